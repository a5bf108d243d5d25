//! What a request requires of its output (`response_format`, `tool_choice`), turned into the
//! engine's token constraint for each choice.

use super::errors::ApiError;
use super::params::ResponseFormat;
use super::state::Loaded;
use kiln_engine::constraint::{BannedTokens, ToolSpec};
use kiln_engine::scheduler::TokenConstraint;
use serde_json::Value;

#[derive(Debug, Clone, Default)]
pub enum Structure {
    /// Anything the model says.
    #[default]
    Free,
    /// `response_format` json_object / json_schema.
    Json(ResponseFormat),
    /// `tool_choice` required or a named function: only calls to `tools`; one call unless
    /// `parallel`.
    ToolCalls { tools: Vec<ToolSpec>, parallel: bool },
    /// `tool_choice: "none"`: `<tool_call>` is never generated.
    NoToolCalls,
}

/// `tool_choice` against the request's `tools`; with the result of `response_format`.
pub fn chat_structure(v: &Value, tools: &[Value], format: &ResponseFormat) -> Result<Structure, ApiError> {
    let bad = |m: String| ApiError::invalid(m, Some("tool_choice"));
    let parallel = match v.get("parallel_tool_calls") {
        None | Some(Value::Null) => true,
        Some(Value::Bool(b)) => *b,
        Some(x) => return Err(ApiError::invalid(format!("`parallel_tool_calls` must be true or false, got {x}"), Some("parallel_tool_calls"))),
    };
    let spec = |t: &Value| -> Option<ToolSpec> {
        let f = t.get("function")?;
        Some(ToolSpec { name: f.get("name")?.as_str()?.to_string(), parameters: f.get("parameters").cloned().unwrap_or(Value::Null) })
    };
    let choice = match v.get("tool_choice") {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) if s == "auto" => None,
        Some(Value::String(s)) if s == "none" => Some(Structure::NoToolCalls),
        Some(Value::String(s)) if s == "required" => {
            if tools.is_empty() {
                return Err(bad("`tool_choice: \"required\"` needs `tools`".into()));
            }
            let specs = tools.iter().map(|t| spec(t).ok_or_else(|| bad(format!("a tool without a function name: {t}")))).collect::<Result<_, _>>()?;
            Some(Structure::ToolCalls { tools: specs, parallel })
        }
        Some(o @ Value::Object(_)) => {
            let name = o
                .get("function")
                .and_then(|f| f.get("name"))
                .and_then(Value::as_str)
                .filter(|_| o.get("type").and_then(Value::as_str) == Some("function"))
                .ok_or_else(|| bad(format!("a named tool choice is {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}, got {o}")))?;
            let tool = tools
                .iter()
                .filter_map(spec)
                .find(|t| t.name == name)
                .ok_or_else(|| bad(format!("`tool_choice` names `{name}`, which is not among `tools`")))?;
            Some(Structure::ToolCalls { tools: vec![tool], parallel: false })
        }
        Some(x) => return Err(bad(format!("`tool_choice` must be \"auto\", \"none\", \"required\" or a named function, got {x}"))),
    };
    if !parallel && !tools.is_empty() && choice.is_none() {
        return Err(ApiError::invalid(
            "`parallel_tool_calls: false` is enforced only with `tool_choice` \"required\" or a named function",
            Some("parallel_tool_calls"),
        ));
    }
    match (choice, format) {
        (Some(Structure::ToolCalls { .. }), ResponseFormat::JsonObject | ResponseFormat::JsonSchema(_)) => {
            Err(ApiError::invalid("`response_format` and a forced `tool_choice` cannot both shape one output", Some("response_format")))
        }
        (Some(c), ResponseFormat::Text) => Ok(c),
        (_, ResponseFormat::Text) => Ok(Structure::Free),
        (_, f) => Ok(Structure::Json(f.clone())),
    }
}

/// The constraint one choice runs under (each choice has its own matcher state). `thinking`:
/// the prompt ends inside `<think>`, so reasoning may come first.
pub fn constraint(loaded: &Loaded, s: &Structure, thinking: bool) -> Result<Option<Box<dyn TokenConstraint>>, ApiError> {
    let compiler = || {
        loaded.constraints.as_ref().ok_or_else(|| ApiError::invalid("structured output is unavailable: this model's tokenizer could not be prepared for it (see the server log)", Some("response_format")))
    };
    let built = match s {
        Structure::Free => return Ok(None),
        Structure::NoToolCalls => return Ok(loaded.tokenizer.token_id("<tool_call>").map(|t| Box::new(BannedTokens(vec![t])) as Box<dyn TokenConstraint>)),
        Structure::Json(ResponseFormat::JsonObject) => compiler()?.json_object(thinking),
        Structure::Json(ResponseFormat::JsonSchema(schema)) => compiler()?.json_schema(schema, thinking),
        Structure::Json(ResponseFormat::Text) => return Ok(None),
        Structure::ToolCalls { tools, parallel } => compiler()?.tool_calls(tools, thinking, *parallel),
    };
    let param = if matches!(s, Structure::ToolCalls { .. }) { "tools" } else { "response_format" };
    built.map(|c| Some(Box::new(c) as Box<dyn TokenConstraint>)).map_err(|e| ApiError::invalid(e, Some(param)))
}
