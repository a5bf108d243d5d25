//! Compile-time benchmark: `kiln compile` of the full-size GLM-5-NVFP4 skeleton for
//! `sm_120a --tp 8`, reporting wall time and peak resident memory.
//!
//! Run: `cargo bench --bench compile` (add `-- --runs N` for more runs). The skeleton is
//! synthesised once into target/bench-glm5 (sparse files: ~50 MB of headers on disk).

use kiln_compiler::{compile, CompileOptions};
use std::path::PathBuf;
use std::time::Instant;

fn peak_rss_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    Some(line.split_whitespace().nth(1)?.parse::<u64>().ok()? * 1024)
}

/// Resets the kernel's peak-RSS counter so synthesis does not count towards compile.
fn reset_peak_rss() {
    let _ = std::fs::write("/proc/self/clear_refs", "5");
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let runs = args.iter().position(|a| a == "--runs").and_then(|i| args.get(i + 1)).and_then(|n| n.parse().ok()).unwrap_or(3usize);
    let target_dir = std::env::var("CARGO_TARGET_DIR").map(PathBuf::from).unwrap_or_else(|_| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("target"));
    let ckpt = target_dir.join("bench-glm5");
    if !ckpt.join("model.safetensors.index.json").exists() {
        let t = Instant::now();
        kiln_compiler::synth::synth("glm5", &ckpt, 0).expect("synth glm5");
        eprintln!("synthesised {} in {:.1}s", ckpt.display(), t.elapsed().as_secs_f64());
    }
    let opts = CompileOptions { target: "sm_120a".into(), tp: 8, ..CompileOptions::default() };
    let mut times = Vec::new();
    let mut peak = 0;
    for _ in 0..runs {
        reset_peak_rss();
        let t = Instant::now();
        let compiled = compile(&ckpt, &opts).expect("compile");
        times.push(t.elapsed().as_secs_f64());
        peak = peak.max(peak_rss_bytes().unwrap_or(0));
        drop(compiled);
    }
    times.sort_by(f64::total_cmp);
    let median = times[times.len() / 2];
    println!(
        "compile glm5 sm_120a tp8: median {median:.2}s (min {:.2}s, max {:.2}s, {runs} runs), peak RSS {:.0} MiB",
        times[0],
        times[times.len() - 1],
        peak as f64 / (1 << 20) as f64
    );
    println!(
        "{}",
        serde_json::json!({"bench": "compile_glm5_sm120a_tp8", "runs": runs, "median_s": median, "min_s": times[0], "peak_rss_bytes": peak})
    );
}
