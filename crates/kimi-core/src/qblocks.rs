//! The block layouts kimi-infer repacks Hugging Face quantized weights into, and their
//! reference dequantization.
//!
//! AWQ, GPTQ and compressed-tensors store integer codes with one scale (and zero point) per
//! group of 32 to thousands of values along a row, packed eight or four to an `i32` in
//! orders of their own; FP8 checkpoints store E4M3 bytes with a scale per row, per tensor or
//! per 128 × 128 block. The loader rewrites each matrix once into rows of 32-value blocks
//! that carry their group's scale (and zero point) as f32, so every value is kept exactly and
//! the CPU kernels widen one layout per kind whatever the group size:
//!
//! | dtype | block (32 values) | value |
//! |---|---|---|
//! | [`DType::Q4Z`] | `d:f32 \| z:f32 \| qs[16]` (24 bytes) | `(q − z) · d`, `q` in the low nibble of byte `j` for value `j`, the high one for `j + 16` |
//! | [`DType::Q8Z`] | `d:f32 \| z:f32 \| qs:u8[32]` (40 bytes) | `(q − z) · d` |
//! | [`DType::F8S`] | `d:f32 \| q:e4m3[32]` (36 bytes) | `e4m3(q) · d` |
//!
//! `q − z` is a small whole number, exact in f32, so each value is one rounding of the
//! product, as the tools' own dequantization computes it in f32 (and exact for the bf16 and
//! f16 scales real checkpoints carry).

use crate::DType;

/// Values per block of every type here.
pub const BLOCK: usize = 32;

/// The f32 value of an FP8 E4M3 byte (OCP "fn": bias 7, no infinities; `0x7f` and `0xff`
/// are NaN). Exact: every E4M3 value is an f32.
pub fn e4m3_to_f32(b: u8) -> f32 {
    let sign = if b & 0x80 != 0 { -1.0f32 } else { 1.0 };
    let exp = i32::from((b >> 3) & 0xF);
    let mant = f32::from(b & 0x7);
    if exp == 0xF && b & 0x7 == 0x7 {
        return f32::NAN;
    }
    if exp == 0 {
        // Subnormal: mant · 2^-9.
        return sign * mant * (1.0 / 512.0);
    }
    sign * (1.0 + mant / 8.0) * pow2(exp - 7)
}

/// `2^e` for `|e|` well inside f32's normal range.
fn pow2(e: i32) -> f32 {
    f32::from_bits(((e + 127) as u32) << 23)
}

/// The E4M3 byte nearest to `x` (ties to the even code), saturating at ±448; NaN gives
/// `0x7f`. The value `e4m3_to_f32` gives back is `x` rounded to E4M3.
pub fn f32_to_e4m3(x: f32) -> u8 {
    if x.is_nan() {
        return 0x7f;
    }
    let sign = if x.is_sign_negative() { 0x80 } else { 0 };
    let a = x.abs();
    // The 127 finite non-negative codes 0x00..=0x7e increase with their values.
    let (mut lo, mut hi) = (0u8, 0x7eu8);
    if a >= e4m3_to_f32(hi) {
        return sign | hi;
    }
    while hi - lo > 1 {
        let mid = lo + (hi - lo) / 2;
        if e4m3_to_f32(mid) <= a {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    let (dl, dh) = (a - e4m3_to_f32(lo), e4m3_to_f32(hi) - a);
    let code = if dl < dh || (dl == dh && lo % 2 == 0) {
        lo
    } else {
        hi
    };
    sign | code
}

/// Every E4M3 byte's value, indexed by the byte.
pub fn e4m3_table() -> [f32; 256] {
    std::array::from_fn(|b| e4m3_to_f32(b as u8))
}

fn f32_at(b: &[u8], at: usize) -> f32 {
    f32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

/// Reference dequantization of whole blocks of [`DType::Q4Z`], [`DType::Q8Z`] or
/// [`DType::F8S`]: `bytes` holds `out.len() / 32` blocks. Returns `false` (writing nothing)
/// for another dtype.
pub fn dequantize(dtype: DType, bytes: &[u8], out: &mut [f32]) -> bool {
    let Some(block_bytes) = block_bytes(dtype) else {
        return false;
    };
    for (b, o) in bytes
        .chunks_exact(block_bytes)
        .zip(out.chunks_exact_mut(BLOCK))
    {
        match dtype {
            DType::Q4Z => {
                let (d, z) = (f32_at(b, 0), f32_at(b, 4));
                for j in 0..16 {
                    o[j] = (f32::from(b[8 + j] & 0xF) - z) * d;
                    o[j + 16] = (f32::from(b[8 + j] >> 4) - z) * d;
                }
            }
            DType::Q8Z => {
                let (d, z) = (f32_at(b, 0), f32_at(b, 4));
                for (y, &q) in o.iter_mut().zip(&b[8..]) {
                    *y = (f32::from(q) - z) * d;
                }
            }
            _ => {
                let d = f32_at(b, 0);
                for (y, &q) in o.iter_mut().zip(&b[4..]) {
                    *y = e4m3_to_f32(q) * d;
                }
            }
        }
    }
    true
}

/// Bytes per block of a type here, `None` for other types.
pub fn block_bytes(dtype: DType) -> Option<usize> {
    matches!(dtype, DType::Q4Z | DType::Q8Z | DType::F8S).then(|| dtype.block_bytes())
}

/// Writes one [`DType::Q4Z`] block: `codes` are 32 values in `0..16`.
pub fn write_q4z(codes: &[u8; BLOCK], d: f32, z: f32, out: &mut [u8]) {
    out[..4].copy_from_slice(&d.to_le_bytes());
    out[4..8].copy_from_slice(&z.to_le_bytes());
    for j in 0..16 {
        out[8 + j] = (codes[j] & 0xF) | (codes[j + 16] << 4);
    }
}

/// Writes one [`DType::Q8Z`] block.
pub fn write_q8z(codes: &[u8; BLOCK], d: f32, z: f32, out: &mut [u8]) {
    out[..4].copy_from_slice(&d.to_le_bytes());
    out[4..8].copy_from_slice(&z.to_le_bytes());
    out[8..40].copy_from_slice(codes);
}

/// Writes one [`DType::F8S`] block of E4M3 bytes.
pub fn write_f8s(codes: &[u8], d: f32, out: &mut [u8]) {
    out[..4].copy_from_slice(&d.to_le_bytes());
    out[4..4 + BLOCK].copy_from_slice(&codes[..BLOCK]);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn e4m3_values_follow_the_ocp_definition() {
        assert_eq!(e4m3_to_f32(0x00), 0.0);
        assert_eq!(e4m3_to_f32(0x01), 2f32.powi(-9)); // smallest subnormal
        assert_eq!(e4m3_to_f32(0x08), 2f32.powi(-6)); // smallest normal
        assert_eq!(e4m3_to_f32(0x38), 1.0);
        assert_eq!(e4m3_to_f32(0x7e), 448.0); // largest
        assert_eq!(e4m3_to_f32(0xfe), -448.0);
        assert_eq!(e4m3_to_f32(0xc0), -2.0);
        assert!(e4m3_to_f32(0x7f).is_nan() && e4m3_to_f32(0xff).is_nan());
        assert!(e4m3_to_f32(0x78).is_finite()); // 256: no infinities
    }

    #[test]
    fn rounding_to_e4m3_is_to_nearest_even() {
        for b in (0..=0x7eu8).chain(0x80..=0xfe) {
            let v = e4m3_to_f32(b);
            // -0 rounds to itself; every finite value round-trips.
            assert_eq!(f32_to_e4m3(v), b, "{b:#04x}");
        }
        assert_eq!(f32_to_e4m3(1.0 + 1.0 / 16.0), 0x38); // tie between 1 and 1.125: even
        assert_eq!(f32_to_e4m3(1.0 + 3.0 / 16.0), 0x3a); // tie between 1.125 and 1.25: even
        assert_eq!(f32_to_e4m3(1000.0), 0x7e);
        assert_eq!(f32_to_e4m3(-1e9), 0xfe);
        assert_eq!(f32_to_e4m3(f32::NAN), 0x7f);
        assert_eq!(f32_to_e4m3(2f32.powi(-11)), 0x00); // below half the smallest subnormal
    }

    #[test]
    fn blocks_round_trip() {
        let codes: [u8; 32] = std::array::from_fn(|i| (i % 16) as u8);
        let mut b = [0u8; 24];
        write_q4z(&codes, 0.5, 3.0, &mut b);
        let mut out = [0f32; 32];
        assert!(dequantize(DType::Q4Z, &b, &mut out));
        for (i, v) in out.iter().enumerate() {
            assert_eq!(*v, ((i % 16) as f32 - 3.0) * 0.5);
        }
        let codes: [u8; 32] = std::array::from_fn(|i| (i * 7) as u8);
        let mut b = [0u8; 40];
        write_q8z(&codes, 0.25, 128.0, &mut b);
        assert!(dequantize(DType::Q8Z, &b, &mut out));
        assert_eq!(out[3], (21.0 - 128.0) * 0.25);
        let mut b = [0u8; 36];
        write_f8s(&[0x38; 32], 3.0, &mut b);
        assert!(dequantize(DType::F8S, &b, &mut out));
        assert!(out.iter().all(|&v| v == 3.0));
        assert!(!dequantize(DType::Q4_0, &b, &mut out));
    }
}
