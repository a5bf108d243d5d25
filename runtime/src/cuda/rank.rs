//! One GPU of a plan, owned by its worker thread: the context, one stream, exactly the memory
//! the plan lays out (one allocation each for the weights arena, the workspace every program
//! shares, the KV cache with its layers back to back, and the RoPE table), the plan's modules,
//! the NCCL communicator, the one-shot P2P collective's region (plans that have the kernel) and
//! one CUDA graph per program.

use super::hardware::{cu, gpu_error};
use super::resources::{Context, DeviceBuffer, Event, Graph, Module, Pinned, Stream, WRITE_COMBINED};
use crate::bind::{fill_slot_region, CheckpointFiles};
use crate::error::RuntimeError;
use crate::plan::{DType, KernelInfo, Launch, LaunchArg, Op, P2pLayout, Plan, Program, SplitKLayout};
use cudarc::driver::{result, sys};
use cudarc::nccl::{result as nccl, sys as nccl_sys};
use std::ffi::{c_void, CString};
use std::path::Path;
use std::time::{Duration, Instant};

/// Bytes of each of the two pinned buffers weights are staged through.
const STAGE_BYTES: usize = 64 << 20;

pub struct RankDevice {
    pub rank: usize,
    graphs: Vec<Graph>,
    comm: Option<nccl_sys::ncclComm_t>,
    /// Per plan kernel: its function and the number of `.param`s its entry declares.
    functions: Vec<(sys::CUfunction, usize)>,
    modules: Vec<Module>,
    inputs_stage: Pinned,
    readback: Pinned,
    arena: DeviceBuffer,
    workspace: DeviceBuffer,
    kv: DeviceBuffer,
    rope: DeviceBuffer,
    /// The P2P collective region (zeroed), when the plan's collectives have P2P launches.
    p2p_region: Option<DeviceBuffer>,
    /// The split-K region (zeroed; plans with a cross-block split-K GEMM).
    split_k: Option<DeviceBuffer>,
    /// Whether small collectives replay the P2P kernel (every pair passed the probe) or NCCL.
    p2p: bool,
    stream: Stream,
    ctx: Context,
}

/// What opening a GPU reported.
pub struct Opened {
    /// Bytes of the four planned allocations (and the P2P region).
    pub allocated: u64,
    /// What the driver has left after them.
    pub free_after: u64,
    /// This GPU's context handle and P2P region address (peers enable access to the context
    /// and find the region in the table).
    pub context: u64,
    pub p2p_region: Option<u64>,
}

/// Whether any collective of the plan has a one-shot P2P launch.
pub fn plan_has_p2p(plan: &Plan) -> bool {
    plan.ranks() > 1 && plan.programs.iter().flat_map(|p| &p.steps).any(|s| s.p2p_collective(plan))
}

fn nccl_error(what: &str, e: nccl::NcclError) -> RuntimeError {
    // SAFETY: returns a static string.
    let text = unsafe { std::ffi::CStr::from_ptr(nccl_sys::ncclGetErrorString(e.0)) }.to_string_lossy().into_owned();
    gpu_error(format!("{what}: NCCL {:?} ({text})", e.0))
}

fn nccl_type(d: DType) -> Result<nccl_sys::ncclDataType_t, RuntimeError> {
    match d {
        DType::F32 => Ok(nccl_sys::ncclDataType_t::ncclFloat32),
        DType::BF16 => Ok(nccl_sys::ncclDataType_t::ncclBfloat16),
        DType::I32 => Ok(nccl_sys::ncclDataType_t::ncclInt32),
        other => Err(RuntimeError::internal(format!("a collective over a {other} buffer"))),
    }
}

/// `.param` entries of the first `.entry` in `ptx` (the launch must pass exactly that many).
pub fn param_count(ptx: &str) -> usize {
    let Some(start) = ptx.find(".entry") else { return 0 };
    let rest = &ptx[start..];
    let end = rest.find(')').unwrap_or(rest.len());
    rest[..end].matches(".param").count()
}

impl RankDevice {
    /// Creates the context and allocates the plan's memory (zeroed), uploading the RoPE table.
    pub fn open(rank: usize, plan: &Plan) -> Result<(RankDevice, Opened), RuntimeError> {
        let ctx = Context::open(rank)?;
        let stream = Stream::new()?;
        let m = &plan.memory;
        let kv_bytes = m.kv.layer_bytes() * m.kv.layers as u64;
        let arena = DeviceBuffer::zeroed(m.weights, "weights arena")?;
        let workspace = DeviceBuffer::zeroed(m.workspace, "workspace")?;
        let kv = DeviceBuffer::zeroed(kv_bytes, "KV cache")?;
        let rope_bytes = crate::cpu::rope::Rope::plan_table_bytes(plan);
        let rope = DeviceBuffer::zeroed(rope_bytes.len() as u64, "RoPE table")?;
        // SAFETY: `rope` holds the table; synchronous copy from host memory.
        cu(|| "uploading the RoPE table".into(), unsafe { result::memcpy_htod_sync(rope.ptr, &rope_bytes) })?;
        let input_bytes = plan.programs.iter().map(inputs_bytes).max().unwrap_or(0);
        // only rank 0 reads its outputs back (a draft plan's prefill hidden rows: 100 MB for
        // GLM-5's 8,192-token chunk, pinned once, not on every GPU's worker)
        let readback_bytes = if rank == 0 { plan.programs.iter().map(readback_bytes).max().unwrap_or(0) } else { 0 };
        let inputs_stage = Pinned::new(input_bytes as usize, WRITE_COMBINED)?;
        let readback = Pinned::new(readback_bytes as usize, 0)?;
        let p2p_region = if plan_has_p2p(plan) { Some(DeviceBuffer::zeroed(P2pLayout { ranks: plan.ranks() as u64 }.bytes(), "P2P collective region")?) } else { None };
        let split_k = if plan.uses_split_k() { Some(DeviceBuffer::zeroed(SplitKLayout::BYTES, "split-K region")?) } else { None };
        let allocated = arena.bytes + workspace.bytes + kv.bytes + rope.bytes + p2p_region.as_ref().map_or(0, |r| r.bytes) + split_k.as_ref().map_or(0, |r| r.bytes);
        let (free_after, _) = ctx.memory()?;
        let opened = Opened { allocated, free_after, context: ctx.ctx as u64, p2p_region: p2p_region.as_ref().map(|r| r.ptr) };
        let dev = RankDevice { rank, graphs: Vec::new(), comm: None, functions: Vec::new(), modules: Vec::new(), inputs_stage, readback, arena, workspace, kv, rope, p2p_region, split_k, p2p: false, stream, ctx };
        Ok((dev, opened))
    }

    /// Fills every weight slot of this rank from the mapped checkpoint into pinned staging
    /// buffers (two, so one is copied while the next is filled) and copies them into the
    /// arena (`flags`: the pinned staging's, from `KILN_UPLOAD_STAGING`). Returns the bytes
    /// uploaded.
    pub fn upload_weights(&mut self, plan: &Plan, files: &CheckpointFiles, flags: u32, bar: &indicatif::ProgressBar) -> Result<u64, RuntimeError> {
        let stage_len = STAGE_BYTES.min(plan.memory.weights.max(1) as usize);
        let mut stager = Stager {
            stages: [Pinned::new(stage_len, flags)?, Pinned::new(stage_len, flags)?],
            events: [Event::new()?, Event::new()?],
            in_flight: [false, false],
            current: 0,
            used: 0,
            pending: Vec::new(),
            arena: self.arena.ptr,
            stream: self.stream.0,
        };
        let mut total = 0u64;
        for slot in &plan.weights {
            let n = slot.bytes as usize;
            if n > stage_len {
                // Larger than a stage: build it on the heap, then stream it through the stages.
                stager.flush()?;
                let mut buf = vec![0u8; n];
                fill_slot_region(plan, files, slot, self.rank, &mut buf)?;
                for (i, chunk) in buf.chunks(stage_len).enumerate() {
                    let region = stager.reserve(chunk.len())?;
                    region.copy_from_slice(chunk);
                    stager.commit(slot.offset + (i * stage_len) as u64, chunk.len());
                    stager.flush()?;
                }
            } else {
                if stager.used + n > stage_len {
                    stager.flush()?;
                }
                let region = stager.reserve(n)?;
                region.fill(0);
                fill_slot_region(plan, files, slot, self.rank, region)?;
                stager.commit(slot.offset, n);
            }
            total += slot.bytes;
            bar.inc(slot.bytes);
        }
        stager.flush()?;
        self.stream.sync()?;
        Ok(total)
    }

    /// Loads every kernel (see [`load_kernel`]); returns the kernels that were JIT-compiled.
    pub fn load_kernels(&mut self, plan: &Plan, kernels_dir: Option<&Path>) -> Result<Vec<String>, RuntimeError> {
        let mut jit = Vec::new();
        let mut dynamic = vec![0u32; plan.kernels.len()];
        for l in plan.programs.iter().flat_map(|p| &p.steps).flat_map(|s| &s.launches) {
            dynamic[l.kernel.0 as usize] = dynamic[l.kernel.0 as usize].max(l.smem_dynamic);
        }
        for (k, &smem) in plan.kernels.iter().zip(&dynamic) {
            let (module, f, jitted) = load_kernel(k, kernels_dir, smem)?;
            self.modules.push(module);
            if jitted {
                jit.push(k.name.clone());
            }
            self.functions.push((f, param_count(&k.ptx)));
        }
        Ok(jit)
    }

    /// Switches small all-reduces to the P2P kernel: enables access to every peer's context and
    /// writes the table of every rank's region (`regions[r]`) into this rank's.
    pub fn enable_p2p(&mut self, contexts: &[u64], regions: &[u64]) -> Result<(), RuntimeError> {
        self.ctx.bind()?;
        let region = self.p2p_region.as_ref().ok_or_else(|| RuntimeError::internal("P2P enabled on a rank without a region"))?;
        for (peer, &c) in contexts.iter().enumerate().filter(|(p, _)| *p != self.rank) {
            // SAFETY: `c` is a live context of the process (peer's worker keeps it retained).
            match unsafe { sys::cuCtxEnablePeerAccess(c as sys::CUcontext, 0) }.result() {
                Ok(()) => {}
                Err(e) if e.0 == sys::CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED => {}
                Err(e) => return Err(gpu_error(format!("GPU {}: enabling peer access to GPU {peer}: {}", self.rank, super::hardware::describe(&e)))),
            }
        }
        let table: Vec<u8> = regions.iter().flat_map(|r| r.to_le_bytes()).collect();
        // SAFETY: the region starts with room for the table (P2pLayout).
        cu(|| "writing the P2P region table".into(), unsafe { result::memcpy_htod_sync(region.ptr, &table) })?;
        self.p2p = true;
        Ok(())
    }

    /// Whether collective `step` replays the P2P kernel.
    fn uses_p2p(&self, plan: &Plan, step: &crate::plan::Step) -> bool {
        self.p2p && step.p2p_collective(plan)
    }

    /// Joins the communicator of all ranks (blocks until every rank has called it).
    pub fn init_comm(&mut self, id: nccl_sys::ncclUniqueId, nranks: usize) -> Result<(), RuntimeError> {
        self.ctx.bind()?;
        let mut comm: nccl_sys::ncclComm_t = std::ptr::null_mut();
        // SAFETY: writes the new communicator.
        unsafe { nccl::comm_init_rank(&mut comm, nranks as i32, id, self.rank as i32) }.map_err(|e| nccl_error(&format!("rank {}: ncclCommInitRank", self.rank), e))?;
        self.comm = Some(comm);
        Ok(())
    }

    /// Runs every collective of every program once, eagerly and in plan order on every rank,
    /// so that NCCL has connected for each message size before any capture.
    pub fn warm_up_collectives(&mut self, plan: &Plan) -> Result<(), RuntimeError> {
        if self.comm.is_none() {
            return Ok(());
        }
        let mut seen = std::collections::HashSet::new();
        for p in &plan.programs {
            for step in p.steps.iter().filter(|s| !self.uses_p2p(plan, s)) {
                let key: Vec<(u64, u64, u64)> = match step.op {
                    Op::AllReduce { buf, .. } => vec![(0, p.buffer(buf).bytes, p.buffer(buf).dtype.size() as u64)],
                    Op::AllGather { ref pairs } => pairs.iter().map(|g| (1, p.buffer(g.input).bytes, p.buffer(g.out).bytes)).collect(),
                    _ => continue,
                };
                if seen.insert(key) {
                    self.collective(plan, p, &step.op)?;
                }
            }
        }
        self.stream.sync()
    }

    fn collective(&self, plan: &Plan, p: &Program, op: &Op) -> Result<(), RuntimeError> {
        let comm = self.comm.ok_or_else(|| RuntimeError::internal(format!("{}: a collective in a plan of one rank", p.name)))?;
        let stream = self.stream.0 as nccl_sys::cudaStream_t;
        let at = |b: crate::plan::BufId| self.workspace.ptr + p.buffer(b).offset;
        match *op {
            Op::AllReduce { buf, .. } => {
                let b = p.buffer(buf);
                let count = b.shape.iter().product::<usize>();
                let ptr = at(buf) as *mut c_void;
                // SAFETY: the buffer lies in the workspace; in place is allowed.
                unsafe { nccl::all_reduce(ptr, ptr, count, nccl_type(b.dtype)?, nccl_sys::ncclRedOp_t::ncclSum, comm, stream) }
                    .map_err(|e| nccl_error(&format!("{}: all-reduce of {}", p.name, b.name), e))?;
            }
            Op::AllGather { ref pairs } => {
                // Each row's columns are gathered rank after rank: one call per row and pair, grouped.
                let ranks = plan.ranks();
                for g in pairs {
                    let (bi, bo) = (p.buffer(g.input), p.buffer(g.out));
                    if bo.shape.iter().product::<usize>() != bi.shape.iter().product::<usize>() * ranks || bo.dtype != bi.dtype {
                        return Err(RuntimeError::internal(format!("{}: all-gather of {} into {} does not match {ranks} ranks", p.name, bi.name, bo.name)));
                    }
                }
                nccl::group_start().map_err(|e| nccl_error("ncclGroupStart", e))?;
                for g in pairs {
                    let bi = p.buffer(g.input);
                    let w = bi.shape.last().copied().unwrap_or(1);
                    let rows = bi.shape.iter().product::<usize>() / w.max(1);
                    let es = bi.dtype.size();
                    for row in 0..rows {
                        let send = (at(g.input) + (row * w * es) as u64) as *const c_void;
                        let recv = (at(g.out) + (row * w * ranks * es) as u64) as *mut c_void;
                        // SAFETY: both rows lie inside their workspace buffers.
                        let r = unsafe { nccl::all_gather(send, recv, w, nccl_type(bi.dtype)?, comm, stream) };
                        if let Err(e) = r {
                            let _ = nccl::group_end();
                            return Err(nccl_error(&format!("{}: all-gather of {}", p.name, bi.name), e));
                        }
                    }
                }
                nccl::group_end().map_err(|e| nccl_error("ncclGroupEnd", e))?;
            }
            _ => return Err(RuntimeError::internal("not a collective")),
        }
        Ok(())
    }

    fn arg(&self, plan: &Plan, p: &Program, a: &LaunchArg) -> Result<u64, RuntimeError> {
        Ok(match *a {
            LaunchArg::Buffer(b) => self.workspace.ptr + p.buffer(b).offset,
            LaunchArg::Weight(w) => self.arena.ptr + plan.weight(w).offset,
            LaunchArg::KvCache { layer } => {
                if layer as usize >= plan.memory.kv.layers {
                    return Err(RuntimeError::internal(format!("{}: KV layer {layer} of {}", p.name, plan.memory.kv.layers)));
                }
                self.kv.ptr + layer as u64 * plan.memory.kv.layer_bytes()
            }
            LaunchArg::RopeTable => self.rope.ptr,
            LaunchArg::P2pRegion => self.p2p_region.as_ref().ok_or_else(|| RuntimeError::internal(format!("{}: a P2P launch on a rank without a region", p.name)))?.ptr,
            LaunchArg::SplitKRegion | LaunchArg::SplitKRegionUpper => {
                let region = self.split_k.as_ref().ok_or_else(|| RuntimeError::internal(format!("{}: a split-K launch on a rank without the region", p.name)))?;
                region.ptr + if *a == LaunchArg::SplitKRegionUpper { SplitKLayout::UPPER } else { 0 }
            }
            LaunchArg::U32(v) => v as u64,
            LaunchArg::F32(v) => v.to_bits() as u64,
            LaunchArg::PerRank(v) => LaunchArg::per_rank(v, self.rank).ok_or_else(|| RuntimeError::internal(format!("rank {} x {v} overflows a u32", self.rank)))? as u64,
        })
    }

    /// Launches one kernel of a step on the stream.
    pub fn launch(&self, plan: &Plan, p: &Program, l: &Launch) -> Result<(), RuntimeError> {
        let k = plan.kernel(l.kernel);
        let (f, params) = *self.functions.get(l.kernel.0 as usize).ok_or_else(|| RuntimeError::internal(format!("kernel {} is not loaded", k.name)))?;
        if l.args.len() != params {
            return Err(RuntimeError::internal(format!("{}: kernel {} takes {params} parameters, the launch passes {}", p.name, k.name, l.args.len())));
        }
        // 8-byte slots: the driver reads each parameter's size (4 for .u32/.f32) from the
        // front of its slot, which holds the value little-endian.
        let mut values: Vec<u64> = l.args.iter().map(|a| self.arg(plan, p, a)).collect::<Result<_, _>>()?;
        let mut ptrs: Vec<*mut c_void> = values.iter_mut().map(|v| v as *mut u64 as *mut c_void).collect();
        let (g, b) = (l.grid, l.block);
        // SAFETY: the arguments match the entry's parameters; every address lies in this
        // GPU's planned allocations.
        cu(|| format!("{}: launching {}", p.name, k.name), unsafe { result::launch_kernel(f, (g[0], g[1], g[2]), (b[0], b[1], b[2]), l.smem_dynamic, self.stream.0, &mut ptrs) })
    }

    /// Captures every program as one graph (thread-local capture: NCCL's multi-thread mode).
    /// Returns how long capture, instantiation and upload took.
    pub fn capture_programs(&mut self, plan: &Plan) -> Result<Duration, RuntimeError> {
        let start = Instant::now();
        for p in &plan.programs {
            // SAFETY: a live stream of this context.
            cu(|| format!("{}: cuStreamBeginCapture", p.name), unsafe { result::stream::begin_capture(self.stream.0, sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL) })?;
            let recorded = self.record(plan, p);
            // SAFETY: ends the capture begun above (also after an error, to leave the stream usable).
            let graph = unsafe { result::stream::end_capture(self.stream.0) };
            recorded?;
            let graph = cu(|| format!("{}: cuStreamEndCapture", p.name), graph)?;
            if graph.is_null() {
                return Err(gpu_error(format!("{}: the capture was invalidated", p.name)));
            }
            // SAFETY: a captured graph.
            let exec = match unsafe { result::graph::instantiate(graph, sys::CUgraphInstantiate_flags(0)) } {
                Ok(e) => e,
                Err(e) => {
                    // SAFETY: not instantiated; destroyed once.
                    let _ = unsafe { result::graph::destroy(graph) };
                    return Err(gpu_error(format!("{}: cuGraphInstantiate: {}", p.name, super::hardware::describe(&e))));
                }
            };
            let g = Graph { graph, exec };
            // SAFETY: an instantiated graph on this context's stream.
            cu(|| format!("{}: cuGraphUpload", p.name), unsafe { result::graph::upload(g.exec, self.stream.0) })?;
            self.graphs.push(g);
        }
        self.stream.sync()?;
        Ok(start.elapsed())
    }

    fn record(&self, plan: &Plan, p: &Program) -> Result<(), RuntimeError> {
        for step in &p.steps {
            match step.op {
                // the P2P kernel, then the add and norm launches only where it left them to them
                _ if self.uses_p2p(plan, step) => std::iter::once(&step.launches[0]).chain(step.after_p2p(plan)).try_for_each(|l| self.launch(plan, p, l))?,
                Op::AllReduce { .. } | Op::AllGather { .. } => {
                    self.collective(plan, p, &step.op)?;
                    step.after_collective(plan).iter().try_for_each(|l| self.launch(plan, p, l))?
                }
                _ => step.launches.iter().try_for_each(|l| self.launch(plan, p, l))?,
            }
        }
        Ok(())
    }

    /// Writes `inputs` (workspace offset, bytes) through pinned memory, replays program
    /// `index` and, on the rank that reads them (`read`), returns the logits' bytes and the
    /// `hidden_out` rows' (empty without them).
    pub fn replay(&mut self, plan: &Plan, index: usize, inputs: &[(u64, Vec<u8>)], read: bool) -> Result<Option<(Vec<u8>, Vec<u8>)>, RuntimeError> {
        let p = &plan.programs[index];
        let graph = self.graphs.get(index).ok_or_else(|| RuntimeError::internal(format!("program {} has no graph", p.name)))?;
        let stage = self.inputs_stage.as_mut_slice();
        let mut pos = 0;
        for (offset, bytes) in inputs {
            let dst = stage.get_mut(pos..pos + bytes.len()).ok_or_else(|| RuntimeError::internal("the inputs outgrow their staging buffer"))?;
            dst.copy_from_slice(bytes);
            // SAFETY: pinned source, the destination is the input's workspace buffer.
            cu(|| format!("{}: copying the inputs", p.name), unsafe { result::memcpy_htod_async(self.workspace.ptr + offset, &*dst, self.stream.0) })?;
            pos += bytes.len();
        }
        // SAFETY: a graph of this context.
        cu(|| format!("{}: cuGraphLaunch", p.name), unsafe { result::graph::launch(graph.exec, self.stream.0) })?;
        // the logits, then the hidden rows, back to back in the readback buffer
        let reads: Vec<(u64, usize)> = std::iter::once(p.logits).chain(p.hidden_out).map(|b| (p.buffer(b).offset, p.buffer(b).bytes as usize)).collect();
        let total: usize = reads.iter().map(|r| r.1).sum();
        if read {
            let mut at = 0;
            for &(offset, n) in &reads {
                let dst = self.readback.as_mut_slice().get_mut(at..at + n).ok_or_else(|| RuntimeError::internal("the outputs outgrow their readback buffer"))?;
                // SAFETY: pinned destination; the buffer lies in the workspace.
                cu(|| format!("{}: reading the outputs", p.name), unsafe { result::memcpy_dtoh_async(dst, self.workspace.ptr + offset, self.stream.0) })?;
                at += n;
            }
        }
        self.stream.sync().map_err(|e| gpu_error(format!("{} on GPU {}: {e}", p.name, self.rank)))?;
        Ok(read.then(|| {
            let (logits, hidden) = self.readback.as_slice()[..total].split_at(reads[0].1);
            (logits.to_vec(), hidden.to_vec())
        }))
    }
}

impl Drop for RankDevice {
    fn drop(&mut self) {
        let _ = self.ctx.bind();
        let _ = self.stream.sync();
        self.graphs.clear();
        if let Some(c) = self.comm.take() {
            // SAFETY: created by init_comm, destroyed once.
            let _ = unsafe { nccl::comm_destroy(c) };
        }
        // The remaining fields drop in declaration order: modules, staging, memory, the
        // stream, then the context.
    }
}

/// Double-buffered pinned staging for the weight upload.
struct Stager {
    stages: [Pinned; 2],
    events: [Event; 2],
    in_flight: [bool; 2],
    current: usize,
    used: usize,
    /// (arena offset, stage position, bytes) waiting in the current stage.
    pending: Vec<(u64, usize, usize)>,
    arena: u64,
    stream: sys::CUstream,
}

impl Stager {
    fn reserve(&mut self, n: usize) -> Result<&mut [u8], RuntimeError> {
        let at = self.used;
        self.stages[self.current].as_mut_slice().get_mut(at..at + n).ok_or_else(|| RuntimeError::internal("a staging reservation overflows its stage"))
    }

    fn commit(&mut self, arena_offset: u64, n: usize) {
        self.pending.push((arena_offset, self.used, n));
        self.used += n;
    }

    /// Copies the current stage's pieces and switches to the other stage (waiting until its
    /// previous copies are done).
    fn flush(&mut self) -> Result<(), RuntimeError> {
        if self.pending.is_empty() {
            return Ok(());
        }
        let c = self.current;
        for &(off, pos, n) in &self.pending {
            let src = &self.stages[c].as_slice()[pos..pos + n];
            // SAFETY: pinned source that stays untouched until the event below completes.
            cu(|| "uploading weights".into(), unsafe { result::memcpy_htod_async(self.arena + off, src, self.stream) })?;
        }
        // SAFETY: event and stream of this context.
        cu(|| "cuEventRecord".into(), unsafe { result::event::record(self.events[c].0, self.stream) })?;
        self.in_flight[c] = true;
        self.pending.clear();
        self.used = 0;
        self.current = 1 - c;
        if self.in_flight[self.current] {
            // SAFETY: recorded above on an earlier flush.
            cu(|| "cuEventSynchronize".into(), unsafe { result::event::synchronize(self.events[self.current].0) })?;
            self.in_flight[self.current] = false;
        }
        Ok(())
    }
}

/// Bytes of a program's input buffers (ids, positions, token rows, slots, page table, logit rows).
fn inputs_bytes(p: &Program) -> u64 {
    let i = p.inputs;
    [i.ids, i.positions, i.token_seq, i.slots, i.page_table, i.logit_rows].into_iter().chain(p.hidden_in).map(|b| p.buffer(b).bytes).sum()
}

/// What a replay reads back: the logits and, in plans with a draft model, the hidden rows.
fn readback_bytes(p: &Program) -> u64 {
    std::iter::once(p.logits).chain(p.hidden_out).map(|b| p.buffer(b).bytes).sum()
}

/// Loads one kernel into the current context: the artifact's cubin when there is one, else
/// the PTX through the driver's JIT (returned `true`; the caller warns). For a cubin, the
/// registers and local memory the driver reports must be what ptxas recorded in the plan.
/// Launches with more than 48 KiB of dynamic shared memory need the function to opt in first:
/// `max_dynamic_smem` is the largest any of its launches uses.
pub fn load_kernel(k: &KernelInfo, kernels_dir: Option<&Path>, max_dynamic_smem: u32) -> Result<(Module, sys::CUfunction, bool), RuntimeError> {
    let cubin = kernels_dir.map(|d| d.join(format!("{}.cubin", k.name))).filter(|p| p.is_file());
    let module = match &cubin {
        Some(path) => {
            let c = CString::new(path.to_string_lossy().into_owned()).map_err(|_| gpu_error(format!("{}: a NUL in the path", path.display())))?;
            cu(|| format!("loading {}", path.display()), result::module::load(c))?
        }
        None => {
            let text = CString::new(k.ptx.clone()).map_err(|_| RuntimeError::internal(format!("kernel {} has a NUL in its PTX", k.name)))?;
            // SAFETY: NUL-terminated PTX text.
            cu(|| format!("JIT-compiling the PTX of kernel {}", k.name), unsafe { result::module::load_data(text.as_ptr() as *const c_void) })?
        }
    };
    let module = Module(module);
    let entry = CString::new(k.entry.clone()).map_err(|_| RuntimeError::internal(format!("kernel {}: NUL in the entry name", k.name)))?;
    // SAFETY: a loaded module.
    let f = cu(|| format!("kernel {}: entry {}", k.name, k.entry), unsafe { result::module::get_function(module.0, entry) })?;
    if let (Some(path), Some(r)) = (&cubin, k.resources) {
        // SAFETY: a loaded function.
        let attr = |a| cu(|| format!("kernel {}: cuFuncGetAttribute", k.name), unsafe { result::function::get_function_attribute(f, a) });
        let regs = attr(sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_NUM_REGS)?;
        let local = attr(sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES)?;
        if regs != r.registers as i32 || local != r.stack_bytes as i32 {
            return Err(gpu_error(format!(
                "{}: the driver reports {regs} registers and {local} B of local memory per thread, ptxas recorded {} and {} B when the plan was compiled; the artifact's cubins do not match its plan (recompile it)",
                path.display(),
                r.registers,
                r.stack_bytes
            )));
        }
    }
    if max_dynamic_smem > 0 {
        // SAFETY: a loaded function.
        cu(
            || format!("kernel {}: allowing {max_dynamic_smem} B of dynamic shared memory", k.name),
            unsafe { result::function::set_function_attribute(f, sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, max_dynamic_smem as i32) },
        )?;
    }
    Ok((module, f, cubin.is_none()))
}
