//! The static execution plan: everything the runtime needs, fixed at compile time.

mod config;
mod dtype;
mod files;
mod io;
mod kernel;
mod memory;
mod op;
mod program;
pub mod summary;
mod target;
mod weights;

pub use config::ModelConfig;
pub use dtype::DType;
pub use files::{check_artifact_files, read_artifact, sha256_hex, FILES_KEY};
pub use io::{decode_plan, read_plan, write_plan, PlanError, PLAN_FILE, RECOMPILE};
pub use kernel::{PtxArch, KernelId, KernelInfo, KernelPart, Launch, LaunchArg, Resources};
pub use memory::{IndexKeys, KvLayout, MemoryPlan, P2pLayout, SplitKLayout, P2P_MAX_BYTES};
pub use op::{AttentionForm, Epilogue, GatherPair, GroupMember, GroupNorm, LinearPart, LinearWeights, Op, ResidualNorm, RouterParams};
pub use program::{attention_splits_cap, BufId, Buffer, Dim, KernelFamily, Program, ProgramInputs, ProgramKind, Step};
pub use target::{Arch, Target};
pub use weights::{
    fingerprint, MoeParallel, Nvfp4Part, Parallelism, ShardChoice, Shard, TensorChoice, TensorInfo, Transform, WeightId,
    WeightKind, WeightSlot, WeightSource,
};

use serde::{Deserialize, Serialize};

/// Bumped whenever the serialized layout of [`Plan`] changes; the runtime refuses other versions.
pub const FORMAT_VERSION: u32 = 19;

/// One step of a prompt's prefill ([`Plan::next_prefill_piece`]): `rows` of the sequence's next
/// tokens as a decode step of `program`, or `tokens` of them as a chunk of prefill `program`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PrefillPiece {
    Decode { program: usize, rows: usize },
    Prefill { program: usize, tokens: usize },
}

/// A compiled model for one target: the unit the runtime loads.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Plan {
    pub format_version: u32,
    /// kiln version that produced the plan (informational).
    pub compiler: String,
    pub model: ModelConfig,
    pub target: Target,
    pub parallel: Parallelism,
    /// Hex SHA-256 over (name, dtype, shape) of every bound checkpoint tensor, in plan order.
    pub fingerprint: String,
    /// Every checkpoint tensor the plan binds, with the dtype and shape it was compiled against.
    pub tensors: Vec<TensorInfo>,
    /// Weight slots of the per-rank weights arena (identical layout on every rank).
    pub weights: Vec<WeightSlot>,
    /// Per-rank memory plan (identical on every rank for TP/EP: SPMD).
    pub memory: MemoryPlan,
    /// One program per shape bucket; each is captured as one CUDA graph per rank.
    pub programs: Vec<Program>,
    /// Human-readable record of every sharding decision and why.
    pub sharding: Vec<ShardChoice>,
    /// Checkpoint tensors recognised but deliberately not bound (e.g. the MTP layer).
    pub ignored: Vec<String>,
    /// Kernel instances the steps launch (empty for the CPU target).
    pub kernels: Vec<KernelInfo>,
}

impl Plan {
    pub fn ranks(&self) -> usize {
        self.parallel.tp
    }

    /// Whether a launch takes the split-K region ([`SplitKLayout`]), so every rank needs one.
    pub fn uses_split_k(&self) -> bool {
        self.programs.iter().flat_map(|p| &p.steps).flat_map(|s| &s.launches).any(|l| l.args.iter().any(|a| matches!(a, LaunchArg::SplitKRegion | LaunchArg::SplitKRegionUpper)))
    }

    pub fn kernel(&self, id: KernelId) -> &KernelInfo {
        &self.kernels[id.0 as usize]
    }

    /// The template kernels launch `l` runs: a merged launch's parts, each as a launch of its
    /// own grid and block (without arguments), else `l` itself.
    pub fn part_launches(&self, l: &Launch) -> Vec<Launch> {
        let parts = &self.kernel(l.kernel).parts;
        if parts.is_empty() {
            return vec![l.clone()];
        }
        parts.iter().map(|q| Launch { kernel: q.kernel, grid: q.grid, block: q.block, smem_dynamic: l.smem_dynamic, args: Vec::new() }).collect()
    }

    pub fn weight(&self, id: WeightId) -> &WeightSlot {
        &self.weights[id.0 as usize]
    }

    /// The largest decode batch of the plan (None: it has no decode program).
    pub fn max_decode_batch(&self) -> Option<usize> {
        self.programs.iter().filter(|p| !p.is_draft()).filter_map(|p| if let ProgramKind::Decode { batch } = p.kind { Some(batch) } else { None }).max()
    }

    /// Index of the smallest decode program that holds `batch` sequences, if any.
    pub fn decode_program(&self, batch: usize) -> Option<usize> {
        self.smallest_decode(batch, false)
    }

    /// Index of the smallest draft program (`kiln compile --draft mtp`) of at least `rows` rows.
    pub fn draft_program(&self, rows: usize) -> Option<usize> {
        self.smallest_decode(rows, true)
    }

    /// Whether the plan carries a draft model.
    pub fn has_draft(&self) -> bool {
        self.programs.iter().any(Program::is_draft)
    }

    fn smallest_decode(&self, rows: usize, draft: bool) -> Option<usize> {
        self.programs
            .iter()
            .enumerate()
            .filter(|(_, p)| p.is_draft() == draft && matches!(p.kind, ProgramKind::Decode { batch: b } if b >= rows))
            .min_by_key(|(_, p)| p.tokens)
            .map(|(i, _)| i)
    }

    /// Index of the smallest prefill program whose chunk holds `tokens` tokens, else of the
    /// largest one (the caller then prefills in chunks); of the programs of that size, the one
    /// made for chunks from the latest position at or before `first_position` (the position of
    /// the chunk's first token: a variant for chunks deep in a context, `Program::from_position`).
    pub fn prefill_program(&self, tokens: usize, first_position: usize) -> Option<usize> {
        let prefill = || self.programs.iter().enumerate().filter(|(_, p)| matches!(p.kind, ProgramKind::Prefill { .. }) && p.from_position <= first_position);
        let size = prefill().filter(|(_, p)| p.tokens >= tokens).map(|(_, p)| p.tokens).min().or_else(|| prefill().map(|(_, p)| p.tokens).max())?;
        prefill().filter(|(_, p)| p.tokens == size).max_by_key(|(_, p)| p.from_position).map(|(i, _)| i)
    }

    /// What a prefill of `remaining` tokens from `first_position` runs next, as `Runner::prefill`
    /// takes it: with `by_decode`, a decode step of the next rows where
    /// [`Plan::prefill_piece_by_decode`] says that is faster per token (`step_us` as there); else
    /// the prefill program [`Plan::prefill_program`] picks, for as many tokens as it holds. None
    /// where the plan has neither.
    pub fn next_prefill_piece(&self, remaining: usize, first_position: usize, by_decode: bool, step_us: impl FnMut(usize, usize) -> Option<f64>) -> Option<PrefillPiece> {
        if by_decode {
            if let Some(rows) = self.prefill_piece_by_decode(remaining, first_position, step_us) {
                return Some(PrefillPiece::Decode { program: self.decode_program(rows)?, rows });
            }
        }
        let program = self.prefill_program(remaining, first_position)?;
        Some(PrefillPiece::Prefill { program, tokens: remaining.min(self.programs[program].tokens) })
    }

    /// How many of the `remaining` tokens of a prefill from `first_position` to run next as one
    /// decode step of that many rows of the sequence (up to the largest decode batch), where
    /// that costs less per token than the prefill program that would take them, by `step_us`
    /// (program index, context -> predicted step; both at the context the chunk ends at,
    /// rounded up to a power of two); None: the prefill program. Decode programs are made for
    /// few rows, so a short turn, a chunk's tail or the one token a cached prompt recomputes
    /// may take a fraction of a prefill program's time, most of all deep in a long context.
    pub fn prefill_piece_by_decode(&self, remaining: usize, first_position: usize, mut step_us: impl FnMut(usize, usize) -> Option<f64>) -> Option<usize> {
        let rows = remaining.min(self.max_decode_batch()?);
        let decode = self.decode_program(rows)?;
        let prefill = self.prefill_program(remaining, first_position)?;
        let tokens = remaining.min(self.programs[prefill].tokens);
        let context = (first_position + tokens).next_power_of_two().max(64);
        let (by_decode, by_prefill) = (step_us(decode, context)? / rows as f64, step_us(prefill, context)? / tokens as f64);
        (by_decode < by_prefill).then_some(rows)
    }
}
