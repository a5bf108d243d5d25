//! Primary contexts (retain, release = destroy with everything in it), the current context, synchronisation, peer access, free memory.

use super::*;

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
