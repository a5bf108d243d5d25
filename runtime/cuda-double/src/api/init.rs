//! `cuInit`, the driver version and error strings.

use super::*;

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
