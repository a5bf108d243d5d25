//! The MoE router as two launches: the gate product `x . gate^T` into the step's F32 `logits`
//! scratch, lowered exactly as a BF16 linear of the same shape (a GEMV whose blocks spread the
//! 256 x 6144 gate over the GPU at decode, a tiled GEMM in prefill), then the `router` template's
//! selection, one block per token, or for a few tokens one warp per token in a single block
//! (which launch merging then runs as the gate product's tail) where the model prices that tail
//! below a launch of a block per token. In one kernel each token's block would stream the whole
//! gate by itself: 1/188 of the bandwidth at batch 1, the gate re-read per token at batch 64.

use super::{candidate_us, fits, float_flag, numel, of, width, Cx, Instance, THREADS};
use crate::kernels::{Ptr, RouterArgs, RouterParams};
use kiln_runtime::plan::{DType, Epilogue, LinearPart, LinearWeights, Op};

/// The most static shared memory (`.shared` arrays, the router's kind) PTX gives one kernel.
const STATIC_SMEM_LIMIT: usize = 48 << 10;

pub(super) fn instances(cx: &Cx, op: &Op) -> Result<Vec<Instance>, String> {
    let Op::Router { input, gate, bias, ref params, logits, ids, weights } = *op else {
        return Err("not a router".into());
    };
    let (plan, p) = (cx.plan, cx.program);
    let h = width(p, input);
    let tokens = numel(p, input) / h.max(1);
    let groups = params.n_group.max(1);
    let (e, k) = (params.experts, params.top_k);
    if tokens == 0 || e == 0 || groups > 32 || e % groups != 0 || k == 0 || k > e || params.topk_group > groups {
        return Err(format!("a router of {e} experts in {groups} groups (top-{k}, {} groups kept) is outside the template", params.topk_group));
    }
    if p.buffer(ids).dtype != DType::I32 || p.buffer(logits).dtype != DType::F32 || plan.weight(gate).dtype != DType::BF16 {
        return Err("the router needs I32 ids, F32 logits and a BF16 gate".into());
    }
    let product = Op::Linear {
        input,
        weights: LinearWeights::Bf16 { weight: gate },
        parts: vec![LinearPart { rows: e }],
        k: h,
        epilogue: Epilogue::None,
        out: logits,
    };
    let mut list = super::instances(cx, &product).map_err(|why| format!("the router's gate product: {why}"))?;
    // A few tokens a warp each in one block, where that block as the gate product's tail (all
    // the tokens' bytes at one SM's bandwidth, no launch) costs less than a block per token in a
    // launch of its own, by the model; otherwise a block per token.
    let bias_bytes = (e * plan.weight(bias).dtype.size() * tokens) as f64;
    let logit_bytes = (tokens * e * 4) as f64;
    let as_tail = candidate_us(bias_bytes, logit_bytes, 0.0, 1.0, &cx.consts) - cx.consts.launch_us;
    let warps = (THREADS / 32) as usize;
    let smem = e * 8 + groups * 4 + k * 4;
    let cheaper = as_tail < candidate_us(bias_bytes, logit_bytes, 0.0, tokens as f64, &cx.consts);
    let per_block = if (2..=warps).contains(&tokens) && warps * smem <= STATIC_SMEM_LIMIT && cheaper { warps } else { 1 };
    fits(per_block * smem, cx.smem_limit.min(STATIC_SMEM_LIMIT as u32), &format!("a router over {e} experts"))?;
    let select = RouterParams {
        arch: cx.arch,
        tokens: tokens as u32,
        per_block: per_block as u32,
        experts: e as u32,
        n_group: groups as u32,
        topk_group: params.topk_group as u32,
        top_k: k as u32,
        norm: params.norm_topk_prob as u32,
        threads: THREADS,
        bias_bf16: float_flag(plan.weight(bias).dtype, "the bias")?,
        w_bf16: float_flag(p.buffer(weights).dtype, "the weights")?,
    };
    let args = RouterArgs { logits: Ptr::Buffer(logits), bias: Ptr::Weight(bias), ids: Ptr::Buffer(ids), weights: Ptr::Buffer(weights), scaling: params.scaling };
    list.push(of(&select, tokens.div_ceil(per_block) as u32, args.launch_args()));
    Ok(list)
}
