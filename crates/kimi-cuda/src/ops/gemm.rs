//! `y [n, out] = x [n, in] · wᵀ` with `w [out, in]` row-major, through cuBLAS.
//!
//! Row-major `y = x·wᵀ` is column-major `yᵀ (out×n) = op(W) · X` with `W` read as the
//! column-major `[in × out]` matrix `wᵀ`, transposed: `gemm(T, N, m=out, n, k=in)`.

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
    let name = if n <= 4 { "gemv_bf16" } else { "gemv_bf16_8" };
    let mut b = dev.kernel("matmul", name)?;
    b.arg(&w).arg(&x).arg(&y).arg(&ni).arg(&oi).arg(&ki);
    // SAFETY: see the function's contract.
    // Eight warps of two rows each per block (`GEMV_RW` in `kernels/gemv.cu`).
    unsafe { b.launch(grid((o.div_ceil(16) as u32, 1, 1), 256, 0)) }.op("matmul")?;
    Ok(())
}
