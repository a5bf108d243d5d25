//! Number formats of the NVFP4 path, bit-exact: BF16, FP8 E4M3 (ue4m3 block scales) and FP4 E2M1,
//! each with round-to-nearest-even and saturation, as PTX `cvt.rn.satfinite` does.

/// BF16 bits of `x`, rounded to nearest even (NaN stays NaN).
pub fn f32_to_bf16(x: f32) -> u16 {
    let b = x.to_bits();
    if x.is_nan() {
        return ((b >> 16) as u16) | 0x0040;
    }
    ((b + 0x7FFF + ((b >> 16) & 1)) >> 16) as u16
}

pub fn bf16_to_f32(b: u16) -> f32 {
    f32::from_bits((b as u32) << 16)
}

/// `x` rounded through BF16 storage.
pub fn round_bf16(x: f32) -> f32 {
    bf16_to_f32(f32_to_bf16(x))
}

/// Little-endian bytes of `v` stored as BF16 (`bf16`) or F32.
pub fn float_bytes(v: &[f32], bf16: bool) -> Vec<u8> {
    if bf16 {
        v.iter().flat_map(|&x| f32_to_bf16(x).to_le_bytes()).collect()
    } else {
        v.iter().flat_map(|x| x.to_le_bytes()).collect()
    }
}

/// The values of little-endian BF16 (`bf16`) or F32 bytes.
pub fn bytes_floats(b: &[u8], bf16: bool) -> Vec<f32> {
    if bf16 {
        b.chunks_exact(2).map(|c| bf16_to_f32(u16::from_le_bytes([c[0], c[1]]))).collect()
    } else {
        b.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
    }
}

/// Largest finite E4M3 value.
pub const E4M3_MAX: f32 = 448.0;

/// FP8 E4M3 (OCP "fn": no infinities, 0x7F/0xFF NaN) to f32.
pub fn e4m3_to_f32(code: u8) -> f32 {
    let sign = if code & 0x80 != 0 { -1.0 } else { 1.0 };
    let exp = ((code >> 3) & 0xF) as i32;
    let mant = (code & 0x7) as f32;
    if exp == 0xF && code & 0x7 == 0x7 {
        return f32::NAN;
    }
    let mag = if exp == 0 { mant / 8.0 * 2f32.powi(-6) } else { (1.0 + mant / 8.0) * 2f32.powi(exp - 7) };
    sign * mag
}

/// f32 to FP8 E4M3, round to nearest even, saturating to +-448 (`cvt.rn.satfinite.e4m3x2.f32`).
pub fn f32_to_e4m3(x: f32) -> u8 {
    if x.is_nan() {
        return 0x7F;
    }
    let sign = if x.is_sign_negative() { 0x80 } else { 0 };
    let a = (x.abs() as f64).min(E4M3_MAX as f64);
    let min_normal = 2f64.powi(-6);
    let code = if a < min_normal {
        // Subnormal grid of 2^-9; rounding up to 8 lands exactly on the smallest normal.
        (a / 2f64.powi(-9)).round_ties_even() as u8
    } else {
        let mut e = a.log2().floor() as i32;
        // Guard against log2 rounding at exact powers of two.
        if 2f64.powi(e) > a {
            e -= 1;
        } else if 2f64.powi(e + 1) <= a {
            e += 1;
        }
        let mut q = ((a / 2f64.powi(e) - 1.0) * 8.0).round_ties_even() as i32;
        if q == 8 {
            e += 1;
            q = 0;
        }
        (((e + 7) as u8) << 3) | q as u8
    };
    sign | code
}

/// Magnitudes of the eight E2M1 codes (bit 3 is the sign).
pub const E2M1_VALUES: [f32; 8] = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0];

pub fn e2m1_to_f32(code: u8) -> f32 {
    let v = E2M1_VALUES[(code & 0x7) as usize];
    if code & 0x8 != 0 {
        -v
    } else {
        v
    }
}

/// f32 to FP4 E2M1, round to nearest with ties to the even code, saturating at +-6
/// (`cvt.rn.satfinite.e2m1x2.f32`). NaN becomes +6 (MAX_NORM), as the PTX ISA specifies.
pub fn f32_to_e2m1(x: f32) -> u8 {
    if x.is_nan() {
        return 0x7;
    }
    let sign = if x.is_sign_negative() { 0x8 } else { 0 };
    let a = x.abs();
    // Midpoints between neighbouring codes; at a tie the even code wins.
    const MID: [f32; 7] = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0];
    let mut code = 0u8;
    for (i, &m) in MID.iter().enumerate() {
        let upper = (i + 1) as u8;
        if a > m || (a == m && upper % 2 == 0) {
            code = upper;
        }
    }
    sign | code
}
