//! Linear layers: `y = x @ W^T` over BF16 or NVFP4 weights, f32 accumulation, with the SiLU-mul
//! epilogue. Weights stay in the arena in their stored format and are decoded one row at a time.

use super::quant::{decode_row, dot_row, quantize_row};
use super::{scratch, ActQuant, Round};
use crate::numerics::bf16_to_f32;
use crate::plan::Epilogue;
use rayon::prelude::*;

/// A weight matrix `[N, K]` as stored in the arena.
#[derive(Clone, Copy)]
pub(crate) enum Matrix<'a> {
    /// Little-endian BF16.
    Bf16(&'a [u8]),
    /// ModelOpt NVFP4: packed codes `[N, K/2]` and E4M3 block scales `[N, K/16]`.
    Nvfp4 { packed: &'a [u8], scales: &'a [u8] },
}

/// A linear layer: the matrix, its input size and its parts (e.g. gate then up), with the
/// per-part NVFP4 scalars.
#[derive(Clone, Copy)]
pub(crate) struct Linear<'a> {
    pub matrix: Matrix<'a>,
    pub k: usize,
    /// Rows of each part, in order.
    pub parts: &'a [usize],
    /// `weight_scale_2` per part (NVFP4 only).
    pub scale_2: &'a [f32],
    /// `input_scale` per part (NVFP4 only).
    pub input_scale: &'a [f32],
}

impl Linear<'_> {
    pub fn rows(&self) -> usize {
        self.parts.iter().sum()
    }

    fn part_of(&self, mut n: usize) -> usize {
        for (p, &rows) in self.parts.iter().enumerate() {
            if n < rows {
                return p;
            }
            n -= rows;
        }
        self.parts.len() - 1
    }

    fn quantises_input(&self, act: ActQuant) -> bool {
        matches!(self.matrix, Matrix::Nvfp4 { .. }) && act == ActQuant::W4A4
    }

    /// Decodes row `n` into `out`; `mul` scales every element (NVFP4 W4A16: weight_scale_2).
    fn decode(&self, n: usize, mul: f32, out: &mut [f32]) {
        match self.matrix {
            Matrix::Bf16(bytes) => {
                let row = &bytes[n * self.k * 2..(n + 1) * self.k * 2];
                for (o, b) in out.iter_mut().zip(row.chunks_exact(2)) {
                    *o = bf16_to_f32(u16::from_le_bytes([b[0], b[1]]));
                }
            }
            Matrix::Nvfp4 { packed, scales } => decode_row(packed, scales, self.k, n, mul, out),
        }
    }
}

/// Reusable buffers of one rank's linear layers.
#[derive(Default)]
pub(crate) struct LinearScratch {
    /// Quantised activations, one `[tokens, K]` copy per part.
    xq: Vec<f32>,
    /// Raw outputs, transposed: `[N, tokens]` (each task owns whole rows of W).
    yt: Vec<f32>,
}

/// Sum of products in f32 (eight partial sums, so the compiler can vectorise).
#[inline]
pub(crate) fn dot(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len().min(b.len());
    let (a, b) = (&a[..n], &b[..n]);
    let mut acc = [0f32; 8];
    let mut ca = a.chunks_exact(8);
    let mut cb = b.chunks_exact(8);
    for (x, y) in (&mut ca).zip(&mut cb) {
        for i in 0..8 {
            acc[i] += x[i] * y[i];
        }
    }
    let mut s = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    for (x, y) in ca.remainder().iter().zip(cb.remainder()) {
        s += x * y;
    }
    s
}

#[inline]
pub(crate) fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

/// Below this many multiply-adds a layer runs on the calling thread.
const PARALLEL_WORK: usize = 1 << 16;

/// `out = epilogue(x @ W^T)` for `tokens` rows of `x` (`[tokens, K]`); `out` is `[tokens, N]`
/// (`[tokens, N/2]` for SiLU-mul), every value rounded once by `round` at the store.
///
/// NVFP4 with W4A4: each part quantises the input with its own `input_scale` and scales its dot
/// products by `alpha = input_scale * weight_scale_2`. W4A16: `W = e2m1 * scale * scale_2`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn linear(
    x: &[f32],
    tokens: usize,
    lin: &Linear,
    act: ActQuant,
    epilogue: Epilogue,
    round: Round,
    scratch: &mut LinearScratch,
    out: &mut [f32],
) {
    let (k, n) = (lin.k, lin.rows());
    let quant = lin.quantises_input(act);
    let xq = if quant {
        let xq = scratch::grow(&mut scratch.xq, lin.parts.len() * tokens * k);
        for p in 0..lin.parts.len() {
            let dst = p * tokens * k;
            // Parts with the same input_scale (gate and up of one MLP) share one quantisation.
            if let Some(q) = (0..p).find(|&q| lin.input_scale[q].to_bits() == lin.input_scale[p].to_bits()) {
                xq.copy_within(q * tokens * k..(q + 1) * tokens * k, dst);
                continue;
            }
            for t in 0..tokens {
                quantize_row(&x[t * k..(t + 1) * k], lin.input_scale[p], &mut xq[dst + t * k..dst + (t + 1) * k]);
            }
        }
        &*xq
    } else {
        x
    };
    let yt = scratch::grow(&mut scratch.yt, n * tokens);
    let threads = rayon::current_num_threads().max(1);
    let rows_per_task = n.div_ceil(threads * 4).max(1);
    let task = |(i, block): (usize, &mut [f32])| {
        scratch::with_f32(k, |row| {
            for (r, yrow) in block.chunks_mut(tokens).enumerate() {
                let nn = i * rows_per_task + r;
                let p = lin.part_of(nn);
                let (mul, alpha, src) = match lin.matrix {
                    Matrix::Nvfp4 { .. } if quant => (1.0, lin.input_scale[p] * lin.scale_2[p], &xq[p * tokens * k..(p + 1) * tokens * k]),
                    Matrix::Nvfp4 { .. } => (lin.scale_2[p], 1.0, xq),
                    Matrix::Bf16(_) => (1.0, 1.0, xq),
                };
                if let (Matrix::Nvfp4 { packed, scales }, true, 1) = (lin.matrix, quant, tokens) {
                    // Decode (one token, W4A4): dot straight from the packed bytes.
                    yrow[0] = alpha * dot_row(packed, scales, k, nn, src);
                    continue;
                }
                lin.decode(nn, mul, row);
                for (t, y) in yrow.iter_mut().enumerate() {
                    let d = dot(&src[t * k..(t + 1) * k], row);
                    *y = if quant { alpha * d } else { d };
                }
            }
        })
    };
    if n * k * tokens < PARALLEL_WORK {
        yt.chunks_mut(rows_per_task * tokens).enumerate().for_each(task);
    } else {
        yt.par_chunks_mut(rows_per_task * tokens).enumerate().for_each(task);
    }
    match epilogue {
        Epilogue::None => {
            for t in 0..tokens {
                for (j, o) in out[t * n..(t + 1) * n].iter_mut().enumerate() {
                    *o = round.apply(yt[j * tokens + t]);
                }
            }
        }
        Epilogue::SiluMul => {
            let half = n / 2;
            for t in 0..tokens {
                for (j, o) in out[t * half..(t + 1) * half].iter_mut().enumerate() {
                    *o = round.apply(silu(yt[j * tokens + t]) * yt[(half + j) * tokens + t]);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::numerics::{f32_to_bf16, quantize_nvfp4};

    fn bf16_bytes(w: &[f32]) -> Vec<u8> {
        w.iter().flat_map(|&v| f32_to_bf16(v).to_le_bytes()).collect()
    }

    #[test]
    fn bf16_linear_with_silu_mul() {
        // W: gate row [1, 0], up row [0, 2]; x = [1, 3].
        let w = bf16_bytes(&[1.0, 0.0, 0.0, 2.0]);
        let lin = Linear { matrix: Matrix::Bf16(&w), k: 2, parts: &[1, 1], scale_2: &[], input_scale: &[] };
        let mut out = [0f32; 1];
        let mut s = LinearScratch::default();
        linear(&[1.0, 3.0], 1, &lin, ActQuant::W4A4, Epilogue::SiluMul, Round::NONE, &mut s, &mut out);
        assert!((out[0] - silu(1.0) * 6.0).abs() < 1e-6);
        let mut out2 = [0f32; 2];
        linear(&[1.0, 3.0], 1, &lin, ActQuant::W4A4, Epilogue::None, Round::NONE, &mut s, &mut out2);
        assert_eq!(out2, [1.0, 6.0]);
    }

    /// A hand-checked W4A4 product: one row of 16 weights, all code 1.0 times block scale 0.5
    /// and weight_scale_2 2 (so W = 1); x = [3, 1, 0, ...] with input_scale 0.5.
    #[test]
    fn nvfp4_w4a4_hand_example() {
        // code 2 = 1.0 in both nibbles; scale 0.5 = E4M3 0x30.
        let packed = [0x22u8; 8];
        let scales = [0x30u8];
        let lin = Linear { matrix: Matrix::Nvfp4 { packed: &packed, scales: &scales }, k: 16, parts: &[1], scale_2: &[2.0], input_scale: &[0.5] };
        let mut x = [0f32; 16];
        x[0] = 3.0;
        x[1] = 1.0;
        x[2] = 0.4;
        let mut s = LinearScratch::default();
        let mut out = [0f32; 1];
        // W4A4: inv = 2, amax 3 -> sf = e4m3(2*3/6) = 1; codes: 6 -> 6, 2 -> 2, 0.8 -> 1.0.
        // y = alpha * sum(xq * wq) = (0.5 * 2) * (6 + 2 + 1) * 0.5 = 4.5.
        linear(&x, 1, &lin, ActQuant::W4A4, Epilogue::None, Round::NONE, &mut s, &mut out);
        assert_eq!(out[0], 4.5);
        // W4A16: y = sum(x * W) = 3 + 1 + 0.4.
        linear(&x, 1, &lin, ActQuant::W4A16, Epilogue::None, Round::NONE, &mut s, &mut out);
        assert!((out[0] - 4.4).abs() < 1e-6);
    }

    #[test]
    fn nvfp4_w4a16_equals_the_dequantised_matmul() {
        let (n, k, t) = (5, 48, 3);
        let w: Vec<f32> = (0..n * k).map(|i| (i * 37 % 101) as f32 / 50.0 - 1.0).collect();
        let (packed, scales, s2) = quantize_nvfp4(&w, n, k);
        let x: Vec<f32> = (0..t * k).map(|i| (i * 13 % 29) as f32 / 14.0 - 1.0).collect();
        let lin = Linear { matrix: Matrix::Nvfp4 { packed: &packed, scales: &scales }, k, parts: &[n], scale_2: &[s2], input_scale: &[1.0] };
        let mut out = vec![0f32; t * n];
        linear(&x, t, &lin, ActQuant::W4A16, Epilogue::None, Round::NONE, &mut LinearScratch::default(), &mut out);
        let mut row = vec![0f32; k];
        for r in 0..n {
            decode_row(&packed, &scales, k, r, s2, &mut row);
            for tt in 0..t {
                let want: f64 = (0..k).map(|c| x[tt * k + c] as f64 * row[c] as f64).sum();
                assert!((out[tt * n + r] as f64 - want).abs() < 1e-5, "{r} {tt}");
            }
        }
    }
}
