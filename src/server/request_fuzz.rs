//! Mutation tests of request parsing: seeded random edits of valid chat and completion bodies
//! (subtrees replaced by hostile values, keys dropped or added, bytes flipped) through every
//! parsing step a request meets before the model: body, shared fields, messages and tools
//! validation, the chat input, the chat template and `tool_choice`. None may panic, and every
//! refusal is a 400 naming a reason.

use super::errors::ApiError;
use super::params::{parse_body, parse_common, ResponseFormat};
use super::structured::chat_structure;
use super::validate;
use kiln_engine::chat_template::{ChatInput, ChatTemplate};
use kiln_runtime::rng::Rng;
use serde_json::{json, Map, Value};

const KEYS: [&str; 40] = [
    "model", "messages", "role", "content", "tools", "type", "function", "name", "parameters", "properties",
    "tool_choice", "response_format", "json_schema", "schema", "max_tokens", "n", "stop", "logprobs",
    "top_logprobs", "temperature", "top_p", "stream", "stream_options", "include_usage", "tool_calls",
    "arguments", "tool_call_id", "reasoning_content", "chat_template_kwargs", "enable_thinking", "text",
    "min_tokens", "stop_token_ids", "seed", "prompt", "top_k", "required", "items", "$ref", "anyOf",
];
const STRINGS: [&str; 16] = [
    "", "user", "system", "assistant", "tool", "developer", "function", "auto", "required", "none", "json_object",
    "json_schema", "<tool_call>f<arg_key>a</arg_key>", "{{ raise_exception('x') }}", "\u{0}\u{ffff}é", "#/properties",
];

fn pick<'a>(rng: &mut Rng, items: &[&'a str]) -> &'a str {
    items[(rng.next_u64() % items.len() as u64) as usize]
}

fn random_value(rng: &mut Rng, depth: u32) -> Value {
    match rng.next_u64() % if depth > 3 { 6 } else { 8 } {
        0 => Value::Null,
        1 => Value::Bool(rng.next_u64() % 2 == 0),
        2 => json!([0i64, -1, 1, 2, 17, 1 << 40, i64::MAX, i64::MIN][(rng.next_u64() % 8) as usize]),
        3 => json!([u64::MAX as f64, 1e308, -0.5, 0.5, 2.5, 1e-300][(rng.next_u64() % 6) as usize]),
        4 => Value::String(pick(rng, &STRINGS).to_string()),
        5 => Value::String("x".repeat((rng.next_u64() % 3000) as usize)),
        6 => Value::Array((0..rng.next_u64() % 4).map(|_| random_value(rng, depth + 1)).collect()),
        _ => Value::Object((0..rng.next_u64() % 4).map(|_| (pick(rng, &KEYS).to_string(), random_value(rng, depth + 1))).collect::<Map<_, _>>()),
    }
}

/// One random edit at a random node of `v` (`depth` 0: the body, which stays an object).
fn mutate(v: &mut Value, rng: &mut Rng, depth: u32) {
    let descend = depth == 0 || rng.next_u64() % 3 != 0;
    match v {
        Value::Object(map) if descend && !map.is_empty() => {
            let i = (rng.next_u64() % map.len() as u64) as usize;
            let key = map.keys().nth(i).cloned().unwrap_or_default();
            match rng.next_u64() % 6 {
                0 => {
                    map.remove(&key);
                }
                1 => {
                    map.insert(pick(rng, &KEYS).to_string(), random_value(rng, 0));
                }
                _ => mutate(map.get_mut(&key).expect("key just listed"), rng, depth + 1),
            }
        }
        Value::Array(items) if descend && !items.is_empty() => {
            let i = (rng.next_u64() % items.len() as u64) as usize;
            match rng.next_u64() % 5 {
                0 => {
                    items.remove(i);
                }
                1 => {
                    let copy = items[i].clone();
                    items.push(copy);
                }
                _ => mutate(&mut items[i], rng, depth + 1),
            }
        }
        _ => *v = random_value(rng, 0),
    }
}

fn seeds() -> Vec<Value> {
    let weather = json!({"type": "function", "function": {"name": "get_weather", "description": "Weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}, "required": ["city"]}}});
    vec![
        json!({"model": "m", "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
            "max_tokens": 8, "temperature": 0.7, "stop": ["\n"], "logprobs": true, "top_logprobs": 2, "n": 2}),
        json!({"messages": [{"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": "", "reasoning_content": "need it", "tool_calls": [{"id": "call_1", "type": "function",
                "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "{\"temp\": 18}"}],
            "tools": [weather.clone()], "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
            "chat_template_kwargs": {"enable_thinking": false}, "stream": true, "stream_options": {"include_usage": true}}),
        json!({"messages": [{"role": "user", "content": [{"type": "text", "text": "JSON please"}]}],
            "response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": {"type": "object",
                "properties": {"a": {"type": "array", "items": {"$ref": "#/$defs/x"}}}, "$defs": {"x": {"type": "integer"}}}}},
            "tools": [weather], "tool_choice": "required", "parallel_tool_calls": false}),
        json!({"prompt": "Hello", "max_tokens": 4, "logprobs": 3, "seed": 1, "stop_token_ids": [1, 2], "min_tokens": 1}),
        json!({"prompt": [1, 2, 3], "n": 3, "top_k": 5, "presence_penalty": 1.5}),
    ]
}

fn refused(e: ApiError) {
    assert_eq!(e.status, 400, "{}", e.message);
    assert!(!e.message.is_empty());
}

/// How far a request got.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Reached {
    Body,
    Fields,
    Validated,
    Rendered,
}

/// Every step the handlers take before the model, as they take them.
fn parse_request(bytes: &[u8], template: &ChatTemplate) -> Reached {
    let v = match parse_body(bytes) {
        Ok(v) => v,
        Err(e) => {
            refused(e);
            return Reached::Body;
        }
    };
    let chat = v.get("messages").is_some();
    let common = match parse_common(&v, chat) {
        Ok(p) => p,
        Err(e) => {
            refused(e);
            return Reached::Fields;
        }
    };
    if !chat {
        return Reached::Validated;
    }
    if let Err(e) = validate::messages(&v).and_then(|()| validate::tools(&v)) {
        refused(e);
        return Reached::Fields;
    }
    let mut reached = Reached::Validated;
    if let Ok(input) = serde_json::from_slice::<ChatInput>(bytes) {
        if template.render(&input).is_ok() {
            reached = Reached::Rendered;
        }
    }
    let tools = v.get("tools").and_then(Value::as_array).cloned().unwrap_or_default();
    for format in [common.response_format.clone(), ResponseFormat::Text] {
        if let Err(e) = chat_structure(&v, &tools, &format) {
            refused(e);
        }
    }
    reached
}

#[test]
fn request_parsing_never_panics_on_mutated_bodies() {
    let template = ChatTemplate::from_source(kiln_compiler::synth::tokenizer::CHAT_TEMPLATE).expect("the synthetic template parses");
    let seeds = seeds();
    let mut rng = Rng::new(11);
    let mut reached = std::collections::BTreeMap::new();
    for case in 0..20_000 {
        let mut v = seeds[case % seeds.len()].clone();
        for _ in 0..1 + rng.next_u64() % 4 {
            mutate(&mut v, &mut rng, 0);
        }
        let mut bytes = serde_json::to_vec(&v).expect("serialises");
        if case % 5 == 0 && !bytes.is_empty() {
            for _ in 0..1 + rng.next_u64() % 3 {
                let i = (rng.next_u64() % bytes.len() as u64) as usize;
                bytes[i] ^= 1 << (rng.next_u64() % 8);
            }
        }
        let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| parse_request(&bytes, &template)));
        let Ok(stage) = outcome else { panic!("case {case} panicked on {}", String::from_utf8_lossy(&bytes)) };
        *reached.entry(stage).or_insert(0usize) += 1;
    }
    // The mutations fail every check, and get past all of them.
    for stage in [Reached::Body, Reached::Fields, Reached::Validated, Reached::Rendered] {
        assert!(reached.get(&stage).copied().unwrap_or(0) > 100, "{reached:?}");
    }
}
