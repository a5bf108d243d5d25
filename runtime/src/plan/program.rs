use super::{DType, Launch, Op};
use serde::{Deserialize, Serialize};

/// Index of a [`Buffer`] in `Program::buffers`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct BufId(pub u32);

/// A symbolic dimension of a graph value, fixed per program by shape specialisation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Dim {
    /// Tokens processed by one replay (prefill chunk or decode batch).
    Tokens,
    /// Sequences in one replay.
    Seqs,
    /// Rows whose logits the program returns.
    LogitRows,
    /// Cache pages a sequence may hold.
    PagesPerSeq,
    /// Tokens whose indexer scores go to scratch: the decode batch; 0 in prefill programs.
    ScoreRows,
    /// Tokens whose absorbed q and split softmax states go to scratch (split-KV attention):
    /// every token of the program, decode and prefill.
    AttentionRows,
    /// KV splits of attention whose partial softmax states go to scratch:
    /// [`attention_splits_cap`] of the program's tokens.
    AttentionSplits,
    Fixed(usize),
}

/// Most KV splits attention may use at `tokens` tokens: enough that tokens x splits blocks fill
/// 256 SMs twice, at most 128 (the scratch of the partial states grows with it; the combine
/// holds 4 splits' states per lane); 1 from 512 tokens (long prefill chunks).
pub fn attention_splits_cap(tokens: usize) -> usize {
    512usize.div_ceil(tokens.max(1)).min(128)
}

/// One activation or input buffer of a program, at a fixed offset in the rank's workspace.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Buffer {
    pub name: String,
    pub dtype: DType,
    pub shape: Vec<usize>,
    pub offset: u64,
    pub bytes: u64,
}

/// The kernel family a step needs on a GPU target (the launch itself is added by lowering).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum KernelFamily {
    Embed,
    RmsNorm,
    LinearBf16,
    LinearNvfp4,
    KvCacheWrite,
    IndexerTopK,
    MlaAttention,
    Router,
    MoeNvfp4,
    MoeBf16,
    Add,
    GatherRows,
    /// Collectives: NCCL, or for small all-reduces and all-gathers the one-shot P2P kernel
    /// (`p2p_collective`), which the CUDA runtime uses only where every GPU pair passed the peer
    /// probe.
    Collective,
    /// A `Concurrent` step: its ops' kernels, one launch of which runs two ops' kernels side by
    /// side (a merged kernel, `KernelInfo::parts`).
    Merged,
}

impl KernelFamily {
    pub fn name(self) -> &'static str {
        match self {
            KernelFamily::Embed => "embed",
            KernelFamily::RmsNorm => "rmsnorm",
            KernelFamily::LinearBf16 => "linear_bf16",
            KernelFamily::LinearNvfp4 => "linear_nvfp4",
            KernelFamily::KvCacheWrite => "kv_cache_write",
            KernelFamily::IndexerTopK => "indexer_topk",
            KernelFamily::MlaAttention => "mla_attention",
            KernelFamily::Router => "router",
            KernelFamily::MoeNvfp4 => "moe_nvfp4",
            KernelFamily::MoeBf16 => "moe_bf16",
            KernelFamily::Add => "add",
            KernelFamily::GatherRows => "gather_rows",
            KernelFamily::Collective => "collective",
            KernelFamily::Merged => "merged",
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Step {
    pub op: Op,
    pub kernel: KernelFamily,
    /// The kernel launches that execute `op` on a GPU target, in order (set by lowering; empty on
    /// the CPU target, for collectives NCCL carries, and for families without a kernel, see
    /// `Plan::missing_kernels`). Most ops take one; MoE takes two (gate/up, then down + combine).
    pub launches: Vec<Launch>,
}

impl Step {
    /// A collective the plan also gives the one-shot P2P kernel (which a multi-GPU runtime runs
    /// where every GPU pair passed the peer probe, NCCL otherwise). A collective's launches are
    /// that kernel first, where it has one, then the launches the NCCL path runs after the
    /// collective (the residual add of `AllReduce { residual }`).
    pub fn p2p_collective(&self, plan: &super::Plan) -> bool {
        matches!(self.op, Op::AllReduce { .. } | Op::AllGather { .. })
            && self.launches.first().is_some_and(|l| plan.kernels.get(l.kernel.0 as usize).is_some_and(|k| k.family == KernelFamily::Collective))
    }

    /// The launches a collective's P2P path runs after the P2P kernel: the NCCL path's too where
    /// the kernel leaves the residual add (and the norm) to them (its ADD 0: the model priced
    /// its one block's add and norm above their launches), else none.
    pub fn after_p2p(&self, plan: &super::Plan) -> &[Launch] {
        if !self.p2p_collective(plan) || plan.kernel(self.launches[0].kernel).param("ADD") == Some(1) {
            return &[];
        }
        self.after_collective(plan)
    }

    /// The launches a collective's NCCL path runs after NCCL (every launch but the P2P kernel).
    pub fn after_collective(&self, plan: &super::Plan) -> &[Launch] {
        if self.p2p_collective(plan) {
            &self.launches[1..]
        } else {
            &self.launches
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum ProgramKind {
    /// One sequence, a chunk of up to `chunk` new tokens appended after its cached prefix.
    Prefill { chunk: usize },
    /// Up to `batch` sequences, one new token each (or consecutive tokens of one sequence). A
    /// draft program ([`Program::is_draft`]) is a decode program of the draft model.
    Decode { batch: usize },
}

/// The fixed input buffers written before each replay.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProgramInputs {
    /// `[tokens]` I32 token ids.
    pub ids: BufId,
    /// `[tokens]` I32 absolute positions.
    pub positions: BufId,
    /// `[tokens]` I32 row of the token's sequence in `page_table` (-1: padding token).
    pub token_seq: BufId,
    /// `[tokens]` I32 cache slot (page * page_size + offset) the token's keys are written to.
    pub slots: BufId,
    /// `[seqs, pages_per_seq]` I32 page ids of each sequence (-1: unused).
    pub page_table: BufId,
    /// `[logit_rows]` I32 token rows whose logits are returned (-1: none).
    pub logit_rows: BufId,
}

/// A static list of steps over fixed buffers for one shape bucket: captured as one CUDA graph per
/// rank. All ranks run the same program (SPMD) on their own shard of the weights.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Program {
    pub name: String,
    pub kind: ProgramKind,
    pub tokens: usize,
    pub seqs: usize,
    pub logit_rows: usize,
    pub buffers: Vec<Buffer>,
    pub inputs: ProgramInputs,
    /// `[logit_rows, vocab]` F32, complete on every rank.
    pub logits: BufId,
    pub steps: Vec<Step>,
    /// Bytes of workspace this program needs (inputs + live activations at their peak).
    pub workspace_bytes: u64,
    /// Prefill: the least position of a chunk's first token this program is for. 0 for every
    /// chunk size; a variant of a size for chunks deep in a context (where its sequence-parallel
    /// indexer pays) has the position from which it does.
    pub from_position: usize,
    /// Plans with a draft model (`kiln compile --draft mtp`): the `[tokens, hidden]` BF16 rows of
    /// the final normed hidden state the replay leaves (the model's after `model.norm`; a draft
    /// program's its own after `shared_head.norm`), which the next draft step continues from.
    pub hidden_out: Option<BufId>,
    /// A draft program (the checkpoint's MTP layer): its `[tokens, hidden]` BF16 input rows, the
    /// hidden state each row continues from (row p: the hidden state at position p, beside the
    /// token at p + 1 in `ids`). None: one of the model's own programs.
    pub hidden_in: Option<BufId>,
}

impl Program {
    pub fn buffer(&self, id: BufId) -> &Buffer {
        &self.buffers[id.0 as usize]
    }

    /// A draft model's program (see [`Program::hidden_in`]).
    pub fn is_draft(&self) -> bool {
        self.hidden_in.is_some()
    }

    pub fn all_reduces(&self) -> usize {
        self.steps.iter().filter(|s| matches!(s.op, Op::AllReduce { .. } | Op::AllGather { .. })).count()
    }
}
