//! What speculative decoding would make of the plan's decode programs. A step that checks `k`
//! drafts for each of `batch` sequences is a decode step of `batch x (1 + k)` rows (the engine
//! feeds a sequence's drafts as rows at its next positions), so its time is the decode program's
//! for that many rows. If each draft is accepted with probability `a` once the ones before it
//! were, a sequence gains `1 + a + ... + a^k` tokens a step. Drafts are free from prompt lookup;
//! a plan with a draft model (`kiln compile --draft mtp-nvfp4`) also gets the draft steps' time
//! the engine spends: one draft step of up to `batch x (1 + k)` rows (the positions the last
//! step accepted, the first draft) and `k - 1` of `batch` rows (each further draft).

use super::{predict_program, uniform_experts, Constants, Load};
use crate::plan::{Plan, ProgramKind};
use serde::Serialize;

/// Per-draft acceptance rates the report gives tokens/s at.
pub const ACCEPTANCE: [f64; 3] = [0.5, 0.7, 0.9];

/// Drafts per sequence the report considers.
pub const MAX_DRAFTS: usize = 3;

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SpeculativeRow {
    pub batch: usize,
    pub context: usize,
    /// Drafts each sequence checks in the step.
    pub drafts: usize,
    /// Decode rows of the step, and the program that runs them.
    pub rows: usize,
    pub program: String,
    pub step_ms: f64,
    pub step_ms_p2p: f64,
    /// The P2P step of `batch` rows without drafts, for comparison.
    pub plain_step_ms_p2p: f64,
    /// The acceptance rate from which the drafts pay (P2P times); None: they never do.
    pub break_even_acceptance: Option<f64>,
    /// Tokens/s (P2P) at each rate of [`ACCEPTANCE`], and with every draft accepted.
    pub tokens_per_s_p2p: Vec<f64>,
    pub tokens_per_s_p2p_all_accepted: f64,
    /// With the plan's draft model: the P2P time of its steps for these drafts, and tokens/s
    /// (P2P) at each rate of [`ACCEPTANCE`] counting them; None without a draft model.
    pub draft_ms_p2p: Option<f64>,
    pub tokens_per_s_p2p_with_draft: Option<Vec<f64>>,
}

/// Tokens a sequence gains from a step checking `drafts` drafts at acceptance `a`.
pub fn expected_tokens(a: f64, drafts: usize) -> f64 {
    (0..=drafts).map(|i| a.powi(i as i32)).sum()
}

/// The acceptance at which [`expected_tokens`] equals `ratio` (the drafted step's time over the
/// plain one's): the rate from which drafting pays; None above `drafts + 1`.
pub fn break_even(ratio: f64, drafts: usize) -> Option<f64> {
    if ratio <= 1.0 {
        return Some(0.0);
    }
    if ratio > (drafts + 1) as f64 {
        return None;
    }
    let (mut lo, mut hi) = (0.0f64, 1.0f64);
    for _ in 0..60 {
        let mid = 0.5 * (lo + hi);
        if expected_tokens(mid, drafts) < ratio {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    Some(hi)
}

/// Every decode batch of the plan with 1..=[`MAX_DRAFTS`] drafts a sequence whose rows a decode
/// program holds, at each of `contexts`.
pub fn rows(plan: &Plan, k: &Constants, contexts: &[usize]) -> Result<Vec<SpeculativeRow>, String> {
    let ranks = plan.ranks();
    let experts = |t: usize| uniform_experts(plan, t);
    let batches: Vec<usize> = plan.programs.iter().filter(|p| !p.is_draft()).filter_map(|p| if let ProgramKind::Decode { batch } = p.kind { Some(batch) } else { None }).collect();
    let mut out = Vec::new();
    for &batch in &batches {
        for &context in contexts {
            // (rows of `per_seq` a sequence, consecutive, at its next positions)
            let program_step = |i: Option<usize>, rows: usize, per_seq: usize| -> Result<Option<(String, f64, f64)>, String> {
                let Some(i) = i else { return Ok(None) };
                let p = &plan.programs[i];
                let perf = predict_program(plan, p, &Load::decode_rows(p.tokens, rows / per_seq, per_seq, context, experts, ranks), k)?;
                Ok(Some((p.name.clone(), perf.step_us(false), perf.step_us(true))))
            };
            let step = |rows: usize, per_seq: usize| program_step(plan.decode_program(rows), rows, per_seq);
            let draft_step = |rows: usize, per_seq: usize| -> Result<Option<f64>, String> { Ok(program_step(plan.draft_program(rows), rows, per_seq)?.map(|(.., p2p)| p2p)) };
            let Some((_, _, plain)) = step(batch, 1)? else { continue };
            for drafts in 1..=MAX_DRAFTS {
                let rows = batch * (1 + drafts);
                let Some((program, nccl, p2p)) = step(rows, 1 + drafts)? else { break };
                let per_s = |a: f64| batch as f64 * expected_tokens(a, drafts) / p2p * 1e6;
                let draft_us = match (draft_step(rows, 1 + drafts)?, draft_step(batch, 1)?) {
                    (Some(first), Some(next)) => Some(first + (drafts - 1) as f64 * next),
                    _ => None,
                };
                out.push(SpeculativeRow {
                    batch,
                    context,
                    drafts,
                    rows,
                    program,
                    step_ms: nccl / 1e3,
                    step_ms_p2p: p2p / 1e3,
                    plain_step_ms_p2p: plain / 1e3,
                    break_even_acceptance: break_even(p2p / plain, drafts),
                    tokens_per_s_p2p: ACCEPTANCE.iter().map(|&a| per_s(a)).collect(),
                    tokens_per_s_p2p_all_accepted: per_s(1.0),
                    draft_ms_p2p: draft_us.map(|d| d / 1e3),
                    tokens_per_s_p2p_with_draft: draft_us.map(|d| ACCEPTANCE.iter().map(|&a| batch as f64 * expected_tokens(a, drafts) / (p2p + d) * 1e6).collect()),
                });
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_step_gains_the_geometric_sum_of_its_acceptances() {
        assert_eq!(expected_tokens(0.0, 3), 1.0);
        assert_eq!(expected_tokens(1.0, 3), 4.0);
        assert!((expected_tokens(0.5, 2) - 1.75).abs() < 1e-12);
    }

    #[test]
    fn break_even_solves_the_sum_for_the_time_ratio() {
        // one draft at 1.3x the time pays from 30 % acceptance
        assert!((break_even(1.3, 1).unwrap() - 0.3).abs() < 1e-9);
        // three drafts at 1.75x: below 50 % (where a step gains 1.875 tokens)
        let a = break_even(1.75, 3).unwrap();
        assert!((expected_tokens(a, 3) - 1.75).abs() < 1e-9 && a < 0.5);
        // a step no slower pays always; one more than k + 1 times slower never
        assert_eq!(break_even(1.0, 2), Some(0.0));
        assert_eq!(break_even(3.5, 2), None);
    }
}
