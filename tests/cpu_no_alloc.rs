//! Steady-state decode of the CPU backend allocates nothing (its own test binary: the counting
//! allocator sees every thread of the process, so no other test may run beside it).

use kiln_runtime::session::{DecodeRow, LogitRows, Runner, SessionOptions};
use std::path::{Path, PathBuf};
use std::process::Command;

fn compile_tiny_tp2() -> PathBuf {
    let root = std::env::temp_dir().join(format!("kiln-cpu-noalloc-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    let (ckpt, art) = (root.join("ckpt"), root.join("tp2"));
    let run = |args: &[&str]| {
        let o = Command::new(env!("CARGO_BIN_EXE_kiln")).args(args).output().unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    };
    let s = |p: &Path| p.to_str().unwrap().to_string();
    run(&["synth", "tiny", "-o", &s(&ckpt)]);
    run(&["compile", &s(&ckpt), "--target", "cpu", "--tp", "2", "-o", &s(&art)]);
    art
}

fn prompt(n: usize, salt: u32) -> Vec<u32> {
    (0..n as u32).map(|i| (i * 37 + salt * 101 + 11) % 320).collect()
}

/// After warm-up steps, further decode steps of the runner (two simulated ranks, bf16 storage,
/// W4A4) make no heap allocation of their own on any thread. What remains is rayon's job queue:
/// handing one replay to the worker pool enqueues one job, and its global queue allocates a block
/// per 63 jobs. So 63 steps may allocate once or twice, never once per step.
#[test]
fn steady_state_decode_does_not_allocate() {
    let art = compile_tiny_tp2();
    let mut runner = Runner::open(&art, None, SessionOptions::default()).unwrap();
    let pages = [0u32, 1];
    let ids = prompt(100, 11);
    runner.prefill(&pages, 0, &ids[..4], LogitRows::Last).unwrap();
    for (pos, &token) in ids.iter().enumerate().take(8).skip(4) {
        runner.decode(&[DecodeRow { pages: &pages, pos, token }]).unwrap();
    }
    let before = counting::allocations();
    for (pos, &token) in ids.iter().enumerate().take(71).skip(8) {
        runner.decode(&[DecodeRow { pages: &pages, pos, token }]).unwrap();
    }
    let n = counting::allocations() - before;
    assert!(n <= 2, "{n} allocations in 63 decode steps");
}

mod counting {
    use std::alloc::{GlobalAlloc, Layout, System};
    use std::sync::atomic::{AtomicUsize, Ordering};

    static ALLOCATIONS: AtomicUsize = AtomicUsize::new(0);

    /// Counts every allocation of the test process.
    struct Counting;

    unsafe impl GlobalAlloc for Counting {
        unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
            ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
            unsafe { System.alloc(layout) }
        }
        unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
            unsafe { System.dealloc(ptr, layout) }
        }
        unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
            ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
            unsafe { System.realloc(ptr, layout, new_size) }
        }
    }

    #[global_allocator]
    static GLOBAL: Counting = Counting;

    pub fn allocations() -> usize {
        ALLOCATIONS.load(Ordering::SeqCst)
    }
}

