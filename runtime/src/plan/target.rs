use serde::{Deserialize, Serialize};

/// What the plan is compiled for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Arch {
    /// The CPU reference backend (simulated ranks).
    Cpu,
    /// RTX PRO 6000 Blackwell (GB202): block-scaled FP4 `mma.sync`, no wgmma/tcgen05.
    Sm120a,
    /// H200 (Hopper): a portable target so a lent H200 can run plans; no FP4 tensor cores.
    Sm90a,
}

/// The hardware a plan is specialised for; one value per GPU (all ranks are identical).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Target {
    /// `cpu`, `sm_120a` or `sm_90a`.
    pub name: String,
    pub arch: Arch,
    pub device: String,
    /// Memory per GPU the plan may use, in bytes (the target default or `--gpu-memory`).
    pub gpu_memory: u64,
    pub sm_count: u32,
    /// Largest dynamic shared memory per block, in bytes.
    pub smem_per_block: u32,
    pub mem_bandwidth_gbs: u32,
}
