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

fn capturing(drv: &Driver, stream: Ptr) -> bool {
    drv.is_capturing(stream as u64)
}

fn ctx_device(ctx: Ptr) -> Result<usize, CuResult> {
    let drv = driver()?;
    let v = (ctx as u64).checked_sub(CONTEXT_TAG).ok_or(INVALID_CONTEXT)? as usize;
    (v < drv.devices.len()).then_some(v).ok_or(INVALID_CONTEXT)
}

mod context;
mod device;
mod graph;
mod init;
mod launch;
mod memory;
mod stream;

pub use self::context::*;
pub use self::device::*;
pub use self::graph::*;
pub use self::init::*;
pub use self::launch::*;
pub use self::memory::*;
pub use self::stream::*;
