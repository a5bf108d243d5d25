//! `POST /v1/completions`: text in, text out (streaming or not).

use super::errors::ApiError;
use super::generation::{forced_tokens, Generation, GenerationSpec, Piece};
use super::params::{parse_body, parse_common};
use super::sse::sse_response;
use super::state::unix_now;
use super::{loaded, RequestId};
use super::AppState;
use axum::body::Bytes;
use axum::extract::{Extension, State};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};

pub async fn completions(State(state): State<AppState>, Extension(rid): Extension<RequestId>, body: Bytes) -> Result<Response, ApiError> {
    let v = parse_body(&body)?;
    let p = parse_common(&v, false)?;
    let loaded = loaded(&state, p.model.as_deref())?;
    let prompt = match v.get("prompt") {
        Some(Value::String(s)) => loaded.tokenizer.encode(s).map_err(|e| ApiError::invalid(e.to_string(), Some("prompt")))?,
        Some(Value::Array(items)) if items.len() == 1 && items[0].is_string() => {
            loaded.tokenizer.encode(items[0].as_str().unwrap_or_default()).map_err(|e| ApiError::invalid(e.to_string(), Some("prompt")))?
        }
        Some(Value::Array(items)) if items.iter().all(|i| i.is_u64()) => items
            .iter()
            .map(|i| u32::try_from(i.as_u64().unwrap_or(u64::MAX)).map_err(|_| ApiError::invalid(format!("token id {i} is out of range"), Some("prompt"))))
            .collect::<Result<_, _>>()?,
        Some(Value::Array(_)) => return Err(ApiError::invalid("`prompt` must be a string, a list with one string, or a list of token ids", Some("prompt"))),
        _ => return Err(ApiError::invalid("`prompt` is required", Some("prompt"))),
    };
    if prompt.is_empty() {
        return Err(ApiError::invalid("`prompt` is empty", Some("prompt")));
    }
    let forced = forced_tokens(&state, &loaded, p.forced_output.as_deref())?;
    let spec = GenerationSpec { prompt, prompt_param: "prompt", max_tokens: p.max_tokens, sampling: p.sampling, stop: p.stop, ignore_eos: p.ignore_eos, forced };
    let mut gen = Generation::start(&state, loaded, spec)?;
    let id = state.new_id("cmpl");
    let model = state.served_model.clone();
    let created = unix_now();
    if !p.stream {
        let mut text = String::new();
        while let Some(piece) = gen.next(&rid.0).await {
            match piece? {
                Piece::Token { text: t } => text += &t,
                Piece::Done { reason, tail, prompt_tokens, completion_tokens } => {
                    text += &tail;
                    return Ok(Json(json!({
                        "id": id, "object": "text_completion", "created": created, "model": model,
                        "choices": [{"index": 0, "text": text, "logprobs": null, "finish_reason": reason}],
                        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens, "total_tokens": prompt_tokens + completion_tokens},
                    }))
                    .into_response());
                }
            }
        }
        return Err(ApiError::internal(&rid.0, "generation ended without a finish event"));
    }
    let chunk = move |text: &str, reason: Option<&str>| {
        json!({"id": id, "object": "text_completion", "created": created, "model": model,
               "choices": [{"index": 0, "text": text, "logprobs": null, "finish_reason": reason}]})
    };
    let include_usage = p.include_usage;
    Ok(sse_response(gen, rid, move |piece| match piece {
        Piece::Token { text } if text.is_empty() => vec![],
        Piece::Token { text } => vec![chunk(&text, None)],
        Piece::Done { reason, tail, prompt_tokens, completion_tokens } => {
            let mut out = vec![chunk(&tail, Some(reason))];
            if include_usage {
                let mut u = chunk("", None);
                u["choices"] = json!([]);
                u["usage"] = json!({"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens, "total_tokens": prompt_tokens + completion_tokens});
                out.push(u);
            }
            out
        }
    }))
}
