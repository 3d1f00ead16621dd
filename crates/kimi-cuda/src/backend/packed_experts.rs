//! Routed experts kept packed on the device (Kimi K3's MXFP4 ones, 4-bit integer ones from
//! AWQ, GPTQ, compressed-tensors or GGUF) on the tensor cores, the weights widened in
//! registers: which banks those kernels read, and the launches of one call. Shared by `moe`
//! (a layer's own experts) and `moe_experts` (an expert bank's view).

use kimi_core::config::Activation;
use kimi_core::DType;
use kimi_ops::{MlpWeights, Result};

use super::CudaBackend;
use crate::ops;
use crate::plan::{PackedBank, PackedFormat};
use crate::tensor::CudaTensor;

/// The kernels' format of a packed expert dtype.
fn packed_format(dtype: DType) -> Option<PackedFormat> {
    match dtype {
        DType::MXFP4 => Some(PackedFormat::Mxfp4),
        DType::Q4Z | DType::Q4_0 => Some(PackedFormat::Int4 { offset: false }),
        DType::Q4_1 | DType::Q4_K => Some(PackedFormat::Int4 { offset: true }),
        _ => None,
    }
}

/// The bank the packed-expert kernels read, or `None`: every expert's gate and up
/// `[inter, d]` and down `[d, inter]` of one packed dtype, both widths whole 32-value blocks,
/// each 4-bit matrix whole (its planes from their start, not a view into them).
pub(super) fn packed_bank<'a>(
    mut experts: impl Iterator<Item = &'a MlpWeights<CudaTensor>> + Clone,
    d: usize,
) -> Option<PackedBank> {
    let first = experts.clone().next()?;
    let (inter, dtype) = (*first.gate.shape.first()?, first.gate.dtype);
    let format = packed_format(dtype)?;
    let whole = |t: &CudaTensor| format == PackedFormat::Mxfp4 || t.offset == 0;
    let ok = inter > 0
        && inter.is_multiple_of(32)
        && d.is_multiple_of(32)
        && experts.all(|x| {
            x.gate.shape == [inter, d]
                && x.up.shape == [inter, d]
                && x.down.shape == [d, inter]
                && [&x.gate, &x.up, &x.down]
                    .iter()
                    .all(|t| t.dtype == dtype && whole(t))
        });
    ok.then_some(PackedBank {
        inter,
        width: d,
        format,
    })
}

/// What one call of [`CudaBackend::packed_experts`] serves: `tokens` rows of `x` routed to
/// `top_k` of `experts` each, the pairs grouped by expert (`offsets`, `slots` from
/// `moe_lists`).
pub(super) struct PackedCall {
    pub(super) bank: PackedBank,
    pub(super) token_tiles: usize,
    pub(super) tokens: usize,
    pub(super) top_k: usize,
    pub(super) experts: usize,
    pub(super) offsets: u64,
    pub(super) slots: u64,
    pub(super) act: Activation,
}

impl CudaBackend {
    /// Every routed pair's expert output `[pairs, d]` f32 in pair order, unweighted: the
    /// tokens' rows in the kernels' fragment order (bf16 hi, and lo with the split
    /// precision), gate/up with the activation into the same order, then down.
    ///
    /// # Safety
    /// `table` holds `3 * call.experts` addresses (gate, up, down) of a bank for which
    /// [`packed_bank`] gave `call.bank`; `call.offsets`/`call.slots` come from `moe_lists` over
    /// the `tokens * top_k` pairs; `x` holds `tokens` f32 rows of the bank's width.
    pub(super) unsafe fn packed_experts(
        &self,
        x: &CudaTensor,
        table: u64,
        call: &PackedCall,
    ) -> Result<CudaTensor> {
        const OP: &str = "moe_experts";
        let (n, k, d, inter) = (call.tokens, call.top_k, call.bank.width, call.bank.inter);
        let p = n * k;
        let split = self.kernel_config().split();
        let terms = if split { 2 } else { 1 };
        // Activation rows in the kernels' fragment order (bf16 hi, then lo): the tokens'
        // inputs, then the gate/up outputs at the pairs' sorted positions. Both are u16
        // tensors of the right byte size; their padding past `inter` must read as zeros.
        let (dp, ip) = (
            ops::expert_mma::padded_width(d),
            ops::expert_mma::padded_width(inter),
        );
        let xa = self.empty(&[terms * n * dp], DType::BF16, OP)?;
        let h = if ip == inter {
            self.empty(&[terms * p * ip], DType::BF16, OP)?
        } else {
            let mut z = self.zeroed(&[(terms * p * ip).div_ceil(2)], OP)?;
            z.dtype = DType::BF16;
            z
        };
        let y = self.empty(&[p, d], DType::F32, OP)?;
        let proj = |glu: bool, rows_out: usize, width: usize| ops::expert_mma::ExpertMma {
            format: call.bank.format,
            glu,
            split,
            token_tiles: call.token_tiles,
            top_k: k,
            experts: call.experts,
            pairs: p,
            rows_out,
            k: width,
            act: call.act,
        };
        let (offsets, slots) = (call.offsets, call.slots);
        // SAFETY: per the function's contract the table holds gate/up [inter, d] and down
        // [d, inter] of the bank's format for every expert (both widths multiples of 32,
        // 4-bit ones whole) and the lists are moe_lists' over p pairs; xa holds n rows of dp
        // bf16 per term, h p rows of ip per term (zeroed where ip > inter), y p rows of d f32.
        unsafe {
            ops::expert_mma::act_bf16(&self.dev, x.ptr(), xa.ptr(), n * dp, n, d, split)?;
            ops::expert_mma::expert_mma(
                &self.dev,
                &proj(true, inter, d),
                table,
                xa.ptr(),
                n * dp,
                offsets,
                slots,
                h.ptr(),
                p * ip,
            )?;
            ops::expert_mma::expert_mma(
                &self.dev,
                &proj(false, d, inter),
                table,
                h.ptr(),
                p * ip,
                offsets,
                slots,
                y.ptr(),
                0,
            )?;
        }
        // The activation rows are freed in stream order after the kernels that read them.
        drop((xa, h));
        Ok(y)
    }
}
