//! The engine layer: what turns a runnable plan into text generation.

pub mod chat_template;
pub mod forward;
pub mod pages;
pub mod reasoning;
pub mod sampling;
pub mod scheduler;
pub mod stop;
pub mod tokenizer;
pub mod tool_calls;
