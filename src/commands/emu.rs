use anyhow::{bail, Context};
use kiln_runtime::emu::{launch, BufferId, GlobalMemory, KernelArg, Module};
use std::path::{Path, PathBuf};

/// Run PTX kernels on the CPU emulator (no GPU needed).
#[derive(clap::Args)]
pub struct Args {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(clap::Subcommand)]
enum Cmd {
    Run(RunArgs),
}

/// Execute one kernel of a PTX file and report the global-memory traffic.
///
/// Each buffer argument `buf:PATH` is filled from PATH, passed as a `.u64` device pointer, and
/// written back to `PATH.out` after the run.
#[derive(clap::Args)]
struct RunArgs {
    /// PTX source file.
    file: PathBuf,
    /// Kernel (`.entry`) name.
    #[arg(long)]
    entry: String,
    /// Grid size: X[,Y,Z].
    #[arg(long, default_value = "1")]
    grid: String,
    /// Block size: X[,Y,Z].
    #[arg(long)]
    block: String,
    /// Dynamic shared memory per block, in bytes.
    #[arg(long, default_value_t = 0)]
    smem: u32,
    /// Kernel arguments in `.param` order: buf:PATH, u32:N, u64:N or f32:X.
    #[arg(long = "arg", value_name = "SPEC", num_args = 1.., action = clap::ArgAction::Append)]
    args: Vec<String>,
}

pub fn run(a: Args) -> anyhow::Result<()> {
    match a.cmd {
        Cmd::Run(r) => run_kernel(r),
    }
}

fn dims(what: &str, s: &str) -> anyhow::Result<[u32; 3]> {
    let parts: Vec<&str> = s.split(',').map(str::trim).collect();
    if parts.is_empty() || parts.len() > 3 {
        bail!("--{what} '{s}': expected X[,Y,Z]");
    }
    let mut d = [1u32; 3];
    for (i, p) in parts.iter().enumerate() {
        d[i] = p.parse().ok().filter(|v| *v > 0).with_context(|| format!("--{what} '{s}': '{p}' is not a positive integer"))?;
    }
    Ok(d)
}

fn int<T: TryFrom<u64>>(spec: &str, v: &str) -> anyhow::Result<T> {
    let n = match v.strip_prefix("0x").or_else(|| v.strip_prefix("0X")) {
        Some(h) => u64::from_str_radix(h, 16).ok(),
        None => v.parse::<u64>().ok(),
    };
    n.and_then(|n| T::try_from(n).ok()).with_context(|| format!("--arg '{spec}': '{v}' is not a valid {}", std::any::type_name::<T>()))
}

enum Spec {
    Buf(PathBuf, BufferId),
    Scalar,
}

fn run_kernel(a: RunArgs) -> anyhow::Result<()> {
    let src = std::fs::read_to_string(&a.file).with_context(|| format!("cannot read PTX file {}", a.file.display()))?;
    let module = Module::parse(&src, &a.file.display().to_string())?;
    let grid = dims("grid", &a.grid)?;
    let block = dims("block", &a.block)?;
    let mut global = GlobalMemory::new();
    let mut args = Vec::new();
    let mut specs = Vec::new();
    for spec in &a.args {
        let Some((kind, v)) = spec.split_once(':') else {
            bail!("--arg '{spec}': expected buf:PATH, u32:N, u64:N or f32:X");
        };
        match kind {
            "buf" => {
                let path = PathBuf::from(v);
                let data = std::fs::read(&path).with_context(|| format!("--arg '{spec}': cannot read buffer file {}", path.display()))?;
                let id = global.alloc_bytes(v, &data);
                args.push(KernelArg::U64(global.addr(id)));
                specs.push(Spec::Buf(path, id));
            }
            "u32" => {
                args.push(KernelArg::U32(int(spec, v)?));
                specs.push(Spec::Scalar);
            }
            "u64" => {
                args.push(KernelArg::U64(int(spec, v)?));
                specs.push(Spec::Scalar);
            }
            "f32" => {
                let x: f32 = v.parse().with_context(|| format!("--arg '{spec}': '{v}' is not a number"))?;
                args.push(KernelArg::F32(x));
                specs.push(Spec::Scalar);
            }
            _ => bail!("--arg '{spec}': unknown kind '{kind}' (expected buf, u32, u64 or f32)"),
        }
    }
    let stats = launch(&module, &a.entry, grid, block, a.smem, &args, &mut global)?;
    let c = &stats.counters;
    println!("kernel {}: grid {}x{}x{}, block {}x{}x{}, {} B dynamic shared memory", a.entry, grid[0], grid[1], grid[2], block[0], block[1], block[2], a.smem);
    println!("global memory: {} B read, {} B written", c.global_bytes_read, c.global_bytes_written);
    println!("shared memory: {} B read, {} B written", c.shared_bytes_read, c.shared_bytes_written);
    println!(
        "executed {} thread instructions ({} warp instructions) in {:.3} s ({:.1} M thread instructions/s)",
        c.thread_instructions,
        c.warp_instructions,
        stats.elapsed.as_secs_f64(),
        stats.thread_instructions_per_second() / 1e6
    );
    for s in &specs {
        if let Spec::Buf(path, id) = s {
            let out = out_path(path);
            let data = global.read(*id);
            std::fs::write(&out, &data).with_context(|| format!("cannot write {}", out.display()))?;
            println!("wrote {} ({} B)", out.display(), data.len());
        }
    }
    Ok(())
}

fn out_path(p: &Path) -> PathBuf {
    let mut s = p.as_os_str().to_owned();
    s.push(".out");
    PathBuf::from(s)
}
