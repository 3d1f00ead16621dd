//! FP8 MLA latent pools (`--kv-cache-dtype fp8`, [`KernelConfig::kv_cache`]): made by
//! `latent_zeros`, written and read by `mla` (`ops::mla_fp8`, `kernels/mla_fp8.cu`).
//!
//! A pool is a [`CudaTensor`] of [`DType::F8E4M3`] with the logical shape `[num_blocks,
//! block_size, width]` whose rows are `8 + width` bytes: the f32 scales of `c` and `k_pe`,
//! then the codes, as the CPU backend's `fp8_cache` keeps them, so both hold the same bytes
//! for the same latents and `serve`'s plan counts the same row size for either.

use std::sync::Arc;

use kimi_core::DType;
use kimi_ops::{Error, KvCacheDtype, Result};

use super::CudaBackend;
use crate::plan::KernelConfig;
use crate::tensor::{fp8_rows_bytes, CudaTensor};

impl CudaBackend {
    /// This backend with MLA latent pools made from now on stored as `dtype`
    /// ([`KernelConfig::kv_cache`]), as `CpuBackend::with_kv_cache_dtype`.
    pub fn with_kv_cache_dtype(self, dtype: KvCacheDtype) -> Self {
        let mut config: KernelConfig = self.kernel_config();
        config.kv_cache = dtype;
        // Only device-wide settings can fail to apply, and they are unchanged here.
        let _ = self.set_kernel_config(config);
        self
    }

    /// The raw rows of an FP8 latent pool (`8 + width` bytes each, in storage order): what
    /// `to_f32` cannot widen, since which columns take which scale is the mla op's (`r`).
    pub fn fp8_rows(&self, t: &CudaTensor) -> Result<Vec<u8>> {
        if t.dtype != DType::F8E4M3 {
            return Err(Error::Unsupported(format!(
                "fp8_rows of a {} tensor (not an FP8 latent pool)",
                t.dtype
            )));
        }
        self.dev.enter("fp8_rows")?;
        let mut host = vec![0u8; t.len_bytes()];
        // SAFETY: the pool's buffer holds len_bytes() bytes (made by `latent_zeros`).
        unsafe { self.dev.read(t.ptr(), &mut host, "fp8_rows")? };
        Ok(host)
    }

    /// A zeroed latent pool of `shape` in the configured storage (`latent_zeros`).
    pub(super) fn latent_pool(&self, shape: &[usize]) -> Result<CudaTensor> {
        match self.kernel_config().kv_cache {
            KvCacheDtype::Auto | KvCacheDtype::F32 => {
                self.dev.enter("latent_zeros")?;
                self.zeroed(shape, "latent_zeros")
            }
            KvCacheDtype::Fp8 => {
                let bytes = fp8_rows_bytes(shape).ok_or_else(|| {
                    Error::out_of_memory(format!("an FP8 cache of shape {shape:?}"), None, 1)
                })?;
                self.dev.enter("latent_zeros")?;
                // Zero scales and codes: a row never written reads as zeros.
                Ok(CudaTensor {
                    shape: shape.to_vec(),
                    dtype: DType::F8E4M3,
                    buf: Arc::new(self.dev.alloc_zeros(bytes, "latent_zeros")?),
                    offset: 0,
                })
            }
            KvCacheDtype::F16 => Err(Error::Unsupported(
                "an f16 MLA latent cache (--kv-cache-dtype f16 is for attention caches; \
                 MLA latent caches take auto, f32 or fp8)"
                    .into(),
            )),
        }
    }
}
