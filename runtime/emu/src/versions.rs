//! Which driver can load which PTX: the `.version` directive of a module and the CUDA version
//! (`cuDriverGetVersion`, x * 1000 + y * 10) a driver must support to JIT that ISA. One table,
//! used by the CUDA backend's hardware check and by the driver double's module loader.

/// The `(major, minor)` of the module's `.version` directive.
pub fn ptx_version(ptx: &str) -> Option<(u32, u32)> {
    let v = ptx.lines().find_map(|l| l.trim().strip_prefix(".version"))?.trim();
    let (a, b) = v.split_once('.')?;
    Some((a.trim().parse().ok()?, b.trim().parse().ok()?))
}

/// The driver version that can load PTX ISA `major.minor` (8.7 needs CUDA 12.8, 8.8 12.9,
/// 9.0 13.0; unknown future versions need more than any driver has).
pub fn driver_for_ptx(major: u32, minor: u32) -> i32 {
    match (major, minor) {
        (..=7, _) => 11000,
        (8, 0..=5) => 12000 + 10 * minor as i32,
        (8, 6) => 12070,
        (8, 7) => 12080,
        (8, 8) => 12090,
        (9, m) => 13000 + 10 * m as i32,
        _ => i32::MAX,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_version_directive_and_maps_it_to_the_cuda_release() {
        assert_eq!(ptx_version("//\n.version 8.7\n.target sm_120a\n"), Some((8, 7)));
        assert_eq!(ptx_version(".target sm_90a\n"), None);
        assert_eq!(driver_for_ptx(8, 7), 12080);
        assert_eq!(driver_for_ptx(8, 8), 12090);
        assert_eq!(driver_for_ptx(9, 0), 13000);
        assert_eq!(driver_for_ptx(8, 5), 12050);
    }
}
