//! Launchers of `kernels/mxfp4.cu`: routed experts whose weights stay MXFP4 on the device,
//! and widening an MXFP4 matrix to f32. The device layout of an MXFP4 matrix (codes plane,
//! then scales plane) is described at the top of the kernel file and made by
//! [`crate::layout::mxfp4_device_planes`].

use kimi_core::config::Activation;
use kimi_ops::{Error, Result};

use crate::device::{flat, grid, Device};
use crate::error::OpContext;

/// Tokens per pass over a weight row (`MX_TG` in the kernel): the staged activation rows.
const TOKENS_PER_PASS: usize = 4;

/// Output rows per 256-thread CTA (8 warps of `MX_RW` = 4 rows).
const ROWS_PER_CTA: usize = 32;

/// The kernel's activation code and parameters: (0 = SiLU, 1 = SiTU; β₁; β₂ or 0 for none).
pub(crate) fn act_params(act: Activation) -> (i32, f32, f32) {
    match act {
        Activation::Silu => (0, 0.0, 0.0),
        Activation::Situ { beta, linear_beta } => (1, beta, linear_beta.unwrap_or(0.0)),
    }
}

/// One projection of every routed pair with MXFP4 weights (`moe_mxfp4_gemv`): `glu` =
/// gate/up with `act` (`cols` = the expert input width, `rows_out` = intermediate), else down
/// (`cols` = intermediate, `rows_out` = the expert output width).
///
/// # Safety
/// `table` holds `3 * experts` addresses of MXFP4 matrices in the device layout (gate and up
/// `[rows_out, cols]` when `glu`, down `[rows_out, cols]` otherwise); `offsets`/`slots` come
/// from `moe_lists` for `pairs` pairs over `experts`; `input` holds `pairs / top_k` (glu) or
/// `pairs` rows of `cols` f32 and `out` `pairs * rows_out` f32; `cols % 32 == 0`.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn expert_gemv(
    dev: &Device,
    table: u64,
    glu: bool,
    input: u64,
    top_k: usize,
    offsets: u64,
    experts: usize,
    slots: u64,
    out: u64,
    pairs: usize,
    rows_out: usize,
    cols: usize,
    act: Activation,
) -> Result<()> {
    const OP: &str = "moe_experts";
    let smem = TOKENS_PER_PASS * cols * 4;
    let too_big = |what: String| Error::Unsupported(format!("MXFP4 expert GEMV: {what}"));
    if smem > 200 * 1024 {
        return Err(too_big(format!("input width {cols} (shared memory)")));
    }
    let (act_code, beta, lbeta) = act_params(act);
    let int = |v: usize| i32::try_from(v).map_err(|_| too_big(format!("size {v}")));
    let (ki, ei, ri, ci) = (int(top_k)?, int(experts)?, int(rows_out)?, int(cols)?);
    let glu_i = glu as i32;
    let mut b = dev.kernel(OP, "moe_mxfp4_gemv")?;
    b.arg(&table).arg(&glu_i).arg(&input).arg(&ki).arg(&offsets);
    b.arg(&ei).arg(&slots).arg(&out).arg(&ri).arg(&ci);
    b.arg(&act_code).arg(&beta).arg(&lbeta);
    let gx = rows_out.div_ceil(ROWS_PER_CTA) as u32;
    let gy = pairs.min(experts) as u32;
    // SAFETY: see the function's contract; the staged rows fit the dynamic shared memory.
    unsafe { b.launch(grid((gx, gy, 1), 256, smem as u32)) }.op(OP)?;
    Ok(())
}

/// `out [rows, cols] f32` = the MXFP4 matrix at `w`.
///
/// # Safety
/// `w` holds an MXFP4 `[rows, cols]` matrix in the device layout (`cols % 32 == 0`) and `out`
/// `rows * cols` f32.
pub(crate) unsafe fn to_f32(
    dev: &Device,
    w: u64,
    out: u64,
    rows: usize,
    cols: usize,
) -> Result<()> {
    let (ri, ci) = (rows as i32, cols as i32);
    let mut b = dev.kernel("to_f32", "mxfp4_to_f32")?;
    b.arg(&w).arg(&out).arg(&ri).arg(&ci);
    // SAFETY: see the function's contract.
    unsafe { b.launch(flat(rows * cols)) }.op("to_f32")?;
    Ok(())
}

/// One projection of every routed pair with MXFP4 weights on the tensor cores
/// (`moe_mxfp4_grouped_mma` in `kernels/moe_gemm.cu`: 64 pairs x 64 features per CTA, the
/// weights widened to bf16 in shared memory, exactly): `glu` = gate/up with `act` (`k` = the
/// expert input width, `n_out` = intermediate), else down. `split`: activations as bf16 hi +
/// lo (near f32 products).
///
/// # Safety
/// As [`expert_gemv`], with `n_out % 64 == 0` and `k % 32 == 0`.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn grouped_mma(
    dev: &Device,
    table: u64,
    glu: bool,
    split: bool,
    input: u64,
    top_k: usize,
    offsets: u64,
    experts: usize,
    slots: u64,
    out: u64,
    pairs: usize,
    n_out: usize,
    k: usize,
    act: Activation,
) -> Result<()> {
    const OP: &str = "moe_experts";
    let int = |v: usize| {
        i32::try_from(v)
            .map_err(|_| Error::Unsupported(format!("MXFP4 grouped expert GEMM: size {v}")))
    };
    let (act_code, beta, lbeta) = act_params(act);
    let (g, s) = (glu as i32, split as i32);
    let (ki, ei, ni, kk) = (int(top_k)?, int(experts)?, int(n_out)?, int(k)?);
    let mut b = dev.kernel(OP, "moe_mxfp4_grouped_mma")?;
    b.arg(&table).arg(&g).arg(&s).arg(&input).arg(&ki);
    b.arg(&offsets)
        .arg(&slots)
        .arg(&ei)
        .arg(&out)
        .arg(&ni)
        .arg(&kk);
    b.arg(&act_code).arg(&beta).arg(&lbeta);
    // Every expert with pairs has at most one partial tile: an upper bound on the tiles,
    // known without reading the counts back; CTAs past the last tile exit at once.
    let tiles = pairs.div_ceil(64) + experts.min(pairs);
    // SAFETY: see the function's contract.
    unsafe { b.launch(grid(((n_out / 64) as u32, tiles as u32, 1), 128, 0)) }.op(OP)?;
    Ok(())
}
