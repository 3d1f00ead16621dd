//! Launchers of `kernels/conv.cu`.

use kimi_ops::Result;

use crate::device::{flat, grid, Device};

/// Tokens per thread of `short_conv_silu_w*` (`CONV_RUN` in `kernels/conv.cu`).
const CONV_RUN: usize = 16;
use crate::error::OpContext;

/// Convolution + SiLU of rows `start..start+len` of `x [n, c]` and the next state.
///
/// # Safety
/// `x`/`out` hold `n * c` f32 with `start + len <= n`; `w` holds `c * width` of dtype
/// `wdt`; `state` and `next_state` hold `(width - 1) * c` f32 and do not overlap.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn short_conv_silu(
    dev: &Device,
    x: u64,
    w: u64,
    wdt: i32,
    state: u64,
    next_state: u64,
    out: u64,
    start: usize,
    len: usize,
    c: usize,
    width: usize,
) -> Result<()> {
    let (s, l, ci, wi) = (start as i32, len as i32, c as i32, width as i32);
    // Widths 2-4 (Kimi's is 4): one thread per (channel, run of 16 tokens).
    let runs = len.div_ceil(CONV_RUN);
    if len * c > 0 && (2..=4).contains(&width) && runs <= 65_535 {
        let name = [
            "short_conv_silu_w2",
            "short_conv_silu_w3",
            "short_conv_silu_w4",
        ][width - 2];
        let mut b = dev.kernel("short_conv", name)?;
        b.arg(&x).arg(&w).arg(&wdt).arg(&state).arg(&out);
        b.arg(&s).arg(&l).arg(&ci);
        let cfg = grid((c.div_ceil(128) as u32, runs as u32, 1), 128, 0);
        // SAFETY: see the function's contract; the grid covers c channels × len tokens.
        unsafe { b.launch(cfg) }.op("short_conv")?;
    } else if len * c > 0 {
        let mut b = dev.kernel("short_conv", "short_conv_silu")?;
        b.arg(&x).arg(&w).arg(&wdt).arg(&state).arg(&out);
        b.arg(&s).arg(&l).arg(&ci).arg(&wi);
        // SAFETY: see the function's contract.
        unsafe { b.launch(flat(len * c)) }.op("short_conv")?;
    }
    if (width - 1) * c > 0 {
        let mut b = dev.kernel("short_conv", "short_conv_state")?;
        b.arg(&x).arg(&state).arg(&next_state);
        b.arg(&s).arg(&l).arg(&ci).arg(&wi);
        // SAFETY: see the function's contract.
        unsafe { b.launch(flat((width - 1) * c)) }.op("short_conv")?;
    }
    Ok(())
}
