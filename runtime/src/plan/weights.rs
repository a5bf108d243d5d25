use super::DType;
use serde::{Deserialize, Serialize};

/// Index of a [`WeightSlot`] in `Plan::weights`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct WeightId(pub u32);

/// A checkpoint tensor the plan binds, as compiled (the runtime checks the user's weights against it).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TensorInfo {
    pub name: String,
    pub dtype: DType,
    pub shape: Vec<usize>,
}

impl TensorInfo {
    pub fn bytes(&self) -> u64 {
        self.shape.iter().product::<usize>() as u64 * self.dtype.size() as u64
    }
}

/// Hex SHA-256 over (name, dtype, shape) of `tensors` in name order (so it names the tensor table,
/// not the order the compiler binds it in): `Plan::fingerprint` is this over `Plan::tensors`; the
/// runtime recomputes it over the user's headers to say how they differ.
pub fn fingerprint(tensors: &[TensorInfo]) -> String {
    use sha2::{Digest, Sha256};
    let mut sorted: Vec<&TensorInfo> = tensors.iter().collect();
    sorted.sort_by(|a, b| a.name.cmp(&b.name));
    let mut h = Sha256::new();
    for t in sorted {
        h.update(t.name.as_bytes());
        h.update([0]);
        h.update(t.dtype.safetensors_name().as_bytes());
        h.update([0]);
        for d in &t.shape {
            h.update((*d as u64).to_le_bytes());
        }
        h.update([0xff]);
    }
    h.finalize().iter().map(|b| format!("{b:02x}")).collect()
}

/// What a weight is, for the per-GPU memory report.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum WeightKind {
    Embedding,
    Attention,
    Indexer,
    Router,
    DenseMlp,
    SharedExperts,
    RoutedExperts,
    Norm,
    LmHead,
}

impl WeightKind {
    pub const ALL: [WeightKind; 9] = [
        WeightKind::Embedding,
        WeightKind::Attention,
        WeightKind::Indexer,
        WeightKind::Router,
        WeightKind::DenseMlp,
        WeightKind::SharedExperts,
        WeightKind::RoutedExperts,
        WeightKind::Norm,
        WeightKind::LmHead,
    ];

    pub fn label(self) -> &'static str {
        match self {
            WeightKind::Embedding => "embedding",
            WeightKind::Attention => "attention (MLA)",
            WeightKind::Indexer => "indexer (DSA)",
            WeightKind::Router => "router",
            WeightKind::DenseMlp => "dense MLP",
            WeightKind::SharedExperts => "shared experts",
            WeightKind::RoutedExperts => "routed experts",
            WeightKind::Norm => "norms",
            WeightKind::LmHead => "lm_head",
        }
    }
}

/// One region of the per-rank weights arena, filled from one or more checkpoint tensors.
/// The layout is the same on every rank; only the sources' shard index differs.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WeightSlot {
    /// Logical name, e.g. `layers.3.mlp.experts.gate_up.weight`.
    pub name: String,
    pub kind: WeightKind,
    pub dtype: DType,
    /// Per-rank shape of the slot.
    pub shape: Vec<usize>,
    /// Byte offset in the rank's weights arena.
    pub offset: u64,
    pub bytes: u64,
    pub sources: Vec<WeightSource>,
}

/// Which checkpoint tensor fills part of a slot.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum TensorChoice {
    /// The same tensor on every rank (index into `Plan::tensors`).
    Same(u32),
    /// A different tensor per rank (expert parallelism): `[rank] -> tensor index`.
    PerRank(Vec<u32>),
}

impl TensorChoice {
    pub fn for_rank(&self, rank: usize) -> u32 {
        match self {
            TensorChoice::Same(t) => *t,
            TensorChoice::PerRank(ts) => ts[rank],
        }
    }
}

/// How a tensor is cut across ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Shard {
    /// Every rank takes the whole tensor.
    Whole,
    /// Rank `r` takes part `r` of `parts` equal parts along `dim` (row-major tensor).
    Split { dim: u8, parts: u32 },
}

/// Layout transforms applied while binding (kernels that need e.g. swizzled scales add theirs here).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Transform {
    /// Copy the (sliced) bytes as they are.
    Identity,
    /// Take columns `start..start + len` of the 2-d tensor first (the shard then splits that
    /// `[rows, len]` view): one part of a linear whose input is a concatenation, computed as a
    /// linear of each part (the MTP layer's `eh_proj` over `[embedding, hidden]`).
    Columns { start: u32, len: u32 },
    /// Quantise the BF16 `[n, k]` tensor to NVFP4 as ModelOpt does
    /// ([`crate::numerics::quantize_nvfp4`]) and take this part of the result (the shard then
    /// splits that part): a checkpoint's BF16 linear run by the NVFP4 kernels (the MTP layer's
    /// experts under `kiln compile --draft mtp-nvfp4`).
    Nvfp4(Nvfp4Part),
}

/// One tensor of an NVFP4 linear.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Nvfp4Part {
    /// `[n, k/2]` U8: two E2M1 codes a byte, the even K index in the low nibble.
    Codes,
    /// `[n, k/16]` F8E4M3 block scales.
    Scales,
    /// The F32 scalar `weight_scale_2`.
    Scale2,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WeightSource {
    pub tensor: TensorChoice,
    pub shard: Shard,
    /// Byte offset of this piece inside the slot.
    pub dst_offset: u64,
    pub transform: Transform,
}

/// How the routed experts are distributed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum MoeParallel {
    /// Every rank holds a 1/tp slice of every expert's intermediate dimension.
    Tp,
    /// Every rank holds n_routed_experts/tp whole experts.
    Ep,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Parallelism {
    pub tp: usize,
    pub moe: MoeParallel,
}

/// One sharding decision, reported by `kiln inspect`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShardChoice {
    pub what: String,
    pub how: String,
    pub why: String,
}
