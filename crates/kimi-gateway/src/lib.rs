//! An OpenAI-compatible gateway over several model servers (`kimi-infer serve` replicas or
//! any OpenAI-compatible server).
//!
//! ```text
//! client ─► listener (TLS, connection cap) ─► access log ─► CORS ─► route
//!   POST /v1/chat/completions, /v1/completions:
//!     key (401) ─► limits (429 + Retry-After) ─► body (413/415/408) ─► JSON (400)
//!       ─► cache? hit: stored JSON, or stored SSE events replayed  (x-kimi-cache: hit)
//!       ─► pick: healthy upstreams serving the model, least outstanding, affine one if not
//!          much busier (wait ≤ queue_timeout for one; none: 503, unknown model: 404)
//!       ─► send (x-request-id passed on) ─► failed before any output? eject on a dead
//!          connection, try another (≤ max_retries)
//!       ─► JSON: read whole, tokens from `usage`, stored if cacheable
//!          SSE: relayed event by event; events without output held until the first token
//!          (so a failure before it can still be retried); after it, a failure ends the
//!          stream with an error event; a client that leaves closes the upstream request
//!   GET /v1/models: every healthy upstream's models, merged;  /health; /metrics
//!   anything else: passed to an upstream as is (keys checked, no limits, no cache)
//! health loop: GET /health + /v1/models every interval; ejects after failed probes,
//!              brings back after good ones
//! ```
//!
//! [`Gateway::start`] probes the upstreams once and starts the health loop;
//! [`Gateway::router`] gives the `axum::Router`; [`serve_listener`] serves it.
#![forbid(unsafe_code)]
#![warn(missing_docs)]
#![cfg_attr(not(test), warn(clippy::unwrap_used))]

mod access_log;
mod affinity;
pub mod cache;
mod config;
mod endpoints;
mod metrics;
mod proxy;
mod relay;
mod request;
mod upstream;

use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::middleware;
use axum::routing::{any, get, post};
use axum::Router;
use kimi_server::keys::KeySet;
use kimi_server::{ConnectionCounters, ListenConfig, ServerError};
use tokio::net::TcpListener;

pub use cache::ResponseCache;
pub use config::{GatewayConfig, HealthConfig};

use affinity::AffinityTable;
use metrics::GatewayMetrics;
use upstream::Pool;

/// Why the gateway could not start or stopped with an error.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum GatewayError {
    /// The configuration is invalid.
    #[error("invalid gateway configuration: {0}")]
    Config(String),
    /// The upstream HTTP client could not be built.
    #[error("cannot build the upstream HTTP client: {0}")]
    Client(#[source] reqwest::Error),
    /// Binding or serving failed.
    #[error(transparent)]
    Serve(#[from] ServerError),
}

/// What every request shares.
pub(crate) struct Shared {
    pub config: GatewayConfig,
    pub keys: KeySet,
    pub pool: Arc<Pool>,
    pub affinity: AffinityTable,
    pub client: reqwest::Client,
    pub metrics: GatewayMetrics,
    pub connections: Arc<ConnectionCounters>,
    pub cors: Option<tower_http::cors::CorsLayer>,
    started: u64,
    next_id: AtomicU64,
    health_task: tokio::task::AbortHandle,
}

impl Drop for Shared {
    fn drop(&mut self) {
        self.health_task.abort();
    }
}

impl Shared {
    /// A fresh request id such as `req-6612…`.
    pub fn request_id(&self) -> String {
        let n = self.next_id.fetch_add(1, Ordering::Relaxed);
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos());
        format!("req-{:x}{nanos:08x}{n:06x}", self.started)
    }
}

/// The gateway: cheap to clone, shared by every connection.
#[derive(Clone)]
pub struct Gateway {
    pub(crate) shared: Arc<Shared>,
}

impl std::fmt::Debug for Gateway {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Gateway")
            .field("upstreams", &self.shared.config.upstreams)
            .finish_non_exhaustive()
    }
}

impl Gateway {
    /// Checks the configuration, builds the upstream client, probes every upstream once
    /// (so that healthy ones take requests from the start) and starts the health loop.
    ///
    /// # Errors
    ///
    /// [`GatewayError::Config`] for no upstreams, a URL that is not http(s), bad keys or
    /// CORS values; [`GatewayError::Client`] if the HTTP client cannot be built.
    pub async fn start(config: GatewayConfig) -> Result<Gateway, GatewayError> {
        if config.upstreams.is_empty() {
            return Err(GatewayError::Config(
                "at least one --upstream URL is needed".into(),
            ));
        }
        for url in &config.upstreams {
            let parsed = reqwest::Url::parse(url)
                .map_err(|e| GatewayError::Config(format!("--upstream {url}: {e}")))?;
            if !matches!(parsed.scheme(), "http" | "https") || parsed.host().is_none() {
                return Err(GatewayError::Config(format!(
                    "--upstream {url}: expected http://HOST:PORT or https://HOST:PORT"
                )));
            }
        }
        if config.max_connections == 0 {
            return Err(GatewayError::Config(
                "--max-connections must be at least 1".into(),
            ));
        }
        let keys = KeySet::build(&config.api_keys, &config.keys).map_err(GatewayError::Config)?;
        let cors = match &config.cors {
            Some(cors) => Some(cors.layer().map_err(GatewayError::Config)?),
            None => None,
        };
        let mut client = reqwest::Client::builder();
        if let Some(pem) = &config.upstream_ca_pem {
            let certs = reqwest::Certificate::from_pem_bundle(pem).map_err(|e| {
                GatewayError::Config(format!("--upstream-ca-file: not PEM certificates: {e}"))
            })?;
            if certs.is_empty() {
                return Err(GatewayError::Config(
                    "--upstream-ca-file: no PEM certificate in the file".into(),
                ));
            }
            for cert in certs {
                client = client.add_root_certificate(cert);
            }
        }
        let client = client
            .connect_timeout(config.connect_timeout)
            // Below the 5 s keep-alive of `serve`, so that a pooled connection is not reused
            // just as the upstream closes it.
            .pool_idle_timeout(Duration::from_secs(4))
            .tcp_nodelay(true)
            .no_proxy()
            .redirect(reqwest::redirect::Policy::none())
            .http1_only()
            .build()
            .map_err(GatewayError::Client)?;
        let pool = Arc::new(Pool::new(&config.upstreams));
        let key = config.upstream_api_key.clone();
        upstream::probe_all(&pool, &client, key.as_deref(), &config.health).await;
        let health_task = tokio::spawn(upstream::health_loop(
            Arc::clone(&pool),
            client.clone(),
            key,
            config.health.clone(),
        ))
        .abort_handle();
        let affinity = AffinityTable::new(config.affinity_entries);
        Ok(Gateway {
            shared: Arc::new(Shared {
                config,
                keys,
                pool,
                affinity,
                client,
                metrics: GatewayMetrics::default(),
                connections: Arc::new(ConnectionCounters::default()),
                cors,
                started: kimi_server_unix_now(),
                next_id: AtomicU64::new(0),
                health_task,
            }),
        })
    }

    /// The configuration it runs with.
    pub fn config(&self) -> &GatewayConfig {
        &self.shared.config
    }

    /// How many upstreams are healthy now.
    pub fn healthy_upstreams(&self) -> usize {
        self.shared
            .pool
            .upstreams
            .iter()
            .filter(|u| u.is_healthy())
            .count()
    }

    /// The application.
    pub fn router(&self) -> Router {
        let app = Router::new()
            .route("/v1/chat/completions", post(proxy::generation))
            .route("/v1/completions", post(proxy::generation))
            .route("/v1/models", get(endpoints::list_models))
            .route("/v1/models/{model}", get(endpoints::get_model))
            .route("/health", get(endpoints::health))
            .route("/metrics", get(endpoints::metrics))
            .fallback(any(proxy::pass_through))
            .method_not_allowed_fallback(method_not_allowed);
        let app = match &self.shared.cors {
            Some(cors) => app.layer(cors.clone()),
            None => app,
        };
        app.layer(middleware::from_fn_with_state(
            self.clone(),
            access_log::access_log,
        ))
        .with_state(self.clone())
    }
}

async fn method_not_allowed() -> kimi_server::ApiError {
    kimi_server::ApiError::method_not_allowed()
}

fn kimi_server_unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// Serves `gateway` on an already bound listener until `shutdown` completes, then lets open
/// requests finish for up to `shutdown_timeout`.
///
/// # Errors
///
/// [`GatewayError::Serve`] if serving fails.
pub async fn serve_listener(
    listener: TcpListener,
    gateway: Gateway,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), GatewayError> {
    let config = &gateway.shared.config;
    let listen = ListenConfig {
        max_connections: config.max_connections,
        keep_alive_timeout: config.keep_alive_timeout,
        shutdown_timeout: config.shutdown_timeout,
        tls: config.tls.clone(),
    };
    let counters = Arc::clone(&gateway.shared.connections);
    let app = gateway.router();
    kimi_server::serve_app(listener, app, listen, counters, shutdown).await?;
    Ok(())
}
