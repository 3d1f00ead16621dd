//! The integer blocks of Hugging Face quantized checkpoints (`Q4Z`, `Q8Z`: f32 scale and
//! zero point per 32 values) rewritten as ggml's `Q4_1` and `Q8_0` blocks, so that the
//! integer kernels (`crate::qdot`, `--int8-matmul`) multiply them as they do GGUF weights.
//!
//! `(q − z)·d` is `q·d + m` with `m = −z·d`: a Q4Z block is a Q4_1 block whose scale and
//! min are rounded to f16 (the scale of a checkpoint with f16 or bf16 scales exactly; the
//! min by at most 2⁻¹¹ of itself), far below the int8 rounding of the activations that path
//! adds anyway. A Q8Z block whose codes all lie within ±127 of its (whole) zero point is a
//! Q8_0 block with the scale rounded to f16. Matrices with a scale or min outside f16's
//! normal range, or 8-bit codes that do not fit, stay as they are (the f32 path).

use half::f16;
use kimi_core::DType;

/// Q4Z: `d:f32 | z:f32 | qs[16]`; Q8Z: `d:f32 | z:f32 | qs:u8[32]`.
const Z_HEADER: usize = 8;

/// `bytes` of `dtype` as ggml blocks, where every block converts.
pub(crate) fn convert(dtype: DType, bytes: &[u8]) -> Option<(DType, Vec<u8>)> {
    match dtype {
        DType::Q4Z => q4z_to_q4_1(bytes).map(|b| (DType::Q4_1, b)),
        DType::Q8Z => q8z_to_q8_0(bytes).map(|b| (DType::Q8_0, b)),
        _ => None,
    }
}

/// An f32 as f16 when it is zero or a normal f16 (within 2⁻¹¹ of itself).
fn normal_f16(x: f32) -> Option<f16> {
    let h = f16::from_f32(x);
    (x == 0.0 || (h.is_normal() && x.abs() <= 65504.0)).then_some(h)
}

fn header(block: &[u8]) -> (f32, f32) {
    let f = |i: usize| f32::from_le_bytes([block[i], block[i + 1], block[i + 2], block[i + 3]]);
    (f(0), f(4))
}

fn q4z_to_q4_1(bytes: &[u8]) -> Option<Vec<u8>> {
    let mut out = Vec::with_capacity(bytes.len() / 24 * 20);
    for block in bytes.chunks_exact(24) {
        let (d, z) = header(block);
        let (dh, mh) = (normal_f16(d)?, normal_f16(-z * d)?);
        out.extend_from_slice(&dh.to_le_bytes());
        out.extend_from_slice(&mh.to_le_bytes());
        // Both keep value j in the low nibble of byte j and value j + 16 in the high one.
        out.extend_from_slice(&block[Z_HEADER..]);
    }
    Some(out)
}

fn q8z_to_q8_0(bytes: &[u8]) -> Option<Vec<u8>> {
    let mut out = Vec::with_capacity(bytes.len() / 40 * 34);
    for block in bytes.chunks_exact(40) {
        let (d, z) = header(block);
        if z.fract() != 0.0 {
            return None;
        }
        out.extend_from_slice(&normal_f16(d)?.to_le_bytes());
        for &q in &block[Z_HEADER..] {
            let v = f32::from(q) - z;
            if !(-127.0..=127.0).contains(&v) {
                return None;
            }
            out.push(v as i8 as u8);
        }
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every value of the converted blocks equals the original within f16's rounding of the
    /// scale and min; blocks that cannot convert leave the matrix as it was.
    #[test]
    fn blocks_keep_their_values() {
        let mut q4z = Vec::new();
        let mut q8z = Vec::new();
        for b in 0..4u8 {
            let (d, z) = (0.0123f32 * f32::from(b + 1), f32::from(b * 3));
            q4z.extend_from_slice(&d.to_le_bytes());
            q4z.extend_from_slice(&z.to_le_bytes());
            q4z.extend((0..16u8).map(|j| (j.wrapping_mul(7) & 0xF) | ((j + b) & 0xF) << 4));
            q8z.extend_from_slice(&d.to_le_bytes());
            q8z.extend_from_slice(&128f32.to_le_bytes());
            q8z.extend((0..32u8).map(|j| 128u8.wrapping_add(j.wrapping_mul(37)) % 255 + 1));
        }
        for (dtype, bytes, want) in [
            (DType::Q4Z, &q4z, DType::Q4_1),
            (DType::Q8Z, &q8z, DType::Q8_0),
        ] {
            let (to, converted) = convert(dtype, bytes).expect("converts");
            assert_eq!(to, want);
            let n = bytes.len() / dtype.block_bytes() * 32;
            let (mut a, mut b) = (vec![0f32; n], vec![0f32; n]);
            assert!(kimi_core::qblocks::dequantize(dtype, bytes, &mut a));
            crate::quant::dequantize(to, &converted, &mut b);
            // Per block: the scale and min each round by at most 2⁻¹¹ of themselves, so a
            // value moves by at most (15 + z)·d·2⁻¹¹ (Q4_1), 127·d·2⁻¹¹ (Q8_0).
            for (i, (x, y)) in a.iter().zip(&b).enumerate() {
                let block = &bytes[i / 32 * dtype.block_bytes()..];
                let (d, z) = header(block);
                let tol = (255f32.min(15.0 + z) + 1.0) * d * 2f32.powi(-11);
                assert!(
                    (x - y).abs() <= tol,
                    "{dtype}: {x} vs {y} (tolerance {tol})"
                );
            }
        }
        // Through the backend: the integer path multiplies them as Q4_1 / Q8_0 (int8
        // activations), within that rounding of the exact f32 product.
        use kimi_ops::{Backend, HostTensor};
        let (rows, cols) = (4, 32);
        let x: Vec<f32> = (0..2 * cols)
            .map(|i| ((i * 37 % 23) as f32 - 11.0) / 7.0)
            .collect();
        for (dtype, bytes) in [(DType::Q4Z, &q4z), (DType::Q8Z, &q8z)] {
            let host = HostTensor {
                shape: &[rows, cols],
                dtype,
                bytes,
            };
            let product = |mode| {
                let be = crate::CpuBackend::with_quant_matmul(mode);
                let w = be.upload(host).unwrap();
                let xs = be.upload_f32(&[2, cols], &x).unwrap();
                be.to_f32(&be.matmul(&xs, &w).unwrap()).unwrap()
            };
            let (exact, int8) = (
                product(crate::QuantMatmul::F32),
                product(crate::QuantMatmul::Int8),
            );
            let num: f32 = exact.iter().zip(&int8).map(|(a, b)| (a - b).powi(2)).sum();
            let den: f32 = exact.iter().map(|a| a * a).sum();
            let rel = (num / den).sqrt();
            assert!(rel > 0.0 && rel < 1e-2, "{dtype}: {rel}");
        }
        // A tiny scale (f16 subnormal) and a code out of Q8_0's range do not convert.
        let mut tiny = q4z.clone();
        tiny[..4].copy_from_slice(&1e-7f32.to_le_bytes());
        assert!(convert(DType::Q4Z, &tiny).is_none());
        let mut wide = q8z.clone();
        wide[8] = 0;
        assert!(convert(DType::Q8Z, &wide).is_none());
    }
}
