//! The generation engine: owns a model, per-sequence caches and sampling.
//!
//! [`Engine::generate`] runs one sequence: the prompt is prefilled in chunks of
//! `prefill_chunk` tokens, then tokens are sampled one at a time until a stop token, a stop
//! request from the caller, or `max_tokens`.
//!
//! [`EngineHandle`] serves many requests at once: a thread owns the model and runs steps
//! that batch every running sequence (decode first, then chunked prefill within a token
//! budget), admitting and preempting by MLA cache blocks (`serving`, `scheduler`,
//! `cache_manager`, `runner` and `engine_loop` modules).
#![forbid(unsafe_code)]
#![deny(missing_docs)]

pub mod beam;
mod cache_manager;
mod engine_loop;
mod generate;
mod runner;
pub mod sampling;
mod scheduler;
pub mod serving;
pub mod stop;

pub use engine_loop::ExpertRebalance;
pub use generate::{Engine, FinishReason, Generation};
pub use kimi_model::{OffloadCounts, Placement};
pub use serving::{
    EngineHandle, EngineMetrics, Event, ExpertOffloadMetrics, LogitsProcessor, Request, RequestId,
    ServingConfig, SubmitError,
};

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
