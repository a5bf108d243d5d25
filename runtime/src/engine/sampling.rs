//! Next-token sampling: greedy, temperature, top-k, top-p, seeded. Reuses its buffers, so a
//! steady-state decode step allocates nothing.

use crate::rng::Rng;

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SamplingParams {
    /// 0 means greedy (argmax, ties to the lowest id).
    pub temperature: f32,
    /// Keep the smallest set of most likely tokens whose probability reaches `top_p` (1 = off).
    pub top_p: f32,
    /// Keep the `top_k` most likely tokens (0 = off).
    pub top_k: usize,
    pub seed: u64,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams { temperature: 0.0, top_p: 1.0, top_k: 0, seed: 0 }
    }
}

impl SamplingParams {
    /// Checks the ranges an OpenAI-style client may send; the message names the field.
    pub fn validate(&self) -> Result<(), String> {
        if !(self.temperature.is_finite() && self.temperature >= 0.0) {
            return Err(format!("temperature must be >= 0, got {}", self.temperature));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(format!("top_p must be in (0, 1], got {}", self.top_p));
        }
        Ok(())
    }
}

pub struct Sampler {
    params: SamplingParams,
    rng: Rng,
    candidates: Vec<(u32, f32)>,
}

impl Sampler {
    pub fn new(params: SamplingParams) -> Sampler {
        Sampler { params, rng: Rng::new(params.seed), candidates: Vec::new() }
    }

    /// Picks the next token from one row of logits.
    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        let p = self.params;
        // Below this, logit / temperature overflows f32: it is greedy in all but name.
        if p.temperature < 1e-5 || p.top_k == 1 {
            return argmax(logits);
        }
        let c = &mut self.candidates;
        c.clear();
        c.extend(logits.iter().enumerate().filter(|(_, l)| !l.is_nan()).map(|(i, &l)| (i as u32, l / p.temperature)));
        if c.is_empty() {
            return 0;
        }
        // Most likely first; ties to the lower id so results never depend on sort stability.
        let by_logit = |a: &(u32, f32), b: &(u32, f32)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
        if p.top_k > 0 && p.top_k < c.len() {
            c.select_nth_unstable_by(p.top_k - 1, by_logit);
            c.truncate(p.top_k);
        }
        if p.top_p < 1.0 {
            c.sort_unstable_by(by_logit); // top-p needs the most likely first
        }
        let max = c.iter().fold(f32::NEG_INFINITY, |m, e| m.max(e.1));
        let mut total = 0.0f64;
        for e in c.iter_mut() {
            e.1 = (e.1 - max).exp();
            total += e.1 as f64;
        }
        if p.top_p < 1.0 {
            let mut cum = 0.0f64;
            let mut keep = c.len();
            for (i, e) in c.iter().enumerate() {
                cum += e.1 as f64 / total;
                if cum >= p.top_p as f64 {
                    keep = i + 1;
                    break;
                }
            }
            c.truncate(keep);
            total = c.iter().map(|e| e.1 as f64).sum();
        }
        let mut r = self.rng.uniform() * total;
        for e in c.iter() {
            r -= e.1 as f64;
            if r < 0.0 {
                return e.0;
            }
        }
        c[c.len() - 1].0
    }
}

/// Index of the largest logit (NaN never wins; ties go to the lowest id).
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0usize;
    for (i, &l) in logits.iter().enumerate() {
        if l > logits[best] || logits[best].is_nan() && !l.is_nan() {
            best = i;
        }
    }
    best as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(temperature: f32, top_p: f32, top_k: usize, seed: u64) -> SamplingParams {
        SamplingParams { temperature, top_p, top_k, seed }
    }

    #[test]
    fn greedy_is_argmax_with_low_id_ties() {
        let mut s = Sampler::new(SamplingParams::default());
        assert_eq!(s.sample(&[0.1, 3.0, 3.0, -1.0]), 1);
        assert_eq!(argmax(&[f32::NAN, 1.0, 0.5]), 1);
        let mut k1 = Sampler::new(params(1.0, 1.0, 1, 7));
        assert_eq!(k1.sample(&[0.1, 3.0, 2.9, -1.0]), 1);
    }

    #[test]
    fn same_seed_same_tokens() {
        let logits: Vec<f32> = (0..50).map(|i| (i as f32 * 0.7).sin()).collect();
        let draw = |seed| {
            let mut s = Sampler::new(params(0.8, 0.95, 20, seed));
            (0..32).map(|_| s.sample(&logits)).collect::<Vec<_>>()
        };
        assert_eq!(draw(3), draw(3));
        assert_ne!(draw(3), draw(4));
    }

    #[test]
    fn frequencies_follow_the_softmax() {
        // logits ln(1), ln(2), ln(3), ln(4): probabilities 0.1, 0.2, 0.3, 0.4.
        let logits = [1f32.ln(), 2f32.ln(), 3f32.ln(), 4f32.ln()];
        let mut s = Sampler::new(params(1.0, 1.0, 0, 11));
        let mut counts = [0usize; 4];
        let n = 40_000;
        for _ in 0..n {
            counts[s.sample(&logits) as usize] += 1;
        }
        for (i, c) in counts.iter().enumerate() {
            let want = (i + 1) as f64 / 10.0;
            // 5 standard deviations of a binomial proportion at n = 40k is < 0.013.
            assert!((*c as f64 / n as f64 - want).abs() < 0.013, "token {i}: {c}/{n}");
        }
    }

    #[test]
    fn top_k_and_top_p_cut_the_tail() {
        let logits = [1f32.ln(), 2f32.ln(), 3f32.ln(), 4f32.ln()];
        let mut k2 = Sampler::new(params(1.0, 1.0, 2, 5));
        let mut p = Sampler::new(params(1.0, 0.65, 0, 5)); // 0.4 + 0.3 >= 0.65: keeps ids 3, 2
        for _ in 0..2000 {
            assert!(k2.sample(&logits) >= 2);
            assert!(p.sample(&logits) >= 2);
        }
    }
}
