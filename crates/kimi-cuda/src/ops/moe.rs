//! Launchers of `kernels/moe.cu`.

use std::num::NonZeroUsize;

use kimi_ops::{Error, MoeRouting, Result};

use crate::device::{flat, grid, Device};
use crate::error::OpContext;
use crate::plan::{LayerPlan, StreamPlan, ROUTE_WARP_MAX_EXPERTS, STREAM_MAX_SLOTS};

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
    // Ungrouped routing of many tokens over at most ROUTE_WARP_MAX_EXPERTS: a warp per token
    // (`moe_route_warp`; 8K tokens: 56 us against the block kernel's 170 us on an H200). A
    // few tokens keep a block each, whose 256 threads finish one token sooner (9 against
    // 13.5 us at one token).
    let warp = r.num_groups <= 1 && e <= ROUTE_WARP_MAX_EXPERTS && n >= ROUTE_WARP_MIN_TOKENS;
    let ni = n as i32;
    let mut b = dev.kernel("moe", if warp { "moe_route_warp" } else { "moe_route" })?;
    b.arg(&logits)
        .arg(&bias)
        .arg(&bdt)
        .arg(&has_bias)
        .arg(&ids)
        .arg(&weights);
    if warp {
        b.arg(&ni).arg(&ei).arg(&k);
    } else {
        b.arg(&ei).arg(&k).arg(&g).arg(&kg);
    }
    b.arg(&renorm).arg(&r.scaling).arg(&use_bias);
    // 8 tokens per warp-kernel block; the block kernel's shared memory holds 3 * e floats.
    let cfg = if warp {
        grid((n.div_ceil(8) as u32, 1, 1), 256, 0)
    } else {
        grid((n as u32, 1, 1), 256, (3 * e * 4) as u32)
    };
    // SAFETY: see the function's contract.
    unsafe { b.launch(cfg) }.op("moe")?;
    Ok(())
}

/// Where [`route_one`] writes a token's picks and lists (as [`route`] and [`lists`] do).
pub(crate) struct ListBufs {
    pub(crate) ids: u64,
    pub(crate) weights: u64,
    pub(crate) offsets: u64,
    pub(crate) slots: u64,
    pub(crate) rows: u64,
    pub(crate) wsel: u64,
    pub(crate) meta: u64,
}

/// One token's router logits, picks and pair lists in one launch (`moe_route_one` in
/// `kernels/moe.cu`): ungrouped routing over at most [`ROUTE_WARP_MAX_EXPERTS`] experts.
///
/// # Safety
/// `router` holds `[e, d]` and `x` `d` f32, both 16-byte aligned, `d % 4 == 0`; `bias`
/// (unless 0) 4-byte aligned, with `e` even unless `bdt` is f32 (the kernel copies it as
/// 4-byte words); `r.top_k <= min(ROUTE_ONE_MAX_TOP_K, e)` (`crate::plan`); `logits` holds
/// `e` f32; `out` as for [`route`] and [`lists`] with one token; `ticket` is one u32 that is
/// zero and no other launch uses while this one runs.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn route_one(
    dev: &Device,
    router: u64,
    x: u64,
    d: usize,
    bias: u64,
    bdt: i32,
    e: usize,
    r: &MoeRouting,
    logits: u64,
    out: &ListBufs,
    ticket: u64,
) -> Result<()> {
    let has_bias = (bias != 0) as i32;
    let (di, ei, k) = (d as i32, e as i32, r.top_k as i32);
    let (renorm, use_bias) = (r.renormalize as i32, r.weights_use_bias as i32);
    let mut b = dev.kernel("moe", "moe_route_one")?;
    b.arg(&router)
        .arg(&x)
        .arg(&di)
        .arg(&bias)
        .arg(&bdt)
        .arg(&has_bias);
    b.arg(&ei)
        .arg(&k)
        .arg(&renorm)
        .arg(&r.scaling)
        .arg(&use_bias);
    b.arg(&logits).arg(&out.ids).arg(&out.weights);
    b.arg(&out.offsets)
        .arg(&out.slots)
        .arg(&out.rows)
        .arg(&out.wsel);
    b.arg(&out.meta).arg(&ticket);
    // Two experts' logits per block (static shared memory only).
    let cfg = grid((e.div_ceil(2) as u32, 1, 1), 256, 0);
    // SAFETY: see the function's contract.
    unsafe { b.launch(cfg) }.op("moe")?;
    Ok(())
}

/// From this many tokens, ungrouped routing runs a warp per token (see [`route`]).
const ROUTE_WARP_MIN_TOKENS: usize = 32;

/// Pairs per `moe_lists_place` block (`LISTS_CHUNK` in `kernels/moe.cu`).
const LISTS_CHUNK: usize = 4096;

/// From this many pairs, [`lists`] runs over several blocks (one block, 220 us for the
/// 65,536 pairs of an 8K prefill on an H200, was the routing's largest cost).
pub(crate) const LISTS_MULTI_BLOCK_PAIRS: usize = 2 * LISTS_CHUNK;

/// Groups the `p = n * top_k` routed pairs by expert (see `moe_lists` in `kernels/moe.cu`).
///
/// # Safety
/// `ids`/`weights` hold `p` entries with ids `< e`; `offsets` holds `2 * e + 2` u32 (the
/// offsets, then the active-expert list), `slots`,
/// `rows` and `wsel` `p` entries, `meta` `p + e` u32. `counters`, when given, holds `2 * e`
/// zeroed u32 and selects the multi-block kernels.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn lists(
    dev: &Device,
    ids: u64,
    weights: u64,
    p: usize,
    e: usize,
    top_k: usize,
    offsets: u64,
    slots: u64,
    rows: u64,
    wsel: u64,
    meta: u64,
    counters: Option<u64>,
) -> Result<()> {
    let (pi, ei, ki) = (p as i32, e as i32, top_k as i32);
    if let Some(counters) = counters {
        // Many pairs: per-block counts, then per-block placement (`moe_lists_count`,
        // `moe_lists_place`); `counters` holds 2 * e zeroed u32 (totals, then cursors).
        let blocks = p.div_ceil(LISTS_CHUNK) as u32;
        let cursor = counters + (e * 4) as u64;
        // SAFETY: ids holds p u32, counters at least e.
        unsafe { count(dev, ids, p, counters, e)? };
        let mut b = dev.kernel("moe", "moe_lists_place")?;
        b.arg(&ids).arg(&weights).arg(&pi).arg(&ei).arg(&ki);
        b.arg(&counters).arg(&cursor).arg(&offsets);
        b.arg(&slots).arg(&rows).arg(&wsel).arg(&meta);
        // SAFETY: as above; shared memory holds 2 * e u32.
        unsafe { b.launch(grid((blocks, 1, 1), 1024, (2 * e * 4) as u32)) }.op("moe")?;
        return Ok(());
    }
    let mut b = dev.kernel("moe", "moe_lists")?;
    b.arg(&ids).arg(&weights).arg(&pi).arg(&ei).arg(&ki);
    b.arg(&offsets).arg(&slots).arg(&rows).arg(&wsel).arg(&meta);
    // SAFETY: see the function's contract; shared memory holds 2 * e u32.
    unsafe { b.launch(grid((1, 1, 1), 1024, (2 * e * 4) as u32)) }.op("moe")?;
    Ok(())
}

/// One expert GEMV pass over all routed pairs (see `moe_expert_gemv` in `kernels/moe.cu`).
///
/// # Safety
/// `wtab` holds `3 * e` weight addresses (gate, up: `[rows_out, cols]` when `glu`; down:
/// `[rows_out, cols]` otherwise) of dtype `dt`; `input` holds `cols`-wide f32 rows (tokens
/// when `glu`, pairs otherwise); `offsets` (with its active-expert list, `2 * e + 2`
/// entries) and `slots` come from [`lists`] for `p` pairs; `out` holds `p * rows_out` f32;
/// `aligned`: every weight and `input` is 16-byte aligned. `row_blocks_forced` overrides
/// the 16-row blocks per CTA (`KernelConfig::moe_row_blocks`).
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn expert_gemv(
    dev: &Device,
    wtab: u64,
    glu: bool,
    input: u64,
    top_k: usize,
    offsets: u64,
    e: usize,
    slots: u64,
    out: u64,
    p: usize,
    rows_out: usize,
    cols: usize,
    dt: i32,
    aligned: bool,
    row_blocks_forced: Option<NonZeroUsize>,
) -> Result<()> {
    let vec = (aligned && dt == 1 && cols.is_multiple_of(8)) as i32;
    // Activation rows go through shared memory where a group of them fits in the default
    // 48 KiB (and rows are float4-aligned).
    let stage_bytes = EXPERT_GEMV_GROUP * cols * 4;
    let stage = aligned && cols.is_multiple_of(4) && stage_bytes <= 48 * 1024;
    let (g, ki, ei, ro, co) = (
        glu as i32,
        top_k as i32,
        e as i32,
        rows_out as i32,
        cols as i32,
    );
    let st = stage as i32;
    let rb = row_blocks_forced.map_or_else(|| row_blocks(p), NonZeroUsize::get);
    let rbi = rb as i32;
    let mut b = dev.kernel("moe", "moe_expert_gemv")?;
    b.arg(&wtab).arg(&g).arg(&input).arg(&ki);
    b.arg(&offsets).arg(&ei).arg(&slots).arg(&out);
    b.arg(&ro).arg(&co).arg(&dt).arg(&vec).arg(&st).arg(&rbi);
    // Eight warps of two rows each per block (`EX_RW` in `kernels/moe.cu`), rb times.
    let gx = rows_out.div_ceil(16 * rb) as u32;
    let gy = p.min(e) as u32;
    let smem = if stage { stage_bytes as u32 } else { 0 };
    // SAFETY: see the function's contract.
    unsafe { b.launch(grid((gx, gy, 1), 256, smem)) }.op("moe")?;
    Ok(())
}

/// One of a token's two expert GEMV passes, streamed, the shared expert included (see
/// `moe_stream_1` in `kernels/moe.cu`): `glu` = true reads the hidden row `input [1, cols]`
/// and writes the SwiGLU rows `out [top_k + shared, rows_out]`; false reads those rows and
/// writes `out [top_k + shared, rows_out]`. Row `top_k` belongs to the shared expert (table
/// entry `e`) when `shared`.
///
/// # Safety
/// `wtab` holds `3 * (e + shared)` addresses of bf16 weights (gate, up `[rows_out, cols]`
/// when `glu`; down `[rows_out, cols]` otherwise), 16-byte aligned; `input` is 16-byte
/// aligned and holds the rows named above; `offsets` (with its active list) and `slots` come
/// from [`lists`] for `top_k` pairs; `plan` is `plan::stream_plan` of `cols`, `rows_out`, 2
/// (glu) or 1, and `staged` = `plan::stream_staged_bytes`. A down pass (`glu` = false) is
/// issued right after the gate/up pass of the same routing, on the same stream (it reads the
/// routing before its `pdl_wait`).
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn expert_stream(
    dev: &Device,
    wtab: u64,
    glu: bool,
    input: u64,
    top_k: usize,
    offsets: u64,
    e: usize,
    slots: u64,
    out: u64,
    shared: bool,
    rows_out: usize,
    cols: usize,
    plan: StreamPlan,
) -> Result<()> {
    if top_k.min(e) + shared as usize > STREAM_MAX_SLOTS {
        return Err(kimi_ops::Error::Device(format!(
            "moe_stream_1: {top_k} pairs, at most {STREAM_MAX_SLOTS} slots"
        )));
    }
    let staged = crate::plan::stream_staged_bytes(glu, top_k, shared, cols) > 0;
    // The down pass follows the gate/up pass on the same stream: its routing is final before
    // its `pdl_wait` (see `moe_stream_1`), so it queues the routed tiles early.
    let route_ready = !glu;
    let ints = [
        glu as i32,
        top_k as i32,
        e as i32,
        rows_out as i32,
        cols as i32,
        plan.rows as i32,
        plan.stages as i32,
        shared as i32,
        staged as i32,
        route_ready as i32,
    ];
    let [g, ki, ei, ro, co, rows, stages, sh, st, rr] = ints;
    let mut b = dev.kernel("moe", "moe_stream_1")?;
    b.arg(&wtab).arg(&g).arg(&input).arg(&ki);
    b.arg(&offsets).arg(&ei).arg(&slots).arg(&out);
    b.arg(&ro).arg(&co).arg(&rows).arg(&stages);
    b.arg(&sh).arg(&st).arg(&rr);
    // The tile count is known on the device only (it depends on the routing): every
    // persistent CTA is launched.
    let ctas = plan.grid as u32;
    // SAFETY: see the function's contract.
    unsafe {
        b.launch(grid(
            (ctas, 1, 1),
            crate::ops::gemm::STREAM_THREADS,
            plan.smem,
        ))
    }
    .op("moe")?;
    Ok(())
}

/// A token's whole expert layer, streamed in one launch: the SwiGLU rows
/// `h [top_k + shared, inter]` of the hidden row `input [1, d]`, then `out [top_k + shared, d]`
/// from them. `int4: None`: bf16 experts (`moe_stream_layer`), as [`expert_stream`]'s two
/// passes compute them (bit for bit); `Some(offset)`: 4-bit integer experts in the planes of
/// `quant_layout` (`moe_int4_stream_layer`; `offset`: format 3, `q · a − b`).
///
/// # Safety
/// As [`expert_stream`] for both passes (for 4-bit experts: whole matrices in the planes,
/// 16-byte aligned); `plan` is `plan::layer_plan` (bf16) or `plan::packed_layer_plan` (4-bit)
/// of `d`, `inter` and `top_k + shared`; `sync` is two u32, zero between launches, used by no
/// other kernel.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn layer_stream(
    dev: &Device,
    wtab: u64,
    input: u64,
    top_k: usize,
    offsets: u64,
    e: usize,
    slots: u64,
    h: u64,
    out: u64,
    shared: bool,
    d: usize,
    inter: usize,
    plan: LayerPlan,
    int4: Option<bool>,
    sync: u64,
) -> Result<()> {
    let name = match int4 {
        None => "moe_stream_layer",
        Some(_) => "moe_int4_stream_layer",
    };
    if top_k.min(e) + shared as usize > STREAM_MAX_SLOTS {
        return Err(kimi_ops::Error::Device(format!(
            "{name}: {top_k} pairs, at most {STREAM_MAX_SLOTS} slots"
        )));
    }
    let ints = [
        top_k as i32,
        e as i32,
        d as i32,
        inter as i32,
        plan.rows_gu as i32,
        plan.rows_dn as i32,
        plan.stages as i32,
        plan.stage_bytes as i32,
        shared as i32,
    ];
    let [ki, ei, di, ii, rg, rd, st, sb, sh] = ints;
    let mut b = dev.kernel("moe", name)?;
    b.arg(&wtab).arg(&input).arg(&ki).arg(&offsets);
    b.arg(&ei).arg(&slots).arg(&h).arg(&out);
    b.arg(&di).arg(&ii);
    let fmt3 = i32::from(int4 == Some(true));
    if int4.is_some() {
        b.arg(&fmt3);
    }
    b.arg(&rg).arg(&rd);
    b.arg(&st).arg(&sb).arg(&sh).arg(&sync);
    // SAFETY: see the function's contract.
    unsafe {
        b.launch(grid(
            (plan.grid as u32, 1, 1),
            crate::ops::gemm::STREAM_THREADS,
            plan.smem,
        ))
    }
    .op("moe")?;
    Ok(())
}

/// Row blocks of 16 per CTA of `moe_expert_gemv` for `p` (token, expert) pairs: one while
/// few experts are active (every CTA is needed to fill the GPU), more once most experts
/// are.
fn row_blocks(p: usize) -> usize {
    if p >= 128 {
        4
    } else {
        1
    }
}

/// Tokens per pass over a weight row in `moe_expert_gemv` (`TG` in `kernels/moe.cu`).
const EXPERT_GEMV_GROUP: usize = 4;

/// `out[t] (+)= Σ_k weights[t, k] · y[row]` over `n` tokens of width `d`, where `row` is
/// the pair `t * top_k + k` itself, or `inv[pair]` when `inv` is non-zero (outputs in
/// sorted pair order, [`gather_bf16`]).
///
/// # Safety
/// `y` holds `n * top_k * d` f32, `weights` (and `inv` unless 0) `n * top_k` entries, `out`
/// `n * d`.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn combine(
    dev: &Device,
    y: u64,
    inv: u64,
    weights: u64,
    out: u64,
    n: usize,
    d: usize,
    top_k: usize,
    accumulate: bool,
) -> Result<()> {
    let (ni, di, ki, acc) = (n as i32, d as i32, top_k as i32, accumulate as i32);
    let mut b = dev.kernel("moe", "moe_combine")?;
    b.arg(&y).arg(&inv).arg(&weights).arg(&out);
    b.arg(&ni).arg(&di).arg(&ki).arg(&acc);
    // SAFETY: see the function's contract.
    unsafe { b.launch(flat(n * d)) }.op("moe")?;
    Ok(())
}

/// One projection of every routed pair on the tensor cores (`moe_grouped_mma` in
/// `kernels/moe_gemm.cu`): `glu` = gate/up with SiLU (`k` = hidden, `n_out` = intermediate),
/// else down (`k` = intermediate, `n_out` = hidden). `split`: activations as bf16 hi + lo.
///
/// # Safety
/// `wtab` holds `3 * e` addresses of 16-byte aligned bf16 weights (gate and up `[n_out, k]`
/// when `glu`, down `[n_out, k]` otherwise); `input` holds 16-byte aligned `k`-wide f32 rows
/// (tokens when `glu`, pairs otherwise); `offsets`/`slots` come from [`lists`] for `p`
/// pairs; `out` holds `p * n_out` f32; `k % 32 == 0`, `n_out % 64 == 0`.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn grouped_mma(
    dev: &Device,
    wtab: u64,
    glu: bool,
    split: bool,
    input: u64,
    top_k: usize,
    offsets: u64,
    slots: u64,
    e: usize,
    out: u64,
    p: usize,
    n_out: usize,
    k: usize,
) -> Result<()> {
    let (g, s, ki, ei) = (glu as i32, split as i32, top_k as i32, e as i32);
    let (ni, kk) = (n_out as i32, k as i32);
    let mut b = dev.kernel("moe_gemm", "moe_grouped_mma")?;
    b.arg(&wtab).arg(&g).arg(&s).arg(&input).arg(&ki);
    b.arg(&offsets)
        .arg(&slots)
        .arg(&ei)
        .arg(&out)
        .arg(&ni)
        .arg(&kk);
    // Every expert with pairs has at most one partial tile: an upper bound on the tiles,
    // known without reading the counts back; CTAs past the last tile exit at once.
    let tiles = p.div_ceil(64) + e.min(p);
    // SAFETY: see the function's contract.
    unsafe { b.launch(grid(((n_out / 64) as u32, tiles as u32, 1), 128, 0)) }.op("moe")?;
    Ok(())
}

/// Pairs per tile of the pipelined grouped GEMM: 128 once experts get ~100 pairs on
/// average, else 64 (fewer padded rows in the last tile of each expert).
pub(crate) fn mma_tile_rows(p: usize, e: usize) -> usize {
    if p >= 96 * e.max(1) {
        128
    } else {
        64
    }
}

/// Dynamic shared memory of `moe_mma_{bm}_*` (`moe_mma_smem_bytes` in `kernels/moe_gemm.cu`).
pub(crate) fn mma_smem_bytes(bm: usize) -> usize {
    const BN: usize = 128;
    const LDS: usize = 40;
    let stages = if bm == 128 { 3 } else { 4 };
    (stages * (2 * bm + BN) * LDS * 2).max(bm * (BN + 4) * 4)
}

/// One projection of every routed pair with the pipelined tensor-core kernel
/// (`moe_mma_*` in `kernels/moe_gemm.cu`).
///
/// `glu`: gate/up of the hidden states `a` (bf16 rows per token, the lo terms `a_lo`
/// elements further when `split`) into `out` = bf16 `h` rows in sorted pair order (lo terms
/// `out_lo` elements further); `n_out` = intermediate, `k` = hidden. Otherwise the down
/// projection of those `h` rows into f32 `out [p, n_out]` in pair order.
///
/// # Safety
/// `wtab` holds `3 * e` addresses of 16-byte aligned bf16 weights (gate and up
/// `[n_out, k]` when `glu`, down `[n_out, k]` otherwise); `a` holds the rows described
/// above (`n` tokens or `p` pairs of `k` bf16, twice when `split`); `offsets`/`slots` come
/// from [`lists`] for `p` pairs; `out` holds `p * n_out` bf16 (twice when `split`) for
/// `glu`, else `p * n_out` f32; `k % 32 == 0`, `n_out % 64 == 0`; `bm` is 64 or 128.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn grouped_mma_pipelined(
    dev: &Device,
    wtab: u64,
    glu: bool,
    split: bool,
    a: u64,
    a_lo: usize,
    top_k: usize,
    offsets: u64,
    slots: u64,
    e: usize,
    out: u64,
    out_lo: usize,
    p: usize,
    n_out: usize,
    k: usize,
    bm: usize,
) -> Result<()> {
    let name = match (bm, split) {
        (128, true) => "moe_mma_128_split",
        (128, false) => "moe_mma_128_half",
        (_, true) => "moe_mma_64_split",
        (_, false) => "moe_mma_64_half",
    };
    let bm = if bm == 128 { 128 } else { 64 };
    let (g, ki, ei) = (glu as i32, top_k as i32, e as i32);
    let (ni, kk) = (n_out as i32, k as i32);
    let (alo, olo) = (a_lo as u64, out_lo as u64);
    let mut b = dev.kernel("moe", name)?;
    b.arg(&wtab).arg(&g).arg(&a).arg(&alo).arg(&ki);
    b.arg(&offsets).arg(&slots).arg(&ei).arg(&out).arg(&olo);
    b.arg(&ni).arg(&kk);
    // Each expert with pairs has at most one partial tile: an upper bound on the tiles,
    // known without reading the counts back; CTAs past the last tile exit at once.
    let tiles = p.div_ceil(bm) + e.min(p);
    let cols = if glu { n_out / 64 } else { n_out.div_ceil(128) };
    let smem = mma_smem_bytes(bm) as u32;
    // SAFETY: see the function's contract; the kernel opts in to `smem` bytes at load.
    unsafe { b.launch(grid((cols as u32, tiles as u32, 1), 256, smem)) }.op("moe")?;
    Ok(())
}

/// Gathers the token rows of every sorted pair as bf16 (hi, then lo terms `p` rows further
/// when `split`) into `out`, and writes `inv[slots[pos]] = pos` (for [`combine`]), for the
/// `offsets[experts]` pairs [`lists`] placed (all `p` unless some were [`mask_absent`]ed).
///
/// # Safety
/// `x` holds 16-byte aligned f32 rows of width `d` (`d % 8 == 0`) for every token `rows`
/// names; `offsets` (over `experts`), `rows` and `slots` (`p` entries) come from [`lists`];
/// `out` holds `p * d` bf16 (twice when `split`), `inv` `p` u32.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn gather_bf16(
    dev: &Device,
    x: u64,
    rows: u64,
    slots: u64,
    offsets: u64,
    experts: usize,
    out: u64,
    inv: u64,
    p: usize,
    d: usize,
    split: bool,
) -> Result<()> {
    let (pi, di, s, ei) = (p as i32, d as i32, split as i32, experts as i32);
    let mut b = dev.kernel("moe", "moe_gather_bf16")?;
    b.arg(&x).arg(&rows).arg(&slots).arg(&offsets).arg(&ei);
    b.arg(&out).arg(&inv).arg(&pi).arg(&di).arg(&s);
    // SAFETY: see the function's contract.
    unsafe { b.launch(flat(p * d / 8)) }.op("moe")?;
    Ok(())
}

/// `h = silu(gate) * up` as bf16 rows (hi, then lo terms `p` rows further when `split`)
/// from the grouped GEMM's `[p, 2 * inter]` output `gu` (f32 when `gu_f32`, else bf16).
///
/// # Safety
/// `gu` holds `p * 2 * inter` elements, `h` `p * inter` bf16 (twice when `split`).
pub(crate) unsafe fn silu_mul_bf16(
    dev: &Device,
    gu: u64,
    gu_f32: bool,
    h: u64,
    p: usize,
    inter: usize,
    split: bool,
) -> Result<()> {
    let (f, pi, ii, s) = (gu_f32 as i32, p as i32, inter as i32, split as i32);
    let mut b = dev.kernel("moe", "moe_silu_mul_bf16")?;
    b.arg(&gu).arg(&f).arg(&h).arg(&pi).arg(&ii).arg(&s);
    // A thread per 8 columns of a row; row blocks walk the pairs.
    let threads = inter.div_ceil(8).next_multiple_of(32).min(256);
    let cfg = grid(
        (
            inter.div_ceil(8 * threads) as u32,
            p.clamp(1, 16384) as u32,
            1,
        ),
        threads as u32,
        0,
    );
    // SAFETY: see the function's contract.
    unsafe { b.launch(cfg) }.op("moe")?;
    Ok(())
}

/// Device buffers of one [`cutlass_gemm`] call.
pub(crate) struct CutlassBuffers {
    /// The per-group argument arrays (`kimi_moe_grouped_scratch_bytes` bytes).
    pub(crate) scratch: u64,
    /// CUTLASS's workspace (`kimi_moe_grouped_workspace_bytes` bytes).
    pub(crate) workspace: u64,
}

/// Bytes of (scratch, workspace) for a [`cutlass_gemm`] over `experts` experts.
pub(crate) fn cutlass_bytes(experts: usize) -> (usize, usize) {
    let groups = (2 * experts) as i32;
    // SAFETY: plain size queries (the workspace one reads the device's SM count).
    unsafe {
        let scratch = kimi_cuda_kernels::cutlass::kimi_moe_grouped_scratch_bytes(groups);
        let ws = kimi_cuda_kernels::cutlass::kimi_moe_grouped_workspace_bytes(groups, 1)
            .max(kimi_cuda_kernels::cutlass::kimi_moe_grouped_workspace_bytes(groups, 0));
        (scratch, ws)
    }
}

/// One projection of every sorted pair through the CUTLASS grouped GEMM
/// (`cutlass/moe_grouped.cu`): `glu` = gate and up into `d [p, 2n]` (`n` = intermediate),
/// else down into `d [p, n]`; `a` holds bf16 pair rows of width `k`; `beta` = 1 adds to `d`.
///
/// # Safety
/// `wtab` holds `3 * experts` addresses of 16-byte aligned bf16 weights (gate and up
/// `[n, k]`, down `[n, k]`); `offsets` comes from [`lists`]; `a` holds `p * k` bf16 and `d`
/// `p * ldd` elements (f32 when `d_f32`), both 16-byte aligned; `k % 8 == 0`, `n % 8 == 0`;
/// the buffers hold [`cutlass_bytes`]. The device's context is current on this thread and
/// no pass is being recorded (the launch bypasses the recorder).
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn cutlass_gemm(
    dev: &Device,
    glu: bool,
    d_f32: bool,
    experts: usize,
    offsets: u64,
    wtab: u64,
    a: u64,
    d: u64,
    n: usize,
    k: usize,
    beta: f32,
    bufs: &CutlassBuffers,
) -> Result<()> {
    let ldd = if glu { 2 * n } else { n };
    // SAFETY: see the function's contract; the stream is the device's.
    let rc = unsafe {
        kimi_cuda_kernels::cutlass::kimi_moe_grouped_gemm(
            glu as i32,
            d_f32 as i32,
            experts as i32,
            offsets as *const u32,
            wtab as *const u64,
            a as *const std::ffi::c_void,
            d as *mut std::ffi::c_void,
            n as i32,
            k as i32,
            ldd as i32,
            beta,
            bufs.scratch as *mut std::ffi::c_void,
            bufs.workspace as *mut std::ffi::c_void,
            dev.stream.cu_stream() as *mut std::ffi::c_void,
        )
    };
    if rc != 0 {
        let step = match rc {
            1 => "unsupported sizes",
            2 => "group argument kernel launch",
            3 => "can_implement",
            4 => "initialize",
            _ => "kernel launch",
        };
        return Err(crate::error::Error::Cuda {
            op: "moe",
            detail: format!(
                "CUTLASS grouped GEMM ({experts} experts, n {n}, k {k}): {step} failed (code {rc})"
            ),
        }
        .into());
    }
    Ok(())
}

/// Copies `p` routed pairs (`ids` u32, `weights` f32) into `ids_out`/`weights_out`, those
/// whose expert is absent (`present[e] == 0`: held by another rank, or computed on the host)
/// given the id [`NO_EXPERT`] and weight 0: [`lists`] places none of them, so no expert
/// kernel computes them, and [`combine`] skips them (see `moe_mask_absent` in
/// `kernels/moe.cu`).
///
/// # Safety
/// `ids`, `weights`, `ids_out` and `weights_out` hold `p` 4-byte entries; every id is below
/// the length of `present` (bytes).
pub(crate) unsafe fn mask_absent(
    dev: &Device,
    ids: u64,
    weights: u64,
    present: u64,
    p: usize,
    ids_out: u64,
    weights_out: u64,
) -> Result<()> {
    let pi = p as i32;
    let mut b = dev.kernel("moe", "moe_mask_absent")?;
    b.arg(&ids).arg(&weights).arg(&present).arg(&pi);
    b.arg(&ids_out).arg(&weights_out);
    // SAFETY: see the function's contract; one thread per pair.
    unsafe { b.launch(flat(p)) }.op("moe")?;
    Ok(())
}

/// The expert id [`mask_absent`] gives a pair that no kernel is to compute.
pub(crate) const NO_EXPERT: u32 = u32::MAX;

/// `counts[e] +=` the number of the `n` ids (u32) equal to `e`, for `e < experts`: the
/// first kernel of the multi-block [`lists`].
///
/// # Safety
/// `ids` holds `n` u32 and `counts` `experts` u32.
pub(crate) unsafe fn count(
    dev: &Device,
    ids: u64,
    n: usize,
    counts: u64,
    experts: usize,
) -> Result<()> {
    let (ni, ei) = (n as i32, experts as i32);
    let mut b = dev.kernel("moe", "moe_lists_count")?;
    b.arg(&ids).arg(&ni).arg(&ei).arg(&counts);
    let blocks = n.div_ceil(LISTS_CHUNK).max(1) as u32;
    // SAFETY: see the function's contract; shared memory holds `experts` u32.
    unsafe { b.launch(grid((blocks, 1, 1), 1024, (experts * 4) as u32)) }.op("moe")?;
    Ok(())
}

/// Layers per `moe_count_layers` launch (`COUNT_LAYERS` in `kernels/moe.cu`).
pub(crate) const COUNT_LAYERS: usize = 64;

/// `struct MoeCountLayers` of `moe.cu`, passed by value as a kernel parameter.
#[repr(C)]
#[derive(Clone, Copy)]
struct CountTable {
    ids: [u64; COUNT_LAYERS],
    n: [i32; COUNT_LAYERS],
}

const _: () = assert!(std::mem::size_of::<CountTable>() == 12 * COUNT_LAYERS);

// SAFETY: plain-old-data with the C layout of `struct MoeCountLayers` (no padding).
unsafe impl cudarc::driver::DeviceRepr for CountTable {}

/// `counts[l][e] +=` how many of layer `l`'s ids equal `e`, for every `(ids, n)` of
/// `layers` (an address of `n` u32 ids; `n` = 0 leaves its row alone): one launch per
/// [`COUNT_LAYERS`] layers instead of one per layer.
///
/// # Safety
/// Each `ids` holds its `n` u32 and `counts` holds `layers.len() * experts` u32.
pub(crate) unsafe fn count_layers(
    dev: &Device,
    layers: &[(u64, usize)],
    counts: u64,
    experts: usize,
) -> Result<()> {
    let ei = experts as i32;
    for (g, group) in layers.chunks(COUNT_LAYERS).enumerate() {
        let mut table = CountTable {
            ids: [0; COUNT_LAYERS],
            n: [0; COUNT_LAYERS],
        };
        for (i, &(ids, n)) in group.iter().enumerate() {
            table.ids[i] = ids;
            table.n[i] = i32::try_from(n)
                .map_err(|_| Error::Unsupported("expert counts over 2^31 pairs".into()))?;
        }
        let most = group.iter().map(|l| l.1).max().unwrap_or(0);
        let out = counts + (g * COUNT_LAYERS * experts * 4) as u64;
        let mut b = dev.kernel("moe", "moe_count_layers")?;
        b.arg(&table).arg(&ei).arg(&out);
        let blocks = most.div_ceil(LISTS_CHUNK).max(1) as u32;
        // SAFETY: see the function's contract; grid y = the group's layers, shared memory
        // holds `experts` u32.
        unsafe {
            b.launch(grid(
                (blocks, group.len() as u32, 1),
                1024,
                (experts * 4) as u32,
            ))
        }
        .op("moe")?;
    }
    Ok(())
}
