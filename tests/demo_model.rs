//! The trained demo model (artifacts/demo-model: GLM-5 architecture, ModelOpt NVFP4, trained by
//! scripts/demo_model/train.py) answers for real, on every backend:
//! - through `kiln serve` (CPU backend) and the official openai client, held-out arithmetic with
//!   thinking on and off and held-out weather questions that must become the right `get_weather`
//!   call (tests/server/test_demo_model.py; issue 12's bar: 95 % each);
//! - on the PTX emulator (an `sm_120a --tp 2` compile, every step as its kernels) ten held-out
//!   questions get the CPU backend's exact text, with prompt-lookup drafts checked in its decode
//!   steps (and `kiln run` with them writes the same replies on the CPU backend);
//! - whole logit rows of the emulator against the CPU backend on a long tool-call conversation
//!   (the DSA indexer drops tokens there), median and worst reported.
//! Held-out questions are drawn by scripts/demo_model/data.py (the one definition of the split).
//!
//! artifacts/demo-model is written by scripts/demo_model/train.sh (never run by CI).

mod common;

use common::serve;
use kiln_runtime::session::{BackendKind, LogitRows, Session, SessionOptions};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn demo() -> PathBuf {
    root().join("artifacts/demo-model")
}

fn kiln() -> Command {
    Command::new(env!("CARGO_BIN_EXE_kiln"))
}

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("kiln-demo-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn compile(name: &str, target: &str, tp: usize) -> PathBuf {
    compile_with(name, target, tp, &[])
}

fn compile_with(name: &str, target: &str, tp: usize, flags: &[&str]) -> PathBuf {
    let art = scratch(name);
    let o = kiln()
        .arg("compile")
        .arg(demo())
        .args(["--target", target, "--tp", &tp.to_string(), "--no-ptxas", "--max-context", "1024", "--decode-batches", "1,2,4,8,16"])
        .args(flags)
        .arg("-o")
        .arg(&art)
        .output()
        .unwrap();
    assert!(o.status.success(), "kiln compile failed:\n{}", String::from_utf8_lossy(&o.stderr));
    art
}

/// `n` held-out arithmetic questions with their answers, from data.py.
fn held_out_arithmetic(python: &str, n: usize, seed: u64) -> Vec<(String, i64)> {
    let code = format!(
        "import json, sys; sys.path.insert(0, 'scripts/demo_model'); import data; \
         print(json.dumps([[i['question'], i['answer']] for i in data.draw_eval_arith({n}, seed={seed})]))"
    );
    let o = Command::new(python).args(["-c", &code]).current_dir(root()).output().unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    serde_json::from_slice(&o.stdout).unwrap()
}

#[test]
fn answers_held_out_questions_through_the_openai_client() {
    let Some(python) = serve::python_with_openai() else { return };
    let art = compile("serve", "cpu", 2);
    let mut serve_cmd = kiln();
    serve_cmd.arg("serve").arg(&art).args(["--served-model-name", "kiln-demo"]);
    let server = serve::start(serve_cmd, Duration::from_secs(60));
    let script = root().join("tests/server/test_demo_model.py");
    let o = Command::new(&python)
        .arg(&script)
        .env("KILN_BASE_URL", format!("http://127.0.0.1:{}", server.port))
        .env("KILN_MODEL", "kiln-demo")
        // Issue 12's bar: 95 % in every group (the script's default). Greedy decoding on the CPU
        // backend is deterministic and batch-invariant, so the measured figures repeat (README:
        // 100 % / 96.0 % / 100 %), and a regression anywhere in the path (template, tokenizer,
        // kernels, sampling, parsers) fails here.
        .env("KILN_DEMO_MIN", "0.95")
        .output()
        .unwrap();
    let report = String::from_utf8_lossy(&o.stdout);
    eprintln!("{report}");
    assert!(o.status.success(), "the demo model missed its bar:\n{report}\n{}", String::from_utf8_lossy(&o.stderr));
}

/// The greedy thinking-off reply to `question` from a server: (token, logprob, top-2 alternatives).
fn reply_tokens(port: u16, question: &str) -> Vec<(String, f64, Vec<(String, f64)>)> {
    let body = serde_json::json!({
        "model": "m", "messages": [{"role": "user", "content": question}], "temperature": 0, "max_tokens": 24,
        "logprobs": true, "top_logprobs": 2, "chat_template_kwargs": {"enable_thinking": false}
    });
    let (status, text) = serve::http(port, "POST", "/v1/chat/completions", &body.to_string());
    assert_eq!(status, 200, "{text}");
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    let entry = |t: &serde_json::Value| (t["token"].as_str().unwrap().to_string(), t["logprob"].as_f64().unwrap());
    v["choices"][0]["logprobs"]["content"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| {
            let (tok, lp) = entry(t);
            (tok, lp, t["top_logprobs"].as_array().unwrap().iter().map(entry).collect())
        })
        .collect()
}

/// Ten held-out questions, thinking off, greedy, on the CPU backend and on the emulator (the same
/// `sm_120a --tp 2` plan, every step as its kernels): the emulator must write the CPU's text
/// (issue 12). The two backends' logits differ by ~1e-2 (rel-L2, `emulator_logit_rows_track_the_cpu`),
/// enough to swap two candidates within a few tenths of a nat (an earlier model parted at
/// `57 - 8 = `: `4` -0.649 and `5` -0.742 on the CPU, the reverse on the emulator), so a failure
/// prints both backends' margins at the first differing token: a near-tie there is numerics, a
/// confident wrong token a broken kernel. Measured on the shipped model: ten of ten equal. The
/// emulator's server drafts by prompt lookup (`--speculative-ngram 2`), so its replies come from
/// decode steps that also check drafts as rows of the same sequence, and must still be the CPU's.
#[test]
fn the_emulator_gives_the_cpu_answers() {
    let Some(python) = serve::python_with_openai() else { return };
    let art = compile("emu", "sm_120a", 2);
    let start = |backend: &str| {
        let mut c = kiln();
        c.arg("serve").arg(&art).args(["--backend", backend, "--served-model-name", "m"]);
        if backend == "emu" {
            // drafts checked as rows of one sequence in a decode step of the plan's kernels
            c.args(["--speculative-ngram", "2"]);
        }
        serve::start(c, Duration::from_secs(120))
    };
    let (cpu_server, emu_server) = (start("cpu"), start("emu"));
    let questions = held_out_arithmetic(&python, 10, 3);
    let mut right = 0;
    for (q, want) in &questions {
        let cpu = reply_tokens(cpu_server.port, q);
        let emu = reply_tokens(emu_server.port, q);
        let text = |r: &[(String, f64, Vec<(String, f64)>)]| r.iter().map(|t| t.0.as_str()).collect::<String>();
        eprintln!("{q} -> cpu {:?}, emu {:?}", text(&cpu), text(&emu));
        right += text(&cpu).trim().ends_with(&format!("= {want}")) as usize;
        let Some(i) = (0..cpu.len().min(emu.len())).find(|&i| cpu[i].0 != emu[i].0) else {
            assert_eq!(text(&emu), text(&cpu), "{q}: one reply is a prefix of the other");
            continue;
        };
        let margin = |own: &(String, f64, Vec<(String, f64)>), other: &str| own.2.iter().find(|(t, _)| t == other).map(|(_, lp)| own.1 - lp);
        panic!(
            "{q}: the emulator writes {:?}, the CPU {:?}; they part at token {i} ({:?} vs {:?}; margin over the other's token: cpu {:?}, emu {:?} nats)",
            text(&emu),
            text(&cpu),
            emu[i].0,
            cpu[i].0,
            margin(&cpu[i], &emu[i].0),
            margin(&emu[i], &cpu[i].0)
        );
    }
    // The CPU backend's own accuracy on these ten (95.5 % without thinking over 200).
    assert!(right >= 9, "only {right} of 10 held-out answers right on the sm_120a plan");
    // the emulator's replies came from steps that also checked drafts, some of them accepted
    let (status, metrics) = serve::http(emu_server.port, "GET", "/metrics", "");
    assert_eq!(status, 200, "{metrics}");
    let counter = |name: &str| metrics.lines().find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse::<f64>().ok()).unwrap_or_else(|| panic!("no {name} in {metrics}"));
    let (drafted, accepted) = (counter("kiln_spec_draft_tokens_total"), counter("kiln_spec_accepted_tokens_total"));
    eprintln!("emulator: {drafted} drafts checked, {accepted} accepted");
    assert!(accepted > 0.0 && drafted > accepted, "{drafted} drafts, {accepted} accepted");
}

/// `kiln run` with prompt-lookup speculation (CPU backend) writes the reply it writes without,
/// greedy and sampled, and the demo model's replies, which restate the question, accept drafts.
#[test]
fn speculative_decoding_keeps_the_reply_and_accepts_drafts() {
    let art = compile("speculative", "cpu", 1);
    let reply = |question: &str, sampling: &[&str], k: usize| {
        let o = kiln()
            .arg("run")
            .arg(&art)
            .args(["--chat", "--prompt", question, "--max-tokens", "120", "--speculative-ngram", &k.to_string()])
            .args(sampling)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&o.stderr).into_owned();
        assert!(o.status.success(), "kiln run failed:\n{err}");
        let accepted = err.lines().find_map(|l| l.strip_prefix("[speculative decoding: ")?.split(", ").nth(1)?.split(' ').next()?.parse::<u64>().ok());
        (String::from_utf8_lossy(&o.stdout).into_owned(), accepted)
    };
    let mut accepted = 0;
    for (question, sampling) in [("What is 13+25?", &[][..]), ("What is 47+38?", &["--temperature", "0.8", "--seed", "5"][..])] {
        let (plain, none) = reply(question, sampling, 0);
        let (speculative, some) = reply(question, sampling, 3);
        assert_eq!(none, None, "no speculation report without --speculative-ngram");
        assert_eq!(speculative, plain, "{question} {sampling:?}");
        accepted += some.expect("the speculation report");
    }
    assert!(accepted > 0, "the replies restate the question, yet no draft was accepted");
}

/// Relative L2 distance of two rows.
fn rel_l2(a: &[f32], b: &[f32]) -> f64 {
    let num: f64 = a.iter().zip(b).map(|(x, y)| ((x - y) as f64).powi(2)).sum();
    let den: f64 = b.iter().map(|y| (*y as f64).powi(2)).sum();
    (num / den).sqrt()
}

/// The emulator's logit rows against the CPU backend's on the same sm_120a plan, over the golden
/// conversation (a held-out tool call exchange of a few hundred tokens), prefilled in chunks.
///
/// Tolerance: both backends store BF16 at the same points and quantise NVFP4 activations alike;
/// they differ only where attention's exp and sum order differ (one BF16 ulp on some values), so
/// rows 0 and 1 must agree to 1e-6. Later, one ulp can move an activation across an E2M1
/// rounding boundary, or flip a near-tie of the router or of the DSA indexer's top-k (this
/// model's indexer scores have many near-ties: kiln's own f32 and bf16 runs choose different
/// top-32 sets at most positions of this exchange, tests/cpu_goldens.rs prints them), and the
/// change spreads through the KV cache to every later row. How far that chaos goes is measured,
/// not guessed: the control is the CPU backend against itself at TP 1 and TP 2 (both right; only
/// the all-reduce's BF16 summation order differs). Measured: control median 6.7e-2, worst 1.14,
/// rows beyond 0.1: 95; emulator median 3.9e-2, worst 1.34 (one isolated row), beyond 0.1: 30.
/// A wrong fragment layout, cache slot or RoPE angle spoils every row by order 100 %, so the
/// emulator's median must stay within 1.5x the control's, and its argmax must agree on as many
/// rows as the control's (less 2 % of the rows); single worst rows are reported, not bounded.
#[test]
fn emulator_logit_rows_track_the_cpu() {
    let golden = root().join("tests/goldens/demo/golden.json");
    let meta: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(golden).unwrap()).unwrap();
    let ids: Vec<u32> = meta["prompt_ids"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect();
    let (art2, art1) = (compile("rows", "sm_120a", 2), compile("rows1", "sm_120a", 1));
    let rows = |art: &Path, backend| {
        let mut s = Session::open(art, None, SessionOptions { backend, ..SessionOptions::default() }).unwrap();
        let seq = s.new_sequence();
        s.prefill(seq, &ids, LogitRows::All).unwrap().to_vec()
    };
    let cpu = rows(&art2, BackendKind::Cpu);
    let emu = Divergence::of(&rows(&art2, BackendKind::Emu), &cpu, ids.len());
    let control = Divergence::of(&rows(&art1, BackendKind::Cpu), &cpu, ids.len());
    eprintln!("demo model over {} rows, emulator vs CPU: {emu}; control (CPU TP 1 vs TP 2): {control}", ids.len());
    assert!(emu.first_two <= 1e-6, "rows 0-1 differ by {:e}: no rounding before them can explain that", emu.first_two);
    assert!(emu.median <= 1.5 * control.median, "emulator median {:e} vs the control's {:e}", emu.median, control.median);
    assert!(emu.same_argmax + ids.len() / 50 >= control.same_argmax, "argmax equal on {} rows, the control on {}", emu.same_argmax, control.same_argmax);
}

/// How far one run's logit rows are from a reference run's (rel-L2 per row).
struct Divergence {
    first_two: f64,
    median: f64,
    worst: f64,
    beyond_tenth: usize,
    same_argmax: usize,
}

impl Divergence {
    fn of(got: &[f32], want: &[f32], rows: usize) -> Divergence {
        let vocab = want.len() / rows;
        let pairs = || got.chunks_exact(vocab).zip(want.chunks_exact(vocab));
        let mut errs: Vec<f64> = pairs().map(|(g, w)| rel_l2(g, w)).collect();
        let argmax = |r: &[f32]| (0..r.len()).max_by(|&a, &b| r[a].total_cmp(&r[b])).unwrap();
        let same_argmax = pairs().filter(|(g, w)| argmax(g) == argmax(w)).count();
        let first_two = errs[0].max(errs[1]);
        let beyond_tenth = errs.iter().filter(|e| **e > 0.1).count();
        errs.sort_by(f64::total_cmp);
        Divergence { first_two, median: errs[errs.len() / 2], worst: errs[errs.len() - 1], beyond_tenth, same_argmax }
    }
}

impl std::fmt::Display for Divergence {
    fn fmt(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        write!(f, "rows 0-1 {:.1e}, median {:.2e}, worst {:.2e}, {} rows beyond 0.1, argmax equal on {}", self.first_two, self.median, self.worst, self.beyond_tenth, self.same_argmax)
    }
}

/// The least share of the trained MTP layer's drafts the demo replies must accept at 3 drafts a
/// step: 45-65 % measured (the first draft ~87 %, as the layer's held-out top-1 of 0.857 in
/// training predicts; later drafts continue from the draft's own hidden state), where the layer
/// before training is right 3.5 % of the time and prompt lookup 22-30 % on these replies.
const MTP_MIN_ACCEPTANCE: f64 = 0.3;

/// The demo model's trained MTP layer (`scripts/demo_model/train_mtp.py`, shipped in
/// artifacts/demo-model as `mtp.safetensors`) as the draft model: `kiln run --speculative-draft 3`
/// on the CPU backend writes every reply it writes without drafts, greedy and sampled, thinking on
/// and off, and its drafts are mostly right (prompt lookup's were right 22-30 % of the time on
/// these replies; the layer's held-out top-1 in training is in train_log.json `mtp`).
#[test]
fn the_trained_mtp_layer_drafts_what_the_model_writes() {
    // as stored (BF16), and with its experts quantised to NVFP4 at bind, as GPU plans run it
    for draft in ["mtp", "mtp-nvfp4"] {
        mtp_drafts(draft);
    }
}

/// A plan that splits the replicated projections (`--split-projections all`) keeps whole copies
/// that its prefill and, the demo's weights being a few hundred KiB, every decode program compute
/// from, while the draft layer, which has no copies, gathers its shares in the draft programs:
/// `kiln inspect` says so, the programs' gathers say so, and `kiln run --speculative-draft 3`
/// writes the replicated plan's reply with the same drafts accepted.
#[test]
fn split_projections_with_copies_draft_as_the_replicated_plan() {
    use kiln_runtime::plan::{read_plan, Op, ProgramKind};
    let split = compile_with("mtp-split", "cpu", 2, &["--draft", "mtp", "--split-projections", "all"]);
    let replicated = compile_with("mtp-replicated", "cpu", 2, &["--draft", "mtp", "--split-projections", "none"]);
    let o = kiln().arg("inspect").arg(&split).output().unwrap();
    let text = String::from_utf8_lossy(&o.stdout);
    let wq_b = text.lines().find(|l| l.contains("indexer.wq_b")).unwrap_or_else(|| panic!("{text}"));
    assert!(wq_b.contains("all-gathered after it in the draft programs only; prefill computes it whole from a copy") && wq_b.contains("as do decode programs of batch 1, 2, 4, 8, 16"), "{wq_b}");
    let plan = read_plan(&split).unwrap();
    for p in &plan.programs {
        let gathers = p.steps.iter().filter(|s| matches!(s.op, Op::AllGather { .. })).count();
        match p.kind {
            // the logits', and the draft layer's projections
            ProgramKind::Decode { .. } if p.is_draft() => assert!(gathers > 1, "{}", p.name),
            _ => assert_eq!(gathers, 1, "{}: only the logits", p.name),
        }
    }
    let reply = |art: &Path| {
        let o = kiln().arg("run").arg(art).args(["--chat", "--prompt", "What is 13+25?", "--max-tokens", "60", "--speculative-draft", "3"]).output().unwrap();
        let err = String::from_utf8_lossy(&o.stderr).into_owned();
        assert!(o.status.success(), "kiln run failed:\n{err}");
        let report = err.lines().find(|l| l.starts_with("[speculative decoding: ")).map(str::to_string);
        (String::from_utf8_lossy(&o.stdout).into_owned(), report.expect("the speculation report"))
    };
    assert_eq!(reply(&split), reply(&replicated));
}

fn mtp_drafts(mode: &str) {
    let art = compile_with(mode, "cpu", 2, &["--draft", mode]);
    let reply = |question: &str, sampling: &[&str], draft: bool| {
        let o = kiln()
            .arg("run")
            .arg(&art)
            .args(["--chat", "--prompt", question, "--max-tokens", "160"])
            .args(if draft { &["--speculative-draft", "3"][..] } else { &[][..] })
            .args(sampling)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&o.stderr).into_owned();
        assert!(o.status.success(), "kiln run failed:\n{err}");
        let counts = err.lines().find_map(|l| {
            let mut it = l.strip_prefix("[speculative decoding: ")?.split(", ").map(|p| p.split(' ').next()?.parse::<u64>().ok());
            Some((it.next()??, it.next()??))
        });
        (String::from_utf8_lossy(&o.stdout).into_owned(), counts)
    };
    let (mut drafted, mut accepted) = (0, 0);
    let cases: [(&str, &[&str]); 4] = [
        ("What is 13+25?", &[]),
        ("What is 47+38?", &["--no-thinking"]),
        ("What is 91-36?", &["--temperature", "0.8", "--seed", "5"]),
        ("What is the weather in Lisbon?", &[]),
    ];
    for (question, sampling) in cases {
        let (plain, none) = reply(question, sampling, false);
        let (drafting, counts) = reply(question, sampling, true);
        assert_eq!(none, None, "no speculation report without drafts");
        assert_eq!(drafting, plain, "{question} {sampling:?}");
        let (d, a) = counts.expect("the speculation report");
        eprintln!("{mode}: {question} {sampling:?}: {d} drafts, {a} accepted");
        drafted += d;
        accepted += a;
    }
    let rate = accepted as f64 / drafted as f64;
    eprintln!("{mode}: the MTP layer's drafts: {accepted} of {drafted} accepted ({:.0} %)", rate * 100.0);
    assert!(rate >= MTP_MIN_ACCEPTANCE, "{mode}: {accepted} of {drafted} drafts accepted");
}
