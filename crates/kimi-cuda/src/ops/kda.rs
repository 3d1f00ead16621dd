//! Launchers of `kernels/kda.cu`.

use cudarc::driver::PushKernelArg;
use kimi_ops::{Error, Result};

use crate::device::{flat, grid, Device};
use crate::error::OpContext;

/// The forget gate over `f [n, width]` (`kind` 0 = softplus, 1 = lower bound `lb`).
///
/// # Safety
/// `f`/`g` hold `n` f32 (`n` a multiple of `width`); `a_log` holds `width / d` and `dt_bias`
/// `width` elements of their dtypes.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn gate(
    dev: &Device,
    f: u64,
    a_log: u64,
    adt: i32,
    dt_bias: u64,
    bdt: i32,
    g: u64,
    n: usize,
    width: usize,
    d: usize,
    kind: i32,
    lb: f32,
) -> Result<()> {
    let (wi, di) = (width as i32, d as i32);
    let mut b = dev.kernel("kda_gate", "kda_gate")?;
    b.arg(&f)
        .arg(&a_log)
        .arg(&adt)
        .arg(&dt_bias)
        .arg(&bdt)
        .arg(&g);
    b.arg(&n).arg(&wi).arg(&di).arg(&kind).arg(&lb);
    // SAFETY: see the function's contract.
    unsafe { b.launch(flat(n)) }.op("kda_gate")?;
    Ok(())
}

/// The recurrent gated delta rule over rows `start..start+len`, one block per head.
///
/// # Safety
/// `q, k, v, g, out` hold `n * h * d` f32 and `beta` `n * h` with `start + len <= n`;
/// `state` holds `h * d * d` f32.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn recurrent(
    dev: &Device,
    qkvg: [u64; 4],
    beta: u64,
    state: u64,
    out: u64,
    start: usize,
    len: usize,
    h: usize,
    d: usize,
) -> Result<()> {
    let threads = match d {
        0..=32 => 32,
        33..=64 => 64,
        65..=128 => 128,
        _ => {
            return Err(Error::Unsupported(format!(
                "kda with head_dim {d} (at most 128)"
            )))
        }
    };
    let name = format!("kda_recurrent_{threads}");
    let [q, k, v, g] = qkvg;
    let (s, l, hi, di) = (start as i32, len as i32, h as i32, d as i32);
    let mut b = dev.kernel("kda", &name)?;
    b.arg(&q)
        .arg(&k)
        .arg(&v)
        .arg(&g)
        .arg(&beta)
        .arg(&state)
        .arg(&out);
    b.arg(&s).arg(&l).arg(&hi).arg(&di);
    // SAFETY: see the function's contract; one block of `threads >= d` per head.
    unsafe { b.launch(grid((h as u32, 1, 1), threads, 0)) }.op("kda")?;
    Ok(())
}
