use crate::server::{serve, AppState, EdgeLimits, Loaded};
use kiln_runtime::session::{Runner, SessionOptions};
use kiln_engine::chat_template::ChatTemplate;
use kiln_engine::constraint::ConstraintCompiler;
use kiln_engine::scheduler;
use kiln_engine::tokenizer::Tokenizer;
use kiln_runtime::plan::read_artifact;
use kiln_runtime::session::{weights_dir, BackendKind};
use std::path::PathBuf;
use std::sync::Arc;

/// Serve a compiled plan behind an OpenAI-compatible HTTP API.
///
/// Endpoints: POST /v1/chat/completions (GLM reasoning_content and tool calls, streaming with
/// `stream: true`), POST /v1/completions, GET /v1/models, GET /health (503 while loading),
/// GET /metrics (Prometheus). Drop-in for `--reasoning-parser glm45 --tool-call-parser glm47`.
#[derive(clap::Args)]
pub struct Args {
    /// Artifact directory written by `kiln compile`.
    artifact: PathBuf,
    /// Checkpoint with the weights (default: the directory the artifact was compiled from).
    #[arg(long)]
    weights: Option<PathBuf>,
    /// Before binding, scan every weight for NaN/Inf and check the hashes `kiln compile
    /// --hash-weights` recorded; refuse to serve damaged weights (reads the whole checkpoint).
    #[arg(long)]
    check_weights: bool,
    /// Address to bind; 127.0.0.1 keeps the server local.
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    #[arg(long, default_value_t = 8000)]
    port: u16,
    /// Execution backend: cpu (reference), emu (the plan's PTX kernels on the emulator: a
    /// functional check of a GPU-target artifact, far too slow to serve traffic) or cuda (the
    /// GPUs, programs replayed as CUDA graphs).
    #[arg(long, default_value = "cpu", value_parser = ["cpu", "emu", "cuda"])]
    backend: String,
    /// Model name clients send and /v1/models lists (default: the artifact directory's name).
    #[arg(long)]
    served_model_name: Option<String>,
    /// Require `Authorization: Bearer KEY` on /v1 endpoints.
    #[arg(long)]
    api_key: Option<String>,
    /// Requests that may wait for admission before new ones get HTTP 429.
    #[arg(long, default_value_t = 256)]
    max_waiting: usize,
    /// Cap the KV cache at this many tokens (SGLang's flag; default: every page the plan
    /// reserves). Requests take KV pages as they grow; when the pool runs dry the youngest
    /// running request is preempted and later recomputed. Caps the context too.
    #[arg(long)]
    max_total_tokens: Option<usize>,
    /// Do not keep finished requests' KV for reuse by prompts that start the same way
    /// (automatic prefix caching is on by default).
    #[arg(long)]
    disable_prefix_cache: bool,
    /// Speculative decoding from the text itself (prompt lookup; vLLM's `ngram`): up to K draft
    /// tokens per request and step, what followed the latest earlier occurrence of its last 2 to
    /// 4 tokens. The model checks them in the same decode step, in rows its batch has to spare,
    /// and keeps each it would have chosen anyway, so the output is unchanged (sampling
    /// included) while a step may yield up to K + 1 tokens. Pays where output repeats its
    /// context (code edits, quotes, structured data); every draft is a decode row, so on a GPU
    /// plan drafts run only where the predicted step times and the request's acceptance so far
    /// say they pay (the CPU backend has no step times: its spare rows take them). 0: off.
    #[arg(long, default_value_t = 0, value_name = "K")]
    speculative_ngram: usize,
    /// Speculative decoding with the artifact's draft model (`kiln compile --draft mtp`: the
    /// checkpoint's MTP layer): up to K draft tokens per request and step, the draft model's
    /// most likely tokens, checked by the model in the same decode step like
    /// --speculative-ngram's (the output is unchanged). The draft layer keeps its own KV cache,
    /// fed with the model's hidden state at every position.
    /// 0: off.
    #[arg(long, default_value_t = 0, value_name = "K")]
    speculative_draft: usize,
    /// Seconds a client has to send a request head; also how long an idle keep-alive connection
    /// stays open. A slow or idle client is disconnected after it.
    #[arg(long, default_value_t = 30)]
    http_timeout: u64,
    /// Open connections served at once; past it a new connection gets a 503 and is closed.
    #[arg(long, default_value_t = 4096)]
    max_connections: usize,
    /// Accept `kiln_forced_output` in requests (tests only: forces the generated text).
    #[arg(long, hide = true)]
    enable_test_hooks: bool,
}

pub fn run(a: Args) -> anyhow::Result<()> {
    let backend = super::backend_kind(&a.backend)?;
    let addr: std::net::SocketAddr = format!("{}:{}", a.host, a.port).parse().map_err(|e| anyhow::anyhow!("--host {} --port {}: {e}", a.host, a.port))?;
    let name = a.served_model_name.clone().unwrap_or_else(|| {
        std::fs::canonicalize(&a.artifact).ok().and_then(|p| p.file_name().map(|n| n.to_string_lossy().into_owned())).unwrap_or_else(|| "kiln".into())
    });
    // Check what can be checked before binding the port.
    let plan = read_artifact(&a.artifact)?;
    let weights = weights_dir(&a.artifact, a.weights.as_deref())?;
    if backend == BackendKind::Cuda && !plan.kernels.is_empty() {
        // A machine without the plan's GPUs is refused before the port is bound (a plan without
        // kernels is refused by the backend itself, naming its target).
        kiln_runtime::cuda::hardware::check(&plan)?;
    }
    let text_dir = super::text_files_dir(&a.artifact, &weights);
    let state = AppState::new(name, a.api_key.clone(), a.enable_test_hooks);
    let artifact = a.artifact.clone();
    let check_weights = a.check_weights;
    let options = scheduler::EngineOptions {
        max_waiting: a.max_waiting,
        max_total_tokens: a.max_total_tokens,
        prefix_cache: !a.disable_prefix_cache,
        speculation: super::speculation(a.speculative_ngram),
        draft_model: super::draft_model(a.speculative_draft, a.speculative_ngram, &plan)?,
    };
    if a.max_total_tokens == Some(0) {
        anyhow::bail!("--max-total-tokens must be at least one KV page ({} tokens)", plan.memory.kv.page_size);
    }
    let load = move || -> anyhow::Result<Loaded> {
        let tokenizer = Tokenizer::from_dir(&text_dir)?;
        let chat_template = match ChatTemplate::from_dir(&text_dir) {
            Ok(t) => Some(t),
            Err(e) => {
                eprintln!("warning: {e}; /v1/chat/completions is disabled");
                None
            }
        };
        let eos_ids = plan.model.eos_token_ids.clone();
        let vocab = plan.model.vocab_size;
        let forward = Runner::open_plan(plan, &artifact, Some(&weights), SessionOptions { progress: true, backend, check_weights, ..SessionOptions::default() })?;
        let constraints = match ConstraintCompiler::new(&tokenizer, vocab, &eos_ids) {
            Ok(c) => Some(Arc::new(c)),
            Err(e) => {
                eprintln!("warning: structured output (response_format, forced tool_choice) is disabled: {e}");
                None
            }
        };
        let engine = scheduler::start(Box::new(forward), options);
        let l = engine.limits;
        eprintln!(
            "kiln serve: KV pool {} tokens ({} pages of {}), context {} tokens, prefix cache {}",
            l.total_pages * l.page_size,
            l.total_pages,
            l.page_size,
            l.max_context,
            if options.prefix_cache { "on" } else { "off" }
        );
        let max_token_bytes = (0..tokenizer.inner().get_vocab_size(true) as u32).map(|id| tokenizer.token_bytes(id).len()).max().unwrap_or(1);
        Ok(Loaded { engine, tokenizer, chat_template, eos_ids, constraints, max_token_bytes })
    };
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    if a.http_timeout == 0 || a.max_connections == 0 {
        anyhow::bail!("--http-timeout and --max-connections must be at least 1");
    }
    let edge = EdgeLimits { timeout: std::time::Duration::from_secs(a.http_timeout), max_connections: a.max_connections };
    rt.block_on(serve(state, addr, edge, load))
}
