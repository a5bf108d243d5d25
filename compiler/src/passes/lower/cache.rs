//! KV-cache writes: `Op::KvCacheWrite` (RMSNorm of the latent and RoPE of the rope key; LayerNorm
//! and RoPE of the indexer key) into the GPU cache layout of `KvLayout`, one launch. One warp per
//! token and part: a row (at most a few hundred values) lives in its lanes' registers, so there
//! is no shared memory and no block-wide barrier; a small batch gets one block of just as many
//! warps as it needs.

use super::{float_flag, numel, of_grid, width, Cx, Instance, THREADS};
use crate::kernels::{KvCacheWriteArgs, KvCacheWriteParams, Ptr};
use kiln_runtime::plan::{DType, IndexKeys, Op};

/// Values per row a lane may hold in registers: 32 lanes x 2 x this many pairs.
const MAX_PAIRS_PER_LANE: usize = 16;

pub(super) fn instances(cx: &Cx, op: &Op) -> Result<Vec<Instance>, String> {
    let Op::KvCacheWrite { kv: x, kv_norm, kv_eps, k, k_norm, k_bias, k_eps, layer } = *op else {
        return Err("not a cache write".into());
    };
    let (p, kv) = (cx.program, &cx.plan.memory.kv);
    let (latent, rope, index) = (kv.latent_dim, kv.rope_dim, kv.index_dim);
    let slots = u32::try_from(kv.pages * kv.page_size).map_err(|_| format!("{} cache slots overflow a u32", kv.pages * kv.page_size))?;
    let max_pos = u32::try_from(kv.max_context).map_err(|_| "the context overflows a u32".to_string())?;
    if [latent, rope, index].iter().any(|d| d % 2 != 0) || rope == 0 {
        return Err(format!("cache row parts {latent} | {rope} | {index} must be even (the kernel moves BF16 pairs)"));
    }
    let ins = p.inputs;
    for b in [ins.positions, ins.token_seq, ins.slots] {
        if p.buffer(b).dtype != DType::I32 {
            return Err(format!("input {} is not I32", p.buffer(b).name));
        }
    }
    let tokens = numel(p, ins.positions);
    if tokens == 0 || width(p, x) != latent + rope || numel(p, x) != tokens * (latent + rope) {
        return Err(format!("kv is {:?}, expected [{tokens}, {}]", p.buffer(x).shape, latent + rope));
    }
    if width(p, k) != index || numel(p, k) != tokens * index {
        return Err(format!("k is {:?}, expected [{tokens}, {index}]", p.buffer(k).shape));
    }
    let too_wide = |d: usize| d.div_ceil(64) > MAX_PAIRS_PER_LANE;
    if too_wide(latent) || too_wide(rope) || too_wide(index) || rope > index {
        return Err(format!("a cache row of {latent} | {rope} | {index} values is outside one warp's registers"));
    }
    let fp8 = kv.index_keys == IndexKeys::Fp8;
    // Two warps per token (MLA part, indexer key); full blocks even at batch 1 (the idle warps
    // exit), so that its launch may merge with a GEMM's (`passes/merge.rs`: equal blocks).
    let threads = THREADS;
    let grid = (tokens as u32 * 64).div_ceil(threads);
    let weight = |w, what| float_flag(cx.plan.weight(w).dtype, what);
    let params = KvCacheWriteParams {
        arch: cx.arch,
        tokens: tokens as u32,
        latent: latent as u32,
        rope: rope as u32,
        d: index as u32,
        row: kv.row_elems() as u32,
        slots,
        max_pos,
        threads,
        x_bf16: float_flag(p.buffer(x).dtype, "kv")?,
        w_bf16: weight(kv_norm, "the latent's norm weight")?,
        k_bf16: float_flag(p.buffer(k).dtype, "k")?,
        kw_bf16: weight(k_norm, "the indexer key's norm weight")?,
        kb_bf16: weight(k_bias, "the indexer key's norm bias")?,
        cache_bf16: float_flag(kv.dtype, "the KV cache")?,
        key_fp8: u32::from(fp8),
    };
    let args = KvCacheWriteArgs {
        kv: Ptr::Buffer(x),
        norm: Ptr::Weight(kv_norm),
        k: Ptr::Buffer(k),
        k_norm: Ptr::Weight(k_norm),
        k_bias: Ptr::Weight(k_bias),
        positions: Ptr::Buffer(ins.positions),
        token_seq: Ptr::Buffer(ins.token_seq),
        slots: Ptr::Buffer(ins.slots),
        cache: Ptr::KvCache(layer as u32),
        rope: Ptr::RopeTable,
        eps: kv_eps,
        k_eps,
    };
    Ok(vec![of_grid(&params, [grid, 1, 1], threads, args.launch_args())])
}
