//! The OpenAI-compatible HTTP server (`kiln serve`): chat and text completions (streaming and
//! not), models, health, Prometheus metrics; request ids, optional API key, OpenAI error shapes.

mod chat;
mod completions;
mod errors;
mod generation;
mod listener;
mod logprobs;
mod metrics;
mod params;
#[cfg(test)]
mod request_fuzz;
mod sse;
mod state;
mod structured;
mod validate;

pub use errors::ApiError;
pub use listener::EdgeLimits;
pub use state::{AppState, Loaded};

use axum::extract::{Request, State};
use axum::http::{HeaderValue, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::json;
use std::sync::Arc;

/// The request id of the current request (client's `x-request-id` or a generated one).
#[derive(Clone)]
pub struct RequestId(pub String);

pub fn router(state: AppState) -> Router {
    let v1 = Router::new()
        .route("/v1/chat/completions", post(chat::chat_completions))
        .route("/v1/completions", post(completions::completions))
        .route("/v1/models", get(models))
        .route_layer(middleware::from_fn_with_state(state.clone(), require_api_key));
    Router::new()
        .merge(v1)
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .fallback(|req: Request| async move { ApiError::not_found(req.uri().path()) })
        .layer(middleware::from_fn(openai_error_shape))
        .layer(middleware::from_fn_with_state(state.clone(), request_id))
        .with_state(state)
}

async fn request_id(State(state): State<AppState>, mut req: Request, next: Next) -> Response {
    let id = req
        .headers()
        .get("x-request-id")
        .and_then(|v| v.to_str().ok())
        .filter(|s| !s.is_empty() && s.len() <= 128)
        .map(String::from)
        .unwrap_or_else(|| state.new_id("req"));
    req.extensions_mut().insert(RequestId(id.clone()));
    let mut resp = next.run(req).await;
    if let Ok(v) = HeaderValue::from_str(&id) {
        resp.headers_mut().insert("x-request-id", v);
    }
    resp
}

/// Errors axum produces itself (405 wrong method, 413 body too large, 415 no JSON content type,
/// ...) come as plain text: rewrap them in the OpenAI error shape clients parse.
async fn openai_error_shape(req: Request, next: Next) -> Response {
    let resp = next.run(req).await;
    let status = resp.status();
    let is_json = resp.headers().get("content-type").and_then(|v| v.to_str().ok()).is_some_and(|c| c.starts_with("application/json"));
    if !(status.is_client_error() || status.is_server_error()) || is_json {
        return resp;
    }
    let text = axum::body::to_bytes(resp.into_body(), 64 * 1024).await.map(|b| String::from_utf8_lossy(&b).trim().to_string()).unwrap_or_default();
    let message = if text.is_empty() { status.canonical_reason().unwrap_or("error").to_string() } else { text };
    let kind = if status.is_client_error() { "invalid_request_error" } else { "internal_error" };
    let body = json!({"error": {"message": message, "type": kind, "param": null, "code": status.as_u16()}});
    (status, Json(body)).into_response()
}

async fn require_api_key(State(state): State<AppState>, req: Request, next: Next) -> Response {
    if let Some(key) = &state.api_key {
        let given = req.headers().get("authorization").and_then(|v| v.to_str().ok()).and_then(|v| v.strip_prefix("Bearer "));
        if !given.is_some_and(|g| same_secret(g, key)) {
            return ApiError::unauthorized().into_response();
        }
    }
    next.run(req).await
}

/// Compares digests of the two, every byte, so the time taken says nothing about how much of
/// the key a guess got right.
fn same_secret(given: &str, key: &str) -> bool {
    use sha2::{Digest, Sha256};
    let (a, b) = (Sha256::digest(given.as_bytes()), Sha256::digest(key.as_bytes()));
    a.iter().zip(b.iter()).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// The loaded model, checking the requested model name.
pub fn loaded(state: &AppState, model: Option<&str>) -> Result<Arc<Loaded>, ApiError> {
    if let Some(m) = model {
        if m != state.served_model {
            return Err(ApiError::model_not_found(m, &state.served_model));
        }
    }
    state.loaded.get().cloned().ok_or_else(|| ApiError::unavailable("the model is still loading; retry when GET /health returns 200"))
}

async fn health(State(state): State<AppState>) -> Response {
    match state.loaded.get() {
        Some(l) if l.engine.stats.stopped.load(std::sync::atomic::Ordering::SeqCst) => {
            (StatusCode::SERVICE_UNAVAILABLE, Json(json!({"status": "engine stopped"}))).into_response()
        }
        Some(l) if l.engine.stats.failure().is_some() => {
            (StatusCode::SERVICE_UNAVAILABLE, Json(json!({"status": "backend failed", "error": l.engine.stats.failure()}))).into_response()
        }
        Some(_) => (StatusCode::OK, Json(json!({"status": "ok"}))).into_response(),
        None => (StatusCode::SERVICE_UNAVAILABLE, Json(json!({"status": "loading"}))).into_response(),
    }
}

async fn models(State(state): State<AppState>) -> Response {
    let max_model_len = state.loaded.get().map(|l| l.engine.limits.max_context);
    Json(json!({"object": "list", "data": [{
        "id": state.served_model, "object": "model", "created": state.created, "owned_by": "kiln", "max_model_len": max_model_len,
    }]}))
    .into_response()
}

async fn metrics(State(state): State<AppState>) -> Response {
    let engine = state.loaded.get().map(|l| l.engine.stats.clone());
    let body = state.metrics.render(engine.as_deref());
    ([("content-type", metrics::CONTENT_TYPE)], body).into_response()
}

/// Binds, then loads the model with `load` in the background (health answers 503 meanwhile),
/// then serves until the process is stopped.
pub async fn serve(
    state: AppState,
    addr: std::net::SocketAddr,
    edge: EdgeLimits,
    load: impl FnOnce() -> anyhow::Result<Loaded> + Send + 'static,
) -> anyhow::Result<()> {
    let listener = tokio::net::TcpListener::bind(addr).await.map_err(|e| anyhow::anyhow!("cannot listen on {addr}: {e}"))?;
    eprintln!("kiln serve: listening on http://{addr} (model `{}` loading)", state.served_model);
    let loading = state.clone();
    let loader = tokio::task::spawn_blocking(move || {
        let t = std::time::Instant::now();
        let loaded = load()?;
        let _ = loading.loaded.set(Arc::new(loaded));
        eprintln!("kiln serve: model loaded in {:.2}s; ready", t.elapsed().as_secs_f64());
        anyhow::Ok(())
    });
    let server = tokio::spawn(listener::serve(listener, router(state), edge));
    match loader.await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => return Err(e.context("loading the model")),
        Err(e) => return Err(anyhow::anyhow!("loading the model failed: {e}")),
    }
    server.await?.map_err(anyhow::Error::from)
}
