//! Bytes and FLOPs of one kernel launch, per template, read off the template's code: every global
//! load and store a launch executes, counted per lane as the PTX emulator counts them
//! (`LaunchStats::global_bytes_read/written`; a value every lane of a warp loads counts 32 times).
//! Each read is a term `unique x times`: `unique` is the data it touches (its compulsory traffic),
//! `times` how often the kernel loads it (a GEMV block re-reads the activations, an attention
//! block per head group re-reads the selected latent rows). `tests/perf.rs` holds these counts
//! against the emulator's, launch by launch and class by class.

use super::load::Load;
use crate::plan::{Arch, KernelInfo, Launch, Plan, Step};
use serde::Serialize;

/// Where a load goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Class {
    /// Weight slots (checkpoint tensors and their scales).
    Weights,
    /// Program buffers other than the inputs (activations, routing, top-k lists, MoE scratch).
    Activations,
    /// The KV cache (latent, rope key, indexer key).
    Kv,
    /// The program inputs (ids, positions, token_seq, slots, page table, logit rows) and the RoPE table.
    Aux,
}

/// Bytes by class; `written` counts every store.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct Bytes {
    pub weights: f64,
    pub activations: f64,
    pub kv: f64,
    pub aux: f64,
    pub written: f64,
}

impl Bytes {
    pub fn read(&self) -> f64 {
        self.weights + self.activations + self.kv + self.aux
    }

    pub fn total(&self) -> f64 {
        self.read() + self.written
    }

    fn class(&mut self, c: Class) -> &mut f64 {
        match c {
            Class::Weights => &mut self.weights,
            Class::Activations => &mut self.activations,
            Class::Kv => &mut self.kv,
            Class::Aux => &mut self.aux,
        }
    }

    pub fn add(&mut self, o: &Bytes) {
        self.weights += o.weights;
        self.activations += o.activations;
        self.kv += o.kv;
        self.aux += o.aux;
        self.written += o.written;
    }
}

/// Floating-point operations (a multiply-add is 2) by the unit that runs them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct Flops {
    /// Block-scaled FP4 `mma` (sm_120a).
    pub fp4_mma: f64,
    /// BF16 / F16 `mma` (F32 activations as three BF16 planes count three times).
    pub bf16_mma: f64,
    /// FP32 FMA on the CUDA cores.
    pub fp32: f64,
}

impl Flops {
    pub fn add(&mut self, o: &Flops) {
        self.fp4_mma += o.fp4_mma;
        self.bf16_mma += o.bf16_mma;
        self.fp32 += o.fp32;
    }
}

/// What one launch costs, before any timing.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct Cost {
    /// Loads and stores as the kernel executes them.
    pub bytes: Bytes,
    /// The same, each distinct byte once (what an ideal kernel would move).
    pub compulsory: Bytes,
    pub flops: Flops,
    /// Blocks that do the launch's work (an MoE gate/up block whose expert got no token exits
    /// after its scan and does not count).
    pub blocks: f64,
    /// Of `bytes`, those a block moves only after the launch's other blocks are done (the
    /// indexer selection's last chunk reading every chunk's list): they take one SM's share of
    /// the bandwidth, whatever the launch's occupancy.
    pub serial: f64,
}

impl Cost {
    /// The costs summed (a merged launch's parts).
    pub fn sum(parts: &[Cost]) -> Cost {
        let mut s = Cost::default();
        for c in parts {
            s.bytes.add(&c.bytes);
            s.compulsory.add(&c.compulsory);
            s.flops.add(&c.flops);
            s.blocks += c.blocks;
            s.serial += c.serial;
        }
        s
    }

    fn read(&mut self, class: Class, unique: f64, times: f64) {
        *self.bytes.class(class) += unique * times;
        *self.compulsory.class(class) += unique.min(unique * times);
    }

    fn write(&mut self, bytes: f64) {
        self.bytes.written += bytes;
        self.compulsory.written += bytes;
    }
}

/// The template's shape parameters by name.
struct Params<'a>(&'a KernelInfo);

impl Params<'_> {
    fn v(&self, name: &str) -> Result<f64, String> {
        self.0.param(name).map(|v| v as f64).ok_or_else(|| format!("{} has no parameter {name}", self.0.name))
    }

    /// A parameter newer than some plans of this format: `default` where the kernel lacks it.
    fn v_or(&self, name: &str, default: f64) -> f64 {
        self.v(name).unwrap_or(default)
    }

    /// Element size of a `*_BF16` flag: 2 for BF16, 4 for F32.
    fn size(&self, flag: &str) -> Result<f64, String> {
        Ok(if self.v(flag)? == 1.0 { 2.0 } else { 4.0 })
    }
}

fn ceil_div(a: f64, b: f64) -> f64 {
    (a / b).ceil()
}

/// The cost of launch `li` of `step` under `load` (one rank); a merged launch's is its parts'
/// summed ([`launch_part_costs`]).
pub fn launch_cost(plan: &Plan, step: &Step, li: usize, load: &Load) -> Result<Cost, String> {
    Ok(Cost::sum(&launch_part_costs(plan, step, li, load)?))
}

/// The cost of each kernel launch `li` of `step` runs: a merged launch's parts, each on its own
/// grid, else the launch alone. A chained part's cost includes its head's arrivals (one counter
/// atomic per head block: 4 B read, 4 B written).
pub fn launch_part_costs(plan: &Plan, step: &Step, li: usize, load: &Load) -> Result<Vec<Cost>, String> {
    let l = step.launches.get(li).ok_or_else(|| format!("step has no launch {li}"))?;
    let parts = plan.part_launches(l);
    let info = &plan.kernel(l.kernel).parts;
    let mut costs = parts.iter().map(|part| kernel_cost(plan, part, load)).collect::<Result<Vec<_>, _>>()?;
    for i in (1..costs.len()).filter(|&i| info.get(i).is_some_and(|q| q.tail)) {
        let head_blocks = parts[i - 1].grid.iter().map(|&g| g as f64).product::<f64>();
        costs[i].read(Class::Activations, 4.0 * head_blocks, 1.0);
        costs[i].write(4.0 * head_blocks);
    }
    Ok(costs)
}

/// The cost of one template kernel's launch `l`.
fn kernel_cost(plan: &Plan, l: &Launch, load: &Load) -> Result<Cost, String> {
    let k = plan.kernel(l.kernel);
    let p = Params(k);
    let grid = l.grid.iter().map(|&g| g as f64).product::<f64>();
    let threads = l.block.iter().map(|&b| b as f64).product::<f64>();
    let mut c = Cost { blocks: grid, ..Default::default() };
    let tokens = &load.tokens;
    let active = tokens.active() as f64;
    // An FP4 "mma" on sm_90a is the decoded f16 mma.
    let fp4_is_mma = plan.target.arch != Arch::Sm90a;
    match k.template.as_str() {
        "embed" => {
            // one block per token: every thread loads the id, the row only on the rank owning it
            let (t, h) = (p.v("TOKENS")?, p.v("H")?);
            c.read(Class::Aux, 4.0 * t, threads);
            c.read(Class::Weights, load.embed_rows * h * 2.0, 1.0);
            c.write(t * h * p.size("OUT_BF16")?);
        }
        "rmsnorm" => {
            // one block per row (padding rows too), each loading the weight; CB column blocks
            // each read the whole row and their columns of the weight
            let (rows, h) = (p.v("ROWS")?, p.v("H")?);
            c.read(Class::Activations, rows * h * p.size("X_BF16")?, p.v("CB")?);
            if p.v("RES")? == 1.0 {
                let rs = p.size("RES_BF16")?;
                c.read(Class::Activations, rows * h * rs, 1.0);
                c.write(rows * h * rs);
            }
            c.read(Class::Weights, h * p.size("W_BF16")?, rows);
            c.write(rows * h * p.size("OUT_BF16")?);
        }
        "add" => {
            let n = p.v("N")?;
            c.read(Class::Activations, n * (p.size("A_BF16")? + p.size("B_BF16")?), 1.0);
            c.write(n * p.size("OUT_BF16")?);
        }
        "gather_rows" => {
            let (rows, h) = (p.v("OUT_ROWS")?, p.v("H")?);
            c.read(Class::Aux, 4.0 * rows, threads);
            c.read(Class::Activations, load.logit_rows.min(rows) * h * p.size("IN_BF16")?, 1.0);
            c.write(rows * h * p.size("OUT_BF16")?);
        }
        "linear_bf16_gemv" => {
            // every block stages all M rows of x; each weight byte is loaded once
            let (m, n, kk) = (p.v("M")?, p.v("N")?, p.v("K")?);
            let x = (m * kk * p.size("X_BF16")? / 16.0).floor() * 16.0;
            c.read(Class::Activations, x, grid);
            c.read(Class::Weights, n * kk * 2.0, 1.0);
            c.write(m * n * p.size("OUT_BF16")?);
            c.flops.fp32 += 2.0 * m * n * kk;
        }
        "linear_nvfp4_gemv" => {
            // as the BF16 GEMV (codes K/2 + scales K/16 per row); thread 0 loads the part scalars
            let (m, n, kk, parts) = (p.v("M")?, p.v("N")?, p.v("K")?, p.v("PARTS")?);
            c.read(Class::Weights, 8.0 * parts, grid);
            c.read(Class::Weights, n * kk * 9.0 / 16.0, 1.0);
            c.read(Class::Activations, m * kk * p.size("X_BF16")?, grid);
            c.write(m * p.v("TASKS")? * p.size("OUT_BF16")?);
            c.flops.fp32 += 2.0 * m * n * kk;
        }
        "linear_bf16_gemm" => {
            // weights once per row block (grid.y), activations once per column block (grid.x),
            // each K slice (grid.z) its share; the tensor cores run the padded tiles. K over
            // KS > 1 blocks: every slice's f32 partials written once and read once (by the
            // tile's last block), and one counter atomic per block (4 B read, 4 B written).
            // BATCH > 1: grid.z runs that many GEMMs of these shapes, each its own operands
            let (m, n, kk) = (p.v("M")?, p.v("N")?, p.v("K")?);
            let xs = p.size("X_BF16")?;
            let (gx, gy) = (l.grid[0] as f64, l.grid[1] as f64);
            let batch = p.v_or("BATCH", 1.0);
            c.read(Class::Weights, batch * n * kk * 2.0, gy);
            c.read(Class::Activations, batch * m * kk * xs, gx);
            // SEGS > 1: each segment's columns in its output's dtype (bit s of OUT_BF16)
            let segs = p.v("SEGS")? as usize;
            if segs == 1 {
                c.write(batch * m * n * p.size("OUT_BF16")?);
            } else {
                let starts = [0.0, p.v("C1")?, p.v("C2")?, p.v("C3")?];
                let mask = p.v("OUT_BF16")? as u32;
                for s in 0..segs {
                    let end = if s + 1 == segs { n } else { starts[s + 1] };
                    c.write(m * (end - starts[s]) * if mask >> s & 1 == 1 { 2.0 } else { 4.0 });
                }
            }
            let ks = p.v("KS")?;
            if ks > 1.0 {
                c.read(Class::Activations, ks * m * n * 4.0, 1.0);
                c.read(Class::Activations, 4.0, grid);
                c.write(ks * m * n * 4.0 + 4.0 * grid);
            }
            if p.v("NORM")? == 1.0 {
                // every block reads its rows in full for their sums of squares (x again: no
                // compulsory bytes), and the norm weight of its K slice (lanes of g = 0)
                *c.bytes.class(Class::Activations) += m * kk * 2.0 * gx * l.grid[2] as f64;
                c.read(Class::Weights, kk * p.size("NW_BF16")?, gx * gy);
            }
            let planes = if xs == 2.0 { 1.0 } else { 3.0 };
            let (mt, nt) = (p.v("MT")?, p.v("NT")?);
            let (bm, bn, kstep) = if p.v("SPLIT")? == 1.0 { (16.0 * mt, 8.0 * nt, 16.0) } else { (32.0 * mt, 128.0, 16.0 * p.v("KB")?) };
            c.flops.bf16_mma += 2.0 * bm * gy * bn * gx * ceil_div(kk, kstep) * kstep * planes * batch;
        }
        "linear_nvfp4_gemm" => {
            // as the BF16 GEMM, per launch one part (or gate + up); thread 0 loads the scalars
            let (m, kk, rows) = (p.v("M")?, p.v("K")?, p.v("ROWS")?);
            let silu = p.v("SILU")?;
            let (gx, gy) = (l.grid[0] as f64, l.grid[1] as f64);
            c.read(Class::Weights, 8.0 * (silu + 1.0), grid);
            c.read(Class::Weights, rows * (silu + 1.0) * kk * 9.0 / 16.0, gy);
            c.read(Class::Activations, m * kk * p.size("X_BF16")?, gx);
            c.write(m * rows * p.size("OUT_BF16")?);
            // K over SLICES > 1 blocks: as the BF16 GEMM's, f32 sums of gate and up with SiLU
            let slices = p.v("SLICES")?;
            if slices > 1.0 {
                let sums = slices * m * rows * (silu + 1.0) * 4.0;
                c.read(Class::Activations, sums, 1.0);
                c.read(Class::Activations, 4.0, grid);
                c.write(sums + 4.0 * grid);
            }
            let (mt, nt) = (p.v("MT")?, p.v("NT")?);
            let (bm, bn, kstep) = if p.v("SPLIT")? == 1.0 { (16.0 * mt, 8.0 * nt, 64.0) } else { (64.0, 128.0, 64.0 * p.v("KS")?) };
            let f = 2.0 * bm * gy * bn * gx * ceil_div(kk, kstep) * kstep;
            if fp4_is_mma {
                c.flops.fp4_mma += f;
            } else {
                c.flops.bf16_mma += f;
            }
        }
        "router" => {
            // selection only (the gate product is its own GEMV/GEMM launch): one block per
            // token, each thread loading its experts' logits and biases
            let (t, e, top) = (p.v("TOKENS")?, p.v("EXPERTS")?, p.v("TOP_K")?);
            c.read(Class::Activations, t * e * 4.0, 1.0);
            c.read(Class::Weights, e * p.size("BIAS_BF16")?, t);
            c.write(t * top * (4.0 + p.size("W_BF16")?));
        }
        "kv_cache_write" => {
            let t = p.v("TOKENS")?;
            // slot, token_seq and position, loaded by all 32 lanes of each of the token's two
            // warps (the MLA part, the indexer key), each of which loads its RoPE table row
            c.read(Class::Aux, 12.0 * t, 64.0);
            let (latent, rope, d) = (p.v("LATENT")?, p.v("ROPE")?, p.v("D")?);
            c.read(Class::Aux, active * rope * 4.0, 2.0);
            c.read(Class::Activations, active * (latent + rope) * p.size("X_BF16")?, 1.0);
            c.read(Class::Weights, latent * p.size("W_BF16")?, active);
            c.read(Class::Activations, active * d * p.size("K_BF16")?, 1.0);
            c.read(Class::Weights, d * (p.size("KW_BF16")? + p.size("KB_BF16")?), active);
            // the key in the cache dtype, or as FP8 codes and their scale
            let key = if p.v("KEY_FP8")? == 1.0 { d + 4.0 } else { d * p.size("CACHE_BF16")? };
            c.write(active * ((latent + rope) * p.size("CACHE_BF16")? + key));
        }
        "indexer_topk" => indexer_topk(&p, l, load, &mut c)?,
        "mla_attention" => mla_attention(&p, l, load, &mut c)?,
        "mla_split" => mla_split(&p, l, &mut c)?,
        "moe_gate_up" => moe_gate_up(&p, l, load, &mut c)?,
        "moe_down" => moe_down(&p, l, load, &mut c)?,
        other => return Err(format!("no cost model for template {other} ({})", k.name)),
    }
    Ok(c)
}

/// MODE 0: one block per token: tokens that see more than TOPK positions score every cached
/// indexer key on the CUDA cores (the whole context); the others, and padding, only write their
/// list. MODE 1 (decode): the scoring alone, grid.y blocks per token looping over its tiles of
/// THREADS positions, each block with a tile staging the token's q and weights, every position's
/// score written. MODE 2: the selection alone, reading those scores: one block per token, or
/// with CHUNK, past FAST positions, a block per chunk of CHUNK positions (its scores read, its
/// list of TOPK keys and positions written, its arrival counted) and then the token's last
/// chunk reading every list's keys and the positions it takes (`Cost::serial`). TT = 2 (MODE 0,
/// lowered for prefill programs only, whose rows are one sequence's): a block per two rows; a
/// pair of rows that both score reads the longer row's page-table entries and keys once and
/// scores each for both, any other pair each row's. STRIDE > 1: the rank's rows are tokens
/// rank, rank + STRIDE, ... of the program's.
fn indexer_topk(p: &Params, l: &Launch, load: &Load, c: &mut Cost) -> Result<(), String> {
    let (heads, dim, rope, topk, page) = (p.v("HEADS")?, p.v("DIM")?, p.v("ROPE")?, p.v("TOPK")?, p.v("PAGE")?);
    let mode = p.v("MODE")?;
    let tt = p.v_or("TT", 1.0);
    // STRIDE > 1 (a sequence-parallel indexer): this rank's rows, every STRIDE-th token from
    // its rank
    let stride = p.v_or("STRIDE", 1.0) as usize;
    let own;
    let tokens = if stride > 1 {
        own = load.tokens.every(load.rank % stride, stride);
        &own
    } else {
        &load.tokens
    };
    let rows = l.grid[0] as f64 * tt;
    let tiles = l.grid[1] as f64;
    let threads = l.block[0] as f64;
    let positions = tokens.sum(|n| if n > topk { n } else { 0.0 });
    let scan = |n: f64| if n > topk { n } else { 0.0 };
    // MODE 1: the blocks along y that take a shared pair as a pair (those whose first tile is
    // inside both rows; the others take its rows one after the other)
    // rows 2i and 2i + 1 (TT = 2): each row's scanned positions, and whether the pair shares its
    // keys (one sequence, both rows scored)
    let pairs: Vec<(f64, f64, bool)> = if tt == 2.0 {
        tokens
            .pairs()
            .iter()
            .map(|&(a, b, one_sequence)| {
                let (na, nb) = (a.map_or(0.0, scan), b.map_or(0.0, scan));
                (na, nb, one_sequence && na > 0.0 && nb > 0.0)
            })
            .collect()
    } else {
        Vec::new()
    };
    let pair_blocks = |short: f64| (short / threads).ceil().min(tiles);
    // the token's token_seq and position: every thread loads them, in MODE 1 and 2 thread 0
    // per block (MODE 1 pairs: both rows' at once)
    c.read(Class::Aux, 8.0 * rows, if mode == 0.0 { threads } else { tiles });
    if mode == 2.0 {
        c.write(rows * topk * 4.0);
        c.read(Class::Activations, positions * 4.0, 1.0);
        let (fast, chunk) = (p.v_or("FAST", 0.0), p.v_or("CHUNK", 0.0));
        let chunks = |n: f64| if chunk > 0.0 && n > fast { (n / chunk).ceil() } else { 0.0 };
        let lists = tokens.sum(chunks);
        // a list per chunk, its arrival (an atomic: 4 B read and written); the last chunk's
        // reads of every list's keys and of the TOPK positions it takes
        c.write(lists * (2.0 * topk * 4.0 + 4.0));
        c.read(Class::Activations, lists * 4.0, 1.0);
        let tail = |n: f64| if chunks(n) > 0.0 { (chunks(n) + 1.0) * topk * 4.0 } else { 0.0 };
        c.read(Class::Activations, tokens.sum(tail), 1.0);
        // ... and its output (counted with every row's above)
        c.serial = tokens.max(|n| if chunks(n) > 0.0 { tail(n) + topk * 4.0 } else { 0.0 });
        c.blocks = rows + tokens.sum(|n| (chunks(n) - 1.0).max(0.0));
        return Ok(());
    }
    if mode == 0.0 {
        c.write(rows * topk * 4.0);
    } else {
        c.write(positions * 4.0);
    }
    // blocks that stage q and the head weights
    let staging = tokens.sum(|n| if n <= topk { 0.0 } else if mode == 1.0 { (n / threads).ceil().min(tiles) } else { 1.0 });
    if mode == 1.0 {
        // blocks without a tile exit at once (a pair's blocks: those with a tile of either row)
        c.blocks = if tt == 2.0 { pairs.iter().map(|&(na, nb, _)| (na.max(nb) / threads).ceil().min(tiles)).sum::<f64>() } else { staging }.max(1.0);
    }
    let pages = tokens.sum(|n| if n > topk { (n / page).ceil() } else { 0.0 });
    // positions whose key a block loads, and scores computed: a shared pair loads the longer
    // row's positions once and scores each for both (MODE 0, prefill: one sequence), in MODE 1
    // only in the blocks that take it as a pair (a tile of a block past the shorter row scores
    // the longer row alone)
    let (keys, scored, pages) = if tt == 2.0 {
        pairs.iter().fold((0.0, 0.0, 0.0), |(k, s, g), &(na, nb, shared)| {
            if !shared {
                return (k + na + nb, s + na + nb, g + (na / page).ceil() + (nb / page).ceil());
            }
            let (short, n) = (na.min(nb), na.max(nb));
            let twice = if mode == 1.0 {
                // tile t of the longer row: block t mod grid.y, a pair's if that block's first
                // tile is inside the shorter row
                (0..(n / threads).ceil() as u64).map(|t| if ((t as f64) % tiles) < pair_blocks(short) { (n - t as f64 * threads).min(threads) } else { 0.0 }).sum::<f64>()
            } else {
                n
            };
            (k + n, s + n + twice, g + (n / page).ceil())
        })
    } else {
        (positions, positions, pages)
    };
    // q: a thread per (even, odd) pair, each loaded once; the table's (cos, sin) once per rope
    // pair of every head, or, when THREADS is a multiple of DIM / 2 (every pair a thread takes
    // has the same dims), once per thread whose dims are rotated
    c.read(Class::Activations, staging * heads * dim * p.size("Q_BF16")?, 1.0);
    if threads % (dim / 2.0) == 0.0 {
        c.read(Class::Aux, staging * (threads / (dim / 2.0)) * (rope / 2.0) * 8.0, 1.0);
    } else {
        c.read(Class::Aux, staging * rope * 4.0, heads);
    }
    c.read(Class::Activations, staging * heads * p.size("W_BF16")?, 1.0);
    // per position: its page-table entry and its key
    c.read(Class::Aux, pages * 4.0, if pages > 0.0 { keys / pages } else { 0.0 });
    // BF16 values, or FP8 codes and their scale
    c.read(Class::Kv, keys * if p.v("KEY_FP8")? == 1.0 { dim + 4.0 } else { dim * 2.0 }, 1.0);
    c.flops.fp32 += 2.0 * scored * heads * dim;
    Ok(())
}

/// Absorbed MLA, one block per (token, head group[, split]). MODE 0: every block loads its heads'
/// W_UK and W_UV (so kv_b is read once per token) and every selected latent row (so the rows are
/// read once per head group). MODE 1 (split-KV decode): q_abs comes from the absorb launch, each
/// split block stages q_rope and its share of the top-k row, and writes its heads' softmax
/// states (padding tokens' too) instead of the output. TT = 2 (a block per two rows; lowered
/// for prefill programs only, whose rows are one sequence's by definition): a pair of tokens
/// below TOPK reads the later one's top-k row and selected rows once for both, any other pair
/// each token's.
fn mla_attention(p: &Params, l: &Launch, load: &Load, c: &mut Cost) -> Result<(), String> {
    let (heads, hg, nope, rope, v, latent) = (p.v("HEADS")?, p.v("HG")?, p.v("NOPE")?, p.v("ROPE")?, p.v("V")?, p.v("LATENT")?);
    let (topk, mma) = (p.v("TOPK")?, p.v("MMA")? == 1.0);
    let split = p.v("MODE")? == 1.0;
    let splits = l.grid[2] as f64;
    let groups = heads / hg;
    let tt = p.v_or("TT", 1.0);
    let rows = l.grid[1] as f64 * tt;
    let warps = l.block[0] as f64 / 32.0;
    let active = load.tokens.active() as f64;
    let os = p.size("OUT_BF16")?;
    let qs = p.size("Q_BF16")?;
    // lane 0 of every warp loads token_seq and position
    c.read(Class::Aux, 8.0 * rows * groups * splits, warps);
    if split {
        c.write(rows * splits * heads * (latent + 4.0) * 4.0);
        c.read(Class::Activations, active * heads * latent * 4.0, splits);
        c.read(Class::Activations, active * heads * rope * qs, splits);
        c.read(Class::Aux, active * rope * 4.0, heads * splits);
    } else {
        c.write(rows * heads * v * os);
        c.read(Class::Activations, active * heads * (nope + rope) * qs, 1.0);
        c.read(Class::Aux, active * rope * 4.0, heads);
        c.read(Class::Weights, heads * (nope + v) * latent * 2.0, active);
    }
    // selected positions per token: the top-k list's valid entries, or every cached one
    let sel = |n: f64| if topk > 0.0 { n.min(topk) } else { n };
    let selected = load.tokens.sum(sel);
    // the rows' lists the blocks read and their selected positions (a shared pair's once)
    let (lists, block_selected) = if tt == 2.0 {
        load.tokens.positions.chunks(2).fold((0.0, 0.0), |(l, s), pair| match *pair {
            [Some(a), Some(b)] if a as f64 + 1.0 <= topk && b as f64 + 1.0 <= topk => (l + 1.0, s + sel(a.max(b) as f64 + 1.0)),
            _ => {
                let real = pair.iter().flatten();
                (l + real.clone().count() as f64, s + real.map(|&p| sel(p as f64 + 1.0)).sum::<f64>())
            }
        })
    } else {
        (active, selected)
    };
    if topk > 0.0 {
        c.read(Class::Activations, lists * topk * 4.0, groups);
    }
    c.read(Class::Aux, block_selected * 4.0, groups);
    // every head group loads each selected row; MMA: the scores load latent | rope for the
    // tensor cores, the context the latent dims again that STAGE did not keep in shared memory
    // (COOP: each warp keeps its share of every row's dims, none are read again)
    let coop = p.v_or("COOP", 0.0) == 1.0;
    let unstaged = if mma && !coop { (latent - 128.0 * p.v("STAGE")?).max(0.0) } else { 0.0 };
    let row = latent + rope + unstaged;
    c.read(Class::Kv, block_selected * (latent + rope) * 2.0, groups * row / (latent + rope));
    let per_block = if split { 0.0 } else { 2.0 * hg * latent * (nope + v) };
    c.flops.fp32 += active * groups * per_block + 2.0 * selected * heads * latent;
    if mma {
        let tiles = load.tokens.sum(|n| (sel(n) / 16.0).ceil() * 16.0);
        c.flops.bf16_mma += 3.0 * 2.0 * tiles * heads * (latent + rope);
    } else {
        c.flops.fp32 += 2.0 * selected * heads * (latent + rope);
    }
    Ok(())
}

/// The other three launches of split-KV decode attention (all tokens, padding too). MODE 0
/// (absorb): W_UK once, each block the q_nope rows of its head for every token; MODE 1
/// (combine): every split's state once; MODE 2 (output): W_UV once per token group (grid y),
/// each block its head's context of every token of its group; MODE 3 (both): W_UV and every
/// split's context once, (m, l) once per slice block, the slices' f32 partial sums written and
/// read once (the head's last block), a counter atomic per block.
fn mla_split(p: &Params, l: &Launch, c: &mut Cost) -> Result<(), String> {
    let (heads, nope, v, latent) = (p.v("HEADS")?, p.v("NOPE")?, p.v("V")?, p.v("LATENT")?);
    let (tokens, splits, mode) = (p.v("TOKENS")?, p.v("SPLITS")?, p.v("MODE")?);
    let per_head = l.grid[0] as f64 / heads;
    match mode as u32 {
        0 => {
            c.read(Class::Weights, heads * nope * latent * 2.0, 1.0);
            c.read(Class::Activations, tokens * heads * nope * p.size("Q_BF16")?, l.grid[1] as f64);
            c.write(tokens * heads * latent * 4.0);
            c.flops.fp32 += 2.0 * tokens * heads * nope * latent;
        }
        1 => {
            // (m, l) per block, the context per lane
            c.read(Class::Activations, tokens * heads * splits * 8.0, per_head);
            c.read(Class::Activations, tokens * heads * splits * latent * 4.0, 1.0);
            c.write(tokens * heads * latent * 4.0);
            c.flops.fp32 += 2.0 * tokens * heads * splits * latent;
        }
        3 => {
            let slices = latent / p.v("DS")?;
            let sums = slices * tokens * heads * v * 4.0;
            c.read(Class::Weights, heads * v * latent * 2.0, 1.0);
            c.read(Class::Activations, tokens * heads * splits * 8.0, slices);
            c.read(Class::Activations, tokens * heads * splits * latent * 4.0, 1.0);
            c.read(Class::Activations, sums, 1.0);
            c.read(Class::Activations, 4.0, heads * slices);
            c.write(sums + 4.0 * heads * slices + tokens * heads * v * p.size("OUT_BF16")?);
            c.flops.fp32 += 2.0 * tokens * heads * (splits + v) * latent;
        }
        _ => {
            c.read(Class::Weights, heads * v * latent * 2.0, l.grid[1] as f64);
            c.read(Class::Activations, tokens * heads * latent * 4.0, per_head);
            c.write(tokens * heads * v * p.size("OUT_BF16")?);
            c.flops.fp32 += 2.0 * tokens * heads * v * latent;
        }
    }
    Ok(())
}

/// Weight rows a column tile of `width` columns loads per group: CUDA-core path `32/LANES`
/// columns per warp pass (columns past the tile load a valid row), tensor-core path 8 rows per warp.
fn tile_rows(width: f64, cols: f64, lanes: f64, mma: bool) -> f64 {
    if mma {
        cols
    } else {
        let per = 32.0 / lanes;
        (width / per).ceil() * per
    }
}

/// Grouped gate/up: every block (expert, column tile) scans the routing; blocks whose expert got
/// tokens quantise them and read the expert's gate and up rows once per group of G tokens. With
/// COMPACT the grid's blocks (as many along x as routed pairs) first read the routing to mark the
/// experts that got tokens, and only those that find one scan it again.
fn moe_gate_up(p: &Params, l: &Launch, load: &Load, c: &mut Cost) -> Result<(), String> {
    let (tokens, topk, experts, inter, kk) = (p.v("TOKENS")?, p.v("TOPK")?, p.v("EXPERTS")?, p.v("INTER")?, p.v("K")?);
    let (g, cols, lanes, mma) = (p.v("G")?, p.v("COLS")?, p.v("LANES")?, p.v("MMA")? == 1.0);
    let active = load.tokens.active() as f64;
    let tiles = (inter / cols).ceil();
    let e = &load.experts;
    let hit = e.sum(|n| if n > 0.0 { 1.0 } else { 0.0 });
    let scans = if p.v("COMPACT")? == 1.0 { l.grid[0] as f64 * tiles + hit * tiles } else { experts * tiles };
    c.read(Class::Aux, tokens * 4.0, scans);
    c.read(Class::Activations, active * topk * 4.0, scans);
    let pairs = e.sum(|n| n);
    let groups = e.sum(|n| (n / g).ceil());
    c.blocks = hit * tiles;
    // a working block's scalars (gate and up input_scale and weight_scale_2; with MID_FP4 the
    // down projection's input_scale, newer than plans of format 16)
    let mid_fp4 = p.v_or("MID_FP4", 0.0) == 1.0;
    c.read(Class::Weights, if mid_fp4 { 20.0 } else { 16.0 }, hit * tiles);
    c.read(Class::Activations, pairs * topk * 4.0, tiles);
    c.read(Class::Activations, pairs * kk * p.size("X_BF16")?, tiles);
    let row = if mma { kk / 2.0 + kk / 4.0 } else { kk * 9.0 / 16.0 };
    let loaded: f64 = (0..tiles as usize).map(|t| tile_rows((inter - t as f64 * cols).min(cols), cols, lanes, mma)).sum();
    // unique: the experts' gate and up rows once; loaded once per group and per clamped row
    let unique = hit * 2.0 * inter * kk * 9.0 / 16.0;
    let loads = groups * loaded * 2.0 * row;
    c.read(Class::Weights, unique, if unique > 0.0 { loads / unique } else { 0.0 });
    // mid: BF16, or with MID_FP4 e2m1 codes and an e4m3 scale per 16 values
    c.write(pairs * inter * if mid_fp4 { 9.0 / 16.0 } else { 2.0 });
    if mma {
        c.flops.fp4_mma += groups * g * loaded * 2.0 * kk * 2.0;
    } else {
        c.flops.fp32 += groups * g * loaded * 2.0 * kk * 2.0;
    }
    Ok(())
}

/// Down + combine: every block owns COLS hidden columns of every token and walks every local
/// expert that got a token (scanning the routing again for each: in global memory, or with STAGE
/// in the block's shared copy), reading that expert's down rows of its columns once per group.
fn moe_down(p: &Params, l: &Launch, load: &Load, c: &mut Cost) -> Result<(), String> {
    let (tokens, topk, inter, hidden) = (p.v("TOKENS")?, p.v("TOPK")?, p.v("INTER")?, p.v("HIDDEN")?);
    let (g, cols, lanes, mma) = (p.v("G")?, p.v("COLS")?, p.v("LANES")?, p.v("MMA")? == 1.0);
    let blocks = l.grid[0] as f64;
    let active = load.tokens.active() as f64;
    let e = &load.experts;
    let used = e.sum(|n| if n > 0.0 { 1.0 } else { 0.0 });
    let pairs = e.sum(|n| n);
    let groups = e.sum(|n| (n / g).ceil());
    // zero acc, mark the used experts, then per used expert: scalars, a scan, the groups (with
    // STAGE the scans and groups read the routing from the copy in shared memory the marking made)
    let staged = p.v("STAGE")? == 1.0;
    let scans = if staged { 0.0 } else { used };
    let group_ids = if staged { 0.0 } else { topk * 4.0 };
    // acc in global memory: zeroed, read-modify-written per (pair, column), read to round; in
    // shared memory (ACC_SMEM, newer than plans of format 16) none of it
    let acc_global = p.v_or("ACC_SMEM", 0.0) == 0.0;
    let acc = if acc_global { 4.0 } else { 0.0 };
    c.write(tokens * hidden * acc);
    c.read(Class::Aux, tokens * 4.0, blocks * (1.0 + scans));
    c.read(Class::Activations, active * topk * 4.0, blocks * (1.0 + scans));
    c.read(Class::Weights, 8.0 * used, blocks);
    c.read(Class::Activations, pairs * (group_ids + p.size("W_BF16")?), blocks);
    // every block reads every routed row of mid (MID_FP4: codes and scales, not BF16)
    c.read(Class::Activations, pairs * inter * if p.v_or("MID_FP4", 0.0) == 1.0 { 9.0 / 16.0 } else { 2.0 }, blocks);
    let row = if mma { inter / 2.0 + inter / 4.0 } else { inter * 9.0 / 16.0 };
    let loaded: f64 = (0..blocks as usize).map(|t| tile_rows((hidden - t as f64 * cols).min(cols), cols, lanes, mma)).sum();
    let unique = used * hidden * inter * 9.0 / 16.0;
    let loads = groups * loaded * row;
    c.read(Class::Weights, unique, if unique > 0.0 { loads / unique } else { 0.0 });
    // acc += w * y per (token, expert, column), then out = round(acc) (plus the shared experts')
    c.read(Class::Activations, (pairs + tokens) * hidden * acc, 1.0);
    if p.v("ADD")? == 1.0 {
        c.read(Class::Activations, tokens * hidden * p.size("ADD_BF16")?, 1.0);
    }
    c.write(pairs * hidden * acc + tokens * hidden * p.size("OUT_BF16")?);
    if mma {
        c.flops.fp4_mma += groups * g * loaded * inter * 2.0;
    } else {
        c.flops.fp32 += groups * g * loaded * inter * 2.0;
    }
    Ok(())
}
