//! KV-cache write kernels (`mla_kv_write`, `indexer_key_write`) against the CPU reference: a
//! cache layer filled with random values, ragged batches (1, 3, 17 tokens; padding rows, a padding
//! row that carries a slot, an active token without a slot; pages handed out of order; positions
//! across page boundaries), run on the PTX emulator and compared with `reference::mla_kv_write` /
//! `indexer_key_write` over the whole layer: slots and row parts a write does not own stay
//! bit-identical, the rope key is bit-exact (same products and rounding as the CPU), normalised
//! values are within `kiln verify`'s tolerance (their sums are reduced in another order). The
//! kernels write exactly the owned bytes and read nothing beyond their tokens' rows. The tiny
//! plan's cache writes, lowered as the compiler lowers them (grid, block, arguments), match the
//! CPU; every GLM-5 tp8 instance (each prefill and decode bucket) assembles with ptxas without
//! spills.

mod common;

use kiln_compiler::kernels::{IndexerKeyWriteParams, MlaKvWriteParams};
use kiln_runtime::cpu::reference::{self, Cache, TokenInputs};
use kiln_runtime::cpu::rope::Rope;
use kiln_runtime::emu::{launch, GlobalMemory, KernelArg, LaunchStats, Module};
use kiln_runtime::numerics::{f32_to_bf16, round_bf16};
use kiln_runtime::plan::{DType, KvLayout};
use kiln_runtime::rng::Rng;
use kiln_runtime::verify::compare_cache;

const LAYER: usize = 1;
const EPS: f32 = 1e-6;

fn randn(rng: &mut Rng, n: usize, mean: f64, scale: f64, bf16: bool) -> Vec<f32> {
    (0..n).map(|_| (mean + rng.normal() * scale) as f32).map(|v| if bf16 { round_bf16(v) } else { v }).collect()
}

fn bytes(v: &[f32], bf16: bool) -> Vec<u8> {
    if bf16 {
        v.iter().flat_map(|&f| f32_to_bf16(f).to_le_bytes()).collect()
    } else {
        v.iter().flat_map(|f| f.to_le_bytes()).collect()
    }
}

fn i32_bytes(v: &[i32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// Cache geometry of a test: row parts, pages, RoPE table rows.
#[derive(Clone, Copy)]
struct Geo {
    latent: usize,
    rope: usize,
    index: usize,
    page_size: usize,
    pages: usize,
    pages_per_seq: usize,
    max_context: usize,
    cache_bf16: bool,
}

impl Geo {
    fn tiny() -> Geo {
        // the tiny model: kv_lora_rank 64, qk_rope 16, index_head_dim 32
        Geo { latent: 64, rope: 16, index: 32, page_size: 16, pages: 9, pages_per_seq: 3, max_context: 48, cache_bf16: true }
    }

    fn row(&self) -> usize {
        self.latent + self.rope + self.index
    }

    fn esize(&self) -> usize {
        if self.cache_bf16 { 2 } else { 4 }
    }

    fn layout(&self) -> KvLayout {
        let dtype = if self.cache_bf16 { DType::BF16 } else { DType::F32 };
        KvLayout {
            dtype,
            layers: 2,
            latent_dim: self.latent,
            rope_dim: self.rope,
            index_dim: self.index,
            page_size: self.page_size,
            pages: self.pages,
            bytes_per_token: (2 * self.row() * self.esize()) as u64,
            max_seqs: 3,
            pages_per_seq: self.pages_per_seq,
            max_context: self.max_context,
        }
    }
}

/// A program's token inputs: 3 sequences with pages handed out in a shuffled order.
struct Batch {
    positions: Vec<i32>,
    token_seq: Vec<i32>,
    slots: Vec<i32>,
    page_table: Vec<i32>,
    pages_per_seq: usize,
}

impl Batch {
    fn new(rng: &mut Rng, tokens: usize, g: &Geo) -> Batch {
        let seqs = 3;
        let mut pages: Vec<i32> = (0..g.pages as i32).collect();
        for i in (1..pages.len()).rev() {
            pages.swap(i, (rng.next_u64() % (i as u64 + 1)) as usize);
        }
        let page_table: Vec<i32> = (0..seqs * g.pages_per_seq).map(|i| pages[i]).collect();
        // each sequence continues from a random position, so a run crosses a page boundary
        let mut next: Vec<i32> = (0..seqs).map(|_| (rng.next_u64() % (g.page_size as u64 + 5)) as i32).collect();
        let (mut positions, mut token_seq, mut slots) = (vec![], vec![], vec![]);
        for t in 0..tokens {
            let s = t % seqs;
            let pos = next[s];
            next[s] += 1;
            let page = page_table[s * g.pages_per_seq + pos as usize / g.page_size];
            let slot = page * g.page_size as i32 + pos % g.page_size as i32;
            let (seq, slot) = match t % 7 {
                // padding: no sequence, no slot
                3 => (-1, -1),
                // padding that still carries a slot: must write nothing
                5 => (-1, slot),
                // an active token without a slot
                6 if t > 7 => (s as i32, -1),
                _ => (s as i32, slot),
            };
            positions.push(pos);
            token_seq.push(seq);
            slots.push(slot);
        }
        Batch { positions, token_seq, slots, page_table, pages_per_seq: g.pages_per_seq }
    }

    fn inputs(&self) -> TokenInputs<'_> {
        TokenInputs { positions: &self.positions, token_seq: &self.token_seq, slots: &self.slots, page_table: &self.page_table, pages_per_seq: self.pages_per_seq }
    }

    /// Slots the batch writes.
    fn written(&self) -> Vec<usize> {
        self.token_seq.iter().zip(&self.slots).filter(|(&q, &s)| q >= 0 && s >= 0).map(|(_, &s)| s as usize).collect()
    }
}

/// A layer of random cache values (in the cache dtype), so untouched values are recognisable.
fn random_layer(rng: &mut Rng, g: &Geo) -> Vec<u8> {
    bytes(&randn(rng, g.pages * g.page_size * g.row(), 0.0, 3.0, g.cache_bf16), g.cache_bf16)
}

/// The launch the lowering makes: one warp per token, a small batch in one block of its warps.
fn launch_shape(tokens: usize) -> (u32, u32) {
    let threads = (tokens as u32 * 32).min(kiln_compiler::passes::lower::THREADS);
    ((tokens as u32 * 32).div_ceil(threads), threads)
}

/// Checks a written layer against the CPU's: everything bit-exact except the values in
/// `[from, to)` of written slots (normalised), which must be within the BF16/F32 tolerance and,
/// for `[exact_from, to)`, bit-exact too. Returns how many normalised values differ in bits.
#[allow(clippy::too_many_arguments)]
fn check_layer(what: &str, g: &Geo, got: &[u8], want: &[u8], written: &[usize], from: usize, to: usize, exact_from: usize, log: bool) -> usize {
    assert_eq!(got.len(), want.len());
    let c = compare_cache(g.layout().dtype, 1, got, want);
    if log {
        eprintln!("{what}: max abs {:.3e}, max rel {:.3e} over {} values", c.max_abs, c.max_rel, c.elements);
    }
    assert!(c.ok(), "{what}: {} of {} values beyond tolerance (max abs {:e}, max rel {:e})", c.beyond + c.non_finite, c.elements, c.max_abs, c.max_rel);
    let (es, row) = (g.esize(), g.row());
    let mut inexact = 0;
    for s in 0..g.pages * g.page_size {
        for v in 0..row {
            let at = (s * row + v) * es;
            if got[at..at + es] == want[at..at + es] {
                continue;
            }
            let owned = written.contains(&s) && (from..to).contains(&v);
            assert!(owned && v < exact_from, "{what}: slot {s} value {v} differs in bits (owned by the write: {owned})");
            inexact += 1;
        }
    }
    if log {
        eprintln!("{what}: {inexact} of {} normalised values differ from the CPU in the last bit(s)", written.len() * (to - from));
    }
    inexact
}

struct Case {
    geo: Geo,
    tokens: usize,
    x_bf16: bool,
    w_bf16: bool,
}

/// Global traffic of a launch: it writes exactly the owned values and reads, per token, its three
/// I32 inputs (in every lane: one broadcast transaction on a GPU) and, per written token, its key
/// row, the norm parameters (cache-resident after the first warp on a GPU) and its RoPE table
/// row, nothing else. The ratio is to the compulsory bytes (inputs, rows and table rows once per
/// token, parameters once).
#[allow(clippy::too_many_arguments)]
fn check_traffic(what: &str, s: &LaunchStats, tokens: usize, written: usize, row: usize, params: usize, table: usize, owned: usize) {
    let expected = tokens * 3 * 4 * 32 + written * (row + params + table);
    let compulsory = tokens * 12 + written * (row + table) + params;
    let read = s.global_bytes_read() as usize;
    eprintln!("{what}: {read} B read (compulsory {compulsory} B, ratio {:.3}), {} B written ({owned} B owned)", read as f64 / compulsory as f64, s.global_bytes_written());
    assert_eq!(s.global_bytes_written(), owned as u64, "{what}: writes exactly the owned values");
    assert_eq!(read, expected, "{what}: reads only the inputs, the written tokens' rows and the parameters");
}

fn run_mla(c: &Case, seed: u64) {
    let g = c.geo;
    let mut rng = Rng::new(seed);
    let batch = Batch::new(&mut rng, c.tokens, &g);
    let init = random_layer(&mut rng, &g);
    let w_ = g.latent + g.rope;
    let x = randn(&mut rng, c.tokens * w_, 0.0, 1.5, c.x_bf16);
    let norm = randn(&mut rng, g.latent, 1.0, 0.3, c.w_bf16);
    let rope = Rope::new(g.rope, 10000.0);
    let table = rope.table(g.max_context);

    let mut cache = Cache::new(&g.layout());
    cache.set_layer_bytes(LAYER, &init);
    reference::mla_kv_write(&x, c.x_bf16, &norm, EPS, &batch.inputs(), &mut cache, LAYER, &rope);
    let want = cache.layer_bytes(LAYER);

    let (grid, threads) = launch_shape(c.tokens);
    let params = MlaKvWriteParams {
        arch: 120,
        tokens: c.tokens as u32,
        latent: g.latent as u32,
        rope: g.rope as u32,
        row: g.row() as u32,
        slots: (g.pages * g.page_size) as u32,
        max_pos: g.max_context as u32,
        threads,
        x_bf16: c.x_bf16 as u32,
        w_bf16: c.w_bf16 as u32,
        cache_bf16: g.cache_bf16 as u32,
    };
    let module = Module::parse(&params.render().unwrap(), "mla_kv_write.ptx").unwrap();
    let mut m = GlobalMemory::new();
    let bufs = [
        m.alloc_bytes("kv", &bytes(&x, c.x_bf16)),
        m.alloc_bytes("norm", &bytes(&norm, c.w_bf16)),
        m.alloc_bytes("positions", &i32_bytes(&batch.positions)),
        m.alloc_bytes("token_seq", &i32_bytes(&batch.token_seq)),
        m.alloc_bytes("slots", &i32_bytes(&batch.slots)),
        m.alloc_bytes("cache", &init),
        m.alloc_f32("rope", &table),
    ];
    let mut args: Vec<KernelArg> = bufs.iter().map(|&b| KernelArg::U64(m.addr(b))).collect();
    args.push(KernelArg::F32(EPS));
    let stats = launch(&module, MlaKvWriteParams::ENTRY, [grid, 1, 1], [threads, 1, 1], params.dynamic_smem().unwrap(), &args, &mut m).unwrap();
    let got = m.read(bufs[5]);

    let written = batch.written();
    let what = format!("mla_kv_write T={} latent={} rope={} x_bf16={} cache_bf16={}", c.tokens, g.latent, g.rope, c.x_bf16, g.cache_bf16);
    // latent within tolerance, the rope key bit-exact, everything else untouched
    check_layer(&what, &g, &got, &want, &written, 0, w_, g.latent, true);
    let (xs, ws) = (if c.x_bf16 { 2 } else { 4 }, if c.w_bf16 { 2 } else { 4 });
    check_traffic(&what, &stats, c.tokens, written.len(), w_ * xs, g.latent * ws, g.rope * 4, written.len() * w_ * g.esize());
}

fn run_indexer(c: &Case, b_bf16: bool, seed: u64) {
    let g = c.geo;
    let mut rng = Rng::new(seed);
    let batch = Batch::new(&mut rng, c.tokens, &g);
    let init = random_layer(&mut rng, &g);
    let d = g.index;
    // an offset mean, so the centring matters
    let k = randn(&mut rng, c.tokens * d, 0.7, 2.0, c.x_bf16);
    let norm = randn(&mut rng, d, 1.0, 0.3, c.w_bf16);
    let bias = randn(&mut rng, d, 0.0, 0.2, b_bf16);
    let rope = Rope::new(g.rope, 10000.0);
    let table = rope.table(g.max_context);

    let mut cache = Cache::new(&g.layout());
    cache.set_layer_bytes(LAYER, &init);
    reference::indexer_key_write(&k, &norm, &bias, EPS, &batch.inputs(), &mut cache, LAYER, &rope);
    let want = cache.layer_bytes(LAYER);

    let (grid, threads) = launch_shape(c.tokens);
    let params = IndexerKeyWriteParams {
        arch: 120,
        tokens: c.tokens as u32,
        d: d as u32,
        rope: g.rope as u32,
        offset: (g.latent + g.rope) as u32,
        row: g.row() as u32,
        slots: (g.pages * g.page_size) as u32,
        max_pos: g.max_context as u32,
        threads,
        x_bf16: c.x_bf16 as u32,
        w_bf16: c.w_bf16 as u32,
        b_bf16: b_bf16 as u32,
        cache_bf16: g.cache_bf16 as u32,
    };
    let module = Module::parse(&params.render().unwrap(), "indexer_key_write.ptx").unwrap();
    let mut m = GlobalMemory::new();
    let bufs = [
        m.alloc_bytes("k", &bytes(&k, c.x_bf16)),
        m.alloc_bytes("norm", &bytes(&norm, c.w_bf16)),
        m.alloc_bytes("bias", &bytes(&bias, b_bf16)),
        m.alloc_bytes("positions", &i32_bytes(&batch.positions)),
        m.alloc_bytes("token_seq", &i32_bytes(&batch.token_seq)),
        m.alloc_bytes("slots", &i32_bytes(&batch.slots)),
        m.alloc_bytes("cache", &init),
        m.alloc_f32("rope", &table),
    ];
    let mut args: Vec<KernelArg> = bufs.iter().map(|&b| KernelArg::U64(m.addr(b))).collect();
    args.push(KernelArg::F32(EPS));
    let stats = launch(&module, IndexerKeyWriteParams::ENTRY, [grid, 1, 1], [threads, 1, 1], params.dynamic_smem().unwrap(), &args, &mut m).unwrap();
    let got = m.read(bufs[6]);

    let written = batch.written();
    let what = format!("indexer_key_write T={} d={d} rope={} x_bf16={} cache_bf16={}", c.tokens, g.rope, c.x_bf16, g.cache_bf16);
    let from = g.latent + g.rope;
    check_layer(&what, &g, &got, &want, &written, from, from + d, from + d, true);
    let (xs, ws, bs) = (if c.x_bf16 { 2 } else { 4 }, if c.w_bf16 { 2 } else { 4 }, if b_bf16 { 2 } else { 4 });
    check_traffic(&what, &stats, c.tokens, written.len(), d * xs, d * (ws + bs), g.rope * 4, written.len() * d * g.esize());
}

/// Ragged geometries: pair counts that leave the last group of 32 lanes partly idle, rope pairs
/// fewer than a warp, an index key longer than one group of pairs.
fn ragged() -> Geo {
    Geo { latent: 200, rope: 6, index: 138, page_size: 8, pages: 12, pages_per_seq: 4, max_context: 40, cache_bf16: true }
}

#[test]
fn mla_kv_write_matches_the_cpu() {
    let tiny = Geo::tiny();
    let cases = [
        Case { geo: tiny, tokens: 1, x_bf16: true, w_bf16: true },
        Case { geo: tiny, tokens: 3, x_bf16: true, w_bf16: true },
        Case { geo: tiny, tokens: 17, x_bf16: true, w_bf16: true },
        Case { geo: tiny, tokens: 17, x_bf16: false, w_bf16: false },
        Case { geo: ragged(), tokens: 17, x_bf16: true, w_bf16: true },
        Case { geo: Geo { cache_bf16: false, ..ragged() }, tokens: 3, x_bf16: false, w_bf16: true },
        // GLM-5's row (latent 512, rope 64, index 128), a few tokens
        Case { geo: Geo { latent: 512, rope: 64, index: 128, page_size: 64, pages: 6, pages_per_seq: 2, max_context: 128, cache_bf16: true }, tokens: 3, x_bf16: true, w_bf16: true },
    ];
    for (i, c) in cases.iter().enumerate() {
        run_mla(c, 1000 + i as u64);
    }
}

#[test]
fn indexer_key_write_matches_the_cpu() {
    let tiny = Geo::tiny();
    let cases = [
        (Case { geo: tiny, tokens: 1, x_bf16: true, w_bf16: true }, true),
        (Case { geo: tiny, tokens: 3, x_bf16: true, w_bf16: true }, true),
        (Case { geo: tiny, tokens: 17, x_bf16: true, w_bf16: true }, true),
        (Case { geo: tiny, tokens: 17, x_bf16: false, w_bf16: false }, false),
        // 69 pairs: two full groups of 32 and 5; rope 3 pairs
        (Case { geo: ragged(), tokens: 17, x_bf16: true, w_bf16: true }, false),
        (Case { geo: Geo { cache_bf16: false, ..ragged() }, tokens: 3, x_bf16: false, w_bf16: true }, true),
        // rope pairs spanning more than one group of lanes (rope 80 = 40 pairs of a 96-value key)
        (Case { geo: Geo { latent: 16, rope: 80, index: 96, page_size: 8, pages: 12, pages_per_seq: 4, max_context: 40, cache_bf16: true }, tokens: 17, x_bf16: true, w_bf16: true }, true),
        // GLM-5's indexer key (128 values, rope 64)
        (Case { geo: Geo { latent: 512, rope: 64, index: 128, page_size: 64, pages: 6, pages_per_seq: 2, max_context: 128, cache_bf16: true }, tokens: 3, x_bf16: true, w_bf16: true }, true),
    ];
    for (i, (c, b_bf16)) in cases.iter().enumerate() {
        run_indexer(c, *b_bf16, 2000 + i as u64);
    }
}

/// (registers, static smem) of one rendered instance, after checking the budgets.
fn assemble(ptxas: &std::path::Path, name: &str, ptx: &str, dynamic_smem: u32) -> (u32, u32) {
    let r = common::assemble_within_budget(ptxas, name, ptx, dynamic_smem);
    (r.registers, r.smem_static_bytes)
}

#[test]
fn cache_writes_assemble_at_tiny_and_glm5_shapes() {
    let Some(ptxas) = common::ptxas("the cache writes") else { return };
    // (name, tokens, latent, rope, index, slots, max_context, x_bf16): tiny (tp1 and tp2 write
    // the same replicated cache) and GLM-5 tp8 (prefill chunk 8192, decode 1 and 32)
    let shapes = [
        ("tiny_prefill", 256u32, 64, 16, 32, 16384, 1024, 1),
        ("tiny_decode", 3, 64, 16, 32, 16384, 1024, 1),
        ("tiny_f32", 17, 64, 16, 32, 16384, 1024, 0),
        ("glm5_prefill", 8192, 512, 64, 128, 800_000, 202_752, 1),
        ("glm5_decode1", 1, 512, 64, 128, 800_000, 202_752, 1),
        ("glm5_decode32", 32, 512, 64, 128, 800_000, 202_752, 1),
    ];
    for (name, tokens, latent, rope, index, slots, max_pos, x_bf16) in shapes {
        let (_, threads) = launch_shape(tokens as usize);
        let row = latent + rope + index;
        let mla = MlaKvWriteParams { arch: 120, tokens, latent, rope, row, slots, max_pos, threads, x_bf16, w_bf16: 1, cache_bf16: 1 };
        assemble(&ptxas, &format!("mla_kv_write_{name}"), &mla.render().unwrap(), mla.dynamic_smem().unwrap());
        let idx = IndexerKeyWriteParams { arch: 120, tokens, d: index, rope, offset: latent + rope, row, slots, max_pos, threads, x_bf16, w_bf16: 1, b_bf16: 1, cache_bf16: 1 };
        assemble(&ptxas, &format!("indexer_key_write_{name}"), &idx.render().unwrap(), idx.dynamic_smem().unwrap());
    }
    let _ = std::fs::remove_dir_all(std::env::temp_dir().join(format!("kiln-kcache-{}", std::process::id())));
}

/// A plan of only the cache writes, lowered for sm_120a: compiled for the CPU target (lowering
/// for a GPU fails while other families lack templates), retargeted, every other step dropped.
fn lowered_cache_plan(preset: &str, opts: kiln_compiler::CompileOptions) -> kiln_runtime::plan::Plan {
    use kiln_runtime::plan::Op;
    let dir = std::env::temp_dir().join(format!("kiln-kcache-{preset}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    kiln_compiler::synth::synth(preset, &dir.join("ckpt"), 7).unwrap();
    let sm120 = kiln_compiler::targets::target("sm_120a").unwrap();
    let opts = kiln_compiler::CompileOptions { target: "cpu".into(), gpu_memory: Some(sm120.gpu_memory), headroom: Some(kiln_compiler::targets::default_headroom(&sm120)), assemble: false, ..opts };
    let mut plan = kiln_compiler::compile(&dir.join("ckpt"), &opts).unwrap().plan;
    let _ = std::fs::remove_dir_all(&dir);
    plan.target = sm120;
    for p in &mut plan.programs {
        p.steps.retain(|s| matches!(s.op, Op::MlaKvWrite { .. } | Op::IndexerKeyWrite { .. }));
    }
    kiln_compiler::passes::lower::lower(&mut plan).unwrap();
    let layers = plan.model.num_hidden_layers;
    for p in &plan.programs {
        assert_eq!(p.steps.len(), 2 * layers, "{}: one MLA and one indexer write per layer", p.name);
        for s in &p.steps {
            assert_eq!(s.launches.len(), 1, "{}: {} is lowered to one launch", p.name, s.op.name());
            let l = &s.launches[0];
            assert_eq!(plan.kernel(l.kernel).family, s.kernel);
            assert!(l.grid[0] * l.block[0] >= p.tokens as u32 * 32 && l.block[0] % 32 == 0, "{}: a warp per token ({:?} x {:?})", p.name, l.grid, l.block);
        }
    }
    plan
}

#[test]
fn glm5_tp8_cache_write_instances_assemble() {
    let Some(ptxas) = common::ptxas("the cache writes") else { return };
    let plan = lowered_cache_plan("glm5", kiln_compiler::CompileOptions { tp: 8, ..Default::default() });
    let kv = &plan.memory.kv;
    eprintln!("GLM-5 tp8 cache: row {} + {} + {}, {} slots, {} positions", kv.latent_dim, kv.rope_dim, kv.index_dim, kv.pages * kv.page_size, kv.max_context);
    let (mut regs, mut n) = (0, 0);
    for (i, k) in plan.kernels.iter().enumerate() {
        let smem = plan.programs.iter().flat_map(|p| &p.steps).flat_map(|s| &s.launches).filter(|l| l.kernel.0 as usize == i).map(|l| l.smem_dynamic).max().unwrap();
        regs = regs.max(assemble(&ptxas, &k.name, &k.ptx, smem).0);
        n += 1;
    }
    eprintln!("GLM-5 tp8: {n} cache-write instances (every prefill and decode bucket), at most {regs} registers, no spills, no shared memory");
    assert!(n >= 4);
}

/// Every lowered cache write of the tiny plan (tp 2: the replicated cache is written alike on
/// each rank) run as lowered (grid, block, arguments) against the CPU reference.
#[test]
fn tiny_plan_cache_writes_match_the_cpu() {
    use kiln_runtime::plan::{LaunchArg, Op};
    let opts = kiln_compiler::CompileOptions { tp: 2, prefill_chunk: 64, decode_batches: vec![1, 3], max_context: Some(256), ..Default::default() };
    let plan = lowered_cache_plan("tiny", opts);
    let kv = plan.memory.kv.clone();
    let g = Geo { latent: kv.latent_dim, rope: kv.rope_dim, index: kv.index_dim, page_size: kv.page_size, pages: kv.pages, pages_per_seq: kv.pages_per_seq, max_context: kv.max_context, cache_bf16: kv.dtype == DType::BF16 };
    let rope = Rope::new(g.rope, plan.model.rope_theta);
    let table = rope.table(g.max_context);
    let (mut steps, mut values, mut inexact) = (0, 0, 0);
    for (pi, p) in plan.programs.iter().enumerate() {
        for (si, step) in p.steps.iter().enumerate() {
            let mut rng = Rng::new(3000 + 100 * pi as u64 + si as u64);
            let batch = Batch::new(&mut rng, p.tokens, &g);
            let l = &step.launches[0];
            let k = plan.kernel(l.kernel);
            let (src, layer, eps, norm, bias) = match step.op {
                Op::MlaKvWrite { kv, norm, eps, layer } => (kv, layer, eps, norm, None),
                Op::IndexerKeyWrite { k, norm, bias, eps, layer } => (k, layer, eps, norm, Some(bias)),
                _ => unreachable!(),
            };
            let src_bf16 = p.buffer(src).dtype == DType::BF16;
            let x = randn(&mut rng, p.buffer(src).shape.iter().product(), 0.3, 1.5, src_bf16);
            let wslot = |w| plan.weight(w).dtype == DType::BF16;
            let wn = randn(&mut rng, plan.weight(norm).shape.iter().product(), 1.0, 0.3, wslot(norm));
            let wb = bias.map(|b| randn(&mut rng, plan.weight(b).shape.iter().product(), 0.0, 0.2, wslot(b)));
            let init = random_layer(&mut rng, &g);
            let mut cache = Cache::new(&kv);
            cache.set_layer_bytes(layer, &init);
            match &wb {
                None => reference::mla_kv_write(&x, src_bf16, &wn, eps, &batch.inputs(), &mut cache, layer, &rope),
                Some(wb) => reference::indexer_key_write(&x, &wn, wb, eps, &batch.inputs(), &mut cache, layer, &rope),
            }
            let want = cache.layer_bytes(layer);

            // each argument: bytes to place in global memory (and whether it is the cache) or a value
            let placed: Vec<Result<(Vec<u8>, bool), KernelArg>> = l
                .args
                .iter()
                .map(|a| match *a {
                    LaunchArg::Buffer(b) if b == p.inputs.positions => Ok((i32_bytes(&batch.positions), false)),
                    LaunchArg::Buffer(b) if b == p.inputs.token_seq => Ok((i32_bytes(&batch.token_seq), false)),
                    LaunchArg::Buffer(b) if b == p.inputs.slots => Ok((i32_bytes(&batch.slots), false)),
                    LaunchArg::Buffer(b) if b == src => Ok((bytes(&x, src_bf16), false)),
                    LaunchArg::Weight(w) if w == norm => Ok((bytes(&wn, wslot(w)), false)),
                    LaunchArg::Weight(w) if Some(w) == bias => Ok((bytes(wb.as_ref().unwrap(), wslot(w)), false)),
                    LaunchArg::KvCache { layer: at } if at as usize == layer => Ok((init.clone(), true)),
                    LaunchArg::RopeTable => Ok((table.iter().flat_map(|f| f.to_le_bytes()).collect(), false)),
                    LaunchArg::F32(v) if v == eps => Err(KernelArg::F32(v)),
                    ref other => panic!("{} step {si}: unexpected argument {other:?}", p.name),
                })
                .collect();
            let mut m = GlobalMemory::new();
            let mut cache_buf = None;
            let mut args = Vec::new();
            for (i, a) in placed.into_iter().enumerate() {
                args.push(match a {
                    Ok((b, is_cache)) => {
                        let id = m.alloc_bytes(&format!("arg{i}"), &b);
                        if is_cache {
                            cache_buf = Some(id);
                        }
                        KernelArg::U64(m.addr(id))
                    }
                    Err(v) => v,
                });
            }
            let module = Module::parse(&k.ptx, &format!("{}.ptx", k.name)).unwrap();
            launch(&module, &k.entry, l.grid, l.block, l.smem_dynamic, &args, &mut m).unwrap();
            let got = m.read(cache_buf.expect("the launch passes its layer of the cache"));
            let what = format!("{} step {si} ({}, layer {layer})", p.name, k.name);
            let from = if wb.is_some() { g.latent + g.rope } else { 0 };
            let to = if wb.is_some() { g.row() } else { g.latent + g.rope };
            let exact_from = if wb.is_some() { to } else { g.latent };
            inexact += check_layer(&what, &g, &got, &want, &batch.written(), from, to, exact_from, false);
            values += batch.written().len() * (to - from);
            steps += 1;
        }
    }
    let names: Vec<&str> = plan.programs.iter().map(|p| p.name.as_str()).collect();
    eprintln!("{steps} lowered cache-write steps of the tiny tp2 plan ({}) match the CPU; {inexact} of {values} normalised values differ in the last bit", names.join(", "));
}
