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
    pub fn propose(&self, tokens: &[u32], max: usize) -> Vec<u32> {
        let want = self.max_draft.min(max);
        if want == 0 {
            return Vec::new();
        }
        let len = tokens.len();
        for n in (self.min_match.max(1)..=self.max_match.min(len.saturating_sub(1))).rev() {
            let suffix = &tokens[len - n..];
            // the latest start before the suffix itself; what followed it may run into the suffix
            if let Some(start) = (0..len - n).rev().find(|&s| &tokens[s..s + n] == suffix) {
                let from = start + n;
                return tokens[from..(from + want).min(len)].to_vec();
            }
        }
        Vec::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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

    #[test]
    fn a_repeating_pattern_drafts_its_continuation() {
        let s = NgramSpeculation::new(5);
        // period 3: the suffix [a b c a] last occurred one period back
        let t = [10, 11, 12, 10, 11, 12, 10];
        assert_eq!(s.propose(&t, 8), vec![11, 12, 10]);
    }
}
