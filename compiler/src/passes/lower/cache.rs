//! KV-cache writes: `Op::MlaKvWrite` (RMSNorm of the latent, RoPE of the rope key) and
//! `Op::IndexerKeyWrite` (LayerNorm + RoPE of the indexer key), into the GPU cache layout of
//! `KvLayout`. One warp per token: a token's row (at most a few hundred values) lives in its
//! lanes' registers, so there is no shared memory and no block-wide barrier; a decode batch gets
//! one block of just as many warps as tokens.

use super::{float_flag, numel, of_grid, width, Cx, Instance, THREADS};
use crate::kernels::{IndexerKeyWriteArgs, IndexerKeyWriteParams, MlaKvWriteArgs, MlaKvWriteParams, Ptr};
use kiln_runtime::plan::{DType, Op};

/// Values per row a lane may hold in registers: 32 lanes x 2 x this many pairs.
const MAX_PAIRS_PER_LANE: usize = 16;

pub(super) fn instances(cx: &Cx, op: &Op) -> Result<Vec<Instance>, String> {
    let (p, kv) = (cx.program, &cx.plan.memory.kv);
    let (latent, rope, index) = (kv.latent_dim, kv.rope_dim, kv.index_dim);
    let slots = u32::try_from(kv.pages * kv.page_size).map_err(|_| format!("{} cache slots overflow a u32", kv.pages * kv.page_size))?;
    let max_pos = u32::try_from(kv.max_context).map_err(|_| "the context overflows a u32".to_string())?;
    if [latent, rope, index].iter().any(|d| d % 2 != 0) || rope == 0 {
        return Err(format!("cache row parts {latent} | {rope} | {index} must be even (the kernels move BF16 pairs)"));
    }
    let cache_bf16 = float_flag(kv.dtype, "the KV cache")?;
    let ins = p.inputs;
    for b in [ins.positions, ins.token_seq, ins.slots] {
        if p.buffer(b).dtype != DType::I32 {
            return Err(format!("input {} is not I32", p.buffer(b).name));
        }
    }
    let tokens = numel(p, ins.positions);
    let too_wide = |d: usize| d.div_ceil(64) > MAX_PAIRS_PER_LANE;
    // One warp per token; a small batch gets one block of exactly its warps.
    let threads = (tokens.max(1) as u32 * 32).min(THREADS);
    let grid = (tokens as u32 * 32).div_ceil(threads);
    match *op {
        Op::MlaKvWrite { kv: x, norm, eps, layer } => {
            if width(p, x) != latent + rope || numel(p, x) != tokens * (latent + rope) || tokens == 0 {
                return Err(format!("kv is {:?}, expected [{tokens}, {}]", p.buffer(x).shape, latent + rope));
            }
            if too_wide(latent) || too_wide(rope) {
                return Err(format!("a latent of {latent} values exceeds one warp's registers"));
            }
            let params = MlaKvWriteParams {
                arch: cx.arch,
                tokens: tokens as u32,
                latent: latent as u32,
                rope: rope as u32,
                row: kv.row_elems() as u32,
                slots,
                max_pos,
                threads,
                x_bf16: float_flag(p.buffer(x).dtype, "kv")?,
                w_bf16: float_flag(cx.plan.weight(norm).dtype, "the norm weight")?,
                cache_bf16,
            };
            let args = MlaKvWriteArgs {
                kv: Ptr::Buffer(x),
                norm: Ptr::Weight(norm),
                positions: Ptr::Buffer(ins.positions),
                token_seq: Ptr::Buffer(ins.token_seq),
                slots: Ptr::Buffer(ins.slots),
                cache: Ptr::KvCache(layer as u32),
                rope: Ptr::RopeTable,
                eps,
            };
            Ok(vec![of_grid(&params, [grid, 1, 1], threads, args.launch_args())])
        }
        Op::IndexerKeyWrite { k, norm, bias, eps, layer } => {
            if width(p, k) != index || numel(p, k) != tokens * index || tokens == 0 {
                return Err(format!("k is {:?}, expected [{tokens}, {index}]", p.buffer(k).shape));
            }
            if rope > index || too_wide(index) {
                return Err(format!("an index key of {index} values (rope {rope}) is outside the template"));
            }
            let params = IndexerKeyWriteParams {
                arch: cx.arch,
                tokens: tokens as u32,
                d: index as u32,
                rope: rope as u32,
                offset: (latent + rope) as u32,
                row: kv.row_elems() as u32,
                slots,
                max_pos,
                threads,
                x_bf16: float_flag(p.buffer(k).dtype, "k")?,
                w_bf16: float_flag(cx.plan.weight(norm).dtype, "the norm weight")?,
                b_bf16: float_flag(cx.plan.weight(bias).dtype, "the norm bias")?,
                cache_bf16,
            };
            let args = IndexerKeyWriteArgs {
                k: Ptr::Buffer(k),
                norm: Ptr::Weight(norm),
                bias: Ptr::Weight(bias),
                positions: Ptr::Buffer(ins.positions),
                token_seq: Ptr::Buffer(ins.token_seq),
                slots: Ptr::Buffer(ins.slots),
                cache: Ptr::KvCache(layer as u32),
                rope: Ptr::RopeTable,
                eps,
            };
            Ok(vec![of_grid(&params, [grid, 1, 1], threads, args.launch_args())])
        }
        _ => Err("not a cache write".into()),
    }
}
