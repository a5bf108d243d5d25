//! Per-thread registers of one warp, stored lane-minor (`reg * 32 + lane`) so an instruction
//! touches one contiguous run of 32 values.

use super::ir::mask_bits;

pub struct RegFile {
    vals: Vec<u64>,
    masks: Vec<u64>,
}

impl RegFile {
    /// `bits[r]` is the declared width of register `r`; every write is masked to it. Registers
    /// start as [`UNWRITTEN`](super::memory::UNWRITTEN) bytes (all ones at their width), as
    /// undefined as on the hardware.
    pub fn new(bits: &[u32]) -> Self {
        let masks: Vec<u64> = bits.iter().map(|b| mask_bits(*b)).collect();
        let unwritten = u64::from_le_bytes([super::memory::UNWRITTEN; 8]);
        RegFile { vals: masks.iter().flat_map(|&m| [unwritten & m; 32]).collect(), masks }
    }

    #[inline]
    pub fn get(&self, r: u32, lane: usize) -> u64 {
        self.vals[r as usize * 32 + lane]
    }

    #[inline]
    pub fn set(&mut self, r: u32, lane: usize, v: u64) {
        self.vals[r as usize * 32 + lane] = v & self.masks[r as usize];
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn writes_are_masked_to_the_declared_width() {
        let mut rf = RegFile::new(&[16, 1, 64]);
        rf.set(0, 3, 0x1_2345);
        rf.set(1, 3, 2);
        rf.set(2, 31, u64::MAX);
        assert_eq!(rf.get(0, 3), 0x2345);
        assert_eq!(rf.get(1, 3), 0);
        assert_eq!(rf.get(2, 31), u64::MAX);
        // a lane not yet written holds all ones at the register's width
        assert_eq!(rf.get(0, 2), 0xFFFF);
        assert_eq!(rf.get(1, 0), 1);
    }
}
