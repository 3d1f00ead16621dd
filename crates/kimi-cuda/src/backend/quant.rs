//! Weights kept packed on the device: Q4Z, Q8Z and F8S (AWQ / GPTQ / compressed-tensors
//! INT4 and INT8, FP8) and ggml's Q4_0, Q4_1, Q8_0 and Q4_K (GGUF files): their upload
//! into the planes of [`crate::quant_layout`], widening, and their products. `impl Backend` in `backend.rs` delegates here.
//!
//! A product of a few activation rows (decode) streams the packed blocks through
//! `quant_gemv_*`; more rows (prefill) widen the matrix to a bf16 scratch once per call
//! and take the bf16 cuBLAS path, which rounds each weight to bf16 (~1e-3 relative error
//! per product). A tensor-core GEMM that widens the blocks in registers instead is a later
//! step.

use std::collections::HashMap;
use std::sync::Arc;

use kimi_core::DType;
use kimi_ops::{Error, HostTensor, Result};

use super::{f32_rows, shape_err, CudaBackend};
use crate::ops;
use crate::quant_layout::{device_planes, format_code};
use crate::tensor::CudaTensor;

/// Widened copies of packed matrices by (address, shape): the packed tensor, held so that
/// its address cannot be reused by another while the copy stands, and its bf16 copy.
pub(super) type PlainCopies = HashMap<(u64, Vec<usize>), (CudaTensor, CudaTensor)>;

/// Whether `dtype` is one of the block types kept in planes on the device.
pub(super) fn is_planar(dtype: DType) -> bool {
    format_code(dtype).is_some()
}

impl CudaBackend {
    /// The device planes of a `[rows, cols]` matrix of stored blocks, or a shape error.
    pub(super) fn quant_planes(host: &HostTensor<'_>) -> Result<Vec<u8>> {
        Self::check_quant_blocks(host)?;
        device_planes(host.dtype, host.bytes).ok_or_else(|| {
            shape_err(
                "upload",
                format!("{} bytes are not whole blocks", host.dtype),
            )
        })
    }

    /// Whether `host` is a `[rows, cols]` matrix of whole stored blocks, or a shape error.
    pub(super) fn check_quant_blocks(host: &HostTensor<'_>) -> Result<()> {
        let n: usize = host.shape.iter().product();
        let cols = host.shape.last().copied().unwrap_or(0);
        let want = host.dtype.storage_bytes(n);
        let block = host.dtype.block_size();
        if host.shape.len() != 2 || !cols.is_multiple_of(block) || want != Some(host.bytes.len()) {
            return Err(shape_err(
                "upload",
                format!(
                    "{} matrix {:?} (rows of whole {block}-value blocks) needs {want:?} bytes, got {}",
                    host.dtype,
                    host.shape,
                    host.bytes.len()
                ),
            ));
        }
        Ok(())
    }

    /// A weight of a type kept packed, from its stored blocks, into the device planes.
    pub(super) fn upload_quant(&self, host: &HostTensor<'_>) -> Result<CudaTensor> {
        let planes = Self::quant_planes(host)?;
        self.dev.enter("upload")?;
        Ok(CudaTensor {
            shape: host.shape.to_vec(),
            dtype: host.dtype,
            buf: Arc::new(self.dev.upload_kept(&planes, "upload")?),
            offset: 0,
        })
    }

    /// A packed matrix widened to a new bf16 (`to` = BF16) or f32 tensor on the device.
    pub(super) fn widen_quant(
        &self,
        w: &CudaTensor,
        to: DType,
        op: &'static str,
    ) -> Result<CudaTensor> {
        let (rows, cols) = match w.shape.as_slice() {
            [r, c] => (*r, *c),
            _ => return Err(shape_err(op, format!("{} tensor {:?}", w.dtype, w.shape))),
        };
        let out = self.empty(&[rows, cols], to, op)?;
        // SAFETY: w is a [rows, cols] matrix of its dtype in the device planes (uploaded by
        // upload_quant, cols % 32 == 0); out is a fresh (aligned) buffer of rows*cols values
        // of `to`.
        unsafe {
            ops::quant::widen(
                &self.dev,
                op,
                w.dtype,
                w.ptr(),
                out.ptr(),
                to == DType::BF16,
                rows,
                cols,
            )?
        };
        Ok(out)
    }

    /// `x · wᵀ` for a packed `w`, split into blocks of `rows` output columns as
    /// [`Self::matmul_blocks`]: the streaming GEMV for up to 8 aligned activation rows, else
    /// the bf16 GEMMs on the widened matrix.
    pub(super) fn matmul_quant(
        &self,
        x: &CudaTensor,
        w: &CudaTensor,
        rows: &[usize],
        op: &'static str,
    ) -> Result<Vec<CudaTensor>> {
        let (n, k) = f32_rows(x, op)?;
        let (o, wk) = match w.shape.as_slice() {
            [o, wk] => (*o, *wk),
            _ => {
                return Err(shape_err(
                    op,
                    format!("weight {:?} is not a matrix", w.shape),
                ))
            }
        };
        // Any f32 activations (a one-row view at any column included): the kernel stages
        // them with vector loads where they are 16-byte aligned, else with scalar ones.
        let gemv = (1..=ops::quant::GEMV_MAX_ROWS).contains(&n)
            && k == wk
            && k.is_multiple_of(32)
            && rows.iter().sum::<usize>() == o
            && x.ptr().is_multiple_of(4);
        if !gemv {
            // Checks the shapes, then cuBLAS on the widened matrix.
            return self.matmul_blocks(x, &self.widen_quant(w, DType::BF16, op)?, rows, op);
        }
        let y = self.empty(&[n, o], DType::F32, op)?;
        let cfg = self.kernel_config();
        // SAFETY: w is an [o, k] matrix of its dtype in the device planes (k % 32 == 0); x
        // holds n <= 8 rows of k f32 at a 4-byte aligned address; y holds n*o f32.
        unsafe { ops::quant::gemv(&self.dev, &cfg, w.dtype, x.ptr(), w.ptr(), y.ptr(), n, k, o)? };
        if rows.len() == 1 {
            Ok(vec![y])
        } else {
            kimi_ops::Backend::split_cols(self, &y, rows)
        }
    }

    /// `w` widened to bf16 when it is packed (for the ops whose kernels read plain weights:
    /// MLA's decompression), made once per matrix and kept (a decode step widened every MLA
    /// layer's matrix again: 5.7 us and 3 MB of reads a layer); `None` when it is already
    /// plain.
    pub(super) fn plain_copy(
        &self,
        w: &CudaTensor,
        op: &'static str,
    ) -> Result<Option<CudaTensor>> {
        if !is_planar(w.dtype) {
            return Ok(None);
        }
        let key = (w.ptr(), w.shape.clone());
        let mut copies = self
            .plain_copies
            .lock()
            .map_err(|_| Error::Unsupported("plain copy lock poisoned".into()))?;
        if let Some((_, plain)) = copies.get(&key) {
            return Ok(Some(plain.share()));
        }
        // Kept across passes: made outside a recorded pass, so never in its arena.
        let plain = self
            .dev
            .outside_pass(op, || self.widen_quant(w, DType::BF16, op))?;
        let out = plain.share();
        copies.insert(key, (w.share(), plain));
        Ok(Some(out))
    }
}
