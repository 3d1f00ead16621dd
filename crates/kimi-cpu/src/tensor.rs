//! The CPU tensor: a shape and a host buffer.

use half::{bf16, f16};
use kimi_core::DType;
use kimi_ops::{Error, HostTensor, Result};

/// Element storage. Activations and states are always f32; weights keep their checkpoint
/// dtype so that decode reads half the bytes for bf16 checkpoints.
#[derive(Clone, Debug)]
pub enum Storage {
    /// Single precision.
    F32(Vec<f32>),
    /// bfloat16 bit patterns.
    Bf16(Vec<u16>),
    /// IEEE half bit patterns.
    F16(Vec<u16>),
}

/// A dense row-major tensor in host memory.
#[derive(Clone, Debug)]
pub struct CpuTensor {
    pub(crate) shape: Vec<usize>,
    pub(crate) storage: Storage,
}

impl CpuTensor {
    /// An f32 tensor; `data.len()` must equal the shape's product.
    pub fn f32(shape: &[usize], data: Vec<f32>) -> Result<Self> {
        let n: usize = shape.iter().product();
        if n != data.len() {
            return Err(Error::Shape {
                op: "from_f32",
                detail: format!("shape {shape:?} needs {n} values, got {}", data.len()),
            });
        }
        Ok(Self {
            shape: shape.to_vec(),
            storage: Storage::F32(data),
        })
    }

    /// Copies a checkpoint tensor, keeping its dtype.
    pub fn from_host(host: HostTensor<'_>) -> Result<Self> {
        let n: usize = host.shape.iter().product();
        let want = n * host.dtype.size_bytes();
        if host.bytes.len() != want {
            return Err(Error::Shape {
                op: "upload",
                detail: format!(
                    "shape {:?} of {} needs {want} bytes, got {}",
                    host.shape,
                    host.dtype,
                    host.bytes.len()
                ),
            });
        }
        let halves = || -> Vec<u16> {
            host.bytes
                .chunks_exact(2)
                .map(|b| u16::from_le_bytes([b[0], b[1]]))
                .collect()
        };
        let storage = match host.dtype {
            DType::F32 => Storage::F32(
                host.bytes
                    .chunks_exact(4)
                    .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                    .collect(),
            ),
            DType::BF16 => Storage::Bf16(halves()),
            DType::F16 => Storage::F16(halves()),
            other => return Err(Error::Unsupported(format!("dtype {other}"))),
        };
        Ok(Self {
            shape: host.shape.to_vec(),
            storage,
        })
    }

    /// Dimensions, outermost first.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        self.shape.iter().product()
    }

    /// True for a tensor with no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The f32 data of an activation, or an error for a half-precision tensor.
    pub(crate) fn as_f32(&self, op: &'static str) -> Result<&[f32]> {
        match &self.storage {
            Storage::F32(v) => Ok(v),
            _ => Err(Error::Shape {
                op,
                detail: "expected an f32 tensor".into(),
            }),
        }
    }

    pub(crate) fn as_f32_mut(&mut self, op: &'static str) -> Result<&mut Vec<f32>> {
        match &mut self.storage {
            Storage::F32(v) => Ok(v),
            _ => Err(Error::Shape {
                op,
                detail: "expected an f32 tensor".into(),
            }),
        }
    }

    /// All elements converted to f32.
    pub fn to_f32_vec(&self) -> Vec<f32> {
        match &self.storage {
            Storage::F32(v) => v.clone(),
            Storage::Bf16(v) => v.iter().map(|&b| bf16::from_bits(b).to_f32()).collect(),
            Storage::F16(v) => v.iter().map(|&b| f16::from_bits(b).to_f32()).collect(),
        }
    }

    /// Bytes of the storage.
    pub fn size_bytes(&self) -> usize {
        match &self.storage {
            Storage::F32(v) => v.len() * 4,
            Storage::Bf16(v) | Storage::F16(v) => v.len() * 2,
        }
    }

    /// `[rows, cols]` of a matrix-shaped tensor (leading dimensions folded into rows).
    pub(crate) fn rows_cols(&self, op: &'static str) -> Result<(usize, usize)> {
        match self.shape.as_slice() {
            [] => Err(Error::Shape {
                op,
                detail: "scalar given where a matrix is needed".into(),
            }),
            [n] => Ok((1, *n)),
            [lead @ .., last] => Ok((lead.iter().product(), *last)),
        }
    }
}

/// Converts one row of any storage to f32 into `out`.
pub(crate) fn row_to_f32(storage: &Storage, offset: usize, out: &mut [f32]) {
    let n = out.len();
    match storage {
        Storage::F32(v) => out.copy_from_slice(&v[offset..offset + n]),
        Storage::Bf16(v) => {
            for (o, &b) in out.iter_mut().zip(&v[offset..offset + n]) {
                *o = f32::from_bits((b as u32) << 16);
            }
        }
        Storage::F16(v) => {
            for (o, &b) in out.iter_mut().zip(&v[offset..offset + n]) {
                *o = f16::from_bits(b).to_f32();
            }
        }
    }
}

pub(crate) fn shape_err(op: &'static str, detail: String) -> Error {
    Error::Shape { op, detail }
}
