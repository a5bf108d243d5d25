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
    words: Box<[AtomicU64]>,
    /// Bytes kernels have loaded from this buffer (for per-buffer traffic reports).
    loaded: AtomicU64,
}

/// Device global memory: named buffers with stable addresses.
#[derive(Default)]
pub struct GlobalMemory {
    bufs: Vec<Buffer>,
    next: u64,
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
    pub fn new() -> Self {
        GlobalMemory { bufs: Vec::new(), next: GLOBAL_BASE }
    }

    /// A zero-filled buffer of `len` bytes, 256-byte aligned.
    pub fn alloc(&mut self, name: &str, len: usize) -> BufferId {
        if self.next == 0 {
            self.next = GLOBAL_BASE;
        }
        let base = self.next;
        let words = (0..len.div_ceil(8)).map(|_| AtomicU64::new(0)).collect::<Vec<_>>().into_boxed_slice();
        self.next = (base + len as u64 + GUARD).next_multiple_of(256);
        self.bufs.push(Buffer { name: name.to_string(), base, len, words, loaded: AtomicU64::new(0) });
        BufferId(self.bufs.len() - 1)
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

    /// Copies `data` into the buffer at byte `offset` (panics if it does not fit: host-side misuse).
    pub fn write(&mut self, id: BufferId, offset: usize, data: &[u8]) {
        let b = &self.bufs[id.0];
        assert!(offset + data.len() <= b.len, "write of {} B at {offset} overflows buffer '{}' ({} B)", data.len(), b.name, b.len);
        for (i, &byte) in data.iter().enumerate() {
            let p = offset + i;
            let w = &b.words[p / 8];
            let sh = (p % 8) * 8;
            let v = w.load(Ordering::Relaxed);
            w.store((v & !(0xFF << sh)) | ((byte as u64) << sh), Ordering::Relaxed);
        }
    }

    pub fn read(&self, id: BufferId) -> Vec<u8> {
        let b = &self.bufs[id.0];
        let mut out: Vec<u8> = b.words.iter().flat_map(|w| w.load(Ordering::Relaxed).to_le_bytes()).collect();
        out.truncate(b.len);
        out
    }

    /// `len` bytes of buffer `id` from byte `offset` (panics outside the buffer: host misuse).
    pub fn read_at(&self, id: BufferId, offset: usize, len: usize) -> Vec<u8> {
        let b = &self.bufs[id.0];
        assert!(offset + len <= b.len, "read of {len} B at {offset} overflows buffer '{}' ({} B)", b.name, b.len);
        (offset..offset + len).map(|p| (b.words[p / 8].load(Ordering::Relaxed) >> ((p % 8) * 8)) as u8).collect()
    }

    pub fn read_f32(&self, id: BufferId) -> Vec<f32> {
        self.read(id).chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
    }

    pub fn read_u32(&self, id: BufferId) -> Vec<u32> {
        self.read(id).chunks_exact(4).map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
    }

    /// The buffer and offset holding `[addr, addr + size)`, or a description of the fault.
    fn locate(&self, addr: u64, size: u64) -> Result<(&Buffer, usize), String> {
        if !matches!(size, 1 | 2 | 4 | 8) || !addr.is_multiple_of(size) {
            return Err(format!("{size}-byte access at {addr:#x} is not a naturally aligned 1/2/4/8-byte access"));
        }
        let i = self.bufs.partition_point(|b| b.base <= addr);
        if i > 0 {
            let b = &self.bufs[i - 1];
            let off = addr - b.base;
            if off.checked_add(size).is_some_and(|e| e <= b.len as u64) {
                return Ok((b, off as usize));
            }
            if off < b.len as u64 + GUARD {
                return Err(format!("{size}-byte access at {addr:#x} runs past the end of buffer '{}' ({} B at {:#x}, offset {off})", b.name, b.len, b.base));
            }
        }
        Err(format!("address {addr:#x} is not in any global buffer"))
    }

    /// Reads `size` (1, 2, 4 or 8) naturally aligned bytes, little-endian.
    pub fn load(&self, addr: u64, size: u64) -> Result<u64, String> {
        let (b, off) = self.locate(addr, size)?;
        b.loaded.fetch_add(size, Ordering::Relaxed);
        let w = b.words[off / 8].load(Ordering::Relaxed);
        Ok(extract(w, off, size))
    }

    pub fn store(&self, addr: u64, size: u64, v: u64) -> Result<(), String> {
        let (b, off) = self.locate(addr, size)?;
        let w = &b.words[off / 8];
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
    pub fn rmw(&self, addr: u64, size: u64, f: &dyn Fn(u64) -> u64) -> Result<u64, String> {
        let (b, off) = self.locate(addr, size)?;
        let w = &b.words[off / 8];
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

impl SharedMemory {
    pub fn new(size: usize) -> Self {
        SharedMemory { bytes: vec![0; size] }
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
}
