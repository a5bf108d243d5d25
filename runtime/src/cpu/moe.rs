//! Routed experts of one rank: tokens are grouped by expert, each expert runs its SwiGLU as two
//! batched linears, and the weighted outputs are summed per token in f32.

use super::linear::{linear, Linear, LinearScratch, Matrix};
use super::{ActQuant, Round};
use crate::plan::Epilogue;

/// A stack of per-expert matrices `[experts, rows, k]` in the arena.
#[derive(Clone, Copy)]
pub(crate) enum Stack<'a> {
    Bf16(&'a [u8]),
    /// Packed codes, block scales, and `[experts, parts]` weight_scale_2 / input_scale.
    Nvfp4 { packed: &'a [u8], scales: &'a [u8], scale_2: &'a [f32], input_scale: &'a [f32] },
}

impl<'a> Stack<'a> {
    /// Expert `e`'s linear (`parts` rows per part, `k` inputs) out of a stack of `experts`.
    fn expert(&self, e: usize, experts: usize, k: usize, parts: &'a [usize]) -> Linear<'a> {
        let slice = |b: &'a [u8]| {
            let n = b.len() / experts;
            &b[e * n..(e + 1) * n]
        };
        let np = parts.len();
        match *self {
            Stack::Bf16(b) => Linear { matrix: Matrix::Bf16(slice(b)), k, parts, scale_2: &[], input_scale: &[] },
            Stack::Nvfp4 { packed, scales, scale_2, input_scale } => Linear {
                matrix: Matrix::Nvfp4 { packed: slice(packed), scales: slice(scales) },
                k,
                parts,
                scale_2: &scale_2[e * np..(e + 1) * np],
                input_scale: &input_scale[e * np..(e + 1) * np],
            },
        }
    }
}

pub(crate) struct Experts<'a> {
    pub gate_up: Stack<'a>,
    pub down: Stack<'a>,
    /// Experts stored on this rank; global id of the first.
    pub local: usize,
    pub first: usize,
    /// Per-rank intermediate size of one expert.
    pub intermediate: usize,
    pub hidden: usize,
}

#[derive(Default)]
pub(crate) struct MoeScratch {
    acc: Vec<f32>,
    xs: Vec<f32>,
    mid: Vec<f32>,
    ys: Vec<f32>,
    /// (token, routing weight) of the current expert.
    rows: Vec<(usize, f32)>,
    lin: LinearScratch,
}

/// `out[t] = sum_j w_j * down_j(silu(gate_j x_t) * up_j x_t)` over the experts of token `t`
/// (`ids`/`weights` `[tokens, top_k]`) that live on this rank. `mid` rounds the intermediate
/// (BF16 storage in bf16 mode); `round` the output.
#[allow(clippy::too_many_arguments)]
pub(crate) fn experts(
    x: &[f32],
    tokens: usize,
    active: impl Fn(usize) -> bool,
    ids: &[i32],
    weights: &[f32],
    top_k: usize,
    ex: &Experts,
    act: ActQuant,
    mid: Round,
    round: Round,
    s: &mut MoeScratch,
    out: &mut [f32],
) {
    let (h, inter) = (ex.hidden, ex.intermediate);
    let gu_parts = [inter, inter];
    let dn_parts = [h];
    if s.acc.len() < tokens * h {
        s.acc.resize(tokens * h, 0.0);
    }
    let acc = &mut s.acc[..tokens * h];
    acc.fill(0.0);
    if s.rows.capacity() < tokens * top_k {
        s.rows.reserve(tokens * top_k - s.rows.len());
    }
    for e in 0..ex.local {
        let global = (ex.first + e) as i32;
        s.rows.clear();
        for t in (0..tokens).filter(|&t| active(t)) {
            for j in 0..top_k {
                if ids[t * top_k + j] == global {
                    s.rows.push((t, weights[t * top_k + j]));
                }
            }
        }
        let n = s.rows.len();
        if n == 0 {
            continue;
        }
        let xs = super::scratch::grow(&mut s.xs, n * h);
        for (m, &(t, _)) in s.rows.iter().enumerate() {
            xs[m * h..(m + 1) * h].copy_from_slice(&x[t * h..(t + 1) * h]);
        }
        let gate_up = ex.gate_up.expert(e, ex.local, h, &gu_parts);
        let down = ex.down.expert(e, ex.local, inter, &dn_parts);
        let hid = super::scratch::grow(&mut s.mid, n * inter);
        linear(xs, n, &gate_up, act, Epilogue::SiluMul, mid, &mut s.lin, hid);
        let ys = super::scratch::grow(&mut s.ys, n * h);
        linear(hid, n, &down, act, Epilogue::None, Round::NONE, &mut s.lin, ys);
        for (m, &(t, w)) in s.rows.iter().enumerate() {
            acc[t * h..(t + 1) * h].iter_mut().zip(&ys[m * h..(m + 1) * h]).for_each(|(a, &y)| *a += w * y);
        }
    }
    for (o, &a) in out[..tokens * h].iter_mut().zip(acc.iter()) {
        *o = round.apply(a);
    }
}
