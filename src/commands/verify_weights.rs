use kiln_runtime::bind::CheckpointFiles;
use kiln_runtime::plan::read_artifact;
use kiln_runtime::session::weights_dir;
use kiln_runtime::weight_check::{recorded_hashes, scan, tensor_progress, WEIGHT_HASHES_FILE};
use std::path::PathBuf;

/// Check a checkpoint's weight data against an artifact.
///
/// Checks every tensor the plan binds: its header against the plan (name, dtype, shape, as every
/// bind does), its data for NaN and Inf (BF16, F16, F32 and the FP8 E4M3 block scales; packed FP4
/// has no such codes), and, when the artifact was compiled with `kiln compile --hash-weights`, its
/// bytes against the SHA-256 recorded then. Reads the whole checkpoint; exits non-zero naming
/// every bad tensor. `kiln run`/`kiln serve --check-weights` run the same checks before binding.
#[derive(clap::Args)]
pub struct Args {
    /// Artifact directory written by `kiln compile`.
    artifact: PathBuf,
    /// Checkpoint directory with the weights (default: the one the artifact was compiled from).
    #[arg(long)]
    weights: Option<PathBuf>,
}

pub fn run(a: Args) -> anyhow::Result<()> {
    let start = std::time::Instant::now();
    let plan = read_artifact(&a.artifact)?;
    let dir = weights_dir(&a.artifact, a.weights.as_deref())?;
    let recorded = recorded_hashes(&a.artifact)?;
    let files = CheckpointFiles::open(&dir)?;
    let bar = tensor_progress(&plan, true, "checking weights {bar:40} {bytes}/{total_bytes}");
    let report = scan(&plan, &files, recorded.as_ref(), &bar)?;
    bar.finish_and_clear();
    let tensors = report.tensors;
    let size = match report.bytes as f64 {
        b if b >= (1u64 << 30) as f64 => format!("{:.2} GiB", b / (1u64 << 30) as f64),
        b => format!("{:.2} MiB", b / (1u64 << 20) as f64),
    };
    let hashed = report.hashed;
    report.into_result()?;
    println!("{tensors} tensors ({size}) in {}: no NaN or Inf", dir.display());
    if hashed {
        println!("every tensor matches the SHA-256 recorded at compile time");
    } else {
        println!("no content hashes recorded ({WEIGHT_HASHES_FILE} absent): compile with --hash-weights to check the bytes too");
    }
    println!("checked in {:.2}s", start.elapsed().as_secs_f64());
    Ok(())
}
