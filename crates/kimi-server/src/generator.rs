//! [`Generator`]: the engine as the server sees it. [`kimi_engine::serving::EngineHandle`]
//! implements it (below); tests may plug in their own.

use kimi_engine::serving::{EngineMetrics, Event, Request, RequestId, SubmitError};
use tokio::sync::mpsc::UnboundedReceiver;

/// What the HTTP layer needs from an engine. Signatures follow `EngineHandle`'s.
pub trait Generator: Send + Sync + 'static {
    /// Queues a request; its events arrive on the receiver. Dropping the receiver cancels it.
    fn submit(
        &self,
        request: Request,
    ) -> Result<(RequestId, UnboundedReceiver<Event>), SubmitError>;
    /// Cancels a request (idempotent).
    fn cancel(&self, id: RequestId);
    /// A point-in-time view for `/metrics`.
    fn metrics(&self) -> EngineMetrics;
    /// Rows of the logits, i.e. the model's vocabulary size.
    fn vocab_size(&self) -> usize;
    /// Longest prompt + output the engine accepts.
    fn max_model_len(&self) -> usize;
}
