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
    /// (for the types kept in planes, of their device layout).
    pub(crate) fn len_bytes(&self) -> usize {
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

/// Kernel dtype code: 0 = f32, 1 = bf16, 2 = f16.
pub(crate) fn dtype_code(dtype: DType) -> Option<i32> {
    match dtype {
        DType::F32 => Some(0),
        DType::BF16 => Some(1),
        DType::F16 => Some(2),
        _ => None,
    }
}
