//! Continuous batching. One engine thread owns the backend; requests arrive on a channel and
//! stream events back. Every iteration runs at most one prefill chunk (chunked prefill, so a long
//! prompt never stalls running sequences for long) and one decode step over every running
//! sequence. KV pages are reserved at admission and freed the moment a sequence ends or its client
//! goes away.

use super::forward::{DecodeItem, Forward};
use super::pages::PageAllocator;
use super::sampling::{Sampler, SamplingParams};
use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc;
use std::sync::Arc;

#[derive(Debug, Clone)]
pub struct GenerationRequest {
    pub prompt: Vec<u32>,
    pub max_tokens: usize,
    pub sampling: SamplingParams,
    /// Token ids that end generation (not emitted).
    pub stop_ids: Vec<u32>,
    /// Keep generating through stop ids (used by tests and benchmarks).
    pub ignore_eos: bool,
    /// Test hook: emit these tokens instead of sampling (the forward passes still run), then
    /// stop as if an eos token came. Lets parser tests drive the real serving path.
    pub forced: Option<Vec<u32>>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// A stop token.
    Stop,
    /// max_tokens or the context limit.
    Length,
}

#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    /// The request left the queue and holds its KV pages.
    Admitted,
    /// `tokens` of the prompt are in the cache (sent after every prefill chunk).
    Prefilled { tokens: usize },
    Token(u32),
    Finished { reason: FinishReason, prompt_tokens: usize, completion_tokens: usize },
    Error(String),
}

/// Why a request was not accepted.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Rejected {
    #[error("{0}")]
    Invalid(String),
    #[error("the server is busy: {waiting} requests are already waiting; retry later")]
    QueueFull { waiting: usize },
    #[error("the engine has stopped")]
    Stopped,
    #[error("the backend has failed and serves nothing: {0}")]
    Failed(String),
}

/// Live counters for `/metrics` and admission decisions.
#[derive(Debug, Default)]
pub struct EngineStats {
    pub running: AtomicUsize,
    pub waiting: AtomicUsize,
    pub kv_pages_used: AtomicUsize,
    pub kv_pages_total: AtomicUsize,
    pub prompt_tokens: AtomicU64,
    pub generation_tokens: AtomicU64,
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

/// Limits the server derives from the plan.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    pub vocab_size: usize,
    pub max_context: usize,
    pub total_pages: usize,
}

pub type EventSink = Box<dyn FnMut(Event) -> bool + Send>;

struct Submission {
    request: GenerationRequest,
    /// Returns false once the receiver is gone (client disconnected): the sequence is cancelled.
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
        request.sampling.validate().map_err(Rejected::Invalid)?;
        if let Some(f) = self.stats.failure() {
            return Err(Rejected::Failed(f));
        }
        let waiting = self.stats.waiting.load(Ordering::SeqCst);
        if waiting >= self.max_waiting {
            return Err(Rejected::QueueFull { waiting });
        }
        self.stats.waiting.fetch_add(1, Ordering::SeqCst);
        self.tx.send(Submission { request, sink }).map_err(|_| {
            self.stats.waiting.fetch_sub(1, Ordering::SeqCst);
            Rejected::Stopped
        })
    }
}

struct Sequence {
    request: GenerationRequest,
    sink: EventSink,
    sampler: Sampler,
    pages: Vec<u32>,
    /// Tokens in the cache (prompt prefix prefilled so far, then generated ones).
    cached: usize,
    /// Next token to feed in decode.
    next: u32,
    generated: usize,
    /// Token budget: prompt + completion, capped by the context.
    limit: usize,
}

impl Sequence {
    fn next_token(&mut self, logits: &[f32]) -> u32 {
        match &self.request.forced {
            Some(forced) => forced.get(self.generated).copied().unwrap_or(u32::MAX),
            None => self.sampler.sample(logits),
        }
    }
}

/// Starts the engine thread over `model`. `max_waiting` bounds the queue (429 beyond it).
pub fn start(model: Box<dyn Forward>, max_waiting: usize) -> EngineHandle {
    let limits = Limits {
        vocab_size: model.vocab_size(),
        max_context: model.max_context(),
        total_pages: model.total_pages(),
    };
    let stats = Arc::new(EngineStats::default());
    stats.kv_pages_total.store(limits.total_pages, Ordering::SeqCst);
    let (tx, rx) = mpsc::channel();
    let thread_stats = stats.clone();
    std::thread::Builder::new()
        .name("kiln-engine".into())
        .spawn(move || {
            let _guard = StoppedOnDrop(thread_stats.clone());
            Engine::new(model, thread_stats).run(rx)
        })
        .expect("spawn engine thread");
    EngineHandle { tx, stats, limits, max_waiting }
}

struct Engine {
    model: Box<dyn Forward>,
    stats: Arc<EngineStats>,
    pages: PageAllocator,
    waiting: VecDeque<Submission>,
    running: Vec<Sequence>,
    logits_row: usize,
}

impl Engine {
    fn new(model: Box<dyn Forward>, stats: Arc<EngineStats>) -> Engine {
        let pages = PageAllocator::new(model.total_pages());
        let logits_row = model.vocab_size();
        Engine { model, stats, pages, waiting: VecDeque::new(), running: Vec::new(), logits_row }
    }

    fn run(mut self, rx: mpsc::Receiver<Submission>) {
        loop {
            // Block only when there is nothing to do.
            if self.running.is_empty() && self.waiting.is_empty() {
                match rx.recv() {
                    Ok(s) => self.waiting.push_back(s),
                    Err(_) => return,
                }
            }
            while let Ok(s) = rx.try_recv() {
                self.waiting.push_back(s);
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

    fn publish(&self) {
        self.stats.running.store(self.running.len(), Ordering::SeqCst);
        self.stats.kv_pages_used.store(self.pages.used(), Ordering::SeqCst);
    }

    /// FIFO admission while pages and decode slots last.
    fn admit(&mut self) {
        let page_size = self.model.page_size();
        while self.running.len() < self.model.max_decode_batch() {
            let Some(front) = self.waiting.front() else { break };
            let limit = (front.request.prompt.len() + front.request.max_tokens).min(self.model.max_context());
            let need = limit.div_ceil(page_size);
            if need > self.pages.total() {
                let mut s = self.waiting.pop_front().expect("front exists");
                self.stats.waiting.fetch_sub(1, Ordering::SeqCst);
                (s.sink)(Event::Error(format!(
                    "prompt + max_tokens needs {need} KV pages of {page_size} tokens; the plan holds {}",
                    self.pages.total()
                )));
                continue;
            }
            let Some(pages) = self.pages.alloc(need) else { break };
            let mut s = self.waiting.pop_front().expect("front exists");
            self.stats.waiting.fetch_sub(1, Ordering::SeqCst);
            if !(s.sink)(Event::Admitted) {
                self.pages.release(pages); // the client left while queued
                continue;
            }
            self.stats.prompt_tokens.fetch_add(s.request.prompt.len() as u64, Ordering::Relaxed);
            let sampler = Sampler::new(s.request.sampling);
            self.running.push(Sequence { request: s.request, sink: s.sink, sampler, pages, cached: 0, next: 0, generated: 0, limit });
        }
        self.publish();
    }

    /// The first sequence still in its prompt gets one chunk.
    fn prefill_one_chunk(&mut self) {
        let Some(i) = self.running.iter().position(|s| s.cached < s.request.prompt.len()) else { return };
        let chunk = self.model.max_prefill_chunk();
        let s = &mut self.running[i];
        let end = (s.cached + chunk).min(s.request.prompt.len());
        let result = self.model.prefill(&s.pages, s.cached, &s.request.prompt[s.cached..end]);
        match result {
            Ok(logits) => {
                s.cached = end;
                if !(s.sink)(Event::Prefilled { tokens: end }) {
                    self.finish(i); // the client left during a long prefill
                    return;
                }
                if end == s.request.prompt.len() {
                    let token = s.next_token(&logits);
                    if !self.emit(i, token) {
                        self.finish(i);
                    }
                }
            }
            Err(e) => self.fail(i, e),
        }
    }

    /// One token for every sequence past its prompt, in plan-sized batches.
    fn decode_step(&mut self) {
        let ready: Vec<usize> = (0..self.running.len()).filter(|&i| self.running[i].cached >= self.running[i].request.prompt.len()).collect();
        if ready.is_empty() {
            return;
        }
        let mut done = Vec::new();
        for batch in ready.chunks(self.model.max_decode_batch()) {
            let items: Vec<DecodeItem> = batch
                .iter()
                .map(|&i| {
                    let s = &self.running[i];
                    DecodeItem { pages: &s.pages, pos: s.cached, token: s.next }
                })
                .collect();
            let result = self.model.decode(&items);
            match result {
                Ok(logits) => {
                    for (row, &i) in batch.iter().enumerate() {
                        let s = &mut self.running[i];
                        s.cached += 1;
                        let token = s.next_token(&logits[row * self.logits_row..(row + 1) * self.logits_row]);
                        if !self.emit(i, token) {
                            done.push(i);
                        }
                    }
                }
                Err(e) => {
                    self.note_failure();
                    for &i in batch {
                        (self.running[i].sink)(Event::Error(e.clone()));
                        done.push(i);
                    }
                }
            }
        }
        done.sort_unstable();
        for i in done.into_iter().rev() {
            self.finish(i);
        }
    }

    /// Records a sampled token; false when the sequence is over (finished or cancelled).
    fn emit(&mut self, i: usize, token: u32) -> bool {
        let s = &mut self.running[i];
        // u32::MAX: the forced output is exhausted.
        let is_stop = token == u32::MAX || (!s.request.ignore_eos && s.request.stop_ids.contains(&token));
        if is_stop {
            let prompt_tokens = s.request.prompt.len();
            (s.sink)(Event::Finished { reason: FinishReason::Stop, prompt_tokens, completion_tokens: s.generated });
            return false;
        }
        s.generated += 1;
        s.next = token;
        self.stats.generation_tokens.fetch_add(1, Ordering::Relaxed);
        if !(s.sink)(Event::Token(token)) {
            return false; // client gone
        }
        if s.generated >= s.request.max_tokens || s.request.prompt.len() + s.generated >= s.limit {
            let prompt_tokens = s.request.prompt.len();
            (s.sink)(Event::Finished { reason: FinishReason::Length, prompt_tokens, completion_tokens: s.generated });
            return false;
        }
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

    fn finish(&mut self, i: usize) {
        let s = self.running.swap_remove(i);
        self.pages.release(s.pages);
        self.publish();
    }
}
