//! The model graph: the whole forward pass of one replay as a list of steps over symbolic values.
//! The same `Op` type as the plan is used; its `BufId`s index `Graph::values` and its `WeightId`s
//! index `Graph::weights` until shape specialisation turns values into buffers.

mod binder;
mod build;

pub use binder::Binder;
pub use build::{build_graph, Draft};

use kiln_runtime::plan::{DType, Dim, Step, TensorInfo, Transform, WeightKind};

/// A symbolic activation or input of the graph.
#[derive(Debug, Clone, PartialEq)]
pub struct Value {
    pub name: String,
    pub dtype: DType,
    pub dims: Vec<Dim>,
}

/// How a weight is distributed over tensor-parallel ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ShardRole {
    /// Every rank holds all of it.
    Replicated,
    /// Output rows (dim 0) split: column-parallel linear, vocab-parallel embedding, attention heads.
    Rows,
    /// Input columns (dim 1) split: row-parallel linear; its output is a partial sum.
    Cols,
    /// Stacked experts: with `--moe-parallel tp` every piece is split along `tp_dim`
    /// (None: scalars, kept whole); with `ep` every rank takes whole experts.
    Experts { tp_dim: Option<u8> },
}

/// A logical weight: the concatenation (along dim 0) of equally shaped checkpoint tensors,
/// optionally stacked per expert.
#[derive(Debug, Clone, PartialEq)]
pub struct GraphWeight {
    pub name: String,
    pub kind: WeightKind,
    pub dtype: DType,
    /// Checkpoint tensors (indices into `Graph::tensors`), expert-major when `experts` is set.
    pub pieces: Vec<u32>,
    /// Full (unsharded) shape of one piece.
    pub piece_shape: Vec<usize>,
    pub experts: Option<usize>,
    pub role: ShardRole,
    /// What binding makes of each piece's checkpoint tensor before sharding it (`piece_shape`
    /// is the result's): a column slice (one part of a linear over a concatenated input), or a
    /// part of its NVFP4 quantisation.
    pub transform: Transform,
}

/// Program inputs as graph values.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GraphInputs {
    pub ids: u32,
    pub positions: u32,
    pub token_seq: u32,
    pub slots: u32,
    pub page_table: u32,
    pub logit_rows: u32,
}

#[derive(Debug, Clone)]
pub struct Graph {
    pub values: Vec<Value>,
    pub weights: Vec<GraphWeight>,
    pub steps: Vec<Step>,
    pub tensors: Vec<TensorInfo>,
    pub inputs: GraphInputs,
    pub logits: u32,
    /// Checkpoint tensors recognised but not used (MTP layer), summarised.
    pub ignored: Vec<String>,
    /// The draft model (the checkpoint's MTP layer) where the plan carries one.
    pub draft: Option<DraftGraph>,
}

/// The draft model's steps over the same values and weights (embedding and `lm_head` shared):
/// one MTP layer that takes the next token and the model's hidden state at the row before it.
#[derive(Debug, Clone)]
pub struct DraftGraph {
    pub steps: Vec<Step>,
    /// `[tokens, hidden]` BF16 input: the hidden state each draft row continues from.
    pub hidden_in: u32,
    /// `[tokens, hidden]` BF16: the draft's own hidden state after `shared_head.norm`.
    pub hidden_out: u32,
    pub logits: u32,
    /// The model's `[tokens, hidden]` final normed hidden state (its programs' `hidden_out`).
    pub model_hidden: u32,
}
