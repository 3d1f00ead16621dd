//! [`Generator`] for the engine loop's [`EngineHandle`] (the one place that names it).

use kimi_engine::serving::{EngineMetrics, Event, Request, RequestId, SubmitError};
use kimi_engine::EngineHandle;
use tokio::sync::mpsc::UnboundedReceiver;

use crate::generator::Generator;

impl Generator for EngineHandle {
    fn submit(
        &self,
        request: Request,
    ) -> Result<(RequestId, UnboundedReceiver<Event>), SubmitError> {
        EngineHandle::submit(self, request)
    }

    fn cancel(&self, id: RequestId) {
        EngineHandle::cancel(self, id);
    }

    fn metrics(&self) -> EngineMetrics {
        EngineHandle::metrics(self)
    }

    fn vocab_size(&self) -> usize {
        EngineHandle::vocab_size(self)
    }

    fn max_model_len(&self) -> usize {
        EngineHandle::max_model_len(self)
    }
}
