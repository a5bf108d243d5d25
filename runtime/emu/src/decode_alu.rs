//! Lowering of integer / floating-point arithmetic, special functions and `setp`.

use super::decode::{count, DecodeCtx, Mods, R};
use super::ir::*;
use super::parser::ROp;

pub fn arith(base: &str, m: &mut Mods, o: &[ROp], ctx: &DecodeCtx) -> R<Op> {
    let lo = m.has("lo");
    let hi = m.has("hi");
    let wide = m.has("wide");
    let sat = m.has("sat");
    let ftz = m.has("ftz");
    let nan = m.has("NaN");
    let approx = m.has("approx");
    let full = m.has("full");
    let rn = m.has("rn");
    let ty = m.one_type()?;
    if ty.is_float() {
        if matches!(ty, Ty::F16 | Ty::F16x2) {
            if !matches!(base, "add" | "sub" | "mul" | "fma") || ftz || sat {
                return Err(format!("{base}.{}: half-precision arithmetic here is add/sub/mul/fma .rn without .ftz/.sat", ty.name()));
            }
        } else if !matches!(ty, Ty::F32 | Ty::F64) {
            return Err(format!("{base}.{} is not supported; only .f32/.f64 and add/sub/mul/fma on .f16/.f16x2", ty.name()));
        }
        if lo || hi || wide {
            return Err("`.lo/.hi/.wide` do not apply to floating point".into());
        }
        if rn && matches!(base, "min" | "max" | "neg" | "abs") {
            return Err(format!("{base} takes no rounding modifier"));
        }
        if (approx || full) && !(base == "div" && ty == Ty::F32) {
            return Err("`.approx/.full` apply only to div.f32 here".into());
        }
        if nan && !matches!(base, "min" | "max") {
            return Err("`.NaN` applies to min/max".into());
        }
        let (op, n) = match base {
            "add" => (FloatOp::Add, 3),
            "sub" => (FloatOp::Sub, 3),
            "mul" => (FloatOp::Mul, 3),
            "mad" | "fma" => (FloatOp::Fma, 4),
            "div" => (FloatOp::Div, 3),
            "min" => (if nan { FloatOp::MinNaN } else { FloatOp::Min }, 3),
            "max" => (if nan { FloatOp::MaxNaN } else { FloatOp::Max }, 3),
            "neg" => (FloatOp::Neg, 2),
            "abs" => (FloatOp::Abs, 2),
            _ => return Err(format!("{base} is not a floating-point instruction")),
        };
        count(o, n)?;
        let get = |i: usize| if i < n { ctx.src(&o[i], ty) } else { Ok(Operand::Imm(0)) };
        return Ok(Op::Float { op, ty, ftz, sat, d: ctx.dst(&o[0], ty)?, a: get(1)?, b: get(2)?, c: get(3)? });
    }
    if ftz || nan || approx || full || rn {
        return Err("floating-point modifier on an integer instruction".into());
    }
    if ty == Ty::Pred && !matches!(base, "and" | "or" | "xor" | "not") {
        return Err(format!("{base}.pred is not valid"));
    }
    let half = |t: Ty| match t {
        Ty::U16 => Ty::U32,
        Ty::S16 => Ty::S32,
        Ty::U32 => Ty::U64,
        Ty::S32 => Ty::S64,
        _ => t,
    };
    let (op, n, dty, cty) = match base {
        "add" if sat => (IntOp::AddSat, 3, ty, ty),
        "sub" if sat => (IntOp::SubSat, 3, ty, ty),
        "add" => (IntOp::Add, 3, ty, ty),
        "sub" => (IntOp::Sub, 3, ty, ty),
        "mul" if wide => (IntOp::MulWide, 3, half(ty), ty),
        "mul" if hi => (IntOp::MulHi, 3, ty, ty),
        "mul" if lo => (IntOp::MulLo, 3, ty, ty),
        "mad" if wide => (IntOp::MadWide, 4, half(ty), half(ty)),
        "mad" if hi => (IntOp::MadHi, 4, ty, ty),
        "mad" if lo => (IntOp::MadLo, 4, ty, ty),
        "mul" | "mad" => return Err(format!("integer {base} needs .lo, .hi or .wide")),
        "div" => (IntOp::Div, 3, ty, ty),
        "rem" => (IntOp::Rem, 3, ty, ty),
        "min" => (IntOp::Min, 3, ty, ty),
        "max" => (IntOp::Max, 3, ty, ty),
        "and" => (IntOp::And, 3, ty, ty),
        "or" => (IntOp::Or, 3, ty, ty),
        "xor" => (IntOp::Xor, 3, ty, ty),
        "not" => (IntOp::Not, 2, ty, ty),
        "cnot" => (IntOp::Cnot, 2, ty, ty),
        "shl" => (IntOp::Shl, 3, ty, ty),
        "shr" => (IntOp::Shr, 3, ty, ty),
        "neg" => (IntOp::Neg, 2, ty, ty),
        "abs" => (IntOp::Abs, 2, ty, ty),
        "popc" => (IntOp::Popc, 2, Ty::U32, ty),
        "clz" => (IntOp::Clz, 2, Ty::U32, ty),
        "brev" => (IntOp::Brev, 2, ty, ty),
        _ => return Err(format!("{base} is not an integer instruction")),
    };
    if sat && ty != Ty::S32 {
        return Err("`.sat` applies to .s32 add/sub only".into());
    }
    if wide && !matches!(ty, Ty::U16 | Ty::S16 | Ty::U32 | Ty::S32) {
        return Err("`.wide` needs a 16- or 32-bit type".into());
    }
    count(o, n)?;
    let bty = if matches!(op, IntOp::Shl | IntOp::Shr) { Ty::U32 } else { ty };
    let b = if n >= 3 { ctx.src(&o[2], bty)? } else { Operand::Imm(0) };
    let c = if n >= 4 { ctx.src(&o[3], cty)? } else { Operand::Imm(0) };
    Ok(Op::Int { op, ty, d: ctx.dst(&o[0], dty)?, a: ctx.src(&o[1], ty)?, b, c })
}

pub fn special_fn(base: &str, m: &mut Mods, o: &[ROp], ctx: &DecodeCtx) -> R<Op> {
    let approx = m.has("approx");
    let rn = m.has("rn");
    let ftz = m.has("ftz");
    let ty = m.one_type()?;
    if !matches!(ty, Ty::F32 | Ty::F64) {
        return Err(format!("{base}.{} is not supported", ty.name()));
    }
    let op = match base {
        "rcp" => FloatOp::Rcp,
        "sqrt" => FloatOp::Sqrt,
        "rsqrt" => FloatOp::Rsqrt,
        "ex2" => FloatOp::Ex2,
        "lg2" => FloatOp::Lg2,
        "sin" => FloatOp::Sin,
        "cos" => FloatOp::Cos,
        _ => FloatOp::Tanh,
    };
    let exact_ok = matches!(op, FloatOp::Rcp | FloatOp::Sqrt);
    if approx == rn || (rn && !exact_ok) {
        return Err(format!("{base} needs {}", if exact_ok { ".approx or .rn" } else { ".approx" }));
    }
    count(o, 2)?;
    Ok(Op::Float { op, ty, ftz, sat: false, d: ctx.dst(&o[0], ty)?, a: ctx.src(&o[1], ty)?, b: Operand::Imm(0), c: Operand::Imm(0) })
}

pub fn setp(m: &mut Mods, o: &[ROp], ctx: &DecodeCtx) -> R<Op> {
    const CMPS: [&str; 18] = ["eq", "ne", "lt", "le", "gt", "ge", "lo", "ls", "hi", "hs", "equ", "neu", "ltu", "leu", "gtu", "geu", "num", "nan"];
    let c = m.one_of(&CMPS).ok_or("setp needs a comparison")?;
    let cmp =
        [Cmp::Eq, Cmp::Ne, Cmp::Lt, Cmp::Le, Cmp::Gt, Cmp::Ge, Cmp::Lo, Cmp::Ls, Cmp::Hi, Cmp::Hs, Cmp::Equ, Cmp::Neu, Cmp::Ltu, Cmp::Leu, Cmp::Gtu, Cmp::Geu, Cmp::Num, Cmp::Nan]
            [CMPS.iter().position(|x| *x == c).unwrap_or(0)];
    let bop = match m.one_of(&["and", "or", "xor"]) {
        Some("and") => Some(BoolOp::And),
        Some("or") => Some(BoolOp::Or),
        Some(_) => Some(BoolOp::Xor),
        None => None,
    };
    let ftz = m.has("ftz");
    let ty = m.one_type()?;
    if ty == Ty::Pred || matches!(ty, Ty::F16 | Ty::F16x2 | Ty::BF16 | Ty::BF16x2) {
        return Err(format!("setp.{} is not supported", ty.name()));
    }
    let unordered = matches!(cmp, Cmp::Equ | Cmp::Neu | Cmp::Ltu | Cmp::Leu | Cmp::Gtu | Cmp::Geu | Cmp::Num | Cmp::Nan);
    if ty.is_float() && matches!(cmp, Cmp::Lo | Cmp::Ls | Cmp::Hi | Cmp::Hs) {
        return Err("unsigned comparisons do not apply to floats".into());
    }
    if !ty.is_float() && (unordered || ftz) {
        return Err("unordered comparisons and .ftz apply only to floats".into());
    }
    if matches!(ty, Ty::B16 | Ty::B32 | Ty::B64 | Ty::B8) && !matches!(cmp, Cmp::Eq | Cmp::Ne) {
        return Err("bit-size types support only eq/ne".into());
    }
    count(o, if bop.is_some() { 4 } else { 3 })?;
    let (p, q) = match &o[0] {
        ROp::Pipe(p, q) => (ctx.dst(p, Ty::Pred)?, ctx.dst(q, Ty::Pred)?),
        p => (ctx.dst(p, Ty::Pred)?, Operand::Sink),
    };
    let combine = match bop {
        Some(b) => Some((b, ctx.src(&o[3], Ty::Pred)?)),
        None => None,
    };
    Ok(Op::Setp { cmp, ty, ftz, p, q, a: ctx.src(&o[1], ty)?, b: ctx.src(&o[2], ty)?, combine })
}
