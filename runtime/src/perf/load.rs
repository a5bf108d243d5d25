//! What one replay's data decides about its launches' traffic: the tokens' positions (how much of
//! the KV cache the indexer and attention read), the routing (which experts the MoE kernels run)
//! and the ids (which rank's embedding rows are read). The prediction assumes them
//! ([`Load::decode`], [`Load::prefill`]); the test that holds the model against the emulator
//! takes them from the replayed state.

/// The tokens of one replay, by row of the program.
#[derive(Debug, Clone, PartialEq)]
pub struct Tokens {
    /// The absolute position of each row's token; `None` for a padding row (`token_seq < 0`).
    pub positions: Vec<Option<u32>>,
    /// Each row's sequence (its `token_seq`; any value for a padding row): rows of one sequence
    /// read the same cache rows, which a kernel may load once for several of them.
    pub seqs: Vec<u32>,
}

impl Tokens {
    /// Rows that are real tokens.
    pub fn active(&self) -> usize {
        self.positions.iter().flatten().count()
    }

    /// `sum f(n)` over the real tokens, `n` = cached positions the token sees (its position + 1).
    pub fn sum(&self, f: impl Fn(f64) -> f64) -> f64 {
        self.positions.iter().flatten().map(|&p| f(p as f64 + 1.0)).sum()
    }

    /// Rows `first`, `first + stride`, ... (a sequence-parallel indexer rank's rows).
    pub fn every(&self, first: usize, stride: usize) -> Tokens {
        Tokens { positions: self.positions.iter().skip(first).step_by(stride).copied().collect(), seqs: self.seqs.iter().skip(first).step_by(stride).copied().collect() }
    }

    /// Rows `2i` and `2i + 1` as pairs: each row's cached positions (None: padding or past the
    /// rows, the last of an odd count alone), and whether both are real rows of one sequence.
    pub fn pairs(&self) -> Vec<(Option<f64>, Option<f64>, bool)> {
        let row = |r: usize| self.positions.get(r).copied().flatten().map(|p| p as f64 + 1.0);
        (0..self.positions.len().div_ceil(2))
            .map(|i| {
                let (a, b) = (row(2 * i), row(2 * i + 1));
                (a, b, a.is_some() && b.is_some() && self.seqs[2 * i] == self.seqs[2 * i + 1])
            })
            .collect()
    }

    /// The largest `f(n)` over the real tokens (0 if none).
    pub fn max(&self, f: impl Fn(f64) -> f64) -> f64 {
        self.positions.iter().flatten().map(|&p| f(p as f64 + 1.0)).fold(0.0, f64::max)
    }
}

/// Routed tokens per local expert, as a histogram: `(n, experts)` = that many local experts got
/// `n` tokens each (fractional counts: an expectation).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Experts {
    pub hist: Vec<(u32, f64)>,
}

impl Experts {
    /// The expectation under uniform routing: each of `local` experts gets each of `tokens`
    /// tokens with probability `top_k / total` (a token's `top_k` experts are distinct), i.e.
    /// Binomial(tokens, top_k / total) tokens each.
    pub fn uniform(tokens: usize, top_k: usize, total: usize, local: usize) -> Experts {
        let p = (top_k as f64 / total.max(1) as f64).clamp(0.0, 1.0);
        if tokens == 0 || p == 0.0 {
            return Experts { hist: vec![(0, local as f64)] };
        }
        if p >= 1.0 {
            return Experts { hist: vec![(tokens as u32, local as f64)] };
        }
        // pmf in log space from n = 0 upwards; terms below 1e-15 of the largest are dropped.
        let (lp, lq) = (p.ln(), (1.0 - p).ln());
        let mut log_pmf = tokens as f64 * lq;
        let mut terms = Vec::new();
        let mut best = f64::NEG_INFINITY;
        for n in 0..=tokens {
            if n > 0 {
                log_pmf += ((tokens - n + 1) as f64).ln() - (n as f64).ln() + lp - lq;
            }
            best = best.max(log_pmf);
            if log_pmf >= best - 34.5 {
                terms.push((n as u32, log_pmf));
            } else if n as f64 > tokens as f64 * p {
                break;
            }
        }
        let hist = terms.into_iter().map(|(n, l)| (n, local as f64 * l.exp())).filter(|&(_, w)| w > 0.0).collect();
        Experts { hist }
    }

    /// Counts the tokens each of `local` experts (ids `first .. first + local`) got from the
    /// routing `ids` (`[tokens, top_k]`; rows whose `token_seq` is negative are padding).
    pub fn count(ids: &[i32], top_k: usize, token_seq: &[i32], first: usize, local: usize) -> Experts {
        let mut per = vec![0u32; local];
        for (t, row) in ids.chunks(top_k.max(1)).enumerate() {
            if token_seq.get(t).is_none_or(|&s| s < 0) {
                continue;
            }
            for &e in row {
                let l = e as i64 - first as i64;
                if (0..local as i64).contains(&l) {
                    per[l as usize] += 1;
                }
            }
        }
        Experts { hist: per.into_iter().map(|n| (n, 1.0)).collect() }
    }

    /// `sum f(n)` over the local experts.
    pub fn sum(&self, f: impl Fn(f64) -> f64) -> f64 {
        self.hist.iter().map(|&(n, w)| w * f(n as f64)).sum()
    }
}

/// Everything data-dependent about one replay of a program on one rank.
#[derive(Debug, Clone, PartialEq)]
pub struct Load {
    pub tokens: Tokens,
    /// The routing seen by every MoE step (the prediction assumes the same at every layer).
    pub experts: Experts,
    /// Rows whose token id falls in this rank's slice of the vocabulary (the embedding rows it reads).
    pub embed_rows: f64,
    /// Rows of `logit_rows` that name a token (the rows `gather_rows` copies).
    pub logit_rows: f64,
    /// The rank predicted (which tokens its share of a sequence-parallel indexer takes); the
    /// predictions take the last, whose tokens are the latest (it scores the most positions).
    pub rank: usize,
}

impl Load {
    /// A decode step: `batch` real sequences (the first rows of the program), each at `context`
    /// cached positions after this step's token (its position is `context - 1`).
    pub fn decode(rows: usize, batch: usize, context: usize, experts: impl Fn(usize) -> Experts, ranks: usize) -> Load {
        Load::decode_rows(rows, batch, 1, context, experts, ranks)
    }

    /// A decode step of `batch` sequences with `per_seq` rows each (a speculative step: a
    /// sequence's token and its drafts at the next positions, its rows consecutive as the engine
    /// lays them out), the first row of each at `context - 1`.
    pub fn decode_rows(rows: usize, batch: usize, per_seq: usize, context: usize, experts: impl Fn(usize) -> Experts, ranks: usize) -> Load {
        let per_seq = per_seq.max(1);
        let first = context.saturating_sub(1);
        let real = batch * per_seq;
        let positions = (0..rows).map(|r| (r < real).then_some((first + r % per_seq) as u32)).collect();
        let seqs = (0..rows).map(|r| (r / per_seq) as u32).collect();
        Load { tokens: Tokens { positions, seqs }, experts: experts(real), embed_rows: rows as f64 / ranks.max(1) as f64, logit_rows: real as f64, rank: ranks.saturating_sub(1) }
    }

    /// A prefill chunk of `chunk` real tokens at positions `prefix ..` (one sequence), returning
    /// the logits of its last token.
    pub fn prefill(rows: usize, chunk: usize, prefix: usize, experts: impl Fn(usize) -> Experts, ranks: usize) -> Load {
        let positions = (0..rows).map(|r| (r < chunk).then_some((prefix + r) as u32)).collect();
        Load { tokens: Tokens { positions, seqs: vec![0; rows] }, experts: experts(chunk), embed_rows: rows as f64 / ranks.max(1) as f64, logit_rows: 1.0, rank: ranks.saturating_sub(1) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uniform_routing_has_the_binomial_moments() {
        let e = Experts::uniform(64, 8, 256, 256);
        let experts = e.sum(|_| 1.0);
        let pairs = e.sum(|n| n);
        assert!((experts - 256.0).abs() < 1e-9, "{experts}");
        assert!((pairs - 64.0 * 8.0).abs() < 1e-6, "{pairs}");
        // P(an expert gets a token) = 1 - (1 - 8/256)^64
        let hit = e.sum(|n| if n > 0.0 { 1.0 } else { 0.0 });
        assert!((hit - 256.0 * (1.0 - (1.0f64 - 8.0 / 256.0).powi(64))).abs() < 1e-6, "{hit}");
        let big = Experts::uniform(8192, 8, 256, 32);
        assert!((big.sum(|n| n) - 8192.0 * 8.0 / 8.0).abs() < 1e-3);
    }

    #[test]
    fn counted_routing_skips_padding_and_other_ranks() {
        let ids = [0, 3, 2, 3, 1, 0];
        let e = Experts::count(&ids, 2, &[0, 0, -1], 2, 2);
        assert_eq!(e.hist, vec![(1, 1.0), (2, 1.0)]);
    }
}
