//! Prometheus metrics on the `prometheus-client` crate (OpenMetrics text): token counters, latency
//! histograms, queue and KV gauges.

use kiln_engine::scheduler::EngineStats;
use prometheus_client::encoding::text::{encode, encode_registry};
use prometheus_client::metrics::counter::{ConstCounter, Counter};
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;
use std::sync::atomic::Ordering;

/// What `/metrics` answers with: the OpenMetrics text format the encoder writes.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

const LATENCY: &[f64] = &[0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0];

/// The server's own metrics; the engine's counters are read at each scrape.
pub struct Metrics {
    registry: Registry,
    pub ttft: Histogram,
    pub itl: Histogram,
    pub e2e: Histogram,
    pub requests_ok: Counter,
    pub requests_failed: Counter,
}

impl Default for Metrics {
    fn default() -> Self {
        let latency = || Histogram::new(LATENCY.iter().copied());
        let (ttft, itl, e2e) = (latency(), latency(), latency());
        let (requests_ok, requests_failed) = (Counter::default(), Counter::default());
        let mut registry = Registry::default();
        // Counters are registered without `_total`: the encoder appends it to the sample name.
        registry.register("kiln_requests_succeeded", "Requests that finished.", requests_ok.clone());
        registry.register("kiln_requests_failed", "Requests answered with an error.", requests_failed.clone());
        registry.register("kiln_time_to_first_token_seconds", "Time from request to first generated token.", ttft.clone());
        registry.register("kiln_inter_token_latency_seconds", "Time between consecutive generated tokens.", itl.clone());
        registry.register("kiln_e2e_request_latency_seconds", "Time from request to last token.", e2e.clone());
        Metrics { registry, ttft, itl, e2e, requests_ok, requests_failed }
    }
}

impl Metrics {
    /// The whole exposition: the engine's counters and gauges (once it is loaded), then the
    /// server's own, then the OpenMetrics `# EOF`.
    pub fn render(&self, engine: Option<&EngineStats>) -> String {
        let mut out = String::new();
        if let Some(e) = engine {
            // A snapshot registry per scrape: the engine owns these atomics, not the registry.
            let _ = encode_registry(&mut out, &engine_snapshot(e));
        }
        let _ = encode(&mut out, &self.registry);
        out
    }
}

fn engine_snapshot(e: &EngineStats) -> Registry {
    let mut r = Registry::default();
    let count = |a: &std::sync::atomic::AtomicU64| ConstCounter::new(a.load(Ordering::Relaxed));
    let level = |a: &std::sync::atomic::AtomicUsize| ConstGauge::new(a.load(Ordering::SeqCst) as i64);
    let used = e.kv_pages_used.load(Ordering::SeqCst) as f64;
    let total = e.kv_pages_total.load(Ordering::SeqCst).max(1) as f64;
    r.register("kiln_prompt_tokens", "Prompt tokens processed.", count(&e.prompt_tokens));
    r.register("kiln_generation_tokens", "Tokens generated.", count(&e.generation_tokens));
    r.register("kiln_requests_running", "Sequences being generated.", level(&e.running));
    r.register("kiln_requests_waiting", "Requests waiting for admission.", level(&e.waiting));
    r.register("kiln_kv_cache_pages_used", "KV cache pages in use.", level(&e.kv_pages_used));
    r.register("kiln_kv_cache_usage_ratio", "Fraction of KV cache pages in use.", ConstGauge::new(used / total));
    r.register("kiln_kv_cache_pages_cached", "Cached KV pages no request holds (reusable, evicted when needed).", level(&e.kv_pages_cached));
    r.register("kiln_prefix_cache_hit_tokens", "Prompt tokens served from the prefix cache.", count(&e.prompt_tokens_cached));
    r.register("kiln_prefix_cache_evictions", "Cached KV pages evicted to make room.", count(&e.prefix_cache_evictions));
    r.register("kiln_non_finite_logits", "Requests failed because the model produced NaN or Inf logits.", count(&e.non_finite));
    r.register("kiln_preemptions", "Running requests preempted to free KV pages (recomputed on resume).", count(&e.preemptions));
    r.register("kiln_spec_draft_tokens", "Speculative draft tokens the model checked.", count(&e.draft_tokens));
    r.register("kiln_spec_accepted_tokens", "Speculative draft tokens the model would have chosen (extra tokens its steps yielded).", count(&e.accepted_draft_tokens));
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The sample value of `name` (a whole line `name value`).
    fn sample(text: &str, name: &str) -> Option<f64> {
        text.lines().find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
    }

    #[test]
    fn exposition_keeps_kiln_metric_names_and_counts() {
        let m = Metrics::default();
        m.requests_ok.inc_by(3);
        for v in [0.002, 0.2, 7.0] {
            m.ttft.observe(v);
        }
        let e = EngineStats::default();
        e.generation_tokens.store(42, Ordering::Relaxed);
        e.draft_tokens.store(9, Ordering::Relaxed);
        e.accepted_draft_tokens.store(5, Ordering::Relaxed);
        e.kv_pages_used.store(3, Ordering::SeqCst);
        e.kv_pages_total.store(12, Ordering::SeqCst);
        let text = m.render(Some(&e));
        assert_eq!(sample(&text, "kiln_requests_succeeded_total"), Some(3.0), "{text}");
        assert_eq!(sample(&text, "kiln_requests_failed_total"), Some(0.0));
        assert_eq!(sample(&text, "kiln_generation_tokens_total"), Some(42.0));
        assert_eq!(sample(&text, "kiln_kv_cache_pages_used"), Some(3.0));
        assert_eq!(sample(&text, "kiln_spec_draft_tokens_total"), Some(9.0));
        assert_eq!(sample(&text, "kiln_spec_accepted_tokens_total"), Some(5.0));
        assert_eq!(sample(&text, "kiln_kv_cache_usage_ratio"), Some(0.25));
        // Cumulative buckets as Prometheus defines them: le=0.005 holds 1, le=0.25 holds 2.
        assert_eq!(sample(&text, "kiln_time_to_first_token_seconds_bucket{le=\"0.005\"}"), Some(1.0), "{text}");
        assert_eq!(sample(&text, "kiln_time_to_first_token_seconds_bucket{le=\"0.25\"}"), Some(2.0));
        assert_eq!(sample(&text, "kiln_time_to_first_token_seconds_bucket{le=\"+Inf\"}"), Some(3.0));
        assert_eq!(sample(&text, "kiln_time_to_first_token_seconds_count"), Some(3.0));
        assert!((sample(&text, "kiln_time_to_first_token_seconds_sum").unwrap() - 7.202).abs() < 1e-9);
        assert!(text.contains("# TYPE kiln_generation_tokens counter"), "{text}");
        assert!(text.ends_with("# EOF\n"), "one OpenMetrics message");
        // Before the engine is loaded only the server's own metrics are there.
        let early = m.render(None);
        assert!(sample(&early, "kiln_generation_tokens_total").is_none() && sample(&early, "kiln_requests_succeeded_total").is_some());
    }
}
