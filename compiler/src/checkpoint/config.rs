//! `config.json` of a `glm_moe_dsa` checkpoint -> [`ModelConfig`].

use super::Checkpoint;
use crate::error::CompileError;
use kiln_runtime::plan::ModelConfig;
use serde_json::Value;

const ARCHITECTURE: &str = "GlmMoeDsaForCausalLM";
const MODEL_TYPE: &str = "glm_moe_dsa";
/// The largest integer a config field may hold: 2^24, 80x GLM-5's largest (its vocabulary).
const MAX_CONFIG_INT: u64 = 1 << 24;

struct Fields<'a> {
    json: &'a Value,
    ckpt: &'a Checkpoint,
}

impl Fields<'_> {
    fn err(&self, field: &str, message: impl Into<String>) -> CompileError {
        CompileError::Config { path: self.ckpt.config_path.clone(), field: field.into(), message: message.into() }
    }

    fn usize(&self, field: &str) -> Result<usize, CompileError> {
        match self.json.get(field) {
            None | Some(Value::Null) => Err(self.err(field, "missing (required for glm_moe_dsa)")),
            Some(v) => match v.as_u64() {
                // Sizes are multiplied together in planning: bound them so no product overflows.
                Some(n) if n > MAX_CONFIG_INT => Err(self.err(field, format!("{n} is implausibly large (at most {MAX_CONFIG_INT})"))),
                Some(n) => Ok(n as usize),
                None => Err(self.err(field, format!("expected a non-negative integer, found {v}"))),
            },
        }
    }

    fn usize_or(&self, field: &str, default: usize) -> Result<usize, CompileError> {
        match self.json.get(field) {
            None | Some(Value::Null) => Ok(default),
            Some(_) => self.usize(field),
        }
    }

    fn positive(&self, field: &str) -> Result<usize, CompileError> {
        let n = self.usize(field)?;
        if n == 0 {
            return Err(self.err(field, "must be positive"));
        }
        Ok(n)
    }

    fn f64(&self, field: &str) -> Result<f64, CompileError> {
        let v = self.json.get(field).ok_or_else(|| self.err(field, "missing (required for glm_moe_dsa)"))?;
        v.as_f64().ok_or_else(|| self.err(field, format!("expected a number, found {v}")))
    }

    fn f64_or(&self, field: &str, default: f64) -> Result<f64, CompileError> {
        match self.json.get(field) {
            None | Some(Value::Null) => Ok(default),
            Some(_) => self.f64(field),
        }
    }

    fn bool_or(&self, field: &str, default: bool) -> Result<bool, CompileError> {
        match self.json.get(field) {
            None | Some(Value::Null) => Ok(default),
            Some(v) => v.as_bool().ok_or_else(|| self.err(field, format!("expected true/false, found {v}"))),
        }
    }

    fn token_ids(&self, field: &str) -> Result<Vec<u32>, CompileError> {
        match self.json.get(field) {
            None | Some(Value::Null) => Ok(vec![]),
            Some(Value::Array(items)) => items
                .iter()
                .map(|i| i.as_u64().and_then(|n| u32::try_from(n).ok()).ok_or_else(|| self.err(field, format!("{i} is not a token id"))))
                .collect(),
            Some(v) => v.as_u64().and_then(|n| u32::try_from(n).ok()).map(|n| vec![n]).ok_or_else(|| self.err(field, format!("{v} is not a token id"))),
        }
    }
}

/// Resolves the model configuration. `qk_rope_head_dim` comes from the shape of
/// `kv_a_proj_with_mqa` (rows - kv_lora_rank), never from `head_dim`, which some transformers
/// versions alias onto it. Returns the config and warnings worth showing the user.
pub fn parse_model_config(ckpt: &Checkpoint) -> Result<(ModelConfig, Vec<String>), CompileError> {
    let f = Fields { json: &ckpt.config, ckpt };
    let mut warnings = Vec::new();
    let model_type = f.json.get("model_type").and_then(Value::as_str).unwrap_or("");
    let archs: Vec<&str> = f
        .json
        .get("architectures")
        .and_then(Value::as_array)
        .map(|a| a.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default();
    if model_type != MODEL_TYPE && !archs.contains(&ARCHITECTURE) {
        let found = if archs.is_empty() { format!("model_type {model_type:?}") } else { format!("{archs:?} (model_type {model_type:?})") };
        return Err(CompileError::Architecture { path: ckpt.config_path.clone(), found });
    }

    let (rope_theta, rope_type) = match f.json.get("rope_parameters") {
        Some(p) if p.is_object() => (
            p.get("rope_theta").and_then(Value::as_f64).ok_or_else(|| f.err("rope_parameters.rope_theta", "missing or not a number"))?,
            p.get("rope_type").and_then(Value::as_str).unwrap_or("default").to_string(),
        ),
        _ => (
            f.f64("rope_theta")?,
            f.json.get("rope_scaling").and_then(|s| s.get("rope_type").or(s.get("type"))).and_then(Value::as_str).unwrap_or("default").to_string(),
        ),
    };
    if rope_type != "default" {
        return Err(f.err("rope_parameters.rope_type", format!("{rope_type:?} is not supported; GLM-5 uses \"default\" RoPE")));
    }

    let kv_lora_rank = f.positive("kv_lora_rank")?;
    let kv_a = "model.layers.0.self_attn.kv_a_proj_with_mqa.weight";
    let kv_a_rows = ckpt.get(kv_a).and_then(|t| t.header.shape.first().copied()).ok_or_else(|| CompileError::MissingTensor {
        tensor: kv_a.into(),
        needed_for: "deriving qk_rope_head_dim from its rows".into(),
        looked_in: ckpt.looked_in(),
    })?;
    if kv_a_rows <= kv_lora_rank {
        return Err(CompileError::TensorMismatch {
            tensor: kv_a.into(),
            file: ckpt.file_of(&ckpt.tensors[kv_a]).into(),
            expected_dtype: kiln_runtime::plan::DType::BF16,
            expected_shape: vec![kv_lora_rank + 1, f.usize("hidden_size")?],
            found_dtype: ckpt.tensors[kv_a].header.dtype.clone(),
            found_shape: ckpt.tensors[kv_a].header.shape.clone(),
            hint: format!("; its rows must be kv_lora_rank ({kv_lora_rank}) + qk_rope_head_dim"),
        });
    }
    let qk_rope_head_dim = kv_a_rows - kv_lora_rank;
    if let Ok(declared) = f.usize("qk_rope_head_dim") {
        if declared != qk_rope_head_dim {
            warnings.push(format!(
                "config.json says qk_rope_head_dim {declared}, but {kv_a} has {kv_a_rows} rows = kv_lora_rank {kv_lora_rank} + {qk_rope_head_dim}; using {qk_rope_head_dim} from the tensor"
            ));
        }
    }
    if qk_rope_head_dim % 2 != 0 {
        return Err(f.err("qk_rope_head_dim", format!("{qk_rope_head_dim} (from tensor shapes) must be even for RoPE pairs")));
    }

    let num_hidden_layers = f.positive("num_hidden_layers")?;
    let index_head_dim = f.positive("index_head_dim")?;
    if index_head_dim < qk_rope_head_dim {
        return Err(f.err("index_head_dim", format!("{index_head_dim} is smaller than the rope dim {qk_rope_head_dim}")));
    }
    let n_routed_experts = f.usize_or("n_routed_experts", 0)?;
    let n_group = f.usize_or("n_group", 1)?.max(1);
    let num_experts_per_tok = f.usize_or("num_experts_per_tok", 0)?;
    let topk_group = f.usize_or("topk_group", 1)?;
    if n_routed_experts > 0 {
        if n_routed_experts % n_group != 0 {
            return Err(f.err("n_group", format!("{n_group} does not divide n_routed_experts {n_routed_experts}")));
        }
        if topk_group == 0 || topk_group > n_group {
            return Err(f.err("topk_group", format!("{topk_group} must be in 1..=n_group ({n_group})")));
        }
        if num_experts_per_tok == 0 || num_experts_per_tok > topk_group * (n_routed_experts / n_group) {
            return Err(f.err(
                "num_experts_per_tok",
                format!("{num_experts_per_tok} must be in 1..={} (topk_group x experts per group)", topk_group * (n_routed_experts / n_group)),
            ));
        }
        if let Some(s) = f.json.get("scoring_func").and_then(Value::as_str) {
            if s != "sigmoid" {
                return Err(f.err("scoring_func", format!("{s:?} is not supported; glm_moe_dsa routes with \"sigmoid\"")));
            }
        }
    }

    let config = ModelConfig {
        model_type: MODEL_TYPE.into(),
        hidden_size: f.positive("hidden_size")?,
        num_hidden_layers,
        vocab_size: f.positive("vocab_size")?,
        max_position_embeddings: f.positive("max_position_embeddings")?,
        rms_norm_eps: f.f64_or("rms_norm_eps", 1e-5)? as f32,
        latent_norm_eps: 1e-6,
        index_norm_eps: 1e-6,
        num_attention_heads: f.positive("num_attention_heads")?,
        q_lora_rank: f.positive("q_lora_rank")?,
        kv_lora_rank,
        qk_nope_head_dim: f.positive("qk_nope_head_dim")?,
        qk_rope_head_dim,
        v_head_dim: f.positive("v_head_dim")?,
        rope_theta,
        rope_interleave: f.bool_or("rope_interleave", true)?,
        index_n_heads: f.positive("index_n_heads")?,
        index_head_dim,
        index_topk: f.positive("index_topk")?,
        indexer_rope_interleave: f.bool_or("indexer_rope_interleave", true)?,
        intermediate_size: f.positive("intermediate_size")?,
        moe_intermediate_size: if n_routed_experts > 0 { f.positive("moe_intermediate_size")? } else { f.usize_or("moe_intermediate_size", 0)? },
        first_k_dense_replace: f.usize_or("first_k_dense_replace", 0)?,
        moe_layer_freq: f.usize_or("moe_layer_freq", 1)?.max(1),
        n_routed_experts,
        n_shared_experts: f.usize_or("n_shared_experts", 0)?,
        num_experts_per_tok,
        n_group,
        topk_group,
        norm_topk_prob: f.bool_or("norm_topk_prob", true)?,
        routed_scaling_factor: f.f64_or("routed_scaling_factor", 1.0)? as f32,
        tie_word_embeddings: f.bool_or("tie_word_embeddings", false)?,
        num_nextn_predict_layers: f.usize_or("num_nextn_predict_layers", 0)?,
        eos_token_ids: f.token_ids("eos_token_id")?,
        pad_token_id: f.token_ids("pad_token_id")?.first().copied(),
    };
    if !config.rope_interleave || !config.indexer_rope_interleave {
        return Err(f.err(
            if config.rope_interleave { "indexer_rope_interleave" } else { "rope_interleave" },
            "false (half-split RoPE) is not supported; GLM-5 uses interleaved RoPE in MLA and the indexer",
        ));
    }
    for t in &config.eos_token_ids {
        if *t as usize >= config.vocab_size {
            return Err(f.err("eos_token_id", format!("{t} is outside the vocabulary of {}", config.vocab_size)));
        }
    }
    Ok((config, warnings))
}
