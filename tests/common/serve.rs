//! A `kiln serve` child process for the server tests (CPU and CUDA backends): start on a free
//! port, wait for `/health`, raw HTTP requests, and the official `openai` client suite.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub struct Server {
    pub child: Child,
    pub port: u16,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// Spawns `serve` (a `kiln serve ART ...` command without `--port`) on a free port and waits
/// until `/health` answers 200 (at most `timeout`).
pub fn start(mut serve: Command, timeout: Duration) -> Server {
    let port = free_port();
    let child = serve.args(["--port", &port.to_string()]).stdout(Stdio::null()).stderr(Stdio::inherit()).spawn().expect("start kiln serve");
    let mut server = Server { child, port };
    let t = Instant::now();
    while http(port, "GET", "/health", "").0 != 200 {
        if let Ok(Some(status)) = server.child.try_wait() {
            panic!("kiln serve exited with {status} before becoming healthy");
        }
        assert!(t.elapsed() < timeout, "server did not become healthy in {timeout:?}");
        std::thread::sleep(Duration::from_millis(100));
    }
    server
}

/// One HTTP/1.1 request; returns (status, body). Status 0 when the connection fails.
pub fn http(port: u16, method: &str, path: &str, body: &str) -> (u16, String) {
    let Ok(mut s) = TcpStream::connect(("127.0.0.1", port)) else { return (0, String::new()) };
    let _ = s.set_read_timeout(Some(Duration::from_secs(300)));
    let req = format!("{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}", body.len());
    s.write_all(req.as_bytes()).unwrap();
    let mut out = String::new();
    let _ = s.read_to_string(&mut out);
    let status = out.split_whitespace().nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
    let body = out.split_once("\r\n\r\n").map(|(_, b)| b.to_string()).unwrap_or_default();
    (status, body)
}

/// Runs tests/server/test_openai_client.py (the official client) against the server, which
/// serves model `kiln-tiny` with --enable-test-hooks, less the script's tests named in `skip`.
/// Skipped (with a note) only outside CI when the client is not installed.
pub fn openai_client_suite(port: u16, what: &str, skip: &[&str]) {
    openai_client_script_skipping(port, "test_openai_client.py", what, skip)
}

/// The python that has the official `openai` client (scripts/test.sh sets KILN_PYTHON); None,
/// with a note, only outside CI.
pub fn python_with_openai() -> Option<String> {
    let python = std::env::var("KILN_PYTHON").unwrap_or_else(|_| "python3".into());
    let has_openai = Command::new(&python).args(["-c", "import openai"]).status().map(|s| s.success()).unwrap_or(false);
    if !has_openai {
        assert!(std::env::var("CI").is_err(), "CI must provide the openai client ({python})");
        eprintln!("SKIPPED the openai client tests: `{python} -c 'import openai'` failed (set KILN_PYTHON)");
        return None;
    }
    Some(python)
}

/// Runs `tests/server/<script>` with the official client against the server on `port`.
pub fn openai_client_script(port: u16, script: &str, what: &str) {
    openai_client_script_skipping(port, script, what, &[])
}

fn openai_client_script_skipping(port: u16, script: &str, what: &str, skip: &[&str]) {
    let Some(python) = python_with_openai() else { return };
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/server").join(script);
    let out = Command::new(&python)
        .arg(&script)
        .env("KILN_BASE_URL", format!("http://127.0.0.1:{port}"))
        .env("KILN_MODEL", "kiln-tiny")
        .env("KILN_SKIP_TESTS", skip.join(","))
        .output()
        .unwrap();
    let report = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "openai client tests failed ({what}):\n{report}\n{}", String::from_utf8_lossy(&out.stderr));
}
