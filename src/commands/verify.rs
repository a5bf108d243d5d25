use anyhow::{bail, Context};
use kiln_runtime::cpu::{StepPhase, StepView};
use kiln_runtime::emu::Module;
use kiln_runtime::plan::{BufId, DType, KernelFamily, Plan, ProgramKind};
use kiln_runtime::session::{LogitRows, Session, SessionOptions};
use kiln_runtime::verify::{compare_outputs, emulate, Comparison, Values};
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

/// Run a plan's kernels step by step against the CPU reference.
///
/// Each chosen program runs on the CPU backend; every step that has a kernel launch is then run
/// in the PTX emulator on the values the CPU had before the step (every rank, the rank's weights
/// arena) and its outputs are compared with the CPU's. Prints per step the max abs / rel error,
/// names the first step beyond tolerance and the first producing NaN/Inf, and reports the
/// emulator's global bytes read against the compulsory bytes (weights + inputs) of the GEMVs.
/// Tolerances: BF16 outputs |d| <= 2^-7 |ref| + 2^-12 max|ref|; F32 outputs 2^-16 / 2^-20.
/// Exits with an error when a step fails.
#[derive(clap::Args)]
pub struct Args {
    /// Artifact directory written by `kiln compile` (a GPU target).
    artifact: PathBuf,
    /// Checkpoint directory with the weights (default: the one the artifact was compiled from).
    #[arg(long)]
    weights: Option<PathBuf>,
    /// Backend to check: emu (the PTX emulator). cuda is not built yet.
    #[arg(long, default_value = "emu", value_parser = ["emu", "cuda"])]
    backend: String,
    /// Only this program (default: every decode program and the smallest prefill program).
    #[arg(long)]
    program: Option<String>,
}

/// Buffer snapshots of one step on one rank.
struct Record {
    step: usize,
    rank: usize,
    before: Vec<(BufId, Values)>,
    after: Vec<(BufId, Values)>,
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
    let mut watch: HashMap<usize, (Vec<BufId>, Vec<BufId>)> = HashMap::new();
    for (s, step) in p.steps.iter().enumerate() {
        if let Some(l) = &step.launch {
            let mut args: Vec<BufId> = l.args.iter().filter_map(|a| if let kiln_runtime::plan::LaunchArg::Buffer(b) = a { Some(*b) } else { None }).collect();
            args.sort();
            args.dedup();
            watch.insert(s, (args, step.op.writes()));
        }
    }
    let dtypes: Vec<DType> = p.buffers.iter().map(|b| b.dtype).collect();
    let records = Arc::new(Mutex::new(Vec::<Record>::new()));
    let sink = records.clone();
    session.backend_mut().set_observer(Some(Box::new(move |view: &StepView| {
        if view.program != index {
            return;
        }
        let Some((args, writes)) = watch.get(&view.step) else { return };
        let mut recs = sink.lock().expect("verify records");
        for rank in 0..view.ranks() {
            match view.phase {
                StepPhase::Before => recs.push(Record { step: view.step, rank, before: snapshot(view, rank, args, &dtypes), after: Vec::new() }),
                StepPhase::After => {
                    if let Some(r) = recs.iter_mut().rev().find(|r| r.step == view.step && r.rank == rank) {
                        r.after = snapshot(view, rank, writes, &dtypes);
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
            // A short prompt each (other programs; not recorded), then one decode step.
            for (i, &s) in seqs.iter().enumerate() {
                if r.is_ok() {
                    let ids: Vec<u32> = (0..3).map(|j| id(i * 3 + j)).collect();
                    r = session.prefill(s, &ids, LogitRows::Last).map(|_| ());
                }
            }
            if r.is_ok() {
                let b: Vec<_> = seqs.iter().enumerate().map(|(i, &s)| (s, id(1000 + i))).collect();
                r = session.decode(&b).map(|_| ());
            }
            for s in seqs {
                session.release(s);
            }
            r
        }
    };
    session.backend_mut().set_observer(None);
    result?;
    if session.backend().last_program() != Some(index) {
        bail!("program {} did not replay (the session chose another bucket)", p.name);
    }
    let recs = std::mem::take(&mut *records.lock().expect("verify records"));
    Ok(recs)
}

pub fn run(a: Args) -> anyhow::Result<()> {
    if a.backend == "cuda" {
        bail!("--backend cuda: the CUDA backend is not built yet; use --backend emu");
    }
    let mut session = Session::open(&a.artifact, a.weights.as_deref(), SessionOptions { progress: true, ..Default::default() })
        .with_context(|| format!("opening {}", a.artifact.display()))?;
    let plan = session.plan().clone();
    if plan.kernels.is_empty() {
        bail!("{} has no kernels (compiled for {}); verify needs a GPU target such as sm_120a", a.artifact.display(), plan.target.name);
    }
    let chosen: Vec<usize> = match &a.program {
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
    let mut modules: HashMap<u32, Module> = HashMap::new();
    let mut first_bad: Option<String> = None;
    let mut first_nan: Option<String> = None;
    let (mut checked, mut lacking) = (0usize, 0usize);
    println!("verify {} on the PTX emulator against the CPU reference ({} ranks)", a.artifact.display(), plan.ranks());
    for &pi in &chosen {
        let p = &plan.programs[pi];
        let records = replay(&mut session, &plan, pi)?;
        println!("\nprogram {} ({} tokens, {} steps)", p.name, p.tokens, p.steps.len());
        println!("  {:>4}  {:<18}{:<14}{:>11}{:>11}  {:<6}{}", "step", "op", "kernel", "max abs", "max rel", "", "global bytes read / compulsory");
        for (s, step) in p.steps.iter().enumerate() {
            let Some(launch) = &step.launch else {
                if step.kernel != KernelFamily::Collective {
                    lacking += 1;
                    println!("  {s:>4}  {:<18}{:<14}no kernel yet", step.op.name(), step.kernel.name());
                }
                continue;
            };
            let kernel = plan.kernel(launch.kernel);
            if !modules.contains_key(&launch.kernel.0) {
                let m = Module::parse(&kernel.ptx, &format!("{}.ptx", kernel.name)).map_err(|e| anyhow::anyhow!("{e}"))?;
                modules.insert(launch.kernel.0, m);
            }
            let module = &modules[&launch.kernel.0];
            let mut cmp = Comparison::default();
            let (mut read, mut compulsory) = (0u64, 0u64);
            for rank in 0..plan.ranks() {
                let rec = records.iter().find(|r| r.step == s && r.rank == rank).with_context(|| format!("step {s} was not recorded"))?;
                let value = |b: BufId| rec.before.iter().find(|(x, _)| *x == b).map(|(_, v)| v.clone()).expect("every launch buffer is recorded");
                let arena = session.backend().arena(rank).context("rank arena")?;
                let out = emulate(&plan, p, launch, module, &step.op.reads(), &step.op.writes(), &value, arena, rank)
                    .map_err(|e| anyhow::anyhow!("{} step {s} ({}) on rank {rank}: {e}", p.name, kernel.name))?;
                let c = compare_outputs(p, &out.outputs, &rec.after);
                cmp.max_abs = cmp.max_abs.max(c.max_abs);
                cmp.max_rel = cmp.max_rel.max(c.max_rel);
                cmp.elements += c.elements;
                cmp.beyond += c.beyond;
                cmp.non_finite += c.non_finite;
                read += out.bytes_read;
                compulsory += out.compulsory_read;
            }
            checked += 1;
            let status = if cmp.non_finite > 0 {
                "NaN"
            } else if cmp.ok() {
                "ok"
            } else {
                "FAIL"
            };
            let here = format!("{} step {s} ({}, {})", p.name, step.op.name(), kernel.name);
            if cmp.non_finite > 0 && first_nan.is_none() {
                first_nan = Some(here.clone());
            }
            if !cmp.ok() && first_bad.is_none() {
                first_bad = Some(format!("{here}: {} of {} values beyond tolerance", cmp.beyond + cmp.non_finite, cmp.elements));
            }
            let bytes = if matches!(step.kernel, KernelFamily::LinearNvfp4 | KernelFamily::LinearBf16) {
                format!("{read} / {compulsory} = {:.3}", read as f64 / compulsory.max(1) as f64)
            } else {
                format!("{read} / {compulsory}")
            };
            println!("  {s:>4}  {:<18}{:<14}{:>11.3e}{:>11.3e}  {status:<6}{bytes}", step.op.name(), step.kernel.name(), cmp.max_abs, cmp.max_rel);
        }
    }
    println!("\n{checked} launched steps checked; {lacking} steps have no kernel yet");
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
