//! The tensor table of a `glm_moe_dsa` checkpoint (glm5.md section 3), quantised per the
//! ModelOpt exclude list: what `kiln synth` writes.

use crate::checkpoint::glob::module_excluded;
use crate::error::CompileError;
use kiln_runtime::plan::DType;
use serde_json::{json, Value};

/// The architecture numbers a synthetic checkpoint needs.
#[derive(Debug, Clone)]
pub struct SynthSpec {
    pub hidden: usize,
    pub layers: usize,
    pub mtp_layers: usize,
    pub vocab: usize,
    pub intermediate: usize,
    pub moe_intermediate: usize,
    pub experts: usize,
    pub shared_experts: usize,
    pub experts_per_tok: usize,
    pub n_group: usize,
    pub topk_group: usize,
    pub first_dense: usize,
    pub heads: usize,
    pub q_lora: usize,
    pub kv_lora: usize,
    pub nope: usize,
    pub rope: usize,
    pub v: usize,
    pub index_heads: usize,
    pub index_dim: usize,
    pub index_topk: usize,
    pub max_positions: usize,
    pub rope_theta: f64,
    /// ModelOpt exclude patterns (modules kept in BF16).
    pub exclude: Vec<String>,
    /// Static activation scale written as every `input_scale` (amax / (6 * 448)).
    pub input_scale: f32,
}

/// How a tensor's values are generated (only for checkpoints with data).
#[derive(Debug, Clone, PartialEq)]
pub enum TensorInit {
    /// Normal(0, std) in BF16.
    Normal { std: f32 },
    /// Uniform in [0.8, 1.2): norm weights near 1 but not 1, so a wrong norm shows.
    NearOne,
    /// Normal(0, std), stored as `dtype` (biases).
    Bias { std: f32 },
    /// Part of an NVFP4 linear whose BF16 master is Normal(0, std) of shape [n, k].
    Nvfp4 { module: String, n: usize, k: usize, std: f32, part: Nvfp4Part },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Nvfp4Part {
    Weight,
    Scale,
    Scale2,
    InputScale,
}

#[derive(Debug, Clone)]
pub struct SynthTensor {
    pub name: String,
    pub dtype: DType,
    pub shape: Vec<usize>,
    pub init: TensorInit,
    /// 0: embeddings and head, 1 + layer, then 1 + layers (+ mtp) for the final norm.
    pub group: usize,
}

impl SynthSpec {
    /// The demo/test model: every shape shardable over 8 ranks, sparse attention active beyond 16 tokens.
    pub fn tiny() -> SynthSpec {
        SynthSpec {
            hidden: 256,
            layers: 4,
            mtp_layers: 1,
            vocab: 320,
            intermediate: 512,
            moe_intermediate: 128,
            experts: 16,
            shared_experts: 1,
            experts_per_tok: 4,
            n_group: 4,
            topk_group: 2,
            first_dense: 1,
            heads: 8,
            q_lora: 128,
            kv_lora: 64,
            nope: 32,
            rope: 16,
            v: 32,
            index_heads: 8,
            index_dim: 32,
            index_topk: 16,
            max_positions: 1024,
            rope_theta: 10000.0,
            exclude: vec![
                "lm_head".into(),
                "model.embed_tokens".into(),
                "model.layers.*.self_attn*".into(),
                "model.layers.*.mlp.gate".into(),
                "model.layers.4*".into(),
            ],
            input_scale: 16.0 / (6.0 * 448.0),
        }
    }

    /// `tiny` cut to the smallest shapes the kernels take (2 layers, hidden 96, 8 experts) with
    /// the same tokenizer: for runs on the PTX emulator, e.g. serving through the driver double.
    pub fn micro() -> SynthSpec {
        SynthSpec {
            hidden: 96,
            layers: 2,
            intermediate: 192,
            moe_intermediate: 64,
            experts: 8,
            experts_per_tok: 2,
            n_group: 1,
            topk_group: 1,
            heads: 4,
            q_lora: 48,
            kv_lora: 16,
            nope: 24,
            index_heads: 4,
            index_topk: 8,
            exclude: vec![
                "lm_head".into(),
                "model.embed_tokens".into(),
                "model.layers.*.self_attn*".into(),
                "model.layers.*.mlp.gate".into(),
                "model.layers.2*".into(),
            ],
            ..SynthSpec::tiny()
        }
    }

    pub fn config_json(&self) -> String {
        let v = json!({
            "architectures": ["GlmMoeDsaForCausalLM"],
            "attention_bias": false,
            "dtype": "bfloat16",
            "eos_token_id": [crate::synth::tokenizer::ENDOFTEXT, crate::synth::tokenizer::USER, crate::synth::tokenizer::OBSERVATION],
            "first_k_dense_replace": self.first_dense,
            "hidden_act": "silu",
            "head_dim": self.rope,
            "hidden_size": self.hidden,
            "index_head_dim": self.index_dim,
            "index_n_heads": self.index_heads,
            "index_topk": self.index_topk,
            "indexer_rope_interleave": true,
            "intermediate_size": self.intermediate,
            "kv_lora_rank": self.kv_lora,
            "max_position_embeddings": self.max_positions,
            "moe_intermediate_size": self.moe_intermediate,
            "moe_layer_freq": 1,
            "model_type": "glm_moe_dsa",
            "n_group": self.n_group,
            "n_routed_experts": self.experts,
            "n_shared_experts": self.shared_experts,
            "norm_topk_prob": true,
            "num_attention_heads": self.heads,
            "num_experts_per_tok": self.experts_per_tok,
            "num_hidden_layers": self.layers,
            "num_key_value_heads": self.heads,
            "num_nextn_predict_layers": self.mtp_layers,
            "pad_token_id": crate::synth::tokenizer::ENDOFTEXT,
            "q_lora_rank": self.q_lora,
            "qk_head_dim": self.nope + self.rope,
            "qk_nope_head_dim": self.nope,
            "qk_rope_head_dim": self.rope,
            "rms_norm_eps": 1e-5,
            "rope_interleave": true,
            "rope_parameters": {"rope_theta": self.rope_theta, "rope_type": "default"},
            "routed_scaling_factor": 2.5,
            "scoring_func": "sigmoid",
            "tie_word_embeddings": false,
            "topk_group": self.topk_group,
            "topk_method": "noaux_tc",
            "v_head_dim": self.v,
            "vocab_size": self.vocab,
        });
        serde_json::to_string_pretty(&v).expect("json") + "\n"
    }

    pub fn quant_json(&self) -> String {
        let v = json!({
            "producer": {"name": "modelopt", "version": "kiln-synth"},
            "quantization": {"quant_algo": "NVFP4", "kv_cache_quant_algo": null, "group_size": 16, "exclude_modules": self.exclude},
        });
        serde_json::to_string_pretty(&v).expect("json") + "\n"
    }

    /// Reads the numbers from a real `config.json` and `hf_quant_config.json`.
    pub fn from_config(config: &str, quant: &str) -> Result<SynthSpec, CompileError> {
        let c: Value = serde_json::from_str(config).map_err(|e| CompileError::Json { path: "config.json".into(), message: e.to_string() })?;
        let q: Value = serde_json::from_str(quant).map_err(|e| CompileError::Json { path: "hf_quant_config.json".into(), message: e.to_string() })?;
        let n = |k: &str| -> Result<usize, CompileError> {
            c.get(k).and_then(Value::as_u64).map(|v| v as usize).ok_or_else(|| CompileError::Config {
                path: "config.json".into(),
                field: k.into(),
                message: "missing".into(),
            })
        };
        Ok(SynthSpec {
            hidden: n("hidden_size")?,
            layers: n("num_hidden_layers")?,
            mtp_layers: n("num_nextn_predict_layers").unwrap_or(0),
            vocab: n("vocab_size")?,
            intermediate: n("intermediate_size")?,
            moe_intermediate: n("moe_intermediate_size")?,
            experts: n("n_routed_experts")?,
            shared_experts: n("n_shared_experts")?,
            experts_per_tok: n("num_experts_per_tok")?,
            n_group: n("n_group")?,
            topk_group: n("topk_group")?,
            first_dense: n("first_k_dense_replace")?,
            heads: n("num_attention_heads")?,
            q_lora: n("q_lora_rank")?,
            kv_lora: n("kv_lora_rank")?,
            nope: n("qk_nope_head_dim")?,
            rope: n("qk_rope_head_dim")?,
            v: n("v_head_dim")?,
            index_heads: n("index_n_heads")?,
            index_dim: n("index_head_dim")?,
            index_topk: n("index_topk")?,
            max_positions: n("max_position_embeddings")?,
            rope_theta: c.pointer("/rope_parameters/rope_theta").and_then(Value::as_f64).unwrap_or(1e6),
            exclude: q
                .pointer("/quantization/exclude_modules")
                .and_then(Value::as_array)
                .map(|a| a.iter().filter_map(|s| s.as_str().map(String::from)).collect())
                .unwrap_or_default(),
            input_scale: 16.0 / (6.0 * 448.0),
        })
    }
}

struct Table<'a> {
    spec: &'a SynthSpec,
    out: Vec<SynthTensor>,
    group: usize,
}

impl Table<'_> {
    fn plain(&mut self, name: String, dtype: DType, shape: Vec<usize>, init: TensorInit) {
        self.out.push(SynthTensor { name, dtype, shape, init, group: self.group });
    }

    fn norm(&mut self, name: String, dim: usize) {
        self.plain(name, DType::BF16, vec![dim], TensorInit::NearOne);
    }

    /// A linear `[n, k]`: BF16 when excluded (or `force_bf16`), else the four NVFP4 tensors.
    fn linear(&mut self, module: String, n: usize, k: usize, force_bf16: bool) {
        let std = (k as f32).powf(-0.5);
        if force_bf16 || module_excluded(&module, &self.spec.exclude).is_some() {
            self.plain(format!("{module}.weight"), DType::BF16, vec![n, k], TensorInit::Normal { std });
            return;
        }
        let part = |p| TensorInit::Nvfp4 { module: module.clone(), n, k, std, part: p };
        self.plain(format!("{module}.weight"), DType::U8, vec![n, k / 2], part(Nvfp4Part::Weight));
        self.plain(format!("{module}.weight_scale"), DType::F8E4M3, vec![n, k / 16], part(Nvfp4Part::Scale));
        self.plain(format!("{module}.weight_scale_2"), DType::F32, vec![], part(Nvfp4Part::Scale2));
        self.plain(format!("{module}.input_scale"), DType::F32, vec![], part(Nvfp4Part::InputScale));
    }

    fn layer(&mut self, l: usize, mtp: bool) {
        let s = self.spec;
        let h = s.hidden;
        let p = format!("model.layers.{l}");
        self.norm(format!("{p}.input_layernorm.weight"), h);
        self.norm(format!("{p}.post_attention_layernorm.weight"), h);
        let a = format!("{p}.self_attn");
        self.linear(format!("{a}.q_a_proj"), s.q_lora, h, false);
        self.norm(format!("{a}.q_a_layernorm.weight"), s.q_lora);
        self.linear(format!("{a}.q_b_proj"), s.heads * (s.nope + s.rope), s.q_lora, false);
        self.linear(format!("{a}.kv_a_proj_with_mqa"), s.kv_lora + s.rope, h, false);
        self.norm(format!("{a}.kv_a_layernorm.weight"), s.kv_lora);
        self.linear(format!("{a}.kv_b_proj"), s.heads * (s.nope + s.v), s.kv_lora, true);
        self.linear(format!("{a}.o_proj"), h, s.heads * s.v, false);
        let i = format!("{a}.indexer");
        self.linear(format!("{i}.wq_b"), s.index_heads * s.index_dim, s.q_lora, false);
        self.linear(format!("{i}.wk"), s.index_dim, h, false);
        self.norm(format!("{i}.k_norm.weight"), s.index_dim);
        self.plain(format!("{i}.k_norm.bias"), DType::BF16, vec![s.index_dim], TensorInit::Bias { std: 0.1 });
        self.linear(format!("{i}.weights_proj"), s.index_heads, h, true);
        let m = format!("{p}.mlp");
        if l < s.first_dense {
            self.linear(format!("{m}.gate_proj"), s.intermediate, h, false);
            self.linear(format!("{m}.up_proj"), s.intermediate, h, false);
            self.linear(format!("{m}.down_proj"), h, s.intermediate, false);
        } else {
            self.plain(format!("{m}.gate.weight"), DType::BF16, vec![s.experts, h], TensorInit::Normal { std: (h as f32).powf(-0.5) });
            self.plain(format!("{m}.gate.e_score_correction_bias"), DType::F32, vec![s.experts], TensorInit::Bias { std: 0.1 });
            for e in 0..s.experts {
                self.linear(format!("{m}.experts.{e}.gate_proj"), s.moe_intermediate, h, false);
                self.linear(format!("{m}.experts.{e}.up_proj"), s.moe_intermediate, h, false);
                self.linear(format!("{m}.experts.{e}.down_proj"), h, s.moe_intermediate, false);
            }
            let si = s.moe_intermediate * s.shared_experts;
            self.linear(format!("{m}.shared_experts.gate_proj"), si, h, false);
            self.linear(format!("{m}.shared_experts.up_proj"), si, h, false);
            self.linear(format!("{m}.shared_experts.down_proj"), h, si, false);
        }
        if mtp {
            self.linear(format!("{p}.eh_proj"), h, 2 * h, true);
            self.norm(format!("{p}.enorm.weight"), h);
            self.norm(format!("{p}.hnorm.weight"), h);
            self.norm(format!("{p}.shared_head.norm.weight"), h);
        }
    }
}

/// Every tensor of the checkpoint, in file order.
pub fn checkpoint_tensors(spec: &SynthSpec) -> Vec<SynthTensor> {
    let mut t = Table { spec, out: Vec::new(), group: 0 };
    let h = spec.hidden;
    t.plain("model.embed_tokens.weight".into(), DType::BF16, vec![spec.vocab, h], TensorInit::Normal { std: 1.0 });
    t.linear("lm_head".into(), spec.vocab, h, false);
    for l in 0..spec.layers + spec.mtp_layers {
        t.group = 1 + l;
        t.layer(l, l >= spec.layers);
    }
    t.group = 1 + spec.layers + spec.mtp_layers;
    t.norm("model.norm.weight".into(), h);
    t.out
}
