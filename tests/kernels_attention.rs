//! The MLA attention template (absorbed form over the paged latent cache) against the CPU
//! reference in both forms: tiny-model geometry, dense (causal) and sparse (top-k rows with -1
//! and future entries, sequences shorter and longer than k), pages out of order and unassigned,
//! padding tokens, 1 / 3 / 17 tokens, every head grouping and several staging chunks, and one
//! GLM-5 tp8 rank's geometry (k = 2048). Every launch reads at most 1.10x its compulsory bytes
//! (kv_b, q and the selected latent rows per block). The GLM-5 tp8 instances assemble with ptxas
//! for sm_120a without spills inside 255 registers and 101 376 B of shared memory.

mod common;
use common::{bytes, floats, randn};
use kiln_compiler::kernels::{LinearBf16GemmParams, MlaAttentionParams, MlaSplitParams};
use kiln_compiler::passes::lower::{output_gemm, token_pairs, SMEM_LIMIT};
use kiln_runtime::cpu::reference::{self, Cache, MlaGeometry, TokenInputs};
use kiln_runtime::cpu::rope::Rope;
use kiln_runtime::emu::{launch, GlobalMemory, KernelArg, LaunchStats, Module};
use kiln_runtime::numerics::f32_to_bf16;
use kiln_runtime::plan::{AttentionForm, DType, KvLayout, SplitKLayout};
use kiln_runtime::rng::Rng;
use kiln_runtime::verify::{compare, Values};

/// Tiny-model attention geometry (per rank: `heads` local heads).
struct Geo {
    heads: usize,
    nope: usize,
    rope: usize,
    v: usize,
    latent: usize,
    index: usize,
}

const TINY: Geo = Geo { heads: 8, nope: 32, rope: 16, v: 32, latent: 64, index: 32 };

struct Case {
    geo: Geo,
    hg: usize,
    /// Threads per block (lowering: 512 for groups of at most 2 heads, else 256).
    threads: u32,
    /// Slices of the nope rows for q_abs (lowering: as many as keep the threads busy).
    qs: usize,
    /// Scores on tensor cores where the geometry allows (lowering: always).
    mma: bool,
    tokens: usize,
    /// Width of the top-k rows; 0: dense causal attention.
    topk: usize,
    chunk: usize,
    page_size: usize,
    /// Sequence lengths (tokens sit at positions below them).
    seqs: Vec<usize>,
    /// Every this-many-th token is padding (0: none).
    pad_every: usize,
    /// Rows of the RoPE table; pages per sequence = this / page_size.
    max_context: usize,
    q_bf16: bool,
    out_bf16: bool,
    scale: f32,
    /// 0: the fused launch; else split-KV decode in this many splits of the top-k row (absorb,
    /// split states, combine, output projection).
    splits: usize,
    /// A prefill chunk: the tokens at consecutive positions of sequence 0 from this one (padding
    /// every `pad_every`-th), with top-k rows as the indexer writes them (every position up to
    /// the token's while they fit, else a random `topk` of them; ascending, then -1). The split
    /// states are also computed a block per two tokens (`TT` = 2, lowering's instance: the case
    /// must have one split and an even number of tokens) and must equal the block-per-token ones
    /// bit for bit.
    prefill_from: Option<usize>,
}

fn below(rng: &mut Rng, n: usize) -> usize {
    (rng.next_u64() % n.max(1) as u64) as usize
}

fn check(what: &str, bf16: bool, emu: &[f32], cpu: &[f32]) {
    let c = compare(if bf16 { DType::BF16 } else { DType::F32 }, &Values::F32(emu.to_vec()), &Values::F32(cpu.to_vec()));
    // Stricter than the tolerance: BF16 results at least 2^-8 of the largest differ from the
    // CPU's by at most one rounding step. (Both sides' f32 sums over 512-wide dot products carry
    // rounding errors of ~1e-6 of the largest output, a few ulps of much smaller values.)
    let ulps = |a: f32, b: f32| {
        let key = |v: f32| {
            let u = f32_to_bf16(v) as i32;
            if u & 0x8000 != 0 { -(u & 0x7fff) } else { u }
        };
        (key(a) - key(b)).abs()
    };
    let (off, max_ulps) = if bf16 {
        let max = cpu.iter().fold(0f32, |m, v| m.max(v.abs()));
        let d: Vec<i32> = emu.iter().zip(cpu).filter(|(_, b)| b.abs() >= max / 256.0).map(|(&a, &b)| ulps(a, b)).collect();
        (d.iter().filter(|&&u| u > 0).count(), d.into_iter().max().unwrap_or(0))
    } else {
        (0, 0)
    };
    eprintln!("{what}: max abs {:.3e}, max rel {:.3e} over {} values ({off} one BF16 ulp off)", c.max_abs, c.max_rel, c.elements);
    assert!(max_ulps <= 1, "{what}: BF16 values up to {max_ulps} ulps apart");
    assert!(c.ok(), "{what}: {} of {} values beyond tolerance (max abs {:e}, max rel {:e})", c.beyond + c.non_finite, c.elements, c.max_abs, c.max_rel);
}

/// Runs one case on the emulator; compares with the CPU in both forms. Returns the stats and the
/// output (for determinism checks).
fn run(c: &Case, seed: u64) -> (LaunchStats, Vec<u8>) {
    let g = &c.geo;
    let mut rng = Rng::new(seed);
    let qk = g.nope + g.rope;
    let max_context = c.max_context;
    let pages_per_seq = max_context / c.page_size;
    let pages = c.seqs.len() * pages_per_seq + 3;
    let row = g.latent + g.rope + g.index;
    let kv = KvLayout {
        dtype: DType::BF16,
        layers: 2,
        latent_dim: g.latent,
        rope_dim: g.rope,
        index_dim: g.index,
        page_size: c.page_size,
        pages,
        bytes_per_token: (2 * row * 2) as u64,
        max_seqs: c.seqs.len(),
        pages_per_seq,
        max_context,
        index_keys: Default::default(),
    };
    let layer = 1;
    let mut cache = Cache::new(&kv);
    let slots = pages * c.page_size;
    let cache_vals = randn(&mut rng, slots * row, 1.0, true);
    cache.set_layer_bytes(layer, &bytes(&cache_vals, true));
    let cache_bytes = cache.layer_bytes(layer);

    // Page table: each sequence's pages from a shuffled pool (out of order); pages past its
    // length unassigned, and one hole (-1) inside the longest sequence.
    let mut pool: Vec<i32> = (0..pages as i32).collect();
    for i in (1..pool.len()).rev() {
        pool.swap(i, below(&mut rng, i + 1));
    }
    let mut page_table = vec![-1i32; c.seqs.len() * pages_per_seq];
    let mut next = 0;
    for (s, &len) in c.seqs.iter().enumerate() {
        for p in 0..len.div_ceil(c.page_size) {
            page_table[s * pages_per_seq + p] = pool[next];
            next += 1;
        }
    }
    let longest = (0..c.seqs.len()).max_by_key(|&s| c.seqs[s]).unwrap();
    if c.seqs[longest] > 2 * c.page_size {
        page_table[longest * pages_per_seq + 1] = -1;
    }

    // Tokens: random sequence and position (padding every `pad_every`-th).
    let mut token_seq = vec![0i32; c.tokens];
    let mut positions = vec![0i32; c.tokens];
    for t in 0..c.tokens {
        if c.pad_every > 0 && t % c.pad_every == c.pad_every - 1 {
            token_seq[t] = -1;
            positions[t] = below(&mut rng, max_context) as i32;
            continue;
        }
        let s = below(&mut rng, c.seqs.len());
        token_seq[t] = s as i32;
        positions[t] = below(&mut rng, c.seqs[s]) as i32;
        if let Some(start) = c.prefill_from {
            (token_seq[t], positions[t]) = (0, (start + t) as i32);
        }
    }
    let slots_in = vec![-1i32; c.tokens];

    // Top-k rows: distinct causal positions in random order, then -1; one future position and
    // one -1 in the middle of every row that has room (both must be skipped).
    let mut ids = vec![-1i32; c.tokens * c.topk.max(1)];
    if c.topk > 0 && c.prefill_from.is_some() {
        for t in 0..c.tokens {
            let n = positions[t].max(0) as usize + 1;
            let mut cand: Vec<i32> = (0..n as i32).collect();
            for i in (1..cand.len()).rev() {
                cand.swap(i, below(&mut rng, i + 1));
            }
            let mut chosen = cand[..n.min(c.topk)].to_vec();
            chosen.sort_unstable();
            ids[t * c.topk..][..chosen.len()].copy_from_slice(&chosen);
        }
    } else if c.topk > 0 {
        for t in 0..c.tokens {
            let pos = positions[t].max(0) as usize;
            let mut cand: Vec<i32> = (0..=pos as i32).collect();
            for i in (1..cand.len()).rev() {
                cand.swap(i, below(&mut rng, i + 1));
            }
            let row = &mut ids[t * c.topk..(t + 1) * c.topk];
            for (r, &j) in row.iter_mut().zip(&cand) {
                *r = j;
            }
            if c.topk > 4 {
                let a = below(&mut rng, c.topk);
                row[a] = pos as i32 + 1 + below(&mut rng, 5) as i32;
                let b = below(&mut rng, c.topk);
                row[b] = -1;
            }
            if t == 1 {
                // No selected position at all: zeros.
                row.fill(-1);
            }
        }
    }

    let q = randn(&mut rng, c.tokens * g.heads * qk, 1.0, c.q_bf16);
    let kv_b = randn(&mut rng, g.heads * (g.nope + g.v) * g.latent, 0.15, true);
    let kv_b_bytes = bytes(&kv_b, true);
    let rope = Rope::new(g.rope, 10000.0);
    let table = rope.table(max_context);

    let inputs = TokenInputs { positions: &positions, token_seq: &token_seq, slots: &slots_in, page_table: &page_table, pages_per_seq };
    let sel = (c.topk > 0).then_some((&ids[..], c.topk));

    let layout = mma_layout(g, c.hg, c.threads, c.qs, c.mma, c.out_bf16);
    let params = MlaAttentionParams {
        arch: 120,
        heads: g.heads as u32,
        hg: c.hg as u32,
        nope: g.nope as u32,
        rope: g.rope as u32,
        v: g.v as u32,
        latent: g.latent as u32,
        nl: g.latent.div_ceil(128) as u32,
        qs: c.qs as u32,
        mma: layout.0,
        qbs: layout.1,
        xs: layout.2,
        row: row as u32,
        page: c.page_size as u32,
        pps: pages_per_seq as u32,
        slots: slots as u32,
        max_pos: max_context as u32,
        topk: c.topk as u32,
        chunk: c.chunk as u32,
        threads: c.threads,
        q_bf16: c.q_bf16 as u32,
        out_bf16: c.out_bf16 as u32,
        mode: 0,
        splits: 1,
        split: c.topk as u32,
        stage: 0,
        coop: 0,
        tt: 1,
    };
    let mut gm = GlobalMemory::new();
    let bq = gm.alloc_bytes("q", &bytes(&q, c.q_bf16));
    let bw = gm.alloc_bytes("kv_b", &kv_b_bytes);
    let bt = gm.alloc_bytes("topk", &ids.iter().flat_map(|v| v.to_le_bytes()).collect::<Vec<u8>>());
    let i32s = |v: &[i32]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
    let bp = gm.alloc_bytes("positions", &i32s(&positions));
    let bs = gm.alloc_bytes("token_seq", &i32s(&token_seq));
    let bpt = gm.alloc_bytes("page_table", &i32s(&page_table));
    let bc = gm.alloc_bytes("cache", &cache_bytes);
    let br = gm.alloc_f32("rope", &table);
    let osize = if c.out_bf16 { 2 } else { 4 };
    // Poison the output: every value must be written (padding included).
    let bo = gm.alloc_bytes("out", &vec![0xFF; c.tokens * g.heads * g.v * osize]);
    // Split scratch, poisoned: every value read must have been written by an earlier launch.
    let nl = g.latent.div_ceil(128);
    let ba = gm.alloc_bytes("absorbed", &vec![0xFF; c.tokens.max(1) * g.heads * g.latent * 4]);
    let bpa = gm.alloc_bytes("partials", &vec![0xFF; c.tokens.max(1) * c.splits.max(1) * g.heads * (g.latent + 4) * 4]);
    let mut args: Vec<KernelArg> = [bq, bw, bt, bp, bs, bpt, bc, br, bo, ba, bpa].iter().map(|&b| KernelArg::U64(gm.addr(b))).collect();
    args.push(KernelArg::F32(c.scale));
    let (mut cache_read, mut staged_read, mut combined, mut coop_out, mut gemm_out) = (0u64, Vec::new(), Vec::new(), None, None);
    let mut pair_read: Vec<(u32, u64)> = Vec::new();
    // the most 128-dim latent chunks of every warp's tile the q_abs | ctx region holds (lowering's STAGE)
    let fits = |threads: u32, mma: u32| if mma == 1 { (c.hg * nl * 1024 / ((threads as usize / 32) * 16 * 256)).min(nl) } else { 0 };
    let stats = if c.splits == 0 {
        let module = Module::parse(&params.render().unwrap(), "mla_attention.ptx").unwrap();
        let grid = [(g.heads / c.hg) as u32, c.tokens as u32, 1];
        let stats = launch(&module, MlaAttentionParams::ENTRY, grid, [c.threads, 1, 1], params.dynamic_smem().unwrap(), &args, &mut gm).unwrap();
        // the one-launch form with staged chunks: the same output bit for bit
        let unstaged = gm.read(bo);
        for stage in 1..=fits(c.threads, layout.0) {
            gm.write(bo, 0, &vec![0xFF; unstaged.len()]);
            let staged = MlaAttentionParams { stage: stage as u32, ..params };
            let m = Module::parse(&staged.render().unwrap(), "mla_attention.ptx").unwrap();
            launch(&m, MlaAttentionParams::ENTRY, grid, [c.threads, 1, 1], staged.dynamic_smem().unwrap(), &args, &mut gm).unwrap();
            assert!(gm.read(bo) == unstaged, "the output with {stage} staged chunks differs from the unstaged one");
        }
        stats
    } else {
        // The lowering's split instance: entries per split, a warp per 16-entry tile (2..8 warps).
        let per = c.topk.div_ceil(c.splits);
        assert_eq!(c.topk.div_ceil(per), c.splits, "every split must be non-empty");
        let threads = (32 * per.div_ceil(16).clamp(2, 8)) as u32;
        let layout = mma_layout(g, c.hg, threads, c.qs, c.mma, c.out_bf16);
        let split = MlaAttentionParams {
            mode: 1,
            splits: c.splits as u32,
            split: per as u32,
            threads,
            chunk: (per.div_ceil(threads as usize) * threads as usize).min(2048) as u32,
            mma: layout.0,
            qbs: layout.1,
            xs: layout.2,
            ..params
        };
        let rpw = if c.tokens <= 4 { 1 } else if c.tokens <= 16 { 2 } else { 4 };
        let rpw = [rpw, 2, 1].into_iter().find(|r| *r <= rpw && g.v % (8 * r) == 0).unwrap();
        let helper = |mode: u32, dpl: u32, ds: u32| MlaSplitParams {
            arch: 120,
            heads: g.heads as u32,
            nope: g.nope as u32,
            rope: g.rope as u32,
            v: g.v as u32,
            latent: g.latent as u32,
            nl: nl as u32,
            tokens: c.tokens as u32,
            splits: c.splits as u32,
            rpw: if mode == 2 { rpw as u32 } else { 1 },
            tg: c.tokens as u32,
            dpl,
            threads: if mode == 1 { 32 } else { 256 },
            ds,
            partials: if mode == 3 { SplitKLayout::PARTIALS as u32 } else { 0 },
            mode,
            q_bf16: c.q_bf16 as u32,
            out_bf16: c.out_bf16 as u32,
        };
        // the rank's split-K region (zeroed, as the runtime allocates it), for MODE 3
        let bk = gm.alloc_bytes("split_k", &vec![0; SplitKLayout::BYTES as usize]);
        let hargs: Vec<KernelArg> = [bq, bw, ba, bpa, bo, bk].iter().map(|&b| KernelArg::U64(gm.addr(b))).collect();
        let run_helper = |mode: u32, dpl: u32, ds: u32, grid: [u32; 3], gm: &mut GlobalMemory| {
            let h = helper(mode, dpl, ds);
            let m = Module::parse(&h.render().unwrap(), "mla_split.ptx").unwrap();
            launch(&m, MlaSplitParams::ENTRY, grid, [h.threads, 1, 1], h.dynamic_smem().unwrap(), &hargs, gm).unwrap()
        };
        run_helper(0, 4, 0, [g.heads as u32, (g.latent / 32) as u32, 1], &mut gm);
        let module = Module::parse(&split.render().unwrap(), "mla_attention.ptx").unwrap();
        let grid = [(g.heads / c.hg) as u32, c.tokens as u32, c.splits as u32];
        let stats = launch(&module, MlaAttentionParams::ENTRY, grid, [threads, 1, 1], split.dynamic_smem().unwrap(), &args, &mut gm).unwrap();
        cache_read = gm.bytes_loaded(bc);
        // STAGE (the tensor-core path): every number of 128-dim latent chunks whose rows fit the
        // q_abs | ctx region for all warps (as lowering takes the most) gives the same partial
        // states bit for bit, and the context reads only the dims not kept from the cache again
        let unstaged = gm.read(bpa);
        for stage in 1..=fits(threads, layout.0) {
            gm.write(bpa, 0, &vec![0xFF; unstaged.len()]);
            let before = gm.bytes_loaded(bc);
            let staged = MlaAttentionParams { stage: stage as u32, ..split };
            let m = Module::parse(&staged.render().unwrap(), "mla_attention.ptx").unwrap();
            launch(&m, MlaAttentionParams::ENTRY, grid, [threads, 1, 1], staged.dynamic_smem().unwrap(), &args, &mut gm).unwrap();
            assert!(gm.read(bpa) == unstaged, "the split states with {stage} staged chunks differ from the unstaged ones");
            staged_read.push((stage, gm.bytes_loaded(bc) - before));
        }
        // COOP (tensor-core path): the block's warps take each tile together, each its share of
        // the dims, so every selected row is read once; its states (the same sums in another
        // order) go through the combine and output projection below to the CPU check
        let coop_states = coop_warps(g.latent, c.hg, nl).filter(|_| layout.0 == 1).map(|w| {
            let threads = 32 * w as u32;
            let coop = MlaAttentionParams {
                coop: 1,
                stage: 0,
                threads,
                chunk: (per.div_ceil(threads as usize) * threads as usize).min(2048) as u32,
                xs: mma_layout(g, c.hg, threads, c.qs, c.mma, c.out_bf16).2,
                ..split
            };
            gm.write(bpa, 0, &vec![0xFF; unstaged.len()]);
            let before = gm.bytes_loaded(bc);
            let m = Module::parse(&coop.render().unwrap(), "mla_attention.ptx").unwrap();
            launch(&m, MlaAttentionParams::ENTRY, grid, [threads, 1, 1], coop.dynamic_smem().unwrap(), &args, &mut gm).unwrap();
            let states = (gm.read(bpa), gm.bytes_loaded(bc) - before, w);
            // a block per two tokens (prefill), with one staging round and with rounds of a block's
            // threads: the same states bit for bit, each row of a pair below `topk` loaded once
            if c.prefill_from.is_some() {
                // lowering's instance (its rounds as large as shared memory allows), then rounds of
                // one block's threads
                let lowered = token_pairs(coop, c.tokens, true, SMEM_LIMIT).unwrap().expect("a prefill case takes a block per two tokens");
                for chunk in [lowered.chunk, threads] {
                    let pair = MlaAttentionParams { chunk, ..lowered };
                    gm.write(bpa, 0, &vec![0xFF; unstaged.len()]);
                    let before = gm.bytes_loaded(bc);
                    let m = Module::parse(&pair.render().unwrap(), "mla_attention.ptx").unwrap();
                    let pgrid = [grid[0], grid[1] / 2, grid[2]];
                    launch(&m, MlaAttentionParams::ENTRY, pgrid, [threads, 1, 1], pair.dynamic_smem().unwrap(), &args, &mut gm).unwrap();
                    assert!(gm.read(bpa) == states.0, "a block per two tokens (chunk {chunk}) wrote other states than a block per token");
                    pair_read.push((chunk, gm.bytes_loaded(bc) - before));
                }
            }
            gm.write(bpa, 0, &unstaged);
            states
        });
        // the combine with 1 and 2 latent dims per lane (more blocks, as small batches get) writes
        // the 4-dim context bit for bit: every dim's sum is the same
        let combine = |dpl: usize, gm: &mut GlobalMemory| {
            run_helper(1, dpl as u32, 0, [(g.heads * g.latent.div_ceil(32 * dpl)) as u32, c.tokens as u32, 1], gm);
            gm.read(ba)
        };
        let (narrow, two) = (combine(1, &mut gm), combine(2, &mut gm));
        let ctx = combine(4, &mut gm);
        assert!(narrow == ctx && two == ctx, "the combine with 1 or 2 dims per lane differs from 4");
        // MODE 3 (combine and output in one launch) with every slice width that divides the
        // latent, run twice: the same output both times (its head counters are back at zero)
        let partials = gm.read(bpa);
        let w_uv = (g.heads * g.v * g.latent * 2) as u64;
        for ds in [16usize, 32, 64].into_iter().filter(|ds| g.latent % ds == 0) {
            let mut runs = Vec::new();
            for _ in 0..2 {
                gm.write(bo, 0, &vec![0xFF; c.tokens * g.heads * g.v * osize]);
                let before = gm.bytes_loaded(bw);
                run_helper(3, 4, ds as u32, [(g.heads * g.latent / ds) as u32, 1, 1], &mut gm);
                assert_eq!(gm.bytes_loaded(bw) - before, w_uv, "MODE 3 ({ds} dims per block) reads W_UV once");
                runs.push(gm.read(bo));
            }
            assert!(runs[0] == runs[1], "MODE 3 ({ds} dims per block) differs between two launches");
            assert!(gm.read(bk)[..4 * g.heads].iter().all(|&b| b == 0), "MODE 3 left a head counter non-zero");
            assert!(gm.read(bpa) == partials, "MODE 3 wrote the split states");
            combined.push((ds, floats(&runs[0], c.out_bf16)));
        }
        // the COOP states through the combine and output projection in one launch
        let ds = [16usize, 32, 64].into_iter().find(|ds| g.latent % ds == 0).unwrap();
        if let Some((states, read, warps)) = &coop_states {
            gm.write(bpa, 0, states);
            gm.write(bo, 0, &vec![0xFF; c.tokens * g.heads * g.v * osize]);
            run_helper(3, 4, ds as u32, [(g.heads * g.latent / ds) as u32, 1, 1], &mut gm);
            coop_out = Some((*read, *warps, floats(&gm.read(bo), c.out_bf16)));
            gm.write(bpa, 0, &partials);
        }
        // the output launch in token groups (grid y; groups of 2 leave a ragged last group of
        // the 3-token cases): the same bits as one group, W_UV read once per group
        let mut grouped = Vec::new();
        for tg in [1usize, 2].into_iter().filter(|&tg| tg < c.tokens) {
            gm.write(bo, 0, &vec![0xFF; c.tokens * g.heads * g.v * osize]);
            let before = gm.bytes_loaded(bw);
            let h = MlaSplitParams { tg: tg as u32, ..helper(2, 4, 0) };
            let m = Module::parse(&h.render().unwrap(), "mla_split.ptx").unwrap();
            let grid = [(g.heads * g.v / (8 * rpw)) as u32, c.tokens.div_ceil(tg) as u32, 1];
            launch(&m, MlaSplitParams::ENTRY, grid, [h.threads, 1, 1], h.dynamic_smem().unwrap(), &hargs, &mut gm).unwrap();
            assert_eq!(gm.bytes_loaded(bw) - before, w_uv * c.tokens.div_ceil(tg) as u64, "the output launch in groups of {tg} tokens reads W_UV once per group");
            grouped.push((tg, gm.read(bo)));
        }
        gm.write(bo, 0, &vec![0xFF; c.tokens * g.heads * g.v * osize]);
        run_helper(2, 4, 0, [(g.heads * g.v / (8 * rpw)) as u32, 1, 1], &mut gm);
        for (tg, out) in &grouped {
            assert!(*out == gm.read(bo), "the output launch in groups of {tg} tokens differs from one group of {}", c.tokens);
        }
        // kv_b is read once per step (W_UK by the absorb launch, W_UV by the output launch)
        let w_uv_runs = 2 * combined.len() as u64 + coop_out.is_some() as u64 + grouped.iter().map(|(tg, _)| c.tokens.div_ceil(*tg) as u64).sum::<u64>();
        assert_eq!(gm.bytes_loaded(bw) - w_uv * w_uv_runs, kv_b_bytes.len() as u64, "kv_b bytes read");
        // the output projection as the batched tensor-core GEMM prefill chunks take (a head per
        // grid.z over the contexts the combine left in `absorbed`), lowering's instance
        if g.latent % 8 == 0 && g.nope % 8 == 0 {
            let mode2 = gm.read(bo);
            gm.write(bo, 0, &vec![0xFF; mode2.len()]);
            let (p, grid) = output_gemm(120, c.tokens, g.heads, g.nope, g.v, g.latent, c.out_bf16 as u32, SMEM_LIMIT).unwrap();
            let m = Module::parse(&p.render().unwrap(), "linear_bf16_gemm.ptx").unwrap();
            let mut gargs: Vec<KernelArg> = [ba, bw, bo, bw, bw, bw, bo, bo, bo, bo, bw].iter().map(|&b| KernelArg::U64(gm.addr(b))).collect();
            gargs.push(KernelArg::F32(0.0));
            launch(&m, LinearBf16GemmParams::ENTRY, grid, [256, 1, 1], p.dynamic_smem().unwrap(), &gargs, &mut gm).unwrap();
            gemm_out = Some(floats(&gm.read(bo), c.out_bf16));
            gm.write(bo, 0, &mode2);
        }
        stats
    };
    let out = gm.read(bo);
    let got = floats(&out, c.out_bf16);

    // Compulsory global reads of every block of an active token: its heads' kv_b rows and q, and
    // the latent + rope key of every selected position that resolves to a slot. Anything beyond
    // is the top-k row, page-table entries and the RoPE row (a few bytes per position).
    let groups = g.heads / c.hg;
    let mut compulsory = 0usize;
    let mut selected_rows = 0usize;
    for t in (0..c.tokens).filter(|&t| token_seq[t] >= 0) {
        let pos = positions[t] as usize;
        let row_pages = &page_table[token_seq[t] as usize * pages_per_seq..][..pages_per_seq];
        let resolves = |j: usize| j <= pos && row_pages.get(j / c.page_size).is_some_and(|&p| p >= 0);
        let rows = if c.topk > 0 {
            ids[t * c.topk..(t + 1) * c.topk].iter().filter(|&&j| j >= 0 && resolves(j as usize)).count()
        } else {
            (0..=pos).filter(|&j| resolves(j)).count()
        };
        selected_rows += rows;
        compulsory += kv_b_bytes.len() + g.heads * qk * if c.q_bf16 { 2 } else { 4 } + groups * rows * (g.latent + g.rope) * 2;
    }
    if std::env::var_os("KILN_ATTN_BYTES").is_some() {
        for (n, b) in [("q", bq), ("kv_b", bw), ("topk", bt), ("positions", bp), ("token_seq", bs), ("page_table", bpt), ("cache", bc), ("rope", br)] {
            eprintln!("  {n}: {} B", gm.bytes_loaded(b));
        }
    }
    // The tensor-core path reads a tile's rows twice: in fragment layout for the scores, then per
    // lane's dims for the context (on the GPU the second read hits L1: the warp just loaded them).
    let bound = if layout.0 == 1 { 1.25 } else { 1.10 };
    if c.splits == 0 {
        let ratio = stats.global_bytes_read() as f64 / compulsory.max(1) as f64;
        eprintln!("T={} hg={} mma={} topk={}: {} B read / {compulsory} B compulsory = {ratio:.3}", c.tokens, c.hg, layout.0, c.topk, stats.global_bytes_read());
        assert!((1.0..=bound).contains(&ratio), "global bytes read / compulsory = {ratio}");
    } else {
        // split: each head group reads every selected row once, across all its splits
        // split: each head group reads every selected row once over all its splits (the
        // tensor-core path: latent | rope for the scores, the latent again for the context)
        let want = groups * selected_rows * (g.latent + g.rope) * 2;
        let ratio = cache_read as f64 / want.max(1) as f64;
        eprintln!("T={} hg={} splits={} topk={}: cache {cache_read} B read / {want} B compulsory = {ratio:.3}; staged: {staged_read:?} B", c.tokens, c.hg, c.splits, c.topk);
        for &(stage, b) in &staged_read {
            let again = g.latent.saturating_sub(128 * stage);
            assert_eq!(b as usize, want + groups * selected_rows * again * 2, "cache bytes read with {stage} staged chunks");
        }
        if let Some((read, warps, _)) = &coop_out {
            assert_eq!(*read as usize, want, "cache bytes read by {warps} warps taking each tile together");
        }
        // a block per two tokens: a pair of one sequence below `topk` reads the later token's
        // rows once for both, any other pair each token's rows
        let rows_of = |t: usize| {
            let row_pages = &page_table[token_seq[t].max(0) as usize * pages_per_seq..][..pages_per_seq];
            let pos = positions[t] as usize;
            ids[t * c.topk..(t + 1) * c.topk].iter().filter(|&&j| j >= 0 && j as usize <= pos && row_pages.get(j as usize / c.page_size).is_some_and(|&p| p >= 0)).count()
        };
        let active = |t: usize| token_seq[t] >= 0;
        let pair_rows: usize = (0..c.tokens / 2)
            .map(|b| {
                let (t0, t1) = (2 * b, 2 * b + 1);
                let dense = active(t0) && token_seq[t1] == token_seq[t0] && (positions[t0] as usize) < c.topk && (positions[t1] as usize) < c.topk;
                if dense { rows_of(t0).max(rows_of(t1)) } else { [t0, t1].into_iter().filter(|&t| active(t)).map(rows_of).sum() }
            })
            .sum();
        for &(chunk, read) in &pair_read {
            assert_eq!(read as usize, groups * pair_rows * (g.latent + g.rope) * 2, "cache bytes read a block per two tokens (chunk {chunk})");
        }
        if !pair_read.is_empty() {
            eprintln!("a block per two tokens: {pair_rows} rows of {selected_rows}");
        }
        let mma_rows = (2 * g.latent + g.rope) as f64 / (g.latent + g.rope) as f64;
        assert!(want > 0 && (1.0..=if layout.0 == 1 { mma_rows } else { 1.0 }).contains(&ratio), "cache bytes read / compulsory = {ratio}");
    }

    let what = format!(
        "mla attention T={} heads={} hg={} threads={} mma={} topk={} chunk={} page={} q_bf16={} out_bf16={} splits={}",
        c.tokens, g.heads, c.hg, c.threads, layout.0, c.topk, c.chunk, c.page_size, c.q_bf16, c.out_bf16, c.splits
    );
    for form in [AttentionForm::Absorbed, AttentionForm::Expanded] {
        let geo = MlaGeometry { heads: g.heads, nope: g.nope, rope_dim: g.rope, v_dim: g.v, latent: g.latent, scale: c.scale, kv_b: &kv_b_bytes, form };
        let mut want = vec![0f32; c.tokens * g.heads * g.v];
        reference::mla_attention(&q, sel, &inputs, &cache, layer, &geo, &rope, c.out_bf16, &mut want);
        check(&format!("{what} vs CPU {form:?}"), c.out_bf16, &got, &want);
        for (ds, got) in &combined {
            check(&format!("{what}, combine and output in one launch ({ds} dims per block), vs CPU {form:?}"), c.out_bf16, got, &want);
        }
        if let Some((_, warps, got)) = &coop_out {
            check(&format!("{what}, {warps} warps taking each tile together, vs CPU {form:?}"), c.out_bf16, got, &want);
        }
        if let Some(got) = &gemm_out {
            check(&format!("{what}, output projection as the batched GEMM, vs CPU {form:?}"), c.out_bf16, got, &want);
        }
        // Padding tokens are zeros; active tokens attend to something (a row whose only position
        // became -1 legitimately gives zeros, on both sides), so nothing passes trivially.
        let mut live = 0;
        for t in 0..c.tokens {
            let o = &got[t * g.heads * g.v..(t + 1) * g.heads * g.v];
            if token_seq[t] < 0 {
                assert!(o.iter().all(|&v| v == 0.0), "padding token {t} is not zero");
            } else if want[t * g.heads * g.v..(t + 1) * g.heads * g.v].iter().any(|&v| v != 0.0) {
                live += 1;
            }
        }
        assert!(live > 0 && live + c.tokens / 3 >= c.tokens - token_seq.iter().filter(|&&s| s < 0).count(), "{live} live tokens of {}", c.tokens);
    }
    (stats, out)
}

/// The lowering's tensor-core choice and scratch layout (compiler/src/passes/lower/attention.rs):
/// (MMA, QBS, XS).
fn mma_layout(g: &Geo, hg: usize, threads: u32, qs: usize, mma: bool, out_bf16: bool) -> (u32, u32, u32) {
    let row = g.latent + g.rope + g.index;
    let mma = mma && hg == 8 && g.latent % 64 == 0 && g.rope % 16 == 0 && row % 8 == 0 && out_bf16;
    let qbs = if mma { ((g.latent + g.rope) * 2).div_ceil(128) * 128 + 64 } else { 0 };
    let nl = g.latent.div_ceil(128);
    let xs = (qs * hg * nl * 512).max(mma as usize * (3 * hg * qbs + threads as usize / 32 * 576));
    (mma as u32, qbs as u32, xs as u32)
}

/// The lowering's warps for tiles taken together (compiler/src/passes/lower/attention.rs).
fn coop_warps(latent: usize, hg: usize, nl: usize) -> Option<usize> {
    (1..=8).rev().find(|&w| latent % (32 * w) == 0 && matches!(latent / w, 32 | 64) && 2 * w * 512 <= hg * nl * 512)
}

/// The lowering's choice of q_abs slices (compiler/src/passes/lower/attention.rs).
fn q_slices(nope: usize, hg: usize, nl: usize, threads: u32) -> usize {
    [8, 4, 2, 1].into_iter().find(|&s| nope % (4 * s) == 0 && s * hg * nl * 16 <= threads as usize).unwrap_or(1)
}

fn case(tokens: usize, hg: usize, topk: usize) -> Case {
    let threads = if hg <= 2 { 512 } else { 256 };
    Case {
        geo: TINY,
        hg,
        threads,
        qs: q_slices(32, hg, 1, threads),
        mma: true,
        tokens,
        topk,
        // One staging round of the block unless a test says otherwise.
        chunk: threads as usize,
        page_size: 4,
        seqs: vec![3, 40, 23, 9],
        pad_every: 5,
        max_context: 64,
        q_bf16: true,
        out_bf16: true,
        scale: 0.35,
        splits: 0,
        prefill_from: None,
    }
}

/// One GLM-5 tp8 rank's attention (8 local heads, k = 2048, pages of 64) over sequences of 3,000
/// and 2,100 positions, every third token padding.
fn glm5_case(tokens: usize, hg: usize) -> Case {
    let mut c = case(tokens, hg, 2048);
    c.geo = Geo { heads: 8, nope: 192, rope: 64, v: 256, latent: 512, index: 128 };
    c.qs = 1;
    c.page_size = 64;
    c.max_context = 4096;
    c.seqs = vec![3000, 2100];
    c.pad_every = 3;
    c.scale = 0.0722; // 1 / sqrt(192 + 64)
    c
}

#[test]
fn sparse_attention_matches_the_cpu() {
    // k = 16 (tiny index_topk): sequences shorter (3, 9) and longer (23, 40) than k.
    for (i, &(tokens, hg)) in [(1, 8), (3, 4), (17, 2), (17, 8), (3, 1)].iter().enumerate() {
        run(&case(tokens, hg, 16), 10 + i as u64);
    }
    // Eight heads per block with the scores on the CUDA cores (the tensor-core path's fallback).
    let mut c = case(17, 8, 16);
    c.mma = false;
    run(&c, 16);
    // A ragged k (not a multiple of anything), one head per block of 8 warps, f32 in and out.
    let mut c = case(3, 1, 13);
    c.threads = 256;
    c.chunk = 256;
    c.qs = 2;
    c.q_bf16 = false;
    c.out_bf16 = false;
    run(&c, 20);
}

#[test]
fn split_kv_decode_matches_the_cpu() {
    // k = 16 in 1, 2 (8 entries each) and 16 splits (one entry each: most splits of a short
    // sequence see nothing); 4 and 8 heads per block, padding, a token without positions.
    for (i, &(tokens, hg, splits)) in [(1, 8, 2), (3, 4, 1), (17, 8, 16), (5, 4, 2)].iter().enumerate() {
        let mut c = case(tokens, hg, 16);
        c.geo = Geo { heads: if hg == 4 { 4 } else { 8 }, ..TINY };
        c.splits = splits;
        run(&c, 100 + i as u64);
    }
    // Latents of 2 chunks of 128 dims (the last one whole, or of 64 dims) and 4 warps per split:
    // the q_abs | ctx region holds one staged chunk per warp, so the context reads the first
    // chunk from shared memory and the second from the cache again (`run` checks both).
    for (i, latent) in [192, 256].into_iter().enumerate() {
        let mut c = case(3, 8, 128);
        c.geo = Geo { latent, ..TINY };
        c.seqs = vec![200, 150];
        c.max_context = 256;
        c.splits = 2;
        run(&c, 120 + i as u64);
    }
    // A ragged k of 300 over 7 splits of 43 (two staging rounds of 32 threads... per split), f32 in and out.
    let mut c = case(3, 4, 300);
    c.geo = Geo { heads: 4, ..TINY };
    c.seqs = vec![64, 50];
    c.splits = 7;
    c.q_bf16 = false;
    c.out_bf16 = false;
    run(&c, 110);
}

#[test]
fn prefill_pairs_share_the_rows_below_topk() {
    // Prefill chunks of 12 tokens with one split: pairs wholly below k = 16 (one sequence, every
    // position up to each selected) share their rows, the pair across k and those past it do
    // not, nor the pairs with a padding token; the page hole of the longest sequence drops rows
    // from the shared ones; k = 40 takes two staging rounds of 32 at rounds of one block.
    for (i, &(start, topk, pad)) in [(0, 16, 0), (9, 16, 5), (20, 40, 7)].iter().enumerate() {
        let mut c = case(12, 8, topk);
        c.seqs = vec![40, 23];
        c.splits = 1;
        c.pad_every = pad;
        c.prefill_from = Some(start);
        run(&c, 140 + i as u64);
    }
    // GLM-5's geometry (8 warps of 64 dims), k = 2048: a chunk from position 2040 (pairs below,
    // across and past k)
    let mut c = glm5_case(8, 8);
    c.pad_every = 0;
    c.splits = 1;
    c.prefill_from = Some(2042);
    run(&c, 150);
}

#[test]
fn dense_attention_matches_the_cpu() {
    // Every causal position (one staging round) with pages of 16, 4 and 8.
    for (i, &(tokens, hg, page)) in [(1, 8, 16), (3, 2, 4), (17, 4, 8)].iter().enumerate() {
        let mut c = case(tokens, hg, 0);
        c.page_size = page;
        run(&c, 30 + i as u64);
    }
    // f32 output, peaked softmax.
    let mut c = case(3, 8, 0);
    c.out_bf16 = false;
    c.scale = 1.5;
    run(&c, 40);
}

#[test]
fn positions_stream_over_several_chunks() {
    // More selected positions than one staging round of the block: rounds of 256 positions with
    // k = 300 and long sequences (tiny heads at TP 2: 4 per rank).
    let mut c = case(3, 4, 300);
    c.geo = Geo { heads: 4, ..TINY };
    c.seqs = vec![64, 50];
    run(&c, 50);
    // Dense over a context of 640: up to two rounds of 512 positions (16 warps), pages of 16.
    let mut c = case(3, 2, 0);
    c.geo = Geo { heads: 4, ..TINY };
    c.seqs = vec![600, 300];
    c.max_context = 640;
    c.page_size = 16;
    c.pad_every = 0;
    run(&c, 51);
}

#[test]
fn a_latent_wider_than_one_warp_pass() {
    // latent 192 = one full 128-dim lane pass plus a partial one; ragged nope / v.
    let mut c = case(3, 2, 16);
    c.geo = Geo { heads: 4, nope: 20, rope: 8, v: 24, latent: 192, index: 16 };
    c.qs = 1;
    run(&c, 60);
}

#[test]
fn glm5_geometry_matches_the_cpu() {
    // One GLM-5 tp8 rank (8 heads, nope 192, rope 64, v 256, latent 512, k 2048, pages of 64)
    // with sequences longer than k: a decode-like instance (one head per block, 16 warps) and a
    // prefill-like one (8 heads per block, scores on the tensor cores and on the CUDA cores).
    for (hg, threads, qs, mma) in [(1, 512, 8, false), (8, 256, 1, true), (8, 256, 1, false)] {
        let mut c = glm5_case(3, hg);
        c.mma = mma;
        c.threads = threads;
        c.chunk = 2048;
        c.qs = qs;
        let (stats, _) = run(&c, 80 + hg as u64);
        // Warp instructions issued: a proxy for the GPU time of the three variants.
        eprintln!("GLM-5 hg={hg} mma={mma}: {} warp instructions for 2 active tokens", stats.counters.warp_instructions);
    }
}

#[test]
fn glm5_split_kv_decode_matches_the_cpu() {
    // One GLM-5 tp8 rank's decode as lowered: 8 heads per block, k = 2048 in 128 splits of 16
    // (batch 1; 64 of 32 at batch 8) and 6 splits of 342 (batch 64), scores on the tensor cores
    // (with 2 warps the tile rows staged for the context) and the CUDA cores.
    for (splits, mma) in [(128, true), (64, true), (6, true), (6, false)] {
        let mut c = glm5_case(3, 8);
        c.mma = mma;
        c.splits = splits;
        run(&c, 90 + splits as u64);
    }
}

#[test]
fn results_are_deterministic() {
    let c = case(17, 8, 16);
    let (stats, a) = run(&c, 70);
    let (_, b) = run(&c, 70);
    assert_eq!(a, b);
    eprintln!("17 tokens: {} B read, {} B written", stats.global_bytes_read(), stats.global_bytes_written());
}

fn ptxas_check(name: &str, params: &MlaAttentionParams, ptxas: &std::path::Path) -> (u32, u32) {
    let smem = params.dynamic_smem().unwrap();
    let r = common::assemble_within_budget(ptxas, name, &params.render().unwrap(), smem);
    (r.registers, r.smem_static_bytes + smem)
}

#[test]
fn glm5_and_tiny_instances_assemble_for_sm_120a() {
    let Some(ptxas) = common::ptxas("MLA attention") else { return };
    let dir = std::env::temp_dir().join(format!("kiln-attn-ptxas-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    // GLM-5 tp8: 8 heads per rank, nope 192, rope 64, v 256, latent 512, index 128, k 2048,
    // page 64 over a 202752-token context; prefill chunks of 8192 tokens and decode batches.
    let glm_geo = Geo { heads: 8, nope: 192, rope: 64, v: 256, latent: 512, index: 128 };
    let glm = |hg: u32, threads: u32, topk: u32, chunk: u32, mma: bool| {
        let qs = q_slices(192, hg as usize, 4, threads);
        let (mma, qbs, xs) = mma_layout(&glm_geo, hg as usize, threads, qs, mma, true);
        MlaAttentionParams {
        qs: qs as u32,
        mma,
        qbs,
        xs,
        arch: 120,
        heads: 8,
        hg,
        nope: 192,
        rope: 64,
        v: 256,
        latent: 512,
        nl: 4,
        row: 704,
        page: 64,
        pps: 202_752 / 64,
        slots: 1_000_000,
        max_pos: 202_752,
        topk,
        chunk,
        threads,
        q_bf16: 1,
        out_bf16: 1,
        mode: 0,
        splits: 1,
        split: topk,
        stage: 0,
        coop: 0,
        tt: 1,
        }
    };
    let mut worst = (0, 0);
    // The token count is the grid, not a parameter: one instance serves every bucket.
    for (topk, chunk) in [(2048, 2048), (0, 1024)] {
        for (hg, threads, mma) in [(1, 256, false), (1, 512, false), (2, 256, false), (2, 512, false), (4, 256, false), (8, 256, false), (8, 256, true)] {
            let (r, s) = ptxas_check(&format!("glm5_k{topk}_hg{hg}_t{threads}_mma{}", mma as u32), &glm(hg, threads, topk, chunk, mma), &ptxas);
            worst = (worst.0.max(r), worst.1.max(s));
        }
    }
    for (hg, threads, topk, q_bf16, out_bf16, mma) in [(8, 256, 16, 1, 1, true), (8, 256, 16, 1, 1, false), (4, 256, 0, 1, 1, false), (2, 512, 0, 0, 0, false), (1, 512, 13, 0, 1, false), (1, 256, 16, 1, 1, false)] {
        let qs = q_slices(32, hg as usize, 1, threads);
        let (mma, qbs, xs) = mma_layout(&TINY, hg as usize, threads, qs, mma, out_bf16 == 1);
        let p = MlaAttentionParams {
            mma,
            qbs,
            xs,
            arch: 120,
            heads: 8,
            hg,
            nope: 32,
            rope: 16,
            v: 32,
            latent: 64,
            nl: 1,
            qs: qs as u32,
            row: 112,
            page: 16,
            pps: 64,
            slots: 4096,
            max_pos: 1024,
            topk,
            chunk: 512,
            threads,
            q_bf16,
            out_bf16,
            mode: 0,
            splits: 1,
            split: topk,
            stage: 0,
            coop: 0,
            tt: 1,
        };
        ptxas_check(&format!("tiny_hg{hg}_k{topk}_t{threads}_mma{mma}"), &p, &ptxas);
    }
    // split-KV decode: the split launch at batch 1 (128 splits of 16, 2 warps, the tile rows
    // staged whole; and 64 of 32) and batch 64 (6 of 342, 8 warps, one 128-dim chunk staged),
    // each also unstaged, and the three mla_split launches at batches 1 (128 and 64 splits) and 64
    for (splits, per, threads, stage) in [(128u32, 16u32, 64u32, 4u32), (64, 32, 64, 4), (64, 32, 64, 0), (6, 342, 256, 1), (6, 342, 256, 0)] {
        let chunk = per.div_ceil(threads) * threads;
        let (r, s) = ptxas_check(&format!("glm5_split{splits}_stage{stage}"), &MlaAttentionParams { mode: 1, splits, split: per, stage, ..glm(8, threads, 2048, chunk, true) }, &ptxas);
        worst = (worst.0.max(r), worst.1.max(s));
    }
    // and with its 8 warps taking each tile together (batches 8 to 64: 47 splits of 44 .. 6 of 342)
    for (splits, per) in [(6u32, 342u32), (47, 44)] {
        let chunk = per.div_ceil(256) * 256;
        let (r, s) = ptxas_check(&format!("glm5_split{splits}_coop"), &MlaAttentionParams { mode: 1, splits, split: per, coop: 1, ..glm(8, 256, 2048, chunk, true) }, &ptxas);
        worst = (worst.0.max(r), worst.1.max(s));
    }
    for (tokens, splits, rpw) in [(1u32, 128u32, 1u32), (1, 64, 1), (64, 6, 4)] {
        // MODE 3 (combine and output in one launch) at batch 1 with 16 and 64 dims per block
        for (mode, ds) in [(0u32, 0u32), (1, 0), (2, 0), (3, 16), (3, 64)].into_iter().filter(|&(m, _)| m < 3 || tokens == 1) {
            let h = MlaSplitParams {
                arch: 120,
                heads: 8,
                nope: 192,
                rope: 64,
                v: 256,
                latent: 512,
                nl: 4,
                tokens,
                splits,
                rpw: if mode == 2 { rpw } else { 1 },
                // batch 64's output launch in groups of 16 tokens (the lowering's choice)
                tg: if mode == 2 && tokens == 64 { 16 } else { tokens },
                // the combine at batch 1 takes one latent dim per lane (128 blocks)
                dpl: if mode == 1 && tokens == 1 { 1 } else { 4 },
                threads: if mode == 1 { 32 } else { 256 },
                ds,
                partials: if mode == 3 { SplitKLayout::PARTIALS as u32 } else { 0 },
                mode,
                q_bf16: 1,
                out_bf16: 1,
            };
            let smem = h.dynamic_smem().unwrap();
            let r = common::assemble_within_budget(&ptxas, &format!("glm5_mla_split_t{tokens}_s{splits}_mode{mode}_ds{ds}"), &h.render().unwrap(), smem);
            worst = (worst.0.max(r.registers), worst.1.max(r.smem_static_bytes + smem));
        }
    }
    eprintln!("GLM-5 instances: at most {} registers, {} B shared memory", worst.0, worst.1);
    let _ = std::fs::remove_dir_all(&dir);
}
