//! Compile-time benchmark (criterion): `kiln compile` of the full-size GLM-5-NVFP4 skeleton for
//! `sm_120a --tp 8`, lowering to kernel instances included (ptxas is not run: it is NVIDIA's
//! time, not kiln's). Peak resident memory of one compile is printed after the timing, since
//! criterion measures time only.
//!
//! Run: `cargo bench --bench compile`. The skeleton is synthesised once into target/bench-glm5
//! (sparse files: ~50 MB of headers on disk).

use criterion::{criterion_group, criterion_main, Criterion};
use kiln_compiler::{compile, CompileOptions};
use std::path::PathBuf;
use std::time::Duration;

fn peak_rss_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    Some(line.split_whitespace().nth(1)?.parse::<u64>().ok()? * 1024)
}

/// Resets the kernel's peak-RSS counter so synthesis and criterion's bookkeeping do not count.
fn reset_peak_rss() {
    let _ = std::fs::write("/proc/self/clear_refs", "5");
}

fn skeleton() -> PathBuf {
    let target_dir = std::env::var("CARGO_TARGET_DIR").map(PathBuf::from).unwrap_or_else(|_| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("target"));
    let ckpt = target_dir.join("bench-glm5");
    if !ckpt.join("model.safetensors.index.json").exists() {
        kiln_compiler::synth::synth("glm5", &ckpt, 0).expect("synth glm5");
    }
    ckpt
}

fn compile_glm5(c: &mut Criterion) {
    let ckpt = skeleton();
    let opts = CompileOptions { target: "sm_120a".into(), tp: 8, ..CompileOptions::default() };
    let mut group = c.benchmark_group("compile");
    group.sample_size(10).measurement_time(Duration::from_secs(30));
    group.bench_function("glm5_sm120a_tp8", |b| b.iter(|| compile(&ckpt, &opts).expect("compile")));
    group.finish();
    reset_peak_rss();
    drop(compile(&ckpt, &opts).expect("compile"));
    if let Some(peak) = peak_rss_bytes() {
        println!("compile/glm5_sm120a_tp8 peak RSS: {:.0} MiB", peak as f64 / (1 << 20) as f64);
    }
}

criterion_group!(benches, compile_glm5);
criterion_main!(benches);
