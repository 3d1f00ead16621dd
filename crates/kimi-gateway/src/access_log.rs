//! One access-log event per request (target `kimi_gateway::access`), written when the
//! response body ends, with the fields of `kimi-infer serve`'s lines (method, path, status,
//! latency, tokens, request id, key name, client, aborted, error) and the gateway's own:
//! the upstream that answered, the attempts it took and what the cache did. Requests get an
//! `x-request-id` (the client's, if it sent a sane one), passed upstream and echoed in the
//! response. 2xx–4xx log at info, 5xx at warn, `/health` and `/metrics` at debug.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock, PoisonError};
use std::time::Instant;

use axum::extract::{ConnectInfo, Request, State};
use axum::http::{HeaderValue, StatusCode};
use axum::middleware::Next;
use axum::response::Response;

use crate::Gateway;

pub(crate) const REQUEST_ID: &str = "x-request-id";

/// What a request's handlers report for its log line; shared through its extensions.
#[derive(Debug, Default)]
pub(crate) struct Record {
    pub id: String,
    pub prompt_tokens: AtomicUsize,
    pub completion_tokens: AtomicUsize,
    pub key: OnceLock<String>,
    /// The upstream of the last attempt.
    pub upstream: Mutex<Option<String>>,
    pub attempts: AtomicUsize,
    /// `hit`, `miss`, `bypass` (when the cache is on).
    pub cache: OnceLock<&'static str>,
    /// The message of an error the gateway answered or streamed.
    pub error: Mutex<Option<String>>,
}

impl Record {
    pub fn set_upstream(&self, url: &str) {
        *self.upstream.lock().unwrap_or_else(PoisonError::into_inner) = Some(url.to_string());
    }

    pub fn set_error(&self, message: &str) {
        *self.error.lock().unwrap_or_else(PoisonError::into_inner) = Some(message.to_string());
    }
}

/// A client-sent request id, if it is short printable ASCII (it goes into logs as is).
fn client_request_id(value: Option<&HeaderValue>) -> Option<String> {
    let text = value?.to_str().ok()?;
    let sane = !text.is_empty() && text.len() <= 128 && text.bytes().all(|b| b.is_ascii_graphic());
    sane.then(|| text.to_string())
}

/// The middleware (outermost, so that it times and logs every response).
pub(crate) async fn access_log(
    State(gateway): State<Gateway>,
    mut request: Request,
    next: Next,
) -> Response {
    let started = Instant::now();
    let method = request.method().to_string();
    let path = request.uri().path().to_owned();
    let client = request
        .extensions()
        .get::<ConnectInfo<SocketAddr>>()
        .map(|c| c.0);
    let id = client_request_id(request.headers().get(REQUEST_ID))
        .unwrap_or_else(|| gateway.shared.request_id());
    let record = Arc::new(Record {
        id: id.clone(),
        ..Record::default()
    });
    request.extensions_mut().insert(Arc::clone(&record));
    let mut response = next.run(request).await;
    let status = response.status();
    if status.is_client_error() || status.is_server_error() {
        gateway.shared.metrics.record_error(status.as_u16());
    }
    if let Ok(value) = HeaderValue::from_str(&id) {
        response.headers_mut().insert(REQUEST_ID, value);
    }
    let error = response
        .extensions()
        .get::<kimi_server::ErrorMessage>()
        .map(|e| e.0.clone());
    if let Some(error) = error {
        record.set_error(&error);
    }
    let entry = Entry {
        started,
        method,
        path,
        status,
        client,
        record,
        keys: !gateway.shared.keys.is_empty(),
    };
    response.map(|body| kimi_server::logged_body(body, entry))
}

/// What the line says, kept until the body is done.
struct Entry {
    started: Instant,
    method: String,
    path: String,
    status: StatusCode,
    client: Option<SocketAddr>,
    record: Arc<Record>,
    keys: bool,
}

impl kimi_server::AccessLine for Entry {
    fn write(self, complete: bool) {
        let latency_ms = (self.started.elapsed().as_secs_f64() * 1e4).round() / 10.0;
        let r = &self.record;
        let key = match r.key.get() {
            Some(name) => name.as_str(),
            None if !self.keys => "none",
            None => "-",
        };
        let client = self.client.map_or_else(|| "-".into(), |c| c.to_string());
        let error = r
            .error
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
            .unwrap_or_default();
        let upstream = r
            .upstream
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
            .unwrap_or_else(|| "-".into());
        let prompt_tokens = r.prompt_tokens.load(Ordering::Relaxed);
        let completion_tokens = r.completion_tokens.load(Ordering::Relaxed);
        let attempts = r.attempts.load(Ordering::Relaxed);
        let cache = r.cache.get().copied().unwrap_or("-");
        let status = self.status.as_u16();
        let aborted = !complete;
        macro_rules! line {
            ($level:ident) => {
                tracing::$level!(
                    target: "kimi_gateway::access",
                    method = %self.method,
                    path = %self.path,
                    status,
                    latency_ms,
                    prompt_tokens,
                    completion_tokens,
                    request_id = %r.id,
                    key = %key,
                    client = %client,
                    upstream = %upstream,
                    attempts,
                    cache,
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
