//! `kiln serve` on the tiny demo model (CPU backend): raw HTTP checks here, and the official
//! `openai` Python client driven by tests/server/test_openai_client.py.

mod common;

use common::serve::{self, http, openai_client_script, openai_client_suite, Server};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

fn kiln() -> Command {
    Command::new(env!("CARGO_BIN_EXE_kiln"))
}

/// Each test gets its own directory: tests run in parallel.
fn demo_artifact(name: &str) -> PathBuf {
    let root = std::env::temp_dir().join(format!("kiln-test-{}-server-{name}", std::process::id()));
    let ckpt = root.join("ckpt");
    let art = root.join("plan");
    assert!(kiln().args(["synth", "tiny", "-o"]).arg(&ckpt).status().unwrap().success());
    assert!(kiln()
        .args(["compile"])
        .arg(&ckpt)
        .args(["--target", "cpu", "--tp", "2", "--decode-batches", "1,2,4,8,16,32", "--prefill-chunk", "256", "-o"])
        .arg(&art)
        .status()
        .unwrap()
        .success());
    art
}

fn start(art: &Path, extra: &[&str]) -> Server {
    let mut serve = kiln();
    serve.arg("serve").arg(art).args(["--served-model-name", "kiln-tiny"]).args(extra);
    serve::start(serve, Duration::from_secs(60))
}

#[test]
fn http_basics_and_the_openai_client() {
    let art = demo_artifact("client");
    let server = start(&art, &["--enable-test-hooks"]);
    let port = server.port;

    let (status, body) = http(port, "GET", "/v1/models", "");
    assert_eq!(status, 200);
    assert!(body.contains("\"kiln-tiny\""), "{body}");
    let (status, body) = http(port, "GET", "/nope", "");
    assert_eq!(status, 404);
    assert!(body.contains("\"error\""), "{body}");
    // Errors axum raises itself are OpenAI-shaped too.
    let (status, body) = http(port, "GET", "/v1/completions", "");
    assert_eq!(status, 405, "{body}");
    let v: serde_json::Value = serde_json::from_str(&body).unwrap_or_else(|e| panic!("{e}: {body}"));
    assert_eq!(v["error"]["type"], "invalid_request_error");
    let huge = format!("{{\"prompt\": \"{}\"}}", "x".repeat(3 << 20));
    let (status, body) = http(port, "POST", "/v1/completions", &huge);
    assert_eq!(status, 413, "{}", &body[..body.len().min(200)]);
    let v: serde_json::Value = serde_json::from_str(&body).unwrap_or_else(|e| panic!("{e}: {body}"));
    assert!(v["error"]["message"].as_str().is_some(), "{body}");
    let (status, body) = http(port, "POST", "/v1/completions", "{\"prompt\": \"Hi\", \"max_tokens\": 4, \"temperature\": 0}");
    assert_eq!(status, 200, "{body}");
    assert!(body.contains("\"text_completion\""), "{body}");

    // Huge prompts are refused by their byte length, before tokenising, and never stall /health.
    let huge = format!("{{\"prompt\": \"{}\", \"max_tokens\": 4}}", "word ".repeat(380_000));
    let t = std::time::Instant::now();
    let senders: Vec<_> = (0..4).map(|_| { let h = huge.clone(); std::thread::spawn(move || http(port, "POST", "/v1/completions", &h)) }).collect();
    let health = http(port, "GET", "/health", "");
    for s in senders {
        let (status, body) = s.join().unwrap();
        assert_eq!(status, 400, "{}", &body[..body.len().min(300)]);
        assert!(body.contains("context_length_exceeded"), "{body}");
    }
    assert_eq!(health.0, 200);
    assert!(t.elapsed() < Duration::from_secs(4), "4 huge prompts took {:?}", t.elapsed());

    // The official client (CI installs it; see .ci/run).
    openai_client_suite(port, "CPU backend", &[]);
}

/// logprobs, `n`, penalties, min_tokens/stop_token_ids, json_object/json_schema, forced
/// tool_choice and the prefix cache, through the official client (tests/server/
/// test_serving_features.py): on random weights, checked against formulas and schemas.
#[test]
fn the_fields_real_clients_send() {
    let art = demo_artifact("fields");
    let server = start(&art, &[]);
    openai_client_script(server.port, "test_serving_features.py", "serving features");
}

/// A pool smaller than the demand: the server preempts and still answers every request in full.
#[test]
fn a_small_kv_pool_preempts_instead_of_refusing() {
    let art = demo_artifact("pool");
    let server = start(&art, &["--max-total-tokens", "1024", "--disable-prefix-cache"]);
    let port = server.port;
    let bodies: Vec<_> = (0..6)
        .map(|i| {
            std::thread::spawn(move || {
                let body = format!("{{\"prompt\": \"request {i}\", \"max_tokens\": 300, \"temperature\": 0, \"ignore_eos\": true}}");
                http(port, "POST", "/v1/completions", &body)
            })
        })
        .collect();
    for b in bodies {
        let (status, body) = b.join().unwrap();
        assert_eq!(status, 200, "{body}");
        let v: serde_json::Value = serde_json::from_str(&body).unwrap();
        assert_eq!(v["usage"]["completion_tokens"], 300, "{body}");
        assert_eq!(v["choices"][0]["finish_reason"], "length");
    }
    let value = |name: &str| -> f64 {
        let (_, metrics) = http(port, "GET", "/metrics", "");
        metrics.lines().find_map(|l| l.strip_prefix(name).and_then(|r| r.trim().parse().ok())).unwrap_or_else(|| panic!("{name} in {metrics}"))
    };
    assert!(value("kiln_preemptions_total ") > 0.0, "6 x ~310 tokens on a 1,024-token pool must preempt");
    assert_eq!(value("kiln_prefix_cache_hit_tokens_total "), 0.0, "the cache is off");
    // The last response can reach the client just before the engine releases its pages.
    let t = std::time::Instant::now();
    while value("kiln_kv_cache_pages_used ") != 0.0 {
        assert!(t.elapsed() < Duration::from_secs(10), "KV pages leaked");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Sends `request` as is; returns the status and the whole response, headers included.
fn raw_http(port: u16, request: &str) -> (u16, String) {
    use std::io::{Read, Write};
    let mut c = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    c.write_all(request.as_bytes()).unwrap();
    let mut out = String::new();
    c.read_to_string(&mut out).unwrap();
    let status = out.split(' ').nth(1).and_then(|s| s.parse().ok()).unwrap_or(0);
    (status, out)
}

/// GET with `Authorization: Bearer KEY`.
fn http_auth(port: u16, path: &str, key: &str) -> (u16, String) {
    raw_http(port, &format!("GET {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\nConnection: close\r\n\r\n"))
}

#[test]
fn busy_answers_say_when_to_retry() {
    // One decode slot and no queue: a second request while the first runs is a 429.
    let root = std::env::temp_dir().join(format!("kiln-test-{}-server-busy", std::process::id()));
    let (ckpt, art) = (root.join("ckpt"), root.join("plan"));
    assert!(kiln().args(["synth", "tiny", "-o"]).arg(&ckpt).status().unwrap().success());
    assert!(kiln().arg("compile").arg(&ckpt).args(["--target", "cpu", "--decode-batches", "1", "-o"]).arg(&art).status().unwrap().success());
    let server = start(&art, &["--max-waiting", "0"]);
    let port = server.port;
    let long = std::thread::spawn(move || http(port, "POST", "/v1/completions", "{\"prompt\": \"Hi\", \"max_tokens\": 900, \"ignore_eos\": true}"));
    let t = std::time::Instant::now();
    while !http(port, "GET", "/metrics", "").1.contains("kiln_requests_running 1") {
        assert!(t.elapsed() < Duration::from_secs(30), "the first request never started");
        std::thread::sleep(Duration::from_millis(10));
    }
    let body = "{\"prompt\": \"Hi\", \"max_tokens\": 2}";
    let (status, response) = raw_http(
        port,
        &format!("POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}", body.len()),
    );
    assert_eq!(status, 429, "{response}");
    assert!(response.to_ascii_lowercase().contains("\r\nretry-after: 1\r\n"), "{response}");
    assert!(response.contains("rate_limit_error"), "{response}");
    assert_eq!(long.join().unwrap().0, 200);
}

/// Overwrites `tensor`'s data in whichever shard of `ckpt` holds it with NaN (BF16 0x7fc0).
fn poison(ckpt: &Path, tensor: &str) {
    for entry in std::fs::read_dir(ckpt).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().and_then(|e| e.to_str()) != Some("safetensors") {
            continue;
        }
        let mut bytes = std::fs::read(&path).unwrap();
        let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
        let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
        if let Some(t) = header.get(tensor) {
            assert_eq!(t["dtype"], "BF16");
            let (a, b) = (t["data_offsets"][0].as_u64().unwrap() as usize, t["data_offsets"][1].as_u64().unwrap() as usize);
            for v in bytes[8 + n + a..8 + n + b].chunks_exact_mut(2) {
                v.copy_from_slice(&0x7fc0u16.to_le_bytes());
            }
            std::fs::write(&path, bytes).unwrap();
            return;
        }
    }
    panic!("{tensor} not found in {}", ckpt.display());
}

/// NaN weights: `kiln run` fails naming NaN and the program; the server answers 500 for the
/// request and stays healthy.
#[test]
fn nan_logits_fail_the_request_not_the_server() {
    let root = std::env::temp_dir().join(format!("kiln-test-{}-server-nan", std::process::id()));
    let (ckpt, art) = (root.join("ckpt"), root.join("plan"));
    assert!(kiln().args(["synth", "tiny", "-o"]).arg(&ckpt).status().unwrap().success());
    poison(&ckpt, "model.norm.weight");
    assert!(kiln().arg("compile").arg(&ckpt).args(["--target", "cpu", "-o"]).arg(&art).status().unwrap().success());
    let out = kiln().arg("run").arg(&art).args(["--prompt", "Hello", "--max-tokens", "4"]).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(err.contains("NaN") && err.contains("prefill_") && err.contains("kiln verify"), "{err}");
    let server = start(&art, &[]);
    for _ in 0..2 {
        let (status, body) = http(server.port, "POST", "/v1/completions", "{\"prompt\": \"Hi\", \"max_tokens\": 4}");
        assert_eq!(status, 500, "{body}");
        assert!(body.contains("internal_error"), "{body}");
    }
    assert_eq!(http(server.port, "GET", "/health", "").0, 200, "one broken request does not take the server down");
    let (_, metrics) = http(server.port, "GET", "/metrics", "");
    assert!(metrics.contains("kiln_non_finite_logits_total 2"), "{metrics}");
}

/// Slow and idle clients are cut after --http-timeout; past --max-connections a new connection
/// gets a 503 at once; neither slows /health.
#[test]
fn slow_idle_and_excess_connections_are_bounded() {
    use std::io::{Read, Write};
    let art = demo_artifact("edge");
    let server = start(&art, &["--http-timeout", "2", "--max-connections", "300"]);
    let port = server.port;
    // A request head trickled one byte every 300 ms: cut after ~2 s, not kept forever.
    let mut slow = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    slow.set_read_timeout(Some(Duration::from_millis(300))).unwrap();
    let t = std::time::Instant::now();
    let head = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa";
    let mut closed = false;
    for b in head.iter() {
        if slow.write_all(&[*b]).is_err() {
            closed = true;
            break;
        }
        let mut buf = [0u8; 256];
        match slow.read(&mut buf) {
            Ok(0) => {
                closed = true;
                break;
            }
            Ok(_) => {
                closed = true; // an error response, then the close
                break;
            }
            Err(_) => {} // nothing yet: keep trickling
        }
    }
    assert!(closed && t.elapsed() < Duration::from_secs(10), "the trickling client was kept {:?}", t.elapsed());
    // 280 idle connections: /health still answers at once.
    let idle: Vec<_> = (0..280).map(|_| std::net::TcpStream::connect(("127.0.0.1", port)).unwrap()).collect();
    std::thread::sleep(Duration::from_millis(200));
    let t = std::time::Instant::now();
    assert_eq!(http(port, "GET", "/health", "").0, 200);
    assert!(t.elapsed() < Duration::from_secs(1), "/health took {:?}", t.elapsed());
    // Past the cap: an OpenAI-shaped 503 with Retry-After.
    let more: Vec<_> = (0..30).map(|_| std::net::TcpStream::connect(("127.0.0.1", port)).unwrap()).collect();
    std::thread::sleep(Duration::from_millis(200));
    let (status, body) = http(port, "GET", "/health", "");
    assert_eq!(status, 503, "{body}");
    assert!(body.contains("too many open connections"), "{body}");
    // Idle connections are closed by the server after the timeout, and the slots come back.
    std::thread::sleep(Duration::from_secs(3));
    let mut first = &idle[0];
    first.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
    assert!(matches!(first.read(&mut [0u8; 64]), Ok(0)), "an idle connection was kept open past --http-timeout");
    drop((idle, more));
    let t = std::time::Instant::now();
    while http(port, "GET", "/health", "").0 != 200 {
        assert!(t.elapsed() < Duration::from_secs(10), "connection slots never came back");
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn api_key_is_required_on_v1_only() {
    let art = demo_artifact("apikey");
    let server = start(&art, &["--api-key", "s3cret"]);
    let (status, body) = http(server.port, "GET", "/v1/models", "");
    assert_eq!(status, 401, "{body}");
    assert!(body.contains("invalid_api_key"));
    assert_eq!(http_auth(server.port, "/v1/models", "s3cre").0, 401, "a prefix of the key is not the key");
    assert_eq!(http_auth(server.port, "/v1/models", "s3cret").0, 200);
    // Health and metrics stay open.
    assert_eq!(http(server.port, "GET", "/metrics", "").0, 200);
}

/// `kiln bench` (hyper-util's client) against a real server: every request streamed to the end,
/// the token counts the server's own `/metrics` saw, the prefix cache hit the shared prefix, and a
/// wrong API key fails the run with the server's answer, not a crash.
#[test]
fn bench_client_counts_what_the_server_served() {
    let art = demo_artifact("bench");
    let server = start(&art, &["--api-key", "k"]);
    let port = server.port.to_string();
    let bench = |key: &str| {
        kiln()
            .args(["bench", "--port", &port, "--api-key", key, "--num-prompts", "6", "--max-concurrency", "3"])
            .args(["--random-input-len", "80", "--random-output-len", "5", "--shared-prefix-len", "64", "--json"])
            .output()
            .unwrap()
    };
    let o = bench("k");
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let r: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&o.stdout)));
    assert_eq!((r["completed"].as_u64(), r["failed"].as_u64()), (Some(6), Some(0)), "{r}");
    assert_eq!(r["total_output_tokens"], 30, "{r}");
    assert_eq!(r["total_input_tokens"], 480, "{r}");
    // The 64 shared tokens fill one 64-token KV page, which every request after the first finds
    // cached (or waits for while the first prefills it): 5 hits, or fewer if the first ones raced.
    let cached = r["total_cached_tokens"].as_u64().unwrap();
    assert!(cached >= 3 * 64 && cached <= 5 * 64, "{r}");
    let (_, metrics) = http_auth(server.port, "/metrics", "k");
    let sample = |name: &str| metrics.lines().find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse::<f64>().ok());
    assert_eq!(sample("kiln_generation_tokens_total"), Some(30.0), "{metrics}");
    assert_eq!(sample("kiln_prefix_cache_hit_tokens_total"), Some(cached as f64), "{metrics}");
    // Every request refused: the bench fails, quoting the server's error.
    let denied = bench("wrong");
    let err = String::from_utf8_lossy(&denied.stderr);
    assert!(!denied.status.success() && err.contains("6 of 6 requests failed") && err.contains("HTTP 401"), "{err}");
}
