//! The CPU tensor: a shape and a host buffer.

use half::{bf16, f16};
use kimi_core::DType;
use kimi_ops::{Error, HostTensor, Result};

use crate::arena::WeightBuf;
use crate::qdot::{groups, Kind};

/// Element storage. Activations and states are always f32; weights keep their checkpoint
/// dtype so that decode reads half the bytes for bf16 checkpoints.
#[derive(Clone, Debug)]
pub enum Storage {
    /// Single precision.
    F32(Vec<f32>),
    /// bfloat16 bit patterns.
    Bf16(WeightBuf<u16>),
    /// IEEE half bit patterns.
    F16(WeightBuf<u16>),
    /// ggml blocks of a quantized type (`dtype.is_quantized()`), row-major; every row is a
    /// whole number of blocks.
    Quant {
        /// The block type.
        dtype: DType,
        /// The blocks, `dtype.storage_bytes(len)` bytes.
        bytes: WeightBuf<u8>,
        /// `Some(cols)` where the rows (of `cols` values) are interleaved in groups of 16
        /// for the x86 kernels (`crate::qdot::groups`), `None` where they are row-major.
        grouped: Option<usize>,
    },
    /// A cache pool in FP8 E4M3 (`--kv-cache-dtype fp8`, `crate::fp8_cache`): each row of
    /// the last dimension is two f32 scales (values `..split` and `split..`) and one E4M3
    /// byte per value.
    Fp8Rows {
        /// `rows × (8 + width)` bytes.
        bytes: Vec<u8>,
        /// Where the second scale's values start (MLA: the latent's rank, so that the
        /// normalised latent and the rope key each get their own).
        split: usize,
    },
}

/// A dense row-major tensor in host memory.
#[derive(Clone, Debug)]
pub struct CpuTensor {
    pub(crate) shape: Vec<usize>,
    pub(crate) storage: Storage,
}

impl CpuTensor {
    /// A tensor of `storage` shaped `shape` (sizes checked by the caller).
    pub(crate) fn new(shape: Vec<usize>, storage: Storage) -> Self {
        Self { shape, storage }
    }

    /// An f32 tensor; `data.len()` must equal the shape's product.
    pub fn f32(shape: &[usize], data: Vec<f32>) -> Result<Self> {
        let n: usize = shape.iter().product();
        if n != data.len() {
            return Err(Error::Shape {
                op: "from_f32",
                detail: format!("shape {shape:?} needs {n} values, got {}", data.len()),
            });
        }
        Ok(Self::new(shape.to_vec(), Storage::F32(data)))
    }

    /// An f16 tensor of zeros.
    pub fn f16_zeros(shape: &[usize]) -> Self {
        Self::new(
            shape.to_vec(),
            Storage::F16(vec![0; shape.iter().product()].into()),
        )
    }

    /// An f32 tensor of zeros, or [`Error::OutOfMemory`] when the shape's size overflows or
    /// the allocator refuses it (pool sizes come from flags: no abort, no overflow).
    pub fn try_f32_zeros(shape: &[usize]) -> Result<Self> {
        let n = checked_len(shape);
        let data = n
            .and_then(crate::arena::try_zeroed_vec::<f32>)
            .ok_or_else(|| {
                Error::out_of_memory(format!("an f32 tensor of shape {shape:?}"), n, 4)
            })?;
        Ok(Self::new(shape.to_vec(), Storage::F32(data)))
    }

    /// [`Self::try_f32_zeros`] in f16.
    pub fn try_f16_zeros(shape: &[usize]) -> Result<Self> {
        let n = checked_len(shape);
        let data = n
            .and_then(crate::arena::WeightBuf::<u16>::try_zeroed)
            .ok_or_else(|| {
                Error::out_of_memory(format!("an f16 tensor of shape {shape:?}"), n, 2)
            })?;
        Ok(Self::new(shape.to_vec(), Storage::F16(data)))
    }

    /// Copies a checkpoint tensor, keeping its dtype. A block-quantized tensor's last
    /// dimension must be a whole number of blocks.
    pub fn from_host(host: HostTensor<'_>) -> Result<Self> {
        Self::from_host_with(host, true)
    }

    /// [`Self::from_host`], interleaving block-quantized rows for the integer kernels only
    /// where `interleave` says (a backend that multiplies dequantized f32 weights keeps
    /// them row-major: it would only widen them back).
    pub fn from_host_with(host: HostTensor<'_>, interleave: bool) -> Result<Self> {
        Self::from_host_in(host, interleave, None)
    }

    /// [`Self::from_host_with`], with bf16/f16 and block-quantized values in `file` where one
    /// is given (f32 values stay in memory: only test checkpoints store experts in f32).
    pub(crate) fn from_host_in(
        host: HostTensor<'_>,
        interleave: bool,
        file: Option<&crate::weight_file::WeightFile>,
    ) -> Result<Self> {
        let n: usize = host.shape.iter().product();
        let cols = host.shape.last().copied().unwrap_or(1);
        if !cols.is_multiple_of(host.dtype.block_size()) {
            return Err(Error::Shape {
                op: "upload",
                detail: format!(
                    "rows of {} values are not whole {}-value blocks of {}",
                    cols,
                    host.dtype.block_size(),
                    host.dtype
                ),
            });
        }
        let want = host.dtype.storage_bytes(n).unwrap_or(usize::MAX);
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
        // The integer kernels take checkpoints' Q4Z/Q8Z blocks as Q4_1/Q8_0.
        let converted = match interleave {
            true => crate::to_ggml::convert(host.dtype, host.bytes),
            false => None,
        };
        let host = match &converted {
            Some((dtype, bytes)) => HostTensor {
                shape: host.shape,
                dtype: *dtype,
                bytes,
            },
            None => host,
        };
        let halves = || -> Result<WeightBuf<u16>> {
            let values = host
                .bytes
                .chunks_exact(2)
                .map(|b| u16::from_le_bytes([b[0], b[1]]));
            WeightBuf::try_from_values_in(host.bytes.len() / 2, values, file)
        };
        let storage = match host.dtype {
            DType::F32 => Storage::F32(
                host.bytes
                    .chunks_exact(4)
                    .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                    .collect(),
            ),
            DType::BF16 => Storage::Bf16(halves()?),
            DType::F16 => Storage::F16(halves()?),
            q if crate::quant::supported(q) => {
                let rows = n.checked_div(cols).unwrap_or(0);
                match Kind::of(q).filter(|&kind| interleave && groups::wanted(kind, rows)) {
                    Some(kind) => {
                        let mut bytes = groups::interleave(kind, host.bytes, cols);
                        if file.is_some() {
                            bytes = WeightBuf::try_from_values_in(
                                bytes.len(),
                                bytes.iter().copied(),
                                file,
                            )?;
                        }
                        Storage::Quant {
                            dtype: q,
                            bytes,
                            grouped: Some(cols),
                        }
                    }
                    None => Storage::Quant {
                        dtype: q,
                        bytes: WeightBuf::try_from_values_in(
                            host.bytes.len(),
                            host.bytes.iter().copied(),
                            file,
                        )?,
                        grouped: None,
                    },
                }
            }
            other => return Err(Error::Unsupported(format!("dtype {other}"))),
        };
        Ok(Self::new(host.shape.to_vec(), storage))
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
            Storage::Quant { .. } | Storage::Fp8Rows { .. } => {
                let mut out = vec![0f32; self.len()];
                let width = self.shape.last().copied().unwrap_or(1);
                match &self.storage {
                    Storage::Fp8Rows { bytes, split } => {
                        crate::fp8_cache::dequantize_rows(bytes, width, *split, &mut out)
                    }
                    _ => row_to_f32(&self.storage, 0, &mut out),
                }
                out
            }
        }
    }

    /// The values as f32, borrowed where they are stored so (weights read on every step,
    /// such as MLA's `kv_b` or norm weights, are not copied each time), else converted.
    pub(crate) fn f32_values(&self) -> std::borrow::Cow<'_, [f32]> {
        match &self.storage {
            Storage::F32(v) => std::borrow::Cow::Borrowed(v),
            _ => std::borrow::Cow::Owned(self.to_f32_vec()),
        }
    }

    /// Bytes of the storage.
    pub fn size_bytes(&self) -> usize {
        match &self.storage {
            Storage::F32(v) => v.len() * 4,
            Storage::Bf16(v) | Storage::F16(v) => v.len() * 2,
            Storage::Quant { bytes, .. } => bytes.len(),
            Storage::Fp8Rows { bytes, .. } => bytes.len(),
        }
    }

    /// The tensor as [`kimi_ops::Backend::upload`] took it: its dtype and stored
    /// little-endian bytes, or `None` where the storage is rearranged (rows interleaved for
    /// the int8 kernels) or the machine is big-endian.
    pub fn stored(&self) -> Option<HostTensor<'_>> {
        if cfg!(target_endian = "big") {
            return None;
        }
        let (dtype, bytes): (DType, &[u8]) = match &self.storage {
            Storage::F32(v) => (DType::F32, as_bytes(v)),
            Storage::Bf16(v) => (DType::BF16, as_bytes(v)),
            Storage::F16(v) => (DType::F16, as_bytes(v)),
            Storage::Quant {
                dtype,
                bytes,
                grouped: None,
            } => (*dtype, bytes),
            Storage::Quant { .. } | Storage::Fp8Rows { .. } => return None,
        };
        Some(HostTensor {
            shape: &self.shape,
            dtype,
            bytes,
        })
    }

    /// The whole anonymous mapping this tensor's stored bytes were carved from, as
    /// `(start, len)` ([`crate::arena::WeightBuf::lockable_region`]); `None` for f32 and heap
    /// storage and for the disk tier's files.
    pub fn lockable_region(&self) -> Option<(usize, usize)> {
        match &self.storage {
            Storage::Bf16(v) | Storage::F16(v) => v.lockable_region(),
            Storage::Quant { bytes, .. } => bytes.lockable_region(),
            Storage::F32(_) | Storage::Fp8Rows { .. } => None,
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

/// Converts `out.len()` elements of any storage, starting at element `offset`, to f32. For
/// quantized storage `offset` and `out.len()` are whole blocks (rows are).
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
            // The slice conversion runs 8 values per F16C instruction where the CPU has it
            // (one call per value measured 70 % of an F16 model's decode time).
            use half::slice::{HalfBitsSliceExt, HalfFloatSliceExt};
            v[offset..offset + n]
                .reinterpret_cast::<f16>()
                .convert_to_f32_slice(out);
        }
        Storage::Quant {
            dtype,
            bytes,
            grouped: Some(cols),
        } => match Kind::of(*dtype) {
            Some(kind) => groups::dequantize(*dtype, kind, bytes, *cols, offset, out),
            None => debug_assert!(false, "invariant: only kernel kinds are interleaved"),
        },
        Storage::Fp8Rows { .. } => {
            debug_assert!(false, "invariant: cache pools are not multiplied");
            out.fill(f32::NAN);
        }
        Storage::Quant {
            dtype,
            bytes,
            grouped: None,
        } => {
            let (block, block_bytes) = (dtype.block_size(), dtype.block_bytes());
            debug_assert!(offset.is_multiple_of(block) && n.is_multiple_of(block));
            let start = offset / block * block_bytes;
            crate::quant::dequantize(*dtype, &bytes[start..start + n / block * block_bytes], out);
        }
    }
}

pub(crate) fn shape_err(op: &'static str, detail: String) -> Error {
    Error::Shape { op, detail }
}

/// The number of values of `shape`, if it fits a `usize` and the address space (as bytes of
/// the widest element, f32).
fn checked_len(shape: &[usize]) -> Option<usize> {
    let n = shape.iter().try_fold(1usize, |n, &d| n.checked_mul(d))?;
    (n <= isize::MAX as usize / 4).then_some(n)
}

/// The bytes of a slice of plain numbers (`u16`, `f32`), in memory order.
fn as_bytes<T: Copy>(v: &[T]) -> &[u8] {
    // SAFETY: `T` is `u16` or `f32` here: no padding, every byte initialised; the slice
    // covers exactly `size_of_val(v)` bytes of `v`'s allocation, borrowed for `v`'s
    // lifetime, and u8 has alignment 1.
    unsafe { std::slice::from_raw_parts(v.as_ptr().cast::<u8>(), std::mem::size_of_val(v)) }
}

#[cfg(test)]
mod alloc_tests {
    use super::*;

    #[test]
    fn impossible_zeros_are_errors_not_aborts() {
        for shape in [&[usize::MAX, 2][..], &[1 << 20, 1 << 20, 1 << 12]] {
            for f16 in [false, true] {
                let result = if f16 {
                    CpuTensor::try_f16_zeros(shape)
                } else {
                    CpuTensor::try_f32_zeros(shape)
                };
                let err = result.expect_err("no machine has this much memory");
                assert!(matches!(err, Error::OutOfMemory { .. }), "{err}");
                assert!(err.to_string().contains(&format!("{shape:?}")), "{err}");
            }
        }
        let t = CpuTensor::try_f16_zeros(&[3, 5]).expect("small");
        assert_eq!((t.shape(), t.to_f32_vec()), (&[3, 5][..], vec![0.0; 15]));
        let t = CpuTensor::try_f32_zeros(&[0, 7]).expect("empty");
        assert!(t.to_f32_vec().is_empty());
    }
}
