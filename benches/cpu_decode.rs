//! CPU decode throughput on the tiny demo model: one sequence, greedy, tokens/s after a short
//! prompt, measured the same way as tests/oracle/bench_transformers.py measures transformers
//! (prefill, warm-up steps, then N timed single-token decode steps through the KV cache).
//!
//! Run: `cargo bench --bench cpu_decode` (add `-- --tokens N --tp T`).

use kiln_engine::forward::{DecodeItem, Forward};
use kiln_engine::sampling::argmax;
use kiln_runtime::session::{Runner, SessionOptions};
use std::path::PathBuf;
use std::time::Instant;

fn arg(name: &str, default: usize) -> usize {
    let args: Vec<String> = std::env::args().collect();
    args.iter().position(|a| a == name).and_then(|i| args.get(i + 1)).and_then(|v| v.parse().ok()).unwrap_or(default)
}

fn main() {
    let tokens = arg("--tokens", 128);
    let tp = arg("--tp", 1);
    let target = std::env::var("CARGO_TARGET_DIR").map(PathBuf::from).unwrap_or_else(|_| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("target"));
    let ckpt = target.join("bench-tiny");
    kiln_compiler::synth::synth("tiny", &ckpt, 0).expect("synth tiny");
    let opts = kiln_compiler::CompileOptions { target: "cpu".into(), tp, ..Default::default() };
    let compiled = kiln_compiler::compile(&ckpt, &opts).expect("compile");
    let mut runner = Runner::from_plan(compiled.plan, &ckpt, SessionOptions::default()).expect("bind");
    let prompt: Vec<u32> = (0..16).map(|i| 32 + (i * 7) % 90).collect();
    let pages: Vec<u32> = (0..(prompt.len() + tokens + 8).div_ceil(Forward::page_size(&runner)) as u32).collect();
    let mut token = argmax(&Forward::prefill(&mut runner, &pages, 0, &prompt).expect("prefill"));
    let mut pos = prompt.len();
    let step = |runner: &mut Runner, token: &mut u32, pos: &mut usize| {
        let logits = Forward::decode(runner, &[DecodeItem { pages: &pages, pos: *pos, token: *token }]).expect("decode");
        *token = argmax(&logits);
        *pos += 1;
    };
    for _ in 0..2 {
        step(&mut runner, &mut token, &mut pos); // warm-up
    }
    let t = Instant::now();
    for _ in 0..tokens {
        step(&mut runner, &mut token, &mut pos);
    }
    let s = t.elapsed().as_secs_f64();
    println!("kiln cpu decode (tiny, tp{tp}, bf16 W4A4): {:.1} tok/s ({tokens} tokens in {s:.3}s)", tokens as f64 / s);
    println!("{}", serde_json::json!({"impl": "kiln-cpu", "tp": tp, "decode_tok_s": tokens as f64 / s, "prompt_len": prompt.len(), "new_tokens": tokens}));
}
