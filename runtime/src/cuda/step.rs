//! One step at a time on GPU 0, for `kiln verify --backend cuda`: the step's launches run
//! eagerly (no graph) on exactly the values the CPU backend had before the step, each buffer,
//! weight slot, cache layer and the RoPE table in an allocation of its own (so an access past
//! a buffer's end faults instead of reading its neighbour), and the written buffers and cache
//! layers come back for comparison: the GPU counterpart of [`crate::verify::emulate`].

use super::hardware::{self, cu, gpu_error};
use super::rank::{load_kernel, param_count};
use super::resources::{Context, DeviceBuffer, Module, Stream};
use crate::error::RuntimeError;
use crate::plan::{BufId, Launch, LaunchArg, Plan, Program, WeightId};
use crate::verify::{decode, encode, Emulated, StepInputs};
use cudarc::driver::{result, sys};
use std::collections::HashMap;
use std::ffi::c_void;
use std::path::PathBuf;

pub struct StepRunner {
    kernels: HashMap<u32, (Module, sys::CUfunction, usize)>,
    kernels_dir: Option<PathBuf>,
    stream: Stream,
    ctx: Context,
}

impl StepRunner {
    /// Opens GPU 0 after checking it can run the plan's kernels.
    pub fn new(plan: &Plan, kernels_dir: Option<PathBuf>) -> Result<StepRunner, RuntimeError> {
        let machine = hardware::probe()?;
        if machine.gpus.is_empty() {
            return Err(gpu_error("the driver reports no GPU"));
        }
        // Every rank's steps run on GPU 0, one buffer at a time: only its kernels must fit.
        let why = hardware::kernel_incompatibilities(plan, &machine, 1);
        if !why.is_empty() {
            return Err(gpu_error(format!("GPU 0 cannot run the plan's kernels:\n  - {}", why.join("\n  - "))));
        }
        let ctx = Context::open(0)?;
        let stream = Stream::new()?;
        Ok(StepRunner { kernels: HashMap::new(), kernels_dir, stream, ctx })
    }

    /// Runs `launches` of one step on one rank's state; `reads` count as compulsory traffic,
    /// `writes` come back.
    pub fn run(&mut self, plan: &Plan, program: &Program, launches: &[Launch], reads: &[BufId], writes: &[BufId], st: &StepInputs) -> Result<Emulated, String> {
        self.ctx.bind().map_err(|e| e.to_string())?;
        let mut bufs: Vec<(BufId, DeviceBuffer, usize)> = Vec::new();
        let mut weights: Vec<(WeightId, DeviceBuffer)> = Vec::new();
        let mut layers: Vec<(u32, DeviceBuffer, usize)> = Vec::new();
        let mut rope: Option<DeviceBuffer> = None;
        let mut compulsory = 0u64;
        let upload = |bytes: &[u8], what: &str| -> Result<DeviceBuffer, String> {
            let b = DeviceBuffer::zeroed(bytes.len() as u64, what).map_err(|e| e.to_string())?;
            // SAFETY: `b` holds `bytes.len()` bytes.
            cu(|| format!("uploading {what}"), unsafe { result::memcpy_htod_sync(b.ptr, bytes) }).map_err(|e| e.to_string())?;
            Ok(b)
        };
        for l in launches {
            let k = plan.kernel(l.kernel);
            if !self.kernels.contains_key(&l.kernel.0) {
                let smem = plan.programs.iter().flat_map(|p| &p.steps).flat_map(|s| &s.launches).filter(|x| x.kernel == l.kernel).map(|x| x.smem_dynamic).max().unwrap_or(0);
                let (m, f, _) = load_kernel(k, self.kernels_dir.as_deref(), smem).map_err(|e| e.to_string())?;
                self.kernels.insert(l.kernel.0, (m, f, param_count(&k.ptx)));
            }
            let mut values = Vec::with_capacity(l.args.len());
            for a in &l.args {
                values.push(match *a {
                    LaunchArg::Buffer(b) => match bufs.iter().find(|(x, _, _)| *x == b) {
                        Some((_, d, _)) => d.ptr,
                        None => {
                            let buf = program.buffer(b);
                            let bytes = encode(buf.dtype, &(st.value)(b))?;
                            if reads.contains(&b) {
                                compulsory += bytes.len() as u64;
                            }
                            let d = upload(&bytes, &buf.name)?;
                            let p = d.ptr;
                            bufs.push((b, d, bytes.len()));
                            p
                        }
                    },
                    LaunchArg::Weight(w) => match weights.iter().find(|(x, _)| *x == w) {
                        Some((_, d)) => d.ptr,
                        None => {
                            let s = plan.weight(w);
                            let bytes = st.arena.get(s.offset as usize..(s.offset + s.bytes) as usize).ok_or_else(|| format!("slot `{}` lies outside the arena", s.name))?;
                            compulsory += bytes.len() as u64;
                            let d = upload(bytes, &s.name)?;
                            let p = d.ptr;
                            weights.push((w, d));
                            p
                        }
                    },
                    LaunchArg::KvCache { layer } => match layers.iter().find(|(x, _, _)| *x == layer) {
                        Some((_, d, _)) => d.ptr,
                        None => {
                            let bytes = (st.kv_layer)(layer);
                            let d = upload(&bytes, &format!("kv_cache.layer{layer}"))?;
                            let p = d.ptr;
                            layers.push((layer, d, bytes.len()));
                            p
                        }
                    },
                    LaunchArg::RopeTable => {
                        if rope.is_none() {
                            rope = Some(upload(st.rope_table, "rope_table")?);
                        }
                        rope.as_ref().map(|d| d.ptr).unwrap_or_default()
                    }
                    LaunchArg::U32(v) => v as u64,
                    LaunchArg::F32(v) => v.to_bits() as u64,
                    LaunchArg::PerRank(v) => LaunchArg::per_rank(v, st.rank).ok_or_else(|| format!("rank {} x {v} overflows a u32 argument", st.rank))? as u64,
                });
            }
            let (_, f, params) = &self.kernels[&l.kernel.0];
            if values.len() != *params {
                return Err(format!("kernel {} takes {params} parameters, the launch passes {}", k.name, values.len()));
            }
            let mut ptrs: Vec<*mut c_void> = values.iter_mut().map(|v| v as *mut u64 as *mut c_void).collect();
            let (g, b) = (l.grid, l.block);
            // SAFETY: arguments match the entry; every address is one of the allocations above.
            cu(|| format!("launching {}", k.name), unsafe { result::launch_kernel(*f, (g[0], g[1], g[2]), (b[0], b[1], b[2]), l.smem_dynamic, self.stream.0, &mut ptrs) }).map_err(|e| e.to_string())?;
            self.stream.sync().map_err(|e| format!("{}: {e}", k.name))?;
        }
        let download = |d: &DeviceBuffer, n: usize| -> Result<Vec<u8>, String> {
            let mut out = vec![0u8; n];
            // SAFETY: `d` holds at least `n` bytes.
            cu(|| "reading back".into(), unsafe { result::memcpy_dtoh_sync(&mut out, d.ptr) }).map_err(|e| e.to_string())?;
            Ok(out)
        };
        let outputs = writes
            .iter()
            .map(|&b| {
                let (_, d, len) = bufs.iter().find(|(x, _, _)| *x == b).ok_or_else(|| format!("the launches do not pass written buffer {}", program.buffer(b).name))?;
                Ok((b, decode(program.buffer(b).dtype, &download(d, *len)?)))
            })
            .collect::<Result<Vec<_>, String>>()?;
        let kv = layers.iter().map(|(l, d, len)| download(d, *len).map(|b| (*l, b))).collect::<Result<Vec<_>, String>>()?;
        let weight_bytes = weights.iter().map(|(w, _)| plan.weight(*w).bytes).sum();
        Ok(Emulated { outputs, kv, bytes_read: 0, bytes_written: 0, compulsory_read: compulsory, weight_read: 0, weight_bytes })
    }
}
