//! The emulator backend: replays a plan's programs the way the CUDA backend will, every step as
//! its kernel launches on simulated GPUs (one [`GlobalMemory`] per rank holding the weights
//! arena, the program buffers, the KV cache and the RoPE table); the collectives are summed or
//! gathered on the host in fixed rank order, as the CPU backend does. Behind `--backend emu` of
//! `kiln logits` and `kiln run`.
//!
//! Nothing here computes model math: every value comes out of emitted PTX. A plan with a step
//! that has no kernel is refused when the backend is built, naming the step.

use crate::bind::Arena;
use crate::cpu::rope::Rope;
use crate::cpu::Inputs;
use crate::emu::{self, BufferId, GlobalMemory, KernelArg, Module};
use crate::error::RuntimeError;
use crate::numerics::{bf16_to_f32, f32_to_bf16};
use crate::plan::{BufId, DType, LaunchArg, Op, Plan, Program};
use std::collections::HashMap;

/// One simulated GPU.
struct Device {
    rank: usize,
    mem: GlobalMemory,
    arena: BufferId,
    /// One buffer per KV-cache layer (the GPU layout of `KvLayout`).
    kv: Vec<BufferId>,
    rope: BufferId,
    /// Per program: one buffer per program value (allocated on the program's first replay).
    buffers: HashMap<usize, Vec<BufferId>>,
}

pub struct EmuBackend {
    plan: Plan,
    modules: Vec<Module>,
    devices: Vec<Device>,
    logits: Vec<f32>,
    /// Global bytes the kernels read and wrote in the last replay (all ranks).
    pub last_bytes: (u64, u64),
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
        let rope: Vec<u8> = Rope::new(plan.model.qk_rope_head_dim, plan.model.rope_theta)
            .table(kv.max_context)
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        let devices = arenas
            .into_iter()
            .enumerate()
            .map(|(rank, arena)| {
                let mut mem = GlobalMemory::new();
                let arena = mem.alloc_bytes("weights", &arena);
                let kv = (0..kv.layers).map(|l| mem.alloc(&format!("kv_cache.layer{l}"), kv.layer_bytes() as usize)).collect();
                let rope = mem.alloc_bytes("rope_table", &rope);
                Device { rank, mem, arena, kv, rope, buffers: HashMap::new() }
            })
            .collect();
        Ok(EmuBackend { plan, modules, devices, logits: Vec::new(), last_bytes: (0, 0) })
    }

    pub fn plan(&self) -> &Plan {
        &self.plan
    }

    /// A float buffer of `rank` as the last replay of `program` left it (every program value has
    /// its own emulated buffer), as f32; None if the program has not run.
    pub fn buffer_f32(&self, rank: usize, program: usize, buf: BufId) -> Option<Vec<f32>> {
        let d = self.devices.get(rank)?;
        d.buffers.get(&program)?;
        Some(read_floats(d, program, self.plan.programs.get(program)?, buf))
    }

    /// An I32 buffer of `rank` after the last replay of `program`.
    pub fn buffer_i32(&self, rank: usize, program: usize, buf: BufId) -> Option<Vec<i32>> {
        let d = self.devices.get(rank)?;
        let p = self.plan.programs.get(program)?;
        let bytes = d.mem.read(*d.buffers.get(&program)?.get(buf.0 as usize)?);
        Some(bytes.chunks_exact(4).take(numel(p, buf)).map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect())
    }

    /// Replays program `index` with `inputs`; returns its logits `[logit_rows, vocab]`.
    pub fn run(&mut self, index: usize, inputs: &Inputs) -> Result<&[f32], RuntimeError> {
        let plan = &self.plan;
        let program = plan.programs.get(index).ok_or_else(|| internal(format!("program {index} of {}", plan.programs.len())))?;
        crate::cpu::check_inputs(plan, program, inputs)?;
        for d in &mut self.devices {
            let bufs = d.buffers.entry(index).or_insert_with(|| {
                program.buffers.iter().map(|b| d.mem.alloc(&format!("{}.{}", program.name, b.name), (b.bytes as usize).max(4))).collect()
            });
            for (_, b, v) in inputs.by_buffer(program) {
                let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
                d.mem.write(bufs[b.0 as usize], 0, &bytes);
            }
        }
        let mut bytes = (0u64, 0u64);
        for (s, step) in program.steps.iter().enumerate() {
            let at = |m: String| internal(format!("{} step {s} ({}): {m}", program.name, step.op.name()));
            match step.op {
                Op::AllReduce { buf } => all_reduce(&mut self.devices, index, program, buf),
                Op::AllGather { input, out } => all_gather(&mut self.devices, index, program, input, out).map_err(at)?,
                _ => {
                    for d in &mut self.devices {
                        for l in &step.launches {
                            let args = l.args.iter().map(|a| d.arg(plan, index, *a)).collect::<Result<Vec<_>, String>>().map_err(at)?;
                            let kernel = plan.kernel(l.kernel);
                            let stats = emu::launch(&self.modules[l.kernel.0 as usize], &kernel.entry, l.grid, l.block, l.smem_dynamic, &args, &mut d.mem)
                                .map_err(|e| at(format!("{} on rank {}: {e}", kernel.name, d.rank)))?;
                            bytes.0 += stats.global_bytes_read();
                            bytes.1 += stats.global_bytes_written();
                        }
                    }
                }
            }
        }
        self.last_bytes = bytes;
        let d = &self.devices[0];
        let logits = read_floats(d, index, program, program.logits);
        self.logits.clear();
        self.logits.extend_from_slice(&logits);
        Ok(&self.logits)
    }
}

impl Device {
    fn arg(&self, plan: &Plan, program: usize, a: LaunchArg) -> Result<KernelArg, String> {
        Ok(match a {
            LaunchArg::Buffer(b) => KernelArg::U64(self.mem.addr(self.buffers[&program][b.0 as usize])),
            LaunchArg::Weight(w) => KernelArg::U64(self.mem.addr(self.arena) + plan.weight(w).offset),
            LaunchArg::KvCache { layer } => {
                let id = self.kv.get(layer as usize).ok_or_else(|| format!("layer {layer} has no KV cache"))?;
                KernelArg::U64(self.mem.addr(*id))
            }
            LaunchArg::RopeTable => KernelArg::U64(self.mem.addr(self.rope)),
            LaunchArg::U32(v) => KernelArg::U32(v),
            LaunchArg::F32(v) => KernelArg::F32(v),
            LaunchArg::PerRank(v) => KernelArg::U32(LaunchArg::per_rank(v, self.rank).ok_or_else(|| format!("rank {} x {v} overflows a u32", self.rank))?),
        })
    }
}

fn numel(p: &Program, b: BufId) -> usize {
    p.buffer(b).shape.iter().product()
}

/// A float buffer of one device as f32.
fn read_floats(d: &Device, program: usize, p: &Program, b: BufId) -> Vec<f32> {
    let n = numel(p, b);
    let bytes = d.mem.read(d.buffers[&program][b.0 as usize]);
    match p.buffer(b).dtype {
        DType::BF16 => bytes.chunks_exact(2).take(n).map(|c| bf16_to_f32(u16::from_le_bytes([c[0], c[1]]))).collect(),
        _ => bytes.chunks_exact(4).take(n).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect(),
    }
}

fn write_floats(d: &mut Device, program: usize, p: &Program, b: BufId, v: &[f32]) {
    let bytes: Vec<u8> = match p.buffer(b).dtype {
        DType::BF16 => v.iter().flat_map(|&x| f32_to_bf16(x).to_le_bytes()).collect(),
        _ => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
    };
    let id = d.buffers[&program][b.0 as usize];
    d.mem.write(id, 0, &bytes);
}

/// Sums `buf` over the ranks in rank order in f32 and stores the sum (rounded to the buffer's
/// dtype) on every rank: the CPU backend's all-reduce, bit for bit.
fn all_reduce(devices: &mut [Device], program: usize, p: &Program, buf: BufId) {
    let mut acc = read_floats(&devices[0], program, p, buf);
    for d in &devices[1..] {
        acc.iter_mut().zip(read_floats(d, program, p, buf)).for_each(|(a, v)| *a += v);
    }
    for d in devices.iter_mut() {
        write_floats(d, program, p, buf, &acc);
    }
}

/// Concatenates each rank's `input` columns in rank order into `out` on every rank.
fn all_gather(devices: &mut [Device], program: usize, p: &Program, input: BufId, out: BufId) -> Result<(), String> {
    let w = p.buffer(input).shape.last().copied().unwrap_or(1);
    let wo = p.buffer(out).shape.last().copied().unwrap_or(1);
    let rows = numel(p, out) / wo.max(1);
    if w * devices.len() != wo {
        return Err("all-gather shapes do not match the rank count".into());
    }
    let mut acc = vec![0f32; rows * wo];
    for (r, d) in devices.iter().enumerate() {
        let src = read_floats(d, program, p, input);
        for row in 0..rows {
            acc[row * wo + r * w..row * wo + (r + 1) * w].copy_from_slice(&src[row * w..(row + 1) * w]);
        }
    }
    for d in devices.iter_mut() {
        write_floats(d, program, p, out, &acc);
    }
    Ok(())
}
