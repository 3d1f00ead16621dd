//! Launchers of `kernels/int4_experts.cu`: routed experts whose weights stay 4-bit integers
//! (Q4Z, Q4_0, Q4_1, Q4_K) in the planes of [`crate::quant_layout`], on the tensor cores with
//! the weights widened in registers. The activation rows come in the fragment order of
//! [`super::mxfp4::act_bf16`], as for MXFP4 experts.

use kimi_ops::{Error, Result};

use super::mxfp4::{act_params, padded_width, ExpertMma};
use crate::device::{grid, Device};
use crate::error::OpContext;

/// Warps per CTA of `moe_int4_mma_*` (each owns two 16-row weight tiles).
const WARPS: usize = 4;

fn int(v: usize, what: &str) -> Result<i32> {
    i32::try_from(v).map_err(|_| Error::Unsupported(format!("4-bit experts: {what} {v}")))
}

/// One projection of every routed pair with 4-bit integer weights (`moe_int4_mma_{1,2,4}_*`),
/// as [`super::mxfp4::expert_mma`] with MXFP4 ones: `offset` for format 3 (`q·a − b`: Q4_1,
/// Q4_K), else format 0 (`(q − z)·d`: Q4Z, Q4_0).
///
/// # Safety
/// `table` holds `3 * experts` addresses of whole `[rows_out, k]` matrices in the device
/// planes of their 4-bit type (gate and up when `glu`, down otherwise; `k % 32 == 0`), of
/// format 3 exactly when `offset`; `offsets`/`slots` come from `moe_lists` for `pairs` pairs
/// over `experts`; `input` holds activation rows of `padded_width(k)` bf16 in the fragment
/// order (lo at `input_lo`) and `out` the rows [`super::mxfp4::expert_mma`] writes.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn expert_mma(
    dev: &Device,
    call: &ExpertMma,
    offset: bool,
    table: u64,
    input: u64,
    input_lo: usize,
    offsets: u64,
    slots: u64,
    out: u64,
    out_lo: usize,
) -> Result<()> {
    const OP: &str = "moe_experts";
    let name = match (call.token_tiles, call.split) {
        (1, false) => "moe_int4_mma_1_half",
        (1, true) => "moe_int4_mma_1_split",
        (2, false) => "moe_int4_mma_2_half",
        (2, true) => "moe_int4_mma_2_split",
        (4, false) => "moe_int4_mma_4_half",
        (4, true) => "moe_int4_mma_4_split",
        (n, _) => {
            return Err(Error::Unsupported(format!(
                "4-bit experts: {n} token tiles per pass"
            )))
        }
    };
    if !call.k.is_multiple_of(32) {
        return Err(Error::Unsupported(format!(
            "4-bit experts: width {} is not whole 32-value blocks",
            call.k
        )));
    }
    let (act_code, beta, lbeta) = act_params(call.act);
    let row_tiles = call.rows_out.div_ceil(16);
    let (glu_i, fmt3) = (call.glu as i32, offset as i32);
    let (ki, ei) = (int(call.top_k, "top_k")?, int(call.experts, "experts")?);
    let (ri, kk) = (int(call.rows_out, "rows")?, int(call.k, "width")?);
    let out_kp = int(padded_width(call.rows_out), "rows")?;
    let (in_lo, o_lo) = (input_lo as u64, out_lo as u64);
    let mut b = dev.kernel(OP, name)?;
    b.arg(&table).arg(&glu_i).arg(&fmt3).arg(&input).arg(&in_lo);
    b.arg(&ki)
        .arg(&offsets)
        .arg(&ei)
        .arg(&slots)
        .arg(&out)
        .arg(&o_lo);
    b.arg(&ri)
        .arg(&out_kp)
        .arg(&kk)
        .arg(&act_code)
        .arg(&beta)
        .arg(&lbeta);
    // glu: one row tile per warp; down: two.
    let tiles_per_cta = if call.glu { WARPS } else { 2 * WARPS };
    let gx = row_tiles.div_ceil(tiles_per_cta) as u32;
    let gy = call.pairs.min(call.experts) as u32;
    // SAFETY: see the function's contract.
    unsafe { b.launch(grid((gx, gy, 1), (WARPS * 32) as u32, 0)) }.op(OP)?;
    Ok(())
}
