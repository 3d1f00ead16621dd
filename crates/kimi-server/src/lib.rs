//! An OpenAI-compatible HTTP server for kimi-infer.
//!
//! ```text
//! client ──HTTP──► axum router ─► auth ─► handler (parse, template, tokenize, grammar)
//!                                             │ Run::submit: one sequence per choice
//!                                             ▼
//!                                   Generator (EngineHandle) ── events ──► Run
//!                                             │ tokens → tool calls / text / stop strings
//!                                             ▼
//!                                   JSON body or SSE chunks ──► client
//! ```
//!
//! Endpoints: `POST /v1/chat/completions`, `POST /v1/completions`, `GET /v1/models`,
//! `GET /v1/models/{model}`, `GET /health`, `GET /metrics` (Prometheus text, vLLM's names),
//! `POST /tokenize`, `POST /detokenize`, and a web page at `/` (chat and dashboard, its assets
//! under `/assets/`). Errors are OpenAI's JSON
//! (`{"error": {"message", "type", "param", "code"}}`). With `tool_choice` `required` or a
//! named function, and with `response_format` `json_object` / `json_schema`, decoding is
//! constrained by an llguidance grammar, so even a random-weight model emits valid output.
//!
//! The chat format is chosen once per server (`ChatFormat`): the chat template
//! (`--chat-template` or the tokenizer's; Kimi K2's tool-call tokens are parsed when
//! present), else Kimi K3's XTML when the tokenizer has `<|open|>`, `<|sep|>`, `<|close|>`
//! and `<|end_of_msg|>` (rendered by `kimi_tokenizer::xtml`, parsed back into
//! `reasoning_content`, `content` and `tool_calls` by `xtml_output`; thinking on by
//! default, off with `chat_template_kwargs: {"thinking": false}`). Template-based models
//! without Kimi's tool tokens write calls as text in a format picked from the template or
//! `--tool-call-parser` (`tool_format`: hermes, llama3_json, mistral, generic), parsed by
//! `json_tool_parser` and forced by `json_tool_grammar`.
//!
//! Who may call: API keys with names ([`keys`]: `--api-key`, a key file, `KIMI_API_KEYS`),
//! per-key limits on the generation routes ([`limits`]: requests and tokens per minute,
//! requests in flight; in memory or Redis; 429 with `Retry-After`), TLS ([`load_tls`]) and
//! CORS ([`CorsConfig`]). The listener ([`serve_app`]), keys, limits, CORS and the
//! Prometheus helpers ([`prometheus`]) are shared with the gateway (`kimi-gateway`).
//!
//! [`serve`] binds and runs; [`router`] gives the `axum::Router` for tests.
//!
//! ```no_run
//! # async fn demo(engine: impl kimi_server::Generator, tokenizer: std::sync::Arc<kimi_tokenizer::Tokenizer>) {
//! let config = kimi_server::ServerConfig { port: 8000, ..Default::default() };
//! let shutdown = async { let _ = tokio::signal::ctrl_c().await; };
//! if let Err(err) = kimi_server::serve(config, engine, tokenizer, shutdown).await {
//!     eprintln!("{err}");
//! }
//! # }
//! ```
#![forbid(unsafe_code)]
#![warn(missing_docs)]
#![cfg_attr(not(test), warn(clippy::unwrap_used))]

mod access_log;
mod auth;
mod beam_relay;
mod chat;
mod chat_format;
mod chat_request;
mod completions;
mod config;
mod constraint;
mod cors;
mod decode;
mod engine_adapter;
mod error;
mod fields;
mod generation;
mod generator;
mod json_call;
mod json_tool_grammar;
mod json_tool_parser;
pub mod keys;
pub mod limits;
mod listener;
mod metrics;
mod misc;
mod params;
pub mod prometheus;
mod request_body;
mod response;
mod state;
mod tls;
mod tool_format;
mod tool_parser;
mod web;
mod xtml_grammar;
mod xtml_output;

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::DefaultBodyLimit;
use axum::http::Uri;
use axum::middleware;
use axum::routing::{get, post};
use axum::Router;
use kimi_tokenizer::Tokenizer;
use tokio::net::TcpListener;

pub use access_log::{logged_body, AccessLine, ErrorMessage};
pub use config::ServerConfig;
pub use cors::{parse_list as parse_cors_list, CorsConfig};
pub use error::{ApiError, ServerError};
pub use generator::Generator;
pub use listener::{serve_app, ConnectionCounters, ListenConfig};
pub use state::AppState;
pub use tls::load_tls;
pub use tool_format::ToolCallParser;

use fields::Body;
use state::Inner;

/// The application: every route with auth, error counting and the body limit.
pub fn router(state: AppState) -> Router {
    // Generation: limits checked before the body is read, so a refused client's body is not.
    let generation = Router::new()
        .route("/v1/chat/completions", post(chat::chat_completions))
        .route("/v1/completions", post(completions::completions))
        .route_layer(middleware::from_fn_with_state(
            state.clone(),
            request_body::read_body,
        ))
        .route_layer(middleware::from_fn_with_state(
            state.clone(),
            auth::limit_requests,
        ));
    let other = Router::new()
        .route("/v1/models", get(misc::list_models))
        .route("/v1/models/{model}", get(misc::get_model))
        .route("/tokenize", post(misc::tokenize))
        .route("/detokenize", post(misc::detokenize))
        .route_layer(middleware::from_fn_with_state(
            state.clone(),
            request_body::read_body,
        ));
    // Authentication first (the outer layer), so anonymous bodies are never read.
    let protected = generation
        .merge(other)
        .route_layer(middleware::from_fn_with_state(
            state.clone(),
            auth::require_api_key,
        ));
    let max_body_bytes = state.inner.config.max_body_bytes;
    let app = Router::new()
        .merge(protected)
        .route("/health", get(misc::health))
        .route("/metrics", get(misc::metrics))
        .route("/", get(web::index))
        .route("/assets/app.js", get(web::app_js))
        .route("/assets/app.css", get(web::app_css))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(DefaultBodyLimit::max(max_body_bytes));
    // CORS inside the access log, so preflights are logged; outside the routes, so a
    // preflight needs no key.
    let app = match &state.inner.cors {
        Some(cors) => app.layer(cors.clone()),
        None => app,
    };
    app.layer(middleware::from_fn_with_state(
        state.clone(),
        access_log::access_log,
    ))
    .with_state(state)
}

/// Serves `engine` on `config.host:config.port` until `shutdown` completes, then lets open
/// requests finish.
///
/// # Errors
///
/// [`ServerError`] if the state cannot be prepared, the address cannot be bound, or serving
/// fails.
pub async fn serve(
    config: ServerConfig,
    engine: impl Generator,
    tokenizer: Arc<Tokenizer>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), ServerError> {
    let addr = format!("{}:{}", config.host, config.port);
    let state = AppState::new(config, Arc::new(engine), tokenizer)?;
    let listener = TcpListener::bind(&addr)
        .await
        .map_err(|source| ServerError::Bind { addr, source })?;
    serve_listener(listener, state, shutdown).await
}

/// Serves on an already bound listener (tests bind `127.0.0.1:0`) until `shutdown`
/// completes, then lets open requests finish for up to `config.shutdown_timeout`.
///
/// # Errors
///
/// [`ServerError::Config`] for a zero `max_connections`.
pub async fn serve_listener(
    listener: TcpListener,
    state: AppState,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), ServerError> {
    if let Ok(addr) = listener.local_addr() {
        tracing::debug!("kimi-server listening on http://{addr}");
    }
    let config = &state.inner.config;
    let listen = ListenConfig {
        max_connections: config.max_connections,
        keep_alive_timeout: config.keep_alive_timeout,
        shutdown_timeout: config.shutdown_timeout,
        tls: config.tls.clone(),
    };
    let counters = Arc::clone(&state.inner.metrics.connections);
    let app = router(state);
    serve_app(listener, app, listen, counters, shutdown).await
}

async fn not_found(uri: Uri) -> ApiError {
    ApiError::route_not_found(uri.path())
}

async fn method_not_allowed() -> ApiError {
    ApiError::method_not_allowed()
}

/// The body, or OpenAI's error for an unreadable or too large one.
pub(crate) fn body_bytes(body: Result<Bytes, BytesRejection>) -> Result<Bytes, ApiError> {
    body.map_err(|rejection| {
        let mut err = ApiError::invalid(format!("Cannot read the request body: {rejection}"), None);
        err.status = rejection.status();
        err
    })
}

/// Runs CPU-heavy request preparation (templates, tokenizing, grammars) off the async
/// threads; a panic there becomes a 500 instead of a dropped connection.
pub(crate) async fn blocking<T: Send + 'static>(
    work: impl FnOnce() -> Result<T, ApiError> + Send + 'static,
) -> Result<T, ApiError> {
    tokio::task::spawn_blocking(work)
        .await
        .unwrap_or_else(|err| {
            Err(ApiError::internal(format!(
                "the request handler failed: {err}"
            )))
        })
}

/// Checks `model` (absent means the served model) and returns the name to report.
pub(crate) fn check_model(inner: &Inner, body: &Body) -> Result<String, ApiError> {
    let served = &inner.config.served_model_name;
    match body.str("model")? {
        Some(model) if model != served => Err(ApiError::model_not_found(model)),
        _ => Ok(served.clone()),
    }
}

/// When a request that arrived at `arrival` must be done, with the configured limit.
pub(crate) fn deadline(
    inner: &Inner,
    arrival: Instant,
) -> Option<(tokio::time::Instant, Duration)> {
    inner
        .config
        .request_timeout
        .map(|limit| (tokio::time::Instant::from_std(arrival) + limit, limit))
}
