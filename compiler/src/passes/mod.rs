//! Compiler passes, run in order by [`crate::compile`]; each is followed by its verifier.

pub mod assemble;
pub mod lower;
pub mod memory;
pub mod merge;
pub mod sequence_parallel;
pub mod shard;
pub mod specialize;
pub mod verify;
