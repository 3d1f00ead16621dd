//! The kernel choices of one [`CudaBackend`](crate::CudaBackend): its [`KernelConfig`], and
//! the planners that decide from that configuration and a call's shapes which kernels the
//! call runs (`plan_moe`, `plan_matmul`, `plan_gemv`, `plan_kda_chunk`, `plan_mla_prefill`).
//!
//! Nothing here touches the GPU: this module builds without the `cuda` feature, so its
//! tests run on any machine, and the backend hands the launchers in `ops/` what the planners
//! chose. [`KernelConfig::from_env`] is the one place that reads the `KIMI_CUDA_*`
//! variables; `plan/README.md` tables every field, its variable, its default and why.

use std::num::NonZeroUsize;

mod bank;
mod env;
mod kernels;
mod moe;
mod stream;

pub(crate) use bank::{plan_expert_bank, BankCall, BankPath, PackedBank, PackedFormat};
pub use env::EnvVarError;
pub(crate) use kernels::{
    plan_gemv, plan_gemv_pair, plan_kda_chunk, plan_matmul, plan_mla_prefill, plan_quant_gemv_pair,
    plan_quant_gemv_path, GemvPath, KdaChunkPath, KdaPrep, MatmulPath, MlaPrefillFacts,
    MlaPrefillPath, QuantGemvPath, QuantGemvPlan, GEMV_MAX_ROWS, QUANT_GEMV_MAX_ROWS,
};
pub(crate) use moe::{
    plan_moe, ExpertLayout, GroupedPath, MoeCall, MoePath, RoutePath, RouterFacts, SharedExpert,
    StreamPasses, TableCall, ROUTE_WARP_MAX_EXPERTS,
};
pub use stream::StreamShape;
pub(crate) use stream::{
    stream_staged_bytes, LayerPlan, StreamPlan, LAYER_SMEM_BYTES, MAX_DYNAMIC_SMEM_BYTES,
    STREAM_CONSUMERS, STREAM_MAX_SLOTS,
};

/// How GEMMs against bf16/f16 weights treat the f32 activations.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum GemmPrecision {
    /// Split each activation into two 16-bit terms (`hi + lo`) and run both through one GEMM
    /// of twice the rows: close to f32 accuracy (the weights are read once, so decode costs
    /// about the same; prefill does twice the tensor-core work).
    #[default]
    Split,
    /// Round activations to the weight's 16-bit type: fastest, ~3e-3 relative error per GEMM.
    Half,
}

/// The small-batch (at most 8 rows) bf16 GEMV kernel.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum GemvKernel {
    /// The TMA-fed `gemv_bulk` where it measured faster (one token, narrow matrices, very
    /// long rows), else the register-streaming `gemv_bf16`; two one-token products of one
    /// row length that both take `gemv_bf16` share one `gemv_bf16_pair` launch.
    #[default]
    Auto,
    /// Always the register-streaming `gemv_bf16`.
    Register,
    /// `gemv_bulk` wherever its weight tile fits.
    Bulk,
    /// The persistent `gemv_stream_1` for one token where its cut fits (else as `Auto`,
    /// without the pair kernel): it matched `gemv_bulk` without bettering it.
    Stream,
}

/// The chunked (prefill) KDA kernels, for head sizes 64 and 128.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum KdaChunkKernel {
    /// The bf16 tensor-core state pass (hi + lo operands under [`GemmPrecision::Split`]),
    /// its operands prepared by 16-row blocks (`kda_chunk_prep_blk_D`).
    #[default]
    Auto,
    /// The f32 CUDA-core kernels (`kda_chunk_prep_D`, `kda_chunk_state_D`).
    F32,
    /// The tensor-core state pass with the pair-loop preparation (`kda_chunk_prep_mma_D`).
    MmaPairPrep,
}

/// Which kernels of a chunked KDA launch run: a timing hook (with either off, the outputs
/// are garbage).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KdaStages {
    /// The per-chunk preparation.
    pub prep: bool,
    /// The serial state pass.
    pub state: bool,
}

impl Default for KdaStages {
    fn default() -> Self {
        Self {
            prep: true,
            state: true,
        }
    }
}

/// The expanded (prefill) MLA attention kernel.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum MlaPrefillKernel {
    /// Under [`GemmPrecision::Half`] with heads of 192 (q·k) and 128 (v), FlashInfer's
    /// Hopper kernel; else our bf16 tensor-core kernel wherever it fits (hi + lo operands
    /// under [`GemmPrecision::Split`]); else the f32 kernel.
    #[default]
    Auto,
    /// Always the f32 CUDA-core kernel.
    F32,
    /// As `Auto`, never FlashInfer's kernel.
    NoFlashInfer,
}

/// The grouped expert GEMM of MoE layers above [`KernelConfig::fused_moe_max_tokens`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum GroupedMoeKernel {
    /// CUTLASS's grouped GEMM from [`KernelConfig::cutlass_min_pairs`] routed pairs (outside
    /// recorded passes: it bypasses the recorder), else the pipelined `moe_mma_*`.
    #[default]
    Auto,
    /// The older single-stage `moe_grouped_mma`.
    SingleStage,
    /// Always the pipelined `moe_mma_*`.
    Pipelined,
    /// Always CUTLASS's grouped GEMM (outside recorded passes).
    Cutlass,
}

/// Routed pairs (tokens × top-k) from which [`GroupedMoeKernel::Auto`] takes CUTLASS.
/// `check moe-bench` on an H200 (48B layer, top-8): with bf16 operands CUTLASS wins from 256
/// tokens (0.81 vs 1.10 ms); under the split it runs two GEMMs per projection and f32
/// gate/up rows, and wins only past ~1.7K tokens (1K: 2.14 vs 1.88 ms; 8K: 6.37 vs 8.65 ms).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CutlassMinPairs {
    /// Under [`GemmPrecision::Half`].
    pub half: usize,
    /// Under [`GemmPrecision::Split`].
    pub split: usize,
}

impl Default for CutlassMinPairs {
    fn default() -> Self {
        Self {
            half: 2048,
            split: 16384,
        }
    }
}

impl CutlassMinPairs {
    /// The threshold for `precision`.
    pub fn for_precision(self, precision: GemmPrecision) -> usize {
        match precision {
            GemmPrecision::Split => self.split,
            GemmPrecision::Half => self.half,
        }
    }
}

/// Every kernel choice of one [`CudaBackend`](crate::CudaBackend). `Default` is what the
/// backend runs with no `KIMI_CUDA_*` variable set; [`KernelConfig::from_env`] applies the
/// variables (`CudaBackend::new` starts from it). Two backends in one process may differ.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct KernelConfig {
    /// How tensor-core products (GEMMs, MoE experts, MLA prefill attention, the chunked KDA
    /// state pass) take the f32 activations.
    pub precision: GemmPrecision,
    /// The small-batch bf16 GEMV kernel.
    pub gemv: GemvKernel,
    /// The cut of the streamed one-token kernels (`KIMI_CUDA_STREAM_SHAPE`).
    pub stream_shape: StreamShape,
    /// The chunked KDA kernels (`KIMI_CUDA_KDA_CHUNK`).
    pub kda_chunk: KdaChunkKernel,
    /// Which kernels of a chunked KDA launch run (timing only).
    pub kda_stages: KdaStages,
    /// The most chunks of one chunked-KDA launch group; `None`: as many as keep the scratch
    /// under its bound (tests set a few to cut short segments into several groups).
    pub kda_group_chunks: Option<NonZeroUsize>,
    /// The expanded (prefill) MLA kernel (`KIMI_CUDA_MLA_PREFILL`).
    pub mla_prefill: MlaPrefillKernel,
    /// The fewest latent rows per CTA of the absorbed (decode) MLA kernel, rounded up to a
    /// multiple of 16: at one token and 1K of context 256 left 5 CTAs working, 64 gives 17.
    pub mla_decode_min_chunk: usize,
    /// One-token MoE layers route in one launch (`moe_route_one`) instead of through cuBLAS,
    /// `moe_route*` and `moe_lists`.
    pub moe_route_one: bool,
    /// One-token MoE layers stream their routed and shared experts (`moe_stream_1` /
    /// `moe_stream_layer`) instead of running the shared expert as an MLP and the routed
    /// ones through `moe_expert_gemv`.
    pub moe_stream: bool,
    /// Streamed one-token MoE layers run gate/up and down in one launch
    /// (`moe_stream_layer`) instead of two `moe_stream_1` passes (`KIMI_CUDA_MOE_LAYER`).
    pub moe_layer: bool,
    /// Up to this many tokens the routed experts run as fused GEMVs over every (token,
    /// expert) pair; above, as grouped tensor-core GEMMs (`KIMI_CUDA_FUSED_MOE_MAX_TOKENS`).
    /// On an H200 with the 48B shapes the GEMV is 14 % faster at 32 tokens, the pipelined
    /// GEMM 3 % faster at 64.
    pub fused_moe_max_tokens: usize,
    /// Forces `moe_expert_gemv`'s 16-row blocks per CTA; `None`: one while few experts are
    /// active, four from 128 pairs.
    pub moe_row_blocks: Option<NonZeroUsize>,
    /// Forces the pairs an MXFP4 expert bank's kernel (`moe_mxfp4_mma_*`) serves per pass
    /// over an expert's weights, in groups of 8 (1, 2 or 4; `KIMI_CUDA_MXFP4_TOKEN_TILES`).
    /// `None`: by the expected pairs per active expert ([`plan_expert_bank`]).
    pub mxfp4_token_tiles: Option<usize>,
    /// The grouped expert GEMM above [`Self::fused_moe_max_tokens`].
    pub grouped_moe: GroupedMoeKernel,
    /// Where [`GroupedMoeKernel::Auto`] switches to CUTLASS (`KIMI_CUDA_MOE_GEMM=cutlass` /
    /// `=mma` make it always / never).
    pub cutlass_min_pairs: CutlassMinPairs,
    /// Decode passes run through CUDA graphs (`KIMI_CUDA_GRAPHS`). Off: with programmatic
    /// dependent launch, issuing a decode step op by op was 4-8 % faster than replaying it
    /// as a graph on an H200, although the captured graphs carry programmatic edges.
    pub cuda_graphs: bool,
    /// Kernels launch with programmatic stream serialization, so that a kernel's blocks
    /// start while its predecessor drains (`KIMI_CUDA_PDL`).
    pub pdl: bool,
    /// Freed device memory stays in the device's pool between passes instead of going back
    /// to the driver at every synchronisation (`KIMI_CUDA_POOL_RELEASE`). The pool is the
    /// device's: backends on one GPU share this setting.
    pub pool_keeps_memory: bool,
    /// MiB of the CUDA graphs' pass arena, made at the first recorded pass (a 64-sequence
    /// decode step of the 48B model peaks near 100 MB; `KIMI_CUDA_GRAPH_ARENA_MB`).
    pub graph_arena_mb: usize,
    /// Host memory that expert cache slots are filled from is page-locked, and fills are
    /// queued as asynchronous copies that run by DMA (`KIMI_CUDA_PIN_HOST_EXPERTS`). Off:
    /// each fill goes through the driver's staging buffer, one after another.
    pub pin_host_experts: bool,
    /// MXFP4 expert slots fill by copying the stored blocks and laying them out on the GPU
    /// (`mxfp4_from_blocks`) instead of on the host before the copy
    /// (`KIMI_CUDA_MXFP4_DEVICE_FILLS`; `0` lays them out on the host). On: `check offload`
    /// passed with it on an H100 (2026-12-06), where a K3 expert's fill took 0.43 ms instead
    /// of 4.8 ms.
    pub mxfp4_device_fills: bool,
    /// Slots of experts kept packed (Q4Z, Q8Z, F8S, ggml Q4_0/Q4_1/Q8_0/Q4_K) fill by
    /// copying the stored blocks and laying them out in the device planes on the GPU
    /// (`quant_from_blocks`) instead of on the host before a staged copy
    /// (`KIMI_CUDA_PACKED_DEVICE_FILLS`; `0` lays them out on the host, which took 2.7 ms
    /// (2.0 GB/s) for a 4-bit 48B expert on an H100, 2026-12-07).
    pub packed_device_fills: bool,
    /// Quantized weights (Q4Z, Q8Z, F8S; ggml Q4_0, Q4_1, Q8_0, Q4_K) stay packed on the device
    /// and run on the quant GEMV kernels, instead of being widened to bf16 at load
    /// (`KIMI_CUDA_PACKED_QUANT`; `0` widens them). On: `check quant-ops` passed on an H100
    /// (2026-12-06, and with every one-token 4-bit kernel 2026-12-07), and the 48B cut to 16
    /// layers with 4-bit linear layers decodes at 1.02x / 1.14x / 1.42x bf16's tokens/s at
    /// batch 1 / 16 / 64 in 0.40x the memory there (1ebc72e); prefill, which widens each packed
    /// dense matrix per call, is 0.76x. A checkpoint quantized to fit a GPU keeps fitting it,
    /// as in other engines; widened, the 4-bit 48B (21.6 GiB) would need 91.5.
    pub packed_quant_weights: bool,
    /// One-token layers of 4-bit integer experts stream in one launch
    /// (`moe_int4_stream_layer`, with `moe_layer`) instead of the tensor-core
    /// `moe_int4_mma_*` (`KIMI_CUDA_INT4_LAYER`). On: `check quant-ops` passed with it on an
    /// H100 (2026-12-07), where a 4-bit 48B decode step at batch 1 went from 3.75 to 2.40 ms
    /// (43.4 us a layer against 75 us on the tensor-core kernels).
    pub int4_stream_layer: bool,
    /// One-token products of packed 4-bit matrices (Q4Z, Q4_0, Q4_1, Q4_K; widths a multiple
    /// of 256, at most `INT4_STREAM_GEMV_MAX_BYTES`) stream through persistent CTAs
    /// (`quant_gemv_int4_stream_1`) instead of `quant_gemv_*_1` and its K-split reduce, and
    /// two narrow ones (KDA's f_b and g_b) run in one launch (`quant_gemv_narrow_pair`)
    /// (`KIMI_CUDA_INT4_GEMV`). On: `check quant-ops` passed with it on an H100
    /// (2026-12-07), 2.40 to 2.24 ms a 4-bit 48B decode step at batch 1.
    pub int4_stream_gemv: bool,
    /// How MLA latent pools made from now on (`latent_zeros`) store their rows
    /// (`--kv-cache-dtype`): `Auto` / `F32` f32 rows, `Fp8` E4M3 rows with two f32 scales
    /// each (the CPU's layout). The mla op reads each pool by the type it was made with, so
    /// changing this leaves existing pools valid. `F16` is refused (no f16 latent kernels).
    pub kv_cache: kimi_ops::KvCacheDtype,
}

impl Default for KernelConfig {
    fn default() -> Self {
        Self {
            precision: GemmPrecision::Split,
            gemv: GemvKernel::Auto,
            stream_shape: StreamShape::default(),
            kda_chunk: KdaChunkKernel::Auto,
            kda_stages: KdaStages::default(),
            kda_group_chunks: None,
            mla_prefill: MlaPrefillKernel::Auto,
            mla_decode_min_chunk: 64,
            moe_route_one: true,
            moe_stream: true,
            moe_layer: true,
            fused_moe_max_tokens: 56,
            mxfp4_token_tiles: None,
            moe_row_blocks: None,
            grouped_moe: GroupedMoeKernel::Auto,
            cutlass_min_pairs: CutlassMinPairs::default(),
            cuda_graphs: false,
            pdl: true,
            pool_keeps_memory: true,
            graph_arena_mb: 512,
            pin_host_experts: true,
            mxfp4_device_fills: true,
            packed_device_fills: true,
            packed_quant_weights: true,
            int4_stream_layer: true,
            int4_stream_gemv: true,
            kv_cache: kimi_ops::KvCacheDtype::Auto,
        }
    }
}

impl KernelConfig {
    /// Whether activations enter tensor-core products as hi + lo pairs.
    pub(crate) fn split(&self) -> bool {
        self.precision == GemmPrecision::Split
    }

    /// Whether routed experts of `dtype` stay as they are on the device (the backend's
    /// `stores_experts`, and what `kimi-infer plan` sizes them by). MXFP4 experts, and with
    /// packed quantized weights the 4-bit integer ones (Q4Z, Q4_0, Q4_1, Q4_K), stay packed:
    /// the tensor-core and streamed expert kernels read them. Other packed experts (Q8Z,
    /// F8S, Q8_0) are widened to bf16, so that they keep the fused and streamed paths rather
    /// than the per-expert one.
    pub fn keeps_routed_experts(&self, dtype: kimi_core::DType) -> bool {
        use kimi_core::DType;
        matches!(dtype, DType::F32 | DType::BF16 | DType::F16 | DType::MXFP4)
            || (matches!(dtype, DType::Q4Z | DType::Q4_0 | DType::Q4_1 | DType::Q4_K)
                && self.packed_quant_weights)
    }
}
