//! Draft tokens for speculative decoding from the sequence's own text (prompt lookup, vLLM's
//! `ngram` method): where the last few tokens occurred before, guess that what followed them then
//! follows now. The engine feeds the drafts to the model as extra decode rows of the same
//! sequence and keeps them only while each is the token the model chooses anyway (`scheduler`),
//! so drafts change how many tokens a step yields, never which tokens.

/// How drafts are proposed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NgramSpeculation {
    /// Draft tokens per sequence and step, at most.
    pub max_draft: usize,
    /// The longest suffix looked up (the longest match found wins).
    pub max_match: usize,
    /// The shortest suffix worth a draft: one token matches too often to predict much.
    pub min_match: usize,
}

impl NgramSpeculation {
    /// `max_draft` tokens after suffixes of 2 to 4 tokens.
    pub fn new(max_draft: usize) -> NgramSpeculation {
        NgramSpeculation { max_draft, max_match: 4, min_match: 2 }
    }

    /// Up to `max` (and `max_draft`) tokens that followed the latest earlier occurrence of the
    /// longest suffix of `tokens` of `min_match..=max_match` tokens; empty when none occurred.
    /// One backward scan for the last token (~0.1 ms over 200k tokens), each hit checked for how
    /// far back it matches, so a long context does not stall the engine thread.
    pub fn propose(&self, tokens: &[u32], max: usize) -> Vec<u32> {
        let want = self.max_draft.min(max);
        let (Some(&last), true) = (tokens.last(), want > 0) else { return Vec::new() };
        let len = tokens.len();
        let longest = self.max_match.min(len - 1);
        // (match length, where the earlier occurrence ends): the longest, then the latest
        let mut best: Option<(usize, usize)> = None;
        let mut end = len - 1;
        while let Some(e) = tokens[..end].iter().rposition(|&t| t == last) {
            let m = (1..=longest.min(e + 1)).take_while(|&k| tokens[e + 1 - k] == tokens[len - k]).count();
            if m >= self.min_match.max(1) && best.is_none_or(|(b, _)| m > b) {
                best = Some((m, e));
                if m == longest {
                    break;
                }
            }
            end = e;
        }
        best.map_or_else(Vec::new, |(_, e)| tokens[e + 1..(e + 1 + want).min(len)].to_vec())
    }
}

/// How many of each sequence's proposed drafts a step of `base` sequences runs (at most
/// `rows` rows in all), given each draft's expected gain (`gains[s][i]`: the chance that it and
/// every draft of sequence s before it are accepted, so a sequence's gains fall). Drafts are
/// taken in order of gain. Where `cost` prices a step of n rows (any unit), the step runs the
/// number of rows with the most expected tokens per unit of time (every row count is tried, so a
/// dearer bucket that more drafts fill can win), and a draft that would slow decoding is not
/// made; where it does not, every proposed draft runs while rows last.
pub fn draft_counts(base: usize, gains: &[Vec<f64>], rows: usize, mut cost: impl FnMut(usize) -> Option<f64>) -> Vec<usize> {
    let mut order: Vec<(f64, usize)> = gains.iter().enumerate().flat_map(|(s, g)| g.iter().map(move |&g| (g, s))).collect();
    order.sort_by(|x, y| y.0.total_cmp(&x.0));
    order.truncate(rows.saturating_sub(base));
    let mut take = order.len();
    if !order.is_empty() {
        if let Some(plain) = cost(base) {
            let (mut best, mut expected) = (base as f64 / plain, base as f64);
            take = 0;
            for (n, &(gain, _)) in order.iter().enumerate() {
                expected += gain;
                let Some(c) = cost(base + n + 1) else { break };
                if expected / c > best * (1.0 + 1e-9) {
                    best = expected / c;
                    take = n + 1;
                }
            }
        }
    }
    let mut counts = vec![0; gains.len()];
    for &(_, s) in &order[..take] {
        counts[s] += 1;
    }
    counts
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Step costs by rows from a table (None past it).
    fn table(t: &'static [f64]) -> impl FnMut(usize) -> Option<f64> {
        move |rows| t.get(rows - 1).copied()
    }

    #[test]
    fn drafts_run_where_their_expected_tokens_outweigh_their_rows() {
        // one sequence, a draft at one half: 1.5 tokens for 1.25x pays, at a fifth 1.2 does not
        assert_eq!(draft_counts(1, &[vec![0.5]], 8, table(&[1.0, 1.25])), vec![1]);
        assert_eq!(draft_counts(1, &[vec![0.2]], 8, table(&[1.0, 1.25])), vec![0]);
        // three at 0.8 (gains 0.8, 0.64, 0.512): 1.8 / 1.25, 2.44 / 1.6, 2.952 / 1.6: all three
        assert_eq!(draft_counts(1, &[vec![0.8, 0.64, 0.512]], 8, table(&[1.0, 1.25, 1.6, 1.6])), vec![3]);
        // a dear second row that a third and fourth fill: 1.9 / 1.9 is no gain, 3.439 / 2 is
        assert_eq!(draft_counts(1, &[vec![0.9, 0.81, 0.729]], 8, table(&[1.0, 1.9, 2.0, 2.0])), vec![3]);
        // rows at full price never pay
        assert_eq!(draft_counts(2, &[vec![0.9, 0.81], vec![0.7]], 8, |r| Some(r as f64)), vec![0, 0]);
    }

    #[test]
    fn drafts_are_taken_by_gain_across_sequences_within_the_rows() {
        // two sequences, room for two drafts: the likelier ones (0.9 and 0.7, not 0.81 and 0.49)
        let gains = [vec![0.9, 0.81 * 0.5], vec![0.7, 0.49]];
        assert_eq!(draft_counts(2, &gains, 4, |_| Some(1.0)), vec![1, 1]);
        // without a price every proposed draft runs while rows last, likeliest first
        assert_eq!(draft_counts(2, &gains, 5, |_| None), vec![1, 2]);
        assert_eq!(draft_counts(2, &gains, 8, |_| None), vec![2, 2]);
        // no rows to spare, or nothing proposed
        assert_eq!(draft_counts(2, &gains, 2, |_| Some(1.0)), vec![0, 0]);
        assert_eq!(draft_counts(2, &[vec![], vec![]], 8, |_| Some(1.0)), vec![0, 0]);
    }

    #[test]
    fn the_longest_suffix_finds_its_latest_occurrence() {
        let s = NgramSpeculation { max_draft: 3, max_match: 3, min_match: 1 };
        // suffix [7, 8, 9] occurred at 1..4, followed by 4, 5, 6
        assert_eq!(s.propose(&[0, 7, 8, 9, 4, 5, 6, 7, 8, 9], 10), vec![4, 5, 6]);
        // [2, 9] occurred twice: the later one (followed by 5) wins over the earlier (by 3)
        assert_eq!(s.propose(&[2, 9, 3, 1, 2, 9, 5, 2, 9], 10), vec![5, 2, 9]);
        // only a one-token match ([9] at 1), its continuation cut at the caller's limit
        assert_eq!(s.propose(&[1, 9, 4, 6, 9], 1), vec![4]);
    }

    #[test]
    fn no_draft_without_a_long_enough_match() {
        let s = NgramSpeculation::new(4);
        assert!(s.propose(&[1, 2, 3, 4, 5], 8).is_empty());
        // [3, 4] never occurred before; a one-token match ([4]) is below min_match
        assert!(s.propose(&[4, 1, 3, 4], 8).is_empty());
        assert!(s.propose(&[], 8).is_empty() && s.propose(&[5], 8).is_empty());
        assert!(s.propose(&[1, 2, 1, 2], 0).is_empty());
    }

    /// The definition, suffix length by suffix length: the oracle for the scan.
    fn by_definition(s: &NgramSpeculation, tokens: &[u32], max: usize) -> Vec<u32> {
        let (len, want) = (tokens.len(), s.max_draft.min(max));
        for n in (s.min_match.max(1)..=s.max_match.min(len.saturating_sub(1))).rev() {
            let suffix = &tokens[len - n..];
            if let Some(start) = (0..len - n).rev().find(|&i| &tokens[i..i + n] == suffix) {
                return tokens[start + n..(start + n + want).min(len)].to_vec();
            }
        }
        Vec::new()
    }

    #[test]
    fn the_scan_finds_what_the_definition_finds() {
        // short random sequences over a few symbols (many matches, overlaps, ties)
        let mut x: u64 = 0x9e3779b97f4a7c15;
        let mut next = move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        for _ in 0..20_000 {
            let len = (next() % 40) as usize;
            let tokens: Vec<u32> = (0..len).map(|_| (next() % 4) as u32).collect();
            for s in [NgramSpeculation::new(3), NgramSpeculation { max_draft: 5, max_match: 3, min_match: 1 }, NgramSpeculation { max_draft: 1, max_match: 2, min_match: 2 }] {
                for max in [0, 2, 8] {
                    assert_eq!(s.propose(&tokens, max), by_definition(&s, &tokens, max), "{tokens:?} {s:?} max {max}");
                }
            }
        }
    }

    #[test]
    fn a_repeating_pattern_drafts_its_continuation() {
        let s = NgramSpeculation::new(5);
        // period 3: the suffix [a b c a] last occurred one period back
        let t = [10, 11, 12, 10, 11, 12, 10];
        assert_eq!(s.propose(&t, 8), vec![11, 12, 10]);
    }
}
