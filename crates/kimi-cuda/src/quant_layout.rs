//! Device layout of weights kept packed for `kernels/quant.cu`: the integer and FP8 block
//! types of `kimi_core::qblocks` (Q4Z, Q8Z, F8S) and ggml's Q4_0, Q4_1, Q8_0 and Q4_K. Pure
//! host code, so that its tests run in every build.
//!
//! Every type becomes 32-value units of one of four kernel formats, each unit a header
//! (the scales as f32) and its codes, split into two planes row-major by (row, unit): first
//! every unit's codes (16 or 32 bytes, whole aligned 16-byte words for the kernels' vector
//! loads), then every unit's header.
//!
//! | format | header | codes | value |
//! |---|---|---|---|
//! | 0 (Q4Z, Q4_0) | `d, z` | 16 bytes, byte j = value j (low nibble), j + 16 (high) | `(q − z) · d` |
//! | 1 (Q8Z, Q8_0) | `d, z` | 32 u8 | `(q − z) · d` |
//! | 2 (F8S) | `d` | 32 E4M3 | `e4m3(q) · d` |
//! | 3 (Q4_1, Q4_K) | `a, b` | as format 0 | `q · a − b` |
//!
//! The repacks are exact: Q4_0 is `z = 8`; Q8_0's signed codes are stored plus 128 with
//! `z = 128`; Q4_1 is `a = d, b = −m`; a Q4_K sub-block is `a = d · scale, b = dmin · min`
//! (f16 times a 6-bit integer: exact in f32, as ggml computes them), its nibbles moved to
//! format 0's order. Q4Z, Q8Z and F8S keep their stored size; Q4_0 grows from 18 to 24
//! bytes per 32 values, Q4_1 from 20, Q8_0 from 34 to 40 and Q4_K from 18 to 24 (a kernel
//! that reads Q4_K's super-blocks as stored is a later step).
#![cfg_attr(not(feature = "cuda"), allow(dead_code))]

use half::f16;
use kimi_core::DType;

/// The kernels' format code of a type kept packed (`kernels/quant.cu`: 0 = Q4Z-like,
/// 1 = Q8Z-like, 2 = F8S, 3 = `q · a − b` nibbles).
pub(crate) fn format_code(dtype: DType) -> Option<i32> {
    match dtype {
        DType::Q4Z | DType::Q4_0 => Some(0),
        DType::Q8Z | DType::Q8_0 => Some(1),
        DType::F8S => Some(2),
        DType::Q4_1 | DType::Q4_K => Some(3),
        _ => None,
    }
}

/// The stored type's code for `quant_from_blocks` (`kernels/quant.cu`), which lays out a
/// slot fill's stored blocks on the device as [`device_planes`] does on the host.
pub(crate) fn fill_kind(dtype: DType) -> Option<i32> {
    Some(match dtype {
        DType::Q4Z => 0,
        DType::Q8Z => 1,
        DType::F8S => 2,
        DType::Q4_0 => 3,
        DType::Q8_0 => 4,
        DType::Q4_1 => 5,
        DType::Q4_K => 6,
        _ => return None,
    })
}

/// `(header bytes, code bytes)` of one 32-value unit of a type kept packed.
pub(crate) fn parts(dtype: DType) -> Option<(usize, usize)> {
    Some(match format_code(dtype)? {
        0 | 3 => (8, 16),
        1 => (8, 32),
        _ => (4, 32),
    })
}

/// Device bytes of `n` values of a type kept packed (whole stored blocks), or `None`.
pub(crate) fn device_bytes(dtype: DType, n: usize) -> Option<usize> {
    let (head, code) = parts(dtype)?;
    dtype.storage_bytes(n)?;
    Some(n / 32 * (head + code))
}

fn f16_at(b: &[u8], at: usize) -> f32 {
    f16::from_le_bytes([b[at], b[at + 1]]).to_f32()
}

fn put_pair(head: &mut [u8], a: f32, b: f32) {
    head[..4].copy_from_slice(&a.to_le_bytes());
    head[4..8].copy_from_slice(&b.to_le_bytes());
}

/// ggml's `get_scale_min_k4`: the 6-bit scale and min of Q4_K sub-block `j`.
fn q4k_scale_min(j: usize, s: &[u8]) -> (u8, u8) {
    if j < 4 {
        (s[j] & 63, s[j + 4] & 63)
    } else {
        (
            (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4),
            (s[j + 4] >> 4) | ((s[j] >> 6) << 4),
        )
    }
}

/// The device planes of whole stored blocks of `dtype`, or `None` for another dtype or a
/// byte count that is not whole blocks.
pub(crate) fn device_planes(dtype: DType, blocks: &[u8]) -> Option<Vec<u8>> {
    let (head, code) = parts(dtype)?;
    let bb = dtype.block_bytes();
    if !blocks.len().is_multiple_of(bb) {
        return None;
    }
    let per_block = dtype.block_size() / 32;
    let units = blocks.len() / bb * per_block;
    let mut out = vec![0u8; units * (head + code)];
    let (codes, heads) = out.split_at_mut(units * code);
    for (bi, b) in blocks.chunks_exact(bb).enumerate() {
        for j in 0..per_block {
            let u = bi * per_block + j;
            let h = &mut heads[u * head..(u + 1) * head];
            let c = &mut codes[u * code..(u + 1) * code];
            match dtype {
                DType::Q4Z | DType::Q8Z | DType::F8S => {
                    h.copy_from_slice(&b[..head]);
                    c.copy_from_slice(&b[head..]);
                }
                DType::Q4_0 => {
                    put_pair(h, f16_at(b, 0), 8.0);
                    c.copy_from_slice(&b[2..18]);
                }
                DType::Q8_0 => {
                    put_pair(h, f16_at(b, 0), 128.0);
                    for (o, &q) in c.iter_mut().zip(&b[2..34]) {
                        *o = q ^ 0x80;
                    }
                }
                DType::Q4_1 => {
                    put_pair(h, f16_at(b, 0), -f16_at(b, 2));
                    c.copy_from_slice(&b[4..20]);
                }
                _ => {
                    // Q4_K: d, dmin, 12 scale bytes, then per 64 values 32 bytes whose low
                    // nibbles are sub-block 2i and high nibbles sub-block 2i + 1.
                    let (sc, m) = q4k_scale_min(j, &b[4..16]);
                    put_pair(h, f16_at(b, 0) * f32::from(sc), f16_at(b, 2) * f32::from(m));
                    let qs = &b[16 + 32 * (j / 2)..][..32];
                    let nib = |l: usize| (qs[l] >> (4 * (j % 2))) & 0xF;
                    for (i, o) in c.iter_mut().enumerate() {
                        *o = nib(i) | (nib(i + 16) << 4);
                    }
                }
            }
        }
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every type kept packed can be laid out on the device when a slot fills
    /// (`quant_from_blocks`), and no other type claims to.
    #[test]
    fn every_packed_type_fills_on_the_device() {
        for dtype in [
            DType::Q4Z,
            DType::Q8Z,
            DType::F8S,
            DType::Q4_0,
            DType::Q8_0,
            DType::Q4_1,
            DType::Q4_K,
            DType::BF16,
            DType::MXFP4,
            DType::Q6_K,
        ] {
            assert_eq!(
                fill_kind(dtype).is_some(),
                format_code(dtype).is_some(),
                "{dtype}"
            );
        }
    }
    use kimi_core::qblocks;
    use kimi_ops::{Backend, HostTensor};

    fn f32_at(b: &[u8], at: usize) -> f32 {
        f32::from_le_bytes(b[at..at + 4].try_into().unwrap())
    }

    /// Unit `u`'s (scale, zero or offset) and code bytes in the planes of `units` units.
    fn unit(dtype: DType, planes: &[u8], u: usize, units: usize) -> (f32, f32, &[u8]) {
        let (head, code) = parts(dtype).unwrap();
        let h = &planes[units * code + u * head..];
        let z = if head == 8 { f32_at(h, 4) } else { 0.0 };
        (f32_at(h, 0), z, &planes[u * code..(u + 1) * code])
    }

    /// A value as the kernels make it from its code.
    fn value(dtype: DType, q: u8, d: f32, z: f32) -> f32 {
        match format_code(dtype).unwrap() {
            0 | 1 => (f32::from(q) - z) * d,
            2 => qblocks::e4m3_to_f32(q) * d,
            _ => f32::from(q).mul_add(d, -z),
        }
    }

    /// What `quant_widen` computes for unit `u`, piece by piece as the kernel reads the
    /// planes (4-bit formats: the low or high nibbles of two code words per 8 values).
    fn widen_like_kernel(dtype: DType, planes: &[u8], u: usize, units: usize) -> Vec<f32> {
        let (d, z, c) = unit(dtype, planes, u, units);
        let four = parts(dtype).unwrap().1 == 16;
        let word = |i: usize| u32::from_le_bytes(c[4 * i..4 * i + 4].try_into().unwrap());
        let mut out = Vec::with_capacity(32);
        for part in 0..4 {
            for j in 0..8 {
                let q = if four {
                    let w = word(2 * (part & 1) + j / 4);
                    ((w >> (4 * (part >> 1) + 8 * (j % 4))) & 0xF) as u8
                } else {
                    c[8 * part + j]
                };
                out.push(value(dtype, q, d, z));
            }
        }
        out
    }

    /// What a GEMV lane sums for unit `u`, as `quant_gemv_*` computes it: value i (the
    /// nibble or byte where the kernel reads it for activation slot i / 4) dequantized as
    /// q · d rounded once, times x[i] = i + 1 (so that a misplaced value shows), then the
    /// zero term −(z · d) · Σx (format 3: −b · Σx; F8S: none).
    fn gemv_like_kernel(dtype: DType, planes: &[u8], u: usize, units: usize) -> f32 {
        let (d, z, c) = unit(dtype, planes, u, units);
        let fmt = format_code(dtype).unwrap();
        let x = |i: usize| (i + 1) as f32;
        let mut s = 0.0f32;
        let mut sx = 0.0f32;
        for p in 0..8 {
            for j in 0..4 {
                let i = 4 * p + j;
                let q = if fmt == 0 || fmt == 3 {
                    // Code word p % 4: low nibbles for slots 0..4, high ones for 4..8.
                    let w = u32::from_le_bytes(c[4 * (p % 4)..4 * (p % 4) + 4].try_into().unwrap());
                    ((w >> (8 * j + 4 * (p / 4))) & 0xF) as u8
                } else {
                    c[i]
                };
                let v = if fmt == 2 {
                    qblocks::e4m3_to_f32(q) * d
                } else {
                    f32::from(q) * d
                };
                s = v.mul_add(x(i), s);
                sx += x(i);
            }
        }
        let zd = match fmt {
            0 | 1 => z * d,
            3 => z,
            _ => 0.0,
        };
        (-zd).mul_add(sx, s)
    }

    fn random_blocks(dtype: DType, values: usize) -> Vec<u8> {
        let mut state = 0x2545f4914f6cdd1du64;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        let bb = dtype.block_bytes();
        let mut out = vec![0u8; values / dtype.block_size() * bb];
        for b in out.chunks_exact_mut(bb) {
            let codes: [u8; 32] = std::array::from_fn(|_| next() as u8);
            let d = 0.01 + (next() % 100) as f32 * 1e-3;
            let z = (next() % 16) as f32;
            let h = |v: f32| f16::from_f32(v).to_le_bytes();
            match dtype {
                DType::Q4Z => qblocks::write_q4z(&codes.map(|c| c & 0xF), d, z, b),
                DType::Q8Z => qblocks::write_q8z(&codes, d, z * 16.0, b),
                // No NaN codes.
                DType::F8S => qblocks::write_f8s(&codes.map(|c| c & 0xF7), d, b),
                _ => {
                    for x in b.iter_mut() {
                        *x = next() as u8;
                    }
                    b[..2].copy_from_slice(&h(d));
                    if matches!(dtype, DType::Q4_1 | DType::Q4_K) {
                        b[2..4].copy_from_slice(&h(d * z * 0.5));
                    }
                }
            }
        }
        out
    }

    #[test]
    fn planes_keep_every_value_where_the_kernels_read_it() {
        let cpu = kimi_cpu::CpuBackend::with_quant_matmul(kimi_cpu::QuantMatmul::F32);
        for dtype in [
            DType::Q4Z,
            DType::Q8Z,
            DType::F8S,
            DType::Q4_0,
            DType::Q4_1,
            DType::Q8_0,
            DType::Q4_K,
        ] {
            let values = 512;
            let blocks = random_blocks(dtype, values);
            let planes = device_planes(dtype, &blocks).unwrap();
            assert_eq!(Some(planes.len()), device_bytes(dtype, values));
            // The reference: the CPU backend's widening of the stored blocks.
            let w = cpu
                .upload(HostTensor {
                    shape: &[1, values],
                    dtype,
                    bytes: &blocks,
                })
                .unwrap();
            let want = cpu.to_f32(&w).unwrap();
            let units = values / 32;
            for u in 0..units {
                let got = widen_like_kernel(dtype, &planes, u, units);
                let w32 = &want[u * 32..(u + 1) * 32];
                // One rounding apart at most (format 3 fuses q · a − b into one FMA).
                let big = w32.iter().fold(0f32, |m, w| m.max(w.abs()));
                for (g, w) in got.iter().zip(w32) {
                    assert!((g - w).abs() <= 1e-6 * big, "{dtype} unit {u}: {g} vs {w}");
                }
                let dot: f64 = w32
                    .iter()
                    .enumerate()
                    .map(|(i, &w)| f64::from(w) * (i + 1) as f64)
                    .sum();
                let g = f64::from(gemv_like_kernel(dtype, &planes, u, units));
                let scale: f64 = w32.iter().map(|w| f64::from(w.abs()) * 32.0).sum();
                assert!(
                    (g - dot).abs() <= 1e-5 * scale,
                    "{dtype} unit {u}: {g} vs {dot}"
                );
            }
        }
        assert!(device_planes(DType::Q4Z, &[0u8; 25]).is_none());
        assert!(device_planes(DType::BF16, &[0u8; 24]).is_none());
        assert!(device_bytes(DType::Q4_K, 32).is_none());
    }
}
