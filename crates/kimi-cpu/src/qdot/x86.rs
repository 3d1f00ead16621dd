//! x86_64 kernels: one body over 256-bit vectors, instantiated with two dot-product units,
//! AVX2 (`vpmaddubsw` + `vpmaddwd`) and AVX-512 VNNI (`vpdpbusd`, EVEX on 256 bits).
//!
//! Work goes in tiles of `R` weight rows by `N` tokens: each weight block is expanded once
//! per tile and each activation block loaded once per tile, and the `R·N` accumulators are
//! independent, so the per-block latency chains (scale conversion, integer dot, FMA) of one
//! row overlap with those of the others. A row at a time leaves the core waiting on them.
//!
//! The bodies are `#[inline(always)]` generic functions so that they inline into the
//! `#[target_feature]` entry points and compile with those features. The kernels of
//! interleaved weights (`super::groups`) are in [`interleaved`].

mod interleaved;

use std::arch::x86_64::*;

pub(super) use interleaved::{matmul_groups_avx2, matmul_groups_vnni};

use super::{mxfp4_half_scale, q4k_scale_min, Kind, Q8Acts, MXFP4_BIAS, MXFP4_DOUBLED, QK};

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

/// [`MXFP4_DOUBLED`] `+ MXFP4_BIAS` in both 128-bit lanes: the `vpshufb` table that turns
/// E2M1 codes into unsigned dot operands.
#[inline(always)]
pub(super) unsafe fn mxfp4_table() -> __m256i {
    let biased: [i8; 16] = std::array::from_fn(|c| MXFP4_DOUBLED[c] + MXFP4_BIAS);
    // SAFETY: AVX2 (caller); the load reads the 16 bytes of a local array.
    unsafe { _mm256_broadcastsi128_si256(_mm_loadu_si128(biased.as_ptr().cast())) }
}

/// `2^(e - 128)` per i32 lane `e` (0..=254), the bits [`mxfp4_half_scale`] gives: the
/// exponent field `e - 1`, or for `e` 0 and 1 the subnormal bit 21 + `e`.
#[inline(always)]
pub(super) unsafe fn mxfp4_half_scales(e: __m256i) -> __m256 {
    // SAFETY: AVX2 (caller); register-only operations.
    unsafe {
        let normal = _mm256_slli_epi32::<23>(_mm256_sub_epi32(e, _mm256_set1_epi32(1)));
        let tiny = _mm256_sllv_epi32(_mm256_set1_epi32(0x0020_0000), e);
        let is_normal = _mm256_cmpgt_epi32(e, _mm256_set1_epi32(1));
        _mm256_castsi256_ps(_mm256_blendv_epi8(tiny, normal, is_normal))
    }
}

/// MXFP4 blocks of a tile: each row's nibbles through [`mxfp4_table`] once, then one
/// integer dot per token, less `12·Σx` (a vector per token, shared by the rows), scaled
/// by half the E8M0 scale times the activation scale.
///
/// # Safety
/// As [`tile`], whose pointers `t` holds.
#[inline(always)]
unsafe fn mxfp4_blocks<D: I8Dot, const R: usize, const N: usize>(
    t: &TilePtrs<R, N>,
    xi: &[*const i32; N],
    nb: usize,
    acc: &mut [[__m256; N]; R],
) {
    let TilePtrs { rp, qs, xd, .. } = t;
    // SAFETY: as in `tile`: every pointer offset stays inside its row, token or block (the
    // 16 code bytes of a block follow its scale byte).
    unsafe {
        let table = mxfp4_table();
        let m4 = _mm256_set1_epi8(0x0F);
        for b in 0..nb {
            let xv: [__m256i; N] =
                std::array::from_fn(|i| _mm256_loadu_si256(qs[i].add(b * QK).cast()));
            let xdb: [f32; N] = std::array::from_fn(|i| *xd[i].add(b));
            // The bias's share in one lane: the lanes are summed at the end.
            let bias: [__m256i; N] = std::array::from_fn(|i| {
                let v = i32::from(MXFP4_BIAS) * *xi[i].add(b);
                _mm256_setr_epi32(v, 0, 0, 0, 0, 0, 0, 0)
            });
            for j in 0..R {
                let blk = rp[j].add(b * 17);
                let dw = mxfp4_half_scale(*blk);
                let nib = _mm_loadu_si128(blk.add(1).cast());
                let codes = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(nib, 4), nib), m4);
                let wv = _mm256_shuffle_epi8(table, codes);
                for i in 0..N {
                    let p = _mm256_cvtepi32_ps(_mm256_sub_epi32(D::dot(wv, xv[i]), bias[i]));
                    acc[j][i] = _mm256_fmadd_ps(_mm256_set1_ps(dw * xdb[i]), p, acc[j][i]);
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
    // and `x.sum` or `x.sum_f16` (checked to be as long); block `b < nb` of a row lies inside that row (a whole row of `nb`
    // 32-value blocks, or `nb / 8` super-blocks), and every load below stays within its
    // block (the f16 pair loads read four bytes of a block of at least 18; Q6_K's ends at
    // the block's last byte).
    let rp: [*const u8; R] = std::array::from_fn(|j| unsafe { w.as_ptr().add((r0 + j) * rb) });
    let qs: [*const i8; N] = std::array::from_fn(|i| unsafe { x.qs.as_ptr().add((t0 + i) * x.k) });
    let xd: [*const f32; N] = std::array::from_fn(|i| unsafe { x.d.as_ptr().add((t0 + i) * nb) });
    // Block sums: ggml's f16 Q8_1 sum for Q4_1's min, d·Σq for the other offsets.
    let sums = if kind == Kind::Q4_1 {
        &x.sum_f16
    } else {
        &x.sum
    };
    let xs: [*const f32; N] = std::array::from_fn(|i| unsafe { sums.as_ptr().add((t0 + i) * nb) });
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
            Kind::Mxfp4 => {
                let xi: [*const i32; N] =
                    std::array::from_fn(|i| x.isum.as_ptr().add((t0 + i) * nb));
                let ptrs = TilePtrs { rp, qs, xd, xs };
                mxfp4_blocks::<D, R, N>(&ptrs, &xi, nb, &mut acc);
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
