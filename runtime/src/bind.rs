//! Weight binding: map the checkpoint's safetensors files, check every tensor the plan binds
//! against their headers (refusing foreign or edited weights, naming the first culprit), then fill
//! each rank's weights arena by slicing every source per its `Shard` into its slot.

use crate::error::{RuntimeError, TensorMismatch};
use crate::plan::{fingerprint, DType, Nvfp4Part, Plan, Shard, TensorInfo, Transform, WeightSlot};
use crate::safetensors::{read_header, TensorHeader};
use memmap2::Mmap;
use std::collections::HashMap;
use std::path::{Path, PathBuf};

pub const INDEX_FILE: &str = "model.safetensors.index.json";
pub const SINGLE_FILE: &str = "model.safetensors";

/// A checkpoint directory with its safetensors files memory-mapped.
pub struct CheckpointFiles {
    pub dir: PathBuf,
    /// File names relative to `dir`, sorted, and their maps.
    files: Vec<(String, Mmap)>,
    /// tensor name -> (file index, header).
    tensors: HashMap<String, (usize, TensorHeader)>,
}

impl CheckpointFiles {
    /// Maps every shard listed in `model.safetensors.index.json`, else the single `model.safetensors`.
    pub fn open(dir: &Path) -> Result<CheckpointFiles, RuntimeError> {
        if !dir.is_dir() {
            return Err(RuntimeError::Io {
                path: dir.to_path_buf(),
                error: std::io::Error::new(std::io::ErrorKind::NotFound, "weights directory not found"),
            });
        }
        let names = shard_files(dir)?;
        let mut files = Vec::with_capacity(names.len());
        let mut tensors = HashMap::new();
        for (index, name) in names.into_iter().enumerate() {
            let path = dir.join(&name);
            for (tensor, header) in read_header(&path)? {
                if let Some((other, _)) = tensors.insert(tensor.clone(), (index, header)) {
                    let other: &(String, Mmap) = &files[other];
                    return Err(RuntimeError::Manifest {
                        path,
                        message: format!("tensor `{tensor}` also appears in {}", other.0),
                    });
                }
            }
            let file = std::fs::File::open(&path).map_err(RuntimeError::io(&path))?;
            // SAFETY: the map is read-only; like every mmap user we rely on nobody truncating the
            // checkpoint while kiln binds it (the headers were validated against the file size).
            let map = unsafe { Mmap::map(&file) }.map_err(RuntimeError::io(&path))?;
            files.push((name, map));
        }
        Ok(CheckpointFiles { dir: dir.to_path_buf(), files, tensors })
    }

    fn looked_in(&self) -> String {
        if self.files.len() == 1 {
            self.dir.join(&self.files[0].0).display().to_string()
        } else {
            format!("{} shards of {}", self.files.len(), self.dir.display())
        }
    }

    /// The tensor's header and the file it lives in.
    pub fn header(&self, name: &str) -> Option<(&str, &TensorHeader)> {
        self.tensors.get(name).map(|(f, h)| (self.files[*f].0.as_str(), h))
    }

    /// Every tensor's name, in no particular order.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.tensors.keys().map(String::as_str)
    }

    /// The raw bytes of a tensor.
    pub fn data(&self, name: &str) -> Option<&[u8]> {
        let (f, h) = self.tensors.get(name)?;
        self.files[*f].1.get(h.data_start as usize..h.data_end as usize)
    }

    /// Checks every tensor of the plan (name, dtype, shape) against the headers; the error names
    /// the first mismatch in plan order, expected vs found, and both fingerprints.
    pub fn check(&self, plan: &Plan) -> Result<(), RuntimeError> {
        let found: Vec<TensorInfo> = plan
            .tensors
            .iter()
            .map(|t| match self.header(&t.name) {
                Some((_, h)) => TensorInfo {
                    name: t.name.clone(),
                    dtype: h.dtype().unwrap_or(t.dtype),
                    shape: h.shape.clone(),
                },
                None => t.clone(),
            })
            .collect();
        for t in &plan.tensors {
            let Some((file, h)) = self.header(&t.name) else {
                return Err(RuntimeError::MissingTensor {
                    tensor: t.name.clone(),
                    looked_in: self.looked_in(),
                    fingerprint: short(&plan.fingerprint),
                });
            };
            if h.dtype() != Some(t.dtype) || h.shape != t.shape {
                return Err(RuntimeError::TensorMismatch(Box::new(TensorMismatch {
                    tensor: t.name.clone(),
                    file: self.dir.join(file).display().to_string(),
                    expected_dtype: t.dtype,
                    expected_shape: t.shape.clone(),
                    found_dtype: h.dtype.clone(),
                    found_shape: h.shape.clone(),
                    fingerprint: short(&plan.fingerprint),
                    found_fingerprint: short(&fingerprint(&found)),
                })));
            }
        }
        if fingerprint(&plan.tensors) != plan.fingerprint {
            return Err(RuntimeError::Manifest {
                path: PathBuf::from("plan.bin"),
                message: "the plan's fingerprint does not match its own tensor table (corrupt plan)".into(),
            });
        }
        Ok(())
    }
}

/// The first 16 hex digits, as `kiln inspect` shows fingerprints.
fn short(fingerprint: &str) -> String {
    fingerprint.chars().take(16).collect()
}

/// The shard files: the values of the index's weight_map, else the single `model.safetensors`.
fn shard_files(dir: &Path) -> Result<Vec<String>, RuntimeError> {
    let index = dir.join(INDEX_FILE);
    if index.exists() {
        let text = std::fs::read_to_string(&index).map_err(RuntimeError::io(&index))?;
        let bad = |message: String| RuntimeError::Manifest { path: index.clone(), message };
        let json: serde_json::Value = serde_json::from_str(&text).map_err(|e| bad(format!("malformed JSON: {e}")))?;
        let map = json
            .get("weight_map")
            .and_then(|m| m.as_object())
            .ok_or_else(|| bad("`weight_map` is missing or not an object".into()))?;
        let mut files = Vec::new();
        for (tensor, file) in map {
            let file = file.as_str().ok_or_else(|| bad(format!("weight_map entry `{tensor}` is not a file name")))?;
            if file.contains('/') || file.contains('\\') || file.contains("..") {
                return Err(bad(format!("shard name {file:?} must be a plain file name in the checkpoint directory")));
            }
            files.push(file.to_string());
        }
        files.sort();
        files.dedup();
        return Ok(files);
    }
    if dir.join(SINGLE_FILE).exists() {
        return Ok(vec![SINGLE_FILE.to_string()]);
    }
    Err(RuntimeError::NoWeights { dir: dir.to_path_buf() })
}

/// One rank's weights arena: `plan.memory.weights` bytes, every slot filled.
pub type Arena = Vec<u8>;

/// Checks the weights against the plan and builds every rank's arena. Shows a progress bar on a
/// terminal when `progress` is set.
pub fn bind(plan: &Plan, weights_dir: &Path, progress: bool) -> Result<Vec<Arena>, RuntimeError> {
    let files = CheckpointFiles::open(weights_dir)?;
    files.check(plan)?;
    let ranks = plan.ranks();
    let bar = weights_progress(plan, progress, "binding weights {bar:40} {bytes}/{total_bytes} {msg}");
    let arena_bytes = plan.memory.weights;
    check_host_memory(arena_bytes.saturating_mul(ranks as u64), ranks)?;
    let mut arenas = Vec::with_capacity(ranks);
    for rank in 0..ranks {
        let mut arena = Vec::new();
        arena.try_reserve_exact(arena_bytes as usize).map_err(|_| RuntimeError::Unsupported {
            message: format!("cannot allocate the {} weights arena of rank {rank} in host memory", human(arena_bytes)),
        })?;
        arena.resize(arena_bytes as usize, 0u8);
        for slot in &plan.weights {
            fill_slot(plan, &files, slot, rank, &mut arena)?;
            bar.inc(slot.bytes);
        }
        arenas.push(arena);
    }
    bar.finish_and_clear();
    Ok(arenas)
}

/// A progress bar over every rank's weight bytes, drawn on stderr with `template` when `shown`
/// (hidden otherwise).
pub fn weights_progress(plan: &Plan, shown: bool, template: &str) -> indicatif::ProgressBar {
    progress_bar(plan.weights.iter().map(|s| s.bytes).sum::<u64>() * plan.ranks() as u64, shown, template)
}

/// A progress bar over `total` bytes, drawn on stderr with `template` when `shown`.
pub fn progress_bar(total: u64, shown: bool, template: &str) -> indicatif::ProgressBar {
    if !shown {
        return indicatif::ProgressBar::hidden();
    }
    let bar = indicatif::ProgressBar::with_draw_target(Some(total), indicatif::ProgressDrawTarget::stderr());
    if let Ok(style) = indicatif::ProgressStyle::with_template(template) {
        bar.set_style(style);
    }
    bar
}

/// The CPU backend keeps every rank's weights in host memory: refuse up front, naming the
/// numbers, when they cannot fit (rather than being killed half way through binding).
fn check_host_memory(needed: u64, ranks: usize) -> Result<(), RuntimeError> {
    let available = std::fs::read_to_string("/proc/meminfo").ok().and_then(|m| {
        let line = m.lines().find(|l| l.starts_with("MemAvailable:"))?;
        let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
        Some(kib * 1024)
    });
    match available {
        Some(avail) if needed > avail => Err(RuntimeError::Unsupported {
            message: format!(
                "the CPU backend needs {} of host memory for the weights of {ranks} rank(s), {} is available; \
                 this plan is too large to run on the CPU (use a GPU backend or a smaller model)",
                human(needed),
                human(avail)
            ),
        }),
        _ => Ok(()),
    }
}

/// `bytes` as GiB, or MiB below one GiB.
pub fn human(bytes: u64) -> String {
    const GIB: f64 = (1u64 << 30) as f64;
    if bytes >= 1 << 30 {
        format!("{:.2} GiB", bytes as f64 / GIB)
    } else {
        format!("{:.2} MiB", bytes as f64 / (1u64 << 20) as f64)
    }
}

fn fill_slot(plan: &Plan, files: &CheckpointFiles, slot: &WeightSlot, rank: usize, arena: &mut [u8]) -> Result<(), RuntimeError> {
    let slot_end = slot.offset.checked_add(slot.bytes).filter(|&e| e <= arena.len() as u64).ok_or_else(|| {
        RuntimeError::internal(format!("slot `{}` ({} bytes at {}) lies outside the weights arena", slot.name, slot.bytes, slot.offset))
    })?;
    fill_slot_region(plan, files, slot, rank, &mut arena[slot.offset as usize..slot_end as usize])
}

/// Fills one slot of rank `rank` into `region` (the slot's `bytes`, zeroed by the caller: the
/// bytes no source covers stay zero), e.g. a pinned staging buffer bound for a GPU.
pub fn fill_slot_region(plan: &Plan, files: &CheckpointFiles, slot: &WeightSlot, rank: usize, region: &mut [u8]) -> Result<(), RuntimeError> {
    if region.len() as u64 != slot.bytes {
        return Err(RuntimeError::internal(format!("slot `{}` is {} bytes, its region {}", slot.name, slot.bytes, region.len())));
    }
    for src in &slot.sources {
        let index = src.tensor.for_rank(rank) as usize;
        let info = plan
            .tensors
            .get(index)
            .ok_or_else(|| RuntimeError::internal(format!("slot `{}` names tensor {index}, the plan has {}", slot.name, plan.tensors.len())))?;
        let data = files
            .data(&info.name)
            .ok_or_else(|| RuntimeError::internal(format!("tensor `{}` vanished after the check", info.name)))?;
        let dst = src.dst_offset as usize;
        let failed = |m: String| RuntimeError::internal(format!("slot `{}` from `{}`: {m}", slot.name, info.name));
        // a quantised part: only the rank's share is quantised where its blocks allow
        let piece = match src.transform {
            Transform::Nvfp4(part) => nvfp4_piece(data, info, part, src.shard, rank).map_err(failed)?,
            _ => None,
        };
        let shard = if piece.is_some() { Shard::Whole } else { src.shard };
        let derived = match (piece, src.transform) {
            (Some(piece), _) => Some(piece),
            (None, Transform::Identity) => None,
            (None, transform) => Some(transformed(data, info, transform).map_err(failed)?),
        };
        let (data, info) = derived.as_ref().map_or((data, info), |(d, i)| (&d[..], i));
        let piece = copy_shard(data, info, shard, rank, region.get_mut(dst..).unwrap_or_default()).map_err(failed)?;
        if dst + piece > region.len() {
            return Err(RuntimeError::internal(format!("slot `{}`: piece from `{}` overruns the slot", slot.name, info.name)));
        }
    }
    Ok(())
}

/// What a source's transform makes of a tensor, as a tensor of its own (before the shard).
fn transformed(data: &[u8], info: &TensorInfo, transform: Transform) -> Result<(Vec<u8>, TensorInfo), String> {
    match transform {
        Transform::Identity => Ok((data.to_vec(), info.clone())),
        Transform::Columns { start, len } => column_slice(data, info, start as usize, len as usize),
        Transform::Nvfp4(part) => nvfp4_part(data, info, part),
    }
}

/// One part of the ModelOpt NVFP4 quantisation of a BF16 `[n, k]` tensor.
pub fn nvfp4_part(data: &[u8], info: &TensorInfo, part: Nvfp4Part) -> Result<(Vec<u8>, TensorInfo), String> {
    nvfp4_piece(data, info, part, Shard::Whole, 0)?.ok_or_else(|| "unreachable: the whole tensor is block-aligned".into())
}

/// Rank `rank`'s `shard` of one part of the NVFP4 quantisation of a BF16 `[n, k]` tensor, as a
/// tensor of its own, quantising only those rows and columns (under the whole tensor's
/// `scale_2`): a rank binding GLM-5's MTP experts quantises an eighth of them, not all of them
/// three times. None where the share's columns are not whole 16-value blocks (the caller
/// quantises the whole part and splits it).
fn nvfp4_piece(data: &[u8], info: &TensorInfo, part: Nvfp4Part, shard: Shard, rank: usize) -> Result<Option<(Vec<u8>, TensorInfo)>, String> {
    let (&[n, k], DType::BF16) = (&info.shape[..], info.dtype) else {
        return Err(format!("NVFP4 quantisation of a {:?} {:?} tensor (takes a 2-d BF16 one)", info.dtype, info.shape));
    };
    if k % 16 != 0 {
        return Err(format!("NVFP4 quantisation of [{n}, {k}]: K must be a multiple of 16"));
    }
    if data.len() != n * k * 2 {
        return Err(format!("{} bytes for a BF16 [{n}, {k}] tensor", data.len()));
    }
    let scale_2 = crate::numerics::nvfp4_scale_2(crate::numerics::bf16_amax(data));
    let tensor = |dtype, shape| TensorInfo { name: info.name.clone(), dtype, shape };
    // the share's rows and columns of values
    let (part_cols, values_per_col) = match part {
        Nvfp4Part::Scale2 => {
            return match shard {
                Shard::Whole => Ok(Some((scale_2.to_le_bytes().to_vec(), tensor(DType::F32, vec![])))),
                Shard::Split { .. } => Err("a split of the scalar weight_scale_2".into()),
            };
        }
        Nvfp4Part::Codes => (k / 2, 2),
        Nvfp4Part::Scales => (k / 16, 16),
    };
    let (rows, cols) = match shard {
        Shard::Whole => (0..n, 0..k),
        Shard::Split { dim, parts } => {
            let (size, parts) = (if dim == 0 { n } else { part_cols }, parts as usize);
            if dim > 1 || parts == 0 || size % parts != 0 || rank >= parts {
                return Err(format!("dim {dim} of size {size} cannot be split in {parts} parts for rank {rank}"));
            }
            let share = size / parts;
            if dim == 0 {
                (rank * share..(rank + 1) * share, 0..k)
            } else if (share * values_per_col) % 16 != 0 {
                return Ok(None);
            } else {
                (0..n, rank * share * values_per_col..(rank + 1) * share * values_per_col)
            }
        }
    };
    let width = cols.len();
    let w: Vec<f32> = rows.clone().flat_map(|r| data[(r * k + cols.start) * 2..(r * k + cols.end) * 2].chunks_exact(2)).map(|b| crate::numerics::bf16_to_f32(u16::from_le_bytes([b[0], b[1]]))).collect();
    let (codes, scales) = crate::numerics::quantize_nvfp4_blocks(&w, width, scale_2, part == Nvfp4Part::Codes);
    Ok(Some(match part {
        Nvfp4Part::Codes => (codes, tensor(DType::U8, vec![rows.len(), width / 2])),
        _ => (scales, tensor(DType::F8E4M3, vec![rows.len(), width / 16])),
    }))
}

/// Columns `start..start + len` of a row-major 2-d tensor, as a tensor of their own.
pub fn column_slice(data: &[u8], info: &TensorInfo, start: usize, len: usize) -> Result<(Vec<u8>, TensorInfo), String> {
    let [rows, cols] = info.shape[..] else {
        return Err(format!("a column slice of a {}-d tensor", info.shape.len()));
    };
    if start + len > cols || info.dtype == DType::U8 {
        return Err(format!("columns {start}..{} of a [{rows}, {cols}] {:?} tensor", start + len, info.dtype));
    }
    let elem = info.dtype.size();
    let mut out = Vec::with_capacity(rows * len * elem);
    for r in 0..rows {
        out.extend_from_slice(&data[(r * cols + start) * elem..(r * cols + start + len) * elem]);
    }
    Ok((out, TensorInfo { name: info.name.clone(), dtype: info.dtype, shape: vec![rows, len] }))
}

/// Copies rank `rank`'s part of a row-major tensor into the front of `dst`; returns its bytes.
pub fn copy_shard(data: &[u8], info: &TensorInfo, shard: Shard, rank: usize, dst: &mut [u8]) -> Result<usize, String> {
    let elem = info.dtype.size();
    match shard {
        Shard::Whole => {
            let n = data.len();
            dst.get_mut(..n).ok_or("the slot is too small")?.copy_from_slice(data);
            Ok(n)
        }
        Shard::Split { dim, parts } => {
            let (dim, parts) = (dim as usize, parts as usize);
            let size = *info.shape.get(dim).ok_or_else(|| format!("split dim {dim} of a {}-d tensor", info.shape.len()))?;
            if parts == 0 || size % parts != 0 || rank >= parts {
                return Err(format!("dim {dim} of size {size} cannot be split in {parts} parts for rank {rank}"));
            }
            let outer: usize = info.shape[..dim].iter().product();
            let inner: usize = info.shape[dim + 1..].iter().product::<usize>() * elem;
            // NVFP4 packs two values per byte along the last dim: the split is over bytes (U8).
            debug_assert!(info.dtype != DType::U8 || elem == 1);
            let chunk = size / parts * inner;
            let total = outer * chunk;
            let dst = dst.get_mut(..total).ok_or("the slot is too small")?;
            for o in 0..outer {
                let src = o * size * inner + rank * chunk;
                dst[o * chunk..(o + 1) * chunk].copy_from_slice(&data[src..src + chunk]);
            }
            Ok(total)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_takes_the_ranks_block_along_the_dim() {
        // [2, 4] u8 tensor: rows 0..2, cols 0..4.
        let data: Vec<u8> = (0..8).collect();
        let info = TensorInfo { name: "t".into(), dtype: DType::U8, shape: vec![2, 4] };
        let mut dst = [0u8; 4];
        assert_eq!(copy_shard(&data, &info, Shard::Split { dim: 1, parts: 2 }, 1, &mut dst), Ok(4));
        assert_eq!(dst, [2, 3, 6, 7]);
        assert_eq!(copy_shard(&data, &info, Shard::Split { dim: 0, parts: 2 }, 1, &mut dst), Ok(4));
        assert_eq!(dst, [4, 5, 6, 7]);
        let bf = TensorInfo { name: "b".into(), dtype: DType::BF16, shape: vec![2, 2] };
        let mut d2 = [0u8; 4];
        assert_eq!(copy_shard(&data, &bf, Shard::Split { dim: 1, parts: 2 }, 0, &mut d2), Ok(4));
        assert_eq!(d2, [0, 1, 4, 5]);
        assert!(copy_shard(&data, &info, Shard::Split { dim: 1, parts: 3 }, 0, &mut dst).is_err());
    }

    /// A BF16 `[n, k]` tensor of distinct values, little-endian bytes.
    fn bf16_matrix(n: usize, k: usize) -> (Vec<u8>, TensorInfo) {
        let v: Vec<f32> = (0..n * k).map(|i| ((i * 37 % 101) as f32 - 50.0) / 16.0).collect();
        let bytes = v.iter().flat_map(|&x| crate::numerics::f32_to_bf16(x).to_le_bytes()).collect();
        (bytes, TensorInfo { name: "w".into(), dtype: DType::BF16, shape: vec![n, k] })
    }

    #[test]
    fn a_column_slice_is_those_columns_of_every_row() {
        let (data, info) = bf16_matrix(3, 8);
        let (cols, sliced) = column_slice(&data, &info, 2, 4).unwrap();
        assert_eq!(sliced.shape, [3, 4]);
        for r in 0..3 {
            assert_eq!(cols[r * 8..(r + 1) * 8], data[(r * 8 + 2) * 2..(r * 8 + 6) * 2]);
        }
        assert!(column_slice(&data, &info, 6, 4).is_err(), "past the last column");
    }

    /// Each part of the bind-time quantisation is what ModelOpt's recipe (`quantize_nvfp4`, as
    /// `kiln quantize` writes checkpoints) gives the tensor's values, in the checkpoint's dtypes
    /// and shapes, and a rank's share of the codes is its rows of them.
    #[test]
    fn nvfp4_parts_are_the_quantisation_of_the_whole_tensor() {
        let (n, k) = (4, 32);
        let (data, info) = bf16_matrix(n, k);
        let values: Vec<f32> = data.chunks_exact(2).map(|b| crate::numerics::bf16_to_f32(u16::from_le_bytes([b[0], b[1]]))).collect();
        let (codes, scales, scale_2) = crate::numerics::quantize_nvfp4(&values, n, k);
        let part = |p| nvfp4_part(&data, &info, p).unwrap();
        assert_eq!(part(Nvfp4Part::Codes), (codes.clone(), TensorInfo { name: "w".into(), dtype: DType::U8, shape: vec![n, k / 2] }));
        assert_eq!(part(Nvfp4Part::Scales).0, scales);
        assert_eq!(part(Nvfp4Part::Scales).1.dtype, DType::F8E4M3);
        assert_eq!(part(Nvfp4Part::Scale2).0, scale_2.to_le_bytes());
        let (c, ci) = part(Nvfp4Part::Codes);
        let mut dst = vec![0u8; c.len() / 2];
        copy_shard(&c, &ci, Shard::Split { dim: 0, parts: 2 }, 1, &mut dst).unwrap();
        assert_eq!(dst, codes[codes.len() / 2..]);
        assert!(nvfp4_part(&data[..16], &TensorInfo { shape: vec![1, 8], ..info.clone() }, Nvfp4Part::Codes).is_err(), "K of 8");
    }

    /// A rank quantises only its share of a tensor (rows, or whole 16-value blocks of columns)
    /// and must get exactly that share of the whole tensor's quantisation, for every part, split
    /// and rank; a share of columns that cuts blocks falls back to the whole.
    #[test]
    fn a_ranks_quantised_share_is_its_share_of_the_whole_quantisation() {
        let (n, k) = (8, 64);
        let (mut data, info) = bf16_matrix(n, k);
        // one block of zeros (scale 1.0) and the tensor's largest magnitude in row 5 only
        data[2 * (3 * k + 16)..2 * (3 * k + 32)].fill(0);
        data[2 * (5 * k + 7)..2 * (5 * k + 8)].copy_from_slice(&crate::numerics::f32_to_bf16(-40.0).to_le_bytes());
        let mut shares = 0;
        for part in [Nvfp4Part::Codes, Nvfp4Part::Scales] {
            let (whole, whole_info) = nvfp4_part(&data, &info, part).unwrap();
            for (dim, parts) in [(0, 2), (0, 4), (1, 2), (1, 4), (1, 8)] {
                let shard = Shard::Split { dim, parts };
                if part == Nvfp4Part::Scales && parts == 8 {
                    assert!(nvfp4_piece(&data, &info, part, shard, 0).is_err(), "4 scale columns in 8 parts");
                    continue;
                }
                for rank in 0..parts as usize {
                    let mut expected = vec![0u8; whole.len() / parts as usize];
                    copy_shard(&whole, &whole_info, shard, rank, &mut expected).unwrap();
                    match nvfp4_piece(&data, &info, part, shard, rank).unwrap() {
                        Some((got, got_info)) => {
                            assert_eq!(got, expected, "{part:?} {shard:?} rank {rank}");
                            assert_eq!(got_info.shape.iter().product::<usize>(), expected.len(), "{part:?} {shard:?}");
                            shares += 1;
                        }
                        // codes split 8 ways along K: 8 values a rank, half a block
                        None => assert_eq!((part, dim, parts), (Nvfp4Part::Codes, 1, 8)),
                    }
                }
            }
        }
        assert_eq!(shares, 2 * 12);
        assert!(nvfp4_piece(&data, &info, Nvfp4Part::Scale2, Shard::Split { dim: 0, parts: 2 }, 0).is_err());
        assert!(nvfp4_piece(&data, &info, Nvfp4Part::Codes, Shard::Split { dim: 0, parts: 3 }, 0).is_err(), "8 rows in 3 parts");
    }

    /// The largest magnitude read off the BF16 bits is the f32 fold's (NaN skipped).
    #[test]
    fn bf16_amax_is_the_largest_magnitude() {
        let values = [1.5f32, -7.25, 3.0, f32::NAN, -0.0, 6.5];
        let bytes: Vec<u8> = values.iter().flat_map(|&x| crate::numerics::f32_to_bf16(x).to_le_bytes()).collect();
        assert_eq!(crate::numerics::bf16_amax(&bytes), 7.25);
        assert_eq!(crate::numerics::bf16_amax(&bytes[..2]), 1.5);
        assert_eq!(crate::numerics::bf16_amax(&[]), 0.0);
    }
}
