//! Request bodies are read whole before a handler runs: JSON content types only (415
//! otherwise, as FastAPI-based servers refuse them), at most `max_body_bytes` (413), and
//! within `body_timeout` of the head (408), so a client cannot hold a connection and its
//! buffer by sending a body slowly or never.

use axum::body::{to_bytes, Body};
use axum::extract::{Request, State};
use axum::http::{header, HeaderValue, Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use crate::error::ApiError;
use crate::state::AppState;

/// Whether a `Content-Type` names JSON: `application/json` or `application/*+json`, with
/// any parameters. An absent header counts as JSON, as OpenAI's clients always send one
/// and curl users often forget it.
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

/// The middleware (after authentication, so that anonymous clients never get a body read).
pub(crate) async fn read_body(
    State(state): State<AppState>,
    request: Request,
    next: Next,
) -> Response {
    if request.method() == Method::GET || request.method() == Method::HEAD {
        return next.run(request).await;
    }
    if let Some(content_type) = request.headers().get(header::CONTENT_TYPE) {
        if !is_json(content_type) {
            let shown = String::from_utf8_lossy(content_type.as_bytes()).into_owned();
            return ApiError::unsupported_media_type(&shown).into_response();
        }
    }
    let config = &state.inner.config;
    let (parts, body) = request.into_parts();
    let read = to_bytes(body, config.max_body_bytes);
    let bytes = match config.body_timeout {
        None => read.await,
        Some(limit) => match tokio::time::timeout(limit, read).await {
            Ok(result) => result,
            Err(_) => return body_timeout(limit),
        },
    };
    match bytes {
        Ok(bytes) => {
            next.run(Request::from_parts(parts, Body::from(bytes)))
                .await
        }
        Err(e) => {
            let too_large = std::error::Error::source(&e)
                .is_some_and(|s| s.is::<http_body_util::LengthLimitError>());
            if too_large {
                ApiError::payload_too_large(config.max_body_bytes).into_response()
            } else {
                let mut err = ApiError::invalid(format!("Cannot read the request body: {e}"), None);
                err.status = StatusCode::BAD_REQUEST;
                close(err.into_response())
            }
        }
    }
}

/// 408 for a body that did not arrive in time; the connection is closed, since the rest
/// of the body may still be on its way.
fn body_timeout(limit: std::time::Duration) -> Response {
    let message = format!(
        "The request body did not arrive within {}s (--timeout-body)",
        limit.as_secs_f64()
    );
    let err =
        ApiError::new(StatusCode::REQUEST_TIMEOUT, "timeout_error", message).code("body_timeout");
    close(err.into_response())
}

fn close(mut response: Response) -> Response {
    response
        .headers_mut()
        .insert(header::CONNECTION, HeaderValue::from_static("close"));
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_content_types() {
        for yes in [
            "application/json",
            "Application/JSON; charset=utf-8",
            "application/vnd.api+json",
        ] {
            assert!(is_json(&HeaderValue::from_static(yes)), "{yes}");
        }
        for no in [
            "text/plain",
            "application/x-www-form-urlencoded",
            "multipart/form-data; boundary=x",
            "application/jsonp",
            "json",
            "application/+json",
        ] {
            assert!(!is_json(&HeaderValue::from_static(no)), "{no}");
        }
    }
}
