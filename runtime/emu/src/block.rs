//! One thread block: its warps, shared memory and the 16 named barriers.
//!
//! Warps take turns at memory accesses (so a race between warps that share memory without a
//! barrier shows, as it would on hardware), each until it exits or reaches a barrier; warps run at
//! different speeds, warp w making [`burst`] accesses a turn, so one can run ahead of another (a
//! buffer one warp rewrites before a slower one has read it shows too), and which warps lead
//! differs between blocks, so a race shows whichever way round it goes; a barrier
//! completes when the participating warps have arrived (the `b` thread count, or all warps that
//! have not exited). Arrival is per warp, as in the ISA.

use super::memory::SharedMemory;
use super::warp::{BlockMem, Counters, LaunchCtx, NcWords, Status, Warp};
use super::EmuError;

#[derive(Default, Clone)]
struct Barrier {
    arrived: u32,
    count: Option<u32>,
    waiting: Vec<usize>,
    line: u32,
}

fn complete(b: &Barrier, live_warps: u32) -> bool {
    b.arrived > 0
        && match b.count {
            Some(n) => b.arrived * 32 >= n,
            None => b.arrived >= live_warps,
        }
}

pub fn run_block(lc: &LaunchCtx, ctaid: [u32; 3]) -> Result<(Counters, Option<NcWords>), EmuError> {
    let block = lc.geo.block;
    let nthreads = block[0] * block[1] * block[2];
    let nwarps = nthreads.div_ceil(32);
    let mut warps: Vec<Warp> = (0..nwarps).map(|w| Warp::new(lc.entry, w, nwarps, block, ctaid)).collect();
    let mut bm = BlockMem { shared: SharedMemory::new(lc.geo.smem_total as usize), ctr: Counters::default(), nc: lc.nc_check.then(NcWords::default) };
    let mut bars: Vec<Barrier> = vec![Barrier::default(); 16];
    let mut blocked = vec![false; warps.len()];
    let fail = |line: u32, msg: String| EmuError::Exec {
        file: String::new(),
        line,
        entry: lc.entry.name.clone(),
        inst: lc.entry.insts.iter().find(|i| i.line == line).map(|i| i.text.clone()).unwrap_or_default(),
        msg: format!("block ({},{},{}): {msg}", ctaid[0], ctaid[1], ctaid[2]),
    };
    loop {
        let mut progressed = false;
        for w in 0..warps.len() {
            let mut accesses = 0;
            while !warps[w].done() && !blocked[w] {
                progressed = true;
                match warps[w].run(lc, &mut bm)? {
                    Status::Done => break,
                    Status::Yield => {
                        accesses += 1;
                        if accesses >= burst(w, ctaid, lc.ordinal) {
                            break;
                        }
                    }
                    Status::Barrier { id, count, wait, line } => {
                        if id == u32::MAX {
                            blocked[w] = true;
                            break;
                        }
                        let b = &mut bars[id as usize];
                        if b.arrived > 0 && b.count != count {
                            return Err(fail(line, format!("barrier {id} used with thread count {count:?} while {:?} is pending (line {})", b.count, b.line)));
                        }
                        if let Some(n) = count {
                            if n == 0 || n % 32 != 0 || n > nwarps * 32 {
                                return Err(fail(
                                    line,
                                    format!("barrier {id}: thread count {n} must be a non-zero multiple of 32 and at most the block's {} warp slots", nwarps * 32),
                                ));
                            }
                        }
                        b.count = count;
                        b.arrived += 1;
                        b.line = line;
                        if wait {
                            b.waiting.push(w);
                            blocked[w] = true;
                        }
                        let live = warps.iter().filter(|x| !x.done()).count() as u32;
                        if complete(&bars[id as usize], live) {
                            release(&mut bars[id as usize], &mut warps, &mut blocked);
                        }
                    }
                }
            }
        }
        // Exits may complete barriers that wait for "all non-exited warps".
        let live = warps.iter().filter(|x| !x.done()).count() as u32;
        let mut released = false;
        for b in bars.iter_mut() {
            if complete(b, live) {
                release(b, &mut warps, &mut blocked);
                released = true;
            }
        }
        if warps.iter().all(|w| w.done()) {
            return Ok((bm.ctr, bm.nc));
        }
        if !progressed && !released {
            let pending: Vec<String> = bars
                .iter()
                .enumerate()
                .filter(|(_, b)| b.arrived > 0)
                .map(|(i, b)| format!("barrier {i} (line {}): {} warp(s) arrived, {} expected", b.line, b.arrived, b.count.map(|n| n.div_ceil(32)).unwrap_or(live)))
                .collect();
            let line = bars.iter().find(|b| b.arrived > 0).map(|b| b.line).unwrap_or(0);
            return Err(fail(line, format!("deadlock: {}; {live} warp(s) still running", pending.join("; "))));
        }
    }
}

/// Memory accesses warp `w` of block `ctaid` makes a turn: 1, 6, 11, .. 36, so within a block
/// some warps run several times ahead of others between barriers. The speeds of each eight
/// warps are permuted by the block and the launch (speed rank `(w mod 8) xor (b mod 8)`, `b` the
/// sum of the block's indices and the launch's ordinal on its memory): warp 0 is the slowest of
/// block 0 of a memory's first launch but ahead of warp 1 in every odd block, and in every block
/// 0 of its odd launches (a one-block kernel, e.g. a collective), so a kernel whose low warps
/// overwrite what its high warps still read, or announce what they have not yet written, fails
/// too.
fn burst(w: usize, ctaid: [u32; 3], ordinal: u64) -> u32 {
    let b = ctaid.iter().map(|&c| c as u64).sum::<u64>() + ordinal;
    1 + 5 * ((w as u64 % 8) ^ (b % 8)) as u32
}

fn release(b: &mut Barrier, warps: &mut [Warp], blocked: &mut [bool]) {
    for &w in &b.waiting {
        warps[w].release_barrier();
        blocked[w] = false;
    }
    *b = Barrier::default();
}
