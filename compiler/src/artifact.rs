//! The artifact directory: `plan.bin`, `manifest.json`, and the tokenizer / chat template files
//! copied from the checkpoint.

use crate::error::CompileError;
use crate::passes::assemble::Cubin;
use kiln_runtime::plan::{sha256_hex, summary::summarize, write_plan, Plan, FILES_KEY};
use kiln_runtime::weight_check::WEIGHT_HASHES_FILE;
use std::collections::BTreeMap;
use std::path::Path;

pub const MANIFEST_FILE: &str = "manifest.json";

/// Files copied verbatim from the checkpoint when present (the runtime's tokenizer and template).
pub const COPIED_FILES: [&str; 5] =
    ["tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json", "generation_config.json"];

/// Writes the artifact. `checkpoint_dir` is recorded in the manifest so `--weights` may be
/// omitted while that directory exists.
pub fn write_artifact(out: &Path, plan: &Plan, checkpoint_dir: &Path) -> Result<Vec<String>, CompileError> {
    write_artifact_with(out, plan, &[], checkpoint_dir, None, true)
}

/// Directory of the kernels in an artifact: `<name>.ptx` per kernel, `<name>.cubin` beside it
/// when ptxas assembled it.
pub const KERNELS_DIR: &str = "kernels";

/// [`write_artifact`] plus the cubins ptxas produced and, when `kiln compile --hash-weights`
/// computed them, the SHA-256 of every bound tensor (`weights.sha256.json`).
pub fn write_artifact_with(
    out: &Path,
    plan: &Plan,
    cubins: &[Cubin],
    checkpoint_dir: &Path,
    weight_hashes: Option<&BTreeMap<String, String>>,
    record_checkpoint: bool,
) -> Result<Vec<String>, CompileError> {
    std::fs::create_dir_all(out).map_err(CompileError::io(out))?;
    let kdir = out.join(KERNELS_DIR);
    if kdir.is_dir() {
        std::fs::remove_dir_all(&kdir).map_err(CompileError::io(&kdir))?;
    }
    if !plan.kernels.is_empty() {
        std::fs::create_dir_all(&kdir).map_err(CompileError::io(&kdir))?;
        for k in &plan.kernels {
            let path = kdir.join(format!("{}.ptx", k.name));
            std::fs::write(&path, &k.ptx).map_err(CompileError::io(&path))?;
        }
        for c in cubins {
            let path = kdir.join(format!("{}.cubin", c.name));
            std::fs::write(&path, &c.bytes).map_err(CompileError::io(&path))?;
        }
    }
    write_plan(out, plan).map_err(|e| CompileError::Io { path: out.join("plan.bin"), error: std::io::Error::other(e.to_string()) })?;
    // Every file beside plan.bin (which carries its own checksum), with its hash: loading
    // refuses a damaged one by name.
    let mut files = serde_json::Map::new();
    for k in &plan.kernels {
        files.insert(format!("{KERNELS_DIR}/{}.ptx", k.name), sha256_hex(k.ptx.as_bytes()).into());
    }
    for c in cubins {
        files.insert(format!("{KERNELS_DIR}/{}.cubin", c.name), sha256_hex(&c.bytes).into());
    }
    let hashes_path = out.join(WEIGHT_HASHES_FILE);
    match weight_hashes {
        Some(hashes) => {
            let text = serde_json::to_string_pretty(hashes).expect("hashes serialise") + "\n";
            std::fs::write(&hashes_path, &text).map_err(CompileError::io(&hashes_path))?;
            files.insert(WEIGHT_HASHES_FILE.to_string(), sha256_hex(text.as_bytes()).into());
        }
        // A recompile without --hash-weights must not leave the old hashes behind.
        None if hashes_path.exists() => std::fs::remove_file(&hashes_path).map_err(CompileError::io(&hashes_path))?,
        None => {}
    }
    let mut copied = Vec::new();
    for name in COPIED_FILES {
        let src = checkpoint_dir.join(name);
        if src.is_file() {
            let bytes = std::fs::read(&src).map_err(CompileError::io(&src))?;
            let dst = out.join(name);
            std::fs::write(&dst, &bytes).map_err(CompileError::io(&dst))?;
            files.insert(name.to_string(), sha256_hex(&bytes).into());
            copied.push(name.to_string());
        }
    }
    let checkpoint = std::fs::canonicalize(checkpoint_dir).unwrap_or_else(|_| checkpoint_dir.to_path_buf());
    let mut manifest = serde_json::json!({
        "checkpoint_dir": checkpoint.display().to_string(),
        "copied_files": copied,
        FILES_KEY: files,
        "summary": summarize(plan),
        "model": plan.model,
        "target": plan.target,
    });
    if !record_checkpoint {
        // A portable artifact names no local path: `--weights` is then required.
        manifest.as_object_mut().expect("an object").remove("checkpoint_dir");
    }
    let path = out.join(MANIFEST_FILE);
    let text = serde_json::to_string_pretty(&manifest).expect("manifest serialises") + "\n";
    std::fs::write(&path, text).map_err(CompileError::io(&path))?;
    Ok(copied)
}
