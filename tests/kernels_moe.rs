//! The routed-expert kernels (`moe_gate_up` then `moe_down`, family MoeNvfp4) against the CPU's
//! `Op::MoeExperts`: tiny-model experts sliced for TP 1 / 2 (intermediate split) and EP (experts
//! split, rank 0 and 1), 1 / 3 / 17 tokens with padding, experts without tokens, experts shared
//! by several tokens, token groups smaller than an expert's tokens, ragged sizes, and the
//! tensor-core (mma m16n8k64 NVFP4) prefill path of both kernels; decode reads each selected
//! expert's weights about once (global bytes read / compulsory <= 1.10); the GLM-5 tp8 instances
//! (TP and EP, decode and prefill) assemble for sm_120a and sm_90a without spills and inside the
//! limits.
//!
//! Every case runs for both targets. The sm_90a forms round activations to e2m1 with float ops
//! and decode codes with integer ops into values scaled by powers of two, so their CUDA-core
//! (decode) path computes exactly the sm_120a numbers (checked bit for bit); their tensor-core
//! path multiplies the same exact values in f16 mma m16n8k16 instead of the block-scaled FP4 mma,
//! which changes only the summation order, so the same BF16 tolerance (one rounding) applies.

mod common;

use kiln_compiler::kernels::{MoeDownParams, MoeGateUpParams};
use kiln_compiler::passes::lower::{down_threads, gate_up_cols, gate_up_threads, loads_ahead, mid_fp4, mma_group, SMEM_LIMIT, THREADS};
use kiln_runtime::cpu::quant::quantize_block_codes;
use kiln_runtime::cpu::reference::{self, Nvfp4Stack};
use kiln_runtime::emu::{launch, GlobalMemory, KernelArg, Module};
use kiln_runtime::perf::{Constants, Experts};
use kiln_runtime::numerics::{bf16_to_f32, f32_to_bf16, quantize_nvfp4, round_bf16};
use kiln_runtime::plan::DType;
use kiln_runtime::rng::Rng;
use kiln_runtime::verify::{compare, Values};

/// Model sizes of one test: hidden, full intermediate per expert, experts, experts per token.
#[derive(Clone, Copy, Debug)]
struct Shape {
    hidden: usize,
    inter: usize,
    experts: usize,
    top_k: usize,
}

/// The tiny synthetic model's routed experts.
const TINY: Shape = Shape { hidden: 256, inter: 128, experts: 16, top_k: 4 };
/// Sizes that are not multiples of the kernels' tiles.
const RAGGED: Shape = Shape { hidden: 272, inter: 80, experts: 6, top_k: 3 };
/// Columns per block (compiler/src/passes/lower/moe.rs: MOE_COLS).
const COLS: u32 = 64;

/// Lanes per column (compiler/src/passes/lower/moe.rs: lanes).
fn lanes(k: usize) -> u32 {
    (k / 16).next_power_of_two().clamp(1, 32) as u32
}

/// K chunk of the tensor-core path (compiler/src/passes/lower/moe.rs: mma_chunk): up to 1024 on
/// sm_120a, 256 on sm_90a.
fn mma_chunk(arch: u32, k: usize) -> usize {
    let most = if arch == 90 { 4 } else { 16 };
    (1..=most).rev().map(|c| c * 64).find(|&c| k % c == 0).unwrap_or(64)
}

/// The largest token group the lowering allows (compiler/src/passes/lower/moe.rs: group_size;
/// decode programs of <= 64 tokens keep to half the shared memory; `decode_group` may pick a
/// smaller one, which only shortens the kernels' register loops).
fn group(tokens: usize, bytes_per_token: usize) -> usize {
    let list = (tokens * 2).div_ceil(16) * 16;
    let budget = if tokens <= 64 { SMEM_LIMIT as usize / 2 } else { SMEM_LIMIT as usize };
    ((budget - 1024 - list) / bytes_per_token).max(1).min(32).min(tokens)
}

/// One NVFP4 matrix per expert, stacked: packed `[E, rows, k/2]`, scales `[E, rows, k/16]`.
struct Stack {
    rows: usize,
    k: usize,
    packed: Vec<u8>,
    scales: Vec<u8>,
    /// `[E, parts]`
    scale_2: Vec<f32>,
    input_scale: Vec<f32>,
    parts: usize,
}

impl Stack {
    fn view(&self) -> Nvfp4Stack<'_> {
        Nvfp4Stack { packed: &self.packed, scales: &self.scales, scale_2: &self.scale_2, input_scale: &self.input_scale }
    }

    /// Rows `r0..r1` and columns `c0..c1` (multiples of 16) of experts `e0..e1`.
    fn slice(&self, experts: std::ops::Range<usize>, rows: &[std::ops::Range<usize>], cols: std::ops::Range<usize>) -> Stack {
        let (mut packed, mut scales) = (Vec::new(), Vec::new());
        for e in experts.clone() {
            for r in rows.iter().flat_map(|r| r.clone()) {
                let row = e * self.rows + r;
                packed.extend_from_slice(&self.packed[row * self.k / 2 + cols.start / 2..row * self.k / 2 + cols.end / 2]);
                scales.extend_from_slice(&self.scales[row * self.k / 16 + cols.start / 16..row * self.k / 16 + cols.end / 16]);
            }
        }
        let np = self.parts;
        Stack {
            rows: rows.iter().map(|r| r.len()).sum(),
            k: cols.len(),
            packed,
            scales,
            scale_2: self.scale_2[experts.start * np..experts.end * np].to_vec(),
            input_scale: self.input_scale[experts.start * np..experts.end * np].to_vec(),
            parts: np,
        }
    }
}

/// `sh.experts` experts, each `parts` matrices `[part_rows, k]` each; input scales from the activation
/// range `amax`, different per part when `split`.
fn experts(sh: Shape, rng: &mut Rng, part_rows: usize, parts: usize, k: usize, amax: f32, split: bool) -> Stack {
    let (mut packed, mut scales, mut scale_2, mut input_scale) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for e in 0..sh.experts {
        for p in 0..parts {
            let w: Vec<f32> = (0..part_rows * k).map(|_| (rng.normal() * 0.05) as f32).collect();
            let (pk, sc, s2) = quantize_nvfp4(&w, part_rows, k);
            packed.extend(pk);
            scales.extend(sc);
            scale_2.push(s2);
            let vary = if split { 1.0 + 0.3 * p as f32 } else { 1.0 };
            input_scale.push(amax / (6.0 * 448.0) * (1.0 + 0.05 * e as f32) * vary);
        }
    }
    Stack { rows: part_rows * parts, k, packed, scales, scale_2, input_scale, parts }
}

struct Model {
    gate_up: Stack,
    down: Stack,
}

fn model(sh: Shape, seed: u64, split_scales: bool) -> Model {
    let mut rng = Rng::new(seed);
    Model { gate_up: experts(sh, &mut rng, sh.inter, 2, sh.hidden, 4.0, split_scales), down: experts(sh, &mut rng, sh.hidden, 1, sh.inter, 0.5, false) }
}

#[derive(Clone, Copy, Debug)]
enum Split {
    /// Intermediate split over `tp` ranks.
    Tp { tp: usize, rank: usize },
    /// Experts split over `ranks`.
    Ep { ranks: usize, rank: usize },
}

/// This rank's stacks, experts, first expert and intermediate size.
fn rank_weights(sh: Shape, m: &Model, split: Split) -> (Stack, Stack, usize, usize, usize) {
    match split {
        Split::Tp { tp, rank } => {
            let i = sh.inter / tp;
            let (a, b) = (rank * i, (rank + 1) * i);
            let gu = m.gate_up.slice(0..sh.experts, &[a..b, sh.inter + a..sh.inter + b], 0..sh.hidden);
            let dn = m.down.slice(0..sh.experts, &[0..sh.hidden], a..b);
            (gu, dn, sh.experts, 0, i)
        }
        Split::Ep { ranks, rank } => {
            let el = sh.experts / ranks;
            let es = rank * el..(rank + 1) * el;
            (m.gate_up.slice(es.clone(), &[0..2 * sh.inter], 0..sh.hidden), m.down.slice(es, &[0..sh.hidden], 0..sh.inter), el, rank * el, sh.inter)
        }
    }
}

struct Routing {
    token_seq: Vec<i32>,
    ids: Vec<i32>,
    weights: Vec<f32>,
}

/// Distinct random experts per token; tokens 0..share all pick expert 5 (one expert, several
/// tokens; of 256 experts, 255: the id a padding token's unwritten bytes in down's staged
/// routing read as, 0xFF); padding tokens keep (valid) ids that must be ignored.
fn routing(sh: Shape, rng: &mut Rng, tokens: usize, padding: &[usize], share: usize) -> Routing {
    let mut ids = Vec::new();
    let shared = if sh.experts == 256 { 255 } else { 5 };
    for t in 0..tokens {
        let mut chosen: Vec<i32> = if t < share { vec![shared] } else { vec![] };
        while chosen.len() < sh.top_k {
            let e = (rng.next_u64() % sh.experts as u64) as i32;
            if !chosen.contains(&e) {
                chosen.push(e);
            }
        }
        // the shared expert is not always choice 0
        chosen.rotate_left(t % sh.top_k);
        ids.extend(chosen);
    }
    let weights = (0..tokens * sh.top_k).map(|_| (0.1 + rng.uniform()) as f32).collect();
    let token_seq = (0..tokens).map(|t| if padding.contains(&t) { -1 } else { (t % 3) as i32 }).collect();
    Routing { token_seq, ids, weights }
}

fn bf16_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|&f| f32_to_bf16(f).to_le_bytes()).collect()
}

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|f| f.to_le_bytes()).collect()
}

fn i32_bytes(v: &[i32]) -> Vec<u8> {
    v.iter().flat_map(|f| f.to_le_bytes()).collect()
}

struct Case {
    shape: Shape,
    tokens: usize,
    padding: Vec<usize>,
    share: usize,
    split: Split,
    /// Token group of both kernels (None: the lowering's choice).
    group: Option<usize>,
    /// Lanes per column of both kernels (None: the lowering's choice).
    lanes: Option<u32>,
    /// The tensor-core gate/up path (prefill; groups of 32 tokens).
    mma: bool,
    x_bf16: bool,
    w_bf16: bool,
    split_scales: bool,
}

struct Run {
    read: u64,
    compulsory: u64,
    out: Vec<f32>,
}

/// Runs both kernels for `arch` (120 or 90) and checks them against the CPU.
fn run(c: &Case, arch: u32, seed: u64) -> Run {
    let sh = c.shape;
    let m = model(sh, seed, c.split_scales);
    let mut rng = Rng::new(seed + 1000);
    let x: Vec<f32> = (0..c.tokens * sh.hidden).map(|_| (rng.normal() * 1.0) as f32).map(|v| if c.x_bf16 { round_bf16(v) } else { v }).collect();
    let mut r = routing(sh, &mut rng, c.tokens, &c.padding, c.share);
    if c.w_bf16 {
        r.weights.iter_mut().for_each(|w| *w = round_bf16(*w));
    }
    let (gu, dn, el, first, inter) = rank_weights(sh, &m, c.split);

    let mut want = vec![0f32; c.tokens * sh.hidden];
    reference::moe_experts(&x, &r.token_seq, &r.ids, &r.weights, sh.top_k, &gu.view(), &dn.view(), el, first, inter, sh.hidden, true, &mut want);

    let g1 = if c.mma { 32 } else { c.group.unwrap_or_else(|| group(c.tokens, sh.hidden * 3 / 2)) };
    // the down kernel takes the tensor cores when its K (the rank's intermediate) allows
    let mma_dn = c.mma && inter % 64 == 0;
    let g2 = if mma_dn { 32 } else { c.group.unwrap_or_else(|| group(c.tokens, inter * 3 / 4)) };
    let pg = MoeGateUpParams {
        arch,
        tokens: c.tokens as u32,
        topk: sh.top_k as u32,
        experts: el as u32,
        inter: inter as u32,
        k: sh.hidden as u32,
        g: g1 as u32,
        cols: COLS,
        lanes: c.lanes.unwrap_or_else(|| lanes(sh.hidden)),
        unroll: 4,
        mma: c.mma as u32,
        kc: mma_chunk(arch, sh.hidden) as u32,
        threads: THREADS,
        x_bf16: c.x_bf16 as u32,
        compact: 0,
        mid_fp4: 0,
    };
    let pd = MoeDownParams {
        arch,
        tokens: c.tokens as u32,
        topk: sh.top_k as u32,
        experts: el as u32,
        inter: inter as u32,
        hidden: sh.hidden as u32,
        g: g2 as u32,
        cols: COLS,
        lanes: c.lanes.unwrap_or_else(|| lanes(inter)),
        unroll: 4,
        mma: mma_dn as u32,
        kc: mma_chunk(arch, inter) as u32,
        threads: THREADS,
        w_bf16: c.w_bf16 as u32,
        out_bf16: 1,
        add: 0,
        add_bf16: 0,
        stage: 0,
        acc_smem: 0,
        mid_fp4: 0,
    };
    let mg = Module::parse(&pg.render().unwrap(), "moe_gate_up.ptx").unwrap();
    let md = Module::parse(&pd.render().unwrap(), "moe_down.ptx").unwrap();
    let mut g = GlobalMemory::new();
    let bx = g.alloc_bytes("x", &if c.x_bf16 { bf16_bytes(&x) } else { f32_bytes(&x) });
    let bids = g.alloc_bytes("ids", &i32_bytes(&r.ids));
    let bseq = g.alloc_bytes("token_seq", &i32_bytes(&r.token_seq));
    let brw = g.alloc_bytes("weights", &if c.w_bf16 { bf16_bytes(&r.weights) } else { f32_bytes(&r.weights) });
    let bgw = g.alloc_bytes("gate_up", &gu.packed);
    let bgs = g.alloc_bytes("gate_up_sf", &gu.scales);
    let bg2 = g.alloc_f32("gate_up_scale_2", &gu.scale_2);
    let bgi = g.alloc_f32("gate_up_input_scale", &gu.input_scale);
    let bdw = g.alloc_bytes("down", &dn.packed);
    let bds = g.alloc_bytes("down_sf", &dn.scales);
    let bd2 = g.alloc_f32("down_scale_2", &dn.scale_2);
    let bdi = g.alloc_f32("down_input_scale", &dn.input_scale);
    let bmid = g.alloc("mid", c.tokens * sh.top_k * inter * 2);
    // the rows gate/up does not write (padding tokens, other ranks' experts) are NaN, so a down
    // that reads one shows in its output, as stale data would on a GPU
    g.fill(bmid, 0, c.tokens * sh.top_k * inter * 2, 0xFF);
    let bacc = g.alloc("acc", c.tokens * sh.hidden * 4);
    let bout = g.alloc("out", c.tokens * sh.hidden * 2);
    let a = |b| KernelArg::U64(g.addr(b));
    let first_arg = KernelArg::U32(first as u32);
    let args1 = vec![a(bx), a(bids), a(bseq), a(bgw), a(bgs), a(bg2), a(bgi), a(bmid), a(bdi), first_arg.clone()];
    let args2 = vec![a(bmid), a(bids), a(bseq), a(brw), a(bdw), a(bds), a(bd2), a(bdi), a(bacc), a(bout), a(bout), first_arg];
    let grid1 = [el as u32, (inter as u32).div_ceil(COLS), 1];
    let s1 = launch(&mg, MoeGateUpParams::ENTRY, grid1, [THREADS, 1, 1], pg.dynamic_smem().unwrap(), &args1, &mut g).unwrap();
    // MID_FP4: gate/up writes mid quantised for down, codes then block scales, every 16-value
    // block as the CPU quantises the BF16 row with the down projection's input_scale (codes
    // compared where the scale is not 0: a zero scale zeroes the block whatever its codes);
    // unwritten bytes stay 0xFF, an e4m3 NaN. On the tensor cores (prefill) the group's values
    // are staged over the parts' rows, where they must fit (as lowering checks), and down copies
    // the codes on sm_120a only.
    let mid_fp4 = mid_fp4(arch, c.mma, mma_dn, COLS, pg.kc as usize).then(|| {
        let fp4 = MoeGateUpParams { mid_fp4: 1, ..pg };
        let mf = Module::parse(&fp4.render().unwrap(), "moe_gate_up.ptx").unwrap();
        let bytes = c.tokens * sh.top_k * inter * 2;
        let bmid_f = g.alloc("mid_fp4", bytes);
        g.fill(bmid_f, 0, bytes, 0xFF);
        let mut args_f = args1.clone();
        args_f[7] = KernelArg::U64(g.addr(bmid_f));
        launch(&mf, MoeGateUpParams::ENTRY, grid1, [THREADS, 1, 1], fp4.dynamic_smem().unwrap(), &args_f, &mut g).unwrap();
        let (mid, quant) = (g.read(bmid), g.read(bmid_f));
        let scales_at = c.tokens * sh.top_k * inter / 2;
        let mut blocks = 0;
        for t in (0..c.tokens).filter(|&t| r.token_seq[t] >= 0) {
            for j in 0..sh.top_k {
                let Some(local) = (r.ids[t * sh.top_k + j] as usize).checked_sub(first).filter(|&e| e < el) else { continue };
                let row = t * sh.top_k + j;
                let vals: Vec<f32> = mid[row * inter * 2..(row + 1) * inter * 2].chunks_exact(2).map(|b| bf16_to_f32(u16::from_le_bytes([b[0], b[1]]))).collect();
                for b in 0..inter / 16 {
                    let (sf, codes) = quantize_block_codes(&vals[b * 16..(b + 1) * 16], dn.input_scale[local]);
                    assert_eq!(quant[scales_at + row * inter / 16 + b], sf, "MID_FP4 scale of row {row} block {b}");
                    let packed: Vec<u8> = codes.chunks_exact(2).map(|p| p[0] | p[1] << 4).collect();
                    if sf != 0 {
                        assert_eq!(&quant[row * inter / 2 + b * 8..][..8], &packed[..], "MID_FP4 codes of row {row} block {b}");
                    }
                    blocks += 1;
                }
            }
        }
        assert!(blocks > 0 || r.token_seq.iter().all(|&t| t < 0) || el == 0, "no routed block checked");
        if c.mma {
            return bmid_f;
        }
        // COMPACT blocks (as lowering pairs them at batches 2 to 16) write the same bytes
        let compact = MoeGateUpParams { compact: 1, ..fp4 };
        let mc = Module::parse(&compact.render().unwrap(), "moe_gate_up.ptx").unwrap();
        let bmid_c = g.alloc("mid_fp4_compact", bytes);
        g.fill(bmid_c, 0, bytes, 0xFF);
        args_f[7] = KernelArg::U64(g.addr(bmid_c));
        let slots = (c.tokens * sh.top_k).min(el) as u32;
        launch(&mc, MoeGateUpParams::ENTRY, [slots, (inter as u32).div_ceil(COLS), 1], [THREADS, 1, 1], compact.dynamic_smem().unwrap(), &args_f, &mut g).unwrap();
        assert!(g.read(bmid_c) == quant, "MID_FP4 gate/up over {slots} compact blocks differs from one block per expert");
        bmid_f
    });
    // another form of the gate/up launch (`blocks_x` blocks along x, the rest from its columns
    // and threads) into a mid of its own: that mid
    let gate_up_variant = |g: &mut GlobalMemory, v: MoeGateUpParams, blocks_x: u32, name: &str| -> Vec<u8> {
        let m = Module::parse(&v.render().unwrap(), "moe_gate_up.ptx").unwrap();
        let mid = g.alloc(&format!("mid_{name}"), c.tokens * sh.top_k * inter * 2);
        g.fill(mid, 0, c.tokens * sh.top_k * inter * 2, 0xFF);
        let mut args = args1.clone();
        args[7] = KernelArg::U64(g.addr(mid));
        launch(&m, MoeGateUpParams::ENTRY, [blocks_x, (inter as u32).div_ceil(v.cols), 1], [v.threads, 1, 1], v.dynamic_smem().unwrap(), &args, g).unwrap();
        g.read(mid)
    };
    if c.mma {
        // Prefill's 128-column blocks of 16 warps (`gate_up_cols`, `gate_up_threads`: half the
        // reads of the activations), an n8 tile of gate and up a warp, write the 8-warp bits; so
        // do groups of 64 tokens (`mma_group`: four m16 tiles, the weights read once per 64)
        let wide = gate_up_variant(&mut g, MoeGateUpParams { cols: 128, threads: gate_up_threads(128, true), ..pg }, el as u32, "warps16");
        assert!(wide == g.read(bmid), "gate/up on the tensor cores with 128 columns per block of 16 warps differs from {COLS} of 8");
        let g64 = gate_up_variant(&mut g, MoeGateUpParams { g: 64, ..pg }, el as u32, "g64");
        assert!(g64 == g.read(bmid), "gate/up on the tensor cores in groups of 64 tokens differs from groups of 32");
        if let Some(bmid_f) = mid_fp4 {
            // and so does MID_FP4's, staging 64 rows of values over the parts' rows
            let g64 = gate_up_variant(&mut g, MoeGateUpParams { g: 64, mid_fp4: 1, ..pg }, el as u32, "g64_fp4");
            assert!(g64 == g.read(bmid_f), "MID_FP4 gate/up on the tensor cores in groups of 64 tokens differs from groups of 32");
        }
    } else {
        // Decode's narrower blocks (as `gate_up_cols` picks at batch 1: one column per warp),
        // loading one block ahead instead of four, compute every column as the 64-wide ones do.
        let narrow = gate_up_variant(&mut g, MoeGateUpParams { cols: 8, unroll: 1, ..pg }, el as u32, "cols8");
        assert!(narrow == g.read(bmid), "gate/up with 8 columns per block, unroll 1, differs from {COLS}, unroll 4");
        // COMPACT (decode with fewer routed pairs than experts): only as many blocks along x as
        // pairs (or experts), block x finding the x-th expert that got a token, writes the same
        // bits (every routed pair's row of mid; experts of other ranks and padding ignored)
        let compact = MoeGateUpParams { compact: 1, ..pg };
        assert!(compact.dynamic_smem().unwrap() as usize >= 4 * (el + 1), "the flags fit the token list's region");
        let slots = (c.tokens * sh.top_k).min(el) as u32;
        let compacted = gate_up_variant(&mut g, compact, slots, "compact");
        assert!(compacted == g.read(bmid), "gate/up over {slots} compact blocks differs from one block per expert");
    }
    let s2 = launch(&md, MoeDownParams::ENTRY, [(sh.hidden as u32).div_ceil(COLS), 1, 1], [THREADS, 1, 1], pd.dynamic_smem().unwrap(), &args2, &mut g).unwrap();
    // another form of the down launch (its blocks from its columns and threads) into an acc and
    // an out of its own: that out
    let down_variant = |g: &mut GlobalMemory, v: MoeDownParams, name: &str| -> Vec<u8> {
        let m = Module::parse(&v.render().unwrap(), "moe_down.ptx").unwrap();
        let (acc, out) = (g.alloc(&format!("acc_{name}"), c.tokens * sh.hidden * 4), g.alloc(&format!("out_{name}"), c.tokens * sh.hidden * 2));
        let mut args = args2.clone();
        args[8] = KernelArg::U64(g.addr(acc));
        args[9] = KernelArg::U64(g.addr(out));
        launch(&m, MoeDownParams::ENTRY, [(sh.hidden as u32).div_ceil(v.cols), 1, 1], [v.threads, 1, 1], v.dynamic_smem().unwrap(), &args, g).unwrap();
        g.read(out)
    };
    if !mma_dn {
        // Decode's 32-column down blocks (`down_cols`), loading 3 blocks ahead, write the
        // 64-column result bit for bit.
        let narrow = down_variant(&mut g, MoeDownParams { cols: 32, unroll: 3, ..pd }, "cols32");
        assert!(narrow == g.read(bout), "down with 32 columns per block, unroll 3, differs from {COLS}, unroll 4");
    } else {
        // Prefill's 32-column blocks of 4 warps (`down_cols`, `down_threads`: 192 blocks where
        // GLM-5's 96 of 64 columns leave half the SMs idle), an n8 tile a warp, write the
        // 8-warp result bit for bit; so do groups of 64 tokens (`mma_group`)
        let narrow = down_variant(&mut g, MoeDownParams { cols: 32, threads: down_threads(32, true), ..pd }, "warps4");
        assert!(narrow == g.read(bout), "down on the tensor cores with 32 columns per block of 4 warps differs from {COLS} of 8");
        let g64 = down_variant(&mut g, MoeDownParams { g: 64, ..pd }, "g64");
        assert!(g64 == g.read(bout), "down on the tensor cores in groups of 64 tokens differs from groups of 32");
    }
    if let Some(bmid_f) = mid_fp4 {
        // ... and down copying those codes writes the bits of down quantising the BF16 rows
        let fp4 = MoeDownParams { mid_fp4: 1, ..pd };
        let mf = Module::parse(&fp4.render().unwrap(), "moe_down.ptx").unwrap();
        let bout_f = g.alloc("out_mid_fp4", c.tokens * sh.hidden * 2);
        let mut args_f = args2.clone();
        args_f[0] = KernelArg::U64(g.addr(bmid_f));
        args_f[9] = KernelArg::U64(g.addr(bout_f));
        launch(&mf, MoeDownParams::ENTRY, [(sh.hidden as u32).div_ceil(COLS), 1, 1], [THREADS, 1, 1], fp4.dynamic_smem().unwrap(), &args_f, &mut g).unwrap();
        assert!(g.read(bout_f) == g.read(bout), "down reading FP4 mid differs from down quantising BF16 mid");
    }
    // STAGE: the routing copied to shared memory once, every expert's scan reading it there,
    // writes the same bits
    let staged = MoeDownParams { stage: 1, ..pd };
    let ms = Module::parse(&staged.render().unwrap(), "moe_down.ptx").unwrap();
    let (bacc_s, bout_s) = (g.alloc("acc_staged", c.tokens * sh.hidden * 4), g.alloc("out_staged", c.tokens * sh.hidden * 2));
    let mut args_s = args2.clone();
    args_s[8] = KernelArg::U64(g.addr(bacc_s));
    args_s[9] = KernelArg::U64(g.addr(bout_s));
    let ids_read = g.bytes_loaded(bids);
    launch(&ms, MoeDownParams::ENTRY, [(sh.hidden as u32).div_ceil(COLS), 1, 1], [THREADS, 1, 1], staged.dynamic_smem().unwrap(), &args_s, &mut g).unwrap();
    assert!(g.read(bout_s) == g.read(bout), "down with the routing staged in shared memory differs");
    // ... reading the routing from global memory once per block (the marking), at most
    let active = r.token_seq.iter().filter(|&&t| t >= 0).count();
    let blocks = (sh.hidden as u32).div_ceil(COLS) as u64;
    assert!(g.bytes_loaded(bids) - ids_read <= blocks * (active * sh.top_k * 4) as u64, "staged down re-reads the routing");
    // ACC_SMEM: each block's columns of acc in its shared memory write the same bits and never
    // touch the acc argument (a NaN pattern there would reach out if it were read)
    let in_smem = MoeDownParams { acc_smem: 1, stage: 1, ..pd };
    let mm = Module::parse(&in_smem.render().unwrap(), "moe_down.ptx").unwrap();
    let (bacc_m, bout_m) = (g.alloc("acc_unused", c.tokens * sh.hidden * 4), g.alloc("out_acc_smem", c.tokens * sh.hidden * 2));
    g.fill(bacc_m, 0, c.tokens * sh.hidden * 4, 0xFF);
    let mut args_m = args2.clone();
    args_m[8] = KernelArg::U64(g.addr(bacc_m));
    args_m[9] = KernelArg::U64(g.addr(bout_m));
    launch(&mm, MoeDownParams::ENTRY, [(sh.hidden as u32).div_ceil(COLS), 1, 1], [THREADS, 1, 1], in_smem.dynamic_smem().unwrap(), &args_m, &mut g).unwrap();
    assert!(g.read(bout_m) == g.read(bout), "down with acc in shared memory differs from acc in global memory");
    assert_eq!(g.bytes_loaded(bacc_m), 0, "down with acc in shared memory read the acc argument");
    assert!(g.read(bacc_m).iter().all(|&b| b == 0xFF), "down with acc in shared memory wrote the acc argument");
    let got: Vec<f32> = g.read(bout).chunks_exact(2).map(|b| bf16_to_f32(u16::from_le_bytes([b[0], b[1]]))).collect();
    // ADD: the shared experts' output added in the final store gives an add launch's bits (the
    // rounded output plus shared, rounded), padding tokens included
    let shared: Vec<f32> = (0..c.tokens * sh.hidden).map(|_| round_bf16((rng.normal() * 0.5) as f32)).collect();
    let with_add = MoeDownParams { add: 1, add_bf16: 1, ..pd };
    let ma = Module::parse(&with_add.render().unwrap(), "moe_down.ptx").unwrap();
    let (bsh, bsum) = (g.alloc_bytes("shared", &bf16_bytes(&shared)), g.alloc("out_plus_shared", c.tokens * sh.hidden * 2));
    let mut args_add = args2.clone();
    args_add[9] = KernelArg::U64(g.addr(bsum));
    args_add[10] = KernelArg::U64(g.addr(bsh));
    launch(&ma, MoeDownParams::ENTRY, [(sh.hidden as u32).div_ceil(COLS), 1, 1], [THREADS, 1, 1], with_add.dynamic_smem().unwrap(), &args_add, &mut g).unwrap();
    let summed: Vec<f32> = g.read(bsum).chunks_exact(2).map(|b| bf16_to_f32(u16::from_le_bytes([b[0], b[1]]))).collect();
    let off = summed.iter().zip(got.iter().zip(&shared)).filter(|(s, (o, v))| s.to_bits() != round_bf16(*o + *v).to_bits()).count();
    assert_eq!(off, 0, "down with ADD: {off} values differ from round(out + shared)");

    let what = format!("moe sm_{arch}a {:?} {:?} tokens={} padding={:?} G={g1}/{g2} mma={}", sh, c.split, c.tokens, c.padding, c.mma);
    let cmp = compare(DType::BF16, &Values::F32(got.clone()), &Values::F32(want.clone()));
    let nonzero = want.iter().filter(|&&v| v != 0.0).count();
    let amax = want.iter().fold(0f32, |a, v| a.max(v.abs()));
    eprintln!("{what}: max abs {:.3e}, max rel {:.3e} over {} values ({nonzero} non-zero, max |out| {amax:.3})", cmp.max_abs, cmp.max_rel, cmp.elements);
    assert!(cmp.ok(), "{what}: {} of {} values beyond tolerance (max abs {:e}, max rel {:e})", cmp.beyond + cmp.non_finite, cmp.elements, cmp.max_abs, cmp.max_rel);
    for &t in &c.padding {
        assert!(got[t * sh.hidden..(t + 1) * sh.hidden].iter().all(|&v| v == 0.0), "padding token {t} must be 0");
    }
    // The rank owns at least one routed (token, expert) pair, so its output must not be all zero.
    let local = |e: i32| (first as i32..(first + el) as i32).contains(&e);
    let active = |t: usize| r.token_seq[t] >= 0;
    let pairs: Vec<(usize, i32)> = (0..c.tokens).filter(|&t| active(t)).flat_map(|t| r.ids[t * sh.top_k..(t + 1) * sh.top_k].iter().map(move |&e| (t, e))).filter(|&(_, e)| local(e)).collect();
    if !pairs.is_empty() {
        assert!(want.iter().any(|&v| v != 0.0), "the reference is all zero");
    }

    // Compulsory bytes: the selected experts' weights, the activations and routing read once.
    let mut selected: Vec<i32> = pairs.iter().map(|&(_, e)| e).collect();
    selected.sort();
    selected.dedup();
    let per_gu = (2 * inter) * (sh.hidden / 2 + sh.hidden / 16);
    let per_dn = sh.hidden * (inter / 2 + inter / 16);
    let x_rows = (0..c.tokens).filter(|&t| active(t)).count();
    let compulsory = selected.len() * (per_gu + per_dn + 12)
        + x_rows * sh.hidden * if c.x_bf16 { 2 } else { 4 }
        + pairs.len() * inter * 2
        + c.tokens * (4 + sh.top_k * 4 + sh.top_k * if c.w_bf16 { 2 } else { 4 });
    Run { read: s1.global_bytes_read() + s2.global_bytes_read(), compulsory: compulsory as u64, out: got }
}

/// Runs a case for both targets; the CUDA-core path must agree bit for bit.
fn run_both(c: &Case, seed: u64) {
    let sm120 = run(c, 120, seed);
    let sm90 = run(c, 90, seed);
    if !c.mma {
        assert!(sm90.out.iter().zip(&sm120.out).all(|(a, b)| a.to_bits() == b.to_bits()), "sm_90a differs from sm_120a on the CUDA-core path");
    }
}

#[test]
fn moe_matches_the_cpu_under_tp_and_ep() {
    let tp1 = Split::Tp { tp: 1, rank: 0 };
    let cases = [
        // decode: one token
        Case { shape: TINY, tokens: 1, padding: vec![], share: 0, split: tp1, group: None, lanes: None, mma: false, x_bf16: true, w_bf16: false, split_scales: false },
        // three tokens sharing expert 5, one padding token; TP2 rank 1 (intermediate 64)
        Case { shape: TINY, tokens: 3, padding: vec![1], share: 3, split: Split::Tp { tp: 2, rank: 1 }, group: None, lanes: None, mma: false, x_bf16: true, w_bf16: false, split_scales: false },
        // seventeen tokens, groups of 3 (an expert's tokens span several groups), split gate/up scales
        Case { shape: TINY, tokens: 17, padding: vec![0, 9, 16], share: 7, split: tp1, group: Some(3), lanes: None, mma: false, x_bf16: true, w_bf16: false, split_scales: true },
        // EP rank 0 and 1 (8 experts each; rank 1's first expert is 8), f32 input, bf16 routing weights; rank 1 with groups of 1 and a whole warp per column
        Case { shape: TINY, tokens: 17, padding: vec![4], share: 5, split: Split::Ep { ranks: 2, rank: 0 }, group: None, lanes: None, mma: false, x_bf16: false, w_bf16: true, split_scales: false },
        Case { shape: TINY, tokens: 3, padding: vec![], share: 2, split: Split::Ep { ranks: 2, rank: 1 }, group: Some(1), lanes: Some(32), mma: false, x_bf16: true, w_bf16: false, split_scales: false },
        // 33 tokens on expert 5 in groups of 16: gate/up's MID_FP4 quantisation of a group spans
        // two warps, and the next group's slots must wait for both (block (5, 0) runs warp 0
        // ahead of warp 1 in the emulator)
        Case { shape: TINY, tokens: 33, padding: vec![], share: 33, split: tp1, group: Some(16), lanes: None, mma: false, x_bf16: true, w_bf16: false, split_scales: false },
        // TP2 rank 0 with 17 tokens, 4 lanes per column (several blocks per lane)
        Case { shape: TINY, tokens: 17, padding: vec![2, 3], share: 17, split: Split::Tp { tp: 2, rank: 0 }, group: None, lanes: Some(4), mma: false, x_bf16: true, w_bf16: false, split_scales: false },
        // ragged: hidden 272 and intermediate 80 are not multiples of the 64-column tiles, 17 and 5
        // blocks of 16 are not multiples of the lanes per column; 6 experts top-3
        Case { shape: RAGGED, tokens: 17, padding: vec![1], share: 9, split: Split::Tp { tp: 1, rank: 0 }, group: Some(5), lanes: None, mma: false, x_bf16: true, w_bf16: false, split_scales: true },
        Case { shape: RAGGED, tokens: 3, padding: vec![2], share: 2, split: Split::Ep { ranks: 2, rank: 1 }, group: None, lanes: None, mma: false, x_bf16: true, w_bf16: false, split_scales: false },
    ];
    for (i, c) in cases.iter().enumerate() {
        run_both(c, 40 + i as u64);
    }
}

#[test]
fn prefill_moe_on_the_tensor_cores_matches_the_cpu() {
    let tp1 = Split::Tp { tp: 1, rank: 0 };
    let cases = [
        // 17 tokens, one partial m16 tile pair; TP1 and TP2 rank 1
        Case { shape: TINY, tokens: 17, padding: vec![3], share: 9, split: tp1, group: None, lanes: None, mma: true, x_bf16: true, w_bf16: false, split_scales: true },
        Case { shape: TINY, tokens: 17, padding: vec![], share: 4, split: Split::Tp { tp: 2, rank: 1 }, group: None, lanes: None, mma: true, x_bf16: false, w_bf16: false, split_scales: false },
        // 80 tokens all on expert 5 (three groups of 32), EP rank 0
        Case { shape: TINY, tokens: 80, padding: vec![0, 79], share: 80, split: Split::Ep { ranks: 2, rank: 0 }, group: None, lanes: None, mma: true, x_bf16: true, w_bf16: false, split_scales: false },
        // ragged: 272 = 17 blocks of 16 is no multiple of 64, so the lowering keeps the CUDA-core
        // path; 320 hidden with intermediate 80 (ragged 8-column warp tiles) takes the mma path
        Case { shape: Shape { hidden: 320, inter: 80, experts: 6, top_k: 3 }, tokens: 33, padding: vec![5], share: 20, split: tp1, group: None, lanes: None, mma: true, x_bf16: true, w_bf16: false, split_scales: true },
    ];
    for (i, c) in cases.iter().enumerate() {
        run_both(c, 60 + i as u64);
    }
}

#[test]
fn staged_down_skips_pairs_by_their_valid_bits_at_256_local_experts() {
    // With 256 local experts every byte of down's staged routing is an expert id, so only the
    // valid bits tell a pair to skip: a padding token's (its bytes never written: 0xFF in the
    // emulator, stale data on a GPU; tokens 0 and 1 route to 255, token 2 is padding), and under
    // EP with 512 experts another rank's (expert 256 + e wraps to the byte of local expert e),
    // whose mid rows this rank's gate/up never writes.
    let wide = Shape { hidden: 64, inter: 64, experts: 256, top_k: 8 };
    let tp1 = Split::Tp { tp: 1, rank: 0 };
    for (i, (tokens, mma)) in [(17, false), (40, true)].into_iter().enumerate() {
        let c = Case { shape: wide, tokens, padding: vec![2, 9], share: 3, split: tp1, group: None, lanes: None, mma, x_bf16: true, w_bf16: false, split_scales: false };
        run_both(&c, 90 + i as u64);
        let ep = Case { shape: Shape { experts: 512, ..wide }, split: Split::Ep { ranks: 2, rank: 0 }, ..c };
        run_both(&ep, 92 + i as u64);
    }
}

#[test]
fn moe_of_only_padding_is_zero() {
    let c = Case { shape: TINY, tokens: 3, padding: vec![0, 1, 2], share: 0, split: Split::Tp { tp: 1, rank: 0 }, group: None, lanes: None, mma: false, x_bf16: true, w_bf16: false, split_scales: false };
    run_both(&c, 7);
}

#[test]
fn decode_moe_reads_the_selected_experts_once() {
    for (arch, tokens, limit) in [(120, 1, 1.10), (120, 4, 1.25), (90, 1, 1.10), (90, 4, 1.25)] {
        let c = Case { shape: TINY, tokens, padding: vec![], share: 0, split: Split::Tp { tp: 1, rank: 0 }, group: None, lanes: None, mma: false, x_bf16: true, w_bf16: false, split_scales: false };
        let r = run(&c, arch, 77);
        let ratio = r.read as f64 / r.compulsory as f64;
        eprintln!("decode MoE sm_{arch}a batch {tokens}: {} B read / {} B compulsory = {ratio:.3}", r.read, r.compulsory);
        assert!(ratio <= limit, "batch {tokens}: byte ratio {ratio}");
        assert!(ratio >= 1.0, "read less than the compulsory bytes? {ratio}");
    }
}

/// At GLM-5 tp8 sizes (hidden 6144, a rank's 256-wide slice of every expert, top-8; 16 experts
/// stored so the test stays small) decode still reads the selected experts' weights about once.
#[test]
fn glm5_decode_moe_reads_the_selected_experts_once() {
    let sh = Shape { hidden: 6144, inter: 256, experts: 16, top_k: 8 };
    for (tokens, limit) in [(1, 1.10), (4, 1.25)] {
        let c = Case { shape: sh, tokens, padding: vec![], share: 0, split: Split::Tp { tp: 1, rank: 0 }, group: None, lanes: None, mma: false, x_bf16: true, w_bf16: false, split_scales: false };
        let r = run(&c, 120, 99);
        let ratio = r.read as f64 / r.compulsory as f64;
        eprintln!("GLM-5 tp8 decode MoE batch {tokens}: {} B read / {} B compulsory = {ratio:.3}", r.read, r.compulsory);
        assert!(ratio >= 1.0 && ratio <= limit, "batch {tokens}: byte ratio {ratio}");
    }
}

/// The down launch with the routing (and acc, within the decode budget) in shared memory where it fits, as lowering does it
/// (1 KiB left for the static arrays; byte expert ids and a token's bits in a word).
fn staged_where_it_fits(dn: MoeDownParams) -> MoeDownParams {
    let fits = dn.experts <= 256 && dn.topk <= 32 && MoeDownParams { stage: 1, ..dn }.dynamic_smem().unwrap() as usize + 1024 <= SMEM_LIMIT as usize;
    let dn = MoeDownParams { stage: fits as u32, ..dn };
    // acc in shared memory within the decode budget (half, for two blocks an SM)
    let with_acc = MoeDownParams { acc_smem: 1, ..dn };
    let budget = if dn.tokens <= 64 { SMEM_LIMIT as usize / 2 } else { SMEM_LIMIT as usize };
    if with_acc.dynamic_smem().unwrap() as usize + 1024 <= budget { with_acc } else { dn }
}

/// (name, gate/up params, down params) of the GLM-5 tp8 instances the lowering emits for `arch`.
fn glm5_instances(arch: u32) -> Vec<(String, MoeGateUpParams, MoeDownParams)> {
    let (hidden, top_k) = (6144usize, 8usize);
    let mut out = Vec::new();
    // TP: 256 experts x 256 intermediate per rank; EP: 32 experts x 2048.
    for (mode, experts, inter) in [("tp", 256usize, 256usize), ("ep", 32, 2048)] {
        for tokens in [1usize, 32, 8192] {
            let mma = tokens > 64;
            let g_mma = mma_group(arch, tokens, mma_chunk(arch, hidden), SMEM_LIMIT);
            let cols = gate_up_cols(&Experts::uniform(tokens, top_k, 256, experts), inter, hidden, 2, mma.then_some(g_mma), (experts * tokens * (top_k + 1) * 4) as f64, &Constants::SM120A);
            // the largest groups that fit (with MID_FP4 a token also stages its columns' values)
            let g1 = if mma { g_mma } else { group(tokens, hidden * 3 / 2 + if cols % 16 == 0 { cols as usize * 4 } else { 0 }) };
            let g2 = if mma { mma_group(arch, tokens, mma_chunk(arch, inter), SMEM_LIMIT) } else { group(tokens, inter * 3 / 4) };
            // loads ahead as the lowering picks them (four at G <= 4 would spill at larger G)
            let gu = MoeGateUpParams { arch, tokens: tokens as u32, topk: top_k as u32, experts: experts as u32, inter: inter as u32, k: hidden as u32, g: g1 as u32, cols, lanes: lanes(hidden), unroll: loads_ahead(g1), mma: mma as u32, kc: mma_chunk(arch, hidden) as u32, threads: gate_up_threads(cols, mma), x_bf16: 1, compact: (!mma && tokens * top_k < experts) as u32, mid_fp4: mid_fp4(arch, mma, mma /* inter % 64 == 0 */, cols, mma_chunk(arch, hidden)) as u32 };
            let dn = MoeDownParams { arch, tokens: tokens as u32, topk: top_k as u32, experts: experts as u32, inter: inter as u32, hidden: hidden as u32, g: g2 as u32, cols: 32 /* down_cols at GLM-5 sizes */, lanes: lanes(inter), unroll: loads_ahead(g2), mma: mma as u32, kc: mma_chunk(arch, inter) as u32, threads: down_threads(32, mma), w_bf16: 0, out_bf16: 1, add: 1, add_bf16: 1, stage: 1, acc_smem: 0, mid_fp4: gu.mid_fp4 };
            out.push((format!("sm_{arch}a glm5 {mode} tokens={tokens} G={g1}/{g2} cols={cols} mma={mma}"), gu, staged_where_it_fits(dn)));
        }
    }
    // and the tiny model's
    for (tokens, mma) in [(1usize, false), (17, false), (128, true)] {
        let g1 = if mma { 32 } else { group(tokens, 384 + 64 * 4) };
        let g2 = if mma { 32 } else { group(tokens, 96) };
        let gu = MoeGateUpParams { arch, tokens: tokens as u32, topk: 4, experts: 16, inter: 128, k: 256, g: g1 as u32, cols: COLS, lanes: lanes(256), unroll: loads_ahead(g1), mma: mma as u32, kc: 256, threads: THREADS, x_bf16: 1, compact: (!mma && tokens * 4 < 16) as u32, mid_fp4: mid_fp4(arch, mma, mma, COLS, 256) as u32 };
        let dn = MoeDownParams { arch, tokens: tokens as u32, topk: 4, experts: 16, inter: 128, hidden: 256, g: g2 as u32, cols: COLS, lanes: lanes(128), unroll: loads_ahead(g2), mma: mma as u32, kc: 128, threads: THREADS, w_bf16: 0, out_bf16: 1, add: 1, add_bf16: 1, stage: 1, acc_smem: 0, mid_fp4: gu.mid_fp4 };
        out.push((format!("sm_{arch}a tiny tokens={tokens} mma={mma}"), gu, staged_where_it_fits(dn)));
    }
    out
}

#[test]
fn moe_kernels_assemble_at_glm5_shapes() {
    let Some(ptxas) = common::ptxas("the MoE kernels") else { return };
    let dir = std::env::temp_dir().join(format!("kiln-moe-ptxas-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut failures = Vec::new();
    for (name, gu, dn) in glm5_instances(120).into_iter().chain(glm5_instances(90)) {
        for (kernel, ptx, smem) in [("gate_up", gu.render().unwrap(), gu.dynamic_smem().unwrap()), ("down", dn.render().unwrap(), dn.dynamic_smem().unwrap())] {
            let r = match common::assemble(&ptxas, &format!("{name}_{kernel}"), &ptx) {
                Ok(r) => r,
                Err(log) => {
                    failures.push(log);
                    continue;
                }
            };
            eprintln!(
                "{name} {kernel}: {} registers, {} B spill stores, {} B spill loads, {} B static + {smem} B dynamic smem",
                r.registers, r.spill_store_bytes, r.spill_load_bytes, r.smem_static_bytes
            );
            if r.spill_store_bytes + r.spill_load_bytes > 0 || r.registers > 255 || r.smem_static_bytes + smem > SMEM_LIMIT {
                failures.push(format!("{name} {kernel}: out of limits: {r:?}"));
            }
        }
    }
    if failures.is_empty() {
        let _ = std::fs::remove_dir_all(&dir);
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
