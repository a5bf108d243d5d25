//! One step at a time on GPU 0, for `kiln verify --backend cuda`: the step's launches run
//! eagerly (no graph) on exactly the values the CPU backend had before the step, each buffer,
//! weight slot, cache layer and the RoPE table in an allocation of its own (so an access past
//! a buffer's end faults instead of reading its neighbour), and the written buffers and cache
//! layers come back for comparison: the GPU counterpart of [`crate::verify::emulate`].

use super::hardware::{self, cu, gpu_error};
use super::rank::{load_kernel, param_count};
use super::resources::{Context, DeviceBuffer, Module, Stream};
use crate::error::RuntimeError;
use crate::plan::{BufId, Launch, Plan, Program};
use crate::verify::{decode, ArgValue, Emulated, StepInputs, StepRegions};
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
        // Each region: its allocation and the bytes uploaded into it.
        let mut regions = StepRegions::<(DeviceBuffer, usize)>::default();
        for l in launches {
            let k = plan.kernel(l.kernel);
            if !self.kernels.contains_key(&l.kernel.0) {
                let smem = plan.programs.iter().flat_map(|p| &p.steps).flat_map(|s| &s.launches).filter(|x| x.kernel == l.kernel).map(|x| x.smem_dynamic).max().unwrap_or(0);
                let (m, f, _) = load_kernel(k, self.kernels_dir.as_deref(), smem).map_err(|e| e.to_string())?;
                self.kernels.insert(l.kernel.0, (m, f, param_count(&k.ptx)));
            }
            let values = regions.args(plan, program, l, reads, st, &mut |what, bytes| {
                let b = DeviceBuffer::zeroed(bytes.len() as u64, what).map_err(|e| e.to_string())?;
                // SAFETY: `b` holds `bytes.len()` bytes.
                cu(|| format!("uploading {what}"), unsafe { result::memcpy_htod_sync(b.ptr, bytes) }).map_err(|e| e.to_string())?;
                let ptr = b.ptr;
                Ok(((b, bytes.len()), ptr))
            })?;
            // 8-byte slots: the driver reads each parameter's size from the front of its slot.
            let mut slots: Vec<u64> = values
                .iter()
                .map(|v| match *v {
                    ArgValue::Addr(a) => a,
                    ArgValue::U32(x) => x as u64,
                    ArgValue::F32(x) => x.to_bits() as u64,
                })
                .collect();
            let (_, f, params) = &self.kernels[&l.kernel.0];
            if slots.len() != *params {
                return Err(format!("kernel {} takes {params} parameters, the launch passes {}", k.name, slots.len()));
            }
            let mut ptrs: Vec<*mut c_void> = slots.iter_mut().map(|v| v as *mut u64 as *mut c_void).collect();
            let (g, b) = (l.grid, l.block);
            // SAFETY: arguments match the entry; every address is one of the regions above.
            cu(|| format!("launching {}", k.name), unsafe { result::launch_kernel(*f, (g[0], g[1], g[2]), (b[0], b[1], b[2]), l.smem_dynamic, self.stream.0, &mut ptrs) }).map_err(|e| e.to_string())?;
            self.stream.sync().map_err(|e| format!("{}: {e}", k.name))?;
        }
        let download = |(d, n): &(DeviceBuffer, usize)| -> Result<Vec<u8>, String> {
            let mut out = vec![0u8; *n];
            // SAFETY: `d` holds at least `n` bytes.
            cu(|| "reading back".into(), unsafe { result::memcpy_dtoh_sync(&mut out, d.ptr) }).map_err(|e| e.to_string())?;
            Ok(out)
        };
        let outputs = writes.iter().map(|&b| Ok((b, decode(program.buffer(b).dtype, &download(regions.written(program, b)?)?)))).collect::<Result<Vec<_>, String>>()?;
        let kv = regions.layers.iter().map(|(l, r, _)| download(r).map(|b| (*l, b))).collect::<Result<Vec<_>, String>>()?;
        let weight_bytes = regions.weights.iter().map(|(w, _, _)| plan.weight(*w).bytes).sum();
        Ok(Emulated { outputs, kv, bytes_read: 0, bytes_written: 0, compulsory_read: regions.compulsory, weight_read: 0, weight_bytes })
    }
}
