//! Integer matrix-vector kernels for block-quantized weights.
//!
//! The activation rows of a matmul are quantized once to int8 blocks of 32 values
//! ([`Q8Acts`], ggml's Q8_0/Q8_1 as llama.cpp's x86 build makes them: the block scale
//! rounded to f16, and Q8_1's scaled sum rounded to f16 for Q4_1's min term); every weight
//! block is then dotted with them in integer arithmetic, straight from its packed bytes,
//! and only the per-block result is scaled in f32. Decode (a few tokens) reads each weight
//! block once for all tokens and never writes dequantized weights.
//!
//! The result differs from the f32 product with dequantized weights by the rounding of the
//! activations (at most half a step plus the f16 rounding of the scale, per value); the
//! tests check that bound.
//!
//! Variants, chosen once at run time ([`Isa::best`]): portable scalar code (the reference
//! for the others), AVX2 (`maddubs`/`madd`), AVX-512 VNNI (`vpdpbusd`) and NEON
//! (aarch64). Integer parts agree bit for bit across variants; only the order of the f32
//! sums of per-block results differs.
//!
//! MXFP4 (OCP microscaling FP4, Kimi K3's routed experts) fits the same scheme: twice an
//! E2M1 value is a whole number in `-12..=12` ([`MXFP4_DOUBLED`], found by a 16-byte table
//! lookup per nibble), so a block's dot is the integer dot of the doubled codes with the
//! int8 activations, times half the E8M0 scale ([`mxfp4_half_scale`]) and the activation
//! scale. Only the activations are rounded, as for the ggml types.

pub(crate) mod groups;
#[cfg(target_arch = "aarch64")]
mod neon;
#[cfg(target_arch = "x86_64")]
mod x86;

use std::sync::OnceLock;

use kimi_core::DType;

/// Values per activation block.
pub(crate) const QK: usize = 32;

/// 1.5·2^23: `(y + ROUNDER) - ROUNDER` is `y` rounded to nearest, ties to even, for
/// |y| < 2^22.
const ROUNDER: f32 = 12_582_912.0;

/// Weight block types with integer kernels.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Kind {
    /// `d:f16 | qs[16]`, `(nibble - 8) * d`.
    Q4_0,
    /// `d:f16 m:f16 | qs[16]`, `nibble * d + m`.
    Q4_1,
    /// `d:f16 | qh:u32 | qs[16]`, `((nibble | bit_j(qh) << 4) - 16) * d`.
    Q5_0,
    /// `d:f16 | qs:i8[32]`, `q * d`.
    Q8_0,
    /// 256-value super-blocks: `d:f16 dmin:f16 | scales[12] | qs[128]`,
    /// `d * sc_j * nibble - dmin * m_j` for sub-block `j` of 32.
    Q4K,
    /// Q4_K with a fifth bit per value: `d:f16 dmin:f16 | scales[12] | qh[32] | qs[128]`,
    /// `d * sc_j * (nibble | bit_j(qh[l]) << 4) - dmin * m_j` for value `l` of sub-block `j`.
    Q5K,
    /// 256-value super-blocks of 16 sub-blocks of 16: `ql[128] | qh[64] | scales:i8[16] |
    /// d:f16`, `d * scales[s] * (q - 32)` with 6-bit `q` (see [`q6k_level`]).
    Q6K,
    /// MXFP4 as ggml's `block_mxfp4`: `e:u8 | qs[16]`, `E2M1(nibble) * 2^(e - 127)`, the
    /// nibbles placed as Q4_0's.
    Mxfp4,
}

impl Kind {
    /// The kernel kind of a weight dtype, if it has one.
    pub(crate) fn of(dtype: DType) -> Option<Kind> {
        Some(match dtype {
            DType::Q4_0 => Kind::Q4_0,
            DType::Q4_1 => Kind::Q4_1,
            DType::Q5_0 => Kind::Q5_0,
            DType::Q8_0 => Kind::Q8_0,
            DType::Q4_K => Kind::Q4K,
            DType::Q5_K => Kind::Q5K,
            DType::Q6_K => Kind::Q6K,
            DType::MXFP4 => Kind::Mxfp4,
            _ => return None,
        })
    }

    /// Values per weight block.
    pub(crate) fn block_values(self) -> usize {
        match self {
            Kind::Q4K | Kind::Q5K | Kind::Q6K => 256,
            Kind::Q4_0 | Kind::Q4_1 | Kind::Q5_0 | Kind::Q8_0 | Kind::Mxfp4 => QK,
        }
    }

    /// Bytes per weight block.
    pub(crate) fn block_bytes(self) -> usize {
        match self {
            Kind::Q4_0 => 18,
            Kind::Q4_1 => 20,
            Kind::Q5_0 => 22,
            Kind::Q8_0 => 34,
            Kind::Q4K => 144,
            Kind::Q5K => 176,
            Kind::Q6K => 210,
            Kind::Mxfp4 => 17,
        }
    }

    /// Bytes of one weight row of `k` values (`k` a whole number of blocks).
    pub(crate) fn row_bytes(self, k: usize) -> usize {
        k / self.block_values() * self.block_bytes()
    }
}

/// Activation rows `[n, k]` quantized to int8 blocks of [`QK`]: value ≈ `q * d`.
/// `sum = d * Σq` per block lets a weight's constant term (Q4_0's −8, Q5_0's −16, Q4_1's
/// min, Q4_K's and Q5_K's mins) be applied once per block instead of once per value.
#[derive(Clone, Debug, Default)]
pub(crate) struct Q8Acts {
    /// Tokens.
    pub n: usize,
    /// Values per token, a multiple of [`QK`].
    pub k: usize,
    /// `[n, k]`, each in `-127..=127`.
    pub qs: Vec<i8>,
    /// `[n, k / QK]` block scales (f16 values, as ggml stores them).
    pub d: Vec<f32>,
    /// `[n, k / QK]` block sums `d * Σq` (Q4_0's, Q5_0's and the K types' offsets: ggml
    /// applies those in integers, which this equals to f32 rounding).
    pub sum: Vec<f32>,
    /// `[n, k / QK]` ggml's Q8_1 sum: the unrounded scale times `Σq`, rounded to f16
    /// (Q4_1's min term, as ggml's `vec_dot_q4_1_q8_1` reads `block_q8_1::s`).
    pub sum_f16: Vec<f32>,
    /// `[n, k / QK]` integer block sums `Σq`, for offsets applied before scaling
    /// (the interleaved kernels of [`groups`]).
    pub isum: Vec<i32>,
    /// `[n, k / 16]` integer sums of each half block (Q6_K's 16-value sub-blocks).
    pub isum16: Vec<i32>,
}

impl Q8Acts {
    /// Quantizes `xs [n, k]` as ggml's x86 `quantize_row_q8_1` does (AVX2 branch; its
    /// `quantize_row_q8_0` makes the same scales and quants): per block, with `m = max|x|`,
    /// `d = m / 127`, `q = round(x · (127 / m))` (ties to even, as `_mm256_round_ps`),
    /// stored scale `f16(d)` and Q8_1 sum `f16(d · Σq)`. Non-finite inputs give
    /// unspecified (but memory-safe) results.
    pub(crate) fn quantize(xs: &[f32], n: usize, k: usize) -> Self {
        debug_assert!(k.is_multiple_of(QK) && xs.len() == n * k);
        let nb = k / QK;
        let mut a = Q8Acts {
            n,
            k,
            qs: vec![0; n * k],
            d: vec![0.0; n * nb],
            sum: vec![0.0; n * nb],
            sum_f16: vec![0.0; n * nb],
            isum: vec![0; n * nb],
            isum16: vec![0; 2 * n * nb],
        };
        for (b, (x, q)) in xs
            .chunks_exact(QK)
            .zip(a.qs.chunks_exact_mut(QK))
            .enumerate()
        {
            let amax = block_amax(x);
            let d = amax / 127.0;
            // 127 / m, not 1 / d: the two differ in the last bit for some m, which moves
            // the quants of values near a half step.
            let id = if amax > 0.0 { 127.0 / amax } else { 0.0 };
            let mut s = 0i32;
            for (q, v) in q.iter_mut().zip(x) {
                // Adding 1.5·2^23 rounds to nearest even (|v·id| ≤ 127), as
                // `round_ties_even` does, and leaves the integer in the low bits: read as
                // an integer, this is `((y + ROUNDER) - ROUNDER).clamp(-127.0, 127.0) as i8`
                // (NaN to 0, ±∞ to ±127) without a float-to-int conversion, which keeps the
                // loop in vector registers.
                let y = v * id + ROUNDER;
                let r = (y.to_bits() as i32).wrapping_sub(ROUNDER.to_bits() as i32);
                let r = if y.is_nan() { 0 } else { r.clamp(-127, 127) };
                *q = r as i8;
                s += r;
            }
            let d16 = round_f16(d);
            a.d[b] = d16;
            a.sum[b] = d16 * s as f32;
            a.sum_f16[b] = round_f16(d * s as f32);
            a.isum[b] = s;
            for (h, half) in q.chunks_exact(QK / 2).enumerate() {
                a.isum16[2 * b + h] = half.iter().map(|&v| i32::from(v)).sum();
            }
        }
        a
    }

    /// Blocks per token.
    pub(crate) fn blocks(&self) -> usize {
        self.k / QK
    }
}

/// `v` rounded to the nearest f16 (ties to even, as F16C's `vcvtps2ph` and ggml's
/// `GGML_CPU_FP32_TO_FP16`), as f32.
#[inline(always)]
pub(crate) fn round_f16(v: f32) -> f32 {
    half::f16::from_f32(v).to_f32()
}

/// The largest `|v|` of a block, NaNs ignored, as `fold(0, |m, v| m.max(v.abs()))` but in
/// eight independent lanes (`a > m` keeps `m` for a NaN, as `max` does, and compiles to one
/// vector max): a serial chain of 32 maxima, each waiting on the last, is slower than the
/// rest of the quantization.
fn block_amax(x: &[f32]) -> f32 {
    let max = |m: f32, a: f32| if a > m { a } else { m };
    let mut lanes = [0f32; 8];
    for c in x.chunks_exact(8) {
        for (l, v) in lanes.iter_mut().zip(c) {
            *l = max(*l, v.abs());
        }
    }
    let tail = x.chunks_exact(8).remainder();
    tail.iter()
        .fold(lanes.into_iter().fold(0f32, max), |m, v| max(m, v.abs()))
}

/// The instruction set a kernel uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Isa {
    /// Portable Rust, the reference.
    Scalar,
    /// AVX2 + FMA + F16C: `maddubs`/`madd` dot products.
    #[cfg(target_arch = "x86_64")]
    Avx2,
    /// AVX-512 F/BW/VL + VNNI: `vpdpbusd` dot products.
    #[cfg(target_arch = "x86_64")]
    Avx512Vnni,
    /// NEON (always present on aarch64): widening multiplies and pairwise adds.
    #[cfg(target_arch = "aarch64")]
    Neon,
}

impl Isa {
    /// The best variant this CPU runs, detected once.
    pub(crate) fn best() -> Isa {
        static BEST: OnceLock<Isa> = OnceLock::new();
        *BEST.get_or_init(|| Isa::available().into_iter().last().unwrap_or(Isa::Scalar))
    }

    /// Every variant this CPU runs, worst first (the tests run them all).
    pub(crate) fn available() -> Vec<Isa> {
        #[allow(unused_mut)]
        let mut v = vec![Isa::Scalar];
        #[cfg(target_arch = "x86_64")]
        {
            use std::arch::is_x86_feature_detected as has;
            if has!("avx2") && has!("fma") && has!("f16c") {
                v.push(Isa::Avx2);
                if has!("avx512f") && has!("avx512bw") && has!("avx512vl") && has!("avx512vnni") {
                    v.push(Isa::Avx512Vnni);
                }
            }
        }
        #[cfg(target_arch = "aarch64")]
        v.push(Isa::Neon);
        v
    }
}

/// `out[r * x.n + t] = row r of w · token t of x` for every whole row of `k = x.k` values in
/// `w` (packed `kind` blocks) and every token, with the best kernel of this CPU.
pub(crate) fn matmul_rows(kind: Kind, w: &[u8], x: &Q8Acts, out: &mut [f32]) {
    matmul_rows_with(Isa::best(), kind, w, x, out)
}

/// [`matmul_rows`] with a given variant; `isa` must be one of [`Isa::available`].
pub(crate) fn matmul_rows_with(isa: Isa, kind: Kind, w: &[u8], x: &Q8Acts, out: &mut [f32]) {
    let row_bytes = kind.row_bytes(x.k);
    let rows = w.len().checked_div(row_bytes).unwrap_or(0);
    // Every kernel relies on these: whole rows, whole blocks, room for every result.
    assert!(
        x.k.is_multiple_of(kind.block_values())
            && w.len() == rows * row_bytes
            && out.len() == rows * x.n
            && x.qs.len() == x.n * x.k
            && x.d.len() == x.n * x.blocks()
            && x.sum.len() == x.d.len()
            && x.sum_f16.len() == x.d.len()
            && x.isum.len() == x.d.len(),
        "qdot: inconsistent sizes"
    );
    match isa {
        Isa::Scalar => scalar::matmul_rows(kind, w, x, out),
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => {
            assert!(Isa::available().contains(&Isa::Avx2));
            // SAFETY: AVX2, FMA and F16C were detected (the assert above); sizes were
            // checked above.
            unsafe { x86::matmul_rows_avx2(kind, w, x, out) }
        }
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512Vnni => {
            assert!(Isa::available().contains(&Isa::Avx512Vnni));
            // SAFETY: AVX2/FMA/F16C and AVX-512 F/BW/VL/VNNI were detected (the assert
            // above); sizes were checked above.
            unsafe { x86::matmul_rows_vnni(kind, w, x, out) }
        }
        #[cfg(target_arch = "aarch64")]
        Isa::Neon => {
            // SAFETY: NEON is part of the aarch64 baseline; sizes were checked above.
            unsafe { neon::matmul_rows(kind, w, x, out) }
        }
    }
}

/// Little-endian f16 at `b[i..i + 2]`, widened exactly.
#[inline(always)]
fn f16_at(b: &[u8], i: usize) -> f32 {
    crate::quant::f16_to_f32(u16::from_le_bytes([b[i], b[i + 1]]))
}

/// Sub-block `j`'s 6-bit scale and min of a Q4_K super-block (`scales` is its 12 bytes).
#[inline(always)]
fn q4k_scale_min(j: usize, scales: &[u8]) -> (u8, u8) {
    if j < 4 {
        (scales[j] & 63, scales[j + 4] & 63)
    } else {
        (
            (scales[j + 4] & 0xF) | ((scales[j - 4] >> 6) << 4),
            (scales[j + 4] >> 4) | ((scales[j] >> 6) << 4),
        )
    }
}

/// Twice the E2M1 value of each MXFP4 code: whole numbers, exact in int8. Code 8 (−0) is
/// 0, which no sum can tell from +0.
pub(crate) const MXFP4_DOUBLED: [i8; 16] =
    [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12];

/// What the x86 kernels add to [`MXFP4_DOUBLED`]: `vpmaddubsw` and `vpdpbusd` multiply
/// unsigned bytes by signed ones, so the weights go in as `w + 12` (0..=24) and
/// `Σ (w + 12)·x − 12·Σx` gives the same integer.
#[cfg(target_arch = "x86_64")]
pub(crate) const MXFP4_BIAS: i8 = 12;

/// `2^(e - 128)`: half an E8M0 scale, the factor of the doubled codes, as f32 bits (the
/// subnormals 2^-128 and 2^-127 for `e` 0 and 1; the SIMD kernels build the same bits).
/// Equal to `e8m0_to_f32(e) * 0.5` for every `e` but 255, which is NaN in the OCP spec and
/// never reaches a block (the loader rejects it).
#[inline(always)]
pub(crate) fn mxfp4_half_scale(e: u8) -> f32 {
    match e {
        0 | 1 => f32::from_bits(0x0020_0000 << e),
        _ => f32::from_bits(u32::from(e - 1) << 23),
    }
}

/// Level `j` (0..32) of a Q5_0 block's packed bytes `qs[16]` and high bits `qh`: the nibble
/// (low for `j < 16`, high for the rest) with bit `j` of `qh` on top, in `0..32`.
#[inline(always)]
fn q5_0_level(qs: &[u8], qh: u32, j: usize) -> u8 {
    let nibble = if j < 16 { qs[j] & 0xF } else { qs[j - 16] >> 4 };
    nibble | (((qh >> j) & 1) as u8) << 4
}

/// Value `i` (0..256) of a Q6_K super-block, `q - 32` in `-32..32`. Half `h` of 128 values
/// keeps its low nibbles in `ql[64h..64h + 64]` and top bit pairs in `qh[32h..32h + 32]`:
/// value `128h + 32k + l` has the low (`k < 2`) or high nibble of `ql[64h + 32(k % 2) + l]`
/// and bits `2k..2k + 2` of `qh[32h + l]`.
#[inline(always)]
fn q6k_level(blk: &[u8], i: usize) -> i8 {
    let (h, k, l) = (i / 128, i % 128 / 32, i % 32);
    let low = (blk[64 * h + 32 * (k % 2) + l] >> (4 * (k / 2))) & 0xF;
    let high = (blk[128 + 32 * h + l] >> (2 * k)) & 3;
    (low | high << 4) as i8 - 32
}

/// The portable kernels: the reference the SIMD variants are tested against.
mod scalar {
    use super::*;

    pub(super) fn matmul_rows(kind: Kind, w: &[u8], x: &Q8Acts, out: &mut [f32]) {
        let row_bytes = kind.row_bytes(x.k);
        for (r, row) in w.chunks_exact(row_bytes.max(1)).enumerate() {
            for t in 0..x.n {
                out[r * x.n + t] = row_dot(kind, row, x, t);
            }
        }
    }

    /// One weight row · token `t`: per-block integer dot, scaled and summed in f32.
    fn row_dot(kind: Kind, row: &[u8], x: &Q8Acts, t: usize) -> f32 {
        let nb = x.blocks();
        let qs = &x.qs[t * x.k..(t + 1) * x.k];
        let (xd, xs) = (&x.d[t * nb..(t + 1) * nb], &x.sum[t * nb..(t + 1) * nb]);
        let xs16 = &x.sum_f16[t * nb..(t + 1) * nb];
        let nibble_dot = |nib: &[u8], q: &[i8]| -> i32 {
            (0..16)
                .map(|j| {
                    i32::from(nib[j] & 0xF) * i32::from(q[j])
                        + i32::from(nib[j] >> 4) * i32::from(q[j + 16])
                })
                .sum()
        };
        let (mut acc, mut offset) = (0f32, 0f32);
        match kind {
            Kind::Q4_0 | Kind::Q4_1 | Kind::Q5_0 | Kind::Q8_0 => {
                let bb = kind.block_bytes();
                for (b, blk) in row.chunks_exact(bb).enumerate() {
                    let q = &qs[b * QK..(b + 1) * QK];
                    let dw = f16_at(blk, 0);
                    let dot = match kind {
                        Kind::Q8_0 => blk[2..]
                            .iter()
                            .zip(q)
                            .map(|(&w, &v)| i32::from(w as i8) * i32::from(v))
                            .sum(),
                        Kind::Q4_0 => nibble_dot(&blk[2..], q),
                        Kind::Q5_0 => {
                            let qh = u32::from_le_bytes([blk[2], blk[3], blk[4], blk[5]]);
                            (0..QK)
                                .map(|j| i32::from(q5_0_level(&blk[6..], qh, j)) * i32::from(q[j]))
                                .sum()
                        }
                        _ => nibble_dot(&blk[4..], q),
                    };
                    acc += dw * xd[b] * dot as f32;
                    match kind {
                        Kind::Q4_0 => offset += -8.0 * dw * xs[b],
                        Kind::Q5_0 => offset += -16.0 * dw * xs[b],
                        Kind::Q4_1 => offset += f16_at(blk, 2) * xs16[b],
                        _ => {}
                    }
                }
            }
            Kind::Q4K | Kind::Q5K => {
                let five = kind == Kind::Q5K;
                for (sb, blk) in row.chunks_exact(kind.block_bytes()).enumerate() {
                    let (d, dmin) = (f16_at(blk, 0), f16_at(blk, 2));
                    // Q5_K's 32 bytes of fifth bits sit between the scales and the nibbles.
                    let (scales, qh) = (&blk[4..16], &blk[16..48]);
                    let nibs = &blk[if five { 48 } else { 16 }..];
                    for j in 0..8 {
                        let (sc, m) = q4k_scale_min(j, scales);
                        let b = sb * 8 + j;
                        let q = &qs[b * QK..(b + 1) * QK];
                        let half = &nibs[32 * (j / 2)..32 * (j / 2) + 32];
                        let dot: i32 = half
                            .iter()
                            .zip(q)
                            .enumerate()
                            .map(|(l, (&v, &x))| {
                                let v = if j % 2 == 0 { v & 0xF } else { v >> 4 };
                                let v = if five { v | ((qh[l] >> j) & 1) << 4 } else { v };
                                i32::from(v) * i32::from(x)
                            })
                            .sum();
                        acc += d * f32::from(sc) * xd[b] * dot as f32;
                        offset += -dmin * f32::from(m) * xs[b];
                    }
                }
            }
            Kind::Mxfp4 => {
                for (b, blk) in row.chunks_exact(17).enumerate() {
                    let q = &qs[b * QK..(b + 1) * QK];
                    let w = |code: u8| i32::from(MXFP4_DOUBLED[usize::from(code & 0xF)]);
                    let dot: i32 = (0..16)
                        .map(|j| {
                            w(blk[1 + j]) * i32::from(q[j])
                                + w(blk[1 + j] >> 4) * i32::from(q[j + 16])
                        })
                        .sum();
                    acc += mxfp4_half_scale(blk[0]) * xd[b] * dot as f32;
                }
            }
            Kind::Q6K => {
                for (sb, blk) in row.chunks_exact(210).enumerate() {
                    let d = f16_at(blk, 208);
                    for j in 0..8 {
                        let b = sb * 8 + j;
                        let q = &qs[b * QK..(b + 1) * QK];
                        // Two 16-value sub-blocks, scales[2j] and scales[2j + 1]: the
                        // integer dot of the block is exact (|Σ| < 2^24).
                        let dot: i32 = (0..2)
                            .map(|s| {
                                let sc = i32::from(blk[192 + 2 * j + s] as i8);
                                let part: i32 = (16 * s..16 * s + 16)
                                    .map(|l| {
                                        i32::from(q6k_level(blk, 32 * j + l)) * i32::from(q[l])
                                    })
                                    .sum();
                                sc * part
                            })
                            .sum();
                        acc += d * xd[b] * dot as f32;
                    }
                }
            }
        }
        acc + offset
    }
}

#[cfg(test)]
mod tests;
