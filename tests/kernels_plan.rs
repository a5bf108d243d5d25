//! Kernels in whole plans, through the binary: every kernel of the full-size GLM-5 plan
//! (`--tp 8`, for sm_120a and sm_90a) assembles with ptxas without spills and inside the register
//! and shared-memory budgets and parses in the emulator, and so does every kernel of the sm_90a plans of the tiny model and
//! the oracle goldens; `kiln verify --backend emu` on the tiny demo plan (tp 1 and 2, both
//! targets) names no failing step; artifacts with kernels are byte-identical across compiles.

mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn kiln(args: &[&str]) -> Output {
    let o = Command::new(env!("CARGO_BIN_EXE_kiln")).args(args).output().expect("run kiln");
    assert!(o.status.success(), "kiln {args:?} failed:\n{}\n{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
    o
}

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("kiln-kplan-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

fn inspect_json(art: &Path) -> serde_json::Value {
    serde_json::from_slice(&kiln(&["inspect", s(art), "--json"]).stdout).unwrap()
}

#[test]
fn glm5_tp8_kernels_assemble_without_spills() {
    let Some(ptxas) = kiln_compiler::passes::assemble::find_ptxas() else {
        assert!(std::env::var_os("CI").is_none(), "CI must provide ptxas (scripts/test.sh installs the wheel)");
        eprintln!("note: ptxas not found (KILN_PTXAS, PATH, nvidia-cuda-nvcc-cu12 wheel); skipping the GLM-5 assembly check (CI installs it)");
        return;
    };
    let dir = scratch("glm5");
    kiln(&["synth", "glm5", "-o", s(&dir.join("ckpt"))]);
    for target in ["sm_120a", "sm_90a"] {
        let plan = dir.join(format!("plan-{target}"));
        let o = Command::new(env!("CARGO_BIN_EXE_kiln"))
            .args(["compile", s(&dir.join("ckpt")), "--target", target, "--tp", "8", "-o", s(&plan)])
            .env("KILN_PTXAS", &ptxas)
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        let j = inspect_json(&plan);
        let kernels = j["kernels"].as_array().unwrap();
        assert!(kernels.len() > 20, "{} kernels", kernels.len());
        let (mut max_regs, mut max_smem) = (0, 0);
        for k in kernels {
            let name = k["name"].as_str().unwrap();
            let r = &k["resources"];
            assert!(r.is_object(), "{name} was not assembled");
            assert_eq!(r["arch"], if target == "sm_90a" { "Sm90a" } else { "Sm120a" }, "{name}");
            assert_eq!(r["spill_store_bytes"], 0, "{name} spills");
            assert_eq!(r["spill_load_bytes"], 0, "{name} spills");
            let regs = r["registers"].as_u64().unwrap();
            let smem = r["smem_static_bytes"].as_u64().unwrap() + k["smem_dynamic_bytes"].as_u64().unwrap();
            assert!(regs <= 255 && smem <= 101_376, "{name}: {regs} registers, {smem} B shared memory");
            assert!(plan.join("kernels").join(format!("{name}.cubin")).is_file() && plan.join("kernels").join(format!("{name}.ptx")).is_file());
            // The emulator takes the PTX too: no construct it cannot run, and no register named
            // as a special register (ptxas reads the special register there; the emulator would not).
            let ptx = std::fs::read_to_string(plan.join("kernels").join(format!("{name}.ptx"))).unwrap();
            if let Err(e) = kiln_runtime::emu::Module::parse(&ptx, &format!("{name}.ptx")) {
                panic!("{name}: the emulator refuses its PTX: {e}");
            }
            max_regs = max_regs.max(regs);
            max_smem = max_smem.max(smem);
        }
        eprintln!("GLM-5 {target} tp8: {} kernels, at most {max_regs} registers and {max_smem} B shared memory, 0 spills", kernels.len());
        merged_blocks_of_different_sizes_are_all_resident(&plan, target);
        if target == "sm_120a" {
            shipped_artifact_equals(&plan);
        }
    }
    shipped_artifact_refuses_what_it_cannot_run(&dir.join("ckpt"));
    let _ = std::fs::remove_dir_all(&dir);
}

/// A launch merging parts of different block sizes runs every block at the larger size, so all
/// its blocks must be resident at once (a second wave would cost a block's whole time, more than
/// the launch saved): by threads, shared memory (1 KiB reserved per block) and ptxas's registers
/// per SM, sm_120a 1,536 / 100 KiB / 64K (`shared/reference/sm120_ptx.md`), sm_90a 2,048 /
/// 228 KiB / 64K.
fn merged_blocks_of_different_sizes_are_all_resident(art: &Path, target: &str) {
    let plan = kiln_runtime::plan::read_plan(art).unwrap();
    let (threads_per_sm, smem_per_sm) = if target == "sm_90a" { (2048, 228 << 10) } else { (1536, 100 << 10) };
    let mut checked = 0;
    for l in plan.programs.iter().flat_map(|p| &p.steps).flat_map(|s| &s.launches) {
        let k = plan.kernel(l.kernel);
        let sizes: std::collections::BTreeSet<u32> = k.parts.iter().map(|q| q.block[0]).collect();
        if sizes.len() < 2 {
            continue;
        }
        let r = k.resources.as_ref().unwrap_or_else(|| panic!("{} was not assembled", k.name));
        let threads = l.block[0];
        // (registers are allocated a warp's 256 at a time: a thread's count rounds up to 8)
        let per_sm = (threads_per_sm / threads).min(smem_per_sm / (l.smem_dynamic + r.smem_static_bytes + 1024)).min(65_536 / (r.registers.div_ceil(8) * 8 * threads));
        let blocks: u32 = l.grid.iter().product();
        assert!(blocks <= plan.target.sm_count * per_sm, "{}: {blocks} blocks of {threads} threads, {} registers and {} B shared memory: {per_sm} per SM on {} SMs", k.name, r.registers, l.smem_dynamic + r.smem_static_bytes, plan.target.sm_count);
        checked += 1;
    }
    eprintln!("GLM-5 {target}: {checked} merged launches of different block sizes, every block resident at once");
}

const SHIPPED: &str = "artifacts/GLM-5-NVFP4-sm120a-tp8";

fn shipped() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(SHIPPED)
}

/// The prebuilt plan in artifacts/ is what this kiln compiles, file for file (plan.bin, every
/// kernel's PTX and cubin, the manifest's checksums): rebuild it with
/// scripts/build-glm5-artifact.sh when this fails.
fn shipped_artifact_equals(fresh: &Path) {
    let stale = format!("{SHIPPED} is stale: rebuild it with scripts/build-glm5-artifact.sh");
    let read = |p: PathBuf| std::fs::read(&p).unwrap_or_else(|e| panic!("{}: {e}; {stale}", p.display()));
    assert!(read(shipped().join("plan.bin")) == read(fresh.join("plan.bin")), "plan.bin differs; {stale}");
    let names = |d: &Path| {
        let mut v: Vec<String> = std::fs::read_dir(d.join("kernels")).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
        v.sort();
        v
    };
    assert_eq!(names(&shipped()), names(fresh), "{stale}");
    for n in names(fresh) {
        assert!(read(shipped().join("kernels").join(&n)) == read(fresh.join("kernels").join(&n)), "kernels/{n} differs; {stale}");
    }
    let manifest = |d: &Path| -> serde_json::Value { serde_json::from_slice(&read(d.join("manifest.json"))).unwrap() };
    let (m, f) = (manifest(&shipped()), manifest(fresh));
    assert_eq!(m["files"], f["files"], "{stale}");
    assert!(m.get("checkpoint_dir").is_none(), "the shipped manifest names no local path");
    let j = inspect_json(&shipped());
    // 364,096 until q_a, kv_a and the indexer's wq_b were split over the ranks (3.39 GiB less
    // each); 393,664 since the shared experts' output stays live through the routed experts
    // (prefill_8192's workspace 550 -> 646 MiB); 393,344 since prefill attention takes the
    // split form (its absorbed q and softmax states for 8,192 tokens: 646 -> 679 MiB); 381,376
    // since prefill computes wq_b whole from a copy on every rank (1.22 GiB)
    assert_eq!(j["per_gpu"]["kv_token_capacity"], 381_376);
}

/// Without GPUs, serving the shipped plan is refused at once, naming the driver; weights whose
/// headers differ are refused naming the tensor, expected and found.
fn shipped_artifact_refuses_what_it_cannot_run(skeleton: &Path) {
    let fails = |args: &[&str], needles: &[&str]| {
        let mut c = Command::new(env!("CARGO_BIN_EXE_kiln"));
        c.args(args).env_remove("LD_LIBRARY_PATH");
        let o = c.output().unwrap();
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success() && !err.contains("panicked"), "kiln {args:?}: {err}");
        for n in needles {
            assert!(err.contains(n), "kiln {args:?}: stderr lacks {n:?}:\n{err}");
        }
    };
    let art = shipped();
    fails(&["serve", s(&art), "--port", "0"], &["--weights"]);
    if !Path::new("/dev/nvidia0").exists() {
        fails(&["serve", s(&art), "--weights", s(skeleton), "--backend", "cuda", "--port", "0"], &["driver"]);
    }
    // One tensor transposed in its shard's header (the same bytes, another shape).
    let edited = skeleton.parent().unwrap().join("edited");
    std::fs::create_dir_all(&edited).unwrap();
    let mut victim = None;
    for e in std::fs::read_dir(skeleton).unwrap() {
        let e = e.unwrap();
        let (name, to) = (e.file_name().to_string_lossy().into_owned(), edited.join(e.file_name()));
        if victim.is_none() && name.ends_with(".safetensors") {
            let (mut h, data_len) = common::read_shard_header(&e.path());
            let tensor = h.as_object().unwrap().iter().find(|(k, v)| k.ends_with("q_a_proj.weight") && v["shape"][0] != v["shape"][1]).map(|(k, _)| k.clone());
            if let Some(t) = tensor {
                let shape = h[&t]["shape"].as_array().unwrap().clone();
                h[&t]["shape"] = serde_json::json!([shape[1], shape[0]]);
                common::write_header_only_shard(&to, &h, data_len);
                victim = Some(t);
                continue;
            }
        }
        std::fs::hard_link(e.path(), &to).or_else(|_| std::fs::copy(e.path(), &to).map(|_| ())).unwrap();
    }
    let victim = victim.expect("a q_a_proj tensor");
    fails(&["verify-weights", s(&art), "--weights", s(&edited)], &[&format!("`{victim}`"), "the plan expects", "found", "d97b4c9dd6235d14"]);
}

/// The sm_90a plans of the tiny model (tp 1 and 2) and of the NVFP4 oracle goldens: each distinct
/// kernel (plans share most of them) assembles with ptxas for sm_90a without spills, within 255
/// registers and, with its largest launch's dynamic shared memory, within the limit.
#[test]
fn sm90a_plans_of_the_small_checkpoints_assemble_without_spills() {
    let Some(ptxas) = common::ptxas("the sm_90a plans") else { return };
    let dir = scratch("sm90-small");
    let tiny = dir.join("tiny");
    kiln(&["synth", "tiny", "-o", s(&tiny)]);
    let goldens = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/goldens");
    let mut ckpts: Vec<(PathBuf, &str)> = vec![(tiny.clone(), "1"), (tiny, "2")];
    ckpts.extend(["nvfp4_flatcfg", "nvfp4_groups"].map(|g| (goldens.join(g).join("ckpt"), "1")));
    // name -> (PTX, largest dynamic shared memory of its launches)
    let mut kernels: BTreeMap<String, (String, u32)> = BTreeMap::new();
    for (i, (ckpt, tp)) in ckpts.iter().enumerate() {
        let art = dir.join(format!("plan{i}"));
        kiln(&["compile", s(ckpt), "--target", "sm_90a", "--tp", tp, "--no-ptxas", "-o", s(&art)]);
        let plan = kiln_runtime::plan::read_plan(&art).unwrap();
        for p in &plan.programs {
            for l in p.steps.iter().flat_map(|st| &st.launches) {
                let k = &plan.kernels[l.kernel.0 as usize];
                let e = kernels.entry(k.name.clone()).or_insert_with(|| (k.ptx.clone(), 0));
                e.1 = e.1.max(l.smem_dynamic);
            }
        }
    }
    let list: Vec<(&String, &(String, u32))> = kernels.iter().collect();
    let threads = std::thread::available_parallelism().map_or(2, |n| n.get()).min(8);
    let results: Vec<(String, kiln_runtime::plan::Resources)> = std::thread::scope(|sc| {
        let handles: Vec<_> = list
            .chunks(list.len().div_ceil(threads))
            .map(|chunk| sc.spawn(|| chunk.iter().map(|(name, (ptx, smem))| ((*name).clone(), common::assemble_within_budget(&ptxas, name, ptx, *smem))).collect::<Vec<_>>()))
            .collect();
        handles.into_iter().flat_map(|h| h.join().expect("ptxas thread")).collect()
    });
    assert!(results.iter().all(|(_, r)| r.arch.name() == "sm_90a"));
    let max_regs = results.iter().map(|(_, r)| r.registers).max().unwrap_or(0);
    eprintln!("{} distinct sm_90a kernels of {} plans assemble without spills, at most {max_regs} registers", results.len(), ckpts.len());
    let _ = std::fs::remove_dir_all(&dir);
}

/// `kiln verify --backend emu` of the tiny plan for `target` at `tp`, compiled with `extra`
/// options; at decode batch 1 the NVFP4 weights are read once.
fn verify_tiny(target: &str, tp: &str, extra: &[&str]) {
    let dir = scratch(&format!("tiny-{target}-tp{tp}"));
    let (ckpt, plan) = (dir.join("ckpt"), dir.join("plan"));
    kiln(&["synth", "tiny", "-o", s(&ckpt)]);
    let mut args = vec!["compile", s(&ckpt), "--target", target, "--tp", tp, "--no-ptxas", "-o", s(&plan)];
    args.extend(extra);
    kiln(&args);
    let o = kiln(&["verify", s(&dir.join("plan")), "--backend", "emu"]);
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(out.contains("first step beyond tolerance: none"), "{out}");
    assert!(out.contains("first NaN/Inf: none"), "{out}");
    // Every step of every program ran (a GPU plan has no step without a kernel).
    assert!(out.contains("launched steps checked") && !out.contains("FAIL"), "{out}");
    // At decode batch 1 the NVFP4 GEMVs and the MoE read each needed weight byte once (the
    // 8 bytes of part scalars every GEMV block loads add under 3 % on the tiny model's rows).
    // Their total bytes stay within 1.5x the compulsory ones (weights + inputs once): GEMV
    // blocks narrow to one column per warp to fill the GPU (`gemv_tasks_per_block`) and each
    // stages the BF16 input row, 2K bytes against 8 x 9K/16 of NVFP4 weights: 1 + 4/9, plus
    // the scalars.
    let decode = &out[out.find("program decode_1 ").expect("decode_1 verified")..];
    let decode = &decode[..decode.find("\nprogram ").unwrap_or(decode.len())];
    let mut families = (0, 0);
    for l in decode.lines().filter(|l| (l.contains("linear_nvfp4") || l.contains("moe_nvfp4")) && l.contains(" ok ")) {
        // "... read / compulsory = R; weights W"
        let (total, weights) = l.rsplit_once("= ").unwrap().1.split_once("; weights ").unwrap();
        let (total, weights): (f64, f64) = (total.trim().parse().unwrap(), weights.trim().parse().unwrap());
        assert!((1.0..=1.5).contains(&total), "decode_1 byte ratio {total}:\n{l}");
        assert!((0.99..=1.03).contains(&weights), "decode_1 weight bytes read {weights} times:\n{l}");
        if l.contains("moe_nvfp4") { families.1 += 1 } else { families.0 += 1 }
    }
    assert!(families.0 > 0 && families.1 > 0, "NVFP4 GEMV and MoE lines in:\n{decode}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn verify_tiny_tp1_on_the_emulator() {
    verify_tiny("sm_120a", "1", &[]);
}

/// At TP 2 the prefill programs select their indexer lists across the ranks (each rank's rows
/// against the CPU's, then the gathered lists), decode splits every replicated projection
/// behind all-gathers, and prefill computes them whole from their copies.
#[test]
fn verify_tiny_tp2_on_the_emulator() {
    verify_tiny("sm_120a", "2", &["--sequence-parallel-indexer", "always", "--split-projections", "all", "--prefill-copies", "all"]);
}

/// The sm_90a kernels (e2m1 without cvt, decoded f16 mma) step by step against the CPU. Fewer
/// programs than the default plan keep it short but cover every form: the GEMVs and the MoE's
/// CUDA-core path (decode_1, decode_4, prefill_16), the tiled GEMMs (prefill_64, prefill_256) and
/// the MoE's tensor-core path (prefill_256: more than 64 tokens).
#[test]
fn verify_tiny_sm90a_tp1_on_the_emulator() {
    verify_tiny("sm_90a", "1", &["--prefill-chunk", "256", "--decode-batches", "1,4"]);
}

#[test]
fn verify_tiny_sm90a_tp2_on_the_emulator() {
    verify_tiny("sm_90a", "2", &["--prefill-chunk", "256", "--decode-batches", "1,4", "--sequence-parallel-indexer", "always"]);
}

/// A broken kernel is caught: verify fails and names the step (and the first NaN/Inf).
#[test]
fn verify_names_the_first_bad_step() {
    use kiln_runtime::plan::{read_plan, write_plan, KernelFamily};
    let dir = scratch("bad");
    kiln(&["synth", "tiny", "-o", s(&dir.join("ckpt"))]);
    kiln(&["compile", s(&dir.join("ckpt")), "--target", "sm_120a", "--no-ptxas", "-o", s(&dir.join("plan"))]);
    let clean = read_plan(&dir.join("plan")).unwrap();
    let first_norm = clean.programs.iter().find(|p| p.name == "decode_1").unwrap().steps.iter().position(|s| !s.launches.is_empty() && s.kernel == KernelFamily::RmsNorm).unwrap();
    for (from, to, needle) in [
        // scale by x instead of the weight: wrong values
        ("mul.rn.f32 %f13, %f12, %f11;", "mul.rn.f32 %f13, %f11, %f11;", format!("first step beyond tolerance: decode_1 step {first_norm} (rmsnorm")),
        // divide by zero: Inf / NaN
        ("div.rn.f32 %f10, %f9, %f8;", "div.rn.f32 %f10, %f9, 0f00000000;", format!("first NaN/Inf: decode_1 step {first_norm} (rmsnorm")),
    ] {
        let mut plan = clean.clone();
        for k in plan.kernels.iter_mut().filter(|k| k.family == KernelFamily::RmsNorm) {
            assert!(k.ptx.contains(from), "{from} not in {}", k.name);
            k.ptx = k.ptx.replace(from, to);
        }
        write_plan(&dir.join("plan"), &plan).unwrap();
        let o = Command::new(env!("CARGO_BIN_EXE_kiln")).args(["verify", s(&dir.join("plan")), "--program", "decode_1"]).output().unwrap();
        let out = String::from_utf8_lossy(&o.stdout);
        assert!(!o.status.success(), "verify accepted a broken kernel:\n{out}");
        assert!(out.contains(&needle), "expected {needle:?} in:\n{out}");
        assert!(String::from_utf8_lossy(&o.stderr).contains("verification failed at decode_1 step"));
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn artifacts_with_kernels_are_byte_identical() {
    let dir = scratch("det");
    kiln(&["synth", "tiny", "-o", s(&dir.join("ckpt"))]);
    for out in ["a", "b"] {
        kiln(&["compile", s(&dir.join("ckpt")), "--target", "sm_120a", "-o", s(&dir.join(out))]);
    }
    let mut files: Vec<PathBuf> = Vec::new();
    for sub in ["", "kernels"] {
        for e in std::fs::read_dir(dir.join("a").join(sub)).unwrap() {
            let p = e.unwrap().path();
            if p.is_file() {
                files.push(p.strip_prefix(dir.join("a")).unwrap().to_path_buf());
            }
        }
    }
    assert!(files.iter().any(|f| f.extension().is_some_and(|x| x == "ptx")));
    for f in files {
        assert_eq!(std::fs::read(dir.join("a").join(&f)).unwrap(), std::fs::read(dir.join("b").join(&f)).unwrap(), "{} differs", f.display());
    }
    let _ = std::fs::remove_dir_all(&dir);
}
