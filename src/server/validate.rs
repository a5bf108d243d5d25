//! The shapes OpenAI checks before a chat request runs: every message's role and content, and
//! every tool's definition. A malformed entry is a 400 naming its index, not a template error or
//! a quietly odd prompt.

use super::errors::ApiError;
use serde_json::Value;

const ROLES: [&str; 5] = ["system", "developer", "user", "assistant", "tool"];

fn bad(param: &'static str, message: String) -> ApiError {
    ApiError::invalid(message, Some(param))
}

/// Text content: a string or a list of `{"type": "text", "text": ...}` parts.
fn text_content(c: &Value, at: &str) -> Result<(), ApiError> {
    match c {
        Value::String(_) => Ok(()),
        Value::Array(parts) => parts.iter().enumerate().try_for_each(|(j, p)| match (p.get("type").and_then(Value::as_str), p.get("text")) {
            (Some("text"), Some(Value::String(_))) => Ok(()),
            (Some("text"), _) => Err(bad("messages", format!("{at}.content[{j}]: a text part needs a string `text`"))),
            (Some(other), _) => Err(bad("messages", format!("{at}.content[{j}]: content parts of type `{other}` are not supported (text only)"))),
            (None, _) => Err(bad("messages", format!("{at}.content[{j}]: a content part must be an object with a `type`"))),
        }),
        other => Err(bad("messages", format!("{at}.content must be a string or a list of text parts, got {other}"))),
    }
}

pub fn messages(v: &Value) -> Result<(), ApiError> {
    let Some(Value::Array(messages)) = v.get("messages") else {
        return Err(bad("messages", "`messages` must be a non-empty list of messages".into()));
    };
    if messages.is_empty() {
        return Err(bad("messages", "`messages` must be a non-empty list of messages".into()));
    }
    for (i, m) in messages.iter().enumerate() {
        let at = format!("messages[{i}]");
        let Some(m) = m.as_object() else { return Err(bad("messages", format!("{at} must be an object, got {m}"))) };
        let role = match m.get("role") {
            Some(Value::String(r)) if ROLES.contains(&r.as_str()) => r.as_str(),
            Some(Value::String(r)) => return Err(bad("messages", format!("{at}.role `{r}` is not one of {}", ROLES.join(", ")))),
            Some(other) => return Err(bad("messages", format!("{at}.role must be a string, got {other}"))),
            None => return Err(bad("messages", format!("{at} has no `role`"))),
        };
        let calls = m.get("tool_calls").filter(|c| !c.is_null());
        match (role, m.get("content")) {
            // An assistant turn may be only tool calls.
            ("assistant", None | Some(Value::Null)) if calls.is_some() => {}
            (_, None | Some(Value::Null)) => return Err(bad("messages", format!("{at} ({role}) needs `content`"))),
            (_, Some(c)) => text_content(c, &at)?,
        }
        if let Some(calls) = calls {
            if role != "assistant" {
                return Err(bad("messages", format!("{at}: only assistant messages carry `tool_calls`")));
            }
            let Some(calls) = calls.as_array() else { return Err(bad("messages", format!("{at}.tool_calls must be a list"))) };
            for (j, c) in calls.iter().enumerate() {
                let f = c.get("function");
                let named = f.and_then(|f| f.get("name")).is_some_and(Value::is_string);
                let args_ok = f.and_then(|f| f.get("arguments")).is_none_or(|a| a.is_string() || a.is_object());
                if !named || !args_ok {
                    return Err(bad("messages", format!("{at}.tool_calls[{j}] must be {{\"type\": \"function\", \"function\": {{\"name\": string, \"arguments\": string}}}}")));
                }
            }
        }
        if role == "tool" && !m.get("tool_call_id").is_none_or(Value::is_string) {
            return Err(bad("messages", format!("{at}.tool_call_id must be a string")));
        }
    }
    Ok(())
}

/// Tool names as OpenAI allows them (they become text in the prompt and the grammar).
fn valid_name(n: &str) -> bool {
    !n.is_empty() && n.len() <= 64 && n.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-' || b == b'.')
}

pub fn tools(v: &Value) -> Result<(), ApiError> {
    let tools = match v.get("tools") {
        None | Some(Value::Null) => return Ok(()),
        Some(Value::Array(t)) => t,
        Some(_) => return Err(bad("tools", "`tools` must be a list".into())),
    };
    for (i, t) in tools.iter().enumerate() {
        let at = format!("tools[{i}]");
        if t.get("type").and_then(Value::as_str) != Some("function") {
            return Err(bad("tools", format!("{at} must be {{\"type\": \"function\", \"function\": {{...}}}}")));
        }
        let Some(f) = t.get("function").and_then(Value::as_object) else {
            return Err(bad("tools", format!("{at} has no `function` object")));
        };
        match f.get("name").and_then(Value::as_str) {
            Some(n) if valid_name(n) => {}
            Some(n) => return Err(bad("tools", format!("{at}.function.name `{n}` must be 1-64 letters, digits, `_`, `-` or `.`"))),
            None => return Err(bad("tools", format!("{at}.function needs a string `name`"))),
        }
        if let Some(p) = f.get("parameters").filter(|p| !p.is_null()) {
            if !p.is_object() {
                return Err(bad("tools", format!("{at}.function.parameters must be a JSON schema object, got {p}")));
            }
        }
    }
    Ok(())
}
