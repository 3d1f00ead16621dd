//! [`ServerConfig`]: what `kimi-infer serve` flags set.

use std::sync::Arc;
use std::time::Duration;

use crate::cors::CorsConfig;
use crate::keys::ApiKey;
use crate::limits::Limiter;
use crate::tool_format::ToolCallParser;

/// Settings of the HTTP server (the engine has its own, `ServingConfig`).
#[derive(Clone, Debug)]
pub struct ServerConfig {
    /// Address to bind, e.g. `127.0.0.1` or `0.0.0.0`.
    pub host: String,
    /// TCP port; `0` picks a free one.
    pub port: u16,
    /// The model name clients must send (and `/v1/models` lists).
    pub served_model_name: String,
    /// Accepted API keys, named `key-1`, `key-2`, ... by position; with `keys` empty too,
    /// no authentication.
    pub api_keys: Vec<String>,
    /// Named API keys with their own limits (a key file, `KIMI_API_KEYS`).
    pub keys: Vec<ApiKey>,
    /// Per-key limits on `/v1/chat/completions` and `/v1/completions`; `None`: none.
    /// Without keys every client counts as the key `anonymous`.
    pub limiter: Option<Arc<Limiter>>,
    /// TLS (see [`crate::load_tls`]); `None`: plain HTTP.
    pub tls: Option<Arc<rustls::ServerConfig>>,
    /// CORS headers for other origins; `None`: none (same-origin only).
    pub cors: Option<CorsConfig>,
    /// A chat template (Jinja source) overriding the tokenizer's.
    pub chat_template: Option<String>,
    /// The tool-call format of a template-based model (`auto`: detected from the tokenizer
    /// and the chat template).
    pub tool_call_parser: ToolCallParser,
    /// Longest prompt + output; `None` uses the engine's limit (a larger value is capped to it).
    pub max_model_len: Option<usize>,
    /// Longest a request may take end to end; `None` is no limit.
    pub request_timeout: Option<Duration>,
    /// Most sequences in flight (running or waiting) at once; more are refused with 429.
    pub max_pending_requests: usize,
    /// Largest request body accepted.
    pub max_body_bytes: usize,
    /// A connection must send a complete request head within this of opening or of its
    /// previous response, else it is closed: this ends idle keep-alive connections and
    /// half-sent heads alike. `None` waits forever.
    pub keep_alive_timeout: Option<Duration>,
    /// A request's body must arrive within this of its head (else 408). `None` waits forever.
    pub body_timeout: Option<Duration>,
    /// Most connections open at once; past it, connections get a 503 (a `/health` probe
    /// still gets its 200).
    pub max_connections: usize,
    /// After the shutdown signal, how long open requests may run before their connections
    /// are closed. `None` waits for them.
    pub shutdown_timeout: Option<Duration>,
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            host: "127.0.0.1".into(),
            port: 8000,
            served_model_name: "kimi".into(),
            api_keys: Vec::new(),
            keys: Vec::new(),
            limiter: None,
            tls: None,
            cors: None,
            chat_template: None,
            tool_call_parser: ToolCallParser::Auto,
            max_model_len: None,
            request_timeout: Some(Duration::from_secs(600)),
            max_pending_requests: 1024,
            max_body_bytes: 32 << 20,
            keep_alive_timeout: Some(Duration::from_secs(5)),
            body_timeout: Some(Duration::from_secs(60)),
            max_connections: 1024,
            shutdown_timeout: Some(Duration::from_secs(30)),
        }
    }
}
