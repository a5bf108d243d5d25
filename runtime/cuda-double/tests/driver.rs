//! The double fails where the driver fails: kernel parameters decoded by the entry's `.param`
//! list (a missing one is an error, a shifted one faults the kernel), out-of-bounds accesses
//! fail the context for good (until it is destroyed), stream capture refuses synchronous work
//! and replays the argument values it captured, allocations count against the GPU's memory
//! while being backed lazily, cubins must match the GPU, and NCCL collectives rendezvous and
//! reduce in rank order. Expectations come from the CUDA driver API documentation (error codes
//! and capture rules) and from sums computed here in rank order.

use kiln_cuda_double::api::*;
use kiln_cuda_double::nccl::*;
use kiln_cuda_double::status::*;
use std::ffi::{c_void, CString};
use std::ptr::null_mut;
use std::sync::Mutex;

/// The driver is one per process: tests take turns.
static SERIAL: Mutex<()> = Mutex::new(());

type P = *mut c_void;

const ADD_ONE: &str = r#"
.version 8.7
.target sm_120a
.address_size 64
.visible .entry add_one(.param .u64 p, .param .u32 n)
{
  .reg .pred %p<2>; .reg .u64 %rd<4>; .reg .u32 %r<3>; .reg .f32 %f<3>;
  ld.param.u64 %rd1, [p];
  ld.param.u32 %r2, [n];
  mov.u32 %r1, %tid.x;
  setp.ge.u32 %p1, %r1, %r2;
  @%p1 bra DONE;
  cvta.to.global.u64 %rd2, %rd1;
  mul.wide.u32 %rd3, %r1, 4;
  add.u64 %rd2, %rd2, %rd3;
  ld.global.f32 %f1, [%rd2];
  add.f32 %f2, %f1, 0f3F800000;
  st.global.f32 [%rd2], %f2;
DONE:
  ret;
}
"#;

struct Gpu {
    dev: i32,
    stream: P,
    f: P,
}

fn ok(r: CuResult) {
    assert_eq!(r, SUCCESS, "driver call failed: {r}");
}

fn open(dev: i32) -> Gpu {
    ok(cuInit(0));
    let mut ctx: P = null_mut();
    unsafe {
        ok(cuDevicePrimaryCtxRetain(&mut ctx, dev));
        ok(cuCtxSetCurrent(ctx));
        let mut stream: P = null_mut();
        ok(cuStreamCreate(&mut stream, 1));
        let src = CString::new(ADD_ONE).unwrap();
        let mut module: P = null_mut();
        ok(cuModuleLoadData(&mut module, src.as_ptr() as *const c_void));
        let mut f: P = null_mut();
        ok(cuModuleGetFunction(&mut f, module, c"add_one".as_ptr()));
        Gpu { dev, stream, f }
    }
}

impl Drop for Gpu {
    fn drop(&mut self) {
        cuStreamDestroy_v2(self.stream);
        cuDevicePrimaryCtxRelease_v2(self.dev);
    }
}

fn alloc_floats(values: &[f32]) -> u64 {
    let mut p = 0u64;
    unsafe {
        ok(cuMemAlloc_v2(&mut p, values.len() * 4));
        ok(cuMemcpyHtoD_v2(p, values.as_ptr() as *const c_void, values.len() * 4));
    }
    p
}

fn read_floats(p: u64, n: usize) -> Vec<f32> {
    let mut out = vec![0f32; n];
    unsafe { ok(cuMemcpyDtoH_v2(out.as_mut_ptr() as P, p, n * 4)) };
    out
}

fn launch(g: &Gpu, params: &mut [P]) -> CuResult {
    unsafe { cuLaunchKernel(g.f, 1, 1, 1, 256, 1, 1, 0, g.stream, params.as_mut_ptr(), null_mut()) }
}

#[test]
fn kernel_parameters_are_decoded_by_the_param_list() {
    let _s = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let g = open(0);
    let x: Vec<f32> = (0..256).map(|i| i as f32).collect();
    let mut p = alloc_floats(&x);
    let mut n = 100u32;
    ok(launch(&g, &mut [&mut p as *mut u64 as P, &mut n as *mut u32 as P]));
    ok(cuStreamSynchronize(g.stream));
    let y = read_floats(p, 256);
    assert!((0..256).all(|i| y[i] == if i < 100 { x[i] + 1.0 } else { x[i] }));
    // One parameter short (the array ends in NULL): refused before anything runs.
    assert_eq!(launch(&g, &mut [&mut p as *mut u64 as P, null_mut()]), INVALID_VALUE);
    // A `extra` parameter buffer of the wrong size is refused too.
    let mut buf = [0u8; 12];
    let mut size = 8usize;
    let mut extra: [P; 5] = [1 as P, buf.as_mut_ptr() as P, 2 as P, &mut size as *mut usize as P, null_mut()];
    assert_eq!(unsafe { cuLaunchKernel(g.f, 1, 1, 1, 256, 1, 1, 0, g.stream, null_mut(), extra.as_mut_ptr()) }, INVALID_VALUE);
    // More threads than a block may have.
    assert_eq!(unsafe { cuLaunchKernel(g.f, 1, 1, 1, 2048, 1, 1, 0, g.stream, [&mut p as *mut u64 as P, &mut n as *mut u32 as P].as_mut_ptr(), null_mut()) }, INVALID_VALUE);
    assert_eq!(read_floats(p, 256), y, "refused launches ran nothing");
    ok(cuMemFree_v2(p));
}

#[test]
fn an_out_of_bounds_write_fails_the_context_until_it_is_destroyed() {
    let _s = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let g = open(1);
    let mut p = alloc_floats(&[0.0; 200]);
    let mut n = 256u32; // threads 200..255 write past the allocation
    // Launches are asynchronous: the launch succeeds, the fault surfaces at the next call.
    ok(launch(&g, &mut [&mut p as *mut u64 as P, &mut n as *mut u32 as P]));
    assert_eq!(cuStreamSynchronize(g.stream), ILLEGAL_ADDRESS);
    let mut q = 0u64;
    assert_eq!(unsafe { cuMemAlloc_v2(&mut q, 1024) }, ILLEGAL_ADDRESS, "the error is sticky");
    assert_eq!(cuCtxSynchronize(), ILLEGAL_ADDRESS);
    drop(g); // releases the primary context: destroyed, error cleared
    let g = open(1);
    let mut p = alloc_floats(&[1.0; 256]);
    let mut n = 256u32;
    ok(launch(&g, &mut [&mut p as *mut u64 as P, &mut n as *mut u32 as P]));
    ok(cuStreamSynchronize(g.stream));
    assert!(read_floats(p, 256).iter().all(|&v| v == 2.0));
}

#[test]
fn capture_refuses_synchronous_work_and_replays_captured_arguments() {
    let _s = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let g = open(2);
    let mut p = alloc_floats(&[0.0; 256]);
    let mut n = 10u32;
    const THREAD_LOCAL: u32 = 1;
    // A synchronous copy during capture is refused and invalidates the capture.
    ok(cuStreamBeginCapture_v2(g.stream, THREAD_LOCAL));
    let host = [5f32; 4];
    assert_eq!(unsafe { cuMemcpyHtoD_v2(p, host.as_ptr() as *const c_void, 16) }, STREAM_CAPTURE_UNSUPPORTED);
    let mut status = 0u32;
    unsafe { ok(cuStreamIsCapturing(g.stream, &mut status)) };
    assert_eq!(status, 2, "CU_STREAM_CAPTURE_STATUS_INVALIDATED");
    let mut graph: P = 1 as P;
    assert_eq!(unsafe { cuStreamEndCapture(g.stream, &mut graph) }, STREAM_CAPTURE_INVALIDATED);
    assert!(graph.is_null());
    // So are allocation and stream synchronisation.
    ok(cuStreamBeginCapture_v2(g.stream, THREAD_LOCAL));
    let mut q = 0u64;
    assert_eq!(unsafe { cuMemAlloc_v2(&mut q, 64) }, STREAM_CAPTURE_UNSUPPORTED);
    assert_eq!(unsafe { cuStreamEndCapture(g.stream, &mut graph) }, STREAM_CAPTURE_INVALIDATED);
    ok(cuStreamBeginCapture_v2(g.stream, THREAD_LOCAL));
    assert_eq!(cuStreamSynchronize(g.stream), STREAM_CAPTURE_UNSUPPORTED);
    assert_eq!(unsafe { cuStreamEndCapture(g.stream, &mut graph) }, STREAM_CAPTURE_INVALIDATED);
    // A valid capture records without running; replays use the argument values captured.
    ok(cuStreamBeginCapture_v2(g.stream, THREAD_LOCAL));
    ok(launch(&g, &mut [&mut p as *mut u64 as P, &mut n as *mut u32 as P]));
    unsafe { ok(cuStreamEndCapture(g.stream, &mut graph)) };
    assert!(read_floats(p, 256).iter().all(|&v| v == 0.0), "capture must not execute");
    n = 200; // changing the host variable after capture changes nothing
    let mut exec: P = null_mut();
    unsafe { ok(cuGraphInstantiateWithFlags(&mut exec, graph, 0)) };
    ok(cuGraphLaunch(exec, g.stream));
    ok(cuGraphLaunch(exec, g.stream));
    ok(cuStreamSynchronize(g.stream));
    let y = read_floats(p, 256);
    assert!((0..256).all(|i| y[i] == if i < 10 { 2.0 } else { 0.0 }), "{y:?}");
    let _ = n;
    ok(cuGraphExecDestroy(exec));
    ok(cuGraphDestroy(graph));
}

#[test]
fn allocations_count_against_the_gpu_and_are_backed_lazily() {
    let _s = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let g = open(3);
    let (mut free, mut total) = (0usize, 0usize);
    unsafe { ok(cuMemGetInfo_v2(&mut free, &mut total)) };
    assert!(free < total, "the context takes some memory");
    // Most of the GPU in one allocation costs nothing until touched.
    let big = free - (1 << 30);
    let mut p = 0u64;
    unsafe { ok(cuMemAlloc_v2(&mut p, big)) };
    let mut q = 0u64;
    assert_eq!(unsafe { cuMemAlloc_v2(&mut q, 2 << 30) }, OUT_OF_MEMORY);
    // Its last bytes are addressable; one byte past them is not.
    let end = p + big as u64 - 16;
    ok(cuMemsetD8Async(end, 7, 16, g.stream));
    let mut back = [0u8; 16];
    unsafe { ok(cuMemcpyDtoH_v2(back.as_mut_ptr() as P, end, 16)) };
    assert_eq!(back, [7; 16]);
    assert_eq!(cuMemsetD8Async(end, 7, 17, g.stream), INVALID_VALUE);
    ok(cuMemFree_v2(p));
    unsafe { ok(cuMemAlloc_v2(&mut q, 2 << 30)) };
    ok(cuMemFree_v2(q));
    assert_eq!(cuMemFree_v2(q), INVALID_VALUE, "a double free is refused");
}

#[test]
fn fresh_allocations_are_not_zeroed() {
    let _s = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let g = open(5);
    // a kernel that adds to a buffer nobody cleared reads what the allocation held: NaN here,
    // where a double handing out zeros would give 1.0 and hide the missing clear
    let mut p = 0u64;
    unsafe { ok(cuMemAlloc_v2(&mut p, 64 * 4)) };
    let (mut addr, mut n) = (p, 64u32);
    let mut params = [&mut addr as *mut u64 as P, &mut n as *mut u32 as P];
    ok(launch(&g, &mut params));
    ok(cuStreamSynchronize(g.stream));
    assert!(read_floats(p, 64).iter().all(|x| x.is_nan()), "an uncleared allocation read as a number");
    // cleared, it reads as zeros
    ok(cuMemsetD8_v2(p, 0, 64 * 4));
    ok(launch(&g, &mut params));
    ok(cuStreamSynchronize(g.stream));
    assert_eq!(read_floats(p, 64), vec![1.0; 64]);
    ok(cuMemFree_v2(p));
    // pinned host memory neither
    let mut h: P = null_mut();
    unsafe { ok(cuMemHostAlloc(&mut h, 4096, 0)) };
    let bytes = unsafe { std::slice::from_raw_parts(h as *const u8, 4096) };
    assert!(bytes.iter().all(|&b| b == POISON), "pinned memory came back cleared");
    unsafe { ok(cuMemFreeHost(h)) };
}

fn ptxas() -> Option<std::path::PathBuf> {
    std::env::var_os("KILN_PTXAS").map(Into::into).filter(|p: &std::path::PathBuf| p.is_file())
}

#[test]
fn cubins_must_match_the_gpu_and_report_ptxas_registers() {
    let _s = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let Some(ptxas) = ptxas() else {
        eprintln!("KILN_PTXAS not set: skipping (scripts/test.sh sets it)");
        return;
    };
    let dir = std::env::temp_dir().join(format!("kiln-double-cubin-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let g = open(4);
    for (arch, expect) in [("sm_120a", SUCCESS), ("sm_90a", NO_BINARY_FOR_GPU)] {
        let ptx = dir.join(format!("k_{arch}.ptx"));
        std::fs::write(&ptx, ADD_ONE.replace("sm_120a", arch)).unwrap();
        let cubin = dir.join(format!("k_{arch}.cubin"));
        let out = std::process::Command::new(&ptxas).args(["-arch", arch, "-v", ptx.to_str().unwrap(), "-o", cubin.to_str().unwrap()]).output().unwrap();
        assert!(out.status.success());
        let log = String::from_utf8_lossy(&out.stderr);
        let regs: i32 = log.split("Used ").nth(1).and_then(|s| s.split_whitespace().next()).and_then(|n| n.parse().ok()).expect("ptxas -v reports registers");
        let path = CString::new(cubin.to_str().unwrap()).unwrap();
        let mut module: P = null_mut();
        assert_eq!(unsafe { cuModuleLoad(&mut module, path.as_ptr()) }, expect, "{arch} cubin on an sm_120a GPU");
        if expect == SUCCESS {
            let mut f: P = null_mut();
            unsafe { ok(cuModuleGetFunction(&mut f, module, c"add_one".as_ptr())) };
            let mut v = 0;
            unsafe { ok(cuFuncGetAttribute(&mut v, 4, f)) };
            assert_eq!(v, regs, "CU_FUNC_ATTRIBUTE_NUM_REGS is what ptxas used");
        }
    }
    // PTX newer than the driver (12.9 supports ISA 8.8) is refused like the driver does.
    let newer = CString::new(ADD_ONE.replace(".version 8.7", ".version 9.0")).unwrap();
    let mut module: P = null_mut();
    assert_eq!(unsafe { cuModuleLoadData(&mut module, newer.as_ptr() as *const c_void) }, UNSUPPORTED_PTX_VERSION);
    drop(g);
    let _ = std::fs::remove_dir_all(&dir);
}

fn bf16(x: f32) -> u16 {
    kiln_emu::formats::f32_to_bf16(x)
}

/// `ranks` threads, one GPU each, all-reduce (in place) and all-gather of rank-specific data.
fn collectives(ranks: usize) {
    let mut id = UniqueId { internal: [0; 128] };
    assert_eq!(unsafe { ncclGetUniqueId(&mut id) }, NCCL_SUCCESS);
    let n = 1000usize;
    let value = |r: usize, i: usize| ((r * 7919 + i * 104729) % 1013) as f32 / 37.0 - 13.0 + 1e-3 * r as f32;
    let threads: Vec<_> = (0..ranks)
        .map(|r| {
            std::thread::spawn(move || {
                let g = open(r as i32);
                let mut comm = 0u64;
                assert_eq!(unsafe { ncclCommInitRank(&mut comm, ranks as i32, id, r as i32) }, NCCL_SUCCESS);
                let mine: Vec<f32> = (0..n).map(|i| value(r, i)).collect();
                let p = alloc_floats(&mine);
                assert_eq!(ncclAllReduce(p as *const c_void, p as P, n, 7, 0, comm, g.stream as u64), NCCL_SUCCESS);
                let summed = read_floats(p, n);
                let halves: Vec<u16> = mine.iter().map(|&v| bf16(v)).collect();
                let mut hb = 0u64;
                unsafe { ok(cuMemAlloc_v2(&mut hb, n * 2)) };
                unsafe { ok(cuMemcpyHtoD_v2(hb, halves.as_ptr() as *const c_void, n * 2)) };
                assert_eq!(ncclAllReduce(hb as *const c_void, hb as P, n, 9, 0, comm, g.stream as u64), NCCL_SUCCESS);
                let mut hsum = vec![0u16; n];
                unsafe { ok(cuMemcpyDtoH_v2(hsum.as_mut_ptr() as P, hb, n * 2)) };
                let mut all = 0u64;
                unsafe { ok(cuMemAlloc_v2(&mut all, n * 4 * ranks)) };
                assert_eq!(ncclAllGather(p as *const c_void, all as P, n, 7, comm, g.stream as u64), NCCL_SUCCESS);
                let gathered = read_floats(all, n * ranks);
                assert_eq!(ncclCommDestroy(comm), NCCL_SUCCESS);
                (summed, hsum, gathered)
            })
        })
        .collect();
    let results: Vec<_> = threads.into_iter().map(|t| t.join().expect("rank thread")).collect();
    let expect: Vec<f32> = (0..n).map(|i| (1..ranks).fold(value(0, i), |a, r| a + value(r, i))).collect();
    let expect_bf16: Vec<u16> = (0..n)
        .map(|i| bf16((1..ranks).fold(kiln_emu::formats::bf16_to_f32(bf16(value(0, i))), |a, r| a + kiln_emu::formats::bf16_to_f32(bf16(value(r, i))))))
        .collect();
    for (summed, hsum, gathered) in &results {
        assert_eq!(summed, &expect, "f32 sums in rank order on every rank");
        assert_eq!(hsum, &expect_bf16, "bf16 summed in f32 in rank order, rounded once");
        // The all-gather saw the summed buffers (the all-reduce was in place).
        assert!(gathered.chunks(n).all(|c| c == expect.as_slice()));
    }
}

#[test]
fn nccl_collectives_reduce_in_rank_order_on_2_and_8_ranks() {
    let _s = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    collectives(2);
    collectives(8);
}

#[test]
fn nccl_fails_instead_of_hanging() {
    let _s = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    // Ranks that disagree about a collective are told so.
    let mut id = UniqueId { internal: [0; 128] };
    assert_eq!(unsafe { ncclGetUniqueId(&mut id) }, NCCL_SUCCESS);
    let threads: Vec<_> = (0..2)
        .map(|r| {
            std::thread::spawn(move || {
                let g = open(r);
                let mut comm = 0u64;
                assert_eq!(unsafe { ncclCommInitRank(&mut comm, 2, id, r) }, NCCL_SUCCESS);
                let p = alloc_floats(&[1.0; 64]);
                let count = if r == 0 { 64 } else { 32 };
                let rc = ncclAllReduce(p as *const c_void, p as P, count, 7, 0, comm, g.stream as u64);
                ncclCommDestroy(comm);
                rc
            })
        })
        .collect();
    for t in threads {
        assert_eq!(t.join().unwrap(), NCCL_INVALID_USAGE);
    }
    // A rank whose peer never joins gives up after the timeout.
    std::env::set_var("KILN_DOUBLE_NCCL_TIMEOUT_S", "0.5");
    let mut id = UniqueId { internal: [0; 128] };
    assert_eq!(unsafe { ncclGetUniqueId(&mut id) }, NCCL_SUCCESS);
    let g = open(0);
    let mut comm = 0u64;
    let started = std::time::Instant::now();
    assert_eq!(unsafe { ncclCommInitRank(&mut comm, 2, id, 0) }, NCCL_SYSTEM_ERROR);
    assert!(started.elapsed() < std::time::Duration::from_secs(10));
    std::env::remove_var("KILN_DOUBLE_NCCL_TIMEOUT_S");
    drop(g);
}
