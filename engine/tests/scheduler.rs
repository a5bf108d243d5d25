//! Continuous batching against a fake backend whose outputs depend on everything cached in the
//! sequence's pages, so a page-table mix-up between concurrent sequences changes the tokens.

use kiln_engine::forward::{DecodeItem, Forward};
use kiln_engine::scheduler::{start, EngineOptions, Event, FinishReason, GenerationRequest, Rejected, TokenConstraint};
use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

const VOCAB: usize = 97;
const PAGE: usize = 4;

struct Fake {
    cache: HashMap<u32, [u32; PAGE]>,
    pages: usize,
    /// Tokens run through prefill so far (what the prefix cache saves).
    prefilled: Arc<AtomicUsize>,
}

impl Fake {
    fn write(&mut self, pages: &[u32], pos: usize, token: u32) {
        self.cache.entry(pages[pos / PAGE]).or_insert([0; PAGE])[pos % PAGE] = token;
    }

    /// Next-token logits: one-hot at (sum of cached tokens * 31 + len) mod VOCAB.
    fn logits(&self, pages: &[u32], len: usize) -> Vec<f32> {
        let sum: u64 = (0..len).map(|p| self.cache[&pages[p / PAGE]][p % PAGE] as u64).sum();
        let mut l = vec![0.0; VOCAB];
        l[((sum * 31 + len as u64) % VOCAB as u64) as usize] = 1.0;
        l
    }
}

impl Forward for Fake {
    fn vocab_size(&self) -> usize {
        VOCAB
    }
    fn page_size(&self) -> usize {
        PAGE
    }
    fn total_pages(&self) -> usize {
        self.pages
    }
    fn max_context(&self) -> usize {
        64
    }
    fn max_decode_batch(&self) -> usize {
        3
    }
    fn max_prefill_chunk(&self) -> usize {
        5
    }
    fn prefill(&mut self, pages: &[u32], start: usize, tokens: &[u32]) -> Result<Vec<f32>, String> {
        self.prefilled.fetch_add(tokens.len(), Ordering::SeqCst);
        for (i, &t) in tokens.iter().enumerate() {
            self.write(pages, start + i, t);
        }
        Ok(self.logits(pages, start + tokens.len()))
    }
    fn decode(&mut self, items: &[DecodeItem<'_>]) -> Result<Vec<f32>, String> {
        let mut out = Vec::new();
        for it in items {
            self.write(it.pages, it.pos, it.token);
            out.extend(self.logits(it.pages, it.pos + 1));
        }
        Ok(out)
    }
}

/// What one sequence alone must produce.
fn reference(prompt: &[u32], max_tokens: usize) -> Vec<u32> {
    reference_within(prompt, max_tokens, 64)
}

fn reference_within(prompt: &[u32], max_tokens: usize, context: usize) -> Vec<u32> {
    let mut seq = prompt.to_vec();
    let mut out = Vec::new();
    while out.len() < max_tokens && seq.len() < context {
        let sum: u64 = seq.iter().map(|&t| t as u64).sum();
        let next = ((sum * 31 + seq.len() as u64) % VOCAB as u64) as u32;
        out.push(next);
        seq.push(next);
    }
    out
}

fn request(prompt: Vec<u32>, max_tokens: usize) -> GenerationRequest {
    GenerationRequest::new(prompt, max_tokens)
}

fn collect(rx: &mpsc::Receiver<Event>) -> (Vec<u32>, Option<FinishReason>, Option<String>) {
    let mut toks = Vec::new();
    loop {
        match rx.recv_timeout(Duration::from_secs(10)).expect("engine answers") {
            Event::Admitted { .. } | Event::Prefilled { .. } => {}
            Event::Token { id, .. } => toks.push(id),
            Event::Finished { reason, completion_tokens, .. } => {
                assert_eq!(completion_tokens, toks.len());
                return (toks, Some(reason), None);
            }
            Event::Error(e) => return (toks, None, Some(e)),
        }
    }
}

fn fake(pages: usize) -> Box<Fake> {
    fake_counting(pages).0
}

fn fake_counting(pages: usize) -> (Box<Fake>, Arc<AtomicUsize>) {
    let prefilled = Arc::new(AtomicUsize::new(0));
    (Box::new(Fake { cache: HashMap::new(), pages, prefilled: prefilled.clone() }), prefilled)
}

fn opts(max_waiting: usize) -> EngineOptions {
    EngineOptions { max_waiting, ..EngineOptions::default() }
}

fn channel_sink() -> (kiln_engine::scheduler::EventSink, mpsc::Receiver<Event>) {
    let (tx, rx) = mpsc::channel();
    (Box::new(move |e| tx.send(e).is_ok()), rx)
}

#[test]
fn concurrent_sequences_match_running_alone_and_free_their_pages() {
    let engine = start(fake(40), opts(100));
    let mut pending = Vec::new();
    for r in 0..12u32 {
        let prompt: Vec<u32> = (0..(1 + r as usize * 3 % 13)).map(|i| (r * 7 + i as u32) % VOCAB as u32).collect();
        let max_tokens = 3 + (r as usize % 6);
        let (sink, rx) = channel_sink();
        engine.submit(request(prompt.clone(), max_tokens), sink).unwrap();
        pending.push((prompt, max_tokens, rx));
    }
    for (prompt, max_tokens, rx) in pending {
        let (toks, reason, err) = collect(&rx);
        assert_eq!(err, None);
        assert_eq!(toks, reference(&prompt, max_tokens), "prompt {prompt:?}");
        assert_eq!(reason, Some(FinishReason::Length));
    }
    wait_for_zero_pages(&engine);
}

fn wait_for_zero_pages(engine: &kiln_engine::scheduler::EngineHandle) {
    let t = Instant::now();
    while engine.stats.kv_pages_used.load(Ordering::SeqCst) != 0 {
        assert!(t.elapsed() < Duration::from_secs(10), "KV pages leaked");
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(engine.stats.running.load(Ordering::SeqCst), 0);
}

#[test]
fn a_cancelled_client_frees_its_pages_at_once() {
    let engine = start(fake(40), opts(100));
    let (tx, rx) = mpsc::channel();
    let mut left = 3;
    // The "client" hangs up after three tokens.
    engine
        .submit(
            request(vec![1, 2, 3], 50),
            Box::new(move |e| {
                if matches!(e, Event::Token { .. }) {
                    left -= 1;
                }
                tx.send(e).is_ok() && left > 0
            }),
        )
        .unwrap();
    let got: Vec<Event> = rx.iter().filter(|e| matches!(e, Event::Token { .. })).collect();
    assert_eq!(got.len(), 3);
    wait_for_zero_pages(&engine);

    // Clients that leave while queued or during prefill are dropped before any token.
    for hang_up_on in [0usize, 1] {
        let (tx, rx) = mpsc::channel();
        let mut seen = 0;
        engine
            .submit(
                request((0..12).collect(), 50),
                Box::new(move |e| {
                    let alive = seen < hang_up_on;
                    seen += 1;
                    let _ = tx.send(e);
                    alive
                }),
            )
            .unwrap();
        let got: Vec<Event> = rx.iter().collect();
        assert!(got.iter().all(|e| !matches!(e, Event::Token { .. })), "{got:?}");
        wait_for_zero_pages(&engine);
    }
}

#[test]
fn stop_tokens_and_rejections() {
    let engine = start(fake(8), opts(100));
    let prompt = vec![5, 6];
    let expected = reference(&prompt, 10);
    let (sink, rx) = channel_sink();
    let mut r = request(prompt, 10);
    r.stop_ids = vec![expected[2]];
    engine.submit(r, sink).unwrap();
    let (toks, reason, _) = collect(&rx);
    assert_eq!(toks, expected[..2], "stops before the stop token, which is not emitted");
    assert_eq!(reason, Some(FinishReason::Stop));

    let invalid = |r: GenerationRequest, needle: &str| {
        let (sink, _rx) = channel_sink();
        match engine.submit(r, sink) {
            Err(Rejected::Invalid(m)) => assert!(m.contains(needle), "{m}"),
            other => panic!("expected Invalid({needle}), got {other:?}"),
        }
    };
    invalid(request(vec![], 4), "empty");
    invalid(request(vec![1, 500], 4), "token id 500");
    invalid(request(vec![1; 64], 4), "context");
    invalid(request(vec![1], 0), "max_tokens");
    let mut bad = request(vec![1], 4);
    bad.sampling.top_p = 0.0;
    invalid(bad, "top_p");

    // The pool (8 pages of 4) caps the context at 32 tokens: a longer prompt is refused, and
    // a sequence stops at 32 tokens with nothing leaked.
    assert_eq!(engine.limits.max_context, 32);
    invalid(request(vec![1; 32], 4), "context is 32 tokens");
    let (sink, rx) = channel_sink();
    engine.submit(request(vec![1; 20], 20), sink).unwrap();
    let (toks, reason, _) = collect(&rx);
    assert_eq!((toks.len(), reason), (12, Some(FinishReason::Length)));
    wait_for_zero_pages(&engine);

    // The test hook replaces sampling, then stops.
    let (sink, rx) = channel_sink();
    let mut forced = request(vec![1, 2], 10);
    forced.forced = Some(vec![7, 8, 9]);
    engine.submit(forced, sink).unwrap();
    let (toks, reason, _) = collect(&rx);
    assert_eq!((toks, reason), (vec![7, 8, 9], Some(FinishReason::Stop)));

    // No queue at all: free decode slots (3) still take requests; past them, 429.
    let full = start(Box::new(Slow(fake(40))), opts(0));
    let mut keep = Vec::new();
    for _ in 0..3 {
        let (sink, rx) = channel_sink();
        full.submit(request(vec![1], 40), sink).expect("a free decode slot takes it");
        keep.push(rx);
    }
    let (sink, _rx) = channel_sink();
    assert!(matches!(full.submit(request(vec![1], 2), sink), Err(Rejected::QueueFull { .. })));
}

/// A fake whose every decode step takes 20 ms, so requests stay running while a test looks.
struct Slow(Box<Fake>);

impl Forward for Slow {
    fn vocab_size(&self) -> usize {
        VOCAB
    }
    fn page_size(&self) -> usize {
        PAGE
    }
    fn total_pages(&self) -> usize {
        self.0.total_pages()
    }
    fn max_context(&self) -> usize {
        64
    }
    fn max_decode_batch(&self) -> usize {
        3
    }
    fn max_prefill_chunk(&self) -> usize {
        5
    }
    fn prefill(&mut self, pages: &[u32], start: usize, tokens: &[u32]) -> Result<Vec<f32>, String> {
        self.0.prefill(pages, start, tokens)
    }
    fn decode(&mut self, items: &[DecodeItem<'_>]) -> Result<Vec<f32>, String> {
        std::thread::sleep(Duration::from_millis(20));
        self.0.decode(items)
    }
}

/// A backend that dies: the engine reports itself stopped and no client hangs.
struct Crashing;

impl Forward for Crashing {
    fn vocab_size(&self) -> usize {
        VOCAB
    }
    fn page_size(&self) -> usize {
        PAGE
    }
    fn total_pages(&self) -> usize {
        8
    }
    fn max_context(&self) -> usize {
        32
    }
    fn max_decode_batch(&self) -> usize {
        2
    }
    fn max_prefill_chunk(&self) -> usize {
        4
    }
    fn prefill(&mut self, _: &[u32], _: usize, _: &[u32]) -> Result<Vec<f32>, String> {
        panic!("backend bug");
    }
    fn decode(&mut self, _: &[DecodeItem<'_>]) -> Result<Vec<f32>, String> {
        unreachable!()
    }
}

#[test]
fn a_dead_engine_is_reported_and_releases_its_clients() {
    let engine = start(Box::new(Crashing), opts(10));
    let (sink, rx) = channel_sink();
    engine.submit(request(vec![1, 2], 4), sink).unwrap();
    // The sink is dropped with the engine thread: the client sees the channel close.
    while let Ok(e) = rx.recv_timeout(Duration::from_secs(10)) {
        assert!(matches!(e, Event::Admitted { .. }), "{e:?}");
    }
    let t = Instant::now();
    while !engine.stats.stopped.load(Ordering::SeqCst) {
        assert!(t.elapsed() < Duration::from_secs(10));
        std::thread::sleep(Duration::from_millis(5));
    }
    let (sink, _rx) = channel_sink();
    assert!(matches!(engine.submit(request(vec![1], 2), sink), Err(Rejected::Stopped)));
}

/// Runs `prompts` concurrently to the context limit; returns each one's tokens.
fn run_all(engine: &kiln_engine::scheduler::EngineHandle, prompts: &[Vec<u32>], max_tokens: usize) -> Vec<(Vec<u32>, Option<FinishReason>)> {
    let rxs: Vec<_> = prompts
        .iter()
        .map(|p| {
            let (sink, rx) = channel_sink();
            engine.submit(request(p.clone(), max_tokens), sink).unwrap();
            rx
        })
        .collect();
    rxs.iter()
        .map(|rx| {
            let (toks, reason, err) = collect(rx);
            assert_eq!(err, None);
            (toks, reason)
        })
        .collect()
}

#[test]
fn a_dry_pool_preempts_the_youngest_and_recomputes_it_unchanged() {
    // 6 pages of 4 tokens: context 24. Three sequences that each grow to 24 tokens need 18
    // pages: they cannot all hold theirs, so the younger ones are preempted and resumed by
    // prefill, with and without the prefix cache keeping their pages meanwhile.
    for prefix_cache in [true, false] {
        let engine = start(fake(6), EngineOptions { max_waiting: 10, max_total_tokens: None, prefix_cache, ..EngineOptions::default() });
        assert_eq!(engine.limits.max_context, 24);
        let prompts: Vec<Vec<u32>> = (0..3u32).map(|r| (0..5).map(|i| (r * 11 + i * 3 + 1) % VOCAB as u32).collect()).collect();
        for (p, (toks, reason)) in prompts.iter().zip(run_all(&engine, &prompts, 1000)) {
            assert_eq!(toks, reference_within(p, 1000, 24), "prompt {p:?}, prefix cache {prefix_cache}");
            assert_eq!(reason, Some(FinishReason::Length));
        }
        assert!(engine.stats.preemptions.load(Ordering::Relaxed) > 0, "the pool was too small for all three");
        wait_for_zero_pages(&engine);
    }
}

#[test]
fn max_total_tokens_caps_the_pool_and_the_context() {
    let engine = start(fake(40), EngineOptions { max_waiting: 10, max_total_tokens: Some(30), prefix_cache: true, ..EngineOptions::default() });
    assert_eq!((engine.limits.total_pages, engine.limits.max_context), (7, 28));
    assert_eq!(engine.stats.kv_pages_total.load(Ordering::SeqCst), 7);
}

fn admitted_cached(rx: &mpsc::Receiver<Event>) -> usize {
    match rx.recv_timeout(Duration::from_secs(10)).expect("engine answers") {
        Event::Admitted { cached_tokens } => cached_tokens,
        other => panic!("expected Admitted, got {other:?}"),
    }
}

#[test]
fn the_prefix_cache_serves_repeated_and_extended_prompts() {
    let (model, prefilled) = fake_counting(40);
    let engine = start(model, opts(10));
    let prompt: Vec<u32> = (0..17).map(|i| (i * 5 + 2) % VOCAB as u32).collect();
    let expected = reference(&prompt, 6);
    let ask = |p: &[u32], max_tokens: usize| {
        let (sink, rx) = channel_sink();
        engine.submit(request(p.to_vec(), max_tokens), sink).unwrap();
        let cached = admitted_cached(&rx);
        let (toks, _, err) = collect(&rx);
        assert_eq!(err, None);
        (cached, toks)
    };
    assert_eq!(ask(&prompt, 6), (0, expected.clone()));
    let before = prefilled.load(Ordering::SeqCst);
    // The same prompt again: its 4 full pages come from the cache (not the partial fifth, and
    // never the last token, whose logits are needed), the output is unchanged.
    assert_eq!(ask(&prompt, 6), (16, expected.clone()));
    assert_eq!(prefilled.load(Ordering::SeqCst) - before, 1, "only the last token is prefilled");
    assert_eq!(engine.stats.prompt_tokens_cached.load(Ordering::Relaxed), 16);
    // A prompt that diverges at token 9 shares the first two pages.
    let mut other = prompt.clone();
    other[9] = (other[9] + 1) % VOCAB as u32;
    assert_eq!(ask(&other, 3), (8, reference(&other, 3)));
    // A follow-up turn (prompt + answer + more) reuses the pages the answer filled in decode.
    let mut follow_up = prompt.clone();
    follow_up.extend(&expected);
    follow_up.extend([7, 7, 7]);
    let (cached, toks) = ask(&follow_up, 3);
    assert_eq!(cached, 20, "prompt 17 + answer 6 = 23 cached tokens: 5 full pages");
    assert_eq!(toks, reference(&follow_up, 3));
    wait_for_zero_pages(&engine);
    assert!(engine.stats.kv_pages_cached.load(Ordering::SeqCst) > 0, "idle pages stay cached");

    // Disabled: nothing is served from the cache, the output is the same.
    let engine = start(fake(40), EngineOptions { max_waiting: 10, max_total_tokens: None, prefix_cache: false, ..EngineOptions::default() });
    for _ in 0..2 {
        let (sink, rx) = channel_sink();
        engine.submit(request(prompt.clone(), 6), sink).unwrap();
        assert_eq!(admitted_cached(&rx), 0);
        assert_eq!(collect(&rx).0, expected);
    }
}

#[test]
fn identical_concurrent_prompts_compute_their_prefix_once() {
    let (model, prefilled) = fake_counting(40);
    let engine = start(model, opts(10));
    let prompt: Vec<u32> = (0..13).map(|i| (i * 3 + 1) % VOCAB as u32).collect();
    let results = run_all(&engine, &vec![prompt.clone(); 3], 2);
    for (toks, _) in &results {
        assert_eq!(toks, &reference(&prompt, 2));
    }
    assert_eq!(prefilled.load(Ordering::SeqCst), 13 + 2, "the later two wait for the first one's pages");
}

/// Allows only `a` and `b`, alternately, and is complete after `n` tokens.
struct Alternate {
    a: u32,
    b: u32,
    n: usize,
    seen: usize,
}

impl TokenConstraint for Alternate {
    fn mask(&mut self, logits: &mut [f32]) -> Result<(), String> {
        let allowed = if self.seen.is_multiple_of(2) { self.a } else { self.b };
        logits.iter_mut().enumerate().filter(|(i, _)| *i as u32 != allowed).for_each(|(_, l)| *l = f32::NEG_INFINITY);
        Ok(())
    }
    fn commit(&mut self, token: u32) -> Result<(), String> {
        let allowed = if self.seen.is_multiple_of(2) { self.a } else { self.b };
        self.seen += 1;
        if token == allowed { Ok(()) } else { Err(format!("{token} was not allowed")) }
    }
    fn is_finished(&self) -> bool {
        self.seen >= self.n
    }
}

#[test]
fn constraints_logprobs_and_min_tokens_shape_the_output() {
    let engine = start(fake(40), opts(10));
    let prompt = vec![3, 1, 4];
    let (sink, rx) = channel_sink();
    let mut r = request(prompt.clone(), 20);
    r.constraint = Some(Box::new(Alternate { a: 5, b: 6, n: 4, seen: 0 }));
    r.logprobs = Some(2);
    engine.submit(r, sink).unwrap();
    let events: Vec<Event> = rx.iter().collect();
    let tokens: Vec<(u32, f32, u32)> = events
        .iter()
        .filter_map(|e| match e {
            Event::Token { id, logprobs: Some(l) } => Some((*id, l.logprob, l.top[0].0)),
            _ => None,
        })
        .collect();
    assert_eq!(tokens.iter().map(|t| t.0).collect::<Vec<_>>(), vec![5, 6, 5, 6]);
    assert!(matches!(events.last(), Some(Event::Finished { reason: FinishReason::Stop, completion_tokens: 4, .. })));
    // The fake's logits are one-hot (1 at the unconstrained choice, 0 elsewhere): the forced
    // tokens' log-probability is -ln(e + VOCAB - 1) and the model's own choice ranks first.
    let z = (1f32.exp() + (VOCAB - 1) as f32).ln();
    let mut seq = prompt.clone();
    for (id, lp, top) in tokens {
        let own = reference(&seq, 1)[0];
        assert_eq!(top, own);
        let want = if id == own { 1.0 - z } else { -z };
        assert!((lp - want).abs() < 1e-5, "{lp} vs {want}");
        seq.push(id);
    }

    // min_tokens masks the stop ids until enough tokens are out.
    let first = reference(&prompt, 1)[0];
    let (sink, rx) = channel_sink();
    let mut r = request(prompt.clone(), 10);
    r.stop_ids = vec![first];
    r.min_tokens = 3;
    engine.submit(r, sink).unwrap();
    let (toks, _, _) = collect(&rx);
    assert!(toks.len() >= 3 && !toks[..3].contains(&first), "{toks:?}");

    let (sink, _rx) = channel_sink();
    let mut r = request(prompt, 10);
    r.logprobs = Some(21);
    assert!(matches!(engine.submit(r, sink), Err(Rejected::Invalid(m)) if m.contains("20")));
}

/// Logits with a NaN whenever the last cached token is 13 (a "broken kernel" on some inputs).
struct Poisoned(Box<Fake>);

impl Forward for Poisoned {
    fn vocab_size(&self) -> usize {
        VOCAB
    }
    fn page_size(&self) -> usize {
        PAGE
    }
    fn total_pages(&self) -> usize {
        self.0.total_pages()
    }
    fn max_context(&self) -> usize {
        64
    }
    fn max_decode_batch(&self) -> usize {
        3
    }
    fn max_prefill_chunk(&self) -> usize {
        5
    }
    fn prefill(&mut self, pages: &[u32], start: usize, tokens: &[u32]) -> Result<Vec<f32>, String> {
        let mut l = self.0.prefill(pages, start, tokens)?;
        if tokens.last() == Some(&13) {
            l[3] = f32::NAN;
        }
        Ok(l)
    }
    fn decode(&mut self, items: &[DecodeItem<'_>]) -> Result<Vec<f32>, String> {
        let mut l = self.0.decode(items)?;
        for (row, it) in items.iter().enumerate() {
            if it.token == 13 {
                l[row * VOCAB] = f32::INFINITY;
            }
        }
        Ok(l)
    }
    fn last_program(&self) -> Option<String> {
        Some("decode_3".into())
    }
}

#[test]
fn nan_logits_fail_only_their_request_naming_the_program() {
    let engine = start(Box::new(Poisoned(fake(40))), opts(10));
    let (sink, bad) = channel_sink();
    engine.submit(request(vec![1, 2, 13], 5), sink).unwrap();
    let (sink, good) = channel_sink();
    let healthy = vec![1, 2, 3];
    assert!(!reference(&healthy, 5).contains(&13), "the healthy request must not meet the poison");
    engine.submit(request(healthy.clone(), 5), sink).unwrap();
    let (toks, _, err) = collect(&bad);
    let err = err.expect("the poisoned request fails");
    assert!(toks.is_empty() && err.contains("NaN") && err.contains("decode_3") && err.contains("kiln verify"), "{err}");
    let (toks, reason, err) = collect(&good);
    assert_eq!((toks, reason, err), (reference(&healthy, 5), Some(FinishReason::Length), None));
    assert_eq!(engine.stats.non_finite.load(Ordering::Relaxed), 1);
    wait_for_zero_pages(&engine);
}
