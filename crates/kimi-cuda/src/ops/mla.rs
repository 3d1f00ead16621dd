//! Launchers of `kernels/mla.cu`.

use cudarc::driver::PushKernelArg;
use kimi_ops::{Error, MlaDims, Result};

use crate::device::{grid, Device, MAX_DYNAMIC_SMEM_BYTES};
use crate::error::OpContext;

/// Where the decompressed or absorbed form reads its keys and values.
pub(crate) enum Form {
    /// `kv [total, H*(dn+dv)]` f32, decompressed by a GEMM.
    Expanded { kv: u64 },
    /// `kv_b [H*(dn+dv), r]` in dtype `dt`.
    Absorbed { kv_b: u64, dt: i32 },
}

/// Attention of `len` new queries over `past + len` cached latents.
///
/// # Safety
/// `q` holds `len * H*(dn+dr)` f32 (this segment's rows), `cache` `(past+len) * (r+dr)`
/// f32, `out` `len * H*dv` f32, and the form's buffers their documented sizes.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn attention(
    dev: &Device,
    q: u64,
    cache: u64,
    form: Form,
    out: u64,
    past: usize,
    len: usize,
    dims: &MlaDims,
) -> Result<()> {
    let total = past + len;
    let (h, r, dn, dr, dv) = (
        dims.num_heads as i32,
        dims.kv_lora_rank as i32,
        dims.qk_nope_head_dim as i32,
        dims.qk_rope_head_dim as i32,
        dims.v_head_dim as i32,
    );
    let p = past as i32;
    let cfg = |floats: usize| -> Result<_> {
        let bytes = floats * 4;
        if bytes > MAX_DYNAMIC_SMEM_BYTES as usize {
            return Err(Error::Unsupported(format!(
                "mla over {total} cached tokens (shared-memory scores; long contexts need the tiled kernel)"
            )));
        }
        Ok(grid(
            (len as u32, dims.num_heads as u32, 1),
            256,
            bytes as u32,
        ))
    };
    match form {
        Form::Expanded { kv } => {
            let c = cfg(total)?;
            let mut b = dev.kernel("mla", "mla_expanded")?;
            b.arg(&q).arg(&cache).arg(&kv).arg(&out).arg(&p);
            b.arg(&h)
                .arg(&r)
                .arg(&dn)
                .arg(&dr)
                .arg(&dv)
                .arg(&dims.scale);
            // SAFETY: see the function's contract.
            unsafe { b.launch(c) }.op("mla")?;
        }
        Form::Absorbed { kv_b, dt } => {
            let c = cfg(total + 2 * dims.kv_lora_rank)?;
            let mut b = dev.kernel("mla", "mla_absorbed")?;
            b.arg(&q).arg(&cache).arg(&kv_b).arg(&dt).arg(&out).arg(&p);
            b.arg(&h)
                .arg(&r)
                .arg(&dn)
                .arg(&dr)
                .arg(&dv)
                .arg(&dims.scale);
            // SAFETY: see the function's contract.
            unsafe { b.launch(c) }.op("mla")?;
        }
    }
    Ok(())
}
