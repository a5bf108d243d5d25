//! Modules, functions and their attributes, and kernel launches with parameters decoded by the entry's `.param` list.

use super::*;

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
