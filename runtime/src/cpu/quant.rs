//! NVFP4 on the CPU: on-the-fly activation quantisation (W4A4) and weight row decoding.

use crate::numerics::{e2m1_to_f32, e4m3_to_f32, f32_to_e2m1, f32_to_e4m3};

/// NVFP4 block: 16 consecutive values along K share one E4M3 scale.
pub const BLOCK: usize = 16;

/// Quantises one activation row (length a multiple of 16) as the W4A4 GEMM does, writing
/// `e2m1(code) * float(sf)` per element; the global `input_scale` is left out (it is folded into
/// the GEMM's alpha). Per block: `sf = e4m3((inv * amax) / 6)` with `inv = 1 / input_scale`
/// (round to nearest even, saturating at 448), `code = e2m1_rne((x * inv) / sf)`, code 0 when
/// `sf` is 0.
pub fn quantize_row(x: &[f32], input_scale: f32, out: &mut [f32]) {
    let inv = 1.0 / input_scale;
    for (xb, ob) in x.chunks_exact(BLOCK).zip(out.chunks_exact_mut(BLOCK)) {
        let amax = xb.iter().fold(0f32, |m, v| m.max(v.abs()));
        let sf = e4m3_to_f32(f32_to_e4m3((inv * amax) / 6.0));
        if sf == 0.0 || !sf.is_finite() {
            ob.fill(0.0);
            continue;
        }
        for (o, &v) in ob.iter_mut().zip(xb) {
            *o = e2m1_to_f32(f32_to_e2m1((v * inv) / sf)) * sf;
        }
    }
}

/// The block scale (E4M3 code) and E2M1 codes of one activation block, for tests and reports.
pub fn quantize_block_codes(x: &[f32], input_scale: f32) -> (u8, Vec<u8>) {
    let inv = 1.0 / input_scale;
    let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
    let sf_code = f32_to_e4m3((inv * amax) / 6.0);
    let sf = e4m3_to_f32(sf_code);
    let codes = x.iter().map(|&v| if sf == 0.0 { 0 } else { f32_to_e2m1((v * inv) / sf) }).collect();
    (sf_code, codes)
}

/// `e2m1 * float(e4m3)` for every (byte, scale) pair would be a 64 Ki table; instead decode
/// nibbles through the 16-entry E2M1 table and multiply by the block scale (exact in f32).
pub(crate) const E2M1: [f32; 16] = {
    let mag = crate::numerics::E2M1_VALUES;
    let mut t = [0f32; 16];
    let mut i = 0;
    while i < 8 {
        t[i] = mag[i];
        t[i + 8] = -mag[i];
        i += 1;
    }
    t
};

/// Every E4M3 code's value (NaN codes 0x7F/0xFF decode to NaN), built bit by bit at compile time
/// so block scales decode with one load; equal to `numerics::e4m3_to_f32` (tested below).
pub(crate) static E4M3_LUT: [f32; 256] = {
    let mut t = [0f32; 256];
    let mut code = 0;
    while code < 256 {
        let (exp, mant) = ((code >> 3) & 0xF, code & 0x7);
        let mag = if exp == 0xF && mant == 0x7 {
            f32::NAN
        } else if exp == 0 {
            // Subnormal: mant * 2^-9, exact.
            mant as f32 / 512.0
        } else {
            // (1 + mant/8) * 2^(exp-7): f32 exponent field exp - 7 + 127.
            f32::from_bits((((exp + 120) as u32) << 23) | ((mant as u32) << 20))
        };
        t[code] = if code & 0x80 != 0 { -mag } else { mag };
        code += 1;
    }
    t
};

/// Both E2M1 values of every packed byte (low nibble first), so a W4A4 dot product needs one
/// table load per weight byte.
static E2M1_PAIRS: [[f32; 2]; 256] = {
    let mut t = [[0f32; 2]; 256];
    let mut b = 0;
    while b < 256 {
        t[b] = [E2M1[b & 0xF], E2M1[b >> 4]];
        b += 1;
    }
    t
};

/// `Σ_k x[k] · (e2m1 · float(scale))` over row `n` of an NVFP4 matrix, without decoding the row
/// first (the W4A4 decode path: every product of an E2M1 weight and a quantised activation is
/// exact in f32, so only the summation order differs from decode-then-dot).
pub fn dot_row(packed: &[u8], scales: &[u8], k: usize, n: usize, x: &[f32]) -> f32 {
    let row = &packed[n * k / 2..(n + 1) * k / 2];
    let row_scales = &scales[n * k / BLOCK..(n + 1) * k / BLOCK];
    let mut total = 0f32;
    for ((bytes, &sf), xb) in row.chunks_exact(BLOCK / 2).zip(row_scales).zip(x.chunks_exact(BLOCK)) {
        let mut acc = [0f32; 2];
        for (&b, xp) in bytes.iter().zip(xb.chunks_exact(2)) {
            let w = E2M1_PAIRS[b as usize];
            acc[0] += w[0] * xp[0];
            acc[1] += w[1] * xp[1];
        }
        total += (acc[0] + acc[1]) * E4M3_LUT[sf as usize];
    }
    total
}

/// Decodes row `n` of an NVFP4 matrix (`packed` `[N, K/2]`, low nibble = even k; `scales`
/// `[N, K/16]` E4M3) into `out` (length K) as `(e2m1 * float(scale)) * mul`. With `mul = 1` the
/// values are exact; W4A16 passes `weight_scale_2` so each element is rounded once, as the
/// ModelOpt dequantisation `W = e2m1 * scale * scale_2` is.
pub fn decode_row(packed: &[u8], scales: &[u8], k: usize, n: usize, mul: f32, out: &mut [f32]) {
    let row = &packed[n * k / 2..(n + 1) * k / 2];
    let row_scales = &scales[n * k / BLOCK..(n + 1) * k / BLOCK];
    for ((bytes, &sf), ob) in row.chunks_exact(BLOCK / 2).zip(row_scales).zip(out.chunks_exact_mut(BLOCK)) {
        let s = E4M3_LUT[sf as usize];
        for (&b, pair) in bytes.iter().zip(ob.chunks_exact_mut(2)) {
            pair[0] = (E2M1[(b & 0xF) as usize] * s) * mul;
            pair[1] = (E2M1[(b >> 4) as usize] * s) * mul;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The fused W4A4 dot equals decode-then-sum up to f32 summation order.
    #[test]
    fn dot_row_matches_decode_row() {
        let k = 64;
        let w: Vec<f32> = (0..3 * k).map(|i| ((i * 37 % 101) as f32 - 50.0) / 17.0).collect();
        let (packed, scales, _) = crate::numerics::quantize_nvfp4(&w, 3, k);
        let x: Vec<f32> = (0..k).map(|i| ((i * 13 % 29) as f32 - 14.0) / 3.0).collect();
        for n in 0..3 {
            let mut row = vec![0f32; k];
            decode_row(&packed, &scales, k, n, 1.0, &mut row);
            let want: f64 = row.iter().zip(&x).map(|(a, b)| *a as f64 * *b as f64).sum();
            let got = dot_row(&packed, &scales, k, n, &x) as f64;
            assert!((got - want).abs() <= 1e-5 * want.abs().max(1.0), "row {n}: {got} vs {want}");
        }
    }
    use crate::numerics::quantize_nvfp4;

    #[test]
    fn activation_blocks_get_their_own_scale() {
        // input_scale 1: block 0 amax 6 -> sf 1; block 1 amax 12 -> sf 2.
        let mut x = [0f32; 32];
        x[0] = 6.0;
        x[1] = 0.7; // -> 0.5 (0.7 is nearer 0.5 than 1.0)
        x[2] = -0.75; // tie between 0.5 and 1.0 -> even code 1.0
        x[16] = 12.0;
        x[17] = 5.0; // 2.5 after the scale: tie between 2 and 3 -> 2, times sf 2 -> 4
        let mut out = [0f32; 32];
        quantize_row(&x, 1.0, &mut out);
        assert_eq!(&out[..3], &[6.0, 0.5, -1.0]);
        assert_eq!(&out[16..18], &[12.0, 4.0]);
        let (sf, codes) = quantize_block_codes(&x[16..], 1.0);
        assert_eq!(e4m3_to_f32(sf), 2.0);
        assert_eq!(codes[0], 7);
    }

    #[test]
    fn e4m3_table_matches_the_reference_decoder() {
        for code in 0..=255u8 {
            let (a, b) = (E4M3_LUT[code as usize], e4m3_to_f32(code));
            assert!(a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan()), "{code:#x}: {a} vs {b}");
        }
    }

    #[test]
    fn zero_blocks_quantise_to_zero() {
        let mut out = [1f32; 16];
        quantize_row(&[0.0; 16], 0.5, &mut out);
        assert_eq!(out, [0.0; 16]);
    }

    #[test]
    fn decode_inverts_the_modelopt_quantiser() {
        let (n, k) = (3, 32);
        let w: Vec<f32> = (0..n * k).map(|i| ((i * 7 % 23) as f32 - 11.0) * 0.05).collect();
        let (packed, scales, s2) = quantize_nvfp4(&w, n, k);
        let mut row = vec![0f32; k];
        for r in 0..n {
            decode_row(&packed, &scales, k, r, s2, &mut row);
            for c in 0..k {
                let code = crate::numerics::nibble(&packed, k / 2, r, c);
                let want = e2m1_to_f32(code) * e4m3_to_f32(scales[r * k / 16 + c / 16]) * s2;
                assert_eq!(row[c], want);
            }
        }
    }
}
