//! The ops Kimi K3 adds to the backend interface (the MoE seam's routing and expert bank,
//! SiTU FFNs, the MLA output gate, Block AttnRes mixes) and its MXFP4 expert weights.
//! `impl Backend` in `backend.rs` delegates here.

use std::sync::Arc;

use kimi_core::config::Activation;
use kimi_core::DType;
use kimi_ops::{ExpertView, HostTensor, MlpWeights, MoeRoutes, MoeRouting, Result};

use super::moe::{uniform_layout, PairLists};
use super::packed_experts::{packed_bank, PackedCall};
use super::{code, f32_rows, shape_err, CudaBackend};
use crate::buffer::DevBuf;
use crate::layout::mxfp4_device_tiles;
use crate::ops;
use crate::plan::{plan_expert_bank, BankCall, BankPath, TableCall};
use crate::tensor::CudaTensor;

/// Device lists of one MoE layer's pairs grouped by expert (`moe_lists`), kept alive until
/// the kernels that read them are queued.
struct Lists {
    offsets: DevBuf,
    slots: DevBuf,
    rows: DevBuf,
    wsel: DevBuf,
    /// `[ids | counts]` (p + e u32), for the host-side fallback.
    meta: CudaTensor,
}

impl CudaBackend {
    /// An MXFP4 weight from ggml `block_mxfp4` bytes, stored in the tensor-core tiles of
    /// [`mxfp4_device_tiles`].
    pub(super) fn upload_mxfp4(&self, host: &HostTensor<'_>) -> Result<CudaTensor> {
        let n: usize = host.shape.iter().product();
        let cols = host.shape.last().copied().unwrap_or(0);
        let want = DType::MXFP4.storage_bytes(n);
        if host.shape.len() != 2 || !cols.is_multiple_of(32) || want != Some(host.bytes.len()) {
            return Err(shape_err(
                "upload",
                format!(
                    "MXFP4 matrix {:?} (rows of whole 32-value blocks) needs {want:?} bytes, got {}",
                    host.shape,
                    host.bytes.len()
                ),
            ));
        }
        let planes = mxfp4_device_tiles(host.bytes, host.shape[0], cols)
            .ok_or_else(|| shape_err("upload", "MXFP4 bytes are not whole blocks".into()))?;
        self.dev.enter("upload")?;
        Ok(CudaTensor {
            shape: host.shape.to_vec(),
            dtype: DType::MXFP4,
            buf: Arc::new(self.dev.upload_kept(&planes, "upload")?),
            offset: 0,
        })
    }

    /// An MXFP4 matrix widened to a new f32 tensor on the device.
    pub(super) fn widen_mxfp4(&self, w: &CudaTensor, op: &'static str) -> Result<CudaTensor> {
        let (rows, cols) = match w.shape.as_slice() {
            [r, c] => (*r, *c),
            _ => return Err(shape_err(op, format!("MXFP4 tensor {:?}", w.shape))),
        };
        let out = self.empty(&[rows, cols], DType::F32, op)?;
        if rows * cols > 0 {
            // SAFETY: w is an MXFP4 [rows, cols] matrix in the device layout (uploaded by
            // upload_mxfp4, cols % 32 == 0); out holds rows*cols f32.
            unsafe { ops::mxfp4::to_f32(&self.dev, w.ptr(), out.ptr(), rows, cols)? };
        }
        Ok(out)
    }

    pub(super) fn gate_sigmoid(&self, x: &CudaTensor, gate: &CudaTensor) -> Result<CudaTensor> {
        const OP: &str = "sigmoid_gate";
        self.dev.enter(OP)?;
        if f32_rows(x, OP)? != f32_rows(gate, OP)? {
            return Err(shape_err(
                OP,
                format!("{:?} gated by {:?}", x.shape, gate.shape),
            ));
        }
        let out = self.empty(&x.shape, DType::F32, OP)?;
        if !x.is_empty() {
            // SAFETY: x, gate and out hold len f32 each (shapes checked above).
            unsafe {
                ops::elementwise::sigmoid_gate(&self.dev, x.ptr(), gate.ptr(), out.ptr(), x.len())?
            };
        }
        Ok(out)
    }

    pub(super) fn mix_attn_res(
        &self,
        blocks: &[&CudaTensor],
        partial: &CudaTensor,
        w_eff: &CudaTensor,
        eps: f32,
    ) -> Result<CudaTensor> {
        const OP: &str = "attn_res_mix";
        self.dev.enter(OP)?;
        let (n, d) = f32_rows(partial, OP)?;
        if w_eff.shape != [d] || w_eff.dtype != DType::F32 {
            return Err(shape_err(
                OP,
                format!("weight {:?} {} for width {d}", w_eff.shape, w_eff.dtype),
            ));
        }
        for b in blocks {
            if f32_rows(b, OP)? != (n, d) {
                return Err(shape_err(
                    OP,
                    format!("block {:?} beside partial sum {:?}", b.shape, partial.shape),
                ));
            }
        }
        let sources: Vec<u64> = blocks
            .iter()
            .map(|b| b.ptr())
            .chain([partial.ptr()])
            .collect();
        let out = self.empty(&[n, d], DType::F32, OP)?;
        if n * d > 0 {
            // SAFETY: every source and out hold n*d f32, w_eff d f32 (checked above).
            unsafe { ops::attn_res::mix(&self.dev, &sources, w_eff.ptr(), out.ptr(), n, d, eps)? };
        }
        Ok(out)
    }

    /// A gated MLP with any activation: SwiGLU takes the tuned [`Backend::mlp`] path; SiTU
    /// runs the two projections, `situ_mul` and the down projection.
    pub(super) fn gated_ffn(
        &self,
        x: &CudaTensor,
        w: &MlpWeights<CudaTensor>,
        act: Activation,
    ) -> Result<CudaTensor> {
        const OP: &str = "ffn";
        let Activation::Situ { beta, linear_beta } = act else {
            return kimi_ops::Backend::mlp(self, x, w);
        };
        self.dev.enter(OP)?;
        let gate = self.matmul_op(x, &w.gate, OP)?;
        let up = self.matmul_op(x, &w.up, OP)?;
        if gate.shape != up.shape {
            return Err(shape_err(OP, "gate and up widths differ".into()));
        }
        if !gate.is_empty() {
            // SAFETY: gate and up hold len f32 each.
            unsafe {
                ops::elementwise::situ_mul(
                    &self.dev,
                    gate.ptr(),
                    up.ptr(),
                    gate.len(),
                    beta,
                    linear_beta.unwrap_or(0.0),
                )?
            };
        }
        self.matmul_op(&gate, &w.down, OP)
    }

    pub(super) fn route_moe(
        &self,
        x: &CudaTensor,
        router: &CudaTensor,
        correction_bias: Option<&CudaTensor>,
        r: &MoeRouting,
    ) -> Result<MoeRoutes<CudaTensor>> {
        const OP: &str = "moe_route";
        self.dev.enter(OP)?;
        let (n, d) = f32_rows(x, OP)?;
        let e = router.shape.first().copied().unwrap_or(0);
        if router.shape != [e, d] || r.top_k == 0 || r.top_k > e {
            return Err(shape_err(
                OP,
                format!("router {:?}, top_k {}, hidden {d}", router.shape, r.top_k),
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
        let (bias, bdt) = match correction_bias {
            Some(b) if b.len() == e => (b.ptr(), code(b, OP)?),
            Some(b) => return Err(shape_err(OP, format!("correction bias {:?}", b.shape))),
            None => (0, 0),
        };
        // The router runs in f32, as on the CPU, so that near-ties pick the same experts.
        let router32 = self.as_f32_copy(router, OP)?;
        let router = router32.as_ref().unwrap_or(router);
        let experts = self.empty(&[n, r.top_k], DType::F32, OP)?;
        let weights = self.empty(&[n, r.top_k], DType::F32, OP)?;
        if n > 0 {
            let logits = self.matmul_op(x, router, OP)?;
            // SAFETY: logits [n, e] f32; experts/weights hold n*top_k 4-byte entries; the
            // bias (when given) holds e values of dtype bdt.
            unsafe {
                ops::moe::route(
                    &self.dev,
                    logits.ptr(),
                    bias,
                    bdt,
                    experts.ptr(),
                    weights.ptr(),
                    n,
                    e,
                    r,
                )?
            };
        }
        Ok(MoeRoutes {
            experts,
            weights,
            top_k: r.top_k,
        })
    }

    /// The pairs of `routes` grouped by expert on the device.
    fn pair_lists(&self, routes: &MoeRoutes<CudaTensor>, p: usize, e: usize) -> Result<Lists> {
        const OP: &str = "moe_experts";
        let lists = Lists {
            offsets: self.raw((2 * e + 2) * 4, OP)?,
            slots: self.raw(p * 4, OP)?,
            rows: self.raw(p * 4, OP)?,
            wsel: self.raw(p * 4, OP)?,
            meta: self.empty(&[p + e], DType::F32, OP)?,
        };
        let counters = if p >= ops::moe::LISTS_MULTI_BLOCK_PAIRS {
            Some(self.zeroed(&[2 * e], OP)?)
        } else {
            None
        };
        // SAFETY: the routes hold p expert ids below e (moe_route chose them among the
        // router's e rows; the caller checked the bank has e experts) and p weights; the
        // list buffers are sized for p pairs over e experts as moe_lists writes them.
        unsafe {
            ops::moe::lists(
                &self.dev,
                routes.experts.ptr(),
                routes.weights.ptr(),
                p,
                e,
                routes.top_k,
                Self::slice_ptr(&lists.offsets),
                Self::slice_ptr(&lists.slots),
                Self::slice_ptr(&lists.rows),
                Self::slice_ptr(&lists.wsel),
                lists.meta.ptr(),
                counters.as_ref().map(|c| c.ptr()),
            )?
        };
        Ok(lists)
    }

    /// Routed experts of which some are absent (held by other ranks under expert
    /// parallelism, or a tiered bank's cold experts, computed on the host): their pairs are
    /// masked out on the device (`ops::moe::mask_absent`), so that no kernel computes them
    /// and they add nothing; the present ones run as the whole bank would. The shapes stay
    /// those of all the routes, so a captured graph replays it.
    pub(super) fn run_present_experts(
        &self,
        x: &CudaTensor,
        routes: &MoeRoutes<CudaTensor>,
        bank: &ExpertView<'_, CudaTensor>,
        act: Activation,
    ) -> Result<CudaTensor> {
        const OP: &str = "moe_experts (absent experts)";
        self.dev.enter(OP)?;
        let present: Vec<u8> = (0..bank.len()).map(|e| bank.is_present(e) as u8).collect();
        let shape = routes.experts.shape.clone();
        if routes.weights.shape != shape || shape.len() != 2 {
            return Err(shape_err(
                OP,
                format!("routes {:?} / {:?}", shape, routes.weights.shape),
            ));
        }
        let p = shape[0] * shape[1];
        let ids = self.empty(&shape, DType::F32, OP)?;
        let weights = self.empty(&shape, DType::F32, OP)?;
        if p > 0 {
            let mask = self.upload_bytes(&present, OP)?;
            // SAFETY: the routes hold p ids below the bank's length (route_moe chose them
            // among as many router rows) and p weights; ids/weights hold p 4-byte entries;
            // the mask holds a byte per expert.
            unsafe {
                ops::moe::mask_absent(
                    &self.dev,
                    routes.experts.ptr(),
                    routes.weights.ptr(),
                    mask.ptr(),
                    p,
                    ids.ptr(),
                    weights.ptr(),
                )?
            };
        }
        let masked = MoeRoutes {
            experts: ids,
            weights,
            top_k: routes.top_k,
        };
        self.run_routed_experts(x, &masked, bank, act)
    }

    pub(super) fn run_routed_experts(
        &self,
        x: &CudaTensor,
        routes: &MoeRoutes<CudaTensor>,
        bank: &ExpertView<'_, CudaTensor>,
        act: Activation,
    ) -> Result<CudaTensor> {
        const OP: &str = "moe_experts";
        self.dev.enter(OP)?;
        let (n, d) = f32_rows(x, OP)?;
        let (k, e) = (routes.top_k, bank.len());
        if k == 0 || routes.experts.shape != [n, k] || routes.weights.shape != [n, k] || e == 0 {
            return Err(shape_err(
                OP,
                format!(
                    "routes {:?} / {:?} of top_k {k} for {n} tokens over {e} experts",
                    routes.experts.shape, routes.weights.shape
                ),
            ));
        }
        let out_width = bank
            .expert(0)
            .and_then(|x| x.down.shape.first().copied())
            .unwrap_or(0);
        if n == 0 {
            return self.zeroed(&[0, out_width], OP);
        }
        let p = n * k;
        let lists = self.pair_lists(routes, p, e)?;
        let offsets = Self::slice_ptr(&lists.offsets);
        let slots = Self::slice_ptr(&lists.slots);
        let cfg = self.kernel_config();
        let swiglu = act == Activation::Silu;
        let table_call = swiglu.then(|| TableCall {
            tokens: n,
            top_k: k,
            hidden: d,
            layout: uniform_layout(bank.experts().iter().copied(), d),
            weights_aligned: bank.experts().iter().all(|w| {
                [&w.gate, &w.up, &w.down]
                    .iter()
                    .all(|t| t.ptr().is_multiple_of(16))
            }),
            input_aligned: x.ptr().is_multiple_of(16),
            recording: crate::graph::recording(self.dev.stream.cu_stream()),
        });
        let call = BankCall {
            tokens: n,
            top_k: k,
            experts: e,
            packed: packed_bank(bank.experts().iter().copied(), d),
            table: table_call,
        };
        let (packed, token_tiles) = match plan_expert_bank(&cfg, &call) {
            BankPath::OneByOne => {
                return self.experts_one_by_one(x, &lists, bank, act, n, p, out_width)
            }
            BankPath::Table(path) => {
                let table = self.bank_table(bank)?;
                let pair_lists = PairLists {
                    offsets,
                    slots,
                    experts: e,
                    top_k: k,
                };
                let aligned = table_call.is_some_and(|t| t.weights_aligned && t.input_aligned);
                // SAFETY: the planner chose `path` for the bank's uniform SwiGLU layout
                // (uniform_layout); the table holds every expert's (gate, up, down); the
                // lists come from pair_lists over the routes' p pairs, whose weights
                // routes.weights holds; `aligned` as checked above.
                let out = unsafe {
                    self.experts_on_table(
                        x,
                        table,
                        path,
                        &pair_lists,
                        Self::slice_ptr(&lists.rows),
                        &routes.weights,
                        None,
                        n,
                        d,
                        aligned,
                    )?
                };
                drop(lists);
                return Ok(out);
            }
            BankPath::PackedMma { bank, token_tiles } => (bank, token_tiles),
        };
        let table = self.bank_table(bank)?;
        let call = PackedCall {
            bank: packed,
            token_tiles,
            tokens: n,
            top_k: k,
            experts: e,
            offsets,
            slots,
            act,
        };
        // SAFETY: packed_bank gave this bank's layout for its view, whose (gate, up, down)
        // addresses the table holds; the lists come from pair_lists over the routes' p
        // pairs; x holds n rows of d f32 (f32_rows).
        let y = unsafe { self.packed_experts(x, table, &call)? };
        let out = self.weighted_combine(&y, 0, &routes.weights, None, n, d, k)?;
        drop(lists);
        Ok(out)
    }

    /// Any expert format or shape: one read of `[ids | counts]` to the host, then per expert
    /// that received pairs a gather, [`Self::gated_ffn`] and a weighted scatter-add.
    #[allow(clippy::too_many_arguments)]
    fn experts_one_by_one(
        &self,
        x: &CudaTensor,
        lists: &Lists,
        bank: &ExpertView<'_, CudaTensor>,
        act: Activation,
        n: usize,
        p: usize,
        out_width: usize,
    ) -> Result<CudaTensor> {
        const OP: &str = "moe_experts";
        let e = bank.len();
        let meta: Vec<u32> = kimi_ops::Backend::to_f32(self, &lists.meta)?
            .into_iter()
            .map(f32::to_bits)
            .collect();
        let (ids, counts) = meta.split_at(p);
        // Masked pairs (NO_EXPERT) are not placed in the lists; any other id past the bank
        // is an error.
        if let Some(bad) = ids
            .iter()
            .find(|&&i| i as usize >= e && i != ops::moe::NO_EXPERT)
        {
            return Err(shape_err(OP, format!("routes name expert {bad} of {e}")));
        }
        let out = self.zeroed(&[n, out_width], OP)?;
        let (rows, wsel) = (Self::slice_ptr(&lists.rows), Self::slice_ptr(&lists.wsel));
        let mut off = 0usize;
        for (expert, &cnt) in counts.iter().enumerate() {
            let cnt = cnt as usize;
            if cnt == 0 {
                continue;
            }
            let w = bank
                .expert(expert)
                .ok_or_else(|| shape_err(OP, format!("no expert {expert} in the bank")))?;
            // SAFETY: pair_lists placed `cnt` distinct tokens (< n) routed to `expert` at
            // sorted positions `off ..` of `rows` / `wsel`; out holds n*out_width f32.
            unsafe {
                self.expert_rows(x, rows, wsel, off, cnt, &out, out_width, |xg| {
                    self.gated_ffn(xg, w, act)
                })?
            };
            off += cnt;
        }
        // The index buffers must outlive the queued kernels that read them.
        self.dev.synchronize(OP)?;
        Ok(out)
    }

    /// The device table of a bank's (gate, up, down) addresses: cached by its contents for
    /// good for a stable view, among the recent ones for a per-call view (a tiered bank's
    /// slots and stand-ins change only with fills and cold experts).
    fn bank_table(&self, experts: &ExpertView<'_, CudaTensor>) -> Result<u64> {
        let key: Vec<u64> = experts
            .experts()
            .iter()
            .flat_map(|x| [x.gate.ptr(), x.up.ptr(), x.down.ptr()])
            .collect();
        if experts.is_stable() {
            self.address_table(key)
        } else {
            self.recent_address_table(key)
        }
    }
}
