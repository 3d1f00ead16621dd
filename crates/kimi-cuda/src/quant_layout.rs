//! Device layout of the 32-value integer and FP8 block types (Q4Z, Q8Z, F8S,
//! `kimi_core::qblocks`): pure host code, so that its tests run in every build.
//!
//! The stored blocks (`scale header | codes`) are split into two planes, row-major by
//! (row, block): first every block's codes (16 or 32 bytes, whole aligned 16-byte words
//! for the kernels' vector loads), then every block's header (`d, z` as two f32, or `d`).
//! The total size is the stored size, so a tensor's byte count is its dtype's.
#![cfg_attr(not(feature = "cuda"), allow(dead_code))]

use kimi_core::DType;

/// `(header bytes, code bytes)` of one block of a type kept in planes on the device.
pub(crate) fn parts(dtype: DType) -> Option<(usize, usize)> {
    match dtype {
        DType::Q4Z => Some((8, 16)),
        DType::Q8Z => Some((8, 32)),
        DType::F8S => Some((4, 32)),
        _ => None,
    }
}

/// The kernels' format code (`kernels/quant.cu`: 0 = Q4Z, 1 = Q8Z, 2 = F8S).
pub(crate) fn format_code(dtype: DType) -> Option<i32> {
    match dtype {
        DType::Q4Z => Some(0),
        DType::Q8Z => Some(1),
        DType::F8S => Some(2),
        _ => None,
    }
}

/// The device planes of whole stored blocks of `dtype`, or `None` for another dtype or a
/// byte count that is not whole blocks.
pub(crate) fn device_planes(dtype: DType, blocks: &[u8]) -> Option<Vec<u8>> {
    let (head, code) = parts(dtype)?;
    let bb = head + code;
    if !blocks.len().is_multiple_of(bb) {
        return None;
    }
    let nb = blocks.len() / bb;
    let mut out = vec![0u8; blocks.len()];
    let (codes, heads) = out.split_at_mut(nb * code);
    for (i, b) in blocks.chunks_exact(bb).enumerate() {
        heads[i * head..(i + 1) * head].copy_from_slice(&b[..head]);
        codes[i * code..(i + 1) * code].copy_from_slice(&b[head..]);
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use kimi_core::qblocks;

    /// The stored blocks back from the planes.
    fn blocks_from_planes(dtype: DType, planes: &[u8]) -> Vec<u8> {
        let (head, code) = parts(dtype).unwrap();
        let nb = planes.len() / (head + code);
        let (codes, heads) = planes.split_at(nb * code);
        (0..nb)
            .flat_map(|i| {
                let h = &heads[i * head..(i + 1) * head];
                h.iter().chain(&codes[i * code..(i + 1) * code]).copied()
            })
            .collect()
    }

    fn f32_at(b: &[u8], at: usize) -> f32 {
        f32::from_le_bytes(b[at..at + 4].try_into().unwrap())
    }

    /// What `quant_widen` computes for block `blk`, piece by piece as the kernel reads the
    /// planes (Q4Z: the low or high nibbles of two code words per 8 values).
    fn widen_like_kernel(dtype: DType, planes: &[u8], blk: usize, nblocks: usize) -> Vec<f32> {
        let (head, code) = parts(dtype).unwrap();
        let c = &planes[blk * code..(blk + 1) * code];
        let h = &planes[nblocks * code + blk * head..];
        let d = f32_at(h, 0);
        let z = if head == 8 { f32_at(h, 4) } else { 0.0 };
        let word = |i: usize| u32::from_le_bytes(c[4 * i..4 * i + 4].try_into().unwrap());
        let mut out = Vec::with_capacity(32);
        for part in 0..4 {
            for j in 0..8 {
                let v = match dtype {
                    DType::Q4Z => {
                        let w = word(2 * (part & 1) + j / 4);
                        let nib = (w >> (4 * (part >> 1) + 8 * (j % 4))) & 0xF;
                        nib as f32 - z
                    }
                    DType::Q8Z => f32::from(c[8 * part + j]) - z,
                    _ => qblocks::e4m3_to_f32(c[8 * part + j]),
                };
                out.push(v * d);
            }
        }
        out
    }

    /// What a GEMV lane sums for block `blk`: Σ over the four pieces of value · x at the
    /// piece's offsets, with x[i] = i + 1 so that a misplaced value shows.
    fn gemv_like_kernel(dtype: DType, planes: &[u8], blk: usize, nblocks: usize) -> f32 {
        let (head, code) = parts(dtype).unwrap();
        let c = &planes[blk * code..(blk + 1) * code];
        let h = &planes[nblocks * code + blk * head..];
        let d = f32_at(h, 0);
        let z = if head == 8 { f32_at(h, 4) } else { 0.0 };
        let x = |i: usize| (i + 1) as f32;
        let mut s = 0.0f32;
        for i in 0..4 {
            let (xa, xb, v): (usize, usize, [f32; 8]) = match dtype {
                DType::Q4Z => {
                    let w = u32::from_le_bytes(c[4 * i..4 * i + 4].try_into().unwrap());
                    let v = std::array::from_fn(|j| {
                        let sh = if j < 4 { 8 * j } else { 8 * (j - 4) + 4 };
                        ((w >> sh) & 0xF) as f32 - z
                    });
                    (4 * i, 16 + 4 * i, v)
                }
                DType::Q8Z => (
                    8 * i,
                    8 * i + 4,
                    std::array::from_fn(|j| f32::from(c[8 * i + j]) - z),
                ),
                _ => (
                    8 * i,
                    8 * i + 4,
                    std::array::from_fn(|j| qblocks::e4m3_to_f32(c[8 * i + j])),
                ),
            };
            for j in 0..4 {
                s += v[j] * x(xa + j) + v[4 + j] * x(xb + j);
            }
        }
        d * s
    }

    fn random_blocks(dtype: DType, nb: usize) -> Vec<u8> {
        let mut state = 0x2545f4914f6cdd1du64;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        let bb = dtype.block_bytes();
        let mut out = vec![0u8; nb * bb];
        for b in out.chunks_exact_mut(bb) {
            let codes: [u8; 32] = std::array::from_fn(|_| next() as u8);
            let d = 0.01 + (next() % 100) as f32 * 1e-3;
            let z = (next() % 16) as f32;
            match dtype {
                DType::Q4Z => qblocks::write_q4z(&codes.map(|c| c & 0xF), d, z, b),
                DType::Q8Z => qblocks::write_q8z(&codes, d, z * 16.0, b),
                // No NaN codes.
                _ => qblocks::write_f8s(&codes.map(|c| c & 0xF7), d, b),
            }
        }
        out
    }

    #[test]
    fn planes_keep_every_value_where_the_kernels_read_it() {
        for dtype in [DType::Q4Z, DType::Q8Z, DType::F8S] {
            let nb = 7;
            let blocks = random_blocks(dtype, nb);
            let planes = device_planes(dtype, &blocks).unwrap();
            assert_eq!(planes.len(), blocks.len());
            assert_eq!(blocks_from_planes(dtype, &planes), blocks, "{dtype}");
            let mut want = vec![0f32; nb * 32];
            assert!(qblocks::dequantize(dtype, &blocks, &mut want));
            for blk in 0..nb {
                let got = widen_like_kernel(dtype, &planes, blk, nb);
                assert_eq!(got, want[blk * 32..(blk + 1) * 32], "{dtype} block {blk}");
                let dot: f64 = want[blk * 32..(blk + 1) * 32]
                    .iter()
                    .enumerate()
                    .map(|(i, &w)| f64::from(w) * (i + 1) as f64)
                    .sum();
                let g = f64::from(gemv_like_kernel(dtype, &planes, blk, nb));
                assert!(
                    (g - dot).abs() <= 1e-4 * dot.abs().max(1.0),
                    "{dtype} {g} {dot}"
                );
            }
        }
        assert!(device_planes(DType::Q4Z, &[0u8; 25]).is_none());
        assert!(device_planes(DType::BF16, &[0u8; 24]).is_none());
    }
}
