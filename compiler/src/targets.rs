//! The hardware kiln compiles for.

use crate::error::CompileError;
use kiln_runtime::plan::{Arch, Target};

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;

/// Names accepted by `--target`.
pub const TARGET_NAMES: [&str; 3] = ["cpu", "sm_120a", "sm_90a"];

/// The target's defaults (memory as the driver reports it).
pub fn target(name: &str) -> Result<Target, CompileError> {
    Ok(match name {
        "cpu" => Target {
            name: "cpu".into(),
            arch: Arch::Cpu,
            device: "CPU reference backend (simulated ranks)".into(),
            gpu_memory: 16 * GIB,
            sm_count: 0,
            smem_per_block: 0,
            mem_bandwidth_gbs: 0,
        },
        "sm_120a" => Target {
            name: "sm_120a".into(),
            arch: Arch::Sm120a,
            device: "NVIDIA RTX PRO 6000 Blackwell (GB202)".into(),
            gpu_memory: 97_887 * MIB,
            sm_count: 188,
            smem_per_block: 101_376,
            mem_bandwidth_gbs: 1792,
        },
        "sm_90a" => Target {
            name: "sm_90a".into(),
            arch: Arch::Sm90a,
            device: "NVIDIA H200 (GH100)".into(),
            gpu_memory: 143_771 * MIB,
            sm_count: 132,
            smem_per_block: 232_448,
            mem_bandwidth_gbs: 4800,
        },
        other => {
            return Err(CompileError::Option {
                option: "--target".into(),
                message: format!("unknown target {other:?}; choose one of {}", TARGET_NAMES.join(", ")),
            })
        }
    })
}

/// Memory kept free per GPU for what kiln does not plan itself: the CUDA context (~0.5 GiB),
/// NCCL buffers and channels (~1 GiB), module images and graph executables (~0.5 GiB) and
/// allocator slack (~1 GiB). The CPU backend needs none of these.
pub fn default_headroom(target: &Target) -> u64 {
    match target.arch {
        Arch::Cpu => 256 * MIB,
        Arch::Sm120a | Arch::Sm90a => 3 * GIB,
    }
}

/// Parses `96GB`, `40GiB`, `512MiB`, `1.5TB`, or plain bytes. GB/MB are decimal, GiB/MiB binary.
pub fn parse_bytes(option: &str, text: &str) -> Result<u64, CompileError> {
    let t = text.trim();
    let split = t.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let scale: f64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "k" | "kb" => 1e3,
        "kib" => 1024.0,
        "m" | "mb" => 1e6,
        "mib" => MIB as f64,
        "g" | "gb" => 1e9,
        "gib" => GIB as f64,
        "t" | "tb" => 1e12,
        "tib" => (GIB * 1024) as f64,
        _ => f64::NAN,
    };
    match num.parse::<f64>() {
        Ok(n) if scale.is_finite() && n >= 0.0 => Ok((n * scale) as u64),
        _ => Err(CompileError::Option {
            option: option.into(),
            message: format!("{text:?} is not a size; write e.g. 96GB, 40GiB or 512MiB"),
        }),
    }
}
