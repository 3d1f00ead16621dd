//! Integer and FP8 matrices, unpacked from a checkpoint's planes, rewritten into the block
//! types of `kimi_core::qblocks` (or, where a block would mix groups, into exact f32).

use kimi_core::qblocks::{self, BLOCK};
use kimi_core::DType;
use rayon::prelude::*;

/// An integer-quantized matrix `[rows, cols]` in one layout whatever the tool:
/// `w[r, c] = (codes[r, c] − zeros[r, g]) · scales[r, g]` with `g = group_of[c]`.
pub(crate) struct IntMatrix {
    pub rows: usize,
    pub cols: usize,
    /// Bits per code (1..=8): ≤ 4 repacks into [`DType::Q4Z`], more into [`DType::Q8Z`].
    pub bits: u32,
    /// Unsigned codes, row-major `[rows, cols]`.
    pub codes: Vec<u8>,
    /// Scale columns per row.
    pub groups: usize,
    /// `[rows, groups]`.
    pub scales: Vec<f32>,
    /// `[rows, groups]`, whole numbers (a code's zero).
    pub zeros: Vec<f32>,
    /// The scale column of each input column `[cols]` (`c / group_size`, or GPTQ's and
    /// compressed-tensors' `g_idx` under activation order).
    pub group_of: Vec<u32>,
}

/// A matrix of FP8 E4M3 codes `[rows, cols]` with a scale per `row_block × col_block`
/// tile: `w[r, c] = e4m3(codes[r, c]) · scales[r / row_block, c / col_block]`.
pub(crate) struct Fp8Matrix<'a> {
    pub rows: usize,
    pub cols: usize,
    pub codes: &'a [u8],
    pub row_block: usize,
    pub col_block: usize,
    /// `[rows.div_ceil(row_block), cols.div_ceil(col_block)]`.
    pub scales: Vec<f32>,
}

impl IntMatrix {
    /// The matrix in blocks when each 32-value block of a row lies in one group (group
    /// sizes that are multiples of 32, activation orders that keep groups whole), else as
    /// f32 values. Both are exact.
    pub fn repack(&self) -> (DType, Vec<u8>) {
        let (rows, cols, g) = (self.rows, self.cols, self.groups);
        let blocks_whole = cols.is_multiple_of(BLOCK)
            && self
                .group_of
                .chunks(BLOCK)
                .all(|b| b.iter().all(|&x| x == b[0]));
        if !blocks_whole {
            let mut out = vec![0u8; rows * cols * 4];
            out.par_chunks_mut(cols * 4)
                .enumerate()
                .for_each(|(r, row)| {
                    for (c, v) in row.chunks_exact_mut(4).enumerate() {
                        let k = r * g + self.group_of[c] as usize;
                        let q = f32::from(self.codes[r * cols + c]);
                        v.copy_from_slice(&((q - self.zeros[k]) * self.scales[k]).to_le_bytes());
                    }
                });
            return (DType::F32, out);
        }
        let dtype = if self.bits <= 4 {
            DType::Q4Z
        } else {
            DType::Q8Z
        };
        let bb = dtype.block_bytes();
        let row_bytes = cols / BLOCK * bb;
        let mut out = vec![0u8; rows * row_bytes];
        out.par_chunks_mut(row_bytes.max(1))
            .enumerate()
            .for_each(|(r, row)| {
                for (b, block) in row.chunks_exact_mut(bb).enumerate() {
                    let c0 = b * BLOCK;
                    let k = r * g + self.group_of[c0] as usize;
                    let codes: &[u8; BLOCK] = self.codes[r * cols + c0..r * cols + c0 + BLOCK]
                        .try_into()
                        .unwrap_or(&[0; BLOCK]);
                    let (d, z) = (self.scales[k], self.zeros[k]);
                    if dtype == DType::Q4Z {
                        qblocks::write_q4z(codes, d, z, block);
                    } else {
                        qblocks::write_q8z(codes, d, z, block);
                    }
                }
            });
        (dtype, out)
    }
}

impl Fp8Matrix<'_> {
    /// The matrix as [`DType::F8S`] blocks where no 32-value block crosses a scale tile,
    /// else as f32 values. Both are exact.
    pub fn repack(&self) -> (DType, Vec<u8>) {
        let (rows, cols) = (self.rows, self.cols);
        let scale_cols = cols.div_ceil(self.col_block);
        let scale =
            |r: usize, c: usize| self.scales[r / self.row_block * scale_cols + c / self.col_block];
        let tiles_whole = cols.is_multiple_of(BLOCK)
            && (self.col_block.is_multiple_of(BLOCK) || self.col_block >= cols);
        if !tiles_whole {
            let table = qblocks::e4m3_table();
            let mut out = vec![0u8; rows * cols * 4];
            out.par_chunks_mut(cols * 4)
                .enumerate()
                .for_each(|(r, row)| {
                    for (c, v) in row.chunks_exact_mut(4).enumerate() {
                        let q = table[usize::from(self.codes[r * cols + c])];
                        v.copy_from_slice(&(q * scale(r, c)).to_le_bytes());
                    }
                });
            return (DType::F32, out);
        }
        let bb = DType::F8S.block_bytes();
        let row_bytes = cols / BLOCK * bb;
        let mut out = vec![0u8; rows * row_bytes];
        out.par_chunks_mut(row_bytes.max(1))
            .enumerate()
            .for_each(|(r, row)| {
                for (b, block) in row.chunks_exact_mut(bb).enumerate() {
                    let c0 = b * BLOCK;
                    let codes = &self.codes[r * cols + c0..r * cols + c0 + BLOCK];
                    qblocks::write_f8s(codes, scale(r, c0), block);
                }
            });
        (DType::F8S, out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn values(dtype: DType, bytes: &[u8], n: usize) -> Vec<f32> {
        if dtype == DType::F32 {
            return bytes
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect();
        }
        let mut out = vec![0f32; n];
        assert!(qblocks::dequantize(dtype, bytes, &mut out));
        out
    }

    fn matrix(cols: usize, group: usize, bits: u32, order: impl Fn(usize) -> u32) -> IntMatrix {
        let rows = 3;
        let groups = cols.div_ceil(group);
        IntMatrix {
            rows,
            cols,
            bits,
            codes: (0..rows * cols)
                .map(|i| (i * 7 % (1 << bits)) as u8)
                .collect(),
            groups,
            scales: (0..rows * groups).map(|i| 0.01 * (i + 1) as f32).collect(),
            zeros: (0..rows * groups).map(|i| (i % 5) as f32).collect(),
            group_of: (0..cols).map(order).collect(),
        }
    }

    fn want(m: &IntMatrix) -> Vec<f32> {
        (0..m.rows * m.cols)
            .map(|i| {
                let (r, c) = (i / m.cols, i % m.cols);
                let k = r * m.groups + m.group_of[c] as usize;
                (f32::from(m.codes[i]) - m.zeros[k]) * m.scales[k]
            })
            .collect()
    }

    #[test]
    fn integer_matrices_keep_every_value() {
        for (cols, group, bits, act_order, dtype) in [
            (128, 32, 4, false, DType::Q4Z),
            (128, 64, 4, false, DType::Q4Z),
            (128, 128, 8, false, DType::Q8Z),
            (96, 32, 2, false, DType::Q4Z),
            (96, 32, 3, false, DType::Q4Z),
            (64, 16, 4, false, DType::F32), // groups smaller than a block
            (40, 40, 4, false, DType::F32), // rows that are not whole blocks
            (128, 32, 4, true, DType::F32), // act-order groups crossing blocks
        ] {
            let m = matrix(cols, group, bits, |c| {
                if act_order {
                    ((c * 5) % cols / group) as u32
                } else {
                    (c / group) as u32
                }
            });
            let (got_type, bytes) = m.repack();
            assert_eq!(got_type, dtype, "{cols} {group} {bits}");
            assert_eq!(values(got_type, &bytes, m.rows * cols), want(&m));
        }
    }

    #[test]
    fn fp8_matrices_keep_every_value() {
        let (rows, cols): (usize, usize) = (5, 64);
        let codes: Vec<u8> = (0..rows * cols).map(|i| (i * 13 % 0x7e) as u8).collect();
        for (rb, cb, dtype) in [
            (1, 64, DType::F8S),
            (2, 32, DType::F8S),
            (128, 128, DType::F8S),
            (1, 16, DType::F32),
        ] {
            let scales: Vec<f32> = (0..rows.div_ceil(rb) * cols.div_ceil(cb))
                .map(|i| 0.5 + i as f32)
                .collect();
            let m = Fp8Matrix {
                rows,
                cols,
                codes: &codes,
                row_block: rb,
                col_block: cb,
                scales,
            };
            let (got_type, bytes) = m.repack();
            assert_eq!(got_type, dtype);
            let got = values(got_type, &bytes, rows * cols);
            for (i, g) in got.iter().enumerate() {
                let (r, c) = (i / cols, i % cols);
                let s = m.scales[r / rb * cols.div_ceil(cb) + c / cb];
                assert_eq!(*g, qblocks::e4m3_to_f32(codes[i]) * s);
            }
        }
    }
}
