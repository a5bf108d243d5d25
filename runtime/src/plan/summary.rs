//! A readable summary of a plan: `manifest.json` and `kiln inspect --json` both print it.

use super::{Plan, ProgramKind, WeightKind};
use serde::Serialize;

#[derive(Debug, Serialize)]
pub struct Summary {
    pub format_version: u32,
    pub compiler: String,
    pub model_type: String,
    pub layers: usize,
    pub fingerprint: String,
    pub target: String,
    pub device: String,
    pub tp: usize,
    pub moe_parallel: String,
    pub per_gpu: PerGpu,
    pub programs: Vec<ProgramSummary>,
    pub sharding: Vec<super::ShardChoice>,
    pub ignored: Vec<String>,
    pub tensors: usize,
    /// Kernel instances with their ptxas resources (empty for the CPU target).
    pub kernels: Vec<KernelSummary>,
}

#[derive(Debug, Serialize)]
pub struct KernelSummary {
    pub name: String,
    pub family: String,
    pub template: String,
    /// Steps (over all programs) that launch it.
    pub launches: usize,
    /// Largest dynamic shared memory of its launches, in bytes.
    pub smem_dynamic_bytes: u32,
    /// What ptxas reported (None when ptxas was not found at compile time).
    pub resources: Option<super::Resources>,
}

#[derive(Debug, Serialize)]
pub struct PerGpu {
    pub gpu_memory_bytes: u64,
    pub weight_bytes: u64,
    /// Weight bytes by kind, in a fixed order.
    pub weight_bytes_by_kind: Vec<KindBytes>,
    pub workspace_bytes: u64,
    pub kv_bytes: u64,
    pub kv_bytes_per_token: u64,
    /// How the cache holds the indexer keys: `bf16` or `fp8`.
    pub kv_index_keys: String,
    pub kv_page_size: usize,
    pub kv_pages: usize,
    pub kv_token_capacity: u64,
    /// The RoPE (cos, sin) table the kernels read.
    pub rope_table_bytes: u64,
    pub headroom_bytes: u64,
    pub free_bytes: u64,
}

#[derive(Debug, Serialize)]
pub struct KindBytes {
    pub kind: String,
    pub bytes: u64,
}

#[derive(Debug, Serialize)]
pub struct ProgramSummary {
    pub name: String,
    pub kind: String,
    pub tokens: usize,
    pub logit_rows: usize,
    pub steps: usize,
    pub collectives: usize,
    pub workspace_bytes: u64,
}

pub fn summarize(plan: &Plan) -> Summary {
    let m = &plan.memory;
    let by_kind = WeightKind::ALL
        .iter()
        .map(|k| KindBytes { kind: k.label().to_string(), bytes: plan.weights.iter().filter(|w| w.kind == *k).map(|w| w.bytes).sum() })
        .filter(|k| k.bytes > 0)
        .collect();
    Summary {
        format_version: plan.format_version,
        compiler: plan.compiler.clone(),
        model_type: plan.model.model_type.clone(),
        layers: plan.model.num_hidden_layers,
        fingerprint: plan.fingerprint.clone(),
        target: plan.target.name.clone(),
        device: plan.target.device.clone(),
        tp: plan.parallel.tp,
        moe_parallel: format!("{:?}", plan.parallel.moe).to_lowercase(),
        per_gpu: PerGpu {
            gpu_memory_bytes: m.gpu_memory,
            weight_bytes: m.weights,
            weight_bytes_by_kind: by_kind,
            workspace_bytes: m.workspace,
            kv_bytes: m.kv.bytes(),
            kv_bytes_per_token: m.kv.bytes_per_token,
            kv_index_keys: m.kv.index_keys.name().into(),
            kv_page_size: m.kv.page_size,
            kv_pages: m.kv.pages,
            kv_token_capacity: m.kv.capacity_tokens(),
            rope_table_bytes: m.kv.rope_table_bytes(),
            headroom_bytes: m.headroom,
            free_bytes: m.gpu_memory.saturating_sub(m.used()),
        },
        programs: plan
            .programs
            .iter()
            .map(|p| ProgramSummary {
                name: p.name.clone(),
                kind: match p.kind {
                    ProgramKind::Prefill { .. } => "prefill".into(),
                    ProgramKind::Decode { .. } if p.is_draft() => "draft".into(),
                    ProgramKind::Decode { .. } => "decode".into(),
                },
                tokens: p.tokens,
                logit_rows: p.logit_rows,
                steps: p.steps.len(),
                collectives: p.all_reduces(),
                workspace_bytes: p.workspace_bytes,
            })
            .collect(),
        sharding: plan.sharding.clone(),
        ignored: plan.ignored.clone(),
        tensors: plan.tensors.len(),
        kernels: plan
            .kernels
            .iter()
            .enumerate()
            .map(|(i, k)| KernelSummary {
                name: k.name.clone(),
                family: k.family.name().into(),
                template: k.template.clone(),
                launches: plan
                    .programs
                    .iter()
                    .flat_map(|p| &p.steps)
                    .filter(|s| s.launches.iter().any(|l| l.kernel.0 as usize == i))
                    .count(),
                smem_dynamic_bytes: plan
                    .programs
                    .iter()
                    .flat_map(|p| &p.steps)
                    .flat_map(|s| &s.launches)
                    .filter(|l| l.kernel.0 as usize == i)
                    .map(|l| l.smem_dynamic)
                    .max()
                    .unwrap_or(0),
                resources: k.resources,
            })
            .collect(),
    }
}
