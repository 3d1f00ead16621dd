//! x86_64 kernels: one body over 256-bit vectors, instantiated with two dot-product units,
//! AVX2 (`vpmaddubsw` + `vpmaddwd`) and AVX-512 VNNI (`vpdpbusd`, EVEX on 256 bits).
//!
//! Work goes in tiles of `R` weight rows by `N` tokens: each weight block is expanded once
//! per tile and each activation block loaded once per tile, and the `R·N` accumulators are
//! independent, so the per-block latency chains (scale conversion, integer dot, FMA) of one
//! row overlap with those of the others. A row at a time leaves the core waiting on them.
//!
//! The bodies are `#[inline(always)]` generic functions so that they inline into the
//! `#[target_feature]` entry points and compile with those features.

use std::arch::x86_64::*;

use super::groups::{self, GROUP};
use super::{q4k_scale_min, Kind, Q8Acts, QK};

/// `Σ w[4i..4i+4]·x[4i..4i+4]` per i32 lane, `w` unsigned and at most 128, `x` signed.
trait I8Dot {
    /// Rows per tile when at least four tokens are multiplied: as many accumulators as the
    /// unit's register file holds beside the operands (16 ymm registers on AVX2, 32 with
    /// AVX-512).
    const WIDE_ROWS: usize;

    /// # Safety
    /// The CPU must have the unit's features (the entry points guarantee it).
    unsafe fn dot(w: __m256i, x: __m256i) -> __m256i;
}

struct Maddubs;
impl I8Dot for Maddubs {
    const WIDE_ROWS: usize = 2;

    #[inline(always)]
    unsafe fn dot(w: __m256i, x: __m256i) -> __m256i {
        // SAFETY: AVX2 (caller). Pair sums are at most 2·128·127 < 2^15: no saturation
        // (activations are in -127..=127, weights at most 128).
        unsafe { _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1)) }
    }
}

struct Vnni;
impl I8Dot for Vnni {
    const WIDE_ROWS: usize = 4;

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

/// Every row and token, in tiles: four rows per token for one or two tokens (decode),
/// `D::WIDE_ROWS` rows by four tokens otherwise; single rows and fewer tokens at the edges.
#[inline(always)]
unsafe fn rows<D: I8Dot>(kind: Kind, w: &[u8], x: &Q8Acts, out: &mut [f32]) {
    let (n, rb) = (x.n, kind.row_bytes(x.k));
    let nrows = w.len().checked_div(rb).unwrap_or(0);
    let (tile_rows, tile_tokens) = if n <= 2 { (4, n) } else { (D::WIDE_ROWS, 4) };
    let mut r0 = 0;
    while r0 < nrows {
        let nr = if r0 + tile_rows <= nrows {
            tile_rows
        } else {
            1
        };
        let mut t0 = 0;
        while t0 < n {
            let nt = (n - t0).min(tile_tokens);
            // SAFETY: rows r0..r0 + nr and tokens t0..t0 + nt exist (sizes checked by the
            // dispatcher); features from the caller.
            unsafe {
                match (nr, nt) {
                    (1, 1) => tile::<D, 1, 1>(kind, w, rb, r0, x, t0, out),
                    (1, 2) => tile::<D, 1, 2>(kind, w, rb, r0, x, t0, out),
                    (1, 3) => tile::<D, 1, 3>(kind, w, rb, r0, x, t0, out),
                    (1, _) => tile::<D, 1, 4>(kind, w, rb, r0, x, t0, out),
                    (2, 1) => tile::<D, 2, 1>(kind, w, rb, r0, x, t0, out),
                    (2, 2) => tile::<D, 2, 2>(kind, w, rb, r0, x, t0, out),
                    (2, 3) => tile::<D, 2, 3>(kind, w, rb, r0, x, t0, out),
                    (2, _) => tile::<D, 2, 4>(kind, w, rb, r0, x, t0, out),
                    (_, 1) => tile::<D, 4, 1>(kind, w, rb, r0, x, t0, out),
                    (_, 2) => tile::<D, 4, 2>(kind, w, rb, r0, x, t0, out),
                    (_, 3) => tile::<D, 4, 3>(kind, w, rb, r0, x, t0, out),
                    (_, _) => tile::<D, 4, 4>(kind, w, rb, r0, x, t0, out),
                }
            }
            t0 += nt;
        }
        r0 += nr;
    }
}

/// The two f16 values at `p` and `p + 2` as f32, in lanes 0 and 1. A 32-bit load into a
/// fresh register (`vmovd`): a 16-bit insert would merge into, and wait on, a live one.
#[inline(always)]
unsafe fn f16_pair(p: *const u8) -> __m128 {
    // SAFETY: the caller passes a pointer to four readable bytes; F16C is enabled.
    unsafe { _mm_cvtph_ps(_mm_cvtsi32_si128(std::ptr::read_unaligned(p.cast::<i32>()))) }
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

/// Q5_0's high bits as bytes: byte `j` is `0x10` where bit `j` of `qh` is set, else 0.
#[inline(always)]
unsafe fn q5_0_high_bits(qh: u32) -> __m256i {
    // SAFETY: AVX2 (caller); register-only operations.
    unsafe {
        // Byte j takes byte j / 8 of qh (each 128-bit lane holds all four), then tests its
        // bit j % 8.
        let sel = _mm256_set_epi64x(
            0x0303_0303_0303_0303,
            0x0202_0202_0202_0202,
            0x0101_0101_0101_0101,
            0,
        );
        let bytes = _mm256_shuffle_epi8(_mm256_set1_epi32(qh as i32), sel);
        let bit = _mm256_set1_epi64x(0x8040_2010_0804_0201u64 as i64);
        let set = _mm256_cmpeq_epi8(_mm256_and_si256(bytes, bit), bit);
        _mm256_and_si256(set, _mm256_set1_epi8(0x10))
    }
}

/// Bit `s` (< 8) of every byte of `qh`, moved to bit 4: Q5_K's fifth bits of sub-block `s`.
#[inline(always)]
unsafe fn fifth_bit(qh: __m256i, s: u32) -> __m256i {
    // SAFETY: AVX2 (caller); register-only operations.
    unsafe {
        let bit = _mm256_set1_epi8((1u8 << s) as i8);
        let set = _mm256_cmpeq_epi8(_mm256_and_si256(qh, bit), bit);
        _mm256_and_si256(set, _mm256_set1_epi8(0x10))
    }
}

/// The 32 six-bit values `q` (0..64) of activation block `s` (0..8) of the Q6_K
/// super-block at `blk` (layout in `qdot::q6k_level`), as bytes.
///
/// # Safety
/// AVX2 (caller); `blk` points to a whole 210-byte block.
#[inline(always)]
unsafe fn q6k_levels(blk: *const u8, s: usize) -> __m256i {
    let (h, k) = (s / 4, s % 4);
    // SAFETY: both 32-byte loads lie in the block's ql[128] and qh[64].
    unsafe {
        let ql = _mm256_loadu_si256(blk.add(64 * h + 32 * (k % 2)).cast());
        let qh = _mm256_loadu_si256(blk.add(128 + 32 * h).cast());
        let m4 = _mm256_set1_epi8(0x0F);
        let low = if k < 2 {
            _mm256_and_si256(ql, m4)
        } else {
            _mm256_and_si256(_mm256_srli_epi16(ql, 4), m4)
        };
        // Bits 2k..2k + 2 of each byte to bits 4..6; the 16-bit shifts carry bits across
        // bytes only into positions the mask drops.
        let high = match k {
            0 => _mm256_slli_epi16(qh, 4),
            1 => _mm256_slli_epi16(qh, 2),
            2 => qh,
            _ => _mm256_srli_epi16(qh, 2),
        };
        _mm256_or_si256(low, _mm256_and_si256(high, _mm256_set1_epi8(0x30)))
    }
}

/// Activation block `s`'s two Q6_K sub-block scales as `madd` operands: `all` holds the
/// 16 scales as i16; the result has `scales[2s]` in the low eight 16-bit lanes (values
/// 0..16) and `scales[2s + 1]` in the high ones.
#[inline(always)]
unsafe fn q6k_block_scales(all: __m256i, s: usize) -> __m256i {
    // SAFETY: AVX2 (caller); register-only operations.
    unsafe {
        // Every 32-bit lane gets the pair (scales[2s], scales[2s + 1]), then each 128-bit
        // half keeps one of the two.
        let pair = _mm256_permutevar8x32_epi32(all, _mm256_set1_epi32(s as i32));
        let pick = _mm256_setr_epi8(
            0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, //
            2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3,
        );
        _mm256_shuffle_epi8(pair, pick)
    }
}

/// The row, token, scale and sum pointers of a tile (see [`tile`]).
struct TilePtrs<const R: usize, const N: usize> {
    rp: [*const u8; R],
    qs: [*const i8; N],
    xd: [*const f32; N],
    xs: [*const f32; N],
}

/// Q4_K (`FIVE` false) or Q5_K super-blocks of a tile: 8 sub-blocks of 32 with 6-bit
/// scales and mins, the mins applied through the activation block sums.
///
/// # Safety
/// As [`tile`], whose pointers `t` holds.
#[inline(always)]
unsafe fn scale_min_blocks<D: I8Dot, const R: usize, const N: usize, const FIVE: bool>(
    t: &TilePtrs<R, N>,
    nb: usize,
    acc: &mut [[__m256; N]; R],
    off: &mut [[f32; N]; R],
) {
    let TilePtrs { rp, qs, xd, xs } = t;
    // SAFETY: as in `tile`: every pointer offset stays inside its row, token or block.
    unsafe {
        let m4 = _mm256_set1_epi8(0x0F);
        let (bb, qo) = if FIVE { (176, 48) } else { (144, 16) };
        for sb in 0..nb / 8 {
            let mut sc = [[0f32; 8]; R];
            let mut mn = [[0f32; 8]; R];
            for j in 0..R {
                let blk = rp[j].add(sb * bb);
                let dd = f16_pair(blk);
                let (d, dmin) = (_mm_cvtss_f32(dd), _mm_cvtss_f32(_mm_movehdup_ps(dd)));
                let scales = std::slice::from_raw_parts(blk.add(4), 12);
                for s in 0..8 {
                    let (q, m) = q4k_scale_min(s, scales);
                    sc[j][s] = d * f32::from(q);
                    mn[j][s] = -dmin * f32::from(m);
                }
            }
            for pair in 0..4 {
                let b = sb * 8 + 2 * pair;
                let x0: [__m256i; N] =
                    std::array::from_fn(|i| _mm256_loadu_si256(qs[i].add(b * QK).cast()));
                let x1: [__m256i; N] =
                    std::array::from_fn(|i| _mm256_loadu_si256(qs[i].add((b + 1) * QK).cast()));
                for j in 0..R {
                    let blk = rp[j].add(sb * bb);
                    // 32 bytes: low nibbles are sub-block 2·pair, high ones 2·pair + 1.
                    let q = _mm256_loadu_si256(blk.add(qo + 32 * pair).cast());
                    let mut lo = _mm256_and_si256(q, m4);
                    let mut hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
                    if FIVE {
                        // Bit s of qh[l] is the fifth bit of value l of sub-block s.
                        let qh = _mm256_loadu_si256(blk.add(16).cast());
                        lo = _mm256_or_si256(lo, fifth_bit(qh, 2 * pair as u32));
                        hi = _mm256_or_si256(hi, fifth_bit(qh, 2 * pair as u32 + 1));
                    }
                    for i in 0..N {
                        let p0 = _mm256_cvtepi32_ps(D::dot(lo, x0[i]));
                        let p1 = _mm256_cvtepi32_ps(D::dot(hi, x1[i]));
                        let s0 = _mm256_set1_ps(sc[j][2 * pair] * *xd[i].add(b));
                        let s1 = _mm256_set1_ps(sc[j][2 * pair + 1] * *xd[i].add(b + 1));
                        acc[j][i] = _mm256_fmadd_ps(s1, p1, _mm256_fmadd_ps(s0, p0, acc[j][i]));
                    }
                }
            }
            for j in 0..R {
                for i in 0..N {
                    for (s, m) in mn[j].iter().enumerate() {
                        off[j][i] += m * *xs[i].add(sb * 8 + s);
                    }
                }
            }
        }
    }
}

/// `out[(r0 + j) * n + t0 + i] = row r0 + j · token t0 + i` for `j < R`, `i < N`.
///
/// # Safety
/// Features from the caller; `w` holds whole rows of `rb` bytes and rows `r0..r0 + R`
/// exist; tokens `t0..t0 + N` exist in `x`, whose arrays have their documented sizes;
/// `out` has `x.n` results per row.
#[inline(always)]
unsafe fn tile<D: I8Dot, const R: usize, const N: usize>(
    kind: Kind,
    w: &[u8],
    rb: usize,
    r0: usize,
    x: &Q8Acts,
    t0: usize,
    out: &mut [f32],
) {
    let nb = x.blocks();
    // SAFETY (for every pointer offset below): rows r0 + j < rows lie inside `w`; token
    // t0 + i < x.n, so its `k` values and `nb` scales and sums lie inside `x.qs`, `x.d`
    // and `x.sum`; block `b < nb` of a row lies inside that row (a whole row of `nb`
    // 32-value blocks, or `nb / 8` super-blocks), and every load below stays within its
    // block (the f16 pair loads read four bytes of a block of at least 18; Q6_K's ends at
    // the block's last byte).
    let rp: [*const u8; R] = std::array::from_fn(|j| unsafe { w.as_ptr().add((r0 + j) * rb) });
    let qs: [*const i8; N] = std::array::from_fn(|i| unsafe { x.qs.as_ptr().add((t0 + i) * x.k) });
    let xd: [*const f32; N] = std::array::from_fn(|i| unsafe { x.d.as_ptr().add((t0 + i) * nb) });
    let xs: [*const f32; N] = std::array::from_fn(|i| unsafe { x.sum.as_ptr().add((t0 + i) * nb) });
    let mut off = [[0f32; N]; R];
    unsafe {
        let mut acc = [[_mm256_setzero_ps(); N]; R];
        let m4 = _mm256_set1_epi8(0x0F);
        match kind {
            Kind::Q4_0 | Kind::Q4_1 => {
                let q4_0 = kind == Kind::Q4_0;
                let (bb, qo) = if q4_0 { (18, 2) } else { (20, 4) };
                for b in 0..nb {
                    let xv: [__m256i; N] =
                        std::array::from_fn(|i| _mm256_loadu_si256(qs[i].add(b * QK).cast()));
                    let xdb: [f32; N] = std::array::from_fn(|i| *xd[i].add(b));
                    let xsb: [f32; N] = std::array::from_fn(|i| *xs[i].add(b));
                    for j in 0..R {
                        let blk = rp[j].add(b * bb);
                        // Q4_0: d then the first two quant bytes; Q4_1: d and m.
                        let dm = f16_pair(blk);
                        let dw = _mm_cvtss_f32(dm);
                        let c = if q4_0 {
                            -8.0 * dw
                        } else {
                            _mm_cvtss_f32(_mm_movehdup_ps(dm))
                        };
                        // Byte j holds value j (low nibble) and j + 16 (high nibble).
                        let nib = _mm_loadu_si128(blk.add(qo).cast());
                        let wv =
                            _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(nib, 4), nib), m4);
                        for i in 0..N {
                            let p = _mm256_cvtepi32_ps(D::dot(wv, xv[i]));
                            acc[j][i] = _mm256_fmadd_ps(_mm256_set1_ps(dw * xdb[i]), p, acc[j][i]);
                            off[j][i] += c * xsb[i];
                        }
                    }
                }
            }
            // Q4_0's loop with the fifth bits and a -16 offset; an arm of its own keeps
            // the Q4 loops free of per-block type tests.
            Kind::Q5_0 => {
                for b in 0..nb {
                    let xv: [__m256i; N] =
                        std::array::from_fn(|i| _mm256_loadu_si256(qs[i].add(b * QK).cast()));
                    let xdb: [f32; N] = std::array::from_fn(|i| *xd[i].add(b));
                    let xsb: [f32; N] = std::array::from_fn(|i| *xs[i].add(b));
                    for j in 0..R {
                        let blk = rp[j].add(b * 22);
                        let dw = _mm_cvtss_f32(f16_pair(blk));
                        let qh = u32::from_le(std::ptr::read_unaligned(blk.add(2).cast::<u32>()));
                        let nib = _mm_loadu_si128(blk.add(6).cast());
                        let wv =
                            _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(nib, 4), nib), m4);
                        let wv = _mm256_or_si256(wv, q5_0_high_bits(qh));
                        for i in 0..N {
                            let p = _mm256_cvtepi32_ps(D::dot(wv, xv[i]));
                            acc[j][i] = _mm256_fmadd_ps(_mm256_set1_ps(dw * xdb[i]), p, acc[j][i]);
                            off[j][i] += -16.0 * dw * xsb[i];
                        }
                    }
                }
            }
            Kind::Q8_0 => {
                for b in 0..nb {
                    let xv: [__m256i; N] =
                        std::array::from_fn(|i| _mm256_loadu_si256(qs[i].add(b * QK).cast()));
                    let xdb: [f32; N] = std::array::from_fn(|i| *xd[i].add(b));
                    for j in 0..R {
                        let blk = rp[j].add(b * 34);
                        let dw = _mm_cvtss_f32(f16_pair(blk));
                        let wv = _mm256_loadu_si256(blk.add(2).cast());
                        // Signed × signed as |w| × (x · sign w).
                        let aw = _mm256_abs_epi8(wv);
                        for i in 0..N {
                            let p = _mm256_cvtepi32_ps(D::dot(aw, _mm256_sign_epi8(xv[i], wv)));
                            acc[j][i] = _mm256_fmadd_ps(_mm256_set1_ps(dw * xdb[i]), p, acc[j][i]);
                        }
                    }
                }
            }
            // A function per type, so that Q4_K's loop carries no test for Q5_K's bits.
            Kind::Q4K => {
                let ptrs = TilePtrs { rp, qs, xd, xs };
                scale_min_blocks::<D, R, N, false>(&ptrs, nb, &mut acc, &mut off);
            }
            Kind::Q5K => {
                let ptrs = TilePtrs { rp, qs, xd, xs };
                scale_min_blocks::<D, R, N, true>(&ptrs, nb, &mut acc, &mut off);
            }
            Kind::Q6K => {
                for sb in 0..nb / 8 {
                    let mut dq = [0f32; R];
                    let mut scales = [_mm256_setzero_si256(); R];
                    for j in 0..R {
                        let blk = rp[j].add(sb * 210);
                        // `d` is the block's last two bytes: read the pair that ends there.
                        dq[j] = _mm_cvtss_f32(_mm_movehdup_ps(f16_pair(blk.add(206))));
                        scales[j] = _mm256_cvtepi8_epi16(_mm_loadu_si128(blk.add(192).cast()));
                    }
                    for s in 0..8 {
                        let b = sb * 8 + s;
                        let xv: [__m256i; N] =
                            std::array::from_fn(|i| _mm256_loadu_si256(qs[i].add(b * QK).cast()));
                        // 32·x in pair sums, the part of (q - 32)·x every row shares.
                        let x32: [__m256i; N] = std::array::from_fn(|i| {
                            _mm256_maddubs_epi16(_mm256_set1_epi8(32), xv[i])
                        });
                        let xdb: [f32; N] = std::array::from_fn(|i| *xd[i].add(b));
                        for j in 0..R {
                            let q = q6k_levels(rp[j].add(sb * 210), s);
                            let sc = q6k_block_scales(scales[j], s);
                            for i in 0..N {
                                // Pair sums of q·x (at most 2·63·127) less those of 32·x
                                // (2·32·127): within i16, no saturation.
                                let qx = _mm256_sub_epi16(_mm256_maddubs_epi16(q, xv[i]), x32[i]);
                                let p = _mm256_cvtepi32_ps(_mm256_madd_epi16(qx, sc));
                                acc[j][i] =
                                    _mm256_fmadd_ps(_mm256_set1_ps(dq[j] * xdb[i]), p, acc[j][i]);
                            }
                        }
                    }
                }
            }
        }
        for j in 0..R {
            for i in 0..N {
                out[(r0 + j) * x.n + t0 + i] = hsum(acc[j][i]) + off[j][i];
            }
        }
    }
}

/// Interleaved weights (`super::groups`), every group of 16 rows and every token, up to
/// four tokens per pass over a group's blocks.
///
/// # Safety
/// The CPU must support AVX2, FMA, F16C and AVX-512 F/BW/VL/VNNI; sizes as checked by
/// `groups::matmul_groups_with`.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub(super) unsafe fn matmul_groups_vnni(kind: Kind, w: &[u8], x: &Q8Acts, out: &mut [f32]) {
    // SAFETY: features and sizes as this function requires.
    unsafe { each_group::<Vnni>(kind, w, x, out) }
}

/// [`matmul_groups_vnni`] on AVX2 (`vpmaddubsw` + `vpmaddwd`), a group's two 8-row halves
/// one after the other: a half's accumulators fit the 16 ymm registers, and the second
/// half finds the group's bytes in L1 or L2.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C; sizes as checked by
/// `groups::matmul_groups_with`.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn matmul_groups_avx2(kind: Kind, w: &[u8], x: &Q8Acts, out: &mut [f32]) {
    // SAFETY: features and sizes as this function requires.
    unsafe { each_group::<Maddubs>(kind, w, x, out) }
}

/// One pass of an interleaved kernel: `PARTS` parts of `16 / PARTS` rows per group, each
/// over up to four tokens.
trait GroupPass {
    const PARTS: usize;

    /// Part `part` of the group `gw` (rows `row0..row0 + rows`) · tokens `t0..t0 + N`.
    ///
    /// # Safety
    /// As [`group`].
    unsafe fn pass<const N: usize>(
        kind: Kind,
        gw: &[u8],
        x: &Q8Acts,
        t0: usize,
        rows: (usize, usize),
        part: usize,
        out: &mut [f32],
    );
}

impl GroupPass for Vnni {
    const PARTS: usize = 1;

    #[inline(always)]
    unsafe fn pass<const N: usize>(
        kind: Kind,
        gw: &[u8],
        x: &Q8Acts,
        t0: usize,
        rows: (usize, usize),
        _part: usize,
        out: &mut [f32],
    ) {
        // SAFETY: as the caller guarantees.
        unsafe { group::<N>(kind, gw, x, t0, rows, out) }
    }
}

impl GroupPass for Maddubs {
    const PARTS: usize = 2;

    #[inline(always)]
    unsafe fn pass<const N: usize>(
        kind: Kind,
        gw: &[u8],
        x: &Q8Acts,
        t0: usize,
        rows: (usize, usize),
        part: usize,
        out: &mut [f32],
    ) {
        // SAFETY: as the caller guarantees.
        unsafe { half_group::<N>(kind, gw, x, t0, rows, part, out) }
    }
}

/// Every group, part and token of interleaved weights.
///
/// # Safety
/// Features of `G`'s unit from the caller; sizes as checked by `groups::matmul_groups_with`.
#[inline(always)]
unsafe fn each_group<G: GroupPass>(kind: Kind, w: &[u8], x: &Q8Acts, out: &mut [f32]) {
    let group_bytes = groups::group_bytes(kind, x.k);
    let rows = out.len() / x.n;
    for (g, gw) in w.chunks_exact(group_bytes).enumerate() {
        let rows = (g * GROUP..rows.min((g + 1) * GROUP)).len();
        for part in 0..rows.div_ceil(GROUP / G::PARTS) {
            let mut t0 = 0;
            while t0 < x.n {
                let nt = (x.n - t0).min(4);
                let at = (g * GROUP, rows);
                // SAFETY: group `g` and tokens t0..t0 + nt exist, and `rows` of the group
                // have results (sizes checked by the dispatcher); features from the caller.
                unsafe {
                    match nt {
                        1 => G::pass::<1>(kind, gw, x, t0, at, part, out),
                        2 => G::pass::<2>(kind, gw, x, t0, at, part, out),
                        3 => G::pass::<3>(kind, gw, x, t0, at, part, out),
                        _ => G::pass::<4>(kind, gw, x, t0, at, part, out),
                    }
                }
                t0 += nt;
            }
        }
    }
}

/// Rows `row0..row0 + rows` (`rows ≤ 16`, the group `gw`) · tokens `t0..t0 + N`.
///
/// # Safety
/// Features from the caller; `gw` holds one whole group of rows of `x.k` values; tokens
/// `t0..t0 + N` exist in `x`; `out` has `x.n` results per row for rows up to
/// `row0 + rows`.
#[inline(always)]
unsafe fn group<const N: usize>(
    kind: Kind,
    gw: &[u8],
    x: &Q8Acts,
    t0: usize,
    (row0, rows): (usize, usize),
    out: &mut [f32],
) {
    let nb = x.blocks();
    let bb16 = GROUP * kind.block_bytes();
    let sb = groups::scale_bytes(kind);
    // SAFETY (every pointer below): block b < nb of the group spans `bb16` bytes inside
    // `gw`; token t0 + i < x.n has `k` quants and `nb` scales and sums in `x`.
    unsafe {
        let qs: [*const u8; N] = std::array::from_fn(|i| x.qs.as_ptr().add((t0 + i) * x.k).cast());
        let xd: [*const f32; N] = std::array::from_fn(|i| x.d.as_ptr().add((t0 + i) * nb));
        let xs: [*const f32; N] = std::array::from_fn(|i| x.sum.as_ptr().add((t0 + i) * nb));
        let xi: [*const i32; N] = std::array::from_fn(|i| x.isum.as_ptr().add((t0 + i) * nb));
        // Four activation values of token i, block b, from value `v`, in every lane.
        let word = |i: usize, b: usize, v: usize| {
            _mm512_set1_epi32(std::ptr::read_unaligned(
                qs[i].add(b * QK + v).cast::<i32>(),
            ))
        };
        let mut acc = [_mm512_setzero_ps(); N];
        let m4 = _mm512_set1_epi8(0x0F);
        let lead = t0 == 0;
        match kind {
            Kind::Q4_0 | Kind::Q4_1 => {
                let q4_1 = kind == Kind::Q4_1;
                for b in 0..nb {
                    let blk = gw.as_ptr().add(b * bb16);
                    if lead {
                        prefetch_ahead(blk, bb16);
                    }
                    // Low and high nibbles in separate sums: two dependency chains.
                    let mut lo = [_mm512_setzero_si512(); N];
                    let mut hi = [_mm512_setzero_si512(); N];
                    for j in 0..4 {
                        let v = _mm512_loadu_si512(blk.add(sb + 64 * j).cast());
                        let l = _mm512_and_si512(v, m4);
                        let h = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
                        for i in 0..N {
                            lo[i] = _mm512_dpbusd_epi32(lo[i], l, word(i, b, 4 * j));
                            hi[i] = _mm512_dpbusd_epi32(hi[i], h, word(i, b, 16 + 4 * j));
                        }
                    }
                    let d = _mm512_cvtph_ps(_mm256_loadu_si256(blk.cast()));
                    let m = if q4_1 {
                        _mm512_cvtph_ps(_mm256_loadu_si256(blk.add(32).cast()))
                    } else {
                        _mm512_setzero_ps()
                    };
                    for i in 0..N {
                        let mut s = _mm512_add_epi32(lo[i], hi[i]);
                        if !q4_1 {
                            // Nibbles are stored + 8: Σ (q + 8)·x − 8·Σx, exactly.
                            s = _mm512_sub_epi32(s, _mm512_set1_epi32(8 * *xi[i].add(b)));
                        }
                        let scale = _mm512_mul_ps(d, _mm512_set1_ps(*xd[i].add(b)));
                        acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), scale, acc[i]);
                        if q4_1 {
                            acc[i] = _mm512_fmadd_ps(m, _mm512_set1_ps(*xs[i].add(b)), acc[i]);
                        }
                    }
                }
            }
            Kind::Q8_0 => {
                for b in 0..nb {
                    let blk = gw.as_ptr().add(b * bb16);
                    if lead {
                        prefetch_ahead(blk, bb16);
                    }
                    let mut even = [_mm512_setzero_si512(); N];
                    let mut odd = [_mm512_setzero_si512(); N];
                    for j in (0..8).step_by(2) {
                        let v0 = _mm512_loadu_si512(blk.add(sb + 64 * j).cast());
                        let v1 = _mm512_loadu_si512(blk.add(sb + 64 * (j + 1)).cast());
                        for i in 0..N {
                            even[i] = _mm512_dpbusd_epi32(even[i], v0, word(i, b, 4 * j));
                            odd[i] = _mm512_dpbusd_epi32(odd[i], v1, word(i, b, 4 * j + 4));
                        }
                    }
                    let d = _mm512_cvtph_ps(_mm256_loadu_si256(blk.cast()));
                    for i in 0..N {
                        // Quants are stored + 128: Σ (q + 128)·x − 128·Σx, exactly.
                        let s = _mm512_sub_epi32(
                            _mm512_add_epi32(even[i], odd[i]),
                            _mm512_set1_epi32(128 * *xi[i].add(b)),
                        );
                        let scale = _mm512_mul_ps(d, _mm512_set1_ps(*xd[i].add(b)));
                        acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), scale, acc[i]);
                    }
                }
            }
            Kind::Q4K => {
                let bgb = groups::block_group_bytes(kind);
                for sb in 0..nb / 8 {
                    let blk = gw.as_ptr().add(sb * bgb);
                    if lead {
                        prefetch_ahead(blk, bgb);
                    }
                    let d = _mm512_cvtph_ps(_mm256_loadu_si256(blk.cast()));
                    let dmin = _mm512_cvtph_ps(_mm256_loadu_si256(blk.add(32).cast()));
                    // Sub-block j's scales and mins, one per row.
                    let sc = |j: usize| {
                        _mm512_cvtepu8_epi32(_mm_loadu_si128(blk.add(64 + 16 * j).cast()))
                    };
                    let mn = |j: usize| {
                        let m = _mm512_cvtepu8_epi32(_mm_loadu_si128(blk.add(192 + 16 * j).cast()));
                        _mm512_mul_ps(dmin, _mm512_cvtepi32_ps(m))
                    };
                    for p in 0..4 {
                        let (b0, b1) = (sb * 8 + 2 * p, sb * 8 + 2 * p + 1);
                        let mut lo = [_mm512_setzero_si512(); N];
                        let mut hi = [_mm512_setzero_si512(); N];
                        for w in 0..8 {
                            let v = _mm512_loadu_si512(blk.add(320 + 512 * p + 64 * w).cast());
                            let l = _mm512_and_si512(v, m4);
                            let h = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
                            for i in 0..N {
                                lo[i] = _mm512_dpbusd_epi32(lo[i], l, word(i, b0, 4 * w));
                                hi[i] = _mm512_dpbusd_epi32(hi[i], h, word(i, b1, 4 * w));
                            }
                        }
                        let (sc0, sc1, m0, m1) =
                            (sc(2 * p), sc(2 * p + 1), mn(2 * p), mn(2 * p + 1));
                        for i in 0..N {
                            // Σ q·x · scale is exact in i32 (|Σ| ≤ 32·15·127·63 < 2^31).
                            let s0 = _mm512_cvtepi32_ps(_mm512_mullo_epi32(lo[i], sc0));
                            let s1 = _mm512_cvtepi32_ps(_mm512_mullo_epi32(hi[i], sc1));
                            let d0 = _mm512_mul_ps(d, _mm512_set1_ps(*xd[i].add(b0)));
                            let d1 = _mm512_mul_ps(d, _mm512_set1_ps(*xd[i].add(b1)));
                            acc[i] = _mm512_fmadd_ps(s0, d0, acc[i]);
                            acc[i] = _mm512_fmadd_ps(s1, d1, acc[i]);
                            acc[i] = _mm512_fnmadd_ps(m0, _mm512_set1_ps(*xs[i].add(b0)), acc[i]);
                            acc[i] = _mm512_fnmadd_ps(m1, _mm512_set1_ps(*xs[i].add(b1)), acc[i]);
                        }
                    }
                }
            }
            Kind::Q6K => {
                let bgb = groups::block_group_bytes(kind);
                let m3 = _mm512_set1_epi8(0x03);
                let xi16: [*const i32; N] =
                    std::array::from_fn(|i| x.isum16.as_ptr().add((t0 + i) * 2 * nb));
                for sb in 0..nb / 8 {
                    let blk = gw.as_ptr().add(sb * bgb);
                    if lead {
                        prefetch_ahead(blk, bgb);
                    }
                    let d = _mm512_cvtph_ps(_mm256_loadu_si256(blk.cast()));
                    // Word `n` of the ql/qh planes (see `groups`).
                    let plane = |n: usize| _mm512_loadu_si512(blk.add(288 + 64 * n).cast());
                    for j in 0..8 {
                        let (h, kk, b) = (j / 4, j % 4, sb * 8 + j);
                        let high_shift = _mm_cvtsi32_si128(2 * kk as i32);
                        // Two sums, one per 16-value sub-block (each has its own scale).
                        let mut a0 = [_mm512_setzero_si512(); N];
                        let mut a1 = [_mm512_setzero_si512(); N];
                        for w in 0..8 {
                            let ql = plane(16 * h + 8 * (kk % 2) + w);
                            let nib = if kk < 2 {
                                _mm512_and_si512(ql, m4)
                            } else {
                                _mm512_and_si512(_mm512_srli_epi16(ql, 4), m4)
                            };
                            let qh = _mm512_srl_epi16(plane(32 + 8 * h + w), high_shift);
                            let top = _mm512_slli_epi16(_mm512_and_si512(qh, m3), 4);
                            let q = _mm512_or_si512(nib, top);
                            for i in 0..N {
                                let a = if w < 4 { &mut a0[i] } else { &mut a1[i] };
                                *a = _mm512_dpbusd_epi32(*a, q, word(i, b, 4 * w));
                            }
                        }
                        let sc = |s: usize| {
                            _mm512_cvtepi8_epi32(_mm_loadu_si128(blk.add(32 + 16 * s).cast()))
                        };
                        let (sc0, sc1) = (sc(2 * j), sc(2 * j + 1));
                        for i in 0..N {
                            // (q − 32)·x = q·x − 32·Σx per sub-block, exactly; scaled, the
                            // block's sum stays in i32 (|Σ| ≤ 2·16·63·127·128 < 2^31).
                            let s0 = _mm512_sub_epi32(
                                a0[i],
                                _mm512_set1_epi32(32 * *xi16[i].add(2 * b)),
                            );
                            let s1 = _mm512_sub_epi32(
                                a1[i],
                                _mm512_set1_epi32(32 * *xi16[i].add(2 * b + 1)),
                            );
                            let t = _mm512_add_epi32(
                                _mm512_mullo_epi32(s0, sc0),
                                _mm512_mullo_epi32(s1, sc1),
                            );
                            let scale = _mm512_mul_ps(d, _mm512_set1_ps(*xd[i].add(b)));
                            acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(t), scale, acc[i]);
                        }
                    }
                }
            }
            // `groups::supported` admits no other kind (the dispatcher asserts it).
            _ => {}
        }
        if x.n == 1 && rows == GROUP {
            _mm512_storeu_ps(out.as_mut_ptr().add(row0), acc[0]);
        } else {
            let mut lanes = [0f32; GROUP];
            for (i, a) in acc.iter().enumerate() {
                _mm512_storeu_ps(lanes.as_mut_ptr(), *a);
                for (r, v) in lanes.iter().enumerate().take(rows) {
                    out[(row0 + r) * x.n + t0 + i] = *v;
                }
            }
        }
    }
}

/// How far ahead of the block being multiplied the interleaved kernels ask for weight
/// bytes. Interleaved weights are one sequential stream per thread, but on its own a core
/// kept too few lines in flight: the SmolLM2 output head (Q8_0, 30 MB) streamed at 7 GB/s
/// on one AMD EPYC core and at 13 GB/s with 4 KiB of software prefetch (2–8 KiB measured
/// alike; `examples/quant_bench.rs`, 4.2 → 2.3 ms).
const PREFETCH_AHEAD: usize = 4096;

/// [`HalfPrefetch`]'s closest lead. Cold weights streamed fastest at 8 KiB (medians of five
/// alternating `examples/cold_bench.rs` runs at 4, 8, 12 and 16 KiB; 4 KiB was 5–20 %
/// slower on the Q4_K and Q6_K shapes, 12 and 16 KiB no faster).
const HALF_STREAM_AHEAD: usize = 8192;

/// Asks for the cache lines [`PREFETCH_AHEAD`] bytes past the `bytes` bytes at `p`, so
/// that each block brings in as many bytes as it consumes.
#[inline(always)]
unsafe fn prefetch_ahead(p: *const u8, bytes: usize) {
    // SAFETY: as for `prefetch_lines`.
    unsafe { prefetch_lines(p.wrapping_add(PREFETCH_AHEAD), bytes) }
}

/// Asks for the cache lines of the `bytes` bytes at `p`.
#[inline(always)]
unsafe fn prefetch_lines(p: *const u8, bytes: usize) {
    for off in (0..bytes).step_by(64) {
        // SAFETY: a prefetch never faults (past the end of the weights it is a no-op
        // hint), and `wrapping_add` makes no claim about the allocation.
        unsafe { _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(off).cast()) };
    }
}

/// The AVX2 kernels' weight prefetch. A group is read by two half passes: the first
/// touches every line of the group (each 64-byte plane holds both halves' rows), the
/// second re-reads them from cache. Prefetching in the first pass alone left the memory
/// idle through the second; here each pass asks for half of the group's bytes as it
/// consumes its half of the compute, at a stream position that runs [`HALF_STREAM_AHEAD`]
/// bytes ahead of the first pass's reads at its closest: a pass at offset `o` of group `g`
/// (`G` bytes) asks for `g·G + HALF_STREAM_AHEAD + (1 + half)·G/2 + o/2`. Cold weights
/// then stream 15–30 % faster (the Kimi 0.5B Q6_K output head 1.93 → 1.39 ms, Q4_K
/// `[3336, 1024]` 103 → 88 µs, on two EPYC cores).
/// The AVX2 Q4_K and Q6_K loops ask a few lines at a time as they consume them: one burst
/// per 2.3–3.4 KiB super-block group (37–53 lines, more than a Zen 3 core keeps in flight)
/// streamed cold weights 10–25 % slower (`examples/cold_bench.rs`).
struct HalfPrefetch {
    group: *const u8,
    ahead: usize,
    on: bool,
}

impl HalfPrefetch {
    fn new(gw: &[u8], half: usize, on: bool) -> HalfPrefetch {
        HalfPrefetch {
            group: gw.as_ptr(),
            ahead: HALF_STREAM_AHEAD + (1 + half) * gw.len() / 2,
            on,
        }
    }

    /// The pass is about to consume the `bytes` bytes at offset `at` of the group.
    #[inline(always)]
    fn consume(&self, at: usize, bytes: usize) {
        if self.on {
            let p = self.group.wrapping_add(self.ahead + at / 2);
            // SAFETY: prefetches never fault (see `prefetch_lines`).
            unsafe { prefetch_lines(p, bytes.div_ceil(2)) }
        }
    }
}

/// Rows `8·half..8·half + 8` of the group `gw` (rows `row0..row0 + rows`) · tokens
/// `t0..t0 + N`, on AVX2: [`group`]'s arithmetic on the half's 32 bytes of each 64-byte
/// word plane. `vpmaddubsw` pair sums are 16-bit, so nibble products add up in 16 bits
/// (at most eight sums of `2·15·127`) before one `vpmaddwd` widens them, by ones or by the
/// block's integer scales; Q8_0 quants (stored `q + 128`) are flipped back and multiplied
/// by sign (`|q| · x·sign(q)`), which no pair sum can saturate.
///
/// # Safety
/// AVX2, FMA and F16C from the caller; otherwise as [`group`], and `8·half < rows`.
#[inline(always)]
unsafe fn half_group<const N: usize>(
    kind: Kind,
    gw: &[u8],
    x: &Q8Acts,
    t0: usize,
    (row0, rows): (usize, usize),
    half: usize,
    out: &mut [f32],
) {
    const HALF: usize = GROUP / 2;
    let nb = x.blocks();
    let bb16 = GROUP * kind.block_bytes();
    let sb = groups::scale_bytes(kind);
    // SAFETY (every pointer below): as in `group`; a half's bytes lie inside its block.
    unsafe {
        let qs: [*const u8; N] = std::array::from_fn(|i| x.qs.as_ptr().add((t0 + i) * x.k).cast());
        let xd: [*const f32; N] = std::array::from_fn(|i| x.d.as_ptr().add((t0 + i) * nb));
        let xs: [*const f32; N] = std::array::from_fn(|i| x.sum.as_ptr().add((t0 + i) * nb));
        let xi: [*const i32; N] = std::array::from_fn(|i| x.isum.as_ptr().add((t0 + i) * nb));
        let word = |i: usize, b: usize, v: usize| {
            _mm256_set1_epi32(std::ptr::read_unaligned(
                qs[i].add(b * QK + v).cast::<i32>(),
            ))
        };
        // The half's 8 rows of a 64-byte word plane, of 16 f16 values, of 16 bytes.
        let plane = |p: *const u8| _mm256_loadu_si256(p.add(32 * half).cast());
        let f16s = |p: *const u8| _mm256_cvtph_ps(_mm_loadu_si128(p.add(16 * half).cast()));
        let u8s = |p: *const u8| _mm256_cvtepu8_epi32(_mm_loadl_epi64(p.add(8 * half).cast()));
        let i8s = |p: *const u8| _mm256_cvtepi8_epi32(_mm_loadl_epi64(p.add(8 * half).cast()));
        // An i32 lane's value (within i16) in both of its i16 halves, for `vpmaddwd`.
        let both16 = |v: __m256i| {
            _mm256_or_si256(
                _mm256_and_si256(v, _mm256_set1_epi32(0xFFFF)),
                _mm256_slli_epi32(v, 16),
            )
        };
        let ones = _mm256_set1_epi16(1);
        let m4 = _mm256_set1_epi8(0x0F);
        let fetch = HalfPrefetch::new(gw, half, t0 == 0);
        // Two sums per token (joined at the end): one FMA chain per token made the latency
        // of its FMAs (two to four per block) the bound of a one-token pass.
        let mut acc = [_mm256_setzero_ps(); N];
        let mut acc2 = [_mm256_setzero_ps(); N];
        match kind {
            Kind::Q4_0 | Kind::Q4_1 => {
                let q4_1 = kind == Kind::Q4_1;
                for b in 0..nb {
                    let blk = gw.as_ptr().add(b * bb16);
                    fetch.consume(b * bb16, bb16);
                    let mut s16 = [_mm256_setzero_si256(); N];
                    for j in 0..4 {
                        let v = plane(blk.add(sb + 64 * j));
                        let l = _mm256_and_si256(v, m4);
                        let h = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
                        for (i, s) in s16.iter_mut().enumerate() {
                            let pl = _mm256_maddubs_epi16(l, word(i, b, 4 * j));
                            let ph = _mm256_maddubs_epi16(h, word(i, b, 16 + 4 * j));
                            *s = _mm256_add_epi16(*s, _mm256_add_epi16(pl, ph));
                        }
                    }
                    let d = f16s(blk);
                    let m = if q4_1 {
                        f16s(blk.add(32))
                    } else {
                        _mm256_setzero_ps()
                    };
                    for i in 0..N {
                        let mut s = _mm256_madd_epi16(s16[i], ones);
                        if !q4_1 {
                            // Nibbles are stored + 8: Σ (q + 8)·x − 8·Σx, exactly.
                            s = _mm256_sub_epi32(s, _mm256_set1_epi32(8 * *xi[i].add(b)));
                        }
                        let scale = _mm256_mul_ps(d, _mm256_set1_ps(*xd[i].add(b)));
                        let (a, a2) = if b % 2 == 0 || q4_1 {
                            (&mut acc[i], &mut acc2[i])
                        } else {
                            (&mut acc2[i], &mut acc[i])
                        };
                        *a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), scale, *a);
                        if q4_1 {
                            *a2 = _mm256_fmadd_ps(m, _mm256_set1_ps(*xs[i].add(b)), *a2);
                        }
                    }
                }
            }
            Kind::Q8_0 => {
                let flip = _mm256_set1_epi8(-128);
                for b in 0..nb {
                    let blk = gw.as_ptr().add(b * bb16);
                    fetch.consume(b * bb16, bb16);
                    let mut s = [_mm256_setzero_si256(); N];
                    for j in 0..8 {
                        let q = _mm256_xor_si256(plane(blk.add(sb + 64 * j)), flip);
                        let magnitude = _mm256_sign_epi8(q, q);
                        for (i, si) in s.iter_mut().enumerate() {
                            let signed = _mm256_sign_epi8(word(i, b, 4 * j), q);
                            let p = _mm256_maddubs_epi16(magnitude, signed);
                            *si = _mm256_add_epi32(*si, _mm256_madd_epi16(p, ones));
                        }
                    }
                    let d = f16s(blk);
                    for i in 0..N {
                        let scale = _mm256_mul_ps(d, _mm256_set1_ps(*xd[i].add(b)));
                        let a = if b % 2 == 0 {
                            &mut acc[i]
                        } else {
                            &mut acc2[i]
                        };
                        *a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[i]), scale, *a);
                    }
                }
            }
            Kind::Q4K => {
                let bgb = groups::block_group_bytes(kind);
                for sb in 0..nb / 8 {
                    let blk = gw.as_ptr().add(sb * bgb);
                    fetch.consume(sb * bgb, 320);
                    let d = f16s(blk);
                    let dmin = f16s(blk.add(32));
                    for p in 0..4 {
                        fetch.consume(sb * bgb + 320 + 512 * p, 512);
                        let (b0, b1) = (sb * 8 + 2 * p, sb * 8 + 2 * p + 1);
                        let mut lo = [_mm256_setzero_si256(); N];
                        let mut hi = [_mm256_setzero_si256(); N];
                        for w in 0..8 {
                            let v = plane(blk.add(320 + 512 * p + 64 * w));
                            let l = _mm256_and_si256(v, m4);
                            let h = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
                            for i in 0..N {
                                let pl = _mm256_maddubs_epi16(l, word(i, b0, 4 * w));
                                let ph = _mm256_maddubs_epi16(h, word(i, b1, 4 * w));
                                lo[i] = _mm256_add_epi16(lo[i], pl);
                                hi[i] = _mm256_add_epi16(hi[i], ph);
                            }
                        }
                        let sc0 = both16(u8s(blk.add(64 + 32 * p)));
                        let sc1 = both16(u8s(blk.add(64 + 32 * p + 16)));
                        let m0 =
                            _mm256_mul_ps(dmin, _mm256_cvtepi32_ps(u8s(blk.add(192 + 32 * p))));
                        let m1 = _mm256_mul_ps(
                            dmin,
                            _mm256_cvtepi32_ps(u8s(blk.add(192 + 32 * p + 16))),
                        );
                        for i in 0..N {
                            // The 16-bit sums times the 6-bit scales, added in i32: exact.
                            let s0 = _mm256_cvtepi32_ps(_mm256_madd_epi16(lo[i], sc0));
                            let s1 = _mm256_cvtepi32_ps(_mm256_madd_epi16(hi[i], sc1));
                            let d0 = _mm256_mul_ps(d, _mm256_set1_ps(*xd[i].add(b0)));
                            let d1 = _mm256_mul_ps(d, _mm256_set1_ps(*xd[i].add(b1)));
                            acc[i] = _mm256_fmadd_ps(s0, d0, acc[i]);
                            acc2[i] = _mm256_fmadd_ps(s1, d1, acc2[i]);
                            acc[i] = _mm256_fnmadd_ps(m0, _mm256_set1_ps(*xs[i].add(b0)), acc[i]);
                            acc2[i] = _mm256_fnmadd_ps(m1, _mm256_set1_ps(*xs[i].add(b1)), acc2[i]);
                        }
                    }
                }
            }
            Kind::Q6K => {
                let bgb = groups::block_group_bytes(kind);
                let xi16: [*const i32; N] =
                    std::array::from_fn(|i| x.isum16.as_ptr().add((t0 + i) * 2 * nb));
                let m30 = _mm256_set1_epi8(0x30);
                for sb in 0..nb / 8 {
                    let blk = gw.as_ptr().add(sb * bgb);
                    fetch.consume(sb * bgb, 288);
                    let d = f16s(blk);
                    let plane_n = |n: usize| plane(blk.add(288 + 64 * n));
                    // Each 128-value half `h` of the super-block is chunks j = 4h + kk,
                    // kk = 0..4, whose word w shares two ql planes and one qh plane: the
                    // four chunks' levels come from three loads and constant shifts.
                    for h in 0..2 {
                        // Chunk kk's sub-block scales (16-value sub-blocks 2j and 2j + 1),
                        // as i32 lanes and in both i16 halves for `vpmaddwd`.
                        // (Plain loops: through `array::from_fn` or `map` the intrinsics
                        // would compile without this function's features.)
                        let mut sc = [[_mm256_setzero_si256(); 2]; 4];
                        let mut sc16 = sc;
                        for kk in 0..4 {
                            for sub in 0..2 {
                                sc[kk][sub] = i8s(blk.add(32 + 32 * (4 * h + kk) + 16 * sub));
                                sc16[kk][sub] = both16(sc[kk][sub]);
                            }
                        }
                        let mut s = [[_mm256_setzero_si256(); 4]; N];
                        for w in 0..8 {
                            for n in [16 * h + w, 16 * h + 8 + w, 32 + 8 * h + w] {
                                fetch.consume(sb * bgb + 288 + 64 * n, 64);
                            }
                            let (ql_a, ql_b) = (plane_n(16 * h + w), plane_n(16 * h + 8 + w));
                            let qh = plane_n(32 + 8 * h + w);
                            let levels = [
                                _mm256_or_si256(
                                    _mm256_and_si256(ql_a, m4),
                                    _mm256_and_si256(_mm256_slli_epi16(qh, 4), m30),
                                ),
                                _mm256_or_si256(
                                    _mm256_and_si256(ql_b, m4),
                                    _mm256_and_si256(_mm256_slli_epi16(qh, 2), m30),
                                ),
                                _mm256_or_si256(
                                    _mm256_and_si256(_mm256_srli_epi16(ql_a, 4), m4),
                                    _mm256_and_si256(qh, m30),
                                ),
                                _mm256_or_si256(
                                    _mm256_and_si256(_mm256_srli_epi16(ql_b, 4), m4),
                                    _mm256_and_si256(_mm256_srli_epi16(qh, 2), m30),
                                ),
                            ];
                            for (kk, q) in levels.iter().enumerate() {
                                let b = sb * 8 + 4 * h + kk;
                                for (i, si) in s.iter_mut().enumerate() {
                                    // Pair sums of at most 2·63·127, times the sub-block's
                                    // scale, in i32.
                                    let p = _mm256_maddubs_epi16(*q, word(i, b, 4 * w));
                                    let t = _mm256_madd_epi16(p, sc16[kk][w / 4]);
                                    si[kk] = _mm256_add_epi32(si[kk], t);
                                }
                            }
                        }
                        for kk in 0..4 {
                            let b = sb * 8 + 4 * h + kk;
                            for i in 0..N {
                                // (q − 32)·x·scale = q·x·scale − 32·Σx·scale per sub-block.
                                let offset = _mm256_add_epi32(
                                    _mm256_mullo_epi32(
                                        sc[kk][0],
                                        _mm256_set1_epi32(32 * *xi16[i].add(2 * b)),
                                    ),
                                    _mm256_mullo_epi32(
                                        sc[kk][1],
                                        _mm256_set1_epi32(32 * *xi16[i].add(2 * b + 1)),
                                    ),
                                );
                                let t = _mm256_sub_epi32(s[i][kk], offset);
                                let scale = _mm256_mul_ps(d, _mm256_set1_ps(*xd[i].add(b)));
                                let a = if kk % 2 == 0 {
                                    &mut acc[i]
                                } else {
                                    &mut acc2[i]
                                };
                                *a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(t), scale, *a);
                            }
                        }
                    }
                }
            }
            // `groups::supported` admits no other kind (the dispatcher asserts it).
            _ => {}
        }
        for i in 0..N {
            acc[i] = _mm256_add_ps(acc[i], acc2[i]);
        }
        let first = row0 + HALF * half;
        let valid = (rows - HALF * half).min(HALF);
        if x.n == 1 && valid == HALF {
            _mm256_storeu_ps(out.as_mut_ptr().add(first), acc[0]);
        } else {
            let mut lanes = [0f32; HALF];
            for (i, a) in acc.iter().enumerate() {
                _mm256_storeu_ps(lanes.as_mut_ptr(), *a);
                for (r, v) in lanes.iter().enumerate().take(valid) {
                    out[(first + r) * x.n + t0 + i] = *v;
                }
            }
        }
    }
}
