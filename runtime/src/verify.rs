//! Step-by-step verification of a plan's kernels against the CPU reference: one step's launch
//! runs in the PTX emulator on exactly the values the CPU backend had before the step, and its
//! outputs are compared with what the CPU backend wrote. Behind `kiln verify --backend emu`.
//!
//! Tolerances (per element, `ref` = CPU value, `max` = largest |ref| of the step's output):
//! * BF16 outputs: `|emu - ref| <= 2^-7 |ref| + 2^-12 max` — the f32 sums differ only in
//!   summation order (the NVFP4 products are exact on both sides because both quantise the
//!   activations identically), so a value rounded once to BF16 may land one ulp (at most 2^-7
//!   relative) away; the absolute term covers cancellation. Ops that round a value twice
//!   ([`bf16_roundings`]: RMSNorm of a BF16 source normalises, rounds, then multiplies by the
//!   weight and rounds again) may land two ulps away: `2^-6 |ref|` for those. (The CPU sums a
//!   row's squares in the rmsnorm kernel's order, so a linear group that normalises its input
//!   inside its launch reads the CPU's normalised values exactly: one rounding.)
//! * F32 outputs: `|emu - ref| <= 2^-16 |ref| + 2^-20 max` (summation order, `ex2.approx`).

use crate::emu::{self, GlobalMemory, KernelArg, Module};
use crate::numerics::{bytes_floats, float_bytes};
use crate::plan::{BufId, DType, KvLayout, Launch, LaunchArg, Op, Plan, Program, WeightId};


/// The values of one buffer (float buffers as f32, I32 buffers as i32).
#[derive(Debug, Clone, PartialEq)]
pub enum Values {
    F32(Vec<f32>),
    I32(Vec<i32>),
}

/// What emulating one step produced.
#[derive(Debug, Clone)]
pub struct Emulated {
    /// The step's written buffers, as the kernel left them.
    pub outputs: Vec<(BufId, Values)>,
    /// The KV-cache layers the launches addressed, after them (GPU byte layout).
    pub kv: Vec<(u32, Vec<u8>)>,
    pub bytes_read: u64,
    pub bytes_written: u64,
    /// Bytes the step must read at least: every distinct weight slot and input buffer once.
    pub compulsory_read: u64,
    /// Bytes loaded from weight slots, and the bytes of the weight slots the step passes.
    pub weight_read: u64,
    pub weight_bytes: u64,
}
/// How one step's outputs compare with the CPU's.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Comparison {
    pub max_abs: f64,
    /// Largest `|emu - ref| / |ref|` over elements with `|ref| >= 2^-10 max`.
    pub max_rel: f64,
    pub elements: usize,
    /// Elements beyond the tolerance.
    pub beyond: usize,
    /// NaN or Inf in the emulator's output (where the CPU's is finite).
    pub non_finite: usize,
}

impl Comparison {
    pub fn ok(&self) -> bool {
        self.beyond == 0 && self.non_finite == 0
    }

    pub fn merge(&mut self, o: &Comparison) {
        self.max_abs = self.max_abs.max(o.max_abs);
        self.max_rel = self.max_rel.max(o.max_rel);
        self.elements += o.elements;
        self.beyond += o.beyond;
        self.non_finite += o.non_finite;
    }
}

fn encode(dtype: DType, v: &Values) -> Result<Vec<u8>, String> {
    Ok(match (dtype, v) {
        (DType::BF16 | DType::F32, Values::F32(x)) => float_bytes(x, dtype == DType::BF16),
        (DType::I32, Values::I32(x)) => x.iter().flat_map(|i| i.to_le_bytes()).collect(),
        (d, _) => return Err(format!("cannot pass a {d} buffer to the emulator")),
    })
}

pub(crate) fn decode(dtype: DType, bytes: &[u8]) -> Values {
    match dtype {
        DType::I32 => Values::I32(bytes.chunks_exact(4).map(|b| i32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect()),
        _ => Values::F32(bytes_floats(bytes, dtype == DType::BF16)),
    }
}

/// The state a step starts from on one rank.
pub struct StepInputs<'a> {
    /// A buffer's contents before the step.
    pub value: &'a dyn Fn(BufId) -> Values,
    /// The rank's weights arena.
    pub arena: &'a [u8],
    /// Resolves `LaunchArg::PerRank`.
    pub rank: usize,
    /// One layer of the rank's KV cache before the step, in the GPU byte layout (`KvLayout`).
    pub kv_layer: &'a dyn Fn(u32) -> Vec<u8>,
    /// The RoPE table (`KvLayout::rope_table_bytes`), F32 bytes.
    pub rope_table: &'a [u8],
}

/// A launch argument once the data it points to is in place.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum ArgValue {
    Addr(u64),
    U32(u32),
    F32(f32),
}

impl From<ArgValue> for KernelArg {
    fn from(v: ArgValue) -> KernelArg {
        match v {
            ArgValue::Addr(a) => KernelArg::U64(a),
            ArgValue::U32(x) => KernelArg::U32(x),
            ArgValue::F32(x) => KernelArg::F32(x),
        }
    }
}

/// The memory one step's launches address, each buffer, weight slot, cache layer and the RoPE
/// table in a region of its own, uploaded on first use (so an access past a region's end
/// faults instead of reading its neighbour). `H` is the backend's handle of a region; each
/// entry keeps it with the region's address.
pub struct StepRegions<H> {
    pub bufs: Vec<(BufId, H, u64)>,
    pub weights: Vec<(WeightId, H, u64)>,
    pub layers: Vec<(u32, H, u64)>,
    pub rope: Option<(H, u64)>,
    /// The split-K region ([`crate::plan::SplitKLayout`]), uploaded zeroed.
    pub split_k: Option<(H, u64)>,
    /// Bytes the step must read at least: every distinct weight slot and input buffer once.
    pub compulsory: u64,
}

impl<H> Default for StepRegions<H> {
    fn default() -> Self {
        StepRegions { bufs: Vec::new(), weights: Vec::new(), layers: Vec::new(), rope: None, split_k: None, compulsory: 0 }
    }
}

impl<H> StepRegions<H> {
    /// The values of `launch`'s arguments on one rank's state `st`, uploading each region not
    /// there yet with `upload(name, bytes) -> (handle, address)`. `reads` are the step's inputs.
    pub fn args(
        &mut self,
        plan: &Plan,
        program: &Program,
        launch: &Launch,
        reads: &[BufId],
        st: &StepInputs,
        upload: &mut dyn FnMut(&str, &[u8]) -> Result<(H, u64), String>,
    ) -> Result<Vec<ArgValue>, String> {
        let mut out = Vec::with_capacity(launch.args.len());
        for a in &launch.args {
            out.push(match *a {
                LaunchArg::Buffer(b) => ArgValue::Addr(match self.bufs.iter().find(|(x, _, _)| *x == b) {
                    Some(&(_, _, addr)) => addr,
                    None => {
                        let buf = program.buffer(b);
                        let bytes = encode(buf.dtype, &(st.value)(b))?;
                        if reads.contains(&b) {
                            self.compulsory += bytes.len() as u64;
                        }
                        let (h, addr) = upload(&buf.name, &bytes)?;
                        self.bufs.push((b, h, addr));
                        addr
                    }
                }),
                LaunchArg::Weight(w) => ArgValue::Addr(match self.weights.iter().find(|(x, _, _)| *x == w) {
                    Some(&(_, _, addr)) => addr,
                    None => {
                        let s = plan.weight(w);
                        let bytes = st.arena.get(s.offset as usize..(s.offset + s.bytes) as usize).ok_or_else(|| format!("slot `{}` lies outside the arena", s.name))?;
                        self.compulsory += bytes.len() as u64;
                        let (h, addr) = upload(&s.name, bytes)?;
                        self.weights.push((w, h, addr));
                        addr
                    }
                }),
                LaunchArg::KvCache { layer } => ArgValue::Addr(match self.layers.iter().find(|(x, _, _)| *x == layer) {
                    Some(&(_, _, addr)) => addr,
                    None => {
                        let (h, addr) = upload(&format!("kv_cache.layer{layer}"), &(st.kv_layer)(layer))?;
                        self.layers.push((layer, h, addr));
                        addr
                    }
                }),
                LaunchArg::RopeTable => ArgValue::Addr(match &self.rope {
                    Some((_, addr)) => *addr,
                    None => {
                        let (h, addr) = upload("rope_table", st.rope_table)?;
                        self.rope = Some((h, addr));
                        addr
                    }
                }),
                LaunchArg::SplitKRegion | LaunchArg::SplitKRegionUpper => ArgValue::Addr(
                    match &self.split_k {
                        Some((_, addr)) => *addr,
                        None => {
                            let (h, addr) = upload("split_k_region", &vec![0; crate::plan::SplitKLayout::BYTES as usize])?;
                            self.split_k = Some((h, addr));
                            addr
                        }
                    } + if *a == LaunchArg::SplitKRegionUpper { crate::plan::SplitKLayout::UPPER } else { 0 },
                ),
                LaunchArg::U32(v) => ArgValue::U32(v),
                LaunchArg::F32(v) => ArgValue::F32(v),
                LaunchArg::PerRank(v) => ArgValue::U32(LaunchArg::per_rank(v, st.rank).ok_or_else(|| format!("rank {} x {v} overflows a u32 argument", st.rank))?),
                LaunchArg::P2pRegion => return Err("a P2P collective runs on all ranks at once, not step by step on one (tests/kernels_p2p.rs and the emulator backend run it)".into()),
            });
        }
        Ok(out)
    }

    /// The region of written buffer `b`.
    pub fn written(&self, program: &Program, b: BufId) -> Result<&H, String> {
        self.bufs.iter().find(|(x, _, _)| *x == b).map(|(_, h, _)| h).ok_or_else(|| format!("the launches do not pass written buffer {}", program.buffer(b).name))
    }
}

/// Runs a step's `launches` (of `program`, `modules[i]` holding launch i's kernel) in order in
/// the emulator on one rank's state. `reads` are the step's inputs (they count as compulsory
/// traffic), `writes` the buffers to read back afterwards.
pub fn emulate(plan: &Plan, program: &Program, launches: &[Launch], modules: &[&Module], reads: &[BufId], writes: &[BufId], st: &StepInputs) -> Result<Emulated, String> {
    let mut g = GlobalMemory::new();
    let mut regions = StepRegions::<emu::BufferId>::default();
    let (mut bytes_read, mut bytes_written) = (0u64, 0u64);
    for (launch, module) in launches.iter().zip(modules) {
        let kernel = plan.kernel(launch.kernel);
        let values = regions.args(plan, program, launch, reads, st, &mut |name, bytes| {
            let id = g.alloc_bytes(name, bytes);
            Ok((id, g.addr(id)))
        })?;
        let args: Vec<KernelArg> = values.into_iter().map(KernelArg::from).collect();
        let stats = emu::launch(module, &kernel.entry, launch.grid, launch.block, launch.smem_dynamic, &args, &g).map_err(|e| format!("{}: {e}", kernel.name))?;
        bytes_read += stats.global_bytes_read();
        bytes_written += stats.global_bytes_written();
    }
    let outputs = writes.iter().map(|&b| Ok((b, decode(program.buffer(b).dtype, &g.read(*regions.written(program, b)?))))).collect::<Result<Vec<_>, String>>()?;
    let kv = regions.layers.iter().map(|&(l, id, _)| (l, g.read(id))).collect();
    let weight_read = regions.weights.iter().map(|&(_, id, _)| g.bytes_loaded(id)).sum();
    let weight_bytes = regions.weights.iter().map(|&(_, id, _)| g.len(id) as u64).sum();
    Ok(Emulated { outputs, kv, bytes_read, bytes_written, compulsory_read: regions.compulsory, weight_read, weight_bytes })
}

/// How many times `op` rounds a value to BF16 on its way to an output (each rounding may put
/// the emulator's result one ulp from the CPU's when their f32 sums differ in the last bit).
pub fn bf16_roundings(program: &Program, op: &Op) -> i32 {
    match *op {
        Op::RmsNorm { input, residual, .. } if program.buffer(residual.unwrap_or(input)).dtype == DType::BF16 => 2,
        // its latent ([`compare_cache_write`] holds the index key, rounded once, to one)
        Op::KvCacheWrite { kv, .. } if program.buffer(kv).dtype == DType::BF16 => 2,
        _ => 1,
    }
}

/// Compares a KV-cache layer the emulator wrote with the CPU's (both GPU byte layout), for an
/// op that rounds `roundings` times.
pub fn compare_cache(dtype: DType, roundings: i32, emu: &[u8], cpu: &[u8]) -> Comparison {
    compare_rounded(dtype, roundings, &decode(dtype, emu), &decode(dtype, cpu))
}

/// Compares a KV-cache layer after `op` (a cache write) as [`compare_cache`] does, each row's MLA
/// part (latent, rope key) under the op's [`bf16_roundings`] and its indexer key under one; an
/// FP8 key (`IndexKeys::Fp8`) as its values (code x scale), which may land one E4M3 step (2^-3
/// relative) away where the value it was quantised from was one BF16 ulp away.
pub fn compare_cache_write(program: &Program, op: &Op, kv: &KvLayout, emu: &[u8], cpu: &[u8]) -> Comparison {
    let fp8 = kv.index_keys == crate::plan::IndexKeys::Fp8;
    let mla = kv.latent_dim + kv.rope_dim;
    let split = |bytes: &[u8]| -> (Vec<f32>, Vec<f32>) {
        let (mut a, mut b) = (Vec::new(), Vec::new());
        for row in bytes.chunks(kv.slot_bytes().max(1) as usize) {
            let at = kv.key_offset_bytes().min(row.len());
            let Values::F32(v) = decode(kv.dtype, if fp8 { &row[..at] } else { row }) else { return (Vec::new(), Vec::new()) };
            a.extend_from_slice(&v[..mla.min(v.len())]);
            if !fp8 {
                b.extend_from_slice(&v[mla.min(v.len())..]);
            } else if row.len() >= at + kv.index_dim + 4 {
                let scale = f32::from_le_bytes(row[at + kv.index_dim..at + kv.index_dim + 4].try_into().expect("4 bytes"));
                b.extend(row[at..at + kv.index_dim].iter().map(|&c| crate::numerics::e4m3_to_f32(c) * scale));
            }
        }
        (a, b)
    };
    if emu.len() != cpu.len() {
        return Comparison { beyond: 1, ..Default::default() };
    }
    let ((ea, eb), (ca, cb)) = (split(emu), split(cpu));
    let write = op.leaves().iter().find(|o| o.writes_kv_cache()).unwrap_or(op);
    let mut c = compare_rounded(kv.dtype, bf16_roundings(program, write), &Values::F32(ea), &Values::F32(ca));
    // (compare_rounded's BF16 tolerance with 5 roundings: 2^-3 relative)
    c.merge(&compare_rounded(kv.dtype, if fp8 { 5 } else { 1 }, &Values::F32(eb), &Values::F32(cb)));
    c
}

/// Compares an emulated output with the CPU's, under the tolerance for its dtype (one rounding).
pub fn compare(dtype: DType, emu: &Values, cpu: &Values) -> Comparison {
    compare_rounded(dtype, 1, emu, cpu)
}

/// [`compare`] for an output rounded to BF16 `roundings` times (one ulp each).
pub fn compare_rounded(dtype: DType, roundings: i32, emu: &Values, cpu: &Values) -> Comparison {
    let (e, c): (Vec<f64>, Vec<f64>) = match (emu, cpu) {
        (Values::F32(e), Values::F32(c)) => (e.iter().map(|&v| v as f64).collect(), c.iter().map(|&v| v as f64).collect()),
        (Values::I32(e), Values::I32(c)) => (e.iter().map(|&v| v as f64).collect(), c.iter().map(|&v| v as f64).collect()),
        _ => return Comparison { beyond: 1, ..Default::default() },
    };
    let (rtol, atol) = match dtype {
        DType::BF16 => (2f64.powi(-8 + roundings.max(1)), 2f64.powi(-12)),
        DType::I32 => (0.0, 0.0),
        _ => (2f64.powi(-16), 2f64.powi(-20)),
    };
    let max = c.iter().filter(|v| v.is_finite()).fold(0f64, |m, v| m.max(v.abs()));
    let mut r = Comparison { elements: c.len(), ..Default::default() };
    if e.len() != c.len() {
        r.beyond = c.len().max(1);
        return r;
    }
    for (&x, &y) in e.iter().zip(&c) {
        if !x.is_finite() {
            if y.is_finite() {
                r.non_finite += 1;
            }
            continue;
        }
        let d = (x - y).abs();
        r.max_abs = r.max_abs.max(d);
        if y.abs() >= max * 2f64.powi(-10) && y != 0.0 {
            r.max_rel = r.max_rel.max(d / y.abs());
        }
        if d > rtol * y.abs() + atol * max {
            r.beyond += 1;
        }
    }
    r
}

/// Compares every output of a step (`op`; of a `Concurrent` one, each under its own op's
/// roundings).
pub fn compare_outputs(program: &Program, op: &Op, emu: &[(BufId, Values)], cpu: &[(BufId, Values)]) -> Comparison {
    let mut all = Comparison::default();
    for (b, e) in emu {
        let of = op.leaves().iter().find(|o| o.writes().contains(b)).unwrap_or(op);
        let roundings = bf16_roundings(program, of);
        match cpu.iter().find(|(x, _)| x == b) {
            Some((_, c)) => all.merge(&compare_rounded(program.buffer(*b).dtype, roundings, e, c)),
            None => all.beyond += 1,
        }
    }
    all
}
