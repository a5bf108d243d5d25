//! The driver's state: the simulated GPUs (one lazily backed [`GlobalMemory`] each, at its own
//! address range as unified addressing gives every device), their primary contexts with sticky
//! errors, and the handle tables (streams, events, modules, functions, graphs, pinned host
//! memory). Work runs immediately on the calling thread in stream order, so a stream is only a
//! device plus, while capturing, the list of operations recorded into the graph.

use crate::config::Config;
use crate::module::{Function, LoadedModule};
use crate::nccl::Call;
use crate::status::*;
use kiln_emu::{BufferId, EmuError, GlobalMemory, GLOBAL_BASE};
use std::cell::Cell;
use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, RwLock};
use std::thread::ThreadId;
use std::time::Instant;

/// Address range of one device (1 TiB).
pub const DEVICE_SPAN: u64 = 1 << 40;
/// Context handles are `CONTEXT_TAG + ordinal` (non-null, distinct from every other handle).
pub const CONTEXT_TAG: u64 = 0xC0DE_0000_0000;
pub const CU_STREAM_LEGACY: u64 = 0x1;
pub const CU_STREAM_PER_THREAD: u64 = 0x2;

pub struct Device {
    pub ordinal: usize,
    pub memory: RwLock<GlobalMemory>,
    /// Live allocations: base address -> (buffer, bytes).
    pub allocs: Mutex<BTreeMap<u64, (BufferId, usize)>>,
    pub used: AtomicU64,
    /// The context's sticky error (0: none); set by a faulting kernel, cleared only when the
    /// primary context is destroyed, as on the real driver.
    pub sticky: AtomicU32,
    pub retains: AtomicU32,
    /// Devices this context enabled peer access to.
    pub peers: Mutex<Vec<usize>>,
}

/// One operation in stream order (executed now, or recorded while the stream captures).
#[derive(Clone)]
pub enum Op {
    Launch { func: Arc<Function>, grid: [u32; 3], block: [u32; 3], smem: u32, params: Vec<u8> },
    Memset { dst: u64, byte: u8, len: usize },
    HtoD { dst: u64, src: usize, len: usize },
    DtoH { dst: usize, src: u64, len: usize },
    DtoD { dst: u64, src: u64, len: usize },
    Record { event: u64 },
    Collective(Call),
}

pub struct Capture {
    pub mode: u32,
    pub thread: ThreadId,
    pub ops: Vec<Op>,
    pub invalidated: bool,
}

pub const CAPTURE_MODE_GLOBAL: u32 = 0;
pub const CAPTURE_MODE_RELAXED: u32 = 2;

pub struct Stream {
    pub device: usize,
    pub capture: Option<Capture>,
}

pub struct Event {
    pub device: usize,
    pub timing: bool,
    pub recorded: Option<Instant>,
    /// Last recorded inside a capture (synchronizing on it is an error).
    pub captured: bool,
}

pub struct Graph {
    pub device: usize,
    pub ops: Arc<Vec<Op>>,
}

#[derive(Default)]
pub struct Objects {
    next: u64,
    pub streams: HashMap<u64, Stream>,
    pub events: HashMap<u64, Event>,
    pub modules: HashMap<u64, Arc<LoadedModule>>,
    pub functions: HashMap<u64, Arc<Function>>,
    pub graphs: HashMap<u64, Graph>,
    pub execs: HashMap<u64, Graph>,
    /// Pinned host allocations: address -> layout.
    pub host: BTreeMap<usize, std::alloc::Layout>,
}

impl Objects {
    /// A fresh handle value (never 0 and never a context handle).
    pub fn handle(&mut self) -> u64 {
        self.next += 1;
        0x5EED_0000 + self.next * 16
    }
}

pub struct Driver {
    pub config: Config,
    pub devices: Vec<Device>,
    pub objects: Mutex<Objects>,
    /// Kernels executed so far (for `KILN_DOUBLE_FAULT_AT_LAUNCH`).
    pub launches: AtomicU64,
    /// Per kernel entry: launches and emulation time (`KILN_DOUBLE_PROFILE=1`).
    pub profile: Mutex<HashMap<String, (u64, std::time::Duration)>>,
}

static DRIVER: OnceLock<Result<Driver, CuResult>> = OnceLock::new();

thread_local! {
    static CURRENT: Cell<Option<usize>> = const { Cell::new(None) };
}

/// `cuInit`: builds the machine from the environment once per process.
pub fn init() -> Result<&'static Driver, CuResult> {
    DRIVER
        .get_or_init(|| {
            let config = Config::from_env().map_err(|e| {
                eprintln!("kiln-cuda-double: {e}");
                INVALID_VALUE
            })?;
            if config.gpus == 0 {
                return Err(NO_DEVICE);
            }
            let devices = (0..config.gpus)
                .map(|ordinal| Device {
                    ordinal,
                    memory: RwLock::new(GlobalMemory::with_base(GLOBAL_BASE + ordinal as u64 * DEVICE_SPAN)),
                    allocs: Mutex::new(BTreeMap::new()),
                    used: AtomicU64::new(0),
                    sticky: AtomicU32::new(0),
                    retains: AtomicU32::new(0),
                    peers: Mutex::new(Vec::new()),
                })
                .collect();
            Ok(Driver { config, devices, objects: Mutex::new(Objects::default()), launches: AtomicU64::new(0), profile: Mutex::new(HashMap::new()) })
        })
        .as_ref()
        .map_err(|&e| e)
}

/// The driver after `cuInit`.
pub fn driver() -> Result<&'static Driver, CuResult> {
    match DRIVER.get() {
        Some(Ok(d)) => Ok(d),
        Some(Err(e)) => Err(*e),
        None => Err(NOT_INITIALIZED),
    }
}

pub fn set_current(dev: Option<usize>) {
    CURRENT.with(|c| c.set(dev));
}

pub fn current_device() -> Option<usize> {
    CURRENT.with(|c| c.get())
}

impl Driver {
    pub fn objects(&self) -> MutexGuard<'_, Objects> {
        self.objects.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn device(&self, ordinal: i32) -> Result<&Device, CuResult> {
        usize::try_from(ordinal).ok().and_then(|o| self.devices.get(o)).ok_or(INVALID_DEVICE)
    }

    /// The device whose context is current on this thread (alive).
    pub fn current(&self) -> Result<usize, CuResult> {
        let d = current_device().ok_or(INVALID_CONTEXT)?;
        if self.devices[d].retains.load(Ordering::SeqCst) == 0 {
            return Err(INVALID_CONTEXT);
        }
        Ok(d)
    }

    /// [`Driver::current`], failing with the context's sticky error if a kernel faulted.
    pub fn live(&self) -> Result<usize, CuResult> {
        let d = self.current()?;
        self.check_sticky(d)?;
        Ok(d)
    }

    pub fn check_sticky(&self, d: usize) -> Result<(), CuResult> {
        match self.devices[d].sticky.load(Ordering::SeqCst) {
            0 => Ok(()),
            e => Err(e),
        }
    }

    /// Marks the context of device `d` failed (a kernel fault); the message goes to stderr as
    /// the only trace, like a fault on a real GPU.
    pub fn fault(&self, d: usize, code: CuResult, message: &str) {
        eprintln!("kiln-cuda-double: GPU {d}: {message}");
        let _ = self.devices[d].sticky.compare_exchange(0, code, Ordering::SeqCst, Ordering::SeqCst);
    }

    pub fn device_of(&self, addr: u64) -> Option<usize> {
        let d = (addr.checked_sub(GLOBAL_BASE)? / DEVICE_SPAN) as usize;
        (d < self.devices.len()).then_some(d)
    }

    /// The allocation holding `[addr, addr + len)`: (device, buffer, offset).
    pub fn range(&self, addr: u64, len: usize) -> Result<(usize, BufferId, usize), CuResult> {
        let d = self.device_of(addr).ok_or(INVALID_VALUE)?;
        let allocs = self.devices[d].allocs.lock().unwrap_or_else(|p| p.into_inner());
        let (&base, &(id, size)) = allocs.range(..=addr).next_back().ok_or(INVALID_VALUE)?;
        let off = (addr - base) as usize;
        if off.checked_add(len).is_none_or(|end| end > size) {
            return Err(INVALID_VALUE);
        }
        Ok((d, id, off))
    }

    pub fn read(&self, addr: u64, len: usize) -> Result<Vec<u8>, CuResult> {
        let (d, id, off) = self.range(addr, len)?;
        Ok(self.devices[d].memory.read().unwrap_or_else(|p| p.into_inner()).read_at(id, off, len))
    }

    pub fn write(&self, addr: u64, data: &[u8]) -> Result<(), CuResult> {
        let (d, id, off) = self.range(addr, data.len())?;
        self.devices[d].memory.read().unwrap_or_else(|p| p.into_inner()).write(id, off, data);
        Ok(())
    }

    /// Frees everything a destroyed context owned and clears its sticky error.
    /// Prints the kernel profile (slowest first) to stderr.
    pub fn print_profile(&self) {
        let p = self.profile.lock().unwrap_or_else(|p| p.into_inner());
        let mut rows: Vec<_> = p.iter().collect();
        rows.sort_by_key(|r| std::cmp::Reverse(r.1 .1));
        let total: f64 = rows.iter().map(|r| r.1 .1.as_secs_f64()).sum();
        eprintln!("kiln-cuda-double: emulated kernel time {total:.2} s:");
        for (name, (n, t)) in rows.iter().take(15) {
            eprintln!("  {:>8.3} s {:>5.1} %  {n:>6} x  {name}", t.as_secs_f64(), 100.0 * t.as_secs_f64() / total.max(1e-9));
        }
    }

    pub fn reset(&self, d: usize) {
        let dev = &self.devices[d];
        let mut allocs = dev.allocs.lock().unwrap_or_else(|p| p.into_inner());
        let mut mem = dev.memory.write().unwrap_or_else(|p| p.into_inner());
        for (_, (id, _)) in std::mem::take(&mut *allocs) {
            mem.free(id);
        }
        dev.used.store(0, Ordering::SeqCst);
        dev.sticky.store(0, Ordering::SeqCst);
        dev.peers.lock().unwrap_or_else(|p| p.into_inner()).clear();
    }

    /// Resolves a stream handle (0 and the legacy / per-thread handles mean the current
    /// context's default stream); returns its device and whether it is a real stream.
    pub fn stream_device(&self, stream: u64) -> Result<(usize, bool), CuResult> {
        if matches!(stream, 0 | CU_STREAM_LEGACY | CU_STREAM_PER_THREAD) {
            return Ok((self.current()?, false));
        }
        self.objects().streams.get(&stream).map(|s| (s.device, true)).ok_or(INVALID_HANDLE)
    }

    /// Runs `op` on stream `stream`, or records it if the stream is capturing. Work on the
    /// legacy stream while this thread captures is an implicit dependency: an error that
    /// invalidates the capture.
    pub fn submit(&self, stream: u64, op: Op) -> Result<(), CuResult> {
        let d = self.live()?;
        let (sd, real) = self.stream_device(stream)?;
        if sd != d {
            return Err(INVALID_CONTEXT);
        }
        if !real {
            if self.invalidate_captures_of_this_thread() {
                return Err(STREAM_CAPTURE_IMPLICIT);
            }
        } else {
            let mut objects = self.objects();
            let Objects { streams, events, .. } = &mut *objects;
            if let Some(c) = streams.get_mut(&stream).and_then(|s| s.capture.as_mut()) {
                if c.invalidated {
                    return Err(STREAM_CAPTURE_INVALIDATED);
                }
                if let Op::Record { event } = op {
                    if let Some(e) = events.get_mut(&event) {
                        e.captured = true;
                    }
                }
                c.ops.push(op);
                return Ok(());
            }
        }
        self.execute(d, &op)
    }

    /// The capture sequences a "potentially unsafe" call (allocation, synchronous copy or
    /// synchronisation) on this thread must not run during: this thread's own non-relaxed
    /// captures and every other thread's global-mode capture. They are invalidated and the
    /// call fails with `CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED`, as the driver does.
    pub fn forbid_during_capture(&self) -> Result<(), CuResult> {
        let me = std::thread::current().id();
        let mut objects = self.objects();
        let mut hit = false;
        for s in objects.streams.values_mut() {
            if let Some(c) = s.capture.as_mut() {
                if (c.thread == me && c.mode != CAPTURE_MODE_RELAXED) || (c.thread != me && c.mode == CAPTURE_MODE_GLOBAL) {
                    c.invalidated = true;
                    hit = true;
                }
            }
        }
        if hit {
            Err(STREAM_CAPTURE_UNSUPPORTED)
        } else {
            Ok(())
        }
    }

    fn invalidate_captures_of_this_thread(&self) -> bool {
        let me = std::thread::current().id();
        let mut objects = self.objects();
        let mut hit = false;
        for c in objects.streams.values_mut().filter_map(|s| s.capture.as_mut()) {
            if c.thread == me {
                c.invalidated = true;
                hit = true;
            }
        }
        hit
    }

    /// Executes one operation on device `d` now. A faulting kernel sets the sticky error and
    /// returns Ok (launches are asynchronous: the error surfaces at the next call).
    pub fn execute(&self, d: usize, op: &Op) -> Result<(), CuResult> {
        self.check_sticky(d)?;
        match op {
            Op::Launch { func, grid, block, smem, params } => {
                let n = self.launches.fetch_add(1, Ordering::SeqCst) + 1;
                if self.config.fault_at_launch == Some(n) {
                    self.fault(d, ILLEGAL_ADDRESS, &format!("kernel {} faulted: injected fault (KILN_DOUBLE_FAULT_AT_LAUNCH={n})", func.entry));
                    return Ok(());
                }
                let mem = self.devices[d].memory.read().unwrap_or_else(|p| p.into_inner());
                // Kernels address the memory of the devices this context enabled peer access
                // to (a P2P fabric that drops writes maps none: such accesses fault here, where
                // real hardware would lose them)
                let peer_ids: Vec<usize> = if self.config.p2p == crate::config::P2p::Ok { self.devices[d].peers.lock().unwrap_or_else(|p| p.into_inner()).clone() } else { Vec::new() };
                let peer_guards: Vec<_> = peer_ids.iter().map(|&p| self.devices[p].memory.read().unwrap_or_else(|p| p.into_inner())).collect();
                let peers: Vec<&GlobalMemory> = peer_guards.iter().map(|g| &**g).collect();
                match kiln_emu::launch_params_with_peers(&func.module.ptx, &func.entry, *grid, *block, *smem, params, &mem, &peers) {
                    Ok(stats) => {
                        if self.config.profile {
                            let mut p = self.profile.lock().unwrap_or_else(|p| p.into_inner());
                            let e = p.entry(func.entry.clone()).or_default();
                            e.0 += 1;
                            e.1 += stats.elapsed;
                        }
                    }
                    Err(e @ EmuError::Exec { .. }) => {
                        let text = e.to_string();
                        let code = if text.contains("aligned") { MISALIGNED_ADDRESS } else if text.contains("address") || text.contains("buffer") { ILLEGAL_ADDRESS } else { LAUNCH_FAILED };
                        drop(peers);
                        drop(peer_guards);
                        drop(mem);
                        self.fault(d, code, &format!("kernel {} faulted: {text}", func.entry));
                    }
                    Err(e) => {
                        drop(peers);
                        drop(peer_guards);
                        drop(mem);
                        self.fault(d, LAUNCH_FAILED, &format!("kernel {} failed to launch: {e}", func.entry));
                    }
                }
            }
            Op::Memset { dst, byte, len } => {
                let (dd, id, off) = self.range(*dst, *len)?;
                self.devices[dd].memory.read().unwrap_or_else(|p| p.into_inner()).fill(id, off, *len, *byte);
            }
            Op::HtoD { dst, src, len } => {
                // SAFETY: the caller promises `len` readable bytes at `src`, as with the driver.
                let data = unsafe { std::slice::from_raw_parts(*src as *const u8, *len) };
                self.write(*dst, data)?;
            }
            Op::DtoH { dst, src, len } => {
                let data = self.read(*src, *len)?;
                // SAFETY: the caller promises `len` writable bytes at `dst`.
                unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), *dst as *mut u8, *len) };
            }
            Op::DtoD { dst, src, len } => {
                let data = self.read(*src, *len)?;
                let (sd, dd) = (self.device_of(*src), self.device_of(*dst));
                if sd != dd && self.config.p2p == crate::config::P2p::Drop && self.peer_enabled(sd, dd) {
                    return Ok(()); // granted peer access, but the fabric drops the writes
                }
                self.write(*dst, &data)?;
            }
            Op::Record { event } => {
                if let Some(e) = self.objects().events.get_mut(event) {
                    e.recorded = Some(Instant::now());
                    e.captured = false;
                }
            }
            Op::Collective(call) => {
                if let Err(message) = crate::nccl::run(self, call) {
                    self.fault(d, LAUNCH_FAILED, &message);
                }
            }
        }
        Ok(())
    }

    fn peer_enabled(&self, a: Option<usize>, b: Option<usize>) -> bool {
        match (a, b) {
            (Some(a), Some(b)) => {
                let pa = self.devices[a].peers.lock().unwrap_or_else(|p| p.into_inner()).contains(&b);
                let pb = self.devices[b].peers.lock().unwrap_or_else(|p| p.into_inner()).contains(&a);
                pa || pb
            }
            _ => false,
        }
    }
}

impl Driver {
    pub fn is_capturing(&self, stream: u64) -> bool {
        self.objects().streams.get(&stream).is_some_and(|s| s.capture.is_some())
    }

    /// Invalidates the capture of `stream` (after an operation the capture cannot hold).
    pub fn invalidate(&self, stream: u64) {
        if let Some(c) = self.objects().streams.get_mut(&stream).and_then(|s| s.capture.as_mut()) {
            c.invalidated = true;
        }
    }
}
