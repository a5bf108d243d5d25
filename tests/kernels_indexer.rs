//! The DSA indexer top-k template (`indexer_topk.ptx`) against the CPU reference
//! (`reference::indexer_topk`): the selected positions must be identical (the kernel's scores
//! are bit-identical to the CPU's), on ragged batches with pages out of order, padding tokens,
//! unassigned pages, sequences shorter than / equal to / longer than top-k, forced ties, and
//! top-k sizes that make the kernel compact its candidate buffer many times; lists are in
//! ascending position order. Decode's selection runs in both of its paths (every key in shared
//! memory up to FAST positions, candidates beyond, or chunks of positions on blocks of their own
//! with the token's last chunk selecting from their lists), each equal to the fused kernel. The GLM-5 tp8
//! instance (decode and 8192-token prefill use the same kernel; only the grid differs) must
//! assemble with ptxas for sm_120a without spills, within 255 registers and 101376 B of shared
//! memory.

mod common;

use kiln_compiler::kernels::IndexerTopkParams;
use kiln_compiler::passes::lower::{fast_positions, select_chunk, SELECT_THREADS, SMEM_LIMIT, THREADS};
use kiln_runtime::cpu::reference::{self, Cache, TokenInputs};
use kiln_runtime::cpu::rope::Rope;
use kiln_runtime::emu::{launch, BufferId, GlobalMemory, KernelArg, LaunchStats, Module};
use kiln_runtime::numerics::{f32_to_bf16, quantize_fp8_key, round_bf16};
use kiln_runtime::plan::{DType, IndexKeys, KvLayout};
use kiln_runtime::rng::Rng;
use std::process::Command;

const LATENT: usize = 64;
const THETA: f64 = 10000.0;

/// Candidate buffer entries, as the lowering (`passes/lower/indexer.rs`) sizes it.
fn capacity(p2: usize, threads: u32) -> usize {
    (p2 + p2.max(threads as usize)).next_multiple_of(2)
}

fn params(heads: usize, dim: usize, rope: usize, page: usize, pps: usize, topk: usize, q_bf16: bool, w_bf16: bool) -> IndexerTopkParams {
    let p2 = topk.next_power_of_two();
    IndexerTopkParams {
        arch: 120,
        heads: heads as u32,
        dim: dim as u32,
        rope: rope as u32,
        row: (LATENT + rope + dim) as u32,
        koff: (LATENT + rope) as u32,
        page: page as u32,
        pps: pps as u32,
        topk: topk as u32,
        p2: p2 as u32,
        cap: capacity(p2, THREADS) as u32,
        threads: THREADS,
        q_bf16: q_bf16 as u32,
        w_bf16: w_bf16 as u32,
        mode: 0,
        fast: 0,
        chunk: 0,
        tt: 1,
        stride: 1,
        key_fp8: 0,
    }
}

struct Case {
    heads: usize,
    dim: usize,
    rope: usize,
    page: usize,
    pages: usize,
    topk: usize,
    /// Page table rows (`pps` entries each, -1: unassigned).
    table: Vec<Vec<i32>>,
    /// (sequence row or -1, position) per token.
    tokens: Vec<(i32, i32)>,
    q_bf16: bool,
    w_bf16: bool,
    /// Copies of one key to other positions of sequence 0 (equal scores): (from, to...).
    ties: Vec<(usize, Vec<usize>)>,
    /// Tokens whose q is all zero (every score 0: the first top-k positions win).
    zero_q: Vec<usize>,
    /// Near ties decided by rounding alone: sequence 0's keys are a few base keys, each stored
    /// at 6 positions with its 3 non-rope chunks of 8 in every order; every q is 0 on the rope
    /// dims and depends only on d % 8 elsewhere, so the 6 dot products sum the same products in
    /// different orders and their scores differ only in the last bits. Needs DIM - ROPE = 24.
    near_ties: bool,
}

fn bf16_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|&f| f32_to_bf16(f).to_le_bytes()).collect()
}

/// Runs one case on the emulator and the CPU, asserts identical outputs; returns the launch
/// stats, the indexer-key bytes the scored tokens must read at least, how many rows a
/// chunked selection took in chunks and how many pairs of tokens a block per two scored together.
fn run(c: &Case, seed: u64) -> (LaunchStats, u64, usize, usize) {
    run_keys(c, seed, IndexKeys::Bf16)
}

/// [`run`] with the keys cached as `keys` says (FP8: the case's BF16 keys quantised per token).
fn run_keys(c: &Case, seed: u64, keys: IndexKeys) -> (LaunchStats, u64, usize, usize) {
    let mut rng = Rng::new(seed);
    let pps = c.table[0].len();
    let n_tok = c.tokens.len();
    let max_context = c.tokens.iter().map(|t| t.1 as usize + 1).max().unwrap().max(pps * c.page);
    let layout = KvLayout {
        dtype: DType::BF16,
        layers: 1,
        latent_dim: LATENT,
        rope_dim: c.rope,
        index_dim: c.dim,
        page_size: c.page,
        pages: c.pages,
        bytes_per_token: 0,
        max_seqs: c.table.len(),
        pages_per_seq: pps,
        max_context,
        index_keys: keys,
    };
    // the case's keys are made in the BF16 layout's rows
    let row = LATENT + c.rope + c.dim;
    let slot_of = |seq: usize, j: usize| c.table[seq][j / c.page] as usize * c.page + j % c.page;
    // Every slot random (latent and rope key too, so a wrong offset shows), keys BF16.
    let mut kv: Vec<f32> = (0..c.pages * c.page * row).map(|_| round_bf16(rng.normal() as f32)).collect();
    for (from, tos) in &c.ties {
        // A large key (likely among the best) copied to later positions: equal scores.
        let src = slot_of(0, *from) * row + LATENT + c.rope;
        let key: Vec<f32> = kv[src..src + c.dim].iter().map(|v| round_bf16(v * 4.0)).collect();
        kv[src..src + c.dim].copy_from_slice(&key);
        for &to in tos {
            let dst = slot_of(0, to) * row + LATENT + c.rope;
            kv[dst..dst + c.dim].copy_from_slice(&key);
        }
    }
    const PERMS: [[usize; 3]; 6] = [[0, 1, 2], [0, 2, 1], [1, 0, 2], [1, 2, 0], [2, 0, 1], [2, 1, 0]];
    if c.near_ties {
        assert_eq!((c.dim - c.rope, c.rope % 8), (24, 0));
        let base: Vec<Vec<f32>> = (0..5).map(|_| (0..c.dim).map(|_| round_bf16(rng.normal() as f32)).collect()).collect();
        for j in 0..pps * c.page {
            if c.table[0][j / c.page] < 0 {
                continue;
            }
            let (b, perm) = (&base[(j / 6) % base.len()], PERMS[j % 6]);
            let at = slot_of(0, j) * row + LATENT + c.rope;
            kv[at..at + c.rope].copy_from_slice(&b[..c.rope]);
            for (m, &from) in perm.iter().enumerate() {
                kv[at + c.rope + 8 * m..at + c.rope + 8 * m + 8].copy_from_slice(&b[c.rope + 8 * from..c.rope + 8 * from + 8]);
            }
        }
    }
    let kv_bytes = match keys {
        IndexKeys::Bf16 => bf16_bytes(&kv),
        // each row's latent and rope key as BF16, then the key's codes and scale, padded
        IndexKeys::Fp8 => {
            let pitch = layout.slot_bytes() as usize;
            let mut bytes = vec![0u8; c.pages * c.page * pitch];
            for (r, out) in kv.chunks_exact(row).zip(bytes.chunks_exact_mut(pitch)) {
                let at = (LATENT + c.rope) * 2;
                out[..at].copy_from_slice(&bf16_bytes(&r[..LATENT + c.rope]));
                let scale = quantize_fp8_key(&r[LATENT + c.rope..], &mut out[at..at + c.dim]);
                out[at + c.dim..at + c.dim + 4].copy_from_slice(&scale.to_le_bytes());
            }
            bytes
        }
    };
    let mut cache = Cache::new(&layout);
    cache.set_layer_bytes(0, &kv_bytes);

    let hd = c.heads * c.dim;
    let mut q: Vec<f32> = (0..n_tok * hd).map(|_| rng.normal() as f32).map(|v| if c.q_bf16 { round_bf16(v) } else { v }).collect();
    for &t in &c.zero_q {
        q[t * hd..(t + 1) * hd].fill(0.0);
    }
    if c.near_ties {
        for qh in q.chunks_exact_mut(c.dim) {
            qh[..c.rope].fill(0.0);
            for d in c.rope + 8..c.dim {
                qh[d] = qh[d - 8];
            }
        }
    }
    let w: Vec<f32> = (0..n_tok * c.heads).map(|_| (rng.normal() * 0.5) as f32).map(|v| if c.w_bf16 { round_bf16(v) } else { v }).collect();
    let rope = Rope::new(c.rope, THETA);
    let table = rope.table(max_context);
    let positions: Vec<i32> = c.tokens.iter().map(|t| t.1).collect();
    let token_seq: Vec<i32> = c.tokens.iter().map(|t| t.0).collect();
    let slots = vec![-1i32; n_tok];
    let page_table: Vec<i32> = c.table.iter().flatten().copied().collect();
    let inputs = TokenInputs { positions: &positions, token_seq: &token_seq, slots: &slots, page_table: &page_table, pages_per_seq: pps };
    let mut want = vec![0i32; n_tok * c.topk];
    reference::indexer_topk(&q, &w, c.heads, &inputs, &cache, 0, &rope, c.topk, &mut want);

    let p = IndexerTopkParams { row: layout.row_elems() as u32, key_fp8: u32::from(keys == IndexKeys::Fp8), ..params(c.heads, c.dim, c.rope, c.page, pps, c.topk, c.q_bf16, c.w_bf16) };
    let smem = p.dynamic_smem().unwrap();
    assert!(smem as usize + 1040 <= SMEM_LIMIT as usize);
    let module = Module::parse(&p.render().unwrap(), "indexer_topk.ptx").unwrap();
    let mut g = GlobalMemory::new();
    let words = |v: &[i32]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
    let bq = if c.q_bf16 { g.alloc_bytes("q", &bf16_bytes(&q)) } else { g.alloc_f32("q", &q) };
    let bw = if c.w_bf16 { g.alloc_bytes("w", &bf16_bytes(&w)) } else { g.alloc_f32("w", &w) };
    let bp = g.alloc_bytes("positions", &words(&positions));
    let bs = g.alloc_bytes("token_seq", &words(&token_seq));
    let bt = g.alloc_bytes("page_table", &words(&page_table));
    // The cache the CPU holds, in its GPU byte layout.
    let bk = g.alloc_bytes("kv", &cache.layer_bytes(0));
    let br = g.alloc_f32("rope", &table);
    let bo = g.alloc("out", n_tok * c.topk * 4);
    // decode's score scratch, filled with a pattern no score takes: a position the select reads
    // without the score launch having written it would show
    let positions_per_seq = pps * c.page;
    let bsc = g.alloc_bytes("scores", &vec![0x5Au8; n_tok * positions_per_seq * 4]);
    // a chunked selection's arrival counter per token (the split-K region's first words)
    let bcn = g.alloc("counters", n_tok * 4);
    let mut args: Vec<KernelArg> = [bq, bw, bp, bs, bt, bk, br, bo, bsc].iter().map(|&b| KernelArg::U64(g.addr(b))).collect();
    args.push(KernelArg::F32((c.heads as f32).powf(-0.5)));
    args.push(KernelArg::F32((c.dim as f32).powf(-0.5)));
    args.push(KernelArg::U64(g.addr(bcn)));
    // first_token: ignored where STRIDE is 1
    args.push(KernelArg::U32(0));
    let stats = launch(&module, IndexerTopkParams::ENTRY, [n_tok as u32, 1, 1], [THREADS, 1, 1], smem, &args, &mut g).unwrap();
    let got: Vec<i32> = g.read(bo).chunks_exact(4).map(|b| i32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect();
    let paired = pairs_match_single_tokens(c, &p, &module, &args, &g, bo, &got);
    strided_rows_match_single_tokens(c, &p, &args, &g, bo, &got);
    // Decode's split: scores over a grid of 1, 3 or one block per tile per token (each block
    // looping over its tiles of 256 positions, or of 64 as the lowering's scoring blocks), then
    // the selection alone: the same lists, bit for bit.
    let score_threads = (c.heads.next_multiple_of(32) as u32).max(64);
    let grids = |threads: u32| {
        let tiles = positions_per_seq.div_ceil(threads as usize) as u32;
        let mut grids = vec![(threads, 1), (threads, 3.min(tiles)), (threads, tiles)];
        grids.dedup();
        grids
    };
    for (threads, blocks_y) in grids(THREADS).into_iter().chain(grids(score_threads)) {
        // a fresh pattern every pass: a tile this grid skipped must not find an earlier pass's scores
        g.write(bsc, 0, &vec![0x5Au8; n_tok * positions_per_seq * 4]);
        let (score, select) = (IndexerTopkParams { mode: 1, threads, ..p }, IndexerTopkParams { mode: 2, ..p });
        let ms = Module::parse(&score.render().unwrap(), "indexer_topk.ptx").unwrap();
        let mt = Module::parse(&select.render().unwrap(), "indexer_topk.ptx").unwrap();
        g.write(bo, 0, &vec![0u8; n_tok * c.topk * 4]);
        let alone = launch(&ms, IndexerTopkParams::ENTRY, [n_tok as u32, blocks_y, 1], [threads, 1, 1], score.dynamic_smem().unwrap(), &args, &mut g).unwrap();
        launch(&mt, IndexerTopkParams::ENTRY, [n_tok as u32, 1, 1], [THREADS, 1, 1], select.dynamic_smem().unwrap(), &args, &mut g).unwrap();
        let split: Vec<i32> = g.read(bo).chunks_exact(4).map(|b| i32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect();
        assert!(split == got, "top-{}: scoring on {blocks_y} block(s) of {threads} threads per token, then selecting, differs from the fused kernel", c.topk);
        if n_tok % 2 == 0 {
            decode_pairs_score_as_single_tokens(c, &score, [blocks_y, threads], &args, &mut g, (bsc, bo), &alone, (&select, &mt), &got);
        }
    }
    // The lowering's selection blocks are larger (their own candidate buffer) and keep every key
    // of up to `fast_positions` positions in shared memory (no candidates, no sort); a small FAST
    // sends the longer rows of the same launch to the candidate path: the same lists from the
    // last pass's scores either way.
    let p2 = c.topk.next_power_of_two();
    let fast = fast_positions(SMEM_LIMIT);
    for (threads, fast) in [(SELECT_THREADS, fast), (SELECT_THREADS, 0), (THREADS, 2 * THREADS)] {
        let cap = capacity(p2, threads).max(fast as usize / 2) as u32;
        let wide = IndexerTopkParams { mode: 2, threads, cap, fast, ..p };
        let mw = Module::parse(&wide.render().unwrap(), "indexer_topk.ptx").unwrap();
        g.write(bo, 0, &vec![0u8; n_tok * c.topk * 4]);
        launch(&mw, IndexerTopkParams::ENTRY, [n_tok as u32, 1, 1], [threads, 1, 1], wide.dynamic_smem().unwrap(), &args, &mut g).unwrap();
        let wide_got: Vec<i32> = g.read(bo).chunks_exact(4).map(|b| i32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect();
        let fast_rows = c.tokens.iter().filter(|t| t.0 >= 0 && t.1 as usize >= c.topk && (t.1 as u32) < fast).count();
        assert!(wide_got == got, "top-{}: selecting with {threads} threads (FAST {fast}: {fast_rows} rows) differs from the fused kernel", c.topk);
    }
    // Past FAST positions the lowering may select in chunks of `select_chunk` positions, a block
    // each, the token's last chunk to finish selecting from their lists (written over the
    // scores): small FASTs send the case's longer rows there, with the most chunks and the
    // fewest, from fresh scores each time; the same lists again, and every counter back at zero
    // (the next launch counts from there).
    let scores = g.read(bsc).to_vec();
    let mut chunked_rows = 0;
    for threads in [32, THREADS, SELECT_THREADS] {
        let fasts: Vec<u32> = (1..).map(|m| m * threads).take_while(|&f| (f as usize) < positions_per_seq).filter(|&f| select_chunk(positions_per_seq, c.topk, f) > 0).collect();
        let mut tried = vec![fasts.first().copied(), fasts.last().copied()];
        tried.dedup();
        for fast in tried.into_iter().flatten() {
            let chunk = select_chunk(positions_per_seq, c.topk, fast);
            let chunks = positions_per_seq.div_ceil(chunk as usize) as u32;
            let cap = capacity(p2, threads).max(fast as usize / 2) as u32;
            let sel = IndexerTopkParams { mode: 2, threads, cap, fast, chunk, ..p };
            let m = Module::parse(&sel.render().unwrap(), "indexer_topk.ptx").unwrap();
            g.write(bsc, 0, &scores);
            g.write(bo, 0, &vec![0u8; n_tok * c.topk * 4]);
            launch(&m, IndexerTopkParams::ENTRY, [n_tok as u32, chunks, 1], [threads, 1, 1], sel.dynamic_smem().unwrap(), &args, &mut g).unwrap();
            let chunked: Vec<i32> = g.read(bo).chunks_exact(4).map(|b| i32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect();
            let rows = c.tokens.iter().filter(|t| t.0 >= 0 && t.1 as u32 >= fast).count();
            assert!(chunked == got, "top-{}: selecting in chunks of {chunk} ({chunks} blocks of {threads} threads; FAST {fast}: {rows} rows chunked) differs from the fused kernel", c.topk);
            assert!(g.read(bcn).iter().all(|&b| b == 0), "a chunk counter is not back at zero: {:?}", g.read(bcn));
            chunked_rows += rows;
        }
    }
    for t in 0..n_tok {
        let (a, b) = (&got[t * c.topk..(t + 1) * c.topk], &want[t * c.topk..(t + 1) * c.topk]);
        assert_eq!(a, b, "token {t} (seq {}, position {}), top-{}: emulator vs CPU", c.tokens[t].0, c.tokens[t].1, c.topk);
    }
    // Scored rows where at least two positions of one tie group were selected (the tie rule at work).
    let tie_rows = (0..n_tok)
        .filter(|&t| c.tokens[t].0 == 0 && c.tokens[t].1 as usize >= c.topk)
        .filter(|&t| {
            let row = &want[t * c.topk..(t + 1) * c.topk];
            c.ties.iter().any(|(from, tos)| std::iter::once(from).chain(tos).filter(|&&j| row.contains(&(j as i32))).count() >= 2)
        })
        .count();
    assert!(c.ties.is_empty() || tie_rows > 0, "no row selected two tied positions: the tie case tests nothing");
    let key_bytes = if keys == IndexKeys::Fp8 { c.dim as u64 + 4 } else { c.dim as u64 * 2 };
    let scored: u64 = c.tokens.iter().filter(|t| t.0 >= 0 && t.1 as usize + 1 > c.topk).map(|t| (t.1 as u64 + 1) * key_bytes).sum();
    eprintln!(
        "indexer top-{} heads={} dim={} {} keys tokens={n_tok}: identical ({} selections, {tie_rows} rows with ties, {} B read, {scored} B of keys scored, {:.2?})",
        c.topk,
        c.heads,
        c.dim,
        keys.name(),
        want.iter().filter(|&&v| v >= 0).count(),
        stats.global_bytes_read(),
        stats.elapsed
    );
    (stats, scored, chunked_rows, paired)
}

/// Decode's scoring a block per two rows (`TT` = 2, MODE 1) on the same grid along y: every
/// score the same bits as a block per row (each row's own positions; the rest of the scratch
/// untouched), the selection from them the same lists, and, where two rows of a pair are one
/// sequence's and both longer than top-k (a speculative step's rows), at least the shorter row's
/// key bytes fewer read.
#[allow(clippy::too_many_arguments)]
fn decode_pairs_score_as_single_tokens(c: &Case, score: &IndexerTopkParams, [blocks_y, threads]: [u32; 2], args: &[KernelArg], g: &mut GlobalMemory, (bsc, bo): (BufferId, BufferId), alone: &LaunchStats, (select, mt): (&IndexerTopkParams, &Module), got: &[i32]) {
    let n_tok = c.tokens.len();
    let singles = g.read(bsc).to_vec();
    let pair = IndexerTopkParams { tt: 2, ..*score };
    let smem = pair.dynamic_smem().unwrap();
    assert!(smem <= 2 * score.dynamic_smem().unwrap() + 16, "a MODE 1 pair holds two q regions, no candidates: {smem} B");
    let m = Module::parse(&pair.render().unwrap(), "indexer_topk.ptx").unwrap();
    g.write(bsc, 0, &vec![0x5Au8; singles.len()]);
    let both = launch(&m, IndexerTopkParams::ENTRY, [n_tok as u32 / 2, blocks_y, 1], [threads, 1, 1], smem, args, g).unwrap();
    let pitch = c.table[0].len() * c.page * 4;
    let paired = g.read(bsc).to_vec();
    for (t, tok) in c.tokens.iter().enumerate() {
        let row = t * pitch..(t + 1) * pitch;
        assert!(paired[row.clone()] == singles[row], "token {t} (seq {}, position {}): its scores scored in pairs differ (grid y {blocks_y}, {threads} threads)", tok.0, tok.1);
    }
    g.write(bo, 0, &vec![0u8; n_tok * c.topk * 4]);
    launch(mt, IndexerTopkParams::ENTRY, [n_tok as u32, 1, 1], [THREADS, 1, 1], select.dynamic_smem().unwrap(), args, g).unwrap();
    let lists: Vec<i32> = g.read(bo).chunks_exact(4).map(|b| i32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect();
    assert!(lists == got, "top-{}: selecting from scores scored in pairs differs", c.topk);
    let key_bytes = if score.key_fp8 == 1 { c.dim as u64 + 4 } else { c.dim as u64 * 2 };
    // the keys (and page-table entries) of the positions both rows of a shared pair score, where
    // a page is assigned, are read once; against that, a pair's blocks past the shorter row
    // stage its q too, and a block whose rows are not a pair reads its second row's sequence
    // and position again (the byte model is held to the emulator's counts in tests/perf.rs):
    // at least half the shared keys' bytes saved
    let assigned = |seq: i32, n: usize| (0..n).filter(|&j| c.table[seq as usize][j / c.page] >= 0).count() as u64;
    let shared: u64 = c.tokens.chunks(2).filter(|p| p[0].0 >= 0 && p[0].0 == p[1].0 && p[0].1 as usize >= c.topk && p[1].1 as usize >= c.topk).map(|p| assigned(p[0].0, p[0].1.min(p[1].1) as usize + 1) * key_bytes).sum();
    if shared > 0 {
        assert!(both.global_bytes_read() + shared / 2 <= alone.global_bytes_read(), "pairs read {} B, single rows {} B: {shared} B of keys shared", both.global_bytes_read(), alone.global_bytes_read());
    }
}

/// Prefill's block per two tokens (`TT` = 2) over the case's tokens in pairs (an odd last token
/// left out): the same lists as a block per token, bit for bit, and exactly the page-table and
/// key reads of every position both tokens of a pair score saved (a pair: one sequence, both rows
/// longer than top-k; any other pair reads what two blocks read). Returns the pairs that shared.
fn pairs_match_single_tokens(c: &Case, p: &IndexerTopkParams, single: &Module, args: &[KernelArg], g: &GlobalMemory, bo: BufferId, got: &[i32]) -> usize {
    let pairs = c.tokens.len() / 2;
    if pairs == 0 {
        return 0;
    }
    let rows = 2 * pairs * c.topk;
    let read = |g: &GlobalMemory| g.read(bo).chunks_exact(4).map(|b| i32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect::<Vec<i32>>();
    g.write(bo, 0, &vec![0u8; c.tokens.len() * c.topk * 4]);
    let alone = launch(single, IndexerTopkParams::ENTRY, [2 * pairs as u32, 1, 1], [THREADS, 1, 1], p.dynamic_smem().unwrap(), args, g).unwrap();
    let pp = IndexerTopkParams { tt: 2, ..*p };
    let smem = pp.dynamic_smem().unwrap();
    assert!(smem as usize + 1056 <= SMEM_LIMIT as usize, "{smem} B");
    assert!(IndexerTopkParams { mode: 2, ..pp }.render().is_err(), "TT = 2 does not render with MODE 2");
    let m = Module::parse(&pp.render().unwrap(), "indexer_topk.ptx").unwrap();
    g.write(bo, 0, &vec![0u8; c.tokens.len() * c.topk * 4]);
    let both = launch(&m, IndexerTopkParams::ENTRY, [pairs as u32, 1, 1], [THREADS, 1, 1], smem, args, g).unwrap();
    let out = read(g);
    for t in 0..2 * pairs {
        let r = t * c.topk..(t + 1) * c.topk;
        assert_eq!(out[r.clone()], got[r], "token {t} (seq {}, position {}) of a block per two tokens, top-{}: differs from a block per token", c.tokens[t].0, c.tokens[t].1, c.topk);
    }
    assert_eq!(out[rows..], vec![0; out.len() - rows][..], "a block per two tokens wrote past its tokens");
    // the reads a shared pass saves: per position of the shorter row, its page-table entry
    // (inside the table) and its key (on an assigned page)
    let pps = c.table[0].len();
    let mut saved = 0u64;
    let mut shared = 0;
    for pair in c.tokens[..2 * pairs].chunks(2) {
        let ((s0, p0), (s1, p1)) = (pair[0], pair[1]);
        if s0 != s1 || s0 < 0 || (p0 as usize) < c.topk || (p1 as usize) < c.topk {
            continue;
        }
        shared += 1;
        for j in 0..=p0.min(p1) as usize {
            if j / c.page < pps {
                saved += 4;
                if c.table[s0 as usize][j / c.page] >= 0 {
                    // the key's BF16 values, or its FP8 codes and scale
                    saved += if p.key_fp8 == 1 { c.dim as u64 + 4 } else { 2 * c.dim as u64 };
                }
            }
        }
    }
    assert_eq!(alone.global_bytes_read() - both.global_bytes_read(), saved, "bytes a block per two tokens saved ({} B read) against a block per token ({} B), {shared} shared pairs", both.global_bytes_read(), alone.global_bytes_read());
    assert_eq!(alone.global_bytes_written(), both.global_bytes_written());
    shared
}

/// A sequence-parallel indexer (`STRIDE` = R ranks, MODE 0): rank r's launch over the rows of
/// tokens r, r + R, ... (a block per token, and per two where the rows are even): row j is
/// token jR + r's list of a block per token over all of them, bit for bit, and nothing is written
/// past the rank's rows. R = 2 and 3 where they divide the case's tokens.
fn strided_rows_match_single_tokens(c: &Case, p: &IndexerTopkParams, args: &[KernelArg], g: &GlobalMemory, bo: BufferId, got: &[i32]) {
    let n_tok = c.tokens.len();
    let read = |g: &GlobalMemory| g.read(bo).chunks_exact(4).map(|b| i32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect::<Vec<i32>>();
    for ranks in [2, 3].into_iter().filter(|&r| n_tok % r == 0 && n_tok >= 2 * r) {
        let rows = n_tok / ranks;
        let strided = IndexerTopkParams { stride: ranks as u32, ..*p };
        assert!(IndexerTopkParams { mode: 1, ..strided }.render().is_err() && IndexerTopkParams { mode: 2, ..strided }.render().is_err(), "STRIDE > 1 renders only with MODE 0");
        let tts: &[u32] = if rows % 2 == 0 { &[1, 2] } else { &[1] };
        for &tt in tts {
            let sp = IndexerTopkParams { tt, ..strided };
            let m = Module::parse(&sp.render().unwrap(), "indexer_topk.ptx").unwrap();
            for rank in 0..ranks {
                let mut a = args.to_vec();
                *a.last_mut().unwrap() = KernelArg::U32(rank as u32);
                g.write(bo, 0, &vec![0u8; n_tok * c.topk * 4]);
                launch(&m, IndexerTopkParams::ENTRY, [(rows / tt as usize) as u32, 1, 1], [THREADS, 1, 1], sp.dynamic_smem().unwrap(), &a, g).unwrap();
                let out = read(g);
                for j in 0..rows {
                    let t = j * ranks + rank;
                    assert_eq!(out[j * c.topk..(j + 1) * c.topk], got[t * c.topk..(t + 1) * c.topk], "rank {rank} of {ranks} (TT {tt}), row {j} = token {t} (seq {}, position {}), top-{}: differs from a block per token", c.tokens[t].0, c.tokens[t].1, c.topk);
                }
                assert_eq!(out[rows * c.topk..], vec![0; (n_tok - rows) * c.topk][..], "rank {rank} of {ranks} (TT {tt}) wrote past its rows");
            }
        }
    }
}

/// Page table rows: sequence s owns pages in a shuffled order (disjoint across sequences).
fn shuffled_tables(rng: &mut Rng, seqs: usize, pps: usize, pages: usize) -> Vec<Vec<i32>> {
    let mut ids: Vec<i32> = (0..pages as i32).collect();
    for i in (1..ids.len()).rev() {
        let j = (rng.next_u64() % (i as u64 + 1)) as usize;
        ids.swap(i, j);
    }
    (0..seqs).map(|s| ids[s * pps..(s + 1) * pps].to_vec()).collect()
}

#[test]
fn tiny_topk_matches_the_cpu_on_a_ragged_batch() {
    // The tiny model: 8 heads x 32, rope 16, top-16; pages of 16 tokens, 3 sequences.
    let (page, pps) = (16, 64);
    let mut rng = Rng::new(11);
    let table = shuffled_tables(&mut rng, 3, pps, 3 * pps);
    // n = 5, 16 (= top-k), 17, 300, 1024 (the longest), padding, ties, an all-zero q
    let tokens = vec![
        (0, 4),
        (0, 15),
        (0, 16),
        (0, 299),
        (-1, 7),
        (1, 1023),
        (1, 100),
        (2, 17),
        (2, 40),
        (-1, 500),
        (0, 63),
        (1, 64),
        (2, 255),
        (2, 256),
        (0, 200),
        (1, 0),
        (0, 299),
    ];
    let c = Case {
        heads: 8,
        dim: 32,
        rope: 16,
        page,
        pages: 3 * pps,
        topk: 16,
        table,
        tokens,
        q_bf16: true,
        w_bf16: false,
        // Position 3's key at 9 other places of sequence 0, across pages: equal scores, the
        // lower positions must come first.
        ties: vec![(3, vec![5, 17, 18, 40, 63, 64, 150, 151, 298])],
        zero_q: vec![16],
        near_ties: false,
    };
    let (_, _, chunked, _) = run(&c, 1);
    assert!(chunked > 0, "no row was selected in chunks");
}

#[test]
fn token_counts_1_and_3_and_f32_q_bf16_weights() {
    let (page, pps) = (16, 48);
    let mut rng = Rng::new(12);
    let table = shuffled_tables(&mut rng, 2, pps, 2 * pps);
    for (i, tokens) in [vec![(1, 700)], vec![(0, 20), (-1, 3), (1, 400)]].into_iter().enumerate() {
        let c = Case { heads: 8, dim: 32, rope: 16, page, pages: 2 * pps, topk: 16, table: table.clone(), tokens, q_bf16: false, w_bf16: true, ties: vec![], zero_q: vec![], near_ties: false };
        run(&c, 20 + i as u64);
    }
}

#[test]
fn a_head_width_the_threads_do_not_divide_rotates_q_pair_by_pair() {
    // DIM = 24: 12 pairs per head do not divide the block's threads, so each thread loads the
    // table entry of every rope pair it takes (the other geometries load theirs once); a block
    // per two tokens stages the second token's q the same way (the last pair)
    let (page, pps) = (16, 48);
    let mut rng = Rng::new(14);
    let table = shuffled_tables(&mut rng, 2, pps, 2 * pps);
    let tokens = vec![(1, 700), (0, 20), (-1, 3), (1, 400), (1, 500), (1, 501)];
    let c = Case { heads: 8, dim: 24, rope: 8, page, pages: 2 * pps, topk: 16, table, tokens, q_bf16: true, w_bf16: true, ties: vec![], zero_q: vec![], near_ties: false };
    run(&c, 25);
}

#[test]
fn larger_topk_compacts_the_candidates_many_times() {
    // top-40 (P2 = 64, capacity 320: a compaction about every tile) and top-300 (P2 = 512),
    // sequences of 1000 positions in 64-token pages; positions with increasing scores would
    // stress the threshold most, random ones the radix select.
    let (page, pps) = (64, 16);
    let mut rng = Rng::new(13);
    let table = shuffled_tables(&mut rng, 2, pps, 2 * pps);
    for (i, topk) in [40usize, 300].into_iter().enumerate() {
        // token 6: all scores 0, so the first top-k positions (ties all the way down)
        let tokens = vec![(0, 999), (1, 650), (0, 39), (1, 40), (0, 299), (1, 300), (0, 700)];
        let ties = vec![(5, vec![11, 500, 998, 999, 64, 128])];
        let c = Case { heads: 2, dim: 16, rope: 8, page, pages: 2 * pps, topk, table: table.clone(), tokens, q_bf16: true, w_bf16: false, ties, zero_q: vec![6], near_ties: false };
        run(&c, 30 + i as u64);
    }
}

#[test]
fn near_ties_follow_the_cpu_rounding_exactly() {
    // Scores that differ only by the summation order's rounding (and exact ties between
    // permutations that happen to round alike): only the CPU's exact order selects the same
    // positions.
    let (page, pps) = (16, 32);
    let mut rng = Rng::new(16);
    let table = shuffled_tables(&mut rng, 1, pps, pps);
    let tokens = vec![(0, 511), (0, 300), (0, 143), (0, 60), (0, 29)];
    let c = Case { heads: 8, dim: 32, rope: 8, page, pages: pps, topk: 16, table, tokens, q_bf16: false, w_bf16: false, ties: vec![], zero_q: vec![], near_ties: true };
    run(&c, 70);
}

#[test]
fn top_1_and_top_3() {
    // P2 = 1 (no sorting network, odd P2) and P2 = 4 with TOPK < P2 (padding keys in the sort).
    let (page, pps) = (16, 16);
    let mut rng = Rng::new(17);
    let table = shuffled_tables(&mut rng, 2, pps, 2 * pps);
    for (i, topk) in [1usize, 3].into_iter().enumerate() {
        let tokens = vec![(0, 0), (1, 2), (0, 3), (1, 255), (-1, 9), (0, 100)];
        let c = Case { heads: 8, dim: 32, rope: 16, page, pages: 2 * pps, topk, table: table.clone(), tokens, q_bf16: true, w_bf16: false, ties: vec![], zero_q: vec![5], near_ties: false };
        run(&c, 90 + i as u64);
    }
}

#[test]
fn unassigned_pages_are_skipped() {
    // Sequence 0 has pages 1 and 3 unassigned: its positions 16..32 and 48..64 are not scored,
    // so a token at position 40 has 25 candidates for top-16, and one at 60 has 29; sequence 1
    // has only 2 pages assigned (a token at 40 > top-k with 32 candidates, ...).
    let page = 16;
    let table = vec![vec![5, -1, 2, -1, 0], vec![1, 4, -1, -1, -1]];
    let tokens = vec![(0, 40), (0, 60), (0, 20), (1, 40), (1, 79), (1, 31)];
    let c = Case { heads: 8, dim: 32, rope: 16, page, pages: 6, topk: 16, table: table.clone(), tokens, q_bf16: true, w_bf16: false, ties: vec![], zero_q: vec![], near_ties: false };
    run(&c, 40);
    // top-40 where a row sees more positions than that but fewer are assigned (sequence 1 at
    // 79: 80 positions, 32 with a page): every assigned one, then -1
    let tokens = vec![(1, 79), (0, 79), (1, 45)];
    let c = Case { heads: 8, dim: 32, rope: 16, page, pages: 6, topk: 40, table, tokens, q_bf16: true, w_bf16: false, ties: vec![], zero_q: vec![], near_ties: false };
    run(&c, 41);
}

#[test]
fn glm5_topk_2048_selects_from_thousands_of_positions() {
    // GLM-5's top-2048 (P2 = 2048, capacity 4096) over 5000 positions, with a small score
    // (1 head x 8) so the emulator stays quick; n = 2048 (no scoring) and 2049 (one dropped).
    let (page, pps) = (64, 80);
    let mut rng = Rng::new(14);
    let table = shuffled_tables(&mut rng, 1, pps, pps);
    let tokens = vec![(0, 4999), (0, 2047), (0, 2048)];
    let c = Case { heads: 1, dim: 8, rope: 8, page, pages: pps, topk: 2048, table, tokens, q_bf16: true, w_bf16: false, ties: vec![(100, vec![101, 4000, 4999])], zero_q: vec![], near_ties: false };
    run(&c, 50);
}

#[test]
fn glm5_topk_2048_selects_in_chunks() {
    // Top-2048 over up to 12,288 positions with FAST 6,144: chunks of 4,096 positions (3 lists
    // of 2,048 for the last block); n = 12,288 (three full chunks), 9,001 (a last chunk of 809
    // positions, fewer than top-k), 6,145 (two chunks), 6,144 (one block), 2,048 (no scoring);
    // ties across chunks.
    let (page, pps) = (64, 192);
    assert_eq!(select_chunk(page * pps, 2048, 6144), 4096);
    let mut rng = Rng::new(18);
    let table = shuffled_tables(&mut rng, 1, pps, pps);
    let tokens = vec![(0, 12287), (0, 9000), (0, 6144), (0, 6143), (0, 2047)];
    let ties = vec![(100, vec![4095, 4096, 8200, 12000]), (200, vec![4097, 6143, 9000]), (300, vec![5000, 8191, 8192])];
    let c = Case { heads: 1, dim: 8, rope: 8, page, pages: pps, topk: 2048, table, tokens, q_bf16: true, w_bf16: false, ties, zero_q: vec![], near_ties: false };
    let (_, _, chunked, _) = run(&c, 51);
    assert!(chunked >= 3, "{chunked} rows selected in chunks");
}

#[test]
fn prefill_pairs_score_each_key_once_for_both() {
    // A prefill chunk of one sequence from position 9 (pairs (9, 10) .. (15, 16) below or across
    // top-16, then pairs of two scoring rows), with a page hole; then two sequences in one pair
    // (both scoring: one after the other), a padding partner, a padding token first, a pair out
    // of position order and long rows whose tiles run past the shorter one.
    let page = 16;
    let mut rng = Rng::new(19);
    let mut table = shuffled_tables(&mut rng, 2, 64, 128);
    table[0][5] = -1;
    let mut tokens: Vec<(i32, i32)> = (9..49).map(|p| (0, p)).collect();
    tokens.extend([(0, 500), (1, 600), (0, 700), (-1, 0), (-1, 0), (0, 900), (0, 800), (0, 700), (0, 1000), (0, 1023)]);
    let c = Case { heads: 8, dim: 32, rope: 16, page, pages: 128, topk: 16, table, tokens, q_bf16: true, w_bf16: false, ties: vec![(3, vec![17, 40, 300, 999])], zero_q: vec![20], near_ties: false };
    let (_, _, _, shared) = run(&c, 80);
    assert_eq!(shared, 16 + 2, "pairs scored together");
    // top-40 (capacity 320): both tokens of a pair compact their candidates about every tile,
    // at different times (one of them all ties: q = 0)
    let (page, pps) = (64, 16);
    let table = shuffled_tables(&mut rng, 1, pps, pps);
    let tokens = vec![(0, 990), (0, 991), (0, 992), (0, 993), (0, 600), (0, 1000)];
    let c = Case { heads: 2, dim: 16, rope: 8, page, pages: pps, topk: 40, table, tokens, q_bf16: false, w_bf16: true, ties: vec![(5, vec![11, 500, 990, 64])], zero_q: vec![2], near_ties: false };
    let (_, _, _, shared) = run(&c, 81);
    assert_eq!(shared, 3);
}

#[test]
fn decode_reads_each_key_about_once() {
    // One decode token over 1000 positions: the kernel reads the keys once (plus q, the
    // page table and the RoPE row).
    let (page, pps) = (16, 64);
    let mut rng = Rng::new(15);
    let table = shuffled_tables(&mut rng, 1, pps, pps);
    let c = Case { heads: 8, dim: 32, rope: 16, page, pages: pps, topk: 16, table, tokens: vec![(0, 999)], q_bf16: true, w_bf16: false, ties: vec![], zero_q: vec![], near_ties: false };
    let (stats, keys, _, _) = run(&c, 60);
    let ratio = stats.global_bytes_read() as f64 / keys as f64;
    eprintln!("decode: {} B read / {keys} B of keys = {ratio:.3}", stats.global_bytes_read());
    assert!((1.0..=1.25).contains(&ratio), "byte ratio {ratio}");
}

/// FP8 keys (`--indexer-keys fp8`, `KEY_FP8`): the kernel reads each key's E4M3 codes and
/// scale from after the rope key and scores code x scale (exact), as the CPU scores the keys it
/// holds: the same lists bit for bit on the tiny model's ragged batch (ties, padding, an all-zero
/// q, chunked selection, pairs and strided rows), on candidates compacted about every tile, and
/// on near ties decided by rounding; decode reads a key's codes and scale (36 B) about once.
#[test]
fn fp8_keys_select_as_the_cpu() {
    let (page, pps) = (16, 64);
    let mut rng = Rng::new(41);
    let table = shuffled_tables(&mut rng, 3, pps, 3 * pps);
    let tokens = vec![(0, 4), (0, 16), (0, 299), (-1, 7), (1, 1023), (1, 100), (2, 40), (0, 63), (1, 64), (2, 256), (0, 200), (0, 201)];
    let ties = vec![(3, vec![5, 17, 18, 40, 63, 64, 150, 151, 298])];
    let c = Case { heads: 8, dim: 32, rope: 16, page, pages: 3 * pps, topk: 16, table: table.clone(), tokens, q_bf16: true, w_bf16: false, ties, zero_q: vec![2], near_ties: false };
    run_keys(&c, 42, IndexKeys::Fp8);
    let c = Case { heads: 2, dim: 16, rope: 8, page, pages: 3 * pps, topk: 40, table: table.clone(), tokens: vec![(0, 999), (1, 650), (0, 39), (1, 40)], q_bf16: true, w_bf16: false, ties: vec![], zero_q: vec![], near_ties: false };
    run_keys(&c, 43, IndexKeys::Fp8);
    let near = Case { heads: 8, dim: 32, rope: 8, page, pages: 3 * pps, topk: 16, table: table.clone(), tokens: vec![(0, 511), (0, 300), (0, 143)], q_bf16: false, w_bf16: false, ties: vec![], zero_q: vec![], near_ties: true };
    run_keys(&near, 44, IndexKeys::Fp8);
    let decode = Case { heads: 8, dim: 32, rope: 16, page, pages: 3 * pps, topk: 16, table, tokens: vec![(0, 999)], q_bf16: true, w_bf16: false, ties: vec![], zero_q: vec![], near_ties: false };
    let (stats, keys, _, _) = run_keys(&decode, 45, IndexKeys::Fp8);
    let ratio = stats.global_bytes_read() as f64 / keys as f64;
    assert!((1.0..=1.25).contains(&ratio), "decode over FP8 keys: {} B read for {keys} B of codes and scales ({ratio:.3})", stats.global_bytes_read());
}

/// (registers, spill bytes, static smem) of one rendered instance.
fn ptxas_resources(ptxas: &std::path::Path, name: &str, ptx: &str) -> (u32, u32, u32) {
    let r = common::assemble(ptxas, name, ptx).unwrap_or_else(|e| panic!("{e}"));
    (r.registers, r.spill_store_bytes + r.spill_load_bytes, r.smem_static_bytes)
}

#[test]
fn tiny_and_glm5_instances_assemble_for_sm_120a() {
    let Some(ptxas) = common::ptxas("the indexer top-k") else { return };
    // GLM-5 tp8: 32 heads x 128, rope 64, latent 512, 64-token pages over 202752 positions,
    // top-2048 (decode batches and 8192-token prefill chunks launch this same kernel).
    let glm5 = |q_bf16| {
        let mut p = params(32, 128, 64, 64, 202_752usize.div_ceil(64), 2048, q_bf16, false);
        p.row = 512 + 64 + 128;
        p.koff = 512 + 64;
        p
    };
    // decode's selection as lowering makes it: 1,024 threads, every key of up to FAST positions
    // in shared memory (the block's limit), longer contexts in chunks
    let fast = fast_positions(SMEM_LIMIT);
    let select = |p: IndexerTopkParams| {
        let chunk = select_chunk((p.pps * p.page) as usize, p.topk as usize, fast);
        IndexerTopkParams { mode: 2, threads: SELECT_THREADS, cap: capacity(p.p2 as usize, SELECT_THREADS).max(fast as usize / 2) as u32, fast, chunk, ..p }
    };
    assert!(select(glm5(true)).chunk > 0, "GLM-5's decode selects its longest contexts in chunks");
    for (name, p) in [("tiny", params(8, 32, 16, 64, 16, 16, true, false)), ("tiny_f32", params(8, 32, 16, 64, 16, 16, false, true)), ("glm5_tp8", glm5(true)), ("glm5_tp8_f32q", glm5(false)), ("glm5_tp8_select", select(glm5(true))), ("glm5_tp8_select_sm90", IndexerTopkParams { arch: 90, ..select(glm5(true)) }), ("tiny_pairs", IndexerTopkParams { tt: 2, ..params(8, 32, 16, 64, 16, 16, true, false) }), ("glm5_tp8_pairs", IndexerTopkParams { tt: 2, ..glm5(true) }), ("glm5_tp8_pairs_sm90", IndexerTopkParams { arch: 90, tt: 2, ..glm5(true) }), ("glm5_tp8_sequence_parallel", IndexerTopkParams { tt: 2, stride: 8, ..glm5(true) }), ("glm5_tp8_sequence_parallel_sm90", IndexerTopkParams { arch: 90, tt: 2, stride: 8, ..glm5(true) }), ("glm5_tp8_fp8_keys", IndexerTopkParams { key_fp8: 1, row: 648, ..glm5(true) }), ("glm5_tp8_fp8_keys_pairs", IndexerTopkParams { key_fp8: 1, row: 648, tt: 2, ..glm5(true) }), ("glm5_tp8_fp8_keys_sm90", IndexerTopkParams { arch: 90, key_fp8: 1, row: 648, ..glm5(true) }), ("glm5_tp8_decode_pairs", IndexerTopkParams { mode: 1, threads: 64, tt: 2, ..glm5(true) }), ("glm5_tp8_decode_pairs_sm90", IndexerTopkParams { arch: 90, mode: 1, threads: 64, tt: 2, ..glm5(true) }), ("glm5_tp8_fp8_keys_decode_pairs", IndexerTopkParams { mode: 1, threads: 64, tt: 2, key_fp8: 1, row: 648, ..glm5(true) })] {
        let (regs, spills, smem_static) = ptxas_resources(&ptxas, name, &p.render().unwrap());
        let dynamic = p.dynamic_smem().unwrap();
        eprintln!("indexer_topk {name}: {regs} registers, {spills} B spills, {smem_static} B static + {dynamic} B dynamic shared memory");
        assert_eq!(spills, 0, "{name} spills");
        assert!(regs <= 255, "{name}: {regs} registers");
        assert!(smem_static + dynamic <= SMEM_LIMIT, "{name}: {smem_static} + {dynamic} B shared memory");
    }
}

/// The lowering, end to end: the tiny model compiled for sm_120a; for a decode and a prefill
/// program, the first indexer top-k step's launches (prefill: one; decode: scores, then the
/// selection; kernels, grids, blocks, shared memory and arguments exactly as planned) run on the
/// emulator over random inputs and match the CPU.
#[test]
fn the_planned_launches_of_the_tiny_model_match_the_cpu() {
    planned_launches_match_the_cpu(false);
}

/// The same with the tiny model's context stretched to 32,768 positions (its config edited; the
/// weights do not depend on it): decode's selection is planned in chunks (the plan is checked
/// for it), and tokens past 24,576 positions take them, the split-K region's counters back at
/// zero afterwards.
#[test]
fn the_planned_chunked_selection_of_a_long_context_matches_the_cpu() {
    planned_launches_match_the_cpu(true);
}

fn planned_launches_match_the_cpu(long: bool) {
    use kiln_runtime::plan::{read_plan, KernelFamily, LaunchArg, Op, ProgramKind};
    let dir = std::env::temp_dir().join(format!("kiln-indexer-plan-{}-{long}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let kiln = |args: &[&str]| {
        let o = Command::new(env!("CARGO_BIN_EXE_kiln")).args(args).output().expect("run kiln");
        assert!(o.status.success(), "kiln {args:?}:\n{}", String::from_utf8_lossy(&o.stderr));
    };
    let (ckpt, art) = (dir.join("ckpt"), dir.join("plan"));
    kiln(&["synth", "tiny", "-o", ckpt.to_str().unwrap()]);
    let config = ckpt.join("config.json");
    let mut compile = vec!["compile", ckpt.to_str().unwrap(), "--target", "sm_120a", "--no-ptxas", "--no-merge", "-o", art.to_str().unwrap()];
    if long {
        let mut c: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&config).unwrap()).unwrap();
        c["max_position_embeddings"] = 32768.into();
        std::fs::write(&config, c.to_string()).unwrap();
        compile.extend(["--max-context", "32768", "--decode-batches", "1,4", "--prefill-chunk", "32"]);
    }
    // --no-merge: the indexer's own launches (a merged plan runs its selection beside
    // attention's absorb, the same kernel: tests/emu_logits.rs holds merged against unmerged)
    kiln(&compile);
    let plan = read_plan(&art).unwrap();
    // (a step without a kernel fails the compile)
    for p in &plan.programs {
        let launches = if matches!(p.kind, ProgramKind::Decode { .. }) { 2 } else { 1 };
        assert!(p.steps.iter().filter(|s| s.kernel == KernelFamily::IndexerTopK).all(|s| s.launches.len() == launches), "{}", p.name);
    }
    let rope = Rope::new(plan.model.qk_rope_head_dim, plan.model.rope_theta);
    let mut checked = 0;
    for (pi, program) in plan.programs.iter().enumerate() {
        let decode = matches!(program.kind, ProgramKind::Decode { .. });
        // decode_1, the largest decode batch and the smallest prefill chunk
        let largest_decode = plan.programs.iter().filter(|p| matches!(p.kind, ProgramKind::Decode { .. })).map(|p| p.tokens).max();
        let smallest_prefill = plan.programs.iter().filter(|p| matches!(p.kind, ProgramKind::Prefill { .. })).map(|p| p.tokens).min();
        if !(decode && (program.tokens == 1 || Some(program.tokens) == largest_decode) || !decode && Some(program.tokens) == smallest_prefill) {
            continue;
        }
        let step = program.steps.iter().find(|s| matches!(s.op, Op::IndexerTopK { .. })).expect("an indexer step");
        let Op::IndexerTopK { q, head_weights, layer, topk, across_ranks, scores, out } = step.op else { unreachable!() };
        assert!(!across_ranks, "a plan of one rank selects for every token");
        let select = step.launches.last().unwrap();
        let select_threads = if decode { SELECT_THREADS } else { THREADS };
        let chunk = plan.kernel(select.kernel).param("CHUNK").unwrap_or(0) as usize;
        let positions_per_seq = plan.memory.kv.pages_per_seq * plan.memory.kv.page_size;
        let chunks = if chunk > 0 { positions_per_seq.div_ceil(chunk) as u32 } else { 1 };
        assert_eq!((select.grid, select.block), ([program.tokens as u32, chunks, 1], [select_threads, 1, 1]));
        assert_eq!(chunk > 0, long && decode, "{}: the selection's CHUNK {chunk}", program.name);

        let (t, seqs) = (program.tokens, program.seqs);
        let heads = plan.model.index_n_heads;
        let hd = heads * plan.model.index_head_dim;
        let mut kv = plan.memory.kv.clone();
        kv.layers = 1;
        kv.pages = seqs * kv.pages_per_seq;
        let mut rng = Rng::new(80 + pi as u64);
        let table = shuffled_tables(&mut rng, seqs, kv.pages_per_seq, kv.pages);
        let page_table: Vec<i32> = table.into_iter().flatten().collect();
        let (positions, token_seq): (Vec<i32>, Vec<i32>) = if long && decode {
            // past one block's 24,576 positions (in chunks, the last one shorter), at it (one
            // block), within top-k
            let pos = [32767, 24576, 24575, 5, 30000];
            (0..t).map(|s| (pos[s % pos.len()], s as i32)).unzip()
        } else if decode {
            // sequence s beyond top-k (every third one within it), the last token padding
            let pos = |s: usize| if s % 3 == 1 { 5 + s as i32 % 11 } else { (300 + 97 * s as i32) % kv.max_context as i32 };
            (0..t).map(|s| if s + 1 == t && t > 1 { (0, -1) } else { (pos(s), s as i32) }).unzip()
        } else {
            // one sequence's chunk after a 200-token prefix, the last 3 tokens padding
            (0..t).map(|i| if i + 3 >= t { (0, -1) } else { (200 + i as i32, 0) }).unzip()
        };
        let row = kv.row_elems();
        let keys: Vec<f32> = (0..kv.pages * kv.page_size * row).map(|_| round_bf16(rng.normal() as f32)).collect();
        let mut cache = Cache::new(&kv);
        cache.set_layer_bytes(0, &bf16_bytes(&keys));
        let qv: Vec<f32> = (0..t * hd).map(|_| round_bf16(rng.normal() as f32)).collect();
        let wv: Vec<f32> = (0..t * heads).map(|_| (rng.normal() * 0.5) as f32).collect();
        let slots = vec![-1; t];
        let inputs = TokenInputs { positions: &positions, token_seq: &token_seq, slots: &slots, page_table: &page_table, pages_per_seq: kv.pages_per_seq };
        let mut want = vec![0i32; t * topk];
        reference::indexer_topk(&qv, &wv, heads, &inputs, &cache, 0, &rope, topk, &mut want);

        let mut g = GlobalMemory::new();
        let words = |v: &[i32]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
        let dtype = |b| program.buffer(b).dtype;
        let bq = if dtype(q) == DType::BF16 { g.alloc_bytes("q", &bf16_bytes(&qv)) } else { g.alloc_f32("q", &qv) };
        let bw = if dtype(head_weights) == DType::BF16 { g.alloc_bytes("w", &bf16_bytes(&wv)) } else { g.alloc_f32("w", &wv) };
        let bp = g.alloc_bytes("positions", &words(&positions));
        let bs = g.alloc_bytes("token_seq", &words(&token_seq));
        let bt = g.alloc_bytes("page_table", &words(&page_table));
        let bk = g.alloc_bytes("kv", &cache.layer_bytes(0));
        let br = g.alloc_f32("rope", &rope.table(kv.max_context));
        let bo = g.alloc("out", t * topk * 4);
        // the pattern no score takes (0.0 is a score), so an unwritten score would show
        let bsc = g.alloc_bytes("scores", &vec![0x5Au8; program.buffer(scores).bytes.max(4) as usize]);
        let bcn = g.alloc("split_k", t * 4);
        let ins = &program.inputs;
        for l in &step.launches {
            let k = &plan.kernels[l.kernel.0 as usize];
            assert_eq!(k.family, KernelFamily::IndexerTopK);
            let args: Vec<KernelArg> = l
                .args
                .iter()
                .map(|a| match *a {
                    LaunchArg::Buffer(b) if b == q => KernelArg::U64(g.addr(bq)),
                    LaunchArg::Buffer(b) if b == head_weights => KernelArg::U64(g.addr(bw)),
                    LaunchArg::Buffer(b) if b == ins.positions => KernelArg::U64(g.addr(bp)),
                    LaunchArg::Buffer(b) if b == ins.token_seq => KernelArg::U64(g.addr(bs)),
                    LaunchArg::Buffer(b) if b == ins.page_table => KernelArg::U64(g.addr(bt)),
                    LaunchArg::Buffer(b) if b == out => KernelArg::U64(g.addr(bo)),
                    LaunchArg::Buffer(b) if b == scores => KernelArg::U64(g.addr(bsc)),
                    LaunchArg::KvCache { layer: la } if la as usize == layer => KernelArg::U64(g.addr(bk)),
                    LaunchArg::RopeTable => KernelArg::U64(g.addr(br)),
                    LaunchArg::SplitKRegion => KernelArg::U64(g.addr(bcn)),
                    LaunchArg::F32(v) => KernelArg::F32(v),
                    // (a plan of one rank: rank 0's)
                    LaunchArg::PerRank(_) => KernelArg::U32(0),
                    ref other => panic!("unexpected argument {other:?} of {}", k.name),
                })
                .collect();
            let module = Module::parse(&k.ptx, &k.name).unwrap();
            launch(&module, &k.entry, l.grid, l.block, l.smem_dynamic, &args, &mut g).unwrap();
        }
        let got: Vec<i32> = g.read(bo).chunks_exact(4).map(|b| i32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect();
        assert_eq!(got, want, "{}: planned launches vs CPU", program.name);
        assert!(g.read(bcn).iter().all(|&b| b == 0), "{}: a chunk counter is not back at zero", program.name);
        eprintln!("{}: planned indexer top-{topk} launch over {t} tokens ({chunks} selecting blocks each) identical to the CPU", program.name);
        checked += 1;
    }
    assert!(checked >= 2, "checked {checked} programs");
    let _ = std::fs::remove_dir_all(&dir);
}
