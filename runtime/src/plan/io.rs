use super::{Plan, FORMAT_VERSION};
use std::io::Write;
use std::path::{Path, PathBuf};

pub const PLAN_FILE: &str = "plan.bin";
const MAGIC: &[u8; 8] = b"KILNPLAN";

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
    #[error("{path}: corrupt plan: {message}")]
    Corrupt { path: PathBuf, message: String },
}

fn bincode_config() -> bincode::config::Configuration {
    bincode::config::standard()
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
    file.write_all(&body).map_err(io)?;
    Ok(())
}

/// Load `dir/plan.bin`, refusing other format versions before decoding anything else.
pub fn read_plan(dir: &Path) -> Result<Plan, PlanError> {
    let path = dir.join(PLAN_FILE);
    let bytes = std::fs::read(&path).map_err(|error| PlanError::Io { path: path.clone(), error })?;
    if bytes.len() < 12 || &bytes[..8] != MAGIC {
        return Err(PlanError::NotAPlan { path });
    }
    let found = u32::from_le_bytes(bytes[8..12].try_into().expect("4 bytes"));
    if found != FORMAT_VERSION {
        return Err(PlanError::Version { path, found, expected: FORMAT_VERSION });
    }
    let (plan, used): (Plan, usize) = bincode::serde::decode_from_slice(&bytes[12..], bincode_config())
        .map_err(|e| PlanError::Corrupt { path: path.clone(), message: e.to_string() })?;
    if used != bytes.len() - 12 {
        return Err(PlanError::Corrupt { path, message: "trailing bytes after the plan".into() });
    }
    Ok(plan)
}
