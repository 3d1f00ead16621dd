//! Flags `serve` and `gateway` share: API keys and their limits, TLS, CORS; and what they
//! build (keys, the limiter, the rustls config, the CORS settings).

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use clap::Args;
use kimi_server::keys::{ApiKey, KeyLimits};
use kimi_server::limits::Limiter;
use kimi_server::CorsConfig;

/// API keys and per-key limits.
#[derive(Args, Debug, Clone)]
pub struct KeyArgs {
    /// Accepted API key (repeatable; also KIMI_API_KEY, comma-separated), named key-1,
    /// key-2, ... in logs and limits. With no key at all (nor --api-key-file, nor
    /// KIMI_API_KEYS=name=key,name=key), every client is served.
    #[arg(
        long = "api-key",
        env = "KIMI_API_KEY",
        value_delimiter = ',',
        hide_env_values = true
    )]
    pub api_keys: Vec<String>,
    /// File of named API keys, one per line: `NAME KEY [rpm=N] [tpm=N] [concurrency=N]`
    /// (`#` comments). Per-key values override --rpm-limit, --tpm-limit and
    /// --max-parallel-requests.
    #[arg(long, env = "KIMI_API_KEY_FILE")]
    pub api_key_file: Option<PathBuf>,
    /// Requests per minute per API key (fixed one-minute windows); past it: 429 with
    /// Retry-After. Without keys, all clients share one budget.
    #[arg(long)]
    pub rpm_limit: Option<u64>,
    /// Prompt + completion tokens per minute per API key (a request is admitted while the
    /// minute's tokens are under the limit; its tokens count when it ends).
    #[arg(long)]
    pub tpm_limit: Option<u64>,
    /// Requests in flight per API key (a stream counts until its last event).
    #[arg(long)]
    pub max_parallel_requests: Option<u64>,
    /// Keep the limits in this Redis (redis://HOST:PORT/DB) so that several gateways or
    /// servers share them; default: in this process's memory.
    #[arg(long, env = "KIMI_REDIS_URL")]
    pub redis_url: Option<String>,
    /// Prefix of every Redis key this process writes (limits and the response cache).
    #[arg(long, default_value = "kimi")]
    pub redis_prefix: String,
}

impl KeyArgs {
    /// The named keys: the key file's, then KIMI_API_KEYS's.
    pub fn named_keys(&self) -> anyhow::Result<Vec<ApiKey>> {
        let mut keys = match &self.api_key_file {
            Some(path) => ApiKey::read_file(path)?,
            None => Vec::new(),
        };
        if let Ok(list) = std::env::var("KIMI_API_KEYS") {
            keys.extend(ApiKey::parse_list(&list, "KIMI_API_KEYS")?);
        }
        Ok(keys)
    }

    /// The `--api-key` values that are not empty.
    pub fn unnamed_keys(&self) -> Vec<String> {
        self.api_keys
            .iter()
            .filter(|k| !k.is_empty())
            .cloned()
            .collect()
    }

    fn default_limits(&self) -> anyhow::Result<KeyLimits> {
        for (flag, value) in [
            ("--rpm-limit", self.rpm_limit),
            ("--tpm-limit", self.tpm_limit),
            ("--max-parallel-requests", self.max_parallel_requests),
        ] {
            anyhow::ensure!(value != Some(0), "{flag} must be at least 1");
        }
        Ok(KeyLimits {
            requests_per_minute: self.rpm_limit,
            tokens_per_minute: self.tpm_limit,
            max_concurrent: self.max_parallel_requests,
        })
    }

    /// The limiter, if any key or default sets a limit: in Redis with --redis-url, else in
    /// memory. `lease_ttl` bounds how long a crashed process holds an in-flight slot.
    pub async fn limiter(
        &self,
        named: &[ApiKey],
        lease_ttl: Duration,
    ) -> anyhow::Result<Option<Arc<Limiter>>> {
        let defaults = self.default_limits()?;
        if defaults.is_unlimited() && named.iter().all(|k| k.limits.is_unlimited()) {
            return Ok(None);
        }
        let limiter = match &self.redis_url {
            Some(url) => {
                let prefix = format!("{}:limits", self.redis_prefix);
                Limiter::in_redis(defaults, url, &prefix, lease_ttl).await?
            }
            None => Limiter::in_memory(defaults),
        };
        Ok(Some(Arc::new(limiter)))
    }
}

/// TLS (as vLLM and uvicorn name the flags).
#[derive(Args, Debug, Clone)]
pub struct TlsArgs {
    /// PEM private key for HTTPS (with --ssl-certfile).
    #[arg(long, requires = "ssl_certfile")]
    pub ssl_keyfile: Option<PathBuf>,
    /// PEM certificate chain for HTTPS, leaf first (with --ssl-keyfile).
    #[arg(long, requires = "ssl_keyfile")]
    pub ssl_certfile: Option<PathBuf>,
}

impl TlsArgs {
    pub fn load(&self) -> anyhow::Result<Option<Arc<rustls::ServerConfig>>> {
        match (&self.ssl_certfile, &self.ssl_keyfile) {
            (Some(cert), Some(key)) => Ok(Some(kimi_server::load_tls(cert, key)?)),
            _ => Ok(None),
        }
    }
}

/// CORS (as vLLM names the flags); off unless --allowed-origins is given.
#[derive(Args, Debug, Clone)]
pub struct CorsArgs {
    /// Origins that browsers may call the API from: a JSON list as vLLM takes it
    /// (`'["https://app.example.com"]'`), or comma-separated; `*` for any. Without it, no
    /// CORS headers are sent.
    #[arg(long, value_parser = parse_list)]
    pub allowed_origins: Option<List>,
    /// Methods allowed from other origins (JSON list or comma-separated; default any).
    #[arg(long, value_parser = parse_list, requires = "allowed_origins")]
    pub allowed_methods: Option<List>,
    /// Request headers allowed from other origins (JSON list or comma-separated; default
    /// any).
    #[arg(long, value_parser = parse_list, requires = "allowed_origins")]
    pub allowed_headers: Option<List>,
    /// Let browsers send credentials (cookies, HTTP auth) with cross-origin requests.
    #[arg(long, requires = "allowed_origins")]
    pub allow_credentials: bool,
}

/// A list flag's values (one flag value: a JSON list or comma-separated).
#[derive(Clone, Debug)]
pub struct List(pub Vec<String>);

fn parse_list(text: &str) -> Result<List, String> {
    kimi_server::parse_cors_list(text).map(List)
}

impl CorsArgs {
    pub fn config(&self) -> Option<CorsConfig> {
        let origins = self.allowed_origins.clone()?.0;
        let defaults = CorsConfig::default();
        Some(CorsConfig {
            allowed_origins: origins,
            allowed_methods: self
                .allowed_methods
                .clone()
                .map_or(defaults.allowed_methods, |l| l.0),
            allowed_headers: self
                .allowed_headers
                .clone()
                .map_or(defaults.allowed_headers, |l| l.0),
            allow_credentials: self.allow_credentials,
        })
    }
}

/// Logs how clients are let in: keys, limits, TLS, CORS.
pub fn log_access(
    keys: usize,
    limits: Option<&Limiter>,
    tls: bool,
    cors: Option<&CorsConfig>,
    url: &str,
) {
    let auth = match keys {
        0 => "none: every client is served".to_string(),
        1 => "1 API key".to_string(),
        n => format!("{n} API keys"),
    };
    let limits = limits.map_or("none".to_string(), Limiter::describe);
    tracing::info!("auth    {auth}; limits: {limits}");
    if tls {
        tracing::info!("tls     on ({url})");
    }
    if let Some(cors) = cors {
        tracing::info!("cors    origins {:?}", cors.allowed_origins);
    }
}
