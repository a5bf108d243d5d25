//! Kernel instances and launches attached to plan steps by the compiler's lowering pass.

use super::{BufId, KernelFamily, WeightId};
use serde::{Deserialize, Serialize};

/// Index of a [`KernelInfo`] in `Plan::kernels`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct KernelId(pub u32);

/// One shape-specialised kernel: a PTX module with a single entry, written to
/// `kernels/<name>.ptx` in the artifact (and `kernels/<name>.cubin` when ptxas was found).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct KernelInfo {
    /// Unique and descriptive (`<template>_<param values>`); also the file stem.
    pub name: String,
    pub family: KernelFamily,
    /// The template it was rendered from (`kernel-templates/<template>.ptx`).
    pub template: String,
    pub entry: String,
    /// The template's shape parameters, in header order.
    pub params: Vec<(String, u64)>,
    /// The rendered PTX text.
    pub ptx: String,
    /// Resource usage reported by `ptxas -v` (None when ptxas was not found at compile time).
    pub resources: Option<Resources>,
    /// A merged kernel's parts, in block order (empty for a template's own kernel): the blocks
    /// `[sum of earlier parts' blocks, + this part's)` of the merged launch run `kernel`'s code
    /// on its grid, with the next `args` arguments of the launch; a `tail` part has no blocks of
    /// its own (see [`KernelPart::tail`]).
    pub parts: Vec<KernelPart>,
}

impl KernelInfo {
    /// The value of shape parameter `name`, None where the template has none of that name.
    pub fn param(&self, name: &str) -> Option<u64> {
        self.params.iter().find(|(n, _)| n == name).map(|(_, v)| *v)
    }
}

/// One kernel of a merged kernel (see [`KernelInfo::parts`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct KernelPart {
    pub kernel: KernelId,
    pub grid: [u32; 3],
    /// The part's own block (the merged launch's is the largest part's).
    pub block: [u32; 3],
    pub args: u32,
    /// A chained part: it runs after the part before it (its head), on the head's last block to
    /// finish, its own grid's blocks one after another; its last argument is the split-K region
    /// (the arrival counter at [`super::SplitKLayout::CHAIN`]). So a dependent kernel of a few
    /// blocks costs no launch of its own.
    pub tail: bool,
}

/// What ptxas reported for one kernel.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Resources {
    pub arch: PtxArch,
    pub registers: u32,
    pub spill_store_bytes: u32,
    pub spill_load_bytes: u32,
    pub stack_bytes: u32,
    /// Static shared memory of the kernel.
    pub smem_static_bytes: u32,
}

/// The ptxas architecture a cubin was built for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum PtxArch {
    Sm120a,
    Sm90a,
}

impl PtxArch {
    pub fn name(self) -> &'static str {
        match self {
            PtxArch::Sm120a => "sm_120a",
            PtxArch::Sm90a => "sm_90a",
        }
    }
}

/// A kernel argument, resolved per rank at load time: buffers are workspace offsets, weights arena
/// offsets (every rank has the same layout).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub enum LaunchArg {
    /// Device address of a program buffer.
    Buffer(BufId),
    /// Device address of a weight slot.
    Weight(WeightId),
    U32(u32),
    F32(f32),
    /// A u32 that differs per rank: `rank index * value`, set by the runtime when it binds the
    /// launch on each rank (checked not to overflow). Programs are SPMD (the same steps and
    /// launches on every rank), so this is how a kernel learns which slice a rank owns, e.g.
    /// the first vocabulary row of the embedding slice (`value` = rows per rank).
    PerRank(u32),
    /// Device address of one layer's KV cache (see [`super::KvLayout`] for the byte layout).
    KvCache { layer: u32 },
    /// Device address of the RoPE table (see [`super::KvLayout::rope_table`]).
    RopeTable,
    /// Device address of the rank's one-shot P2P collective region (see [`super::P2pLayout`]).
    P2pRegion,
    /// Device address of the rank's split-K region (see [`super::SplitKLayout`]).
    SplitKRegion,
    /// Device address of the split-K region's upper slot ([`super::SplitKLayout::UPPER`]): the
    /// second split-K part of a merged launch, so two parts' counters and sums stay apart.
    SplitKRegionUpper,
}

impl LaunchArg {
    /// The value of a `PerRank` argument on `rank` (None if it overflows a u32).
    pub fn per_rank(value: u32, rank: usize) -> Option<u32> {
        u32::try_from(rank).ok().and_then(|r| r.checked_mul(value))
    }
}

/// The launch of a step: fixed grid, block and dynamic shared memory (captured in the graph).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Launch {
    pub kernel: KernelId,
    pub grid: [u32; 3],
    pub block: [u32; 3],
    /// Dynamic shared memory in bytes (kiln's kernels use static shared memory: 0).
    pub smem_dynamic: u32,
    pub args: Vec<LaunchArg>,
}
