//! The predicted-performance ("roofline") model behind `kiln inspect ART --perf`: the time of
//! every launch and collective of a program, from the bytes and FLOPs its kernels execute
//! ([`kernels`]) under an assumed load ([`load`]) and fixed hardware constants ([`Constants`]).
//! Nothing here is measured: every figure is a prediction.
//!
//! A launch takes `max(bytes / bandwidth, sum over units of flops / rate) + launch`, where bytes
//! are its loads and stores as the PTX emulator counts them (L2 is not a cache for weights; a
//! value re-read by several blocks counts each time), and a launch with fewer working blocks than
//! SMs gets that fraction of the bandwidth and of every rate. A collective takes NCCL's
//! `base + bytes / bandwidth`, or, for a collective the plan gives the one-shot P2P kernel (each
//! rank's part at most `p2p_max_bytes`), that kernel's `base + (ranks - 1) * part / bandwidth`,
//! where an all-reduce's part is its whole buffer and an all-gather's one rank's share; the
//! kernel's two-shot all-reduce is two such passes over a share each (reported beside NCCL: the
//! runtime uses the kernel only where every GPU pair passes the peer probe).
//! A step is the sum of its launches and collectives (one CUDA graph, nothing overlaps).

pub mod kernels;
pub mod load;
pub mod prompt;
pub mod speculative;

pub use kernels::{launch_cost, launch_part_costs, Bytes, Class, Cost, Flops};
pub use load::{Experts, Load, Tokens};

use crate::plan::{Arch, KernelId, MoeParallel, Op, Plan, Program, ProgramKind, Target};
use serde::Serialize;
use std::collections::BTreeMap;

/// Hardware constants of the model (per GPU).
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Constants {
    /// DRAM bandwidth, TB/s (10^12 B/s).
    pub dram_tbps: f64,
    /// Fraction of it a streaming kernel achieves.
    pub dram_efficiency: f64,
    /// Streaming multiprocessors: a launch with fewer working blocks gets that fraction.
    pub sms: u32,
    /// Dense block-scaled FP4 `mma`, PFLOP/s.
    pub fp4_pflops: f64,
    /// Dense BF16 `mma`, PFLOP/s.
    pub bf16_pflops: f64,
    /// FP32 FMA on the CUDA cores, TFLOP/s.
    pub fp32_tflops: f64,
    /// Per kernel node of a graph, µs.
    pub launch_us: f64,
    /// NCCL all-reduce / all-gather: `nccl_base_us + bytes / nccl_gbps`.
    pub nccl_base_us: f64,
    pub nccl_gbps: f64,
    /// One-shot P2P all-reduce or all-gather: `p2p_base_us + (ranks - 1) * part / p2p_gbps`, where
    /// `part` (what each rank reads of each peer: an all-reduce's buffer, a gather's one share) is
    /// at most `p2p_max_bytes`; a two-shot all-reduce is two of them, each over a share
    /// (`bytes / ranks`, at most `p2p_max_bytes`).
    pub p2p_base_us: f64,
    pub p2p_gbps: f64,
    pub p2p_max_bytes: u64,
}

impl Constants {
    /// The fixed constants for `sm_120a` (RTX PRO 6000 Blackwell), issue 13.
    pub const SM120A: Constants = Constants {
        dram_tbps: 1.792,
        dram_efficiency: 0.85,
        sms: 188,
        fp4_pflops: 1.6,
        bf16_pflops: 0.4,
        fp32_tflops: 60.0,
        launch_us: 1.5,
        nccl_base_us: 25.0,
        nccl_gbps: 40.0,
        p2p_base_us: 8.0,
        p2p_gbps: 50.0,
        p2p_max_bytes: 64 * 1024,
    };

    /// The defaults for a plan's target and notes on where they come from. `sm_120a`: the fixed
    /// constants. `sm_90a`: bandwidth and SM count from kiln's target definition; the repo holds
    /// no H200 compute or interconnect rates, so those stay `sm_120a`'s (flags override).
    /// CPU plans have no kernels to time.
    pub fn for_target(t: &Target) -> Result<(Constants, Vec<String>), String> {
        match t.arch {
            Arch::Cpu => Err(format!("the performance model times GPU kernels; this plan was compiled for {} (compile for sm_120a)", t.name)),
            Arch::Sm120a => Ok((Constants { sms: t.sm_count.max(1), ..Constants::SM120A }, vec![])),
            Arch::Sm90a => Ok((
                Constants { dram_tbps: t.mem_bandwidth_gbs as f64 / 1000.0, sms: t.sm_count.max(1), ..Constants::SM120A },
                vec![format!(
                    "{}: DRAM {:.1} TB/s and {} SMs from kiln's target definition; no H200 compute or interconnect rates are defined in the repo, so the FLOP rates, launch and collective constants are sm_120a's (NVLink collectives are far faster): set them with the flags; FP4 GEMMs run as f16 mma here and count at the BF16 rate",
                    t.name,
                    t.mem_bandwidth_gbs as f64 / 1000.0,
                    t.sm_count
                )],
            )),
        }
    }

    /// Bytes per µs the whole GPU streams.
    pub fn bytes_per_us(&self) -> f64 {
        self.dram_tbps * self.dram_efficiency * 1e6
    }
}

/// Whether bandwidth or a compute unit decides a launch's time.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Bound {
    Memory,
    Fp4Mma,
    Bf16Mma,
    Fp32,
}

impl Bound {
    pub fn label(self) -> &'static str {
        match self {
            Bound::Memory => "memory",
            Bound::Fp4Mma => "fp4 mma",
            Bound::Bf16Mma => "bf16 mma",
            Bound::Fp32 => "fp32",
        }
    }
}

/// A launch's predicted time.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Timing {
    pub us: f64,
    pub memory_us: f64,
    pub compute_us: f64,
    /// Fraction of the GPU the launch's working blocks occupy (at most 1).
    pub occupancy: f64,
    pub bound: Bound,
}

/// `max(bytes / bandwidth, flops / rates) / occupancy + launch`; the serial bytes
/// (`Cost::serial`) at one SM's share of the bandwidth.
pub fn launch_time(c: &Cost, k: &Constants) -> Timing {
    let occupancy = (c.blocks.max(1.0) / k.sms.max(1) as f64).min(1.0);
    let serial = c.serial.min(c.bytes.total());
    let memory_us = (c.bytes.total() - serial) / k.bytes_per_us() / occupancy + serial / k.bytes_per_us() * k.sms.max(1) as f64;
    let units = [(Bound::Fp4Mma, c.flops.fp4_mma / (k.fp4_pflops * 1e9)), (Bound::Bf16Mma, c.flops.bf16_mma / (k.bf16_pflops * 1e9)), (Bound::Fp32, c.flops.fp32 / (k.fp32_tflops * 1e6))];
    let compute_us = units.iter().map(|u| u.1).sum::<f64>() / occupancy;
    let bound = if memory_us >= compute_us { Bound::Memory } else { units.iter().max_by(|a, b| a.1.total_cmp(&b.1)).map_or(Bound::Memory, |u| u.0) };
    Timing { us: memory_us.max(compute_us) + k.launch_us, memory_us, compute_us, occupancy, bound }
}

/// A merged launch's time: its parts' summed bytes and FLOPs over their summed blocks, but no
/// less than its slowest part would take alone (a one-block part is not sped up by sharing the
/// launch with a wide one); a chained part (`tails[i]`, `KernelPart::tail`: one flag per part)
/// adds its [`tail_us`] after that, as if nothing else still ran beside it.
pub fn merged_time(parts: &[Cost], tails: &[bool], k: &Constants) -> Timing {
    let side: Vec<Cost> = parts.iter().zip(tails).filter(|(_, &t)| !t).map(|(c, _)| c.clone()).collect();
    let together = launch_time(&Cost::sum(&side), k);
    let mut time = side.iter().map(|c| launch_time(c, k)).fold(together, |t, alone| if alone.us > t.us { alone } else { t });
    time.us += parts.iter().zip(tails).filter(|(_, &t)| t).map(|(c, _)| tail_us(c, k)).sum::<f64>();
    time
}

/// A chained part's time: its blocks one after another on the one SM of its head's last block
/// (the occupancy of one block), no launch of its own.
pub fn tail_us(c: &Cost, k: &Constants) -> f64 {
    launch_time(&Cost { blocks: 1.0, ..c.clone() }, k).us - k.launch_us
}

/// What a launch cannot beat: its distinct bytes at full bandwidth on every SM, or its FLOPs at
/// full rate, without the launch cost.
pub fn launch_floor_us(c: &Cost, k: &Constants) -> f64 {
    let memory_us = c.compulsory.total() / k.bytes_per_us();
    let compute_us = c.flops.fp4_mma / (k.fp4_pflops * 1e9) + c.flops.bf16_mma / (k.bf16_pflops * 1e9) + c.flops.fp32 / (k.fp32_tflops * 1e6);
    memory_us.max(compute_us)
}

/// A collective's predicted time: (NCCL, P2P where its size allows). `bytes`: the all-reduced
/// buffer, or the gathered result (each rank contributes `bytes / ranks`); `two_shot`: an
/// all-reduce by the P2P kernel's two-shot form (a pass over each rank's share of the sums, then
/// one gathering the shares), else one-shot (each rank reads every peer's whole part).
pub fn collective_time(all_reduce: bool, two_shot: bool, bytes: f64, ranks: usize, k: &Constants) -> (f64, Option<f64>) {
    let nccl = k.nccl_base_us + bytes / (k.nccl_gbps * 1e3);
    let share = bytes / ranks.max(1) as f64;
    let (part, passes) = match (all_reduce, two_shot) {
        (true, false) => (bytes, 1.0),
        (true, true) => (share, 2.0),
        (false, _) => (share, 1.0),
    };
    let p2p = (part <= k.p2p_max_bytes as f64).then(|| passes * (k.p2p_base_us + ranks.saturating_sub(1) as f64 * part / (k.p2p_gbps * 1e3)));
    (nccl, p2p)
}

/// The P2P kernel's work after the transfers, at its per-peer rate (one block does it): the
/// residual add an all-reduce took over reads and writes the residual, and the norm it took over
/// after that reads the residual again, with the weight for every row, and writes the normed
/// rows. 0 for a plain all-reduce or a gather.
pub fn p2p_epilogue_us(plan: &Plan, program: &Program, op: &Op, k: &Constants) -> f64 {
    let Op::AllReduce { buf, residual: Some(_), norm } = *op else {
        return 0.0;
    };
    let bytes = program.buffer(buf).bytes;
    let norm_bytes = norm.map_or(0, |n| {
        let out = program.buffer(n.out);
        let rows = out.shape.iter().product::<usize>() / out.shape.last().copied().unwrap_or(1).max(1);
        bytes + out.bytes + rows as u64 * plan.weight(n.weight).bytes
    });
    (2 * bytes + norm_bytes) as f64 / (k.p2p_gbps * 1e3)
}

/// One launch of a program, predicted.
#[derive(Debug, Clone, PartialEq)]
pub struct LaunchPerf {
    pub step: usize,
    pub launch: usize,
    pub kernel: KernelId,
    pub cost: Cost,
    pub time: Timing,
}

/// One collective of a program, predicted.
#[derive(Debug, Clone, PartialEq)]
pub struct CollectivePerf {
    pub step: usize,
    pub all_reduce: bool,
    pub bytes: u64,
    /// NCCL's time for the collective alone.
    pub nccl_us: f64,
    /// The launches the NCCL path runs after the collective: their time and their floor
    /// ([`launch_floor_us`]).
    pub after_us: f64,
    pub after_floor_us: f64,
    /// The P2P kernel's time, where the plan has it (with the add and norm it does itself).
    pub p2p_us: Option<f64>,
    /// Whether the P2P path runs the launches after the collective too (`Step::after_p2p`).
    pub p2p_after: bool,
}

impl CollectivePerf {
    /// The step time of the NCCL path: the collective, then the launches after it.
    pub fn nccl_path_us(&self) -> f64 {
        self.nccl_us + self.after_us
    }

    /// The path taken (P2P where asked and the plan has the kernel): its time and its floor.
    fn path_us(&self, p2p: bool) -> (f64, f64) {
        match (p2p, self.p2p_us) {
            (true, Some(t)) if self.p2p_after => (t + self.after_us, t + self.after_floor_us),
            (true, Some(t)) => (t, t),
            _ => (self.nccl_path_us(), self.nccl_us + self.after_floor_us),
        }
    }
}

/// A program under one load, predicted launch by launch.
#[derive(Debug, Clone, PartialEq)]
pub struct ProgramPerf {
    pub launches: Vec<LaunchPerf>,
    pub collectives: Vec<CollectivePerf>,
}

impl ProgramPerf {
    pub fn kernel_us(&self) -> f64 {
        self.launches.iter().map(|l| l.time.us).sum()
    }

    pub fn collective_us(&self, p2p: bool) -> f64 {
        self.collectives.iter().map(|c| c.path_us(p2p).0).sum()
    }

    pub fn step_us(&self, p2p: bool) -> f64 {
        self.kernel_us() + self.collective_us(p2p)
    }

    /// The step's floor: every launch's [`launch_floor_us`] plus the collectives (with the floor
    /// of the launches an NCCL collective's path runs after it).
    pub fn floor_us(&self, p2p: bool, k: &Constants) -> f64 {
        self.launches.iter().map(|l| launch_floor_us(&l.cost, k)).sum::<f64>() + self.collectives.iter().map(|c| c.path_us(p2p).1).sum::<f64>()
    }

    pub fn bytes(&self) -> Bytes {
        self.sum_bytes(|c| &c.bytes)
    }

    pub fn compulsory(&self) -> Bytes {
        self.sum_bytes(|c| &c.compulsory)
    }

    fn sum_bytes(&self, of: impl Fn(&Cost) -> &Bytes) -> Bytes {
        let mut b = Bytes::default();
        for l in &self.launches {
            b.add(of(&l.cost));
        }
        b
    }
}

/// The context at which [`program_step_us`] prices programs for the runtime's and the engine's
/// choices (the plan's `--max-context` where shorter): KV reads grow with the context, weights do
/// not, so one context gives the ratios between programs well enough.
pub const COST_CONTEXT: usize = 8192;

/// Predicted step of program `index` with every row real (P2P path), µs: a decode program's
/// sequences at `context`, a prefill chunk ending there (from position 0 if it is longer), at
/// most the plan's `--max-context`. None for a CPU plan, which the model does not time.
pub fn program_step_us(plan: &Plan, index: usize, context: usize) -> Option<f64> {
    let (k, _) = Constants::for_target(&plan.target).ok()?;
    let p = plan.programs.get(index)?;
    let context = context.min(plan.memory.kv.max_context).max(1);
    let experts = |t: usize| uniform_experts(plan, t);
    let load = match p.kind {
        ProgramKind::Decode { .. } => Load::decode(p.tokens, p.tokens, context, experts, plan.ranks()),
        ProgramKind::Prefill { .. } => Load::prefill(p.tokens, p.tokens, context.saturating_sub(p.tokens), experts, plan.ranks()),
    };
    predict_program(plan, p, &load, &k).ok().map(|perf| perf.step_us(true))
}

/// Predicts every launch and collective of `program` under `load`.
pub fn predict_program(plan: &Plan, program: &Program, load: &Load, k: &Constants) -> Result<ProgramPerf, String> {
    let mut launches = Vec::new();
    let mut collectives = Vec::new();
    for (s, step) in program.steps.iter().enumerate() {
        match step.op {
            Op::AllReduce { buf, .. } => {
                let bytes = program.buffer(buf).bytes;
                let two_shot = step.p2p_collective(plan) && plan.kernel(step.launches[0].kernel).param("TWO_SHOT") == Some(1);
                let (nccl_us, p2p_us) = collective_time(true, two_shot, bytes as f64, plan.ranks(), k);
                // the P2P time where the plan has the kernel (its launch is costed as the
                // collective, with the add and norm it took over, or followed by their launches);
                // NCCL's, plus the launches that follow it (that add, that norm)
                let p2p_after = !step.after_p2p(plan).is_empty();
                let epilogue = if p2p_after { 0.0 } else { p2p_epilogue_us(plan, program, &step.op, k) };
                let p2p_us = p2p_us.filter(|_| step.p2p_collective(plan)).map(|t| t + epilogue);
                let (after_us, after_floor_us) = after_collective_us(plan, step, load, k).map_err(|e| format!("{} step {s} ({}): {e}", program.name, step.op.name()))?;
                collectives.push(CollectivePerf { step: s, all_reduce: true, bytes, nccl_us, after_us, after_floor_us, p2p_us, p2p_after });
                continue;
            }
            Op::AllGather { ref pairs } => {
                // the pairs of one gather share its latency
                let bytes = pairs.iter().map(|g| program.buffer(g.out).bytes).sum::<u64>();
                let (nccl_us, p2p_us) = collective_time(false, false, bytes as f64, plan.ranks(), k);
                let p2p_us = p2p_us.filter(|_| step.p2p_collective(plan));
                let (after_us, after_floor_us) = after_collective_us(plan, step, load, k).map_err(|e| format!("{} step {s} ({}): {e}", program.name, step.op.name()))?;
                collectives.push(CollectivePerf { step: s, all_reduce: false, bytes, nccl_us, after_us, after_floor_us, p2p_us, p2p_after: false });
                continue;
            }
            _ => {}
        }
        for (li, l) in step.launches.iter().enumerate() {
            let parts = launch_part_costs(plan, step, li, load).map_err(|e| format!("{} step {s} ({}): {e}", program.name, step.op.name()))?;
            let cost = Cost::sum(&parts);
            // a plain launch is one part, no tail
            let tails: Vec<bool> = match &plan.kernel(l.kernel).parts[..] {
                [] => vec![false; parts.len()],
                merged => merged.iter().map(|q| q.tail).collect(),
            };
            launches.push(LaunchPerf { step: s, launch: li, kernel: l.kernel, cost, time: merged_time(&parts, &tails, k) });
        }
    }
    Ok(ProgramPerf { launches, collectives })
}

/// The time and the floor of the launches a collective's NCCL path runs after NCCL
/// (`Step::after_collective`).
fn after_collective_us(plan: &Plan, step: &crate::plan::Step, load: &Load, k: &Constants) -> Result<(f64, f64), String> {
    let first = step.launches.len() - step.after_collective(plan).len();
    let costs = (first..step.launches.len()).map(|li| launch_cost(plan, step, li, load)).collect::<Result<Vec<_>, _>>()?;
    Ok((costs.iter().map(|c| launch_time(c, k).us).sum(), costs.iter().map(|c| launch_floor_us(c, k)).sum()))
}

/// The uniform routing of `tokens` tokens over this plan's local experts.
pub fn uniform_experts(plan: &Plan, tokens: usize) -> Experts {
    let m = &plan.model;
    let local = match plan.parallel.moe {
        MoeParallel::Tp => m.n_routed_experts,
        MoeParallel::Ep => m.n_routed_experts / plan.ranks().max(1),
    };
    Experts::uniform(tokens, m.num_experts_per_tok, m.n_routed_experts, local)
}

/// The contexts decode is predicted at (those within the plan's `--max-context`; a plan shorter
/// than all of them at its own).
pub const CONTEXTS: [usize; 4] = [2048, 8192, 32768, 131072];

/// The summed prediction of one program under one load.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct StepPerf {
    pub program: String,
    /// Cached positions each sequence attends over after this step.
    pub context: usize,
    pub step_ms: f64,
    pub tokens_per_s: f64,
    /// With the one-shot P2P all-reduce kernel for the all-reduces the plan gives it.
    pub step_ms_p2p: f64,
    pub tokens_per_s_p2p: f64,
    pub kernel_ms: f64,
    pub collective_ms: f64,
    pub collective_ms_p2p: f64,
    /// Loads and stores of every launch on one GPU.
    pub bytes_per_gpu: f64,
    /// The same, each distinct byte of each launch once.
    pub compulsory_bytes_per_gpu: f64,
    pub weight_bytes_per_gpu: f64,
    pub kv_bytes_per_gpu: f64,
    pub launches: usize,
    pub collectives: usize,
    /// What this program's launches and collectives cannot beat (NCCL / P2P collectives): each
    /// launch's distinct bytes at full bandwidth on every SM (or its FLOPs at full rate), no
    /// launch cost.
    pub floor_ms: f64,
    pub floor_ms_p2p: f64,
}

impl StepPerf {
    fn of(program: &Program, context: usize, tokens: usize, perf: &ProgramPerf, k: &Constants) -> StepPerf {
        let (step, step_p2p) = (perf.step_us(false), perf.step_us(true));
        let bytes = perf.bytes();
        StepPerf {
            program: program.name.clone(),
            context,
            step_ms: step / 1e3,
            tokens_per_s: tokens as f64 / step * 1e6,
            step_ms_p2p: step_p2p / 1e3,
            tokens_per_s_p2p: tokens as f64 / step_p2p * 1e6,
            kernel_ms: perf.kernel_us() / 1e3,
            collective_ms: perf.collective_us(false) / 1e3,
            collective_ms_p2p: perf.collective_us(true) / 1e3,
            bytes_per_gpu: bytes.total(),
            compulsory_bytes_per_gpu: perf.compulsory().total(),
            weight_bytes_per_gpu: bytes.weights,
            kv_bytes_per_gpu: bytes.kv,
            launches: perf.launches.len(),
            collectives: perf.collectives.len(),
            floor_ms: perf.floor_us(false, k) / 1e3,
            floor_ms_p2p: perf.floor_us(true, k) / 1e3,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct DecodeRow {
    pub batch: usize,
    #[serde(flatten)]
    pub step: StepPerf,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PrefillRow {
    /// Real tokens of the chunk (the program's bucket).
    pub chunk: usize,
    /// Cached positions before the chunk (the chunk's tokens sit at `prefix ..`).
    pub prefix: usize,
    #[serde(flatten)]
    pub step: StepPerf,
}

/// Identical launches of the detailed program, summed.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TopLaunch {
    /// Kernel instance (or `nccl all_reduce` / `nccl all_gather`).
    pub kernel: String,
    pub family: String,
    pub op: String,
    /// Launches per step.
    pub count: usize,
    pub us_each: f64,
    pub ms_total: f64,
    /// Of the step time (NCCL).
    pub share: f64,
    pub bytes_each: f64,
    pub compulsory_bytes_each: f64,
    pub blocks: f64,
    pub bound: String,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Top {
    pub program: String,
    /// Sequences of the step (1 for a prefill chunk).
    pub batch: usize,
    /// Tokens of the step: its sequences at decode, the chunk at prefill.
    pub tokens: usize,
    /// Positions cached after the step (a prefill chunk's last token is at `context - 1`).
    pub context: usize,
    pub step_ms: f64,
    pub launches: Vec<TopLaunch>,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Assumptions {
    pub target: String,
    #[serde(flatten)]
    pub constants: Constants,
    pub notes: Vec<String>,
}

/// `perf` of `kiln inspect --perf --json`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Report {
    pub assumptions: Assumptions,
    pub decode: Vec<DecodeRow>,
    pub prefill: Vec<PrefillRow>,
    /// Prompts prefilled from position 0 to their first token ([`prompt`]).
    pub prompts: Vec<prompt::PromptRow>,
    /// The decode programs as speculative decoding would use them ([`speculative`]).
    pub speculative: Vec<speculative::SpeculativeRow>,
    pub top: Top,
}

/// The notes every report states beside the constants.
fn notes(plan: &Plan) -> Vec<String> {
    let m = &plan.model;
    vec![
        "every figure is predicted by this model, none is measured".into(),
        "launch time = max(bytes / (DRAM x efficiency), sum of flops / rate per unit) / occupancy + launch; occupancy = min(1, working blocks / SMs)".into(),
        "bytes = every global load and store a kernel executes, counted per lane as the PTX emulator counts them (weights, activations, KV cache, inputs); L2 is not a cache for weights, nor for anything else: a re-read counts again".into(),
        "a step = sum of its launches and collectives (one CUDA graph per rank, nothing overlaps); all ranks run the same program".into(),
        "floor = what the program cannot beat as compiled: each launch's distinct bytes at full bandwidth on every SM (or its flops at full rate), no launch cost, plus the collectives (the p2p kernel where the plan has it)".into(),
        format!(
            "collectives: NCCL for every all-reduce and all-gather (the gathered bytes); the p2p columns use the plan's P2P kernel where it has one (one-shot: an all-reduce of up to 64 KiB, an all-gather of up to 64 KiB per rank, with (ranks - 1) = {} transfers of each rank's part; two-shot: an all-reduce of up to {} KiB, two such passes over a share of 1/{} each; the runtime uses it where every GPU pair passes the peer probe); at decode an all-reduce adds its sum into the residual stream and normalises it: the P2P kernel in its own block (reading and writing the residual at its per-peer rate) where the plan gives it that, else the add and norm launches after it, as after NCCL, counted in the collective's time",
            plan.ranks().saturating_sub(1),
            plan.ranks() * 64,
            plan.ranks()
        ),
        format!(
            "routing: uniform, each expert gets Binomial(tokens, {}/{}) tokens (expected values; a real step waits for its busiest rank)",
            m.num_experts_per_tok, m.n_routed_experts
        ),
        "decode: every sequence of the bucket at the row's context (its token at position context - 1); prefill: one sequence, the chunk at positions prefix .., logits of its last token".into(),
    ]
}

/// The whole report: decode buckets x [`CONTEXTS`], prefill buckets (from position 0, and the
/// largest one and those with a variant for deep chunks as the last chunk of each longer
/// context), and the launches of `step` at `context` summed by kernel, longest first.
pub fn report(plan: &Plan, k: &Constants, mut notes_extra: Vec<String>, step: TopStep, context: usize, count: usize) -> Result<Report, String> {
    let ranks = plan.ranks();
    let experts = |t: usize| uniform_experts(plan, t);
    let max_context = plan.memory.kv.max_context;
    let mut contexts: Vec<usize> = CONTEXTS.iter().copied().filter(|&c| c <= max_context).collect();
    if contexts.is_empty() {
        contexts.push(max_context.max(1));
    }
    let mut decode = Vec::new();
    let mut prefill = Vec::new();
    for p in &plan.programs {
        match p.kind {
            // (a draft model's programs are not in the decode table)
            ProgramKind::Decode { batch } if !p.is_draft() => {
                for &c in &contexts {
                    let perf = predict_program(plan, p, &Load::decode(p.tokens, batch, c, experts, ranks), k)?;
                    decode.push(DecodeRow { batch, step: StepPerf::of(p, c, batch, &perf, k) });
                }
            }
            ProgramKind::Prefill { chunk } if p.from_position == 0 => {
                let chunk = chunk.min(p.tokens);
                let perf = predict_program(plan, p, &Load::prefill(p.tokens, chunk, 0, experts, ranks), k)?;
                prefill.push(PrefillRow { chunk, prefix: 0, step: StepPerf::of(p, chunk, chunk, &perf, k) });
            }
            // (a variant for chunks deep in a context: at the contexts below)
            ProgramKind::Prefill { .. } | ProgramKind::Decode { .. } => {}
        }
    }
    // The largest chunk, and every chunk size with a variant for deep chunks, as the last chunk
    // of each longer context (by the program the runtime takes there)
    let prefill_programs = || plan.programs.iter().filter(|p| matches!(p.kind, ProgramKind::Prefill { .. }));
    let largest = prefill_programs().map(|p| p.tokens).max();
    let mut deep: Vec<usize> = prefill_programs().filter(|p| p.from_position > 0 || Some(p.tokens) == largest).map(|p| p.tokens).collect();
    deep.sort_unstable();
    deep.dedup();
    for chunk in deep {
        for &c in contexts.iter().filter(|&&c| c > chunk) {
            let p = &plan.programs[plan.prefill_program(chunk, c - chunk).ok_or("the plan has no prefill program")?];
            let perf = predict_program(plan, p, &Load::prefill(p.tokens, chunk, c - chunk, experts, ranks), k)?;
            prefill.push(PrefillRow { chunk, prefix: c - chunk, step: StepPerf::of(p, c, chunk, &perf, k) });
        }
    }
    let prompts = prompt::rows(plan, k, &prompt::PROMPTS)?;
    let speculative = speculative::rows(plan, k, &contexts)?;
    let top = top(plan, k, step, context.min(max_context), count)?;
    if context > max_context {
        notes_extra.push(format!("the detailed step is at context {max_context}, the plan's --max-context"));
    }
    let mut all_notes = notes(plan);
    all_notes.extend(notes_extra);
    Ok(Report { assumptions: Assumptions { target: plan.target.name.clone(), constants: *k, notes: all_notes }, decode, prefill, prompts, speculative, top })
}

/// Which step [`top`] lists: the decode step of `batch` sequences, or the prefill chunk of
/// `chunk` tokens (one sequence), each ending at the context `top` is given.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TopStep {
    Decode { batch: usize },
    Prefill { chunk: usize },
}

/// The program holding `step` at `context` (a chunk longer than the context starts at position
/// 0 and ends the context with it), its launches summed by kernel instance and grid, and its
/// collectives by kind, the `count` longest first.
pub fn top(plan: &Plan, k: &Constants, step: TopStep, context: usize, count: usize) -> Result<Top, String> {
    let experts = |t: usize| uniform_experts(plan, t);
    let (p, load, batch, tokens, context) = match step {
        TopStep::Decode { batch } => {
            let batch = batch.max(1);
            let pi = plan.decode_program(batch).ok_or_else(|| format!("the plan has no decode program for {batch} sequences"))?;
            let p = &plan.programs[pi];
            (p, Load::decode(p.tokens, batch, context, experts, plan.ranks()), batch, batch, context)
        }
        TopStep::Prefill { chunk } => {
            let chunk = chunk.max(1);
            // the smallest program holding the chunk, else the largest: a chunk it does not hold
            let context = context.max(chunk);
            let p = plan.prefill_program(chunk, context - chunk).map(|i| &plan.programs[i]).ok_or("the plan has no prefill program")?;
            if p.tokens < chunk {
                return Err(format!("the plan has no prefill program for a chunk of {chunk} tokens (its largest chunk: {})", p.tokens));
            }
            (p, Load::prefill(p.tokens, chunk, context - chunk, experts, plan.ranks()), 1, chunk, context)
        }
    };
    let perf = predict_program(plan, p, &load, k)?;
    let step_us = perf.step_us(false);
    let mut groups: BTreeMap<(u32, [u32; 3]), Vec<&LaunchPerf>> = BTreeMap::new();
    for l in &perf.launches {
        groups.entry((l.kernel.0, p.steps[l.step].launches[l.launch].grid)).or_default().push(l);
    }
    let mut launches: Vec<TopLaunch> = groups
        .values()
        .map(|ls| {
            let n = ls.len() as f64;
            let first = ls[0];
            let kernel = plan.kernel(first.kernel);
            let total: f64 = ls.iter().map(|l| l.time.us).sum();
            TopLaunch {
                kernel: kernel.name.clone(),
                family: kernel.family.name().into(),
                op: p.steps[first.step].op.name().into(),
                count: ls.len(),
                us_each: total / n,
                ms_total: total / 1e3,
                share: total / step_us,
                bytes_each: ls.iter().map(|l| l.cost.bytes.total()).sum::<f64>() / n,
                compulsory_bytes_each: ls.iter().map(|l| l.cost.compulsory.total()).sum::<f64>() / n,
                blocks: ls.iter().map(|l| l.cost.blocks).sum::<f64>() / n,
                bound: first.time.bound.label().into(),
            }
        })
        .collect();
    for all_reduce in [true, false] {
        let cs: Vec<&CollectivePerf> = perf.collectives.iter().filter(|c| c.all_reduce == all_reduce).collect();
        if cs.is_empty() {
            continue;
        }
        let n = cs.len() as f64;
        let total: f64 = cs.iter().map(|c| c.nccl_path_us()).sum();
        let bytes = cs.iter().map(|c| c.bytes as f64).sum::<f64>() / n;
        launches.push(TopLaunch {
            kernel: if all_reduce { "nccl all_reduce".into() } else { "nccl all_gather".into() },
            family: "collective".into(),
            op: if all_reduce { "all_reduce".into() } else { "all_gather".into() },
            count: cs.len(),
            us_each: total / n,
            ms_total: total / 1e3,
            share: total / step_us,
            bytes_each: bytes,
            compulsory_bytes_each: bytes,
            blocks: 0.0,
            bound: "latency".into(),
        });
    }
    launches.sort_by(|a, b| b.ms_total.total_cmp(&a.ms_total));
    launches.truncate(count);
    Ok(Top { program: p.name.clone(), batch, tokens, context, step_ms: step_us / 1e3, launches })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_launch_takes_its_slower_roof_scaled_by_occupancy_plus_the_launch() {
        let k = Constants::SM120A;
        // 1.5232 GB at 1.792 TB/s x 0.85 is 1 ms on the whole GPU
        let mut c = Cost { blocks: 188.0, ..Default::default() };
        c.bytes.weights = 1.5232e9;
        let t = launch_time(&c, &k);
        assert!((t.us - 1001.5).abs() < 1e-6 && t.bound == Bound::Memory, "{t:?}");
        // half the SMs: half the bandwidth
        c.blocks = 94.0;
        assert!((launch_time(&c, &k).us - 2001.5).abs() < 1e-6);
        // 1.6 PFLOP of FP4 mma is 1 s; more blocks than SMs do not help
        let mut f = Cost { blocks: 1000.0, ..Default::default() };
        f.flops.fp4_mma = 1.6e12;
        f.flops.fp32 = 6e7;
        let t = launch_time(&f, &k);
        assert!((t.us - (1e3 + 1.0 + 1.5)).abs() < 1e-6 && t.bound == Bound::Fp4Mma, "{t:?}");
    }

    #[test]
    fn small_collectives_may_take_the_one_shot_p2p_path() {
        let k = Constants::SM120A;
        let (nccl, p2p) = collective_time(true, false, 12_288.0, 8, &k);
        assert!((nccl - (25.0 + 12_288.0 / 40e3)).abs() < 1e-9);
        assert!((p2p.unwrap() - (8.0 + 7.0 * 12_288.0 / 50e3)).abs() < 1e-9);
        assert_eq!(collective_time(true, false, 65_537.0, 8, &k).1, None);
        assert!(collective_time(true, false, 65_536.0, 8, &k).1.is_some());
        // an all-gather: each rank reads one share from each peer
        let (nccl, p2p) = collective_time(false, false, 8.0 * 512.0, 8, &k);
        assert!((nccl - (25.0 + 4_096.0 / 40e3)).abs() < 1e-9);
        assert!((p2p.unwrap() - (8.0 + 7.0 * 512.0 / 50e3)).abs() < 1e-9);
        assert!(collective_time(false, false, 8.0 * 65_536.0, 8, &k).1.is_some());
        assert_eq!(collective_time(false, false, 8.0 * 65_537.0, 8, &k).1, None);
    }

    #[test]
    fn a_two_shot_all_reduce_is_two_passes_over_a_share() {
        let k = Constants::SM120A;
        // batch 8 of hidden 6144 in BF16 on 8 ranks: 98,304 B, shares of 12,288 B
        let (_, p2p) = collective_time(true, true, 98_304.0, 8, &k);
        assert!((p2p.unwrap() - 2.0 * (8.0 + 7.0 * 12_288.0 / 50e3)).abs() < 1e-9);
        assert!(collective_time(true, true, 8.0 * 65_536.0, 8, &k).1.is_some());
        assert_eq!(collective_time(true, true, 8.0 * 65_536.0 + 8.0, 8, &k).1, None);
    }

    /// What the lowering (`passes/lower/collective.rs`) relies on: under these constants the
    /// one-shot form's transfers are the fastest up to 64 KiB, and above it, up to `ranks` x 64
    /// KiB, the two-shot form's beat NCCL's (whether the kernel's one-block add and norm still
    /// leave it ahead the lowering prices per collective), for every rank count the kernel serves.
    #[test]
    fn each_p2p_form_transfers_fastest_where_the_lowering_may_take_it() {
        let k = Constants::SM120A;
        for ranks in 2..=8 {
            let max = ranks as u64 * k.p2p_max_bytes;
            for bytes in (16 * ranks as u64..=max).step_by(16 * ranks * 97) {
                let (nccl, one) = collective_time(true, false, bytes as f64, ranks, &k);
                let two = collective_time(true, true, bytes as f64, ranks, &k).1.unwrap();
                if bytes <= k.p2p_max_bytes {
                    assert!(one.unwrap() < two && one.unwrap() < nccl, "{ranks} ranks, {bytes} B: one-shot {one:?}, two-shot {two}, NCCL {nccl}");
                } else {
                    assert!(one.is_none() && two < nccl, "{ranks} ranks, {bytes} B: two-shot {two}, NCCL {nccl}");
                }
            }
        }
    }
}
