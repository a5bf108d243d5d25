//! Shared server state: configuration, metrics, and the model once it has loaded.

use super::metrics::Metrics;
use kiln_engine::chat_template::ChatTemplate;
use kiln_engine::constraint::ConstraintCompiler;
use kiln_engine::scheduler::EngineHandle;
use kiln_engine::tokenizer::Tokenizer;
use super::errors::ApiError;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

/// Everything that exists only after the model is loaded.
pub struct Loaded {
    pub engine: EngineHandle,
    pub tokenizer: Tokenizer,
    /// The artifact's chat template (None: only /v1/completions works).
    pub chat_template: Option<ChatTemplate>,
    /// Token ids that end generation (the model's eos ids).
    pub eos_ids: Vec<u32>,
    /// Compiles `response_format` / forced `tool_choice` grammars (None: the tokenizer could
    /// not be prepared; those requests get a 400 saying so).
    pub constraints: Option<Arc<ConstraintCompiler>>,
    /// The longest token's length in bytes: a text longer than this times the context cannot
    /// fit, whatever it tokenises to (refused before tokenising it).
    pub max_token_bytes: usize,
}

impl Loaded {
    /// Tokenises `text` on a blocking thread (a long prompt must not stall the async workers
    /// that answer `/health` and stream other requests), after refusing text too long to fit.
    pub async fn encode(self: &Arc<Self>, text: String, param: &'static str) -> Result<Vec<u32>, ApiError> {
        let context = self.engine.limits.max_context;
        if text.len() > context.saturating_mul(self.max_token_bytes.max(1)) {
            return Err(ApiError::context_length(
                format!("This model's maximum context length is {context} tokens; the {param} has {} bytes, more than that many tokens can hold", text.len()),
                param,
            ));
        }
        let me = self.clone();
        tokio::task::spawn_blocking(move || me.tokenizer.encode(&text))
            .await
            .map_err(|e| ApiError::invalid(format!("tokenising failed: {e}"), Some(param)))?
            .map_err(|e| ApiError::invalid(e.to_string(), Some(param)))
    }
}

pub struct Inner {
    pub served_model: String,
    pub api_key: Option<String>,
    /// Accept `kiln_forced_output` (tests drive the parsers through the real HTTP path).
    pub test_hooks: bool,
    pub metrics: Metrics,
    pub loaded: OnceLock<Arc<Loaded>>,
    pub created: u64,
    next_id: AtomicU64,
}

#[derive(Clone)]
pub struct AppState(pub Arc<Inner>);

impl std::ops::Deref for AppState {
    type Target = Inner;
    fn deref(&self) -> &Inner {
        &self.0
    }
}

impl AppState {
    pub fn new(served_model: String, api_key: Option<String>, test_hooks: bool) -> AppState {
        AppState(Arc::new(Inner {
            served_model,
            api_key,
            test_hooks,
            metrics: Metrics::default(),
            loaded: OnceLock::new(),
            created: unix_now(),
            next_id: AtomicU64::new(1),
        }))
    }

    /// A process-unique id with a prefix, e.g. `cmpl-3f2a...-7`.
    pub fn new_id(&self, prefix: &str) -> String {
        let n = self.next_id.fetch_add(1, Ordering::Relaxed);
        format!("{prefix}-{:08x}{n}", self.created as u32 ^ (n as u32).wrapping_mul(0x9E37_79B9))
    }
}

pub fn unix_now() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)
}
