//! Self-consistency of the CPU reference backend on `kiln synth tiny` (16 experts in 4 groups,
//! NVFP4 experts, DSA index_topk 16): prompts of 40 tokens, so the sparse attention really drops
//! positions. Whatever the route through the plan (one prefill or token-by-token decode, chunked
//! prefill, batched decode, 1 to 8 ranks, absorbed or expanded attention), the logits must agree.
//!
//! Tolerance: these paths run the same fp32 arithmetic (`--precision f32`, W4A16) and differ
//! only in summation order (absorbed vs expanded attention, per-rank partial sums, batch rows),
//! i.e. a few f32 ulps per op. Measured differences are ~1e-6 relative; 1e-5 per position fails
//! on any real divergence (a wrong position, page or rank slice moves logits by >1e-2).

use kiln_runtime::cpu::{ActQuant, CpuOptions, Precision};
use kiln_runtime::plan::AttentionForm;
use kiln_runtime::session::{LogitRows, Session, SessionOptions};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::OnceLock;

const TOL: f64 = 1e-5;

fn kiln(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_kiln")).args(args).output().expect("run kiln")
}

fn ok(args: &[&str]) -> Output {
    let o = kiln(args);
    assert!(o.status.success(), "kiln {args:?} failed:\n{}", String::from_utf8_lossy(&o.stderr));
    o
}

/// Runs kiln expecting a clean failure: non-zero exit, no panic, every `needle` in stderr.
fn fails<A: AsRef<str>>(args: &[A], needles: &[&str]) -> String {
    let args: Vec<&str> = args.iter().map(AsRef::as_ref).collect();
    let args = &args[..];
    let o = kiln(args);
    let err = String::from_utf8_lossy(&o.stderr).into_owned();
    assert!(!o.status.success(), "kiln {args:?} should fail");
    assert!(!err.contains("panicked"), "kiln {args:?} panicked:\n{err}");
    assert!(err.starts_with("error: "), "kiln {args:?}: not an `error:` line:\n{err}");
    for n in needles {
        assert!(err.contains(n), "kiln {args:?}: stderr lacks {n:?}:\n{err}");
    }
    err
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("kiln-cpu-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// The tiny checkpoint and its plans, compiled once for the whole file.
struct Tiny {
    ckpt: PathBuf,
    root: PathBuf,
}

fn tiny() -> &'static Tiny {
    static T: OnceLock<Tiny> = OnceLock::new();
    T.get_or_init(|| {
        let root = scratch("tiny");
        let ckpt = root.join("ckpt");
        ok(&["synth", "tiny", "-o", s(&ckpt)]);
        Tiny { ckpt, root }
    })
}

/// `kiln compile` of the tiny checkpoint with `flags`, cached by name. Serialised: tests run in
/// parallel, and one must not open an artifact another is still writing.
fn plan(name: &str, flags: &[&str]) -> PathBuf {
    static COMPILING: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _one_at_a_time = COMPILING.lock().unwrap_or_else(|e| e.into_inner());
    let t = tiny();
    let art = t.root.join(name);
    if !art.join("plan.bin").exists() {
        let mut args = vec!["compile", s(&t.ckpt), "--target", "cpu", "-o", s(&art)];
        args.extend_from_slice(flags);
        ok(&args);
    }
    art
}

fn prompt(n: usize, salt: u32) -> Vec<u32> {
    (0..n as u32).map(|i| (i * 37 + salt * 101 + 11) % 320).collect()
}

fn session(art: &Path, opts: CpuOptions) -> Session {
    Session::open(art, None, SessionOptions { cpu: opts, ..Default::default() }).unwrap()
}

const F32: CpuOptions = CpuOptions { precision: Precision::F32, act_quant: ActQuant::W4A16, attention: None };

/// Largest per-position relative L2 error of `a` against `b`.
fn max_rel(a: &[f32], b: &[f32], vocab: usize) -> f64 {
    assert_eq!(a.len(), b.len());
    a.chunks_exact(vocab)
        .zip(b.chunks_exact(vocab))
        .map(|(x, y)| {
            let num: f64 = x.iter().zip(y).map(|(p, q)| ((p - q) as f64).powi(2)).sum();
            let den: f64 = y.iter().map(|q| (*q as f64).powi(2)).sum();
            (num / den).sqrt()
        })
        .fold(0.0, f64::max)
}

#[test]
fn prefill_equals_token_by_token_decode() {
    let art = plan("tp1", &[]);
    let ids = prompt(40, 0);
    let mut sess = session(&art, F32);
    let prefill = sess.logits(&ids, false).unwrap();
    let decode = sess.logits(&ids, true).unwrap();
    let err = max_rel(&decode, &prefill, 320);
    assert!(err <= TOL, "decode vs prefill: {err:.2e}");
    // Released sequences give their pages back: the same prompt again reproduces the logits.
    assert_eq!(sess.logits(&ids, false).unwrap(), prefill);
}

#[test]
fn absorbed_attention_equals_expanded() {
    let art = plan("tp1", &[]);
    let ids = prompt(40, 1);
    let run = |form| session(&art, CpuOptions { attention: Some(form), ..F32 }).logits(&ids, false).unwrap();
    let err = max_rel(&run(AttentionForm::Absorbed), &run(AttentionForm::Expanded), 320);
    assert!(err <= TOL, "absorbed vs expanded: {err:.2e}");
}

#[test]
fn tensor_parallel_plans_equal_tp1() {
    let ids = prompt(40, 2);
    let want = session(&plan("tp1", &[]), F32).logits(&ids, false).unwrap();
    for (name, flags) in [
        ("tp2", &["--tp", "2"][..]),
        ("tp4", &["--tp", "4"][..]),
        ("tp8", &["--tp", "8"][..]),
        ("tp4-ep", &["--tp", "4", "--moe-parallel", "ep"][..]),
        ("tp8-ep", &["--tp", "8", "--moe-parallel", "ep"][..]),
    ] {
        let got = session(&plan(name, flags), F32).logits(&ids, false).unwrap();
        let err = max_rel(&got, &want, 320);
        assert!(err <= TOL, "{name} vs tp1: {err:.2e}");
    }
}

/// `other`'s logits of `ids` have `replicated`'s bits at F32 and with the GPU's BF16 buffers and
/// FP4 activations, prefilled and decoded token by token.
fn same_bits_both_ways(replicated: &Path, other: &Path, ids: &[u32], what: &str) {
    let gpu_like = CpuOptions { precision: Precision::Bf16, act_quant: ActQuant::W4A4, attention: None };
    for opts in [F32, gpu_like] {
        for decode in [false, true] {
            let want = session(replicated, opts).logits(ids, decode).unwrap();
            let got = session(other, opts).logits(ids, decode).unwrap();
            let off = got.iter().zip(&want).filter(|(g, w)| g.to_bits() != w.to_bits()).count();
            assert_eq!(off, 0, "{what}, {:?}, decode {decode}: {off} logits differ from the replicated plan's", opts.precision);
        }
    }
}

/// Splitting the replicated projections by output rows behind all-gathers (`--split-projections
/// all`: q_a, kv_a and the indexer's; the tiny model is too small for `auto` to split any) moves
/// no arithmetic: each output is the same dot product, the gather a copy. So the bits equal the
/// replicated plan's, at F32 and with the GPU's BF16 buffers and FP4 activations, prefill and
/// decode, at TP 2 and 8. So do programs computing them whole from copies (`--prefill-copies
/// all`), whose only gather is then the logits': prefill, and decode, since the tiny model's
/// weights of a few KiB take less time than any gather (8 µs).
#[test]
fn split_projections_give_the_replicated_bits() {
    use kiln_runtime::plan::{read_plan, Op, ProgramKind};
    let ids = prompt(40, 4);
    // the most any program of the kind gathers
    let gathers = |art: &Path, prefill: bool| {
        let plan = read_plan(art).unwrap();
        let programs = plan.programs.iter().filter(|p| matches!(p.kind, ProgramKind::Prefill { .. }) == prefill);
        programs.map(|p| p.steps.iter().filter(|s| matches!(s.op, Op::AllGather { .. })).count()).max().unwrap()
    };
    for tp in ["2", "8"] {
        let whole = plan(&format!("tp{tp}"), &["--tp", tp]);
        let split = plan(&format!("tp{tp}-split"), &["--tp", tp, "--split-projections", "all", "--prefill-copies", "none"]);
        let text = String::from_utf8(ok(&["inspect", s(&split)]).stdout).unwrap();
        for name in ["q_a_proj", "kv_a_proj_with_mqa", "indexer.wq_b", "indexer.wk", "indexer.weights_proj"] {
            assert!(text.lines().any(|l| l.contains(name) && l.contains("all-gathered after it")), "TP {tp}: {name} not split:\n{text}");
        }
        same_bits_both_ways(&whole, &split, &ids, &format!("TP {tp}, split projections"));
        let copied = plan(&format!("tp{tp}-copies"), &["--tp", tp, "--split-projections", "all", "--prefill-copies", "all"]);
        let text = String::from_utf8(ok(&["inspect", s(&copied)]).stdout).unwrap();
        for name in ["q_a_proj", "kv_a_proj_with_mqa", "indexer.wq_b", "indexer.wk", "indexer.weights_proj"] {
            assert!(text.lines().any(|l| l.contains(name) && l.contains("prefill computes it whole from a copy")), "TP {tp}: {name} not copied:\n{text}");
        }
        assert!(gathers(&split, true) > 1, "TP {tp}: the split plan's prefill gathers its projections");
        assert_eq!(gathers(&copied, true), 1, "TP {tp}: prefill with copies gathers only the logits");
        assert!(gathers(&split, false) > 1, "TP {tp}: the split plan's decode gathers its projections");
        assert_eq!(gathers(&copied, false), 1, "TP {tp}: decode with copies gathers only the logits");
        assert!(text.contains("as do decode programs of batch"), "TP {tp}: {text}");
        same_bits_both_ways(&whole, &copied, &ids, &format!("TP {tp}, split projections with prefill copies"));
    }
}

/// The sequence-parallel indexer (`--sequence-parallel-indexer always`: rank r selects the
/// lists of tokens r, r + R, ..., all-gathered after) computes each list as the replicated plan
/// does, so every logit has the replicated plan's bits, at F32 and with the GPU's BF16 buffers,
/// prefill (where it applies) and decode after it, at TP 2 and 8. The plans are checked to take
/// it: every prefill indexer step across ranks, a gather of its lists right after.
#[test]
fn the_sequence_parallel_indexer_gives_the_replicated_bits() {
    use kiln_runtime::plan::{read_plan, Op, ProgramKind};
    let ids = prompt(40, 5);
    for tp in ["2", "8"] {
        let whole = plan(&format!("tp{tp}-sp-never"), &["--tp", tp, "--sequence-parallel-indexer", "never"]);
        let split = plan(&format!("tp{tp}-sp-always"), &["--tp", tp, "--sequence-parallel-indexer", "always"]);
        let p = read_plan(&split).unwrap();
        assert!(p.model.index_topk < 40, "the prompt's later tokens score");
        for program in p.programs.iter().filter(|p| matches!(p.kind, ProgramKind::Prefill { .. })) {
            let steps = &program.steps;
            let across: Vec<usize> = (0..steps.len()).filter(|&i| matches!(steps[i].op, Op::IndexerTopK { across_ranks: true, .. })).collect();
            assert_eq!(across.len(), p.model.num_hidden_layers, "TP {tp} {}: every layer's indexer across ranks", program.name);
            for i in across {
                let Op::IndexerTopK { out, .. } = steps[i].op else { unreachable!() };
                assert!(matches!(&steps[i + 1].op, Op::AllGather { pairs } if pairs.len() == 1 && pairs[0].input == out), "TP {tp} {}: no gather of the lists after step {i}", program.name);
            }
        }
        same_bits_both_ways(&whole, &split, &ids, &format!("TP {tp}, the sequence-parallel indexer"));
    }
}

/// A chunk size's second program for chunks deep in a context (`from:20`: selecting across the
/// ranks from position 20 on) is what the runtime replays for chunks from there: 40 tokens in
/// chunks of 16 take the first program at positions 0 and 16 and the second at 32, with the
/// replicated indexer's bits.
#[test]
fn chunks_deep_in_a_context_take_their_own_program_with_the_same_bits() {
    let ids = prompt(40, 6);
    let whole = plan("chunk16-tp2-never", &["--prefill-chunk", "16", "--tp", "2", "--sequence-parallel-indexer", "never"]);
    let deep = plan("chunk16-tp2-from20", &["--prefill-chunk", "16", "--tp", "2", "--sequence-parallel-indexer", "from:20"]);
    let want = session(&whole, F32).logits(&ids, false).unwrap();
    let mut s = session(&deep, F32);
    let names: Vec<String> = s.plan().programs.iter().map(|p| p.name.clone()).collect();
    assert!(names.contains(&"prefill_16_from_20".to_string()), "{names:?}");
    let replayed = std::sync::Arc::new(std::sync::Mutex::new(Vec::<String>::new()));
    let sink = replayed.clone();
    s.cpu_mut().unwrap().set_observer(Some(Box::new(move |v: &kiln_runtime::cpu::StepView| {
        if v.step == 0 && v.phase == kiln_runtime::cpu::StepPhase::Before {
            sink.lock().unwrap().push(names[v.program].clone());
        }
    })));
    let got = s.logits(&ids, false).unwrap();
    assert_eq!(*replayed.lock().unwrap(), ["prefill_16", "prefill_16", "prefill_16_from_20"]);
    let off = got.iter().zip(&want).filter(|(g, w)| g.to_bits() != w.to_bits()).count();
    assert_eq!(off, 0, "{off} logits differ from the replicated indexer's");
}

#[test]
fn chunked_prefill_equals_one_prefill() {
    // --prefill-chunk 16: a single 16-token bucket, so 40 tokens take three chunks (16, 16, 8).
    let chunked = plan("chunk16", &["--prefill-chunk", "16"]);
    let ids = prompt(40, 3);
    let want = session(&plan("tp1", &[]), F32).logits(&ids, false).unwrap();
    let got = session(&chunked, F32).logits(&ids, false).unwrap();
    let err = max_rel(&got, &want, 320);
    assert!(err <= TOL, "chunked vs one prefill: {err:.2e}");
}

#[test]
fn batched_decode_of_several_sequences_equals_each_alone() {
    let art = plan("tp1", &[]);
    let prompts = [prompt(21, 4), prompt(33, 5), prompt(7, 6)];
    let steps = [prompt(5, 7), prompt(5, 8), prompt(5, 9)];
    // Alone: prompt then the steps, one sequence at a time.
    let mut alone = Vec::new();
    for (p, st) in prompts.iter().zip(&steps) {
        let mut all = p.clone();
        all.extend(st);
        let l = session(&art, F32).logits(&all, false).unwrap();
        alone.push(l[p.len() * 320..].to_vec());
    }
    // Together: interleaved prefills (pages of the sequences alternate), then batched decode.
    let mut sess = session(&art, F32);
    let seqs: Vec<_> = prompts.iter().map(|_| sess.new_sequence()).collect();
    for (half, (&seq, p)) in [0, 1].into_iter().flat_map(|h| seqs.iter().zip(&prompts).map(move |x| (h, x))) {
        let (a, b) = p.split_at(p.len() / 2);
        sess.prefill(seq, if half == 0 { a } else { b }, LogitRows::Last).unwrap();
    }
    let mut together = vec![Vec::new(); 3];
    for i in 0..5 {
        let batch: Vec<_> = seqs.iter().zip(&steps).map(|(&seq, st)| (seq, st[i])).collect();
        let l = sess.decode(&batch).unwrap().to_vec();
        for (j, row) in l.chunks_exact(320).enumerate() {
            together[j].extend_from_slice(row);
        }
    }
    for j in 0..3 {
        let err = max_rel(&together[j], &alone[j], 320);
        assert!(err <= TOL, "sequence {j}: batched decode vs alone: {err:.2e}");
    }
}

/// The default mode (bf16 storage, W4A4) is deterministic and self-consistent too: the same
/// prompt through a one-prefill plan and a chunked plan must pick the same argmax almost
/// everywhere (bf16 rounding of different partial results is allowed to differ slightly).
#[test]
fn default_mode_runs_and_is_deterministic() {
    let art = plan("tp1", &[]);
    let ids = prompt(40, 10);
    let mut a = session(&art, CpuOptions::default());
    let x = a.logits(&ids, false).unwrap();
    assert!(x.iter().all(|v| v.is_finite()));
    assert_eq!(x, a.logits(&ids, false).unwrap(), "same inputs, same logits");
    assert_eq!(x, session(&art, CpuOptions::default()).logits(&ids, false).unwrap());
}

#[test]
fn bad_inputs_fail_with_the_culprit_named() {
    let t = tiny();
    let art = plan("tp1", &[]);
    let out = t.root.join("bad.safetensors");
    let (art_s, out_s) = (s(&art).to_string(), s(&out).to_string());
    let logits = |extra: &[&str]| -> Vec<String> {
        ["logits", &art_s, "--out", &out_s].iter().chain(extra).map(|a| a.to_string()).collect()
    };
    // Ids out of the vocabulary, none at all, too many for the context.
    fails(&logits(&["--ids", "1,2,320"]), &["320", "index 2", "vocabulary of 320"]);
    fails(&logits(&["--ids", ""]), &["--ids"]);
    let short = plan("ctx32", &["--max-context", "32"]);
    let many = prompt(40, 0).iter().map(u32::to_string).collect::<Vec<_>>().join(",");
    fails(&["logits", s(&short), "--ids", &many, "--out", s(&out)], &["40 tokens", "at most 32"]);
    fails(&["logits", s(&short), "--ids", &many, "--out", s(&out), "--decode"], &["40 tokens", "at most 32"]);
    // A GPU backend for a CPU plan (refused before any driver is looked for).
    fails(&logits(&["--ids", "1", "--backend", "cuda"]), &["compiled for cpu", "GPU target"]);
    // Weights: a missing directory, foreign weights, an edited header.
    let missing = t.root.join("no-such-ckpt");
    fails(&logits(&["--ids", "1", "--weights", s(&missing)]), &["no-such-ckpt"]);
    let foreign = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/goldens/nvfp4_flatcfg/ckpt");
    fails(
        &logits(&["--ids", "1", "--weights", s(&foreign)]),
        &["weights do not match the plan", "model.embed_tokens.weight", "BF16 [320, 256]", "found BF16 [384, 96]", "fingerprint"],
    );
    let edited = t.root.join("edited");
    edit_header(&t.ckpt, &edited, "model.layers.2.post_attention_layernorm.weight", "F16");
    fails(
        &logits(&["--ids", "1", "--weights", s(&edited)]),
        &["model.layers.2.post_attention_layernorm.weight", "expects BF16 [256]", "found F16 [256]"],
    );
    // Not an artifact; an artifact whose checkpoint is gone and no --weights.
    fails(&["logits", s(&t.root.join("nothing")), "--ids", "1", "--out", s(&out)], &["plan.bin"]);
    let moved = t.root.join("moved-ckpt");
    copy_dir(&t.ckpt, &moved);
    let orphan = t.root.join("orphan");
    ok(&["compile", s(&moved), "--target", "cpu", "-o", s(&orphan)]);
    std::fs::remove_dir_all(&moved).unwrap();
    fails(&["logits", s(&orphan), "--ids", "1", "--out", s(&out)], &["no longer exists", "--weights"]);
    // ... which --weights repairs.
    ok(&["logits", s(&orphan), "--ids", "1", "--out", s(&out), "--weights", s(&t.ckpt)]);
}

#[test]
fn logits_cli_writes_one_row_per_id() {
    let art = plan("tp1", &[]);
    let out = tiny().root.join("cli.safetensors");
    let ids = prompt(20, 12);
    let list = ids.iter().map(u32::to_string).collect::<Vec<_>>().join(",");
    ok(&["logits", s(&art), "--ids", &list, "--out", s(&out), "--precision", "f32", "--act-quant", "off"]);
    let headers = kiln_runtime::safetensors::read_header(&out).unwrap();
    assert_eq!(headers.len(), 1);
    let (name, h) = &headers[0];
    assert_eq!(name, "logits");
    assert_eq!(h.dtype, "F32");
    assert_eq!(h.shape, vec![20, 320]);
    let bytes = std::fs::read(&out).unwrap();
    let cli: Vec<f32> = bytes[h.data_start as usize..h.data_end as usize].chunks_exact(4).map(|b| f32::from_le_bytes(b.try_into().unwrap())).collect();
    assert_eq!(cli, session(&art, F32).logits(&ids, false).unwrap(), "the CLI and the library agree bit for bit");
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
    }
}

/// Copies checkpoint `from` to `to`, changing the header dtype of `tensor` (same element size, so
/// the file stays valid; only the header is edited).
fn edit_header(from: &Path, to: &Path, tensor: &str, dtype: &str) {
    copy_dir(from, to);
    for e in std::fs::read_dir(to).unwrap() {
        let path = e.unwrap().path();
        if path.extension().is_none_or(|x| x != "safetensors") {
            continue;
        }
        let bytes = std::fs::read(&path).unwrap();
        let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
        let mut header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
        let Some(entry) = header.get_mut(tensor) else { continue };
        entry["dtype"] = serde_json::Value::String(dtype.into());
        let mut json = serde_json::to_vec(&header).unwrap();
        while !json.len().is_multiple_of(8) {
            json.push(b' ');
        }
        let mut out = (json.len() as u64).to_le_bytes().to_vec();
        out.extend_from_slice(&json);
        out.extend_from_slice(&bytes[8 + n..]);
        std::fs::write(&path, out).unwrap();
        return;
    }
    panic!("{tensor} not found in {}", from.display());
}
