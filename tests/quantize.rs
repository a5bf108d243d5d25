//! `kiln quantize`: the BF16 golden checkpoint (made by transformers, tests/oracle) quantised to
//! ModelOpt NVFP4 with a calibration the test makes up. Every quantised weight is checked against
//! the NVFP4 definition (glm5.md 4.3) element by element: the global scale is amax / (6 * 448),
//! each block scale is the E4M3 rounding of the block amax / (6 * global scale), and each code is
//! a nearest E2M1 value of the scaled element. Everything else is copied byte for byte, the input
//! scales are the calibrated amax / (6 * 448), and the result compiles and runs. Bad calibrations
//! and sources are refused naming the module or tensor.

use kiln_runtime::bind::CheckpointFiles;
use kiln_runtime::numerics::{bf16_to_f32, e2m1_to_f32, e4m3_to_f32, f32_to_e4m3, E2M1_VALUES};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

const GLOBAL: f32 = 6.0 * 448.0;

fn kiln(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_kiln")).args(args).output().expect("run kiln")
}

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("kiln-quantize-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn source() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/goldens/bf16/ckpt")
}

/// The linears GLM-5-NVFP4 quantises, read off the source's tensor names: every MLP, expert and
/// shared-expert projection (attention, indexer, router, embeddings and head stay BF16).
fn quantised_modules(src: &CheckpointFiles) -> Vec<String> {
    let mut m: Vec<String> = src
        .names()
        .filter(|n| n.contains(".mlp.") && !n.contains(".mlp.gate.") && n.ends_with("_proj.weight"))
        .map(|n| n.trim_end_matches(".weight").to_string())
        .collect();
    m.sort();
    m
}

fn f32s(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect()
}

fn write_calibration(path: &Path, amax: &BTreeMap<String, f32>) {
    std::fs::write(path, serde_json::to_string(amax).unwrap()).unwrap();
}

fn calibration(modules: &[String]) -> BTreeMap<String, f32> {
    modules.iter().enumerate().map(|(i, m)| (m.clone(), 0.75 + (i % 11) as f32 * 0.5)).collect()
}

#[test]
fn quantised_weights_follow_the_nvfp4_definition_and_the_rest_is_copied() {
    let dir = scratch("ok");
    let src = CheckpointFiles::open(&source()).unwrap();
    let modules = quantised_modules(&src);
    assert!(modules.len() > 40, "{modules:?}");
    let amax = calibration(&modules);
    let cal = dir.join("calibration.json");
    write_calibration(&cal, &amax);
    let out = dir.join("nvfp4");
    let o = kiln(&["quantize", source().to_str().unwrap(), "--calibration", cal.to_str().unwrap(), "-o", out.to_str().unwrap()]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(String::from_utf8_lossy(&o.stderr).contains(&format!("{} linears in NVFP4", modules.len())));

    let q = CheckpointFiles::open(&out).unwrap();
    let mut copied = 0;
    for name in src.names() {
        let module = name.trim_end_matches(".weight");
        if modules.iter().any(|m| m == module) {
            continue;
        }
        assert_eq!(q.data(name), src.data(name), "{name} is copied unchanged");
        copied += 1;
    }
    let (mut elements, mut nonzero) = (0usize, 0usize);
    for m in &modules {
        let (_, h) = src.header(&format!("{m}.weight")).unwrap();
        let (n, k) = (h.shape[0], h.shape[1]);
        let w: Vec<f32> = src.data(&format!("{m}.weight")).unwrap().chunks_exact(2).map(|b| bf16_to_f32(u16::from_le_bytes([b[0], b[1]]))).collect();
        let shape = |t: &str| q.header(&format!("{m}.{t}")).map(|(_, h)| (h.dtype.clone(), h.shape.clone()));
        assert_eq!(shape("weight"), Some(("U8".into(), vec![n, k / 2])), "{m}");
        assert_eq!(shape("weight_scale"), Some(("F8_E4M3".into(), vec![n, k / 16])), "{m}");
        assert_eq!(shape("weight_scale_2"), Some(("F32".into(), vec![])), "{m}");
        assert_eq!(shape("input_scale"), Some(("F32".into(), vec![])), "{m}");
        assert_eq!(f32s(q.data(&format!("{m}.input_scale")).unwrap()), vec![amax[m] / GLOBAL], "{m}");
        let s2 = f32s(q.data(&format!("{m}.weight_scale_2")).unwrap())[0];
        assert_eq!(s2, w.iter().fold(0f32, |a, v| a.max(v.abs())) / GLOBAL, "{m}: global scale");
        let codes = q.data(&format!("{m}.weight")).unwrap();
        let scales = q.data(&format!("{m}.weight_scale")).unwrap();
        for r in 0..n {
            for b in 0..k / 16 {
                let block = &w[r * k + b * 16..][..16];
                let bmax = block.iter().fold(0f32, |a, v| a.max(v.abs()));
                let sf = scales[r * k / 16 + b];
                let want = if bmax == 0.0 { f32_to_e4m3(1.0) } else { f32_to_e4m3((bmax / (6.0 * s2)).max(2f32.powi(-9))) };
                assert_eq!(sf, want, "{m}: block scale of row {r} block {b}");
                let step = e4m3_to_f32(sf) * s2;
                for (j, &x) in block.iter().enumerate() {
                    let c = b * 16 + j;
                    let code = (codes[r * k / 2 + c / 2] >> (4 * (c % 2))) & 0xF;
                    let scaled = x / step;
                    let best = E2M1_VALUES.iter().map(|v| (scaled - v).abs()).fold(f32::INFINITY, f32::min);
                    let got = e2m1_to_f32(code);
                    assert!((scaled - got).abs() <= best * (1.0 + 1e-6), "{m}[{r},{c}]: {x} / {step} = {scaled} coded as {got}, nearest is {best} away");
                    assert!(got == 0.0 || got.is_sign_negative() == (x < 0.0), "{m}[{r},{c}]: sign");
                    elements += 1;
                    nonzero += (got != 0.0) as usize;
                }
            }
        }
    }
    assert!(copied > 30 && elements > 100_000 && nonzero * 2 > elements, "{copied} copied, {nonzero} of {elements} codes non-zero");

    // ModelOpt's config: NVFP4 in groups of 16 with GLM-5-NVFP4's exclusions.
    let qc: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(out.join("hf_quant_config.json")).unwrap()).unwrap();
    assert_eq!(qc["quantization"]["quant_algo"], "NVFP4");
    assert_eq!(qc["quantization"]["group_size"], 16);
    let excludes = qc["quantization"]["exclude_modules"].as_array().unwrap();
    for want in ["lm_head", "model.embed_tokens", "model.layers.*.self_attn*", "model.layers.*.mlp.gate"] {
        assert!(excludes.iter().any(|e| e == want), "{want} in {excludes:?}");
    }

    // The result is a checkpoint kiln compiles and runs.
    let art = dir.join("plan");
    let o = kiln(&["compile", out.to_str().unwrap(), "--target", "cpu", "--max-context", "64", "-o", art.to_str().unwrap()]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let logits = dir.join("logits.safetensors");
    let o = kiln(&["logits", art.to_str().unwrap(), "--ids", "1,2,3,4", "--out", logits.to_str().unwrap()]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
}

#[test]
fn bad_calibrations_and_sources_are_refused_by_name() {
    let dir = scratch("bad");
    let src = CheckpointFiles::open(&source()).unwrap();
    let modules = quantised_modules(&src);
    let run = |amax: &BTreeMap<String, f32>, from: &Path| {
        let cal = dir.join("cal.json");
        write_calibration(&cal, amax);
        let o = kiln(&["quantize", from.to_str().unwrap(), "--calibration", cal.to_str().unwrap(), "-o", dir.join("out").to_str().unwrap()]);
        let err = String::from_utf8_lossy(&o.stderr).into_owned();
        assert!(!o.status.success() && !err.contains("panicked"), "{err}");
        err
    };
    let mut missing = calibration(&modules);
    missing.remove(&modules[3]);
    let err = run(&missing, &source());
    assert!(err.contains("no input amax") && err.contains(&format!("`{}`", modules[3])), "{err}");

    let mut stray = calibration(&modules);
    stray.insert("model.layers.0.self_attn.o_proj".into(), 1.0);
    let err = run(&stray, &source());
    assert!(err.contains("`model.layers.0.self_attn.o_proj` is not a linear that is quantised"), "{err}");

    let mut nan = calibration(&modules);
    nan.insert(modules[0].clone(), 0.0);
    assert!(run(&nan, &source()).contains("not a positive finite number"));

    // A tensor the layout has no place for would be lost: refused.
    let extra = dir.join("extra");
    std::fs::create_dir_all(&extra).unwrap();
    std::fs::copy(source().join("config.json"), extra.join("config.json")).unwrap();
    let mut tensors: Vec<(String, Vec<usize>, Vec<u8>)> = src
        .names()
        .map(|n| (n.to_string(), src.header(n).unwrap().1.shape.clone(), src.data(n).unwrap().to_vec()))
        .collect();
    tensors.push(("model.layers.0.mlp.bonus.weight".into(), vec![2], vec![0; 4]));
    write_bf16_like(&extra.join("model.safetensors"), &src, &tensors);
    let err = run(&calibration(&modules), &extra);
    assert!(err.contains("`model.layers.0.mlp.bonus.weight` is not part of a glm_moe_dsa checkpoint"), "{err}");
}

/// Writes `tensors` (dtype taken from `src`, BF16 for new ones) as one safetensors file.
fn write_bf16_like(path: &Path, src: &CheckpointFiles, tensors: &[(String, Vec<usize>, Vec<u8>)]) {
    let mut header = serde_json::Map::new();
    let mut offset = 0;
    for (name, shape, data) in tensors {
        let dtype = src.header(name).map_or("BF16".to_string(), |(_, h)| h.dtype.clone());
        header.insert(name.clone(), serde_json::json!({"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + data.len()]}));
        offset += data.len();
    }
    let mut json = serde_json::to_vec(&header).unwrap();
    json.resize(json.len().next_multiple_of(8), b' ');
    let mut bytes = (json.len() as u64).to_le_bytes().to_vec();
    bytes.extend(json);
    for (_, _, data) in tensors {
        bytes.extend(data);
    }
    std::fs::write(path, bytes).unwrap();
}
