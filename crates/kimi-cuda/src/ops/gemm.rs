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
    let variant = GEMV_VARIANT.load(Ordering::Relaxed);
    // One token, on request: the persistent streamed kernel, with the activation row staged.
    // It matched `gemv_bulk` at the model's shapes but not bettered it (o_proj was slower;
    // device-results/2026-12-01-session11), so the automatic choice stays with the latter.
    let stream = match variant {
        3 if n == 1 => stream_plan(dev, k, o, 1, k * 4),
        _ => None,
    };
    if let Some(plan) = stream {
        let mut b = dev.kernel("matmul", "gemv_stream_1")?;
        let (rows, stages) = (plan.rows as i32, plan.stages as i32);
        b.arg(&w)
            .arg(&x)
            .arg(&y)
            .arg(&oi)
            .arg(&ki)
            .arg(&rows)
            .arg(&stages);
        // SAFETY: see the function's contract; `stream_plan` checked k against the tile's
        // column slices and sized the stages within the kernel's opted-in shared memory.
        unsafe { b.launch(grid((plan.grid as u32, 1, 1), STREAM_THREADS, plan.smem)) }
            .op("matmul")?;
        return Ok(());
    }
    let bulk = match variant {
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
        // SAFETY: see the function's contract; the tile is at most 48 KiB (the kernels are
        // opted in beyond the default limit, which the tile and the static part exceed).
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

/// `ya = xa·waᵀ` and `yb = xb·wbᵀ` for one token each, in one launch of `gemv_bf16_pair`,
/// where the automatic choice for each alone is the register-streaming `gemv_bf16` (rows
/// of `k` < 256 bf16). Returns false, launching nothing, where it is not: the caller then
/// runs two products.
///
/// # Safety
/// For each of `a` and `b` = `[x, w, y]`: `x` holds `k` f32, `w` `o * k` bf16 (`oa`, `ob`),
/// both 16-byte aligned, `k % 8 == 0`; `y` holds `o` f32.
pub(crate) unsafe fn gemv_bf16_pair(
    dev: &Device,
    a: [u64; 3],
    oa: usize,
    b: [u64; 3],
    ob: usize,
    k: usize,
) -> Result<bool> {
    if GEMV_VARIANT.load(Ordering::Relaxed) != 0 || prefers_bulk(1, k, oa.max(ob)) || oa * ob == 0 {
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

/// How a streamed one-token product (`gemv_stream_1`, `moe_stream_1`) is cut: output rows
/// per tile, shared-memory stages, CTAs and dynamic shared memory per CTA (stages, then the
/// staged activations).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct StreamPlan {
    pub(crate) rows: usize,
    pub(crate) stages: usize,
    pub(crate) grid: usize,
    pub(crate) smem: u32,
}

/// Bytes of one streamed tile at most, and of a CTA's stages and staged activations (one
/// CTA per SM). Tunable ([`set_stream_shape`]) for comparison.
static STREAM_TILE_BYTES: AtomicUsize = AtomicUsize::new(40 * 1024);
static STREAM_CTA_BYTES: AtomicUsize = AtomicUsize::new(200 * 1024);
/// `STREAM_MAX_ROWS`, `STREAM_CONSUMERS`, `STREAM_MAX_STAGES` and `STREAM_THREADS` in
/// `kernels/stream.cuh`.
const STREAM_MAX_ROWS: usize = 16;
const STREAM_CONSUMERS: usize = 8;
const STREAM_MAX_STAGES: usize = 8;
pub(crate) const STREAM_THREADS: u32 = 32 * (STREAM_CONSUMERS as u32 + 1);

/// Once per process: `KIMI_CUDA_STREAM_SHAPE` = "TILE_KIB,CTA_KIB" sets the streamed
/// kernels' shape (as [`set_stream_shape`], which still overrides it), for measurements.
fn stream_shape_from_env() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        if let Ok(v) = std::env::var("KIMI_CUDA_STREAM_SHAPE") {
            let kib: Vec<usize> = v.split(',').filter_map(|x| x.trim().parse().ok()).collect();
            if let [tile, cta] = kib[..] {
                store_stream_shape(tile << 10, cta << 10);
            }
        }
    });
}

/// Sets the streamed kernels' tile bytes and shared memory per CTA (0 keeps a value).
pub(crate) fn set_stream_shape(tile_bytes: usize, cta_bytes: usize) {
    stream_shape_from_env();
    store_stream_shape(tile_bytes, cta_bytes);
}

fn store_stream_shape(tile_bytes: usize, cta_bytes: usize) {
    for (v, a) in [
        (tile_bytes, &STREAM_TILE_BYTES),
        (cta_bytes, &STREAM_CTA_BYTES),
    ] {
        if v > 0 {
            a.store(v, Ordering::Relaxed);
        }
    }
}

/// The cut of a streamed product over `o` output rows of `k` bf16 (`per_row` weight rows
/// per output row: 2 for gate + up), with `staged` bytes of activations in shared memory;
/// `None` where it does not apply. A tile takes the most rows that fit the tile bytes, up
/// to 8 weight rows per consumer warp... while still leaving every CTA two tiles; tiles of
/// fewer than 8 weight rows split rows into column slices, which must divide k into
/// 256-column multiples.
pub(crate) fn stream_plan(
    dev: &Device,
    k: usize,
    o: usize,
    per_row: usize,
    staged: usize,
) -> Option<StreamPlan> {
    if k == 0 || o == 0 || !k.is_multiple_of(256) {
        return None;
    }
    stream_shape_from_env();
    let tile_cap = STREAM_TILE_BYTES.load(Ordering::Relaxed);
    let row_bytes = k * 2 * per_row;
    let ctas = dev.sm_count;
    let fits = |r: usize| {
        let wrows = r * per_row;
        let slices = (STREAM_CONSUMERS / wrows).max(1);
        wrows <= STREAM_MAX_ROWS && r * row_bytes <= tile_cap && k.is_multiple_of(256 * slices)
    };
    let rows = [16usize, 8, 4, 2, 1]
        .into_iter()
        .filter(|&r| fits(r))
        .find(|&r| o.div_ceil(r) >= 2 * ctas)
        .or_else(|| [1usize, 2, 4, 8, 16].into_iter().find(|&r| fits(r)))?;
    let tile = rows * row_bytes;
    let budget = STREAM_CTA_BYTES
        .load(Ordering::Relaxed)
        .min(crate::device::MAX_DYNAMIC_SMEM_BYTES as usize);
    let stages = (budget.checked_sub(staged)? / tile).min(STREAM_MAX_STAGES);
    if stages < 2 {
        return None;
    }
    Some(StreamPlan {
        rows,
        stages,
        grid: o.div_ceil(rows).min(ctas),
        smem: (stages * tile + staged) as u32,
    })
}

/// Which GEMV kernel small-batch bf16 matmuls use: 0 = automatic ([`prefers_bulk`]), 1 =
/// always the register-streaming `gemv_bf16`, 2 = `gemv_bulk` wherever its tile fits, 3 =
/// the persistent `gemv_stream_1` for one token (else as 0). For tuning and comparison.
static GEMV_VARIANT: AtomicUsize = AtomicUsize::new(0);

/// Sets [`GEMV_VARIANT`].
pub(crate) fn set_gemv_variant(v: usize) {
    GEMV_VARIANT.store(v, Ordering::Relaxed);
}
