//! The serving engine: many concurrent requests, continuously batched.
//!
//! CONTRACT between the engine loop and the HTTP server (kimi-server). The types and
//! signatures below are fixed; the loop behind them lives in `scheduler.rs` /
//! `cache_manager.rs` / `serving.rs`.
//!
//! A dedicated thread owns the model and runs `step()` repeatedly: schedule (decode first,
//! then chunked prefill within `max_num_batched_tokens`), one batched forward pass over
//! every scheduled sequence, sample, and send [`Event`]s to each request's channel.

use kimi_core::TokenId;

use crate::sampling::{Sampled, SamplingParams};
use crate::FinishReason;

/// Engine-wide limits (validated `serve` flags).
#[derive(Clone, Debug)]
pub struct ServingConfig {
    /// Longest prompt + output a request may have (`--max-model-len`).
    pub max_model_len: usize,
    /// Sequences running at once (`--max-num-seqs`).
    pub max_num_seqs: usize,
    /// Tokens per forward pass (`--max-num-batched-tokens`); prefills are chunked to fit.
    pub max_num_batched_tokens: usize,
    /// Tokens per MLA cache block.
    pub block_size: usize,
    /// MLA cache blocks available (capacity for admission and preemption).
    pub num_blocks: usize,
    /// Requests allowed to wait; more are refused with [`SubmitError::QueueFull`].
    pub max_waiting: usize,
}

/// Constrains decoding (tool calls, JSON schemas): masks logits before sampling and
/// advances on each accepted token.
pub trait LogitsProcessor: Send {
    /// Sets disallowed tokens' logits to `-inf`.
    fn mask(&mut self, logits: &mut [f32]);
    /// Records the sampled token. An error ends the request with that error.
    fn accept(&mut self, token: TokenId) -> Result<(), String>;
    /// True once the constraint is complete and generation must stop.
    fn is_finished(&self) -> bool;
}

/// One generation request.
pub struct Request {
    /// Prompt token ids.
    pub prompt: Vec<TokenId>,
    /// Sampling parameters (already validated by the caller, validated again here).
    pub params: SamplingParams,
    /// End-of-sequence ids (tokenizer's and config's).
    pub eos_ids: Vec<TokenId>,
    /// Optional constraint on the output.
    pub logits_processor: Option<Box<dyn LogitsProcessor>>,
}

/// Identifies a submitted request.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RequestId(pub u64);

/// What the engine reports about a request, in order: `Started` once, `Token`s, then
/// exactly one `Finished` or `Error`.
#[derive(Clone, Debug)]
pub enum Event {
    /// Prefill finished; `queued_secs` is the wait before it was scheduled.
    Started {
        /// Seconds in the waiting queue.
        queued_secs: f64,
    },
    /// A new output token.
    Token(Sampled),
    /// Generation ended normally.
    Finished {
        /// Why.
        reason: FinishReason,
        /// Prompt tokens.
        prompt_tokens: usize,
        /// Output tokens.
        completion_tokens: usize,
    },
    /// The request failed (it is removed and its capacity freed).
    Error(String),
}

/// Why a request was not accepted.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SubmitError {
    /// The request is invalid (empty or over-long prompt, bad sampling values, bad token ids).
    #[error("{0}")]
    Invalid(String),
    /// Too many requests are waiting.
    #[error("the server is overloaded: {0} requests are waiting")]
    QueueFull(usize),
    /// The engine is shutting down.
    #[error("the engine is shutting down")]
    ShuttingDown,
}

/// A point-in-time view for `/metrics`.
#[derive(Clone, Debug, Default)]
pub struct EngineMetrics {
    /// Sequences in the running set.
    pub num_running: usize,
    /// Requests waiting for admission.
    pub num_waiting: usize,
    /// Fraction of MLA cache blocks in use, 0..1.
    pub cache_usage: f64,
    /// Prompt tokens processed since start.
    pub prompt_tokens_total: u64,
    /// Output tokens generated since start.
    pub generation_tokens_total: u64,
    /// Preemptions since start.
    pub num_preemptions_total: u64,
    /// For each layer, how many times each expert was chosen since start (empty for dense layers).
    pub expert_counts: Vec<Vec<u64>>,
}

// The handle (implemented by the engine-loop work; signatures fixed):
//
// pub struct EngineHandle { .. }            // Clone + Send + Sync
// impl EngineHandle {
//     /// Moves the model to a dedicated engine thread and starts the step loop.
//     pub fn spawn<B: Backend + 'static>(model: KimiLinear<B>, config: ServingConfig) -> Result<Self, EngineError>;
//     /// Queues a request; events arrive on the receiver. Dropping the receiver cancels it.
//     pub fn submit(&self, request: Request)
//         -> Result<(RequestId, tokio::sync::mpsc::UnboundedReceiver<Event>), SubmitError>;
//     /// Cancels a request (idempotent); its capacity is freed before the next step.
//     pub fn cancel(&self, id: RequestId);
//     pub fn metrics(&self) -> EngineMetrics;
//     pub fn vocab_size(&self) -> usize;
//     pub fn max_model_len(&self) -> usize;
//     /// Stops accepting requests; `graceful` lets running ones finish, else cancels them.
//     /// Returns once the engine thread has exited.
//     pub fn shutdown(&self, graceful: bool);
// }
