//! The generation engine: owns a model, per-sequence caches and sampling.
//!
//! [`Engine::generate`] runs one sequence: the prompt is prefilled in chunks of
//! `prefill_chunk` tokens, then tokens are sampled one at a time until a stop token, a stop
//! request from the caller, or `max_tokens`.
#![forbid(unsafe_code)]
#![deny(missing_docs)]

mod generate;
pub mod sampling;
pub mod serving;
pub mod stop;

pub use generate::{Engine, FinishReason, Generation};

/// Errors of the engine.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum EngineError {
    /// The model failed.
    #[error(transparent)]
    Model(#[from] kimi_model::ModelError),
    /// The request cannot be served as given.
    #[error("{0}")]
    Request(String),
}

/// Result alias of this crate.
pub type Result<T> = std::result::Result<T, EngineError>;
