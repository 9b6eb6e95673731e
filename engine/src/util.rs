//! Small helpers: a deterministic hasher and f32 ↔ byte views.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

#[cfg(not(target_endian = "little"))]
compile_error!("Ferry's wire format and memory layout assume a little-endian host");

/// A fast, deterministic hasher for integer keys (the FxHash mixing step), so that a node's
/// protocol state machine behaves identically on every run of a simulation seed.
#[derive(Default, Clone, Copy)]
pub struct IdHasher(u64);

const MIX: u64 = 0x51_7c_c1_b7_27_22_0a_95;

impl Hasher for IdHasher {
    fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.0 = (self.0.rotate_left(5) ^ *b as u64).wrapping_mul(MIX);
        }
    }
    fn write_u16(&mut self, n: u16) {
        self.write_u64(n as u64);
    }
    fn write_u32(&mut self, n: u32) {
        self.write_u64(n as u64);
    }
    fn write_u64(&mut self, n: u64) {
        self.0 = (self.0.rotate_left(5) ^ n).wrapping_mul(MIX);
    }
    fn write_usize(&mut self, n: usize) {
        self.write_u64(n as u64);
    }
    fn finish(&self) -> u64 {
        self.0
    }
}

/// A hash map with [`IdHasher`].
pub type FastMap<K, V> = HashMap<K, V, BuildHasherDefault<IdHasher>>;

/// A hash set with [`IdHasher`].
pub type FastSet<K> = std::collections::HashSet<K, BuildHasherDefault<IdHasher>>;

/// The bytes of a float slice (little endian on every supported host).
#[inline]
pub fn f32_bytes(values: &[f32]) -> &[u8] {
    // SAFETY: f32 has no padding and no invalid bit patterns as bytes; u8 needs no alignment;
    // the length covers exactly the slice's memory.
    unsafe { std::slice::from_raw_parts(values.as_ptr() as *const u8, std::mem::size_of_val(values)) }
}

/// The bytes of a u64 slice (little endian on every supported host).
#[inline]
pub fn u64_bytes(values: &[u64]) -> &[u8] {
    // SAFETY: u64 has no padding; u8 needs no alignment; the length covers the slice exactly.
    unsafe { std::slice::from_raw_parts(values.as_ptr() as *const u8, std::mem::size_of_val(values)) }
}

/// Copies little-endian float bytes into `out` (`bytes.len() == 4 * out.len()`).
#[inline]
pub fn copy_bytes_to_f32(bytes: &[u8], out: &mut [f32]) {
    assert_eq!(bytes.len(), out.len() * 4, "byte count must match");
    // SAFETY: the destination has exactly `bytes.len()` bytes of initialised f32 memory, every
    // bit pattern is a valid f32, and the two slices cannot overlap (one is borrowed mutably).
    unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), out.as_mut_ptr() as *mut u8, bytes.len()) };
}
