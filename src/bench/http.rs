//! A minimal HTTP/1.1 client for the benchmark: one POST per connection, reading a streamed
//! (chunked) response incrementally so each server-sent event is timed when it arrives.

use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;

pub struct Response {
    pub status: u16,
    reader: BufReader<TcpStream>,
    chunked: bool,
    remaining_in_chunk: usize,
    done: bool,
    pending: Vec<u8>,
}

/// Sends `POST path` with a JSON body to `host:port`.
pub async fn post_json(host: &str, port: u16, path: &str, body: &str, api_key: Option<&str>) -> std::io::Result<Response> {
    let mut stream = TcpStream::connect((host, port)).await?;
    stream.set_nodelay(true)?;
    let auth = api_key.map(|k| format!("Authorization: Bearer {k}\r\n")).unwrap_or_default();
    let head = format!(
        "POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\nAccept: text/event-stream\r\n{auth}Content-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    stream.write_all(head.as_bytes()).await?;
    stream.write_all(body.as_bytes()).await?;
    let mut reader = BufReader::new(stream);
    let mut line = String::new();
    reader.read_line(&mut line).await?;
    let status = line.split_whitespace().nth(1).and_then(|s| s.parse().ok()).ok_or_else(|| bad(format!("bad status line {line:?}")))?;
    let mut chunked = false;
    loop {
        line.clear();
        reader.read_line(&mut line).await?;
        if line == "\r\n" || line.is_empty() {
            break;
        }
        let lower = line.to_ascii_lowercase();
        if lower.starts_with("transfer-encoding:") && lower.contains("chunked") {
            chunked = true;
        }
    }
    Ok(Response { status, reader, chunked, remaining_in_chunk: 0, done: false, pending: Vec::new() })
}

fn bad(message: String) -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::InvalidData, message)
}

impl Response {
    /// The next body bytes as they arrive; None at the end.
    async fn read_some(&mut self) -> std::io::Result<Option<Vec<u8>>> {
        if self.done {
            return Ok(None);
        }
        if !self.chunked {
            let mut buf = vec![0u8; 8192];
            let n = self.reader.read(&mut buf).await?;
            if n == 0 {
                self.done = true;
                return Ok(None);
            }
            buf.truncate(n);
            return Ok(Some(buf));
        }
        if self.remaining_in_chunk == 0 {
            let mut size = String::new();
            self.reader.read_line(&mut size).await?;
            if size.trim().is_empty() {
                size.clear();
                self.reader.read_line(&mut size).await?;
            }
            let n = usize::from_str_radix(size.trim().split(';').next().unwrap_or(""), 16).map_err(|_| bad(format!("bad chunk size {size:?}")))?;
            if n == 0 {
                self.done = true;
                return Ok(None);
            }
            self.remaining_in_chunk = n;
        }
        let mut buf = vec![0u8; self.remaining_in_chunk.min(8192)];
        let n = self.reader.read(&mut buf).await?;
        if n == 0 {
            self.done = true;
            return Ok(None);
        }
        buf.truncate(n);
        self.remaining_in_chunk -= n;
        Ok(Some(buf))
    }

    /// The whole body.
    pub async fn text(mut self) -> std::io::Result<String> {
        let mut all = std::mem::take(&mut self.pending);
        while let Some(b) = self.read_some().await? {
            all.extend(b);
        }
        Ok(String::from_utf8_lossy(&all).into_owned())
    }

    /// The next `data:` payload of a server-sent event stream; None at the end.
    pub async fn next_event(&mut self) -> std::io::Result<Option<String>> {
        loop {
            if let Some(end) = find(&self.pending, b"\n\n") {
                let event: Vec<u8> = self.pending.drain(..end + 2).collect();
                let text = String::from_utf8_lossy(&event);
                let data: Vec<&str> = text.lines().filter_map(|l| l.strip_prefix("data:")).map(|d| d.strip_prefix(' ').unwrap_or(d)).collect();
                if data.is_empty() {
                    continue; // keep-alive comment
                }
                return Ok(Some(data.join("\n")));
            }
            match self.read_some().await? {
                Some(b) => self.pending.extend(b),
                None => return Ok(None),
            }
        }
    }
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}
