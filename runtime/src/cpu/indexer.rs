//! DSA lightning indexer: cache write of the indexer key and top-k selection of past positions.

use super::kv_cache::{slot_of, KvCache};
use super::norm::layer_norm_row;
use super::rope::Rope;
use super::{scratch, Tokens};
use rayon::prelude::*;

/// Stores `RoPE(LayerNorm(k))` (RoPE on the first rope-dim values) of every token that has a
/// cache slot, as the cache holds keys (rounded to its dtype; FP8 with [`IndexKeys::Fp8`]).
///
/// [`IndexKeys::Fp8`]: crate::plan::IndexKeys::Fp8
#[allow(clippy::too_many_arguments)]
pub(crate) fn key_write(k: &[f32], norm: &[f32], bias: &[f32], eps: f32, tokens: &Tokens, cache: &mut KvCache, layer: usize, rope: &Rope) {
    let d = cache.index_dim;
    scratch::with_f32(d, |key| {
        for t in 0..tokens.count() {
            let Some(slot) = tokens.slot(t) else { continue };
            layer_norm_row(&k[t * d..(t + 1) * d], norm, bias, eps, key);
            rope.apply(&mut key[..rope.dim()], tokens.positions[t]);
            cache.store_index(layer, slot, key);
        }
    });
}

/// For each token: score every cached position `j <= pos` of its sequence with
/// `sum_h (w[h] / sqrt(H)) * relu(q_h . k_j) / sqrt(D)` (q_h with RoPE on its first rope-dim
/// values; each dot product by [`fused_dot`]) and write the `min(topk, pos + 1)` best positions
/// (ties: lower position first) in ascending order, padded with -1. When every position fits,
/// all are selected without scoring.
/// Row j of `out` is token `j * stride + first`'s (a sequence-parallel indexer's rank `first` of
/// `stride`; 0 of 1 selects for every token).
#[allow(clippy::too_many_arguments)]
pub(crate) fn top_k(q: &[f32], w: &[f32], heads: usize, tokens: &Tokens, cache: &KvCache, layer: usize, rope: &Rope, topk: usize, (first, stride): (usize, usize), out: &mut [i32]) {
    let d = cache.index_dim;
    let head_scale = (heads as f32).powf(-0.5);
    let dim_scale = (d as f32).powf(-0.5);
    let dot = fused_dot();
    let task = |(j, row): (usize, &mut [i32])| {
        let t = j * stride + first;
        row.fill(-1);
        let Some(pages) = tokens.pages(t) else { return };
        let n = tokens.positions[t] as usize + 1;
        if n <= topk {
            row.iter_mut().zip(0..n as i32).for_each(|(o, j)| *o = j);
            return;
        }
        scratch::with_f32(heads * d, |qr| {
            qr.copy_from_slice(&q[t * heads * d..(t + 1) * heads * d]);
            for qh in qr.chunks_exact_mut(d) {
                rope.apply(&mut qh[..rope.dim()], tokens.positions[t]);
            }
            let wt = &w[t * heads..(t + 1) * heads];
            scratch::with_pairs(n, |scores| {
                let mut m = 0;
                for j in 0..n {
                    let Some(slot) = slot_of(pages, cache.page_size, j) else { continue };
                    let kj = cache.index(layer, slot);
                    let mut s = 0f32;
                    for (qh, &wh) in qr.chunks_exact(d).zip(wt) {
                        s += (wh * head_scale) * (dot(qh, kj).max(0.0) * dim_scale);
                    }
                    scores[m] = (s, j as u32);
                    m += 1;
                }
                let scores = &mut scores[..m];
                let better = |a: &(f32, u32), b: &(f32, u32)| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1));
                let k = topk.min(m);
                if k == 0 {
                    return;
                }
                if k < m {
                    scores.select_nth_unstable_by(k - 1, better);
                }
                // the k best, in position order (the order the cache is read in)
                scores[..k].sort_unstable_by_key(|s| s.1);
                for (o, s) in row.iter_mut().zip(&scores[..k]) {
                    *o = s.1 as i32;
                }
            })
        })
    };
    if tokens.count() > 1 {
        out.par_chunks_mut(topk).enumerate().for_each(task);
    } else {
        out.chunks_mut(topk).enumerate().for_each(task);
    }
}

/// The indexer's dot product: eight partial sums (element i into sum i mod 8), each a chain of
/// fused multiply-adds (one rounding per element, as the GPU's `fma.rn.f32`), combined as
/// `((s0 + s4) + (s1 + s5)) + ((s2 + s6) + (s3 + s7))`, then any elements past a multiple of 8
/// fused in turn (the GPU's key dims are a multiple of 8). Fused because the scoring is the one
/// FP32-bound kernel of a long context: a separate multiply and add take two issue slots per
/// element where a fused one takes one, and the GPU's selection must stay bit-identical to this.
/// Returns the form for this CPU, found once per caller rather than per dot product.
pub(crate) fn fused_dot() -> fn(&[f32], &[f32]) -> f32 {
    // x86-64's baseline has no FMA instruction, so `mul_add` there is a software routine (13x
    // slower on a 128-dim dot); the same function compiled with the instruction, where the CPU
    // has it, gives the same bits (both are IEEE fused multiply-adds)
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("fma") {
        return fused_dot_with_fma;
    }
    fused_dot_portable
}

#[cfg(target_arch = "x86_64")]
fn fused_dot_with_fma(a: &[f32], b: &[f32]) -> f32 {
    #[target_feature(enable = "fma")]
    unsafe fn with_fma(a: &[f32], b: &[f32]) -> f32 {
        fused_dot_portable(a, b)
    }
    // SAFETY: only returned by `fused_dot` where the CPU supports FMA
    unsafe { with_fma(a, b) }
}

#[inline(always)]
fn fused_dot_portable(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len().min(b.len());
    let (a, b) = (&a[..n], &b[..n]);
    let mut acc = [0f32; 8];
    let (mut ca, mut cb) = (a.chunks_exact(8), b.chunks_exact(8));
    for (x, y) in (&mut ca).zip(&mut cb) {
        for i in 0..8 {
            acc[i] = x[i].mul_add(y[i], acc[i]);
        }
    }
    let s = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    ca.remainder().iter().zip(cb.remainder()).fold(s, |s, (x, y)| x.mul_add(*y, s))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::Round;
    use crate::plan::{DType, KvLayout};

    /// Each element's product and its partial sum rounded once: (1 + 2^-12)^2 = 1 + 2^-11 + 2^-24
    /// added to -(1 + 2^-11) leaves 2^-24, where rounding the product first (to 1 + 2^-11, a tie
    /// to even) would leave 0. Elements 0 and 8 share partial sum 0; the rest are zero.
    #[test]
    fn the_indexer_dot_fuses_each_multiply_add() {
        let x = 1.0 + 2f32.powi(-12);
        let mut a = vec![0f32; 16];
        let mut b = vec![0f32; 16];
        (a[0], b[0]) = (-(1.0 + 2f32.powi(-11)), 1.0);
        (a[8], b[8]) = (x, x);
        assert_eq!(fused_dot()(&a, &b), 2f32.powi(-24));
        assert_eq!(fused_dot_portable(&a, &b), 2f32.powi(-24));
        // a 17th element fuses into the combined sums: 2^-24 + (1 + 2^-11 + 2^-24) is exact in
        // f32 (the product rounded first would tie to 1 + 2^-11 again)
        a.push(x);
        b.push(x);
        assert_eq!(fused_dot()(&a, &b), 1.0 + 2f32.powi(-11) + 2f32.powi(-23));
        assert_eq!(fused_dot_portable(&a, &b), 1.0 + 2f32.powi(-11) + 2f32.powi(-23));
    }

    /// One head, dim 4 (rope dim 2): keys chosen so scores tie, to pin the tie rule.
    #[test]
    fn top_k_prefers_higher_scores_then_lower_positions() {
        let kv = KvLayout {
            dtype: DType::F32,
            layers: 1,
            latent_dim: 2,
            rope_dim: 2,
            index_dim: 4,
            page_size: 4,
            pages: 2,
            bytes_per_token: 0,
            max_seqs: 1,
            pages_per_seq: 2,
            max_context: 8,
            index_keys: Default::default(),
        };
        let mut cache = KvCache::new(&kv, Round::NONE);
        cache.reserve(8).unwrap();
        // Position j lives in page 1 - j / 4 (pages out of order, to exercise the page table).
        let page_table = [1, 0];
        // q = [0, 0, 1, 0]: the score is relu(k[2]); rope dims (0, 1) are zero in q, so RoPE is moot.
        let k2 = [0.5, -1.0, 2.0, 0.5, 2.0, 0.1];
        for (j, &v) in k2.iter().enumerate() {
            let slot = slot_of(&page_table, 4, j).unwrap();
            cache.index_mut(0, slot).copy_from_slice(&[0.0, 0.0, v, 0.0]);
        }
        let rope = Rope::new(2, 10000.0);
        let positions = [5];
        let token_seq = [0];
        let slots = [-1];
        let tokens = Tokens { positions: &positions, token_seq: &token_seq, slots: &slots, page_table: &page_table, pages_per_seq: 2 };
        let mut out = [0i32; 3];
        top_k(&[0.0, 0.0, 1.0, 0.0], &[1.0], 1, &tokens, &cache, 0, &rope, 3, (0, 1), &mut out);
        // scores: [0.5, 0, 2, 0.5, 2, 0.1] -> 2 (pos 2), 2 (pos 4), then 0.5 (pos 0 before pos 3),
        // listed in position order.
        assert_eq!(out, [0, 2, 4]);
        // Short sequences select everything, in order.
        let positions = [1];
        let tokens = Tokens { positions: &positions, ..tokens };
        top_k(&[0.0, 0.0, 1.0, 0.0], &[1.0], 1, &tokens, &cache, 0, &rope, 3, (0, 1), &mut out);
        assert_eq!(out, [0, 1, -1]);
        // Padding tokens select nothing.
        let token_seq = [-1];
        let tokens = Tokens { token_seq: &token_seq, ..tokens };
        top_k(&[0.0, 0.0, 1.0, 0.0], &[1.0], 1, &tokens, &cache, 0, &rope, 3, (0, 1), &mut out);
        assert_eq!(out, [-1, -1, -1]);
    }
}
