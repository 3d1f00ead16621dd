//! `Backend::moe` on the device: the routing, then the expert path that `plan::plan_moe`
//! picks (streamed, fused GEMV, a grouped tensor-core GEMM, packed experts on the tensor
//! cores or cuBLAS per expert), then the weighted combine.

use std::collections::HashMap;

use kimi_core::config::Activation;
use kimi_core::DType;
use kimi_ops::{Backend, Error, MlpWeights, MoeRouting, MoeWeights, Result};

use super::packed_experts::{packed_bank, PackedCall};
use super::{code, f32_rows, shape_err, CudaBackend};
use crate::buffer::DevBuf;
use crate::ops;
use crate::plan::{
    self, ExpertLayout, GroupedPath, LayerPlan, MoeCall, MoePath, PackedBank, RoutePath,
    RouterFacts, SharedExpert, StreamPasses,
};
use crate::tensor::{dtype_code, CudaTensor};

const OP: &str = "moe";

/// Device lists of a MoE layer's routed pairs grouped by expert (`moe_lists`).
pub(super) struct PairLists {
    /// `u32 [E + 1]` start of each expert's pairs.
    pub(super) offsets: u64,
    /// `u32 [P]` pair number (token * top_k + j) at each sorted position.
    pub(super) slots: u64,
    pub(super) experts: usize,
    pub(super) top_k: usize,
}

/// The routed experts' common layout: every expert's gate/up `[inter, d]` and down
/// `[d, inter]` of one dtype the kernels read; `None` otherwise.
fn expert_layout(w: &MoeWeights<CudaTensor>, d: usize) -> Option<ExpertLayout> {
    uniform_layout(w.experts.iter(), d)
}

/// [`expert_layout`] of any list of experts (an expert bank's view).
pub(super) fn uniform_layout<'a>(
    mut experts: impl Iterator<Item = &'a MlpWeights<CudaTensor>> + Clone,
    d: usize,
) -> Option<ExpertLayout> {
    let first = experts.clone().next()?;
    let inter = *first.gate.shape.first()?;
    let dtype = first.gate.dtype;
    dtype_code(dtype)?;
    let uniform = experts.all(|x| {
        x.gate.shape == [inter, d]
            && x.up.shape == [inter, d]
            && x.down.shape == [d, inter]
            && x.gate.dtype == dtype
            && x.up.dtype == dtype
            && x.down.dtype == dtype
    });
    uniform.then_some(ExpertLayout { inter, dtype })
}

/// Whether the shared expert can stream as one more slot: bf16 of the routed shapes.
fn shared_expert(
    w: &MoeWeights<CudaTensor>,
    layout: Option<ExpertLayout>,
    packed: Option<PackedBank>,
    d: usize,
) -> SharedExpert {
    let Some(m) = &w.shared else {
        return SharedExpert::Absent;
    };
    let bf16 = layout.is_some_and(|l| {
        m.gate.shape == [l.inter, d]
            && m.up.shape == [l.inter, d]
            && m.down.shape == [d, l.inter]
            && [&m.gate, &m.up, &m.down]
                .iter()
                .all(|t| t.dtype == DType::BF16)
    });
    // Packed like the routed experts: the same kernel format and shapes.
    let packed_alike = packed.is_some() && packed_bank(std::iter::once(m), d) == packed;
    let foldable = bf16 || packed_alike;
    if foldable {
        SharedExpert::Foldable
    } else {
        SharedExpert::Separate
    }
}

/// Every routed and shared expert weight, in [`CudaBackend::expert_table`]'s order.
fn expert_weights(w: &MoeWeights<CudaTensor>) -> impl Iterator<Item = u64> + '_ {
    w.experts
        .iter()
        .chain(w.shared.as_ref())
        .flat_map(|x| [x.gate.ptr(), x.up.ptr(), x.down.ptr()])
}

/// How many changing bank tables stay on the device: one per MoE layer of the deepest
/// model (K3's 92) several times over, so that a steady cache reuses its layers' tables.
const RECENT_TABLES: usize = 512;

/// Address tables of expert banks whose views change from step to step (a tiered bank's
/// slots and stand-ins), by their contents: a view that repeats (no fill since) finds its
/// table on the device instead of uploading it again. The least recently used goes past
/// [`RECENT_TABLES`], freed in stream order after the kernels queued to read it.
pub(super) struct RecentTables<T = DevBuf> {
    tables: HashMap<Vec<u64>, (T, u64)>,
    clock: u64,
}

impl<T> Default for RecentTables<T> {
    fn default() -> Self {
        Self {
            tables: HashMap::new(),
            clock: 0,
        }
    }
}

impl<T> RecentTables<T> {
    /// `key`'s table, made by `upload` (from the key's little-endian bytes) when it is not
    /// kept.
    fn get_or_upload(
        &mut self,
        key: Vec<u64>,
        upload: impl FnOnce(&[u8]) -> Result<T>,
    ) -> Result<&T> {
        self.clock += 1;
        let clock = self.clock;
        if !self.tables.contains_key(&key) {
            if self.tables.len() >= RECENT_TABLES {
                let oldest = self
                    .tables
                    .iter()
                    .min_by_key(|(_, (_, used))| *used)
                    .map(|(k, _)| k.clone());
                if let Some(k) = oldest {
                    self.tables.remove(&k);
                }
            }
            let bytes: Vec<u8> = key.iter().flat_map(|v| v.to_le_bytes()).collect();
            let t = upload(&bytes)?;
            self.tables.insert(key.clone(), (t, clock));
        }
        let (t, used) = self
            .tables
            .get_mut(&key)
            .ok_or_else(|| Error::Device("bank table vanished".into()))?;
        *used = clock;
        Ok(t)
    }
}

impl CudaBackend {
    /// [`kimi_ops::Backend::moe`].
    pub(super) fn moe_layer(
        &self,
        x: &CudaTensor,
        w: &MoeWeights<CudaTensor>,
        r: &MoeRouting,
    ) -> Result<(CudaTensor, CudaTensor)> {
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
        let cfg = self.kernel_config();
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
        let list_bufs = ops::moe::ListBufs {
            ids: ids_dev.ptr(),
            weights: wts_dev.ptr(),
            offsets: offsets_ptr,
            slots: slots_ptr,
            rows: rows_ptr,
            wsel: wsel_ptr,
            meta: meta.ptr(),
        };
        let layout = expert_layout(w, d);
        let packed = match layout {
            None => packed_bank(w.experts.iter(), d),
            Some(_) => None,
        };
        let call = MoeCall {
            tokens: n,
            experts: e,
            top_k: k,
            hidden: d,
            layout,
            packed,
            shared: shared_expert(w, layout, packed, d),
            router: RouterFacts {
                ungrouped: r.num_groups <= 1,
                f32_aligned: router.dtype == DType::F32 && router.ptr().is_multiple_of(16),
                bias_fits: bias == 0
                    || (bias.is_multiple_of(4) && (bdt == 0 || e.is_multiple_of(2))),
            },
            weights_aligned: expert_weights(w).all(|p| p.is_multiple_of(16)),
            input_aligned: x.ptr().is_multiple_of(16),
            recording: crate::graph::recording(self.dev.stream.cu_stream()),
            sm_count: self.dev.sm_count,
        };
        let plan = plan::plan_moe(&cfg, &call);
        match plan.route {
            RoutePath::OneLaunch => {
                let logits = self.empty(&[e], DType::F32, OP)?;
                // SAFETY: the planner took one launch only for one token, ungrouped routing
                // over at most ROUTE_WARP_MAX_EXPERTS experts and top_k <= min(32, e), an f32
                // router [e, d] and x [1, d] 16-byte aligned with d % 4 == 0 and a bias it
                // can copy as words; the ticket is this backend's (zero between launches);
                // buffers as allocated above.
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
                        &list_bufs,
                        Self::slice_ptr(&self.route_ticket),
                    )?
                };
            }
            RoutePath::Separate => {
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
        }
        let lists = PairLists {
            offsets: offsets_ptr,
            slots: slots_ptr,
            experts: e,
            top_k: k,
        };
        let aligned = call.weights_aligned && call.input_aligned;
        let out = match plan.experts {
            MoePath::Streamed {
                inter,
                fold_shared,
                passes,
            } => self.moe_streamed(x, w, &wts_dev, &lists, n, d, inter, fold_shared, passes)?,
            path @ (MoePath::FusedGemv { .. } | MoePath::Grouped { .. }) => {
                let shared_out = self.shared_expert_out(x, w, n, d)?;
                let table = self.expert_table(w)?;
                // SAFETY: the table holds every routed expert's (gate, up, down) in the
                // layout the planner was given; the lists and wts come from this step's
                // routing of n tokens; `aligned` as checked for the planner.
                unsafe {
                    self.experts_on_table(
                        x, table, path, &lists, rows_ptr, &wts_dev, shared_out, n, d, aligned,
                    )?
                }
            }
            MoePath::PackedMma { bank, token_tiles } => {
                let shared_out = self.shared_expert_out(x, w, n, d)?;
                let table = self.expert_table(w)?;
                let packed = PackedCall {
                    bank,
                    token_tiles,
                    tokens: n,
                    top_k: k,
                    experts: e,
                    offsets: offsets_ptr,
                    slots: slots_ptr,
                    act: Activation::Silu,
                };
                // SAFETY: packed_bank gave the bank's layout for these experts, whose (gate,
                // up, down) addresses lead the table; the lists come from this step's
                // routing of n tokens; x holds n rows of d f32.
                let y = unsafe { self.packed_experts(x, table, &packed)? };
                self.weighted_combine(&y, 0, &wts_dev, shared_out, n, d, k)?
            }
            MoePath::PerExpert => {
                let shared_out = self.shared_expert_out(x, w, n, d)?;
                self.moe_per_expert(x, w, &meta, shared_out, rows_ptr, wsel_ptr, n, d, p)?
            }
        };
        // The index buffers are freed in stream order, after the kernels that read them.
        drop((offsets, slots, rows, wsel));
        Ok((out, ids_dev))
    }

    /// The routed experts of `path` (the fused GEMV or a grouped GEMM) over `table`'s
    /// (gate, up, down) addresses, weighted by `wts` and added into `shared_out` when given.
    ///
    /// # Safety
    /// `table` holds `3 * lists.experts` addresses of SwiGLU experts in the layout the
    /// planner chose `path` for (gate/up `[inter, d]`, down `[d, inter]`); `lists` and
    /// `rows` come from `moe_lists` over the `n * top_k` pairs whose weights `wts` holds;
    /// `aligned`: the weights and `x` are 16-byte aligned where the path asked for it.
    #[allow(clippy::too_many_arguments)]
    pub(super) unsafe fn experts_on_table(
        &self,
        x: &CudaTensor,
        table: u64,
        path: MoePath,
        lists: &PairLists,
        rows: u64,
        wts: &CudaTensor,
        shared_out: Option<CudaTensor>,
        n: usize,
        d: usize,
        aligned: bool,
    ) -> Result<CudaTensor> {
        let cfg = self.kernel_config();
        let (k, e) = (lists.top_k, lists.experts);
        let p = n * k;
        match path {
            MoePath::FusedGemv { inter, dtype } => {
                let dt = dtype_code(dtype)
                    .ok_or_else(|| Error::Unsupported(format!("{OP} with {dtype} experts")))?;
                let h = self.empty(&[p, inter], DType::F32, OP)?;
                let y = self.empty(&[p, d], DType::F32, OP)?;
                // SAFETY: the caller's contract; h holds p*inter and y p*d f32 (fresh
                // allocations, aligned).
                unsafe {
                    ops::moe::expert_gemv(
                        &self.dev,
                        table,
                        true,
                        x.ptr(),
                        k,
                        lists.offsets,
                        e,
                        lists.slots,
                        h.ptr(),
                        p,
                        inter,
                        d,
                        dt,
                        aligned,
                        cfg.moe_row_blocks,
                    )?;
                    ops::moe::expert_gemv(
                        &self.dev,
                        table,
                        false,
                        h.ptr(),
                        k,
                        lists.offsets,
                        e,
                        lists.slots,
                        y.ptr(),
                        p,
                        d,
                        inter,
                        dt,
                        aligned,
                        cfg.moe_row_blocks,
                    )?
                };
                self.weighted_combine(&y, 0, wts, shared_out, n, d, k)
            }
            MoePath::Grouped { inter, kernel } => {
                let split = cfg.split();
                match kernel {
                    GroupedPath::Cutlass => {
                        let (y, inv) =
                            self.grouped_moe_cutlass(x, table, split, lists, rows, n, d, inter)?;
                        let out = self.weighted_combine(
                            &y,
                            Self::slice_ptr(&inv),
                            wts,
                            shared_out,
                            n,
                            d,
                            k,
                        );
                        drop(inv);
                        out
                    }
                    GroupedPath::Pipelined => {
                        let y = self.grouped_moe_pipelined(x, table, split, lists, n, d, inter)?;
                        self.weighted_combine(&y, 0, wts, shared_out, n, d, k)
                    }
                    GroupedPath::SingleStage => {
                        let y =
                            self.grouped_moe_single_stage(x, table, split, lists, n, d, inter)?;
                        self.weighted_combine(&y, 0, wts, shared_out, n, d, k)
                    }
                }
            }
            other => Err(Error::Unsupported(format!(
                "{OP}: {other:?} does not read an expert table"
            ))),
        }
    }

    /// The shared expert's output `[n, d]`, which the routed experts then add into.
    fn shared_expert_out(
        &self,
        x: &CudaTensor,
        w: &MoeWeights<CudaTensor>,
        n: usize,
        d: usize,
    ) -> Result<Option<CudaTensor>> {
        let Some(shared) = &w.shared else {
            return Ok(None);
        };
        let y = self.mlp(x, shared)?;
        if y.shape != [n, d] {
            return Err(shape_err(OP, format!("shared expert output {:?}", y.shape)));
        }
        Ok(Some(y))
    }

    /// Other shapes or dtypes: cuBLAS per expert, with one host read of [ids | counts]
    /// (`meta`), the routing-weighted rows added to `shared_out` (or to zero).
    #[allow(clippy::too_many_arguments)]
    fn moe_per_expert(
        &self,
        x: &CudaTensor,
        w: &MoeWeights<CudaTensor>,
        meta: &CudaTensor,
        shared_out: Option<CudaTensor>,
        rows_ptr: u64,
        wsel_ptr: u64,
        n: usize,
        d: usize,
        p: usize,
    ) -> Result<CudaTensor> {
        let e = w.experts.len();
        let meta_host: Vec<u32> = self.to_f32(meta)?.into_iter().map(f32::to_bits).collect();
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
            // SAFETY: `lists` placed `cnt` distinct tokens (< n) routed to `expert` at
            // sorted positions `off ..` of `rows_ptr` / `wsel_ptr`; out holds n*d f32.
            unsafe {
                self.expert_rows(x, rows_ptr, wsel_ptr, off, cnt, &out, d, |xg| {
                    self.mlp(xg, &w.experts[expert])
                })?
            };
            off += cnt;
        }
        // Keep the index buffers alive until the queued kernels have read them.
        self.dev.synchronize(OP)?;
        Ok(out)
    }

    /// The routing-weighted pair rows `y [p, d]` (in pair order, or in sorted order when
    /// `inv` is non-zero, see `ops::moe::combine`) added to `shared_out` in place, or written
    /// to a new `[n, d]`. The chosen experts stay on the device for `expert_ids` to read once
    /// the pass is queued: no host wait per layer.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn weighted_combine(
        &self,
        y: &CudaTensor,
        inv: u64,
        wts: &CudaTensor,
        shared_out: Option<CudaTensor>,
        n: usize,
        d: usize,
        k: usize,
    ) -> Result<CudaTensor> {
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

    /// A one-token MoE layer's experts streamed by `passes` (`moe_stream_layer`, or two
    /// `moe_stream_1` passes: gate/up, then down), the shared expert folded in as one more
    /// slot when `fold_shared` (else run as an MLP that the routed experts add into), then
    /// the weighted combine.
    #[allow(clippy::too_many_arguments)]
    fn moe_streamed(
        &self,
        x: &CudaTensor,
        w: &MoeWeights<CudaTensor>,
        wts: &CudaTensor,
        lists: &PairLists,
        n: usize,
        d: usize,
        inter: usize,
        fold_shared: bool,
        passes: StreamPasses,
    ) -> Result<CudaTensor> {
        let (k, e) = (lists.top_k, lists.experts);
        let (offsets, slots) = (lists.offsets, lists.slots);
        let table = self.expert_table(w)?;
        // A shared expert of other shapes runs as an MLP; the routed experts add into it.
        let shared_mlp = match (&w.shared, fold_shared) {
            (Some(shared), false) => Some(self.mlp(x, shared)?),
            _ => None,
        };
        let p = n * k;
        let rows = p + if fold_shared { n } else { 0 };
        let h = self.empty(&[rows, inter], DType::F32, OP)?;
        let y = self.empty(&[rows, d], DType::F32, OP)?;
        // What the launches rely on: the planner streamed only one token whose experts are
        // bf16 gate/up [inter, d] and down [d, inter] (Int4Layer: 4-bit ones of those shapes,
        // whole matrices of one packed bank, `packed_bank`) (fold_shared: the shared one too,
        // at table entry e, of the same kind), the table's weights and x 16-byte aligned
        // (fresh allocations such as h are), with at most STREAM_MAX_SLOTS slots and the
        // plans stream_plan / layer_plan / packed_layer_plan made for these sizes;
        // offsets/slots come from lists for p pairs; h and y hold `rows` rows.
        let layer = |plan: LayerPlan, int4: Option<bool>| -> Result<()> {
            // SAFETY: see above; layer_sync is this backend's (zero between launches).
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
                    int4,
                    Self::slice_ptr(&self.layer_sync),
                )
            }
        };
        match passes {
            StreamPasses::Layer(plan) => layer(plan, None)?,
            StreamPasses::Int4Layer { plan, offset } => layer(plan, Some(offset))?,
            StreamPasses::Two { gate_up, down } => {
                // SAFETY: see above.
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
                        gate_up,
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
                        down,
                    )?;
                }
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
        self.weighted_combine(&y, 0, wts, shared_out, n, d, k)
    }

    /// Routed experts of many tokens on the single-stage tensor-core kernel
    /// (`moe_grouped_mma`), f32 rows throughout. Returns the f32 expert outputs `[p, d]` in
    /// pair order.
    #[allow(clippy::too_many_arguments)]
    fn grouped_moe_single_stage(
        &self,
        x: &CudaTensor,
        table: u64,
        split: bool,
        lists: &PairLists,
        n: usize,
        d: usize,
        inter: usize,
    ) -> Result<CudaTensor> {
        let (k, e) = (lists.top_k, lists.experts);
        let p = n * k;
        let h = self.empty(&[p, inter], DType::F32, OP)?;
        let y = self.empty(&[p, d], DType::F32, OP)?;
        // SAFETY: the planner took the grouped kernels only for bf16 gate/up [inter, d] and
        // down [d, inter] for every expert, d % 64 == 0 and inter % 64 == 0, and this one
        // only with the table's weights and x 16-byte aligned; offsets/slots come from
        // lists; h holds p*inter and y p*d f32.
        unsafe {
            ops::moe::grouped_mma(
                &self.dev,
                table,
                true,
                split,
                x.ptr(),
                k,
                lists.offsets,
                lists.slots,
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
                lists.offsets,
                lists.slots,
                e,
                y.ptr(),
                p,
                d,
                inter,
            )?;
        }
        Ok(y)
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
        // SAFETY: the planner took the grouped kernels only for bf16 gate/up [inter, d] and
        // down [d, inter] for every expert, d % 64 == 0 and inter % 64 == 0, and this one
        // only with the table's weights 16-byte aligned; xs holds n token rows (+ n lo rows
        // at n*d), h p pair rows (+ p lo rows at p*inter), y p rows of d f32; offsets/slots
        // come from `lists` for p pairs.
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
        let (p, e) = (n * lists.top_k, lists.experts);
        let terms = if split { 2 } else { 1 };
        let a = self.empty(&[terms * p, d], DType::BF16, OP)?;
        let inv = self.raw(p * 4, OP)?;
        // SAFETY: x holds n rows of d f32 (16-byte aligned, d % 8 == 0: the planner checked);
        // offsets (over e experts), rows and slots (p entries) come from moe_lists; a and inv
        // are sized as the kernel needs.
        unsafe {
            ops::moe::gather_bf16(
                &self.dev,
                x.ptr(),
                rows,
                lists.slots,
                lists.offsets,
                e,
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
        // What the launches below rely on: the planner took CUTLASS only for bf16 gate/up
        // [inter, d] and down [d, inter] for every expert (16-byte aligned), d and inter
        // multiples of 64, and no pass being recorded; a holds terms*p rows of d, gu p rows
        // of 2*inter, h terms*p rows of inter, y p rows of d; scratch and workspace have the
        // sizes cutlass_bytes gave, and `moe` entered the device's context.
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
    /// One expert's share of a per-expert MoE pass: its `cnt` routed rows of `x [n, d]`
    /// (token numbers at sorted positions `off ..` of `rows`) gathered, run through `ffn`,
    /// and added to `out [n, out_width]` times their routing weights (`wsel`, same positions).
    ///
    /// # Safety
    /// `rows` and `wsel` hold at least `off + cnt` u32 / f32 entries, the rows are distinct
    /// token numbers below `n`, and `out` holds `n * out_width` f32.
    #[allow(clippy::too_many_arguments)]
    pub(super) unsafe fn expert_rows(
        &self,
        x: &CudaTensor,
        rows: u64,
        wsel: u64,
        off: usize,
        cnt: usize,
        out: &CudaTensor,
        out_width: usize,
        ffn: impl FnOnce(&CudaTensor) -> Result<CudaTensor>,
    ) -> Result<()> {
        let d = x.shape.last().copied().unwrap_or(0);
        let at = (off * 4) as u64;
        let xg = self.empty(&[cnt, d], DType::F32, OP)?;
        // SAFETY: the caller's contract; xg holds cnt*d f32.
        unsafe { ops::elementwise::gather_rows(&self.dev, x.ptr(), rows + at, xg.ptr(), cnt, d)? };
        let y = ffn(&xg)?;
        if y.shape != [cnt, out_width] {
            return Err(shape_err(OP, format!("expert output {:?}", y.shape)));
        }
        // SAFETY: the caller's contract; y holds cnt*out_width f32.
        unsafe {
            ops::elementwise::scatter_add_rows(
                &self.dev,
                y.ptr(),
                rows + at,
                wsel + at,
                out.ptr(),
                cnt,
                out_width,
            )
        }
    }

    fn expert_table(&self, w: &MoeWeights<CudaTensor>) -> Result<u64> {
        self.address_table(expert_weights(w).collect())
    }

    /// A device table of the addresses `key` for a bank whose view changes: kept while
    /// recently used ([`RecentTables`]).
    pub(super) fn recent_address_table(&self, key: Vec<u64>) -> Result<u64> {
        let mut tables = self
            .bank_tables
            .lock()
            .map_err(|_| Error::Unsupported("bank table lock poisoned".into()))?;
        // Kept across passes: never from a pass arena.
        let t = tables.get_or_upload(key, |bytes| self.dev.upload_kept(bytes, OP))?;
        Ok(Self::slice_ptr(t))
    }

    /// A device array of the addresses `key`, uploaded once per distinct contents and kept
    /// (its contents are its key, so it cannot go stale).
    pub(super) fn address_table(&self, key: Vec<u64>) -> Result<u64> {
        let mut tables = self
            .moe_tables
            .lock()
            .map_err(|_| Error::Unsupported("moe table lock poisoned".into()))?;
        if let Some(t) = tables.get(&key) {
            return Ok(Self::slice_ptr(t));
        }
        let bytes: Vec<u8> = key.iter().flat_map(|v| v.to_le_bytes()).collect();
        // Kept across passes: never from a pass arena.
        let t = self.dev.upload_kept(&bytes, OP)?;
        let ptr = Self::slice_ptr(&t);
        tables.insert(key, t);
        Ok(ptr)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A repeated view reuses its table; past the bound the least recently used goes.
    #[test]
    fn recent_tables_keep_the_recently_used() {
        let mut tables = RecentTables::<Vec<u8>>::default();
        let mut uploads = 0;
        let mut get = |t: &mut RecentTables<Vec<u8>>, key: u64| {
            t.get_or_upload(vec![key, key + 1], |b| {
                uploads += 1;
                Ok(b.to_vec())
            })
            .map(|b| b.len())
        };
        assert_eq!(get(&mut tables, 0).ok(), Some(16));
        assert_eq!(get(&mut tables, 0).ok(), Some(16));
        for k in 1..RECENT_TABLES as u64 {
            assert!(get(&mut tables, 10 * k).is_ok());
        }
        // Key 0 was used before the rest: touch it, then one more evicts key 10 instead.
        assert!(get(&mut tables, 0).is_ok());
        assert!(get(&mut tables, 999_999).is_ok());
        assert_eq!(tables.tables.len(), RECENT_TABLES);
        assert!(tables.tables.contains_key(&vec![0, 1]));
        assert!(!tables.tables.contains_key(&vec![10, 11]));
        assert_eq!(uploads, RECENT_TABLES + 1);
    }
}
