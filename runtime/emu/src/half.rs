//! IEEE binary16 arithmetic (`add sub mul fma` `.rn` on `.f16` and `.f16x2`): the exact result,
//! rounded once to nearest even. Every finite half is an integer multiple of 2^-24 below 2^16,
//! so products and sums are exact in i128 units of 2^-48 and only the final rounding rounds
//! (an f32 or f64 intermediate would round twice for some fma operands). Subnormals are kept
//! (PTX flushes f16 only under `.ftz`, which is not accepted here); NaN results are canonical.

use super::ir::{FloatOp, Ty};

const CANONICAL_NAN16: u16 = 0x7FFF;
const ONE: u16 = 0x3C00;
const SIGN: u16 = 0x8000;

fn is_nan(h: u16) -> bool {
    h & 0x7C00 == 0x7C00 && h & 0x3FF != 0
}

fn is_inf(h: u16) -> bool {
    h & 0x7FFF == 0x7C00
}

fn is_zero(h: u16) -> bool {
    h & 0x7FFF == 0
}

/// A finite half as a signed integer in units of 2^-24.
fn units(h: u16) -> i128 {
    let e = (h >> 10) & 0x1F;
    let m = (h & 0x3FF) as i128;
    let mag = if e == 0 { m } else { (m | 0x400) << (e - 1) };
    if h & SIGN != 0 {
        -mag
    } else {
        mag
    }
}

/// `v >> shift`, rounded to nearest, ties to even.
fn round_shift(v: u128, shift: u32) -> u128 {
    if shift == 0 {
        return v;
    }
    let kept = v >> shift;
    let rem = v & ((1u128 << shift) - 1);
    let half = 1u128 << (shift - 1);
    kept + u128::from(rem > half || (rem == half && kept & 1 == 1))
}

/// A non-zero exact value in units of 2^-48 to the nearest half (overflow to infinity).
fn round_units48(s: i128) -> u16 {
    let sign = if s < 0 { SIGN } else { 0 };
    let u = s.unsigned_abs();
    // Below 2^-14 (2^34 units) the spacing is the subnormal step 2^-24 (2^24 units).
    if u < 1u128 << 34 {
        // Rounding up to 0x400 encodes the smallest normal correctly.
        return sign | round_shift(u, 24) as u16;
    }
    let top = 127 - u.leading_zeros(); // value in [2^(top-48), 2^(top-47))
    let mut exp = top as i32 - 48 + 15;
    let mut q = round_shift(u, top - 10); // 11 significant bits, in [1024, 2048]
    if q == 2048 {
        q = 1024;
        exp += 1;
    }
    if exp >= 31 {
        return sign | 0x7C00;
    }
    sign | ((exp as u16) << 10) | (q as u16 - 1024)
}

/// One half `a * b + c`, rounded once.
fn fma16(a: u16, b: u16, c: u16) -> u16 {
    if is_nan(a) || is_nan(b) || is_nan(c) {
        return CANONICAL_NAN16;
    }
    let product_sign = (a ^ b) & SIGN;
    if is_inf(a) || is_inf(b) {
        if is_zero(a) || is_zero(b) || (is_inf(c) && c & SIGN != product_sign) {
            return CANONICAL_NAN16;
        }
        return product_sign | 0x7C00;
    }
    if is_inf(c) {
        return c;
    }
    let product = units(a) * units(b);
    let sum = product + (units(c) << 24);
    if sum != 0 {
        return round_units48(sum);
    }
    // An exact zero: two zeros keep their common sign, anything that cancels is +0.
    if product == 0 && is_zero(c) {
        product_sign & c
    } else {
        0
    }
}

fn lane(op: FloatOp, a: u16, b: u16, c: u16) -> u16 {
    match op {
        FloatOp::Add => fma16(a, ONE, b),
        FloatOp::Sub => fma16(a, ONE, b ^ SIGN),
        // + (-0) keeps the product's zero sign.
        FloatOp::Mul => fma16(a, b, SIGN),
        FloatOp::Fma => fma16(a, b, c),
        other => unreachable!("{other:?} on half precision is refused at decode"),
    }
}

/// `add sub mul fma` on `.f16` (low 16 bits) or `.f16x2` (each half on its own).
pub fn half_op(op: FloatOp, ty: Ty, a: u64, b: u64, c: u64) -> u64 {
    let low = |v: u64| v as u16;
    let high = |v: u64| (v >> 16) as u16;
    let lo = lane(op, low(a), low(b), low(c)) as u64;
    if ty == Ty::F16 {
        return lo;
    }
    lo | (lane(op, high(a), high(b), high(c)) as u64) << 16
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::convert::{f16_to_f32, f32_to_f16};

    fn h(x: f32) -> u16 {
        let r = f32_to_f16(x);
        assert_eq!(f16_to_f32(r), x, "{x} is not a half");
        r
    }

    #[test]
    fn exact_results_stay_exact_and_subnormals_are_kept() {
        assert_eq!(fma16(h(1.5), h(-6.0), h(0.25)), h(-8.75));
        // 2^-15 * 0.5 = 2^-16: a subnormal product, kept.
        assert_eq!(fma16(h(2f32.powi(-15)), h(0.5), 0), h(2f32.powi(-16)));
        // The smallest subnormal times 0.5 is a tie between 0 and 2^-24: to even (0).
        assert_eq!(fma16(1, h(0.5), 0), 0);
        assert_eq!(fma16(3, h(0.5), 0), 2, "1.5 ulp rounds to the even 2");
    }

    #[test]
    fn rounds_once_to_nearest_even() {
        // 2049 is a tie between 2048 and 2050: even mantissa (2048).
        assert_eq!(fma16(h(2048.0), ONE, ONE), h(2048.0));
        assert_eq!(fma16(h(2050.0), ONE, ONE), h(2052.0));
        // fma rounds once: (1 + 2^-10)^2 = 1 + 2^-9 + 2^-20; minus 1 - 2^-9 leaves 2^-20 exactly,
        // where a rounded product would leave 0.
        let a = h(1.0 + 2f32.powi(-10));
        assert_eq!(fma16(a, a, h(-(1.0 + 2f32.powi(-9)))), h(2f32.powi(-20)));
        // A sum just past a tie by far less than an f32 ulp of the sum still rounds up:
        // 2048 + 1 + 2^-24 -> 2050 (an f32 intermediate would round to the tie, then to 2048).
        assert_eq!(fma16(1, 1, h(2048.0)), h(2048.0), "2048 + 2^-48 rounds to 2048");
        assert_eq!(round_units48((2049i128 << 48) + 1), h(2050.0));
    }

    #[test]
    fn overflow_infinities_nan_and_zero_signs() {
        assert_eq!(fma16(h(65504.0), h(2.0), 0), 0x7C00);
        assert_eq!(fma16(h(65504.0), ONE, h(8.0)), h(65504.0), "below the halfway point rounds down");
        assert_eq!(fma16(h(65504.0), ONE, h(16.0)), 0x7C00, "the tie rounds to the even 2^16: infinity");
        assert_eq!(fma16(0x7C00, 0, 0), CANONICAL_NAN16);
        assert_eq!(fma16(0x7C00, ONE, 0xFC00), CANONICAL_NAN16);
        assert_eq!(fma16(0x7E00, ONE, 0), CANONICAL_NAN16);
        assert_eq!(lane(FloatOp::Mul, h(-2.0), 0, 0), SIGN, "-2 * +0 = -0");
        assert_eq!(lane(FloatOp::Add, SIGN, SIGN, 0), SIGN, "-0 + -0 = -0");
        assert_eq!(lane(FloatOp::Add, SIGN, 0, 0), 0);
        assert_eq!(lane(FloatOp::Sub, h(3.0), h(3.0), 0), 0, "x - x = +0");
    }

    #[test]
    fn f16x2_works_on_each_half() {
        let pack = |hi: f32, lo: f32| ((h(hi) as u64) << 16) | h(lo) as u64;
        assert_eq!(half_op(FloatOp::Mul, Ty::F16x2, pack(3.0, -0.5), pack(0.5, 6.0), 0), pack(1.5, -3.0));
        assert_eq!(half_op(FloatOp::Fma, Ty::F16x2, pack(2.0, 4.0), pack(3.0, 0.25), pack(-1.0, 1.0)), pack(5.0, 2.0));
        assert_eq!(half_op(FloatOp::Add, Ty::F16, pack(9.0, 1.0), pack(9.0, 2.0), 0), h(3.0) as u64, ".f16 uses the low half only");
    }
}
