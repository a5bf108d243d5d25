//! The DSA indexer top-k: `Op::IndexerTopK` (scores over the cached indexer keys, exact top-k with ties to the lower position).
//!
//! Prefill: one block per token scores and selects (`indexer_topk.ptx` MODE 0), or per two
//! tokens where that still fills the SMs ([`indexer_pairs`]): a chunk's neighbours past `index_topk`
//! score the same keys, so the pair loads each once. A sequence-parallel indexer
//! (`IndexerTopK { across_ranks }`, `passes/sequence_parallel.rs`) launches over the rank's
//! rows only (`STRIDE` = ranks, the rank's first token a per-rank argument). Decode, where
//! that leaves all but a few SMs idle (measured on an H200: 0.55 ms per layer at 8k context),
//! scores in one launch of a block per (token, 64 positions) into the op's `scores` scratch
//! (MODE 1; with an even number of rows a block per two rows, which loads each key once where
//! both are one sequence's: a speculative step's token and drafts) and selects in a second, one block per token (MODE 2: up to `fast_positions` a radix
//! select over every key in shared memory, no sort; longer contexts over several blocks of
//! `select_chunk` positions each, the token's last to finish selecting from their lists, so a
//! 128k context is not one block's serial work). Scores are bit-identical to the CPU's
//! either way, so the selected positions are exact; they are written in ascending order. The two scales are computed here
//! exactly as the CPU does.

use super::{float_flag, fits, numel, of, of_grid, width, Cx, Instance, THREADS};
use crate::kernels::{IndexerTopkArgs, IndexerTopkParams, Ptr};
use kiln_runtime::plan::{DType, IndexKeys, Op, ProgramKind, SplitKLayout};

/// Static shared memory of the template (radix histogram + 8 counters).
const STATIC_SMEM: usize = 256 * 4 + 32;

/// Threads (= positions per tile) of decode's scoring blocks.
const SCORE_THREADS: u32 = 64;

/// Threads of decode's selection block (one per token). Its loop over the scores is bound by
/// latency, one load and two barriers per tile of this many positions (an H200 took 48 µs for
/// 7.9k positions with 256), so it takes the most a block may have.
pub const SELECT_THREADS: u32 = 1024;

/// Positions up to which decode's selection holds every key (4 bytes) in shared memory, with no
/// candidates and no sort (`FAST`): a multiple of its threads, the most the block's shared
/// memory takes (24,576 on sm_120a: contexts up to 24k).
pub fn fast_positions(smem_limit: u32) -> u32 {
    let keys = (smem_limit as usize).saturating_sub(STATIC_SMEM) / 4;
    (keys.min(u16::MAX as usize) / SELECT_THREADS as usize * SELECT_THREADS as usize) as u32
}

/// Positions per selecting block (`CHUNK`) for contexts of up to `positions`, where they may be
/// longer than the `fast` one block selects with every key in shared memory; 0 where none is or
/// no chunk fits. Of the chunks that fit (at least 2 `topk`, so a chunk's list of keys and
/// positions fits over its scores, the last chunk's list inside the row too; at most `fast`; at
/// most `fast / topk` chunks, so their lists fit the last block's shared memory), the one that
/// moves the fewest words at the longest context: a chunk's scores and its list, then the last
/// block's reads of every list and its output (each block runs on one SM, so these add up).
/// For a number of chunks the smallest chunk that makes it moves the fewest words (and leaves
/// the most room after the last chunk), so only those are priced.
pub fn select_chunk(positions: usize, topk: usize, fast: u32) -> u32 {
    let fast = fast as usize;
    if fast == 0 || positions <= fast || topk == 0 {
        return 0;
    }
    let words = |c: usize| c + 2 * topk + positions.div_ceil(c) * topk + 2 * topk;
    let fits = |c: usize| {
        let chunks = positions.div_ceil(c);
        c <= fast && chunks * topk <= fast && (chunks - 1) * c + 2 * topk <= positions
    };
    (1..=fast / topk).map(|chunks| positions.div_ceil(chunks).max(2 * topk)).filter(|&c| fits(c)).min_by_key(|&c| (words(c), c)).unwrap_or(0) as u32
}

/// Candidate buffer entries for a top-k of `p2` (its power of two) in blocks of `threads`: room
/// for the `topk` kept plus at least one tile of `threads` new candidates (and at least `p2` of
/// them, so compactions stay rare); even, so the f32 arrays after the buffer stay 16-byte aligned.
pub(crate) fn candidate_capacity(p2: usize, threads: u32) -> usize {
    (p2 + p2.max(threads as usize)).next_multiple_of(2)
}

/// The fused instance with a block per two tokens (`TT` = 2), where it takes them: a prefill
/// program (its tokens one sequence's, in position order), an even number of tokens, half of
/// them still a block for every SM (the scoring's FP32 work stays the same per block while the
/// blocks halve, so fewer would idle SMs), and both tokens' regions in shared memory. Past
/// `index_topk` the two tokens score the same keys (the second one more), so the pair reads each
/// key once for both: half the key reads of a chunk at a long context. None where it does not
/// apply.
pub fn indexer_pairs(params: IndexerTopkParams, tokens: usize, prefill: bool, sms: u32, smem_limit: u32) -> Result<Option<IndexerTopkParams>, String> {
    if !prefill || params.mode != 0 || tokens % 2 != 0 || tokens / 2 < sms as usize {
        return Ok(None);
    }
    let pair = IndexerTopkParams { tt: 2, ..params };
    Ok((pair.dynamic_smem()? as usize + STATIC_SMEM <= smem_limit as usize).then_some(pair))
}

pub(super) fn instances(cx: &Cx, op: &Op) -> Result<Vec<Instance>, String> {
    let Op::IndexerTopK { q, head_weights, layer, topk, across_ranks, scores, out } = *op else {
        return Err("not an indexer top-k".into());
    };
    let (p, kv) = (cx.program, &cx.plan.memory.kv);
    let heads = width(p, head_weights);
    let all_tokens = numel(p, head_weights) / heads.max(1);
    // across ranks: this rank's rows, every ranks-th token (only prefill's fused launch takes them)
    let stride = if across_ranks { cx.plan.ranks() } else { 1 };
    let tokens = all_tokens / stride;
    let dim = kv.index_dim;
    if tokens == 0 || heads == 0 || topk == 0 || width(p, q) != heads * dim || numel(p, out) != tokens * topk || all_tokens % stride != 0 {
        return Err(format!("an indexer top-k over {all_tokens} tokens x {heads} heads x {dim} (top-{topk}, {tokens} rows) is outside the template"));
    }
    if across_ranks && p.buffer(scores).bytes != 0 {
        return Err("a sequence-parallel indexer with decode's score scratch".into());
    }
    if kv.dtype != DType::BF16 || p.buffer(out).dtype != DType::I32 {
        return Err("the indexer top-k template needs a BF16 KV cache and I32 output".into());
    }
    if heads > THREADS as usize {
        return Err(format!("{heads} indexer heads exceed the {THREADS} threads that load the head weights"));
    }
    // 16-byte key loads: the key's offset, the row pitch and the key length are multiples of 8
    // values (BF16), or 16 codes (FP8; the scale after them)
    let (row, koff) = (kv.row_elems(), kv.latent_dim + kv.rope_dim);
    let fp8 = kv.index_keys == IndexKeys::Fp8;
    if dim % if fp8 { 16 } else { 8 } != 0 || row % 8 != 0 || koff % 8 != 0 || kv.rope_dim % 2 != 0 || kv.rope_dim > dim {
        return Err(format!("indexer key dim {dim} (row {row}, offset {koff}, rope {}, {} keys) is outside the template", kv.rope_dim, kv.index_keys.name()));
    }
    let p2 = topk.next_power_of_two();
    let cap = candidate_capacity(p2, THREADS);
    // decode's selection keeps every key of up to `fast` positions in its candidate buffer
    let fast = fast_positions(cx.smem_limit);
    let select_cap = candidate_capacity(p2, SELECT_THREADS).max(fast as usize / 2);
    let what = format!("an indexer top-{topk} over {heads} x {dim}");
    // the fused (and prefill) launch: candidates, q and weights; decode's selection: candidates
    fits(cap * 8 + heads * dim * 4 + heads * 4 + STATIC_SMEM, cx.smem_limit, &what)?;
    fits(select_cap * 8 + STATIC_SMEM, cx.smem_limit, &what)?;
    let params = IndexerTopkParams {
        arch: cx.arch,
        heads: heads as u32,
        dim: dim as u32,
        rope: kv.rope_dim as u32,
        row: row as u32,
        koff: koff as u32,
        key_fp8: u32::from(fp8),
        page: kv.page_size as u32,
        pps: kv.pages_per_seq as u32,
        topk: topk as u32,
        p2: p2 as u32,
        cap: cap as u32,
        threads: THREADS,
        q_bf16: float_flag(p.buffer(q).dtype, "the indexer q")?,
        w_bf16: float_flag(p.buffer(head_weights).dtype, "the head weights")?,
        mode: 0,
        fast: 0,
        chunk: 0,
        tt: 1,
        stride: stride as u32,
    };
    let inputs = &p.inputs;
    let args = IndexerTopkArgs {
        q: Ptr::Buffer(q),
        w: Ptr::Buffer(head_weights),
        positions: Ptr::Buffer(inputs.positions),
        token_seq: Ptr::Buffer(inputs.token_seq),
        page_table: Ptr::Buffer(inputs.page_table),
        kv: Ptr::KvCache(layer as u32),
        rope: Ptr::RopeTable,
        out: Ptr::Buffer(out),
        scores: Ptr::Buffer(scores),
        head_scale: (heads as f32).powf(-0.5),
        dim_scale: (dim as f32).powf(-0.5),
        splitk: Ptr::Buffer(out),
        first_token: u32::from(across_ranks),
    };
    // (the shape verifier has checked `scores`: empty, or a score per token and position)
    if p.buffer(scores).bytes == 0 {
        let prefill = matches!(p.kind, ProgramKind::Prefill { .. });
        if let Some(pair) = indexer_pairs(params, tokens, prefill, cx.consts.sms, cx.smem_limit)? {
            return Ok(vec![of(&pair, (tokens / 2) as u32, args.launch_args())]);
        }
        return Ok(vec![of(&params, tokens as u32, args.launch_args())]);
    }
    let positions = kv.pages_per_seq * kv.page_size;
    // Scoring blocks of 64 threads (one position each; at least a thread per head for the head
    // weights): tiles of 64 positions, so a batch-1 step at 8k context fills 128 blocks, not 32.
    // Blocks per token: enough for two per SM over the batch, never more than the tiles of the
    // longest context; each loops over its tiles (the grid is fixed at graph capture, the context
    // is not, and blocks past a short context only exit).
    let score_threads = (heads.next_multiple_of(32) as u32).max(SCORE_THREADS);
    let tiles = positions.div_ceil(score_threads as usize);
    // With an even number of rows, a block per two rows (`TT` = 2): where both are one
    // sequence's (a speculative step's token and drafts, a prompt's tail taken as decode rows)
    // each key is loaded once for both; other pairs take their rows one after the other. The
    // blocks along y stay what a block per row would have (more would stage q in more blocks):
    // a block for every SM, each with twice the rows
    let tt = if tokens % 2 == 0 { 2 } else { 1 };
    let row_blocks = tokens / tt;
    let per_token = (2 * cx.consts.sms as usize).div_ceil(tokens).clamp(1, tiles) as u32;
    let score = IndexerTopkParams { mode: 1, threads: score_threads, tt: tt as u32, ..params };
    // The selection's result is the exact top-k in ascending position order whatever the block
    // size; contexts past `fast` are selected in chunks, a block each, counted in at a counter
    // per token in the split-K region. Only where the grid of every token's chunks fits on the
    // SMs at once: at short contexts all but a block per token exit, and a second wave of such
    // blocks (1,024 threads and most of the shared memory each) would cost what the model
    // does not see; larger batches keep a block per token, which fills more of the GPU anyway.
    let chunk = select_chunk(positions, topk, fast);
    let chunks = if chunk > 0 { positions.div_ceil(chunk as usize) } else { 1 };
    let (chunk, chunks) = if chunk > 0 && tokens * chunks <= cx.consts.sms as usize && tokens as u64 <= SplitKLayout::COUNTERS { (chunk, chunks as u32) } else { (0, 1) };
    let select = IndexerTopkParams { mode: 2, threads: SELECT_THREADS, cap: select_cap as u32, fast, chunk, ..params };
    let select_args = IndexerTopkArgs { splitk: if chunk > 0 { Ptr::SplitKRegion } else { Ptr::Buffer(out) }, ..args };
    Ok(vec![
        of_grid(&score, [row_blocks as u32, per_token, 1], score_threads, args.launch_args()),
        of_grid(&select, [tokens as u32, chunks, 1], SELECT_THREADS, select_args.launch_args()),
    ])
}

#[cfg(test)]
mod tests {
    use super::{indexer_pairs, select_chunk};
    use crate::kernels::IndexerTopkParams;

    #[test]
    fn pairs_take_prefill_chunks_whose_pairs_fill_the_sms_and_fit() {
        // GLM-5 tp8's fused instance (32 heads x 128, top-2048: 49,280 B a token) on sm_120a
        let p = IndexerTopkParams { arch: 120, heads: 32, dim: 128, rope: 64, row: 704, koff: 576, page: 64, pps: 3168, topk: 2048, p2: 2048, cap: 4096, threads: 256, q_bf16: 1, w_bf16: 0, mode: 0, fast: 0, chunk: 0, tt: 1, stride: 1, key_fp8: 0 };
        let pair = |tokens, prefill, limit| indexer_pairs(p, tokens, prefill, 188, limit).unwrap().map(|q| q.tt);
        assert_eq!(pair(512, true, 101_376), Some(2));
        assert_eq!(pair(376, true, 101_376), Some(2));
        // 187 pairs leave an SM idle; decode; an odd count; two regions past the limit
        assert_eq!(pair(374, true, 101_376), None);
        assert_eq!(pair(512, false, 101_376), None);
        assert_eq!(pair(513, true, 101_376), None);
        assert_eq!(pair(512, true, 99_615), None);
        assert_eq!(pair(512, true, 99_616), Some(2));
        // the split launches never pair
        assert_eq!(indexer_pairs(IndexerTopkParams { mode: 1, ..p }, 512, true, 188, 101_376).unwrap(), None);
    }

    #[test]
    fn the_chunk_is_the_one_that_moves_the_fewest_words_and_fits() {
        // GLM-5 (202,752 positions, top-2048, 24,576 keys a block): words = chunk + 2,048 x
        // chunks (+ 8,192 either way), least near sqrt(2,048 x 202,752) = 20,377; 10 chunks
        // from 20,276 (the smallest chunk of 10) give 40,756 against 40,960 for 9 (22,528) and
        // for 11 (18,432)
        assert_eq!(select_chunk(202_752, 2048, 24_576), 20_276);
        // one block takes contexts up to FAST
        assert_eq!(select_chunk(24_576, 2048, 24_576), 0);
        // 300,000 positions would need chunks of 25,000 to leave at most 12 lists: more than a block holds
        assert_eq!(select_chunk(300_000, 2048, 24_576), 0);
        // 5,120 positions, top-2048, FAST 4,096: the one chunk size (4,096) would put the last
        // chunk's list (4,096 words from position 4,096) past the row
        assert_eq!(select_chunk(5_120, 2048, 4_096), 0);
    }
}
