//! `y [n, out] = x [n, in] · wᵀ` with `w [out, in]` row-major, through cuBLAS.
//!
//! Row-major `y = x·wᵀ` is column-major `yᵀ (out×n) = op(W) · X` with `W` read as the
//! column-major `[in × out]` matrix `wᵀ`, transposed: `gemm(T, N, m=out, n, k=in)`.

use cudarc::cublas::sys::cudaDataType;
use kimi_ops::Result;

use crate::device::{grid, Device};
use crate::error::OpContext;
use crate::graph::{GemmOp, Op};
use crate::plan::{self, GemvPath, KernelConfig};

/// `y = x·wᵀ`: `x` and `w` both of element type `ab` (f32, bf16 or f16), `y` f32,
/// f32 accumulation.
///
/// # Safety
/// `x` holds `n * k` and `w` `o * k` elements of type `ab`; `y` holds `n * o` f32.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn gemm(
    dev: &Device,
    x: u64,
    w: u64,
    ab: cudaDataType,
    y: u64,
    n: usize,
    k: usize,
    o: usize,
) -> Result<()> {
    // SAFETY: the caller's contract.
    unsafe { gemm_into(dev, x, w, ab, y, n, k, o, false) }
}

/// `y = x·wᵀ`, or `y += x·wᵀ` when `accumulate`; otherwise as [`gemm`].
///
/// # Safety
/// As [`gemm`]; with `accumulate`, `y` holds initialised values.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn gemm_into(
    dev: &Device,
    x: u64,
    w: u64,
    ab: cudaDataType,
    y: u64,
    n: usize,
    k: usize,
    o: usize,
    accumulate: bool,
) -> Result<()> {
    if n == 0 || o == 0 {
        return Ok(());
    }
    let op = Op::Gemm(GemmOp {
        x,
        w,
        ab,
        y,
        n,
        k,
        o,
        accumulate,
    });
    // SAFETY: the caller's contract (issued by `graph::issue`, or recorded for it).
    unsafe { dev.submit(op) }.op("matmul")
}

/// `y = x·wᵀ` for a few rows: f32 `x [n, k]`, bf16 `w [o, k]`, f32 `y [n, o]`, f32 products
/// (see `kernels/gemv.cu`), with the kernel [`plan::plan_gemv`] picks under `cfg`.
///
/// # Safety
/// `x` holds `n * k` f32 and `w` `o * k` bf16, both 16-byte aligned, `k % 8 == 0`; `y` holds
/// `n * o` f32.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn gemv_bf16(
    dev: &Device,
    cfg: &KernelConfig,
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
    let (ni, oi, ki) = (n as i32, o as i32, k as i32);
    if n > plan::GEMV_MAX_ROWS {
        return Err(kimi_ops::Error::Device(format!(
            "gemv_bf16: {n} rows, at most {}",
            plan::GEMV_MAX_ROWS
        )));
    }
    match plan::plan_gemv(cfg, dev.sm_count, n, k, o) {
        GemvPath::Stream(plan) => {
            let mut b = dev.kernel("matmul", "gemv_stream_1")?;
            let (rows, stages) = (plan.rows as i32, plan.stages as i32);
            b.arg(&w)
                .arg(&x)
                .arg(&y)
                .arg(&oi)
                .arg(&ki)
                .arg(&rows)
                .arg(&stages);
            // SAFETY: see the function's contract; `stream_plan` checked k against the
            // tile's column slices and sized the stages within the kernel's opted-in shared
            // memory.
            unsafe { b.launch(grid((plan.grid as u32, 1, 1), STREAM_THREADS, plan.smem)) }
                .op("matmul")?;
        }
        GemvPath::Bulk { rows } => {
            let name = match n {
                1 => "gemv_bulk_1",
                2..=4 => "gemv_bulk_4",
                _ => "gemv_bulk_8",
            };
            let mut b = dev.kernel("matmul", name)?;
            let rows_i = rows as i32;
            b.arg(&w)
                .arg(&x)
                .arg(&y)
                .arg(&ni)
                .arg(&oi)
                .arg(&ki)
                .arg(&rows_i);
            let smem = (rows * k * 2) as u32;
            // SAFETY: see the function's contract; the tile is at most 48 KiB (the kernels are
            // opted in beyond the default limit, which the tile and the static part exceed).
            unsafe { b.launch(grid((o.div_ceil(rows) as u32, 1, 1), 256, smem)) }.op("matmul")?;
        }
        GemvPath::Register => {
            let name = if n <= 4 { "gemv_bf16" } else { "gemv_bf16_8" };
            let mut b = dev.kernel("matmul", name)?;
            b.arg(&w).arg(&x).arg(&y).arg(&ni).arg(&oi).arg(&ki);
            // SAFETY: see the function's contract.
            // Eight warps of two rows each per block (`GEMV_RW` in `kernels/gemv.cu`).
            unsafe { b.launch(grid((o.div_ceil(16) as u32, 1, 1), 256, 0)) }.op("matmul")?;
        }
    }
    Ok(())
}

/// `ya = xa·waᵀ` and `yb = xb·wbᵀ` for one token each, in one launch of `gemv_bf16_pair`,
/// where [`plan::plan_gemv_pair`] takes it under `cfg` (where the automatic choice for each
/// alone is the register-streaming `gemv_bf16`: rows of `k` < 256 bf16). Returns false,
/// launching nothing, where it does not: the caller then runs two products.
///
/// # Safety
/// For each of `a` and `b` = `[x, w, y]`: `x` holds `k` f32, `w` `o * k` bf16 (`oa`, `ob`),
/// both 16-byte aligned, `k % 8 == 0`; `y` holds `o` f32.
pub(crate) unsafe fn gemv_bf16_pair(
    dev: &Device,
    cfg: &KernelConfig,
    a: [u64; 3],
    oa: usize,
    b: [u64; 3],
    ob: usize,
    k: usize,
) -> Result<bool> {
    if !plan::plan_gemv_pair(cfg, k, oa, ob) {
        return Ok(false);
    }
    let (oai, obi, ki) = (oa as i32, ob as i32, k as i32);
    let mut l = dev.kernel("matmul", "gemv_bf16_pair")?;
    l.arg(&a[1]).arg(&a[0]).arg(&a[2]).arg(&oai);
    l.arg(&b[1]).arg(&b[0]).arg(&b[2]).arg(&obi).arg(&ki);
    // Sixteen rows per block (`GEMV_RW` x 8 warps), `a`'s blocks first.
    let blocks = oa.div_ceil(16) + ob.div_ceil(16);
    // SAFETY: see the function's contract.
    unsafe { l.launch(grid((blocks as u32, 1, 1), 256, 0)) }.op("matmul")?;
    Ok(true)
}

/// Threads of a streamed kernel's CTA: the consumer warps and the producer warp
/// (`STREAM_THREADS` in `kernels/stream.cuh`).
pub(crate) const STREAM_THREADS: u32 = 32 * (plan::STREAM_CONSUMERS as u32 + 1);
