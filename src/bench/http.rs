//! The benchmark's HTTP side on hyper-util's pooled client: a POST with a JSON body, the response
//! body read frame by frame so each server-sent event is timed when it arrives. Only the SSE
//! framing (events end at a blank line) is kiln's.

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::client::legacy::{connect::HttpConnector, Client as Pool};
use hyper_util::rt::TokioExecutor;

/// One client for the whole run: connections are kept alive and reused across requests.
#[derive(Clone)]
pub struct Client {
    pool: Pool<HttpConnector, Full<Bytes>>,
    base: String,
    api_key: Option<String>,
}

pub struct Response {
    pub status: u16,
    body: Incoming,
    pending: Vec<u8>,
}

fn io_error(e: impl std::error::Error + Send + Sync + 'static) -> std::io::Error {
    std::io::Error::other(e)
}

impl Client {
    pub fn new(host: &str, port: u16, api_key: Option<&str>) -> Client {
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        let pool = Pool::builder(TokioExecutor::new()).build(connector);
        let host = if host.contains(':') { format!("[{host}]") } else { host.to_string() }; // IPv6 literal
        Client { pool, base: format!("http://{host}:{port}"), api_key: api_key.map(str::to_string) }
    }

    /// Sends `POST path` with a JSON body; returns once the response head has arrived.
    pub async fn post_json(&self, path: &str, body: String) -> std::io::Result<Response> {
        let mut request = hyper::Request::post(format!("{}{path}", self.base))
            .header("content-type", "application/json")
            .header("accept", "text/event-stream");
        if let Some(key) = &self.api_key {
            request = request.header("authorization", format!("Bearer {key}"));
        }
        let request = request.body(Full::new(Bytes::from(body))).map_err(io_error)?;
        let response = self.pool.request(request).await.map_err(io_error)?;
        Ok(Response { status: response.status().as_u16(), body: response.into_body(), pending: Vec::new() })
    }
}

impl Response {
    /// The next body bytes as they arrive; None at the end.
    async fn read_some(&mut self) -> std::io::Result<Option<Bytes>> {
        while let Some(frame) = self.body.frame().await {
            if let Ok(data) = frame.map_err(io_error)?.into_data() {
                return Ok(Some(data));
            }
            // Trailers carry no body bytes.
        }
        Ok(None)
    }

    /// The whole body.
    pub async fn text(mut self) -> std::io::Result<String> {
        let mut all = std::mem::take(&mut self.pending);
        while let Some(b) = self.read_some().await? {
            all.extend_from_slice(&b);
        }
        Ok(String::from_utf8_lossy(&all).into_owned())
    }

    /// The next `data:` payload of a server-sent event stream; None at the end.
    pub async fn next_event(&mut self) -> std::io::Result<Option<String>> {
        loop {
            if let Some(end) = self.pending.windows(2).position(|w| w == b"\n\n") {
                let event: Vec<u8> = self.pending.drain(..end + 2).collect();
                let text = String::from_utf8_lossy(&event);
                let data: Vec<&str> = text.lines().filter_map(|l| l.strip_prefix("data:")).map(|d| d.strip_prefix(' ').unwrap_or(d)).collect();
                if data.is_empty() {
                    continue; // keep-alive comment
                }
                return Ok(Some(data.join("\n")));
            }
            match self.read_some().await? {
                Some(b) => self.pending.extend_from_slice(&b),
                None => return Ok(None),
            }
        }
    }
}
