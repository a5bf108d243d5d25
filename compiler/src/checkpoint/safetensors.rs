//! safetensors files: header reading (no weight data is touched at compile time) and writing
//! (synthetic checkpoints).

use crate::error::CompileError;
use kiln_runtime::plan::DType;
pub use kiln_runtime::safetensors::TensorHeader;
use safetensors::tensor::{Metadata, TensorInfo};
use std::io::Write;
use std::path::Path;

/// Reads and validates the header of one safetensors file: the tensors in file order.
pub fn read_header(path: &Path) -> Result<Vec<(String, TensorHeader)>, CompileError> {
    kiln_runtime::safetensors::read_header(path)
        .map_err(|e| CompileError::Safetensors { path: e.path, message: e.message })
}


/// A tensor to write: name, dtype, shape, and its bytes (None: leave a sparse hole of the right size).
pub struct TensorToWrite<'a> {
    pub name: String,
    pub dtype: DType,
    pub shape: Vec<usize>,
    pub data: Option<&'a [u8]>,
}

impl TensorToWrite<'_> {
    fn bytes(&self) -> u64 {
        self.shape.iter().product::<usize>() as u64 * self.dtype.size() as u64
    }
}

/// Writes a safetensors file. Tensors without data become holes (`set_len`), so a full-size
/// checkpoint skeleton costs only its headers on disk.
pub fn write_file(path: &Path, tensors: &[TensorToWrite<'_>]) -> Result<u64, CompileError> {
    let mut infos = Vec::with_capacity(tensors.len());
    let mut offset = 0usize;
    for t in tensors {
        let end = offset + t.bytes() as usize;
        let info = TensorInfo { dtype: t.dtype.to_safetensors(), shape: t.shape.clone(), data_offsets: (offset, end) };
        infos.push((t.name.clone(), info));
        offset = end;
    }
    // The crate checks the table and writes it in its own field order.
    let header = Metadata::new(None, infos).map_err(|e| CompileError::Safetensors { path: path.to_path_buf(), message: e.to_string() })?;
    let mut json = serde_json::to_vec(&header).expect("header serialises");
    while json.len() % 8 != 0 {
        json.push(b' ');
    }
    let file = std::fs::File::create(path).map_err(CompileError::io(path))?;
    let mut out = std::io::BufWriter::new(file);
    let io = CompileError::io(path);
    let result = (|| {
        out.write_all(&(json.len() as u64).to_le_bytes())?;
        out.write_all(&json)?;
        let mut written = 0u64;
        for t in tensors {
            if let Some(data) = t.data {
                assert_eq!(data.len() as u64, t.bytes(), "tensor {} data size", t.name);
                out.write_all(data)?;
                written += data.len() as u64;
            } else {
                out.flush()?;
                let pos = 8 + json.len() as u64 + written + t.bytes();
                out.get_ref().set_len(pos)?;
                use std::io::Seek;
                out.get_mut().seek(std::io::SeekFrom::Start(pos))?;
                written += t.bytes();
            }
        }
        out.flush()?;
        Ok(8 + json.len() as u64 + written)
    })();
    result.map_err(io)
}
