//! The artifact's other files (kernel cubins and PTX, tokenizer, chat template): the compiler
//! records each one's SHA-256 in `manifest.json` (`files`), and loading checks them, so a damaged
//! cubin or tokenizer is refused by name instead of loading or running wrong.

use super::io::PlanError;
use sha2::{Digest, Sha256};
use std::collections::BTreeMap;
use std::path::Path;

/// The manifest key holding `{relative path: sha256 hex}`.
pub const FILES_KEY: &str = "files";
const MANIFEST: &str = "manifest.json";

pub fn sha256_hex(bytes: &[u8]) -> String {
    Sha256::digest(bytes).iter().map(|b| format!("{b:02x}")).collect()
}

/// Checks every file the manifest lists against its recorded hash. An artifact without a
/// manifest (a plan copied on its own) has nothing to check.
pub fn check_artifact_files(dir: &Path) -> Result<(), PlanError> {
    let manifest = dir.join(MANIFEST);
    let Ok(text) = std::fs::read_to_string(&manifest) else { return Ok(()) };
    let corrupt = |path: &Path, message: String| PlanError::Corrupt { path: path.to_path_buf(), message };
    let json: serde_json::Value = serde_json::from_str(&text).map_err(|e| corrupt(&manifest, format!("not valid JSON ({e})")))?;
    let Some(files) = json.get(FILES_KEY) else { return Ok(()) };
    let files: BTreeMap<String, String> =
        serde_json::from_value(files.clone()).map_err(|e| corrupt(&manifest, format!("`{FILES_KEY}` is not a map of file hashes ({e})")))?;
    for (name, want) in files {
        if name.split(['/', '\\']).any(|part| part == ".." || part.is_empty()) {
            return Err(corrupt(&manifest, format!("`{FILES_KEY}` names `{name}`, outside the artifact")));
        }
        let path = dir.join(&name);
        let bytes = std::fs::read(&path).map_err(|e| corrupt(&path, format!("listed in the manifest but unreadable ({e})")))?;
        if sha256_hex(&bytes) != want {
            return Err(corrupt(&path, "does not match the checksum recorded at compile time".into()));
        }
    }
    Ok(())
}

/// `dir/plan.bin` and every file its manifest lists, all checked: what loading an artifact reads.
pub fn read_artifact(dir: &Path) -> Result<super::Plan, PlanError> {
    let plan = super::read_plan(dir)?;
    check_artifact_files(dir)?;
    Ok(plan)
}
