//! Kimi model definitions, written once against the [`kimi_ops::Backend`] trait.
//!
//! [`KimiLinear`] loads a checkpoint through `kimi-weights`, uploads it to a backend and runs
//! forward passes over a batch of sequences, each with its own [`SeqCache`] (KDA recurrent and
//! convolution state, MLA latent cache). Nothing here names a device.
#![forbid(unsafe_code)]
#![deny(missing_docs)]

mod cache;
mod kimi_linear;
mod layers;
mod source;
mod summary;

pub use cache::{LayerCache, SeqCache};
pub use kimi_linear::{Batch, ForwardOptions, ForwardOutput, KimiLinear};
pub use source::{RandomWeights, WeightSource};
pub use summary::{ModelSummary, ParamCounts};

/// Errors from loading or running a model.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ModelError {
    /// The checkpoint could not provide a tensor.
    #[error(transparent)]
    Weights(#[from] kimi_weights::WeightsError),
    /// The backend failed.
    #[error(transparent)]
    Backend(#[from] kimi_ops::Error),
    /// The request does not fit the model (bad token id, mismatched caches).
    #[error("{0}")]
    Input(String),
}

/// Result alias of this crate.
pub type Result<T> = std::result::Result<T, ModelError>;
