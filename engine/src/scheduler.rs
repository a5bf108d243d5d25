//! Continuous batching. One engine thread owns the backend; requests arrive on a channel and
//! stream events back. Every iteration admits what fits, runs at most one prefill chunk (chunked
//! prefill, so a long prompt never stalls running sequences for long) and one decode step over
//! every decoding sequence.
//!
//! KV pages are taken on demand: admission needs only the prompt's pages (less what the prefix
//! cache already holds), and a decoding sequence gets a page when its next token starts one.
//! When the pool runs dry the youngest running sequence is preempted: it gives up its pages and
//! goes back to the head of the queue, and on resume its prompt and output are recomputed by
//! prefill (vLLM's recompute policy), so its output is what it would have been. Its full pages
//! stay in the prefix cache meanwhile, so a resume often recomputes little.
//!
//! With speculative decoding a decoding sequence may also feed drafts (`speculation`) as rows
//! at its next positions in the same step; its rows are taken in order and count only while
//! the token chosen is the draft the next row was fed, so the tokens are the ones it would have
//! had, a step just yields more of them.

use crate::forward::{DecodeItem, Forward};
use crate::pages::PagePool;
pub use crate::request::{Event, EventSink, FinishReason, GenerationRequest, Rejected, TokenConstraint};
use crate::sequence::{Phase, Sequence};
pub use crate::speculation::NgramSpeculation;
use crate::speculation::draft_counts;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc;
use std::sync::Arc;

/// Live counters for `/metrics` and admission decisions.
#[derive(Debug, Default)]
pub struct EngineStats {
    pub running: AtomicUsize,
    /// Queued requests, preempted sequences included.
    pub waiting: AtomicUsize,
    /// Pages some sequence holds.
    pub kv_pages_used: AtomicUsize,
    /// Cached pages no sequence holds (reused by a matching prompt, evicted when needed).
    pub kv_pages_cached: AtomicUsize,
    pub kv_pages_total: AtomicUsize,
    pub prompt_tokens: AtomicU64,
    /// Prompt tokens whose KV the prefix cache served (at first admission).
    pub prompt_tokens_cached: AtomicU64,
    pub generation_tokens: AtomicU64,
    /// Sequences that gave up their pages to make room (recomputed on resume).
    pub preemptions: AtomicU64,
    /// Cached pages evicted to make room.
    pub prefix_cache_evictions: AtomicU64,
    /// Requests failed because their logits held NaN or Inf.
    pub non_finite: AtomicU64,
    /// Draft tokens run through the model beside their sequence's token (speculative decoding).
    pub draft_tokens: AtomicU64,
    /// Draft tokens the model chose itself, each a token the step yielded beyond the first.
    pub accepted_draft_tokens: AtomicU64,
    /// Set when the engine thread has ended (including by a panic): nothing will be served.
    pub stopped: std::sync::atomic::AtomicBool,
    /// Set when the backend failed for good (a GPU fault): every request fails, /health is 503.
    pub failure: std::sync::Mutex<Option<String>>,
}

impl EngineStats {
    pub fn failure(&self) -> Option<String> {
        self.failure.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }
}

/// Marks the engine stopped when its thread ends, however it ends.
struct StoppedOnDrop(Arc<EngineStats>);

impl Drop for StoppedOnDrop {
    fn drop(&mut self) {
        self.0.stopped.store(true, Ordering::SeqCst);
    }
}

/// Limits the server derives from the plan and the options.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    pub vocab_size: usize,
    /// The longest sequence served: the plan's context, capped by the KV pool.
    pub max_context: usize,
    pub total_pages: usize,
    pub page_size: usize,
    pub max_decode_batch: usize,
}

#[derive(Debug, Clone, Copy)]
pub struct EngineOptions {
    /// Requests that may wait for admission before new ones are refused (HTTP 429).
    pub max_waiting: usize,
    /// Caps the KV pool at this many tokens (SGLang's `--max-total-tokens`); None: the plan's.
    pub max_total_tokens: Option<usize>,
    pub prefix_cache: bool,
    /// Speculative decoding with drafts from each sequence's own text, in the rows a decode
    /// batch has to spare; None: one token per sequence and step.
    pub speculation: Option<NgramSpeculation>,
    /// Speculative decoding with up to this many drafts per sequence and step from the plan's
    /// draft model (`kiln compile --draft mtp`; [`Forward::draft`]), in place of `speculation`.
    /// Ignored where the backend has no draft model.
    pub draft_model: Option<usize>,
}

impl Default for EngineOptions {
    fn default() -> Self {
        EngineOptions { max_waiting: 256, max_total_tokens: None, prefix_cache: true, speculation: None, draft_model: None }
    }
}

struct Submission {
    request: GenerationRequest,
    sink: EventSink,
}

/// Cheap to clone; submits to the engine thread.
#[derive(Clone)]
pub struct EngineHandle {
    tx: mpsc::Sender<Submission>,
    pub stats: Arc<EngineStats>,
    pub limits: Limits,
    max_waiting: usize,
}

impl EngineHandle {
    /// Validates and enqueues a request. Events go to `sink` until it returns false or the
    /// request finishes.
    pub fn submit(&self, request: GenerationRequest, sink: EventSink) -> Result<(), Rejected> {
        let l = self.limits;
        if request.prompt.is_empty() {
            return Err(Rejected::Invalid("the prompt is empty".into()));
        }
        if let Some(bad) = request.prompt.iter().find(|&&t| t as usize >= l.vocab_size) {
            return Err(Rejected::Invalid(format!("token id {bad} is outside the vocabulary of {}", l.vocab_size)));
        }
        if request.prompt.len() >= l.max_context {
            return Err(Rejected::Invalid(format!(
                "the prompt has {} tokens; this model's context is {} tokens, prompt and completion included",
                request.prompt.len(),
                l.max_context
            )));
        }
        if let Some(bad) = request.forced.iter().flatten().find(|&&t| t as usize >= l.vocab_size) {
            return Err(Rejected::Invalid(format!("forced token id {bad} is outside the vocabulary of {}", l.vocab_size)));
        }
        if request.max_tokens == 0 {
            return Err(Rejected::Invalid("max_tokens must be at least 1".into()));
        }
        if let Some(n) = request.logprobs.filter(|&n| n > MAX_TOP_LOGPROBS) {
            return Err(Rejected::Invalid(format!("at most {MAX_TOP_LOGPROBS} top logprobs, got {n}")));
        }
        request.sampling.validate().map_err(Rejected::Invalid)?;
        if let Some(f) = self.stats.failure() {
            return Err(Rejected::Failed(f));
        }
        // Requests a free decode slot will take at the next iteration are not waiting for
        // anything: only the ones beyond the free slots count against the queue.
        let waiting = self.stats.waiting.load(Ordering::SeqCst);
        let free_slots = l.max_decode_batch.saturating_sub(self.stats.running.load(Ordering::SeqCst));
        if waiting >= self.max_waiting + free_slots {
            return Err(Rejected::QueueFull { waiting });
        }
        self.stats.waiting.fetch_add(1, Ordering::SeqCst);
        self.tx.send(Submission { request, sink }).map_err(|_| {
            self.stats.waiting.fetch_sub(1, Ordering::SeqCst);
            Rejected::Stopped
        })
    }
}

/// The most alternatives a request may ask log-probabilities for (OpenAI's limit).
pub const MAX_TOP_LOGPROBS: usize = 20;

/// Starts the engine thread over `model`.
pub fn start(model: Box<dyn Forward>, options: EngineOptions) -> EngineHandle {
    let page_size = model.page_size().max(1);
    let total_pages = match options.max_total_tokens {
        Some(t) => (t / page_size).min(model.total_pages()),
        None => model.total_pages(),
    };
    let limits = Limits {
        vocab_size: model.vocab_size(),
        // A sequence alone must always fit, so that preemption can always make progress.
        max_context: model.max_context().min(total_pages * page_size),
        total_pages,
        page_size,
        max_decode_batch: model.max_decode_batch(),
    };
    let stats = Arc::new(EngineStats::default());
    stats.kv_pages_total.store(limits.total_pages, Ordering::SeqCst);
    let (tx, rx) = mpsc::channel();
    let thread_stats = stats.clone();
    std::thread::Builder::new()
        .name("kiln-engine".into())
        .spawn(move || {
            let _guard = StoppedOnDrop(thread_stats.clone());
            Engine::new(model, thread_stats, limits, options).run(rx)
        })
        .expect("spawn engine thread");
    EngineHandle { tx, stats, limits, max_waiting: options.max_waiting }
}

struct Engine {
    model: Box<dyn Forward>,
    stats: Arc<EngineStats>,
    limits: Limits,
    pool: PagePool,
    /// Oldest first; preempted sequences go back to the front.
    waiting: VecDeque<Sequence>,
    /// Sorted by arrival: the first one still in prefill gets the next chunk, the last one is
    /// the first preempted.
    running: Vec<Sequence>,
    arrivals: u64,
    speculation: Option<NgramSpeculation>,
    /// Drafts per sequence from the draft model, and the width of its hidden rows.
    draft_model: Option<(usize, usize)>,
}

impl Engine {
    fn new(model: Box<dyn Forward>, stats: Arc<EngineStats>, limits: Limits, options: EngineOptions) -> Engine {
        let pool = PagePool::new(limits.total_pages, limits.page_size, options.prefix_cache);
        let draft_model = options.draft_model.filter(|&k| k > 0).zip(model.draft_hidden_size());
        Engine { model, stats, limits, pool, waiting: VecDeque::new(), running: Vec::new(), arrivals: 0, speculation: options.speculation, draft_model }
    }

    fn run(mut self, rx: mpsc::Receiver<Submission>) {
        loop {
            // Block only when there is nothing to do.
            if self.running.is_empty() && self.waiting.is_empty() {
                match rx.recv() {
                    Ok(s) => self.enqueue(s),
                    Err(_) => return,
                }
            }
            while let Ok(s) = rx.try_recv() {
                self.enqueue(s);
            }
            self.admit();
            self.prefill_one_chunk();
            self.decode_step();
            self.publish();
            if self.note_failure() {
                // Nothing can run any more: fail everything still waiting.
                for mut s in self.waiting.drain(..) {
                    self.stats.waiting.fetch_sub(1, Ordering::SeqCst);
                    (s.sink)(Event::Error("the backend has failed; the request was not run".into()));
                }
            }
        }
    }

    fn enqueue(&mut self, s: Submission) {
        self.arrivals += 1;
        self.waiting.push_back(Sequence::new(s.request, s.sink, self.arrivals, self.limits.max_context));
    }

    fn publish(&self) {
        self.stats.running.store(self.running.len(), Ordering::SeqCst);
        self.stats.kv_pages_used.store(self.pool.used(), Ordering::SeqCst);
        self.stats.kv_pages_cached.store(self.pool.cached_idle(), Ordering::SeqCst);
        self.stats.prefix_cache_evictions.store(self.pool.evictions(), Ordering::Relaxed);
    }

    /// FIFO admission while decode slots and the pages of the next sequence's tokens last.
    fn admit(&mut self) {
        let ps = self.pool.page_size();
        while self.running.len() < self.limits.max_decode_batch {
            let Some(front) = self.waiting.front() else { break };
            let len = front.tokens.len();
            // The last token is always computed: its logits choose the next one.
            let found = self.pool.lookup(&front.tokens, (len - 1) / ps);
            if self.prefix_in_flight(&front.tokens, found.pages.len()) {
                break;
            }
            let need = len.div_ceil(ps) - found.pages.len();
            if need > self.pool.available() - self.pool.idle_among(&found.pages) {
                break;
            }
            let mut s = self.waiting.pop_front().expect("front exists");
            self.stats.waiting.fetch_sub(1, Ordering::SeqCst);
            self.pool.retain(&found.pages);
            s.registered = found.pages.len();
            s.cached = found.pages.len() * ps;
            // a cached prefix's draft KV is as its first owner left it (a guess, like any draft's)
            s.draft_cached = s.cached;
            s.draft_hidden.clear();
            s.pages = found.pages;
            s.pages.extend(self.pool.alloc(need).expect("counted above"));
            s.chain = found.hash;
            if !s.announced {
                s.announced = true;
                s.cached_prompt = s.cached;
                self.stats.prompt_tokens.fetch_add(s.prompt_len() as u64, Ordering::Relaxed);
                self.stats.prompt_tokens_cached.fetch_add(s.cached as u64, Ordering::Relaxed);
                if !(s.sink)(Event::Admitted { cached_tokens: s.cached }) {
                    s.drop_pages(&mut self.pool); // the client left while queued
                    continue;
                }
            }
            let at = self.running.partition_point(|r| r.arrival < s.arrival);
            self.running.insert(at, s);
        }
        self.publish();
    }

    /// Whether a running sequence is still computing pages of `tokens`' prefix beyond the
    /// `found` cached ones: waiting for it to register them beats computing them twice (`n`
    /// choices, identical concurrent prompts).
    fn prefix_in_flight(&self, tokens: &[u32], found: usize) -> bool {
        let ps = self.pool.page_size();
        let cap = (tokens.len() - 1) / ps;
        self.running.iter().any(|r| {
            let common = r.tokens.iter().zip(tokens).take_while(|(a, b)| a == b).count();
            let shared = (common / ps).min(cap).min(r.tokens.len() / ps);
            r.phase == Phase::Prefill && shared > found && shared > r.registered
        })
    }

    /// The oldest sequence in prefill gets one chunk.
    fn prefill_one_chunk(&mut self) {
        let Some(i) = self.running.iter().position(|s| s.phase == Phase::Prefill) else { return };
        let chunk = self.model.max_prefill_chunk();
        let s = &mut self.running[i];
        let end = (s.cached + chunk).min(s.tokens.len());
        let result = self.model.prefill(&s.pages, s.cached, &s.tokens[s.cached..end]);
        match result {
            Ok(logits) => {
                if self.draft_model.is_some() {
                    s.draft_hidden.extend(self.model.hidden_rows());
                }
                s.cached = end;
                let complete = end == s.tokens.len();
                if let Err(e) = self.draft_catch_up(i) {
                    self.fail(i, e);
                    return;
                }
                if complete && self.non_finite(i, &logits) {
                    return;
                }
                let s = &mut self.running[i];
                s.register_full_pages(&mut self.pool);
                // A resumed sequence's progress is not news to its client.
                if s.generated() == 0 && !(s.sink)(Event::Prefilled { tokens: end }) {
                    self.finish(i); // the client left during a long prefill
                    return;
                }
                if end == s.tokens.len() {
                    s.phase = Phase::Decode;
                    self.next_token(i, &logits);
                }
            }
            Err(e) => self.fail(i, e),
        }
    }

    /// Chooses and emits sequence `i`'s next token; ends the sequence when it is over.
    /// Returns whether it goes on.
    fn next_token(&mut self, i: usize, logits: &[f32]) -> bool {
        let s = &mut self.running[i];
        match s.choose(logits) {
            Ok((token, lp)) => {
                let counted = token != u32::MAX && (s.request.ignore_eos || !s.request.stop_ids.contains(&token));
                if counted {
                    self.stats.generation_tokens.fetch_add(1, Ordering::Relaxed);
                }
                if s.emit(token, lp) {
                    return true;
                }
                self.finish(i);
            }
            Err(e) => self.fail(i, format!("constrained decoding: {e}")),
        }
        false
    }

    /// Gives every decoding sequence the page its next token goes to, oldest first, preempting
    /// the youngest running sequences when the pool is dry.
    fn grow_pages(&mut self) {
        let ps = self.pool.page_size();
        let decoding: Vec<u64> = self.running.iter().filter(|s| s.phase == Phase::Decode).map(|s| s.arrival).collect();
        for arrival in decoding {
            // Until it has the page, or was itself the youngest and got preempted.
            while let Some(i) = self.running.iter().position(|s| s.arrival == arrival) {
                if self.running[i].pages.len() * ps > self.running[i].cached {
                    break;
                }
                match self.pool.alloc(1) {
                    Some(page) => self.running[i].pages.extend(page),
                    None => self.preempt_youngest(),
                }
            }
        }
    }

    fn preempt_youngest(&mut self) {
        let Some(mut s) = self.running.pop() else { return };
        s.drop_pages(&mut self.pool);
        self.stats.preemptions.fetch_add(1, Ordering::Relaxed);
        self.stats.waiting.fetch_add(1, Ordering::SeqCst);
        self.waiting.push_front(s);
    }

    /// The draft model takes in sequence `i`'s positions whose next token is known (a prompt's,
    /// during its prefill): their draft KV from the model's hidden rows, logits unused.
    fn draft_catch_up(&mut self, i: usize) -> Result<(), String> {
        let Some((_, h)) = self.draft_model else { return Ok(()) };
        let s = &mut self.running[i];
        let end = s.cached.min(s.tokens.len() - 1);
        if end <= s.draft_cached {
            return Ok(());
        }
        let items: Vec<DecodeItem> = (s.draft_cached..end).map(|p| DecodeItem { pages: &s.pages, pos: p, token: s.tokens[p + 1] }).collect();
        let rows = items.len();
        self.model.draft(&items, &s.draft_hidden[..rows * h])?;
        s.draft_hidden.drain(..rows * h);
        s.draft_cached = end;
        Ok(())
    }

    /// One token for every decoding sequence, in plan-sized batches (with speculation, up to
    /// one more for each of its drafts the model chooses).
    fn decode_step(&mut self) {
        self.grow_pages();
        let mut ready: Vec<u64> = self.running.iter().filter(|s| s.phase == Phase::Decode).map(|s| s.arrival).collect();
        if ready.is_empty() {
            return;
        }
        let batch_size = self.model.max_decode_batch().max(1);
        let vocab = self.limits.vocab_size;
        while !ready.is_empty() {
            let batch: Vec<u64> = ready.drain(..batch_size.min(ready.len())).collect();
            let drafts = self.drafts(&batch, batch_size);
            let cached: Vec<usize> = batch.iter().map(|&a| self.running.iter().find(|s| s.arrival == a).map_or(0, |s| s.cached)).collect();
            let index = |running: &[Sequence], a: u64| running.iter().position(|s| s.arrival == a).expect("decoding sequences stay running during a step");
            // a sequence's rows: its token at `cached`, then each draft at the next position
            let items: Vec<DecodeItem> = batch
                .iter()
                .zip(&drafts)
                .flat_map(|(&a, draft)| {
                    let s = &self.running[index(&self.running, a)];
                    std::iter::once(s.tokens[s.cached])
                        .chain(draft.iter().copied())
                        .enumerate()
                        .map(move |(j, token)| DecodeItem { pages: &s.pages, pos: s.cached + j, token })
                })
                .collect();
            let result = self.model.decode(&items);
            match result {
                Ok(logits) => {
                    let hidden = if self.draft_model.is_some() { self.model.hidden_rows() } else { Vec::new() };
                    let mut first = 0;
                    for ((&a, draft), &before) in batch.iter().zip(&drafts).zip(&cached) {
                        let rows = 1 + draft.len();
                        self.accept(a, draft, &logits[first * vocab..(first + rows) * vocab]);
                        // the hidden rows of the positions now cached: the rows whose token
                        // was the sequence's (not a rejected draft)
                        if let (Some((_, h)), Some(s)) = (self.draft_model, self.running.iter_mut().find(|s| s.arrival == a)) {
                            let kept = s.cached.saturating_sub(before).min(rows);
                            s.draft_hidden.extend_from_slice(&hidden[first * h..(first + kept) * h]);
                        }
                        first += rows;
                    }
                }
                Err(e) => {
                    self.note_failure();
                    for &a in &batch {
                        let i = index(&self.running, a);
                        (self.running[i].sink)(Event::Error(e.clone()));
                        self.finish(i);
                    }
                }
            }
        }
    }

    /// The drafts of a decode batch's sequences, oldest first: what prompt lookup proposes for
    /// each (at most one token fewer than it may still emit, at positions its pages and the free
    /// ones hold), then as many of them as [`draft_counts`] finds worth their rows, each
    /// given the pages its positions need from the free ones (a guess never evicts a cached page
    /// or preempts).
    fn drafts(&mut self, batch: &[u64], rows: usize) -> Vec<Vec<u32>> {
        if let Some((max_draft, _)) = self.draft_model {
            return self.model_drafts(batch, rows, max_draft);
        }
        let Some(spec) = self.speculation else { return vec![Vec::new(); batch.len()] };
        let spare = rows.saturating_sub(batch.len());
        let free = self.pool.available() - self.pool.cached_idle();
        let at: Vec<usize> = batch.iter().map(|&a| self.running.iter().position(|s| s.arrival == a).expect("decoding sequences stay running during a step")).collect();
        let proposals: Vec<Vec<u32>> = at.iter().map(|&i| spec.propose(&self.running[i].tokens, self.draft_room(i, spare, free))).collect();
        let gains: Vec<Vec<f64>> = at
            .iter()
            .zip(&proposals)
            .map(|(&i, draft)| {
                let a = self.running[i].draft_acceptance();
                (1..=draft.len()).map(|n| a.powi(n as i32)).collect()
            })
            .collect();
        let model = &mut self.model;
        let counts = draft_counts(batch.len(), &gains, rows, |r| model.decode_cost(r));
        at.into_iter()
            .zip(proposals)
            .zip(counts)
            .map(|((i, mut draft), keep)| {
                draft.truncate(keep);
                if !self.draft_pages(i, draft.len()) {
                    draft.clear();
                }
                self.stats.draft_tokens.fetch_add(draft.len() as u64, Ordering::Relaxed);
                draft
            })
            .collect()
    }

    /// How many drafts sequence `i` may run in a step with `spare` rows and `free` free pages:
    /// one token fewer than it may still emit, at positions its pages and the free ones hold.
    fn draft_room(&self, i: usize, spare: usize, free: usize) -> usize {
        let s = &self.running[i];
        let emits = s.limit.saturating_sub(s.tokens.len()).min(s.request.max_tokens.saturating_sub(s.generated()));
        let fits = ((s.pages.len() + free) * self.pool.page_size()).saturating_sub(s.cached + 1);
        spare.min(emits.saturating_sub(1)).min(fits)
    }

    /// Gives sequence `i` the pages `n` drafts' positions need, from the free ones (a guess
    /// never evicts a cached page or preempts); false where there are not enough.
    fn draft_pages(&mut self, i: usize, n: usize) -> bool {
        let s = &self.running[i];
        let more = ((s.cached + n) / self.pool.page_size() + 1).saturating_sub(s.pages.len());
        if more == 0 {
            return true;
        }
        match self.pool.alloc(more) {
            Some(pages) => {
                self.running[i].pages.extend(pages);
                true
            }
            None => false,
        }
    }

    /// The drafts of a decode batch's sequences from the draft model: how many each gets is
    /// decided as for prompt lookup (positions, pages, acceptance so far and the step's cost:
    /// [`draft_counts`]); then one draft step takes in every sequence's positions not yet in
    /// the draft layer (the model's hidden rows beside the tokens after them), whose last row
    /// gives the first draft, and each further draft is one more step of the sequences still
    /// drafting, from the draft's own hidden row and the draft before it. Drafts are the draft
    /// model's most likely tokens; the model's own choice decides what is kept (`accept`). A
    /// draft step that fails leaves the batch without drafts.
    fn model_drafts(&mut self, batch: &[u64], rows: usize, max_draft: usize) -> Vec<Vec<u32>> {
        let h = self.draft_model.map_or(0, |(_, h)| h);
        let spare = rows.saturating_sub(batch.len());
        let free = self.pool.available() - self.pool.cached_idle();
        let at: Vec<usize> = batch.iter().map(|&a| self.running.iter().position(|s| s.arrival == a).expect("decoding sequences stay running during a step")).collect();
        let gains: Vec<Vec<f64>> = at
            .iter()
            .map(|&i| {
                let a = self.running[i].draft_acceptance();
                (1..=max_draft.min(self.draft_room(i, spare, free))).map(|n| a.powi(n as i32)).collect()
            })
            .collect();
        let model = &mut self.model;
        let mut counts = draft_counts(batch.len(), &gains, rows, |r| model.decode_cost(r));
        for (&i, n) in at.iter().zip(counts.iter_mut()) {
            if !self.draft_pages(i, *n) {
                *n = 0;
            }
        }
        let mut drafts = vec![Vec::new(); batch.len()];
        match self.run_drafts(&at, &counts, h) {
            Ok(d) => drafts = d,
            Err(e) => eprintln!("kiln: a draft model step failed, decoding without drafts: {e}"),
        }
        let made: usize = drafts.iter().map(Vec::len).sum();
        self.stats.draft_tokens.fetch_add(made as u64, Ordering::Relaxed);
        drafts
    }

    /// The draft steps of [`Engine::model_drafts`]: `counts[j]` drafts for sequence `at[j]`.
    fn run_drafts(&mut self, at: &[usize], counts: &[usize], h: usize) -> Result<Vec<Vec<u32>>, String> {
        let vocab = self.limits.vocab_size;
        // first step: every sequence's positions not yet in the draft layer
        let mut items = Vec::new();
        let mut hidden = Vec::new();
        let mut last_row = Vec::new();
        for &i in at {
            let s = &self.running[i];
            items.extend((s.draft_cached..s.cached).map(|p| DecodeItem { pages: &s.pages, pos: p, token: s.tokens[p + 1] }));
            hidden.extend_from_slice(&s.draft_hidden);
            last_row.push(items.len().checked_sub(1).filter(|_| s.cached > s.draft_cached));
        }
        if items.is_empty() {
            return Ok(vec![Vec::new(); at.len()]);
        }
        let (logits, out) = self.model.draft(&items, &hidden)?;
        for &i in at {
            let s = &mut self.running[i];
            s.draft_cached = s.cached;
            s.draft_hidden.clear();
        }
        let mut drafts: Vec<Vec<u32>> = vec![Vec::new(); at.len()];
        let mut chain: Vec<Vec<f32>> = vec![Vec::new(); at.len()];
        for (j, row) in last_row.iter().enumerate() {
            if let (Some(r), true) = (*row, counts[j] > 0) {
                drafts[j].push(crate::sampling::argmax(&logits[r * vocab..(r + 1) * vocab]));
                chain[j] = out[r * h..(r + 1) * h].to_vec();
            }
        }
        // each further draft: the draft before it at the next position, from the draft's hidden
        for step in 1..counts.iter().copied().max().unwrap_or(0) {
            let going: Vec<usize> = (0..at.len()).filter(|&j| counts[j] > step && drafts[j].len() == step).collect();
            if going.is_empty() {
                break;
            }
            let items: Vec<DecodeItem> = going
                .iter()
                .map(|&j| {
                    let s = &self.running[at[j]];
                    DecodeItem { pages: &s.pages, pos: s.cached + step - 1, token: drafts[j][step - 1] }
                })
                .collect();
            let hidden: Vec<f32> = going.iter().flat_map(|&j| chain[j].iter().copied()).collect();
            let (logits, out) = self.model.draft(&items, &hidden)?;
            for (r, &j) in going.iter().enumerate() {
                drafts[j].push(crate::sampling::argmax(&logits[r * vocab..(r + 1) * vocab]));
                chain[j] = out[r * h..(r + 1) * h].to_vec();
            }
        }
        Ok(drafts)
    }

    /// Sequence `a`'s logit rows of a step, in order: each chooses the next token as a step of
    /// its own would (penalties, constraint, sampler state and all), and the next row counts
    /// only while the token chosen is the draft that row was fed. A draft the model would not
    /// have chosen ends the sequence's step there; the KV its rows wrote past the last accepted
    /// position is overwritten by the tokens that follow.
    fn accept(&mut self, a: u64, draft: &[u32], logits: &[f32]) {
        let vocab = self.limits.vocab_size;
        for (j, row) in logits.chunks_exact(vocab).enumerate() {
            let Some(i) = self.running.iter().position(|s| s.arrival == a) else { return };
            if self.non_finite(i, row) {
                return;
            }
            let s = &mut self.running[i];
            s.cached += 1;
            s.register_full_pages(&mut self.pool);
            if !self.next_token(i, row) {
                return;
            }
            let Some(&fed) = draft.get(j) else { return };
            let s = &mut self.running[i];
            let accepted = s.tokens.last() == Some(&fed);
            s.record_draft(accepted);
            if !accepted {
                return;
            }
            self.stats.accepted_draft_tokens.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// The NaN sentinel: a logits row with NaN or Inf fails its request (naming the program, so
    /// `kiln verify` can find the step) instead of sampling garbage; the engine goes on.
    fn non_finite(&mut self, i: usize, logits: &[f32]) -> bool {
        let Some(bad) = logits.iter().find(|l| !l.is_finite()) else { return false };
        let what = if bad.is_nan() { "NaN" } else { "Inf" };
        let program = self.model.last_program().unwrap_or_else(|| "the last program".into());
        let pos = self.running[i].cached;
        self.stats.non_finite.fetch_add(1, Ordering::Relaxed);
        let message = format!(
            "the model produced {what} logits in program `{program}` (position {pos}); the weights or a kernel are broken: run `kiln verify ART` to find the step"
        );
        eprintln!("kiln: {message}");
        self.fail(i, message);
        true
    }

    /// Records a backend failure in the stats (before the failed requests hear of it, so that
    /// the server can tell them the backend is gone); true once the backend has failed.
    fn note_failure(&self) -> bool {
        match self.model.failure() {
            Some(f) => {
                *self.stats.failure.lock().unwrap_or_else(|p| p.into_inner()) = Some(f);
                true
            }
            None => false,
        }
    }

    fn fail(&mut self, i: usize, message: String) {
        self.note_failure();
        (self.running[i].sink)(Event::Error(message));
        self.finish(i);
    }

    /// Removes sequence `i`; its registered pages stay cached for prompts that start the same.
    fn finish(&mut self, i: usize) {
        let mut s = self.running.remove(i);
        s.drop_pages(&mut self.pool);
        self.publish();
    }
}
