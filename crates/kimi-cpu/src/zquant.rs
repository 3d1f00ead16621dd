//! Weight rows of quantized Hugging Face checkpoints (AWQ, GPTQ, compressed-tensors INT4 /
//! INT8, FP8) for the f32 matmul path, in the blocks the loader repacks them into
//! (`kimi_core::qblocks`: 32 values with an f32 scale, and for integers an f32 zero point).
//! A few rows at a time are widened into an L1-sized tile as MXFP4's are; the widest kernel
//! the CPU has is chosen at run time, and each computes `(q − z) · d` with the same two
//! roundings as the reference [`kimi_core::qblocks::dequantize`] (a subtraction that is
//! exact, then the product; no fused multiply-add), so every kernel equals it bit for bit.

use kimi_core::DType;

/// Widens whole blocks of `dtype` (Q4Z, Q8Z or F8S): `bytes` holds `out.len() / 32` blocks.
pub(crate) fn dequantize(dtype: DType, bytes: &[u8], out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    {
        if std::is_x86_feature_detected!("avx512f") {
            // SAFETY: AVX-512F was detected on this CPU just above.
            return unsafe { avx512::dequantize(dtype, bytes, out) };
        }
        if std::is_x86_feature_detected!("avx2") {
            // SAFETY: AVX2 was detected on this CPU just above.
            return unsafe { avx2::dequantize(dtype, bytes, out) };
        }
    }
    #[cfg(target_arch = "aarch64")]
    {
        // NEON is part of the AArch64 base architecture.
        return neon::dequantize(dtype, bytes, out);
    }
    #[allow(unreachable_code)]
    dequantize_scalar(dtype, bytes, out)
}

/// The portable reference (kimi-core's definition of the blocks).
pub(crate) fn dequantize_scalar(dtype: DType, bytes: &[u8], out: &mut [f32]) {
    if !kimi_core::qblocks::dequantize(dtype, bytes, out) {
        debug_assert!(false, "invariant: {dtype} is a qblocks type");
        out.fill(f32::NAN);
    }
}

fn f32_at(b: &[u8], at: usize) -> f32 {
    f32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

/// Every E4M3 byte's f32 value (gathered by the x86 kernels, read per lane on NEON).
static E4M3: std::sync::LazyLock<[f32; 256]> =
    std::sync::LazyLock::new(kimi_core::qblocks::e4m3_table);

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::*;
    use std::arch::x86_64::*;

    /// # Safety
    /// The CPU must support AVX2.
    #[target_feature(enable = "avx2")]
    pub unsafe fn dequantize(dtype: DType, bytes: &[u8], out: &mut [f32]) {
        let bb = dtype.block_bytes();
        let table = E4M3.as_ptr();
        let low = _mm_set1_epi8(0x0F);
        for (b, o) in bytes.chunks_exact(bb).zip(out.chunks_exact_mut(32)) {
            let d = _mm256_set1_ps(f32_at(b, 0));
            // SAFETY: every load reads inside the block (`bb` bytes: 24, 40 or 36) and every
            // store writes 8 floats inside the 32 of `o`; gathered indices are bytes, < 256.
            unsafe {
                let op = o.as_mut_ptr();
                match dtype {
                    DType::Q4Z => {
                        let z = _mm256_set1_ps(f32_at(b, 4));
                        let qs = _mm_loadu_si128(b.as_ptr().add(8).cast());
                        let lo = _mm_and_si128(qs, low);
                        let hi = _mm_and_si128(_mm_srli_epi16::<4>(qs), low);
                        let parts = [lo, _mm_srli_si128::<8>(lo), hi, _mm_srli_si128::<8>(hi)];
                        for (i, q) in parts.into_iter().enumerate() {
                            let v = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(q));
                            let v = _mm256_mul_ps(_mm256_sub_ps(v, z), d);
                            _mm256_storeu_ps(op.add(8 * i), v);
                        }
                    }
                    DType::Q8Z => {
                        let z = _mm256_set1_ps(f32_at(b, 4));
                        for i in 0..4 {
                            let q = _mm_loadl_epi64(b.as_ptr().add(8 + 8 * i).cast());
                            let v = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(q));
                            let v = _mm256_mul_ps(_mm256_sub_ps(v, z), d);
                            _mm256_storeu_ps(op.add(8 * i), v);
                        }
                    }
                    _ => {
                        for i in 0..4 {
                            let q = _mm_loadl_epi64(b.as_ptr().add(4 + 8 * i).cast());
                            let v = _mm256_i32gather_ps::<4>(table, _mm256_cvtepu8_epi32(q));
                            _mm256_storeu_ps(op.add(8 * i), _mm256_mul_ps(v, d));
                        }
                    }
                }
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use super::*;
    use std::arch::x86_64::*;

    /// # Safety
    /// The CPU must support AVX-512F.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn dequantize(dtype: DType, bytes: &[u8], out: &mut [f32]) {
        let bb = dtype.block_bytes();
        let table = E4M3.as_ptr();
        let low = _mm_set1_epi8(0x0F);
        for (b, o) in bytes.chunks_exact(bb).zip(out.chunks_exact_mut(32)) {
            let d = _mm512_set1_ps(f32_at(b, 0));
            // SAFETY: every load reads 16 bytes inside the block and every store writes 16
            // floats inside the 32 of `o`; gathered indices are bytes, < 256.
            unsafe {
                let op = o.as_mut_ptr();
                let halves = match dtype {
                    DType::Q4Z => {
                        let qs = _mm_loadu_si128(b.as_ptr().add(8).cast());
                        [
                            _mm_and_si128(qs, low),
                            _mm_and_si128(_mm_srli_epi16::<4>(qs), low),
                        ]
                    }
                    DType::Q8Z => [
                        _mm_loadu_si128(b.as_ptr().add(8).cast()),
                        _mm_loadu_si128(b.as_ptr().add(24).cast()),
                    ],
                    _ => [
                        _mm_loadu_si128(b.as_ptr().add(4).cast()),
                        _mm_loadu_si128(b.as_ptr().add(20).cast()),
                    ],
                };
                for (i, q) in halves.into_iter().enumerate() {
                    let idx = _mm512_cvtepu8_epi32(q);
                    let v = if dtype == DType::F8S {
                        _mm512_mul_ps(_mm512_i32gather_ps::<4>(idx, table.cast()), d)
                    } else {
                        let z = _mm512_set1_ps(f32_at(b, 4));
                        _mm512_mul_ps(_mm512_sub_ps(_mm512_cvtepi32_ps(idx), z), d)
                    };
                    _mm512_storeu_ps(op.add(16 * i), v);
                }
            }
        }
    }
}

#[cfg(target_arch = "aarch64")]
mod neon {
    use super::*;
    use std::arch::aarch64::*;

    pub fn dequantize(dtype: DType, bytes: &[u8], out: &mut [f32]) {
        let bb = dtype.block_bytes();
        // SAFETY: NEON is part of the AArch64 base architecture; every load reads 16 bytes
        // inside the block (or 4 table entries inside E4M3) and every store writes 4 floats
        // inside the 32 of `o`.
        unsafe {
            let low = vdupq_n_u8(0x0F);
            for (b, o) in bytes.chunks_exact(bb).zip(out.chunks_exact_mut(32)) {
                let d = vdupq_n_f32(f32_at(b, 0));
                let op = o.as_mut_ptr();
                if dtype == DType::F8S {
                    for (i, q) in b[4..36].chunks_exact(4).enumerate() {
                        let vals = [
                            E4M3[q[0] as usize],
                            E4M3[q[1] as usize],
                            E4M3[q[2] as usize],
                            E4M3[q[3] as usize],
                        ];
                        vst1q_f32(op.add(4 * i), vmulq_f32(vld1q_f32(vals.as_ptr()), d));
                    }
                    continue;
                }
                let z = vdupq_n_f32(f32_at(b, 4));
                let halves = if dtype == DType::Q4Z {
                    let qs = vld1q_u8(b.as_ptr().add(8));
                    [vandq_u8(qs, low), vshrq_n_u8::<4>(qs)]
                } else {
                    [vld1q_u8(b.as_ptr().add(8)), vld1q_u8(b.as_ptr().add(24))]
                };
                for (h, q) in halves.into_iter().enumerate() {
                    let wide = [vmovl_u8(vget_low_u8(q)), vmovl_u8(vget_high_u8(q))];
                    for (w, v) in wide.into_iter().enumerate() {
                        let parts = [vmovl_u16(vget_low_u16(v)), vmovl_u16(vget_high_u16(v))];
                        for (r, p) in parts.into_iter().enumerate() {
                            let x = vmulq_f32(vsubq_f32(vcvtq_f32_u32(p), z), d);
                            vst1q_f32(op.add(16 * h + 8 * w + 4 * r), x);
                        }
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kimi_core::qblocks;

    /// Blocks of every type with codes over their whole range, scales of many magnitudes
    /// (subnormal products included) and zero points on and off the codes.
    fn blocks(dtype: DType, n: usize) -> Vec<u8> {
        let mut state = 0x1234_5678u32;
        let mut next = || {
            state ^= state << 13;
            state ^= state >> 17;
            state ^= state << 5;
            state
        };
        let mut bytes = vec![0u8; n * dtype.block_bytes()];
        for (i, b) in bytes.chunks_exact_mut(dtype.block_bytes()).enumerate() {
            let d = f32::from_bits(next() % 0x7f00_0000) * if i % 2 == 0 { 1.0 } else { -1.0 };
            let codes: [u8; 32] = std::array::from_fn(|_| next() as u8);
            match dtype {
                DType::Q4Z => {
                    let c = codes.map(|c| c & 0xF);
                    qblocks::write_q4z(&c, d, (i % 17) as f32, b)
                }
                DType::Q8Z => qblocks::write_q8z(&codes, d, (i * 37 % 256) as f32, b),
                _ => qblocks::write_f8s(&codes, d, b),
            }
        }
        bytes
    }

    fn same_bits(a: &[f32], b: &[f32]) -> bool {
        a.iter()
            .zip(b)
            .all(|(x, y)| x.to_bits() == y.to_bits() || (x.is_nan() && y.is_nan()))
    }

    #[test]
    fn every_kernel_equals_the_reference() {
        for dtype in [DType::Q4Z, DType::Q8Z, DType::F8S] {
            let n = 67;
            let bytes = blocks(dtype, n);
            let (mut want, mut got) = (vec![0f32; n * 32], vec![0f32; n * 32]);
            dequantize_scalar(dtype, &bytes, &mut want);
            dequantize(dtype, &bytes, &mut got);
            assert!(same_bits(&got, &want), "{dtype} dispatched");
            #[cfg(target_arch = "x86_64")]
            {
                if std::is_x86_feature_detected!("avx2") {
                    got.fill(0.0);
                    // SAFETY: AVX2 was detected just above.
                    unsafe { avx2::dequantize(dtype, &bytes, &mut got) };
                    assert!(same_bits(&got, &want), "{dtype} avx2");
                }
                if std::is_x86_feature_detected!("avx512f") {
                    got.fill(0.0);
                    // SAFETY: AVX-512F was detected just above.
                    unsafe { avx512::dequantize(dtype, &bytes, &mut got) };
                    assert!(same_bits(&got, &want), "{dtype} avx512");
                }
            }
        }
    }
}
