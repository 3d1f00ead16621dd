//! The CPU backend of kimi-infer.
//!
//! Activations and recurrent states are f32; weights keep their checkpoint dtype (bf16, f16,
//! f32 or a ggml block-quantized type from a GGUF file) and are widened to f32 inside the
//! matmul, block by block. Parallel sections (output features for matmuls, heads for
//! attention) run on a spinning fork-join team (`team`): the calling thread and
//! `num_threads() - 1` workers, which do not go to sleep between the few hundred short
//! sections of a decode step. Every op, and a whole forward pass ([`Backend::run_pass`]),
//! runs with subnormal floats flushed to zero on the calling thread, as on the workers:
//! decay products in KDA underflow through the subnormal range, where x86 arithmetic is
//! about 20x slower, and values that small do not change any result at f32 precision.
//!
//! `unsafe` appears only for SIMD intrinsics selected at run time ([`simd`] and the
//! quantized kernels), in `team`, which hands a borrowed closure to its workers, and in
//! `arena`, which maps the huge pages that weights live in.
#![deny(missing_docs)]
#![deny(unsafe_op_in_unsafe_fn)]

mod arena;
mod attention;
mod attn_res;
mod fp8_cache;
mod kda;
mod kda_step;
mod matmul;
mod mla;
mod moe;
mod mxfp4;
mod norm;
mod paged;
mod qdot;
mod quant;
pub mod simd;
mod team;
mod tensor;
mod to_ggml;
mod weight_file;
mod zquant;

pub use arena::WeightBuf;
pub use matmul::{QuantMatmul, INT8_MAX_TOKENS};
pub use tensor::{CpuTensor, Storage};
pub use weight_file::{free_bytes, WeightFile};

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::OnceLock;

use kimi_core::config::KdaGate;
use kimi_ops::{
    Activation, AttentionDims, Backend, Error, ExpertView, HostTensor, KdaMode, KdaStepInputs,
    KdaStepWeights, KvCacheDtype, MlaDims, MlaMode, MlpWeights, MoeRoutes, MoeRouting, MoeWeights,
    PagedSeq, Result, RopeStyle, Segment,
};

/// The CPU backend. Cheap to construct; holds no state besides how it multiplies
/// block-quantized weights and how it stores MLA latent caches (its threads are shared by
/// the process).
#[derive(Clone, Debug, Default)]
pub struct CpuBackend {
    quant_matmul: QuantMatmul,
    kv_cache: KvCacheDtype,
    /// Where uploaded weights go instead of memory (the disk tier of offloaded experts).
    weight_file: Option<std::sync::Arc<WeightFile>>,
}

impl CpuBackend {
    /// A backend on the CPU backend's threads, with the fast integer kernels for
    /// block-quantized weights ([`QuantMatmul::Int8`]).
    pub fn new() -> Self {
        Self::default()
    }

    /// A backend that multiplies block-quantized weights as `mode` says.
    pub fn with_quant_matmul(mode: QuantMatmul) -> Self {
        Self {
            quant_matmul: mode,
            kv_cache: KvCacheDtype::Auto,
            weight_file: None,
        }
    }

    /// This backend with MLA latent caches stored as `dtype` says.
    pub fn with_kv_cache_dtype(mut self, dtype: KvCacheDtype) -> Self {
        self.kv_cache = dtype;
        self
    }

    /// This backend with every weight it uploads from now on kept in `file`'s directory on
    /// disk (memory-mapped) instead of in memory.
    pub fn keeping_weights_in(mut self, file: std::sync::Arc<WeightFile>) -> Self {
        self.weight_file = Some(file);
        self
    }

    /// Where this backend keeps the weights it uploads, if not in memory.
    pub fn weight_file(&self) -> Option<&WeightFile> {
        self.weight_file.as_deref()
    }

    /// How this backend multiplies block-quantized weights.
    pub fn quant_matmul(&self) -> QuantMatmul {
        self.quant_matmul
    }
}

impl Backend for CpuBackend {
    type Tensor = CpuTensor;

    fn expect_work(&self, within: std::time::Duration) {
        team().expect_work(within);
    }

    fn name(&self) -> String {
        format!("cpu ({} threads)", num_threads())
    }
    fn rank_backend(&self, _rank: usize) -> Result<Self> {
        // Ranks in threads share the CPU and its worker team.
        Ok(self.clone())
    }
    fn new_process_group(&self, world: usize) -> Result<kimi_ops::ProcessGroupId> {
        // Rank processes of one node meet in shared memory (NCCL's place on GPUs).
        let group = kimi_ops::ShmGroup::create(world)?;
        Ok(kimi_ops::ProcessGroupId {
            bytes: group.name().as_bytes().to_vec(),
            keep: Some(Box::new(group)),
        })
    }
    fn join_process_group(
        &self,
        id: &[u8],
        rank: usize,
        world: usize,
        timeout: std::time::Duration,
    ) -> Result<std::sync::Arc<dyn kimi_ops::Collective<Self>>> {
        let name = std::str::from_utf8(id).map_err(|_| {
            kimi_ops::Error::Device(
                "rank 0 sent a shared-memory group name that is not text".into(),
            )
        })?;
        Ok(std::sync::Arc::new(kimi_ops::ShmComm::join(
            name, rank, world, timeout,
        )?))
    }
    fn upload(&self, host: HostTensor<'_>) -> Result<CpuTensor> {
        CpuTensor::from_host_in(
            host,
            self.quant_matmul == QuantMatmul::Int8,
            self.weight_file.as_deref(),
        )
    }
    fn run_pass<R: Send>(&self, f: impl FnOnce() -> R + Send) -> R {
        flushing(f)
    }
    fn host_view<'a>(&self, t: &'a CpuTensor) -> Option<HostTensor<'a>> {
        t.stored()
    }
    fn host_region(&self, t: &CpuTensor) -> Option<kimi_ops::HostRegion> {
        t.lockable_region()
            .map(|(start, len)| kimi_ops::HostRegion { start, len })
    }
    fn upload_f32(&self, shape: &[usize], data: &[f32]) -> Result<CpuTensor> {
        CpuTensor::f32(shape, data.to_vec())
    }
    fn zeros(&self, shape: &[usize]) -> Result<CpuTensor> {
        CpuTensor::try_f32_zeros(shape)
    }
    // By default the int8 mode keeps keys and values in f16, as llama.cpp does: decode
    // attention reads every cached row once per step, and that read bounds it. The f32
    // mode (golden tests) keeps them exact. `--kv-cache-dtype f16` or `f32` picks either.
    // FP8 applies to MLA latents only; attention pools then keep their default.
    fn kv_zeros(&self, shape: &[usize]) -> Result<CpuTensor> {
        match (self.kv_cache, self.quant_matmul) {
            (KvCacheDtype::F16, _)
            | (KvCacheDtype::Auto | KvCacheDtype::Fp8, QuantMatmul::Int8) => {
                CpuTensor::try_f16_zeros(shape)
            }
            (KvCacheDtype::F32, _) | (KvCacheDtype::Auto | KvCacheDtype::Fp8, QuantMatmul::F32) => {
                self.zeros(shape)
            }
        }
    }
    fn latent_zeros(&self, shape: &[usize]) -> Result<CpuTensor> {
        match self.kv_cache {
            KvCacheDtype::Auto | KvCacheDtype::F32 => self.zeros(shape),
            KvCacheDtype::Fp8 => fp8_cache::zeros(shape),
            KvCacheDtype::F16 => Err(Error::Unsupported(
                "an f16 MLA latent cache (--kv-cache-dtype f16 is for attention caches; \
                 MLA latent caches take auto, f32 or fp8)"
                    .into(),
            )),
        }
    }
    fn to_f32(&self, t: &CpuTensor) -> Result<Vec<f32>> {
        Ok(t.to_f32_vec())
    }
    fn shape<'a>(&self, t: &'a CpuTensor) -> &'a [usize] {
        t.shape()
    }
    fn size_bytes(&self, t: &CpuTensor) -> usize {
        t.size_bytes()
    }
    // The row and norm ops are sequential loops over a few rows, run on the calling thread
    // as they are (a parallel section would cost more than the work in a decode step).
    fn embedding(&self, table: &CpuTensor, ids: &[u32]) -> Result<CpuTensor> {
        norm::embedding(table, ids)
    }
    fn embedding_part(
        &self,
        table: &CpuTensor,
        ids: &[u32],
        first: usize,
        vocab: usize,
    ) -> Result<CpuTensor> {
        norm::embedding_part(table, ids, first, vocab)
    }
    fn matmul(&self, x: &CpuTensor, w: &CpuTensor) -> Result<CpuTensor> {
        flushing(|| matmul::matmul(x, w, self.quant_matmul))
    }
    // One section for both products (KDA's two small gate projections per layer and
    // token); each result equals `matmul`'s bit for bit.
    fn matmul_pair(
        &self,
        a: (&CpuTensor, &CpuTensor),
        b: (&CpuTensor, &CpuTensor),
    ) -> Result<(CpuTensor, CpuTensor)> {
        let ys = flushing(|| matmul::matmul_many(&[a, b], self.quant_matmul))?;
        match <[CpuTensor; 2]>::try_from(ys) {
            Ok([ya, yb]) => Ok((ya, yb)),
            Err(_) => Err(kimi_ops::Error::Shape {
                op: "matmul_pair",
                detail: "two products gave another number of results".into(),
            }),
        }
    }
    fn rms_norm(&self, x: &CpuTensor, weight: &CpuTensor, eps: f32) -> Result<CpuTensor> {
        norm::rms_norm(x, weight, eps)
    }
    fn add_assign(&self, x: &mut CpuTensor, y: &CpuTensor) -> Result<()> {
        norm::add_assign(x, y)
    }
    fn select_rows(&self, x: &CpuTensor, rows: &[usize]) -> Result<CpuTensor> {
        norm::select_rows(x, rows)
    }
    fn split_cols(&self, x: &CpuTensor, widths: &[usize]) -> Result<Vec<CpuTensor>> {
        norm::split_cols(x, widths)
    }
    fn concat_cols(&self, parts: &[&CpuTensor]) -> Result<CpuTensor> {
        norm::concat_cols(parts)
    }
    fn sigmoid(&self, x: &CpuTensor) -> Result<CpuTensor> {
        let v = x
            .as_f32("sigmoid")?
            .iter()
            .map(|&v| kda::sigmoid(v))
            .collect();
        CpuTensor::f32(x.shape(), v)
    }
    fn sigmoid_gate(&self, x: &CpuTensor, gate: &CpuTensor) -> Result<CpuTensor> {
        attn_res::sigmoid_gate(x, gate)
    }
    fn attn_res_mix(
        &self,
        blocks: &[&CpuTensor],
        partial: &CpuTensor,
        w_eff: &CpuTensor,
        eps: f32,
    ) -> Result<CpuTensor> {
        attn_res::mix(blocks, partial, w_eff, eps)
    }
    fn mlp(&self, x: &CpuTensor, w: &MlpWeights<CpuTensor>) -> Result<CpuTensor> {
        flushing(|| moe::mlp(x, w, Activation::Silu, self.quant_matmul))
    }
    fn ffn(&self, x: &CpuTensor, w: &MlpWeights<CpuTensor>, act: Activation) -> Result<CpuTensor> {
        flushing(|| moe::mlp(x, w, act, self.quant_matmul))
    }
    fn ffn_many(
        &self,
        items: &[(&CpuTensor, &MlpWeights<CpuTensor>)],
        act: Activation,
    ) -> Result<Vec<CpuTensor>> {
        flushing(|| moe::mlp_many(items, act, self.quant_matmul))
    }
    fn moe_route(
        &self,
        x: &CpuTensor,
        router: &CpuTensor,
        correction_bias: Option<&CpuTensor>,
        routing: &MoeRouting,
    ) -> Result<MoeRoutes<CpuTensor>> {
        let routes = flushing(|| moe::route_tokens(x, router, correction_bias, routing))?;
        let k = routing.top_k;
        let shape = [routes.len(), k];
        // Ids as f32 values: exact below 2^24 experts.
        let ids = routes
            .iter()
            .flat_map(|r| r.experts.iter().map(|&e| e as f32));
        let weights = routes.iter().flat_map(|r| r.weights.iter().copied());
        Ok(MoeRoutes {
            experts: CpuTensor::f32(&shape, ids.collect())?,
            weights: CpuTensor::f32(&shape, weights.collect())?,
            top_k: k,
        })
    }
    fn moe_experts(
        &self,
        x: &CpuTensor,
        routes: &MoeRoutes<CpuTensor>,
        experts: &ExpertView<'_, CpuTensor>,
        act: Activation,
    ) -> Result<CpuTensor> {
        let (ids, weights) = (
            routes.experts.as_f32("moe_experts")?,
            routes.weights.as_f32("moe_experts")?,
        );
        let k = routes.top_k.max(1);
        let routes: Vec<moe::Route> = ids
            .chunks(k)
            .zip(weights.chunks(k))
            .map(|(e, w)| moe::Route {
                experts: e.iter().map(|&e| e as usize).collect(),
                weights: w.to_vec(),
            })
            .collect();
        // Pairs of absent experts (held by other ranks, or a tiered bank's cold experts,
        // computed by the caller) count nothing here.
        let routes: Vec<moe::Route> = match experts.has_absent() {
            false => routes,
            true => routes
                .into_iter()
                .map(|r| {
                    let (e, w) = r
                        .experts
                        .iter()
                        .zip(&r.weights)
                        .filter(|(&e, _)| experts.is_present(e))
                        .map(|(&e, &w)| (e, w))
                        .unzip();
                    moe::Route {
                        experts: e,
                        weights: w,
                    }
                })
                .collect(),
        };
        flushing(|| moe::run_experts(x, &routes, experts.experts(), None, act, self.quant_matmul))
    }
    fn moe(
        &self,
        x: &CpuTensor,
        w: &MoeWeights<CpuTensor>,
        routing: &MoeRouting,
    ) -> Result<(CpuTensor, CpuTensor)> {
        let (y, ids) = flushing(|| moe::moe(x, w, routing, self.quant_matmul))?;
        // Ids as f32 values: exact below 2^24 experts.
        let chosen = CpuTensor::f32(&[ids.len()], ids.iter().map(|&e| e as f32).collect())?;
        Ok((y, chosen))
    }
    fn expert_ids(&self, chosen: &CpuTensor) -> Result<Vec<u32>> {
        Ok(chosen
            .as_f32("expert_ids")?
            .iter()
            .map(|&e| e as u32)
            .collect())
    }
    fn short_conv_silu(
        &self,
        x: &CpuTensor,
        weight: &CpuTensor,
        segments: &[Segment],
        states: &mut [&mut CpuTensor],
    ) -> Result<CpuTensor> {
        flushing(|| kda::short_conv_silu(x, weight, segments, states))
    }
    fn kda_gate(
        &self,
        f: &CpuTensor,
        a_log: &CpuTensor,
        dt_bias: &CpuTensor,
        num_heads: usize,
        gate: KdaGate,
    ) -> Result<CpuTensor> {
        flushing(|| kda::gate(f, a_log, dt_bias, num_heads, gate))
    }
    fn kda(
        &self,
        q: &CpuTensor,
        k: &CpuTensor,
        v: &CpuTensor,
        g: &CpuTensor,
        beta: &CpuTensor,
        num_heads: usize,
        segments: &[Segment],
        states: &mut [&mut CpuTensor],
        mode: KdaMode,
    ) -> Result<CpuTensor> {
        flushing(|| kda::kda(q, k, v, g, beta, num_heads, segments, states, mode))
    }
    // One section per layer and token instead of seven ops (`kda_step`); prefill and
    // mixed batches keep the separate ops.
    fn kda_decode(
        &self,
        x: &KdaStepInputs<'_, CpuTensor>,
        w: &KdaStepWeights<'_, CpuTensor>,
        num_heads: usize,
        segments: &[Segment],
        caches: &mut [(&mut [CpuTensor; 3], &mut CpuTensor)],
    ) -> Result<CpuTensor> {
        if segments.iter().all(|s| s.len == 1) {
            flushing(|| kda_step::decode(x, w, num_heads, segments, caches))
        } else {
            kimi_ops::kda_decode_composed(self, x, w, num_heads, segments, caches)
        }
    }
    fn gated_rms_norm(
        &self,
        o: &CpuTensor,
        z: &CpuTensor,
        weight: &CpuTensor,
        eps: f32,
    ) -> Result<CpuTensor> {
        flushing(|| kda::gated_rms_norm(o, z, weight, eps))
    }
    fn mla(
        &self,
        q: &CpuTensor,
        latent: &CpuTensor,
        kv_b: &CpuTensor,
        dims: &MlaDims,
        segments: &[Segment],
        cache_pool: &mut CpuTensor,
        seqs: &[PagedSeq<'_>],
        mode: MlaMode,
    ) -> Result<CpuTensor> {
        flushing(|| mla::mla(q, latent, kv_b, dims, segments, cache_pool, seqs, mode))
    }
    fn fill_zero(&self, t: &mut CpuTensor) -> Result<()> {
        t.as_f32_mut("fill_zero")?.fill(0.0);
        Ok(())
    }
    fn copy_block(&self, pool: &mut CpuTensor, src: usize, dst: usize) -> Result<()> {
        let num_blocks = pool.shape.first().copied().unwrap_or(0);
        if src >= num_blocks || dst >= num_blocks {
            return Err(Error::Shape {
                op: "copy_block",
                detail: format!("blocks {src} and {dst} of a pool of {num_blocks}"),
            });
        }
        let block: usize = pool.shape[1..].iter().product();
        let (from, to) = (src * block, dst * block);
        match &mut pool.storage {
            Storage::F32(v) => v.copy_within(from..from + block, to),
            Storage::F16(v) => v.copy_within(from..from + block, to),
            Storage::Fp8Rows { bytes, .. } => {
                let width = pool.shape.last().copied().unwrap_or(0);
                let (rows, row) = (block / width.max(1), 8 + width);
                let (from, to) = (src * rows * row, dst * rows * row);
                bytes.copy_within(from..from + rows * row, to)
            }
            _ => {
                return Err(Error::Shape {
                    op: "copy_block",
                    detail: "cache pools are f32 or f16".into(),
                })
            }
        }
        Ok(())
    }
    fn rope(
        &self,
        x: &CpuTensor,
        positions: &[usize],
        num_heads: usize,
        head_dim: usize,
        theta: f32,
        style: RopeStyle,
    ) -> Result<CpuTensor> {
        flushing(|| attention::rope(x, positions, num_heads, head_dim, theta, style))
    }
    fn attention(
        &self,
        q: &CpuTensor,
        k: &CpuTensor,
        v: &CpuTensor,
        dims: &AttentionDims,
        segments: &[Segment],
        k_pool: &mut CpuTensor,
        v_pool: &mut CpuTensor,
        seqs: &[PagedSeq<'_>],
    ) -> Result<CpuTensor> {
        flushing(|| attention::attention(q, k, v, dims, segments, k_pool, v_pool, seqs))
    }
}

static NUM_THREADS: AtomicUsize = AtomicUsize::new(0);
static TEAM: OnceLock<team::Team> = OnceLock::new();

/// Sets the number of threads the CPU backend uses, the calling one included. Call before
/// any work.
pub fn set_num_threads(n: usize) -> std::result::Result<(), String> {
    if n == 0 {
        return Err("the thread count must be at least 1".into());
    }
    if TEAM.get().is_some() {
        return Err("the CPU threads are already running".into());
    }
    NUM_THREADS.store(n, Ordering::Relaxed);
    Ok(())
}

/// Number of threads of the CPU backend, the calling one included.
pub fn num_threads() -> usize {
    team().threads()
}

/// The team that runs the backend's parallel sections: [`set_num_threads`] threads, else
/// `RAYON_NUM_THREADS` (which sized the rayon pool the team replaced), else one per core.
fn team() -> &'static team::Team {
    TEAM.get_or_init(|| {
        let from_env = || {
            std::env::var("RAYON_NUM_THREADS")
                .ok()
                .and_then(|v| v.trim().parse::<usize>().ok())
                .filter(|&n| n > 0)
        };
        let n = match NUM_THREADS.load(Ordering::Relaxed) {
            0 => from_env()
                .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get())),
            n => n,
        };
        team::Team::new(n, team::spin_budget())
    })
}

/// Runs `f` on the calling thread with subnormal floats flushed to zero, as the team's
/// workers always do, so that no value depends on which thread computed it.
fn flushing<R>(f: impl FnOnce() -> R) -> R {
    let _mode = simd::FlushSubnormals::new();
    f()
}
