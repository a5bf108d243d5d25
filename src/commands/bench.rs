use crate::bench::{report, run, BenchOptions};

/// Benchmark a running `kiln serve` (or any OpenAI-compatible server).
///
/// Like SGLang's bench_serving: random prompts of --random-input-len tokens, --random-output-len generated
/// tokens each (ignore_eos), at most --max-concurrency in flight, streamed.
#[derive(clap::Args)]
pub struct Args {
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    #[arg(long, default_value_t = 8000)]
    port: u16,
    /// Model name to send (default: none, the server's only model).
    #[arg(long)]
    model: Option<String>,
    #[arg(long)]
    api_key: Option<String>,
    #[arg(long, default_value_t = 32)]
    num_prompts: usize,
    #[arg(long, default_value_t = 8)]
    max_concurrency: usize,
    #[arg(long, default_value_t = 128)]
    random_input_len: usize,
    #[arg(long, default_value_t = 64)]
    random_output_len: usize,
    /// Make the first N tokens of every prompt the same (a shared system prompt): the report's
    /// prefix cache hit rate then shows how much prefill the server saved.
    #[arg(long, default_value_t = 0)]
    shared_prefix_len: usize,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Print the result as JSON (SGLang key names) instead of the table.
    #[arg(long)]
    json: bool,
}

pub fn run_cli(a: Args) -> anyhow::Result<()> {
    if a.num_prompts == 0 || a.random_input_len == 0 || a.random_output_len == 0 {
        anyhow::bail!("--num-prompts, --random-input-len and --random-output-len must be positive");
    }
    let opts = BenchOptions {
        host: a.host,
        port: a.port,
        model: a.model,
        api_key: a.api_key,
        num_prompts: a.num_prompts,
        max_concurrency: a.max_concurrency,
        input_len: a.random_input_len,
        output_len: a.random_output_len,
        shared_prefix_len: a.shared_prefix_len,
        seed: a.seed,
    };
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    let (results, duration) = rt.block_on(run(opts.clone()));
    if let Some(failed) = results.iter().find(|r| !r.ok) {
        eprintln!("warning: {} of {} requests failed; first error: {}", results.iter().filter(|r| !r.ok).count(), results.len(), failed.error);
    }
    let rep = report::build(&results, duration, opts.max_concurrency);
    if a.json {
        println!("{}", serde_json::to_string_pretty(&rep.json)?);
    } else {
        print!("{}", rep.text);
    }
    if results.iter().all(|r| !r.ok) {
        anyhow::bail!("every request failed (is `kiln serve` running on {}:{}?)", opts.host, opts.port);
    }
    Ok(())
}
