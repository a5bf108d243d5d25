//! Tensor-core GEMMs for the `Op::Linear` steps the GEMV templates do not take (M > 32 in
//! prefill, or decode batches whose activations do not fit in shared memory).
//!
//! Tiled forms: 64-row blocks (`grid.y`; 128 or 256 for BF16 prefill with BF16 activations) by
//! 128-column blocks (`grid.x`: consecutive blocks share an activation tile in L2), K streamed
//! through a ring of cp.async stages. Decode-sized M uses the split-K forms: small blocks whose 8
//! warps share out K and add their partial sums in warp order, so even a 256-row projection gets
//! dozens of blocks (NVFP4 up to M = 32; BF16 up to 64 where the byte model prefers them).
//! NVFP4 gets one launch per part (each part quantises the activations with its own
//! `input_scale`), or one launch for SiLU-mul, whose blocks take gate rows and the matching up
//! rows.

use super::{candidate_us, fits, float_flag, numel, of_grid, Cx, Instance, THREADS};
use crate::kernels::{LinearBf16GemmArgs, LinearBf16GemmParams, LinearNvfp4GemmArgs, LinearNvfp4GemmParams, Ptr};
use kiln_runtime::perf::Constants;
use kiln_runtime::plan::{DType, Epilogue, LinearWeights, Op, SplitKLayout};

/// Activation rows per block of both tiled GEMMs.
pub const GEMM_BM: usize = 64;
/// Weight rows (output columns; half of them gate and half up with SiLU-mul) per block.
pub const GEMM_BN: usize = 128;
/// Largest M for which the split-K forms (NVFP4, and BF16 past decode's 64 rows; blocks of 16 or
/// 32 rows, larger M taking several row blocks, each quantising or loading its own rows) are
/// costed beside the tiled ones: decode, and prefill chunks up to 512 tokens, whose narrow
/// projections leave most SMs idle in tiles.
const SPLIT_MAX_M: usize = 512;
/// Largest M of the BF16 split-K form (4 m16 tiles per warp).
const BF16_SPLIT_MAX_M: usize = 64;

/// Shared memory a block may take so that two blocks share an SM (100 KiB per SM, 1 KiB of it
/// reserved per block): one block loads or quantises while the other runs its mmas.
const TWO_BLOCKS_SMEM: usize = 48 * 1024;
/// k16 steps per stage of the tiled BF16 GEMM (64-byte rows: a 128-row block's stage is 20 KiB).
pub(super) const BF16_KB: u32 = 2;

/// Stage buffers for stages of `stage` bytes: a ring of 3 or 4 within two blocks per SM if it
/// fits, else as deep a ring as one block may have (at least double buffering).
fn ring(stage: usize, smem_limit: u32) -> u32 {
    let two = (TWO_BLOCKS_SMEM / stage).min(4);
    let n = if two >= 3 { two } else { (smem_limit as usize / stage).min(4) };
    n.max(2) as u32
}

/// A BF16 GEMM's params with the tiled form's ring of stage buffers sized by [`ring`] (the split
/// form has none: unchanged).
pub(super) fn tiled_ring(params: LinearBf16GemmParams, smem_limit: u32) -> Result<LinearBf16GemmParams, String> {
    if params.split == 1 {
        return Ok(params);
    }
    let stage = LinearBf16GemmParams { nbuf: 1, ..params }.dynamic_smem()? as usize;
    Ok(LinearBf16GemmParams { nbuf: ring(stage, smem_limit), ..params })
}

/// NVFP4 stages: (64-wide K steps per stage, stage buffers). One k64 step per stage and as deep
/// a ring as fits two blocks per SM, so several stages of weights are in flight (decode-sized M
/// is latency-bound); no more buffers than K has stages. A stage holds the weight codes and
/// scales (6656 B) and one activation plane per part: e2m1 codes and scales (3328 B) on
/// sm_120a, f16 values (8192 B) on sm_90a.
fn nvfp4_stages(arch: u32, k: usize, silu: bool) -> (u32, u32) {
    let plane = if arch == 90 { 8192 } else { 3328 };
    let stage = (if silu { 2 } else { 1 }) * plane + 6656;
    let nbuf = (TWO_BLOCKS_SMEM / stage).clamp(2, 4).min(k.div_ceil(64).max(2));
    (1, nbuf as u32)
}

/// The shape of a BF16 GEMM's blocks: split-K (`split` 1: 16*MT rows x 8*NT weight rows, K
/// over `ks` blocks) or tiled (32*MT rows x 128).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Bf16Form {
    pub split: u32,
    pub mt: u32,
    pub nt: u32,
    /// Blocks that share out K (grid.z; > 1 adds the partials through the split-K region,
    /// `SplitKLayout`).
    pub ks: u32,
}

impl Bf16Form {
    /// Activation rows and weight rows (output columns) of one block.
    pub fn block(&self) -> (usize, usize) {
        if self.split == 1 {
            (16 * self.mt as usize, 8 * self.nt as usize)
        } else {
            (32 * self.mt as usize, GEMM_BN)
        }
    }
}

/// K stages each slice of a tiled form sharing K over blocks keeps (its ring of cp.async
/// stages fills and drains once per block).
const MIN_TILED_STAGES: usize = 8;

/// m16 tiles per warp of the 256-row prefill tile (BF16 activations).
const WIDE_MT: u32 = 8;

/// Most K slices of a prefill (128-row) tile: ptxas 12.9 spills such a block that adds 12 slices
/// into its 64 accumulators (the unrolled slice sum), not one that adds 6.
const MAX_PREFILL_KS: u32 = 6;

/// Most K slices of a 64-row tile past decode's 64 rows: ptxas 12.9 spills the sm_90a block
/// that adds 24 slices into its 32 accumulators at 128 rows, not one that adds 12 (as decode's
/// 2,048-column projection at batch 64 does).
const MAX_SHORT_KS: u32 = 12;

/// Warps of a split-form block (THREADS / 32): each takes every 8th K step.
const WARPS: usize = THREADS as usize / 32;

/// Cross-block K slices the split forms may take (see [`ks_allowed`]).
const KS_CANDIDATES: [u32; 12] = [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64];

/// Whether a form with `tiles` output tiles may share its `steps` K steps over `ks` blocks: each
/// slice keeps at least `min_per` steps (split forms: one per warp, the warps of a block taking
/// every 8th k16 / k64 step; the tiled form: `MIN_TILED_STAGES` for its ring) and none is empty,
/// the tiles fit the region's counters and the `sums` f32 partial sums of every slice its bytes.
fn ks_allowed(ks: u32, tiles: usize, steps: usize, sums: usize, min_per: usize) -> bool {
    let per = steps.div_ceil(ks as usize);
    ks == 1 || (per >= min_per && (ks as usize - 1) * per < steps && tiles as u64 <= SplitKLayout::COUNTERS && (ks as usize * sums * 4) as u64 <= SplitKLayout::PARTIAL_BYTES)
}

/// The BF16 GEMM's form for M x N x K and its predicted µs. Prefill (M > 64) is tiled: 128-row
/// blocks with BF16 activations past 64 rows, else 64, with K over the `ks` blocks that cost
/// least (the tiled forms below). Up to 64 rows the split-K widths (32, 16,
/// 8 weight rows per block), each with K shared out over `ks` blocks, and the tiled form are
/// costed with [`candidate_us`]: the weights read once per row block, the activations once per
/// column block, the partial sums written and read once per slice, over the SMs the blocks
/// occupy; the cheapest wins (ties: the earlier, so fewer slices). At decode batch 64 a
/// 2,048-row projection becomes 128 split blocks instead of 16 tiled ones; a 32-row one at
/// batch 1 shares its K over 48 blocks instead of one block per 8 rows. `out_f32`: the output is
/// F32, whose decode tiles take K over at most `MAX_SHORT_KS` blocks (ptxas 12.9 spills the
/// sm_120a 64-row tile adding 24 slices into F32 outputs: the MTP layer's eh_proj halves).
pub fn bf16_gemm_form(m: usize, n: usize, k: usize, x_bf16: bool, out_f32: bool, consts: &Constants) -> (Bf16Form, f64) {
    let tiled = Bf16Form { split: 0, mt: if x_bf16 && m > GEMM_BM { 4 } else { 2 }, nt: 1, ks: 1 };
    let cost = bf16_cost(m, n, k, x_bf16, None, consts);
    if m > BF16_SPLIT_MAX_M {
        // a narrow projection's tiles alone leave most SMs idle (q_a's 256 columns of a 2,048-token
        // chunk: 32 blocks): its K shared out too, where the partial sums fit the region; a wide
        // one's 256-row blocks read its weights half as often (o_proj of a 2,048-token chunk: 8
        // row blocks, not 16), with K in one block (their 128 accumulators a thread leave no
        // registers for a slice sum)
        let wide = (x_bf16 && m > 4 * GEMM_BM).then_some(Bf16Form { mt: WIDE_MT, ..tiled });
        // and a narrow projection of a short chunk may take 64-row tiles with K over more blocks
        // (decode's): q_a of a 128-token chunk is 2 tiles x 6 slices of 128 rows, 12 blocks, or
        // 4 x 12 of 64 rows, 48
        let short = (tiled.mt > 2).then(|| bf16_tiled_forms(Bf16Form { mt: 2, ..tiled }, m, n, k).filter(|f| f.ks <= MAX_SHORT_KS)).into_iter().flatten();
        // or, up to 512 rows, the split form's 16- and 32-row blocks (a few weight rows each, K
        // over the warps and blocks), which fill the SMs where the tiles cannot
        let split = (m <= SPLIT_MAX_M).then(|| bf16_split_forms(m, n, k).filter(|f| f.mt <= 2)).into_iter().flatten();
        let best = cheapest(bf16_tiled_forms(tiled, m, n, k).filter(|f| f.ks <= MAX_PREFILL_KS).chain(wide).chain(short).chain(split), &cost).unwrap_or(tiled);
        return (best, cost(&best));
    }
    let tiles = bf16_tiled_forms(tiled, m, n, k).filter(|f| !out_f32 || f.ks <= MAX_SHORT_KS);
    let best = cheapest(bf16_split_forms(m, n, k).chain(tiles), &cost).unwrap_or(tiled);
    (best, cost(&best))
}

/// The tiled form, its K stages shared out over `ks` blocks where each slice
/// keeps `MIN_TILED_STAGES` stages for its ring, none is empty, and the tiles and partial sums
/// fit the split-K region: a 6,144-column projection at batch 64 reads its activations once per
/// 128 columns (48 column blocks, not the split form's 192) and still fills the GPU.
fn bf16_tiled_forms(tiled: Bf16Form, m: usize, n: usize, k: usize) -> impl Iterator<Item = Bf16Form> {
    let tiles = n.div_ceil(GEMM_BN) * m.div_ceil(32 * tiled.mt as usize);
    let steps = k.div_ceil(16 * BF16_KB as usize);
    KS_CANDIDATES.into_iter().filter(move |&ks| ks_allowed(ks, tiles, steps, m * n, MIN_TILED_STAGES)).map(move |ks| Bf16Form { ks, ..tiled })
}

/// The cheapest form of a group's M x N x K (its members' columns side by side) and its
/// predicted µs; None past the split form's rows (decode only). `norm`: the GEMM RMS-normalises
/// its BF16 rows first (`NORM`), with a norm weight of that many bytes a value: only the split
/// forms do that. Without it, a group of two members with outputs of one dtype may take the
/// tiled forms too (q_b | wq_b at batch 64: 2,560 columns read x once per 128 instead of once
/// per 32); with more members or mixed outputs ptxas 12.9 spills some tiled instances.
pub fn bf16_group_form(m: usize, n: usize, k: usize, x_bf16: bool, norm: Option<usize>, tiled_ok: bool, consts: &Constants) -> Option<(Bf16Form, f64)> {
    let cost = bf16_cost(m, n, k, x_bf16, norm, consts);
    if m > BF16_SPLIT_MAX_M {
        return None;
    }
    let tiled = Bf16Form { split: 0, mt: 2, nt: 1, ks: 1 };
    let tiled_forms = (norm.is_none() && tiled_ok).then(|| bf16_tiled_forms(tiled, m, n, k)).into_iter().flatten();
    cheapest(bf16_split_forms(m, n, k).chain(tiled_forms), &cost).map(|f| (f, cost(&f)))
}

/// A BF16 form's predicted µs ([`candidate_us`]): the weights once per row block, the
/// activations once per column block, the partial sums written and read once per slice. With
/// a norm (split form) every block also reads its rows in full for their sums of squares, and
/// the norm weight of its K slice.
fn bf16_cost(m: usize, n: usize, k: usize, x_bf16: bool, norm: Option<usize>, consts: &Constants) -> impl Fn(&Bf16Form) -> f64 + '_ {
    let x_bytes = if x_bf16 { 2 } else { 4 };
    move |f: &Bf16Form| {
        let (bm, bn) = f.block();
        let (gx, gy) = (n.div_ceil(bn) as f64, m.div_ceil(bm) as f64);
        let partials = if f.ks > 1 { 2.0 * (f.ks as usize * m * n * 4) as f64 } else { 0.0 };
        let (norm_w, norm_x) = norm.map_or((0.0, 0.0), |w| ((k * w) as f64 * gx * gy, (m * k * 2) as f64 * gx * f.ks as f64));
        candidate_us((n * k * 2) as f64 * gy + norm_w, (m * k * x_bytes) as f64 * gx + partials + norm_x, 0.0, gx * gy * f.ks as f64, consts)
    }
}

/// Every split width with all rows in one block, then with 32 or 16 rows per block (a few
/// weight rows at batch 64: more row blocks fill SMs that one block of 64 rows leaves idle),
/// each with the K slices it may take.
fn bf16_split_forms(m: usize, n: usize, k: usize) -> impl Iterator<Item = Bf16Form> {
    let all_rows = m.div_ceil(16) as u32;
    let mts = [all_rows, 2, 1].into_iter().filter(move |&mt| mt <= all_rows);
    mts.flat_map(|mt| [4, 2, 1].map(|nt| (mt, nt))).flat_map(move |(mt, nt)| {
        let tiles = n.div_ceil(8 * nt as usize) * m.div_ceil(16 * mt as usize);
        KS_CANDIDATES.into_iter().filter(move |&ks| ks_allowed(ks, tiles, k.div_ceil(16), m * n, WARPS)).map(move |ks| Bf16Form { split: 1, mt, nt, ks })
    })
}

/// The candidate of least `cost` (ties: the earlier).
fn cheapest<F>(candidates: impl Iterator<Item = F>, cost: impl Fn(&F) -> f64) -> Option<F> {
    candidates.map(|f| (cost(&f), f)).fold(None, |best: Option<(f64, F)>, (c, f)| match best {
        Some((bc, b)) if bc <= c => Some((bc, b)),
        _ => Some((c, f)),
    })
    .map(|(_, f)| f)
}

/// The NVFP4 GEMM's form for M x K over the widest part's `rows` (gate/up pairs with SiLU-mul)
/// and its predicted µs: `(split, mt, nt, slices)`, split-K blocks of 16*MT rows x 8*NT weight
/// rows (4*NT pairs) with K over `slices` blocks, or tiled 64 x 128. Up to 64 rows the split
/// widths, their 16- and 32-row blocks, their K slices and the tiled form are costed with
/// [`candidate_us`] as the BF16 form is (weights once per row block, activations once per column
/// block, the partials written and read once per slice); the cheapest wins (ties: the earlier).
/// At batch 64 the shared expert's 256 gate/up pairs become 64 split blocks of 16 pairs x 32 rows
/// instead of 4 tiled ones.
pub fn nvfp4_gemm_form(m: usize, rows: usize, k: usize, silu: bool, x_bf16: bool, consts: &Constants) -> ((u32, u32, u32, u32), f64) {
    let tiled = (0, 1, 2, 1);
    let per_row = (if silu { 2 } else { 1 }) * k * 9 / 16;
    let x = m * k * if x_bf16 { 2 } else { 4 };
    // f32 sums per output: gate and up with SiLU
    let sums = m * rows * if silu { 2 } else { 1 };
    let cost = |&(split, mt, nt, slices): &(u32, u32, u32, u32)| {
        let (bm, bn) = if split == 1 { (16 * mt as usize, (if silu { 4 } else { 8 }) * nt as usize) } else { (GEMM_BM, if silu { GEMM_BN / 2 } else { GEMM_BN }) };
        let (gx, gy) = (rows.div_ceil(bn) as f64, m.div_ceil(bm) as f64);
        let partials = if slices > 1 { 2.0 * (slices as usize * sums * 4) as f64 } else { 0.0 };
        candidate_us((rows * per_row) as f64 * gy, x as f64 * gx + partials, 0.0, gx * gy * slices as f64, consts)
    };
    // past decode-sized M the split form still serves a narrow part of a short chunk (the
    // shared expert's 256 gate/up pairs of a 128-token chunk: 8 tiled blocks), its weights read
    // once per 32 rows; the model weighs that against the idle SMs
    if m > SPLIT_MAX_M {
        return (tiled, cost(&tiled));
    }
    let all_rows = m.div_ceil(16).min(2) as u32;
    let mts = [all_rows, 1].into_iter().filter(|&mt| mt <= all_rows);
    let candidates = mts.flat_map(|mt| [4, 2].map(|nt| (mt, nt))).flat_map(|(mt, nt)| {
        let tiles = rows.div_ceil((if silu { 4 } else { 8 }) * nt as usize) * m.div_ceil(16 * mt as usize);
        KS_CANDIDATES.into_iter().filter(move |&ks| ks_allowed(ks, tiles, k.div_ceil(64), sums, WARPS)).map(move |ks| (1, mt, nt, ks))
    });
    let best = cheapest(candidates.chain([tiled]), cost).unwrap_or(tiled);
    (best, cost(&best))
}

pub(super) fn instances(cx: &Cx, op: &Op) -> Result<Vec<Instance>, String> {
    let Op::Linear { input, ref weights, ref parts, k, epilogue, out } = *op else {
        return Err("not a linear".into());
    };
    let p = cx.program;
    let m = numel(p, input) / k.max(1);
    let n: usize = parts.iter().map(|q| q.rows).sum();
    if m == 0 || n == 0 || k == 0 {
        return Err("an empty linear".into());
    }
    let x_bf16 = float_flag(p.buffer(input).dtype, "the input")?;
    let out_bf16 = float_flag(p.buffer(out).dtype, "the output")?;
    if m.div_ceil(GEMM_BM) > 65_535 {
        return Err(format!("M = {m} needs too many row blocks"));
    }
    // The kernels index elements with 32-bit offsets (bytes with 64-bit ones).
    if m.checked_mul(n.max(k)).is_none_or(|e| e > u32::MAX as usize) {
        return Err(format!("M = {m} x {} elements overflow 32-bit indices", n.max(k)));
    }
    let u = |v: usize| v as u32;
    match *weights {
        LinearWeights::Bf16 { weight } => {
            super::bf16_linear_shape(k, epilogue, "GEMM")?;
            // Decode-sized M: split K over the warps of small blocks, enough of them to keep the
            // weights streaming. Else 128-row blocks halve the weight traffic of long prefills
            // (256-row ones again where the byte model prefers them); F32 activations (three
            // BF16 planes) and short ones keep 64 rows.
            let base = LinearBf16GemmParams { arch: cx.arch, m: u(m), n: u(n), k: u(k), segs: 1, c1: 0, c2: 0, c3: 0, split: 0, ks: 1, partials: 0, mt: 2, nt: 1, kb: BF16_KB, nbuf: 2, threads: THREADS, x_bf16, out_bf16, norm: 0, nw_bf16: 0, batch: 1, xld: 0, old: 0, woff: 0, xb: 0, wb: 0, ob: 0 };
            let (form, _) = bf16_gemm_form(m, n, k, x_bf16 == 1, out_bf16 == 0, &cx.consts);
            let partials = if form.ks > 1 { SplitKLayout::PARTIALS as u32 } else { 0 };
            let params = tiled_ring(LinearBf16GemmParams { split: form.split, mt: form.mt, nt: form.nt, ks: form.ks, partials, ..base }, cx.smem_limit)?;
            let (bm, bn) = form.block();
            fits(params.dynamic_smem()? as usize, cx.smem_limit, "the BF16 GEMM")?;
            let grid = [u(n.div_ceil(bn)), u(m.div_ceil(bm)), params.ks];
            // one K slice per block needs no region: the output stands in for the ignored argument
            let splitk = if params.ks > 1 { Ptr::SplitKRegion } else { Ptr::Buffer(out) };
            let (w, o) = (Ptr::Weight(weight), Ptr::Buffer(out));
            let args = LinearBf16GemmArgs { x: Ptr::Buffer(input), w, out: o, w1: w, w2: w, w3: w, out1: o, out2: o, out3: o, splitk, nw: w, eps: 0.0 };
            Ok(vec![of_grid(&params, grid, THREADS, args.launch_args())])
        }
        LinearWeights::Nvfp4 { weight, scale, scale_2, input_scale } => {
            let silu = super::nvfp4_linear_shape(k, parts, epilogue, "GEMM")?;
            // Decode-sized M: the split-K form, 16 or 32 rows by 8*NT weight rows per block, K
            // maybe over several blocks, as the byte model prefers (nvfp4_gemm_form).
            let widest = parts.iter().map(|q| q.rows).max().unwrap_or(0);
            let ((split, mt, nt, slices), _) = nvfp4_gemm_form(m, widest, k, silu, x_bf16 == 1, &cx.consts);
            let args = LinearNvfp4GemmArgs {
                x: Ptr::Buffer(input),
                w: Ptr::Weight(weight),
                sf: Ptr::Weight(scale),
                scale_2: Ptr::Weight(scale_2),
                input_scale: Ptr::Weight(input_scale),
                out: Ptr::Buffer(out),
                // one K slice per block needs no region: the output stands in for the ignored argument
                splitk: if slices > 1 { Ptr::SplitKRegion } else { Ptr::Buffer(out) },
            }
            .launch_args();
            let base = LinearNvfp4GemmParams {
                arch: cx.arch,
                m: u(m),
                k: u(k),
                rows: 0,
                row0: 0,
                up0: 0,
                part: 0,
                silu: silu as u32,
                ldo: u(if silu { parts[0].rows } else { n }),
                col0: 0,
                ks: nvfp4_stages(cx.arch, k, silu).0,
                nbuf: nvfp4_stages(cx.arch, k, silu).1,
                split: 0,
                slices: 1,
                partials: 0,
                mt: 1,
                nt: 2,
                threads: THREADS,
                x_bf16,
                out_bf16,
            };
            let (base, bm, bn) = if split == 1 {
                let per_block = if silu { 4 * nt as usize } else { 8 * nt as usize };
                let partials = if slices > 1 { SplitKLayout::PARTIALS as u32 } else { 0 };
                (LinearNvfp4GemmParams { split: 1, slices, partials, mt, nt, ks: 1, nbuf: 2, ..base }, 16 * mt as usize, per_block)
            } else {
                (base, GEMM_BM, if silu { GEMM_BN / 2 } else { GEMM_BN })
            };
            let launch = |params: LinearNvfp4GemmParams| -> Result<Instance, String> {
                fits(params.dynamic_smem()? as usize, cx.smem_limit, "the NVFP4 GEMM")?;
                Ok(of_grid(&params, [u((params.rows as usize).div_ceil(bn)), u(m.div_ceil(bm)), params.slices], THREADS, args.clone()))
            };
            if silu {
                let rows = u(parts[0].rows);
                return Ok(vec![launch(LinearNvfp4GemmParams { rows, up0: rows, ..base })?]);
            }
            let mut row0 = 0;
            let mut list = Vec::new();
            for (i, q) in parts.iter().enumerate() {
                list.push(launch(LinearNvfp4GemmParams { rows: u(q.rows), row0: u(row0), part: i as u32, col0: u(row0), ..base })?);
                row0 += q.rows;
            }
            Ok(list)
        }
    }
}

/// The form [`instances`] gives a linear: whether it shares K over blocks, and its predicted µs
/// (all its launches: one per part of an NVFP4 linear without SiLU); None for an empty linear or
/// an NVFP4 shape the template does not take.
pub(super) fn predicted(cx: &Cx, op: &Op) -> Option<(bool, f64)> {
    let Op::Linear { input, ref weights, ref parts, k, epilogue, out } = *op else {
        return None;
    };
    let p = cx.program;
    let m = numel(p, input) / k.max(1);
    let n: usize = parts.iter().map(|q| q.rows).sum();
    if m == 0 || n == 0 || k == 0 {
        return None;
    }
    let x_bf16 = p.buffer(input).dtype == kiln_runtime::plan::DType::BF16;
    match *weights {
        LinearWeights::Bf16 { .. } => {
            let (form, us) = bf16_gemm_form(m, n, k, x_bf16, p.buffer(out).dtype == kiln_runtime::plan::DType::F32, &cx.consts);
            Some((form.ks > 1, us))
        }
        LinearWeights::Nvfp4 { .. } => {
            let silu = super::nvfp4_linear_shape(k, parts, epilogue, "GEMM").ok()?;
            let widest = parts.iter().map(|q| q.rows).max().unwrap_or(0);
            let ((.., slices), us) = nvfp4_gemm_form(m, widest, k, silu, x_bf16, &cx.consts);
            let launches = if silu { 1.0 } else { parts.len() as f64 };
            Some((slices > 1, us * launches))
        }
    }
}

/// The most linears one grouped launch takes (the template's segments).
pub const GROUP_MAX: usize = 4;

/// A `LinearGroup` as one launch of the BF16 GEMM (split or tiled form, [`bf16_group_form`]),
/// its members' columns side by side (`SEGS`), and its predicted µs; None where the group
/// cannot be one launch: more than [`GROUP_MAX`] members, prefill-sized M, or a member other
/// than the last whose rows are not a multiple of 8 (an n8 tile would straddle two weights).
///
/// With `fuse_norm` (a group with a norm, BF16 rows and normed rows) the launch normalises the
/// group's input itself (`NORM`); without it, a group with a norm reads its normed rows (which a
/// norm launch before it writes).
pub(super) fn group_instance(cx: &Cx, op: &Op, fuse_norm: bool) -> Result<Option<(Instance, f64)>, String> {
    let Op::LinearGroup { input, norm, k, ref members } = *op else {
        return Err("not a linear group".into());
    };
    let p = cx.program;
    let (input, fused) = match norm {
        Some(nm) if fuse_norm => {
            if p.buffer(input).dtype != DType::BF16 || p.buffer(nm.normed).dtype != DType::BF16 {
                return Ok(None);
            }
            (input, Some(nm))
        }
        Some(nm) => (nm.normed, None),
        None if fuse_norm => return Ok(None),
        None => (input, None),
    };
    let nw_bf16 = match fused {
        Some(nm) => float_flag(cx.plan.weight(nm.weight).dtype, "the norm weight")?,
        None => 0,
    };
    let m = numel(p, input) / k.max(1);
    let n: usize = members.iter().map(|g| g.rows).sum();
    let aligned = members.split_last().is_some_and(|(_, rest)| rest.iter().all(|g| g.rows % 8 == 0));
    if !(2..=GROUP_MAX).contains(&members.len()) || !aligned || m == 0 || n == 0 || m.checked_mul(n.max(k)).is_none_or(|e| e > u32::MAX as usize) {
        return Ok(None);
    }
    super::bf16_linear_shape(k, Epilogue::None, "GEMM")?;
    let x_bf16 = float_flag(p.buffer(input).dtype, "the input")?;
    let norm_bytes = fused.map(|_| if nw_bf16 == 1 { 2 } else { 4 });
    let mut out_bf16 = 0;
    let mut starts = [0u32; GROUP_MAX];
    let mut col = 0;
    for (s, g) in members.iter().enumerate() {
        out_bf16 |= float_flag(p.buffer(g.out).dtype, "an output")? << s;
        starts[s] = col as u32;
        col += g.rows;
    }
    let tiled_ok = members.len() == 2 && (out_bf16 == 0 || out_bf16 == 3);
    let Some((form, us)) = bf16_group_form(m, n, k, x_bf16 == 1, norm_bytes, tiled_ok, &cx.consts) else {
        return Ok(None);
    };
    let u = |v: usize| v as u32;
    let params = LinearBf16GemmParams {
        arch: cx.arch,
        m: u(m),
        n: u(n),
        k: u(k),
        segs: u(members.len()),
        c1: starts[1],
        c2: starts[2],
        c3: starts[3],
        split: form.split,
        ks: form.ks,
        partials: if form.ks > 1 { SplitKLayout::PARTIALS as u32 } else { 0 },
        mt: form.mt,
        nt: form.nt,
        kb: BF16_KB,
        nbuf: 2,
        threads: THREADS,
        x_bf16,
        out_bf16,
        norm: fused.is_some() as u32,
        nw_bf16,
        batch: 1,
        xld: 0,
        old: 0,
        woff: 0,
        xb: 0,
        wb: 0,
        ob: 0,
    };
    let params = tiled_ring(params, cx.smem_limit)?;
    fits(params.dynamic_smem()? as usize, cx.smem_limit, "the grouped BF16 GEMM")?;
    let w = |s: usize| Ptr::Weight(members.get(s).unwrap_or(&members[0]).weight);
    let o = |s: usize| Ptr::Buffer(members.get(s).unwrap_or(&members[0]).out);
    let splitk = if form.ks > 1 { Ptr::SplitKRegion } else { o(0) };
    let (nw, eps) = fused.map_or((w(0), 0.0), |nm| (Ptr::Weight(nm.weight), nm.eps));
    let args = LinearBf16GemmArgs { x: Ptr::Buffer(input), w: w(0), out: o(0), w1: w(1), w2: w(2), w3: w(3), out1: o(1), out2: o(2), out3: o(3), splitk, nw, eps };
    let (bm, bn) = form.block();
    let grid = [u(n.div_ceil(bn)), u(m.div_ceil(bm)), form.ks];
    Ok(Some((of_grid(&params, grid, THREADS, args.launch_args()), us)))
}

#[cfg(test)]
mod tests {
    use super::{bf16_gemm_form, nvfp4_gemm_form, nvfp4_stages, ring, Bf16Form};
    use kiln_runtime::perf::Constants;

    #[test]
    fn bf16_gemms_pick_the_form_the_byte_model_prefers() {
        let form = |m, n, k, x_bf16| bf16_gemm_form(m, n, k, x_bf16, false, &Constants::SM120A).0;
        // A 2,048 x 6144 projection at decode batch 64 on 188 SMs: 16 tiled blocks draw 16/188
        // of the bandwidth for 37.8 MB, 444 MB-equivalents; two row blocks of 32 rows and 32
        // weight rows make 128 blocks for 100.7 MB, 148; one row block of 64 rows (weights
        // once, 25.2 MB; x once per 32-row column block, 50.3 MB) with K over 3 blocks makes
        // 192 blocks for 78.6 MB with the partials' 3.1 MB: 79; the 16 tiled blocks with their
        // 192 K stages over 12 blocks make 192 too, for 25.2 MB of weights, x once per 128
        // columns (12.6 MB) and the partials written and read (12.6 MB): 50.
        assert_eq!(form(64, 2048, 6144, true), Bf16Form { split: 0, mt: 2, nt: 1, ks: 12 });
        // Prefill is always tiled, 128 rows per block with BF16 activations; 256 tiles of a
        // 2,048-column projection of a 2,048-token chunk fill the SMs with K in one block.
        assert_eq!(form(2048, 2048, 6144, true), Bf16Form { split: 0, mt: 4, nt: 1, ks: 1 });
        assert_eq!(form(2048, 2048, 6144, false), Bf16Form { split: 0, mt: 2, nt: 1, ks: 1 });
        // o_proj's 6,144 columns of that chunk (K 2,048): 768 tiles of 128 rows read x 48 times
        // and the weights 16 times (403 + 403 MB); 384 tiles of 256 rows still fill the SMs and
        // read the weights 8 times (403 + 201 MB). The 2,048-column projection above keeps 128
        // rows: 128 tiles of 256 would leave 60 SMs idle.
        assert_eq!(form(2048, 6144, 2048, true), Bf16Form { split: 0, mt: 8, nt: 1, ks: 1 });
        assert_eq!(form(8192, 2048, 2048, true), Bf16Form { split: 0, mt: 8, nt: 1, ks: 1 });
        // q_a's 256 columns of that chunk are 32 tiles: at 32/188 of the bandwidth, x twice
        // (25.2 MB each) and the weights 16 times (3.1 MB each) are 591 MB-equivalents; K over 6
        // blocks makes 192 blocks for 125.8 MB with the partials' 2 x 12.6 MB (4 slices: 128
        // blocks, 117.4 MB at 128/188, 172), at most 6 (ptxas spills 12).
        assert_eq!(form(2048, 256, 6144, true), Bf16Form { split: 0, mt: 4, nt: 1, ks: 6 });
        // At 8,192 tokens q_a keeps K in one block (two slices' partials, 2 x 8.4 MB, exceed the
        // split-K region's 16 MiB slot); the indexer's 128 wk columns (64 tiles) take 3 slices
        // (12.6 MB of partials), the most that fit.
        assert_eq!(form(8192, 256, 6144, true), Bf16Form { split: 0, mt: 4, nt: 1, ks: 1 });
        assert_eq!(form(8192, 128, 6144, true), Bf16Form { split: 0, mt: 4, nt: 1, ks: 3 });
        // The lm_head slice (19,360 rows) at 32 tokens: the widest split blocks re-read the
        // activations 605 times; 128-wide tiles read them 152 times, and with K over 2 blocks
        // (304 blocks; the partials' 9.9 MB) they fill the GPU, where 152 blocks leave 36 SMs idle.
        assert_eq!(form(32, 19_360, 6144, true), Bf16Form { split: 0, mt: 2, nt: 1, ks: 2 });
        // The indexer's 32 head-weight rows at batch 64: 16-row blocks of 8 weight rows were 16
        // blocks (4.7 MB at 16/188: 36 µs); 32-row blocks of 16 weight rows with K over 48
        // blocks make 192 (x 1.6 MB, weights 0.8 MB, partials 0.8 MB: 2.1 µs).
        assert_eq!(form(64, 32, 6144, true), Bf16Form { split: 1, mt: 2, nt: 2, ks: 48 });
        // ... and at batch 1: the GEMV's 32 blocks each staged all of x; K over 48 blocks of 8
        // rows (8 k16 steps each, one per warp) fills 192 SMs with the weights read once.
        assert_eq!(form(1, 32, 6144, true), Bf16Form { split: 1, mt: 1, nt: 1, ks: 48 });
        // o_proj-sized (6,144 x 2048) at batch 64: the split form's 192 column blocks each read
        // all of x (50.3 MB beside the weights' 25.2); 48 tiled blocks of 128 columns with K over
        // 4 blocks make 192 too and read x 48 times (12.6 MB) with 12.6 MB of partials.
        assert_eq!(form(64, 6144, 2048, true), Bf16Form { split: 0, mt: 2, nt: 1, ks: 4 });
    }

    #[test]
    fn nvfp4_decode_gemms_pick_the_form_the_byte_model_prefers() {
        let form = |m, rows, k, silu| nvfp4_gemm_form(m, rows, k, silu, true, &Constants::SM120A).0;
        // GLM-5 tp8 shared expert gate/up (256 pairs of K = 6144, 1.77 MB) at batch 64: 4 tiled
        // blocks (4.9 MB at 4/188: 151 µs); split blocks of 16 rows and 8 pairs (4 x 32 blocks:
        // the weights 4 times, the 0.79 MB of x 32 times, 32.3 MB at 128/188: 31 µs); blocks of
        // 32 rows and 16 pairs with K over 6 (2 x 16 x 6 = 192 blocks: the weights twice, x 16
        // times, 1.6 MB of partials: 17.4 MB at full bandwidth, 13 µs)
        assert_eq!(form(64, 256, 6144, true), (1, 2, 4, 6));
        // batch 1 and 8: one row block, K over 12 blocks of 8 k64 steps (16 x 12 = 192 blocks)
        assert_eq!(form(1, 256, 6144, true), (1, 1, 4, 12));
        assert_eq!(form(8, 256, 6144, true), (1, 1, 4, 12));
        // the shared expert's down (K = 256: 4 k64 steps, too few to share out)
        assert_eq!(form(64, 6144, 256, false), (1, 2, 4, 1));
        // a 128-token chunk: 8 tiled blocks (2 x 4 of 64 rows x 64 pairs) draw 8/188 of the
        // bandwidth; 4 row blocks of 32 rows and 16 pairs with K over 3 (192 blocks) read the
        // weights 4 times, x 16 times and 3 slices' partials, at full bandwidth
        assert_eq!(form(128, 256, 6144, true), (1, 2, 4, 3));
        // 512 tokens: 32 tiled blocks; 16 row blocks of 16 pairs (256 blocks), K in one
        assert_eq!(form(512, 256, 6144, true), (1, 2, 4, 1));
        // longer chunks stay tiled (their tiles fill the SMs), as does anything past 512 rows
        assert_eq!(form(2048, 256, 6144, true), (0, 1, 2, 1));
        assert_eq!(form(513, 256, 6144, true), (0, 1, 2, 1));
    }

    #[test]
    fn short_chunks_narrow_projections_fill_the_sms() {
        let form = |m, n, k| bf16_gemm_form(m, n, k, true, false, &Constants::SM120A).0;
        // q_a's 256 columns of a 128-token chunk: 128-row tiles are 2 blocks, 12 with their most
        // slices (6); 64-row tiles (4) with K over 12 blocks (the most sm_90a's ptxas takes
        // without spills) make 48; split blocks of 32 rows and 32 weight rows with K over 6
        // make 192 (4 x 8 x 6), for the weights 4 times and x 8 times (12.6 MB each)
        assert_eq!(form(128, 256, 6144), Bf16Form { split: 1, mt: 2, nt: 4, ks: 6 });
        // the 2,048-column projection of that chunk: 64-row tiles (32) with K over 6 make 192
        assert_eq!(form(128, 2048, 2048), Bf16Form { split: 0, mt: 2, nt: 1, ks: 6 });
        // o_proj of that chunk (48 column tiles) keeps 128 rows, K over 4 (192 blocks)
        assert_eq!(form(128, 6144, 2048), Bf16Form { split: 0, mt: 4, nt: 1, ks: 4 });
    }

    #[test]
    fn bf16_rings_fit_the_shared_memory() {
        // 64-row BF16 stages (15 KiB): 3 buffers, two blocks per SM; 128-row (20 KiB): 4, one
        // block; F32 activations (25 KiB): 3.
        assert_eq!(ring(15_360, 101_376), 3);
        assert_eq!(ring(20_480, 101_376), 4);
        assert_eq!(ring(25_600, 101_376), 3);
        assert_eq!(ring(60_000, 101_376), 2);
    }

    #[test]
    fn nvfp4_stages_fit_two_blocks_per_sm() {
        assert_eq!(nvfp4_stages(120, 6144, false), (1, 4));
        assert_eq!(nvfp4_stages(120, 6144, true), (1, 3));
        assert_eq!(nvfp4_stages(120, 80, false), (1, 2));
        assert_eq!(nvfp4_stages(120, 16, true), (1, 2));
        // sm_90a's f16 activation planes: 14.5 KiB stages (3 buffers), 22.5 KiB with SiLU (2)
        assert_eq!(nvfp4_stages(90, 6144, false), (1, 3));
        assert_eq!(nvfp4_stages(90, 6144, true), (1, 2));
    }
}
