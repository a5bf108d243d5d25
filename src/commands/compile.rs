use anyhow::Context;
use kiln_compiler::targets::parse_bytes;
use kiln_compiler::{compile, CompileOptions, Draft, PrefillCopies, SequenceParallel, SplitProjections};
use kiln_runtime::plan::MoeParallel;
use kiln_runtime::bind::CheckpointFiles;
use kiln_runtime::weight_check::{hash_tensors, tensor_progress};
use std::io::IsTerminal;
use std::path::PathBuf;

/// Compile a checkpoint into a plan artifact.
///
/// Reads config.json, the ModelOpt quantization config and the safetensors headers (no weight
/// data), checks every tensor against the architecture, shards for --tp GPUs, specialises one
/// program per shape bucket and plans memory per GPU. Fails, naming the culprit, if anything is
/// missing or the model does not fit.
#[derive(clap::Args)]
pub struct Args {
    /// Hugging Face checkpoint directory (config.json + safetensors).
    checkpoint: PathBuf,
    /// Target: sm_120a (RTX PRO 6000 Blackwell), sm_90a (H200) or cpu (reference backend).
    #[arg(long, default_value = "sm_120a")]
    target: String,
    /// Tensor-parallel degree: 1, 2, 4 or 8 GPUs.
    #[arg(long, default_value_t = 1)]
    tp: usize,
    /// How routed experts are split: tp (slice every expert) or ep (whole experts per GPU).
    #[arg(long, default_value = "tp", value_parser = ["tp", "ep"])]
    moe_parallel: String,
    /// Replicated projections (q_a, kv_a, the indexer's) split by output rows, each GPU computing
    /// its share, then all-gathered: auto (where the performance model says the weight bytes a GPU
    /// no longer streams at batch 1 outweigh the one-shot P2P all-gather; `kiln inspect` shows
    /// each decision and its numbers), all, or none (all replicated). Same bits either way.
    #[arg(long, default_value = "auto", value_parser = ["auto", "all", "none"])]
    split_projections: String,
    /// Split projections that also keep a whole copy on every GPU for prefill: prefill programs
    /// compute them whole from it instead of all-gathering a chunk's outputs over NCCL, and so do
    /// the decode batches whose gathers the performance model prices above the rows a GPU lacks
    /// (GLM-5 at --tp 8: batches 16 to 64); smaller batches keep the split. auto: where, at the
    /// largest prefill chunk, the gather costs at least 4x what computing the projection whole
    /// adds (a copy holds memory the KV cache would otherwise have; GLM-5 at --tp 8: the
    /// indexer's wq_b, 1.2 GiB per GPU); all; none. Same bits either way.
    #[arg(long, default_value = "auto", value_parser = ["auto", "all", "none"])]
    prefill_copies: String,
    /// Prefill chunks whose DSA indexer selects across GPUs: GPU r takes tokens r, r + tp, ...
    /// and one all-gather of the lists per layer gives every GPU all of them. auto: where, by
    /// the performance model, the scoring a GPU no longer does outweighs the gather; a chunk
    /// size where it does only deeper in a context (the saving grows with the position) gets a
    /// second program that the runtime takes for chunks from there on (GLM-5 at --tp 8: 8,192
    /// tokens always, 2,048 from position 1,363, 512 from 2,680; `kiln inspect` shows the
    /// numbers). always: every chunk that divides by --tp. never. from:N: every such chunk
    /// size also gets a second program for chunks from position N (for testing). Same
    /// selections either way.
    #[arg(long, default_value = "auto", value_parser = parse_sequence_parallel)]
    sequence_parallel_indexer: SequenceParallel,
    /// Memory per GPU to plan for, e.g. 96GB or 40GiB (default: the target's).
    #[arg(long)]
    gpu_memory: Option<String>,
    /// Memory per GPU kept free for the CUDA context, NCCL and slack (default: 3 GiB on GPUs).
    #[arg(long)]
    headroom: Option<String>,
    /// Largest prefill chunk in tokens; smaller buckets are derived from it.
    #[arg(long, default_value_t = 8192)]
    prefill_chunk: usize,
    /// Decode batch buckets, comma separated.
    #[arg(long, default_value = "1,2,4,8,16,32,64", value_delimiter = ',')]
    decode_batches: Vec<usize>,
    /// Longest sequence to serve (default: max_position_embeddings).
    #[arg(long)]
    max_context: Option<usize>,
    /// A draft model compiled beside the model for speculative decoding (`kiln run|serve
    /// --speculative-draft K`): none; mtp, the checkpoint's MTP/NextN layer
    /// (`model.layers.<num_hidden_layers>.*`) as `draft_{batch}` programs with its own KV cache
    /// layer and weights (the embedding and lm_head are the model's); or mtp-nvfp4, the same with
    /// its BF16 routed and shared experts quantised to NVFP4 when the weights are bound (their
    /// activation scales borrowed from the last decoder layer's experts), which the GPU kernels
    /// run: GPU targets have no BF16 MoE kernel. Every backend runs draft programs.
    #[arg(long, default_value = "none", value_parser = ["none", "mtp", "mtp-nvfp4"])]
    draft: String,
    /// How the KV cache holds the DSA indexer's keys: bf16, in each token's cache row as
    /// transformers keeps them; or fp8, E4M3 with one power-of-two scale per token (132 B a key
    /// instead of 256 at 128 dims), as DeepSeek's reference, SGLang and vLLM cache them (their
    /// queries are FP8 too, kiln's stay f32). Every backend, the CPU reference included, then
    /// scores the FP8 keys, so the selection may differ from transformers' near ties; decode at
    /// long contexts reads half the key bytes and the cache holds more tokens.
    #[arg(long, default_value = "bf16", value_parser = ["bf16", "fp8"])]
    indexer_keys: String,
    /// Do not assemble the kernels with ptxas even when it is found.
    #[arg(long)]
    no_ptxas: bool,
    /// Keep every decode step's launches apart: no launch runs two steps' kernels side by side
    /// (the merged launches compute the same bits; this is for bisecting a kernel or timing
    /// the merge).
    #[arg(long)]
    no_merge: bool,
    /// Also read every weight byte and record each tensor's SHA-256 in the artifact, so
    /// `kiln verify-weights` and `--check-weights` can tell edited or damaged weights (reads the
    /// whole checkpoint once: minutes for GLM-5).
    #[arg(long)]
    hash_weights: bool,
    /// Record no local path in the artifact (for artifacts shipped to other machines, like
    /// artifacts/GLM-5-NVFP4-sm120a-tp8): `run` and `serve` then need --weights, and read the
    /// tokenizer and chat template from that checkpoint when the artifact has none.
    #[arg(long)]
    portable: bool,
    /// Output artifact directory.
    #[arg(short, long)]
    out: PathBuf,
}

/// `auto`, `always`, `never` or `from:N`.
fn parse_sequence_parallel(s: &str) -> Result<SequenceParallel, String> {
    match s {
        "auto" => Ok(SequenceParallel::Auto),
        "always" => Ok(SequenceParallel::Always),
        "never" => Ok(SequenceParallel::Never),
        _ => match s.strip_prefix("from:").map(str::parse::<usize>) {
            Some(Ok(n)) => Ok(SequenceParallel::From(n)),
            _ => Err(format!("`{s}`: expected auto, always, never or from:N (N a position)")),
        },
    }
}

pub fn run(a: Args) -> anyhow::Result<()> {
    let start = std::time::Instant::now();
    let opts = CompileOptions {
        target: a.target,
        tp: a.tp,
        moe: if a.moe_parallel == "ep" { MoeParallel::Ep } else { MoeParallel::Tp },
        split_projections: match a.split_projections.as_str() {
            "all" => SplitProjections::All,
            "none" => SplitProjections::None,
            _ => SplitProjections::Auto,
        },
        prefill_copies: match a.prefill_copies.as_str() {
            "all" => PrefillCopies::All,
            "none" => PrefillCopies::None,
            _ => PrefillCopies::Auto,
        },
        sequence_parallel: a.sequence_parallel_indexer,
        gpu_memory: a.gpu_memory.map(|s| parse_bytes("--gpu-memory", &s)).transpose()?,
        headroom: a.headroom.map(|s| parse_bytes("--headroom", &s)).transpose()?,
        prefill_chunk: a.prefill_chunk,
        decode_batches: a.decode_batches,
        max_context: a.max_context,
        assemble: !a.no_ptxas,
        merge_launches: !a.no_merge,
        draft: match a.draft.as_str() {
            "mtp" => Draft::Mtp,
            "mtp-nvfp4" => Draft::MtpNvfp4,
            _ => Draft::None,
        },
        index_keys: if a.indexer_keys == "fp8" { kiln_runtime::plan::IndexKeys::Fp8 } else { kiln_runtime::plan::IndexKeys::Bf16 },
    };
    let compiled = compile(&a.checkpoint, &opts)?;
    for w in &compiled.warnings {
        eprintln!("warning: {w}");
    }
    let hashes = if a.hash_weights {
        let files = CheckpointFiles::open(&a.checkpoint)?;
        let bar = tensor_progress(&compiled.plan, std::io::stderr().is_terminal(), "hashing weights {bar:40} {bytes}/{total_bytes}");
        let hashes = hash_tensors(&compiled.plan, &files, &bar)?;
        bar.finish_and_clear();
        Some(hashes)
    } else {
        None
    };
    kiln_compiler::artifact::write_artifact_with(&a.out, &compiled.plan, &compiled.cubins, &a.checkpoint, hashes.as_ref(), !a.portable)
        .with_context(|| format!("writing the artifact to {}", a.out.display()))?;
    if let Some(h) = &hashes {
        eprintln!("recorded the SHA-256 of {} weight tensors ({})", h.len(), kiln_runtime::weight_check::WEIGHT_HASHES_FILE);
    }
    let p = &compiled.plan;
    if !p.kernels.is_empty() {
        match &compiled.ptxas {
            Some(ptxas) => eprintln!("{} kernels assembled with {} (0 spills; kiln inspect shows registers and shared memory)", p.kernels.len(), ptxas.display()),
            None => eprintln!("{} kernels written as PTX (ptxas not found: set KILN_PTXAS to assemble)", p.kernels.len()),
        }
    }
    eprintln!(
        "compiled {} ({} layers, {} tensors) for {} x{} into {} in {:.2}s; KV capacity {} tokens per GPU",
        a.checkpoint.display(),
        p.model.num_hidden_layers,
        p.tensors.len(),
        p.target.name,
        p.parallel.tp,
        a.out.display(),
        start.elapsed().as_secs_f64(),
        p.memory.kv.capacity_tokens()
    );
    Ok(())
}
