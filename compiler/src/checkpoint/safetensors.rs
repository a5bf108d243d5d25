//! safetensors headers: read (compile time touches no weight data) and write (synthetic checkpoints).

use crate::error::CompileError;
use kiln_runtime::plan::DType;
use std::io::{Read, Write};
use std::path::Path;

/// Headers larger than this are refused as corrupt (the spec caps them at 100 MB).
const MAX_HEADER_BYTES: u64 = 100 * 1024 * 1024;

/// One tensor as described by a safetensors header.
#[derive(Debug, Clone)]
pub struct TensorHeader {
    /// The dtype string as written in the file (kept verbatim so errors can quote it).
    pub dtype: String,
    pub shape: Vec<usize>,
    /// Absolute byte range of the data in the file.
    pub data_start: u64,
    pub data_end: u64,
}

impl TensorHeader {
    pub fn dtype(&self) -> Option<DType> {
        DType::from_safetensors_name(&self.dtype)
    }
}

/// Reads and validates the header of one safetensors file: the tensors in file order.
pub fn read_header(path: &Path) -> Result<Vec<(String, TensorHeader)>, CompileError> {
    let bad = |message: String| CompileError::Safetensors { path: path.to_path_buf(), message };
    let mut file = std::fs::File::open(path).map_err(CompileError::io(path))?;
    let file_len = file.metadata().map_err(CompileError::io(path))?.len();
    let mut len_bytes = [0u8; 8];
    file.read_exact(&mut len_bytes)
        .map_err(|_| bad(format!("truncated: {file_len} bytes, too short for the 8-byte header length")))?;
    let header_len = u64::from_le_bytes(len_bytes);
    if header_len > MAX_HEADER_BYTES || header_len > file_len.saturating_sub(8) {
        return Err(bad(format!(
            "truncated or corrupt: header length field says {header_len} bytes but the file has {file_len} bytes"
        )));
    }
    let mut header = vec![0u8; header_len as usize];
    file.read_exact(&mut header).map_err(CompileError::io(path))?;
    let map: serde_json::Map<String, serde_json::Value> = serde_json::from_slice(&header)
        .map_err(|e| bad(format!("header is not valid JSON: {e}")))?;
    let data_base = 8 + header_len;
    let data_len = file_len - data_base;
    let mut tensors = Vec::with_capacity(map.len());
    for (name, entry) in map {
        if name == "__metadata__" {
            continue;
        }
        let field = |key: &str| {
            entry.get(key).ok_or_else(|| bad(format!("tensor `{name}`: header entry has no `{key}`")))
        };
        let dtype = field("dtype")?
            .as_str()
            .ok_or_else(|| bad(format!("tensor `{name}`: `dtype` is not a string")))?
            .to_string();
        let shape = field("shape")?
            .as_array()
            .and_then(|dims| dims.iter().map(|d| d.as_u64().map(|d| d as usize)).collect::<Option<Vec<_>>>())
            .ok_or_else(|| bad(format!("tensor `{name}`: `shape` is not a list of integers")))?;
        let offsets = field("data_offsets")?
            .as_array()
            .filter(|o| o.len() == 2)
            .and_then(|o| Some([o[0].as_u64()?, o[1].as_u64()?]))
            .ok_or_else(|| bad(format!("tensor `{name}`: `data_offsets` is not [begin, end]")))?;
        let [begin, end] = offsets;
        if begin > end || end > data_len {
            return Err(bad(format!(
                "truncated or corrupt: tensor `{name}` claims bytes {begin}..{end} of the data region but it holds {data_len} bytes"
            )));
        }
        if let Some(dt) = DType::from_safetensors_name(&dtype) {
            let expected = shape.iter().product::<usize>() as u64 * dt.size() as u64;
            if end - begin != expected {
                return Err(bad(format!(
                    "tensor `{name}`: {dtype} {shape:?} needs {expected} bytes but data_offsets span {}",
                    end - begin
                )));
            }
        }
        tensors.push((name, TensorHeader { dtype, shape, data_start: data_base + begin, data_end: data_base + end }));
    }
    tensors.sort_by_key(|(_, t)| t.data_start);
    Ok(tensors)
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
    let mut header = serde_json::Map::new();
    let mut offset = 0u64;
    for t in tensors {
        let end = offset + t.bytes();
        header.insert(
            t.name.clone(),
            serde_json::json!({"dtype": t.dtype.safetensors_name(), "shape": t.shape, "data_offsets": [offset, end]}),
        );
        offset = end;
    }
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
