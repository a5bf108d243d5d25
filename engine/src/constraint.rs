//! Structured output by constrained decoding: before each sampling step the logits of every
//! token that cannot continue the required output are set to -inf. The grammar engine is
//! `llguidance` (Earley parser over a lexer of derivative-based regexes, with a token trie): we
//! only write the grammars, in its Lark dialect, and translate between its token sets and the
//! engine's logit rows.
//!
//! What can be required:
//! * `response_format: {"type": "json_object"}` / `{"type": "json_schema"}`: the content is one
//!   JSON value (whitespace between tokens is free, as models like to pretty-print).
//! * `tool_choice: "required"` / a named function: the content is GLM tool calls,
//!   `<tool_call>NAME<arg_key>K</arg_key><arg_value>V</arg_value>…</tool_call>`, where the tags
//!   are single special tokens, exactly what [`crate::tool_calls`] parses.
//!
//! With `thinking` (the prompt ends in `<think>`) the output may first reason freely and must
//! then close the reasoning with the `</think>` token. The reasoning is deliberately not bounded
//! by the grammar: a forced cut would end it mid-thought, and the request's `max_tokens` bounds
//! it as it does without a constraint. It may not spell out `</think>` or `<tool_call>` as text,
//! which the reasoning parser would take for the tags.
//!
//! Tool arguments follow the `properties` of the tool's `parameters`, in the order declared:
//! required ones always, optional ones may be left out, undeclared ones are never generated
//! (combinators at the top of `parameters` are not looked at).
//! A parameter that the parser keeps as raw text (a string type) is raw text here too, with
//! `enum`/`const`/`minLength`/`maxLength`/`pattern` enforced (`format` is not: raw text has no
//! JSON-schema engine behind it); it cannot start or end with whitespace (the parser would trim
//! it) nor contain the text `</arg_value>`. Any other parameter is JSON of its schema, compiled
//! leniently (unknown keywords and formats are ignored rather than failing the request). Known
//! gap: a string nested in such JSON could still spell out `</arg_value>` byte by byte.
//!
//! Ids past the tokenizer's vocabulary (padding rows of the logits) are never allowed, and an eos
//! id only once the output is complete. A mask costs about 0.4-1 ms on average on a 155k vocab,
//! a few ms at worst (the ignored `timings_on_a_large_vocab` test measures it).

use std::fmt::Write as _;
use std::sync::Arc;

use llguidance::api::{StopReason, TopLevelGrammar};
use llguidance::toktrie::{ApproximateTokEnv, SimpleVob, TokEnv, TokRxInfo, TokTrie};
use llguidance::{regex_to_lark, Matcher, ParserFactory};
use serde_json::Value;

use crate::tokenizer::Tokenizer;

/// A tool the output may call: its name and its JSON-schema `parameters` (`Null`: none).
#[derive(Debug, Clone)]
pub struct ToolSpec {
    pub name: String,
    pub parameters: Value,
}

/// The GLM tool-call tags, each one special token.
#[derive(Debug, Clone, Copy)]
struct ToolTags {
    call: u32,
    call_end: u32,
    key: u32,
    key_end: u32,
    value: u32,
    value_end: u32,
}

/// Built once per server from the tokenizer (the token trie and the lexer slices llguidance
/// precomputes over the vocabulary); compiles a grammar per request. Send + Sync: share it
/// through an `Arc`.
pub struct ConstraintCompiler {
    factory: ParserFactory,
    vocab_size: usize,
    think_end: Option<u32>,
    tool_tags: Option<ToolTags>,
}

/// Free reasoning text: anything that the reasoning parser will not read as a tag.
const REASONING: &str = r"REASONING: /(?s:.*)/ & ~/(?s:.*)(<\/think>|<tool_call>)(?s:.*)/";
/// A raw-text argument value that the tool-call parser gives back unchanged: not padded with
/// whitespace (it trims) and without the text of the closing tag.
const RAW_VALUE: &str = r"RAW_VALUE: /(\S((?s:.)*\S)?)?/ & ~/(?s:.*)<\/arg_value>(?s:.*)/";

impl ConstraintCompiler {
    /// `vocab_size`: the length of a logit row (at least the tokenizer's vocabulary). `eos_ids`:
    /// the stop tokens (generation_config's `eos_token_id`), allowed only when the output is
    /// complete.
    pub fn new(tokenizer: &Tokenizer, vocab_size: usize, eos_ids: &[u32]) -> Result<Self, String> {
        // llguidance reads token bytes from tokenizer.json itself (byte-level or byte-fallback
        // decoding of the vocabulary, special added tokens marked as such); hand it ours.
        let json = tokenizer.inner().to_string(false).map_err(|e| format!("constraint: serialising the tokenizer: {e}"))?;
        let json: Value = serde_json::from_str(&json).map_err(|e| format!("constraint: tokenizer JSON: {e}"))?;
        let mut words = llguidance::token_bytes_from_tokenizer_json(&json).map_err(|e| format!("constraint: {e}"))?;
        if words.len() > vocab_size {
            return Err(format!("constraint: {} tokens, more than the vocab size {vocab_size}", words.len()));
        }
        // Rows with no token get no bytes: the trie never offers them.
        words.resize(vocab_size, Vec::new());
        let Some(&first_eos) = eos_ids.first() else { return Err("constraint: no eos token id".into()) };
        if let Some(bad) = eos_ids.iter().find(|&&id| id as usize >= vocab_size) {
            return Err(format!("constraint: eos id {bad} is outside the vocab ({vocab_size})"));
        }
        let trie = TokTrie::from(&TokRxInfo::new(vocab_size as u32, first_eos), &words).with_eos_tokens(eos_ids);
        // Greedy (non-canonical) tokenisation: masks then allow every token that fits forced
        // text, instead of forcing one tokenisation of it on the model.
        let env: TokEnv = Arc::new(ApproximateTokEnv::new(trie));
        let mut factory = ParserFactory::new_simple(&env).map_err(|e| format!("constraint: {e}"))?;
        factory.quiet(); // warnings would go to stderr; errors come back as results
        let id = |t: &str| tokenizer.token_id(t);
        let tool_tags = (|| {
            Some(ToolTags {
                call: id("<tool_call>")?,
                call_end: id("</tool_call>")?,
                key: id("<arg_key>")?,
                key_end: id("</arg_key>")?,
                value: id("<arg_value>")?,
                value_end: id("</arg_value>")?,
            })
        })();
        Ok(ConstraintCompiler { factory, vocab_size, think_end: id("</think>"), tool_tags })
    }

    /// Any JSON object (`response_format: {"type": "json_object"}`). `thinking`: reasoning text
    /// and `</think>` come first (the prompt ended in `<think>`).
    pub fn json_object(&self, thinking: bool) -> Result<Constraint, String> {
        self.json_schema(&serde_json::json!({"type": "object"}), thinking)
    }

    /// An instance of `schema` (`response_format: {"type": "json_schema"}`'s `schema`);
    /// `thinking` as for [`json_object`](Self::json_object). An invalid schema, or one using
    /// keywords or formats llguidance does not implement, is an error naming them (a 400).
    pub fn json_schema(&self, schema: &Value, thinking: bool) -> Result<Constraint, String> {
        if !schema.is_object() {
            return Err("json_schema: the schema must be a JSON object".into());
        }
        let grammar = if thinking {
            let mut g = String::new();
            self.start(&mut g, thinking, false)?;
            writeln!(g, "answer: %json {schema}").unwrap();
            TopLevelGrammar::from_lark(g)
        } else {
            TopLevelGrammar::from_json_schema(schema.clone())
        };
        self.compile(grammar).map_err(|e| format!("json_schema: {}", self.schema_error(schema).unwrap_or(e)))
    }

    /// GLM tool calls to `tools` (`tool_choice: "required"`: all the request's tools; a named
    /// function: that one). `parallel`: one or more calls (OpenAI's `parallel_tool_calls`,
    /// default true), else exactly one. `thinking`: reasoning text may come first, then
    /// `</think>` (which GLM may also leave out before `<tool_call>`; the parsers accept both).
    /// Each call's arguments satisfy its tool's `parameters` as the module doc describes.
    pub fn tool_calls(&self, tools: &[ToolSpec], thinking: bool, parallel: bool) -> Result<Constraint, String> {
        let tags = self.tool_tags.ok_or("tool_calls: the tokenizer has no GLM tool-call tokens")?;
        if tools.is_empty() {
            return Err("tool_calls: no tools".into());
        }
        let mut g = String::new();
        self.start(&mut g, thinking, true)?;
        writeln!(g, "answer: call{}", if parallel { "+" } else { "" }).unwrap();
        let names: Vec<String> = (0..tools.len()).map(|i| format!("tool{i}")).collect();
        writeln!(g, "call: {}", names.join(" | ")).unwrap();
        g.push_str(RAW_VALUE);
        g.push('\n');
        let mut json_params = Vec::new();
        for (i, tool) in tools.iter().enumerate() {
            let json = tool_rules(&mut g, i, tool, tags).map_err(|e| format!("tool_calls: tool {:?}: {e}", tool.name))?;
            json_params.extend(json.into_iter().map(|(key, schema)| (&tool.name, key, schema)));
        }
        self.compile(TopLevelGrammar::from_lark(g)).map_err(|e| {
            // Name the parameter whose schema failed, rather than a place in our grammar.
            let culprit = json_params.iter().find_map(|(name, key, schema)| {
                self.schema_error(schema).map(|e| format!("tool {name:?}: parameter {key:?}: {e}"))
            });
            format!("tool_calls: {}", culprit.unwrap_or(e))
        })
    }

    /// The `start` rule: optional reasoning and `</think>`, then `answer`.
    fn start(&self, g: &mut String, thinking: bool, think_end_optional: bool) -> Result<(), String> {
        if !thinking {
            g.push_str("start: answer\n");
            return Ok(());
        }
        let end = self.think_end.ok_or("the tokenizer has no </think> token")?;
        writeln!(g, "start: REASONING? <[{end}]>{} answer", if think_end_optional { "?" } else { "" }).unwrap();
        g.push_str(REASONING);
        g.push('\n');
        Ok(())
    }

    fn compile(&self, grammar: TopLevelGrammar) -> Result<Constraint, String> {
        let parser = self.factory.create_parser(grammar).map_err(|e| e.to_string())?;
        let matcher = Matcher::new(Ok(parser));
        if let Some(e) = matcher.get_error() {
            return Err(e);
        }
        Ok(Constraint { matcher, allowed: None, vocab_size: self.vocab_size })
    }

    /// Why `schema` alone does not compile, if it does not: on the error path only, to report
    /// the schema's problem instead of a position in a generated grammar.
    fn schema_error(&self, schema: &Value) -> Option<String> {
        self.factory.create_parser(TopLevelGrammar::from_json_schema(schema.clone())).err().map(|e| e.to_string())
    }
}

/// Per-request matcher state; Send, to move to the engine thread. Call [`mask`](Self::mask)
/// then [`commit`](Self::commit) with the sampled token, each step.
pub struct Constraint {
    matcher: Matcher,
    /// The tokens allowed now, kept from `mask` so that `commit` checks its token in O(1).
    allowed: Option<SimpleVob>,
    vocab_size: usize,
}

impl Constraint {
    /// Sets the logit of every token not allowed now to -inf (`logits`: a whole row, vocab_size
    /// long). Once [`is_finished`](Self::is_finished), only the eos ids stay. An error (the
    /// grammar hit one of llguidance's limits) means the constraint cannot be kept: fail the
    /// request.
    pub fn mask(&mut self, logits: &mut [f32]) -> Result<(), String> {
        if logits.len() != self.vocab_size {
            return Err(format!("constraint: logit row of {} for a vocab of {}", logits.len(), self.vocab_size));
        }
        let allowed = self.allowed()?;
        for (&bits, row) in allowed.as_slice().iter().zip(logits.chunks_mut(32)) {
            if bits != u32::MAX {
                for (i, l) in row.iter_mut().enumerate() {
                    if bits >> i & 1 == 0 {
                        *l = f32::NEG_INFINITY;
                    }
                }
            }
        }
        Ok(())
    }

    /// Advances by the sampled `token`; an error, leaving the state as it was, if the token is
    /// not allowed now.
    pub fn commit(&mut self, token: u32) -> Result<(), String> {
        if token as usize >= self.vocab_size || !self.allowed()?.is_allowed(token) {
            return Err(format!("constraint: token {token} is not allowed here"));
        }
        self.allowed = None;
        if self.matcher.is_stopped() {
            return Ok(()); // finished, and `token` is an eos: nothing left to match
        }
        self.matcher.consume_token(token).map_err(|e| format!("constraint: {e}"))
    }

    /// The output is complete and only eos may follow (finish with reason "stop"): right after
    /// the JSON value's last token, or the last tool call's `</tool_call>` when only one call is
    /// allowed. Where more may follow (another call), eos is allowed too and finishes it.
    pub fn is_finished(&self) -> bool {
        matches!(self.matcher.stop_reason(), StopReason::NoExtension | StopReason::EndOfSentence)
    }

    fn allowed(&mut self) -> Result<&SimpleVob, String> {
        if self.allowed.is_none() {
            let set = self.matcher.compute_mask_or_eos().map_err(|e| format!("constraint: {e}"))?;
            self.allowed = Some(set);
        }
        Ok(self.allowed.as_ref().expect("just set"))
    }
}

impl crate::request::TokenConstraint for Constraint {
    fn mask(&mut self, logits: &mut [f32]) -> Result<(), String> {
        Constraint::mask(self, logits)
    }
    fn commit(&mut self, token: u32) -> Result<(), String> {
        Constraint::commit(self, token)
    }
    fn is_finished(&self) -> bool {
        Constraint::is_finished(self)
    }
}

/// Tokens that may never be generated (`tool_choice: "none"` bans `<tool_call>`): no grammar
/// needed, so it costs one store per banned id.
pub struct BannedTokens(pub Vec<u32>);

impl crate::request::TokenConstraint for BannedTokens {
    fn mask(&mut self, logits: &mut [f32]) -> Result<(), String> {
        for &t in &self.0 {
            if let Some(l) = logits.get_mut(t as usize) {
                *l = f32::NEG_INFINITY;
            }
        }
        Ok(())
    }
    fn commit(&mut self, token: u32) -> Result<(), String> {
        if self.0.contains(&token) {
            return Err(format!("token {token} is banned"));
        }
        Ok(())
    }
}

/// The rules of tool `i`: `tool{i}: <tool_call> "NAME" arg{i}_0 arg{i}_1? … </tool_call>`.
/// Returns the JSON-typed parameters with the schemas they are compiled from.
fn tool_rules<'a>(g: &mut String, i: usize, tool: &'a ToolSpec, t: ToolTags) -> Result<Vec<(&'a str, Value)>, String> {
    // What the parser takes for a name (tool_calls.rs `name_text`).
    let name_ok = |c: char| c.is_alphanumeric() || "_-.:".contains(c);
    if tool.name.is_empty() || tool.name.len() > 128 || !tool.name.chars().all(name_ok) {
        return Err("the name cannot be written in GLM's tool-call format".into());
    }
    let root = &tool.parameters;
    let mut params: Vec<(&str, &Value)> = Vec::new();
    match root.get("properties") {
        None | Some(Value::Null) => {}
        Some(Value::Object(props)) => params.extend(props.iter().map(|(k, v)| (k.as_str(), v))),
        Some(_) => return Err("`properties` must be an object".into()),
    }
    let required: Vec<&str> = match root.get("required") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::Array(r)) => {
            r.iter().map(|k| k.as_str().ok_or("`required` must list strings")).collect::<Result<_, _>>()?
        }
        Some(_) => return Err("`required` must be an array".into()),
    };
    // A required key without a schema may hold anything.
    let any = Value::Bool(true);
    for &key in &required {
        if !params.iter().any(|(k, _)| *k == key) {
            params.push((key, &any));
        }
    }
    let mut call = format!("tool{i}: <[{}]> {}", t.call, lark_string(&tool.name));
    let mut json_params = Vec::new();
    for (j, &(key, schema)) in params.iter().enumerate() {
        let is_required = required.contains(&key);
        if *schema == Value::Bool(false) {
            if is_required {
                return Err(format!("required parameter {key:?} has the schema `false`"));
            }
            continue;
        }
        if key.trim() != key || key.contains("</arg_key>") {
            return Err(format!("parameter name {key:?} cannot be written in GLM's tool-call format"));
        }
        let arg = format!("arg{i}_{j}");
        write!(call, " {arg}{}", if is_required { "" } else { "?" }).unwrap();
        let value = if is_raw_string(schema, root) {
            let mut raw = RawString { g: &mut *g, prefix: format!("S{i}_{j}_"), n: 0, root };
            match raw.terminal(schema, 0).map_err(|e| format!("parameter {key:?}: {e}"))? {
                Some(rx) => {
                    writeln!(g, "V{i}_{j}: RAW_VALUE & {rx}").unwrap();
                    format!("V{i}_{j}")
                }
                None => "RAW_VALUE".to_string(),
            }
        } else {
            let schema = json_value_schema(schema, root);
            writeln!(g, "val{i}_{j}: %json {schema}").unwrap();
            json_params.push((key, schema));
            format!("val{i}_{j}")
        };
        let (k, ke, v, ve) = (t.key, t.key_end, t.value, t.value_end);
        writeln!(g, "{arg}: <[{k}]> {} <[{ke}]> <[{v}]> {value} <[{ve}]>", lark_string(key)).unwrap();
    }
    writeln!(g, "{call} <[{}]>", t.call_end).unwrap();
    Ok(json_params)
}

/// A parameter schema to compile on its own: the root's definitions go along so that `$ref`s
/// into them resolve, and unknown keywords relax rather than fail.
fn json_value_schema(schema: &Value, root: &Value) -> Value {
    let mut out = match schema {
        Value::Object(o) => o.clone(),
        _ => serde_json::Map::new(), // `true`: anything
    };
    for defs in ["$defs", "definitions"] {
        if let (Some(d), false) = (root.get(defs), out.contains_key(defs)) {
            out.insert(defs.to_string(), d.clone());
        }
    }
    out.entry("x-guidance").or_insert_with(|| serde_json::json!({"lenient": true}));
    Value::Object(out)
}

/// Whether the tool-call parser keeps this parameter's value as raw text (its own rule, so the
/// grammar and the parser can never disagree).
fn is_raw_string(schema: &Value, root: &Value) -> bool {
    crate::tool_calls::keeps_raw_text(schema, root)
}

/// The target of a local `$ref` (`#/…`).
fn resolve<'a>(schema: &Value, root: &'a Value) -> Option<&'a Value> {
    root.pointer(schema.get("$ref")?.as_str()?.strip_prefix('#')?)
}

/// Translates the string keywords of a raw-text parameter into Lark terminals.
struct RawString<'a> {
    g: &'a mut String,
    /// Names this parameter's helper terminals apart from the others.
    prefix: String,
    n: usize,
    root: &'a Value,
}

impl RawString<'_> {
    /// A terminal for the texts `schema` allows, or `None` for any text.
    fn terminal(&mut self, schema: &Value, depth: usize) -> Result<Option<String>, String> {
        if depth > 16 {
            return Err("schema nested too deeply".into());
        }
        let Value::Object(s) = schema else { return Ok(None) }; // `true`
        let mut parts = Vec::new();
        if s.contains_key("$ref") {
            let target = resolve(schema, self.root).ok_or_else(|| format!("cannot resolve $ref {}", s["$ref"]))?;
            parts.extend(self.terminal(target, depth + 1)?);
        }
        let values: Option<Vec<&Value>> = match (s.get("enum"), s.get("const")) {
            (Some(Value::Array(e)), _) => Some(e.iter().collect()),
            (_, Some(c)) => Some(vec![c]),
            _ => None,
        };
        if let Some(values) = values {
            // Only strings the parser gives back unchanged can be chosen.
            let literals: Vec<String> = values
                .iter()
                .filter_map(|v| v.as_str())
                .filter(|v| v.trim() == *v && !v.contains("</arg_value>"))
                .map(lark_string)
                .collect();
            if literals.is_empty() {
                return Err("no enum value can be written as raw text".into());
            }
            parts.push(self.define(&literals.join(" | ")));
        }
        let bound = |k: &str| s.get(k).and_then(Value::as_u64);
        let (min, max) = (bound("minLength").unwrap_or(0), bound("maxLength"));
        if min > 0 || max.is_some() {
            let max = max.map(|m| m.to_string()).unwrap_or_default();
            parts.push(self.define(&format!("/(?s:.){{{min},{max}}}/")));
        }
        if let Some(p) = s.get("pattern") {
            let p = p.as_str().ok_or("`pattern` must be a string")?;
            parts.push(self.define(&search_regex(p)));
        }
        for combinator in ["anyOf", "oneOf"] {
            let Some(subs) = s.get(combinator) else { continue };
            let subs = subs.as_array().ok_or_else(|| format!("`{combinator}` must be an array"))?;
            let mut alts = Some(Vec::new());
            for sub in subs.iter().filter(|sub| !is_null_only(sub)) {
                match (self.terminal(sub, depth + 1)?, &mut alts) {
                    (Some(t), Some(alts)) => alts.push(t),
                    _ => alts = None, // a branch allows any text: so does the union
                }
            }
            if let Some(alts) = alts.filter(|a| !a.is_empty()) {
                parts.push(self.define(&alts.join(" | ")));
            }
        }
        for sub in s.get("allOf").and_then(Value::as_array).into_iter().flatten() {
            parts.extend(self.terminal(sub, depth + 1)?);
        }
        Ok(match parts.len() {
            0 => None,
            1 => parts.pop(),
            _ => Some(self.define(&parts.join(" & "))),
        })
    }

    /// Defines a helper terminal; returns its name.
    fn define(&mut self, body: &str) -> String {
        let name = format!("{}{}", self.prefix, self.n);
        self.n += 1;
        writeln!(self.g, "{name}: {body}").unwrap();
        name
    }
}

fn is_null_only(schema: &Value) -> bool {
    schema.get("type").and_then(Value::as_str) == Some("null")
}

/// JSON-schema `pattern` semantics (a search, anchored only by `^`/`$`) as a whole-text Lark
/// regex, with ECMA's ASCII `\d`/`\w`.
fn search_regex(pattern: &str) -> String {
    let (anchored_start, rest) = match pattern.strip_prefix('^') {
        Some(rest) => (true, rest),
        None => (false, pattern),
    };
    let (anchored_end, body) = match rest.strip_suffix('$') {
        // `\$` is a literal dollar, `\\$` an anchor after a backslash.
        Some(body) if body.chars().rev().take_while(|&c| c == '\\').count() % 2 == 0 => (true, body),
        _ => (false, rest),
    };
    let any = "(?s:.*)";
    format!(
        "/{}(?:{}){}/",
        if anchored_start { "" } else { any },
        regex_to_lark(body, "dw"),
        if anchored_end { "" } else { any }
    )
}

/// A Lark string literal (Lark strings use JSON string syntax).
fn lark_string(s: &str) -> String {
    Value::String(s.to_string()).to_string()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tool_calls::OutputParser;
    use kiln_runtime::rng::Rng;
    use serde_json::json;
    use std::sync::OnceLock;

    /// The GLM special tokens at ids 256.. as `kiln synth` lays them out.
    const SPECIALS: [&str; 20] = [
        "<|endoftext|>", "[MASK]", "[gMASK]", "[sMASK]", "<sop>", "<eop>", "<|system|>", "<|user|>", "<|assistant|>",
        "<|observation|>", "<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>",
        "</tool_response>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>",
    ];
    const EOS: [u32; 3] = [256, 263, 265];
    const THINK_END: u32 = 267;
    const CALL_END: u32 = 269;
    const VALUE_END: u32 = 275;
    /// Ordinary multi-byte tokens after the specials, so that tokens straddle the grammar's
    /// boundaries as real BPE tokens do, including pieces of plain-text spellings of the tags,
    /// which the constraint must keep out where the parsers would take them for tags.
    const MERGED: [&str; 24] = [
        "{\"", "\":", "\",\"", "\"}", "\"]", "[\"", "true", "false", "null", "},{", "\n  ", " the", "ab", "12", "0.",
        "red", "city", "Paris", "</", "think>", "arg_value>", "<tool", "é", "日本",
    ];
    /// Logit rows are longer than the tokenizer (and not a multiple of 32): the rest are padding.
    const PADDING: usize = 11;

    struct Fixture {
        tokenizer: Tokenizer,
        compiler: ConstraintCompiler,
        n_tokens: usize,
        vocab: usize,
    }

    /// GPT-2's byte-to-unicode alphabet of byte-level BPE vocabularies.
    fn byte_char(b: u8) -> char {
        let printable = |b: u8| matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
        if printable(b) {
            return b as char;
        }
        char::from_u32(256 + (0..b).filter(|&x| !printable(x)).count() as u32).unwrap()
    }

    fn fixture() -> &'static Fixture {
        static F: OnceLock<Fixture> = OnceLock::new();
        F.get_or_init(|| Fixture::new(&MERGED.map(|m| m.as_bytes().to_vec()), "small"))
    }

    impl Fixture {
        /// A byte-level tokenizer: the 256 bytes, the GLM specials, then `merged`.
        fn new(merged: &[Vec<u8>], name: &str) -> Fixture {
            let mut vocab = serde_json::Map::new();
            let token = |bytes: &[u8]| bytes.iter().map(|&b| byte_char(b)).collect::<String>();
            for b in 0..=255u8 {
                vocab.insert(token(&[b]), json!(b));
            }
            // Like real tokenizer.json files, the model's vocabulary lists the added tokens too
            // (tokenizers renumbers added tokens that fall into holes of it).
            for (i, t) in SPECIALS.iter().enumerate() {
                vocab.insert(t.to_string(), json!(256 + i));
            }
            let first_merged = 256 + SPECIALS.len();
            for (i, m) in merged.iter().enumerate() {
                vocab.insert(token(m), json!(first_merged + i));
            }
            let added: Vec<Value> = SPECIALS
                .iter()
                .enumerate()
                .map(|(i, t)| {
                    json!({"id": 256 + i, "content": t, "single_word": false, "lstrip": false, "rstrip": false,
                           "normalized": false, "special": true})
                })
                .collect();
            let byte_level =
                json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true});
            let json = json!({
                "version": "1.0", "truncation": null, "padding": null, "added_tokens": added, "normalizer": null,
                "pre_tokenizer": byte_level, "post_processor": null, "decoder": byte_level,
                "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
                    "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
                    "vocab": vocab, "merges": []},
            });
            let dir = std::env::temp_dir().join(format!("kiln-constraint-test-{}-{name}", std::process::id()));
            std::fs::create_dir_all(&dir).unwrap();
            std::fs::write(dir.join("tokenizer.json"), json.to_string()).unwrap();
            let tokenizer = Tokenizer::from_dir(&dir).unwrap();
            std::fs::remove_dir_all(&dir).ok();
            let n_tokens = first_merged + merged.len();
            let vocab = n_tokens + PADDING;
            let compiler = ConstraintCompiler::new(&tokenizer, vocab, &EOS).unwrap();
            Fixture { tokenizer, compiler, n_tokens, vocab }
        }

        fn text(&self, ids: &[u32]) -> String {
            self.tokenizer.decode(ids).unwrap()
        }

        fn ids(&self, bytes: &[u8]) -> Vec<u32> {
            bytes.iter().map(|&b| b as u32).collect()
        }

        /// The allowed set after masking a row of zeros.
        fn allowed(&self, c: &mut Constraint) -> Vec<u32> {
            let mut row = vec![0.0; self.vocab];
            c.mask(&mut row).unwrap();
            (0..self.vocab as u32).filter(|&t| row[t as usize] == 0.0).collect()
        }

        /// Samples from random logits (plus `bias`) under the constraint until it finishes, and
        /// checks every step: padding rows never allowed, eos allowed exactly when
        /// `complete(ids so far)`, a masked token refused by `commit` without harm, the sampled
        /// one accepted, and only eos left once finished. Returns the ids, the final eos
        /// included.
        fn generate(
            &self,
            c: &mut Constraint,
            rng: &mut Rng,
            bias: &dyn Fn(u32) -> f32,
            complete: &dyn Fn(&[u32]) -> bool,
        ) -> Vec<u32> {
            let mut ids = Vec::new();
            for _ in 0..4000 {
                let mut logits: Vec<f32> =
                    (0..self.vocab as u32).map(|t| rng.uniform() as f32 * 4.0 + bias(t)).collect();
                c.mask(&mut logits).unwrap();
                assert!(logits[self.n_tokens..].iter().all(|&l| l == f32::NEG_INFINITY), "a padding row allowed");
                let eos_allowed = EOS.iter().any(|&e| logits[e as usize].is_finite());
                assert_eq!(eos_allowed, complete(&ids), "eos allowed: {eos_allowed}, after {:?}", self.text(&ids));
                if c.is_finished() {
                    assert!((0..self.vocab).all(|t| logits[t].is_finite() == EOS.contains(&(t as u32))));
                }
                let masked: Vec<u32> =
                    (0..self.vocab as u32).filter(|&t| logits[t as usize] == f32::NEG_INFINITY).collect();
                if !masked.is_empty() {
                    let t = masked[(rng.next_u64() % masked.len() as u64) as usize];
                    assert!(c.commit(t).is_err(), "masked token {t} committed after {:?}", self.text(&ids));
                }
                let tok = (0..self.vocab).max_by(|&a, &b| logits[a].total_cmp(&logits[b])).unwrap() as u32;
                assert!(logits[tok as usize].is_finite(), "nothing allowed after {:?}", self.text(&ids));
                c.commit(tok).unwrap();
                ids.push(tok);
                if EOS.contains(&tok) {
                    assert!(c.is_finished());
                    return ids;
                }
            }
            panic!("no end after {:?}", self.text(&ids));
        }
    }

    /// Pushes the generation towards closing what it opened, so random walks end.
    fn closers(extra: &'static [u32]) -> impl Fn(u32) -> f32 {
        move |t| {
            let closing = matches!(t, 0x22 | 0x5D | 0x7D) || EOS.contains(&t) || extra.contains(&t);
            if closing { 2.5 } else { 0.0 }
        }
    }

    /// A small JSON-schema validator for the keywords these tests use: an expectation
    /// independent of llguidance.
    fn valid(v: &Value, schema: &Value, root: &Value) -> bool {
        if let Some(target) = resolve(schema, root) {
            return valid(v, target, root);
        }
        let types: Vec<&str> = match &schema["type"] {
            Value::String(t) => vec![t.as_str()],
            Value::Array(ts) => ts.iter().filter_map(Value::as_str).collect(),
            _ => vec![],
        };
        let type_ok = |t: &str| match t {
            "integer" => v.is_i64() || v.is_u64(),
            "number" => v.is_number(),
            "string" => v.is_string(),
            "boolean" => v.is_boolean(),
            "object" => v.is_object(),
            "array" => v.is_array(),
            "null" => v.is_null(),
            _ => false,
        };
        let num = |k: &str| schema.get(k).and_then(Value::as_f64);
        let len = |k: &str| schema.get(k).and_then(Value::as_u64).map(|n| n as usize);
        (types.is_empty() || types.iter().any(|t| type_ok(t)))
            && schema.get("enum").and_then(Value::as_array).is_none_or(|e| e.contains(v))
            && schema.get("const").is_none_or(|c| c == v)
            && v.as_f64().is_none_or(|x| num("minimum").is_none_or(|m| x >= m) && num("maximum").is_none_or(|m| x <= m))
            && v.as_str().is_none_or(|s| {
                let n = s.chars().count();
                len("minLength").is_none_or(|m| n >= m) && len("maxLength").is_none_or(|m| n <= m)
            })
            && v.as_array().is_none_or(|a| {
                len("minItems").is_none_or(|m| a.len() >= m)
                    && len("maxItems").is_none_or(|m| a.len() <= m)
                    && schema.get("items").is_none_or(|items| a.iter().all(|x| valid(x, items, root)))
            })
            && v.as_object().is_none_or(|o| {
                let props = schema.get("properties").and_then(Value::as_object);
                let required = schema.get("required").and_then(Value::as_array).into_iter().flatten();
                required.filter_map(Value::as_str).all(|k| o.contains_key(k))
                    && o.iter().all(|(k, x)| match props.and_then(|p| p.get(k)) {
                        Some(s) => valid(x, s, root),
                        None => schema.get("additionalProperties") != Some(&Value::Bool(false)),
                    })
            })
            && schema.get("anyOf").and_then(Value::as_array).is_none_or(|alts| alts.iter().any(|s| valid(v, s, root)))
    }

    /// The content after `</think>` (all of it without thinking) as JSON, if complete.
    fn json_answer(f: &Fixture, ids: &[u32], thinking: bool) -> Option<Value> {
        let content = if thinking { &ids[ids.iter().position(|&t| t == THINK_END)? + 1..] } else { ids };
        serde_json::from_str(&f.text(content)).ok()
    }

    fn assert_send_sync<T: Send + Sync>() {}
    fn assert_send<T: Send>() {}

    #[test]
    fn thread_safety() {
        assert_send_sync::<ConstraintCompiler>();
        assert_send::<Constraint>();
    }

    #[test]
    fn json_object_outputs_parse_as_objects() {
        let f = fixture();
        let mut rng = Rng::new(1);
        for run in 0..40 {
            let thinking = run % 2 == 1;
            let mut c = f.compiler.json_object(thinking).unwrap();
            let complete = |ids: &[u32]| json_answer(f, ids, thinking).is_some_and(|v| v.is_object());
            let ids = f.generate(&mut c, &mut rng, &closers(&[THINK_END]), &complete);
            let answer = json_answer(f, &ids[..ids.len() - 1], thinking).unwrap();
            assert!(answer.is_object(), "{answer}");
            if thinking {
                // The reasoning parser sees the same split.
                let text = f.text(&ids[..ids.len() - 1]);
                let parsed = OutputParser::parse(&text, true, None);
                assert_eq!(serde_json::from_str::<Value>(&parsed.content).unwrap(), answer);
            }
        }
    }

    fn person_schema() -> Value {
        json!({
            "type": "object",
            "properties": {
                "name": {"type": "string", "minLength": 1, "maxLength": 8},
                "age": {"type": "integer", "minimum": 0, "maximum": 150},
                "color": {"$ref": "#/$defs/color"},
                "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 3},
                "ok": {"type": "boolean"},
                "home": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6}},
                         "required": ["city"], "additionalProperties": false},
            },
            "required": ["name", "age", "color", "tags"],
            "additionalProperties": false,
            "$defs": {"color": {"enum": ["red", "green", "blue"]}},
        })
    }

    #[test]
    fn json_schema_outputs_validate() {
        let f = fixture();
        let schema = person_schema();
        let mut rng = Rng::new(2);
        let mut seen_optional = false;
        for run in 0..40 {
            let thinking = run % 3 == 2;
            let mut c = f.compiler.json_schema(&schema, thinking).unwrap();
            let complete = |ids: &[u32]| json_answer(f, ids, thinking).is_some_and(|v| valid(&v, &schema, &schema));
            let ids = f.generate(&mut c, &mut rng, &closers(&[THINK_END]), &complete);
            let answer = json_answer(f, &ids[..ids.len() - 1], thinking).unwrap();
            assert!(valid(&answer, &schema, &schema), "{answer}");
            seen_optional |= answer.get("ok").is_some() || answer.get("home").is_some();
        }
        assert!(seen_optional, "optional properties never generated");
    }

    #[test]
    fn invalid_schemas_are_errors_naming_the_problem() {
        let c = &fixture().compiler;
        let err = |schema: Value| c.json_schema(&schema, false).err().expect("an error");
        assert!(err(json!({"type": "strin"})).contains("strin"));
        assert!(err(json!({"type": "string", "format": "no-such-format"})).contains("no-such-format"));
        assert!(err(json!({"properties": {"a": {"$ref": "#/$defs/missing"}}})).contains("missing"));
        assert!(err(json!(["not", "a", "schema"])).contains("object"));
        let tool = |name: &str, parameters: Value| ToolSpec { name: name.into(), parameters };
        let tool_err = |t: ToolSpec| c.tool_calls(&[t], false, true).err().expect("an error");
        assert!(tool_err(tool("get weather", Value::Null)).contains("get weather"));
        let e = tool_err(tool("f", json!({"type": "object", "properties": {"n": {"type": "integr"}}})));
        assert!(e.contains("\"n\"") && e.contains("integr"), "{e}");
        let e = tool_err(tool("f", json!({"type": "object", "properties": {"s": {"enum": [" padded "]}}})));
        assert!(e.contains("\"s\""), "{e}");
        assert!(c.tool_calls(&[], false, true).is_err());
    }

    fn tools() -> Vec<ToolSpec> {
        let tool = |name: &str, parameters: Value| ToolSpec { name: name.into(), parameters };
        vec![
            tool("get_weather", json!({
                "type": "object",
                "properties": {
                    "city": {"type": "string", "minLength": 1, "maxLength": 10},
                    "days": {"type": "integer", "minimum": 1, "maximum": 7},
                    "units": {"$ref": "#/$defs/units"},
                    "code": {"type": "string", "pattern": "^[a-z]{2}[0-9]$"},
                },
                "required": ["city"],
                "$defs": {"units": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
            })),
            tool("search", json!({
                "type": "object",
                "properties": {
                    "query": {"type": ["string", "null"], "maxLength": 12},
                    "filters": {"type": "object", "properties": {"lang": {"type": "string", "maxLength": 3}},
                                "required": ["lang"], "additionalProperties": false},
                    "limit": {"anyOf": [{"type": "integer", "maximum": 50}, {"type": "null"}]},
                },
                "required": ["query", "filters"],
            })),
            tool("ping", json!({"type": "object", "properties": {}})),
            tool("noop", Value::Null),
        ]
    }

    /// Random constrained tool calls, run through the tool-call parser: every call names a given
    /// tool, its arguments satisfy the tool's schema, nothing is left as content.
    #[test]
    fn tool_calls_parse_into_valid_calls() {
        let f = fixture();
        let tools = tools();
        let tools_json: Vec<Value> = tools
            .iter()
            .map(|t| json!({"type": "function", "function": {"name": t.name, "parameters": t.parameters}}))
            .collect();
        let code_ok = |s: &str| {
            s.len() == 3 && s[..2].bytes().all(|b| b.is_ascii_lowercase()) && s.as_bytes()[2].is_ascii_digit()
        };
        let mut rng = Rng::new(3);
        let mut seen = std::collections::BTreeSet::new();
        let mut multi = false;
        for run in 0..100 {
            let (thinking, parallel) = (run % 2 == 0, run % 3 != 0);
            let mut c = f.compiler.tool_calls(&tools, thinking, parallel).unwrap();
            let complete = |ids: &[u32]| ids.last() == Some(&CALL_END);
            // Some runs favour another call, some optional arguments.
            let extra: &'static [u32] = match run % 4 {
                1 => &[THINK_END, CALL_END, VALUE_END, 268],
                2 => &[THINK_END, VALUE_END, 272],
                _ => &[THINK_END, CALL_END, VALUE_END],
            };
            let bias = closers(extra);
            let ids = f.generate(&mut c, &mut rng, &bias, &complete);
            let text = f.text(&ids[..ids.len() - 1]);
            let parsed = OutputParser::parse(&text, thinking, Some(&tools_json));
            assert_eq!(parsed.content, "", "{text:?}");
            let n_calls = ids.iter().filter(|&&t| t == CALL_END).count();
            assert_eq!(parsed.tool_calls.len(), n_calls, "{text:?}");
            assert!(parallel || n_calls == 1);
            multi |= n_calls > 1;
            for call in &parsed.tool_calls {
                let tool = tools.iter().find(|t| t.name == call.name);
                let tool = tool.unwrap_or_else(|| panic!("unknown tool in {text:?}"));
                let args: Value = serde_json::from_str(&call.arguments).unwrap();
                let schema = if tool.parameters.is_null() { json!({}) } else { tool.parameters.clone() };
                let mut closed = schema.clone();
                closed["additionalProperties"] = json!(false); // undeclared arguments are never generated
                assert!(valid(&args, &closed, &schema), "{} {args} from {text:?}", call.name);
                if let Some(code) = args.get("code") {
                    assert!(code_ok(code.as_str().unwrap()), "{code}");
                }
                seen.insert(call.name.clone());
                seen.extend(args.as_object().unwrap().keys().map(|k| format!("{}.{k}", call.name)));
            }
        }
        let every = [
            "get_weather", "get_weather.city", "get_weather.days", "get_weather.units", "get_weather.code",
            "search", "search.query", "search.filters", "search.limit", "ping", "noop",
        ];
        assert!(every.iter().all(|k| seen.contains(*k)), "seen: {seen:?}");
        assert!(multi, "never more than one call");
    }

    /// Tags spelt out as text, byte by byte or with ordinary tokens, would split the output where
    /// the parsers look for the tags: the constraint keeps them out.
    #[test]
    fn tags_cannot_be_spelt_out_as_text() {
        let f = fixture();
        let merged = |s: &str| (256 + SPECIALS.len() + MERGED.iter().position(|m| *m == s).unwrap()) as u32;
        let commit = |c: &mut Constraint, ids: &[u32]| ids.iter().for_each(|&t| c.commit(t).unwrap());
        let parameters = json!({"properties": {"s": {"type": "string"}}, "required": ["s"]});
        let tool = ToolSpec { name: "f".into(), parameters };
        let mut c = f.compiler.tool_calls(&[tool], true, true).unwrap();
        commit(&mut c, &[b'h' as u32, b' ' as u32, merged("</")]);
        assert!(!f.allowed(&mut c).contains(&merged("think>")));
        commit(&mut c, &f.ids(b"think"));
        let allowed = f.allowed(&mut c);
        assert!(!allowed.contains(&(b'>' as u32)) && allowed.contains(&(b'!' as u32)));
        commit(&mut c, &[b'!' as u32, merged("<tool")]);
        commit(&mut c, &f.ids(b"_call"));
        assert!(!f.allowed(&mut c).contains(&(b'>' as u32)));
        commit(&mut c, &[b'!' as u32, THINK_END, 268, b'f' as u32, 272, b's' as u32, 273, 274]);
        // Leading whitespace would be trimmed by the parser.
        assert!(!f.allowed(&mut c).contains(&(b' ' as u32)));
        commit(&mut c, &[b'x' as u32, merged("</")]);
        assert!(!f.allowed(&mut c).contains(&merged("arg_value>")));
        commit(&mut c, &f.ids(b"arg_value"));
        let allowed = f.allowed(&mut c);
        assert!(!allowed.contains(&(b'>' as u32)));
        assert!(allowed.contains(&VALUE_END) && !allowed.iter().any(|t| EOS.contains(t)));
        commit(&mut c, &[VALUE_END, CALL_END]);
        assert!(!c.is_finished(), "another call may follow");
        c.commit(265).unwrap();
        assert!(c.is_finished());
    }

    #[test]
    fn json_finishes_at_its_last_token() {
        let f = fixture();
        let mut c = f.compiler.json_object(false).unwrap();
        assert!(c.commit(THINK_END).is_err(), "no reasoning without thinking");
        c.commit(b'{' as u32).unwrap();
        assert!(!c.is_finished());
        c.commit(b'}' as u32).unwrap();
        assert!(c.is_finished());
        assert_eq!(f.allowed(&mut c), EOS.to_vec());
    }

    #[test]
    fn a_single_call_finishes_at_its_end() {
        let f = fixture();
        let mut c = f.compiler.tool_calls(&tools()[2..3], false, false).unwrap();
        assert!(c.commit(267).is_err(), "no reasoning without thinking");
        for t in [268, b'p' as u32, b'i' as u32, b'n' as u32, b'g' as u32, CALL_END] {
            assert!(!c.is_finished());
            c.commit(t).unwrap();
        }
        assert!(c.is_finished());
        assert_eq!(f.allowed(&mut c), EOS.to_vec());
        assert!(c.commit(b'a' as u32).is_err());
        c.commit(256).unwrap();
        assert!(c.is_finished());
    }

    /// Timings on a GLM-5-sized vocabulary (~155k random byte-level tokens); run with
    /// `cargo test -p kiln-engine constraint -- --ignored --nocapture` (the dev profile optimises
    /// kiln-engine and dependencies).
    #[test]
    #[ignore]
    fn timings_on_a_large_vocab() {
        let mut rng = Rng::new(9);
        let alphabet: Vec<&str> = "abcdefghijklmnopqrstuvwxyzaeiouEAST0123 \"{}[]:,.\n_-é日本語"
            .split("").filter(|c| !c.is_empty()).collect();
        let mut words = std::collections::HashSet::new();
        while words.len() < 154_500 {
            let len = 2 + (rng.next_u64() % 7) as usize;
            let w: String = (0..len).map(|_| alphabet[(rng.next_u64() % alphabet.len() as u64) as usize]).collect();
            words.insert(w.into_bytes());
        }
        let merged: Vec<Vec<u8>> = words.into_iter().filter(|w| w.len() > 1).collect();
        let t = std::time::Instant::now();
        let f = Fixture::new(&merged, "large");
        eprintln!("vocab {}: tokenizer + ConstraintCompiler::new {:?}", f.vocab, t.elapsed());
        let t = std::time::Instant::now();
        let constraints =
            [f.compiler.json_schema(&person_schema(), false).unwrap(), f.compiler.tool_calls(&tools(), true, true).unwrap()];
        eprintln!("two grammars compiled in {:?}", t.elapsed());
        for (mut c, name) in constraints.into_iter().zip(["json_schema", "tool_calls"]) {
            let (mut total, mut worst, mut steps) = (std::time::Duration::ZERO, std::time::Duration::ZERO, 0);
            let mut logits = vec![0.0f32; f.vocab];
            while !c.is_finished() && steps < 300 {
                let bias = closers(&[THINK_END, CALL_END, VALUE_END]);
                logits.iter_mut().enumerate().for_each(|(t, l)| *l = rng.uniform() as f32 * 4.0 + bias(t as u32));
                let t = std::time::Instant::now();
                c.mask(&mut logits).unwrap();
                let dt = t.elapsed();
                (total, worst, steps) = (total + dt, worst.max(dt), steps + 1);
                let tok = (0..f.vocab).max_by(|&a, &b| logits[a].total_cmp(&logits[b])).unwrap() as u32;
                c.commit(tok).unwrap();
            }
            eprintln!("{name}: {steps} steps, mask mean {:?}, worst {worst:?}", total / steps);
        }
    }
}
