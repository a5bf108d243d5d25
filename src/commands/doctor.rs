use anyhow::bail;
use kiln_runtime::cuda::hardware::{self, Machine};
use kiln_runtime::cuda::p2p::{self, PeerResult};
use kiln_runtime::plan::read_plan;
use serde_json::{json, Value};
use std::io::Write;
use std::path::PathBuf;

/// Check this machine's GPUs, and whether it can run an artifact.
///
/// Reports the CUDA driver (the CUDA version it supports), NCCL, every GPU (name, compute
/// capability, SMs, memory, PCI address and PCIe link), and a peer-to-peer write-and-verify
/// probe between every GPU pair: 1 MiB is copied from one GPU into the other and read back,
/// because the capability bit alone can lie (VMs, IOMMU/ACS setups drop peer writes); `--backend
/// cuda` runs the same probe at start-up and uses its one-shot P2P all-reduce only where every
/// pair passes (`KILN_P2P=off`: NCCL only). Given an
/// artifact, says whether this machine can run it and, if not, why (GPU count, compute
/// capability, memory, driver version). Exits non-zero when there is no usable GPU, a probe
/// lost data, or the artifact cannot run here.
#[derive(clap::Args)]
pub struct Args {
    /// Artifact directory to check against this machine.
    artifact: Option<PathBuf>,
    /// Print one JSON object instead of the report.
    #[arg(long)]
    json: bool,
    /// Skip the P2P probe.
    #[arg(long)]
    no_p2p: bool,
}

fn gib(b: u64) -> String {
    format!("{:.2} GiB", b as f64 / (1u64 << 30) as f64)
}

/// The PCIe link from sysfs (`Gen5 x16 (max Gen5 x16)`), when the machine exposes it.
fn pcie_link(bus_id: &str) -> Option<String> {
    let dir = PathBuf::from("/sys/bus/pci/devices").join(bus_id.to_ascii_lowercase());
    let read = |f: &str| std::fs::read_to_string(dir.join(f)).ok().map(|s| s.trim().to_string());
    let gen = |speed: &str| match speed.split_whitespace().next().and_then(|v| v.parse::<f64>().ok()) {
        Some(v) if v >= 60.0 => "Gen6".to_string(),
        Some(v) if v >= 32.0 => "Gen5".to_string(),
        Some(v) if v >= 16.0 => "Gen4".to_string(),
        Some(v) if v >= 8.0 => "Gen3".to_string(),
        _ => speed.to_string(),
    };
    let (speed, width) = (read("current_link_speed")?, read("current_link_width")?);
    let max = match (read("max_link_speed"), read("max_link_width")) {
        (Some(s), Some(w)) => format!(" (max {} x{w})", gen(&s)),
        _ => String::new(),
    };
    Some(format!("{} x{width}{max}", gen(&speed)))
}

pub fn run(a: Args) -> anyhow::Result<()> {
    let machine: Result<Machine, String> = hardware::probe().map_err(|e| e.to_string());
    let plan = match &a.artifact {
        Some(dir) => Some(read_plan(dir).map_err(|e| anyhow::anyhow!("{}: {e}", dir.display()))?),
        None => None,
    };
    let mut problems: Vec<String> = Vec::new();
    let mut report = json!({});
    let mut text = String::from("kiln doctor\n");
    match &machine {
        Err(e) => {
            problems.push(e.clone());
            text += &format!("driver: none: {e}\n");
            report["driver"] = Value::Null;
        }
        Ok(m) => {
            let cuda = format!("{}.{}", m.driver_version / 1000, m.driver_version % 1000 / 10);
            text += &format!("driver: supports CUDA {cuda} (cuDriverGetVersion {})\n", m.driver_version);
            report["driver"] = json!({"cuda_version": cuda, "version": m.driver_version});
            let nccl = hardware::nccl_version();
            text += &format!("NCCL: {}\n", nccl.as_deref().unwrap_or("not found (libnccl.so; needed for more than one GPU)"));
            report["nccl_version"] = json!(nccl);
            text += &format!("GPUs: {}\n", m.gpus.len());
            if m.gpus.is_empty() {
                problems.push("the driver reports no GPU".into());
            }
            let mut gpus = Vec::new();
            for g in &m.gpus {
                let link = pcie_link(&g.pci_bus_id);
                text += &format!(
                    "  GPU {}: {}; compute capability {}.{}, {} SMs, {}, PCI {}, link {}\n",
                    g.ordinal,
                    g.name,
                    g.cc.0,
                    g.cc.1,
                    g.sms,
                    gib(g.memory),
                    g.pci_bus_id,
                    link.as_deref().unwrap_or("unknown (no sysfs entry)")
                );
                gpus.push(json!({"index": g.ordinal, "name": g.name, "compute_capability": [g.cc.0, g.cc.1], "sms": g.sms,
                    "memory_bytes": g.memory, "pci_bus_id": g.pci_bus_id, "pcie_link": link}));
            }
            report["gpus"] = json!(gpus);
            if !a.no_p2p && m.gpus.len() > 1 {
                text += "P2P (write-and-verify: 1 MiB peer copy per ordered pair, read back):\n";
                match p2p::probe(m.gpus.len()) {
                    Err(e) => {
                        problems.push(format!("the P2P probe failed: {e}"));
                        text += &format!("  probe failed: {e}\n");
                    }
                    Ok(pairs) => {
                        let mut rows = Vec::new();
                        let ok = pairs.iter().filter(|p| p.result == PeerResult::Ok).count();
                        for p in &pairs {
                            let (status, detail) = match &p.result {
                                PeerResult::Ok => ("ok", String::new()),
                                PeerResult::Unsupported => ("unsupported", "the driver reports no peer capability (NCCL goes through host memory)".to_string()),
                                PeerResult::Lost { bad } => ("lost", format!("peer access granted but {bad} of {} bytes did not arrive", 1 << 20)),
                                PeerResult::Error(e) => ("error", e.clone()),
                            };
                            if status != "ok" {
                                text += &format!("  GPU {} -> GPU {}: {status}{}\n", p.from, p.to, if detail.is_empty() { String::new() } else { format!(": {detail}") });
                            }
                            rows.push(json!({"from": p.from, "to": p.to, "result": status, "detail": detail}));
                        }
                        let lost = pairs.iter().filter(|p| matches!(p.result, PeerResult::Lost { .. } | PeerResult::Error(_))).count();
                        text += &format!("  {ok} of {} pairs ok\n", pairs.len());
                        if lost > 0 {
                            problems.push(format!(
                                "{lost} GPU pair(s) report peer access but lose peer writes: NCCL would hang or corrupt data; run with NCCL_P2P_DISABLE=1 or fix the host (iommu=pt / ACS, see the P2P notes in README)"
                            ));
                        }
                        report["p2p"] = json!(rows);
                    }
                }
            }
        }
    }
    if let (Some(plan), Some(dir)) = (&plan, &a.artifact) {
        let reasons = match &machine {
            Ok(m) => hardware::incompatibilities(plan, m),
            Err(e) => vec![e.clone()],
        };
        let needs = format!(
            "{} plan, tensor parallel {}, {} per GPU",
            plan.target.name,
            plan.ranks(),
            gib(plan.memory.used())
        );
        if reasons.is_empty() {
            text += &format!("artifact {}: {needs}: this machine can run it\n", dir.display());
        } else {
            text += &format!("artifact {}: {needs}: this machine cannot run it:\n", dir.display());
            for r in &reasons {
                text += &format!("  - {r}\n");
            }
            problems.push(format!("{} cannot run here", dir.display()));
        }
        report["artifact"] = json!({"path": dir, "target": plan.target.name, "ranks": plan.ranks(), "memory_per_gpu": plan.memory.used(), "runnable": reasons.is_empty(), "reasons": reasons});
    }
    report["problems"] = json!(problems);
    // A closed pipe (`kiln doctor | head`) is not an error of the doctor's.
    let mut out = std::io::stdout().lock();
    let _ = if a.json { writeln!(out, "{}", serde_json::to_string_pretty(&report)?) } else { write!(out, "{text}") };
    if !problems.is_empty() {
        bail!("{}", problems.join("; "));
    }
    Ok(())
}
