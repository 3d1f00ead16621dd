//! Launchers: one module per kernel family (`kernels/<family>.cu`). Each takes raw device
//! addresses, sizes and the [`Device`](crate::device::Device) whose stream it launches on;
//! the safe checks (shape, dtype, device) happen in `backend.rs` before these are called.

pub(crate) mod attn_res;
pub(crate) mod conv;
pub(crate) mod elementwise;
pub(crate) mod expert_mma;
pub(crate) mod gemm;
pub(crate) mod kda;
pub(crate) mod mla;
pub(crate) mod mla_fp8;
pub(crate) mod moe;
pub(crate) mod mxfp4;
pub(crate) mod quant;
