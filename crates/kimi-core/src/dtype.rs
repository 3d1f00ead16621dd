use std::fmt;

/// Element type of a stored tensor.
///
/// Besides the plain float types there are ggml's block-quantized types (as stored in GGUF
/// files): a block of [`DType::block_size`] consecutive values of a row is stored in
/// [`DType::block_bytes`] bytes (layouts: `block_*` structs of ggml's `ggml-common.h`). A
/// quantized matrix's rows are whole blocks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
#[allow(non_camel_case_types)] // the ggml names
pub enum DType {
    /// IEEE 754 single precision.
    F32,
    /// IEEE 754 half precision.
    F16,
    /// bfloat16: the upper 16 bits of an f32.
    BF16,
    /// ggml Q8_0: 32 values as an f16 scale and 32 `i8`.
    Q8_0,
    /// ggml Q4_0: 32 values as an f16 scale and 32 nibbles (offset 8).
    Q4_0,
    /// ggml Q4_1: 32 values as an f16 scale, an f16 minimum and 32 nibbles.
    Q4_1,
    /// ggml Q5_0: 32 values as an f16 scale and 32 five-bit levels (offset 16).
    Q5_0,
    /// ggml Q5_1: 32 values as an f16 scale, an f16 minimum and 32 five-bit levels.
    Q5_1,
    /// ggml Q4_K: 256-value super-block of eight 32-value sub-blocks with 6-bit scales and mins.
    Q4_K,
    /// ggml Q5_K: as Q4_K with five-bit levels.
    Q5_K,
    /// ggml Q6_K: 256-value super-block of sixteen 16-value sub-blocks with 8-bit scales.
    Q6_K,
    /// ggml MXFP4 (OCP microscaling FP4): 32 values as one E8M0 scale byte `e` and 16 bytes
    /// of E2M1 codes, byte `j` holding value `j` (low nibble) and `j + 16` (high nibble);
    /// `x = e2m1(code) · 2^(e − 127)`. Kimi K3's checkpoints store the same values as two
    /// planes (codes with the even column in the low nibble, then scales); the loader
    /// repacks them into these blocks.
    MXFP4,
    /// Raw bytes (`U8` in safetensors): the planes of packed weights before repacking.
    U8,
    /// E8M0 scale bytes (`F8_E8M0` in safetensors, as some quantizers write MXFP4 scales).
    E8M0,
    /// Signed bytes (`I8` in safetensors): unpacked integer codes or zero points.
    I8,
    /// Little-endian `i32` (`I32`): packed integer codes, zero points, GPTQ's `g_idx`.
    I32,
    /// Little-endian `i64` (`I64`): compressed-tensors' `weight_shape`.
    I64,
    /// FP8 E4M3 (`F8_E4M3` in safetensors, the OCP "fn" variant: no infinities, NaN only at
    /// `S.1111.111`): FP8 weights before their scales are applied.
    F8E4M3,
    /// 4-bit integer codes with an f32 scale and zero point per 32 values
    /// ([`crate::qblocks`]): `d:f32 | z:f32 | qs[16]`, nibbles in ggml's order (value `j`
    /// in the low nibble of byte `j`, value `j + 16` in the high one), `x = (q − z) · d`.
    /// The loader repacks AWQ, GPTQ and compressed-tensors INT4 weights of any group size
    /// that is a multiple of 32 into it, values unchanged.
    Q4Z,
    /// 8-bit integer codes with an f32 scale and zero point per 32 values:
    /// `d:f32 | z:f32 | qs:u8[32]`, `x = (q − z) · d` (INT8 weights of those formats).
    Q8Z,
    /// FP8 E4M3 codes with an f32 scale per 32 values: `d:f32 | q:e4m3[32]`,
    /// `x = e4m3(q) · d` (per-tensor, per-channel and 128 × 128 block-scaled FP8 weights).
    F8S,
}

impl DType {
    /// `(elements per block, bytes per block)`.
    fn block(self) -> (usize, usize) {
        match self {
            DType::F32 => (1, 4),
            DType::F16 | DType::BF16 => (1, 2),
            DType::Q8_0 => (32, 2 + 32),
            DType::Q4_0 => (32, 2 + 16),
            DType::Q4_1 => (32, 4 + 16),
            DType::Q5_0 => (32, 2 + 4 + 16),
            DType::Q5_1 => (32, 4 + 4 + 16),
            DType::Q4_K => (256, 4 + 12 + 128),
            DType::Q5_K => (256, 4 + 12 + 32 + 128),
            DType::Q6_K => (256, 128 + 64 + 16 + 2),
            DType::MXFP4 => (32, 1 + 16),
            DType::U8 | DType::E8M0 | DType::I8 | DType::F8E4M3 => (1, 1),
            DType::I32 => (1, 4),
            DType::I64 => (1, 8),
            DType::Q4Z => (32, 8 + 16),
            DType::Q8Z => (32, 8 + 32),
            DType::F8S => (32, 4 + 32),
        }
    }

    /// Bytes per element for the plain types (F32, F16, BF16); for a block-quantized type,
    /// bytes per block (the same as [`DType::block_bytes`]). Use [`DType::storage_bytes`]
    /// to size a buffer of any type.
    pub fn size_bytes(self) -> usize {
        self.block().1
    }

    /// Elements per storage block: 1 for plain types, 32 for the Q4/Q5/Q8 types, 256 for
    /// the k-quants.
    pub fn block_size(self) -> usize {
        self.block().0
    }

    /// Bytes per storage block (per element for plain types).
    pub fn block_bytes(self) -> usize {
        self.block().1
    }

    /// Bytes that `num_elements` values occupy, or `None` when they are not a whole number
    /// of blocks or the size overflows.
    pub fn storage_bytes(self, num_elements: usize) -> Option<usize> {
        let (block, bytes) = self.block();
        if !num_elements.is_multiple_of(block) {
            return None;
        }
        (num_elements / block).checked_mul(bytes)
    }

    /// Whether this is a block-quantized type.
    pub fn is_quantized(self) -> bool {
        self.block_size() > 1
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            DType::F32 => "f32",
            DType::F16 => "f16",
            DType::BF16 => "bf16",
            DType::Q8_0 => "q8_0",
            DType::Q4_0 => "q4_0",
            DType::Q4_1 => "q4_1",
            DType::Q5_0 => "q5_0",
            DType::Q5_1 => "q5_1",
            DType::Q4_K => "q4_k",
            DType::Q5_K => "q5_k",
            DType::Q6_K => "q6_k",
            DType::MXFP4 => "mxfp4",
            DType::U8 => "u8",
            DType::E8M0 => "e8m0",
            DType::I8 => "i8",
            DType::I32 => "i32",
            DType::I64 => "i64",
            DType::F8E4M3 => "f8_e4m3",
            DType::Q4Z => "q4z",
            DType::Q8Z => "q8z",
            DType::F8S => "f8s",
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn block_sizes_match_ggml() {
        assert_eq!(DType::F32.size_bytes(), 4);
        assert_eq!(DType::BF16.size_bytes(), 2);
        assert_eq!(DType::F16.storage_bytes(3), Some(6));
        assert_eq!(DType::Q8_0.storage_bytes(64), Some(68));
        assert_eq!(DType::Q4_1.storage_bytes(576), Some(18 * 20));
        assert_eq!(DType::Q4_K.block_bytes(), 144);
        assert_eq!(DType::Q5_K.block_bytes(), 176);
        assert_eq!(DType::Q6_K.block_bytes(), 210);
        assert_eq!(DType::Q4_K.storage_bytes(100), None);
        assert_eq!(DType::F32.storage_bytes(usize::MAX), None);
        assert!(DType::Q4_0.is_quantized() && !DType::BF16.is_quantized());
        // A K3 expert's gate matrix: 3072 rows of 3584 values at 4.25 bits.
        assert_eq!(
            DType::MXFP4.storage_bytes(3072 * 3584),
            Some(3072 * 3584 / 32 * 17)
        );
        assert!(DType::MXFP4.is_quantized() && !DType::U8.is_quantized());
    }
}
