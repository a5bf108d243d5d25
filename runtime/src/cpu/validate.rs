//! Checks, once when a backend is built, that every step of every program has the buffer and
//! weight sizes its kernel indexes with, so a damaged or hand-edited plan is refused with a
//! message instead of crashing a kernel. (The compiler's verifier proves the same for the plans it
//! writes; this guards the runtime's own inputs.)

use super::{numel, width};
use crate::error::RuntimeError;
use crate::plan::{BufId, DType, Epilogue, GatherPair, LinearWeights, Op, Plan, Program, WeightId};

pub(crate) fn check_plan(plan: &Plan) -> Result<(), RuntimeError> {
    let kv = &plan.memory.kv;
    let m = &plan.model;
    if kv.latent_dim != m.kv_lora_rank || kv.rope_dim != m.qk_rope_head_dim || kv.index_dim != m.index_head_dim {
        return Err(RuntimeError::internal("the KV layout does not match the model config"));
    }
    if m.index_head_dim < m.qk_rope_head_dim || !m.qk_rope_head_dim.is_multiple_of(2) {
        return Err(RuntimeError::internal("the rope dim must be even and fit the indexer head"));
    }
    for slot in &plan.weights {
        if slot.offset.checked_add(slot.bytes).is_none_or(|end| end > plan.memory.weights) {
            return Err(RuntimeError::internal(format!("slot `{}` lies outside the weights arena", slot.name)));
        }
    }
    for p in &plan.programs {
        for (n, step) in p.steps.iter().enumerate() {
            check_op(plan, p, &step.op)
                .map_err(|m| RuntimeError::internal(format!("plan check: {} step {n} ({}): {m}", p.name, step.op.name())))?;
        }
    }
    Ok(())
}

fn check_op(plan: &Plan, p: &Program, op: &Op) -> Result<(), String> {
    for b in op.reads().into_iter().chain(op.writes()) {
        if b.0 as usize >= p.buffers.len() {
            return Err(format!("buffer {} out of range", b.0));
        }
    }
    for w in op.weight_ids() {
        if w.0 as usize >= plan.weights.len() {
            return Err(format!("weight {} out of range", w.0));
        }
    }
    let m = &plan.model;
    let kv = &plan.memory.kv;
    let t = p.tokens;
    let buf = |b: BufId| p.buffer(b);
    let float = |b: BufId, n: usize| -> Result<(), String> {
        let x = buf(b);
        if x.dtype == DType::I32 || numel(p, b) != n {
            return Err(format!("`{}` is {} {:?}, expected {n} float values", x.name, x.dtype, x.shape));
        }
        Ok(())
    };
    let int = |b: BufId, n: usize| -> Result<(), String> {
        let x = buf(b);
        if x.dtype != DType::I32 || numel(p, b) != n {
            return Err(format!("`{}` is {} {:?}, expected {n} I32 values", x.name, x.dtype, x.shape));
        }
        Ok(())
    };
    let bytes = |w: WeightId, dtype: DType, n: usize| -> Result<(), String> {
        let s = plan.weight(w);
        if s.dtype != dtype || s.bytes != (n * dtype.size()) as u64 {
            return Err(format!("slot `{}` is {} ({} bytes), expected {n} {dtype} values", s.name, s.dtype, s.bytes));
        }
        Ok(())
    };
    // Small vectors are decoded to f32 (BF16 or F32 slots).
    let vector = |w: WeightId, n: usize| -> Result<(), String> {
        let s = plan.weight(w);
        let count = s.bytes as usize / s.dtype.size();
        if !matches!(s.dtype, DType::BF16 | DType::F32) || s.shape.len() > 2 || count != n {
            return Err(format!("slot `{}` is {} {:?}, expected {n} values", s.name, s.dtype, s.shape));
        }
        Ok(())
    };
    let linear = |w: &LinearWeights, n: usize, k: usize, parts: usize, stack: usize| -> Result<(), String> {
        match *w {
            LinearWeights::Bf16 { weight } => bytes(weight, DType::BF16, stack * n * k),
            LinearWeights::Nvfp4 { weight, scale, scale_2, input_scale } => {
                if !k.is_multiple_of(16) {
                    return Err(format!("NVFP4 input size {k} is not a multiple of 16"));
                }
                bytes(weight, DType::U8, stack * n * k / 2)?;
                bytes(scale, DType::F8E4M3, stack * n * k / 16)?;
                bytes(scale_2, DType::F32, stack * parts)?;
                bytes(input_scale, DType::F32, stack * parts)
            }
        }
    };
    let layer = |l: usize| if l < kv.layers { Ok(()) } else { Err(format!("layer {l} of a {}-layer cache", kv.layers)) };
    match *op {
        Op::Concurrent { ref ops } => {
            if ops.len() < 2 || ops.iter().any(|o| matches!(o, Op::Concurrent { .. } | Op::AllReduce { .. } | Op::AllGather { .. })) {
                return Err("a concurrent step holds two or more ops, none a collective or concurrent".into());
            }
            ops.iter().try_for_each(|o| check_op(plan, p, o))
        }
        Op::LinearGroup { ref members, .. } => {
            if members.is_empty() {
                return Err("a linear group without members".into());
            }
            op.group_norm().into_iter().chain(op.group_members().unwrap_or_default()).try_for_each(|m| check_op(plan, p, &m))
        }
        Op::Embed { ids, table, vocab_rows, out } => {
            let h = width(p, out);
            int(ids, t)?;
            float(out, t * h)?;
            bytes(table, DType::BF16, vocab_rows * h)
        }
        Op::RmsNorm { input, residual, weight, out, .. } => {
            let h = width(p, out);
            let rows = numel(p, out) / h.max(1);
            float(input, rows * h)?;
            float(out, rows * h)?;
            if let Some(r) = residual {
                float(r, rows * h)?;
            }
            vector(weight, h)
        }
        Op::Linear { input, ref weights, ref parts, k, epilogue, out } => {
            if parts.is_empty() || parts.len() > 2 {
                return Err(format!("{} parts (the CPU backend takes 1 or 2)", parts.len()));
            }
            let n: usize = parts.iter().map(|x| x.rows).sum();
            let rows = numel(p, input) / k.max(1);
            float(input, rows * k)?;
            let out_n = match epilogue {
                Epilogue::None => n,
                Epilogue::SiluMul if parts.len() == 2 && parts[0].rows == parts[1].rows => n / 2,
                Epilogue::SiluMul => return Err("SiLU-mul needs two equal parts".into()),
            };
            float(out, rows * out_n)?;
            linear(weights, n, k, parts.len(), 1)
        }
        Op::KvCacheWrite { kv: b, kv_norm, k, k_norm, k_bias, layer: l, .. } => {
            layer(l)?;
            float(b, t * (kv.latent_dim + kv.rope_dim))?;
            vector(kv_norm, kv.latent_dim)?;
            float(k, t * kv.index_dim)?;
            vector(k_norm, kv.index_dim)?;
            vector(k_bias, kv.index_dim)
        }
        Op::IndexerTopK { q, head_weights, layer: l, topk, across_ranks, scores, out } => {
            layer(l)?;
            let heads = width(p, head_weights);
            float(head_weights, t * heads)?;
            float(q, t * heads * kv.index_dim)?;
            // scratch: empty (prefill) or a score per token and cached position (decode)
            if p.buffer(scores).bytes != 0 {
                float(scores, t * kv.pages_per_seq * kv.page_size)?;
            }
            // across ranks: a row for every rank-th token (whole rows on every rank)
            let ranks = plan.ranks();
            if across_ranks && t % ranks != 0 {
                return Err(format!("{t} tokens do not split over {ranks} ranks"));
            }
            int(out, if across_ranks { t / ranks } else { t } * topk)
        }
        Op::MlaAttention { q, kv_b, topk, layer: l, heads, absorbed, partials, out, .. } => {
            layer(l)?;
            let (nope, dr, dv, r) = (m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim, m.kv_lora_rank);
            float(q, t * heads * (nope + dr))?;
            float(out, t * heads * dv)?;
            // scratch: empty (plans before prefill took the split form) or split-KV attention's absorbed q and split states
            if p.buffer(absorbed).bytes != 0 || p.buffer(partials).bytes != 0 {
                float(absorbed, t * heads * r)?;
                float(partials, t * crate::plan::attention_splits_cap(t) * heads * (r + 4))?;
            }
            if let Some(b) = topk {
                int(b, t * width(p, b))?;
            }
            bytes(kv_b, DType::BF16, heads * (nope + dv) * r)
        }
        Op::Router { input, gate, bias, ref params, logits, ids, weights } => {
            let (e, h) = (params.experts, width(p, input));
            let groups = params.n_group.max(1);
            if e == 0 || !e.is_multiple_of(groups) || params.top_k == 0 || params.top_k > e {
                return Err(format!("router of {e} experts in {groups} groups, top-{}", params.top_k));
            }
            float(input, t * h)?;
            bytes(gate, DType::BF16, e * h)?;
            vector(bias, e)?;
            if buf(logits).dtype != DType::F32 {
                return Err(format!("router logits `{}` are {}, expected F32", buf(logits).name, buf(logits).dtype));
            }
            float(logits, t * e)?;
            int(ids, t * params.top_k)?;
            float(weights, t * params.top_k)
        }
        Op::MoeExperts { input, ids, weights, ref gate_up, ref down, experts_local, expert_parallel, intermediate, hidden, out, mid, acc, shared } => {
            let top_k = width(p, ids);
            float(input, t * hidden)?;
            if let Some(sh) = shared {
                float(sh, t * hidden)?;
            }
            int(ids, t * top_k)?;
            float(weights, t * top_k)?;
            float(out, t * hidden)?;
            float(mid, t * top_k * intermediate)?;
            float(acc, t * hidden)?;
            if expert_parallel && experts_local * plan.ranks() > m.n_routed_experts {
                return Err(format!("{experts_local} experts per rank x {} ranks", plan.ranks()));
            }
            linear(gate_up, 2 * intermediate, hidden, 2, experts_local)?;
            linear(down, hidden, intermediate, 1, experts_local)
        }
        Op::Add { a, b, out } => {
            let n = numel(p, out);
            float(a, n)?;
            float(b, n)?;
            float(out, n)
        }
        Op::GatherRows { input, rows, out } => {
            let h = width(p, out);
            int(rows, numel(p, out) / h.max(1))?;
            if width(p, input) != h || buf(input).dtype == DType::I32 {
                return Err("input and output rows differ".into());
            }
            Ok(())
        }
        Op::AllReduce { buf: b, residual, norm } => {
            float(b, numel(p, b))?;
            match residual {
                Some(r) if buf(r).dtype == buf(b).dtype => float(r, numel(p, b))?,
                Some(_) => return Err("the residual's dtype differs from the summed buffer's".into()),
                None if norm.is_some() => return Err("normalises a residual it does not have".into()),
                None => {}
            }
            op.residual_norm().map_or(Ok(()), |n| check_op(plan, p, &n))
        }
        Op::AllGather { ref pairs } => {
            if pairs.is_empty() {
                return Err("gathers nothing".into());
            }
            for &GatherPair { input, out } in pairs {
                // `out` holds [rows, ranks x w] whatever its shape
                let (w, n) = (width(p, input), numel(p, input));
                if w == 0 || numel(p, out) != n * plan.ranks() || width(p, out) % w != 0 {
                    return Err(format!("gathers {n} values ({w} columns) from {} ranks into {:?}", plan.ranks(), p.buffer(out).shape));
                }
                if p.buffer(input).dtype != p.buffer(out).dtype {
                    return Err("gathers into a buffer of another dtype".into());
                }
                if p.buffer(out).dtype == DType::I32 {
                    int(input, n)?;
                    int(out, n * plan.ranks())?;
                } else {
                    float(input, n)?;
                    float(out, n * plan.ranks())?;
                }
            }
            Ok(())
        }
    }
}
