//! MLA latent caches in FP8 E4M3 (`--kv-cache-dtype fp8`).
//!
//! MLA caches one row per token shared by every head — the normalised latent `c` and the
//! rope key `k_pe` — so there are no per-head scales to give it. Each row instead carries
//! two f32 scales, one for `c` (values `..split`) and one for `k_pe` (`split..`), set when
//! the row is written to the part's largest magnitude over 448 (E4M3's largest value): no
//! calibration, no overflow, and the two parts' different ranges do not share a scale.
//! A row of `width` values takes `8 + width` bytes (584 for Kimi Linear's 512 + 64: 3.9×
//! fewer than f32). Attention dequantizes a sequence's rows once per call into f32 and runs
//! the f32 kernels over them.

use kimi_core::qblocks::{e4m3_to_f32, f32_to_e4m3};
use kimi_ops::{Error, PagedSeq, Result};

use crate::tensor::{CpuTensor, Storage};

/// Largest finite E4M3 value.
const E4M3_MAX: f32 = 448.0;

/// A zeroed pool of `shape` (`[.., width]`), every row's scales 0.
pub(crate) fn zeros(shape: &[usize]) -> Result<CpuTensor> {
    let width = shape.last().copied().unwrap_or(0);
    let rows = shape[..shape.len().saturating_sub(1)]
        .iter()
        .try_fold(1usize, |n, &d| n.checked_mul(d));
    let len = rows.and_then(|r| r.checked_mul(width.checked_add(8)?));
    let bytes = len
        .filter(|&n| n <= isize::MAX as usize)
        .and_then(crate::arena::try_zeroed_vec::<u8>)
        .ok_or_else(|| Error::out_of_memory(format!("an FP8 cache of shape {shape:?}"), len, 1))?;
    Ok(CpuTensor::new(
        shape.to_vec(),
        Storage::Fp8Rows {
            bytes,
            split: width,
        },
    ))
}

/// Scale of `values`: their largest magnitude over 448 (0 for an all-zero part).
fn scale_of(values: &[f32]) -> f32 {
    values.iter().fold(0f32, |m, v| m.max(v.abs())) / E4M3_MAX
}

/// Writes one row: `out` is `8 + src.len()` bytes.
pub(crate) fn quantize_row(src: &[f32], split: usize, out: &mut [u8]) {
    let split = split.min(src.len());
    for (part, (values, codes)) in [(&src[..split], 0..split), (&src[split..], split..src.len())]
        .into_iter()
        .enumerate()
    {
        let s = scale_of(values);
        out[4 * part..4 * part + 4].copy_from_slice(&s.to_le_bytes());
        let inv = if s > 0.0 { 1.0 / s } else { 0.0 };
        for (o, v) in out[8 + codes.start..8 + codes.end].iter_mut().zip(values) {
            *o = f32_to_e4m3(v * inv);
        }
    }
}

/// One row's values (`out` is `width` long; `row` is `8 + width` bytes).
fn dequantize_row(row: &[u8], split: usize, out: &mut [f32]) {
    let s = [
        f32::from_le_bytes([row[0], row[1], row[2], row[3]]),
        f32::from_le_bytes([row[4], row[5], row[6], row[7]]),
    ];
    for (i, (o, &q)) in out.iter_mut().zip(&row[8..]).enumerate() {
        *o = e4m3_to_f32(q) * s[usize::from(i >= split)];
    }
}

/// Every row of a pool's bytes, in storage order.
pub(crate) fn dequantize_rows(bytes: &[u8], width: usize, split: usize, out: &mut [f32]) {
    for (row, o) in bytes
        .chunks_exact(8 + width)
        .zip(out.chunks_exact_mut(width.max(1)))
    {
        dequantize_row(row, split, o);
    }
}

fn row_start(table: &[u32], block_size: usize, width: usize, i: usize) -> usize {
    (table[i / block_size] as usize * block_size + i % block_size) * (8 + width)
}

/// Writes `rows` (whole rows of `width`) at the sequence's positions `num_cached ..`.
pub(crate) fn write_rows(
    bytes: &mut [u8],
    seq: &PagedSeq<'_>,
    block_size: usize,
    width: usize,
    split: usize,
    rows: &[f32],
) {
    for (j, src) in rows.chunks_exact(width.max(1)).enumerate() {
        let at = row_start(seq.block_table, block_size, width, seq.num_cached + j);
        quantize_row(src, split, &mut bytes[at..at + 8 + width]);
    }
}

/// The sequence's rows `0..count` as f32, in token order (`[count, width]`).
pub(crate) fn gather(
    bytes: &[u8],
    seq: &PagedSeq<'_>,
    block_size: usize,
    width: usize,
    split: usize,
    count: usize,
) -> Vec<f32> {
    let mut out = vec![0f32; count * width];
    for (i, o) in out.chunks_exact_mut(width.max(1)).enumerate() {
        let at = row_start(seq.block_table, block_size, width, i);
        dequantize_row(&bytes[at..at + 8 + width], split, o);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Rows come back within E4M3's half step of their part's scale, zero rows stay zero,
    /// and the two parts keep their own ranges.
    #[test]
    fn rows_round_trip_within_half_a_step() {
        let width = 40;
        let split = 32;
        let src: Vec<f32> = (0..width)
            .map(|i| {
                if i < split {
                    (i as f32 - 15.5) * 0.03
                } else {
                    (i as f32 - 35.0) * 7.0
                }
            })
            .collect();
        let mut row = vec![0u8; 8 + width];
        quantize_row(&src, split, &mut row);
        let mut back = vec![0f32; width];
        dequantize_row(&row, split, &mut back);
        for (part, range) in [(0, 0..split), (1, split..width)] {
            let amax = src[range.clone()].iter().fold(0f32, |m, v| m.max(v.abs()));
            for i in range {
                // 3 mantissa bits: relative error ≤ 2^-4 above the subnormals.
                let tol = (src[i].abs() / 16.0).max(amax / 448.0 * 2f32.powi(-9) * 2.0) * 1.0001;
                assert!(
                    (back[i] - src[i]).abs() <= tol,
                    "part {part} value {i}: {} vs {}",
                    back[i],
                    src[i]
                );
            }
            assert_eq!(back[if part == 0 { 0 } else { width - 1 }].abs(), amax);
        }
        let mut zero = vec![0u8; 8 + 4];
        quantize_row(&[0.0; 4], 2, &mut zero);
        dequantize_row(&zero, 2, &mut back[..4]);
        assert!(back[..4].iter().all(|&v| v == 0.0));
    }

    #[test]
    fn paged_rows_are_written_and_gathered_in_token_order() {
        let (width, block_size) = (6, 2);
        let t = zeros(&[4, block_size, width]).unwrap();
        let Storage::Fp8Rows { mut bytes, .. } = t.storage else {
            unreachable!()
        };
        let table = [3u32, 0, 2];
        let rows: Vec<f32> = (0..5 * width).map(|i| (i % 7) as f32 - 3.0).collect();
        let seq = PagedSeq {
            block_table: &table,
            num_cached: 0,
        };
        write_rows(&mut bytes, &seq, block_size, width, 4, &rows[..2 * width]);
        let seq = PagedSeq {
            block_table: &table,
            num_cached: 2,
        };
        write_rows(&mut bytes, &seq, block_size, width, 4, &rows[2 * width..]);
        let got = gather(&bytes, &seq, block_size, width, 4, 5);
        // Small whole numbers are exact in E4M3 at these scales... up to the scale's rounding.
        for (g, w) in got.iter().zip(&rows) {
            assert!((g - w).abs() <= w.abs() / 16.0 + 1e-6, "{g} vs {w}");
        }
    }
}
