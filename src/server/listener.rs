//! The HTTP edge: kiln's own accept loop over hyper, because `axum::serve` sets no timer (so no
//! header-read or idle timeout) and no connection cap. A request head must arrive within
//! `timeout`, which also bounds how long an idle keep-alive connection is kept; past
//! `max_connections` a new connection gets an OpenAI-shaped 503 and is closed.

use hyper::server::conn::http1;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::io::AsyncWriteExt;
use tokio::net::TcpListener;

#[derive(Debug, Clone, Copy)]
pub struct EdgeLimits {
    /// For a request head to arrive (a slow or idle client is disconnected after it).
    pub timeout: Duration,
    pub max_connections: usize,
}

/// Frees a connection slot when the connection ends, however it ends.
struct Slot(Arc<AtomicUsize>);

impl Drop for Slot {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

pub async fn serve(listener: TcpListener, app: axum::Router, limits: EdgeLimits) -> std::io::Result<()> {
    let open = Arc::new(AtomicUsize::new(0));
    loop {
        let (mut stream, _) = match listener.accept().await {
            Ok(c) => c,
            // Out of file descriptors and the like: back off instead of spinning.
            Err(_) => {
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        if open.fetch_add(1, Ordering::SeqCst) >= limits.max_connections {
            open.fetch_sub(1, Ordering::SeqCst);
            tokio::spawn(async move {
                let body = format!(
                    "{{\"error\": {{\"message\": \"too many open connections (at most {}); retry later\", \"type\": \"service_unavailable\", \"param\": null, \"code\": 503}}}}",
                    limits.max_connections
                );
                let head = format!(
                    "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nretry-after: 1\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
                    body.len()
                );
                let _ = tokio::time::timeout(Duration::from_secs(2), stream.write_all((head + &body).as_bytes())).await;
            });
            continue;
        }
        let slot = Slot(open.clone());
        let service = TowerToHyperService::new(app.clone());
        tokio::spawn(async move {
            let _slot = slot;
            let _ = stream.set_nodelay(true);
            let conn = http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(limits.timeout)
                .keep_alive(true)
                .serve_connection(TokioIo::new(stream), service);
            let _ = conn.await;
        });
    }
}
