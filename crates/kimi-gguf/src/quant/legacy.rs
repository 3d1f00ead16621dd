//! The 32-value block formats: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0.
//!
//! ```text
//!  Q4_0  d:f16 | qs[16]            x[j] = (nibble_j - 8) * d
//!  Q4_1  d:f16 m:f16 | qs[16]      x[j] = nibble_j * d + m
//!  Q5_0  d:f16 | qh:u32 | qs[16]   x[j] = (nibble_j | bit_j(qh) << 4) - 16) * d
//!  Q5_1  d:f16 m:f16 | qh | qs[16] x[j] = (nibble_j | bit_j(qh) << 4) * d + m
//!  Q8_0  d:f16 | qs:i8[32]         x[j] = qs[j] * d
//! ```
//! Nibbles: `qs[j] & 0xF` holds value `j`, `qs[j] >> 4` holds value `j + 16`.

use super::{f16_at, put_f16};

const QK: usize = 32;

/// Returns the value of largest magnitude (with its sign), 0 for an all-zero block.
fn signed_absmax(x: &[f32]) -> f32 {
    let mut max = 0.0f32;
    for &v in x {
        if v.abs() > max.abs() {
            max = v;
        }
    }
    max
}

/// `(min, max)` by strict comparisons, so the first of equal values (0.0 or -0.0) wins as
/// in ggml, and NaNs are skipped.
fn min_max(x: &[f32]) -> (f32, f32) {
    let (mut lo, mut hi) = (f32::MAX, f32::MIN);
    for &v in x {
        if v < lo {
            lo = v;
        }
        if v > hi {
            hi = v;
        }
    }
    (lo, hi)
}

/// `1 / d`, or 0 when `d` is 0 (an all-zero block quantizes to zeros).
fn inverse(d: f32) -> f32 {
    if d != 0.0 {
        1.0 / d
    } else {
        0.0
    }
}

/// Truncates toward zero after adding `bias` and clamps to `0..=max` (ggml's
/// `MIN(max, (int8_t)(v + bias))`, without its undefined behaviour for stray values).
fn trunc_level(v: f32, bias: f32, max: i32) -> u8 {
    ((v + bias) as i32).clamp(0, max) as u8
}

fn pack_nibbles(levels: &[u8; QK], qs: &mut [u8]) {
    for j in 0..QK / 2 {
        qs[j] = (levels[j] & 0xF) | ((levels[j + QK / 2] & 0xF) << 4);
    }
}

fn high_bits(levels: &[u8; QK]) -> [u8; 4] {
    let mut qh = 0u32;
    for (j, &l) in levels.iter().enumerate() {
        qh |= u32::from(l >> 4 & 1) << j;
    }
    qh.to_le_bytes()
}

/// Level `j` (0..32) of a nibble-packed block, with the fifth bit from `qh` if given.
fn level(qs: &[u8], qh: u32, j: usize) -> i32 {
    let nibble = if j < QK / 2 {
        qs[j] & 0xF
    } else {
        qs[j - QK / 2] >> 4
    };
    i32::from(nibble) | ((qh >> j & 1) as i32) << 4
}

pub(super) fn quantize_q4_0(x: &[f32; QK], b: &mut [u8; 18]) {
    // The largest-magnitude value maps to level 0 (-8 * d), so d carries its sign.
    let d = signed_absmax(x) / -8.0;
    let id = inverse(d);
    put_f16(b, 0, d);
    let levels = x.map(|v| trunc_level(v * id, 8.5, 15));
    pack_nibbles(&levels, &mut b[2..]);
}

pub(super) fn dequantize_q4_0(b: &[u8; 18], y: &mut [f32; QK]) {
    let d = f16_at(b, 0);
    for (j, y) in y.iter_mut().enumerate() {
        *y = (level(&b[2..], 0, j) - 8) as f32 * d;
    }
}

pub(super) fn quantize_q4_1(x: &[f32; QK], b: &mut [u8; 20]) {
    let (min, max) = min_max(x);
    let d = (max - min) / 15.0;
    let id = inverse(d);
    put_f16(b, 0, d);
    put_f16(b, 2, min);
    let levels = x.map(|v| trunc_level((v - min) * id, 0.5, 15));
    pack_nibbles(&levels, &mut b[4..]);
}

pub(super) fn dequantize_q4_1(b: &[u8; 20], y: &mut [f32; QK]) {
    let (d, m) = (f16_at(b, 0), f16_at(b, 2));
    for (j, y) in y.iter_mut().enumerate() {
        *y = level(&b[4..], 0, j) as f32 * d + m;
    }
}

pub(super) fn quantize_q5_0(x: &[f32; QK], b: &mut [u8; 22]) {
    let d = signed_absmax(x) / -16.0;
    let id = inverse(d);
    put_f16(b, 0, d);
    let levels = x.map(|v| trunc_level(v * id, 16.5, 31));
    b[2..6].copy_from_slice(&high_bits(&levels));
    pack_nibbles(&levels, &mut b[6..]);
}

pub(super) fn dequantize_q5_0(b: &[u8; 22], y: &mut [f32; QK]) {
    let d = f16_at(b, 0);
    let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
    for (j, y) in y.iter_mut().enumerate() {
        *y = (level(&b[6..], qh, j) - 16) as f32 * d;
    }
}

pub(super) fn quantize_q5_1(x: &[f32; QK], b: &mut [u8; 24]) {
    let (min, max) = min_max(x);
    let d = (max - min) / 31.0;
    let id = inverse(d);
    put_f16(b, 0, d);
    put_f16(b, 2, min);
    let levels = x.map(|v| trunc_level((v - min) * id, 0.5, 31));
    b[4..8].copy_from_slice(&high_bits(&levels));
    pack_nibbles(&levels, &mut b[8..]);
}

pub(super) fn dequantize_q5_1(b: &[u8; 24], y: &mut [f32; QK]) {
    let (d, m) = (f16_at(b, 0), f16_at(b, 2));
    let qh = u32::from_le_bytes([b[4], b[5], b[6], b[7]]);
    for (j, y) in y.iter_mut().enumerate() {
        *y = level(&b[8..], qh, j) as f32 * d + m;
    }
}

pub(super) fn quantize_q8_0(x: &[f32; QK], b: &mut [u8; 34]) {
    let amax = x.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    let d = amax / 127.0;
    let id = inverse(d);
    put_f16(b, 0, d);
    for (q, &v) in b[2..].iter_mut().zip(x) {
        // Round half away from zero, as ggml's `roundf`; `as` saturates to -128..=127.
        *q = ((v * id).round() as i8) as u8;
    }
}

pub(super) fn dequantize_q8_0(b: &[u8; 34], y: &mut [f32; QK]) {
    let d = f16_at(b, 0);
    for (y, &q) in y.iter_mut().zip(&b[2..]) {
        *y = f32::from(q as i8) * d;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Builds a block by hand from the format definition and checks dequantization.
    #[test]
    fn hand_built_blocks_dequantize() {
        // Q8_0, d = 0.5: qs = 0, 1, -1, 127, -128, ...
        let mut b = [0u8; 34];
        b[..2].copy_from_slice(&half::f16::from_f32(0.5).to_le_bytes());
        b[2..7].copy_from_slice(&[0, 1, 0xFF, 127, 0x80]);
        let mut y = [0.0; 32];
        dequantize_q8_0(&b, &mut y);
        assert_eq!(&y[..5], &[0.0, 0.5, -0.5, 63.5, -64.0]);

        // Q4_1, d = 2, m = -1: qs[0] = 0x3A -> value 0 = 10, value 16 = 3.
        let mut b = [0u8; 20];
        b[..2].copy_from_slice(&half::f16::from_f32(2.0).to_le_bytes());
        b[2..4].copy_from_slice(&half::f16::from_f32(-1.0).to_le_bytes());
        b[4] = 0x3A;
        let mut y = [0.0; 32];
        dequantize_q4_1(&b, &mut y);
        assert_eq!((y[0], y[16], y[1]), (19.0, 5.0, -1.0));

        // Q5_0, d = 1: value 0 has nibble 0xF and high bit 1 -> 31 - 16 = 15; value 17
        // has nibble 0 and high bit 0 -> -16.
        let mut b = [0u8; 22];
        b[..2].copy_from_slice(&half::f16::from_f32(1.0).to_le_bytes());
        b[2] = 1;
        b[6] = 0x0F;
        let mut y = [0.0; 32];
        dequantize_q5_0(&b, &mut y);
        assert_eq!((y[0], y[17]), (15.0, -16.0));
    }

    #[test]
    fn q4_0_extreme_value_is_exact() {
        let mut x = [0.25f32; 32];
        x[7] = -4.0;
        let mut b = [0u8; 18];
        quantize_q4_0(&x, &mut b);
        let mut y = [0.0; 32];
        dequantize_q4_0(&b, &mut y);
        assert_eq!(y[7], -4.0);
        assert!((y[0] - 0.25).abs() <= 0.25);
    }
}
