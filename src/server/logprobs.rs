//! Log-probabilities in the two OpenAI shapes: chat's `logprobs.content` entries and the legacy
//! completions object of parallel lists.

use kiln_engine::sampling::TokenLogprobs;
use kiln_engine::tokenizer::Tokenizer;
use serde_json::{json, Map, Value};

/// One generated token's log-probabilities, with the token texts resolved.
#[derive(Debug, Clone)]
pub struct TokenInfo {
    pub token: Piece,
    pub logprob: f32,
    pub top: Vec<(Piece, f32)>,
}

#[derive(Debug, Clone)]
pub struct Piece {
    /// The token's text (a token that ends inside a UTF-8 character shows U+FFFD), or
    /// `token_id:N` when the request set vLLM's `return_tokens_as_token_ids`.
    pub text: String,
    pub bytes: Vec<u8>,
}

impl Piece {
    fn of(tok: &Tokenizer, id: u32, as_id: bool) -> Piece {
        let bytes = tok.token_bytes(id);
        let text = if as_id { format!("token_id:{id}") } else { String::from_utf8_lossy(&bytes).into_owned() };
        Piece { text, bytes }
    }
}

impl TokenInfo {
    pub fn new(tok: &Tokenizer, id: u32, lp: &TokenLogprobs, as_ids: bool) -> TokenInfo {
        let top = lp.top.iter().map(|&(t, l)| (Piece::of(tok, t, as_ids), l)).collect();
        TokenInfo { token: Piece::of(tok, id, as_ids), logprob: lp.logprob, top }
    }
}

/// A logprob as JSON: -inf (a token the model rules out) is not JSON, so it becomes -9999.0,
/// the floor OpenAI documents for "very unlikely".
fn number(lp: f32) -> Value {
    json!(if lp.is_finite() { lp.max(-9999.0) } else { -9999.0 })
}

/// One entry of chat's `choices[].logprobs.content`.
pub fn chat_entry(t: &TokenInfo) -> Value {
    let top: Vec<Value> = t.top.iter().map(|(p, l)| json!({"token": p.text, "logprob": number(*l), "bytes": p.bytes})).collect();
    json!({"token": t.token.text, "logprob": number(t.logprob), "bytes": t.token.bytes, "top_logprobs": top})
}

/// Chat's `logprobs` object for `entries`.
pub fn chat_logprobs(entries: Vec<Value>) -> Value {
    json!({"content": entries})
}

/// The completions shape: `tokens`, `token_logprobs`, `top_logprobs` (token -> logprob maps)
/// and `text_offset` (where each token starts in the choice's text).
#[derive(Debug, Default)]
pub struct CompletionLogprobs {
    tokens: Vec<Value>,
    token_logprobs: Vec<Value>,
    top_logprobs: Vec<Value>,
    text_offset: Vec<usize>,
}

impl CompletionLogprobs {
    pub fn push(&mut self, t: &TokenInfo, offset: usize) {
        self.tokens.push(t.token.text.clone().into());
        self.token_logprobs.push(number(t.logprob));
        let top: Map<String, Value> = t.top.iter().map(|(p, l)| (p.text.clone(), number(*l))).collect();
        self.top_logprobs.push(Value::Object(top));
        self.text_offset.push(offset);
    }

    /// The object so far, and empties it (streaming sends each token's part once).
    pub fn take(&mut self) -> Value {
        let me = std::mem::take(self);
        json!({"tokens": me.tokens, "token_logprobs": me.token_logprobs, "top_logprobs": me.top_logprobs, "text_offset": me.text_offset})
    }
}
