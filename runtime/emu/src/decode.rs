//! Lowering of parsed instructions to the IR. Every modifier must be understood: anything left
//! over is reported as unsupported, so the emulator never silently ignores a qualifier.

use super::decode_alu;
use super::ir::*;
use super::parser::{RAddr, RBase, ROp, RawInst};
use std::collections::HashMap;

pub struct DecodeCtx<'a> {
    pub labels: &'a HashMap<String, u32>,
    pub shared: &'a HashMap<String, u64>,
    pub params: &'a HashMap<String, u64>,
    pub reg_tys: &'a [Ty],
}

pub(super) type R<T> = Result<T, String>;

/// The dot-separated modifiers of an opcode, consumed as they are recognised.
pub(super) struct Mods<'a> {
    items: Vec<&'a str>,
    used: Vec<bool>,
}

impl<'a> Mods<'a> {
    fn new(rest: &'a str) -> Self {
        let items: Vec<&str> = if rest.is_empty() { Vec::new() } else { rest.split('.').collect() };
        let used = vec![false; items.len()];
        Mods { items, used }
    }

    /// Takes modifier `m` if present.
    pub(super) fn has(&mut self, m: &str) -> bool {
        for (i, it) in self.items.iter().enumerate() {
            if !self.used[i] && *it == m {
                self.used[i] = true;
                return true;
            }
        }
        false
    }

    /// Takes the first present modifier of `list`.
    pub(super) fn one_of(&mut self, list: &[&'static str]) -> Option<&'static str> {
        for (i, it) in self.items.iter().enumerate() {
            if !self.used[i] {
                if let Some(m) = list.iter().find(|m| **m == *it) {
                    self.used[i] = true;
                    return Some(m);
                }
            }
        }
        None
    }

    /// Takes, in order, every unused modifier that `f` recognises.
    pub(super) fn take_all<T>(&mut self, f: impl Fn(&str) -> Option<T>) -> Vec<T> {
        let mut out = Vec::new();
        for (i, it) in self.items.iter().enumerate() {
            if !self.used[i] {
                if let Some(v) = f(it) {
                    self.used[i] = true;
                    out.push(v);
                }
            }
        }
        out
    }

    pub(super) fn types(&mut self) -> Vec<Ty> {
        self.take_all(Ty::parse)
    }

    pub(super) fn one_type(&mut self) -> R<Ty> {
        let t = self.types();
        match t.as_slice() {
            [t] => Ok(*t),
            [] => Err("missing type modifier".into()),
            _ => Err(format!("expected one type modifier, found {}", t.iter().map(|t| format!(".{}", t.name())).collect::<Vec<_>>().join(""))),
        }
    }

    fn finish(&self) -> R<()> {
        let left: Vec<String> = self.items.iter().zip(&self.used).filter(|(_, u)| !**u).map(|(m, _)| format!(".{m}")).collect();
        if left.is_empty() {
            Ok(())
        } else {
            Err(format!("unsupported modifier{} {}", if left.len() > 1 { "s" } else { "" }, left.join(" ")))
        }
    }
}

pub(super) fn count(ops: &[ROp], n: usize) -> R<()> {
    if ops.len() != n {
        return Err(format!("expected {n} operands, found {}", ops.len()));
    }
    Ok(())
}

use super::convert::f32_to_f16;

/// Raw bits of an immediate for an operand of type `ty`.
fn imm_bits(v: &ROp, ty: Ty) -> R<u64> {
    let m = mask_bits(ty.bits());
    Ok(match (v, ty) {
        (ROp::Int(i), Ty::F32) => (*i as f32).to_bits() as u64,
        (ROp::Int(i), Ty::F64) => (*i as f64).to_bits(),
        (ROp::Int(i), t) if t.is_float() => return Err(format!("integer immediate {i} for .{} operand", t.name())),
        (ROp::Int(i), _) => (*i as u64) & m,
        (ROp::F32(b), Ty::F64) => (f32::from_bits(*b) as f64).to_bits(),
        (ROp::F32(b), Ty::F16) => f32_to_f16(f32::from_bits(*b)) as u64,
        (ROp::F32(b), Ty::BF16) => crate::formats::f32_to_bf16(f32::from_bits(*b)) as u64,
        (ROp::F32(b), t) if t.bits() == 32 => *b as u64,
        (ROp::F64(b), Ty::F32) => (f64::from_bits(*b) as f32).to_bits() as u64,
        (ROp::F64(b), t) if t.bits() == 64 => *b,
        (ROp::Float(f), Ty::F32) => (*f as f32).to_bits() as u64,
        (ROp::Float(f), Ty::F64) => f.to_bits(),
        (ROp::Float(f), Ty::F16) => f32_to_f16(*f as f32) as u64,
        (ROp::Float(f), Ty::BF16) => crate::formats::f32_to_bf16(*f as f32) as u64,
        (v, t) => return Err(format!("immediate {v:?} does not fit a .{} operand", t.name())),
    })
}

impl<'a> DecodeCtx<'a> {
    pub(super) fn reg_ty(&self, r: u32) -> Ty {
        self.reg_tys[r as usize]
    }

    fn check_reg(&self, r: u32, ty: Ty) -> R<()> {
        let rt = self.reg_ty(r);
        if (rt == Ty::Pred) != (ty == Ty::Pred) {
            return Err(format!("register of type .{} used as a .{} operand", rt.name(), ty.name()));
        }
        Ok(())
    }

    /// A source operand of type `ty`.
    pub(super) fn src(&self, v: &ROp, ty: Ty) -> R<Operand> {
        Ok(match v {
            ROp::Reg(r) => {
                self.check_reg(*r, ty)?;
                Operand::Reg(*r)
            }
            ROp::NotReg(r) => {
                if ty != Ty::Pred {
                    return Err("'!' applies only to predicate operands".into());
                }
                self.check_reg(*r, Ty::Pred)?;
                Operand::PredNot(*r)
            }
            ROp::Special(s) => Operand::Special(*s),
            ROp::Name(n) => Operand::Sym(self.symbol(n)?),
            ROp::Int(_) | ROp::F32(_) | ROp::F64(_) | ROp::Float(_) => Operand::Imm(imm_bits(v, ty)?),
            ROp::Sink => return Err("'_' cannot be a source".into()),
            ROp::Vec(_) | ROp::Addr(_) | ROp::Pipe(..) => return Err("unexpected vector, address or `|` operand".into()),
        })
    }

    /// A destination register (or `_`).
    pub(super) fn dst(&self, v: &ROp, ty: Ty) -> R<Operand> {
        match v {
            ROp::Reg(r) => {
                self.check_reg(*r, ty)?;
                Ok(Operand::Reg(*r))
            }
            ROp::Sink => Ok(Operand::Sink),
            _ => Err(format!("destination must be a register, found {v:?}")),
        }
    }

    pub(super) fn symbol(&self, n: &str) -> R<Symbol> {
        if let Some(o) = self.shared.get(n) {
            return Ok(Symbol::Shared(*o));
        }
        if let Some(o) = self.params.get(n) {
            return Ok(Symbol::Param(*o));
        }
        Err(format!("unknown name '{n}' (not a register, shared variable or parameter)"))
    }

    pub(super) fn addr(&self, v: &ROp) -> R<Address> {
        let ROp::Addr(RAddr { base, offset }) = v else {
            return Err(format!("expected an address [..], found {v:?}"));
        };
        let base = match base {
            None => AddrBase::Abs,
            Some(RBase::Reg(r)) => {
                let t = self.reg_ty(*r);
                if t.bits() < 32 || t == Ty::Pred || t.is_float() {
                    return Err(format!("address register has type .{}", t.name()));
                }
                AddrBase::Reg(*r)
            }
            Some(RBase::Name(n)) => AddrBase::Sym(self.symbol(n)?),
        };
        Ok(Address { base, offset: *offset })
    }

    pub(super) fn vec_dst(&self, v: &ROp, n: usize, ty: Ty) -> R<Vec<Operand>> {
        match v {
            ROp::Vec(items) if items.len() == n => items.iter().map(|x| self.dst(x, ty)).collect(),
            ROp::Vec(items) => Err(format!("expected a vector of {n} registers, found {}", items.len())),
            _ if n == 1 => Ok(vec![self.dst(v, ty)?]),
            _ => Err(format!("expected a vector of {n} registers")),
        }
    }

    pub(super) fn vec_src(&self, v: &ROp, n: usize, ty: Ty) -> R<Vec<Operand>> {
        match v {
            ROp::Vec(items) if items.len() == n => items.iter().map(|x| self.src(x, ty)).collect(),
            ROp::Vec(items) => Err(format!("expected a vector of {n} operands, found {}", items.len())),
            _ if n == 1 => Ok(vec![self.src(v, ty)?]),
            _ => Err(format!("expected a vector of {n} operands")),
        }
    }
}

pub fn decode(raw: &RawInst, ctx: &DecodeCtx) -> Result<Inst, String> {
    let (base, rest) = raw.opcode.split_once('.').unwrap_or((raw.opcode.as_str(), ""));
    let mut m = Mods::new(rest);
    let o = &raw.ops;
    let op = match base {
        "mov" => mov(&mut m, o, ctx)?,
        "ld" => ld(&mut m, o, ctx)?,
        "st" => st(&mut m, o, ctx)?,
        "cvta" => cvta(&mut m, o, ctx)?,
        "add" | "sub" | "mul" | "mad" | "fma" | "div" | "rem" | "min" | "max" | "neg" | "abs" | "and" | "or" | "xor" | "not" | "cnot" | "shl" | "shr" | "popc" | "clz" | "brev" => {
            decode_alu::arith(base, &mut m, o, ctx)?
        }
        "rcp" | "sqrt" | "rsqrt" | "ex2" | "lg2" | "sin" | "cos" | "tanh" => decode_alu::special_fn(base, &mut m, o, ctx)?,
        "setp" => decode_alu::setp(&mut m, o, ctx)?,
        "selp" => {
            let ty = m.one_type()?;
            count(o, 4)?;
            Op::Selp { d: ctx.dst(&o[0], ty)?, a: ctx.src(&o[1], ty)?, b: ctx.src(&o[2], ty)?, c: ctx.src(&o[3], Ty::Pred)? }
        }
        "prmt" => {
            if m.one_type()? != Ty::B32 {
                return Err("prmt needs .b32".into());
            }
            count(o, 4)?;
            Op::Prmt { d: ctx.dst(&o[0], Ty::B32)?, a: ctx.src(&o[1], Ty::B32)?, b: ctx.src(&o[2], Ty::B32)?, c: ctx.src(&o[3], Ty::B32)? }
        }
        "lop3" => {
            if m.one_type()? != Ty::B32 {
                return Err("lop3 needs .b32".into());
            }
            count(o, 5)?;
            let ROp::Int(lut) = o[4] else {
                return Err("lop3 immLut must be an immediate".into());
            };
            Op::Lop3 { d: ctx.dst(&o[0], Ty::B32)?, a: ctx.src(&o[1], Ty::B32)?, b: ctx.src(&o[2], Ty::B32)?, c: ctx.src(&o[3], Ty::B32)?, lut: lut as u8 }
        }
        "cvt" => super::decode_cvt::cvt(&mut m, o, ctx)?,
        "bra" => {
            let uni = m.has("uni");
            count(o, 1)?;
            let ROp::Name(l) = &o[0] else {
                return Err("bra needs a label".into());
            };
            let target = *ctx.labels.get(l).ok_or_else(|| format!("unknown label '{l}'"))?;
            Op::Bra { target, uni }
        }
        "trap" => {
            count(o, 0)?;
            Op::Trap
        }
        "ret" | "exit" => {
            m.has("uni");
            count(o, 0)?;
            Op::Exit
        }
        "bar" | "barrier" => bar(base, &mut m, o, ctx)?,
        "membar" => {
            m.one_of(&["cta", "gl", "sys"]).ok_or("membar needs .cta, .gl or .sys")?;
            count(o, 0)?;
            Op::Fence
        }
        "nanosleep" => {
            // a hint: the emulator yields the host thread (spin-waits on another GPU's flags)
            if !m.has("u32") {
                return Err("nanosleep needs .u32".into());
            }
            count(o, 1)?;
            ctx.src(&o[0], Ty::U32)?;
            Op::Nanosleep
        }
        "fence" => {
            m.one_of(&["sc", "acq_rel"]).ok_or("fence needs .sc or .acq_rel")?;
            m.one_of(&["cta", "gpu", "sys", "cluster"]).ok_or("fence needs a scope")?;
            count(o, 0)?;
            Op::Fence
        }
        "shfl" => shfl(&mut m, o, ctx)?,
        "ldmatrix" => ldmatrix(&mut m, o, ctx)?,
        "mma" => super::decode_mma::mma(&mut m, o, ctx)?,
        "atom" | "red" => atom(base == "red", &mut m, o, ctx)?,
        "cp" => cp_async(&mut m, o, ctx)?,
        _ => return Err(format!("unsupported instruction '{base}'")),
    };
    m.finish()?;
    Ok(Inst { op, guard: raw.guard, line: raw.line, text: raw.text.clone() })
}

fn mov(m: &mut Mods, o: &[ROp], ctx: &DecodeCtx) -> R<Op> {
    let ty = m.one_type()?;
    count(o, 2)?;
    match (&o[0], &o[1]) {
        (d, ROp::Vec(parts)) => {
            if parts.is_empty() || ty.bits() % parts.len() as u32 != 0 || !matches!(ty, Ty::B16 | Ty::B32 | Ty::B64 | Ty::U32 | Ty::U64 | Ty::S32 | Ty::S64 | Ty::F64 | Ty::F32) {
                return Err("vector pack needs .b16/.b32/.b64 and 2 or 4 parts".into());
            }
            let bits = ty.bits() / parts.len() as u32;
            let pty = part_ty(bits)?;
            let parts = parts.iter().map(|p| ctx.src(p, pty)).collect::<R<Vec<_>>>()?;
            Ok(Op::Pack { d: ctx.dst(d, ty)?, parts, bits })
        }
        (ROp::Vec(parts), a) => {
            if parts.is_empty() || ty.bits() % parts.len() as u32 != 0 {
                return Err("vector unpack needs 2 or 4 parts".into());
            }
            let bits = ty.bits() / parts.len() as u32;
            let pty = part_ty(bits)?;
            let parts = parts.iter().map(|p| ctx.dst(p, pty)).collect::<R<Vec<_>>>()?;
            Ok(Op::Unpack { parts, a: ctx.src(a, ty)?, bits })
        }
        (d, a) => Ok(Op::Mov { d: ctx.dst(d, ty)?, a: ctx.src(a, ty)? }),
    }
}

fn part_ty(bits: u32) -> R<Ty> {
    Ok(match bits {
        8 => Ty::B8,
        16 => Ty::B16,
        32 => Ty::B32,
        _ => return Err(format!("cannot split into {bits}-bit parts")),
    })
}

fn space(m: &mut Mods) -> Space {
    if m.has("global") {
        Space::Global
    } else if m.has("shared") || m.has("shared::cta") {
        Space::Shared
    } else if m.has("param") || m.has("param::entry") {
        Space::Param
    } else {
        Space::Generic
    }
}

/// Memory-consistency and cache qualifiers of ld/st: hints with no effect on a sequential memory.
fn mem_qualifiers(m: &mut Mods, load: bool) -> R<()> {
    let sem = m.one_of(&["weak", "volatile", "relaxed", "acquire", "release", "mmio"]);
    if sem == Some("mmio") {
        return Err("`.mmio` is not supported".into());
    }
    if matches!(sem, Some("relaxed" | "acquire" | "release")) {
        m.one_of(&["cta", "gpu", "sys", "cluster"]).ok_or("memory order needs a scope")?;
    }
    if load {
        m.one_of(&["ca", "cg", "cs", "lu", "cv"]);
    } else {
        m.one_of(&["wb", "cg", "cs", "wt"]);
    }
    m.take_all(|s| {
        matches!(
            s,
            "L1::evict_normal"
                | "L1::evict_unchanged"
                | "L1::evict_first"
                | "L1::evict_last"
                | "L1::no_allocate"
                | "L2::evict_normal"
                | "L2::evict_first"
                | "L2::evict_last"
                | "L2::64B"
                | "L2::128B"
                | "L2::256B"
        )
        .then_some(())
    });
    Ok(())
}

fn vec_width(m: &mut Mods) -> usize {
    match m.one_of(&["v2", "v4"]) {
        Some("v2") => 2,
        Some("v4") => 4,
        _ => 1,
    }
}

fn mem_ty(m: &mut Mods) -> R<Ty> {
    let ty = m.one_type()?;
    if ty == Ty::Pred || ty == Ty::F16x2 || ty == Ty::BF16x2 {
        return Err(format!(".{} is not a memory type here", ty.name()));
    }
    Ok(ty)
}

fn ld(m: &mut Mods, o: &[ROp], ctx: &DecodeCtx) -> R<Op> {
    mem_qualifiers(m, true)?;
    let space = space(m);
    let nc = m.has("nc");
    if nc && space != Space::Global {
        return Err("`.nc` needs .global".into());
    }
    let n = vec_width(m);
    let ty = mem_ty(m)?;
    count(o, 2)?;
    Ok(Op::Ld { space, ty, d: ctx.vec_dst(&o[0], n, ty)?, addr: ctx.addr(&o[1])?, nc })
}

fn st(m: &mut Mods, o: &[ROp], ctx: &DecodeCtx) -> R<Op> {
    mem_qualifiers(m, false)?;
    let space = space(m);
    if space == Space::Param {
        return Err("st.param is not supported (kernel parameters are read-only)".into());
    }
    let n = vec_width(m);
    let ty = mem_ty(m)?;
    count(o, 2)?;
    Ok(Op::St { space, ty, addr: ctx.addr(&o[0])?, s: ctx.vec_src(&o[1], n, ty)? })
}

fn cvta(m: &mut Mods, o: &[ROp], ctx: &DecodeCtx) -> R<Op> {
    let to = m.has("to");
    let sp = space(m);
    if !matches!(sp, Space::Global | Space::Shared) {
        return Err("cvta supports .global and .shared".into());
    }
    let ty = m.one_type()?;
    if ty != Ty::U64 {
        return Err("cvta needs .u64 (generic addresses are 64-bit)".into());
    }
    count(o, 2)?;
    Ok(Op::Cvta { to, space: sp, d: ctx.dst(&o[0], ty)?, a: ctx.src(&o[1], ty)?, bits: ty.bits() })
}

fn bar(base: &str, m: &mut Mods, o: &[ROp], ctx: &DecodeCtx) -> R<Op> {
    if base == "bar" && m.has("warp") {
        if !m.has("sync") {
            return Err("bar.warp needs .sync".into());
        }
        count(o, 1)?;
        return Ok(Op::WarpSync { mask: ctx.src(&o[0], Ty::B32)? });
    }
    m.has("cta");
    let arrive = match m.one_of(&["sync", "arrive", "red"]) {
        Some("sync") => false,
        Some("arrive") => true,
        Some(_) => return Err("bar.red is not supported".into()),
        None => return Err("barrier needs .sync or .arrive".into()),
    };
    if base == "barrier" {
        m.has("aligned");
    }
    if o.is_empty() || o.len() > 2 || (arrive && o.len() != 2) {
        return Err(format!("{} needs {} operands", if arrive { "bar.arrive" } else { "bar.sync" }, if arrive { "2" } else { "1 or 2" }));
    }
    Ok(Op::Bar { arrive, id: ctx.src(&o[0], Ty::U32)?, count: if o.len() == 2 { Some(ctx.src(&o[1], Ty::U32)?) } else { None } })
}

fn shfl(m: &mut Mods, o: &[ROp], ctx: &DecodeCtx) -> R<Op> {
    if !m.has("sync") {
        return Err("only shfl.sync is supported (legacy shfl is not)".into());
    }
    let mode = match m.one_of(&["up", "down", "bfly", "idx"]) {
        Some("up") => ShflMode::Up,
        Some("down") => ShflMode::Down,
        Some("bfly") => ShflMode::Bfly,
        Some(_) => ShflMode::Idx,
        None => return Err("shfl.sync needs .up, .down, .bfly or .idx".into()),
    };
    if m.one_type()? != Ty::B32 {
        return Err("shfl.sync needs .b32".into());
    }
    count(o, 5)?;
    let (d, p) = match &o[0] {
        ROp::Pipe(d, p) => (ctx.dst(d, Ty::B32)?, ctx.dst(p, Ty::Pred)?),
        d => (ctx.dst(d, Ty::B32)?, Operand::Sink),
    };
    Ok(Op::Shfl { mode, d, p, a: ctx.src(&o[1], Ty::B32)?, b: ctx.src(&o[2], Ty::B32)?, c: ctx.src(&o[3], Ty::B32)?, mask: ctx.src(&o[4], Ty::B32)? })
}

fn ldmatrix(m: &mut Mods, o: &[ROp], ctx: &DecodeCtx) -> R<Op> {
    if !(m.has("sync") && m.has("aligned")) {
        return Err("ldmatrix needs .sync.aligned".into());
    }
    if !m.has("m8n8") {
        return Err("only ldmatrix .m8n8 (b16) is supported".into());
    }
    let num = match m.one_of(&["x1", "x2", "x4"]) {
        Some("x1") => 1,
        Some("x2") => 2,
        Some(_) => 4,
        None => return Err("ldmatrix needs .x1, .x2 or .x4".into()),
    };
    let trans = m.has("trans");
    let sp = space(m);
    if !matches!(sp, Space::Shared | Space::Generic) {
        return Err("ldmatrix reads shared memory".into());
    }
    if !m.has("b16") {
        return Err("ldmatrix .m8n8 needs .b16".into());
    }
    count(o, 2)?;
    Ok(Op::Ldmatrix { num, trans, space: sp, d: ctx.vec_dst(&o[0], num as usize, Ty::B32)?, addr: ctx.addr(&o[1])? })
}

fn atom(red: bool, m: &mut Mods, o: &[ROp], ctx: &DecodeCtx) -> R<Op> {
    if let Some(s) = m.one_of(&["relaxed", "acquire", "release", "acq_rel"]) {
        if red && s == "acquire" {
            return Err("red cannot be .acquire".into());
        }
    }
    m.one_of(&["cta", "gpu", "sys"]);
    let sp = space(m);
    if sp == Space::Param {
        return Err("atom/red on .param".into());
    }
    let op = match m.one_of(&["add", "min", "max", "and", "or", "xor", "exch", "cas", "inc", "dec"]) {
        Some("add") => AtomOp::Add,
        Some("min") => AtomOp::Min,
        Some("max") => AtomOp::Max,
        Some("and") => AtomOp::And,
        Some("or") => AtomOp::Or,
        Some("xor") => AtomOp::Xor,
        Some("exch") => AtomOp::Exch,
        Some("cas") => AtomOp::Cas,
        Some("inc") => AtomOp::Inc,
        Some(_) => AtomOp::Dec,
        None => return Err("missing atomic operation".into()),
    };
    let ty = m.one_type()?;
    let ok = match op {
        AtomOp::Add => matches!(ty, Ty::U32 | Ty::S32 | Ty::U64 | Ty::F32 | Ty::F64),
        AtomOp::Min | AtomOp::Max => matches!(ty, Ty::U32 | Ty::S32 | Ty::U64 | Ty::S64),
        AtomOp::And | AtomOp::Or | AtomOp::Xor | AtomOp::Exch | AtomOp::Cas => matches!(ty, Ty::B32 | Ty::B64),
        AtomOp::Inc | AtomOp::Dec => ty == Ty::U32,
    };
    if !ok {
        return Err(format!("{}.{:?}.{} is not supported", if red { "red" } else { "atom" }, op, ty.name()).to_lowercase());
    }
    if red && op == AtomOp::Cas {
        return Err("red has no .cas".into());
    }
    let nsrc = if op == AtomOp::Cas { 2 } else { 1 };
    let first = if red { 0 } else { 1 };
    count(o, first + 1 + nsrc)?;
    let d = if red { Operand::Sink } else { ctx.dst(&o[0], ty)? };
    let addr = ctx.addr(&o[first])?;
    let b = ctx.src(&o[first + 1], ty)?;
    let c = if nsrc == 2 { ctx.src(&o[first + 2], ty)? } else { Operand::Imm(0) };
    Ok(Op::Atom { space: sp, op, ty, d, addr, b, c })
}

fn cp_async(m: &mut Mods, o: &[ROp], ctx: &DecodeCtx) -> R<Op> {
    if !m.has("async") {
        return Err("only cp.async is supported".into());
    }
    if m.has("commit_group") {
        count(o, 0)?;
        return Ok(Op::CpAsyncCommit);
    }
    if m.has("wait_all") {
        count(o, 0)?;
        return Ok(Op::CpAsyncWait(None));
    }
    if m.has("wait_group") {
        count(o, 1)?;
        let ROp::Int(n) = o[0] else {
            return Err("cp.async.wait_group needs an immediate".into());
        };
        return Ok(Op::CpAsyncWait(Some(n as u32)));
    }
    let cg = match m.one_of(&["ca", "cg"]) {
        Some(c) => c == "cg",
        None => return Err("cp.async needs .ca or .cg (bulk and mbarrier forms are not supported)".into()),
    };
    if !(m.has("shared") || m.has("shared::cta")) || !m.has("global") {
        return Err("cp.async needs .shared.global".into());
    }
    m.one_of(&["L2::64B", "L2::128B", "L2::256B"]);
    if o.len() < 3 || o.len() > 4 {
        return Err("cp.async needs [dst], [src], cp-size{, src-size | ignore-src}".into());
    }
    let ROp::Int(size) = o[2] else {
        return Err("cp-size must be an immediate".into());
    };
    let size = size as u32;
    if !matches!(size, 4 | 8 | 16) || (cg && size != 16) {
        return Err(format!("cp-size {size} is invalid (.ca: 4, 8, 16; .cg: 16)"));
    }
    let fill = match o.get(3) {
        None => None,
        Some(ROp::Reg(r)) if ctx.reg_ty(*r) == Ty::Pred => Some((Operand::Reg(*r), true)),
        Some(ROp::NotReg(r)) => Some((Operand::PredNot(*r), true)),
        Some(v) => Some((ctx.src(v, Ty::U32)?, false)),
    };
    Ok(Op::CpAsync { dst: ctx.addr(&o[0])?, src: ctx.addr(&o[1])?, size, fill })
}
