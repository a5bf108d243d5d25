//! kiln-runtime: what the runtime can execute.
//!
//! The runtime owns the plan schema (`plan`): the compiler produces it, the backends consume it.
//! It executes plans and nothing more: the serving engine (scheduler, pages, sampling, parsers)
//! is the `kiln-engine` crate above it. Data flows one way: checkpoint -> compiler -> artifact ->
//! runtime -> engine -> server.

pub mod bind;
pub mod cpu;
pub mod cuda;
pub mod emu_backend;
pub mod error;
pub mod numerics;
pub mod perf;
pub mod plan;
pub mod rng;
pub mod safetensors;
pub mod session;
pub mod verify;
pub mod weight_check;

/// The PTX emulator (its own crate, so the CUDA driver double links only it).
pub use kiln_emu as emu;
pub use error::RuntimeError;
pub use plan::{Plan, PlanError, FORMAT_VERSION};
