//! The device tensor: a shape, a dtype and a place in a device buffer, which it may share
//! with other tensors (the column blocks of a one-row matrix are views of it, see
//! `split_cols`).
//!
//! ```text
//!  buf: |<------------------ buffer bytes ------------------>|
//!       | offset |<- shape.product() * dtype size ->|  spare  |
//! ```

use kimi_core::DType;

use std::sync::Arc;

use crate::buffer::DevBuf;

/// A dense row-major tensor in device memory.
pub struct CudaTensor {
    pub(crate) shape: Vec<usize>,
    pub(crate) dtype: DType,
    pub(crate) buf: Arc<DevBuf>,
    /// Bytes from the start of `buf` to the first element.
    pub(crate) offset: usize,
}

impl std::fmt::Debug for CudaTensor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaTensor")
            .field("shape", &self.shape)
            .field("dtype", &self.dtype)
            .field("capacity_bytes", &self.capacity_bytes())
            .finish()
    }
}

impl CudaTensor {
    /// Another handle on the same device memory (the buffer is shared, not copied).
    pub(crate) fn share(&self) -> CudaTensor {
        CudaTensor {
            shape: self.shape.clone(),
            dtype: self.dtype,
            buf: self.buf.clone(),
            offset: self.offset,
        }
    }

    /// Dimensions, outermost first.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// Element type.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        self.shape.iter().product()
    }

    /// True for a tensor with no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Bytes of the elements (not the capacity); for a block-quantized tensor, of its blocks
    /// (for the types kept in planes, of their device layout); for an FP8 latent pool, of
    /// its rows.
    pub(crate) fn len_bytes(&self) -> usize {
        if self.dtype == DType::F8E4M3 {
            return fp8_rows_bytes(&self.shape).unwrap_or(usize::MAX);
        }
        let n = self.len();
        if let Some(b) = crate::quant_layout::device_bytes(self.dtype, n) {
            return b;
        }
        self.dtype
            .storage_bytes(n)
            .unwrap_or(n * self.dtype.size_bytes())
    }

    /// The raw device address of the first element.
    pub(crate) fn ptr(&self) -> u64 {
        self.buf.ptr() + self.offset as u64
    }

    /// Bytes from the first element to the end of the buffer.
    pub(crate) fn capacity_bytes(&self) -> usize {
        self.buf.len() - self.offset
    }

    /// `[rows, cols]` with leading dimensions folded into rows.
    pub(crate) fn rows_cols(&self) -> Option<(usize, usize)> {
        match self.shape.as_slice() {
            [] => None,
            [n] => Some((1, *n)),
            [lead @ .., last] => Some((lead.iter().product(), *last)),
        }
    }
}

/// Bytes of an FP8 latent pool of `shape` `[.., width]`: each row two f32 scales and `width`
/// E4M3 codes (`kernels/mla_fp8.cu`, the CPU's `fp8_cache` layout). The backend makes
/// tensors of [`DType::F8E4M3`] only as such pools (`upload` refuses the type).
pub(crate) fn fp8_rows_bytes(shape: &[usize]) -> Option<usize> {
    let (&width, lead) = shape.split_last()?;
    let rows = lead.iter().try_fold(1usize, |n, &d| n.checked_mul(d))?;
    width.checked_add(8)?;
    rows.checked_mul(kimi_ops::KvCacheDtype::Fp8.latent_row_bytes(width))
}

/// Kernel dtype code: 0 = f32, 1 = bf16, 2 = f16.
pub(crate) fn dtype_code(dtype: DType) -> Option<i32> {
    match dtype {
        DType::F32 => Some(0),
        DType::BF16 => Some(1),
        DType::F16 => Some(2),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fp8_rows_take_eight_bytes_more_than_their_width() {
        assert_eq!(fp8_rows_bytes(&[3, 16, 576]), Some(3 * 16 * 584));
        assert_eq!(fp8_rows_bytes(&[2, 5, 7]), Some(2 * 5 * 15));
        assert_eq!(fp8_rows_bytes(&[]), None);
        assert_eq!(fp8_rows_bytes(&[usize::MAX, 2, 8]), None);
    }
}
