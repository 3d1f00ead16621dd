//! `Backend::moe` on the device: the routing, then the expert path (streamed, fused GEMV,
//! a grouped tensor-core GEMM or cuBLAS per expert), then the weighted combine.

use kimi_core::DType;
use kimi_ops::{Backend, Error, MoeRouting, MoeWeights, Result};

use super::{code, f32_rows, shape_err, CudaBackend, GemmPrecision};
use crate::buffer::DevBuf;
use crate::ops;
use crate::tensor::{dtype_code, CudaTensor};

/// Device lists of a MoE layer's routed pairs grouped by expert (`moe_lists`).
struct PairLists {
    /// `u32 [E + 1]` start of each expert's pairs.
    offsets: u64,
    /// `u32 [P]` pair number (token * top_k + j) at each sorted position.
    slots: u64,
    experts: usize,
    top_k: usize,
}

/// Up to this many tokens, routed experts run as fused GEMV kernels over all (token, expert)
/// pairs; above it, as grouped tensor-core GEMMs. Measured on an H200 with the 48B shapes:
/// the GEMV is 14 % faster at 32 tokens, the pipelined GEMM 3 % faster at 64.
/// `KIMI_CUDA_FUSED_MOE_MAX_TOKENS` overrides it (for measurements).
fn fused_moe_max_tokens() -> usize {
    static MAX: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *MAX.get_or_init(|| {
        std::env::var("KIMI_CUDA_FUSED_MOE_MAX_TOKENS")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(56)
    })
}

impl CudaBackend {
    /// [`kimi_ops::Backend::moe`].
    pub(super) fn moe_layer(
        &self,
        x: &CudaTensor,
        w: &MoeWeights<CudaTensor>,
        r: &MoeRouting,
    ) -> Result<(CudaTensor, CudaTensor)> {
        const OP: &str = "moe";
        self.dev.enter(OP)?;
        let (n, d) = f32_rows(x, OP)?;
        let e = w.experts.len();
        if w.router.shape != [e, d] || r.top_k == 0 || r.top_k > e {
            return Err(shape_err(
                OP,
                format!(
                    "router {:?}, {e} experts, top_k {}, hidden {d}",
                    w.router.shape, r.top_k
                ),
            ));
        }
        if r.num_groups == 0
            || r.num_groups > 64
            || !e.is_multiple_of(r.num_groups)
            || r.topk_group > r.num_groups
        {
            return Err(shape_err(
                OP,
                format!("{e} experts in {} groups", r.num_groups),
            ));
        }
        // The router runs in f32, as on the CPU, so that near-ties pick the same experts.
        let router32 = self.as_f32_copy(&w.router, OP)?;
        let router = router32.as_ref().unwrap_or(&w.router);
        let (bias, bdt) = match &w.correction_bias {
            Some(b) if b.len() == e => (b.ptr(), code(b, OP)?),
            Some(b) => return Err(shape_err(OP, format!("correction bias {:?}", b.shape))),
            None => (0, 0),
        };
        let ids_dev = self.empty(&[n, r.top_k], DType::F32, OP)?;
        let wts_dev = self.empty(&[n, r.top_k], DType::F32, OP)?;
        if n == 0 {
            return Ok((self.zeroed(&[n, d], OP)?, ids_dev));
        }
        // Pairs grouped by expert, on the device.
        let (k, p) = (r.top_k, n * r.top_k);
        // Offsets, then the active-expert list (see `moe_lists`).
        let offsets = self.raw((2 * e + 2) * 4, OP)?;
        let slots = self.raw(p * 4, OP)?;
        let rows = self.raw(p * 4, OP)?;
        let wsel = self.raw(p * 4, OP)?;
        let meta = self.empty(&[p + e], DType::F32, OP)?;
        let (offsets_ptr, slots_ptr) = (Self::slice_ptr(&offsets), Self::slice_ptr(&slots));
        let (rows_ptr, wsel_ptr) = (Self::slice_ptr(&rows), Self::slice_ptr(&wsel));
        let lists = ops::moe::ListBufs {
            ids: ids_dev.ptr(),
            weights: wts_dev.ptr(),
            offsets: offsets_ptr,
            slots: slots_ptr,
            rows: rows_ptr,
            wsel: wsel_ptr,
            meta: meta.ptr(),
        };
        let one_launch = n == 1
            && ops::moe::route_one_on()
            && r.num_groups <= 1
            && e <= ops::moe::ROUTE_WARP_MAX_EXPERTS
            && r.top_k <= ops::moe::ROUTE_ONE_MAX_TOP_K.min(e)
            && (bias == 0 || (bias.is_multiple_of(4) && (bdt == 0 || e.is_multiple_of(2))))
            && router.dtype == DType::F32
            && d.is_multiple_of(4)
            && router.ptr().is_multiple_of(16)
            && x.ptr().is_multiple_of(16);
        if one_launch {
            let logits = self.empty(&[e], DType::F32, OP)?;
            // SAFETY: router [e, d] f32 and x [1, d] 16-byte aligned with d % 4 == 0; the
            // ticket is this backend's (zero between launches); buffers as allocated above.
            unsafe {
                ops::moe::route_one(
                    &self.dev,
                    router.ptr(),
                    x.ptr(),
                    d,
                    bias,
                    bdt,
                    e,
                    r,
                    logits.ptr(),
                    &lists,
                    Self::slice_ptr(&self.route_ticket),
                )?
            };
        } else {
            let logits = self.matmul_op(x, router, OP)?;
            let counters = if p >= ops::moe::LISTS_MULTI_BLOCK_PAIRS {
                Some(self.zeroed(&[2 * e], OP)?)
            } else {
                None
            };
            // SAFETY: logits [n,e] f32; ids/weights hold n*top_k 4-byte entries; ids < e
            // (route picks among e experts); buffer sizes as allocated above.
            unsafe {
                ops::moe::route(
                    &self.dev,
                    logits.ptr(),
                    bias,
                    bdt,
                    ids_dev.ptr(),
                    wts_dev.ptr(),
                    n,
                    e,
                    r,
                )?;
                ops::moe::lists(
                    &self.dev,
                    ids_dev.ptr(),
                    wts_dev.ptr(),
                    p,
                    e,
                    k,
                    offsets_ptr,
                    slots_ptr,
                    rows_ptr,
                    wsel_ptr,
                    meta.ptr(),
                    counters.as_ref().map(|c| c.ptr()),
                )?
            };
        }
        if let Some(done) = self.moe_streamed(x, w, &wts_dev, k, offsets_ptr, slots_ptr, n, d)? {
            return Ok((done, ids_dev));
        }
        // The shared expert first: the routed experts add into its output.
        let shared_out = match &w.shared {
            Some(shared) => {
                let y = self.mlp(x, shared)?;
                if y.shape != [n, d] {
                    return Err(shape_err(OP, format!("shared expert output {:?}", y.shape)));
                }
                Some(y)
            }
            None => None,
        };
        if let Some((inter, dt)) = self.fused_moe_shape(w, d, n) {
            let (table, aligned) = self.expert_table(w)?;
            // 16-byte loads need aligned weights and activations (fresh allocations are).
            let aligned = aligned && x.ptr().is_multiple_of(16);
            let h = self.empty(&[p, inter], DType::F32, OP)?;
            let y = self.empty(&[p, d], DType::F32, OP)?;
            // SAFETY: the table holds gate/up [inter, d] and down [d, inter] of dtype dt for
            // every expert (checked by fused_moe_shape); ids/offsets/slots come from lists;
            // h holds p*inter and y p*d f32.
            unsafe {
                ops::moe::expert_gemv(
                    &self.dev,
                    table,
                    true,
                    x.ptr(),
                    k,
                    offsets_ptr,
                    e,
                    slots_ptr,
                    h.ptr(),
                    p,
                    inter,
                    d,
                    dt,
                    aligned,
                )?;
                ops::moe::expert_gemv(
                    &self.dev,
                    table,
                    false,
                    h.ptr(),
                    k,
                    offsets_ptr,
                    e,
                    slots_ptr,
                    y.ptr(),
                    p,
                    d,
                    inter,
                    dt,
                    aligned,
                )?
            };
            return self.combine_routed(&y, 0, &wts_dev, ids_dev, shared_out, n, d, k);
        }
        if let Some(inter) = self.grouped_moe_shape(w, d) {
            let (table, aligned) = self.expert_table(w)?;
            let split = self.gemm_precision() == GemmPrecision::Split;
            let lists = PairLists {
                offsets: offsets_ptr,
                slots: slots_ptr,
                experts: e,
                top_k: k,
            };
            let recording = crate::graph::recording(self.dev.stream.cu_stream());
            if aligned
                && !recording
                && ops::moe::pipelined_grouped()
                && ops::moe::cutlass_grouped(p, split)
                && x.ptr().is_multiple_of(16)
                && d.is_multiple_of(8)
            {
                let (y, inv) =
                    self.grouped_moe_cutlass(x, table, split, &lists, rows_ptr, n, d, inter)?;
                let inv_ptr = Self::slice_ptr(&inv);
                let done = self.combine_routed(&y, inv_ptr, &wts_dev, ids_dev, shared_out, n, d, k);
                drop((offsets, slots, rows, wsel, inv));
                return done;
            }
            if aligned && ops::moe::pipelined_grouped() {
                let y = self.grouped_moe_pipelined(x, table, split, &lists, n, d, inter)?;
                drop((offsets, slots, rows, wsel));
                return self.combine_routed(&y, 0, &wts_dev, ids_dev, shared_out, n, d, k);
            }
            if aligned && x.ptr().is_multiple_of(16) {
                let h = self.empty(&[p, inter], DType::F32, OP)?;
                let y = self.empty(&[p, d], DType::F32, OP)?;
                // SAFETY: grouped_moe_shape checked bf16 gate/up [inter, d] and down
                // [d, inter] for every expert, d % 64 == 0 and inter % 64 == 0; the table's
                // weights and x are 16-byte aligned; offsets/slots come from lists; h holds
                // p*inter and y p*d f32.
                unsafe {
                    ops::moe::grouped_mma(
                        &self.dev,
                        table,
                        true,
                        split,
                        x.ptr(),
                        k,
                        offsets_ptr,
                        slots_ptr,
                        e,
                        h.ptr(),
                        p,
                        inter,
                        d,
                    )?;
                    ops::moe::grouped_mma(
                        &self.dev,
                        table,
                        false,
                        split,
                        h.ptr(),
                        k,
                        offsets_ptr,
                        slots_ptr,
                        e,
                        y.ptr(),
                        p,
                        d,
                        inter,
                    )?;
                }
                drop((offsets, slots, rows, wsel));
                return self.combine_routed(&y, 0, &wts_dev, ids_dev, shared_out, n, d, k);
            }
        }
        // Other shapes or dtypes: cuBLAS per expert, with one host read of [ids | counts].
        let meta_host: Vec<u32> = self.to_f32(&meta)?.into_iter().map(f32::to_bits).collect();
        let (ids, counts) = meta_host.split_at(p);
        if let Some(bad) = ids.iter().find(|&&i| i as usize >= e) {
            return Err(shape_err(OP, format!("router chose expert {bad} of {e}")));
        }
        let out = match shared_out {
            Some(o) => o,
            None => self.zeroed(&[n, d], OP)?,
        };
        let mut off = 0usize;
        for (expert, &cnt) in counts.iter().enumerate() {
            let cnt = cnt as usize;
            if cnt == 0 {
                continue;
            }
            let xg = self.empty(&[cnt, d], DType::F32, OP)?;
            // SAFETY: the row indices are token numbers < n; xg holds cnt*d f32.
            unsafe {
                ops::elementwise::gather_rows(
                    &self.dev,
                    x.ptr(),
                    rows_ptr + (off * 4) as u64,
                    xg.ptr(),
                    cnt,
                    d,
                )?
            };
            let y = self.mlp(&xg, &w.experts[expert])?;
            if y.shape != [cnt, d] {
                return Err(shape_err(
                    OP,
                    format!("expert {expert} output {:?}", y.shape),
                ));
            }
            // SAFETY: one expert's rows are distinct tokens; y holds cnt*d f32.
            unsafe {
                ops::elementwise::scatter_add_rows(
                    &self.dev,
                    y.ptr(),
                    rows_ptr + (off * 4) as u64,
                    wsel_ptr + (off * 4) as u64,
                    out.ptr(),
                    cnt,
                    d,
                )?
            };
            off += cnt;
        }
        // Keep the index buffers alive until the queued kernels have read them.
        self.dev.synchronize(OP)?;
        drop((offsets, slots, rows, wsel));
        Ok((out, ids_dev))
    }

    /// `(intermediate, weight dtype code)` when the routed experts can take the fused
    /// device path: at most [`fused_moe_max_tokens`] tokens and every expert's gate/up
    /// `[inter, d]` and down `[d, inter]` of one dtype.
    fn fused_moe_shape(
        &self,
        w: &MoeWeights<CudaTensor>,
        d: usize,
        n: usize,
    ) -> Option<(usize, i32)> {
        if n > fused_moe_max_tokens() {
            return None;
        }
        let first = w.experts.first()?;
        let inter = *first.gate.shape.first()?;
        let dtype = first.gate.dtype;
        let dt = dtype_code(dtype)?;
        let ok = w.experts.iter().all(|x| {
            x.gate.shape == [inter, d]
                && x.up.shape == [inter, d]
                && x.down.shape == [d, inter]
                && x.gate.dtype == dtype
                && x.up.dtype == dtype
                && x.down.dtype == dtype
        });
        (ok && inter > 0).then_some((inter, dt))
    }

    /// The last step of the device MoE paths: adds the routing-weighted pair rows `y [p, d]`
    /// (in pair order, or in sorted order when `inv` is non-zero, see `ops::moe::combine`)
    /// to the shared expert's output (or to zero). The chosen experts stay on the device
    /// (`ids`), for `expert_ids` to read once the pass is queued: no host wait per layer.
    #[allow(clippy::too_many_arguments)]
    fn combine_routed(
        &self,
        y: &CudaTensor,
        inv: u64,
        wts: &CudaTensor,
        ids: CudaTensor,
        shared_out: Option<CudaTensor>,
        n: usize,
        d: usize,
        k: usize,
    ) -> Result<(CudaTensor, CudaTensor)> {
        Ok((
            self.weighted_combine(y, inv, wts, shared_out, n, d, k)?,
            ids,
        ))
    }

    /// The routing-weighted pair rows `y` (see [`Self::combine_routed`]) added to
    /// `shared_out` in place, or written to a new `[n, d]`.
    #[allow(clippy::too_many_arguments)]
    fn weighted_combine(
        &self,
        y: &CudaTensor,
        inv: u64,
        wts: &CudaTensor,
        shared_out: Option<CudaTensor>,
        n: usize,
        d: usize,
        k: usize,
    ) -> Result<CudaTensor> {
        const OP: &str = "moe";
        let accumulate = shared_out.is_some();
        let out = match shared_out {
            Some(o) => o,
            None => self.empty(&[n, d], DType::F32, OP)?,
        };
        // SAFETY: y holds n*k*d f32 (at least), wts (and inv unless 0) n*k entries, out n*d.
        unsafe {
            ops::moe::combine(
                &self.dev,
                y.ptr(),
                inv,
                wts.ptr(),
                out.ptr(),
                n,
                d,
                k,
                accumulate,
            )?
        };
        Ok(out)
    }

    /// A one-token MoE layer's experts as two `moe_stream_1` passes (gate/up, then down),
    /// the shared expert folded in as one more slot when its shapes match the routed ones',
    /// then the weighted combine. `None` where the stream does not apply (more tokens,
    /// other dtypes or shapes, unaligned weights): the caller takes another path.
    #[allow(clippy::too_many_arguments)]
    fn moe_streamed(
        &self,
        x: &CudaTensor,
        w: &MoeWeights<CudaTensor>,
        wts: &CudaTensor,
        k: usize,
        offsets: u64,
        slots: u64,
        n: usize,
        d: usize,
    ) -> Result<Option<CudaTensor>> {
        const OP: &str = "moe";
        if n != 1 || !ops::moe::stream_on() {
            return Ok(None);
        }
        let Some(inter) = self.grouped_moe_shape(w, d) else {
            return Ok(None);
        };
        let e = w.experts.len();
        let fold_shared = w.shared.as_ref().is_some_and(|m| {
            m.gate.shape == [inter, d]
                && m.up.shape == [inter, d]
                && m.down.shape == [d, inter]
                && [&m.gate, &m.up, &m.down]
                    .iter()
                    .all(|t| t.dtype == DType::BF16)
        });
        let slots_max = k.min(e) + fold_shared as usize;
        if slots_max > ops::moe::STREAM_MAX_SLOTS {
            return Ok(None);
        }
        let staged = |glu, cols| ops::moe::stream_staged_bytes(glu, k, fold_shared, cols);
        let (Some(plan_gu), Some(plan_down)) = (
            ops::gemm::stream_plan(&self.dev, d, inter * slots_max, 2, staged(true, d)),
            ops::gemm::stream_plan(&self.dev, inter, d * slots_max, 1, staged(false, inter)),
        ) else {
            return Ok(None);
        };
        let (table, aligned) = self.expert_table(w)?;
        if !aligned || !x.ptr().is_multiple_of(16) {
            return Ok(None);
        }
        // A shared expert of other shapes runs as an MLP; the routed experts add into it.
        let shared_mlp = match (&w.shared, fold_shared) {
            (Some(shared), false) => Some(self.mlp(x, shared)?),
            _ => None,
        };
        let p = n * k;
        let rows = p + if fold_shared { n } else { 0 };
        let h = self.empty(&[rows, inter], DType::F32, OP)?;
        let y = self.empty(&[rows, d], DType::F32, OP)?;
        let layer = ops::moe::layer_on()
            .then(|| ops::moe::layer_plan(&self.dev, d, inter, rows))
            .flatten();
        if let Some(plan) = layer {
            // SAFETY: as for the two passes below; the plan is layer_plan's for `rows` slots
            // and layer_sync is this backend's (zero between launches).
            unsafe {
                ops::moe::layer_stream(
                    &self.dev,
                    table,
                    x.ptr(),
                    k,
                    offsets,
                    e,
                    slots,
                    h.ptr(),
                    y.ptr(),
                    fold_shared,
                    d,
                    inter,
                    plan,
                    Self::slice_ptr(&self.layer_sync),
                )?
            };
        } else {
            // SAFETY: grouped_moe_shape checked bf16 gate/up [inter, d] and down [d, inter] for
            // every expert (fold_shared: the shared one too, at table entry e); the table and x
            // are 16-byte aligned (fresh allocations such as h are); offsets/slots come from
            // lists for p pairs; h and y hold `rows` rows; the plans are stream_plan's.
            unsafe {
                ops::moe::expert_stream(
                    &self.dev,
                    table,
                    true,
                    x.ptr(),
                    k,
                    offsets,
                    e,
                    slots,
                    h.ptr(),
                    fold_shared,
                    inter,
                    d,
                    plan_gu,
                )?;
                ops::moe::expert_stream(
                    &self.dev,
                    table,
                    false,
                    h.ptr(),
                    k,
                    offsets,
                    e,
                    slots,
                    y.ptr(),
                    fold_shared,
                    d,
                    inter,
                    plan_down,
                )?;
            }
        }
        // The shared rows (after the p pair rows) take the routed sum in place.
        let shared_out = if fold_shared {
            Some(CudaTensor {
                shape: vec![n, d],
                dtype: DType::F32,
                buf: y.buf.clone(),
                offset: y.offset + p * d * 4,
            })
        } else {
            shared_mlp
        };
        // y's first p rows are the pair rows.
        Ok(Some(
            self.weighted_combine(&y, 0, wts, shared_out, n, d, k)?,
        ))
    }

    /// The intermediate size when the routed experts fit the grouped tensor-core kernel:
    /// bf16 gate/up `[inter, d]` and down `[d, inter]` with both sizes multiples of 64.
    fn grouped_moe_shape(&self, w: &MoeWeights<CudaTensor>, d: usize) -> Option<usize> {
        let inter = *w.experts.first()?.gate.shape.first()?;
        let ok = inter > 0
            && inter.is_multiple_of(64)
            && d.is_multiple_of(64)
            && w.experts.iter().all(|x| {
                x.gate.shape == [inter, d]
                    && x.up.shape == [inter, d]
                    && x.down.shape == [d, inter]
                    && [&x.gate, &x.up, &x.down]
                        .iter()
                        .all(|t| t.dtype == DType::BF16)
            });
        ok.then_some(inter)
    }

    /// Routed experts of many tokens on the pipelined tensor-core kernels: the hidden
    /// states become bf16 rows once (hi and lo terms when `split`), gate/up writes the
    /// SwiGLU rows in sorted pair order as bf16, down reads them contiguously. Returns the
    /// f32 expert outputs `[p, d]` in pair order.
    #[allow(clippy::too_many_arguments)]
    fn grouped_moe_pipelined(
        &self,
        x: &CudaTensor,
        table: u64,
        split: bool,
        lists: &PairLists,
        n: usize,
        d: usize,
        inter: usize,
    ) -> Result<CudaTensor> {
        const OP: &str = "moe";
        let p = n * lists.top_k;
        let terms = if split { 2 } else { 1 };
        let xs = self.empty(&[terms * n, d], DType::BF16, OP)?;
        let kernel = if split {
            "split_f32_bf16"
        } else {
            "cast_f32_bf16"
        };
        // SAFETY: x holds n*d f32 and xs terms*n*d bf16.
        unsafe { ops::elementwise::binary(&self.dev, OP, kernel, x.ptr(), xs.ptr(), n * d)? };
        let h = self.empty(&[terms * p, inter], DType::BF16, OP)?;
        let y = self.empty(&[p, d], DType::F32, OP)?;
        let bm = ops::moe::mma_tile_rows(p, lists.experts);
        // SAFETY: the caller checked (grouped_moe_shape) bf16 gate/up [inter, d] and down
        // [d, inter] for every expert, 16-byte aligned, d % 64 == 0 and inter % 64 == 0;
        // xs holds n token rows (+ n lo rows at n*d), h p pair rows (+ p lo rows at
        // p*inter), y p rows of d f32; offsets/slots come from `lists` for p pairs.
        unsafe {
            ops::moe::grouped_mma_pipelined(
                &self.dev,
                table,
                true,
                split,
                xs.ptr(),
                n * d,
                lists.top_k,
                lists.offsets,
                lists.slots,
                lists.experts,
                h.ptr(),
                p * inter,
                p,
                inter,
                d,
                bm,
            )?;
            ops::moe::grouped_mma_pipelined(
                &self.dev,
                table,
                false,
                split,
                h.ptr(),
                p * inter,
                lists.top_k,
                lists.offsets,
                lists.slots,
                lists.experts,
                y.ptr(),
                0,
                p,
                d,
                inter,
                bm,
            )?;
        }
        Ok(y)
    }

    /// Routed experts of many tokens through the CUTLASS grouped GEMM
    /// (`cutlass/moe_grouped.cu`): the pairs' token rows gathered in sorted order as bf16
    /// (hi and lo terms when `split`, each term one GEMM, the second accumulating), gate and
    /// up in one launch into `[p, 2 * inter]` (f32 under `split`, else bf16), SiLU-and-
    /// multiply to bf16 rows, then down. Returns the f32 expert outputs `[p, d]` in sorted
    /// pair order and the inverse order (`inv[pair] = sorted position`).
    #[allow(clippy::too_many_arguments)]
    fn grouped_moe_cutlass(
        &self,
        x: &CudaTensor,
        table: u64,
        split: bool,
        lists: &PairLists,
        rows: u64,
        n: usize,
        d: usize,
        inter: usize,
    ) -> Result<(CudaTensor, DevBuf)> {
        const OP: &str = "moe";
        let (p, e) = (n * lists.top_k, lists.experts);
        let terms = if split { 2 } else { 1 };
        let a = self.empty(&[terms * p, d], DType::BF16, OP)?;
        let inv = self.raw(p * 4, OP)?;
        // SAFETY: x holds n rows of d f32 (16-byte aligned, d % 8 == 0: the caller checked);
        // rows/slots hold p entries from moe_lists; a and inv are sized as the kernel needs.
        unsafe {
            ops::moe::gather_bf16(
                &self.dev,
                x.ptr(),
                rows,
                lists.slots,
                a.ptr(),
                Self::slice_ptr(&inv),
                p,
                d,
                split,
            )?
        };
        let (scratch_bytes, ws_bytes) = ops::moe::cutlass_bytes(e);
        if ws_bytes == 0 {
            return Err(shape_err(OP, "CUTLASS cannot query the device".into()));
        }
        let scratch = self.raw(scratch_bytes, OP)?;
        let workspace = self.raw(ws_bytes, OP)?;
        let bufs = ops::moe::CutlassBuffers {
            scratch: Self::slice_ptr(&scratch),
            workspace: Self::slice_ptr(&workspace),
        };
        // Split: f32 sums of the hi and lo products; Half: bf16 gate/up rows, as bf16
        // engines write them.
        let gu_dtype = if split { DType::F32 } else { DType::BF16 };
        let gu = self.empty(&[p, 2 * inter], gu_dtype, OP)?;
        let h = self.empty(&[terms * p, inter], DType::BF16, OP)?;
        let y = self.empty(&[p, d], DType::F32, OP)?;
        // What the launches below rely on: grouped_moe_shape checked bf16 gate/up [inter, d]
        // and down [d, inter] for every expert (16-byte aligned: expert_table), d and inter
        // multiples of 64; a holds terms*p rows of d, gu p rows of 2*inter, h terms*p rows
        // of inter, y p rows of d; scratch and workspace have the sizes cutlass_bytes gave;
        // the caller checked that no pass is being recorded, and `moe` entered the device's
        // context.
        //
        // One projection per term of the bf16 input rows `[terms * p, k]`, the lo term
        // accumulating onto the hi term's output (beta = 1).
        let project = |glu: bool, d_f32: bool, input: u64, out: u64, n_out: usize, k: usize| {
            (0..terms).try_for_each(|t| {
                let input_t = input + (t * p * k * 2) as u64;
                // SAFETY: see above; input_t is term t's p rows of k bf16.
                unsafe {
                    ops::moe::cutlass_gemm(
                        &self.dev,
                        glu,
                        d_f32,
                        e,
                        lists.offsets,
                        table,
                        input_t,
                        out,
                        n_out,
                        k,
                        t as f32,
                        &bufs,
                    )
                }
            })
        };
        project(true, split, a.ptr(), gu.ptr(), inter, d)?;
        // SAFETY: gu holds p rows of 2*inter (f32 when split), h terms*p rows of inter bf16.
        unsafe { ops::moe::silu_mul_bf16(&self.dev, gu.ptr(), split, h.ptr(), p, inter, split)? };
        project(false, true, h.ptr(), y.ptr(), d, inter)?;
        drop((scratch, workspace));
        Ok((y, inv))
    }

    /// The device table of every expert's (gate, up, down) addresses, then the shared
    /// expert's when there is one (entry `experts.len()`, read by `moe_stream`), uploaded
    /// once per distinct set of weights and kept (its contents are its key, so it cannot go
    /// stale).
    fn expert_table(&self, w: &MoeWeights<CudaTensor>) -> Result<(u64, bool)> {
        let key: Vec<u64> = w
            .experts
            .iter()
            .chain(w.shared.as_ref())
            .flat_map(|x| [x.gate.ptr(), x.up.ptr(), x.down.ptr()])
            .collect();
        let mut tables = self
            .moe_tables
            .lock()
            .map_err(|_| Error::Unsupported("moe table lock poisoned".into()))?;
        let aligned = key.iter().all(|p| p.is_multiple_of(16));
        if let Some(t) = tables.get(&key) {
            return Ok((Self::slice_ptr(t), aligned));
        }
        let bytes: Vec<u8> = key.iter().flat_map(|v| v.to_le_bytes()).collect();
        // Kept across passes: never from a pass arena.
        let t = self.dev.upload_kept(&bytes, "moe")?;
        let ptr = Self::slice_ptr(&t);
        tables.insert(key, t);
        Ok((ptr, aligned))
    }
}
