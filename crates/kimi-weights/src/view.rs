//! Borrowed views of stored tensors and their conversion to f32.

use std::fmt;
use std::path::Path;

use half::{bf16, f16};
use kimi_core::DType;

/// One tensor as stored: raw little-endian bytes borrowed from the memory-mapped shard.
///
/// `bytes` has no alignment guarantee (safetensors places tensors at any byte offset), so read
/// it through [`TensorView::to_f32_vec`] or byte-wise, never by casting the slice.
#[derive(Clone, Copy)]
pub struct TensorView<'a> {
    /// Name in the checkpoint.
    pub name: &'a str,
    /// The shard that holds it.
    pub file: &'a Path,
    /// Shape, outermost first.
    pub shape: &'a [usize],
    /// Element type.
    pub dtype: DType,
    /// The stored bytes, little-endian, row-major; `num_elements() * dtype.size_bytes()` long.
    pub bytes: &'a [u8],
}

impl TensorView<'_> {
    /// Number of elements (the product of the shape; 1 for a scalar). Saturates at
    /// `usize::MAX` for a hand-built view whose shape overflows.
    pub fn num_elements(&self) -> usize {
        self.shape
            .iter()
            .try_fold(1usize, |acc, &d| acc.checked_mul(d))
            .unwrap_or(usize::MAX)
    }

    /// Converts the elements to f32 (bf16 and f16 are widened exactly). Reads the bytes
    /// one element at a time, so any alignment works. Trailing bytes that do not form a whole
    /// element (only possible in a hand-built view) are ignored; a dtype other than F32, F16
    /// or BF16 (never returned by `Checkpoint::get`) gives an empty vector.
    pub fn to_f32_vec(&self) -> Vec<f32> {
        match self.dtype {
            DType::F32 => self
                .bytes
                .chunks_exact(4)
                .filter_map(le_array)
                .map(f32::from_le_bytes)
                .collect(),
            DType::F16 => self
                .bytes
                .chunks_exact(2)
                .filter_map(le_array)
                .map(|b| f16::from_bits(u16::from_le_bytes(b)).to_f32())
                .collect(),
            DType::BF16 => self
                .bytes
                .chunks_exact(2)
                .filter_map(le_array)
                .map(|b| bf16::from_bits(u16::from_le_bytes(b)).to_f32())
                .collect(),
            _ => Vec::new(),
        }
    }
}

impl fmt::Debug for TensorView<'_> {
    /// Prints the length of `bytes`, not the bytes (tensors can be gigabytes).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TensorView")
            .field("name", &self.name)
            .field("file", &self.file)
            .field("shape", &self.shape)
            .field("dtype", &self.dtype)
            .field("num_bytes", &self.bytes.len())
            .finish()
    }
}

/// A chunk of exactly `N` bytes as an array (`chunks_exact` guarantees the length).
fn le_array<const N: usize>(chunk: &[u8]) -> Option<[u8; N]> {
    chunk.try_into().ok()
}
