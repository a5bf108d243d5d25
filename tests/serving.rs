//! The serving engine over the real tiny model (CPU backend): KV grown on demand with
//! preemption and recompute, the prefix cache and speculative decoding, each held against the
//! same requests run alone on an engine with room to spare (whole token sequences compared).

use kiln_engine::scheduler::{start, EngineHandle, EngineOptions, Event, FinishReason, GenerationRequest, NgramSpeculation};
use kiln_runtime::cpu::CpuOptions;
use kiln_runtime::plan::AttentionForm;
use kiln_runtime::session::{LogitRows, Runner, Session, SessionOptions};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::Ordering;
use std::sync::mpsc;
use std::time::Duration;

fn kiln(args: &[&str]) {
    let out = Command::new(env!("CARGO_BIN_EXE_kiln")).args(args).output().unwrap();
    assert!(out.status.success(), "kiln {args:?}: {}", String::from_utf8_lossy(&out.stderr));
}

/// The tiny model compiled for a 1,024-token context.
fn artifact(name: &str) -> PathBuf {
    artifact_with(name, &[])
}

/// [`artifact`] with more compile flags (`--draft mtp`: the tiny model's MTP layer as a draft).
fn artifact_with(name: &str, flags: &[&str]) -> PathBuf {
    let root = std::env::temp_dir().join(format!("kiln-test-{}-serving-{name}", std::process::id()));
    let (ckpt, art) = (root.join("ckpt"), root.join("plan"));
    let s = |p: &Path| p.to_str().unwrap().to_string();
    kiln(&["synth", "tiny", "-o", &s(&ckpt)]);
    let (ckpt, art) = (s(&ckpt), s(&art));
    let mut args = vec!["compile", &ckpt, "--target", "cpu", "--max-context", "1024", "--decode-batches", "1,2,4,8", "--prefill-chunk", "64", "-o", &art];
    args.extend_from_slice(flags);
    kiln(&args);
    PathBuf::from(art)
}

/// Every attention step in the absorbed form, prefill included (see the last test for why).
fn engine(art: &Path, options: EngineOptions) -> EngineHandle {
    let cpu = CpuOptions { attention: Some(AttentionForm::Absorbed), ..CpuOptions::default() };
    let runner = Runner::open(art, None, SessionOptions { cpu, ..SessionOptions::default() }).unwrap();
    start(Box::new(runner), options)
}

struct Outcome {
    tokens: Vec<u32>,
    reason: FinishReason,
    cached_tokens: usize,
}

fn submit(e: &EngineHandle, request: GenerationRequest) -> mpsc::Receiver<Event> {
    let (tx, rx) = mpsc::channel();
    e.submit(request, Box::new(move |ev| tx.send(ev).is_ok())).unwrap();
    rx
}

fn outcome(rx: mpsc::Receiver<Event>) -> Outcome {
    let mut tokens = Vec::new();
    loop {
        match rx.recv_timeout(Duration::from_secs(600)).expect("the engine answers") {
            Event::Token { id, .. } => tokens.push(id),
            Event::Finished { reason, completion_tokens, cached_tokens, .. } => {
                assert_eq!(completion_tokens, tokens.len());
                return Outcome { tokens, reason, cached_tokens };
            }
            Event::Error(e) => panic!("generation failed: {e}"),
            Event::Admitted { .. } | Event::Prefilled { .. } => {}
        }
    }
}

fn prompt(len: usize, salt: u32) -> Vec<u32> {
    (0..len as u32).map(|i| (i * 37 + salt * 101 + 11) % 256).collect()
}

/// To the context limit, through every stop token.
fn unbounded(prompt: Vec<u32>, context: usize) -> GenerationRequest {
    let room = context - prompt.len();
    GenerationRequest { ignore_eos: true, ..GenerationRequest::new(prompt, room) }
}

#[test]
fn eight_unbounded_requests_on_a_small_pool_are_preempted_and_finish_unchanged() {
    let art = artifact("preempt");
    // Alone, one at a time, with the plan's whole pool (8,192 tokens) and no cache: what each
    // request must produce.
    let roomy = engine(&art, EngineOptions { prefix_cache: false, ..EngineOptions::default() });
    let context = roomy.limits.max_context;
    assert_eq!(context, 1024);
    let prompts: Vec<Vec<u32>> = (0..8).map(|i| prompt(20 + 9 * i, i as u32)).collect();
    let alone: Vec<Vec<u32>> = prompts.iter().map(|p| outcome(submit(&roomy, unbounded(p.clone(), context))).tokens).collect();
    drop(roomy);

    // Together on a 2,048-token pool: eight requests that each grow to 1,024 tokens cannot all
    // hold their pages, so the youngest are preempted and recomputed by prefill on resume.
    // (and with prompt-lookup drafts, whose pages come only from free ones on this dry pool)
    // (and with the MTP layer's drafts, whose draft layer is fed again after each preemption)
    let mtp_art = artifact_with("preempt-mtp", &["--draft", "mtp"]);
    let cases = [(false, None, None), (true, None, None), (true, Some(NgramSpeculation::new(3)), None), (true, None, Some(2))];
    for (prefix_cache, speculation, draft_model) in cases {
        let art = if draft_model.is_some() { &mtp_art } else { &art };
        let small = engine(art, EngineOptions { max_total_tokens: Some(2048), prefix_cache, speculation, draft_model, ..EngineOptions::default() });
        assert_eq!(small.limits.total_pages * small.limits.page_size, 2048);
        let rxs: Vec<_> = prompts.iter().map(|p| submit(&small, unbounded(p.clone(), context))).collect();
        for (i, rx) in rxs.into_iter().enumerate() {
            let o = outcome(rx);
            assert_eq!(o.reason, FinishReason::Length);
            assert_eq!(prompts[i].len() + o.tokens.len(), context, "request {i} ends at the context limit");
            let first_diff = o.tokens.iter().zip(&alone[i]).position(|(a, b)| a != b);
            assert_eq!(first_diff, None, "request {i} (prefix cache {prefix_cache}, speculation {speculation:?}, draft model {draft_model:?}) differs from running alone");
        }
        let preemptions = small.stats.preemptions.load(Ordering::Relaxed);
        let drafts = small.stats.draft_tokens.load(Ordering::Relaxed);
        eprintln!("prefix cache {prefix_cache}: {preemptions} preemptions, {drafts} drafts");
        assert_eq!(drafts > 0, speculation.is_some() || draft_model.is_some());
        assert!(preemptions >= 4, "8 x 1,024 tokens on a 2,048-token pool must preempt, got {preemptions}");
        // The last Finished event can arrive just before the engine releases that sequence.
        let t = std::time::Instant::now();
        while small.stats.kv_pages_used.load(Ordering::SeqCst) != 0 {
            assert!(t.elapsed() < Duration::from_secs(10), "KV pages were not given back");
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}

#[test]
fn a_repeated_long_prompt_is_served_from_the_prefix_cache() {
    let art = artifact("prefix");
    let long = prompt(600, 7);
    let greedy = |p: &[u32]| GenerationRequest { ignore_eos: true, ..GenerationRequest::new(p.to_vec(), 60) };

    let uncached = engine(&art, EngineOptions { prefix_cache: false, ..EngineOptions::default() });
    let want = outcome(submit(&uncached, greedy(&long)));
    assert_eq!(outcome(submit(&uncached, greedy(&long))).cached_tokens, 0, "disabled: nothing cached");
    drop(uncached);

    let cached = engine(&art, EngineOptions::default());
    let first = outcome(submit(&cached, greedy(&long)));
    assert_eq!((first.cached_tokens, &first.tokens), (0, &want.tokens));
    let again = outcome(submit(&cached, greedy(&long)));
    assert!(again.cached_tokens * 10 >= long.len() * 8, "{} of {} prompt tokens cached", again.cached_tokens, long.len());
    let ps = cached.limits.page_size;
    let whole_pages = (long.len() - 1) / ps * ps;
    assert_eq!(again.cached_tokens, whole_pages, "every full page but one holding the last token (its logits are needed)");
    assert_eq!(again.tokens, want.tokens, "greedy output with the cache equals the output without it");
    assert_eq!(cached.stats.prompt_tokens_cached.load(Ordering::Relaxed), whole_pages as u64, "the counter rises by as much");

    // A follow-up turn (the prompt, the answer, a new question) reuses the answer's pages too.
    let mut follow = long.clone();
    follow.extend(&first.tokens);
    follow.extend(prompt(30, 9));
    let turn = outcome(submit(&cached, greedy(&follow)));
    // The answer's last token was sampled but never fed back, so it is not cached.
    let computed = long.len() + first.tokens.len() - 1;
    assert!(computed / ps * ps > whole_pages, "the test needs the answer to fill a page");
    assert_eq!(turn.cached_tokens, computed / ps * ps, "prompt and answer, in whole pages");
    let fresh = engine(&art, EngineOptions { prefix_cache: false, ..EngineOptions::default() });
    assert_eq!(turn.tokens, outcome(submit(&fresh, greedy(&follow))).tokens);
}

/// Recompute-by-prefill gives a preempted request the output it would have had only if
/// prefill and decode agree bit for bit. They do when both run one attention form; the plan's
/// default (expanded for prefill, absorbed for decode: cheaper each) differs in f32 rounding,
/// which can flip a greedy near-tie after a preemption. The preemption test runs absorbed.
#[test]
fn prefill_and_decode_agree_bit_for_bit_in_one_attention_form() {
    let art = artifact("bitwise");
    let ids = prompt(300, 3);
    for form in [AttentionForm::Absorbed, AttentionForm::Expanded] {
        let cpu = CpuOptions { attention: Some(form), ..CpuOptions::default() };
        let mut s = Session::open(&art, None, SessionOptions { cpu, ..Default::default() }).unwrap();
        let (p, d) = (s.logits(&ids, false).unwrap(), s.logits(&ids, true).unwrap());
        let vocab = s.vocab_size();
        let differ = p.chunks(vocab).zip(d.chunks(vocab)).filter(|(a, b)| a != b).count();
        assert_eq!(differ, 0, "{form:?}: {differ} of {} rows differ between prefill and decode", ids.len());
    }
}

/// Speculative decoding feeds a sequence's drafts as extra rows of its decode step. On the CPU
/// backend a row's logits do not depend on the other rows, so a step of consecutive tokens of
/// one sequence (beside another sequence) must give, bit for bit, the logits of one token a
/// step; the prompt is longer than the tiny model's `index_topk`, so the indexer selects.
#[test]
fn a_decode_step_of_one_sequences_consecutive_tokens_equals_one_token_a_step() {
    let art = artifact("rows");
    let (a_ids, b_ids) = (prompt(300, 4), prompt(40, 5));
    let next = [17u32, 201, 5, 96];
    let open = || Session::open(&art, None, SessionOptions::default()).unwrap();
    let mut s = open();
    assert!(a_ids.len() > s.plan().model.index_topk, "the prompt must pass index_topk");
    let (a, b) = (s.new_sequence(), s.new_sequence());
    s.prefill(a, &a_ids, LogitRows::Last).unwrap();
    s.prefill(b, &b_ids, LogitRows::Last).unwrap();
    let batch: Vec<_> = [(a, next[0]), (b, next[3]), (a, next[1]), (a, next[2])].into();
    let together = s.decode(&batch).unwrap().to_vec();
    assert_eq!((s.len(a), s.len(b)), (Some(303), Some(41)));

    let mut one = open();
    let (a, b) = (one.new_sequence(), one.new_sequence());
    one.prefill(a, &a_ids, LogitRows::Last).unwrap();
    one.prefill(b, &b_ids, LogitRows::Last).unwrap();
    let vocab = one.vocab_size();
    let first = one.decode(&[(a, next[0]), (b, next[3])]).unwrap().to_vec();
    let second = one.decode(&[(a, next[1])]).unwrap().to_vec();
    let third = one.decode(&[(a, next[2])]).unwrap().to_vec();
    let rows = |v: &[f32], i: usize| v[i * vocab..(i + 1) * vocab].to_vec();
    assert!(rows(&together, 0) == rows(&first, 0), "sequence a, first token");
    assert!(rows(&together, 1) == rows(&first, 1), "sequence b");
    assert!(rows(&together, 2) == rows(&second, 0), "sequence a, second token");
    assert!(rows(&together, 3) == rows(&third, 0), "sequence a, third token");
}

/// The engine with prompt-lookup speculation serves the tiny model's output unchanged, greedy
/// and sampled (a prompt that repeats a phrase, so drafts are made; this random model seldom
/// repeats it, so they show the rejections; `demo_model` shows acceptances).
#[test]
fn speculative_decoding_serves_what_plain_decoding_serves() {
    let art = artifact("speculative");
    let phrase = prompt(9, 6);
    let repetitive: Vec<u32> = phrase.iter().cycle().take(9 * 12 + 4).copied().collect();
    let requests = || {
        [(0.0, 0u64), (0.8, 7), (1.0, 11)].map(|(temperature, seed)| {
            let sampling = kiln_engine::sampling::SamplingParams { temperature, seed, ..Default::default() };
            GenerationRequest { sampling, ignore_eos: true, ..GenerationRequest::new(repetitive.clone(), 48) }
        })
    };
    let plain = engine(&art, EngineOptions::default());
    let want: Vec<Vec<u32>> = requests().into_iter().map(|r| outcome(submit(&plain, r)).tokens).collect();
    let spec = engine(&art, EngineOptions { speculation: Some(NgramSpeculation::new(4)), ..EngineOptions::default() });
    let got: Vec<Vec<u32>> = requests().into_iter().map(|r| outcome(submit(&spec, r)).tokens).collect();
    let (drafted, accepted) = (spec.stats.draft_tokens.load(Ordering::Relaxed), spec.stats.accepted_draft_tokens.load(Ordering::Relaxed));
    eprintln!("{drafted} drafts, {accepted} accepted");
    assert_eq!(got, want);
    assert!(drafted > 0, "no drafts were made");

    // the tiny model's MTP layer as the draft model (random weights: its drafts are mostly
    // wrong, which the output must not show); the draft plan's own programs serve the same
    let art = artifact_with("speculative-mtp", &["--draft", "mtp"]);
    for draft_model in [None, Some(3)] {
        let mtp = engine(&art, EngineOptions { draft_model, ..EngineOptions::default() });
        let got: Vec<Vec<u32>> = requests().into_iter().map(|r| outcome(submit(&mtp, r)).tokens).collect();
        let (drafted, accepted) = (mtp.stats.draft_tokens.load(Ordering::Relaxed), mtp.stats.accepted_draft_tokens.load(Ordering::Relaxed));
        eprintln!("draft model {draft_model:?}: {drafted} drafts, {accepted} accepted");
        assert_eq!(got, want, "draft model {draft_model:?}");
        assert_eq!(drafted > 0, draft_model.is_some());
    }
}
