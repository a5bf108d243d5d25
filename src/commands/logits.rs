use anyhow::Context;
use kiln_compiler::checkpoint::safetensors::{write_file, TensorToWrite};
use kiln_runtime::cpu::{ActQuant, CpuOptions, Precision};
use kiln_runtime::plan::DType;
use kiln_runtime::session::{Session, SessionOptions};
use std::path::PathBuf;

/// Run token ids through a plan and write their logits.
///
/// Writes a safetensors file with one tensor, `logits` (F32 `[n, vocab]`, one row per id). By
/// default all ids go through one prefill (in chunks if longer than the largest prefill bucket);
/// --decode feeds them one at a time through the KV cache instead.
#[derive(clap::Args)]
pub struct Args {
    /// Artifact directory written by `kiln compile`.
    artifact: PathBuf,
    /// Checkpoint directory with the weights (default: the one the artifact was compiled from).
    #[arg(long)]
    weights: Option<PathBuf>,
    /// Token ids, comma separated.
    #[arg(long, value_delimiter = ',', required = true)]
    ids: Vec<u32>,
    /// Output safetensors file.
    #[arg(long)]
    out: PathBuf,
    /// Feed the ids one at a time (decode programs) instead of one prefill.
    #[arg(long)]
    decode: bool,
    /// NVFP4 activation quantisation: on (W4A4, as the GPU) or off (W4A16 reference).
    #[arg(long, default_value = "on", value_parser = ["on", "off"])]
    act_quant: String,
    /// Storage precision of BF16 buffers: bf16 (as the GPU) or f32 (for fp32 references).
    #[arg(long, default_value = "bf16", value_parser = ["bf16", "f32"])]
    precision: String,
    /// Execution backend: cpu (reference), emu (the plan's PTX kernels on the emulator; needs an
    /// artifact compiled for a GPU target, and is slow) or cuda (the GPUs; checks the machine
    /// against the plan first; `kiln doctor` tells what a machine has).
    #[arg(long, default_value = "cpu", value_parser = ["cpu", "emu", "cuda"])]
    backend: String,
}

pub fn run(a: Args) -> anyhow::Result<()> {
    let backend = super::backend_kind(&a.backend)?;
    if backend == kiln_runtime::session::BackendKind::Emu && (a.precision != "bf16" || a.act_quant != "on") {
        anyhow::bail!("--precision and --act-quant choose CPU-backend numerics; the emulator runs the compiled kernels (BF16 storage, W4A4)");
    }
    let start = std::time::Instant::now();
    let cpu = CpuOptions {
        precision: if a.precision == "f32" { Precision::F32 } else { Precision::Bf16 },
        act_quant: if a.act_quant == "off" { ActQuant::W4A16 } else { ActQuant::W4A4 },
        attention: None,
    };
    // the plan's prefill programs as compiled (this is the numerics tool): no decode route
    let opts = SessionOptions { cpu, progress: true, backend, prefill_by_decode: Some(false), ..SessionOptions::default() };
    let mut session = Session::open(&a.artifact, a.weights.as_deref(), opts)
        .with_context(|| format!("loading {}", a.artifact.display()))?;
    let logits = session.logits(&a.ids, a.decode)?;
    let vocab = session.vocab_size();
    let bytes: Vec<u8> = logits.iter().flat_map(|v| v.to_le_bytes()).collect();
    let tensor = TensorToWrite { name: "logits".into(), dtype: DType::F32, shape: vec![a.ids.len(), vocab], data: Some(&bytes) };
    write_file(&a.out, &[tensor]).with_context(|| format!("writing {}", a.out.display()))?;
    eprintln!(
        "wrote logits [{}, {vocab}] to {} ({} backend, {}, {} precision, act-quant {}) in {:.2}s",
        a.ids.len(),
        a.out.display(),
        a.backend,
        if a.decode { "decode" } else { "prefill" },
        a.precision,
        a.act_quant,
        start.elapsed().as_secs_f64()
    );
    Ok(())
}
