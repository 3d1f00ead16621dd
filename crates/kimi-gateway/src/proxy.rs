//! Sending a request upstream: picking an upstream, the attempt and its retries, JSON
//! answers, and requests passed on as is.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use axum::body::{Body, Bytes};
use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, HeaderName, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Extension;
use futures_util::StreamExt;
use kimi_server::keys::KeyLimits;
use kimi_server::limits::Lease;
use kimi_server::ApiError;
use serde_json::Value;

use crate::access_log::{Record, REQUEST_ID};
use crate::cache::{self, Entry, Kind, Policy};
use crate::request::{authenticate, parse_object, read_body, Prepared};
use crate::upstream::{describe, InFlight, NoUpstream, Upstream};
use crate::{relay, Gateway, Shared};

/// Says which upstream answered.
pub(crate) const UPSTREAM_HEADER: &str = "x-kimi-upstream";
/// Says what the cache did: `hit`, `miss` or `bypass`.
pub(crate) const CACHE_HEADER: &str = "x-kimi-cache";
/// The largest JSON answer read from an upstream.
const MAX_RESPONSE_BYTES: usize = 64 << 20;

/// An answer read whole.
pub(crate) struct Buffered {
    pub status: StatusCode,
    pub content_type: Option<HeaderValue>,
    pub retry_after: Option<HeaderValue>,
    pub body: Bytes,
    pub upstream: String,
}

impl Buffered {
    pub fn into_response(self) -> Response {
        let mut response = (self.status, self.body).into_response();
        let headers = response.headers_mut();
        if let Some(v) = self.content_type {
            headers.insert(header::CONTENT_TYPE, v);
        }
        if let Some(v) = self.retry_after {
            headers.insert(header::RETRY_AFTER, v);
        }
        if let Ok(v) = HeaderValue::from_str(&self.upstream) {
            headers.insert(UPSTREAM_HEADER, v);
        }
        response
    }
}

/// A request sent upstream whose response head came back.
pub(crate) struct Attempt {
    pub index: usize,
    pub upstream: Arc<Upstream>,
    pub response: reqwest::Response,
    pub in_flight: InFlight,
}

impl Attempt {
    pub fn is_event_stream(&self) -> bool {
        self.response
            .headers()
            .get(header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v.starts_with("text/event-stream"))
    }
}

/// Where a request stands among the upstreams.
#[derive(Default)]
pub(crate) struct Route {
    pub tried: Vec<usize>,
    /// The last retryable error answer, returned when no upstream is left.
    last: Option<Buffered>,
    /// The last failure without an answer.
    last_error: Option<String>,
}

/// 502 (or 504 after a timeout): the upstreams failed.
pub(crate) fn upstream_failed(message: String, timeout: bool) -> ApiError {
    ApiError {
        status: if timeout {
            StatusCode::GATEWAY_TIMEOUT
        } else {
            StatusCode::BAD_GATEWAY
        },
        message,
        kind: "server_error",
        param: None,
        code: Some("upstream_failed"),
    }
}

fn retryable(status: StatusCode) -> bool {
    matches!(status.as_u16(), 429 | 502 | 503 | 504)
}

enum SendFailure {
    /// No answer: the connection failed or broke (the upstream is ejected).
    Broken(String),
    /// No response head within `upstream_timeout`.
    Timeout,
    /// The upstream was ejected while this request waited.
    Ejected,
}

/// Sends `prepared` to upstreams until one answers with a status that is not retryable,
/// trying at most `1 + max_retries` of them. `Err` is the response for the client.
pub(crate) async fn connect(
    shared: &Shared,
    prepared: &Prepared,
    record: &Record,
    route: &mut Route,
) -> Result<Attempt, Response> {
    let config = &shared.config;
    loop {
        let first = route.tried.is_empty();
        let affine = (first && !prepared.chain.is_empty())
            .then(|| shared.affinity.lookup(&prepared.chain))
            .flatten();
        let (index, took_affine) = match pick(shared, prepared, affine, route).await {
            Ok(choice) => choice,
            Err(response) => return Err(response),
        };
        if first && !prepared.chain.is_empty() {
            let m = &shared.metrics;
            let counter = match (affine, took_affine) {
                (None, _) => &m.affinity_misses,
                (Some(_), true) => &m.affinity_hits,
                (Some(_), false) => &m.affinity_overridden,
            };
            counter.fetch_add(1, Ordering::Relaxed);
        }
        if !first {
            shared.metrics.retries.fetch_add(1, Ordering::Relaxed);
        }
        route.tried.push(index);
        record.attempts.store(route.tried.len(), Ordering::Relaxed);
        let upstream = Arc::clone(&shared.pool.upstreams[index]);
        record.set_upstream(&upstream.url);
        let in_flight = InFlight::new(&upstream);
        let started = Instant::now();
        let failure = match send(shared, &upstream, prepared).await {
            Ok(response) => {
                let status = response.status();
                upstream
                    .metrics
                    .first_byte
                    .observe(started.elapsed().as_secs_f64());
                upstream.metrics.status(status.as_u16());
                if !retryable(status) {
                    return Ok(Attempt {
                        index,
                        upstream,
                        response,
                        in_flight,
                    });
                }
                upstream.metrics.error("status");
                let answer = buffer(response, &upstream).await;
                route.last_error = Some(format!("{} answered {status}", upstream.url));
                route.last = answer.ok();
                None
            }
            Err(SendFailure::Broken(message)) => {
                upstream.metrics.error("connect");
                shared.pool.eject(index, &message);
                Some((format!("{}: {message}", upstream.url), false))
            }
            Err(SendFailure::Timeout) => {
                upstream.metrics.error("timeout");
                Some((format!("{} sent no response in time", upstream.url), true))
            }
            Err(SendFailure::Ejected) => {
                upstream.metrics.error("ejected");
                Some((format!("{} was ejected", upstream.url), false))
            }
        };
        drop(in_flight);
        if let Some((message, _)) = &failure {
            route.last_error = Some(message.clone());
            route.last = None;
        }
        if route.tried.len() > config.max_retries {
            return Err(exhausted(route, failure.is_some_and(|(_, t)| t)));
        }
    }
}

/// The answer when no attempt is left: the last upstream error answer, else a 502/504.
fn exhausted(route: &mut Route, timeout: bool) -> Response {
    if let Some(last) = route.last.take() {
        return last.into_response();
    }
    let detail = route.last_error.take().unwrap_or_default();
    upstream_failed(
        format!(
            "No upstream could answer ({} tried): {detail}",
            route.tried.len()
        ),
        timeout,
    )
    .into_response()
}

/// An upstream for the next attempt, waiting up to `queue_timeout` for a healthy one when
/// none is.
async fn pick(
    shared: &Shared,
    prepared: &Prepared,
    affine: Option<usize>,
    route: &mut Route,
) -> Result<(usize, bool), Response> {
    let pool = &shared.pool;
    let slack = shared.config.affinity_slack;
    let model = prepared.model.as_deref();
    let deadline = tokio::time::Instant::now() + shared.config.queue_timeout;
    loop {
        let notified = pool.changed.notified();
        tokio::pin!(notified);
        notified.as_mut().enable();
        match pool.choose(model, affine, slack, &route.tried) {
            Ok(choice) => return Ok(choice),
            Err(NoUpstream::UnknownModel) => {
                return Err(ApiError::model_not_found(model.unwrap_or("")).into_response())
            }
            Err(NoUpstream::Unavailable) if !route.tried.is_empty() => {
                return Err(exhausted(route, false));
            }
            Err(NoUpstream::Unavailable) => {}
        }
        pool.waiting.fetch_add(1, Ordering::Relaxed);
        let woken = tokio::time::timeout_at(deadline, notified).await;
        pool.waiting.fetch_sub(1, Ordering::Relaxed);
        if woken.is_err() {
            let mut response = ApiError::unavailable(format!(
                "No healthy upstream{} (waited {}s)",
                model.map_or(String::new(), |m| format!(" serves `{m}`")),
                shared.config.queue_timeout.as_secs_f64()
            ))
            .code("no_healthy_upstream")
            .into_response();
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
            return Err(response);
        }
    }
}

/// One request to one upstream, until its response head (or its ejection).
async fn send(
    shared: &Shared,
    upstream: &Upstream,
    prepared: &Prepared,
) -> Result<reqwest::Response, SendFailure> {
    let url = format!("{}{}", upstream.url, prepared.path);
    let mut builder = shared
        .client
        .request(prepared.method.clone(), url)
        .header(REQUEST_ID, prepared.request_id.as_str())
        .body(prepared.body.clone());
    for (name, value) in [
        (header::CONTENT_TYPE, &prepared.content_type),
        (header::ACCEPT, &prepared.accept),
        (header::AUTHORIZATION, &prepared.authorization),
    ] {
        if let Some(value) = value {
            builder = builder.header(name, value.clone());
        }
    }
    let sent = async {
        match shared.config.upstream_timeout {
            Some(limit) => tokio::time::timeout(limit, builder.send())
                .await
                .map_err(|_| SendFailure::Timeout)?,
            None => builder.send().await,
        }
        .map_err(|e| {
            if e.is_timeout() {
                SendFailure::Timeout
            } else {
                SendFailure::Broken(describe(&e))
            }
        })
    };
    tokio::select! {
        result = sent => result,
        () = upstream.ejected() => Err(SendFailure::Ejected),
    }
}

/// Reads a whole answer (bounded), or says why it broke off.
async fn buffer(response: reqwest::Response, upstream: &Upstream) -> Result<Buffered, String> {
    let status = response.status();
    let headers = response.headers().clone();
    let mut body = Vec::new();
    let mut chunks = response.bytes_stream();
    let ejected = upstream.ejected();
    tokio::pin!(ejected);
    loop {
        tokio::select! {
            chunk = chunks.next() => match chunk {
                Some(Ok(bytes)) => {
                    if body.len() + bytes.len() > MAX_RESPONSE_BYTES {
                        return Err(format!("the answer is larger than {MAX_RESPONSE_BYTES} bytes"));
                    }
                    body.extend_from_slice(&bytes);
                }
                Some(Err(e)) => return Err(format!("the answer broke off: {}", describe(&e))),
                None => break,
            },
            () = &mut ejected => return Err("the upstream was ejected".into()),
        }
    }
    Ok(Buffered {
        status,
        content_type: headers.get(header::CONTENT_TYPE).cloned(),
        retry_after: headers.get(header::RETRY_AFTER).cloned(),
        body: Bytes::from(body),
        upstream: upstream.url.clone(),
    })
}

/// `POST /v1/chat/completions` and `/v1/completions`.
pub(crate) async fn generation(
    State(gateway): State<Gateway>,
    Extension(record): Extension<Arc<Record>>,
    request: Request,
) -> Response {
    let shared = &gateway.shared;
    let key = match authenticate(shared, request.headers(), &record) {
        Ok(key) => key,
        Err(err) => return err.into_response(),
    };
    let key_name = key.as_ref().map_or("anonymous", |k| k.name.as_str());
    let lease = match &shared.config.limiter {
        Some(limiter) => {
            let own = key.as_ref().map_or(KeyLimits::default(), |k| k.limits);
            match limiter.admit(key_name, own).await {
                Ok(lease) => Some(lease),
                Err(refusal) => return refusal.into_response(),
            }
        }
        None => None,
    };
    let (parts, body) = match read_body(shared, request, true).await {
        Ok(read) => read,
        Err(response) => return response,
    };
    let json = match parse_object(&body) {
        Ok(json) => json,
        Err(err) => return err.into_response(),
    };
    let path = parts.uri.path();
    let policy = shared
        .config
        .cache
        .as_ref()
        .map(|c| (c, cache::policy(key_name, path, &json, &parts.headers)));
    let stream = json.get("stream").and_then(Value::as_bool) == Some(true);
    let mut cache_key = None;
    match &policy {
        Some((cache, Policy::Use { key, lookup })) => {
            if *lookup {
                if let Some(entry) = cache.get(key).await {
                    let _ = record.cache.set("hit");
                    return replay(entry);
                }
            }
            let _ = record.cache.set("miss");
            cache_key = Some(key.clone());
        }
        Some((cache, Policy::Bypass)) => {
            cache.bypassed();
            let _ = record.cache.set("bypass");
        }
        None => {}
    }
    let prepared = Arc::new(Prepared::generation(shared, &parts, body, &json, &record));
    let mut route = Route::default();
    let mut response = if stream {
        match connect(shared, &prepared, &record, &mut route).await {
            Ok(attempt) if attempt.is_event_stream() && attempt.response.status().is_success() => {
                shared.affinity.record(&prepared.chain, attempt.index);
                let job = relay::Job {
                    gateway: gateway.clone(),
                    prepared: Arc::clone(&prepared),
                    record: Arc::clone(&record),
                    lease,
                    cache_key,
                    route,
                };
                relay::start(job, attempt)
            }
            Ok(attempt) => answer_json(shared, attempt, &prepared, &record, lease, cache_key).await,
            Err(response) => response,
        }
    } else {
        json_with_retries(shared, &prepared, &record, &mut route, lease, cache_key).await
    };
    if let Some(value) = record
        .cache
        .get()
        .and_then(|v| HeaderValue::from_str(v).ok())
    {
        response.headers_mut().insert(CACHE_HEADER, value);
    }
    response
}

/// A non-streamed answer, retried on another upstream when the connection breaks before
/// its end.
async fn json_with_retries(
    shared: &Shared,
    prepared: &Prepared,
    record: &Arc<Record>,
    route: &mut Route,
    lease: Option<Lease>,
    cache_key: Option<String>,
) -> Response {
    loop {
        let attempt = match connect(shared, prepared, record, route).await {
            Ok(attempt) => attempt,
            Err(response) => return response,
        };
        let (index, upstream) = (attempt.index, Arc::clone(&attempt.upstream));
        match buffer(attempt.response, &upstream).await {
            Ok(answer) => {
                drop(attempt.in_flight);
                if answer.status.is_success() {
                    shared.affinity.record(&prepared.chain, index);
                }
                return finish_json(shared, answer, record, lease, cache_key).await;
            }
            Err(message) => {
                drop(attempt.in_flight);
                upstream.metrics.error("stream");
                shared.pool.eject(index, &message);
                route.last_error = Some(format!("{}: {message}", upstream.url));
                if route.tried.len() > shared.config.max_retries {
                    return exhausted(route, false);
                }
            }
        }
    }
}

/// An answer to a stream request that is not a stream (an error, or a server that does not
/// stream): read whole and passed on.
async fn answer_json(
    shared: &Shared,
    attempt: Attempt,
    prepared: &Prepared,
    record: &Arc<Record>,
    lease: Option<Lease>,
    _cache_key: Option<String>,
) -> Response {
    let upstream = Arc::clone(&attempt.upstream);
    match buffer(attempt.response, &upstream).await {
        Ok(answer) => {
            if answer.status.is_success() {
                shared.affinity.record(&prepared.chain, attempt.index);
            }
            // A stream request answered with JSON is not what the cache would replay.
            finish_json(shared, answer, record, lease, None).await
        }
        Err(message) => {
            upstream.metrics.error("stream");
            upstream_failed(format!("{}: {message}", upstream.url), false).into_response()
        }
    }
}

/// Counts a JSON answer's tokens, stores it when cacheable, and passes it on.
async fn finish_json(
    shared: &Shared,
    answer: Buffered,
    record: &Record,
    lease: Option<Lease>,
    cache_key: Option<String>,
) -> Response {
    let json: Option<Value> = answer
        .status
        .is_success()
        .then(|| serde_json::from_slice(&answer.body).ok())
        .flatten();
    if let Some(usage) = json.as_ref().and_then(|j| j.get("usage")) {
        count_usage(usage, record, lease);
    }
    if let (Some(key), Some(cache), true) = (
        cache_key,
        &shared.config.cache,
        answer.status == StatusCode::OK && json.is_some(),
    ) {
        let entry = Entry {
            kind: Kind::Json,
            body: answer.body.clone(),
        };
        cache.put(&key, entry).await;
    }
    answer.into_response()
}

/// Records an OpenAI `usage` object's tokens for the log and the token limit.
pub(crate) fn count_usage(usage: &Value, record: &Record, lease: Option<Lease>) {
    let count = |field: &str| usage.get(field).and_then(Value::as_u64).unwrap_or(0);
    let (prompt, completion) = (count("prompt_tokens"), count("completion_tokens"));
    record
        .prompt_tokens
        .store(prompt as usize, Ordering::Relaxed);
    record
        .completion_tokens
        .store(completion as usize, Ordering::Relaxed);
    if let Some(mut lease) = lease {
        lease.add_tokens(prompt + completion);
    }
}

/// A cached answer: its JSON, or its SSE events one by one.
fn replay(entry: Entry) -> Response {
    match entry.kind {
        Kind::Json => ([(header::CONTENT_TYPE, "application/json")], entry.body).into_response(),
        Kind::Events => {
            let events = relay::split_events(entry.body);
            let body = Body::from_stream(futures_util::stream::iter(
                events.into_iter().map(Ok::<_, std::convert::Infallible>),
            ));
            (
                [
                    (header::CONTENT_TYPE, "text/event-stream"),
                    (header::CACHE_CONTROL, "no-cache"),
                ],
                body,
            )
                .into_response()
        }
    }
    .with_cache_header()
}

trait WithCacheHeader {
    fn with_cache_header(self) -> Response;
}

impl WithCacheHeader for Response {
    fn with_cache_header(mut self) -> Response {
        self.headers_mut()
            .insert(CACHE_HEADER, HeaderValue::from_static("hit"));
        self
    }
}

/// Any other request: the key checked, then passed to an upstream as is, its answer
/// streamed back unchanged.
pub(crate) async fn pass_through(
    State(gateway): State<Gateway>,
    Extension(record): Extension<Arc<Record>>,
    request: Request,
) -> Response {
    let shared = &gateway.shared;
    if let Err(err) = authenticate(shared, request.headers(), &record) {
        return err.into_response();
    }
    let (parts, body) = match read_body(shared, request, false).await {
        Ok(read) => read,
        Err(response) => return response,
    };
    let prepared = Prepared::raw(shared, &parts, body, &record);
    let mut route = Route::default();
    let attempt = match connect(shared, &prepared, &record, &mut route).await {
        Ok(attempt) => attempt,
        Err(response) => return response,
    };
    let status = attempt.response.status();
    let mut headers = HeaderMap::new();
    for name in [
        header::CONTENT_TYPE,
        header::CACHE_CONTROL,
        header::RETRY_AFTER,
    ] {
        if let Some(v) = attempt.response.headers().get(&name) {
            headers.insert(name, v.clone());
        }
    }
    if let Ok(v) = HeaderValue::from_str(&attempt.upstream.url) {
        headers.insert(HeaderName::from_static(UPSTREAM_HEADER), v);
    }
    let in_flight = attempt.in_flight;
    let chunks = attempt.response.bytes_stream().map(move |chunk| {
        // The request stays counted on its upstream until its body is done.
        let _ = &in_flight;
        chunk.map_err(std::io::Error::other)
    });
    let mut response = Response::new(Body::from_stream(chunks));
    *response.status_mut() = status;
    *response.headers_mut() = headers;
    response
}
