//! `kiln bench`: a serving benchmark client. Random token-id prompts of a fixed input length
//! (optionally all starting with one shared prefix, like a system prompt, which exercises the
//! prefix cache), a fixed number of output tokens (ignore_eos), bounded concurrency, streamed
//! through `/v1/completions` so TTFT and inter-token latencies are measured per chunk.

mod http;
pub mod report;

use report::RequestResult;
use std::sync::Arc;
use std::time::Instant;

#[derive(Debug, Clone)]
pub struct BenchOptions {
    pub host: String,
    pub port: u16,
    pub model: Option<String>,
    pub api_key: Option<String>,
    pub num_prompts: usize,
    pub max_concurrency: usize,
    pub input_len: usize,
    pub output_len: usize,
    /// The first this many tokens of every prompt are the same.
    pub shared_prefix_len: usize,
    pub seed: u64,
}

/// Prompt `i`: `input_len` ids drawn from the byte range (valid in every kiln tokenizer), the
/// first `shared` of them the same for every prompt.
fn prompt(seed: u64, i: usize, len: usize, shared: usize) -> Vec<u32> {
    let ids = |stream: u64, n: usize| {
        let mut rng = kiln_runtime::rng::Rng::new(seed ^ stream.wrapping_mul(0x9E37_79B9_7F4A_7C15));
        (0..n).map(move |_| (rng.next_u64() % 256) as u32)
    };
    let shared = shared.min(len);
    ids(u64::MAX, shared).chain(ids(i as u64, len - shared)).collect()
}

async fn one(opts: Arc<BenchOptions>, client: http::Client, i: usize) -> RequestResult {
    let ids = prompt(opts.seed, i, opts.input_len, opts.shared_prefix_len);
    let mut body = serde_json::json!({
        "prompt": ids, "max_tokens": opts.output_len, "temperature": 0.0, "ignore_eos": true,
        "stream": true, "stream_options": {"include_usage": true},
    });
    if let Some(m) = &opts.model {
        body["model"] = m.clone().into();
    }
    let mut r = RequestResult { input_tokens: opts.input_len, ..Default::default() };
    let start = Instant::now();
    let mut resp = match client.post_json("/v1/completions", body.to_string()).await {
        Ok(resp) => resp,
        Err(e) => {
            r.error = e.to_string();
            return r;
        }
    };
    if resp.status != 200 {
        let status = resp.status;
        r.error = format!("HTTP {status}: {}", resp.text().await.unwrap_or_default());
        return r;
    }
    let mut last: Option<Instant> = None;
    loop {
        match resp.next_event().await {
            Ok(Some(data)) if data == "[DONE]" => break,
            Ok(Some(data)) => {
                let Ok(v) = serde_json::from_str::<serde_json::Value>(&data) else { continue };
                if let Some(err) = v.get("error") {
                    r.error = err.to_string();
                    return r;
                }
                if let Some(u) = v.get("usage").filter(|u| !u.is_null()) {
                    r.output_tokens = u["completion_tokens"].as_u64().unwrap_or(0) as usize;
                    r.cached_tokens = u["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap_or(0) as usize;
                }
                let has_text = v["choices"].get(0).and_then(|c| c["text"].as_str()).is_some_and(|t| !t.is_empty());
                if has_text {
                    let now = Instant::now();
                    match last {
                        None => r.ttft_s = (now - start).as_secs_f64(),
                        Some(t) => r.itl_s.push((now - t).as_secs_f64()),
                    }
                    last = Some(now);
                }
            }
            Ok(None) => break,
            Err(e) => {
                r.error = e.to_string();
                return r;
            }
        }
    }
    r.e2e_s = start.elapsed().as_secs_f64();
    r.ok = r.output_tokens > 0;
    if !r.ok && r.error.is_empty() {
        r.error = "no tokens generated".into();
    }
    r
}

/// Runs the benchmark; returns per-request results and the wall time.
pub async fn run(opts: BenchOptions) -> (Vec<RequestResult>, f64) {
    let opts = Arc::new(opts);
    let client = http::Client::new(&opts.host, opts.port, opts.api_key.as_deref());
    let sem = Arc::new(tokio::sync::Semaphore::new(opts.max_concurrency.max(1)));
    let start = Instant::now();
    let mut tasks = Vec::new();
    for i in 0..opts.num_prompts {
        let permit = sem.clone().acquire_owned().await.expect("semaphore open");
        let (o, c) = (opts.clone(), client.clone());
        tasks.push(tokio::spawn(async move {
            let r = one(o, c, i).await;
            drop(permit);
            r
        }));
    }
    let mut results = Vec::new();
    for t in tasks {
        results.push(t.await.unwrap_or_else(|e| RequestResult { error: e.to_string(), ..Default::default() }));
    }
    (results, start.elapsed().as_secs_f64())
}

#[cfg(test)]
mod tests {
    #[test]
    fn prompts_share_exactly_the_prefix() {
        let (a, b) = (super::prompt(1, 0, 50, 20), super::prompt(1, 1, 50, 20));
        assert_eq!((a.len(), b.len()), (50, 50));
        assert_eq!(a[..20], b[..20]);
        assert_ne!(a[20..], b[20..]);
        assert_eq!(super::prompt(1, 0, 50, 0), super::prompt(1, 0, 50, 0), "deterministic");
    }
}
