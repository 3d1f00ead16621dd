//! Per-key limits: requests per minute, tokens per minute and requests in flight, held in
//! this process's memory or in Redis (so that several gateways or servers share them).
//!
//! ```text
//! request ─► admit(key): tokens this minute < tpm? in flight < concurrency? requests this minute < rpm?
//!              │ yes: a Lease (the in-flight slot)      no: 429 + Retry-After (OpenAI's error body)
//!              ▼
//!          response body ends ─► Lease dropped: the request's tokens charged to this minute,
//!                                the in-flight slot freed
//! ```
//!
//! Minutes are fixed windows (Unix time / 60, by each process's clock: processes sharing a
//! Redis should keep their clocks in sync), as Redis `INCR` + `EXPIRE` counters are:
//! a refusal's `Retry-After` is the time left in the window (1 s for the in-flight cap).
//! Tokens are known only when a request ends, so a request is admitted while the minute's
//! tokens are under the limit and its own tokens are charged at its end.
//!
//! In Redis each check is one Lua script (atomic across gateways): per key and minute a
//! request counter and a token counter that expire after two minutes, and a sorted set of
//! in-flight leases scored by their expiry (a gateway that dies cannot hold slots past
//! `lease_ttl`). If Redis cannot be reached the request is admitted (limits fail open) and
//! a warning is logged; `kimi:rate_limit_store_errors_total` counts these.

use std::collections::{BTreeMap, HashMap};
use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::http::{header, HeaderValue};
use axum::response::{IntoResponse, Response};

use crate::error::ApiError;
use crate::keys::KeyLimits;
use crate::prometheus::{escape, header as metric_header};

/// Which limit refused a request.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum LimitKind {
    /// Requests per minute.
    Requests,
    /// Tokens per minute.
    Tokens,
    /// Requests in flight.
    Concurrency,
}

impl LimitKind {
    /// `requests`, `tokens`, `concurrency` (the `limit` label of the metrics).
    pub fn label(self) -> &'static str {
        match self {
            LimitKind::Requests => "requests",
            LimitKind::Tokens => "tokens",
            LimitKind::Concurrency => "concurrency",
        }
    }
}

/// A refused request: which limit, its value, and when to retry.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Refusal {
    /// The key's name.
    pub key: String,
    /// The limit that refused.
    pub kind: LimitKind,
    /// Its value.
    pub limit: u64,
    /// Seconds until a retry can succeed (the `Retry-After` header).
    pub retry_after: u64,
}

impl Refusal {
    /// OpenAI's 429 body (`rate_limit_error`, `rate_limit_exceeded`).
    pub fn to_api_error(&self) -> ApiError {
        let what = match self.kind {
            LimitKind::Requests => format!("{} requests per minute", self.limit),
            LimitKind::Tokens => format!("{} tokens per minute", self.limit),
            LimitKind::Concurrency => format!("{} requests in flight", self.limit),
        };
        ApiError::rate_limited(format!(
            "Rate limit reached for API key `{}`: {what}. Retry in {} s.",
            self.key, self.retry_after
        ))
    }
}

impl IntoResponse for Refusal {
    fn into_response(self) -> Response {
        let mut response = self.to_api_error().into_response();
        if let Ok(value) = HeaderValue::from_str(&self.retry_after.to_string()) {
            response.headers_mut().insert(header::RETRY_AFTER, value);
        }
        response
    }
}

/// Why a limits store could not be set up.
#[derive(Debug, thiserror::Error)]
#[error("cannot use Redis at {url} for rate limits: {source}")]
pub struct LimitStoreError {
    url: String,
    #[source]
    source: redis::RedisError,
}

/// Counters of one key in this process.
#[derive(Debug, Default)]
struct LocalUsage {
    minute: u64,
    requests: u64,
    tokens: u64,
    in_flight: u64,
}

enum Store {
    Memory(Mutex<HashMap<String, LocalUsage>>),
    Redis(RedisStore),
}

struct RedisStore {
    url: String,
    conn: redis::aio::ConnectionManager,
    prefix: String,
    admit: redis::Script,
}

/// The admission script (see the module docs). KEYS: requests, tokens, leases;
/// ARGV: rpm, tpm, concurrency (0: none), now (ms), lease id, lease ttl (ms).
/// Returns 0 (admitted), 1 (requests), 2 (tokens) or 3 (concurrency).
const ADMIT_LUA: &str = r"
local rpm, tpm, conc = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local now, ttl = tonumber(ARGV[4]), tonumber(ARGV[6])
if tpm > 0 and tonumber(redis.call('GET', KEYS[2]) or '0') >= tpm then return 2 end
if conc > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now)
  if redis.call('ZCARD', KEYS[3]) >= conc then return 3 end
end
if rpm > 0 then
  local n = redis.call('INCR', KEYS[1])
  if n == 1 then redis.call('EXPIRE', KEYS[1], 120) end
  if n > rpm then return 1 end
end
if conc > 0 then
  redis.call('ZADD', KEYS[3], now + ttl, ARGV[5])
  redis.call('PEXPIRE', KEYS[3], ttl)
end
return 0
";

/// Per-key limits and their counters.
pub struct Limiter {
    defaults: KeyLimits,
    store: Store,
    /// How long an in-flight slot may be held in Redis without being released.
    lease_ttl: Duration,
    next_lease: AtomicU64,
    /// Leases are unique across processes sharing a Redis.
    instance: String,
    refused: Mutex<BTreeMap<(String, LimitKind), u64>>,
    store_errors: Arc<AtomicU64>,
    last_warning: Mutex<Option<std::time::Instant>>,
}

impl std::fmt::Debug for Limiter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let store = match &self.store {
            Store::Memory(_) => "memory".to_string(),
            Store::Redis(r) => format!("redis {}", r.url),
        };
        f.debug_struct("Limiter")
            .field("defaults", &self.defaults)
            .field("store", &store)
            .finish_non_exhaustive()
    }
}

fn now() -> Duration {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default()
}

impl Limiter {
    /// Limits counted in this process; `defaults` apply to keys that set none of their own.
    pub fn in_memory(defaults: KeyLimits) -> Limiter {
        Self::with_store(defaults, Store::Memory(Mutex::new(HashMap::new())))
    }

    /// Limits counted in Redis at `url` (`redis://host:port/db`), under keys starting with
    /// `prefix`; `lease_ttl` bounds how long a crashed holder keeps an in-flight slot.
    ///
    /// # Errors
    ///
    /// [`LimitStoreError`] if the URL is invalid or Redis does not answer within 5 s.
    pub async fn in_redis(
        defaults: KeyLimits,
        url: &str,
        prefix: &str,
        lease_ttl: Duration,
    ) -> Result<Limiter, LimitStoreError> {
        let conn = connect_redis(url).await.map_err(|source| LimitStoreError {
            url: url.to_string(),
            source,
        })?;
        let store = Store::Redis(RedisStore {
            url: url.to_string(),
            conn,
            prefix: prefix.to_string(),
            admit: redis::Script::new(ADMIT_LUA),
        });
        let mut limiter = Self::with_store(defaults, store);
        limiter.lease_ttl = lease_ttl;
        Ok(limiter)
    }

    fn with_store(defaults: KeyLimits, store: Store) -> Limiter {
        let t = now();
        Limiter {
            defaults,
            store,
            lease_ttl: Duration::from_secs(600),
            next_lease: AtomicU64::new(0),
            instance: format!(
                "{}-{:x}{:x}",
                std::process::id(),
                t.as_secs(),
                t.subsec_nanos()
            ),
            refused: Mutex::new(BTreeMap::new()),
            store_errors: Arc::new(AtomicU64::new(0)),
            last_warning: Mutex::new(None),
        }
    }

    /// "per key by default: 60 requests/min, no token limit, 4 in flight; in memory".
    pub fn describe(&self) -> String {
        let show = |v: Option<u64>, unit: &str| {
            v.map_or(format!("no {unit} limit"), |v| format!("{v} {unit}"))
        };
        let store = match &self.store {
            Store::Memory(_) => "counted in memory".to_string(),
            Store::Redis(r) => format!("counted in Redis at {}", r.url),
        };
        format!(
            "per key by default: {}, {}, {}; {store}",
            show(self.defaults.requests_per_minute, "requests/min"),
            show(self.defaults.tokens_per_minute, "tokens/min"),
            show(self.defaults.max_concurrent, "in flight"),
        )
    }

    /// The limits for a key: its own, else the defaults.
    pub fn effective(&self, own: KeyLimits) -> KeyLimits {
        own.or(self.defaults)
    }

    /// Admits a request of key `name` (with its own limits `own`), or refuses it. The lease
    /// holds the in-flight slot until it is dropped, and charges the tokens given to
    /// [`Lease::add_tokens`] then.
    ///
    /// # Errors
    ///
    /// [`Refusal`] for a request over one of the limits.
    pub async fn admit(self: &Arc<Self>, name: &str, own: KeyLimits) -> Result<Lease, Refusal> {
        let limits = self.effective(own);
        let id = format!(
            "{}-{}",
            self.instance,
            self.next_lease.fetch_add(1, Ordering::Relaxed)
        );
        let t = now();
        let minute = t.as_secs() / 60;
        let outcome = match &self.store {
            Store::Memory(map) => Ok(admit_local(map, name, &limits, minute)),
            Store::Redis(redis) => self.admit_redis(redis, name, &limits, minute, t, &id).await,
        };
        let refused = match outcome {
            Ok(refused) => refused,
            Err(e) => {
                self.store_failed(&e);
                None
            }
        };
        if let Some(kind) = refused {
            *self
                .refused
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .entry((name.to_string(), kind))
                .or_default() += 1;
            let (limit, retry_after) = match kind {
                LimitKind::Requests => (limits.requests_per_minute, 60 - t.as_secs() % 60),
                LimitKind::Tokens => (limits.tokens_per_minute, 60 - t.as_secs() % 60),
                LimitKind::Concurrency => (limits.max_concurrent, 1),
            };
            return Err(Refusal {
                key: name.to_string(),
                kind,
                limit: limit.unwrap_or(0),
                retry_after: retry_after.max(1),
            });
        }
        Ok(Lease {
            limiter: Arc::clone(self),
            name: name.to_string(),
            id,
            limits,
            tokens: 0,
        })
    }

    async fn admit_redis(
        &self,
        redis: &RedisStore,
        name: &str,
        limits: &KeyLimits,
        minute: u64,
        t: Duration,
        id: &str,
    ) -> Result<Option<LimitKind>, redis::RedisError> {
        if limits.is_unlimited() {
            return Ok(None);
        }
        let base = format!("{}:{name}", redis.prefix);
        let mut conn = redis.conn.clone();
        let code: i64 = redis
            .admit
            .key(format!("{base}:requests:{minute}"))
            .key(format!("{base}:tokens:{minute}"))
            .key(format!("{base}:in-flight"))
            .arg(limits.requests_per_minute.unwrap_or(0))
            .arg(limits.tokens_per_minute.unwrap_or(0))
            .arg(limits.max_concurrent.unwrap_or(0))
            .arg(t.as_millis() as u64)
            .arg(id)
            .arg(self.lease_ttl.as_millis() as u64)
            .invoke_async(&mut conn)
            .await?;
        Ok(match code {
            1 => Some(LimitKind::Requests),
            2 => Some(LimitKind::Tokens),
            3 => Some(LimitKind::Concurrency),
            _ => None,
        })
    }

    /// Ends a lease: charges its tokens, frees its slot.
    fn release(&self, lease: &Lease) {
        let minute = now().as_secs() / 60;
        match &self.store {
            Store::Memory(map) => {
                let mut map = map.lock().unwrap_or_else(PoisonError::into_inner);
                if let Some(usage) = map.get_mut(&lease.name) {
                    roll(usage, minute);
                    usage.tokens += lease.tokens;
                    if lease.limits.max_concurrent.is_some() {
                        usage.in_flight = usage.in_flight.saturating_sub(1);
                    }
                }
            }
            Store::Redis(redis) => {
                let charge = lease.limits.tokens_per_minute.is_some() && lease.tokens > 0;
                let free = lease.limits.max_concurrent.is_some();
                if !charge && !free {
                    return;
                }
                let base = format!("{}:{}", redis.prefix, lease.name);
                let mut pipe = redis::pipe();
                pipe.atomic();
                if charge {
                    let key = format!("{base}:tokens:{minute}");
                    pipe.incr(&key, lease.tokens).ignore();
                    pipe.expire(&key, 120).ignore();
                }
                if free {
                    pipe.zrem(format!("{base}:in-flight"), &lease.id).ignore();
                }
                let mut conn = redis.conn.clone();
                let Ok(runtime) = tokio::runtime::Handle::try_current() else {
                    return;
                };
                let errors = Arc::clone(&self.store_errors);
                runtime.spawn(async move {
                    let done: Result<(), redis::RedisError> = pipe.query_async(&mut conn).await;
                    if let Err(e) = done {
                        errors.fetch_add(1, Ordering::Relaxed);
                        tracing::warn!("rate limits: cannot update Redis: {e}");
                    }
                });
            }
        }
    }

    fn store_failed(&self, e: &redis::RedisError) {
        self.store_errors.fetch_add(1, Ordering::Relaxed);
        let mut last = self
            .last_warning
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if last.is_none_or(|t| t.elapsed() > Duration::from_secs(10)) {
            *last = Some(std::time::Instant::now());
            tracing::warn!("rate limits: Redis failed ({e}); admitting requests unchecked");
        }
    }

    /// Prometheus text: refusals by key and limit, and store errors.
    pub fn render_metrics(&self, out: &mut String) {
        metric_header(
            out,
            "kimi:rate_limited_requests_total",
            "Requests refused with 429 by a per-key limit, by key name and limit.",
            "counter",
        );
        let refused = self.refused.lock().unwrap_or_else(PoisonError::into_inner);
        for ((key, kind), count) in refused.iter() {
            let _ = writeln!(
                out,
                "kimi:rate_limited_requests_total{{key=\"{}\",limit=\"{}\"}} {count}",
                escape(key),
                kind.label()
            );
        }
        drop(refused);
        metric_header(
            out,
            "kimi:rate_limit_store_errors_total",
            "Rate-limit checks or updates that Redis failed (those requests were admitted).",
            "counter",
        );
        let errors = self.store_errors.load(Ordering::Relaxed);
        let _ = writeln!(out, "kimi:rate_limit_store_errors_total {errors}");
    }
}

/// Starts a new minute's counters when the minute has changed.
fn roll(usage: &mut LocalUsage, minute: u64) {
    if usage.minute != minute {
        usage.minute = minute;
        usage.requests = 0;
        usage.tokens = 0;
    }
}

fn admit_local(
    map: &Mutex<HashMap<String, LocalUsage>>,
    name: &str,
    limits: &KeyLimits,
    minute: u64,
) -> Option<LimitKind> {
    if limits.is_unlimited() {
        return None;
    }
    let mut map = map.lock().unwrap_or_else(PoisonError::into_inner);
    let usage = map.entry(name.to_string()).or_default();
    roll(usage, minute);
    if limits
        .tokens_per_minute
        .is_some_and(|tpm| usage.tokens >= tpm)
    {
        return Some(LimitKind::Tokens);
    }
    if limits
        .max_concurrent
        .is_some_and(|max| usage.in_flight >= max)
    {
        return Some(LimitKind::Concurrency);
    }
    if let Some(rpm) = limits.requests_per_minute {
        usage.requests += 1;
        if usage.requests > rpm {
            return Some(LimitKind::Requests);
        }
    }
    if limits.max_concurrent.is_some() {
        usage.in_flight += 1;
    }
    None
}

/// Opens a Redis connection that reconnects by itself, with 5 s connect and response
/// timeouts (a request never waits longer than that on a limit or cache check).
///
/// # Errors
///
/// The client's error for a bad URL or a server that does not answer.
pub async fn connect_redis(url: &str) -> Result<redis::aio::ConnectionManager, redis::RedisError> {
    let client = redis::Client::open(url)?;
    let config = redis::aio::ConnectionManagerConfig::new()
        .set_connection_timeout(Duration::from_secs(5))
        .set_response_timeout(Duration::from_secs(5))
        .set_number_of_retries(1);
    let mut conn = redis::aio::ConnectionManager::new_with_config(client, config).await?;
    // Fail at start, not at the first request, when the server is not there.
    let _: String = redis::cmd("PING").query_async(&mut conn).await?;
    Ok(conn)
}

/// A request's in-flight slot; dropping it charges its tokens and frees the slot.
pub struct Lease {
    limiter: Arc<Limiter>,
    name: String,
    id: String,
    limits: KeyLimits,
    tokens: u64,
}

impl std::fmt::Debug for Lease {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Lease")
            .field("key", &self.name)
            .field("tokens", &self.tokens)
            .finish_non_exhaustive()
    }
}

impl Lease {
    /// Counts tokens the request used (charged when the lease ends).
    pub fn add_tokens(&mut self, tokens: u64) {
        self.tokens = self.tokens.saturating_add(tokens);
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        let limiter = Arc::clone(&self.limiter);
        limiter.release(self);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits(rpm: Option<u64>, tpm: Option<u64>, conc: Option<u64>) -> KeyLimits {
        KeyLimits {
            requests_per_minute: rpm,
            tokens_per_minute: tpm,
            max_concurrent: conc,
        }
    }

    #[tokio::test]
    async fn memory_limits_refuse_and_recover() {
        let limiter = Arc::new(Limiter::in_memory(limits(Some(3), None, None)));
        // The defaults apply to a key without its own limits.
        let mut held = Vec::new();
        for _ in 0..3 {
            held.push(
                limiter
                    .admit("a", KeyLimits::default())
                    .await
                    .expect("admitted"),
            );
        }
        let refusal = limiter
            .admit("a", KeyLimits::default())
            .await
            .expect_err("4th request");
        assert_eq!(refusal.kind, LimitKind::Requests);
        assert!((1..=60).contains(&refusal.retry_after));
        // Keys are counted apart.
        limiter.admit("b", KeyLimits::default()).await.expect("b");

        let own = limits(None, None, Some(1));
        let first = limiter.admit("c", own).await.expect("first");
        let busy = limiter.admit("c", own).await.expect_err("second in flight");
        assert_eq!((busy.kind, busy.retry_after), (LimitKind::Concurrency, 1));
        drop(first);
        limiter.admit("c", own).await.expect("slot freed");

        let tpm = limits(None, Some(10), None);
        let mut lease = limiter.admit("d", tpm).await.expect("first");
        lease.add_tokens(12);
        drop(lease);
        let spent = limiter.admit("d", tpm).await.expect_err("tokens spent");
        assert_eq!(spent.kind, LimitKind::Tokens);
        let body = spent.to_api_error().to_json();
        assert_eq!(body["error"]["type"], "rate_limit_error");
        assert!(body["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("10 tokens per minute")));
        let response = spent.into_response();
        assert_eq!(response.status().as_u16(), 429);
        assert!(response.headers().contains_key(header::RETRY_AFTER));

        let mut text = String::new();
        limiter.render_metrics(&mut text);
        assert!(text.contains("kimi:rate_limited_requests_total{key=\"a\",limit=\"requests\"} 1\n"));
        assert!(text.contains("{key=\"d\",limit=\"tokens\"} 1\n"));
    }
}
