//! safetensors headers (the compiler reads them at compile time, the runtime to bind weights).

use crate::plan::DType;
use std::io::Read;
use std::path::{Path, PathBuf};

#[derive(Debug, thiserror::Error)]
#[error("{path}: {message}")]
pub struct SafetensorsError {
    pub path: PathBuf,
    pub message: String,
}

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
pub fn read_header(path: &Path) -> Result<Vec<(String, TensorHeader)>, SafetensorsError> {
    let bad = |message: String| SafetensorsError { path: path.to_path_buf(), message };
    let io = |e: std::io::Error| SafetensorsError { path: path.to_path_buf(), message: e.to_string() };
    // Opening a FIFO blocks until a writer comes, and a device never ends: check first.
    let meta = std::fs::metadata(path).map_err(io)?;
    if !meta.is_file() {
        let kind = if meta.is_dir() { "a directory" } else { "not a regular file (a FIFO, socket or device)" };
        return Err(bad(format!("is {kind}; a checkpoint shard must be a regular file")));
    }
    let mut file = std::fs::File::open(path).map_err(io)?;
    let file_len = file.metadata().map_err(io)?.len();
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
    file.read_exact(&mut header).map_err(io)?;
    parse_header(path, &header, file_len)
}

/// Validates the JSON header (the `header.len()` bytes after the length field) of a safetensors
/// file of `file_len` bytes: every tensor's dtype, shape and data range, sizes, alignment and
/// overlaps. Never panics, whatever the bytes.
pub fn parse_header(path: &Path, header: &[u8], file_len: u64) -> Result<Vec<(String, TensorHeader)>, SafetensorsError> {
    let bad = |message: String| SafetensorsError { path: path.to_path_buf(), message };
    let map: serde_json::Map<String, serde_json::Value> = serde_json::from_slice(header)
        .map_err(|e| bad(format!("header is not valid JSON: {e}")))?;
    let data_base = 8 + header.len() as u64;
    let Some(data_len) = file_len.checked_sub(data_base) else {
        return Err(bad(format!("truncated: the {}-byte header does not fit in the {file_len}-byte file", header.len())));
    };
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
            let expected = shape.iter().try_fold(dt.size() as u64, |n, &d| n.checked_mul(d as u64));
            let Some(expected) = expected else {
                return Err(bad(format!("tensor `{name}`: shape {shape:?} is too large (more bytes than a u64 counts)")));
            };
            if end - begin != expected {
                return Err(bad(format!(
                    "tensor `{name}`: {dtype} {shape:?} needs {expected} bytes but data_offsets span {}",
                    end - begin
                )));
            }
        }
        if let Some(dt) = DType::from_safetensors_name(&dtype) {
            // What a reader that maps the file and views it as `dtype` needs.
            if (data_base + begin) % dt.size() as u64 != 0 {
                return Err(bad(format!(
                    "tensor `{name}`: its {dtype} data starts at byte {} of the file, not a multiple of {} (unaligned)",
                    data_base + begin,
                    dt.size()
                )));
            }
        }
        tensors.push((name, TensorHeader { dtype, shape, data_start: data_base + begin, data_end: data_base + end }));
    }
    tensors.sort_by_key(|(_, t)| (t.data_start, t.data_end));
    // Two tensors sharing bytes would silently read each other's data.
    for pair in tensors.windows(2) {
        let ((a, ta), (b, tb)) = (&pair[0], &pair[1]);
        if tb.data_start < ta.data_end && tb.data_start < tb.data_end {
            return Err(bad(format!(
                "corrupt: tensors `{a}` (bytes {}..{}) and `{b}` (bytes {}..{}) overlap",
                ta.data_start - data_base,
                ta.data_end - data_base,
                tb.data_start - data_base,
                tb.data_end - data_base
            )));
        }
    }
    Ok(tensors)
}

