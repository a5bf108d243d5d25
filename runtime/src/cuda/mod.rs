//! The CUDA backend: the plan's programs as CUDA graphs on real GPUs (or on the driver double,
//! `scripts/with-cuda-double.sh`), through cudarc's driver and NCCL bindings. Behind
//! `--backend cuda` of `kiln logits`, `run`, `serve` and `verify`.
//!
//! One worker thread per GPU owns everything of that GPU for its whole life (context, stream,
//! memory, modules, communicator, graphs): graphs and communicators must not be shared between
//! threads, and NCCL captured in several threads of one process needs thread-local capture,
//! which is what the workers use. Start-up, in order: the hardware check (before anything is
//! allocated), the planned allocations, the weight upload (all GPUs in parallel from the
//! mapped checkpoint through pinned staging), the modules, the communicator and a warm-up of
//! every collective, then one graph per program. A replay writes the program's inputs into
//! their fixed buffers, launches the graph on every rank and reads rank 0's logits back.
//!
//! A CUDA or NCCL error fails the request that hit it and the backend for good (the driver's
//! context is lost after a kernel fault): later calls fail at once with the same message, and
//! nothing waits on a rank that may never answer.

pub mod hardware;
pub mod p2p;
mod rank;
mod resources;
pub mod step;

use crate::bind::{weights_progress, CheckpointFiles};
use crate::cpu::Inputs;
use crate::error::RuntimeError;
use crate::numerics::{bytes_floats, float_bytes};
use crate::plan::{DType, Op, Plan};
use hardware::gpu_error;
use rank::RankDevice;
use std::path::{Path, PathBuf};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// What start-up measured.
#[derive(Debug, Clone, Default)]
pub struct LoadReport {
    pub weight_bytes: u64,
    pub upload: Duration,
    /// Loading every kernel module (cubins) on a GPU, the slowest GPU's.
    pub module_load: Duration,
    /// Joining the NCCL communicator.
    pub nccl_init: Duration,
    pub graphs: usize,
    pub graph_build: Duration,
    /// Per GPU: (bytes allocated for the plan, bytes the driver has left).
    pub memory: Vec<(u64, u64)>,
    /// Kernels loaded from PTX through the JIT because the artifact had no cubin.
    pub jit_kernels: usize,
    /// Whether small all-reduces and all-gathers replay the one-shot P2P kernel (else NCCL), and why.
    pub p2p: bool,
    pub p2p_reason: String,
}

impl LoadReport {
    pub fn upload_gbps(&self) -> f64 {
        self.weight_bytes as f64 / self.upload.as_secs_f64().max(1e-9) / 1e9
    }
}

enum Command {
    P2p { contexts: Arc<Vec<u64>>, regions: Arc<Vec<u64>> },
    Comm(cudarc::nccl::sys::ncclUniqueId),
    Capture,
    Run { index: usize, inputs: Arc<Vec<(u64, Vec<u8>)>>, read_outputs: bool },
}

enum Reply {
    Opened { allocated: u64, free_after: u64, context: u64, p2p_region: Option<u64>, upload: Duration, modules: Duration, bytes: u64, jit: Vec<String> },
    Ready,
    Captured(Duration),
    /// Rank 0's logits and hidden rows (empty without `hidden_out`).
    Ran(Option<(Vec<u8>, Vec<u8>)>),
    Failed(String),
}

struct Worker {
    tx: Sender<Command>,
    thread: Option<std::thread::JoinHandle<()>>,
}

pub struct CudaBackend {
    plan: Arc<Plan>,
    workers: Vec<Worker>,
    replies: Receiver<(usize, Reply)>,
    logits: Vec<f32>,
    /// The last replay's `hidden_out` rows (plans with a draft model), rank 0's.
    hidden: Vec<f32>,
    /// Set by the first failure: the backend cannot run anything after it.
    dead: Option<String>,
    pub report: LoadReport,
}

/// What a GPU's worker loads: the checkpoint's weights through pinned staging of these flags, and
/// the artifact's cubins (none: PTX through the driver's JIT).
struct Sources {
    files: Arc<CheckpointFiles>,
    staging_flags: u32,
    kernels: Option<PathBuf>,
}

/// Body of one GPU's worker thread.
fn worker(rank: usize, plan: Arc<Plan>, sources: Sources, bar: indicatif::ProgressBar, rx: Receiver<Command>, tx: Sender<(usize, Reply)>) {
    let Sources { files, staging_flags, kernels } = sources;
    let fail = |e: RuntimeError| {
        let _ = tx.send((rank, Reply::Failed(e.to_string())));
    };
    let opened = (|| {
        let (mut dev, opened) = RankDevice::open(rank, &plan)?;
        let t = Instant::now();
        let bytes = dev.upload_weights(&plan, &files, staging_flags, &bar)?;
        let upload = t.elapsed();
        let t = Instant::now();
        let jit = dev.load_kernels(&plan, kernels.as_deref())?;
        let modules = t.elapsed();
        Ok::<_, RuntimeError>((dev, Reply::Opened { allocated: opened.allocated, free_after: opened.free_after, context: opened.context, p2p_region: opened.p2p_region, upload, modules, bytes, jit }))
    })();
    let mut dev = match opened {
        Ok((dev, reply)) => {
            let _ = tx.send((rank, reply));
            dev
        }
        Err(e) => return fail(e),
    };
    drop(files);
    while let Ok(cmd) = rx.recv() {
        let reply = match cmd {
            Command::P2p { contexts, regions } => dev.enable_p2p(&contexts, &regions).map(|()| Reply::Ready),
            Command::Comm(id) => dev.init_comm(id, plan.ranks()).and_then(|()| dev.warm_up_collectives(&plan)).map(|()| Reply::Ready),
            Command::Capture => dev.capture_programs(&plan).map(Reply::Captured),
            Command::Run { index, inputs, read_outputs } => dev.replay(&plan, index, &inputs, read_outputs).map(Reply::Ran),
        };
        match reply {
            Ok(r) => {
                let _ = tx.send((rank, r));
            }
            Err(e) => return fail(e),
        }
    }
}

/// Whether small all-reduces may use the P2P kernel: `KILN_P2P=off` says no; otherwise every
/// ordered GPU pair must pass the write-and-verify probe of `kiln doctor` (the capability bit
/// alone lies on some hosts, and a kernel waiting for writes that never land would hang).
fn p2p_choice(ranks: usize) -> Result<(bool, String), RuntimeError> {
    match std::env::var("KILN_P2P").as_deref() {
        Ok("off") => return Ok((false, "KILN_P2P=off".into())),
        Ok("auto") | Err(_) => {}
        Ok(other) => return Err(RuntimeError::Unsupported { message: format!("KILN_P2P={other:?}: expected `auto` (the default: the P2P all-reduce where every GPU pair passes the peer probe) or `off` (NCCL only)") }),
    }
    // a probe that cannot run (e.g. no memory left for its buffers) leaves NCCL, not a failure
    let probes = match p2p::probe(ranks) {
        Ok(p) => p,
        Err(e) => return Ok((false, format!("the peer probe could not run: {e}"))),
    };
    match probes.iter().find(|p| p.result != p2p::PeerResult::Ok) {
        None => Ok((true, format!("all {} GPU pairs passed the peer write-and-verify probe", probes.len()))),
        Some(p) => Ok((false, format!("GPU {} -> GPU {}: {:?} in the peer probe (`kiln doctor` shows every pair)", p.from, p.to, p.result))),
    }
}

fn human(b: u64) -> String {
    let f = b as f64;
    if b >= 1 << 30 {
        format!("{:.2} GiB", f / (1u64 << 30) as f64)
    } else if b >= 1 << 20 {
        format!("{:.2} MiB", f / (1u64 << 20) as f64)
    } else {
        format!("{:.1} KiB", f / 1024.0)
    }
}

impl CudaBackend {
    /// Checks the machine, then loads the plan onto its GPUs: `weights` is the checkpoint
    /// directory, `artifact` (when known) holds the cubins in `kernels/`.
    pub fn new(plan: Plan, artifact: Option<&Path>, weights: &Path, progress: bool) -> Result<CudaBackend, RuntimeError> {
        if plan.kernels.is_empty() {
            return Err(RuntimeError::Unsupported {
                message: format!("the plan was compiled for {} and has no kernels; the CUDA backend needs a GPU target (--target sm_120a or sm_90a)", plan.target.name),
            });
        }
        let started = Instant::now();
        let machine = hardware::check(&plan)?;
        // a bad KILN_UPLOAD_STAGING is the user's setting, refused before any GPU work
        let (staging_flags, staging) = resources::upload_staging()?;
        if plan.ranks() > 1 {
            hardware::require_nccl()?;
        }
        let files = CheckpointFiles::open(weights)?;
        files.check(&plan)?;
        let plan = Arc::new(plan);
        let files = Arc::new(files);
        let ranks = plan.ranks();
        let bar = weights_progress(&plan, progress, "uploading weights {bar:40} {bytes}/{total_bytes} {binary_bytes_per_sec} {msg}");
        let kernels = artifact.map(|a| a.join("kernels"));
        let (reply_tx, replies) = channel();
        let mut workers = Vec::with_capacity(ranks);
        for rank in 0..ranks {
            let (tx, rx) = channel();
            let (plan, files, kernels, bar, reply_tx) = (plan.clone(), files.clone(), kernels.clone(), bar.clone(), reply_tx.clone());
            let thread = std::thread::Builder::new()
                .name(format!("kiln-gpu{rank}"))
                .spawn(move || {
                    // A panic must still answer, or the main thread would wait for this rank forever.
                    let answer = reply_tx.clone();
                    let sources = Sources { files, staging_flags, kernels };
                    let run = std::panic::AssertUnwindSafe(|| worker(rank, plan, sources, bar, rx, reply_tx));
                    if std::panic::catch_unwind(run).is_err() {
                        let _ = answer.send((rank, Reply::Failed("the GPU worker panicked (a kiln bug)".into())));
                    }
                })
                .map_err(|e| RuntimeError::internal(format!("cannot start the worker of GPU {rank}: {e}")))?;
            workers.push(Worker { tx, thread: Some(thread) });
        }
        drop(reply_tx);
        drop(files);
        let mut backend = CudaBackend { plan, workers, replies, logits: Vec::new(), hidden: Vec::new(), dead: None, report: LoadReport::default() };
        let mut jit = Vec::new();
        backend.report.memory = vec![(0, 0); ranks];
        let (mut contexts, mut regions) = (vec![0u64; ranks], vec![None; ranks]);
        for (rank, reply) in backend.gather("loading the plan")? {
            if let Reply::Opened { allocated, free_after, context, p2p_region, upload, modules, bytes, jit: j } = reply {
                contexts[rank] = context;
                regions[rank] = p2p_region;
                backend.report.memory[rank] = (allocated, free_after);
                backend.report.weight_bytes += bytes;
                backend.report.upload = backend.report.upload.max(upload);
                backend.report.module_load = backend.report.module_load.max(modules);
                if rank == 0 {
                    jit = j;
                }
            }
        }
        bar.finish_and_clear();
        let r = &mut backend.report;
        r.jit_kernels = jit.len();
        eprintln!(
            "kiln cuda: {} GPU(s) ({}), driver CUDA {}.{}; weights uploaded: {} in {:.2} s ({:.2} GB/s, {} staging)",
            ranks,
            machine.gpus.first().map(|g| g.name.as_str()).unwrap_or("?"),
            machine.driver_version / 1000,
            machine.driver_version % 1000 / 10,
            human(r.weight_bytes),
            r.upload.as_secs_f64(),
            r.upload_gbps(),
            staging
        );
        for (rank, (allocated, free)) in r.memory.iter().enumerate() {
            let note = if *free < backend.plan.memory.headroom { " — less than the plan's headroom: NCCL and graphs may run out of memory" } else { "" };
            eprintln!("kiln cuda: GPU {rank}: {} allocated as planned, {} left by the driver (plan headroom {}){note}", human(*allocated), human(*free), human(backend.plan.memory.headroom));
        }
        if !jit.is_empty() {
            eprintln!(
                "kiln cuda: warning: {} kernel(s) have no cubin in the artifact and were JIT-compiled from PTX by the driver (e.g. {}); compile with ptxas available to ship cubins",
                jit.len(),
                jit[0]
            );
        }
        let opened = started.elapsed();
        if rank::plan_has_p2p(&backend.plan) {
            let (on, reason) = p2p_choice(ranks)?;
            backend.report.p2p_reason = reason;
            if on {
                let regions: Option<Vec<u64>> = regions.into_iter().collect();
                let regions = Arc::new(regions.ok_or_else(|| RuntimeError::internal("a rank has no P2P region"))?);
                let contexts = Arc::new(contexts);
                backend.broadcast(|| Command::P2p { contexts: contexts.clone(), regions: regions.clone() })?;
                backend.gather("enabling the P2P collectives")?;
                backend.report.p2p = true;
            }
            let how = if backend.report.p2p { "the P2P kernel" } else { "NCCL" };
            let kib = crate::plan::P2P_MAX_BYTES >> 10;
            eprintln!("kiln cuda: all-reduces up to {} KiB (two-shot above {kib} KiB) and all-gathers up to {kib} KiB per GPU: {how} ({})", ranks as u64 * kib, backend.report.p2p_reason);
            // the gathers of projections split for the P2P path (all but the logits' and a
            // sequence-parallel indexer's lists, which save more than NCCL costs)
            let split_gathers = |p: &crate::plan::Program| {
                let lists: Vec<_> = p.steps.iter().filter_map(|s| if let Op::IndexerTopK { across_ranks: true, out, .. } = s.op { Some(out) } else { None }).collect();
                p.steps.iter().filter(|s| matches!(&s.op, Op::AllGather { pairs } if pairs.iter().all(|g| g.out != p.logits && !lists.contains(&g.input)))).count()
            };
            let gathers = backend.plan.programs.iter().map(split_gathers).max().unwrap_or(0);
            if !backend.report.p2p && gathers > 0 {
                eprintln!(
                    "kiln cuda: warning: the plan splits replicated projections behind {gathers} all-gathers per step, chosen for the P2P kernel; on NCCL each costs more than it saves: recompile with --split-projections none"
                );
            }
        }
        if ranks > 1 {
            let t = Instant::now();
            let id = cudarc::nccl::result::get_uniqueid().map_err(|e| gpu_error(format!("ncclGetUniqueId: NCCL {:?}", e.0)))?;
            backend.broadcast(|| Command::Comm(id))?;
            backend.gather("joining the NCCL communicator")?;
            backend.report.nccl_init = t.elapsed();
        }
        backend.broadcast(|| Command::Capture)?;
        let captured = backend.gather("capturing the programs as CUDA graphs")?;
        backend.report.graph_build = captured.iter().filter_map(|(_, r)| if let Reply::Captured(d) = r { Some(*d) } else { None }).max().unwrap_or_default();
        backend.report.graphs = backend.plan.programs.len() * ranks;
        let r = &backend.report;
        eprintln!(
            "kiln cuda: {} CUDA graphs ({} programs x {ranks} ranks) built in {:.2} s",
            r.graphs,
            backend.plan.programs.len(),
            r.graph_build.as_secs_f64()
        );
        eprintln!(
            "kiln cuda: start-up {:.2} s = machine check, header check, contexts, memory and weight upload {:.2} s (upload {:.2} s at {:.2} GB/s) + module load {:.2} s + NCCL {:.2} s + graph build {:.2} s",
            started.elapsed().as_secs_f64(),
            opened.saturating_sub(r.module_load).as_secs_f64(),
            r.upload.as_secs_f64(),
            r.upload_gbps(),
            r.module_load.as_secs_f64(),
            r.nccl_init.as_secs_f64(),
            r.graph_build.as_secs_f64()
        );
        Ok(backend)
    }

    pub fn plan(&self) -> &Plan {
        &self.plan
    }

    /// The failure that stopped the backend, if one did.
    pub fn failure(&self) -> Option<&str> {
        self.dead.as_deref()
    }

    fn broadcast(&mut self, cmd: impl Fn() -> Command) -> Result<(), RuntimeError> {
        for (rank, w) in self.workers.iter().enumerate() {
            if w.tx.send(cmd()).is_err() {
                return Err(self.die(format!("the worker of GPU {rank} has stopped")));
            }
        }
        Ok(())
    }

    /// One reply from every worker; the first failure kills the backend (and is returned at
    /// once: the other ranks may be blocked in a collective the failed rank never joins).
    fn gather(&mut self, doing: &str) -> Result<Vec<(usize, Reply)>, RuntimeError> {
        let mut got = Vec::with_capacity(self.workers.len());
        while got.len() < self.workers.len() {
            match self.replies.recv() {
                Ok((rank, Reply::Failed(m))) => return Err(self.die(format!("{doing}: GPU {rank}: {m}"))),
                Ok(r) => got.push(r),
                Err(_) => return Err(self.die(format!("{doing}: a GPU worker stopped without an answer"))),
            }
        }
        Ok(got)
    }

    fn die(&mut self, message: String) -> RuntimeError {
        let m = self.dead.get_or_insert(message).clone();
        gpu_error(format!("{m}; the CUDA backend has stopped (restart kiln; `kiln verify --backend cuda` runs the plan step by step to find a faulting kernel)"))
    }

    /// Replays program `index` with `inputs`; returns its logits `[logit_rows, vocab]`.
    pub fn run(&mut self, index: usize, inputs: &Inputs) -> Result<&[f32], RuntimeError> {
        if let Some(m) = &self.dead {
            return Err(gpu_error(format!("the CUDA backend stopped earlier: {m}")));
        }
        let plan = self.plan.clone();
        let program = plan.programs.get(index).ok_or_else(|| RuntimeError::internal(format!("program {index} of {}", plan.programs.len())))?;
        crate::cpu::check_inputs(&plan, program, inputs)?;
        let mut bytes: Vec<(u64, Vec<u8>)> = inputs.by_buffer(program).iter().map(|(_, b, v)| (program.buffer(*b).offset, v.iter().flat_map(|x| x.to_le_bytes()).collect())).collect();
        // a draft program's hidden rows, rounded to the buffer's dtype as the CPU backend does
        // (through the host: at decode a few rows of hidden_size values)
        bytes.extend(program.hidden_in.map(|b| (program.buffer(b).offset, float_bytes(&inputs.hidden, program.buffer(b).dtype == DType::BF16))));
        let bytes = Arc::new(bytes);
        for (rank, w) in self.workers.iter().enumerate() {
            if w.tx.send(Command::Run { index, inputs: bytes.clone(), read_outputs: rank == 0 }).is_err() {
                return Err(self.die(format!("the worker of GPU {rank} has stopped")));
            }
        }
        let replies = self.gather(&format!("running {}", program.name))?;
        let raw = replies.into_iter().find_map(|(rank, r)| match r {
            Reply::Ran(Some(b)) if rank == 0 => Some(b),
            _ => None,
        });
        let (logits, hidden) = raw.ok_or_else(|| RuntimeError::internal("rank 0 returned no logits"))?;
        self.logits = bytes_floats(&logits, program.buffer(program.logits).dtype == DType::BF16);
        self.hidden = program.hidden_out.map(|b| bytes_floats(&hidden, program.buffer(b).dtype == DType::BF16)).unwrap_or_default();
        Ok(&self.logits)
    }

    /// The `[tokens, hidden]` rows of the final normed hidden state the last replay left, in
    /// plans with a draft model ([`crate::plan::Program::hidden_out`]).
    pub fn hidden_out(&self) -> Option<&[f32]> {
        (!self.hidden.is_empty()).then_some(&self.hidden[..])
    }
}

impl Drop for CudaBackend {
    fn drop(&mut self) {
        let workers = std::mem::take(&mut self.workers);
        let threads: Vec<_> = workers.into_iter().filter_map(|mut w| w.thread.take()).collect();
        // Closing the channels stops the workers; after a failure some may be blocked for
        // good (a collective a dead rank never joins), so they are left to the process exit.
        if self.dead.is_none() {
            for t in threads {
                let _ = t.join();
            }
        }
    }
}
