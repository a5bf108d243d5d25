use anyhow::{bail, Context};
use kiln_runtime::cpu::{StepPhase, StepView};
use kiln_runtime::cuda::step::StepRunner;
use kiln_runtime::emu::Module;
use kiln_runtime::plan::{BufId, DType, KernelFamily, LaunchArg, Op, Plan, ProgramKind};
use kiln_runtime::session::{LogitRows, Session, SessionOptions};
use kiln_runtime::verify::{compare_cache_write, compare_outputs, emulate, Comparison, StepInputs, Values};
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

/// Run a plan's kernels step by step against the CPU reference.
///
/// Each chosen program runs on the CPU backend; every step's kernel launches are then run in the
/// PTX emulator on the values (and KV cache) the CPU had before the step, on every rank with its
/// weights arena, and the outputs (the cache too, for cache writes) are compared with the CPU's.
/// Prints per step the max abs / rel error, names the first step beyond tolerance and the first
/// producing NaN/Inf, and reports the emulator's global bytes read against the compulsory bytes
/// (inputs and weights once; for MoE only the selected experts) and how many times each needed
/// weight byte was read.
/// Tolerances: BF16 outputs |d| <= 2^-7 |ref| + 2^-12 max|ref| (one BF16 ulp from summation order;
/// 2^-6 for ops that round twice, e.g. RMSNorm); F32 outputs 2^-16 / 2^-20.
/// Exits with an error when a step fails.
#[derive(clap::Args)]
pub struct Args {
    /// Artifact directory written by `kiln compile` (a GPU target).
    artifact: PathBuf,
    /// Checkpoint directory with the weights (default: the one the artifact was compiled from).
    #[arg(long)]
    weights: Option<PathBuf>,
    /// Backend to check: emu (the PTX emulator) or cuda (each step's launches eagerly on GPU 0,
    /// every rank in turn; the byte counts are the emulator's only).
    #[arg(long, default_value = "emu", value_parser = ["emu", "cuda"])]
    backend: String,
    /// Only this program, or `all` (default: every program with `--backend cuda`, where the
    /// kernels run in milliseconds; every decode program and the smallest prefill program on the
    /// emulator, where larger prefills take minutes).
    #[arg(long)]
    program: Option<String>,
}

/// Buffer snapshots of one step on one rank.
struct Record {
    step: usize,
    rank: usize,
    before: Vec<(BufId, Values)>,
    after: Vec<(BufId, Values)>,
    /// KV-cache layers the launches address, before the step and (for cache writes) after it
    /// (GPU byte layout).
    kv_before: Vec<(u32, Vec<u8>)>,
    kv_after: Vec<(u32, Vec<u8>)>,
}

fn snapshot(view: &StepView, rank: usize, bufs: &[BufId], dtypes: &[DType]) -> Vec<(BufId, Values)> {
    bufs.iter()
        .map(|&b| {
            let v = if dtypes[b.0 as usize] == DType::I32 { Values::I32(view.buffer_i32(rank, b).to_vec()) } else { Values::F32(view.buffer_f32(rank, b).to_vec()) };
            (b, v)
        })
        .collect()
}

/// Drives the session so that program `index` replays once (recording its launched steps).
fn replay(session: &mut Session, plan: &Plan, index: usize) -> anyhow::Result<Vec<Record>> {
    let p = &plan.programs[index];
    // Per launched step: the buffers its launch passes (before) and writes (after).
    let mut watch: HashMap<usize, (Vec<BufId>, Vec<BufId>, Vec<u32>)> = HashMap::new();
    for (s, step) in p.steps.iter().enumerate() {
        if !step.launches.is_empty() && step.kernel != KernelFamily::Collective {
            let mut args: Vec<BufId> = step.launches.iter().flat_map(|l| &l.args).filter_map(|a| if let LaunchArg::Buffer(b) = a { Some(*b) } else { None }).collect();
            for op in step.op.leaves() {
                if let Op::MoeExperts { ids, .. } = *op {
                    // The MoE byte report needs the routing and which tokens are real.
                    args.extend([ids, p.inputs.token_seq]);
                }
            }
            args.sort();
            args.dedup();
            let layers: Vec<u32> = step.launches.iter().flat_map(|l| &l.args).filter_map(|a| if let LaunchArg::KvCache { layer } = a { Some(*layer) } else { None }).collect();
            watch.insert(s, (args, step.op.results(), layers));
        }
    }
    let dtypes: Vec<DType> = p.buffers.iter().map(|b| b.dtype).collect();
    let cache_writes: Vec<bool> = p.steps.iter().map(|s| s.op.writes_kv_cache()).collect();
    let records = Arc::new(Mutex::new(Vec::<Record>::new()));
    let sink = records.clone();
    session.cpu_mut().context("verify needs the CPU backend")?.set_observer(Some(Box::new(move |view: &StepView| {
        if view.program != index {
            return;
        }
        let Some((args, writes, layers)) = watch.get(&view.step) else { return };
        let cache_write = cache_writes[view.step];
        let mut recs = sink.lock().expect("verify records");
        let slots = view.kv_slots();
        for rank in 0..view.ranks() {
            let kv = |rank| layers.iter().map(|&l| (l, view.kv_layer_bytes(rank, l as usize, slots))).collect::<Vec<_>>();
            match view.phase {
                StepPhase::Before => recs.push(Record {
                    step: view.step,
                    rank,
                    before: snapshot(view, rank, args, &dtypes),
                    after: Vec::new(),
                    kv_before: kv(rank),
                    kv_after: Vec::new(),
                }),
                StepPhase::After => {
                    if let Some(r) = recs.iter_mut().rev().find(|r| r.step == view.step && r.rank == rank) {
                        r.after = snapshot(view, rank, writes, &dtypes);
                        if cache_write {
                            r.kv_after = kv(rank);
                        }
                    }
                }
            }
        }
    })));
    let vocab = plan.model.vocab_size as u32;
    let id = |i: usize| ((i as u64 * 7919 + 13) % vocab as u64) as u32;
    let result = match p.kind {
        ProgramKind::Prefill { .. } => {
            let n = p.tokens.min(session.max_context());
            let seq = session.new_sequence();
            let ids: Vec<u32> = (0..n).map(id).collect();
            let r = session.prefill(seq, &ids, LogitRows::Last).map(|_| ());
            session.release(seq);
            r
        }
        ProgramKind::Decode { batch } => {
            let seqs: Vec<_> = (0..batch).map(|_| session.new_sequence()).collect();
            let mut r = Ok(());
            // A short prompt each (other programs; not recorded), then one decode step; for a
            // draft program one draft step, beside the hidden state the prompt's last token left.
            let mut hidden = Vec::new();
            for (i, &s) in seqs.iter().enumerate() {
                if r.is_ok() {
                    let ids: Vec<u32> = (0..3).map(|j| id(i * 3 + j)).collect();
                    r = session.prefill(s, &ids, LogitRows::Last).map(|_| ());
                    let rows = session.runner().hidden().unwrap_or_default();
                    hidden.extend_from_slice(&rows[rows.len().saturating_sub(plan.model.hidden_size)..]);
                }
            }
            if r.is_ok() {
                let b: Vec<_> = seqs.iter().enumerate().map(|(i, &s)| (s, id(1000 + i))).collect();
                r = if p.is_draft() { session.draft(&b, &hidden) } else { session.decode(&b) }.map(|_| ());
            }
            for s in seqs {
                session.release(s);
            }
            r
        }
    };
    session.cpu_mut().context("verify needs the CPU backend")?.set_observer(None);
    result?;
    if session.cpu().and_then(|c| c.last_program()) != Some(index) {
        bail!("program {} did not replay (the session chose another bucket)", p.name);
    }
    let recs = std::mem::take(&mut *records.lock().expect("verify records"));
    Ok(recs)
}

/// Bytes of the expert weights an MoE step needs: the gate/up and down slices of every local
/// expert that some active token selected (each counted once).
fn moe_selected_bytes(plan: &Plan, p: &kiln_runtime::plan::Program, op: &Op, value: &dyn Fn(BufId) -> Values, rank: usize) -> u64 {
    let Op::MoeExperts { ids: ids_buf, gate_up, down, experts_local, expert_parallel, .. } = op else { return 0 };
    let Values::I32(ids) = value(*ids_buf) else { return 0 };
    let Values::I32(seq) = value(p.inputs.token_seq) else { return 0 };
    let top_k = p.buffer(*ids_buf).shape.last().copied().unwrap_or(1).max(1);
    let first = if *expert_parallel { rank * experts_local } else { 0 };
    let mut used = vec![false; *experts_local];
    for (i, &e) in ids.iter().enumerate() {
        let local = e as i64 - first as i64;
        if seq.get(i / top_k).is_some_and(|&s| s >= 0) && (0..*experts_local as i64).contains(&local) {
            used[local as usize] = true;
        }
    }
    let per_expert: u64 = gate_up.ids().iter().chain(down.ids().iter()).map(|&w| plan.weight(w).bytes / *experts_local as u64).sum();
    used.iter().filter(|&&u| u).count() as u64 * per_expert
}

pub fn run(a: Args) -> anyhow::Result<()> {
    let mut session = Session::open(&a.artifact, a.weights.as_deref(), SessionOptions { progress: true, ..Default::default() })
        .with_context(|| format!("opening {}", a.artifact.display()))?;
    let plan = session.plan().clone();
    if plan.kernels.is_empty() {
        bail!("{} has no kernels (compiled for {}); verify needs a GPU target such as sm_120a", a.artifact.display(), plan.target.name);
    }
    let all = a.program.as_deref() == Some("all") || (a.program.is_none() && a.backend == "cuda");
    let chosen: Vec<usize> = match &a.program {
        _ if all => (0..plan.programs.len()).collect(),
        Some(name) => vec![plan.programs.iter().position(|p| &p.name == name).with_context(|| {
            format!("no program {name:?}; the plan has {}", plan.programs.iter().map(|p| p.name.as_str()).collect::<Vec<_>>().join(", "))
        })?],
        None => {
            let mut v: Vec<usize> = (0..plan.programs.len()).filter(|&i| matches!(plan.programs[i].kind, ProgramKind::Decode { .. })).collect();
            if let Some(i) = (0..plan.programs.len()).filter(|&i| matches!(plan.programs[i].kind, ProgramKind::Prefill { .. })).min_by_key(|&i| plan.programs[i].tokens) {
                v.insert(0, i);
            }
            v
        }
    };
    let rope_table = kiln_runtime::cpu::rope::Rope::plan_table_bytes(&plan);
    let mut gpu = match a.backend.as_str() {
        "cuda" => Some(StepRunner::new(&plan, Some(a.artifact.join("kernels"))).context("opening GPU 0 for verify --backend cuda")?),
        _ => None,
    };
    let mut modules: HashMap<u32, Module> = HashMap::new();
    let mut first_bad: Option<String> = None;
    let mut first_nan: Option<String> = None;
    let mut checked = 0usize;
    let on = if gpu.is_some() { "GPU 0 (CUDA, eager launches)" } else { "the PTX emulator" };
    println!("verify {} on {on} against the CPU reference ({} ranks)", a.artifact.display(), plan.ranks());
    for &pi in &chosen {
        let p = &plan.programs[pi];
        let records = replay(&mut session, &plan, pi)?;
        println!("\nprogram {} ({} tokens, {} steps)", p.name, p.tokens, p.steps.len());
        println!("  {:>4}  {:<18}{:<14}{:>11}{:>11}  {:<6}{}", "step", "op", "kernel", "max abs", "max rel", "", "global bytes read / compulsory");
        for (s, step) in p.steps.iter().enumerate() {
            if step.launches.is_empty() || step.kernel == KernelFamily::Collective {
                continue; // a collective: the host sums in rank order on both sides (the P2P
                          // all-reduce kernel needs every rank at once: the emulator backend runs it)
            }
            for l in step.launches.iter().filter(|_| gpu.is_none()) {
                if !modules.contains_key(&l.kernel.0) {
                    let kernel = plan.kernel(l.kernel);
                    let m = Module::parse(&kernel.ptx, &format!("{}.ptx", kernel.name)).map_err(|e| anyhow::anyhow!("{e}"))?;
                    modules.insert(l.kernel.0, m);
                }
            }
            let mods: Vec<&Module> = step.launches.iter().filter_map(|l| modules.get(&l.kernel.0)).collect();
            let names: Vec<&str> = step.launches.iter().map(|l| plan.kernel(l.kernel).name.as_str()).collect();
            let mut cmp = Comparison::default();
            let (mut read, mut compulsory, mut weight_read, mut weight_bytes) = (0u64, 0u64, 0u64, 0u64);
            for rank in 0..plan.ranks() {
                let rec = records.iter().find(|r| r.step == s && r.rank == rank).with_context(|| format!("step {s} was not recorded"))?;
                let value = |b: BufId| rec.before.iter().find(|(x, _)| *x == b).map(|(_, v)| v.clone()).expect("every launch buffer is recorded");
                let kv_layer = |l: u32| rec.kv_before.iter().find(|(x, _)| *x == l).map(|(_, v)| v.clone()).expect("every cache layer is recorded");
                let arena = session.cpu().and_then(|c| c.arena(rank)).context("rank arena")?;
                let inputs = StepInputs { value: &value, arena, rank, kv_layer: &kv_layer, rope_table: &rope_table };
                let out = match gpu.as_mut() {
                    Some(g) => g.run(&plan, p, &step.launches, &step.op.reads(), &step.op.results(), &inputs),
                    None => emulate(&plan, p, &step.launches, &mods, &step.op.reads(), &step.op.results(), &inputs),
                }
                .map_err(|e| anyhow::anyhow!("{} step {s} on rank {rank}: {e}", p.name))?;
                let mut c = compare_outputs(p, &step.op, &out.outputs, &rec.after);
                if step.op.writes_kv_cache() {
                    for (l, bytes) in &out.kv {
                        let cpu = rec.kv_after.iter().find(|(x, _)| x == l).map(|(_, v)| v.as_slice()).unwrap_or(&[]);
                        c.merge(&compare_cache_write(p, &step.op, &plan.memory.kv, bytes, cpu));
                    }
                }
                cmp.merge(&c);
                // An MoE step needs only the experts its tokens selected.
                let weights_needed = step.op.leaves().iter().filter(|op| matches!(op, Op::MoeExperts { .. })).fold(out.weight_bytes, |bytes, op| {
                    let all: u64 = op.weight_ids().iter().map(|&w| plan.weight(w).bytes).sum();
                    bytes - all.min(bytes) + moe_selected_bytes(&plan, p, op, &value, rank)
                });
                read += out.bytes_read;
                compulsory += out.compulsory_read - out.weight_bytes + weights_needed;
                weight_read += out.weight_read;
                weight_bytes += weights_needed;
            }
            checked += 1;
            let status = if cmp.non_finite > 0 {
                "NaN"
            } else if cmp.ok() {
                "ok"
            } else {
                "FAIL"
            };
            let here = format!("{} step {s} ({}, {})", p.name, step.op.name(), names.join(" + "));
            if cmp.non_finite > 0 && first_nan.is_none() {
                first_nan = Some(here.clone());
            }
            if !cmp.ok() && first_bad.is_none() {
                first_bad = Some(format!("{here}: {} of {} values beyond tolerance", cmp.beyond + cmp.non_finite, cmp.elements));
            }
            let bytes = if gpu.is_some() {
                "n/a on a GPU".to_string()
            } else if weight_bytes > 0 {
                format!("{read} / {compulsory} = {:.3}; weights {:.3}", read as f64 / compulsory.max(1) as f64, weight_read as f64 / weight_bytes as f64)
            } else {
                format!("{read} / {compulsory}")
            };
            // a concurrent step: its ops and the kernel families of its launches' parts
            let (op_name, family) = match &step.op {
                Op::Concurrent { ops } => {
                    let mut families: Vec<&str> = step.launches.iter().flat_map(|l| plan.part_launches(l)).map(|q| plan.kernel(q.kernel).family.name()).collect();
                    families.dedup();
                    (ops.iter().map(Op::name).collect::<Vec<_>>().join("+"), families.join("+"))
                }
                op => (op.name().to_string(), step.kernel.name().to_string()),
            };
            println!("  {s:>4}  {op_name:<18}{family:<14}{:>11.3e}{:>11.3e}  {status:<6}{bytes}", cmp.max_abs, cmp.max_rel);
        }
    }
    println!("\n{checked} launched steps checked");
    println!("first NaN/Inf: {}", first_nan.as_deref().unwrap_or("none"));
    match first_bad {
        None => {
            println!("first step beyond tolerance: none");
            Ok(())
        }
        Some(b) => {
            println!("first step beyond tolerance: {b}");
            bail!("verification failed at {b}")
        }
    }
}
