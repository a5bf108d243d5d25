//! Per-thread scratch space for kernels that run inside rayon tasks: grown on first use, then
//! reused, so steady-state decode allocates nothing. Kernels take one slice per call and split
//! it; they must not call back into rayon while holding it.

use std::cell::RefCell;

thread_local! {
    static F32: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
    static PAIRS: RefCell<Vec<(f32, u32)>> = const { RefCell::new(Vec::new()) };
}

/// Grows this thread's scratch to the given sizes (called on every worker when a backend starts,
/// so no kernel allocates on its first call on some thread later).
pub(crate) fn reserve(f32s: usize, pairs: usize) {
    with_f32(f32s, |_| ());
    with_pairs(pairs, |_| ());
}

/// Runs `f` with this thread's f32 scratch of at least `len` values (contents unspecified).
pub(crate) fn with_f32<R>(len: usize, f: impl FnOnce(&mut [f32]) -> R) -> R {
    F32.with(|cell| {
        let mut v = cell.borrow_mut();
        if v.len() < len {
            v.resize(len, 0.0);
        }
        f(&mut v[..len])
    })
}

/// Runs `f` with this thread's (score, index) scratch of at least `len` entries.
pub(crate) fn with_pairs<R>(len: usize, f: impl FnOnce(&mut [(f32, u32)]) -> R) -> R {
    PAIRS.with(|cell| {
        let mut v = cell.borrow_mut();
        if v.len() < len {
            v.resize(len, (0.0, 0));
        }
        f(&mut v[..len])
    })
}

/// Grows `v` to at least `len` (never shrinks) and returns its first `len` values.
pub(crate) fn grow(v: &mut Vec<f32>, len: usize) -> &mut [f32] {
    if v.len() < len {
        v.resize(len, 0.0);
    }
    &mut v[..len]
}
