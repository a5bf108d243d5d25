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
    /// Where, by the performance model, the indexer's FP32 work a rank no longer does outweighs
    /// the all-gather of the lists: a chunk size where it does even from position 0 (where the
    /// fewest tokens score: a token sees more than `index_topk` positions only past it) in its
    /// program; one where it does only deeper in a context in a second program of that size,
    /// which the runtime takes for chunks from that position on.
    Auto,
    /// Every prefill program whose tokens divide by the ranks.
    Always,
    /// None: every rank selects for every token.
    Never,
    /// Every prefill chunk size whose tokens divide by the ranks gets a second program that
    /// selects across ranks, for chunks from this position on (to test the runtime's choice of
    /// program on models too small for `Auto` to make one).
    From(usize),
}

/// The indexer's shape, as the decision prices it.
#[derive(Debug, Clone, Copy)]
pub struct Indexer {
    pub topk: usize,
    pub heads: usize,
    pub dim: usize,
}

impl Indexer {
    pub fn of(cfg: &ModelConfig) -> Indexer {
        Indexer { topk: cfg.index_topk, heads: cfg.index_n_heads, dim: cfg.index_head_dim }
    }
}

/// By the model's constants, for a chunk of `tokens` tokens from position `from` selecting
/// across `ranks` ranks: the scoring time a layer saves and the all-gather of the lists it
/// costs, µs. The scoring is priced at the FP32 rate alone (where a long chunk's indexer is
/// bound), a rank's share of blocks filling that fraction of the SMs where it has fewer than
/// `sms` tokens (below that, selecting across ranks saves less, or costs).
pub fn saving_us(tokens: usize, from: usize, ranks: usize, ix: Indexer, k: &Constants) -> (f64, f64) {
    // the token at position p sees p + 1 positions and scores them all only past topk
    let scored: f64 = (from..from + tokens).map(|p| (p + 1) as f64).filter(|&n| n > ix.topk as f64).sum();
    let flops = 2.0 * scored * (ix.heads * ix.dim) as f64;
    let fill = |blocks: usize| (blocks as f64 / k.sms as f64).clamp(1e-9, 1.0);
    let us = |flops: f64, blocks: usize| flops / (k.fp32_tflops * 1e6 * fill(blocks));
    let saved = us(flops, tokens) - us(flops / ranks as f64, tokens / ranks);
    let (nccl, p2p) = collective_time(false, false, (tokens * ix.topk * 4) as f64, ranks, k);
    (saved, p2p.map_or(nccl, |p| p.min(nccl)))
}

/// The first position from which chunks of `tokens` tokens save more by [`saving_us`] than the
/// gather costs, up to `last` (the saving grows with the position, so a binary search finds
/// it); None where even `last` does not, or the tokens do not split over the ranks.
pub fn paying_from(tokens: usize, ranks: usize, ix: Indexer, k: &Constants, last: usize) -> Option<usize> {
    let pays = |from: usize| {
        let (saved, gather) = saving_us(tokens, from, ranks, ix, k);
        saved > gather
    };
    if ranks < 2 || tokens % ranks != 0 || !pays(last) {
        return None;
    }
    let (mut lo, mut hi) = (0, last);
    while lo < hi {
        let mid = lo + (hi - lo) / 2;
        if pays(mid) {
            hi = mid;
        } else {
            lo = mid + 1;
        }
    }
    Some(lo)
}

/// From which position chunks of `tokens` tokens select across ranks under `policy` (0: every
/// chunk of that size; a later one: a variant program for chunks from there); None: never.
pub fn across_from(tokens: usize, ranks: usize, policy: SequenceParallel, ix: Indexer, k: &Constants, max_context: usize) -> Option<usize> {
    match policy {
        SequenceParallel::Never => None,
        SequenceParallel::Always => (ranks > 1 && tokens % ranks == 0).then_some(0),
        SequenceParallel::Auto => paying_from(tokens, ranks, ix, k, max_context.checked_sub(tokens)?),
        SequenceParallel::From(from) => (ranks > 1 && tokens % ranks == 0 && from + tokens <= max_context).then_some(from),
    }
}

/// Makes the prefill programs select across ranks where [`across_from`] says: a chunk size from
/// position 0 in its own program, one from a later position in a copy of it placed after it
/// (`{name}_from_{position}`, `Program::from_position`).
pub fn apply(programs: &mut Vec<Program>, ranks: usize, policy: SequenceParallel, cfg: &ModelConfig, k: &Constants, max_context: usize) {
    let mut i = 0;
    while i < programs.len() {
        if matches!(programs[i].kind, ProgramKind::Prefill { .. }) && programs[i].from_position == 0 {
            match across_from(programs[i].tokens, ranks, policy, Indexer::of(cfg), k, max_context) {
                Some(0) => indexer_across_ranks(&mut programs[i], ranks),
                Some(from) => {
                    let mut deep = programs[i].clone();
                    deep.name = format!("{}_from_{from}", deep.name);
                    deep.from_position = from;
                    indexer_across_ranks(&mut deep, ranks);
                    programs.insert(i + 1, deep);
                    i += 1;
                }
                None => {}
            }
        }
        i += 1;
    }
}

/// The decision for `kiln inspect`: which prefill chunks select across ranks, and why.
pub fn choice(chunks: &[usize], ranks: usize, policy: SequenceParallel, cfg: &ModelConfig, k: &Constants, max_context: usize) -> Option<ShardChoice> {
    if ranks < 2 || chunks.is_empty() {
        return None;
    }
    let ix = Indexer::of(cfg);
    let each: Vec<String> = chunks
        .iter()
        .map(|&t| match across_from(t, ranks, policy, ix, k, max_context) {
            Some(0) => format!("{t}: across ranks"),
            Some(from) => format!("{t}: across ranks from position {from} (a second program), every rank every token before"),
            None => format!("{t}: every rank every token"),
        })
        .collect();
    let how = format!("rank r selects for tokens r, r + {ranks}, ..., the lists all-gathered after (one collective a layer), by chunk size: {}", each.join("; "));
    let why = match policy {
        SequenceParallel::Auto => {
            let at = |t: usize, from: usize| {
                let (saved, gather) = saving_us(t, from, ranks, ix, k);
                format!("{t} from {from}: {saved:.0} µs saved, {gather:.0} µs of gather")
            };
            let zero: Vec<String> = chunks.iter().map(|&t| at(t, 0)).collect();
            format!("by the perf model, a layer of a chunk (FP32 scoring a rank stops doing against the gather; the saving grows with the chunk's position): {}", zero.join("; "))
        }
        SequenceParallel::Always => "--sequence-parallel-indexer always".into(),
        SequenceParallel::Never => "--sequence-parallel-indexer never".into(),
        SequenceParallel::From(from) => format!("--sequence-parallel-indexer from:{from}"),
    };
    Some(ShardChoice { what: "the DSA indexer's top-k in prefill chunks".into(), how, why })
}

/// Rewrites a prefill program's indexer steps to select across `ranks` ranks: each writes this
/// rank's rows into a new `…_local` buffer, gathered into the op's output right after.
fn indexer_across_ranks(p: &mut Program, ranks: usize) {
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
    use super::{across_from, paying_from, saving_us, Indexer, SequenceParallel};
    use kiln_runtime::perf::Constants;

    /// GLM-5's indexer: top-2,048 over 32 heads x 128
    const GLM5: Indexer = Indexer { topk: 2048, heads: 32, dim: 128 };

    #[test]
    fn chunks_select_across_ranks_from_where_the_scoring_saved_outweighs_the_gather() {
        let k = Constants::SM120A;
        let from = |tokens| across_from(tokens, 8, SequenceParallel::Auto, GLM5, &k, 202_752);
        // 8,192 tokens from 0: 31.5M positions scored x 8,192 flops = 258 GFLOP, 4.3 ms at
        // 60 TFLOP/s; 7/8 of it saved against 25 µs + 64 MiB / 40 GB/s = 1.7 ms
        assert_eq!(from(8192), Some(0));
        // 2,048 from position 0 scores nothing (no token sees more than 2,048 positions); deeper
        // every token scores: 2 x 2,048 x (p + 1,024) x 4,096 flops, 7/8 of it saved, against
        // 25 µs + 16 MiB / 40 GB/s = 444 µs, from about p = 800 (less where tokens below
        // top-k score nothing)
        let f2048 = from(2048).unwrap();
        assert!((800..2048).contains(&f2048), "{f2048}");
        // 512: a rank's 64 blocks fill a third of the SMs, so it saves 1 - 8 x 64 / 188 of the
        // time only, against 130 µs: from a few thousand positions
        let f512 = from(512).unwrap();
        assert!((2048..8192).contains(&f512), "{f512}");
        // 128 and 32: a rank's 16 or 4 blocks take longer than all 128 or 32 did
        assert_eq!((from(128), from(32)), (None, None));
        for (t, f) in [(2048, f2048), (512, f512)] {
            let (saved, gather) = saving_us(t, f, 8, GLM5, &k);
            let (before, _) = saving_us(t, f - 1, 8, GLM5, &k);
            assert!(saved > gather && before <= gather, "{t} from {f}: the first position that pays");
        }
        // a context too short for the deep chunks; tokens that do not split; the policies
        assert_eq!(paying_from(2048, 8, GLM5, &k, 500), None);
        assert_eq!(paying_from(2044, 8, GLM5, &k, 200_000), None);
        assert_eq!(across_from(128, 8, SequenceParallel::Always, GLM5, &k, 202_752), Some(0));
        assert_eq!(across_from(8192, 8, SequenceParallel::Never, GLM5, &k, 202_752), None);
        assert_eq!(across_from(8192, 1, SequenceParallel::Always, GLM5, &k, 202_752), None);
        assert_eq!(across_from(16, 2, SequenceParallel::From(20), GLM5, &k, 1024), Some(20));
        assert_eq!(across_from(16, 2, SequenceParallel::From(1010), GLM5, &k, 1024), None);
    }
}
