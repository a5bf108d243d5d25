//! kiln-engine: the serving layer above the runtime. It turns a runnable plan (anything that
//! implements [`forward::Forward`]) into text generation: scheduling, KV pages and the prefix
//! cache, sampling, the chat template, and the GLM reasoning and tool-call parsers.

pub mod chat_template;
pub mod constraint;
pub mod forward;
pub mod pages;
pub mod reasoning;
pub mod request;
pub mod sampling;
pub mod scheduler;
pub mod sequence;
pub mod speculation;
pub mod stop;
pub mod tokenizer;
pub mod tool_calls;
