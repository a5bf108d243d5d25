//! The tensor-core GEMMs (`Op::Linear` steps the GEMV does not take) against the CPU reference:
//! NVFP4 W4A4 (one or two parts, SiLU-mul with equal or different input scales, zero and
//! saturated blocks) and BF16, BF16 / F32 activations and outputs, tiled (prefill) and split-K
//! (decode-sized M = 1, 3, 17, 32) forms, M, N and K not multiples of the tiles, run on the PTX
//! emulator and compared under `kiln verify`'s tolerances; global bytes read stay within what
//! the tiling implies (weights once per row block, activations once per column block). GLM-5
//! tp8 shapes (M = 1 .. 8192) must assemble with ptxas for sm_120a and sm_90a without spills,
//! within 255 registers and the shared-memory limit.
//!
//! Every NVFP4 case also runs as the sm_90a form (decoded f16 mma instead of the block-scaled
//! FP4 mma; its stage ring trimmed to the shared memory), under the same tolerance: both forms
//! multiply the same exact E2M1 x E4M3 values and accumulate in f32 (the emulator's mma sums each
//! instruction's exact products in f64 and rounds once), so they differ from the CPU only in
//! summation order, as the sm_120a form does.

mod common;
use common::{bytes, floats, randn};
use kiln_compiler::kernels::{LinearBf16GemmParams, LinearNvfp4GemmParams, RmsnormParams};
use kiln_compiler::passes::lower::{bf16_gemm_form, nvfp4_gemm_form};
use kiln_runtime::perf::Constants;
use kiln_runtime::plan::{DType, SplitKLayout};
use kiln_runtime::verify::{compare, Values};
use kiln_runtime::cpu::reference;
use kiln_runtime::emu::{launch, GlobalMemory, KernelArg, LaunchStats, Module};
use kiln_runtime::rng::Rng;

/// Tiled-form blocks (rows x output columns; SiLU-mul halves the columns).
const NV_BM: usize = 64;
const NV_BN: usize = 128;
const BF_BN: usize = 128;

fn check(what: &str, bf16: bool, emu: &[f32], cpu: &[f32]) {
    assert!(cpu.iter().filter(|v| **v != 0.0).count() > cpu.len() / 2, "{what}: the reference is mostly zero");
    common::check(what, bf16, emu, cpu);
}

/// The launches of an NVFP4 linear as lowering makes them: one per part, or one for SiLU-mul.
/// The NVFP4 GEMM's form: tiled (64 x 128 blocks, stages of `ks` k64 steps in `nbuf` buffers)
/// or split-K (16 * mt x 8 * nt blocks, K over `slices` blocks).
#[derive(Clone, Copy, Debug)]
struct NvForm {
    split: u32,
    ks: u32,
    nbuf: u32,
    mt: u32,
    nt: u32,
    slices: u32,
}

fn nv_tiled(ks: u32, nbuf: u32) -> NvForm {
    NvForm { split: 0, ks, nbuf, mt: 1, nt: 2, slices: 1 }
}

fn nv_split(mt: u32, nt: u32) -> NvForm {
    NvForm { split: 1, ks: 1, nbuf: 2, mt, nt, slices: 1 }
}

fn nv_split_k(mt: u32, nt: u32, slices: u32) -> NvForm {
    NvForm { slices, ..nv_split(mt, nt) }
}

#[allow(clippy::too_many_arguments)]
fn nvfp4_launches(arch: u32, m: usize, k: usize, parts: &[usize], silu: bool, x_bf16: bool, out_bf16: bool, f: NvForm) -> Vec<(LinearNvfp4GemmParams, [u32; 3])> {
    let n: usize = parts.iter().sum();
    let NvForm { split, ks, nbuf, mt, nt, slices } = f;
    let partials = if slices > 1 { SplitKLayout::PARTIALS as u32 } else { 0 };
    let base = LinearNvfp4GemmParams { arch, m: m as u32, k: k as u32, rows: 0, row0: 0, up0: 0, part: 0, silu: 0, ldo: n as u32, col0: 0, ks, nbuf, split, slices, partials, mt, nt, threads: 256, x_bf16: x_bf16 as u32, out_bf16: out_bf16 as u32 };
    let (bm, bn) = if split == 1 { (16 * mt as usize, 8 * nt as usize) } else { (NV_BM, NV_BN) };
    let grid = |cols: usize, per: usize| [cols.div_ceil(per) as u32, m.div_ceil(bm) as u32, slices];
    if silu {
        let p = LinearNvfp4GemmParams { rows: parts[0] as u32, up0: parts[0] as u32, silu: 1, ldo: parts[0] as u32, ..base };
        return vec![(p, grid(parts[0], bn / 2))];
    }
    let mut row0 = 0;
    parts
        .iter()
        .enumerate()
        .map(|(i, &rows)| {
            let p = LinearNvfp4GemmParams { rows: rows as u32, row0: row0 as u32, part: i as u32, col0: row0 as u32, ..base };
            row0 += rows;
            (p, grid(rows, bn))
        })
        .collect()
}

struct Nvfp4Case {
    m: usize,
    parts: Vec<usize>,
    k: usize,
    silu: bool,
    x_bf16: bool,
    out_bf16: bool,
    split_scales: bool,
    form: NvForm,
    /// Multiplies the input scales: < 1 saturates block scales at 448 and codes at 6.
    scale_mul: f32,
}

/// A case at the input scales' own size.
#[allow(clippy::too_many_arguments)]
fn nvfp4(m: usize, parts: Vec<usize>, k: usize, silu: bool, x_bf16: bool, out_bf16: bool, split_scales: bool, form: NvForm) -> Nvfp4Case {
    Nvfp4Case { m, parts, k, silu, x_bf16, out_bf16, split_scales, form, scale_mul: 1.0 }
}

/// Every case on sm_120a and sm_90a, case i with seed `seed + i`.
fn on_both_archs(cases: &[Nvfp4Case], seed: u64) {
    for (i, case) in cases.iter().enumerate() {
        for arch in [120, 90] {
            nvfp4_case(case, arch, seed + i as u64);
        }
    }
}

/// The case's form within the shared memory of one block: sm_90a's stages are larger (f16
/// activation planes), so a ring too deep for it loses buffers, then K steps per stage.
fn fitted(arch: u32, c: &Nvfp4Case) -> NvForm {
    let mut f = c.form;
    let smem = |f: NvForm| nvfp4_launches(arch, c.m, c.k, &c.parts, c.silu, c.x_bf16, c.out_bf16, f).iter().map(|(p, _)| p.dynamic_smem().unwrap()).max().unwrap();
    while smem(f) > 101_376 {
        if f.nbuf > 2 {
            f.nbuf -= 1;
        } else {
            f.ks /= 2;
        }
    }
    f
}

/// Runs one case for `arch` (120 or 90); returns the global bytes read over its launches.
fn nvfp4_case(c: &Nvfp4Case, arch: u32, seed: u64) -> u64 {
    let mut rng = Rng::new(seed);
    let (m, k) = (c.m, c.k);
    let n: usize = c.parts.iter().sum();
    let mut x = randn(&mut rng, m * k, 1.5, c.x_bf16);
    // A zero row (a padding token) and a zero block: block scale 0, codes 0.
    if m > 2 {
        x[..k].fill(0.0);
        x[2 * k + 16..2 * k + 32].fill(0.0);
    }
    let common::Nvfp4Linear { packed, scales, scale_2: s2, input_scale, want } = common::nvfp4_linear(&mut rng, &x, m, k, &c.parts, c.silu, c.split_scales, c.scale_mul, c.out_bf16);
    let cols = if c.silu { c.parts[0] } else { n };

    let mut g = GlobalMemory::new();
    let bx = g.alloc_bytes("x", &bytes(&x, c.x_bf16));
    let bw = g.alloc_bytes("w", &packed);
    let bs = g.alloc_bytes("sf", &scales);
    let b2 = g.alloc_f32("scale_2", &s2);
    let bi = g.alloc_f32("input_scale", &input_scale);
    let bo = g.alloc("out", m * cols * if c.out_bf16 { 2 } else { 4 });
    let region = g.alloc("split_k_region", SplitKLayout::BYTES as usize);
    let args: Vec<KernelArg> = [bx, bw, bs, b2, bi, bo, region].iter().map(|&b| KernelArg::U64(g.addr(b))).collect();
    let what = format!("nvfp4 gemm sm_{arch}a M={m} parts={:?} K={k} silu={} {:?}", c.parts, c.silu, fitted(arch, c));
    let launches = nvfp4_launches(arch, m, k, &c.parts, c.silu, c.x_bf16, c.out_bf16, fitted(arch, c));
    let run = |g: &mut GlobalMemory| {
        let mut read = 0;
        for (params, grid) in &launches {
            let module = Module::parse(&params.render().unwrap(), "linear_nvfp4_gemm.ptx").unwrap();
            let s: LaunchStats = launch(&module, LinearNvfp4GemmParams::ENTRY, *grid, [256, 1, 1], params.dynamic_smem().unwrap(), &args, g).unwrap();
            read += s.global_bytes_read();
        }
        read
    };
    let read = run(&mut g);
    let out = g.read(bo);
    let got = floats(&out, c.out_bf16);
    check(&what, c.out_bf16, &got, &want);
    if c.form.slices > 1 {
        // every tile counter back at zero; a replay over the same region stores the same bits
        assert!(g.read(region)[..4 * SplitKLayout::COUNTERS as usize].iter().all(|&b| b == 0), "{what}: a tile counter is not back at zero");
        g.write(bo, 0, &vec![0xAB; out.len()]);
        run(&mut g);
        assert_eq!(g.read(bo), out, "{what}: the replay differs");
    }
    // Each row block streams its weight rows once and each column block its activation rows
    // once: nothing else is read (beyond the per-part scalars).
    let x_bytes = m * k * if c.x_bf16 { 2 } else { 4 };
    let (bm, bn) = if c.form.split == 1 { (16 * c.form.mt as usize, 8 * c.form.nt as usize) } else { (NV_BM, NV_BN) };
    let per = if c.silu { bn / 2 } else { bn };
    let col_blocks: usize = if c.silu { c.parts[0].div_ceil(per) } else { c.parts.iter().map(|r| r.div_ceil(per)).sum() };
    // K slices: their partial sums read once more, and each block's counter
    let slices = c.form.slices as usize;
    let sums = if slices > 1 { slices * m * n * 4 + 4 * slices * col_blocks * m.div_ceil(bm) } else { 0 };
    let bound = (x_bytes * col_blocks + (packed.len() + scales.len()) * m.div_ceil(bm) + sums) as u64;
    let compulsory = (x_bytes + packed.len() + scales.len()) as u64;
    eprintln!("  {read} B read, {:.3} x compulsory, {:.3} x the tiled bound", read as f64 / compulsory as f64, read as f64 / bound as f64);
    assert!(read <= bound + 64 * (col_blocks * m.div_ceil(bm) * slices) as u64, "{read} B read > {bound} B");
    read
}

#[test]
fn nvfp4_gemm_matches_the_cpu_on_ragged_shapes() {
    let cases = [
        // one part, K = 80 (one 64-wide step plus a 16-wide tail), N below one tile
        Nvfp4Case { m: 33, parts: vec![40], k: 80, silu: false, x_bf16: true, out_bf16: true, split_scales: false, form: nv_tiled(2, 2), scale_mul: 1.0 },
        // gate/up SiLU-mul sharing one input scale, several stages, two column blocks
        Nvfp4Case { m: 50, parts: vec![72, 72], k: 272, silu: true, x_bf16: true, out_bf16: true, split_scales: false, form: nv_tiled(2, 3), scale_mul: 1.0 },
        // SiLU-mul with different input scales per part, f32 in and out, one 64-wide step per stage
        Nvfp4Case { m: 33, parts: vec![40, 40], k: 144, silu: true, x_bf16: false, out_bf16: false, split_scales: true, form: nv_tiled(1, 2), scale_mul: 1.0 },
        // two concatenated parts (two launches), M over one row tile, K = 1040, f32 out
        Nvfp4Case { m: 100, parts: vec![40, 150], k: 1040, silu: false, x_bf16: true, out_bf16: false, split_scales: true, form: nv_tiled(4, 2), scale_mul: 1.0 },
        // f32 activations, bf16 out, K a multiple of 64 (16-byte codes, 4-byte scale words)
        Nvfp4Case { m: 50, parts: vec![130], k: 256, silu: false, x_bf16: false, out_bf16: true, split_scales: false, form: nv_tiled(2, 3), scale_mul: 1.0 },
        // K a multiple of 32 but not 64 (16-byte codes, scale bytes), a partial last stage
        Nvfp4Case { m: 33, parts: vec![72, 72], k: 160, silu: true, x_bf16: true, out_bf16: true, split_scales: true, form: nv_tiled(2, 2), scale_mul: 1.0 },
        // K a multiple of 64 with one and four 64-wide steps per stage, 2 parts
        Nvfp4Case { m: 70, parts: vec![136, 24], k: 192, silu: false, x_bf16: true, out_bf16: true, split_scales: true, form: nv_tiled(1, 4), scale_mul: 1.0 },
        Nvfp4Case { m: 40, parts: vec![200], k: 640, silu: false, x_bf16: true, out_bf16: false, split_scales: false, form: nv_tiled(4, 2), scale_mul: 1.0 },
        // input scales 8x too small: saturated block scales (448) and codes (6)
        Nvfp4Case { m: 36, parts: vec![48, 48], k: 128, silu: true, x_bf16: false, out_bf16: true, split_scales: true, form: nv_tiled(2, 3), scale_mul: 0.125 },
    ];
    on_both_archs(&cases, 500);
}

#[test]
fn split_k_nvfp4_gemm_matches_the_cpu_for_decode_sized_m() {
    let c = nvfp4;
    let cases = [
        // M = 1, 3, 17: K with a 16-wide tail (K % 64 != 0), fewer k64 steps than warps
        c(3, vec![40, 40], 80, true, true, true, false, nv_split(1, 2)),
        c(1, vec![130], 272, false, true, false, false, nv_split(1, 4)),
        c(17, vec![72, 72], 1040, true, false, true, true, nv_split(2, 4)),
        // K a multiple of 64 (scale words), two parts, f32 activations
        c(17, vec![24, 40], 640, false, false, false, true, nv_split(2, 2)),
        c(32, vec![136, 136], 192, true, true, true, false, nv_split(2, 2)),
        // several row blocks (batch 64: 2 of 32 rows, 4 of 16; 50 rows: a partial last block)
        c(64, vec![40, 40], 320, true, true, true, false, nv_split(2, 2)),
        c(64, vec![72], 272, false, true, false, false, nv_split(1, 4)),
        c(50, vec![24, 40], 640, false, false, false, true, nv_split(1, 2)),
    ];
    on_both_archs(&cases, 900);
}

#[test]
fn split_k_nvfp4_gemm_across_blocks_matches_the_cpu_and_replays_the_same_bits() {
    let c = nvfp4;
    let cases = [
        // the shared expert's gate/up (K = 6144, 96 k64 steps) at batch 1 over 12 slices, and at
        // batch 64 over 3; a last slice shorter than the others (20 steps over 2: 10 + 10; 17
        // over 2: 9 + 8), K with a 16-wide tail, two parts (a launch each), f32 in and out
        c(1, vec![24, 24], 6144, true, true, true, false, nv_split_k(1, 2, 12)),
        c(64, vec![16, 16], 6144, true, true, true, true, nv_split_k(2, 2, 3)),
        c(3, vec![40], 1280, false, true, false, false, nv_split_k(1, 4, 2)),
        c(17, vec![24, 40], 1040, false, false, false, true, nv_split_k(2, 2, 2)),
    ];
    on_both_archs(&cases, 940);
}

#[test]
fn short_prefill_chunks_take_the_split_form_and_64_row_tiles() {
    // Chunks of up to 512 tokens: the NVFP4 split form over many row blocks (the shared expert's
    // gate/up of a 128-token chunk: 32-row blocks, K over 3; a ragged 200 rows, the last block of
    // 8; 300 rows of one part with K over 2), and the BF16 tiled form in 64-row tiles with K
    // over 12 blocks of 16 stages (a 2,048-column projection of a 128-token chunk takes 6;
    // 130 rows: a last row block of 2).
    let c = nvfp4;
    let cases = [
        c(128, vec![16, 16], 6144, true, true, true, false, nv_split_k(2, 4, 3)),
        c(200, vec![40, 40], 1040, true, true, true, true, nv_split_k(2, 2, 2)),
        c(300, vec![24], 640, false, true, false, false, nv_split_k(2, 4, 2)),
    ];
    on_both_archs(&cases, 960);
    bf16_case(130, 40, 6144, true, true, Form { ks: 12, ..tiled(2, 2, 3) }, 970);
    bf16_case(128, 136, 6144, true, false, Form { ks: 12, ..tiled(2, 2, 3) }, 971);
    // ... and the BF16 split form over many row blocks (q_a of a 128-token chunk: 32-row blocks
    // of 32 weight rows, K over 6; 200 rows: a last row block of 8, F32 activations and out)
    bf16_case(128, 72, 6144, true, true, split_k(2, 4, 6), 972);
    bf16_case(200, 40, 2056, false, false, split_k(2, 2, 3), 973);
}

#[test]
fn gemms_match_the_cpu_at_glm5_depth() {
    // GLM-5's K = 6144 (48 stages of 128), tp8 shared-expert gate/up sized rows, M over a tile;
    // and a BF16 kv_a-like projection (K = 6144 -> 576 rows cut to 136 here).
    nvfp4_case(&Nvfp4Case { m: 65, parts: vec![136, 136], k: 6144, silu: true, x_bf16: true, out_bf16: true, split_scales: false, form: nv_tiled(1, 3), scale_mul: 1.0 }, 120, 700);
    nvfp4_case(&Nvfp4Case { m: 40, parts: vec![130], k: 1536, silu: false, x_bf16: true, out_bf16: false, split_scales: false, form: nv_tiled(4, 2), scale_mul: 1.0 }, 120, 701);
    nvfp4_case(&Nvfp4Case { m: 24, parts: vec![40, 40], k: 6144, silu: true, x_bf16: true, out_bf16: true, split_scales: false, form: nv_split(2, 2), scale_mul: 1.0 }, 120, 704);
    bf16_case(65, 136, 6144, true, true, tiled(4, 2, 4), 702);
    bf16_case(24, 136, 6144, true, true, split(2, 4), 703);
}

/// The BF16 GEMM's form: `split` 0 tiled (`mt` m16 tiles per warp, 32 * mt x 128 blocks, stages
/// of `kb` k16 steps in `nbuf` buffers) or 1 split-K (16 * mt x 8 * nt blocks, K over `ks`
/// blocks).
#[derive(Clone, Copy, Debug)]
struct Form {
    split: u32,
    mt: u32,
    nt: u32,
    kb: u32,
    nbuf: u32,
    ks: u32,
}

fn tiled(mt: u32, kb: u32, nbuf: u32) -> Form {
    Form { split: 0, mt, nt: 1, kb, nbuf, ks: 1 }
}

fn split(mt: u32, nt: u32) -> Form {
    Form { split: 1, mt, nt, kb: 2, nbuf: 2, ks: 1 }
}

fn split_k(mt: u32, nt: u32, ks: u32) -> Form {
    Form { ks, ..split(mt, nt) }
}

fn bf16_case(m: usize, n: usize, k: usize, x_bf16: bool, out_bf16: bool, f: Form, seed: u64) -> u64 {
    let Form { split, mt, nt, kb, nbuf, ks } = f;
    let (bm, bn) = if split == 1 { (16 * mt as usize, 8 * nt as usize) } else { (32 * mt as usize, BF_BN) };
    let mut rng = Rng::new(seed);
    let x = randn(&mut rng, m * k, 1.0, x_bf16);
    let w = randn(&mut rng, n * k, 0.1, true);
    let wb = bytes(&w, true);
    let mut want = vec![0f32; m * n];
    reference::linear_bf16(&x, m, &wb, k, n, out_bf16, &mut want);
    let partials = if ks > 1 { SplitKLayout::PARTIALS as u32 } else { 0 };
    let params = LinearBf16GemmParams { arch: 120, m: m as u32, n: n as u32, k: k as u32, segs: 1, c1: 0, c2: 0, c3: 0, split, ks, partials, mt, nt, kb, nbuf, threads: 256, x_bf16: x_bf16 as u32, out_bf16: out_bf16 as u32, norm: 0, nw_bf16: 0, batch: 1, xld: 0, old: 0, woff: 0, xb: 0, wb: 0, ob: 0 };
    let module = Module::parse(&params.render().unwrap(), "linear_bf16_gemm.ptx").unwrap();
    let mut g = GlobalMemory::new();
    let bx = g.alloc_bytes("x", &bytes(&x, x_bf16));
    let bw = g.alloc_bytes("w", &wb);
    let bo = g.alloc("out", m * n * if out_bf16 { 2 } else { 4 });
    let region = g.alloc("split_k_region", SplitKLayout::BYTES as usize);
    // one segment: w1..w3 and out1..out3 repeat w and out
    let mut args: Vec<KernelArg> = [bx, bw, bo, bw, bw, bw, bo, bo, bo, region, bw].iter().map(|&b| KernelArg::U64(g.addr(b))).collect();
    args.push(KernelArg::F32(0.0));
    let (gx, gy) = (n.div_ceil(bn), m.div_ceil(bm));
    let grid = [gx as u32, gy as u32, ks];
    let what = format!("bf16 gemm M={m} N={n} K={k} x_bf16={x_bf16} out_bf16={out_bf16} split={split} mt={mt} nt={nt} kb={kb} nbuf={nbuf} ks={ks}");
    let s = launch(&module, LinearBf16GemmParams::ENTRY, grid, [256, 1, 1], params.dynamic_smem().unwrap(), &args, &mut g).unwrap();
    let out = g.read(bo);
    check(&what, out_bf16, &floats(&out, out_bf16), &want);
    if ks > 1 {
        // every tile's counter is back at zero, and a second launch over the same region (a
        // graph replay) stores the same bits whichever block arrived last
        let counters = g.read(region);
        assert!(counters[..4 * gx * gy].iter().all(|&b| b == 0), "{what}: a tile counter is not back at zero");
        g.write(bo, 0, &vec![0xAB; out.len()]);
        launch(&module, LinearBf16GemmParams::ENTRY, grid, [256, 1, 1], params.dynamic_smem().unwrap(), &args, &mut g).unwrap();
        assert_eq!(g.read(bo), out, "{what}: the replay differs");
    }
    let x_bytes = m * k * if x_bf16 { 2 } else { 4 };
    // K slices: the partials are read once more, and each block's counter
    let bound = (x_bytes * gx + wb.len() * gy + if ks > 1 { ks as usize * m * n * 4 + 4 * gx * gy * ks as usize } else { 0 }) as u64;
    let read = s.global_bytes_read();
    eprintln!("  {read} B read, {:.3} x compulsory, {:.3} x the tiled bound", read as f64 / (x_bytes + wb.len()) as f64, read as f64 / bound as f64);
    assert!(read <= bound, "{read} B read > {bound} B");
    read
}

/// `batch` GEMMs in one launch (grid.z), each reading its x as a K-wide column slice of rows
/// `xld` apart, its W `woff + z * wb` elements into a shared weight buffer and writing its out as
/// an N-wide column slice of rows `old` apart: the attention output projection's shape (every
/// head's context and output inside the token's row, its W_UV inside kv_b). Each GEMM must be
/// the CPU's, and every element outside the slices left as it was.
fn batched_case(m: usize, n: usize, k: usize, batch: usize, x_bf16: bool, out_bf16: bool, seed: u64) {
    let (xld, xb) = (batch * k + 8, k);
    let (woff, wb) = (16 * k, n * k + 8 * k);
    let (old, ob) = (batch * n + 3, n);
    let mut rng = Rng::new(seed);
    let x = randn(&mut rng, m * xld, 1.0, x_bf16);
    let w = randn(&mut rng, woff + batch * wb, 0.1, true);
    let wbytes = bytes(&w, true);
    let os = if out_bf16 { 2 } else { 4 };
    let params = LinearBf16GemmParams { arch: 120, m: m as u32, n: n as u32, k: k as u32, segs: 1, c1: 0, c2: 0, c3: 0, split: 0, ks: 1, partials: 0, mt: 2, nt: 1, kb: 2, nbuf: 3, threads: 256, x_bf16: x_bf16 as u32, out_bf16: out_bf16 as u32, norm: 0, nw_bf16: 0, batch: batch as u32, xld: xld as u32, old: old as u32, woff: woff as u32, xb: xb as u32, wb: wb as u32, ob: ob as u32 };
    let module = Module::parse(&params.render().unwrap(), "linear_bf16_gemm.ptx").unwrap();
    let mut g = GlobalMemory::new();
    let bx = g.alloc_bytes("x", &bytes(&x, x_bf16));
    let bw = g.alloc_bytes("w", &wbytes);
    let bo = g.alloc("out", m * old * os);
    g.write(bo, 0, &vec![0xAB; m * old * os]);
    let region = g.alloc("split_k_region", SplitKLayout::BYTES as usize);
    let mut args: Vec<KernelArg> = [bx, bw, bo, bw, bw, bw, bo, bo, bo, region, bw].iter().map(|&b| KernelArg::U64(g.addr(b))).collect();
    args.push(KernelArg::F32(0.0));
    let grid = [n.div_ceil(BF_BN) as u32, m.div_ceil(64) as u32, batch as u32];
    let what = format!("batched bf16 gemm {batch} x M={m} N={n} K={k} x_bf16={x_bf16} out_bf16={out_bf16}");
    launch(&module, LinearBf16GemmParams::ENTRY, grid, [256, 1, 1], params.dynamic_smem().unwrap(), &args, &mut g).unwrap();
    let out = g.read(bo);
    let mut written = vec![false; m * old];
    for z in 0..batch {
        let xz: Vec<f32> = (0..m * k).map(|i| x[(i / k) * xld + z * xb + i % k]).collect();
        let wz = &wbytes[(woff + z * wb) * 2..(woff + z * wb + n * k) * 2];
        let mut want = vec![0f32; m * n];
        reference::linear_bf16(&xz, m, wz, k, n, out_bf16, &mut want);
        let at = |i: usize| (i / n) * old + z * ob + i % n;
        let got: Vec<u8> = (0..m * n).flat_map(|i| out[at(i) * os..(at(i) + 1) * os].to_vec()).collect();
        (0..m * n).for_each(|i| written[at(i)] = true);
        check(&format!("{what} z={z}"), out_bf16, &floats(&got, out_bf16), &want);
    }
    for (e, _) in written.iter().enumerate().filter(|(_, w)| !**w) {
        assert!(out[e * os..(e + 1) * os].iter().all(|&b| b == 0xAB), "{what}: element {e} outside every GEMM's slice was written");
    }
}

#[test]
fn bf16_gemm_batches_strided_slices_of_wider_rows() {
    // F32 contexts as three BF16 planes (the attention output projection) and BF16 x, ragged
    // M and N, 2 to 3 GEMMs
    batched_case(70, 136, 64, 3, false, true, 710);
    batched_case(33, 40, 48, 2, true, false, 711);
}

#[test]
fn bf16_gemm_matches_the_cpu_on_ragged_shapes() {
    // 64-, 128- and 256-row blocks, stages of 32 and 64 K in rings of 2 to 4 buffers, F32
    // activations split in 3 planes
    let cases = [
        (33, 40, 80, true, true, tiled(2, 2, 3)),
        (50, 72, 272, true, false, tiled(4, 4, 2)),
        (100, 150, 1040, false, true, tiled(2, 2, 3)),
        (33, 130, 8, false, false, tiled(2, 4, 2)),
        (50, 40, 200, false, false, tiled(2, 2, 2)),
        (200, 136, 136, true, true, tiled(4, 2, 4)),
        (130, 40, 72, true, false, tiled(4, 2, 4)),
        (300, 136, 136, true, true, tiled(8, 2, 3)),
        (257, 40, 200, true, false, tiled(8, 2, 3)),
    ];
    for (i, &(m, n, k, x_bf16, out_bf16, f)) in cases.iter().enumerate() {
        bf16_case(m, n, k, x_bf16, out_bf16, f, 600 + i as u64);
    }
}

#[test]
fn split_k_bf16_gemm_matches_the_cpu_for_decode_sized_m() {
    // (M, N, K, x BF16, out BF16, m16 tiles, n8 tiles): K = 16 j + 8 tails, fewer k16 steps than
    // warps, N not a multiple of the block, M = 1, 3, 17, 32, 50, 64.
    let cases = [
        (1, 40, 264, true, true, 1, 4),
        (3, 130, 72, true, false, 1, 2),
        (17, 33, 1032, false, true, 2, 1),
        (32, 72, 520, true, true, 2, 4),
        (17, 24, 8, false, false, 2, 2),
        (50, 40, 200, false, false, 4, 4),
        (64, 48, 136, true, true, 4, 2),
        // several row blocks: 2 of 32 rows (q_a at batch 64), 4 of 16 (the indexer's head
        // weights at batch 64), and a partial last one (50 = 32 + 18)
        (64, 48, 136, true, true, 2, 4),
        (64, 40, 264, true, false, 1, 1),
        (50, 48, 520, false, true, 2, 2),
    ];
    for (i, &(m, n, k, x_bf16, out_bf16, mt, nt)) in cases.iter().enumerate() {
        bf16_case(m, n, k, x_bf16, out_bf16, split(mt, nt), 800 + i as u64);
    }
}

#[test]
fn k_across_blocks_matches_the_cpu_and_replays_the_same_bits() {
    // (M, N, K, x BF16, out BF16, m16 tiles, n8 tiles, K slices): GLM-5's indexer head weights
    // (32 x 6144) and q_a-like rows at batch 1 and 64, a last slice shorter than the others
    // (384 k16 steps over 24 = 16 each; 300 steps over 16: 19, the last 15), K with an 8 tail,
    // F32 activations and outputs, several row blocks.
    let cases = [
        (1, 32, 6144, true, false, 1, 1, 24),
        (1, 72, 6144, true, true, 1, 4, 16),
        (64, 40, 4800, true, true, 4, 1, 16),
        (3, 24, 4104, false, false, 1, 2, 12),
        (50, 48, 2056, false, true, 2, 2, 8),
        (17, 8, 520, true, true, 2, 1, 2),
    ];
    for (i, &(m, n, k, x_bf16, out_bf16, mt, nt, ks)) in cases.iter().enumerate() {
        bf16_case(m, n, k, x_bf16, out_bf16, split_k(mt, nt, ks), 820 + i as u64);
    }
    // The tiled form (M, N, K, x BF16, out BF16, m16 tiles per warp, K slices), its K stages of
    // 32 over the slices: o_proj-like rows at batch 64 (64 stages over 4), a last slice shorter
    // than the others (33 stages over 3: 11 each; over 4: 9, the last 6), M and N past the
    // block, a K tail, F32 activations (three planes) and outputs, two row blocks of 64.
    let tiled_cases = [(64, 300, 2048, true, true, 2, 4), (50, 200, 1040, true, false, 2, 3), (33, 136, 1040, false, true, 2, 4), (100, 72, 776, false, false, 2, 2)];
    for (i, &(m, n, k, x_bf16, out_bf16, mt, ks)) in tiled_cases.iter().enumerate() {
        bf16_case(m, n, k, x_bf16, out_bf16, Form { ks, ..tiled(mt, 2, 3) }, 840 + i as u64);
    }
    // Prefill's 128-row blocks (4 m16 tiles per warp) with K over blocks, as a narrow projection
    // of a long chunk takes them: three row blocks, the last of 4 rows (260 = 2 x 128 + 4), 2
    // column blocks, 6 slices of 33 stages (6 each, the last 3); F32 outputs over 5 slices.
    let prefill_cases = [(260, 136, 1040, true, true, 6), (150, 40, 1552, true, false, 5)];
    for (i, &(m, n, k, x_bf16, out_bf16, ks)) in prefill_cases.iter().enumerate() {
        bf16_case(m, n, k, x_bf16, out_bf16, Form { ks, ..tiled(4, 2, 4) }, 860 + i as u64);
    }
}

/// One launch of a group of BF16 linears of the same x (`SEGS`: weights and outputs side by
/// side in the columns), each output against the CPU's linear under verify's tolerance; with
/// `shift` the launch gets segment 1's first column moved by that many (a mutant), and the
/// result says whether the launch ran and every output matched.
fn bf16_group_case(m: usize, k: usize, members: &[(usize, bool)], x_bf16: bool, f: Form, shift: i32, seed: u64) -> bool {
    let mut rng = Rng::new(seed);
    let x = randn(&mut rng, m * k, 1.0, x_bf16);
    let n: usize = members.iter().map(|&(rows, _)| rows).sum();
    let mut g = GlobalMemory::new();
    let bx = g.alloc_bytes("x", &bytes(&x, x_bf16));
    let (mut ws, mut outs, mut wants, mut starts, mut mask) = (Vec::new(), Vec::new(), Vec::new(), vec![0u32; 4], 0u32);
    let mut col = 0;
    for (s, &(rows, out_bf16)) in members.iter().enumerate() {
        let wb = bytes(&randn(&mut rng, rows * k, 0.1, true), true);
        let mut want = vec![0f32; m * rows];
        reference::linear_bf16(&x, m, &wb, k, rows, out_bf16, &mut want);
        ws.push(g.alloc_bytes(&format!("w{s}"), &wb));
        outs.push(g.alloc(&format!("out{s}"), m * rows * if out_bf16 { 2 } else { 4 }));
        wants.push(want);
        starts[s] = col as u32;
        mask |= (out_bf16 as u32) << s;
        col += rows;
    }
    starts[1] = (starts[1] as i32 + shift) as u32;
    let region = g.alloc("split_k_region", SplitKLayout::BYTES as usize);
    let partials = if f.ks > 1 { SplitKLayout::PARTIALS as u32 } else { 0 };
    let (m32, n32, k32) = (m as u32, n as u32, k as u32);
    let params = LinearBf16GemmParams { arch: 120, m: m32, n: n32, k: k32, segs: members.len() as u32, c1: starts[1], c2: starts[2], c3: starts[3], split: f.split, ks: f.ks, partials, mt: f.mt, nt: f.nt, kb: f.kb, nbuf: f.nbuf, threads: 256, x_bf16: x_bf16 as u32, out_bf16: mask, norm: 0, nw_bf16: 0, batch: 1, xld: 0, old: 0, woff: 0, xb: 0, wb: 0, ob: 0 };
    let module = Module::parse(&params.render().unwrap(), "linear_bf16_gemm.ptx").unwrap();
    let seg = |v: &Vec<_>, s: usize| *v.get(s).unwrap_or(&v[0]);
    let mut args: Vec<KernelArg> = [bx, ws[0], outs[0], seg(&ws, 1), seg(&ws, 2), seg(&ws, 3), seg(&outs, 1), seg(&outs, 2), seg(&outs, 3), region, ws[0]].iter().map(|&b| KernelArg::U64(g.addr(b))).collect();
    args.push(KernelArg::F32(0.0));
    let (bm, bn) = if f.split == 1 { (16 * f.mt as usize, 8 * f.nt as usize) } else { (32 * f.mt as usize, 128) };
    let grid = [n.div_ceil(bn) as u32, m.div_ceil(bm) as u32, f.ks];
    // (a mutant's loads may run past a weight: the emulator's bounds check is a failure too)
    if let Err(e) = launch(&module, LinearBf16GemmParams::ENTRY, grid, [256, 1, 1], params.dynamic_smem().unwrap(), &args, &mut g) {
        eprintln!("{params:?}: {e}");
        return false;
    }
    let counters = g.read(region);
    assert!(counters[..4 * (grid[0] * grid[1]) as usize].iter().all(|&b| b == 0), "a tile counter is not back at zero");
    members.iter().enumerate().all(|(s, &(rows, out_bf16))| {
        let what = format!("group M={m} K={k} member {s} ({rows} rows, out_bf16={out_bf16}) of {members:?} {f:?} shift {shift}");
        let emu = floats(&g.read(outs[s]), out_bf16);
        let c = compare(if out_bf16 { DType::BF16 } else { DType::F32 }, &Values::F32(emu), &Values::F32(wants[s].clone()));
        eprintln!("{what}: max abs {:.3e}, max rel {:.3e}, {} beyond", c.max_abs, c.max_rel, c.beyond + c.non_finite);
        c.ok()
    })
}

#[test]
fn grouped_bf16_linears_match_the_cpu_member_by_member() {
    // GLM-5 tp8 decode groups as lowering forms them: q_a's 256 columns, kv_a's 72, the
    // indexer's wk (128) and head weights (32, F32 out) of the hidden state (K = 6144); q_b's
    // 2,048 and wq_b's 512 of q_a (K = 2048); an n8 tile-aligned but block-straddling boundary
    // (72 with 32-column blocks); a ragged last member; one slice and K over blocks
    let qa = [(256, true), (72, true), (128, true), (32, false)];
    for (i, (m, k, members, x_bf16)) in [
        (1, 6144, &qa[..], true),
        (4, 6144, &qa[..], true),
        (64, 6144, &qa[..], true),
        (1, 2048, &[(2048, true), (512, true)][..], true),
        (3, 520, &[(40, false), (24, true), (13, true)][..], false),
    ]
    .into_iter()
    .enumerate()
    {
        let n: usize = members.iter().map(|&(r, _)| r).sum();
        let (picked, _) = kiln_compiler::passes::lower::bf16_gemm_form(m, n, k, x_bf16, false, &Constants::SM120A);
        let forms = [split_k(picked.mt.max(1), if picked.split == 1 { picked.nt } else { 4 }, picked.ks), split(m.div_ceil(16).min(4) as u32, 4)];
        for f in forms {
            assert!(bf16_group_case(m, k, members, x_bf16, f, 0, 900 + i as u64), "group {i} {f:?} differs from the CPU");
        }
        // the tiled form (its 128-column tiles straddle q_a | kv_a | wk | the head weights: each
        // row and column finds its segment), one K slice and K over blocks
        for f in [tiled(2, 2, 3), Form { ks: 2, ..tiled(2, 2, 3) }] {
            assert!(bf16_group_case(m, k, members, x_bf16, f, 0, 920 + i as u64), "group {i} tiled {f:?} differs from the CPU");
        }
    }
    // mutants: segment 1 starting one n8 tile late (its first columns go to segment 0's
    // weights), or early, must show
    assert!(!bf16_group_case(1, 6144, &qa, true, split_k(1, 4, 12), 8, 950), "a misplaced segment boundary went unnoticed");
    assert!(!bf16_group_case(4, 2048, &[(2048, true), (512, true)], true, split(1, 4), -8, 951), "a misplaced segment boundary went unnoticed");
    assert!(!bf16_group_case(64, 6144, &qa, true, tiled(2, 2, 3), 8, 952), "a misplaced segment boundary in the tiled form went unnoticed");
}

/// A group with a norm in its launch (`NORM`, decode's input and q_a norms): the launch that
/// normalises x itself against the rmsnorm kernel's launch followed by the group's launch over
/// its rows, which it must equal bit for bit (the same sums in the same order), and against the
/// CPU's norm then linears under verify's tolerance (the CPU normalises to the same bits, so the
/// outputs differ only in the GEMM's summation order). `fused_eps` is the epsilon the fused launch gets (a
/// mutant where it is not `EPS`). The result says whether both held.
fn normed_group_case(m: usize, k: usize, members: &[(usize, bool)], nw_bf16: bool, f: Form, fused_eps: f32, seed: u64) -> bool {
    const EPS: f32 = 1e-5;
    let mut rng = Rng::new(seed);
    let x = randn(&mut rng, m * k, 2.0, true);
    let nw = randn(&mut rng, k, 1.0, nw_bf16);
    let n: usize = members.iter().map(|&(rows, _)| rows).sum();
    let mut normed = vec![0f32; m * k];
    reference::rms_norm(&x, None, &nw, EPS, k, true, true, &mut normed);
    let mut g = GlobalMemory::new();
    let bx = g.alloc_bytes("x", &bytes(&x, true));
    let bnw = g.alloc_bytes("norm_weight", &bytes(&nw, nw_bf16));
    let bnormed = g.alloc("normed", m * k * 2);
    let region = g.alloc("split_k_region", SplitKLayout::BYTES as usize);
    let (mut ws, mut wants, mut starts, mut mask) = (Vec::new(), Vec::new(), vec![0u32; 4], 0u32);
    let mut col = 0;
    for (s, &(rows, out_bf16)) in members.iter().enumerate() {
        let wb = bytes(&randn(&mut rng, rows * k, 0.1, true), true);
        let mut want = vec![0f32; m * rows];
        reference::linear_bf16(&normed, m, &wb, k, rows, out_bf16, &mut want);
        ws.push(g.alloc_bytes(&format!("w{s}"), &wb));
        wants.push(want);
        starts[s] = col as u32;
        mask |= (out_bf16 as u32) << s;
        col += rows;
    }
    // the rmsnorm kernel as lowering launches it for one row block
    let norm = RmsnormParams { arch: 120, rows: m as u32, h: k as u32, threads: 256, x_bf16: 1, res: 0, res_bf16: 0, src_bf16: 1, w_bf16: nw_bf16 as u32, out_bf16: 1, cb: 1 };
    let module = Module::parse(&norm.render().unwrap(), "rmsnorm.ptx").unwrap();
    let args = [bx, bx, bnw, bnormed].iter().map(|&b| KernelArg::U64(g.addr(b))).chain([KernelArg::F32(EPS)]).collect::<Vec<_>>();
    launch(&module, RmsnormParams::ENTRY, [m as u32, 1, 1], [256, 1, 1], norm.dynamic_smem().unwrap(), &args, &mut g).unwrap();
    let partials = if f.ks > 1 { SplitKLayout::PARTIALS as u32 } else { 0 };
    let grid = [n.div_ceil(8 * f.nt as usize) as u32, m.div_ceil(16 * f.mt as usize) as u32, f.ks];
    let group = |fused: bool, g: &mut GlobalMemory| -> Vec<Vec<u8>> {
        let params = LinearBf16GemmParams { arch: 120, m: m as u32, n: n as u32, k: k as u32, segs: members.len() as u32, c1: starts[1], c2: starts[2], c3: starts[3], split: 1, ks: f.ks, partials, mt: f.mt, nt: f.nt, kb: 2, nbuf: 2, threads: 256, x_bf16: 1, out_bf16: mask, norm: fused as u32, nw_bf16: nw_bf16 as u32, batch: 1, xld: 0, old: 0, woff: 0, xb: 0, wb: 0, ob: 0 };
        let module = Module::parse(&params.render().unwrap(), "linear_bf16_gemm.ptx").unwrap();
        let outs: Vec<_> = members.iter().enumerate().map(|(s, &(rows, out_bf16))| g.alloc(&format!("out{s}_{fused}"), m * rows * if out_bf16 { 2 } else { 4 })).collect();
        let seg = |v: &Vec<_>, s: usize| *v.get(s).unwrap_or(&v[0]);
        let input = if fused { bx } else { bnormed };
        let ptrs = [input, ws[0], outs[0], seg(&ws, 1), seg(&ws, 2), seg(&ws, 3), seg(&outs, 1), seg(&outs, 2), seg(&outs, 3), region, bnw];
        let args: Vec<KernelArg> = ptrs.iter().map(|&b| KernelArg::U64(g.addr(b))).chain([KernelArg::F32(if fused { fused_eps } else { 0.0 })]).collect();
        launch(&module, LinearBf16GemmParams::ENTRY, grid, [256, 1, 1], params.dynamic_smem().unwrap(), &args, g).unwrap();
        outs.iter().map(|&o| g.read(o)).collect()
    };
    let (apart, fused) = (group(false, &mut g), group(true, &mut g));
    let mut ok = true;
    for (s, &(rows, out_bf16)) in members.iter().enumerate() {
        let dtype = if out_bf16 { DType::BF16 } else { DType::F32 };
        let c = compare(dtype, &Values::F32(floats(&fused[s], out_bf16)), &Values::F32(wants[s].clone()));
        let same = fused[s] == apart[s];
        eprintln!("normed group M={m} K={k} member {s} ({rows} rows) {f:?} nw_bf16={nw_bf16} eps {fused_eps}: the norm launch's bits {same}; vs the CPU max rel {:.3e}, {} beyond", c.max_rel, c.beyond + c.non_finite);
        ok &= same && c.ok();
    }
    ok
}

#[test]
fn normed_groups_equal_the_norm_launch_then_the_group_and_match_the_cpu() {
    // GLM-5 tp8: the input norm before q_a, kv_a and the indexer's wk and head weights (K =
    // 6144) at batch 1 and 2 as lowering picks them, q_a's norm before q_b and wq_b (K = 2048),
    // several row blocks and rows past M, an F32 norm weight, one K slice, K with an 8 tail
    let qa = [(256, true), (72, true), (128, true), (32, false)];
    let qb = [(2048, true), (512, true)];
    for (i, (m, k, members, nw_bf16, f)) in [
        (1, 6144, &qa[..], true, split_k(1, 4, 12)),
        (2, 6144, &qa[..], true, split_k(1, 4, 12)),
        (1, 2048, &qb[..], true, split_k(1, 4, 3)),
        (20, 520, &[(40, false), (24, true), (13, true)][..], false, split_k(1, 2, 4)),
        (3, 1032, &[(16, true), (8, false)][..], true, split(1, 1)),
        (40, 264, &[(16, true), (8, true)][..], true, split_k(2, 1, 2)),
    ]
    .into_iter()
    .enumerate()
    {
        assert!(normed_group_case(m, k, members, nw_bf16, f, 1e-5, 960 + i as u64), "normed group {i} differs");
    }
    // a fused launch given another epsilon must not pass for the norm's
    assert!(!normed_group_case(1, 2048, &qb, true, split_k(1, 4, 3), 1e-1, 970), "the fused norm ignored its epsilon");
}

/// (registers, spill bytes, static smem) of one rendered kernel.
fn assemble(ptxas: &std::path::Path, name: &str, ptx: &str) -> (u32, u32, u32) {
    let r = common::assemble(ptxas, name, ptx).unwrap_or_else(|e| panic!("{e}"));
    (r.registers, r.spill_store_bytes + r.spill_load_bytes, r.smem_static_bytes)
}

#[test]
fn glm5_prefill_shapes_assemble_without_spills() {
    let Some(ptxas) = common::ptxas("the GEMMs") else { return };
    let mut kernels: Vec<(String, String, u32)> = Vec::new();
    // NVFP4 tp8: dense MLP / shared expert gate+up (K 6144 -> 2 x 1536 or 2 x 256), down projections
    // (K 1536 or 256 -> 6144), q_a / o_proj sized single and two-part linears; tiny shapes too.
    for (arch, m) in [120, 90].into_iter().flat_map(|a| [1usize, 16, 32, 33, 2048, 8192].map(|m| (a, m))) {
        for &(k, parts, silu) in &[(6144, &[1536, 1536][..], true), (6144, &[256, 256][..], true), (1536, &[6144][..], false), (256, &[6144][..], false), (6144, &[2048][..], false), (2048, &[6144][..], false), (6144, &[1536, 576][..], false), (80, &[40, 150][..], false), (272, &[72, 72][..], true)] {
            for (x_bf16, out_bf16) in [(true, true), (false, false)] {
                // as lowering picks them (188 SMs; sm_90a's larger stages: one buffer fewer)
                let widest = parts.iter().copied().max().unwrap();
                let ((split, mt, nt, slices), _) = nvfp4_gemm_form(m, widest, k, silu, x_bf16, &Constants::SM120A);
                let form = if split == 1 { nv_split_k(mt, nt, slices) } else { nv_tiled(1, if silu { 3 } else { 4 } - (arch == 90) as u32) };
                for (p, _) in nvfp4_launches(arch, m, k, parts, silu, x_bf16, out_bf16, form) {
                    let name = format!("nvfp4_sm{arch}_m{m}_k{k}_rows{}_silu{}_x{}_o{}_{form:?}", p.rows, p.silu, p.x_bf16, p.out_bf16).replace([' ', ',', '{', '}', ':'], "");
                    kernels.push((name, p.render().unwrap(), p.dynamic_smem().unwrap()));
                }
            }
        }
    }
    // BF16: q_a (6144 -> 2048), o_proj (2048 -> 6144), kv_a (6144 -> 576), lm_head (6144 -> 154880 / 8),
    // the MTP layer's eh_proj halves at TP 8 (6144 -> 768, F32 out).
    for (arch, m) in [120, 90].into_iter().flat_map(|a| [1u32, 16, 32, 33, 64, 2048, 8192].map(|m| (a, m))) {
        for &(n, k) in &[(2048u32, 6144u32), (6144, 2048), (576, 6144), (19360, 6144), (768, 6144), (40, 80), (150, 1040)] {
            for (x_bf16, out_bf16) in [(1, 1), (1, 0), (0, 0)] {
                // as lowering picks them (188 SMs)
                let (picked, _) = bf16_gemm_form(m as usize, n as usize, k as usize, x_bf16 == 1, out_bf16 == 0, &Constants::SM120A);
                let f = if picked.split == 1 {
                    split_k(picked.mt, picked.nt, picked.ks)
                } else if picked.mt == 8 {
                    tiled(8, 2, 3)
                } else if picked.mt == 4 {
                    Form { ks: picked.ks, ..tiled(4, 2, 4) }
                } else {
                    Form { ks: picked.ks, ..tiled(2, 2, 3) }
                };
                let partials = if f.ks > 1 { SplitKLayout::PARTIALS as u32 } else { 0 };
                let p = LinearBf16GemmParams { arch, m, n, k, segs: 1, c1: 0, c2: 0, c3: 0, split: f.split, ks: f.ks, partials, mt: f.mt, nt: f.nt, kb: f.kb, nbuf: f.nbuf, threads: 256, x_bf16, out_bf16, norm: 0, nw_bf16: 0, batch: 1, xld: 0, old: 0, woff: 0, xb: 0, wb: 0, ob: 0 };
                kernels.push((format!("bf16_sm{arch}_m{m}_n{n}_k{k}_x{x_bf16}_o{out_bf16}_s{}_mt{}_nt{}_kb{}_nbuf{}_ks{}", f.split, f.mt, f.nt, f.kb, f.nbuf, f.ks), p.render().unwrap(), p.dynamic_smem().unwrap()));
            }
        }
    }
    // BF16 decode groups (tp8): q_a | kv_a | wk | head weights (F32) of K = 6144, q_b | wq_b of 2048
    for (arch, m) in [120, 90].into_iter().flat_map(|a| [1u32, 4, 16, 64].map(|m| (a, m))) {
        for (k, starts, n, mask) in [(6144u32, [256u32, 328, 456], 488u32, 7u32), (2048, [2048, 0, 0], 2560, 3)] {
            let segs = if starts[1] == 0 { 2 } else { 4 };
            // the form lowering picks (a tiled one with its ring as lowering sizes it at mt 2)
            let (picked, _) = kiln_compiler::passes::lower::bf16_group_form(m as usize, n as usize, k as usize, true, None, segs == 2, &Constants::SM120A).unwrap();
            for f in [if picked.split == 1 { split_k(picked.mt, picked.nt, picked.ks) } else { Form { ks: picked.ks, ..tiled(2, 2, 3) } }] {
                let partials = if f.ks > 1 { SplitKLayout::PARTIALS as u32 } else { 0 };
                let p = LinearBf16GemmParams { arch, m, n, k, segs, c1: starts[0], c2: starts[1], c3: starts[2], split: f.split, ks: f.ks, partials, mt: f.mt, nt: f.nt, kb: f.kb, nbuf: f.nbuf, threads: 256, x_bf16: 1, out_bf16: mask, norm: 0, nw_bf16: 0, batch: 1, xld: 0, old: 0, woff: 0, xb: 0, wb: 0, ob: 0 };
                kernels.push((format!("bf16group_sm{arch}_m{m}_n{n}_k{k}_s{}_segs{segs}_mt{}_nt{}_ks{}", f.split, f.mt, f.nt, f.ks), p.render().unwrap(), p.dynamic_smem().unwrap()));
            }
        }
    }
    // (instances, fewest and most registers, least and most shared memory) per form
    let mut forms: std::collections::BTreeMap<String, (usize, u32, u32, u32, u32)> = Default::default();
    for (name, ptx, dynamic) in &kernels {
        let (regs, spills, smem) = assemble(&ptxas, name, ptx);
        assert_eq!(spills, 0, "{name} spills");
        assert!(regs <= 255, "{name}: {regs} registers");
        assert!(smem + dynamic <= 101_376, "{name}: {smem} + {dynamic} B shared memory");
        let split = name.contains("split1") || name.contains("_s1_");
        let mut words = name.split('_');
        let form = format!("{} {} {}", words.next().unwrap(), if split { "split-K" } else { "tiled" }, common::target_of(ptx).name());
        let e = forms.entry(form).or_insert((0, u32::MAX, 0, u32::MAX, 0));
        *e = (e.0 + 1, e.1.min(regs), e.2.max(regs), e.3.min(smem + dynamic), e.4.max(smem + dynamic));
    }
    for (form, (n, r0, r1, s0, s1)) in forms {
        eprintln!("{form}: {n} instances assemble, 0 spills, {r0}..{r1} registers, {s0}..{s1} B shared memory");
    }
}
