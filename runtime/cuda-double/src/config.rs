//! The simulated machine, read from the environment at `cuInit`.
//!
//! * `KILN_DOUBLE_GPUS` — GPU count (default 8; 0 makes `cuInit` report no device).
//! * `KILN_DOUBLE_ARCH` — `sm_120a` (RTX PRO 6000 Blackwell, CC 12.0, default) or `sm_90a`
//!   (H200, CC 9.0); sets the defaults below.
//! * `KILN_DOUBLE_SMS`, `KILN_DOUBLE_MEMORY` (bytes, or `96GiB`, `512MiB`, ...) — override.
//! * `KILN_DOUBLE_CONTEXT_MEMORY` — what a context takes from each GPU (default 512 MiB).
//! * `KILN_DOUBLE_DRIVER_VERSION` — `cuDriverGetVersion` (default 12090, CUDA 12.9).
//! * `KILN_DOUBLE_P2P` — `ok` (peer copies land), `drop` (peer access is granted but peer
//!   writes are silently lost, as on some VMs) or `off` (no peer access).
//! * `KILN_DOUBLE_NCCL_TIMEOUT_S` — how long a collective waits for the other ranks before it
//!   fails (real NCCL would hang; default 120).
//! * `KILN_DOUBLE_PROFILE=1` — when GPU 0's context is destroyed, print where the emulated
//!   kernel time went (per kernel entry).
//! * `KILN_DOUBLE_FAULT_AT_LAUNCH` — fault injection for tests: the N-th kernel the process
//!   executes (counting from 1, on any GPU) fails with `CUDA_ERROR_ILLEGAL_ADDRESS`.

use std::time::Duration;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum P2p {
    Ok,
    Drop,
    Off,
}

#[derive(Debug, Clone)]
pub struct Config {
    pub gpus: usize,
    pub name: String,
    /// Compute capability (major, minor).
    pub cc: (i32, i32),
    pub sms: i32,
    pub memory: u64,
    pub smem_optin: i32,
    pub l2_bytes: i32,
    pub context_memory: u64,
    pub driver_version: i32,
    pub p2p: P2p,
    pub nccl_timeout: Duration,
    pub fault_at_launch: Option<u64>,
    pub profile: bool,
}

const MIB: u64 = 1 << 20;

fn var(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.trim().is_empty())
}

fn bytes(name: &str, text: &str) -> Result<u64, String> {
    let t = text.trim();
    let split = t.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let scale = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "kib" => 1024.0,
        "mib" => MIB as f64,
        "gib" => (1u64 << 30) as f64,
        "kb" => 1e3,
        "mb" => 1e6,
        "gb" => 1e9,
        _ => return Err(format!("{name}={text}: expected bytes, e.g. 96GiB or 512MiB")),
    };
    num.parse::<f64>().map(|n| (n * scale) as u64).map_err(|_| format!("{name}={text}: expected bytes, e.g. 96GiB or 512MiB"))
}

fn int<T: std::str::FromStr>(name: &str, text: &str) -> Result<T, String> {
    text.trim().parse().map_err(|_| format!("{name}={text}: expected an integer"))
}

impl Config {
    pub fn from_env() -> Result<Config, String> {
        let arch = var("KILN_DOUBLE_ARCH").unwrap_or_else(|| "sm_120a".into());
        let rtx_pro_6000 = Config {
            gpus: 8,
            name: "NVIDIA RTX PRO 6000 Blackwell Workstation Edition (kiln driver double)".into(),
            cc: (12, 0),
            sms: 188,
            memory: 97_887 * MIB,
            smem_optin: 101_376,
            l2_bytes: 128 << 20,
            context_memory: 512 * MIB,
            driver_version: 12090,
            p2p: P2p::Ok,
            nccl_timeout: Duration::from_secs(120),
            fault_at_launch: None,
            profile: false,
        };
        let mut c = match arch.as_str() {
            "sm_120a" => rtx_pro_6000,
            "sm_90a" => Config {
                name: "NVIDIA H200 (kiln driver double)".into(),
                cc: (9, 0),
                sms: 132,
                memory: 143_771 * MIB,
                smem_optin: 232_448,
                l2_bytes: 60 << 20,
                ..rtx_pro_6000
            },
            other => return Err(format!("KILN_DOUBLE_ARCH={other}: expected sm_120a or sm_90a")),
        };
        if let Some(v) = var("KILN_DOUBLE_GPUS") {
            c.gpus = int("KILN_DOUBLE_GPUS", &v)?;
            if c.gpus > 64 {
                return Err(format!("KILN_DOUBLE_GPUS={v}: at most 64"));
            }
        }
        if let Some(v) = var("KILN_DOUBLE_SMS") {
            c.sms = int("KILN_DOUBLE_SMS", &v)?;
        }
        if let Some(v) = var("KILN_DOUBLE_MEMORY") {
            c.memory = bytes("KILN_DOUBLE_MEMORY", &v)?;
        }
        if let Some(v) = var("KILN_DOUBLE_CONTEXT_MEMORY") {
            c.context_memory = bytes("KILN_DOUBLE_CONTEXT_MEMORY", &v)?;
        }
        if let Some(v) = var("KILN_DOUBLE_DRIVER_VERSION") {
            c.driver_version = int("KILN_DOUBLE_DRIVER_VERSION", &v)?;
        }
        if let Some(v) = var("KILN_DOUBLE_P2P") {
            c.p2p = match v.as_str() {
                "ok" => P2p::Ok,
                "drop" => P2p::Drop,
                "off" => P2p::Off,
                _ => return Err(format!("KILN_DOUBLE_P2P={v}: expected ok, drop or off")),
            };
        }
        if let Some(v) = var("KILN_DOUBLE_NCCL_TIMEOUT_S") {
            c.nccl_timeout = Duration::from_secs_f64(v.trim().parse::<f64>().map_err(|_| format!("KILN_DOUBLE_NCCL_TIMEOUT_S={v}: expected seconds"))?);
        }
        c.profile = var("KILN_DOUBLE_PROFILE").is_some_and(|v| v != "0");
        if let Some(v) = var("KILN_DOUBLE_FAULT_AT_LAUNCH") {
            c.fault_at_launch = Some(int("KILN_DOUBLE_FAULT_AT_LAUNCH", &v)?);
        }
        Ok(c)
    }

    /// The PTX `.target` the devices run (`sm_120a` or `sm_90a`).
    pub fn ptx_target(&self) -> String {
        format!("sm_{}{}a", self.cc.0, self.cc.1)
    }
}
