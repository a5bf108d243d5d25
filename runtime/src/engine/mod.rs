//! The engine layer: what turns a runnable plan into text generation (sampling, tokenizer).

pub mod sampling;
pub mod tokenizer;
