//! Instruction IR: what the decoder produces from PTX text and the warp executes.
//!
//! Operands are resolved at decode time: registers to indices into the per-thread register file,
//! immediates to raw bits of the instruction type, labels to instruction indices, variables to
//! offsets in their state space.

/// PTX fundamental types used by the supported instructions.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Ty {
    B8,
    B16,
    B32,
    B64,
    U8,
    U16,
    U32,
    U64,
    S8,
    S16,
    S32,
    S64,
    F16,
    F16x2,
    BF16,
    BF16x2,
    F32,
    F64,
    Pred,
}

impl Ty {
    pub fn parse(s: &str) -> Option<Ty> {
        Some(match s {
            "b8" => Ty::B8,
            "b16" => Ty::B16,
            "b32" => Ty::B32,
            "b64" => Ty::B64,
            "u8" => Ty::U8,
            "u16" => Ty::U16,
            "u32" => Ty::U32,
            "u64" => Ty::U64,
            "s8" => Ty::S8,
            "s16" => Ty::S16,
            "s32" => Ty::S32,
            "s64" => Ty::S64,
            "f16" => Ty::F16,
            "f16x2" => Ty::F16x2,
            "bf16" => Ty::BF16,
            "bf16x2" => Ty::BF16x2,
            "f32" => Ty::F32,
            "f64" => Ty::F64,
            "pred" => Ty::Pred,
            _ => return None,
        })
    }

    pub fn bits(self) -> u32 {
        match self {
            Ty::Pred => 1,
            Ty::B8 | Ty::U8 | Ty::S8 => 8,
            Ty::B16 | Ty::U16 | Ty::S16 | Ty::F16 | Ty::BF16 => 16,
            Ty::B32 | Ty::U32 | Ty::S32 | Ty::F32 | Ty::F16x2 | Ty::BF16x2 => 32,
            Ty::B64 | Ty::U64 | Ty::S64 | Ty::F64 => 64,
        }
    }

    /// Bytes in memory (predicates have no memory form; 1 is never used).
    pub fn bytes(self) -> u32 {
        self.bits().div_ceil(8)
    }

    pub fn is_signed(self) -> bool {
        matches!(self, Ty::S8 | Ty::S16 | Ty::S32 | Ty::S64)
    }

    pub fn is_float(self) -> bool {
        matches!(self, Ty::F16 | Ty::F16x2 | Ty::BF16 | Ty::BF16x2 | Ty::F32 | Ty::F64)
    }

    pub fn is_int(self) -> bool {
        !self.is_float() && self != Ty::Pred
    }

    pub fn name(self) -> &'static str {
        match self {
            Ty::B8 => "b8",
            Ty::B16 => "b16",
            Ty::B32 => "b32",
            Ty::B64 => "b64",
            Ty::U8 => "u8",
            Ty::U16 => "u16",
            Ty::U32 => "u32",
            Ty::U64 => "u64",
            Ty::S8 => "s8",
            Ty::S16 => "s16",
            Ty::S32 => "s32",
            Ty::S64 => "s64",
            Ty::F16 => "f16",
            Ty::F16x2 => "f16x2",
            Ty::BF16 => "bf16",
            Ty::BF16x2 => "bf16x2",
            Ty::F32 => "f32",
            Ty::F64 => "f64",
            Ty::Pred => "pred",
        }
    }
}

/// Low `bits` bits set.
#[inline]
pub fn mask_bits(bits: u32) -> u64 {
    if bits >= 64 {
        u64::MAX
    } else {
        (1u64 << bits) - 1
    }
}

/// Sign-extend the low `bits` bits of `v` to 64 bits.
#[inline]
pub fn sext(v: u64, bits: u32) -> u64 {
    if bits >= 64 {
        v
    } else {
        let sh = 64 - bits;
        (((v << sh) as i64) >> sh) as u64
    }
}

/// State spaces addressable by `ld`/`st`/`atom`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Space {
    Generic,
    Global,
    Shared,
    Param,
}

/// Special registers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Sreg {
    Tid(u8),
    Ntid(u8),
    Ctaid(u8),
    Nctaid(u8),
    LaneId,
    WarpId,
    NWarpId,
    LanemaskEq,
    LanemaskLt,
    LanemaskLe,
    LanemaskGt,
    LanemaskGe,
    DynamicSmemSize,
    TotalSmemSize,
}

impl Sreg {
    pub fn parse(s: &str) -> Option<Sreg> {
        let dim = |d: &str| match d {
            "x" => Some(0u8),
            "y" => Some(1),
            "z" => Some(2),
            _ => None,
        };
        if let Some((base, d)) = s.split_once('.') {
            let d = dim(d)?;
            return Some(match base {
                "%tid" => Sreg::Tid(d),
                "%ntid" => Sreg::Ntid(d),
                "%ctaid" => Sreg::Ctaid(d),
                "%nctaid" => Sreg::Nctaid(d),
                _ => return None,
            });
        }
        Some(match s {
            "%laneid" => Sreg::LaneId,
            "%warpid" => Sreg::WarpId,
            "%nwarpid" => Sreg::NWarpId,
            "%lanemask_eq" => Sreg::LanemaskEq,
            "%lanemask_lt" => Sreg::LanemaskLt,
            "%lanemask_le" => Sreg::LanemaskLe,
            "%lanemask_gt" => Sreg::LanemaskGt,
            "%lanemask_ge" => Sreg::LanemaskGe,
            "%dynamic_smem_size" => Sreg::DynamicSmemSize,
            "%total_smem_size" => Sreg::TotalSmemSize,
            _ => return None,
        })
    }
}

/// A source or destination operand.
#[derive(Clone, Debug, PartialEq)]
pub enum Operand {
    /// Register index into the per-thread register file.
    Reg(u32),
    /// `!%p`: the complement of a predicate register (setp/selp/bar sources).
    PredNot(u32),
    /// Raw bits of an immediate, already converted to the operand's type.
    Imm(u64),
    Special(Sreg),
    /// Address of a variable as a value (`mov.u64 %rd, smem;`), in the variable's own space.
    Sym(Symbol),
    /// `_`: a destination that discards the result.
    Sink,
}

#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Symbol {
    /// Offset within the block's shared memory.
    Shared(u64),
    /// Offset within the kernel parameter buffer.
    Param(u64),
}

/// `[base+offset]`.
#[derive(Clone, Debug, PartialEq)]
pub struct Address {
    pub base: AddrBase,
    pub offset: i64,
}

#[derive(Clone, Debug, PartialEq)]
pub enum AddrBase {
    Reg(u32),
    Sym(Symbol),
    /// `[imm]`: the offset alone is the address.
    Abs,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IntOp {
    Add,
    AddSat,
    Sub,
    SubSat,
    MulLo,
    MulHi,
    MulWide,
    MadLo,
    MadHi,
    MadWide,
    Div,
    Rem,
    Min,
    Max,
    And,
    Or,
    Xor,
    Not,
    Cnot,
    Shl,
    Shr,
    Neg,
    Abs,
    Popc,
    Clz,
    Brev,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FloatOp {
    Add,
    Sub,
    Mul,
    Fma,
    Div,
    Min,
    Max,
    MinNaN,
    MaxNaN,
    Neg,
    Abs,
    Rcp,
    Sqrt,
    Rsqrt,
    Ex2,
    Lg2,
    Sin,
    Cos,
    Tanh,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Cmp {
    Eq,
    Ne,
    Lt,
    Le,
    Gt,
    Ge,
    Lo,
    Ls,
    Hi,
    Hs,
    Equ,
    Neu,
    Ltu,
    Leu,
    Gtu,
    Geu,
    Num,
    Nan,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BoolOp {
    And,
    Or,
    Xor,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ShflMode {
    Up,
    Down,
    Bfly,
    Idx,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AtomOp {
    Add,
    Min,
    Max,
    And,
    Or,
    Xor,
    Exch,
    Cas,
    Inc,
    Dec,
}

/// Integer rounding of `cvt` (float to integer, or float to integral float).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IntRound {
    Rni,
    Rzi,
    Rmi,
    Rpi,
}

/// Narrow floating-point formats produced or consumed in pairs by `cvt`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Packed {
    E4m3x2,
    E2m1x2,
}

#[derive(Clone, Copy, Debug, PartialEq)]
pub enum CvtKind {
    /// Integer to integer (truncate / extend, optionally saturate).
    IntInt { dst: Ty, src: Ty, sat: bool },
    /// Integer to f32/f64, round to nearest even.
    IntFloat { dst: Ty, src: Ty },
    /// Float to integer with the given rounding; saturates; NaN per the ISA.
    FloatInt { dst: Ty, src: Ty, rnd: IntRound, ftz: bool },
    /// Float to float (`round`: round a same-size value to an integral value).
    FloatFloat { dst: Ty, src: Ty, round: Option<IntRound>, ftz: bool, sat: bool, relu: bool, satfinite: bool },
    /// Two f32 to a packed pair: `d = {cvt(a) (high), cvt(b) (low)}` for bf16x2/f16x2.
    F32x2 { dst: Ty, relu: bool, satfinite: bool },
    /// Two f32 to e4m3x2 (b16) or e2m1x2 (b8): `a` in the high byte/nibble.
    ToPacked { fmt: Packed, relu: bool },
    /// e4m3x2 / e2m1x2 to f16x2: high byte/nibble to the high half.
    PackedToF16x2 { fmt: Packed, relu: bool },
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MmaKind {
    /// `m16n8k16.row.col.f32.{bf16,f16}.{bf16,f16}.f32`.
    Dense16 { f16: bool },
    /// `m16n8k64.row.col.kind::{mxf4,mxf4nvf4}.block_scale.scale_vec::{2X,4X}.f32.e2m1.e2m1.f32.{ue8m0,ue4m3}`.
    Fp4BlockScaled { scale_vec: u32, ue4m3: bool },
}

#[derive(Clone, Debug, PartialEq)]
pub struct Mma {
    pub kind: MmaKind,
    pub d: Vec<Operand>,
    pub a: Vec<Operand>,
    pub b: Vec<Operand>,
    pub c: Vec<Operand>,
    /// Block-scaled only: scale-a-data, byte-id-a, thread-id-a, scale-b-data, byte-id-b, thread-id-b.
    pub scales: Vec<Operand>,
}

#[derive(Clone, Debug, PartialEq)]
pub enum Op {
    /// Copy bits (immediates were converted at decode time).
    Mov {
        d: Operand,
        a: Operand,
    },
    /// `mov.bN d, {a, b, ...}`: element i goes to bits [i*bits, (i+1)*bits).
    Pack {
        d: Operand,
        parts: Vec<Operand>,
        bits: u32,
    },
    /// `mov.bN {a, b, ...}, s`.
    Unpack {
        parts: Vec<Operand>,
        a: Operand,
        bits: u32,
    },
    Ld {
        space: Space,
        ty: Ty,
        d: Vec<Operand>,
        addr: Address,
        /// `.nc`: through the non-coherent path, so the data must not change during the kernel.
        nc: bool,
    },
    St {
        space: Space,
        ty: Ty,
        s: Vec<Operand>,
        addr: Address,
    },
    /// `cvta[.to].space.size`: `to` converts generic to `space`.
    Cvta {
        to: bool,
        space: Space,
        d: Operand,
        a: Operand,
        bits: u32,
    },
    Int {
        op: IntOp,
        ty: Ty,
        d: Operand,
        a: Operand,
        b: Operand,
        c: Operand,
    },
    Float {
        op: FloatOp,
        ty: Ty,
        ftz: bool,
        sat: bool,
        d: Operand,
        a: Operand,
        b: Operand,
        c: Operand,
    },
    Setp {
        cmp: Cmp,
        ty: Ty,
        ftz: bool,
        p: Operand,
        q: Operand,
        a: Operand,
        b: Operand,
        combine: Option<(BoolOp, Operand)>,
    },
    Selp {
        d: Operand,
        a: Operand,
        b: Operand,
        c: Operand,
    },
    Prmt {
        d: Operand,
        a: Operand,
        b: Operand,
        c: Operand,
    },
    Lop3 {
        d: Operand,
        a: Operand,
        b: Operand,
        c: Operand,
        lut: u8,
    },
    Cvt {
        kind: CvtKind,
        d: Operand,
        a: Operand,
        b: Operand,
    },
    Bra {
        target: u32,
        uni: bool,
    },
    Exit,
    /// `bar.sync` / `barrier.sync` (`arrive == false`) or `bar.arrive`.
    Bar {
        arrive: bool,
        id: Operand,
        count: Option<Operand>,
    },
    WarpSync {
        mask: Operand,
    },
    /// `membar` / `fence`: a sequentially consistent fence.
    Fence,
    /// `nanosleep`: yields the host thread.
    Nanosleep,
    /// `trap`: the kernel aborts (on a GPU the launch fails with an error).
    Trap,
    Shfl {
        mode: ShflMode,
        d: Operand,
        p: Operand,
        a: Operand,
        b: Operand,
        c: Operand,
        mask: Operand,
    },
    Ldmatrix {
        num: u32,
        trans: bool,
        space: Space,
        d: Vec<Operand>,
        addr: Address,
    },
    Mma(Box<Mma>),
    /// `cp.async.{ca,cg}.shared.global [dst], [src], size{, src-size | ignore-src}`: the global
    /// bytes are read at issue and land in shared memory when a `cp.async.wait_*` completes
    /// their group. `fill` is the src-size (u32) or ignore-src (pred) operand.
    CpAsync {
        dst: Address,
        src: Address,
        size: u32,
        fill: Option<(Operand, bool)>,
    },
    CpAsyncCommit,
    /// `cp.async.wait_group N` (`None`: `cp.async.wait_all`).
    CpAsyncWait(Option<u32>),
    /// `atom` (d present) and `red` (d = Sink).
    Atom {
        space: Space,
        op: AtomOp,
        ty: Ty,
        d: Operand,
        addr: Address,
        b: Operand,
        c: Operand,
    },
}

/// One decoded instruction with its guard and source position.
#[derive(Clone, Debug)]
pub struct Inst {
    pub op: Op,
    /// `@p` (false) or `@!p` (true).
    pub guard: Option<(u32, bool)>,
    pub line: u32,
    pub text: String,
}

impl Inst {
    /// Instructions that need several lanes (or warps) to arrive before they execute.
    pub fn is_collective(&self) -> bool {
        matches!(self.op, Op::Bar { .. } | Op::WarpSync { .. } | Op::Shfl { .. } | Op::Ldmatrix { .. } | Op::Mma(_))
    }
}
