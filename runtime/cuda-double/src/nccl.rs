//! `libnccl.so`: communicators whose ranks rendezvous inside this process (one thread per GPU,
//! the layout kiln's CUDA backend uses) and collectives computed on the host from the ranks'
//! device memory: all-reduce sums in rank order in f32 (f64 for f64) and rounds once to the
//! buffer's type, so results equal kiln's emulator and CPU backends bit for bit. Every rank
//! checks that all ranks called the same collective with the same count and type (real NCCL
//! would hang or corrupt memory; the double names the mismatch). A rank that waits longer than
//! `KILN_DOUBLE_NCCL_TIMEOUT_S` for the others fails the collective (and the communicator).
//! Group calls execute as they are issued (each thread drives one communicator), and inside a
//! stream capture a collective is recorded into the graph and runs at every replay.

use crate::driver::{self, Driver, Op};
use crate::status;
use std::cell::RefCell;
use std::collections::HashMap;
use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::sync::{Arc, Condvar, LazyLock, Mutex, MutexGuard};
use std::time::Instant;

pub type NcclResult = u32;
pub const NCCL_SUCCESS: NcclResult = 0;
pub const NCCL_UNHANDLED_CUDA_ERROR: NcclResult = 1;
pub const NCCL_SYSTEM_ERROR: NcclResult = 2;
pub const NCCL_INTERNAL_ERROR: NcclResult = 3;
pub const NCCL_INVALID_ARGUMENT: NcclResult = 4;
pub const NCCL_INVALID_USAGE: NcclResult = 5;

/// NCCL 2.30.7 (`NCCL_VERSION_CODE` = major * 10000 + minor * 100 + patch).
pub const VERSION: c_int = 23007;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    AllReduce,
    AllGather,
    Broadcast,
}

/// One collective call of one rank.
#[derive(Clone, Debug)]
pub struct Call {
    pub comm: u64,
    pub kind: Kind,
    pub send: u64,
    pub recv: u64,
    pub count: usize,
    pub dtype: u32,
    pub op: u32,
    pub root: i32,
}

struct CliqueState {
    devices: Vec<Option<usize>>,
    generation: u64,
    arrived: usize,
    calls: Vec<Option<Call>>,
    broken: Option<String>,
}

struct Clique {
    nranks: usize,
    state: Mutex<CliqueState>,
    cv: Condvar,
}

struct Comm {
    rank: usize,
    nranks: usize,
    device: usize,
    clique: Arc<Clique>,
}

/// `ncclUniqueId` (passed by value to `ncclCommInitRank`).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct UniqueId {
    pub internal: [u8; 128],
}

static CLIQUES: LazyLock<Mutex<HashMap<[u8; 16], Arc<Clique>>>> = LazyLock::new(Default::default);
static COMMS: LazyLock<Mutex<HashMap<u64, Arc<Comm>>>> = LazyLock::new(Default::default);
static NEXT: Mutex<u64> = Mutex::new(0);

thread_local! {
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
    static GROUP_DEPTH: RefCell<u32> = const { RefCell::new(0) };
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn fail(code: NcclResult, message: String) -> NcclResult {
    eprintln!("kiln-cuda-double (nccl): {message}");
    LAST_ERROR.with(|e| *e.borrow_mut() = CString::new(message).unwrap_or_default());
    code
}

fn next_id() -> u64 {
    let mut n = lock(&NEXT);
    *n += 1;
    0xCC11_0000 + *n * 16
}

impl Clique {
    /// Waits until every rank arrived (or the timeout passed, which breaks the clique).
    fn barrier(&self, rank: usize, what: &str) -> Result<(), String> {
        // Read at every wait (not only at cuInit) so that a test can shorten it.
        let timeout = std::env::var("KILN_DOUBLE_NCCL_TIMEOUT_S")
            .ok()
            .and_then(|v| v.trim().parse::<f64>().ok())
            .map(std::time::Duration::from_secs_f64)
            .or_else(|| driver::driver().ok().map(|d| d.config.nccl_timeout))
            .unwrap_or(std::time::Duration::from_secs(120));
        let mut s = lock(&self.state);
        if let Some(b) = &s.broken {
            return Err(b.clone());
        }
        let generation = s.generation;
        s.arrived += 1;
        if s.arrived == self.nranks {
            s.arrived = 0;
            s.generation += 1;
            self.cv.notify_all();
            return Ok(());
        }
        let deadline = Instant::now() + timeout;
        while s.generation == generation {
            if let Some(b) = &s.broken {
                return Err(b.clone());
            }
            let now = Instant::now();
            if now >= deadline {
                let m = format!("rank {rank} waited {:.0} s in {what} for the other ranks ({} of {} arrived)", timeout.as_secs_f64(), s.arrived, self.nranks);
                s.broken = Some(m.clone());
                self.cv.notify_all();
                return Err(m);
            }
            s = self.cv.wait_timeout(s, deadline - now).unwrap_or_else(|p| p.into_inner()).0;
        }
        Ok(())
    }

    fn break_with(&self, message: &str) {
        let mut s = lock(&self.state);
        s.broken.get_or_insert_with(|| message.to_string());
        self.cv.notify_all();
    }
}

fn dtype_bytes(t: u32) -> Option<usize> {
    Some(match t {
        0 | 1 => 1,
        2 | 3 | 7 => 4,
        4 | 5 | 8 => 8,
        6 | 9 => 2,
        _ => return None,
    })
}

fn dtype_name(t: u32) -> &'static str {
    ["int8", "uint8", "int32", "uint32", "int64", "uint64", "float16", "float32", "float64", "bfloat16"].get(t as usize).copied().unwrap_or("unknown type")
}

/// Reduces the ranks' inputs in rank order (sum, prod, max, min) in f32 for 16/32-bit floats,
/// f64 for f64, wrapping for integers.
fn reduce(inputs: &[Vec<u8>], dtype: u32, op: u32) -> Result<Vec<u8>, String> {
    let n = inputs[0].len() / dtype_bytes(dtype).unwrap_or(1);
    let f32s = |b: &[u8]| -> Vec<f32> {
        match dtype {
            7 => b.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect(),
            9 => b.chunks_exact(2).map(|c| kiln_emu::formats::bf16_to_f32(u16::from_le_bytes([c[0], c[1]]))).collect(),
            _ => b.chunks_exact(2).map(|c| kiln_emu::f16_to_f32(u16::from_le_bytes([c[0], c[1]]))).collect(),
        }
    };
    let combine_f = |a: f64, b: f64| match op {
        0 => a + b,
        1 => a * b,
        2 => a.max(b),
        _ => a.min(b),
    };
    if op > 3 {
        return Err(format!("reduction op {op} (the double implements sum, prod, max and min)"));
    }
    Ok(match dtype {
        6 | 7 | 9 => {
            let mut acc = f32s(&inputs[0]);
            for other in &inputs[1..] {
                for (a, b) in acc.iter_mut().zip(f32s(other)) {
                    *a = match op {
                        0 => *a + b,
                        1 => *a * b,
                        2 => a.max(b),
                        _ => a.min(b),
                    };
                }
            }
            match dtype {
                7 => acc.iter().flat_map(|v| v.to_le_bytes()).collect(),
                9 => acc.iter().flat_map(|&v| kiln_emu::formats::f32_to_bf16(v).to_le_bytes()).collect(),
                _ => acc.iter().flat_map(|&v| kiln_emu::f32_to_f16(v).to_le_bytes()).collect(),
            }
        }
        8 => {
            let get = |b: &[u8], i: usize| f64::from_le_bytes(b[i * 8..i * 8 + 8].try_into().expect("8 bytes"));
            (0..n).flat_map(|i| inputs[1..].iter().fold(get(&inputs[0], i), |a, b| combine_f(a, get(b, i))).to_le_bytes()).collect()
        }
        2..=5 => {
            let w = dtype_bytes(dtype).expect("known");
            let signed = matches!(dtype, 2 | 4);
            let get = |b: &[u8], i: usize| -> i128 {
                let mut x = [0u8; 8];
                x[..w].copy_from_slice(&b[i * w..i * w + w]);
                let u = u64::from_le_bytes(x);
                if signed && w == 4 {
                    u as u32 as i32 as i128
                } else if signed {
                    u as i64 as i128
                } else {
                    u as i128
                }
            };
            (0..n)
                .flat_map(|i| {
                    let v = inputs[1..].iter().fold(get(&inputs[0], i), |a, b| {
                        let y = get(b, i);
                        match op {
                            0 => a.wrapping_add(y),
                            1 => a.wrapping_mul(y),
                            2 => a.max(y),
                            _ => a.min(y),
                        }
                    });
                    (v as u64).to_le_bytes()[..w].to_vec()
                })
                .collect()
        }
        _ => return Err(format!("all-reduce of {} (not implemented by the double)", dtype_name(dtype))),
    })
}

fn describe(c: &Call) -> String {
    format!("{:?} of {} {}", c.kind, c.count, dtype_name(c.dtype))
}

/// Runs one rank's part of a collective (blocks until all ranks took part).
pub fn run(drv: &Driver, call: &Call) -> Result<(), String> {
    let comm = lock(&COMMS).get(&call.comm).cloned().ok_or_else(|| "collective on a destroyed communicator".to_string())?;
    let clique = &comm.clique;
    let what = format!("nccl{:?}", call.kind);
    lock(&clique.state).calls[comm.rank] = Some(call.clone());
    clique.barrier(comm.rank, &what)?;
    let calls: Vec<Call> = lock(&clique.state).calls.iter().map(|c| c.clone().expect("every rank deposited")).collect();
    let first = &calls[0];
    let result = (|| {
        if let Some((r, c)) = calls.iter().enumerate().find(|(_, c)| c.kind != first.kind || c.count != first.count || c.dtype != first.dtype || c.op != first.op || c.root != first.root) {
            return Err(format!("ranks disagree: rank 0 called {}, rank {r} called {}", describe(first), describe(c)));
        }
        let es = dtype_bytes(call.dtype).ok_or_else(|| format!("data type {}", call.dtype))?;
        let len = call.count * es;
        let read = |r: usize, c: &Call| drv.read(c.send, len).map_err(|_| format!("rank {r}'s send buffer {:#x} (+{len} B) is not device memory", c.send));
        Ok(match call.kind {
            Kind::AllReduce => reduce(&calls.iter().enumerate().map(|(r, c)| read(r, c)).collect::<Result<Vec<_>, _>>()?, call.dtype, call.op)?,
            Kind::AllGather => calls.iter().enumerate().map(|(r, c)| read(r, c)).collect::<Result<Vec<_>, _>>()?.concat(),
            Kind::Broadcast => {
                let root = usize::try_from(call.root).ok().filter(|&r| r < comm.nranks).ok_or_else(|| format!("broadcast root {}", call.root))?;
                read(root, &calls[root])?
            }
        })
    })();
    if let Err(m) = &result {
        clique.break_with(m);
    }
    // Every rank has read its inputs before anyone overwrites them (in-place collectives).
    clique.barrier(comm.rank, &what)?;
    let data = result?;
    let dst_device = drv.device_of(call.recv);
    if dst_device != Some(comm.device) {
        return Err(format!("rank {}'s receive buffer {:#x} is not memory of GPU {}", comm.rank, call.recv, comm.device));
    }
    drv.write(call.recv, &data).map_err(|_| format!("rank {}'s receive buffer {:#x} (+{} B) is not device memory", comm.rank, call.recv, data.len()))
}

fn guard(f: impl FnOnce() -> Result<(), NcclResult>) -> NcclResult {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
        Ok(Ok(())) => NCCL_SUCCESS,
        Ok(Err(e)) => e,
        Err(_) => fail(NCCL_INTERNAL_ERROR, "internal error (panic) in the driver double".into()),
    }
}

/// # Safety
/// `version` must be writable.
#[no_mangle]
pub unsafe extern "C" fn ncclGetVersion(version: *mut c_int) -> NcclResult {
    if version.is_null() {
        return NCCL_INVALID_ARGUMENT;
    }
    *version = VERSION;
    NCCL_SUCCESS
}

/// # Safety
/// `id` must point to a writable `ncclUniqueId` (128 bytes).
#[no_mangle]
pub unsafe extern "C" fn ncclGetUniqueId(id: *mut UniqueId) -> NcclResult {
    guard(|| {
        if id.is_null() {
            return Err(NCCL_INVALID_ARGUMENT);
        }
        let n = next_id();
        let mut bytes = [0u8; 128];
        bytes[..8].copy_from_slice(b"KILNDBL\0");
        bytes[8..16].copy_from_slice(&n.to_le_bytes());
        *id = UniqueId { internal: bytes };
        Ok(())
    })
}

fn key(id: &[u8; 128]) -> [u8; 16] {
    id[..16].try_into().expect("16 bytes")
}

/// # Safety
/// `comm` must be writable.
#[no_mangle]
pub unsafe extern "C" fn ncclCommInitRank(comm: *mut u64, nranks: c_int, id: UniqueId, rank: c_int) -> NcclResult {
    guard(|| {
        if comm.is_null() || nranks < 1 || rank < 0 || rank >= nranks {
            return Err(fail(NCCL_INVALID_ARGUMENT, format!("ncclCommInitRank: rank {rank} of {nranks}")));
        }
        let id = id.internal;
        if &id[..8] != b"KILNDBL\0" {
            return Err(fail(NCCL_SYSTEM_ERROR, "ncclCommInitRank: the unique id was not made by ncclGetUniqueId in this process (the double's ranks meet in-process)".into()));
        }
        // NCCL uses the calling thread's current device (device 0 when none is current).
        let device = driver::current_device().unwrap_or(0);
        let (nranks, rank) = (nranks as usize, rank as usize);
        let clique = lock(&CLIQUES)
            .entry(key(&id))
            .or_insert_with(|| {
                Arc::new(Clique {
                    nranks,
                    state: Mutex::new(CliqueState { devices: vec![None; nranks], generation: 0, arrived: 0, calls: vec![None; nranks], broken: None }),
                    cv: Condvar::new(),
                })
            })
            .clone();
        if clique.nranks != nranks {
            return Err(fail(NCCL_INVALID_USAGE, format!("ncclCommInitRank: rank {rank} says {nranks} ranks, others said {}", clique.nranks)));
        }
        {
            let mut s = lock(&clique.state);
            if s.devices[rank].is_some() {
                drop(s);
                return Err(fail(NCCL_INVALID_USAGE, format!("ncclCommInitRank: rank {rank} joined twice")));
            }
            s.devices[rank] = Some(device);
        }
        clique.barrier(rank, "ncclCommInitRank").map_err(|m| fail(NCCL_SYSTEM_ERROR, m))?;
        let devices: Vec<usize> = lock(&clique.state).devices.iter().map(|d| d.expect("all joined")).collect();
        if let Some(other) = devices.iter().position(|&d| d == device).filter(|&r| r != rank) {
            return Err(fail(NCCL_INVALID_USAGE, format!("ncclCommInitRank: duplicate GPU {device} (ranks {other} and {rank})")));
        }
        let handle = next_id();
        lock(&COMMS).insert(handle, Arc::new(Comm { rank, nranks, device, clique }));
        *comm = handle;
        Ok(())
    })
}

/// # Safety
/// `comms` must hold `ndev` writable handles, `devlist` (or NULL: 0..ndev) `ndev` ordinals.
#[no_mangle]
pub unsafe extern "C" fn ncclCommInitAll(comms: *mut u64, ndev: c_int, devlist: *const c_int) -> NcclResult {
    guard(|| {
        if comms.is_null() || ndev < 1 {
            return Err(NCCL_INVALID_ARGUMENT);
        }
        let n = ndev as usize;
        let devices: Vec<usize> = (0..n).map(|i| if devlist.is_null() { i } else { *devlist.add(i) as usize }).collect();
        let clique = Arc::new(Clique {
            nranks: n,
            state: Mutex::new(CliqueState { devices: devices.iter().map(|&d| Some(d)).collect(), generation: 0, arrived: 0, calls: vec![None; n], broken: None }),
            cv: Condvar::new(),
        });
        for (rank, &device) in devices.iter().enumerate() {
            let handle = next_id();
            lock(&COMMS).insert(handle, Arc::new(Comm { rank, nranks: n, device, clique: clique.clone() }));
            *comms.add(rank) = handle;
        }
        Ok(())
    })
}

fn comm_of(comm: u64) -> Result<Arc<Comm>, NcclResult> {
    lock(&COMMS).get(&comm).cloned().ok_or_else(|| fail(NCCL_INVALID_ARGUMENT, format!("communicator {comm:#x} does not exist")))
}

fn remove(comm: u64, abort: bool) -> NcclResult {
    guard(|| {
        let c = lock(&COMMS).remove(&comm).ok_or(NCCL_INVALID_ARGUMENT)?;
        if abort {
            c.clique.break_with(&format!("rank {} aborted the communicator", c.rank));
        }
        Ok(())
    })
}

#[no_mangle]
pub extern "C" fn ncclCommDestroy(comm: u64) -> NcclResult {
    remove(comm, false)
}

#[no_mangle]
pub extern "C" fn ncclCommAbort(comm: u64) -> NcclResult {
    remove(comm, true)
}

#[no_mangle]
pub extern "C" fn ncclCommFinalize(comm: u64) -> NcclResult {
    guard(|| comm_of(comm).map(|_| ()))
}

/// # Safety
/// `out` must be writable.
#[no_mangle]
pub unsafe extern "C" fn ncclCommCount(comm: u64, out: *mut c_int) -> NcclResult {
    guard(|| {
        *out = comm_of(comm)?.nranks as c_int;
        Ok(())
    })
}

/// # Safety
/// `out` must be writable.
#[no_mangle]
pub unsafe extern "C" fn ncclCommCuDevice(comm: u64, out: *mut c_int) -> NcclResult {
    guard(|| {
        *out = comm_of(comm)?.device as c_int;
        Ok(())
    })
}

/// # Safety
/// `out` must be writable.
#[no_mangle]
pub unsafe extern "C" fn ncclCommUserRank(comm: u64, out: *mut c_int) -> NcclResult {
    guard(|| {
        *out = comm_of(comm)?.rank as c_int;
        Ok(())
    })
}

/// # Safety
/// `out` must be writable.
#[no_mangle]
pub unsafe extern "C" fn ncclCommGetAsyncError(comm: u64, out: *mut u32) -> NcclResult {
    guard(|| {
        let c = comm_of(comm)?;
        *out = if lock(&c.clique.state).broken.is_some() { NCCL_SYSTEM_ERROR } else { NCCL_SUCCESS };
        Ok(())
    })
}

fn enqueue(call: Call, stream: u64) -> NcclResult {
    guard(|| {
        let comm = comm_of(call.comm)?;
        let drv = driver::driver().map_err(|_| fail(NCCL_UNHANDLED_CUDA_ERROR, "CUDA is not initialised".into()))?;
        if dtype_bytes(call.dtype).is_none() || call.count == 0 {
            return Err(fail(NCCL_INVALID_ARGUMENT, format!("{}: count {} of data type {}", describe(&call), call.count, call.dtype)));
        }
        let (sd, _) = drv.stream_device(stream).map_err(|e| fail(NCCL_UNHANDLED_CUDA_ERROR, format!("stream {stream:#x}: {}", cuda_error_name(e))))?;
        if sd != comm.device {
            return Err(fail(NCCL_UNHANDLED_CUDA_ERROR, format!("rank {}: the stream belongs to GPU {sd}, the communicator to GPU {}", comm.rank, comm.device)));
        }
        drv.check_sticky(sd).map_err(|e| fail(NCCL_UNHANDLED_CUDA_ERROR, format!("rank {}: the GPU's context has failed ({})", comm.rank, cuda_error_name(e))))?;
        if drv.is_capturing(stream) {
            return drv.submit(stream, Op::Collective(call)).map_err(|e| fail(NCCL_UNHANDLED_CUDA_ERROR, format!("capturing the collective: {}", cuda_error_name(e))));
        }
        run(drv, &call).map_err(|m| fail(if m.contains("disagree") { NCCL_INVALID_USAGE } else { NCCL_SYSTEM_ERROR }, m))
    })
}

#[no_mangle]
pub extern "C" fn ncclAllReduce(send: *const c_void, recv: *mut c_void, count: usize, dtype: u32, op: u32, comm: u64, stream: u64) -> NcclResult {
    enqueue(Call { comm, kind: Kind::AllReduce, send: send as u64, recv: recv as u64, count, dtype, op, root: 0 }, stream)
}

#[no_mangle]
pub extern "C" fn ncclAllGather(send: *const c_void, recv: *mut c_void, count: usize, dtype: u32, comm: u64, stream: u64) -> NcclResult {
    enqueue(Call { comm, kind: Kind::AllGather, send: send as u64, recv: recv as u64, count, dtype, op: 0, root: 0 }, stream)
}

#[no_mangle]
pub extern "C" fn ncclBroadcast(send: *const c_void, recv: *mut c_void, count: usize, dtype: u32, root: c_int, comm: u64, stream: u64) -> NcclResult {
    enqueue(Call { comm, kind: Kind::Broadcast, send: send as u64, recv: recv as u64, count, dtype, op: 0, root }, stream)
}

#[no_mangle]
pub extern "C" fn ncclGroupStart() -> NcclResult {
    GROUP_DEPTH.with(|d| *d.borrow_mut() += 1);
    NCCL_SUCCESS
}

#[no_mangle]
pub extern "C" fn ncclGroupEnd() -> NcclResult {
    GROUP_DEPTH.with(|d| {
        let mut d = d.borrow_mut();
        if *d == 0 {
            return fail(NCCL_INVALID_USAGE, "ncclGroupEnd without ncclGroupStart".into());
        }
        *d -= 1;
        NCCL_SUCCESS
    })
}

#[no_mangle]
pub extern "C" fn ncclGetErrorString(result: NcclResult) -> *const c_char {
    let s: &CStr = match result {
        NCCL_SUCCESS => c"no error",
        NCCL_UNHANDLED_CUDA_ERROR => c"unhandled cuda error (run with NCCL_DEBUG=INFO for details)",
        NCCL_SYSTEM_ERROR => c"unhandled system error (run with NCCL_DEBUG=INFO for details)",
        NCCL_INTERNAL_ERROR => c"internal error - please report this issue to the NCCL developers",
        NCCL_INVALID_ARGUMENT => c"invalid argument (run with NCCL_DEBUG=WARN for details)",
        NCCL_INVALID_USAGE => c"invalid usage (run with NCCL_DEBUG=WARN for details)",
        _ => c"unknown result code",
    };
    s.as_ptr()
}

/// The calling thread's last error message (the pointer stays valid until its next error).
#[no_mangle]
pub extern "C" fn ncclGetLastError(_comm: u64) -> *const c_char {
    LAST_ERROR.with(|e| e.borrow().as_ptr())
}

fn cuda_error_name(code: status::CuResult) -> &'static str {
    status::describe(code).and_then(|(n, _)| n.to_str().ok()).unwrap_or("CUDA_ERROR")
}
