//! A client's request before it goes upstream: its key, its body (read whole, bounded in
//! size and time, JSON only), and what routing needs from it.

use std::sync::Arc;

use axum::body::{to_bytes, Bytes};
use axum::extract::Request;
use axum::http::request::Parts;
use axum::http::{header, HeaderMap, HeaderValue, Method, StatusCode};
use axum::response::{IntoResponse, Response};
use kimi_server::keys::ApiKey;
use kimi_server::ApiError;
use serde_json::Value;

use crate::access_log::Record;
use crate::affinity::Chain;
use crate::Shared;

/// The session header that pins a conversation to one upstream.
pub(crate) const SESSION: &str = "x-session-id";

/// The key of a request, or the 401 (when the gateway has keys).
pub(crate) fn authenticate(
    shared: &Shared,
    headers: &HeaderMap,
    record: &Record,
) -> Result<Option<ApiKey>, ApiError> {
    if shared.keys.is_empty() {
        return Ok(None);
    }
    match shared.keys.authenticate(headers) {
        Some(key) => {
            let _ = record.key.set(key.name.clone());
            Ok(Some(key.clone()))
        }
        None => Err(ApiError::unauthorized()),
    }
}

/// Whether a `Content-Type` names JSON (`application/json`, `application/*+json`); an
/// absent one counts as JSON.
fn is_json(content_type: &HeaderValue) -> bool {
    let Ok(text) = content_type.to_str() else {
        return false;
    };
    let essence = text.split(';').next().unwrap_or("").trim();
    let Some((kind, sub)) = essence.split_once('/') else {
        return false;
    };
    kind.eq_ignore_ascii_case("application")
        && (sub.eq_ignore_ascii_case("json")
            || sub.len() > 5 && sub[sub.len() - 5..].eq_ignore_ascii_case("+json"))
}

/// The request's head and whole body: 415 for a body that is not JSON, 413 past
/// `max_body_bytes`, 408 past `body_timeout`.
pub(crate) async fn read_body(
    shared: &Shared,
    request: Request,
    json_only: bool,
) -> Result<(Parts, Bytes), Response> {
    let (parts, body) = request.into_parts();
    if parts.method == Method::GET || parts.method == Method::HEAD {
        return Ok((parts, Bytes::new()));
    }
    if let Some(content_type) = parts.headers.get(header::CONTENT_TYPE) {
        if json_only && !is_json(content_type) {
            let shown = String::from_utf8_lossy(content_type.as_bytes()).into_owned();
            return Err(ApiError::unsupported_media_type(&shown).into_response());
        }
    }
    let limit = shared.config.max_body_bytes;
    let read = to_bytes(body, limit);
    let bytes = match shared.config.body_timeout {
        None => read.await,
        Some(timeout) => match tokio::time::timeout(timeout, read).await {
            Ok(result) => result,
            Err(_) => {
                let mut err = ApiError::invalid(
                    format!(
                        "The request body did not arrive within {}s",
                        timeout.as_secs_f64()
                    ),
                    None,
                );
                err.status = StatusCode::REQUEST_TIMEOUT;
                return Err(err.into_response());
            }
        },
    };
    match bytes {
        Ok(bytes) => Ok((parts, bytes)),
        // `to_bytes` fails for a body over the limit or a connection that broke.
        Err(_) => Err(ApiError::payload_too_large(limit).into_response()),
    }
}

/// A generation request, ready to send to any upstream.
pub(crate) struct Prepared {
    pub method: Method,
    /// Path and query.
    pub path: String,
    /// The body sent upstream.
    pub body: Bytes,
    pub content_type: Option<HeaderValue>,
    pub accept: Option<HeaderValue>,
    /// What goes upstream as `Authorization`.
    pub authorization: Option<HeaderValue>,
    pub request_id: String,
    pub model: Option<String>,
    /// `"stream": true`.
    pub stream: bool,
    /// The gateway asked the upstream for a usage chunk the client did not ask for; it is
    /// removed from the client's stream.
    pub strip_usage: bool,
    /// Affinity links.
    pub chain: Chain,
}

impl Prepared {
    /// A request passed on as is.
    pub fn raw(shared: &Shared, parts: &Parts, body: Bytes, record: &Arc<Record>) -> Prepared {
        Prepared {
            method: parts.method.clone(),
            path: parts
                .uri
                .path_and_query()
                .map_or_else(|| parts.uri.path().to_string(), |p| p.as_str().to_string()),
            body,
            content_type: parts.headers.get(header::CONTENT_TYPE).cloned(),
            accept: parts.headers.get(header::ACCEPT).cloned(),
            authorization: upstream_authorization(shared, &parts.headers),
            request_id: record.id.clone(),
            model: None,
            stream: false,
            strip_usage: false,
            chain: Chain::default(),
        }
    }

    /// A chat or text completion whose JSON is `json`: the model, streaming, the usage
    /// chunk the gateway needs to count a stream's tokens, and the affinity chain.
    pub fn generation(
        shared: &Shared,
        parts: &Parts,
        body: Bytes,
        json: &Value,
        record: &Arc<Record>,
    ) -> Prepared {
        let mut prepared = Prepared::raw(shared, parts, body, record);
        prepared.model = json.get("model").and_then(Value::as_str).map(str::to_owned);
        prepared.stream = json.get("stream").and_then(Value::as_bool) == Some(true);
        if prepared.stream {
            let asked = json
                .pointer("/stream_options/include_usage")
                .and_then(Value::as_bool)
                == Some(true);
            if !asked {
                let mut with_usage = json.clone();
                if let Some(object) = with_usage.as_object_mut() {
                    let options = object
                        .entry("stream_options")
                        .or_insert_with(|| Value::Object(Default::default()));
                    if !options.is_object() {
                        *options = Value::Object(Default::default());
                    }
                    if let Some(options) = options.as_object_mut() {
                        options.insert("include_usage".into(), Value::Bool(true));
                    }
                    prepared.body = Bytes::from(with_usage.to_string());
                    prepared.strip_usage = true;
                }
            }
        }
        if shared.config.affinity {
            let session = parts.headers.get(SESSION).and_then(|v| v.to_str().ok());
            prepared.chain = Chain::of(parts.uri.path(), json, session);
        }
        prepared
    }
}

/// `Authorization` for upstreams: the gateway's upstream key, else the client's own when
/// the gateway checks no keys itself (so a gateway without keys is transparent).
fn upstream_authorization(shared: &Shared, headers: &HeaderMap) -> Option<HeaderValue> {
    match &shared.config.upstream_api_key {
        Some(key) => HeaderValue::from_str(&format!("Bearer {key}")).ok(),
        None if shared.keys.is_empty() => headers.get(header::AUTHORIZATION).cloned(),
        None => None,
    }
}

/// The JSON object of a generation request, or the 400.
pub(crate) fn parse_object(body: &[u8]) -> Result<Value, ApiError> {
    match serde_json::from_slice::<Value>(body) {
        Ok(value @ Value::Object(_)) => Ok(value),
        Ok(_) => Err(ApiError::invalid(
            "The request body must be a JSON object",
            None,
        )),
        Err(e) => Err(ApiError::invalid(
            format!("The request body is not valid JSON: {e}"),
            None,
        )),
    }
}
