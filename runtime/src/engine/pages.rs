//! KV page allocator: a free list over the backend's pages. A sequence reserves every page it
//! can need when it is admitted, so it can never run out mid-generation.

#[derive(Debug)]
pub struct PageAllocator {
    free: Vec<u32>,
    total: usize,
}

impl PageAllocator {
    pub fn new(total: usize) -> PageAllocator {
        // Hand out low page ids first (pop from the end).
        PageAllocator { free: (0..total as u32).rev().collect(), total }
    }

    pub fn total(&self) -> usize {
        self.total
    }

    pub fn used(&self) -> usize {
        self.total - self.free.len()
    }

    pub fn available(&self) -> usize {
        self.free.len()
    }

    /// `n` pages, or None (nothing taken) when fewer are free.
    pub fn alloc(&mut self, n: usize) -> Option<Vec<u32>> {
        if n > self.free.len() {
            return None;
        }
        Some((0..n).map(|_| self.free.pop().expect("checked")).collect())
    }

    pub fn release(&mut self, pages: Vec<u32>) {
        debug_assert!(pages.iter().all(|p| (*p as usize) < self.total && !self.free.contains(p)));
        self.free.extend(pages);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn alloc_release_accounting() {
        let mut a = PageAllocator::new(4);
        let x = a.alloc(3).unwrap();
        assert_eq!(x, vec![0, 1, 2]);
        assert!(a.alloc(2).is_none(), "all or nothing");
        assert_eq!(a.used(), 3);
        a.release(x);
        assert_eq!(a.used(), 0);
        assert_eq!(a.alloc(4).unwrap().len(), 4);
    }
}
