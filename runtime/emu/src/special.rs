//! Special registers (`%tid`, `%ctaid`, `%laneid`, ...).

use super::ir::Sreg;

/// Launch-wide values special registers read.
#[derive(Clone, Copy, Debug)]
pub struct Geometry {
    pub grid: [u32; 3],
    pub block: [u32; 3],
    pub smem_dynamic: u32,
    pub smem_total: u32,
}

/// Where one thread sits.
#[derive(Clone, Copy, Debug)]
pub struct ThreadPos {
    pub tid: [u32; 3],
    pub ctaid: [u32; 3],
    pub lane: u32,
    pub warp: u32,
    pub nwarps: u32,
}

pub fn read(s: Sreg, g: &Geometry, p: &ThreadPos) -> u64 {
    let lane = p.lane;
    let below = if lane == 0 { 0 } else { u32::MAX >> (32 - lane) };
    (match s {
        Sreg::Tid(d) => p.tid[d as usize],
        Sreg::Ntid(d) => g.block[d as usize],
        Sreg::Ctaid(d) => p.ctaid[d as usize],
        Sreg::Nctaid(d) => g.grid[d as usize],
        Sreg::LaneId => lane,
        Sreg::WarpId => p.warp,
        // The emulator's "SM" holds exactly one block.
        Sreg::NWarpId => p.nwarps,
        Sreg::LanemaskEq => 1 << lane,
        Sreg::LanemaskLt => below,
        Sreg::LanemaskLe => below | (1 << lane),
        Sreg::LanemaskGt => !(below | (1 << lane)),
        Sreg::LanemaskGe => !below,
        Sreg::DynamicSmemSize => g.smem_dynamic,
        Sreg::TotalSmemSize => g.smem_total,
    }) as u64
}
