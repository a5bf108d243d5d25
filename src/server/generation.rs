//! One request's generation as seen by an HTTP handler: engine events turned into text deltas
//! (streaming detokenisation, stop strings), with latency metrics recorded on the way. Dropping
//! it cancels the sequence in the engine and frees its KV pages.

use super::errors::ApiError;
use super::state::Loaded;
use super::AppState;
use kiln_runtime::engine::scheduler::{Event, FinishReason, GenerationRequest, Rejected};
use kiln_runtime::engine::stop::StopMatcher;
use kiln_runtime::engine::tokenizer::StreamDecoder;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;
use tokio::sync::mpsc;

pub enum Piece {
    /// One generated token and the text it makes visible now (may be empty).
    Token { text: String },
    /// Generation ended; `tail` is text held back until now.
    Done { reason: &'static str, tail: String, prompt_tokens: usize, completion_tokens: usize },
}

pub struct Generation {
    rx: mpsc::UnboundedReceiver<Event>,
    loaded: Arc<Loaded>,
    state: AppState,
    decoder: StreamDecoder,
    stops: StopMatcher,
    started: Instant,
    last_token: Option<Instant>,
    prompt_tokens: usize,
    generated: usize,
    finished: bool,
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
    pub sampling: kiln_runtime::engine::sampling::SamplingParams,
    pub stop: Vec<String>,
    pub ignore_eos: bool,
    /// Test hook (`--enable-test-hooks`): output tokens to force instead of sampling.
    pub forced: Option<Vec<u32>>,
}

impl Generation {
    pub fn start(state: &AppState, loaded: Arc<Loaded>, spec: GenerationSpec) -> Result<Generation, ApiError> {
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
        let (tx, rx) = mpsc::unbounded_channel();
        let request = GenerationRequest {
            prompt: spec.prompt.clone(),
            max_tokens,
            sampling: spec.sampling,
            stop_ids: loaded.eos_ids.clone(),
            ignore_eos: spec.ignore_eos,
            forced: spec.forced,
        };
        loaded.engine.submit(request, Box::new(move |e| tx.send(e).is_ok())).map_err(|r| match r {
            Rejected::Invalid(m) => ApiError::invalid(m, None),
            Rejected::QueueFull { .. } => ApiError::busy(r.to_string()),
            Rejected::Stopped | Rejected::Failed(_) => ApiError::unavailable(r.to_string()),
        })?;
        Ok(Generation {
            rx,
            loaded,
            state: state.clone(),
            decoder: StreamDecoder::default(),
            stops: StopMatcher::new(spec.stop),
            started: Instant::now(),
            last_token: None,
            prompt_tokens: spec.prompt.len(),
            generated: 0,
            finished: false,
        })
    }

    /// The next piece; None after Done. An engine error becomes an internal error.
    pub async fn next(&mut self, request_id: &str) -> Option<Result<Piece, ApiError>> {
        if self.finished {
            return None;
        }
        let metrics = &self.state.metrics;
        // Progress events only prove the client is still there (the engine cancels on failure).
        let mut event = self.rx.recv().await;
        while matches!(event, Some(Event::Admitted | Event::Prefilled { .. })) {
            event = self.rx.recv().await;
        }
        let now = Instant::now();
        match event {
            Some(Event::Token(id)) => {
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
                let visible = self.stops.push(&text);
                if self.stops.stopped() {
                    // A stop string: end here; dropping the receiver cancels the sequence.
                    return Some(Ok(self.done("stop", visible)));
                }
                Some(Ok(Piece::Token { text: visible }))
            }
            Some(Event::Finished { reason, .. }) => {
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
            Some(Event::Admitted | Event::Prefilled { .. }) => unreachable!("skipped above"),
            None => Some(Err(self.fail(request_id, "the engine stopped"))),
        }
    }

    fn done(&mut self, reason: &'static str, tail: String) -> Piece {
        self.finished = true;
        self.rx.close();
        self.state.metrics.e2e.observe(self.started.elapsed().as_secs_f64());
        self.state.metrics.requests_ok.fetch_add(1, Ordering::Relaxed);
        Piece::Done { reason, tail, prompt_tokens: self.prompt_tokens, completion_tokens: self.generated }
    }

    fn fail(&mut self, request_id: &str, cause: impl std::fmt::Display) -> ApiError {
        self.finished = true;
        self.state.metrics.requests_failed.fetch_add(1, Ordering::Relaxed);
        ApiError::internal(request_id, cause)
    }
}
