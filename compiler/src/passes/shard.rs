//! Tensor-parallel sharding: cuts every weight for `--tp` ranks, rewrites the ops to per-rank
//! sizes, and inserts the collectives the cuts require (all-reduce before the first consumer of a
//! partial sum, all-gather of vocab-split logits and of the replicated projections it splits by
//! output rows where the performance model says the bytes saved outweigh the gather). Records
//! each decision and why.

use crate::error::{human_bytes, CompileError};
use crate::graph::{Graph, GraphWeight, ShardRole};
use kiln_runtime::perf::{collective_time, Constants};
use kiln_runtime::plan::{
    BufId, Dim, GatherPair, KernelFamily, LinearWeights, ModelConfig, MoeParallel, Op, Parallelism, Shard, ShardChoice, Step,
    TensorChoice, WeightId, WeightKind, WeightSlot, WeightSource,
};
use super::lower::P2P_GATHER_PAIRS;
use std::collections::BTreeMap;

/// Which projections the graph replicates on every rank (q_a, kv_a, the indexer's) are instead
/// split by output rows, each rank computing its share, and all-gathered right after.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SplitProjections {
    /// Those where the weight bytes a rank no longer streams at batch 1 take longer than the
    /// one-shot P2P all-gather of the output, both by the performance model's constants.
    Auto,
    /// Every one whose rows divide by the rank count.
    All,
    /// None: all stay replicated.
    None,
}

/// Which projections split by output rows also keep a whole copy on every rank that prefill
/// programs compute from instead of gathering the ranks' shares. Decode programs compute them
/// whole too at the batches where the gathers take longer than the rows a rank lacks (the
/// copy is there anyway); at small batches they keep the split, whose gather is cheap for a
/// few rows and whose weights they stream every step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PrefillCopies {
    /// Those whose gather costs the largest prefill chunk at least [`COPY_MARGIN`] times what
    /// computing the projection whole adds there (the rows a rank lacks: their weight bytes and
    /// FLOPs), by the performance model's constants.
    Auto,
    /// Every split projection.
    All,
    /// None: prefill gathers as decode does.
    None,
}

/// How much more a gather must cost than the whole projection's extra work before `Auto` copies
/// it: a copy holds memory the KV cache would otherwise have, so a narrow win does not pay.
pub const COPY_MARGIN: f64 = 4.0;

/// How [`shard`] decides [`SplitProjections`] and [`PrefillCopies`]: the policies, the model
/// constants `Auto` uses, the decode batches (a shared gather must stay within the P2P kernel's
/// limit at the largest; each decides whether it computes the copied projections whole) and
/// the largest prefill chunk (where a copy is priced).
#[derive(Debug, Clone)]
pub struct SplitPolicy {
    pub projections: SplitProjections,
    pub copies: PrefillCopies,
    pub consts: Constants,
    pub decode_batches: Vec<usize>,
    pub prefill_chunk: usize,
}

impl SplitPolicy {
    fn max_batch(&self) -> usize {
        self.decode_batches.iter().copied().max().unwrap_or(1)
    }
}

/// The graph with per-rank ops and values, plus the per-rank weight slots (offsets unassigned).
/// `whole_graph`: where split projections have whole copies, the graph with each computed whole
/// from its copy (its share of the gather gone), which prefill programs run and the decode
/// programs of `whole_decode_batches`; `None` where there are no copies.
pub struct Sharded {
    pub graph: Graph,
    pub whole_graph: Option<Graph>,
    pub whole_decode_batches: Vec<usize>,
    pub slots: Vec<WeightSlot>,
    pub choices: Vec<ShardChoice>,
}

pub fn shard(mut graph: Graph, cfg: &ModelConfig, par: &Parallelism, split: &SplitPolicy) -> Result<Sharded, CompileError> {
    let tp = par.tp;
    // the draft's steps after the model's: one pass decides and rewrites both (they share weights)
    let model_steps = graph.steps.len();
    if let Some(d) = graph.draft.as_mut() {
        let draft = std::mem::take(&mut d.steps);
        graph.steps.extend(draft);
    }
    let Splits { gathered, copies, whole_decode_batches, choices: split_choices } = if tp > 1 { split_projections(&mut graph, tp, split, model_steps) } else { Splits::default() };
    let slots = graph.weights.iter().map(|w| slot_for(w, par)).collect::<Result<Vec<_>, _>>()?;
    let mut choices = choices(cfg, par, &graph, &slots);
    if tp == 1 {
        split_off_draft(&mut graph, model_steps);
        return Ok(Sharded { graph, whole_graph: None, whole_decode_batches: Vec::new(), slots, choices });
    }
    choices.extend(split_choices);
    let weights = graph.weights.clone();
    let role_of = |lw: &LinearWeights| weights[lw.ids()[0].0 as usize].role;
    let mut partial = vec![false; graph.values.len()];
    let mut steps = Vec::with_capacity(graph.steps.len() * 2);
    // the gathered pairs of split projections whose shared all-gather is still to come
    let mut pending = Vec::new();
    // (index in `steps`, the op computing it whole from its copy) per copied projection
    let mut whole_ops = Vec::new();
    let mut draft_start = None;
    for (index, mut step) in std::mem::take(&mut graph.steps).into_iter().enumerate() {
        if index == model_steps {
            let split = graph.logits;
            graph.logits = gather_logits(&mut graph, &mut steps, split, "logits", tp);
            partial.push(false);
            draft_start = Some(steps.len());
        }
        // a copied projection's whole form: the op as the graph has it, on the copy's weights
        let whole = copies.get(&index).map(|map| {
            let mut op = step.op.clone();
            if let Op::Linear { weights, .. } = &mut op {
                *weights = with_ids(weights, map);
            }
            op
        });
        // Complete every partial sum this op needs whole (Add is linear: it keeps partials, and so
        // does the add of the shared experts' output into the routed experts').
        let added = match step.op {
            Op::MoeExperts { shared, .. } => shared,
            _ => None,
        };
        if !matches!(step.op, Op::Add { .. }) {
            for v in step.op.reads().into_iter().filter(|&v| Some(v) != added) {
                if partial[v.0 as usize] {
                    steps.push(Step { op: Op::AllReduce { buf: v, residual: None, norm: None }, kernel: KernelFamily::Collective, launches: Vec::new() });
                    partial[v.0 as usize] = false;
                }
            }
        }
        let mut out_partial = false;
        match &mut step.op {
            Op::Embed { vocab_rows, .. } => {
                *vocab_rows /= tp;
                out_partial = true;
            }
            Op::Linear { weights, parts, k, out, .. } => match role_of(weights) {
                ShardRole::Rows if gathered.contains_key(&index) => {
                    parts.iter_mut().for_each(|p| p.rows /= tp);
                    let mut local = graph.values[out.0 as usize].clone();
                    local.name.push_str("_local");
                    divide_last(&mut local.dims, tp);
                    graph.values.push(local);
                    partial.push(false);
                    let local = BufId(graph.values.len() as u32 - 1);
                    pending.push(GatherPair { input: local, out: *out });
                    *out = local;
                }
                ShardRole::Rows => {
                    parts.iter_mut().for_each(|p| p.rows /= tp);
                    divide_last(&mut graph.values[out.0 as usize].dims, tp);
                }
                ShardRole::Cols => {
                    *k /= tp;
                    out_partial = true;
                }
                _ => {}
            },
            Op::MlaAttention { heads, out, absorbed, partials, .. } => {
                *heads /= tp;
                for b in [out, absorbed, partials] {
                    divide_last(&mut graph.values[b.0 as usize].dims, tp);
                }
            }
            Op::MoeExperts { experts_local, expert_parallel, intermediate, mid, .. } => {
                match par.moe {
                    MoeParallel::Tp => {
                        *intermediate /= tp;
                        divide_last(&mut graph.values[mid.0 as usize].dims, tp);
                    }
                    MoeParallel::Ep => {
                        *experts_local /= tp;
                        *expert_parallel = true;
                    }
                }
                // the routed sum is partial on every rank; a complete shared output added to it
                // would count tp times
                if let Some(sh) = added.filter(|sh| !partial[sh.0 as usize]) {
                    return Err(CompileError::Verifier { pass: "shard", message: format!("the shared experts' output (value {}) is complete where the routed experts' sum is partial", sh.0) });
                }
                out_partial = true;
            }
            Op::Add { a, b, .. } => {
                let (pa, pb) = (partial[a.0 as usize], partial[b.0 as usize]);
                if pa != pb {
                    // Mixing a partial and a complete value would count the complete one tp times.
                    let v = if pa { *a } else { *b };
                    steps.push(Step { op: Op::AllReduce { buf: v, residual: None, norm: None }, kernel: KernelFamily::Collective, launches: Vec::new() });
                    partial[v.0 as usize] = false;
                }
                out_partial = pa && pb;
            }
            _ => {}
        }
        for w in step.op.writes() {
            partial[w.0 as usize] = out_partial;
        }
        steps.push(step);
        if let Some(op) = whole {
            whole_ops.push((steps.len() - 1, op));
        }
        if gathered.get(&index) == Some(&true) {
            let pairs = std::mem::take(&mut pending);
            steps.push(Step { op: Op::AllGather { pairs }, kernel: KernelFamily::Collective, launches: Vec::new() });
        }
    }
    match graph.draft.as_ref().map(|d| d.logits) {
        Some(draft_logits) => {
            let out = gather_logits(&mut graph, &mut steps, draft_logits, "draft.logits", tp);
            graph.draft.as_mut().expect("matched a draft").logits = out;
        }
        None => {
            let split = graph.logits;
            graph.logits = gather_logits(&mut graph, &mut steps, split, "logits", tp);
        }
    }
    graph.steps = steps;
    split_off_draft(&mut graph, draft_start.unwrap_or(usize::MAX));
    // the draft has no copies
    let whole_graph = (!whole_ops.is_empty()).then(|| with_whole_projections(&graph, whole_ops));
    Ok(Sharded { graph, whole_graph, whole_decode_batches, slots, choices })
}

/// The lm_head output is vocab-split: gathers the columns of every rank (the Rows branch
/// already cut its width to vocab / tp); returns the gathered value.
fn gather_logits(graph: &mut Graph, steps: &mut Vec<Step>, split: u32, name: &str, tp: usize) -> u32 {
    graph.values[split as usize].name = format!("{name}_local");
    let mut gathered = graph.values[split as usize].clone();
    gathered.name = name.into();
    if let Some(Dim::Fixed(n)) = gathered.dims.last_mut() {
        *n *= tp;
    }
    graph.values.push(gathered);
    let out = graph.values.len() as u32 - 1;
    steps.push(Step { op: Op::AllGather { pairs: vec![GatherPair { input: BufId(split), out: BufId(out) }] }, kernel: KernelFamily::Collective, launches: Vec::new() });
    out
}

/// Moves the steps from `start` on back into the draft graph (where there is one).
fn split_off_draft(graph: &mut Graph, start: usize) {
    if let Some(d) = graph.draft.as_mut() {
        d.steps = graph.steps.split_off(start.min(graph.steps.len()));
    }
}

/// `graph` with each split projection in `whole_ops` computed whole (its op writes the gathered
/// buffer) and its pair dropped from the all-gather after it (the gather too, once empty); the
/// rank's share it no longer writes takes no memory.
fn with_whole_projections(graph: &Graph, whole_ops: Vec<(usize, Op)>) -> Graph {
    let mut g = graph.clone();
    for (at, op) in whole_ops {
        let Op::Linear { out: local, .. } = g.steps[at].op else { unreachable!("a copied projection is a linear") };
        g.steps[at].op = op;
        if let Some(Step { op: Op::AllGather { pairs }, .. }) = g.steps[at + 1..].iter_mut().find(|s| matches!(&s.op, Op::AllGather { pairs } if pairs.iter().any(|p| p.input == local))) {
            pairs.retain(|p| p.input != local);
        }
        g.values[local.0 as usize].dims = vec![Dim::Fixed(0)];
    }
    g.steps.retain(|s| !matches!(&s.op, Op::AllGather { pairs } if pairs.is_empty()));
    g
}

/// `lw` with its matrix weights replaced as `map` says (the NVFP4 scalars stay).
fn with_ids(lw: &LinearWeights, map: &BTreeMap<WeightId, WeightId>) -> LinearWeights {
    let m = |id: &WeightId| *map.get(id).unwrap_or(id);
    match lw {
        LinearWeights::Bf16 { weight } => LinearWeights::Bf16 { weight: m(weight) },
        LinearWeights::Nvfp4 { weight, scale, scale_2, input_scale } => LinearWeights::Nvfp4 { weight: m(weight), scale: m(scale), scale_2: *scale_2, input_scale: *input_scale },
    }
}

/// The matrix weights of a linear (an NVFP4 linear's per-tensor scalars stay whole).
fn matrices(lw: &LinearWeights) -> Vec<WeightId> {
    match *lw {
        LinearWeights::Bf16 { weight } => vec![weight],
        LinearWeights::Nvfp4 { weight, scale, .. } => vec![weight, scale],
    }
}

/// Decides which replicated linears to split by output rows (their matrix weights become
/// `Rows`) and returns their steps (true: the last of a group whose outputs share one all-gather
/// after it), with one choice per projection (layers grouped) for `kiln inspect`. Auto weighs, at
/// batch 1 (where a decode step is most bound by weight bytes), the weight bytes a rank no longer
/// streams against the one-shot P2P all-gather of one token's output. A split linear right after
/// another (q_a then kv_a, both reading the attention input) joins its gather, up to
/// `P2P_GATHER_PAIRS` buffers whose shares at the largest decode batch fit the P2P kernel, and
/// pays only for its share of the transfer. A projection split this way must gather in a P2P
/// kernel (its share of a row whole 16-byte chunks), since NCCL's 25 µs would cost more than any
/// of them saves. A split projection may also keep a whole copy for prefill ([`PrefillCopies`]),
/// priced at the largest prefill chunk, whose gathers run on NCCL; decode batches whose gathers
/// cost more than computing the copied projections whole compute them whole too.
fn split_projections(graph: &mut Graph, tp: usize, split: &SplitPolicy, prefill_steps: usize) -> Splits {
    let k = &split.consts;
    let mut steps: BTreeMap<usize, bool> = BTreeMap::new();
    let mut copies: BTreeMap<usize, BTreeMap<WeightId, WeightId>> = BTreeMap::new();
    // every gather group's members (the last one open while `open` is its last step)
    let mut groups: Vec<Vec<Member>> = Vec::new();
    let mut open: Option<usize> = None;
    // per projection name: (layers, rows, whether split, the weight bytes of its copies, why,
    // whether the draft's layer has one too: it gathers in the draft programs)
    let mut seen: BTreeMap<String, (usize, usize, bool, Option<usize>, String, bool)> = BTreeMap::new();
    for (index, step) in graph.steps.iter().enumerate() {
        let Op::Linear { weights, parts, out, k: inputs, .. } = &step.op else { continue };
        let ids = matrices(weights);
        // one part only: the gather places each rank's share of a row side by side, which for
        // several parts would interleave them
        let [part] = parts.as_slice() else { continue };
        if ids.iter().any(|id| graph.weights[id.0 as usize].role != ShardRole::Replicated) {
            continue;
        }
        let rows = part.rows;
        let share = rows / tp * graph.values[out.0 as usize].dtype.size();
        let bytes: usize = ids.iter().map(|id| {
            let w = &graph.weights[id.0 as usize];
            w.pieces.len() * w.piece_shape.iter().product::<usize>() * w.dtype.size()
        }).sum();
        let divides = rows % tp == 0;
        let saved_us = bytes as f64 * (tp - 1) as f64 / tp as f64 / k.bytes_per_us();
        // joining the gather of the split linear just before: only this share's transfer
        let joins = open.filter(|&last| {
            let members = groups.last().map_or(&[][..], Vec::as_slice);
            let bytes: usize = members.iter().map(|m| m.share).sum();
            last + 1 == index && members.len() < P2P_GATHER_PAIRS && ((bytes + share) * split.max_batch()) as u64 <= k.p2p_max_bytes
        });
        let transfer_us = (tp - 1) as f64 * share as f64 / (k.p2p_gbps * 1e3);
        let gather_us = match joins {
            Some(_) => Some(transfer_us),
            None => collective_time(false, false, (share * tp) as f64, tp, k).1,
        }
        .filter(|_| share % 16 == 0);
        let (chosen, why) = match (split.projections, divides, gather_us) {
            (_, false, _) => (false, format!("its {rows} output rows do not divide by {tp}")),
            (SplitProjections::None, ..) => (false, "--split-projections none".into()),
            (SplitProjections::All, ..) => (true, "--split-projections all".into()),
            (SplitProjections::Auto, true, None) => (false, format!("{share} output bytes per rank and token are not whole 16-byte chunks or too many for the one-shot P2P all-gather")),
            (SplitProjections::Auto, true, Some(gather_us)) => (
                saved_us > gather_us,
                format!(
                    "at batch 1 a rank would stream {} less per layer ({saved_us:.1} µs at {} TB/s x {}) against {gather_us:.2} µs for {} its {share} output bytes",
                    human_bytes((bytes - bytes / tp) as u64),
                    k.dram_tbps,
                    k.dram_efficiency,
                    if joins.is_some() { "joining the previous projection's one-shot P2P all-gather with" } else { "a one-shot P2P all-gather of" },
                ),
            ),
        };
        // a whole copy for prefill: at the largest chunk, this share of the gather (all of it
        // unless it joined another's) against the rows a rank lacks, their bytes and FLOPs
        let chunk = split.prefill_chunk as f64;
        let chunk_bytes = chunk * (share * tp) as f64;
        let chunk_gather_us = match joins {
            Some(_) => chunk_bytes / (k.nccl_gbps * 1e3),
            None => gather_time(chunk_bytes, tp, k),
        };
        // the lacking rows' weight bytes are the ones the split saves at decode
        let flops_per_us = match weights {
            LinearWeights::Bf16 { .. } => k.bf16_pflops,
            LinearWeights::Nvfp4 { .. } => k.fp4_pflops,
        } * 1e9;
        let lacking_flops_us = (tp - 1) as f64 / tp as f64 * 2.0 * (rows * inputs) as f64 / flops_per_us;
        let whole_extra_us = saved_us + chunk * lacking_flops_us;
        // (the draft's steps, after the model's, run in no prefill program)
        let copy = chosen
            && index < prefill_steps
            && match split.copies {
                PrefillCopies::None => false,
                PrefillCopies::All => true,
                PrefillCopies::Auto => chunk_gather_us >= COPY_MARGIN * whole_extra_us,
            };
        let copy_why = format!(
            "; at the largest prefill chunk ({} tokens) its gather takes {chunk_gather_us:.0} µs, computing it whole {whole_extra_us:.0} µs more ({})",
            split.prefill_chunk,
            match split.copies {
                PrefillCopies::None => "--prefill-copies none".to_string(),
                PrefillCopies::All => "--prefill-copies all".to_string(),
                PrefillCopies::Auto => format!("a copy pays from {COPY_MARGIN}x"),
            }
        );
        if copy {
            let mut map = BTreeMap::new();
            for id in &ids {
                let mut whole = graph.weights[id.0 as usize].clone();
                whole.name.push_str(".whole");
                graph.weights.push(whole);
                map.insert(*id, WeightId(graph.weights.len() as u32 - 1));
            }
            copies.insert(index, map);
        }
        if chosen {
            for id in &ids {
                graph.weights[id.0 as usize].role = ShardRole::Rows;
            }
            let member = Member { share, whole: copy.then_some((saved_us, lacking_flops_us)) };
            match (joins, groups.last_mut()) {
                (Some(last), Some(g)) => {
                    steps.insert(last, false);
                    g.push(member);
                }
                _ => groups.push(vec![member]),
            }
            open = Some(index);
            steps.insert(index, true);
        }
        let name = projection_name(&graph.weights[ids[0].0 as usize].name);
        let why = if chosen { why + &copy_why } else { why };
        let draft = index >= prefill_steps;
        seen.entry(name)
            .and_modify(|e| {
                e.0 += 1;
                e.3 = e.3.map(|b| b + if copy { bytes } else { 0 });
                e.5 |= draft;
            })
            .or_insert((1, rows, chosen, copy.then_some(bytes), why, draft));
    }
    let (whole_decode_batches, split_decode_batches): (Vec<usize>, Vec<usize>) = split.decode_batches.iter().partition(|&&b| whole_pays(&groups, b, tp, k));
    let list = |batches: &[usize]| batches.iter().map(|b| b.to_string()).collect::<Vec<_>>().join(", ");
    // where a copied projection is gathered (the draft's layer, which has no copy, in the draft
    // programs), and which decode programs compute it whole too
    let gathered_at = |draft: bool| match (whole_decode_batches.as_slice(), split_decode_batches.as_slice(), draft) {
        ([], ..) => "at decode".to_string(),
        (_, [], false) => "in no program".to_string(),
        (_, [], true) => "in the draft programs only".to_string(),
        (_, split, false) => format!("at decode batch {}", list(split)),
        (_, split, true) => format!("at decode batch {} and in the draft programs", list(split)),
    };
    let whole_decode = match whole_decode_batches.as_slice() {
        [] => String::new(),
        whole => format!(", as do decode programs of batch {}", list(whole)),
    };
    let choices = seen
        .into_iter()
        .map(|(name, (layers, rows, chosen, copy, why, draft))| ShardChoice {
            what: format!("{name} ({layers} layers)"),
            how: match (chosen, copy) {
                (false, _) => "replicated".into(),
                (true, None) => format!("split by output rows, {} of {rows} per rank, all-gathered after it", rows / tp),
                (true, Some(bytes)) => format!(
                    "split by output rows, {} of {rows} per rank, all-gathered after it {}; prefill computes it whole from a copy on every rank ({} per rank){whole_decode}",
                    rows / tp,
                    gathered_at(draft),
                    human_bytes(bytes as u64)
                ),
            },
            why: if copy.is_some() && !whole_decode.is_empty() {
                why + "; a decode batch computes the copied projections whole where their gathers would take longer than the rows a rank lacks"
            } else {
                why
            },
        })
        .collect();
    Splits { gathered: steps, copies, whole_decode_batches, choices }
}

/// An all-gather of `bytes` in all: the P2P kernel where it takes them and is faster, else NCCL.
fn gather_time(bytes: f64, tp: usize, k: &Constants) -> f64 {
    let (nccl, p2p) = collective_time(false, false, bytes, tp, k);
    p2p.map_or(nccl, |p| p.min(nccl))
}

/// A split projection in a gather group: its output bytes per token and rank and, where it has a
/// whole copy, what computing it whole adds (the weight bytes a rank lacks, µs; their FLOPs, µs a
/// token).
struct Member {
    share: usize,
    whole: Option<(f64, f64)>,
}

/// Whether a decode step of `batch` rows is faster computing every copied projection whole: the
/// gather time that saves (each group's gather less that of its members without copies, none if
/// all have them; the P2P kernel where it takes the rows, NCCL otherwise) against the lacking
/// rows' bytes and FLOPs.
fn whole_pays(groups: &[Vec<Member>], batch: usize, tp: usize, k: &Constants) -> bool {
    let gather_us = |shares: usize| if shares == 0 { 0.0 } else { gather_time((batch * shares * tp) as f64, tp, k) };
    let mut saved = 0.0;
    let mut extra = 0.0;
    for g in groups.iter().filter(|g| g.iter().any(|m| m.whole.is_some())) {
        let all: usize = g.iter().map(|m| m.share).sum();
        let kept: usize = g.iter().filter(|m| m.whole.is_none()).map(|m| m.share).sum();
        saved += gather_us(all) - gather_us(kept);
        extra += g.iter().filter_map(|m| m.whole).map(|(bytes_us, flops_us)| bytes_us + batch as f64 * flops_us).sum::<f64>();
    }
    saved > extra
}

/// What [`split_projections`] decided: the split steps (true: the last of a group whose outputs
/// share one all-gather after it), the whole copies of those prefill computes whole (step ->
/// split weight -> its copy), the decode batches that compute them whole too, and one choice per
/// projection for `kiln inspect`.
#[derive(Default)]
struct Splits {
    gathered: BTreeMap<usize, bool>,
    copies: BTreeMap<usize, BTreeMap<WeightId, WeightId>>,
    whole_decode_batches: Vec<usize>,
    choices: Vec<ShardChoice>,
}

/// `layers.3.self_attn.q_a_proj.weight` -> `layers.*.self_attn.q_a_proj`.
fn projection_name(slot: &str) -> String {
    let base = slot.strip_suffix(".weight").unwrap_or(slot);
    match base.strip_prefix("layers.").and_then(|r| r.split_once('.')) {
        Some((layer, rest)) if layer.chars().all(|c| c.is_ascii_digit()) => format!("layers.*.{rest}"),
        _ => base.to_string(),
    }
}

fn divide_last(dims: &mut [Dim], tp: usize) {
    if let Some(Dim::Fixed(n)) = dims.last_mut() {
        *n /= tp;
    }
}

/// `n` pieces of `shape` concatenated along dim 0 (scalars stack into a vector).
fn concat0(n: usize, shape: &[usize]) -> Vec<usize> {
    match shape.split_first() {
        None => vec![n],
        Some((first, rest)) => std::iter::once(n * first).chain(rest.iter().copied()).collect(),
    }
}

fn slot_for(w: &GraphWeight, par: &Parallelism) -> Result<WeightSlot, CompileError> {
    let tp = par.tp;
    let ep = par.moe == MoeParallel::Ep;
    let split_dim = match w.role {
        ShardRole::Replicated => None,
        ShardRole::Rows => Some(0u8),
        ShardRole::Cols => Some(1),
        ShardRole::Experts { tp_dim } => if ep { None } else { tp_dim },
    };
    let mut piece = w.piece_shape.clone();
    if let (Some(d), true) = (split_dim, tp > 1) {
        let d = d as usize;
        if piece[d] % tp != 0 {
            let nvfp4 = if w.dtype.size() == 1 { " (NVFP4: each rank's input size must stay a multiple of 16)" } else { "" };
            return Err(CompileError::Shard {
                what: format!("`{}` ({} {:?})", w.name, w.dtype, w.piece_shape),
                tp,
                message: format!("dimension {d} of size {} is not divisible by {tp}{nvfp4}", piece[d]),
            });
        }
        piece[d] /= tp;
    }
    let shard = match (split_dim, tp > 1) {
        (Some(d), true) => Shard::Split { dim: d, parts: tp as u32 },
        _ => Shard::Whole,
    };
    let piece_bytes = piece.iter().product::<usize>() as u64 * w.dtype.size() as u64;
    let transform = w.transform;
    let (shape, sources) = match w.experts {
        Some(experts) => {
            let per_expert = w.pieces.len() / experts;
            let local = if ep && tp > 1 {
                if experts % tp != 0 {
                    return Err(CompileError::Shard {
                        what: format!("`{}`", w.name),
                        tp,
                        message: format!("--moe-parallel ep needs n_routed_experts ({experts}) divisible by the rank count"),
                    });
                }
                experts / tp
            } else {
                experts
            };
            let n_local = local * per_expert;
            let sources = (0..n_local)
                .map(|i| WeightSource {
                    tensor: if ep && tp > 1 {
                        TensorChoice::PerRank((0..tp).map(|r| w.pieces[r * n_local + i]).collect())
                    } else {
                        TensorChoice::Same(w.pieces[i])
                    },
                    shard,
                    dst_offset: i as u64 * piece_bytes,
                    transform,
                })
                .collect();
            (std::iter::once(local).chain(concat0(per_expert, &piece)).collect(), sources)
        }
        None => {
            let sources = w
                .pieces
                .iter()
                .enumerate()
                .map(|(i, &t)| WeightSource { tensor: TensorChoice::Same(t), shard, dst_offset: i as u64 * piece_bytes, transform })
                .collect();
            (concat0(w.pieces.len(), &piece), sources)
        }
    };
    let bytes = shape.iter().product::<usize>() as u64 * w.dtype.size() as u64;
    Ok(WeightSlot { name: w.name.clone(), kind: w.kind, dtype: w.dtype, shape, offset: 0, bytes, sources })
}

/// The sharding decisions, with the numbers behind them.
fn choices(cfg: &ModelConfig, par: &Parallelism, graph: &Graph, slots: &[WeightSlot]) -> Vec<ShardChoice> {
    let tp = par.tp;
    let kind_bytes = |pred: &dyn Fn(&GraphWeight) -> bool| -> u64 {
        graph.weights.iter().zip(slots).filter(|(w, _)| pred(w)).map(|(_, s)| s.bytes).sum()
    };
    let norms = kind_bytes(&|w| matches!(w.kind, WeightKind::Norm | WeightKind::Indexer) && w.role == ShardRole::Replicated && w.piece_shape.len() == 1);
    let router = kind_bytes(&|w| w.kind == WeightKind::Router);
    let c = |what: &str, how: String, why: String| ShardChoice { what: what.into(), how, why };
    let mut out = vec![
        c(
            "attention heads: q_b_proj, kv_b_proj (rows), o_proj (columns)",
            format!("{} heads split {} per rank; o_proj row-parallel, all-reduce after it", cfg.num_attention_heads, cfg.num_attention_heads / tp),
            "heads are independent, so attention needs no communication inside it".into(),
        ),
        c(
            "RMSNorm weights, the indexer's k_norm; the DSA indexer's top-k",
            format!("replicated ({} per rank in all); the top-k over all its heads on every rank{}", human_bytes(norms), if tp > 1 { " (which tokens in prefill: below)" } else { "" }),
            "the norms are vectors; top-k needs the score summed over all indexer heads, so split heads would need an all-reduce of the [tokens x context] score matrix every layer (the projections feeding them are listed below)".into(),
        ),
        c(
            "MoE router: gate, e_score_correction_bias",
            format!("replicated ({} per rank)", human_bytes(router)),
            "every rank must make the same expert choice; the router is small and computed in fp32".into(),
        ),
        match par.moe {
            MoeParallel::Tp => c(
                "routed experts",
                format!(
                    "tensor-parallel: each expert's intermediate {} split {} per rank (gate/up rows, down columns); partial sums all-reduced with the shared expert",
                    cfg.moe_intermediate_size,
                    cfg.moe_intermediate_size / tp
                ),
                "every rank does the same work for every token (no load imbalance, no token dispatch); --moe-parallel ep is the alternative".into(),
            ),
            MoeParallel::Ep => c(
                "routed experts",
                format!("expert-parallel: {} whole experts per rank; partial sums all-reduced", cfg.n_routed_experts / tp),
                "larger per-expert GEMMs; load depends on routing balance".into(),
            ),
        },
        c(
            "dense MLP and shared experts",
            "gate/up column-parallel, down row-parallel; one all-reduce per block".into(),
            "the standard Megatron split: the SwiGLU needs no communication".into(),
        ),
        c(
            "embedding and lm_head",
            format!("vocab-parallel: {} rows per rank; embedding all-reduced, logits all-gathered", cfg.vocab_size / tp),
            "together they are 2 x vocab x hidden BF16; replicating them would cost every rank that much".into(),
        ),
        c(
            "KV cache (latent, rope key, indexer key)",
            "replicated on every rank".into(),
            "MLA keeps one latent per token shared by all heads, so every rank's heads read the whole cache".into(),
        ),
    ];
    if tp == 1 {
        out = vec![c("everything", "one rank holds the whole model".into(), "--tp 1".into())];
    }
    out
}

#[cfg(test)]
mod tests {
    use super::{whole_pays, with_whole_projections, Member};
    use kiln_runtime::perf::Constants;
    use crate::graph::{Graph, GraphInputs, Value};
    use kiln_runtime::plan::{BufId, DType, Dim, Epilogue, GatherPair, KernelFamily, LinearPart, LinearWeights, Op, Step, WeightId};

    /// q_a and kv_a split (values 1 and 2 their shares of values 3 and 4), one gather after both.
    fn split_pair() -> Graph {
        let value = |name: &str, n: usize| Value { name: name.into(), dtype: DType::BF16, dims: vec![Dim::Tokens, Dim::Fixed(n)] };
        let linear = |weight: u32, rows: usize, out: u32| Step {
            op: Op::Linear { input: BufId(0), weights: LinearWeights::Bf16 { weight: WeightId(weight) }, parts: vec![LinearPart { rows }], k: 64, epilogue: Epilogue::None, out: BufId(out) },
            kernel: KernelFamily::LinearBf16,
            launches: vec![],
        };
        let pairs = vec![GatherPair { input: BufId(1), out: BufId(3) }, GatherPair { input: BufId(2), out: BufId(4) }];
        Graph {
            values: vec![value("x", 64), value("q_a_local", 16), value("kv_a_local", 8), value("q_a", 32), value("kv_a", 16)],
            weights: vec![],
            steps: vec![linear(0, 16, 1), linear(1, 8, 2), Step { op: Op::AllGather { pairs }, kernel: KernelFamily::Collective, launches: vec![] }],
            tensors: vec![],
            inputs: GraphInputs { ids: 0, positions: 0, token_seq: 0, slots: 0, page_table: 0, logit_rows: 0 },
            logits: 0,
            ignored: vec![],
            draft: None,
        }
    }

    /// The op computing value `out` whole from weight `copy`.
    fn whole(copy: u32, rows: usize, out: u32) -> Op {
        Op::Linear { input: BufId(0), weights: LinearWeights::Bf16 { weight: WeightId(copy) }, parts: vec![LinearPart { rows }], k: 64, epilogue: Epilogue::None, out: BufId(out) }
    }

    #[test]
    fn a_copied_projection_leaves_the_shared_gather_to_the_others() {
        let g = with_whole_projections(&split_pair(), vec![(0, whole(2, 32, 3))]);
        assert_eq!(g.steps[0].op, whole(2, 32, 3), "q_a computed whole into the gathered value");
        assert_eq!(g.steps[2].op, Op::AllGather { pairs: vec![GatherPair { input: BufId(2), out: BufId(4) }] }, "kv_a still gathered");
        assert_eq!(g.values[1].dims, vec![Dim::Fixed(0)], "q_a's share takes no memory");
        assert_eq!(g.values[2].dims, split_pair().values[2].dims, "kv_a's share is untouched");
    }

    #[test]
    fn a_gather_whose_projections_are_all_copied_goes() {
        let g = with_whole_projections(&split_pair(), vec![(0, whole(2, 32, 3)), (1, whole(3, 16, 4))]);
        assert_eq!(g.steps.len(), 2, "no gather left: {:?}", g.steps);
        assert_eq!((g.steps[0].op.clone(), g.steps[1].op.clone()), (whole(2, 32, 3), whole(3, 16, 4)));
    }

    /// At 8 ranks under the sm_120a constants, by hand: a gather of a projection alone costs the
    /// P2P kernel's 8 µs plus 7 x its rows' bytes / 50 GB/s, so computing it whole pays where
    /// the lacking rows take less; sharing its gather with a projection without a copy, only its
    /// transfer is saved (the other still gathers), 7 x batch x 144 B / 50 GB/s.
    #[test]
    fn a_decode_batch_computes_the_copies_whole_where_their_gathers_cost_more() {
        let k = Constants::SM120A;
        let alone = |extra_us: f64| vec![vec![Member { share: 1024, whole: Some((extra_us, 0.0)) }]];
        let gather_64 = 8.0 + 7.0 * 64.0 * 1024.0 / 50e3;
        assert!(whole_pays(&alone(gather_64 - 0.01), 64, 8, &k));
        assert!(!whole_pays(&alone(gather_64 + 0.01), 64, 8, &k));
        // its FLOPs grow with the batch: at 0.3 µs a row against the gather's 0.143, computing
        // it whole pays at batch 1 (8.14 µs against 7.8), not at 64 (17.2 against 26.7)
        let per_row = vec![vec![Member { share: 1024, whole: Some((7.5, 0.3)) }]];
        assert!(whole_pays(&per_row, 1, 8, &k) && !whole_pays(&per_row, 64, 8, &k));
        let shared = |extra_us: f64| vec![vec![Member { share: 512, whole: None }, Member { share: 144, whole: Some((extra_us, 0.0)) }]];
        let transfer_32 = 7.0 * 32.0 * 144.0 / 50e3;
        assert!(whole_pays(&shared(transfer_32 - 0.01), 32, 8, &k));
        assert!(!whole_pays(&shared(transfer_32 + 0.01), 32, 8, &k));
        // no copies: nothing to compute whole
        assert!(!whole_pays(&[vec![Member { share: 1024, whole: None }]], 64, 8, &k));
    }
}
