//! Writes checkpoints in the Hugging Face / ModelOpt NVFP4 layout: shards, index, and the data —
//! deterministic random values (`synth tiny`), holes (`synth glm5`), or a trained BF16
//! checkpoint's values quantised with calibrated activation scales (`kiln quantize`).

use super::layout::{checkpoint_tensors, Nvfp4Part, SynthSpec, SynthTensor, TensorInit};
use kiln_runtime::rng::{tensor_seed, Rng};
use super::SynthReport;
use crate::checkpoint::safetensors::{write_file, TensorToWrite};
use crate::checkpoint::INDEX_FILE;
use crate::error::CompileError;
use kiln_runtime::bind::CheckpointFiles;
use kiln_runtime::numerics::{bf16_to_f32, f32_to_bf16, quantize_nvfp4, E4M3_MAX};
use kiln_runtime::plan::DType;
use std::collections::{BTreeMap, HashMap};
use std::path::Path;

pub fn write_text(dir: &Path, name: &str, text: &str) -> Result<(), CompileError> {
    let path = dir.join(name);
    std::fs::write(&path, text).map_err(CompileError::io(&path))
}

/// Where the tensors' values come from.
pub enum Values<'a> {
    /// Sparse holes (a full-size skeleton), except the NVFP4 per-tensor scalars, which get real
    /// values: a zero `input_scale` would make activation quantisation divide by zero, so a
    /// skeleton runs (on zeros, without NaN) where a GPU has the memory.
    Holes,
    /// Deterministic random values per tensor name (`TensorInit`), with the spec's fixed input scale.
    Random { seed: u64 },
    /// A trained checkpoint: BF16/F32 tensors copied, NVFP4 linears quantised from their BF16
    /// weights, `input_scale = amax / (6 * 448)` from each module's calibrated input amax.
    Trained { source: &'a CheckpointFiles, input_amax: &'a BTreeMap<String, f32> },
}

/// Splits the tensor groups over `shards` files and writes them plus the index.
pub fn write_checkpoint(dir: &Path, spec: &SynthSpec, shards: usize, values: &Values) -> Result<SynthReport, CompileError> {
    let tensors = checkpoint_tensors(spec);
    let groups = tensors.iter().map(|t| t.group).max().unwrap_or(0) + 1;
    let shards = shards.clamp(1, groups);
    let shard_of = |group: usize| group * shards / groups;
    let name_of = |i: usize| format!("model-{:05}-of-{shards:05}.safetensors", i + 1);
    let bar = indicatif::ProgressBar::new(shards as u64).with_style(
        indicatif::ProgressStyle::with_template("{msg} [{bar:40}] {pos}/{len} shards").expect("template").progress_chars("=> "),
    );
    bar.set_message(format!("writing {}", dir.display()));
    let mut quantised: HashMap<String, (Vec<u8>, Vec<u8>, f32)> = HashMap::new();
    let mut weight_map = BTreeMap::new();
    let mut total = 0u64;
    for shard in 0..shards {
        let members: Vec<&SynthTensor> = tensors.iter().filter(|t| shard_of(t.group) == shard).collect();
        let data: Vec<Option<Vec<u8>>> = members
            .iter()
            .map(|t| match values {
                Values::Holes => Ok(hole_scalar(t, spec)),
                Values::Random { seed } => Ok(Some(tensor_bytes(t, *seed, spec, &mut quantised))),
                Values::Trained { source, input_amax } => trained_bytes(t, source, input_amax, &mut quantised).map(Some),
            })
            .collect::<Result<_, _>>()?;
        let to_write: Vec<TensorToWrite> = members
            .iter()
            .zip(&data)
            .map(|(t, d)| TensorToWrite { name: t.name.clone(), dtype: t.dtype, shape: t.shape.clone(), data: d.as_deref() })
            .collect();
        let file = name_of(shard);
        write_file(&dir.join(&file), &to_write)?;
        for t in &members {
            total += t.shape.iter().product::<usize>() as u64 * t.dtype.size() as u64;
            weight_map.insert(t.name.clone(), file.clone());
        }
        bar.inc(1);
    }
    bar.finish_and_clear();
    let index = serde_json::json!({"metadata": {"total_size": total}, "weight_map": weight_map});
    write_text(dir, INDEX_FILE, &(serde_json::to_string_pretty(&index).expect("json") + "\n"))?;
    Ok(SynthReport { files: shards, tensors: tensors.len(), data_bytes: total })
}

/// One tensor of the quantised checkpoint from the trained source.
fn trained_bytes(
    t: &SynthTensor,
    source: &CheckpointFiles,
    input_amax: &BTreeMap<String, f32>,
    quantised: &mut HashMap<String, (Vec<u8>, Vec<u8>, f32)>,
) -> Result<Vec<u8>, CompileError> {
    let (name, dtype, shape) = match &t.init {
        TensorInit::Nvfp4 { module, n, k, .. } => (format!("{module}.weight"), DType::BF16, vec![*n, *k]),
        _ => (t.name.clone(), t.dtype, t.shape.clone()),
    };
    let (file, header) = source.header(&name).ok_or_else(|| CompileError::MissingTensor {
        tensor: name.clone(),
        needed_for: "the quantised checkpoint".into(),
        looked_in: source.dir.display().to_string(),
    })?;
    if header.dtype() != Some(dtype) || header.shape != shape {
        return Err(CompileError::TensorMismatch {
            tensor: name,
            file: file.to_string(),
            expected_dtype: dtype,
            expected_shape: shape,
            found_dtype: header.dtype.clone(),
            found_shape: header.shape.clone(),
            hint: " (kiln quantize reads a BF16 checkpoint)".into(),
        });
    }
    let bytes = source.data(&name).expect("a tensor with a header has data");
    let TensorInit::Nvfp4 { module, n, k, part, .. } = &t.init else {
        return Ok(bytes.to_vec());
    };
    if *part == Nvfp4Part::InputScale {
        let amax = input_amax.get(module).copied().ok_or_else(|| CompileError::Option {
            option: "--calibration".into(),
            message: format!("no input amax for `{module}`, which is quantised to NVFP4"),
        })?;
        if !(amax.is_finite() && amax > 0.0) {
            return Err(CompileError::Option { option: "--calibration".into(), message: format!("`{module}`: input amax {amax} is not a positive finite number") });
        }
        // ModelOpt's static scale: FP4's largest magnitude times FP8 E4M3's maps amax to the top.
        return Ok((amax / (6.0 * E4M3_MAX)).to_le_bytes().to_vec());
    }
    let (packed, scales, scale_2) = quantised.entry(module.clone()).or_insert_with(|| {
        let w: Vec<f32> = bytes.chunks_exact(2).map(|b| bf16_to_f32(u16::from_le_bytes([b[0], b[1]]))).collect();
        quantize_nvfp4(&w, *n, *k)
    });
    Ok(match part {
        Nvfp4Part::Weight => packed.clone(),
        Nvfp4Part::Scale => scales.clone(),
        Nvfp4Part::Scale2 => scale_2.to_le_bytes().to_vec(),
        Nvfp4Part::InputScale => unreachable!("handled above"),
    })
}

/// A skeleton's one written value: the NVFP4 per-tensor scalars (`weight_scale_2` 1, `input_scale`
/// the spec's).
fn hole_scalar(t: &SynthTensor, spec: &SynthSpec) -> Option<Vec<u8>> {
    match &t.init {
        TensorInit::Nvfp4 { part: Nvfp4Part::Scale2, .. } => Some(1.0f32.to_le_bytes().to_vec()),
        TensorInit::Nvfp4 { part: Nvfp4Part::InputScale, .. } => Some(spec.input_scale.to_le_bytes().to_vec()),
        _ => None,
    }
}

fn normal_values(seed: u64, name: &str, count: usize, std: f32) -> Vec<f32> {
    let mut rng = Rng::new(tensor_seed(seed, name));
    (0..count).map(|_| rng.normal() as f32 * std).collect()
}

fn tensor_bytes(t: &SynthTensor, seed: u64, spec: &SynthSpec, quantised: &mut HashMap<String, (Vec<u8>, Vec<u8>, f32)>) -> Vec<u8> {
    let count: usize = t.shape.iter().product();
    let encode = |values: Vec<f32>, dtype: DType| -> Vec<u8> {
        match dtype {
            DType::BF16 => values.iter().flat_map(|v| f32_to_bf16(*v).to_le_bytes()).collect(),
            DType::F32 => values.iter().flat_map(|v| v.to_le_bytes()).collect(),
            other => unreachable!("synthetic {other} tensor"),
        }
    };
    match &t.init {
        TensorInit::Normal { std } => encode(normal_values(seed, &t.name, count, *std), t.dtype),
        TensorInit::Bias { std } => encode(normal_values(seed, &t.name, count, *std), t.dtype),
        TensorInit::NearOne => {
            let mut rng = Rng::new(tensor_seed(seed, &t.name));
            encode((0..count).map(|_| 0.8 + 0.4 * rng.uniform() as f32).collect(), t.dtype)
        }
        TensorInit::Nvfp4 { module, n, k, std, part } => {
            let (packed, scales, scale_2) = quantised
                .entry(module.clone())
                .or_insert_with(|| quantize_nvfp4(&normal_values(seed, module, n * k, *std), *n, *k));
            match part {
                Nvfp4Part::Weight => packed.clone(),
                Nvfp4Part::Scale => scales.clone(),
                Nvfp4Part::Scale2 => scale_2.to_le_bytes().to_vec(),
                Nvfp4Part::InputScale => spec.input_scale.to_le_bytes().to_vec(),
            }
        }
    }
}
