//! Memory access of one warp: effective addresses, loads and stores per state space (with the
//! global/shared byte counters), atomics, and `cp.async` (global bytes read at issue, landing in
//! shared memory when a `cp.async.wait_*` completes their group).

use super::alu;
use super::ir::{AddrBase, Address, AtomOp, Operand, Space, Symbol, Ty};
use super::memory::{classify, Generic, SHARED_WINDOW};
use super::warp::{lanes, BlockMem, LaunchCtx, Warp};

/// A `cp.async` whose source was read at issue; it lands in shared memory at completion.
#[derive(Clone, Debug)]
pub(super) struct PendingCopy {
    dst: u64,
    data: [u8; 16],
    len: u32,
}

impl Warp {
    pub(super) fn eff_addr(&self, a: &Address, space: Space, lane: usize) -> Result<u64, String> {
        let base = match &a.base {
            AddrBase::Reg(r) => self.regs.get(*r, lane),
            AddrBase::Abs => 0,
            AddrBase::Sym(Symbol::Shared(o)) => match space {
                Space::Shared => *o,
                Space::Generic => SHARED_WINDOW + *o,
                _ => return Err("shared variable used as a non-shared address".into()),
            },
            AddrBase::Sym(Symbol::Param(o)) => match space {
                Space::Param => *o,
                _ => return Err("kernel parameter used as a non-.param address".into()),
            },
        };
        Ok(base.wrapping_add(a.offset as u64))
    }

    pub(super) fn load(&self, lc: &LaunchCtx, bm: &mut BlockMem, space: Space, addr: u64, size: u64) -> Result<u64, String> {
        match space {
            Space::Global => {
                bm.ctr.global_bytes_read += size;
                lc.memory(addr).load(addr, size)
            }
            Space::Shared => {
                bm.ctr.shared_bytes_read += size;
                bm.shared.load(addr, size)
            }
            Space::Param => {
                let end = addr
                    .checked_add(size)
                    .filter(|e| *e <= lc.params.len() as u64)
                    .ok_or_else(|| format!("parameter read at offset {addr} is outside the {} B parameter buffer", lc.params.len()))?;
                let mut b = [0u8; 8];
                b[..size as usize].copy_from_slice(&lc.params[addr as usize..end as usize]);
                Ok(u64::from_le_bytes(b))
            }
            Space::Generic => match classify(addr) {
                Generic::Shared(o) => self.load(lc, bm, Space::Shared, o, size),
                Generic::Global(g) => self.load(lc, bm, Space::Global, g, size),
            },
        }
    }

    pub(super) fn store(&self, lc: &LaunchCtx, bm: &mut BlockMem, space: Space, addr: u64, size: u64, v: u64) -> Result<(), String> {
        match space {
            Space::Global => {
                bm.ctr.global_bytes_written += size;
                if let Some(t) = bm.nc.as_mut() {
                    t.note(false, addr, size);
                }
                lc.memory(addr).store(addr, size, v)
            }
            Space::Shared => {
                bm.ctr.shared_bytes_written += size;
                bm.shared.store(addr, size, v)
            }
            Space::Param => Err("stores to .param are not allowed".into()),
            Space::Generic => match classify(addr) {
                Generic::Shared(o) => self.store(lc, bm, Space::Shared, o, size, v),
                Generic::Global(g) => self.store(lc, bm, Space::Global, g, size, v),
            },
        }
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) fn atomic(&self, lc: &LaunchCtx, bm: &mut BlockMem, space: Space, addr: u64, op: AtomOp, ty: Ty, b: u64, c: u64) -> Result<u64, String> {
        let size = ty.bytes() as u64;
        match space {
            Space::Global => {
                bm.ctr.global_bytes_read += size;
                bm.ctr.global_bytes_written += size;
                if let Some(t) = bm.nc.as_mut() {
                    t.note(false, addr, size);
                }
                lc.memory(addr).rmw(addr, size, &|old| alu::atom_apply(op, ty, old, b, c, true))
            }
            Space::Shared => {
                bm.ctr.shared_bytes_read += size;
                bm.ctr.shared_bytes_written += size;
                let old = bm.shared.load(addr, size)?;
                bm.shared.store(addr, size, alu::atom_apply(op, ty, old, b, c, false))?;
                Ok(old)
            }
            Space::Param => Err("atomics on .param".into()),
            Space::Generic => match classify(addr) {
                Generic::Shared(o) => self.atomic(lc, bm, Space::Shared, o, op, ty, b, c),
                Generic::Global(g) => self.atomic(lc, bm, Space::Global, g, op, ty, b, c),
            },
        }
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) fn cp_async(&mut self, dst: &Address, src: &Address, size: u32, fill: &Option<(Operand, bool)>, exec: u32, lc: &LaunchCtx, bm: &mut BlockMem) -> Result<(), String> {
        let n = size as u64;
        for l in lanes(exec) {
            let d = self.eff_addr(dst, Space::Shared, l)?;
            let s = self.eff_addr(src, Space::Global, l)?;
            if d % n != 0 || s % n != 0 {
                return Err(format!("lane {l}: cp.async of {n} B needs {n}-byte aligned addresses (dst {d:#x}, src {s:#x})"));
            }
            let valid = match fill {
                None => n,
                // ignore-src: a true predicate copies zeros.
                Some((op, true)) => {
                    if self.val(op, l, lc) != 0 {
                        0
                    } else {
                        n
                    }
                }
                // src-size: bytes past it are zero-filled.
                Some((op, false)) => {
                    let v = self.val(op, l, lc) & 0xFFFF_FFFF;
                    if v > n {
                        return Err(format!("lane {l}: cp.async src-size {v} exceeds cp-size {n}"));
                    }
                    v
                }
            };
            // Check the destination now so a fault points at this instruction.
            bm.shared.load(d.wrapping_add(n - 1), 1).map_err(|e| format!("lane {l}: {e}"))?;
            let mut data = [0u8; 16];
            for i in 0..valid {
                data[i as usize] = self.load(lc, bm, Space::Global, s.wrapping_add(i), 1).map_err(|e| format!("lane {l}: {e}"))? as u8;
            }
            self.cp_open[l].push(PendingCopy { dst: d, data, len: size });
        }
        Ok(())
    }

    pub(super) fn cp_async_commit(&mut self, exec: u32) {
        for l in lanes(exec) {
            let g = std::mem::take(&mut self.cp_open[l]);
            self.cp_groups[l].push_back(g);
        }
    }

    pub(super) fn cp_async_wait(&mut self, n: Option<u32>, exec: u32, bm: &mut BlockMem) -> Result<(), String> {
        for l in lanes(exec) {
            if n.is_none() {
                let g = std::mem::take(&mut self.cp_open[l]);
                self.cp_groups[l].push_back(g);
            }
            let keep = n.unwrap_or(0) as usize;
            while self.cp_groups[l].len() > keep {
                for c in self.cp_groups[l].pop_front().unwrap_or_default() {
                    for i in 0..c.len as u64 {
                        bm.shared.store(c.dst.wrapping_add(i), 1, c.data[i as usize] as u64)?;
                    }
                    bm.ctr.shared_bytes_written += c.len as u64;
                }
            }
        }
        Ok(())
    }
}
