//! The KV-cache write kernel (`kv_cache_write`: a warp per token writes the MLA latent and rope
//! key, another the indexer key) against the CPU reference: a cache layer filled with random
//! values, ragged batches (1, 3, 17 tokens; padding rows, a padding row that carries a slot, an
//! active token without a slot; pages handed out of order; positions across page boundaries),
//! run on the PTX emulator and compared with `reference::mla_kv_write` then
//! `indexer_key_write` over the whole layer: slots a write does not own stay bit-identical, the
//! rope key is bit-exact (same products and rounding as the CPU), normalised values are within
//! `kiln verify`'s tolerance (their sums are reduced in another order). The kernel writes exactly
//! the owned bytes and reads nothing beyond its tokens' rows. The tiny plan's cache writes,
//! lowered as the compiler lowers them (grid, block, arguments), match the CPU; every GLM-5 tp8
//! instance (each prefill and decode bucket) assembles with ptxas without spills.

mod common;

use kiln_compiler::kernels::KvCacheWriteParams;
use kiln_runtime::cpu::reference::{self, Cache, TokenInputs};
use kiln_runtime::cpu::rope::Rope;
use kiln_runtime::emu::{launch, GlobalMemory, KernelArg, LaunchStats, Module};
use kiln_runtime::numerics::{f32_to_bf16, round_bf16};
use kiln_runtime::numerics::{e4m3_to_f32, quantize_fp8_key};
use kiln_runtime::plan::{DType, IndexKeys, KvLayout};
use kiln_runtime::rng::Rng;
use kiln_runtime::verify::compare_cache;

const LAYER: usize = 1;
const EPS: f32 = 1e-6;
const K_EPS: f32 = 1e-5;

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
            index_keys: IndexKeys::Bf16,
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

/// The launch the lowering makes: two warps per token (its two parts), a small batch in one block
/// of its warps.
fn launch_shape(tokens: usize) -> (u32, u32) {
    let threads = (tokens as u32 * 64).min(kiln_compiler::passes::lower::THREADS);
    ((tokens as u32 * 64).div_ceil(threads), threads)
}

/// Checks a written layer against the CPU's: everything bit-exact except, in written slots, the
/// values of the `normalised` ranges, which must be within the BF16/F32 tolerance. Returns how
/// many normalised values differ in bits.
fn check_layer(what: &str, g: &Geo, got: &[u8], want: &[u8], written: &[usize], normalised: &[std::ops::Range<usize>], log: bool) -> usize {
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
            let owned = written.contains(&s) && normalised.iter().any(|r| r.contains(&v));
            assert!(owned, "{what}: slot {s} value {v} differs in bits (a normalised value the write owns: {owned})");
            inexact += 1;
        }
    }
    if log {
        let n: usize = normalised.iter().map(|r| r.len()).sum();
        eprintln!("{what}: {inexact} of {} normalised values differ from the CPU in the last bit(s)", written.len() * n);
    }
    inexact
}

struct Case {
    geo: Geo,
    tokens: usize,
    /// kv and k
    x_bf16: bool,
    /// the norms' weights
    w_bf16: bool,
    /// the indexer key's LayerNorm bias
    b_bf16: bool,
    /// k and its LayerNorm weight in the other dtype than kv and the latent's weight
    mixed: bool,
}

/// Global traffic of a launch: it writes exactly the owned values and reads, per token and
/// part, its three I32 inputs (in every lane: one broadcast transaction on a GPU) and, per
/// written token, its kv and k rows, the norm parameters (cache-resident after the first warp on
/// a GPU) and its RoPE table row once per part, nothing else. The ratio is to the compulsory
/// bytes (inputs, rows and table rows once per token, parameters once).
fn check_traffic(what: &str, s: &LaunchStats, tokens: usize, written: usize, rows: usize, params: usize, table: usize, owned: usize) {
    let expected = 2 * tokens * 3 * 4 * 32 + written * (rows + params + 2 * table);
    let compulsory = tokens * 12 + written * (rows + table) + params;
    let read = s.global_bytes_read() as usize;
    eprintln!("{what}: {read} B read (compulsory {compulsory} B, ratio {:.3}), {} B written ({owned} B owned)", read as f64 / compulsory as f64, s.global_bytes_written());
    assert_eq!(s.global_bytes_written(), owned as u64, "{what}: writes exactly the owned values");
    assert_eq!(read, expected, "{what}: reads only the inputs, the written tokens' rows and the parameters");
}

fn run(c: &Case, seed: u64) {
    let g = c.geo;
    let mut rng = Rng::new(seed);
    let batch = Batch::new(&mut rng, c.tokens, &g);
    let init = random_layer(&mut rng, &g);
    let (w_, d) = (g.latent + g.rope, g.index);
    let x = randn(&mut rng, c.tokens * w_, 0.0, 1.5, c.x_bf16);
    let norm = randn(&mut rng, g.latent, 1.0, 0.3, c.w_bf16);
    // an offset mean, so the centring matters
    let (k_bf16, kw_bf16) = (c.x_bf16 != c.mixed, c.w_bf16 != c.mixed);
    let k = randn(&mut rng, c.tokens * d, 0.7, 2.0, k_bf16);
    let k_norm = randn(&mut rng, d, 1.0, 0.3, kw_bf16);
    let k_bias = randn(&mut rng, d, 0.0, 0.2, c.b_bf16);
    let rope = Rope::new(g.rope, 10000.0);
    let table = rope.table(g.max_context);

    let mut cache = Cache::new(&g.layout());
    cache.set_layer_bytes(LAYER, &init);
    reference::mla_kv_write(&x, c.x_bf16, &norm, EPS, &batch.inputs(), &mut cache, LAYER, &rope);
    reference::indexer_key_write(&k, &k_norm, &k_bias, K_EPS, &batch.inputs(), &mut cache, LAYER, &rope);
    let want = cache.layer_bytes(LAYER);

    let (grid, threads) = launch_shape(c.tokens);
    let params = KvCacheWriteParams {
        arch: 120,
        tokens: c.tokens as u32,
        latent: g.latent as u32,
        rope: g.rope as u32,
        d: d as u32,
        row: g.row() as u32,
        slots: (g.pages * g.page_size) as u32,
        max_pos: g.max_context as u32,
        threads,
        x_bf16: c.x_bf16 as u32,
        w_bf16: c.w_bf16 as u32,
        k_bf16: k_bf16 as u32,
        kw_bf16: kw_bf16 as u32,
        kb_bf16: c.b_bf16 as u32,
        cache_bf16: g.cache_bf16 as u32,
        key_fp8: 0,
    };
    let module = Module::parse(&params.render().unwrap(), "kv_cache_write.ptx").unwrap();
    let mut m = GlobalMemory::new();
    let bufs = [
        m.alloc_bytes("kv", &bytes(&x, c.x_bf16)),
        m.alloc_bytes("norm", &bytes(&norm, c.w_bf16)),
        m.alloc_bytes("k", &bytes(&k, k_bf16)),
        m.alloc_bytes("k_norm", &bytes(&k_norm, kw_bf16)),
        m.alloc_bytes("k_bias", &bytes(&k_bias, c.b_bf16)),
        m.alloc_bytes("positions", &i32_bytes(&batch.positions)),
        m.alloc_bytes("token_seq", &i32_bytes(&batch.token_seq)),
        m.alloc_bytes("slots", &i32_bytes(&batch.slots)),
        m.alloc_bytes("cache", &init),
        m.alloc_f32("rope", &table),
    ];
    let mut args: Vec<KernelArg> = bufs.iter().map(|&b| KernelArg::U64(m.addr(b))).collect();
    args.push(KernelArg::F32(EPS));
    args.push(KernelArg::F32(K_EPS));
    let stats = launch(&module, KvCacheWriteParams::ENTRY, [grid, 1, 1], [threads, 1, 1], params.dynamic_smem().unwrap(), &args, &mut m).unwrap();
    let got = m.read(bufs[8]);

    let written = batch.written();
    let what = format!("kv_cache_write T={} latent={} rope={} d={d} x_bf16={} mixed={} cache_bf16={}", c.tokens, g.latent, g.rope, c.x_bf16, c.mixed, g.cache_bf16);
    // the latent and the index key within tolerance, the rope key bit-exact, everything else untouched
    check_layer(&what, &g, &got, &want, &written, &[0..g.latent, w_..g.row()], true);
    let size = |bf16: bool| if bf16 { 2 } else { 4 };
    let (xs, ws, bs, ks, kws) = (size(c.x_bf16), size(c.w_bf16), size(c.b_bf16), size(k_bf16), size(kw_bf16));
    check_traffic(&what, &stats, c.tokens, written.len(), w_ * xs + d * ks, g.latent * ws + d * (kws + bs), g.rope * 4, written.len() * g.row() * g.esize());
}

/// Ragged geometries: pair counts that leave the last group of 32 lanes partly idle, rope pairs
/// fewer than a warp, an index key longer than one group of pairs.
fn ragged() -> Geo {
    Geo { latent: 200, rope: 6, index: 138, page_size: 8, pages: 12, pages_per_seq: 4, max_context: 40, cache_bf16: true }
}

#[test]
fn cache_writes_match_the_cpu() {
    let tiny = Geo::tiny();
    let cases = [
        Case { geo: tiny, tokens: 1, x_bf16: true, w_bf16: true, b_bf16: true, mixed: false },
        Case { geo: tiny, tokens: 3, x_bf16: true, w_bf16: true, b_bf16: true, mixed: false },
        Case { geo: tiny, tokens: 17, x_bf16: true, w_bf16: true, b_bf16: false, mixed: false },
        Case { geo: tiny, tokens: 17, x_bf16: false, w_bf16: false, b_bf16: false, mixed: false },
        // latent 100 pairs and index key 69 pairs: groups of 32 lanes partly idle; rope 3 pairs
        Case { geo: ragged(), tokens: 17, x_bf16: true, w_bf16: true, b_bf16: false, mixed: false },
        Case { geo: Geo { cache_bf16: false, ..ragged() }, tokens: 3, x_bf16: false, w_bf16: true, b_bf16: true, mixed: false },
        // rope pairs spanning more than one group of lanes (rope 80 = 40 pairs of a 96-value key)
        Case { geo: Geo { latent: 16, rope: 80, index: 96, page_size: 8, pages: 12, pages_per_seq: 4, max_context: 40, cache_bf16: true }, tokens: 17, x_bf16: true, w_bf16: true, b_bf16: true, mixed: false },
        // k and its norm weight in the other dtype than kv and the latent's weight, both ways
        Case { geo: tiny, tokens: 3, x_bf16: true, w_bf16: false, b_bf16: true, mixed: true },
        Case { geo: ragged(), tokens: 17, x_bf16: false, w_bf16: true, b_bf16: false, mixed: true },
        // GLM-5's row (latent 512, rope 64, index 128), a few tokens
        Case { geo: Geo { latent: 512, rope: 64, index: 128, page_size: 64, pages: 6, pages_per_seq: 2, max_context: 128, cache_bf16: true }, tokens: 3, x_bf16: true, w_bf16: true, b_bf16: true, mixed: false },
    ];
    for (i, c) in cases.iter().enumerate() {
        run(c, 1000 + i as u64);
    }
}

/// FP8 indexer keys (`--indexer-keys fp8`, `KEY_FP8`): the key goes after the rope key as E4M3
/// codes and a power-of-two scale (`numerics::quantize_fp8_key` of the BF16-rounded key), in a
/// row padded to 16 bytes. Against the CPU reference on a layer of random rows in that layout
/// (which the CPU must hold and give back unchanged): slots not written stay bit-identical, the
/// rope key is bit-exact, the latent within `verify`'s tolerance, and every key value (code x
/// scale) within one E4M3 step (a BF16 ulp of the normalised value, summed in another order, may
/// move a code or the scale); the launch writes exactly the owned bytes.
#[test]
fn fp8_key_writes_match_the_cpu() {
    let glm5 = Geo { latent: 512, rope: 64, index: 128, page_size: 64, pages: 6, pages_per_seq: 2, max_context: 128, cache_bf16: true };
    for (i, (g, tokens)) in [(Geo::tiny(), 17), (Geo::tiny(), 1), (glm5, 3)].into_iter().enumerate() {
        run_fp8(g, tokens, 2000 + i as u64);
    }
}

fn run_fp8(g: Geo, tokens: usize, seed: u64) {
    let layout = KvLayout { index_keys: IndexKeys::Fp8, ..g.layout() };
    let (pitch, at, d) = (layout.slot_bytes() as usize, layout.key_offset_bytes(), g.index);
    assert_eq!((pitch % 16, at), (0, (g.latent + g.rope) * 2));
    let slots = g.pages * g.page_size;
    let mut rng = Rng::new(seed);
    let batch = Batch::new(&mut rng, tokens, &g);
    let mut init = vec![0u8; slots * pitch];
    for row in init.chunks_exact_mut(pitch) {
        row[..at].copy_from_slice(&bytes(&randn(&mut rng, g.latent + g.rope, 0.0, 3.0, true), true));
        let key = randn(&mut rng, d, 0.0, 3.0, true);
        let scale = quantize_fp8_key(&key, &mut row[at..at + d]);
        row[at + d..at + d + 4].copy_from_slice(&scale.to_le_bytes());
    }
    let x = randn(&mut rng, tokens * (g.latent + g.rope), 0.0, 1.5, true);
    let norm = randn(&mut rng, g.latent, 1.0, 0.3, true);
    let k = randn(&mut rng, tokens * d, 0.7, 2.0, true);
    let k_norm = randn(&mut rng, d, 1.0, 0.3, true);
    let k_bias = randn(&mut rng, d, 0.0, 0.2, true);
    let rope = Rope::new(g.rope, 10000.0);
    let mut cache = Cache::new(&layout);
    cache.set_layer_bytes(LAYER, &init);
    assert!(cache.layer_bytes(LAYER) == init, "the CPU gives back the FP8 layer it was given");
    reference::mla_kv_write(&x, true, &norm, EPS, &batch.inputs(), &mut cache, LAYER, &rope);
    reference::indexer_key_write(&k, &k_norm, &k_bias, K_EPS, &batch.inputs(), &mut cache, LAYER, &rope);
    let want = cache.layer_bytes(LAYER);

    let (grid, threads) = launch_shape(tokens);
    let params = KvCacheWriteParams {
        arch: 120,
        tokens: tokens as u32,
        latent: g.latent as u32,
        rope: g.rope as u32,
        d: d as u32,
        row: layout.row_elems() as u32,
        slots: slots as u32,
        max_pos: g.max_context as u32,
        threads,
        x_bf16: 1,
        w_bf16: 1,
        k_bf16: 1,
        kw_bf16: 1,
        kb_bf16: 1,
        cache_bf16: 1,
        key_fp8: 1,
    };
    let module = Module::parse(&params.render().unwrap(), "kv_cache_write.ptx").unwrap();
    let mut m = GlobalMemory::new();
    let bufs = [
        m.alloc_bytes("kv", &bytes(&x, true)),
        m.alloc_bytes("norm", &bytes(&norm, true)),
        m.alloc_bytes("k", &bytes(&k, true)),
        m.alloc_bytes("k_norm", &bytes(&k_norm, true)),
        m.alloc_bytes("k_bias", &bytes(&k_bias, true)),
        m.alloc_bytes("positions", &i32_bytes(&batch.positions)),
        m.alloc_bytes("token_seq", &i32_bytes(&batch.token_seq)),
        m.alloc_bytes("slots", &i32_bytes(&batch.slots)),
        m.alloc_bytes("cache", &init),
        m.alloc_f32("rope", &rope.table(g.max_context)),
    ];
    let mut args: Vec<KernelArg> = bufs.iter().map(|&b| KernelArg::U64(m.addr(b))).collect();
    args.push(KernelArg::F32(EPS));
    args.push(KernelArg::F32(K_EPS));
    let stats = launch(&module, KvCacheWriteParams::ENTRY, [grid, 1, 1], [threads, 1, 1], params.dynamic_smem().unwrap(), &args, &mut m).unwrap();
    let got = m.read(bufs[8]);
    let written = batch.written();
    let what = format!("fp8 kv_cache_write T={tokens} latent={} rope={} d={d}", g.latent, g.rope);
    let key_values = |r: &[u8]| -> Vec<f32> {
        let scale = f32::from_le_bytes(r[at + d..at + d + 4].try_into().unwrap());
        r[at..at + d].iter().map(|&c| e4m3_to_f32(c) * scale).collect()
    };
    let mut exact = 0;
    for s in 0..slots {
        let (gr, wr) = (&got[s * pitch..(s + 1) * pitch], &want[s * pitch..(s + 1) * pitch]);
        if !written.contains(&s) {
            assert!(gr == wr, "{what}: slot {s}, which no token writes, changed");
            continue;
        }
        let c = compare_cache(DType::BF16, 1, &gr[..g.latent * 2], &wr[..g.latent * 2]);
        assert!(c.ok(), "{what}: slot {s}'s latent beyond tolerance (max rel {:e})", c.max_rel);
        assert!(gr[g.latent * 2..at] == wr[g.latent * 2..at], "{what}: slot {s}'s rope key differs in bits");
        assert!(gr[at + d + 4..] == wr[at + d + 4..], "{what}: slot {s}'s padding was written");
        let (gv, wv) = (key_values(gr), key_values(wr));
        let amax = wv.iter().fold(0f32, |m, v| m.max(v.abs()));
        for (i, (a, b)) in gv.iter().zip(&wv).enumerate() {
            assert!((a - b).abs() <= b.abs() / 8.0 + amax / 512.0, "{what}: slot {s} key value {i}: {a} against the CPU's {b}");
        }
        exact += usize::from(gr[at..at + d + 4] == wr[at..at + d + 4]);
    }
    eprintln!("{what}: {exact} of {} written keys (codes and scale) bit for bit", written.len());
    assert!(2 * exact >= written.len(), "{what}: only {exact} of {} keys bit for bit", written.len());
    assert_eq!(stats.global_bytes_written() as usize, written.len() * (at + d + 4), "{what}: writes exactly the owned bytes");
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
        let p = KvCacheWriteParams { arch: 120, tokens, latent, rope, d: index, row, slots, max_pos, threads, x_bf16, w_bf16: 1, k_bf16: x_bf16, kw_bf16: 1, kb_bf16: 1, cache_bf16: 1, key_fp8: 0 };
        assemble(&ptxas, &format!("kv_cache_write_{name}"), &p.render().unwrap(), p.dynamic_smem().unwrap());
    }
    // GLM-5's FP8 keys: a row of 1,152 B of BF16, 128 codes and the scale, padded to 1,296 B
    for (name, tokens, arch) in [("glm5_fp8_prefill", 8192u32, 120), ("glm5_fp8_decode1", 1, 120), ("glm5_fp8_decode1_sm90", 1, 90)] {
        let (_, threads) = launch_shape(tokens as usize);
        let p = KvCacheWriteParams { arch, tokens, latent: 512, rope: 64, d: 128, row: 648, slots: 800_000, max_pos: 202_752, threads, x_bf16: 1, w_bf16: 1, k_bf16: 1, kw_bf16: 1, kb_bf16: 1, cache_bf16: 1, key_fp8: 1 };
        assemble(&ptxas, &format!("kv_cache_write_{name}"), &p.render().unwrap(), p.dynamic_smem().unwrap());
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
        p.steps.retain(|s| matches!(s.op, Op::KvCacheWrite { .. }));
    }
    kiln_compiler::passes::lower::lower(&mut plan).unwrap();
    let layers = plan.model.num_hidden_layers;
    for p in &plan.programs {
        assert_eq!(p.steps.len(), layers, "{}: one cache write (MLA and indexer key) per layer", p.name);
        for s in &p.steps {
            assert_eq!(s.launches.len(), 1, "{}: {} is lowered to one launch", p.name, s.op.name());
            let l = &s.launches[0];
            assert_eq!(plan.kernel(l.kernel).family, s.kernel);
            assert!(l.grid[0] * l.block[0] >= p.tokens as u32 * 64 && l.block[0] % 32 == 0, "{}: two warps per token ({:?} x {:?})", p.name, l.grid, l.block);
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
            let kern = plan.kernel(l.kernel);
            let Op::KvCacheWrite { kv: src, kv_norm: norm, kv_eps: eps, k, k_norm, k_bias, k_eps, layer } = step.op else { unreachable!() };
            let (src_bf16, k_bf16) = (p.buffer(src).dtype == DType::BF16, p.buffer(k).dtype == DType::BF16);
            let x = randn(&mut rng, p.buffer(src).shape.iter().product(), 0.3, 1.5, src_bf16);
            let kx = randn(&mut rng, p.buffer(k).shape.iter().product(), 0.7, 2.0, k_bf16);
            let wslot = |w| plan.weight(w).dtype == DType::BF16;
            let wn = randn(&mut rng, plan.weight(norm).shape.iter().product(), 1.0, 0.3, wslot(norm));
            let kn = randn(&mut rng, plan.weight(k_norm).shape.iter().product(), 1.0, 0.3, wslot(k_norm));
            let kb = randn(&mut rng, plan.weight(k_bias).shape.iter().product(), 0.0, 0.2, wslot(k_bias));
            let init = random_layer(&mut rng, &g);
            let mut cache = Cache::new(&kv);
            cache.set_layer_bytes(layer, &init);
            reference::mla_kv_write(&x, src_bf16, &wn, eps, &batch.inputs(), &mut cache, layer, &rope);
            reference::indexer_key_write(&kx, &kn, &kb, k_eps, &batch.inputs(), &mut cache, layer, &rope);
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
                    LaunchArg::Buffer(b) if b == k => Ok((bytes(&kx, k_bf16), false)),
                    LaunchArg::Weight(w) if w == norm => Ok((bytes(&wn, wslot(w)), false)),
                    LaunchArg::Weight(w) if w == k_norm => Ok((bytes(&kn, wslot(w)), false)),
                    LaunchArg::Weight(w) if w == k_bias => Ok((bytes(&kb, wslot(w)), false)),
                    LaunchArg::KvCache { layer: at } if at as usize == layer => Ok((init.clone(), true)),
                    LaunchArg::RopeTable => Ok((table.iter().flat_map(|f| f.to_le_bytes()).collect(), false)),
                    LaunchArg::F32(v) if v == eps || v == k_eps => Err(KernelArg::F32(v)),
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
            let module = Module::parse(&kern.ptx, &format!("{}.ptx", kern.name)).unwrap();
            launch(&module, &kern.entry, l.grid, l.block, l.smem_dynamic, &args, &mut m).unwrap();
            let got = m.read(cache_buf.expect("the launch passes its layer of the cache"));
            let what = format!("{} step {si} ({}, layer {layer})", p.name, kern.name);
            inexact += check_layer(&what, &g, &got, &want, &batch.written(), &[0..g.latent, g.latent + g.rope..g.row()], false);
            values += batch.written().len() * (g.latent + g.index);
            steps += 1;
        }
    }
    let names: Vec<&str> = plan.programs.iter().map(|p| p.name.as_str()).collect();
    eprintln!("{steps} lowered cache-write steps of the tiny tp2 plan ({}) match the CPU; {inexact} of {values} normalised values differ in the last bit", names.join(", "));
}
