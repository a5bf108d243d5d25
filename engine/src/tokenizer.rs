//! The checkpoint's tokenizer (`tokenizer.json`, copied into the artifact) with incremental
//! detokenisation for streaming.

use std::path::Path;

#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    #[error("{path}: cannot load the tokenizer: {message}")]
    Load { path: String, message: String },
    #[error("tokenizer: {0}")]
    Codec(String),
}

pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
}

impl Tokenizer {
    /// Loads `dir/tokenizer.json`.
    pub fn from_dir(dir: &Path) -> Result<Tokenizer, TokenizerError> {
        let path = dir.join("tokenizer.json");
        let inner = tokenizers::Tokenizer::from_file(&path)
            .map_err(|e| TokenizerError::Load { path: path.display().to_string(), message: e.to_string() })?;
        Ok(Tokenizer { inner })
    }

    /// Token ids of `text`; special tokens written in the text (e.g. `<|user|>`) are recognised.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, TokenizerError> {
        let enc = self.inner.encode(text, false).map_err(|e| TokenizerError::Codec(e.to_string()))?;
        Ok(enc.get_ids().to_vec())
    }

    pub fn decode(&self, ids: &[u32]) -> Result<String, TokenizerError> {
        self.inner.decode(ids, false).map_err(|e| TokenizerError::Codec(e.to_string()))
    }

    pub fn token_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// The bytes token `id` stands for (what OpenAI's logprobs call `bytes`): a byte-level BPE
    /// token's string mapped back through GPT-2's byte alphabet, or the token's text when it is
    /// not byte-level (added tokens such as `<think>` are their own text either way).
    pub fn token_bytes(&self, id: u32) -> Vec<u8> {
        let Some(piece) = self.inner.id_to_token(id) else { return Vec::new() };
        let special = self.inner.get_added_vocabulary().get_added_tokens_decoder().get(&id).is_some_and(|t| t.special);
        match piece.chars().map(byte_of_char).collect::<Option<Vec<u8>>>() {
            Some(bytes) if !special => bytes,
            _ => piece.into_bytes(),
        }
    }

    /// The underlying tokenizer, for code that needs its vocabulary (constrained decoding).
    pub fn inner(&self) -> &tokenizers::Tokenizer {
        &self.inner
    }
}

/// Inverse of GPT-2's byte -> printable character map: printable Latin-1 bytes stand for
/// themselves, the other 68 bytes for U+0100 onwards in byte order.
fn byte_of_char(c: char) -> Option<u8> {
    let printable = |b: u8| (b'!'..=b'~').contains(&b) || (0xA1..=0xAC).contains(&b) || (0xAE..=0xFF).contains(&b);
    let code = c as u32;
    if code < 256 && printable(code as u8) {
        return Some(code as u8);
    }
    let shifted = code.checked_sub(256)? as usize;
    (0..=255u8).filter(|&b| !printable(b)).nth(shifted)
}

/// Turns a growing token sequence into text deltas, holding back incomplete UTF-8 (a byte-level
/// token can end in the middle of a character). Decodes only a short window per token (the
/// tokens since the last emitted text plus the one before), so long generations stay linear.
#[derive(Default)]
pub struct StreamDecoder {
    ids: Vec<u32>,
    /// Start of the window decoded for context.
    prefix: usize,
    /// End of the text already emitted.
    read: usize,
}

impl StreamDecoder {
    pub fn push(&mut self, tok: &Tokenizer, id: u32) -> Result<String, TokenizerError> {
        self.ids.push(id);
        let before = tok.decode(&self.ids[self.prefix..self.read])?;
        let now = tok.decode(&self.ids[self.prefix..])?;
        if now.len() <= before.len() || now.ends_with('\u{FFFD}') || !now.is_char_boundary(before.len()) || !now.starts_with(&before) {
            return Ok(String::new());
        }
        self.prefix = self.read;
        self.read = self.ids.len();
        Ok(now[before.len()..].to_string())
    }
}
