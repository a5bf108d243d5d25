//! The KV page pool with its prefix cache.
//!
//! Pages are reference-counted: a sequence holds one reference on every page of its page table.
//! A full page whose contents are computed can be *registered*: it is then keyed by the tokens it
//! holds and the hash of everything before it (a hash chain), so a later sequence starting with
//! the same tokens can share it instead of recomputing it. When its last holder lets go, a
//! registered page is not freed but kept, evictable, until the pool needs a page; then the least
//! recently used one goes first (deepest first among equals, so a prefix never loses a page
//! while a longer prefix built on it is still cached). A match is verified against the stored
//! tokens and the parent's hash, so two prefixes can be confused only by a 64-bit collision of
//! the parent chain, and never by a reused page id.

use std::collections::hash_map::DefaultHasher;
use std::collections::{BTreeSet, HashMap};
use std::hash::{Hash, Hasher};

/// The chain hash of the page before the first one.
pub const ROOT_HASH: u64 = 0x6b69_6c6e_5f6b_7600;

/// The chain hash of a page holding `tokens` after a prefix whose last page hashed to `parent`.
pub fn chain_hash(parent: u64, tokens: &[u32]) -> u64 {
    // SipHash with fixed keys: deterministic across runs, well mixed.
    let mut h = DefaultHasher::new();
    parent.hash(&mut h);
    tokens.hash(&mut h);
    h.finish()
}

struct CachedPage {
    hash: u64,
    parent: u64,
    tokens: Box<[u32]>,
    depth: u32,
    /// When it last lost its last holder (the eviction order).
    released_at: u64,
}

/// Eviction order: oldest release first; among pages released together, the deepest first.
type EvictKey = (u64, std::cmp::Reverse<u32>, u32);

pub struct PagePool {
    page_size: usize,
    refs: Vec<u32>,
    /// Unreferenced and not cached, low ids handed out first (popped from the end).
    free: Vec<u32>,
    /// None when the prefix cache is disabled.
    cache: Option<PrefixCache>,
}

#[derive(Default)]
struct PrefixCache {
    by_hash: HashMap<u64, u32>,
    pages: HashMap<u32, CachedPage>,
    evictable: BTreeSet<EvictKey>,
    clock: u64,
    evictions: u64,
}

impl PrefixCache {
    fn evict_key(&self, page: u32) -> Option<EvictKey> {
        self.pages.get(&page).map(|c| (c.released_at, std::cmp::Reverse(c.depth), page))
    }
}

/// What a lookup found: the shared pages (in order) and the chain hash after the last of them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PrefixMatch {
    pub pages: Vec<u32>,
    pub hash: u64,
}

impl PagePool {
    pub fn new(total: usize, page_size: usize, prefix_cache: bool) -> PagePool {
        PagePool {
            page_size: page_size.max(1),
            refs: vec![0; total],
            free: (0..total as u32).rev().collect(),
            cache: prefix_cache.then(PrefixCache::default),
        }
    }

    pub fn page_size(&self) -> usize {
        self.page_size
    }

    pub fn total(&self) -> usize {
        self.refs.len()
    }

    /// Pages some sequence holds.
    pub fn used(&self) -> usize {
        self.total() - self.free.len() - self.cached_idle()
    }

    /// Registered pages no sequence holds (reusable, evicted when the pool needs them).
    pub fn cached_idle(&self) -> usize {
        self.cache.as_ref().map_or(0, |c| c.evictable.len())
    }

    /// Pages an allocation can get: free ones plus idle cached ones.
    pub fn available(&self) -> usize {
        self.free.len() + self.cached_idle()
    }

    /// Cached pages evicted so far.
    pub fn evictions(&self) -> u64 {
        self.cache.as_ref().map_or(0, |c| c.evictions)
    }

    pub fn prefix_cache_enabled(&self) -> bool {
        self.cache.is_some()
    }

    /// `n` fresh pages (one reference each), evicting idle cached pages when no free ones are
    /// left; None (nothing taken) when even that is not enough.
    pub fn alloc(&mut self, n: usize) -> Option<Vec<u32>> {
        if n > self.available() {
            return None;
        }
        let mut out = Vec::with_capacity(n);
        for _ in 0..n {
            let page = match self.free.pop() {
                Some(p) => p,
                None => self.evict_one().expect("available() counted it"),
            };
            self.refs[page as usize] = 1;
            out.push(page);
        }
        Some(out)
    }

    fn evict_one(&mut self) -> Option<u32> {
        let c = self.cache.as_mut()?;
        let key = c.evictable.pop_first()?;
        let page = key.2;
        if let Some(gone) = c.pages.remove(&page) {
            c.by_hash.remove(&gone.hash);
        }
        c.evictions += 1;
        Some(page)
    }

    /// One more reference on each of `pages` (pages found by [`PagePool::lookup`]).
    pub fn retain(&mut self, pages: &[u32]) {
        for &p in pages {
            if self.refs[p as usize] == 0 {
                if let Some(c) = self.cache.as_mut() {
                    if let Some(key) = c.evict_key(p) {
                        c.evictable.remove(&key);
                    }
                }
            }
            self.refs[p as usize] += 1;
        }
    }

    /// Drops one reference on each of `pages`: a page nobody holds any more is freed, or kept
    /// as an idle cached page when it is registered.
    pub fn release(&mut self, pages: &[u32]) {
        let stamp = self.cache.as_mut().map_or(0, |c| {
            c.clock += 1;
            c.clock
        });
        for &p in pages {
            let r = &mut self.refs[p as usize];
            debug_assert!(*r > 0, "page {p} released more often than held");
            *r = r.saturating_sub(1);
            if *r > 0 {
                continue;
            }
            let cached = self.cache.as_mut().and_then(|c| c.pages.get_mut(&p).map(|e| (e, &mut c.evictable)));
            match cached {
                Some((entry, evictable)) => {
                    entry.released_at = stamp;
                    evictable.insert((stamp, std::cmp::Reverse(entry.depth), p));
                }
                None => self.free.push(p),
            }
        }
    }

    /// Idle pages that a sequence about to retain `pages` would take out of [`available`].
    ///
    /// [`available`]: PagePool::available
    pub fn idle_among(&self, pages: &[u32]) -> usize {
        pages.iter().filter(|&&p| self.refs[p as usize] == 0).count()
    }

    /// The longest cached prefix of `tokens` in whole pages, at most `max_pages` of them.
    /// Takes no references.
    pub fn lookup(&self, tokens: &[u32], max_pages: usize) -> PrefixMatch {
        let mut m = PrefixMatch { pages: Vec::new(), hash: ROOT_HASH };
        let Some(c) = self.cache.as_ref() else { return m };
        for chunk in tokens.chunks_exact(self.page_size).take(max_pages) {
            let h = chain_hash(m.hash, chunk);
            let Some(&page) = c.by_hash.get(&h) else { break };
            let e = &c.pages[&page];
            if e.parent != m.hash || *e.tokens != *chunk {
                break;
            }
            m.pages.push(page);
            m.hash = h;
        }
        m
    }

    /// Registers `page`, which holds `tokens` (one full page) after a prefix whose chain hash is
    /// `parent` and which is page number `depth` of its sequence; returns the page's chain hash
    /// (what the next page of the sequence chains on). A page whose contents are already cached
    /// elsewhere is left unregistered: it is freed with its sequence.
    pub fn register(&mut self, page: u32, parent: u64, tokens: &[u32], depth: usize) -> u64 {
        let hash = chain_hash(parent, tokens);
        if let Some(c) = self.cache.as_mut() {
            if !c.by_hash.contains_key(&hash) && !c.pages.contains_key(&page) {
                debug_assert!(self.refs[page as usize] > 0, "only a held page is registered");
                c.by_hash.insert(hash, page);
                c.pages.insert(page, CachedPage { hash, parent, tokens: tokens.into(), depth: depth as u32, released_at: 0 });
            }
        }
        hash
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const P: usize = 4;

    /// Holds pages for `tokens` and registers the full ones, as a sequence does.
    fn hold(pool: &mut PagePool, tokens: &[u32]) -> Vec<u32> {
        let m = pool.lookup(tokens, tokens.len() / P);
        pool.retain(&m.pages);
        let mut pages = m.pages.clone();
        pages.extend(pool.alloc(tokens.len().div_ceil(P) - m.pages.len()).expect("room"));
        let mut h = ROOT_HASH;
        for (i, chunk) in tokens.chunks_exact(P).enumerate() {
            h = pool.register(pages[i], h, chunk, i);
        }
        pages
    }

    #[test]
    fn alloc_release_accounting_without_cache() {
        let mut a = PagePool::new(4, P, false);
        let x = a.alloc(3).unwrap();
        assert_eq!(x, vec![0, 1, 2]);
        assert!(a.alloc(2).is_none(), "all or nothing");
        assert_eq!(a.used(), 3);
        assert_eq!(a.register(x[0], ROOT_HASH, &[1, 2, 3, 4], 0), chain_hash(ROOT_HASH, &[1, 2, 3, 4]));
        a.release(&x);
        assert_eq!((a.used(), a.cached_idle()), (0, 0), "nothing is kept without the cache");
        assert!(a.lookup(&[1, 2, 3, 4, 5], 1).pages.is_empty());
        assert_eq!(a.alloc(4).unwrap().len(), 4);
    }

    #[test]
    fn a_released_prefix_is_found_again_and_shared() {
        let mut pool = PagePool::new(8, P, true);
        let prompt: Vec<u32> = (10..20).collect(); // 2 full pages + 2 tokens
        let a = hold(&mut pool, &prompt);
        // While a still holds them, another sequence with the same start shares the full pages.
        let m = pool.lookup(&prompt, 2);
        assert_eq!(m.pages, a[..2].to_vec());
        assert_eq!(m.hash, chain_hash(chain_hash(ROOT_HASH, &prompt[..4]), &prompt[4..8]));
        pool.release(&a);
        assert_eq!(pool.cached_idle(), 2, "the two full pages stay cached, the partial one is freed");
        assert_eq!(pool.used(), 0);
        // A prompt that diverges in the second page matches only the first.
        let mut other = prompt.clone();
        other[5] = 99;
        assert_eq!(pool.lookup(&other, 2).pages, vec![a[0]]);
        // Retaining an idle page takes it out of the evictable set.
        pool.retain(&a[..1]);
        assert_eq!((pool.cached_idle(), pool.used()), (1, 1));
        pool.release(&a[..1]);
    }

    #[test]
    fn eviction_is_lru_and_deepest_first() {
        let mut pool = PagePool::new(4, P, true);
        let old = hold(&mut pool, &[1, 1, 1, 1, 2, 2, 2, 2]);
        pool.release(&old);
        let new = hold(&mut pool, &[3, 3, 3, 3, 4, 4, 4, 4]);
        pool.release(&new);
        assert_eq!(pool.available(), 4);
        // One page needed: the oldest release, and of it the deeper page (its second).
        let got = pool.alloc(1).unwrap();
        assert_eq!(got, vec![old[1]]);
        assert_eq!(pool.evictions(), 1);
        assert_eq!(pool.lookup(&[1, 1, 1, 1, 2, 2, 2, 2], 2).pages, vec![old[0]], "the shorter prefix survives");
        assert_eq!(pool.lookup(&[3, 3, 3, 3, 4, 4, 4, 4], 2).pages, new, "the newer prefix is untouched");
        pool.release(&got);
        // A reused page id holding other tokens is never mistaken for the evicted one.
        let reuse = hold(&mut pool, &[7, 7, 7, 7]);
        assert!(pool.lookup(&[1, 1, 1, 1, 2, 2, 2, 2], 2).pages.len() <= 1);
        pool.release(&reuse);
    }

    #[test]
    fn duplicate_contents_are_not_registered_twice() {
        let mut pool = PagePool::new(4, P, true);
        let a = pool.alloc(1).unwrap();
        let b = pool.alloc(1).unwrap();
        let h1 = pool.register(a[0], ROOT_HASH, &[5, 5, 5, 5], 0);
        let h2 = pool.register(b[0], ROOT_HASH, &[5, 5, 5, 5], 0);
        assert_eq!(h1, h2, "the chain continues either way");
        pool.release(&b);
        assert_eq!(pool.cached_idle(), 0, "the duplicate is freed, not cached");
        pool.release(&a);
        assert_eq!(pool.cached_idle(), 1);
        assert_eq!(pool.lookup(&[5, 5, 5, 5], 1).pages, a);
    }
}
