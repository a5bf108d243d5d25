//! The one-shot P2P all-reduce (`p2p_all_reduce.ptx`) of every all-reduce up to
//! `P2P_MAX_BYTES`: one block per rank sums the ranks' buffers over peer memory in rank order.
//! The runtime replays it instead of NCCL only when every GPU pair passed the peer
//! write-and-verify probe; larger all-reduces, all-gathers and single-rank plans keep NCCL (or
//! nothing).

use super::{float_flag, of_grid, Cx, Instance};
use crate::kernels::{P2pAllReduceArgs, P2pAllReduceParams, Ptr};
use kiln_runtime::plan::{Op, P2pLayout, P2P_MAX_BYTES};

/// Threads of the block: enough loads in flight for 64 KiB from each of 7 peers.
const THREADS: u32 = 512;

/// Polls of a peer's flag before the kernel traps: each is a system-scope load of local memory
/// and a `nanosleep` of up to 200 ns, so 2^25 polls are seconds, against the microseconds a
/// peer normally takes. A rank that never arrives becomes a launch error, not a hung graph.
pub const P2P_SPINS: u32 = 1 << 25;

pub(super) fn instances(cx: &Cx, op: &Op) -> Result<Vec<Instance>, String> {
    let Op::AllReduce { buf } = *op else {
        return Ok(Vec::new());
    };
    let ranks = cx.plan.ranks();
    let b = cx.program.buffer(buf);
    if !(2..=8).contains(&ranks) || b.bytes > P2P_MAX_BYTES || b.bytes % 16 != 0 || b.bytes == 0 {
        return Ok(Vec::new());
    }
    let layout = P2pLayout { ranks: ranks as u64 };
    let params = P2pAllReduceParams {
        arch: cx.arch,
        ranks: ranks as u32,
        bytes: b.bytes as u32,
        bf16: float_flag(b.dtype, "the all-reduced buffer")?,
        slot: P2P_MAX_BYTES as u32,
        flags: layout.flags() as u32,
        slots: layout.slots() as u32,
        threads: THREADS,
        spins: P2P_SPINS,
    };
    let args = P2pAllReduceArgs { buf: Ptr::Buffer(buf), region: Ptr::P2pRegion, rank: 1 };
    Ok(vec![of_grid(&params, [1, 1, 1], THREADS, args.launch_args())])
}
