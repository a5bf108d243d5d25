//! The paged KV cache of one rank: per layer and cache slot the MLA latent, the rope key and the
//! indexer key. Slot `s` is `page * page_size + offset`; storage grows page by page as the
//! session hands pages out, up to the plan's capacity, so a large plan costs nothing up front.

use super::norm::rms_norm_row;
use super::rope::Rope;
use super::{Round, Tokens};
use crate::error::RuntimeError;
use crate::numerics::{bytes_floats, float_bytes};
use crate::plan::{DType, IndexKeys, KvLayout};

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
    /// How the indexer keys are held: with FP8, `index` keeps the codes' values times the
    /// token's scale, kept in `index_scale`.
    pub index_keys: IndexKeys,
    /// A slot's row in the GPU layout, in cache-dtype values (`KvLayout::row_elems`).
    row: usize,
    latent: Vec<Vec<f32>>,
    rope: Vec<Vec<f32>>,
    index: Vec<Vec<f32>>,
    index_scale: Vec<Vec<f32>>,
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
            index_keys: kv.index_keys,
            row: kv.row_elems(),
            latent: vec![Vec::new(); kv.layers],
            rope: vec![Vec::new(); kv.layers],
            index: vec![Vec::new(); kv.layers],
            index_scale: vec![Vec::new(); kv.layers],
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
        for (store, width) in [(&mut self.latent, self.latent_dim), (&mut self.rope, self.rope_dim), (&mut self.index, self.index_dim), (&mut self.index_scale, 1)] {
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

    /// Caches an indexer key as [`IndexKeys`] says: rounded to the cache dtype, then with FP8
    /// keys quantised (from the rounded values, as a model computing in BF16 would cast them)
    /// and kept as the codes' values times the scale.
    pub fn store_index(&mut self, layer: usize, slot: usize, key: &mut [f32]) {
        let round = self.round;
        key.iter_mut().for_each(|v| *v = round.apply(*v));
        if self.index_keys == IndexKeys::Fp8 {
            self.index_scale[layer][slot] = crate::numerics::round_fp8_key(key);
        }
        self.index_mut(layer, slot).copy_from_slice(key);
    }
}

impl KvCache {
    /// Slots `0..slots` of one layer in the GPU byte layout (`KvLayout`): rows of
    /// `[latent | rope | index]` in `dtype` (BF16 or F32), with FP8 keys `[latent | rope]` then
    /// the key's codes and scale, padded to `row` bytes; slots not allocated yet are zeros.
    pub fn layer_bytes(&self, layer: usize, slots: usize, dtype: DType) -> Vec<u8> {
        let row = self.row;
        let (a, b) = (self.latent_dim, self.latent_dim + self.rope_dim);
        if self.index_keys == IndexKeys::Bf16 {
            let mut vals = vec![0f32; slots * row];
            for (s, r) in vals.chunks_exact_mut(row).enumerate().take(self.slots) {
                r[..a].copy_from_slice(self.latent(layer, s));
                r[a..b].copy_from_slice(self.rope(layer, s));
                r[b..].copy_from_slice(self.index(layer, s));
            }
            return float_bytes(&vals, dtype == DType::BF16);
        }
        let pitch = row * dtype.size();
        let mut bytes = vec![0u8; slots * pitch];
        let mut vals = Vec::with_capacity(b);
        for (s, r) in bytes.chunks_exact_mut(pitch).enumerate().take(self.slots) {
            vals.clear();
            vals.extend_from_slice(self.latent(layer, s));
            vals.extend_from_slice(self.rope(layer, s));
            let mla = float_bytes(&vals, dtype == DType::BF16);
            r[..mla.len()].copy_from_slice(&mla);
            // a held value over its scale is its code's value exactly; a slot no key was
            // written to has scale 0 and zero codes
            let scale = self.index_scale[layer][s];
            let key = &mut r[mla.len()..mla.len() + self.index_dim];
            key.iter_mut().zip(self.index(layer, s)).for_each(|(c, &v)| *c = if scale > 0.0 { crate::numerics::f32_to_e4m3(v / scale) } else { 0 });
            r[mla.len() + self.index_dim..mla.len() + self.index_dim + 4].copy_from_slice(&scale.to_le_bytes());
        }
        bytes
    }

    /// Loads one layer from the GPU byte layout (the inverse of `layer_bytes`; allocates the
    /// slots it covers).
    pub fn set_layer_bytes(&mut self, layer: usize, bytes: &[u8], dtype: DType) -> Result<(), RuntimeError> {
        let row = self.row;
        let (a, b) = (self.latent_dim, self.latent_dim + self.rope_dim);
        let pitch = row * dtype.size();
        let slots = bytes.len() / pitch.max(1);
        self.reserve(slots)?;
        let fp8 = self.index_keys == IndexKeys::Fp8;
        for (s, r) in bytes.chunks_exact(pitch.max(1)).enumerate() {
            let vals = bytes_floats(&r[..if fp8 { b * dtype.size() } else { pitch }], dtype == DType::BF16);
            self.latent_mut(layer, s).copy_from_slice(&vals[..a]);
            self.rope_mut(layer, s).copy_from_slice(&vals[a..b]);
            if !fp8 {
                self.index_mut(layer, s).copy_from_slice(&vals[b..]);
                continue;
            }
            let at = b * dtype.size();
            let scale = f32::from_le_bytes(r[at + self.index_dim..at + self.index_dim + 4].try_into().expect("4 bytes"));
            self.index_scale[layer][s] = scale;
            let codes = &r[at..at + self.index_dim];
            self.index_mut(layer, s).iter_mut().zip(codes).for_each(|(v, &c)| *v = crate::numerics::e4m3_to_f32(c) * scale);
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::Round;

    /// The FP8 layout: a key stored through `store_index` comes back as its codes and scale after
    /// the rope key (row padded to 16 bytes), a slot never written as zeros, and loading those
    /// bytes gives back the same cache.
    #[test]
    fn fp8_keys_round_trip_through_the_gpu_layout() {
        let kv = KvLayout {
            dtype: DType::BF16,
            layers: 1,
            latent_dim: 4,
            rope_dim: 2,
            index_dim: 16,
            page_size: 2,
            pages: 1,
            bytes_per_token: 0,
            max_seqs: 1,
            pages_per_seq: 1,
            max_context: 2,
            index_keys: IndexKeys::Fp8,
        };
        // 6 BF16 values (12 B), 16 codes and a 4-byte scale: 32 B
        assert_eq!((kv.row_elems(), kv.slot_bytes(), kv.key_offset_bytes()), (16, 32, 12));
        let mut cache = KvCache::new(&kv, Round::for_dtype(DType::BF16, crate::cpu::Precision::Bf16));
        cache.reserve(2).unwrap();
        let mut key: Vec<f32> = (0..16).map(|i| i as f32 * 0.3 - 2.0).collect();
        cache.store_index(0, 1, &mut key);
        let bytes = cache.layer_bytes(0, 2, DType::BF16);
        assert!(bytes[..32].iter().all(|&b| b == 0), "slot 0 was never written");
        let mut codes = [0u8; 16];
        let rounded: Vec<f32> = (0..16).map(|i| crate::numerics::round_bf16(i as f32 * 0.3 - 2.0)).collect();
        let scale = crate::numerics::quantize_fp8_key(&rounded, &mut codes);
        assert_eq!(bytes[32 + 12..32 + 28], codes);
        assert_eq!(bytes[32 + 28..64], scale.to_le_bytes());
        let mut again = KvCache::new(&kv, Round::NONE);
        again.set_layer_bytes(0, &bytes, DType::BF16).unwrap();
        assert_eq!(again.layer_bytes(0, 2, DType::BF16), bytes);
        assert_eq!(again.index(0, 1), key.as_slice(), "the values held are code x scale");
    }
}
