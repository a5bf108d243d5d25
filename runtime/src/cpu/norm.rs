//! RMSNorm (transformers' order of operations) and LayerNorm, one row at a time.

use super::Round;

/// `out = outer(w * inner(x * rsqrt(mean(x^2) + eps)))`: normalise in f32, cast to the input's
/// dtype (`inner`), scale by the weight, cast to the output's dtype (`outer`).
pub(crate) fn rms_norm_row(x: &[f32], w: &[f32], eps: f32, inner: Round, outer: Round, out: &mut [f32]) {
    let ss: f32 = x.iter().map(|v| v * v).sum();
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
