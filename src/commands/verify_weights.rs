use kiln_runtime::bind::human;
use kiln_runtime::plan::read_artifact;
use kiln_runtime::session::weights_dir;
use kiln_runtime::weight_check::{scan_checkpoint, WEIGHT_HASHES_FILE};
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
    let report = scan_checkpoint(&plan, Some(&a.artifact), &dir, true)?.into_result()?;
    println!("{} tensors ({}) in {}: no NaN or Inf", report.tensors, human(report.bytes), dir.display());
    if report.hashed {
        println!("every tensor matches the SHA-256 recorded at compile time");
    } else {
        println!("no content hashes recorded ({WEIGHT_HASHES_FILE} absent): compile with --hash-weights to check the bytes too");
    }
    println!("checked in {:.2}s", start.elapsed().as_secs_f64());
    Ok(())
}
