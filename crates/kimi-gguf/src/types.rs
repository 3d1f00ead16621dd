//! ggml tensor types: ids, block sizes and block byte sizes.

use std::fmt;

/// The ggml element type of a tensor, with the ids GGUF stores (`enum ggml_type` in ggml's
/// `ggml.h`; ids 4, 5 and 31-33, 36-38 were removed upstream and are not accepted).
///
/// Every type here can be read from a file (its size is known). Which ones can be
/// dequantized or quantized: [`GgmlType::can_dequantize`], [`GgmlType::can_quantize`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
#[allow(missing_docs, non_camel_case_types)] // names and meanings are ggml's
pub enum GgmlType {
    F32,
    F16,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    Q8_1,
    Q2_K,
    Q3_K,
    Q4_K,
    Q5_K,
    Q6_K,
    Q8_K,
    IQ2_XXS,
    IQ2_XS,
    IQ3_XXS,
    IQ1_S,
    IQ4_NL,
    IQ3_S,
    IQ2_S,
    IQ4_XS,
    I8,
    I16,
    I32,
    I64,
    F64,
    IQ1_M,
    BF16,
    TQ1_0,
    TQ2_0,
    MXFP4,
    NVFP4,
    Q1_0,
}

/// Elements in one k-quant super-block (`QK_K` in ggml).
pub const QK_K: usize = 256;

/// `(type, id, name, elements per block, bytes per block)`, one row per type in declaration
/// order. Block sizes follow the `block_*` structs of ggml's `ggml-common.h`.
const TABLE: [(GgmlType, u32, &str, usize, usize); 34] = [
    (GgmlType::F32, 0, "F32", 1, 4),
    (GgmlType::F16, 1, "F16", 1, 2),
    (GgmlType::Q4_0, 2, "Q4_0", 32, 2 + 16),
    (GgmlType::Q4_1, 3, "Q4_1", 32, 4 + 16),
    (GgmlType::Q5_0, 6, "Q5_0", 32, 2 + 4 + 16),
    (GgmlType::Q5_1, 7, "Q5_1", 32, 4 + 4 + 16),
    (GgmlType::Q8_0, 8, "Q8_0", 32, 2 + 32),
    (GgmlType::Q8_1, 9, "Q8_1", 32, 4 + 32),
    (GgmlType::Q2_K, 10, "Q2_K", QK_K, 4 + 16 + 64),
    (GgmlType::Q3_K, 11, "Q3_K", QK_K, 2 + 64 + 32 + 12),
    (GgmlType::Q4_K, 12, "Q4_K", QK_K, 4 + 12 + 128),
    (GgmlType::Q5_K, 13, "Q5_K", QK_K, 4 + 12 + 32 + 128),
    (GgmlType::Q6_K, 14, "Q6_K", QK_K, 128 + 64 + 16 + 2),
    (GgmlType::Q8_K, 15, "Q8_K", QK_K, 4 + 256 + 32),
    (GgmlType::IQ2_XXS, 16, "IQ2_XXS", QK_K, 2 + 64),
    (GgmlType::IQ2_XS, 17, "IQ2_XS", QK_K, 2 + 64 + 8),
    (GgmlType::IQ3_XXS, 18, "IQ3_XXS", QK_K, 2 + 96),
    (GgmlType::IQ1_S, 19, "IQ1_S", QK_K, 2 + 32 + 16),
    (GgmlType::IQ4_NL, 20, "IQ4_NL", 32, 2 + 16),
    (GgmlType::IQ3_S, 21, "IQ3_S", QK_K, 2 + 104 + 4),
    (GgmlType::IQ2_S, 22, "IQ2_S", QK_K, 2 + 64 + 16),
    (GgmlType::IQ4_XS, 23, "IQ4_XS", QK_K, 2 + 2 + 4 + 128),
    (GgmlType::I8, 24, "I8", 1, 1),
    (GgmlType::I16, 25, "I16", 1, 2),
    (GgmlType::I32, 26, "I32", 1, 4),
    (GgmlType::I64, 27, "I64", 1, 8),
    (GgmlType::F64, 28, "F64", 1, 8),
    (GgmlType::IQ1_M, 29, "IQ1_M", QK_K, 32 + 16 + 8),
    (GgmlType::BF16, 30, "BF16", 1, 2),
    (GgmlType::TQ1_0, 34, "TQ1_0", QK_K, 2 + 4 + 48),
    (GgmlType::TQ2_0, 35, "TQ2_0", QK_K, 2 + 64),
    (GgmlType::MXFP4, 39, "MXFP4", 32, 1 + 16),
    (GgmlType::NVFP4, 40, "NVFP4", 64, 4 + 32),
    (GgmlType::Q1_0, 41, "Q1_0", 128, 2 + 16),
];

impl GgmlType {
    /// The type for a stored id, or `None` if the id is unknown.
    pub fn from_id(id: u32) -> Option<GgmlType> {
        TABLE.iter().find(|row| row.1 == id).map(|row| row.0)
    }

    fn row(self) -> &'static (GgmlType, u32, &'static str, usize, usize) {
        // Row i describes variant i (declaration order); `table_is_complete` checks it.
        &TABLE[self as usize]
    }

    /// The id GGUF stores.
    pub fn id(self) -> u32 {
        self.row().1
    }

    /// ggml's name (`Q4_K`, `BF16`, ...).
    pub fn name(self) -> &'static str {
        self.row().2
    }

    /// Elements per block (1 for plain types, 32 for `Q8_0`, 256 for k-quants).
    pub fn block_size(self) -> usize {
        self.row().3
    }

    /// Bytes per block.
    pub fn type_size(self) -> usize {
        self.row().4
    }

    /// Whether this is a block-quantized type (block size above 1).
    pub fn is_quantized(self) -> bool {
        self.block_size() > 1
    }

    /// Bytes of a row of `num_cols` elements, or `None` when `num_cols` is not a whole
    /// number of blocks or the size overflows `usize`.
    pub fn row_bytes(self, num_cols: usize) -> Option<usize> {
        if !num_cols.is_multiple_of(self.block_size()) {
            return None;
        }
        (num_cols / self.block_size()).checked_mul(self.type_size())
    }

    /// Whether [`crate::dequantize`] supports this type.
    pub fn can_dequantize(self) -> bool {
        crate::quant::supported(self)
    }

    /// Whether [`crate::quantize`] supports this type.
    pub fn can_quantize(self) -> bool {
        crate::quant::supported(self)
    }

    /// Every type, in id order.
    pub fn all() -> impl Iterator<Item = GgmlType> {
        TABLE.iter().map(|row| row.0)
    }
}

impl fmt::Display for GgmlType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_is_complete() {
        for (i, row) in TABLE.iter().enumerate() {
            assert_eq!(row.0 as usize, i);
            assert_eq!(GgmlType::from_id(row.1), Some(row.0));
            assert_eq!(row.0.id(), row.1);
            assert!(TABLE[..i].iter().all(|r| r.0 != row.0 && r.1 != row.1));
        }
        for removed in [4, 5, 31, 32, 33, 36, 37, 38, 42, u32::MAX] {
            assert_eq!(GgmlType::from_id(removed), None);
        }
    }

    #[test]
    fn sizes_match_ggml() {
        assert_eq!(GgmlType::Q4_K.type_size(), 144);
        assert_eq!(GgmlType::Q5_K.type_size(), 176);
        assert_eq!(GgmlType::Q6_K.type_size(), 210);
        assert_eq!(GgmlType::Q8_0.type_size(), 34);
        assert_eq!(GgmlType::Q4_1.row_bytes(576), Some(18 * 20));
        assert_eq!(GgmlType::Q4_K.row_bytes(100), None);
        assert_eq!(GgmlType::F32.row_bytes(usize::MAX), None);
    }
}
