//! API keys: `Authorization: Bearer <key>`, compared in constant time against every key
//! ([`crate::keys::KeySet`]); then the per-key limits of the generation routes.

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use axum::body::{Body, Bytes};
use axum::extract::{Request, State};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use http_body::Frame;

use crate::access_log::RequestRecord;
use crate::error::ApiError;
use crate::keys::{ApiKey, KeyLimits};
use crate::limits::Lease;
use crate::state::AppState;

/// The key that authenticated a request, in its extensions.
#[derive(Clone, Debug)]
pub(crate) struct AuthenticatedKey(pub ApiKey);

/// Rejects requests without a valid key (when keys are configured).
pub(crate) async fn require_api_key(
    State(state): State<AppState>,
    mut request: Request,
    next: Next,
) -> Response {
    let keys = &state.inner.keys;
    if keys.is_empty() {
        return next.run(request).await;
    }
    match keys.authenticate(request.headers()) {
        Some(key) => {
            // The access log names the key, never shows its text.
            if let Some(record) = request.extensions().get::<Arc<RequestRecord>>() {
                let _ = record.key.set(key.name.clone());
            }
            let key = AuthenticatedKey(key.clone());
            request.extensions_mut().insert(key);
            next.run(request).await
        }
        None => ApiError::unauthorized().into_response(),
    }
}

/// Applies the per-key limits (`config.limiter`): a refused request gets 429 with
/// `Retry-After`; an admitted one holds its lease until its response body ends, when its
/// prompt and completion tokens are charged.
pub(crate) async fn limit_requests(
    State(state): State<AppState>,
    request: Request,
    next: Next,
) -> Response {
    let Some(limiter) = &state.inner.config.limiter else {
        return next.run(request).await;
    };
    let (name, own) = match request.extensions().get::<AuthenticatedKey>() {
        Some(AuthenticatedKey(key)) => (key.name.clone(), key.limits),
        None => ("anonymous".to_string(), KeyLimits::default()),
    };
    let lease = match limiter.admit(&name, own).await {
        Ok(lease) => lease,
        Err(refusal) => return refusal.into_response(),
    };
    let record = request.extensions().get::<Arc<RequestRecord>>().cloned();
    let response = next.run(request).await;
    response.map(|inner| {
        Body::new(LeasedBody {
            inner,
            lease: Some(lease),
            record,
        })
    })
}

/// A response body that ends its lease (charging the request's tokens) when it ends or is
/// dropped.
struct LeasedBody {
    inner: Body,
    lease: Option<Lease>,
    record: Option<Arc<RequestRecord>>,
}

impl LeasedBody {
    fn finish(&mut self) {
        if let Some(mut lease) = self.lease.take() {
            if let Some(record) = &self.record {
                use std::sync::atomic::Ordering::Relaxed;
                let tokens =
                    record.prompt_tokens.load(Relaxed) + record.completion_tokens.load(Relaxed);
                lease.add_tokens(tokens as u64);
            }
        }
    }
}

impl http_body::Body for LeasedBody {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        let polled = Pin::new(&mut self.inner).poll_frame(cx);
        if let Poll::Ready(None) = polled {
            self.finish();
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

impl Drop for LeasedBody {
    fn drop(&mut self) {
        self.finish();
    }
}
