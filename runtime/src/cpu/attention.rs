//! MLA attention over the cached latents, in the expanded form (per-head K/V from kv_b, prefill)
//! or the absorbed form (kv_b folded into q and the output, decode). Both compute
//! `softmax((q_nope . k_nope_j + q_rope . k_rope_j) * scale) . v_j` in f32 and must agree.

use super::kv_cache::{slot_of, KvCache};
use super::linear::dot;
use super::rope::Rope;
use super::{scratch, Round, Tokens};
use crate::numerics::bf16_to_f32;
use crate::plan::AttentionForm;
use rayon::prelude::*;

/// The attention geometry of this rank.
pub struct Mla<'a> {
    /// Local heads.
    pub heads: usize,
    pub nope: usize,
    pub rope_dim: usize,
    pub v_dim: usize,
    pub latent: usize,
    pub scale: f32,
    /// BF16 `[heads * (nope + v), latent]`: per head its `nope` rows (W_UK) then `v` rows (W_UV).
    pub kv_b: &'a [u8],
    pub form: AttentionForm,
}

impl Mla<'_> {
    /// Decodes head `h`'s `(nope + v) x latent` block of kv_b into `out`.
    fn decode_head(&self, h: usize, out: &mut [f32]) {
        let rows = self.nope + self.v_dim;
        let bytes = &self.kv_b[h * rows * self.latent * 2..(h + 1) * rows * self.latent * 2];
        for (o, b) in out.iter_mut().zip(bytes.chunks_exact(2)) {
            *o = bf16_to_f32(u16::from_le_bytes([b[0], b[1]]));
        }
    }
}

/// The positions token `t` attends to: its top-k row (-1 skipped) or every `j <= pos`.
fn selected<'a>(topk: Option<(&'a [i32], usize)>, t: usize, pos: usize) -> impl Iterator<Item = usize> + 'a {
    let (row, all) = match topk {
        Some((ids, k)) => (&ids[t * k..(t + 1) * k], 0),
        None => (&[][..], pos + 1),
    };
    row.iter().filter(move |&&j| j >= 0 && j as usize <= pos).map(|&j| j as usize).chain(0..all)
}

/// `out[t, h*v..(h+1)*v]` for every token and local head; `q` rows are `[heads, nope | rope]`
/// before RoPE. Padding tokens get zeros.
#[allow(clippy::too_many_arguments)]
pub(crate) fn mla_attention(
    q: &[f32],
    topk: Option<(&[i32], usize)>,
    tokens: &Tokens,
    cache: &KvCache,
    layer: usize,
    m: &Mla,
    rope: &Rope,
    round: Round,
    out: &mut [f32],
) {
    let (nope, dr, dv, r) = (m.nope, m.rope_dim, m.v_dim, m.latent);
    let qk = nope + dr;
    let max_sel = match topk {
        Some((_, k)) => k,
        None => tokens.positions.iter().map(|&p| p.max(0) as usize + 1).max().unwrap_or(0),
    };
    let task = |(i, o): (usize, &mut [f32])| {
        let (t, h) = (i / m.heads, i % m.heads);
        o.fill(0.0);
        let Some(pages) = tokens.pages(t) else { return };
        let pos = tokens.positions[t] as usize;
        let need = (nope + dv) * r + dr + max_sel + 2 * r.max(nope).max(dv);
        scratch::with_f32(need, |s| {
            let (w, s) = s.split_at_mut((nope + dv) * r);
            let (qr, s) = s.split_at_mut(dr);
            let (scores, s) = s.split_at_mut(max_sel);
            let (a, b) = s.split_at_mut(r.max(nope).max(dv));
            m.decode_head(h, w);
            let (w_uk, w_uv) = w.split_at(nope * r);
            let qh = &q[t * m.heads * qk + h * qk..t * m.heads * qk + (h + 1) * qk];
            let q_nope = &qh[..nope];
            qr.copy_from_slice(&qh[nope..]);
            rope.apply(qr, tokens.positions[t]);
            let slot = |j: usize| slot_of(pages, cache.page_size, j);

            // Scores.
            let mut n = 0;
            match m.form {
                AttentionForm::Expanded => {
                    let k_nope = &mut a[..nope];
                    for j in selected(topk, t, pos) {
                        let Some(sl) = slot(j) else { continue };
                        let c = cache.latent(layer, sl);
                        for (kv, wrow) in k_nope.iter_mut().zip(w_uk.chunks_exact(r)) {
                            *kv = dot(wrow, c);
                        }
                        scores[n] = (dot(q_nope, k_nope) + dot(qr, cache.rope(layer, sl))) * m.scale;
                        n += 1;
                    }
                }
                AttentionForm::Absorbed => {
                    let q_abs = &mut a[..r];
                    q_abs.fill(0.0);
                    for (&qi, wrow) in q_nope.iter().zip(w_uk.chunks_exact(r)) {
                        q_abs.iter_mut().zip(wrow).for_each(|(acc, &wv)| *acc += qi * wv);
                    }
                    for j in selected(topk, t, pos) {
                        let Some(sl) = slot(j) else { continue };
                        scores[n] = (dot(q_abs, cache.latent(layer, sl)) + dot(qr, cache.rope(layer, sl))) * m.scale;
                        n += 1;
                    }
                }
            }
            if n == 0 {
                return;
            }
            let p = &mut scores[..n];
            let max = p.iter().fold(f32::NEG_INFINITY, |acc, &v| acc.max(v));
            let mut sum = 0f32;
            for v in p.iter_mut() {
                *v = (*v - max).exp();
                sum += *v;
            }
            p.iter_mut().for_each(|v| *v /= sum);

            // Weighted values.
            match m.form {
                AttentionForm::Expanded => {
                    let v = &mut b[..dv];
                    let mut i = 0;
                    for j in selected(topk, t, pos) {
                        let Some(sl) = slot(j) else { continue };
                        let c = cache.latent(layer, sl);
                        for (vv, wrow) in v.iter_mut().zip(w_uv.chunks_exact(r)) {
                            *vv = dot(wrow, c);
                        }
                        o.iter_mut().zip(v.iter()).for_each(|(acc, &vv)| *acc += p[i] * vv);
                        i += 1;
                    }
                }
                AttentionForm::Absorbed => {
                    let ctx = &mut b[..r];
                    ctx.fill(0.0);
                    let mut i = 0;
                    for j in selected(topk, t, pos) {
                        let Some(sl) = slot(j) else { continue };
                        ctx.iter_mut().zip(cache.latent(layer, sl)).for_each(|(acc, &c)| *acc += p[i] * c);
                        i += 1;
                    }
                    for (ov, wrow) in o.iter_mut().zip(w_uv.chunks_exact(r)) {
                        *ov = dot(wrow, ctx);
                    }
                }
            }
            o.iter_mut().for_each(|v| *v = round.apply(*v));
        })
    };
    if out.len() / dv > 1 {
        out.par_chunks_mut(dv).enumerate().for_each(task);
    } else {
        out.chunks_mut(dv).enumerate().for_each(task);
    }
}
