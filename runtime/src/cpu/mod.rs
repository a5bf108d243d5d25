//! The CPU reference backend: executes a program's `Op`s step by step for every simulated
//! tensor-parallel rank, with the collectives summing (all-reduce) or concatenating (all-gather)
//! the ranks' buffers in fixed rank order.
//!
//! Numerics: every matmul accumulates in f32. In [`Precision::Bf16`] (the default) every value
//! stored into a BF16 buffer or the KV cache is rounded to BF16 exactly there, as the GPU kernels
//! do; [`Precision::F32`] keeps everything in f32 for comparison with fp32 references. NVFP4
//! layers quantise their input on the fly per 16 values ([`ActQuant::W4A4`], the GPU path) or use
//! dequantised weights with unquantised activations ([`ActQuant::W4A16`]).
//!
//! Each buffer is one Vec per program value (the CPU ignores the arena offsets); the Vecs, the
//! KV cache pages and all scratch grow on first use and are reused, so steady-state decode does
//! not allocate.

mod attention;
mod elementwise;
mod indexer;
mod kv_cache;
mod linear;
mod moe;
mod norm;
pub mod quant;
pub use norm::NORM_THREADS;
pub mod reference;
pub mod rope;
mod router;
mod scratch;
mod validate;

use crate::bind::Arena;
use crate::error::RuntimeError;
use crate::numerics::{bytes_floats, round_bf16};
use crate::plan::{AttentionForm, BufId, DType, Epilogue, LinearWeights, Op, Plan, Program, WeightId};
use kv_cache::KvCache;
use linear::{Linear, LinearScratch, Matrix};
use moe::MoeScratch;
use rope::Rope;

/// How values stored in BF16 buffers are kept.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Precision {
    /// Every buffer and the KV cache in f32 (for fp32 references).
    F32,
    /// BF16 buffers and KV cache rounded to BF16 at every store, as on the GPU.
    Bf16,
}

/// How NVFP4 layers treat their input.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ActQuant {
    /// Quantise activations to NVFP4 per 16-element block (the GPU's W4A4 GEMM).
    W4A4,
    /// Dequantised weights times unquantised activations (the upstream bf16 reference).
    W4A16,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CpuOptions {
    pub precision: Precision,
    pub act_quant: ActQuant,
    /// Run every MLA attention step in this form instead of the plan's (tests the equivalence).
    pub attention: Option<AttentionForm>,
}

impl Default for CpuOptions {
    fn default() -> Self {
        CpuOptions { precision: Precision::Bf16, act_quant: ActQuant::W4A4, attention: None }
    }
}

/// Rounding applied when a value is stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Round(pub(crate) bool);

impl Round {
    pub const NONE: Round = Round(false);
    #[cfg(test)]
    pub const BF16: Round = Round(true);

    pub fn for_dtype(dtype: DType, precision: Precision) -> Round {
        Round(dtype == DType::BF16 && precision == Precision::Bf16)
    }

    #[inline]
    pub fn apply(self, x: f32) -> f32 {
        if self.0 {
            round_bf16(x)
        } else {
            x
        }
    }
}

/// The per-token inputs every cache-aware op reads.
#[derive(Clone, Copy)]
pub(crate) struct Tokens<'a> {
    pub positions: &'a [i32],
    pub token_seq: &'a [i32],
    pub slots: &'a [i32],
    pub page_table: &'a [i32],
    pub pages_per_seq: usize,
}

impl<'a> Tokens<'a> {
    pub fn count(&self) -> usize {
        self.positions.len()
    }

    pub fn active(&self, t: usize) -> bool {
        self.token_seq[t] >= 0
    }

    /// The page-table row of token `t`'s sequence (None for padding).
    pub fn pages(&self, t: usize) -> Option<&'a [i32]> {
        let s = usize::try_from(self.token_seq[t]).ok()?;
        self.page_table.get(s * self.pages_per_seq..(s + 1) * self.pages_per_seq)
    }

    /// The cache slot token `t` writes (None for padding or slot -1).
    pub fn slot(&self, t: usize) -> Option<usize> {
        if !self.active(t) {
            return None;
        }
        usize::try_from(self.slots[t]).ok()
    }
}

/// The values of a program's input buffers for one replay (sizes as the program's buffers).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Inputs {
    pub ids: Vec<i32>,
    pub positions: Vec<i32>,
    pub token_seq: Vec<i32>,
    pub slots: Vec<i32>,
    /// `[seqs, pages_per_seq]` row-major.
    pub page_table: Vec<i32>,
    pub logit_rows: Vec<i32>,
    /// A draft program's `[tokens, hidden]` input rows ([`Program::hidden_in`]); empty for the
    /// model's own programs.
    pub hidden: Vec<f32>,
}

impl Inputs {
    /// Every input with its name and the program buffer it fills.
    pub fn by_buffer<'a>(&'a self, program: &Program) -> [(&'static str, BufId, &'a [i32]); 6] {
        let i = program.inputs;
        [
            ("ids", i.ids, &self.ids),
            ("positions", i.positions, &self.positions),
            ("token_seq", i.token_seq, &self.token_seq),
            ("slots", i.slots, &self.slots),
            ("page_table", i.page_table, &self.page_table),
            ("logit_rows", i.logit_rows, &self.logit_rows),
        ]
    }

    /// Resets every input to the program's sizes, all padding (ids 0, everything else -1,
    /// positions 0). Reuses the Vecs' capacity.
    pub fn reset(&mut self, program: &Program) {
        let i = program.inputs;
        let size = |b: BufId| numel(program, b);
        for (v, b, fill) in [
            (&mut self.ids, i.ids, 0),
            (&mut self.positions, i.positions, 0),
            (&mut self.token_seq, i.token_seq, -1),
            (&mut self.slots, i.slots, -1),
            (&mut self.page_table, i.page_table, -1),
            (&mut self.logit_rows, i.logit_rows, -1),
        ] {
            v.clear();
            v.resize(size(b), fill);
        }
        self.hidden.clear();
        self.hidden.resize(program.hidden_in.map_or(0, size), 0.0);
    }
}

fn numel(p: &Program, b: BufId) -> usize {
    p.buffer(b).shape.iter().product()
}

fn width(p: &Program, b: BufId) -> usize {
    p.buffer(b).shape.last().copied().unwrap_or(1)
}

/// One simulated rank: its weights arena, buffers, KV cache and scratch.
struct Rank {
    index: usize,
    arena: Arena,
    /// Small F32/BF16 weights (norms, biases, NVFP4 scalars) decoded once; empty for matrices.
    small: Vec<Vec<f32>>,
    /// Float buffers (BF16 and F32 dtypes), one per program value.
    f: Vec<Vec<f32>>,
    /// I32 buffers, one per program value.
    i: Vec<Vec<i32>>,
    kv: KvCache,
    lin: LinearScratch,
    moe: MoeScratch,
}

pub struct CpuBackend {
    plan: Plan,
    opts: CpuOptions,
    rope: Rope,
    ranks: Vec<Rank>,
    /// Collective staging.
    staging: Vec<f32>,
    /// The program of the last replay.
    last: Option<usize>,
    /// Worker threads of the kernels (one per core unless RAYON_NUM_THREADS says otherwise).
    pool: rayon::ThreadPool,
    /// Called before and after every step (for `kiln verify`).
    observer: Option<Observer>,
}

/// When an [`Observer`] is called.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StepPhase {
    Before,
    After,
}

/// Read access to every rank's buffers and weights between two steps.
pub struct StepView<'a> {
    ranks: &'a [Rank],
    /// Index of the program being replayed.
    pub program: usize,
    /// Index of the step in the program.
    pub step: usize,
    pub phase: StepPhase,
    plan: &'a Plan,
}

impl StepView<'_> {
    pub fn ranks(&self) -> usize {
        self.ranks.len()
    }

    /// A float buffer of `rank` (BF16 buffers hold BF16-rounded values in `Precision::Bf16`).
    pub fn buffer_f32(&self, rank: usize, buf: BufId) -> &[f32] {
        let n = numel(&self.plan.programs[self.program], buf);
        &self.ranks[rank].f[buf.0 as usize][..n]
    }

    pub fn buffer_i32(&self, rank: usize, buf: BufId) -> &[i32] {
        let n = numel(&self.plan.programs[self.program], buf);
        &self.ranks[rank].i[buf.0 as usize][..n]
    }

    /// The rank's weights arena (slot offsets as in `Plan::weights`).
    pub fn arena(&self, rank: usize) -> &[u8] {
        &self.ranks[rank].arena
    }

    /// Slots `0..slots` of one layer of `rank`'s KV cache in the GPU byte layout (`KvLayout`).
    pub fn kv_layer_bytes(&self, rank: usize, layer: usize, slots: usize) -> Vec<u8> {
        self.ranks[rank].kv.layer_bytes(layer, slots, self.plan.memory.kv.dtype)
    }

    /// Slots of the KV cache allocated so far.
    pub fn kv_slots(&self) -> usize {
        self.ranks.first().map_or(0, |r| r.kv.slots())
    }
}

/// A callback run around every step of every replay; it sees all ranks' buffers.
pub type Observer = Box<dyn FnMut(&StepView) + Send>;

/// Read-only context of one step.
struct Cx<'a> {
    plan: &'a Plan,
    program: &'a Program,
    opts: CpuOptions,
    rope: &'a Rope,
}

impl CpuBackend {
    /// Takes one weights arena per rank (from [`crate::bind::bind`]).
    pub fn new(plan: Plan, arenas: Vec<Arena>, opts: CpuOptions) -> Result<CpuBackend, RuntimeError> {
        if arenas.len() != plan.ranks() {
            return Err(RuntimeError::internal(format!("{} weight arenas for {} ranks", arenas.len(), plan.ranks())));
        }
        validate::check_plan(&plan)?;
        let values = plan.programs.iter().map(|p| p.buffers.len()).max().unwrap_or(0);
        let kv_round = match opts.precision {
            Precision::Bf16 => Round::for_dtype(plan.memory.kv.dtype, opts.precision),
            Precision::F32 => Round::NONE,
        };
        let ranks = arenas
            .into_iter()
            .enumerate()
            .map(|(index, arena)| {
                let small = decode_small(&plan, &arena)?;
                Ok(Rank {
                    index,
                    arena,
                    small,
                    f: vec![Vec::new(); values],
                    i: vec![Vec::new(); values],
                    kv: KvCache::new(&plan.memory.kv, kv_round),
                    lin: LinearScratch::default(),
                    moe: MoeScratch::default(),
                })
            })
            .collect::<Result<Vec<_>, RuntimeError>>()?;
        let rope = Rope::of_plan(&plan);
        let pool = rayon::ThreadPoolBuilder::new()
            .thread_name(|i| format!("kiln-cpu-{i}"))
            .build()
            .map_err(|e| RuntimeError::Unsupported { message: format!("cannot start the CPU worker threads: {e}") })?;
        let (f32s, pairs) = scratch_bound(&plan);
        pool.broadcast(|_| scratch::reserve(f32s, pairs));
        scratch::reserve(f32s, pairs);
        Ok(CpuBackend { plan, opts, rope, ranks, staging: Vec::new(), last: None, pool, observer: None })
    }

    pub fn plan(&self) -> &Plan {
        &self.plan
    }

    pub fn options(&self) -> CpuOptions {
        self.opts
    }

    /// The weights arena of `rank`.
    pub fn arena(&self, rank: usize) -> Option<&[u8]> {
        self.ranks.get(rank).map(|r| &r.arena[..])
    }

    /// Installs (or removes) a callback run before and after every step of every replay.
    pub fn set_observer(&mut self, observer: Option<Observer>) {
        self.observer = observer;
    }

    /// A float buffer of `rank` as the last replay of a program left it (every program value has
    /// its own storage on the CPU, so intermediate values survive the replay; for reports and
    /// step-by-step comparison).
    pub fn buffer_f32(&self, rank: usize, program: usize, buf: BufId) -> Option<&[f32]> {
        let n = numel(self.plan.programs.get(program)?, buf);
        self.ranks.get(rank)?.f.get(buf.0 as usize)?.get(..n)
    }

    /// An I32 buffer of `rank` after the last replay (see [`CpuBackend::buffer_f32`]).
    pub fn buffer_i32(&self, rank: usize, program: usize, buf: BufId) -> Option<&[i32]> {
        let n = numel(self.plan.programs.get(program)?, buf);
        self.ranks.get(rank)?.i.get(buf.0 as usize)?.get(..n)
    }

    /// The `[tokens, hidden]` final normed hidden rows the last replay left, in plans with a
    /// draft model ([`Program::hidden_out`]): what a draft step takes as input.
    pub fn hidden_out(&self) -> Option<&[f32]> {
        let last = self.last?;
        self.buffer_f32(0, last, self.plan.programs[last].hidden_out?)
    }

    /// The program the last replay ran (its buffers are what [`CpuBackend::buffer_f32`] shows).
    pub fn last_program(&self) -> Option<usize> {
        self.last
    }

    /// Slots of the KV cache allocated so far (per rank).
    pub fn kv_slots_allocated(&self) -> usize {
        self.ranks.first().map_or(0, |r| r.kv.slots())
    }

    /// Replays program `index` with `inputs`; returns its logits `[logit_rows, vocab]`.
    pub fn run(&mut self, index: usize, inputs: &Inputs) -> Result<&[f32], RuntimeError> {
        let program = self
            .plan
            .programs
            .get(index)
            .ok_or_else(|| RuntimeError::internal(format!("program {index} of {}", self.plan.programs.len())))?;
        let need = check_inputs(&self.plan, program, inputs)?;
        self.last = Some(index);
        for rank in &mut self.ranks {
            rank.kv.reserve(need)?;
            for (_, b, v) in inputs.by_buffer(program) {
                let dst = &mut rank.i[b.0 as usize];
                dst.clear();
                dst.extend_from_slice(v);
            }
            for (b, buf) in program.buffers.iter().enumerate() {
                let n: usize = buf.shape.iter().product();
                match buf.dtype {
                    DType::I32 => grow(&mut rank.i[b], n),
                    _ => grow(&mut rank.f[b], n),
                }
            }
            if let Some(b) = program.hidden_in {
                // as a BF16 buffer holds them
                let round = Round::for_dtype(program.buffer(b).dtype, self.opts.precision);
                rank.f[b.0 as usize].iter_mut().zip(&inputs.hidden).for_each(|(d, &v)| *d = round.apply(v));
            }
        }
        let cx = Cx { plan: &self.plan, program, opts: self.opts, rope: &self.rope };
        let (ranks, staging, observer) = (&mut self.ranks, &mut self.staging, &mut self.observer);
        let plan = &self.plan;
        // The whole replay runs inside the backend's pool: the kernels' parallel loops then queue
        // their tasks on the workers' own deques instead of the global injector (cheaper, and no
        // queue-block allocation per parallel loop).
        self.pool.install(|| -> Result<(), RuntimeError> {
            for (n, step) in program.steps.iter().enumerate() {
                let at = |e: RuntimeError| match e {
                    RuntimeError::Internal { message } => {
                        RuntimeError::internal(format!("{} step {n} ({}): {message}", program.name, step.op.name()))
                    }
                    other => other,
                };
                if let Some(o) = observer.as_mut() {
                    o(&StepView { ranks, program: index, step: n, phase: StepPhase::Before, plan });
                }
                match step.op {
                    Op::AllReduce { buf, residual, .. } => {
                        all_reduce(ranks, staging, &cx, buf, residual).map_err(at)?;
                        // the rmsnorm it took over, on every rank as that step ran
                        if let Some(norm) = step.op.residual_norm() {
                            ranks.iter_mut().try_for_each(|rank| rank.exec(&cx, &norm)).map_err(at)?;
                        }
                    }
                    Op::AllGather { ref pairs } => pairs.iter().try_for_each(|g| all_gather(ranks, staging, &cx, g.input, g.out)).map_err(at)?,
                    ref op => {
                        for rank in ranks.iter_mut() {
                            rank.exec(&cx, op).map_err(at)?;
                        }
                    }
                }
                if let Some(o) = observer.as_mut() {
                    o(&StepView { ranks, program: index, step: n, phase: StepPhase::After, plan });
                }
            }
            Ok(())
        })?;
        let n = numel(program, program.logits);
        Ok(&self.ranks[0].f[program.logits.0 as usize][..n])
    }
}

fn grow<T: Clone + Default>(v: &mut Vec<T>, n: usize) {
    if v.len() < n {
        v.resize(n, T::default());
    }
}

/// Validates a replay's inputs; returns the number of cache slots it needs.
pub(crate) fn check_inputs(plan: &Plan, p: &Program, inputs: &Inputs) -> Result<usize, RuntimeError> {
    let bad = |what: &str, message: String| RuntimeError::input(format!("program {} input `{what}`", p.name), message);
    let pi = p.inputs;
    for (what, b, v) in inputs.by_buffer(p) {
        if v.len() != numel(p, b) {
            return Err(bad(what, format!("{} values, the program takes {}", v.len(), numel(p, b))));
        }
    }
    let hidden = p.hidden_in.map_or(0, |b| numel(p, b));
    if inputs.hidden.len() != hidden {
        return Err(bad("hidden", format!("{} values, the program takes {hidden}", inputs.hidden.len())));
    }
    let kv = &plan.memory.kv;
    let page_size = kv.page_size.max(1);
    let pages_per_seq = width(p, pi.page_table);
    let vocab = plan.model.vocab_size;
    let mut need = 0usize;
    for (i, &page) in inputs.page_table.iter().enumerate() {
        if page < -1 || page >= kv.pages as i32 {
            return Err(bad("page_table", format!("entry {i} is page {page}; the cache has {} pages", kv.pages)));
        }
        if page >= 0 {
            need = need.max((page as usize + 1) * page_size);
        }
    }
    for t in 0..p.tokens {
        let id = inputs.ids[t];
        if id < 0 || id as usize >= vocab {
            return Err(bad("ids", format!("token id {id} at row {t} is outside the vocabulary of {vocab}")));
        }
        let seq = inputs.token_seq[t];
        if seq < -1 || seq >= p.seqs as i32 {
            return Err(bad("token_seq", format!("row {t} names sequence {seq}; the program has {}", p.seqs)));
        }
        let slot = inputs.slots[t];
        if slot < -1 || slot as i64 >= (kv.pages * page_size) as i64 {
            return Err(bad("slots", format!("row {t} writes slot {slot}; the cache has {} slots", kv.pages * page_size)));
        }
        if seq < 0 {
            continue;
        }
        let pos = inputs.positions[t];
        if pos < 0 || pos as usize >= pages_per_seq * page_size {
            return Err(bad("positions", format!("row {t} is at position {pos}; a sequence holds {}", pages_per_seq * page_size)));
        }
        let row = &inputs.page_table[seq as usize * pages_per_seq..(seq as usize + 1) * pages_per_seq];
        if let Some(missing) = row[..=pos as usize / page_size].iter().position(|&pg| pg < 0) {
            return Err(bad("page_table", format!("row {t} (position {pos}) needs page {missing} of sequence {seq}, which is unassigned")));
        }
        if slot >= 0 && kv_cache::slot_of(row, page_size, pos as usize) != Some(slot as usize) {
            return Err(bad("slots", format!("row {t} writes slot {slot}, but position {pos} of sequence {seq} lives elsewhere")));
        }
        need = need.max(slot.max(0) as usize + 1);
    }
    for (r, &row) in inputs.logit_rows.iter().enumerate() {
        if row < -1 || row >= p.tokens as i32 {
            return Err(bad("logit_rows", format!("entry {r} names row {row}; the program has {} rows", p.tokens)));
        }
    }
    Ok(need)
}

/// Upper bounds of the per-thread scratch any kernel of the plan takes: (f32 values, pairs).
fn scratch_bound(plan: &Plan) -> (usize, usize) {
    let m = &plan.model;
    let context = plan.memory.kv.max_context.max(1);
    let mut f32s = m.index_n_heads * m.index_head_dim;
    f32s = f32s.max(m.hidden_size + 2 * m.n_routed_experts + 2 * m.n_group.max(1));
    for p in &plan.programs {
        for step in &p.steps {
            let need = step.op.leaves().iter().map(|op| match *op {
                Op::Linear { k, .. } | Op::LinearGroup { k, .. } => k,
                Op::MoeExperts { hidden, intermediate, .. } => hidden.max(intermediate),
                Op::MlaAttention { topk, .. } => {
                    let selected = topk.map_or(context, |b| width(p, b));
                    let (nope, dv, r) = (m.qk_nope_head_dim, m.v_head_dim, m.kv_lora_rank);
                    (nope + dv) * r + m.qk_rope_head_dim + selected + 2 * r.max(nope).max(dv)
                }
                _ => 0,
            }).max().unwrap_or(0);
            f32s = f32s.max(need);
        }
    }
    (f32s, context)
}

/// Decodes every F32 slot and every BF16 vector (norm weights, biases, scalars) to f32.
fn decode_small(plan: &Plan, arena: &[u8]) -> Result<Vec<Vec<f32>>, RuntimeError> {
    plan.weights
        .iter()
        .map(|slot| {
            let bytes = arena
                .get(slot.offset as usize..(slot.offset + slot.bytes) as usize)
                .ok_or_else(|| RuntimeError::internal(format!("slot `{}` lies outside the weights arena", slot.name)))?;
            Ok(match slot.dtype {
                DType::F32 => bytes_floats(bytes, false),
                DType::BF16 if slot.shape.len() <= 1 => bytes_floats(bytes, true),
                _ => Vec::new(),
            })
        })
        .collect()
}

/// `buf` summed over the ranks in rank order (f32, then rounded to its dtype); with `residual`,
/// then `residual = round(residual + buf)` on every rank: the rmsnorm's residual add, bit for bit.
fn all_reduce(ranks: &mut [Rank], staging: &mut Vec<f32>, cx: &Cx, buf: BufId, residual: Option<BufId>) -> Result<(), RuntimeError> {
    let n = numel(cx.program, buf);
    let dtype = cx.program.buffer(buf).dtype;
    if dtype == DType::I32 {
        return Err(RuntimeError::internal("all-reduce of an I32 buffer"));
    }
    let round = Round::for_dtype(dtype, cx.opts.precision);
    let acc = scratch::grow(staging, n);
    acc.copy_from_slice(&ranks[0].f[buf.0 as usize][..n]);
    for rank in &ranks[1..] {
        acc.iter_mut().zip(&rank.f[buf.0 as usize][..n]).for_each(|(a, &v)| *a += v);
    }
    acc.iter_mut().for_each(|v| *v = round.apply(*v));
    for rank in ranks.iter_mut() {
        rank.f[buf.0 as usize][..n].copy_from_slice(acc);
        if let Some(r) = residual {
            elementwise::add_in_place(&mut rank.f[r.0 as usize][..n], acc, Round::for_dtype(cx.program.buffer(r).dtype, cx.opts.precision));
        }
    }
    Ok(())
}

fn all_gather(ranks: &mut [Rank], staging: &mut Vec<f32>, cx: &Cx, input: BufId, out: BufId) -> Result<(), RuntimeError> {
    // `out` holds [rows, ranks x w] whatever its shape (see Op::AllGather)
    let w = width(cx.program, input);
    let rows = numel(cx.program, input) / w.max(1);
    let wo = w * ranks.len();
    if numel(cx.program, out) != rows * wo {
        return Err(RuntimeError::internal("all-gather shapes do not match the rank count"));
    }
    if cx.program.buffer(out).dtype == DType::I32 {
        // (lists of positions: copied as they are)
        let mut acc = vec![0i32; rows * wo];
        place_rank_rows(ranks.iter().map(|r| &r.i[input.0 as usize][..rows * w]), w, &mut acc);
        ranks.iter_mut().for_each(|r| r.i[out.0 as usize][..rows * wo].copy_from_slice(&acc));
        return Ok(());
    }
    let round = Round::for_dtype(cx.program.buffer(out).dtype, cx.opts.precision);
    let acc = scratch::grow(staging, rows * wo);
    place_rank_rows(ranks.iter().map(|r| &r.f[input.0 as usize][..rows * w]), w, acc);
    acc.iter_mut().for_each(|a| *a = round.apply(*a));
    ranks.iter_mut().for_each(|r| r.f[out.0 as usize][..rows * wo].copy_from_slice(acc));
    Ok(())
}

/// Row j of `out` = row j of each rank's `w`-wide rows, in rank order.
fn place_rank_rows<'a, T: Copy + 'a>(ranks: impl ExactSizeIterator<Item = &'a [T]>, w: usize, out: &mut [T]) {
    let wo = w * ranks.len();
    for (r, src) in ranks.enumerate() {
        for (row, s) in src.chunks_exact(w.max(1)).enumerate() {
            out[row * wo + r * w..row * wo + (r + 1) * w].copy_from_slice(s);
        }
    }
}

/// The arena bytes of a slot.
fn slot_bytes<'a>(plan: &Plan, arena: &'a [u8], id: WeightId) -> &'a [u8] {
    let s = plan.weight(id);
    &arena[s.offset as usize..(s.offset + s.bytes) as usize]
}

/// A linear layer's weights in a rank's arena (`small`: its decoded scalars).
fn linear_of<'a>(plan: &Plan, arena: &'a [u8], small: &'a [Vec<f32>], w: &LinearWeights, k: usize, parts: &'a [usize]) -> Linear<'a> {
    match *w {
        LinearWeights::Bf16 { weight } => {
            Linear { matrix: Matrix::Bf16(slot_bytes(plan, arena, weight)), k, parts, scale_2: &[], input_scale: &[] }
        }
        LinearWeights::Nvfp4 { weight, scale, scale_2, input_scale } => Linear {
            matrix: Matrix::Nvfp4 { packed: slot_bytes(plan, arena, weight), scales: slot_bytes(plan, arena, scale) },
            k,
            parts,
            scale_2: &small[scale_2.0 as usize],
            input_scale: &small[input_scale.0 as usize],
        },
    }
}

/// The token inputs of the current replay, from a rank's I32 buffers.
fn tokens_in<'a>(i: &'a [Vec<i32>], cx: &Cx) -> Tokens<'a> {
    let p = cx.program;
    let pi = p.inputs;
    let get = |b: BufId| &i[b.0 as usize][..numel(p, b)];
    Tokens {
        positions: get(pi.positions),
        token_seq: get(pi.token_seq),
        slots: get(pi.slots),
        page_table: get(pi.page_table),
        pages_per_seq: width(p, pi.page_table),
    }
}

impl Rank {
    /// `out = input @ W^T` over the weights' `parts` (rows each), with its epilogue.
    #[allow(clippy::too_many_arguments)]
    fn linear(&mut self, cx: &Cx, input: BufId, weights: &LinearWeights, parts: &[usize], k: usize, epilogue: Epilogue, out: BufId) {
        let p = cx.program;
        let n = |b: BufId| numel(p, b);
        let mut o = std::mem::take(&mut self.f[out.0 as usize]);
        let lin = linear_of(cx.plan, &self.arena, &self.small, weights, k, parts);
        let round = Round::for_dtype(p.buffer(out).dtype, cx.opts.precision);
        linear::linear(&self.f[input.0 as usize][..n(input)], tokens_of(p, input, k), &lin, cx.opts.act_quant, epilogue, round, &mut self.lin, &mut o[..n(out)]);
        self.f[out.0 as usize] = o;
    }

    fn exec(&mut self, cx: &Cx, op: &Op) -> Result<(), RuntimeError> {
        let (plan, p) = (cx.plan, cx.program);
        let n = |b: BufId| numel(p, b);
        let round = |b: BufId| Round::for_dtype(p.buffer(b).dtype, cx.opts.precision);
        let take = |v: &mut Vec<Vec<f32>>, b: BufId| std::mem::take(&mut v[b.0 as usize]);
        match *op {
            Op::LinearGroup { input, norm, k, ref members } => {
                // the norm into its scratch rows, then each member as its own Linear (no
                // allocation: the decode loop allocates nothing)
                let x = match norm {
                    Some(nm) => {
                        let mut o = take(&mut self.f, nm.normed);
                        let w = &self.small[nm.weight.0 as usize];
                        for (xr, or) in self.f[input.0 as usize][..n(input)].chunks_exact(k).zip(o[..n(nm.normed)].chunks_exact_mut(k)) {
                            norm::rms_norm_row(xr, w, nm.eps, round(input), round(nm.normed), or);
                        }
                        self.f[nm.normed.0 as usize] = o;
                        nm.normed
                    }
                    None => input,
                };
                for g in members {
                    self.linear(cx, x, &LinearWeights::Bf16 { weight: g.weight }, &[g.rows], k, Epilogue::None, g.out);
                }
            }
            Op::Embed { ids, table, vocab_rows, out } => {
                let h = width(p, out);
                let mut o = take(&mut self.f, out);
                let table = slot_bytes(plan, &self.arena, table);
                let first = (self.index * vocab_rows) as i64;
                elementwise::embed(&self.i[ids.0 as usize], table, vocab_rows, first, h, round(out), &mut o[..n(out)]);
                self.f[out.0 as usize] = o;
            }
            Op::RmsNorm { input, residual, weight, eps, out } => {
                let h = width(p, out);
                let w = &self.small[weight.0 as usize];
                let mut o = take(&mut self.f, out);
                let source = match residual {
                    Some(r) => {
                        let mut res = take(&mut self.f, r);
                        elementwise::add_in_place(&mut res[..n(r)], &self.f[input.0 as usize][..n(input)], round(r));
                        self.f[r.0 as usize] = res;
                        r
                    }
                    None => input,
                };
                let x = &self.f[source.0 as usize][..n(source)];
                for (xr, or) in x.chunks_exact(h).zip(o[..n(out)].chunks_exact_mut(h)) {
                    norm::rms_norm_row(xr, w, eps, round(source), round(out), or);
                }
                self.f[out.0 as usize] = o;
            }
            Op::Linear { input, ref weights, ref parts, k, epilogue, out } => {
                let rows: [usize; 2];
                let parts: &[usize] = match parts.as_slice() {
                    [a] => {
                        rows = [a.rows, 0];
                        &rows[..1]
                    }
                    [a, b] => {
                        rows = [a.rows, b.rows];
                        &rows[..]
                    }
                    _ => return Err(RuntimeError::internal(format!("a linear with {} parts", parts.len()))),
                };
                self.linear(cx, input, weights, parts, k, epilogue, out);
            }
            Op::KvCacheWrite { kv, kv_norm, kv_eps, k, k_norm, k_bias, k_eps, layer } => {
                let tk = tokens_in(&self.i, cx);
                kv_cache::mla_write(&self.f[kv.0 as usize][..n(kv)], &self.small[kv_norm.0 as usize], kv_eps, round(kv), &tk, &mut self.kv, layer, cx.rope);
                let (w, b) = (&self.small[k_norm.0 as usize], &self.small[k_bias.0 as usize]);
                indexer::key_write(&self.f[k.0 as usize][..n(k)], w, b, k_eps, &tk, &mut self.kv, layer, cx.rope);
            }
            Op::IndexerTopK { q, head_weights, layer, topk, across_ranks, out, .. } => {
                let mut o = std::mem::take(&mut self.i[out.0 as usize]);
                let heads = width(p, head_weights);
                let tk = tokens_in(&self.i, cx);
                let rows = if across_ranks { (self.index, plan.ranks()) } else { (0, 1) };
                indexer::top_k(&self.f[q.0 as usize][..n(q)], &self.f[head_weights.0 as usize][..n(head_weights)], heads, &tk, &self.kv, layer, cx.rope, topk, rows, &mut o[..n(out)]);
                self.i[out.0 as usize] = o;
            }
            Op::MlaAttention { q, kv_b, topk, layer, heads, scale, form, out, .. } => {
                let c = &plan.model;
                let mut o = take(&mut self.f, out);
                let m = attention::Mla {
                    heads,
                    nope: c.qk_nope_head_dim,
                    rope_dim: c.qk_rope_head_dim,
                    v_dim: c.v_head_dim,
                    latent: c.kv_lora_rank,
                    scale,
                    kv_b: slot_bytes(plan, &self.arena, kv_b),
                    form: cx.opts.attention.unwrap_or(form),
                };
                let sel = topk.map(|b| (&self.i[b.0 as usize][..n(b)], width(p, b)));
                let tk = tokens_in(&self.i, cx);
                attention::mla_attention(&self.f[q.0 as usize][..n(q)], sel, &tk, &self.kv, layer, &m, cx.rope, round(out), &mut o[..n(out)]);
                self.f[out.0 as usize] = o;
            }
            Op::Router { input, gate, bias, ref params, ids, weights, .. } => {
                let mut ids_v = std::mem::take(&mut self.i[ids.0 as usize]);
                let mut w_v = take(&mut self.f, weights);
                let h = width(p, input);
                router::route(&self.f[input.0 as usize][..n(input)], h, slot_bytes(plan, &self.arena, gate), &self.small[bias.0 as usize], params, &mut ids_v[..n(ids)], &mut w_v[..n(weights)]);
                self.i[ids.0 as usize] = ids_v;
                self.f[weights.0 as usize] = w_v;
            }
            Op::MoeExperts { input, ids, weights, ref gate_up, ref down, experts_local, expert_parallel, intermediate, hidden, out, shared, .. } => {
                let stack = |w: &LinearWeights| match *w {
                    LinearWeights::Bf16 { weight } => moe::Stack::Bf16(slot_bytes(plan, &self.arena, weight)),
                    LinearWeights::Nvfp4 { weight, scale, scale_2, input_scale } => moe::Stack::Nvfp4 {
                        packed: slot_bytes(plan, &self.arena, weight),
                        scales: slot_bytes(plan, &self.arena, scale),
                        scale_2: &self.small[scale_2.0 as usize],
                        input_scale: &self.small[input_scale.0 as usize],
                    },
                };
                let ex = moe::Experts {
                    gate_up: stack(gate_up),
                    down: stack(down),
                    local: experts_local,
                    first: if expert_parallel { self.index * experts_local } else { 0 },
                    intermediate,
                    hidden,
                };
                let mut o = take(&mut self.f, out);
                let mut s = std::mem::take(&mut self.moe);
                let top_k = width(p, ids);
                let tk = tokens_in(&self.i, cx);
                moe::experts(
                    &self.f[input.0 as usize][..n(input)],
                    tokens_of(p, input, hidden),
                    |t| tk.active(t),
                    &self.i[ids.0 as usize][..n(ids)],
                    &self.f[weights.0 as usize][..n(weights)],
                    top_k,
                    &ex,
                    cx.opts.act_quant,
                    Round::for_dtype(DType::BF16, cx.opts.precision),
                    round(out),
                    &mut s,
                    &mut o[..n(out)],
                );
                if let Some(sh) = shared {
                    elementwise::add_in_place(&mut o[..n(out)], &self.f[sh.0 as usize][..n(sh)], round(out));
                }
                self.moe = s;
                self.f[out.0 as usize] = o;
            }
            Op::Add { a, b, out } => {
                let mut o = take(&mut self.f, out);
                elementwise::add(&self.f[a.0 as usize][..n(a)], &self.f[b.0 as usize][..n(b)], round(out), &mut o[..n(out)]);
                self.f[out.0 as usize] = o;
            }
            Op::GatherRows { input, rows, out } => {
                let h = width(p, out);
                let mut o = take(&mut self.f, out);
                elementwise::gather_rows(&self.f[input.0 as usize][..n(input)], &self.i[rows.0 as usize], h, round(out), &mut o[..n(out)]);
                self.f[out.0 as usize] = o;
            }
            Op::AllReduce { .. } | Op::AllGather { .. } => return Err(RuntimeError::internal("collective executed on one rank")),
            Op::Concurrent { ref ops } => {
                for op in ops {
                    self.exec(cx, op)?;
                }
            }
        }
        Ok(())
    }
}

/// Rows of a `[rows, k]` buffer.
fn tokens_of(p: &Program, b: BufId, k: usize) -> usize {
    numel(p, b) / k.max(1)
}
