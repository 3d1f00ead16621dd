//! The CUDA backend of kimi-infer.
//!
//! [`CudaBackend`] implements [`kimi_ops::Backend`] on one GPU with cudarc (driver API,
//! dynamically loaded, so the binary builds and starts without a CUDA toolkit), cuBLAS for
//! the GEMMs and the `sm_90a` kernels that `kimi-cuda-kernels` embeds.
//!
//! Precision: activations, recurrent states and MLA latent caches are f32 on the device;
//! weights keep their checkpoint dtype (bf16, f16 or f32). A GEMM against a bf16/f16 weight
//! runs on the tensor cores with f32 accumulation (cuBLAS `CUBLAS_COMPUTE_32F`); by default
//! (`GemmPrecision::Split`) the activation enters as two 16-bit terms `hi + lo`, which keeps
//! it near f32 accuracy, or with `GemmPrecision::Half` rounded once to the weight's type.
//! f32 weights use a true f32 GEMM. The MoE router always runs in f32. Decode-sized work
//! skips cuBLAS: with `Split`, GEMMs of at most 8 rows against bf16 weights run as an
//! f32-product GEMV kernel, and the routed experts of at most 56 tokens run as fused GEMV
//! kernels over every (token, expert) pair, grouped by expert on the device (bf16 weights
//! read in f32, f32 accumulation), with no host round trip before the experts. MLA's
//! expanded (prefill) attention runs on bf16 tensor cores as well: under `Split` Q, K, V and
//! the probabilities enter as `hi + lo` pairs (three MMAs per product), under `Half` rounded
//! once; softmax and accumulation stay f32.
//!
//! Which kernel each call takes is decided in one place, the planner (`plan.rs`), from the
//! call's shapes and the backend's own [`KernelConfig`] (`CudaBackend::new` reads it from
//! the `KIMI_CUDA_*` variables, `CudaBackend::with_config` takes one): two backends in one
//! process may choose differently.
//!
//! Without the `cuda` feature this crate is a stub: [`CudaBackend::new`] returns
//! [`kimi_ops::Error::Unsupported`], and nothing CUDA is compiled or linked.
//!
//! ```no_run
//! # fn main() -> Result<(), kimi_ops::Error> {
//! let backend = kimi_cuda::CudaBackend::new(0)?; // Unsupported without the `cuda` feature
//! # let _ = backend;
//! # Ok(())
//! # }
//! ```
#![deny(missing_docs)]
#![deny(unsafe_op_in_unsafe_fn)]

mod error;
pub use error::Error;
mod kernel_list;
mod layout;
mod quant_layout;

#[cfg(feature = "cuda")]
mod backend;
#[cfg(feature = "cuda")]
mod buffer;
#[cfg(feature = "cuda")]
mod device;
#[cfg(feature = "cuda")]
mod graph;
#[cfg(feature = "cuda")]
mod host_lock;
#[cfg(feature = "cuda")]
mod ops;
// Without the `cuda` feature only the tests call the planners.
#[cfg_attr(not(feature = "cuda"), allow(dead_code, unused_imports))]
mod plan;
#[cfg(feature = "cuda")]
mod tensor;

#[cfg(feature = "cuda")]
pub use backend::{nccl_version, CudaBackend, NcclComm, NcclId};
pub use plan::{
    CutlassMinPairs, EnvVarError, GemmPrecision, GemvKernel, GroupedMoeKernel, KdaChunkKernel,
    KdaStages, KernelConfig, MlaPrefillKernel, StreamShape,
};
#[cfg(feature = "cuda")]
pub use tensor::CudaTensor;

/// Stand-in for the CUDA backend in builds without the `cuda` feature.
#[cfg(not(feature = "cuda"))]
#[derive(Debug)]
pub struct CudaBackend {
    _private: (),
}

#[cfg(not(feature = "cuda"))]
impl CudaBackend {
    /// Always fails: this build has no CUDA support.
    pub fn new(ordinal: usize) -> kimi_ops::Result<Self> {
        Self::with_config(ordinal, KernelConfig::default())
    }

    /// Always fails: this build has no CUDA support.
    pub fn with_config(_ordinal: usize, _config: KernelConfig) -> kimi_ops::Result<Self> {
        Err(kimi_ops::Error::Unsupported(
            "CUDA (this build lacks the `cuda` feature of kimi-cuda)".into(),
        ))
    }
}
