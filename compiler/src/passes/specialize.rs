//! Shape specialisation: one program per bucket (prefill chunk sizes, decode batch sizes) with
//! every dimension fixed, so each program can be captured as one CUDA graph.

use crate::graph::Graph;
use crate::passes::lower::GROUP_MAX;
use kiln_runtime::plan::{attention_splits_cap, AttentionForm, BufId, Buffer, Dim, Epilogue, GroupMember, GroupNorm, LinearWeights, Op, Program, ProgramInputs, ProgramKind, ResidualNorm, Step};

/// The concrete sizes of one bucket.
#[derive(Debug, Clone, Copy)]
pub struct Bucket {
    pub kind: ProgramKind,
    pub tokens: usize,
    pub seqs: usize,
    pub logit_rows: usize,
    pub pages_per_seq: usize,
    /// A program of the draft model (decode-shaped: `Decode { batch }`, every row's logits).
    pub draft: bool,
}

/// Logits returned by a prefill chunk: every row when that stays under this many bytes,
/// otherwise the largest power of two that does (serving needs one row per sequence).
pub const PREFILL_LOGITS_BUDGET: usize = 64 << 20;

/// The programs' shapes: prefill chunks, decode batches and, with a draft model, a draft
/// program per decode batch.
pub fn buckets(prefill_chunks: &[usize], decode_batches: &[usize], vocab: usize, pages_per_seq: usize, draft: bool) -> Vec<Bucket> {
    let mut out = Vec::new();
    for &chunk in prefill_chunks {
        let max_rows = (PREFILL_LOGITS_BUDGET / (vocab * 4)).max(1);
        let rows = if chunk <= max_rows { chunk } else { 1 << max_rows.ilog2() };
        out.push(Bucket { kind: ProgramKind::Prefill { chunk }, tokens: chunk, seqs: 1, logit_rows: rows, pages_per_seq, draft: false });
    }
    let kinds: &[bool] = if draft { &[false, true] } else { &[false] };
    for &d in kinds {
        for &batch in decode_batches {
            out.push(Bucket { kind: ProgramKind::Decode { batch }, tokens: batch, seqs: batch, logit_rows: batch, pages_per_seq, draft: d });
        }
    }
    out
}

/// Decode: an all-reduce of the sub-layer output that the next rmsnorm adds into the residual
/// takes over that rmsnorm (`AllReduce { residual, norm }`: each layer's input norm after the
/// first, the norm before the MoE, the final norm), so that the one-shot P2P kernel adds and
/// normalises in its own launch instead of an add and a norm launch (with NCCL both stay
/// launches, after the collective). Before [`norms_into_groups`]: the P2P kernel reads a row
/// once for its norm, where a group's `NORM` form has every block sum the whole row's squares
/// (the plan is made for the P2P path: on NCCL the input norm is a launch again). Prefill keeps
/// the add in its one-block-per-row norm, where it costs no launch.
fn residual_norms_into_all_reduces(steps: &mut Vec<Step>) {
    let mut i = 1;
    while i < steps.len() {
        if let (Op::AllReduce { buf, residual: None, norm: None }, Op::RmsNorm { input, residual: Some(r), weight, eps, out }) = (&steps[i - 1].op, &steps[i].op) {
            if input == buf && out != r {
                let (r, norm) = (*r, ResidualNorm { weight: *weight, eps: *eps, out: *out });
                let Op::AllReduce { residual, norm: fused, .. } = &mut steps[i - 1].op else { unreachable!("matched an all-reduce") };
                (*residual, *fused) = (Some(r), Some(norm));
                steps.remove(i);
                continue;
            }
        }
        i += 1;
    }
}

/// Decode: BF16 linears of the same activations become one `LinearGroup` (q_a, kv_a and the
/// indexer's wk and head weights all read the normed hidden state; q_b and the indexer's wq_b
/// read q_a), which lowering may compute in one launch instead of one each. A later linear joins
/// the first (up to [`GROUP_MAX`]) when no step between them writes its input or reads or
/// writes its output, so moving it up changes nothing another step sees.
fn group_linears_sharing_input(steps: &mut Vec<Step>) {
    let member = |op: &Op| match op {
        Op::Linear { input, weights: LinearWeights::Bf16 { weight }, parts, k, epilogue: Epilogue::None, out } if parts.len() == 1 => {
            Some((*input, *k, GroupMember { weight: *weight, rows: parts[0].rows, out: *out }))
        }
        _ => None,
    };
    let mut i = 0;
    while i < steps.len() {
        let Some((input, k, first)) = member(&steps[i].op) else {
            i += 1;
            continue;
        };
        let mut members = vec![first];
        let mut j = i + 1;
        while j < steps.len() && members.len() < GROUP_MAX {
            // (the input and K first: the scan over the steps between is for members only)
            if let Some((_, _, g)) = member(&steps[j].op).filter(|(x, kk, _)| *x == input && *kk == k) {
                let between = &steps[i + 1..j];
                if between.iter().all(|s| !s.op.reads().contains(&g.out) && !s.op.writes().contains(&g.out)) {
                    members.push(g);
                    steps.remove(j);
                    continue;
                }
            }
            if steps[j].op.writes().contains(&input) {
                break;
            }
            j += 1;
        }
        if members.len() > 1 {
            steps[i].op = Op::LinearGroup { input, norm: None, k, members };
        }
        i += 1;
    }
}

/// Decode: an RMSNorm (no residual) whose rows only the next step reads, a `LinearGroup`,
/// becomes the group's `norm` (q_a's norm before q_b and wq_b; the first layer's input norm, which
/// has no all-reduce before it), so that lowering may normalise inside the group's launch.
/// The group then reads the norm's input; the normed rows become its scratch.
fn norms_into_groups(steps: &mut Vec<Step>) {
    let mut i = 0;
    while i + 1 < steps.len() {
        let (a, b) = (&steps[i].op, &steps[i + 1].op);
        if let (Op::RmsNorm { input, residual: None, weight, eps, out }, Op::LinearGroup { input: x, norm: None, .. }) = (a, b) {
            let (input, weight, eps, out) = (*input, *weight, *eps, *out);
            let read_elsewhere = steps.iter().enumerate().any(|(j, s)| j != i + 1 && s.op.reads().contains(&out));
            if *x == out && input != out && !read_elsewhere {
                let Op::LinearGroup { input: x, norm, .. } = &mut steps[i + 1].op else { unreachable!("matched a group") };
                *x = input;
                *norm = Some(GroupNorm { weight, eps, normed: out });
                steps.remove(i);
                continue;
            }
        }
        i += 1;
    }
}

/// Decode: a cache write moves up to just after the step that writes its inputs (past the q_b
/// group and the gather after it), next to a launch it does not depend on, which lowering may
/// merge with its own. It passes only steps that neither write its inputs nor touch the cache
/// (no step that reads or writes the cache is passed).
fn cache_writes_up(steps: &mut [Step]) {
    let touches_cache = |op: &Op| op.writes_kv_cache() || matches!(op, Op::IndexerTopK { .. } | Op::MlaAttention { .. });
    for i in 1..steps.len() {
        if !matches!(steps[i].op, Op::KvCacheWrite { .. }) {
            continue;
        }
        let inputs = steps[i].op.reads();
        let mut at = i;
        while at > 0 && !touches_cache(&steps[at - 1].op) && !steps[at - 1].op.writes().iter().any(|b| inputs.contains(b)) {
            at -= 1;
        }
        steps[at..=i].rotate_right(1);
    }
}

/// Instantiates the sharded graph for one bucket (buffer offsets are assigned by the memory pass).
pub fn specialize(graph: &Graph, bucket: &Bucket) -> Program {
    let size = |d: &Dim| match *d {
        Dim::Tokens => bucket.tokens,
        Dim::Seqs => bucket.seqs,
        Dim::LogitRows => bucket.logit_rows,
        Dim::PagesPerSeq => bucket.pages_per_seq,
        Dim::ScoreRows => if matches!(bucket.kind, ProgramKind::Decode { .. }) { bucket.tokens } else { 0 },
        Dim::AttentionRows => bucket.tokens,
        Dim::AttentionSplits => attention_splits_cap(bucket.tokens),
        Dim::Fixed(n) => n,
    };
    // the model's steps or the draft's; values only the other one's steps touch take no memory
    let draft = graph.draft.as_ref().filter(|_| bucket.draft);
    let (own, other): (&[Step], &[Step]) = match (&graph.draft, draft) {
        (_, Some(d)) => (&d.steps, &graph.steps),
        (Some(d), None) => (&graph.steps, &d.steps),
        (None, None) => (&graph.steps, &[]),
    };
    let touched = |steps: &[Step]| -> std::collections::HashSet<BufId> { steps.iter().flat_map(|s| s.op.reads().into_iter().chain(s.op.writes())).collect() };
    let (mine, theirs) = (touched(own), touched(other));
    let (hidden_in, hidden_out, logits) = match (&graph.draft, draft) {
        (_, Some(d)) => (Some(BufId(d.hidden_in)), Some(BufId(d.hidden_out)), BufId(d.logits)),
        (Some(d), None) => (None, Some(BufId(d.model_hidden)), BufId(graph.logits)),
        (None, None) => (None, None, BufId(graph.logits)),
    };
    let buffers = graph
        .values
        .iter()
        .enumerate()
        .map(|(i, v)| {
            let id = BufId(i as u32);
            let unused = theirs.contains(&id) && !mine.contains(&id) && hidden_in != Some(id) && hidden_out != Some(id);
            let shape: Vec<usize> = if unused { vec![0] } else { v.dims.iter().map(size).collect() };
            let bytes = shape.iter().product::<usize>() as u64 * v.dtype.size() as u64;
            Buffer { name: v.name.clone(), dtype: v.dtype, shape, offset: 0, bytes }
        })
        .collect();
    let decode = matches!(bucket.kind, ProgramKind::Decode { .. });
    let mut steps: Vec<Step> = own
        .iter()
        .cloned()
        .map(|mut s| {
            if let Op::MlaAttention { form, .. } = &mut s.op {
                // Decode reads each cached latent once per head group: absorb kv_b instead of expanding K/V.
                *form = if decode { AttentionForm::Absorbed } else { AttentionForm::Expanded };
            }
            s
        })
        .collect();
    if decode {
        residual_norms_into_all_reduces(&mut steps);
        group_linears_sharing_input(&mut steps);
        norms_into_groups(&mut steps);
        cache_writes_up(&mut steps);
    }
    let i = graph.inputs;
    let name = match bucket.kind {
        ProgramKind::Prefill { chunk } => format!("prefill_{chunk}"),
        ProgramKind::Decode { batch } if bucket.draft => format!("draft_{batch}"),
        ProgramKind::Decode { batch } => format!("decode_{batch}"),
    };
    Program {
        name,
        kind: bucket.kind,
        tokens: bucket.tokens,
        seqs: bucket.seqs,
        logit_rows: bucket.logit_rows,
        buffers,
        inputs: ProgramInputs {
            ids: BufId(i.ids),
            positions: BufId(i.positions),
            token_seq: BufId(i.token_seq),
            slots: BufId(i.slots),
            page_table: BufId(i.page_table),
            logit_rows: BufId(i.logit_rows),
        },
        logits,
        steps,
        workspace_bytes: 0,
        from_position: 0,
        hidden_out,
        hidden_in,
    }
}

#[cfg(test)]
mod tests {
    use super::{group_linears_sharing_input, norms_into_groups, residual_norms_into_all_reduces};
    use crate::passes::lower::GROUP_MAX;
    use kiln_runtime::plan::{BufId, Epilogue, GroupNorm, KernelFamily, LinearPart, LinearWeights, Op, ResidualNorm, Step, WeightId};

    fn linear(input: u32, out: u32, k: usize, epilogue: Epilogue) -> Step {
        let weights = LinearWeights::Bf16 { weight: WeightId(out) };
        let op = Op::Linear { input: BufId(input), weights, parts: vec![LinearPart { rows: 8 }], k, epilogue, out: BufId(out) };
        Step { op, kernel: KernelFamily::LinearBf16, launches: vec![] }
    }

    fn add(a: u32, b: u32, out: u32) -> Step {
        Step { op: Op::Add { a: BufId(a), b: BufId(b), out: BufId(out) }, kernel: KernelFamily::Add, launches: vec![] }
    }

    fn norm(input: u32, out: u32) -> Step {
        let op = Op::RmsNorm { input: BufId(input), residual: None, weight: WeightId(99), eps: 1e-5, out: BufId(out) };
        Step { op, kernel: KernelFamily::RmsNorm, launches: vec![] }
    }

    /// The members' outputs of the group at `at`, or None where it is not a group.
    fn group(steps: &[Step], at: usize) -> Option<Vec<u32>> {
        match &steps[at].op {
            Op::LinearGroup { members, .. } => Some(members.iter().map(|g| g.out.0).collect()),
            _ => None,
        }
    }

    #[test]
    fn linears_of_one_input_join_only_where_moving_them_changes_nothing() {
        let plain = |input, out| linear(input, out, 16, Epilogue::None);
        // buffer 0 is the shared input; a step between that touches neither lets the later one up
        let mut s = vec![plain(0, 1), add(5, 6, 7), plain(0, 2)];
        group_linears_sharing_input(&mut s);
        assert_eq!((group(&s, 0), s.len()), (Some(vec![1, 2]), 2));
        // a step between that reads the later linear's output (an older value) keeps it in place
        let mut s = vec![plain(0, 1), add(2, 6, 7), plain(0, 2)];
        group_linears_sharing_input(&mut s);
        assert_eq!((group(&s, 0), s.len()), (None, 3));
        // ... and one that writes the shared input
        let mut s = vec![plain(0, 1), add(5, 6, 0), plain(0, 2)];
        group_linears_sharing_input(&mut s);
        assert_eq!((group(&s, 0), s.len()), (None, 3));
        // another K, an epilogue, another input: never members; at most GROUP_MAX members
        let mut s = vec![plain(0, 1), linear(0, 2, 32, Epilogue::None), linear(0, 3, 16, Epilogue::SiluMul), plain(9, 4)];
        s.extend((10..10 + GROUP_MAX as u32).map(|o| plain(0, o)));
        group_linears_sharing_input(&mut s);
        let want: Vec<u32> = std::iter::once(1).chain(10..10 + GROUP_MAX as u32 - 1).collect();
        assert_eq!(group(&s, 0), Some(want));
        assert!(s[1..4].iter().all(|st| matches!(st.op, Op::Linear { .. })), "the non-members stay where they were");
        assert_eq!(s.len(), 5, "the last linear stays a linear of its own");
    }

    #[test]
    fn the_rmsnorm_after_an_all_reduce_joins_it_with_its_residual_add() {
        let reduce = |buf: u32| Step { op: Op::AllReduce { buf: BufId(buf), residual: None, norm: None }, kernel: KernelFamily::Collective, launches: vec![] };
        let residual_norm = |input: u32, residual: u32, out: u32| {
            let op = Op::RmsNorm { input: BufId(input), residual: Some(BufId(residual)), weight: WeightId(99), eps: 1e-5, out: BufId(out) };
            Step { op, kernel: KernelFamily::RmsNorm, launches: vec![] }
        };
        // all-reduce of 0, then residual 4 += 0 and the norm of 4 into 5: one step
        let mut s = vec![reduce(0), residual_norm(0, 4, 5), plain_linear(5, 6)];
        residual_norms_into_all_reduces(&mut s);
        assert_eq!(s.len(), 2);
        let want = Some(ResidualNorm { weight: WeightId(99), eps: 1e-5, out: BufId(5) });
        assert!(matches!(&s[0].op, Op::AllReduce { residual: Some(BufId(4)), norm, .. } if *norm == want), "{:?}", s[0].op);
        assert_eq!((s[0].op.writes(), s[0].op.weight_ids()), (vec![BufId(0), BufId(4), BufId(5)], vec![WeightId(99)]));
        assert_eq!(s[0].op.residual_norm(), Some(norm(4, 5).op));
        // a norm without a residual, a norm of another buffer, or a step between: unchanged
        for mut s in [vec![reduce(0), norm(0, 5)], vec![reduce(0), residual_norm(7, 4, 5)], vec![reduce(0), add(7, 8, 9), residual_norm(0, 4, 5)]] {
            let before = s.len();
            residual_norms_into_all_reduces(&mut s);
            assert_eq!(s.len(), before);
            assert!(matches!(s[0].op, Op::AllReduce { residual: None, norm: None, .. }));
        }
    }

    fn plain_linear(input: u32, out: u32) -> Step {
        linear(input, out, 16, Epilogue::None)
    }

    #[test]
    fn a_norm_joins_the_group_after_it_only_where_nothing_else_reads_its_rows() {
        let plain = |input, out| linear(input, out, 16, Epilogue::None);
        // norm 0 -> 1, the group of 1: the group reads 0 and keeps 1 as its scratch
        let mut s = vec![norm(0, 1), plain(1, 2), plain(1, 3)];
        group_linears_sharing_input(&mut s);
        norms_into_groups(&mut s);
        assert_eq!(s.len(), 1);
        let want = Some(GroupNorm { weight: WeightId(99), eps: 1e-5, normed: BufId(1) });
        assert!(matches!(&s[0].op, Op::LinearGroup { input: BufId(0), norm, .. } if *norm == want), "{:?}", s[0].op);
        assert_eq!(s[0].op.scratch(), vec![BufId(1)]);
        // a later reader of the normed rows keeps the norm a step of its own
        let mut s = vec![norm(0, 1), plain(1, 2), plain(1, 3), add(1, 5, 6)];
        group_linears_sharing_input(&mut s);
        norms_into_groups(&mut s);
        assert!(matches!(s[1].op, Op::LinearGroup { norm: None, .. }) && s.len() == 3);
        // a norm with a residual, or a lone linear after it, stays
        let mut s = vec![norm(0, 1), plain(1, 2)];
        norms_into_groups(&mut s);
        assert_eq!(s.len(), 2);
        let mut s = vec![norm(0, 1), plain(1, 2), plain(1, 3)];
        if let Op::RmsNorm { residual, .. } = &mut s[0].op {
            *residual = Some(BufId(7));
        }
        group_linears_sharing_input(&mut s);
        norms_into_groups(&mut s);
        assert!(matches!(s[1].op, Op::LinearGroup { norm: None, .. }) && s.len() == 2);
    }
}
