//! The MoE router (noaux_tc): fp32 sigmoid scores, selection by score + correction bias with
//! group-limited top-k, weights from the unbiased scores.

use super::linear::dot;
use super::scratch;
use crate::numerics::bf16_to_f32;
use crate::plan::RouterParams;
use rayon::prelude::*;

/// Index of the largest `v[i]` over `candidates` (ties: lower index); None if empty.
fn argmax(v: &[f32], candidates: impl Iterator<Item = usize>) -> Option<usize> {
    let mut best: Option<usize> = None;
    for i in candidates {
        if best.is_none_or(|b| v[i] > v[b]) {
            best = Some(i);
        }
    }
    best
}

/// Routes one token given its sigmoid scores `s` and selection scores `c = s + bias` (`c` and
/// `groups_buf` (2 x n_group) are scratch). Writes the chosen experts (best first) and weights.
pub(crate) fn select(s: &[f32], c: &mut [f32], groups_buf: &mut [f32], p: &RouterParams, ids: &mut [i32], weights: &mut [f32]) {
    let e = p.experts;
    let groups = p.n_group.max(1);
    let per_group = e / groups;
    let (group_score, kept) = groups_buf.split_at_mut(groups);
    let kept = &mut kept[..groups];
    kept.fill(0.0);
    // Group score: the sum of its two best selection scores.
    for (g, score) in group_score.iter_mut().enumerate() {
        let range = g * per_group..(g + 1) * per_group;
        let first = argmax(c, range.clone());
        let second = argmax(c, range.filter(|&i| Some(i) != first));
        *score = first.map_or(0.0, |i| c[i]) + second.map_or(0.0, |i| c[i]);
    }
    for _ in 0..p.topk_group.min(groups) {
        if let Some(g) = argmax(group_score, (0..groups).filter(|&g| kept[g] == 0.0)) {
            kept[g] = 1.0;
        }
    }
    for j in 0..p.top_k {
        let pick = argmax(c, (0..e).filter(|&i| kept[i / per_group] != 0.0 && c[i] != f32::NEG_INFINITY));
        let Some(i) = pick else {
            ids[j] = -1;
            weights[j] = 0.0;
            continue;
        };
        ids[j] = i as i32;
        weights[j] = s[i];
        c[i] = f32::NEG_INFINITY;
    }
    if p.norm_topk_prob {
        let sum: f32 = weights.iter().sum::<f32>() + 1e-20;
        weights.iter_mut().for_each(|w| *w /= sum);
    }
    weights.iter_mut().for_each(|w| *w *= p.scaling);
}

/// Routes every token of `x` (`[tokens, hidden]`) with the BF16 gate `[experts, hidden]` and the
/// F32 correction bias; `ids`/`weights` are `[tokens, top_k]`.
pub(crate) fn route(x: &[f32], hidden: usize, gate: &[u8], bias: &[f32], p: &RouterParams, ids: &mut [i32], weights: &mut [f32]) {
    let e = p.experts;
    let task = |(t, (ids, weights)): (usize, (&mut [i32], &mut [f32]))| {
        let groups = p.n_group.max(1);
        scratch::with_f32(hidden + 2 * e + 2 * groups, |buf| {
            let (row, rest) = buf.split_at_mut(hidden);
            let (s, rest) = rest.split_at_mut(e);
            let (c, gbuf) = rest.split_at_mut(e);
            let xt = &x[t * hidden..(t + 1) * hidden];
            for i in 0..e {
                let bytes = &gate[i * hidden * 2..(i + 1) * hidden * 2];
                for (o, b) in row.iter_mut().zip(bytes.chunks_exact(2)) {
                    *o = bf16_to_f32(u16::from_le_bytes([b[0], b[1]]));
                }
                let logit = dot(xt, row);
                s[i] = 1.0 / (1.0 + (-logit).exp());
                c[i] = s[i] + bias[i];
            }
            select(s, c, gbuf, p, ids, weights);
        })
    };
    let tokens = ids.len() / p.top_k.max(1);
    if tokens > 1 {
        ids.par_chunks_mut(p.top_k).zip(weights.par_chunks_mut(p.top_k)).enumerate().for_each(task);
    } else {
        ids.chunks_mut(p.top_k).zip(weights.chunks_mut(p.top_k)).enumerate().for_each(task);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(n_group: usize, topk_group: usize, top_k: usize) -> RouterParams {
        RouterParams { experts: 8, top_k, n_group, topk_group, norm_topk_prob: true, scaling: 2.0 }
    }

    #[test]
    fn groups_are_ranked_by_their_two_best_scores() {
        // 4 groups of 2 (values exact in binary). Group sums of c: g0 = 0.75+0, g1 = 0.5+0.5,
        // g2 = 0.5+0.25, g3 = 0.125+0.0625. g1 (1.0) first; g0 and g2 tie at 0.75 -> g0 wins.
        let s = [0.75, 0.0, 0.5, 0.5, 0.5, 0.25, 0.125, 0.0625];
        let mut c = s;
        let (mut ids, mut w) = ([0i32; 3], [0f32; 3]);
        select(&s, &mut c, &mut [0.0; 8], &params(4, 2, 3), &mut ids, &mut w);
        // Among experts 0..4: 0.75 (e0), then 0.5 (e2) before 0.5 (e3) by index; e4 (0.5, in
        // the dropped group g2) is never considered.
        assert_eq!(ids, [0, 2, 3]);
        let sum = 0.75 + 0.5 + 0.5 + 1e-20;
        for (wi, si) in w.iter().zip([0.75f32, 0.5, 0.5]) {
            assert!((wi - si / sum * 2.0).abs() < 1e-6);
        }
    }

    #[test]
    fn selection_uses_the_bias_weights_do_not() {
        let s = [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8];
        // The bias lifts expert 0 to the top, but its weight stays its unbiased score.
        let mut c = s;
        c[0] += 1.0;
        let (mut ids, mut w) = ([0i32; 2], [0f32; 2]);
        let p = RouterParams { norm_topk_prob: false, ..params(1, 1, 2) };
        select(&s, &mut c, &mut [0.0; 2], &p, &mut ids, &mut w);
        assert_eq!(ids, [0, 7]);
        assert!((w[0] - 0.2).abs() < 1e-7 && (w[1] - 1.6).abs() < 1e-6, "{w:?}");
    }
}
