//! Builds the logical (unsharded) forward graph of `glm_moe_dsa` from the checkpoint, checking
//! every tensor it binds.

use super::{Binder, DraftGraph, Graph, GraphInputs, GraphWeight, ShardRole, Value};
use crate::checkpoint::Checkpoint;
use crate::error::CompileError;
use kiln_runtime::plan::{
    AttentionForm, BufId, DType, Dim, Epilogue, KernelFamily, LinearPart, LinearWeights, ModelConfig, Nvfp4Part, Op, RouterParams,
    Step, Transform, WeightId, WeightKind,
};
use std::collections::BTreeMap;

struct Builder<'a> {
    bind: Binder<'a>,
    cfg: &'a ModelConfig,
    values: Vec<Value>,
    weights: Vec<GraphWeight>,
    steps: Vec<Step>,
    /// While building the MTP layer under `--draft mtp-nvfp4`: the decoder layer whose NVFP4
    /// MLP linears lend their activation scales to the MTP layer's BF16 ones, quantised at bind.
    quantise_from: Option<usize>,
}

const T: Dim = Dim::Tokens;

impl<'a> Builder<'a> {
    fn value(&mut self, name: impl Into<String>, dtype: DType, dims: Vec<Dim>) -> BufId {
        self.values.push(Value { name: name.into(), dtype, dims });
        BufId(self.values.len() as u32 - 1)
    }

    fn tokens(&mut self, name: impl Into<String>, dtype: DType, features: usize) -> BufId {
        self.value(name, dtype, vec![T, Dim::Fixed(features)])
    }

    fn push(&mut self, op: Op, kernel: KernelFamily) {
        self.steps.push(Step { op, kernel, launches: Vec::new() });
    }

    #[allow(clippy::too_many_arguments)]
    fn weight(
        &mut self,
        name: String,
        kind: WeightKind,
        dtype: DType,
        pieces: Vec<u32>,
        piece_shape: Vec<usize>,
        experts: Option<usize>,
        role: ShardRole,
    ) -> WeightId {
        self.weights.push(GraphWeight { name, kind, dtype, pieces, piece_shape, experts, role, transform: Transform::Identity });
        WeightId(self.weights.len() as u32 - 1)
    }

    /// A single checkpoint tensor as a weight.
    fn param(&mut self, tensor: &str, dtype: DType, shape: &[usize], kind: WeightKind, role: ShardRole, why: &str) -> Result<WeightId, CompileError> {
        let id = self.bind.expect(tensor, dtype, shape, why)?;
        Ok(self.weight(logical(tensor), kind, dtype, vec![id], shape.to_vec(), None, role))
    }

    /// The weights of a linear made of `modules` (parts concatenated along the output rows; for
    /// expert stacks, `modules` is expert-major), each `[n, k]`. NVFP4 or BF16 per the quant config.
    #[allow(clippy::too_many_arguments)]
    fn linear_weights(
        &mut self,
        name: &str,
        modules: &[String],
        n: usize,
        k: usize,
        kind: WeightKind,
        role: ShardRole,
        experts: Option<usize>,
    ) -> Result<LinearWeights, CompileError> {
        let mlp = matches!(kind, WeightKind::RoutedExperts | WeightKind::SharedExperts | WeightKind::DenseMlp);
        if let (Some(donor), true, false) = (self.quantise_from, mlp, self.bind.ckpt.quant.is_nvfp4(&modules[0])) {
            return self.quantised_linear_weights(name, modules, n, k, kind, role, experts, donor);
        }
        let quant = &self.bind.ckpt.quant;
        let nvfp4 = quant.is_nvfp4(&modules[0]);
        if let Some(other) = modules.iter().find(|m| quant.is_nvfp4(m) != nvfp4) {
            return Err(CompileError::Config {
                path: self.bind.ckpt.config_path.clone(),
                field: "quantization exclude list".into(),
                message: format!("`{}` and `{other}` are computed together but only one of them is excluded from NVFP4", modules[0]),
            });
        }
        let scalar_role = scalar_role(role);
        let group = |b: &mut Self, suffix: &str, dtype: DType, shape: Vec<usize>, role: ShardRole| -> Result<WeightId, CompileError> {
            let pieces = modules
                .iter()
                .map(|m| b.bind.expect(&format!("{m}.{suffix}"), dtype, &shape, &format!("linear `{m}`")))
                .collect::<Result<Vec<_>, _>>()?;
            Ok(b.weight(format!("{name}.{suffix}"), kind, dtype, pieces, shape, experts, role))
        };
        if nvfp4 {
            if k % 16 != 0 {
                return Err(CompileError::Config {
                    path: self.bind.ckpt.config_path.clone(),
                    field: "quantization".into(),
                    message: format!("`{}` is NVFP4 but its input size {k} is not a multiple of the 16-element block", modules[0]),
                });
            }
            Ok(LinearWeights::Nvfp4 {
                weight: group(self, "weight", DType::U8, vec![n, k / 2], role)?,
                scale: group(self, "weight_scale", DType::F8E4M3, vec![n, k / 16], role)?,
                scale_2: group(self, "weight_scale_2", DType::F32, vec![], scalar_role)?,
                input_scale: group(self, "input_scale", DType::F32, vec![], scalar_role)?,
            })
        } else {
            Ok(LinearWeights::Bf16 { weight: group(self, "weight", DType::BF16, vec![n, k], role)? })
        }
    }

    /// [`Builder::linear_weights`] of BF16 checkpoint linears as NVFP4: each weight quantised
    /// at bind as ModelOpt does ([`Transform::Nvfp4`]), its activation scale (`input_scale`)
    /// the one the same module of decoder layer `donor` was calibrated with (the MTP layer's
    /// MLP inputs are normed rows as the last decoder layer's are; a draft need not be exact).
    #[allow(clippy::too_many_arguments)]
    fn quantised_linear_weights(
        &mut self,
        name: &str,
        modules: &[String],
        n: usize,
        k: usize,
        kind: WeightKind,
        role: ShardRole,
        experts: Option<usize>,
        donor: usize,
    ) -> Result<LinearWeights, CompileError> {
        let scalar_role = scalar_role(role);
        let layer = format!("model.layers.{}.", self.cfg.num_hidden_layers);
        let mut lent = Vec::new();
        for m in modules {
            let from = m.replacen(&layer, &format!("model.layers.{donor}."), 1);
            if !self.bind.ckpt.quant.is_nvfp4(&from) {
                return Err(CompileError::Config {
                    path: self.bind.ckpt.config_path.clone(),
                    field: "--draft mtp-nvfp4".into(),
                    message: format!("`{m}` would take the activation scale of `{from}`, which is not NVFP4 in this checkpoint"),
                });
            }
            lent.push(self.bind.expect(&format!("{from}.input_scale"), DType::F32, &[], &format!("the activation scale `{m}` borrows"))?);
        }
        let pieces = modules
            .iter()
            .map(|m| self.bind.expect(&format!("{m}.weight"), DType::BF16, &[n, k], &format!("linear `{m}`, quantised to NVFP4 at bind")))
            .collect::<Result<Vec<_>, _>>()?;
        let part = |b: &mut Self, suffix: &str, dtype: DType, shape: Vec<usize>, role: ShardRole, pieces: Vec<u32>, transform: Transform| {
            let id = b.weight(format!("{name}.{suffix}"), kind, dtype, pieces, shape, experts, role);
            b.weights[id.0 as usize].transform = transform;
            id
        };
        Ok(LinearWeights::Nvfp4 {
            weight: part(self, "weight", DType::U8, vec![n, k / 2], role, pieces.clone(), Transform::Nvfp4(Nvfp4Part::Codes)),
            scale: part(self, "weight_scale", DType::F8E4M3, vec![n, k / 16], role, pieces.clone(), Transform::Nvfp4(Nvfp4Part::Scales)),
            scale_2: part(self, "weight_scale_2", DType::F32, vec![], scalar_role, pieces, Transform::Nvfp4(Nvfp4Part::Scale2)),
            input_scale: part(self, "input_scale", DType::F32, vec![], scalar_role, lent, Transform::Identity),
        })
    }

    #[allow(clippy::too_many_arguments)]
    fn linear(
        &mut self,
        input: BufId,
        modules: &[String],
        n: usize,
        k: usize,
        kind: WeightKind,
        role: ShardRole,
        epilogue: Epilogue,
        out: BufId,
    ) -> Result<(), CompileError> {
        let name = logical(&modules[0]);
        let weights = self.linear_weights(&name, modules, n, k, kind, role, None)?;
        let kernel = match weights {
            LinearWeights::Bf16 { .. } => KernelFamily::LinearBf16,
            LinearWeights::Nvfp4 { .. } => KernelFamily::LinearNvfp4,
        };
        let parts = vec![LinearPart { rows: n }; modules.len()];
        self.push(Op::Linear { input, weights, parts, k, epilogue, out }, kernel);
        Ok(())
    }

    fn norm(&mut self, tensor: &str, dim: usize) -> Result<WeightId, CompileError> {
        self.param(tensor, DType::BF16, &[dim], WeightKind::Norm, ShardRole::Replicated, "RMSNorm")
    }

    fn attention(&mut self, l: usize, x: BufId, inputs: &GraphInputs) -> Result<BufId, CompileError> {
        let c = self.cfg;
        let p = format!("model.layers.{l}.self_attn");
        let h = c.hidden_size;
        let qk = c.qk_head_dim();
        let kind = WeightKind::Attention;
        let _ = inputs;

        let qa = self.tokens(format!("l{l}.q_a"), DType::BF16, c.q_lora_rank);
        self.linear(x, &[format!("{p}.q_a_proj")], c.q_lora_rank, h, kind, ShardRole::Replicated, Epilogue::None, qa)?;
        // kv_a right after q_a (both read x): where sharding splits both, one all-gather serves them
        let kv_rows = c.kv_lora_rank + c.qk_rope_head_dim;
        let kv = self.tokens(format!("l{l}.kv_a"), DType::BF16, kv_rows);
        self.linear(x, &[format!("{p}.kv_a_proj_with_mqa")], kv_rows, h, kind, ShardRole::Replicated, Epilogue::None, kv)?;
        let q_norm = self.param(&format!("{p}.q_a_layernorm.weight"), DType::BF16, &[c.q_lora_rank], WeightKind::Norm, ShardRole::Replicated, "q_a_layernorm")?;
        let q_resid = self.tokens(format!("l{l}.q_resid"), DType::BF16, c.q_lora_rank);
        self.push(Op::RmsNorm { input: qa, residual: None, weight: q_norm, eps: c.latent_norm_eps, out: q_resid }, KernelFamily::RmsNorm);
        let q = self.tokens(format!("l{l}.q"), DType::BF16, c.num_attention_heads * qk);
        self.linear(q_resid, &[format!("{p}.q_b_proj")], c.num_attention_heads * qk, c.q_lora_rank, kind, ShardRole::Rows, Epilogue::None, q)?;

        let kv_norm = self.param(&format!("{p}.kv_a_layernorm.weight"), DType::BF16, &[c.kv_lora_rank], WeightKind::Norm, ShardRole::Replicated, "kv_a_layernorm")?;

        // DSA indexer (replicated on every rank: splitting its heads would need an all-reduce of
        // the [tokens x context] score matrix before top-k).
        let ip = format!("{p}.indexer");
        let ikind = WeightKind::Indexer;
        let iq = self.tokens(format!("l{l}.index_q"), DType::BF16, c.index_n_heads * c.index_head_dim);
        self.linear(q_resid, &[format!("{ip}.wq_b")], c.index_n_heads * c.index_head_dim, c.q_lora_rank, ikind, ShardRole::Replicated, Epilogue::None, iq)?;
        let ik = self.tokens(format!("l{l}.index_k"), DType::BF16, c.index_head_dim);
        self.linear(x, &[format!("{ip}.wk")], c.index_head_dim, h, ikind, ShardRole::Replicated, Epilogue::None, ik)?;
        let k_norm = self.param(&format!("{ip}.k_norm.weight"), DType::BF16, &[c.index_head_dim], ikind, ShardRole::Replicated, "indexer k_norm")?;
        let k_bias = self.param(&format!("{ip}.k_norm.bias"), DType::BF16, &[c.index_head_dim], ikind, ShardRole::Replicated, "indexer k_norm")?;
        // both cache writes in one op, once both keys exist (one launch)
        let write = Op::KvCacheWrite { kv, kv_norm, kv_eps: c.latent_norm_eps, k: ik, k_norm, k_bias, k_eps: c.index_norm_eps, layer: l };
        self.push(write, KernelFamily::KvCacheWrite);
        let iw = self.tokens(format!("l{l}.index_w"), DType::F32, c.index_n_heads);
        let wp = format!("{ip}.weights_proj");
        if self.bind.ckpt.quant.is_nvfp4(&wp) {
            return Err(CompileError::Config {
                path: self.bind.ckpt.config_path.clone(),
                field: "quantization exclude list".into(),
                message: format!("`{wp}` must stay unquantised (BF16); add it to the exclude list"),
            });
        }
        self.linear(x, &[wp], c.index_n_heads, h, ikind, ShardRole::Replicated, Epilogue::None, iw)?;
        let topk = self.tokens(format!("l{l}.topk"), DType::I32, c.index_topk);
        // decode scores every cached position in a separate launch (see Op::IndexerTopK)
        let page = Dim::Fixed(crate::passes::memory::KV_PAGE_SIZE);
        let scores = self.value(format!("l{l}.index_scores"), DType::F32, vec![Dim::ScoreRows, Dim::PagesPerSeq, page]);
        self.push(Op::IndexerTopK { q: iq, head_weights: iw, layer: l, topk: c.index_topk, across_ranks: false, scores, out: topk }, KernelFamily::IndexerTopK);

        let kvb = format!("{p}.kv_b_proj");
        if self.bind.ckpt.quant.is_nvfp4(&kvb) {
            return Err(CompileError::Config {
                path: self.bind.ckpt.config_path.clone(),
                field: "quantization exclude list".into(),
                message: format!("`{kvb}` must be BF16: attention absorbs it into q and the output"),
            });
        }
        let kv_b_rows = c.num_attention_heads * (c.qk_nope_head_dim + c.v_head_dim);
        let kv_b = self.param(&format!("{kvb}.weight"), DType::BF16, &[kv_b_rows, c.kv_lora_rank], kind, ShardRole::Rows, "MLA kv_b_proj")?;
        let att = self.tokens(format!("l{l}.attn"), DType::BF16, c.num_attention_heads * c.v_head_dim);
        // split-KV attention's scratch: the q absorbed once, the selected positions split over
        // blocks (see Op::MlaAttention)
        let (heads, latent) = (c.num_attention_heads, c.kv_lora_rank);
        let absorbed = self.value(format!("l{l}.attn_absorbed"), DType::F32, vec![Dim::AttentionRows, Dim::Fixed(heads * latent)]);
        let partials = self.value(format!("l{l}.attn_partials"), DType::F32, vec![Dim::AttentionRows, Dim::AttentionSplits, Dim::Fixed(heads * (latent + 4))]);
        self.push(
            Op::MlaAttention {
                q,
                kv_b,
                topk: Some(topk),
                layer: l,
                heads: c.num_attention_heads,
                scale: c.attention_scale(),
                form: AttentionForm::Expanded,
                absorbed,
                partials,
                out: att,
            },
            KernelFamily::MlaAttention,
        );
        let o = self.tokens(format!("l{l}.attn_out"), DType::BF16, h);
        self.linear(att, &[format!("{p}.o_proj")], h, c.num_attention_heads * c.v_head_dim, kind, ShardRole::Cols, Epilogue::None, o)?;
        Ok(o)
    }

    /// SwiGLU MLP `down(silu(gate x) * up x)`: column-parallel gate/up, row-parallel down.
    fn mlp(&mut self, prefix: &str, x: BufId, inter: usize, kind: WeightKind, name: &str) -> Result<BufId, CompileError> {
        let h = self.cfg.hidden_size;
        let act = self.tokens(format!("{name}.act"), DType::BF16, inter);
        let gate_up = [format!("{prefix}.gate_proj"), format!("{prefix}.up_proj")];
        self.linear(x, &gate_up, inter, h, kind, ShardRole::Rows, Epilogue::SiluMul, act)?;
        let out = self.tokens(format!("{name}.out"), DType::BF16, h);
        self.linear(act, &[format!("{prefix}.down_proj")], h, inter, kind, ShardRole::Cols, Epilogue::None, out)?;
        Ok(out)
    }

    fn moe(&mut self, l: usize, x: BufId) -> Result<BufId, CompileError> {
        let c = self.cfg;
        let p = format!("model.layers.{l}.mlp");
        let h = c.hidden_size;
        let e = c.n_routed_experts;
        let gate = self.param(&format!("{p}.gate.weight"), DType::BF16, &[e, h], WeightKind::Router, ShardRole::Replicated, "MoE router")?;
        let bias = self.param(&format!("{p}.gate.e_score_correction_bias"), DType::F32, &[e], WeightKind::Router, ShardRole::Replicated, "MoE router selection bias")?;
        let logits = self.tokens(format!("l{l}.router_logits"), DType::F32, e);
        let ids = self.tokens(format!("l{l}.expert_ids"), DType::I32, c.num_experts_per_tok);
        let weights = self.tokens(format!("l{l}.expert_weights"), DType::F32, c.num_experts_per_tok);
        let params = RouterParams {
            experts: e,
            top_k: c.num_experts_per_tok,
            n_group: c.n_group,
            topk_group: c.topk_group,
            norm_topk_prob: c.norm_topk_prob,
            scaling: c.routed_scaling_factor,
        };
        self.push(Op::Router { input: x, gate, bias, params, logits, ids, weights }, KernelFamily::Router);

        let inter = c.moe_intermediate_size;
        let gate_up: Vec<String> = (0..e).flat_map(|j| [format!("{p}.experts.{j}.gate_proj"), format!("{p}.experts.{j}.up_proj")]).collect();
        let down: Vec<String> = (0..e).map(|j| format!("{p}.experts.{j}.down_proj")).collect();
        let kind = WeightKind::RoutedExperts;
        let name = format!("layers.{l}.mlp.experts");
        let gu = self.linear_weights(&format!("{name}.gate_up"), &gate_up, inter, h, kind, ShardRole::Experts { tp_dim: Some(0) }, Some(e))?;
        let dn = self.linear_weights(&format!("{name}.down"), &down, h, inter, kind, ShardRole::Experts { tp_dim: Some(1) }, Some(e))?;
        let kernel = match gu {
            LinearWeights::Nvfp4 { .. } => KernelFamily::MoeNvfp4,
            LinearWeights::Bf16 { .. } => KernelFamily::MoeBf16,
        };
        // the shared experts first: the routed experts' final store adds their output
        let shared = if c.n_shared_experts == 0 {
            None
        } else {
            Some(self.mlp(&format!("{p}.shared_experts"), x, inter * c.n_shared_experts, WeightKind::SharedExperts, &format!("l{l}.shared"))?)
        };
        let out = self.tokens(format!("l{l}.moe_out"), DType::BF16, h);
        let mid = self.tokens(format!("l{l}.moe_mid"), DType::BF16, c.num_experts_per_tok * inter);
        let acc = self.tokens(format!("l{l}.moe_acc"), DType::F32, h);
        self.push(
            Op::MoeExperts {
                input: x,
                ids,
                weights,
                gate_up: gu,
                down: dn,
                experts_local: e,
                expert_parallel: false,
                intermediate: inter,
                hidden: h,
                out,
                mid,
                acc,
                shared,
            },
            kernel,
        );
        Ok(out)
    }
}

/// How a linear's scalars (`weight_scale_2`, `input_scale`) are held: whole on every rank, one
/// per expert in an expert stack.
fn scalar_role(role: ShardRole) -> ShardRole {
    match role {
        ShardRole::Experts { .. } => ShardRole::Experts { tp_dim: None },
        _ => ShardRole::Replicated,
    }
}

/// `model.layers.3.mlp.gate.weight` -> `layers.3.mlp.gate.weight` (slot names in reports).
fn logical(tensor: &str) -> String {
    tensor.strip_prefix("model.").unwrap_or(tensor).to_string()
}

/// Which draft model the plan carries for speculative decoding.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Draft {
    #[default]
    None,
    /// The checkpoint's MTP (NextN) layer, `model.layers.<num_hidden_layers>.*`, as stored.
    Mtp,
    /// The MTP layer with its BF16 MLP linears (routed and shared experts) quantised to NVFP4
    /// at bind, so that the NVFP4 MoE kernels run them (SGLang casts them to FP8 for its
    /// kernels the same way); their activation scales are the last decoder layer's.
    MtpNvfp4,
}

impl Builder<'_> {
    /// The MTP layer as a draft model (DeepSeek-V3's multi-token prediction module, as SGLang's
    /// `DeepseekModelNextN` runs it; reference/glm5.md section 6): row p takes the token at
    /// p + 1 and the model's hidden state at p,
    /// `x = eh_proj(cat(enorm(embed(token)), hnorm(hidden)))`, then one decoder layer with its
    /// own attention, indexer and KV cache layer, `shared_head.norm`, and the model's `lm_head`.
    /// `eh_proj` is computed as two linears over the halves of its input, each into F32, and
    /// their sum rounded once: the concatenation never exists.
    fn mtp_draft(&mut self, inputs: &GraphInputs, table: WeightId, head: &LinearWeights, model_hidden: BufId, nvfp4: bool) -> Result<DraftGraph, CompileError> {
        let c = self.cfg;
        let (h, v, l) = (c.hidden_size, c.vocab_size, c.num_hidden_layers);
        let lp = format!("model.layers.{l}");
        let main = std::mem::take(&mut self.steps);
        let hidden_in = self.tokens("draft.hidden_in", DType::BF16, h);
        let embed = self.tokens("draft.embed", DType::BF16, h);
        self.push(Op::Embed { ids: BufId(inputs.ids), table, vocab_rows: v, out: embed }, KernelFamily::Embed);
        let mut halves = Vec::new();
        for (i, (norm, input)) in [("enorm", embed), ("hnorm", hidden_in)].into_iter().enumerate() {
            let w = self.norm(&format!("{lp}.{norm}.weight"), h)?;
            let normed = self.tokens(format!("draft.{norm}"), DType::BF16, h);
            self.push(Op::RmsNorm { input, residual: None, weight: w, eps: c.rms_norm_eps, out: normed }, KernelFamily::RmsNorm);
            let tensor = format!("{lp}.eh_proj.weight");
            let id = self.bind.expect(&tensor, DType::BF16, &[h, 2 * h], "the MTP layer's eh_proj")?;
            let name = format!("layers.{l}.eh_proj.{}.weight", ["embedding", "hidden"][i]);
            let weight = self.weight(name, WeightKind::Attention, DType::BF16, vec![id], vec![h, h], None, ShardRole::Replicated);
            self.weights[weight.0 as usize].transform = Transform::Columns { start: (i * h) as u32, len: h as u32 };
            let out = self.tokens(format!("draft.eh_proj.{norm}"), DType::F32, h);
            let op = Op::Linear { input: normed, weights: LinearWeights::Bf16 { weight }, parts: vec![LinearPart { rows: h }], k: h, epilogue: Epilogue::None, out };
            self.push(op, KernelFamily::LinearBf16);
            halves.push(out);
        }
        let resid = self.tokens("draft.residual", DType::BF16, h);
        self.push(Op::Add { a: halves[0], b: halves[1], out: resid }, KernelFamily::Add);

        let w = self.norm(&format!("{lp}.input_layernorm.weight"), h)?;
        let x = self.tokens(format!("l{l}.attn_in"), DType::BF16, h);
        self.push(Op::RmsNorm { input: resid, residual: None, weight: w, eps: c.rms_norm_eps, out: x }, KernelFamily::RmsNorm);
        let a = self.attention(l, x, inputs)?;
        let w = self.norm(&format!("{lp}.post_attention_layernorm.weight"), h)?;
        let x2 = self.tokens(format!("l{l}.mlp_in"), DType::BF16, h);
        self.push(Op::RmsNorm { input: a, residual: Some(resid), weight: w, eps: c.rms_norm_eps, out: x2 }, KernelFamily::RmsNorm);
        if !c.is_moe_layer(l) {
            return Err(CompileError::Config {
                path: self.bind.ckpt.config_path.clone(),
                field: "first_k_dense_replace".into(),
                message: format!("the MTP layer {l} would be a dense layer; kiln's draft expects a sparse (MoE) one"),
            });
        }
        self.quantise_from = nvfp4.then(|| l - 1);
        let m = self.moe(l, x2);
        self.quantise_from = None;
        let m = m?;
        let w = self.norm(&format!("{lp}.shared_head.norm.weight"), h)?;
        let hidden_out = self.tokens("draft.hidden_out", DType::BF16, h);
        self.push(Op::RmsNorm { input: m, residual: Some(resid), weight: w, eps: c.rms_norm_eps, out: hidden_out }, KernelFamily::RmsNorm);
        let rows = self.value("draft.logit_hidden", DType::BF16, vec![Dim::LogitRows, Dim::Fixed(h)]);
        self.push(Op::GatherRows { input: hidden_out, rows: BufId(inputs.logit_rows), out: rows }, KernelFamily::GatherRows);
        let logits = self.value("draft.logits", DType::F32, vec![Dim::LogitRows, Dim::Fixed(v)]);
        let kernel = match head {
            LinearWeights::Bf16 { .. } => KernelFamily::LinearBf16,
            LinearWeights::Nvfp4 { .. } => KernelFamily::LinearNvfp4,
        };
        self.push(Op::Linear { input: rows, weights: head.clone(), parts: vec![LinearPart { rows: v }], k: h, epilogue: Epilogue::None, out: logits }, kernel);
        let steps = std::mem::replace(&mut self.steps, main);
        Ok(DraftGraph { steps, hidden_in: hidden_in.0, hidden_out: hidden_out.0, logits: logits.0, model_hidden: model_hidden.0 })
    }
}

pub fn build_graph(ckpt: &Checkpoint, cfg: &ModelConfig, draft: Draft) -> Result<Graph, CompileError> {
    let mut b = Builder { bind: Binder::new(ckpt), cfg, values: Vec::new(), weights: Vec::new(), steps: Vec::new(), quantise_from: None };
    let h = cfg.hidden_size;
    let v = cfg.vocab_size;
    let i32_tokens = |b: &mut Builder, name: &str| b.value(name, DType::I32, vec![T]);
    let ids = i32_tokens(&mut b, "in.ids");
    let positions = i32_tokens(&mut b, "in.positions");
    let token_seq = i32_tokens(&mut b, "in.token_seq");
    let slots = i32_tokens(&mut b, "in.slots");
    let page_table = b.value("in.page_table", DType::I32, vec![Dim::Seqs, Dim::PagesPerSeq]);
    let logit_rows = b.value("in.logit_rows", DType::I32, vec![Dim::LogitRows]);
    let inputs = GraphInputs {
        ids: ids.0,
        positions: positions.0,
        token_seq: token_seq.0,
        slots: slots.0,
        page_table: page_table.0,
        logit_rows: logit_rows.0,
    };

    let embed_name = "model.embed_tokens.weight";
    let table = b.param(embed_name, DType::BF16, &[v, h], WeightKind::Embedding, ShardRole::Rows, "token embedding")?;
    let resid = b.tokens("residual", DType::BF16, h);
    b.push(Op::Embed { ids, table, vocab_rows: v, out: resid }, KernelFamily::Embed);

    // `pending` is the sub-layer output still to be added into the residual stream.
    let mut pending: Option<BufId> = None;
    for l in 0..cfg.num_hidden_layers {
        let lp = format!("model.layers.{l}");
        let w = b.norm(&format!("{lp}.input_layernorm.weight"), h)?;
        let x = b.tokens(format!("l{l}.attn_in"), DType::BF16, h);
        b.push(Op::RmsNorm { input: pending.unwrap_or(resid), residual: pending.map(|_| resid), weight: w, eps: cfg.rms_norm_eps, out: x }, KernelFamily::RmsNorm);
        let a = b.attention(l, x, &inputs)?;
        let w = b.norm(&format!("{lp}.post_attention_layernorm.weight"), h)?;
        let x2 = b.tokens(format!("l{l}.mlp_in"), DType::BF16, h);
        b.push(Op::RmsNorm { input: a, residual: Some(resid), weight: w, eps: cfg.rms_norm_eps, out: x2 }, KernelFamily::RmsNorm);
        let m = if cfg.is_moe_layer(l) {
            b.moe(l, x2)?
        } else {
            b.mlp(&format!("{lp}.mlp"), x2, cfg.intermediate_size, WeightKind::DenseMlp, &format!("l{l}.mlp"))?
        };
        pending = Some(m);
    }
    let w = b.norm("model.norm.weight", h)?;
    let final_x = b.tokens("final_norm", DType::BF16, h);
    b.push(Op::RmsNorm { input: pending.unwrap_or(resid), residual: pending.map(|_| resid), weight: w, eps: cfg.rms_norm_eps, out: final_x }, KernelFamily::RmsNorm);
    let rows = b.value("logit_hidden", DType::BF16, vec![Dim::LogitRows, Dim::Fixed(h)]);
    b.push(Op::GatherRows { input: final_x, rows: logit_rows, out: rows }, KernelFamily::GatherRows);
    let logits = b.value("logits", DType::F32, vec![Dim::LogitRows, Dim::Fixed(v)]);
    let head = if cfg.tie_word_embeddings { "model.embed_tokens".to_string() } else { "lm_head".to_string() };
    let head_weights = b.linear_weights("lm_head", std::slice::from_ref(&head), v, h, WeightKind::LmHead, ShardRole::Rows, None)?;
    let kernel = match head_weights {
        LinearWeights::Bf16 { .. } => KernelFamily::LinearBf16,
        LinearWeights::Nvfp4 { .. } => KernelFamily::LinearNvfp4,
    };
    b.push(Op::Linear { input: rows, weights: head_weights.clone(), parts: vec![LinearPart { rows: v }], k: h, epilogue: Epilogue::None, out: logits }, kernel);

    let draft = match draft {
        Draft::None => None,
        Draft::Mtp | Draft::MtpNvfp4 if cfg.num_nextn_predict_layers == 0 => {
            return Err(CompileError::Config {
                path: ckpt.config_path.clone(),
                field: "num_nextn_predict_layers".into(),
                message: "is 0: the model has no MTP layer for `--draft mtp`".into(),
            })
        }
        Draft::Mtp | Draft::MtpNvfp4 => Some(b.mtp_draft(&inputs, table, &head_weights, final_x, draft == Draft::MtpNvfp4)?),
    };
    let ignored = summarise_unbound(ckpt, &b.bind, cfg);
    Ok(Graph { values: b.values, weights: b.weights, steps: b.steps, tensors: b.bind.tensors, inputs, logits: logits.0, ignored, draft })
}

/// Checkpoint tensors the graph does not bind: MTP layers summarised per layer, others by name.
fn summarise_unbound(ckpt: &Checkpoint, bind: &Binder, cfg: &ModelConfig) -> Vec<String> {
    let bound: std::collections::HashSet<&str> = bind.tensors.iter().map(|t| t.name.as_str()).collect();
    let mut mtp: BTreeMap<usize, usize> = BTreeMap::new();
    let mut other = Vec::new();
    for name in ckpt.tensors.keys().filter(|n| !bound.contains(n.as_str())) {
        let layer = name.strip_prefix("model.layers.").and_then(|r| r.split('.').next()).and_then(|l| l.parse::<usize>().ok());
        match layer {
            Some(l) if l >= cfg.num_hidden_layers => *mtp.entry(l).or_default() += 1,
            _ => other.push(name.clone()),
        }
    }
    let mut out: Vec<String> = mtp
        .into_iter()
        .map(|(l, n)| format!("model.layers.{l}.* ({n} tensors): MTP/NextN layer, a draft model for speculative decoding (compile with --draft mtp to use it)"))
        .collect();
    out.extend(other.into_iter().map(|n| format!("{n}: not used by glm_moe_dsa")));
    out
}
