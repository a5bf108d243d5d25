//! Build-time code generation from kernel-templates/ (typed instantiation code for each PTX kernel
//! family) belongs here; the kernel templates do not exist yet, so there is nothing to generate.
fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed=kernel-templates");
}
