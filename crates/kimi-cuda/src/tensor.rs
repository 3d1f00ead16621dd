//! The device tensor: a shape, a dtype and a device buffer that may be larger than the
//! tensor (MLA caches grow by appending rows into spare capacity).
//!
//! ```text
//!  buf: |<------------- capacity bytes ------------->|
//!       |<- shape.product() * dtype size ->|  spare  |
//! ```

use kimi_core::DType;

use crate::buffer::DevBuf;

/// A dense row-major tensor in device memory.
pub struct CudaTensor {
    pub(crate) shape: Vec<usize>,
    pub(crate) dtype: DType,
    pub(crate) buf: DevBuf,
}

impl std::fmt::Debug for CudaTensor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaTensor")
            .field("shape", &self.shape)
            .field("dtype", &self.dtype)
            .field("capacity_bytes", &self.buf.len())
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

    /// Bytes of the elements (not the capacity).
    pub(crate) fn len_bytes(&self) -> usize {
        self.len() * self.dtype.size_bytes()
    }

    /// The raw device address of the first element.
    pub(crate) fn ptr(&self) -> u64 {
        self.buf.ptr()
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
