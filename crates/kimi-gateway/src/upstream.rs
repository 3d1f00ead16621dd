//! The upstreams: their health (probed, and ejected at once when a connection to them
//! fails), the models they serve, their requests in flight, and the choice of one for a
//! request: least outstanding requests among the healthy ones that serve the model,
//! preferring the affine one while it is not much busier.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError, RwLock};
use std::time::{Duration, Instant};

use serde_json::Value;
use tokio::sync::{watch, Notify};

use crate::config::HealthConfig;
use crate::metrics::UpstreamMetrics;

/// Consecutive probe results.
#[derive(Debug, Default)]
struct Streak {
    failures: u32,
    successes: u32,
}

/// One upstream server.
pub(crate) struct Upstream {
    /// Base URL without a trailing slash.
    pub url: String,
    /// `true` while requests may go there. Attempts in flight watch it: an ejection
    /// aborts those that have sent nothing to their client yet, so they are retried.
    healthy: watch::Sender<bool>,
    streak: Mutex<Streak>,
    /// Requests in flight through the gateway.
    pub outstanding: AtomicUsize,
    /// Model cards from its `/v1/models`; `None` until it answered.
    pub models: RwLock<Option<Vec<Value>>>,
    pub metrics: UpstreamMetrics,
    pub ejections: AtomicU64,
}

impl Upstream {
    fn new(url: &str) -> Upstream {
        Upstream {
            url: url.trim_end_matches('/').to_string(),
            healthy: watch::Sender::new(false),
            streak: Mutex::new(Streak::default()),
            outstanding: AtomicUsize::new(0),
            models: RwLock::new(None),
            metrics: UpstreamMetrics::new(),
            ejections: AtomicU64::new(0),
        }
    }

    pub fn is_healthy(&self) -> bool {
        *self.healthy.borrow()
    }

    /// Resolves when the upstream is ejected.
    pub fn ejected(&self) -> impl std::future::Future<Output = ()> + Send + 'static {
        let mut rx = self.healthy.subscribe();
        async move {
            if rx.wait_for(|healthy| !*healthy).await.is_err() {
                std::future::pending::<()>().await;
            }
        }
    }

    /// Whether it serves `model` (an upstream whose list is unknown might).
    pub fn serves(&self, model: &str) -> bool {
        let models = self.models.read().unwrap_or_else(PoisonError::into_inner);
        models.as_ref().is_none_or(|cards| {
            cards
                .iter()
                .any(|card| card.get("id").and_then(Value::as_str) == Some(model))
        })
    }
}

/// Counts a request in flight on an upstream until dropped.
pub(crate) struct InFlight {
    upstream: Arc<Upstream>,
    started: Instant,
}

impl InFlight {
    pub fn new(upstream: &Arc<Upstream>) -> InFlight {
        upstream.outstanding.fetch_add(1, Ordering::AcqRel);
        InFlight {
            upstream: Arc::clone(upstream),
            started: Instant::now(),
        }
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.upstream.outstanding.fetch_sub(1, Ordering::AcqRel);
        self.upstream
            .metrics
            .duration
            .observe(self.started.elapsed().as_secs_f64());
    }
}

/// Why no upstream was chosen.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum NoUpstream {
    /// None of the upstreams serves the model (as far as their lists say).
    UnknownModel,
    /// Some would, but none is healthy (or all were tried).
    Unavailable,
}

/// All upstreams.
pub(crate) struct Pool {
    pub upstreams: Vec<Arc<Upstream>>,
    /// Rotates the start of the search, so ties spread over the upstreams.
    next: AtomicUsize,
    /// Woken when an upstream comes back.
    pub changed: Notify,
    /// Requests waiting for a healthy upstream.
    pub waiting: AtomicUsize,
}

impl Pool {
    pub fn new(urls: &[String]) -> Pool {
        Pool {
            upstreams: urls.iter().map(|u| Arc::new(Upstream::new(u))).collect(),
            next: AtomicUsize::new(0),
            changed: Notify::new(),
            waiting: AtomicUsize::new(0),
        }
    }

    /// The upstream for a request for `model`: the least outstanding among the healthy
    /// ones not yet `tried` that serve it; `affine` instead while it has at most `slack`
    /// more in flight than that one. The bool says whether `affine` was taken.
    pub fn choose(
        &self,
        model: Option<&str>,
        affine: Option<usize>,
        slack: usize,
        tried: &[usize],
    ) -> Result<(usize, bool), NoUpstream> {
        let n = self.upstreams.len();
        let serves = |u: &Upstream| model.is_none_or(|m| u.serves(m));
        if !self.upstreams.iter().any(|u| serves(u)) {
            return Err(NoUpstream::UnknownModel);
        }
        let start = self.next.fetch_add(1, Ordering::Relaxed);
        let mut best: Option<(usize, usize)> = None;
        for k in 0..n {
            let i = (start + k) % n;
            let u = &self.upstreams[i];
            if tried.contains(&i) || !u.is_healthy() || !serves(u) {
                continue;
            }
            let load = u.outstanding.load(Ordering::Acquire);
            if best.is_none_or(|(_, b)| load < b) {
                best = Some((i, load));
            }
        }
        let (least, least_load) = best.ok_or(NoUpstream::Unavailable)?;
        if let Some(a) = affine.filter(|&a| a < n && a != least) {
            let u = &self.upstreams[a];
            if !tried.contains(&a)
                && u.is_healthy()
                && serves(u)
                && u.outstanding.load(Ordering::Acquire) <= least_load + slack
            {
                return Ok((a, true));
            }
        }
        Ok((least, affine == Some(least)))
    }

    /// Takes `i` out of rotation now (a connection to it failed).
    pub fn eject(&self, i: usize, reason: &str) {
        let u = &self.upstreams[i];
        let was = u.healthy.send_replace(false);
        *u.streak.lock().unwrap_or_else(PoisonError::into_inner) = Streak::default();
        if was {
            u.ejections.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(upstream = %u.url, "upstream ejected: {reason}");
        }
    }

    /// Records a probe's result; ejects or brings back the upstream at the thresholds.
    fn probed(&self, i: usize, result: Result<Option<Vec<Value>>, String>, health: &HealthConfig) {
        let u = &self.upstreams[i];
        let mut streak = u.streak.lock().unwrap_or_else(PoisonError::into_inner);
        match result {
            Ok(models) => {
                if let Some(models) = models {
                    *u.models.write().unwrap_or_else(PoisonError::into_inner) = Some(models);
                }
                streak.failures = 0;
                streak.successes = streak.successes.saturating_add(1);
                // At start every upstream is out; the first good probe brings it in.
                let first = u.ejections.load(Ordering::Relaxed) == 0;
                if !u.is_healthy() && (first || streak.successes >= health.healthy_after) {
                    u.healthy.send_replace(true);
                    drop(streak);
                    tracing::info!(upstream = %u.url, "upstream healthy");
                    self.changed.notify_waiters();
                }
            }
            Err(reason) => {
                streak.successes = 0;
                streak.failures = streak.failures.saturating_add(1);
                if u.is_healthy() && streak.failures >= health.unhealthy_after {
                    drop(streak);
                    self.eject(i, &format!("health check failed: {reason}"));
                } else if !u.is_healthy() && u.ejections.load(Ordering::Relaxed) == 0 {
                    // Never up yet: count it as ejected once, so that its return needs
                    // `healthy_after` probes like any other.
                    drop(streak);
                    if u.ejections.fetch_add(1, Ordering::Relaxed) == 0 {
                        tracing::warn!(upstream = %u.url, "upstream not reachable: {reason}");
                    }
                }
            }
        }
    }
}

/// One probe: `GET /health` must answer 2xx, then `GET /v1/models` gives the models (a
/// server without that endpoint still counts as healthy).
async fn probe(
    client: &reqwest::Client,
    u: &Upstream,
    key: Option<&str>,
    timeout: Duration,
) -> Result<Option<Vec<Value>>, String> {
    let health = client.get(format!("{}/health", u.url)).timeout(timeout);
    let response = health.send().await.map_err(|e| describe(&e))?;
    if !response.status().is_success() {
        return Err(format!("/health answered {}", response.status()));
    }
    let mut models = client.get(format!("{}/v1/models", u.url)).timeout(timeout);
    if let Some(key) = key {
        models = models.bearer_auth(key);
    }
    let Ok(response) = models.send().await else {
        return Ok(None);
    };
    if !response.status().is_success() {
        return Ok(None);
    }
    let body: Value = response.json().await.map_err(|e| describe(&e))?;
    Ok(body.get("data").and_then(Value::as_array).cloned())
}

/// A client error in a few words (reqwest's Display hides the cause).
pub(crate) fn describe(e: &reqwest::Error) -> String {
    use std::error::Error;
    let mut text = if e.is_timeout() {
        "timed out".to_string()
    } else if e.is_connect() {
        "cannot connect".to_string()
    } else {
        e.to_string()
    };
    let mut source = e.source();
    while let Some(cause) = source {
        let cause_text = cause.to_string();
        if !text.contains(&cause_text) {
            text.push_str(": ");
            text.push_str(&cause_text);
        }
        source = cause.source();
    }
    text
}

/// Probes every upstream once, concurrently.
pub(crate) async fn probe_all(
    pool: &Pool,
    client: &reqwest::Client,
    key: Option<&str>,
    health: &HealthConfig,
) {
    let probes = pool
        .upstreams
        .iter()
        .map(|u| probe(client, u, key, health.timeout));
    let results = futures_util::future::join_all(probes).await;
    for (i, result) in results.into_iter().enumerate() {
        pool.probed(i, result, health);
    }
}

/// Probes forever, every `health.interval`.
pub(crate) async fn health_loop(
    pool: Arc<Pool>,
    client: reqwest::Client,
    key: Option<String>,
    health: HealthConfig,
) {
    let mut tick = tokio::time::interval(health.interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        probe_all(&pool, &client, key.as_deref(), &health).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn pool(n: usize) -> Pool {
        let urls: Vec<String> = (0..n).map(|i| format!("http://u{i}/")).collect();
        let pool = Pool::new(&urls);
        for u in &pool.upstreams {
            u.healthy.send_replace(true);
        }
        pool
    }

    #[test]
    fn least_outstanding_with_affinity_slack() {
        let p = pool(3);
        assert_eq!(p.upstreams[0].url, "http://u0");
        p.upstreams[0].outstanding.store(5, Ordering::Relaxed);
        p.upstreams[1].outstanding.store(1, Ordering::Relaxed);
        p.upstreams[2].outstanding.store(3, Ordering::Relaxed);
        assert_eq!(p.choose(None, None, 2, &[]), Ok((1, false)));
        // Affine upstream 2 is within the slack of 2; upstream 0 is not.
        assert_eq!(p.choose(None, Some(2), 2, &[]), Ok((2, true)));
        assert_eq!(p.choose(None, Some(0), 2, &[]), Ok((1, false)));
        assert_eq!(p.choose(None, Some(1), 2, &[]), Ok((1, true)));
        // Tried ones are skipped; ejected ones too.
        assert_eq!(p.choose(None, None, 2, &[1]), Ok((2, false)));
        p.eject(2, "test");
        assert_eq!(p.choose(None, Some(2), 2, &[1]), Ok((0, false)));
        assert_eq!(
            p.choose(None, None, 2, &[0, 1]),
            Err(NoUpstream::Unavailable)
        );
    }

    #[test]
    fn models_filter_upstreams() {
        let p = pool(2);
        *p.upstreams[0].models.write().expect("lock") = Some(vec![json!({"id": "a"})]);
        *p.upstreams[1].models.write().expect("lock") = Some(vec![json!({"id": "b"})]);
        assert_eq!(p.choose(Some("b"), None, 0, &[]), Ok((1, false)));
        assert_eq!(
            p.choose(Some("c"), None, 0, &[]),
            Err(NoUpstream::UnknownModel)
        );
        p.eject(1, "test");
        assert_eq!(
            p.choose(Some("b"), None, 0, &[]),
            Err(NoUpstream::Unavailable)
        );
    }

    #[test]
    fn probes_eject_and_return_at_thresholds() {
        let p = pool(1);
        let health = HealthConfig::default();
        p.probed(0, Err("down".into()), &health);
        assert!(p.upstreams[0].is_healthy(), "one failure is not enough");
        p.probed(0, Err("down".into()), &health);
        assert!(!p.upstreams[0].is_healthy());
        p.probed(0, Ok(None), &health);
        assert!(!p.upstreams[0].is_healthy(), "one success is not enough");
        p.probed(0, Ok(None), &health);
        assert!(p.upstreams[0].is_healthy());
        assert_eq!(p.upstreams[0].ejections.load(Ordering::Relaxed), 1);
    }
}
