//! Verifiers run after each pass. A failure here is a kiln bug, reported as such.

use crate::error::CompileError;
use kiln_runtime::plan::{BufId, Epilogue, LinearWeights, MemoryPlan, ModelConfig, Op, Program, WeightId, WeightSlot};

fn fail(pass: &'static str, message: String) -> CompileError {
    CompileError::Verifier { pass, message }
}

/// Shapes agree across every step; every buffer is written before it is read; ids are in range.
/// `ranks`: the plan's tensor-parallel ranks (what a gather concatenates).
pub fn program(pass: &'static str, p: &Program, slots: &[WeightSlot], cfg: &ModelConfig, ranks: usize) -> Result<(), CompileError> {
    let mut written = vec![false; p.buffers.len()];
    let i = p.inputs;
    for b in [i.ids, i.positions, i.token_seq, i.slots, i.page_table, i.logit_rows].into_iter().chain(p.hidden_in) {
        written[b.0 as usize] = true;
    }
    for (n, step) in p.steps.iter().enumerate() {
        let at = |m: String| fail(pass, format!("{} step {n} ({}): {m}; op {:?} {:?}", p.name, step.op.name(), step.op, step.op.writes().iter().map(|b| p.buffer(*b).name.clone()).collect::<Vec<_>>()));
        for b in step.op.reads().into_iter().chain(step.op.writes()) {
            if b.0 as usize >= p.buffers.len() {
                return Err(at(format!("buffer {} out of range", b.0)));
            }
        }
        for w in step.op.weight_ids() {
            if w.0 as usize >= slots.len() {
                return Err(at(format!("weight {} out of range", w.0)));
            }
        }
        for b in step.op.reads() {
            if !written[b.0 as usize] {
                return Err(at(format!("reads `{}` before anything writes it", p.buffer(b).name)));
            }
        }
        check_shapes(p, &step.op, slots, cfg, ranks).map_err(at)?;
        for b in step.op.writes() {
            written[b.0 as usize] = true;
        }
    }
    if let Some(h) = p.hidden_out.filter(|h| !written[h.0 as usize]) {
        return Err(fail(pass, format!("{}: nothing writes the hidden rows `{}` it leaves for the draft", p.name, p.buffer(h).name)));
    }
    if !written[p.logits.0 as usize] {
        return Err(fail(pass, format!("{}: nothing writes the logits", p.name)));
    }
    Ok(())
}

fn check_shapes(p: &Program, op: &Op, slots: &[WeightSlot], cfg: &ModelConfig, ranks: usize) -> Result<(), String> {
    let shape = |b: BufId| p.buffer(b).shape.as_slice();
    let last = |b: BufId| *p.buffer(b).shape.last().unwrap_or(&0);
    let rows = |b: BufId| p.buffer(b).shape[0];
    let slot = |w: WeightId| slots[w.0 as usize].shape.as_slice();
    let expect = |what: &str, found: &[usize], want: &[usize]| {
        if found == want {
            Ok(())
        } else {
            Err(format!("{what} has shape {found:?}, expected {want:?}"))
        }
    };
    let linear = |w: &LinearWeights, lead: &[usize], n: usize, k: usize, parts: usize| -> Result<(), String> {
        let with = |rest: &[usize]| lead.iter().chain(rest).copied().collect::<Vec<_>>();
        match *w {
            LinearWeights::Bf16 { weight } => expect("weight", slot(weight), &with(&[n, k])),
            LinearWeights::Nvfp4 { weight, scale, scale_2, input_scale } => {
                if k % 16 != 0 {
                    return Err(format!("NVFP4 input size {k} is not a multiple of 16"));
                }
                expect("packed weight", slot(weight), &with(&[n, k / 2]))?;
                expect("block scales", slot(scale), &with(&[n, k / 16]))?;
                expect("weight_scale_2", slot(scale_2), &with(&[parts]))?;
                expect("input_scale", slot(input_scale), &with(&[parts]))
            }
        }
    };
    match op {
        Op::Concurrent { ops } => {
            for o in ops {
                check_shapes(p, o, slots, cfg, ranks)?;
            }
        }
        Op::LinearGroup { members, .. } => {
            if members.is_empty() {
                return Err("a linear group without members".into());
            }
            for m in op.group_norm().into_iter().chain(op.group_members().unwrap_or_default()) {
                check_shapes(p, &m, slots, cfg, ranks)?;
            }
        }
        Op::Linear { input, weights, parts, k, epilogue, out } => {
            let n: usize = parts.iter().map(|p| p.rows).sum();
            if last(*input) != *k {
                return Err(format!("input width {} != k {k}", last(*input)));
            }
            linear(weights, &[], n, *k, parts.len())?;
            let want = match epilogue {
                Epilogue::None => n,
                Epilogue::SiluMul => {
                    if parts.len() != 2 || parts[0].rows != parts[1].rows {
                        return Err("SiluMul needs two equal parts".into());
                    }
                    n / 2
                }
            };
            if last(*out) != want || rows(*out) != rows(*input) {
                return Err(format!("output {:?}, expected [{}, {want}]", shape(*out), rows(*input)));
            }
        }
        Op::MoeExperts { input, ids, gate_up, down, experts_local, intermediate, hidden, out, shared, .. } => {
            linear(gate_up, &[*experts_local], 2 * intermediate, *hidden, 2)?;
            linear(down, &[*experts_local], *hidden, *intermediate, 1)?;
            if shape(*out) != shape(*input) || rows(*ids) != rows(*input) {
                return Err("input/output/ids rows disagree".into());
            }
            if let Some(sh) = shared {
                expect("shared", shape(*sh), shape(*out))?;
            }
        }
        Op::MlaAttention { q, kv_b, topk, heads, out, absorbed, partials, .. } => {
            expect("q", shape(*q), &[rows(*q), heads * cfg.qk_head_dim()])?;
            expect("kv_b", slot(*kv_b), &[heads * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank])?;
            expect("out", shape(*out), &[rows(*q), heads * cfg.v_head_dim])?;
            // split-KV attention's scratch: absorbed q, then each split's state
            let latent = cfg.kv_lora_rank;
            let split_rows = if rows(*absorbed) == 0 { 0 } else { rows(*q) };
            expect("absorbed", shape(*absorbed), &[split_rows, heads * latent])?;
            let splits = if split_rows == 0 { 0 } else { kiln_runtime::plan::attention_splits_cap(rows(*q)) };
            expect("partials", shape(*partials), &[split_rows, splits, heads * (latent + 4)])?;
            if let Some(t) = topk {
                expect("topk", shape(*t), &[rows(*q), cfg.index_topk])?;
            }
        }
        Op::RmsNorm { input, residual, weight, out, .. } => {
            expect("norm weight", slot(*weight), &[last(*input)])?;
            expect("out", shape(*out), shape(*input))?;
            if let Some(r) = residual {
                expect("residual", shape(*r), shape(*input))?;
            }
        }
        Op::Embed { ids, table, vocab_rows, out } => {
            expect("table", slot(*table), &[*vocab_rows, cfg.hidden_size])?;
            expect("out", shape(*out), &[shape(*ids)[0], cfg.hidden_size])?;
        }
        Op::Add { a, b, out } => {
            expect("b", shape(*b), shape(*a))?;
            expect("out", shape(*out), shape(*a))?;
        }
        Op::AllGather { pairs } => {
            // `out` holds [rows, ranks x columns]: the input's rows with every rank's columns
            // (split projections, logits), or R rows to one (a sequence-parallel indexer's lists)
            let numel = |b: BufId| shape(b).iter().product::<usize>();
            for g in pairs {
                let whole_rows = last(g.out) % last(g.input).max(1) == 0 && (rows(g.input) == rows(g.out) || last(g.input) == last(g.out));
                if numel(g.out) != numel(g.input) * ranks || !whole_rows || p.buffer(g.input).dtype != p.buffer(g.out).dtype {
                    return Err(format!("gathers {:?} into {:?} over {ranks} ranks", shape(g.input), shape(g.out)));
                }
            }
        }
        Op::KvCacheWrite { kv, k, .. } => {
            expect("kv", shape(*kv), &[rows(*kv), cfg.kv_lora_rank + cfg.qk_rope_head_dim])?;
            expect("k", shape(*k), &[rows(*k), cfg.index_head_dim])?;
        }
        Op::IndexerTopK { q, head_weights, out, topk, across_ranks, scores, .. } => {
            expect("q", shape(*q), &[rows(*q), cfg.index_n_heads * cfg.index_head_dim])?;
            expect("head weights", shape(*head_weights), &[rows(*q), cfg.index_n_heads])?;
            // across ranks: this rank's rows, every ranks-th token
            if *across_ranks && rows(*q) % ranks != 0 {
                return Err(format!("{} tokens do not split over {ranks} ranks", rows(*q)));
            }
            expect("out", shape(*out), &[if *across_ranks { rows(*q) / ranks } else { rows(*q) }, *topk])?;
            // decode's scratch: a score per token and position a sequence's pages hold; prefill's is empty
            let pages = shape(p.inputs.page_table)[1];
            let score_rows = if rows(*scores) == 0 { 0 } else { rows(*q) };
            expect("scores", shape(*scores), &[score_rows, pages, crate::passes::memory::KV_PAGE_SIZE])?;
        }
        Op::Router { input, logits, ids, weights, params, .. } => {
            expect("logits", shape(*logits), &[rows(*input), params.experts])?;
            expect("ids", shape(*ids), &[rows(*input), params.top_k])?;
            expect("weights", shape(*weights), &[rows(*input), params.top_k])?;
        }
        Op::GatherRows { input, rows: r, out } => expect("out", shape(*out), &[shape(*r)[0], last(*input)])?,
        Op::AllReduce { buf, residual, .. } => {
            if let Some(r) = residual {
                expect("residual", shape(*r), shape(*buf))?;
            }
            if let Some(n) = op.residual_norm() {
                check_shapes(p, &n, slots, cfg, ranks)?;
            }
        }
    }
    Ok(())
}

/// Weights do not overlap; buffers alive at the same step do not overlap; everything fits.
pub fn memory(slots: &[WeightSlot], programs: &[Program], mem: &MemoryPlan) -> Result<(), CompileError> {
    const PASS: &str = "memory";
    for pair in slots.windows(2) {
        if pair[0].offset + pair[0].bytes > pair[1].offset {
            return Err(fail(PASS, format!("weight slots `{}` and `{}` overlap", pair[0].name, pair[1].name)));
        }
    }
    if let Some(s) = slots.last() {
        if s.offset + s.bytes > mem.weights {
            return Err(fail(PASS, format!("weight slot `{}` ends past the arena", s.name)));
        }
    }
    for p in programs {
        let n = p.buffers.len();
        let mut first = vec![usize::MAX; n];
        let mut last = vec![0; n];
        for (i, step) in p.steps.iter().enumerate() {
            for b in step.op.reads().into_iter().chain(step.op.writes()) {
                first[b.0 as usize] = first[b.0 as usize].min(i);
                last[b.0 as usize] = i;
            }
        }
        let live: Vec<usize> = (0..n).filter(|&i| first[i] != usize::MAX).collect();
        let mut by_offset = live.clone();
        by_offset.sort_by_key(|&i| p.buffers[i].offset);
        for (x, &a) in by_offset.iter().enumerate() {
            let ba = &p.buffers[a];
            if ba.offset + ba.bytes > p.workspace_bytes || p.workspace_bytes > mem.workspace {
                return Err(fail(PASS, format!("{}: buffer `{}` ends past the workspace", p.name, ba.name)));
            }
            for &b in &by_offset[x + 1..] {
                let bb = &p.buffers[b];
                if bb.offset >= ba.offset + ba.bytes {
                    break;
                }
                if first[a] <= last[b] && first[b] <= last[a] {
                    return Err(fail(PASS, format!("{}: live buffers `{}` and `{}` overlap", p.name, ba.name, bb.name)));
                }
            }
        }
    }
    if mem.used() > mem.gpu_memory {
        return Err(fail(PASS, format!("plan uses {} bytes of {}", mem.used(), mem.gpu_memory)));
    }
    Ok(())
}
