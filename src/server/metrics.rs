//! Prometheus metrics: token counters, latency histograms, queue and KV gauges.

use kiln_engine::scheduler::EngineStats;
use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

pub struct Histogram {
    name: &'static str,
    help: &'static str,
    bounds: &'static [f64],
    state: Mutex<(Vec<u64>, f64, u64)>, // bucket counts, sum, count
}

impl Histogram {
    const fn new(name: &'static str, help: &'static str, bounds: &'static [f64]) -> Histogram {
        Histogram { name, help, bounds, state: Mutex::new((Vec::new(), 0.0, 0)) }
    }

    pub fn observe(&self, v: f64) {
        let mut s = self.state.lock().expect("metrics lock");
        if s.0.is_empty() {
            s.0 = vec![0; self.bounds.len()];
        }
        for (i, b) in self.bounds.iter().enumerate() {
            if v <= *b {
                s.0[i] += 1;
            }
        }
        s.1 += v;
        s.2 += 1;
    }

    fn render(&self, out: &mut String) {
        let s = self.state.lock().expect("metrics lock");
        let _ = writeln!(out, "# HELP {} {}\n# TYPE {} histogram", self.name, self.help, self.name);
        for (i, b) in self.bounds.iter().enumerate() {
            let _ = writeln!(out, "{}_bucket{{le=\"{b}\"}} {}", self.name, s.0.get(i).copied().unwrap_or(0));
        }
        let _ = writeln!(out, "{}_bucket{{le=\"+Inf\"}} {}\n{}_sum {}\n{}_count {}", self.name, s.2, self.name, s.1, self.name, s.2);
    }
}

const LATENCY: &[f64] = &[0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0];

pub struct Metrics {
    pub ttft: Histogram,
    pub itl: Histogram,
    pub e2e: Histogram,
    pub requests_ok: AtomicU64,
    pub requests_failed: AtomicU64,
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics {
            ttft: Histogram::new("kiln_time_to_first_token_seconds", "Time from request to first generated token.", LATENCY),
            itl: Histogram::new("kiln_inter_token_latency_seconds", "Time between consecutive generated tokens.", LATENCY),
            e2e: Histogram::new("kiln_e2e_request_latency_seconds", "Time from request to last token.", LATENCY),
            requests_ok: AtomicU64::new(0),
            requests_failed: AtomicU64::new(0),
        }
    }
}

impl Metrics {
    pub fn render(&self, engine: Option<&EngineStats>) -> String {
        let mut out = String::new();
        let mut metric = |name: &str, kind: &str, help: &str, value: f64| {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {value}");
        };
        if let Some(e) = engine {
            let used = e.kv_pages_used.load(Ordering::SeqCst) as f64;
            let total = e.kv_pages_total.load(Ordering::SeqCst).max(1) as f64;
            metric("kiln_prompt_tokens_total", "counter", "Prompt tokens processed.", e.prompt_tokens.load(Ordering::Relaxed) as f64);
            metric("kiln_generation_tokens_total", "counter", "Tokens generated.", e.generation_tokens.load(Ordering::Relaxed) as f64);
            metric("kiln_requests_running", "gauge", "Sequences being generated.", e.running.load(Ordering::SeqCst) as f64);
            metric("kiln_requests_waiting", "gauge", "Requests waiting for admission.", e.waiting.load(Ordering::SeqCst) as f64);
            metric("kiln_kv_cache_pages_used", "gauge", "KV cache pages in use.", used);
            metric("kiln_kv_cache_usage_ratio", "gauge", "Fraction of KV cache pages in use.", used / total);
            metric("kiln_kv_cache_pages_cached", "gauge", "Cached KV pages no request holds (reusable, evicted when needed).", e.kv_pages_cached.load(Ordering::SeqCst) as f64);
            metric("kiln_prefix_cache_hit_tokens_total", "counter", "Prompt tokens served from the prefix cache.", e.prompt_tokens_cached.load(Ordering::Relaxed) as f64);
            metric("kiln_prefix_cache_evictions_total", "counter", "Cached KV pages evicted to make room.", e.prefix_cache_evictions.load(Ordering::Relaxed) as f64);
            metric("kiln_non_finite_logits_total", "counter", "Requests failed because the model produced NaN or Inf logits.", e.non_finite.load(Ordering::Relaxed) as f64);
            metric("kiln_preemptions_total", "counter", "Running requests preempted to free KV pages (recomputed on resume).", e.preemptions.load(Ordering::Relaxed) as f64);
        }
        metric("kiln_requests_succeeded_total", "counter", "Requests that finished.", self.requests_ok.load(Ordering::Relaxed) as f64);
        metric("kiln_requests_failed_total", "counter", "Requests answered with an error.", self.requests_failed.load(Ordering::Relaxed) as f64);
        self.ttft.render(&mut out);
        self.itl.render(&mut out);
        self.e2e.render(&mut out);
        out
    }
}
