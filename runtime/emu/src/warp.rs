//! Warp execution: 32 lanes in lockstep under an active mask.
//!
//! Divergence: the warp keeps groups of lanes that share a program counter and always runs the
//! group with the lowest PC, so lanes that branched ahead wait for the others and reconverge where
//! the paths meet (for the forward-branch / loop layouts compilers emit). Collective instructions
//! (`shfl.sync`, `ldmatrix`, `mma`, `bar.warp.sync`, `bar.sync`) park a group until every lane
//! they need has arrived at the same instruction; if those lanes can never arrive, the launch
//! fails with a deadlock error naming the instruction.

use super::access::PendingCopy;
use super::alu;
use super::convert;
use super::ir::*;
use super::memory::{classify, Generic, GlobalMemory, SharedMemory, SHARED_WINDOW};
use super::parser::Entry;
use super::regs::RegFile;
use super::special::{self, Geometry, ThreadPos};
use super::EmuError;

/// Watchdog: a block that runs longer than this is reported instead of hanging the process.
pub const MAX_WARP_INSTRUCTIONS_PER_BLOCK: u64 = 1 << 32;

/// Read-only state of one launch.
pub struct LaunchCtx<'a> {
    pub entry: &'a Entry,
    pub global: &'a GlobalMemory,
    /// Other GPUs' memories this one may address (peer access enabled), as over NVLink / PCIe.
    pub peers: &'a [&'a GlobalMemory],
    pub params: &'a [u8],
    pub geo: Geometry,
    /// Record `.nc` reads and global writes (`KILN_EMU_NC_CHECK`): a launch that writes a word it
    /// also reads through `.nc` is an error.
    pub nc_check: bool,
    /// The launch's number on its memory (`GlobalMemory::count_launch`): it permutes the warps'
    /// speeds, so a one-block kernel's warp 0 is not always its slowest.
    pub ordinal: u64,
}

impl LaunchCtx<'_> {
    /// The memory whose address range holds `addr`: this GPU's, else a peer's (an address in
    /// neither faults in this GPU's memory, naming it). Every global access asks: a range check,
    /// the buffer lookup stays the memory's own.
    pub fn memory(&self, addr: u64) -> &GlobalMemory {
        if self.peers.is_empty() || self.global.owns(addr) {
            return self.global;
        }
        self.peers.iter().copied().find(|m| m.owns(addr)).unwrap_or(self.global)
    }
}

/// Per-block counters, summed into `LaunchStats`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Counters {
    pub warp_instructions: u64,
    pub thread_instructions: u64,
    pub global_bytes_read: u64,
    pub global_bytes_written: u64,
    pub shared_bytes_read: u64,
    pub shared_bytes_written: u64,
}

impl Counters {
    pub fn add(&mut self, o: &Counters) {
        self.warp_instructions += o.warp_instructions;
        self.thread_instructions += o.thread_instructions;
        self.global_bytes_read += o.global_bytes_read;
        self.global_bytes_written += o.global_bytes_written;
        self.shared_bytes_read += o.shared_bytes_read;
        self.shared_bytes_written += o.shared_bytes_written;
    }
}

/// Mutable state of one block that warps touch.
pub struct BlockMem {
    pub shared: SharedMemory,
    pub ctr: Counters,
    /// Global words this block read through `.nc` and wrote, when the launch checks `.nc`.
    pub nc: Option<NcWords>,
}

/// 4-byte global words a block read with `ld.global.nc` and wrote (stores, atomics). PTX makes
/// `.nc` data read-only for the whole kernel: a GPU may serve such a load from a non-coherent
/// cache, stale if the kernel writes the word anywhere, before or after.
///
/// Past `NcWords::CAP` words a block stops recording and its launch goes unchecked (full-size
/// GLM-5 launches touch hundreds of MB; the kernel tests' shapes stay far below).
#[derive(Debug, Default)]
pub struct NcWords {
    pub read: std::collections::HashSet<u64>,
    pub written: std::collections::HashSet<u64>,
    pub overflow: bool,
}

impl NcWords {
    pub const CAP: usize = 1 << 20;

    /// Records the words of `bytes` bytes at `addr` as read through `.nc` or as written.
    pub fn note(&mut self, nc_read: bool, addr: u64, bytes: u64) {
        if self.overflow {
            return;
        }
        let words = (addr >> 2)..=((addr + bytes.max(1) - 1) >> 2);
        if nc_read {
            self.read.extend(words);
        } else {
            self.written.extend(words);
        }
        if self.read.len() + self.written.len() > Self::CAP {
            *self = NcWords { overflow: true, ..NcWords::default() };
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Wait {
    No,
    /// Parked at a collective until more lanes arrive.
    Collective,
    /// Arrived at `bar.sync`; released by the block.
    Barrier,
}

#[derive(Clone, Copy, Debug)]
struct Group {
    pc: u32,
    mask: u32,
    wait: Wait,
}

/// Why `Warp::run` returned.
#[derive(Debug, PartialEq, Eq)]
pub enum Status {
    /// Every lane has exited.
    Done,
    /// The whole warp arrived at barrier `id`; `wait` is false for `bar.arrive` (keep running).
    Barrier { id: u32, count: Option<u32>, wait: bool, line: u32 },
    /// The warp accessed memory and lets the block's next warp run to its next access: warps take
    /// turns access by access, so warps that share memory without a barrier between them see
    /// each other's accesses interleaved, as on hardware, not one warp's all before the next's.
    Yield,
}

pub struct Warp {
    pub index: u32,
    pub regs: RegFile,
    groups: Vec<Group>,
    /// Lanes that exited, or never existed (partial last warp).
    pub exited: u32,
    pos: [ThreadPos; 32],
    /// Per lane: cp.async copies not yet committed, and committed groups (oldest first).
    pub(super) cp_open: Vec<Vec<PendingCopy>>,
    pub(super) cp_groups: Vec<std::collections::VecDeque<Vec<PendingCopy>>>,
}

#[inline]
pub(super) fn lanes(mask: u32) -> impl Iterator<Item = usize> {
    let mut m = mask;
    std::iter::from_fn(move || {
        if m == 0 {
            None
        } else {
            let l = m.trailing_zeros() as usize;
            m &= m - 1;
            Some(l)
        }
    })
}

impl Warp {
    /// Warp `index` of a block; lanes beyond `nthreads` do not exist.
    pub fn new(entry: &Entry, index: u32, nwarps: u32, block: [u32; 3], ctaid: [u32; 3]) -> Warp {
        let nthreads = block[0] * block[1] * block[2];
        let mut pos = [ThreadPos { tid: [0; 3], ctaid, lane: 0, warp: index, nwarps }; 32];
        let mut live = 0u32;
        for (l, p) in pos.iter_mut().enumerate() {
            let t = index * 32 + l as u32;
            p.lane = l as u32;
            if t < nthreads {
                live |= 1 << l;
                p.tid = [t % block[0], (t / block[0]) % block[1], t / (block[0] * block[1])];
            }
        }
        Warp {
            index,
            regs: RegFile::new(&entry.reg_bits),
            groups: vec![Group { pc: 0, mask: live, wait: Wait::No }],
            exited: !live,
            pos,
            cp_open: vec![Vec::new(); 32],
            cp_groups: vec![Default::default(); 32],
        }
    }

    pub fn done(&self) -> bool {
        self.groups.is_empty()
    }

    /// Continues the lanes parked at a completed `bar.sync`.
    pub fn release_barrier(&mut self) {
        for g in &mut self.groups {
            if g.wait == Wait::Barrier {
                g.wait = Wait::No;
                g.pc += 1;
            }
        }
        self.merge();
    }

    pub fn at_barrier(&self) -> bool {
        self.groups.iter().any(|g| g.wait == Wait::Barrier)
    }

    #[inline]
    pub(super) fn val(&self, op: &Operand, lane: usize, lc: &LaunchCtx) -> u64 {
        match op {
            Operand::Reg(r) => self.regs.get(*r, lane),
            Operand::PredNot(r) => u64::from(self.regs.get(*r, lane) == 0),
            Operand::Imm(v) => *v,
            Operand::Special(s) => special::read(*s, &lc.geo, &self.pos[lane]),
            Operand::Sym(Symbol::Shared(o)) | Operand::Sym(Symbol::Param(o)) => *o,
            Operand::Sink => 0,
        }
    }

    #[inline]
    pub(super) fn set(&mut self, d: &Operand, lane: usize, v: u64) {
        if let Operand::Reg(r) = d {
            self.regs.set(*r, lane, v);
        }
    }

    /// The value an operand has in every lane of `mask`, or an error if lanes disagree.
    pub(super) fn uniform(&self, op: &Operand, mask: u32, lc: &LaunchCtx, what: &str) -> Result<u64, String> {
        let mut it = lanes(mask);
        let Some(first) = it.next() else {
            return Ok(0);
        };
        let v = self.val(op, first, lc);
        for l in it {
            let w = self.val(op, l, lc);
            if w != v {
                return Err(format!("{what} must be the same in all lanes (lane {first}: {v:#x}, lane {l}: {w:#x})"));
            }
        }
        Ok(v)
    }

    fn merge(&mut self) {
        if self.groups.len() < 2 {
            return;
        }
        let mut i = 0;
        while i < self.groups.len() {
            let mut j = i + 1;
            while j < self.groups.len() {
                if self.groups[j].pc == self.groups[i].pc && self.groups[j].wait != Wait::Barrier && self.groups[i].wait != Wait::Barrier {
                    let m = self.groups[j].mask;
                    self.groups[i].mask |= m;
                    self.groups[i].wait = Wait::No;
                    self.groups.swap_remove(j);
                } else {
                    j += 1;
                }
            }
            i += 1;
        }
    }

    fn err(&self, lc: &LaunchCtx, inst: &Inst, msg: String) -> EmuError {
        let c = self.pos[0].ctaid;
        EmuError::Exec {
            file: String::new(),
            line: inst.line,
            inst: inst.text.clone(),
            msg: format!("block ({},{},{}) warp {}: {msg}", c[0], c[1], c[2], self.index),
            entry: lc.entry.name.clone(),
        }
    }

    /// Lanes a collective needs at the same instruction before it can run.
    fn required(&self, inst: &Inst, mask: u32, lc: &LaunchCtx) -> Result<u32, String> {
        let live = !self.exited;
        match &inst.op {
            Op::Mma(_) | Op::Ldmatrix { .. } => {
                if self.exited != 0 {
                    return Err(format!(
                        ".aligned warp collective executed while lanes {:#010x} have exited or do not exist (the block size must be a multiple of 32)",
                        self.exited
                    ));
                }
                Ok(u32::MAX)
            }
            Op::Bar { .. } => Ok(live),
            Op::Shfl { mask: m, .. } | Op::WarpSync { mask: m } => {
                let mm = self.uniform(m, mask, lc, "membermask")? as u32;
                let outside = mask & !mm;
                if outside != 0 {
                    return Err(format!("lanes {outside:#010x} execute it but are not in membermask {mm:#010x}"));
                }
                Ok(mm & live)
            }
            _ => Ok(0),
        }
    }

    /// Runs until every lane exits or the warp reaches a barrier.
    pub fn run(&mut self, lc: &LaunchCtx, bm: &mut BlockMem) -> Result<Status, EmuError> {
        let insts = &lc.entry.insts;
        loop {
            let mut gi = usize::MAX;
            for (i, g) in self.groups.iter().enumerate() {
                if g.wait == Wait::No && (gi == usize::MAX || g.pc < self.groups[gi].pc) {
                    gi = i;
                }
            }
            if gi == usize::MAX {
                return self.stalled(lc);
            }
            let Group { pc, mask, .. } = self.groups[gi];
            let Some(inst) = insts.get(pc as usize) else {
                // Falling off the end of the kernel is an exit.
                self.exited |= mask;
                self.groups.swap_remove(gi);
                for g in &mut self.groups {
                    if g.wait == Wait::Collective {
                        g.wait = Wait::No;
                    }
                }
                continue;
            };
            if inst.is_collective() {
                let req = self.required(inst, mask, lc).map_err(|m| self.err(lc, inst, m))?;
                if req & !mask != 0 {
                    self.groups[gi].wait = Wait::Collective;
                    continue;
                }
            }
            let exec = match inst.guard {
                None => mask,
                Some((p, neg)) => {
                    let mut e = 0;
                    for l in lanes(mask) {
                        if (self.regs.get(p, l) != 0) != neg {
                            e |= 1 << l;
                        }
                    }
                    e
                }
            };
            bm.ctr.warp_instructions += 1;
            bm.ctr.thread_instructions += exec.count_ones() as u64;
            if bm.ctr.warp_instructions > MAX_WARP_INSTRUCTIONS_PER_BLOCK {
                return Err(self.err(lc, inst, format!("block executed more than {MAX_WARP_INSTRUCTIONS_PER_BLOCK} warp instructions: infinite loop, or a spin-wait on another block (blocks are not guaranteed to run concurrently)")));
            }
            match &inst.op {
                Op::Bra { target, uni } => {
                    let fall = mask & !exec;
                    if *uni && exec != 0 && fall != 0 {
                        return Err(self.err(lc, inst, format!("bra.uni is divergent (taken by {exec:#010x}, not by {fall:#010x})")));
                    }
                    if exec == 0 {
                        self.groups[gi].pc += 1;
                    } else if fall == 0 {
                        self.groups[gi].pc = *target;
                    } else {
                        self.groups[gi].mask = fall;
                        self.groups[gi].pc += 1;
                        self.groups.push(Group { pc: *target, mask: exec, wait: Wait::No });
                    }
                }
                Op::Exit => {
                    self.exited |= exec;
                    // Parked collectives may have been waiting only for the lanes that just exited.
                    for g in &mut self.groups {
                        if g.wait == Wait::Collective {
                            g.wait = Wait::No;
                        }
                    }
                    let rest = mask & !exec;
                    if rest == 0 {
                        self.groups.swap_remove(gi);
                    } else {
                        self.groups[gi].mask = rest;
                        self.groups[gi].pc += 1;
                    }
                }
                Op::Bar { .. } if exec == 0 => self.groups[gi].pc += 1,
                Op::Bar { arrive, id, count } => {
                    if exec != mask {
                        return Err(self.err(
                            lc,
                            inst,
                            format!("barrier with a guard that is false for lanes {:#010x} (all non-exited lanes of the warp must execute it)", mask & !exec),
                        ));
                    }
                    let b = self.uniform(id, mask, lc, "barrier id").map_err(|m| self.err(lc, inst, m))? as u32;
                    if b > 15 {
                        return Err(self.err(lc, inst, format!("barrier id {b} is out of range 0..15")));
                    }
                    let n = match count {
                        Some(c) => Some(self.uniform(c, mask, lc, "barrier thread count").map_err(|m| self.err(lc, inst, m))? as u32),
                        None => None,
                    };
                    if *arrive {
                        self.groups[gi].pc += 1;
                    } else {
                        self.groups[gi].wait = Wait::Barrier;
                    }
                    self.merge();
                    return Ok(Status::Barrier { id: b, count: n, wait: !*arrive, line: inst.line });
                }
                Op::WarpSync { .. } => self.groups[gi].pc += 1,
                _ => {
                    if exec != 0 {
                        self.exec(inst, exec, lc, bm).map_err(|m| self.err(lc, inst, m))?;
                    }
                    self.groups[gi].pc += 1;
                }
            }
            self.merge();
            // turns at memory accesses: what another warp may see or change in between
            if matches!(inst.op, Op::Ld { .. } | Op::St { .. } | Op::Ldmatrix { .. } | Op::CpAsync { .. } | Op::CpAsyncWait(_) | Op::Atom { .. }) {
                return Ok(Status::Yield);
            }
        }
    }

    fn stalled(&self, lc: &LaunchCtx) -> Result<Status, EmuError> {
        if self.groups.is_empty() {
            return Ok(Status::Done);
        }
        if self.at_barrier() {
            // Reported when the barrier was reached; the block decides when to release.
            return Ok(Status::Barrier { id: u32::MAX, count: None, wait: true, line: 0 });
        }
        let g = self.groups[0];
        let inst = &lc.entry.insts[g.pc as usize];
        let waiting: u32 = self.groups.iter().filter(|x| x.pc == g.pc).map(|x| x.mask).fold(0, |a, b| a | b);
        let elsewhere: Vec<String> =
            self.groups.iter().filter(|x| x.pc != g.pc).map(|x| format!("{:#010x} at line {}", x.mask, lc.entry.insts.get(x.pc as usize).map(|i| i.line).unwrap_or(0))).collect();
        Err(self.err(
            lc,
            inst,
            format!(
                "deadlock: lanes {waiting:#010x} wait for lanes that never arrive (exited lanes {:#010x}; other lanes: {})",
                self.exited,
                if elsewhere.is_empty() { "none".to_string() } else { elsewhere.join(", ") }
            ),
        ))
    }

    /// Executes a non-control instruction for the lanes in `exec`.
    fn exec(&mut self, inst: &Inst, exec: u32, lc: &LaunchCtx, bm: &mut BlockMem) -> Result<(), String> {
        match &inst.op {
            Op::Mov { d, a } => {
                for l in lanes(exec) {
                    let v = self.val(a, l, lc);
                    self.set(d, l, v);
                }
            }
            Op::Pack { d, parts, bits } => {
                for l in lanes(exec) {
                    let mut v = 0u64;
                    for (i, p) in parts.iter().enumerate() {
                        v |= (self.val(p, l, lc) & mask_bits(*bits)) << (i as u32 * bits);
                    }
                    self.set(d, l, v);
                }
            }
            Op::Unpack { parts, a, bits } => {
                for l in lanes(exec) {
                    let v = self.val(a, l, lc);
                    for (i, p) in parts.iter().enumerate() {
                        self.set(p, l, (v >> (i as u32 * bits)) & mask_bits(*bits));
                    }
                }
            }
            Op::Ld { space, ty, d, addr, nc } => {
                let size = ty.bytes() as u64;
                let total = size * d.len() as u64;
                for l in lanes(exec) {
                    let a = self.eff_addr(addr, *space, l)?;
                    if a % total != 0 {
                        return Err(format!("lane {l}: misaligned {total}-byte load at {a:#x}"));
                    }
                    if let (true, Some(t)) = (*nc, bm.nc.as_mut()) {
                        t.note(true, a, total);
                    }
                    for (i, dst) in d.iter().enumerate() {
                        let v = self.load(lc, bm, *space, a.wrapping_add(i as u64 * size), size).map_err(|e| format!("lane {l}: {e}"))?;
                        let v = if ty.is_signed() { sext(v, ty.bits()) } else { v };
                        self.set(dst, l, v);
                    }
                }
            }
            Op::St { space, ty, s, addr } => {
                let size = ty.bytes() as u64;
                let total = size * s.len() as u64;
                for l in lanes(exec) {
                    let a = self.eff_addr(addr, *space, l)?;
                    if a % total != 0 {
                        return Err(format!("lane {l}: misaligned {total}-byte store at {a:#x}"));
                    }
                    for (i, src) in s.iter().enumerate() {
                        let v = self.val(src, l, lc) & mask_bits(ty.bits());
                        self.store(lc, bm, *space, a.wrapping_add(i as u64 * size), size, v).map_err(|e| format!("lane {l}: {e}"))?;
                    }
                }
            }
            Op::Cvta { to, space, d, a, bits } => {
                for l in lanes(exec) {
                    let v = self.val(a, l, lc) & mask_bits(*bits);
                    let r = match (space, to) {
                        (Space::Shared, true) => match classify(v) {
                            Generic::Shared(o) => o,
                            Generic::Global(_) => return Err(format!("lane {l}: cvta.to.shared of {v:#x}, which is not a shared-window address")),
                        },
                        (Space::Shared, false) => SHARED_WINDOW.wrapping_add(v),
                        _ => v,
                    };
                    self.set(d, l, r);
                }
            }
            Op::Int { op, ty, d, a, b, c } => {
                for l in lanes(exec) {
                    let r = alu::int_op(*op, *ty, self.val(a, l, lc), self.val(b, l, lc), self.val(c, l, lc));
                    self.set(d, l, r);
                }
            }
            Op::Float { op, ty, ftz, sat, d, a, b, c } => {
                for l in lanes(exec) {
                    let r = alu::float_op(*op, *ty, *ftz, *sat, self.val(a, l, lc), self.val(b, l, lc), self.val(c, l, lc));
                    self.set(d, l, r);
                }
            }
            Op::Setp { cmp, ty, ftz, p, q, a, b, combine } => {
                for l in lanes(exec) {
                    let t = alu::compare(*cmp, *ty, *ftz, self.val(a, l, lc), self.val(b, l, lc));
                    let (tp, tq) = match combine {
                        Some((op, c)) => {
                            let cv = self.val(c, l, lc) != 0;
                            (alu::combine(*op, t, cv), alu::combine(*op, !t, cv))
                        }
                        None => (t, !t),
                    };
                    self.set(p, l, tp as u64);
                    self.set(q, l, tq as u64);
                }
            }
            Op::Selp { d, a, b, c } => {
                for l in lanes(exec) {
                    let v = if self.val(c, l, lc) != 0 { self.val(a, l, lc) } else { self.val(b, l, lc) };
                    self.set(d, l, v);
                }
            }
            Op::Prmt { d, a, b, c } => {
                for l in lanes(exec) {
                    let v = alu::prmt(self.val(a, l, lc), self.val(b, l, lc), self.val(c, l, lc));
                    self.set(d, l, v);
                }
            }
            Op::Lop3 { d, a, b, c, lut } => {
                for l in lanes(exec) {
                    let v = alu::lop3(self.val(a, l, lc), self.val(b, l, lc), self.val(c, l, lc), *lut);
                    self.set(d, l, v);
                }
            }
            Op::Cvt { kind, d, a, b } => {
                for l in lanes(exec) {
                    let v = convert::cvt(kind, self.val(a, l, lc), self.val(b, l, lc));
                    self.set(d, l, v);
                }
            }
            Op::Fence => std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst),
            Op::Nanosleep => std::thread::yield_now(),
            Op::Trap if exec != 0 => return Err(format!("trap: lanes {exec:#010x} aborted the kernel")),
            Op::Trap => {}
            Op::Atom { space, op, ty, d, addr, b, c } => {
                let size = ty.bytes() as u64;
                for l in lanes(exec) {
                    let a = self.eff_addr(addr, *space, l)?;
                    if a % size != 0 {
                        return Err(format!("lane {l}: misaligned {size}-byte atomic at {a:#x}"));
                    }
                    let old = self.atomic(lc, bm, *space, a, *op, *ty, self.val(b, l, lc), self.val(c, l, lc)).map_err(|e| format!("lane {l}: {e}"))?;
                    self.set(d, l, if ty.is_signed() { sext(old, ty.bits()) } else { old });
                }
            }
            Op::CpAsync { dst, src, size, fill } => self.cp_async(dst, src, *size, fill, exec, lc, bm)?,
            Op::CpAsyncCommit => self.cp_async_commit(exec),
            Op::CpAsyncWait(n) => self.cp_async_wait(*n, exec, bm)?,
            Op::Shfl { .. } => self.shfl(inst, exec, lc)?,
            Op::Ldmatrix { .. } => {
                if exec != u32::MAX {
                    return Err(format!("ldmatrix.sync.aligned with a guard that is false for lanes {:#010x}", !exec));
                }
                self.ldmatrix(inst, exec, lc, bm)?
            }
            Op::Mma(m) => {
                if exec != u32::MAX {
                    return Err(format!("mma.sync.aligned with a guard that is false for lanes {:#010x}", !exec));
                }
                self.mma(m, lc)?
            }
            Op::Bra { .. } | Op::Exit | Op::Bar { .. } | Op::WarpSync { .. } => {}
        }
        Ok(())
    }
}
