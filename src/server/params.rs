//! Request fields shared by chat and text completions, validated with the offending `param` named.

use super::errors::ApiError;
use kiln_runtime::engine::sampling::SamplingParams;
use serde_json::Value;

pub const MAX_STOP_STRINGS: usize = 16;
pub const MAX_STOP_BYTES: usize = 256;

pub struct CommonParams {
    pub model: Option<String>,
    /// None: as many as the context allows.
    pub max_tokens: Option<usize>,
    pub sampling: SamplingParams,
    pub stop: Vec<String>,
    pub stream: bool,
    pub include_usage: bool,
    pub ignore_eos: bool,
    /// Test hook text (only honoured with --enable-test-hooks).
    pub forced_output: Option<String>,
}

/// Parses a request body, naming the position of a syntax error.
pub fn parse_body(bytes: &[u8]) -> Result<Value, ApiError> {
    let v: Value = serde_json::from_slice(bytes).map_err(|e| ApiError::invalid(format!("the request body is not valid JSON: {e}"), None))?;
    if !v.is_object() {
        return Err(ApiError::invalid("the request body must be a JSON object", None));
    }
    Ok(v)
}

fn number(v: &Value, key: &'static str) -> Result<Option<f64>, ApiError> {
    match v.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(x) => x.as_f64().map(Some).ok_or_else(|| ApiError::invalid(format!("`{key}` must be a number, got {x}"), Some(key))),
    }
}

fn integer(v: &Value, key: &'static str) -> Result<Option<i64>, ApiError> {
    match v.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(x) => x.as_i64().map(Some).ok_or_else(|| ApiError::invalid(format!("`{key}` must be an integer, got {x}"), Some(key))),
    }
}

fn boolean(v: &Value, key: &'static str) -> Result<bool, ApiError> {
    match v.get(key) {
        None | Some(Value::Null) => Ok(false),
        Some(x) => x.as_bool().ok_or_else(|| ApiError::invalid(format!("`{key}` must be true or false, got {x}"), Some(key))),
    }
}

pub fn parse_common(v: &Value, chat: bool) -> Result<CommonParams, ApiError> {
    let model = match v.get("model") {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) => Some(s.clone()),
        Some(x) => return Err(ApiError::invalid(format!("`model` must be a string, got {x}"), Some("model"))),
    };
    let given = |k: &str| v.get(k).is_some_and(|x| !x.is_null());
    let key = if chat && given("max_completion_tokens") { "max_completion_tokens" } else { "max_tokens" };
    let max_tokens = match integer(v, key)? {
        None => (!chat).then_some(16),
        Some(n) if n >= 1 => Some(n as usize),
        Some(n) => return Err(ApiError::invalid(format!("`{key}` must be at least 1, got {n}"), Some(key))),
    };
    if let Some(n) = integer(v, "n")? {
        if n != 1 {
            return Err(ApiError::invalid(format!("only n = 1 is supported, got {n}"), Some("n")));
        }
    }
    let temperature = number(v, "temperature")?.unwrap_or(1.0);
    if !(0.0..=2.0).contains(&temperature) {
        return Err(ApiError::invalid(format!("`temperature` must be in [0, 2], got {temperature}"), Some("temperature")));
    }
    let top_p = number(v, "top_p")?.unwrap_or(1.0);
    if !(top_p > 0.0 && top_p <= 1.0) {
        return Err(ApiError::invalid(format!("`top_p` must be in (0, 1], got {top_p}"), Some("top_p")));
    }
    let top_k = match integer(v, "top_k")? {
        None | Some(-1) | Some(0) => 0,
        Some(k) if k > 0 => k as usize,
        Some(k) => return Err(ApiError::invalid(format!("`top_k` must be -1 (off) or positive, got {k}"), Some("top_k"))),
    };
    let seed = match integer(v, "seed")? {
        Some(s) => s as u64,
        None => std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos() as u64).unwrap_or(0),
    };
    let stop = match v.get("stop") {
        None | Some(Value::Null) => vec![],
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(items)) => items
            .iter()
            .map(|i| i.as_str().map(String::from).ok_or_else(|| ApiError::invalid("`stop` must be a string or a list of strings", Some("stop"))))
            .collect::<Result<_, _>>()?,
        Some(_) => return Err(ApiError::invalid("`stop` must be a string or a list of strings", Some("stop"))),
    };
    // Every generated token is checked against every stop string: keep that cheap.
    if stop.len() > MAX_STOP_STRINGS || stop.iter().any(|s: &String| s.len() > MAX_STOP_BYTES) {
        return Err(ApiError::invalid(format!("at most {MAX_STOP_STRINGS} stop strings of at most {MAX_STOP_BYTES} bytes each"), Some("stop")));
    }
    let stream = boolean(v, "stream")?;
    let include_usage = v.get("stream_options").map(|o| boolean(o, "include_usage")).transpose()?.unwrap_or(false);
    Ok(CommonParams {
        model,
        max_tokens,
        sampling: SamplingParams { temperature: temperature as f32, top_p: top_p as f32, top_k, seed },
        stop,
        stream,
        include_usage,
        ignore_eos: boolean(v, "ignore_eos")?,
        forced_output: v.get("kiln_forced_output").and_then(Value::as_str).map(String::from),
    })
}
