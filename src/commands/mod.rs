pub mod bench;
pub mod compile;
pub mod emu;
pub mod inspect;
pub mod logits;
pub mod run;
pub mod synth;
pub mod serve;
pub mod verify;

use kiln_runtime::session::BackendKind;

/// `--backend`: cpu (the reference backend) or emu (the plan's kernels on the PTX emulator;
/// slow, for checking); cuda is refused until the CUDA backend exists.
pub fn backend_kind(name: &str) -> anyhow::Result<BackendKind> {
    match name {
        "cpu" => Ok(BackendKind::Cpu),
        "emu" => Ok(BackendKind::Emu),
        "cuda" => anyhow::bail!("--backend cuda: the CUDA backend is not built yet (there is no GPU here); use cpu, or emu to run the compiled kernels on the PTX emulator"),
        other => anyhow::bail!("--backend {other:?}: expected cpu, emu or cuda"),
    }
}
