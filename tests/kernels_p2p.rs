//! The P2P collective template on simulated GPUs: every rank its own memory at its own base,
//! each rank's launch on its own thread addressing the other ranks' memories (as peer access
//! gives), several all-reduces and all-gathers back to back on each rank (both slots, the epoch
//! advancing, a rank running ahead of its peers), BF16 and F32, 2, 3 and 8 ranks, from 16 B to
//! the 64 KiB limit of the one-shot form and the `ranks` x 64 KiB of the two-shot one (each rank
//! sums its share, then copies every share). Every rank must end with the sum bit for bit: f32 additions in
//! rank order 0, 1, ..., rounded once (the CPU backend's all-reduce), or each row of every rank
//! side by side in rank order (NCCL's all-gather row by row, the CPU backend's); an all-reduce
//! that adds into the residual and normalises it must write the CPU reference's rmsnorm of the
//! updated residual bit for bit (the norm step it took over).
//! A rank whose peer never arrives traps after SPINS polls instead of waiting forever.

mod common;
use common::{bytes, floats, randn};
use kiln_compiler::kernels::P2pCollectiveParams;
use kiln_compiler::passes::lower::P2P_SPINS;
use kiln_runtime::cpu::reference;
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

/// What one round of [`rounds`] runs on every rank.
#[derive(Clone, Copy)]
enum Round {
    /// An all-reduce in place.
    Reduce,
    /// An all-reduce in place that then adds the sum into a residual (the same on every rank, as
    /// the residual stream is): `residual = round(residual + sum)`.
    ReduceAdd,
    /// `ReduceAdd`, then the rmsnorm of the updated residual's rows of `h` values into a buffer
    /// of its own (weight and output BF16 or F32).
    ReduceAddNorm { h: usize, w_bf16: bool, out_bf16: bool },
    /// An all-gather of rows of `width` values: every rank's row side by side in rank order; with
    /// `second` = (values, width), a second buffer gathered by the same kernel.
    Gather { width: usize, second: Option<(usize, usize)> },
    /// An all-reduce round (`Reduce`, `ReduceAdd`, `ReduceAddNorm`) by the two-shot form.
    TwoShot(&'static Round),
}

/// (two-shot, the round itself).
fn shot(kind: &Round) -> (bool, Round) {
    match *kind {
        Round::TwoShot(inner) => (true, *inner),
        k => (false, k),
    }
}

fn gather(width: usize) -> Round {
    Round::Gather { width, second: None }
}

/// Every rank runs `kinds` back to back on `n` values of its own (BF16 or F32), each round a
/// kernel of its own sharing the one region and epoch, as the plan's collectives do.
fn rounds(ranks: usize, n: usize, bf16: bool, kinds: &[Round], seed: u64) {
    rounds_of(256, ranks, n, bf16, kinds, seed)
}

/// The norm's epsilon in these tests.
const EPS: f32 = 1e-5;

/// [`rounds`] with blocks of `threads` threads.
fn rounds_of(threads: u32, ranks: usize, n: usize, bf16: bool, kinds: &[Round], seed: u64) {
    let norm_of = |kind: &Round| match shot(kind).1 {
        Round::ReduceAddNorm { h, w_bf16, out_bf16 } => Some((h, w_bf16, out_bf16)),
        _ => None,
    };
    let size = if bf16 { 2 } else { 4 };
    let layout = P2pLayout { ranks: ranks as u64 };
    let second = |kind: &Round| match shot(kind).1 {
        Round::Gather { second: Some(s), .. } => s,
        _ => (0, 1),
    };
    let modules: Vec<Module> = kinds
        .iter()
        .map(|kind| {
            let (two_shot, kind) = shot(kind);
            let kind = &kind;
            let (n2, width2) = second(kind);
            let (gather, row) = match *kind {
                Round::Reduce | Round::ReduceAdd | Round::ReduceAddNorm { .. } => (0, n * size),
                Round::Gather { width, .. } => (1, width * size),
                Round::TwoShot(_) => unreachable!("a two-shot round of a two-shot round"),
            };
            let params = P2pCollectiveParams {
                arch: 120,
                ranks: ranks as u32,
                gather,
                bytes: ((n + n2) * size) as u32,
                part: (n * size) as u32,
                row: row as u32,
                row2: if n2 > 0 { (width2 * size) as u32 } else { row as u32 },
                two_shot: two_shot as u32,
                bf16: bf16 as u32,
                add: matches!(kind, Round::ReduceAdd | Round::ReduceAddNorm { .. }) as u32,
                norm: norm_of(kind).is_some() as u32,
                h: norm_of(kind).map_or(1, |n| n.0 as u32),
                w_bf16: norm_of(kind).is_some_and(|n| n.1) as u32,
                out_bf16: norm_of(kind).is_some_and(|n| n.2) as u32,
                slot: layout.slot() as u32,
                flags: layout.flags() as u32,
                slots: layout.slots() as u32,
                threads,
                spins: P2P_SPINS,
            };
            Module::parse(&params.render().unwrap(), "p2p_collective.ptx").unwrap()
        })
        .collect();
    let n2_max = kinds.iter().map(|k| second(k).0).max().unwrap_or(0).max(1);
    let mut mems: Vec<GlobalMemory> = (0..ranks).map(|r| GlobalMemory::with_base(GLOBAL_BASE + ((r as u64 + 1) << 40))).collect();
    let bufs: Vec<_> = mems.iter_mut().map(|m| m.alloc("buf", n * size)).collect();
    let bufs2: Vec<_> = mems.iter_mut().map(|m| m.alloc("buf2", n2_max * size)).collect();
    let outs: Vec<_> = mems.iter_mut().map(|m| m.alloc("out", ranks * n * size)).collect();
    let outs2: Vec<_> = mems.iter_mut().map(|m| m.alloc("out2", ranks * n2_max * size)).collect();
    let residuals: Vec<_> = mems.iter_mut().map(|m| m.alloc("residual", n * size)).collect();
    let regions: Vec<_> = mems.iter_mut().map(|m| m.alloc("p2p region", layout.bytes() as usize)).collect();
    let normed: Vec<_> = mems.iter_mut().map(|m| m.alloc("normed", n * 4)).collect();
    let h_max = kinds.iter().filter_map(norm_of).map(|n| n.0).max().unwrap_or(1);
    let weights: Vec<_> = mems.iter_mut().map(|m| m.alloc("norm weight", h_max * 4)).collect();
    let table: Vec<u8> = (0..ranks).flat_map(|q| mems[q].addr(regions[q]).to_le_bytes()).collect();
    for (m, &reg) in mems.iter().zip(&regions) {
        m.write(reg, 0, &table);
    }
    let mut rng = Rng::new(seed);
    // every rank runs its rounds back to back, as graph replays do: a rank may be a round ahead,
    // writing the other slot and announcing the next epoch while a peer still reads this one.
    // Per round and rank: its values for buf, then for buf2.
    let inputs: Vec<Vec<(Vec<f32>, Vec<f32>)>> = kinds.iter().map(|k| (0..ranks).map(|_| (randn(&mut rng, n, 1.0, bf16), randn(&mut rng, second(k).0, 1.0, bf16))).collect()).collect();
    // per round: the residual every rank holds (ReduceAdd)
    let residual_in: Vec<Vec<f32>> = kinds.iter().map(|_| randn(&mut rng, n, 4.0, bf16)).collect();
    // per round: the norm weight (ReduceAddNorm), around 1 as a trained norm's
    let weight_in: Vec<Vec<f32>> = kinds.iter().map(|k| norm_of(k).map_or_else(Vec::new, |(h, w_bf16, _)| randn(&mut rng, h, 0.5, w_bf16).into_iter().map(|v| v + 1.0).map(|v| if w_bf16 { bf16_to_f32(f32_to_bf16(v)) } else { v }).collect())).collect();
    let results: Vec<Vec<Vec<f32>>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..ranks)
            .map(|r| {
                let (mems, modules, bufs, bufs2, outs, outs2, regions, inputs) = (&mems, &modules, &bufs, &bufs2, &outs, &outs2, &regions, &inputs);
                let (residuals, residual_in, normed, weights, weight_in) = (&residuals, &residual_in, &normed, &weights, &weight_in);
                s.spawn(move || {
                    let peers: Vec<&GlobalMemory> = (0..ranks).filter(|&q| q != r).map(|q| &mems[q]).collect();
                    let addr = |b| KernelArg::U64(mems[r].addr(b));
                    let mut results = Vec::new();
                    for ((((round, module), kind), res), w) in inputs.iter().zip(modules).zip(kinds).zip(residual_in).zip(weight_in) {
                        let kind = &shot(kind).1;
                        mems[r].write(bufs[r], 0, &bytes(&round[r].0, bf16));
                        mems[r].write(bufs2[r], 0, &bytes(&round[r].1, bf16));
                        mems[r].write(residuals[r], 0, &bytes(res, bf16));
                        let norm = norm_of(kind);
                        if let Some((_, w_bf16, _)) = norm {
                            mems[r].write(weights[r], 0, &bytes(w, w_bf16));
                        }
                        let two = second(kind).0 > 0;
                        let (buf2, out, out2) = match kind {
                            Round::Gather { .. } if two => (bufs2[r], outs[r], outs2[r]),
                            Round::Gather { .. } => (bufs[r], outs[r], outs[r]),
                            _ => (bufs[r], bufs[r], bufs[r]),
                        };
                        let adds = matches!(kind, Round::ReduceAdd | Round::ReduceAddNorm { .. });
                        let residual = if adds { residuals[r] } else { bufs[r] };
                        let (weight, out_norm) = if norm.is_some() { (weights[r], normed[r]) } else { (bufs[r], bufs[r]) };
                        let args = [addr(bufs[r]), addr(buf2), addr(out), addr(out2), addr(residual), addr(regions[r]), KernelArg::U32(r as u32), addr(weight), addr(out_norm), KernelArg::F32(EPS)];
                        launch_with_peers(module, P2pCollectiveParams::ENTRY, [1, 1, 1], [threads, 1, 1], 0, &args, &mems[r], &peers).unwrap();
                        let mut got = floats(&mems[r].read(out), bf16);
                        if two {
                            got.truncate(ranks * n);
                            got.extend(floats(&mems[r].read(out2), bf16).into_iter().take(ranks * second(kind).0));
                        }
                        // ReduceAdd: the sum, then the residual it was added into; else the
                        // residual is untouched
                        let residual_now = floats(&mems[r].read(residuals[r]), bf16);
                        if adds {
                            got.extend(residual_now);
                            if let Some((_, _, out_bf16)) = norm {
                                got.extend(floats(&mems[r].read(normed[r]), out_bf16).into_iter().take(n));
                            }
                        } else {
                            assert!(residual_now.iter().zip(res).all(|(a, b)| a.to_bits() == b.to_bits()), "rank {r}: a collective without ADD wrote the residual");
                        }
                        results.push(got);
                    }
                    results
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (round, (parts, kind)) in inputs.iter().zip(kinds).enumerate() {
        let firsts: Vec<Vec<f32>> = parts.iter().map(|p| p.0.clone()).collect();
        let want = match shot(kind).1 {
            Round::Reduce => rank_order_sum(&firsts, bf16),
            Round::ReduceAdd => {
                // the add launch's bits: the residual plus the rounded sum, rounded
                let sum = rank_order_sum(&firsts, bf16);
                let added: Vec<f32> = residual_in[round].iter().zip(&sum).map(|(&r, &v)| if bf16 { bf16_to_f32(f32_to_bf16(r + v)) } else { r + v }).collect();
                sum.into_iter().chain(added).collect()
            }
            Round::ReduceAddNorm { h, out_bf16, .. } => {
                // the CPU reference's rmsnorm of the residual plus the rounded sum
                let sum = rank_order_sum(&firsts, bf16);
                let mut res = residual_in[round].clone();
                let mut normed = vec![0f32; n];
                reference::rms_norm(&sum, Some((&mut res[..], bf16)), &weight_in[round], EPS, h, bf16, out_bf16, &mut normed);
                sum.into_iter().chain(res).chain(normed).collect()
            }
            Round::Gather { width, second } => {
                let mut w = side_by_side(&firsts, width);
                if let Some((_, width2)) = second {
                    w.extend(side_by_side(&parts.iter().map(|p| p.1.clone()).collect::<Vec<_>>(), width2));
                }
                w
            }
            Round::TwoShot(_) => unreachable!("a two-shot round of a two-shot round"),
        };
        for (r, got) in results.iter().map(|per_rank| &per_rank[round]).enumerate() {
            let off = got.iter().zip(&want).filter(|(g, w)| g.to_bits() != w.to_bits()).count();
            assert_eq!(got.len(), want.len());
            assert_eq!(off, 0, "{ranks} ranks, {n} values (bf16 {bf16}), round {round}: rank {r} differs from the expected result in {off} values");
        }
    }
    // the epoch advanced once per one-shot collective and twice per two-shot one on every rank
    let epochs: usize = kinds.iter().map(|k| 1 + shot(k).0 as usize).sum();
    for (m, &reg) in mems.iter().zip(&regions) {
        let epoch = u32::from_le_bytes(m.read(reg)[layout.epoch() as usize..][..4].try_into().unwrap());
        assert_eq!(epoch as usize, epochs);
    }
}

/// NCCL's all-gather row by row (the CPU backend's): row i of the result is row i of rank 0,
/// then of rank 1, ...
fn side_by_side(parts: &[Vec<f32>], width: usize) -> Vec<f32> {
    let rows = parts[0].len() / width;
    (0..rows).flat_map(|i| parts.iter().flat_map(move |p| p[i * width..(i + 1) * width].iter().copied())).collect()
}

#[test]
fn sums_in_rank_order_on_every_rank_round_after_round() {
    use Round::Reduce;
    // GLM-5's decode all-reduce (one token of hidden 6144, BF16) over 8 and 2 ranks, four rounds
    // (each slot twice)
    rounds(8, 6144, true, &[Reduce; 4], 1);
    rounds(2, 6144, true, &[Reduce; 4], 2);
    // 3 ranks, F32, one 16-byte chunk and the 64 KiB limit
    rounds(3, 4, false, &[Reduce; 3], 3);
    rounds(3, (P2P_MAX_BYTES / 4) as usize, false, &[Reduce; 2], 4);
}

#[test]
fn adds_the_sum_into_the_residual_as_the_add_launch_does() {
    use Round::{Reduce, ReduceAdd};
    // decode's all-reduces that took over the rmsnorm's residual add: one token of hidden 6144
    // (BF16) on 8 and 2 ranks, between plain all-reduces and gathers on the same epochs; F32 on 3
    rounds(8, 6144, true, &[ReduceAdd, Reduce, ReduceAdd, gather(256)], 13);
    rounds(2, 4 * 6144, true, &[ReduceAdd; 3], 14);
    rounds(3, 20, false, &[Reduce, ReduceAdd, ReduceAdd], 15);
}

#[test]
fn normalises_the_updated_residual_as_the_cpu_reference_does() {
    use Round::{Reduce, ReduceAdd, ReduceAddNorm};
    let norm = |h, w_bf16, out_bf16| ReduceAddNorm { h, w_bf16, out_bf16 };
    // GLM-5's norm after attention's all-reduce at decode: hidden 6144, BF16 weight and rows, one
    // token on 8 ranks and four (one more row than the block's two groups of 256 threads) on 2,
    // between plain all-reduces and residual adds on the same epochs
    rounds_of(512, 8, 6144, true, &[norm(6144, true, true), Reduce, norm(6144, true, true), ReduceAdd], 16);
    rounds_of(512, 2, 3 * 6144, true, &[norm(6144, true, true); 2], 17);
    // one group of threads; rows narrower than it and not a multiple of 32; F32 weight, output
    // and sums
    rounds_of(256, 3, 4 * 200, true, &[norm(200, false, false), norm(200, true, false)], 18);
    rounds_of(512, 3, 5 * 1000, false, &[norm(1000, false, true), Reduce, norm(1000, true, false)], 19);
}

#[test]
fn gathers_every_rank_row_by_row_between_all_reduces() {
    use Round::Reduce;
    // GLM-5's sharded q_a at decode (2048 / 8 = 256 BF16 per rank and token): one token, then a
    // batch of 64 (32 KiB per rank), between all-reduces on the same region and epochs
    rounds(8, 256, true, &[gather(256), Reduce, gather(256), Reduce], 5);
    rounds(8, 64 * 256, true, &[gather(256), gather(256), Reduce], 6);
    // rows of one 16-byte chunk, 3 ranks, F32, the 64 KiB limit
    rounds(3, 4 * 5, false, &[gather(4), Reduce, gather(4)], 7);
    rounds(2, 72 * 3, true, &[gather(72); 3], 8);
    rounds(3, (P2P_MAX_BYTES / 4) as usize, false, &[gather(1024), gather(1024)], 9);
}

#[test]
fn gathers_two_buffers_in_one_kernel() {
    use Round::{Gather, Reduce};
    // q_a (256 BF16 per rank and token) and kv_a (72) split over 8 ranks share one gather: one
    // token, then 64 (41 KiB per rank), between all-reduces
    let (q, kv) = (256, 72);
    rounds(8, q, true, &[Gather { width: q, second: Some((kv, kv)) }, Reduce, Gather { width: q, second: Some((kv, kv)) }], 10);
    rounds(8, 64 * q, true, &[Gather { width: q, second: Some((64 * kv, kv)) }, gather(q), Reduce], 11);
    // F32, 3 ranks, rows of different chunk counts, the second buffer larger than the first
    rounds(3, 2 * 4, false, &[Gather { width: 4, second: Some((2 * 12, 12)) }, Reduce], 12);
}

#[test]
fn two_shot_all_reduces_give_the_one_shot_bits() {
    use Round::{Reduce, ReduceAdd, ReduceAddNorm, TwoShot};
    const NORM: Round = ReduceAddNorm { h: 6144, w_bf16: true, out_bf16: true };
    // GLM-5's decode all-reduce at batch 8 (8 x 6144 BF16: shares of 12 KiB) on 8 ranks: plain,
    // adding into the residual and normalising it, between one-shot all-reduces and gathers on
    // the same region and epochs
    rounds_of(512, 8, 8 * 6144, true, &[TwoShot(&Reduce), Reduce, TwoShot(&NORM), gather(256), TwoShot(&ReduceAdd), TwoShot(&NORM)], 20);
    // the limit: 2 ranks of 64 KiB shares (BF16), each slot twice
    rounds(2, 64 << 10, true, &[TwoShot(&Reduce); 4], 21);
    // F32 on 3 ranks, just past the one-shot limit; rows of 900 values straddling the shares'
    // boundaries (6,000 values each) for the norm
    rounds(3, 16_392, false, &[TwoShot(&Reduce), Reduce, TwoShot(&ReduceAdd)], 22);
    rounds_of(512, 3, 20 * 900, false, &[TwoShot(&ReduceAddNorm { h: 900, w_bf16: true, out_bf16: false }), TwoShot(&Reduce)], 23);
}

/// Rank 0 of a 2-rank all-reduce of 64 B on its own simulated GPU, rank 1's GPU beside it (both
/// regions hold the table of regions); `peer_access`: whether rank 0 may address rank 1. Rank 1
/// never launches. Returns the launch's error and rank 1's region.
fn rank_0_alone(spins: u32, peer_access: bool) -> (String, Vec<u8>) {
    let layout = P2pLayout { ranks: 2 };
    let params = P2pCollectiveParams { arch: 120, ranks: 2, gather: 0, bytes: 64, part: 64, row: 64, row2: 64, two_shot: 0, bf16: 0, add: 0, norm: 0, h: 1, w_bf16: 0, out_bf16: 0, slot: layout.slot() as u32, flags: layout.flags() as u32, slots: layout.slots() as u32, threads: 64, spins };
    let module = Module::parse(&params.render().unwrap(), "p2p_collective.ptx").unwrap();
    let mut mine = GlobalMemory::with_base(GLOBAL_BASE + (1 << 40));
    let mut other = GlobalMemory::with_base(GLOBAL_BASE + (2 << 40));
    let (b, reg) = (mine.alloc("buf", 64), mine.alloc("p2p region", layout.bytes() as usize));
    let other_reg = other.alloc("p2p region", layout.bytes() as usize);
    let table: Vec<u8> = [mine.addr(reg), other.addr(other_reg)].iter().flat_map(|a| a.to_le_bytes()).collect();
    mine.write(reg, 0, &table);
    other.write(other_reg, 0, &table);
    let at = KernelArg::U64(mine.addr(b));
    let args = [at.clone(), at.clone(), at.clone(), at.clone(), at.clone(), KernelArg::U64(mine.addr(reg)), KernelArg::U32(0), at.clone(), at, KernelArg::F32(0.0)];
    let peers: &[&GlobalMemory] = if peer_access { &[&other] } else { &[] };
    let err = launch_with_peers(&module, P2pCollectiveParams::ENTRY, [1, 1, 1], [64, 1, 1], 0, &args, &mine, peers).unwrap_err().to_string();
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
