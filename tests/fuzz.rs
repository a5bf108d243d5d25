//! Mutation tests (seeded, a few thousand cases, seconds): the safetensors header reader, the
//! checkpoint reader and compiler behind it (config.json, the quant config, compile options) and
//! plan decoding never panic, hang or allocate without bound on corrupt input; what they accept
//! satisfies the invariants they promise. (Request parsing and the output parsers have their own
//! mutation tests beside them: src/server/request_fuzz.rs, engine/src/tool_calls.rs.)
//! `KILN_FUZZ_SCALE=20 KILN_FUZZ_SEED=7 cargo test --test fuzz` hunts longer and elsewhere.

mod common;

use kiln_compiler::{compile, CompileOptions};
use kiln_runtime::plan::{decode_plan, write_plan, PlanError};
use kiln_runtime::rng::Rng;
use kiln_runtime::safetensors::parse_header;
use serde_json::{json, Value};
use sha2::{Digest, Sha256};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("kiln-fuzz-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn tiny() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let dir = scratch("tiny").join("ckpt");
        kiln_compiler::synth::synth("tiny", &dir, 0).expect("synth tiny");
        dir
    })
}

/// `n` cases, times `KILN_FUZZ_SCALE` (default 1) for a longer hunt.
fn cases(n: usize) -> usize {
    n * std::env::var("KILN_FUZZ_SCALE").ok().and_then(|s| s.parse().ok()).unwrap_or(1)
}

/// The generator for `test`, moved by `KILN_FUZZ_SEED` to explore other inputs.
fn rng(test: u64) -> Rng {
    Rng::new(test ^ std::env::var("KILN_FUZZ_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or(0u64).wrapping_mul(0x9E37_79B9))
}

fn below(rng: &mut Rng, n: usize) -> usize {
    (rng.next_u64() % n.max(1) as u64) as usize
}

/// Values that break assumptions: zero, one, negative, huge, fractional, wrong types.
fn hostile(rng: &mut Rng) -> Value {
    match below(rng, 12) {
        0 => json!(0),
        1 => json!(1),
        2 => json!(-1),
        3 => json!(u64::MAX),
        4 => json!(1u64 << 32),
        5 => json!(1u64 << 62),
        6 => json!(2.5),
        7 => json!(1e300),
        8 => json!("16"),
        9 => Value::Null,
        10 => json!([3, 4]),
        _ => json!(below(rng, 70)),
    }
}

/// One structural edit somewhere in `v` (keys kept: the readers look them up by name).
fn mutate(v: &mut Value, rng: &mut Rng) {
    match v {
        Value::Object(map) if !map.is_empty() => {
            let key = map.keys().nth(below(rng, map.len())).cloned().unwrap();
            match below(rng, 8) {
                0 => {
                    map.remove(&key);
                }
                1 | 2 => {
                    map.insert(key, hostile(rng));
                }
                _ => mutate(map.get_mut(&key).unwrap(), rng),
            }
        }
        Value::Array(items) if !items.is_empty() && below(rng, 4) != 0 => {
            let i = below(rng, items.len());
            match below(rng, 5) {
                0 => {
                    items.remove(i);
                }
                1 => items.push(hostile(rng)),
                _ => mutate(&mut items[i], rng),
            }
        }
        _ => *v = hostile(rng),
    }
}

/// The first shard's header bytes and the file's length.
fn first_shard() -> (PathBuf, Vec<u8>, u64) {
    let path = tiny().join("model-00001-of-00002.safetensors");
    let bytes = std::fs::read(&path).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    (path, bytes[8..8 + n].to_vec(), bytes.len() as u64)
}

/// What `parse_header` promises of what it accepts: every tensor's data inside the data region,
/// covering it exactly, known dtypes sized and aligned exactly.
fn check_accepted(tensors: &[(String, kiln_runtime::safetensors::TensorHeader)], header_len: usize, file_len: u64) {
    let base = 8 + header_len as u64;
    let mut ranges: Vec<(u64, u64)> = Vec::new();
    for (name, t) in tensors {
        assert!(base <= t.data_start && t.data_start <= t.data_end && t.data_end <= file_len, "{name}: {t:?}");
        if let Some(dt) = t.dtype() {
            let elems = t.shape.iter().try_fold(1u64, |a, &d| a.checked_mul(d as u64)).expect("accepted shapes fit");
            assert_eq!(t.data_end - t.data_start, elems * dt.size() as u64, "{name}");
            assert_eq!(t.data_start % dt.size() as u64, 0, "{name}");
        }
        ranges.push((t.data_start, t.data_end));
    }
    ranges.sort();
    // The format's own rule: the data region is covered exactly, no holes, no overlaps.
    let mut at = base;
    for r in &ranges {
        assert_eq!(r.0, at, "a hole or an overlap accepted at {r:?}");
        at = r.1;
    }
    assert_eq!(at, file_len, "trailing bytes accepted");
}

#[test]
fn safetensors_headers_never_panic_and_what_is_accepted_is_sound() {
    let (path, header, file_len) = first_shard();
    let json: Value = serde_json::from_slice(&header).unwrap();
    let mut rng = rng(3);
    let (mut accepted, mut refused) = (0, 0);
    for case in 0..cases(3000) {
        let (bytes, len) = if case % 2 == 0 {
            // Structural: a tensor entry's dtype, shape or offsets made hostile.
            let mut v = json.clone();
            for _ in 0..1 + below(&mut rng, 3) {
                mutate(&mut v, &mut rng);
            }
            (serde_json::to_vec(&v).unwrap(), file_len)
        } else {
            // Bytes: flips, truncation, a shorter or longer file.
            let mut b = header.clone();
            for _ in 0..1 + below(&mut rng, 4) {
                let i = below(&mut rng, b.len());
                b[i] ^= 1 << below(&mut rng, 8);
            }
            if case % 7 == 1 {
                b.truncate(below(&mut rng, b.len()));
            }
            let len = match below(&mut rng, 4) {
                0 => below(&mut rng, file_len as usize) as u64,
                1 => file_len + below(&mut rng, 4096) as u64,
                _ => file_len,
            };
            (b, len)
        };
        match parse_header(&path, &bytes, len) {
            Ok(t) => {
                check_accepted(&t, bytes.len(), len);
                accepted += 1;
            }
            Err(e) => {
                assert!(e.to_string().contains(&*path.to_string_lossy()), "the error names the file: {e}");
                refused += 1;
            }
        }
    }
    // Both sides exercised: about 3 % of mutants stay valid safetensors (whitespace, names, values).
    assert!(accepted * 100 > cases(3000) && refused * 3 > cases(3000), "{accepted} accepted, {refused} refused");
}

/// A copy of the tiny checkpoint whose small files are replaced (the shards are linked), and
/// maybe with the first shard's header replaced (its data a sparse hole of the same length).
fn variant(dir: &Path, files: &[(&str, &Value)], shard_header: Option<&Value>) {
    let _ = std::fs::remove_dir_all(dir);
    std::fs::create_dir_all(dir).unwrap();
    for e in std::fs::read_dir(tiny()).unwrap() {
        let e = e.unwrap();
        let name = e.file_name();
        if files.iter().any(|(f, _)| name.to_str() == Some(*f)) {
            continue;
        }
        let to = dir.join(&name);
        if std::fs::hard_link(e.path(), &to).is_err() {
            std::fs::copy(e.path(), &to).unwrap();
        }
    }
    for (name, v) in files {
        std::fs::write(dir.join(name), serde_json::to_vec(v).unwrap()).unwrap();
    }
    if let Some(h) = shard_header {
        let path = first_shard().0;
        let (_, data_len) = common::read_shard_header(&path);
        common::write_header_only_shard(&dir.join(path.file_name().unwrap()), h, data_len);
    }
}

/// Random config.json / hf_quant_config.json / index / shard header values and compile options
/// through the whole compiler (CPU target, and sm_120a kernel generation without ptxas): an error naming the
/// problem or a plan, never a panic.
#[test]
fn hostile_configs_and_options_are_refused_or_compiled_never_panic() {
    let read = |f: &str| -> Value { serde_json::from_str(&std::fs::read_to_string(tiny().join(f)).unwrap()).unwrap() };
    let (config, quant, index) = (read("config.json"), read("hf_quant_config.json"), read("model.safetensors.index.json"));
    let header: Value = serde_json::from_slice(&first_shard().1).unwrap();
    let root = scratch("configs");
    let mut rng = rng(5);
    let (mut compiled, mut refused) = (0, 0);
    for case in 0..cases(300) {
        let (mut c, mut q, mut x, mut h) = (config.clone(), quant.clone(), index.clone(), None);
        for _ in 0..1 + below(&mut rng, 2) {
            match below(&mut rng, 10) {
                0 | 1 => mutate(&mut q, &mut rng),
                2 => mutate(&mut x, &mut rng),
                3 | 4 => mutate(h.get_or_insert_with(|| header.clone()), &mut rng),
                _ => mutate(&mut c, &mut rng),
            }
        }
        let mut opts = CompileOptions { target: if case % 10 == 0 { "sm_120a".into() } else { "cpu".into() }, assemble: false, ..Default::default() };
        if case % 4 == 0 {
            let pick = |rng: &mut Rng| [0usize, 1, 3, 16, 1000, 1 << 20, usize::MAX / 2, usize::MAX][below(rng, 8)];
            match below(&mut rng, 5) {
                0 => opts.prefill_chunk = pick(&mut rng),
                1 => opts.decode_batches = (0..below(&mut rng, 4)).map(|_| pick(&mut rng)).collect(),
                2 => opts.max_context = Some(pick(&mut rng)),
                3 => opts.gpu_memory = Some(pick(&mut rng) as u64),
                _ => opts.tp = [0, 3, 16, 1 << 40][below(&mut rng, 4)],
            }
        }
        let dir = root.join("ckpt");
        variant(&dir, &[("config.json", &c), ("hf_quant_config.json", &q), ("model.safetensors.index.json", &x)], h.as_ref());
        let outcome = std::panic::catch_unwind(|| compile(&dir, &opts).map(|_| ()).map_err(|e| e.to_string()));
        match outcome {
            Ok(Ok(())) => compiled += 1,
            Ok(Err(message)) => {
                assert!(!message.is_empty());
                refused += 1;
            }
            Err(_) => panic!("case {case} panicked: config {c}\nquant {q}\nindex or header changed: {}\noptions {opts:?}", x != index || h.is_some()),
        }
    }
    assert!(compiled > 20 && refused > 50, "{compiled} compiled, {refused} refused");
    let _ = std::fs::remove_dir_all(&root);
}

fn plan_bytes() -> Vec<u8> {
    let plan = compile(tiny(), &CompileOptions { target: "cpu".into(), ..Default::default() }).unwrap().plan;
    let dir = scratch("plan");
    write_plan(&dir, &plan).unwrap();
    std::fs::read(dir.join("plan.bin")).unwrap()
}

/// plan.bin: every unrehashed flip is refused by the checksum; with the checksum recomputed
/// (what a crafted file could do) the decoder itself refuses or decodes, never panics or
/// allocates past its bound.
#[test]
fn mutated_plans_are_refused_and_the_decoder_never_panics() {
    let original = plan_bytes();
    const HEADER: usize = 8 + 4 + 32;
    let path = PathBuf::from("plan.bin");
    assert!(decode_plan(path.clone(), &original).is_ok());
    let mut rng = rng(9);
    let (mut decoded, mut undecodable) = (0, 0);
    for case in 0..cases(2000) {
        let mut b = original.clone();
        for _ in 0..1 + below(&mut rng, 3) {
            let i = HEADER + below(&mut rng, b.len() - HEADER);
            b[i] = match below(&mut rng, 3) {
                0 => b[i] ^ (1 << below(&mut rng, 8)),
                1 => 0xff,
                _ => rng.next_u64() as u8,
            };
        }
        if case % 9 == 0 {
            b.truncate(HEADER + below(&mut rng, b.len() - HEADER));
        }
        if b == original {
            continue;
        }
        match decode_plan(path.clone(), &b) {
            Err(PlanError::Corrupt { message, .. }) => assert!(message.contains("checksum"), "{message}"),
            other => panic!("case {case}: a changed plan passed the checksum: {:?}", other.map(|_| ())),
        }
        let digest = Sha256::digest(&b[HEADER..]);
        b[12..HEADER].copy_from_slice(&digest);
        match std::panic::catch_unwind(|| decode_plan(path.clone(), &b)) {
            Ok(Ok(_)) => decoded += 1,
            Ok(Err(PlanError::Corrupt { message, .. })) => {
                assert!(!message.contains("checksum"), "{message}");
                undecodable += 1;
            }
            Ok(Err(e)) => panic!("case {case}: unexpected error {e}"),
            Err(_) => panic!("case {case}: decoding panicked"),
        }
    }
    assert!(undecodable > 500, "{decoded} decoded, {undecodable} refused");
}
