//! Launchers of `kernels/mla.cu`.
//!
//! A layer's latent cache is a pool `[num_blocks, block_size, r + dr]`; a sequence's
//! position `s` is row `s % block_size` of block `table[s / block_size]`, where `table` is
//! the sequence's block table as device u32s (see `kimi_ops::PagedSeq`).

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

/// A sequence's rows in a paged pool.
#[derive(Clone, Copy)]
pub(crate) struct Paged {
    /// The pool `[num_blocks, block_size, width]` f32.
    pub(crate) pool: u64,
    /// The sequence's block table, u32 block ids.
    pub(crate) table: u64,
    /// Rows per block.
    pub(crate) block_size: usize,
    /// Row width.
    pub(crate) width: usize,
}

/// Writes `len` rows `[len, width]` from `src` at the sequence's positions `first ..`.
///
/// # Safety
/// `src` holds `len * width` f32; the table covers positions `first .. first+len` with
/// blocks inside the pool.
pub(crate) unsafe fn write_rows(
    dev: &Device,
    src: u64,
    dst: Paged,
    first: usize,
    len: usize,
) -> Result<()> {
    if len == 0 {
        return Ok(());
    }
    let (bs, first, lw) = (dst.block_size as i32, first as i32, dst.width as i32);
    let mut b = dev.kernel("mla", "mla_paged_write")?;
    b.arg(&src).arg(&dst.pool).arg(&dst.table);
    b.arg(&bs).arg(&first).arg(&lw);
    // SAFETY: see the function's contract.
    unsafe { b.launch(grid((len as u32, 1, 1), 128, 0)) }.op("mla")?;
    Ok(())
}

/// Copies columns `0 .. ncols` of the sequence's positions `0 .. total` to `out
/// [total, ncols]`.
///
/// # Safety
/// `out` holds `total * ncols` f32, `ncols <= width`; the table covers `total` positions
/// with blocks inside the pool.
pub(crate) unsafe fn gather(
    dev: &Device,
    src: Paged,
    total: usize,
    ncols: usize,
    out: u64,
) -> Result<()> {
    if total == 0 {
        return Ok(());
    }
    let (bs, lw, nc) = (src.block_size as i32, src.width as i32, ncols as i32);
    let mut b = dev.kernel("mla", "mla_paged_gather")?;
    b.arg(&src.pool).arg(&src.table);
    b.arg(&bs).arg(&lw).arg(&nc).arg(&out);
    // SAFETY: see the function's contract.
    unsafe { b.launch(grid((total as u32, 1, 1), 128, 0)) }.op("mla")?;
    Ok(())
}

/// Attention of `len` new queries over the sequence's `past + len` cached latents.
///
/// # Safety
/// `q` holds `len * H*(dn+dr)` f32 (this segment's rows), `cache` is a pool of rows of
/// `r+dr` f32 whose table covers `past+len` positions, `out` holds `len * H*dv` f32, and
/// the form's buffers their documented sizes.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn attention(
    dev: &Device,
    q: u64,
    cache: Paged,
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
    let bs = cache.block_size as i32;
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
            b.arg(&q).arg(&cache.pool).arg(&cache.table).arg(&bs);
            b.arg(&kv).arg(&out).arg(&p);
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
            b.arg(&q).arg(&cache.pool).arg(&cache.table).arg(&bs);
            b.arg(&kv_b).arg(&dt).arg(&out).arg(&p);
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
