//! Plain types shared by every kimi-infer crate.
//!
//! `kimi-core` holds no I/O beyond serde: element types ([`DType`]), the validated model
//! configuration ([`config::ModelConfig`]) parsed from Hugging Face `config.json` files of
//! either schema, and the error type used for configuration problems.
#![forbid(unsafe_code)]
#![deny(missing_docs)]

pub mod config;
mod dtype;
pub mod qblocks;

pub use config::{ConfigError, ModelConfig};
pub use dtype::DType;

/// A token id in a model's vocabulary.
pub type TokenId = u32;
