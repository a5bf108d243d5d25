//! What a client hands the engine and what it hears back.

use crate::sampling::{SamplingParams, TokenLogprobs};

/// Restricts which tokens may come next (structured output, banned tokens). The engine masks
/// every step's logits with it before sampling and tells it the token chosen.
pub trait TokenConstraint: Send {
    /// Sets the logit of every token that may not come next to -inf.
    fn mask(&mut self, logits: &mut [f32]) -> Result<(), String>;
    /// Advances past the sampled `token`.
    fn commit(&mut self, token: u32) -> Result<(), String>;
    /// The output is complete: the sequence ends here (as if a stop token came).
    fn is_finished(&self) -> bool {
        false
    }
}

pub struct GenerationRequest {
    pub prompt: Vec<u32>,
    pub max_tokens: usize,
    pub sampling: SamplingParams,
    /// Token ids that end generation (not emitted): the model's eos ids and `stop_token_ids`.
    pub stop_ids: Vec<u32>,
    /// Keep generating through stop ids (used by tests and benchmarks).
    pub ignore_eos: bool,
    /// Stop ids are masked until this many tokens are generated.
    pub min_tokens: usize,
    /// Report log-probabilities: the sampled token's and this many alternatives'.
    pub logprobs: Option<usize>,
    pub constraint: Option<Box<dyn TokenConstraint>>,
    /// Test hook: emit these tokens instead of sampling (the forward passes still run), then
    /// stop as if an eos token came. Lets parser tests drive the real serving path.
    pub forced: Option<Vec<u32>>,
}

impl GenerationRequest {
    /// Greedy, no stop ids, nothing extra.
    pub fn new(prompt: Vec<u32>, max_tokens: usize) -> GenerationRequest {
        GenerationRequest {
            prompt,
            max_tokens,
            sampling: SamplingParams::default(),
            stop_ids: Vec::new(),
            ignore_eos: false,
            min_tokens: 0,
            logprobs: None,
            constraint: None,
            forced: None,
        }
    }
}

impl std::fmt::Debug for GenerationRequest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GenerationRequest")
            .field("prompt_tokens", &self.prompt.len())
            .field("max_tokens", &self.max_tokens)
            .field("sampling", &self.sampling)
            .field("constrained", &self.constraint.is_some())
            .finish_non_exhaustive()
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// A stop token, or a constraint's output is complete.
    Stop,
    /// max_tokens or the context limit.
    Length,
}

#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    /// The request left the queue and holds its KV pages; `cached_tokens` of its prompt were
    /// found in the prefix cache.
    Admitted { cached_tokens: usize },
    /// `tokens` of the prompt are in the cache (sent after every prefill chunk).
    Prefilled { tokens: usize },
    Token { id: u32, logprobs: Option<TokenLogprobs> },
    Finished { reason: FinishReason, prompt_tokens: usize, completion_tokens: usize, cached_tokens: usize },
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

/// Receives a request's events; returns false once the receiver is gone (the client hung up),
/// which cancels the sequence.
pub type EventSink = Box<dyn FnMut(Event) -> bool + Send>;
