//! Number formats of the NVFP4 path and ModelOpt quantisation. The bit-exact conversions live in
//! the emulator crate (`kiln_emu::formats`: the emulator's `cvt` needs them and must not depend on
//! the runtime); they are re-exported here so there is one implementation.

pub use kiln_emu::formats::{f32_to_bf16, bf16_to_f32, round_bf16, float_bytes, bytes_floats, E4M3_MAX, e4m3_to_f32, f32_to_e4m3, E2M1_VALUES, e2m1_to_f32, f32_to_e2m1};

/// One value of an NVFP4 tensor: `weight` is `[N, K/2]`, low nibble = even k.
pub fn nibble(packed: &[u8], row_bytes: usize, n: usize, k: usize) -> u8 {
    let byte = packed[n * row_bytes + k / 2];
    if k % 2 == 0 {
        byte & 0xF
    } else {
        byte >> 4
    }
}

/// ModelOpt NVFP4 quantisation of a row-major `[n, k]` matrix: returns (packed `[n, k/2]`,
/// block scales `[n, k/16]` as E4M3 codes, weight_scale_2). Blocks of zeros get scale 1.0.
pub fn quantize_nvfp4(w: &[f32], n: usize, k: usize) -> (Vec<u8>, Vec<u8>, f32) {
    assert_eq!(w.len(), n * k);
    assert_eq!(k % 16, 0, "NVFP4 needs k divisible by 16");
    let scale_2 = nvfp4_scale_2(w.iter().fold(0f32, |m, v| m.max(v.abs())));
    let (packed, scales) = quantize_nvfp4_blocks(w, k, scale_2, true);
    (packed, scales, scale_2)
}

/// The scale of an FP8 (E4M3) indexer key: the smallest power of two `s` with `amax / s <= 448`
/// (DeepSeek's `act_quant(.., scale_fmt="ue8m0")`), read off the bits of `amax / 448` as the
/// kernel divides it in f32: its exponent, one up unless it is a power of two. At least the
/// smallest normal f32 (a subnormal ratio); 1 for a key of zeros (or a non-finite one).
pub fn fp8_key_scale(amax: f32) -> f32 {
    if !(amax > 0.0 && amax.is_finite()) {
        return 1.0;
    }
    let bits = (amax / E4M3_MAX).to_bits();
    let exponent = bits & 0x7f80_0000;
    if exponent == 0 {
        return f32::MIN_POSITIVE;
    }
    f32::from_bits(exponent + if bits & 0x007f_ffff != 0 { 0x0080_0000 } else { 0 })
}

/// The key [`quantize_fp8_key`] makes, in place: each value becomes its code's value times the
/// scale (what the FP8 cache holds and the indexer scores); returns the scale.
pub fn round_fp8_key(key: &mut [f32]) -> f32 {
    let scale = fp8_key_scale(key.iter().fold(0f32, |m, v| m.max(v.abs())));
    key.iter_mut().for_each(|v| *v = e4m3_to_f32(f32_to_e4m3(*v / scale)) * scale);
    scale
}

/// An indexer key as the FP8 cache holds it: E4M3 codes of `key / s` (round to nearest even,
/// saturating; the division by a power of two is exact) and the scale `s`
/// ([`fp8_key_scale`] of the key's largest magnitude). A code's value times `s` is exact in f32.
pub fn quantize_fp8_key(key: &[f32], codes: &mut [u8]) -> f32 {
    let scale = fp8_key_scale(key.iter().fold(0f32, |m, v| m.max(v.abs())));
    for (c, &v) in codes.iter_mut().zip(key) {
        *c = f32_to_e4m3(v / scale);
    }
    scale
}

/// The largest magnitude of little-endian BF16 values, NaNs skipped (as `f32::max` skips them):
/// the largest of the magnitudes' bit patterns, which order as the values do.
pub fn bf16_amax(data: &[u8]) -> f32 {
    let bits = data.chunks_exact(2).map(|b| u16::from_le_bytes([b[0], b[1]]) & 0x7fff).filter(|&m| m <= 0x7f80).max();
    bf16_to_f32(bits.unwrap_or(0))
}

/// ModelOpt's `weight_scale_2` of a tensor whose largest magnitude is `amax`.
pub fn nvfp4_scale_2(amax: f32) -> f32 {
    if amax > 0.0 {
        amax / (6.0 * E4M3_MAX)
    } else {
        1.0
    }
}

/// The block scales (`[rows, k/16]` E4M3 codes) and, where `codes`, the packed values
/// (`[rows, k/2]`; else empty) of row-major rows of `k` values under the tensor's `scale_2`.
/// Each 16-value block depends only on itself and `scale_2`, so any block-aligned piece of a
/// tensor quantises to the same bits as that piece of the whole (binding quantises a rank's
/// share only). Rows in parallel.
pub fn quantize_nvfp4_blocks(w: &[f32], k: usize, scale_2: f32, codes: bool) -> (Vec<u8>, Vec<u8>) {
    use rayon::prelude::*;
    assert_eq!(k % 16, 0, "NVFP4 needs k divisible by 16");
    let rows = w.len() / k.max(1);
    if rows == 0 {
        return (Vec::new(), Vec::new());
    }
    let mut packed = vec![0u8; if codes { rows * k / 2 } else { 0 }];
    let mut scales = vec![0u8; rows * k / 16];
    let quantise_row = |r: usize, scales: &mut [u8], packed: &mut [u8]| {
        for (b, block) in w[r * k..(r + 1) * k].chunks_exact(16).enumerate() {
            let bmax = block.iter().fold(0f32, |m, v| m.max(v.abs()));
            let sf = if bmax == 0.0 { f32_to_e4m3(1.0) } else { f32_to_e4m3((bmax / (6.0 * scale_2)).max(2f32.powi(-9))) };
            scales[b] = sf;
            if packed.is_empty() {
                continue;
            }
            let denom = e4m3_to_f32(sf) * scale_2;
            for (j, pair) in block.chunks_exact(2).enumerate() {
                packed[b * 8 + j] = f32_to_e2m1(pair[0] / denom) | f32_to_e2m1(pair[1] / denom) << 4;
            }
        }
    };
    if codes {
        scales.par_chunks_mut(k / 16).zip(packed.par_chunks_mut(k / 2)).enumerate().for_each(|(r, (s, p))| quantise_row(r, s, p));
    } else {
        scales.par_chunks_mut(k / 16).enumerate().for_each(|(r, s)| quantise_row(r, s, &mut []));
    }
    (packed, scales)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The FP8 key scale is the smallest power of two taking the largest magnitude to at most
    /// 448, and the codes are E4M3 of the scaled values (values by hand).
    #[test]
    fn fp8_keys_scale_by_the_smallest_power_of_two() {
        assert_eq!(fp8_key_scale(448.0), 1.0, "exactly 448: no headroom needed");
        assert_eq!(fp8_key_scale(449.0), 2.0);
        assert_eq!(fp8_key_scale(3.5), 2f32.powi(-7), "3.5 / 2^-7 = 448");
        assert_eq!(fp8_key_scale(3.6), 2f32.powi(-6));
        assert_eq!(fp8_key_scale(0.0), 1.0);
        assert_eq!(fp8_key_scale(f32::NAN), 1.0);
        assert_eq!(fp8_key_scale(1e-42), f32::MIN_POSITIVE, "a subnormal ratio");
        let key = [3.0f32, -1.25, 0.1, 0.0];
        let mut codes = [0u8; 4];
        let s = quantize_fp8_key(&key, &mut codes);
        assert_eq!(s, 2f32.powi(-7));
        // 3 * 128 = 384 (exact), -1.25 * 128 = -160 (exact), 0.1 * 128 = 12.8 -> 13 (spacing 1 in [8, 16))
        let values: Vec<f32> = codes.iter().map(|&c| e4m3_to_f32(c) * s).collect();
        assert_eq!(values, [3.0, -1.25, 13.0 / 128.0, 0.0]);
        // 12.5 * 2^-7 lies halfway between 12 and 13 (scaled): ties to the even code, 12
        let mut c = [0u8; 2];
        quantize_fp8_key(&[3.0, 12.5 / 128.0], &mut c);
        assert_eq!(e4m3_to_f32(c[1]), 12.0);
    }

    #[test]
    fn bf16_rounds_to_nearest_even() {
        assert_eq!(f32_to_bf16(1.0), 0x3F80);
        // 1 + 2^-8 is exactly halfway between two bf16 values: ties to even (down).
        assert_eq!(f32_to_bf16(1.0 + 2f32.powi(-8)), 0x3F80);
        // 1 + 3*2^-8 is halfway, the even neighbour is above.
        assert_eq!(f32_to_bf16(1.0 + 3.0 * 2f32.powi(-8)), 0x3F82);
        assert_eq!(bf16_to_f32(0xC040), -3.0);
    }

    #[test]
    fn e4m3_matches_the_format_table() {
        assert_eq!(f32_to_e4m3(1.0), 0x38);
        assert_eq!(f32_to_e4m3(448.0), 0x7E);
        assert_eq!(f32_to_e4m3(1e6), 0x7E, "satfinite");
        assert_eq!(f32_to_e4m3(-1e6), 0xFE);
        assert_eq!(f32_to_e4m3(2f32.powi(-9)), 0x01, "smallest subnormal");
        assert_eq!(f32_to_e4m3(2f32.powi(-10)), 0x00, "half the smallest subnormal ties to even 0");
        assert_eq!(f32_to_e4m3(1.0625), 0x38, "1 + 1/16 ties to even mantissa 0");
        assert_eq!(f32_to_e4m3(1.1875), 0x3A, "1 + 3/16 ties to even mantissa 2");
        for code in 0u8..=0xFE {
            if code & 0x7F == 0x7F {
                continue;
            }
            let v = e4m3_to_f32(code);
            let back = f32_to_e4m3(v);
            assert!(back == code || (v == 0.0), "code {code:#x} -> {v} -> {back:#x}");
        }
    }

    #[test]
    fn e2m1_ties_go_to_the_even_code() {
        let cases = [(0.25, 0.0), (0.75, 1.0), (1.25, 1.0), (1.75, 2.0), (2.5, 2.0), (3.5, 4.0), (5.0, 4.0), (7.0, 6.0), (0.26, 0.5)];
        for (x, want) in cases {
            assert_eq!(e2m1_to_f32(f32_to_e2m1(x)), want, "{x}");
            assert_eq!(e2m1_to_f32(f32_to_e2m1(-x)), -want, "-{x}");
        }
        assert_eq!(f32_to_e2m1(f32::NAN), 0x7, "satfinite NaN is +MAX_NORM");
    }

    #[test]
    fn nvfp4_roundtrip_is_close() {
        let k = 32;
        let w: Vec<f32> = (0..2 * k).map(|i| ((i as f32) * 0.37).sin()).collect();
        let (packed, scales, s2) = quantize_nvfp4(&w, 2, k);
        for r in 0..2 {
            for c in 0..k {
                let v = e2m1_to_f32(nibble(&packed, k / 2, r, c)) * e4m3_to_f32(scales[r * k / 16 + c / 16]) * s2;
                assert!((v - w[r * k + c]).abs() <= 0.25 * w[r * k..r * k + k].iter().fold(0f32, |m, x| m.max(x.abs())), "{r},{c}");
            }
        }
    }
}
