//! Launchers of `kernels/mla_fp8.cu`: quantizing new latent rows into an FP8 pool and
//! widening a sequence's FP8 rows for the expanded prefill (the decode kernels are
//! [`super::mla::absorbed`]'s, with its `fp8` flag).

use kimi_ops::Result;

use crate::device::{grid, Device};
use crate::error::OpContext;
use crate::ops::mla::Paged;

fn to_i32(x: usize, what: &str) -> Result<i32> {
    i32::try_from(x)
        .map_err(|_| kimi_ops::Error::Unsupported(format!("mla fp8 {what} {x} exceeds i32")))
}

/// Quantizes each row `j < n` of `src [n, width]` into its sequence's position of the FP8
/// pool, as [`super::mla::write_rows_all`] places f32 rows; columns `< split` share one
/// scale and the rest another.
///
/// # Safety
/// `src` holds `n * width` f32 and `where_` `2n` u32; every table named covers its rows'
/// positions with blocks inside the pool `[_, block_size, width]` of `8 + width`-byte rows.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn write_rows_all(
    dev: &Device,
    src: u64,
    pool: u64,
    tables: u64,
    where_: u64,
    n: usize,
    block_size: usize,
    width: usize,
    split: usize,
) -> Result<()> {
    if n == 0 {
        return Ok(());
    }
    let (bs, lw, r) = (
        to_i32(block_size, "block size")?,
        to_i32(width, "width")?,
        to_i32(split, "split")?,
    );
    let mut b = dev.kernel("mla", "mla_fp8_write_rows")?;
    b.arg(&src).arg(&pool).arg(&tables).arg(&where_);
    b.arg(&bs).arg(&lw).arg(&r);
    // SAFETY: see the function's contract; one CTA of 128 threads (a multiple of 32, as
    // the kernel's block reduction needs) per row.
    unsafe { b.launch(grid((n as u32, 1, 1), 128, 0)) }.op("mla")?;
    Ok(())
}

/// Widens columns `0 .. ncols` of the sequence's FP8 positions `0 .. total` into `out
/// [total, ncols]` f32; columns `< split` take a row's first scale, the rest its second.
///
/// # Safety
/// `out` holds `total * ncols` f32, `ncols <= src.width`; the table covers `total`
/// positions with blocks inside the pool of `8 + width`-byte rows.
pub(crate) unsafe fn gather(
    dev: &Device,
    src: Paged,
    split: usize,
    total: usize,
    ncols: usize,
    out: u64,
) -> Result<()> {
    if total == 0 {
        return Ok(());
    }
    let (bs, lw, r, nc) = (
        to_i32(src.block_size, "block size")?,
        to_i32(src.width, "width")?,
        to_i32(split, "split")?,
        to_i32(ncols, "columns")?,
    );
    let mut b = dev.kernel("mla", "mla_fp8_gather")?;
    b.arg(&src.pool).arg(&src.table);
    b.arg(&bs).arg(&lw).arg(&r).arg(&nc).arg(&out);
    // SAFETY: see the function's contract; one CTA per position.
    unsafe { b.launch(grid((total as u32, 1, 1), 128, 0)) }.op("mla")?;
    Ok(())
}
