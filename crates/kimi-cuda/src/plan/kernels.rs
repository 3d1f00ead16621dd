//! The planners of the dense products (GEMM or GEMV), chunked KDA and MLA prefill.

use super::stream::{packed_gemv_plan, stream_plan, PackedGemvPlan, StreamPlan};
use super::{GemmPrecision, GemvKernel, KdaChunkKernel, KernelConfig, MlaPrefillKernel};

/// Up to this many rows, GEMMs against bf16 weights (either precision) run as an f32-product
/// GEMV kernel (`kernels/gemv.cu`) instead of split + cuBLAS + sum.
pub(crate) const GEMV_MAX_ROWS: usize = 8;

/// From this many rows, a Split-precision GEMM runs as two accumulating GEMMs (hi, then
/// lo) instead of one of twice the rows plus a summing pass: the weight is read twice, which
/// costs little once the product is compute-bound, and the [2n, o] intermediate goes away.
const SPLIT_ACCUMULATE_MIN_ROWS: usize = 512;

/// Shared memory a `gemv_bulk` CTA may use for its weight tile (the default limit, so the
/// kernel needs no opt-in).
const BULK_TILE_BYTES: usize = 48 * 1024;

/// How `x [n, k] · wᵀ` against a 16-bit weight runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum MatmulPath {
    /// The f32-product GEMV (bf16 weights, a few rows; see [`plan_gemv`]).
    Gemv,
    /// The activations rounded once to the weight's type, one cuBLAS GEMM.
    Half,
    /// hi and lo rows stacked into one GEMM of `2n` rows, then summed (the weight is read
    /// once).
    SplitStacked,
    /// `y = hi · wᵀ`, then `y += lo · wᵀ` (cuBLAS's beta = 1).
    SplitAccumulate,
}

/// The path of an `n`-row product against a bf16 (`weight_bf16`) or f16 weight; `aligned`:
/// the activations and the weight are 16-byte aligned with rows of a multiple of 8.
pub(crate) fn plan_matmul(
    cfg: &KernelConfig,
    weight_bf16: bool,
    n: usize,
    aligned: bool,
) -> MatmulPath {
    // A few rows (decode): the GEMV in either precision; it streams the weight faster than
    // cuBLAS and rounding the activations would gain nothing.
    if weight_bf16 && n <= GEMV_MAX_ROWS && aligned {
        MatmulPath::Gemv
    } else if cfg.precision == GemmPrecision::Half {
        MatmulPath::Half
    } else if n >= SPLIT_ACCUMULATE_MIN_ROWS {
        MatmulPath::SplitAccumulate
    } else {
        MatmulPath::SplitStacked
    }
}

/// Which GEMV kernel runs `x [n, k] · wᵀ` for a bf16 `w [o, k]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum GemvPath {
    /// `gemv_stream_1`, cut by the plan.
    Stream(StreamPlan),
    /// `gemv_bulk_{1,4,8}` with `rows` weight rows per CTA.
    Bulk { rows: usize },
    /// The register-streaming `gemv_bf16` / `gemv_bf16_8`.
    Register,
}

/// Weight rows per `gemv_bulk` CTA for rows of `k` bf16: the largest of 8, 4, 2, 1 whose
/// tile fits [`BULK_TILE_BYTES`]; `None` when not even one row does.
fn bulk_rows(k: usize) -> Option<usize> {
    [8, 4, 2, 1]
        .into_iter()
        .find(|r| r * k * 2 <= BULK_TILE_BYTES)
}

/// Where `gemv_bulk` beat `gemv_bf16` on an H200 (`check gemv-bench`,
/// device-results/2026-11-30-50826b9): at one token everywhere but very short rows (it
/// fetches a whole tile per DRAM round trip); at up to 8 tokens only on narrow matrices
/// (o <= 1024: router, MLA kv_a, shared expert gate/up, 2.3-2.5x faster) and very long
/// rows (k >= 8192), since it re-reads every activation row per CTA from L2.
fn prefers_bulk(n: usize, k: usize, o: usize) -> bool {
    k >= 256 && (n == 1 || o <= 1024 || k >= 8192)
}

/// The GEMV kernel for `n` (1..=8) rows of `k` against `o` weight rows on `sm_count` SMs.
pub(crate) fn plan_gemv(
    cfg: &KernelConfig,
    sm_count: usize,
    n: usize,
    k: usize,
    o: usize,
) -> GemvPath {
    // One token, on request: the persistent streamed kernel, with the activation row
    // staged. It matched `gemv_bulk` at the model's shapes but not bettered it (o_proj was
    // slower; device-results/2026-12-01-ee40ab2), so the automatic choice stays with the
    // latter.
    if cfg.gemv == GemvKernel::Stream && n == 1 {
        if let Some(plan) = stream_plan(cfg.stream_shape, sm_count, k, o, 1, k * 4) {
            return GemvPath::Stream(plan);
        }
    }
    let bulk = match cfg.gemv {
        GemvKernel::Register => None,
        GemvKernel::Bulk => bulk_rows(k),
        GemvKernel::Auto | GemvKernel::Stream => bulk_rows(k).filter(|_| prefers_bulk(n, k, o)),
    };
    bulk.map_or(GemvPath::Register, |rows| GemvPath::Bulk { rows })
}

/// Whether two one-token products of rows of `k` against `oa` and `ob` weight rows share
/// one `gemv_bf16_pair` launch: where the automatic choice for each alone is `gemv_bf16`.
pub(crate) fn plan_gemv_pair(cfg: &KernelConfig, k: usize, oa: usize, ob: usize) -> bool {
    cfg.gemv == GemvKernel::Auto && !prefers_bulk(1, k, oa.max(ob)) && oa * ob != 0
}

/// The most activation rows one `quant_gemv_*` launch takes.
pub(crate) const QUANT_GEMV_MAX_ROWS: usize = 8;

/// Shared memory of a `quant_gemv_*` CTA, static and dynamic together: the default limit
/// (no opt-in, and 3-4 CTAs per SM).
const QUANT_GEMV_SMEM_BYTES: usize = 48 * 1024;

/// Shared-memory bytes per staged 32-value block and activation row: 32 f32 and their sum.
const QUANT_GEMV_BLOCK_BYTES: usize = 32 * 4 + 4;

/// The activation rows the `quant_gemv_*` kernel for `n` rows is compiled for (`NT`).
pub(crate) fn quant_gemv_tile(n: usize) -> usize {
    match n {
        0..=2 => n.max(1),
        3..=4 => 4,
        _ => 8,
    }
}

/// Static shared memory of the `quant_gemv_*` kernel for `n` rows: its cross-warp sums,
/// `red[4][16][NT]` f32.
fn quant_gemv_static_smem(n: usize) -> usize {
    4 * 16 * quant_gemv_tile(n) * 4
}

/// How `x [n, k] · wᵀ` runs for a packed `w [o, k]` and a few activation rows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum QuantGemvPath {
    /// `quant_gemv_*` (`kernels/quant.cu`), with `quant_gemv_reduce` after it when K splits.
    Blocks(QuantGemvPlan),
    /// One token of a 4-bit matrix: `quant_gemv_int4_stream_1` (`kernels/int4_stream.cu`).
    Int4Stream(PackedGemvPlan),
}

/// The largest 4-bit matrix the streamed one-token kernel takes. On an H100 (`check
/// quant-bench`, 2026-12-07) it beat `quant_gemv_*_1` up to o_proj's 7.1 MB (8.25 against
/// 9.17 us; expert-sized matrices 5.9 against 11.6 us) and lost from MLA q_proj's 10.6 MB
/// up (10.05 against 9.31 us; the 21.7 MB KDA projection 18.4 against 13.8): its f32
/// products on 8 warps an SM top out near 1.1 TB/s, where the 16 warps of `quant_gemv_*`
/// keep more in flight.
pub(crate) const INT4_STREAM_GEMV_MAX_BYTES: usize = 8 << 20;

/// The kernel for `n` rows of `x` (`x_aligned`: at a 16-byte address) against a packed
/// `[o, k]` matrix of format `fmt` (`quant_layout::format_code`): the streamed 4-bit kernel
/// at one row where `int4_stream_gemv` is on, the matrix is at most
/// [`INT4_STREAM_GEMV_MAX_BYTES`] and its cut applies, else `quant_gemv_*`.
pub(crate) fn plan_quant_gemv_path(
    cfg: &KernelConfig,
    sm_count: usize,
    fmt: i32,
    n: usize,
    k: usize,
    o: usize,
    x_aligned: bool,
) -> QuantGemvPath {
    let four_bit = fmt == 0 || fmt == 3;
    let small = o.saturating_mul(k / 32 * 24) <= INT4_STREAM_GEMV_MAX_BYTES;
    if n == 1 && four_bit && x_aligned && small && cfg.int4_stream_gemv {
        if let Some(plan) = packed_gemv_plan(sm_count, k, o) {
            return QuantGemvPath::Int4Stream(plan);
        }
    }
    QuantGemvPath::Blocks(plan_quant_gemv(sm_count, n, k, o))
}

/// Whether two one-token products over packed matrices of formats `fmt_a` and `fmt_b` and
/// `k` columns run in one `quant_gemv_narrow_pair` launch (`kernels/quant.cu`): with
/// `int4_stream_gemv`, one 4-bit format, a lane per 32-value block of a row (k / 32 a power
/// of two up to 32) and 16-byte aligned activations. KDA's f_b and g_b (128 columns) are the
/// case: two `quant_gemv_*_1` launches of ~5 us each on an H100.
pub(crate) fn plan_quant_gemv_pair(
    cfg: &KernelConfig,
    fmt_a: i32,
    fmt_b: i32,
    k: usize,
    x_aligned: bool,
) -> bool {
    let nb = k / 32;
    cfg.int4_stream_gemv
        && fmt_a == fmt_b
        && (fmt_a == 0 || fmt_a == 3)
        && k.is_multiple_of(32)
        && nb.is_power_of_two()
        && nb <= 32
        && x_aligned
}

/// A launch of `quant_gemv_*` (`kernels/quant.cu`): `x [n, k] · wᵀ` for a packed `w [o, k]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct QuantGemvPlan {
    /// K slices per CTA (1, 2 or 4): the CTA's 4 warps cover `64 / wk` rows.
    pub wk: usize,
    /// 32-value blocks of the activations staged in shared memory at a time.
    pub chunk: usize,
    /// CTAs (of 128 threads) along the rows: `grid.x`.
    pub ctas: usize,
    /// CTAs along K (`grid.y`), each taking `span` blocks: with more than one, each writes
    /// partial sums `[splits, n, o]` that `quant_gemv_reduce` adds in order.
    pub splits: usize,
    /// 32-value blocks of K per split (all of them without a split).
    pub span: usize,
    /// Dynamic shared memory per CTA.
    pub smem: usize,
}

/// The `quant_gemv_*` launch for `n` (1..=8) activation rows of `k` (a multiple of 32)
/// against `o` packed weight rows on `sm_count` SMs. A CTA stages the activations once for
/// its rows, so it takes as many rows as fill the SMs (twice over for one or two rows,
/// whose staging is cheap, to even out the SMs' shares): 64, else 32 rows (else 16 at one
/// or two rows), the CTA's warps splitting K between them. Where those leave SMs idle
/// (small `o`), K is split across 64-row CTAs instead, about a wave of them (4 per SM, 3 at
/// 5..8 rows), in whole warp steps of 8 blocks, with a second pass adding the partial sums;
/// unless 16-row CTAs (unsplit) are as many.
pub(crate) fn plan_quant_gemv(sm_count: usize, n: usize, k: usize, o: usize) -> QuantGemvPlan {
    let n = n.clamp(1, QUANT_GEMV_MAX_ROWS);
    let o = o.max(1);
    let nb = (k / 32).max(1);
    let want = if n <= 2 { 2 * sm_count } else { sm_count };
    let rows_ctas = |wk: usize| o.div_ceil(64 / wk);
    // 16-row CTAs stage the activations four times over: only for one or two rows.
    let unsplit: &[usize] = if n <= 2 { &[1, 2, 4] } else { &[1, 2] };
    let (wk, splits, span) = match unsplit.iter().copied().find(|&wk| rows_ctas(wk) >= want) {
        Some(wk) => (wk, 1, nb),
        None => {
            let wave = sm_count * if n <= 4 { 4 } else { 3 };
            let steps = nb.div_ceil(8);
            let per = steps.div_ceil(wave.div_ceil(rows_ctas(1)).clamp(1, steps));
            let splits = steps.div_ceil(per);
            if splits > 1 && rows_ctas(1) * splits > rows_ctas(4) {
                (1, splits, (8 * per).min(nb))
            } else {
                (4, 1, nb)
            }
        }
    };
    let cap = (QUANT_GEMV_SMEM_BYTES - quant_gemv_static_smem(n)) / (n * QUANT_GEMV_BLOCK_BYTES);
    let chunk = if span <= cap {
        span
    } else {
        // Whole steps of the CTA's warps (8 blocks per warp), so that they stay even.
        (cap / (8 * wk) * (8 * wk)).max(8 * wk)
    };
    QuantGemvPlan {
        wk,
        chunk,
        ctas: rows_ctas(wk),
        splits,
        span,
        smem: n * chunk * QUANT_GEMV_BLOCK_BYTES,
    }
}

/// How the chunked KDA form runs (head sizes 64 and 128).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum KdaChunkPath {
    /// `kda_chunk_prep_D` + `kda_chunk_state_D` on the CUDA cores.
    F32,
    /// A preparation kernel, then `kda_chunk_mma_D_{split,half}` on the tensor cores.
    TensorCore(KdaPrep),
}

/// The preparation kernel of [`KdaChunkPath::TensorCore`] (both write the same scratch).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum KdaPrep {
    /// `kda_chunk_prep_blk_D`, by 16-row blocks.
    Blocked,
    /// `kda_chunk_prep_mma_D`, the pair loop.
    PairLoop,
}

/// The chunked KDA kernels.
pub(crate) fn plan_kda_chunk(cfg: &KernelConfig) -> KdaChunkPath {
    match cfg.kda_chunk {
        KdaChunkKernel::Auto => KdaChunkPath::TensorCore(KdaPrep::Blocked),
        KdaChunkKernel::F32 => KdaChunkPath::F32,
        KdaChunkKernel::MmaPairPrep => KdaChunkPath::TensorCore(KdaPrep::PairLoop),
    }
}

/// What the expanded MLA kernels need of one segment, found by `ops::mla`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct MlaPrefillFacts {
    /// Heads of 192 (q·k) and 128 (v) with the nope part a multiple of 4: FlashInfer's
    /// kernel's layout.
    pub(crate) flashinfer_heads: bool,
    /// q, the latent rows, kv and the output are 16-byte aligned.
    pub(crate) aligned: bool,
    /// Every width the vector kernels load is a multiple of 4.
    pub(crate) vec_widths: bool,
    /// The head widths are multiples of 16 and the tensor-core kernel's tiles fit its
    /// shared memory.
    pub(crate) mma_fits: bool,
    /// A pass is being recorded (FlashInfer's host launch would bypass the recorder).
    pub(crate) recording: bool,
}

/// The expanded MLA kernel of one segment.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum MlaPrefillPath {
    /// FlashInfer's Hopper kernel on bf16 copies (`mla_pack_bf16`).
    FlashInfer,
    /// `mla_flash_prefill_mma` (hi + lo operands under the split).
    TensorCore,
    /// `mla_flash_prefill_vec`, f32 with vector loads.
    F32Vec,
    /// `mla_flash_prefill`, f32.
    F32,
}

/// The expanded MLA kernel for a segment with `facts`.
pub(crate) fn plan_mla_prefill(cfg: &KernelConfig, facts: &MlaPrefillFacts) -> MlaPrefillPath {
    let vec = facts.vec_widths && facts.aligned;
    match cfg.mla_prefill {
        MlaPrefillKernel::Auto
            if !cfg.split() && facts.flashinfer_heads && facts.aligned && !facts.recording =>
        {
            MlaPrefillPath::FlashInfer
        }
        MlaPrefillKernel::Auto | MlaPrefillKernel::NoFlashInfer if vec && facts.mma_fits => {
            MlaPrefillPath::TensorCore
        }
        _ if vec => MlaPrefillPath::F32Vec,
        _ => MlaPrefillPath::F32,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs the index arithmetic of `quant_gemv_body` (`kernels/quant.cu`) for every thread
    /// of `p`'s grid: each (row, block) of `w [o, k]` is summed exactly once, by a lane
    /// whose loaded weights are that block's, and lands in the CTA's output of that row.
    fn quant_gemv_covers(p: &QuantGemvPlan, o: usize, k: usize) {
        let nb = k / 32;
        let mut seen = vec![0u32; o * nb];
        let (wr_count, stride, ch) = (4 / p.wk, 8 * p.wk, p.chunk);
        for split in 0..p.splits {
            // Block indices count from the split's first, kb0, as in the kernel.
            let kb0 = split * p.span;
            let nk = (nb - kb0).min(p.span);
            for cta in 0..p.ctas {
                for warp in 0..4 {
                    let (wr, wk) = (warp % wr_count, warp / wr_count);
                    for lane in 0..32 {
                        let (g, l8) = (lane >> 3, lane & 7);
                        let row0 = cta * 16 * wr_count + 16 * wr + 4 * g;
                        let mut cur = None;
                        let b = 8 * wk + l8;
                        if b < ch.min(nk) {
                            cur = Some(b);
                        }
                        let mut c0 = 0;
                        while c0 < nk {
                            let c1 = (c0 + ch).min(nk);
                            if c0 > 0 && c0 + 8 * wk + l8 < c1 {
                                cur = Some(c0 + 8 * wk + l8);
                            }
                            let mut s0 = c0 + 8 * wk;
                            while s0 < c1 {
                                let b = s0 + l8;
                                if b < c1 {
                                    assert_eq!(cur, Some(b), "{p:?} {o} {k}");
                                    assert!(b - c0 < ch);
                                    for r in 0..4 {
                                        if row0 + r < o {
                                            seen[(row0 + r) * nb + kb0 + b] += 1;
                                        }
                                    }
                                }
                                if s0 + stride < c1 && b + stride < c1 {
                                    cur = Some(b + stride);
                                }
                                s0 += stride;
                            }
                            c0 += ch;
                        }
                    }
                }
            }
        }
        assert!(seen.iter().all(|&c| c == 1), "{p:?} {o} {k}");
    }

    #[test]
    fn quant_gemv_plans_cover_every_block_once_within_the_shared_memory() {
        for n in 1..=8 {
            for (o, k) in [
                (12576, 2304),
                (2304, 4096),
                (6144, 2304),
                (1024, 2304),
                (2304, 1024),
                (9216, 2304),
                (2304, 9216),
                (37, 96),
                (37, 256),
                (33, 1056),
                (33, 1280),
                (129, 2304),
                (225, 2304),
                (40, 96),
                (40, 256),
                (96, 256),
                (256, 96),
                (256, 256),
                (7, 2336),
                (100, 1984),
                (3000, 2336),
            ] {
                let p = plan_quant_gemv(132, n, k, o);
                assert!([1, 2, 4].contains(&p.wk), "{n} {o} {k}: {p:?}");
                assert_eq!(p.ctas, o.div_ceil(64 / p.wk));
                let total = p.smem + quant_gemv_static_smem(n);
                assert!(total <= QUANT_GEMV_SMEM_BYTES, "{n} {o} {k}: {p:?}");
                assert_eq!(p.smem, n * p.chunk * QUANT_GEMV_BLOCK_BYTES);
                assert!(p.chunk <= p.span && p.span <= k / 32, "{n} {o} {k}: {p:?}");
                assert!(p.chunk == p.span || p.chunk.is_multiple_of(8 * p.wk));
                assert_eq!(p.splits, (k / 32).div_ceil(p.span));
                assert!(p.splits == 1 || (p.wk == 1 && p.span.is_multiple_of(8)));
                quant_gemv_covers(&p, o, k);
            }
        }
        // The failing case of the first H100 run: 47,520 bytes staged plus 2,048 static.
        let p = plan_quant_gemv(132, 5, 2304, 129);
        assert!(p.smem + quant_gemv_static_smem(5) <= 48 * 1024);
        assert_eq!((p.wk, p.ctas, p.splits, p.span), (1, 3, 9, 8));
        // The 48B model's kda in projection fills the SMs with 64- or 32-row CTAs, unsplit.
        let kda = plan_quant_gemv(132, 8, 2304, 12576);
        assert_eq!((kda.wk, kda.splits), (1, 1));
        let kda = plan_quant_gemv(132, 1, 2304, 12576);
        assert_eq!((kda.wk, kda.splits), (2, 1));
        // o_proj, expert gate/up and dense down split K over 64-row CTAs, about a wave.
        let o_proj = plan_quant_gemv(132, 1, 4096, 2304);
        assert_eq!(
            (o_proj.wk, o_proj.ctas, o_proj.splits, o_proj.span),
            (1, 36, 8, 16)
        );
        let o_proj = plan_quant_gemv(132, 8, 4096, 2304);
        assert_eq!((o_proj.ctas, o_proj.splits, o_proj.chunk), (36, 8, 16));
        let gate = plan_quant_gemv(132, 1, 2304, 1024);
        assert_eq!((gate.wk, gate.ctas, gate.splits, gate.span), (1, 16, 9, 8));
        let down = plan_quant_gemv(132, 4, 9216, 2304);
        assert_eq!(
            (down.wk, down.ctas, down.splits, down.span),
            (1, 36, 12, 24)
        );
        // Expert down: 16-row CTAs are as many as a split would make.
        let down = plan_quant_gemv(132, 1, 1024, 2304);
        assert_eq!((down.wk, down.ctas, down.splits), (4, 144, 1));
        // Tiny products stay one launch.
        assert_eq!(plan_quant_gemv(132, 1, 96, 37).splits, 1);
    }

    #[test]
    fn one_token_4bit_products_stream_up_to_8_mib() {
        let cfg = KernelConfig::default();
        let path = |fmt, n, k, o, aligned| plan_quant_gemv_path(&cfg, 132, fmt, n, k, o, aligned);
        // o_proj (7.1 MB) and an expert-sized matrix stream, for Q4Z and format 3.
        for fmt in [0, 3] {
            assert!(matches!(
                path(fmt, 1, 4096, 2304, true),
                QuantGemvPath::Int4Stream(_)
            ));
            assert!(matches!(
                path(fmt, 1, 2304, 1024, true),
                QuantGemvPath::Int4Stream(_)
            ));
        }
        // Larger matrices, more rows, 8-bit types, unaligned activations, widths that are
        // not whole words per lane, or the choice off: `quant_gemv_*`.
        let blocks = |p: QuantGemvPath| matches!(p, QuantGemvPath::Blocks(_));
        assert!(blocks(path(0, 1, 2304, 6144, true)));
        assert!(blocks(path(0, 2, 4096, 2304, true)));
        assert!(blocks(path(1, 1, 4096, 2304, true)));
        assert!(blocks(path(0, 1, 4096, 2304, false)));
        assert!(blocks(path(0, 1, 1056, 33, true)));
        let off = with(|c| c.int4_stream_gemv = false);
        assert!(blocks(plan_quant_gemv_path(
            &off, 132, 0, 1, 4096, 2304, true
        )));
        // KDA's f_b and g_b pair in one launch; 8-bit and mixed types do not.
        assert!(plan_quant_gemv_pair(&cfg, 0, 0, 128, true));
        assert!(plan_quant_gemv_pair(&cfg, 3, 3, 1024, true));
        assert!(!plan_quant_gemv_pair(&cfg, 0, 3, 128, true));
        assert!(!plan_quant_gemv_pair(&cfg, 1, 1, 128, true));
        assert!(!plan_quant_gemv_pair(&cfg, 0, 0, 2048, true));
        assert!(!plan_quant_gemv_pair(&cfg, 0, 0, 96, true));
        assert!(!plan_quant_gemv_pair(&cfg, 0, 0, 128, false));
    }

    fn with(f: impl FnOnce(&mut KernelConfig)) -> KernelConfig {
        let mut cfg = KernelConfig::default();
        f(&mut cfg);
        cfg
    }

    #[test]
    fn matmuls_take_the_gemv_up_to_8_rows() {
        let cfg = KernelConfig::default();
        assert_eq!(plan_matmul(&cfg, true, 1, true), MatmulPath::Gemv);
        assert_eq!(plan_matmul(&cfg, true, 8, true), MatmulPath::Gemv);
        assert_eq!(plan_matmul(&cfg, true, 9, true), MatmulPath::SplitStacked);
        assert_eq!(plan_matmul(&cfg, true, 511, true), MatmulPath::SplitStacked);
        assert_eq!(
            plan_matmul(&cfg, true, 512, true),
            MatmulPath::SplitAccumulate
        );
        // f16 weights and unaligned rows go to cuBLAS whatever the rows.
        assert_eq!(plan_matmul(&cfg, false, 1, true), MatmulPath::SplitStacked);
        assert_eq!(plan_matmul(&cfg, true, 1, false), MatmulPath::SplitStacked);
        let half = with(|c| c.precision = GemmPrecision::Half);
        assert_eq!(plan_matmul(&half, true, 4, true), MatmulPath::Gemv);
        assert_eq!(plan_matmul(&half, true, 9, true), MatmulPath::Half);
        assert_eq!(plan_matmul(&half, true, 4096, true), MatmulPath::Half);
    }

    #[test]
    fn gemv_defaults_follow_the_measured_split() {
        let cfg = KernelConfig::default();
        // One token: the bulk kernel with the most rows whose tile fits 48 KiB.
        assert_eq!(
            plan_gemv(&cfg, 132, 1, 2304, 4096),
            GemvPath::Bulk { rows: 8 }
        );
        assert_eq!(
            plan_gemv(&cfg, 132, 1, 9216, 2304),
            GemvPath::Bulk { rows: 2 }
        );
        // Very short rows, and 8 tokens on wide matrices: the register kernel.
        assert_eq!(plan_gemv(&cfg, 132, 1, 128, 4096), GemvPath::Register);
        assert_eq!(plan_gemv(&cfg, 132, 8, 2304, 4096), GemvPath::Register);
        // 8 tokens on narrow matrices or very long rows: bulk.
        assert_eq!(
            plan_gemv(&cfg, 132, 8, 2304, 1024),
            GemvPath::Bulk { rows: 8 }
        );
        assert_eq!(
            plan_gemv(&cfg, 132, 8, 9216, 2304),
            GemvPath::Bulk { rows: 2 }
        );
        // The pair kernel only where each alone would take gemv_bf16.
        assert!(plan_gemv_pair(&cfg, 128, 4096, 64));
        assert!(!plan_gemv_pair(&cfg, 2304, 4096, 64));
        assert!(!plan_gemv_pair(&cfg, 128, 4096, 0));
    }

    #[test]
    fn gemv_overrides() {
        let regs = with(|c| c.gemv = GemvKernel::Register);
        assert_eq!(plan_gemv(&regs, 132, 1, 2304, 4096), GemvPath::Register);
        assert!(!plan_gemv_pair(&regs, 128, 4096, 64));
        let bulk = with(|c| c.gemv = GemvKernel::Bulk);
        assert_eq!(
            plan_gemv(&bulk, 132, 8, 2304, 4096),
            GemvPath::Bulk { rows: 8 }
        );
        // Rows too long for one row per tile: the register kernel even when forced.
        assert_eq!(plan_gemv(&bulk, 132, 1, 32768, 64), GemvPath::Register);
        let stream = with(|c| c.gemv = GemvKernel::Stream);
        assert!(matches!(
            plan_gemv(&stream, 132, 1, 2304, 4096),
            GemvPath::Stream(_)
        ));
        // Not one token, or rows no stream cut divides: as automatic.
        assert_eq!(plan_gemv(&stream, 132, 8, 2304, 4096), GemvPath::Register);
        assert_eq!(
            plan_gemv(&stream, 132, 1, 2300, 4096),
            GemvPath::Bulk { rows: 8 }
        );
        assert!(!plan_gemv_pair(&stream, 128, 4096, 64));
    }

    #[test]
    fn kda_chunk_kernels() {
        let tc = |c: KernelConfig| plan_kda_chunk(&c);
        assert_eq!(
            tc(KernelConfig::default()),
            KdaChunkPath::TensorCore(KdaPrep::Blocked)
        );
        assert_eq!(
            tc(with(|c| c.kda_chunk = KdaChunkKernel::F32)),
            KdaChunkPath::F32
        );
        assert_eq!(
            tc(with(|c| c.kda_chunk = KdaChunkKernel::MmaPairPrep)),
            KdaChunkPath::TensorCore(KdaPrep::PairLoop)
        );
    }

    #[test]
    fn mla_prefill_kernels() {
        // Kimi Linear's heads, aligned, outside a recorded pass.
        let kimi = MlaPrefillFacts {
            flashinfer_heads: true,
            aligned: true,
            vec_widths: true,
            mma_fits: true,
            recording: false,
        };
        let split = KernelConfig::default();
        let half = with(|c| c.precision = GemmPrecision::Half);
        assert_eq!(plan_mla_prefill(&split, &kimi), MlaPrefillPath::TensorCore);
        assert_eq!(plan_mla_prefill(&half, &kimi), MlaPrefillPath::FlashInfer);
        let recording = MlaPrefillFacts {
            recording: true,
            ..kimi
        };
        assert_eq!(
            plan_mla_prefill(&half, &recording),
            MlaPrefillPath::TensorCore
        );
        let no_fi = with(|c| {
            c.precision = GemmPrecision::Half;
            c.mla_prefill = MlaPrefillKernel::NoFlashInfer;
        });
        assert_eq!(plan_mla_prefill(&no_fi, &kimi), MlaPrefillPath::TensorCore);
        let f32 = with(|c| c.mla_prefill = MlaPrefillKernel::F32);
        assert_eq!(plan_mla_prefill(&f32, &kimi), MlaPrefillPath::F32Vec);
        let unaligned = MlaPrefillFacts {
            aligned: false,
            ..kimi
        };
        assert_eq!(plan_mla_prefill(&half, &unaligned), MlaPrefillPath::F32);
        let odd = MlaPrefillFacts {
            flashinfer_heads: false,
            mma_fits: false,
            ..kimi
        };
        assert_eq!(plan_mla_prefill(&half, &odd), MlaPrefillPath::F32Vec);
    }
}
