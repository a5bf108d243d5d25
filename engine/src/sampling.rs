//! Next-token sampling: repetition penalties, greedy, temperature, top-k, top-p, seeded; and the
//! log-probabilities clients ask for. Reuses its buffers, so a steady-state decode step without
//! penalties allocates nothing.

use kiln_runtime::rng::Rng;
use std::collections::HashMap;

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SamplingParams {
    /// 0 means greedy (argmax, ties to the lowest id).
    pub temperature: f32,
    /// Keep the smallest set of most likely tokens whose probability reaches `top_p` (1 = off).
    pub top_p: f32,
    /// Keep the `top_k` most likely tokens (0 = off).
    pub top_k: usize,
    pub seed: u64,
    /// OpenAI's: subtracted once from the logit of every token already generated ([-2, 2]).
    pub presence_penalty: f32,
    /// OpenAI's: subtracted per occurrence in the generated tokens ([-2, 2]).
    pub frequency_penalty: f32,
    /// HF/vLLM's (CTRL paper): logits of tokens in the prompt or the output are divided by it
    /// when positive, multiplied when negative (1 = off, > 0).
    pub repetition_penalty: f32,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams { temperature: 0.0, top_p: 1.0, top_k: 0, seed: 0, presence_penalty: 0.0, frequency_penalty: 0.0, repetition_penalty: 1.0 }
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
        for (name, v) in [("presence_penalty", self.presence_penalty), ("frequency_penalty", self.frequency_penalty)] {
            if !(-2.0..=2.0).contains(&v) {
                return Err(format!("{name} must be in [-2, 2], got {v}"));
            }
        }
        if !(self.repetition_penalty.is_finite() && self.repetition_penalty > 0.0) {
            return Err(format!("repetition_penalty must be > 0, got {}", self.repetition_penalty));
        }
        Ok(())
    }

    pub fn penalises(&self) -> bool {
        self.presence_penalty != 0.0 || self.frequency_penalty != 0.0 || self.repetition_penalty != 1.0
    }
}

/// What the penalties look at: how often each token was generated, and the prompt's tokens.
#[derive(Debug, Default)]
pub struct TokenHistory {
    output: HashMap<u32, u32>,
    prompt: std::collections::HashSet<u32>,
}

impl TokenHistory {
    pub fn new(prompt: &[u32]) -> TokenHistory {
        TokenHistory { output: HashMap::new(), prompt: prompt.iter().copied().collect() }
    }

    pub fn push(&mut self, token: u32) {
        *self.output.entry(token).or_insert(0) += 1;
    }

    /// Applies the penalties of `p` to `logits` in place, as vLLM orders them: repetition
    /// (prompt and output), then frequency and presence (output only).
    pub fn penalise(&self, p: &SamplingParams, logits: &mut [f32]) {
        if p.repetition_penalty != 1.0 {
            let r = p.repetition_penalty;
            for &t in self.prompt.iter().chain(self.output.keys()) {
                if let Some(l) = logits.get_mut(t as usize) {
                    *l = if *l > 0.0 { *l / r } else { *l * r };
                }
            }
        }
        if p.presence_penalty != 0.0 || p.frequency_penalty != 0.0 {
            for (&t, &n) in &self.output {
                if let Some(l) = logits.get_mut(t as usize) {
                    *l -= p.frequency_penalty * n as f32 + p.presence_penalty;
                }
            }
        }
    }
}

/// The log-probabilities of one sampled token and of the most likely alternatives.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprobs {
    pub logprob: f32,
    /// The `top` most likely tokens, most likely first (ties to the lower id).
    pub top: Vec<(u32, f32)>,
}

/// Log-softmax of the model's logits (before penalties, temperature or masks: what vLLM returns)
/// at `token`, and the `top` most likely tokens.
pub fn logprobs(logits: &[f32], token: u32, top: usize) -> TokenLogprobs {
    let max = logits.iter().copied().filter(|l| !l.is_nan()).fold(f32::NEG_INFINITY, f32::max);
    let sum: f64 = logits.iter().filter(|l| !l.is_nan()).map(|&l| ((l - max) as f64).exp()).sum();
    let log_z = max as f64 + sum.ln();
    let lp = |l: f32| if l.is_nan() { f32::NEG_INFINITY } else { (l as f64 - log_z) as f32 };
    let mut best: Vec<(u32, f32)> = Vec::with_capacity(top + 1);
    if top > 0 {
        let mut ranked: Vec<(u32, f32)> = logits.iter().enumerate().map(|(i, &l)| (i as u32, if l.is_nan() { f32::NEG_INFINITY } else { l })).collect();
        let order = |a: &(u32, f32), b: &(u32, f32)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
        let k = top.min(ranked.len());
        if k < ranked.len() {
            ranked.select_nth_unstable_by(k - 1, order);
            ranked.truncate(k);
        }
        ranked.sort_unstable_by(order);
        best.extend(ranked.into_iter().map(|(i, l)| (i, lp(l))));
    }
    TokenLogprobs { logprob: logits.get(token as usize).map_or(f32::NEG_INFINITY, |&l| lp(l)), top: best }
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
        SamplingParams { temperature, top_p, top_k, seed, ..SamplingParams::default() }
    }

    #[test]
    fn logprobs_are_a_log_softmax_with_ranked_alternatives() {
        // Probabilities 0.1, 0.2, 0.3, 0.4 (logits shifted by 5: the softmax does not care).
        let logits = [0.1f32.ln() + 5.0, 0.2f32.ln() + 5.0, 0.3f32.ln() + 5.0, 0.4f32.ln() + 5.0];
        let l = logprobs(&logits, 1, 3);
        assert!((l.logprob - 0.2f32.ln()).abs() < 1e-6, "{}", l.logprob);
        let ids: Vec<u32> = l.top.iter().map(|t| t.0).collect();
        assert_eq!(ids, vec![3, 2, 1]);
        for (id, lp) in &l.top {
            assert!((lp - ((*id + 1) as f32 / 10.0).ln()).abs() < 1e-6);
        }
        let total: f32 = logprobs(&logits, 0, 4).top.iter().map(|t| t.1.exp()).sum();
        assert!((total - 1.0).abs() < 1e-6);
        assert!(logprobs(&logits, 0, 0).top.is_empty());
    }

    #[test]
    fn penalties_follow_the_openai_and_hf_formulas() {
        let mut h = TokenHistory::new(&[0]);
        h.push(1);
        h.push(1);
        h.push(2);
        let p = SamplingParams { presence_penalty: 0.5, frequency_penalty: 0.25, ..SamplingParams::default() };
        let mut l = [1.0f32, 1.0, 1.0, 1.0];
        h.penalise(&p, &mut l);
        // token 1: 2 occurrences -> 1 - 2*0.25 - 0.5; token 2: 1 -> 1 - 0.25 - 0.5; the prompt's
        // token 0 is not an output token.
        assert_eq!(l, [1.0, 0.0, 0.25, 1.0]);
        let r = SamplingParams { repetition_penalty: 2.0, ..SamplingParams::default() };
        let mut l = [4.0f32, -4.0, 4.0, 4.0];
        h.penalise(&r, &mut l);
        assert_eq!(l, [2.0, -8.0, 2.0, 4.0], "prompt and output tokens; positive divided, negative multiplied");
        assert!(SamplingParams { presence_penalty: 2.5, ..SamplingParams::default() }.validate().unwrap_err().contains("presence_penalty"));
        assert!(SamplingParams { repetition_penalty: 0.0, ..SamplingParams::default() }.validate().unwrap_err().contains("repetition_penalty"));
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
