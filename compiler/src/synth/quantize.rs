//! `kiln quantize`: a trained BF16 `glm_moe_dsa` checkpoint to ModelOpt NVFP4, quantised where
//! the shipped GLM-5-NVFP4 quantises (dense MLP, routed and shared experts; BF16 for embeddings,
//! attention, indexer, router, head and MTP layers). Weights are quantised as ModelOpt does
//! (`numerics::quantize_nvfp4`); each linear's static `input_scale` is its calibrated input amax
//! over `6 * 448`, as ModelOpt's max calibration sets it. The tensor table, quantisation config
//! and shard writer are `kiln synth`'s, so a quantised model and a synthetic one have one layout.

use super::layout::{checkpoint_tensors, SynthSpec};
use super::write::{write_checkpoint, write_text, Values};
use super::SynthReport;
use crate::error::CompileError;
use kiln_runtime::bind::CheckpointFiles;
use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// The exclude patterns of NVIDIA's GLM-5-NVFP4 `hf_quant_config.json` that hold for any depth;
/// the MTP layers (`model.layers.<num_hidden_layers + i>*`) are added per model.
pub const GLM5_NVFP4_EXCLUDES: [&str; 4] = ["lm_head", "model.embed_tokens", "model.layers.*.self_attn*", "model.layers.*.mlp.gate"];

/// Files a checkpoint directory carries besides its weights, copied when present.
const SIDE_FILES: [&str; 5] = ["tokenizer.json", "tokenizer_config.json", "generation_config.json", "chat_template.jinja", "special_tokens_map.json"];

pub struct QuantizeReport {
    pub written: SynthReport,
    /// Linears stored as NVFP4.
    pub quantised: usize,
}

/// Quantises the BF16 checkpoint in `source` into `out` with the input amax per quantised module
/// from `calibration` (a JSON object `{"model.layers.0.mlp.gate_proj": 3.25, ...}`).
pub fn quantize(source: &Path, calibration: &Path, out: &Path) -> Result<QuantizeReport, CompileError> {
    let read = |path: &Path| std::fs::read_to_string(path).map_err(CompileError::io(path));
    let config_path = source.join("config.json");
    let config = read(&config_path)?;
    let mut spec = SynthSpec::from_config(&config, "{}")?;
    spec.exclude = GLM5_NVFP4_EXCLUDES.iter().map(|s| s.to_string()).collect();
    spec.exclude.extend((spec.layers..spec.layers + spec.mtp_layers).map(|l| format!("model.layers.{l}*")));
    let input_amax: BTreeMap<String, f32> = serde_json::from_str(&read(calibration)?)
        .map_err(|e| CompileError::Json { path: calibration.to_path_buf(), message: format!("{e} (expected an object of module name -> input amax)") })?;

    let files = CheckpointFiles::open(source).map_err(|e| CompileError::Safetensors { path: source.to_path_buf(), message: e.to_string() })?;
    let table = checkpoint_tensors(&spec);
    // Nothing of the source may be lost: every tensor it has must have a place in the table
    // (an NVFP4 linear's place is its BF16 `.weight`).
    let mut expected = BTreeSet::new();
    let mut modules = BTreeSet::new();
    for t in &table {
        match &t.init {
            super::TensorInit::Nvfp4 { module, .. } => {
                expected.insert(format!("{module}.weight"));
                modules.insert(module.as_str());
            }
            _ => {
                expected.insert(t.name.clone());
            }
        }
    }
    if let Some(extra) = files.names().find(|n| !expected.contains(*n)) {
        return Err(CompileError::Safetensors {
            path: source.to_path_buf(),
            message: format!("tensor `{extra}` is not part of a glm_moe_dsa checkpoint with this config.json; kiln quantize would drop it"),
        });
    }
    if let Some(stray) = input_amax.keys().find(|m| !modules.contains(m.as_str())) {
        return Err(CompileError::Option {
            option: "--calibration".into(),
            message: format!("`{stray}` is not a linear that is quantised to NVFP4 (a misspelt module name?)"),
        });
    }

    std::fs::create_dir_all(out).map_err(CompileError::io(out))?;
    write_text(out, "config.json", &config)?;
    write_text(out, "hf_quant_config.json", &spec.quant_json())?;
    for name in SIDE_FILES {
        let from = source.join(name);
        if from.is_file() {
            std::fs::copy(&from, out.join(name)).map_err(CompileError::io(&from))?;
        }
    }
    let shards = (spec.layers + spec.mtp_layers + 2).min(4);
    let written = write_checkpoint(out, &spec, shards, &Values::Trained { source: &files, input_amax: &input_amax })?;
    Ok(QuantizeReport { written, quantised: modules.len() })
}
