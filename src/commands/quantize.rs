use kiln_compiler::error::human_bytes;
use std::path::PathBuf;

/// Quantise a trained BF16 glm_moe_dsa checkpoint to ModelOpt NVFP4.
///
/// NVFP4 where NVIDIA's GLM-5-NVFP4 quantises (dense MLP, routed and shared experts: U8 codes,
/// F8_E4M3 block scales, F32 weight_scale_2 and input_scale), BF16 elsewhere, written with the
/// same tensor table and writer as `kiln synth`. Each input_scale is the module's calibrated
/// input amax / (6 * 448), as ModelOpt's max calibration sets it; the amax values come from
/// --calibration (scripts/demo_model/train.py measures them with the trained weights).
///
/// Example: kiln quantize target/demo-train/bf16 --calibration target/demo-train/calibration.json -o artifacts/demo-model
#[derive(clap::Args)]
pub struct Args {
    /// The BF16 checkpoint directory (config.json, safetensors, tokenizer files).
    source: PathBuf,
    /// JSON object: quantised module name -> the amax of its input over the calibration data.
    #[arg(long)]
    calibration: PathBuf,
    /// Output checkpoint directory (created).
    #[arg(short, long)]
    out: PathBuf,
}

pub fn run(a: Args) -> anyhow::Result<()> {
    let start = std::time::Instant::now();
    let report = kiln_compiler::synth::quantize(&a.source, &a.calibration, &a.out)?;
    eprintln!(
        "wrote {} ({} tensors in {} shards, {} linears in NVFP4, {} of tensor data) in {:.2}s",
        a.out.display(),
        report.written.tensors,
        report.written.files,
        report.quantised,
        human_bytes(report.written.data_bytes),
        start.elapsed().as_secs_f64()
    );
    Ok(())
}
