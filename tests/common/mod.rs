//! Helpers shared by the kernel tests: random data, BF16/F32 bytes, the comparison under `kiln
//! verify`'s tolerances, and ptxas assembly of rendered instances for the target they name
//! (`.target sm_120a` or `sm_90a`).
#![allow(dead_code, unused_imports)]

pub mod serve;

use kiln_compiler::passes::assemble::{find_ptxas, parse_ptxas_log};
use kiln_runtime::numerics::round_bf16;
use kiln_runtime::plan::{DType, PtxArch, Resources};
use kiln_runtime::rng::Rng;
use kiln_runtime::verify::{compare, Values};
use std::path::{Path, PathBuf};

/// Normal samples times `scale`, rounded to BF16 when the buffer is BF16.
pub fn randn(rng: &mut Rng, n: usize, scale: f64, bf16: bool) -> Vec<f32> {
    (0..n).map(|_| (rng.normal() * scale) as f32).map(|v| if bf16 { round_bf16(v) } else { v }).collect()
}

pub use kiln_runtime::numerics::{bytes_floats as floats, float_bytes as bytes};

/// Asserts `emu` equals `cpu` under `kiln verify`'s tolerance for the dtype.
pub fn check(what: &str, bf16: bool, emu: &[f32], cpu: &[f32]) {
    let c = compare(if bf16 { DType::BF16 } else { DType::F32 }, &Values::F32(emu.to_vec()), &Values::F32(cpu.to_vec()));
    eprintln!("{what}: max abs {:.3e}, max rel {:.3e} over {} values", c.max_abs, c.max_rel, c.elements);
    assert!(c.ok(), "{what}: {} of {} values beyond tolerance (max abs {:e}, max rel {:e})", c.beyond + c.non_finite, c.elements, c.max_abs, c.max_rel);
}

/// ptxas for the assembly checks, or None (with a note) where it is not installed; CI must have it.
pub fn ptxas(what: &str) -> Option<PathBuf> {
    let found = find_ptxas();
    if found.is_none() {
        assert!(std::env::var_os("CI").is_none(), "CI must provide ptxas (scripts/test.sh installs the wheel)");
        eprintln!("note: ptxas not found (set KILN_PTXAS or `pip install nvidia-cuda-nvcc-cu12==12.9.86`); skipping the assembly check of {what}");
    }
    found
}

/// The target a rendered instance names in its `.target` line.
pub fn target_of(ptx: &str) -> PtxArch {
    match ptx.lines().find_map(|l| l.trim().strip_prefix(".target ")).map(str::trim) {
        Some("sm_90a") => PtxArch::Sm90a,
        Some("sm_120a") => PtxArch::Sm120a,
        other => panic!("unexpected .target {other:?}"),
    }
}

/// `ptxas -arch=<its .target> -v` of one rendered instance: its resources, or ptxas' log on
/// failure.
pub fn assemble(ptxas: &Path, name: &str, ptx: &str) -> Result<Resources, String> {
    let arch = target_of(ptx);
    let dir = std::env::temp_dir().join(format!("kiln-ptxas-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = name.replace(|c: char| !c.is_ascii_alphanumeric() && c != '_', "_");
    let src = dir.join(format!("{file}.ptx"));
    std::fs::write(&src, ptx).unwrap();
    let o = std::process::Command::new(ptxas).args([format!("-arch={}", arch.name()).as_str(), "-v"]).arg(&src).arg("-o").arg(dir.join(format!("{file}.cubin"))).output().unwrap();
    let log = format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
    let _ = std::fs::remove_file(&src);
    let _ = std::fs::remove_file(dir.join(format!("{file}.cubin")));
    if !o.status.success() {
        return Err(format!("ptxas rejected {name}:\n{log}"));
    }
    parse_ptxas_log(&log, arch).ok_or_else(|| format!("{name}: cannot read the ptxas log:\n{log}"))
}

/// Assembles one instance and asserts the budgets: no spills, <= 255 registers, static +
/// `dynamic_smem` shared memory <= 101,376 B.
pub fn assemble_within_budget(ptxas: &Path, name: &str, ptx: &str, dynamic_smem: u32) -> Resources {
    let r = assemble(ptxas, name, ptx).unwrap_or_else(|e| panic!("{e}"));
    eprintln!("{name} ({}): {} registers, {} + {} B spilled, {} B static + {dynamic_smem} B dynamic shared memory", r.arch.name(), r.registers, r.spill_store_bytes, r.spill_load_bytes, r.smem_static_bytes);
    assert!(r.spill_store_bytes == 0 && r.spill_load_bytes == 0, "{name} spills");
    assert!(r.registers <= 255 && r.smem_static_bytes + dynamic_smem <= 101_376, "{name}: {} registers, {} B shared memory", r.registers, r.smem_static_bytes + dynamic_smem);
    r
}

/// One NVFP4 linear of a kernel test: weights of `parts` (rows each, `k` inputs) drawn from `rng`
/// and quantised as ModelOpt does, per-part input scales from the activations' amax (times
/// `1 + 0.37 * part` when `split_scales`, times `scale_mul`), and the CPU's W4A4 output for `x`.
pub struct Nvfp4Linear {
    pub packed: Vec<u8>,
    pub scales: Vec<u8>,
    pub scale_2: Vec<f32>,
    pub input_scale: Vec<f32>,
    /// `[m, N]` (`[m, N/2]` with SiLU-mul).
    pub want: Vec<f32>,
}

#[allow(clippy::too_many_arguments)]
pub fn nvfp4_linear(rng: &mut Rng, x: &[f32], m: usize, k: usize, parts: &[usize], silu: bool, split_scales: bool, scale_mul: f32, out_bf16: bool) -> Nvfp4Linear {
    let (mut packed, mut scales, mut scale_2) = (Vec::new(), Vec::new(), Vec::new());
    for &rows in parts {
        let w = randn(rng, rows * k, 0.05, false);
        let (p, s, g) = kiln_runtime::numerics::quantize_nvfp4(&w, rows, k);
        packed.extend(p);
        scales.extend(s);
        scale_2.push(g);
    }
    let amax = x.iter().fold(0f32, |a, v| a.max(v.abs()));
    let input_scale: Vec<f32> = (0..parts.len()).map(|p| amax / (6.0 * 448.0) * scale_mul * if split_scales { 1.0 + p as f32 * 0.37 } else { 1.0 }).collect();
    let cols = if silu { parts[0] } else { parts.iter().sum() };
    let mut want = vec![0f32; m * cols];
    let epilogue = if silu { kiln_runtime::plan::Epilogue::SiluMul } else { kiln_runtime::plan::Epilogue::None };
    kiln_runtime::cpu::reference::linear_nvfp4(x, m, &packed, &scales, k, parts, &scale_2, &input_scale, epilogue, out_bf16, &mut want);
    Nvfp4Linear { packed, scales, scale_2, input_scale, want }
}

/// A safetensors file's JSON header and the length of its data region.
pub fn read_shard_header(path: &Path) -> (serde_json::Value, u64) {
    use std::io::Read;
    let mut file = std::fs::File::open(path).unwrap();
    let len = file.metadata().unwrap().len();
    let mut head = [0u8; 8];
    file.read_exact(&mut head).unwrap();
    let n = u64::from_le_bytes(head);
    let mut json = vec![0u8; n as usize];
    file.read_exact(&mut json).unwrap();
    (serde_json::from_slice(&json).unwrap(), len - 8 - n)
}

/// Writes `header` as a safetensors file whose `data_len` data bytes are a sparse hole (the
/// compiler and header checks read headers only).
pub fn write_header_only_shard(path: &Path, header: &serde_json::Value, data_len: u64) {
    let text = serde_json::to_vec(header).unwrap();
    let mut bytes = (text.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(&text);
    let _ = std::fs::remove_file(path); // may be a hard link of the original
    std::fs::write(path, &bytes).unwrap();
    std::fs::OpenOptions::new().write(true).open(path).unwrap().set_len(bytes.len() as u64 + data_len).unwrap();
}
