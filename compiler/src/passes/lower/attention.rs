//! MLA attention in absorbed form over the paged latent cache: `Op::MlaAttention` (decode and prefill, dense or over the indexer's top-k).
//!
//! Both `AttentionForm`s lower to the absorbed kernel: the forms are mathematically equal and
//! the absorbed one reads each selected latent row once for all heads of a block instead of
//! expanding per-head keys and values. Where the op has split scratch (decode and prefill
//! alike) and `mla_split` takes the geometry: split-KV in four launches, so that even one token
//! fills the GPU and kv_b is read once per step instead of once per block (a prefill chunk's
//! fused launch read its 3.7 MB per token on GLM-5 tp8), the splits per token as many as fill
//! the GPU within the scratch (one from 512 tokens): q absorbed into the
//! latent space (`mla_split` MODE 0), each split of the top-k row's softmax state
//! (`mla_attention` MODE 1, all heads of a block sharing every latent row), the splits combined
//! (`mla_split` MODE 1), and the output projection (`mla_split` MODE 2 on the CUDA cores, or,
//! where the byte model prices it lower, as in prefill chunks, one batched tensor-core GEMM of a
//! head per grid.z: [`output_gemm_us`]). Else one fused launch, a block per (token, group of heads).

use super::gemm::{tiled_ring, BF16_KB, GEMM_BN};
use super::{candidate_us, fits, float_flag, numel, of_grid, width, Cx, Instance, THREADS};
use kiln_runtime::perf::{launch_time, Bytes, Constants, Cost, Flops};
use crate::kernels::{LinearBf16GemmArgs, LinearBf16GemmParams, MlaAttentionArgs, MlaAttentionParams, MlaSplitArgs, MlaSplitParams, Ptr};
use kiln_runtime::plan::{DType, Op, ProgramKind, SplitKLayout};

/// Context accumulators a lane may hold: heads per block x 4 dims x latent chunks of 128.
const MAX_CTX_REGS: usize = 128;
/// Most heads per block (GLM-5: the 8 heads of a tp8 rank share every latent row they load).
const MAX_HEADS_PER_BLOCK: usize = 8;
/// Blocks below which heads are split over more blocks (decode batches), at the cost of reading
/// each selected latent row once per group instead of once per token.
const MIN_BLOCKS: usize = 256;
/// Positions resolved to cache slots per round (shared memory: 4 B each).
const MAX_CHUNK: usize = 2048;

/// Heads per block: a divisor of `heads` whose context fits the registers, as many as possible
/// while the grid still has `MIN_BLOCKS` blocks.
fn heads_per_block(heads: usize, latent_chunks: usize, tokens: usize) -> usize {
    let cap = (MAX_CTX_REGS / (4 * latent_chunks)).clamp(1, MAX_HEADS_PER_BLOCK);
    let fits = |g: usize| heads % g == 0 && g <= cap;
    let mut g = (1..=cap.min(heads)).rev().find(|&g| fits(g)).unwrap_or(1);
    while g > 1 && tokens * heads / g < MIN_BLOCKS {
        match (1..g).rev().find(|&d| fits(d)) {
            Some(d) => g = d,
            None => break,
        }
    }
    g
}

/// Threads per block: small head groups (decode batches, at most ~110 registers) get 16 warps,
/// halving the positions each warp streams through; larger groups keep 8 (up to ~240 registers).
fn threads_for(hg: usize) -> u32 {
    if hg <= 2 {
        2 * THREADS
    } else {
        THREADS
    }
}

/// Slices of the nope rows that q_abs = W_UK^T q_nope is summed over in parallel: as many as
/// keep every thread busy (a task is 8 columns of one head and slice), dividing nope into runs of
/// 4 rows.
fn q_slices(nope: usize, hg: usize, latent_chunks: usize, threads: u32) -> usize {
    [8, 4, 2, 1].into_iter().find(|&s| nope % (4 * s) == 0 && s * hg * latent_chunks * 16 <= threads as usize).unwrap_or(1)
}

/// Whether the scores go to the tensor cores: a group of exactly 8 heads fills the mma's N, and
/// the fragments load 16 / 8 B pieces of the cache rows. q enters as three BF16 terms (~f32);
/// F32 outputs (tested at 2^-16) stay on the CUDA cores all the same. Returns (MMA, QBS): QBS is
/// the bytes per head of each BF16 term of q (64 mod 128 B apart: conflict-free B fragment loads).
fn mma_layout(hg: usize, latent: usize, rope: usize, row: usize, out_bf16: bool) -> (u32, u32) {
    if hg == 8 && latent % 64 == 0 && rope % 16 == 0 && row % 8 == 0 && out_bf16 {
        (1, (((latent + rope) * 2).div_ceil(128) * 128 + 64) as u32)
    } else {
        (0, 0)
    }
}

/// Most bytes of partial sums the last slice block of a head adds up in `mla_split` MODE 3: that
/// block runs alone after the others (a tail the byte model does not see: a token's slices per
/// round trip of its loads), so the one-launch form stays where the tail is a few round trips.
const MAX_LAST_BLOCK_SUMS: usize = 64 << 10;

/// Positions per staging round: the top-k width rounded up to whole rounds of the block, or a
/// fixed chunk for dense attention (the context is unbounded).
fn chunk(topk: usize, threads: u32) -> usize {
    let t = threads as usize;
    if topk == 0 {
        1024
    } else {
        topk.div_ceil(t).saturating_mul(t).min(MAX_CHUNK)
    }
}

/// Fewest top-k entries a split takes (one score tile of the tensor-core path).
const MIN_SPLIT: usize = 16;

/// Splits of decode attention: enough that the blocks fill the GPU twice, within the scratch's
/// capacity and at least `MIN_SPLIT` entries each; returns (splits, entries per split), every
/// split non-empty.
fn splits(topk: usize, blocks_per_split: usize, sms: usize, cap: usize) -> (usize, usize) {
    let want = (2 * sms).div_ceil(blocks_per_split.max(1)).clamp(1, cap.max(1)).min(topk.div_ceil(MIN_SPLIT).max(1));
    let per = topk.div_ceil(want);
    (topk.div_ceil(per), per)
}

/// Threads of a split block: a warp per 16-entry tile of the split, 2 to 8 warps.
fn split_threads(per_split: usize) -> u32 {
    (32 * per_split.div_ceil(MIN_SPLIT).clamp(2, 8)) as u32
}

/// The split instance with a block per two tokens (`TT` = 2), where it takes them: a prefill
/// program (one sequence, as the byte model assumes of its pairs), the cooperative tiles with one
/// split, an even number of tokens, both tokens'
/// partial scores in the q_abs half and their entry counts beside the warp counts, and the
/// second token's q terms within shared memory once the positions resolved per round (`CHUNK`)
/// are halved as far as it takes (more rounds, the same rows). Where a chunk starts below
/// `TOPK`, every position up to a token is selected and the pair's first token's rows are a
/// prefix of the second's: the block loads each row once for both (a 2,048-token chunk of GLM-5
/// tp8 from position 0: half of attention's KV reads). Elsewhere the block runs its two tokens
/// one after the other, with the same bytes as two blocks. None where it does not apply.
pub fn token_pairs(params: MlaAttentionParams, tokens: usize, prefill: bool, smem_limit: u32) -> Result<Option<MlaAttentionParams>, String> {
    let warps = params.threads as usize / 32;
    let applies = prefill
        && params.mode == 1 && params.coop == 1 && params.splits == 1 && tokens % 2 == 0 && 3 * warps <= 32 && 2 * 2 * warps * 512 <= (params.hg * params.nl * 512) as usize;
    if !applies {
        return Ok(None);
    }
    let xs = params.xs.max(2 * 3 * params.hg * params.qbs + warps as u32 * 576);
    let mut pair = MlaAttentionParams { tt: 2, xs, ..params };
    while pair.dynamic_smem()? > smem_limit && pair.chunk > params.threads {
        pair.chunk /= 2;
    }
    Ok((pair.dynamic_smem()? <= smem_limit && pair.chunk % params.threads == 0).then_some(pair))
}

/// Warps of a split block whose warps take each tile together (`COOP`): the most, up to 8, that
/// share the latent equally in runs of 32 or 64 dims (one or two fragment loads a row, held in
/// registers a tile ahead), with their partial scores (two buffers of 512 B a warp) inside the
/// q_abs half of the region.
fn coop_warps(latent: usize, hg: usize, nl: usize) -> Option<usize> {
    (1..=8).rev().find(|&w| latent % (32 * w) == 0 && matches!(latent / w, 32 | 64) && 2 * w * 512 <= hg * nl * 512)
}

/// W_UV rows per warp and tokens per block of the output launch (`heads * v / (8 * rows)` x
/// `ceil(tokens / group)` blocks), as the byte model prefers ([`candidate_us`]): every block reads
/// its rows of W_UV once and each of its tokens' context of its head once, so more rows per warp
/// re-read the contexts less and smaller token groups re-read W_UV more, while either may leave
/// SMs idle (batch 1: 1 row, 256 blocks; batch 64: 4 rows in groups of 16 tokens, 256 blocks,
/// where one group of 64 with 2 rows gave 128 blocks, each reading all 64 contexts of its head).
/// Ties: more rows, larger groups.
fn output_shape(tokens: usize, heads: usize, v: usize, latent: usize, out_size: usize, k: &Constants) -> ((usize, usize), f64) {
    let cost = |(r, tg): (usize, usize)| {
        let (groups, per_head) = (tokens.div_ceil(tg), v / (8 * r));
        let ctx = tokens * heads * latent * 4 * per_head + tokens * heads * v * out_size;
        candidate_us((heads * v * latent * 2 * groups) as f64, ctx as f64, (2 * tokens * heads * v * latent) as f64, (heads * per_head * groups) as f64, k)
    };
    let groups = [tokens, 32, 16, 8].into_iter().filter(|&tg| tg <= tokens);
    let shapes = [4usize, 2, 1].into_iter().filter(|r| v % (8 * r) == 0).flat_map(|r| groups.clone().map(move |tg| (r, tg)));
    shapes.map(|s| (s, cost(s))).fold(((1, tokens), f64::MAX), |best, c| if c.1 < best.1 { c } else { best })
}

/// Rows per block of the output projection's GEMM: F32 contexts enter the tiled BF16 GEMM as
/// three BF16 planes, whose stages hold 64 rows (`linear_bf16_gemm` MT = 2).
const OUTPUT_GEMM_ROWS: usize = 64;

/// The output projection as one batched tensor-core GEMM (`linear_bf16_gemm` BATCH = heads, a
/// head per grid.z): out[t, h] = W_UV[h] ctx[t, h], its W_UV rows inside kv_b and its context and
/// output rows column slices of the token's rows, the F32 contexts split into three BF16 planes
/// (exact: the products are the CPU's). Its predicted µs as the BF16 GEMM's forms are priced, with
/// the outputs and the tensor cores' time: W_UV once per row block of 64 tokens, each context
/// once per column block of 128 outputs. A 2,048-token chunk of GLM-5 tp8: 512 blocks moving
/// 143 MB (95 µs), where MODE 2 re-reads every context once per 32 rows of W_UV (411 MB, 271 µs).
fn output_gemm_us(tokens: usize, heads: usize, v: usize, latent: usize, out_size: usize, k: &Constants) -> f64 {
    let (gx, gy) = (v.div_ceil(GEMM_BN), tokens.div_ceil(OUTPUT_GEMM_ROWS));
    let weights = (heads * v * latent * 2 * gy) as f64;
    let activations = (heads * tokens * latent * 4 * gx + tokens * heads * v * out_size) as f64;
    let bf16_mma = 3.0 * 2.0 * (heads * gy * OUTPUT_GEMM_ROWS * gx * GEMM_BN * latent.next_multiple_of(32)) as f64;
    let cost = Cost { bytes: Bytes { weights, activations, ..Bytes::default() }, flops: Flops { bf16_mma, ..Flops::default() }, blocks: (heads * gx * gy) as f64, ..Cost::default() };
    launch_time(&cost, k).us
}

/// The output projection's GEMM instance ([`output_gemm_us`]) and its grid: x the contexts in
/// `absorbed` (F32 `[tokens, heads, latent]`), W the W_UV rows of kv_b (head h's from row
/// h * (nope + v) + nope), out `[tokens, heads, v]`.
#[allow(clippy::too_many_arguments)]
pub fn output_gemm(arch: u32, tokens: usize, heads: usize, nope: usize, v: usize, latent: usize, out_bf16: u32, smem_limit: u32) -> Result<(LinearBf16GemmParams, [u32; 3]), String> {
    let u = |n: usize| n as u32;
    let base = LinearBf16GemmParams { arch, m: u(tokens), n: u(v), k: u(latent), segs: 1, c1: 0, c2: 0, c3: 0, split: 0, ks: 1, partials: 0, mt: u(OUTPUT_GEMM_ROWS / 32), nt: 1, kb: BF16_KB, nbuf: 2, threads: THREADS, x_bf16: 0, out_bf16, norm: 0, nw_bf16: 0, batch: u(heads), xld: u(heads * latent), old: u(heads * v), woff: u(nope * latent), xb: u(latent), wb: u((nope + v) * latent), ob: u(v) };
    Ok((tiled_ring(base, smem_limit)?, [u(v.div_ceil(GEMM_BN)), u(tokens.div_ceil(OUTPUT_GEMM_ROWS)), u(heads)]))
}

/// The combine's predicted µs (`mla_split` MODE 1 with `dpl` latent dims per lane): every split's
/// state once, (m, l) once per block of a head.
fn combine_us(tokens: usize, heads: usize, latent: usize, splits: usize, dpl: usize, k: &Constants) -> f64 {
    let per_head = latent.div_ceil(32 * dpl);
    let bytes = tokens * heads * splits * (8 * per_head + latent * 4) + tokens * heads * latent * 4;
    candidate_us(0.0, bytes as f64, (2 * tokens * heads * splits * latent) as f64, (heads * per_head * tokens) as f64, k)
}

/// Latent dims per block of `mla_split` MODE 3 (combine and output projection in one launch)
/// where the byte model prices it below the two launches it replaces (`two_us`): each block combines its slice of every token and multiplies it by its W_UV
/// columns, the slices' partial sums written to the split-K region and read once by the head's
/// last block. None where no slice width fits (the template: 16, 32 or 64 dims; V rows within
/// a block; the partial sums within the region and a last block's within `MAX_LAST_BLOCK_SUMS`).
fn combined_slice(tokens: usize, heads: usize, v: usize, latent: usize, splits: usize, out_size: usize, two_us: f64, k: &Constants) -> Option<usize> {
    let cost = |ds: usize| {
        let sl = latent / ds;
        let bytes = tokens * heads * splits * (8 * sl + latent * 4) + 2 * sl * tokens * heads * v * 4 + 8 * heads * sl + tokens * heads * v * out_size;
        let flops = 2 * tokens * heads * (splits + v) * latent;
        candidate_us((heads * v * latent * 2) as f64, bytes as f64, flops as f64, (heads * sl) as f64, k)
    };
    let fits = |ds: usize| {
        let sums = (latent / ds) * tokens * v * 4;
        latent % ds == 0 && v <= THREADS as usize && sums <= MAX_LAST_BLOCK_SUMS && sums * heads <= SplitKLayout::PARTIAL_BYTES as usize && heads <= SplitKLayout::COUNTERS as usize
    };
    [64usize, 32, 16].into_iter().filter(|&ds| fits(ds)).map(|ds| (ds, cost(ds))).filter(|&(_, us)| us < two_us).min_by(|a, b| a.1.total_cmp(&b.1)).map(|(ds, _)| ds)
}

pub(super) fn instances(cx: &Cx, op: &Op) -> Result<Vec<Instance>, String> {
    let Op::MlaAttention { q, kv_b, topk, layer, heads, scale, form: _, absorbed, partials, out } = *op else {
        return Err("not an MLA attention".into());
    };
    let (p, m, kv) = (cx.program, &cx.plan.model, &cx.plan.memory.kv);
    let (nope, rope, v, latent) = (m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim, m.kv_lora_rank);
    if kv.dtype != DType::BF16 || kv.latent_dim != latent || kv.rope_dim != rope {
        return Err(format!("the cache ({} latent {} rope {}) does not hold this model's BF16 latents", kv.dtype, kv.latent_dim, kv.rope_dim));
    }
    if nope % 4 != 0 || rope % 4 != 0 || rope == 0 || rope > 128 || latent % 8 != 0 || latent == 0 || v == 0 || v % 4 != 0 || kv.row_elems() % 4 != 0 {
        return Err(format!("nope {nope}, rope {rope}, v {v}, latent {latent}, row {} are outside the template", kv.row_elems()));
    }
    let qk = nope + rope;
    let tokens = numel(p, q) / (heads * qk).max(1);
    if tokens == 0 || numel(p, q) != tokens * heads * qk || numel(p, out) != tokens * heads * v {
        return Err(format!("q {:?} / out {:?} do not match {heads} heads", p.buffer(q).shape, p.buffer(out).shape));
    }
    if cx.plan.weight(kv_b).dtype != DType::BF16 {
        return Err("kv_b must be BF16".into());
    }
    let ins = p.inputs;
    for b in [ins.positions, ins.token_seq, ins.page_table].into_iter().chain(topk) {
        if p.buffer(b).dtype != DType::I32 {
            return Err(format!("{} is not I32", p.buffer(b).name));
        }
    }
    let k = match topk {
        Some(t) if numel(p, t) == tokens * width(p, t) && width(p, t) > 0 => width(p, t),
        Some(t) => return Err(format!("top-k {:?} does not have a row per token", p.buffer(t).shape)),
        None => 0,
    };
    let nl = latent.div_ceil(128);
    let slots = u32::try_from(kv.pages * kv.page_size).map_err(|_| "the cache slots overflow a u32".to_string())?;
    let max_pos = u32::try_from(kv.max_context).map_err(|_| "the context overflows a u32".to_string())?;
    let (q_bf16, out_bf16) = (float_flag(p.buffer(q).dtype, "q")?, float_flag(p.buffer(out).dtype, "the output")?);
    // split-KV where the op has the scratch and the geometry fits mla_split
    let split_cap = if p.buffer(partials).shape.len() == 3 { p.buffer(partials).shape[1] } else { 0 };
    // (the combine launch holds 128 splits' states in a warp: attention_splits_cap stays <= 128)
    let split = (1..=128).contains(&split_cap)
        && k > 0
        && nope % 8 == 0
        && nope <= 256
        && latent % 32 == 0
        && latent <= 4 * THREADS as usize
        && v % 8 == 0
        && numel(p, absorbed) == tokens * heads * latent
        && numel(p, partials) == tokens * split_cap * heads * (latent + 4);
    let instance = |hg: usize, mode: u32, splits: usize, per: usize| -> MlaAttentionParams {
        let (mma, qbs) = mma_layout(hg, latent, rope, kv.row_elems(), out_bf16 == 1);
        let threads = if mode == 1 { split_threads(per) } else { threads_for(hg) };
        // the tensor-core path keeps as many 128-dim chunks of each warp's 16-row tile for the
        // context as the q_abs | ctx region (free during the tiles) holds for every warp
        let stage = |threads: u32| if mma == 1 { (hg * nl * 1024 / ((threads as usize / 32) * 16 * 256)).min(nl) } else { 0 };
        // where that leaves dims to read from the cache again, a split block's warps take each
        // tile together instead, each its share of the dims (every row read once)
        let coop = match coop_warps(latent, hg, nl) {
            Some(w) if mode == 1 && mma == 1 && stage(threads) < nl => Some(w),
            _ => None,
        };
        let threads = coop.map_or(threads, |w| 32 * w as u32);
        let stage = if coop.is_some() { 0 } else { stage(threads) };
        let per = if mode == 1 { per } else { k };
        let qs = q_slices(nope, hg, nl, threads);
        // The q_abs partial sums and (MMA) the split q and p tiles share one scratch region.
        let xs = (qs * hg * nl * 512).max(mma as usize * (3 * hg * qbs as usize + threads as usize / 32 * 576));
        MlaAttentionParams {
            arch: cx.arch,
            heads: heads as u32,
            hg: hg as u32,
            nope: nope as u32,
            rope: rope as u32,
            v: v as u32,
            latent: latent as u32,
            nl: nl as u32,
            qs: qs as u32,
            row: kv.row_elems() as u32,
            page: kv.page_size.max(1) as u32,
            pps: width(p, ins.page_table) as u32,
            slots,
            max_pos,
            topk: k as u32,
            chunk: chunk(per, threads) as u32,
            threads,
            mma,
            qbs,
            xs: xs as u32,
            q_bf16,
            out_bf16,
            mode,
            splits: splits as u32,
            split: per as u32,
            stage: stage as u32,
            coop: coop.is_some() as u32,
            tt: 1,
        }
    };
    // The preferred head group (split: all heads that fit, the splits fill the GPU), or smaller
    // ones while shared memory does not fit.
    let mut hg = heads_per_block(heads, nl, if split { MIN_BLOCKS } else { tokens });
    if 4 * nl * hg > MAX_CTX_REGS {
        return Err(format!("a latent of {latent} does not fit one warp's registers"));
    }
    let (mode, (n_splits, per)) = if split { (1, splits(k, tokens * heads / hg, cx.consts.sms as usize, split_cap)) } else { (0, (1, k)) };
    let mut params = instance(hg, mode, n_splits, per);
    while hg > 1 && params.dynamic_smem()? > cx.smem_limit {
        hg = (1..hg).rev().find(|d| heads % d == 0).unwrap_or(1);
        params = instance(hg, mode, n_splits, per);
    }
    let smem = params.dynamic_smem()?;
    fits(smem as usize, cx.smem_limit, &format!("MLA attention over {hg} heads"))?;
    let prefill = matches!(p.kind, ProgramKind::Prefill { .. });
    let params = token_pairs(params, tokens, prefill, cx.smem_limit)?.unwrap_or(params);
    if tokens > 65_535 {
        return Err(format!("{tokens} tokens exceed the grid's y dimension"));
    }
    let args = MlaAttentionArgs {
        q: Ptr::Buffer(q),
        kv_b: Ptr::Weight(kv_b),
        topk: Ptr::Buffer(topk.unwrap_or(q)),
        positions: Ptr::Buffer(ins.positions),
        token_seq: Ptr::Buffer(ins.token_seq),
        page_table: Ptr::Buffer(ins.page_table),
        cache: Ptr::KvCache(layer as u32),
        rope: Ptr::RopeTable,
        out: Ptr::Buffer(out),
        absorbed: Ptr::Buffer(absorbed),
        partials: Ptr::Buffer(partials),
        scale,
    };
    let attention = of_grid(&params, [(heads / hg) as u32, (tokens / params.tt as usize) as u32, n_splits as u32], params.threads, args.launch_args());
    if !split {
        return Ok(vec![attention]);
    }
    // the combine's latent dims per lane: the most (4) whose blocks still cover the SMs, else 1
    let sms = cx.consts.sms as usize;
    let dpl = [4usize, 2].into_iter().find(|d| heads * latent.div_ceil(32 * d) * tokens >= sms).unwrap_or(1);
    let out_size = if out_bf16 == 1 { 2 } else { 4 };
    let ((rpw, tg), output_us) = output_shape(tokens, heads, v, latent, out_size, &cx.consts);
    let helper = |mode: u32, rpw: usize, ds: usize| MlaSplitParams {
        arch: cx.arch,
        heads: heads as u32,
        nope: nope as u32,
        rope: rope as u32,
        v: v as u32,
        latent: latent as u32,
        nl: nl as u32,
        tokens: tokens as u32,
        splits: n_splits as u32,
        rpw: rpw as u32,
        tg: if mode == 2 { tg as u32 } else { tokens as u32 },
        dpl: if mode == 1 { dpl as u32 } else { 4 },
        threads: if mode == 1 { 32 } else { THREADS },
        ds: ds as u32,
        partials: if mode == 3 { SplitKLayout::PARTIALS as u32 } else { 0 },
        mode,
        q_bf16,
        out_bf16,
    };
    let split_args = |splitk: Ptr| MlaSplitArgs { q: Ptr::Buffer(q), kv_b: Ptr::Weight(kv_b), absorbed: Ptr::Buffer(absorbed), partials: Ptr::Buffer(partials), out: Ptr::Buffer(out), splitk }.launch_args();
    let args = split_args(Ptr::Buffer(out));
    let absorb = helper(0, 1, 0);
    fits(absorb.dynamic_smem()? as usize, cx.smem_limit, "the MLA absorb launch")?;
    let mut launches = vec![of_grid(&absorb, [heads as u32, (latent / 32) as u32, 1], THREADS, args.clone()), attention];
    // combine and output projection in one launch where the byte model prices it lower (small
    // batches: the launch saved, W_UV read once by slices), else two
    let two_us = combine_us(tokens, heads, latent, n_splits, dpl, &cx.consts) + output_us;
    if let Some(ds) = combined_slice(tokens, heads, v, latent, n_splits, out_size, two_us, &cx.consts) {
        let both = helper(3, 1, ds);
        launches.push(of_grid(&both, [(heads * latent / ds) as u32, 1, 1], THREADS, split_args(Ptr::SplitKRegion)));
    } else {
        let (combine, output) = (helper(1, 1, 0), helper(2, rpw, 0));
        launches.push(of_grid(&combine, [(heads * latent.div_ceil(32 * dpl)) as u32, tokens as u32, 1], 32, args.clone()));
        // (16-byte loads: every head's context, W_UV and row start on a multiple of 8 values)
        let gemm_fits = latent % 8 == 0 && nope % 8 == 0 && heads <= 65_535;
        if gemm_fits && output_gemm_us(tokens, heads, v, latent, out_size, &cx.consts) < output_us {
            let (gemm, grid) = output_gemm(cx.arch, tokens, heads, nope, v, latent, out_bf16, cx.smem_limit)?;
            fits(gemm.dynamic_smem()? as usize, cx.smem_limit, "the attention output GEMM")?;
            let (w, o) = (Ptr::Weight(kv_b), Ptr::Buffer(out));
            let gemm_args = LinearBf16GemmArgs { x: Ptr::Buffer(absorbed), w, out: o, w1: w, w2: w, w3: w, out1: o, out2: o, out3: o, splitk: o, nw: w, eps: 0.0 };
            launches.push(of_grid(&gemm, grid, THREADS, gemm_args.launch_args()));
        } else {
            launches.push(of_grid(&output, [(heads * v / (8 * rpw)) as u32, tokens.div_ceil(tg) as u32, 1], THREADS, args));
        }
    }
    Ok(launches)
}

#[cfg(test)]
mod tests {
    use super::output_shape;
    use kiln_runtime::perf::Constants;

    #[test]
    fn the_output_projection_groups_tokens_where_contexts_are_read_again() {
        // GLM-5 tp8 (8 heads, v 256, latent 512, BF16 out), 188 SMs. Batch 64: one group of 64
        // with 2 rows per warp is 128 blocks reading W_UV (2 MiB) once and every 128 KiB context
        // of a head 16 times (16.8 MB); 4 rows in groups of 16 is 256 blocks reading W_UV 4 times
        // and each context 8 times (8.4 + 8.4 MB) on every SM: the lower
        let c = Constants::SM120A;
        let ((rpw, tg), us) = output_shape(64, 8, 256, 512, 2, &c);
        assert_eq!((rpw, tg), (4, 16));
        let bandwidth = c.dram_tbps * c.dram_efficiency * 1e6; // bytes per µs
        let bytes = (4 * 8 * 256 * 512 * 2 + 64 * 8 * 512 * 4 * 8 + 64 * 8 * 256 * 2) as f64;
        assert!((us - (bytes / bandwidth + c.launch_us)).abs() < 1e-6, "{us} µs for {bytes} B");
        // batch 1: one token, one row per warp fills the GPU (256 blocks); nothing to group
        assert_eq!(output_shape(1, 8, 256, 512, 2, &c).0, (1, 1));
    }
}
