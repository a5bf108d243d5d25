//! `POST /v1/chat/completions`: the chat template renders the prompt; the GLM reasoning
//! (`glm45`) and tool-call (`glm47`) parsers split the output into `reasoning_content`,
//! `content` and `tool_calls`, streaming or not.

use super::errors::ApiError;
use super::generation::{forced_tokens, Generation, GenerationSpec, Piece};
use super::params::{parse_body, parse_common};
use super::sse::sse_response;
use super::state::unix_now;
use super::{loaded, AppState, RequestId};
use axum::body::Bytes;
use axum::extract::{Extension, State};
use axum::response::{IntoResponse, Response};
use axum::Json;
use kiln_runtime::engine::chat_template::{ChatInput, ChatTemplateError};
use kiln_runtime::engine::tool_calls::{OutputDelta, OutputParser, ToolCallEvent};
use serde_json::{json, Value};

pub async fn chat_completions(State(state): State<AppState>, Extension(rid): Extension<RequestId>, body: Bytes) -> Result<Response, ApiError> {
    let v = parse_body(&body)?;
    let p = parse_common(&v, true)?;
    let loaded = loaded(&state, p.model.as_deref())?;
    match v.get("messages") {
        Some(Value::Array(m)) if !m.is_empty() => {}
        _ => return Err(ApiError::invalid("`messages` must be a non-empty list of messages", Some("messages"))),
    }
    let Some(template) = &loaded.chat_template else {
        return Err(ApiError::invalid("this model has no chat template; use /v1/completions", None));
    };
    let input: ChatInput = serde_json::from_slice(&body).map_err(|e| ApiError::invalid(format!("invalid `messages` or `tools`: {e}"), Some("messages")))?;
    let thinking = input.enable_thinking() != Some(false);
    let prompt_text = template.render(&input).map_err(|e| match e {
        ChatTemplateError::Raised(_) | ChatTemplateError::Render { .. } => ApiError::invalid(format!("cannot render the chat: {e}"), Some("messages")),
        other => ApiError::internal(&rid.0, other),
    })?;
    let prompt = loaded.tokenizer.encode(&prompt_text).map_err(|e| ApiError::internal(&rid.0, e))?;
    let tool_choice_none = v.get("tool_choice").and_then(Value::as_str) == Some("none");
    let tools: Option<Vec<Value>> = match v.get("tools") {
        Some(Value::Array(t)) if !t.is_empty() && !tool_choice_none => Some(t.clone()),
        None | Some(Value::Null) | Some(Value::Array(_)) => None,
        Some(_) => return Err(ApiError::invalid("`tools` must be a list", Some("tools"))),
    };
    let forced = forced_tokens(&state, &loaded, p.forced_output.as_deref())?;
    let spec = GenerationSpec { prompt, prompt_param: "messages", max_tokens: p.max_tokens, sampling: p.sampling, stop: p.stop, ignore_eos: p.ignore_eos, forced };
    let mut gen = Generation::start(&state, loaded, spec)?;
    let mut parser = OutputParser::new(thinking, tools.as_deref());
    let id = state.new_id("chatcmpl");
    let model = state.served_model.clone();
    let created = unix_now();
    let mut reasoning_tokens = 0usize;

    if !p.stream {
        let (mut reasoning, mut content) = (String::new(), String::new());
        let mut absorb = |d: OutputDelta| {
            reasoning += &d.reasoning;
            content += &d.content;
        };
        while let Some(piece) = gen.next(&rid.0).await {
            match piece? {
                Piece::Token { text } => {
                    reasoning_tokens += parser.in_reasoning() as usize;
                    absorb(parser.push(&text));
                }
                Piece::Done { reason, tail, prompt_tokens, completion_tokens } => {
                    absorb(parser.push(&tail));
                    absorb(parser.finish());
                    let calls: Vec<Value> = parser.tool_calls().iter().map(|c| c.to_openai_json()).collect();
                    let finish = if !calls.is_empty() && reason == "stop" { "tool_calls" } else { reason };
                    let mut message = json!({"role": "assistant", "content": if content.is_empty() { Value::Null } else { content.into() }});
                    if !reasoning.is_empty() {
                        message["reasoning_content"] = reasoning.into();
                    }
                    if !calls.is_empty() {
                        message["tool_calls"] = calls.into();
                    }
                    return Ok(Json(json!({
                        "id": id, "object": "chat.completion", "created": created, "model": model,
                        "choices": [{"index": 0, "message": message, "logprobs": null, "finish_reason": finish}],
                        "usage": usage(prompt_tokens, completion_tokens, reasoning_tokens),
                    }))
                    .into_response());
                }
            }
        }
        return Err(ApiError::internal(&rid.0, "generation ended without a finish event"));
    }

    let include_usage = p.include_usage;
    let chunk = move |delta: Value, finish: Option<&str>| {
        json!({"id": id, "object": "chat.completion.chunk", "created": created, "model": model,
               "choices": [{"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish}]})
    };
    let mut first = true;
    Ok(sse_response(gen, rid, move |piece| {
        let mut out = Vec::new();
        if first {
            first = false;
            out.push(chunk(json!({"role": "assistant", "content": ""}), None));
        }
        match piece {
            Piece::Token { text } => {
                reasoning_tokens += parser.in_reasoning() as usize;
                out.extend(delta_chunk(parser.push(&text)).map(|d| chunk(d, None)));
            }
            Piece::Done { reason, tail, prompt_tokens, completion_tokens } => {
                out.extend(delta_chunk(parser.push(&tail)).map(|d| chunk(d, None)));
                out.extend(delta_chunk(parser.finish()).map(|d| chunk(d, None)));
                let finish = if !parser.tool_calls().is_empty() && reason == "stop" { "tool_calls" } else { reason };
                out.push(chunk(json!({}), Some(finish)));
                if include_usage {
                    let mut u = chunk(json!({}), None);
                    u["choices"] = json!([]);
                    u["usage"] = usage(prompt_tokens, completion_tokens, reasoning_tokens);
                    out.push(u);
                }
            }
        }
        out
    }))
}

fn usage(prompt: usize, completion: usize, reasoning: usize) -> Value {
    json!({"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
           "completion_tokens_details": {"reasoning_tokens": reasoning}})
}

/// A chunk delta for one parser step, or None when it produced nothing visible.
fn delta_chunk(d: OutputDelta) -> Option<Value> {
    let mut delta = serde_json::Map::new();
    if !d.reasoning.is_empty() {
        delta.insert("reasoning_content".into(), d.reasoning.into());
    }
    if !d.content.is_empty() {
        delta.insert("content".into(), d.content.into());
    }
    let calls: Vec<Value> = d
        .tool_calls
        .into_iter()
        .filter_map(|e| match e {
            ToolCallEvent::Start { index, id, name } => {
                Some(json!({"index": index, "id": id, "type": "function", "function": {"name": name, "arguments": ""}}))
            }
            ToolCallEvent::Arguments { index, delta } => Some(json!({"index": index, "function": {"arguments": delta}})),
            ToolCallEvent::End { .. } => None,
        })
        .collect();
    if !calls.is_empty() {
        delta.insert("tool_calls".into(), calls.into());
    }
    (!delta.is_empty()).then(|| Value::Object(delta))
}
