#![recursion_limit = "256"]
//! kiln-compiler: a Hugging Face `glm_moe_dsa` checkpoint -> a static execution plan.
//!
//! `compile()` reads the checkpoint headers, builds the model graph, then runs named passes, each
//! followed by its verifier: shard (tensor parallelism) -> specialize (one program per shape
//! bucket) -> memory (arena offsets, KV pages, proof that it fits) -> lower (kernel instances and
//! launches from `kernel-templates/`, GPU targets) -> assemble (ptxas, when found).

pub mod artifact;
pub mod checkpoint;
pub mod error;
pub mod graph;
pub mod kernels;
pub mod passes;
pub mod synth;

pub mod targets;

pub use error::CompileError;
pub use graph::Draft;

use checkpoint::Checkpoint;
use kiln_runtime::plan::{MoeParallel, Parallelism, Plan, FORMAT_VERSION};
use passes::{assemble, lower, memory, merge, sequence_parallel, shard, specialize, verify};
pub use passes::sequence_parallel::SequenceParallel;
pub use passes::shard::{PrefillCopies, SplitProjections};

/// The most sequences one decode program may batch (and the KV plan reserve for).
pub const MAX_DECODE_BATCH: usize = 4096;
/// The most memory per GPU kiln plans for (1 PiB): a bound that keeps byte sums from overflowing.
pub const MAX_GPU_MEMORY: u64 = 1 << 50;

#[derive(Debug, Clone)]
pub struct CompileOptions {
    pub target: String,
    pub tp: usize,
    pub moe: MoeParallel,
    /// Which replicated projections are split by output rows behind an all-gather.
    pub split_projections: SplitProjections,
    /// Which split projections keep a whole copy that prefill programs compute from.
    pub prefill_copies: PrefillCopies,
    /// Which prefill programs select their indexer lists across ranks (`passes/sequence_parallel.rs`).
    pub sequence_parallel: SequenceParallel,
    /// Per-GPU memory to plan for (default: the target's).
    pub gpu_memory: Option<u64>,
    pub headroom: Option<u64>,
    /// Largest prefill chunk; smaller buckets are derived from it (/4 each, down to 16).
    pub prefill_chunk: usize,
    pub decode_batches: Vec<usize>,
    /// Longest sequence to serve (default: max_position_embeddings).
    pub max_context: Option<usize>,
    /// Assemble the kernels with ptxas when it is found (resources into the plan, cubins into
    /// the artifact).
    pub assemble: bool,
    /// Merge the launches of adjacent independent decode steps (`passes/merge.rs`).
    pub merge_launches: bool,
    /// The draft model compiled beside the model for speculative decoding (`Draft::Mtp`: the
    /// checkpoint's MTP layer, as `draft_{batch}` programs).
    pub draft: Draft,
    /// How the KV cache holds the indexer keys (`IndexKeys::Fp8`: E4M3 with a scale per token).
    pub index_keys: kiln_runtime::plan::IndexKeys,
}

impl Default for CompileOptions {
    fn default() -> Self {
        CompileOptions {
            target: "sm_120a".into(),
            tp: 1,
            moe: MoeParallel::Tp,
            split_projections: SplitProjections::Auto,
            prefill_copies: PrefillCopies::Auto,
            sequence_parallel: SequenceParallel::Auto,
            gpu_memory: None,
            headroom: None,
            prefill_chunk: 8192,
            decode_batches: vec![1, 2, 4, 8, 16, 32, 64],
            max_context: None,
            assemble: true,
            merge_launches: true,
            draft: Draft::None,
            index_keys: kiln_runtime::plan::IndexKeys::Bf16,
        }
    }
}

pub struct Compiled {
    pub plan: Plan,
    pub warnings: Vec<String>,
    /// One per kernel when ptxas was found (written beside the PTX by `artifact::write_artifact_with`).
    pub cubins: Vec<passes::assemble::Cubin>,
    /// The ptxas that assembled them.
    pub ptxas: Option<std::path::PathBuf>,
}

/// Prefill buckets: the chunk, then /4 steps down to 16 tokens, ascending.
pub fn prefill_buckets(chunk: usize) -> Vec<usize> {
    let mut out = vec![chunk];
    let mut c = chunk;
    while c / 4 >= 16 {
        c /= 4;
        out.push(c);
    }
    out.reverse();
    out
}

pub fn compile(ckpt_dir: &std::path::Path, opts: &CompileOptions) -> Result<Compiled, CompileError> {
    let mut target = targets::target(&opts.target)?;
    if let Some(m) = opts.gpu_memory {
        target.gpu_memory = m;
    }
    let option = |option: &str, message: String| CompileError::Option { option: option.into(), message };
    if !matches!(opts.tp, 1 | 2 | 4 | 8) {
        return Err(option("--tp", format!("{}; kiln shards over 1, 2, 4 or 8 GPUs", opts.tp)));
    }
    if opts.decode_batches.is_empty() || opts.decode_batches.contains(&0) {
        return Err(option("--decode-batches", "needs one or more positive batch sizes".into()));
    }
    if let Some(&b) = opts.decode_batches.iter().find(|&&b| b > MAX_DECODE_BATCH) {
        return Err(option("--decode-batches", format!("{b} is larger than the {MAX_DECODE_BATCH} sequences one decode step may hold")));
    }
    for (name, bytes) in [("--gpu-memory", opts.gpu_memory), ("--headroom", opts.headroom)] {
        if let Some(b) = bytes.filter(|&b| b > MAX_GPU_MEMORY) {
            return Err(option(name, format!("{b} bytes is more than the {} TiB kiln plans for", MAX_GPU_MEMORY >> 40)));
        }
    }
    if opts.prefill_chunk == 0 {
        return Err(option("--prefill-chunk", "must be positive".into()));
    }

    let ckpt = Checkpoint::open(ckpt_dir)?;
    let (cfg, warnings) = checkpoint::parse_model_config(&ckpt)?;
    let max_context = opts.max_context.unwrap_or(cfg.max_position_embeddings);
    if max_context == 0 || max_context > cfg.max_position_embeddings {
        return Err(option("--max-context", format!("{max_context}; the model supports 1..={}", cfg.max_position_embeddings)));
    }
    for (what, n) in [("attention heads", cfg.num_attention_heads), ("vocab rows", cfg.vocab_size)] {
        if n % opts.tp != 0 {
            return Err(CompileError::Shard { what: format!("{what} ({n})"), tp: opts.tp, message: "not divisible".into() });
        }
    }

    let graph = graph::build_graph(&ckpt, &cfg, opts.draft)?;
    let parallel = Parallelism { tp: opts.tp, moe: opts.moe };
    // a CPU plan splits what the product target would (the bits are the same either way)
    let consts = kiln_runtime::perf::Constants::for_target(&target).map_or(kiln_runtime::perf::Constants::SM120A, |(k, _)| k);
    let mut batches = opts.decode_batches.clone();
    batches.sort_unstable();
    batches.dedup();
    let chunk = opts.prefill_chunk.min(max_context);
    let split = shard::SplitPolicy { projections: opts.split_projections, copies: opts.prefill_copies, consts, decode_batches: batches.clone(), prefill_chunk: chunk };
    let sharded = shard::shard(graph, &cfg, &parallel, &split)?;
    let pages_per_seq = max_context.div_ceil(memory::KV_PAGE_SIZE);
    let probe = specialize::Bucket { kind: kiln_runtime::plan::ProgramKind::Decode { batch: 1 }, tokens: 1, seqs: 1, logit_rows: 1, pages_per_seq, draft: false };
    let mut slots = sharded.slots;
    verify::program("shard", &specialize::specialize(&sharded.graph, &probe), &slots, &cfg, opts.tp)?;

    let chunks = prefill_buckets(chunk);
    let draft = sharded.graph.draft.is_some();
    let buckets = specialize::buckets(&chunks, &batches, cfg.vocab_size, pages_per_seq, draft);
    // prefill programs run the steps with the whole copies where there are any, and so do the
    // decode batches the model prices lower with them (draft programs have no copies)
    let graph_for = |b: &specialize::Bucket| match (&b.kind, &sharded.whole_graph) {
        (kiln_runtime::plan::ProgramKind::Prefill { .. }, Some(g)) => g,
        (kiln_runtime::plan::ProgramKind::Decode { batch }, Some(g)) if !b.draft && sharded.whole_decode_batches.contains(batch) => g,
        _ => &sharded.graph,
    };
    let mut programs: Vec<_> = buckets.iter().map(|b| specialize::specialize(graph_for(b), b)).collect();
    sequence_parallel::apply(&mut programs, opts.tp, opts.sequence_parallel, &cfg, &consts, max_context);
    for p in &programs {
        verify::program("specialize", p, &slots, &cfg, opts.tp)?;
    }

    let weights = memory::plan_weights(&mut slots);
    let workspace = programs.iter_mut().map(memory::plan_workspace).max().unwrap_or(0);
    let headroom = opts.headroom.unwrap_or_else(|| targets::default_headroom(&target));
    let layers = cfg.num_hidden_layers + usize::from(draft);
    let kv = memory::KvRequest { page_size: memory::KV_PAGE_SIZE, max_seqs: *batches.last().expect("non-empty"), max_context, layers, index_keys: opts.index_keys };
    let mem = memory::plan_memory(&cfg, &target, headroom, weights, workspace, &kv)?;
    verify::memory(&slots, &programs, &mem)?;

    let indexer_choice = sequence_parallel::choice(&chunks, opts.tp, opts.sequence_parallel, &cfg, &consts, max_context);
    let fingerprint = fingerprint(&sharded.graph.tensors);
    let mut plan = Plan {
        format_version: FORMAT_VERSION,
        compiler: format!("kiln {}", env!("CARGO_PKG_VERSION")),
        model: cfg,
        target,
        parallel,
        fingerprint,
        tensors: sharded.graph.tensors,
        weights: slots,
        memory: mem,
        programs,
        sharding: sharded.choices.into_iter().chain(indexer_choice).collect(),
        ignored: sharded.graph.ignored,
        kernels: Vec::new(),
    };
    lower::lower(&mut plan)?;
    let smem_limit = lower::SMEM_LIMIT.min(plan.target.smem_per_block);
    if opts.merge_launches {
        merge::merge(&mut plan, smem_limit)?;
    }
    let ptxas = if opts.assemble && plan.target.arch != kiln_runtime::plan::Arch::Cpu { assemble::find_ptxas() } else { None };
    let cubins = match &ptxas {
        Some(p) => assemble::assemble(&mut plan, p)?,
        None => Vec::new(),
    };
    Ok(Compiled { plan, warnings, cubins, ptxas })
}

/// SHA-256 over (name, dtype, shape) of every bound tensor, in plan order (the runtime computes
/// the same over the user's weights to refuse foreign ones).
pub fn fingerprint(tensors: &[kiln_runtime::plan::TensorInfo]) -> String {
    kiln_runtime::plan::fingerprint(tensors)
}
