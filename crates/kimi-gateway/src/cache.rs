//! The response cache (opt-in): deterministic requests answered again without the
//! upstream.
//!
//! A request is cached only when its output cannot vary: `temperature` 0, or a `seed`.
//! The key is the SHA-256 of the API key's name (one key never sees another's entries),
//! the path and the request's JSON. A streamed request is stored as the exact SSE events
//! its client got and replayed event by event; a non-streamed one as its JSON body. Only
//! complete 200 responses are stored (never errors, never a stream that failed or was cut);
//! a stream whose `stream_options` ask for anything but `include_usage` and
//! `continuous_usage_stats` is not cached (its events might depend on what the cache
//! cannot replay). `Cache-Control: no-store` on a request bypasses the cache;
//! `no-cache` skips the lookup but stores the answer.
//!
//! Entries live in this process's memory (LRU, bounded in bytes, with a TTL) or in Redis,
//! shared by several gateways: one Lua script stores an entry with its TTL and evicts the
//! oldest entries while the total passes the byte bound (a sorted set of entries by expiry,
//! a hash of their sizes, a byte counter).

use std::collections::{BTreeMap, HashMap};
use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use axum::http::HeaderMap;
use bytes::Bytes;
use kimi_server::prometheus::header;
use serde_json::Value;
use sha2::{Digest, Sha256};

/// Why a cache could not be set up.
#[derive(Debug, thiserror::Error)]
#[error("cannot use Redis at {url} for the response cache: {source}")]
pub struct CacheStoreError {
    url: String,
    #[source]
    source: redis::RedisError,
}

/// What a stored response is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Kind {
    /// A JSON body.
    Json,
    /// SSE events, as sent.
    Events,
}

/// A stored response.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Entry {
    pub kind: Kind,
    pub body: Bytes,
}

impl Entry {
    fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(self.body.len() + 1);
        out.push(match self.kind {
            Kind::Json => b'J',
            Kind::Events => b'S',
        });
        out.extend_from_slice(&self.body);
        out
    }

    fn decode(bytes: &[u8]) -> Option<Entry> {
        let (&tag, body) = bytes.split_first()?;
        let kind = match tag {
            b'J' => Kind::Json,
            b'S' => Kind::Events,
            _ => return None,
        };
        Some(Entry {
            kind,
            body: Bytes::copy_from_slice(body),
        })
    }
}

/// What the cache does for one request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Policy {
    /// Not cacheable (or `no-store`): the `x-kimi-cache: bypass` answer.
    Bypass,
    /// Cacheable under `key`; `lookup` is false for `Cache-Control: no-cache`.
    Use { key: String, lookup: bool },
}

/// `stream_options` fields a recorded stream replays faithfully.
const REPLAYABLE_STREAM_OPTIONS: &[&str] = &["include_usage", "continuous_usage_stats"];

/// The cache policy of a request to `path` by key `key_name`.
pub(crate) fn policy(key_name: &str, path: &str, body: &Value, headers: &HeaderMap) -> Policy {
    let directives = headers
        .get_all(axum::http::header::CACHE_CONTROL)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .map(|d| d.trim().to_ascii_lowercase())
        .collect::<Vec<_>>();
    if directives.iter().any(|d| d == "no-store") {
        return Policy::Bypass;
    }
    if !deterministic(body) {
        return Policy::Bypass;
    }
    if let Some(options) = body.get("stream_options") {
        let replayable = match options {
            Value::Null => true,
            Value::Object(fields) => fields
                .keys()
                .all(|k| REPLAYABLE_STREAM_OPTIONS.contains(&k.as_str())),
            _ => false,
        };
        if !replayable {
            return Policy::Bypass;
        }
    }
    let mut hash = Sha256::new();
    for part in [
        b"kimi-gateway-cache-v1".as_slice(),
        key_name.as_bytes(),
        path.as_bytes(),
    ] {
        hash.update((part.len() as u64).to_le_bytes());
        hash.update(part);
    }
    hash.update(body.to_string().as_bytes());
    let key = hash
        .finalize()
        .iter()
        .fold(String::with_capacity(64), |mut s, b| {
            let _ = write!(s, "{b:02x}");
            s
        });
    Policy::Use {
        key,
        lookup: !directives.iter().any(|d| d == "no-cache"),
    }
}

/// Temperature 0, or a fixed seed.
fn deterministic(body: &Value) -> bool {
    let greedy = body
        .get("temperature")
        .and_then(Value::as_f64)
        .is_some_and(|t| t == 0.0);
    let seeded = body.get("seed").is_some_and(|s| s.is_i64() || s.is_u64());
    greedy || seeded
}

struct MemEntry {
    entry: Entry,
    expires: Instant,
    tick: u64,
    size: usize,
}

#[derive(Default)]
struct Memory {
    map: HashMap<String, MemEntry>,
    /// Recency: tick → key.
    order: BTreeMap<u64, String>,
    tick: u64,
    bytes: usize,
}

impl Memory {
    fn remove(&mut self, key: &str) {
        if let Some(old) = self.map.remove(key) {
            self.order.remove(&old.tick);
            self.bytes -= old.size;
        }
    }
}

enum Store {
    Memory(Mutex<Memory>),
    Redis {
        conn: redis::aio::ConnectionManager,
        prefix: String,
        put: redis::Script,
    },
}

/// Stores an entry (see the module docs). KEYS: entry, index (by expiry), sizes, bytes;
/// ARGV: value, ttl (ms), now (ms), max bytes. Returns 1 if stored.
const PUT_LUA: &str = r"
local ttl, now, max = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local function drop(m)
  local size = tonumber(redis.call('HGET', KEYS[3], m) or '0')
  redis.call('DEL', m)
  redis.call('ZREM', KEYS[2], m)
  redis.call('HDEL', KEYS[3], m)
  return redis.call('DECRBY', KEYS[4], size)
end
for _, m in ipairs(redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', now)) do drop(m) end
local size = string.len(ARGV[1])
if size > max then return 0 end
if redis.call('EXISTS', KEYS[1]) == 1 then drop(KEYS[1]) end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ttl)
redis.call('ZADD', KEYS[2], now + ttl, KEYS[1])
redis.call('HSET', KEYS[3], KEYS[1], size)
local total = redis.call('INCRBY', KEYS[4], size)
while total > max do
  local oldest = redis.call('ZRANGE', KEYS[2], 0, 0)
  if #oldest == 0 then break end
  total = drop(oldest[1])
end
return 1
";

/// The cache and its counters.
pub struct ResponseCache {
    store: Store,
    ttl: Duration,
    max_bytes: usize,
    /// Larger responses are not stored.
    max_entry_bytes: usize,
    hits: AtomicU64,
    misses: AtomicU64,
    bypassed: AtomicU64,
    stored: AtomicU64,
    errors: AtomicU64,
}

impl std::fmt::Debug for ResponseCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let store = match &self.store {
            Store::Memory(_) => "memory",
            Store::Redis { .. } => "redis",
        };
        f.debug_struct("ResponseCache")
            .field("store", &store)
            .field("ttl", &self.ttl)
            .field("max_bytes", &self.max_bytes)
            .finish_non_exhaustive()
    }
}

impl ResponseCache {
    /// A cache in this process: at most `max_bytes` of responses, each kept `ttl`.
    pub fn in_memory(max_bytes: usize, ttl: Duration) -> ResponseCache {
        Self::with_store(Store::Memory(Mutex::new(Memory::default())), max_bytes, ttl)
    }

    /// A cache in Redis at `url`, under keys starting with `prefix`, shared by every
    /// gateway that uses the same URL and prefix.
    ///
    /// # Errors
    ///
    /// [`CacheStoreError`] if the URL is invalid or Redis does not answer.
    pub async fn in_redis(
        url: &str,
        prefix: &str,
        max_bytes: usize,
        ttl: Duration,
    ) -> Result<ResponseCache, CacheStoreError> {
        let conn = kimi_server::limits::connect_redis(url)
            .await
            .map_err(|source| CacheStoreError {
                url: url.to_string(),
                source,
            })?;
        let store = Store::Redis {
            conn,
            prefix: prefix.to_string(),
            put: redis::Script::new(PUT_LUA),
        };
        Ok(Self::with_store(store, max_bytes, ttl))
    }

    fn with_store(store: Store, max_bytes: usize, ttl: Duration) -> ResponseCache {
        ResponseCache {
            store,
            ttl,
            max_bytes,
            max_entry_bytes: (max_bytes / 4).max(1),
            hits: AtomicU64::new(0),
            misses: AtomicU64::new(0),
            bypassed: AtomicU64::new(0),
            stored: AtomicU64::new(0),
            errors: AtomicU64::new(0),
        }
    }

    /// The largest response stored (a quarter of the bound).
    pub(crate) fn max_entry_bytes(&self) -> usize {
        self.max_entry_bytes
    }

    /// Counts a bypassed request.
    pub(crate) fn bypassed(&self) {
        self.bypassed.fetch_add(1, Ordering::Relaxed);
    }

    /// The entry under `key`, counting a hit or a miss.
    pub(crate) async fn get(&self, key: &str) -> Option<Entry> {
        let found = match &self.store {
            Store::Memory(memory) => {
                let mut m = memory.lock().unwrap_or_else(PoisonError::into_inner);
                let now = Instant::now();
                match m.map.get(key).map(|e| e.expires > now) {
                    Some(true) => {
                        m.tick += 1;
                        let tick = m.tick;
                        let entry = m.map.get_mut(key).map(|e| {
                            let old = std::mem::replace(&mut e.tick, tick);
                            (old, e.entry.clone())
                        });
                        entry.map(|(old, entry)| {
                            m.order.remove(&old);
                            m.order.insert(tick, key.to_string());
                            entry
                        })
                    }
                    Some(false) => {
                        m.remove(key);
                        None
                    }
                    None => None,
                }
            }
            Store::Redis { conn, prefix, .. } => {
                let mut conn = conn.clone();
                let got: Result<Option<Vec<u8>>, _> = redis::cmd("GET")
                    .arg(format!("{prefix}:entry:{key}"))
                    .query_async(&mut conn)
                    .await;
                match got {
                    Ok(bytes) => bytes.and_then(|b| Entry::decode(&b)),
                    Err(e) => {
                        self.failed(&e);
                        None
                    }
                }
            }
        };
        let counter = if found.is_some() {
            &self.hits
        } else {
            &self.misses
        };
        counter.fetch_add(1, Ordering::Relaxed);
        found
    }

    /// Stores `entry` under `key` (if it fits).
    pub(crate) async fn put(&self, key: &str, entry: Entry) {
        let encoded = entry.encode();
        let size = encoded.len() + key.len();
        if size > self.max_entry_bytes {
            return;
        }
        match &self.store {
            Store::Memory(memory) => {
                let mut m = memory.lock().unwrap_or_else(PoisonError::into_inner);
                m.remove(key);
                m.tick += 1;
                let tick = m.tick;
                m.order.insert(tick, key.to_string());
                m.bytes += size;
                m.map.insert(
                    key.to_string(),
                    MemEntry {
                        entry,
                        expires: Instant::now() + self.ttl,
                        tick,
                        size,
                    },
                );
                while m.bytes > self.max_bytes {
                    let Some((_, oldest)) = m.order.pop_first() else {
                        break;
                    };
                    if let Some(old) = m.map.remove(&oldest) {
                        m.bytes -= old.size;
                    }
                }
            }
            Store::Redis { conn, prefix, put } => {
                let now = SystemTime::now()
                    .duration_since(UNIX_EPOCH)
                    .unwrap_or_default()
                    .as_millis() as u64;
                let mut conn = conn.clone();
                let stored: Result<i64, _> = put
                    .key(format!("{prefix}:entry:{key}"))
                    .key(format!("{prefix}:index"))
                    .key(format!("{prefix}:sizes"))
                    .key(format!("{prefix}:bytes"))
                    .arg(encoded)
                    .arg(self.ttl.as_millis().max(1) as u64)
                    .arg(now)
                    .arg(self.max_bytes as u64)
                    .invoke_async(&mut conn)
                    .await;
                if let Err(e) = stored {
                    self.failed(&e);
                    return;
                }
            }
        }
        self.stored.fetch_add(1, Ordering::Relaxed);
    }

    fn failed(&self, e: &redis::RedisError) {
        if self
            .errors
            .fetch_add(1, Ordering::Relaxed)
            .is_multiple_of(100)
        {
            tracing::warn!("response cache: Redis failed ({e}); answering from upstreams");
        }
    }

    /// Prometheus text: hits, misses, bypasses, stores, errors, and for a memory cache its
    /// bytes and entries.
    pub(crate) fn render_metrics(&self, out: &mut String) {
        let counters = [
            (
                "kimi:gateway_cache_hits_total",
                "Requests answered from the response cache.",
                &self.hits,
            ),
            (
                "kimi:gateway_cache_misses_total",
                "Cacheable requests not found in the response cache.",
                &self.misses,
            ),
            (
                "kimi:gateway_cache_bypassed_total",
                "Requests the cache does not apply to (not deterministic, stream options, no-store).",
                &self.bypassed,
            ),
            (
                "kimi:gateway_cache_stores_total",
                "Responses stored in the cache.",
                &self.stored,
            ),
            (
                "kimi:gateway_cache_errors_total",
                "Cache reads or writes that Redis failed.",
                &self.errors,
            ),
        ];
        for (name, help, value) in counters {
            header(out, name, help, "counter");
            let _ = writeln!(out, "{name} {}", value.load(Ordering::Relaxed));
        }
        if let Store::Memory(memory) = &self.store {
            let m = memory.lock().unwrap_or_else(PoisonError::into_inner);
            header(
                out,
                "kimi:gateway_cache_bytes",
                "Bytes of responses held by the in-memory cache.",
                "gauge",
            );
            let _ = writeln!(out, "kimi:gateway_cache_bytes {}", m.bytes);
            header(
                out,
                "kimi:gateway_cache_entries",
                "Responses held by the in-memory cache.",
                "gauge",
            );
            let _ = writeln!(out, "kimi:gateway_cache_entries {}", m.map.len());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn key(p: &Policy) -> &str {
        match p {
            Policy::Use { key, .. } => key,
            Policy::Bypass => panic!("bypassed"),
        }
    }

    #[test]
    fn only_deterministic_requests_are_cacheable() {
        let h = HeaderMap::new();
        let path = "/v1/chat/completions";
        let greedy = json!({"model": "m", "temperature": 0, "messages": []});
        let seeded = json!({"model": "m", "temperature": 0.8, "seed": 7, "messages": []});
        let sampled = json!({"model": "m", "temperature": 0.8, "messages": []});
        let default = json!({"model": "m", "messages": []});
        assert!(matches!(
            policy("k", path, &greedy, &h),
            Policy::Use { lookup: true, .. }
        ));
        assert!(matches!(policy("k", path, &seeded, &h), Policy::Use { .. }));
        assert_eq!(policy("k", path, &sampled, &h), Policy::Bypass);
        assert_eq!(policy("k", path, &default, &h), Policy::Bypass);
        // Keys, paths and parameters separate entries.
        let a = policy("k", path, &greedy, &h);
        assert_ne!(key(&a), key(&policy("other", path, &greedy, &h)));
        assert_ne!(key(&a), key(&policy("k", "/v1/completions", &greedy, &h)));
        let longer = json!({"model": "m", "temperature": 0, "messages": [], "max_tokens": 5});
        assert_ne!(key(&a), key(&policy("k", path, &longer, &h)));
        assert_eq!(key(&a), key(&policy("k", path, &greedy, &h)));
    }

    #[test]
    fn stream_options_and_cache_control() {
        let path = "/v1/chat/completions";
        let usage =
            json!({"temperature": 0, "stream": true, "stream_options": {"include_usage": true}});
        let odd = json!({"temperature": 0, "stream": true, "stream_options": {"chunk_size": 4}});
        let h = HeaderMap::new();
        assert!(matches!(policy("k", path, &usage, &h), Policy::Use { .. }));
        assert_eq!(policy("k", path, &odd, &h), Policy::Bypass);
        let mut no_cache = HeaderMap::new();
        no_cache.insert("cache-control", "No-Cache".parse().expect("value"));
        assert!(matches!(
            policy("k", path, &usage, &no_cache),
            Policy::Use { lookup: false, .. }
        ));
        let mut no_store = HeaderMap::new();
        no_store.insert(
            "cache-control",
            "max-age=0, no-store".parse().expect("value"),
        );
        assert_eq!(policy("k", path, &usage, &no_store), Policy::Bypass);
    }

    #[tokio::test]
    async fn memory_cache_is_bounded_and_expires() {
        let cache = ResponseCache::in_memory(1000, Duration::from_millis(200));
        let entry = |n: usize| Entry {
            kind: Kind::Json,
            body: Bytes::from(vec![b'x'; n]),
        };
        assert_eq!(cache.get("a").await, None);
        cache.put("a", entry(100)).await;
        cache.put("b", entry(100)).await;
        assert_eq!(cache.get("a").await, Some(entry(100)));
        // Too large for one entry (a quarter of the bound): not stored.
        cache.put("big", entry(400)).await;
        assert_eq!(cache.get("big").await, None);
        // Filling past the bound evicts the least recently used ("b").
        for k in ["c", "d", "e", "f", "g", "h", "i", "j"] {
            cache.put(k, entry(100)).await;
            let _ = cache.get("a").await;
        }
        assert_eq!(cache.get("b").await, None);
        assert!(cache.get("a").await.is_some());
        let mut text = String::new();
        cache.render_metrics(&mut text);
        let bytes: usize = text
            .lines()
            .find_map(|l| l.strip_prefix("kimi:gateway_cache_bytes "))
            .and_then(|n| n.parse().ok())
            .expect("bytes gauge");
        assert!(bytes <= 1000, "{bytes}");
        tokio::time::sleep(Duration::from_millis(250)).await;
        assert_eq!(cache.get("a").await, None, "expired");
        assert!(text.contains("kimi:gateway_cache_hits_total "));
    }

    #[test]
    fn entries_round_trip() {
        for kind in [Kind::Json, Kind::Events] {
            let e = Entry {
                kind,
                body: Bytes::from_static(b"data: {}\n\n"),
            };
            assert_eq!(Entry::decode(&e.encode()), Some(e));
        }
        assert_eq!(Entry::decode(b""), None);
        assert_eq!(Entry::decode(b"Zx"), None);
    }
}
