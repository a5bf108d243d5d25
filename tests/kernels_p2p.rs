//! The one-shot P2P all-reduce template on simulated GPUs: every rank its own memory at its own
//! base, each rank's launch on its own thread addressing the other ranks' memories (as peer
//! access gives), several all-reduces back to back on each rank (both slots, the epoch advancing,
//! a rank running ahead of its peers), BF16 and F32,
//! 2, 3 and 8 ranks, from 16 B to the 64 KiB limit. Every rank must end with the sum bit
//! for bit: f32 additions in rank order 0, 1, ..., rounded once (the CPU backend's all-reduce).
//! A rank whose peer never arrives traps after SPINS polls instead of waiting forever.

mod common;
use common::{bytes, floats, randn};
use kiln_compiler::kernels::P2pAllReduceParams;
use kiln_compiler::passes::lower::P2P_SPINS;
use kiln_runtime::emu::{launch_with_peers, GlobalMemory, KernelArg, Module, GLOBAL_BASE};
use kiln_runtime::numerics::{bf16_to_f32, f32_to_bf16};
use kiln_runtime::plan::{P2pLayout, P2P_MAX_BYTES};
use kiln_runtime::rng::Rng;

/// The order: rank 0's value, plus rank 1's, ... in f32, then one rounding.
fn rank_order_sum(parts: &[Vec<f32>], bf16: bool) -> Vec<f32> {
    let mut acc = parts[0].clone();
    for p in &parts[1..] {
        acc.iter_mut().zip(p).for_each(|(a, &v)| *a += v);
    }
    if bf16 {
        acc.iter_mut().for_each(|v| *v = bf16_to_f32(f32_to_bf16(*v)));
    }
    acc
}

fn all_reduce_rounds(ranks: usize, n: usize, bf16: bool, rounds: usize, seed: u64) {
    let size = if bf16 { 2 } else { 4 };
    let layout = P2pLayout { ranks: ranks as u64 };
    let params = P2pAllReduceParams {
        arch: 120,
        ranks: ranks as u32,
        bytes: (n * size) as u32,
        bf16: bf16 as u32,
        slot: P2P_MAX_BYTES as u32,
        flags: layout.flags() as u32,
        slots: layout.slots() as u32,
        threads: 256,
        spins: P2P_SPINS,
    };
    let module = Module::parse(&params.render().unwrap(), "p2p_all_reduce.ptx").unwrap();
    let mut mems: Vec<GlobalMemory> = (0..ranks).map(|r| GlobalMemory::with_base(GLOBAL_BASE + ((r as u64 + 1) << 40))).collect();
    let bufs: Vec<_> = mems.iter_mut().map(|m| m.alloc("buf", n * size)).collect();
    let regions: Vec<_> = mems.iter_mut().map(|m| m.alloc("p2p region", layout.bytes() as usize)).collect();
    let table: Vec<u8> = (0..ranks).flat_map(|q| mems[q].addr(regions[q]).to_le_bytes()).collect();
    for (m, &reg) in mems.iter().zip(&regions) {
        m.write(reg, 0, &table);
    }
    let mut rng = Rng::new(seed);
    // every rank runs its rounds back to back, as graph replays do: a rank may be a round ahead,
    // writing the other slot and announcing the next epoch while a peer still reads this one
    let inputs: Vec<Vec<Vec<f32>>> = (0..rounds).map(|_| (0..ranks).map(|_| randn(&mut rng, n, 1.0, bf16)).collect()).collect();
    let results: Vec<Vec<Vec<f32>>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..ranks)
            .map(|r| {
                let (mems, module, bufs, regions, inputs) = (&mems, &module, &bufs, &regions, &inputs);
                s.spawn(move || {
                    let peers: Vec<&GlobalMemory> = (0..ranks).filter(|&q| q != r).map(|q| &mems[q]).collect();
                    let args = [KernelArg::U64(mems[r].addr(bufs[r])), KernelArg::U64(mems[r].addr(regions[r])), KernelArg::U32(r as u32)];
                    let mut out = Vec::new();
                    for round in inputs {
                        mems[r].write(bufs[r], 0, &bytes(&round[r], bf16));
                        launch_with_peers(module, P2pAllReduceParams::ENTRY, [1, 1, 1], [256, 1, 1], 0, &args, &mems[r], &peers).unwrap();
                        out.push(floats(&mems[r].read(bufs[r]), bf16));
                    }
                    out
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (round, parts) in inputs.iter().enumerate() {
        let want = rank_order_sum(parts, bf16);
        for (r, got) in results.iter().map(|per_rank| &per_rank[round]).enumerate() {
            let off = got.iter().zip(&want).filter(|(g, w)| g.to_bits() != w.to_bits()).count();
            assert_eq!(off, 0, "{ranks} ranks, {n} values (bf16 {bf16}), round {round}: rank {r} differs from the rank-order sum in {off} values");
        }
    }
    // the epoch advanced once per all-reduce on every rank
    for (m, &reg) in mems.iter().zip(&regions) {
        let epoch = u32::from_le_bytes(m.read(reg)[layout.epoch() as usize..][..4].try_into().unwrap());
        assert_eq!(epoch as usize, rounds);
    }
}

#[test]
fn sums_in_rank_order_on_every_rank_round_after_round() {
    // GLM-5's decode all-reduce (one token of hidden 6144, BF16) over 8 and 2 ranks, four rounds
    // (each slot twice)
    all_reduce_rounds(8, 6144, true, 4, 1);
    all_reduce_rounds(2, 6144, true, 4, 2);
    // 3 ranks, F32, one 16-byte chunk and the 64 KiB limit
    all_reduce_rounds(3, 4, false, 3, 3);
    all_reduce_rounds(3, (P2P_MAX_BYTES / 4) as usize, false, 2, 4);
}

/// Rank 0 of a 2-rank all-reduce of 64 B on its own simulated GPU, rank 1's GPU beside it (both
/// regions hold the table of regions); `peer_access`: whether rank 0 may address rank 1. Rank 1
/// never launches. Returns the launch's error and rank 1's region.
fn rank_0_alone(spins: u32, peer_access: bool) -> (String, Vec<u8>) {
    let layout = P2pLayout { ranks: 2 };
    let params = P2pAllReduceParams { arch: 120, ranks: 2, bytes: 64, bf16: 0, slot: P2P_MAX_BYTES as u32, flags: layout.flags() as u32, slots: layout.slots() as u32, threads: 64, spins };
    let module = Module::parse(&params.render().unwrap(), "p2p_all_reduce.ptx").unwrap();
    let mut mine = GlobalMemory::with_base(GLOBAL_BASE + (1 << 40));
    let mut other = GlobalMemory::with_base(GLOBAL_BASE + (2 << 40));
    let (b, reg) = (mine.alloc("buf", 64), mine.alloc("p2p region", layout.bytes() as usize));
    let other_reg = other.alloc("p2p region", layout.bytes() as usize);
    let table: Vec<u8> = [mine.addr(reg), other.addr(other_reg)].iter().flat_map(|a| a.to_le_bytes()).collect();
    mine.write(reg, 0, &table);
    other.write(other_reg, 0, &table);
    let args = [KernelArg::U64(mine.addr(b)), KernelArg::U64(mine.addr(reg)), KernelArg::U32(0)];
    let peers: &[&GlobalMemory] = if peer_access { &[&other] } else { &[] };
    let err = launch_with_peers(&module, P2pAllReduceParams::ENTRY, [1, 1, 1], [64, 1, 1], 0, &args, &mine, peers).unwrap_err().to_string();
    (err, other.read(other_reg))
}

#[test]
fn a_rank_does_not_read_a_peer_it_cannot_address() {
    // without peer access the first peer access faults instead of hanging
    let (err, _) = rank_0_alone(P2P_SPINS, false);
    assert!(err.contains("not in any global buffer"), "{err}");
}

#[test]
fn a_rank_whose_peer_never_arrives_traps_instead_of_hanging() {
    // its peer is addressable but never announces the epoch. With a small SPINS the emulator sees
    // the trap quickly; the plan's SPINS only makes it take seconds.
    let (err, peer_region) = rank_0_alone(1000, true);
    assert!(err.contains("trap"), "{err}");
    // it announced the epoch to its peer before waiting
    let flags = P2pLayout { ranks: 2 }.flags() as usize;
    assert_eq!(u32::from_le_bytes(peer_region[flags..][..4].try_into().unwrap()), 1, "rank 0's flag in its peer's region");
}
