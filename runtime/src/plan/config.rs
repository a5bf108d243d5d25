use serde::{Deserialize, Serialize};

/// The resolved architecture of a `glm_moe_dsa` model: every field explicit, nothing defaulted
/// at run time. Produced by the compiler from `config.json` and the tensor shapes.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelConfig {
    pub model_type: String,
    pub hidden_size: usize,
    pub num_hidden_layers: usize,
    pub vocab_size: usize,
    pub max_position_embeddings: usize,
    pub rms_norm_eps: f32,
    /// eps of `q_a_layernorm` / `kv_a_layernorm` (transformers builds them with the 1e-6 default).
    pub latent_norm_eps: f32,
    /// eps of the indexer's `k_norm` LayerNorm.
    pub index_norm_eps: f32,

    // MLA
    pub num_attention_heads: usize,
    pub q_lora_rank: usize,
    pub kv_lora_rank: usize,
    pub qk_nope_head_dim: usize,
    /// Derived from `kv_a_proj_with_mqa` rows - kv_lora_rank, never from `head_dim`.
    pub qk_rope_head_dim: usize,
    pub v_head_dim: usize,
    pub rope_theta: f64,
    pub rope_interleave: bool,

    // DSA indexer
    pub index_n_heads: usize,
    pub index_head_dim: usize,
    pub index_topk: usize,
    pub indexer_rope_interleave: bool,

    // MLP / MoE
    pub intermediate_size: usize,
    pub moe_intermediate_size: usize,
    pub first_k_dense_replace: usize,
    pub moe_layer_freq: usize,
    pub n_routed_experts: usize,
    pub n_shared_experts: usize,
    pub num_experts_per_tok: usize,
    pub n_group: usize,
    pub topk_group: usize,
    pub norm_topk_prob: bool,
    pub routed_scaling_factor: f32,

    pub tie_word_embeddings: bool,
    pub num_nextn_predict_layers: usize,
    pub eos_token_ids: Vec<u32>,
    pub pad_token_id: Option<u32>,
}

impl ModelConfig {
    pub fn qk_head_dim(&self) -> usize {
        self.qk_nope_head_dim + self.qk_rope_head_dim
    }

    /// Softmax scale of MLA: qk_head_dim^-0.5 (GLM-5 uses rope_type "default": no mscale).
    pub fn attention_scale(&self) -> f32 {
        (self.qk_head_dim() as f32).powf(-0.5)
    }

    /// Whether decoder layer `layer` uses the routed-expert MoE (else the dense MLP).
    pub fn is_moe_layer(&self, layer: usize) -> bool {
        self.n_routed_experts > 0
            && layer >= self.first_k_dense_replace
            && layer % self.moe_layer_freq.max(1) == 0
    }

    /// Values cached per token per layer: MLA latent, rope key, indexer key.
    pub fn kv_values_per_token_layer(&self) -> usize {
        self.kv_lora_rank + self.qk_rope_head_dim + self.index_head_dim
    }
}
