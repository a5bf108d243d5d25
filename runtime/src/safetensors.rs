//! safetensors headers (the compiler reads them at compile time, the runtime to bind weights).

use crate::plan::DType;
use safetensors::tensor::{Metadata, TensorInfo};
use safetensors::SafeTensorError;
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
/// file of `file_len` bytes. Each entry is decoded into the `safetensors` crate's `TensorInfo`
/// (its dtype vocabulary and field types) and the whole table is checked by the crate's
/// `Metadata::new` (tensors contiguous from byte 0, sizes exact). kiln adds what the crate cannot
/// know or does not say: the data region's length on disk (headers are read without the data),
/// alignment for mapping, and errors that name the tensor and its bytes. Never panics.
pub fn parse_header(path: &Path, header: &[u8], file_len: u64) -> Result<Vec<(String, TensorHeader)>, SafetensorsError> {
    let bad = |message: String| SafetensorsError { path: path.to_path_buf(), message };
    // Decoded as a map first so that a bad entry's error names its tensor.
    let map: serde_json::Map<String, serde_json::Value> = serde_json::from_slice(header)
        .map_err(|e| bad(format!("header is not valid JSON: {e}")))?;
    let data_base = 8 + header.len() as u64;
    let Some(data_len) = file_len.checked_sub(data_base) else {
        return Err(bad(format!("truncated: the {}-byte header does not fit in the {file_len}-byte file", header.len())));
    };
    let mut user_metadata = None;
    let mut infos: Vec<(String, TensorInfo)> = Vec::with_capacity(map.len());
    for (name, entry) in map {
        if name == "__metadata__" {
            let m = serde_json::from_value(entry).map_err(|e| bad(format!("`__metadata__` is not a map of strings: {e}")))?;
            user_metadata = Some(m);
            continue;
        }
        let info: TensorInfo = serde_json::from_value(entry).map_err(|e| bad(format!("tensor `{name}`: bad header entry: {e}")))?;
        let (begin, end) = (info.data_offsets.0 as u64, info.data_offsets.1 as u64);
        if begin > end || end > data_len {
            return Err(bad(format!(
                "truncated or corrupt: tensor `{name}` claims bytes {begin}..{end} of the data region but it holds {data_len} bytes"
            )));
        }
        let dtype = info.dtype;
        let bits = info.shape.iter().try_fold(dtype.bitsize() as u64, |n, &d| n.checked_mul(d as u64));
        let Some(bits) = bits else {
            return Err(bad(format!("tensor `{name}`: shape {:?} is too large (more bytes than a u64 counts)", info.shape)));
        };
        if bits != (end - begin) * 8 {
            return Err(bad(format!(
                "tensor `{name}`: {dtype} {:?} needs {} bytes but data_offsets span {}",
                info.shape,
                bits.div_ceil(8),
                end - begin
            )));
        }
        // What a reader that maps the file and views it as `dtype` needs.
        let element_bytes = (dtype.bitsize() as u64 / 8).max(1);
        if (data_base + begin) % element_bytes != 0 {
            return Err(bad(format!(
                "tensor `{name}`: its {dtype} data starts at byte {} of the file, not a multiple of {element_bytes} (unaligned)",
                data_base + begin
            )));
        }
        infos.push((name, info));
    }
    infos.sort_by_key(|(_, t)| t.data_offsets);
    let tensors: Vec<(String, TensorHeader)> = infos
        .iter()
        .map(|(name, t)| {
            let header = TensorHeader {
                dtype: t.dtype.to_string(),
                shape: t.shape.clone(),
                data_start: data_base + t.data_offsets.0 as u64,
                data_end: data_base + t.data_offsets.1 as u64,
            };
            (name.clone(), header)
        })
        .collect();
    Metadata::new(user_metadata, infos).map_err(|e| explain(&bad, &tensors, data_base, e))?;
    let covered = tensors.last().map_or(0, |(_, t)| t.data_end - data_base);
    if covered != data_len {
        return Err(bad(format!(
            "corrupt: the tensors cover {covered} of the {data_len} data bytes after the header (the format allows no trailing bytes)"
        )));
    }
    Ok(tensors)
}

/// The crate's verdict on a table that passed kiln's per-tensor checks, in words that name the
/// tensors (it reports only one name, or none).
fn explain(
    bad: &dyn Fn(String) -> SafetensorsError,
    tensors: &[(String, TensorHeader)],
    data_base: u64,
    e: SafeTensorError,
) -> SafetensorsError {
    let SafeTensorError::InvalidOffset(culprit) = &e else {
        return bad(format!("rejected by the safetensors format check: {e}"));
    };
    let range = |t: &TensorHeader| format!("bytes {}..{}", t.data_start - data_base, t.data_end - data_base);
    let Some(i) = tensors.iter().position(|(n, _)| n == culprit) else {
        return bad(format!("rejected by the safetensors format check: {e}"));
    };
    let (name, t) = &tensors[i];
    match i.checked_sub(1).map(|p| &tensors[p]) {
        Some((prev, p)) if t.data_start < p.data_end => {
            bad(format!("corrupt: tensors `{prev}` ({}) and `{name}` ({}) overlap", range(p), range(t)))
        }
        Some((prev, p)) => bad(format!(
            "corrupt: {} unused bytes between tensors `{prev}` ({}) and `{name}` ({}) (the format allows no holes)",
            t.data_start - p.data_end,
            range(p),
            range(t)
        )),
        None => bad(format!("corrupt: the first tensor `{name}` ({}) does not start at byte 0 of the data region", range(t))),
    }
}

#[cfg(test)]
mod tests {
    use super::parse_header;
    use std::path::Path;

    /// Parses `json` (padded to 8 bytes, as writers do) as the header of a file whose data region
    /// holds `data_len` bytes.
    fn parse(json: &str, data_len: u64) -> Result<Vec<(String, super::TensorHeader)>, String> {
        let json = format!("{json:<width$}", width = json.len().next_multiple_of(8));
        parse_header(Path::new("x.safetensors"), json.as_bytes(), 8 + json.len() as u64 + data_len).map_err(|e| e.to_string())
    }

    #[test]
    fn the_format_rules_are_enforced_with_named_errors() {
        let ok = r#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"U8","shape":[3],"data_offsets":[8,11]}}"#;
        let t = parse(ok, 11).unwrap();
        assert_eq!((t[0].0.as_str(), t[1].1.data_end - t[1].1.data_start), ("a", 3));
        // A hole between tensors (the spec forbids it: no polyglot files).
        let hole = r#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"U8","shape":[3],"data_offsets":[9,12]}}"#;
        let e = parse(hole, 12).unwrap_err();
        assert!(e.contains("1 unused bytes") && e.contains("`a`") && e.contains("`b`"), "{e}");
        // Overlap names both.
        let overlap = r#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"U8","shape":[3],"data_offsets":[4,7]}}"#;
        let e = parse(overlap, 8).unwrap_err();
        assert!(e.contains("overlap") && e.contains("`a` (bytes 0..8)") && e.contains("`b` (bytes 4..7)"), "{e}");
        // Trailing bytes after the last tensor.
        let e = parse(ok, 12).unwrap_err();
        assert!(e.contains("cover 11 of the 12"), "{e}");
        // A first tensor that does not start at 0.
        let late = r#"{"a":{"dtype":"U8","shape":[3],"data_offsets":[1,4]}}"#;
        assert!(parse(late, 4).unwrap_err().contains("first tensor `a`"));
    }

    #[test]
    fn dtypes_come_from_the_crate_vocabulary() {
        // Known to the format but not to kiln: accepted, kept verbatim for later errors.
        let t = parse(r#"{"s":{"dtype":"F8_E8M0","shape":[4],"data_offsets":[0,4]}}"#, 4).unwrap();
        assert_eq!((t[0].1.dtype.as_str(), t[0].1.dtype()), ("F8_E8M0", None));
        // Sub-byte dtypes are sized in bits (F4: two per byte).
        assert!(parse(r#"{"w":{"dtype":"F4","shape":[6],"data_offsets":[0,3]}}"#, 3).is_ok());
        // Not a safetensors dtype at all: refused naming the tensor and the word.
        let e = parse(r#"{"w":{"dtype":"FP4","shape":[6],"data_offsets":[0,3]}}"#, 3).unwrap_err();
        assert!(e.contains("tensor `w`") && e.contains("FP4"), "{e}");
        // Size mismatch names dtype, shape and both sizes.
        let e = parse(r#"{"w":{"dtype":"BF16","shape":[3],"data_offsets":[0,4]}}"#, 4).unwrap_err();
        assert!(e.contains("BF16 [3] needs 6 bytes but data_offsets span 4"), "{e}");
    }
}
