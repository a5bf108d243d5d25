//! Device and pinned host allocations, memsets and copies (each range must lie in one live allocation).

use super::*;

/// The byte a fresh allocation holds, device (`cuMemAlloc`, up to [`POISON_MAX_BYTES`]) or
/// pinned host (`cuMemHostAlloc`): the driver promises nothing about it (a GPU hands out what the
/// last owner left), and all-ones bytes are NaN as floats and never a zero counter, so a missing
/// clear shows as it would on hardware instead of passing on zeros.
pub const POISON: u8 = 0xFF;

/// Device allocations up to this size are filled with [`POISON`]; larger ones (weight arenas,
/// KV caches) are backed lazily and read as zeros until written, since filling them would make
/// the host hold every page of a simulated 96 GB GPU.
pub const POISON_MAX_BYTES: usize = 64 << 20;

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
        // the driver does not clear what it hands out: a buffer that is read before it is
        // written must fail here as on a GPU (see `POISON`)
        if size <= POISON_MAX_BYTES {
            mem.fill(id, 0, size, POISON);
        }
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
        let p = std::alloc::alloc(layout);
        if p.is_null() {
            return Err(OUT_OF_MEMORY);
        }
        p.write_bytes(POISON, size);
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
    // The synchronous copy: the asynchronous one on the legacy stream, refused during capture.
    guard(|| {
        let drv = driver()?;
        drv.forbid_during_capture()?;
        match cuMemcpyHtoDAsync_v2(dst, src, n, std::ptr::null_mut()) {
            SUCCESS => drv.live().map(|_| ()),
            e => Err(e),
        }
    })
}

/// # Safety
/// `dst` must hold `n` writable bytes.
#[no_mangle]
pub unsafe extern "C" fn cuMemcpyDtoH_v2(dst: Ptr, src: u64, n: usize) -> CuResult {
    guard(|| {
        let drv = driver()?;
        drv.forbid_during_capture()?;
        match cuMemcpyDtoHAsync_v2(dst, src, n, std::ptr::null_mut()) {
            SUCCESS => drv.live().map(|_| ()),
            e => Err(e),
        }
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
