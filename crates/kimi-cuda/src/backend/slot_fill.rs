//! Expert slot fills ([`kimi_ops::Backend::upload_into`]): new contents for a device tensor
//! of the same shape, in place where it can be, from host memory that is often page-locked.

use std::sync::Arc;

use kimi_core::DType;
use kimi_ops::{Backend, HostTensor, Result};

use super::{quant, CudaBackend};
use crate::ops;
use crate::tensor::CudaTensor;

impl CudaBackend {
    /// [`Backend::upload_into`] (`ahead`: [`Backend::upload_into_ahead`], on the copy stream
    /// where the bytes go as they are; the forms laid out first stay in order on the main
    /// stream) once outside any recorded pass.
    pub(crate) fn fill_slot(
        &self,
        dst: &mut CudaTensor,
        host: HostTensor<'_>,
        ahead: bool,
    ) -> Result<()> {
        // In place where the buffer is this tensor's alone and takes the bytes (MXFP4 laid
        // out for the device first: on the host, or with `mxfp4_device_fills` by a kernel
        // after the copy); otherwise, or with `pin_host_experts` off, a new upload.
        let mxfp4 = host.dtype == DType::MXFP4;
        let same = self.kernel_config().pin_host_experts
            && dst.dtype == host.dtype
            && dst.shape == host.shape
            && dst.offset == 0
            && Arc::strong_count(&dst.buf) == 1;
        let fits = |len: usize| same && dst.len_bytes() == len;
        if quant::is_planar(host.dtype) {
            let n: usize = host.shape.iter().product();
            let device_len = crate::quant_layout::device_bytes(host.dtype, n);
            if self.kernel_config().packed_device_fills
                && Self::check_quant_blocks(&host).is_ok()
                && device_len.is_some_and(fits)
            {
                // The stored blocks cross the link as they are (by DMA from a locked host
                // store) and are laid out in the planes on the device.
                let staging = self.raw(host.bytes.len(), "expert slot fill")?;
                // SAFETY: `staging` holds the stored blocks' bytes (a fresh allocation:
                // aligned), freed in stream order after the kernel below has read them;
                // `dst` was uploaded by `upload_quant` at this shape and dtype, so it holds
                // `device_bytes(dtype, n)` bytes; a locked source stays unwritten while
                // locked.
                return unsafe {
                    self.dev
                        .copy_from_host(staging.ptr(), host.bytes, "expert slot fill")?;
                    ops::quant::from_blocks(&self.dev, host.dtype, staging.ptr(), dst.ptr(), n)
                };
            }
            // Laid out in planes on the host, then a copy the driver stages.
            let planes = Self::quant_planes(&host)?;
            if !fits(planes.len()) {
                *dst = self.upload(host)?;
                return Ok(());
            }
            // SAFETY: `dst` was uploaded by `upload_quant` at this shape and dtype: it owns
            // `planes.len()` bytes of device memory; the stream orders the copy after the
            // kernels that read the old contents, and the driver has taken the pageable
            // bytes when it returns.
            return unsafe {
                self.dev
                    .copy_from_host(dst.ptr(), &planes, "expert slot fill")
            };
        }
        if mxfp4 && self.kernel_config().mxfp4_device_fills {
            // The stored blocks cross the link as they are (by DMA from a locked host
            // store) and are laid out for the device on it.
            let shape = match host.shape {
                [rows, cols]
                    if cols.is_multiple_of(32)
                        && DType::MXFP4.storage_bytes(rows * cols) == Some(host.bytes.len()) =>
                {
                    Some((*rows, *cols))
                }
                _ => None,
            };
            return match shape {
                Some((rows, cols)) if same => {
                    let staging = self.raw(host.bytes.len(), "expert slot fill")?;
                    // SAFETY: `staging` holds `host.bytes.len()` bytes, freed in stream
                    // order after the kernel below has read them; `dst` was uploaded by
                    // `upload_mxfp4` at this shape, so it holds its device layout (padding
                    // zero); a locked source stays unwritten while locked.
                    unsafe {
                        self.dev
                            .copy_from_host(staging.ptr(), host.bytes, "expert slot fill")?;
                        ops::mxfp4::from_blocks(&self.dev, staging.ptr(), dst.ptr(), rows, cols)
                    }
                }
                _ => {
                    *dst = self.upload(host)?;
                    Ok(())
                }
            };
        }
        if mxfp4 {
            // Laid out for the device on the host, then a copy the driver stages.
            let tiles = match host.shape {
                [rows, cols] => crate::layout::mxfp4_device_tiles(host.bytes, *rows, *cols),
                _ => None,
            };
            return match tiles {
                Some(tiles) if same => {
                    // SAFETY: `dst` was uploaded by `upload_mxfp4` at this shape: it owns
                    // `tiles.len()` bytes of device memory; the stream orders the copy after
                    // the kernels that read the old contents, and the driver has taken the
                    // pageable bytes when it returns.
                    unsafe {
                        self.dev
                            .copy_from_host(dst.ptr(), &tiles, "expert slot fill")
                    }
                }
                _ => {
                    *dst = self.upload(host)?;
                    Ok(())
                }
            };
        }
        if !fits(host.bytes.len()) {
            *dst = self.upload(host)?;
            return Ok(());
        }
        if ahead {
            // SAFETY: as below, with the copy stream ordered after the kernels queued so
            // far; the tiered bank awaits its copies ahead before its step's work reads
            // or refills the slot.
            return unsafe {
                self.dev
                    .copy_from_host_ahead(dst.ptr(), host.bytes, "expert slot fill ahead")
            };
        }
        // SAFETY: `dst` owns `len_bytes()` == `host.bytes.len()` bytes of device memory; the
        // stream orders the copy after the kernels that read the old contents. A source in
        // a region locked through `lock_host_region` stays unwritten while locked (its
        // contract), so the copy may finish after this returns.
        unsafe {
            self.dev
                .copy_from_host(dst.ptr(), host.bytes, "expert slot fill")
        }
    }
}
