//! The tiny model's tokenizer: byte-level (every byte one token, GPT-2 byte-to-unicode alphabet)
//! plus the GLM special tokens, and the GLM-5 chat template.

use super::layout::SynthSpec;
use super::write::write_text;
use crate::error::CompileError;
use serde_json::json;
use std::path::Path;

/// GLM special tokens, numbered from 256 (right after the 256 byte tokens).
pub const SPECIAL_TOKENS: [&str; 20] = [
    "<|endoftext|>",
    "[MASK]",
    "[gMASK]",
    "[sMASK]",
    "<sop>",
    "<eop>",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|observation|>",
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    "<arg_key>",
    "</arg_key>",
    "<arg_value>",
    "</arg_value>",
];
pub const ENDOFTEXT: u32 = 256;
pub const USER: u32 = 263;
pub const OBSERVATION: u32 = 265;

pub const CHAT_TEMPLATE: &str = include_str!("chat_template.jinja");

/// GPT-2's reversible byte -> printable unicode mapping used by byte-level BPE.
fn byte_to_char(b: u8) -> char {
    let printable = |b: u8| (b'!'..=b'~').contains(&b) || (0xA1..=0xAC).contains(&b) || (0xAE..=0xFF).contains(&b);
    if printable(b) {
        return char::from(b);
    }
    let shifted = (0..b).filter(|&x| !printable(x)).count() as u32;
    char::from_u32(256 + shifted).expect("valid char")
}

pub fn write_tokenizer_files(dir: &Path, spec: &SynthSpec) -> Result<(), CompileError> {
    assert!(spec.vocab >= 256 + SPECIAL_TOKENS.len(), "tiny vocab too small for the tokenizer");
    let vocab: serde_json::Map<String, serde_json::Value> =
        (0..=255u8).map(|b| (byte_to_char(b).to_string(), json!(b as u32))).collect();
    let added: Vec<_> = SPECIAL_TOKENS
        .iter()
        .enumerate()
        .map(|(i, t)| json!({"id": 256 + i, "content": t, "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true}))
        .collect();
    let tokenizer = json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": null,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true},
        "post_processor": null,
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
        "model": {
            "type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
            "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
            "vocab": vocab, "merges": []
        }
    });
    write_text(dir, "tokenizer.json", &(serde_json::to_string_pretty(&tokenizer).expect("json") + "\n"))?;
    let config = json!({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "<|endoftext|>",
        "pad_token": "<|endoftext|>",
        "clean_up_tokenization_spaces": false,
        "model_max_length": spec.max_positions,
    });
    write_text(dir, "tokenizer_config.json", &(serde_json::to_string_pretty(&config).expect("json") + "\n"))?;
    write_text(dir, "chat_template.jinja", CHAT_TEMPLATE)?;
    let generation = json!({"eos_token_id": [ENDOFTEXT, USER, OBSERVATION], "pad_token_id": ENDOFTEXT});
    write_text(dir, "generation_config.json", &(serde_json::to_string_pretty(&generation).expect("json") + "\n"))
}
