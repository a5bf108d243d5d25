//! Shape specialisation: one program per bucket (prefill chunk sizes, decode batch sizes) with
//! every dimension fixed, so each program can be captured as one CUDA graph.

use crate::graph::Graph;
use kiln_runtime::plan::{attention_splits_cap, AttentionForm, BufId, Buffer, Dim, Op, Program, ProgramInputs, ProgramKind, Step};

/// The concrete sizes of one bucket.
#[derive(Debug, Clone, Copy)]
pub struct Bucket {
    pub kind: ProgramKind,
    pub tokens: usize,
    pub seqs: usize,
    pub logit_rows: usize,
    pub pages_per_seq: usize,
}

/// Logits returned by a prefill chunk: every row when that stays under this many bytes,
/// otherwise the largest power of two that does (serving needs one row per sequence).
pub const PREFILL_LOGITS_BUDGET: usize = 64 << 20;

pub fn buckets(prefill_chunks: &[usize], decode_batches: &[usize], vocab: usize, pages_per_seq: usize) -> Vec<Bucket> {
    let mut out = Vec::new();
    for &chunk in prefill_chunks {
        let max_rows = (PREFILL_LOGITS_BUDGET / (vocab * 4)).max(1);
        let rows = if chunk <= max_rows { chunk } else { 1 << max_rows.ilog2() };
        out.push(Bucket { kind: ProgramKind::Prefill { chunk }, tokens: chunk, seqs: 1, logit_rows: rows, pages_per_seq });
    }
    for &batch in decode_batches {
        out.push(Bucket { kind: ProgramKind::Decode { batch }, tokens: batch, seqs: batch, logit_rows: batch, pages_per_seq });
    }
    out
}

/// Decode: an all-reduce of the sub-layer output that the next rmsnorm adds into the residual
/// takes over that add (`AllReduce { residual }`; the norm then normalises the residual), so
/// that the one-shot P2P kernel does it in the same launch instead of an add launch of its own
/// (with NCCL the add stays a launch, after the collective). Prefill keeps the add in its
/// one-block-per-row norm, where it costs no launch.
fn residual_adds_into_all_reduces(steps: &mut [Step]) {
    for i in 1..steps.len() {
        let (before, after) = steps.split_at_mut(i);
        let (prev, step) = (&mut before[i - 1], &mut after[0]);
        if let (Op::AllReduce { buf, residual: fused @ None }, Op::RmsNorm { input, residual: norm_residual @ Some(_), .. }) = (&mut prev.op, &mut step.op) {
            if *input == *buf {
                let r = norm_residual.take().expect("matched Some");
                *fused = Some(r);
                *input = r;
            }
        }
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
        Dim::AttentionSplits => if matches!(bucket.kind, ProgramKind::Decode { .. }) { attention_splits_cap(bucket.tokens) } else { 0 },
        Dim::Fixed(n) => n,
    };
    let buffers = graph
        .values
        .iter()
        .map(|v| {
            let shape: Vec<usize> = v.dims.iter().map(size).collect();
            let bytes = shape.iter().product::<usize>() as u64 * v.dtype.size() as u64;
            Buffer { name: v.name.clone(), dtype: v.dtype, shape, offset: 0, bytes }
        })
        .collect();
    let decode = matches!(bucket.kind, ProgramKind::Decode { .. });
    let mut steps: Vec<Step> = graph
        .steps
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
        residual_adds_into_all_reduces(&mut steps);
    }
    let i = graph.inputs;
    let name = match bucket.kind {
        ProgramKind::Prefill { chunk } => format!("prefill_{chunk}"),
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
        logits: BufId(graph.logits),
        steps,
        workspace_bytes: 0,
    }
}
