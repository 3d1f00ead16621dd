//! Model definitions, written once against the [`kimi_ops::Backend`] trait.
//!
//! [`KimiLinear`] loads a checkpoint through `kimi-weights`, uploads it to a backend and runs
//! forward passes over a batch of sequences, each a [`SeqCache`] (block table and state slot)
//! into a shared [`CachePool`] (KDA recurrent and convolution state slots, paged MLA latent
//! cache). [`Llama`] does the same for Llama-architecture GGUF files (the SmolLM2 demo
//! model) with a paged key/value cache. Both implement [`CausalLm`], the
//! interface generation drives. [`ModelSummary`] sizes a model from its config alone and
//! [`plan`] places it on a machine and bounds its decode speed. Nothing here names a device.
#![forbid(unsafe_code)]
#![deny(missing_docs)]

mod cache;
mod ffn;
mod forward;
pub mod gguf_kimi;
mod kimi_linear;
mod layers;
mod llama;
pub mod llama_hf;
mod native_names;
pub mod parallel;
pub mod plan;
pub mod quantized;
pub mod registry;
mod source;
mod summary;

use std::path::PathBuf;

pub use cache::{CachePool, LayerPool, LayerSpec, SeqCache};
pub use ffn::routed_expert_bytes;
pub use forward::{Batch, CausalLm, ForwardOptions, ForwardOutput, RowPicks, SINGLE_BLOCK_SIZE};
pub use kimi_linear::KimiLinear;
pub use kimi_ops::offload::{ExpertOffload, OffloadAmount, OffloadCounts, Placement};
pub use llama::{Llama, LlamaConfig};
pub use native_names::{CheckpointLayout, CheckpointSource};
pub use registry::{Architecture, LoadedModel};
pub use source::{RandomWeights, SkewedRouting, WeightSource, WeightsReopener, WithSource};
pub use summary::{Component, ComponentSize, ModelSummary, ParamCounts, CACHE_BYTES, STATE_BYTES};

/// Errors from loading or running a model.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ModelError {
    /// The checkpoint could not provide a tensor.
    #[error(transparent)]
    Weights(#[from] kimi_weights::WeightsError),
    /// A GGUF file could not be read.
    #[error(transparent)]
    Gguf(#[from] kimi_gguf::GgufError),
    /// A model file is readable but not a model this crate can run (wrong architecture,
    /// missing metadata, unexpected tensor shapes or types, unused tensors).
    #[error("{}: {reason}", path.display())]
    Format {
        /// The file.
        path: PathBuf,
        /// What does not fit.
        reason: String,
    },
    /// A tensor that transformers stores under another name (or inside a fused tensor)
    /// could not be read from there.
    #[error("`{hub}` is read from `{stored}` in {layout}: {source}")]
    Stored {
        /// The hub name the model asked for.
        hub: String,
        /// The stored tensor that holds it.
        stored: String,
        /// The checkpoint's layout, in words.
        layout: String,
        /// What went wrong reading the stored tensor (boxed: keeps `Result`s small).
        source: Box<kimi_weights::WeightsError>,
    },
    /// The backend failed.
    #[error(transparent)]
    Backend(#[from] kimi_ops::Error),
    /// The request does not fit the model (bad token id, mismatched caches).
    #[error("{0}")]
    Input(String),
}

/// Result alias of this crate.
pub type Result<T> = std::result::Result<T, ModelError>;

/// How a model is loaded beyond its files.
#[derive(Clone, Debug, Default)]
pub struct LoadOptions {
    /// Routed experts in tiers (host memory, device cache slots); `None`: all in the
    /// backend's memory.
    pub offload: Option<ExpertOffload>,
    /// This rank's part of a model split over several ranks ([`parallel`]); the default is
    /// the whole model.
    pub shard: parallel::Shard,
    /// Which rank holds which experts under expert parallelism (`None`: contiguous runs of
    /// ids).
    pub expert_placement: Option<std::sync::Arc<parallel::ExpertPlacement>>,
    /// How expert parallelism combines the routed experts' outputs (all-reduce, or token
    /// dispatch by all-to-all).
    pub expert_dispatch: parallel::ExpertDispatch,
    /// The weights again, for the experts a rank takes on when the placement changes
    /// (`None`: the placement stays as loaded).
    pub reopen: Option<WeightsReopener>,
}
