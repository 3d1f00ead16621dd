//! MXFP4 (OCP microscaling 4-bit float), ggml's `block_mxfp4` layout:
//!
//! ```text
//!  MXFP4  e:u8 (E8M0) | qs[16]     x[j] = E2M1(nibble_j) * 2^(e - 127)
//! ```
//! Nibbles as Q4_0: `qs[j] & 0xF` holds value `j`, `qs[j] >> 4` holds value `j + 16`. An E2M1
//! code is sign (bit 3), exponent (bits 2–1) and mantissa (bit 0): magnitudes
//! {0, 0.5, 1, 1.5, 2, 3, 4, 6}. Kimi K3's safetensors store the same codes and scales as two
//! planes with the even column in the low nibble ([`from_planes`] repacks them).

/// E2M1 code → value.
pub const E2M1: [f32; 16] = [
    0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
];

/// `2^(e - 127)` for an E8M0 scale byte. 255 is NaN in the OCP spec; the loader rejects it
/// before any block is built, so here it stays NaN and shows a broken invariant.
#[inline]
pub fn e8m0_to_f32(e: u8) -> f32 {
    match e {
        // 2^-127 is an f32 subnormal: its only bit is the top mantissa bit.
        0 => f32::from_bits(0x0040_0000),
        255 => f32::NAN,
        _ => f32::from_bits(u32::from(e) << 23),
    }
}

/// Dequantizes one block.
pub(super) fn dequantize_mxfp4(b: &[u8; 17], out: &mut [f32; 32]) {
    let d = e8m0_to_f32(b[0]);
    for j in 0..16 {
        out[j] = E2M1[usize::from(b[1 + j] & 0xF)] * d;
        out[j + 16] = E2M1[usize::from(b[1 + j] >> 4)] * d;
    }
}

/// The code of the E2M1 value nearest to `x` (the first of two equally near ones).
fn nearest_code(x: f32) -> u8 {
    let mut best = (0u8, f32::INFINITY);
    for (code, &v) in E2M1.iter().enumerate() {
        let err = (x - v).abs();
        if err < best.1 {
            best = (code as u8, err);
        }
    }
    best.0
}

/// Quantizes one block: the scale puts the largest magnitude in E2M1's top binade
/// (`e = floor(log2(amax)) − 2 + 127`, as ggml's reference quantizer does), then each value
/// takes the nearest code.
pub(super) fn quantize_mxfp4(x: &[f32; 32], out: &mut [u8; 17]) {
    let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
    let e = if amax > 0.0 && amax.is_finite() {
        (amax.log2().floor() - 2.0 + 127.0).clamp(1.0, 254.0) as u8
    } else {
        0
    };
    let d = e8m0_to_f32(e);
    out[0] = e;
    for j in 0..16 {
        let lo = nearest_code(x[j] / d);
        let hi = nearest_code(x[j + 16] / d);
        out[1 + j] = lo | (hi << 4);
    }
}

/// Repacks one row of a two-plane MXFP4 tensor into ggml blocks: `codes` holds `cols / 2`
/// bytes with column `2i` in the low nibble of byte `i` and `2i + 1` in the high one,
/// `scales` holds `cols / 32` E8M0 bytes, `out` receives `cols / 32` blocks of 17 bytes.
/// The values are unchanged.
pub fn from_planes(codes: &[u8], scales: &[u8], out: &mut [u8]) {
    for ((block, pairs), &e) in out
        .chunks_exact_mut(17)
        .zip(codes.chunks_exact(16))
        .zip(scales)
    {
        block[0] = e;
        // Column c of the block is nibble c % 2 of pair byte c / 2.
        let nib = |c: usize| (pairs[c / 2] >> (4 * (c % 2))) & 0xF;
        for j in 0..16 {
            block[1 + j] = nib(j) | (nib(j + 16) << 4);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scales_are_powers_of_two() {
        assert_eq!(e8m0_to_f32(127), 1.0);
        assert_eq!(e8m0_to_f32(128), 2.0);
        assert_eq!(e8m0_to_f32(120), 1.0 / 128.0);
        assert_eq!(e8m0_to_f32(254), 2f32.powi(127));
        assert_eq!(e8m0_to_f32(1), 2f32.powi(-126));
        assert_eq!(e8m0_to_f32(0), 2f32.powi(-127));
        assert!(e8m0_to_f32(255).is_nan());
    }

    #[test]
    fn planes_repack_to_the_same_values() {
        // Row of 64 columns: column c has code c % 16, scale bytes 126 and 129.
        let codes: Vec<u8> = (0..32)
            .map(|i| ((2 * i) % 16) as u8 | ((((2 * i + 1) % 16) as u8) << 4))
            .collect();
        let scales = [126u8, 129];
        let mut blocks = vec![0u8; 34];
        from_planes(&codes, &scales, &mut blocks);
        let mut out = [0f32; 32];
        for (b, block) in blocks.chunks_exact(17).enumerate() {
            dequantize_mxfp4(block.try_into().expect("17-byte blocks"), &mut out);
            let d = [0.5f32, 4.0][b];
            for (j, &v) in out.iter().enumerate() {
                let c = 32 * b + j;
                assert_eq!(v.to_bits(), (E2M1[c % 16] * d).to_bits(), "column {c}");
            }
        }
        // Negative zero survives.
        assert!(E2M1[8] == 0.0 && E2M1[8].is_sign_negative());
    }

    #[test]
    fn quantize_round_trips_representable_blocks() {
        let x: [f32; 32] = std::array::from_fn(|j| E2M1[j % 16] * 0.25);
        let mut b = [0u8; 17];
        quantize_mxfp4(&x, &mut b);
        let mut y = [0f32; 32];
        dequantize_mxfp4(&b, &mut y);
        assert_eq!(x, y);
    }
}
