//! The paged KV cache of one rank: per layer and cache slot the MLA latent, the rope key and the
//! indexer key. Slot `s` is `page * page_size + offset`; storage grows page by page as the
//! session hands pages out, up to the plan's capacity, so a large plan costs nothing up front.

use super::norm::rms_norm_row;
use super::rope::Rope;
use super::{Round, Tokens};
use crate::error::RuntimeError;
use crate::numerics::{bytes_floats, float_bytes};
use crate::plan::{DType, KvLayout};

pub(crate) struct KvCache {
    pub latent_dim: usize,
    pub rope_dim: usize,
    pub index_dim: usize,
    pub page_size: usize,
    /// Slots the plan provides (pages * page_size).
    capacity: usize,
    /// Slots allocated so far.
    slots: usize,
    /// Values are rounded to the cache dtype when stored.
    pub round: Round,
    latent: Vec<Vec<f32>>,
    rope: Vec<Vec<f32>>,
    index: Vec<Vec<f32>>,
}

impl KvCache {
    pub fn new(kv: &KvLayout, round: Round) -> KvCache {
        KvCache {
            latent_dim: kv.latent_dim,
            rope_dim: kv.rope_dim,
            index_dim: kv.index_dim,
            page_size: kv.page_size.max(1),
            capacity: kv.pages * kv.page_size,
            slots: 0,
            round,
            latent: vec![Vec::new(); kv.layers],
            rope: vec![Vec::new(); kv.layers],
            index: vec![Vec::new(); kv.layers],
        }
    }

    /// Makes slots `0..slots` addressable (whole pages), allocating only what is new.
    pub fn reserve(&mut self, slots: usize) -> Result<(), RuntimeError> {
        if slots <= self.slots {
            return Ok(());
        }
        if slots > self.capacity {
            return Err(RuntimeError::KvFull {
                message: format!("slot {} requested, the plan's cache holds {} slots", slots - 1, self.capacity),
            });
        }
        let slots = slots.div_ceil(self.page_size) * self.page_size;
        let slots = slots.min(self.capacity);
        for (store, width) in [(&mut self.latent, self.latent_dim), (&mut self.rope, self.rope_dim), (&mut self.index, self.index_dim)] {
            for layer in store.iter_mut() {
                layer.resize(slots * width, 0.0);
            }
        }
        self.slots = slots;
        Ok(())
    }

    pub fn slots(&self) -> usize {
        self.slots
    }

    pub fn latent(&self, layer: usize, slot: usize) -> &[f32] {
        &self.latent[layer][slot * self.latent_dim..(slot + 1) * self.latent_dim]
    }

    pub fn rope(&self, layer: usize, slot: usize) -> &[f32] {
        &self.rope[layer][slot * self.rope_dim..(slot + 1) * self.rope_dim]
    }

    pub fn index(&self, layer: usize, slot: usize) -> &[f32] {
        &self.index[layer][slot * self.index_dim..(slot + 1) * self.index_dim]
    }

    pub fn latent_mut(&mut self, layer: usize, slot: usize) -> &mut [f32] {
        &mut self.latent[layer][slot * self.latent_dim..(slot + 1) * self.latent_dim]
    }

    pub fn rope_mut(&mut self, layer: usize, slot: usize) -> &mut [f32] {
        &mut self.rope[layer][slot * self.rope_dim..(slot + 1) * self.rope_dim]
    }

    pub fn index_mut(&mut self, layer: usize, slot: usize) -> &mut [f32] {
        &mut self.index[layer][slot * self.index_dim..(slot + 1) * self.index_dim]
    }
}

impl KvCache {
    /// Slots `0..slots` of one layer in the GPU byte layout (`KvLayout`): rows of
    /// `[latent | rope | index]` in `dtype` (BF16 or F32); slots not allocated yet are zeros.
    pub fn layer_bytes(&self, layer: usize, slots: usize, dtype: DType) -> Vec<u8> {
        let row = self.latent_dim + self.rope_dim + self.index_dim;
        let mut vals = vec![0f32; slots * row];
        for (s, r) in vals.chunks_exact_mut(row).enumerate().take(self.slots) {
            r[..self.latent_dim].copy_from_slice(self.latent(layer, s));
            r[self.latent_dim..self.latent_dim + self.rope_dim].copy_from_slice(self.rope(layer, s));
            r[self.latent_dim + self.rope_dim..].copy_from_slice(self.index(layer, s));
        }
        float_bytes(&vals, dtype == DType::BF16)
    }

    /// Loads one layer from the GPU byte layout (the inverse of `layer_bytes`; allocates the
    /// slots it covers).
    pub fn set_layer_bytes(&mut self, layer: usize, bytes: &[u8], dtype: DType) -> Result<(), RuntimeError> {
        let row = self.latent_dim + self.rope_dim + self.index_dim;
        let vals = bytes_floats(bytes, dtype == DType::BF16);
        let slots = vals.len() / row.max(1);
        self.reserve(slots)?;
        let (a, b) = (self.latent_dim, self.latent_dim + self.rope_dim);
        for (s, r) in vals.chunks_exact(row).enumerate() {
            self.latent_mut(layer, s).copy_from_slice(&r[..a]);
            self.rope_mut(layer, s).copy_from_slice(&r[a..b]);
            self.index_mut(layer, s).copy_from_slice(&r[b..]);
        }
        Ok(())
    }
}

/// The MLA part of `Op::KvCacheWrite`: for every token with a slot, the RMS-normalised latent (rounded to the
/// `kv` buffer's dtype by `inner`, as transformers normalises in the activation dtype) and the
/// rope key rotated at the token's position, both rounded to the cache dtype.
#[allow(clippy::too_many_arguments)]
pub(crate) fn mla_write(src: &[f32], norm: &[f32], eps: f32, inner: Round, tokens: &Tokens, cache: &mut KvCache, layer: usize, rope: &Rope) {
    let (r, dr) = (cache.latent_dim, cache.rope_dim);
    let round = cache.round;
    for t in 0..tokens.count() {
        let Some(slot) = tokens.slot(t) else { continue };
        let row = &src[t * (r + dr)..(t + 1) * (r + dr)];
        rms_norm_row(&row[..r], norm, eps, inner, round, cache.latent_mut(layer, slot));
        let kr = cache.rope_mut(layer, slot);
        kr.copy_from_slice(&row[r..]);
        rope.apply(kr, tokens.positions[t]);
        kr.iter_mut().for_each(|v| *v = round.apply(*v));
    }
}

/// Where position `pos` of a sequence lives: `page_table_row[pos / page_size] * page_size +
/// pos % page_size`; None if that page is not assigned.
#[inline]
pub(crate) fn slot_of(page_table_row: &[i32], page_size: usize, pos: usize) -> Option<usize> {
    let page = *page_table_row.get(pos / page_size)?;
    (page >= 0).then(|| page as usize * page_size + pos % page_size)
}
