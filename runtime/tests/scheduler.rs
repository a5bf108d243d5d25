//! Continuous batching against a fake backend whose outputs depend on everything cached in the
//! sequence's pages, so a page-table mix-up between concurrent sequences changes the tokens.

use kiln_runtime::engine::forward::{DecodeItem, Forward};
use kiln_runtime::engine::sampling::SamplingParams;
use kiln_runtime::engine::scheduler::{start, Event, FinishReason, GenerationRequest, Rejected};
use std::collections::HashMap;
use std::sync::mpsc;
use std::time::{Duration, Instant};

const VOCAB: usize = 97;
const PAGE: usize = 4;

struct Fake {
    cache: HashMap<u32, [u32; PAGE]>,
    pages: usize,
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
    let mut seq = prompt.to_vec();
    let mut out = Vec::new();
    while out.len() < max_tokens && seq.len() < 64 {
        let sum: u64 = seq.iter().map(|&t| t as u64).sum();
        let next = ((sum * 31 + seq.len() as u64) % VOCAB as u64) as u32;
        out.push(next);
        seq.push(next);
    }
    out
}

fn request(prompt: Vec<u32>, max_tokens: usize) -> GenerationRequest {
    GenerationRequest { prompt, max_tokens, sampling: SamplingParams::default(), stop_ids: vec![], ignore_eos: false, forced: None }
}

fn collect(rx: &mpsc::Receiver<Event>) -> (Vec<u32>, Option<FinishReason>, Option<String>) {
    let mut toks = Vec::new();
    loop {
        match rx.recv_timeout(Duration::from_secs(10)).expect("engine answers") {
            Event::Admitted | Event::Prefilled { .. } => {}
            Event::Token(t) => toks.push(t),
            Event::Finished { reason, completion_tokens, .. } => {
                assert_eq!(completion_tokens, toks.len());
                return (toks, Some(reason), None);
            }
            Event::Error(e) => return (toks, None, Some(e)),
        }
    }
}

fn channel_sink() -> (kiln_runtime::engine::scheduler::EventSink, mpsc::Receiver<Event>) {
    let (tx, rx) = mpsc::channel();
    (Box::new(move |e| tx.send(e).is_ok()), rx)
}

#[test]
fn concurrent_sequences_match_running_alone_and_free_their_pages() {
    let engine = start(Box::new(Fake { cache: HashMap::new(), pages: 40 }), 100);
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

fn wait_for_zero_pages(engine: &kiln_runtime::engine::scheduler::EngineHandle) {
    let t = Instant::now();
    while engine.stats.kv_pages_used.load(std::sync::atomic::Ordering::SeqCst) != 0 {
        assert!(t.elapsed() < Duration::from_secs(10), "KV pages leaked");
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(engine.stats.running.load(std::sync::atomic::Ordering::SeqCst), 0);
}

#[test]
fn a_cancelled_client_frees_its_pages_at_once() {
    let engine = start(Box::new(Fake { cache: HashMap::new(), pages: 40 }), 100);
    let (tx, rx) = mpsc::channel();
    let mut left = 3;
    // The "client" hangs up after three tokens.
    engine
        .submit(
            request(vec![1, 2, 3], 50),
            Box::new(move |e| {
                if matches!(e, Event::Token(_)) {
                    left -= 1;
                }
                tx.send(e).is_ok() && left > 0
            }),
        )
        .unwrap();
    let got: Vec<Event> = rx.iter().filter(|e| matches!(e, Event::Token(_))).collect();
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
        assert!(got.iter().all(|e| !matches!(e, Event::Token(_))), "{got:?}");
        wait_for_zero_pages(&engine);
    }
}

#[test]
fn stop_tokens_and_rejections() {
    let engine = start(Box::new(Fake { cache: HashMap::new(), pages: 8 }), 100);
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

    // Needs 10 pages but the backend has 8: an error event, nothing leaked.
    let (sink, rx) = channel_sink();
    engine.submit(request(vec![1; 20], 20), sink).unwrap();
    let (_, _, err) = collect(&rx);
    assert!(err.unwrap().contains("KV pages"));
    wait_for_zero_pages(&engine);

    // The test hook replaces sampling, then stops.
    let (sink, rx) = channel_sink();
    let mut forced = request(vec![1, 2], 10);
    forced.forced = Some(vec![7, 8, 9]);
    engine.submit(forced, sink).unwrap();
    let (toks, reason, _) = collect(&rx);
    assert_eq!((toks, reason), (vec![7, 8, 9], Some(FinishReason::Stop)));

    let full = start(Box::new(Fake { cache: HashMap::new(), pages: 8 }), 0);
    let (sink, _rx) = channel_sink();
    assert!(matches!(full.submit(request(vec![1], 2), sink), Err(Rejected::QueueFull { .. })));
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
    let engine = start(Box::new(Crashing), 10);
    let (sink, rx) = channel_sink();
    engine.submit(request(vec![1, 2], 4), sink).unwrap();
    // The sink is dropped with the engine thread: the client sees the channel close.
    while let Ok(e) = rx.recv_timeout(Duration::from_secs(10)) {
        assert!(matches!(e, Event::Admitted), "{e:?}");
    }
    let t = Instant::now();
    while !engine.stats.stopped.load(std::sync::atomic::Ordering::SeqCst) {
        assert!(t.elapsed() < Duration::from_secs(10));
        std::thread::sleep(Duration::from_millis(5));
    }
    let (sink, _rx) = channel_sink();
    assert!(matches!(engine.submit(request(vec![1], 2), sink), Err(Rejected::Stopped)));
}
