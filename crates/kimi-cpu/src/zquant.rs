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

/// The block types as const-generic tags of the kernels.
#[cfg(target_arch = "x86_64")]
const Q4Z: u8 = 0;
#[cfg(target_arch = "x86_64")]
const Q8Z: u8 = 1;
#[cfg(target_arch = "x86_64")]
const F8S: u8 = 2;

/// Bytes per block of a tag.
#[cfg(target_arch = "x86_64")]
const fn block_bytes(tag: u8) -> usize {
    match tag {
        Q4Z => 24,
        Q8Z => 40,
        _ => 36,
    }
}

/// Every E4M3 byte's f32 value (gathered by the x86 kernels, read per lane on NEON).
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
static E4M3: std::sync::LazyLock<[f32; 256]> =
    std::sync::LazyLock::new(kimi_core::qblocks::e4m3_table);

/// `out[r] = w[r] · x` for the rows of `k` values (whole blocks of `dtype`) in `w`: the
/// decode product (one token), with the weights widened in registers. Equal bit for bit to
/// widening each row with [`dequantize`] and multiplying it by `crate::simd::dot` (the same
/// values, the same accumulators in the same order), so the f32 path's results do not
/// depend on the batch size; four rows go together so that four weight streams are in
/// flight.
pub(crate) fn dot_rows(dtype: DType, w: &[u8], k: usize, x: &[f32], out: &mut [f32]) {
    let row_bytes = k / 32 * dtype.block_bytes();
    let (w, x) = (&w[..out.len() * row_bytes], &x[..k]);
    #[cfg(target_arch = "x86_64")]
    {
        if crate::simd::has_avx512() {
            // SAFETY: AVX-512F was detected just above (the test `simd::dot` dispatches on).
            return unsafe { avx512::dot_rows(dtype, w, k, x, out) };
        }
        if crate::simd::has_avx2_fma() {
            // SAFETY: AVX2 and FMA were detected just above (as for `simd::dot`).
            return unsafe { avx2::dot_rows(dtype, w, k, x, out) };
        }
    }
    let mut row = vec![0f32; k];
    for (o, wr) in out.iter_mut().zip(w.chunks_exact(row_bytes.max(1))) {
        dequantize(dtype, wr, &mut row);
        *o = crate::simd::dot(&row, x);
    }
}

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

    /// A block's 32 values widened: four vectors of 8, the same roundings as `dequantize`.
    ///
    /// # Safety
    /// The CPU must support AVX2; `b` points at a whole block of `D`.
    #[target_feature(enable = "avx2")]
    #[inline]
    unsafe fn widen<const D: u8>(b: *const u8, table: *const f32) -> [__m256; 4] {
        // SAFETY: every load reads inside the block (the caller's promise).
        unsafe {
            let d = _mm256_set1_ps(b.cast::<f32>().read_unaligned());
            if D == F8S {
                return [0, 8, 16, 24].map(|v0| {
                    let q = _mm_loadl_epi64(b.add(4 + v0).cast());
                    _mm256_mul_ps(_mm256_i32gather_ps::<4>(table, _mm256_cvtepu8_epi32(q)), d)
                });
            }
            let z = _mm256_set1_ps(b.add(4).cast::<f32>().read_unaligned());
            let qs = if D == Q4Z {
                let qs = _mm_loadu_si128(b.add(8).cast());
                let low = _mm_set1_epi8(0x0F);
                let (lo, hi) = (
                    _mm_and_si128(qs, low),
                    _mm_and_si128(_mm_srli_epi16::<4>(qs), low),
                );
                [lo, _mm_srli_si128::<8>(lo), hi, _mm_srli_si128::<8>(hi)]
            } else {
                [0, 8, 16, 24].map(|v0| _mm_loadl_epi64(b.add(8 + v0).cast()))
            };
            qs.map(|q| {
                let v = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(q));
                _mm256_mul_ps(_mm256_sub_ps(v, z), d)
            })
        }
    }

    fn hsum(v: __m256) -> f32 {
        // SAFETY: plain SSE/AVX register arithmetic (AVX2 machines only reach here).
        unsafe {
            let hi = _mm256_extractf128_ps(v, 1);
            let lo = _mm256_castps256_ps128(v);
            let s = _mm_add_ps(hi, lo);
            let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
            let s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
            _mm_cvtss_f32(s)
        }
    }

    /// See `super::dot_rows`: `simd::avx2::dot`'s two 8-lane accumulators per row.
    ///
    /// # Safety
    /// The CPU must support AVX2 and FMA; `w` holds `out.len()` rows of `k / 32` blocks and
    /// `x` `k` values.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn dot_rows(dtype: DType, w: &[u8], k: usize, x: &[f32], out: &mut [f32]) {
        // SAFETY: forwarded (the same promise).
        unsafe {
            match dtype {
                DType::Q4Z => rows::<Q4Z>(w, k, x, out),
                DType::Q8Z => rows::<Q8Z>(w, k, x, out),
                _ => rows::<F8S>(w, k, x, out),
            }
        }
    }

    /// # Safety
    /// As [`dot_rows`].
    #[target_feature(enable = "avx2,fma")]
    unsafe fn rows<const D: u8>(w: &[u8], k: usize, x: &[f32], out: &mut [f32]) {
        let (bb, nb) = (block_bytes(D), k / 32);
        let table = E4M3.as_ptr();
        for (r0, outs) in out.chunks_mut(4).enumerate() {
            let mut s0 = [_mm256_setzero_ps(); 4];
            let mut s1 = [_mm256_setzero_ps(); 4];
            let base = w.as_ptr().wrapping_add(4 * r0 * nb * bb);
            for blk in 0..nb {
                // SAFETY: block `blk` of rows 4·r0 + j < out.len() lies inside `w`, and
                // values 32·blk .. 32·blk + 32 inside `x` (the caller's promise).
                unsafe {
                    let xp = x.as_ptr().add(32 * blk);
                    let xv = [0, 8, 16, 24].map(|o| _mm256_loadu_ps(xp.add(o)));
                    for j in 0..outs.len() {
                        let v = widen::<D>(base.add((j * nb + blk) * bb), table);
                        // `simd::avx2::dot`'s order: s0 takes values 0..8 of each 16, s1 8..16.
                        s0[j] = _mm256_fmadd_ps(v[0], xv[0], s0[j]);
                        s1[j] = _mm256_fmadd_ps(v[1], xv[1], s1[j]);
                        s0[j] = _mm256_fmadd_ps(v[2], xv[2], s0[j]);
                        s1[j] = _mm256_fmadd_ps(v[3], xv[3], s1[j]);
                    }
                }
            }
            for (j, o) in outs.iter_mut().enumerate() {
                *o = hsum(_mm256_add_ps(s0[j], s1[j]));
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

    /// A block's 32 values widened: two vectors of 16, `(q − z)·d` or `e4m3(q)·d`, the same
    /// roundings as `dequantize`.
    ///
    /// # Safety
    /// The CPU must support AVX-512F; `b` points at a whole block of `D`.
    #[target_feature(enable = "avx512f")]
    #[inline]
    unsafe fn widen<const D: u8>(b: *const u8, table: *const f32) -> [__m512; 2] {
        // SAFETY: every load reads inside the block (the caller's promise).
        unsafe {
            let d = _mm512_set1_ps(b.cast::<f32>().read_unaligned());
            if D == F8S {
                let q0 = _mm512_cvtepu8_epi32(_mm_loadu_si128(b.add(4).cast()));
                let q1 = _mm512_cvtepu8_epi32(_mm_loadu_si128(b.add(20).cast()));
                return [
                    _mm512_mul_ps(_mm512_i32gather_ps::<4>(q0, table.cast()), d),
                    _mm512_mul_ps(_mm512_i32gather_ps::<4>(q1, table.cast()), d),
                ];
            }
            let z = _mm512_set1_ps(b.add(4).cast::<f32>().read_unaligned());
            let (q0, q1) = if D == Q4Z {
                let qs = _mm_loadu_si128(b.add(8).cast());
                let low = _mm_set1_epi8(0x0F);
                (
                    _mm_and_si128(qs, low),
                    _mm_and_si128(_mm_srli_epi16::<4>(qs), low),
                )
            } else {
                (
                    _mm_loadu_si128(b.add(8).cast()),
                    _mm_loadu_si128(b.add(24).cast()),
                )
            };
            let f = |q: __m128i| _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(q));
            [
                _mm512_mul_ps(_mm512_sub_ps(f(q0), z), d),
                _mm512_mul_ps(_mm512_sub_ps(f(q1), z), d),
            ]
        }
    }

    /// See `super::dot_rows`: `simd::avx512::dot`'s one 16-lane accumulator per row.
    ///
    /// # Safety
    /// The CPU must support AVX-512F; `w` holds `out.len()` rows of `k / 32` blocks and `x`
    /// `k` values.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn dot_rows(dtype: DType, w: &[u8], k: usize, x: &[f32], out: &mut [f32]) {
        // SAFETY: forwarded (the same promise).
        unsafe {
            match dtype {
                DType::Q4Z => rows::<Q4Z>(w, k, x, out),
                DType::Q8Z => rows::<Q8Z>(w, k, x, out),
                _ => rows::<F8S>(w, k, x, out),
            }
        }
    }

    /// # Safety
    /// As [`dot_rows`].
    #[target_feature(enable = "avx512f")]
    unsafe fn rows<const D: u8>(w: &[u8], k: usize, x: &[f32], out: &mut [f32]) {
        let (bb, nb) = (block_bytes(D), k / 32);
        let table = E4M3.as_ptr();
        for (r0, outs) in out.chunks_mut(4).enumerate() {
            let mut acc = [_mm512_setzero_ps(); 4];
            let base = w.as_ptr().wrapping_add(4 * r0 * nb * bb);
            for blk in 0..nb {
                // SAFETY: block `blk` of rows 4·r0 + j < out.len() lies inside `w`, and
                // values 32·blk .. 32·blk + 32 inside `x` (the caller's promise).
                unsafe {
                    let xp = x.as_ptr().add(32 * blk);
                    let (x0, x1) = (_mm512_loadu_ps(xp), _mm512_loadu_ps(xp.add(16)));
                    for (j, a) in acc.iter_mut().enumerate().take(outs.len()) {
                        let [w0, w1] = widen::<D>(base.add((j * nb + blk) * bb), table);
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

    /// The fused decode product equals widening the rows and `simd::dot`, bit for bit,
    /// for every row count (four-row passes and the rest).
    #[test]
    fn fused_rows_equal_widened_rows() {
        for dtype in [DType::Q4Z, DType::Q8Z, DType::F8S] {
            let (rows, k) = (7, 96);
            let bytes = blocks(dtype, rows * k / 32);
            let x: Vec<f32> = (0..k)
                .map(|i| ((i * 37 % 23) as f32 - 11.0) / 7.0)
                .collect();
            let mut got = vec![0f32; rows];
            dot_rows(dtype, &bytes, k, &x, &mut got);
            let row_bytes = k / 32 * dtype.block_bytes();
            let mut row = vec![0f32; k];
            for (r, g) in got.iter().enumerate() {
                dequantize(dtype, &bytes[r * row_bytes..(r + 1) * row_bytes], &mut row);
                // Scales of any magnitude: compare bits, NaN with NaN.
                let want = crate::simd::dot(&row, &x);
                assert!(
                    g.to_bits() == want.to_bits() || (g.is_nan() && want.is_nan()),
                    "{dtype} row {r}: {g} vs {want}"
                );
            }
            // The AVX2 kernel against AVX2's dot, where this CPU dispatches to AVX-512.
            #[cfg(target_arch = "x86_64")]
            if crate::simd::has_avx2_fma() {
                // SAFETY: AVX2 and FMA were detected just above.
                unsafe { avx2::dot_rows(dtype, &bytes, k, &x, &mut got) };
                for (r, g) in got.iter().enumerate() {
                    dequantize_scalar(dtype, &bytes[r * row_bytes..(r + 1) * row_bytes], &mut row);
                    // SAFETY: as above.
                    let want = unsafe { crate::simd::avx2::dot(&row, &x) };
                    let same = g.to_bits() == want.to_bits() || (g.is_nan() && want.is_nan());
                    assert!(same, "{dtype} avx2 row {r}: {g} vs {want}");
                }
            }
        }
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

#[cfg(test)]
mod speed {
    use super::*;

    /// Decode throughput of the fused rows against bf16 rows (`cargo test -p kimi-cpu
    /// --release -- --ignored --nocapture fused_decode_speed`).
    #[test]
    #[ignore]
    fn fused_decode_speed() {
        let (rows, k) = (4096, 4096);
        let x: Vec<f32> = (0..k).map(|i| (i % 13) as f32 * 0.1).collect();
        let mut out = vec![0f32; rows];
        for dtype in [DType::Q4Z, DType::Q8Z, DType::F8S] {
            let bytes = vec![0x11u8; rows * k / 32 * dtype.block_bytes()];
            let t = std::time::Instant::now();
            for _ in 0..20 {
                dot_rows(dtype, &bytes, k, &x, &mut out);
            }
            let s = t.elapsed().as_secs_f64() / 20.0;
            eprintln!(
                "{dtype}: {:.2} ms, {:.2} GB/s of weights, {:.2} Gvalues/s",
                s * 1e3,
                bytes.len() as f64 / s / 1e9,
                (rows * k) as f64 / s / 1e9
            );
        }
        let w = vec![0x3f80u16; rows * k];
        let t = std::time::Instant::now();
        for _ in 0..20 {
            crate::simd::dot_rows_16bit::<false>(&w, k, &x, &mut out);
        }
        let s = t.elapsed().as_secs_f64() / 20.0;
        eprintln!(
            "bf16: {:.2} ms, {:.2} GB/s, {:.2} Gvalues/s",
            s * 1e3,
            w.len() as f64 * 2.0 / s / 1e9,
            (rows * k) as f64 / s / 1e9
        );
    }
}
