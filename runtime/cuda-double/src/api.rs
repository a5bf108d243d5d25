//! The exported driver functions (`libcuda.so`), each checked the way the driver checks it:
//! a current, live context; handles of the right kind and device; allocations that hold the
//! whole range a copy touches; stream-capture rules (allocations, synchronous copies and
//! synchronisation during a capture fail and invalidate it; launches, async copies, memsets,
//! event records and collectives are recorded, and a replay runs them with the values
//! captured); kernel parameters marshalled from `kernelParams` by the entry's `.param` list.

use crate::config::P2p;
use crate::driver::{self, driver, Capture, Driver, Event, Graph, Op, Stream, CONTEXT_TAG};
use crate::module::{self, Function};
use crate::status::*;
use std::ffi::{c_char, c_int, c_uint, c_void, CStr};
use std::sync::atomic::{AtomicI32, Ordering};
use std::sync::Arc;

type Ptr = *mut c_void;

fn guard(f: impl FnOnce() -> Result<(), CuResult>) -> CuResult {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
        Ok(Ok(())) => SUCCESS,
        Ok(Err(e)) => e,
        Err(_) => {
            eprintln!("kiln-cuda-double: internal error (panic)");
            UNKNOWN
        }
    }
}

/// Writes through an out-pointer, failing with INVALID_VALUE on NULL.
unsafe fn put<T>(p: *mut T, v: T) -> Result<(), CuResult> {
    if p.is_null() {
        return Err(INVALID_VALUE);
    }
    p.write(v);
    Ok(())
}

/// Copies `len` bytes from a host pointer the caller handed in, without trusting it: an
/// unreadable address is an error instead of a crash.
fn read_host(ptr: *const c_void, len: usize) -> Option<Vec<u8>> {
    if ptr.is_null() {
        return None;
    }
    let mut out = vec![0u8; len];
    let local = libc::iovec { iov_base: out.as_mut_ptr().cast(), iov_len: len };
    let remote = libc::iovec { iov_base: ptr as *mut c_void, iov_len: len };
    // SAFETY: process_vm_readv checks the remote range and reports EFAULT instead of faulting.
    let n = unsafe { libc::process_vm_readv(libc::getpid(), &local, 1, &remote, 1, 0) };
    (n == len as isize).then_some(out)
}

fn ctx_device(ctx: Ptr) -> Result<usize, CuResult> {
    let drv = driver()?;
    let v = (ctx as u64).checked_sub(CONTEXT_TAG).ok_or(INVALID_CONTEXT)? as usize;
    (v < drv.devices.len()).then_some(v).ok_or(INVALID_CONTEXT)
}

// ---- initialisation, versions, errors ------------------------------------------------------

#[no_mangle]
pub extern "C" fn cuInit(flags: c_uint) -> CuResult {
    guard(|| {
        if flags != 0 {
            return Err(INVALID_VALUE);
        }
        driver::init().map(|_| ())
    })
}

/// # Safety
/// Out-pointer must be writable.
#[no_mangle]
pub unsafe extern "C" fn cuDriverGetVersion(v: *mut c_int) -> CuResult {
    // Works before cuInit, as on the driver.
    guard(|| {
        let version = match driver() {
            Ok(d) => d.config.driver_version,
            Err(_) => crate::config::Config::from_env().map(|c| c.driver_version).unwrap_or(12090),
        };
        put(v, version)
    })
}

/// # Safety
/// Out-pointer must be writable.
#[no_mangle]
pub unsafe extern "C" fn cuGetErrorString(code: CuResult, s: *mut *const c_char) -> CuResult {
    match describe(code) {
        Some((_, m)) if !s.is_null() => {
            *s = m.as_ptr();
            SUCCESS
        }
        _ => INVALID_VALUE,
    }
}

/// # Safety
/// Out-pointer must be writable.
#[no_mangle]
pub unsafe extern "C" fn cuGetErrorName(code: CuResult, s: *mut *const c_char) -> CuResult {
    match describe(code) {
        Some((n, _)) if !s.is_null() => {
            *s = n.as_ptr();
            SUCCESS
        }
        _ => INVALID_VALUE,
    }
}

// ---- devices --------------------------------------------------------------------------------

/// # Safety
/// Out-pointer must be writable.
#[no_mangle]
pub unsafe extern "C" fn cuDeviceGetCount(n: *mut c_int) -> CuResult {
    guard(|| put(n, driver()?.devices.len() as c_int))
}

/// # Safety
/// Out-pointer must be writable.
#[no_mangle]
pub unsafe extern "C" fn cuDeviceGet(dev: *mut c_int, ordinal: c_int) -> CuResult {
    guard(|| {
        driver()?.device(ordinal)?;
        put(dev, ordinal)
    })
}

/// # Safety
/// `name` must hold `len` bytes.
#[no_mangle]
pub unsafe extern "C" fn cuDeviceGetName(name: *mut c_char, len: c_int, dev: c_int) -> CuResult {
    guard(|| {
        let drv = driver()?;
        drv.device(dev)?;
        if name.is_null() || len <= 0 {
            return Err(INVALID_VALUE);
        }
        let bytes = drv.config.name.as_bytes();
        let n = bytes.len().min(len as usize - 1);
        std::ptr::copy_nonoverlapping(bytes.as_ptr(), name.cast(), n);
        *name.add(n) = 0;
        Ok(())
    })
}

/// # Safety
/// Out-pointer must be writable (16 bytes).
#[no_mangle]
pub unsafe extern "C" fn cuDeviceGetUuid(uuid: *mut [u8; 16], dev: c_int) -> CuResult {
    guard(|| {
        driver()?.device(dev)?;
        let mut u = *b"kiln-double-gpu\0";
        u[15] = dev as u8;
        put(uuid, u)
    })
}

/// # Safety
/// Out-pointer must be writable (16 bytes).
#[no_mangle]
pub unsafe extern "C" fn cuDeviceGetUuid_v2(uuid: *mut [u8; 16], dev: c_int) -> CuResult {
    cuDeviceGetUuid(uuid, dev)
}

/// # Safety
/// `bus` must hold `len` bytes.
#[no_mangle]
pub unsafe extern "C" fn cuDeviceGetPCIBusId(bus: *mut c_char, len: c_int, dev: c_int) -> CuResult {
    guard(|| {
        driver()?.device(dev)?;
        let s = format!("0000:{:02x}:00.0\0", dev + 1);
        if bus.is_null() || (len as usize) < s.len() {
            return Err(INVALID_VALUE);
        }
        std::ptr::copy_nonoverlapping(s.as_ptr(), bus.cast(), s.len());
        Ok(())
    })
}

/// # Safety
/// Out-pointer must be writable.
#[no_mangle]
pub unsafe extern "C" fn cuDeviceGetAttribute(v: *mut c_int, attr: c_int, dev: c_int) -> CuResult {
    guard(|| {
        let drv = driver()?;
        drv.device(dev)?;
        let c = &drv.config;
        let value = match attr {
            1 => 1024,                      // MAX_THREADS_PER_BLOCK
            2 | 3 => 1024,                  // MAX_BLOCK_DIM_X/Y
            4 => 64,                        // MAX_BLOCK_DIM_Z
            5 => i32::MAX,                  // MAX_GRID_DIM_X
            6 | 7 => 65535,                 // MAX_GRID_DIM_Y/Z
            8 => 48 * 1024,                 // MAX_SHARED_MEMORY_PER_BLOCK
            10 => 32,                       // WARP_SIZE
            12 => 65536,                    // MAX_REGISTERS_PER_BLOCK
            16 => c.sms,                    // MULTIPROCESSOR_COUNT
            19 => 1,                        // CAN_MAP_HOST_MEMORY
            33 => dev + 1,                  // PCI_BUS_ID
            34 | 50 => 0,                   // PCI_DEVICE_ID, PCI_DOMAIN_ID
            38 => c.l2_bytes,               // L2_CACHE_SIZE
            39 => 1536,                     // MAX_THREADS_PER_MULTIPROCESSOR
            41 => 1,                        // UNIFIED_ADDRESSING
            75 => c.cc.0,                   // COMPUTE_CAPABILITY_MAJOR
            76 => c.cc.1,                   // COMPUTE_CAPABILITY_MINOR
            81 => c.smem_optin,             // MAX_SHARED_MEMORY_PER_MULTIPROCESSOR (approx.)
            82 => 65536,                    // MAX_REGISTERS_PER_MULTIPROCESSOR
            97 => c.smem_optin,             // MAX_SHARED_MEMORY_PER_BLOCK_OPTIN
            115 => 0,                       // MEMORY_POOLS_SUPPORTED: cudarc then uses cuMemAlloc
            _ => return Err(INVALID_VALUE),
        };
        put(v, value)
    })
}

/// # Safety
/// Out-pointer must be writable.
#[no_mangle]
pub unsafe extern "C" fn cuDeviceTotalMem_v2(bytes: *mut usize, dev: c_int) -> CuResult {
    guard(|| {
        let drv = driver()?;
        drv.device(dev)?;
        put(bytes, drv.config.memory as usize)
    })
}

/// # Safety
/// Out-pointer must be writable.
#[no_mangle]
pub unsafe extern "C" fn cuDeviceCanAccessPeer(can: *mut c_int, dev: c_int, peer: c_int) -> CuResult {
    guard(|| {
        let drv = driver()?;
        drv.device(dev)?;
        drv.device(peer)?;
        put(can, (dev != peer && drv.config.p2p != P2p::Off) as c_int)
    })
}

// ---- contexts -------------------------------------------------------------------------------

/// # Safety
/// Out-pointer must be writable.
#[no_mangle]
pub unsafe extern "C" fn cuDevicePrimaryCtxRetain(ctx: *mut Ptr, dev: c_int) -> CuResult {
    guard(|| {
        let drv = driver()?;
        drv.device(dev)?.retains.fetch_add(1, Ordering::SeqCst);
        put(ctx, (CONTEXT_TAG + dev as u64) as Ptr)
    })
}

#[no_mangle]
pub extern "C" fn cuDevicePrimaryCtxRelease_v2(dev: c_int) -> CuResult {
    guard(|| {
        let drv = driver()?;
        let d = drv.device(dev)?;
        let left = d.retains.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |r| r.checked_sub(1)).map_err(|_| INVALID_CONTEXT)? - 1;
        if left == 0 {
            drv.reset(dev as usize); // the primary context is destroyed with everything in it
            if dev == 0 && drv.config.profile {
                drv.print_profile();
            }
        }
        Ok(())
    })
}

/// # Safety
/// Out-pointer must be writable.
#[no_mangle]
pub unsafe extern "C" fn cuCtxGetCurrent(ctx: *mut Ptr) -> CuResult {
    guard(|| {
        driver()?;
        put(ctx, driver::current_device().map_or(std::ptr::null_mut(), |d| (CONTEXT_TAG + d as u64) as Ptr))
    })
}

#[no_mangle]
pub extern "C" fn cuCtxSetCurrent(ctx: Ptr) -> CuResult {
    guard(|| {
        if ctx.is_null() {
            driver::set_current(None);
            return Ok(());
        }
        let d = ctx_device(ctx)?;
        if driver()?.devices[d].retains.load(Ordering::SeqCst) == 0 {
            return Err(INVALID_CONTEXT);
        }
        driver::set_current(Some(d));
        Ok(())
    })
}

/// # Safety
/// Out-pointer must be writable.
#[no_mangle]
pub unsafe extern "C" fn cuCtxGetDevice(dev: *mut c_int) -> CuResult {
    guard(|| put(dev, driver()?.current()? as c_int))
}

#[no_mangle]
pub extern "C" fn cuCtxSynchronize() -> CuResult {
    guard(|| {
        let drv = driver()?;
        drv.forbid_during_capture()?;
        drv.live().map(|_| ())
    })
}

#[no_mangle]
pub extern "C" fn cuCtxEnablePeerAccess(peer: Ptr, flags: c_uint) -> CuResult {
    guard(|| {
        let drv = driver()?;
        let d = drv.live()?;
        let p = ctx_device(peer)?;
        if flags != 0 || p == d {
            return Err(INVALID_VALUE);
        }
        if drv.config.p2p == P2p::Off {
            return Err(PEER_ACCESS_UNSUPPORTED);
        }
        let mut peers = drv.devices[d].peers.lock().unwrap_or_else(|e| e.into_inner());
        if peers.contains(&p) {
            return Err(PEER_ACCESS_ALREADY_ENABLED);
        }
        peers.push(p);
        Ok(())
    })
}

/// # Safety
/// Out-pointers must be writable.
#[no_mangle]
pub unsafe extern "C" fn cuMemGetInfo_v2(free: *mut usize, total: *mut usize) -> CuResult {
    guard(|| {
        let drv = driver()?;
        let d = drv.live()?;
        let total_b = drv.config.memory;
        let used = drv.devices[d].used.load(Ordering::SeqCst) + drv.config.context_memory;
        put(free, total_b.saturating_sub(used) as usize)?;
        put(total, total_b as usize)
    })
}

// ---- memory -----------------------------------------------------------------------------------

/// # Safety
/// Out-pointer must be writable.
#[no_mangle]
pub unsafe extern "C" fn cuMemAlloc_v2(ptr: *mut u64, size: usize) -> CuResult {
    guard(|| {
        let drv = driver()?;
        drv.forbid_during_capture()?;
        let d = drv.live()?;
        if size == 0 || ptr.is_null() {
            return Err(INVALID_VALUE);
        }
        let dev = &drv.devices[d];
        let rounded = (size as u64).next_multiple_of(2 << 20); // the driver hands out 2 MiB pages
        let budget = drv.config.memory.saturating_sub(drv.config.context_memory);
        if dev.used.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |u| (u + rounded <= budget).then_some(u + rounded)).is_err() {
            return Err(OUT_OF_MEMORY);
        }
        let mut mem = dev.memory.write().unwrap_or_else(|e| e.into_inner());
        let id = match mem.try_alloc("cuMemAlloc", size) {
            Ok(id) => id,
            Err(e) => {
                dev.used.fetch_sub(rounded, Ordering::SeqCst);
                eprintln!("kiln-cuda-double: GPU {d}: the host cannot back a {size} B allocation: {e}");
                return Err(OUT_OF_MEMORY);
            }
        };
        let addr = mem.addr(id);
        dev.allocs.lock().unwrap_or_else(|e| e.into_inner()).insert(addr, (id, size));
        put(ptr, addr)
    })
}

#[no_mangle]
pub extern "C" fn cuMemFree_v2(ptr: u64) -> CuResult {
    guard(|| {
        let drv = driver()?;
        drv.forbid_during_capture()?;
        drv.live()?;
        if ptr == 0 {
            return Ok(());
        }
        let d = drv.device_of(ptr).ok_or(INVALID_VALUE)?;
        let dev = &drv.devices[d];
        let (id, size) = dev.allocs.lock().unwrap_or_else(|e| e.into_inner()).remove(&ptr).ok_or(INVALID_VALUE)?;
        dev.memory.write().unwrap_or_else(|e| e.into_inner()).free(id);
        dev.used.fetch_sub((size as u64).next_multiple_of(2 << 20), Ordering::SeqCst);
        Ok(())
    })
}

/// # Safety
/// Out-pointer must be writable.
#[no_mangle]
pub unsafe extern "C" fn cuMemHostAlloc(pp: *mut Ptr, size: usize, _flags: c_uint) -> CuResult {
    guard(|| {
        let drv = driver()?;
        drv.forbid_during_capture()?;
        drv.live()?;
        if size == 0 || pp.is_null() {
            return Err(INVALID_VALUE);
        }
        let layout = std::alloc::Layout::from_size_align(size, 4096).map_err(|_| INVALID_VALUE)?;
        let p = std::alloc::alloc_zeroed(layout);
        if p.is_null() {
            return Err(OUT_OF_MEMORY);
        }
        drv.objects().host.insert(p as usize, layout);
        put(pp, p.cast())
    })
}

/// # Safety
/// `p` must come from `cuMemHostAlloc` and not be used afterwards.
#[no_mangle]
pub unsafe extern "C" fn cuMemFreeHost(p: Ptr) -> CuResult {
    guard(|| {
        let drv = driver()?;
        drv.forbid_during_capture()?;
        let layout = drv.objects().host.remove(&(p as usize)).ok_or(INVALID_VALUE)?;
        // SAFETY: allocated by cuMemHostAlloc with this layout.
        unsafe { std::alloc::dealloc(p.cast(), layout) };
        Ok(())
    })
}

fn checked(drv: &Driver, addr: u64, len: usize) -> Result<(), CuResult> {
    drv.range(addr, len).map(|_| ())
}

#[no_mangle]
pub extern "C" fn cuMemsetD8Async(dst: u64, byte: u8, n: usize, stream: Ptr) -> CuResult {
    guard(|| {
        let drv = driver()?;
        checked(drv, dst, n)?;
        drv.submit(stream as u64, Op::Memset { dst, byte, len: n })
    })
}

#[no_mangle]
pub extern "C" fn cuMemsetD8_v2(dst: u64, byte: u8, n: usize) -> CuResult {
    guard(|| {
        let drv = driver()?;
        drv.forbid_during_capture()?;
        checked(drv, dst, n)?;
        drv.submit(0, Op::Memset { dst, byte, len: n })
    })
}

/// # Safety
/// `src` must hold `n` readable bytes until the copy has run.
#[no_mangle]
pub unsafe extern "C" fn cuMemcpyHtoDAsync_v2(dst: u64, src: *const c_void, n: usize, stream: Ptr) -> CuResult {
    guard(|| {
        let drv = driver()?;
        checked(drv, dst, n)?;
        if src.is_null() {
            return Err(INVALID_VALUE);
        }
        drv.submit(stream as u64, Op::HtoD { dst, src: src as usize, len: n })
    })
}

/// # Safety
/// `dst` must hold `n` writable bytes.
#[no_mangle]
pub unsafe extern "C" fn cuMemcpyDtoHAsync_v2(dst: Ptr, src: u64, n: usize, stream: Ptr) -> CuResult {
    guard(|| {
        let drv = driver()?;
        checked(drv, src, n)?;
        if dst.is_null() {
            return Err(INVALID_VALUE);
        }
        drv.submit(stream as u64, Op::DtoH { dst: dst as usize, src, len: n })
    })
}

/// # Safety
/// `src` must hold `n` readable bytes.
#[no_mangle]
pub unsafe extern "C" fn cuMemcpyHtoD_v2(dst: u64, src: *const c_void, n: usize) -> CuResult {
    guard(|| {
        let drv = driver()?;
        drv.forbid_during_capture()?;
        checked(drv, dst, n)?;
        if src.is_null() {
            return Err(INVALID_VALUE);
        }
        drv.submit(0, Op::HtoD { dst, src: src as usize, len: n })?;
        drv.live().map(|_| ())
    })
}

/// # Safety
/// `dst` must hold `n` writable bytes.
#[no_mangle]
pub unsafe extern "C" fn cuMemcpyDtoH_v2(dst: Ptr, src: u64, n: usize) -> CuResult {
    guard(|| {
        let drv = driver()?;
        drv.forbid_during_capture()?;
        checked(drv, src, n)?;
        if dst.is_null() {
            return Err(INVALID_VALUE);
        }
        drv.submit(0, Op::DtoH { dst: dst as usize, src, len: n })?;
        drv.live().map(|_| ())
    })
}

#[no_mangle]
pub extern "C" fn cuMemcpyDtoDAsync_v2(dst: u64, src: u64, n: usize, stream: Ptr) -> CuResult {
    guard(|| {
        let drv = driver()?;
        checked(drv, src, n)?;
        checked(drv, dst, n)?;
        drv.submit(stream as u64, Op::DtoD { dst, src, len: n })
    })
}

#[no_mangle]
pub extern "C" fn cuMemcpyPeerAsync(dst: u64, dst_ctx: Ptr, src: u64, src_ctx: Ptr, n: usize, stream: Ptr) -> CuResult {
    guard(|| {
        let drv = driver()?;
        let (dd, sd) = (ctx_device(dst_ctx)?, ctx_device(src_ctx)?);
        if drv.device_of(dst) != Some(dd) || drv.device_of(src) != Some(sd) {
            return Err(INVALID_VALUE);
        }
        checked(drv, src, n)?;
        checked(drv, dst, n)?;
        drv.submit(stream as u64, Op::DtoD { dst, src, len: n })
    })
}

// ---- streams and events ---------------------------------------------------------------------

/// # Safety
/// Out-pointer must be writable.
#[no_mangle]
pub unsafe extern "C" fn cuStreamCreate(stream: *mut Ptr, _flags: c_uint) -> CuResult {
    guard(|| {
        let drv = driver()?;
        let d = drv.live()?;
        let mut o = drv.objects();
        let h = o.handle();
        o.streams.insert(h, Stream { device: d, capture: None });
        put(stream, h as Ptr)
    })
}

#[no_mangle]
pub extern "C" fn cuStreamDestroy_v2(stream: Ptr) -> CuResult {
    guard(|| {
        let drv = driver()?;
        let mut o = drv.objects();
        match o.streams.get(&(stream as u64)) {
            None => Err(INVALID_HANDLE),
            Some(s) if s.capture.is_some() => Err(STREAM_CAPTURE_UNSUPPORTED),
            Some(_) => {
                o.streams.remove(&(stream as u64));
                Ok(())
            }
        }
    })
}

fn capturing(drv: &Driver, stream: Ptr) -> bool {
    drv.is_capturing(stream as u64)
}

#[no_mangle]
pub extern "C" fn cuStreamSynchronize(stream: Ptr) -> CuResult {
    guard(|| {
        let drv = driver()?;
        let (d, _) = drv.stream_device(stream as u64)?;
        if capturing(drv, stream) {
            drv.invalidate(stream as u64);
            return Err(STREAM_CAPTURE_UNSUPPORTED);
        }
        drv.forbid_during_capture()?;
        drv.check_sticky(d)
    })
}

#[no_mangle]
pub extern "C" fn cuStreamQuery(stream: Ptr) -> CuResult {
    guard(|| {
        let drv = driver()?;
        let (d, _) = drv.stream_device(stream as u64)?;
        if capturing(drv, stream) {
            drv.invalidate(stream as u64);
            return Err(STREAM_CAPTURE_UNSUPPORTED);
        }
        drv.check_sticky(d)
    })
}

/// # Safety
/// Out-pointer must be writable.
#[no_mangle]
pub unsafe extern "C" fn cuEventCreate(event: *mut Ptr, flags: c_uint) -> CuResult {
    guard(|| {
        let drv = driver()?;
        let d = drv.live()?;
        let mut o = drv.objects();
        let h = o.handle();
        o.events.insert(h, Event { device: d, timing: flags & 0x2 == 0, recorded: None, captured: false });
        put(event, h as Ptr)
    })
}

#[no_mangle]
pub extern "C" fn cuEventDestroy_v2(event: Ptr) -> CuResult {
    guard(|| driver()?.objects().events.remove(&(event as u64)).map(|_| ()).ok_or(INVALID_HANDLE))
}

#[no_mangle]
pub extern "C" fn cuEventRecord(event: Ptr, stream: Ptr) -> CuResult {
    guard(|| {
        let drv = driver()?;
        let (sd, _) = drv.stream_device(stream as u64)?;
        let ed = drv.objects().events.get(&(event as u64)).map(|e| e.device).ok_or(INVALID_HANDLE)?;
        if ed != sd {
            return Err(INVALID_CONTEXT);
        }
        drv.submit(stream as u64, Op::Record { event: event as u64 })
    })
}

#[no_mangle]
pub extern "C" fn cuEventSynchronize(event: Ptr) -> CuResult {
    guard(|| {
        let drv = driver()?;
        let (d, captured) = drv.objects().events.get(&(event as u64)).map(|e| (e.device, e.captured)).ok_or(INVALID_HANDLE)?;
        if captured {
            return Err(CAPTURED_EVENT);
        }
        drv.forbid_during_capture()?;
        drv.check_sticky(d)
    })
}

#[no_mangle]
pub extern "C" fn cuEventQuery(event: Ptr) -> CuResult {
    guard(|| {
        let drv = driver()?;
        let (d, captured) = drv.objects().events.get(&(event as u64)).map(|e| (e.device, e.captured)).ok_or(INVALID_HANDLE)?;
        if captured {
            return Err(CAPTURED_EVENT);
        }
        drv.check_sticky(d)
    })
}

/// # Safety
/// Out-pointer must be writable.
#[no_mangle]
pub unsafe extern "C" fn cuEventElapsedTime(ms: *mut f32, start: Ptr, end: Ptr) -> CuResult {
    guard(|| {
        let drv = driver()?;
        let o = drv.objects();
        let (a, b) = (o.events.get(&(start as u64)).ok_or(INVALID_HANDLE)?, o.events.get(&(end as u64)).ok_or(INVALID_HANDLE)?);
        if !a.timing || !b.timing {
            return Err(INVALID_HANDLE);
        }
        let (Some(ta), Some(tb)) = (a.recorded, b.recorded) else { return Err(NOT_READY) };
        let v = if tb >= ta { (tb - ta).as_secs_f64() * 1e3 } else { -((ta - tb).as_secs_f64() * 1e3) };
        put(ms, v as f32)
    })
}

#[no_mangle]
pub extern "C" fn cuStreamWaitEvent(stream: Ptr, event: Ptr, _flags: c_uint) -> CuResult {
    guard(|| {
        let drv = driver()?;
        drv.stream_device(stream as u64)?;
        let captured = drv.objects().events.get(&(event as u64)).map(|e| e.captured).ok_or(INVALID_HANDLE)?;
        if capturing(drv, stream) && !captured {
            // A dependency on work outside the capture (all work here completes in order, so
            // an event from the same capture is satisfied by stream order).
            drv.invalidate(stream as u64);
            return Err(STREAM_CAPTURE_ISOLATION);
        }
        Ok(())
    })
}

// ---- modules and launches -------------------------------------------------------------------

fn register(drv: &Driver, m: module::LoadedModule) -> u64 {
    let mut o = drv.objects();
    let h = o.handle();
    o.modules.insert(h, Arc::new(m));
    h
}

/// # Safety
/// `path` must be a NUL-terminated string, the out-pointer writable.
#[no_mangle]
pub unsafe extern "C" fn cuModuleLoad(out: *mut Ptr, path: *const c_char) -> CuResult {
    guard(|| {
        let drv = driver()?;
        let d = drv.live()?;
        if path.is_null() {
            return Err(INVALID_VALUE);
        }
        let p = std::path::PathBuf::from(CStr::from_ptr(path).to_string_lossy().into_owned());
        let m = module::load_file(&drv.config, d, &p)?;
        put(out, register(drv, m) as Ptr)
    })
}

/// # Safety
/// `image` must be NUL-terminated PTX or a cubin/fatbin image; the out-pointer writable.
#[no_mangle]
pub unsafe extern "C" fn cuModuleLoadData(out: *mut Ptr, image: *const c_void) -> CuResult {
    guard(|| {
        let drv = driver()?;
        let d = drv.live()?;
        if image.is_null() {
            return Err(INVALID_VALUE);
        }
        let head = std::slice::from_raw_parts(image as *const u8, 4);
        if head == b"\x7fELF" || head == [0x50, 0xed, 0x55, 0xba] {
            eprintln!("kiln-cuda-double: cuModuleLoadData got a cubin/fatbin image; the double executes PTX, so load cubins by path (cuModuleLoad) with the .ptx beside them");
            return Err(NOT_SUPPORTED);
        }
        let text = CStr::from_ptr(image as *const c_char).to_str().map_err(|_| INVALID_IMAGE)?;
        let m = module::load_ptx(&drv.config, d, text, "<PTX image>")?;
        put(out, register(drv, m) as Ptr)
    })
}

#[no_mangle]
pub extern "C" fn cuModuleUnload(m: Ptr) -> CuResult {
    guard(|| driver()?.objects().modules.remove(&(m as u64)).map(|_| ()).ok_or(INVALID_HANDLE))
}

/// # Safety
/// `name` must be NUL-terminated, the out-pointer writable.
#[no_mangle]
pub unsafe extern "C" fn cuModuleGetFunction(out: *mut Ptr, m: Ptr, name: *const c_char) -> CuResult {
    guard(|| {
        let drv = driver()?;
        if name.is_null() {
            return Err(INVALID_VALUE);
        }
        let module = drv.objects().modules.get(&(m as u64)).cloned().ok_or(INVALID_HANDLE)?;
        let entry = CStr::from_ptr(name).to_string_lossy().into_owned();
        if module.ptx.entry(&entry).is_err() {
            return Err(NOT_FOUND);
        }
        let f = Function { module, entry, max_dynamic_smem: AtomicI32::new(48 * 1024) };
        let mut o = drv.objects();
        let h = o.handle();
        o.functions.insert(h, Arc::new(f));
        put(out, h as Ptr)
    })
}

fn function(drv: &Driver, f: Ptr) -> Result<Arc<Function>, CuResult> {
    drv.objects().functions.get(&(f as u64)).cloned().ok_or(INVALID_HANDLE)
}

/// # Safety
/// Out-pointer must be writable.
#[no_mangle]
pub unsafe extern "C" fn cuFuncGetAttribute(v: *mut c_int, attr: c_int, f: Ptr) -> CuResult {
    guard(|| {
        let drv = driver()?;
        let f = function(drv, f)?;
        let e = f.module.ptx.entry(&f.entry).map_err(|_| INVALID_HANDLE)?;
        let (regs, local) = f.module.resources.get(&f.entry).copied().unwrap_or((0, 0));
        let value = match attr {
            0 => match e.maxntid {
                Some(m) => (m[0] * m[1] * m[2]) as i32,
                None if regs > 0 => (65536 / regs.max(1)).min(1024) / 32 * 32,
                None => 1024,
            },
            1 => e.shared_static as i32,
            2 => 0,
            3 => local,
            4 => regs,
            5 | 6 => f.module.virtual_arch,
            8 => f.max_dynamic_smem.load(Ordering::SeqCst),
            _ => return Err(INVALID_VALUE),
        };
        put(v, value)
    })
}

#[no_mangle]
pub extern "C" fn cuFuncSetAttribute(f: Ptr, attr: c_int, value: c_int) -> CuResult {
    guard(|| {
        let drv = driver()?;
        let f = function(drv, f)?;
        match attr {
            8 => {
                let e = f.module.ptx.entry(&f.entry).map_err(|_| INVALID_HANDLE)?;
                if value < 0 || value as i64 + e.shared_static as i64 > drv.config.smem_optin as i64 {
                    return Err(INVALID_VALUE);
                }
                f.max_dynamic_smem.store(value, Ordering::SeqCst);
                Ok(())
            }
            9 => Ok(()), // carve-out preference
            _ => Err(INVALID_VALUE),
        }
    })
}

const LAUNCH_PARAM_END: usize = 0;
const LAUNCH_PARAM_BUFFER_POINTER: usize = 1;
const LAUNCH_PARAM_BUFFER_SIZE: usize = 2;

/// Marshals the `.param` space from `kernelParams` (one pointer per parameter, each read for
/// the parameter's size) or from `extra` (a buffer whose size must equal the space's).
unsafe fn marshal(e: &kiln_emu::Entry, params: *mut Ptr, extra: *mut Ptr) -> Result<Vec<u8>, CuResult> {
    let mut space = vec![0u8; e.param_bytes];
    match (params.is_null(), extra.is_null()) {
        (false, true) => {
            for (i, p) in e.params.iter().enumerate() {
                let ptr = read_host(params.add(i) as *const c_void, 8).map(|b| u64::from_le_bytes(b.try_into().expect("8 bytes")) as *const c_void).ok_or(INVALID_VALUE)?;
                let bytes = read_host(ptr, p.size).ok_or_else(|| {
                    eprintln!("kiln-cuda-double: launch of {}: kernelParams[{i}] ({}) is not a readable pointer to {} B (the kernel takes {} parameters)", e.name, p.name, p.size, e.params.len());
                    INVALID_VALUE
                })?;
                space[p.offset..p.offset + p.size].copy_from_slice(&bytes);
            }
        }
        (true, false) => {
            let (mut buf, mut size) = (std::ptr::null::<c_void>(), None::<usize>);
            let mut i = 0;
            loop {
                let key = *extra.add(i) as usize;
                match key {
                    LAUNCH_PARAM_END => break,
                    LAUNCH_PARAM_BUFFER_POINTER => buf = *extra.add(i + 1),
                    LAUNCH_PARAM_BUFFER_SIZE => size = Some(*(*extra.add(i + 1) as *const usize)),
                    _ => return Err(INVALID_VALUE),
                }
                i += 2;
            }
            if size != Some(e.param_bytes) {
                eprintln!("kiln-cuda-double: launch of {}: extra gives {size:?} B of parameters, the kernel's .param space is {} B", e.name, e.param_bytes);
                return Err(INVALID_VALUE);
            }
            space = read_host(buf, e.param_bytes).ok_or(INVALID_VALUE)?;
        }
        (true, true) if e.params.is_empty() => {}
        _ => return Err(INVALID_VALUE),
    }
    Ok(space)
}

/// # Safety
/// `params` must hold one readable pointer per kernel parameter (or be NULL with `extra`), as
/// the driver requires; the double checks each before reading it.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn cuLaunchKernel(f: Ptr, gx: c_uint, gy: c_uint, gz: c_uint, bx: c_uint, by: c_uint, bz: c_uint, smem: c_uint, stream: Ptr, params: *mut Ptr, extra: *mut Ptr) -> CuResult {
    guard(|| {
        let drv = driver()?;
        let d = drv.live()?;
        let func = function(drv, f)?;
        if func.module.device != d {
            return Err(INVALID_HANDLE);
        }
        let e = func.module.ptx.entry(&func.entry).map_err(|_| INVALID_HANDLE)?;
        let space = marshal(e, params, extra)?;
        let (grid, block) = ([gx, gy, gz], [bx, by, bz]);
        let threads = bx as u64 * by as u64 * bz as u64;
        let refuse = |code: CuResult, why: String| {
            eprintln!("kiln-cuda-double: launch of {} refused: {why}", func.entry);
            Err(code)
        };
        if grid.contains(&0) || block.contains(&0) || gx > i32::MAX as u32 || gy > 65535 || gz > 65535 || bx > 1024 || by > 1024 || bz > 64 || threads > 1024 {
            return refuse(INVALID_VALUE, format!("grid {grid:?} / block {block:?} outside the limits"));
        }
        let max_dynamic = func.max_dynamic_smem.load(Ordering::SeqCst);
        if smem as i32 > max_dynamic || e.shared_static as u64 + smem as u64 > drv.config.smem_optin as u64 {
            return refuse(
                INVALID_VALUE,
                format!("{smem} B dynamic + {} B static shared memory (dynamic limit {max_dynamic} B, per block {} B)", e.shared_static, drv.config.smem_optin),
            );
        }
        if let Some(&(regs, _)) = func.module.resources.get(&func.entry) {
            if regs as u64 * threads.next_multiple_of(32) > 65536 {
                return refuse(LAUNCH_OUT_OF_RESOURCES, format!("{regs} registers x {threads} threads exceed the 65536 of an SM"));
            }
        }
        drv.submit(stream as u64, Op::Launch { func, grid, block, smem, params: space })
    })
}

// ---- stream capture and graphs --------------------------------------------------------------

#[no_mangle]
pub extern "C" fn cuStreamBeginCapture_v2(stream: Ptr, mode: c_uint) -> CuResult {
    guard(|| {
        let drv = driver()?;
        drv.live()?;
        if mode > 2 {
            return Err(INVALID_VALUE);
        }
        let mut o = drv.objects();
        // The legacy / per-thread default streams cannot be captured.
        let s = o.streams.get_mut(&(stream as u64)).ok_or(STREAM_CAPTURE_UNSUPPORTED)?;
        if s.capture.is_some() {
            return Err(ILLEGAL_STATE);
        }
        s.capture = Some(Capture { mode, thread: std::thread::current().id(), ops: Vec::new(), invalidated: false });
        Ok(())
    })
}

/// # Safety
/// Out-pointer must be writable.
#[no_mangle]
pub unsafe extern "C" fn cuStreamIsCapturing(stream: Ptr, status: *mut c_uint) -> CuResult {
    guard(|| {
        let drv = driver()?;
        drv.stream_device(stream as u64)?;
        let o = drv.objects();
        let v = match o.streams.get(&(stream as u64)).and_then(|s| s.capture.as_ref()) {
            None => 0,
            Some(c) if c.invalidated => 2,
            Some(_) => 1,
        };
        put(status, v)
    })
}

/// # Safety
/// Out-pointer must be writable.
#[no_mangle]
pub unsafe extern "C" fn cuStreamEndCapture(stream: Ptr, graph: *mut Ptr) -> CuResult {
    guard(|| {
        let drv = driver()?;
        if graph.is_null() {
            return Err(INVALID_VALUE);
        }
        let mut o = drv.objects();
        let s = o.streams.get_mut(&(stream as u64)).ok_or(ILLEGAL_STATE)?;
        let c = s.capture.as_ref().ok_or(ILLEGAL_STATE)?;
        if c.mode != driver::CAPTURE_MODE_RELAXED && c.thread != std::thread::current().id() {
            return Err(STREAM_CAPTURE_WRONG_THREAD);
        }
        let device = s.device;
        let c = s.capture.take().expect("checked");
        if c.invalidated {
            *graph = std::ptr::null_mut();
            return Err(STREAM_CAPTURE_INVALIDATED);
        }
        let h = o.handle();
        o.graphs.insert(h, Graph { device, ops: Arc::new(c.ops) });
        *graph = h as Ptr;
        Ok(())
    })
}

/// # Safety
/// Out-pointer must be writable.
#[no_mangle]
pub unsafe extern "C" fn cuGraphInstantiateWithFlags(exec: *mut Ptr, graph: Ptr, _flags: u64) -> CuResult {
    guard(|| {
        let drv = driver()?;
        let mut o = drv.objects();
        let g = o.graphs.get(&(graph as u64)).ok_or(INVALID_VALUE)?;
        let instance = Graph { device: g.device, ops: g.ops.clone() };
        let h = o.handle();
        o.execs.insert(h, instance);
        put(exec, h as Ptr)
    })
}

fn exec_on(drv: &Driver, exec: Ptr, stream: Ptr) -> Result<(usize, Arc<Vec<Op>>), CuResult> {
    let d = drv.live()?;
    let (sd, _) = drv.stream_device(stream as u64)?;
    let o = drv.objects();
    let g = o.execs.get(&(exec as u64)).ok_or(INVALID_HANDLE)?;
    if g.device != d || sd != d {
        return Err(INVALID_CONTEXT);
    }
    Ok((d, g.ops.clone()))
}

#[no_mangle]
pub extern "C" fn cuGraphUpload(exec: Ptr, stream: Ptr) -> CuResult {
    guard(|| exec_on(driver()?, exec, stream).map(|_| ()))
}

#[no_mangle]
pub extern "C" fn cuGraphLaunch(exec: Ptr, stream: Ptr) -> CuResult {
    guard(|| {
        let drv = driver()?;
        let (d, ops) = exec_on(drv, exec, stream)?;
        if capturing(drv, stream) {
            eprintln!("kiln-cuda-double: launching a graph into a capture (child graphs) is not supported by the double");
            return Err(NOT_SUPPORTED);
        }
        for op in ops.iter() {
            drv.execute(d, op)?;
            if drv.check_sticky(d).is_err() {
                break; // the fault surfaces at the next call, as after an asynchronous launch
            }
        }
        Ok(())
    })
}

#[no_mangle]
pub extern "C" fn cuGraphExecDestroy(exec: Ptr) -> CuResult {
    guard(|| driver()?.objects().execs.remove(&(exec as u64)).map(|_| ()).ok_or(INVALID_VALUE))
}

#[no_mangle]
pub extern "C" fn cuGraphDestroy(graph: Ptr) -> CuResult {
    guard(|| driver()?.objects().graphs.remove(&(graph as u64)).map(|_| ()).ok_or(INVALID_VALUE))
}
