use super::{BufId, WeightId};
use serde::{Deserialize, Serialize};

/// The semantic operation of one plan step. The CPU backend executes the `Op`; the emulator and
/// CUDA execute the step's kernel launch; `verify` compares the two.
///
/// Tokens are rows: every activation buffer is `[tokens, features]` row-major. Cache ops find a
/// token's sequence, position and cache slot in the program's input buffers.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum Op {
    /// `out[t] = table[ids[t] - rank * vocab_rows]` when the id falls in this rank's `vocab_rows`
    /// rows, else 0 (vocab-parallel embedding; an all-reduce follows when there are several ranks).
    /// Programs are identical on every rank: the kernel gets its first row `rank * vocab_rows` as a
    /// `LaunchArg::PerRank(vocab_rows)` that the runtime resolves per rank.
    Embed { ids: BufId, table: WeightId, vocab_rows: usize, out: BufId },
    /// `residual += input` (when given), then `out = rmsnorm(residual or input) * weight`
    /// (normalised in fp32, cast to the buffer dtype, then scaled, as transformers does).
    RmsNorm { input: BufId, residual: Option<BufId>, weight: WeightId, eps: f32, out: BufId },
    /// `out = input @ W^T` for the concatenated parts of W, with an optional epilogue.
    Linear {
        input: BufId,
        weights: LinearWeights,
        /// Rows of W per part (e.g. gate then up); the parts may carry their own scales.
        parts: Vec<LinearPart>,
        k: usize,
        epilogue: Epilogue,
        out: BufId,
    },
    /// Several BF16 linears of one input, `out_i = input @ W_i^T` (`[rows_i, k]` weights, no
    /// epilogue): decode's projections of the same activations (q_a, kv_a and the indexer's wk
    /// and head weights of the hidden state; q_b and the indexer's wq_b of q_a), which one launch
    /// can compute side by side. Specialisation forms it from `Linear` steps; each member means
    /// exactly its `Linear` ([`Op::group_members`]). With `norm` (decode: the input norm and the
    /// q_a norm) the members read `rmsnorm(input) * weight` ([`Op::group_norm`]), which one
    /// launch may compute on the fly; `normed` is then kernel scratch, where a plan that norms in
    /// a launch of its own puts it.
    LinearGroup { input: BufId, norm: Option<GroupNorm>, k: usize, members: Vec<GroupMember> },
    /// The layer's KV-cache writes of its tokens, into disjoint parts of each slot's row: the MLA
    /// part from `kv` rows `[latent (kv_lora_rank) | k_rope (rope dim)]` (the latent
    /// RMS-normalised with `kv_norm`, the rope key rotated at the token's position), and the
    /// indexer key, LayerNorm(`k_norm`, `k_bias`) of `k` with RoPE on its first rope-dim values.
    KvCacheWrite { kv: BufId, kv_norm: WeightId, kv_eps: f32, k: BufId, k_norm: WeightId, k_bias: WeightId, k_eps: f32, layer: usize },
    /// DSA lightning indexer: score every cached position `t <= pos` of the token's sequence with
    /// `sum_h w[h]/sqrt(H) * relu(q_h . k_t)/sqrt(d)` and keep the `topk` best (ties: lower position
    /// first), listed in ascending position order; unused slots are -1. `q` is pre-RoPE; RoPE is
    /// applied to its first rope-dim values.
    /// `scores` `[tokens, positions]` F32 is kernel scratch: decode programs score in one launch
    /// over many blocks and select in a second; it is empty in prefill programs (one launch).
    /// `across_ranks` (long prefill chunks of a plan of R ranks): rank r selects only for tokens
    /// r, r + R, r + 2R, ..., `out` `[tokens / R, topk]` holding token jR + r's list in row j; an
    /// [`Op::AllGather`] of `out` after it gives every rank the lists in token order.
    IndexerTopK { q: BufId, head_weights: BufId, layer: usize, topk: usize, across_ranks: bool, scores: BufId, out: BufId },
    /// MLA attention for this rank's heads over the cached latents selected by `topk`
    /// (all causal positions when `topk` is None). `q` rows are `[heads, nope | rope]` (pre-RoPE),
    /// `kv_b` the rank's `[heads * (nope + v), kv_lora_rank]` slice; output `[heads * v]`.
    /// `absorbed` (F32 `[tokens, heads * kv_lora_rank]`) and `partials` (F32 `[tokens, splits,
    /// heads * (kv_lora_rank + 4)]`) are kernel scratch of split-KV decode: q absorbed into the
    /// latent space (then the combined context), and each split's softmax state; both are empty in
    /// prefill programs (one fused launch).
    MlaAttention {
        q: BufId,
        kv_b: WeightId,
        topk: Option<BufId>,
        layer: usize,
        heads: usize,
        scale: f32,
        form: AttentionForm,
        absorbed: BufId,
        partials: BufId,
        out: BufId,
    },
    /// fp32 sigmoid router with selection bias, group-limited top-k, normalisation and scaling.
    /// `logits` (`[tokens, experts]` F32) is kernel scratch: a GPU plan computes the gate product
    /// into it in one launch (the gate streamed by many blocks) and selects in the next.
    Router { input: BufId, gate: WeightId, bias: WeightId, params: RouterParams, logits: BufId, ids: BufId, weights: BufId },
    /// Routed experts of this rank: for each token, `sum_j w_j * down(silu(gate x) * up x)` over
    /// its selected experts that live on this rank.
    MoeExperts {
        input: BufId,
        ids: BufId,
        weights: BufId,
        gate_up: LinearWeights,
        down: LinearWeights,
        /// Experts stored on this rank and the index of the first one (rank * experts_local for EP).
        experts_local: usize,
        expert_parallel: bool,
        /// Per-rank intermediate size of one expert.
        intermediate: usize,
        hidden: usize,
        out: BufId,
        /// Kernel scratch (the CPU does not use it): BF16 `[tokens * top_k, intermediate]`, the
        /// SwiGLU output of every (token, choice) pair ...
        mid: BufId,
        /// ... and F32 `[tokens, hidden]`, the weighted sum over experts before rounding.
        acc: BufId,
        /// Added to `out` after its rounding (the shared experts' output): the bits of an `Add`
        /// after the op, without its launch.
        shared: Option<BufId>,
    },
    /// `out = a + b` elementwise.
    Add { a: BufId, b: BufId, out: BufId },
    /// `out[i] = input[rows[i]]` (rows < 0 give zeros).
    GatherRows { input: BufId, rows: BufId, out: BufId },
    /// Sum `buf` over all ranks in fixed rank order; every rank gets the sum. With `residual`
    /// (decode: the residual add of the rmsnorm that follows, moved here so that the one-shot
    /// P2P kernel does it in the same launch), then `residual = round(residual + buf)`; with
    /// `norm` as well (decode: the rmsnorm that followed), then `norm.out = rmsnorm(residual)`.
    AllReduce { buf: BufId, residual: Option<BufId>, norm: Option<ResidualNorm> },
    /// For each pair, concatenate each rank's `input` columns in rank order into `out` on every
    /// rank (row by row); several pairs share one collective. `out` holds `[rows, ranks x
    /// columns]` in memory, whatever its shape says (a sequence-parallel indexer's lists gather
    /// into `[tokens, topk]`: row j of the gather is the lists of tokens jR .. jR + R - 1).
    AllGather { pairs: Vec<GatherPair> },
    /// Ops of adjacent steps that do not depend on each other, in their program order, made one
    /// step by lowering where it merged the last launch of one with the first of the next into
    /// one launch (`passes/merge.rs`). The CPU runs them in order; nothing else nests.
    Concurrent { ops: Vec<Op> },
}

/// The RMSNorm (no residual) an [`Op::LinearGroup`] applies to its input first.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct GroupNorm {
    pub weight: WeightId,
    pub eps: f32,
    /// The normalised rows `[tokens, k]`: kernel scratch (the CPU's and a separate norm launch's).
    pub normed: BufId,
}

/// The RMSNorm of the residual stream an [`Op::AllReduce`] with a residual applies last: the
/// norm of the step that followed it, so that the one-shot P2P kernel normalises in its own
/// launch.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct ResidualNorm {
    pub weight: WeightId,
    pub eps: f32,
    /// The normalised rows (a result: the next steps read them).
    pub out: BufId,
}

/// One linear of an [`Op::LinearGroup`]: BF16 `weight` `[rows, k]` into `out` `[tokens, rows]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct GroupMember {
    pub weight: WeightId,
    pub rows: usize,
    pub out: BufId,
}

/// One buffer of an [`Op::AllGather`]: this rank's columns and the gathered rows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct GatherPair {
    pub input: BufId,
    pub out: BufId,
}

/// The weights of a linear layer (or of a stack of experts, with a leading expert dimension).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum LinearWeights {
    /// `[N, K]` BF16 rows.
    Bf16 { weight: WeightId },
    /// ModelOpt NVFP4: `weight` U8 `[N, K/2]` (low nibble = even k), `scale` F8_E4M3 `[N, K/16]`,
    /// `scale_2` and `input_scale` F32 `[parts]` (one per part; per expert for expert stacks).
    Nvfp4 { weight: WeightId, scale: WeightId, scale_2: WeightId, input_scale: WeightId },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct LinearPart {
    pub rows: usize,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Epilogue {
    None,
    /// Two equal parts (gate, up): `out = silu(gate) * up`, half the columns.
    SiluMul,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum AttentionForm {
    /// Expand per-head K/V from the latents with kv_b (prefill).
    Expanded,
    /// Absorb kv_b into q and the output (decode); must equal the expanded form.
    Absorbed,
}

#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct RouterParams {
    pub experts: usize,
    pub top_k: usize,
    pub n_group: usize,
    pub topk_group: usize,
    pub norm_topk_prob: bool,
    pub scaling: f32,
}

impl LinearWeights {
    pub fn ids(&self) -> Vec<WeightId> {
        match *self {
            LinearWeights::Bf16 { weight } => vec![weight],
            LinearWeights::Nvfp4 { weight, scale, scale_2, input_scale } => vec![weight, scale, scale_2, input_scale],
        }
    }
}

impl Op {
    /// The ops this one is made of: a `Concurrent`'s, in order, else itself.
    pub fn leaves(&self) -> &[Op] {
        match self {
            Op::Concurrent { ops } => ops,
            op => std::slice::from_ref(op),
        }
    }

    /// Activation buffers the op reads (program inputs such as positions are implicit).
    pub fn reads(&self) -> Vec<BufId> {
        match self {
            Op::Concurrent { ops } => ops.iter().flat_map(Op::reads).collect(),
            Op::Embed { ids, .. } => vec![*ids],
            Op::RmsNorm { input, residual, .. } => std::iter::once(*input).chain(*residual).collect(),
            Op::Linear { input, .. } | Op::LinearGroup { input, .. } => vec![*input],
            Op::KvCacheWrite { kv, k, .. } => vec![*kv, *k],
            Op::IndexerTopK { q, head_weights, .. } => vec![*q, *head_weights],
            Op::MlaAttention { q, topk, .. } => std::iter::once(*q).chain(*topk).collect(),
            Op::Router { input, .. } => vec![*input],
            Op::MoeExperts { input, ids, weights, shared, .. } => [*input, *ids, *weights].into_iter().chain(*shared).collect(),
            Op::Add { a, b, .. } => vec![*a, *b],
            Op::GatherRows { input, rows, .. } => vec![*input, *rows],
            Op::AllReduce { buf, residual, .. } => std::iter::once(*buf).chain(*residual).collect(),
            Op::AllGather { pairs } => pairs.iter().map(|g| g.input).collect(),
        }
    }

    /// Activation buffers the op writes (cache writes go to the KV cache, not a buffer).
    pub fn writes(&self) -> Vec<BufId> {
        match self {
            Op::Concurrent { ops } => ops.iter().flat_map(Op::writes).collect(),
            Op::Embed { out, .. }
            | Op::Linear { out, .. }
            | Op::Add { out, .. }
            | Op::GatherRows { out, .. } => vec![*out],
            Op::AllGather { pairs } => pairs.iter().map(|g| g.out).collect(),
            Op::LinearGroup { members, norm, .. } => members.iter().map(|g| g.out).chain(norm.map(|n| n.normed)).collect(),
            Op::RmsNorm { residual, out, .. } => std::iter::once(*out).chain(*residual).collect(),
            Op::MoeExperts { out, mid, acc, .. } => vec![*out, *mid, *acc],
            Op::Router { logits, ids, weights, .. } => vec![*logits, *ids, *weights],
            Op::IndexerTopK { scores, out, .. } => vec![*scores, *out],
            Op::MlaAttention { absorbed, partials, out, .. } => vec![*out, *absorbed, *partials],
            Op::AllReduce { buf, residual, norm } => std::iter::once(*buf).chain(*residual).chain(norm.map(|n| n.out)).collect(),
            Op::KvCacheWrite { .. } => vec![],
        }
    }

    /// Whether the op writes the KV cache (its result is there, not in a buffer).
    pub fn writes_kv_cache(&self) -> bool {
        self.leaves().iter().any(|op| matches!(op, Op::KvCacheWrite { .. }))
    }

    /// Written buffers that are only kernel scratch: their contents are not a result of the op
    /// (the CPU backend leaves them alone; `verify` does not compare them).
    pub fn scratch(&self) -> Vec<BufId> {
        match self {
            Op::Concurrent { ops } => ops.iter().flat_map(Op::scratch).collect(),
            Op::MoeExperts { mid, acc, .. } => vec![*mid, *acc],
            Op::Router { logits, .. } => vec![*logits],
            Op::IndexerTopK { scores, .. } => vec![*scores],
            Op::MlaAttention { absorbed, partials, .. } => vec![*absorbed, *partials],
            Op::LinearGroup { norm: Some(n), .. } => vec![n.normed],
            _ => vec![],
        }
    }

    /// Written buffers that hold the op's results.
    pub fn results(&self) -> Vec<BufId> {
        let scratch = self.scratch();
        self.writes().into_iter().filter(|b| !scratch.contains(b)).collect()
    }

    /// Weight slots the op reads.
    pub fn weight_ids(&self) -> Vec<WeightId> {
        match self {
            Op::Concurrent { ops } => ops.iter().flat_map(Op::weight_ids).collect(),
            Op::Embed { table, .. } => vec![*table],
            Op::RmsNorm { weight, .. } => vec![*weight],
            Op::Linear { weights, .. } => weights.ids(),
            Op::LinearGroup { members, norm, .. } => norm.map(|n| n.weight).into_iter().chain(members.iter().map(|g| g.weight)).collect(),
            Op::KvCacheWrite { kv_norm, k_norm, k_bias, .. } => vec![*kv_norm, *k_norm, *k_bias],
            Op::MlaAttention { kv_b, .. } => vec![*kv_b],
            Op::Router { gate, bias, .. } => vec![*gate, *bias],
            Op::MoeExperts { gate_up, down, .. } => gate_up.ids().into_iter().chain(down.ids()).collect(),
            Op::AllReduce { norm, .. } => norm.map(|n| n.weight).into_iter().collect(),
            Op::IndexerTopK { .. } | Op::Add { .. } | Op::GatherRows { .. } | Op::AllGather { .. } => vec![],
        }
    }

    /// The `RmsNorm` a `LinearGroup` with a norm applies first (into its `normed` buffer).
    pub fn group_norm(&self) -> Option<Op> {
        let Op::LinearGroup { input, norm: Some(n), .. } = *self else {
            return None;
        };
        Some(Op::RmsNorm { input, residual: None, weight: n.weight, eps: n.eps, out: n.normed })
    }

    /// The `RmsNorm` (no residual) of the residual an `AllReduce` with a norm applies last.
    pub fn residual_norm(&self) -> Option<Op> {
        let Op::AllReduce { residual: Some(r), norm: Some(n), .. } = *self else {
            return None;
        };
        Some(Op::RmsNorm { input: r, residual: None, weight: n.weight, eps: n.eps, out: n.out })
    }

    /// The `Linear` each member of a `LinearGroup` stands for (None for other ops): of the
    /// normed rows where the group has a norm.
    pub fn group_members(&self) -> Option<Vec<Op>> {
        let Op::LinearGroup { input, norm, k, members } = self else {
            return None;
        };
        let input = norm.map_or(*input, |n| n.normed);
        Some(
            members
                .iter()
                .map(|g| Op::Linear {
                    input,
                    weights: LinearWeights::Bf16 { weight: g.weight },
                    parts: vec![LinearPart { rows: g.rows }],
                    k: *k,
                    epilogue: Epilogue::None,
                    out: g.out,
                })
                .collect(),
        )
    }

    /// Short name for reports.
    pub fn name(&self) -> &'static str {
        match self {
            Op::Embed { .. } => "embed",
            Op::RmsNorm { .. } => "rmsnorm",
            Op::Linear { .. } => "linear",
            Op::LinearGroup { .. } => "linear_group",
            Op::KvCacheWrite { .. } => "kv_cache_write",
            Op::IndexerTopK { .. } => "indexer_topk",
            Op::MlaAttention { .. } => "mla_attention",
            Op::Router { .. } => "router",
            Op::MoeExperts { .. } => "moe_experts",
            Op::Add { .. } => "add",
            Op::GatherRows { .. } => "gather_rows",
            Op::AllReduce { .. } => "all_reduce",
            Op::AllGather { .. } => "all_gather",
            Op::Concurrent { .. } => "concurrent",
        }
    }
}
