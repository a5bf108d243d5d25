//! Stream capture (the rules that make a capture fail) and graphs (replays run the recorded operations with the values captured).

use super::*;

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
