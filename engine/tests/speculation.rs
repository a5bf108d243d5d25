//! Speculative decoding with prompt-lookup drafts against a fake backend that mostly repeats its
//! context with a period (so drafts are often right) but not always (so some are wrong). Held
//! against the same requests on an engine without speculation: the tokens (and log-probabilities)
//! must be the same, sampled or greedy, with penalties and stop ids, while steps yield more than
//! one token.

use kiln_engine::forward::{DecodeItem, Forward};
use kiln_engine::sampling::SamplingParams;
use kiln_engine::scheduler::{start, EngineHandle, EngineOptions, Event, FinishReason, GenerationRequest, NgramSpeculation, TokenConstraint};
use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{mpsc, Arc};
use std::time::Duration;

const VOCAB: usize = 50;
const PAGE: usize = 4;
const BATCH: usize = 6;
const PERIOD: usize = 5;

#[derive(Default)]
struct Counters {
    decode_calls: AtomicUsize,
    decode_rows: AtomicUsize,
}

/// What the fake says a decode step of `rows` rows costs.
#[derive(Clone, Copy)]
enum Cost {
    /// Nothing (drafts fill the spare rows).
    Unknown,
    /// Every row as much as a step's first: a draft never pays.
    PerRow,
    /// A GPU's shape: 1 row 1.0, 2 rows 1.25, up to 4 1.6, up to 8 2.2 (GLM-5's predicted
    /// batch 1, 2, 4, 8 steps at 8k context, rounded).
    Buckets,
}

/// The next token's logits from the cached tokens at positions `< len` only: mostly the token
/// one period back, but every `wrong_every`-th position that token plus one, so a draft copied
/// from the context is wrong there. `soft`: a peaked distribution instead of one-hot.
struct Periodic {
    cache: HashMap<u32, [u32; PAGE]>,
    soft: bool,
    wrong_every: usize,
    cost: Cost,
    counters: Arc<Counters>,
}

impl Periodic {
    fn write(&mut self, pages: &[u32], pos: usize, token: u32) {
        self.cache.entry(pages[pos / PAGE]).or_insert([0; PAGE])[pos % PAGE] = token;
    }

    fn logits(&self, pages: &[u32], len: usize) -> Vec<f32> {
        let at = |p: usize| self.cache[&pages[p / PAGE]][p % PAGE];
        let back = if len >= PERIOD { at(len - PERIOD) } else { at(len - 1) };
        let next = if len % self.wrong_every == 0 { (back + 1) % VOCAB as u32 } else { back } as usize;
        if self.soft {
            // position-dependent runners-up, so a sample off the peak is not always the same token
            (0..VOCAB).map(|t| if t == next { 6.0 } else { ((t * 13 + len * 7) % 11) as f32 * 0.1 }).collect()
        } else {
            (0..VOCAB).map(|t| if t == next { 1.0 } else { 0.0 }).collect()
        }
    }
}

impl Forward for Periodic {
    fn vocab_size(&self) -> usize {
        VOCAB
    }
    fn page_size(&self) -> usize {
        PAGE
    }
    fn total_pages(&self) -> usize {
        64
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
        for (i, &t) in tokens.iter().enumerate() {
            self.write(pages, start + i, t);
        }
        Ok(self.logits(pages, start + tokens.len()))
    }
    fn decode(&mut self, items: &[DecodeItem<'_>]) -> Result<Vec<f32>, String> {
        assert!(items.len() <= BATCH, "a step of {} rows; the plan's largest batch is {BATCH}", items.len());
        self.counters.decode_calls.fetch_add(1, Ordering::SeqCst);
        self.counters.decode_rows.fetch_add(items.len(), Ordering::SeqCst);
        // every row's KV first, as a layer writes the cache before it attends
        for it in items {
            self.write(it.pages, it.pos, it.token);
        }
        Ok(items.iter().flat_map(|it| self.logits(it.pages, it.pos + 1)).collect())
    }
    fn decode_cost(&mut self, rows: usize) -> Option<f64> {
        match self.cost {
            Cost::Unknown => None,
            Cost::PerRow => Some(rows as f64),
            Cost::Buckets => Some(match rows {
                1 => 1.0,
                2 => 1.25,
                3..=4 => 1.6,
                _ => 2.2,
            }),
        }
    }
}

fn engine(soft: bool, speculation: Option<NgramSpeculation>) -> (EngineHandle, Arc<Counters>) {
    engine_with(soft, 7, Cost::Unknown, speculation)
}

fn engine_with(soft: bool, wrong_every: usize, cost: Cost, speculation: Option<NgramSpeculation>) -> (EngineHandle, Arc<Counters>) {
    let counters = Arc::new(Counters::default());
    let model = Periodic { cache: HashMap::new(), soft, wrong_every, cost, counters: counters.clone() };
    (start(Box::new(model), EngineOptions { speculation, ..EngineOptions::default() }), counters)
}

/// Every event of a request but the admission and prefill progress.
fn events(rx: &mpsc::Receiver<Event>) -> Vec<Event> {
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
}

/// Runs `requests` concurrently and returns each one's events.
fn run(e: &EngineHandle, requests: Vec<GenerationRequest>) -> Vec<Vec<Event>> {
    let rxs: Vec<_> = requests
        .into_iter()
        .map(|r| {
            let (tx, rx) = mpsc::channel();
            e.submit(r, Box::new(move |ev| tx.send(ev).is_ok())).unwrap();
            rx
        })
        .collect();
    rxs.iter().map(events).collect()
}

fn prompt(salt: u32, len: usize) -> Vec<u32> {
    (0..len as u32).map(|i| (i * 11 + salt * 17 + 3) % VOCAB as u32).collect()
}

fn tokens(events: &[Event]) -> Vec<u32> {
    events.iter().filter_map(|e| if let Event::Token { id, .. } = e { Some(*id) } else { None }).collect()
}

/// A constraint that bans one token and ends the output after `len` tokens.
struct Ban {
    token: u32,
    left: usize,
}

impl TokenConstraint for Ban {
    fn mask(&mut self, logits: &mut [f32]) -> Result<(), String> {
        logits[self.token as usize] = f32::NEG_INFINITY;
        Ok(())
    }
    fn commit(&mut self, token: u32) -> Result<(), String> {
        if token == self.token {
            return Err(format!("token {token} is banned"));
        }
        self.left -= 1;
        Ok(())
    }
    fn is_finished(&self) -> bool {
        self.left == 0
    }
}

fn requests(sampling: SamplingParams, logprobs: Option<usize>) -> Vec<GenerationRequest> {
    // odd lengths and budgets, so steps end mid-draft; one request stops at a token it drafts;
    // one bans a token of its period, so drafts copied from the prompt hold a token it cannot
    // choose, and its grammar ends it
    (0..4u32)
        .map(|r| {
            let mut q = GenerationRequest::new(prompt(r, 3 + 2 * r as usize), 20 + 7 * r as usize);
            q.sampling = SamplingParams { seed: 1000 + r as u64, ..sampling };
            q.logprobs = logprobs;
            if r == 2 {
                q.stop_ids = vec![prompt(r, 7)[4]];
            }
            if r == 3 {
                q.constraint = Some(Box::new(Ban { token: prompt(r, 9)[6], left: 30 }));
            }
            q
        })
        .collect()
}

#[test]
fn greedy_drafts_change_how_many_tokens_a_step_yields_not_which() {
    let (plain, plain_counts) = engine(false, None);
    let (spec, spec_counts) = engine(false, Some(NgramSpeculation::new(3)));
    let want = run(&plain, requests(SamplingParams::default(), None));
    let got = run(&spec, requests(SamplingParams::default(), None));
    assert_eq!(got, want);
    // the stop id ended request 2 early, and the grammar request 3 after its 30 tokens
    assert!(matches!(want[2].last(), Some(Event::Finished { reason: FinishReason::Stop, .. })), "{:?}", want[2]);
    assert!(matches!(want[3].last(), Some(Event::Finished { reason: FinishReason::Stop, completion_tokens: 30, .. })), "{:?}", want[3]);
    let banned = prompt(3, 9)[6];
    assert!(prompt(3, 9).contains(&banned) && !tokens(&want[3]).contains(&banned));
    let generated: usize = want.iter().map(|e| tokens(e).len()).sum();
    let (drafted, accepted) = (spec.stats.draft_tokens.load(Ordering::Relaxed), spec.stats.accepted_draft_tokens.load(Ordering::Relaxed));
    eprintln!(
        "{generated} tokens: {} decode steps without speculation, {} with; {drafted} drafts, {accepted} accepted",
        plain_counts.decode_calls.load(Ordering::SeqCst),
        spec_counts.decode_calls.load(Ordering::SeqCst)
    );
    assert!(accepted > 10 && drafted > accepted, "drafted {drafted}, accepted {accepted}: the fake makes some right and some wrong");
    assert_eq!(plain.stats.draft_tokens.load(Ordering::Relaxed), 0);
    assert_eq!(spec.stats.generation_tokens.load(Ordering::Relaxed), plain.stats.generation_tokens.load(Ordering::Relaxed));
    // a row chooses a token where its input was the sequence's token or an accepted draft; the
    // rows fed a rejected draft (or past a finish) are the only extra work
    let rows = |c: &Counters| c.decode_rows.load(Ordering::SeqCst) as u64;
    assert_eq!(rows(&spec_counts), rows(&plain_counts) + drafted - accepted);

    // alone (so the steps do not depend on when requests arrive), fewer steps for the same tokens
    let steps = |speculation| {
        let (e, counts) = engine(false, speculation);
        let out = run(&e, vec![GenerationRequest::new(prompt(9, 6), 40)]);
        (out, counts.decode_calls.load(Ordering::SeqCst))
    };
    let ((want, plain_steps), (got, spec_steps)) = (steps(None), steps(Some(NgramSpeculation::new(3))));
    assert_eq!(got, want);
    assert_eq!(plain_steps, 39, "the first token comes from the prefill");
    assert!(spec_steps < 30, "{spec_steps} steps with up to 3 drafts a step, where most drafts are right");
}

#[test]
fn sampled_output_penalties_and_logprobs_are_unchanged_by_drafts() {
    let sampling = SamplingParams { temperature: 0.9, top_p: 0.95, presence_penalty: 0.3, ..SamplingParams::default() };
    let (plain, _) = engine(true, None);
    let (spec, _) = engine(true, Some(NgramSpeculation::new(4)));
    let want = run(&plain, requests(sampling, Some(2)));
    let got = run(&spec, requests(sampling, Some(2)));
    assert_eq!(got, want);
    let accepted = spec.stats.accepted_draft_tokens.load(Ordering::Relaxed);
    let drafted = spec.stats.draft_tokens.load(Ordering::Relaxed);
    assert!(accepted > 0 && drafted > accepted, "drafted {drafted}, accepted {accepted}");
}

#[test]
fn more_requests_than_a_batch_holds_are_unchanged_and_never_overfill_a_step() {
    // (the fake refuses a step of more rows than the plan's largest batch)
    let many = || (0..BATCH as u32 + 3).map(|r| GenerationRequest::new(prompt(r, 4 + r as usize), 9 + r as usize)).collect();
    let (plain, _) = engine(false, None);
    let (spec, _) = engine(false, Some(NgramSpeculation::new(8)));
    assert_eq!(run(&spec, many()), run(&plain, many()));
    assert!(spec.stats.accepted_draft_tokens.load(Ordering::Relaxed) > 0);
}

#[test]
fn drafts_run_only_where_the_step_costs_say_they_pay() {
    let alone = |wrong_every: usize, cost: Cost| {
        let (e, counts) = engine_with(false, wrong_every, cost, Some(NgramSpeculation::new(3)));
        let out = run(&e, vec![GenerationRequest::new(prompt(9, 6), 40)]);
        let drafted = e.stats.draft_tokens.load(Ordering::Relaxed);
        (out, drafted, counts.decode_calls.load(Ordering::SeqCst))
    };
    // (a draft every 3rd position wrong: drafts copied from this context then never are right)
    for wrong_every in [7, 3] {
        let (plain, _) = engine_with(false, wrong_every, Cost::Unknown, None);
        let want = run(&plain, vec![GenerationRequest::new(prompt(9, 6), 40)]);
        // a row costing as much as a step: expected gains below one token never pay
        let (out, drafted, steps) = alone(wrong_every, Cost::PerRow);
        assert_eq!((&out, drafted, steps), (&want, 0, 39), "rows at full price, a draft every {wrong_every}");
        // a GPU's shape: drafts while they are accepted often enough for their rows
        let (out, drafted, steps) = alone(wrong_every, Cost::Buckets);
        assert_eq!(out, want);
        if wrong_every == 7 {
            // mostly right: up to three drafts a step (1 + a + a^2 + a^3 against 1.6x)
            assert!(steps <= 30 && drafted > 20, "{steps} steps, {drafted} drafts");
        } else {
            // never right: a draft at the prior's one half (1.5 tokens for 1.25x), another at a
            // third, then none once its record says a quarter, where free rows would take dozens
            assert!(drafted <= 3 && steps == 39, "{steps} steps, {drafted} drafts");
            let (out, free_drafts, _) = alone(wrong_every, Cost::Unknown);
            assert!(out == want && free_drafts > 20, "{free_drafts} drafts in free rows");
        }
    }
}

