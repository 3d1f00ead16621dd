//! `kimi-infer gateway`: one OpenAI-compatible front door for several servers.

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use clap::{Args, ValueEnum};
use kimi_gateway::{Gateway, GatewayConfig, HealthConfig, ResponseCache};
use tokio::net::TcpListener;

use crate::access_args::{CorsArgs, KeyArgs, TlsArgs};
use crate::args::parse_bytes;
use crate::serve::{is_loopback, max_connections, secs, shutdown_signal, Signals};

/// Where the response cache lives.
#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum CacheStore {
    /// In this gateway's memory.
    Memory,
    /// In Redis (--redis-url), shared by every gateway that uses it.
    Redis,
}

/// `kimi-infer gateway`.
#[derive(Args, Debug)]
pub struct GatewayArgs {
    /// Base URL of an upstream OpenAI-compatible server, e.g. http://10.0.0.5:8000
    /// (repeatable, or comma-separated).
    #[arg(long = "upstream", required = true, value_delimiter = ',')]
    pub upstreams: Vec<String>,
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// Port to listen on (0 picks a free one).
    #[arg(long, default_value_t = 8080)]
    pub port: u16,
    /// API key sent to the upstreams. Without it, a client's own Authorization header is
    /// passed on when the gateway checks no keys itself.
    #[arg(long, env = "KIMI_UPSTREAM_API_KEY", hide_env_values = true)]
    pub upstream_api_key: Option<String>,
    /// PEM file of certificates to trust for https:// upstreams besides the public roots
    /// (a private CA, or a replica's self-signed certificate).
    #[arg(long)]
    pub upstream_ca_file: Option<std::path::PathBuf>,
    /// Seconds between health probes of each upstream (GET /health, then /v1/models).
    #[arg(long, default_value_t = 5.0, value_parser = parse_positive_secs)]
    pub health_interval: f64,
    /// Seconds a health probe may take.
    #[arg(long, default_value_t = 2.0, value_parser = parse_positive_secs)]
    pub health_timeout: f64,
    /// Consecutive failed probes that eject an upstream (a connection that fails ejects it
    /// at once).
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u32).range(1..))]
    pub unhealthy_threshold: u32,
    /// Consecutive good probes that bring an ejected upstream back.
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u32).range(1..))]
    pub healthy_threshold: u32,
    /// Seconds to connect to an upstream.
    #[arg(long, default_value_t = 3.0, value_parser = parse_positive_secs)]
    pub connect_timeout: f64,
    /// Seconds an upstream may take to answer a request's head (a non-streamed completion
    /// answers when it is done; 0: no limit).
    #[arg(long, default_value_t = 600.0, value_parser = crate::args::parse_secs)]
    pub upstream_timeout: f64,
    /// Other upstreams tried for a request that failed before any output reached the
    /// client (connection failed, upstream ejected, or 429/502/503/504).
    #[arg(long, default_value_t = 2)]
    pub max_retries: usize,
    /// Seconds a request waits for a healthy upstream before a 503.
    #[arg(long, default_value_t = 10.0, value_parser = crate::args::parse_secs)]
    pub queue_timeout: f64,
    /// Route requests by load only, not back to the upstream that served their
    /// conversation (session header `x-session-id`, or the same messages/prompt prefix).
    #[arg(long)]
    pub no_affinity: bool,
    /// An affine upstream is used while it has at most this many more requests in flight
    /// than the least loaded one.
    #[arg(long, default_value_t = 4)]
    pub affinity_slack: usize,
    /// Answer deterministic requests (temperature 0 or a seed) again from a cache: in this
    /// gateway's memory, or in Redis (--redis-url) shared by several gateways. Off by
    /// default.
    #[arg(long, value_enum)]
    pub response_cache: Option<CacheStore>,
    /// Bytes the response cache may hold (units as in 256MiB); one response may take a
    /// quarter of it.
    #[arg(long, default_value = "256MiB", value_parser = parse_bytes)]
    pub response_cache_max_bytes: u64,
    /// Seconds a cached response is kept.
    #[arg(long, default_value_t = 600.0, value_parser = parse_positive_secs)]
    pub response_cache_ttl: f64,
    #[command(flatten)]
    pub keys: KeyArgs,
    #[command(flatten)]
    pub tls: TlsArgs,
    #[command(flatten)]
    pub cors: CorsArgs,
    /// Seconds a connection may take to send a complete request head (0: never closed).
    #[arg(long, default_value_t = 5.0, value_parser = crate::args::parse_secs)]
    pub timeout_keep_alive: f64,
    /// Seconds a request body may take to arrive; later: 408 (0: never).
    #[arg(long, default_value_t = 60.0, value_parser = crate::args::parse_secs)]
    pub timeout_body: f64,
    /// Most client connections open at once (default: 1024, lowered to fit the open-file
    /// limit).
    #[arg(long)]
    pub max_connections: Option<usize>,
    /// Seconds SIGTERM / Ctrl-C lets running requests finish (0: wait for them).
    #[arg(long, default_value_t = 30.0, value_parser = crate::args::parse_secs)]
    pub shutdown_timeout: f64,
}

/// Seconds above 0.
fn parse_positive_secs(text: &str) -> Result<f64, String> {
    match crate::args::parse_secs(text) {
        Ok(s) if s > 0.0 => Ok(s),
        _ => Err(format!("`{text}` is not a number of seconds above 0")),
    }
}

pub fn gateway(a: GatewayArgs) -> anyhow::Result<()> {
    let named = a.keys.named_keys()?;
    let upstream_ca_pem = match &a.upstream_ca_file {
        Some(path) => Some(
            std::fs::read(path)
                .with_context(|| format!("--upstream-ca-file {}", path.display()))?,
        ),
        None => None,
    };
    let tls = a.tls.load()?;
    anyhow::ensure!(
        a.response_cache != Some(CacheStore::Redis) || a.keys.redis_url.is_some(),
        "--response-cache redis needs --redis-url"
    );
    let max_bytes = usize::try_from(a.response_cache_max_bytes)
        .context("--response-cache-max-bytes is too large")?;
    anyhow::ensure!(
        max_bytes >= 4096,
        "--response-cache-max-bytes must be at least 4KiB"
    );
    let runtime = tokio::runtime::Runtime::new().context("starting the async runtime")?;
    let result = runtime.block_on(async {
        let signals = Signals::new()?;
        let upstream_timeout = secs(a.upstream_timeout);
        let lease_ttl = upstream_timeout.unwrap_or(Duration::from_secs(3600));
        let limiter = a.keys.limiter(&named, lease_ttl).await?;
        let ttl = Duration::from_secs_f64(a.response_cache_ttl);
        let cache = match a.response_cache {
            None => None,
            Some(CacheStore::Memory) => Some(Arc::new(ResponseCache::in_memory(max_bytes, ttl))),
            Some(CacheStore::Redis) => {
                let url = a.keys.redis_url.as_deref().unwrap_or_default();
                let prefix = format!("{}:cache", a.keys.redis_prefix);
                Some(Arc::new(
                    ResponseCache::in_redis(url, &prefix, max_bytes, ttl).await?,
                ))
            }
        };
        let config = GatewayConfig {
            host: a.host.clone(),
            port: a.port,
            upstreams: a.upstreams.clone(),
            upstream_api_key: a.upstream_api_key.clone().filter(|k| !k.is_empty()),
            upstream_ca_pem,
            health: HealthConfig {
                interval: Duration::from_secs_f64(a.health_interval),
                timeout: Duration::from_secs_f64(a.health_timeout),
                unhealthy_after: a.unhealthy_threshold,
                healthy_after: a.healthy_threshold,
            },
            connect_timeout: Duration::from_secs_f64(a.connect_timeout),
            upstream_timeout,
            max_retries: a.max_retries,
            queue_timeout: Duration::from_secs_f64(a.queue_timeout),
            affinity: !a.no_affinity,
            affinity_slack: a.affinity_slack,
            api_keys: a.keys.unnamed_keys(),
            keys: named,
            limiter,
            cache,
            tls,
            cors: a.cors.config(),
            body_timeout: secs(a.timeout_body),
            keep_alive_timeout: secs(a.timeout_keep_alive),
            max_connections: max_connections(a.max_connections)?,
            shutdown_timeout: secs(a.shutdown_timeout),
            ..GatewayConfig::default()
        };
        let addr = format!("{}:{}", config.host, config.port);
        let gateway = Gateway::start(config).await?;
        let listener = TcpListener::bind(&addr)
            .await
            .with_context(|| format!("cannot listen on {addr}"))?;
        banner(&gateway, listener.local_addr().ok());
        kimi_gateway::serve_listener(
            listener,
            gateway,
            shutdown_signal(signals, a.shutdown_timeout),
        )
        .await
        .context("the gateway failed")
    });
    runtime.shutdown_timeout(Duration::from_secs(1));
    result
}

fn banner(gateway: &Gateway, addr: Option<std::net::SocketAddr>) {
    let config = gateway.config();
    for url in &config.upstreams {
        tracing::info!("upstream {url}");
    }
    tracing::info!(
        "routing least outstanding requests{}; health every {}s (timeout {}s, eject after \
         {}, back after {}); up to {} retries",
        if config.affinity {
            format!(", conversation affinity (slack {})", config.affinity_slack)
        } else {
            String::new()
        },
        config.health.interval.as_secs_f64(),
        config.health.timeout.as_secs_f64(),
        config.health.unhealthy_after,
        config.health.healthy_after,
        config.max_retries
    );
    if let Some(cache) = &config.cache {
        tracing::info!("cache   {cache:?}");
    }
    let keys = config.api_keys.len() + config.keys.len();
    let scheme = if config.tls.is_some() {
        "https"
    } else {
        "http"
    };
    let url = addr.map_or_else(
        || format!("{scheme}://{}:{}", config.host, config.port),
        |a| format!("{scheme}://{a}"),
    );
    crate::access_args::log_access(
        keys,
        config.limiter.as_deref(),
        config.tls.is_some(),
        config.cors.as_ref(),
        &url,
    );
    if keys == 0 && !is_loopback(&config.host) {
        tracing::warn!(
            "listening on {} without --api-key: anyone who can reach this address can use \
             the upstreams",
            config.host
        );
    }
    let healthy = gateway.healthy_upstreams();
    if healthy == 0 {
        tracing::warn!("no upstream is healthy yet: requests wait for one");
    }
    tracing::info!(
        "gateway for {} upstreams ({healthy} healthy) on {url}",
        config.upstreams.len()
    );
}
