//! Interleaved (GPT-J) rotary position embedding, as GLM-5 uses in MLA and in the DSA indexer:
//! the pair (x[2i], x[2i+1]) is rotated by the angle `pos * theta^(-2i/d)`.
//!
//! transformers returns the rotated vector de-interleaved ([evens | odds]); kiln keeps the pairs in
//! place. Dot products are identical because q and k always get the same layout.

use crate::numerics::float_bytes;
use crate::plan::Plan;

pub struct Rope {
    /// `1 / theta^(2i/d)` for i in 0..d/2, computed in f32 exactly as transformers does.
    inv_freq: Vec<f32>,
}

impl Rope {
    pub fn new(dim: usize, theta: f64) -> Rope {
        let base = theta as f32;
        let inv_freq = (0..dim / 2).map(|i| 1.0 / base.powf((2 * i) as f32 / dim as f32)).collect();
        Rope { inv_freq }
    }

    /// The rotation of a plan's model (`qk_rope_head_dim`, `rope_theta`).
    pub fn of_plan(plan: &Plan) -> Rope {
        Rope::new(plan.model.qk_rope_head_dim, plan.model.rope_theta)
    }

    /// The GPU's RoPE table of `plan` as F32 bytes (`KvLayout::rope_table_bytes`): `table` for
    /// every position below the plan's `max_context`.
    pub fn plan_table_bytes(plan: &Plan) -> Vec<u8> {
        float_bytes(&Rope::of_plan(plan).table(plan.memory.kv.max_context), false)
    }

    /// `(cos, sin)` of every pair for positions `0..rows`, F32 `[rows, dim / 2, 2]`: the GPU's
    /// RoPE table, the same values `apply` rotates by.
    pub fn table(&self, rows: usize) -> Vec<f32> {
        let mut t = Vec::with_capacity(rows * self.inv_freq.len() * 2);
        for pos in 0..rows {
            for &f in &self.inv_freq {
                let (sin, cos) = (pos as f32 * f).sin_cos();
                t.extend([cos, sin]);
            }
        }
        t
    }

    pub fn dim(&self) -> usize {
        self.inv_freq.len() * 2
    }

    /// Rotates `x` (the rope part, `dim` values) in place for position `pos`.
    pub fn apply(&self, x: &mut [f32], pos: i32) {
        let p = pos as f32;
        for (pair, &f) in x.chunks_exact_mut(2).zip(&self.inv_freq) {
            // The angle is rounded to f32 first, as transformers' fp32 `inv_freq @ positions` is.
            let (sin, cos) = (p * f).sin_cos();
            let (a, b) = (pair[0], pair[1]);
            pair[0] = a * cos - b * sin;
            pair[1] = b * cos + a * sin;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pairs_rotate_by_position_times_frequency() {
        let rope = Rope::new(4, 100.0);
        // pair 0 has frequency 1, pair 1 has 100^(-1/2) = 0.1.
        let mut x = [1.0, 0.0, 0.0, 2.0];
        rope.apply(&mut x, 3);
        let (s0, c0) = 3f32.sin_cos();
        let (s1, c1) = 0.3f32.sin_cos();
        let want = [c0, s0, -2.0 * s1, 2.0 * c1];
        for (a, b) in x.iter().zip(want) {
            assert!((a - b).abs() < 1e-6, "{x:?} vs {want:?}");
        }
        // Position 0 is the identity; rotation keeps the norm of every pair.
        let mut y = [0.3, -0.7, 1.5, 0.25];
        rope.apply(&mut y, 0);
        assert_eq!(y, [0.3, -0.7, 1.5, 0.25]);
        rope.apply(&mut y, 12345);
        assert!(((y[0] * y[0] + y[1] * y[1]) - 0.58).abs() < 1e-5);
        // The GPU table holds exactly the rotation `apply` uses.
        let t = rope.table(4);
        let mut z = [1.0, 0.0, 1.0, 0.0];
        rope.apply(&mut z, 3);
        assert_eq!([t[3 * 4], t[3 * 4 + 1], t[3 * 4 + 2], t[3 * 4 + 3]], [z[0], z[1], z[2], z[3]]);
    }

    #[test]
    fn rotation_is_relative_for_dot_products() {
        // q at position m and k at position n: q.k depends only on m - n.
        let rope = Rope::new(8, 10000.0);
        let q0 = [0.1, 0.2, -0.3, 0.4, 0.5, -0.6, 0.7, 0.8];
        let k0 = [-0.2, 0.1, 0.3, 0.3, -0.5, 0.2, 0.1, 0.9];
        let dot_at = |m: i32, n: i32| {
            let (mut q, mut k) = (q0, k0);
            rope.apply(&mut q, m);
            rope.apply(&mut k, n);
            q.iter().zip(&k).map(|(a, b)| a * b).sum::<f32>()
        };
        assert!((dot_at(7, 3) - dot_at(14, 10)).abs() < 1e-5);
    }
}
