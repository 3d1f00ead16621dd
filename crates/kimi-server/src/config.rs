//! [`ServerConfig`]: what `kimi-infer serve` flags set.

use std::time::Duration;

/// Settings of the HTTP server (the engine has its own, `ServingConfig`).
#[derive(Clone, Debug)]
pub struct ServerConfig {
    /// Address to bind, e.g. `127.0.0.1` or `0.0.0.0`.
    pub host: String,
    /// TCP port; `0` picks a free one.
    pub port: u16,
    /// The model name clients must send (and `/v1/models` lists).
    pub served_model_name: String,
    /// Accepted API keys; empty means no authentication.
    pub api_keys: Vec<String>,
    /// A chat template (Jinja source) overriding the tokenizer's.
    pub chat_template: Option<String>,
    /// Longest prompt + output; `None` uses the engine's limit (a larger value is capped to it).
    pub max_model_len: Option<usize>,
    /// Longest a request may take end to end; `None` is no limit.
    pub request_timeout: Option<Duration>,
    /// Most sequences in flight (running or waiting) at once; more are refused with 429.
    pub max_pending_requests: usize,
    /// Largest request body accepted.
    pub max_body_bytes: usize,
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            host: "127.0.0.1".into(),
            port: 8000,
            served_model_name: "kimi".into(),
            api_keys: Vec::new(),
            chat_template: None,
            max_model_len: None,
            request_timeout: Some(Duration::from_secs(600)),
            max_pending_requests: 1024,
            max_body_bytes: 32 << 20,
        }
    }
}
