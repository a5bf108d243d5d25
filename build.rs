//! The root package generates nothing: kernel-template code generation (proc-macro2 + quote) lives
//! in `compiler/build.rs`, because the compiler's lowering pass uses the generated types and
//! dependencies point one way only (runtime <- compiler <- root). See ARCHITECTURE.md.
fn main() {
    println!("cargo:rerun-if-changed=build.rs");
}
