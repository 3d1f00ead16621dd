//! Launchers of `kernels/moe.cu`.

use cudarc::driver::PushKernelArg;
use kimi_ops::{MoeRouting, Result};

use crate::device::{grid, Device};
use crate::error::OpContext;

/// Routes `n` tokens from f32 router logits `[n, e]`: writes `ids` and `weights`
/// `[n, top_k]`.
///
/// # Safety
/// `logits` holds `n * e` f32, `bias` (unless `has_bias` is 0) `e` elements of dtype `bdt`,
/// `ids`/`weights` `n * top_k` entries; `num_groups <= 64` and divides `e`.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn route(
    dev: &Device,
    logits: u64,
    bias: u64,
    bdt: i32,
    ids: u64,
    weights: u64,
    n: usize,
    e: usize,
    r: &MoeRouting,
) -> Result<()> {
    let has_bias = (bias != 0) as i32;
    let (ei, k, g, kg) = (
        e as i32,
        r.top_k as i32,
        r.num_groups as i32,
        r.topk_group as i32,
    );
    let (renorm, use_bias) = (r.renormalize as i32, r.weights_use_bias as i32);
    let mut b = dev.kernel("moe", "moe_route")?;
    b.arg(&logits)
        .arg(&bias)
        .arg(&bdt)
        .arg(&has_bias)
        .arg(&ids)
        .arg(&weights);
    b.arg(&ei)
        .arg(&k)
        .arg(&g)
        .arg(&kg)
        .arg(&renorm)
        .arg(&r.scaling)
        .arg(&use_bias);
    // SAFETY: see the function's contract; shared memory holds 3 * e floats.
    unsafe { b.launch(grid((n as u32, 1, 1), 256, (3 * e * 4) as u32)) }.op("moe")?;
    Ok(())
}
