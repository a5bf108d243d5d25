//! Request fields shared by chat and text completions, validated with the offending `param` named.

use super::errors::ApiError;
use kiln_engine::sampling::SamplingParams;
use kiln_engine::scheduler::MAX_TOP_LOGPROBS;
use serde_json::Value;

pub const MAX_STOP_STRINGS: usize = 16;
pub const MAX_STOP_BYTES: usize = 256;
/// Most choices per request (`n`): each is a sequence of its own.
pub const MAX_CHOICES: usize = 16;
pub const MAX_STOP_TOKEN_IDS: usize = 64;

/// `response_format`: what the content must be (enforced by constrained decoding).
#[derive(Debug, Clone, PartialEq)]
pub enum ResponseFormat {
    Text,
    JsonObject,
    JsonSchema(Value),
}

pub struct CommonParams {
    pub model: Option<String>,
    /// None: as many as the context allows.
    pub max_tokens: Option<usize>,
    pub sampling: SamplingParams,
    pub stop: Vec<String>,
    pub stream: bool,
    pub include_usage: bool,
    pub ignore_eos: bool,
    /// Independent choices.
    pub n: usize,
    pub min_tokens: usize,
    pub stop_token_ids: Vec<u32>,
    /// Log-probabilities of the sampled tokens and of this many alternatives.
    pub logprobs: Option<usize>,
    /// vLLM's `return_tokens_as_token_ids`: logprob tokens as `token_id:N`.
    pub tokens_as_ids: bool,
    pub response_format: ResponseFormat,
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
    let n = match integer(v, "n")? {
        None => 1,
        Some(n) if (1..=MAX_CHOICES as i64).contains(&n) => n as usize,
        Some(n) => return Err(ApiError::invalid(format!("`n` must be in 1..={MAX_CHOICES}, got {n}"), Some("n"))),
    };
    refuse_unsupported(v)?;
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
    let penalty = |key: &'static str, default: f64, ok: fn(f64) -> bool, range: &str| -> Result<f32, ApiError> {
        let x = number(v, key)?.unwrap_or(default);
        if !ok(x) {
            return Err(ApiError::invalid(format!("`{key}` must be {range}, got {x}"), Some(key)));
        }
        Ok(x as f32)
    };
    let presence_penalty = penalty("presence_penalty", 0.0, |x| (-2.0..=2.0).contains(&x), "in [-2, 2]")?;
    let frequency_penalty = penalty("frequency_penalty", 0.0, |x| (-2.0..=2.0).contains(&x), "in [-2, 2]")?;
    let repetition_penalty = penalty("repetition_penalty", 1.0, |x| x > 0.0 && x.is_finite(), "> 0")?;
    let min_tokens = match integer(v, "min_tokens")? {
        None => 0,
        Some(m) if m >= 0 => m as usize,
        Some(m) => return Err(ApiError::invalid(format!("`min_tokens` must be >= 0, got {m}"), Some("min_tokens"))),
    };
    if let Some(max) = max_tokens.filter(|&m| m < min_tokens) {
        return Err(ApiError::invalid(format!("`min_tokens` ({min_tokens}) is larger than `{key}` ({max})"), Some("min_tokens")));
    }
    let stop_token_ids = match v.get("stop_token_ids") {
        None | Some(Value::Null) => vec![],
        Some(Value::Array(ids)) if ids.len() <= MAX_STOP_TOKEN_IDS => ids
            .iter()
            .map(|i| i.as_u64().and_then(|i| u32::try_from(i).ok()).ok_or_else(|| ApiError::invalid(format!("`stop_token_ids` must hold token ids, got {i}"), Some("stop_token_ids"))))
            .collect::<Result<_, _>>()?,
        Some(_) => return Err(ApiError::invalid(format!("`stop_token_ids` must be a list of at most {MAX_STOP_TOKEN_IDS} token ids"), Some("stop_token_ids"))),
    };
    let logprobs = if chat { chat_logprobs(v)? } else { completion_logprobs(v)? };
    let response_format = response_format(v)?;
    let stream = boolean(v, "stream")?;
    let include_usage = v.get("stream_options").map(|o| boolean(o, "include_usage")).transpose()?.unwrap_or(false);
    Ok(CommonParams {
        model,
        max_tokens,
        sampling: SamplingParams { temperature: temperature as f32, top_p: top_p as f32, top_k, seed, presence_penalty, frequency_penalty, repetition_penalty },
        stop,
        stream,
        include_usage,
        ignore_eos: boolean(v, "ignore_eos")?,
        n,
        min_tokens,
        stop_token_ids,
        logprobs,
        tokens_as_ids: boolean(v, "return_tokens_as_token_ids")?,
        response_format,
        forced_output: v.get("kiln_forced_output").and_then(Value::as_str).map(String::from),
    })
}

/// Fields kiln does not implement, refused by name rather than silently ignored.
fn refuse_unsupported(v: &Value) -> Result<(), ApiError> {
    let refuse = |key: &'static str, why: &str| Err(ApiError::invalid(format!("`{key}` is not supported: {why}"), Some(key)));
    if integer(v, "best_of")?.is_some_and(|b| b != 1) {
        return refuse("best_of", "use `n` for several choices");
    }
    if boolean(v, "echo")? {
        return refuse("echo", "the prompt is not returned");
    }
    if v.get("logit_bias").is_some_and(|b| b.as_object().is_some_and(|o| !o.is_empty()) || !(b.is_null() || b.is_object())) {
        return refuse("logit_bias", "use `response_format` or `stop_token_ids` to shape the output");
    }
    if v.get("suffix").is_some_and(|s| !s.is_null()) {
        return refuse("suffix", "GLM-5 has no fill-in-the-middle format");
    }
    if v.get("prediction").is_some_and(|s| !s.is_null()) {
        return refuse("prediction", "predicted outputs are not implemented");
    }
    if v.get("audio").is_some_and(|s| !s.is_null()) || v.get("modalities").is_some_and(|m| m.as_array().is_some_and(|m| m.iter().any(|x| x != "text"))) {
        return refuse("modalities", "only text");
    }
    Ok(())
}

/// Chat: `logprobs: true` and `top_logprobs` (0..=20, only with `logprobs`).
fn chat_logprobs(v: &Value) -> Result<Option<usize>, ApiError> {
    let on = boolean(v, "logprobs")?;
    let top = integer(v, "top_logprobs")?;
    match (on, top) {
        (_, Some(t)) if !(0..=MAX_TOP_LOGPROBS as i64).contains(&t) => {
            Err(ApiError::invalid(format!("`top_logprobs` must be in 0..={MAX_TOP_LOGPROBS}, got {t}"), Some("top_logprobs")))
        }
        (false, Some(_)) => Err(ApiError::invalid("`top_logprobs` needs `logprobs: true`", Some("top_logprobs"))),
        (true, t) => Ok(Some(t.unwrap_or(0) as usize)),
        (false, None) => Ok(None),
    }
}

/// Completions: `logprobs: N` alternatives (0..=20; OpenAI allows 5, vLLM 20).
fn completion_logprobs(v: &Value) -> Result<Option<usize>, ApiError> {
    match v.get("logprobs") {
        None | Some(Value::Null) => Ok(None),
        Some(x) => match x.as_i64() {
            Some(n) if (0..=MAX_TOP_LOGPROBS as i64).contains(&n) => Ok(Some(n as usize)),
            _ => Err(ApiError::invalid(format!("`logprobs` must be an integer in 0..={MAX_TOP_LOGPROBS}, got {x}"), Some("logprobs"))),
        },
    }
}

fn response_format(v: &Value) -> Result<ResponseFormat, ApiError> {
    let bad = |m: String| ApiError::invalid(m, Some("response_format"));
    let Some(f) = v.get("response_format").filter(|f| !f.is_null()) else { return Ok(ResponseFormat::Text) };
    match f.get("type").and_then(Value::as_str) {
        Some("text") => Ok(ResponseFormat::Text),
        Some("json_object") => Ok(ResponseFormat::JsonObject),
        Some("json_schema") => {
            let schema = f
                .get("json_schema")
                .and_then(|j| j.get("schema"))
                .filter(|s| s.is_object() || s.is_boolean())
                .ok_or_else(|| bad("`response_format.json_schema.schema` must be a JSON schema object".into()))?;
            Ok(ResponseFormat::JsonSchema(schema.clone()))
        }
        Some(other) => Err(bad(format!("`response_format.type` must be text, json_object or json_schema, got {other:?}"))),
        None => Err(bad("`response_format` needs a `type`".into())),
    }
}
