use kiln_compiler::error::human_bytes;
use kiln_runtime::perf::{self, Constants};
use kiln_runtime::plan::summary::summarize;
use kiln_runtime::plan::{read_plan, Plan};
use std::fmt::Write as _;
use std::io::Write as _;
use std::path::PathBuf;

/// Show what a plan does per GPU: memory by kind, KV capacity, programs and sharding choices;
/// with --perf, the predicted time of every launch and collective (a model, not a measurement).
#[derive(clap::Args)]
pub struct Args {
    /// Artifact directory written by `kiln compile`.
    artifact: PathBuf,
    /// Print the summary as JSON (with --perf: and the prediction under `perf`).
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    perf: PerfArgs,
}

/// The performance model's switch and constants (defaults: the fixed sm_120a constants).
#[derive(clap::Args)]
pub struct PerfArgs {
    /// Predict the step time, tokens/s and the longest launches of the decode and prefill
    /// programs from each launch's bytes and FLOPs (`max(bytes / bandwidth, flops / rate) + launch`)
    /// and each collective's size, the time to first token of 8k to 128k prompts (the chunks the
    /// runtime prefills them in, each at its context), and what speculative decoding would make of
    /// the decode programs (k drafts a sequence as k more rows: the step, and tokens/s by
    /// acceptance). Every figure is a prediction.
    #[arg(long)]
    perf: bool,
    /// DRAM bandwidth per GPU, TB/s [default: 1.792 for sm_120a; the target's for sm_90a].
    #[arg(long, requires = "perf")]
    dram_tbps: Option<f64>,
    /// Fraction of the DRAM bandwidth a kernel achieves [default: 0.85].
    #[arg(long, requires = "perf")]
    dram_efficiency: Option<f64>,
    /// Dense block-scaled FP4 mma rate, PFLOP/s [default: 1.6].
    #[arg(long, requires = "perf")]
    fp4_pflops: Option<f64>,
    /// Dense BF16 mma rate, PFLOP/s [default: 0.4].
    #[arg(long, requires = "perf")]
    bf16_pflops: Option<f64>,
    /// FP32 FMA rate of the CUDA cores, TFLOP/s [default: 60].
    #[arg(long, requires = "perf")]
    fp32_tflops: Option<f64>,
    /// Cost of one kernel node in a graph, µs [default: 1.5].
    #[arg(long, requires = "perf")]
    launch_us: Option<f64>,
    /// NCCL all-reduce / all-gather latency, µs [default: 25].
    #[arg(long, requires = "perf")]
    nccl_base_us: Option<f64>,
    /// NCCL bandwidth, GB/s [default: 40].
    #[arg(long, requires = "perf")]
    nccl_gbps: Option<f64>,
    /// One-shot P2P all-reduce / all-gather latency, µs [default: 8].
    #[arg(long, requires = "perf")]
    p2p_base_us: Option<f64>,
    /// One-shot P2P bandwidth per peer, GB/s [default: 50].
    #[arg(long, requires = "perf")]
    p2p_gbps: Option<f64>,
    /// Largest all-reduce (all-gather: per rank) the one-shot P2P path takes, KiB [default: 64].
    #[arg(long, requires = "perf")]
    p2p_max_kib: Option<u64>,
    /// Sequences of the decode step whose launches are listed.
    #[arg(long, requires = "perf", default_value_t = 1)]
    top_batch: usize,
    /// Context of the step whose launches are listed (with --top-prefill: the chunk ends there).
    #[arg(long, requires = "perf", default_value_t = 8192)]
    top_context: usize,
    /// List the launches of the prefill chunk of this many tokens instead of a decode step
    /// (one sequence; the chunk's last token at --top-context - 1, or from position 0 when the
    /// chunk is longer).
    #[arg(long, requires = "perf", conflicts_with = "top_batch")]
    top_prefill: Option<usize>,
    /// How many of its longest launch groups are listed (identical launches summed; 0: all).
    #[arg(long, requires = "perf", default_value_t = 10)]
    top_count: usize,
}

impl PerfArgs {
    fn top_step(&self) -> perf::TopStep {
        match self.top_prefill {
            Some(chunk) => perf::TopStep::Prefill { chunk },
            None => perf::TopStep::Decode { batch: self.top_batch },
        }
    }

    /// The target's defaults with the flags applied, and the notes on where they come from.
    fn constants(&self, plan: &Plan) -> anyhow::Result<(Constants, Vec<String>)> {
        let (mut k, notes) = Constants::for_target(&plan.target).map_err(anyhow::Error::msg)?;
        let set = |v: &mut f64, flag: Option<f64>, name: &str| -> anyhow::Result<()> {
            if let Some(x) = flag {
                anyhow::ensure!(x.is_finite() && x > 0.0, "--{name} must be a positive number, got {x}");
                *v = x;
            }
            Ok(())
        };
        set(&mut k.dram_tbps, self.dram_tbps, "dram-tbps")?;
        set(&mut k.dram_efficiency, self.dram_efficiency, "dram-efficiency")?;
        anyhow::ensure!(k.dram_efficiency <= 1.0, "--dram-efficiency is a fraction of the bandwidth (at most 1), got {}", k.dram_efficiency);
        set(&mut k.fp4_pflops, self.fp4_pflops, "fp4-pflops")?;
        set(&mut k.bf16_pflops, self.bf16_pflops, "bf16-pflops")?;
        set(&mut k.fp32_tflops, self.fp32_tflops, "fp32-tflops")?;
        set(&mut k.nccl_gbps, self.nccl_gbps, "nccl-gbps")?;
        set(&mut k.p2p_gbps, self.p2p_gbps, "p2p-gbps")?;
        for (v, flag, name) in [(&mut k.launch_us, self.launch_us, "launch-us"), (&mut k.nccl_base_us, self.nccl_base_us, "nccl-base-us"), (&mut k.p2p_base_us, self.p2p_base_us, "p2p-base-us")] {
            if let Some(x) = flag {
                anyhow::ensure!(x.is_finite() && x >= 0.0, "--{name} must be a number >= 0, got {x}");
                *v = x;
            }
        }
        if let Some(kib) = self.p2p_max_kib {
            k.p2p_max_bytes = kib * 1024;
        }
        Ok((k, notes))
    }
}

pub fn run(a: Args) -> anyhow::Result<()> {
    let plan = read_plan(&a.artifact)?;
    let s = summarize(&plan);
    let report = match a.perf.perf {
        true => {
            let (k, notes) = a.perf.constants(&plan)?;
            Some(perf::report(&plan, &k, notes, a.perf.top_step(), a.perf.top_context, if a.perf.top_count == 0 { usize::MAX } else { a.perf.top_count }).map_err(anyhow::Error::msg)?)
        }
        false => None,
    };
    if a.json {
        let text = match &report {
            // The summary's fields as without --perf (serde_json keeps their order), then `perf`.
            Some(perf) => {
                let mut v = serde_json::to_value(&s)?;
                if let Some(obj) = v.as_object_mut() {
                    obj.insert("perf".into(), serde_json::to_value(perf)?);
                }
                serde_json::to_string_pretty(&v)?
            }
            None => serde_json::to_string_pretty(&s)?,
        };
        return emit(text + "\n");
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
        match kv.index_keys {
            kiln_runtime::plan::IndexKeys::Bf16 => format!(
                "{} pages x {} tokens = {} tokens; {} B/token ({} layers x (latent {} + rope {} + indexer {}) x {})",
                g.kv_pages, g.kv_page_size, g.kv_token_capacity, g.kv_bytes_per_token, kv.layers, kv.latent_dim, kv.rope_dim, kv.index_dim, kv.dtype
            ),
            kiln_runtime::plan::IndexKeys::Fp8 => format!(
                "{} pages x {} tokens = {} tokens; {} B/token ({} layers x {} B: (latent {} + rope {}) x {} + indexer {} FP8 + scale, padded to 16 B)",
                g.kv_pages, g.kv_page_size, g.kv_token_capacity, g.kv_bytes_per_token, kv.layers, kv.slot_bytes(), kv.latent_dim, kv.rope_dim, kv.dtype, kv.index_dim
            ),
        },
    );
    row(&mut out, "RoPE table", g.rope_table_bytes, format!("(cos, sin) F32 for {} positions x {} pairs", kv.max_context, kv.rope_dim / 2));
    row(&mut out, "headroom", g.headroom_bytes, "CUDA context, NCCL, module images, slack".into());
    row(&mut out, "free", g.free_bytes, String::new());
    writeln!(out)?;
    writeln!(out, "programs (one CUDA graph per rank each)")?;
    // (names as long as `prefill_2048_from_1363` keep the columns aligned)
    let w = s.programs.iter().map(|p| p.name.len() + 2).max().unwrap_or(0).max(16);
    writeln!(out, "  {:<w$}{:>8}{:>8}{:>8}{:>8}{:>13}{:>14}", "name", "kind", "tokens", "logits", "steps", "collectives", "workspace")?;
    for p in &s.programs {
        writeln!(out, "  {:<w$}{:>8}{:>8}{:>8}{:>8}{:>13}{:>14}", p.name, p.kind, p.tokens, p.logit_rows, p.steps, p.collectives, human_bytes(p.workspace_bytes))?;
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
    if let Some(r) = &report {
        writeln!(out)?;
        perf_text(&mut out, r)?;
    }
    emit(out)
}

/// The column heads of a decode or prefill table; `first` names the leading column.
fn step_header(out: &mut String, first: &str) -> std::fmt::Result {
    writeln!(out, "    {:>5} {:>7} {:>10} {:>9} {:>10} {:>9} {:>9} {:>10} {:>10} {:>8} {:>5}", first, "context", "step ms", "tok/s", "p2p ms", "p2p tok/s", "floor ms", "bytes/GPU", "KV/GPU", "launches", "coll")
}

/// One row of a decode or prefill table, tokens/s with `digits` decimals.
fn step_row(out: &mut String, first: usize, s: &perf::StepPerf, digits: usize) -> std::fmt::Result {
    writeln!(
        out,
        "    {:>5} {:>7} {:>10.2} {:>9.digits$} {:>10.2} {:>9.digits$} {:>9.2} {:>10} {:>10} {:>8} {:>5}",
        first,
        context(s.context),
        s.step_ms,
        s.tokens_per_s,
        s.step_ms_p2p,
        s.tokens_per_s_p2p,
        s.floor_ms_p2p,
        gb(s.bytes_per_gpu),
        gb(s.kv_bytes_per_gpu),
        s.launches,
        s.collectives
    )
}

/// Decimal bytes with a unit (the model's byte counts are fractional expectations).
fn gb(bytes: f64) -> String {
    if bytes >= 1e9 {
        format!("{:.2} GB", bytes / 1e9)
    } else if bytes >= 1e6 {
        format!("{:.2} MB", bytes / 1e6)
    } else if bytes >= 1e3 {
        format!("{:.1} kB", bytes / 1e3)
    } else {
        format!("{bytes:.0} B")
    }
}

fn context(c: usize) -> String {
    if c >= 1024 && c.is_multiple_of(1024) {
        format!("{}k", c / 1024)
    } else {
        c.to_string()
    }
}

/// Time to first token of prompts from position 0: the pieces the runtime runs, summed.
fn prompts(out: &mut String, r: &perf::Report) -> std::fmt::Result {
    if r.prompts.is_empty() {
        return Ok(());
    }
    writeln!(out)?;
    writeln!(out, "  time to first token (predicted; a prompt from position 0 in the pieces the CUDA backend runs, each at the context it ends at)")?;
    writeln!(out, "    {:>7} {:>9} {:>7} {:>9} {:>9}  pieces", "prompt", "ttft s", "tok/s", "p2p s", "p2p tok/s")?;
    for p in &r.prompts {
        let runs: Vec<String> = perf::prompt::runs(&p.pieces).iter().map(|(name, n)| if *n == 1 { name.to_string() } else { format!("{n} x {name}") }).collect();
        writeln!(out, "    {:>7} {:>9.2} {:>7.0} {:>9.2} {:>9.0}  {}", context(p.tokens), p.ttft_ms / 1e3, p.tokens_per_s, p.ttft_ms_p2p / 1e3, p.tokens_per_s_p2p, runs.join(", "))?;
    }
    Ok(())
}

/// The prediction as text: assumptions first, then decode and prefill rows, then the longest launches.
fn perf_text(out: &mut String, r: &perf::Report) -> std::fmt::Result {
    let k = &r.assumptions.constants;
    writeln!(out, "predicted performance ({}; a model of the plan's launches, nothing measured: every figure below is predicted)", r.assumptions.target)?;
    writeln!(out, "  assumptions (override with the flags named)")?;
    writeln!(out, "    DRAM            {:.3} TB/s x {:.2} effective = {:.3} TB/s per GPU   --dram-tbps --dram-efficiency", k.dram_tbps, k.dram_efficiency, k.dram_tbps * k.dram_efficiency)?;
    writeln!(out, "    L2              not a cache for weights (nor for re-read activations or KV rows)")?;
    writeln!(out, "    compute         NVFP4 mma {} PFLOP/s, BF16 mma {} PFLOP/s, FP32 FMA {} TFLOP/s (dense)   --fp4-pflops --bf16-pflops --fp32-tflops", k.fp4_pflops, k.bf16_pflops, k.fp32_tflops)?;
    writeln!(out, "    occupancy       a launch with fewer working blocks than the {} SMs gets that fraction of bandwidth and compute", k.sms)?;
    writeln!(out, "    launch          {} µs per kernel node of the graph   --launch-us", k.launch_us)?;
    writeln!(out, "    NCCL            all-reduce {} µs + bytes / {} GB/s (all-gather: the same over the gathered bytes)   --nccl-base-us --nccl-gbps", k.nccl_base_us, k.nccl_gbps)?;
    writeln!(
        out,
        "    P2P             {} µs + (ranks - 1) x part / {} GB/s, part = an all-reduce's bytes or an all-gather's share per rank, up to {} KiB, where the plan has the kernel: the p2p columns   --p2p-base-us --p2p-gbps --p2p-max-kib",
        k.p2p_base_us,
        k.p2p_gbps,
        k.p2p_max_bytes / 1024
    )?;
    for n in &r.assumptions.notes {
        writeln!(out, "    - {n}")?;
    }
    writeln!(out)?;
    writeln!(out, "  decode (predicted; tok/s = sequences / step)")?;
    step_header(out, "batch")?;
    for d in &r.decode {
        step_row(out, d.batch, &d.step, 1)?;
    }
    writeln!(out)?;
    writeln!(out, "  prefill (predicted; one sequence, tok/s = chunk / step)")?;
    step_header(out, "chunk")?;
    for p in &r.prefill {
        step_row(out, p.chunk, &p.step, 0)?;
    }
    prompts(out, r)?;
    speculative(out, r)?;
    let t = &r.top;
    writeln!(out)?;
    writeln!(
        out,
        "  top {} launches of {} ({} at context {}; predicted step {:.2} ms; identical launches summed; x compulsory = bytes moved / distinct bytes)",
        t.launches.len(),
        t.program,
        match t.program.starts_with("prefill") {
            true => format!("a chunk of {} tokens", t.tokens),
            false => format!("{} sequence(s)", t.batch),
        },
        context(t.context),
        t.step_ms
    )?;
    writeln!(out, "    {:>8} {:>6} {:>6} {:>10} {:>10} {:>6} {:>7} {:>9}  kernel", "ms/step", "share", "count", "µs each", "bytes each", "x comp", "blocks", "bound")?;
    for l in &t.launches {
        writeln!(
            out,
            "    {:>8.3} {:>5.1}% {:>6} {:>10.2} {:>10} {:>6.2} {:>7.0} {:>9}  {} ({})",
            l.ms_total,
            l.share * 100.0,
            l.count,
            l.us_each,
            gb(l.bytes_each),
            l.bytes_each / l.compulsory_bytes_each.max(1.0),
            l.blocks,
            l.bound,
            l.kernel,
            l.op
        )?;
    }
    Ok(())
}

/// The decode steps speculative decoding would run, at the context of the detailed step (or the
/// nearest below it; `--json` has every context).
fn speculative(out: &mut String, r: &perf::Report) -> std::fmt::Result {
    let contexts = || r.speculative.iter().map(|s| s.context);
    let Some(at) = contexts().filter(|&c| c <= r.top.context).max().or_else(|| contexts().min()) else { return Ok(()) };
    let rates = perf::speculative::ACCEPTANCE.map(|a| format!("a={a}"));
    writeln!(out)?;
    writeln!(
        out,
        "  speculative decoding at context {} (predicted, P2P; k drafts a sequence checked as k more decode rows; each accepted with probability a once those before it were, a step gains 1 + a + ... + a^k tokens a sequence; drafts free, as prompt lookup's are)",
        context(at)
    )?;
    writeln!(out, "    {:>5} {:>2} {:>5} {:>8} {:>8} {:>10} {:>9} {:>9} {:>9} {:>9}", "batch", "k", "rows", "plain ms", "step ms", "pays from", rates[0], rates[1], rates[2], "all")?;
    for s in r.speculative.iter().filter(|s| s.context == at) {
        let pays = s.break_even_acceptance.map_or("never".to_string(), |a| format!("a={a:.2}"));
        let t = &s.tokens_per_s_p2p;
        writeln!(
            out,
            "    {:>5} {:>2} {:>5} {:>8.2} {:>8.2} {:>10} {:>9.1} {:>9.1} {:>9.1} {:>9.1}",
            s.batch, s.drafts, s.rows, s.plain_step_ms_p2p, s.step_ms_p2p, pays, t[0], t[1], t[2], s.tokens_per_s_p2p_all_accepted
        )?;
    }
    let drafted: Vec<_> = r.speculative.iter().filter(|s| s.context == at && s.draft_ms_p2p.is_some()).collect();
    if drafted.is_empty() {
        return Ok(());
    }
    writeln!(
        out,
        "  with the plan's draft model (its steps counted: one of up to batch x (1 + k) rows, k - 1 of batch rows)"
    )?;
    writeln!(out, "    {:>5} {:>2} {:>8} {:>8} {:>9} {:>9} {:>9}", "batch", "k", "draft ms", "total ms", rates[0], rates[1], rates[2])?;
    for s in drafted {
        let (d, t) = (s.draft_ms_p2p.unwrap_or(0.0), s.tokens_per_s_p2p_with_draft.clone().unwrap_or_default());
        writeln!(out, "    {:>5} {:>2} {:>8.2} {:>8.2} {:>9.1} {:>9.1} {:>9.1}", s.batch, s.drafts, d, s.step_ms_p2p + d, t[0], t[1], t[2])?;
    }
    Ok(())
}

/// Writes to stdout; a closed pipe (`kiln inspect | head`) is not an error.
fn emit(text: String) -> anyhow::Result<()> {
    match std::io::stdout().write_all(text.as_bytes()) {
        Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => Err(e.into()),
        _ => Ok(()),
    }
}
