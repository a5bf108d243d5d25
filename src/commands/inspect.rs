use kiln_compiler::error::human_bytes;
use kiln_runtime::plan::{read_plan, summary::summarize};
use std::fmt::Write as _;
use std::io::Write as _;
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
        return emit(serde_json::to_string_pretty(&s)? + "\n");
    }
    let mut out = String::new();
    let g = &s.per_gpu;
    let kv = &plan.memory.kv;
    writeln!(out, "plan      {} ({} layers, {} tensors) -> {} [{}] x{}, TP {}, MoE {}", s.model_type, s.layers, s.tensors, s.target, s.device, s.tp, s.tp, s.moe_parallel)?;
    writeln!(out, "format    v{} by {}; checkpoint fingerprint {}", s.format_version, s.compiler, &s.fingerprint[..16])?;
    writeln!(out)?;
    writeln!(out, "per GPU (identical on all {} ranks)", s.tp)?;
    let row = |out: &mut String, label: &str, bytes: u64, note: String| writeln!(out, "  {label:<22}{:>12}  {note}", human_bytes(bytes)).expect("writing to a String cannot fail");
    row(&mut out, "GPU memory", g.gpu_memory_bytes, String::new());
    row(&mut out, "weights", g.weight_bytes, String::new());
    for k in &g.weight_bytes_by_kind {
        row(&mut out, &format!("  {}", k.kind), k.bytes, String::new());
    }
    row(&mut out, "workspace", g.workspace_bytes, "largest program; buffers reused by liveness".into());
    row(
        &mut out,
        "KV cache",
        g.kv_bytes,
        format!(
            "{} pages x {} tokens = {} tokens; {} B/token ({} layers x (latent {} + rope {} + indexer {}) x {})",
            g.kv_pages, g.kv_page_size, g.kv_token_capacity, g.kv_bytes_per_token, kv.layers, kv.latent_dim, kv.rope_dim, kv.index_dim, kv.dtype
        ),
    );
    row(&mut out, "RoPE table", g.rope_table_bytes, format!("(cos, sin) F32 for {} positions x {} pairs", kv.max_context, kv.rope_dim / 2));
    row(&mut out, "headroom", g.headroom_bytes, "CUDA context, NCCL, module images, slack".into());
    row(&mut out, "free", g.free_bytes, String::new());
    writeln!(out)?;
    writeln!(out, "programs (one CUDA graph per rank each)")?;
    writeln!(out, "  {:<16}{:>8}{:>8}{:>8}{:>8}{:>13}{:>14}", "name", "kind", "tokens", "logits", "steps", "collectives", "workspace")?;
    for p in &s.programs {
        writeln!(out, "  {:<16}{:>8}{:>8}{:>8}{:>8}{:>13}{:>14}", p.name, p.kind, p.tokens, p.logit_rows, p.steps, p.collectives, human_bytes(p.workspace_bytes))?;
    }
    if plan.target.arch != kiln_runtime::plan::Arch::Cpu {
        writeln!(out)?;
        writeln!(out, "kernels ({} instances; registers / spills / static smem from ptxas -v, dynamic smem of the launch)", s.kernels.len())?;
        for k in &s.kernels {
            let res = match &k.resources {
                Some(r) => format!(
                    "{} regs, {} B spills, smem {} B static + {} B dynamic [{}]",
                    r.registers,
                    r.spill_store_bytes + r.spill_load_bytes,
                    r.smem_static_bytes,
                    k.smem_dynamic_bytes,
                    r.arch.name()
                ),
                None => format!("smem {} B dynamic; not assembled (ptxas not found at compile time)", k.smem_dynamic_bytes),
            };
            writeln!(out, "  {:<14}{:>6} launches  {res}\n    {}", k.family, k.launches, k.name)?;
        }
    }
    writeln!(out)?;
    writeln!(out, "sharding")?;
    for c in &s.sharding {
        writeln!(out, "  - {}: {}\n      why: {}", c.what, c.how, c.why)?;
    }
    if !s.ignored.is_empty() {
        writeln!(out)?;
        writeln!(out, "not bound")?;
        for i in s.ignored.iter().take(20) {
            writeln!(out, "  - {i}")?;
        }
        if s.ignored.len() > 20 {
            writeln!(out, "  ... and {} more", s.ignored.len() - 20)?;
        }
    }
    emit(out)
}

/// Writes to stdout; a closed pipe (`kiln inspect | head`) is not an error.
fn emit(text: String) -> anyhow::Result<()> {
    match std::io::stdout().write_all(text.as_bytes()) {
        Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => Err(e.into()),
        _ => Ok(()),
    }
}
