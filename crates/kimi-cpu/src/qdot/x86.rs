//! x86_64 kernels: one body over 256-bit vectors, instantiated with two dot-product units,
//! AVX2 (`vpmaddubsw` + `vpmaddwd`) and AVX-512 VNNI (`vpdpbusd`, EVEX on 256 bits).
//!
//! The bodies are `#[inline(always)]` generic functions so that they inline into the
//! `#[target_feature]` entry points and compile with those features.

use std::arch::x86_64::*;

use super::{q4k_scale_min, Kind, Q8Acts, QK};

/// `Σ w[4i..4i+4]·x[4i..4i+4]` per i32 lane, `w` unsigned and at most 128, `x` signed.
trait I8Dot {
    /// # Safety
    /// The CPU must have the unit's features (the entry points guarantee it).
    unsafe fn dot(w: __m256i, x: __m256i) -> __m256i;
}

struct Maddubs;
impl I8Dot for Maddubs {
    #[inline(always)]
    unsafe fn dot(w: __m256i, x: __m256i) -> __m256i {
        // SAFETY: AVX2 (caller). Pair sums are at most 2·128·127 < 2^15: no saturation
        // (activations are in -127..=127, weights at most 128).
        unsafe { _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1)) }
    }
}

struct Vnni;
impl I8Dot for Vnni {
    #[inline(always)]
    unsafe fn dot(w: __m256i, x: __m256i) -> __m256i {
        // SAFETY: AVX-512 VNNI + VL (caller).
        unsafe { _mm256_dpbusd_epi32(_mm256_setzero_si256(), w, x) }
    }
}

/// # Safety
/// The CPU must support AVX2, FMA and F16C; sizes as checked by `qdot::matmul_rows_with`.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn matmul_rows_avx2(kind: Kind, w: &[u8], x: &Q8Acts, out: &mut [f32]) {
    // SAFETY: features and sizes as this function requires.
    unsafe { rows::<Maddubs>(kind, w, x, out) }
}

/// # Safety
/// The CPU must support AVX2, FMA, F16C and AVX-512 F/BW/VL/VNNI; sizes as checked by
/// `qdot::matmul_rows_with`.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub(super) unsafe fn matmul_rows_vnni(kind: Kind, w: &[u8], x: &Q8Acts, out: &mut [f32]) {
    // SAFETY: features and sizes as this function requires.
    unsafe { rows::<Vnni>(kind, w, x, out) }
}

/// Every row, tokens four at a time so each weight block is expanded once per four tokens.
#[inline(always)]
unsafe fn rows<D: I8Dot>(kind: Kind, w: &[u8], x: &Q8Acts, out: &mut [f32]) {
    let n = x.n;
    let row_bytes = kind.row_bytes(x.k);
    for (r, row) in w.chunks_exact(row_bytes.max(1)).enumerate() {
        let mut t0 = 0;
        while t0 < n {
            let nt = (n - t0).min(4);
            let o = &mut out[r * n + t0..r * n + t0 + nt];
            // SAFETY: features from the caller; `row` is one whole row of `x.k` values and
            // tokens t0..t0 + nt exist in `x` (sizes checked by the dispatcher).
            unsafe {
                match nt {
                    1 => row_tokens::<D, 1>(kind, row, x, t0, o),
                    2 => row_tokens::<D, 2>(kind, row, x, t0, o),
                    3 => row_tokens::<D, 3>(kind, row, x, t0, o),
                    _ => row_tokens::<D, 4>(kind, row, x, t0, o),
                }
            }
            t0 += nt;
        }
    }
}

#[inline(always)]
unsafe fn f16_at(p: *const u8) -> f32 {
    // SAFETY: the caller passes a pointer to two readable bytes; F16C is enabled.
    unsafe {
        let h = std::ptr::read_unaligned(p.cast::<u16>());
        _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(i32::from(h))))
    }
}

#[inline(always)]
unsafe fn hsum(v: __m256) -> f32 {
    // SAFETY: AVX (implied by the caller's AVX2).
    unsafe {
        let s = _mm_add_ps(_mm256_extractf128_ps(v, 1), _mm256_castps256_ps128(v));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps(s, s, 1)))
    }
}

/// `out[i] = row · token t0 + i` for `i < N`.
///
/// # Safety
/// Features from the caller; `row` is `kind.row_bytes(x.k)` bytes; tokens `t0..t0 + N`
/// exist in `x`, whose arrays have their documented sizes; `out.len() == N`.
#[inline(always)]
unsafe fn row_tokens<D: I8Dot, const N: usize>(
    kind: Kind,
    row: &[u8],
    x: &Q8Acts,
    t0: usize,
    out: &mut [f32],
) {
    let nb = x.blocks();
    let rp = row.as_ptr();
    // SAFETY (for every pointer offset below): token t0 + i < x.n, so its `k` values and
    // `nb` scales and sums lie inside `x.qs`, `x.d` and `x.sum`; block `b < nb` of this
    // row lies inside `row` (a whole row of `nb` 32-value blocks, or `nb / 8` Q4_K
    // super-blocks), and every load below stays within its block.
    let qs: [*const i8; N] = std::array::from_fn(|i| unsafe { x.qs.as_ptr().add((t0 + i) * x.k) });
    let xd: [*const f32; N] = std::array::from_fn(|i| unsafe { x.d.as_ptr().add((t0 + i) * nb) });
    let xs: [*const f32; N] = std::array::from_fn(|i| unsafe { x.sum.as_ptr().add((t0 + i) * nb) });
    let mut off = [0f32; N];
    unsafe {
        let mut acc = [_mm256_setzero_ps(); N];
        let m4 = _mm256_set1_epi8(0x0F);
        match kind {
            Kind::Q4_0 | Kind::Q4_1 => {
                let (bb, qo) = if kind == Kind::Q4_0 { (18, 2) } else { (20, 4) };
                for b in 0..nb {
                    let blk = rp.add(b * bb);
                    let dw = f16_at(blk);
                    let c = if kind == Kind::Q4_0 {
                        -8.0 * dw
                    } else {
                        f16_at(blk.add(2))
                    };
                    // Byte j holds value j (low nibble) and j + 16 (high nibble).
                    let nib = _mm_loadu_si128(blk.add(qo).cast());
                    let wv = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(nib, 4), nib), m4);
                    for i in 0..N {
                        let xv = _mm256_loadu_si256(qs[i].add(b * QK).cast());
                        let p = _mm256_cvtepi32_ps(D::dot(wv, xv));
                        acc[i] = _mm256_fmadd_ps(_mm256_set1_ps(dw * *xd[i].add(b)), p, acc[i]);
                        off[i] += c * *xs[i].add(b);
                    }
                }
            }
            Kind::Q8_0 => {
                for b in 0..nb {
                    let blk = rp.add(b * 34);
                    let dw = f16_at(blk);
                    let wv = _mm256_loadu_si256(blk.add(2).cast());
                    // Signed × signed as |w| × (x · sign w).
                    let aw = _mm256_abs_epi8(wv);
                    for i in 0..N {
                        let xv = _mm256_loadu_si256(qs[i].add(b * QK).cast());
                        let p = _mm256_cvtepi32_ps(D::dot(aw, _mm256_sign_epi8(xv, wv)));
                        acc[i] = _mm256_fmadd_ps(_mm256_set1_ps(dw * *xd[i].add(b)), p, acc[i]);
                    }
                }
            }
            Kind::Q4K => {
                for sb in 0..nb / 8 {
                    let blk = rp.add(sb * 144);
                    let (d, dmin) = (f16_at(blk), f16_at(blk.add(2)));
                    let scales = std::slice::from_raw_parts(blk.add(4), 12);
                    let mut sc = [0f32; 8];
                    let mut mn = [0f32; 8];
                    for j in 0..8 {
                        let (s, m) = q4k_scale_min(j, scales);
                        sc[j] = d * f32::from(s);
                        mn[j] = -dmin * f32::from(m);
                    }
                    for pair in 0..4 {
                        // 32 bytes: low nibbles are sub-block 2·pair, high ones 2·pair + 1.
                        let q = _mm256_loadu_si256(blk.add(16 + 32 * pair).cast());
                        let lo = _mm256_and_si256(q, m4);
                        let hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
                        let b = sb * 8 + 2 * pair;
                        for i in 0..N {
                            let x0 = _mm256_loadu_si256(qs[i].add(b * QK).cast());
                            let x1 = _mm256_loadu_si256(qs[i].add((b + 1) * QK).cast());
                            let p0 = _mm256_cvtepi32_ps(D::dot(lo, x0));
                            let p1 = _mm256_cvtepi32_ps(D::dot(hi, x1));
                            let s0 = _mm256_set1_ps(sc[2 * pair] * *xd[i].add(b));
                            let s1 = _mm256_set1_ps(sc[2 * pair + 1] * *xd[i].add(b + 1));
                            acc[i] = _mm256_fmadd_ps(s1, p1, _mm256_fmadd_ps(s0, p0, acc[i]));
                        }
                    }
                    for i in 0..N {
                        for (j, m) in mn.iter().enumerate() {
                            off[i] += m * *xs[i].add(sb * 8 + j);
                        }
                    }
                }
            }
        }
        for i in 0..N {
            out[i] = hsum(acc[i]) + off[i];
        }
    }
}
