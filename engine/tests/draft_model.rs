//! Speculative decoding with a draft model (`Forward::draft`: the plan's MTP layer) against a
//! fake backend whose model repeats its context with a period and whose draft model predicts
//! that from its own KV cache: the draft layer's KV at position p holds the token it was given
//! there (the token at p + 1), so a draft is right exactly when the engine fed the draft layer
//! every position in order, each beside the model's hidden state at that position. The hidden
//! rows carry their position, and every draft row checks it. Held against the same requests on
//! an engine without drafts: the same tokens, in fewer steps.

use kiln_engine::forward::{DecodeItem, Forward};
use kiln_engine::sampling::SamplingParams;
use kiln_engine::scheduler::{start, EngineHandle, EngineOptions, Event, GenerationRequest};
use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{mpsc, Arc};
use std::time::Duration;

const VOCAB: usize = 40;
const PAGE: usize = 4;
const BATCH: usize = 6;
const PERIOD: usize = 5;
/// Hidden rows: (position, token at it).
const HIDDEN: usize = 2;

#[derive(Default)]
struct Counters {
    decode_calls: AtomicUsize,
    draft_rows: AtomicUsize,
    /// Draft rows whose hidden row was not the state at their position.
    misaligned: AtomicUsize,
}

struct Fake {
    /// The model's cache: the token at each position.
    cache: HashMap<u32, [u32; PAGE]>,
    /// The draft layer's cache: at position p, the token it was given there (the one at p + 1).
    draft_cache: HashMap<u32, [u32; PAGE]>,
    /// The draft model also errs where the next position is a multiple of this (0: never).
    draft_wrong_every: usize,
    soft: bool,
    hidden: Vec<f32>,
    counters: Arc<Counters>,
}

fn at(cache: &HashMap<u32, [u32; PAGE]>, pages: &[u32], p: usize) -> u32 {
    cache[&pages[p / PAGE]][p % PAGE]
}

/// The model's choice after the tokens at positions `< len`: the token one period back (the
/// last one while the context is shorter), every 7th position that plus one.
fn rule(len: usize, back: u32) -> u32 {
    if len % 7 == 0 {
        (back + 1) % VOCAB as u32
    } else {
        back
    }
}

impl Fake {
    fn write(cache: &mut HashMap<u32, [u32; PAGE]>, pages: &[u32], pos: usize, token: u32) {
        cache.entry(pages[pos / PAGE]).or_insert([0; PAGE])[pos % PAGE] = token;
    }

    fn logits(&self, next: u32, len: usize) -> Vec<f32> {
        if self.soft {
            (0..VOCAB).map(|t| if t == next as usize { 6.0 } else { ((t * 13 + len * 7) % 11) as f32 * 0.1 }).collect()
        } else {
            (0..VOCAB).map(|t| if t == next as usize { 1.0 } else { 0.0 }).collect()
        }
    }

    fn model_logits(&self, pages: &[u32], len: usize) -> Vec<f32> {
        let back = at(&self.cache, pages, if len >= PERIOD { len - PERIOD } else { len - 1 });
        self.logits(rule(len, back), len)
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
        96
    }
    fn max_context(&self) -> usize {
        96
    }
    fn max_decode_batch(&self) -> usize {
        BATCH
    }
    fn max_prefill_chunk(&self) -> usize {
        8
    }
    fn prefill(&mut self, pages: &[u32], start: usize, tokens: &[u32]) -> Result<Vec<f32>, String> {
        self.hidden.clear();
        for (i, &t) in tokens.iter().enumerate() {
            Fake::write(&mut self.cache, pages, start + i, t);
            self.hidden.extend([(start + i) as f32, t as f32]);
        }
        Ok(self.model_logits(pages, start + tokens.len()))
    }
    fn decode(&mut self, items: &[DecodeItem<'_>]) -> Result<Vec<f32>, String> {
        assert!(items.len() <= BATCH, "a step of {} rows; the plan's largest batch is {BATCH}", items.len());
        self.counters.decode_calls.fetch_add(1, Ordering::SeqCst);
        self.hidden.clear();
        for it in items {
            Fake::write(&mut self.cache, it.pages, it.pos, it.token);
            self.hidden.extend([it.pos as f32, it.token as f32]);
        }
        Ok(items.iter().flat_map(|it| self.model_logits(it.pages, it.pos + 1)).collect())
    }
    fn draft_hidden_size(&self) -> Option<usize> {
        Some(HIDDEN)
    }
    fn hidden_rows(&self) -> Vec<f32> {
        self.hidden.clone()
    }
    /// Row i: the token at `pos + 1` beside the hidden state at `pos`; predicts the token at
    /// `pos + 2` from the draft layer's own cache, as the model would from its.
    fn draft(&mut self, items: &[DecodeItem<'_>], hidden: &[f32]) -> Result<(Vec<f32>, Vec<f32>), String> {
        assert_eq!(hidden.len(), items.len() * HIDDEN);
        assert!(items.len() <= BATCH * 16, "{} draft rows", items.len());
        self.counters.draft_rows.fetch_add(items.len(), Ordering::SeqCst);
        for (it, h) in items.iter().zip(hidden.chunks_exact(HIDDEN)) {
            if h[0] != it.pos as f32 {
                self.counters.misaligned.fetch_add(1, Ordering::SeqCst);
            }
            Fake::write(&mut self.draft_cache, it.pages, it.pos, it.token);
        }
        let mut logits = Vec::new();
        let mut out = Vec::new();
        for it in items {
            // the token at position q is the draft layer's entry at q - 1
            let len = it.pos + 2;
            let back = match len {
                _ if len < PERIOD => it.token,
                // the prompt's first token is never given to the draft layer
                _ if len == PERIOD => at(&self.cache, it.pages, 0),
                _ => at(&self.draft_cache, it.pages, len - PERIOD - 1),
            };
            let mut next = rule(len, back);
            if self.draft_wrong_every > 0 && len % self.draft_wrong_every == 0 {
                next = (next + 2) % VOCAB as u32;
            }
            logits.extend(self.logits(next, len));
            out.extend([(it.pos + 1) as f32, next as f32]);
        }
        Ok((logits, out))
    }
}

fn engine(draft_wrong_every: usize, soft: bool, draft_model: Option<usize>) -> (EngineHandle, Arc<Counters>) {
    let counters = Arc::new(Counters::default());
    let model = Fake { cache: HashMap::new(), draft_cache: HashMap::new(), draft_wrong_every, soft, hidden: Vec::new(), counters: counters.clone() };
    (start(Box::new(model), EngineOptions { draft_model, ..EngineOptions::default() }), counters)
}

fn run(e: &EngineHandle, requests: Vec<GenerationRequest>) -> Vec<Vec<Event>> {
    let rxs: Vec<_> = requests
        .into_iter()
        .map(|r| {
            let (tx, rx) = mpsc::channel();
            e.submit(r, Box::new(move |ev| tx.send(ev).is_ok())).unwrap();
            rx
        })
        .collect();
    rxs.iter()
        .map(|rx| {
            let mut out = Vec::new();
            loop {
                let e = rx.recv_timeout(Duration::from_secs(10)).expect("the engine answers");
                match e {
                    Event::Admitted { .. } | Event::Prefilled { .. } => continue,
                    Event::Finished { .. } | Event::Error(_) => {
                        out.push(e);
                        return out;
                    }
                    Event::Token { .. } => out.push(e),
                }
            }
        })
        .collect()
}

fn prompt(salt: u32, len: usize) -> Vec<u32> {
    (0..len as u32).map(|i| (i * 11 + salt * 17 + 3) % VOCAB as u32).collect()
}

/// Prompts of 3 to 19 tokens (one longer than two prefill chunks), budgets that end mid-draft.
fn requests(sampling: SamplingParams) -> Vec<GenerationRequest> {
    (0..5u32)
        .map(|r| {
            let mut q = GenerationRequest::new(prompt(r, 3 + 4 * r as usize), 17 + 6 * r as usize);
            q.sampling = SamplingParams { seed: 500 + r as u64, ..sampling };
            q
        })
        .collect()
}

#[test]
fn a_draft_model_fed_every_position_in_order_drafts_what_the_model_chooses() {
    let (plain, plain_counts) = engine(0, false, None);
    let want = run(&plain, requests(SamplingParams::default()));
    let (spec, counts) = engine(0, false, Some(3));
    let got = run(&spec, requests(SamplingParams::default()));
    assert_eq!(got, want);
    let (drafted, accepted) = (spec.stats.draft_tokens.load(Ordering::Relaxed), spec.stats.accepted_draft_tokens.load(Ordering::Relaxed));
    let steps = (plain_counts.decode_calls.load(Ordering::SeqCst), counts.decode_calls.load(Ordering::SeqCst));
    eprintln!("{drafted} drafts, {accepted} accepted; {} decode steps plain, {} with drafts", steps.0, steps.1);
    assert_eq!(counts.misaligned.load(Ordering::SeqCst), 0, "a draft row beside the hidden state of another position");
    // the draft layer's cache is complete and in order, so every draft is the model's choice
    assert!(drafted > 30, "{drafted} drafts");
    assert_eq!(accepted, drafted, "a draft the model did not choose: the draft layer missed a position");
    assert!(steps.1 < steps.0, "{} steps with drafts against {} without", steps.1, steps.0);
    // alone, with rows to spare for all three drafts a step: four tokens a step
    let (plain, _) = engine(0, false, None);
    let want = run(&plain, vec![GenerationRequest::new(prompt(9, 6), 41)]);
    let (spec, counts) = engine(0, false, Some(3));
    assert_eq!(run(&spec, vec![GenerationRequest::new(prompt(9, 6), 41)]), want);
    assert_eq!(counts.decode_calls.load(Ordering::SeqCst), 10, "40 tokens after the prefill's, 4 a step");
}

#[test]
fn wrong_drafts_and_sampling_leave_the_output_unchanged() {
    let sampling = SamplingParams { temperature: 0.8, top_p: 0.9, presence_penalty: 0.2, ..SamplingParams::default() };
    for (soft, sampling) in [(false, SamplingParams::default()), (true, sampling)] {
        let (plain, _) = engine(0, soft, None);
        let want = run(&plain, requests(sampling));
        let (spec, counts) = engine(3, soft, Some(2));
        let got = run(&spec, requests(sampling));
        assert_eq!(got, want, "soft {soft}");
        let (drafted, accepted) = (spec.stats.draft_tokens.load(Ordering::Relaxed), spec.stats.accepted_draft_tokens.load(Ordering::Relaxed));
        eprintln!("soft {soft}: {drafted} drafts, {accepted} accepted");
        assert_eq!(counts.misaligned.load(Ordering::SeqCst), 0);
        assert!(accepted > 0 && drafted > accepted, "drafted {drafted}, accepted {accepted}");
    }
}
