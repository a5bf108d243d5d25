//! Warp collectives that move data between lanes: `shfl.sync` and `ldmatrix`.

use super::ir::{Inst, Op, ShflMode};
use super::warp::{lanes, BlockMem, LaunchCtx, Warp};

impl Warp {
    /// `shfl.sync.{up,down,bfly,idx}.b32 d[|p], a, b, c, membermask` (PTX ISA semantics: `c`
    /// packs the clamp value in bits 4:0 and the segment mask in bits 12:8).
    pub(super) fn shfl(&mut self, inst: &Inst, exec: u32, lc: &LaunchCtx) -> Result<(), String> {
        let Op::Shfl { mode, d, p, a, b, c, .. } = &inst.op else {
            return Err("internal: not a shfl".into());
        };
        let mut src = [0u64; 32];
        for l in lanes(exec) {
            src[l] = self.val(a, l, lc);
        }
        let mut out = [(0u64, false); 32];
        for l in lanes(exec) {
            let lane = l as i32;
            let bval = (self.val(b, l, lc) & 0x1F) as i32;
            let cv = self.val(c, l, lc);
            let cval = (cv & 0x1F) as i32;
            let seg = ((cv >> 8) & 0x1F) as i32;
            let max_lane = (lane & seg) | (cval & !seg);
            let min_lane = lane & seg;
            let (j, pval) = match mode {
                ShflMode::Up => {
                    let j = lane - bval;
                    (j, j >= max_lane)
                }
                ShflMode::Down => {
                    let j = lane + bval;
                    (j, j <= max_lane)
                }
                ShflMode::Bfly => {
                    let j = lane ^ bval;
                    (j, j <= max_lane)
                }
                ShflMode::Idx => {
                    let j = min_lane | (bval & !seg);
                    (j, j <= max_lane)
                }
            };
            let j = if pval { j } else { lane };
            if !(0..32).contains(&j) || exec & (1 << j) == 0 {
                return Err(format!("lane {l} reads lane {j}, which is not active in this shfl.sync (undefined in PTX)"));
            }
            out[l] = (src[j as usize], pval);
        }
        for l in lanes(exec) {
            self.set(d, l, out[l].0);
            self.set(p, l, out[l].1 as u64);
        }
        Ok(())
    }

    /// `ldmatrix.sync.aligned.m8n8.{x1,x2,x4}{.trans}.shared.b16`: lanes 8j..8j+7 give the row
    /// addresses of matrix j; without `.trans` lane l receives row l/4, elements 2(l%4) and
    /// 2(l%4)+1 (low half first); with `.trans` it receives column l/4, rows 2(l%4) and 2(l%4)+1.
    pub(super) fn ldmatrix(&mut self, inst: &Inst, _exec: u32, lc: &LaunchCtx, bm: &mut BlockMem) -> Result<(), String> {
        let Op::Ldmatrix { num, trans, space, d, addr } = &inst.op else {
            return Err("internal: not an ldmatrix".into());
        };
        let rows = 8 * *num as usize;
        let mut m = [[0u16; 8]; 32];
        for (r, row) in m.iter_mut().enumerate().take(rows) {
            let a = self.eff_addr(addr, *space, r)?;
            if a % 16 != 0 {
                return Err(format!("lane {r}: ldmatrix row address {a:#x} is not 16-byte aligned"));
            }
            for half in 0..2u64 {
                let v = self.load(lc, bm, *space, a.wrapping_add(8 * half), 8).map_err(|e| format!("lane {r}: {e}"))?;
                for k in 0..4 {
                    row[half as usize * 4 + k] = (v >> (16 * k)) as u16;
                }
            }
        }
        for l in 0..32usize {
            for (j, dst) in d.iter().enumerate() {
                let (lo, hi) =
                    if *trans { (m[8 * j + 2 * (l % 4)][l / 4], m[8 * j + 2 * (l % 4) + 1][l / 4]) } else { (m[8 * j + l / 4][2 * (l % 4)], m[8 * j + l / 4][2 * (l % 4) + 1]) };
                self.set(dst, l, lo as u64 | (hi as u64) << 16);
            }
        }
        Ok(())
    }
}
