//! Launchers of `kernels/mxfp4.cu` besides the expert products ([`super::expert_mma`]):
//! widening an MXFP4 matrix to f32 and laying out stored blocks on the device. The device
//! layout of an MXFP4 matrix is made and described by [`crate::layout::mxfp4_device_tiles`].

use kimi_ops::Result;

use crate::device::{flat, Device};
use crate::error::OpContext;

fn int(v: usize, what: &str) -> Result<i32> {
    i32::try_from(v).map_err(|_| kimi_ops::Error::Unsupported(format!("MXFP4 matrix: {what} {v}")))
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
    let (ri, ci) = (int(rows, "rows")?, int(cols, "width")?);
    let mut b = dev.kernel("to_f32", "mxfp4_to_f32")?;
    b.arg(&w).arg(&out).arg(&ri).arg(&ci);
    // SAFETY: see the function's contract.
    unsafe { b.launch(flat(rows * cols)) }.op("to_f32")?;
    Ok(())
}

/// Lays out an MXFP4 `[rows, cols]` matrix for the device from ggml `block_mxfp4` bytes
/// already on the device (`blocks`), into `w`, which holds the device layout of a matrix of
/// this shape (its zero padding is kept): a slot fill whose blocks crossed the host link as
/// stored. The same bytes as `layout::mxfp4_device_tiles`.
///
/// # Safety
/// `blocks` holds `rows * cols / 32` blocks of 17 bytes (`cols % 32 == 0`) and `w`
/// `layout::mxfp4_device_bytes(rows, cols)` bytes; the two do not overlap.
pub(crate) unsafe fn from_blocks(
    dev: &Device,
    blocks: u64,
    w: u64,
    rows: usize,
    cols: usize,
) -> Result<()> {
    let (ri, ci) = (int(rows, "rows")?, int(cols, "width")?);
    let mut b = dev.kernel("from_blocks", "mxfp4_from_blocks")?;
    b.arg(&blocks).arg(&w).arg(&ri).arg(&ci);
    // SAFETY: see the function's contract.
    unsafe { b.launch(flat(rows * (cols / 32))) }.op("from_blocks")?;
    Ok(())
}
