//! Dequantization of ggml block-quantized weights, for the matmul and embedding paths.
//!
//! Q8_0, Q4_0 and Q4_1 (the types of the SmolLM2 demo model) have portable loops here and
//! AVX2 kernels in `crate::simd`; the other types go through `kimi-gguf`'s dequantizers,
//! which are the reference for all of them (the tests check both fast paths against it).

use kimi_core::DType;
use kimi_gguf::GgmlType;

/// The ggml type of a quantized dtype.
fn ggml_type(dtype: DType) -> Option<GgmlType> {
    Some(match dtype {
        DType::Q8_0 => GgmlType::Q8_0,
        DType::Q4_0 => GgmlType::Q4_0,
        DType::Q4_1 => GgmlType::Q4_1,
        DType::Q5_0 => GgmlType::Q5_0,
        DType::Q5_1 => GgmlType::Q5_1,
        DType::Q4_K => GgmlType::Q4_K,
        DType::Q5_K => GgmlType::Q5_K,
        DType::Q6_K => GgmlType::Q6_K,
        DType::MXFP4 => GgmlType::MXFP4,
        _ => return None,
    })
}

/// Whether quantized storage of `dtype` can be dequantized here: the ggml types and the
/// blocks quantized Hugging Face checkpoints are repacked into (`kimi_core::qblocks`).
pub(crate) fn supported(dtype: DType) -> bool {
    dtype.is_quantized()
        && (ggml_type(dtype).is_some_and(GgmlType::can_dequantize)
            || kimi_core::qblocks::block_bytes(dtype).is_some())
}

/// Dequantizes whole blocks: `bytes` holds `out.len() / dtype.block_size()` blocks.
pub(crate) fn dequantize(dtype: DType, bytes: &[u8], out: &mut [f32]) {
    match dtype {
        DType::Q8_0 => crate::simd::dequantize_legacy(Legacy::Q8_0, bytes, out),
        DType::Q4_0 => crate::simd::dequantize_legacy(Legacy::Q4_0, bytes, out),
        DType::Q4_1 => crate::simd::dequantize_legacy(Legacy::Q4_1, bytes, out),
        DType::MXFP4 => crate::mxfp4::dequantize(bytes, out),
        DType::Q4Z | DType::Q8Z | DType::F8S => crate::zquant::dequantize(dtype, bytes, out),
        other => {
            // Upload checked the type and that rows are whole blocks, so this cannot fail;
            // NaNs make a broken invariant visible instead of silently zero weights.
            let ok = ggml_type(other)
                .is_some_and(|ty| kimi_gguf::dequantize_row(ty, bytes, out).is_ok());
            if !ok {
                debug_assert!(false, "invariant: {other} blocks dequantize");
                out.fill(f32::NAN);
            }
        }
    }
}

/// The 32-value block types with loops of their own here.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Legacy {
    Q8_0,
    Q4_0,
    Q4_1,
}

/// Dequantizes whole blocks of a [`Legacy`] type (portable loops).
pub(crate) fn dequantize_legacy(kind: Legacy, bytes: &[u8], out: &mut [f32]) {
    match kind {
        Legacy::Q8_0 => q8_0(bytes, out),
        Legacy::Q4_0 => q4_0(bytes, out),
        Legacy::Q4_1 => q4_1(bytes, out),
    }
}

/// IEEE half to f32 in integer arithmetic, inlined into the AVX2 kernels (`half`'s
/// conversion is a runtime-dispatched call per block scale).
#[inline(always)]
pub(crate) fn f16_to_f32(h: u16) -> f32 {
    let sign = u32::from(h & 0x8000) << 16;
    let exp = u32::from(h >> 10) & 0x1f;
    let mant = u32::from(h & 0x3ff);
    match exp {
        // Zero and subnormals: mant * 2^-24, exact in f32.
        0 => f32::from_bits(sign) + mant as f32 * f32::from_bits(sign | (103 << 23)),
        0x1f => f32::from_bits(sign | 0x7f80_0000 | (mant << 13)),
        _ => f32::from_bits(sign | ((exp + 112) << 23) | (mant << 13)),
    }
}

fn f16_at(b: &[u8], i: usize) -> f32 {
    f16_to_f32(u16::from_le_bytes([b[i], b[i + 1]]))
}

/// `d:f16 | qs:i8[32]`, `x = q * d`.
fn q8_0(bytes: &[u8], out: &mut [f32]) {
    for (b, o) in bytes.chunks_exact(34).zip(out.chunks_exact_mut(32)) {
        let d = f16_at(b, 0);
        for (y, &q) in o.iter_mut().zip(&b[2..]) {
            *y = f32::from(q as i8) * d;
        }
    }
}

/// `d:f16 | qs[16]`; byte `j` holds value `j` (low nibble) and `j + 16` (high nibble);
/// `x = (nibble - 8) * d`.
fn q4_0(bytes: &[u8], out: &mut [f32]) {
    for (b, o) in bytes.chunks_exact(18).zip(out.chunks_exact_mut(32)) {
        let d = f16_at(b, 0);
        for j in 0..16 {
            o[j] = (i32::from(b[2 + j] & 0xF) - 8) as f32 * d;
            o[j + 16] = (i32::from(b[2 + j] >> 4) - 8) as f32 * d;
        }
    }
}

/// `d:f16 m:f16 | qs[16]`, nibbles as Q4_0; `x = nibble * d + m`.
fn q4_1(bytes: &[u8], out: &mut [f32]) {
    for (b, o) in bytes.chunks_exact(20).zip(out.chunks_exact_mut(32)) {
        let (d, m) = (f16_at(b, 0), f16_at(b, 2));
        for j in 0..16 {
            o[j] = f32::from(b[4 + j] & 0xF) * d + m;
            o[j + 16] = f32::from(b[4 + j] >> 4) * d + m;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    /// Every supported type dequantizes as `kimi-gguf` does, bit for bit.
    #[test]
    fn matches_reference_dequantizers() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(7);
        let values: Vec<f32> = (0..1024).map(|_| rng.random_range(-2.0..2.0)).collect();
        for dtype in [
            DType::Q8_0,
            DType::Q4_0,
            DType::Q4_1,
            DType::Q5_0,
            DType::Q5_1,
            DType::Q4_K,
            DType::Q5_K,
            DType::Q6_K,
        ] {
            assert!(supported(dtype), "{dtype}");
            let ty = ggml_type(dtype).expect("a ggml type");
            let bytes = kimi_gguf::quantize(ty, &values).expect("quantizes");
            assert_eq!(Some(bytes.len()), dtype.storage_bytes(values.len()));
            let want = kimi_gguf::dequantize(ty, &bytes, values.len()).expect("dequantizes");
            let mut got = vec![0f32; values.len()];
            dequantize(dtype, &bytes, &mut got);
            assert_eq!(got, want, "{dtype}");
            let legacy = match dtype {
                DType::Q8_0 => Some(Legacy::Q8_0),
                DType::Q4_0 => Some(Legacy::Q4_0),
                DType::Q4_1 => Some(Legacy::Q4_1),
                _ => None,
            };
            if let Some(kind) = legacy {
                // The portable loops as well as the dispatched (AVX2) kernel.
                dequantize_legacy(kind, &bytes, &mut got);
                assert_eq!(got, want, "{dtype} portable");
            }
            // Quantization error stays within the type's resolution.
            let worst = got
                .iter()
                .zip(&values)
                .map(|(a, b)| (a - b).abs())
                .fold(0f32, f32::max);
            assert!(worst < 0.35, "{dtype}: {worst}");
        }
        assert!(!supported(DType::BF16));
    }

    #[test]
    fn f16_conversion_is_exact() {
        for bits in 0..=u16::MAX {
            let want = half::f16::from_bits(bits).to_f32();
            let got = f16_to_f32(bits);
            assert!(
                got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan()),
                "{bits:#06x}: {got} vs {want}"
            );
        }
    }
}
