//! End-to-end tests of `kiln synth`, `kiln compile` and `kiln inspect` through the binary.

use kiln_compiler::checkpoint::safetensors::{read_header, write_file, TensorToWrite};
use kiln_runtime::plan::{read_plan, DType, Plan, Transform};
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::OnceLock;

fn kiln(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_kiln")).args(args).output().expect("run kiln")
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn ok(args: &[&str]) -> Output {
    let o = kiln(args);
    assert!(o.status.success(), "kiln {args:?} failed:\n{}", stderr(&o));
    o
}

/// Runs kiln expecting a clean failure: non-zero exit, no panic, every `needle` in stderr.
fn fails(args: &[&str], needles: &[&str]) -> String {
    let o = kiln(args);
    let err = stderr(&o);
    assert!(!o.status.success(), "kiln {args:?} should fail");
    assert!(!err.contains("panicked"), "kiln {args:?} panicked:\n{err}");
    for n in needles {
        assert!(err.contains(n), "kiln {args:?}: stderr lacks {n:?}:\n{err}");
    }
    err
}

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("kiln-test-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// One tiny checkpoint shared by the tests of this file (copied before mutation).
fn tiny() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let dir = scratch("tiny").join("ckpt");
        ok(&["synth", "tiny", "-o", s(&dir)]);
        dir
    })
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
    }
}

fn inspect_json(art: &Path) -> Value {
    let o = ok(&["inspect", s(art), "--json"]);
    serde_json::from_slice(&o.stdout).expect("inspect --json prints JSON")
}

#[test]
fn tiny_compiles_for_every_tp_and_both_moe_splits() {
    let root = scratch("tp");
    for tp in ["1", "2", "4", "8"] {
        for moe in ["tp", "ep"] {
            let art = root.join(format!("tp{tp}-{moe}"));
            ok(&["compile", s(tiny()), "--target", "cpu", "--tp", tp, "--moe-parallel", moe, "-o", s(&art)]);
            let j = inspect_json(&art);
            assert_eq!(j["tp"], tp.parse::<u64>().unwrap());
            let progs = j["programs"].as_array().unwrap();
            assert!(progs.iter().any(|p| p["kind"] == "prefill") && progs.iter().any(|p| p["kind"] == "decode"));
            // 1 embedding + 2 per layer (attention, MLP) + 1 logits gather when sharded.
            let layers = j["layers"].as_u64().unwrap();
            let want = if tp == "1" { 0 } else { 2 + 2 * layers };
            assert!(progs.iter().all(|p| p["collectives"] == want), "{tp}/{moe}: {progs:?}");
            assert!(j["ignored"][0].as_str().unwrap().contains("MTP"), "MTP layer is recognised and not bound");
            for f in ["tokenizer.json", "chat_template.jinja", "manifest.json"] {
                assert!(art.join(f).is_file(), "{f} copied/written");
            }
        }
    }
}

#[test]
fn same_input_gives_byte_identical_artifacts() {
    let root = scratch("determinism");
    let (a, b) = (root.join("a"), root.join("b"));
    for out in [&a, &b] {
        ok(&["compile", s(tiny()), "--target", "cpu", "--tp", "2", "-o", s(out)]);
    }
    for f in ["plan.bin", "manifest.json"] {
        assert_eq!(std::fs::read(a.join(f)).unwrap(), std::fs::read(b.join(f)).unwrap(), "{f} differs between compiles");
    }
    // synth itself is deterministic too.
    let again = root.join("tiny-again");
    ok(&["synth", "tiny", "-o", s(&again)]);
    for f in ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", "tokenizer.json"] {
        assert_eq!(std::fs::read(tiny().join(f)).unwrap(), std::fs::read(again.join(f)).unwrap(), "{f}");
    }
}

/// Per-GPU weight bytes of GLM-5-NVFP4 at TP 8, counted by hand from the tensor table
/// (glm5.md section 3/4) and kiln's sharding rules as documented, not from compiler code.
fn glm5_expected_weight_bytes_tp8() -> u64 {
    // plus the whole copy of wq_b that prefill programs compute from (every layer, BF16)
    glm5_expected_weight_bytes(8, 78, &["q_a", "kv_a", "wq_b"]) + 78 * 2 * 4096 * 2048
}

/// The same count for `tp` ranks and the first `layers` decoder layers (3 dense, then MoE), with
/// the `split` replicated projections split by output rows.
fn glm5_expected_weight_bytes(tp: u64, layers: u64, split: &[&str]) -> u64 {
    let (h, v) = (6144u64, 154880u64);
    let bf16 = |n: u64| 2 * n;
    let part = |name: &str, bytes: u64| if split.contains(&name) { bytes / tp } else { bytes };
    // NVFP4 [n, k] split over ranks: packed n*k/2 + scales n*k/16, bytes per rank.
    let fp4 = |n: u64, k: u64| n * k / 2 / tp + n * k / 16 / tp;
    let scalars = |count: u64| 4 * count;
    let embed_and_head = 2 * bf16(v * h) / tp;
    let attention = part("q_a", bf16(2048 * h)) + part("kv_a", bf16(576 * h)) // replicated unless split
        + (bf16(16384 * 2048) + bf16(28672 * 512) + bf16(h * 16384)) / tp // q_b, kv_b, o_proj: split
        + bf16(2048) + bf16(512); // q_a / kv_a layernorms
    let indexer = part("wq_b", bf16(4096 * 2048)) + part("wk", bf16(128 * h)) + bf16(2 * 128) + part("weights_proj", bf16(32 * h));
    let norms = bf16(2 * h);
    let dense = 2 * fp4(12288, h) + fp4(h, 12288) + scalars(2 * 3); // gate, up, down: scale_2 + input_scale each
    let expert = 2 * fp4(2048, h) + fp4(h, 2048) + scalars(2 * 3);
    let moe = bf16(256 * h) + 4 * 256 + 256 * expert + expert; // router + routed + shared
    let dense_layers = layers.min(3);
    embed_and_head + layers * (attention + indexer + norms) + dense_layers * dense + (layers - dense_layers) * moe + bf16(h)
}

/// `synth glm5 --layers 5`: GLM-5's own layer shapes cut to 3 dense + 2 MoE layers (what
/// scripts/gpu-check.sh times on one GPU). The weight count is the hand count's for 5 layers at
/// TP 1; the MTP layer follows the kept layers; the weights are holes (no disk), but the NVFP4
/// per-tensor scalars hold values, because a zero `input_scale` would turn the zeros into NaN.
#[test]
fn glm5_slice_keeps_the_real_layer_shapes() {
    let root = scratch("glm5-slice");
    let ckpt = root.join("ckpt");
    ok(&["synth", "glm5", "--layers", "5", "-o", s(&ckpt)]);
    let config: Value = serde_json::from_str(&std::fs::read_to_string(ckpt.join("config.json")).unwrap()).unwrap();
    assert_eq!(config["num_hidden_layers"], 5);
    assert_eq!(config["hidden_size"], 6144, "the rest of the config is GLM-5's");
    use std::os::unix::fs::{FileExt, MetadataExt};
    let mut names = Vec::new();
    let (mut apparent, mut allocated) = (0u64, 0u64);
    for entry in std::fs::read_dir(&ckpt).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "safetensors") {
            let file = std::fs::File::open(&path).unwrap();
            let meta = file.metadata().unwrap();
            (apparent, allocated) = (apparent + meta.len(), allocated + meta.blocks() * 512);
            for (name, h) in read_header(&path).unwrap() {
                let scalar = |name: &str| {
                    let mut b = [0u8; 4];
                    assert_eq!(h.data_end - h.data_start, 4, "{name} is a 4-byte scalar");
                    file.read_exact_at(&mut b, h.data_start).unwrap();
                    f32::from_le_bytes(b)
                };
                if name.ends_with(".input_scale") {
                    let v = scalar(&name);
                    assert!(v > 0.0 && v.is_finite(), "{name} = {v}");
                } else if name.ends_with(".weight_scale_2") {
                    assert_eq!(scalar(&name), 1.0, "{name}");
                }
                names.push(name);
            }
        }
    }
    // Reading 21 GiB of holes would take minutes: the file system's allocation says it instead.
    assert!(apparent > 20 << 30, "5 GLM-5 layers, embeddings and MTP hold > 20 GiB: {apparent}");
    assert!(allocated < 64 << 20, "the weights are holes: {allocated} bytes allocated on disk");
    assert!(names.iter().any(|n| n.starts_with("model.layers.4.mlp.experts.255.")), "layer 4 is MoE");
    assert!(names.iter().any(|n| n == "model.layers.5.eh_proj.weight"), "the MTP layer follows as layer 5");
    assert!(!names.iter().any(|n| n.starts_with("model.layers.6.")), "nothing past the MTP layer");
    assert!(ckpt.join("tokenizer.json").is_file(), "a stand-in tokenizer, so `kiln run` takes a prompt");

    let art = root.join("plan");
    ok(&["compile", s(&ckpt), "--target", "sm_90a", "--tp", "1", "--no-ptxas", "--max-context", "2048", "-o", s(&art)]);
    let j = inspect_json(&art);
    let by_kind: u64 = j["per_gpu"]["weight_bytes_by_kind"].as_array().unwrap().iter().map(|k| k["bytes"].as_u64().unwrap()).sum();
    assert_eq!(by_kind, glm5_expected_weight_bytes(1, 5, &[]), "weight bytes of 3 dense + 2 MoE layers at TP 1");

    fails(&["synth", "glm5", "--layers", "79", "-o", s(&root.join("x"))], &["--layers", "1..=78"]);
    fails(&["synth", "tiny", "--layers", "2", "-o", s(&root.join("y"))], &["--layers cuts the glm5 skeleton"]);
    let _ = std::fs::remove_dir_all(&root);
}

#[test]
fn glm5_skeleton_tp8_matches_independent_weight_count_and_public_kv_capacity() {
    let root = scratch("glm5");
    let ckpt = root.join("ckpt");
    ok(&["synth", "glm5", "-o", s(&ckpt)]);
    let art = root.join("plan");
    ok(&["compile", s(&ckpt), "--target", "sm_120a", "--tp", "8", "-o", s(&art)]);
    let j = inspect_json(&art);
    // The replicated projections the performance model splits behind a P2P all-gather: those
    // whose weight bytes a GPU stops streaming at batch 1 take longer at 1.792 TB/s x 0.85 than
    // the gather of one token's share: 8 µs + 7 x share / 50 GB/s, or only the 7 x share / 50
    // GB/s when it joins the gather of the projection just before it (kv_a after q_a), which it
    // may while the two shares at batch 64 fit the kernel's 64 KiB (wk after wq_b would not:
    // (1024 + 32) x 64 B). By hand, BF16 [rows, k], output bytes per rank and token:
    let full = |share: f64| 8.0 + 7.0 * share / 50e3;
    let joined = |share: f64| 7.0 * share / 50e3;
    assert!((512.0 + 144.0) * 64.0 <= 65536.0 && (1024.0 + 32.0) * 64.0 > 65536.0);
    let saved = |rows: f64, k: f64| rows * k * 2.0 * 7.0 / 8.0 / (1.792e6 * 0.85);
    for (name, rows, k, gather_us) in [
        ("q_a_proj", 2048.0, 6144.0, full(512.0)),
        ("kv_a_proj_with_mqa", 576.0, 6144.0, joined(144.0)),
        ("indexer.wq_b", 4096.0, 2048.0, full(1024.0)),
        ("indexer.wk", 128.0, 6144.0, full(32.0)),
        ("indexer.weights_proj", 32.0, 6144.0, full(16.0)),
    ] {
        let choice = j["sharding"].as_array().unwrap().iter().find(|c| c["what"].as_str().unwrap().starts_with(&format!("layers.*.self_attn.{name} "))).unwrap_or_else(|| panic!("no sharding choice for {name}"));
        assert_eq!(choice["how"].as_str().unwrap().starts_with("split by output rows"), saved(rows, k) > gather_us, "{name}: {choice}");
        // A split projection also keeps a whole copy for prefill where its gather of an
        // 8,192-token chunk (NCCL: 25 µs + bytes / 40 GB/s; only the transfer where it joins
        // q_a's) costs at least 4x what the rows a rank lacks add there: their bytes at 1.792
        // TB/s x 0.85 and their FLOPs at 0.4 PFLOP/s (wq_b 1,703 µs against 310; q_a 864
        // against 465; kv_a 236 against 131).
        let chunk_bytes = 8192.0 * rows * 2.0;
        let chunk_gather = if name == "kv_a_proj_with_mqa" { chunk_bytes / 40e3 } else { 25.0 + chunk_bytes / 40e3 };
        let lacking = 7.0 / 8.0 * (rows * k * 2.0 / (1.792e6 * 0.85) + 2.0 * 8192.0 * rows * k / 0.4e9);
        let copied = choice["how"].as_str().unwrap().contains("prefill computes it whole from a copy");
        assert_eq!(copied, saved(rows, k) > gather_us && chunk_gather >= 4.0 * lacking, "{name}: {choice}");
        // The decode batches whose gather of the copied projection (wq_b alone in its gather;
        // P2P while a rank's share fits 64 KiB) takes longer than computing it whole adds: 16,
        // 32 and 64 (batch 8: 9.1 µs against 9.9; batch 16: 10.3 against 10.2)
        if copied {
            let batches: Vec<u32> = [1u32, 2, 4, 8, 16, 32, 64]
                .into_iter()
                .filter(|&b| {
                    let b = b as f64;
                    assert!(b * rows / 8.0 * 2.0 <= 65536.0);
                    let gather = 8.0 + 7.0 * b * rows / 8.0 * 2.0 / 50e3;
                    gather > 7.0 / 8.0 * (rows * k * 2.0 / (1.792e6 * 0.85) + 2.0 * b * rows * k / 0.4e9)
                })
                .collect();
            assert_eq!(batches, [16, 32, 64]);
            let listed = batches.iter().map(|b| b.to_string()).collect::<Vec<_>>().join(", ");
            assert!(choice["how"].as_str().unwrap().ends_with(&format!("as do decode programs of batch {listed}")), "{name}: {choice}");
            let plan = read_plan(&art).unwrap();
            for p in plan.programs.iter().filter(|p| !p.is_draft()) {
                let kiln_runtime::plan::ProgramKind::Decode { batch } = p.kind else { continue };
                let gathers = p.steps.iter().filter(|s| matches!(s.op, kiln_runtime::plan::Op::AllGather { .. })).count();
                let whole = batches.contains(&(batch as u32));
                assert_eq!(gathers, if whole { 1 + 78 } else { 1 + 2 * 78 }, "{}", p.name);
            }
        }
    }
    let g = &j["per_gpu"];
    let by_kind: u64 = g["weight_bytes_by_kind"].as_array().unwrap().iter().map(|k| k["bytes"].as_u64().unwrap()).sum();
    assert_eq!(by_kind, glm5_expected_weight_bytes_tp8(), "per-GPU weight bytes");
    let arena = g["weight_bytes"].as_u64().unwrap();
    assert!(arena >= by_kind && arena - by_kind < 256 * 100_000, "arena adds only alignment padding");

    // KV: latent 512 + rope 64 + indexer key 128 values per token and layer, BF16, 78 layers.
    let per_token = 78 * (512 + 64 + 128) * 2;
    assert_eq!(g["kv_bytes_per_token"], per_token);
    // The RoPE table: (cos, sin) F32 per position (202,752) and pair (32).
    assert_eq!(g["rope_table_bytes"], 202_752 * 64 * 4);
    let left = g["gpu_memory_bytes"].as_u64().unwrap() - arena - g["workspace_bytes"].as_u64().unwrap() - g["headroom_bytes"].as_u64().unwrap() - g["rope_table_bytes"].as_u64().unwrap();
    let capacity = g["kv_token_capacity"].as_u64().unwrap();
    assert_eq!(capacity, left / (64 * per_token) * 64, "KV takes what is left, in 64-token pages");
    // Public figure (SGLang, rtx6kpro): 314,304 BF16 tokens per GPU at TP8. kiln plans the rest
    // of memory exactly instead of reserving a fraction for a caching allocator, so it may hold
    // more, but it must be the same order.
    let public = 314_304f64;
    let ratio = capacity as f64 / public;
    assert!((0.9..1.3).contains(&ratio), "KV capacity {capacity} vs public {public} (ratio {ratio:.2})");

    // The same compile in 40 GB does not fit and says by how much.
    let err = fails(
        &["compile", s(&ckpt), "--target", "sm_120a", "--tp", "8", "--gpu-memory", "40GB", "-o", s(&root.join("small"))],
        &["does not fit", "more than available", "weights 52."],
    );
    assert!(!root.join("small").join("plan.bin").exists(), "no artifact on failure: {err}");

    // FP8 indexer keys: a row of (512 + 64) BF16 values (1,152 B), 128 codes and a 4-byte scale,
    // padded to 16 B: 1,296 B a layer; the cache takes what is left in pages of those, and every
    // cache write and indexer launch reads and writes that row (KEY_FP8, ROW 648 values)
    let fp8 = root.join("fp8");
    ok(&["compile", s(&ckpt), "--target", "sm_120a", "--tp", "8", "--no-ptxas", "--indexer-keys", "fp8", "-o", s(&fp8)]);
    let f = inspect_json(&fp8);
    let g8 = &f["per_gpu"];
    assert_eq!(g8["kv_index_keys"], "fp8");
    let fp8_per_token = 78 * (((512 + 64) * 2 + 128 + 4) as u64).next_multiple_of(16);
    assert_eq!(g8["kv_bytes_per_token"], fp8_per_token);
    let left = g8["gpu_memory_bytes"].as_u64().unwrap() - g8["weight_bytes"].as_u64().unwrap() - g8["workspace_bytes"].as_u64().unwrap() - g8["headroom_bytes"].as_u64().unwrap() - g8["rope_table_bytes"].as_u64().unwrap();
    assert_eq!(g8["kv_token_capacity"].as_u64().unwrap(), left / (64 * fp8_per_token) * 64);
    assert!(g8["kv_token_capacity"].as_u64().unwrap() > capacity, "FP8 keys hold more tokens than BF16 ones");
    let keyed: Vec<&str> = f["kernels"].as_array().unwrap().iter().filter_map(|k| k["name"].as_str()).filter(|n| n.starts_with("kv_cache_write") || n.starts_with("indexer_topk")).collect();
    assert!(!keyed.is_empty());
    for n in keyed {
        assert!(n.contains("row648") && (n.ends_with("key_fp81") || n.contains("key_fp81_")), "{n}: not the FP8 row");
    }
}

/// The NVFP4 checkpoints compile for the H200 (`--target sm_90a`): the tiny model (TP 1, 2 and 8,
/// and expert-parallel), the NVFP4 oracle goldens and the GLM-5 skeleton at TP 8. Every step gets its
/// launches (a missing kernel fails the compile), and every kernel is rendered for sm_90a without
/// the sm_120a-only instructions (cvt to or from e2m1, block-scaled FP4 mma). ptxas assembly of
/// these plans is tests/kernels_plan.rs'.
#[test]
fn nvfp4_checkpoints_compile_for_sm_90a() {
    use kiln_runtime::plan::KernelFamily;
    let root = scratch("sm90");
    let goldens = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/goldens");
    let glm5 = root.join("glm5");
    ok(&["synth", "glm5", "-o", s(&glm5)]);
    let mut cases: Vec<(PathBuf, Vec<&str>)> = ["1", "2", "8"].iter().map(|tp| (tiny().to_path_buf(), vec!["--tp", tp])).collect();
    cases.push((tiny().to_path_buf(), vec!["--tp", "2", "--moe-parallel", "ep"]));
    cases.extend(["nvfp4_flatcfg", "nvfp4_groups"].map(|g| (goldens.join(g).join("ckpt"), vec![])));
    cases.push((glm5, vec!["--tp", "8"]));
    for (i, (ckpt, extra)) in cases.iter().enumerate() {
        let art = root.join(format!("plan{i}"));
        let mut args = vec!["compile", s(ckpt), "--target", "sm_90a", "--no-ptxas", "-o", s(&art)];
        args.extend(extra.iter().copied());
        ok(&args);
        let plan = read_plan(&art).unwrap();
        assert_eq!(plan.target.name, "sm_90a");
        let what = format!("{} {extra:?}", ckpt.display());
        for p in &plan.programs {
            for (n, st) in p.steps.iter().enumerate() {
                assert!(st.kernel == KernelFamily::Collective || !st.launches.is_empty(), "{what}: {} step {n} ({}) has no kernel", p.name, st.op.name());
            }
        }
        assert!(plan.kernels.iter().any(|k| k.family == KernelFamily::LinearNvfp4), "{what}: no NVFP4 linear");
        for k in &plan.kernels {
            assert!(k.ptx.contains(".target sm_90a\n") && k.name.contains("_arch90_"), "{what}: {} is not an sm_90a kernel", k.name);
            for sm120_only in ["e2m1x2", "kind::mxf4", "block_scale"] {
                assert!(!k.ptx.contains(sm120_only), "{what}: {} uses {sm120_only}", k.name);
            }
        }
        if extra.contains(&"8") && ckpt.ends_with("glm5") {
            // H200: 141 GiB (as the driver reports it) holds far more KV than the RTX PRO 6000.
            let j = inspect_json(&art);
            assert_eq!(j["per_gpu"]["gpu_memory_bytes"], 143_771u64 << 20);
            assert!(j["per_gpu"]["kv_token_capacity"].as_u64().unwrap() > 600_000, "{}", j["per_gpu"]);
        }
    }
    let _ = std::fs::remove_dir_all(&root);
}

/// Rewrites one shard, letting `edit` drop tensors (None) or change dtype/shape (data zeroed
/// when the size changes).
fn rewrite_shard(path: &Path, edit: impl Fn(&str, DType, &[usize]) -> Option<(DType, Vec<usize>)>) {
    let bytes = std::fs::read(path).unwrap();
    let tensors = read_header(path).unwrap();
    let mut kept = Vec::new();
    for (name, h) in &tensors {
        let dtype = h.dtype().unwrap();
        if let Some((dt, shape)) = edit(name, dtype, &h.shape) {
            let size = shape.iter().product::<usize>() * dt.size();
            let data = if size == (h.data_end - h.data_start) as usize {
                bytes[h.data_start as usize..h.data_end as usize].to_vec()
            } else {
                vec![0u8; size]
            };
            kept.push((name.clone(), dt, shape, data));
        }
    }
    let to_write: Vec<TensorToWrite> =
        kept.iter().map(|(n, d, s, data)| TensorToWrite { name: n.clone(), dtype: *d, shape: s.clone(), data: Some(data) }).collect();
    write_file(path, &to_write).unwrap();
}

fn shard_of(ckpt: &Path, tensor: &str) -> PathBuf {
    let index: Value = serde_json::from_str(&std::fs::read_to_string(ckpt.join("model.safetensors.index.json")).unwrap()).unwrap();
    ckpt.join(index["weight_map"][tensor].as_str().unwrap())
}

fn broken_copy(name: &str) -> (PathBuf, PathBuf) {
    let root = scratch(name);
    let ckpt = root.join("ckpt");
    copy_dir(tiny(), &ckpt);
    (ckpt, root.join("plan"))
}

fn compile_fails(ckpt: &Path, out: &Path, needles: &[&str]) -> String {
    fails(&["compile", s(ckpt), "--target", "cpu", "-o", s(out)], needles)
}

#[test]
fn bad_checkpoints_fail_with_the_culprit_named() {
    // Not a directory.
    compile_fails(Path::new("/nonexistent/ckpt"), Path::new("/tmp/never"), &["/nonexistent/ckpt", "not found"]);

    // Malformed config.json.
    let (ckpt, out) = broken_copy("badjson");
    std::fs::write(ckpt.join("config.json"), "{\"hidden_size\": 12,").unwrap();
    compile_fails(&ckpt, &out, &["config.json", "malformed JSON"]);

    // Unknown architecture.
    let (ckpt, out) = broken_copy("arch");
    let mut cfg: Value = serde_json::from_str(&std::fs::read_to_string(tiny().join("config.json")).unwrap()).unwrap();
    cfg["architectures"] = serde_json::json!(["LlamaForCausalLM"]);
    cfg["model_type"] = "llama".into();
    std::fs::write(ckpt.join("config.json"), cfg.to_string()).unwrap();
    compile_fails(&ckpt, &out, &["unsupported architecture", "LlamaForCausalLM"]);

    // Missing config field.
    let (ckpt, out) = broken_copy("field");
    let mut cfg: Value = serde_json::from_str(&std::fs::read_to_string(tiny().join("config.json")).unwrap()).unwrap();
    cfg.as_object_mut().unwrap().remove("index_topk");
    std::fs::write(ckpt.join("config.json"), cfg.to_string()).unwrap();
    compile_fails(&ckpt, &out, &["index_topk", "missing"]);

    // Unsupported quantisation.
    let (ckpt, out) = broken_copy("fp8");
    std::fs::write(ckpt.join("hf_quant_config.json"), r#"{"quantization": {"quant_algo": "FP8"}}"#).unwrap();
    compile_fails(&ckpt, &out, &["hf_quant_config.json", "quant_algo", "FP8"]);

    // Missing tensor, still promised by the index.
    let t = "model.layers.1.self_attn.o_proj.weight";
    let (ckpt, out) = broken_copy("missing-indexed");
    rewrite_shard(&shard_of(&ckpt, t), |n, d, s| (n != t).then(|| (d, s.to_vec())));
    compile_fails(&ckpt, &out, &[t, "listed in model.safetensors.index.json"]);

    // Missing tensor, also gone from the index.
    let (ckpt, out) = broken_copy("missing");
    rewrite_shard(&shard_of(&ckpt, t), |n, d, s| (n != t).then(|| (d, s.to_vec())));
    let index_path = ckpt.join("model.safetensors.index.json");
    let mut index: Value = serde_json::from_str(&std::fs::read_to_string(&index_path).unwrap()).unwrap();
    index["weight_map"].as_object_mut().unwrap().remove(t);
    std::fs::write(&index_path, index.to_string()).unwrap();
    compile_fails(&ckpt, &out, &["missing tensor", t, "o_proj"]);

    // Wrong dtype.
    let (ckpt, out) = broken_copy("dtype");
    rewrite_shard(&shard_of(&ckpt, t), |n, d, s| Some((if n == t { DType::F16 } else { d }, s.to_vec())));
    compile_fails(&ckpt, &out, &[t, "expected BF16", "found F16"]);

    // Wrong shape.
    let (ckpt, out) = broken_copy("shape");
    rewrite_shard(&shard_of(&ckpt, t), |n, d, s| Some((d, if n == t { vec![s[0], s[1] / 2] } else { s.to_vec() })));
    compile_fails(&ckpt, &out, &[t, "expected BF16 [256, 256]", "found BF16 [256, 128]"]);

    // The quantization config and the tensors disagree.
    let (ckpt, out) = broken_copy("excluded");
    let q = std::fs::read_to_string(ckpt.join("hf_quant_config.json")).unwrap().replace("\"lm_head\",", "\"lm_head\", \"*experts*\",");
    std::fs::write(ckpt.join("hf_quant_config.json"), q).unwrap();
    compile_fails(&ckpt, &out, &["experts.0.gate_proj.weight", "expected BF16", "found U8", "excluded by pattern \"*experts*\""]);

    // Truncated header and truncated data.
    let (ckpt, out) = broken_copy("trunc-header");
    let shard = ckpt.join("model-00001-of-00002.safetensors");
    std::fs::OpenOptions::new().write(true).open(&shard).unwrap().set_len(1000).unwrap();
    compile_fails(&ckpt, &out, &["model-00001-of-00002.safetensors", "truncated"]);
    std::fs::OpenOptions::new().write(true).open(&shard).unwrap().set_len(3).unwrap();
    compile_fails(&ckpt, &out, &["model-00001-of-00002.safetensors", "truncated"]);
    let (ckpt, out) = broken_copy("trunc-data");
    let shard = ckpt.join("model-00002-of-00002.safetensors");
    let len = std::fs::metadata(&shard).unwrap().len();
    std::fs::OpenOptions::new().write(true).open(&shard).unwrap().set_len(len - 100).unwrap();
    compile_fails(&ckpt, &out, &["model-00002-of-00002.safetensors", "truncated or corrupt", "claims bytes"]);

    // Overlapping data: a later tensor pointed at an earlier one's bytes (same dtype and shape,
    // so only the overlap is wrong). The header is rewritten in place, padded with spaces.
    let (ckpt, out) = broken_copy("overlap");
    let (a, b) = ("model.layers.0.input_layernorm.weight", "model.layers.1.input_layernorm.weight");
    let shard = shard_of(&ckpt, a);
    assert_eq!(shard, shard_of(&ckpt, b), "the test needs both in one shard");
    let mut bytes = std::fs::read(&shard).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let mut header: serde_json::Map<String, Value> = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let (oa, ob) = (header[a]["data_offsets"].clone(), header[b]["data_offsets"].clone());
    let (a, b) = if oa[0].as_u64() < ob[0].as_u64() { (a, b) } else { (b, a) };
    header.get_mut(b).unwrap()["data_offsets"] = header[a]["data_offsets"].clone();
    let mut text = serde_json::to_vec(&header).unwrap();
    assert!(text.len() <= n);
    text.resize(n, b' ');
    bytes[8..8 + n].copy_from_slice(&text);
    std::fs::write(&shard, bytes).unwrap();
    compile_fails(&ckpt, &out, &[a, b, "overlap"]);

    // A FIFO in place of a shard is refused at once (opening it would wait for a writer forever).
    let (ckpt, out) = broken_copy("fifo");
    let shard = ckpt.join("model-00002-of-00002.safetensors");
    std::fs::remove_file(&shard).unwrap();
    assert!(Command::new("mkfifo").arg(&shard).status().unwrap().success());
    let t = std::time::Instant::now();
    compile_fails(&ckpt, &out, &["model-00002-of-00002.safetensors", "not a regular file"]);
    assert!(t.elapsed() < std::time::Duration::from_secs(10));
}

#[test]
fn bad_options_and_artifacts_fail_cleanly() {
    let out = scratch("opts").join("plan");
    fails(&["compile", s(tiny()), "--target", "sm_100", "-o", s(&out)], &["--target", "sm_100", "sm_120a"]);
    fails(&["compile", s(tiny()), "--target", "cpu", "--tp", "3", "-o", s(&out)], &["--tp", "3"]);
    fails(&["compile", s(tiny()), "--target", "cpu", "--gpu-memory", "lots", "-o", s(&out)], &["--gpu-memory", "lots"]);
    fails(&["compile", s(tiny()), "--target", "cpu", "--max-context", "999999", "-o", s(&out)], &["--max-context", "999999"]);

    fails(&["inspect", "/nonexistent/plan"], &["/nonexistent/plan/plan.bin"]);
    let art = scratch("garbage");
    std::fs::write(art.join("plan.bin"), b"hello").unwrap();
    fails(&["inspect", s(&art)], &["not a kiln plan"]);
    let mut bytes = b"KILNPLAN".to_vec();
    bytes.extend(999u32.to_le_bytes());
    std::fs::write(art.join("plan.bin"), &bytes).unwrap();
    fails(&["inspect", s(&art)], &["format version 999", "recompile"]);
    let good = scratch("good");
    ok(&["compile", s(tiny()), "--target", "cpu", "-o", s(&good)]);
    let mut plan = std::fs::read(good.join("plan.bin")).unwrap();
    plan.truncate(plan.len() / 2);
    std::fs::write(art.join("plan.bin"), &plan).unwrap();
    fails(&["inspect", s(&art)], &["corrupt or from another kiln version", "recompile"]);
}

/// Runs kiln; panics if it died of a signal (an abort on a huge allocation, a crash).
fn exits(args: &[&str]) -> Output {
    let out = Command::new(env!("CARGO_BIN_EXE_kiln")).args(args).output().unwrap();
    assert!(out.status.code().is_some(), "kiln {args:?} died: {:?}\n{}", out.status, String::from_utf8_lossy(&out.stderr));
    out
}

#[test]
fn damaged_artifacts_are_refused_by_name_and_never_run() {
    let good = scratch("damage-good");
    ok(&["compile", s(tiny()), "--target", "cpu", "-o", s(&good)]);
    let plan = std::fs::read(good.join("plan.bin")).unwrap();
    let art = scratch("damage");
    for f in std::fs::read_dir(&good).unwrap() {
        let f = f.unwrap().path();
        if f.is_file() {
            std::fs::copy(&f, art.join(f.file_name().unwrap())).unwrap();
        }
    }
    // 40 single-bit flips anywhere in plan.bin (header included): every one refused, with the
    // artifact blamed (never the weights, never kiln), by `inspect` and by `run`.
    let mut x = 0x2545_f491_4f6c_dd1du64;
    for i in 0..40 {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let (byte, bit) = ((x % plan.len() as u64) as usize, (x >> 32) % 8);
        let mut bad = plan.clone();
        bad[byte] ^= 1 << bit;
        std::fs::write(art.join("plan.bin"), &bad).unwrap();
        let cmd: &[&str] = if i % 8 == 0 { &["run", s(&art), "--prompt", "hi", "--max-tokens", "2"] } else { &["inspect", s(&art)] };
        let out = exits(cmd);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "flip of bit {bit} of byte {byte} was accepted");
        assert!(err.contains("recompile") || err.contains("not a kiln plan"), "byte {byte}: {err}");
        assert!(!err.contains("kiln bug") && !err.contains("weights"), "byte {byte}: {err}");
    }
    // A damaged body whose checksum was recomputed (what a checksum cannot catch): decoding is
    // bounded, so a length turned huge is an error, never an abort on a vast allocation.
    use sha2::Digest;
    for byte in (44..plan.len()).step_by(plan.len() / 64 + 1) {
        let mut bad = plan.clone();
        bad[byte] = 0xfd;
        let sum = sha2::Sha256::digest(&bad[44..]);
        bad[12..44].copy_from_slice(&sum);
        std::fs::write(art.join("plan.bin"), &bad).unwrap();
        exits(&["inspect", s(&art)]);
    }
    // The files beside plan.bin are checked against the manifest's hashes.
    std::fs::write(art.join("plan.bin"), &plan).unwrap();
    let mut tok = std::fs::read(good.join("tokenizer.json")).unwrap();
    tok[10] ^= 1;
    std::fs::write(art.join("tokenizer.json"), &tok).unwrap();
    fails(&["run", s(&art), "--prompt", "hi", "--max-tokens", "2"], &["tokenizer.json", "checksum", "recompile"]);
    fails(&["logits", s(&art), "--ids", "1,2", "--out", s(&art.join("l.st"))], &["tokenizer.json", "checksum"]);
}

/// Overwrites the first bytes of `tensor`'s data in `ckpt` (whichever shard holds it).
fn overwrite_tensor(ckpt: &Path, tensor: &str, bytes: &[u8]) {
    let path = shard_of(ckpt, tensor);
    let headers = read_header(&path).unwrap();
    let (_, h) = headers.iter().find(|(n, _)| n == tensor).unwrap();
    let mut file = std::fs::read(&path).unwrap();
    let at = h.data_start as usize;
    file[at..at + bytes.len()].copy_from_slice(bytes);
    std::fs::remove_file(&path).unwrap(); // the copy may be a hard link of the shared checkpoint
    std::fs::write(&path, file).unwrap();
}

/// `kiln verify-weights` and `--check-weights`: NaN/Inf named per dtype, edited bytes caught by
/// the hashes `compile --hash-weights` records, and a clean checkpoint passes.
#[test]
fn damaged_weights_are_found_by_verify_weights() {
    let (ckpt, art) = broken_copy("verify-weights");
    let o = ok(&["compile", s(&ckpt), "--target", "cpu", "--hash-weights", "-o", s(&art)]);
    assert!(stderr(&o).contains("recorded the SHA-256 of"), "{}", stderr(&o));
    let manifest: Value = serde_json::from_str(&std::fs::read_to_string(art.join("manifest.json")).unwrap()).unwrap();
    assert!(manifest["files"]["weights.sha256.json"].is_string(), "the hashes are covered by the manifest");
    let o = ok(&["verify-weights", s(&art)]);
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(out.contains("no NaN or Inf") && out.contains("matches the SHA-256"), "{out}");

    // One NaN (BF16), one Inf (F32), a NaN block scale (FP8 E4M3): each named with its count.
    overwrite_tensor(&ckpt, "model.layers.3.input_layernorm.weight", &[0x00, 0x00, 0xc1, 0x7f]);
    overwrite_tensor(&ckpt, "model.layers.3.mlp.gate.e_score_correction_bias", &f32::INFINITY.to_le_bytes());
    overwrite_tensor(&ckpt, "model.layers.0.mlp.gate_proj.weight_scale", &[0x10, 0x7f]);
    let err = fails(
        &["verify-weights", s(&art)],
        &[
            "`model.layers.3.input_layernorm.weight`",
            "1 NaN and 0 Inf value(s), the first at element 1",
            "`model.layers.3.mlp.gate.e_score_correction_bias`",
            "0 NaN and 1 Inf",
            "`model.layers.0.mlp.gate_proj.weight_scale`",
            "re-download",
        ],
    );
    assert!(err.contains("its bytes differ from the SHA-256"), "edited tensors also fail their hash: {err}");
    fails(&["run", s(&art), "--check-weights", "--prompt", "hi", "--max-tokens", "2"], &["input_layernorm.weight", "NaN"]);

    // A finite edit (packed FP4 has no NaN) is caught only by the hash.
    let (ckpt, art) = broken_copy("verify-weights-fp4");
    ok(&["compile", s(&ckpt), "--target", "cpu", "--hash-weights", "-o", s(&art)]);
    overwrite_tensor(&ckpt, "model.layers.0.mlp.gate_proj.weight", &[0x12, 0x34]);
    let err = fails(&["verify-weights", s(&art)], &["`model.layers.0.mlp.gate_proj.weight`", "differ from the SHA-256"]);
    assert!(!err.contains("NaN and"), "{err}");

    // Without recorded hashes only NaN/Inf are checked, and the output says so; a recompile
    // without --hash-weights removes the old hashes.
    ok(&["compile", s(&ckpt), "--target", "cpu", "-o", s(&art)]);
    assert!(!art.join("weights.sha256.json").exists());
    let out = String::from_utf8_lossy(&ok(&["verify-weights", s(&art)]).stdout).into_owned();
    assert!(out.contains("no content hashes recorded") && out.contains("--hash-weights"), "{out}");

    // Edited hashes are a damaged artifact (the manifest covers them).
    ok(&["compile", s(&ckpt), "--target", "cpu", "--hash-weights", "-o", s(&art)]);
    let hashes = std::fs::read_to_string(art.join("weights.sha256.json")).unwrap();
    std::fs::write(art.join("weights.sha256.json"), hashes.replacen('a', "b", 1)).unwrap();
    fails(&["verify-weights", s(&art)], &["weights.sha256.json", "checksum", "recompile"]);
}

#[test]
fn inspect_reports_memory_programs_and_sharding() {
    let art = scratch("inspect").join("plan");
    ok(&["compile", s(tiny()), "--target", "cpu", "--tp", "4", "--decode-batches", "1,3", "--prefill-chunk", "64", "-o", s(&art)]);
    let text = String::from_utf8(ok(&["inspect", s(&art)]).stdout).unwrap();
    for needle in ["routed experts", "KV cache", "headroom", "decode_3", "prefill_64", "prefill_16", "DSA indexer", "replicated", "why:"] {
        assert!(text.contains(needle), "inspect lacks {needle:?}:\n{text}");
    }
    let j = inspect_json(&art);
    let names: Vec<&str> = j["programs"].as_array().unwrap().iter().map(|p| p["name"].as_str().unwrap()).collect();
    assert_eq!(names, ["prefill_16", "prefill_64", "decode_1", "decode_3"]);
    // Liveness reuse: the workspace is far smaller than all buffers laid end to end.
    let plan = kiln_runtime::plan::read_plan(&art).unwrap();
    let p = &plan.programs[plan.prefill_program(64, 0).unwrap()];
    let total: u64 = p.buffers.iter().map(|b| b.bytes).sum();
    assert!(p.workspace_bytes * 4 < total, "workspace {} vs sum of buffers {total}", p.workspace_bytes);
}

#[test]
fn decode_all_reduces_take_over_the_residual_add_and_norm_and_the_p2p_kernel_does_them_where_cheaper() {
    use kiln_runtime::plan::{read_plan, KernelFamily, Op, ProgramKind};
    // the shipped GLM-5 plan (tp 8): every all-reduce whose sum the next rmsnorm adds into the
    // residual, at decode, carries that add (2 per layer; the embedding's is followed by the first
    // norm, which has no residual yet); prefill keeps it in its one-block-per-row norm. The norm
    // then is the all-reduce's own (every layer's input norm after the first, the norm before
    // the MoE, the final norm)
    let art = Path::new(env!("CARGO_MANIFEST_DIR")).join("artifacts/GLM-5-NVFP4-sm120a-tp8");
    let plan = read_plan(&art).unwrap();
    for p in &plan.programs {
        let fused: Vec<usize> = (0..p.steps.len()).filter(|&s| matches!(p.steps[s].op, Op::AllReduce { residual: Some(_), .. })).collect();
        let decode = matches!(p.kind, ProgramKind::Decode { .. });
        assert_eq!(fused.len(), if decode { 2 * plan.model.num_hidden_layers } else { 0 }, "{}", p.name);
        for &s in &fused {
            let Op::AllReduce { buf, residual: Some(r), norm } = &p.steps[s].op else { unreachable!("filtered") };
            let n = norm.unwrap_or_else(|| panic!("{} step {s}: an all-reduce with a residual and no norm of it", p.name));
            // its normed rows are what the next step reads (the q_a group, the router, lm_head)
            assert!(p.steps[s + 1].op.reads().contains(&n.out) && n.out != *r, "{} step {s}: {n:?}", p.name);
            let families: Vec<(KernelFamily, &str)> = p.steps[s].launches.iter().map(|l| (plan.kernel(l.kernel).family, plan.kernel(l.kernel).template.as_str())).collect();
            // one token of hidden 6144 is 12 KiB: batches up to 4 fit the P2P kernel's one-shot
            // form, batches 8 to 32 (up to 384 KiB) its two-shot form (2 x (8 + 7 x share / 50
            // GB/s), against NCCL's 25 + bytes / 40 GB/s: 19.4 against 27.5 µs at batch 8, 29.8
            // against 34.8 at 32); batch 64's 768 KiB exceeds 8 shares of 64 KiB: NCCL. The kernel
            // adds and normalises in its one block at 50 GB/s, 5 x 12 KiB a token (1.2 µs), which
            // beats the add and norm launches (1.5 µs each and more) at batches 1 and 2 only;
            // elsewhere the P2P path launches them after the kernel, as the NCCL path does
            let batch = match p.kind {
                ProgramKind::Decode { batch } => batch,
                ProgramKind::Prefill { .. } => unreachable!("decode only"),
            };
            let one_shot = p.buffer(*buf).bytes <= kiln_runtime::plan::P2P_MAX_BYTES;
            let p2p = batch <= 32;
            let fused = batch <= 2;
            let nccl_path = [(KernelFamily::Add, "add"), (KernelFamily::RmsNorm, "rmsnorm")];
            let want: Vec<(KernelFamily, &str)> = if p2p { std::iter::once((KernelFamily::Collective, "p2p_collective")).chain(nccl_path).collect() } else { nccl_path.to_vec() };
            assert_eq!(families, want, "{} step {s}", p.name);
            assert_eq!(p.steps[s].p2p_collective(&plan), p2p, "{} step {s}", p.name);
            assert_eq!(p.steps[s].after_collective(&plan).len(), 2, "{} step {s}", p.name);
            assert_eq!(p.steps[s].after_p2p(&plan).len(), if p2p && !fused { 2 } else { 0 }, "{} step {s}", p.name);
            if p2p {
                let k = plan.kernel(p.steps[s].launches[0].kernel);
                let fused = Some(u64::from(fused));
                assert_eq!((k.param("ADD"), k.param("NORM"), k.param("TWO_SHOT")), (fused, fused, Some(u64::from(!one_shot))), "{}: {}", p.name, k.name);
            }
        }
        // no norm is left a step of its own at decode (q_a's and the first layer's input norm
        // belong to the groups after them)
        if decode {
            assert!(!p.steps.iter().any(|st| matches!(st.op, Op::RmsNorm { .. })), "{}", p.name);
        }
    }
}

#[test]
fn decode_projections_of_the_same_activations_are_one_launch() {
    use kiln_runtime::plan::{read_plan, Op, ProgramKind};
    // the shipped GLM-5 plan (tp 8): at decode, q_a, kv_a (this rank's rows), the indexer's wk
    // and head weights (of the normed hidden state) form one group, q_b and the indexer's wq_b
    // (of the normed q_a) another, each one launch of the BF16 GEMM with its members side by side
    // (SEGS), wq_b from its whole copy at batches 16 to 64 (where the model prices that below
    // the gather: `glm5_skeleton_tp8_matches_independent_weight_count_and_public_kv_capacity`);
    // prefill keeps them apart (its tiled GEMM has no segments). q_b's group carries
    // q_a's norm, and the first layer's q_a group its input norm (later layers' input norms are
    // the all-reduce's before them): a launch of its own before the group's, or, where the model
    // prices it lower, inside it (NORM): both at batch 1, neither from batch 4 (every block of
    // the fused form re-reads its rows); at batch 2 as the model prices each
    let art = Path::new(env!("CARGO_MANIFEST_DIR")).join("artifacts/GLM-5-NVFP4-sm120a-tp8");
    let plan = read_plan(&art).unwrap();
    let slot = |w: kiln_runtime::plan::WeightId| plan.weight(w).name.clone();
    for p in &plan.programs {
        let groups: Vec<&Op> = p.steps.iter().flat_map(|s| s.op.leaves()).filter(|op| matches!(op, Op::LinearGroup { .. })).collect();
        let decode = matches!(p.kind, ProgramKind::Decode { .. });
        assert_eq!(groups.len(), if decode { 2 * plan.model.num_hidden_layers } else { 0 }, "{}", p.name);
        for (s, step) in p.steps.iter().enumerate() {
            let Some(Op::LinearGroup { members, norm, .. }) = step.op.leaves().iter().find(|op| matches!(op, Op::LinearGroup { .. })) else { continue };
            // the group's launches: a merged launch's parts count as their own launches (the
            // cache write moved up beside q_b's group shares its first launch)
            let launches: Vec<kiln_runtime::plan::Launch> =
                step.launches.iter().flat_map(|l| plan.part_launches(l)).filter(|l| plan.kernel(l.kernel).template != "kv_cache_write").collect();
            let step = kiln_runtime::plan::Step { op: step.op.clone(), kernel: step.kernel, launches };
            let names: Vec<String> = members.iter().map(|g| slot(g.weight)).collect();
            let ends: Vec<&str> = names.iter().map(|n| n.rsplit_once(".self_attn.").map_or(n.as_str(), |(_, e)| e)).collect();
            let wq_b = match p.kind {
                ProgramKind::Decode { batch } if batch >= 16 => "indexer.wq_b.weight.whole",
                _ => "indexer.wq_b.weight",
            };
            assert!(
                ends == ["q_a_proj.weight", "kv_a_proj_with_mqa.weight", "indexer.wk.weight", "indexer.weights_proj.weight"] || ends == ["q_b_proj.weight", wq_b],
                "{} step {s}: group {names:?}", p.name
            );
            let normed = ends[0] == "q_b_proj.weight" || names[0].starts_with("layers.0.");
            assert_eq!(norm.is_some(), normed, "{} step {s}: {names:?}", p.name);
            let param = |l: &kiln_runtime::plan::Launch, name: &str| plan.kernel(l.kernel).params.iter().find(|(n, _)| n == name).map(|(_, v)| *v);
            if !normed {
                assert_eq!(step.launches.len(), 1, "{} step {s}: {names:?}", p.name);
                assert_eq!(param(&step.launches[0], "NORM"), Some(0), "{} step {s}", p.name);
                continue;
            }
            let batch = match p.kind {
                ProgramKind::Decode { batch } => batch,
                _ => unreachable!("groups are decode's"),
            };
            let fused = step.launches.len() == 1;
            match batch {
                1 => assert!(fused, "{} step {s}: {names:?} launches its norm apart at batch 1", p.name),
                2 => assert!(step.launches.len() <= 2, "{} step {s}: {names:?}", p.name),
                _ => assert_eq!(step.launches.len(), 2, "{} step {s}: {names:?} normalises inside from batch 4", p.name),
            }
            if !fused {
                assert_eq!(plan.kernel(step.launches[0].kernel).template, "rmsnorm", "{} step {s}", p.name);
            }
            let group = step.launches.last().unwrap();
            let k = plan.kernel(group.kernel);
            assert_eq!((param(group, "SEGS"), param(group, "NORM")), (Some(members.len() as u64), Some(fused as u64)), "{}: {}", p.name, k.name);
            // every member's output is still read after the group, by a later step
            for g in members {
                assert!(p.steps[s + 1..].iter().any(|t| t.op.reads().contains(&g.out)), "{} step {s}: {} is never read", p.name, p.buffer(g.out).name);
            }
        }
    }
}

#[test]
fn moe_launches_stage_the_routing_and_pass_prefill_mid_as_fp4_codes() {
    use kiln_runtime::plan::read_plan;
    // the shipped GLM-5 plan (tp 8, 256 local experts, top-8): every MoE down launch, the
    // 8,192-token chunk's included, stages the routing (9 bits a pair: 73.7 KB there, beside
    // groups of 64 tokens within the 99 KiB), so its blocks read the routing once each, not once
    // per used expert (76 MB a block, 26.6 GB a layer before); a layer's gate/up and down agree
    // on mid's format, and every prefill chunk passes it as FP4 codes and block scales (9/16 B a
    // value where each of down's 192 blocks read 2)
    let art = Path::new(env!("CARGO_MANIFEST_DIR")).join("artifacts/GLM-5-NVFP4-sm120a-tp8");
    let plan = read_plan(&art).unwrap();
    let mut programs = std::collections::BTreeSet::new();
    for p in &plan.programs {
        // MID_FP4 of the gate/up and the down launches, in the program's order (a layer's
        // gate/up may be merged into an earlier step's launch)
        let (mut gate_up, mut down) = (Vec::new(), Vec::new());
        for l in p.steps.iter().flat_map(|s| &s.launches).flat_map(|l| plan.part_launches(l)) {
            let k = plan.kernel(l.kernel);
            let param = |n: &str| k.params.iter().find(|(name, _)| name == n).map(|(_, v)| *v);
            match k.template.as_str() {
                "moe_down" => {
                    assert_eq!(param("STAGE"), Some(1), "{}: {}", p.name, k.name);
                    down.push(param("MID_FP4").unwrap());
                    programs.insert(p.name.clone());
                }
                "moe_gate_up" => gate_up.push(param("MID_FP4").unwrap()),
                _ => {}
            }
        }
        assert_eq!(gate_up, down, "{}: MID_FP4 of the gate/up and down launches", p.name);
        if p.name.starts_with("prefill") {
            assert!(down.iter().all(|&f| f == 1), "{}: MID_FP4 {down:?}", p.name);
        }
    }
    assert_eq!(programs.len(), plan.programs.len(), "a MoE down launch in every program: {programs:?}");
}

#[test]
fn attention_absorbs_kv_b_once_per_step_in_prefill_as_in_decode() {
    use kiln_runtime::plan::{attention_splits_cap, read_plan, LaunchArg, Op};
    // the shipped GLM-5 plan (tp 8): every attention, prefill chunks too, takes the split form:
    // q absorbed by W_UK in a launch of its own (kv_b read once a step, not once per token as
    // the fused prefill launch did: 3.7 MB a token, 7.5 GB a layer at 2,048 tokens), each split
    // of the top-k rows' softmax state (MODE 1), then the combine and the output projection by
    // W_UV (MODE 3, or MODE 1 and MODE 2), with its scratch sized for every token of the program.
    // Chunks of 512 tokens and more take a block per two tokens for the split states (`TT`: a
    // pair below index_topk reads its rows once) and project the contexts by W_UV as one batched tensor-core GEMM
    // (a head per grid.z: the contexts in `absorbed`, W_UV inside kv_b, the op's output), which
    // MODE 2 re-reads once per 32 rows of W_UV
    let art = Path::new(env!("CARGO_MANIFEST_DIR")).join("artifacts/GLM-5-NVFP4-sm120a-tp8");
    let plan = read_plan(&art).unwrap();
    let mut prefill_steps = 0;
    for p in &plan.programs {
        for (s, step) in p.steps.iter().enumerate() {
            let Some(&Op::MlaAttention { q, kv_b, heads, absorbed, partials, out, .. }) = step.op.leaves().iter().find(|op| matches!(op, Op::MlaAttention { .. })) else { continue };
            let tokens = p.buffer(q).shape[0];
            let latent = plan.model.kv_lora_rank;
            assert_eq!(p.buffer(absorbed).shape, [tokens, heads * latent], "{} step {s}", p.name);
            assert_eq!(p.buffer(partials).shape, [tokens, attention_splits_cap(tokens), heads * (latent + 4)], "{} step {s}", p.name);
            let parts: Vec<(String, Option<u64>)> = step
                .launches
                .iter()
                .flat_map(|l| plan.part_launches(l))
                .filter_map(|l| {
                    let k = plan.kernel(l.kernel);
                    let param = |name: &str| k.params.iter().find(|(n, _)| n == name).map(|(_, v)| *v);
                    if k.template == "mla_attention" && p.name.starts_with("prefill") && tokens >= 512 {
                        assert_eq!(param("TT"), Some(2), "{} step {s}: a {tokens}-token chunk's attention takes a block per two tokens", p.name);
                    }
                    match k.template.as_str() {
                        "mla_split" | "mla_attention" => Some((k.template.clone(), param("MODE"))),
                        "linear_bf16_gemm" if param("BATCH") == Some(heads as u64) => {
                            let want = [LaunchArg::Buffer(absorbed), LaunchArg::Weight(kv_b), LaunchArg::Buffer(out)];
                            assert_eq!(l.args[..3], want, "{} step {s}: the output GEMM's x, W and out", p.name);
                            Some((k.template.clone(), param("BATCH")))
                        }
                        _ => None,
                    }
                })
                .collect();
            let modes: Vec<(&str, u64)> = parts.iter().map(|(t, m)| (t.as_str(), m.unwrap_or(u64::MAX))).collect();
            let combined = [("mla_split", 0), ("mla_attention", 1), ("mla_split", 3)];
            let apart = [("mla_split", 0), ("mla_attention", 1), ("mla_split", 1), ("mla_split", 2)];
            let gemm = [("mla_split", 0), ("mla_attention", 1), ("mla_split", 1), ("linear_bf16_gemm", heads as u64)];
            assert!(modes == combined || modes == apart || modes == gemm, "{} step {s}: {modes:?}", p.name);
            if p.name.starts_with("prefill") && tokens >= 512 {
                assert!(modes == gemm, "{} step {s}: the output projection of a {tokens}-token chunk is not the batched GEMM: {modes:?}", p.name);
            }
            prefill_steps += usize::from(p.name.starts_with("prefill"));
        }
    }
    // (5 chunk sizes, and the 512- and 2,048-token chunks' programs for deep chunks)
    assert_eq!(prefill_steps, 7 * plan.model.num_hidden_layers, "every layer of the 7 prefill programs");
}

#[test]
fn prefill_indexer_takes_a_block_per_two_tokens_where_they_fill_the_sms() {
    use kiln_runtime::perf::Constants;
    use kiln_runtime::plan::{read_plan, Op, ProgramKind};
    // the shipped GLM-5 plan: the 8,192-token chunk selects across the 8 ranks (each its rows of
    // every 8th token, gathered right after: by the model the scoring saved outweighs the gather
    // even from position 0), the 2,048- and 512-token chunks only in second programs for chunks
    // deep in a context (from 0 they save nothing); prefill launches with at least a pair of
    // rows per SM (512 rows and more on sm_120a's 188 SMs) score and select a block per two rows
    // (`TT` = 2: a pair past index_topk loads each key once), smaller ones and decode a block per
    // token
    let art = Path::new(env!("CARGO_MANIFEST_DIR")).join("artifacts/GLM-5-NVFP4-sm120a-tp8");
    let plan = read_plan(&art).unwrap();
    let (consts, _) = Constants::for_target(&plan.target).unwrap();
    let ranks = plan.ranks();
    let (mut paired, mut across) = (Vec::new(), Vec::new());
    for p in &plan.programs {
        for (i, step) in p.steps.iter().enumerate() {
            let Some(&Op::IndexerTopK { head_weights, across_ranks, out, .. }) = step.op.leaves().iter().find(|op| matches!(op, Op::IndexerTopK { .. })) else { continue };
            let tokens = p.buffer(head_weights).shape[0];
            let rows = if across_ranks { tokens / ranks } else { tokens };
            if across_ranks {
                assert!(matches!(&p.steps[i + 1].op, Op::AllGather { pairs } if pairs.len() == 1 && pairs[0].input == out), "{}: no gather of the lists after step {i}", p.name);
                assert_eq!(p.buffer(out).shape, [rows, plan.model.index_topk], "{}", p.name);
                across.push(p.name.clone());
            }
            for l in step.launches.iter().flat_map(|l| plan.part_launches(l)) {
                let k = plan.kernel(l.kernel);
                if k.template != "indexer_topk" {
                    continue;
                }
                let param = |name: &str| k.params.iter().find(|(n, _)| n == name).map(|(_, v)| *v).unwrap();
                assert_eq!(param("STRIDE"), if across_ranks { ranks as u64 } else { 1 }, "{}: {}", p.name, k.name);
                let pairs = matches!(p.kind, ProgramKind::Prefill { .. }) && rows / 2 >= consts.sms as usize;
                // decode's scoring (MODE 1): a block per two rows wherever the rows are even
                let decode_pairs = param("MODE") == 1 && rows % 2 == 0;
                assert_eq!(param("TT"), if pairs || decode_pairs { 2 } else { 1 }, "{}: {}", p.name, k.name);
                if param("MODE") == 1 {
                    assert_eq!(l.grid[0] as usize, rows / param("TT") as usize, "{}", p.name);
                }
                if pairs {
                    assert_eq!((param("MODE"), l.grid), (0, [rows as u32 / 2, 1, 1]), "{}", p.name);
                    paired.push(p.name.clone());
                }
            }
        }
    }
    paired.dedup();
    across.dedup();
    assert_eq!(paired, ["prefill_512", "prefill_2048", "prefill_8192"]);
    assert_eq!(across, ["prefill_512_from_2680", "prefill_2048_from_1363", "prefill_8192"]);
    // the runtime takes a deep chunk's program from its position on, the first program of a
    // size before, and the largest chunk for longer prompts
    let name = |tokens, first| plan.programs[plan.prefill_program(tokens, first).unwrap()].name.as_str();
    assert_eq!([name(2048, 0), name(2048, 1362), name(1808, 1363), name(2048, 30_000)], ["prefill_2048", "prefill_2048", "prefill_2048_from_1363", "prefill_2048_from_1363"]);
    assert_eq!([name(300, 2679), name(512, 2680), name(129, 100_000), name(100, 100_000)], ["prefill_512", "prefill_512_from_2680", "prefill_512_from_2680", "prefill_128"]);
    assert_eq!([name(20_000, 0), name(3000, 50_000)], ["prefill_8192", "prefill_8192"]);
    for p in plan.programs.iter().filter(|p| p.from_position > 0) {
        assert_eq!(p.name, format!("prefill_{}_from_{}", p.tokens, p.from_position));
    }
    // `kiln inspect` shows the decision with the model's numbers
    let c = plan.sharding.iter().find(|c| c.what == "the DSA indexer's top-k in prefill chunks").expect("the indexer's prefill choice");
    let sizes = "32: every rank every token; 128: every rank every token; 512: across ranks from position 2680 (a second program), every rank every token before; 2048: across ranks from position 1363 (a second program), every rank every token before; 8192: across ranks";
    assert!(c.how.ends_with(sizes), "{c:?}");
    assert!(c.why.contains("2048 from 0: 0 µs saved") && c.why.contains("8192 from 0: "), "{c:?}");
}

/// `--draft mtp` binds the MTP layer the plan otherwise reports as ignored: draft programs of
/// every decode batch beside the model's, a fifth KV cache layer, the layer's weights (its
/// eh_proj as two column halves); and fails naming the culprit where it cannot: a model without
/// an MTP layer, a missing MTP tensor, and a GPU target, which has no kernel for the layer's BF16
/// experts and BF16 shared expert yet.
#[test]
fn draft_mtp_binds_the_mtp_layer_or_names_what_is_missing() {
    let root = scratch("draft-mtp");
    let (plain, mtp) = (root.join("plain"), root.join("mtp"));
    ok(&["compile", s(tiny()), "--target", "cpu", "--tp", "2", "-o", s(&plain)]);
    ok(&["compile", s(tiny()), "--target", "cpu", "--tp", "2", "--draft", "mtp", "-o", s(&mtp)]);
    let (a, b) = (read_plan(&plain).unwrap(), read_plan(&mtp).unwrap());
    assert!(!a.has_draft() && a.ignored.iter().any(|i| i.contains("MTP")));
    assert!(b.has_draft() && b.ignored.is_empty(), "{:?}", b.ignored);
    let names = |p: &Plan, draft: bool| p.programs.iter().filter(|q| q.is_draft() == draft).map(|q| q.name.clone()).collect::<Vec<_>>();
    assert_eq!(names(&b, false), names(&a, false), "the model's programs are unchanged");
    assert_eq!(names(&b, true), ["draft_1", "draft_2", "draft_4", "draft_8", "draft_16", "draft_32", "draft_64"]);
    assert_eq!((a.memory.kv.layers, b.memory.kv.layers), (4, 5));
    for p in &b.programs {
        assert!(p.hidden_out.is_some() && p.hidden_in.is_some() == p.is_draft(), "{}", p.name);
    }
    let eh: Vec<_> = b.weights.iter().filter(|w| w.name.contains("eh_proj")).collect();
    assert_eq!(eh.len(), 2, "eh_proj as its two column halves");
    for (half, w) in eh.iter().enumerate() {
        assert_eq!(w.sources[0].transform, Transform::Columns { start: (half * 256) as u32, len: 256 });
        assert_eq!(w.shape, [256, 256]);
    }
    let more: u64 = b.weights.iter().map(|w| w.bytes).sum::<u64>() - a.weights.iter().map(|w| w.bytes).sum::<u64>();
    assert!(more > 0, "the MTP layer's weights");

    // the goldens' bf16 model has no MTP layer
    let bf16 = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/goldens/bf16/ckpt");
    fails(&["compile", s(&bf16), "--target", "cpu", "--draft", "mtp", "-o", s(&root.join("x"))], &["num_nextn_predict_layers", "no MTP layer"]);
    // a checkpoint whose MTP layer lacks a tensor
    let (ckpt, out) = broken_copy("draft-mtp-missing");
    let shard = shard_of(&ckpt, "model.layers.4.hnorm.weight");
    rewrite_shard(&shard, |name, dtype, shape| (name != "model.layers.4.hnorm.weight").then(|| (dtype, shape.to_vec())));
    fails(&["compile", s(&ckpt), "--target", "cpu", "--draft", "mtp", "-o", s(&out)], &["model.layers.4.hnorm.weight"]);
    // GPU targets: the BF16 experts have no kernel yet
    fails(&["compile", s(tiny()), "--target", "sm_120a", "--no-ptxas", "--draft", "mtp", "-o", s(&root.join("gpu"))], &["moe_bf16", "BF16 experts have no template"]);
}

/// `--draft mtp-nvfp4`: the MTP layer's BF16 routed and shared experts become NVFP4 weights
/// quantised at bind (codes, block scales and scale_2 from the BF16 tensor, `Transform::Nvfp4`;
/// each activation scale the same module's of the last decoder layer), so a GPU target compiles:
/// the draft programs' MoE and shared expert run the NVFP4 kernels. The performance model then
/// prices the drafts of speculative decoding with the draft programs' own predicted steps.
#[test]
fn draft_mtp_nvfp4_compiles_for_gpus_and_prices_the_draft_steps() {
    use kiln_runtime::plan::{KernelFamily, LinearWeights, Nvfp4Part, Op, TensorChoice};
    let art = scratch("draft-mtp-nvfp4").join("plan");
    ok(&["compile", s(tiny()), "--target", "sm_120a", "--tp", "2", "--no-ptxas", "--draft", "mtp-nvfp4", "-o", s(&art)]);
    let plan = read_plan(&art).unwrap();
    let tensor = |w: kiln_runtime::plan::WeightId, i: usize| match &plan.weight(w).sources[i].tensor {
        TensorChoice::Same(t) => plan.tensors[*t as usize].clone(),
        other => panic!("{other:?}"),
    };
    let mut moe = 0;
    for p in plan.programs.iter().filter(|p| p.is_draft()) {
        for (step, leaf) in p.steps.iter().flat_map(|s| s.op.leaves().into_iter().map(move |l| (s, l))) {
            let Op::MoeExperts { gate_up, down, .. } = leaf else { continue };
            moe += 1;
            // (a launch merging may have joined it to its neighbour's)
            assert!(matches!(step.kernel, KernelFamily::MoeNvfp4 | KernelFamily::Merged), "{} {:?}", p.name, step.kernel);
            assert!(!step.launches.is_empty());
            for lw in [gate_up, down] {
                let LinearWeights::Nvfp4 { weight, scale, scale_2, input_scale } = *lw else { panic!("{lw:?}") };
                for (w, part) in [(weight, Nvfp4Part::Codes), (scale, Nvfp4Part::Scales), (scale_2, Nvfp4Part::Scale2)] {
                    assert_eq!(plan.weight(w).sources[0].transform, Transform::Nvfp4(part));
                    let t = tensor(w, 0);
                    assert!(t.name.starts_with("model.layers.4.mlp.experts.0.") && t.dtype == DType::BF16, "{t:?}");
                }
                let lent = tensor(input_scale, 0);
                assert!(lent.name.starts_with("model.layers.3.mlp.experts.0.") && lent.name.ends_with(".input_scale"), "{lent:?}");
            }
        }
    }
    assert_eq!(moe, 7, "one MoE step per draft program");

    // the speculative table's draft steps: the first of batch x (1 + k) rows, k - 1 of batch rows
    let context = 512;
    let (k, _) = kiln_runtime::perf::Constants::for_target(&plan.target).unwrap();
    let rows = kiln_runtime::perf::speculative::rows(&plan, &k, &[context]).unwrap();
    // (the first draft step's rows are one sequence's, at its next positions)
    let draft_ms = |r: usize| {
        let p = &plan.programs[plan.draft_program(r).unwrap()];
        let load = kiln_runtime::perf::Load::decode_rows(p.tokens, 1, r, context, |t| kiln_runtime::perf::uniform_experts(&plan, t), plan.ranks());
        kiln_runtime::perf::predict_program(&plan, p, &load, &k).unwrap().step_us(true) / 1e3
    };
    for (drafts, want) in [(1, draft_ms(2)), (3, draft_ms(4) + 2.0 * draft_ms(1))] {
        let row = rows.iter().find(|r| r.batch == 1 && r.drafts == drafts).unwrap();
        let got = row.draft_ms_p2p.unwrap();
        assert!((got - want).abs() < 1e-9, "{drafts} drafts: {got} ms, by hand {want}");
        let with = row.tokens_per_s_p2p_with_draft.as_ref().unwrap();
        let a = kiln_runtime::perf::speculative::ACCEPTANCE[1];
        let by_hand = kiln_runtime::perf::speculative::expected_tokens(a, drafts) / (row.step_ms_p2p + want) * 1e3;
        assert!((with[1] - by_hand).abs() < 1e-6 * by_hand, "{} against {by_hand}", with[1]);
        assert!(with[1] < row.tokens_per_s_p2p[1], "the draft steps cost time");
    }
    // a plan without a draft model has no draft figures
    let plain = scratch("draft-none").join("plan");
    ok(&["compile", s(tiny()), "--target", "sm_120a", "--tp", "2", "--no-ptxas", "-o", s(&plain)]);
    let plain = read_plan(&plain).unwrap();
    assert!(kiln_runtime::perf::speculative::rows(&plain, &k, &[context]).unwrap().iter().all(|r| r.draft_ms_p2p.is_none()));
}
