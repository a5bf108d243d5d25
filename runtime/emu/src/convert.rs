//! `cvt` semantics. BF16, E4M3 and E2M1 encodings come from `crate::formats` (bit-exact RNE,
//! satfinite); IEEE half is implemented here. Values are raw register bits in and out.

use super::ir::{mask_bits, sext, CvtKind, IntRound, Packed, Ty};
use crate::formats::{bf16_to_f32, e2m1_to_f32, e4m3_to_f32, f32_to_bf16, f32_to_e2m1, f32_to_e4m3};

/// f32 to IEEE binary16, round to nearest even; overflow to infinity, NaN to a quiet NaN.
pub fn f32_to_f16(x: f32) -> u16 {
    let b = x.to_bits();
    let sign = ((b >> 16) & 0x8000) as u16;
    let exp = ((b >> 23) & 0xFF) as i32;
    let man = b & 0x7F_FFFF;
    if exp == 0xFF {
        return sign | 0x7C00 | if man != 0 { 0x200 | (man >> 13) as u16 } else { 0 };
    }
    let e = exp - 127 + 15;
    if e >= 31 {
        return sign | 0x7C00;
    }
    // Full significand with the implicit bit (f32 subnormals are far below f16's range).
    let sig = if exp == 0 { man } else { man | 0x80_0000 };
    // Shift that maps the f32 significand to f16's 10-bit fraction (plus implicit bit).
    let shift = if e >= 1 { 13 } else { 14 - e };
    if shift > 24 + 1 {
        return sign;
    }
    let shift = shift as u32;
    let kept = sig >> shift;
    let rem = sig & ((1u32 << shift) - 1);
    let half = 1u32 << (shift - 1);
    let mut r = kept + u32::from(rem > half || (rem == half && kept & 1 == 1));
    if e >= 1 {
        // Normal: kept includes the implicit bit at bit 10; rounding may carry into the exponent.
        r = ((e as u32) << 10) + (r - 0x400);
        if r >= 0x7C00 {
            return sign | 0x7C00;
        }
        sign | r as u16
    } else {
        // Subnormal (r may round up to the smallest normal 0x400, which encodes correctly).
        sign | r as u16
    }
}

pub fn f16_to_f32(h: u16) -> f32 {
    let sign = if h & 0x8000 != 0 { -1.0f32 } else { 1.0 };
    let e = ((h >> 10) & 0x1F) as i32;
    let m = (h & 0x3FF) as f32;
    if e == 0x1F {
        return if h & 0x3FF != 0 { f32::NAN } else { sign * f32::INFINITY };
    }
    if e == 0 {
        return sign * m * 2f32.powi(-24);
    }
    sign * (1.0 + m / 1024.0) * 2f32.powi(e - 15)
}

/// Flush an f32 subnormal to a sign-preserving zero.
#[inline]
pub fn ftz32(x: f32) -> f32 {
    if x.is_subnormal() {
        f32::from_bits(x.to_bits() & 0x8000_0000)
    } else {
        x
    }
}

const F16_MAX: u16 = 0x7BFF;
const BF16_MAX: u16 = 0x7F7F;
const BF16_NAN: u16 = 0x7FFF;
const F16_NAN: u16 = 0x7FFF;

/// f32 to bf16 bits with the optional `.relu` / `.satfinite` of `cvt`.
pub fn to_bf16(x: f32, relu: bool, satfinite: bool) -> u16 {
    if x.is_nan() {
        return BF16_NAN;
    }
    let x = if relu && x < 0.0 { 0.0 } else { x };
    let h = f32_to_bf16(x);
    if satfinite && h & 0x7FFF == 0x7F80 {
        return (h & 0x8000) | BF16_MAX;
    }
    h
}

pub fn to_f16(x: f32, relu: bool, satfinite: bool) -> u16 {
    if x.is_nan() {
        return F16_NAN;
    }
    let x = if relu && x < 0.0 { 0.0 } else { x };
    let h = f32_to_f16(x);
    if satfinite && h & 0x7FFF == 0x7C00 {
        return (h & 0x8000) | F16_MAX;
    }
    h
}

/// One element of `cvt.rn.satfinite{.relu}.{e4m3x2,e2m1x2}.f32`.
pub fn to_packed_elem(fmt: Packed, x: f32, relu: bool) -> u8 {
    match fmt {
        Packed::E4m3x2 => {
            if x.is_nan() {
                return 0x7F;
            }
            f32_to_e4m3(if relu && x < 0.0 { 0.0 } else { x })
        }
        Packed::E2m1x2 => {
            // PTX: for .e2m1x2, NaN results become positive MAX_NORM (6.0 = 0x7).
            if x.is_nan() {
                return 0x7;
            }
            f32_to_e2m1(if relu && x < 0.0 { 0.0 } else { x })
        }
    }
}

/// Decoded value of one packed element (exact in f16).
fn packed_elem_f32(fmt: Packed, code: u8) -> f32 {
    match fmt {
        Packed::E4m3x2 => e4m3_to_f32(code),
        Packed::E2m1x2 => e2m1_to_f32(code & 0xF),
    }
}

fn to_float_value(bits: u64, ty: Ty) -> f64 {
    match ty {
        Ty::F16 => f16_to_f32(bits as u16) as f64,
        Ty::BF16 => bf16_to_f32(bits as u16) as f64,
        Ty::F32 => f32::from_bits(bits as u32) as f64,
        _ => f64::from_bits(bits),
    }
}

fn round_int(x: f64, r: IntRound) -> f64 {
    match r {
        IntRound::Rni => x.round_ties_even(),
        IntRound::Rzi => x.trunc(),
        IntRound::Rmi => x.floor(),
        IntRound::Rpi => x.ceil(),
    }
}

/// Executes one `cvt` on raw bits. `a`/`b` are the source operands' bits (`b` for pairs).
/// Results for signed integer destinations are sign-extended to 64 bits.
pub fn cvt(kind: &CvtKind, a: u64, b: u64) -> u64 {
    match *kind {
        CvtKind::IntInt { dst, src, sat } => {
            let v: i128 = if src.is_signed() { sext(a, src.bits()) as i64 as i128 } else { (a & mask_bits(src.bits())) as i128 };
            let db = dst.bits();
            let out = if sat {
                let (lo, hi): (i128, i128) = if dst.is_signed() { (-(1i128 << (db - 1)), (1i128 << (db - 1)) - 1) } else { (0, (1i128 << db) - 1) };
                v.clamp(lo, hi) as u64
            } else {
                v as u64
            };
            extend(out, dst)
        }
        CvtKind::IntFloat { dst, src } => {
            let bits = src.bits();
            if dst == Ty::F32 {
                let f = if src.is_signed() { sext(a, bits) as i64 as f32 } else { (a & mask_bits(bits)) as f32 };
                f.to_bits() as u64
            } else {
                let f = if src.is_signed() { sext(a, bits) as i64 as f64 } else { (a & mask_bits(bits)) as f64 };
                f.to_bits()
            }
        }
        CvtKind::FloatInt { dst, src, rnd, ftz } => {
            let mut x = to_float_value(a, src);
            if ftz && src == Ty::F32 {
                x = ftz32(x as f32) as f64;
            }
            let db = dst.bits();
            if x.is_nan() {
                // Zero, except f64 sources or 64-bit destinations: 1 << (bits - 1).
                return if src == Ty::F64 || db == 64 { extend(1u64 << (db - 1), dst) } else { 0 };
            }
            let r = round_int(x, rnd);
            let out = if dst.is_signed() {
                let lo = -(2f64.powi(db as i32 - 1));
                let hi = 2f64.powi(db as i32 - 1) - 1.0;
                (r.clamp(lo, hi) as i64) as u64
            } else {
                let hi = 2f64.powi(db as i32) - 1.0;
                r.clamp(0.0, hi) as u64
            };
            extend(out, dst)
        }
        CvtKind::FloatFloat { dst, src, round, ftz, sat, relu, satfinite } => {
            let mut x = to_float_value(a, src);
            if ftz && src == Ty::F32 {
                x = ftz32(x as f32) as f64;
            }
            if let Some(r) = round {
                x = round_int(x, r);
            }
            if sat {
                x = if x.is_nan() { 0.0 } else { x.clamp(0.0, 1.0) };
            }
            match dst {
                Ty::F64 => x.to_bits(),
                Ty::F32 => {
                    let mut f = x as f32;
                    if ftz {
                        f = ftz32(f);
                    }
                    f.to_bits() as u64
                }
                // f16/bf16 destinations come from f32 (exact widening of f32 or RNE of f64 first).
                Ty::BF16 => to_bf16(narrow_f32(x, src), relu, satfinite) as u64,
                _ => to_f16(narrow_f32(x, src), relu, satfinite) as u64,
            }
        }
        CvtKind::F32x2 { dst, relu, satfinite } => {
            let (fa, fb) = (f32::from_bits(a as u32), f32::from_bits(b as u32));
            let conv = |x: f32| if dst == Ty::BF16x2 { to_bf16(x, relu, satfinite) } else { to_f16(x, relu, satfinite) };
            ((conv(fa) as u64) << 16) | conv(fb) as u64
        }
        CvtKind::ToPacked { fmt, relu } => {
            let hi = to_packed_elem(fmt, f32::from_bits(a as u32), relu) as u64;
            let lo = to_packed_elem(fmt, f32::from_bits(b as u32), relu) as u64;
            match fmt {
                Packed::E4m3x2 => (hi << 8) | lo,
                Packed::E2m1x2 => (hi << 4) | lo,
            }
        }
        CvtKind::PackedToF16x2 { fmt, relu } => {
            let (hi, lo) = match fmt {
                Packed::E4m3x2 => (((a >> 8) & 0xFF) as u8, (a & 0xFF) as u8),
                Packed::E2m1x2 => (((a >> 4) & 0xF) as u8, (a & 0xF) as u8),
            };
            let conv = |c: u8| to_f16(packed_elem_f32(fmt, c), relu, false) as u64;
            (conv(hi) << 16) | conv(lo)
        }
    }
}

/// `x` (exactly an f32 when `src` is f32/f16/bf16) as f32. An f64 source is first rounded to f32;
/// this double rounding is exact for the f32→{f16,bf16} step only when the f64 is f32-representable.
fn narrow_f32(x: f64, _src: Ty) -> f32 {
    x as f32
}

/// Sign-extend signed results to 64 bits; zero-extend the rest.
fn extend(v: u64, ty: Ty) -> u64 {
    if ty.is_signed() {
        sext(v, ty.bits())
    } else {
        v & mask_bits(ty.bits())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn f16_round_trip_and_ties() {
        for &(x, h) in &[(1.0f32, 0x3C00u16), (-2.0, 0xC000), (65504.0, 0x7BFF), (65520.0, 0x7C00), (6.0e-8, 0x0001), (0.0, 0), (448.0, 0x5F00), (0.5, 0x3800)] {
            assert_eq!(f32_to_f16(x), h, "{x}");
        }
        // 1 + 2^-11 is halfway between 1 and 1+2^-10: ties to even (1.0).
        assert_eq!(f32_to_f16(1.0 + 2f32.powi(-11)), 0x3C00);
        // 1 + 3*2^-11 is halfway between 1+2^-10 and 1+2^-9: ties to even (1+2^-9).
        assert_eq!(f32_to_f16(1.0 + 3.0 * 2f32.powi(-11)), 0x3C02);
        // Smallest subnormal 2^-24; half of it (2^-25) ties to even -> 0.
        assert_eq!(f32_to_f16(2f32.powi(-25)), 0);
        assert_eq!(f32_to_f16(3.0 * 2f32.powi(-26)), 1);
        // Rounding up from the largest subnormal gives the smallest normal.
        assert_eq!(f32_to_f16(2f32.powi(-14) - 2f32.powi(-26)), 0x0400);
        for h in 0..0x7C00u16 {
            assert_eq!(f32_to_f16(f16_to_f32(h)), h);
        }
    }

    #[test]
    fn packed_order_and_nan() {
        // a goes to the high nibble.
        let k = CvtKind::ToPacked { fmt: Packed::E2m1x2, relu: false };
        assert_eq!(cvt(&k, 6.0f32.to_bits() as u64, 0.5f32.to_bits() as u64), 0x71);
        assert_eq!(cvt(&k, f32::NAN.to_bits() as u64, (-1.0f32).to_bits() as u64), 0x7A);
        let k = CvtKind::ToPacked { fmt: Packed::E4m3x2, relu: false };
        assert_eq!(cvt(&k, 1.0f32.to_bits() as u64, 1000.0f32.to_bits() as u64), 0x387E);
    }
}
