//! The engine layer: what turns a runnable plan into text generation.

pub mod forward;
pub mod pages;
pub mod sampling;
pub mod scheduler;
pub mod tokenizer;
