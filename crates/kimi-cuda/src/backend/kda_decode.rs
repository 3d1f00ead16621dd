//! The fused KDA decode step (`Backend::kda_decode`): shape checks and the launch of
//! `kda_decode_D`; anything it does not cover goes to the composed ops.

use kimi_core::config::KdaGate;
use kimi_core::DType;
use kimi_ops::{KdaStepInputs, KdaStepWeights, Result, Segment};

use super::{code, f32_rows, rows_tiled, CudaBackend};
use crate::ops;
use crate::tensor::CudaTensor;

const OP: &str = "kda_decode";

impl CudaBackend {
    /// `Some(D)` when the fused kernel covers this call: one-token segments, a head size
    /// with split kernels and every operand of the documented shape and an f32/bf16/f16
    /// dtype. `None` sends the call to the composed ops, which report any shape error.
    pub(super) fn kda_decode_shape(
        &self,
        x: &KdaStepInputs<'_, CudaTensor>,
        w: &KdaStepWeights<'_, CudaTensor>,
        num_heads: usize,
        segments: &[Segment],
        caches: &[(&mut [CudaTensor; 3], &mut CudaTensor)],
    ) -> Result<Option<usize>> {
        let Ok((n, width)) = f32_rows(x.qkv[0], OP) else {
            return Ok(None);
        };
        if num_heads == 0 || !width.is_multiple_of(num_heads) || n == 0 {
            return Ok(None);
        }
        let d = width / num_heads;
        let rows = |t: &CudaTensor, cols: usize| f32_rows(t, OP).ok() == Some((n, cols));
        let conv_len = w.conv[0].len();
        let wlen = conv_len / width;
        let ok = ops::kda::has_split_kernels(d)
            && !segments.is_empty()
            && segments.len() == caches.len()
            && segments.iter().all(|s| s.len == 1 && s.start < n)
            && x.qkv.iter().all(|t| rows(t, width))
            && rows(x.f, width)
            && rows(x.z, width)
            && rows(x.beta_logits, num_heads)
            && wlen >= 1
            && w.conv.iter().all(|c| c.len() == wlen * width)
            && w.a_log.len() == num_heads
            && w.dt_bias.len() == width
            && w.o_norm.len() == d
            && caches.iter().all(|(conv, state)| {
                state.dtype == DType::F32
                    && state.len() == num_heads * d * d
                    && conv
                        .iter()
                        .all(|c| c.dtype == DType::F32 && c.len() == (wlen - 1) * width)
            });
        let dtypes_ok = w
            .conv
            .iter()
            .chain([&w.a_log, &w.dt_bias, &w.o_norm])
            .all(|t| code(t, OP).is_ok());
        Ok((ok && dtypes_ok).then_some(d))
    }

    /// One `kda_decode_D` launch per [`ops::kda::MAX_SEGS`] segments; conv windows and
    /// states are updated in place.
    pub(super) fn kda_decode_fused(
        &self,
        x: &KdaStepInputs<'_, CudaTensor>,
        w: &KdaStepWeights<'_, CudaTensor>,
        num_heads: usize,
        d: usize,
        segments: &[Segment],
        caches: &mut [(&mut [CudaTensor; 3], &mut CudaTensor)],
    ) -> Result<CudaTensor> {
        let (n, width) = f32_rows(x.qkv[0], OP)?;
        // kda_decode writes every column of each segment's row.
        let y = if rows_tiled(segments, n) {
            self.empty(&[n, width], DType::F32, OP)?
        } else {
            self.zeroed(&[n, width], OP)?
        };
        let (kind, lb) = match w.gate {
            KdaGate::Softplus => (0, 0.0),
            KdaGate::LowerBound(lb) => (1, lb),
        };
        let args = ops::kda::StepArgs {
            x: [x.qkv[0].ptr(), x.qkv[1].ptr(), x.qkv[2].ptr()],
            w: [w.conv[0].ptr(), w.conv[1].ptr(), w.conv[2].ptr()],
            f: x.f.ptr(),
            b: x.beta_logits.ptr(),
            z: x.z.ptr(),
            a_log: w.a_log.ptr(),
            dt_bias: w.dt_bias.ptr(),
            o_norm: w.o_norm.ptr(),
            y: y.ptr(),
            wdt: [
                code(w.conv[0], OP)?,
                code(w.conv[1], OP)?,
                code(w.conv[2], OP)?,
            ],
            adt: code(w.a_log, OP)?,
            bdt: code(w.dt_bias, OP)?,
            odt: code(w.o_norm, OP)?,
            h: num_heads as i32,
            w_len: (w.conv[0].len() / width) as i32,
            kind,
            lb,
            eps: w.eps,
            _pad: 0,
        };
        let entries: Vec<(usize, u64, [u64; 3])> = segments
            .iter()
            .zip(caches.iter())
            .map(|(s, (conv, state))| {
                (
                    s.start,
                    state.ptr(),
                    [conv[0].ptr(), conv[1].ptr(), conv[2].ptr()],
                )
            })
            .collect();
        for group in entries.chunks(ops::kda::MAX_SEGS) {
            let segs = ops::kda::StepSegs::new(group)?;
            // SAFETY: kda_decode_shape checked every operand's shape and dtype for n rows of
            // width H*D, one-token segments inside them, and per-segment windows and states
            // (distinct tensors, as the caches are distinct &mut borrows); y holds n*H*D f32.
            unsafe { ops::kda::decode(&self.dev, &args, &segs, num_heads, d)? };
        }
        Ok(y)
    }
}
