//! Errors: [`ApiError`] goes back to an HTTP client as OpenAI's error JSON; [`ServerError`]
//! is what [`crate::serve`] and [`crate::AppState::new`] can fail with.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde_json::json;

/// One request's failure, rendered as OpenAI's error body:
/// `{"error": {"message", "type", "param", "code"}}`.
#[derive(Clone, Debug, PartialEq)]
pub struct ApiError {
    /// HTTP status.
    pub status: StatusCode,
    /// Plain-words explanation for the client.
    pub message: String,
    /// OpenAI error type, e.g. `invalid_request_error`.
    pub kind: &'static str,
    /// The request field at fault, if one is.
    pub param: Option<String>,
    /// A machine-readable code, e.g. `model_not_found`.
    pub code: Option<&'static str>,
}

impl ApiError {
    pub(crate) fn new(status: StatusCode, kind: &'static str, message: impl Into<String>) -> Self {
        ApiError {
            status,
            message: message.into(),
            kind,
            param: None,
            code: None,
        }
    }

    /// 400 `invalid_request_error` about `param` (`None` when no single field is at fault).
    pub fn invalid(message: impl Into<String>, param: Option<&str>) -> Self {
        let mut err = Self::new(StatusCode::BAD_REQUEST, "invalid_request_error", message);
        err.param = param.map(str::to_owned);
        err
    }

    /// 400 `context_length_exceeded` for a prompt (or prompt + completion) that does not
    /// fit the context; `param` names the prompt's field.
    pub fn context_length_exceeded(message: impl Into<String>, param: &str) -> Self {
        Self::invalid(message, Some(param)).code("context_length_exceeded")
    }

    /// 404 for a model this server does not serve, whether named in the path
    /// (`/v1/models/{id}`) or in a request body (as OpenAI and vLLM answer).
    pub fn model_not_found(model: &str) -> Self {
        let message = format!("The model `{model}` does not exist.");
        let mut err = Self::new(StatusCode::NOT_FOUND, "invalid_request_error", message);
        err.param = Some("model".into());
        err.code = Some("model_not_found");
        err
    }

    /// 404 for an unknown path.
    pub fn route_not_found(path: &str) -> Self {
        let message = format!("Unknown request URL: {path}");
        Self::new(StatusCode::NOT_FOUND, "invalid_request_error", message).code("unknown_url")
    }

    /// 405 for a known path with the wrong method.
    pub fn method_not_allowed() -> Self {
        let message = "This HTTP method is not allowed for this URL";
        Self::new(
            StatusCode::METHOD_NOT_ALLOWED,
            "invalid_request_error",
            message,
        )
    }

    /// 415 for a request body that is not JSON.
    pub fn unsupported_media_type(content_type: &str) -> Self {
        let message = format!(
            "Content-Type `{content_type}` is not supported; send the body as application/json"
        );
        Self::new(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "invalid_request_error",
            message,
        )
        .code("unsupported_media_type")
    }

    /// 413 for a body over the server's limit.
    pub fn payload_too_large(limit: usize) -> Self {
        let message =
            format!("The request body is larger than the server's limit of {limit} bytes");
        Self::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "invalid_request_error",
            message,
        )
        .code("payload_too_large")
    }

    /// 401 for a missing or wrong API key.
    pub fn unauthorized() -> Self {
        let message = "Incorrect API key provided. Pass it as `Authorization: Bearer <key>`.";
        Self::new(StatusCode::UNAUTHORIZED, "invalid_request_error", message)
            .code("invalid_api_key")
    }

    /// 429: too many requests are in flight.
    pub fn overloaded(message: impl Into<String>) -> Self {
        Self::new(StatusCode::TOO_MANY_REQUESTS, "rate_limit_error", message)
            .code("rate_limit_exceeded")
    }

    /// 429: a per-key rate limit refused the request.
    pub fn rate_limited(message: impl Into<String>) -> Self {
        Self::new(StatusCode::TOO_MANY_REQUESTS, "rate_limit_error", message)
            .code("rate_limit_exceeded")
    }

    /// 408: the request ran past the server's request timeout.
    pub fn timeout(secs: f64) -> Self {
        let message = format!("The request did not finish within the server's timeout of {secs}s");
        Self::new(StatusCode::REQUEST_TIMEOUT, "timeout_error", message).code("request_timeout")
    }

    /// 503: the engine is shutting down or gone.
    pub fn unavailable(message: impl Into<String>) -> Self {
        Self::new(StatusCode::SERVICE_UNAVAILABLE, "server_error", message)
    }

    /// 500: a fault of the server, not of the request.
    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(StatusCode::INTERNAL_SERVER_ERROR, "server_error", message)
    }

    /// Sets the machine-readable code.
    pub fn code(mut self, code: &'static str) -> Self {
        self.code = Some(code);
        self
    }

    /// The JSON body.
    pub fn to_json(&self) -> serde_json::Value {
        json!({"error": {
            "message": self.message,
            "type": self.kind,
            "param": self.param,
            "code": self.code,
        }})
    }
}

impl std::fmt::Display for ApiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {}", self.status.as_u16(), self.message)
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut response = (self.status, axum::Json(self.to_json())).into_response();
        // For the access log.
        response
            .extensions_mut()
            .insert(crate::access_log::ErrorMessage(self.message));
        response
    }
}

/// Why the server could not start or stopped with an error.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ServerError {
    /// The listening address could not be bound.
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        /// `host:port` as configured.
        addr: String,
        /// The socket error.
        #[source]
        source: std::io::Error,
    },
    /// Accepting or serving connections failed.
    #[error("the HTTP server failed: {0}")]
    Serve(#[source] std::io::Error),
    /// The configuration is invalid (a bad chat template, a zero limit, ...).
    #[error("invalid server configuration: {0}")]
    Config(String),
    /// The tokenizer cannot be used for constrained decoding.
    #[error("cannot prepare constrained decoding: {0}")]
    Constraint(String),
}
