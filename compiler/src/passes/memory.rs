//! Memory planning per rank: the weights arena, one workspace shared by all programs with
//! liveness-based reuse inside each program, the paged KV cache from what is left, and explicit
//! headroom. If the model does not fit, the compile fails here, not at CUDA-graph capture.

use crate::error::{human_bytes, CompileError};
use kiln_runtime::plan::{DType, IndexKeys, KvLayout, MemoryPlan, ModelConfig, Program, Target, WeightSlot};

/// Every arena offset is aligned to this many bytes (enough for 128-bit vector loads and TMA).
pub const ALIGN: u64 = 256;
pub const KV_PAGE_SIZE: usize = 64;

fn align(n: u64) -> u64 {
    n.div_ceil(ALIGN) * ALIGN
}

/// Lays the weight slots out back to back; returns the arena size.
pub fn plan_weights(slots: &mut [WeightSlot]) -> u64 {
    let mut offset = 0;
    for s in slots {
        s.offset = offset;
        offset = align(offset + s.bytes);
    }
    offset
}

/// Assigns workspace offsets: program inputs first (live for the whole replay), then every
/// activation at the lowest offset that no buffer alive at the same time occupies. Deterministic.
pub fn plan_workspace(program: &mut Program) -> u64 {
    let n = program.buffers.len();
    let mut first = vec![usize::MAX; n];
    let mut last = vec![0usize; n];
    // steps whose launches lowering may merge (`merge::may_share_a_launch`) count as one time:
    // their buffers are live together, so none takes another's bytes
    let mut time = 0;
    for (i, step) in program.steps.iter().enumerate() {
        if i > 0 && !super::merge::may_share_a_launch(program, &program.steps[i - 1].op, &step.op) {
            time += 1;
        }
        let i = time;
        for b in step.op.reads().into_iter().chain(step.op.writes()) {
            let b = b.0 as usize;
            first[b] = first[b].min(i);
            last[b] = last[b].max(i);
        }
    }
    let inputs = program.inputs;
    // inputs (a draft program's hidden rows too) first, then the outputs, live throughout
    let mut pinned = vec![inputs.ids, inputs.positions, inputs.token_seq, inputs.slots, inputs.page_table, inputs.logit_rows];
    pinned.extend(program.hidden_in);
    let n_inputs = pinned.len();
    pinned.push(program.logits);
    pinned.extend(program.hidden_out);
    let steps = program.steps.len();
    for b in &pinned {
        first[b.0 as usize] = 0;
        last[b.0 as usize] = steps;
    }
    let mut offset = 0;
    for b in &pinned[..n_inputs] {
        let buf = &mut program.buffers[b.0 as usize];
        buf.offset = offset;
        offset = align(offset + buf.bytes);
    }
    let io_end = offset;
    // Largest first, then by first use: the classic greedy for interval packing.
    let mut order: Vec<usize> = (0..n).filter(|i| !pinned[..n_inputs].iter().any(|p| p.0 as usize == *i)).collect();
    order.sort_by_key(|&i| (std::cmp::Reverse(program.buffers[i].bytes), first[i], i));
    let mut placed: Vec<(u64, u64, usize, usize)> = Vec::new(); // (offset, end, first, last)
    let mut peak = io_end;
    for i in order {
        if first[i] == usize::MAX {
            first[i] = 0; // never touched: keep it addressable but out of everyone's way
            last[i] = steps;
        }
        let size = align(program.buffers[i].bytes.max(1));
        let mut conflicts: Vec<(u64, u64)> = placed
            .iter()
            .filter(|p| p.2 <= last[i] && first[i] <= p.3)
            .map(|p| (p.0, p.1))
            .collect();
        conflicts.sort_unstable();
        let mut at = io_end;
        for (start, end) in conflicts {
            if at + size <= start {
                break;
            }
            at = at.max(end);
        }
        program.buffers[i].offset = at;
        placed.push((at, at + size, first[i], last[i]));
        peak = peak.max(at + size);
    }
    program.workspace_bytes = peak;
    peak
}

pub struct KvRequest {
    pub page_size: usize,
    pub max_seqs: usize,
    /// The longest sequence the plan serves; at least one such sequence must fit.
    pub max_context: usize,
    /// Cache layers: the model's, and a draft model's layer after them (its own KV and indexer
    /// keys, in the same pages).
    pub layers: usize,
    pub index_keys: IndexKeys,
}

/// Per-rank budget: weights + workspace + KV + headroom <= GPU memory. The KV cache takes what is
/// left, capped at what `max_seqs` sequences of `max_context` tokens can use.
pub fn plan_memory(
    cfg: &ModelConfig,
    target: &Target,
    headroom: u64,
    weights: u64,
    workspace: u64,
    req: &KvRequest,
) -> Result<MemoryPlan, CompileError> {
    let dtype = DType::BF16;
    let mut kv = KvLayout {
        dtype,
        layers: req.layers,
        latent_dim: cfg.kv_lora_rank,
        rope_dim: cfg.qk_rope_head_dim,
        index_dim: cfg.index_head_dim,
        page_size: req.page_size,
        pages: 0,
        bytes_per_token: 0,
        max_seqs: req.max_seqs,
        pages_per_seq: 0,
        max_context: req.max_context,
        index_keys: req.index_keys,
    };
    let per_token = req.layers as u64 * kv.slot_bytes();
    let page_bytes = per_token * req.page_size as u64;
    let pages_per_seq = req.max_context.div_ceil(req.page_size);
    let min_pages = pages_per_seq as u64;
    // The RoPE table: (cos, sin) F32 per position and pair.
    let rope_table = (req.max_context * cfg.qk_rope_head_dim * 4) as u64;
    let fixed = headroom + weights + workspace + rope_table;
    let available = target.gpu_memory.saturating_sub(fixed);
    let pages = available / page_bytes;
    if pages < min_pages {
        let needed = fixed + min_pages * page_bytes;
        return Err(CompileError::DoesNotFit {
            target: format!("{} ({})", target.name, target.device),
            gpu_memory: human_bytes(target.gpu_memory),
            needed: human_bytes(needed),
            weights: human_bytes(weights),
            workspace: human_bytes(workspace),
            kv_min: format!("{} for one {}-token sequence", human_bytes(min_pages * page_bytes), req.max_context),
            headroom: human_bytes(headroom),
            short: human_bytes(needed - target.gpu_memory),
        });
    }
    let cap = (req.max_seqs * pages_per_seq) as u64;
    let pages = pages.min(cap) as usize;
    Ok(MemoryPlan {
        gpu_memory: target.gpu_memory,
        headroom,
        weights,
        workspace,
        kv: {
            kv.pages = pages;
            kv.bytes_per_token = per_token;
            kv.pages_per_seq = pages_per_seq;
            kv
        },
    })
}
