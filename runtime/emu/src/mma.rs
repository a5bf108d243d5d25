//! `mma.sync.aligned` with the fragment layouts of the PTX ISA (§9.7.14.5.8 m16n8k16 f16/bf16,
//! §9.7.14.5.11 m16n8k64 e2m1, §9.7.14.3 block scaling). With `g = laneid >> 2` and
//! `q = laneid % 4`:
//!
//! * m16n8k16 A (four .b32, a0..a7, low half first): row `g` for a0,a1,a4,a5 else `g + 8`;
//!   col `2q + (i & 1)` (+8 for i >= 4). B (two .b32, b0..b3): row `2q + (i & 1)` (+8 for
//!   i >= 2), col `g`.
//! * m16n8k64 A (four .b32, a0..a31, element i in bits [4(i%8)+3 : 4(i%8)] of register i/8):
//!   row `g` for i < 8 or 16 <= i < 24 else `g + 8`; col `8q + (i & 7)` (+32 for i >= 16).
//!   B (two .b32, b0..b15): row `8q + (i & 7)` (+32 for i >= 8), col `g`.
//! * C/D (four .f32): row `g` for c0,c1 else `g + 8`; col `2q + (i & 1)`.
//! * Scales: `thread-id-a` picks the lane pair `q in {2t, 2t+1}` of each quad; the lower lane of
//!   the pair supplies row `g`, the upper row `g + 8`. `thread-id-b` picks lane `q == t`, which
//!   supplies column `g`. Byte `byte-id + kb` of the register is the scale of K block `kb`
//!   (16 wide for 4X, 32 for 2X).
//!
//! Products are exact; the sum is formed in f64 and rounded once to f32 (the ISA leaves the
//! accumulation order and intermediate rounding unspecified).

use super::convert::f16_to_f32;
use super::ir::{Mma, MmaKind};
use super::warp::{LaunchCtx, Warp};
use crate::formats::{bf16_to_f32, e2m1_to_f32, e4m3_to_f32};

fn ue8m0(code: u8) -> f64 {
    if code == 0xFF {
        f64::NAN
    } else {
        2f64.powi(code as i32 - 127)
    }
}

impl Warp {
    /// Reads C from its fragments into a 16x8 matrix.
    fn gather_c(&self, m: &Mma, lc: &LaunchCtx) -> [[f64; 8]; 16] {
        let mut c = [[0f64; 8]; 16];
        for lane in 0..32 {
            let (g, q) = (lane >> 2, lane & 3);
            for (i, op) in m.c.iter().enumerate() {
                let row = if i < 2 { g } else { g + 8 };
                c[row][2 * q + (i & 1)] = f32::from_bits(self.val(op, lane, lc) as u32) as f64;
            }
        }
        c
    }

    fn scatter_d(&mut self, m: &Mma, d: &[[f64; 8]; 16]) {
        for lane in 0..32 {
            let (g, q) = (lane >> 2, lane & 3);
            for (i, op) in m.d.iter().enumerate() {
                let row = if i < 2 { g } else { g + 8 };
                let v = d[row][2 * q + (i & 1)] as f32;
                let bits = if v.is_nan() { super::alu::CANONICAL_NAN32 } else { v.to_bits() };
                self.set(op, lane, bits as u64);
            }
        }
    }

    pub(super) fn mma(&mut self, m: &Mma, lc: &LaunchCtx) -> Result<(), String> {
        let c = self.gather_c(m, lc);
        let mut d = [[0f64; 8]; 16];
        match m.kind {
            MmaKind::Dense16 { f16 } => {
                let dec = |h: u64| -> f64 {
                    let h = (h & 0xFFFF) as u16;
                    if f16 {
                        f16_to_f32(h) as f64
                    } else {
                        bf16_to_f32(h) as f64
                    }
                };
                let mut a = [[0f64; 16]; 16];
                let mut b = [[0f64; 8]; 16];
                for lane in 0..32 {
                    let (g, q) = (lane >> 2, lane & 3);
                    let aw: Vec<u64> = m.a.iter().map(|op| self.val(op, lane, lc)).collect();
                    let bw: Vec<u64> = m.b.iter().map(|op| self.val(op, lane, lc)).collect();
                    for i in 0..8 {
                        let h = aw[i / 2] >> (16 * (i % 2));
                        let row = if i < 2 || (4..6).contains(&i) { g } else { g + 8 };
                        let col = 2 * q + (i & 1) + if i >= 4 { 8 } else { 0 };
                        a[row][col] = dec(h);
                    }
                    for i in 0..4 {
                        let h = bw[i / 2] >> (16 * (i % 2));
                        let row = 2 * q + (i & 1) + if i >= 2 { 8 } else { 0 };
                        b[row][g] = dec(h);
                    }
                }
                for r in 0..16 {
                    for n in 0..8 {
                        d[r][n] = (0..16).map(|k| a[r][k] * b[k][n]).sum::<f64>() + c[r][n];
                    }
                }
            }
            MmaKind::Fp4BlockScaled { scale_vec, ue4m3 } => {
                let mut a = [[0f64; 64]; 16];
                let mut b = [[0f64; 8]; 64];
                for lane in 0..32 {
                    let (g, q) = (lane >> 2, lane & 3);
                    let aw: Vec<u64> = m.a.iter().map(|op| self.val(op, lane, lc)).collect();
                    let bw: Vec<u64> = m.b.iter().map(|op| self.val(op, lane, lc)).collect();
                    for i in 0..32 {
                        let nib = (aw[i / 8] >> (4 * (i % 8))) & 0xF;
                        let row = if i < 8 || (16..24).contains(&i) { g } else { g + 8 };
                        let col = 8 * q + (i & 7) + if i >= 16 { 32 } else { 0 };
                        a[row][col] = e2m1_to_f32(nib as u8) as f64;
                    }
                    for i in 0..16 {
                        let nib = (bw[i / 8] >> (4 * (i % 8))) & 0xF;
                        let row = 8 * q + (i & 7) + if i >= 8 { 32 } else { 0 };
                        b[row][g] = e2m1_to_f32(nib as u8) as f64;
                    }
                }
                let sel = |k: usize| -> Result<u32, String> { self.uniform(&m.scales[k], u32::MAX, lc, "scale selector").map(|v| (v & 0xFFFF) as u32) };
                let (byte_a, tid_a, byte_b, tid_b) = (sel(1)?, sel(2)?, sel(4)?, sel(5)?);
                let byte_ok = |v: u32| match scale_vec {
                    4 => v == 0,
                    _ => v == 0 || v == 2,
                };
                if !byte_ok(byte_a) || !byte_ok(byte_b) || tid_a > 1 || tid_b > 3 {
                    return Err(format!("invalid scale selectors {{byte-id-a {byte_a}, thread-id-a {tid_a}}}, {{byte-id-b {byte_b}, thread-id-b {tid_b}}} for scale_vec::{scale_vec}X (PTX Table 37)"));
                }
                let dec = |word: u64, byte: u32| -> f64 {
                    let code = ((word >> (8 * byte)) & 0xFF) as u8;
                    if ue4m3 {
                        e4m3_to_f32(code & 0x7F) as f64
                    } else {
                        ue8m0(code)
                    }
                };
                let sv = scale_vec as usize;
                let mut sfa = [[0f64; 4]; 16];
                for (r, row) in sfa.iter_mut().enumerate() {
                    let lane = 4 * (r % 8) + 2 * tid_a as usize + r / 8;
                    let word = self.val(&m.scales[0], lane, lc);
                    for (kb, s) in row.iter_mut().enumerate().take(sv) {
                        *s = dec(word, byte_a + kb as u32);
                    }
                }
                let mut sfb = [[0f64; 4]; 8];
                for (n, col) in sfb.iter_mut().enumerate() {
                    let lane = 4 * n + tid_b as usize;
                    let word = self.val(&m.scales[3], lane, lc);
                    for (kb, s) in col.iter_mut().enumerate().take(sv) {
                        *s = dec(word, byte_b + kb as u32);
                    }
                }
                let block = 64 / sv;
                for r in 0..16 {
                    for n in 0..8 {
                        let mut acc = c[r][n];
                        for kb in 0..sv {
                            // Exact: e2m1 products and scale products fit f64's significand.
                            let part: f64 = (kb * block..(kb + 1) * block).map(|k| a[r][k] * b[k][n]).sum();
                            acc += part * (sfa[r][kb] * sfb[n][kb]);
                        }
                        d[r][n] = acc;
                    }
                }
            }
        }
        self.scatter_d(m, &d);
        Ok(())
    }
}
