//! `kiln emu run` through the binary: buffers in and out, scalar arguments, reported traffic and
//! clean failures (no panics) for bad input.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn kiln(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_kiln")).args(args).output().expect("run kiln")
}

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("kiln-emu-cli-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn ptx(name: &str) -> String {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/ptx").join(name).display().to_string()
}

fn f32_file(path: &Path, v: &[f32]) -> String {
    std::fs::write(path, v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>()).unwrap();
    format!("buf:{}", path.display())
}

fn fails(args: &[&str], needles: &[&str]) {
    let o = kiln(args);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success(), "kiln {args:?} should fail");
    assert!(!err.contains("panicked"), "kiln {args:?} panicked:\n{err}");
    for n in needles {
        assert!(err.contains(n), "kiln {args:?}: stderr lacks {n:?}:\n{err}");
    }
}

#[test]
fn emu_run_vec_add_writes_buffers_back_and_reports_traffic() {
    let d = scratch("vec_add");
    let n = 300;
    let a: Vec<f32> = (0..n).map(|i| i as f32).collect();
    let b: Vec<f32> = (0..n).map(|i| 0.25 * i as f32).collect();
    let (sa, sb, sc) = (f32_file(&d.join("a.bin"), &a), f32_file(&d.join("b.bin"), &b), f32_file(&d.join("c.bin"), &vec![0.0; n]));
    let file = ptx("basic.ptx");
    let o = kiln(&["emu", "run", &file, "--entry", "vec_add", "--grid", "3", "--block", "128,1,1", "--arg", &sa, &sb, "--arg", &sc, "--arg", "u32:300"]);
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(out.contains("global memory: 2400 B read, 1200 B written"), "{out}");
    assert!(out.contains("c.bin.out (1200 B)"), "{out}");
    let c: Vec<f32> = std::fs::read(d.join("c.bin.out")).unwrap().chunks_exact(4).map(|x| f32::from_le_bytes(x.try_into().unwrap())).collect();
    for i in 0..n {
        assert_eq!(c[i], a[i] + b[i]);
    }
    // Input buffers are written back unchanged.
    assert_eq!(std::fs::read(d.join("a.bin")).unwrap(), std::fs::read(d.join("a.bin.out")).unwrap());
}

#[test]
fn emu_run_rejects_bad_input_cleanly() {
    let d = scratch("bad");
    let file = ptx("basic.ptx");
    let buf = f32_file(&d.join("x.bin"), &[0.0; 4]);
    fails(&["emu", "run", &file, "--entry", "vec_add", "--block", "32", "--arg", "i32:5"], &["--arg 'i32:5'", "unknown kind 'i32'"]);
    fails(&["emu", "run", &file, "--entry", "vec_add", "--block", "32", "--arg", "u32"], &["--arg 'u32'", "expected buf:PATH, u32:N, u64:N or f32:X"]);
    fails(&["emu", "run", &file, "--entry", "vec_add", "--block", "32", "--arg", "u32:-3"], &["'-3' is not a valid u32"]);
    fails(&["emu", "run", &file, "--entry", "vec_add", "--block", "32", "--arg", "f32:abc"], &["'abc' is not a number"]);
    fails(&["emu", "run", &file, "--entry", "vec_add", "--block", "32", "--arg", "buf:/nonexistent/x.bin"], &["cannot read buffer file /nonexistent/x.bin"]);
    fails(&["emu", "run", "/nonexistent/k.ptx", "--entry", "k", "--block", "32"], &["cannot read PTX file /nonexistent/k.ptx"]);
    fails(&["emu", "run", &file, "--entry", "nope", "--block", "32"], &["no entry named 'nope'", "vec_add"]);
    fails(&["emu", "run", &file, "--entry", "vec_add", "--block", "0"], &["--block '0'"]);
    fails(&["emu", "run", &file, "--entry", "vec_add", "--block", "32", "--arg", &buf], &["1 argument(s) given, kernel takes 4"]);
    let bad = d.join("bad.ptx");
    std::fs::write(&bad, ".version 8.7\n.target sm_120a\n.address_size 64\n.visible .entry k()\n{\n  frobnicate.u32 %r1;\n}\n").unwrap();
    fails(&["emu", "run", &bad.display().to_string(), "--entry", "k", "--block", "32"], &[&format!("{}:6:", bad.display()), "undeclared register '%r1'"]);
    std::fs::write(&bad, ".version 8.7\n.target sm_120a\n.address_size 64\n.visible .entry k()\n{\n  .reg .b32 %r<2>;\n  frobnicate.u32 %r1;\n}\n").unwrap();
    fails(&["emu", "run", &bad.display().to_string(), "--entry", "k", "--block", "32"], &[&format!("{}:7:", bad.display()), "unsupported instruction 'frobnicate'"]);
    // Execution faults keep the file and line.
    fails(&["emu", "run", &ptx("errors.ptx"), "--entry", "oob_store", "--block", "64", "--arg", &buf], &["errors.ptx:18:", "past the end of buffer"]);
}
