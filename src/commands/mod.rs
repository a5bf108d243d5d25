pub mod bench;
pub mod compile;
pub mod doctor;
pub mod emu;
pub mod inspect;
pub mod logits;
pub mod quantize;
pub mod run;
pub mod synth;
pub mod serve;
pub mod verify;
pub mod verify_weights;

use kiln_runtime::session::BackendKind;
use std::path::{Path, PathBuf};

/// Where the tokenizer and chat template are read from: the artifact when `kiln compile` copied
/// them there (checked against the manifest), else the checkpoint the weights come from (a
/// prebuilt artifact ships without them; the downloaded checkpoint has them).
pub fn text_files_dir(artifact: &Path, weights: &Path) -> PathBuf {
    if artifact.join("tokenizer.json").is_file() { artifact.to_path_buf() } else { weights.to_path_buf() }
}

/// `--backend`: cpu (the reference backend), emu (the plan's kernels on the PTX emulator;
/// slow, for checking) or cuda (the GPUs).
pub fn backend_kind(name: &str) -> anyhow::Result<BackendKind> {
    match name {
        "cpu" => Ok(BackendKind::Cpu),
        "emu" => Ok(BackendKind::Emu),
        "cuda" => Ok(BackendKind::Cuda),
        other => anyhow::bail!("--backend {other:?}: expected cpu, emu or cuda"),
    }
}

/// `--speculative-ngram K`: prompt-lookup drafts of up to K tokens (0: none).
pub fn speculation(max_draft: usize) -> Option<kiln_engine::speculation::NgramSpeculation> {
    (max_draft > 0).then(|| kiln_engine::speculation::NgramSpeculation::new(max_draft))
}
