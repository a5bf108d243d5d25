//! The runtime's error type. Variants say whether the input (artifact, weights, request) or kiln
//! itself is at fault, and name the culprit; nothing in the runtime panics on bad input.

use crate::plan::{DType, PlanError};
use crate::safetensors::SafetensorsError;
use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum RuntimeError {
    // ---- the input is at fault ----
    #[error(transparent)]
    Plan(#[from] PlanError),
    /// (The I/O error is part of the message, not a separate cause, so it is printed once.)
    #[error("{path}: {error}")]
    Io { path: PathBuf, error: std::io::Error },
    #[error(transparent)]
    Safetensors(#[from] SafetensorsError),
    #[error("{path}: {message}")]
    Manifest { path: PathBuf, message: String },
    #[error(
        "{dir}: no `model.safetensors.index.json` and no `model.safetensors`; pass the checkpoint \
         directory the artifact was compiled from with --weights"
    )]
    NoWeights { dir: PathBuf },
    #[error(
        "weights do not match the plan: tensor `{tensor}` is missing from {looked_in}; the plan was \
         compiled for a checkpoint with fingerprint {fingerprint}"
    )]
    MissingTensor { tensor: String, looked_in: String, fingerprint: String },
    #[error("weights do not match the plan: {0}")]
    TensorMismatch(Box<TensorMismatch>),
    /// NaN/Inf in the weights, or bytes that differ from the hashes recorded at compile time.
    #[error("{message}")]
    BadWeights { message: String },
    /// A request the plan cannot serve (bad token ids, too long, unknown sequence, ...).
    #[error("{what}: {message}")]
    Input { what: String, message: String },
    #[error("the KV cache is full: {message}")]
    KvFull { message: String },
    #[error("{message}")]
    Unsupported { message: String },
    /// The GPU, its driver or NCCL refused or failed (a missing driver, the wrong hardware, a
    /// kernel fault).
    #[error("{message}")]
    Gpu { message: String },

    // ---- kiln is at fault ----
    #[error("internal runtime error: {message} (this is a kiln bug)")]
    Internal { message: String },
}

impl RuntimeError {
    pub fn io(path: impl Into<PathBuf>) -> impl FnOnce(std::io::Error) -> RuntimeError {
        let path = path.into();
        move |error| RuntimeError::Io { path, error }
    }

    pub fn input(what: impl Into<String>, message: impl Into<String>) -> RuntimeError {
        RuntimeError::Input { what: what.into(), message: message.into() }
    }

    pub fn internal(message: impl Into<String>) -> RuntimeError {
        RuntimeError::Internal { message: message.into() }
    }

    /// True when kiln itself, not the input, is at fault.
    pub fn is_internal(&self) -> bool {
        matches!(self, RuntimeError::Internal { .. })
    }
}

/// A checkpoint tensor whose header differs from what the plan was compiled against.
#[derive(Debug)]
pub struct TensorMismatch {
    pub tensor: String,
    pub file: String,
    pub expected_dtype: DType,
    pub expected_shape: Vec<usize>,
    pub found_dtype: String,
    pub found_shape: Vec<usize>,
    /// Of the checkpoint the plan was compiled for, and of the given weights (16 hex digits).
    pub fingerprint: String,
    pub found_fingerprint: String,
}

impl std::fmt::Display for TensorMismatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "tensor `{}` in {}: the plan expects {} {:?}, found {} {:?}; the plan was compiled for a \
             checkpoint with fingerprint {}, these weights have {} (recompile with `kiln compile` for \
             these weights)",
            self.tensor,
            self.file,
            self.expected_dtype,
            self.expected_shape,
            self.found_dtype,
            self.found_shape,
            self.fingerprint,
            self.found_fingerprint
        )
    }
}
