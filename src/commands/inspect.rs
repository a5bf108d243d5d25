use kiln_compiler::error::human_bytes;
use kiln_runtime::plan::{read_plan, summary::summarize};
use std::path::PathBuf;

/// Show what a plan does per GPU: memory by kind, KV capacity, programs and sharding choices.
#[derive(clap::Args)]
pub struct Args {
    /// Artifact directory written by `kiln compile`.
    artifact: PathBuf,
    /// Print the summary as JSON.
    #[arg(long)]
    json: bool,
}

pub fn run(a: Args) -> anyhow::Result<()> {
    let plan = read_plan(&a.artifact)?;
    let s = summarize(&plan);
    if a.json {
        println!("{}", serde_json::to_string_pretty(&s)?);
        return Ok(());
    }
    let g = &s.per_gpu;
    let kv = &plan.memory.kv;
    println!("plan      {} ({} layers, {} tensors) -> {} [{}] x{}, TP {}, MoE {}", s.model_type, s.layers, s.tensors, s.target, s.device, s.tp, s.tp, s.moe_parallel);
    println!("format    v{} by {}; checkpoint fingerprint {}", s.format_version, s.compiler, &s.fingerprint[..16]);
    println!();
    println!("per GPU (identical on all {} ranks)", s.tp);
    let row = |label: &str, bytes: u64, note: String| println!("  {label:<22}{:>12}  {note}", human_bytes(bytes));
    row("GPU memory", g.gpu_memory_bytes, String::new());
    row("weights", g.weight_bytes, String::new());
    for (kind, bytes) in &g.weight_bytes_by_kind {
        row(&format!("  {kind}"), *bytes, String::new());
    }
    row("workspace", g.workspace_bytes, "largest program; buffers reused by liveness".into());
    row(
        "KV cache",
        g.kv_bytes,
        format!(
            "{} pages x {} tokens = {} tokens; {} B/token ({} layers x (latent {} + rope {} + indexer {}) x {})",
            g.kv_pages, g.kv_page_size, g.kv_token_capacity, g.kv_bytes_per_token, kv.layers, kv.latent_dim, kv.rope_dim, kv.index_dim, kv.dtype
        ),
    );
    row("headroom", g.headroom_bytes, "CUDA context, NCCL, module images, slack".into());
    row("free", g.free_bytes, String::new());
    println!();
    println!("programs (one CUDA graph per rank each)");
    println!("  {:<16}{:>8}{:>8}{:>8}{:>8}{:>13}{:>14}", "name", "kind", "tokens", "logits", "steps", "collectives", "workspace");
    for p in &s.programs {
        println!("  {:<16}{:>8}{:>8}{:>8}{:>8}{:>13}{:>14}", p.name, p.kind, p.tokens, p.logit_rows, p.steps, p.collectives, human_bytes(p.workspace_bytes));
    }
    println!();
    println!("sharding");
    for c in &s.sharding {
        println!("  - {}: {}\n      why: {}", c.what, c.how, c.why);
    }
    if !s.ignored.is_empty() {
        println!();
        println!("not bound");
        for i in s.ignored.iter().take(20) {
            println!("  - {i}");
        }
        if s.ignored.len() > 20 {
            println!("  ... and {} more", s.ignored.len() - 20);
        }
    }
    Ok(())
}
