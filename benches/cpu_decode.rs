//! Decode throughput (criterion) of one sequence on the tiny demo model, greedy, measured the
//! way tests/oracle/bench_transformers.py measures transformers: a 16-token prompt prefilled,
//! then single-token decode steps through the KV cache. Two backends over the same checkpoint:
//! - `cpu_decode/tiny_tp1`: the CPU reference backend (default bf16 storage, W4A4);
//! - `emu_decode/tiny_tp1`: the PTX emulator running the plan's sm_120a kernels (emulator
//!   throughput: every launch of a decode step interpreted instruction by instruction).
//!
//! Run: `cargo bench --bench cpu_decode`; criterion reports time per step and tokens/s.

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use kiln_engine::forward::{DecodeItem, Forward};
use kiln_engine::sampling::argmax;
use kiln_runtime::session::{BackendKind, Runner, SessionOptions};
use std::path::PathBuf;
use std::time::Duration;

const PROMPT_LEN: usize = 16;
/// Positions the KV pages cover; the decode position wraps back before it runs out, so every
/// step costs about the same (attention over 16..=PROMPT_LEN + WINDOW positions).
const WINDOW: usize = 256;

fn runner(target: &str, backend: BackendKind) -> Runner {
    let dir = std::env::var("CARGO_TARGET_DIR").map(PathBuf::from).unwrap_or_else(|_| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("target"));
    let ckpt = dir.join("bench-tiny");
    kiln_compiler::synth::synth("tiny", &ckpt, 0).expect("synth tiny");
    let opts = kiln_compiler::CompileOptions { target: target.into(), tp: 1, ..Default::default() };
    let compiled = kiln_compiler::compile(&ckpt, &opts).expect("compile");
    Runner::from_plan(compiled.plan, &ckpt, SessionOptions { backend, ..SessionOptions::default() }).expect("bind")
}

fn bench_decode(c: &mut Criterion, group: &str, mut runner: Runner, measurement: Duration) {
    let prompt: Vec<u32> = (0..PROMPT_LEN as u32).map(|i| 32 + (i * 7) % 90).collect();
    let pages: Vec<u32> = (0..(PROMPT_LEN + WINDOW + 1).div_ceil(Forward::page_size(&runner)) as u32).collect();
    let first = argmax(&Forward::prefill(&mut runner, &pages, 0, &prompt).expect("prefill"));
    let (mut token, mut pos) = (first, PROMPT_LEN);
    let mut g = c.benchmark_group(group);
    g.throughput(Throughput::Elements(1)).sample_size(10).measurement_time(measurement);
    g.bench_function("tiny_tp1", |b| {
        b.iter(|| {
            let logits = Forward::decode(&mut runner, &[DecodeItem { pages: &pages, pos, token }]).expect("decode");
            token = argmax(&logits);
            // Rewriting positions the cache already holds keeps the context bounded.
            pos = if pos + 1 >= PROMPT_LEN + WINDOW { PROMPT_LEN } else { pos + 1 };
        })
    });
    g.finish();
}

fn decode(c: &mut Criterion) {
    bench_decode(c, "cpu_decode", runner("cpu", BackendKind::Cpu), Duration::from_secs(5));
    bench_decode(c, "emu_decode", runner("sm_120a", BackendKind::Emu), Duration::from_secs(20));
}

criterion_group!(benches, decode);
criterion_main!(benches);
