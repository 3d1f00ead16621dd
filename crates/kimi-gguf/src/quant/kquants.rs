//! The 256-value k-quant super-block formats: Q4_K, Q5_K, Q6_K.
//!
//! ```text
//!  Q4_K (144 B)  d:f16 dmin:f16 | scales[12] | qs[128]
//!  Q5_K (176 B)  d:f16 dmin:f16 | scales[12] | qh[32] | qs[128]
//!      8 sub-blocks of 32 values; sub-block s has a 6-bit scale sc_s and min m_s packed
//!      in `scales`; x = d * sc_s * q - dmin * m_s, q in 0..16 (Q4_K) or 0..32 (Q5_K).
//!      qs: 64-value chunk c is 32 bytes; low nibbles = sub-block 2c, high = 2c + 1.
//!      qh (Q5_K): bit 2c of qh[l] is the fifth bit of value 64c + l, bit 2c + 1 that of
//!      value 64c + 32 + l.
//!  Q6_K (210 B)  ql[128] | qh[64] | scales:i8[16] | d:f16
//!      16 sub-blocks of 16 values; x = d * scales[s] * (q - 32), q in 0..64.
//!      128-value half h uses ql[64h..64h + 64], qh[32h..32h + 32]; for l in 0..32 the
//!      values l, l + 32, l + 64, l + 96 of the half take the low nibble of ql[l], low
//!      of ql[l + 32], high of ql[l], high of ql[l + 32], and bits 0-1, 2-3, 4-5, 6-7 of
//!      qh[l] as their top two bits.
//! ```
//! The 12 `scales` bytes of Q4_K/Q5_K: for s < 4, `scales[s]` and `scales[s + 4]` hold
//! sc_s and m_s in their low six bits; for s >= 4, `scales[s + 4]` holds the low four
//! bits of sc_s (low nibble) and m_s (high nibble), and their top two bits sit in the top
//! bits of `scales[s - 4]` (sc) and `scales[s]` (m).

use super::{f16_at, nearest_int, put_f16};
use crate::types::QK_K;

/// Below this, a group is treated as all zeros (ggml's `GROUP_MAX_EPS`).
const GROUP_MAX_EPS: f32 = 1e-15;

/// Sub-block `s`'s 6-bit scale and min from the packed 12 bytes.
fn scale_min(s: usize, scales: &[u8]) -> (u8, u8) {
    if s < 4 {
        (scales[s] & 63, scales[s + 4] & 63)
    } else {
        let sc = (scales[s + 4] & 0xF) | ((scales[s - 4] >> 6) << 4);
        let m = (scales[s + 4] >> 4) | ((scales[s] >> 6) << 4);
        (sc, m)
    }
}

/// Packs eight 6-bit scales and mins into 12 bytes (the inverse of [`scale_min`]).
fn pack_scale_mins(sc: &[u8; 8], m: &[u8; 8]) -> [u8; 12] {
    let mut out = [0u8; 12];
    for s in 0..8 {
        if s < 4 {
            out[s] = sc[s];
            out[s + 4] = m[s];
        } else {
            out[s + 4] = (sc[s] & 0xF) | ((m[s] & 0xF) << 4);
            out[s - 4] |= (sc[s] >> 4) << 6;
            out[s] |= (m[s] >> 4) << 6;
        }
    }
    out
}

/// Fits `x ≈ scale * l - min` with `l` in `0..=nmax`, minimizing the `weights`-weighted
/// squared error. Starts from the min/max grid, then tries `nstep + 1` grid densities
/// `(nmax + rmin + rdelta * i) / (max - min)`, refitting scale and min by weighted least
/// squares for each (the design of ggml's `make_qkx2_quants`). The min is clamped so that
/// 0 stays representable. Returns `(scale, min)` with `min >= 0`; levels go to `levels`.
fn fit_scale_min(
    x: &[f32; 32],
    weights: &[f32; 32],
    nmax: i32,
    (rmin, rdelta, nstep): (f32, f32, usize),
    levels: &mut [u8; 32],
) -> (f32, f32) {
    // Strict comparisons, as ggml: the first of 0.0 and -0.0 wins, NaNs are skipped.
    let (mut lo, mut hi) = (x[0], x[0]);
    for &v in &x[1..] {
        if v < lo {
            lo = v;
        }
        if v > hi {
            hi = v;
        }
    }
    if lo > 0.0 {
        lo = 0.0;
    }
    if hi == lo || !(hi - lo).is_finite() {
        *levels = [0; 32];
        return (0.0, -lo);
    }
    let quantize = |iscale: f32, lo: f32, out: &mut [u8; 32]| {
        for (l, &v) in out.iter_mut().zip(x) {
            *l = nearest_int(iscale * (v - lo)).clamp(0, nmax) as u8;
        }
    };
    let error = |scale: f32, lo: f32, ls: &[u8; 32]| -> f32 {
        ls.iter()
            .zip(x)
            .zip(weights)
            .map(|((&l, &v), &w)| {
                let diff = scale * f32::from(l) + lo - v;
                w * (diff * diff)
            })
            .sum()
    };
    let sum_w: f32 = weights.iter().sum();
    let sum_x: f32 = weights.iter().zip(x).map(|(w, v)| w * v).sum();

    let iscale = nmax as f32 / (hi - lo);
    let mut scale = 1.0 / iscale;
    quantize(iscale, lo, levels);
    let mut best = error(scale, lo, levels);
    let mut trial = [0u8; 32];
    for step in 0..=nstep {
        let iscale = (rmin + rdelta * step as f32 + nmax as f32) / (hi - lo);
        quantize(iscale, lo, &mut trial);
        let (mut sum_l, mut sum_l2, mut sum_xl) = (0.0f32, 0.0f32, 0.0f32);
        for ((&l, &v), &w) in trial.iter().zip(x).zip(weights) {
            let l = f32::from(l);
            sum_l += w * l;
            sum_l2 += w * l * l;
            sum_xl += w * l * v;
        }
        let det = sum_w * sum_l2 - sum_l * sum_l;
        if det <= 0.0 {
            continue;
        }
        let mut this_scale = (sum_w * sum_xl - sum_x * sum_l) / det;
        let mut this_lo = (sum_l2 * sum_x - sum_l * sum_xl) / det;
        if this_lo > 0.0 {
            this_lo = 0.0;
            this_scale = sum_xl / sum_l2;
        }
        let err = error(this_scale, this_lo, &trial);
        if err < best {
            *levels = trial;
            best = err;
            scale = this_scale;
            lo = this_lo;
        }
    }
    (scale, -lo)
}

/// Shared quantizer of Q4_K and Q5_K: fits each 32-value sub-block, quantizes the eight
/// scales and mins to 6 bits against the super-block's `d` and `dmin`, then recomputes the
/// levels with the quantized scales. Writes `d`, `dmin`, `scales` to `head` (16 bytes) and
/// returns the 256 levels in `0..=nmax`.
fn quantize_scale_min_block(
    x: &[f32; QK_K],
    nmax: i32,
    search: (f32, f32, usize),
    head: &mut [u8],
) -> [u8; QK_K] {
    let mut levels = [0u8; QK_K];
    let mut scales = [0.0f32; 8];
    let mut mins = [0.0f32; 8];
    for s in 0..8 {
        let sub: &[f32; 32] = sub_block(x, s);
        let rms = (sub.iter().map(|v| v * v).sum::<f32>() / 32.0).sqrt();
        let weights = sub.map(|v| rms + v.abs());
        let mut l = [0u8; 32];
        (scales[s], mins[s]) = fit_scale_min(sub, &weights, nmax, search, &mut l);
        levels[32 * s..32 * s + 32].copy_from_slice(&l);
    }
    let largest = |v: &[f32; 8]| v.iter().fold(0.0f32, |m, &x| if x > m { x } else { m });
    let (max_scale, max_min) = (largest(&scales), largest(&mins));
    let inv_scale = if max_scale > 0.0 {
        63.0 / max_scale
    } else {
        0.0
    };
    let inv_min = if max_min > 0.0 { 63.0 / max_min } else { 0.0 };
    let sc = scales.map(|v| nearest_int(inv_scale * v).clamp(0, 63) as u8);
    let m = mins.map(|v| nearest_int(inv_min * v).clamp(0, 63) as u8);
    let d = put_f16(head, 0, max_scale / 63.0);
    let dmin = put_f16(head, 2, max_min / 63.0);
    head[4..16].copy_from_slice(&pack_scale_mins(&sc, &m));
    for s in 0..8 {
        let sd = d * f32::from(sc[s]);
        if sd == 0.0 {
            continue;
        }
        let dm = dmin * f32::from(m[s]);
        for (l, &v) in levels[32 * s..32 * s + 32]
            .iter_mut()
            .zip(sub_block::<32>(x, s))
        {
            *l = nearest_int((v + dm) / sd).clamp(0, nmax) as u8;
        }
    }
    levels
}

/// Sub-block `s` of `N` values of a super-block.
fn sub_block<const N: usize>(x: &[f32; QK_K], s: usize) -> &[f32; N] {
    <&[f32; N]>::try_from(&x[N * s..N * s + N]).expect("invariant: a slice of length N")
}

pub(super) fn quantize_q4_k(x: &[f32; QK_K], b: &mut [u8; 144]) {
    let levels = quantize_scale_min_block(x, 15, (-1.0, 0.1, 20), &mut b[..16]);
    let qs = &mut b[16..];
    for c in 0..4 {
        for l in 0..32 {
            qs[32 * c + l] = levels[64 * c + l] | (levels[64 * c + 32 + l] << 4);
        }
    }
}

pub(super) fn dequantize_q4_k(b: &[u8; 144], y: &mut [f32; QK_K]) {
    let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
    let (scales, qs) = (&b[4..16], &b[16..]);
    // Sub-block s (32 values): low nibbles of qs[32·(s/2)..] for even s, high for odd s.
    // One scale and min per sub-block, so the inner loop vectorizes; the same products.
    for (s, y) in y.chunks_exact_mut(32).enumerate() {
        let (sc, m) = scale_min(s, scales);
        let (d1, m1) = (d * f32::from(sc), dmin * f32::from(m));
        let (qs, shift) = (&qs[32 * (s / 2)..32 * (s / 2) + 32], 4 * (s % 2));
        for (y, &q) in y.iter_mut().zip(qs) {
            *y = d1 * f32::from((q >> shift) & 0xF) - m1;
        }
    }
}

pub(super) fn quantize_q5_k(x: &[f32; QK_K], b: &mut [u8; 176]) {
    let levels = quantize_scale_min_block(x, 31, (-0.5, 0.1, 15), &mut b[..16]);
    let (qh, qs) = b[16..].split_at_mut(32);
    qh.fill(0);
    for c in 0..4 {
        for l in 0..32 {
            let (lo, hi) = (levels[64 * c + l], levels[64 * c + 32 + l]);
            qs[32 * c + l] = (lo & 0xF) | ((hi & 0xF) << 4);
            qh[l] |= (lo >> 4) << (2 * c) | (hi >> 4) << (2 * c + 1);
        }
    }
}

pub(super) fn dequantize_q5_k(b: &[u8; 176], y: &mut [f32; QK_K]) {
    let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
    let (scales, qh, qs) = (&b[4..16], &b[16..48], &b[48..]);
    for (i, y) in y.iter_mut().enumerate() {
        let (c, l, high) = (i / 64, i % 32, i % 64 >= 32);
        let (sc, m) = scale_min(i / 32, scales);
        let q = qs[32 * c + l];
        let bit = 2 * c + usize::from(high);
        let q = (if high { q >> 4 } else { q & 0xF }) | ((qh[l] >> bit) & 1) << 4;
        *y = d * f32::from(sc) * f32::from(q) - dmin * f32::from(m);
    }
}

/// Fits `x ≈ scale * l` with `l` in `-nmax..nmax`, weighting each error by `x²`: starts
/// from the grid that puts the largest-magnitude value on `-nmax`, then tries 18 nearby
/// grid densities and keeps the least-squares best (the design of ggml's `make_qx_quants`
/// with `rmse_type = 1`). Levels (offset by `nmax`) go to `levels`.
fn fit_scale_symmetric(x: &[f32; 16], nmax: i32, levels: &mut [u8; 16]) -> f32 {
    let max = x
        .iter()
        .fold(0.0f32, |m, &v| if v.abs() > m.abs() { v } else { m });
    if max.abs() < GROUP_MAX_EPS || !max.is_finite() {
        *levels = [0; 16];
        return 0.0;
    }
    let level = |iscale: f32, v: f32| nearest_int(iscale * v).clamp(-nmax, nmax - 1);
    let sums = |iscale: f32| {
        x.iter().fold((0.0f32, 0.0f32), |(slx, sl2), &v| {
            let (l, w) = (level(iscale, v) as f32, v * v);
            (slx + w * v * l, sl2 + w * l * l)
        })
    };
    let mut best_iscale = -(nmax as f32) / max;
    let (sumlx, suml2) = sums(best_iscale);
    let mut scale = if suml2 > 0.0 { sumlx / suml2 } else { 0.0 };
    let mut best = scale * sumlx;
    for step in (-9..=9).filter(|&s| s != 0) {
        let iscale = -(nmax as f32 + 0.1 * step as f32) / max;
        let (sumlx, suml2) = sums(iscale);
        if suml2 > 0.0 && sumlx * sumlx > best * suml2 {
            scale = sumlx / suml2;
            best = scale * sumlx;
            best_iscale = iscale;
        }
    }
    for (l, &v) in levels.iter_mut().zip(x) {
        *l = (level(best_iscale, v) + nmax) as u8;
    }
    scale
}

pub(super) fn quantize_q6_k(x: &[f32; QK_K], b: &mut [u8; 210]) {
    let mut levels = [0u8; QK_K];
    let mut scales = [0.0f32; 16];
    for (s, scale) in scales.iter_mut().enumerate() {
        let mut l = [0u8; 16];
        *scale = fit_scale_symmetric(sub_block(x, s), 32, &mut l);
        levels[16 * s..16 * s + 16].copy_from_slice(&l);
    }
    let max_scale = scales
        .iter()
        .fold(0.0f32, |m, &v| if v.abs() > m.abs() { v } else { m });
    b.fill(0);
    if max_scale.abs() < GROUP_MAX_EPS {
        return;
    }
    // The largest scale maps to -128, so `d` takes the sign that makes it representable.
    let iscale = -128.0 / max_scale;
    let d = put_f16(b, 208, 1.0 / iscale);
    for s in 0..16 {
        let sc = nearest_int(iscale * scales[s]).clamp(-128, 127) as i8;
        b[192 + s] = sc as u8;
        let sd = d * f32::from(sc);
        if sd == 0.0 {
            continue;
        }
        for (l, &v) in levels[16 * s..16 * s + 16]
            .iter_mut()
            .zip(sub_block::<16>(x, s))
        {
            *l = (nearest_int(v / sd).clamp(-32, 31) + 32) as u8;
        }
    }
    let (ql, qh) = b[..192].split_at_mut(128);
    for h in 0..2 {
        for l in 0..32 {
            let q = |k: usize| levels[128 * h + 32 * k + l];
            ql[64 * h + l] = (q(0) & 0xF) | ((q(2) & 0xF) << 4);
            ql[64 * h + 32 + l] = (q(1) & 0xF) | ((q(3) & 0xF) << 4);
            qh[32 * h + l] = (q(0) >> 4) | (q(1) >> 4) << 2 | (q(2) >> 4) << 4 | (q(3) >> 4) << 6;
        }
    }
}

pub(super) fn dequantize_q6_k(b: &[u8; 210], y: &mut [f32; QK_K]) {
    let d = f16_at(b, 208);
    let (ql, qh, scales) = (&b[..128], &b[128..192], &b[192..208]);
    // Value 128·h + 32·k + l: low nibble of ql[64·h + 32·(k % 2) + l] (high nibble for k ≥ 2),
    // bits 2k..2k+1 of qh[32·h + l], scale scales[8·h + 2·k + l / 16]. Laid out as ggml's
    // `dequantize_row_q6_K` (fixed strides, so the loop vectorizes; the same products).
    for (h, y) in y.chunks_exact_mut(128).enumerate() {
        let (ql, qh, sc) = (
            &ql[64 * h..64 * h + 64],
            &qh[32 * h..32 * h + 32],
            &scales[8 * h..],
        );
        for l in 0..32 {
            let q = |low: u8, shift: u32| f32::from((low | ((qh[l] >> shift) & 3) << 4) as i8 - 32);
            let s = |k: usize| f32::from(sc[2 * k + l / 16] as i8);
            y[l] = d * s(0) * q(ql[l] & 0xF, 0);
            y[l + 32] = d * s(1) * q(ql[l + 32] & 0xF, 2);
            y[l + 64] = d * s(2) * q(ql[l] >> 4, 4);
            y[l + 96] = d * s(3) * q(ql[l + 32] >> 4, 6);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scale_min_packing_round_trips() {
        let sc = [0, 1, 62, 63, 17, 63, 32, 5];
        let m = [63, 0, 1, 33, 48, 2, 63, 31];
        let packed = pack_scale_mins(&sc, &m);
        for s in 0..8 {
            assert_eq!(scale_min(s, &packed), (sc[s], m[s]), "sub-block {s}");
        }
    }

    /// A Q4_K block built by hand from the layout: d = 1, dmin = 0.5, sub-block 5 has
    /// scale 33 and min 18 (both above 15, so their top bits use the packed positions).
    #[test]
    fn hand_built_q4_k_block() {
        let mut b = [0u8; 144];
        b[..2].copy_from_slice(&half::f16::from_f32(1.0).to_le_bytes());
        b[2..4].copy_from_slice(&half::f16::from_f32(0.5).to_le_bytes());
        // s = 5: scales[9] = (33 & 0xF) | (18 & 0xF) << 4; scales[1] top bits = 33 >> 4;
        // scales[5] top bits = 18 >> 4.
        b[4 + 9] = 0x21;
        b[4 + 1] = 2 << 6;
        b[4 + 5] = 1 << 6;
        // Value 160 + 7 is in chunk 2, high nibble of qs[64 + 7].
        b[16 + 64 + 7] = 0xC0;
        let mut y = [0.0; QK_K];
        dequantize_q4_k(&b, &mut y);
        assert_eq!(y[167], 33.0 * 12.0 - 0.5 * 18.0);
        assert_eq!(y[160], -9.0);
        assert_eq!(y[0], 0.0);
    }

    /// A Q6_K block by hand: d = 0.25, scales[9] = -3; value 128 + 64 + 5 (half 1, k = 2)
    /// takes the high nibble of ql[64 + 5] and bits 4-5 of qh[32 + 5].
    #[test]
    fn hand_built_q6_k_block() {
        let mut b = [0u8; 210];
        b[208..].copy_from_slice(&half::f16::from_f32(0.25).to_le_bytes());
        for s in 0..16 {
            b[192 + s] = 1;
        }
        b[192 + 12] = (-3i8) as u8;
        b[64 + 5] = 0x70; // high nibble 7
        b[128 + 32 + 5] = 0b10 << 4; // top bits 2
        let mut y = [0.0; QK_K];
        dequantize_q6_k(&b, &mut y);
        // q = 7 | 2 << 4 = 39, minus 32 = 7; sub-block (128 + 69) / 16 = 12.
        assert_eq!(y[128 + 64 + 5], 0.25 * -3.0 * 7.0);
        // Every other value is level 0 (-32) except those sharing ql[69] / qh[37].
        assert_eq!(y[0], 0.25 * 1.0 * -32.0);
    }
}
