//! `POST /v1/chat/completions`: the chat template renders the prompt; the GLM reasoning
//! (`glm45`) and tool-call (`glm47`) parsers split the output into `reasoning_content`,
//! `content` and `tool_calls`, streaming or not.

use super::errors::ApiError;
use super::generation::{forced_tokens, start, total_usage, usage_json, GenerationSpec, Piece, Usage};
use super::logprobs::{chat_entry, chat_logprobs};
use super::params::{parse_body, parse_common};
use super::sse::{sse_response, Item};
use super::structured::chat_structure;
use super::state::unix_now;
use super::{loaded, AppState, RequestId};
use axum::body::Bytes;
use axum::extract::{Extension, State};
use axum::response::{IntoResponse, Response};
use axum::Json;
use kiln_engine::chat_template::{ChatInput, ChatTemplateError};
use kiln_engine::tool_calls::{OutputDelta, OutputParser, ToolCallEvent};
use serde_json::{json, Value};

pub async fn chat_completions(State(state): State<AppState>, Extension(rid): Extension<RequestId>, body: Bytes) -> Result<Response, ApiError> {
    let v = parse_body(&body)?;
    let p = parse_common(&v, true)?;
    let loaded = loaded(&state, p.model.as_deref())?;
    super::validate::messages(&v)?;
    super::validate::tools(&v)?;
    let Some(template) = &loaded.chat_template else {
        return Err(ApiError::invalid("this model has no chat template; use /v1/completions", None));
    };
    let input: ChatInput = serde_json::from_slice(&body).map_err(|e| ApiError::invalid(format!("invalid `messages` or `tools`: {e}"), Some("messages")))?;
    let thinking = input.enable_thinking() != Some(false);
    let prompt_text = template.render(&input).map_err(|e| match e {
        ChatTemplateError::Raised(_) | ChatTemplateError::Render { .. } => ApiError::invalid(format!("cannot render the chat: {e}"), Some("messages")),
        other => ApiError::internal(&rid.0, other),
    })?;
    let prompt = loaded.encode(prompt_text, "messages").await?;
    let all_tools: Vec<Value> = match v.get("tools") {
        None | Some(Value::Null) => vec![],
        Some(Value::Array(t)) => t.clone(),
        Some(_) => return Err(ApiError::invalid("`tools` must be a list", Some("tools"))),
    };
    let structure = chat_structure(&v, &all_tools, &p.response_format)?;
    // With `tool_choice: "none"` no call is generated, and none is parsed out of the text.
    let tool_choice_none = matches!(structure, super::structured::Structure::NoToolCalls);
    let tools: Option<Vec<Value>> = (!all_tools.is_empty() && !tool_choice_none).then_some(all_tools);
    let forced = forced_tokens(&state, &loaded, p.forced_output.as_deref())?;
    let n = p.n;
    let spec = GenerationSpec::new(&p, prompt, "messages", structure, thinking, forced);
    let mut pieces = start(&state, loaded, spec, &rid.0)?;
    let mut choices: Vec<ChoiceState> = (0..n).map(|_| ChoiceState::new(thinking, tools.as_deref())).collect();
    let with_logprobs = p.logprobs.is_some();
    let id = state.new_id("chatcmpl");
    let model = state.served_model.clone();
    let created = unix_now();

    if !p.stream {
        let mut finished = 0;
        while finished < n {
            let Some((i, piece)) = pieces.recv().await else { break };
            let c = &mut choices[i];
            match piece? {
                Piece::Token { text, logprobs } => {
                    c.reasoning_tokens += c.parser.in_reasoning() as usize;
                    c.logprobs.extend(logprobs.as_ref().map(chat_entry));
                    let d = c.parser.push(&text);
                    c.absorb(d);
                }
                Piece::Done { reason, tail, usage } => {
                    let d = c.parser.push(&tail);
                    c.absorb(d);
                    let d = c.parser.finish();
                    c.absorb(d);
                    c.finish = Some(if !c.parser.tool_calls().is_empty() && reason == "stop" { "tool_calls" } else { reason });
                    c.usage = usage;
                    finished += 1;
                }
            }
        }
        if finished < n {
            return Err(ApiError::internal(&rid.0, "generation ended without a finish event"));
        }
        let usage = total_usage(&choices.iter().map(|c| c.usage).collect::<Vec<_>>());
        let reasoning_tokens = choices.iter().map(|c| c.reasoning_tokens).sum();
        let out: Vec<Value> = choices
            .into_iter()
            .enumerate()
            .map(|(index, c)| {
                let calls: Vec<Value> = c.parser.tool_calls().iter().map(|t| t.to_openai_json()).collect();
                let mut message = json!({"role": "assistant", "content": if c.content.is_empty() { Value::Null } else { c.content.into() }});
                if !c.reasoning.is_empty() {
                    message["reasoning_content"] = c.reasoning.into();
                }
                if !calls.is_empty() {
                    message["tool_calls"] = calls.into();
                }
                let logprobs = if with_logprobs { chat_logprobs(c.logprobs) } else { Value::Null };
                json!({"index": index, "message": message, "logprobs": logprobs, "finish_reason": c.finish})
            })
            .collect();
        return Ok(Json(json!({
            "id": id, "object": "chat.completion", "created": created, "model": model,
            "choices": out,
            "usage": usage_json(usage, Some(reasoning_tokens)),
        }))
        .into_response());
    }

    let include_usage = p.include_usage;
    let chunk = move |index: usize, delta: Value, logprobs: Value, finish: Option<&str>| {
        json!({"id": id, "object": "chat.completion.chunk", "created": created, "model": model,
               "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}]})
    };
    Ok(sse_response(pieces, n, move |item| {
        let mut out = Vec::new();
        let index = match &item {
            Item::Piece(i, _) => *i,
            Item::End => 0,
        };
        if let Item::Piece(i, _) = &item {
            if !choices[*i].started {
                choices[*i].started = true;
                out.push(chunk(*i, json!({"role": "assistant", "content": ""}), Value::Null, None));
            }
        }
        match item {
            Item::Piece(_, Piece::Token { text, logprobs }) => {
                let c = &mut choices[index];
                c.reasoning_tokens += c.parser.in_reasoning() as usize;
                let lp = logprobs.as_ref().map(|l| chat_logprobs(vec![chat_entry(l)])).unwrap_or(Value::Null);
                match delta_chunk(c.parser.push(&text)) {
                    Some(d) => out.push(chunk(index, d, lp, None)),
                    // A token that shows nothing yet still reports its logprob.
                    None if !lp.is_null() => out.push(chunk(index, json!({}), lp, None)),
                    None => {}
                }
            }
            Item::Piece(_, Piece::Done { reason, tail, usage }) => {
                let c = &mut choices[index];
                out.extend(delta_chunk(c.parser.push(&tail)).map(|d| chunk(index, d, Value::Null, None)));
                out.extend(delta_chunk(c.parser.finish()).map(|d| chunk(index, d, Value::Null, None)));
                let finish = if !c.parser.tool_calls().is_empty() && reason == "stop" { "tool_calls" } else { reason };
                c.usage = usage;
                out.push(chunk(index, json!({}), Value::Null, Some(finish)));
            }
            Item::End if include_usage => {
                let usage = total_usage(&choices.iter().map(|c| c.usage).collect::<Vec<_>>());
                let reasoning_tokens = choices.iter().map(|c| c.reasoning_tokens).sum();
                let mut u = chunk(0, json!({}), Value::Null, None);
                u["choices"] = json!([]);
                u["usage"] = usage_json(usage, Some(reasoning_tokens));
                out.push(u);
            }
            Item::End => {}
        }
        out
    }))
}

/// One choice's output as it accumulates.
struct ChoiceState {
    parser: OutputParser,
    reasoning: String,
    content: String,
    reasoning_tokens: usize,
    logprobs: Vec<Value>,
    finish: Option<&'static str>,
    usage: Usage,
    /// Sent its first (role) chunk.
    started: bool,
}

impl ChoiceState {
    fn new(thinking: bool, tools: Option<&[Value]>) -> ChoiceState {
        ChoiceState {
            parser: OutputParser::new(thinking, tools),
            reasoning: String::new(),
            content: String::new(),
            reasoning_tokens: 0,
            logprobs: Vec::new(),
            finish: None,
            usage: Usage::default(),
            started: false,
        }
    }

    fn absorb(&mut self, d: OutputDelta) {
        self.reasoning += &d.reasoning;
        self.content += &d.content;
    }
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
