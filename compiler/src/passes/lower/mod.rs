//! Lowering: gives every plan step whose kernel family has a template its kernel instance and
//! launch (fixed grid / block / shared memory and arguments over buffer and weight ids).
//!
//! A step no template covers (a family without a kernel for the target, or a shape outside every
//! template) is a compile error listing each such family with its reason: a GPU plan never falls
//! back silently.
//!
//! One file per kernel family beside this one (`cache`, `indexer`, `attention`, `moe`, `gemm`,
//! `router`);
//! each turns its ops into instances with [`of`] / [`of_grid`].

mod attention;
mod cache;
mod collective;
mod gemm;
mod indexer;
mod moe;
mod norm;
mod router;

pub use attention::{output_gemm, token_pairs};
pub use collective::{P2P_GATHER_PAIRS, P2P_SPINS};
pub use gemm::{bf16_gemm_form, bf16_group_form, nvfp4_gemm_form, Bf16Form, GROUP_MAX};
pub use indexer::{fast_positions, indexer_pairs, select_chunk, SELECT_THREADS};
pub use moe::{down_cols, down_threads, gate_up_cols, gate_up_threads, mid_fp4, mma_group};

use crate::kernels::{AddArgs, AddParams, EmbedArgs, EmbedParams, GatherRowsArgs, GatherRowsParams, LinearBf16GemvArgs, LinearBf16GemvParams, LinearNvfp4GemvArgs, LinearNvfp4GemvParams, KernelParams, Ptr};
use crate::CompileError;
use kiln_runtime::perf::{launch_time, Bytes, Constants, Cost, Flops};
use kiln_runtime::plan::{
    Arch, BufId, DType, Epilogue, KernelFamily, KernelId, KernelInfo, Launch, LaunchArg, LinearPart, LinearWeights, Op, Plan,
    Program,
};
use std::collections::BTreeMap;

/// Threads per block of every kiln kernel so far (8 warps).
pub const THREADS: u32 = 256;
/// Most output columns per block of the GEMVs (8 per warp); see [`gemv_tasks_per_block`].
pub const TASKS_PER_BLOCK: u32 = 64;
/// Fewest output columns per block of the GEMVs: one per warp.
pub const MIN_TASKS_PER_BLOCK: u32 = THREADS / 32;
/// Largest M the GEMV templates take (their accumulators are registers).
pub const GEMV_MAX_M: usize = 32;
/// Weight loads each lane of a decode GEMV (BF16: 16-byte chunks; NVFP4 and MoE: 16-element
/// blocks) issues before using the first, for `rows` activation rows per pass: measured on an
/// H200, one load in flight per lane left the NVFP4 kernels at a fifth of DRAM bandwidth and the
/// small BF16 GEMVs at a fixed ~8.5 µs (bytes in flight bound them, not DRAM). More rows per pass
/// mean more work per byte loaded (and more registers: 16 rows with four blocks ahead spill), so
/// fewer loads ahead.
pub fn loads_ahead(rows: usize) -> u32 {
    match rows {
        0..=4 => 4,
        5..=8 => 2,
        _ => 1,
    }
}
/// Most blocks of an elementwise kernel (`add`): larger tensors are strided over by the grid.
pub const ELEMENTWISE_MAX_GRID: u32 = 1024;
/// Shared memory per block kiln's kernels may use (SM120's opt-in limit; every target).
pub const SMEM_LIMIT: u32 = 101_376;

/// A kernel instance before it is added to the plan.
pub(crate) struct Instance {
    template: &'static str,
    entry: &'static str,
    family: KernelFamily,
    values: Vec<(&'static str, u64)>,
    /// Renders the PTX; called only for the first step that uses this instance (rendering
    /// every step's copy would dominate the compile time).
    render: Box<dyn FnOnce() -> Result<String, String>>,
    smem: Result<u32, String>,
    grid: [u32; 3],
    /// Threads per block (x only).
    block: u32,
    args: Vec<LaunchArg>,
}

/// The instance of any template's `params` with a 1-D grid of `THREADS`-thread blocks.
pub(crate) fn of<P: KernelParams + Copy + 'static>(params: &P, grid: u32, args: Vec<LaunchArg>) -> Instance {
    of_grid(params, [grid, 1, 1], THREADS, args)
}

/// The instance of any template's `params` with its grid, block size and arguments.
pub(crate) fn of_grid<P: KernelParams + Copy + 'static>(params: &P, grid: [u32; 3], block: u32, args: Vec<LaunchArg>) -> Instance {
    let p = *params;
    Instance {
        template: P::TEMPLATE,
        entry: P::ENTRY,
        family: P::FAMILY,
        values: params.values(),
        render: Box::new(move || p.render()),
        smem: params.dynamic_smem(),
        grid,
        block,
        args,
    }
}

/// What every family's lowering sees of the step it lowers.
pub(crate) struct Cx<'a> {
    pub plan: &'a Plan,
    pub program: &'a Program,
    /// 120 or 90.
    pub arch: u32,
    pub smem_limit: u32,
    /// The performance model's constants for the target: block shapes are chosen with them.
    pub consts: Constants,
}

/// Predicted µs of a candidate launch shape: `perf::launch_time` (what `kiln inspect --perf`
/// prints) of the weight and activation bytes it moves, its FP32 FLOPs and its working blocks.
/// Lowering picks block shapes with it, so a choice and the prediction never disagree.
pub fn candidate_us(weights: f64, activations: f64, fp32_flops: f64, blocks: f64, k: &Constants) -> f64 {
    let bytes = Bytes { weights, activations, ..Bytes::default() };
    let cost = Cost { bytes, flops: Flops { fp32: fp32_flops, ..Flops::default() }, blocks, ..Cost::default() };
    launch_time(&cost, k).us
}

/// Output columns per block of a GEMV with `tasks` columns of `task_bytes` weight bytes each,
/// when every block also stages `block_bytes` of activations (all M rows): weights once,
/// activations once per block, over the SMs the blocks occupy ([`candidate_us`]). At decode
/// batch 1 one column per warp fills the GPU (a 2,048-row projection becomes 256 blocks, not
/// 32), and below `MIN_TASKS_PER_BLOCK` (down to `min_per_block`) warps share a column (a
/// 32-column projection: 32 blocks, not 4); with 32 staged rows wider blocks re-read x less.
/// Ties keep the wider block.
pub fn gemv_tasks_per_block(tasks: usize, task_bytes: usize, block_bytes: usize, min_per_block: u32, k: &Constants) -> u32 {
    let cost = |per_block: u32| gemv_us(tasks, task_bytes, block_bytes, per_block, k);
    let mut best = TASKS_PER_BLOCK;
    let mut per_block = TASKS_PER_BLOCK;
    while per_block > min_per_block.max(1) {
        per_block /= 2;
        if cost(per_block) < cost(best) {
            best = per_block;
        }
    }
    best
}

/// Predicted µs of a GEMV of `tasks` columns, `per_block` of them per block (see
/// [`gemv_tasks_per_block`]).
fn gemv_us(tasks: usize, task_bytes: usize, block_bytes: usize, per_block: u32, k: &Constants) -> f64 {
    let blocks = tasks.div_ceil(per_block as usize) as f64;
    candidate_us(tasks as f64 * task_bytes as f64, blocks * block_bytes as f64, 0.0, blocks, k)
}

/// The fewest columns per GEMV block: 1 (warps share a column) when the rows are few (a sum per
/// row and warp), a column's `chunks` (what a lane loads at once: 8 BF16 weights, or an NVFP4
/// block of 16) give each of the 8 warps at least a lane round, and the block's shared memory
/// with the warps' sums (`smem` bytes) fits; else a warp per column.
fn gemv_min_per_block(m: usize, chunks: usize, smem: usize, smem_limit: u32) -> u32 {
    if m <= 8 && chunks >= 32 * MIN_TASKS_PER_BLOCK as usize && smem <= smem_limit as usize {
        1
    } else {
        MIN_TASKS_PER_BLOCK
    }
}

/// Attaches launches to the steps of every program and fills `plan.kernels`; fails if any step
/// is left without a kernel. Deterministic: kernels are numbered in order of first use.
pub fn lower(plan: &mut Plan) -> Result<(), CompileError> {
    let arch = match plan.target.arch {
        Arch::Cpu => return Ok(()),
        Arch::Sm120a => 120,
        Arch::Sm90a => 90,
    };
    let smem_limit = SMEM_LIMIT.min(plan.target.smem_per_block);
    let (consts, _) = Constants::for_target(&plan.target).map_err(|message| CompileError::Verifier { pass: "lower", message })?;
    let mut kernels: Vec<KernelInfo> = Vec::new();
    let mut by_name: BTreeMap<String, KernelId> = BTreeMap::new();
    let mut missing: BTreeMap<(KernelFamily, String), usize> = BTreeMap::new();
    let mut programs = std::mem::take(&mut plan.programs);
    for program in &mut programs {
        for s in 0..program.steps.len() {
            let family = program.steps[s].kernel;
            let cx = Cx { plan, program, arch, smem_limit, consts };
            match instances(&cx, &program.steps[s].op) {
                Err(reason) => *missing.entry((family, reason)).or_default() += 1,
                Ok(list) => {
                    let mut launches = Vec::with_capacity(list.len());
                    for inst in list {
                        let smem = inst.smem.clone().map_err(|message| CompileError::Verifier { pass: "lower", message })?;
                        let name = std::iter::once(inst.template.to_string())
                            .chain(inst.values.iter().map(|(k, v)| format!("{}{v}", k.to_ascii_lowercase())))
                            .collect::<Vec<_>>()
                            .join("_");
                        let id = match by_name.get(&name) {
                            Some(&id) => id,
                            None => {
                                let ptx = (inst.render)().map_err(|message| CompileError::Verifier {
                                    pass: "lower",
                                    message: format!("rendering {name}: {message}"),
                                })?;
                                let id = KernelId(kernels.len() as u32);
                                kernels.push(KernelInfo {
                                    name: name.clone(),
                                    family: inst.family,
                                    template: inst.template.into(),
                                    entry: inst.entry.into(),
                                    params: inst.values.iter().map(|(k, v)| (k.to_string(), *v)).collect(),
                                    ptx,
                                    resources: None,
                                    parts: Vec::new(),
                                });
                                by_name.insert(name, id);
                                id
                            }
                        };
                        launches.push(Launch { kernel: id, grid: inst.grid, block: [inst.block, 1, 1], smem_dynamic: smem, args: inst.args });
                    }
                    program.steps[s].launches = launches;
                }
            }
        }
    }
    if !missing.is_empty() {
        let list = missing.iter().map(|((family, reason), steps)| format!("{} ({steps} steps): {reason}", family.name())).collect::<Vec<_>>().join("; ");
        return Err(CompileError::NoKernel { target: plan.target.name.clone(), list });
    }
    plan.programs = programs;
    plan.kernels = kernels;
    verify_launches(plan, smem_limit)
}

/// Whether a step of family `step` may launch a kernel of family `kernel`: its own, for the
/// router the BF16 linear that computes its gate product, for attention the BF16 GEMM of its
/// output projection, for a BF16 linear group its norm, for an rmsnorm or an all-reduce the
/// residual's add, for an all-reduce also the norm after it.
fn may_launch(step: KernelFamily, kernel: KernelFamily) -> bool {
    kernel == step
        || (matches!(step, KernelFamily::Router | KernelFamily::MlaAttention) && kernel == KernelFamily::LinearBf16)
        || (matches!(step, KernelFamily::LinearBf16 | KernelFamily::Collective) && kernel == KernelFamily::RmsNorm)
        || (matches!(step, KernelFamily::RmsNorm | KernelFamily::Collective) && kernel == KernelFamily::Add)
}

/// The verifier after lowering: every launch names a kernel of the plan, passes as many
/// arguments as its entry takes and only buffers / weights that exist, and fits the limits.
fn verify_launches(plan: &Plan, smem_limit: u32) -> Result<(), CompileError> {
    let bug = |message: String| CompileError::Verifier { pass: "lower", message };
    for p in &plan.programs {
        for (s, step) in p.steps.iter().enumerate() {
          for l in &step.launches {
            let at = format!("{} step {s} ({})", p.name, step.op.name());
            let k = plan.kernels.get(l.kernel.0 as usize).ok_or_else(|| bug(format!("{at}: kernel {} does not exist", l.kernel.0)))?;
            if !may_launch(step.kernel, k.family) {
                return Err(bug(format!("{at}: launches {} ({:?}) for a {:?} step", k.name, k.family, step.kernel)));
            }
            let entry = format!(".entry {}(", k.entry);
            let params = k.ptx.find(&entry).map(|i| k.ptx[i..].split(')').next().unwrap_or("").matches(".param").count());
            if params != Some(l.args.len()) {
                return Err(bug(format!("{at}: {} arguments for {} ({params:?} parameters)", l.args.len(), k.name)));
            }
            for a in &l.args {
                match *a {
                    LaunchArg::Buffer(b) if b.0 as usize >= p.buffers.len() => return Err(bug(format!("{at}: buffer {} does not exist", b.0))),
                    LaunchArg::Weight(w) if w.0 as usize >= plan.weights.len() => return Err(bug(format!("{at}: weight {} does not exist", w.0))),
                    _ => {}
                }
            }
            if l.grid.contains(&0) || l.block[0] * l.block[1] * l.block[2] > 1024 || l.smem_dynamic > smem_limit {
                return Err(bug(format!("{at}: launch {:?} x {:?} with {} B shared memory is out of bounds", l.grid, l.block, l.smem_dynamic)));
            }
          }
        }
    }
    Ok(())
}

pub(crate) fn numel(p: &Program, b: BufId) -> usize {
    p.buffer(b).shape.iter().product()
}

pub(crate) fn width(p: &Program, b: BufId) -> usize {
    p.buffer(b).shape.last().copied().unwrap_or(1)
}

/// 1 for BF16, 0 for F32, else why not.
pub(crate) fn float_flag(dtype: DType, what: &str) -> Result<u32, String> {
    match dtype {
        DType::BF16 => Ok(1),
        DType::F32 => Ok(0),
        other => Err(format!("{what} is {other}; the template takes BF16 or F32")),
    }
}

/// What the BF16 GEMV and GEMM templates both require of a linear: no epilogue (the CPU has no
/// BF16 SiLU-mul either) and K a multiple of 8 (16-byte weight rows).
pub(crate) fn bf16_linear_shape(k: usize, epilogue: Epilogue, form: &str) -> Result<(), String> {
    if epilogue != Epilogue::None {
        return Err(format!("the BF16 {form} has no SiLU-mul epilogue"));
    }
    if k % 8 != 0 {
        return Err(format!("K = {k} is not a multiple of 8 (16-byte rows)"));
    }
    Ok(())
}

/// What the NVFP4 GEMV and GEMM templates both require of a linear (on either target): K a
/// multiple of the 16-value block, one or two parts, and two equal parts for SiLU-mul. Returns
/// whether SiLU-mul.
pub(crate) fn nvfp4_linear_shape(k: usize, parts: &[LinearPart], epilogue: Epilogue, form: &str) -> Result<bool, String> {
    if k % 16 != 0 || parts.is_empty() || parts.len() > 2 {
        return Err(format!("K = {k} with {} parts is outside the NVFP4 {form} template", parts.len()));
    }
    let silu = epilogue == Epilogue::SiluMul;
    if silu && (parts.len() != 2 || parts[0].rows != parts[1].rows) {
        return Err("SiLU-mul needs two equal parts".into());
    }
    Ok(silu)
}

pub(crate) fn fits(bytes: usize, limit: u32, what: &str) -> Result<(), String> {
    if bytes > limit as usize {
        return Err(format!("{what} needs {bytes} B of shared memory (limit {limit} B); needs a tiled kernel"));
    }
    Ok(())
}

/// The launches of one step, in order, or why it has none.
fn instances(cx: &Cx, op: &Op) -> Result<Vec<Instance>, String> {
    match op {
        Op::KvCacheWrite { .. } => cache::instances(cx, op),
        Op::IndexerTopK { .. } => indexer::instances(cx, op),
        Op::MlaAttention { .. } => attention::instances(cx, op),
        Op::AllReduce { .. } | Op::AllGather { .. } => collective::instances(cx, op),
        Op::RmsNorm { .. } => norm::instances(cx, op),
        Op::MoeExperts { .. } => moe::instances(cx, op),
        Op::Router { .. } => router::instances(cx, op),
        Op::Linear { .. } => linear(cx, op).map(|(list, _)| list),
        Op::LinearGroup { .. } => linear_group(cx, op),
        _ => instance(cx, op).map(|i| vec![i]),
    }
}

/// A linear's launches and their predicted µs: the GEMV, or the GEMM's split form with K over
/// blocks where the byte model prices it below the GEMV, or the GEMM.
fn linear(cx: &Cx, op: &Op) -> Result<(Vec<Instance>, f64), String> {
    let gemv = gemv(cx, op);
    if let Ok((_, gemv_us)) = gemv {
        if let Some(us) = split_k_us(cx, op).filter(|&us| us < gemv_us) {
            if let Ok(list) = gemm::instances(cx, op) {
                return Ok((list, us));
            }
        }
    }
    match gemv {
        Ok((i, us)) => Ok((vec![i], us)),
        Err(gemv) => match gemm::instances(cx, op) {
            Ok(list) => Ok((list, gemm::predicted(cx, op).map_or(0.0, |(_, us)| us))),
            Err(gemm) => Err(format!("GEMV: {gemv}; GEMM: {gemm}")),
        },
    }
}

/// A `LinearGroup`: one launch of its members side by side where the byte model prices it below
/// the members' own launches (each a launch cost of its own), else those launches in order (also
/// where the one launch cannot be made: the members' own launches are the complete fallback).
/// A group with a norm puts it in a norm launch before those, or, where the model prices it
/// lower still, in the group's one launch (`NORM`: the rows normalised on the fly).
fn linear_group(cx: &Cx, op: &Op) -> Result<Vec<Instance>, String> {
    let members = op.group_members().ok_or("not a linear group")?;
    let (mut launches, mut norm_us) = (Vec::new(), 0.0);
    if let Some(n) = op.group_norm() {
        launches = norm::instances(cx, &n)?;
        norm_us = norm::predicted_us(cx, &n)?;
    }
    let mut each = Vec::new();
    let mut each_us = 0.0;
    for m in &members {
        let (list, us) = linear(cx, m)?;
        each.extend(list);
        each_us += us;
    }
    match gemm::group_instance(cx, op, false) {
        Ok(Some((one, us))) if us < each_us => {
            launches.push(one);
            each_us = us;
        }
        _ => launches.extend(each),
    }
    match gemm::group_instance(cx, op, true) {
        Ok(Some((one, us))) if us < norm_us + each_us => Ok(vec![one]),
        _ => Ok(launches),
    }
}

/// The predicted µs of a linear in the GEMM's split form when that form shares K over blocks
/// (else None). Every GEMV block stages all of x, so a few-column projection over a long K (the
/// indexer's 32 head weights over 6,144) reads x as often as its weights, or leaves SMs idle:
/// there the split form can be the cheaper one.
fn split_k_us(cx: &Cx, op: &Op) -> Option<f64> {
    gemm::predicted(cx, op).filter(|&(sliced, _)| sliced).map(|(_, us)| us)
}

/// The GEMV of a linear of at most `GEMV_MAX_M` rows, and its predicted µs (the cost its columns
/// per block were chosen by, [`gemv_tasks_per_block`]).
fn gemv(cx: &Cx, op: &Op) -> Result<(Instance, f64), String> {
    let (p, arch, smem_limit) = (cx.program, cx.arch, cx.smem_limit);
    let Op::Linear { input, ref weights, ref parts, k, epilogue, out } = *op else {
        return Err("not a linear".into());
    };
    let m = numel(p, input) / k.max(1);
    if m > GEMV_MAX_M {
        return Err(format!("M > {GEMV_MAX_M} is the tiled GEMM's"));
    }
    let x_bf16 = float_flag(p.buffer(input).dtype, "the input")?;
    let out_bf16 = float_flag(p.buffer(out).dtype, "the output")?;
    let n: usize = parts.iter().map(|q| q.rows).sum();
    match *weights {
        LinearWeights::Bf16 { weight } => {
            bf16_linear_shape(k, epilogue, "GEMV")?;
            let staged = m * k * if x_bf16 == 1 { 2 } else { 4 };
            fits(staged, smem_limit, &format!("a BF16 GEMV with M = {m}, K = {k}"))?;
            let min_per_block = gemv_min_per_block(m, k / 8, staged + m * THREADS as usize / 8, smem_limit);
            let tasks_per_block = gemv_tasks_per_block(n, 2 * k, staged, min_per_block, &cx.consts);
            let params = LinearBf16GemvParams {
                arch,
                m: m as u32,
                n: n as u32,
                k: k as u32,
                tasks_per_block,
                unroll: loads_ahead(m),
                threads: THREADS,
                x_bf16,
                out_bf16,
            };
            let args = LinearBf16GemvArgs { x: Ptr::Buffer(input), w: Ptr::Weight(weight), out: Ptr::Buffer(out) };
            let us = gemv_us(n, 2 * k, staged, tasks_per_block, &cx.consts);
            Ok((of(&params, (n as u32).div_ceil(tasks_per_block), args.launch_args()), us))
        }
        LinearWeights::Nvfp4 { weight, scale, scale_2, input_scale } => {
            let silu = nvfp4_linear_shape(k, parts, epilogue, "GEMV")?;
            // f16 codes and f32 block scales of each part's rows, and 16 B of scalars
            fits(parts.len() * m * (k * 2 + k / 4) + 16, smem_limit, &format!("an NVFP4 GEMV with M = {m}, K = {k}"))?;
            let tasks = if silu { parts[0].rows } else { n };
            // a task is one output column: one weight row, or a gate and an up row
            let task_bytes = (if silu { 2 } else { 1 }) * k * 9 / 16;
            let staged = m * k * if x_bf16 == 1 { 2 } else { 4 };
            let sums = (silu as usize + 1) * m * THREADS as usize / 8;
            let min_per_block = gemv_min_per_block(m, k / 16, parts.len() * m * (k * 2 + k / 4) + 16 + sums, smem_limit);
            let tasks_per_block = gemv_tasks_per_block(tasks, task_bytes, staged, min_per_block, &cx.consts);
            let params = LinearNvfp4GemvParams {
                arch,
                m: m as u32,
                n: n as u32,
                k: k as u32,
                n0: parts[0].rows as u32,
                parts: parts.len() as u32,
                silu: silu as u32,
                tasks: tasks as u32,
                tasks_per_block,
                unroll: loads_ahead(m),
                threads: THREADS,
                x_bf16,
                out_bf16,
            };
            let args = LinearNvfp4GemvArgs {
                x: Ptr::Buffer(input),
                w: Ptr::Weight(weight),
                sf: Ptr::Weight(scale),
                scale_2: Ptr::Weight(scale_2),
                input_scale: Ptr::Weight(input_scale),
                out: Ptr::Buffer(out),
            };
            let us = gemv_us(tasks, task_bytes, staged, tasks_per_block, &cx.consts);
            Ok((of(&params, (tasks as u32).div_ceil(tasks_per_block), args.launch_args()), us))
        }
    }
}

fn instance(cx: &Cx, op: &Op) -> Result<Instance, String> {
    let (plan, p, arch) = (cx.plan, cx.program, cx.arch);
    match *op {
        Op::Embed { ids, table, vocab_rows, out } => {
            let h = width(p, out);
            let tokens = numel(p, out) / h.max(1);
            if tokens == 0 || h == 0 || p.buffer(ids).dtype != DType::I32 || plan.weight(table).dtype != DType::BF16 {
                return Err("embed needs I32 ids, a BF16 table and a non-empty output".into());
            }
            let rows = u32::try_from(vocab_rows).ok().filter(|&v| LaunchArg::per_rank(v, plan.ranks().saturating_sub(1)).is_some());
            let vocab_rows = rows.ok_or_else(|| format!("{vocab_rows} vocabulary rows x {} ranks overflow a u32 row offset", plan.ranks()))?;
            let params = EmbedParams {
                arch,
                tokens: tokens as u32,
                vocab_rows,
                h: h as u32,
                threads: THREADS,
                out_bf16: float_flag(p.buffer(out).dtype, "the output")?,
            };
            // The rank's first vocabulary row is rank * vocab_rows: a per-rank argument, so the
            // program stays identical on every rank.
            let args = EmbedArgs { ids: Ptr::Buffer(ids), table: Ptr::Weight(table), out: Ptr::Buffer(out), first_row: vocab_rows };
            Ok(of(&params, tokens as u32, args.launch_args()))
        }
        Op::Add { a, b, out } => {
            let n = numel(p, out);
            if numel(p, a) < n || numel(p, b) < n {
                return Err("operands smaller than the output".into());
            }
            let grid = (n as u32).div_ceil(THREADS).clamp(1, ELEMENTWISE_MAX_GRID);
            let params = AddParams {
                arch,
                n: n as u32,
                grid,
                threads: THREADS,
                a_bf16: float_flag(p.buffer(a).dtype, "a")?,
                b_bf16: float_flag(p.buffer(b).dtype, "b")?,
                out_bf16: float_flag(p.buffer(out).dtype, "the output")?,
            };
            let args = AddArgs { a: Ptr::Buffer(a), b: Ptr::Buffer(b), out: Ptr::Buffer(out) };
            Ok(of(&params, grid, args.launch_args()))
        }
        Op::GatherRows { input, rows, out } => {
            let h = width(p, out);
            let out_rows = numel(p, out) / h.max(1);
            if out_rows == 0 || h == 0 {
                return Err("an empty gather".into());
            }
            if p.buffer(rows).dtype != DType::I32 || width(p, input) != h {
                return Err("gather_rows needs I32 row ids and equal row widths".into());
            }
            let params = GatherRowsParams {
                arch,
                out_rows: out_rows as u32,
                in_rows: (numel(p, input) / h.max(1)) as u32,
                h: h as u32,
                threads: THREADS,
                in_bf16: float_flag(p.buffer(input).dtype, "the input")?,
                out_bf16: float_flag(p.buffer(out).dtype, "the output")?,
            };
            let args = GatherRowsArgs { input: Ptr::Buffer(input), rows: Ptr::Buffer(rows), out: Ptr::Buffer(out) };
            Ok(of(&params, out_rows as u32, args.launch_args()))
        }
        _ => Err("no template yet".into()),
    }
}

#[cfg(test)]
mod tests {
    use super::{gemv_tasks_per_block, MIN_TASKS_PER_BLOCK};
    use kiln_runtime::perf::Constants;

    #[test]
    fn gemv_blocks_fill_the_gpu_at_batch_one_and_widen_with_staged_rows() {
        // GLM-5 tp8 q_a (2,048 BF16 rows of K = 6144), 188 SMs. Batch 1: 32 blocks of 64 would
        // draw 32/188 of the bandwidth; 256 blocks of 8 draw all of it for 12 KiB more x each.
        assert_eq!(gemv_tasks_per_block(2048, 2 * 6144, 2 * 6144, MIN_TASKS_PER_BLOCK, &Constants::SM120A), 8);
        // Batch 32 stages 384 KiB of x per block: 128 blocks of 16 cost (25.2 + 50.3 MB) / 0.68,
        // less than 256 of 8 ((25.2 + 100.7 MB) / 1) or 64 of 32 ((25.2 + 25.2 MB) / 0.34).
        assert_eq!(gemv_tasks_per_block(2048, 2 * 6144, 32 * 2 * 6144, MIN_TASKS_PER_BLOCK, &Constants::SM120A), 16);
        // Few columns: one per warp, however few blocks that makes.
        assert_eq!(gemv_tasks_per_block(32, 2 * 6144, 2 * 6144, MIN_TASKS_PER_BLOCK, &Constants::SM120A), 8);
        // ... unless warps may share a column: 32 columns (the indexer's head weights) in 32
        // blocks: (0.39 + 0.39 MB) / (32/188) beats (0.39 + 0.05 MB) / (4/188); 576 (kv_a) in
        // 288 blocks of 2: 10.6 MB at full bandwidth beats 576 of 1 (14.2 MB) and 144 of 4.
        assert_eq!(gemv_tasks_per_block(32, 2 * 6144, 2 * 6144, 1, &Constants::SM120A), 1);
        assert_eq!(gemv_tasks_per_block(576, 2 * 6144, 2 * 6144, 1, &Constants::SM120A), 2);
        // A GPU the widest blocks already fill keeps them.
        assert_eq!(gemv_tasks_per_block(64 * 188, 2 * 6144, 2 * 6144, MIN_TASKS_PER_BLOCK, &Constants::SM120A), 64);
    }
}
