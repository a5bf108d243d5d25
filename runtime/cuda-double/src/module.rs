//! Module loading as the driver does it, for a driver that executes PTX: a cubin is checked
//! (ELF machine, SM version and the arch-specific flag against the device) and its ptxas
//! resource records (registers, stack frame) are read, then the PTX written beside it
//! (`<stem>.ptx`, as kiln's artifacts hold) is what runs. PTX text is "JIT-compiled": its
//! `.version` must be one the driver supports and its `.target` must run on the device.

use crate::config::Config;
use crate::status::*;
use kiln_emu::versions::{driver_for_ptx, ptx_version};
use std::collections::HashMap;
use std::path::Path;
use std::sync::atomic::AtomicI32;
use std::sync::Arc;

pub struct LoadedModule {
    pub device: usize,
    pub ptx: kiln_emu::Module,
    /// Per entry: (registers, local bytes per thread) from the cubin (absent for JIT-ed PTX).
    pub resources: HashMap<String, (i32, i32)>,
    pub virtual_arch: i32,
}

pub struct Function {
    pub module: Arc<LoadedModule>,
    pub entry: String,
    pub max_dynamic_smem: AtomicI32,
}

const EM_CUDA: u16 = 190;
const EIATTR_FRAME_SIZE: u8 = 0x11;
const EIATTR_REGCOUNT: u8 = 0x2f;

fn complain(code: CuResult, message: String) -> CuResult {
    eprintln!("kiln-cuda-double: {message}");
    code
}

/// Loads PTX text for the device (`source` names it in messages).
pub fn load_ptx(cfg: &Config, device: usize, text: &str, source: &str) -> Result<LoadedModule, CuResult> {
    let (major, minor) = ptx_version(text).ok_or_else(|| complain(INVALID_PTX, format!("{source}: no `.version` directive")))?;
    let need = driver_for_ptx(major, minor);
    if need > cfg.driver_version {
        return Err(complain(
            UNSUPPORTED_PTX_VERSION,
            format!("{source}: PTX ISA {major}.{minor} needs a driver for CUDA {}.{}, this one is {}.{}", need / 1000, need % 1000 / 10, cfg.driver_version / 1000, cfg.driver_version % 1000 / 10),
        ));
    }
    let target = text.lines().find_map(|l| l.trim().strip_prefix(".target")).map(|t| t.split(',').next().unwrap_or("").trim().to_string()).unwrap_or_default();
    let sm = sm_of(&target).ok_or_else(|| complain(INVALID_PTX, format!("{source}: no usable `.target` (found {target:?})")))?;
    let device_sm = cfg.cc.0 * 10 + cfg.cc.1;
    let runs = if target.ends_with('a') { sm == device_sm } else { sm <= device_sm };
    if !runs {
        return Err(complain(INVALID_PTX, format!("{source}: PTX for {target} cannot be compiled for this GPU (compute capability {}.{})", cfg.cc.0, cfg.cc.1)));
    }
    let ptx = kiln_emu::Module::parse(text, source).map_err(|e| complain(INVALID_PTX, format!("{e}")))?;
    Ok(LoadedModule { device, ptx, resources: HashMap::new(), virtual_arch: sm })
}

fn sm_of(target: &str) -> Option<i32> {
    target.strip_prefix("sm_")?.trim_end_matches(['a', 'f']).parse().ok()
}

/// Loads `path`: a cubin (with its PTX beside it) or a PTX file.
pub fn load_file(cfg: &Config, device: usize, path: &Path) -> Result<LoadedModule, CuResult> {
    let bytes = std::fs::read(path).map_err(|e| complain(FILE_NOT_FOUND, format!("{}: {e}", path.display())))?;
    if !bytes.starts_with(b"\x7fELF") {
        let text = String::from_utf8(bytes).map_err(|_| complain(INVALID_IMAGE, format!("{}: neither a cubin nor PTX text", path.display())))?;
        return load_ptx(cfg, device, &text, &path.display().to_string());
    }
    let cubin = Cubin::parse(&bytes).map_err(|m| complain(INVALID_IMAGE, format!("{}: {m}", path.display())))?;
    let device_sm = cfg.cc.0 * 10 + cfg.cc.1;
    let runs = if cubin.arch_specific { cubin.sm == device_sm } else { cubin.sm / 10 == device_sm / 10 && cubin.sm <= device_sm };
    if !runs {
        return Err(complain(
            NO_BINARY_FOR_GPU,
            format!("{}: a cubin for sm_{}{} does not run on compute capability {}.{}", path.display(), cubin.sm, if cubin.arch_specific { "a" } else { "" }, cfg.cc.0, cfg.cc.1),
        ));
    }
    let ptx_path = path.with_extension("ptx");
    let text = std::fs::read_to_string(&ptx_path).map_err(|_| {
        complain(NOT_SUPPORTED, format!("{}: the double executes PTX and finds no {} beside the cubin", path.display(), ptx_path.display()))
    })?;
    let mut m = load_ptx(cfg, device, &text, &ptx_path.display().to_string())?;
    m.resources = cubin.resources;
    Ok(m)
}

/// What the double reads from a cubin.
struct Cubin {
    sm: i32,
    arch_specific: bool,
    resources: HashMap<String, (i32, i32)>,
}

fn u16_at(b: &[u8], o: usize) -> Result<u16, String> {
    b.get(o..o + 2).map(|s| u16::from_le_bytes([s[0], s[1]])).ok_or_else(|| "truncated ELF".to_string())
}

fn u32_at(b: &[u8], o: usize) -> Result<u32, String> {
    b.get(o..o + 4).map(|s| u32::from_le_bytes([s[0], s[1], s[2], s[3]])).ok_or_else(|| "truncated ELF".to_string())
}

fn u64_at(b: &[u8], o: usize) -> Result<u64, String> {
    b.get(o..o + 8).map(|s| u64::from_le_bytes(s.try_into().expect("8 bytes"))).ok_or_else(|| "truncated ELF".to_string())
}

fn cstr(b: &[u8], o: usize) -> String {
    let s = b.get(o..).unwrap_or(&[]);
    String::from_utf8_lossy(&s[..s.iter().position(|&c| c == 0).unwrap_or(s.len())]).into_owned()
}

impl Cubin {
    fn parse(b: &[u8]) -> Result<Cubin, String> {
        if b.len() < 64 || b[4] != 2 {
            return Err("not a 64-bit ELF".into());
        }
        if u16_at(b, 18)? != EM_CUDA {
            return Err(format!("ELF machine {} is not CUDA ({EM_CUDA})", u16_at(b, 18)?));
        }
        let flags = u32_at(b, 48)?;
        // ELF ABI 7 (CUDA 12.8+ toolchains for new targets) keeps the SM in bits 8..16 and the
        // arch-specific flag in bit 3; the older layout has the SM in bits 0..8, flag 0x800.
        let (sm, arch_specific) = if b[7] >= 0x41 { (((flags >> 8) & 0xff) as i32, flags & 0x8 != 0) } else { ((flags & 0xff) as i32, flags & 0x800 != 0) };
        let shoff = u64_at(b, 40)? as usize;
        let (shentsize, shnum, shstrndx) = (u16_at(b, 58)? as usize, u16_at(b, 60)? as usize, u16_at(b, 62)? as usize);
        let sec = |i: usize| -> Result<(u32, u32, usize, usize, u32), String> {
            let o = shoff + i * shentsize;
            Ok((u32_at(b, o)?, u32_at(b, o + 4)?, u64_at(b, o + 24)? as usize, u64_at(b, o + 32)? as usize, u32_at(b, o + 40)?))
        };
        let shstr = sec(shstrndx)?.2;
        let mut symbols: Vec<String> = Vec::new();
        let mut info: Option<(usize, usize)> = None;
        for i in 0..shnum {
            let (name, ty, off, size, link) = sec(i)?;
            let name = cstr(b, shstr + name as usize);
            if ty == 2 {
                let strtab = sec(link as usize)?.2;
                symbols = (0..size / 24).map(|k| u32_at(b, off + k * 24).map(|n| cstr(b, strtab + n as usize))).collect::<Result<_, _>>()?;
            } else if name == ".nv.info" {
                info = Some((off, size));
            }
        }
        let mut resources: HashMap<String, (i32, i32)> = HashMap::new();
        if let Some((off, size)) = info {
            let d = b.get(off..off + size).ok_or("truncated .nv.info")?;
            let mut i = 0;
            while i + 2 <= d.len() {
                let (format, attr) = (d[i], d[i + 1]);
                match format {
                    0x04 => {
                        let n = u16_at(d, i + 2)? as usize;
                        if n == 8 && (attr == EIATTR_REGCOUNT || attr == EIATTR_FRAME_SIZE) {
                            let (sym, value) = (u32_at(d, i + 4)? as usize, u32_at(d, i + 8)? as i32);
                            let entry = resources.entry(symbols.get(sym).cloned().unwrap_or_default()).or_default();
                            if attr == EIATTR_REGCOUNT {
                                entry.0 = value;
                            } else {
                                entry.1 = value;
                            }
                        }
                        i += 4 + n;
                    }
                    0x03 => i += 4,
                    0x02 => i += 4,
                    _ => i += 2,
                }
            }
        }
        Ok(Cubin { sm, arch_specific, resources })
    }
}
