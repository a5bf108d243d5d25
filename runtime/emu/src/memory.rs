//! Memory spaces: global memory (named buffers at device-like addresses, shared by all blocks
//! and accessed through relaxed atomics so parallel blocks are data-race free), per-block shared
//! memory, and the generic-address window that maps onto shared memory.

use std::sync::atomic::{AtomicU64, Ordering};

/// First global buffer address (device pointers look like this on real GPUs).
pub const GLOBAL_BASE: u64 = 0x7F40_0000_0000;
/// Generic addresses in `[SHARED_WINDOW, SHARED_WINDOW + 4 GiB)` refer to the block's shared memory.
pub const SHARED_WINDOW: u64 = 0x0100_0000_0000;
const SHARED_WINDOW_SIZE: u64 = 1 << 32;
/// Gap between buffers, so running off the end of one never lands in the next.
const GUARD: u64 = 4096;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct BufferId(pub usize);

struct Buffer {
    name: String,
    base: u64,
    len: usize,
    /// None once freed: the address range stays reserved, and any access names the freed buffer.
    words: Option<Words>,
    /// Bytes kernels have loaded from this buffer (for per-buffer traffic reports).
    loaded: AtomicU64,
}

/// A buffer's bytes as 64-bit atomic words in an anonymous mapping reserved without swap
/// accounting, so untouched pages cost no memory: a simulated GPU may hold a 96 GB arena of
/// which a test touches a few megabytes.
struct Words {
    map: memmap2::MmapMut,
    n: usize,
}

impl Words {
    fn zeroed(len: usize) -> Result<Words, String> {
        let n = len.div_ceil(8).max(1);
        let map = memmap2::MmapOptions::new()
            .len(n * 8)
            .no_reserve_swap()
            .map_anon()
            .map_err(|e| format!("cannot map {len} B: {e}"))?;
        Ok(Words { map, n })
    }

    fn get(&self) -> &[AtomicU64] {
        // SAFETY: the mapping is page-aligned, n * 8 bytes long, zero-initialised (a valid
        // AtomicU64 bit pattern) and lives as long as `self`; all access goes through atomics.
        unsafe { std::slice::from_raw_parts(self.map.as_ptr() as *const AtomicU64, self.n) }
    }

    /// Gives whole pages of `[from, to)` (word indices) back to the OS, which refills them with
    /// zeros on the next touch; returns the word range it could not release (page edges).
    fn release_zero(&self, from: usize, to: usize) -> [(usize, usize); 2] {
        const PAGE_WORDS: usize = 4096 / 8;
        let (a, b) = (from.next_multiple_of(PAGE_WORDS), to / PAGE_WORDS * PAGE_WORDS);
        // SAFETY: DONTNEED on a private anonymous mapping only resets the pages to zero; no
        // Rust reference into them outlives this call except the atomics, which read zeros after.
        if b > a && unsafe { self.map.unchecked_advise_range(memmap2::UncheckedAdvice::DontNeed, a * 8, (b - a) * 8) }.is_ok() {
            [(from, a), (b, to)]
        } else {
            [(from, to), (to, to)]
        }
    }
}

/// Device global memory: named buffers with stable addresses.
#[derive(Default)]
pub struct GlobalMemory {
    bufs: Vec<Buffer>,
    next: u64,
    /// Launches run on this memory so far: each launch's warp speeds are permuted by its count
    /// (see the block scheduler's `burst`).
    launches: std::sync::atomic::AtomicU64,
}

impl std::fmt::Debug for GlobalMemory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut l = f.debug_list();
        for b in &self.bufs {
            l.entry(&format_args!("{} @ {:#x} ({} B)", b.name, b.base, b.len));
        }
        l.finish()
    }
}

impl GlobalMemory {
    /// The number of this launch on this memory (0 for the first), counting it.
    pub fn count_launch(&self) -> u64 {
        self.launches.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
    }

    pub fn new() -> Self {
        GlobalMemory { bufs: Vec::new(), next: GLOBAL_BASE, launches: Default::default() }
    }

    /// Buffers start at `base` (distinct simulated GPUs use distinct bases, as unified
    /// addressing gives every device its own range).
    pub fn with_base(base: u64) -> Self {
        GlobalMemory { bufs: Vec::new(), next: base, launches: Default::default() }
    }

    /// A zero-filled buffer of `len` bytes, 256-byte aligned (panics if the host cannot map it:
    /// host-side misuse in tests; see [`GlobalMemory::try_alloc`]).
    pub fn alloc(&mut self, name: &str, len: usize) -> BufferId {
        self.try_alloc(name, len).unwrap_or_else(|e| panic!("buffer '{name}': {e}"))
    }

    /// A zero-filled, lazily backed buffer of `len` bytes, 256-byte aligned.
    pub fn try_alloc(&mut self, name: &str, len: usize) -> Result<BufferId, String> {
        if self.next == 0 {
            self.next = GLOBAL_BASE;
        }
        let base = self.next;
        let words = Words::zeroed(len)?;
        self.next = (base + len as u64 + GUARD).next_multiple_of(256);
        self.bufs.push(Buffer { name: name.to_string(), base, len, words: Some(words), loaded: AtomicU64::new(0) });
        Ok(BufferId(self.bufs.len() - 1))
    }

    /// Releases a buffer's storage; its addresses stay reserved so a later access is reported
    /// as a use after free instead of landing in another buffer.
    pub fn free(&mut self, id: BufferId) {
        self.bufs[id.0].words = None;
    }

    pub fn is_live(&self, id: BufferId) -> bool {
        self.bufs[id.0].words.is_some()
    }

    /// Whether `addr` lies in this memory's address range (its buffers, freed ones and guard
    /// gaps included): two comparisons, so a GPU with peers tells its own accesses apart cheaply.
    pub fn owns(&self, addr: u64) -> bool {
        self.bufs.first().is_some_and(|b| addr >= b.base) && addr < self.next
    }

    /// The live buffer holding address `addr`, and the offset of `addr` in it.
    pub fn buffer_at(&self, addr: u64) -> Option<(BufferId, usize)> {
        let i = self.bufs.partition_point(|b| b.base <= addr);
        let b = self.bufs.get(i.checked_sub(1)?)?;
        let off = addr - b.base;
        (b.words.is_some() && off < b.len as u64).then_some((BufferId(i - 1), off as usize))
    }

    /// Sets `len` bytes from `offset` to `byte` (zero fills of whole pages release the pages).
    pub fn fill(&self, id: BufferId, offset: usize, len: usize, byte: u8) {
        let b = &self.bufs[id.0];
        assert!(offset + len <= b.len, "fill of {len} B at {offset} overflows buffer '{}' ({} B)", b.name, b.len);
        let words = b.words.as_ref().unwrap_or_else(|| panic!("fill of freed buffer '{}'", b.name));
        let (first_full, end_full) = (offset.next_multiple_of(8), (offset + len) / 8 * 8);
        if end_full <= first_full {
            self.write(id, offset, &vec![byte; len]);
            return;
        }
        self.write(id, offset, &vec![byte; first_full - offset]);
        self.write(id, end_full, &vec![byte; offset + len - end_full]);
        let pattern = u64::from_le_bytes([byte; 8]);
        let ranges = if byte == 0 { words.release_zero(first_full / 8, end_full / 8) } else { [(first_full / 8, end_full / 8), (0, 0)] };
        for (a, z) in ranges {
            words.get()[a..z].iter().for_each(|w| w.store(pattern, Ordering::Relaxed));
        }
    }

    /// A buffer holding a copy of `data`.
    pub fn alloc_bytes(&mut self, name: &str, data: &[u8]) -> BufferId {
        let id = self.alloc(name, data.len());
        self.write(id, 0, data);
        id
    }

    pub fn alloc_f32(&mut self, name: &str, data: &[f32]) -> BufferId {
        let bytes: Vec<u8> = data.iter().flat_map(|x| x.to_le_bytes()).collect();
        self.alloc_bytes(name, &bytes)
    }

    pub fn alloc_u32(&mut self, name: &str, data: &[u32]) -> BufferId {
        let bytes: Vec<u8> = data.iter().flat_map(|x| x.to_le_bytes()).collect();
        self.alloc_bytes(name, &bytes)
    }

    pub fn find(&self, name: &str) -> Option<BufferId> {
        self.bufs.iter().position(|b| b.name == name).map(BufferId)
    }

    /// Device address of a buffer (pass it as a `.u64` kernel argument).
    pub fn addr(&self, id: BufferId) -> u64 {
        self.bufs[id.0].base
    }

    pub fn len(&self, id: BufferId) -> usize {
        self.bufs[id.0].len
    }

    /// Bytes kernels have loaded from buffer `id` since it was allocated.
    pub fn bytes_loaded(&self, id: BufferId) -> u64 {
        self.bufs[id.0].loaded.load(Ordering::Relaxed)
    }

    pub fn name(&self, id: BufferId) -> &str {
        &self.bufs[id.0].name
    }

    pub fn is_empty(&self) -> bool {
        self.bufs.is_empty()
    }

    /// Copies `data` into the buffer at byte `offset` (panics if it does not fit or the buffer
    /// was freed: host-side misuse).
    pub fn write(&self, id: BufferId, offset: usize, data: &[u8]) {
        let b = &self.bufs[id.0];
        assert!(offset + data.len() <= b.len, "write of {} B at {offset} overflows buffer '{}' ({} B)", data.len(), b.name, b.len);
        let words = b.host_words();
        let mut p = offset;
        let mut rest = data;
        while !rest.is_empty() {
            let (w, sh) = (&words[p / 8], p % 8);
            let n = (8 - sh).min(rest.len());
            if n == 8 {
                w.store(u64::from_le_bytes(rest[..8].try_into().expect("8 bytes")), Ordering::Relaxed);
            } else {
                let mut bytes = [0u8; 8];
                bytes[sh..sh + n].copy_from_slice(&rest[..n]);
                let m = mask(n as u64) << (sh * 8);
                let v = u64::from_le_bytes(bytes);
                let _ = w.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |old| Some((old & !m) | v));
            }
            p += n;
            rest = &rest[n..];
        }
    }

    pub fn read(&self, id: BufferId) -> Vec<u8> {
        self.read_at(id, 0, self.bufs[id.0].len)
    }

    /// `len` bytes of buffer `id` from byte `offset` (panics outside the buffer: host misuse).
    pub fn read_at(&self, id: BufferId, offset: usize, len: usize) -> Vec<u8> {
        let b = &self.bufs[id.0];
        assert!(offset + len <= b.len, "read of {len} B at {offset} overflows buffer '{}' ({} B)", b.name, b.len);
        let words = b.host_words();
        let (first, last) = (offset / 8, (offset + len).div_ceil(8));
        let mut out: Vec<u8> = words[first..last].iter().flat_map(|w| w.load(Ordering::Relaxed).to_le_bytes()).collect();
        out.drain(..offset - first * 8);
        out.truncate(len);
        out
    }

    pub fn read_f32(&self, id: BufferId) -> Vec<f32> {
        self.read(id).chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
    }

    pub fn read_u32(&self, id: BufferId) -> Vec<u32> {
        self.read(id).chunks_exact(4).map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
    }

    /// The buffer and offset holding `[addr, addr + size)`, or a description of the fault.
    fn locate(&self, addr: u64, size: u64) -> Result<(&[AtomicU64], &Buffer, usize), String> {
        if !matches!(size, 1 | 2 | 4 | 8) || !addr.is_multiple_of(size) {
            return Err(format!("{size}-byte access at {addr:#x} is not a naturally aligned 1/2/4/8-byte access"));
        }
        let i = self.bufs.partition_point(|b| b.base <= addr);
        if i > 0 {
            let b = &self.bufs[i - 1];
            let off = addr - b.base;
            if off.checked_add(size).is_some_and(|e| e <= b.len as u64) {
                return match &b.words {
                    Some(w) => Ok((w.get(), b, off as usize)),
                    None => Err(format!("{size}-byte access at {addr:#x} touches buffer '{}' ({} B at {:#x}), which was freed", b.name, b.len, b.base)),
                };
            }
            if off < b.len as u64 + GUARD {
                return Err(format!("{size}-byte access at {addr:#x} runs past the end of buffer '{}' ({} B at {:#x}, offset {off})", b.name, b.len, b.base));
            }
        }
        Err(format!("address {addr:#x} is not in any global buffer"))
    }

    /// Reads `size` (1, 2, 4 or 8) naturally aligned bytes, little-endian.
    pub fn load(&self, addr: u64, size: u64) -> Result<u64, String> {
        let (words, b, off) = self.locate(addr, size)?;
        b.loaded.fetch_add(size, Ordering::Relaxed);
        let w = words[off / 8].load(Ordering::Relaxed);
        Ok(extract(w, off, size))
    }

    pub fn store(&self, addr: u64, size: u64, v: u64) -> Result<(), String> {
        let (words, _, off) = self.locate(addr, size)?;
        let w = &words[off / 8];
        if size == 8 {
            w.store(v, Ordering::Relaxed);
        } else {
            let sh = (off % 8) * 8;
            let m = mask(size) << sh;
            // Other bytes of the word may be written concurrently by other blocks.
            let _ = w.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |old| Some((old & !m) | ((v << sh) & m)));
        }
        Ok(())
    }

    /// Atomic read-modify-write of a naturally aligned 4- or 8-byte value; returns the old value.
    /// Counted as a load of the buffer (the launch counts it read and written).
    pub fn rmw(&self, addr: u64, size: u64, f: &dyn Fn(u64) -> u64) -> Result<u64, String> {
        let (words, b, off) = self.locate(addr, size)?;
        b.loaded.fetch_add(size, Ordering::Relaxed);
        let w = &words[off / 8];
        let sh = (off % 8) * 8;
        let m = mask(size);
        let mut old_val = 0;
        let _ = w.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |old| {
            old_val = (old >> sh) & m;
            let new = f(old_val) & m;
            Some((old & !(m << sh)) | (new << sh))
        });
        Ok(old_val)
    }
}

impl Buffer {
    /// The words of a live buffer for host-side copies (panics on a freed one: host misuse).
    fn host_words(&self) -> &[AtomicU64] {
        self.words.as_ref().map(Words::get).unwrap_or_else(|| panic!("host access to freed buffer '{}'", self.name))
    }
}

fn mask(size: u64) -> u64 {
    if size >= 8 {
        u64::MAX
    } else {
        (1u64 << (size * 8)) - 1
    }
}

fn extract(w: u64, off: usize, size: u64) -> u64 {
    (w >> ((off % 8) * 8)) & mask(size)
}

/// One block's shared memory (static + dynamic), addressed from 0.
pub struct SharedMemory {
    pub bytes: Vec<u8>,
}

/// What a block finds in shared memory and registers it has not written. The hardware leaves
/// them as earlier blocks did, so a kernel must not read them first; all-ones bytes are NaN as
/// floats, -1 as integers and true as predicates, so such a read shows in the results (zeros
/// would hide a missing clear of an accumulator).
pub const UNWRITTEN: u8 = 0xFF;

impl SharedMemory {
    pub fn new(size: usize) -> Self {
        SharedMemory { bytes: vec![UNWRITTEN; size] }
    }

    fn range(&self, addr: u64, size: u64) -> Result<usize, String> {
        if addr.checked_add(size).is_none_or(|e| e > self.bytes.len() as u64) {
            return Err(format!("{size}-byte shared access at offset {addr:#x} is outside the block's {} B of shared memory", self.bytes.len()));
        }
        Ok(addr as usize)
    }

    pub fn load(&self, addr: u64, size: u64) -> Result<u64, String> {
        let a = self.range(addr, size)?;
        let mut buf = [0u8; 8];
        buf[..size as usize].copy_from_slice(&self.bytes[a..a + size as usize]);
        Ok(u64::from_le_bytes(buf))
    }

    pub fn store(&mut self, addr: u64, size: u64, v: u64) -> Result<(), String> {
        let a = self.range(addr, size)?;
        self.bytes[a..a + size as usize].copy_from_slice(&v.to_le_bytes()[..size as usize]);
        Ok(())
    }
}

/// Where a generic address points.
pub enum Generic {
    Shared(u64),
    Global(u64),
}

pub fn classify(addr: u64) -> Generic {
    if (SHARED_WINDOW..SHARED_WINDOW + SHARED_WINDOW_SIZE).contains(&addr) {
        Generic::Shared(addr - SHARED_WINDOW)
    } else {
        Generic::Global(addr)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_have_stable_addresses_and_bounds() {
        let mut g = GlobalMemory::new();
        let a = g.alloc_bytes("a", &[1, 2, 3, 4, 5]);
        let b = g.alloc("b", 16);
        assert_eq!(g.addr(a), GLOBAL_BASE);
        assert!(g.addr(b) >= g.addr(a) + 5 + GUARD);
        assert_eq!(g.load(g.addr(a) + 2, 2).unwrap(), 0x0403);
        assert!(g.load(g.addr(a) + 1, 2).unwrap_err().contains("not a naturally aligned"));
        assert!(g.load(g.addr(a) + 4, 2).unwrap_err().contains("past the end of buffer 'a'"));
        assert!(g.load(0x10, 4).unwrap_err().contains("not in any global buffer"));
        g.store(g.addr(b) + 4, 4, 0xDEADBEEF).unwrap();
        assert_eq!(g.read_u32(b), vec![0, 0xDEADBEEF, 0, 0]);
        let old = g.rmw(g.addr(b) + 4, 4, &|v| v + 1).unwrap();
        assert_eq!(old, 0xDEADBEEF);
        assert_eq!(g.read_u32(b)[1], 0xDEADBEF0);
        // One 2-byte load from `a` succeeded (the faulting ones load nothing).
        assert_eq!(g.bytes_loaded(a), 2);
    }

    #[test]
    fn huge_buffers_cost_only_touched_pages_and_freed_ones_fault() {
        let mut g = GlobalMemory::with_base(0x5000_0000_0000);
        // 64 GiB: far more than the machine has; only the pages touched below are backed.
        let big = g.try_alloc("arena", 64 << 30).unwrap();
        assert_eq!(g.addr(big), 0x5000_0000_0000);
        let far = (63u64 << 30) + 12;
        g.store(g.addr(big) + far, 4, 7).unwrap();
        assert_eq!(g.buffer_at(g.addr(big) + far), Some((big, far as usize)));
        g.write(big, 5, &[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]);
        assert_eq!(g.read_at(big, 4, 13), vec![0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 0]);
        // A zero fill over whole pages releases them; the edges are cleared byte-exactly.
        g.fill(big, 3, 3 * 4096, 0xAB);
        assert_eq!(g.read_at(big, 2, 3), vec![0, 0xAB, 0xAB]);
        assert_eq!(g.read_at(big, 3 * 4096 + 2, 2), vec![0xAB, 0]);
        g.fill(big, 1, 3 * 4096 + 2, 0);
        assert!(g.read_at(big, 0, 3 * 4096 + 4).iter().all(|&b| b == 0));
        let small = g.alloc("small", 8);
        g.free(big);
        assert!(g.load(g.addr(big) + far, 4).unwrap_err().contains("which was freed"));
        assert_eq!(g.buffer_at(g.addr(big)), None);
        assert!(g.is_live(small) && !g.is_live(big));
    }
}
