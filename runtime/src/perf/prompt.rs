//! Time to first token: a prompt prefilled from position 0 in the pieces the runtime runs
//! ([`Plan::next_prefill_piece`], decode pieces allowed as on the CUDA backend, chosen by the
//! model's default constants as the runtime chooses them), each piece's predicted step summed.
//! The step of a long prompt's later chunks grows with the context they attend over (the
//! indexer scores every cached key, attention reads its selection), which the prefill table's
//! rows from position 0 do not show.

use super::{predict_program, program_step_us, uniform_experts, Constants, Load};
use crate::plan::{Plan, PrefillPiece};
use serde::Serialize;

/// Prompt lengths the report predicts (those the plan's context holds).
pub const PROMPTS: [usize; 4] = [8192, 32768, 65536, 131072];

/// One piece of a prompt's prefill: a chunk of a prefill program, or rows of a decode step.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PromptPiece {
    pub program: String,
    pub first_position: usize,
    pub tokens: usize,
    pub step_ms: f64,
    pub step_ms_p2p: f64,
}

/// A prompt of `tokens` tokens from position 0, through its last token's logits.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PromptRow {
    pub tokens: usize,
    pub ttft_ms: f64,
    pub tokens_per_s: f64,
    pub ttft_ms_p2p: f64,
    pub tokens_per_s_p2p: f64,
    pub pieces: Vec<PromptPiece>,
}

/// The rows for each of `prompts` (in tokens) the plan's context holds.
pub fn rows(plan: &Plan, k: &Constants, prompts: &[usize]) -> Result<Vec<PromptRow>, String> {
    prompts.iter().filter(|&&n| n > 0 && n <= plan.memory.kv.max_context).map(|&n| row(plan, k, n)).collect()
}

fn row(plan: &Plan, k: &Constants, tokens: usize) -> Result<PromptRow, String> {
    let experts = |t: usize| uniform_experts(plan, t);
    let mut pieces = Vec::new();
    let mut done = 0;
    while done < tokens {
        let next = plan.next_prefill_piece(tokens - done, done, true, |index, context| program_step_us(plan, index, context)).ok_or("the plan has no prefill program")?;
        let (program, taken, load) = match next {
            PrefillPiece::Prefill { program, tokens: m } => (program, m, Load::prefill(plan.programs[program].tokens, m, done, experts, plan.ranks())),
            // the sequence's next rows, each at its own position
            PrefillPiece::Decode { program, rows } => (program, rows, Load::decode_rows(plan.programs[program].tokens, 1, rows, done + 1, experts, plan.ranks())),
        };
        if taken == 0 {
            return Err(format!("the plan's {} takes no tokens of a prompt at position {done}", plan.programs[program].name));
        }
        let perf = predict_program(plan, &plan.programs[program], &load, k)?;
        pieces.push(PromptPiece { program: plan.programs[program].name.clone(), first_position: done, tokens: taken, step_ms: perf.step_us(false) / 1e3, step_ms_p2p: perf.step_us(true) / 1e3 });
        done += taken;
    }
    let ttft_ms: f64 = pieces.iter().map(|p| p.step_ms).sum();
    let ttft_ms_p2p: f64 = pieces.iter().map(|p| p.step_ms_p2p).sum();
    Ok(PromptRow { tokens, ttft_ms, tokens_per_s: tokens as f64 / ttft_ms * 1e3, ttft_ms_p2p, tokens_per_s_p2p: tokens as f64 / ttft_ms_p2p * 1e3, pieces })
}

/// The pieces as runs of one program: `(program, count)` in order.
pub fn runs(pieces: &[PromptPiece]) -> Vec<(&str, usize)> {
    let mut out: Vec<(&str, usize)> = Vec::new();
    for p in pieces {
        match out.last_mut() {
            Some((name, n)) if *name == p.program => *n += 1,
            _ => out.push((&p.program, 1)),
        }
    }
    out
}
