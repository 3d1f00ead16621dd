//! x86_64 kernels of weights interleaved in groups of 16 rows (`qdot::groups`): AVX-512
//! VNNI on a whole group per pass, AVX2 on its two 8-row halves.

use std::arch::x86_64::*;

use super::super::groups::{self, GROUP};
use super::super::{Kind, Q8Acts, MXFP4_BIAS, MXFP4_DOUBLED, QK};
use super::{mxfp4_half_scales, mxfp4_table, Maddubs, Vnni};

/// Interleaved weights (`super::groups`), every group of 16 rows and every token, up to
/// four tokens per pass over a group's blocks.
///
/// # Safety
/// The CPU must support AVX2, FMA, F16C and AVX-512 F/BW/VL/VNNI; sizes as checked by
/// `groups::matmul_groups_with`.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub(in crate::qdot) unsafe fn matmul_groups_vnni(
    kind: Kind,
    w: &[u8],
    x: &Q8Acts,
    out: &mut [f32],
) {
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
pub(in crate::qdot) unsafe fn matmul_groups_avx2(
    kind: Kind,
    w: &[u8],
    x: &Q8Acts,
    out: &mut [f32],
) {
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
        // Block sums: ggml's f16 Q8_1 sum for Q4_1's min, d·Σq for the K types' mins (one
        // array either way: the loops keep every pointer in a register).
        let sums = if kind == Kind::Q4_1 {
            &x.sum_f16
        } else {
            &x.sum
        };
        let xs: [*const f32; N] = std::array::from_fn(|i| sums.as_ptr().add((t0 + i) * nb));
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
            Kind::Mxfp4 => {
                let biased: [i8; 16] = std::array::from_fn(|c| MXFP4_DOUBLED[c] + MXFP4_BIAS);
                let table = _mm512_broadcast_i32x4(_mm_loadu_si128(biased.as_ptr().cast()));
                for b in 0..nb {
                    let blk = gw.as_ptr().add(b * bb16);
                    if lead {
                        prefetch_ahead(blk, bb16);
                    }
                    let mut lo = [_mm512_setzero_si512(); N];
                    let mut hi = [_mm512_setzero_si512(); N];
                    for j in 0..4 {
                        let v = _mm512_loadu_si512(blk.add(sb + 64 * j).cast());
                        // `vpshufb` indexes by the low four bits within each 128-bit lane.
                        let l = _mm512_shuffle_epi8(table, _mm512_and_si512(v, m4));
                        let h = _mm512_shuffle_epi8(
                            table,
                            _mm512_and_si512(_mm512_srli_epi16(v, 4), m4),
                        );
                        for i in 0..N {
                            lo[i] = _mm512_dpbusd_epi32(lo[i], l, word(i, b, 4 * j));
                            hi[i] = _mm512_dpbusd_epi32(hi[i], h, word(i, b, 16 + 4 * j));
                        }
                    }
                    let d =
                        mxfp4_half_scales_512(_mm512_cvtepu8_epi32(_mm_loadu_si128(blk.cast())));
                    for i in 0..N {
                        // Codes are looked up + 12: Σ (w + 12)·x − 12·Σx, exactly.
                        let bias = i32::from(MXFP4_BIAS) * *xi[i].add(b);
                        let s = _mm512_sub_epi32(
                            _mm512_add_epi32(lo[i], hi[i]),
                            _mm512_set1_epi32(bias),
                        );
                        let scale = _mm512_mul_ps(d, _mm512_set1_ps(*xd[i].add(b)));
                        acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), scale, acc[i]);
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

/// [`mxfp4_half_scales`] on 16 lanes.
#[inline(always)]
unsafe fn mxfp4_half_scales_512(e: __m512i) -> __m512 {
    // SAFETY: AVX-512F (caller); register-only operations.
    unsafe {
        let normal = _mm512_slli_epi32::<23>(_mm512_sub_epi32(e, _mm512_set1_epi32(1)));
        let tiny = _mm512_sllv_epi32(_mm512_set1_epi32(0x0020_0000), e);
        let is_normal = _mm512_cmpgt_epi32_mask(e, _mm512_set1_epi32(1));
        _mm512_castsi512_ps(_mm512_mask_blend_epi32(is_normal, tiny, normal))
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
        // Block sums: ggml's f16 Q8_1 sum for Q4_1's min, d·Σq for the K types' mins (one
        // array either way: the loops keep every pointer in a register).
        let sums = if kind == Kind::Q4_1 {
            &x.sum_f16
        } else {
            &x.sum
        };
        let xs: [*const f32; N] = std::array::from_fn(|i| sums.as_ptr().add((t0 + i) * nb));
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
            Kind::Mxfp4 => {
                let table = mxfp4_table();
                for b in 0..nb {
                    let blk = gw.as_ptr().add(b * bb16);
                    fetch.consume(b * bb16, bb16);
                    // `vpmaddubsw` pair sums of (w + 12)·x reach 2·24·127: four of them
                    // (two word planes) fit in 16 bits, then widen.
                    let mut s = [_mm256_setzero_si256(); N];
                    for jj in 0..2 {
                        let mut s16 = [_mm256_setzero_si256(); N];
                        for j in 2 * jj..2 * jj + 2 {
                            let v = plane(blk.add(sb + 64 * j));
                            let l = _mm256_shuffle_epi8(table, _mm256_and_si256(v, m4));
                            let h = _mm256_shuffle_epi8(
                                table,
                                _mm256_and_si256(_mm256_srli_epi16(v, 4), m4),
                            );
                            for (i, t) in s16.iter_mut().enumerate() {
                                let pl = _mm256_maddubs_epi16(l, word(i, b, 4 * j));
                                let ph = _mm256_maddubs_epi16(h, word(i, b, 16 + 4 * j));
                                *t = _mm256_add_epi16(*t, _mm256_add_epi16(pl, ph));
                            }
                        }
                        for (si, t) in s.iter_mut().zip(&s16) {
                            *si = _mm256_add_epi32(*si, _mm256_madd_epi16(*t, ones));
                        }
                    }
                    let d = mxfp4_half_scales(u8s(blk));
                    for i in 0..N {
                        // Codes are looked up + 12: Σ (w + 12)·x − 12·Σx, exactly.
                        let bias = i32::from(MXFP4_BIAS) * *xi[i].add(b);
                        let t = _mm256_sub_epi32(s[i], _mm256_set1_epi32(bias));
                        let scale = _mm256_mul_ps(d, _mm256_set1_ps(*xd[i].add(b)));
                        let a = if b % 2 == 0 {
                            &mut acc[i]
                        } else {
                            &mut acc2[i]
                        };
                        *a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(t), scale, *a);
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
