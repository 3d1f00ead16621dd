//! Launcher of `kernels/attn_res.cu`: Block Attention Residuals' softmax mix.

use kimi_ops::{Error, Result};

use crate::device::{grid, Device};
use crate::error::OpContext;

/// Most sources of one mix (`ATTN_RES_MAX_SOURCES` in the kernel). Kimi K3's largest mix
/// has 9 (8 stored blocks and the partial sum).
pub(crate) const MAX_SOURCES: usize = 64;

/// `struct AttnResSources` of `attn_res.cu`, passed by value as a kernel parameter.
#[repr(C)]
#[derive(Clone, Copy)]
struct Sources {
    src: [u64; MAX_SOURCES],
    count: i32,
}

// SAFETY: plain-old-data with the C layout of `struct AttnResSources` (the trailing padding
// of both is the same: the struct aligns to 8 bytes in C and in Rust).
unsafe impl cudarc::driver::DeviceRepr for Sources {}

/// `out [n, d]` = the per-token softmax mix of `sources` (each `[n, d]` f32) scored by
/// `w [d]` f32.
///
/// # Safety
/// Every source and `out` hold `n * d` f32 and `w` holds `d` f32.
pub(crate) unsafe fn mix(
    dev: &Device,
    sources: &[u64],
    w: u64,
    out: u64,
    n: usize,
    d: usize,
    eps: f32,
) -> Result<()> {
    const OP: &str = "attn_res_mix";
    if sources.is_empty() || sources.len() > MAX_SOURCES {
        return Err(Error::Unsupported(format!(
            "attn_res_mix over {} sources (1 to {MAX_SOURCES})",
            sources.len()
        )));
    }
    let mut s = Sources {
        src: [0; MAX_SOURCES],
        count: sources.len() as i32,
    };
    s.src[..sources.len()].copy_from_slice(sources);
    let di = d as i32;
    let mut b = dev.kernel(OP, "attn_res_mix")?;
    b.arg(&s).arg(&w).arg(&out).arg(&di).arg(&eps);
    // SAFETY: see the function's contract; one block per token.
    unsafe { b.launch(grid((n as u32, 1, 1), 256, 0)) }.op(OP)?;
    Ok(())
}
