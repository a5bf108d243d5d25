//! RMSNorm (transformers' order of operations) and LayerNorm, one row at a time.

use super::Round;

/// Threads of the GPU's rmsnorm block (and of the split GEMM that normalises its rows inside
/// its launch): the CPU sums a row's squares in their order, so that both backends normalise to
/// the same bits (a normalised value one BF16 ulp apart would move every output of the GEMM
/// that reads it).
pub const NORM_THREADS: usize = 256;

/// `sum(x^2)` in the order of a block of [`NORM_THREADS`] threads: thread t adds the squares of
/// x[t], x[t + THREADS], ... in turn; each warp adds its 32 lanes' sums by butterfly (offsets
/// 16, 8, 4, 2, 1); the first warp adds the warp sums (zeros past them) by butterfly again. Just
/// as accurate as a running sum (a tree of at most 24-term runs).
fn sum_of_squares(x: &[f32]) -> f32 {
    let butterfly = |lanes: &mut [f32; 32]| {
        for offset in [16, 8, 4, 2, 1] {
            let before = *lanes;
            for (l, v) in lanes.iter_mut().enumerate() {
                *v = before[l] + before[l ^ offset];
            }
        }
        lanes[0]
    };
    let mut warp_sums = [0f32; 32];
    for (w, sum) in warp_sums.iter_mut().take(NORM_THREADS / 32).enumerate() {
        let mut lanes = [0f32; 32];
        for (l, lane) in lanes.iter_mut().enumerate() {
            *lane = x.iter().skip(w * 32 + l).step_by(NORM_THREADS).fold(0.0, |acc, v| acc + v * v);
        }
        *sum = butterfly(&mut lanes);
    }
    butterfly(&mut warp_sums)
}

/// `out = outer(w * inner(x * rsqrt(mean(x^2) + eps)))`: normalise in f32, cast to the input's
/// dtype (`inner`), scale by the weight, cast to the output's dtype (`outer`).
pub(crate) fn rms_norm_row(x: &[f32], w: &[f32], eps: f32, inner: Round, outer: Round, out: &mut [f32]) {
    let ss = sum_of_squares(x);
    let r = 1.0 / (ss / x.len() as f32 + eps).sqrt();
    for ((o, &v), &g) in out.iter_mut().zip(x).zip(w) {
        *o = outer.apply(g * inner.apply(v * r));
    }
}

/// `out = (x - mean) * rsqrt(var + eps) * w + b` (biased variance), in f32.
pub(crate) fn layer_norm_row(x: &[f32], w: &[f32], b: &[f32], eps: f32, out: &mut [f32]) {
    let n = x.len() as f32;
    let mean = x.iter().sum::<f32>() / n;
    let var = x.iter().map(|v| (v - mean) * (v - mean)).sum::<f32>() / n;
    let r = 1.0 / (var + eps).sqrt();
    for (((o, &v), &g), &c) in out.iter_mut().zip(x).zip(w).zip(b) {
        *o = (v - mean) * r * g + c;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rms_norm_matches_hand_values() {
        let x = [3.0, 4.0];
        let mut out = [0.0; 2];
        // mean(x^2) = 12.5, rsqrt = 0.28284271
        rms_norm_row(&x, &[1.0, 2.0], 0.0, Round::NONE, Round::NONE, &mut out);
        assert!((out[0] - 0.848_528_1).abs() < 1e-6 && (out[1] - 2.262_741_7).abs() < 1e-6, "{out:?}");
        rms_norm_row(&x, &[1.0, 2.0], 0.0, Round::BF16, Round::BF16, &mut out);
        assert_eq!(out, [0.84765625, 2.265625]);
    }

    #[test]
    fn the_block_order_sum_of_squares_is_the_exact_sum_to_rounding() {
        // rows shorter than a warp, than the block, and GLM-5's 6,144 (24 terms a thread)
        for n in [3usize, 200, 1000, 6144] {
            let x: Vec<f32> = (0..n).map(|i| ((i * 7919 % 1013) as f32 - 506.0) / 97.0).collect();
            let exact: f64 = x.iter().map(|&v| v as f64 * v as f64).sum();
            let got = sum_of_squares(&x) as f64;
            assert!((got - exact).abs() <= exact * 1e-6, "n {n}: {got} vs {exact}");
        }
        assert_eq!(sum_of_squares(&[3.0, 4.0]), 25.0);
    }

    #[test]
    fn layer_norm_centres_and_scales() {
        let mut out = [0.0; 4];
        layer_norm_row(&[1.0, 2.0, 3.0, 4.0], &[1.0; 4], &[0.5; 4], 0.0, &mut out);
        // mean 2.5, var 1.25
        let r = 1.0 / 1.25f32.sqrt();
        for (o, v) in out.iter().zip([1.0f32, 2.0, 3.0, 4.0]) {
            assert!((o - ((v - 2.5) * r + 0.5)).abs() < 1e-6);
        }
    }
}
