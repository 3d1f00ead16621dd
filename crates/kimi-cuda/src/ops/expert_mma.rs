//! Launchers of the routed-expert kernels that keep their weights packed and widen them in
//! registers for the tensor cores: `kernels/mxfp4.cu` (MXFP4, in the tiles of
//! [`crate::layout::mxfp4_device_tiles`]) and `kernels/int4_experts.cu` (4-bit integers, in
//! the planes of [`crate::quant_layout`]), and the activation rows both read in the
//! fragment order (`mxfp4_act_bf16`).

use kimi_core::config::Activation;
use kimi_ops::{Error, Result};

use crate::device::{flat, grid, Device};
use crate::error::OpContext;
use crate::plan::PackedFormat;

/// Warps per CTA of `moe_mxfp4_mma_*` and `moe_int4_mma_*` (each owns two 16-row weight
/// tiles).
const WARPS: usize = 4;

/// Shared memory of `moe_mxfp4_mma_*`: per warp `MX_STAGES` (4) k tiles of its weight stream,
/// 2,560 bytes each (`MX_STAGE_BYTES`). `moe_int4_mma_*` keeps its stream in registers.
const MXFP4_STAGE_SMEM: usize = WARPS * 4 * 2560;

/// The kernel's activation code and parameters: (0 = SiLU, 1 = SiTU; β₁; β₂ or 0 for none).
pub(crate) fn act_params(act: Activation) -> (i32, f32, f32) {
    match act {
        Activation::Silu => (0, 0.0, 0.0),
        Activation::Situ { beta, linear_beta } => (1, beta, linear_beta.unwrap_or(0.0)),
    }
}

/// The width of an activation row in the fragment order: `k` rounded up to whole 128-value
/// tiles.
pub(crate) fn padded_width(k: usize) -> usize {
    k.div_ceil(128) * 128
}

fn int(v: usize, what: &str) -> Result<i32> {
    i32::try_from(v).map_err(|_| Error::Unsupported(format!("packed experts: {what} {v}")))
}

/// f32 rows `[rows, k]` at `x` into bf16 rows `[rows, padded_width(k)]` in the fragment order
/// at `out` (zeros past `k`); with `split` the residual lo = x - hi at `out + lo` elements.
///
/// # Safety
/// `x` holds `rows * k` f32 (`k % 32 == 0`); `out` holds `rows * padded_width(k)` bf16, and
/// as many again from `lo` on when `split`.
pub(crate) unsafe fn act_bf16(
    dev: &Device,
    x: u64,
    out: u64,
    lo: usize,
    rows: usize,
    k: usize,
    split: bool,
) -> Result<()> {
    const OP: &str = "moe_experts";
    let kp = padded_width(k);
    let (ri, ki, kpi, si) = (
        int(rows, "rows")?,
        int(k, "width")?,
        int(kp, "width")?,
        split as i32,
    );
    let lo = lo as u64;
    let mut b = dev.kernel(OP, "mxfp4_act_bf16")?;
    b.arg(&x)
        .arg(&out)
        .arg(&lo)
        .arg(&ri)
        .arg(&ki)
        .arg(&kpi)
        .arg(&si);
    // SAFETY: see the function's contract.
    unsafe { b.launch(flat(rows * kp / 2)) }.op(OP)?;
    Ok(())
}

/// The launch of one projection of every routed pair ([`expert_mma`]).
pub(crate) struct ExpertMma {
    /// The weights' format: which kernel family runs.
    pub format: PackedFormat,
    /// Gate/up with the activation (else down).
    pub glu: bool,
    /// Activations as bf16 hi + lo (near f32 products), else hi alone.
    pub split: bool,
    /// Pairs per pass over a weight tile, in groups of 8 (1, 2 or 4).
    pub token_tiles: usize,
    pub top_k: usize,
    pub experts: usize,
    pub pairs: usize,
    /// Output rows of each matrix (gate/up: the intermediate width; down: the output width).
    pub rows_out: usize,
    /// Input width of each matrix.
    pub k: usize,
    pub act: Activation,
}

/// One projection of every routed pair with packed weights (`moe_mxfp4_mma_{1,2,4}_*` or
/// `moe_int4_mma_{1,2,4}_*`). `input` holds activation rows in the fragment order (glu: one
/// per token, from [`act_bf16`]; down: one per sorted pair, the glu output); lo at
/// `input_lo` elements on. glu writes `out` as bf16 rows of `padded_width(rows_out)` in the
/// fragment order at each pair's sorted position (lo at `out_lo`), ready to be the down
/// projection's input; down writes f32 `out[pair * rows_out + row]`.
///
/// # Safety
/// `table` holds `3 * experts` addresses of matrices of `call.format` (MXFP4 in the device
/// tiles; 4-bit integers whole, in the device planes, format 3 exactly when `offset`): gate
/// and up `[rows_out, k]` when `glu`, down `[rows_out, k]` otherwise, `k % 32 == 0`;
/// `offsets`/`slots` come from `moe_lists` for `pairs` pairs over `experts`; `input` and `out`
/// hold the rows above (the padding of glu's output past `rows_out` zeroed when the down
/// projection reads it).
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn expert_mma(
    dev: &Device,
    call: &ExpertMma,
    table: u64,
    input: u64,
    input_lo: usize,
    offsets: u64,
    slots: u64,
    out: u64,
    out_lo: usize,
) -> Result<()> {
    const OP: &str = "moe_experts";
    let family = match call.format {
        PackedFormat::Mxfp4 => "mxfp4",
        PackedFormat::Int4 { .. } => "int4",
    };
    let precision = if call.split { "split" } else { "half" };
    let tiles = match call.token_tiles {
        n @ (1 | 2 | 4) => n,
        n => {
            return Err(Error::Unsupported(format!(
                "packed experts: {n} token tiles per pass"
            )))
        }
    };
    if !call.k.is_multiple_of(32) {
        return Err(Error::Unsupported(format!(
            "packed experts: width {} is not whole 32-value blocks",
            call.k
        )));
    }
    let name = format!("moe_{family}_mma_{tiles}_{precision}");
    let (act_code, beta, lbeta) = act_params(call.act);
    let row_tiles = call.rows_out.div_ceil(16);
    let glu_i = call.glu as i32;
    let (ki, ei) = (int(call.top_k, "top_k")?, int(call.experts, "experts")?);
    let (ri, kk) = (int(call.rows_out, "rows")?, int(call.k, "width")?);
    let out_kp = int(padded_width(call.rows_out), "rows")?;
    let (in_lo, o_lo) = (input_lo as u64, out_lo as u64);
    let mut b = dev.kernel(OP, &name)?;
    b.arg(&table).arg(&glu_i);
    // The 4-bit kernels take the format (0: (q − z)·d; 1: q·a − b) after glu.
    let offset = match call.format {
        PackedFormat::Int4 { offset } => Some(offset as i32),
        PackedFormat::Mxfp4 => None,
    };
    if let Some(fmt3) = &offset {
        b.arg(fmt3);
    }
    b.arg(&input).arg(&in_lo).arg(&ki);
    b.arg(&offsets).arg(&ei).arg(&slots).arg(&out).arg(&o_lo);
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
    let smem = match call.format {
        PackedFormat::Mxfp4 => MXFP4_STAGE_SMEM as u32,
        PackedFormat::Int4 { .. } => 0,
    };
    // SAFETY: see the function's contract.
    unsafe { b.launch(grid((gx, gy, 1), (WARPS * 32) as u32, smem)) }.op(OP)?;
    Ok(())
}
