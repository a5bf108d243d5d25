use kiln_runtime::plan::DType;
use std::path::PathBuf;

/// Everything that can stop a compile. Variants say whether the input (checkpoint, flags) or
/// the compiler itself is at fault, and name the culprit.
#[derive(Debug, thiserror::Error)]
pub enum CompileError {
    // ---- the input is at fault ----
    #[error("{path}: {error}")]
    Io { path: PathBuf, error: std::io::Error },
    #[error("{path}: malformed JSON: {message}")]
    Json { path: PathBuf, message: String },
    #[error("{path}: field `{field}`: {message}")]
    Config { path: PathBuf, field: String, message: String },
    #[error("{path}: unsupported architecture {found:?}; kiln compiles `glm_moe_dsa` (GlmMoeDsaForCausalLM) checkpoints")]
    Architecture { path: PathBuf, found: String },
    #[error("{path}: {message}")]
    Safetensors { path: PathBuf, message: String },
    #[error("{dir}: no `model.safetensors.index.json` and no `model.safetensors`; is this a Hugging Face checkpoint directory?")]
    NoWeights { dir: PathBuf },
    #[error("missing tensor `{tensor}` ({needed_for}); looked in {looked_in}")]
    MissingTensor { tensor: String, needed_for: String, looked_in: String },
    #[error("tensor `{tensor}` in {file}: expected {expected_dtype} {expected_shape:?}, found {found_dtype} {found_shape:?}{hint}")]
    TensorMismatch {
        tensor: String,
        file: String,
        expected_dtype: DType,
        expected_shape: Vec<usize>,
        found_dtype: String,
        found_shape: Vec<usize>,
        hint: String,
    },
    #[error("invalid option {option}: {message}")]
    Option { option: String, message: String },
    #[error("{what} cannot be sharded over --tp {tp}: {message}")]
    Shard { what: String, tp: usize, message: String },
    #[error(
        "the model does not fit on {target} with {gpu_memory}: per GPU it needs {needed} \
         (weights {weights}, workspace {workspace}, minimum KV cache {kv_min}, headroom {headroom}), \
         {short} more than available; use more GPUs (--tp), a larger --gpu-memory, or smaller \
         --max-context, --prefill-chunk or --decode-batches"
    )]
    DoesNotFit {
        target: String,
        gpu_memory: String,
        needed: String,
        weights: String,
        workspace: String,
        kv_min: String,
        headroom: String,
        short: String,
    },
    // ---- kiln is at fault ----
    #[error("no kernel for {target} covers these steps, so the plan cannot run there: {list}")]
    NoKernel { target: String, list: String },
    #[error("kernel {kernel}: {message} (this is a kiln bug)")]
    Kernel { kernel: String, message: String },
    #[error("internal compiler error after pass `{pass}`: {message} (this is a kiln bug)")]
    Verifier { pass: &'static str, message: String },
}

impl CompileError {
    pub fn io(path: impl Into<PathBuf>) -> impl FnOnce(std::io::Error) -> CompileError {
        let path = path.into();
        move |error| CompileError::Io { path, error }
    }

    /// True when kiln itself, not the input, is at fault.
    pub fn is_internal(&self) -> bool {
        matches!(self, CompileError::Verifier { .. } | CompileError::Kernel { .. })
    }
}

/// `12.3 GiB`-style rendering for messages and reports.
pub fn human_bytes(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut value = bytes as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{bytes} B")
    } else {
        format!("{value:.2} {}", UNITS[unit])
    }
}
