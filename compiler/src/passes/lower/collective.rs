//! The one-shot P2P collective (`p2p_collective.ptx`) of every all-reduce and all-gather whose
//! per-rank buffer is at most `P2P_MAX_BYTES`: one block per rank sums (or places side by side)
//! the ranks' buffers over peer memory. The runtime replays it instead of NCCL only when every
//! GPU pair passed the peer write-and-verify probe; larger collectives and single-rank plans keep
//! NCCL (or nothing).

use super::{float_flag, of_grid, Cx, Instance};
use crate::kernels::{P2pCollectiveArgs, P2pCollectiveParams, Ptr};
use kiln_runtime::plan::{Op, P2pLayout, P2P_MAX_BYTES};

/// Threads of the block: enough loads in flight for 64 KiB from each of 7 peers.
const THREADS: u32 = 512;

/// Polls of a peer's flag before the kernel traps: each is a system-scope load of local memory
/// and a `nanosleep` of up to 200 ns, so 2^25 polls are seconds, against the microseconds a
/// peer normally takes. A rank that never arrives becomes a launch error, not a hung graph.
pub const P2P_SPINS: u32 = 1 << 25;

pub(super) fn instances(cx: &Cx, op: &Op) -> Result<Vec<Instance>, String> {
    // (this rank's buffer, the result, bytes of a row of this rank's buffer)
    let (buf, out, row) = match *op {
        Op::AllReduce { buf } => (buf, buf, cx.program.buffer(buf).bytes),
        Op::AllGather { input, out } => {
            let b = cx.program.buffer(input);
            (input, out, b.shape.last().copied().unwrap_or(1) as u64 * b.dtype.size() as u64)
        }
        _ => return Ok(Vec::new()),
    };
    let ranks = cx.plan.ranks();
    let b = cx.program.buffer(buf);
    if !(2..=8).contains(&ranks) || b.bytes > P2P_MAX_BYTES || b.bytes % 16 != 0 || b.bytes == 0 || row % 16 != 0 || row == 0 {
        return Ok(Vec::new());
    }
    let layout = P2pLayout { ranks: ranks as u64 };
    let params = P2pCollectiveParams {
        arch: cx.arch,
        ranks: ranks as u32,
        gather: u32::from(buf != out),
        bytes: b.bytes as u32,
        row: row as u32,
        // a gather copies bytes of any type
        bf16: if buf == out { float_flag(b.dtype, "an all-reduced buffer")? } else { 0 },
        slot: P2P_MAX_BYTES as u32,
        flags: layout.flags() as u32,
        slots: layout.slots() as u32,
        threads: THREADS,
        spins: P2P_SPINS,
    };
    let args = P2pCollectiveArgs { buf: Ptr::Buffer(buf), out: Ptr::Buffer(out), region: Ptr::P2pRegion, rank: 1 };
    Ok(vec![of_grid(&params, [1, 1, 1], THREADS, args.launch_args())])
}
