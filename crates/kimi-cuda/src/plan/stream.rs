//! How the streamed one-token kernels (`kernels/stream.cuh`: `gemv_stream_1`,
//! `moe_stream_1`, `moe_stream_layer`; `kernels/int4_stream.cu`: `moe_int4_stream_layer`,
//! `quant_gemv_int4_stream_1`) are cut: tile rows, shared-memory stages, CTAs.

/// Kernels with more than 48 KiB of dynamic shared memory opt in to this much.
pub(crate) const MAX_DYNAMIC_SMEM_BYTES: u32 = 200 * 1024;

/// Dynamic shared memory of `moe_stream_layer` (above the 200 KiB of the other kernels: with
/// its ~6 KiB of static tables it stays under the 227 KiB a CTA may have).
pub(crate) const LAYER_SMEM_BYTES: u32 = 216 * 1024;

/// `STREAM_MAX_ROWS`, `STREAM_CONSUMERS` and `STREAM_MAX_STAGES` in `kernels/stream.cuh`.
const STREAM_MAX_ROWS: usize = 16;
pub(crate) const STREAM_CONSUMERS: usize = 8;
const STREAM_MAX_STAGES: usize = 8;

/// Slots (routed experts of one token, plus the shared one) a `moe_stream_1` launch handles
/// at most (`MOE_STREAM_MAX_SLOTS` in `kernels/moe.cu`).
pub(crate) const STREAM_MAX_SLOTS: usize = 64;

/// The bytes of one streamed tile at most, and of a CTA's stages and staged activations
/// (one CTA per SM).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StreamShape {
    /// Bytes of one tile of weight rows at most.
    pub tile_bytes: usize,
    /// Dynamic shared memory per CTA (capped at the kernels' 200 KiB opt-in).
    pub cta_bytes: usize,
}

impl Default for StreamShape {
    /// 40 KiB tiles, 200 KiB per CTA: 20 KiB tiles made the one-token MoE layer slower on an
    /// H200 (75.5 against 52.4 us in one launch).
    fn default() -> Self {
        Self {
            tile_bytes: 40 * 1024,
            cta_bytes: 200 * 1024,
        }
    }
}

/// How a streamed one-token product is cut: output rows per tile, shared-memory stages,
/// CTAs and dynamic shared memory per CTA (stages, then the staged activations).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct StreamPlan {
    pub(crate) rows: usize,
    pub(crate) stages: usize,
    pub(crate) grid: usize,
    pub(crate) smem: u32,
}

/// The cut of a streamed product over `o` output rows of `k` bf16 (`per_row` weight rows
/// per output row: 2 for gate + up) on `sm_count` SMs, with `staged` bytes of activations in
/// shared memory; `None` where it does not apply. A tile takes the most rows that fit the
/// tile bytes, up to 8 weight rows per consumer warp... while still leaving every CTA two
/// tiles; tiles of fewer than 8 weight rows split rows into column slices, which must
/// divide k into 256-column multiples.
pub(crate) fn stream_plan(
    shape: StreamShape,
    sm_count: usize,
    k: usize,
    o: usize,
    per_row: usize,
    staged: usize,
) -> Option<StreamPlan> {
    if k == 0 || o == 0 || !k.is_multiple_of(256) {
        return None;
    }
    let row_bytes = k * 2 * per_row;
    let ctas = sm_count;
    let fits = |r: usize| {
        let wrows = r * per_row;
        let slices = (STREAM_CONSUMERS / wrows).max(1);
        wrows <= STREAM_MAX_ROWS
            && r * row_bytes <= shape.tile_bytes
            && k.is_multiple_of(256 * slices)
    };
    let rows = [16usize, 8, 4, 2, 1]
        .into_iter()
        .filter(|&r| fits(r))
        .find(|&r| o.div_ceil(r) >= 2 * ctas)
        .or_else(|| [1usize, 2, 4, 8, 16].into_iter().find(|&r| fits(r)))?;
    let tile = rows * row_bytes;
    let budget = shape.cta_bytes.min(MAX_DYNAMIC_SMEM_BYTES as usize);
    let stages = (budget.checked_sub(staged)? / tile).min(STREAM_MAX_STAGES);
    if stages < 2 {
        return None;
    }
    Some(StreamPlan {
        rows,
        stages,
        grid: o.div_ceil(rows).min(ctas),
        smem: (stages * tile + staged) as u32,
    })
}

/// Bytes of input rows `moe_stream_1` stages in shared memory (the token's hidden row for
/// `glu`, every pair's SwiGLU row otherwise), or 0 when they are read from global memory.
pub(crate) fn stream_staged_bytes(glu: bool, top_k: usize, shared: bool, cols: usize) -> usize {
    let rows = if glu { 1 } else { top_k + shared as usize };
    let bytes = rows * cols * 4;
    if bytes <= 48 * 1024 {
        bytes
    } else {
        0
    }
}

/// The cut of a one-token MoE layer in one launch (`moe_stream_layer` in `kernels/moe.cu`):
/// each projection's tile rows as [`stream_plan`] picks them, every stage the larger tile,
/// and the shared memory left after the staged rows filled with stages.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct LayerPlan {
    pub(crate) rows_gu: usize,
    pub(crate) rows_dn: usize,
    pub(crate) stages: usize,
    pub(crate) stage_bytes: usize,
    pub(crate) grid: usize,
    pub(crate) smem: u32,
}

/// [`LayerPlan`] for `slots` experts of `[inter, d]` gate/up and `[d, inter]` down on
/// `sm_count` SMs, or `None` where it does not apply (then the two `moe_stream_1` passes
/// run).
pub(crate) fn layer_plan(
    shape: StreamShape,
    sm_count: usize,
    d: usize,
    inter: usize,
    slots: usize,
) -> Option<LayerPlan> {
    let staged = d.max(slots * inter) * 4;
    let gu = stream_plan(shape, sm_count, d, inter * slots, 2, d * 4)?;
    let dn = stream_plan(shape, sm_count, inter, d * slots, 1, slots * inter * 4)?;
    let stage_bytes = (gu.rows * d * 4).max(dn.rows * inter * 2);
    let stages = ((LAYER_SMEM_BYTES as usize).checked_sub(staged)? / stage_bytes).min(8);
    (stages >= 2).then_some(LayerPlan {
        rows_gu: gu.rows,
        rows_dn: dn.rows,
        stages,
        stage_bytes,
        // The grid-wide handoff needs every CTA resident: one per SM.
        grid: sm_count,
        smem: (stages * stage_bytes + staged) as u32,
    })
}

/// Code words (8 values) per lane of a row at most in `moe_int4_stream_layer`
/// (`I4S_MAX_WORDS` in `kernels/int4_stream.cu`), and weight rows of a tile at most
/// (`I4S_MAX_ROWS`).
const INT4_LAYER_MAX_WORDS: usize = 12;
const INT4_LAYER_MAX_ROWS: usize = 32;

/// [`LayerPlan`] of `moe_int4_stream_layer` (`kernels/int4_stream.cu`) for `slots` experts
/// of 4-bit gate/up `[inter, d]` and down `[d, inter]` in the planes of `quant_layout` (24
/// bytes per 32 values), or `None` where it does not apply: both widths whole words per lane
/// (multiples of 256, at most 3072). A gate/up tile takes 8 gate and 8 up rows (two per
/// consumer warp), a down tile 32 rows (four per warp, the activations loaded once per
/// tile), fewer where a tile would pass 40 KiB.
pub(crate) fn packed_layer_plan(
    sm_count: usize,
    d: usize,
    inter: usize,
    slots: usize,
) -> Option<LayerPlan> {
    let words_ok = |w: usize| w > 0 && w.is_multiple_of(256) && w / 256 <= INT4_LAYER_MAX_WORDS;
    if !words_ok(d) || !words_ok(inter) || slots == 0 {
        return None;
    }
    let (gu_row, dn_row) = (d / 32 * 24, inter / 32 * 24);
    const TILE: usize = 40 * 1024;
    let rows_gu = [8usize, 4, 2, 1]
        .into_iter()
        .find(|&r| 2 * r * gu_row <= TILE && 2 * r <= INT4_LAYER_MAX_ROWS)?;
    let rows_dn = [32usize, 16, 8, 4, 2, 1]
        .into_iter()
        .find(|&r| r * dn_row <= TILE && r <= INT4_LAYER_MAX_ROWS)?;
    let stage_bytes = (2 * rows_gu * gu_row)
        .max(rows_dn * dn_row)
        .next_multiple_of(128);
    let staged = d.max(slots * inter) * 4;
    let stages = ((LAYER_SMEM_BYTES as usize).checked_sub(staged)? / stage_bytes).min(8);
    (stages >= 2).then_some(LayerPlan {
        rows_gu,
        rows_dn,
        stages,
        stage_bytes,
        // The grid-wide handoff needs every CTA resident: one per SM.
        grid: sm_count,
        smem: (stages * stage_bytes + staged) as u32,
    })
}

/// Tile rows × column slices of `quant_gemv_int4_stream_1` at most (`I4S_GEMV_UNITS` in
/// `kernels/int4_stream.cu`).
const INT4_GEMV_UNITS: usize = 64;

/// How `quant_gemv_int4_stream_1` (`kernels/int4_stream.cu`) cuts a one-token product over
/// a 4-bit `[o, k]` matrix: weight rows per tile, column slices per row, stages, CTAs and
/// dynamic shared memory (the stages only: the activations sit in registers).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct PackedGemvPlan {
    pub(crate) rows: usize,
    pub(crate) slices: usize,
    pub(crate) stages: usize,
    pub(crate) stage_bytes: usize,
    pub(crate) grid: usize,
    pub(crate) smem: u32,
}

/// [`PackedGemvPlan`] for `o` rows of `k` 4-bit values (24 bytes per 32) on `sm_count` SMs,
/// or `None` where it does not apply (`k` not whole words per lane: a multiple of 256).
/// Rows wider than a lane's registers take (k / 256 words per lane past 12) split into the
/// fewest column slices that bring them under. Tiles stay under 32 KiB, and the rows per
/// tile are those whose busiest CTA streams the least, counting each tile as its bytes plus
/// about 2 KiB for its round trip: large tiles on tall matrices, small ones where a few
/// large tiles would leave SMs idle (o_proj's 2,304 rows of 4,096: tiles of 4 rows).
pub(crate) fn packed_gemv_plan(sm_count: usize, k: usize, o: usize) -> Option<PackedGemvPlan> {
    if k == 0 || o == 0 || sm_count == 0 || !k.is_multiple_of(256) {
        return None;
    }
    let words = k / 256;
    let slices = [1usize, 2, 4, 8]
        .into_iter()
        .find(|&s| words.is_multiple_of(s) && words / s <= INT4_LAYER_MAX_WORDS)?;
    let row_bytes = k / 32 * 24;
    const TILE: usize = 32 * 1024;
    const TILE_COST: usize = 2 * 1024;
    let busiest = |r: usize| {
        let tiles = o.div_ceil(r);
        tiles.div_ceil(tiles.min(sm_count)) * (r * row_bytes + TILE_COST)
    };
    let rows = [32usize, 16, 8, 4, 2, 1]
        .into_iter()
        .filter(|&r| r * slices <= INT4_GEMV_UNITS && r * row_bytes <= TILE)
        .min_by_key(|&r| busiest(r))?;
    let stage_bytes = (rows * row_bytes).next_multiple_of(128);
    let tiles = o.div_ceil(rows);
    let grid = tiles.min(sm_count);
    let stages = (MAX_DYNAMIC_SMEM_BYTES as usize / stage_bytes)
        .min(STREAM_MAX_STAGES)
        .min(tiles.div_ceil(grid));
    (stages >= 1).then_some(PackedGemvPlan {
        rows,
        slices,
        stages,
        stage_bytes,
        grid,
        smem: (stages * stage_bytes) as u32,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An H200's SMs.
    const SMS: usize = 132;

    #[test]
    fn stream_plans_of_the_48b_decode_shapes() {
        let shape = StreamShape::default();
        // The router-sized and the one-token gate/up cuts of the 48B model.
        let plan = stream_plan(shape, SMS, 2304, 9 * 1024, 2, 2304 * 4).expect("fits");
        assert!(plan.stages >= 2 && plan.grid <= SMS);
        assert!(plan.smem as usize <= MAX_DYNAMIC_SMEM_BYTES as usize);
        // Rows that no 256-column slice divides do not stream.
        assert_eq!(stream_plan(shape, SMS, 2300, 1024, 1, 0), None);
        // A tile cap below one row leaves nothing.
        let tiny = StreamShape {
            tile_bytes: 1024,
            ..shape
        };
        assert_eq!(stream_plan(tiny, SMS, 2304, 1024, 1, 0), None);
    }

    #[test]
    fn the_48b_int4_layer_fits_one_launch() {
        let plan = packed_layer_plan(SMS, 2304, 1024, 9).expect("fits");
        assert_eq!((plan.rows_gu, plan.rows_dn, plan.grid), (8, 32, SMS));
        // 16 rows of 2304 4-bit values (1,728 bytes each) per stage, 9 SwiGLU rows staged.
        assert_eq!(plan.stage_bytes, 16 * 1728);
        assert_eq!(plan.stages, 6);
        assert!(plan.smem <= LAYER_SMEM_BYTES);
        // Widths that are not whole words per lane, or past 3072, do not stream.
        assert_eq!(packed_layer_plan(SMS, 2304, 96, 9), None);
        assert_eq!(packed_layer_plan(SMS, 3328, 1024, 9), None);
        assert!(packed_layer_plan(SMS, 3072, 256, 5).is_some());
    }

    #[test]
    fn the_48b_layer_fits_one_launch() {
        let plan = layer_plan(StreamShape::default(), SMS, 2304, 1024, 9).expect("fits");
        assert_eq!(plan.grid, SMS);
        assert!(plan.stages >= 2 && plan.smem <= LAYER_SMEM_BYTES);
    }

    #[test]
    fn packed_gemv_plans_of_the_48b_decode_shapes() {
        // o_proj (2,304 rows of 4,096): two slices of 8 words per lane, small tiles so that
        // every SM streams about as much.
        let o_proj = packed_gemv_plan(SMS, 4096, 2304).expect("fits");
        assert_eq!((o_proj.rows, o_proj.slices, o_proj.grid), (4, 2, SMS));
        // The fused q/k/v projection and the head: 16 rows of 2,304 (27 KiB) per tile.
        for o in [12576usize, 163840] {
            let p = packed_gemv_plan(SMS, 2304, o).expect("fits");
            assert_eq!((p.rows, p.slices, p.stage_bytes), (16, 1, 16 * 1728));
            assert!(p.stages >= 2 && p.smem <= MAX_DYNAMIC_SMEM_BYTES);
        }
        // Every plan covers its rows, stays within the kernel's limits and fits the SMs.
        for (k, o) in [
            (256usize, 37usize),
            (512, 1),
            (2304, 129),
            (7168, 4096),
            (18432, 7168),
        ] {
            let p = packed_gemv_plan(SMS, k, o).expect("fits");
            assert!(p.rows * p.slices <= INT4_GEMV_UNITS, "{k} {o}: {p:?}");
            assert!(
                k / 256 / p.slices <= INT4_LAYER_MAX_WORDS && (k / 256).is_multiple_of(p.slices)
            );
            assert!(p.stage_bytes >= p.rows * k / 32 * 24 && p.stage_bytes.is_multiple_of(128));
            assert!(p.grid <= SMS && p.grid * p.rows * p.stages.max(1) >= p.grid);
            assert!(p.smem <= MAX_DYNAMIC_SMEM_BYTES && p.stages >= 1);
        }
        // Widths that are not whole words per lane do not stream.
        assert_eq!(packed_gemv_plan(SMS, 128, 4096), None);
        assert_eq!(packed_gemv_plan(SMS, 1056, 33), None);
    }
}
