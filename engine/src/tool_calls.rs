//! Parses GLM-4.7/GLM-5 tool calls out of the content, incrementally (SGLang/vLLM `glm47`):
//! `<tool_call>NAME<arg_key>K</arg_key><arg_value>V</arg_value>...</tool_call>`, several in a
//! row, `<tool_call>NAME</tool_call>` for no arguments, whitespace allowed between tags.
//!
//! Where SGLang's and vLLM's glm47 parsers differ, kiln follows SGLang:
//! - a call to a tool the request does not list is dropped (vLLM returns it), and nothing of it
//!   is streamed: its name is checked before its start is emitted;
//! - the content is all the text outside calls, joined as written, with the whitespace at its
//!   two ends dropped once a call was made (vLLM keeps only the text before the first call,
//!   unstripped); without a call the content is untouched;
//! - a non-string value holding escaped JSON (`[{\"id\": 1}]`) is decoded twice, as SGLang
//!   falls back; vLLM would keep the text as a string.
//!
//! Like vLLM, a `string` parameter's text is kept verbatim, quotes included (SGLang strips one
//! pair of matching outer quotes); that is what lets string values stream as they arrive.
//!
//! The model writes values as bare text, so the tool's JSON schema decides their type: a
//! `string` parameter keeps the text (streamed as it arrives); anything else is parsed as JSON
//! (`42`, `true`, `{"a": 1}`), falling back to the text. Keys, names and values are stripped of
//! surrounding whitespace, as vLLM and SGLang do.
//!
//! One state machine serves streaming and one-shot parsing, and holds back only what could still
//! turn into a tag, so the result does not depend on how the text is cut into deltas (merged
//! multi-token deltas broke buffer-based GLM parsers elsewhere). A call's start is emitted once
//! its name is complete; its argument deltas concatenate to its final `arguments` string.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;

use serde_json::Value;

use crate::reasoning::{held_suffix, ReasoningParser};

const CALL_START: &str = "<tool_call>";
const CALL_END: &str = "</tool_call>";
const KEY_START: &str = "<arg_key>";
const KEY_END: &str = "</arg_key>";
const VALUE_START: &str = "<arg_value>";
const VALUE_END: &str = "</arg_value>";
/// Longer "names" are prose after a stray `<tool_call>`.
const MAX_NAME_BYTES: usize = 128;

/// A finished call, in OpenAI terms.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ToolCall {
    /// `call_` + 22 base-62 characters, unique within the process.
    pub id: String,
    pub name: String,
    /// A compact JSON object, keys in the order the model wrote them.
    pub arguments: String,
}

impl ToolCall {
    /// `{"id", "type": "function", "function": {"name", "arguments"}}`.
    pub fn to_openai_json(&self) -> Value {
        serde_json::json!({
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        })
    }
}

/// Streaming progress of the calls; `index` counts the calls of this output from 0.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ToolCallEvent {
    /// The name is complete: send `{index, id, type: "function", function: {name}}`.
    Start { index: usize, id: String, name: String },
    /// The next piece of the call's `arguments` string.
    Arguments { index: usize, delta: String },
    /// The call is closed (its arguments end with `}`).
    End { index: usize },
}

/// What one push produced.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ToolDelta {
    pub content: String,
    pub calls: Vec<ToolCallEvent>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Text,
    Name,
    /// After the name or a value: waiting for `<arg_key>` or `</tool_call>`.
    Between,
    Key,
    /// After `</arg_key>`: waiting for `<arg_value>`.
    AfterKey,
    Value,
}

impl State {
    /// The tags that mean something in this state; anything else is text (so a string value may
    /// contain `<`, even `<arg_key>`).
    fn tags(self) -> &'static [&'static str] {
        match self {
            State::Text => &[CALL_START],
            State::Name | State::Between => &[KEY_START, CALL_END],
            State::Key => &[KEY_END],
            State::AfterKey => &[VALUE_START, CALL_END],
            State::Value => &[VALUE_END],
        }
    }
}

enum ValueText {
    /// A `string` parameter, streamed as it comes: leading whitespace skipped, trailing
    /// whitespace held until more text follows it.
    Streamed { started: bool, trailing_ws: String },
    /// Anything else, typed once complete.
    Whole(String),
}

struct OpenCall {
    index: usize,
    id: String,
    name: String,
    arguments: String,
    pairs: usize,
}

pub struct ToolCallParser {
    /// Tool name → its `parameters` schema.
    schemas: Vec<(String, Value)>,
    state: State,
    pending: String,
    /// Whitespace at the end of the content so far: emitted when more content follows it,
    /// dropped at the end of an output that made a call.
    trailing_ws: String,
    /// A complete call name was seen (kept or dropped): the content's ends are trimmed.
    seen_call: bool,
    /// Content other than whitespace was emitted.
    emitted: bool,
    /// The text of a call whose name is not complete: content again if the output ends there.
    raw_call: String,
    name: String,
    /// Whitespace followed the name: only whitespace and a tag may come now.
    name_done: bool,
    key: String,
    key_types: Vec<String>,
    value: ValueText,
    open: Option<OpenCall>,
    calls: Vec<ToolCall>,
}

impl ToolCallParser {
    /// `tools`: the request's `tools` entries (`{type: "function", function: {name,
    /// parameters}}`, or the bare function objects). Calls to tools not listed are dropped.
    pub fn new(tools: &[Value]) -> ToolCallParser {
        let schemas = tools
            .iter()
            .filter_map(|t| {
                let f = t.get("function").unwrap_or(t);
                let name = f.get("name")?.as_str()?.to_string();
                Some((name, f.get("parameters").cloned().unwrap_or(Value::Null)))
            })
            .collect();
        ToolCallParser {
            schemas,
            state: State::Text,
            pending: String::new(),
            trailing_ws: String::new(),
            seen_call: false,
            emitted: false,
            raw_call: String::new(),
            name: String::new(),
            name_done: false,
            key: String::new(),
            key_types: Vec::new(),
            value: ValueText::Whole(String::new()),
            open: None,
            calls: Vec::new(),
        }
    }

    /// The calls closed so far (all of them after [`finish`](Self::finish)).
    pub fn calls(&self) -> &[ToolCall] {
        &self.calls
    }

    pub fn push(&mut self, text: &str) -> ToolDelta {
        self.pending.push_str(text);
        let mut out = ToolDelta::default();
        self.drain(&mut out, false);
        out
    }

    /// Flushes what is held back and closes a call cut off by the end of generation (with the
    /// arguments complete so far; a name never completed is given back as content).
    pub fn finish(&mut self) -> ToolDelta {
        let mut out = ToolDelta::default();
        self.drain(&mut out, true);
        match self.state {
            State::Text | State::Name => {
                if self.state == State::Name {
                    self.abandon_call(&mut out);
                }
                if !self.seen_call {
                    out.content.push_str(&self.trailing_ws);
                }
                self.trailing_ws.clear();
            }
            State::Between | State::Key | State::AfterKey => self.end_call(&mut out),
            State::Value => {
                self.end_value(&mut out);
                self.end_call(&mut out);
            }
        }
        self.state = State::Text;
        out
    }

    fn drain(&mut self, out: &mut ToolDelta, last: bool) {
        loop {
            let tags = self.state.tags();
            let found = tags.iter().filter_map(|t| self.pending.find(t).map(|i| (i, *t))).min_by_key(|&(i, _)| i);
            let end = match found {
                Some((at, _)) => at,
                None => self.pending.len() - if last { 0 } else { held_suffix(&self.pending, tags) },
            };
            let text = self.pending[..end].to_string();
            let used = self.text(&text, out);
            self.pending.drain(..used);
            if used < end {
                continue; // the state changed inside the text: scan the rest again
            }
            let Some((_, tag)) = found else { return };
            if self.state == State::Name && self.name.is_empty() {
                self.abandon_call(out); // `<tool_call>` with no name: not a call
                continue;
            }
            self.pending.drain(..tag.len());
            self.tag(tag, out);
        }
    }

    /// Handles `text` in the current state; returns how much of it was used, less than all only
    /// when the state changed part-way.
    fn text(&mut self, text: &str, out: &mut ToolDelta) -> usize {
        match self.state {
            State::Text => self.content(text, out),
            State::Name => return self.name_text(text, out),
            State::Between | State::AfterKey => {} // stray text between tags carries nothing
            State::Key => self.key.push_str(text),
            State::Value => match &mut self.value {
                ValueText::Whole(v) => v.push_str(text),
                ValueText::Streamed { started, trailing_ws } => {
                    let mut piece = String::new();
                    for c in text.chars() {
                        if !*started && c.is_whitespace() {
                            continue;
                        }
                        *started = true;
                        if c.is_whitespace() {
                            trailing_ws.push(c);
                        } else {
                            piece.push_str(trailing_ws);
                            trailing_ws.clear();
                            piece.push(c);
                        }
                    }
                    if !piece.is_empty() {
                        let escaped = json_string(&piece);
                        self.arguments(&escaped[1..escaped.len() - 1], out);
                    }
                }
            },
        }
        text.len()
    }

    /// A function name: optional whitespace, then letters, digits and `_-.:`, then optional
    /// whitespace. Anything else (prose, a JSON-style call) means the `<tool_call>` did not open a
    /// call in this format: it becomes content, so content is never held back for long.
    fn name_text(&mut self, text: &str, out: &mut ToolDelta) -> usize {
        for (i, c) in text.char_indices() {
            let name_char = c.is_alphanumeric() || "_-.:".contains(c);
            let fits = if c.is_whitespace() {
                true
            } else {
                name_char && !self.name_done && self.name.len() < MAX_NAME_BYTES
            };
            if !fits {
                self.abandon_call(out);
                return i;
            }
            self.raw_call.push(c);
            if c.is_whitespace() {
                self.name_done |= !self.name.is_empty();
            } else {
                self.name.push(c);
            }
        }
        text.len()
    }

    /// Gives the text of a call that turned out not to be one back as content.
    fn abandon_call(&mut self, out: &mut ToolDelta) {
        let raw = std::mem::take(&mut self.raw_call);
        self.state = State::Text;
        self.content(&raw, out);
    }

    /// Content, holding back trailing whitespace; after a call and before any content, leading
    /// whitespace is dropped.
    fn content(&mut self, text: &str, out: &mut ToolDelta) {
        let text = if self.seen_call && !self.emitted { text.trim_start() } else { text };
        self.trailing_ws.push_str(text);
        let body = self.trailing_ws.trim_end().len();
        let ws = self.trailing_ws.split_off(body);
        let piece = std::mem::replace(&mut self.trailing_ws, ws);
        self.emitted |= !piece.is_empty();
        out.content.push_str(&piece);
    }

    fn tag(&mut self, tag: &str, out: &mut ToolDelta) {
        self.state = match (self.state, tag) {
            (State::Text, CALL_START) => {
                self.raw_call = CALL_START.to_string();
                self.name.clear();
                self.name_done = false;
                State::Name
            }
            (State::Name, KEY_START) => {
                self.start_call(out);
                self.key.clear();
                State::Key
            }
            (State::Name, CALL_END) => {
                self.start_call(out);
                self.end_call(out);
                State::Text
            }
            (State::Between, KEY_START) => {
                self.key.clear();
                State::Key
            }
            (State::Between | State::AfterKey, CALL_END) => {
                self.end_call(out);
                State::Text
            }
            (State::Key, KEY_END) => State::AfterKey,
            (State::AfterKey, VALUE_START) => {
                self.start_value(out);
                State::Value
            }
            (State::Value, VALUE_END) => {
                self.end_value(out);
                State::Between
            }
            (state, _) => state, // unreachable: `tags()` lists only the tags handled above
        };
    }

    /// The name is complete: opens the call, or, for a tool the request does not list, parses
    /// the rest of it with nothing emitted (`open` stays empty).
    fn start_call(&mut self, out: &mut ToolDelta) {
        self.seen_call = true;
        if !self.emitted {
            self.trailing_ws.clear(); // the content starts after the call
        }
        self.raw_call.clear();
        let name = self.name.trim();
        if !self.schemas.iter().any(|(n, _)| n == name) {
            return;
        }
        let call = OpenCall {
            index: self.calls.len(),
            id: new_call_id(),
            name: name.to_string(),
            arguments: String::new(),
            pairs: 0,
        };
        out.calls.push(ToolCallEvent::Start { index: call.index, id: call.id.clone(), name: call.name.clone() });
        self.open = Some(call);
        self.arguments("{", out);
    }

    fn end_call(&mut self, out: &mut ToolDelta) {
        self.arguments("}", out);
        if let Some(call) = self.open.take() {
            out.calls.push(ToolCallEvent::End { index: call.index });
            self.calls.push(ToolCall { id: call.id, name: call.name, arguments: call.arguments });
        }
    }

    fn start_value(&mut self, out: &mut ToolDelta) {
        let key = self.key.trim().to_string();
        let name = self.open.as_ref().map(|c| c.name.as_str()).unwrap_or_default();
        self.key_types = self.arg_types(name, &key);
        self.key = key;
        if string_only(&self.key_types) {
            let head = format!("{}{}:\"", self.separator(), json_string(&self.key));
            self.arguments(&head, out);
            self.value = ValueText::Streamed { started: false, trailing_ws: String::new() };
        } else {
            self.value = ValueText::Whole(String::new());
        }
    }

    fn end_value(&mut self, out: &mut ToolDelta) {
        match std::mem::replace(&mut self.value, ValueText::Whole(String::new())) {
            ValueText::Streamed { .. } => self.arguments("\"", out),
            ValueText::Whole(raw) => {
                let value = typed_json(raw.trim(), &self.key_types);
                let pair = format!("{}{}:{}", self.separator(), json_string(&self.key), value);
                self.arguments(&pair, out);
            }
        }
    }

    /// `,` before every pair but the first; counts the pair.
    fn separator(&mut self) -> &'static str {
        match &mut self.open {
            Some(call) => {
                call.pairs += 1;
                if call.pairs == 1 { "" } else { "," }
            }
            None => "",
        }
    }

    fn arguments(&mut self, delta: &str, out: &mut ToolDelta) {
        let Some(call) = &mut self.open else { return };
        call.arguments.push_str(delta);
        if let Some(ToolCallEvent::Arguments { index, delta: last }) = out.calls.last_mut() {
            if *index == call.index {
                last.push_str(delta);
                return;
            }
        }
        out.calls.push(ToolCallEvent::Arguments { index: call.index, delta: delta.to_string() });
    }

    /// The JSON types the schema allows for `key` of tool `name`, following `$ref`,
    /// `anyOf`/`oneOf`/`allOf` and, without a `type`, `enum`/`const`. Empty: unknown.
    fn arg_types(&self, name: &str, key: &str) -> Vec<String> {
        let mut types = Vec::new();
        if let Some((_, params)) = self.schemas.iter().find(|(n, _)| n == name) {
            if let Some(schema) = params.get("properties").and_then(|p| p.get(key)) {
                collect_types(schema, params, 0, &mut types);
            }
        }
        types
    }
}

fn collect_types(schema: &Value, root: &Value, depth: usize, out: &mut Vec<String>) {
    if depth > 16 {
        return;
    }
    let mut push = |t: &str| {
        if !out.iter().any(|x| x == t) {
            out.push(t.to_string());
        }
    };
    match schema.get("type") {
        Some(Value::String(t)) => push(t),
        Some(Value::Array(ts)) => ts.iter().filter_map(Value::as_str).for_each(&mut push),
        _ => {
            if let Some(Value::Array(values)) = schema.get("enum") {
                values.iter().for_each(|v| push(json_type(v)));
            }
            if let Some(v) = schema.get("const") {
                push(json_type(v));
            }
        }
    }
    if let Some(target) = schema.get("$ref").and_then(Value::as_str).and_then(|r| r.strip_prefix('#')).and_then(|p| root.pointer(p)) {
        collect_types(target, root, depth + 1, out);
    }
    for combinator in ["anyOf", "oneOf", "allOf"] {
        if let Some(Value::Array(subs)) = schema.get(combinator) {
            for sub in subs {
                collect_types(sub, root, depth + 1, out);
            }
        }
    }
}

fn json_type(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "boolean",
        Value::Number(n) if n.is_f64() => "number",
        Value::Number(_) => "integer",
        Value::String(_) => "string",
        Value::Array(_) => "array",
        Value::Object(_) => "object",
    }
}

/// Whether a parameter with `schema` (inside the tool's `root` parameters, for `$ref`) is kept
/// as raw text: the constrained-decoding grammar writes such values raw too.
pub(crate) fn keeps_raw_text(schema: &Value, root: &Value) -> bool {
    let mut types = Vec::new();
    collect_types(schema, root, 0, &mut types);
    string_only(&types)
}

/// Only `string` (and maybe `null`): the text is the value, never parsed.
fn string_only(types: &[String]) -> bool {
    let mut non_null = types.iter().filter(|t| *t != "null").peekable();
    non_null.peek().is_some() && non_null.all(|t| t == "string")
}

/// The JSON text of a non-string (or unknown) parameter written as `raw`. JSON the model wrote
/// is kept as written, only compacted, so nested objects keep their key order.
fn typed_json(raw: &str, types: &[String]) -> String {
    let has = |t: &str| types.iter().any(|x| x == t);
    let integer_only = has("integer") && !has("number");
    let parsed = match serde_json::from_str::<Value>(raw) {
        Ok(v) => Some((v, compact_json(raw))),
        Err(_) => match raw {
            // Python literals, which vLLM accepts through `ast.literal_eval`.
            "True" => Some((Value::Bool(true), "true".to_string())),
            "False" => Some((Value::Bool(false), "false".to_string())),
            "None" => Some((Value::Null, "null".to_string())),
            // JSON written with its quotes escaped, as inside a JSON string: decode it twice.
            _ => serde_json::from_str::<String>(&format!("\"{raw}\""))
                .ok()
                .and_then(|once| serde_json::from_str::<Value>(&once).ok().map(|v| (v, compact_json(&once)))),
        },
    };
    let fits = |v: &Value| {
        let t = json_type(v);
        types.is_empty() || has(t) || (t == "integer" && has("number")) || (t == "number" && has("integer") && is_integral(v))
    };
    let as_string = || Value::String(raw.to_string()).to_string();
    match parsed {
        Some((v, text)) if fits(&v) => match v {
            Value::Number(_) if integer_only => number(&text, true).map(|n| n.to_string()).unwrap_or(text),
            _ => text,
        },
        Some((Value::String(s), _)) if has("number") || has("integer") => match number(s.trim(), integer_only) {
            Some(n) => n.to_string(),
            None if has("string") => as_string(),
            None => Value::String(s).to_string(),
        },
        _ if types.is_empty() || has("string") => as_string(),
        Some((_, text)) => text,
        None => number(raw, integer_only).map(|n| n.to_string()).unwrap_or_else(as_string),
    }
}

/// Valid JSON text without the whitespace outside its strings.
fn compact_json(json: &str) -> String {
    let mut out = String::with_capacity(json.len());
    let (mut in_string, mut escaped) = (false, false);
    for c in json.chars() {
        if in_string {
            out.push(c);
            if escaped {
                escaped = false;
            } else if c == '\\' {
                escaped = true;
            } else if c == '"' {
                in_string = false;
            }
        } else if !c.is_ascii_whitespace() {
            in_string = c == '"';
            out.push(c);
        }
    }
    out
}

fn is_integral(v: &Value) -> bool {
    v.as_f64().is_some_and(|f| f.fract() == 0.0 && f.abs() < 9.0e15)
}

/// A finite number written as `s` (Python `float()` syntax), as an integer where asked and
/// exact.
fn number(s: &str, integer: bool) -> Option<Value> {
    if let Ok(i) = s.parse::<i64>() {
        return Some(Value::from(i));
    }
    let f: f64 = s.parse().ok().filter(|f: &f64| f.is_finite())?;
    if integer && f.fract() == 0.0 && f.abs() < 9.0e15 {
        return Some(Value::from(f as i64));
    }
    serde_json::Number::from_f64(f).map(Value::Number)
}

fn json_string(s: &str) -> String {
    Value::String(s.to_string()).to_string()
}

/// `call_` + 22 base-62 characters. The first half is a bijection of a process-wide counter
/// (unique within the process), the second half is seeded by time and pid (distinct across
/// restarts).
fn new_call_id() -> String {
    static STATE: OnceLock<AtomicU64> = OnceLock::new();
    let state = STATE.get_or_init(|| {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(0);
        AtomicU64::new(nanos ^ (u64::from(std::process::id()) << 40))
    });
    let x = state.fetch_add(0x9E37_79B9_7F4A_7C15, Ordering::Relaxed);
    let mut id = String::from("call_");
    for mut v in [mix(x), mix(x ^ 0xD6E8_FEB8_6659_FD93)] {
        for _ in 0..11 {
            id.push(b"0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"[(v % 62) as usize] as char);
            v /= 62;
        }
    }
    id
}

/// The SplitMix64 finaliser: a bijection on u64.
fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Per request: the model's text → reasoning, content and tool calls (reasoning parser first,
/// then the tool-call parser on the content side).
pub struct OutputParser {
    reasoning: ReasoningParser,
    tools: Option<ToolCallParser>,
}

/// What one push produced, ready for a chat-completion chunk (`reasoning_content`, `content`,
/// `tool_calls`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct OutputDelta {
    pub reasoning: String,
    pub content: String,
    pub tool_calls: Vec<ToolCallEvent>,
}

impl OutputDelta {
    pub fn is_empty(&self) -> bool {
        self.reasoning.is_empty() && self.content.is_empty() && self.tool_calls.is_empty()
    }
}

/// A whole response. Empty `content` is reported as `null`; a non-empty `tool_calls` means
/// `finish_reason: "tool_calls"`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ParsedOutput {
    pub reasoning: String,
    pub content: String,
    pub tool_calls: Vec<ToolCall>,
}

impl OutputParser {
    /// `thinking`: the prompt ended in `<think>` (see [`ReasoningParser::new`]). `tools`: the
    /// request's tools, or `None` when there are none or `tool_choice` is `"none"` (then calls
    /// are not parsed and stay content).
    pub fn new(thinking: bool, tools: Option<&[Value]>) -> OutputParser {
        OutputParser { reasoning: ReasoningParser::new(thinking), tools: tools.map(ToolCallParser::new) }
    }

    /// Whether text pushed now would be reasoning: ask before pushing a token's text to count
    /// reasoning tokens.
    pub fn in_reasoning(&self) -> bool {
        self.reasoning.in_reasoning()
    }

    pub fn push(&mut self, text: &str) -> OutputDelta {
        let split = self.reasoning.push(text);
        self.route(split.reasoning, &split.content, false)
    }

    /// Call once at the end of generation.
    pub fn finish(&mut self) -> OutputDelta {
        let split = self.reasoning.finish();
        self.route(split.reasoning, &split.content, true)
    }

    /// The calls closed so far (all of them after [`finish`](Self::finish)).
    pub fn tool_calls(&self) -> &[ToolCall] {
        self.tools.as_ref().map(|t| t.calls()).unwrap_or_default()
    }

    /// Non-streaming: one push and finish.
    pub fn parse(text: &str, thinking: bool, tools: Option<&[Value]>) -> ParsedOutput {
        let mut parser = OutputParser::new(thinking, tools);
        let mut all = parser.push(text);
        let rest = parser.finish();
        all.reasoning.push_str(&rest.reasoning);
        all.content.push_str(&rest.content);
        ParsedOutput { reasoning: all.reasoning, content: all.content, tool_calls: parser.tool_calls().to_vec() }
    }

    fn route(&mut self, reasoning: String, content: &str, last: bool) -> OutputDelta {
        let Some(tools) = &mut self.tools else {
            return OutputDelta { reasoning, content: content.to_string(), tool_calls: Vec::new() };
        };
        let mut delta = tools.push(content);
        if last {
            let rest = tools.finish();
            delta.content.push_str(&rest.content);
            delta.calls.extend(rest.calls);
        }
        OutputDelta { reasoning, content: delta.content, tool_calls: delta.calls }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kiln_runtime::rng::Rng;

    /// Content, and (name, arguments) of each call.
    type Parsed = (String, Vec<(String, String)>);

    /// Feeds `text` cut at `cuts` and checks the streaming contract: a start per call before its
    /// argument deltas, deltas that concatenate to the final arguments, an end, valid JSON.
    fn run(text: &str, tools: &[Value], cuts: &[usize]) -> Parsed {
        let mut p = ToolCallParser::new(tools);
        let mut content = String::new();
        let mut events = Vec::new();
        let mut from = 0;
        for &cut in cuts.iter().chain(std::iter::once(&text.len())) {
            let d = p.push(&text[from..cut]);
            content += &d.content;
            events.extend(d.calls);
            from = cut;
        }
        let d = p.finish();
        content += &d.content;
        events.extend(d.calls);
        check_events(&events, p.calls());
        (content, p.calls().iter().map(|c| (c.name.clone(), c.arguments.clone())).collect())
    }

    fn check_events(events: &[ToolCallEvent], calls: &[ToolCall]) {
        let mut streamed: Vec<(String, String, String, bool)> = Vec::new(); // id, name, args, ended
        for e in events {
            match e {
                ToolCallEvent::Start { index, id, name } => {
                    assert_eq!(*index, streamed.len(), "calls start in order");
                    streamed.push((id.clone(), name.clone(), String::new(), false));
                }
                ToolCallEvent::Arguments { index, delta } => {
                    let s = streamed.get_mut(*index).expect("arguments after start");
                    assert!(!s.3, "arguments after end");
                    s.2 += delta;
                }
                ToolCallEvent::End { index } => streamed[*index].3 = true,
            }
        }
        assert_eq!(streamed.len(), calls.len());
        for (s, c) in streamed.iter().zip(calls) {
            assert_eq!((&s.0, &s.1, &s.2, s.3), (&c.id, &c.name, &c.arguments, true));
            let args: Value = serde_json::from_str(&c.arguments).unwrap_or_else(|e| panic!("{e}: {}", c.arguments));
            assert!(args.is_object(), "{}", c.arguments);
            assert!(c.id.starts_with("call_") && c.id.len() == 27, "{}", c.id);
        }
    }

    /// The one-push result, checked against every split point and char-by-char feeding.
    fn parse(text: &str, tools: &[Value]) -> Parsed {
        let whole = run(text, tools, &[]);
        let bounds: Vec<usize> = (1..text.len()).filter(|&i| text.is_char_boundary(i)).collect();
        for &i in &bounds {
            assert_eq!(run(text, tools, &[i]), whole, "split at {i} of {text:?}");
        }
        assert_eq!(run(text, tools, &bounds), whole, "char by char: {text:?}");
        whole
    }

    fn calls(list: &[(&str, &str)]) -> Vec<(String, String)> {
        list.iter().map(|(n, a)| (n.to_string(), a.to_string())).collect()
    }

    fn weather_tools() -> Vec<Value> {
        vec![
            serde_json::json!({"type": "function", "function": {"name": "get_weather", "description": "Get weather",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}, "required": ["city"]}}}),
            serde_json::json!({"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}}}}),
        ]
    }

    /// Tools with these names and no parameters.
    fn named(names: &[&str]) -> Vec<Value> {
        names.iter().map(|n| serde_json::json!({"type": "function", "function": {"name": n}})).collect()
    }

    #[test]
    fn a_single_call() {
        let text = "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value></tool_call>";
        assert_eq!(parse(text, &weather_tools()), (String::new(), calls(&[("get_weather", r#"{"city":"Paris"}"#)])));
    }

    #[test]
    fn two_calls_with_whitespace_between_tags() {
        let text = "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>São Paulo</arg_value>\n<arg_key> days </arg_key> <arg_value> 3 </arg_value>\n</tool_call>\n<tool_call>get_time<arg_key>tz</arg_key><arg_value>CET</arg_value></tool_call>\n";
        assert_eq!(
            parse(text, &weather_tools()),
            (String::new(), calls(&[("get_weather", r#"{"city":"São Paulo","days":3}"#), ("get_time", r#"{"tz":"CET"}"#)]))
        );
    }

    #[test]
    fn zero_argument_calls() {
        let tools = named(&["list_files", "ping", "pong"]);
        assert_eq!(parse("<tool_call>list_files</tool_call>", &tools), (String::new(), calls(&[("list_files", "{}")])));
        assert_eq!(
            parse("Sure.<tool_call>ping</tool_call><tool_call> pong \n</tool_call>", &tools),
            ("Sure.".into(), calls(&[("ping", "{}"), ("pong", "{}")]))
        );
    }

    #[test]
    fn content_around_calls() {
        let text = "Let me check the weather.\n\n<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value></tool_call>\nDone.";
        // The text outside calls, joined as written; its two ends trimmed (SGLang's glm47).
        assert_eq!(
            parse(text, &weather_tools()),
            ("Let me check the weather.\n\n\nDone.".into(), calls(&[("get_weather", r#"{"city":"Paris"}"#)]))
        );
        let tools = named(&["noop"]);
        let noop = "<tool_call>noop</tool_call>";
        assert_eq!(parse(&format!("Let me check. {noop}"), &tools), ("Let me check.".into(), calls(&[("noop", "{}")])));
        assert_eq!(
            parse(&format!("{noop} middle {noop} tail"), &tools),
            ("middle  tail".into(), calls(&[("noop", "{}"), ("noop", "{}")]))
        );
        assert_eq!(
            parse(&format!("Before: {noop} Between: {noop}{noop} After."), &tools).0,
            "Before:  Between:  After."
        );
        assert_eq!(parse(&format!("  \n  {noop}\n"), &tools), (String::new(), calls(&[("noop", "{}")])));
        // No call: content untouched, `<` that starts no tag included.
        assert_eq!(
            parse("  if a < b then <tool_ and </tool_call>\n", &[]),
            ("  if a < b then <tool_ and </tool_call>\n".into(), vec![])
        );
    }

    #[test]
    fn values_are_typed_by_the_schema() {
        let tools = vec![serde_json::json!({"type": "function", "function": {"name": "t", "parameters": {
            "type": "object",
            "$defs": {"Level": {"type": "integer"}},
            "properties": {
                "count": {"type": "integer"}, "ratio": {"type": "number"}, "flag": {"type": "boolean"},
                "tags": {"type": "array", "items": {"type": "string"}}, "opts": {"type": "object"},
                "code": {"type": "string"}, "note": {"anyOf": [{"type": "string"}, {"type": "null"}]},
                "level": {"$ref": "#/$defs/Level"}, "mode": {"enum": ["fast", "slow"]},
                "limit": {"oneOf": [{"type": "integer"}, {"type": "null"}]}, "scale": {"type": "number"},
                "maybe": {"type": ["integer", "string"]}
            }}}})];
        let text = concat!(
            "<tool_call>t",
            "<arg_key>count</arg_key><arg_value>42</arg_value>",
            "<arg_key>ratio</arg_key><arg_value>\"0.5\"</arg_value>",
            "<arg_key>flag</arg_key><arg_value>True</arg_value>",
            "<arg_key>tags</arg_key><arg_value>[\"a\", \"b <c>\"]</arg_value>",
            "<arg_key>opts</arg_key><arg_value>{\"z\": {\"max\": 3}, \"a\": [1, {\"y\": null}], \"s\": \"x  y\"}</arg_value>",
            "<arg_key>code</arg_key><arg_value>\nif a < b and c > d: print(\"<b>\\n\") </arg_key> <arg_value> done\n</arg_value>",
            "<arg_key>note</arg_key><arg_value>  42  </arg_value>",
            "<arg_key>level</arg_key><arg_value>7.0</arg_value>",
            "<arg_key>mode</arg_key><arg_value>fast</arg_value>",
            "<arg_key>limit</arg_key><arg_value>null</arg_value>",
            "<arg_key>scale</arg_key><arg_value>1e3</arg_value>",
            "<arg_key>maybe</arg_key><arg_value>abc</arg_value>",
            "<arg_key>extra</arg_key><arg_value>{\"a\":1}</arg_value>",
            "<arg_key>other</arg_key><arg_value>hello world</arg_value>",
            "<arg_key>num</arg_key><arg_value>-1.5</arg_value>",
            "</tool_call>"
        );
        let (content, found) = parse(text, &tools);
        assert_eq!(content, "");
        let expected = concat!(
            r#"{"count":42,"ratio":0.5,"flag":true,"tags":["a","b <c>"],"opts":{"z":{"max":3},"a":[1,{"y":null}],"s":"x  y"},"#,
            r#""code":"if a < b and c > d: print(\"<b>\\n\") </arg_key> <arg_value> done","note":"42","level":7,"mode":"fast","#,
            r#""limit":null,"scale":1e3,"maybe":"abc","extra":{"a":1},"other":"hello world","num":-1.5}"#
        );
        assert_eq!(found, calls(&[("t", expected)]));
    }

    #[test]
    fn what_is_not_a_call_stays_content() {
        let tools = named(&["f"]);
        for text in [
            "<tool_call>{\"name\": \"f\", \"arguments\": {}}</tool_call>",
            "Use <tool_call> tags like this.",
            "<tool_call></tool_call>",
            "<tool_call>get weather<arg_key>a</arg_key></tool_call>",
            "<tool_call>f<b>x</b></tool_call>",
        ] {
            assert_eq!(parse(text, &tools), (text.to_string(), vec![]), "{text}");
        }
        let long = format!("<tool_call>{}</tool_call>", "n".repeat(MAX_NAME_BYTES + 1));
        assert_eq!(parse(&long, &tools), (long.clone(), vec![]));
        // A real call after a false start.
        assert_eq!(
            parse("<tool_call>oops <tool_call>f</tool_call>", &tools),
            ("<tool_call>oops".into(), calls(&[("f", "{}")]))
        );
    }

    #[test]
    fn cut_off_output() {
        let tools = weather_tools();
        // A name never completed is content again.
        assert_eq!(parse("Checking. <tool_call>get_wea", &tools), ("Checking. <tool_call>get_wea".into(), vec![]));
        // A call whose name is complete is closed with the arguments finished so far.
        assert_eq!(
            parse("<tool_call>get_weather<arg_key>city</arg_key><arg_value>New Yo", &tools),
            (String::new(), calls(&[("get_weather", r#"{"city":"New Yo"}"#)]))
        );
        assert_eq!(
            parse("<tool_call>get_weather<arg_key>days</arg_key><arg_value>4", &tools),
            (String::new(), calls(&[("get_weather", r#"{"days":4}"#)]))
        );
        assert_eq!(parse("<tool_call>get_weather<arg_key>ci", &tools), (String::new(), calls(&[("get_weather", "{}")])));
    }

    #[test]
    fn streaming_emits_the_name_then_argument_pieces() {
        let mut p = ToolCallParser::new(&weather_tools());
        let d = p.push("Hi <tool_call>get_wea");
        assert_eq!(d, ToolDelta { content: "Hi".into(), calls: vec![] });
        let d = p.push("ther<arg_key>city</arg_key><arg_value>Par");
        let id = match &d.calls[0] {
            ToolCallEvent::Start { index: 0, id, name } if name == "get_weather" => id.clone(),
            other => panic!("{other:?}"),
        };
        assert_eq!(d.calls[1..], [ToolCallEvent::Arguments { index: 0, delta: r#"{"city":"Par"#.into() }]);
        let d = p.push("is</arg_value></tool_call>");
        assert_eq!(
            d.calls,
            [ToolCallEvent::Arguments { index: 0, delta: r#"is"}"#.into() }, ToolCallEvent::End { index: 0 }]
        );
        assert_eq!(p.finish(), ToolDelta::default());
        assert_eq!(p.calls()[0].to_openai_json(), serde_json::json!({
            "id": id, "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\":\"Paris\"}"}}));
    }

    /// SGLang drops calls to tools the request does not list (vLLM keeps them): nothing of such a
    /// call is streamed, and the calls around it keep their order and indices.
    #[test]
    fn calls_to_unlisted_tools_are_dropped() {
        let tools = weather_tools();
        let text = "<tool_call>invalid_func<arg_key>city</arg_key><arg_value>Beijing</arg_value></tool_call>";
        assert_eq!(parse(text, &tools), (String::new(), vec![]));
        let text = concat!(
            "Checking.\n<tool_call>get_time<arg_key>tz</arg_key><arg_value>CET</arg_value></tool_call>",
            "<tool_call>nonexistent_function<arg_key>x</arg_key><arg_value>1</arg_value></tool_call>\n",
            "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value></tool_call>"
        );
        assert_eq!(
            parse(text, &tools),
            ("Checking.".into(), calls(&[("get_time", r#"{"tz":"CET"}"#), ("get_weather", r#"{"city":"Paris"}"#)]))
        );
        let mut p = ToolCallParser::new(&tools);
        let d = p.push("<tool_call>nonexistent_function<arg_key>x</arg_key><arg_value>streamed?");
        assert_eq!(d, ToolDelta::default());
        let d = p.push("</arg_value></tool_call><tool_call>get_time</tool_call>");
        assert!(matches!(&d.calls[0], ToolCallEvent::Start { index: 0, name, .. } if name == "get_time"), "{d:?}");
        // Without a tools list no call is kept.
        assert_eq!(parse("<tool_call>get_time</tool_call>", &[]), (String::new(), vec![]));
    }

    /// Argument values holding escaped JSON are decoded twice for non-string parameters (SGLang's
    /// fallback); string parameters keep the text as written (vLLM and SGLang).
    #[test]
    fn escaped_json_values_are_decoded_twice() {
        let tools = vec![serde_json::json!({"type": "function", "function": {"name": "todo_write", "parameters": {
            "type": "object", "properties": {"todos": {"type": "array"}, "path": {"type": "string"}, "meta": {"type": "object"}}}}})];
        let text = concat!(
            r#"<tool_call>todo_write<arg_key>todos</arg_key><arg_value>[{\"id\": \"1\", \"task\": \"Check \\\"a\\\"\"}, {\"id\": \"2\"}]</arg_value>"#,
            r#"<arg_key>path</arg_key><arg_value>C:\\Users\"x\"</arg_value>"#,
            r#"<arg_key>meta</arg_key><arg_value>{\"n\": 2}</arg_value></tool_call>"#
        );
        let (_, found) = parse(text, &tools);
        let args: Value = serde_json::from_str(&found[0].1).unwrap();
        assert_eq!(
            args,
            serde_json::json!({"todos": [{"id": "1", "task": "Check \"a\""}, {"id": "2"}], "path": "C:\\\\Users\\\"x\\\"", "meta": {"n": 2}})
        );
        // Text that is not JSON either way stays a string.
        let text = r#"<tool_call>todo_write<arg_key>todos</arg_key><arg_value>say \"hi\"</arg_value></tool_call>"#;
        assert_eq!(parse(text, &tools).1, calls(&[("todo_write", r#"{"todos":"say \\\"hi\\\""}"#)]));
    }

    #[test]
    fn call_ids_are_unique() {
        let ids: std::collections::HashSet<String> = (0..10_000).map(|_| new_call_id()).collect();
        assert_eq!(ids.len(), 10_000);
    }

    fn output(text: &str, thinking: bool, tools: Option<&[Value]>, cuts: &[usize]) -> (String, String, Vec<(String, String)>) {
        let mut p = OutputParser::new(thinking, tools);
        let (mut reasoning, mut content, mut events) = (String::new(), String::new(), Vec::new());
        let mut from = 0;
        for &cut in cuts.iter().chain(std::iter::once(&text.len())) {
            let d = p.push(&text[from..cut]);
            reasoning += &d.reasoning;
            content += &d.content;
            events.extend(d.tool_calls);
            from = cut;
        }
        let d = p.finish();
        reasoning += &d.reasoning;
        content += &d.content;
        events.extend(d.tool_calls);
        check_events(&events, p.tool_calls());
        (reasoning, content, p.tool_calls().iter().map(|c| (c.name.clone(), c.arguments.clone())).collect())
    }

    #[test]
    fn reasoning_and_tools_together() {
        let tools = weather_tools();
        let text = "I should call it.</think><tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value></tool_call>";
        let whole = output(text, true, Some(&tools), &[]);
        assert_eq!(whole, ("I should call it.".into(), String::new(), calls(&[("get_weather", r#"{"city":"Paris"}"#)])));
        let bounds: Vec<usize> = (1..text.len()).collect();
        for &i in &bounds {
            assert_eq!(output(text, true, Some(&tools), &[i]), whole, "split at {i}");
        }
        assert_eq!(output(text, true, Some(&tools), &bounds), whole);

        let parsed = OutputParser::parse(text, true, Some(&tools));
        assert_eq!((parsed.reasoning.as_str(), parsed.content.as_str(), parsed.tool_calls.len()), ("I should call it.", "", 1));
        // A call opened inside the reasoning (no `</think>`) still counts.
        let parsed = OutputParser::parse("Need weather.<tool_call>get_time</tool_call>", true, Some(&tools));
        assert_eq!((parsed.reasoning.as_str(), parsed.content.as_str()), ("Need weather.", ""));
        assert_eq!(parsed.tool_calls[0].name, "get_time");
        // Without tools the markup stays content; truncated reasoning is all reasoning.
        let parsed = OutputParser::parse("r</think><tool_call>x</tool_call>", true, None);
        assert_eq!((parsed.content.as_str(), parsed.tool_calls.len()), ("<tool_call>x</tool_call>", 0));
        let parsed = OutputParser::parse("still thinking", true, Some(&tools));
        assert_eq!(parsed, ParsedOutput { reasoning: "still thinking".into(), ..Default::default() });
    }

    #[test]
    fn in_reasoning_counts_reasoning_tokens() {
        let mut p = OutputParser::new(true, None);
        let mut reasoning_tokens = 0;
        for piece in ["Let", " me", " see", ".", "</think>", "Yes", "."] {
            reasoning_tokens += usize::from(p.in_reasoning());
            p.push(piece);
        }
        assert_eq!(reasoning_tokens, 5);
    }

    /// Random strings over the tag vocabulary: no panic, split-invariant, valid argument JSON.
    #[test]
    fn fuzz_tag_soup() {
        const PIECES: [&str; 36] = [
            "<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>", "<think>",
            "</think>", "<", "/", ">", "a", "é", " ", "\n", "42", "\"x\"", "{", "}", "[1,", "get_weather", "city",
            "days", "tool_", "call>", "<tool", "_call>", "</arg", "_value>", "\\", "<tool_call>get_weather",
            "<tool_call>f</tool_call>", "<arg_key>city</arg_key><arg_value>", "<arg_key>days</arg_key><arg_value>",
            "<tool_call>nope", "[{\\\"a\\\": 1}]",
        ];
        let mut tools = weather_tools();
        tools.extend(named(&["f"]));
        let mut rng = Rng::new(7);
        let (mut with_calls, mut with_reasoning, mut with_content) = (0, 0, 0);
        for case in 0..1500 {
            let n = (rng.next_u64() % 24) as usize;
            let text: String = (0..n).map(|_| PIECES[(rng.next_u64() % PIECES.len() as u64) as usize]).collect();
            let thinking = case % 2 == 0;
            let tools = (case % 3 != 0).then_some(tools.as_slice());
            let whole = output(&text, thinking, tools, &[]);
            let bounds: Vec<usize> = (1..text.len()).filter(|&i| text.is_char_boundary(i)).collect();
            assert_eq!(output(&text, thinking, tools, &bounds), whole, "char by char: {text:?}");
            let mut cuts: Vec<usize> = bounds.iter().copied().filter(|_| rng.next_u64().is_multiple_of(4)).collect();
            cuts.dedup();
            assert_eq!(output(&text, thinking, tools, &cuts), whole, "cuts {cuts:?}: {text:?}");
            with_reasoning += usize::from(!whole.0.is_empty());
            with_content += usize::from(!whole.1.is_empty());
            with_calls += usize::from(!whole.2.is_empty());
        }
        // The soup reaches every path.
        assert!(with_calls > 100 && with_reasoning > 100 && with_content > 100, "{with_calls} {with_reasoning} {with_content}");
    }
}
