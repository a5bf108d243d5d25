//! Hugging Face checkpoint directories: config, quantisation config and safetensors headers.
//! Only headers are read; no weight data is touched at compile time.

mod config;
pub mod glob;
mod quant;
pub mod safetensors;

pub use config::parse_model_config;
pub use quant::QuantConfig;
pub use safetensors::TensorHeader;

use crate::error::CompileError;
use serde_json::Value;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

pub const INDEX_FILE: &str = "model.safetensors.index.json";
pub const SINGLE_FILE: &str = "model.safetensors";

/// A checkpoint tensor's header plus the file it lives in.
#[derive(Debug, Clone)]
pub struct CheckpointTensor {
    pub header: TensorHeader,
    /// Index into `Checkpoint::files`.
    pub file: usize,
}

#[derive(Debug)]
pub struct Checkpoint {
    pub dir: PathBuf,
    pub config_path: PathBuf,
    pub config: Value,
    pub quant: QuantConfig,
    /// Shard file names relative to `dir`, sorted.
    pub files: Vec<String>,
    pub tensors: BTreeMap<String, CheckpointTensor>,
}

impl Checkpoint {
    pub fn open(dir: &Path) -> Result<Checkpoint, CompileError> {
        if !dir.is_dir() {
            return Err(CompileError::Io {
                path: dir.to_path_buf(),
                error: std::io::Error::new(std::io::ErrorKind::NotFound, "checkpoint directory not found"),
            });
        }
        let config_path = dir.join("config.json");
        let text = std::fs::read_to_string(&config_path).map_err(CompileError::io(&config_path))?;
        let config: Value = serde_json::from_str(&text)
            .map_err(|e| CompileError::Json { path: config_path.clone(), message: e.to_string() })?;
        if !config.is_object() {
            return Err(CompileError::Json { path: config_path, message: "expected a JSON object".into() });
        }
        let quant = QuantConfig::load(dir, &config, &config_path)?;
        let files = shard_files(dir)?;
        let mut tensors = BTreeMap::new();
        for (index, file) in files.iter().enumerate() {
            for (name, header) in safetensors::read_header(&dir.join(file))? {
                if let Some(previous) = tensors.insert(name.clone(), CheckpointTensor { header, file: index }) {
                    return Err(CompileError::Safetensors {
                        path: dir.join(file),
                        message: format!("tensor `{name}` also appears in {}", files[previous.file]),
                    });
                }
            }
        }
        if dir.join(INDEX_FILE).exists() {
            check_index(dir, &files, &tensors)?;
        }
        Ok(Checkpoint { dir: dir.to_path_buf(), config_path, config, quant, files, tensors })
    }

    pub fn get(&self, name: &str) -> Option<&CheckpointTensor> {
        self.tensors.get(name)
    }

    pub fn file_of(&self, tensor: &CheckpointTensor) -> &str {
        &self.files[tensor.file]
    }

    /// Where a missing tensor was looked for, for error messages.
    pub fn looked_in(&self) -> String {
        if self.files.len() == 1 {
            self.dir.join(&self.files[0]).display().to_string()
        } else {
            format!("{} shards listed in {}", self.files.len(), self.dir.join(INDEX_FILE).display())
        }
    }
}

/// The shard files: from the index's weight_map, else the single `model.safetensors`.
fn shard_files(dir: &Path) -> Result<Vec<String>, CompileError> {
    let index_path = dir.join(INDEX_FILE);
    if index_path.exists() {
        let map = read_weight_map(&index_path)?;
        let mut files: Vec<String> = map.values().cloned().collect();
        files.sort();
        files.dedup();
        for f in &files {
            if f.contains('/') || f.contains("..") {
                return Err(CompileError::Config {
                    path: index_path,
                    field: "weight_map".into(),
                    message: format!("shard name {f:?} must be a plain file name in the checkpoint directory"),
                });
            }
        }
        return Ok(files);
    }
    if dir.join(SINGLE_FILE).exists() {
        return Ok(vec![SINGLE_FILE.to_string()]);
    }
    Err(CompileError::NoWeights { dir: dir.to_path_buf() })
}

fn read_weight_map(index_path: &Path) -> Result<BTreeMap<String, String>, CompileError> {
    let text = std::fs::read_to_string(index_path).map_err(CompileError::io(index_path))?;
    let json: Value = serde_json::from_str(&text)
        .map_err(|e| CompileError::Json { path: index_path.to_path_buf(), message: e.to_string() })?;
    let bad = |message: &str| CompileError::Config {
        path: index_path.to_path_buf(),
        field: "weight_map".into(),
        message: message.into(),
    };
    let map = json.get("weight_map").and_then(Value::as_object).ok_or_else(|| bad("missing or not an object"))?;
    map.iter()
        .map(|(k, v)| Ok((k.clone(), v.as_str().ok_or_else(|| bad(&format!("entry `{k}` is not a file name")))?.to_string())))
        .collect()
}

/// Every tensor the index promises must be in the shard it names.
fn check_index(dir: &Path, files: &[String], tensors: &BTreeMap<String, CheckpointTensor>) -> Result<(), CompileError> {
    let index_path = dir.join(INDEX_FILE);
    for (name, file) in read_weight_map(&index_path)? {
        match tensors.get(&name) {
            Some(t) if files[t.file] == file => {}
            Some(t) => {
                return Err(CompileError::Safetensors {
                    path: dir.join(&file),
                    message: format!("index says tensor `{name}` is here, but it is in {}", files[t.file]),
                })
            }
            None => {
                return Err(CompileError::MissingTensor {
                    tensor: name,
                    needed_for: format!("listed in {INDEX_FILE}"),
                    looked_in: dir.join(&file).display().to_string(),
                })
            }
        }
    }
    Ok(())
}
