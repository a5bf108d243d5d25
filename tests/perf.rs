//! The performance model (`kiln inspect --perf`, runtime/src/perf) against the PTX emulator: the
//! bytes the model says each launch loads and stores are what the emulator counts when it runs
//! the launch, class by class (weights, activations, KV cache, inputs + RoPE table, stores), on
//! the `micro` model compiled for sm_120a at TP 2: prefill chunks (tiled GEMMs; a full chunk from
//! position 0 and a padded one after a prefix; the indexer selecting across the two ranks, each
//! rank's rows its own tokens) and decode buckets (GEMVs, split-K GEMMs; a full
//! bucket and one with a padding row), every launch of every replayed program on both ranks, on
//! the state the CPU backend had before the step (real routing, top-k lists and page tables).
//! The load the model is given is read off the same state (positions, routing, ids).
//!
//! Tolerance: none. The model counts each template's loads and stores per lane, as the emulator
//! does, so every class must match to the byte; a template change that moves traffic (or a
//! lowering change that picks another form) fails here until the model follows it.
//!
//! Also: `kiln inspect --perf` on the full GLM-5 skeleton is instant, prints its assumptions and
//! has a model for every launch; `--json` keeps the summary and adds `perf`; CPU plans are refused.

use kiln_runtime::emu::{self, BufferId, GlobalMemory, KernelArg, Module};
use kiln_runtime::perf::{launch_cost, Bytes, Experts, Load, Tokens};
use kiln_runtime::plan::{BufId, DType, LaunchArg, Op, Plan, Program, SplitKLayout};
use kiln_runtime::session::{LogitRows, Session, SessionOptions};
use kiln_runtime::verify::{StepInputs, StepRegions, Values};
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::{Arc, Mutex};

fn kiln(args: &[&str]) -> Output {
    let o = Command::new(env!("CARGO_BIN_EXE_kiln")).args(args).output().expect("run kiln");
    assert!(o.status.success(), "kiln {args:?} failed:\n{}\n{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
    o
}

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("kiln-perf-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// One launched step of one replay on one rank: the buffers its launches pass (and the routing,
/// the inputs the load is read from) and the cache layers they address, before the step.
struct Record {
    replay: usize,
    program: usize,
    step: usize,
    rank: usize,
    values: Vec<(BufId, Values)>,
    kv: Vec<(u32, Vec<u8>)>,
}

/// Runs `drive` on the CPU backend, recording every launched step of every replay.
fn record(session: &mut Session, drive: impl FnOnce(&mut Session)) -> Vec<Record> {
    let plan = session.plan().clone();
    let records = Arc::new(Mutex::new(Vec::<Record>::new()));
    let sink = records.clone();
    let mut replay = 0usize;
    session.cpu_mut().expect("CPU backend").set_observer(Some(Box::new(move |view: &kiln_runtime::cpu::StepView| {
        if view.phase != kiln_runtime::cpu::StepPhase::Before {
            return;
        }
        if view.step == 0 {
            replay += 1;
        }
        let p = &plan.programs[view.program];
        let step = &p.steps[view.step];
        // collectives (NCCL, or the P2P all-reduce across all ranks at once) are costed by the
        // collective formulas, not by bytes
        if step.launches.is_empty() || step.kernel == kiln_runtime::plan::KernelFamily::Collective {
            return;
        }
        let i = p.inputs;
        let mut bufs: Vec<BufId> = step.launches.iter().flat_map(|l| &l.args).filter_map(|a| if let LaunchArg::Buffer(b) = a { Some(*b) } else { None }).collect();
        bufs.extend([i.ids, i.positions, i.token_seq, i.logit_rows]);
        for op in step.op.leaves() {
            if let Op::MoeExperts { ids, .. } = *op {
                bufs.push(ids);
            }
        }
        bufs.sort();
        bufs.dedup();
        let layers: Vec<u32> = step.launches.iter().flat_map(|l| &l.args).filter_map(|a| if let LaunchArg::KvCache { layer } = a { Some(*layer) } else { None }).collect();
        let slots = view.kv_slots();
        let mut recs = sink.lock().unwrap();
        for rank in 0..view.ranks() {
            let values = bufs
                .iter()
                .map(|&b| {
                    let v = if p.buffer(b).dtype == DType::I32 { Values::I32(view.buffer_i32(rank, b).to_vec()) } else { Values::F32(view.buffer_f32(rank, b).to_vec()) };
                    (b, v)
                })
                .collect();
            let kv = layers.iter().map(|&l| (l, view.kv_layer_bytes(rank, l as usize, slots))).collect();
            recs.push(Record { replay, program: view.program, step: view.step, rank, values, kv });
        }
    })));
    drive(session);
    session.cpu_mut().unwrap().set_observer(None);
    let taken = std::mem::take(&mut *records.lock().unwrap());
    taken
}

fn ints(values: &[(BufId, Values)], b: BufId) -> &[i32] {
    match values.iter().find(|(x, _)| *x == b).map(|(_, v)| v) {
        Some(Values::I32(v)) => v,
        _ => panic!("buffer {} was not recorded as I32", b.0),
    }
}

/// The model's load for one recorded step: positions, routing and ids as the state has them.
fn load_of(plan: &Plan, p: &Program, r: &Record) -> Load {
    let i = p.inputs;
    let (pos, seq) = (ints(&r.values, i.positions), ints(&r.values, i.token_seq));
    let tokens = Tokens { positions: pos.iter().zip(seq).map(|(&p, &s)| (s >= 0).then_some(p as u32)).collect(), seqs: seq.iter().map(|&s| s.max(0) as u32).collect() };
    let step = &p.steps[r.step];
    // (of a concurrent step, its MoE's: the load's routing is the one MoE of the step)
    let experts = step.op.leaves().iter().find_map(|op| match *op {
        Op::MoeExperts { ids, experts_local, expert_parallel, .. } => {
            let top_k = p.buffer(ids).shape.last().copied().unwrap_or(1);
            let first = if expert_parallel { r.rank * experts_local } else { 0 };
            Some(Experts::count(ints(&r.values, ids), top_k, seq, first, experts_local))
        }
        _ => None,
    }).unwrap_or_default();
    let embed_rows = match step.op {
        Op::Embed { vocab_rows, .. } => {
            let lo = (r.rank * vocab_rows) as i64;
            ints(&r.values, i.ids).iter().filter(|&&id| (lo..lo + vocab_rows as i64).contains(&(id as i64))).count() as f64
        }
        _ => 0.0,
    };
    let logit_rows = match step.op {
        Op::GatherRows { input, .. } => {
            let in_rows = p.buffer(input).shape.iter().product::<usize>() / p.buffer(input).shape.last().copied().unwrap_or(1).max(1);
            ints(&r.values, i.logit_rows).iter().filter(|&&x| x >= 0 && (x as usize) < in_rows).count() as f64
        }
        _ => 0.0,
    };
    let _ = plan;
    Load { tokens, experts, embed_rows, logit_rows, rank: r.rank }
}

/// Runs the step's launches in order in one emulated memory and returns each launch's bytes by
/// class (from the per-region load counters) with its stores.
fn emulate(plan: &Plan, p: &Program, r: &Record, arena: &[u8], rope: &[u8], modules: &mut HashMap<u32, Module>) -> Vec<Bytes> {
    let step = &p.steps[r.step];
    let mut g = GlobalMemory::new();
    let mut regions = StepRegions::<BufferId>::default();
    let value = |b: BufId| r.values.iter().find(|(x, _)| *x == b).map(|(_, v)| v.clone()).expect("recorded buffer");
    let kv_layer = |l: u32| r.kv.iter().find(|(x, _)| *x == l).map(|(_, v)| v.clone()).expect("recorded layer");
    let st = StepInputs { value: &value, arena, rank: r.rank, kv_layer: &kv_layer, rope_table: rope };
    let i = p.inputs;
    let inputs = [i.ids, i.positions, i.token_seq, i.slots, i.page_table, i.logit_rows];
    let mut out = Vec::new();
    for l in &step.launches {
        let kernel = plan.kernel(l.kernel);
        let module = modules.entry(l.kernel.0).or_insert_with(|| Module::parse(&kernel.ptx, &kernel.name).expect("parse"));
        let args = regions
            .args(plan, p, l, &step.op.reads(), &st, &mut |name, bytes| {
                let id = g.alloc_bytes(name, bytes);
                Ok((id, g.addr(id)))
            })
            .expect("launch arguments");
        let args: Vec<KernelArg> = args.into_iter().map(KernelArg::from).collect();
        let before = counters(&g, &regions, &inputs);
        let stats = emu::launch(module, &kernel.entry, l.grid, l.block, l.smem_dynamic, &args, &g).unwrap_or_else(|e| panic!("{}: {e}", kernel.name));
        let after = counters(&g, &regions, &inputs);
        let mut b = Bytes { written: stats.global_bytes_written() as f64, ..Default::default() };
        b.weights = after.weights - before.weights;
        b.activations = after.activations - before.activations;
        b.kv = after.kv - before.kv;
        b.aux = after.aux - before.aux;
        assert_eq!(b.read(), stats.global_bytes_read() as f64, "{}: every load falls in a region", kernel.name);
        out.push(b);
    }
    out
}

/// Bytes loaded so far from each class of region.
fn counters(g: &GlobalMemory, r: &StepRegions<BufferId>, inputs: &[BufId]) -> Bytes {
    let mut b = Bytes::default();
    for (buf, id, _) in &r.bufs {
        let n = g.bytes_loaded(*id) as f64;
        if inputs.contains(buf) {
            b.aux += n;
        } else {
            b.activations += n;
        }
    }
    b.weights = r.weights.iter().map(|(_, id, _)| g.bytes_loaded(*id) as f64).sum();
    b.kv = r.layers.iter().map(|(_, id, _)| g.bytes_loaded(*id) as f64).sum();
    b.aux += r.rope.as_ref().map_or(0.0, |(id, _)| g.bytes_loaded(*id) as f64);
    // the split-K GEMM's partial sums and tile counters: activations
    b.activations += r.split_k.as_ref().map_or(0.0, |(id, _)| g.bytes_loaded(*id) as f64);
    b
}

fn micro_plan(dir: &Path, index_keys: &str) -> (PathBuf, PathBuf) {
    let ckpt = dir.join("ckpt");
    let art = dir.join("art");
    kiln(&["synth", "micro", "-o", s(&ckpt)]);
    kiln(&[
        "compile", s(&ckpt), "--target", "sm_120a", "--tp", "2", "--no-ptxas", "--prefill-chunk", "128", "--decode-batches", "1,4", "--max-context", "512",
        "--sequence-parallel-indexer", "always", "--indexer-keys", index_keys, "-o", s(&art),
    ]);
    (ckpt, art)
}

#[test]
fn the_model_counts_every_launchs_bytes_as_the_emulator_does() {
    model_counts_as_the_emulator("bytes", "bf16");
}

/// The same with the indexer keys cached as FP8 codes and scales (the cache writes' and the
/// indexer's key bytes).
#[test]
fn the_model_counts_fp8_indexer_keys_as_the_emulator_does() {
    model_counts_as_the_emulator("bytes-fp8", "fp8");
}

fn model_counts_as_the_emulator(name: &str, index_keys: &str) {
    let dir = scratch(name);
    let (ckpt, art) = micro_plan(&dir, index_keys);
    let mut session = Session::open(&art, Some(&ckpt), SessionOptions::default()).expect("open the micro plan");
    let plan = session.plan().clone();
    let vocab = plan.model.vocab_size as u64;
    let ids = |n: usize, salt: u64| (0..n as u64).map(|i| ((i * 7919 + salt * 104_729 + 13) % vocab) as u32).collect::<Vec<u32>>();
    let records = record(&mut session, |s| {
        // a full prefill chunk from position 0, then one padded chunk after a prefix of 128
        let a = s.new_sequence();
        s.prefill(a, &ids(200, 1), LogitRows::Last).expect("prefill");
        // three short prompts (the 32-token bucket), longer than index_topk
        let others: Vec<_> = (0..3)
            .map(|i| {
                let q = s.new_sequence();
                s.prefill(q, &ids(20 + 3 * i, 2 + i as u64), LogitRows::Last).expect("prefill");
                q
            })
            .collect();
        // a full decode bucket, one with a padding row, and a bucket of one
        let all: Vec<_> = std::iter::once(a).chain(others.iter().copied()).collect();
        s.decode(&all.iter().enumerate().map(|(i, &q)| (q, 100 + i as u32)).collect::<Vec<_>>()).expect("decode 4");
        s.decode(&all[..3].iter().enumerate().map(|(i, &q)| (q, 200 + i as u32)).collect::<Vec<_>>()).expect("decode 3");
        s.decode(&[(others[0], 7)]).expect("decode 1");
        // two rows of each of two sequences (a speculative step's layout): the indexer's scoring
        // pairs share their keys
        s.decode(&[(a, 11), (a, 12), (others[1], 13), (others[1], 14)]).expect("decode 2 x 2");
    });
    let rope = kiln_runtime::cpu::rope::Rope::plan_table_bytes(&plan);
    let mut modules = HashMap::new();
    let mut failures = Vec::new();
    let mut seen: BTreeMap<String, usize> = BTreeMap::new();
    let (mut launches, mut emu_total) = (0usize, 0f64);
    let mut programs_seen = std::collections::BTreeSet::new();
    for r in &records {
        let p = &plan.programs[r.program];
        programs_seen.insert(p.name.clone());
        let arena = session.cpu().and_then(|c| c.arena(r.rank)).expect("arena");
        let emulated = emulate(&plan, p, r, arena, &rope, &mut modules);
        let load = load_of(&plan, p, r);
        let step = &p.steps[r.step];
        for (li, emu) in emulated.iter().enumerate() {
            let kernel = plan.kernel(step.launches[li].kernel);
            *seen.entry(kernel.template.clone()).or_default() += 1;
            launches += 1;
            emu_total += emu.read() + emu.written;
            let model = launch_cost(&plan, step, li, &load).unwrap_or_else(|e| panic!("{}: {e}", kernel.name)).bytes;
            let classes = [
                ("weights", model.weights, emu.weights),
                ("activations", model.activations, emu.activations),
                ("kv", model.kv, emu.kv),
                ("inputs", model.aux, emu.aux),
                ("written", model.written, emu.written),
            ];
            for (class, m, e) in classes {
                if (m - e).abs() > 1e-6 * e.max(1.0) {
                    failures.push(format!("replay {} {} step {} ({}) launch {li} rank {} {}: {class} model {m} B, emulator {e} B", r.replay, p.name, r.step, step.op.name(), r.rank, kernel.name));
                }
            }
        }
    }
    eprintln!("{launches} launches of {programs_seen:?}, {emu_total:.0} B in all; by template: {seen:?}");
    for f in failures.iter().take(40) {
        eprintln!("{f}");
    }
    assert!(failures.is_empty(), "{} of the model's byte counts differ from the emulator's", failures.len());
    // every template kiln has, in both decode and prefill forms (but `add`: the micro model's
    // norms take one block per row and its MoE adds the shared experts in MoE down's store, so
    // the residual add, which an all-reduce launches after NCCL, is checked at GLM-5's shapes below)
    for t in ["embed", "rmsnorm", "linear_bf16_gemv", "linear_nvfp4_gemv", "linear_bf16_gemm", "linear_nvfp4_gemm", "kv_cache_write", "indexer_topk", "mla_attention", "router", "moe_gate_up", "moe_down", "gather_rows"] {
        assert!(seen.contains_key(t), "no launch of {t} was checked: {seen:?}");
    }
    for p in ["prefill_128", "prefill_32", "decode_4", "decode_1"] {
        assert!(programs_seen.contains(p), "{p} did not replay: {programs_seen:?}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// A launch of the GLM-5 skeleton's plan run alone on rank 0 in the emulator, on crafted state:
/// zero weights (F32 scales 1), zero activations, `active` real tokens at positions `first ..`
/// (prefill: one sequence; decode: one each, all at `first`), 64 pages per sequence, top-k lists
/// of every cached position, routing of 8 distinct experts per token. Returns the emulator's
/// bytes and the model's load. With `only`, the step's other launches are not run (None).
fn emulate_crafted(plan: &Plan, p: &Program, s: usize, active: usize, first: u32, only: Option<LaunchPick>) -> (Vec<Option<Bytes>>, Load) {
    let step = &p.steps[s];
    let t = p.tokens;
    let i = p.inputs;
    let decode = matches!(p.kind, kiln_runtime::plan::ProgramKind::Decode { .. });
    let pos: Vec<i32> = (0..t).map(|r| if decode { first as i32 } else { first as i32 + r as i32 }).collect();
    let seq: Vec<i32> = (0..t).map(|r| if r < active { if decode { r as i32 } else { 0 } } else { -1 }).collect();
    let pps = p.buffer(i.page_table).shape.last().copied().unwrap_or(1);
    let seqs = p.buffer(i.page_table).shape.iter().product::<usize>() / pps;
    // 64 pages per sequence (4096 positions at GLM-5's page size), the rest unassigned
    let pages: Vec<i32> = (0..seqs * pps).map(|x| if x % pps < 64 { ((x / pps) * 64 + x % pps) as i32 } else { -1 }).collect();
    let mut ints: HashMap<BufId, Vec<i32>> = HashMap::from([(i.positions, pos.clone()), (i.token_seq, seq.clone()), (i.page_table, pages)]);
    let mut experts = Experts::default();
    for op in step.op.leaves() {
        match *op {
            Op::MlaAttention { topk: Some(b), .. } => {
                let w = p.buffer(b).shape.last().copied().unwrap_or(1);
                ints.insert(b, (0..t * w).map(|x| if (x % w) as i32 <= pos[x / w] { (x % w) as i32 } else { -1 }).collect());
            }
            Op::MoeExperts { ids, experts_local, .. } => {
                let k = p.buffer(ids).shape.last().copied().unwrap_or(1);
                let v: Vec<i32> = (0..t * k).map(|x| (((x / k) * 8 + (x % k) * 29) % plan.model.n_routed_experts) as i32).collect();
                experts = Experts::count(&v, k, &seq, 0, experts_local);
                ints.insert(ids, v);
            }
            _ => {}
        }
    }
    let kv = &plan.memory.kv;
    let mut g = GlobalMemory::new();
    let mut regions: HashMap<String, BufferId> = HashMap::new();
    let inputs = [i.ids, i.positions, i.token_seq, i.slots, i.page_table, i.logit_rows];
    let mut out = Vec::new();
    for l in &step.launches {
        if only.is_some_and(|pick| !with_parts(plan, l).iter().any(|x| pick(plan, x))) {
            out.push(None);
            continue;
        }
        let kernel = plan.kernel(l.kernel);
        let module = Module::parse(&kernel.ptx, &kernel.name).expect("parse");
        let mut args = Vec::new();
        let mut class_of: Vec<(BufferId, &'static str)> = Vec::new();
        for a in &l.args {
            let (key, len, class) = match *a {
                LaunchArg::Buffer(b) => (format!("b{}", b.0), p.buffer(b).bytes as usize, if inputs.contains(&b) { "aux" } else { "act" }),
                LaunchArg::Weight(w) => (format!("w{}", w.0), plan.weight(w).bytes as usize, "weights"),
                LaunchArg::KvCache { layer } => (format!("kv{layer}"), kv.layer_bytes() as usize, "kv"),
                LaunchArg::RopeTable => ("rope".into(), kv.rope_table_bytes() as usize, "aux"),
                LaunchArg::P2pRegion => panic!("the P2P all-reduce is a collective: not a crafted step"),
                LaunchArg::SplitKRegion => ("split_k".into(), SplitKLayout::BYTES as usize, "act"),
                LaunchArg::SplitKRegionUpper => ("split_k_upper".into(), SplitKLayout::SLOT_BYTES as usize, "act"),
                LaunchArg::U32(v) => {
                    args.push(KernelArg::U32(v));
                    continue;
                }
                LaunchArg::F32(v) => {
                    args.push(KernelArg::F32(v));
                    continue;
                }
                LaunchArg::PerRank(_) => {
                    args.push(KernelArg::U32(0));
                    continue;
                }
            };
            let id = *regions.entry(key).or_insert_with(|| {
                let id = g.alloc("region", len);
                match *a {
                    LaunchArg::Buffer(b) => {
                        if let Some(v) = ints.get(&b) {
                            g.write(id, 0, &v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>());
                        }
                    }
                    LaunchArg::Weight(w) if plan.weight(w).dtype == DType::F32 && len <= 1 << 20 => {
                        g.write(id, 0, &vec![1f32; len / 4].iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>());
                    }
                    _ => {}
                }
                id
            });
            class_of.push((id, class));
            args.push(KernelArg::U64(g.addr(id)));
        }
        class_of.sort_by_key(|c| c.0 .0);
        class_of.dedup();
        let count = |g: &GlobalMemory| {
            let mut b = Bytes::default();
            for &(id, c) in &class_of {
                let n = g.bytes_loaded(id) as f64;
                match c {
                    "weights" => b.weights += n,
                    "kv" => b.kv += n,
                    "aux" => b.aux += n,
                    _ => b.activations += n,
                }
            }
            b
        };
        let before = count(&g);
        let stats = emu::launch(&module, &kernel.entry, l.grid, l.block, l.smem_dynamic, &args, &g).unwrap_or_else(|e| panic!("{}: {e}", kernel.name));
        let after = count(&g);
        out.push(Some(Bytes {
            weights: after.weights - before.weights,
            activations: after.activations - before.activations,
            kv: after.kv - before.kv,
            aux: after.aux - before.aux,
            written: stats.global_bytes_written() as f64,
        }));
    }
    let tokens = Tokens { positions: pos.iter().zip(&seq).map(|(&p, &s)| (s >= 0).then_some(p as u32)).collect(), seqs: seq.iter().map(|&s| s.max(0) as u32).collect() };
    // (rank 0: every per-rank argument is passed as 0)
    (out, Load { tokens, experts, embed_rows: 0.0, logit_rows: 0.0, rank: 0 })
}

/// Picks a launch (or a merged launch's part) of a plan.
type LaunchPick = fn(&Plan, &kiln_runtime::plan::Launch) -> bool;

/// The value of a kernel's template parameter.
fn param(plan: &Plan, l: &kiln_runtime::plan::Launch, name: &str) -> u64 {
    plan.kernel(l.kernel).params.iter().find(|(n, _)| n == name).map(|(_, v)| *v).unwrap_or(u64::MAX)
}

#[test]
fn glm5_forms_the_micro_model_lacks_count_as_the_emulator_does() {
    let dir = scratch("glm5");
    kiln(&["synth", "glm5", "-o", s(&dir.join("ckpt"))]);
    kiln(&["compile", s(&dir.join("ckpt")), "--target", "sm_120a", "--tp", "8", "--no-ptxas", "-o", s(&dir.join("plan"))]);
    let plan = kiln_runtime::plan::read_plan(&dir.join("plan")).expect("plan");
    // (what, program, predicate on one of the step's launches, real tokens, first position)
    type Pick = (&'static str, &'static str, LaunchPick, usize, u32);
    let picks: [Pick; 24] = [
        ("a merged launch: the router's gate product with its selection as the tail, beside the shared expert's gate/up", "decode_1", |pl, l| plan_template(pl, l) == "merged" && pl.kernel(l.kernel).parts.iter().any(|q| pl.kernel(q.kernel).template == "router"), 1, 300),
        ("rmsnorm over column blocks (a group's input norm)", "decode_4", |pl, l| plan_template(pl, l) == "rmsnorm" && param(pl, l, "CB") > 1, 4, 300),
        ("the residual add and the norm an all-reduce launches after NCCL", "decode_64", |pl, l| plan_template(pl, l) == "add", 64, 300),
        ("split-K BF16 GEMM", "decode_32", |pl, l| plan_template(pl, l) == "linear_bf16_gemm" && param(pl, l, "SPLIT") == 1 && param(pl, l, "SEGS") == 1, 32, 300),
        ("tiled BF16 GEMM with K over blocks at batch 64", "decode_64", |pl, l| plan_template(pl, l) == "linear_bf16_gemm" && param(pl, l, "SPLIT") == 0 && param(pl, l, "KS") > 1 && param(pl, l, "SEGS") == 1, 64, 300),
        ("2 BF16 linears in one tiled launch, K over blocks at batch 64", "decode_64", |pl, l| plan_template(pl, l) == "linear_bf16_gemm" && param(pl, l, "SPLIT") == 0 && param(pl, l, "SEGS") == 2, 64, 300),
        ("BF16 GEMM with K over blocks at batch 1", "decode_1", |pl, l| plan_template(pl, l) == "linear_bf16_gemm" && param(pl, l, "KS") > 1 && param(pl, l, "SEGS") == 1, 1, 300),
        ("4 BF16 linears in one launch, one output F32", "decode_32", |pl, l| plan_template(pl, l) == "linear_bf16_gemm" && param(pl, l, "SEGS") == 4, 32, 300),
        ("4 BF16 linears normalising their input in the launch, K over blocks at batch 1", "decode_1", |pl, l| plan_template(pl, l) == "linear_bf16_gemm" && param(pl, l, "SEGS") == 4 && param(pl, l, "NORM") == 1 && param(pl, l, "KS") > 1, 1, 300),
        ("2 BF16 linears in one launch, K over blocks at batch 1", "decode_1", |pl, l| plan_template(pl, l) == "linear_bf16_gemm" && param(pl, l, "SEGS") == 2 && param(pl, l, "KS") > 1, 1, 300),
        ("NVFP4 SiLU GEMM with K over blocks at batch 1", "decode_1", |pl, l| plan_template(pl, l) == "linear_nvfp4_gemm" && param(pl, l, "SLICES") > 1 && param(pl, l, "SILU") == 1, 1, 300),
        ("split-K NVFP4 SiLU GEMM", "decode_32", |pl, l| plan_template(pl, l) == "linear_nvfp4_gemm" && param(pl, l, "SPLIT") == 1 && param(pl, l, "SILU") == 1, 32, 300),
        ("split-KV attention over 2048 selected of 3000", "decode_1", |pl, l| plan_template(pl, l) == "mla_split", 1, 2999),
        ("split-KV attention, 3 of 64 tokens", "decode_64", |pl, l| plan_template(pl, l) == "mla_split", 3, 150),
        ("split-KV attention with every tile taken by all 8 warps, 3 of 64 tokens", "decode_64", |pl, l| plan_template(pl, l) == "mla_attention" && param(pl, l, "COOP") == 1, 3, 150),
        ("prefill attention in the split form, up to 4 splits a token, 3 of 128 tokens", "prefill_128", |pl, l| plan_template(pl, l) == "mla_attention" && param(pl, l, "MODE") == 1, 3, 150),
        ("prefill attention on the tensor cores, one split a token, a block per two tokens: a pair below index_topk sharing its rows (and the output projection's batched GEMM)", "prefill_512", |pl, l| plan_template(pl, l) == "mla_attention" && param(pl, l, "MMA") == 1 && param(pl, l, "SPLITS") == 1 && param(pl, l, "TT") == 2, 2, 150),
        ("prefill attention a block per two tokens: a pair across index_topk, one token after the other", "prefill_512", |pl, l| plan_template(pl, l) == "mla_attention" && param(pl, l, "TT") == 2, 2, 2047),
        ("MoE on the tensor cores, down in 4-warp blocks of 32 columns", "prefill_128", |pl, l| plan_template(pl, l) == "moe_gate_up" && param(pl, l, "MMA") == 1, 2, 10),
        ("MoE on the CUDA cores at GLM-5 shapes", "decode_8", |pl, l| plan_template(pl, l) == "moe_gate_up" && param(pl, l, "MMA") == 0, 1, 10),
        ("indexer top-k scoring 3000 positions", "decode_1", |pl, l| plan_template(pl, l) == "indexer_topk", 1, 2999),
        ("prefill indexer a block per two tokens: a pair scoring 3,000 and 3,001 positions together, a token beside padding alone", "prefill_512", |pl, l| plan_template(pl, l) == "indexer_topk" && param(pl, l, "TT") == 2, 3, 2999),
        ("prefill indexer a block per token, 3 of 128 tokens scoring", "prefill_128", |pl, l| plan_template(pl, l) == "indexer_topk" && param(pl, l, "TT") == 1, 3, 2999),
        ("the sequence-parallel prefill indexer: rank 0's rows of 8,192 tokens, a pair of tokens 8 apart scoring together, a token beside padding alone", "prefill_8192", |pl, l| plan_template(pl, l) == "indexer_topk" && param(pl, l, "STRIDE") == 8 && param(pl, l, "TT") == 2, 17, 2999),
    ];
    // The indexer's selection in chunks (contexts past what one block selects), run alone on
    // scores of zero (all tied: the first 2,048 positions win), without the scoring launch
    // before it: 2 chunks of 1 token, 3 chunks of each of 3 tokens.
    let chunked: LaunchPick = |pl, l| plan_template(pl, l) == "indexer_topk" && param(pl, l, "MODE") == 2 && param(pl, l, "CHUNK") > 0;
    let chunk_picks: [Pick; 2] = [("the indexer's selection in 2 chunks", "decode_1", chunked, 1, 30000), ("the indexer's selection in 3 chunks, 3 of 4 tokens", "decode_4", chunked, 3, 45000)];
    let plain = picks.len();
    let mut failures = Vec::new();
    for (i, (what, program, pred, active, first)) in picks.into_iter().chain(chunk_picks).enumerate() {
        let p = plan.programs.iter().find(|p| p.name == program).unwrap_or_else(|| panic!("no {program}"));
        // (a step with the P2P collective kernel needs every rank at once: not a crafted step)
        let s = p.steps.iter().position(|st| !st.p2p_collective(&plan) && st.launches.iter().flat_map(|l| with_parts(&plan, l)).any(|l| pred(&plan, &l))).unwrap_or_else(|| panic!("{program} has no launch of the {what}"));
        let t0 = std::time::Instant::now();
        let (emulated, load) = emulate_crafted(&plan, p, s, active, first, (i >= plain).then_some(pred));
        for (li, emu) in emulated.iter().enumerate().filter_map(|(li, e)| Some((li, e.as_ref()?))) {
            let name = &plan.kernel(p.steps[s].launches[li].kernel).name;
            let model = launch_cost(&plan, &p.steps[s], li, &load).unwrap_or_else(|e| panic!("{name}: {e}")).bytes;
            for (class, m, e) in [("weights", model.weights, emu.weights), ("activations", model.activations, emu.activations), ("kv", model.kv, emu.kv), ("inputs", model.aux, emu.aux), ("written", model.written, emu.written)] {
                if (m - e).abs() > 1e-6 * e.max(1.0) {
                    failures.push(format!("{what}: {program} step {s} launch {li} {name}: {class} model {m} B, emulator {e} B"));
                }
            }
        }
        eprintln!("{what}: {program} step {s} ({} launches) emulated in {:.1?}", emulated.len(), t0.elapsed());
    }
    for f in &failures {
        eprintln!("{f}");
    }
    assert!(failures.is_empty(), "{} of the model's byte counts differ from the emulator's", failures.len());
    let _ = std::fs::remove_dir_all(&dir);
}

/// A launch and, if it is merged, each of its parts as a launch of its own.
fn with_parts(plan: &Plan, l: &kiln_runtime::plan::Launch) -> Vec<kiln_runtime::plan::Launch> {
    let parts = if plan.kernel(l.kernel).parts.is_empty() { Vec::new() } else { plan.part_launches(l) };
    std::iter::once(l.clone()).chain(parts).collect()
}

fn plan_template<'a>(plan: &'a Plan, l: &kiln_runtime::plan::Launch) -> &'a str {
    &plan.kernel(l.kernel).template
}

const SHIPPED: &str = "artifacts/GLM-5-NVFP4-sm120a-tp8";

fn inspect(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_kiln")).arg("inspect").args(args).output().expect("run kiln inspect")
}

fn json(o: &Output) -> serde_json::Value {
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    serde_json::from_slice(&o.stdout).expect("JSON")
}

#[test]
fn inspect_perf_on_the_glm5_plan_is_instant_and_states_its_assumptions() {
    // the text: assumptions first, then decode, prefill and the longest launches
    let t0 = std::time::Instant::now();
    let o = inspect(&[SHIPPED, "--perf"]);
    let secs = t0.elapsed().as_secs_f64();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let text = String::from_utf8(o.stdout).unwrap();
    let at = |needle: &str| text.find(needle).unwrap_or_else(|| panic!("no {needle:?} in:\n{text}"));
    assert!(at("predicted performance") < at("assumptions"));
    for c in ["1.792 TB/s x 0.85", "NVFP4 mma 1.6 PFLOP/s", "BF16 mma 0.4 PFLOP/s", "FP32 FMA 60 TFLOP/s", "188 SMs", "1.5 µs per kernel node", "25 µs + bytes / 40 GB/s", "8 µs + (ranks - 1) x part / 50 GB/s, part = an all-reduce's bytes or an all-gather's share per rank, up to 64 KiB", "not a cache for weights"] {
        assert!(at(c) < at("  decode ("), "{c}");
    }
    assert!(at("  decode (") < at("  prefill (") && at("  prefill (") < at("speculative decoding at context 8k") && at("speculative decoding at context 8k") < at("top 10 launches of decode_1"));
    assert!(secs < 10.0, "inspect --perf of the GLM-5 plan took {secs:.1} s");

    // --json: the summary as without --perf, plus `perf`
    let plain = json(&inspect(&[SHIPPED, "--json"]));
    let j = json(&inspect(&[SHIPPED, "--json", "--perf"]));
    assert!(plain.get("perf").is_none());
    for (key, value) in plain.as_object().unwrap() {
        assert_eq!(&j[key], value, "{key} changed with --perf");
    }
    let perf = &j["perf"];
    let a = &perf["assumptions"];
    for (key, want) in [("dram_tbps", 1.792), ("dram_efficiency", 0.85), ("fp4_pflops", 1.6), ("bf16_pflops", 0.4), ("fp32_tflops", 60.0), ("launch_us", 1.5), ("nccl_base_us", 25.0), ("nccl_gbps", 40.0), ("p2p_base_us", 8.0), ("p2p_gbps", 50.0), ("sms", 188.0), ("p2p_max_bytes", 65536.0)] {
        assert_eq!(a[key].as_f64(), Some(want), "assumption {key}");
    }
    let plan = kiln_runtime::plan::read_plan(Path::new(env!("CARGO_MANIFEST_DIR")).join(SHIPPED).as_path()).expect("the shipped plan");
    let decode = perf["decode"].as_array().unwrap();
    assert_eq!(decode.len(), 7 * 4, "batches 1 .. 64 x contexts 2k, 8k, 32k, 128k");
    for d in decode {
        let (batch, step_ms, tps) = (d["batch"].as_f64().unwrap(), d["step_ms"].as_f64().unwrap(), d["tokens_per_s"].as_f64().unwrap());
        assert!(step_ms > 0.0 && (tps - batch / step_ms * 1e3).abs() < 1e-6 * tps, "{d}");
        assert!(d["step_ms_p2p"].as_f64().unwrap() <= step_ms + 1e-9, "{d}");
        // 78 layers' launches and the head: 1,552 until the router's gate product became its
        // own launch in each of the 75 MoE layers, decode's indexer scores got theirs in each of
        // the 78 layers, decode attention became four (absorb, splits, combine, output), and
        // the 156 residual rmsnorms add the residual in a launch of its own before the norm
        // spreads over column blocks; and 75 fewer since MoE down's final store adds the shared
        // experts' output; and the 156 adds moved into the all-reduces before the norms (the
        // P2P kernel adds; after NCCL the add is a launch of the collective step, costed with it);
        // and 4 fewer per layer since decode's projections of the same activations share one
        // (q_a, kv_a, wk and the head weights; q_b and wq_b), 1 fewer since both cache writes
        // are one; and one fewer for each group that normalises its input in its launch (the
        // plan's choice, counted from its steps: q_a's and the first layer's input norm at batch
        // 1, none from batch 4); and the norm each all-reduce before one took over, every layer's
        // input norm but the first, the norm before each MoE and the final norm (the P2P kernel
        // normalises; after NCCL the norm is a launch of the collective step, costed with it)
        let program = plan.programs.iter().find(|p| p.name == format!("decode_{batch}")).expect("decode program");
        let kernels: Vec<kiln_runtime::plan::Launch> = program.steps.iter().flat_map(|s| &s.launches).flat_map(|l| with_parts(&plan, l)).collect();
        let normed_in_groups = kernels.iter().filter(|l| plan_template(&plan, l) == "linear_bf16_gemm" && param(&plan, l, "NORM") == 1).count();
        match batch as u32 {
            1 => assert_eq!(normed_in_groups, 78 + 1),
            2 => {}
            _ => assert_eq!(normed_in_groups, 0, "{d}"),
        }
        let normed_in_all_reduces = program.steps.iter().filter(|s| matches!(s.op, kiln_runtime::plan::Op::AllReduce { norm: Some(_), .. })).count();
        assert_eq!(normed_in_all_reduces, 2 * 78, "{d}");
        // and one fewer for each launch that runs two steps' kernels side by side: at batch 1
        // the router's selection beside the shared expert's gate/up and the shared expert's down
        // beside the MoE gate/up in each of the 75 MoE layers, the cache write beside q_b's
        // group and the indexer's 1,024-thread selection beside attention's absorb in each of
        // the 78 (counted from the plan: which pairs merge is its choice)
        let merged = program.steps.iter().flat_map(|s| &s.launches).filter(|l| plan_template(&plan, l) == "merged").count();
        if batch == 1.0 {
            assert_eq!(merged, 2 * 75 + 2 * 78, "{d}");
        }
        // and one fewer for each layer whose attention combines the splits and projects the
        // context in one launch (mla_split MODE 3: the plan's choice at small batches, 78 at
        // batch 1)
        let combined = kernels.iter().filter(|l| plan_template(&plan, l) == "mla_split" && param(&plan, l, "MODE") == 3).count();
        if batch == 1.0 {
            assert_eq!(combined, 78, "{d}");
        }
        // and one fewer for each launch whose last block runs a dependent one-block kernel after
        // it (a chain: the router's selection after its gate product in the 75 MoE layers, where
        // one block selects for the whole batch: at batch 1, and a warp per token where the
        // model prices that block below a launch of a block per token, batches 2 and 4)
        let chained = program.steps.iter().flat_map(|s| &s.launches).filter(|l| plan.kernel(l.kernel).parts.iter().any(|q| q.tail)).count();
        if batch == 1.0 {
            assert_eq!(chained, 75, "{d}");
        }
        assert_eq!(d["launches"], 1552 + 75 + 78 + 3 * 78 + 156 - 75 - 156 - 4 * 78 - 78 - normed_in_groups - normed_in_all_reduces - merged - combined - chained, "{d}");
        // two all-reduces per layer, the embedding's and the logits' gather, and since the model
        // chose to split q_a with kv_a and the indexer's wq_b behind all-gathers, two gathers per
        // layer; one where the batch computes wq_b whole from its prefill copy: where the P2P
        // gather of its 1 KiB a row and rank (8 µs + 7 x batch KiB / 50 GB/s) takes longer than
        // the 7/8 of the 4,096 x 2,048 BF16 weight a rank lacks adds (its bytes at 1.792 TB/s x
        // 0.85, its FLOPs at 0.4 PFLOP/s), by hand
        let gather_us = 8.0 + 7.0 * batch * 1024.0 / 50e3;
        let lacking_us = 7.0 / 8.0 * (4096.0 * 2048.0 * 2.0 / (1.792e6 * 0.85) + 2.0 * batch * 4096.0 * 2048.0 / 0.4e9);
        let gathers = if gather_us > lacking_us { 78 } else { 2 * 78 };
        assert_eq!(d["collectives"], 158 + gathers, "{d}");
        assert!(d["bytes_per_gpu"].as_f64().unwrap() >= d["compulsory_bytes_per_gpu"].as_f64().unwrap());
        // the floor: below the step (no launch cost, no re-reads, every SM), at least the
        // compulsory bytes at full bandwidth plus each collective's latency (8 µs with the P2P
        // kernel, 25 with NCCL)
        let f = |k: &str| d[k].as_f64().unwrap();
        let bytes_ms = f("compulsory_bytes_per_gpu") / (1.792e12 * 0.85) * 1e3;
        let collectives = f("collectives");
        assert!(f("floor_ms_p2p") < f("step_ms_p2p") && f("floor_ms") < step_ms, "{d}");
        assert!(f("floor_ms_p2p") >= bytes_ms + collectives * 0.008 && f("floor_ms") >= bytes_ms + collectives * 0.025, "{d}");
        assert!(f("floor_ms_p2p") <= f("floor_ms"), "{d}");
    }
    let row = |b: u64, c: u64| decode.iter().find(|d| d["batch"] == b && d["context"] == c).unwrap_or_else(|| panic!("no decode row {b} @ {c}"));
    // a longer context reads more KV and takes longer; a larger batch more tokens per second
    assert!(row(1, 131072)["step_ms"].as_f64() > row(1, 8192)["step_ms"].as_f64());
    assert!(row(64, 2048)["tokens_per_s"].as_f64() > row(1, 2048)["tokens_per_s"].as_f64());
    // batch 1 reads at least this GPU's share of the attention weights and its KV rows
    assert!(row(1, 8192)["bytes_per_gpu"].as_f64().unwrap() > 5e9);
    // speculative decoding: a step checking k drafts for each of b sequences is the decode step
    // of b (1 + k) rows (the table's where that is a bucket), and a sequence gains
    // 1 + a + ... + a^k tokens from it at per-draft acceptance a
    let speculative = perf["speculative"].as_array().unwrap();
    let f = |v: &serde_json::Value, k: &str| v[k].as_f64().unwrap_or_else(|| panic!("{k} in {v}"));
    let mut at_buckets = 0;
    for s in speculative {
        let (batch, k, rows, c) = (s["batch"].as_u64().unwrap(), s["drafts"].as_u64().unwrap(), s["rows"].as_u64().unwrap(), s["context"].as_u64().unwrap());
        assert_eq!(rows, batch * (1 + k), "{s}");
        assert!(rows <= 64 && (1..=3).contains(&k), "{s}");
        assert_eq!(f(s, "plain_step_ms_p2p"), f(row(batch, c), "step_ms_p2p"), "{s}");
        if decode.iter().any(|d| d["batch"] == rows) {
            // the decode step of that many rows, each sequence's at its next positions: with an
            // even number of rows a sequence, past 2k (where the table's rows score nothing)
            // the indexer's scoring pairs load each key once for two rows, so the step takes
            // no longer than the table's of as many rows of distinct sequences, and at 128k less
            let (spec, plain) = (f(s, "step_ms_p2p"), f(row(rows, c), "step_ms_p2p"));
            if k % 2 == 1 && c >= 8192 {
                assert!(spec <= plain, "{s}: {spec} ms against {plain} for rows of distinct sequences");
            }
            if k % 2 == 1 && c == 131072 {
                assert!(spec < plain, "{s}: {spec} ms against {plain} for rows of distinct sequences");
            }
            at_buckets += 1;
        }
        let gain = |a: f64| (0..=k).map(|i| a.powi(i as i32)).sum::<f64>();
        for (a, tps) in [0.5, 0.7, 0.9].iter().zip(s["tokens_per_s_p2p"].as_array().unwrap()) {
            let want = batch as f64 * gain(*a) / f(s, "step_ms_p2p") * 1e3;
            assert!((tps.as_f64().unwrap() - want).abs() < 1e-9 * want, "{s}");
        }
        let ratio = f(s, "step_ms_p2p") / f(s, "plain_step_ms_p2p");
        match s["break_even_acceptance"].as_f64() {
            Some(a) => assert!((gain(a) - ratio).abs() < 1e-9 && (0.0..=1.0).contains(&a), "{s}"),
            None => assert!(ratio > (k + 1) as f64, "{s}"),
        }
    }
    // what the engine weighs drafts against (Runner::predicted_decode_us): the P2P step of the
    // decode program holding the rows, every row of it at 8k (3 rows: the batch-4 program's)
    for (rows, bucket) in [(1u64, 1u64), (2, 2), (3, 4), (4, 4), (33, 64), (64, 64)] {
        let program = plan.decode_program(rows as usize).unwrap();
        let us = kiln_runtime::perf::program_step_us(&plan, program, kiln_runtime::perf::COST_CONTEXT).unwrap();
        assert_eq!(us / 1e3, f(row(bucket, 8192), "step_ms_p2p"), "{rows} rows");
    }
    assert_eq!(plan.decode_program(65), None);
    // short prefills run as decode steps where those cost less per token (Runner::prefill): the
    // one token a cached prompt recomputes, a short turn deep in a context, the first 64 of a
    // 100-token turn at 120k (decode_64 against prefill_128, per token); never a long chunk
    let step = |i: usize, c: usize| kiln_runtime::perf::program_step_us(&plan, i, c);
    for (tokens, from, want) in [(1, 8000, Some(1)), (16, 30000, Some(16)), (100, 120000, Some(64)), (2, 2048 + 6, Some(2)), (512, 0, None), (2048, 8192, None), (8192, 0, None)] {
        assert_eq!(plan.prefill_piece_by_decode(tokens, from, step), want, "{tokens} tokens from {from}");
    }
    assert_eq!(plan.prefill_piece_by_decode(1, 8000, |_, _| None), None, "without predicted steps (a CPU plan), the prefill program");
    // batches 1 .. 32 with the drafts whose rows a decode program holds, at four contexts
    assert_eq!(speculative.len(), 4 * (3 + 3 + 3 + 3 + 3 + 1), "{speculative:?}");
    assert!(at_buckets >= 4 * 8);
    let prefill = perf["prefill"].as_array().unwrap();
    assert!(prefill.iter().any(|p| p["chunk"] == 8192 && p["prefix"] == 0));
    assert!(prefill.iter().all(|p| p["step_ms"].as_f64().unwrap() > 0.0 && p["tokens_per_s"].as_f64().unwrap() > 0.0));
    // time to first token: a prompt's pieces cover it from position 0 in order, their steps sum
    // to the prompt's time; an 8k prompt is the table's 8k chunk from position 0, and the last
    // piece of a 32k or 128k prompt is the table's 8k chunk ending there
    let prompts = perf["prompts"].as_array().unwrap();
    assert_eq!(prompts.iter().map(|p| p["tokens"].as_u64().unwrap()).collect::<Vec<_>>(), [8192, 32768, 65536, 131072]);
    let f = |v: &serde_json::Value, k: &str| v[k].as_f64().unwrap();
    for p in prompts {
        let pieces = p["pieces"].as_array().unwrap();
        let mut next = 0;
        for piece in pieces {
            assert_eq!(piece["first_position"].as_u64(), Some(next), "{p}");
            next += piece["tokens"].as_u64().unwrap();
        }
        assert_eq!(Some(next), p["tokens"].as_u64());
        for (total, each) in [("ttft_ms", "step_ms"), ("ttft_ms_p2p", "step_ms_p2p")] {
            let sum: f64 = pieces.iter().map(|q| f(q, each)).sum();
            assert!((f(p, total) - sum).abs() < 1e-9 * sum, "{p}");
        }
        assert!((f(p, "tokens_per_s") - f(p, "tokens") / f(p, "ttft_ms") * 1e3).abs() < 1e-6 * f(p, "tokens_per_s"));
        // every piece a full chunk of the largest program: no shorter program pays for 8k tokens
        assert!(pieces.iter().all(|q| q["program"] == "prefill_8192" && q["tokens"] == 8192), "{p}");
        let table = |prefix: u64| prefill.iter().find(|r| r["chunk"] == 8192 && r["prefix"] == prefix).unwrap_or_else(|| panic!("no prefill row of 8192 from {prefix}"));
        let last = pieces.last().unwrap();
        if [8192, 32768, 131072].contains(&p["tokens"].as_u64().unwrap()) {
            assert!((f(last, "step_ms") - f(table(last["first_position"].as_u64().unwrap()), "step_ms")).abs() < 1e-9, "{p}");
        }
    }
    // deeper chunks take longer (more keys to score, the selection over more positions)
    let p128 = prompts[3]["pieces"].as_array().unwrap();
    assert!(p128.windows(2).all(|w| f(&w[1], "step_ms") > f(&w[0], "step_ms")));
    let top = &perf["top"];
    assert_eq!((top["program"].as_str(), top["batch"].as_u64(), top["context"].as_u64()), (Some("decode_1"), Some(1), Some(8192)));
    let launches = top["launches"].as_array().unwrap();
    assert_eq!(launches.len(), 10);
    assert!(launches.windows(2).all(|w| w[0]["ms_total"].as_f64() >= w[1]["ms_total"].as_f64()));
    assert!((top["step_ms"].as_f64().unwrap() - row(1, 8192)["step_ms"].as_f64().unwrap()).abs() < 1e-9);

    // flags override the constants: twice the bandwidth, every row faster
    let fast = json(&inspect(&[SHIPPED, "--json", "--perf", "--dram-tbps", "3.584", "--top-batch", "64", "--top-context", "2048"]));
    assert_eq!(fast["perf"]["assumptions"]["dram_tbps"].as_f64(), Some(3.584));
    assert_eq!(fast["perf"]["top"]["program"], "decode_64");
    for (d, f) in decode.iter().zip(fast["perf"]["decode"].as_array().unwrap()) {
        assert!(f["step_ms"].as_f64() < d["step_ms"].as_f64(), "{d} / {f}");
    }
    // a prefill chunk's launches: the table's step of that chunk from position 0
    let chunk = json(&inspect(&[SHIPPED, "--json", "--perf", "--top-prefill", "2048", "--top-context", "2048", "--top-count", "0"]));
    let top = &chunk["perf"]["top"];
    assert_eq!((top["program"].as_str(), top["batch"].as_u64(), top["tokens"].as_u64(), top["context"].as_u64()), (Some("prefill_2048"), Some(1), Some(2048), Some(2048)));
    let row = prefill.iter().find(|p| p["chunk"] == 2048 && p["prefix"] == 0).expect("a prefill row of 2048 from 0");
    assert!((top["step_ms"].as_f64().unwrap() - row["step_ms"].as_f64().unwrap()).abs() < 1e-9, "{top} / {row}");
    let sum: f64 = top["launches"].as_array().unwrap().iter().map(|l| l["ms_total"].as_f64().unwrap()).sum();
    assert!((sum - top["step_ms"].as_f64().unwrap()).abs() < 1e-6 * sum, "every launch listed sums to the step: {sum}");
    // the largest chunk as the last of a longer context: the table's row at that prefix
    let last = json(&inspect(&[SHIPPED, "--json", "--perf", "--top-prefill", "8192", "--top-context", "32768"]));
    let row = prefill.iter().find(|p| p["chunk"] == 8192 && p["prefix"] == 32768 - 8192).expect("the 8k chunk ending at 32k");
    assert!((last["perf"]["top"]["step_ms"].as_f64().unwrap() - row["step_ms"].as_f64().unwrap()).abs() < 1e-9);
    let bad = inspect(&[SHIPPED, "--perf", "--top-prefill", "9000"]);
    assert!(!bad.status.success() && String::from_utf8_lossy(&bad.stderr).contains("no prefill program for a chunk of 9000 tokens (its largest chunk: 8192)"), "{}", String::from_utf8_lossy(&bad.stderr));
    let bad = inspect(&[SHIPPED, "--perf", "--top-prefill", "2048", "--top-batch", "4"]);
    assert!(!bad.status.success(), "--top-prefill lists a prefill chunk, --top-batch a decode step: not both");
    let bad = inspect(&[SHIPPED, "--perf", "--dram-efficiency", "1.5"]);
    assert!(!bad.status.success() && String::from_utf8_lossy(&bad.stderr).contains("--dram-efficiency"));
}

/// The time-to-first-token rows price the pieces the runtime runs: a session prefilling a
/// prompt with decode pieces allowed (as on the CUDA backend) replays exactly the programs,
/// first positions and token counts the row lists, here across the micro plan's chunks
/// (including its chunks deep in a context) and a tail the plan may take by decode steps.
#[test]
fn prompt_rows_list_the_pieces_the_runtime_prefills() {
    let dir = scratch("prompt-pieces");
    let (ckpt, art) = micro_plan(&dir, "bf16");
    let opts = SessionOptions { prefill_by_decode: Some(true), ..SessionOptions::default() };
    let mut session = Session::open(&art, Some(&ckpt), opts).expect("open the micro plan");
    let plan = session.plan().clone();
    let k = kiln_runtime::perf::Constants::for_target(&plan.target).expect("constants").0;
    let vocab = plan.model.vocab_size as u32;
    let mut kinds = Vec::new();
    for tokens in [130, 300, 509] {
        // each replay's program, its first real position and its real rows (rank 0's inputs)
        let ran = Arc::new(Mutex::new(Vec::<(String, usize, usize)>::new()));
        let sink = ran.clone();
        let names: Vec<String> = plan.programs.iter().map(|p| p.name.clone()).collect();
        let inputs: Vec<_> = plan.programs.iter().map(|p| p.inputs).collect();
        session.cpu_mut().expect("CPU backend").set_observer(Some(Box::new(move |view: &kiln_runtime::cpu::StepView| {
            if view.phase != kiln_runtime::cpu::StepPhase::Before || view.step != 0 {
                return;
            }
            let i = inputs[view.program];
            let (pos, seq) = (view.buffer_i32(0, i.positions), view.buffer_i32(0, i.token_seq));
            let real: Vec<i32> = pos.iter().zip(seq).filter(|(_, &s)| s >= 0).map(|(&p, _)| p).collect();
            sink.lock().unwrap().push((names[view.program].clone(), real[0] as usize, real.len()));
        })));
        let seq = session.new_sequence();
        let ids: Vec<u32> = (0..tokens as u32).map(|i| (i * 7919 + 13) % vocab).collect();
        session.prefill(seq, &ids, LogitRows::Last).expect("prefill");
        session.release(seq);
        session.cpu_mut().unwrap().set_observer(None);
        let row = kiln_runtime::perf::prompt::rows(&plan, &k, &[tokens]).expect("prompt row").remove(0);
        let priced: Vec<(String, usize, usize)> = row.pieces.iter().map(|p| (p.program.clone(), p.first_position, p.tokens)).collect();
        let ran = ran.lock().unwrap().clone();
        assert_eq!(priced, ran, "{tokens} tokens");
        assert!(ran.len() >= 2, "{tokens} tokens in more than one piece: {ran:?}");
        kinds.extend(ran.iter().map(|(name, _, n)| (name.starts_with("decode"), *n < 128)));
    }
    // (what the cases cover: a tail of 2 tokens the model prices lower as decode rows, partial
    // chunks and full ones)
    assert!(kinds.contains(&(true, true)) && kinds.contains(&(false, true)) && kinds.contains(&(false, false)), "{kinds:?}");
}

#[test]
fn inspect_perf_refuses_cpu_plans() {
    let dir = scratch("cpu");
    kiln(&["synth", "micro", "-o", s(&dir.join("ckpt"))]);
    kiln(&["compile", s(&dir.join("ckpt")), "--target", "cpu", "-o", s(&dir.join("art"))]);
    let o = inspect(&[s(&dir.join("art")), "--perf"]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && err.contains("GPU kernels") && err.contains("compiled for cpu"), "{err}");
    assert!(inspect(&[s(&dir.join("art"))]).status.success(), "plain inspect still works");
    let _ = std::fs::remove_dir_all(&dir);
}
