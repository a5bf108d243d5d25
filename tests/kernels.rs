//! Kernel templates against the CPU reference: every family rendered for ragged shapes (N and K
//! not multiples of the tiles, M = 1, 3, 17), run on the PTX emulator, compared with the CPU
//! backend's op under `kiln verify`'s tolerances; the decode NVFP4 GEMV reads each weight byte
//! once (global bytes read / compulsory bytes <= 1.10). The copies (add, gather_rows, embed on
//! every rank of a split vocabulary) are bit-exact; the router's expert ids are exact.
//!
//! The NVFP4 GEMV runs for both targets: the sm_90a form (e2m1 by integer and float ops instead
//! of cvt) forms the same exact products and sums them in the same order, so beyond matching the
//! CPU it must equal the sm_120a form bit for bit.

mod common;
use common::{bytes, check, floats, randn};
use kiln_compiler::kernels::{AddParams, EmbedArgs, EmbedParams, GatherRowsParams, Ptr, RouterParams, LinearBf16GemvParams, LinearNvfp4GemvParams, RmsnormParams, TEMPLATES};
use kiln_compiler::passes::lower::{ELEMENTWISE_MAX_GRID, MIN_TASKS_PER_BLOCK, TASKS_PER_BLOCK, THREADS};
use kiln_runtime::cpu::reference;
use kiln_runtime::emu::{launch, GlobalMemory, KernelArg, LaunchStats, Module};
use kiln_runtime::rng::Rng;

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

/// The bit patterns of `v`, for bit-exact comparisons with readable failures.
fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// Runs one NVFP4 GEMV for `arch` (120 or 90) on the emulator and the CPU; returns the launch
/// stats, compulsory bytes and the output.
fn nvfp4_case(c: &Nvfp4Case, arch: u32, seed: u64) -> (LaunchStats, u64, Vec<f32>) {
    let mut rng = Rng::new(seed);
    let (m, k) = (c.m, c.k);
    let n: usize = c.parts.iter().sum();
    let x = randn(&mut rng, m * k, 1.5, c.x_bf16);
    let common::Nvfp4Linear { packed, scales, scale_2: s2, input_scale, want } = common::nvfp4_linear(&mut rng, &x, m, k, &c.parts, c.silu, c.split_scales, 1.0, c.out_bf16);
    let tasks = if c.silu { c.parts[0] } else { n };

    let params = LinearNvfp4GemvParams {
        arch,
        m: m as u32,
        n: n as u32,
        k: k as u32,
        n0: c.parts[0] as u32,
        parts: c.parts.len() as u32,
        silu: c.silu as u32,
        tasks: tasks as u32,
        tasks_per_block: TASKS_PER_BLOCK,
        unroll: 4,
        threads: THREADS,
        x_bf16: c.x_bf16 as u32,
        out_bf16: c.out_bf16 as u32,
    };
    let (stats, got) = run_gemv(&params, &bytes(&x, c.x_bf16), &packed, &scales, &s2, &input_scale);
    check(&format!("nvfp4 gemv sm_{arch}a M={m} parts={:?} K={k} silu={}", c.parts, c.silu), c.out_bf16, &got, &want);
    // One column per warp (what decode batch 1 compiles to) computes every column as eight do.
    let narrow = LinearNvfp4GemvParams { tasks_per_block: MIN_TASKS_PER_BLOCK, ..params };
    let (_, got_narrow) = run_gemv(&narrow, &bytes(&x, c.x_bf16), &packed, &scales, &s2, &input_scale);
    assert_eq!(bits(&got_narrow), bits(&got), "sm_{arch}a: {MIN_TASKS_PER_BLOCK} columns per block differ from {TASKS_PER_BLOCK}");
    // Loading 1 or 3 blocks ahead instead of 4 changes when loads are issued, never what is summed.
    for unroll in [1, 3] {
        let (_, got_unroll) = run_gemv(&LinearNvfp4GemvParams { unroll, ..params }, &bytes(&x, c.x_bf16), &packed, &scales, &s2, &input_scale);
        assert_eq!(bits(&got_unroll), bits(&got), "sm_{arch}a: unroll {unroll} differs from 4");
    }
    // 2, 4 and 8 warps sharing a task (few tasks at batch 1) sum in another order: held to the CPU
    for per_block in [4, 2, 1] {
        let shared = LinearNvfp4GemvParams { tasks_per_block: per_block, unroll: 3, ..params };
        let (_, got_shared) = run_gemv(&shared, &bytes(&x, c.x_bf16), &packed, &scales, &s2, &input_scale);
        check(&format!("nvfp4 gemv sm_{arch}a M={m} parts={:?} K={k} silu={}, {} warps per task", c.parts, c.silu, MIN_TASKS_PER_BLOCK / per_block), c.out_bf16, &got_shared, &want);
    }
    if k == 16 && !c.silu {
        // One block per row: both sides sum the same exact products once, so any difference
        // would be a different activation code or scale. The quantisation must match bit for bit.
        assert_eq!(bits(&got), bits(&want), "K = 16 must be bit-exact");
    }
    let compulsory = (m * k * if c.x_bf16 { 2 } else { 4 } + packed.len() + scales.len() + 8 * c.parts.len()) as u64;
    (stats, compulsory, got)
}

/// One launch of an NVFP4 GEMV instance on the emulator: its stats and output.
fn run_gemv(params: &LinearNvfp4GemvParams, x: &[u8], packed: &[u8], scales: &[u8], s2: &[f32], input_scale: &[f32]) -> (LaunchStats, Vec<f32>) {
    let module = Module::parse(&params.render().unwrap(), "linear_nvfp4_gemv.ptx").unwrap();
    let mut g = GlobalMemory::new();
    let bx = g.alloc_bytes("x", x);
    let bw = g.alloc_bytes("w", packed);
    let bs = g.alloc_bytes("sf", scales);
    let b2 = g.alloc_f32("scale_2", s2);
    let bi = g.alloc_f32("input_scale", input_scale);
    let bo = g.alloc("out", (params.m * params.tasks) as usize * if params.out_bf16 == 1 { 2 } else { 4 });
    let args: Vec<KernelArg> = [bx, bw, bs, b2, bi, bo].iter().map(|&b| KernelArg::U64(g.addr(b))).collect();
    let grid = params.tasks.div_ceil(params.tasks_per_block);
    let stats = launch(&module, LinearNvfp4GemvParams::ENTRY, [grid, 1, 1], [THREADS, 1, 1], params.dynamic_smem().unwrap(), &args, &mut g).unwrap();
    (stats, floats(&g.read(bo), params.out_bf16 == 1))
}

/// The activation quantisation at its edges, one 16-value block per row (K = 16, so each output
/// is one exact block sum and must equal the CPU's bit for bit): values on every e2m1 rounding
/// tie and just beside them, both signs, saturation past 6, +-inf (block scale saturates at 448),
/// NaN (code +6, left out of the block maximum), an all-zero block (scale 0), subnormal block
/// scales, and f32 subnormal inputs. On sm_90a the rounding is the float-op emulation of cvt.
#[test]
fn nvfp4_gemv_quantises_edge_values_like_the_cpu() {
    let (inf, nan) = (f32::INFINITY, f32::NAN);
    let rows: [[f32; 16]; 8] = [
        [6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -6.0, -0.25, -0.75, -1.25, -1.75, -2.5, -3.5, -5.0],
        [6.0, 0.2499, 0.2501, 0.7499, 0.7501, 1.2499, 1.2501, 1.7499, 1.7501, 2.4999, 2.5001, 3.4999, 3.5001, 4.9999, 5.0001, 5.9],
        [12.0, 7.0, -9.0, 11.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0],
        [inf, 1.0, -2.0, 3.0, 448.0, 1000.0, -inf, 0.1, 2688.0, 2687.0, -5000.0, 0.0, -0.0, 1e-3, 6.0, 7.0],
        [nan, 1.0, 2.0, 3.0, 6.0, -0.7, 0.3, 5.5, -nan, 4.5, 0.0, 1.0, 2.0, 3.0, 4.0, 5.0],
        [0.0; 16],
        [3e-6, -1e-6, 2e-6, 5e-7, 1e-7, -3e-6, 0.0, 2.5e-6, 1.5e-6, -2e-6, 1e-6, 7e-7, -4e-7, 2e-7, 6e-7, 9e-7],
        [1e-40, -2e-40, 3e-41, 5e-39, 0.0, -1e-39, 2e-39, 1e-38, -5e-39, 4e-39, 3e-39, -2e-39, 1e-39, 6e-39, -7e-39, 8e-39],
    ];
    let (m, k, n) = (rows.len(), 16, 40);
    let x: Vec<f32> = rows.iter().flatten().copied().collect();
    let mut rng = Rng::new(5);
    let w = randn(&mut rng, n * k, 0.05, false);
    let (packed, scales, s2) = kiln_runtime::numerics::quantize_nvfp4(&w, n, k);
    // input_scale 1 (inv 1) puts the first rows' blocks at scale 1: their values are the ties
    for input_scale in [1.0f32, 1e-7] {
        let mut want = vec![0f32; m * n];
        reference::linear_nvfp4(&x, m, &packed, &scales, k, &[n], &[s2], &[input_scale], kiln_runtime::plan::Epilogue::None, false, &mut want);
        for arch in [120, 90] {
            let params = LinearNvfp4GemvParams { arch, m: m as u32, n: n as u32, k: k as u32, n0: n as u32, parts: 1, silu: 0, tasks: n as u32, tasks_per_block: TASKS_PER_BLOCK, unroll: 4, threads: THREADS, x_bf16: 0, out_bf16: 0 };
            let (_, got) = run_gemv(&params, &bytes(&x, false), &packed, &scales, &[s2], &[input_scale]);
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                assert!(g.to_bits() == w.to_bits(), "sm_{arch}a input_scale {input_scale}: row {} column {}: {g} vs the CPU's {w}", i / n, i % n);
            }
        }
    }
}

#[test]
fn every_family_has_its_template() {
    assert_eq!(
        TEMPLATES,
        &[
            "add",
            "embed",
            "gather_rows",
            "indexer_topk",
            "kv_cache_write",
            "linear_bf16_gemm",
            "linear_bf16_gemv",
            "linear_nvfp4_gemm",
            "linear_nvfp4_gemv",
            "mla_attention",
            "mla_split",
            "moe_down",
            "moe_gate_up",
            "p2p_collective",
            "rmsnorm",
            "router"
        ]
    );
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
        let (_, _, sm120) = nvfp4_case(c, 120, 100 + i as u64);
        let (_, _, sm90) = nvfp4_case(c, 90, 100 + i as u64);
        assert_eq!(bits(&sm90), bits(&sm120), "sm_90a differs from sm_120a");
    }
}

#[test]
fn decode_nvfp4_gemv_reads_each_weight_byte_once() {
    // Small shapes, and a GLM-5 tp8 decode shape (a 6144 -> 1536 projection slice).
    for (parts, k, silu) in [(vec![512], 1024, false), (vec![256, 256], 1024, true), (vec![1536], 6144, false)] {
        let c = Nvfp4Case { m: 1, parts, k, silu, x_bf16: true, out_bf16: true, split_scales: false };
        let (stats, compulsory, _) = nvfp4_case(&c, 120, 7);
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
        let mut outputs = Vec::new();
        // Columns per block and chunks loaded ahead (partial trips at these K) change the
        // schedule, never the sums.
        // a warp per column (wide and narrow blocks), then 2, 4 and 8 warps sharing a column
        for (tasks_per_block, unroll) in [(TASKS_PER_BLOCK, 4), (MIN_TASKS_PER_BLOCK, 1), (MIN_TASKS_PER_BLOCK, 3), (4, 4), (2, 2), (1, 3)] {
            let wpc = (MIN_TASKS_PER_BLOCK / tasks_per_block).max(1);
            let params = LinearBf16GemvParams { arch: 120, m: m as u32, n: n as u32, k: k as u32, tasks_per_block, unroll, threads: THREADS, x_bf16: x_bf16 as u32, out_bf16: out_bf16 as u32 };
            let module = Module::parse(&params.render().unwrap(), "linear_bf16_gemv.ptx").unwrap();
            let mut g = GlobalMemory::new();
            let bx = g.alloc_bytes("x", &bytes(&x, x_bf16));
            let bw = g.alloc_bytes("w", &wb);
            let bo = g.alloc("out", m * n * if out_bf16 { 2 } else { 4 });
            let args: Vec<KernelArg> = [bx, bw, bo].iter().map(|&b| KernelArg::U64(g.addr(b))).collect();
            launch(&module, LinearBf16GemvParams::ENTRY, [(n as u32).div_ceil(tasks_per_block), 1, 1], [THREADS, 1, 1], params.dynamic_smem().unwrap(), &args, &mut g).unwrap();
            let got = floats(&g.read(bo), out_bf16);
            check(&format!("bf16 gemv M={m} N={n} K={k} {tasks_per_block} columns per block, {wpc} warps per column, {unroll} ahead"), out_bf16, &got, &want);
            // (warps sharing a column sum in another order: held to the CPU only)
            if wpc == 1 {
                outputs.push(bits(&got));
            }
        }
        assert!(outputs.iter().all(|o| *o == outputs[0]), "bf16 gemv M={m} N={n} K={k}: the column count per block or the loads ahead changed the numbers");
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
            cb: 1,
        };
        let module = Module::parse(&params.render().unwrap(), "rmsnorm.ptx").unwrap();
        let mut g = GlobalMemory::new();
        let bx = g.alloc_bytes("x", &bytes(&x, x_bf16));
        let br = g.alloc_bytes("residual", &bytes(&residual, res_bf16));
        let bw = g.alloc_bytes("weight", &bytes(&w, true));
        let bo = g.alloc("out", rows * h * if out_bf16 { 2 } else { 4 });
        let args = vec![KernelArg::U64(g.addr(bx)), KernelArg::U64(g.addr(br)), KernelArg::U64(g.addr(bw)), KernelArg::U64(g.addr(bo)), KernelArg::F32(1e-6)];
        launch(&module, RmsnormParams::ENTRY, [rows as u32, 1, 1], [THREADS, 1, 1], params.dynamic_smem().unwrap(), &args, &mut g).unwrap();
        let one_block = g.read(bo);
        check(&format!("rmsnorm rows={rows} H={h} residual={res}"), out_bf16, &floats(&one_block, out_bf16), &want);
        // the CPU sums the squares in the block's order: the same bits, not just close
        assert_eq!(floats(&one_block, out_bf16), want, "rmsnorm rows={rows} H={h} residual={res}: not the CPU's bits");
        if res {
            check("rmsnorm residual", res_bf16, &floats(&g.read(br), res_bf16), &want_res);
        }
        // column blocks (RES = 0): every block sums the whole row as one does, so the same bits;
        // with a residual, the lowering's add (residual += x) first, then the norm of the residual
        for cb in [2u32, 3, (h as u32).div_ceil(THREADS)] {
            let cols = RmsnormParams { cb, res: 0, x_bf16: params.src_bf16, ..params };
            let module = Module::parse(&cols.render().unwrap(), "rmsnorm.ptx").unwrap();
            let bs = if res {
                let bs = g.alloc_bytes("residual2", &bytes(&residual, res_bf16));
                let bx2 = g.alloc_bytes("x2", &bytes(&x, x_bf16));
                let n = rows * h;
                let grid = (n as u32).div_ceil(THREADS).clamp(1, ELEMENTWISE_MAX_GRID);
                let add = AddParams { arch: 120, n: n as u32, grid, threads: THREADS, a_bf16: res_bf16 as u32, b_bf16: x_bf16 as u32, out_bf16: res_bf16 as u32 };
                let m = Module::parse(&add.render().unwrap(), "add.ptx").unwrap();
                let a = [bs, bx2, bs].map(|b| KernelArg::U64(g.addr(b)));
                launch(&m, AddParams::ENTRY, [grid, 1, 1], [THREADS, 1, 1], 0, &a, &mut g).unwrap();
                assert_eq!(g.read(bs), g.read(br), "the add's residual differs from the rmsnorm's");
                bs
            } else {
                g.alloc_bytes("source", &bytes(&x, x_bf16))
            };
            let bo2 = g.alloc("out2", rows * h * if out_bf16 { 2 } else { 4 });
            let args = vec![KernelArg::U64(g.addr(bs)), KernelArg::U64(g.addr(bs)), KernelArg::U64(g.addr(bw)), KernelArg::U64(g.addr(bo2)), KernelArg::F32(1e-6)];
            launch(&module, RmsnormParams::ENTRY, [rows as u32, cb, 1], [THREADS, 1, 1], cols.dynamic_smem().unwrap(), &args, &mut g).unwrap();
            assert_eq!(g.read(bo2), one_block, "rmsnorm rows={rows} H={h} residual={res}: {cb} column blocks differ from one block");
        }
    }
}

#[test]
fn add_matches_the_cpu_on_ragged_sizes() {
    // One partial block, several blocks, and more elements than the capped grid covers at once.
    let big = (ELEMENTWISE_MAX_GRID * THREADS) as usize * 2 + 77;
    for (i, &(n, a_bf16, b_bf16, out_bf16)) in [(1, true, true, true), (300, true, false, true), (4099, false, false, false), (big, true, true, true), (513, false, true, false)].iter().enumerate() {
        let mut rng = Rng::new(400 + i as u64);
        let a = randn(&mut rng, n, 3.0, a_bf16);
        let b = randn(&mut rng, n, 1.0, b_bf16);
        let mut want = vec![0f32; n];
        reference::add(&a, &b, out_bf16, &mut want);
        let grid = (n as u32).div_ceil(THREADS).clamp(1, ELEMENTWISE_MAX_GRID);
        let params = AddParams { arch: 120, n: n as u32, grid, threads: THREADS, a_bf16: a_bf16 as u32, b_bf16: b_bf16 as u32, out_bf16: out_bf16 as u32 };
        let module = Module::parse(&params.render().unwrap(), "add.ptx").unwrap();
        let mut g = GlobalMemory::new();
        let ba = g.alloc_bytes("a", &bytes(&a, a_bf16));
        let bb = g.alloc_bytes("b", &bytes(&b, b_bf16));
        let bo = g.alloc("out", n * if out_bf16 { 2 } else { 4 });
        let args: Vec<KernelArg> = [ba, bb, bo].iter().map(|&x| KernelArg::U64(g.addr(x))).collect();
        launch(&module, AddParams::ENTRY, [grid, 1, 1], [THREADS, 1, 1], params.dynamic_smem().unwrap(), &args, &mut g).unwrap();
        let got = floats(&g.read(bo), out_bf16);
        check(&format!("add N={n}"), out_bf16, &got, &want);
        // One f32 addition rounded once on both sides: bit-exact.
        assert_eq!(bits(&got), bits(&want), "add N={n} must be bit-exact");
    }
}

#[test]
fn gather_rows_matches_the_cpu_with_out_of_range_rows() {
    for (i, &(in_rows, h, in_bf16, out_bf16)) in [(5, 1, true, true), (17, 300, true, true), (3, 513, false, true), (40, 72, false, false)].iter().enumerate() {
        let mut rng = Rng::new(500 + i as u64);
        let src = randn(&mut rng, in_rows * h, 2.0, in_bf16);
        // in range, repeated, negative, one past the end, far out of range
        let mut rows: Vec<i32> = vec![0, in_rows as i32 - 1, -1, in_rows as i32, 1 % in_rows as i32, i32::MIN, i32::MAX, 2 % in_rows as i32, 2 % in_rows as i32];
        rows.extend((0..in_rows as i32).rev());
        let out_rows = rows.len();
        let mut want = vec![0f32; out_rows * h];
        reference::gather_rows(&src, &rows, h, out_bf16, &mut want);
        let params = GatherRowsParams { arch: 120, out_rows: out_rows as u32, in_rows: in_rows as u32, h: h as u32, threads: THREADS, in_bf16: in_bf16 as u32, out_bf16: out_bf16 as u32 };
        let module = Module::parse(&params.render().unwrap(), "gather_rows.ptx").unwrap();
        let mut g = GlobalMemory::new();
        let bi = g.alloc_bytes("input", &bytes(&src, in_bf16));
        let br = g.alloc_bytes("rows", &rows.iter().flat_map(|r| r.to_le_bytes()).collect::<Vec<u8>>());
        // Poison the output: zero rows must be written, not left alone.
        let bo = g.alloc_bytes("out", &vec![0x7Fu8; out_rows * h * if out_bf16 { 2 } else { 4 }]);
        let args: Vec<KernelArg> = [bi, br, bo].iter().map(|&x| KernelArg::U64(g.addr(x))).collect();
        launch(&module, GatherRowsParams::ENTRY, [out_rows as u32, 1, 1], [THREADS, 1, 1], params.dynamic_smem().unwrap(), &args, &mut g).unwrap();
        let got = floats(&g.read(bo), out_bf16);
        check(&format!("gather_rows {in_rows}x{h}"), out_bf16, &got, &want);
        assert_eq!(bits(&got), bits(&want), "gather_rows must be bit-exact");
    }
}

#[test]
fn embed_matches_the_cpu_on_every_rank_of_a_split_vocabulary() {
    use kiln_runtime::plan::{BufId, LaunchArg, WeightId};
    // (ranks, vocab rows per rank, h, out_bf16): ragged widths; ids cover every rank's slice,
    // both ends of each, and ids past the vocabulary or negative (zero rows everywhere).
    for (i, &(ranks, vocab_rows, h, out_bf16)) in [(1, 37, 300, true), (2, 11, 33, true), (4, 5, 257, false), (8, 3, 1, true)].iter().enumerate() {
        let mut rng = Rng::new(600 + i as u64);
        let vocab = ranks * vocab_rows;
        let mut ids: Vec<i32> = (0..vocab as i32).rev().collect();
        ids.extend([0, vocab as i32 - 1, vocab as i32, vocab as i32 + 7, -1, i32::MIN, i32::MAX, (vocab / 2) as i32]);
        let tokens = ids.len();
        let params = EmbedParams { arch: 120, tokens: tokens as u32, vocab_rows: vocab_rows as u32, h: h as u32, threads: THREADS, out_bf16: out_bf16 as u32 };
        let module = Module::parse(&params.render().unwrap(), "embed.ptx").unwrap();
        // The lowering's argument list: the first row is the one per-rank argument.
        let largs = EmbedArgs { ids: Ptr::Buffer(BufId(0)), table: Ptr::Weight(WeightId(0)), out: Ptr::Buffer(BufId(1)), first_row: vocab_rows as u32 }.launch_args();
        assert_eq!(largs[3], LaunchArg::PerRank(vocab_rows as u32));
        let mut sum = vec![0f32; tokens * h];
        for rank in 0..ranks {
            let table = bytes(&randn(&mut rng, vocab_rows * h, 1.0, true), true);
            let mut want = vec![0f32; tokens * h];
            reference::embed(&ids, &table, vocab_rows, rank * vocab_rows, h, out_bf16, &mut want);
            let first_row = LaunchArg::per_rank(vocab_rows as u32, rank).unwrap();
            let mut g = GlobalMemory::new();
            let bi = g.alloc_bytes("ids", &ids.iter().flat_map(|r| r.to_le_bytes()).collect::<Vec<u8>>());
            let bt = g.alloc_bytes("table", &table);
            let bo = g.alloc_bytes("out", &vec![0x7Fu8; tokens * h * if out_bf16 { 2 } else { 4 }]);
            let args = vec![KernelArg::U64(g.addr(bi)), KernelArg::U64(g.addr(bt)), KernelArg::U64(g.addr(bo)), KernelArg::U32(first_row)];
            launch(&module, EmbedParams::ENTRY, [tokens as u32, 1, 1], [THREADS, 1, 1], params.dynamic_smem().unwrap(), &args, &mut g).unwrap();
            let got = floats(&g.read(bo), out_bf16);
            check(&format!("embed rank {rank}/{ranks} rows={vocab_rows} H={h}"), out_bf16, &got, &want);
            assert_eq!(bits(&got), bits(&want), "embed is a copy: bit-exact");
            sum.iter_mut().zip(&got).for_each(|(s, g)| *s += g);
        }
        // An id outside the vocabulary is zero on every rank (no rank owns it).
        for (t, &id) in ids.iter().enumerate() {
            let row = &sum[t * h..(t + 1) * h];
            if !(0..vocab as i32).contains(&id) {
                assert!(row.iter().all(|&v| v == 0.0), "id {id} must embed to zeros");
            }
        }
    }
}

/// The router as the lowering emits it: the gate product on the BF16 GEMV (F32 logits), then the
/// selection kernel; ids must equal the CPU's exactly and weights to the usual tolerance.
#[test]
fn router_matches_the_cpu_with_groups_ties_and_exhausted_groups() {
    use kiln_runtime::plan::RouterParams as Route;
    // (tokens, hidden, experts, n_group, topk_group, top_k, norm, x_bf16, bias_bf16)
    let cases = [
        (3, 72, 16, 4, 2, 4, true, true, false),
        (1, 264, 256, 8, 4, 8, true, true, false), // GLM-5's routing shape
        (5, 40, 300, 1, 1, 6, false, false, true), // one group, more experts than threads
        (2, 64, 12, 6, 1, 3, true, true, false),   // top_k > kept experts (2): -1 / 0 picks
        (17, 40, 8, 2, 2, 2, true, true, true),
    ];
    for (i, &(tokens, h, e, n_group, topk_group, top_k, norm, x_bf16, bias_bf16)) in cases.iter().enumerate() {
        let mut rng = Rng::new(700 + i as u64);
        let x = randn(&mut rng, tokens * h, 1.0, x_bf16);
        let gate = bytes(&randn(&mut rng, e * h, 0.2, true), true);
        let mut bias = randn(&mut rng, e, 0.05, bias_bf16);
        if i == 0 {
            // exact ties in the selection score: equal gate rows and bias
            let row = gate[..h * 2].to_vec();
            let mut g2 = gate.clone();
            g2[3 * h * 2..4 * h * 2].copy_from_slice(&row);
            bias[3] = bias[0];
            let r = Route { experts: e, top_k, n_group, topk_group, norm_topk_prob: norm, scaling: 2.5 };
            run_router(&x, tokens, h, &g2, &bias, &r, x_bf16, bias_bf16, 1);
        }
        let r = Route { experts: e, top_k, n_group, topk_group, norm_topk_prob: norm, scaling: 2.5 };
        // a block per token, and a warp per token (THREADS / 32 tokens per block: one block for a
        // few tokens, 17 tokens in 3 with the last one's warps past them idle)
        for per_block in [1, THREADS / 32] {
            run_router(&x, tokens, h, &gate, &bias, &r, x_bf16, bias_bf16, per_block);
        }
    }
}

#[allow(clippy::too_many_arguments)]
fn run_router(x: &[f32], tokens: usize, h: usize, gate: &[u8], bias: &[f32], r: &kiln_runtime::plan::RouterParams, x_bf16: bool, bias_bf16: bool, per_block: u32) {
    let (mut want_ids, mut want_w) = (vec![0i32; tokens * r.top_k], vec![0f32; tokens * r.top_k]);
    reference::router(x, h, gate, bias, r, &mut want_ids, &mut want_w);
    let mut g = GlobalMemory::new();
    let bx = g.alloc_bytes("x", &bytes(x, x_bf16));
    let bg = g.alloc_bytes("gate", gate);
    let bl = g.alloc("logits", tokens * r.experts * 4);
    let product = LinearBf16GemvParams { arch: 120, m: tokens as u32, n: r.experts as u32, k: h as u32, tasks_per_block: MIN_TASKS_PER_BLOCK, unroll: 4, threads: THREADS, x_bf16: x_bf16 as u32, out_bf16: 0 };
    let module = Module::parse(&product.render().unwrap(), "linear_bf16_gemv.ptx").unwrap();
    let args: Vec<KernelArg> = [bx, bg, bl].iter().map(|&b| KernelArg::U64(g.addr(b))).collect();
    launch(&module, LinearBf16GemvParams::ENTRY, [(r.experts as u32).div_ceil(MIN_TASKS_PER_BLOCK), 1, 1], [THREADS, 1, 1], product.dynamic_smem().unwrap(), &args, &mut g).unwrap();
    let params = RouterParams {
        arch: 120,
        tokens: tokens as u32,
        per_block,
        experts: r.experts as u32,
        n_group: r.n_group as u32,
        topk_group: r.topk_group as u32,
        top_k: r.top_k as u32,
        norm: r.norm_topk_prob as u32,
        threads: THREADS,
        bias_bf16: bias_bf16 as u32,
        w_bf16: 0,
    };
    let module = Module::parse(&params.render().unwrap(), "router.ptx").unwrap();
    let bb = g.alloc_bytes("bias", &bytes(bias, bias_bf16));
    let bi = g.alloc_bytes("ids", &vec![0x55u8; tokens * r.top_k * 4]);
    let bw = g.alloc_bytes("weights", &vec![0x55u8; tokens * r.top_k * 4]);
    let mut args: Vec<KernelArg> = [bl, bb, bi, bw].iter().map(|&b| KernelArg::U64(g.addr(b))).collect();
    args.push(KernelArg::F32(r.scaling));
    launch(&module, RouterParams::ENTRY, [(tokens as u32).div_ceil(per_block), 1, 1], [THREADS, 1, 1], params.dynamic_smem().unwrap(), &args, &mut g).unwrap();
    let ids: Vec<i32> = g.read(bi).chunks_exact(4).map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
    let what = format!("router T={tokens} H={h} E={} groups={}/{} top-{} tokens per block {per_block}", r.experts, r.topk_group, r.n_group, r.top_k);
    eprintln!("{what}: ids {:?}", &ids[..ids.len().min(16)]);
    assert_eq!(ids, want_ids, "{what}: expert ids");
    if r.topk_group * (r.experts / r.n_group.max(1)) < r.top_k {
        assert!(ids.contains(&-1), "{what}: the kept groups run out, so some picks must be -1");
    }
    check(&what, false, &floats(&g.read(bw), false), &want_w);
}

/// The router's selection (three tokens, a warp each, in one block) as the tail of its split-K
/// gate product, beside a second split-K GEMM that takes the split-K region's upper slot, all in
/// one merged launch (`kernels/merge.rs`, as `passes/merge.rs` builds it at small decode batches
/// beside the shared experts' gate/up): the ids equal the CPU's, the weights and the GEMM agree
/// within `kiln verify`'s tolerance, every counter (both slots' tiles, the chain's) is back at
/// zero and a replay stores the same bits.
#[test]
fn router_selection_chained_to_its_split_k_gate_product_beside_a_split_k_gemm() {
    use kiln_compiler::kernels::merge::{merge_ptx, MergePart, MERGED_ENTRY};
    use kiln_compiler::kernels::LinearBf16GemmParams;
    use kiln_runtime::plan::SplitKLayout as Region;
    // three tokens: the selection a warp per token, all in one block
    let (t, h, e, top_k, n2, k2) = (3, 264, 256, 8, 40, 200);
    let mut rng = Rng::new(811);
    let x = randn(&mut rng, t * h, 1.0, true);
    let gate = bytes(&randn(&mut rng, e * h, 0.2, true), true);
    let bias = randn(&mut rng, e, 0.05, false);
    let route = kiln_runtime::plan::RouterParams { experts: e, top_k, n_group: 1, topk_group: 1, norm_topk_prob: true, scaling: 2.5 };
    let (mut want_ids, mut want_w) = (vec![0i32; t * top_k], vec![0f32; t * top_k]);
    reference::router(&x, h, &gate, &bias, &route, &mut want_ids, &mut want_w);
    let x2 = randn(&mut rng, k2, 1.0, true);
    let w2 = bytes(&randn(&mut rng, n2 * k2, 0.1, true), true);
    let mut want2 = vec![0f32; n2];
    reference::linear_bf16(&x2, 1, &w2, k2, n2, true, &mut want2);
    // split-K forms: 16 x 32 blocks, K over 3 (the gate product) and 16 x 8 blocks, K over 2
    let gemm = |m: usize, n: usize, k: usize, nt: u32, ks: u32, out_bf16: u32| LinearBf16GemmParams { arch: 120, m: m as u32, n: n as u32, k: k as u32, segs: 1, c1: 0, c2: 0, c3: 0, split: 1, ks, partials: Region::PARTIALS as u32, mt: 1, nt, kb: 2, nbuf: 2, threads: 256, x_bf16: 1, out_bf16, norm: 0, nw_bf16: 0, batch: 1, xld: 0, old: 0, woff: 0, xb: 0, wb: 0, ob: 0 };
    let (product, beside) = (gemm(t, e, h, 4, 3, 0), gemm(1, n2, k2, 1, 2, 1));
    let router = RouterParams { arch: 120, tokens: t as u32, per_block: THREADS / 32, experts: e as u32, n_group: 1, topk_group: 1, top_k: top_k as u32, norm: 1, threads: THREADS, bias_bf16: 0, w_bf16: 0 };
    let (grid_product, grid_beside) = ([(e / 32) as u32, 1, 3], [n2.div_ceil(8) as u32, 1, 2]);
    let ptx = [product.render().unwrap(), router.render().unwrap(), beside.render().unwrap()];
    let parts = [MergePart { ptx: &ptx[0], grid: grid_product, tail: false }, MergePart { ptx: &ptx[1], grid: [1, 1, 1], tail: true }, MergePart { ptx: &ptx[2], grid: grid_beside, tail: false }];
    let module = Module::parse(&merge_ptx(&parts).unwrap(), "merged").unwrap();
    let mut g = GlobalMemory::new();
    let region = g.alloc("split_k_region", Region::BYTES as usize);
    let [bx, bg, bl, bb, bi, bw, bx2, bw2, bo2] = [
        g.alloc_bytes("x", &bytes(&x, true)),
        g.alloc_bytes("gate", &gate),
        g.alloc("logits", t * e * 4),
        g.alloc_bytes("bias", &bytes(&bias, false)),
        g.alloc("ids", t * top_k * 4),
        g.alloc("weights", t * top_k * 4),
        g.alloc_bytes("x2", &bytes(&x2, true)),
        g.alloc_bytes("w2", &w2),
        g.alloc("out2", n2 * 2),
    ];
    let (lower, upper) = (g.addr(region), g.addr(region) + Region::UPPER);
    let a = |b| KernelArg::U64(g.addr(b));
    // a GEMM's arguments: x, w, out, w1..w3, out1..out3 (one segment: w and out again), the
    // split-K slot, the norm weight (unused) and eps
    let mut args = vec![a(bx), a(bg), a(bl), a(bg), a(bg), a(bg), a(bl), a(bl), a(bl), KernelArg::U64(lower), a(bg), KernelArg::F32(0.0)];
    // the router's, then the region (its arrival counter at CHAIN)
    args.extend([a(bl), a(bb), a(bi), a(bw), KernelArg::F32(route.scaling), KernelArg::U64(lower)]);
    args.extend([a(bx2), a(bw2), a(bo2), a(bw2), a(bw2), a(bw2), a(bo2), a(bo2), a(bo2), KernelArg::U64(upper), a(bw2), KernelArg::F32(0.0)]);
    let blocks = grid_product.iter().product::<u32>() + grid_beside.iter().product::<u32>();
    let smem = product.dynamic_smem().unwrap().max(beside.dynamic_smem().unwrap()).max(router.dynamic_smem().unwrap());
    let mut stored = Vec::new();
    for replay in 0..2 {
        for b in [bi, bw, bo2] {
            let n = g.read(b).len();
            g.write(b, 0, &vec![0x55; n]);
        }
        launch(&module, MERGED_ENTRY, [blocks, 1, 1], [256, 1, 1], smem, &args, &mut g).unwrap();
        let ids: Vec<i32> = g.read(bi).chunks_exact(4).map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
        assert_eq!(ids, want_ids, "replay {replay}: expert ids");
        check("chained router weights", false, &floats(&g.read(bw), false), &want_w);
        check("split-K GEMM beside the chain (upper slot)", true, &floats(&g.read(bo2), true), &want2);
        let r = g.read(region);
        let zero = |at: u64, n: usize| r[at as usize..at as usize + 4 * n].iter().all(|&b| b == 0);
        assert!(zero(0, e / 32) && zero(Region::UPPER, n2.div_ceil(8)) && zero(Region::CHAIN, 1), "replay {replay}: a counter is not back at zero");
        stored.push([g.read(bi), g.read(bw), g.read(bo2)]);
    }
    assert_eq!(stored[0], stored[1], "the replay stores other bits");
}
