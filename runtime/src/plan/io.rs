//! `plan.bin`: magic, format version (u32 LE), the SHA-256 of the body, then the body (bincode 2).
//! The checksum is checked before anything is decoded, so a flipped bit is refused instead of
//! running with different numbers; decoding is also bounded (a corrupt length that slipped
//! through cannot ask for more memory than a small multiple of the file).

use super::{Plan, FORMAT_VERSION};
use sha2::{Digest, Sha256};
use std::io::Write;
use std::path::{Path, PathBuf};

pub const PLAN_FILE: &str = "plan.bin";
const MAGIC: &[u8; 8] = b"KILNPLAN";
/// Magic, version, checksum.
const HEADER: usize = 8 + 4 + 32;

/// What every integrity error tells the user to do.
pub const RECOMPILE: &str = "the artifact is corrupt or from another kiln version: recompile it with `kiln compile`";

#[derive(Debug, thiserror::Error)]
pub enum PlanError {
    #[error("{path}: {error}")]
    Io { path: PathBuf, error: std::io::Error },
    #[error("{path}: not a kiln plan (bad magic bytes); expected a file written by `kiln compile`")]
    NotAPlan { path: PathBuf },
    #[error(
        "{path}: plan format version {found}, this kiln reads version {expected}; recompile the \
         checkpoint with this kiln (`kiln compile`)"
    )]
    Version { path: PathBuf, found: u32, expected: u32 },
    #[error("{path}: {message}; {RECOMPILE}")]
    Corrupt { path: PathBuf, message: String },
}

fn bincode_config() -> bincode::config::Configuration {
    bincode::config::standard()
}

/// Decodes with a cap on what collections may claim: the smallest power of two of at least 64
/// times the body's length (a decoded plan takes a few times its varint-encoded size).
fn decode_bounded(body: &[u8]) -> Result<(Plan, usize), bincode::error::DecodeError> {
    macro_rules! with_limit {
        ($($bits:literal),*) => {{
            let need = (body.len() as u64).saturating_mul(64).max(1 << 20);
            $(if need <= 1u64 << $bits {
                return bincode::serde::decode_from_slice(body, bincode_config().with_limit::<{ 1usize << $bits }>());
            })*
            Err(bincode::error::DecodeError::LimitExceeded)
        }};
    }
    with_limit!(20, 22, 24, 26, 28, 30, 32, 34, 36)
}

/// Serialise `plan` into `dir/plan.bin`: magic, format version (u32 LE), then bincode 2.
pub fn write_plan(dir: &Path, plan: &Plan) -> Result<(), PlanError> {
    let path = dir.join(PLAN_FILE);
    let body = bincode::serde::encode_to_vec(plan, bincode_config())
        .map_err(|e| PlanError::Corrupt { path: path.clone(), message: e.to_string() })?;
    let io = |error| PlanError::Io { path: path.clone(), error };
    let mut file = std::fs::File::create(&path).map_err(io)?;
    file.write_all(MAGIC).map_err(io)?;
    file.write_all(&plan.format_version.to_le_bytes()).map_err(io)?;
    file.write_all(&Sha256::digest(&body)).map_err(io)?;
    file.write_all(&body).map_err(io)?;
    Ok(())
}

/// Load `dir/plan.bin`, refusing other format versions before decoding anything else.
pub fn read_plan(dir: &Path) -> Result<Plan, PlanError> {
    let path = dir.join(PLAN_FILE);
    let bytes = std::fs::read(&path).map_err(|error| PlanError::Io { path: path.clone(), error })?;
    decode_plan(path, &bytes)
}

/// Checks and decodes the bytes of a plan.bin (`path` names it in errors). Never panics and
/// never allocates much more than the bytes could hold, whatever they are.
pub fn decode_plan(path: PathBuf, bytes: &[u8]) -> Result<Plan, PlanError> {
    if bytes.len() < 12 || &bytes[..8] != MAGIC {
        return Err(PlanError::NotAPlan { path });
    }
    let found = u32::from_le_bytes(bytes[8..12].try_into().expect("4 bytes"));
    if found != FORMAT_VERSION {
        return Err(PlanError::Version { path, found, expected: FORMAT_VERSION });
    }
    if bytes.len() < HEADER {
        return Err(PlanError::Corrupt { path, message: format!("{} bytes, shorter than the plan header", bytes.len()) });
    }
    let body = &bytes[HEADER..];
    if Sha256::digest(body)[..] != bytes[12..HEADER] {
        return Err(PlanError::Corrupt { path, message: "the plan's contents do not match its checksum".into() });
    }
    let (plan, used) = decode_bounded(body).map_err(|e| PlanError::Corrupt { path: path.clone(), message: format!("undecodable plan ({e})") })?;
    if used != body.len() {
        return Err(PlanError::Corrupt { path, message: "trailing bytes after the plan".into() });
    }
    if plan.format_version != found {
        return Err(PlanError::Corrupt { path, message: format!("header says format {found}, the plan {}", plan.format_version) });
    }
    Ok(plan)
}
