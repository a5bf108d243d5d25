//! The tiny model's byte-level tokenizer, GLM special tokens and streaming detokenisation.

use kiln_engine::tokenizer::{StreamDecoder, Tokenizer};

/// Synthesised once: the tests of this file run in parallel.
fn tiny_tokenizer() -> Tokenizer {
    static DIR: std::sync::OnceLock<std::path::PathBuf> = std::sync::OnceLock::new();
    let dir = DIR.get_or_init(|| {
        let dir = std::env::temp_dir().join(format!("kiln-test-{}-tok", std::process::id()));
        kiln_compiler::synth::synth("tiny", &dir, 0).expect("synth tiny");
        dir
    });
    Tokenizer::from_dir(dir).expect("tokenizer.json loads")
}

#[test]
fn bytes_and_special_tokens_round_trip() {
    let tok = tiny_tokenizer();
    let ids = tok.encode("Hi <|user|>é").unwrap();
    // 'H' 'i' ' ' are single bytes; <|user|> is special id 263; 'é' is two UTF-8 bytes.
    assert_eq!(ids, vec![b'H' as u32, b'i' as u32, b' ' as u32, 263, 0xC3, 0xA9]);
    assert_eq!(tok.decode(&ids).unwrap(), "Hi <|user|>é");
    for (text, id) in [("<|endoftext|>", 256), ("[gMASK]", 258), ("<think>", 266), ("</arg_value>", 275)] {
        assert_eq!(tok.token_id(text), Some(id), "{text}");
    }
}

#[test]
fn streaming_holds_back_partial_characters() {
    let tok = tiny_tokenizer();
    let mut s = StreamDecoder::default();
    let deltas: Vec<String> = tok.encode("aé€b").unwrap().into_iter().map(|id| s.push(&tok, id).unwrap()).collect();
    assert_eq!(deltas, vec!["a", "", "é", "", "", "€", "b"]);
}
