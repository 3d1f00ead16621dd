//! One access-log event per request (target `kimi_server::access`), written when the
//! response body ends, so a stream's line carries its final token counts and duration:
//! method, path, status, latency, prompt and completion tokens, request id, API key name
//! (`key-N` for the N-th `--api-key`, else the name from the key file; never the key),
//! client address, and for an error its message. Requests get an `x-request-id` (the client's, if it sent a sane one)
//! echoed in the response. 2xx–4xx log at info, 5xx at warn; `/health` and `/metrics`
//! (probes and scrapes) at debug.

use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::task::{Context, Poll};
use std::time::Instant;

use axum::body::{Body, Bytes};
use axum::extract::{ConnectInfo, Request, State};
use axum::http::{HeaderValue, StatusCode};
use axum::middleware::Next;
use axum::response::Response;
use http_body::{Body as _, Frame};

use crate::state::AppState;

const REQUEST_ID: &str = "x-request-id";

/// What a request's handlers report for its log line; shared through the request's
/// extensions.
#[derive(Debug, Default)]
pub(crate) struct RequestRecord {
    pub prompt_tokens: AtomicUsize,
    pub completion_tokens: AtomicUsize,
    /// The name of the API key that authenticated the request.
    pub key: OnceLock<String>,
}

/// An error response's message, left in the response's extensions for the log.
#[derive(Clone, Debug)]
pub struct ErrorMessage(pub String);

/// A client-sent request id, if it is short printable ASCII (it goes into logs as is).
fn client_request_id(value: Option<&HeaderValue>) -> Option<String> {
    let text = value?.to_str().ok()?;
    let sane = !text.is_empty() && text.len() <= 128 && text.bytes().all(|b| b.is_ascii_graphic());
    sane.then(|| text.to_string())
}

/// The middleware (outermost, so that it times and logs every response).
pub(crate) async fn access_log(
    State(state): State<AppState>,
    mut request: Request,
    next: Next,
) -> Response {
    let started = Instant::now();
    let method = request.method().clone();
    let path = request.uri().path().to_owned();
    let client = request
        .extensions()
        .get::<ConnectInfo<SocketAddr>>()
        .map(|c| c.0);
    let id = client_request_id(request.headers().get(REQUEST_ID))
        .unwrap_or_else(|| state.inner.response_id("req"));
    let record = Arc::new(RequestRecord::default());
    request.extensions_mut().insert(Arc::clone(&record));
    let mut response = next.run(request).await;
    let status = response.status();
    if status.is_client_error() || status.is_server_error() {
        state.inner.metrics.record_error(status.as_u16());
    }
    if let Ok(value) = HeaderValue::from_str(&id) {
        response.headers_mut().insert(REQUEST_ID, value);
    }
    let entry = Entry {
        started,
        method: method.to_string(),
        path,
        status,
        id,
        client,
        record,
        error: response.extensions().get::<ErrorMessage>().cloned(),
        num_keys: state.inner.keys.len(),
    };
    response.map(|body| logged_body(body, entry))
}

/// What the line says, kept until the body is done.
struct Entry {
    started: Instant,
    method: String,
    path: String,
    status: StatusCode,
    id: String,
    client: Option<SocketAddr>,
    record: Arc<RequestRecord>,
    error: Option<ErrorMessage>,
    num_keys: usize,
}

impl Entry {
    fn write(self, complete: bool) {
        // Tenths of a millisecond: a number in JSON logs, short in text ones.
        let latency_ms = (self.started.elapsed().as_secs_f64() * 1e4).round() / 10.0;
        let key = match self.record.key.get() {
            Some(name) => name.as_str(),
            None if self.num_keys == 0 => "none",
            None => "-",
        };
        let client = self.client.map_or_else(|| "-".into(), |c| c.to_string());
        let error = self.error.map(|e| e.0).unwrap_or_default();
        let prompt_tokens = self.record.prompt_tokens.load(Ordering::Relaxed);
        let completion_tokens = self.record.completion_tokens.load(Ordering::Relaxed);
        let status = self.status.as_u16();
        // The client went away (or the server cut it) before the body's end.
        let aborted = !complete;
        macro_rules! line {
            ($level:ident) => {
                tracing::$level!(
                    target: "kimi_server::access",
                    method = %self.method,
                    path = %self.path,
                    status,
                    latency_ms,
                    prompt_tokens,
                    completion_tokens,
                    request_id = %self.id,
                    key = %key,
                    client = %client,
                    aborted,
                    error = %error,
                    "request"
                )
            };
        }
        if self.status.is_server_error() {
            line!(warn);
        } else if matches!(self.path.as_str(), "/health" | "/metrics") {
            line!(debug);
        } else {
            line!(info);
        }
    }
}

/// An access-log line kept until its response body is done ([`logged_body`]).
pub trait AccessLine: Send + Unpin + 'static {
    /// Writes the line; `complete` says whether the whole body was sent.
    fn write(self, complete: bool);
}

impl AccessLine for Entry {
    fn write(self, complete: bool) {
        Entry::write(self, complete)
    }
}

/// `body`, writing `line` when it ends or is dropped (a client that leaves mid-stream
/// drops it: the line then says the body was not complete).
pub fn logged_body<L: AccessLine>(body: Body, line: L) -> Body {
    Body::new(LoggedBody {
        inner: body,
        entry: Some(line),
        complete: false,
    })
}

struct LoggedBody<L: AccessLine> {
    inner: Body,
    entry: Option<L>,
    complete: bool,
}

impl<L: AccessLine> http_body::Body for LoggedBody<L> {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        let polled = Pin::new(&mut self.inner).poll_frame(cx);
        if let Poll::Ready(None) = polled {
            self.complete = true;
            if let Some(entry) = self.entry.take() {
                entry.write(true);
            }
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

impl<L: AccessLine> Drop for LoggedBody<L> {
    fn drop(&mut self) {
        if let Some(entry) = self.entry.take() {
            // A body whose end hyper knew from its size is never polled to `None`.
            let complete = self.complete || self.inner.is_end_stream();
            entry.write(complete);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_sane_client_ids_are_kept() {
        let id = |s: &'static str| client_request_id(Some(&HeaderValue::from_static(s)));
        assert_eq!(id("abc-123").as_deref(), Some("abc-123"));
        assert_eq!(id("has space"), None);
        assert_eq!(id(""), None);
        assert_eq!(client_request_id(None), None);
        let long = "x".repeat(200);
        let value = HeaderValue::from_str(&long).expect("ASCII");
        assert_eq!(client_request_id(Some(&value)), None);
    }
}
