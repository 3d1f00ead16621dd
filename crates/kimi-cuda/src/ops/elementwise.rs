//! Launchers of `kernels/elementwise.cu`.

use kimi_ops::Result;

use crate::device::{flat, grid, Device};
use crate::error::OpContext;

/// `out [ids.len(), d] = table[ids]`.
///
/// # Safety
/// `table` holds `vocab * d` elements of dtype `dt`, every id is below `vocab`, `ids` holds
/// `num_ids` u32 and `out` `num_ids * d` f32, all on `dev`.
pub(crate) unsafe fn embedding(
    dev: &Device,
    table: u64,
    dt: i32,
    ids: u64,
    out: u64,
    num_ids: usize,
    d: usize,
) -> Result<()> {
    let d = d as i32;
    let mut b = dev.kernel("embedding", "embedding")?;
    b.arg(&table).arg(&dt).arg(&ids).arg(&out).arg(&d);
    // SAFETY: the caller guarantees the buffers; one block per id.
    unsafe { b.launch(grid((num_ids as u32, 1, 1), 256, 0)) }.op("embedding")?;
    Ok(())
}

/// Row RMSNorm of `x [rows, d]` times `w [d]` (dtype `wdt`), optionally times `sigmoid(z)`.
///
/// # Safety
/// `x`, `out` (and `z` unless 0) hold `rows * d` f32; `w` holds `d` elements.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn rms_norm(
    dev: &Device,
    x: u64,
    w: u64,
    wdt: i32,
    z: u64,
    out: u64,
    rows: usize,
    d: usize,
    eps: f32,
) -> Result<()> {
    if z == 0 {
        if let Some(threads) = vec_norm_threads(d, &[x, out]) {
            let di = d as i32;
            let mut b = dev.kernel("rms_norm", "rms_norm_vec")?;
            b.arg(&x).arg(&w).arg(&wdt).arg(&out).arg(&di).arg(&eps);
            // SAFETY: see the function's contract; one block per row, d % 4 == 0, aligned.
            unsafe { b.launch(grid((rows as u32, 1, 1), threads, 0)) }.op("rms_norm")?;
            return Ok(());
        }
    }
    // Short rows (the per-head gated norm): a warp per row.
    if d <= 1024 && rows <= i32::MAX as usize {
        let (ri, di) = (rows as i32, d as i32);
        let mut b = dev.kernel("rms_norm", "rms_norm_warp")?;
        b.arg(&x)
            .arg(&w)
            .arg(&wdt)
            .arg(&z)
            .arg(&out)
            .arg(&ri)
            .arg(&di)
            .arg(&eps);
        // SAFETY: see the function's contract; 8 rows per block.
        unsafe { b.launch(grid((rows.div_ceil(8) as u32, 1, 1), 256, 0)) }.op("rms_norm")?;
        return Ok(());
    }
    let d = d as i32;
    let mut b = dev.kernel("rms_norm", "rms_norm")?;
    b.arg(&x)
        .arg(&w)
        .arg(&wdt)
        .arg(&z)
        .arg(&out)
        .arg(&d)
        .arg(&eps);
    // SAFETY: see the function's contract; one block per row.
    unsafe { b.launch(grid((rows as u32, 1, 1), 256, 0)) }.op("rms_norm")?;
    Ok(())
}

/// Floats per thread of `rms_norm_vec` / `add_rms_norm_vec` (`NORM_V` float4s).
const NORM_VEC_FLOATS: usize = 8;

/// Threads per row for the register-resident norm kernels when rows of `d` fit them
/// (`d % 4 == 0`, at most 1024 threads) and every row pointer is 16-byte aligned.
fn vec_norm_threads(d: usize, ptrs: &[u64]) -> Option<u32> {
    let threads = d.div_ceil(NORM_VEC_FLOATS).next_multiple_of(32);
    (d > 0 && d.is_multiple_of(4) && threads <= 1024 && ptrs.iter().all(|p| p.is_multiple_of(16)))
        .then_some(threads as u32)
}

/// `x += y`, then `out` = row RMSNorm of `x` times `w [d]` (dtype `wdt`).
///
/// # Safety
/// `x`, `y` and `out` hold `rows * d` f32 (`out` not aliasing `x`); `w` holds `d` elements.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn add_rms_norm(
    dev: &Device,
    x: u64,
    y: u64,
    w: u64,
    wdt: i32,
    out: u64,
    rows: usize,
    d: usize,
    eps: f32,
) -> Result<()> {
    if let Some(threads) = vec_norm_threads(d, &[x, y, out]) {
        let di = d as i32;
        let mut b = dev.kernel("rms_norm", "add_rms_norm_vec")?;
        b.arg(&x)
            .arg(&y)
            .arg(&w)
            .arg(&wdt)
            .arg(&out)
            .arg(&di)
            .arg(&eps);
        // SAFETY: see the function's contract; one block per row, d % 4 == 0, aligned.
        unsafe { b.launch(grid((rows as u32, 1, 1), threads, 0)) }.op("rms_norm")?;
        return Ok(());
    }
    let d = d as i32;
    let mut b = dev.kernel("rms_norm", "add_rms_norm")?;
    b.arg(&x)
        .arg(&y)
        .arg(&w)
        .arg(&wdt)
        .arg(&out)
        .arg(&d)
        .arg(&eps);
    // SAFETY: see the function's contract; one block per row.
    unsafe { b.launch(grid((rows as u32, 1, 1), 256, 0)) }.op("rms_norm")?;
    Ok(())
}

/// Launches a grid-stride kernel over `n` elements with arguments `(a, b, n)`.
///
/// # Safety
/// `a` and `b` are valid for the kernel's accesses of `n` elements.
pub(crate) unsafe fn binary(
    dev: &Device,
    op: &'static str,
    kernel: &str,
    a: u64,
    b_: u64,
    n: usize,
) -> Result<()> {
    let mut b = dev.kernel(op, kernel)?;
    b.arg(&a).arg(&b_).arg(&n);
    // SAFETY: see the function's contract.
    unsafe { b.launch(flat(n)) }.op(op)?;
    Ok(())
}

/// `out[r] = [a[r] (wa f32) | b[r] (wb f32)]` for `rows` rows, in one launch.
///
/// # Safety
/// `a` holds `rows * wa`, `b` `rows * wb` and `out` `rows * (wa + wb)` f32.
pub(crate) unsafe fn concat_cols2(
    dev: &Device,
    a: u64,
    wa: usize,
    b_: u64,
    wb: usize,
    out: u64,
    rows: usize,
) -> Result<()> {
    let n = rows * (wa + wb);
    if n == 0 {
        return Ok(());
    }
    let (wai, wbi, ri) = (wa as i32, wb as i32, rows as i32);
    let mut b = dev.kernel("concat_cols", "concat_cols2")?;
    b.arg(&a).arg(&wai).arg(&b_).arg(&wbi).arg(&out).arg(&ri);
    // SAFETY: see the function's contract.
    unsafe { b.launch(flat(n)) }.op("concat_cols")?;
    Ok(())
}

/// `dst[r, dst_off..dst_off+w] = src[r, src_off..src_off+w]` for `rows` rows (f32).
///
/// # Safety
/// Both matrices hold `rows` rows of their leading dimension.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn copy_cols(
    dev: &Device,
    src: u64,
    src_ld: usize,
    src_off: usize,
    dst: u64,
    dst_ld: usize,
    dst_off: usize,
    rows: usize,
    w: usize,
) -> Result<()> {
    if rows * w == 0 {
        return Ok(());
    }
    let (a, b_, c, d, e, f) = (
        src_ld as i32,
        src_off as i32,
        dst_ld as i32,
        dst_off as i32,
        rows as i32,
        w as i32,
    );
    let mut b = dev.kernel("copy_cols", "copy_cols")?;
    b.arg(&src)
        .arg(&a)
        .arg(&b_)
        .arg(&dst)
        .arg(&c)
        .arg(&d)
        .arg(&e)
        .arg(&f);
    // SAFETY: see the function's contract.
    unsafe { b.launch(flat(rows * w)) }.op("copy_cols")?;
    Ok(())
}

/// `out[i] = x[rows[i]]` (rows of width `d`, f32).
///
/// # Safety
/// `rows` holds `num_rows` u32 indices below `x`'s row count; `out` holds `num_rows * d`.
pub(crate) unsafe fn gather_rows(
    dev: &Device,
    x: u64,
    rows: u64,
    out: u64,
    num_rows: usize,
    d: usize,
) -> Result<()> {
    if num_rows == 0 {
        return Ok(());
    }
    let d = d as i32;
    let mut b = dev.kernel("gather_rows", "gather_rows")?;
    b.arg(&x).arg(&rows).arg(&out).arg(&d);
    // SAFETY: see the function's contract.
    unsafe { b.launch(grid((num_rows as u32, 1, 1), 256, 0)) }.op("gather_rows")?;
    Ok(())
}

/// `out[rows[i]] += weights[i] * y[i]` (atomic: a row may repeat, as the stand-in expert of
/// expert parallelism's absent pairs does, at weight 0).
///
/// # Safety
/// `y` holds `num_rows * d` f32, `rows`/`weights` `num_rows` entries, `out` every row named.
pub(crate) unsafe fn scatter_add_rows(
    dev: &Device,
    y: u64,
    rows: u64,
    weights: u64,
    out: u64,
    num_rows: usize,
    d: usize,
) -> Result<()> {
    if num_rows == 0 {
        return Ok(());
    }
    let d = d as i32;
    let mut b = dev.kernel("moe", "scatter_add_rows")?;
    b.arg(&y).arg(&rows).arg(&weights).arg(&out).arg(&d);
    // SAFETY: see the function's contract.
    unsafe { b.launch(grid((num_rows as u32, 1, 1), 256, 0)) }.op("moe")?;
    Ok(())
}

/// `out = f32(x)` for `n` elements of dtype `dt`.
///
/// # Safety
/// `x` holds `n` elements of dtype `dt`, `out` `n` f32.
pub(crate) unsafe fn cast_to_f32(dev: &Device, x: u64, dt: i32, out: u64, n: usize) -> Result<()> {
    let mut b = dev.kernel("cast", "cast_to_f32")?;
    b.arg(&x).arg(&dt).arg(&out).arg(&n);
    // SAFETY: see the function's contract.
    unsafe { b.launch(flat(n)) }.op("cast")?;
    Ok(())
}

/// `out = x ⊙ sigmoid(gate)`.
///
/// # Safety
/// `x`, `gate` and `out` hold `n` f32.
pub(crate) unsafe fn sigmoid_gate(
    dev: &Device,
    x: u64,
    gate: u64,
    out: u64,
    n: usize,
) -> Result<()> {
    let mut b = dev.kernel("sigmoid_gate", "sigmoid_gate")?;
    b.arg(&x).arg(&gate).arg(&out).arg(&n);
    // SAFETY: see the function's contract.
    unsafe { b.launch(flat(n)) }.op("sigmoid_gate")?;
    Ok(())
}

/// `gate = situ(gate, up)` in place (Kimi K3's SiTU-GLU; `linear_beta` 0 = the up half
/// unchanged).
///
/// # Safety
/// `gate` and `up` hold `n` f32.
pub(crate) unsafe fn situ_mul(
    dev: &Device,
    gate: u64,
    up: u64,
    n: usize,
    beta: f32,
    linear_beta: f32,
) -> Result<()> {
    let mut b = dev.kernel("ffn", "situ_mul")?;
    b.arg(&gate).arg(&up).arg(&n).arg(&beta).arg(&linear_beta);
    // SAFETY: see the function's contract.
    unsafe { b.launch(flat(n)) }.op("ffn")?;
    Ok(())
}
