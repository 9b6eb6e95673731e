//! Value compression on the wire (the parameter server, OSDI 2014, Section 4.2), chosen per table.
//!
//! Values travel as little-endian `f32` unless the table says otherwise
//! ([`crate::TableSpec::compressed`]). A compressed message marks its codec in its header, so a
//! receiver decodes it without looking anything up. What is compressed: the values of pushes,
//! sets and push-pulls on their way to the owner, and of pull and push-pull answers on their way
//! back. What is not: relocations (a one-sided write of the slot, exact) and replication deltas.
//! Values are stored as `f32` everywhere; only the bytes between nodes shrink.

use crate::error::{Error, Result};

/// How a table's values are encoded in messages.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[repr(u8)]
pub enum ValueCodec {
    /// 4 bytes per element, exact (the default).
    #[default]
    F32 = 0,
    /// bfloat16: the upper half of the `f32`, rounded to nearest even (2 bytes; 8 bits of
    /// mantissa, the full exponent range).
    Bf16 = 1,
    /// IEEE half precision (2 bytes; 11 bits of mantissa, magnitudes up to 65 504).
    F16 = 2,
    /// 8-bit integers with one `f32` scale per message part (the largest magnitude of the
    /// part's values maps to 127): `4 + n` bytes for `n` elements.
    Int8 = 3,
}

impl ValueCodec {
    /// The codec a header byte names.
    pub fn from_u8(b: u8) -> Option<ValueCodec> {
        match b {
            0 => Some(ValueCodec::F32),
            1 => Some(ValueCodec::Bf16),
            2 => Some(ValueCodec::F16),
            3 => Some(ValueCodec::Int8),
            _ => None,
        }
    }

    /// Its name on the command line.
    pub fn name(self) -> &'static str {
        match self {
            ValueCodec::F32 => "f32",
            ValueCodec::Bf16 => "bf16",
            ValueCodec::F16 => "f16",
            ValueCodec::Int8 => "int8",
        }
    }

    /// Encoded bytes of `elements` floats.
    pub fn encoded_len(self, elements: usize) -> Option<usize> {
        match self {
            ValueCodec::F32 => elements.checked_mul(4),
            ValueCodec::Bf16 | ValueCodec::F16 => elements.checked_mul(2),
            ValueCodec::Int8 if elements == 0 => Some(0),
            ValueCodec::Int8 => elements.checked_add(4),
        }
    }

    /// Compresses the little-endian `f32` bytes `out[at..]` in place (the region shrinks).
    pub(crate) fn compress_tail(self, out: &mut Vec<u8>, at: usize) {
        let region = &out[at..];
        let n = region.len() / 4;
        let float = |i: usize| f32::from_le_bytes([region[4 * i], region[4 * i + 1], region[4 * i + 2], region[4 * i + 3]]);
        match self {
            ValueCodec::F32 => {}
            ValueCodec::Bf16 | ValueCodec::F16 => {
                // Element i moves from 4i to 2i: never ahead of what is still to be read.
                for i in 0..n {
                    let x = f32::from_le_bytes([out[at + 4 * i], out[at + 4 * i + 1], out[at + 4 * i + 2], out[at + 4 * i + 3]]);
                    let h = if self == ValueCodec::Bf16 { half::bf16::from_f32(x).to_bits() } else { half::f16::from_f32(x).to_bits() };
                    out[at + 2 * i..at + 2 * i + 2].copy_from_slice(&h.to_le_bytes());
                }
                out.truncate(at + 2 * n);
            }
            ValueCodec::Int8 => {
                if n == 0 {
                    return;
                }
                let max = (0..n).map(|i| float(i).abs()).filter(|x| x.is_finite()).fold(0.0f32, f32::max);
                let scale = if max > 0.0 { max / 127.0 } else { 1.0 };
                let mut packed = Vec::with_capacity(4 + n);
                packed.extend_from_slice(&scale.to_le_bytes());
                packed.extend((0..n).map(|i| (float(i) / scale).round().clamp(-127.0, 127.0) as i8 as u8));
                out.truncate(at);
                out.extend_from_slice(&packed);
            }
        }
    }

    /// Decodes `elements` floats from `bytes` (exactly [`ValueCodec::encoded_len`] of them) into
    /// little-endian `f32` bytes.
    pub fn decode(self, bytes: &[u8], elements: usize) -> Result<Vec<u8>> {
        if self.encoded_len(elements) != Some(bytes.len()) {
            return Err(Error::Protocol(format!("{} values of {elements} elements have {} bytes", self.name(), bytes.len())));
        }
        let mut out = Vec::with_capacity(elements * 4);
        match self {
            ValueCodec::F32 => out.extend_from_slice(bytes),
            ValueCodec::Bf16 => out.extend(bytes.chunks_exact(2).flat_map(|c| half::bf16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32().to_le_bytes())),
            ValueCodec::F16 => out.extend(bytes.chunks_exact(2).flat_map(|c| half::f16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32().to_le_bytes())),
            ValueCodec::Int8 if elements == 0 => {}
            ValueCodec::Int8 => {
                let scale = f32::from_le_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]);
                out.extend(bytes[4..].iter().flat_map(|&b| (b as i8 as f32 * scale).to_le_bytes()));
            }
        }
        Ok(out)
    }
}

impl std::str::FromStr for ValueCodec {
    type Err = String;

    fn from_str(s: &str) -> std::result::Result<ValueCodec, String> {
        match s {
            "f32" | "none" => Ok(ValueCodec::F32),
            "bf16" => Ok(ValueCodec::Bf16),
            "f16" => Ok(ValueCodec::F16),
            "int8" => Ok(ValueCodec::Int8),
            other => Err(format!("value codec '{other}': expected f32, bf16, f16 or int8")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn round_trip(codec: ValueCodec, values: &[f32]) -> Vec<f32> {
        let mut buf = vec![9u8; 3];
        buf.extend(values.iter().flat_map(|v| v.to_le_bytes()));
        codec.compress_tail(&mut buf, 3);
        assert_eq!(&buf[..3], &[9, 9, 9], "the prefix is untouched");
        assert_eq!(Some(buf.len() - 3), codec.encoded_len(values.len()));
        let back = codec.decode(&buf[3..], values.len()).unwrap();
        back.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
    }

    #[test]
    fn codecs_round_trip_within_their_precision() {
        let values = [0.0f32, 1.0, -2.5, 1e-3, 3.3333, -100.25, 7.0e4];
        assert_eq!(round_trip(ValueCodec::F32, &values), values);
        for (codec, rel) in [(ValueCodec::Bf16, 1.0 / 128.0), (ValueCodec::F16, 1.0 / 1024.0)] {
            for (x, y) in values.iter().zip(round_trip(codec, &values)) {
                if codec == ValueCodec::F16 && x.abs() > 65504.0 {
                    assert!(y.is_infinite());
                    continue;
                }
                assert!((x - y).abs() <= rel * x.abs() + 1e-7, "{codec:?}: {x} → {y}");
            }
        }
        let small = [0.5f32, -1.0, 0.25, 0.0];
        for (x, y) in small.iter().zip(round_trip(ValueCodec::Int8, &small)) {
            assert!((x - y).abs() <= 1.0 / 254.0, "{x} → {y}");
        }
        // Small integers (the simulator's lanes and tags) are exact in both 16-bit formats.
        let ints: Vec<f32> = (0..=256).map(|i| i as f32).collect();
        assert_eq!(round_trip(ValueCodec::Bf16, &ints), ints);
        assert_eq!(round_trip(ValueCodec::F16, &ints), ints);
        assert!(round_trip(ValueCodec::Int8, &[]).is_empty());
        assert_eq!(round_trip(ValueCodec::Int8, &[0.0, 0.0]), [0.0, 0.0]);
    }

    #[test]
    fn malformed_lengths_are_errors() {
        assert!(ValueCodec::Bf16.decode(&[1, 2, 3], 2).is_err());
        assert!(ValueCodec::Int8.decode(&[0, 0, 128, 63, 1], 2).is_err());
        assert!(ValueCodec::from_u8(9).is_none());
        assert!("fp8".parse::<ValueCodec>().is_err());
    }
}
