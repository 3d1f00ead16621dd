//! [`GatewayConfig`]: what `kimi-infer gateway` flags set.

use std::sync::Arc;
use std::time::Duration;

use kimi_server::keys::ApiKey;
use kimi_server::limits::Limiter;
use kimi_server::CorsConfig;

use crate::cache::ResponseCache;

/// How upstreams are probed.
#[derive(Clone, Debug)]
pub struct HealthConfig {
    /// Time between probes of each upstream (`GET /health`, then `GET /v1/models`).
    pub interval: Duration,
    /// A probe slower than this fails.
    pub timeout: Duration,
    /// Consecutive failed probes that eject a healthy upstream.
    pub unhealthy_after: u32,
    /// Consecutive good probes that bring an ejected upstream back.
    pub healthy_after: u32,
}

impl Default for HealthConfig {
    fn default() -> Self {
        HealthConfig {
            interval: Duration::from_secs(5),
            timeout: Duration::from_secs(2),
            unhealthy_after: 2,
            healthy_after: 2,
        }
    }
}

/// Settings of the gateway.
#[derive(Clone, Debug)]
pub struct GatewayConfig {
    /// Address to bind.
    pub host: String,
    /// TCP port; `0` picks a free one.
    pub port: u16,
    /// Base URLs of the upstream OpenAI-compatible servers (`http://10.0.0.5:8000`).
    pub upstreams: Vec<String>,
    /// The key the gateway sends upstream (`Authorization: Bearer`); `None`: a client's own
    /// `Authorization` is passed on when the gateway has no keys of its own.
    pub upstream_api_key: Option<String>,
    /// PEM certificates trusted for `https://` upstreams besides the public roots (a
    /// private CA, a self-signed replica).
    pub upstream_ca_pem: Option<Vec<u8>>,
    /// Health checks.
    pub health: HealthConfig,
    /// Longest wait to connect to an upstream.
    pub connect_timeout: Duration,
    /// Longest wait for an upstream's response head (a non-streamed completion's head
    /// comes when it is done); `None`: no limit besides ejection.
    pub upstream_timeout: Option<Duration>,
    /// Further upstreams tried for a request that failed before any output was sent.
    pub max_retries: usize,
    /// How long a request waits for a healthy upstream before a 503.
    pub queue_timeout: Duration,
    /// Route a conversation (session header or prompt prefix) back to its upstream.
    pub affinity: bool,
    /// An affine upstream is used while it has at most this many more requests in flight
    /// than the least loaded one.
    pub affinity_slack: usize,
    /// Prefixes remembered for affinity.
    pub affinity_entries: usize,
    /// Keys named `key-1`, `key-2`, ... by position.
    pub api_keys: Vec<String>,
    /// Named keys with their own limits.
    pub keys: Vec<ApiKey>,
    /// Per-key limits; `None`: none.
    pub limiter: Option<Arc<Limiter>>,
    /// The response cache; `None`: off.
    pub cache: Option<Arc<ResponseCache>>,
    /// TLS for clients; `None`: plain HTTP.
    pub tls: Option<Arc<rustls::ServerConfig>>,
    /// CORS; `None`: none.
    pub cors: Option<CorsConfig>,
    /// Largest request body accepted.
    pub max_body_bytes: usize,
    /// A request's body must arrive within this of its head (else 408).
    pub body_timeout: Option<Duration>,
    /// A connection must send a complete request head within this.
    pub keep_alive_timeout: Option<Duration>,
    /// Most client connections open at once.
    pub max_connections: usize,
    /// After the shutdown signal, how long open requests may run.
    pub shutdown_timeout: Option<Duration>,
}

impl Default for GatewayConfig {
    fn default() -> Self {
        GatewayConfig {
            host: "127.0.0.1".into(),
            port: 8080,
            upstreams: Vec::new(),
            upstream_api_key: None,
            upstream_ca_pem: None,
            health: HealthConfig::default(),
            connect_timeout: Duration::from_secs(3),
            upstream_timeout: Some(Duration::from_secs(600)),
            max_retries: 2,
            queue_timeout: Duration::from_secs(10),
            affinity: true,
            affinity_slack: 4,
            affinity_entries: 100_000,
            api_keys: Vec::new(),
            keys: Vec::new(),
            limiter: None,
            cache: None,
            tls: None,
            cors: None,
            max_body_bytes: 32 << 20,
            body_timeout: Some(Duration::from_secs(60)),
            keep_alive_timeout: Some(Duration::from_secs(5)),
            max_connections: 4096,
            shutdown_timeout: Some(Duration::from_secs(30)),
        }
    }
}
