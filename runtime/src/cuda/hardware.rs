//! What the machine has, asked of the driver without creating a context: the driver library
//! itself (checked first: cudarc panics when it is missing), the CUDA version the driver
//! supports, each GPU's name, compute capability, SMs, memory and PCI address; and whether a
//! plan can run there, each mismatch named with expected vs found. Shared by the CUDA backend
//! (before it allocates anything) and `kiln doctor`.

use crate::error::RuntimeError;
use crate::plan::{Arch, Plan};
use cudarc::driver::{result, sys};
use kiln_emu::versions::{driver_for_ptx, ptx_version};

/// One GPU as the driver reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Gpu {
    pub ordinal: usize,
    pub name: String,
    /// Compute capability (major, minor).
    pub cc: (i32, i32),
    pub sms: i32,
    pub memory: u64,
    /// `domain:bus:device.function`, as in sysfs.
    pub pci_bus_id: String,
}

/// The driver and its GPUs.
#[derive(Debug, Clone)]
pub struct Machine {
    /// `cuDriverGetVersion`: the newest CUDA version the driver supports (12090 = 12.9).
    pub driver_version: i32,
    pub gpus: Vec<Gpu>,
}

pub fn gpu_error(message: impl Into<String>) -> RuntimeError {
    RuntimeError::Gpu { message: message.into() }
}

/// Formats a driver error with its name, e.g. `CUDA_ERROR_ILLEGAL_ADDRESS (an illegal memory
/// access was encountered)`.
pub fn describe(e: &result::DriverError) -> String {
    let name = e.error_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_else(|_| format!("CUresult {}", e.0 as u32));
    match e.error_string() {
        Ok(s) => format!("{name} ({})", s.to_string_lossy()),
        Err(_) => name,
    }
}

/// `Err` with what the driver said while doing `what`.
pub fn cu<T>(what: impl FnOnce() -> String, r: Result<T, result::DriverError>) -> Result<T, RuntimeError> {
    r.map_err(|e| gpu_error(format!("{}: {}", what(), describe(&e))))
}

/// Fails (never panics) when no CUDA driver library can be loaded.
pub fn require_driver() -> Result<(), RuntimeError> {
    // SAFETY: only tries to dlopen the candidate names.
    if unsafe { sys::is_culib_present() } {
        Ok(())
    } else {
        Err(gpu_error(
            "no CUDA driver: libcuda.so could not be loaded (is the NVIDIA driver installed, and this a machine with a GPU? \
             Without one, run the CPU backend with --backend cpu, or the driver double: scripts/with-cuda-double.sh)",
        ))
    }
}

/// Fails when NCCL (needed for more than one rank) cannot be loaded.
pub fn require_nccl() -> Result<(), RuntimeError> {
    // SAFETY: only tries to dlopen the candidate names.
    if unsafe { cudarc::nccl::sys::is_culib_present() } {
        Ok(())
    } else {
        Err(gpu_error("no NCCL: libnccl.so could not be loaded; a plan with more than one rank needs NCCL (install libnccl2 and make sure libnccl.so is on the library path)"))
    }
}

/// NCCL's version (`2.30.7`), or None when libnccl.so cannot be loaded.
pub fn nccl_version() -> Option<String> {
    require_nccl().ok()?;
    let v = cudarc::nccl::result::get_nccl_version().ok()?;
    Some(format!("{}.{}.{}", v / 10000, v / 100 % 100, v % 100))
}

pub fn driver_version() -> Result<i32, RuntimeError> {
    let mut v = 0;
    // SAFETY: writes one int.
    cu(|| "cuDriverGetVersion".into(), unsafe { sys::cuDriverGetVersion(&mut v) }.result())?;
    Ok(v)
}

/// Asks the driver for every GPU.
pub fn probe() -> Result<Machine, RuntimeError> {
    require_driver()?;
    let driver_version = driver_version()?;
    match result::init() {
        Ok(()) => {}
        Err(e) if e.0 == sys::CUresult::CUDA_ERROR_NO_DEVICE => return Ok(Machine { driver_version, gpus: Vec::new() }),
        Err(e) => return Err(gpu_error(format!("cuInit: {}", describe(&e)))),
    }
    let count = cu(|| "cuDeviceGetCount".into(), result::device::get_count())?;
    let mut gpus = Vec::new();
    for ordinal in 0..count.max(0) as usize {
        let dev = cu(|| format!("cuDeviceGet({ordinal})"), result::device::get(ordinal as i32))?;
        let attr = |a: sys::CUdevice_attribute| cu(|| format!("GPU {ordinal}: cuDeviceGetAttribute({a:?})"), unsafe { result::device::get_attribute(dev, a) });
        let cc = (attr(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?, attr(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?);
        let sms = attr(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?;
        let pci = (attr(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID)?, attr(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_PCI_BUS_ID)?, attr(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID)?);
        // SAFETY: `dev` is a valid device.
        let memory = cu(|| format!("GPU {ordinal}: cuDeviceTotalMem"), unsafe { result::device::total_mem(dev) })? as u64;
        let name = cu(|| format!("GPU {ordinal}: cuDeviceGetName"), result::device::get_name(dev))?;
        gpus.push(Gpu { ordinal, name, cc, sms, memory, pci_bus_id: format!("{:04x}:{:02x}:{:02x}.0", pci.0, pci.1, pci.2) });
    }
    Ok(Machine { driver_version, gpus })
}

/// The compute capability a plan's cubins need (arch-specific targets run on exactly one).
pub fn required_cc(arch: Arch) -> Option<(i32, i32)> {
    match arch {
        Arch::Cpu => None,
        Arch::Sm120a => Some((12, 0)),
        Arch::Sm90a => Some((9, 0)),
    }
}

/// The newest PTX ISA version among the plan's kernels.
pub fn plan_ptx_version(plan: &Plan) -> Option<(u32, u32)> {
    plan.kernels.iter().filter_map(|k| ptx_version(&k.ptx)).max()
}

fn cuda_version(v: i32) -> String {
    format!("{}.{}", v / 1000, v % 1000 / 10)
}

fn gib(b: u64) -> String {
    format!("{:.2} GiB", b as f64 / (1u64 << 30) as f64)
}

/// Why `plan` cannot run on `machine` (empty when it can): one line per mismatch, naming
/// expected vs found.
pub fn incompatibilities(plan: &Plan, machine: &Machine) -> Vec<String> {
    let mut why = kernel_incompatibilities(plan, machine, plan.ranks());
    let ranks = plan.ranks();
    if required_cc(plan.target.arch).is_none() {
        return why;
    }
    if machine.gpus.len() < ranks {
        why.insert(0, format!("the plan needs {ranks} GPU(s) (tensor parallel {ranks}), the driver reports {}", machine.gpus.len()));
    }
    let need_memory = plan.memory.used();
    for g in machine.gpus.iter().take(ranks) {
        if g.memory < need_memory {
            why.push(format!(
                "GPU {} ({}) has {} of memory; the plan needs {} per GPU (weights, workspace, KV cache, RoPE table and {} headroom)",
                g.ordinal,
                g.name,
                gib(g.memory),
                gib(need_memory),
                gib(plan.memory.headroom)
            ));
        }
    }
    why
}

/// Why the plan's kernels cannot run on the first `gpus` GPUs of `machine`: the target
/// (a CPU plan has none), the driver version against the PTX ISA, the compute capability.
pub fn kernel_incompatibilities(plan: &Plan, machine: &Machine, gpus: usize) -> Vec<String> {
    let mut why = Vec::new();
    let Some(cc) = required_cc(plan.target.arch) else {
        why.push(format!("the plan was compiled for {} (the CPU backend); compile for a GPU target (--target sm_120a or sm_90a) to run it on a GPU", plan.target.name));
        return why;
    };
    if let Some((major, minor)) = plan_ptx_version(plan) {
        let need = driver_for_ptx(major, minor);
        if machine.driver_version < need {
            why.push(format!(
                "the plan's PTX is ISA {major}.{minor}, which needs a driver for CUDA {} or newer; this driver supports CUDA {}",
                cuda_version(need),
                cuda_version(machine.driver_version)
            ));
        }
    }
    for g in machine.gpus.iter().take(gpus) {
        if g.cc != cc {
            why.push(format!(
                "GPU {} ({}) has compute capability {}.{}; the plan's {} kernels run only on {}.{}",
                g.ordinal, g.name, g.cc.0, g.cc.1, plan.target.name, cc.0, cc.1
            ));
        }
    }
    why
}

/// [`probe`] + [`incompatibilities`] as one error.
pub fn check(plan: &Plan) -> Result<Machine, RuntimeError> {
    let machine = probe()?;
    let why = incompatibilities(plan, &machine);
    if why.is_empty() {
        Ok(machine)
    } else {
        Err(gpu_error(format!("this machine cannot run the plan:\n  - {}", why.join("\n  - "))))
    }
}
