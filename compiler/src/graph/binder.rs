//! Checks every checkpoint tensor the graph needs (presence, dtype, shape) and numbers them.

use crate::checkpoint::Checkpoint;
use crate::error::CompileError;
use kiln_runtime::plan::{DType, TensorInfo};
use std::collections::HashMap;

pub struct Binder<'a> {
    pub ckpt: &'a Checkpoint,
    pub tensors: Vec<TensorInfo>,
    index: HashMap<String, u32>,
}

impl<'a> Binder<'a> {
    pub fn new(ckpt: &'a Checkpoint) -> Self {
        Binder { ckpt, tensors: Vec::new(), index: HashMap::new() }
    }

    /// The tensor `name` must exist with `dtype` and `shape` (a scalar also accepts `[1]`).
    pub fn expect(&mut self, name: &str, dtype: DType, shape: &[usize], needed_for: &str) -> Result<u32, CompileError> {
        if let Some(&id) = self.index.get(name) {
            return Ok(id);
        }
        let Some(t) = self.ckpt.get(name) else {
            return Err(CompileError::MissingTensor {
                tensor: name.into(),
                needed_for: needed_for.into(),
                looked_in: self.ckpt.looked_in(),
            });
        };
        let found = &t.header;
        let scalar_ok = shape.is_empty() && found.shape == [1];
        if found.dtype() != Some(dtype) || (found.shape != shape && !scalar_ok) {
            let module = name.rsplit_once('.').map(|(m, _)| m).unwrap_or(name);
            let hint = match (dtype, found.dtype()) {
                (DType::BF16, Some(DType::U8)) => format!(
                    "; the quantization config keeps `{module}` in BF16 ({}), but the checkpoint stores it quantised",
                    self.ckpt.quant.bf16_reason(module).unwrap_or_default()
                ),
                (DType::U8, Some(DType::BF16)) => format!(
                    "; the quantization config makes `{module}` NVFP4 (no exclude pattern matches it), but the checkpoint stores it in BF16"
                ),
                _ => String::new(),
            };
            return Err(CompileError::TensorMismatch {
                tensor: name.into(),
                file: self.ckpt.file_of(t).into(),
                expected_dtype: dtype,
                expected_shape: shape.to_vec(),
                found_dtype: found.dtype.clone(),
                found_shape: found.shape.clone(),
                hint,
            });
        }
        let id = self.tensors.len() as u32;
        self.tensors.push(TensorInfo { name: name.into(), dtype, shape: found.shape.clone() });
        self.index.insert(name.into(), id);
        Ok(id)
    }
}
