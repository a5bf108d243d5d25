//! Assembling: every kernel of the plan goes through NVIDIA's ptxas when it is found
//! (`KILN_PTXAS`, then `PATH`, then the `nvidia-cuda-nvcc-cu12` wheel in Python's
//! site-packages). Registers, spills, stack and static shared memory from `ptxas -v` go into the
//! plan; a kernel that spills, needs more than 255 registers or exceeds the shared-memory budget
//! fails the compile.

use super::lower::SMEM_LIMIT;
use crate::CompileError;
use kiln_runtime::plan::{Arch, Plan, PtxArch, Resources};
use std::path::{Path, PathBuf};
use std::process::Command;

fn runs(p: &Path) -> bool {
    Command::new(p).arg("--version").output().map(|o| o.status.success()).unwrap_or(false)
}

/// Where ptxas is: `KILN_PTXAS`, `PATH`, or the pip wheel in a Python's site-packages.
pub fn find_ptxas() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("KILN_PTXAS") {
        let p = PathBuf::from(p);
        return runs(&p).then_some(p);
    }
    if let Some(path) = std::env::var_os("PATH") {
        for dir in std::env::split_paths(&path) {
            let p = dir.join("ptxas");
            if p.is_file() && runs(&p) {
                return Some(p);
            }
        }
    }
    let mut pythons = Vec::new();
    if let Some(v) = std::env::var_os("VIRTUAL_ENV") {
        pythons.push(PathBuf::from(v).join("bin/python"));
    }
    pythons.push("python3".into());
    let script = "import site, sys\nfor p in site.getsitepackages() + [site.getusersitepackages()] + sys.path: print(p)";
    for py in pythons {
        let Ok(o) = Command::new(&py).args(["-c", script]).output() else { continue };
        for dir in String::from_utf8_lossy(&o.stdout).lines() {
            for rel in ["nvidia/cuda_nvcc/bin/ptxas", "nvidia/cu13/bin/ptxas"] {
                let p = Path::new(dir).join(rel);
                if p.is_file() && runs(&p) {
                    return Some(p);
                }
            }
        }
    }
    None
}

/// A kernel's cubin, named like its PTX file.
pub struct Cubin {
    pub name: String,
    pub bytes: Vec<u8>,
}

/// Assembles every kernel with `ptxas` for the plan's target; records resources in the plan.
pub fn assemble(plan: &mut Plan, ptxas: &Path) -> Result<Vec<Cubin>, CompileError> {
    let arch = match plan.target.arch {
        Arch::Cpu => return Ok(Vec::new()),
        Arch::Sm120a => PtxArch::Sm120a,
        Arch::Sm90a => PtxArch::Sm90a,
    };
    let smem_limit = SMEM_LIMIT.min(plan.target.smem_per_block);
    let dir = std::env::temp_dir().join(format!("kiln-ptxas-{}-{}", std::process::id(), unique()));
    std::fs::create_dir_all(&dir).map_err(CompileError::io(&dir))?;
    let results: Vec<Result<(Resources, Vec<u8>), CompileError>> = std::thread::scope(|s| {
        let threads = std::thread::available_parallelism().map_or(2, |n| n.get()).min(8);
        let chunk = plan.kernels.len().div_ceil(threads).max(1);
        let handles: Vec<_> = plan
            .kernels
            .chunks(chunk)
            .map(|ks| {
                let dir = &dir;
                s.spawn(move || ks.iter().map(|k| run_one(ptxas, dir, &k.name, &k.ptx, arch)).collect::<Vec<_>>())
            })
            .collect();
        handles.into_iter().flat_map(|h| h.join().expect("ptxas thread")).collect()
    });
    let _ = std::fs::remove_dir_all(&dir);
    // The largest dynamic shared memory any launch of each kernel asks for.
    let mut dynamic = vec![0u32; plan.kernels.len()];
    for l in plan.programs.iter().flat_map(|p| &p.steps).flat_map(|s| &s.launches) {
        let d = &mut dynamic[l.kernel.0 as usize];
        *d = (*d).max(l.smem_dynamic);
    }
    let mut cubins = Vec::new();
    for ((k, r), dynamic) in plan.kernels.iter_mut().zip(results).zip(dynamic) {
        let (res, bytes) = r?;
        let fail = |message: String| CompileError::Kernel { kernel: k.name.clone(), message };
        if res.spill_store_bytes > 0 || res.spill_load_bytes > 0 {
            return Err(fail(format!("spills ({} B stores, {} B loads)", res.spill_store_bytes, res.spill_load_bytes)));
        }
        if res.registers > 255 {
            return Err(fail(format!("needs {} registers (max 255)", res.registers)));
        }
        if res.smem_static_bytes + dynamic > smem_limit {
            return Err(fail(format!("uses {} B static + {dynamic} B dynamic shared memory (limit {smem_limit} B)", res.smem_static_bytes)));
        }
        k.resources = Some(res);
        cubins.push(Cubin { name: k.name.clone(), bytes });
    }
    Ok(cubins)
}

fn unique() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static N: AtomicU64 = AtomicU64::new(0);
    N.fetch_add(1, Ordering::Relaxed)
}

fn run_one(ptxas: &Path, dir: &Path, name: &str, ptx: &str, arch: PtxArch) -> Result<(Resources, Vec<u8>), CompileError> {
    let src = dir.join(format!("{name}.ptx"));
    let out = dir.join(format!("{name}.cubin"));
    std::fs::write(&src, ptx).map_err(CompileError::io(&src))?;
    let o = Command::new(ptxas)
        .arg(format!("-arch={}", arch.name()))
        .args(["-v", "--warn-on-spills"])
        .arg(&src)
        .arg("-o")
        .arg(&out)
        .output()
        .map_err(CompileError::io(ptxas))?;
    let log = format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
    if !o.status.success() {
        return Err(CompileError::Kernel { kernel: name.into(), message: format!("ptxas failed (a kiln bug):\n{log}") });
    }
    let bytes = std::fs::read(&out).map_err(CompileError::io(&out))?;
    let res = parse_ptxas_log(&log, arch).ok_or_else(|| CompileError::Kernel { kernel: name.into(), message: format!("cannot read ptxas -v output:\n{log}") })?;
    Ok((res, bytes))
}

/// Reads `ptxas -v` output (one entry function).
pub fn parse_ptxas_log(log: &str, arch: PtxArch) -> Option<Resources> {
    let num_before = |line: &str, unit: &str| -> Option<u32> {
        let at = line.find(unit)?;
        line[..at].split_whitespace().last()?.parse().ok()
    };
    let mut r = Resources { arch, registers: 0, spill_store_bytes: 0, spill_load_bytes: 0, stack_bytes: 0, smem_static_bytes: 0 };
    let mut seen = false;
    for line in log.lines() {
        if line.contains("bytes stack frame") {
            r.stack_bytes = num_before(line, "bytes stack frame")?;
            r.spill_store_bytes = num_before(line, "bytes spill stores")?;
            r.spill_load_bytes = num_before(line, "bytes spill loads")?;
        }
        if line.contains("Used") && line.contains("registers") {
            r.registers = num_before(line, "registers")?;
            r.smem_static_bytes = num_before(line, "bytes smem").unwrap_or(0);
            seen = true;
        }
    }
    seen.then_some(r)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_ptxas_verbose_output() {
        let log = "ptxas info    : 0 bytes gmem\nptxas info    : Compiling entry function 'k' for 'sm_120a'\nptxas info    : Function properties for k\n    0 bytes stack frame, 8 bytes spill stores, 4 bytes spill loads\nptxas info    : Used 235 registers, used 1 barriers, 18432 bytes smem\n";
        let r = parse_ptxas_log(log, PtxArch::Sm120a).unwrap();
        assert_eq!((r.registers, r.spill_store_bytes, r.spill_load_bytes, r.smem_static_bytes), (235, 8, 4, 18432));
    }
}
