//! `kiln synth`: deterministic synthetic checkpoints in the exact Hugging Face / ModelOpt layout.
//! `tiny`: small random weights with real NVFP4 tensors, a byte-level tokenizer and the GLM-5 chat
//! template (tests and the demo); `micro`: the same at the smallest shapes (for the emulator).
//! `glm5`: the full-size GLM-5-NVFP4 tensor table as header-only
//! shards whose data regions are sparse holes (compile the real geometry without 440 GB of disk).

mod layout;
mod quantize;
pub mod tokenizer;
mod write;

pub use quantize::{quantize, QuantizeReport, GLM5_NVFP4_EXCLUDES};

pub use layout::{checkpoint_tensors, SynthSpec, SynthTensor, TensorInit};

use crate::error::CompileError;
use std::path::Path;

pub const PRESETS: [&str; 3] = ["tiny", "micro", "glm5"];

/// The real GLM-5 `config.json` and NVIDIA's NVFP4 quantisation config, shipped under artifacts/.
pub const GLM5_CONFIG: &str = include_str!("../../../artifacts/GLM-5-NVFP4/config.json");
pub const GLM5_QUANT_CONFIG: &str = include_str!("../../../artifacts/GLM-5-NVFP4/hf_quant_config.json");

pub struct SynthReport {
    pub files: usize,
    pub tensors: usize,
    /// Logical bytes of tensor data (sparse holes included).
    pub data_bytes: u64,
}

/// The GLM-5 skeleton cut to its first `layers` decoder layers (the MTP layer follows them), with
/// the byte-level stand-in tokenizer: the real per-layer shapes in a size one GPU holds, so the
/// GLM-5 kernels can be run and timed (`scripts/gpu-check.sh`). Its weights are zeros.
pub fn synth_glm5_slice(out: &Path, layers: usize) -> Result<SynthReport, CompileError> {
    let mut spec = SynthSpec::from_config(GLM5_CONFIG, GLM5_QUANT_CONFIG)?;
    if layers == 0 || layers > spec.layers {
        return Err(CompileError::Option {
            option: "--layers".into(),
            message: format!("{layers}: GLM-5 has 1..={} decoder layers", spec.layers),
        });
    }
    spec.layers = layers;
    let mut config: serde_json::Value = serde_json::from_str(GLM5_CONFIG).expect("the shipped GLM-5 config is JSON");
    config["num_hidden_layers"] = layers.into();
    std::fs::create_dir_all(out).map_err(CompileError::io(out))?;
    write::write_text(out, "config.json", &(serde_json::to_string_pretty(&config).expect("json") + "\n"))?;
    write::write_text(out, "hf_quant_config.json", GLM5_QUANT_CONFIG)?;
    tokenizer::write_tokenizer_files(out, &spec)?;
    write::write_checkpoint(out, &spec, spec.layers + spec.mtp_layers + 2, &write::Values::Holes)
}

pub fn synth(preset: &str, out: &Path, seed: u64) -> Result<SynthReport, CompileError> {
    std::fs::create_dir_all(out).map_err(CompileError::io(out))?;
    match preset {
        "tiny" | "micro" => {
            let spec = if preset == "tiny" { SynthSpec::tiny() } else { SynthSpec::micro() };
            write::write_text(out, "config.json", &spec.config_json())?;
            write::write_text(out, "hf_quant_config.json", &spec.quant_json())?;
            tokenizer::write_tokenizer_files(out, &spec)?;
            write::write_checkpoint(out, &spec, 2, &write::Values::Random { seed })
        }
        "glm5" => {
            let spec = SynthSpec::from_config(GLM5_CONFIG, GLM5_QUANT_CONFIG)?;
            write::write_text(out, "config.json", GLM5_CONFIG)?;
            write::write_text(out, "hf_quant_config.json", GLM5_QUANT_CONFIG)?;
            write::write_checkpoint(out, &spec, spec.layers + spec.mtp_layers + 2, &write::Values::Holes)
        }
        other => Err(CompileError::Option {
            option: "PRESET".into(),
            message: format!("unknown preset {other:?}; choose one of {}", PRESETS.join(", ")),
        }),
    }
}
