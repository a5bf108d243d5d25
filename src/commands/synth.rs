use kiln_compiler::error::human_bytes;
use std::path::PathBuf;

/// Write a deterministic synthetic checkpoint.
///
/// `tiny`: a small random GLM-5-layout model with real ModelOpt NVFP4 experts, shared experts and
/// dense MLP, BF16 elsewhere, a byte-level tokenizer and the GLM-5 chat template (tests, demo).
/// `micro`: the same at the smallest shapes the kernels take (2 layers, hidden 96), for runs on
/// the PTX emulator or the driver double. `glm5`: the full-size GLM-5-NVFP4 tensor table as header-only shards whose data are sparse
/// holes, so the real 744B geometry compiles on any machine.
#[derive(clap::Args)]
pub struct Args {
    /// Preset: tiny, micro or glm5.
    preset: String,
    /// Output checkpoint directory (created).
    #[arg(short, long)]
    out: PathBuf,
    /// Seed of the random weights (tiny and micro).
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// glm5 only: keep the first N decoder layers (GLM-5's first 3 are dense, the rest MoE) and
    /// add the byte-level stand-in tokenizer, so the real layer shapes fit one GPU and can be
    /// run and timed. The weights stay zeros.
    #[arg(long, value_name = "N")]
    layers: Option<usize>,
}

pub fn run(a: Args) -> anyhow::Result<()> {
    let start = std::time::Instant::now();
    let report = match a.layers {
        None => kiln_compiler::synth::synth(&a.preset, &a.out, a.seed)?,
        Some(n) if a.preset == "glm5" => kiln_compiler::synth::synth_glm5_slice(&a.out, n)?,
        Some(_) => anyhow::bail!("--layers cuts the glm5 skeleton; preset {:?} has its own fixed layer count", a.preset),
    };
    eprintln!(
        "wrote {} ({} tensors in {} shards, {} of tensor data) in {:.2}s",
        a.out.display(),
        report.tensors,
        report.files,
        human_bytes(report.data_bytes),
        start.elapsed().as_secs_f64()
    );
    Ok(())
}
