use kiln_runtime::session::{Runner, SessionOptions};
use kiln_engine::chat_template::{ChatInput, ChatTemplate};
use kiln_engine::forward::Forward;
use kiln_engine::scheduler::{self, Event, GenerationRequest};
use kiln_engine::sampling::SamplingParams;
use kiln_engine::tokenizer::{StreamDecoder, Tokenizer};
use kiln_engine::tool_calls::{OutputDelta, OutputParser};
use std::io::Write;
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::time::Instant;

/// Generate text from a prompt, streaming tokens to stdout; prints tokens/s at the end.
#[derive(clap::Args)]
pub struct Args {
    /// Artifact directory written by `kiln compile`.
    pub artifact: PathBuf,
    /// Checkpoint with the weights (default: the directory the artifact was compiled from).
    #[arg(long)]
    pub weights: Option<PathBuf>,
    /// Before binding, scan every weight for NaN/Inf and check the hashes `kiln compile
    /// --hash-weights` recorded (reads the whole checkpoint).
    #[arg(long)]
    pub check_weights: bool,
    #[arg(long)]
    pub prompt: String,
    /// Render the prompt as one user message through the model's chat template, and print the
    /// reply as the server splits it: `thinking:` (reasoning_content), then `answer:` (content).
    #[arg(long)]
    pub chat: bool,
    /// With --chat: the template's thinking-off form (`enable_thinking: false`), the answer only.
    #[arg(long, requires = "chat")]
    pub no_thinking: bool,
    #[arg(long, default_value_t = 64)]
    pub max_tokens: usize,
    /// 0 = greedy.
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f32,
    #[arg(long, default_value_t = 1.0)]
    pub top_p: f32,
    /// 0 = off.
    #[arg(long, default_value_t = 0)]
    pub top_k: usize,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Execution backend: cpu (reference), emu (the plan's PTX kernels on the emulator; needs an
    /// artifact compiled for a GPU target, and is slow) or cuda (the GPUs; checks the machine
    /// against the plan first; `kiln doctor` tells what a machine has).
    #[arg(long, default_value = "cpu", value_parser = ["cpu", "emu", "cuda"])]
    pub backend: String,
    /// Speculative decoding from the text itself (as `kiln serve --speculative-ngram`): up to K
    /// draft tokens a step from what followed the last 2 to 4 tokens earlier, checked by the
    /// model in the same decode step; the output is unchanged (GPU plans: only drafts their
    /// predicted step times say pay). 0: off.
    #[arg(long, default_value_t = 0, value_name = "K")]
    pub speculative_ngram: usize,
    /// Speculative decoding with the artifact's draft model (`kiln compile --draft mtp`: the
    /// checkpoint's MTP layer): up to K draft tokens per request and step, the draft model's
    /// most likely tokens, checked by the model in the same decode step like
    /// --speculative-ngram's (the output is unchanged). The draft layer keeps its own KV cache,
    /// fed with the model's hidden state at every position.
    /// 0: off.
    #[arg(long, default_value_t = 0, value_name = "K")]
    pub speculative_draft: usize,
}

pub fn run(a: Args) -> anyhow::Result<()> {
    let backend = super::backend_kind(&a.backend)?;
    if a.prompt.is_empty() {
        anyhow::bail!("--prompt is empty");
    }
    if a.max_tokens == 0 {
        anyhow::bail!("--max-tokens must be at least 1");
    }
    let params = SamplingParams { temperature: a.temperature, top_p: a.top_p, top_k: a.top_k, seed: a.seed, ..SamplingParams::default() };
    params.validate().map_err(|m| anyhow::anyhow!("sampling: {m}"))?;
    // Before the tokenizer and template are read: a damaged file is named as such.
    let plan = kiln_runtime::plan::read_artifact(&a.artifact)?;
    let weights = kiln_runtime::session::weights_dir(&a.artifact, a.weights.as_deref())?;
    let text_dir = super::text_files_dir(&a.artifact, &weights);
    let tok = Tokenizer::from_dir(&text_dir)?;
    let text = if a.chat {
        let template = ChatTemplate::from_dir(&text_dir)?;
        let messages = serde_json::json!([{"role": "user", "content": a.prompt}]);
        let mut input = ChatInput::from_json(&messages, None);
        if a.no_thinking {
            input.chat_template_kwargs.insert("enable_thinking".into(), serde_json::json!(false).into());
        }
        template.render(&input)?
    } else {
        a.prompt.clone()
    };
    let prompt = tok.encode(&text)?;
    let model = Runner::open_plan(plan, &a.artifact, Some(&weights), SessionOptions { progress: true, backend, check_weights: a.check_weights, ..SessionOptions::default() })?;
    let eos = model.plan().model.eos_token_ids.clone();
    let limit = Forward::max_context(&model);
    if prompt.len() + a.max_tokens > limit {
        anyhow::bail!(
            "the prompt has {} tokens and --max-tokens asks for {} more, but the plan's context is {limit} tokens",
            prompt.len(),
            a.max_tokens
        );
    }
    // The same engine `kiln serve` uses, with one request.
    let draft_model = super::draft_model(a.speculative_draft, a.speculative_ngram, model.plan())?;
    let engine = scheduler::start(Box::new(model), scheduler::EngineOptions { max_waiting: 1, speculation: super::speculation(a.speculative_ngram), draft_model, ..Default::default() });
    let (tx, rx) = std::sync::mpsc::channel();
    let request = GenerationRequest { sampling: params, stop_ids: eos, ..GenerationRequest::new(prompt.clone(), a.max_tokens) };
    let start = Instant::now();
    engine.submit(request, Box::new(move |e| tx.send(e).is_ok())).map_err(|e| anyhow::anyhow!("{e}"))?;
    let mut out = std::io::stdout().lock();
    let mut decoder = StreamDecoder::default();
    let mut reply = a.chat.then(|| Reply { parser: OutputParser::new(!a.no_thinking, None), shown: Shown::Nothing });
    let (mut prefill_s, mut first_token, mut generated) = (0.0, None, 0usize);
    for event in rx {
        match event {
            Event::Admitted { .. } => {}
            Event::Prefilled { tokens } if tokens == prompt.len() => prefill_s = start.elapsed().as_secs_f64(),
            Event::Prefilled { .. } => {}
            Event::Token { id, .. } => {
                first_token.get_or_insert_with(Instant::now);
                generated += 1;
                let text = decoder.push(&tok, id)?;
                match &mut reply {
                    Some(r) => r.show(&mut out, |p| p.push(&text))?,
                    None => write!(out, "{text}")?,
                }
                out.flush()?;
            }
            Event::Finished { .. } => {
                if let Some(r) = &mut reply {
                    r.show(&mut out, OutputParser::finish)?;
                }
                break;
            }
            Event::Error(e) => anyhow::bail!("generation failed: {e}"),
        }
    }
    writeln!(out)?;
    let decode_s = first_token.map(|t| t.elapsed().as_secs_f64()).unwrap_or(0.0);
    eprintln!(
        "[{} prompt tokens in {:.3}s ({:.1} tok/s); {generated} generated, {:.1} tok/s decode]",
        prompt.len(),
        prefill_s,
        prompt.len() as f64 / prefill_s.max(1e-9),
        generated.saturating_sub(1) as f64 / decode_s.max(1e-9)
    );
    if a.speculative_ngram > 0 || a.speculative_draft > 0 {
        let (drafted, accepted) = (engine.stats.draft_tokens.load(Ordering::Relaxed), engine.stats.accepted_draft_tokens.load(Ordering::Relaxed));
        eprintln!("[speculative decoding: {drafted} draft tokens checked, {accepted} accepted]");
    }
    Ok(())
}

/// A chat reply printed as it streams, split the way the server splits it.
struct Reply {
    parser: OutputParser,
    shown: Shown,
}

#[derive(PartialEq)]
enum Shown {
    Nothing,
    Thinking,
    Answer,
}

impl Reply {
    fn show(&mut self, out: &mut impl Write, step: impl FnOnce(&mut OutputParser) -> OutputDelta) -> std::io::Result<()> {
        let d = step(&mut self.parser);
        if !d.reasoning.is_empty() {
            if self.shown == Shown::Nothing {
                write!(out, "thinking: ")?;
                self.shown = Shown::Thinking;
            }
            write!(out, "{}", d.reasoning)?;
        }
        if !d.content.is_empty() {
            match self.shown {
                Shown::Nothing => write!(out, "answer: ")?,
                Shown::Thinking => write!(out, "\nanswer: ")?,
                Shown::Answer => {}
            }
            self.shown = Shown::Answer;
            write!(out, "{}", d.content)?;
        }
        Ok(())
    }
}
