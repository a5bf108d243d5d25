//! The P2P collective (`p2p_collective.ptx`) of every all-reduce and all-gather (of one or two
//! buffers) whose per-rank part is at most `P2P_MAX_BYTES`: one block per rank sums (or places
//! side by side) the ranks' buffers over peer memory. An all-reduce of up to `ranks` such parts
//! may take the two-shot form (each rank sums its share of every rank's buffer, then every rank
//! copies every share): the performance model prices its transfers below NCCL's at every size it
//! takes (and the one-shot form's below `P2P_MAX_BYTES`: one latency, not two); lowering takes it
//! where the model prices it, with the add and norm below, under NCCL and the launches after it.
//! The runtime replays the kernel instead of NCCL only when every GPU pair passed the peer
//! write-and-verify probe; larger collectives and single-rank plans keep NCCL (or nothing).
//!
//! An all-reduce that took over the next rmsnorm's residual add (decode, `AllReduce { residual }`)
//! is followed by an `add` launch, and one that took over the norm after that (`AllReduce { norm
//! }`) by the norm's launch: the NCCL path's (`Step::after_collective`). The P2P kernel adds and
//! normalises itself (ADD, NORM) where the model prices that, in its one block at the rate it
//! reads a peer, below those launches (small batches); else the P2P path runs the launches after
//! it too (`Step::after_p2p`).

use super::{float_flag, numel, of_grid, width, Cx, Instance};
use crate::kernels::{P2pCollectiveArgs, P2pCollectiveParams, Ptr};
use kiln_runtime::perf::{collective_time, p2p_epilogue_us};
use kiln_runtime::plan::{BufId, Op, P2pLayout, P2P_MAX_BYTES};

/// Threads of the block: enough loads in flight for 64 KiB from each of 7 peers.
const THREADS: u32 = 512;

/// Polls of a peer's flag before the kernel traps: each is a system-scope load of local memory
/// and a `nanosleep` of up to 200 ns, so 2^25 polls are seconds, against the microseconds a
/// peer normally takes. A rank that never arrives becomes a launch error, not a hung graph.
pub const P2P_SPINS: u32 = 1 << 25;

/// The most buffers one P2P all-gather carries (the template's `buf` and `buf2`).
pub const P2P_GATHER_PAIRS: usize = 2;

pub(super) fn instances(cx: &Cx, op: &Op) -> Result<Vec<Instance>, String> {
    let p = cx.program;
    let row = |b: BufId| p.buffer(b).shape.last().copied().unwrap_or(1) as u64 * p.buffer(b).dtype.size() as u64;
    // (this rank's buffers, the results, bytes of a row of each of this rank's buffers)
    let (bufs, outs, rows): (Vec<BufId>, Vec<BufId>, Vec<u64>) = match op {
        Op::AllReduce { buf, .. } => (vec![*buf], vec![*buf], vec![p.buffer(*buf).bytes]),
        Op::AllGather { pairs } if (1..=P2P_GATHER_PAIRS).contains(&pairs.len()) => {
            (pairs.iter().map(|g| g.input).collect(), pairs.iter().map(|g| g.out).collect(), pairs.iter().map(|g| row(g.input)).collect())
        }
        _ => return Ok(Vec::new()),
    };
    // the residual add an all-reduce took over, and the norm it took over after that: the
    // NCCL path's launches after the collective
    let mut after = Vec::new();
    let residual = match *op {
        Op::AllReduce { buf, residual: Some(r), .. } => {
            after.push(super::norm::residual_add(cx, r, buf)?);
            Some(r)
        }
        _ => None,
    };
    let norm = op.residual_norm();
    if let Some(n) = &norm {
        after.extend(super::norm::instances(cx, n)?);
    }
    let ranks = cx.plan.ranks();
    let sizes: Vec<u64> = bufs.iter().map(|&b| p.buffer(b).bytes).collect();
    let bytes: u64 = sizes.iter().sum();
    let aligned = sizes.iter().zip(&rows).all(|(&n, &r)| n > 0 && n % 16 == 0 && r > 0 && r % 16 == 0);
    let same = residual.is_none_or(|r| p.buffer(r).dtype == p.buffer(bufs[0]).dtype && p.buffer(r).bytes == sizes[0]);
    // the norm's rows in the P2P kernel: whole rows of the residual, the residual's dtype
    // normalised (the norm step's source)
    let norm_shape = match norm {
        Some(Op::RmsNorm { weight, out, eps, .. }) => {
            let h = width(p, out);
            Some((h, float_flag(cx.plan.weight(weight).dtype, "the norm weight")?, float_flag(p.buffer(out).dtype, "the normed rows")?, weight, out, eps))
        }
        _ => None,
    };
    let rows_fit = norm_shape.is_none_or(|(h, ..)| h > 0 && numel(p, bufs[0]) % h == 0);
    let gather = matches!(op, Op::AllGather { .. });
    let k = &cx.consts;
    // the launches after the collective (the residual add, the norm), as the model prices them
    let after_us = match *op {
        Op::AllReduce { buf, residual: Some(r), .. } => super::norm::residual_add_us(cx, r, buf) + norm.as_ref().map_or(Ok(0.0), |n| super::norm::predicted_us(cx, n))?,
        _ => 0.0,
    };
    // the kernel adds (and normalises) itself where its one block does that in less time
    let in_kernel_us = p2p_epilogue_us(cx.plan, p, op, k);
    let fuse = residual.is_some() && same && rows_fit && in_kernel_us < after_us;
    let epilogue_us = if fuse { in_kernel_us } else { after_us };
    // the two-shot form: RANKS shares of whole 16-byte chunks, each at most P2P_MAX_BYTES, where
    // the model prices it below the NCCL path
    let two_shot = !gather && bytes > P2P_MAX_BYTES && bytes <= ranks as u64 * P2P_MAX_BYTES && bytes % (16 * ranks as u64) == 0 && {
        let (nccl_us, p2p_us) = collective_time(true, true, bytes as f64, ranks, k);
        p2p_us.is_some_and(|t| t + epilogue_us < nccl_us + after_us)
    };
    if !(2..=8).contains(&ranks) || (bytes > P2P_MAX_BYTES && !two_shot) || !aligned {
        return Ok(after);
    }
    let norm_shape = norm_shape.filter(|_| fuse);
    let layout = P2pLayout { ranks: ranks as u64 };
    let params = P2pCollectiveParams {
        arch: cx.arch,
        ranks: ranks as u32,
        gather: u32::from(gather),
        bytes: bytes as u32,
        part: sizes[0] as u32,
        row: rows[0] as u32,
        row2: *rows.last().unwrap_or(&rows[0]) as u32,
        two_shot: u32::from(two_shot),
        // a gather copies bytes of any type
        bf16: if gather { 0 } else { float_flag(p.buffer(bufs[0]).dtype, "an all-reduced buffer")? },
        add: u32::from(fuse),
        norm: u32::from(norm_shape.is_some()),
        h: norm_shape.map_or(1, |n| n.0 as u32),
        w_bf16: norm_shape.map_or(0, |n| n.1),
        out_bf16: norm_shape.map_or(0, |n| n.2),
        slot: layout.slot() as u32,
        flags: layout.flags() as u32,
        slots: layout.slots() as u32,
        threads: THREADS,
        spins: P2P_SPINS,
    };
    let second = |v: &[BufId]| Ptr::Buffer(*v.last().unwrap_or(&v[0]));
    let res = residual.filter(|_| fuse).unwrap_or(bufs[0]);
    let (weight, normed, eps) = match norm_shape {
        Some((.., w, out, eps)) => (Ptr::Weight(w), Ptr::Buffer(out), eps),
        None => (Ptr::Buffer(bufs[0]), Ptr::Buffer(bufs[0]), 0.0),
    };
    let args = P2pCollectiveArgs {
        buf: Ptr::Buffer(bufs[0]),
        buf2: second(&bufs),
        out: Ptr::Buffer(outs[0]),
        out2: second(&outs),
        residual: Ptr::Buffer(res),
        region: Ptr::P2pRegion,
        rank: 1,
        weight,
        normed,
        eps,
    };
    // the P2P kernel first, then what the NCCL path runs after the collective
    Ok(std::iter::once(of_grid(&params, [1, 1, 1], THREADS, args.launch_args())).chain(after).collect())
}
