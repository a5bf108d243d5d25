//! PTX emulator tests pinned to the PTX ISA (not to any kiln kernel): each kernel in tests/ptx/
//! runs on the emulator and its results are compared with expectations written from the ISA text
//! (fragment layouts, shuffle pseudo-code, cvt rounding rules) or with plain CPU arithmetic.

use kiln_runtime::emu::{launch, EmuError, GlobalMemory, KernelArg, LaunchStats, Module};
use kiln_runtime::numerics::{bf16_to_f32, e2m1_to_f32, e4m3_to_f32, f32_to_bf16, f32_to_e2m1, f32_to_e4m3};
use std::path::PathBuf;

fn ptx_path(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/ptx").join(name)
}

fn module(name: &str) -> Module {
    let p = ptx_path(name);
    let src = std::fs::read_to_string(&p).unwrap();
    Module::parse(&src, &p.display().to_string()).unwrap_or_else(|e| panic!("{e}"))
}

fn run(m: &Module, entry: &str, grid: u32, block: u32, smem: u32, args: &[KernelArg], g: &mut GlobalMemory) -> LaunchStats {
    launch(m, entry, [grid, 1, 1], [block, 1, 1], smem, args, g).unwrap_or_else(|e| panic!("{e}"))
}

fn ptr(g: &GlobalMemory, id: kiln_runtime::emu::BufferId) -> KernelArg {
    KernelArg::U64(g.addr(id))
}

/// Deterministic pseudo-random numbers (xorshift64*).
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    fn u32(&mut self) -> u32 {
        (self.next() >> 32) as u32
    }
    fn f32(&mut self, lo: f32, hi: f32) -> f32 {
        lo + (hi - lo) * ((self.next() >> 40) as f32 / (1u64 << 24) as f32)
    }
}

#[test]
fn vec_add_with_divergent_exit_and_byte_counts() {
    let m = module("basic.ptx");
    let n = 1000usize;
    let a: Vec<f32> = (0..n).map(|i| i as f32 * 0.5).collect();
    let b: Vec<f32> = (0..n).map(|i| 1.0 - i as f32).collect();
    let mut g = GlobalMemory::new();
    let (ia, ib, ic) = (g.alloc_f32("a", &a), g.alloc_f32("b", &b), g.alloc("c", n * 4));
    let s = run(&m, "vec_add", 8, 128, 0, &[ptr(&g, ia), ptr(&g, ib), ptr(&g, ic), KernelArg::U32(n as u32)], &mut g);
    let c = g.read_f32(ic);
    for i in 0..n {
        assert_eq!(c[i], a[i] + b[i], "c[{i}]");
    }
    assert_eq!(s.global_bytes_read(), (n * 8) as u64);
    assert_eq!(s.global_bytes_written(), (n * 4) as u64);
    assert_eq!(s.blocks, 8);
}

fn int_expect(a: u32, b: u32) -> [u32; 32] {
    let (sa, sb) = (a as i32, b as i32);
    let sh = b & 63;
    let d = b | 1;
    let wide_s = sa as i64 * sb as i64;
    let wide_u = a as u64 * b as u64;
    [
        a.wrapping_add(b),
        a.wrapping_sub(b),
        a.wrapping_mul(b),
        (wide_s >> 32) as u32,
        (wide_u >> 32) as u32,
        wide_s as u32,
        (wide_s >> 32) as u32,
        (wide_u >> 32) as u32,
        a.wrapping_mul(b).wrapping_add(7),
        sa.wrapping_div(d as i32) as u32,
        a % d,
        sa.min(sb) as u32,
        a.max(b),
        a & b,
        a | b,
        a ^ b,
        !a,
        if sh >= 32 { 0 } else { a << sh },
        if sh >= 32 { 0 } else { a >> sh },
        (sa >> sh.min(31)) as u32,
        sa.wrapping_neg() as u32,
        sa.wrapping_abs() as u32,
        a.count_ones(),
        a.leading_zeros(),
        a.reverse_bits(),
        sa.saturating_add(sb) as u32,
        sa.saturating_sub(sb) as u32,
        // prmt 0x5140: d.b0 = byte 0 (a.b0), d.b1 = byte 4 (b.b0), d.b2 = byte 1 (a.b1), d.b3 = byte 5 (b.b1)
        (a & 0xFF) | (b & 0xFF) << 8 | ((a >> 8) & 0xFF) << 16 | ((b >> 8) & 0xFF) << 24,
        a ^ b ^ sh,
        (sa < sb) as u32,
        (a < b) as u32,
        (a != 0 && sa < sb) as u32,
    ]
}

#[test]
fn integer_instructions() {
    let m = module("basic.ptx");
    let mut rng = Rng(7);
    let mut pairs: Vec<(u32, u32)> = vec![
        (0, 0),
        (1, 1),
        (u32::MAX, 1),
        (0x8000_0000, 2),
        (0x7FFF_FFFF, 1),
        (0x8000_0000, 0x8000_0000),
        (5, 31),
        (5, 32),
        (0x8000_0000, 40),
        (0xF0F0_1234, 63),
        (123456789, u32::MAX - 3),
    ];
    while pairs.len() < 32 {
        pairs.push((rng.u32(), rng.u32()));
    }
    let input: Vec<u32> = pairs.iter().flat_map(|(a, b)| [*a, *b]).collect();
    let mut g = GlobalMemory::new();
    let (i, o) = (g.alloc_u32("in", &input), g.alloc("out", 32 * 32 * 4));
    run(&m, "int_ops", 1, 32, 0, &[ptr(&g, i), ptr(&g, o)], &mut g);
    let out = g.read_u32(o);
    for (t, (a, b)) in pairs.iter().enumerate() {
        let e = int_expect(*a, *b);
        for j in 0..32 {
            assert_eq!(out[t * 32 + j], e[j], "op {j} on a={a:#x} b={b:#x}");
        }
    }
}

fn ftz(x: f32) -> f32 {
    if x.is_subnormal() {
        0.0f32.copysign(x)
    } else {
        x
    }
}

fn ptx_min(x: f32, y: f32, max: bool) -> f32 {
    if x.is_nan() {
        return y;
    }
    if y.is_nan() {
        return x;
    }
    if x == y && x == 0.0 {
        // -0.0 < +0.0
        return if (x.is_sign_negative() && !max) || (!x.is_sign_negative() && max) { x } else { y };
    }
    if (x < y) != max {
        x
    } else {
        y
    }
}

#[test]
fn float_instructions() {
    let m = module("basic.ptx");
    let sub = f32::from_bits(0x0000_1000);
    let mut triples: Vec<[f32; 3]> = vec![
        [1.0 + 2f32.powi(-12), 1.0 - 2f32.powi(-12), -1.0], // fma is fused: -2^-24, not 0
        [1.5, 2.0, 0.25],
        [f32::NAN, 1.0, 0.0],
        [1.0, f32::NAN, 0.0],
        [-0.0, 0.0, 0.0],
        [0.0, -0.0, 0.0],
        [sub, 0.0, 0.0],  // add.ftz flushes the subnormal
        [3.0, 0.0, 0.0],  // division by zero -> inf
        [0.5, 3.0, 0.0],  // mul.sat -> 1
        [-1.0, 2.0, 0.0], // mul.sat -> 0
        [2.5, 1.0, 0.0],  // cvt.rni -> 2
        [3.5, 1.0, 0.0],  // cvt.rni -> 4
        [-2.5, 1.0, 0.0], // cvt.rni -> -2
        [f32::INFINITY, -f32::INFINITY, 1.0],
        [1e30, 1e30, -1e30],
        [7.0, 3.0, 1.0],
    ];
    let mut rng = Rng(11);
    while triples.len() < 32 {
        triples.push([rng.f32(-100.0, 100.0), rng.f32(-100.0, 100.0), rng.f32(-100.0, 100.0)]);
    }
    let input: Vec<f32> = triples.iter().flatten().copied().collect();
    let mut g = GlobalMemory::new();
    let (i, o) = (g.alloc_f32("in", &input), g.alloc("out", 32 * 16 * 4));
    run(&m, "float_ops", 1, 32, 0, &[ptr(&g, i), ptr(&g, o)], &mut g);
    let out = g.read_f32(o);
    for (t, [a, b, c]) in triples.iter().copied().enumerate() {
        let any_nan = a.is_nan() || b.is_nan();
        let expect = [
            a + b,
            a - b,
            a * b,
            a.mul_add(b, c),
            a / b,
            ptx_min(a, b, false),
            ptx_min(a, b, true),
            if any_nan { f32::NAN } else { ptx_min(a, b, false) },
            if any_nan { f32::NAN } else { ptx_min(a, b, true) },
            -a,
            a.abs(),
            a.abs().sqrt(),
            1.0 / a,
            ftz(ftz(a) + ftz(b)),
            if (a * b).is_nan() { 0.0 } else { (a * b).clamp(0.0, 1.0) },
            a.round_ties_even(),
        ];
        for (j, e) in expect.iter().enumerate() {
            let got = out[t * 16 + j];
            if e.is_nan() {
                assert!(got.is_nan(), "op {j} on {a} {b} {c}: expected NaN, got {got}");
            } else {
                assert_eq!(got.to_bits(), e.to_bits(), "op {j} on {a} {b} {c}: got {got}, expected {e}");
            }
        }
    }
    // The fused result is exact: (1 + 2^-12)(1 - 2^-12) - 1 = -2^-24.
    assert_eq!(out[3], -(2f32.powi(-24)));
    assert_eq!(out[6 * 16 + 13], 0.0);
}

#[test]
fn approximate_functions_within_isa_error_bounds() {
    let m = module("basic.ptx");
    let xs: Vec<f32> = (0..32).map(|i| 0.1 + i as f32 * 0.37).collect();
    let mut g = GlobalMemory::new();
    let (i, o) = (g.alloc_f32("in", &xs), g.alloc("out", 32 * 8 * 4));
    run(&m, "approx_ops", 1, 32, 0, &[ptr(&g, i), ptr(&g, o)], &mut g);
    let out = g.read_f32(o);
    for (t, &x) in xs.iter().enumerate() {
        let xd = x as f64;
        let expect = [xd.exp2(), xd.log2(), 1.0 / xd.sqrt(), 1.0 / xd, xd.sqrt(), 3.0 / xd, xd.sin(), xd.exp2()];
        for (j, e) in expect.iter().enumerate() {
            let got = out[t * 8 + j] as f64;
            let tol = if j == 1 || j == 6 { 2f64.powi(-20) } else { e.abs() * 2f64.powi(-21) };
            assert!((got - e).abs() <= tol, "approx op {j} of {x}: {got} vs {e}");
        }
    }
}

#[test]
fn float_comparisons_ordered_and_unordered() {
    let m = module("basic.ptx");
    let pairs: Vec<[f32; 2]> = vec![[1.0, 2.0], [2.0, 1.0], [1.0, 1.0], [f32::NAN, 1.0], [1.0, f32::NAN], [f32::NAN, f32::NAN], [-0.0, 0.0], [f32::NEG_INFINITY, f32::INFINITY]];
    let input: Vec<f32> = pairs.iter().flatten().copied().collect();
    let mut g = GlobalMemory::new();
    let (i, o) = (g.alloc_f32("in", &input), g.alloc("out", pairs.len() * 14 * 4));
    run(&m, "compare_ops", 1, pairs.len() as u32, 0, &[ptr(&g, i), ptr(&g, o)], &mut g);
    let out = g.read_u32(o);
    for (t, [a, b]) in pairs.iter().copied().enumerate() {
        let nan = a.is_nan() || b.is_nan();
        let e = [a == b, !nan && a != b, a < b, a <= b, a > b, a >= b, nan || a == b, a != b, nan || a < b, nan || a <= b, nan || a > b, nan || a >= b, !nan, nan];
        for (j, v) in e.iter().enumerate() {
            assert_eq!(out[t * 14 + j], *v as u32, "compare {j} on ({a}, {b})");
        }
    }
}

#[test]
fn memory_widths_extension_and_packing() {
    let m = module("basic.ptx");
    let mut g = GlobalMemory::new();
    let i = g.alloc_bytes("in", &[0x80, 0x00, 0x01, 0x80, 0x44, 0x33, 0x22, 0x11]);
    let o = g.alloc_bytes("out", &[0xAA; 64]);
    run(&m, "mem_ops", 1, 1, 0, &[ptr(&g, i), ptr(&g, o)], &mut g);
    let b = g.read(o);
    let u32_at = |k: usize| u32::from_le_bytes([b[k], b[k + 1], b[k + 2], b[k + 3]]);
    let u64_at = |k: usize| u64::from_le_bytes(b[k..k + 8].try_into().unwrap());
    assert_eq!([u32_at(0), u32_at(4), u32_at(8), u32_at(12)], [0xFFFF_FF80, 0x80, 0xFFFF_8001, 0x8001]);
    assert_eq!([u32_at(16), u32_at(20), u32_at(24), u32_at(28)], [0x3344_1122, 0x44, 0, 0x44]);
    assert_eq!(u32_at(32), 0xFFFF_FF80);
    assert_eq!(u64_at(40), 0xFFFF_FFFF_FFFF_FF80);
    assert_eq!(u64_at(48), 0xFFFF_FF80_1122_3344);
    assert_eq!(&b[56..64], &[0x44, 0xAA, 0x44, 0x33, 0xAA, 0xAA, 0xAA, 0xAA]);
}

/// One `cvt_pairs` record (see tests/ptx/cvt.ptx).
struct CvtOut {
    bf16x2: u32,
    bf16: u16,
    e4m3x2: u16,
    bf16_back: f32,
    e2m1x2: u8,
    e2m1x2_relu: u8,
    f16: u16,
    f16x2_from_e2m1: u32,
    f16x2_from_e4m3: u32,
    rni: i32,
    rzi: i32,
    rmi: i32,
    rpi_u32: u32,
    bf16x2_satfinite: u32,
    f16_back: f32,
    e4m3x2_relu: u16,
    packed4: u32,
}

fn cvt_run(pairs: &[(f32, f32)]) -> Vec<CvtOut> {
    let m = module("cvt.ptx");
    let input: Vec<f32> = pairs.iter().flat_map(|(a, b)| [*a, *b]).collect();
    let mut g = GlobalMemory::new();
    let (i, o) = (g.alloc_f32("in", &input), g.alloc("out", pairs.len() * 64));
    run(&m, "cvt_pairs", 1, pairs.len() as u32, 0, &[ptr(&g, i), ptr(&g, o)], &mut g);
    let b = g.read(o);
    (0..pairs.len())
        .map(|t| {
            let r = &b[t * 64..t * 64 + 64];
            let u16_at = |k: usize| u16::from_le_bytes([r[k], r[k + 1]]);
            let u32_at = |k: usize| u32::from_le_bytes([r[k], r[k + 1], r[k + 2], r[k + 3]]);
            CvtOut {
                bf16x2: u32_at(0),
                bf16: u16_at(4),
                e4m3x2: u16_at(6),
                bf16_back: f32::from_bits(u32_at(8)),
                e2m1x2: r[12],
                e2m1x2_relu: r[13],
                f16: u16_at(14),
                f16x2_from_e2m1: u32_at(16),
                f16x2_from_e4m3: u32_at(20),
                rni: u32_at(24) as i32,
                rzi: u32_at(28) as i32,
                rmi: u32_at(32) as i32,
                rpi_u32: u32_at(36),
                bf16x2_satfinite: u32_at(40),
                f16_back: f32::from_bits(u32_at(44)),
                e4m3x2_relu: u16_at(48),
                packed4: u32_at(60),
            }
        })
        .collect()
}

#[test]
fn cvt_rounding_saturation_and_packing_order_hand_computed() {
    let p = |e: i32| 2f32.powi(e);
    let pairs = [
        (1.0 + p(-8), 1.0 + 3.0 * p(-8)), // 0: bf16 ties to even: 0x3F80, 0x3F82
        (1.0625, 1.1875),                 // 1: e4m3 ties to even: 0x38 (1.0), 0x3A (1.25)
        (0.25, 0.75),                     // 2: e2m1 ties: 0 and 1.0
        (1.25, 1.75),                     // 3: e2m1 ties: 1.0 and 2.0
        (2.5, 3.5),                       // 4: e2m1 ties: 2.0 and 4.0
        (5.0, 7.0),                       // 5: e2m1 tie 4.0; 7 saturates to 6
        (0.5, 6.0),                       // 6: a (6.0) in the high nibble/byte
        (f32::NAN, f32::NEG_INFINITY),    // 7: NaN -> e2m1 +6, e4m3 0x7F; -inf saturates
        (448.0, 464.0),                   // 8: e4m3 max and beyond-max saturate to 0x7E
        (p(-10), 3.0 * p(-10)),           // 9: e4m3 subnormal ties: 0 and 2 * 2^-9
        (3.4e38, -3.4e38),                // 10: bf16 overflow to inf; satfinite clamps
        (-2.5, 1.0),                      // 11: float-to-int roundings of a negative tie
        (-3.0, 1.5),                      // 12: .relu
        (1e10, 0.0),                      // 13: float-to-int saturation
        (65520.0, 1.0),                   // 14: f16 tie at the top rounds to inf
        (-0.0, 0.0),                      // 15: signed zeros
    ];
    let r = cvt_run(&pairs);
    // bf16 (cvt.rn.bf16x2.f32 d, x1, x0 puts x1 in the high half).
    assert_eq!(r[0].bf16x2, 0x3F82_3F80);
    assert_eq!(r[0].bf16, 0x3F80);
    assert_eq!(r[0].bf16_back, 1.0);
    assert_eq!(r[1].bf16x2, 0x3F98_3F88);
    assert_eq!(r[10].bf16x2, 0xFF80_7F80);
    assert_eq!(r[10].bf16x2_satfinite, 0xFF7F_7F7F);
    assert_eq!(r[7].bf16x2 >> 16, 0xFF80);
    assert!(bf16_to_f32(r[7].bf16x2 as u16).is_nan());
    assert_eq!(r[7].bf16x2_satfinite >> 16, 0xFF7F);
    assert!(bf16_to_f32(r[7].bf16x2_satfinite as u16).is_nan());
    assert_eq!(r[15].bf16x2, 0x0000_8000);
    // e4m3x2 (x1 in the high byte).
    assert_eq!(r[1].e4m3x2, 0x3A38);
    assert_eq!(r[6].e4m3x2, 0x4C30);
    assert_eq!(r[7].e4m3x2, 0xFE7F);
    assert_eq!(r[8].e4m3x2, 0x7E7E);
    assert_eq!(r[9].e4m3x2, 0x0200);
    assert_eq!(r[12].e4m3x2, 0x3CC4);
    assert_eq!(r[12].e4m3x2_relu, 0x3C00);
    assert_eq!(r[15].e4m3x2, 0x0080);
    // e2m1x2 (x1 in the high nibble).
    assert_eq!(r[0].e2m1x2, 0x22);
    assert_eq!(r[2].e2m1x2, 0x20);
    assert_eq!(r[3].e2m1x2, 0x42);
    assert_eq!(r[4].e2m1x2, 0x64);
    assert_eq!(r[5].e2m1x2, 0x76);
    assert_eq!(r[6].e2m1x2, 0x71);
    assert_eq!(r[7].e2m1x2, 0xF7);
    assert_eq!(r[12].e2m1x2, 0x3D);
    assert_eq!(r[12].e2m1x2_relu, 0x30);
    assert_eq!(r[15].e2m1x2, 0x08);
    // Byte packing with mov.b32 {b0, b1, b2, b3}: b0 in the low byte.
    assert_eq!(r[12].packed4, 0x303D_303D);
    // f16x2 from packed pairs: the high nibble/byte goes to the high half.
    assert_eq!(r[6].f16x2_from_e2m1, 0x4600_3800);
    assert_eq!(r[1].f16x2_from_e4m3, 0x3D00_3C00);
    assert_eq!(r[8].f16x2_from_e4m3, 0x5F00_5F00);
    // f16.
    assert_eq!(r[1].f16, 0x3C40);
    assert_eq!(r[2].f16, 0x3400);
    assert_eq!(r[8].f16, 0x5F00);
    assert_eq!(r[14].f16, 0x7C00);
    assert_eq!(r[1].f16_back, 1.0625);
    // float -> int.
    assert_eq!((r[4].rni, r[4].rzi, r[4].rmi, r[4].rpi_u32), (2, 2, 2, 3));
    assert_eq!((r[11].rni, r[11].rzi, r[11].rmi, r[11].rpi_u32), (-2, -2, -3, 0));
    assert_eq!((r[13].rni, r[13].rpi_u32), (i32::MAX, u32::MAX));
    assert_eq!((r[7].rni, r[7].rpi_u32), (0, 0));
}

#[test]
fn cvt_agrees_with_numerics_on_random_values() {
    let mut rng = Rng(3);
    let pairs: Vec<(f32, f32)> = (0..64)
        .map(|i| {
            let s = [0.01f32, 1.0, 10.0, 1000.0][i % 4];
            (rng.f32(-8.0, 8.0) * s, rng.f32(-8.0, 8.0) * s)
        })
        .collect();
    for chunk in pairs.chunks(32) {
        let r = cvt_run(chunk);
        for (o, (x0, x1)) in r.iter().zip(chunk) {
            assert_eq!(o.bf16x2, (f32_to_bf16(*x1) as u32) << 16 | f32_to_bf16(*x0) as u32);
            assert_eq!(o.e4m3x2, (f32_to_e4m3(*x1) as u16) << 8 | f32_to_e4m3(*x0) as u16);
            assert_eq!(o.e2m1x2, f32_to_e2m1(*x1) << 4 | f32_to_e2m1(*x0));
        }
    }
}

/// (mode, b, c) of each shfl_modes case, as written in tests/ptx/shfl.ptx (b = None: 31 - lane).
const SHFL_CASES: [(&str, Option<i32>, i32); 8] = [
    ("up", Some(3), 0),
    ("down", Some(5), 0x1f),
    ("bfly", Some(6), 0x1f),
    ("idx", Some(7), 0x1f),
    ("idx", Some(2), 0x181f),
    ("down", Some(3), 0x101f),
    ("up", Some(2), 0x1800),
    ("idx", None, 0x1f),
];

/// The shfl.sync pseudo-code of the PTX ISA, written out independently.
fn shfl_expect(mode: &str, lane: i32, b: i32, c: i32) -> (i32, bool) {
    let bval = b & 0x1f;
    let cval = c & 0x1f;
    let seg = (c >> 8) & 0x1f;
    let max_lane = (lane & seg) | (cval & !seg);
    let min_lane = lane & seg;
    let (j, p) = match mode {
        "up" => (lane - bval, lane - bval >= max_lane),
        "down" => (lane + bval, lane + bval <= max_lane),
        "bfly" => (lane ^ bval, (lane ^ bval) <= max_lane),
        _ => {
            let j = min_lane | (bval & !seg);
            (j, j <= max_lane)
        }
    };
    (if p { j } else { lane }, p)
}

#[test]
fn shfl_sync_modes_clamps_and_segments() {
    let m = module("shfl.ptx");
    let mut g = GlobalMemory::new();
    let (v, p) = (g.alloc("vals", 8 * 32 * 4), g.alloc("preds", 8 * 32 * 4));
    run(&m, "shfl_modes", 1, 32, 0, &[ptr(&g, v), ptr(&g, p)], &mut g);
    let (vals, preds) = (g.read_u32(v), g.read_u32(p));
    for (k, (mode, b, c)) in SHFL_CASES.iter().enumerate() {
        for lane in 0..32i32 {
            let (src, pv) = shfl_expect(mode, lane, b.unwrap_or(31 - lane), *c);
            assert_eq!(vals[k * 32 + lane as usize], (10 * src + 1) as u32, "case {k} ({mode}) lane {lane}");
            assert_eq!(preds[k * 32 + lane as usize], pv as u32, "case {k} ({mode}) lane {lane} predicate");
        }
    }
    // Hand-checked spots: up by 3 keeps lanes 0-2; down by 5 keeps lanes 27-31; idx in 8-lane
    // segments broadcasts lane 2 of each segment; down by 3 in 16-lane segments stops at lane 15.
    assert_eq!(&vals[0..4], &[1, 11, 21, 1]);
    assert_eq!(vals[32 + 26], 311);
    assert_eq!(vals[32 + 27], 271);
    assert_eq!(vals[4 * 32 + 13], 10 * 10 + 1);
    assert_eq!(vals[5 * 32 + 13], 10 * 13 + 1);
    assert_eq!(vals[5 * 32 + 12], 10 * 15 + 1);
    assert_eq!(vals[6 * 32 + 9], 10 * 9 + 1);
    assert_eq!(vals[6 * 32 + 10], 10 * 8 + 1);
}

#[test]
fn shfl_sync_with_partial_membermask() {
    let m = module("shfl.ptx");
    let mut g = GlobalMemory::new();
    let v = g.alloc("vals", 32 * 4);
    run(&m, "shfl_partial", 1, 32, 0, &[ptr(&g, v)], &mut g);
    let vals = g.read_u32(v);
    for l in 0..32u32 {
        let src = if l < 16 { l ^ 1 } else { l };
        assert_eq!(vals[l as usize], 10 * src + 1, "lane {l}");
    }
}

#[test]
fn ldmatrix_fragments_plain_and_transposed() {
    let m = module("ldmatrix.ptx");
    let mut g = GlobalMemory::new();
    let o = g.alloc("out", 11 * 32 * 4);
    run(&m, "ldm", 1, 32, 0, &[ptr(&g, o)], &mut g);
    let out = g.read_u32(o);
    // Element (row r, column c) of matrix j is 8 * (8j + r) + c.
    let el = |j: usize, r: usize, c: usize| (8 * (8 * j + r) + c) as u32;
    let slots: [(usize, usize, bool); 4] = [(0, 1, false), (1, 2, false), (3, 4, false), (7, 4, true)];
    for (first, num, trans) in slots {
        for j in 0..num {
            for l in 0..32 {
                let (lo, hi) = if trans { (el(j, 2 * (l % 4), l / 4), el(j, 2 * (l % 4) + 1, l / 4)) } else { (el(j, l / 4, 2 * (l % 4)), el(j, l / 4, 2 * (l % 4) + 1)) };
                assert_eq!(out[(first + j) * 32 + l], lo | hi << 16, "slot {} lane {l}", first + j);
            }
        }
    }
    // ISA figure: lane 5 holds row 1, columns 2-3 (values 10, 11); transposed: column 1, rows 2-3.
    assert_eq!(out[5], 10 | 11 << 16);
    assert_eq!(out[7 * 32 + 5], 17 | 25 << 16);
}

fn bf16_matrix(rng: &mut Rng, n: usize) -> Vec<u16> {
    (0..n).map(|_| f32_to_bf16(rng.f32(-2.0, 2.0))).collect()
}

fn run_mma_bf16(entry: &str, a: &[u16], b: &[u16], c: &[f32]) -> Vec<f32> {
    let m = module("mma_bf16.ptx");
    let mut g = GlobalMemory::new();
    let bytes = |v: &[u16]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
    let (ia, ib, ic, id) = (g.alloc_bytes("A", &bytes(a)), g.alloc_bytes("B", &bytes(b)), g.alloc_f32("C", c), g.alloc("D", 16 * 8 * 4));
    run(&m, entry, 1, 32, 0, &[ptr(&g, ia), ptr(&g, ib), ptr(&g, ic), ptr(&g, id)], &mut g);
    g.read_f32(id)
}

/// D = A (16x16) * B (16x8) + C on the CPU.
fn matmul_ref(a: &dyn Fn(usize, usize) -> f64, b: &dyn Fn(usize, usize) -> f64, c: &[f32], k: usize) -> Vec<f64> {
    let mut d = vec![0.0; 128];
    for r in 0..16 {
        for n in 0..8 {
            d[r * 8 + n] = c[r * 8 + n] as f64 + (0..k).map(|kk| a(r, kk) * b(kk, n)).sum::<f64>();
        }
    }
    d
}

#[test]
fn mma_bf16_m16n8k16_fragments_match_cpu_matmul() {
    let mut rng = Rng(5);
    let a = bf16_matrix(&mut rng, 256);
    let b = bf16_matrix(&mut rng, 128);
    let c: Vec<f32> = (0..128).map(|_| rng.f32(-4.0, 4.0)).collect();
    let d = run_mma_bf16("mma_bf16", &a, &b, &c);
    let expect = matmul_ref(&|r, k| bf16_to_f32(a[r * 16 + k]) as f64, &|k, n| bf16_to_f32(b[k * 8 + n]) as f64, &c, 16);
    for i in 0..128 {
        assert!((d[i] as f64 - expect[i]).abs() <= 1e-5, "D[{}][{}] = {} expected {}", i / 8, i % 8, d[i], expect[i]);
    }
    // A loaded with rows and columns swapped is a different (wrong) product: A^T * B + C.
    let wrong = run_mma_bf16("mma_bf16_transposed", &a, &b, &c);
    let at = matmul_ref(&|r, k| bf16_to_f32(a[k * 16 + r]) as f64, &|k, n| bf16_to_f32(b[k * 8 + n]) as f64, &c, 16);
    let mismatches = (0..128).filter(|&i| (wrong[i] as f64 - expect[i]).abs() > 1e-3).count();
    assert!(mismatches > 100, "transposed A mapping should not reproduce A*B+C ({mismatches} mismatches)");
    for i in 0..128 {
        assert!((wrong[i] as f64 - at[i]).abs() <= 1e-5);
    }
}

#[test]
fn mma_bf16_single_element_probes() {
    // A = e_(r,k), B = e_(k,n) * 1 at a time: D has exactly one 1 at (r, n) — every fragment
    // position of A, B and D is exercised individually.
    let one = f32_to_bf16(1.0);
    let c = vec![0.0f32; 128];
    for (r, k, n) in [(0, 0, 0), (15, 15, 7), (3, 9, 5), (8, 1, 2), (12, 14, 0), (7, 8, 6)] {
        let mut a = vec![0u16; 256];
        let mut b = vec![0u16; 128];
        a[r * 16 + k] = one;
        b[k * 8 + n] = one;
        let d = run_mma_bf16("mma_bf16", &a, &b, &c);
        for (i, v) in d.iter().enumerate() {
            assert_eq!(*v, if i == r * 8 + n { 1.0 } else { 0.0 }, "probe A({r},{k}) B({k},{n}): D[{}][{}]", i / 8, i % 8);
        }
    }
}

struct Fp4Case {
    a: Vec<u8>,
    b: Vec<u8>,
    sfa: Vec<u8>,
    sfb: Vec<u8>,
    c: Vec<f32>,
}

fn fp4_case(rng: &mut Rng) -> Fp4Case {
    Fp4Case {
        a: (0..16 * 32).map(|_| rng.u32() as u8).collect(),
        b: (0..8 * 32).map(|_| rng.u32() as u8).collect(),
        // ue4m3 scales between 2^-3 and 2^3.
        sfa: (0..16 * 4).map(|_| 0x20 + (rng.u32() % 0x30) as u8).collect(),
        sfb: (0..8 * 4).map(|_| 0x20 + (rng.u32() % 0x30) as u8).collect(),
        c: (0..128).map(|_| rng.f32(-8.0, 8.0)).collect(),
    }
}

fn run_fp4(entry: &str, t: &Fp4Case) -> Vec<f32> {
    let m = module("mma_fp4.ptx");
    let mut g = GlobalMemory::new();
    let ids = [g.alloc_bytes("A", &t.a), g.alloc_bytes("B", &t.b), g.alloc_bytes("SFA", &t.sfa), g.alloc_bytes("SFB", &t.sfb), g.alloc_f32("C", &t.c), g.alloc("D", 128 * 4)];
    let args: Vec<KernelArg> = ids.iter().map(|i| ptr(&g, *i)).collect();
    run(&m, entry, 1, 32, 0, &args, &mut g);
    g.read_f32(ids[5])
}

/// e2m1 element k of a K-contiguous packed row (low nibble = even k), optionally nibble-swapped.
fn nib(row: &[u8], k: usize, swapped: bool) -> f64 {
    let byte = row[k / 2];
    let hi = (k % 2 == 1) != swapped;
    e2m1_to_f32(if hi { byte >> 4 } else { byte & 0xF }) as f64
}

#[test]
fn mma_block_scaled_nvfp4_matches_dequantised_matmul() {
    let mut rng = Rng(9);
    for _ in 0..3 {
        let t = fp4_case(&mut rng);
        let d = run_fp4("mma_nvfp4", &t);
        let sa = |r: usize, k: usize| e4m3_to_f32(t.sfa[r * 4 + k / 16]) as f64;
        let sb = |k: usize, n: usize| e4m3_to_f32(t.sfb[n * 4 + k / 16]) as f64;
        let expect = matmul_ref(&|r, k| nib(&t.a[r * 32..], k, false) * sa(r, k), &|k, n| nib(&t.b[n * 32..], k, false) * sb(k, n), &t.c, 64);
        for i in 0..128 {
            assert!(d[i].is_finite(), "D[{}][{}] is {} (a NaN scale from an unselected lane leaked in)", i / 8, i % 8, d[i]);
            assert!((d[i] as f64 - expect[i]).abs() <= 1e-5 * expect[i].abs().max(1.0), "D[{}][{}] = {} expected {}", i / 8, i % 8, d[i], expect[i]);
        }
        // The nibble order matters: reading A's nibbles swapped gives a different product.
        let swapped = matmul_ref(&|r, k| nib(&t.a[r * 32..], k, true) * sa(r, k), &|k, n| nib(&t.b[n * 32..], k, false) * sb(k, n), &t.c, 64);
        assert!((0..128).filter(|&i| (d[i] as f64 - swapped[i]).abs() > 1e-3).count() > 100);
    }
}

#[test]
fn mma_block_scaled_2x_ue8m0_uses_selected_bytes() {
    let mut rng = Rng(21);
    let mut t = fp4_case(&mut rng);
    // A scales live in bytes 2-3 (byte-id-a = 2), B scales in bytes 0-1; the other bytes are NaN.
    for r in 0..16 {
        t.sfa[r * 4..r * 4 + 4].copy_from_slice(&[0xFF, 0xFF, 120 + (r % 8) as u8, 130 - (r % 5) as u8]);
    }
    for n in 0..8 {
        t.sfb[n * 4..n * 4 + 4].copy_from_slice(&[125 + n as u8, 127, 0xFF, 0xFF]);
    }
    let d = run_fp4("mma_mxf4_2x_bytes23", &t);
    let ue8m0 = |c: u8| 2f64.powi(c as i32 - 127);
    let expect =
        matmul_ref(&|r, k| nib(&t.a[r * 32..], k, false) * ue8m0(t.sfa[r * 4 + 2 + k / 32]), &|k, n| nib(&t.b[n * 32..], k, false) * ue8m0(t.sfb[n * 4 + k / 32]), &t.c, 64);
    for i in 0..128 {
        assert!((d[i] as f64 - expect[i]).abs() <= 1e-5 * expect[i].abs().max(1.0), "D[{}][{}] = {} expected {}", i / 8, i % 8, d[i], expect[i]);
    }
}

#[test]
fn bar_sync_orders_shared_memory_across_warps_and_named_barriers() {
    let m = module("sync.ptx");
    let mut g = GlobalMemory::new();
    let o = g.alloc("out", 192 * 4);
    run(&m, "reverse_smem", 1, 128, 256, &[ptr(&g, o)], &mut g);
    let out = g.read_u32(o);
    for t in 0..128u32 {
        assert_eq!(out[t as usize], 3 * (127 - t) + 1, "phase 1 thread {t}");
    }
    for t in 0..64u32 {
        assert_eq!(out[128 + t as usize], t + 1000, "phase 2 thread {}", t + 64);
    }
}

#[test]
fn divergent_branches_and_loops_reconverge() {
    let m = module("sync.ptx");
    let mut g = GlobalMemory::new();
    let o = g.alloc("out", 64 * 4);
    run(&m, "divergence", 1, 32, 0, &[ptr(&g, o)], &mut g);
    let out = g.read_u32(o);
    let v = |l: u32| {
        (if l % 2 == 1 { 3 * l } else { l + 100 })
            + if l < 5 {
                1000
            } else if l < 10 {
                2000
            } else {
                0
            }
            + l * l.saturating_sub(1) / 2
    };
    for l in 0..32u32 {
        assert_eq!(out[l as usize], v(l), "v lane {l}");
        assert_eq!(out[32 + l as usize], v(31 - l), "shuffled lane {l}");
    }
}

#[test]
fn barrier_ignores_exited_threads() {
    let m = module("sync.ptx");
    let mut g = GlobalMemory::new();
    let o = g.alloc("out", 64 * 4);
    run(&m, "exit_then_barrier", 1, 64, 0, &[ptr(&g, o)], &mut g);
    let out = g.read_u32(o);
    for t in 0..64u32 {
        assert_eq!(out[t as usize], if t < 16 { t + 1 } else { 0 });
    }
}

#[test]
fn atomics_global_and_shared() {
    let m = module("sync.ptx");
    let blocks = 4usize;
    let n = blocks * 64;
    let mut g = GlobalMemory::new();
    let ids = [
        g.alloc("counter", 4),
        g.alloc("fsum", 4),
        g.alloc("gmax", 4),
        g.alloc("tickets", n * 4),
        g.alloc("block_sums", blocks * 4),
        g.alloc("cas_loc", 4),
        g.alloc("cas_out", n * 4),
    ];
    let args: Vec<KernelArg> = ids.iter().map(|i| ptr(&g, *i)).collect();
    let s = run(&m, "atomics", blocks as u32, 64, 0, &args, &mut g);
    assert_eq!(g.read_u32(ids[0]), vec![n as u32]);
    assert_eq!(g.read_f32(ids[1]), vec![1.5 * n as f32]);
    assert_eq!(g.read_u32(ids[2])[0], (0..n as u32).map(|t| t * 37 % 101).max().unwrap());
    let mut tickets = g.read_u32(ids[3]);
    tickets.sort();
    assert_eq!(tickets, (0..n as u32).collect::<Vec<_>>());
    assert_eq!(g.read_u32(ids[4]), vec![(0..64).sum::<u32>(); blocks]);
    let winner = g.read_u32(ids[5])[0];
    let cas = g.read_u32(ids[6]);
    assert_eq!(cas.iter().filter(|&&v| v == 0).count(), 1, "exactly one CAS succeeds");
    assert_eq!(cas[winner as usize - 1], 0);
    assert!(cas.iter().all(|&v| v == 0 || v == winner));
    // Per thread: 4 global atomics (each reads and writes 4 B) and 2 stores; one store per block.
    assert_eq!(s.global_bytes_written(), (n * 6 * 4 + blocks * 4) as u64);
    assert_eq!(s.global_bytes_read(), (n * 4 * 4) as u64);
}

#[test]
fn cp_async_groups_and_zero_fill() {
    let m = module("cp_async.ptx");
    let src: Vec<u32> = (0..128).map(|i| 1000 + i).collect();
    let mut g = GlobalMemory::new();
    let (s, o) = (g.alloc_u32("src", &src), g.alloc("out", 32 * 32));
    let st = run(&m, "cp_async_copy", 1, 32, 0, &[ptr(&g, s), ptr(&g, o)], &mut g);
    let out = g.read_u32(o);
    for t in 0..32usize {
        let r = 31 - t;
        for w in 0..4 {
            // src-size 16 - 4 (r % 4): the missing tail bytes are zero-filled.
            let e = if w < 4 - r % 4 { src[r * 4 + w] } else { 0 };
            assert_eq!(out[t * 8 + w], e, "thread {t} word {w}");
        }
        assert_eq!(out[t * 8 + 4], src[t * 4], "thread {t} extra");
    }
    // Only the bytes inside src-size are read from global memory.
    assert_eq!(st.global_bytes_read(), (0..32).map(|t| 16 - 4 * (t % 4) + 4).sum::<u64>());
    let o2 = g.alloc("out2", 8);
    run(&m, "cp_async_late", 1, 1, 0, &[ptr(&g, s), ptr(&g, o2)], &mut g);
    assert_eq!(g.read_u32(o2), vec![0, 1000]);
}

fn launch_err(file: &str, entry: &str, block: u32, bufs: &[usize]) -> String {
    let m = module(file);
    let mut g = GlobalMemory::new();
    let args: Vec<KernelArg> = bufs
        .iter()
        .enumerate()
        .map(|(i, n)| {
            let id = g.alloc(&format!("buf{i}"), *n);
            ptr(&g, id)
        })
        .collect();
    match launch(&m, entry, [1, 1, 1], [block, 1, 1], 0, &args, &mut g) {
        Ok(_) => panic!("{entry} should fail"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn execution_faults_name_the_line_and_instruction() {
    let e = launch_err("errors.ptx", "oob_store", 64, &[128]);
    assert!(e.contains("errors.ptx:18:") && e.contains("st.global.u32 [%rd3], %r1;") && e.contains("past the end of buffer 'buf0'"), "{e}");
    let e = launch_err("errors.ptx", "misaligned", 32, &[16]);
    assert!(e.contains("errors.ptx:30:") && e.contains("misaligned 4-byte load"), "{e}");
    let e = launch_err("errors.ptx", "shfl_divergent", 32, &[128]);
    assert!(e.contains("errors.ptx:48:") && e.contains("deadlock") && e.contains("0x0000ffff"), "{e}");
    let e = launch_err("errors.ptx", "shfl_bad_source", 32, &[128]);
    assert!(e.contains("errors.ptx:71:") && e.contains("reads lane 16"), "{e}");
    let e = launch_err("errors.ptx", "bar_mismatch", 64, &[4]);
    assert!(e.contains("deadlock") && e.contains("barrier 0") && e.contains("barrier 1"), "{e}");
    // mma.sync.aligned needs the full warp.
    let e = launch_err("mma_bf16.ptx", "mma_bf16", 16, &[512, 256, 512, 512]);
    assert!(e.contains("mma.sync.aligned") && e.contains("exited or do not exist"), "{e}");
}

#[test]
fn a_launch_that_writes_what_it_reads_through_nc_fails() {
    // .nc data must stay unchanged for the whole kernel (PTX ISA, ld .nc): a GPU may serve it
    // from a non-coherent cache. The error names the word: offset 0 in the first kernel, 4 in
    // the second.
    let e = launch_err("errors.ptx", "nc_after_write", 64, &[16]);
    assert!(e.contains("reads buffer 'buf0' + 0 with ld.global.nc and also writes it"), "{e}");
    let m = module("errors.ptx");
    let two_blocks = |plain: u32| {
        let mut g = GlobalMemory::new();
        let id = g.alloc("buf0", 16);
        launch(&m, "nc_other_block_writes", [2, 1, 1], [32, 1, 1], 0, &[ptr(&g, id), KernelArg::U32(plain)], &mut g).map_err(|e| e.to_string())
    };
    let e = two_blocks(0).unwrap_err();
    assert!(e.contains("nc_other_block_writes") && e.contains("reads buffer 'buf0' + 4 with ld.global.nc"), "{e}");
    // a coherent load of the written word, and .nc of a word nobody writes, are fine
    two_blocks(1).unwrap();
}

#[test]
fn unsupported_instruction_is_a_parse_error_with_line() {
    let p = ptx_path("unsupported.ptx");
    let e = Module::parse(&std::fs::read_to_string(&p).unwrap(), "unsupported.ptx").unwrap_err().to_string();
    assert!(e.starts_with("unsupported.ptx:16:") && e.contains("mbarrier.init.shared::cta.b64 [%r1], 32;") && e.contains("unsupported instruction 'mbarrier'"), "{e}");
}

fn parse_err(body: &str) -> String {
    let src = format!(".version 8.7\n.target sm_120a\n.address_size 64\n.visible .entry k(.param .u64 p)\n{{\n{body}\n}}\n");
    match Module::parse(&src, "inline.ptx") {
        Ok(_) => panic!("should not parse:\n{body}"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn malformed_or_unsupported_ptx_is_rejected() {
    let e = parse_err(".reg .b32 %r<2>;\nadd.cc.u32 %r1, %r1, %r0;\nret;");
    assert!(e.contains("inline.ptx:7:") && e.contains("unsupported modifier .cc"), "{e}");
    let e = parse_err(".reg .b32 %r<2>;\nadd.u32 %r2, %r1, %r0;");
    assert!(e.contains("inline.ptx:7:") && e.contains("undeclared register '%r2'"), "{e}");
    let e = parse_err(".reg .f32 %f<2>;\nadd.rz.f32 %f1, %f1, %f0;");
    assert!(e.contains("unsupported modifier .rz"), "{e}");
    let e = parse_err(".reg .b32 %r<2>;\nbra $L_nowhere;");
    assert!(e.contains("unknown label '$L_nowhere'"), "{e}");
    let e = parse_err(".reg .b32 %r<2>;\nmma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%r0}, {%r0}, {%r0}, {%r0};");
    assert!(e.contains("unsupported mma shape"), "{e}");
    let e = parse_err(".reg .b32 %r<2>\nret;");
    assert!(e.contains("inline.ptx:7:") && e.contains("expected ';'"), "{e}");
}

#[test]
fn launch_checks_entry_arguments_and_limits() {
    let m = module("basic.ptx");
    let mut g = GlobalMemory::new();
    let err = |r: Result<LaunchStats, EmuError>| r.unwrap_err().to_string();
    let e = err(launch(&m, "nope", [1, 1, 1], [32, 1, 1], 0, &[], &mut g));
    assert!(e.contains("no entry named 'nope'") && e.contains("vec_add"), "{e}");
    let e = err(launch(&m, "vec_add", [1, 1, 1], [32, 1, 1], 0, &[KernelArg::U64(0)], &mut g));
    assert!(e.contains("1 argument(s) given, kernel takes 4"), "{e}");
    let e = err(launch(&m, "vec_add", [1, 1, 1], [32, 1, 1], 0, &[KernelArg::U64(0), KernelArg::U64(0), KernelArg::U64(0), KernelArg::U64(5)], &mut g));
    assert!(e.contains("argument 4 (u64 0x5) does not match parameter 'n' (.u32, 4 B)"), "{e}");
    let e = err(launch(&m, "vec_add", [1, 1, 1], [2048, 1, 1], 0, &[KernelArg::U64(0), KernelArg::U64(0), KernelArg::U64(0), KernelArg::U32(0)], &mut g));
    assert!(e.contains("2048 threads"), "{e}");
    let e = err(launch(&m, "vec_add", [1, 1, 1], [32, 1, 1], 200_000, &[KernelArg::U64(0), KernelArg::U64(0), KernelArg::U64(0), KernelArg::U32(0)], &mut g));
    assert!(e.contains("exceeds the SM120 limit of 101376 B"), "{e}");
}

#[test]
fn parser_never_panics_on_mutated_sources() {
    let mut rng = Rng(99);
    let files = ["basic.ptx", "cvt.ptx", "mma_fp4.ptx", "sync.ptx", "ldmatrix.ptx", "cp_async.ptx"];
    let junk = ["{", "}", "[", "]", ",", ";", "%r1", "-", "0x", "0f3F80", ".reg", ".b8", "@", "!", "|", "<99999999999>", "::", "mma.sync", "_", "1e", "\"", "/*"];
    for f in files {
        let src = std::fs::read_to_string(ptx_path(f)).unwrap();
        for _ in 0..300 {
            let mut b: Vec<char> = src.chars().collect();
            for _ in 0..1 + rng.u32() % 4 {
                let at = rng.u32() as usize % b.len();
                match rng.u32() % 3 {
                    0 => {
                        b.remove(at);
                    }
                    1 => b.splice(at..at, junk[rng.u32() as usize % junk.len()].chars()).for_each(drop),
                    _ => b.truncate(at),
                }
            }
            let text: String = b.into_iter().collect();
            let r = std::panic::catch_unwind(|| Module::parse(&text, f).map(|m| m.entries.len()));
            assert!(r.is_ok(), "parser panicked on a mutation of {f}:\n{text}");
        }
    }
}

/// Emulator speed on this machine (run with `--ignored --nocapture`).
#[test]
#[ignore]
fn emulator_throughput() {
    let m = module("basic.ptx");
    let n = 1 << 20;
    let mut g = GlobalMemory::new();
    let (a, b, c) = (g.alloc_f32("a", &vec![1.0; n]), g.alloc_f32("b", &vec![2.0; n]), g.alloc("c", n * 4));
    let s = run(&m, "vec_add", (n / 256) as u32, 256, 0, &[ptr(&g, a), ptr(&g, b), ptr(&g, c), KernelArg::U32(n as u32)], &mut g);
    println!(
        "vec_add n={n}: {} thread instructions in {:.3} s = {:.1} M thread-instr/s ({:.1} M warp-instr/s)",
        s.counters.thread_instructions,
        s.elapsed.as_secs_f64(),
        s.thread_instructions_per_second() / 1e6,
        s.counters.warp_instructions as f64 / s.elapsed.as_secs_f64() / 1e6
    );
    let t = fp4_case(&mut Rng(1));
    let m = module("mma_fp4.ptx");
    let mut g = GlobalMemory::new();
    let ids = [g.alloc_bytes("A", &t.a), g.alloc_bytes("B", &t.b), g.alloc_bytes("SFA", &t.sfa), g.alloc_bytes("SFB", &t.sfb), g.alloc_f32("C", &t.c), g.alloc("D", 128 * 4)];
    let args: Vec<KernelArg> = ids.iter().map(|i| ptr(&g, *i)).collect();
    let blocks = 4096;
    let s = run(&m, "mma_nvfp4", blocks, 32, 0, &args, &mut g);
    println!(
        "mma_nvfp4 x{blocks} (one m16n8k64 + {} other warp instructions each): {:.3} s = {:.0} block-scaled mma/s",
        s.counters.warp_instructions / blocks as u64 - 1,
        s.elapsed.as_secs_f64(),
        blocks as f64 / s.elapsed.as_secs_f64()
    );
}
