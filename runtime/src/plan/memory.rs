use super::DType;
use serde::{Deserialize, Serialize};

/// Paged KV cache geometry: per token and layer it holds the MLA latent, the rope key and the
/// indexer key. MLA shares one latent across heads, so every rank keeps the whole cache.
///
/// GPU byte layout (what kernels address through `LaunchArg::KvCache { layer }`): layer-major,
/// each layer `[capacity_tokens, row_elems]` in `dtype`, a slot's row being
/// `[latent (latent_dim) | rope key (rope_dim) | indexer key (index_dim)]`; with
/// [`IndexKeys::Fp8`] the key is `index_dim` E4M3 codes and an f32 scale after the rope key,
/// the row padded to 16 bytes (`row_elems` counts it in `dtype` values). Slot `s` is
/// `page * page_size + offset`, as the page table says.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct KvLayout {
    pub dtype: DType,
    pub layers: usize,
    pub latent_dim: usize,
    pub rope_dim: usize,
    pub index_dim: usize,
    /// Tokens per page.
    pub page_size: usize,
    pub pages: usize,
    /// Bytes one token occupies across all layers.
    pub bytes_per_token: u64,
    /// Largest number of sequences resident at once (the largest decode batch).
    pub max_seqs: usize,
    pub pages_per_seq: usize,
    /// The longest sequence the plan serves (`--max-context`), in tokens.
    pub max_context: usize,
    pub index_keys: IndexKeys,
}

/// How the cache holds the DSA indexer's keys (`kiln compile --indexer-keys`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub enum IndexKeys {
    /// In each slot's row, in the cache dtype (transformers keeps them so).
    #[default]
    Bf16,
    /// FP8 E4M3 with one power-of-two scale per token ([`crate::numerics::quantize_fp8_key`]),
    /// as DeepSeek's reference, SGLang and vLLM cache them (their queries are FP8 too; kiln's stay
    /// in f32): in the row after the rope key, `index_dim` codes then the f32 scale, the row
    /// padded to 16 bytes. GLM-5's row: 1,296 B instead of 1,408.
    Fp8,
}

impl IndexKeys {
    pub fn name(self) -> &'static str {
        match self {
            IndexKeys::Bf16 => "bf16",
            IndexKeys::Fp8 => "fp8",
        }
    }
}

impl KvLayout {
    pub fn capacity_tokens(&self) -> u64 {
        (self.pages * self.page_size) as u64
    }

    pub fn bytes(&self) -> u64 {
        self.capacity_tokens() * self.bytes_per_token
    }

    /// A slot's row in `dtype` values (with FP8 keys: its bytes, padded, over the value size).
    pub fn row_elems(&self) -> usize {
        match self.index_keys {
            IndexKeys::Bf16 => self.latent_dim + self.rope_dim + self.index_dim,
            IndexKeys::Fp8 => (self.key_offset_bytes() + self.index_dim + 4).next_multiple_of(16) / self.dtype.size(),
        }
    }

    /// Byte offset of the indexer key in a row (after the latent and the rope key).
    pub fn key_offset_bytes(&self) -> usize {
        (self.latent_dim + self.rope_dim) * self.dtype.size()
    }

    /// Bytes one slot takes in one layer.
    pub fn slot_bytes(&self) -> u64 {
        (self.row_elems() * self.dtype.size()) as u64
    }

    /// Bytes of one layer's cache (the distance between two `KvCache` layer addresses).
    pub fn layer_bytes(&self) -> u64 {
        self.capacity_tokens() * self.slot_bytes()
    }

    /// The RoPE table kernels read through `LaunchArg::RopeTable`: for every position below
    /// `max_context` and pair `i < rope_dim / 2`, `(cos, sin)` of `pos * inv_freq[i]` as F32,
    /// `[max_context, rope_dim / 2, 2]`. Precomputed so GPU and CPU rotate by identical values.
    pub fn rope_table_bytes(&self) -> u64 {
        (self.max_context * self.rope_dim * 4) as u64
    }
}

/// Per-rank memory budget. Everything is decided here, at compile time: if it does not fit the
/// compile fails; the runtime allocates exactly these regions.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MemoryPlan {
    /// Memory per GPU the plan was sized for.
    pub gpu_memory: u64,
    /// Reserved for the CUDA context, NCCL buffers, module images and allocator slack.
    pub headroom: u64,
    pub weights: u64,
    /// Largest workspace of any program (programs replay one at a time and share it).
    pub workspace: u64,
    pub kv: KvLayout,
}

impl MemoryPlan {
    pub fn used(&self) -> u64 {
        self.headroom + self.weights + self.workspace + self.kv.bytes() + self.kv.rope_table_bytes()
    }
}

/// The per-rank split-K region of the GEMMs' cross-block forms (`linear_bf16_gemm.ptx` KS > 1,
/// `linear_nvfp4_gemm.ptx` SLICES > 1) and of split-KV attention's combine with the output
/// projection (`mla_split.ptx` MODE 3, a counter per head). Two slots of [`SplitKLayout::SLOT_BYTES`]
/// each: a u32 arrival counter per output tile ([`SplitKLayout::COUNTERS`] of them, zero between
/// launches: the last block's `atom.inc` wraps its tile's back to zero), then the f32 partial
/// sums of one launch (`KS x M x N`). A launch uses the lower slot; a merged launch whose second
/// part also counts tiles gives that part the upper one. After the slots, the arrival counter of
/// a chained launch ([`SplitKLayout::CHAIN`], see `KernelPart::tail`), also back at zero after
/// each launch. Launches replay one at a time, so every launch uses the same region. The runtime
/// allocates it zeroed on every GPU that runs such a launch; like the P2P region it comes out of
/// the memory plan's headroom.
pub struct SplitKLayout;

impl SplitKLayout {
    /// Tile counters of a slot (the most output tiles of one split-K launch).
    pub const COUNTERS: u64 = 4096;
    /// Byte offset of the partial sums in a slot.
    pub const PARTIALS: u64 = 4 * Self::COUNTERS;
    /// Bytes of a slot (a tiled projection at decode batch 64 sharing K over 4 blocks keeps
    /// 4 x 64 x 6,144 f32 sums).
    pub const SLOT_BYTES: u64 = 16 << 20;
    /// Byte offset of the upper slot.
    pub const UPPER: u64 = Self::SLOT_BYTES;
    /// Byte offset of a chained launch's block counter (u32).
    pub const CHAIN: u64 = 2 * Self::SLOT_BYTES;
    /// Bytes of the region.
    pub const BYTES: u64 = Self::CHAIN + 256;
    /// Bytes of partial sums one launch (one slot) may use.
    pub const PARTIAL_BYTES: u64 = Self::SLOT_BYTES - Self::PARTIALS;
}

/// Largest part a rank sends its peers in one P2P collective: a one-shot all-reduce's buffer, an
/// all-gather's share, a two-shot all-reduce's share (its buffer up to `ranks` times this);
/// larger ones stay on NCCL.
pub const P2P_MAX_BYTES: u64 = 64 << 10;

/// The per-rank region of the P2P collective (`kernel-templates/p2p_collective.ptx`): every
/// rank's region base (u64 each), this rank's epoch (u32, padded to 16 B), a flag per rank (u32),
/// then two slots of `ranks` x [`P2P_MAX_BYTES`] (a two-shot all-reduce's whole buffer) at a
/// 256-byte boundary. The runtime allocates it zeroed on every GPU and writes the table; peers
/// address it directly.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct P2pLayout {
    pub ranks: u64,
}

impl P2pLayout {
    pub fn epoch(&self) -> u64 {
        8 * self.ranks
    }

    pub fn flags(&self) -> u64 {
        self.epoch() + 16
    }

    pub fn slots(&self) -> u64 {
        (self.flags() + 4 * self.ranks).next_multiple_of(256)
    }

    /// Bytes of each slot.
    pub fn slot(&self) -> u64 {
        self.ranks * P2P_MAX_BYTES
    }

    pub fn bytes(&self) -> u64 {
        self.slots() + 2 * self.slot()
    }
}
