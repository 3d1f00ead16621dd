//! MXFP4 weight rows (Kimi K3's routed experts) for the f32 matmul path: a few rows at a
//! time are widened from ggml `block_mxfp4` (an E8M0 scale byte, then 16 bytes of E2M1
//! codes, value `j` in the low nibble of byte `j`, value `j + 16` in the high one) into an
//! L1-sized tile, so each weight byte is read from memory once per pass at 4.25 bits per
//! value. The widest kernel the CPU has is chosen at run time; [`dequantize_scalar`] is the
//! reference every kernel equals.

use kimi_gguf::mxfp4::{e8m0_to_f32, E2M1};

/// Bytes per 32-value block.
const BLOCK_BYTES: usize = 17;

/// Widens whole blocks: `bytes` holds `out.len() / 32` blocks.
pub(crate) fn dequantize(bytes: &[u8], out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    {
        if std::is_x86_feature_detected!("avx512f") {
            // SAFETY: AVX-512F was detected on this CPU just above.
            return unsafe { avx512::dequantize(bytes, out) };
        }
        if std::is_x86_feature_detected!("avx2") {
            // SAFETY: AVX2 was detected on this CPU just above.
            return unsafe { avx2::dequantize(bytes, out) };
        }
    }
    #[cfg(target_arch = "aarch64")]
    {
        // NEON is part of the AArch64 base architecture.
        return neon::dequantize(bytes, out);
    }
    #[allow(unreachable_code)]
    dequantize_scalar(bytes, out)
}

/// `out[r] = w[r] · x` for `out.len()` rows of `k / 32` blocks: the decode product (one
/// token) with the weights widened in registers. Equal bit for bit to widening each row with
/// [`dequantize`] and multiplying it by `crate::simd::dot` (the same values, the same
/// accumulator in the same order), so the f32 path's results do not depend on the batch
/// size; four rows go together so that four weight streams are in flight.
pub(crate) fn dot_rows(w: &[u8], k: usize, x: &[f32], out: &mut [f32]) {
    let row_bytes = k / 32 * BLOCK_BYTES;
    let (w, x) = (&w[..out.len() * row_bytes], &x[..k]);
    #[cfg(target_arch = "x86_64")]
    {
        if crate::simd::has_avx512() {
            // SAFETY: AVX-512F was detected just above (the test `simd::dot` dispatches on).
            return unsafe { avx512::dot_rows(w, k, x, out) };
        }
    }
    let mut row = vec![0f32; k];
    for (o, wr) in out.iter_mut().zip(w.chunks_exact(row_bytes.max(1))) {
        dequantize(wr, &mut row);
        *o = crate::simd::dot(&row, x);
    }
}

/// The portable reference: `x = E2M1[code] · 2^(e − 127)`.
pub(crate) fn dequantize_scalar(bytes: &[u8], out: &mut [f32]) {
    for (b, o) in bytes
        .chunks_exact(BLOCK_BYTES)
        .zip(out.chunks_exact_mut(32))
    {
        let d = e8m0_to_f32(b[0]);
        for j in 0..16 {
            o[j] = E2M1[usize::from(b[1 + j] & 0xF)] * d;
            o[j + 16] = E2M1[usize::from(b[1 + j] >> 4)] * d;
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::*;
    use std::arch::x86_64::*;

    /// # Safety
    /// The CPU must support AVX2.
    #[target_feature(enable = "avx2")]
    pub unsafe fn dequantize(bytes: &[u8], out: &mut [f32]) {
        // Magnitudes by the code's low three bits; bit 3 becomes the float's sign bit.
        let magnitudes = _mm256_setr_ps(0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0);
        let sign_bit = _mm256_set1_epi32(8);
        let low = _mm_set1_epi8(0x0F);
        for (b, o) in bytes
            .chunks_exact(BLOCK_BYTES)
            .zip(out.chunks_exact_mut(32))
        {
            let d = _mm256_set1_ps(e8m0_to_f32(b[0]));
            // SAFETY: b is 17 bytes, so the 16 code bytes b[1..17] are inside it; o is 32
            // floats, written in four stores of 8 at 0, 8, 16 and 24.
            unsafe {
                let qs = _mm_loadu_si128(b.as_ptr().add(1).cast());
                let lo = _mm_and_si128(qs, low);
                let hi = _mm_and_si128(_mm_srli_epi16::<4>(qs), low);
                let halves = [lo, _mm_srli_si128::<8>(lo), hi, _mm_srli_si128::<8>(hi)];
                for (i, codes) in halves.into_iter().enumerate() {
                    let idx = _mm256_cvtepu8_epi32(codes);
                    // permutevar8x32 reads the low three bits of each index.
                    let mag = _mm256_permutevar8x32_ps(magnitudes, idx);
                    let sign = _mm256_slli_epi32::<28>(_mm256_and_si256(idx, sign_bit));
                    let v = _mm256_or_ps(mag, _mm256_castsi256_ps(sign));
                    _mm256_storeu_ps(o.as_mut_ptr().add(8 * i), _mm256_mul_ps(v, d));
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
    pub unsafe fn dequantize(bytes: &[u8], out: &mut [f32]) {
        // permutexvar reads the low four bits of each index: the whole E2M1 table, signed
        // zero included.
        // SAFETY: E2M1 is 16 f32 values, one 512-bit load.
        let table = unsafe { _mm512_loadu_ps(E2M1.as_ptr()) };
        let low = _mm_set1_epi8(0x0F);
        for (b, o) in bytes
            .chunks_exact(BLOCK_BYTES)
            .zip(out.chunks_exact_mut(32))
        {
            let d = _mm512_set1_ps(e8m0_to_f32(b[0]));
            // SAFETY: b is 17 bytes, so the 16 code bytes b[1..17] are inside it; o is 32
            // floats, written in two stores of 16 at 0 and 16.
            unsafe {
                let qs = _mm_loadu_si128(b.as_ptr().add(1).cast());
                let lo = _mm512_cvtepu8_epi32(_mm_and_si128(qs, low));
                let hi = _mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16::<4>(qs), low));
                let vlo = _mm512_permutexvar_ps(lo, table);
                let vhi = _mm512_permutexvar_ps(hi, table);
                _mm512_storeu_ps(o.as_mut_ptr(), _mm512_mul_ps(vlo, d));
                _mm512_storeu_ps(o.as_mut_ptr().add(16), _mm512_mul_ps(vhi, d));
            }
        }
    }

    /// See `super::dot_rows`: `simd::avx512::dot`'s one 16-lane accumulator per row, fed
    /// with the values `dequantize` writes (the same table lookup and scale product).
    ///
    /// # Safety
    /// The CPU must support AVX-512F; `w` holds `out.len()` rows of `k / 32` blocks and `x`
    /// `k` values.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn dot_rows(w: &[u8], k: usize, x: &[f32], out: &mut [f32]) {
        let nb = k / 32;
        // SAFETY: E2M1 is 16 f32 values, one 512-bit load.
        let table = unsafe { _mm512_loadu_ps(E2M1.as_ptr()) };
        let low = _mm_set1_epi8(0x0F);
        for (r0, outs) in out.chunks_mut(4).enumerate() {
            let mut acc = [_mm512_setzero_ps(); 4];
            let base = w.as_ptr().wrapping_add(4 * r0 * nb * BLOCK_BYTES);
            for blk in 0..nb {
                // SAFETY: block `blk` of rows 4·r0 + j < out.len() lies inside `w`, and
                // values 32·blk .. 32·blk + 32 inside `x` (the caller's promise).
                unsafe {
                    let xp = x.as_ptr().add(32 * blk);
                    let (x0, x1) = (_mm512_loadu_ps(xp), _mm512_loadu_ps(xp.add(16)));
                    for (j, a) in acc.iter_mut().enumerate().take(outs.len()) {
                        let b = base.add((j * nb + blk) * BLOCK_BYTES);
                        let d = _mm512_set1_ps(e8m0_to_f32(*b));
                        let qs = _mm_loadu_si128(b.add(1).cast());
                        let lo = _mm512_cvtepu8_epi32(_mm_and_si128(qs, low));
                        let hi = _mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16::<4>(qs), low));
                        let w0 = _mm512_mul_ps(_mm512_permutexvar_ps(lo, table), d);
                        let w1 = _mm512_mul_ps(_mm512_permutexvar_ps(hi, table), d);
                        *a = _mm512_fmadd_ps(w0, x0, *a);
                        *a = _mm512_fmadd_ps(w1, x1, *a);
                    }
                }
            }
            for (o, a) in outs.iter_mut().zip(acc) {
                *o = _mm512_reduce_add_ps(a);
            }
        }
    }
}

#[cfg(target_arch = "aarch64")]
mod neon {
    use super::*;
    use std::arch::aarch64::*;

    /// Twice the E2M1 values, which are whole numbers and so fit a byte table lookup; a
    /// negative zero code becomes +0 (the only difference from the reference, which no sum
    /// can see).
    const DOUBLED: [i8; 16] = [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12];

    pub fn dequantize(bytes: &[u8], out: &mut [f32]) {
        // SAFETY: NEON is part of the AArch64 base architecture; every load reads 16 bytes
        // inside a 17-byte block (or the 16-byte table) and every store writes 4 floats
        // inside a 32-float block.
        unsafe {
            let table = vld1q_s8(DOUBLED.as_ptr());
            let low = vdupq_n_u8(0x0F);
            for (b, o) in bytes
                .chunks_exact(BLOCK_BYTES)
                .zip(out.chunks_exact_mut(32))
            {
                let d = vdupq_n_f32(e8m0_to_f32(b[0]) * 0.5);
                let qs = vld1q_u8(b.as_ptr().add(1));
                let lo = vqtbl1q_s8(table, vandq_u8(qs, low));
                let hi = vqtbl1q_s8(table, vshrq_n_u8::<4>(qs));
                for (half, v) in [lo, hi].into_iter().enumerate() {
                    let wide = [vmovl_s8(vget_low_s8(v)), vmovl_s8(vget_high_s8(v))];
                    for (q, w) in wide.into_iter().enumerate() {
                        let parts = [vmovl_s16(vget_low_s16(w)), vmovl_s16(vget_high_s16(w))];
                        for (r, p) in parts.into_iter().enumerate() {
                            let at = 16 * half + 8 * q + 4 * r;
                            vst1q_f32(o.as_mut_ptr().add(at), vmulq_f32(vcvtq_f32_s32(p), d));
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

    /// Blocks whose codes and scales cover every nibble, both nibble positions and a range
    /// of E8M0 exponents, as ggml blocks.
    fn blocks(n: usize) -> Vec<u8> {
        let mut state = 0x9e37_79b9u32;
        let mut next = || {
            state ^= state << 13;
            state ^= state >> 17;
            state ^= state << 5;
            state
        };
        let mut bytes = Vec::with_capacity(n * BLOCK_BYTES);
        for i in 0..n {
            bytes.push(100 + (i % 50) as u8);
            for j in 0..16 {
                bytes.push(if i == 0 {
                    (j | (15 - j) << 4) as u8
                } else {
                    next() as u8
                });
            }
        }
        bytes
    }

    /// The decode product with the weights widened in registers gives the bits of widening
    /// each row and taking `simd::dot`, for row counts around the four-row groups.
    #[test]
    fn decode_rows_equal_widened_rows_times_dot() {
        for (rows, k) in [(1usize, 32usize), (3, 64), (4, 96), (9, 3584), (6, 2048)] {
            let bytes = blocks(rows * k / 32);
            let x: Vec<f32> = (0..k)
                .map(|i| ((i * 37 % 101) as f32 - 50.0) * 0.013)
                .collect();
            let mut got = vec![0f32; rows];
            dot_rows(&bytes, k, &x, &mut got);
            let mut row = vec![0f32; k];
            for (r, g) in got.iter().enumerate() {
                dequantize(
                    &bytes[r * k / 32 * BLOCK_BYTES..(r + 1) * k / 32 * BLOCK_BYTES],
                    &mut row,
                );
                assert_eq!(
                    g.to_bits(),
                    crate::simd::dot(&row, &x).to_bits(),
                    "{rows}x{k} row {r}"
                );
            }
        }
    }

    #[test]
    fn the_dispatched_kernel_equals_the_reference() {
        let bytes = blocks(64);
        let (mut want, mut got) = (vec![0f32; 64 * 32], vec![0f32; 64 * 32]);
        dequantize_scalar(&bytes, &mut want);
        dequantize(&bytes, &mut got);
        assert_eq!(got, want);
        // Block 0: value j holds code j, value j + 16 code 15 - j, at scale 2^(100 - 127).
        let d = 2f32.powi(-27);
        for j in 0..16 {
            assert_eq!(want[j], E2M1[j] * d);
            assert_eq!(want[j + 16], E2M1[15 - j] * d);
        }
    }

    /// Every x86 kernel this CPU can run, not only the one dispatch picks.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn every_x86_kernel_equals_the_reference() {
        let bytes = blocks(33);
        let mut want = vec![0f32; 33 * 32];
        dequantize_scalar(&bytes, &mut want);
        if std::is_x86_feature_detected!("avx2") {
            let mut got = vec![0f32; 33 * 32];
            // SAFETY: AVX2 was detected just above.
            unsafe { avx2::dequantize(&bytes, &mut got) };
            assert_eq!(got, want, "avx2");
            assert!(got
                .iter()
                .zip(&want)
                .all(|(g, w)| g.to_bits() == w.to_bits()));
        }
        if std::is_x86_feature_detected!("avx512f") {
            let mut got = vec![0f32; 33 * 32];
            // SAFETY: AVX-512F was detected just above.
            unsafe { avx512::dequantize(&bytes, &mut got) };
            assert!(got
                .iter()
                .zip(&want)
                .all(|(g, w)| g.to_bits() == w.to_bits()));
        }
    }

    #[test]
    fn the_reference_equals_kimi_gguf() {
        let bytes = blocks(9);
        let mut got = vec![0f32; 9 * 32];
        dequantize_scalar(&bytes, &mut got);
        let want = kimi_gguf::dequantize(kimi_gguf::GgmlType::MXFP4, &bytes, 9 * 32).unwrap();
        assert_eq!(got, want);
    }
}
