//! Weight content checks (`kiln verify-weights`, `--check-weights`): every tensor the plan binds
//! is scanned for NaN/Inf, and, when `kiln compile --hash-weights` recorded them, its bytes are
//! checked against their SHA-256. Header checks (name, dtype, shape) happen at every bind; these
//! read every byte, so they run only when asked.
//!
//! Non-finite codes per dtype: BF16/F16/F32 an all-ones exponent; FP8 E4M3 (the "fn" variant
//! NVFP4 block scales use) only S.1111.111 is NaN and there is no Inf; FP4 E2M1 (packed in U8)
//! and the integer types have no non-finite codes.

use crate::bind::CheckpointFiles;
use crate::error::RuntimeError;
use crate::plan::{sha256_hex, DType, Plan, TensorInfo};
use rayon::prelude::*;
use std::collections::BTreeMap;
use std::path::Path;

/// The artifact file with `{tensor name: sha256 hex of its bytes}`, written by
/// `kiln compile --hash-weights` and covered by the manifest's file checksums.
pub const WEIGHT_HASHES_FILE: &str = "weights.sha256.json";

/// What is wrong with one tensor's data.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WeightProblem {
    NonFinite { tensor: String, file: String, nan: u64, inf: u64, first_index: u64 },
    HashMismatch { tensor: String, file: String },
    /// The plan binds a tensor the recorded hashes do not cover (hashes from another compile).
    NotHashed { tensor: String },
}

impl std::fmt::Display for WeightProblem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            WeightProblem::NonFinite { tensor, file, nan, inf, first_index } => write!(
                f,
                "tensor `{tensor}` in {file}: {nan} NaN and {inf} Inf value(s), the first at element {first_index}"
            ),
            WeightProblem::HashMismatch { tensor, file } => write!(
                f,
                "tensor `{tensor}` in {file}: its bytes differ from the SHA-256 recorded at compile time (edited or damaged weights)"
            ),
            WeightProblem::NotHashed { tensor } => write!(f, "tensor `{tensor}`: no hash recorded for it in {WEIGHT_HASHES_FILE}"),
        }
    }
}

/// The outcome of [`scan`].
#[derive(Debug, Clone, Default)]
pub struct WeightReport {
    pub tensors: usize,
    pub bytes: u64,
    /// Whether the bytes were checked against recorded hashes.
    pub hashed: bool,
    /// In plan tensor order.
    pub problems: Vec<WeightProblem>,
}

impl WeightReport {
    /// An error listing the problems (the first 20), or Ok when there are none.
    pub fn into_result(self) -> Result<WeightReport, RuntimeError> {
        if self.problems.is_empty() {
            return Ok(self);
        }
        const SHOWN: usize = 20;
        let mut message = format!("{} of {} weight tensors are bad:", self.problems.len(), self.tensors);
        for p in self.problems.iter().take(SHOWN) {
            message.push_str(&format!("\n  {p}"));
        }
        if self.problems.len() > SHOWN {
            message.push_str(&format!("\n  ... and {} more", self.problems.len() - SHOWN));
        }
        message.push_str("\nthe checkpoint's weights are damaged: re-download or re-export them");
        Err(RuntimeError::BadWeights { message })
    }
}

/// Counts of non-finite elements in `data` of `dtype`, and the index of the first.
fn non_finite(dtype: DType, data: &[u8]) -> (u64, u64, Option<u64>) {
    let (mut nan, mut inf, mut first) = (0u64, 0u64, None);
    let mut note = |i: usize, is_nan: bool| {
        if is_nan {
            nan += 1;
        } else {
            inf += 1;
        }
        first.get_or_insert(i as u64);
    };
    match dtype {
        DType::BF16 | DType::F16 => {
            let (exp, man) = if dtype == DType::BF16 { (0x7f80u16, 0x007fu16) } else { (0x7c00, 0x03ff) };
            for (i, c) in data.chunks_exact(2).enumerate() {
                let v = u16::from_le_bytes([c[0], c[1]]);
                if v & exp == exp {
                    note(i, v & man != 0);
                }
            }
        }
        DType::F32 => {
            for (i, c) in data.chunks_exact(4).enumerate() {
                let v = u32::from_le_bytes([c[0], c[1], c[2], c[3]]);
                if v & 0x7f80_0000 == 0x7f80_0000 {
                    note(i, v & 0x007f_ffff != 0);
                }
            }
        }
        DType::F8E4M3 => {
            for (i, &b) in data.iter().enumerate() {
                if b & 0x7f == 0x7f {
                    note(i, true);
                }
            }
        }
        DType::U8 | DType::I32 | DType::I64 => {}
    }
    (nan, inf, first)
}

/// SHA-256 of every tensor the plan binds, by name (for `kiln compile --hash-weights`).
pub fn hash_tensors(plan: &Plan, files: &CheckpointFiles, progress: &indicatif::ProgressBar) -> Result<BTreeMap<String, String>, RuntimeError> {
    plan.tensors
        .par_iter()
        .map(|t| {
            let data = tensor_data(files, t)?;
            progress.inc(data.len() as u64);
            Ok((t.name.clone(), sha256_hex(data)))
        })
        .collect()
}

fn tensor_data<'a>(files: &'a CheckpointFiles, t: &TensorInfo) -> Result<&'a [u8], RuntimeError> {
    files.data(&t.name).ok_or_else(|| RuntimeError::MissingTensor {
        tensor: t.name.clone(),
        looked_in: files.dir.display().to_string(),
        fingerprint: String::new(),
    })
}

/// Checks the headers against the plan, then scans every bound tensor for NaN/Inf and, when
/// `recorded` is given, compares its SHA-256. Problems are reported, not returned as an error:
/// see [`WeightReport::into_result`].
pub fn scan(
    plan: &Plan,
    files: &CheckpointFiles,
    recorded: Option<&BTreeMap<String, String>>,
    progress: &indicatif::ProgressBar,
) -> Result<WeightReport, RuntimeError> {
    files.check(plan)?;
    let per_tensor: Vec<Vec<WeightProblem>> = plan
        .tensors
        .par_iter()
        .map(|t| {
            let data = tensor_data(files, t)?;
            let file = files.header(&t.name).map(|(f, _)| files.dir.join(f).display().to_string()).unwrap_or_default();
            let mut problems = Vec::new();
            let (nan, inf, first) = non_finite(t.dtype, data);
            if let Some(first_index) = first {
                problems.push(WeightProblem::NonFinite { tensor: t.name.clone(), file: file.clone(), nan, inf, first_index });
            }
            if let Some(recorded) = recorded {
                match recorded.get(&t.name) {
                    None => problems.push(WeightProblem::NotHashed { tensor: t.name.clone() }),
                    Some(want) if *want != sha256_hex(data) => problems.push(WeightProblem::HashMismatch { tensor: t.name.clone(), file }),
                    Some(_) => {}
                }
            }
            progress.inc(data.len() as u64);
            Ok(problems)
        })
        .collect::<Result<_, RuntimeError>>()?;
    Ok(WeightReport {
        tensors: plan.tensors.len(),
        bytes: plan.tensors.iter().map(TensorInfo::bytes).sum(),
        hashed: recorded.is_some(),
        problems: per_tensor.into_iter().flatten().collect(),
    })
}

/// The hashes `kiln compile --hash-weights` recorded in `artifact`, if it did. (Their file is
/// covered by the manifest's checksums, which loading the artifact checks.)
pub fn recorded_hashes(artifact: &Path) -> Result<Option<BTreeMap<String, String>>, RuntimeError> {
    let path = artifact.join(WEIGHT_HASHES_FILE);
    if !path.exists() {
        return Ok(None);
    }
    let text = std::fs::read_to_string(&path).map_err(RuntimeError::io(&path))?;
    let hashes = serde_json::from_str(&text).map_err(|e| RuntimeError::Manifest {
        path: path.clone(),
        message: format!("not a map of tensor names to SHA-256 hashes ({e}); the artifact is corrupt: recompile"),
    })?;
    Ok(Some(hashes))
}

/// A progress bar over the bytes of every tensor the plan binds, on stderr when `shown`.
pub fn tensor_progress(plan: &Plan, shown: bool, template: &str) -> indicatif::ProgressBar {
    crate::bind::progress_bar(plan.tensors.iter().map(TensorInfo::bytes).sum(), shown, template)
}

/// [`scan`] of the checkpoint in `weights` against the hashes `artifact` records (if any), with
/// a progress bar when `progress`: what `kiln verify-weights` and `--check-weights` run.
pub fn scan_checkpoint(plan: &Plan, artifact: Option<&Path>, weights: &Path, progress: bool) -> Result<WeightReport, RuntimeError> {
    let recorded = match artifact {
        Some(dir) => recorded_hashes(dir)?,
        None => None,
    };
    let files = CheckpointFiles::open(weights)?;
    let bar = tensor_progress(plan, progress, "checking weights {bar:40} {bytes}/{total_bytes}");
    let report = scan(plan, &files, recorded.as_ref(), &bar);
    bar.finish_and_clear();
    report
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bytes16(v: &[u16]) -> Vec<u8> {
        v.iter().flat_map(|x| x.to_le_bytes()).collect()
    }

    #[test]
    fn non_finite_codes_per_dtype() {
        // BF16: +1.0, NaN, -Inf, max finite (0x7f7f).
        assert_eq!(non_finite(DType::BF16, &bytes16(&[0x3f80, 0x7fc1, 0xff80, 0x7f7f])), (1, 1, Some(1)));
        // F16: 65504 (0x7bff) is finite; 0x7c00 Inf, 0xfe00 NaN.
        assert_eq!(non_finite(DType::F16, &bytes16(&[0x7bff, 0x7c00, 0xfe00])), (1, 1, Some(1)));
        let f32s: Vec<u8> = [1.0f32, f32::MAX, f32::NAN, f32::NEG_INFINITY].iter().flat_map(|x| x.to_le_bytes()).collect();
        assert_eq!(non_finite(DType::F32, &f32s), (1, 1, Some(2)));
        // E4M3: 0x7e is 448 (finite), 0x7f and 0xff NaN, 0x78 is 256.
        assert_eq!(non_finite(DType::F8E4M3, &[0x7e, 0x78, 0x7f, 0xff]), (2, 0, Some(2)));
        // Packed FP4 has no NaN: every byte is a pair of finite codes.
        assert_eq!(non_finite(DType::U8, &[0xff, 0x7f]), (0, 0, None));
    }
}
