//! One request inside the engine: its tokens, the KV pages it holds, and how it picks its next
//! token (penalties, constraint mask, sampling, log-probabilities).

use crate::pages::{PagePool, ROOT_HASH};
use crate::request::{Event, EventSink, FinishReason, GenerationRequest};
use crate::sampling::{logprobs, Sampler, TokenHistory, TokenLogprobs};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// Computing the KV of `tokens` (the prompt, or after a preemption prompt + output).
    Prefill,
    /// One token per step.
    Decode,
}

pub struct Sequence {
    pub request: GenerationRequest,
    pub sink: EventSink,
    /// Submission order: the youngest running sequence is preempted first.
    pub arrival: u64,
    /// Prompt, then every generated token.
    pub tokens: Vec<u32>,
    /// Tokens whose KV is in `pages`.
    pub cached: usize,
    pub pages: Vec<u32>,
    pub phase: Phase,
    /// Leading pages registered in the prefix cache, and the chain hash after the last one.
    pub registered: usize,
    pub chain: u64,
    /// Prompt tokens the prefix cache served at first admission.
    pub cached_prompt: usize,
    /// Sent `Admitted` (the first admission; a resumed sequence is not announced again).
    pub announced: bool,
    /// Token budget: prompt + completion, capped by the context.
    pub limit: usize,
    /// Speculative drafts the model's choice was compared with, and those it equalled.
    drafts_tested: u32,
    drafts_accepted: u32,
    /// With a draft model: positions below this have the draft layer's KV computed from the
    /// model's own hidden states (a cached prefix's as its first owner left it).
    pub draft_cached: usize,
    /// The model's hidden rows of positions `draft_cached..cached`, which the draft layer has
    /// still to take in (each beside the token after it).
    pub draft_hidden: Vec<f32>,
    sampler: Sampler,
    history: Option<TokenHistory>,
    /// Scratch row for penalties and masks, reused every step.
    row: Vec<f32>,
}

impl Sequence {
    pub fn new(request: GenerationRequest, sink: EventSink, arrival: u64, max_context: usize) -> Sequence {
        let limit = (request.prompt.len() + request.max_tokens).min(max_context);
        let history = request.sampling.penalises().then(|| TokenHistory::new(&request.prompt));
        Sequence {
            sampler: Sampler::new(request.sampling),
            tokens: request.prompt.clone(),
            request,
            sink,
            arrival,
            cached: 0,
            pages: Vec::new(),
            phase: Phase::Prefill,
            registered: 0,
            chain: ROOT_HASH,
            cached_prompt: 0,
            announced: false,
            limit,
            drafts_tested: 0,
            drafts_accepted: 0,
            draft_cached: 0,
            draft_hidden: Vec::new(),
            history,
            row: Vec::new(),
        }
    }

    pub fn prompt_len(&self) -> usize {
        self.request.prompt.len()
    }

    pub fn generated(&self) -> usize {
        self.tokens.len() - self.prompt_len()
    }

    /// The chance that this sequence's next draft is accepted, from its record (Laplace's rule:
    /// one accepted and one rejected draft assumed, so a new sequence starts at one half).
    pub fn draft_acceptance(&self) -> f64 {
        (self.drafts_accepted as f64 + 1.0) / (self.drafts_tested as f64 + 2.0)
    }

    /// A draft was compared with the token the model chose.
    pub fn record_draft(&mut self, accepted: bool) {
        self.drafts_tested += 1;
        self.drafts_accepted += accepted as u32;
    }

    /// Registers every page that has become full and computed.
    pub fn register_full_pages(&mut self, pool: &mut PagePool) {
        let ps = pool.page_size();
        while (self.registered + 1) * ps <= self.cached {
            let i = self.registered;
            self.chain = pool.register(self.pages[i], self.chain, &self.tokens[i * ps..(i + 1) * ps], i);
            self.registered += 1;
        }
    }

    /// Lets go of every page and starts over (the KV is recomputed on resume).
    pub fn drop_pages(&mut self, pool: &mut PagePool) {
        pool.release(&self.pages);
        self.pages.clear();
        self.cached = 0;
        self.registered = 0;
        self.chain = ROOT_HASH;
        self.phase = Phase::Prefill;
        self.draft_cached = 0;
        self.draft_hidden.clear();
    }

    /// Chooses the next token from the model's `logits` row. Err: the constraint failed.
    pub fn choose(&mut self, logits: &[f32]) -> Result<(u32, Option<TokenLogprobs>), String> {
        if let Some(forced) = &self.request.forced {
            // u32::MAX: the forced output is exhausted.
            return Ok((forced.get(self.generated()).copied().unwrap_or(u32::MAX), None));
        }
        let r = &mut self.request;
        let plain = self.history.is_none() && r.constraint.is_none() && (r.min_tokens == 0 || r.ignore_eos);
        let token = if plain {
            self.sampler.sample(logits)
        } else {
            self.row.clear();
            self.row.extend_from_slice(logits);
            if let Some(h) = &self.history {
                h.penalise(&r.sampling, &mut self.row);
            }
            if self.tokens.len() - r.prompt.len() < r.min_tokens && !r.ignore_eos {
                for &s in &r.stop_ids {
                    if let Some(l) = self.row.get_mut(s as usize) {
                        *l = f32::NEG_INFINITY;
                    }
                }
            }
            if let Some(c) = r.constraint.as_mut() {
                c.mask(&mut self.row)?;
                if self.row.iter().all(|l| *l == f32::NEG_INFINITY) {
                    return Err("the output constraint allows no token here".into());
                }
            }
            let t = self.sampler.sample(&self.row);
            if let Some(c) = r.constraint.as_mut() {
                c.commit(t)?;
            }
            t
        };
        let lp = r.logprobs.map(|top| logprobs(logits, token, top));
        Ok((token, lp))
    }

    /// Records a chosen token; false when the sequence is over (finished or cancelled).
    pub fn emit(&mut self, token: u32, logprobs: Option<TokenLogprobs>) -> bool {
        let r = &self.request;
        let is_stop = token == u32::MAX || (!r.ignore_eos && r.stop_ids.contains(&token));
        if is_stop {
            self.finish(FinishReason::Stop);
            return false;
        }
        self.tokens.push(token);
        if let Some(h) = self.history.as_mut() {
            h.push(token);
        }
        if !(self.sink)(Event::Token { id: token, logprobs }) {
            return false; // client gone
        }
        let complete = self.request.constraint.as_ref().is_some_and(|c| c.is_finished());
        if complete {
            self.finish(FinishReason::Stop);
            return false;
        }
        if self.generated() >= self.request.max_tokens || self.tokens.len() >= self.limit {
            self.finish(FinishReason::Length);
            return false;
        }
        true
    }

    fn finish(&mut self, reason: FinishReason) {
        let (prompt_tokens, completion_tokens, cached_tokens) = (self.prompt_len(), self.generated(), self.cached_prompt);
        (self.sink)(Event::Finished { reason, prompt_tokens, completion_tokens, cached_tokens });
    }
}
