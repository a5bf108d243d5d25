//! Lowering of `cvt`: which conversions exist, and which modifiers each requires or accepts.

use super::decode::{count, DecodeCtx, Mods, R};
use super::ir::{CvtKind, IntRound, Op, Operand, Packed, Ty};
use super::parser::ROp;

#[derive(Clone, Copy, PartialEq)]
enum CTy {
    T(Ty),
    P(Packed),
}

fn cty(s: &str) -> Option<CTy> {
    match s {
        "e4m3x2" => Some(CTy::P(Packed::E4m3x2)),
        "e2m1x2" => Some(CTy::P(Packed::E2m1x2)),
        _ => Ty::parse(s).filter(|t| !matches!(t, Ty::B8 | Ty::B16 | Ty::B32 | Ty::B64 | Ty::Pred)).map(CTy::T),
    }
}

pub fn cvt(m: &mut Mods, o: &[ROp], ctx: &DecodeCtx) -> R<Op> {
    let frnd = m.one_of(&["rn", "rz", "rm", "rp", "rna", "rs"]);
    let irnd = match m.one_of(&["rni", "rzi", "rmi", "rpi"]) {
        Some("rni") => Some(IntRound::Rni),
        Some("rzi") => Some(IntRound::Rzi),
        Some("rmi") => Some(IntRound::Rmi),
        Some(_) => Some(IntRound::Rpi),
        None => None,
    };
    let ftz = m.has("ftz");
    let sat = m.has("sat");
    let relu = m.has("relu");
    let satfinite = m.has("satfinite");
    let tys = m.take_all(cty);
    let [dt, at] = tys.as_slice() else {
        return Err("cvt needs a destination and a source type".into());
    };
    if frnd.is_some_and(|r| r != "rn") {
        return Err(format!("cvt rounding .{} is not supported (only .rn / integer roundings)", frnd.unwrap_or_default()));
    }
    let rn = frnd.is_some();
    let only = |allowed: &[bool], what: &str| -> R<()> {
        if allowed.iter().any(|x| *x) {
            return Err(format!("modifier not valid for {what}"));
        }
        Ok(())
    };
    match (*dt, *at) {
        (CTy::P(fmt), CTy::T(Ty::F32)) => {
            if !rn || !satfinite {
                return Err("conversion to a packed fp8/fp4 pair needs .rn.satfinite".into());
            }
            only(&[irnd.is_some(), ftz, sat], "packed conversions")?;
            count(o, 3)?;
            let dty = if fmt == Packed::E2m1x2 { Ty::B8 } else { Ty::B16 };
            Ok(Op::Cvt { kind: CvtKind::ToPacked { fmt, relu }, d: ctx.dst(&o[0], dty)?, a: ctx.src(&o[1], Ty::F32)?, b: ctx.src(&o[2], Ty::F32)? })
        }
        (CTy::T(Ty::F16x2), CTy::P(fmt)) => {
            if !rn {
                return Err("cvt to .f16x2 needs .rn".into());
            }
            only(&[irnd.is_some(), ftz, sat, satfinite], "unpacking conversions")?;
            count(o, 2)?;
            let aty = if fmt == Packed::E2m1x2 { Ty::B8 } else { Ty::B16 };
            Ok(Op::Cvt { kind: CvtKind::PackedToF16x2 { fmt, relu }, d: ctx.dst(&o[0], Ty::B32)?, a: ctx.src(&o[1], aty)?, b: Operand::Imm(0) })
        }
        (CTy::T(dst @ (Ty::BF16x2 | Ty::F16x2)), CTy::T(Ty::F32)) => {
            if !rn {
                return Err(format!("cvt to .{} needs .rn", dst.name()));
            }
            only(&[irnd.is_some(), ftz, sat], "pair conversions")?;
            count(o, 3)?;
            Ok(Op::Cvt { kind: CvtKind::F32x2 { dst, relu, satfinite }, d: ctx.dst(&o[0], Ty::B32)?, a: ctx.src(&o[1], Ty::F32)?, b: ctx.src(&o[2], Ty::F32)? })
        }
        (CTy::T(dst), CTy::T(src)) if !matches!(dst, Ty::F16x2 | Ty::BF16x2) && !matches!(src, Ty::F16x2 | Ty::BF16x2) => {
            count(o, 2)?;
            let kind = scalar(dst, src, rn, irnd, ftz, sat, relu, satfinite)?;
            let dty = if dst.is_float() && dst != Ty::F32 && dst != Ty::F64 { Ty::B16 } else { dst };
            let sty = if src.is_float() && src != Ty::F32 && src != Ty::F64 { Ty::B16 } else { src };
            Ok(Op::Cvt { kind, d: ctx.dst(&o[0], dty)?, a: ctx.src(&o[1], sty)?, b: Operand::Imm(0) })
        }
        _ => Err("unsupported cvt type combination".into()),
    }
}

#[allow(clippy::too_many_arguments)]
fn scalar(dst: Ty, src: Ty, rn: bool, irnd: Option<IntRound>, ftz: bool, sat: bool, relu: bool, satfinite: bool) -> R<CvtKind> {
    let df = dst.is_float();
    let sf = src.is_float();
    if (relu || satfinite) && !matches!(dst, Ty::F16 | Ty::BF16) {
        return Err(".relu/.satfinite apply to .f16/.bf16 destinations here".into());
    }
    if ftz && dst != Ty::F32 && src != Ty::F32 {
        return Err(".ftz needs an .f32 source or destination".into());
    }
    match (df, sf) {
        (false, false) => {
            if rn || irnd.is_some() || ftz {
                return Err("integer-to-integer cvt takes no rounding".into());
            }
            Ok(CvtKind::IntInt { dst, src, sat })
        }
        (true, false) => {
            if !rn {
                return Err("integer-to-float cvt needs a rounding modifier (.rn supported)".into());
            }
            if !matches!(dst, Ty::F32 | Ty::F64) || sat {
                return Err(format!("cvt.rn.{}.{} is not supported", dst.name(), src.name()));
            }
            Ok(CvtKind::IntFloat { dst, src })
        }
        (false, true) => {
            let Some(rnd) = irnd else {
                return Err("float-to-integer cvt needs .rni, .rzi, .rmi or .rpi".into());
            };
            if rn {
                return Err("float-to-integer cvt takes an integer rounding".into());
            }
            Ok(CvtKind::FloatInt { dst, src, rnd, ftz })
        }
        (true, true) => {
            let narrowing = dst.bits() < src.bits();
            if (dst == Ty::F16 && src == Ty::BF16) || (dst == Ty::BF16 && src == Ty::F16) {
                return Err("cvt between .f16 and .bf16 is not supported".into());
            }
            if dst == src {
                if rn {
                    return Err("same-type float cvt takes an integer rounding".into());
                }
            } else if narrowing {
                if !rn || irnd.is_some() {
                    return Err("narrowing float cvt needs .rn".into());
                }
            } else if rn || irnd.is_some() {
                return Err("widening float cvt takes no rounding".into());
            }
            Ok(CvtKind::FloatFloat { dst, src, round: irnd, ftz, sat, relu, satfinite })
        }
    }
}
