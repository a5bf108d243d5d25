//! Owned driver objects, released in the right order when dropped: a GPU's primary context,
//! a stream, device and pinned host allocations, a module, an instantiated graph. All of one
//! GPU live on that GPU's worker thread (nothing here is Send), which created them.

use super::hardware::cu;
use crate::error::RuntimeError;
use cudarc::driver::{result, sys};
use std::ffi::c_void;

/// The primary context of one GPU, current on the owning thread.
pub struct Context {
    pub device: sys::CUdevice,
    pub ctx: sys::CUcontext,
}

impl Context {
    pub fn open(ordinal: usize) -> Result<Context, RuntimeError> {
        cu(|| "cuInit".into(), result::init())?;
        let device = cu(|| format!("GPU {ordinal}: cuDeviceGet"), result::device::get(ordinal as i32))?;
        // SAFETY: a valid device; released in Drop.
        let ctx = cu(|| format!("GPU {ordinal}: cuDevicePrimaryCtxRetain"), unsafe { result::primary_ctx::retain(device) })?;
        let c = Context { device, ctx };
        c.bind()?;
        Ok(c)
    }

    pub fn bind(&self) -> Result<(), RuntimeError> {
        // SAFETY: the context is retained.
        cu(|| "cuCtxSetCurrent".into(), unsafe { result::ctx::set_current(self.ctx) })
    }

    /// (free, total) bytes of the GPU.
    pub fn memory(&self) -> Result<(u64, u64), RuntimeError> {
        let (free, total) = cu(|| "cuMemGetInfo".into(), result::mem_get_info())?;
        Ok((free as u64, total as u64))
    }
}

impl Drop for Context {
    fn drop(&mut self) {
        // SAFETY: retained in `open`; everything allocated in it was dropped before.
        let _ = unsafe { result::primary_ctx::release(self.device) };
    }
}

/// A non-blocking stream (capturable, unlike the legacy default stream).
pub struct Stream(pub sys::CUstream);

impl Stream {
    pub fn new() -> Result<Stream, RuntimeError> {
        cu(|| "cuStreamCreate".into(), result::stream::create(result::stream::StreamKind::NonBlocking)).map(Stream)
    }

    pub fn sync(&self) -> Result<(), RuntimeError> {
        // SAFETY: a live stream.
        cu(|| "cuStreamSynchronize".into(), unsafe { result::stream::synchronize(self.0) })
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        // SAFETY: created in `new`.
        let _ = unsafe { result::stream::destroy(self.0) };
    }
}

/// One device allocation (`cuMemAlloc`), zeroed.
pub struct DeviceBuffer {
    pub ptr: u64,
    pub bytes: u64,
}

impl DeviceBuffer {
    pub fn zeroed(bytes: u64, what: &str) -> Result<DeviceBuffer, RuntimeError> {
        let n = bytes.max(4) as usize;
        // SAFETY: plain allocation, freed in Drop.
        let ptr = cu(|| format!("allocating the {what} ({bytes} B)"), unsafe { result::malloc_sync(n) })?;
        let b = DeviceBuffer { ptr, bytes: n as u64 };
        // SAFETY: the whole allocation.
        cu(|| format!("zeroing the {what}"), unsafe { result::memset_d8_sync(ptr, 0, n) })?;
        Ok(b)
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        // SAFETY: allocated in `zeroed`, not freed elsewhere.
        let _ = unsafe { result::free_sync(self.ptr) };
    }
}

/// Page-locked host memory (`cuMemHostAlloc`). Write-combined suits host-to-device staging
/// (the CPU only writes it); readback buffers must not be write-combined (CPU reads of such
/// memory are very slow).
pub struct Pinned {
    pub ptr: *mut u8,
    pub len: usize,
}

pub const WRITE_COMBINED: u32 = 0x4;

/// The mapping of the weight upload's pinned staging: write-combined (the default: the CPU only
/// writes it) or cached, with `KILN_UPLOAD_STAGING=cached`. On an H200 VM the upload through
/// write-combined staging ran at ~0.9 GB/s; a VM may map it uncached, which this lets a GPU
/// check compare. Returns (cuMemHostAlloc flags, name).
pub fn upload_staging() -> Result<(u32, &'static str), RuntimeError> {
    match std::env::var("KILN_UPLOAD_STAGING").as_deref() {
        Err(_) | Ok("write-combined") => Ok((WRITE_COMBINED, "write-combined")),
        Ok("cached") => Ok((0, "cached")),
        Ok(other) => Err(RuntimeError::Input {
            what: "KILN_UPLOAD_STAGING".into(),
            message: format!("{other:?}: use write-combined (the default) or cached"),
        }),
    }
}

impl Pinned {
    pub fn new(len: usize, flags: u32) -> Result<Pinned, RuntimeError> {
        // SAFETY: freed in Drop.
        let ptr = cu(|| format!("allocating {len} B of pinned host memory"), unsafe { result::malloc_host(len.max(1), flags) })? as *mut u8;
        Ok(Pinned { ptr, len: len.max(1) })
    }

    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: `len` bytes owned by this buffer; no copy into or out of it is in flight
        // (callers synchronise before touching it).
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }

    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: as above.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}

impl Drop for Pinned {
    fn drop(&mut self) {
        // SAFETY: allocated in `new`.
        let _ = unsafe { result::free_host(self.ptr as *mut c_void) };
    }
}

pub struct Module(pub sys::CUmodule);

impl Drop for Module {
    fn drop(&mut self) {
        // SAFETY: loaded by the owner; its functions are not used after this.
        let _ = unsafe { result::module::unload(self.0) };
    }
}

/// A captured and instantiated graph.
pub struct Graph {
    pub graph: sys::CUgraph,
    pub exec: sys::CUgraphExec,
}

impl Drop for Graph {
    fn drop(&mut self) {
        // SAFETY: created by the owner's capture; not launched any more.
        unsafe {
            let _ = result::graph::exec_destroy(self.exec);
            let _ = result::graph::destroy(self.graph);
        }
    }
}

/// An event for timing.
pub struct Event(pub sys::CUevent);

impl Event {
    pub fn new() -> Result<Event, RuntimeError> {
        cu(|| "cuEventCreate".into(), result::event::create(sys::CUevent_flags::CU_EVENT_DEFAULT)).map(Event)
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        // SAFETY: created in `new`.
        let _ = unsafe { result::event::destroy(self.0) };
    }
}
