//! `kiln serve` on the tiny demo model (CPU backend): raw HTTP checks here, and the official
//! `openai` Python client driven by tests/server/test_openai_client.py.

mod common;

use common::serve::{self, http, openai_client_suite, Server};
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
    let (status, body) = http(port, "POST", "/v1/completions", "{\"prompt\": \"Hi\", \"max_tokens\": 4, \"temperature\": 0}");
    assert_eq!(status, 200, "{body}");
    assert!(body.contains("\"text_completion\""), "{body}");

    // The official client (CI installs it; see .ci/run).
    openai_client_suite(port, "CPU backend");
}

#[test]
fn api_key_is_required_on_v1_only() {
    let art = demo_artifact("apikey");
    let server = start(&art, &["--api-key", "s3cret"]);
    let (status, body) = http(server.port, "GET", "/v1/models", "");
    assert_eq!(status, 401, "{body}");
    assert!(body.contains("invalid_api_key"));
    // Health and metrics stay open.
    assert_eq!(http(server.port, "GET", "/metrics", "").0, 200);
}
