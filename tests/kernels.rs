//! Kernel templates against the CPU reference: every family rendered for ragged shapes (N and K
//! not multiples of the tiles, M = 1, 3, 17), run on the PTX emulator, compared with the CPU
//! backend's op under `kiln verify`'s tolerances; the decode NVFP4 GEMV reads each weight byte
//! once (global bytes read / compulsory bytes <= 1.10).

use kiln_compiler::kernels::{LinearBf16GemvParams, LinearNvfp4GemvParams, RmsnormParams, TEMPLATES};
use kiln_compiler::passes::lower::{TASKS_PER_BLOCK, THREADS};
use kiln_runtime::cpu::reference;
use kiln_runtime::emu::{launch, GlobalMemory, KernelArg, LaunchStats, Module};
use kiln_runtime::numerics::{bf16_to_f32, f32_to_bf16, quantize_nvfp4, round_bf16};
use kiln_runtime::plan::{DType, Epilogue};
use kiln_runtime::rng::Rng;
use kiln_runtime::verify::{compare, Values};

fn randn(rng: &mut Rng, n: usize, scale: f64, bf16: bool) -> Vec<f32> {
    (0..n).map(|_| (rng.normal() * scale) as f32).map(|v| if bf16 { round_bf16(v) } else { v }).collect()
}

fn bytes(v: &[f32], bf16: bool) -> Vec<u8> {
    if bf16 {
        v.iter().flat_map(|&f| f32_to_bf16(f).to_le_bytes()).collect()
    } else {
        v.iter().flat_map(|f| f.to_le_bytes()).collect()
    }
}

fn floats(b: &[u8], bf16: bool) -> Vec<f32> {
    if bf16 {
        b.chunks_exact(2).map(|c| bf16_to_f32(u16::from_le_bytes([c[0], c[1]]))).collect()
    } else {
        b.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
    }
}

fn check(what: &str, bf16: bool, emu: &[f32], cpu: &[f32]) {
    let c = compare(if bf16 { DType::BF16 } else { DType::F32 }, &Values::F32(emu.to_vec()), &Values::F32(cpu.to_vec()));
    eprintln!("{what}: max abs {:.3e}, max rel {:.3e} over {} values", c.max_abs, c.max_rel, c.elements);
    assert!(c.ok(), "{what}: {} of {} values beyond tolerance (max abs {:e}, max rel {:e})", c.beyond + c.non_finite, c.elements, c.max_abs, c.max_rel);
}

struct Nvfp4Case {
    m: usize,
    parts: Vec<usize>,
    k: usize,
    silu: bool,
    x_bf16: bool,
    out_bf16: bool,
    /// Different input scales per part (else shared, as gate/up of one MLP).
    split_scales: bool,
}

/// Runs one NVFP4 GEMV on the emulator and the CPU; returns the launch stats and compulsory bytes.
fn nvfp4_case(c: &Nvfp4Case, seed: u64) -> (LaunchStats, u64) {
    let mut rng = Rng::new(seed);
    let (m, k) = (c.m, c.k);
    let n: usize = c.parts.iter().sum();
    let x = randn(&mut rng, m * k, 1.5, c.x_bf16);
    let (mut packed, mut scales, mut s2) = (Vec::new(), Vec::new(), Vec::new());
    for &rows in &c.parts {
        let w = randn(&mut rng, rows * k, 0.05, false);
        let (p, s, g) = quantize_nvfp4(&w, rows, k);
        packed.extend(p);
        scales.extend(s);
        s2.push(g);
    }
    let amax = x.iter().fold(0f32, |a, v| a.max(v.abs()));
    let input_scale: Vec<f32> = (0..c.parts.len()).map(|p| amax / (6.0 * 448.0) * if c.split_scales { 1.0 + p as f32 * 0.37 } else { 1.0 }).collect();
    let tasks = if c.silu { c.parts[0] } else { n };
    let mut want = vec![0f32; m * tasks];
    let epilogue = if c.silu { Epilogue::SiluMul } else { Epilogue::None };
    reference::linear_nvfp4(&x, m, &packed, &scales, k, &c.parts, &s2, &input_scale, epilogue, c.out_bf16, &mut want);

    let params = LinearNvfp4GemvParams {
        arch: 120,
        m: m as u32,
        n: n as u32,
        k: k as u32,
        n0: c.parts[0] as u32,
        parts: c.parts.len() as u32,
        silu: c.silu as u32,
        tasks: tasks as u32,
        tasks_per_block: TASKS_PER_BLOCK,
        threads: THREADS,
        x_bf16: c.x_bf16 as u32,
        out_bf16: c.out_bf16 as u32,
    };
    let module = Module::parse(&params.render().unwrap(), "linear_nvfp4_gemv.ptx").unwrap();
    let mut g = GlobalMemory::new();
    let bx = g.alloc_bytes("x", &bytes(&x, c.x_bf16));
    let bw = g.alloc_bytes("w", &packed);
    let bs = g.alloc_bytes("sf", &scales);
    let b2 = g.alloc_f32("scale_2", &s2);
    let bi = g.alloc_f32("input_scale", &input_scale);
    let bo = g.alloc("out", m * tasks * if c.out_bf16 { 2 } else { 4 });
    let args: Vec<KernelArg> = [bx, bw, bs, b2, bi, bo].iter().map(|&b| KernelArg::U64(g.addr(b))).collect();
    let grid = (tasks as u32).div_ceil(TASKS_PER_BLOCK);
    let stats = launch(&module, LinearNvfp4GemvParams::ENTRY, [grid, 1, 1], [THREADS, 1, 1], params.dynamic_smem().unwrap(), &args, &mut g).unwrap();
    let got = floats(&g.read(bo), c.out_bf16);
    check(&format!("nvfp4 gemv M={m} parts={:?} K={k} silu={}", c.parts, c.silu), c.out_bf16, &got, &want);
    if k == 16 && !c.silu {
        // One block per row: both sides sum the same exact products once, so any difference
        // would be a different activation code or scale. The quantisation must match bit for bit.
        assert_eq!(got.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), want.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), "K = 16 must be bit-exact");
    }
    let compulsory = (m * k * if c.x_bf16 { 2 } else { 4 } + packed.len() + scales.len() + 8 * c.parts.len()) as u64;
    (stats, compulsory)
}

#[test]
fn every_family_has_its_template() {
    assert_eq!(TEMPLATES, &["linear_bf16_gemv", "linear_nvfp4_gemv", "rmsnorm"]);
}

#[test]
fn nvfp4_gemv_matches_the_cpu_on_ragged_shapes() {
    let cases = [
        // one part, K/16 = 33 blocks (one more than the lanes), N not a multiple of 64
        Nvfp4Case { m: 1, parts: vec![130], k: 528, silu: false, x_bf16: true, out_bf16: true, split_scales: false },
        // gate/up with SiLU-mul, M = 3
        Nvfp4Case { m: 3, parts: vec![40, 40], k: 160, silu: true, x_bf16: true, out_bf16: true, split_scales: false },
        // SiLU-mul with different input scales per part, f32 in and out
        Nvfp4Case { m: 3, parts: vec![72, 72], k: 48, silu: true, x_bf16: false, out_bf16: false, split_scales: true },
        // two concatenated parts of different sizes, M = 17
        Nvfp4Case { m: 17, parts: vec![33, 70], k: 80, silu: false, x_bf16: true, out_bf16: true, split_scales: true },
        Nvfp4Case { m: 17, parts: vec![65], k: 16, silu: false, x_bf16: true, out_bf16: false, split_scales: false },
    ];
    for (i, c) in cases.iter().enumerate() {
        nvfp4_case(c, 100 + i as u64);
    }
}

#[test]
fn decode_nvfp4_gemv_reads_each_weight_byte_once() {
    // Small shapes, and a GLM-5 tp8 decode shape (a 6144 -> 1536 projection slice).
    for (parts, k, silu) in [(vec![512], 1024, false), (vec![256, 256], 1024, true), (vec![1536], 6144, false)] {
        let c = Nvfp4Case { m: 1, parts, k, silu, x_bf16: true, out_bf16: true, split_scales: false };
        let (stats, compulsory) = nvfp4_case(&c, 7);
        let ratio = stats.global_bytes_read() as f64 / compulsory as f64;
        eprintln!("decode NVFP4 GEMV N={} K={k} silu={silu}: {} B read / {compulsory} B compulsory = {ratio:.3}", c.parts.iter().sum::<usize>(), stats.global_bytes_read());
        assert!(ratio <= 1.10, "byte ratio {ratio}");
        assert!(ratio >= 1.0, "read less than the weights? {ratio}");
    }
}

#[test]
fn bf16_gemv_matches_the_cpu_on_ragged_shapes() {
    for (i, &(m, n, k, x_bf16, out_bf16)) in [(1, 70, 264, true, true), (3, 130, 72, true, false), (17, 33, 520, false, true), (1, 200, 8, false, false)].iter().enumerate() {
        let mut rng = Rng::new(200 + i as u64);
        let x = randn(&mut rng, m * k, 1.0, x_bf16);
        let w = randn(&mut rng, n * k, 0.1, true);
        let wb = bytes(&w, true);
        let mut want = vec![0f32; m * n];
        reference::linear_bf16(&x, m, &wb, k, n, out_bf16, &mut want);
        let params = LinearBf16GemvParams { arch: 120, m: m as u32, n: n as u32, k: k as u32, tasks_per_block: TASKS_PER_BLOCK, threads: THREADS, x_bf16: x_bf16 as u32, out_bf16: out_bf16 as u32 };
        let module = Module::parse(&params.render().unwrap(), "linear_bf16_gemv.ptx").unwrap();
        let mut g = GlobalMemory::new();
        let bx = g.alloc_bytes("x", &bytes(&x, x_bf16));
        let bw = g.alloc_bytes("w", &wb);
        let bo = g.alloc("out", m * n * if out_bf16 { 2 } else { 4 });
        let args: Vec<KernelArg> = [bx, bw, bo].iter().map(|&b| KernelArg::U64(g.addr(b))).collect();
        launch(&module, LinearBf16GemvParams::ENTRY, [(n as u32).div_ceil(TASKS_PER_BLOCK), 1, 1], [THREADS, 1, 1], params.dynamic_smem().unwrap(), &args, &mut g).unwrap();
        check(&format!("bf16 gemv M={m} N={n} K={k}"), out_bf16, &floats(&g.read(bo), out_bf16), &want);
    }
}

#[test]
fn rmsnorm_matches_the_cpu_with_and_without_residual() {
    for (i, &(rows, h, res, x_bf16, out_bf16)) in [(1, 200, false, true, true), (3, 1000, true, true, true), (17, 72, true, false, false), (17, 33, false, false, true)].iter().enumerate() {
        let mut rng = Rng::new(300 + i as u64);
        let x = randn(&mut rng, rows * h, 2.0, x_bf16);
        let w = randn(&mut rng, h, 1.0, true);
        let res_bf16 = x_bf16;
        let residual = randn(&mut rng, rows * h, 3.0, res_bf16);
        let mut want = vec![0f32; rows * h];
        let mut want_res = residual.clone();
        reference::rms_norm(&x, res.then_some((&mut want_res[..], res_bf16)), &w, 1e-6, h, x_bf16, out_bf16, &mut want);
        let params = RmsnormParams {
            arch: 120,
            rows: rows as u32,
            h: h as u32,
            threads: THREADS,
            x_bf16: x_bf16 as u32,
            res: res as u32,
            res_bf16: res_bf16 as u32,
            src_bf16: if res { res_bf16 } else { x_bf16 } as u32,
            w_bf16: 1,
            out_bf16: out_bf16 as u32,
        };
        let module = Module::parse(&params.render().unwrap(), "rmsnorm.ptx").unwrap();
        let mut g = GlobalMemory::new();
        let bx = g.alloc_bytes("x", &bytes(&x, x_bf16));
        let br = g.alloc_bytes("residual", &bytes(&residual, res_bf16));
        let bw = g.alloc_bytes("weight", &bytes(&w, true));
        let bo = g.alloc("out", rows * h * if out_bf16 { 2 } else { 4 });
        let args = vec![KernelArg::U64(g.addr(bx)), KernelArg::U64(g.addr(br)), KernelArg::U64(g.addr(bw)), KernelArg::U64(g.addr(bo)), KernelArg::F32(1e-6)];
        launch(&module, RmsnormParams::ENTRY, [rows as u32, 1, 1], [THREADS, 1, 1], params.dynamic_smem().unwrap(), &args, &mut g).unwrap();
        check(&format!("rmsnorm rows={rows} H={h} residual={res}"), out_bf16, &floats(&g.read(bo), out_bf16), &want);
        if res {
            check("rmsnorm residual", res_bf16, &floats(&g.read(br), res_bf16), &want_res);
        }
    }
}
