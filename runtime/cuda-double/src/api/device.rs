//! Device queries: count, name, UUID, PCI address, attributes, memory, peer capability.

use super::*;

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
