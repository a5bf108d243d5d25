use serde::{Deserialize, Serialize};
use std::fmt;

/// Element types that appear in checkpoints and in the plan's buffers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum DType {
    BF16,
    F16,
    F32,
    /// Two E2M1 (FP4) codes per byte: NVFP4 packed weights are stored as U8.
    U8,
    F8E4M3,
    I32,
    I64,
}

impl DType {
    /// Size of one element in bytes (U8 holds two FP4 values but is one byte).
    pub fn size(self) -> usize {
        match self {
            DType::U8 | DType::F8E4M3 => 1,
            DType::BF16 | DType::F16 => 2,
            DType::F32 | DType::I32 => 4,
            DType::I64 => 8,
        }
    }

    /// The safetensors spelling of this dtype.
    pub fn safetensors_name(self) -> &'static str {
        match self {
            DType::BF16 => "BF16",
            DType::F16 => "F16",
            DType::F32 => "F32",
            DType::U8 => "U8",
            DType::F8E4M3 => "F8_E4M3",
            DType::I32 => "I32",
            DType::I64 => "I64",
        }
    }

    /// The `safetensors` crate's name for this dtype.
    pub fn to_safetensors(self) -> safetensors::Dtype {
        match self {
            DType::BF16 => safetensors::Dtype::BF16,
            DType::F16 => safetensors::Dtype::F16,
            DType::F32 => safetensors::Dtype::F32,
            DType::U8 => safetensors::Dtype::U8,
            DType::F8E4M3 => safetensors::Dtype::F8_E4M3,
            DType::I32 => safetensors::Dtype::I32,
            DType::I64 => safetensors::Dtype::I64,
        }
    }

    pub fn from_safetensors_name(name: &str) -> Option<DType> {
        Some(match name {
            "BF16" => DType::BF16,
            "F16" => DType::F16,
            "F32" => DType::F32,
            "U8" => DType::U8,
            "F8_E4M3" => DType::F8E4M3,
            "I32" => DType::I32,
            "I64" => DType::I64,
            _ => return None,
        })
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.safetensors_name())
    }
}
