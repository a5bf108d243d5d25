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

/// `--speculative-draft K`: up to K drafts a step from the plan's draft model (0: none), where
/// the plan has one.
pub fn draft_model(max_draft: usize, ngram: usize, plan: &kiln_runtime::plan::Plan) -> anyhow::Result<Option<usize>> {
    if max_draft == 0 {
        return Ok(None);
    }
    if ngram > 0 {
        anyhow::bail!("--speculative-draft {max_draft} and --speculative-ngram {ngram}: choose one source of drafts");
    }
    if !plan.has_draft() {
        anyhow::bail!("--speculative-draft: the artifact has no draft model; compile it with --draft mtp from a checkpoint that has the MTP layer");
    }
    Ok(Some(max_draft))
}

/// `--speculative-ngram K`: prompt-lookup drafts of up to K tokens (0: none).
pub fn speculation(max_draft: usize) -> Option<kiln_engine::speculation::NgramSpeculation> {
    (max_draft > 0).then(|| kiln_engine::speculation::NgramSpeculation::new(max_draft))
}
