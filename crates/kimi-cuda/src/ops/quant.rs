//! Launchers of `kernels/quant.cu`: weights kept packed on the device (Q4Z, Q8Z, F8S and
//! ggml's Q4_0, Q4_1, Q8_0, Q4_K, in the planes of [`crate::quant_layout`]): the small-batch GEMV that streams them, and
//! widening a matrix to bf16 (prefill GEMMs) or f32 (reading it back).

use kimi_core::DType;
use kimi_ops::{Error, Result};

use crate::device::{flat, grid, Device};
use crate::error::OpContext;
use crate::ops::gemm::STREAM_THREADS;
use crate::plan::{
    plan_quant_gemv_pair, plan_quant_gemv_path, KernelConfig, QuantGemvPath, QuantGemvPlan,
};
use crate::quant_layout::{fill_kind, format_code};

/// The most activation rows one `quant_gemv_*` launch takes.
pub(crate) use crate::plan::QUANT_GEMV_MAX_ROWS as GEMV_MAX_ROWS;

fn int(v: usize, what: &str) -> Result<i32> {
    i32::try_from(v).map_err(|_| Error::Unsupported(format!("quantized weights: {what} {v}")))
}

fn fmt(dtype: DType) -> Result<i32> {
    format_code(dtype).ok_or_else(|| Error::Unsupported(format!("quantized kernels for {dtype}")))
}

/// `y [n, o] = x [n, k] · wᵀ` for a packed `w [o, k]` of `dtype` (a type kept packed), f32
/// activations and products, `1 <= n <= GEMV_MAX_ROWS`, with the kernel
/// [`plan_quant_gemv_path`] picks under `cfg`.
///
/// # Safety
/// `w` holds an `[o, k]` matrix of `dtype` in the device planes (`k % 32 == 0`); `x` holds
/// `n * k` f32 (4-byte aligned, as every f32 tensor); `y` holds `n * o` f32.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn gemv(
    dev: &Device,
    cfg: &KernelConfig,
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
    if n > GEMV_MAX_ROWS {
        return Err(Error::Device(format!("quant_gemv: {n} rows, at most 8")));
    }
    let format = fmt(dtype)?;
    let (oi, ki) = (int(o, "rows")?, int(k, "width")?);
    // The kernels index blocks with 32 bits.
    if !k.is_multiple_of(32) || u32::try_from(o * (k / 32)).is_err() {
        return Err(Error::Unsupported(format!(
            "quant_gemv: a [{o}, {k}] matrix (whole 32-value blocks, under 2^32 of them)"
        )));
    }
    let aligned = x.is_multiple_of(16);
    match plan_quant_gemv_path(cfg, dev.sm_count, format, n, k, o, aligned) {
        QuantGemvPath::Int4Stream(plan) => {
            let fmt3 = i32::from(format == 3);
            let (rows, slices) = (int(plan.rows, "rows")?, int(plan.slices, "slices")?);
            let (stages, stage_bytes) =
                (int(plan.stages, "stages")?, int(plan.stage_bytes, "stage")?);
            let mut b = dev.kernel("matmul", "quant_gemv_int4_stream_1")?;
            b.arg(&w)
                .arg(&x)
                .arg(&y)
                .arg(&oi)
                .arg(&ki)
                .arg(&fmt3)
                .arg(&rows)
                .arg(&slices)
                .arg(&stages)
                .arg(&stage_bytes);
            let cfg = grid((plan.grid as u32, 1, 1), STREAM_THREADS, plan.smem);
            // SAFETY: see the function's contract; `x` is 16-byte aligned, `packed_gemv_plan`
            // checked k against the lanes' words and the slices, and sized the stages within
            // the kernel's opted-in shared memory.
            unsafe { b.launch(cfg) }.op("matmul")
        }
        QuantGemvPath::Blocks(plan) => unsafe { gemv_blocks(dev, format, x, w, y, n, k, o, plan) },
    }
}

/// `ya = xa·waᵀ` and `yb = xb·wbᵀ` for one token each against packed matrices of `k`
/// columns (`da`, `db` their types), in one `quant_gemv_narrow_pair` launch where
/// [`plan_quant_gemv_pair`] takes it under `cfg`. Returns false, launching nothing, where it
/// does not: the caller then runs two products.
///
/// # Safety
/// For each of `a` and `b` = `[x, w, y]`: `x` holds `k` f32, `w` an `[o, k]` matrix of its
/// type in the device planes (`oa`, `ob`); `y` holds `o` f32.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn gemv_narrow_pair(
    dev: &Device,
    cfg: &KernelConfig,
    (da, db): (DType, DType),
    a: [u64; 3],
    oa: usize,
    b: [u64; 3],
    ob: usize,
    k: usize,
) -> Result<bool> {
    let (Some(fa), Some(fb)) = (format_code(da), format_code(db)) else {
        return Ok(false);
    };
    let aligned = a[0].is_multiple_of(16) && b[0].is_multiple_of(16);
    if !plan_quant_gemv_pair(cfg, fa, fb, k, aligned) {
        return Ok(false);
    }
    let (oai, obi, ki, fmt3) = (
        int(oa, "rows")?,
        int(ob, "rows")?,
        int(k, "width")?,
        i32::from(fa == 3),
    );
    let mut l = dev.kernel("matmul", "quant_gemv_narrow_pair")?;
    l.arg(&a[1]).arg(&a[0]).arg(&a[2]).arg(&oai);
    l.arg(&b[1])
        .arg(&b[0])
        .arg(&b[2])
        .arg(&obi)
        .arg(&ki)
        .arg(&fmt3);
    // 8 warps of 32 / (k / 32) rows per CTA, `a`'s CTAs first.
    let rows = 8 * (32 / (k / 32));
    let ctas = oa.div_ceil(rows) + ob.div_ceil(rows);
    // SAFETY: see the function's contract; the plan checked the width and the alignment.
    unsafe { l.launch(grid((ctas as u32, 1, 1), 256, 0)) }.op("matmul")?;
    Ok(true)
}

/// [`gemv`] on `quant_gemv_*`, then `quant_gemv_reduce` where K splits.
///
/// # Safety
/// As [`gemv`], with the matrix checked there.
#[allow(clippy::too_many_arguments)]
unsafe fn gemv_blocks(
    dev: &Device,
    format: i32,
    x: u64,
    w: u64,
    y: u64,
    n: usize,
    k: usize,
    o: usize,
    plan: QuantGemvPlan,
) -> Result<()> {
    let tiles = match n {
        1 => "1",
        2 => "2",
        3..=4 => "4",
        _ => "8",
    };
    let family = match format {
        0 => "q4z",
        1 => "q8z",
        2 => "f8s",
        _ => "q4a",
    };
    let (ni, oi, ki) = (int(n, "rows")?, int(o, "rows")?, int(k, "width")?);
    let (wk, chunk, span) = (
        int(plan.wk, "slices")?,
        int(plan.chunk, "chunk")?,
        int(plan.span, "span")?,
    );
    // Split K: partial sums [splits, n, o], added in order by `quant_gemv_reduce`.
    let part = if plan.splits > 1 {
        int(plan.splits * n * o, "partial sums")?;
        // Every element is written by the first launch before the second reads it.
        Some(dev.alloc(plan.splits * n * o * 4, "matmul")?)
    } else {
        None
    };
    let out = part.as_ref().map_or(y, |p| p.ptr());
    let mut b = dev.kernel("matmul", &format!("quant_gemv_{family}_{tiles}"))?;
    b.arg(&w)
        .arg(&x)
        .arg(&out)
        .arg(&ni)
        .arg(&oi)
        .arg(&ki)
        .arg(&wk)
        .arg(&chunk)
        .arg(&span);
    let cfg = grid(
        (plan.ctas as u32, plan.splits as u32, 1),
        128,
        plan.smem as u32,
    );
    // SAFETY: see the function's contract; `out` holds splits * n * o f32; the plan's shared
    // memory, static included, is within the default limit.
    unsafe { b.launch(cfg) }.op("matmul")?;
    if let Some(p) = &part {
        let (src, len, splits) = (p.ptr(), int(n * o, "outputs")?, int(plan.splits, "splits")?);
        let mut r = dev.kernel("matmul", "quant_gemv_reduce")?;
        r.arg(&src).arg(&y).arg(&len).arg(&splits);
        // SAFETY: `p` holds splits * len f32 written above; y holds len f32.
        unsafe { r.launch(flat(n * o)) }.op("matmul")?;
    }
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

/// Lays out `n` values of `dtype`'s stored blocks, already on the device (`blocks`), in the
/// device planes (`planes`, which holds `quant_layout::device_bytes(dtype, n)` bytes): a slot
/// fill whose blocks crossed the host link as stored. The same bytes as
/// `quant_layout::device_planes`.
///
/// # Safety
/// `blocks` holds `dtype.storage_bytes(n)` bytes (4-byte aligned) and `planes`
/// `device_bytes(dtype, n)` (16-byte aligned); the two do not overlap.
pub(crate) unsafe fn from_blocks(
    dev: &Device,
    dtype: DType,
    blocks: u64,
    planes: u64,
    n: usize,
) -> Result<()> {
    let kind = fill_kind(dtype).ok_or_else(|| {
        Error::Unsupported(format!("slot fills laid out on the device for {dtype}"))
    })?;
    let units = u32::try_from(n / 32)
        .map_err(|_| Error::Unsupported(format!("a slot fill of {n} values")))?;
    let mut b = dev.kernel("quant", "quant_from_blocks")?;
    b.arg(&blocks).arg(&planes).arg(&kind).arg(&units);
    // SAFETY: see the function's contract; one thread per 32-value unit.
    unsafe { b.launch(flat(n / 32)) }.op("from_blocks")?;
    Ok(())
}
