//! A request's generation as seen by an HTTP handler: one engine sequence per choice, its events
//! turned into text deltas (streaming detokenisation, stop strings, log-probabilities), with
//! latency metrics recorded on the way. The choices' pieces arrive merged on one channel;
//! dropping it cancels every choice's sequence in the engine and frees its KV pages.

use super::errors::ApiError;
use super::logprobs::TokenInfo;
use super::params::CommonParams;
use super::state::Loaded;
use super::structured::{constraint, Structure};
use super::AppState;
use kiln_engine::scheduler::{Event, FinishReason, GenerationRequest, Rejected};
use kiln_engine::stop::StopMatcher;
use kiln_engine::tokenizer::StreamDecoder;
use std::sync::Arc;
use std::time::Instant;
use tokio::sync::mpsc;

pub enum Piece {
    /// One generated token and the text it makes visible now (may be empty).
    Token { text: String, logprobs: Option<TokenInfo> },
    /// Generation ended; `tail` is text held back until now.
    Done { reason: &'static str, tail: String, usage: Usage },
}

#[derive(Debug, Clone, Copy, Default)]
pub struct Usage {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    /// Prompt tokens the prefix cache served.
    pub cached_tokens: usize,
}

struct Generation {
    rx: mpsc::UnboundedReceiver<Event>,
    loaded: Arc<Loaded>,
    state: AppState,
    decoder: StreamDecoder,
    stops: StopMatcher,
    started: Instant,
    last_token: Option<Instant>,
    prompt_tokens: usize,
    cached_tokens: usize,
    generated: usize,
    finished: bool,
    tokens_as_ids: bool,
}

/// The test hook's forced output as token ids; refused unless the server enabled test hooks.
pub fn forced_tokens(state: &AppState, loaded: &Loaded, text: Option<&str>) -> Result<Option<Vec<u32>>, ApiError> {
    match text {
        None => Ok(None),
        Some(_) if !state.test_hooks => Err(ApiError::invalid("`kiln_forced_output` needs `kiln serve --enable-test-hooks`", Some("kiln_forced_output"))),
        Some(t) => loaded.tokenizer.encode(t).map(Some).map_err(|e| ApiError::invalid(e.to_string(), Some("kiln_forced_output"))),
    }
}

pub struct GenerationSpec {
    pub prompt: Vec<u32>,
    /// The request field the prompt came from (`prompt` or `messages`), for error messages.
    pub prompt_param: &'static str,
    pub max_tokens: Option<usize>,
    pub sampling: kiln_engine::sampling::SamplingParams,
    pub stop: Vec<String>,
    pub stop_token_ids: Vec<u32>,
    pub ignore_eos: bool,
    pub min_tokens: usize,
    pub logprobs: Option<usize>,
    /// Logprob tokens as `token_id:N` (vLLM's `return_tokens_as_token_ids`).
    pub tokens_as_ids: bool,
    /// What the output must be, and whether the prompt ends inside `<think>`.
    pub structure: Structure,
    pub thinking: bool,
    pub n: usize,
    /// Test hook (`--enable-test-hooks`): output tokens to force instead of sampling.
    pub forced: Option<Vec<u32>>,
}

impl GenerationSpec {
    /// The spec of a request whose common fields are `p`.
    pub fn new(p: &CommonParams, prompt: Vec<u32>, prompt_param: &'static str, structure: Structure, thinking: bool, forced: Option<Vec<u32>>) -> Self {
        GenerationSpec {
            prompt,
            prompt_param,
            max_tokens: p.max_tokens,
            sampling: p.sampling,
            stop: p.stop.clone(),
            stop_token_ids: p.stop_token_ids.clone(),
            ignore_eos: p.ignore_eos,
            min_tokens: p.min_tokens,
            logprobs: p.logprobs,
            tokens_as_ids: p.tokens_as_ids,
            structure,
            thinking,
            n: p.n,
            forced,
        }
    }
}

/// The pieces of every choice, tagged with the choice's index.
pub type Choices = mpsc::UnboundedReceiver<(usize, Result<Piece, ApiError>)>;

/// Submits the `spec.n` choices (choice i samples with seed + i) and merges their pieces.
pub fn start(state: &AppState, loaded: Arc<Loaded>, spec: GenerationSpec, request_id: &str) -> Result<Choices, ApiError> {
    let limits = loaded.engine.limits;
    if spec.prompt.len() >= limits.max_context {
        return Err(ApiError::context_length(
            format!("This model's maximum context length is {} tokens; the prompt has {} tokens", limits.max_context, spec.prompt.len()),
            spec.prompt_param,
        ));
    }
    let room = limits.max_context - spec.prompt.len();
    let max_tokens = spec.max_tokens.unwrap_or(room);
    if max_tokens > room {
        return Err(ApiError::context_length(
            format!(
                "This model's maximum context length is {} tokens; the prompt has {} tokens and max_tokens asks for {max_tokens} more",
                limits.max_context,
                spec.prompt.len()
            ),
            "max_tokens",
        ));
    }
    if let Some(bad) = spec.stop_token_ids.iter().find(|&&t| t as usize >= limits.vocab_size) {
        return Err(ApiError::invalid(format!("stop token id {bad} is outside the vocabulary of {}", limits.vocab_size), Some("stop_token_ids")));
    }
    let mut stop_ids = loaded.eos_ids.clone();
    stop_ids.extend(&spec.stop_token_ids);
    let mut gens = Vec::with_capacity(spec.n);
    for i in 0..spec.n {
        let (tx, rx) = mpsc::unbounded_channel();
        let mut sampling = spec.sampling;
        sampling.seed = sampling.seed.wrapping_add(i as u64);
        let request = GenerationRequest {
            sampling,
            stop_ids: stop_ids.clone(),
            ignore_eos: spec.ignore_eos,
            min_tokens: spec.min_tokens,
            logprobs: spec.logprobs,
            constraint: constraint(&loaded, &spec.structure, spec.thinking)?,
            forced: spec.forced.clone(),
            ..GenerationRequest::new(spec.prompt.clone(), max_tokens)
        };
        // An earlier choice already submitted is cancelled when `gens` drops on error.
        loaded.engine.submit(request, Box::new(move |e| tx.send(e).is_ok())).map_err(|r| match r {
            Rejected::Invalid(m) => ApiError::invalid(m, None),
            Rejected::QueueFull { .. } => ApiError::busy(r.to_string()),
            Rejected::Stopped | Rejected::Failed(_) => ApiError::unavailable(r.to_string()),
        })?;
        gens.push(Generation {
            rx,
            loaded: loaded.clone(),
            state: state.clone(),
            decoder: StreamDecoder::default(),
            stops: StopMatcher::new(spec.stop.clone()),
            started: Instant::now(),
            last_token: None,
            prompt_tokens: spec.prompt.len(),
            cached_tokens: 0,
            generated: 0,
            finished: false,
            tokens_as_ids: spec.tokens_as_ids,
        });
    }
    let (tx, rx) = mpsc::unbounded_channel();
    for (index, mut g) in gens.into_iter().enumerate() {
        let (tx, rid) = (tx.clone(), request_id.to_string());
        // Each choice forwards its pieces until it ends or the handler hangs up.
        tokio::spawn(async move {
            while let Some(piece) = g.next(&rid).await {
                if tx.send((index, piece)).is_err() {
                    break;
                }
            }
        });
    }
    Ok(rx)
}

impl Generation {
    /// The next piece; None after Done. An engine error becomes an internal error.
    async fn next(&mut self, request_id: &str) -> Option<Result<Piece, ApiError>> {
        if self.finished {
            return None;
        }
        let metrics = &self.state.metrics;
        // Progress events only prove the client is still there (the engine cancels on failure).
        let mut event = self.rx.recv().await;
        while let Some(Event::Admitted { .. } | Event::Prefilled { .. }) = event {
            if let Some(Event::Admitted { cached_tokens }) = event {
                self.cached_tokens = cached_tokens;
            }
            event = self.rx.recv().await;
        }
        let now = Instant::now();
        match event {
            Some(Event::Token { id, logprobs }) => {
                self.generated += 1;
                match self.last_token {
                    None => metrics.ttft.observe((now - self.started).as_secs_f64()),
                    Some(t) => metrics.itl.observe((now - t).as_secs_f64()),
                }
                self.last_token = Some(now);
                let text = match self.decoder.push(&self.loaded.tokenizer, id) {
                    Ok(t) => t,
                    Err(e) => return Some(Err(self.fail(request_id, e))),
                };
                let logprobs = logprobs.map(|l| TokenInfo::new(&self.loaded.tokenizer, id, &l, self.tokens_as_ids));
                let visible = self.stops.push(&text);
                if self.stops.stopped() {
                    // A stop string: end here; dropping the receiver cancels the sequence.
                    return Some(Ok(self.done("stop", visible)));
                }
                Some(Ok(Piece::Token { text: visible, logprobs }))
            }
            Some(Event::Finished { reason, cached_tokens, .. }) => {
                self.cached_tokens = cached_tokens;
                let tail = self.stops.finish();
                let reason = match reason {
                    FinishReason::Stop => "stop",
                    FinishReason::Length => "length",
                };
                Some(Ok(self.done(reason, tail)))
            }
            Some(Event::Error(e)) => match self.loaded.engine.stats.failure() {
                // The GPU backend is gone: say so (it is the server's state, not a secret).
                Some(f) => {
                    let _ = self.fail(request_id, &e);
                    Some(Err(ApiError::unavailable(format!("the backend failed while running this request and serves nothing until kiln is restarted: {f}"))))
                }
                None => Some(Err(self.fail(request_id, e))),
            },
            Some(Event::Admitted { .. } | Event::Prefilled { .. }) => unreachable!("skipped above"),
            None => Some(Err(self.fail(request_id, "the engine stopped"))),
        }
    }

    fn done(&mut self, reason: &'static str, tail: String) -> Piece {
        self.finished = true;
        self.rx.close();
        self.state.metrics.e2e.observe(self.started.elapsed().as_secs_f64());
        self.state.metrics.requests_ok.inc();
        let usage = Usage { prompt_tokens: self.prompt_tokens, completion_tokens: self.generated, cached_tokens: self.cached_tokens };
        Piece::Done { reason, tail, usage }
    }

    fn fail(&mut self, request_id: &str, cause: impl std::fmt::Display) -> ApiError {
        self.finished = true;
        self.state.metrics.requests_failed.inc();
        ApiError::internal(request_id, cause)
    }
}

/// The usage of a whole request: the prompt counts once, completions add up; the cached
/// prompt tokens are the first choice's (the others share its pages).
pub fn total_usage(choices: &[Usage]) -> Usage {
    Usage {
        prompt_tokens: choices.first().map_or(0, |u| u.prompt_tokens),
        completion_tokens: choices.iter().map(|u| u.completion_tokens).sum(),
        cached_tokens: choices.first().map_or(0, |u| u.cached_tokens),
    }
}

pub fn usage_json(u: Usage, reasoning_tokens: Option<usize>) -> serde_json::Value {
    let mut v = serde_json::json!({
        "prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
    });
    if let Some(r) = reasoning_tokens {
        v["completion_tokens_details"] = serde_json::json!({"reasoning_tokens": r});
    }
    v
}
