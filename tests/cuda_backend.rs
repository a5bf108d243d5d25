//! `--backend cuda` end to end through the driver double (`scripts/with-cuda-double.sh`: a
//! `libcuda.so` + `libnccl.so` that run every kernel in the PTX emulator), so the exact host
//! code that drives real GPUs (cudarc, graphs, NCCL, pinned copies) runs in every test run.
//!
//! Expectations: the emulator backend, which executes the same kernels with the collectives
//! summed on the host in rank order. The double's NCCL sums in rank order in f32 as well, so
//! logits must agree bit for bit at every tensor-parallel degree (on real GPUs NCCL's summation
//! order differs: there the gpu-check script compares against the CPU backend with tolerances).
//! Without a driver, every CUDA command must fail with a message naming the missing driver and
//! never panic; machines that do not fit a plan are refused before anything is allocated.

mod common;

use common::serve::{self as serve_child, http, openai_client_suite, Server};
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// The double's library directory (built once by the script when CI has not already).
fn double_dir() -> PathBuf {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        if let Some(d) = std::env::var_os("KILN_CUDA_DOUBLE_DIR").map(PathBuf::from).filter(|d| d.join("libcuda.so").exists()) {
            return d;
        }
        let o = Command::new("bash").arg(root().join("scripts/with-cuda-double.sh")).arg("true").env("KILN_CUDA_DOUBLE_FORCE", "1").output().expect("run with-cuda-double.sh");
        assert!(o.status.success(), "building the driver double failed:\n{}", String::from_utf8_lossy(&o.stderr));
        let target = std::env::var_os("CARGO_TARGET_DIR").map(PathBuf::from).unwrap_or_else(|| root().join("target"));
        target.join("cuda-double")
    })
    .clone()
}

fn kiln() -> Command {
    Command::new(env!("CARGO_BIN_EXE_kiln"))
}

/// kiln with the double as its driver (plus `env`).
fn kiln_cuda(env: &[(&str, &str)]) -> Command {
    let mut c = kiln();
    c.env("LD_LIBRARY_PATH", double_dir());
    for (k, v) in env {
        c.env(k, v);
    }
    c
}

fn run_ok(mut c: Command, what: &str) -> Output {
    let o = c.output().expect("run kiln");
    assert!(o.status.success(), "{what} failed:\nstdout:\n{}\nstderr:\n{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
    o
}

fn scratch(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("kiln-cuda-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn golden_ckpt() -> PathBuf {
    root().join("tests/goldens/nvfp4_flatcfg/ckpt")
}

/// Compiles for sm_120a (with cubins when ptxas is there: scripts/test.sh provides it).
fn compile(ckpt: &Path, tp: usize, extra: &[&str], out: &Path) {
    let mut c = kiln();
    c.arg("compile").arg(ckpt).args(["--target", "sm_120a", "--tp", &tp.to_string(), "-o"]).arg(out).args(extra);
    run_ok(c, "kiln compile");
}

fn logits(art: &Path, backend: &str, ids: &str, decode: bool, out: &Path) -> (Vec<u8>, String) {
    let mut c = if backend == "cuda" { kiln_cuda(&[]) } else { kiln() };
    c.arg("logits").arg(art).args(["--ids", ids, "--backend", backend, "--out"]).arg(out);
    if decode {
        c.arg("--decode");
    }
    let o = run_ok(c, &format!("kiln logits --backend {backend}"));
    (std::fs::read(out).unwrap(), String::from_utf8_lossy(&o.stderr).into_owned())
}

fn assert_same(what: &str, a: &[u8], b: &[u8]) {
    assert_eq!(a.len(), b.len(), "{what}: different file sizes");
    let first = a.iter().zip(b).position(|(x, y)| x != y);
    assert!(first.is_none(), "{what}: logits differ from byte {}", first.unwrap_or(0));
}

#[test]
fn cuda_equals_the_emulator_bit_for_bit_at_tp1_and_tp2_prefill_and_decode() {
    let dir = scratch("bits");
    // 40 ids: the prefill takes two chunks of the 32-token program.
    let ids: String = (0..40).map(|i| ((i * 37 + 5) % 384).to_string()).collect::<Vec<_>>().join(",");
    let ids = ids.as_str();
    for tp in [1, 2] {
        let art = dir.join(format!("tp{tp}"));
        // every replicated projection split, each with a whole copy that the tiny model's prefill
        // and decode compute from (its gathers cost more than its few KiB of weights; the
        // gathers themselves: `p2p_collectives_only_where_the_peers_pass_the_probe`), and the
        // prefill's indexer lists selected across the ranks and gathered: at TP 2 both backends
        // run the P2P gather kernel too
        let flags = ["--prefill-chunk", "32", "--decode-batches", "1,2", "--max-context", "64", "--split-projections", "all", "--sequence-parallel-indexer", "always"];
        compile(&golden_ckpt(), tp, &flags, &art);
        for decode in [false, true] {
            let (cuda, log) = logits(&art, "cuda", ids, decode, &dir.join(format!("cuda{tp}{decode}.safetensors")));
            let (emu, _) = logits(&art, "emu", ids, decode, &dir.join(format!("emu{tp}{decode}.safetensors")));
            assert_same(&format!("TP {tp}, {}", if decode { "decode" } else { "prefill" }), &cuda, &emu);
            // Start-up reports what it measured, and at TP 2 that the all-reduces use the P2P
            // kernel (the double's peers pass the probe)
            assert!(log.contains("GB/s") && log.contains("CUDA graphs") && log.contains("allocated as planned"), "{log}");
            assert_eq!(log.contains("all-reduces up to 128 KiB (two-shot above 64 KiB) and all-gathers up to 64 KiB per GPU: the P2P kernel (all 2 GPU pairs passed"), tp == 2, "{log}");
        }
    }
}

/// `--indexer-keys fp8` on the CUDA backend: the cache it allocates holds the FP8 layout's rows
/// (codes and scales after the rope key), and a prefill past `index_topk` then a decode step score
/// those keys: the emulator's logits bit for bit at TP 2.
#[test]
fn fp8_indexer_keys_on_cuda_equal_the_emulator() {
    let dir = scratch("fp8-keys");
    let art = dir.join("art");
    let ids: String = (0..24).map(|i| ((i * 37 + 5) % 384).to_string()).collect::<Vec<_>>().join(",");
    compile(&golden_ckpt(), 2, &["--prefill-chunk", "32", "--decode-batches", "1,2", "--max-context", "64", "--indexer-keys", "fp8"], &art);
    for decode in [false, true] {
        let (cuda, _) = logits(&art, "cuda", &ids, decode, &dir.join(format!("cuda{decode}.safetensors")));
        let (emu, _) = logits(&art, "emu", &ids, decode, &dir.join(format!("emu{decode}.safetensors")));
        assert_same(&format!("FP8 keys, {}", if decode { "decode" } else { "prefill" }), &cuda, &emu);
    }
}

/// Small all-reduces and all-gathers take the one-shot P2P kernel only where every GPU pair
/// passes the peer write-and-verify probe: with `KILN_P2P=off`, or on a fabric that grants peer
/// access but drops the writes (`KILN_DOUBLE_P2P=drop`), or without peer capability, they stay on
/// NCCL, and every way gives the same logits (rank-order sums and row-by-row gathers on all
/// paths), the same as the plan that keeps its projections replicated; a bad `KILN_P2P` is
/// refused.
#[test]
fn p2p_collectives_only_where_the_peers_pass_the_probe() {
    let dir = scratch("p2p");
    let art = dir.join("tp2");
    let flags = ["--prefill-chunk", "32", "--decode-batches", "1", "--max-context", "64"];
    // the split plan gathers its projections at decode and prefill (no whole copies, which the
    // tiny model would compute from instead) and selects its prefill's indexer lists across the
    // ranks (gathered I32 lists: P2P or NCCL), the replicated one on every rank
    compile(&golden_ckpt(), 2, &[&flags[..], &["--split-projections", "all", "--prefill-copies", "none", "--sequence-parallel-indexer", "always"]].concat(), &art);
    let replicated = dir.join("tp2-replicated");
    compile(&golden_ckpt(), 2, &[&flags[..], &["--split-projections", "none", "--sequence-parallel-indexer", "never"]].concat(), &replicated);
    let ids = "5,42,7,300,12,9";
    let mut outputs = Vec::new();
    for (env, want) in [
        (vec![], "the P2P kernel (all 2 GPU pairs passed the peer write-and-verify probe)"),
        (vec![("KILN_P2P", "off")], "NCCL (KILN_P2P=off)"),
        (vec![("KILN_DOUBLE_P2P", "drop")], "NCCL (GPU 0 -> GPU 1: Lost"),
        (vec![("KILN_DOUBLE_P2P", "off")], "NCCL (GPU 0 -> GPU 1: Unsupported"),
    ] {
        let out = dir.join(format!("{}.safetensors", outputs.len()));
        let mut c = kiln_cuda(&env);
        c.arg("logits").arg(&art).args(["--ids", ids, "--decode", "--backend", "cuda", "--out"]).arg(&out);
        let o = run_ok(c, &format!("kiln logits with {env:?}"));
        let log = String::from_utf8_lossy(&o.stderr);
        assert!(log.contains(&format!("and all-gathers up to 64 KiB per GPU: {want}")), "{env:?}: {log}");
        // on NCCL the split projections' gathers cost more than they save, and start-up says so
        assert_eq!(log.contains("recompile with --split-projections none"), !outputs.is_empty(), "{env:?}: {log}");
        outputs.push(std::fs::read(&out).unwrap());
    }
    for (i, o) in outputs.iter().enumerate().skip(1) {
        assert_same(&format!("path {i} against the P2P kernel"), o, &outputs[0]);
    }
    let out = dir.join("replicated.safetensors");
    let mut c = kiln_cuda(&[]);
    c.arg("logits").arg(&replicated).args(["--ids", ids, "--decode", "--backend", "cuda", "--out"]).arg(&out);
    run_ok(c, "kiln logits of the replicated plan");
    assert_same("the replicated plan against the split one", &std::fs::read(&out).unwrap(), &outputs[0]);
    let mut c = kiln_cuda(&[("KILN_P2P", "nvlink")]);
    c.arg("logits").arg(&art).args(["--ids", "1", "--backend", "cuda", "--out"]).arg(dir.join("x.safetensors"));
    let o = c.output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && err.contains("KILN_P2P") && err.contains("\"nvlink\"") && !err.contains("panicked"), "{err}");
}

/// A decode batch of 384 tokens of hidden 96 at TP 2 all-reduces 73,728 B (BF16) a step: more
/// than the one-shot form's 64 KiB, so the P2P kernel's two-shot form (each GPU sums its half,
/// then copies its peer's half), followed on the P2P path too by the residual add and norm
/// launches it leaves to them. On the double it must give NCCL's bits (both sum in rank order in
/// f32), and the emulator backend's (which runs the same kernel and launches after it).
#[test]
fn two_shot_p2p_all_reduces_give_nccl_bits() {
    let dir = scratch("two-shot");
    let art = dir.join("tp2");
    compile(&golden_ckpt(), 2, &["--prefill-chunk", "32", "--decode-batches", "384", "--max-context", "64"], &art);
    let plan = kiln_runtime::plan::read_plan(&art).unwrap();
    let two_shot = plan.kernels.iter().filter(|k| k.template == "p2p_collective" && k.param("TWO_SHOT") == Some(1)).count();
    assert!(two_shot >= 1, "no two-shot P2P kernel in the batch-384 plan");
    let leaves = plan.programs.iter().flat_map(|p| &p.steps).filter(|s| !s.after_p2p(&plan).is_empty()).count();
    assert!(leaves >= 1, "no P2P collective of the batch-384 plan leaves its add and norm to their launches");
    // a prefill and two decode steps: each step's all-reduces are two-shot
    let ids = "5,42,7";
    let mut outputs = Vec::new();
    for env in [vec![], vec![("KILN_P2P", "off")]] {
        let out = dir.join(format!("{}.safetensors", outputs.len()));
        let mut c = kiln_cuda(&env);
        c.arg("logits").arg(&art).args(["--ids", ids, "--decode", "--backend", "cuda", "--out"]).arg(&out);
        let o = run_ok(c, &format!("kiln logits with {env:?}"));
        let log = String::from_utf8_lossy(&o.stderr);
        assert!(log.contains(if env.is_empty() { "per GPU: the P2P kernel" } else { "per GPU: NCCL" }), "{env:?}: {log}");
        outputs.push(std::fs::read(&out).unwrap());
    }
    assert_same("the two-shot P2P kernel against NCCL", &outputs[0], &outputs[1]);
    let (emu, _) = logits(&art, "emu", ids, true, &dir.join("emu.safetensors"));
    assert_same("the two-shot P2P kernel against the emulator backend", &outputs[0], &emu);
}

/// `KILN_UPLOAD_STAGING=cached` uploads the weights through cached instead of write-combined
/// pinned staging (for GPU checks in VMs): the same weights, so the same logits; the log names
/// the staging; any other value is refused before any GPU work, naming the variable.
#[test]
fn upload_staging_is_chosen_by_the_environment() {
    let dir = scratch("staging");
    let art = dir.join("tp1");
    compile(&golden_ckpt(), 1, &["--prefill-chunk", "32", "--decode-batches", "1", "--max-context", "64"], &art);
    let mut outputs = Vec::new();
    for staging in ["write-combined", "cached"] {
        let out = dir.join(format!("{staging}.safetensors"));
        let mut c = kiln_cuda(&[("KILN_UPLOAD_STAGING", staging)]);
        c.arg("logits").arg(&art).args(["--ids", "1,2,3,4,5", "--backend", "cuda", "--out"]).arg(&out);
        let o = run_ok(c, &format!("kiln logits with {staging} staging"));
        let log = String::from_utf8_lossy(&o.stderr);
        assert!(log.contains(&format!("GB/s, {staging} staging)")), "{log}");
        outputs.push(std::fs::read(&out).unwrap());
    }
    assert_same("cached against write-combined staging", &outputs[1], &outputs[0]);
    let mut c = kiln_cuda(&[("KILN_UPLOAD_STAGING", "uncached")]);
    c.arg("logits").arg(&art).args(["--ids", "1", "--backend", "cuda", "--out"]).arg(dir.join("x.safetensors"));
    let o = c.output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && err.contains("KILN_UPLOAD_STAGING") && err.contains("\"uncached\"") && !err.contains("panicked"), "{err}");
    assert!(!err.contains("the CUDA backend has stopped"), "a setting is not a GPU failure: {err}");
}

#[test]
fn cuda_equals_the_emulator_at_tp8() {
    let dir = scratch("tp8");
    let ckpt = dir.join("ckpt");
    run_ok({
        let mut c = kiln();
        c.args(["synth", "tiny", "-o"]).arg(&ckpt);
        c
    }, "kiln synth");
    let art = dir.join("art");
    compile(&ckpt, 8, &["--prefill-chunk", "4", "--decode-batches", "1", "--max-context", "16"], &art);
    let (cuda, log) = logits(&art, "cuda", "3,1,4,1", false, &dir.join("cuda.safetensors"));
    let (emu, _) = logits(&art, "emu", "3,1,4,1", false, &dir.join("emu.safetensors"));
    assert_same("TP 8 prefill", &cuda, &emu);
    assert!(log.contains("8 GPU(s)") && log.contains("the P2P kernel (all 56 GPU pairs passed"), "{log}");
}

#[test]
fn verify_on_the_gpu_passes_step_by_step() {
    let dir = scratch("verify");
    let art = dir.join("art");
    compile(&golden_ckpt(), 2, &["--prefill-chunk", "16", "--decode-batches", "1", "--max-context", "32"], &art);
    let mut c = kiln_cuda(&[]);
    c.arg("verify").arg(&art).args(["--backend", "cuda"]);
    let o = run_ok(c, "kiln verify --backend cuda");
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(out.contains("on GPU 0 (CUDA") && out.contains("first step beyond tolerance: none"), "{out}");
    assert!(!out.contains("FAIL"), "{out}");
}

/// The demo model's trained MTP layer as a draft model (`--draft mtp-nvfp4`, TP 2) on the CUDA
/// backend: `verify --backend cuda` checks every program, the draft programs' steps included
/// (their hidden rows in as the CPU had them), and `kiln run --speculative-draft 2` replays the
/// draft graphs with the model's hidden rows read back and written in by the backend: the same
/// reply, drafts and accepted drafts as the emulator backend (bit for bit, as everywhere on the
/// double), with drafts accepted (a draft fed wrong hidden rows would be right by chance only).
#[test]
fn the_mtp_draft_model_runs_on_cuda() {
    let dir = scratch("draft");
    let art = dir.join("art");
    let flags = ["--draft", "mtp-nvfp4", "--prefill-chunk", "16", "--decode-batches", "1,2", "--max-context", "64"];
    compile(&root().join("artifacts/demo-model"), 2, &flags, &art);
    let mut c = kiln_cuda(&[]);
    c.arg("verify").arg(&art).args(["--backend", "cuda"]);
    let out = String::from_utf8_lossy(&run_ok(c, "kiln verify --backend cuda").stdout).into_owned();
    assert!(out.contains("program draft_2") && out.contains("first step beyond tolerance: none") && !out.contains("FAIL"), "{out}");
    let run = |backend: &str| {
        let mut c = if backend == "cuda" { kiln_cuda(&[]) } else { kiln() };
        c.arg("run").arg(&art).args(["--backend", backend, "--prompt", "What is the capital of France?", "--max-tokens", "8", "--speculative-draft", "2"]);
        let o = run_ok(c, &format!("kiln run --backend {backend} --speculative-draft 2"));
        let err = String::from_utf8_lossy(&o.stderr).into_owned();
        let stats = err.lines().find(|l| l.starts_with("[speculative decoding:")).unwrap_or_else(|| panic!("no draft statistics:\n{err}")).to_string();
        (String::from_utf8_lossy(&o.stdout).into_owned(), stats)
    };
    let (cuda, cuda_stats) = run("cuda");
    let (emu, emu_stats) = run("emu");
    assert_eq!(cuda, emu, "the reply");
    assert_eq!(cuda_stats, emu_stats, "drafts checked and accepted");
    let accepted: usize = cuda_stats.split(", ").nth(1).and_then(|a| a.split_whitespace().next()).and_then(|n| n.parse().ok()).expect("accepted count");
    assert!(accepted > 0, "{cuda_stats}");
}

/// A machine with no CUDA driver at all (the double's directory is not on the path).
fn driverless() -> Option<Command> {
    if Path::new("/dev/nvidiactl").exists() {
        eprintln!("this machine has an NVIDIA driver: skipping the no-driver checks");
        return None;
    }
    let mut c = kiln();
    c.env("LD_LIBRARY_PATH", scratch("nodriver"));
    Some(c)
}

#[test]
fn without_a_driver_every_cuda_command_fails_naming_it() {
    // A model with a tokenizer, so that `run` and `serve` get as far as the GPU.
    let art = micro_artifact("nodriver-art", "1", &["--no-ptxas", "--max-context", "64"]);
    let dir = art.parent().unwrap().to_path_buf();
    let a = art.to_str().unwrap();
    let out = dir.join("x.safetensors");
    let cases: Vec<Vec<&str>> = vec![
        vec!["logits", a, "--ids", "1,2", "--backend", "cuda", "--out", out.to_str().unwrap()],
        vec!["run", a, "--prompt", "hi", "--max-tokens", "2", "--backend", "cuda"],
        vec!["serve", a, "--port", "0", "--backend", "cuda"],
        vec!["verify", a, "--backend", "cuda"],
        vec!["doctor"],
        vec!["doctor", a, "--json"],
    ];
    for args in cases {
        let Some(mut c) = driverless() else { return };
        let o = c.args(&args).stdin(Stdio::null()).output().unwrap();
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success(), "kiln {args:?} succeeded without a driver");
        assert!(err.contains("libcuda"), "kiln {args:?} does not name the driver:\n{err}");
        assert!(!err.contains("panicked"), "kiln {args:?} panicked:\n{err}");
    }
}

#[test]
fn doctor_reports_gpus_p2p_and_whether_an_artifact_fits() {
    let dir = scratch("doctor");
    let art = dir.join("art");
    compile(&golden_ckpt(), 2, &["--prefill-chunk", "16", "--decode-batches", "1", "--max-context", "32", "--no-ptxas"], &art);
    let mut c = kiln_cuda(&[]);
    c.arg("doctor").arg(&art).arg("--json");
    let o = run_ok(c, "kiln doctor");
    let j: serde_json::Value = serde_json::from_slice(&o.stdout).expect("doctor --json prints JSON");
    let gpus = j["gpus"].as_array().unwrap();
    assert_eq!(gpus.len(), 8);
    assert_eq!(gpus[0]["compute_capability"], serde_json::json!([12, 0]));
    assert_eq!(gpus[0]["sms"], 188);
    let p2p = j["p2p"].as_array().unwrap();
    assert_eq!(p2p.len(), 56, "every ordered pair");
    assert!(p2p.iter().all(|p| p["result"] == "ok"));
    assert_eq!(j["artifact"]["runnable"], true);
    assert_eq!(j["nccl_version"], "2.30.7");

    // Peer access granted but writes lost (as on some VMs): named, and a non-zero exit.
    let mut c = kiln_cuda(&[("KILN_DOUBLE_P2P", "drop"), ("KILN_DOUBLE_GPUS", "2")]);
    let o = c.arg("doctor").output().unwrap();
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(!o.status.success() && out.contains("GPU 0 -> GPU 1: lost"), "{out}");
    // No peer capability at all is reported, not an error.
    let mut c = kiln_cuda(&[("KILN_DOUBLE_P2P", "off"), ("KILN_DOUBLE_GPUS", "2")]);
    let o = c.arg("doctor").output().unwrap();
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success() && out.contains("unsupported") && out.contains("0 of 2 pairs ok"), "{out}");
}

#[test]
fn machines_that_do_not_fit_the_plan_are_refused_naming_expected_and_found() {
    let dir = scratch("mismatch");
    let art = dir.join("art");
    compile(&golden_ckpt(), 2, &["--prefill-chunk", "16", "--decode-batches", "1", "--max-context", "32", "--no-ptxas"], &art);
    // (the simulated machine, what the refusal must say)
    type Case<'a> = (&'a [(&'a str, &'a str)], &'a [&'a str]);
    let cases: [Case; 4] = [
        (&[("KILN_DOUBLE_ARCH", "sm_90a")], &["compute capability 9.0", "only on 12.0"]),
        (&[("KILN_DOUBLE_GPUS", "1")], &["needs 2 GPU(s)", "reports 1"]),
        (&[("KILN_DOUBLE_MEMORY", "2GiB")], &["2.00 GiB of memory", "the plan needs"]),
        (&[("KILN_DOUBLE_DRIVER_VERSION", "12040")], &["ISA 8.7", "CUDA 12.8", "supports CUDA 12.4"]),
    ];
    for (env, expect) in cases {
        let mut c = kiln_cuda(env);
        let o = c.arg("logits").arg(&art).args(["--ids", "1", "--backend", "cuda", "--out"]).arg(dir.join("x.safetensors")).output().unwrap();
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success(), "{env:?} was accepted");
        for e in expect {
            assert!(err.contains(e), "{env:?}: expected {e:?} in:\n{err}");
        }
        assert!(!err.contains("panicked"), "{err}");
    }
}

fn serve(art: &Path, env: &[(&str, &str)]) -> Server {
    let mut c = kiln_cuda(env);
    c.arg("serve").arg(art).args(["--served-model-name", "kiln-tiny", "--backend", "cuda", "--enable-test-hooks"]);
    serve_child::start(c, Duration::from_secs(120))
}

/// The `micro` synthetic model (the demo model's tokenizer and chat template at the smallest
/// shapes: the emulator behind the double runs every kernel, so serving must stay cheap) at TP 2.
fn micro_artifact(name: &str, decode_batches: &str, extra: &[&str]) -> PathBuf {
    let dir = scratch(name);
    let ckpt = dir.join("ckpt");
    run_ok({
        let mut c = kiln();
        c.args(["synth", "micro", "-o"]).arg(&ckpt);
        c
    }, "kiln synth");
    let art = dir.join("art");
    let mut args = vec!["--prefill-chunk", "128", "--decode-batches", decode_batches];
    args.extend_from_slice(extra);
    compile(&ckpt, 2, &args, &art);
    art
}

#[test]
fn a_gpu_fault_fails_the_request_marks_health_and_never_hangs() {
    let art = micro_artifact("fault", "1,2", &[]);
    // Capture executes nothing: kernel 5 is the fifth of the first request's prefill.
    let server = serve(&art, &[("KILN_DOUBLE_FAULT_AT_LAUNCH", "5")]);
    let t = Instant::now();
    let (status, body) = http(server.port, "POST", "/v1/completions", r#"{"model": "kiln-tiny", "prompt": "Hello", "max_tokens": 4}"#);
    assert!(t.elapsed() < Duration::from_secs(120), "the failed request took {:?}", t.elapsed());
    assert_eq!(status, 503, "{body}");
    assert!(body.contains("CUDA_ERROR_ILLEGAL_ADDRESS"), "the error names the fault: {body}");
    let (status, body) = http(server.port, "GET", "/health", "");
    assert_eq!(status, 503, "{body}");
    assert!(body.contains("backend failed"), "{body}");
    // Later requests fail at once instead of waiting on a dead GPU.
    let t = Instant::now();
    let (status, body) = http(server.port, "POST", "/v1/completions", r#"{"model": "kiln-tiny", "prompt": "Hi", "max_tokens": 2}"#);
    assert_eq!(status, 503, "{body}");
    assert!(t.elapsed() < Duration::from_secs(5));
}

#[test]
fn serve_on_cuda_answers_the_openai_client() {
    let art = micro_artifact("openai", "1,2,4,8,16,32", &[]);
    let server = serve(&art, &[]);
    // The tool-call parsing (test_tools: five forced replies of ~60 tokens, a third of this
    // test's time on the emulator) runs after the backend, the same on every backend, and
    // tests/server.rs runs it on the CPU backend; the rest (batched decode up to 32, streams,
    // disconnects returning KV pages) is the CUDA backend's to pass here.
    openai_client_suite(server.port, "--backend cuda on the driver double", &["test_tools"]);
}

/// The GPU check script, rehearsed on the double as CI does (it adapts to the emulator's speed:
/// the `micro` model, small buckets), for both GPUs it may meet (an RTX PRO 6000 and the H200
/// some tasks are lent), leaves its report in $OUT; without a GPU it refuses.
#[test]
fn gpu_check_quick_passes_on_the_double_and_refuses_without_a_gpu() {
    for arch in ["sm_120a", "sm_90a"] {
        gpu_check_on_the_double(arch);
    }
    let Some(_) = driverless() else { return };
    let o = Command::new("bash")
        .arg(root().join("scripts/gpu-check.sh"))
        .arg("--quick")
        .env("KILN_BIN", env!("CARGO_BIN_EXE_kiln"))
        .env("LD_LIBRARY_PATH", scratch("gpu-check-nodriver"))
        .env("OUT", scratch("gpu-check-none"))
        .output()
        .unwrap();
    assert!(!o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr).contains("no usable GPU"), "{}", String::from_utf8_lossy(&o.stderr));
}

fn gpu_check_on_the_double(arch: &str) {
    let out = scratch(&format!("gpu-check-{arch}"));
    let o = Command::new("bash")
        .arg(root().join("scripts/with-cuda-double.sh"))
        .arg("bash")
        .arg(root().join("scripts/gpu-check.sh"))
        .arg("--quick")
        .env("KILN_BIN", env!("CARGO_BIN_EXE_kiln"))
        .env("KILN_CUDA_DOUBLE_NO_BUILD", "1")
        .env("KILN_CUDA_DOUBLE_FORCE", "1")
        .env("CARGO_TARGET_DIR", double_dir().parent().unwrap())
        .env("KILN_DOUBLE_ARCH", arch)
        .env("OUT", &out)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "gpu-check on {arch} failed:\n{stdout}\n{}", String::from_utf8_lossy(&o.stderr));
    assert!(stdout.trim_end().lines().last().unwrap_or("").starts_with("gpu-check: PASS"), "{stdout}");
    let summary: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(out.join("summary.json")).unwrap()).unwrap();
    assert_eq!(summary["passed"], true);
    let stages: Vec<&str> = summary["stages"].as_array().unwrap().iter().map(|s| s["stage"].as_str().unwrap()).collect();
    for want in ["doctor", "verify-demo", "logits-demo-prefill", "logits-demo-decode", "allreduce-paths", "bench-c1", "bench-c4", "startup", "decode-cuda", "decode-cpu"] {
        assert!(stages.contains(&want), "stage {want} missing from {stages:?}");
    }
    // the double's 8 GPUs pass the peer probe: TP 2 takes the P2P kernel, with NCCL's bits
    let paths = summary["stages"].as_array().unwrap().iter().find(|s| s["stage"] == "allreduce-paths").unwrap();
    assert_eq!(paths["figures"]["default_path"], "the P2P kernel");
    assert_eq!(paths["figures"]["same_bits_as_nccl"], true);
    let prefill = summary["stages"].as_array().unwrap().iter().find(|s| s["stage"] == "logits-demo-prefill").unwrap();
    assert!(prefill["figures"]["median_rel_l2"].as_f64().unwrap() <= 1e-5);
    assert_eq!(summary["arch"], arch);
}
