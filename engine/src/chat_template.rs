//! Renders a Hugging Face chat template (Jinja) into the prompt text, with the semantics of
//! transformers' `apply_chat_template`: `trim_blocks` and `lstrip_blocks` on, trailing newline
//! dropped, a `tojson` that is Python's `json.dumps`, `raise_exception` and `strftime_now`, and the
//! Python string/dict methods templates call (`.strip()`, `.items()`, ...). A prompt that differs
//! from what vLLM/SGLang build by one byte changes what the model does, so fidelity beats speed.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::Path;

use minijinja::value::{Kwargs, Rest, ValueKind};
use minijinja::{Environment, ErrorKind, Value};
use serde::Deserialize;

#[derive(Debug, thiserror::Error)]
pub enum ChatTemplateError {
    #[error("{dir}: no chat template (neither chat_template.jinja nor a usable `chat_template` in tokenizer_config.json)")]
    Missing { dir: String },
    #[error("{path}: {message}")]
    Read { path: String, message: String },
    #[error("chat template `{name}`: syntax error{}: {message}", at_line(*.line))]
    Syntax { name: String, line: Option<usize>, message: String },
    /// The template called `raise_exception(msg)`: the request is one it does not accept.
    #[error("chat template: {0}")]
    Raised(String),
    #[error("chat template: render error{}: {message}", at_line(*.line))]
    Render { line: Option<usize>, message: String },
}

fn at_line(line: Option<usize>) -> String {
    line.map(|l| format!(" at line {l}")).unwrap_or_default()
}

/// A JSON value on its way into the template. Objects keep their keys in the order they were
/// written, as a Python dict does: the tool schemas are printed into the prompt with `tojson`, and
/// sorting their keys would change the prompt. Deserialize it straight from request JSON to keep
/// that order; converting from `serde_json::Value` gives that map's order (sorted, unless the
/// workspace enables serde_json's `preserve_order`).
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(transparent)]
pub struct TemplateJson(Value);

impl TemplateJson {
    /// Parses JSON text, keeping key order.
    pub fn parse(json: &str) -> Result<TemplateJson, serde_json::Error> {
        serde_json::from_str(json)
    }

    /// The same value as `serde_json` (e.g. the tools, for [`crate::tool_calls`]).
    pub fn to_json(&self) -> serde_json::Value {
        serde_json::to_value(&self.0).unwrap_or_default()
    }
}

impl From<&serde_json::Value> for TemplateJson {
    fn from(v: &serde_json::Value) -> TemplateJson {
        TemplateJson(Value::from(minijinja::value::Serde(v)))
    }
}

impl From<serde_json::Value> for TemplateJson {
    fn from(v: serde_json::Value) -> TemplateJson {
        TemplateJson::from(&v)
    }
}

/// What the template sees. Deserializes from an OpenAI chat-completions request body (unknown
/// fields ignored), so `serde_json::from_str::<ChatInput>(body)` keeps the key order as sent.
#[derive(Debug, Clone, Deserialize)]
pub struct ChatInput {
    /// OpenAI message objects (`role`, `content` as a string or a list of `{type: text, text}`
    /// parts, `tool_calls`, `tool_call_id`, `reasoning_content`, ...).
    pub messages: Vec<TemplateJson>,
    /// The request's `tools`; `None` renders as Python `None`, as transformers passes it.
    #[serde(default)]
    pub tools: Option<Vec<TemplateJson>>,
    #[serde(default = "yes")]
    pub add_generation_prompt: bool,
    /// Extra template variables, e.g. `enable_thinking: false`.
    #[serde(default, deserialize_with = "null_as_empty")]
    pub chat_template_kwargs: BTreeMap<String, TemplateJson>,
}

fn yes() -> bool {
    true
}

fn null_as_empty<'de, D: serde::Deserializer<'de>>(d: D) -> Result<BTreeMap<String, TemplateJson>, D::Error> {
    Ok(Option::deserialize(d)?.unwrap_or_default())
}

impl ChatInput {
    /// `messages` must be a JSON array; key order is serde_json's (see [`TemplateJson`]).
    pub fn from_json(messages: &serde_json::Value, tools: Option<&serde_json::Value>) -> ChatInput {
        let list = |v: &serde_json::Value| match v {
            serde_json::Value::Array(a) => a.iter().map(TemplateJson::from).collect(),
            other => vec![TemplateJson::from(other)],
        };
        ChatInput {
            messages: list(messages),
            tools: tools.filter(|t| !t.is_null()).map(list),
            add_generation_prompt: true,
            chat_template_kwargs: BTreeMap::new(),
        }
    }

    /// The value of `chat_template_kwargs.enable_thinking`, where it is a boolean.
    pub fn enable_thinking(&self) -> Option<bool> {
        let v = &self.chat_template_kwargs.get("enable_thinking")?.0;
        (v.kind() == ValueKind::Bool).then(|| v.is_true())
    }
}

/// A compiled chat template plus the special-token variables (`bos_token`, `eos_token`, ...)
/// that transformers passes to every render.
pub struct ChatTemplate {
    env: Environment<'static>,
    /// Besides `default`, the checkpoint has a `tool_use` template (used when tools are given).
    has_tool_use: bool,
    special_tokens: Vec<(String, String)>,
}

const SPECIAL_TOKEN_VARS: [&str; 7] =
    ["bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token"];

impl ChatTemplate {
    /// Loads `dir/chat_template.jinja`, else `chat_template` from `dir/tokenizer_config.json` (a
    /// string, or a list of `{name, template}` of which `default`, and `tool_use` for requests
    /// with tools, are used). Special tokens come from `tokenizer_config.json` when it exists.
    pub fn from_dir(dir: &Path) -> Result<ChatTemplate, ChatTemplateError> {
        let config_path = dir.join("tokenizer_config.json");
        let config: Option<serde_json::Value> = match std::fs::read_to_string(&config_path) {
            Ok(text) => Some(serde_json::from_str(&text).map_err(|e| ChatTemplateError::Read {
                path: config_path.display().to_string(),
                message: format!("malformed JSON: {e}"),
            })?),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
            Err(e) => return Err(ChatTemplateError::Read { path: config_path.display().to_string(), message: e.to_string() }),
        };
        let jinja_path = dir.join("chat_template.jinja");
        let mut sources: Vec<(String, String)> = Vec::new();
        match std::fs::read_to_string(&jinja_path) {
            Ok(text) => sources.push(("default".into(), text)),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                match config.as_ref().and_then(|c| c.get("chat_template")) {
                    Some(serde_json::Value::String(s)) => sources.push(("default".into(), s.clone())),
                    Some(serde_json::Value::Array(list)) => {
                        for entry in list {
                            if let (Some(name), Some(t)) = (
                                entry.get("name").and_then(|n| n.as_str()),
                                entry.get("template").and_then(|t| t.as_str()),
                            ) {
                                sources.push((name.to_string(), t.to_string()));
                            }
                        }
                    }
                    _ => {}
                }
            }
            Err(e) => return Err(ChatTemplateError::Read { path: jinja_path.display().to_string(), message: e.to_string() }),
        }
        if !sources.iter().any(|(n, _)| n == "default") {
            return Err(ChatTemplateError::Missing { dir: dir.display().to_string() });
        }
        let mut template = ChatTemplate::new_env();
        for (name, source) in sources.into_iter().filter(|(n, _)| n == "default" || n == "tool_use") {
            template.add(name, source)?;
        }
        if let Some(config) = &config {
            for var in SPECIAL_TOKEN_VARS {
                let token = match config.get(var) {
                    Some(serde_json::Value::String(s)) => Some(s.clone()),
                    Some(obj @ serde_json::Value::Object(_)) => obj.get("content").and_then(|c| c.as_str()).map(String::from),
                    _ => None,
                };
                if let Some(token) = token {
                    template.special_tokens.push((var.to_string(), token));
                }
            }
        }
        Ok(template)
    }

    /// Compiles one template source (used as `default`).
    pub fn from_source(source: &str) -> Result<ChatTemplate, ChatTemplateError> {
        let mut template = ChatTemplate::new_env();
        template.add("default".into(), source.to_string())?;
        Ok(template)
    }

    fn new_env() -> ChatTemplate {
        let mut env = Environment::new();
        let syntax = minijinja::syntax::SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .keep_trailing_newline(false)
            .build()
            .expect("default delimiters are valid");
        env.set_syntax(syntax);
        // No HTML autoescaping: transformers' environment has none.
        env.set_auto_escape_callback(|_| minijinja::AutoEscape::None);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_filter("tojson", tojson_filter);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", |format: String| strftime_utc(&format, now_unix_seconds()));
        ChatTemplate { env, has_tool_use: false, special_tokens: Vec::new() }
    }

    fn add(&mut self, name: String, source: String) -> Result<(), ChatTemplateError> {
        if name == "tool_use" {
            self.has_tool_use = true;
        }
        self.env.add_template_owned(name.clone(), source).map_err(|e| ChatTemplateError::Syntax {
            name,
            line: e.line(),
            message: e.detail().map(String::from).unwrap_or_else(|| e.kind().to_string()),
        })
    }

    /// The prompt text for `input`.
    pub fn render(&self, input: &ChatInput) -> Result<String, ChatTemplateError> {
        let name = if input.tools.is_some() && self.has_tool_use { "tool_use" } else { "default" };
        let template = self.env.get_template(name).expect("templates are added at load");
        let mut ctx: Vec<(String, Value)> =
            self.special_tokens.iter().map(|(k, v)| (k.clone(), Value::from(v.as_str()))).collect();
        for (k, v) in &input.chat_template_kwargs {
            ctx.push((k.clone(), v.0.clone()));
        }
        // The fixed variables win over kwargs of the same name.
        let messages: Vec<Value> = input.messages.iter().map(|m| normalize_message(&m.0)).collect();
        ctx.push(("messages".into(), Value::from(messages)));
        let tools = match &input.tools {
            Some(tools) => Value::from(tools.iter().map(|t| t.0.clone()).collect::<Vec<_>>()),
            None => Value::from(()),
        };
        ctx.push(("tools".into(), tools));
        ctx.push(("documents".into(), Value::from(())));
        ctx.push(("add_generation_prompt".into(), Value::from(input.add_generation_prompt)));
        template.render(Value::from_pairs(ctx)).map_err(render_error)
    }
}

/// Raised by `raise_exception`, carried as the source of the render error so it can be told
/// apart from template bugs.
#[derive(Debug)]
struct Raised(String);

impl std::fmt::Display for Raised {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Raised {}

fn raise_exception(message: String) -> Result<Value, minijinja::Error> {
    Err(minijinja::Error::new(ErrorKind::InvalidOperation, message.clone()).with_source(Raised(message)))
}

fn render_error(e: minijinja::Error) -> ChatTemplateError {
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(&e);
    while let Some(err) = source {
        if let Some(raised) = err.downcast_ref::<Raised>() {
            return ChatTemplateError::Raised(raised.0.clone());
        }
        source = err.source();
    }
    let message = match e.detail() {
        Some(detail) => format!("{}: {detail}", e.kind()),
        None => e.kind().to_string(),
    };
    ChatTemplateError::Render { line: e.line(), message }
}

/// OpenAI clients send tool-call `arguments` as a JSON string, while templates iterate them as a
/// mapping (`arguments.items()`); like vLLM, parse a string that holds a JSON object.
fn normalize_message(message: &Value) -> Value {
    let calls = match message.get_attr("tool_calls") {
        Ok(calls) if calls.kind() == ValueKind::Seq => calls,
        _ => return message.clone(),
    };
    let Ok(calls_iter) = calls.try_iter() else { return message.clone() };
    let fixed: Vec<Value> = calls_iter
        .map(|call| {
            let function = call.get_attr("function").unwrap_or_default();
            let args = function.get_attr("arguments").unwrap_or_default();
            let Some(text) = args.as_str() else { return call };
            match serde_json::from_str::<Value>(text) {
                Ok(parsed) if parsed.kind() == ValueKind::Map => {
                    let function = replace_key(&function, "arguments", parsed);
                    replace_key(&call, "function", function)
                }
                _ => call,
            }
        })
        .collect();
    replace_key(message, "tool_calls", Value::from(fixed))
}

/// A copy of the mapping `map` with `key` set to `value`, keeping key order.
fn replace_key(map: &Value, key: &str, value: Value) -> Value {
    let Ok(keys) = map.try_iter() else { return map.clone() };
    let mut value = Some(value);
    let mut pairs: Vec<(Value, Value)> = keys
        .map(|k| {
            let v = if k.as_str() == Some(key) { value.take().unwrap_or_default() } else { map.get_item(&k).unwrap_or_default() };
            (k, v)
        })
        .collect();
    if let Some(v) = value {
        pairs.push((Value::from(key), v));
    }
    Value::from_pairs(pairs)
}

/// How `json.dumps` lays out its output.
struct JsonStyle {
    ensure_ascii: bool,
    indent: Option<String>,
    item_sep: String,
    key_sep: String,
    sort_keys: bool,
}

/// transformers' `tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False)`,
/// i.e. `json.dumps` with those arguments (positional or keyword) and no HTML escaping.
fn tojson_filter(value: &Value, args: Rest<Value>, kwargs: Kwargs) -> Result<Value, minijinja::Error> {
    let arg = |i: usize, name: &str| -> Result<Option<Value>, minijinja::Error> {
        let kw: Option<Value> = kwargs.get(name)?;
        Ok(kw.or_else(|| args.get(i).cloned()).filter(|v| !v.is_none() && !v.is_undefined()))
    };
    let bad = |what: &str| minijinja::Error::new(ErrorKind::InvalidOperation, format!("tojson: {what}"));
    let ensure_ascii = arg(0, "ensure_ascii")?.is_some_and(|v| v.is_true());
    let indent = match arg(1, "indent")? {
        None => None,
        Some(v) if v.kind() == ValueKind::String => Some(v.as_str().unwrap_or_default().to_string()),
        Some(v) => Some(" ".repeat(v.as_i64().ok_or_else(|| bad("indent must be an int or a string"))?.max(0) as usize)),
    };
    let (mut item_sep, mut key_sep) = (if indent.is_some() { "," } else { ", " }.to_string(), ": ".to_string());
    if let Some(seps) = arg(2, "separators")? {
        let parts: Vec<Value> = seps.try_iter().map_err(|_| bad("separators must be a pair of strings"))?.collect();
        match parts.as_slice() {
            [a, b] if a.as_str().is_some() && b.as_str().is_some() => {
                item_sep = a.as_str().unwrap_or_default().to_string();
                key_sep = b.as_str().unwrap_or_default().to_string();
            }
            _ => return Err(bad("separators must be a pair of strings")),
        }
    }
    let sort_keys = arg(3, "sort_keys")?.is_some_and(|v| v.is_true());
    let style = JsonStyle { ensure_ascii, indent, item_sep, key_sep, sort_keys };
    let mut out = String::new();
    write_json(&mut out, value, &style, 0)?;
    Ok(Value::from(out))
}

fn write_json(out: &mut String, v: &Value, style: &JsonStyle, depth: usize) -> Result<(), minijinja::Error> {
    let unsupported =
        |kind: ValueKind| minijinja::Error::new(ErrorKind::InvalidOperation, format!("tojson: a {kind} is not JSON serializable"));
    if depth > 512 {
        return Err(minijinja::Error::new(ErrorKind::InvalidOperation, "tojson: nesting too deep"));
    }
    match v.kind() {
        ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if v.is_true() { "true" } else { "false" }),
        ValueKind::Number => write_number(out, v),
        ValueKind::String => write_json_str(out, v.as_str().unwrap_or_default(), style.ensure_ascii),
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = v.try_iter()?.collect();
            if items.is_empty() {
                out.push_str("[]");
                return Ok(());
            }
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(&style.item_sep);
                }
                newline(out, style, depth + 1);
                write_json(out, item, style, depth + 1)?;
            }
            newline(out, style, depth);
            out.push(']');
        }
        ValueKind::Map => {
            let mut entries: Vec<(String, Value)> = Vec::new();
            for k in v.try_iter()? {
                let key = match k.kind() {
                    ValueKind::String => k.as_str().unwrap_or_default().to_string(),
                    ValueKind::Number => {
                        let mut s = String::new();
                        write_number(&mut s, &k);
                        s
                    }
                    ValueKind::Bool => if k.is_true() { "true" } else { "false" }.to_string(),
                    ValueKind::None => "null".to_string(),
                    kind => return Err(unsupported(kind)),
                };
                let value = v.get_item(&k)?;
                entries.push((key, value));
            }
            if style.sort_keys {
                entries.sort_by(|a, b| a.0.cmp(&b.0));
            }
            if entries.is_empty() {
                out.push_str("{}");
                return Ok(());
            }
            out.push('{');
            for (i, (key, value)) in entries.iter().enumerate() {
                if i > 0 {
                    out.push_str(&style.item_sep);
                }
                newline(out, style, depth + 1);
                write_json_str(out, key, style.ensure_ascii);
                out.push_str(&style.key_sep);
                write_json(out, value, style, depth + 1)?;
            }
            newline(out, style, depth);
            out.push('}');
        }
        kind => return Err(unsupported(kind)),
    }
    Ok(())
}

fn newline(out: &mut String, style: &JsonStyle, depth: usize) {
    if let Some(indent) = &style.indent {
        out.push('\n');
        for _ in 0..depth {
            out.push_str(indent);
        }
    }
}

fn write_number(out: &mut String, v: &Value) {
    if v.is_integer() {
        let _ = write!(out, "{v}");
    } else {
        out.push_str(&python_float_repr(f64::try_from(v.clone()).unwrap_or(f64::NAN)));
    }
}

/// Python's `repr(float)`: the shortest round-trip digits, positional for exponents in [-4, 16),
/// scientific (`1e+16`, `1.5e-07`) outside it, always with a `.0` or an exponent.
fn python_float_repr(f: f64) -> String {
    if f.is_nan() {
        return "NaN".into();
    }
    if f.is_infinite() {
        return if f > 0.0 { "Infinity" } else { "-Infinity" }.into();
    }
    let sci = format!("{f:e}");
    let (mantissa, exp) = sci.split_once('e').unwrap_or((&sci, "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    if (-4..16).contains(&exp) {
        let s = format!("{f}");
        if s.contains('.') { s } else { s + ".0" }
    } else {
        format!("{mantissa}e{}{:02}", if exp < 0 { '-' } else { '+' }, exp.abs())
    }
}

/// A JSON string literal the way `json.dumps` writes it (lowercase `\u00XX`, surrogate pairs
/// under `ensure_ascii`).
fn write_json_str(out: &mut String, s: &str, ensure_ascii: bool) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 || (ensure_ascii && !(' '..='~').contains(&c)) => {
                let mut units = [0u16; 2];
                for unit in c.encode_utf16(&mut units) {
                    let _ = write!(out, "\\u{unit:04x}");
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

fn now_unix_seconds() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0)
}

/// `strftime` for the specifiers chat templates use (`%Y %m %d %H %M %S %y %j %b %B %a %A %I
/// %p %e %%`, glibc's `-` no-padding flag), in UTC. Unknown specifiers are copied through.
fn strftime_utc(format: &str, unix: i64) -> String {
    const MONTHS: [&str; 12] =
        ["January", "February", "March", "April", "May", "June", "July", "August", "September", "October", "November", "December"];
    const DAYS: [&str; 7] = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"];
    let days = unix.div_euclid(86_400);
    let secs = unix.rem_euclid(86_400);
    let (year, month, day) = civil_from_days(days);
    let weekday = (days + 3).rem_euclid(7) as usize; // 1970-01-01 was a Thursday
    let yday = days - days_from_civil(year, 1, 1) + 1;
    let (hour, minute, second) = (secs / 3600, secs / 60 % 60, secs % 60);
    let mut out = String::new();
    let mut chars = format.chars().peekable();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        let pad = chars.peek() != Some(&'-');
        if !pad {
            chars.next();
        }
        let num = |out: &mut String, n: i64, width: usize| {
            if pad {
                let _ = write!(out, "{n:0width$}");
            } else {
                let _ = write!(out, "{n}");
            }
        };
        match chars.next() {
            Some('Y') => {
                let _ = write!(out, "{year}");
            }
            Some('y') => num(&mut out, year.rem_euclid(100), 2),
            Some('m') => num(&mut out, month, 2),
            Some('d') => num(&mut out, day, 2),
            Some('e') => {
                let _ = if pad { write!(out, "{day:2}") } else { write!(out, "{day}") };
            }
            Some('j') => num(&mut out, yday, 3),
            Some('H') => num(&mut out, hour, 2),
            Some('I') => num(&mut out, (hour + 11) % 12 + 1, 2),
            Some('M') => num(&mut out, minute, 2),
            Some('S') => num(&mut out, second, 2),
            Some('p') => out.push_str(if hour < 12 { "AM" } else { "PM" }),
            Some('B') => out.push_str(MONTHS[month as usize - 1]),
            Some('b') | Some('h') => out.push_str(&MONTHS[month as usize - 1][..3]),
            Some('A') => out.push_str(DAYS[weekday]),
            Some('a') => out.push_str(&DAYS[weekday][..3]),
            Some('%') => out.push('%'),
            Some(other) => {
                out.push('%');
                if !pad {
                    out.push('-');
                }
                out.push(other);
            }
            None => out.push('%'),
        }
    }
    out
}

/// Days since 1970-01-01 → (year, month 1..=12, day 1..=31), proleptic Gregorian.
fn civil_from_days(z: i64) -> (i64, i64, i64) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

fn days_from_civil(year: i64, month: i64, day: i64) -> i64 {
    let y = if month <= 2 { year - 1 } else { year };
    let era = y.div_euclid(400);
    let yoe = y.rem_euclid(400);
    let mp = if month > 2 { month - 3 } else { month + 9 };
    let doy = (153 * mp + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

#[cfg(test)]
mod tests {
    use super::*;

    const TINY: &str = include_str!("../../compiler/src/synth/chat_template.jinja");

    fn render(input_json: &str) -> String {
        let input: ChatInput = serde_json::from_str(input_json).expect("input JSON");
        ChatTemplate::from_source(TINY).expect("tiny template compiles").render(&input).expect("renders")
    }

    const SYSTEM_USER: &str = r#"{"messages": [{"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What is 2+2?"}]"#;

    #[test]
    fn system_and_user_with_generation_prompt() {
        assert_eq!(
            render(&format!("{SYSTEM_USER}}}")),
            "[gMASK]<sop><|system|>You are a helpful assistant.<|user|>What is 2+2?<|assistant|><think>"
        );
    }

    #[test]
    fn thinking_off_ends_with_a_closed_think() {
        let out = render(&format!(r#"{SYSTEM_USER}, "chat_template_kwargs": {{"enable_thinking": false}}}}"#));
        assert_eq!(out, "[gMASK]<sop><|system|>You are a helpful assistant.<|user|>What is 2+2?<|assistant|></think>");
        let out = render(&format!(r#"{SYSTEM_USER}, "add_generation_prompt": false}}"#));
        assert!(out.ends_with("What is 2+2?"), "{out}");
    }

    /// glm5.md §5.3, which Python jinja2 reproduces byte for byte from the tiny template with
    /// transformers' environment and a `json.dumps` tojson. Arguments arrive as a JSON string.
    #[test]
    fn tools_and_a_completed_tool_round_match_the_reference() {
        let expected = "[gMASK]<sop><|system|>\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{\"type\": \"function\", \"function\": {\"name\": \"get_weather\", \"description\": \"Get weather\", \"parameters\": {\"type\": \"object\", \"properties\": {\"city\": {\"type\": \"string\"}}, \"required\": [\"city\"]}}}\n</tools>\n\nFor each function call, output the function name and arguments within the following XML format:\n<tool_call>{function-name}<arg_key>{arg-key-1}</arg_key><arg_value>{arg-value-1}</arg_value><arg_key>{arg-key-2}</arg_key><arg_value>{arg-value-2}</arg_value>...</tool_call><|system|>You are a helpful assistant.<|user|>Weather in Paris?<|assistant|><think>Need the tool.</think><tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value></tool_call><|observation|><tool_response>{\"temp_c\": 18}</tool_response><|assistant|><think>";
        let body = r#"{"model": "glm-5", "stream": false,
          "messages": [
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": "", "reasoning_content": "Need the tool.",
             "tool_calls": [{"id": "call_1", "type": "function",
                             "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "{\"temp_c\": 18}"}],
          "tools": [{"type": "function", "function": {"name": "get_weather", "description": "Get weather",
                     "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]}"#;
        assert_eq!(render(body), expected);
        // Arguments already given as a mapping render the same.
        assert_eq!(render(&body.replace(r#""{\"city\": \"Paris\"}""#, r#"{"city": "Paris"}"#)), expected);
    }

    /// Content parts, history reasoning dropped before the last user turn, typed argument values
    /// through tojson (non-ASCII kept, Python float repr), grouped tool results. Expected text
    /// from Python jinja2 with the same environment.
    #[test]
    fn history_parts_and_typed_arguments_match_python() {
        let body = r#"{"messages": [
            {"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "image_url", "image_url": {"url": "x"}}, {"type": "text", "text": "there"}]},
            {"role": "assistant", "content": "  Hello!  ", "reasoning_content": "old thoughts"},
            {"role": "user", "content": "Plan a trip"},
            {"role": "assistant", "content": null, "reasoning_content": "  think more  ", "tool_calls": [
                {"id": "a", "type": "function", "function": {"name": "search",
                 "arguments": "{\"q\": \"café <b>\", \"n\": 3, \"opts\": {\"deep\": true, \"ratio\": 0.5, \"big\": 1e20, \"tags\": [\"é\", \"x\\\"y\"]}}"}},
                {"id": "b", "type": "function", "function": {"name": "noop", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "a", "content": "r1"},
            {"role": "tool", "tool_call_id": "b", "content": [{"type": "text", "text": "r2"}]}],
          "tools": [], "chat_template_kwargs": {"enable_thinking": false}}"#;
        let expected = "[gMASK]<sop><|user|>Hi there<|assistant|></think>Hello!<|user|>Plan a trip<|assistant|><think>think more</think><tool_call>search<arg_key>q</arg_key><arg_value>café <b></arg_value><arg_key>n</arg_key><arg_value>3</arg_value><arg_key>opts</arg_key><arg_value>{\"deep\": true, \"ratio\": 0.5, \"big\": 1e+20, \"tags\": [\"é\", \"x\\\"y\"]}</arg_value></tool_call><tool_call>noop</tool_call><|observation|><tool_response>r1</tool_response><tool_response>r2</tool_response><|assistant|></think>";
        assert_eq!(render(body), expected);
    }

    #[test]
    fn shared_across_threads_and_null_kwargs_accepted() {
        fn send_sync<T: Send + Sync>() {}
        send_sync::<ChatTemplate>();
        send_sync::<ChatInput>();
        let input: ChatInput = serde_json::from_str(r#"{"messages": [], "tools": null, "chat_template_kwargs": null}"#).unwrap();
        assert!(input.tools.is_none() && input.chat_template_kwargs.is_empty() && input.add_generation_prompt);
    }

    #[test]
    fn from_json_values_render_like_the_request_body() {
        let messages = serde_json::json!([{"role": "user", "content": "What is 2+2?"}]);
        let mut input = ChatInput::from_json(&messages, None);
        assert_eq!(input.enable_thinking(), None);
        assert_eq!(input.messages[0].to_json(), messages[0]);
        input.chat_template_kwargs.insert("enable_thinking".into(), serde_json::json!(false).into());
        assert_eq!(input.enable_thinking(), Some(false));
        let out = ChatTemplate::from_source(TINY).unwrap().render(&input).unwrap();
        assert_eq!(out, "[gMASK]<sop><|user|>What is 2+2?<|assistant|></think>");
    }

    fn tojson(template: &str, value: serde_json::Value) -> String {
        let t = ChatTemplate::from_source(template).unwrap();
        let input = ChatInput {
            messages: vec![],
            tools: Some(vec![value.into()]),
            add_generation_prompt: false,
            chat_template_kwargs: BTreeMap::new(),
        };
        t.render(&input).unwrap()
    }

    #[test]
    fn tojson_is_python_json_dumps() {
        // Keys in sorted order, so the expectations hold with serde_json's preserve_order
        // feature (which llguidance turns on) and without it.
        let v = serde_json::json!({"a": "é\u{1F600}<&>\u{1}\u{7f}", "b": [1, 2.0, -0.0, 1e-7, 123456.789, null], "c": {}, "d": []});
        assert_eq!(
            tojson("{{ tools[0] | tojson }}", v.clone()),
            "{\"a\": \"é😀<&>\\u0001\u{7f}\", \"b\": [1, 2.0, -0.0, 1e-07, 123456.789, null], \"c\": {}, \"d\": []}"
        );
        assert_eq!(
            tojson("{{ tools[0] | tojson(ensure_ascii=True) }}", v.clone()),
            r#"{"a": "\u00e9\ud83d\ude00<&>\u0001\u007f", "b": [1, 2.0, -0.0, 1e-07, 123456.789, null], "c": {}, "d": []}"#
        );
        assert_eq!(
            tojson("{{ tools[0] | tojson(indent=2) }}", serde_json::json!({"a": [1, {"x": true}], "e": {}})),
            "{\n  \"a\": [\n    1,\n    {\n      \"x\": true\n    }\n  ],\n  \"e\": {}\n}"
        );
        assert_eq!(
            tojson("{{ tools[0] | tojson(separators=(',', ':'), sort_keys=true) }}", serde_json::json!({"b": 1, "a": [1, 2]})),
            r#"{"a":[1,2],"b":1}"#
        );
        assert_eq!(tojson("{{ 'x' | tojson(false, 1) }}", serde_json::json!(null)), "\"x\"");
    }

    #[test]
    fn python_float_repr_matches_python() {
        let cases = [
            (1.0, "1.0"),
            (0.1, "0.1"),
            (1e16, "1e+16"),
            (1e15, "1000000000000000.0"),
            (0.0001, "0.0001"),
            (0.00001, "1e-05"),
            (12345678901234567.0, "1.2345678901234568e+16"),
            (-2.5e-300, "-2.5e-300"),
            (f64::INFINITY, "Infinity"),
        ];
        for (f, want) in cases {
            assert_eq!(python_float_repr(f), want, "{f}");
        }
    }

    #[test]
    fn key_order_is_kept_from_request_json() {
        let t = ChatTemplate::from_source("{{ messages[0] | tojson }}|{% for k, v in messages[0].items() %}{{ k }}{% endfor %}").unwrap();
        let input: ChatInput = serde_json::from_str(r#"{"messages": [{"z": 1, "a": 2, "m": 3}], "add_generation_prompt": false}"#).unwrap();
        assert_eq!(t.render(&input).unwrap(), r#"{"z": 1, "a": 2, "m": 3}|zam"#);
    }

    #[test]
    fn python_string_methods_and_helpers() {
        let t = ChatTemplate::from_source(
            "{{ ' a b '.strip() }}|{{ 'abc'.startswith('ab') }}|{{ 'x,y'.split(',') | join('+') }}|{{ 'A'.lower() }}|{% for i in [1,2,3] %}{% if i == 2 %}{% continue %}{% endif %}{{ i }}{% endfor %}|{{ bos_token is defined }}|{{ tools is none }}",
        )
        .unwrap();
        let input: ChatInput = serde_json::from_str(r#"{"messages": []}"#).unwrap();
        assert_eq!(t.render(&input).unwrap(), "a b|True|x+y|a|13|False|True");
        let year = ChatTemplate::from_source("{{ strftime_now('%Y') }}").unwrap().render(&input).unwrap();
        assert!(year.len() == 4 && year.starts_with('2'), "{year}");
    }

    #[test]
    fn strftime_formats_a_known_instant() {
        // 2024-02-29 13:05:09 UTC, a Thursday.
        let t = 1_709_211_909;
        assert_eq!(strftime_utc("%Y-%m-%d %H:%M:%S", t), "2024-02-29 13:05:09");
        assert_eq!(strftime_utc("%d %b %Y, %A %a %B %j %I%p %-d %-m %y %% %Q", t), "29 Feb 2024, Thursday Thu February 060 01PM 29 2 24 % %Q");
        assert_eq!(strftime_utc("%Y-%m-%d", 0), "1970-01-01");
    }

    #[test]
    fn errors_name_the_problem() {
        let input: ChatInput = serde_json::from_str(r#"{"messages": []}"#).unwrap();
        let t = ChatTemplate::from_source("a\n{% if true %}{{ raise_exception('System role not supported') }}{% endif %}").unwrap();
        match t.render(&input) {
            Err(ChatTemplateError::Raised(msg)) => assert_eq!(msg, "System role not supported"),
            other => panic!("{other:?}"),
        }
        match ChatTemplate::from_source("line one\n{% if %}\n") {
            Err(e @ ChatTemplateError::Syntax { line: Some(2), .. }) => assert!(e.to_string().contains("line 2"), "{e}"),
            Err(e) => panic!("{e:?}"),
            Ok(_) => panic!("a syntax error compiled"),
        }
        let t = ChatTemplate::from_source("{{ messages | tojson }}{{ 1 / 0 }}").unwrap();
        assert!(matches!(t.render(&input), Err(ChatTemplateError::Render { .. })));
    }

    #[test]
    fn loads_from_an_artifact_dir() {
        let dir = std::env::temp_dir().join(format!("kiln-chat-template-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        assert!(matches!(ChatTemplate::from_dir(&dir), Err(ChatTemplateError::Missing { .. })));
        let input: ChatInput = serde_json::from_str(r#"{"messages": [], "tools": []}"#).unwrap();

        let config = serde_json::json!({"bos_token": {"content": "<s>"}, "eos_token": "</s>",
            "chat_template": [{"name": "tool_use", "template": "T{{ eos_token }}"}, {"name": "default", "template": "D{{ bos_token }}"}]});
        std::fs::write(dir.join("tokenizer_config.json"), config.to_string()).unwrap();
        let t = ChatTemplate::from_dir(&dir).unwrap();
        assert_eq!(t.render(&input).unwrap(), "T</s>");
        assert_eq!(t.render(&ChatInput { tools: None, ..input.clone() }).unwrap(), "D<s>");

        std::fs::write(dir.join("tokenizer_config.json"), r#"{"chat_template": "S{{ add_generation_prompt }}"}"#).unwrap();
        assert_eq!(ChatTemplate::from_dir(&dir).unwrap().render(&input).unwrap(), "STrue");

        std::fs::write(dir.join("chat_template.jinja"), "J\n").unwrap();
        assert_eq!(ChatTemplate::from_dir(&dir).unwrap().render(&input).unwrap(), "J");

        std::fs::write(dir.join("chat_template.jinja"), "{% for %}").unwrap();
        assert!(matches!(ChatTemplate::from_dir(&dir), Err(ChatTemplateError::Syntax { .. })));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
