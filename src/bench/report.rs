//! The benchmark report, in the layout and key names of SGLang's bench_serving.

use serde_json::json;

/// What one request measured.
#[derive(Debug, Clone, Default)]
pub struct RequestResult {
    pub ok: bool,
    pub error: String,
    pub input_tokens: usize,
    pub output_tokens: usize,
    /// Prompt tokens the server's prefix cache served (`usage.prompt_tokens_details`).
    pub cached_tokens: usize,
    pub ttft_s: f64,
    /// Gaps between consecutive streamed chunks after the first.
    pub itl_s: Vec<f64>,
    pub e2e_s: f64,
}

pub struct Report {
    pub json: serde_json::Value,
    pub text: String,
}

fn mean(v: &[f64]) -> f64 {
    if v.is_empty() {
        0.0
    } else {
        v.iter().sum::<f64>() / v.len() as f64
    }
}

/// Percentile with linear interpolation (numpy's default), `p` in [0, 100].
pub fn percentile(v: &[f64], p: f64) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    let rank = p / 100.0 * (s.len() - 1) as f64;
    let (lo, hi) = (rank.floor() as usize, rank.ceil() as usize);
    s[lo] + (s[hi] - s[lo]) * (rank - lo as f64)
}

pub fn build(results: &[RequestResult], duration_s: f64, max_concurrency: usize) -> Report {
    let ok: Vec<&RequestResult> = results.iter().filter(|r| r.ok).collect();
    let ms = |v: Vec<f64>| v.into_iter().map(|x| x * 1000.0).collect::<Vec<_>>();
    let ttft = ms(ok.iter().map(|r| r.ttft_s).collect());
    let e2e = ms(ok.iter().map(|r| r.e2e_s).collect());
    let tpot = ms(ok.iter().filter(|r| r.output_tokens > 1).map(|r| (r.e2e_s - r.ttft_s) / (r.output_tokens - 1) as f64).collect());
    let itl = ms(ok.iter().flat_map(|r| r.itl_s.iter().copied()).collect());
    let input: usize = ok.iter().map(|r| r.input_tokens).sum();
    let output: usize = ok.iter().map(|r| r.output_tokens).sum();
    let cached: usize = ok.iter().map(|r| r.cached_tokens).sum();
    let d = duration_s.max(1e-9);
    let json = json!({
        "backend": "kiln",
        "completed": ok.len(),
        "failed": results.len() - ok.len(),
        "duration": duration_s,
        "max_concurrency": max_concurrency,
        "total_input_tokens": input,
        "total_output_tokens": output,
        "total_cached_tokens": cached,
        "prefix_cache_hit_rate": cached as f64 / input.max(1) as f64,
        "request_throughput": ok.len() as f64 / d,
        "input_throughput": input as f64 / d,
        "output_throughput": output as f64 / d,
        "total_throughput": (input + output) as f64 / d,
        "concurrency": e2e.iter().sum::<f64>() / 1000.0 / d,
        "mean_e2e_latency_ms": mean(&e2e),
        "median_e2e_latency_ms": percentile(&e2e, 50.0),
        "mean_ttft_ms": mean(&ttft),
        "median_ttft_ms": percentile(&ttft, 50.0),
        "p99_ttft_ms": percentile(&ttft, 99.0),
        "mean_tpot_ms": mean(&tpot),
        "median_tpot_ms": percentile(&tpot, 50.0),
        "p99_tpot_ms": percentile(&tpot, 99.0),
        "mean_itl_ms": mean(&itl),
        "median_itl_ms": percentile(&itl, 50.0),
        "p99_itl_ms": percentile(&itl, 99.0),
    });
    let f = |k: &str| json[k].as_f64().unwrap_or(0.0);
    let mut t = String::new();
    let line = |t: &mut String, label: &str, value: String| t.push_str(&format!("{label:<41}{value:<10}\n"));
    t.push_str(&format!("{:=^50}\n", " Serving Benchmark Result "));
    line(&mut t, "Backend:", "kiln".into());
    line(&mut t, "Max request concurrency:", max_concurrency.to_string());
    line(&mut t, "Successful requests:", ok.len().to_string());
    line(&mut t, "Failed requests:", (results.len() - ok.len()).to_string());
    line(&mut t, "Benchmark duration (s):", format!("{duration_s:.2}"));
    line(&mut t, "Total input tokens:", input.to_string());
    line(&mut t, "Total generated tokens:", output.to_string());
    line(&mut t, "Prefix cache hit rate:", format!("{:.2}% ({cached} tokens)", 100.0 * f("prefix_cache_hit_rate")));
    line(&mut t, "Request throughput (req/s):", format!("{:.2}", f("request_throughput")));
    line(&mut t, "Input token throughput (tok/s):", format!("{:.2}", f("input_throughput")));
    line(&mut t, "Output token throughput (tok/s):", format!("{:.2}", f("output_throughput")));
    line(&mut t, "Total token throughput (tok/s):", format!("{:.2}", f("total_throughput")));
    line(&mut t, "Concurrency:", format!("{:.2}", f("concurrency")));
    t.push_str(&format!("{:-^50}\n", "End-to-End Latency"));
    line(&mut t, "Mean E2E Latency (ms):", format!("{:.2}", f("mean_e2e_latency_ms")));
    line(&mut t, "Median E2E Latency (ms):", format!("{:.2}", f("median_e2e_latency_ms")));
    t.push_str(&format!("{:-^50}\n", "Time to First Token"));
    line(&mut t, "Mean TTFT (ms):", format!("{:.2}", f("mean_ttft_ms")));
    line(&mut t, "Median TTFT (ms):", format!("{:.2}", f("median_ttft_ms")));
    line(&mut t, "P99 TTFT (ms):", format!("{:.2}", f("p99_ttft_ms")));
    t.push_str(&format!("{:-^50}\n", "Time per Output Token (excl. 1st token)"));
    line(&mut t, "Mean TPOT (ms):", format!("{:.2}", f("mean_tpot_ms")));
    line(&mut t, "Median TPOT (ms):", format!("{:.2}", f("median_tpot_ms")));
    line(&mut t, "P99 TPOT (ms):", format!("{:.2}", f("p99_tpot_ms")));
    t.push_str(&format!("{:-^50}\n", "Inter-token Latency"));
    line(&mut t, "Mean ITL (ms):", format!("{:.2}", f("mean_itl_ms")));
    line(&mut t, "Median ITL (ms):", format!("{:.2}", f("median_itl_ms")));
    line(&mut t, "P99 ITL (ms):", format!("{:.2}", f("p99_itl_ms")));
    t.push_str(&format!("{}\n", "=".repeat(50)));
    Report { json, text: t }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_interpolate_like_numpy() {
        let v = [1.0, 2.0, 3.0, 4.0];
        assert_eq!(percentile(&v, 50.0), 2.5);
        assert!((percentile(&v, 99.0) - 3.97).abs() < 1e-12);
        assert_eq!(percentile(&[5.0], 99.0), 5.0);
    }

    #[test]
    fn throughput_and_latencies() {
        let r = RequestResult { ok: true, input_tokens: 10, output_tokens: 5, cached_tokens: 4, ttft_s: 0.1, itl_s: vec![0.05; 4], e2e_s: 0.3, ..Default::default() };
        let rep = build(&[r.clone(), r, RequestResult::default()], 2.0, 4);
        assert_eq!(rep.json["completed"], 2);
        assert_eq!(rep.json["failed"], 1);
        assert_eq!(rep.json["output_throughput"], 5.0);
        assert!((rep.json["mean_tpot_ms"].as_f64().unwrap() - 50.0).abs() < 1e-9);
        assert!(rep.text.contains("Successful requests:"));
        assert_eq!(rep.json["prefix_cache_hit_rate"], 0.4, "8 of 20 prompt tokens cached");
        assert!(rep.text.contains("Prefix cache hit rate:                   40.00% (8 tokens)"), "{}", rep.text);
    }
}
