//! Launchers of `kernels/quant.cu`: weights kept packed on the device (Q4Z, Q8Z, F8S and
//! ggml's Q4_0, Q4_1, Q8_0, Q4_K, in the planes of [`crate::quant_layout`]): the small-batch GEMV that streams them, and
//! widening a matrix to bf16 (prefill GEMMs) or f32 (reading it back).

use kimi_core::DType;
use kimi_ops::{Error, Result};

use crate::device::{flat, grid, Device};
use crate::error::OpContext;
use crate::quant_layout::format_code;

/// Weight rows per CTA of `quant_gemv_*`: 4 warps of 2 rows (`QGEMV_WARPS`, `QGEMV_RW`).
const ROWS_PER_CTA: usize = 8;

/// The most activation rows one `quant_gemv_*` launch takes.
pub(crate) const GEMV_MAX_ROWS: usize = 8;

fn int(v: usize, what: &str) -> Result<i32> {
    i32::try_from(v).map_err(|_| Error::Unsupported(format!("quantized weights: {what} {v}")))
}

fn fmt(dtype: DType) -> Result<i32> {
    format_code(dtype).ok_or_else(|| Error::Unsupported(format!("quantized kernels for {dtype}")))
}

/// `y [n, o] = x [n, k] · wᵀ` for a packed `w [o, k]` of `dtype` (a type kept packed), f32
/// activations and products, `1 <= n <= GEMV_MAX_ROWS`.
///
/// # Safety
/// `w` holds an `[o, k]` matrix of `dtype` in the device planes (`k % 32 == 0`); `x` holds
/// `n * k` f32 at a 16-byte aligned address; `y` holds `n * o` f32.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn gemv(
    dev: &Device,
    dtype: DType,
    x: u64,
    w: u64,
    y: u64,
    n: usize,
    k: usize,
    o: usize,
) -> Result<()> {
    if n == 0 || o == 0 {
        return Ok(());
    }
    let tiles = match n {
        1 => "1",
        2 => "2",
        3..=4 => "4",
        5..=GEMV_MAX_ROWS => "8",
        _ => return Err(Error::Device(format!("quant_gemv: {n} rows, at most 8"))),
    };
    let family = match fmt(dtype)? {
        0 => "q4z",
        1 => "q8z",
        2 => "f8s",
        _ => "q4a",
    };
    let (ni, oi, ki) = (int(n, "rows")?, int(o, "rows")?, int(k, "width")?);
    let mut b = dev.kernel("matmul", &format!("quant_gemv_{family}_{tiles}"))?;
    b.arg(&w).arg(&x).arg(&y).arg(&ni).arg(&oi).arg(&ki);
    let blocks = o.div_ceil(ROWS_PER_CTA) as u32;
    // SAFETY: see the function's contract.
    unsafe { b.launch(grid((blocks, 1, 1), 128, 0)) }.op("matmul")?;
    Ok(())
}

/// The packed `[rows, cols]` matrix at `w` (a type kept packed) widened into `out`:
/// bf16 values when `bf16`, else f32.
///
/// # Safety
/// `w` holds the matrix in the device planes (`cols % 32 == 0`); `out` holds `rows * cols`
/// bf16 or f32 at a 16-byte aligned address.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn widen(
    dev: &Device,
    op: &'static str,
    dtype: DType,
    w: u64,
    out: u64,
    bf16: bool,
    rows: usize,
    cols: usize,
) -> Result<()> {
    if rows * cols == 0 {
        return Ok(());
    }
    let (f, bi) = (fmt(dtype)?, bf16 as i32);
    let (ri, ci) = (int(rows, "rows")?, int(cols, "width")?);
    let mut b = dev.kernel(op, "quant_widen")?;
    b.arg(&w).arg(&f).arg(&out).arg(&bi).arg(&ri).arg(&ci);
    // SAFETY: see the function's contract; one thread per 8 values.
    unsafe { b.launch(flat(rows * cols / 8)) }.op(op)?;
    Ok(())
}

/// `out [n, d] f32` = rows `ids` of the packed table `[vocab, d]` at `w`, widened.
///
/// # Safety
/// `w` holds the table in the device planes (`d % 32 == 0`); `ids` holds `n` u32 below
/// `vocab`; `out` holds `n * d` f32 at a 16-byte aligned address.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn embed(
    dev: &Device,
    dtype: DType,
    w: u64,
    ids: u64,
    out: u64,
    n: usize,
    d: usize,
    vocab: usize,
) -> Result<()> {
    if n * d == 0 {
        return Ok(());
    }
    let f = fmt(dtype)?;
    let (ni, di, vi) = (int(n, "rows")?, int(d, "width")?, int(vocab, "rows")?);
    let mut b = dev.kernel("embedding", "quant_embed")?;
    b.arg(&w)
        .arg(&f)
        .arg(&ids)
        .arg(&out)
        .arg(&ni)
        .arg(&di)
        .arg(&vi);
    // SAFETY: see the function's contract; one thread per 8 values.
    unsafe { b.launch(flat(n * d / 8)) }.op("embedding")?;
    Ok(())
}
