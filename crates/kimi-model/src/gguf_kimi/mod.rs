//! Kimi Linear and Kimi K3 in llama.cpp's GGUF layouts (`general.architecture = kimi-linear`
//! or `kimi-k3`).
//!
//! * [`config_from_gguf`] + [`KimiGguf`]: read a file written by llama.cpp's
//!   `convert_hf_to_gguf.py` (or by [`plan_export`]) as hub-named tensors, so
//!   [`crate::KimiLinear::load_gguf`] is the checkpoint loader over another source.
//! * [`plan_export`]: write such a file from any [`crate::WeightSource`] (`kimi-infer convert`).
//!
//! `recipes.rs` is the single name/shape/layout table both directions use.

mod config;
mod export;
mod quant_plan;
mod recipes;
mod source;

pub use config::{config_from_gguf, ExtraHparams, ARCH, ARCH_K3};
pub use export::{plan_export, ExportOptions, ExportPlan, PlannedTensor};
pub use quant_plan::GgufQuant;
pub use source::KimiGguf;
