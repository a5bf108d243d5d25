//! `POST /v1/completions`: text in, text out (streaming or not).

use super::errors::ApiError;
use super::generation::{forced_tokens, start, total_usage, usage_json, GenerationSpec, Piece, Usage};
use super::logprobs::CompletionLogprobs;
use super::params::{parse_body, parse_common, ResponseFormat};
use super::sse::{sse_response, Item};
use super::structured::Structure;
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
        Some(Value::String(s)) => loaded.encode(s.clone(), "prompt").await?,
        Some(Value::Array(items)) if items.len() == 1 && items[0].is_string() => loaded.encode(items[0].as_str().unwrap_or_default().to_string(), "prompt").await?,
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
    let n = p.n;
    let structure = match &p.response_format {
        ResponseFormat::Text => Structure::Free,
        f => Structure::Json(f.clone()),
    };
    let spec = GenerationSpec::new(&p, prompt, "prompt", structure, false, forced);
    let mut pieces = start(&state, loaded, spec, &rid.0)?;
    let with_logprobs = p.logprobs.is_some();
    let id = state.new_id("cmpl");
    let model = state.served_model.clone();
    let created = unix_now();
    // Per choice: text so far, logprobs, finish reason, usage.
    let mut choices: Vec<(String, CompletionLogprobs, Option<&'static str>, Usage)> = (0..n).map(|_| Default::default()).collect();
    if !p.stream {
        let mut finished = 0;
        while finished < n {
            let Some((i, piece)) = pieces.recv().await else { break };
            let c = &mut choices[i];
            match piece? {
                Piece::Token { text, logprobs } => {
                    if let Some(l) = &logprobs {
                        c.1.push(l, c.0.len());
                    }
                    c.0 += &text;
                }
                Piece::Done { reason, tail, usage } => {
                    c.0 += &tail;
                    c.2 = Some(reason);
                    c.3 = usage;
                    finished += 1;
                }
            }
        }
        if finished < n {
            return Err(ApiError::internal(&rid.0, "generation ended without a finish event"));
        }
        let usage = total_usage(&choices.iter().map(|c| c.3).collect::<Vec<_>>());
        let out: Vec<Value> = choices
            .into_iter()
            .enumerate()
            .map(|(index, mut c)| {
                let logprobs = if with_logprobs { c.1.take() } else { Value::Null };
                json!({"index": index, "text": c.0, "logprobs": logprobs, "finish_reason": c.2})
            })
            .collect();
        return Ok(Json(json!({
            "id": id, "object": "text_completion", "created": created, "model": model,
            "choices": out,
            "usage": usage_json(usage, None),
        }))
        .into_response());
    }
    let chunk = move |index: usize, text: &str, logprobs: Value, reason: Option<&str>| {
        json!({"id": id, "object": "text_completion", "created": created, "model": model,
               "choices": [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": reason}]})
    };
    let include_usage = p.include_usage;
    Ok(sse_response(pieces, n, move |item| match item {
        Item::Piece(i, Piece::Token { text, logprobs }) => {
            let c = &mut choices[i];
            let lp = match &logprobs {
                Some(l) => {
                    c.1.push(l, c.0.len());
                    c.1.take()
                }
                None => Value::Null,
            };
            c.0 += &text;
            if text.is_empty() && lp.is_null() {
                return vec![];
            }
            vec![chunk(i, &text, lp, None)]
        }
        Item::Piece(i, Piece::Done { reason, tail, usage }) => {
            choices[i].3 = usage;
            vec![chunk(i, &tail, Value::Null, Some(reason))]
        }
        Item::End if include_usage => {
            let mut u = chunk(0, "", Value::Null, None);
            u["choices"] = json!([]);
            u["usage"] = usage_json(total_usage(&choices.iter().map(|c| c.3).collect::<Vec<_>>()), None);
            vec![u]
        }
        Item::End => vec![],
    }))
}
