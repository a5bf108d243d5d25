//! Integer, floating-point, comparison and bit-manipulation semantics on raw register bits.
//! Results of signed integer operations are sign-extended to 64 bits; everything else is
//! zero-extended (the register file masks to the destination width).

use super::convert::ftz32;
use super::ir::{mask_bits, sext, AtomOp, BoolOp, Cmp, FloatOp, IntOp, Ty};

/// Canonical f32 NaN produced by NVIDIA GPUs for arithmetic NaN results.
pub const CANONICAL_NAN32: u32 = 0x7FFF_FFFF;

fn extend(v: u64, bits: u32, signed: bool) -> u64 {
    if signed {
        sext(v, bits)
    } else {
        v & mask_bits(bits)
    }
}

pub fn int_op(op: IntOp, ty: Ty, a: u64, b: u64, c: u64) -> u64 {
    let bits = ty.bits();
    let m = mask_bits(bits);
    let signed = ty.is_signed();
    let (ua, ub) = (a & m, b & m);
    let (sa, sb) = (sext(a, bits) as i64, sext(b, bits) as i64);
    if ty == Ty::Pred {
        let (pa, pb) = (a & 1, b & 1);
        return match op {
            IntOp::And => pa & pb,
            IntOp::Or => pa | pb,
            IntOp::Xor => pa ^ pb,
            _ => pa ^ 1,
        };
    }
    let wide = |x: u64, y: u64| -> u64 {
        if signed {
            (sext(x, bits) as i64).wrapping_mul(sext(y, bits) as i64) as u64
        } else {
            (x & m).wrapping_mul(y & m)
        }
    };
    let hi = |x: u64, y: u64| -> u64 {
        if signed {
            (((sext(x, bits) as i64 as i128) * (sext(y, bits) as i64 as i128)) >> bits) as u64
        } else {
            (((x & m) as u128 * (y & m) as u128) >> bits) as u64
        }
    };
    let r = match op {
        IntOp::Add => a.wrapping_add(b),
        IntOp::Sub => a.wrapping_sub(b),
        IntOp::AddSat => (sa as i128 + sb as i128).clamp(i32::MIN as i128, i32::MAX as i128) as u64,
        IntOp::SubSat => (sa as i128 - sb as i128).clamp(i32::MIN as i128, i32::MAX as i128) as u64,
        IntOp::MulLo => a.wrapping_mul(b),
        IntOp::MulHi => hi(a, b),
        IntOp::MulWide => return extend(wide(a, b), bits * 2, signed),
        IntOp::MadLo => a.wrapping_mul(b).wrapping_add(c),
        IntOp::MadHi => hi(a, b).wrapping_add(c),
        IntOp::MadWide => return extend(wide(a, b).wrapping_add(c), bits * 2, signed),
        IntOp::Div => {
            if ub == 0 {
                m // division by zero is unspecified in PTX: all ones
            } else if signed {
                sa.wrapping_div(sb) as u64
            } else {
                ua / ub
            }
        }
        IntOp::Rem => {
            if ub == 0 {
                a
            } else if signed {
                sa.wrapping_rem(sb) as u64
            } else {
                ua % ub
            }
        }
        IntOp::Min => {
            if signed {
                sa.min(sb) as u64
            } else {
                ua.min(ub)
            }
        }
        IntOp::Max => {
            if signed {
                sa.max(sb) as u64
            } else {
                ua.max(ub)
            }
        }
        IntOp::And => a & b,
        IntOp::Or => a | b,
        IntOp::Xor => a ^ b,
        IntOp::Not => !a,
        IntOp::Cnot => u64::from(ua == 0),
        IntOp::Shl => {
            let s = (b & 0xFFFF_FFFF) as u32;
            if s >= bits {
                0
            } else {
                a << s
            }
        }
        IntOp::Shr => {
            let s = ((b & 0xFFFF_FFFF) as u32).min(bits);
            if signed {
                (sa >> s.min(63)) as u64
            } else if s >= bits {
                0
            } else {
                ua >> s
            }
        }
        IntOp::Neg => sa.wrapping_neg() as u64,
        IntOp::Abs => sa.wrapping_abs() as u64,
        IntOp::Popc => return ua.count_ones() as u64,
        IntOp::Clz => return (ua.leading_zeros() - (64 - bits)) as u64,
        IntOp::Brev => ua.reverse_bits() >> (64 - bits),
    };
    extend(r, bits, signed)
}

trait Float: Copy + PartialOrd {
    fn is_nan_(self) -> bool;
    fn is_sign_neg(self) -> bool;
}
impl Float for f32 {
    fn is_nan_(self) -> bool {
        self.is_nan()
    }
    fn is_sign_neg(self) -> bool {
        self.is_sign_negative()
    }
}
impl Float for f64 {
    fn is_nan_(self) -> bool {
        self.is_nan()
    }
    fn is_sign_neg(self) -> bool {
        self.is_sign_negative()
    }
}

/// PTX min/max: a NaN operand yields the other; -0.0 < +0.0.
fn minmax<T: Float>(x: T, y: T, is_max: bool, nan: T) -> T {
    match (x.is_nan_(), y.is_nan_()) {
        (true, true) => nan,
        (true, false) => y,
        (false, true) => x,
        _ => {
            let x_less = x < y || (x == y && x.is_sign_neg() && !y.is_sign_neg());
            if x_less != is_max {
                x
            } else {
                y
            }
        }
    }
}

pub fn float_op(op: FloatOp, ty: Ty, ftz: bool, sat: bool, a: u64, b: u64, c: u64) -> u64 {
    if matches!(ty, Ty::F16 | Ty::F16x2) {
        return super::half::half_op(op, ty, a, b, c);
    }
    if ty == Ty::F64 {
        let (x, y, z) = (f64::from_bits(a), f64::from_bits(b), f64::from_bits(c));
        let r = match op {
            FloatOp::Add => x + y,
            FloatOp::Sub => x - y,
            FloatOp::Mul => x * y,
            FloatOp::Fma => x.mul_add(y, z),
            FloatOp::Div => x / y,
            FloatOp::Min | FloatOp::MinNaN => minmax(x, y, false, f64::NAN),
            FloatOp::Max | FloatOp::MaxNaN => minmax(x, y, true, f64::NAN),
            FloatOp::Neg => return a ^ (1 << 63),
            FloatOp::Abs => return a & !(1 << 63),
            FloatOp::Rcp => 1.0 / x,
            FloatOp::Sqrt => x.sqrt(),
            FloatOp::Rsqrt => 1.0 / x.sqrt(),
            FloatOp::Ex2 => x.exp2(),
            FloatOp::Lg2 => x.log2(),
            FloatOp::Sin => x.sin(),
            FloatOp::Cos => x.cos(),
            FloatOp::Tanh => x.tanh(),
        };
        let r = if matches!(op, FloatOp::MinNaN | FloatOp::MaxNaN) && (x.is_nan() || y.is_nan()) { f64::NAN } else { r };
        return if sat { sat01(r) } else { r }.to_bits();
    }
    let f = |v: u64| {
        let x = f32::from_bits(v as u32);
        if ftz {
            ftz32(x)
        } else {
            x
        }
    };
    let (x, y, z) = (f(a), f(b), f(c));
    let approx = |g: fn(f64) -> f64| g(x as f64) as f32;
    let r = match op {
        FloatOp::Add => x + y,
        FloatOp::Sub => x - y,
        FloatOp::Mul => x * y,
        FloatOp::Fma => x.mul_add(y, z),
        FloatOp::Div => x / y,
        FloatOp::Min => minmax(x, y, false, f32::NAN),
        FloatOp::Max => minmax(x, y, true, f32::NAN),
        FloatOp::MinNaN | FloatOp::MaxNaN => {
            if x.is_nan() || y.is_nan() {
                f32::NAN
            } else {
                minmax(x, y, op == FloatOp::MaxNaN, f32::NAN)
            }
        }
        FloatOp::Neg => return (f(a).to_bits() ^ 0x8000_0000) as u64,
        FloatOp::Abs => return (f(a).to_bits() & 0x7FFF_FFFF) as u64,
        FloatOp::Rcp => approx(|v| 1.0 / v),
        FloatOp::Sqrt => x.sqrt(),
        FloatOp::Rsqrt => approx(|v| 1.0 / v.sqrt()),
        FloatOp::Ex2 => approx(f64::exp2),
        FloatOp::Lg2 => approx(f64::log2),
        FloatOp::Sin => approx(f64::sin),
        FloatOp::Cos => approx(f64::cos),
        FloatOp::Tanh => approx(f64::tanh),
    };
    let mut r = if sat { sat01(r as f64) as f32 } else { r };
    if ftz {
        r = ftz32(r);
    }
    if r.is_nan() {
        return CANONICAL_NAN32 as u64;
    }
    r.to_bits() as u64
}

fn sat01(x: f64) -> f64 {
    if x.is_nan() {
        0.0
    } else {
        x.clamp(0.0, 1.0)
    }
}

pub fn compare(cmp: Cmp, ty: Ty, ftz: bool, a: u64, b: u64) -> bool {
    if ty.is_float() {
        let (x, y) = if ty == Ty::F64 {
            (f64::from_bits(a), f64::from_bits(b))
        } else {
            let g = |v: u64| {
                let x = f32::from_bits(v as u32);
                if ftz {
                    ftz32(x)
                } else {
                    x
                }
            };
            (g(a) as f64, g(b) as f64)
        };
        let nan = x.is_nan() || y.is_nan();
        return match cmp {
            Cmp::Eq => !nan && x == y,
            Cmp::Ne => !nan && x != y,
            Cmp::Lt => !nan && x < y,
            Cmp::Le => !nan && x <= y,
            Cmp::Gt => !nan && x > y,
            Cmp::Ge => !nan && x >= y,
            Cmp::Equ => nan || x == y,
            Cmp::Neu => nan || x != y,
            Cmp::Ltu => nan || x < y,
            Cmp::Leu => nan || x <= y,
            Cmp::Gtu => nan || x > y,
            Cmp::Geu => nan || x >= y,
            Cmp::Num => !nan,
            Cmp::Nan => nan,
            Cmp::Lo | Cmp::Ls | Cmp::Hi | Cmp::Hs => false,
        };
    }
    let bits = ty.bits();
    let (ua, ub) = (a & mask_bits(bits), b & mask_bits(bits));
    let (sa, sb) = (sext(a, bits) as i64, sext(b, bits) as i64);
    let s = ty.is_signed();
    match cmp {
        Cmp::Eq => ua == ub,
        Cmp::Ne => ua != ub,
        Cmp::Lt => {
            if s {
                sa < sb
            } else {
                ua < ub
            }
        }
        Cmp::Le => {
            if s {
                sa <= sb
            } else {
                ua <= ub
            }
        }
        Cmp::Gt => {
            if s {
                sa > sb
            } else {
                ua > ub
            }
        }
        Cmp::Ge => {
            if s {
                sa >= sb
            } else {
                ua >= ub
            }
        }
        Cmp::Lo => ua < ub,
        Cmp::Ls => ua <= ub,
        Cmp::Hi => ua > ub,
        Cmp::Hs => ua >= ub,
        _ => false,
    }
}

pub fn combine(op: BoolOp, x: bool, y: bool) -> bool {
    match op {
        BoolOp::And => x && y,
        BoolOp::Or => x || y,
        BoolOp::Xor => x ^ y,
    }
}

/// `prmt.b32` default mode.
pub fn prmt(a: u64, b: u64, c: u64) -> u64 {
    let src = ((b & 0xFFFF_FFFF) << 32) | (a & 0xFFFF_FFFF);
    let mut out = 0u64;
    for i in 0..4 {
        let sel = (c >> (4 * i)) & 0xF;
        let byte = (src >> ((sel & 7) * 8)) & 0xFF;
        let byte = if sel & 8 != 0 {
            if byte & 0x80 != 0 {
                0xFF
            } else {
                0
            }
        } else {
            byte
        };
        out |= byte << (8 * i);
    }
    out
}

pub fn lop3(a: u64, b: u64, c: u64, lut: u8) -> u64 {
    let mut r = 0u64;
    for k in 0..8 {
        if lut >> k & 1 == 1 {
            let ta = if k & 4 != 0 { a } else { !a };
            let tb = if k & 2 != 0 { b } else { !b };
            let tc = if k & 1 != 0 { c } else { !c };
            r |= ta & tb & tc;
        }
    }
    r & 0xFFFF_FFFF
}

/// New value of an atomic location (`old` and operands are raw bits of `ty`). `ftz`: the ISA's
/// `atom.add.f32` on global memory flushes subnormal inputs and results (shared memory does not).
pub fn atom_apply(op: AtomOp, ty: Ty, old: u64, b: u64, c: u64, ftz: bool) -> u64 {
    let bits = ty.bits();
    let m = mask_bits(bits);
    let signed = ty.is_signed();
    match op {
        AtomOp::Add => match ty {
            Ty::F32 if ftz => ftz32(ftz32(f32::from_bits(old as u32)) + ftz32(f32::from_bits(b as u32))).to_bits() as u64,
            Ty::F32 => (f32::from_bits(old as u32) + f32::from_bits(b as u32)).to_bits() as u64,
            Ty::F64 => (f64::from_bits(old) + f64::from_bits(b)).to_bits(),
            _ => old.wrapping_add(b) & m,
        },
        AtomOp::Min | AtomOp::Max => {
            let less = if signed { (sext(b, bits) as i64) < (sext(old, bits) as i64) } else { (b & m) < (old & m) };
            if less == (op == AtomOp::Min) {
                b & m
            } else {
                old
            }
        }
        AtomOp::And => old & b & m,
        AtomOp::Or => (old | b) & m,
        AtomOp::Xor => (old ^ b) & m,
        AtomOp::Exch => b & m,
        AtomOp::Cas => {
            if old & m == b & m {
                c & m
            } else {
                old
            }
        }
        AtomOp::Inc => {
            if (old & m) >= (b & m) {
                0
            } else {
                (old + 1) & m
            }
        }
        AtomOp::Dec => {
            if old & m == 0 || (old & m) > (b & m) {
                b & m
            } else {
                (old - 1) & m
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn integer_edge_cases() {
        assert_eq!(int_op(IntOp::MulWide, Ty::S32, (-3i64) as u64, 5, 0) as i64, -15);
        assert_eq!(int_op(IntOp::MulWide, Ty::U32, 0xFFFF_FFFF, 2, 0), 0x1_FFFF_FFFE);
        assert_eq!(int_op(IntOp::MulHi, Ty::U32, 0x8000_0000, 4, 0), 2);
        assert_eq!(int_op(IntOp::Shl, Ty::B32, 1, 40, 0), 0);
        assert_eq!(int_op(IntOp::Shr, Ty::S32, 0x8000_0000, 40, 0) as i64, -1);
        assert_eq!(int_op(IntOp::Shr, Ty::U32, 0x8000_0000, 31, 0), 1);
        assert_eq!(int_op(IntOp::AddSat, Ty::S32, 0x7FFF_FFFF, 1, 0), 0x7FFF_FFFF);
        assert_eq!(int_op(IntOp::Clz, Ty::B32, 1, 0, 0), 31);
        assert_eq!(int_op(IntOp::Brev, Ty::B32, 1, 0, 0), 0x8000_0000);
        assert_eq!(prmt(0x33221100, 0x77665544, 0x7531), 0x77553311);
        assert_eq!(lop3(0xF0, 0xCC, 0xAA, 0x96), 0xF0 ^ 0xCC ^ 0xAA);
    }

    #[test]
    fn float_min_max_and_unordered_compares() {
        let nan = f32::NAN.to_bits() as u64;
        let one = 1.0f32.to_bits() as u64;
        assert_eq!(float_op(FloatOp::Min, Ty::F32, false, false, nan, one, 0), one);
        assert_eq!(float_op(FloatOp::MinNaN, Ty::F32, false, false, nan, one, 0), CANONICAL_NAN32 as u64);
        let (pz, nz) = (0.0f32.to_bits() as u64, (-0.0f32).to_bits() as u64);
        assert_eq!(float_op(FloatOp::Min, Ty::F32, false, false, pz, nz, 0), nz);
        assert_eq!(float_op(FloatOp::Max, Ty::F32, false, false, nz, pz, 0), pz);
        assert!(compare(Cmp::Ltu, Ty::F32, false, nan, one));
        assert!(!compare(Cmp::Lt, Ty::F32, false, nan, one));
        assert!(!compare(Cmp::Ne, Ty::F32, false, nan, one));
        assert!(compare(Cmp::Neu, Ty::F32, false, nan, one));
        assert!(compare(Cmp::Lt, Ty::S32, false, 0xFFFF_FFFF, 0));
        let sub = f32::from_bits(1).to_bits() as u64;
        assert_eq!(atom_apply(AtomOp::Add, Ty::F32, sub, sub, 0, true), 0);
        assert_eq!(atom_apply(AtomOp::Add, Ty::F32, sub, sub, 0, false), 2);
        assert_eq!(atom_apply(AtomOp::Inc, Ty::U32, 5, 5, 0, false), 0);
        assert_eq!(atom_apply(AtomOp::Dec, Ty::U32, 0, 5, 0, false), 5);
        assert!(!compare(Cmp::Lo, Ty::S32, false, 0xFFFF_FFFF, 0));
    }
}
