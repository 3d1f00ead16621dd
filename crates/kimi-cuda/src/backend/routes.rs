//! A MoE layer's routes read back to the host, several with one wait (a tiered expert
//! step's own routes and the next layer's predicted ones).

use kimi_core::DType;
use kimi_ops::{MoeRoutes, Result};

use super::{shape_err, CudaBackend};
use crate::tensor::CudaTensor;

impl CudaBackend {
    /// [`kimi_ops::Backend::read_route_sets`]: the ids and weights of every set of routes.
    pub(super) fn read_routes_back(
        &self,
        sets: &[&MoeRoutes<CudaTensor>],
    ) -> Result<Vec<(Vec<u32>, Vec<f32>)>> {
        const OP: &str = "read_routes";
        self.dev.enter(OP)?;
        let mut out = Vec::with_capacity(sets.len());
        for routes in sets {
            let (ids, wts) = (&routes.experts, &routes.weights);
            if ids.dtype != DType::F32 || wts.dtype != DType::F32 {
                return Err(shape_err(
                    OP,
                    format!("routes of {} ids and {} weights", ids.dtype, wts.dtype),
                ));
            }
            out.push((vec![0u32; ids.len()], vec![0f32; wts.len()]));
        }
        // `moe_route` writes u32 ids into an f32-typed buffer: both read as 4-byte words.
        let mut parts = Vec::with_capacity(2 * sets.len());
        for (routes, (id_bits, weights)) in sets.iter().zip(out.iter_mut()) {
            // SAFETY: u32 and f32 are plain 4-byte values (every byte pattern valid, u8
            // needs no alignment); each slice views exactly its vector's bytes.
            let (id_bytes, wt_bytes) = unsafe {
                (
                    std::slice::from_raw_parts_mut(
                        id_bits.as_mut_ptr().cast::<u8>(),
                        id_bits.len() * 4,
                    ),
                    std::slice::from_raw_parts_mut(
                        weights.as_mut_ptr().cast::<u8>(),
                        weights.len() * 4,
                    ),
                )
            };
            parts.push((routes.experts.ptr(), id_bytes));
            parts.push((routes.weights.ptr(), wt_bytes));
        }
        // SAFETY: every tensor holds len() f32 words on the device (checked dtypes above).
        unsafe { self.dev.read_all(&mut parts, OP)? };
        Ok(out)
    }
}
