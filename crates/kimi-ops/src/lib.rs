//! The backend interface that model code is written against.
//!
//! A [`Backend`] owns device memory and implements a small, closed set of model-level fused
//! operations (RMSNorm, matmul, short convolution, KDA, MLA, MoE, ...). Model definitions in
//! `kimi-model` are generic over `B: Backend` and never name a device; `kimi-cpu` and (later)
//! `kimi-cuda` implement the trait.
//!
//! Activations are row-major `[num_tokens, width]` matrices of f32 (CPU) or bf16 (GPU). A
//! forward pass over several sequences flattens their tokens into one matrix; the sequence
//! boundaries travel as [`Segment`]s so that mixers with per-sequence state (KDA, MLA) can
//! find their rows.
// No unsafe code but the shared-memory collective's file mappings (`collective::shm`).
#![deny(unsafe_code)]
#![deny(missing_docs)]

pub use kimi_core::config::Activation;
use kimi_core::config::KdaGate;
use kimi_core::DType;

pub mod bootstrap;
pub mod calibrate;
pub mod collective;
pub mod experts;
pub mod offload;
pub mod sampling;
pub use collective::{Collective, ProcessGroupId, ShmComm, ShmGroup, ThreadComm, ThreadGroup};
pub use experts::{ExpertBank, ExpertView};
pub use sampling::{RowSampling, TokenPenalty};

/// Errors raised by backends.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// Operands do not fit together.
    #[error("{op}: {detail}")]
    Shape {
        /// The operation.
        op: &'static str,
        /// What does not fit.
        detail: String,
    },
    /// The backend cannot run this operation or dtype.
    #[error("{0} is not supported by this backend")]
    Unsupported(String),
    /// A device-level failure.
    #[error("backend: {0}")]
    Device(String),
    /// A buffer could not be allocated (or its size does not fit in memory at all).
    #[error("cannot allocate {what}: {}", describe_bytes(*.bytes))]
    OutOfMemory {
        /// What the buffer was for, e.g. `a tensor of shape [4096, 16, 576]`.
        what: String,
        /// The bytes asked for; `None` when the size overflows.
        bytes: Option<u128>,
    },
}

/// "12.50 GiB (13421772800 bytes)", or that the size overflows.
fn describe_bytes(bytes: Option<u128>) -> String {
    match bytes {
        Some(b) => format!("{:.2} GiB ({b} bytes)", b as f64 / (1u64 << 30) as f64),
        None => "the size does not fit in memory at all".into(),
    }
}

impl Error {
    /// [`Error::OutOfMemory`] for `count` elements of `elem_bytes` bytes each.
    pub fn out_of_memory(what: impl Into<String>, count: Option<usize>, elem_bytes: usize) -> Self {
        Error::OutOfMemory {
            what: what.into(),
            bytes: count.map(|n| n as u128 * elem_bytes as u128),
        }
    }
}

/// Result alias for backend operations.
pub type Result<T> = std::result::Result<T, Error>;

/// A tensor in host memory, as read from a checkpoint, before upload.
#[derive(Clone, Copy, Debug)]
pub struct HostTensor<'a> {
    /// Dimensions, outermost first (`[out_features, in_features]` for linear weights).
    pub shape: &'a [usize],
    /// Element type of `bytes`.
    pub dtype: DType,
    /// Little-endian elements, `shape.product() * dtype.size_bytes()` bytes.
    pub bytes: &'a [u8],
}

/// A range of host memory by address: a whole region a host-memory backend keeps weights
/// in ([`Backend::host_region`]), which a device backend may page-lock
/// ([`Backend::lock_host_region`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct HostRegion {
    /// First byte's address.
    pub start: usize,
    /// Length in bytes.
    pub len: usize,
}

/// Keeps a [`HostRegion`] page-locked; dropping it unlocks the region.
pub type LockedRegion = Box<dyn Send + Sync>;

/// The index of the largest value of `row`, as greedy sampling picks it: NaN counts as
/// `-inf`, `+inf` as the largest finite value, ties go to the lowest index, and a row with
/// nothing above `-inf` gives 0.
pub fn argmax_row(row: &[f32]) -> u32 {
    let mut best = (0usize, f32::NEG_INFINITY);
    for (i, &x) in row.iter().enumerate() {
        // Not `min`: that would turn NaN into f32::MAX.
        let x = if x > f32::MAX { f32::MAX } else { x };
        if x > best.1 {
            best = (i, x);
        }
    }
    best.0 as u32
}

/// The rows of one sequence inside a flattened activation matrix.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Segment {
    /// First row of this sequence's new tokens.
    pub start: usize,
    /// Number of new tokens.
    pub len: usize,
}

/// Checks that there is one state per segment and that every segment lies inside the
/// `num_rows` rows of the activation; every backend's stateful ops start with this.
pub fn check_segments(
    op: &'static str,
    segments: &[Segment],
    num_states: usize,
    num_rows: usize,
) -> Result<()> {
    if segments.len() != num_states {
        return Err(Error::Shape {
            op,
            detail: format!("{} segments but {num_states} states", segments.len()),
        });
    }
    for s in segments {
        if s.start + s.len > num_rows {
            return Err(Error::Shape {
                op,
                detail: format!("segment {s:?} outside {num_rows} rows"),
            });
        }
    }
    Ok(())
}

/// One sequence's place in a paged cache: the blocks that hold its tokens.
///
/// A paged cache is one pre-allocated f32 pool `[num_blocks, block_size, width]` per layer.
/// Token `i` of the sequence lives in row `i % block_size` of block
/// `block_table[i / block_size]`; the table may list blocks in any order.
///
/// ```text
/// pool (block_size 4):  b0 [ . . . . ]  b1 [ A4 A5 . . ]  b2 [ A0 A1 A2 A3 ]  b3 [ . . . . ]
/// sequence A, 6 tokens: block_table [2, 1]
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PagedSeq<'a> {
    /// Blocks in token order.
    pub block_table: &'a [u32],
    /// Tokens of the sequence already in the cache; the segment's new tokens are written
    /// at positions `num_cached ..`.
    pub num_cached: usize,
}

/// How a backend stores key/value caches (`--kv-cache-dtype`, after vLLM's flag and
/// llama.cpp's `-ctk`/`-ctv`): MLA latent caches take `Auto` or `Fp8`; attention key/value
/// pools (Llama-family models) take `Auto`, `F16` or `F32`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum KvCacheDtype {
    /// The backend's own type (f32 on the CPU and on CUDA; the CPU's attention pools are
    /// f16 under its integer matmuls, f32 otherwise).
    #[default]
    Auto,
    /// FP8 E4M3, each cached row with its own f32 scales (no calibration, no overflow).
    Fp8,
    /// IEEE half precision, as llama.cpp's default `-ctk f16 -ctv f16`: keys and values are
    /// rounded to f16 when written, products and sums run on the widened values in f32.
    F16,
    /// f32: the exact cache, as llama.cpp's `-ctk f32 -ctv f32`.
    F32,
}

impl KvCacheDtype {
    /// The flag's spelling of this type.
    pub fn name(self) -> &'static str {
        match self {
            KvCacheDtype::Auto => "auto",
            KvCacheDtype::Fp8 => "fp8",
            KvCacheDtype::F16 => "f16",
            KvCacheDtype::F32 => "f32",
        }
    }

    /// Bytes a backend keeps for one MLA latent row of `width` values stored as this type:
    /// `8 + width` under `Fp8` (two f32 scales, then a byte per value: the CPU's and the
    /// CUDA backend's pools alike), else `4 * width` (f32; MLA pools refuse `F16`). `serve`
    /// sizes its pool by it, so the plan matches what the backends allocate.
    pub fn latent_row_bytes(self, width: usize) -> usize {
        match self {
            KvCacheDtype::Fp8 => width + 8,
            KvCacheDtype::Auto | KvCacheDtype::F16 | KvCacheDtype::F32 => 4 * width,
        }
    }
}

/// Checks a paged cache: `pool` is `[num_blocks, block_size, width]`, there is one
/// [`PagedSeq`] per segment, and every table covers its sequence's tokens after the
/// segment with blocks inside the pool. Returns `block_size`.
pub fn check_paged(
    op: &'static str,
    pool_shape: &[usize],
    width: usize,
    segments: &[Segment],
    seqs: &[PagedSeq<'_>],
) -> Result<usize> {
    let err = |detail: String| Error::Shape { op, detail };
    let &[num_blocks, block_size, w] = pool_shape else {
        return Err(err(format!(
            "cache pool {pool_shape:?} is not [blocks, block_size, width]"
        )));
    };
    if w != width || block_size == 0 {
        return Err(err(format!(
            "cache pool {pool_shape:?} is not [blocks, >0, {width}]"
        )));
    }
    if seqs.len() != segments.len() {
        return Err(err(format!(
            "{} segments but {} block tables",
            segments.len(),
            seqs.len()
        )));
    }
    for (seg, seq) in segments.iter().zip(seqs) {
        let need = (seq.num_cached + seg.len).div_ceil(block_size);
        if seq.block_table.len() < need {
            return Err(err(format!(
                "a block table of {} blocks cannot hold {} tokens in blocks of {block_size}",
                seq.block_table.len(),
                seq.num_cached + seg.len
            )));
        }
        if let Some(b) = seq.block_table[..need]
            .iter()
            .find(|&&b| b as usize >= num_blocks)
        {
            return Err(err(format!(
                "block {b} is outside the pool of {num_blocks}"
            )));
        }
    }
    Ok(block_size)
}

/// How the KDA core processes a segment of several tokens.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum KdaMode {
    /// Chunked (WY) form for more than one token, recurrent form for a single token.
    #[default]
    Auto,
    /// Token-by-token recurrence for every segment.
    Recurrent,
    /// Chunked form for every segment, even single tokens.
    Chunked,
}

/// Per-token inputs of [`Backend::kda_decode`]: a KDA layer's projections, `[n, width]` rows.
#[derive(Clone, Copy)]
pub struct KdaStepInputs<'a, T> {
    /// q, k and v projections before the short convolutions, each `[n, H*D]`.
    pub qkv: [&'a T; 3],
    /// Forget-gate pre-activation `f [n, H*D]` (input of [`Backend::kda_gate`]).
    pub f: &'a T,
    /// β logits `[n, H]`, before the sigmoid.
    pub beta_logits: &'a T,
    /// Output-gate pre-activation `z [n, H*D]` (input of [`Backend::gated_rms_norm`]).
    pub z: &'a T,
}

/// The weights [`Backend::kda_decode`] reads besides the projections.
#[derive(Clone, Copy)]
pub struct KdaStepWeights<'a, T> {
    /// Depthwise convolution weights of q, k and v (`[H*D, 1, W]` or `[H*D, W]`).
    pub conv: [&'a T; 3],
    /// `A_log [H]`.
    pub a_log: &'a T,
    /// `dt_bias [H*D]`.
    pub dt_bias: &'a T,
    /// Output norm weight `[D]`.
    pub o_norm: &'a T,
    /// Forget-gate form.
    pub gate: KdaGate,
    /// Epsilon of the gated RMSNorm.
    pub eps: f32,
}

/// The body of [`Backend::kda_decode`]'s default: the separate ops in the order a KDA layer
/// has always called them (short_conv_silu ×3, kda_gate, sigmoid, recurrent kda,
/// gated_rms_norm), so a backend's fused version can be checked against it.
pub fn kda_decode_composed<B: Backend + ?Sized>(
    be: &B,
    x: &KdaStepInputs<'_, B::Tensor>,
    w: &KdaStepWeights<'_, B::Tensor>,
    num_heads: usize,
    segments: &[Segment],
    caches: &mut [(&mut [B::Tensor; 3], &mut B::Tensor)],
) -> Result<B::Tensor> {
    let mut streams = Vec::with_capacity(3);
    for i in 0..3 {
        let mut states: Vec<&mut B::Tensor> =
            caches.iter_mut().map(|(conv, _)| &mut conv[i]).collect();
        streams.push(be.short_conv_silu(x.qkv[i], w.conv[i], segments, &mut states)?);
    }
    let g = be.kda_gate(x.f, w.a_log, w.dt_bias, num_heads, w.gate)?;
    let beta = be.sigmoid(x.beta_logits)?;
    let mut states: Vec<&mut B::Tensor> = caches.iter_mut().map(|(_, s)| &mut **s).collect();
    let o = be.kda(
        &streams[0],
        &streams[1],
        &streams[2],
        &g,
        &beta,
        num_heads,
        segments,
        &mut states,
        KdaMode::Recurrent,
    )?;
    be.gated_rms_norm(&o, x.z, w.o_norm, w.eps)
}

/// How MLA attends over its latent cache.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum MlaMode {
    /// Expanded (per-head K/V) form for several tokens, absorbed form for one.
    #[default]
    Auto,
    /// Decompress every cached latent to per-head keys and values (reference form).
    Expanded,
    /// Project queries into the latent space and attend over the 576-wide cache.
    Absorbed,
}

/// Dimensions the MLA operation needs.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MlaDims {
    /// Attention heads.
    pub num_heads: usize,
    /// Latent width (`kv_lora_rank`).
    pub kv_lora_rank: usize,
    /// Per-head query/key width without position part.
    pub qk_nope_head_dim: usize,
    /// Shared key width (`k_pe`).
    pub qk_rope_head_dim: usize,
    /// Per-head value width.
    pub v_head_dim: usize,
    /// Softmax scale.
    pub scale: f32,
}

/// How rotary position embedding pairs up the dimensions of a head.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RopeStyle {
    /// Dimensions `(2i, 2i+1)` form pair `i` (ggml's "normal" rope; llama-architecture
    /// GGUF files, whose converter permuted the Q/K rows for it).
    Adjacent,
    /// Dimensions `(i, i + D/2)` form pair `i` (ggml's NEOX rope; Hugging Face checkpoints'
    /// `rotate_half`, Qwen2 GGUF files).
    HalfSplit,
}

/// Dimensions of grouped-query attention.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AttentionDims {
    /// Query heads `Hq`.
    pub num_heads: usize,
    /// Key/value heads `Hkv`; `Hq` must be a multiple. Query head `h` reads key/value head
    /// `h / (Hq / Hkv)` (Hugging Face `repeat_kv`).
    pub num_kv_heads: usize,
    /// Width of one head `D` (queries, keys and values alike).
    pub head_dim: usize,
    /// Softmax scale, usually `D^-1/2`.
    pub scale: f32,
}

/// Weights of one gated MLP: `down(act(gate(x), up(x)))` ([`Activation`]).
pub struct MlpWeights<T> {
    /// `[intermediate, hidden]`.
    pub gate: T,
    /// `[intermediate, hidden]`.
    pub up: T,
    /// `[hidden, intermediate]`.
    pub down: T,
}

/// Weights of one mixture-of-experts block.
pub struct MoeWeights<T> {
    /// Router `[num_experts, hidden]`.
    pub router: T,
    /// Selection bias `[num_experts]` (`e_score_correction_bias`), if the checkpoint has one.
    pub correction_bias: Option<T>,
    /// Routed experts.
    pub experts: Vec<MlpWeights<T>>,
    /// Shared experts, applied to every token unweighted.
    pub shared: Option<MlpWeights<T>>,
}

/// The routes of a batch's tokens through one MoE layer, as [`Backend::moe_route`] chose
/// them: `top_k` experts per token, best first, and their combine weights (renormalised and
/// scaled), both `[n, top_k]` tensors of the backend. [`Backend::expert_ids`] reads
/// `experts`.
pub struct MoeRoutes<T> {
    /// Expert ids `[n, top_k]`.
    pub experts: T,
    /// Combine weights `[n, top_k]`, f32.
    pub weights: T,
    /// Experts per token.
    pub top_k: usize,
}

/// Routing hyper-parameters of a MoE block.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MoeRouting {
    /// Experts per token.
    pub top_k: usize,
    /// Expert groups (1 = ungrouped).
    pub num_groups: usize,
    /// Groups kept per token.
    pub topk_group: usize,
    /// Renormalise chosen weights.
    pub renormalize: bool,
    /// Multiplier on the routed weights.
    pub scaling: f32,
    /// Weight by biased scores (remote-code compatibility).
    pub weights_use_bias: bool,
}

/// The operations a device must provide to run Kimi models.
///
/// Every method that takes an activation reads a row-major `[num_tokens, width]` matrix.
/// Weights are `[out_features, in_features]` as stored in Hugging Face checkpoints, so
/// `matmul(x, w)` computes `x · wᵀ`.
pub trait Backend: Send + Sync {
    /// A tensor in this backend's memory (activations, weights and states alike).
    type Tensor: Send + Sync;

    /// Short name for logs (`cpu`, `cuda:0`).
    fn name(&self) -> String;

    /// A backend of the same kind and settings for rank `rank` of a model split over
    /// several ranks of this process (the same CPU; on GPUs, the rank's device). Default:
    /// [`Error::Unsupported`].
    fn rank_backend(&self, rank: usize) -> Result<Self>
    where
        Self: Sized,
    {
        let _ = rank;
        Err(Error::Unsupported(format!(
            "splitting a model over ranks on {}",
            self.name()
        )))
    }

    /// Starts a group of `world` rank processes: what rank 0 hands the others at the
    /// rendezvous, for every rank's [`Backend::join_process_group`] (NCCL's unique id on
    /// GPUs; on the CPU, a shared-memory group's name). Default: [`Error::Unsupported`].
    fn new_process_group(&self, world: usize) -> Result<ProcessGroupId> {
        let _ = world;
        Err(Error::Unsupported(format!(
            "ranks as processes on {}",
            self.name()
        )))
    }

    /// Joins the group `id` ([`Backend::new_process_group`] of rank 0) as rank `rank` of
    /// `world`; `timeout` bounds the join and every later collective. Default:
    /// [`Error::Unsupported`].
    fn join_process_group(
        &self,
        id: &[u8],
        rank: usize,
        world: usize,
        timeout: std::time::Duration,
    ) -> Result<std::sync::Arc<dyn Collective<Self>>>
    where
        Self: Sized,
    {
        let _ = (id, rank, world, timeout);
        Err(Error::Unsupported(format!(
            "ranks as processes on {}",
            self.name()
        )))
    }

    /// Waits until the work queued so far has run (for timing it). Default: nothing, for
    /// backends whose calls return when their work is done.
    fn synchronize(&self) -> Result<()> {
        Ok(())
    }
    /// Says that calls will come within `within` after a wait this backend cannot see (a
    /// host tier's cold experts, computed once a device has routed them): a backend whose
    /// threads sleep when idle keeps them awake until then. Default: nothing.
    fn expect_work(&self, within: std::time::Duration) {
        let _ = within;
    }
    /// Copies a checkpoint tensor to the device. Matrices may keep their stored dtype.
    fn upload(&self, host: HostTensor<'_>) -> Result<Self::Tensor>;
    /// Replaces the contents of `dst` (an earlier [`Backend::upload`] of the same shape and
    /// dtype: an expert cache slot) with `host`. Backends that can copy into the existing
    /// buffer do, in order with the work queued before and after it; the default uploads a
    /// new tensor in its place. `host` must stay unchanged while a copy from a region locked
    /// by [`Backend::lock_host_region`] may still be running (weights never change).
    fn upload_into(&self, dst: &mut Self::Tensor, host: HostTensor<'_>) -> Result<()> {
        *dst = self.upload(host)?;
        Ok(())
    }
    /// [`Backend::upload_into`] for a slot that work queued later will read, not work
    /// queued now: a backend with a copy engine of its own starts the copy there, after the
    /// work queued so far (which may still read the old contents), beside what is queued
    /// next; [`Backend::await_ahead`] makes later work wait for it. Default: `upload_into`.
    fn upload_into_ahead(&self, dst: &mut Self::Tensor, host: HostTensor<'_>) -> Result<()> {
        self.upload_into(dst, host)
    }
    /// Work queued after this sees every [`Backend::upload_into_ahead`] queued before it.
    /// Default: nothing (the default copies are in order already).
    fn await_ahead(&self) -> Result<()> {
        Ok(())
    }
    /// The stored bytes of a weight that lives in host memory, as [`Backend::upload`] took
    /// them, so that a host-side expert store can feed device slots without a second copy.
    /// Default: `None` (device memory).
    fn host_view<'a>(&self, t: &'a Self::Tensor) -> Option<HostTensor<'a>> {
        let _ = t;
        None
    }
    /// The whole region of host memory `t`'s stored bytes lie in, where this backend keeps
    /// weights in regions that may be page-locked as units (anonymous mappings shared by
    /// many weights; never files, whose locking would read them into RAM). Default: `None`.
    fn host_region(&self, t: &Self::Tensor) -> Option<HostRegion> {
        let _ = t;
        None
    }
    /// Page-locks `region` so that copies from it into this backend's memory run by DMA
    /// ([`Backend::upload_into`] then returns before its copy is done). `owner` keeps the
    /// region mapped, and its bytes unwritten, while it lives: the lock holds it. Returns
    /// what keeps the region locked, or `None` where the backend gains nothing (the
    /// default) or could not lock it (copies then stage through pageable memory as before;
    /// the backend says why in its log). A region already locked is shared, not locked
    /// twice.
    fn lock_host_region(
        &self,
        region: HostRegion,
        owner: std::sync::Arc<dyn Send + Sync>,
    ) -> Result<Option<LockedRegion>> {
        let _ = (region, owner);
        Ok(None)
    }
    /// Whether [`Backend::upload`] takes weights of `dtype` as stored. Where it does not
    /// (block-quantized GGUF weights on a backend without kernels for them), model loaders
    /// widen them to bf16 on the host first.
    fn stores(&self, dtype: DType) -> bool {
        let _ = dtype;
        true
    }
    /// Whether routed experts of `dtype` stay as stored ([`Backend::upload`]ed as they are
    /// and run by [`Backend::moe`] and the expert banks). Where not, model loaders widen
    /// them to bf16 on the host first, as [`Backend::stores`] does for other weights. A
    /// backend whose MoE kernels take fewer dtypes than its matmuls says so here; shared
    /// experts and dense layers follow [`Backend::stores`]. Default: [`Backend::stores`].
    fn stores_experts(&self, dtype: DType) -> bool {
        self.stores(dtype)
    }
    /// Creates an f32 tensor from host data.
    fn upload_f32(&self, shape: &[usize], data: &[f32]) -> Result<Self::Tensor>;
    /// Creates an f32 tensor of zeros.
    fn zeros(&self, shape: &[usize]) -> Result<Self::Tensor>;
    /// Creates a zeroed key/value cache pool `[num_blocks, block_size, width]` for
    /// [`Backend::attention`]; the backend picks its element type (by default f32, as
    /// [`Backend::zeros`]).
    fn kv_zeros(&self, shape: &[usize]) -> Result<Self::Tensor> {
        self.zeros(shape)
    }
    /// Creates a zeroed MLA latent cache pool `[num_blocks, block_size, width]` for
    /// [`Backend::mla`]; the backend picks its storage (f32 by default; FP8 E4M3 with
    /// per-row scales on the CPU and CUDA under [`KvCacheDtype::Fp8`]).
    fn latent_zeros(&self, shape: &[usize]) -> Result<Self::Tensor> {
        self.zeros(shape)
    }
    /// Copies a tensor back to the host as f32.
    fn to_f32(&self, t: &Self::Tensor) -> Result<Vec<f32>>;
    /// Dimensions of a tensor, outermost first.
    fn shape<'a>(&self, t: &'a Self::Tensor) -> &'a [usize];
    /// The greedy choice of each row of the f32 matrix `x` `[rows, cols]`
    /// ([`argmax_row`]'s rule), without copying the rows to the host where the backend
    /// can avoid it. Default: reads `x` back and scans it here.
    fn argmax_rows(&self, x: &Self::Tensor) -> Result<Vec<u32>> {
        let cols = self.shape(x).last().copied().unwrap_or(0);
        let values = self.to_f32(x)?;
        Ok(values.chunks(cols.max(1)).map(argmax_row).collect())
    }
    /// Whether [`Backend::sample_rows`] runs where the logits are; if not, the engine's
    /// host sampler (which also reports logprobs) is the better choice.
    fn samples_on_device(&self) -> bool {
        false
    }
    /// The token of each row of the f32 logits `x` `[rows, vocab]` chosen by `params[row]`
    /// after the row's `penalties` ([`sampling::sample_row`]'s rule); `x` is scratch and
    /// holds the penalised logits afterwards. Default: reads `x` back and samples here.
    fn sample_rows(
        &self,
        x: &mut Self::Tensor,
        params: &[RowSampling],
        penalties: &[TokenPenalty],
    ) -> Result<Vec<u32>> {
        let cols = self.shape(x).last().copied().unwrap_or(0).max(1);
        let mut values = self.to_f32(x)?;
        if values.len() != params.len() * cols {
            return Err(Error::Shape {
                op: "sample_rows",
                detail: format!(
                    "{} rows of logits for {} rows",
                    values.len() / cols,
                    params.len()
                ),
            });
        }
        let rows = values.chunks_mut(cols).zip(params).enumerate();
        Ok(rows
            .map(|(r, (row, p))| {
                let mine = penalties.iter().filter(|t| t.row as usize == r).copied();
                sampling::apply_penalties(row, p, mine);
                sampling::sample_row(row, p)
            })
            .collect())
    }
    /// Bytes the tensor occupies on the device.
    fn size_bytes(&self, t: &Self::Tensor) -> usize;
    /// Free and total bytes of the device memory this backend allocates from, where the
    /// backend owns such memory (GPUs); `None` for host memory (ask the OS instead).
    fn memory_info(&self) -> Option<(u64, u64)> {
        None
    }
    /// Runs `f` (e.g. one forward pass) and returns, with its result, the most device memory
    /// it had allocated at once beyond what was in use when it started, where the backend
    /// tracks its allocations (GPU memory pools); `None` otherwise. Sizes the per-step
    /// workspace in a memory plan. Memory the backend will hold for good once it runs
    /// (CUDA: the graph arena, where graphs are on) is allocated before measuring, so that
    /// the free memory read afterwards already excludes it.
    fn measure_workspace<R>(&self, f: impl FnOnce() -> R) -> (R, Option<u64>) {
        (f(), None)
    }
    /// Returns memory the backend holds for reuse but no tensor uses to the device, so that
    /// free-memory figures count only live tensors. Default: nothing to return.
    fn release_unused_memory(&self) -> Result<()> {
        Ok(())
    }
    /// Measured bytes per second the device reads from its own memory (the roofline of
    /// bandwidth-bound work), where the backend can measure it; `None` otherwise.
    fn measure_read_bandwidth(&self) -> Option<f64> {
        None
    }
    /// Runs `f`, a whole forward pass, where this backend's ops start cheapest. The CPU
    /// backend runs it on the calling thread with its floating-point mode set once for the
    /// pass (subnormals flushed to zero, as on its worker threads); each op's parallel
    /// section then starts in place on that thread and its spinning workers. Other backends
    /// just call it.
    fn run_pass<R: Send>(&self, f: impl FnOnce() -> R + Send) -> R {
        f()
    }

    /// Runs `f`, which queues one forward pass of device work and reads nothing back, as
    /// a unit the backend may record and replay. `key` names passes that launch the same
    /// work on buffers of the same sizes (decode steps of one batch size); `None` runs `f`
    /// as is. The CUDA backend records the pass, captures it once per key as a CUDA graph
    /// and replays the graph, patching the kernel arguments that changed (positions,
    /// split counts): one launch per step instead of hundreds. Tensors `f` returns must be
    /// read (and dropped) before the next replayable pass. Default: calls `f`.
    fn replayable<R>(&self, key: Option<u64>, f: impl FnOnce() -> R) -> Result<R> {
        let _ = key;
        Ok(f())
    }

    /// Rows of `table` `[vocab, d]` for `ids` → `[ids.len(), d]`.
    fn embedding(&self, table: &Self::Tensor, ids: &[u32]) -> Result<Self::Tensor>;
    /// One rank's part of a vocabulary-split embedding: `table` `[rows, d]` holds the
    /// vocabulary rows `first..first + rows` of a table of `vocab`; ids in that range give
    /// their row, other ids a zero row (another rank's), so that the ranks' outputs sum to
    /// the whole table's [`Backend::embedding`]. Ids at or past `vocab` are an error.
    /// Default: unsupported.
    fn embedding_part(
        &self,
        table: &Self::Tensor,
        ids: &[u32],
        first: usize,
        vocab: usize,
    ) -> Result<Self::Tensor> {
        let _ = (table, ids, first, vocab);
        Err(Error::Unsupported(format!(
            "a vocabulary-split embedding on {}",
            self.name()
        )))
    }
    /// `x [n, in] · wᵀ` with `w [out, in]` → `[n, out]`.
    fn matmul(&self, x: &Self::Tensor, w: &Self::Tensor) -> Result<Self::Tensor>;
    /// `x · wᵀ` for a `w` stacked by rows from blocks of `rows[i]` rows (fused projections),
    /// one `[n, rows[i]]` product per block: what [`Backend::split_cols`] of
    /// [`Backend::matmul`] gives, to f32 rounding. The CUDA backend writes each block's
    /// product in place for prefill, which spares the split's copies. Default: exactly that.
    fn matmul_split(
        &self,
        x: &Self::Tensor,
        w: &Self::Tensor,
        rows: &[usize],
    ) -> Result<Vec<Self::Tensor>> {
        self.split_cols(&self.matmul(x, w)?, rows)
    }
    /// Two independent products `(xa · waᵀ, xb · wbᵀ)` (KDA's forget and output gates, both
    /// from low-rank halves of one projection). The CUDA backend runs a one-token pair as one
    /// launch. Default: two [`Backend::matmul`]s.
    fn matmul_pair(
        &self,
        a: (&Self::Tensor, &Self::Tensor),
        b: (&Self::Tensor, &Self::Tensor),
    ) -> Result<(Self::Tensor, Self::Tensor)> {
        Ok((self.matmul(a.0, a.1)?, self.matmul(b.0, b.1)?))
    }
    /// Per-row RMSNorm of `x [n, d]` times `weight [d]`.
    fn rms_norm(&self, x: &Self::Tensor, weight: &Self::Tensor, eps: f32) -> Result<Self::Tensor>;
    /// The residual step between two sublayers: `x += y`, then the RMSNorm of the new `x`
    /// times `weight` (one kernel on a GPU). Default: [`Backend::add_assign`] then
    /// [`Backend::rms_norm`], which a fused version must match bit for bit.
    fn add_rms_norm(
        &self,
        x: &mut Self::Tensor,
        y: &Self::Tensor,
        weight: &Self::Tensor,
        eps: f32,
    ) -> Result<Self::Tensor> {
        self.add_assign(x, y)?;
        self.rms_norm(x, weight, eps)
    }
    /// `x += y`, both `[n, d]`.
    fn add_assign(&self, x: &mut Self::Tensor, y: &Self::Tensor) -> Result<()>;
    /// Picks rows of `x [n, d]` → `[rows.len(), d]`.
    fn select_rows(&self, x: &Self::Tensor, rows: &[usize]) -> Result<Self::Tensor>;
    /// Splits `x [n, sum(widths)]` into column blocks `[n, widths[i]]`. The blocks may share
    /// memory with `x` (the CUDA backend returns views of a one-row `x`): `x` must not be
    /// written while they are in use.
    fn split_cols(&self, x: &Self::Tensor, widths: &[usize]) -> Result<Vec<Self::Tensor>>;
    /// Concatenates `[n, w_i]` matrices along columns.
    fn concat_cols(&self, parts: &[&Self::Tensor]) -> Result<Self::Tensor>;
    /// Elementwise logistic sigmoid.
    fn sigmoid(&self, x: &Self::Tensor) -> Result<Self::Tensor>;
    /// `x ⊙ sigmoid(gate)`, both `[n, d]` (Kimi K3's MLA output gate). Default: unsupported.
    fn sigmoid_gate(&self, x: &Self::Tensor, gate: &Self::Tensor) -> Result<Self::Tensor> {
        let _ = (x, gate);
        Err(Error::Unsupported("sigmoid_gate".into()))
    }
    /// Block Attention Residuals' mix (Kimi K3 spec §3.6), per token: over the sources
    /// `V = [blocks.., partial]` (each `[n, d]`), logits `(V_k · w_eff) / sqrt(mean(V_k²) +
    /// eps)`, a softmax over the sources, and `Σ_k π_k V_k` (f32 throughout). `w_eff [d]` is
    /// the mix's norm weight times its projection. With no blocks it returns `partial`.
    /// Default: unsupported.
    fn attn_res_mix(
        &self,
        blocks: &[&Self::Tensor],
        partial: &Self::Tensor,
        w_eff: &Self::Tensor,
        eps: f32,
    ) -> Result<Self::Tensor> {
        let _ = (blocks, partial, w_eff, eps);
        Err(Error::Unsupported("attn_res_mix".into()))
    }

    /// SwiGLU MLP `down(silu(x·gateᵀ) ⊙ x·upᵀ)` on `x [n, hidden]`.
    fn mlp(&self, x: &Self::Tensor, w: &MlpWeights<Self::Tensor>) -> Result<Self::Tensor>;
    /// Gated MLP `down(act(x·gateᵀ, x·upᵀ))` on `x [n, hidden]`, the activation in f32.
    /// Default: [`Backend::mlp`] for SwiGLU; a backend runs other activations itself.
    fn ffn(
        &self,
        x: &Self::Tensor,
        w: &MlpWeights<Self::Tensor>,
        act: Activation,
    ) -> Result<Self::Tensor> {
        match act {
            Activation::Silu => self.mlp(x, w),
            other => Err(Error::Unsupported(format!("ffn with {other:?}"))),
        }
    }
    /// [`Backend::ffn`] of several experts, each on its own rows (a MoE layer's cold experts
    /// on the host): a backend may run them together (the CPU backend in one section of its
    /// threads per projection). Each result equals `ffn`'s.
    fn ffn_many(
        &self,
        items: &[(&Self::Tensor, &MlpWeights<Self::Tensor>)],
        act: Activation,
    ) -> Result<Vec<Self::Tensor>> {
        items.iter().map(|(x, w)| self.ffn(x, w, act)).collect()
    }
    /// Routes `x [n, hidden]` through a MoE layer's router (`router [E, hidden]`, logits in
    /// f32): sigmoid scores, `correction_bias` added for the selection only, group-limited
    /// top-k, weights from the unbiased scores (unless `routing.weights_use_bias`),
    /// renormalised and scaled. Default: unsupported (backends with only the fused
    /// [`Backend::moe`] cannot split the step).
    fn moe_route(
        &self,
        x: &Self::Tensor,
        router: &Self::Tensor,
        correction_bias: Option<&Self::Tensor>,
        routing: &MoeRouting,
    ) -> Result<MoeRoutes<Self::Tensor>> {
        let _ = (x, router, correction_bias, routing);
        Err(Error::Unsupported("moe_route".into()))
    }
    /// The routed experts of a layer on `x [n, d]` (the hidden state, or the LatentMoE
    /// latent): for each token `Σ_k weight_k · expert_k(x)` over its `routes`, each expert
    /// a gated MLP with `act` whose weights `experts` lends by id (all in this backend's
    /// memory; see [`ExpertBank::run`] for banks with experts elsewhere). Returns `[n, d]`.
    /// Default: unsupported.
    fn moe_experts(
        &self,
        x: &Self::Tensor,
        routes: &MoeRoutes<Self::Tensor>,
        experts: &ExpertView<'_, Self::Tensor>,
        act: Activation,
    ) -> Result<Self::Tensor> {
        let _ = (x, routes, experts, act);
        Err(Error::Unsupported("moe_experts".into()))
    }
    /// Routed experts plus shared experts on `x [n, hidden]` → `[n, hidden]`, SwiGLU
    /// throughout: the fused form of [`Backend::moe_route`], [`Backend::moe_experts`] and
    /// [`Backend::ffn`] for a plain MoE layer (Kimi Linear), where backends have their
    /// fastest paths.
    /// Returns the output and the chosen experts, `top_k` per token, in a tensor only
    /// [`Backend::expert_ids`] reads: a GPU backend can then read every layer's choices
    /// after the whole pass is queued, with one wait, instead of waiting once per layer.
    fn moe(
        &self,
        x: &Self::Tensor,
        w: &MoeWeights<Self::Tensor>,
        routing: &MoeRouting,
    ) -> Result<(Self::Tensor, Self::Tensor)>;
    /// The expert ids held by the second tensor [`Backend::moe`] returns (or by
    /// [`MoeRoutes::experts`]).
    fn expert_ids(&self, chosen: &Self::Tensor) -> Result<Vec<u32>>;
    /// The expert ids and the weights of `routes` read back together (a device waits once).
    fn read_routes(&self, routes: &MoeRoutes<Self::Tensor>) -> Result<(Vec<u32>, Vec<f32>)> {
        Ok((
            self.expert_ids(&routes.experts)?,
            self.to_f32(&routes.weights)?,
        ))
    }
    /// [`Backend::read_routes`] of several routes with one wait (a layer's routes and the
    /// next layer's predicted ones).
    fn read_route_sets(
        &self,
        sets: &[&MoeRoutes<Self::Tensor>],
    ) -> Result<Vec<(Vec<u32>, Vec<f32>)>> {
        sets.iter().map(|r| self.read_routes(r)).collect()
    }
    /// Expert ids `[rows, top_k]` in the layout [`Backend::moe_route`] writes and
    /// [`Backend::moe_experts`] reads, for routes the caller builds (the pairs one rank
    /// receives under expert parallelism). Default: the ids as f32 values (exact below
    /// 2^24), the CPU backend's layout.
    fn upload_expert_ids(&self, shape: &[usize], ids: &[u32]) -> Result<Self::Tensor> {
        let values: Vec<f32> = ids.iter().map(|&e| e as f32).collect();
        self.upload_f32(shape, &values)
    }
    /// For each tensor [`Backend::moe`] returned (one per MoE layer of a pass), how many
    /// times each of `num_experts` experts was chosen. The CUDA backend counts on the device
    /// and reads every layer's counts back at once (one wait per pass instead of one per
    /// layer). Default: [`Backend::expert_ids`] per layer, counted on the host.
    fn expert_counts(&self, chosen: &[&Self::Tensor], num_experts: usize) -> Result<Vec<Vec<u32>>> {
        chosen
            .iter()
            .map(|c| {
                let mut counts = vec![0u32; num_experts];
                for e in self.expert_ids(c)? {
                    if let Some(n) = counts.get_mut(e as usize) {
                        *n += 1;
                    }
                }
                Ok(counts)
            })
            .collect()
    }

    /// Causal depthwise convolution followed by SiLU, per segment.
    ///
    /// `x [n, C]`, `weight [C, W]` (tap `W-1` multiplies the current token). `states[s]` is
    /// segment `s`'s `[W-1, C]` window of the previous pre-convolution inputs (oldest first);
    /// it is read as left context and updated to the last `W-1` inputs.
    fn short_conv_silu(
        &self,
        x: &Self::Tensor,
        weight: &Self::Tensor,
        segments: &[Segment],
        states: &mut [&mut Self::Tensor],
    ) -> Result<Self::Tensor>;

    /// KDA log-space forget gate from `f [n, H*K]`, `a_log [H]` and `dt_bias [H*K]`.
    fn kda_gate(
        &self,
        f: &Self::Tensor,
        a_log: &Self::Tensor,
        dt_bias: &Self::Tensor,
        num_heads: usize,
        gate: KdaGate,
    ) -> Result<Self::Tensor>;

    /// The gated delta rule of KDA, per segment.
    ///
    /// `q, k, v, g [n, H*D]`, `beta [n, H]` (already sigmoid). q and k are L2-normalised per
    /// head inside (`x·rsqrt(Σx²+1e-6)`) and q is scaled by `D^-1/2`. `states[s]` is segment
    /// `s`'s `[H, D, D]` f32 state (key-major), updated in place. Returns `o [n, H*D]`.
    #[allow(clippy::too_many_arguments)]
    fn kda(
        &self,
        q: &Self::Tensor,
        k: &Self::Tensor,
        v: &Self::Tensor,
        g: &Self::Tensor,
        beta: &Self::Tensor,
        num_heads: usize,
        segments: &[Segment],
        states: &mut [&mut Self::Tensor],
        mode: KdaMode,
    ) -> Result<Self::Tensor>;

    /// Per-head RMSNorm of `o [n, H*D]` times `weight [D]`, gated by `sigmoid(z)`.
    fn gated_rms_norm(
        &self,
        o: &Self::Tensor,
        z: &Self::Tensor,
        weight: &Self::Tensor,
        eps: f32,
    ) -> Result<Self::Tensor>;

    /// A KDA layer between its projections and `o_proj`, in the recurrent form: the short
    /// convolutions + SiLU of q, k, v (updating `caches[s].0`), the forget gate, β =
    /// sigmoid, the gated delta rule (updating the state `caches[s].1`) and the gated
    /// RMSNorm. Returns `[n, H*D]`, the input of `o_proj`.
    ///
    /// Model code calls it when every segment is one token (decode). The default composes
    /// the separate ops ([`kda_decode_composed`]); backends may fuse it (one kernel per
    /// layer on CUDA) and must then agree with the composition to f32 rounding.
    fn kda_decode(
        &self,
        x: &KdaStepInputs<'_, Self::Tensor>,
        w: &KdaStepWeights<'_, Self::Tensor>,
        num_heads: usize,
        segments: &[Segment],
        caches: &mut [(&mut [Self::Tensor; 3], &mut Self::Tensor)],
    ) -> Result<Self::Tensor> {
        kda_decode_composed(self, x, w, num_heads, segments, caches)
    }

    /// Causal MLA over a paged latent cache, per segment.
    ///
    /// `q [n, H*(nope+rope)]`; `latent [n, r+rope]` holds each new token's normalised latent
    /// `c` followed by its shared key `k_pe`; `kv_b [H*(nope+v), r]`. `pool` is the layer's
    /// cache `[num_blocks, block_size, r+rope]` from [`Backend::latent_zeros`]; `seqs[s]` says where segment `s`'s
    /// sequence lives in it (see [`PagedSeq`]). The segment's new latent rows are written to
    /// positions `num_cached ..` of its table, then each new token attends over positions
    /// `0 ..=` its own. Returns `[n, H*v]`.
    #[allow(clippy::too_many_arguments)]
    fn mla(
        &self,
        q: &Self::Tensor,
        latent: &Self::Tensor,
        kv_b: &Self::Tensor,
        dims: &MlaDims,
        segments: &[Segment],
        pool: &mut Self::Tensor,
        seqs: &[PagedSeq<'_>],
        mode: MlaMode,
    ) -> Result<Self::Tensor>;

    /// Sets every element of an f32 tensor to zero in place (resets a recycled state slot).
    fn fill_zero(&self, t: &mut Self::Tensor) -> Result<()> {
        *t = self.zeros(self.shape(t))?;
        Ok(())
    }

    /// Copies block `src` of a cache pool `[num_blocks, block_size, width]` over block
    /// `dst` (forking a beam copies the partial block its parent would overwrite). The
    /// default says it is unsupported, and the engine prefills the fork instead.
    fn copy_block(&self, pool: &mut Self::Tensor, src: usize, dst: usize) -> Result<()> {
        let _ = (pool, src, dst);
        Err(Error::Unsupported("copy_block".into()))
    }

    /// Rotary position embedding of `x [n, num_heads * head_dim]`, one position per row.
    ///
    /// Pair `i` of each head (`0 <= i < head_dim / 2`, paired as `style` says) is rotated by
    /// the angle `positions[row] * theta^(-2i / head_dim)`. Returns a new `[n, H*D]` tensor.
    fn rope(
        &self,
        x: &Self::Tensor,
        positions: &[usize],
        num_heads: usize,
        head_dim: usize,
        theta: f32,
        style: RopeStyle,
    ) -> Result<Self::Tensor> {
        let _ = (x, positions, num_heads, head_dim, theta, style);
        Err(Error::Unsupported("rope".into()))
    }

    /// Causal grouped-query attention over paged key/value caches.
    ///
    /// `q [n, Hq*D]` (already rotated), `k, v [n, Hkv*D]` (k already rotated). `k_pool` and
    /// `v_pool` are the layer's f32 caches, each `[num_blocks, block_size, Hkv*D]`; `seqs[s]`
    /// says where segment `s`'s sequence lives in them (see [`PagedSeq`]). The segment's new
    /// rows of `k` and `v` are written at positions `num_cached ..`, then each new token
    /// attends to every position up to and including itself. Returns `[n, Hq*D]`.
    #[allow(clippy::too_many_arguments)]
    fn attention(
        &self,
        q: &Self::Tensor,
        k: &Self::Tensor,
        v: &Self::Tensor,
        dims: &AttentionDims,
        segments: &[Segment],
        k_pool: &mut Self::Tensor,
        v_pool: &mut Self::Tensor,
        seqs: &[PagedSeq<'_>],
    ) -> Result<Self::Tensor> {
        let _ = (q, k, v, dims, segments, k_pool, v_pool, seqs);
        Err(Error::Unsupported("attention".into()))
    }
}

#[cfg(test)]
mod tests {
    use super::{argmax_row, KvCacheDtype};

    #[test]
    fn fp8_latent_rows_are_a_byte_a_value_and_two_scales() {
        // Kimi Linear's 512 + 64: 584 bytes against 2304, the 3.9x of the README.
        assert_eq!(KvCacheDtype::Fp8.latent_row_bytes(576), 584);
        assert_eq!(KvCacheDtype::Auto.latent_row_bytes(576), 2304);
        assert_eq!(KvCacheDtype::F32.latent_row_bytes(7), 28);
    }

    #[test]
    fn argmax_row_follows_greedy_sampling() {
        assert_eq!(
            argmax_row(&[1.0, 3.0, 3.0, 2.0]),
            1,
            "ties go to the lowest index"
        );
        assert_eq!(argmax_row(&[f32::NAN, 0.5, f32::NAN]), 1, "NaN never wins");
        assert_eq!(argmax_row(&[f32::NEG_INFINITY; 3]), 0);
        assert_eq!(argmax_row(&[f32::NAN, f32::NAN]), 0);
        assert_eq!(argmax_row(&[]), 0);
        // +inf counts as the largest finite value, so an earlier f32::MAX ties and wins.
        assert_eq!(argmax_row(&[f32::MAX, f32::INFINITY]), 0);
        assert_eq!(argmax_row(&[-1.0, f32::INFINITY]), 1);
    }
}
