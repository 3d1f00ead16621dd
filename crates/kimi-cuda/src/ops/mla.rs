//! Launchers of `kernels/mla.cu`: the flash-style expanded prefill and the split-KV
//! absorbed decode (q absorb → partial attention per latent chunk → combine → W_uv).

use kimi_ops::{Error, MlaDims, Result};

use crate::buffer::DevBuf;
use crate::device::{grid, Device, MAX_DYNAMIC_SMEM_BYTES};
use crate::error::OpContext;
use crate::plan::{self, KernelConfig, MlaPrefillFacts, MlaPrefillPath};

/// Queries per CTA of the flash prefill kernel.
const FLASH_BM: usize = 64;
/// Queries per CTA of the tensor-core prefill kernel (`fm::BM` in `mla.cu`).
const MMA_BM: usize = 128;
/// Keys per tile of the tensor-core prefill kernel (`fm::BN`).
const MMA_BN: usize = 64;
/// Query rows (token, head) per CTA of the decode kernel.
const DECODE_ROWS: usize = 32;
/// Latent rows per decode tile; chunk lengths are multiples of it.
const DECODE_TILE: usize = 16;
/// A decode chunk covers at least this many latent rows (fewer only for short contexts), so
/// the per-CTA query load and the merge stay small next to the rows read: the backend's
/// `KernelConfig::mla_decode_min_chunk` (at least 1), as a multiple of [`DECODE_TILE`].
fn decode_min_chunk(rows: usize) -> usize {
    round_up(rows.max(1), DECODE_TILE)
}
/// Decode CTAs to aim for: four per SM of an H200 (132 SMs; one resident CTA per SM).
const TARGET_CTAS: usize = 4 * 132;
/// CTAs per (head, token group) of `mla_uv_project`, each taking a share of the dv output
/// rows: with one token, H CTAs alone read W_uv far below the memory's bandwidth. Eight
/// leave each warp two rows at dv = 128, which the kernel loads whole before waiting for
/// its predecessor (`UV_PRE_J` rows of up to 512 weights).
const UV_SPLITS: usize = 8;
/// Absorbed queries (tokens) per launch group: bounds the q_cat, partial and o_lat buffers
/// (≤ ~55 MB on the real model) whatever the segment lengths.
const GROUP_TOKENS: usize = 128;

fn round_up(x: usize, m: usize) -> usize {
    x.div_ceil(m) * m
}

/// Shared-memory row stride of `smem_ld` in `mla.cu`.
fn smem_ld(w: usize) -> usize {
    round_up(w, 32) + 4
}

fn flash_smem_bytes(dq: usize) -> usize {
    (2 * FLASH_BM * smem_ld(dq) + 64 * 128 + FLASH_BM * 68) * 4
}

/// `flash_mma_smem_bytes` of `mla.cu`: Q, K and V tiles as hi and lo bf16 rows of `d + 8`.
fn mma_smem_bytes(dq: usize, dv: usize) -> usize {
    4 * (MMA_BM + MMA_BN) * (dq + 8) + 4 * MMA_BN * (dv + 8)
}

fn decode_smem_bytes(lw: usize) -> usize {
    (DECODE_ROWS * smem_ld(lw)
        + 2 * DECODE_TILE * smem_ld(lw)
        + 8 * DECODE_ROWS * 17
        + DECODE_TILE * DECODE_ROWS
        + 3 * DECODE_ROWS)
        * 4
}

fn aligned(ptrs: &[u64]) -> bool {
    ptrs.iter().all(|p| p.is_multiple_of(16))
}

fn dims_i32(dims: &MlaDims) -> Result<[i32; 5]> {
    let v = [
        dims.num_heads,
        dims.kv_lora_rank,
        dims.qk_nope_head_dim,
        dims.qk_rope_head_dim,
        dims.v_head_dim,
    ];
    let mut out = [0i32; 5];
    for (o, x) in out.iter_mut().zip(v) {
        *o = i32::try_from(x).map_err(|_| Error::Unsupported(format!("mla dims {dims:?}")))?;
    }
    Ok(out)
}

fn to_i32(x: usize, what: &str) -> Result<i32> {
    i32::try_from(x).map_err(|_| Error::Unsupported(format!("mla {what} {x} exceeds i32")))
}

/// Expanded (prefill) attention of one segment: `len` queries over `past + len` keys, on the
/// kernel [`plan::plan_mla_prefill`] picks under `cfg` for this segment's shapes and
/// buffers: FlashInfer's, the tensor-core kernel (under the split its operands as bf16
/// hi + lo pairs, near f32; without, bf16) or the f32 one.
///
/// # Safety
/// `q` holds this segment's `len` rows of `H*(dn+dr)` f32, `cache` `past+len` contiguous
/// rows of `r+dr` f32 (k_pe at column `r`), `kv` `past+len` rows of `H*(dn+dv)` f32
/// (k_nope ‖ v per head) and `out` `len` rows of `H*dv` f32, all on `dev`'s context.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn expanded(
    dev: &Device,
    q: u64,
    cache: u64,
    kv: u64,
    out: u64,
    past: usize,
    len: usize,
    dims: &MlaDims,
    cfg: &KernelConfig,
) -> Result<()> {
    if len == 0 {
        return Ok(());
    }
    let [h, r, dn, dr, dv] = dims_i32(dims)?;
    let dq = dims.qk_nope_head_dim + dims.qk_rope_head_dim;
    let mma_smem = mma_smem_bytes(dq, dims.v_head_dim);
    let facts = MlaPrefillFacts {
        flashinfer_heads: dq == 192
            && dims.v_head_dim == 128
            && dims.qk_nope_head_dim.is_multiple_of(4),
        aligned: aligned(&[q, cache, kv, out]),
        vec_widths: [
            dims.kv_lora_rank,
            dq,
            dims.qk_nope_head_dim,
            dims.v_head_dim,
        ]
        .iter()
        .all(|d| d.is_multiple_of(4)),
        mma_fits: dq.is_multiple_of(16)
            && dims.v_head_dim.is_multiple_of(16)
            && mma_smem <= MAX_DYNAMIC_SMEM_BYTES as usize,
        recording: crate::graph::recording(dev.stream.cu_stream()),
    };
    let path = plan::plan_mla_prefill(cfg, &facts);
    if path == MlaPrefillPath::FlashInfer {
        // SAFETY: the caller's contract; the planner took FlashInfer's kernel only for
        // heads of 192 / 128 with dn % 4 == 0, aligned buffers and no recorded pass.
        return unsafe { expanded_sm90(dev, q, cache, kv, out, past, len, dims) };
    }
    let smem = flash_smem_bytes(dq);
    if dims.v_head_dim > 128 || dq > 256 || smem > MAX_DYNAMIC_SMEM_BYTES as usize {
        return Err(Error::Unsupported(format!(
            "mla expanded with {dims:?} (needs dn+dr <= 256, dv <= 128)"
        )));
    }
    let mma = path == MlaPrefillPath::TensorCore;
    let (name, bm, smem) = match path {
        MlaPrefillPath::TensorCore => ("mla_flash_prefill_mma", MMA_BM, mma_smem),
        MlaPrefillPath::F32Vec => ("mla_flash_prefill_vec", FLASH_BM, smem),
        MlaPrefillPath::F32 | MlaPrefillPath::FlashInfer => ("mla_flash_prefill", FLASH_BM, smem),
    };
    let tiles = u32::try_from(len.div_ceil(bm))
        .map_err(|_| Error::Unsupported(format!("mla segment of {len} tokens")))?;
    let (p, n) = (to_i32(past, "past")?, to_i32(len, "len")?);
    to_i32(past + len, "context")?;
    let scale_log2 = dims.scale * std::f32::consts::LOG2_E;
    let split = i32::from(cfg.split());
    let mut b = dev.kernel("mla", name)?;
    b.arg(&q).arg(&cache).arg(&kv).arg(&out).arg(&p).arg(&n);
    b.arg(&h)
        .arg(&r)
        .arg(&dn)
        .arg(&dr)
        .arg(&dv)
        .arg(&scale_log2);
    if mma {
        b.arg(&split);
    }
    let shape = grid((tiles, dims.num_heads as u32, 1), 256, smem as u32);
    // SAFETY: grid (query tiles of `bm`, H) × 256 threads with the chosen kernel's dynamic
    // shared memory (opted in at load, within the limit), as the kernel expects; buffer sizes
    // per the contract above; the planner took the vec and mma variants only with widths
    // % 4 == 0 and 16-byte aligned pointers, mma only with dn+dr, dv % 16 == 0 (dn+dr <= 256,
    // dv <= 128 above).
    unsafe { b.launch(shape) }.op("mla")?;
    Ok(())
}

/// [`expanded`] with bf16 operands on FlashInfer's Hopper prefill kernel
/// (`flashinfer/mla_prefill.cu`): the segment's q, k and v packed as bf16 (`mla_pack_bf16`),
/// attention into bf16 rows, widened back to f32. Heads of 192 (q·k) and 128 (v) only.
///
/// # Safety
/// As [`expanded`], with dn + dr = 192, dv = 128, dn % 4 == 0, 16-byte aligned pointers, the
/// device's context current and no pass being recorded (the launch bypasses the recorder).
#[allow(clippy::too_many_arguments)]
unsafe fn expanded_sm90(
    dev: &Device,
    q: u64,
    cache: u64,
    kv: u64,
    out: u64,
    past: usize,
    len: usize,
    dims: &MlaDims,
) -> Result<()> {
    let [h, r, dn, dr, dv] = dims_i32(dims)?;
    let total = past + len;
    let (len_i, total_i) = (to_i32(len, "len")?, to_i32(total, "context")?);
    let heads = dims.num_heads;
    let (dq, dvu) = (192usize, 128usize);
    // bf16 buffers; `scratch` counts f32, two bf16 each.
    let qb = scratch(dev, (len * heads * dq).div_ceil(2))?;
    let kb = scratch(dev, (total * heads * dq).div_ceil(2))?;
    let vb = scratch(dev, (total * heads * dvu).div_ceil(2))?;
    let ob = scratch(dev, (len * heads * dvu).div_ceil(2))?;
    let mut b = dev.kernel("mla", "mla_pack_bf16")?;
    b.arg(&q).arg(&cache).arg(&kv);
    b.arg(&ptr(&qb)).arg(&ptr(&kb)).arg(&ptr(&vb));
    b.arg(&len_i)
        .arg(&total_i)
        .arg(&h)
        .arg(&r)
        .arg(&dn)
        .arg(&dr)
        .arg(&dv);
    let elems = (len + 2 * total) * heads * dq;
    // SAFETY: q holds len rows of H*192 f32, cache and kv total rows (the caller's
    // contract); qb/kb/vb hold the packed sizes allocated above.
    unsafe { b.launch(crate::device::flat(elems / 4)) }.op("mla")?;
    // SAFETY: qb/kb/vb/ob hold [len|total, H, 192|128] bf16 as packed above; the stream is
    // the device's and nothing is being recorded (the caller's contract).
    let rc = unsafe {
        kimi_cuda_kernels::cutlass::kimi_mla_prefill_sm90(
            ptr(&qb) as *const std::ffi::c_void,
            ptr(&kb) as *const std::ffi::c_void,
            ptr(&vb) as *const std::ffi::c_void,
            ptr(&ob) as *mut std::ffi::c_void,
            len_i,
            total_i,
            h,
            (heads * dq) as i64,
            (heads * dq) as i64,
            (heads * dvu) as i64,
            (heads * dvu) as i64,
            dims.scale,
            dev.stream.cu_stream() as *mut std::ffi::c_void,
        )
    };
    if rc != 0 {
        return Err(crate::error::Error::Cuda {
            op: "mla",
            detail: format!(
                "FlashInfer prefill ({len} queries over {total} keys, {heads} heads) failed (code {rc})"
            ),
        }
        .into());
    }
    // SAFETY: ob holds len*H*dv bf16 and out as many f32 (the caller's contract).
    unsafe {
        crate::ops::elementwise::cast_to_f32(dev, ptr(&ob), 1, out, len * heads * dvu)?;
    }
    Ok(())
}

/// One sequence's queries for the absorbed form.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Piece {
    /// Latent rows `[past + len, r+dr]` f32 (contiguous, or slots of a block pool).
    pub cache: u64,
    /// Device `u32` block table (0 = contiguous rows).
    pub block_table: u64,
    /// Cached rows before the first query.
    pub past: usize,
    /// Queries (rows of `q` from `q_row`).
    pub len: usize,
    /// First query's row in `q` / `out`.
    pub q_row: usize,
}

/// `MlaSeq` of `mla.cu` (32 bytes, pointers first).
fn seq_bytes(p: &Piece, row0: usize, chunk_len: usize) -> Result<[u8; 32]> {
    let mut b = [0u8; 32];
    b[0..8].copy_from_slice(&p.cache.to_le_bytes());
    b[8..16].copy_from_slice(&p.block_table.to_le_bytes());
    b[16..20].copy_from_slice(&to_i32(p.past, "past")?.to_le_bytes());
    b[20..24].copy_from_slice(&to_i32(p.len, "len")?.to_le_bytes());
    b[24..28].copy_from_slice(&to_i32(row0, "row")?.to_le_bytes());
    b[28..32].copy_from_slice(&to_i32(chunk_len, "chunk")?.to_le_bytes());
    Ok(b)
}

/// Splits pieces to at most [`GROUP_TOKENS`] queries each and groups consecutive ones into
/// launches of at most that many queries.
fn launch_groups(pieces: &[Piece]) -> Vec<Vec<Piece>> {
    let mut groups: Vec<Vec<Piece>> = vec![];
    let mut cur: Vec<Piece> = vec![];
    let mut cur_tokens = 0;
    for p in pieces {
        let mut off = 0;
        while off < p.len {
            let n = (p.len - off).min(GROUP_TOKENS - cur_tokens);
            cur.push(Piece {
                past: p.past + off,
                len: n,
                q_row: p.q_row + off,
                ..*p
            });
            cur_tokens += n;
            off += n;
            if cur_tokens == GROUP_TOKENS {
                groups.push(std::mem::take(&mut cur));
                cur_tokens = 0;
            }
        }
    }
    if !cur.is_empty() {
        groups.push(cur);
    }
    groups
}

/// The most chunks [`split_plan`] gives `group`, whatever its context lengths.
fn max_chunks(group: &[Piece], h: usize) -> usize {
    let row_tiles: usize = group
        .iter()
        .map(|p| (p.len * h).div_ceil(DECODE_ROWS))
        .sum();
    TARGET_CTAS.div_ceil(row_tiles.max(1)).max(1)
}

/// Splits per sequence so that about [`TARGET_CTAS`] CTAs run, chunks of at least
/// `min_chunk` rows (a multiple of [`DECODE_TILE`]): `(nchunks, chunk_len per piece)`.
fn split_plan(group: &[Piece], h: usize, min_chunk: usize) -> (usize, Vec<usize>) {
    let max_total = group.iter().map(|p| p.past + p.len).max().unwrap_or(1);
    let nchunks = max_chunks(group, h)
        .min(max_total.div_ceil(min_chunk))
        .max(1);
    let lens = group
        .iter()
        .map(|p| round_up((p.past + p.len).div_ceil(nchunks), DECODE_TILE).max(DECODE_TILE))
        .collect();
    (nchunks, lens)
}

/// An uninitialised device buffer of `n` f32 (every element read is written first).
fn scratch(dev: &Device, n: usize) -> Result<DevBuf> {
    // The kernels below write every element they later read.
    dev.alloc((n * 4).max(16), "mla")
}

fn ptr(s: &DevBuf) -> u64 {
    s.ptr()
}

/// Absorbed attention of every piece: `out[q_row + i]` for each piece's `len` queries, in
/// latent chunks of at least `min_chunk` rows (`KernelConfig::mla_decode_min_chunk`).
/// With `fp8`, the caches hold FP8 rows (`kernels/mla_fp8.cu`) and the partial attention
/// widens them as it loads them.
///
/// # Safety
/// `q` holds `H*(dn+dr)` f32 per row and `out` `H*dv` f32 per row for every row a piece
/// names; each piece's cache holds `past + len` latent rows of `r+dr` f32 (with `fp8`, of
/// `8 + r+dr` bytes) (through its block table, whose entries are valid block indices, when
/// non-zero); `kv_b` is `[H*(dn+dv), r]` in dtype code `kdt`.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn absorbed(
    dev: &Device,
    q: u64,
    pieces: &[Piece],
    block_size: usize,
    kv_b: u64,
    kdt: i32,
    out: u64,
    dims: &MlaDims,
    min_chunk: usize,
    fp8: bool,
) -> Result<()> {
    let [h, r, dn, dr, dv] = dims_i32(dims)?;
    let (hu, ru) = (dims.num_heads, dims.kv_lora_rank);
    let lw = ru + dims.qk_rope_head_dim;
    let smem = decode_smem_bytes(lw);
    if ru > 512
        || lw > 640
        || dims.qk_nope_head_dim > 256
        || hu == 0
        || smem > MAX_DYNAMIC_SMEM_BYTES as usize
    {
        return Err(Error::Unsupported(format!(
            "mla absorbed with {dims:?} (needs r <= 512, r+dr <= 640, dn <= 256)"
        )));
    }
    let bs = to_i32(block_size.max(1), "block size")?;
    let scale_log2 = dims.scale * std::f32::consts::LOG2_E;
    let groups = launch_groups(pieces);
    let max_tokens = groups
        .iter()
        .map(|g| g.iter().map(|p| p.len).sum::<usize>())
        .max()
        .unwrap_or(0);
    if max_tokens == 0 {
        return Ok(());
    }
    let min_chunk = decode_min_chunk(min_chunk);
    let plans: Vec<(usize, Vec<usize>)> = groups
        .iter()
        .map(|g| split_plan(g, hu, min_chunk))
        .collect();
    // Sized for the most chunks `split_plan` can choose, not this step's: the scratch then
    // keeps its size as the context grows (so a replayed decode graph stays valid).
    let max_parts = groups
        .iter()
        .map(|g| g.iter().map(|p| p.len).sum::<usize>() * max_chunks(g, hu))
        .max()
        .unwrap_or(0);
    // Scratch shared by the groups (stream order serialises their use).
    let qcat = scratch(dev, max_tokens * hu * lw)?;
    let olat = scratch(dev, max_tokens * hu * ru)?;
    let part_ml = scratch(dev, max_parts * hu * 2)?;
    let part_o = scratch(dev, max_parts * hu * ru)?;
    let (qcat_p, olat_p, ml_p, po_p) = (ptr(&qcat), ptr(&olat), ptr(&part_ml), ptr(&part_o));
    // FP8 rows are read with plain loads (no cp.async of the cache), so only the widths
    // decide the float4 variant there.
    let vec = ru.is_multiple_of(4)
        && lw.is_multiple_of(4)
        && (fp8 || aligned(&pieces.iter().map(|p| p.cache).collect::<Vec<_>>()));
    let partial = match (fp8, vec) {
        (false, true) => "mla_decode_partial_vec",
        (false, false) => "mla_decode_partial",
        (true, true) => "mla_decode_partial_fp8_vec",
        (true, false) => "mla_decode_partial_fp8",
    };
    for (group, (nchunks, chunk_lens)) in groups.iter().zip(&plans) {
        // One upload: the MlaSeq table, then the q row of every launch-local token.
        let mut bytes = Vec::with_capacity(group.len() * 32 + GROUP_TOKENS * 4);
        let mut rows: Vec<u32> = vec![];
        for (p, &cl) in group.iter().zip(chunk_lens) {
            bytes.extend_from_slice(&seq_bytes(p, rows.len(), cl)?);
            for i in 0..p.len {
                rows.push(
                    u32::try_from(p.q_row + i)
                        .map_err(|_| Error::Unsupported("mla row index".into()))?,
                );
            }
        }
        let rows_off = bytes.len() as u64;
        bytes.extend(rows.iter().flat_map(|x| x.to_le_bytes()));
        let table = dev.upload(&bytes, "mla")?;
        let seqs_p = ptr(&table);
        let rows_p = seqs_p + rows_off;
        let ntok = rows.len();
        let nt = to_i32(ntok, "tokens")?;
        let tok_groups = ntok.div_ceil(8) as u32;
        let nc = to_i32(*nchunks, "chunks")?;

        let mut b = dev.kernel("mla", "mla_q_absorb")?;
        b.arg(&q)
            .arg(&rows_p)
            .arg(&nt)
            .arg(&kv_b)
            .arg(&kdt)
            .arg(&qcat_p);
        b.arg(&h).arg(&r).arg(&dn).arg(&dr).arg(&dv);
        let col_blocks = ru.div_ceil(64) as u32;
        // SAFETY: grid (H, ceil(ntok/8), ceil(r/64)) × 256 threads; `rows` holds ntok valid
        // q rows; q_cat has room for ntok*H rows of r+dr f32; dn <= 256 fits its static
        // buffer.
        unsafe { b.launch(grid((hu as u32, tok_groups, col_blocks), 256, 0)) }.op("mla")?;

        let row_tiles = group
            .iter()
            .map(|p| (p.len * hu).div_ceil(DECODE_ROWS))
            .max()
            .unwrap_or(1) as u32;
        let mut b = dev.kernel("mla", partial)?;
        b.arg(&seqs_p).arg(&bs).arg(&qcat_p).arg(&ml_p).arg(&po_p);
        b.arg(&nc).arg(&h).arg(&r).arg(&dr).arg(&scale_log2);
        let cfg = grid(
            (*nchunks as u32, row_tiles, group.len() as u32),
            256,
            smem as u32,
        );
        // SAFETY: grid (nchunks, row tiles, pieces) × 256 threads with
        // decode_smem_bytes(r+dr) of dynamic shared memory (opted in at load); each MlaSeq
        // names a cache of past+len rows and chunk_len * nchunks >= past+len; the partial
        // buffers hold ntok*H*nchunks entries; the vec variant only with r, r+dr % 4 == 0
        // and (f32 caches) 16-byte aligned caches; FP8 caches only with `fp8`.
        unsafe { b.launch(cfg) }.op("mla")?;

        let mut b = dev.kernel("mla", "mla_decode_combine")?;
        b.arg(&ml_p).arg(&po_p).arg(&nc).arg(&r).arg(&olat_p);
        // SAFETY: one CTA of 128 threads per launch-local row (ntok*H); every (row, chunk)
        // has its (m, l) written by the partial kernel, o only where l > 0 (the only
        // entries read); o_lat holds ntok*H rows of r f32.
        unsafe { b.launch(grid(((ntok * hu) as u32, 1, 1), 128, 0)) }.op("mla")?;

        let mut b = dev.kernel("mla", "mla_uv_project")?;
        b.arg(&olat_p)
            .arg(&rows_p)
            .arg(&nt)
            .arg(&kv_b)
            .arg(&kdt)
            .arg(&out);
        b.arg(&h).arg(&r).arg(&dn).arg(&dv);
        let row_splits = UV_SPLITS.min(dims.v_head_dim.div_ceil(8)).max(1) as u32;
        // SAFETY: grid (H, ceil(ntok/8), splits) × 256 threads with 8*r f32 of dynamic
        // shared memory (<= 16 KiB); writes `out` rows named by `rows`, each H*dv wide.
        unsafe {
            b.launch(grid(
                (hu as u32, tok_groups, row_splits),
                256,
                (8 * ru * 4) as u32,
            ))
        }
        .op("mla")?;
        // `table` and the scratch buffers are freed in stream order after these launches.
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn piece(past: usize, len: usize, q_row: usize) -> Piece {
        Piece {
            cache: 0,
            block_table: 0,
            past,
            len,
            q_row,
        }
    }

    #[test]
    fn groups_split_long_segments() {
        let g = launch_groups(&[piece(5, 300, 0), piece(0, 1, 300)]);
        let lens: Vec<Vec<(usize, usize, usize)>> = g
            .iter()
            .map(|g| g.iter().map(|p| (p.past, p.len, p.q_row)).collect())
            .collect();
        assert_eq!(
            lens,
            vec![
                vec![(5, 128, 0)],
                vec![(133, 128, 128)],
                vec![(261, 44, 256), (0, 1, 300)]
            ]
        );
    }

    #[test]
    fn split_covers_context() {
        for total in [1usize, 100, 5000, 70_000, 1 << 20] {
            let g = [piece(total - 1, 1, 0)];
            let (nc, lens) = split_plan(&g, 32, decode_min_chunk(64));
            assert!(nc * lens[0] >= total, "{total}");
            assert!(nc <= TARGET_CTAS);
            assert_eq!(lens[0] % DECODE_TILE, 0);
        }
    }
}

/// A sequence's rows in a paged pool.
#[derive(Clone, Copy)]
pub(crate) struct Paged {
    /// The pool `[num_blocks, block_size, width]`: f32 rows, or FP8 rows for `mla_fp8`.
    pub(crate) pool: u64,
    /// The sequence's block table, u32 block ids.
    pub(crate) table: u64,
    /// Rows per block.
    pub(crate) block_size: usize,
    /// Row width.
    pub(crate) width: usize,
}

/// Writes each row `j < n` of `src [n, width]` to its sequence's position: `where_[2j]` is
/// the u32 offset of the sequence's block table in `tables`, `where_[2j+1]` the position
/// (`u32::MAX` skips the row). One launch for every sequence of a batch.
///
/// # Safety
/// `src` holds `n * width` f32 and `where_` `2n` u32; every table named covers its rows'
/// positions with blocks inside the pool `[_, block_size, width]`.
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
) -> Result<()> {
    if n == 0 {
        return Ok(());
    }
    let (bs, lw) = (block_size as i32, width as i32);
    let mut b = dev.kernel("mla", "mla_paged_write_rows")?;
    b.arg(&src).arg(&pool).arg(&tables).arg(&where_);
    b.arg(&bs).arg(&lw);
    // SAFETY: see the function's contract.
    unsafe { b.launch(grid((n as u32, 1, 1), 128, 0)) }.op("mla")?;
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
