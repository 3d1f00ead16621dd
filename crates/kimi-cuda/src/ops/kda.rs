//! Launchers of `kernels/kda.cu`.
//!
//! The chunked (WY) form runs as two kernels per launch group: a parallel preparation per
//! (chunk, head) into a scratch buffer, then the serial pass over each segment's chunks.
//! Two variants (`plan::plan_kda_chunk` picks one): the tensor-core pass (a preparation
//! kernel + `kda_chunk_mma_D_{split,half}`, the default for D = 64 and 128: bf16 hi + lo
//! operands under `GemmPrecision::Split`, hi only under `Half`, f32 state) and the f32
//! CUDA-core pass (`kda_chunk_prep_D` + `kda_chunk_state_D`, `KIMI_CUDA_KDA_CHUNK=f32`).
//! Long inputs are cut into launch groups of at most [`max_group_chunks`] chunks so that the
//! scratch stays under [`SCRATCH_CAP_BYTES`]; a segment cut in two continues from its state
//! in place.

use std::num::NonZeroUsize;

use kimi_ops::{Error, Result};

use crate::device::{grid, Device, MAX_DYNAMIC_SMEM_BYTES};
use crate::error::OpContext;
use crate::plan::{KdaPrep, KdaStages};

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
    if width == 0 || n == 0 {
        return Ok(());
    }
    let rows = n / width;
    let (ri, wi, di) = (rows as i32, width as i32, d as i32);
    let mut b = dev.kernel("kda_gate", "kda_gate")?;
    b.arg(&f)
        .arg(&a_log)
        .arg(&adt)
        .arg(&dt_bias)
        .arg(&bdt)
        .arg(&g);
    b.arg(&ri).arg(&wi).arg(&di).arg(&kind).arg(&lb);
    // Each thread owns a column and walks rows with a stride of up to 1024 row blocks.
    let cfg = grid(
        (width.div_ceil(256) as u32, rows.min(1024) as u32, 1),
        256,
        0,
    );
    // SAFETY: see the function's contract.
    unsafe { b.launch(cfg) }.op("kda_gate")?;
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

/// Segments per launch of the table-driven kernels (`KDA_MAX_SEGS` in `kda.cu`).
pub(crate) const MAX_SEGS: usize = 64;

/// Tokens per chunk of the chunked form (`KDA_C` in `kda.cu`, kimi-cpu's `CHUNK`).
pub(crate) const CHUNK: usize = 64;

/// f32 scratch per (chunk, head) between the two chunked kernels (`KDA_SCRATCH`).
pub(crate) const SCRATCH_PER_CHUNK: usize = CHUNK * CHUNK + 2 * CHUNK;

/// Bytes of scratch per (chunk, head) of the tensor-core variant (`kda_mma_scratch_bytes`
/// in `kda.cu`): KG, QG, Kd as `[C][D]` and T, A as `[C][C]` bf16 hi planes (and lo planes
/// with `split`), then e^Γ_last as `[D]` f32. 128.5 KiB at D = 128 with `split`, 64.5 KiB
/// without.
pub(crate) fn mma_scratch_bytes(d: usize, split: bool) -> usize {
    let planes = if split { 2 } else { 1 };
    planes * (3 * CHUNK * d + 2 * CHUNK * CHUNK) * 2 + 4 * d
}

/// Upper bound of one launch group's scratch (bytes); longer inputs take several groups.
pub(crate) const SCRATCH_CAP_BYTES: usize = 256 << 20;

/// Warps per block of `kda_chunk_mma_D_*` (`km::NW`), 16 state columns each.
const MMA_WARPS: usize = 4;

/// Scratch bytes per (chunk, head) of the chunked variant (`mma`, with or without the
/// `split`'s lo planes, or f32).
pub(crate) fn scratch_bytes(d: usize, mma: bool, split: bool) -> usize {
    if mma {
        mma_scratch_bytes(d, split)
    } else {
        SCRATCH_PER_CHUNK * 4
    }
}

/// Chunks per launch group that keep its scratch under [`SCRATCH_CAP_BYTES`] (at least 1),
/// or `fixed` (`KernelConfig::kda_group_chunks`).
pub(crate) fn max_group_chunks(
    h: usize,
    d: usize,
    mma: bool,
    split: bool,
    fixed: Option<NonZeroUsize>,
) -> usize {
    match fixed {
        None => (SCRATCH_CAP_BYTES / (h * scratch_bytes(d, mma, split)).max(1)).max(1),
        Some(n) => n.get(),
    }
}

/// Launch groups of `(start, len, state)` segments: at most [`MAX_SEGS`] segments and
/// `max_chunks` chunks each. A segment that does not fit is cut at a chunk boundary and
/// continues in the next group (groups run in order, and each updates its states in place).
pub(crate) fn launch_groups(
    segs: &[(usize, usize, u64)],
    max_chunks: usize,
) -> Vec<Vec<(usize, usize, u64)>> {
    let max_chunks = max_chunks.max(1);
    let (mut groups, mut cur, mut used) = (vec![], vec![], 0usize);
    for &(start, len, state) in segs {
        let (mut s, mut left) = (start, len);
        while left > 0 {
            if cur.len() == MAX_SEGS || used == max_chunks {
                groups.push(std::mem::take(&mut cur));
                used = 0;
            }
            let take = left.min((max_chunks - used) * CHUNK);
            cur.push((s, take, state));
            used += take.div_ceil(CHUNK);
            s += take;
            left -= take;
            if left > 0 {
                // The rest of this segment must run after this piece: a later group.
                groups.push(std::mem::take(&mut cur));
                used = 0;
            }
        }
    }
    if !cur.is_empty() {
        groups.push(cur);
    }
    groups
}

/// Head sizes with split-V, chunked and fused-decode kernels.
pub(crate) fn has_split_kernels(d: usize) -> bool {
    matches!(d, 64 | 128)
}

/// `struct KdaSegs` of `kda.cu`, passed by value as a kernel parameter.
#[repr(C)]
#[derive(Clone, Copy)]
pub(crate) struct SegTable {
    n: i32,
    start: [i32; MAX_SEGS],
    len: [i32; MAX_SEGS],
    chunk0: [i32; MAX_SEGS],
    /// The C compiler's padding before `state`, spelled out so every byte is initialised
    /// (launches copy arguments as bytes).
    _pad: i32,
    state: [u64; MAX_SEGS],
}

const _: () = assert!(std::mem::size_of::<SegTable>() == 4 + 3 * 4 * MAX_SEGS + 4 + 8 * MAX_SEGS);

// SAFETY: plain-old-data with the C layout of `struct KdaSegs` (repr(C), same field order).
unsafe impl cudarc::driver::DeviceRepr for SegTable {}

impl SegTable {
    /// Table of up to [`MAX_SEGS`] non-empty `(start, len, state address)` segments; returns
    /// it with the number of chunks it covers (`chunk0` counts them in order).
    pub(crate) fn new(segs: &[(usize, usize, u64)]) -> Result<(Self, usize)> {
        if segs.len() > MAX_SEGS || segs.iter().any(|s| s.1 == 0) {
            return Err(Error::Shape {
                op: "kda",
                detail: format!("{} segments for one launch", segs.len()),
            });
        }
        let mut t = SegTable {
            n: segs.len() as i32,
            start: [0; MAX_SEGS],
            len: [0; MAX_SEGS],
            chunk0: [0; MAX_SEGS],
            _pad: 0,
            state: [0; MAX_SEGS],
        };
        let mut chunks = 0usize;
        for (i, &(start, len, state)) in segs.iter().enumerate() {
            let (start, len, c0) = (
                i32::try_from(start),
                i32::try_from(len),
                i32::try_from(chunks),
            );
            let (Ok(start), Ok(len), Ok(c0)) = (start, len, c0) else {
                return Err(Error::Unsupported("kda over more than 2^31 rows".into()));
            };
            t.start[i] = start;
            t.len[i] = len;
            t.chunk0[i] = c0;
            t.state[i] = state;
            chunks += (len as usize).div_ceil(CHUNK);
        }
        Ok((t, chunks))
    }
}

/// The recurrence of every segment in `table`, split over `D/4`-column blocks of the state.
///
/// # Safety
/// `q, k, v, g, out` hold `n * h * d` f32 and `beta` `n * h`, with every table segment
/// inside the `n` rows; each table state holds `h * d * d` f32 and no two alias;
/// [`has_split_kernels`]`(d)`.
pub(crate) unsafe fn recurrent_split(
    dev: &Device,
    qkvg: [u64; 4],
    beta: u64,
    table: &SegTable,
    out: u64,
    h: usize,
    d: usize,
) -> Result<()> {
    let [q, k, v, g] = qkvg;
    let hi = h as i32;
    let mut b = dev.kernel("kda", &format!("kda_recurrent_split_{d}"))?;
    b.arg(&q).arg(&k).arg(&v).arg(&g).arg(&beta);
    b.arg(table).arg(&out).arg(&hi);
    // SAFETY: see the function's contract; grid (4, H, segments) of 128 threads as the
    // kernel's `Split<D>` layout expects.
    unsafe { b.launch(grid((4, h as u32, table.n as u32), 128, 0)) }.op("kda")?;
    Ok(())
}

/// Dynamic shared memory of `kda_chunk_prep_D` (q̂, k̂, exp(g) tiles, M, β and norms).
pub(crate) fn prep_smem(d: usize) -> usize {
    (3 * CHUNK * d + CHUNK * CHUNK + 3 * CHUNK) * 4
}

/// Dynamic shared memory of `kda_chunk_prep_blk_D` (q̂, k̂, exp(g) tiles, M, then two block
/// decay rows / β): 113 KiB at D = 128, so two blocks fit an SM.
pub(crate) fn prep_blk_smem(d: usize) -> usize {
    (3 * CHUNK * d + CHUNK * CHUNK + (2 * d).max(CHUNK)) * 4
}

/// Dynamic shared memory of `kda_chunk_state_D` (KQ tiles, M, the state columns, X, norms,
/// β and the chunk decay).
pub(crate) fn state_smem(d: usize) -> usize {
    (2 * CHUNK * d + CHUNK * CHUNK + 32 * (d + 4) + CHUNK * 32 + 3 * CHUNK + d) * 4
}

/// The chunked (WY) form of every segment in `table` (`chunks` chunks in all): the
/// per-chunk preparation into `scratch`, then the serial state pass (each only where
/// `stages` has it).
///
/// # Safety
/// As [`recurrent_split`]; also `q, k, v, g, out` are 16-byte aligned, and `scratch` holds
/// `chunks * h * SCRATCH_PER_CHUNK` f32.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn chunked(
    dev: &Device,
    qkvg: [u64; 4],
    beta: u64,
    table: &SegTable,
    chunks: usize,
    scratch: u64,
    out: u64,
    h: usize,
    d: usize,
    stages: KdaStages,
) -> Result<()> {
    let [q, k, v, g] = qkvg;
    let hi = h as i32;
    let (ps, ss) = (prep_smem(d), state_smem(d));
    if ps.max(ss) > MAX_DYNAMIC_SMEM_BYTES as usize || chunks > u32::MAX as usize {
        return Err(Error::Unsupported(format!("chunked kda with head_dim {d}")));
    }
    if stages.prep {
        let mut b = dev.kernel("kda", &format!("kda_chunk_prep_{d}"))?;
        b.arg(&q).arg(&k).arg(&g).arg(&beta);
        b.arg(table).arg(&scratch).arg(&hi);
        // SAFETY: see the function's contract; one block per (chunk, head) writes that
        // chunk's scratch; the shared memory size matches the kernel's carve-up.
        unsafe { b.launch(grid((chunks as u32, h as u32, 1), 256, ps as u32)) }.op("kda")?;
    }
    if !stages.state {
        return Ok(());
    }
    let mut b = dev.kernel("kda", &format!("kda_chunk_state_{d}"))?;
    b.arg(&q).arg(&k).arg(&v).arg(&g).arg(&beta);
    b.arg(table).arg(&scratch).arg(&out).arg(&hi);
    // SAFETY: as above; grid (D/32, H, segments): each block owns 32 columns of one state.
    unsafe {
        b.launch(grid(
            ((d / 32) as u32, h as u32, table.n as u32),
            256,
            ss as u32,
        ))
    }
    .op("kda")?;
    Ok(())
}

/// Dynamic shared memory of `kda_chunk_mma_D_*` (`kda_mma_smem_bytes`): KG, QG, Kd
/// `[C][D+8]` and T, A `[C][C+8]` bf16 planes (hi, and lo with `split`), V `[C][16 NW + 4]`
/// and γ `[D]` f32. 138.5 KiB at D = 128 with `split`.
pub(crate) fn mma_smem(d: usize, split: bool) -> usize {
    let planes = if split { 2 } else { 1 };
    planes * (3 * CHUNK * (d + 8) + 2 * CHUNK * (CHUNK + 8)) * 2
        + CHUNK * (16 * MMA_WARPS + 4) * 4
        + d * 4
}

/// The chunked form on tensor cores: `kda_chunk_prep_mma_D` (grid (chunks, H), block 256)
/// writes the per-chunk operands to `scratch`, then `kda_chunk_mma_D_{split,half}` (grid
/// (D / 64, H, segments), block 128) runs each segment's chunks in order; every warp keeps
/// 16 columns of one state in mma accumulators. `prep` picks the preparation kernel;
/// `stages` which of the two kernels run.
///
/// # Safety
/// As [`chunked`], with `scratch` holding `chunks * h * mma_scratch_bytes(d, split)` bytes.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn chunked_mma(
    dev: &Device,
    qkvg: [u64; 4],
    beta: u64,
    table: &SegTable,
    chunks: usize,
    scratch: u64,
    out: u64,
    h: usize,
    d: usize,
    split: bool,
    prep: KdaPrep,
    stages: KdaStages,
) -> Result<()> {
    let [q, k, v, g] = qkvg;
    let hi = h as i32;
    let (ps, ss) = (prep_smem(d).max(prep_blk_smem(d)), mma_smem(d, split));
    if !has_split_kernels(d)
        || ps.max(ss) > MAX_DYNAMIC_SMEM_BYTES as usize
        || chunks > u32::MAX as usize
    {
        return Err(Error::Unsupported(format!("chunked kda with head_dim {d}")));
    }
    let sp = i32::from(split);
    if stages.prep {
        // The blocked preparation (default) or the pair loop; same scratch.
        let (prep, smem) = match prep {
            KdaPrep::PairLoop => ("mma", ps),
            KdaPrep::Blocked => ("blk", prep_blk_smem(d)),
        };
        let mut b = dev.kernel("kda", &format!("kda_chunk_prep_{prep}_{d}"))?;
        b.arg(&q).arg(&k).arg(&g).arg(&beta);
        b.arg(table).arg(&scratch).arg(&hi).arg(&sp);
        // SAFETY: see the function's contract; one block per (chunk, head) writes that
        // chunk's scratch slot; the shared memory size matches the kernel's carve-up.
        unsafe { b.launch(grid((chunks as u32, h as u32, 1), 256, smem as u32)) }.op("kda")?;
    }
    if !stages.state {
        return Ok(());
    }
    let name = format!("kda_chunk_mma_{d}_{}", if split { "split" } else { "half" });
    let mut b = dev.kernel("kda", &name)?;
    b.arg(&v).arg(table).arg(&scratch).arg(&out).arg(&hi);
    // SAFETY: as above; each block owns 16 * MMA_WARPS columns of one state.
    unsafe {
        b.launch(grid(
            ((d / (16 * MMA_WARPS)) as u32, h as u32, table.n as u32),
            (32 * MMA_WARPS) as u32,
            ss as u32,
        ))
    }
    .op("kda")?;
    Ok(())
}

/// `struct KdaStepSegs` of `kda.cu`.
#[repr(C)]
#[derive(Clone, Copy)]
pub(crate) struct StepSegs {
    n: i32,
    row: [i32; MAX_SEGS],
    /// The C compiler's padding before `state` (see `SegTable`).
    _pad: i32,
    state: [u64; MAX_SEGS],
    conv: [[u64; MAX_SEGS]; 3],
}

const _: () = assert!(std::mem::size_of::<StepSegs>() == 4 + 4 * MAX_SEGS + 4 + 4 * 8 * MAX_SEGS);

// SAFETY: plain-old-data with the C layout of `struct KdaStepSegs`.
unsafe impl cudarc::driver::DeviceRepr for StepSegs {}

impl StepSegs {
    /// Up to [`MAX_SEGS`] `(row, state, [q, k, v conv windows])` addresses.
    pub(crate) fn new(segs: &[(usize, u64, [u64; 3])]) -> Result<Self> {
        if segs.len() > MAX_SEGS {
            return Err(Error::Shape {
                op: "kda_decode",
                detail: format!("{} segments for one launch", segs.len()),
            });
        }
        let mut t = StepSegs {
            n: segs.len() as i32,
            row: [0; MAX_SEGS],
            _pad: 0,
            state: [0; MAX_SEGS],
            conv: [[0; MAX_SEGS]; 3],
        };
        for (i, &(row, state, conv)) in segs.iter().enumerate() {
            t.row[i] = i32::try_from(row)
                .map_err(|_| Error::Unsupported("kda_decode over 2^31 rows".into()))?;
            t.state[i] = state;
            for (s, c) in conv.into_iter().enumerate() {
                t.conv[s][i] = c;
            }
        }
        Ok(t)
    }
}

/// `struct KdaStepArgs` of `kda.cu`: the layer's inputs, weights and output.
#[repr(C)]
#[derive(Clone, Copy)]
pub(crate) struct StepArgs {
    /// q, k, v projections before the convolution `[n, H*D]` f32.
    pub x: [u64; 3],
    /// Convolution weights `[H*D, W]` of dtypes `wdt`.
    pub w: [u64; 3],
    /// Gate pre-activation `[n, H*D]` f32.
    pub f: u64,
    /// β logits `[n, H]` f32.
    pub b: u64,
    /// Output gate `[n, H*D]` f32.
    pub z: u64,
    /// `A_log [H]` of dtype `adt`.
    pub a_log: u64,
    /// `dt_bias [H*D]` of dtype `bdt`.
    pub dt_bias: u64,
    /// Output norm weight `[D]` of dtype `odt`.
    pub o_norm: u64,
    /// Output `[n, H*D]` f32.
    pub y: u64,
    /// Dtype codes of `w`.
    pub wdt: [i32; 3],
    /// Dtype code of `a_log`.
    pub adt: i32,
    /// Dtype code of `dt_bias`.
    pub bdt: i32,
    /// Dtype code of `o_norm`.
    pub odt: i32,
    /// Heads.
    pub h: i32,
    /// Convolution width.
    pub w_len: i32,
    /// 0 = softplus gate, 1 = lower-bound gate.
    pub kind: i32,
    /// Lower bound of kind 1.
    pub lb: f32,
    /// RMSNorm epsilon.
    pub eps: f32,
    /// The C struct's tail padding to 8 bytes (see `SegTable`).
    pub _pad: i32,
}

const _: () = assert!(std::mem::size_of::<StepArgs>() == 152);

// SAFETY: plain-old-data with the C layout of `struct KdaStepArgs`.
unsafe impl cudarc::driver::DeviceRepr for StepArgs {}

/// One fused decode step of a KDA layer for every one-token segment in `segs`.
///
/// # Safety
/// `args` describes live buffers of the documented shapes for `n` rows with every table row
/// below `n`; each state holds `h * d * d` f32 and each conv window `(W-1) * h * d` f32,
/// none aliasing another; [`has_split_kernels`]`(d)`.
pub(crate) unsafe fn decode(
    dev: &Device,
    args: &StepArgs,
    segs: &StepSegs,
    h: usize,
    d: usize,
) -> Result<()> {
    let mut b = dev.kernel("kda_decode", &format!("kda_decode_{d}"))?;
    b.arg(args).arg(segs);
    // SAFETY: see the function's contract; grid x = 4 is the kernel's compile-time cluster
    // width (`__cluster_dims__(4, 1, 1)`).
    unsafe { b.launch(grid((4, h as u32, segs.n as u32), 128, 0)) }.op("kda_decode")?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn launch_groups_cut_at_chunk_boundaries() {
        let segs = [(0usize, 300usize, 1u64), (300, 5, 2), (305, 64, 3)];
        let groups = launch_groups(&segs, 2);
        let want: Vec<Vec<(usize, usize, u64)>> = vec![
            vec![(0, 128, 1)],
            vec![(128, 128, 1)],
            vec![(256, 44, 1), (300, 5, 2)],
            vec![(305, 64, 3)],
        ];
        assert_eq!(groups, want);
        for g in &groups {
            let chunks: usize = g.iter().map(|s| s.1.div_ceil(CHUNK)).sum();
            assert!(chunks <= 2);
        }
        let many: Vec<_> = (0..70).map(|i| (i, 1, i as u64)).collect();
        let groups = launch_groups(&many, 1000);
        assert_eq!(groups.iter().map(Vec::len).collect::<Vec<_>>(), [64, 6]);
    }
}
