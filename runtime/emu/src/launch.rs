//! Grid launch: parameter marshalling, launch-configuration checks, blocks in parallel (rayon).

use super::block::run_block;
use super::memory::GlobalMemory;
use super::parser::Module;
use super::special::Geometry;
use super::warp::{Counters, LaunchCtx, NcWords};
use super::EmuError;
use rayon::prelude::*;
use std::time::{Duration, Instant};

/// Largest dynamic + static shared memory per block on SM120 (opt-in carve-out).
pub const MAX_SHARED_PER_BLOCK: u32 = 101_376;
pub const MAX_THREADS_PER_BLOCK: u32 = 1024;

/// A kernel argument, matched against the entry's `.param` list by size.
#[derive(Clone, Debug, PartialEq)]
pub enum KernelArg {
    U32(u32),
    S32(i32),
    U64(u64),
    S64(i64),
    F32(f32),
    F64(f64),
    /// Raw bytes for `.param .align N .b8 name[SIZE]` aggregates.
    Bytes(Vec<u8>),
}

impl KernelArg {
    fn bytes(&self) -> Vec<u8> {
        match self {
            KernelArg::U32(v) => v.to_le_bytes().to_vec(),
            KernelArg::S32(v) => v.to_le_bytes().to_vec(),
            KernelArg::U64(v) => v.to_le_bytes().to_vec(),
            KernelArg::S64(v) => v.to_le_bytes().to_vec(),
            KernelArg::F32(v) => v.to_le_bytes().to_vec(),
            KernelArg::F64(v) => v.to_le_bytes().to_vec(),
            KernelArg::Bytes(b) => b.clone(),
        }
    }

    fn describe(&self) -> String {
        match self {
            KernelArg::U32(v) => format!("u32 {v}"),
            KernelArg::S32(v) => format!("s32 {v}"),
            KernelArg::U64(v) => format!("u64 {v:#x}"),
            KernelArg::S64(v) => format!("s64 {v}"),
            KernelArg::F32(v) => format!("f32 {v}"),
            KernelArg::F64(v) => format!("f64 {v}"),
            KernelArg::Bytes(b) => format!("{} raw bytes", b.len()),
        }
    }
}

/// What one launch did.
#[derive(Clone, Debug)]
pub struct LaunchStats {
    pub blocks: u64,
    pub threads_per_block: u32,
    pub counters: Counters,
    pub elapsed: Duration,
}

impl LaunchStats {
    pub fn global_bytes_read(&self) -> u64 {
        self.counters.global_bytes_read
    }

    pub fn global_bytes_written(&self) -> u64 {
        self.counters.global_bytes_written
    }

    /// Emulated thread instructions per second of wall time.
    pub fn thread_instructions_per_second(&self) -> f64 {
        self.counters.thread_instructions as f64 / self.elapsed.as_secs_f64().max(1e-9)
    }
}

/// Runs kernel `entry` of `module` on the CPU.
///
/// `smem_bytes` is the dynamic shared memory of the launch (for `.extern .shared` arrays).
/// Pointers to `global` buffers are passed as `KernelArg::U64(global.addr(id))`.
pub fn launch(module: &Module, entry: &str, grid: [u32; 3], block: [u32; 3], smem_bytes: u32, args: &[KernelArg], global: &GlobalMemory) -> Result<LaunchStats, EmuError> {
    launch_with_peers(module, entry, grid, block, smem_bytes, args, global, &[])
}

/// [`launch`] on a GPU that may also address `peers`' memories (see [`launch_params_with_peers`]).
#[allow(clippy::too_many_arguments)]
pub fn launch_with_peers(module: &Module, entry: &str, grid: [u32; 3], block: [u32; 3], smem_bytes: u32, args: &[KernelArg], global: &GlobalMemory, peers: &[&GlobalMemory]) -> Result<LaunchStats, EmuError> {
    let e = module.entry(entry)?;
    let bad = |m: String| Err(EmuError::Launch(format!("launch of '{entry}': {m}")));
    if args.len() != e.params.len() {
        return bad(format!("{} argument(s) given, kernel takes {} ({})", args.len(), e.params.len(), e.params.iter().map(|p| p.name.as_str()).collect::<Vec<_>>().join(", ")));
    }
    let mut params = vec![0u8; e.param_bytes];
    for (i, (p, a)) in e.params.iter().zip(args).enumerate() {
        let b = a.bytes();
        if b.len() != p.size || (matches!(a, KernelArg::Bytes(_)) && p.ty.is_some()) {
            let ty = p.ty.map(|t| format!(".{}", t.name())).unwrap_or_else(|| "byte array".into());
            return bad(format!("argument {} ({}) does not match parameter '{}' ({ty}, {} B)", i + 1, a.describe(), p.name, p.size));
        }
        params[p.offset..p.offset + p.size].copy_from_slice(&b);
    }
    launch_params_with_peers(module, entry, grid, block, smem_bytes, &params, global, peers)
}

/// [`launch`] with the `.param` space already marshalled (`params`: the entry's `param_bytes`,
/// each parameter at its `Param::offset`), as a driver receives it.
pub fn launch_params(module: &Module, entry: &str, grid: [u32; 3], block: [u32; 3], smem_bytes: u32, params: &[u8], global: &GlobalMemory) -> Result<LaunchStats, EmuError> {
    launch_params_with_peers(module, entry, grid, block, smem_bytes, params, global, &[])
}

/// [`launch_params`] on a GPU that may also address `peers`' memories (peer access enabled).
/// A one-block grid runs on the calling thread, not the shared block pool: kernels of several
/// GPUs that wait on each other's flags then all make progress, as on separate devices.
#[allow(clippy::too_many_arguments)]
pub fn launch_params_with_peers(module: &Module, entry: &str, grid: [u32; 3], block: [u32; 3], smem_bytes: u32, params: &[u8], global: &GlobalMemory, peers: &[&GlobalMemory]) -> Result<LaunchStats, EmuError> {
    let e = module.entry(entry)?;
    let bad = |m: String| Err(EmuError::Launch(format!("launch of '{entry}': {m}")));
    if params.len() != e.param_bytes {
        return bad(format!("{} B of parameters given, the kernel's .param space is {} B", params.len(), e.param_bytes));
    }
    if grid.contains(&0) || block.contains(&0) {
        return bad(format!("grid {grid:?} and block {block:?} must be non-zero"));
    }
    if grid[0] > i32::MAX as u32 || grid[1] > 65535 || grid[2] > 65535 {
        return bad(format!("grid {grid:?} exceeds the limits (2^31-1, 65535, 65535)"));
    }
    let threads = block[0] as u64 * block[1] as u64 * block[2] as u64;
    if threads > MAX_THREADS_PER_BLOCK as u64 || block[2] > 64 {
        return bad(format!("block {block:?} has {threads} threads (max {MAX_THREADS_PER_BLOCK}, z <= 64)"));
    }
    if let Some(r) = e.reqntid {
        if r != block {
            return bad(format!("block {block:?} differs from the kernel's .reqntid {r:?}"));
        }
    }
    if let Some(m) = e.maxntid {
        if threads > m[0] as u64 * m[1] as u64 * m[2] as u64 {
            return bad(format!("block {block:?} exceeds the kernel's .maxntid {m:?}"));
        }
    }
    let smem_total = if smem_bytes > 0 { e.dynamic_shared_offset as u64 + smem_bytes as u64 } else { e.shared_static as u64 };
    if smem_total > MAX_SHARED_PER_BLOCK as u64 {
        return bad(format!("{smem_total} B of shared memory per block ({} static + {smem_bytes} dynamic) exceeds the SM120 limit of {MAX_SHARED_PER_BLOCK} B", e.shared_static));
    }
    let geo = Geometry { grid, block, smem_dynamic: smem_bytes, smem_total: smem_total as u32 };
    let lc = LaunchCtx { entry: e, global, peers, params, geo, nc_check: nc_check(), ordinal: global.count_launch() };
    let nblocks = grid[0] as u64 * grid[1] as u64 * grid[2] as u64;
    let start = Instant::now();
    let block_of = |b: u64| {
        let ctaid = [(b % grid[0] as u64) as u32, ((b / grid[0] as u64) % grid[1] as u64) as u32, (b / (grid[0] as u64 * grid[1] as u64)) as u32];
        run_block(&lc, ctaid)
    };
    let results: Vec<Result<(Counters, Option<NcWords>), EmuError>> = if nblocks == 1 { vec![block_of(0)] } else { (0..nblocks).into_par_iter().map(block_of).collect() };
    let elapsed = start.elapsed();
    let mut counters = Counters::default();
    let mut nc = NcWords::default();
    for r in results {
        match r {
            Ok((c, words)) => {
                counters.add(&c);
                if let Some(w) = words {
                    nc.overflow |= w.overflow || nc.read.len() + nc.written.len() > 4 * NcWords::CAP;
                    if !nc.overflow {
                        nc.read.extend(w.read);
                        nc.written.extend(w.written);
                    }
                }
            }
            Err(EmuError::Exec { line, entry, inst, msg, .. }) => return Err(EmuError::Exec { file: module.file.clone(), line, entry, inst, msg }),
            Err(other) => return Err(other),
        }
    }
    let stale = if nc.overflow { None } else { nc.read.iter().filter(|w| nc.written.contains(w)).min() };
    if let Some(&word) = stale {
        let addr = word << 2;
        let at = match lc.memory(addr).buffer_at(addr) {
            Some((b, off)) => format!("buffer '{}' + {off}", lc.memory(addr).name(b)),
            None => format!("{addr:#x}"),
        };
        return bad(format!("it reads {at} with ld.global.nc and also writes it: .nc data must stay unchanged for the whole kernel (a GPU may serve the load from a non-coherent cache)"));
    }
    Ok(LaunchStats { blocks: nblocks, threads_per_block: threads as u32, counters, elapsed })
}

/// Whether launches check `.nc` reads against the launch's writes: on unless
/// `KILN_EMU_NC_CHECK=0` (it records the words each block touches, up to `NcWords::CAP`).
fn nc_check() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("KILN_EMU_NC_CHECK").map_or(true, |v| v != "0"))
}
