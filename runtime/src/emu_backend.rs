//! The emulator backend: replays a plan's programs the way the CUDA backend will, every step as
//! its kernel launches on simulated GPUs, one [`GlobalMemory`] per rank holding the weights arena,
//! one workspace in which every program buffer sits at the offset the memory plan gave it (so a
//! liveness mistake of the planner corrupts values here as it would on a GPU), the KV cache and
//! the RoPE table. An all-reduce the plan gives a one-shot P2P launch runs that kernel on every
//! rank at once (a thread each, every rank addressing the others' memories, each its own address
//! range as unified addressing gives); the other collectives are summed or gathered on the host
//! in fixed rank order, as the CPU backend does. Behind `--backend emu` of `kiln logits`, `run`
//! and `serve`.
//!
//! Nothing here computes model math: every value comes out of emitted PTX.

use crate::bind::Arena;
use crate::cpu::rope::Rope;
use crate::cpu::Inputs;
use crate::emu::{self, BufferId, GlobalMemory, KernelArg, Module, GLOBAL_BASE};
use crate::error::RuntimeError;
use crate::numerics::{bytes_floats, float_bytes};
use crate::plan::{BufId, DType, Launch, LaunchArg, Op, P2pLayout, Plan, Program, SplitKLayout};

/// One simulated GPU.
struct Device {
    rank: usize,
    mem: GlobalMemory,
    arena: BufferId,
    /// The workspace all programs share (`MemoryPlan::workspace` bytes).
    workspace: BufferId,
    /// One buffer per KV-cache layer (the GPU layout of `KvLayout`).
    kv: Vec<BufferId>,
    rope: BufferId,
    /// The P2P collective region (plans whose collectives have a P2P launch).
    p2p: Option<BufferId>,
    /// The split-K region (plans with a cross-block split-K GEMM), zeroed.
    split_k: Option<BufferId>,
}

pub struct EmuBackend {
    plan: Plan,
    modules: Vec<Module>,
    devices: Vec<Device>,
    logits: Vec<f32>,
    /// The last replay's `hidden_out` rows (plans with a draft model), rank 0's.
    hidden: Vec<f32>,
}

fn internal(m: impl Into<String>) -> RuntimeError {
    RuntimeError::internal(m.into())
}

impl EmuBackend {
    /// Takes one weights arena per rank (from [`crate::bind::bind`]).
    pub fn new(plan: Plan, arenas: Vec<Arena>) -> Result<EmuBackend, RuntimeError> {
        if plan.kernels.is_empty() {
            return Err(RuntimeError::Unsupported {
                message: format!("the plan was compiled for {} and has no kernels; the emulator needs a GPU target such as sm_120a", plan.target.name),
            });
        }
        for p in &plan.programs {
            if let Some((s, step)) = p.steps.iter().enumerate().find(|(_, s)| s.launches.is_empty() && !matches!(s.op, Op::AllReduce { .. } | Op::AllGather { .. })) {
                return Err(internal(format!("{} step {s} ({}) has no kernel launch in a GPU plan", p.name, step.op.name())));
            }
        }
        if arenas.len() != plan.ranks() {
            return Err(internal(format!("{} weight arenas for {} ranks", arenas.len(), plan.ranks())));
        }
        let modules = plan
            .kernels
            .iter()
            .map(|k| Module::parse(&k.ptx, &format!("{}.ptx", k.name)).map_err(|e| internal(format!("kernel {}: {e}", k.name))))
            .collect::<Result<Vec<_>, _>>()?;
        let kv = &plan.memory.kv;
        let rope = Rope::plan_table_bytes(&plan);
        let workspace = plan.memory.workspace.max(4) as usize;
        let p2p = plan.ranks() > 1 && plan.programs.iter().flat_map(|p| &p.steps).any(|s| s.p2p_collective(&plan));
        let layout = P2pLayout { ranks: plan.ranks() as u64 };
        let split_k = plan.uses_split_k();
        let mut devices: Vec<Device> = arenas
            .into_iter()
            .enumerate()
            .map(|(rank, arena)| {
                // one address range per GPU (1 TiB apart), so peers' addresses never collide
                let mut mem = GlobalMemory::with_base(GLOBAL_BASE + ((rank as u64 + 1) << 40));
                let arena = mem.alloc_bytes("weights", &arena);
                let workspace = mem.alloc("workspace", workspace);
                let kv = (0..kv.layers).map(|l| mem.alloc(&format!("kv_cache.layer{l}"), kv.layer_bytes() as usize)).collect();
                let rope = mem.alloc_bytes("rope_table", &rope);
                let p2p = p2p.then(|| mem.alloc("p2p_region", layout.bytes() as usize));
                let split_k = split_k.then(|| mem.alloc("split_k_region", SplitKLayout::BYTES as usize));
                Device { rank, mem, arena, workspace, kv, rope, p2p, split_k }
            })
            .collect();
        // every region starts with the table of all ranks' regions
        let table: Vec<u8> = devices.iter().filter_map(|d| d.p2p.map(|r| d.mem.addr(r))).flat_map(|a| a.to_le_bytes()).collect();
        for d in &mut devices {
            if let Some(r) = d.p2p {
                d.mem.write(r, 0, &table);
            }
        }
        Ok(EmuBackend { plan, modules, devices, logits: Vec::new(), hidden: Vec::new() })
    }

    pub fn plan(&self) -> &Plan {
        &self.plan
    }

    /// Replays program `index` with `inputs`; returns its logits `[logit_rows, vocab]`.
    pub fn run(&mut self, index: usize, inputs: &Inputs) -> Result<&[f32], RuntimeError> {
        let plan = &self.plan;
        let program = plan.programs.get(index).ok_or_else(|| internal(format!("program {index} of {}", plan.programs.len())))?;
        crate::cpu::check_inputs(plan, program, inputs)?;
        for d in &mut self.devices {
            for (_, b, v) in inputs.by_buffer(program) {
                let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
                d.mem.write(d.workspace, program.buffer(b).offset as usize, &bytes);
            }
            // a draft program's hidden rows, rounded to the buffer's dtype as the CPU backend does
            if let Some(b) = program.hidden_in {
                write_floats(d, program, b, &inputs.hidden);
            }
        }
        for (s, step) in program.steps.iter().enumerate() {
            let at = |m: String| internal(format!("{} step {s} ({}): {m}", program.name, step.op.name()));
            match step.op {
                _ if step.p2p_collective(plan) && self.devices.len() > 1 => {
                    let l = &step.launches[0];
                    let kernel = plan.kernel(l.kernel);
                    let module = &self.modules[l.kernel.0 as usize];
                    let devices = &self.devices;
                    // every rank's arguments first: a rank that cannot start must not leave the
                    // others waiting for its flags
                    let args: Vec<Vec<KernelArg>> = devices.iter().map(|d| l.args.iter().map(|a| d.arg(plan, program, *a)).collect::<Result<Vec<_>, String>>()).collect::<Result<_, _>>().map_err(at)?;
                    let results: Vec<Result<(), String>> = std::thread::scope(|sc| {
                        let handles: Vec<_> = devices
                            .iter()
                            .zip(&args)
                            .map(|(d, args)| {
                                sc.spawn(move || {
                                    let peers: Vec<&GlobalMemory> = devices.iter().filter(|o| o.rank != d.rank).map(|o| &o.mem).collect();
                                    emu::launch_with_peers(module, &kernel.entry, l.grid, l.block, l.smem_dynamic, args, &d.mem, &peers).map(|_| ()).map_err(|e| format!("{} on rank {}: {e}", kernel.name, d.rank))
                                })
                            })
                            .collect();
                        handles.into_iter().map(|h| h.join().unwrap_or_else(|_| Err("a rank's thread panicked".into()))).collect()
                    });
                    results.into_iter().collect::<Result<Vec<()>, String>>().map_err(at)?;
                    // the add and norm the kernel left to their launches
                    launch_on_every_rank(&mut self.devices, plan, program, &self.modules, step.after_p2p(plan)).map_err(at)?;
                }
                Op::AllReduce { buf, .. } => {
                    all_reduce(&mut self.devices, program, buf);
                    // what the NCCL path runs after the collective (the residual add it took over)
                    launch_on_every_rank(&mut self.devices, plan, program, &self.modules, step.after_collective(plan)).map_err(at)?;
                }
                Op::AllGather { ref pairs } => {
                    pairs.iter().try_for_each(|g| all_gather(&mut self.devices, program, g.input, g.out)).map_err(at)?;
                    launch_on_every_rank(&mut self.devices, plan, program, &self.modules, step.after_collective(plan)).map_err(at)?;
                }
                _ => launch_on_every_rank(&mut self.devices, plan, program, &self.modules, &step.launches).map_err(at)?,
            }
        }
        self.logits = read_floats(&self.devices[0], program, program.logits);
        self.hidden = program.hidden_out.map(|b| read_floats(&self.devices[0], program, b)).unwrap_or_default();
        Ok(&self.logits)
    }

    /// The `[tokens, hidden]` rows of the final normed hidden state the last replay left, in
    /// plans with a draft model ([`Program::hidden_out`]).
    pub fn hidden_out(&self) -> Option<&[f32]> {
        (!self.hidden.is_empty()).then_some(&self.hidden[..])
    }
}

/// Runs `launches` in order on every rank's memory.
fn launch_on_every_rank(devices: &mut [Device], plan: &Plan, program: &Program, modules: &[Module], launches: &[Launch]) -> Result<(), String> {
    for d in devices {
        for l in launches {
            let args = l.args.iter().map(|a| d.arg(plan, program, *a)).collect::<Result<Vec<_>, String>>()?;
            let kernel = plan.kernel(l.kernel);
            emu::launch(&modules[l.kernel.0 as usize], &kernel.entry, l.grid, l.block, l.smem_dynamic, &args, &mut d.mem).map_err(|e| format!("{} on rank {}: {e}", kernel.name, d.rank))?;
        }
    }
    Ok(())
}

impl Device {
    fn arg(&self, plan: &Plan, program: &Program, a: LaunchArg) -> Result<KernelArg, String> {
        Ok(match a {
            LaunchArg::Buffer(b) => KernelArg::U64(self.mem.addr(self.workspace) + program.buffer(b).offset),
            LaunchArg::Weight(w) => KernelArg::U64(self.mem.addr(self.arena) + plan.weight(w).offset),
            LaunchArg::KvCache { layer } => {
                let id = self.kv.get(layer as usize).ok_or_else(|| format!("layer {layer} has no KV cache"))?;
                KernelArg::U64(self.mem.addr(*id))
            }
            LaunchArg::RopeTable => KernelArg::U64(self.mem.addr(self.rope)),
            LaunchArg::P2pRegion => KernelArg::U64(self.mem.addr(self.p2p.ok_or("no P2P region on this device")?)),
            LaunchArg::SplitKRegion => KernelArg::U64(self.mem.addr(self.split_k.ok_or("no split-K region on this device")?)),
            LaunchArg::SplitKRegionUpper => KernelArg::U64(self.mem.addr(self.split_k.ok_or("no split-K region on this device")?) + SplitKLayout::UPPER),
            LaunchArg::U32(v) => KernelArg::U32(v),
            LaunchArg::F32(v) => KernelArg::F32(v),
            LaunchArg::PerRank(v) => KernelArg::U32(LaunchArg::per_rank(v, self.rank).ok_or_else(|| format!("rank {} x {v} overflows a u32", self.rank))?),
        })
    }
}

/// A float buffer of one device as f32.
fn read_floats(d: &Device, p: &Program, b: BufId) -> Vec<f32> {
    let buf = p.buffer(b);
    let bf16 = buf.dtype == DType::BF16;
    let n: usize = buf.shape.iter().product();
    bytes_floats(&d.mem.read_at(d.workspace, buf.offset as usize, n * if bf16 { 2 } else { 4 }), bf16)
}

fn write_floats(d: &mut Device, p: &Program, b: BufId, v: &[f32]) {
    let buf = p.buffer(b);
    d.mem.write(d.workspace, buf.offset as usize, &float_bytes(v, buf.dtype == DType::BF16));
}

/// Sums `buf` over the ranks in rank order in f32 and stores the sum (rounded to the buffer's
/// dtype) on every rank: the CPU backend's all-reduce, bit for bit.
fn all_reduce(devices: &mut [Device], p: &Program, buf: BufId) {
    let mut acc = read_floats(&devices[0], p, buf);
    for d in &devices[1..] {
        acc.iter_mut().zip(read_floats(d, p, buf)).for_each(|(a, v)| *a += v);
    }
    for d in devices.iter_mut() {
        write_floats(d, p, buf, &acc);
    }
}

/// Concatenates each rank's `input` columns in rank order into `out` on every rank.
fn all_gather(devices: &mut [Device], p: &Program, input: BufId, out: BufId) -> Result<(), String> {
    // `out` holds [rows, ranks x w] whatever its shape (see Op::AllGather); I32 lists move as
    // the f32 words of their bits
    let w = p.buffer(input).shape.last().copied().unwrap_or(1);
    let rows = p.buffer(input).shape.iter().product::<usize>() / w.max(1);
    let wo = w * devices.len();
    if p.buffer(out).shape.iter().product::<usize>() != rows * wo {
        return Err("all-gather shapes do not match the rank count".into());
    }
    let mut acc = vec![0f32; rows * wo];
    for (r, d) in devices.iter().enumerate() {
        let src = read_floats(d, p, input);
        for row in 0..rows {
            acc[row * wo + r * w..row * wo + (r + 1) * w].copy_from_slice(&src[row * w..(row + 1) * w]);
        }
    }
    for d in devices.iter_mut() {
        write_floats(d, p, out, &acc);
    }
    Ok(())
}
