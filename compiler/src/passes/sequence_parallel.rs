//! The sequence-parallel indexer of long prefill chunks: every rank holds the whole indexer (its
//! projections and keys are replicated), so instead of each rank selecting for every token of a
//! chunk, rank r selects for tokens r, r + R, r + 2R, ... and an all-gather of the lists gives
//! every rank all of them, in token order (row j of the gather is the lists of tokens jR ..
//! jR + R - 1, which is the `[tokens, topk]` layout attention reads). A rank then scores 1/R of
//! the chunk's positions, for one collective of the lists per layer.

use kiln_runtime::perf::{collective_time, Constants};
use kiln_runtime::plan::{BufId, Buffer, GatherPair, KernelFamily, ModelConfig, Op, Program, ProgramKind, ShardChoice, Step};

/// Which prefill programs select their indexer lists across ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SequenceParallel {
    /// Those where, by the performance model, the indexer's FP32 work a rank no longer does
    /// outweighs the all-gather of the lists even for a chunk from position 0 (where the fewest
    /// tokens score: a token sees more than `index_topk` positions only past it).
    Auto,
    /// Every prefill program whose tokens divide by the ranks.
    Always,
    /// None: every rank selects for every token.
    Never,
}

/// By the model's constants, for `tokens` tokens from position 0 (the least indexer work a chunk
/// of that size has) selecting across `ranks` ranks: the scoring time a layer saves and the
/// all-gather of the lists it costs, µs (an indexer of `heads` x `dim` selecting `topk`). The
/// scoring is priced at the FP32 rate alone (where a long chunk's indexer is bound), with a
/// rank's share of blocks filling that fraction of the SMs where it has fewer than `sms` tokens.
pub fn saving_us(tokens: usize, ranks: usize, topk: usize, heads: usize, dim: usize, k: &Constants) -> (f64, f64) {
    // token t sees t + 1 positions and scores them all only where that is more than topk
    let scored: f64 = (topk.min(tokens)..tokens).map(|t| (t + 1) as f64).sum();
    let flops = 2.0 * scored * (heads * dim) as f64;
    let fill = |blocks: usize| (blocks as f64 / k.sms as f64).clamp(1e-9, 1.0);
    let us = |flops: f64, blocks: usize| flops / (k.fp32_tflops * 1e6 * fill(blocks));
    let saved = us(flops, tokens) - us(flops / ranks as f64, tokens / ranks);
    let (nccl, p2p) = collective_time(false, false, (tokens * topk * 4) as f64, ranks, k);
    (saved, p2p.map_or(nccl, |p| p.min(nccl)))
}

/// Whether [`saving_us`] saves more than it costs.
pub fn worth_it(tokens: usize, ranks: usize, topk: usize, heads: usize, dim: usize, k: &Constants) -> bool {
    let (saved, gather) = saving_us(tokens, ranks, topk, heads, dim, k);
    saved > gather
}

/// The decision for `kiln inspect`: which prefill chunks select across ranks, and why.
pub fn choice(chunks: &[usize], ranks: usize, policy: SequenceParallel, cfg: &ModelConfig, k: &Constants) -> Option<ShardChoice> {
    if ranks < 2 || chunks.is_empty() {
        return None;
    }
    let (topk, heads, dim) = (cfg.index_topk, cfg.index_n_heads, cfg.index_head_dim);
    let takes = |t: usize| t % ranks == 0 && policy != SequenceParallel::Never && (policy == SequenceParallel::Always || worth_it(t, ranks, topk, heads, dim, k));
    let list = |want: bool| chunks.iter().filter(|&&t| takes(t) == want).map(|t| t.to_string()).collect::<Vec<_>>().join(", ");
    let (across, whole) = (list(true), list(false));
    let mut how = Vec::new();
    if !across.is_empty() {
        how.push(format!("chunks of {across} tokens: rank r selects for tokens r, r + {ranks}, ..., the lists all-gathered after (one collective a layer)"));
    }
    if !whole.is_empty() {
        how.push(format!("chunks of {whole}: every rank selects for every token"));
    }
    let why = match policy {
        SequenceParallel::Auto => {
            let each = chunks.iter().map(|&t| {
                let (saved, gather) = saving_us(t, ranks, topk, heads, dim, k);
                format!("{t}: {:.0} µs saved, {:.0} µs of gather", saved, gather)
            });
            format!("by the perf model, a layer of a chunk from position 0 (the least a chunk scores): {}", each.collect::<Vec<_>>().join("; "))
        }
        SequenceParallel::Always => "--sequence-parallel-indexer always".into(),
        SequenceParallel::Never => "--sequence-parallel-indexer never".into(),
    };
    Some(ShardChoice { what: "the DSA indexer's top-k in prefill chunks".into(), how: how.join("; "), why })
}

/// Rewrites a prefill program's indexer steps to select across `ranks` ranks where `policy`
/// takes them: each writes this rank's rows into a new `…_local` buffer, gathered into the
/// op's output right after.
pub fn indexer_across_ranks(p: &mut Program, ranks: usize, policy: SequenceParallel, cfg: &ModelConfig, k: &Constants) {
    let take = match policy {
        SequenceParallel::Never => false,
        SequenceParallel::Always => true,
        SequenceParallel::Auto => worth_it(p.tokens, ranks, cfg.index_topk, cfg.index_n_heads, cfg.index_head_dim, k),
    };
    if !take || ranks < 2 || !matches!(p.kind, ProgramKind::Prefill { .. }) || p.tokens % ranks != 0 {
        return;
    }
    let mut i = 0;
    while i < p.steps.len() {
        if let Op::IndexerTopK { across_ranks: across @ false, out, .. } = &mut p.steps[i].op {
            let whole = p.buffers[out.0 as usize].clone();
            let rows = whole.shape[0] / ranks;
            let shape = vec![rows, whole.shape[1]];
            let bytes = (rows * whole.shape[1] * whole.dtype.size()) as u64;
            p.buffers.push(Buffer { name: format!("{}_local", whole.name), dtype: whole.dtype, shape, offset: 0, bytes });
            let local = BufId(p.buffers.len() as u32 - 1);
            let gathered = std::mem::replace(out, local);
            *across = true;
            let gather = Op::AllGather { pairs: vec![GatherPair { input: local, out: gathered }] };
            p.steps.insert(i + 1, Step { op: gather, kernel: KernelFamily::Collective, launches: Vec::new() });
            i += 1;
        }
        i += 1;
    }
}

#[cfg(test)]
mod tests {
    use super::worth_it;
    use kiln_runtime::perf::Constants;

    /// GLM-5's indexer: top-2,048 over 32 heads x 128
    fn glm5(tokens: usize) -> bool {
        worth_it(tokens, 8, 2048, 32, 128, &Constants::SM120A)
    }

    #[test]
    fn long_chunks_select_across_ranks_where_the_scoring_saved_outweighs_the_gather() {
        // 8,192 tokens: 31.5M positions scored x 8,192 flops = 258 GFLOP, 4.3 ms at 60 TFLOP/s;
        // 7/8 of it saved against 25 us + 64 MiB / 40 GB/s = 1.7 ms
        assert!(glm5(8192));
        // 2,048 from position 0: no token sees more than 2,048 positions, nothing to save
        assert!(!glm5(2048));
        // 4,096: 6.3M positions, 0.86 ms, 0.75 ms saved against 0.86 ms of gather
        assert!(!glm5(4096));
    }
}
