//! Routed experts: `Op::MoeExperts` as grouped NVFP4 gate/up (SiLU-mul) then down with the weighted combine.
//!
//! Two launches: `moe_gate_up` (grid: local experts x intermediate column tiles; a block whose
//! expert got no token exits after scanning the routing; at decode with fewer routed pairs than
//! experts, `COMPACT`: only as many blocks along x as pairs, block x taking the x-th expert that
//! got a token) writes the BF16 SwiGLU output of every
//! routed (token, choice) pair into `mid`; `moe_down` (grid: hidden column tiles) owns its
//! columns of `acc` for every token (in its shared memory where they fit: decode) and adds the
//! experts' weighted outputs in ascending expert order, as the CPU does, then rounds into `out`.
//! Where gate/up's column tiles are multiples of 16 (`MID_FP4`; prefill's tensor-core down on
//! sm_120a only), gate/up writes `mid` already quantised for down (codes and block scales, as
//! down would compute them), so down's column blocks do not each quantise every row again.
//! No float atomics: the result is deterministic.
//! Decode programs use CUDA-core dot products over exact NVFP4 block products (each selected
//! expert's weights read once); prefill programs use the tensor cores on groups of 32 tokens:
//! FP4 mma m16n8k64 with e4m3 block scales on sm_120a, f16 mma m16n8k16 over the decoded
//! (exact) values on sm_90a.

use super::{candidate_us, float_flag, loads_ahead, numel, of_grid, width, Cx, Instance, THREADS};
use crate::kernels::{MoeDownArgs, MoeDownParams, MoeGateUpArgs, MoeGateUpParams, Ptr};
use kiln_runtime::perf::{uniform_experts, Constants, Experts};
use kiln_runtime::plan::{DType, LaunchArg, LinearWeights, Op};

/// Columns per block of both launches (8 warps, 8 columns each: the tensor-core path gives every
/// warp one n8 tile); see [`gate_up_cols`] for decode's gate/up.
pub const MOE_COLS: u32 = 64;
const _: () = assert!(MOE_COLS == THREADS / 32 * 8);
/// Most tokens quantised and accumulated together (accumulators are registers).
pub const MOE_MAX_GROUP: usize = 32;
/// Shared memory left for each template's static arrays (scan counts, group slots, scalars).
const STATIC_SMEM: usize = 1024;

/// Lanes per output column: enough for the `k / 16` blocks of a row (at most a warp), so short
/// rows (the down projection of a TP slice) do not leave most of a warp idle.
pub fn lanes(k: usize) -> u32 {
    (k / 16).next_power_of_two().clamp(1, 32) as u32
}

/// Tokens per group of the tensor-core path (two m16 tiles), the least [`mma_group`] takes.
pub const MMA_GROUP: usize = 32;

/// Tokens per group of the tensor-core path: 64 (four m16 tiles, each expert's weights read
/// once per 64 tokens instead of 32) where gate/up's two parts of that many quantised rows of
/// `kc` values fit the shared memory beside the token list, else [`MMA_GROUP`]. The group is
/// the rows of the tiles, so any size gives the same bits.
pub fn mma_group(arch: u32, tokens: usize, kc: usize, smem_limit: u32) -> usize {
    let row = mma_row_bytes(arch, kc);
    [2 * MMA_GROUP, MMA_GROUP].into_iter().find(|g| list_bytes(tokens) + 2 * g * row + STATIC_SMEM <= smem_limit as usize).unwrap_or(MMA_GROUP)
}

/// Shared-memory bytes of one quantised row of a `kc` chunk on the tensor-core path: e2m1 codes
/// (padded by 16 B) and e4m3 scale bytes on sm_120a, f16 values on sm_90a.
pub fn mma_row_bytes(arch: u32, kc: usize) -> usize {
    if arch == 90 { kc * 2 } else { kc / 2 + 16 + kc / 16 }
}

/// Whether gate/up writes `mid` quantised for down (`MID_FP4`): its column tiles hold whole
/// 16-value blocks; down's tensor-core path copies the codes on sm_120a only (sm_90a's keeps
/// f16 values); gate/up's tensor-core path stages its tile's values (`cols` f32 a row) over its
/// two parts' rows of the `kc` chunk once the K loop is done, so they must fit there.
pub fn mid_fp4(arch: u32, mma: bool, mma_dn: bool, cols: u32, kc: usize) -> bool {
    cols % 16 == 0 && (!mma_dn || arch == 120) && (!mma || cols as usize * 4 <= 2 * mma_row_bytes(arch, kc))
}

/// K chunk of the tensor-core path: the largest multiple of 64 dividing `k` up to 1024 on
/// sm_120a (e2m1 codes, 0.6 B a value) or 256 on sm_90a (f16 values, 2 B), so two parts of 32
/// quantised rows stay far inside the shared memory (at most 37 KiB or 32 KiB).
pub fn mma_chunk(arch: u32, k: usize) -> usize {
    let most = if arch == 90 { 4 } else { 16 };
    (1..=most).rev().map(|c| c * 64).find(|&c| k % c == 0).unwrap_or(64)
}

/// Bytes of the u16 token list at the front of both kernels' dynamic shared memory.
pub fn list_bytes(tokens: usize) -> usize {
    (tokens * 2).div_ceil(16) * 16
}

/// Programs up to this many tokens (decode batches) keep each block within half the shared
/// memory, so two blocks share an SM and more weight loads are in flight (decode is bound by
/// memory bandwidth, and an expert rarely gets more than a few of these tokens).
pub const MOE_DECODE_TOKENS: usize = 64;

/// Shared memory one MoE block may take: half the SM's at decode (two blocks an SM), else all.
fn smem_budget(tokens: usize, smem_limit: u32) -> usize {
    if tokens <= MOE_DECODE_TOKENS { smem_limit as usize / 2 } else { smem_limit as usize }
}

/// Largest token group whose quantised rows (`bytes_per_token` each) fit beside the token list.
pub fn group_size(tokens: usize, bytes_per_token: usize, smem_limit: u32) -> Result<usize, String> {
    let budget = smem_budget(tokens, smem_limit);
    let fit = |budget: usize| budget.saturating_sub(STATIC_SMEM + list_bytes(tokens)) / bytes_per_token.max(1);
    // Below the budget, one token at a time if a row fits at all.
    let g = match fit(budget) {
        0 => fit(smem_limit as usize).min(1),
        g => g,
    };
    let g = g.min(MOE_MAX_GROUP).min(tokens.max(1));
    if g == 0 {
        return Err(format!("{tokens} tokens leave no shared memory for one quantised row of {bytes_per_token} B"));
    }
    Ok(g)
}

/// Intermediate columns per block of the gate/up launch, by [`candidate_us`] under `routing`:
/// each working block (an expert that got tokens, times a column tile) reads its columns' gate
/// and up rows and its expert's activation rows; every column tile's blocks read `scan` bytes
/// of routing between them. The CUDA-core (decode) path picks from 64, 32, 16 and 8 columns of
/// 8 warps, its weights read once: at GLM-5 tp8 batch 1 (8 experts x 256 columns) 64-wide
/// blocks are 32 working blocks; 8-wide, 256. The tensor-core (prefill) path takes an n8 tile a
/// warp, 64 columns of 8 warps or 128 of 16 ([`gate_up_threads`]), its weights read once per
/// group of `mma` tokens whatever the width: wider tiles read the activations fewer times.
pub fn gate_up_cols(routing: &Experts, inter: usize, k: usize, x_bytes: usize, mma: Option<usize>, scan: f64, consts: &Constants) -> u32 {
    let hit = routing.sum(|n| if n > 0.0 { 1.0 } else { 0.0 });
    let pairs = routing.sum(|n| n);
    let weights = match mma {
        Some(g) => routing.sum(|n| (n / g as f64).ceil()) * 2.0 * inter as f64 * k as f64 * 3.0 / 4.0,
        None => hit * 2.0 * inter as f64 * k as f64 * 9.0 / 16.0,
    };
    let cost = |cols: u32| {
        // every column tile of an expert reads that expert's rows
        let tiles = inter.div_ceil(cols as usize) as f64;
        candidate_us(weights, tiles * (pairs * (k * x_bytes) as f64 + scan), 0.0, hit * tiles, consts)
    };
    let widths: &[u32] = if mma.is_some() { &[MOE_COLS, 2 * MOE_COLS] } else { &[MOE_COLS, 32, 16, 8] };
    widths.iter().copied().fold(MOE_COLS, |best, c| if cost(c) < cost(best) { c } else { best })
}

/// Threads of a gate/up block of `cols` columns: 8 warps, or on the tensor cores a warp per n8
/// tile of gate and up.
pub fn gate_up_threads(cols: u32, mma: bool) -> u32 {
    if mma { cols / 8 * 32 } else { THREADS }
}

/// Hidden columns per block of the down launch, by [`candidate_us`] under `routing`: every
/// block reads the whole `mid` (one row per routed pair: `inter` BF16 values, or with `mid_fp4`
/// their codes and block scales, 9/16 B a value) and `scan` bytes of routing (its scans of the
/// routing in global memory where they are not staged), and its columns of the routed experts'
/// weights. The CUDA-core (decode) path picks 64 or 32 columns a block of 8 warps: at GLM-5 tp8
/// batch 64, 64-wide blocks are 96 (half the GPU); 32-wide, 192 for 25 MB (BF16) or 7 MB (FP4)
/// more of `mid` re-reads. The tensor-core (prefill) path takes an n8 tile a warp: 64 columns
/// with 8 warps or 32 with 4 ([`down_threads`]); its weights are read once per group of `mma`
/// tokens and its f32 sums read, added and written per routed pair, whatever the width.
pub fn down_cols(routing: &Experts, hidden: usize, inter: usize, mid_fp4: bool, mma: Option<usize>, scan: f64, consts: &Constants) -> u32 {
    let used = routing.sum(|n| if n > 0.0 { 1.0 } else { 0.0 });
    let pairs = routing.sum(|n| n);
    let (weights, acc) = match mma {
        Some(g) => (routing.sum(|n| (n / g as f64).ceil()) * hidden as f64 * inter as f64 * 3.0 / 4.0, 2.0 * pairs * hidden as f64 * 4.0),
        None => (used * hidden as f64 * inter as f64 * 9.0 / 16.0, 0.0),
    };
    let mid = pairs * inter as f64 * if mid_fp4 { 9.0 / 16.0 } else { 2.0 };
    let cost = |cols: u32| {
        let blocks = hidden.div_ceil(cols as usize) as f64;
        candidate_us(weights, blocks * (mid + scan) + acc, 0.0, blocks, consts)
    };
    [MOE_COLS, 32].into_iter().fold(MOE_COLS, |best, c| if cost(c) < cost(best) { c } else { best })
}

/// Threads of a down block of `cols` columns: 8 warps, or on the tensor cores a warp per n8 tile.
pub fn down_threads(cols: u32, mma: bool) -> u32 {
    if mma { cols / 8 * 32 } else { THREADS }
}

/// Tokens per group of a decode (CUDA-core) launch, at most `most` (what fits the shared
/// memory). Both kernels compute every row of a group (register accumulators) and read an
/// expert's weights once per group: large groups waste FLOPs on experts with few tokens (at
/// batch 64 an expert gets ~2 tokens), small ones re-read the weights of busy experts. Each
/// candidate (powers of two up to `most`, and `most`) is costed by [`candidate_us`] under
/// uniform routing (groups x `weight_bytes`, groups x G x `row_flops`; the blocks do not depend
/// on G); ties keep the larger group.
pub fn decode_group(most: usize, routing: &Experts, weight_bytes: f64, row_flops: f64, consts: &Constants) -> usize {
    let cost = |g: usize| {
        let groups = routing.sum(|n| (n / g as f64).ceil());
        candidate_us(groups * weight_bytes, 0.0, groups * g as f64 * row_flops, consts.sms as f64, consts)
    };
    let candidates = (0..6).map(|i| 1usize << i).filter(|&g| g < most).chain([most.max(1)]);
    candidates.fold(most.max(1), |best, g| if cost(g) < cost(best) { g } else { best })
}

pub(super) fn instances(cx: &Cx, op: &Op) -> Result<Vec<Instance>, String> {
    let Op::MoeExperts { input, ids, weights, ref gate_up, ref down, experts_local, expert_parallel, intermediate, hidden, out, mid, acc, shared } = *op
    else {
        return Err("not a MoE step".into());
    };
    let (
        &LinearWeights::Nvfp4 { weight: gw, scale: gs, scale_2: g2, input_scale: gi },
        &LinearWeights::Nvfp4 { weight: dw, scale: ds, scale_2: d2, input_scale: di },
    ) = (gate_up, down)
    else {
        return Err("BF16 experts have no template (MoeNvfp4 takes NVFP4 stacks)".into());
    };
    let p = cx.program;
    let tokens = numel(p, input) / hidden.max(1);
    let top_k = width(p, ids);
    let (e, inter, h) = (experts_local, intermediate, hidden);
    if tokens == 0 || top_k == 0 || e == 0 || inter == 0 || h % 16 != 0 || inter % 16 != 0 {
        return Err(format!("{tokens} tokens, top-{top_k}, {e} experts, hidden {h}, intermediate {inter}: outside the template (multiples of 16)"));
    }
    if tokens > u16::MAX as usize {
        return Err(format!("{tokens} tokens overflow the u16 token list"));
    }
    let seq = p.inputs.token_seq;
    if p.buffer(ids).dtype != DType::I32 || p.buffer(seq).dtype != DType::I32 {
        return Err("the MoE kernels need I32 expert ids and token_seq".into());
    }
    if p.buffer(mid).dtype != DType::BF16 || numel(p, mid) < tokens * top_k * inter {
        return Err(format!("mid must be BF16 [{}, {inter}]", tokens * top_k));
    }
    if p.buffer(acc).dtype != DType::F32 || numel(p, acc) < tokens * h {
        return Err(format!("acc must be F32 [{tokens}, {h}]"));
    }
    let first_expert = if expert_parallel { u32::try_from(e).map_err(|_| "expert count overflows u32")? } else { 0 };
    if LaunchArg::per_rank(first_expert, cx.plan.ranks().saturating_sub(1)).is_none() {
        return Err("the first expert id of the last rank overflows a u32".into());
    }
    let u = |v: usize| u32::try_from(v).map_err(|_| format!("{v} overflows u32"));

    // Gate/up. Prefill programs (many tokens per expert) use the FP4 tensor cores: groups of 32
    // tokens, K in chunks of KC, both parts' codes (rows padded by 16 B) and scale bytes in shared
    // memory. Decode: G rows of K values per part as codes (K/2 B) and f32 scales (K/4 B).
    let mma = tokens > MOE_DECODE_TOKENS && h % 64 == 0;
    let kc = mma_chunk(cx.arch, h);
    // Decode shapes are costed under the uniform routing `kiln inspect --perf` assumes.
    let routing = uniform_experts(cx.plan, tokens);
    let x_bf16 = float_flag(p.buffer(input).dtype, "the input")?;
    // every (expert, column tile) block scans the routing (COMPACT decode: fewer blocks, priced alike)
    let gu_scan = (e * tokens * (top_k + 1) * 4) as f64;
    let g_mma = mma_group(cx.arch, tokens, kc, cx.smem_limit);
    let gu_cols = gate_up_cols(&routing, inter, h, if x_bf16 == 1 { 2 } else { 4 }, mma.then_some(g_mma), gu_scan, &cx.consts);
    let gu_threads = gate_up_threads(gu_cols, mma);
    // Gate/up quantises mid for down where it can ([`mid_fp4`]), so down's blocks copy codes
    // instead of each quantising every row again, and read 9/16 B a value instead of 2 (GLM-5
    // tp8 batch 64: 192 blocks read 74 KB of mid instead of 262 KB; a 2,048-token chunk 4.7 MB
    // instead of 8.4 MB).
    let mma_dn = tokens > MOE_DECODE_TOKENS && inter % 64 == 0;
    let mid_fp4 = mid_fp4(cx.arch, mma, mma_dn, gu_cols, kc);
    let g1 = if mma {
        g_mma
    } else {
        // a token's quantised row, and with MID_FP4 its staged values of the block's columns
        let row = h * 3 / 2 + if mid_fp4 { gu_cols as usize * 4 } else { 0 };
        let most = group_size(tokens, row, cx.smem_limit)?;
        decode_group(most, &routing, 2.0 * inter as f64 * h as f64 * 9.0 / 16.0, 2.0 * inter as f64 * 2.0 * h as f64, &cx.consts)
    };
    let gu = MoeGateUpParams {
        arch: cx.arch,
        tokens: u(tokens)?,
        topk: u(top_k)?,
        experts: u(e)?,
        inter: u(inter)?,
        k: u(h)?,
        g: g1 as u32,
        cols: gu_cols,
        lanes: lanes(h),
        unroll: if mma { 1 } else { loads_ahead(g1) },
        mma: mma as u32,
        kc: kc as u32,
        threads: gu_threads,
        x_bf16,
        compact: 0,
        mid_fp4: 0,
    };
    // decode with fewer routed pairs than local experts: only as many gate/up blocks as pairs
    // along x, each finding its expert (GLM-5 tp8 batch 1: 8 x 32 blocks launched, not 256 x 32)
    let slots = tokens * top_k;
    let compact = !mma && slots < e && gu.dynamic_smem()? as usize >= 4 * (e + 1);
    let gu = MoeGateUpParams { compact: compact as u32, mid_fp4: mid_fp4 as u32, ..gu };
    let gu_args = MoeGateUpArgs {
        x: Ptr::Buffer(input),
        ids: Ptr::Buffer(ids),
        token_seq: Ptr::Buffer(seq),
        w: Ptr::Weight(gw),
        sf: Ptr::Weight(gs),
        scale_2: Ptr::Weight(g2),
        input_scale: Ptr::Weight(gi),
        mid: Ptr::Buffer(mid),
        down_input_scale: Ptr::Weight(di),
        first_expert,
    };
    // Down: G rows of K = intermediate values (tensor cores for prefill, as gate/up).
    let kc_dn = mma_chunk(cx.arch, inter);
    // (priced as gate/up's two parts of rows: down stages one, so it fits wherever those do)
    let g2n = if mma_dn {
        mma_group(cx.arch, tokens, kc_dn, cx.smem_limit)
    } else {
        let most = group_size(tokens, inter * 3 / 4, cx.smem_limit)?;
        decode_group(most, &routing, h as f64 * inter as f64 * 9.0 / 16.0, h as f64 * inter as f64 * 2.0, &cx.consts)
    };
    let dn = MoeDownParams {
        arch: cx.arch,
        tokens: u(tokens)?,
        topk: u(top_k)?,
        experts: u(e)?,
        inter: u(inter)?,
        hidden: u(h)?,
        g: g2n as u32,
        cols: MOE_COLS,
        lanes: lanes(inter),
        unroll: if mma_dn { 1 } else { loads_ahead(g2n) },
        mma: mma_dn as u32,
        kc: kc_dn as u32,
        threads: THREADS,
        w_bf16: float_flag(p.buffer(weights).dtype, "the routing weights")?,
        out_bf16: float_flag(p.buffer(out).dtype, "the output")?,
        add: u32::from(shared.is_some()),
        add_bf16: shared.map_or(Ok(0), |s| float_flag(p.buffer(s).dtype, "the shared experts' output"))?,
        stage: 1,
        acc_smem: 0,
        mid_fp4: mid_fp4 as u32,
    };
    // every used expert's scan reads the routing from shared memory where it fits (9 bits a
    // pair: up to 8,192 tokens of GLM-5 beside groups of 64; its size does not depend on the
    // columns) and byte ids and a token's bits in a u32 can hold it, else from global memory:
    // the bytes each block scans (once to mark the used experts, once per used expert
    // unstaged) price the columns
    let stageable = e <= 256 && top_k <= 32;
    let staged = stageable && dn.dynamic_smem()? as usize + STATIC_SMEM <= cx.smem_limit as usize;
    let used = routing.sum(|n| if n > 0.0 { 1.0 } else { 0.0 });
    let scan = (tokens * (top_k + 1) * 4) as f64 * if staged { 1.0 } else { 1.0 + used };
    let dn_cols = down_cols(&routing, h, inter, mid_fp4, mma_dn.then_some(g2n), scan, &cx.consts);
    let dn = MoeDownParams { cols: dn_cols, threads: down_threads(dn_cols, mma_dn), stage: staged as u32, ..dn };
    // and the block's columns of acc live there too where they fit within the decode budget
    // (two blocks an SM): the sum over experts then never leaves the SM (GLM-5 tp8 batch 64:
    // 8 KiB a block instead of 25 MB of read-modify-writes per layer)
    let with_acc = MoeDownParams { acc_smem: 1, ..dn };
    let budget = smem_budget(tokens, cx.smem_limit);
    let dn = if with_acc.dynamic_smem()? as usize + STATIC_SMEM <= budget { with_acc } else { dn };
    let dn_args = MoeDownArgs {
        mid: Ptr::Buffer(mid),
        ids: Ptr::Buffer(ids),
        token_seq: Ptr::Buffer(seq),
        weights: Ptr::Buffer(weights),
        w: Ptr::Weight(dw),
        sf: Ptr::Weight(ds),
        scale_2: Ptr::Weight(d2),
        input_scale: Ptr::Weight(di),
        acc: Ptr::Buffer(acc),
        out: Ptr::Buffer(out),
        shared: Ptr::Buffer(shared.unwrap_or(out)),
        first_expert,
    };
    for smem in [gu.dynamic_smem()?, dn.dynamic_smem()?] {
        super::fits(smem as usize + STATIC_SMEM, cx.smem_limit, "a MoE kernel")?;
    }
    Ok(vec![
        of_grid(&gu, [u(if compact { slots } else { e })?, u(inter)?.div_ceil(gu_cols), 1], gu_threads, gu_args.launch_args()),
        of_grid(&dn, [u(h)?.div_ceil(dn_cols), 1, 1], dn.threads, dn_args.launch_args()),
    ])
}

#[cfg(test)]
mod tests {
    use super::{decode_group, down_cols, down_threads, gate_up_cols, gate_up_threads, mid_fp4, mma_group};
    use crate::passes::lower::SMEM_LIMIT;
    use kiln_runtime::perf::{Constants, Experts};

    #[test]
    fn decode_down_halves_its_blocks_when_they_leave_sms_idle() {
        // GLM-5 tp8 down (hidden 6144, a 256-wide slice), 188 SMs: batch 64 routes ~512 pairs
        // to ~225 experts (226 MB of weights); 96 blocks of 64 columns draw half the bandwidth,
        // 192 of 32 all of it for 25 MB more of mid.
        let (batch64, c) = (Experts::uniform(64, 8, 256, 256), Constants::SM120A);
        assert_eq!(down_cols(&batch64, 6144, 256, false, None, 0.0, &c), 32);
        // FP4 mid (7 MB more) only makes the narrower blocks cheaper
        assert_eq!(down_cols(&batch64, 6144, 256, true, None, 0.0, &c), 32);
        // A GPU that 96 blocks fill keeps them.
        assert_eq!(down_cols(&batch64, 6144, 256, false, None, 0.0, &Constants { sms: 96, ..c }), 64);
        // Prefill on the tensor cores: a 2,048-token chunk (256 experts, ~64 pairs each: 632
        // groups of 32) reads 745 MB of weights and 805 MB of f32 sums whatever the width, and
        // 8.4 MB of mid per block: 96 blocks move 2.36 GB at 96/188 of the bandwidth (4.63
        // GB-equivalents), 192 of 4 warps 3.18 GB at all of it.
        let chunk = Experts::uniform(2048, 8, 256, 256);
        assert_eq!(down_cols(&chunk, 6144, 256, false, Some(32), 2048.0 * 9.0 * 4.0, &c), 32);
        assert_eq!((down_threads(32, true), down_threads(64, true), down_threads(32, false)), (128, 256, 256));
        // An 8,192-token chunk's routing, staged (9 bits a pair: 73.7 KB), is read once a block
        // beside 33.6 MB of mid; unstaged, every block would scan it once per used expert, 75.8
        // MB a block. The narrower blocks win either way.
        let long = Experts::uniform(8192, 8, 256, 256);
        assert_eq!(down_cols(&long, 6144, 256, false, Some(64), 8192.0 * 9.0 * 4.0, &c), 32);
        assert_eq!(down_cols(&long, 6144, 256, false, Some(32), 8192.0 * 9.0 * 4.0 * 257.0, &c), 32);
        // Without the scans' and the sums' bytes the wider blocks' idle SMs cost less only on a GPU they fill.
        assert_eq!(down_cols(&chunk, 6144, 256, false, Some(32), 0.0, &Constants { sms: 96, ..c }), 64);
    }

    #[test]
    fn decode_groups_stop_growing_where_the_flops_outrun_the_weight_reads() {
        // GLM-5 tp8 down (a 6144 x 256 slice per expert): 0.58 µs to stream an expert's rows,
        // 0.052 µs of FP32 per token row, so up to 11 rows a group is bandwidth-bound. Batch 64
        // (~2 tokens per expert): 8 rows is one group for nearly every expert, 16 or 32 only add
        // FLOPs. Batch 1: one token per selected expert, so one row. Batch 4: all four rows
        // in one group, so an expert hit twice streams its weights once (rows are cheap here).
        let (w, f) = (6144.0 * 256.0 * 9.0 / 16.0, 6144.0 * 256.0 * 2.0);
        let c = Constants::SM120A;
        assert_eq!(decode_group(32, &Experts::uniform(64, 8, 256, 256), w, f, &c), 8);
        assert_eq!(decode_group(1, &Experts::uniform(1, 8, 256, 256), w, f, &c), 1);
        assert_eq!(decode_group(4, &Experts::uniform(4, 8, 256, 256), w, f, &c), 4);
    }

    #[test]
    fn decode_gate_up_narrows_its_blocks_until_the_gpu_is_full() {
        // GLM-5 tp8, 188 SMs, uniform routing. Batch 1: 8 experts x 256 columns; 64-wide blocks are 32 working
        // blocks (14.5 MB at 32/188), 8-wide 256 (17.3 MB at full bandwidth).
        let (routed, c) = (|tokens| Experts::uniform(tokens, 8, 256, 256), Constants::SM120A);
        let scan = |tokens: usize| (256 * tokens * 9 * 4) as f64;
        assert_eq!(gate_up_cols(&routed(1), 256, 6144, 2, None, scan(1), &c), 8);
        // Batch 64: 256 experts with about 2 tokens each already fill the GPU at 64 columns;
        // narrower blocks would only re-read the activations.
        assert_eq!(gate_up_cols(&routed(64), 256, 6144, 2, None, scan(64), &c), 64);
        // Prefill on the tensor cores: a 2,048-token chunk reads 1.49 GB of gate and up rows
        // (632 groups of 32 tokens) whatever the width, its 16,384 routed rows of x (12 KB each)
        // once per column tile, and the routing (18.9 MB a tile): 64-wide tiles 2.37 GB, 128-wide
        // (16 warps) 1.93 GB, both over 256 experts' blocks and more.
        assert_eq!(gate_up_cols(&routed(2048), 256, 6144, 2, Some(32), scan(2048), &c), 128);
        assert_eq!((gate_up_threads(128, true), gate_up_threads(64, true), gate_up_threads(8, false)), (512, 256, 256));
    }

    #[test]
    fn mid_goes_to_down_as_fp4_codes_where_both_kernels_can_pass_them() {
        // GLM-5 tp8 prefill on sm_120a: 128-column gate/up tiles stage 512 B a row over the parts'
        // two rows of a 1,024-value chunk (592 B each)
        assert!(mid_fp4(120, true, true, 128, 1024));
        // sm_90a's tensor-core down keeps f16 values; its CUDA-core down copies codes
        assert!(!mid_fp4(90, true, true, 128, 256) && mid_fp4(90, true, false, 64, 256));
        // decode: 8-column tiles hold no whole 16-value block; 64-column ones do
        assert!(!mid_fp4(120, false, false, 8, 1024) && mid_fp4(120, false, false, 64, 1024));
        // a 64-value chunk's rows (52 B) cannot hold a 64-column tile's 256 B
        assert!(!mid_fp4(120, true, true, 64, 64));
    }

    #[test]
    fn prefill_groups_take_64_tokens_where_both_parts_fit() {
        // sm_120a, K = 6144 in chunks of 1024: a quantised row of a chunk is 512 B of codes, 16
        // of padding and 64 of scales, 592; two parts of 64 rows are 75,776 B, beside the token
        // list (2 B a token, in 16-byte steps) and the 1 KiB kept for static shared memory,
        // within 99 KiB up to 12,288 tokens. sm_90a (the same limit) keeps f16 values (2 B each)
        // of chunks of 256: 65,536 B.
        assert_eq!(mma_group(120, 8192, 1024, SMEM_LIMIT), 64);
        assert_eq!(mma_group(120, 12_288, 1024, SMEM_LIMIT), 64);
        assert_eq!(mma_group(120, 12_296, 1024, SMEM_LIMIT), 32);
        assert_eq!(mma_group(90, 8192, 256, SMEM_LIMIT), 64);
    }
}
