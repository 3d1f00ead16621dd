//! `y [n, out] = x [n, in] · wᵀ` with `w [out, in]` row-major, through cuBLAS.
//!
//! Row-major `y = x·wᵀ` is column-major `yᵀ (out×n) = op(W) · X` with `W` read as the
//! column-major `[in × out]` matrix `wᵀ`, transposed: `gemm(T, N, m=out, n, k=in)`.

use std::sync::atomic::{AtomicUsize, Ordering};

use cudarc::cublas::sys::cudaDataType;
use kimi_ops::Result;

use crate::device::{grid, Device};
use crate::error::OpContext;
use crate::graph::{GemmOp, Op};

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
/// (see `kernels/gemv.cu`).
///
/// # Safety
/// `x` holds `n * k` f32 and `w` `o * k` bf16, both 16-byte aligned, `k % 8 == 0`; `y` holds
/// `n * o` f32.
pub(crate) unsafe fn gemv_bf16(
    dev: &Device,
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
    if n > 8 {
        return Err(kimi_ops::Error::Device(format!(
            "gemv_bf16: {n} rows, at most 8"
        )));
    }
    let bulk = match GEMV_VARIANT.load(Ordering::Relaxed) {
        1 => None,
        2 => bulk_rows(k),
        _ => bulk_rows(k).filter(|_| prefers_bulk(n, k, o)),
    };
    if let Some(rows) = bulk {
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
        // SAFETY: see the function's contract; the tile fits the default 48 KiB.
        unsafe { b.launch(grid((o.div_ceil(rows) as u32, 1, 1), 256, smem)) }.op("matmul")?;
        return Ok(());
    }
    let name = if n <= 4 { "gemv_bf16" } else { "gemv_bf16_8" };
    let mut b = dev.kernel("matmul", name)?;
    b.arg(&w).arg(&x).arg(&y).arg(&ni).arg(&oi).arg(&ki);
    // SAFETY: see the function's contract.
    // Eight warps of two rows each per block (`GEMV_RW` in `kernels/gemv.cu`).
    unsafe { b.launch(grid((o.div_ceil(16) as u32, 1, 1), 256, 0)) }.op("matmul")?;
    Ok(())
}

/// Shared memory a `gemv_bulk` CTA may use for its weight tile (the default limit, so the
/// kernel needs no opt-in).
const BULK_TILE_BYTES: usize = 48 * 1024;

/// Weight rows per `gemv_bulk` CTA for rows of `k` bf16: the largest of 8, 4, 2, 1 whose
/// tile fits [`BULK_TILE_BYTES`]; `None` when not even one row does.
fn bulk_rows(k: usize) -> Option<usize> {
    [8, 4, 2, 1]
        .into_iter()
        .find(|r| r * k * 2 <= BULK_TILE_BYTES)
}

/// Where `gemv_bulk` beat `gemv_bf16` on an H200 (`check gemv-bench`,
/// device-results/2026-11-30-session5): at one token everywhere but very short rows (it
/// fetches a whole tile per DRAM round trip); at up to 8 tokens only on narrow matrices
/// (o <= 1024: router, MLA kv_a, shared expert gate/up, 2.3-2.5x faster) and very long
/// rows (k >= 8192), since it re-reads every activation row per CTA from L2.
fn prefers_bulk(n: usize, k: usize, o: usize) -> bool {
    k >= 256 && (n == 1 || o <= 1024 || k >= 8192)
}

/// Which GEMV kernel small-batch bf16 matmuls use: 0 = automatic ([`prefers_bulk`]),
/// 1 = always the register-streaming `gemv_bf16`, 2 = `gemv_bulk` wherever its tile fits.
/// For tuning and comparison.
static GEMV_VARIANT: AtomicUsize = AtomicUsize::new(0);

/// Sets [`GEMV_VARIANT`].
pub(crate) fn set_gemv_variant(v: usize) {
    GEMV_VARIANT.store(v, Ordering::Relaxed);
}
