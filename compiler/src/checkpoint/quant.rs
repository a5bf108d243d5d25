//! ModelOpt NVFP4 quantisation config: `hf_quant_config.json` (nested) or `config.json`'s
//! `quantization_config` (flat).

use super::glob::module_excluded;
use crate::error::CompileError;
use serde_json::Value;
use std::path::Path;

#[derive(Debug, Clone, PartialEq)]
pub enum QuantConfig {
    /// No quantisation config: every linear is BF16.
    None,
    /// ModelOpt NVFP4 with 16-element blocks; modules matching `exclude` stay BF16.
    Nvfp4 { exclude: Vec<String>, source: String },
}

impl QuantConfig {
    /// Which pattern keeps `module` in BF16 (None: it is NVFP4). Always Some("") when unquantised.
    pub fn bf16_reason(&self, module: &str) -> Option<String> {
        match self {
            QuantConfig::None => Some("the checkpoint has no quantization config".into()),
            QuantConfig::Nvfp4 { exclude, source } => {
                module_excluded(module, exclude).map(|p| format!("excluded by pattern {p:?} in {source}"))
            }
        }
    }

    pub fn is_nvfp4(&self, module: &str) -> bool {
        self.bf16_reason(module).is_none()
    }

    /// Reads the quantisation config: `hf_quant_config.json` wins, else `config.json`'s
    /// `quantization_config`, else none.
    pub fn load(dir: &Path, config: &Value, config_path: &Path) -> Result<QuantConfig, CompileError> {
        let hf_path = dir.join("hf_quant_config.json");
        if hf_path.exists() {
            let text = std::fs::read_to_string(&hf_path).map_err(CompileError::io(&hf_path))?;
            let json: Value = serde_json::from_str(&text)
                .map_err(|e| CompileError::Json { path: hf_path.clone(), message: e.to_string() })?;
            let Some(q) = json.get("quantization") else {
                return Err(CompileError::Config {
                    path: hf_path,
                    field: "quantization".into(),
                    message: "missing; expected ModelOpt's {\"quantization\": {\"quant_algo\": \"NVFP4\", ...}}".into(),
                });
            };
            return parse_section(q, &hf_path, "quantization", &["exclude_modules", "ignore", "modules_to_not_convert"]);
        }
        match config.get("quantization_config") {
            None | Some(Value::Null) => Ok(QuantConfig::None),
            Some(q) => {
                if let Some(method) = q.get("quant_method").and_then(Value::as_str) {
                    if method != "modelopt" {
                        return Err(CompileError::Config {
                            path: config_path.to_path_buf(),
                            field: "quantization_config.quant_method".into(),
                            message: format!("{method:?} is not supported; kiln reads ModelOpt (\"modelopt\") NVFP4 checkpoints"),
                        });
                    }
                }
                parse_section(q, config_path, "quantization_config", &["ignore", "modules_to_not_convert", "exclude_modules"])
            }
        }
    }
}

fn parse_section(q: &Value, path: &Path, section: &str, exclude_keys: &[&str]) -> Result<QuantConfig, CompileError> {
    let err = |field: &str, message: String| CompileError::Config {
        path: path.to_path_buf(),
        field: format!("{section}.{field}"),
        message,
    };
    let algo = q.get("quant_algo").and_then(Value::as_str).ok_or_else(|| err("quant_algo", "missing".into()))?;
    if algo != "NVFP4" {
        return Err(err("quant_algo", format!("{algo:?} is not supported; kiln compiles NVFP4 (or unquantised BF16) checkpoints")));
    }
    let group_size = q.get("group_size").and_then(Value::as_u64).or_else(|| {
        q.get("config_groups")?
            .as_object()?
            .values()
            .find_map(|g| g.get("weights")?.get("group_size")?.as_u64())
    });
    if let Some(gs) = group_size {
        if gs != 16 {
            return Err(err("group_size", format!("{gs}; NVFP4 uses 16-element blocks")));
        }
    }
    let mut exclude = Vec::new();
    if let Some((key, list)) = exclude_keys.iter().find_map(|k| q.get(*k).map(|v| (*k, v))) {
        let items = list.as_array().ok_or_else(|| err(key, "expected a list of module patterns".into()))?;
        for item in items {
            exclude.push(item.as_str().ok_or_else(|| err(key, format!("pattern {item} is not a string")))?.to_string());
        }
    }
    let source = format!("{}", path.file_name().map(|f| f.to_string_lossy()).unwrap_or_default());
    Ok(QuantConfig::Nvfp4 { exclude, source })
}
