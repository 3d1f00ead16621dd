//! The gateway's `/metrics` (Prometheus text): per upstream its health, requests in
//! flight, attempts by status, errors by kind, ejections, time to the response head and
//! attempt duration; the gateway's retries, requests waiting for an upstream, affinity
//! choices, error responses, connections, the cache's and the limits' counters.

use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, PoisonError};

use kimi_server::prometheus::{escape, header, Histogram, LATENCY_SECONDS};

use crate::Shared;

/// What the gateway counts for one upstream.
pub(crate) struct UpstreamMetrics {
    /// Attempts by response status (`error` for no response).
    requests: Mutex<BTreeMap<String, u64>>,
    /// Failed attempts by kind.
    errors: Mutex<BTreeMap<&'static str, u64>>,
    /// Request sent → response head.
    pub first_byte: Histogram,
    /// Attempt start → its body's end.
    pub duration: Histogram,
}

impl UpstreamMetrics {
    pub fn new() -> Self {
        UpstreamMetrics {
            requests: Mutex::new(BTreeMap::new()),
            errors: Mutex::new(BTreeMap::new()),
            first_byte: Histogram::new(
                "kimi:gateway_upstream_response_head_seconds",
                "Time from sending a request upstream to its response head (for a stream, \
                 its start; for a JSON answer, its end).",
                LATENCY_SECONDS,
            ),
            duration: Histogram::new(
                "kimi:gateway_upstream_request_seconds",
                "Time from sending a request upstream to the end of its response body.",
                LATENCY_SECONDS,
            ),
        }
    }

    /// Counts an attempt's answer.
    pub fn status(&self, status: u16) {
        *self
            .requests
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .entry(status.to_string())
            .or_default() += 1;
    }

    /// Counts a failed attempt: `connect`, `timeout`, `ejected`, `stream`, `status`.
    pub fn error(&self, kind: &'static str) {
        *self
            .errors
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .entry(kind)
            .or_default() += 1;
        if kind != "status" {
            *self
                .requests
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .entry("error".into())
                .or_default() += 1;
        }
    }
}

/// Gateway-wide counters.
#[derive(Default)]
pub(crate) struct GatewayMetrics {
    /// Attempts after the first of a request.
    pub retries: AtomicU64,
    /// Requests routed by affinity to their upstream / with no known upstream / whose
    /// upstream was too busy or gone.
    pub affinity_hits: AtomicU64,
    pub affinity_misses: AtomicU64,
    pub affinity_overridden: AtomicU64,
    /// Error responses by status.
    http_errors: Mutex<BTreeMap<u16, u64>>,
}

impl GatewayMetrics {
    pub fn record_error(&self, status: u16) {
        *self
            .http_errors
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .entry(status)
            .or_default() += 1;
    }
}

fn counter_line(out: &mut String, name: &str, help: &str, kind: &str, value: u64) {
    header(out, name, help, kind);
    let _ = writeln!(out, "{name} {value}");
}

/// A per-upstream series: name, help, value of upstream `i`.
type PerUpstream<'a> = (&'a str, &'a str, &'a dyn Fn(usize) -> u64);

/// The exposition text.
pub(crate) fn render(shared: &Shared) -> String {
    let mut out = String::new();
    let ups = &shared.pool.upstreams;
    let labels: Vec<String> = ups
        .iter()
        .map(|u| format!("upstream=\"{}\"", escape(&u.url)))
        .collect();
    let gauges: [PerUpstream; 3] = [
        (
            "kimi:gateway_upstream_healthy",
            "1 while the upstream receives requests, 0 while it is ejected.",
            &|i| u64::from(ups[i].is_healthy()),
        ),
        (
            "kimi:gateway_upstream_outstanding_requests",
            "Requests in flight on the upstream through this gateway (its queue as seen from here).",
            &|i| ups[i].outstanding.load(Ordering::Relaxed) as u64,
        ),
        (
            "kimi:gateway_upstream_ejections_total",
            "Times the upstream was taken out of rotation (failed probes or connections).",
            &|i| ups[i].ejections.load(Ordering::Relaxed),
        ),
    ];
    for (name, help, value) in gauges {
        let kind = if name.ends_with("_total") {
            "counter"
        } else {
            "gauge"
        };
        header(&mut out, name, help, kind);
        for (i, l) in labels.iter().enumerate() {
            let _ = writeln!(out, "{name}{{{l}}} {}", value(i));
        }
    }
    header(
        &mut out,
        "kimi:gateway_upstream_requests_total",
        "Attempts sent to the upstream, by response status (`error`: no response).",
        "counter",
    );
    for (u, l) in ups.iter().zip(&labels) {
        let requests = u
            .metrics
            .requests
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        for (status, n) in requests.iter() {
            let _ = writeln!(
                out,
                "kimi:gateway_upstream_requests_total{{{l},status=\"{status}\"}} {n}"
            );
        }
    }
    header(
        &mut out,
        "kimi:gateway_upstream_errors_total",
        "Failed attempts, by kind: connect, timeout (response head), ejected (while in \
         flight), stream (cut mid-body), status (a retryable error status).",
        "counter",
    );
    for (u, l) in ups.iter().zip(&labels) {
        let errors = u
            .metrics
            .errors
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        for (kind, n) in errors.iter() {
            let _ = writeln!(
                out,
                "kimi:gateway_upstream_errors_total{{{l},kind=\"{kind}\"}} {n}"
            );
        }
    }
    if let Some(first) = ups.first() {
        first.metrics.first_byte.render_header(&mut out);
        for (u, l) in ups.iter().zip(&labels) {
            u.metrics.first_byte.render_series(&mut out, l);
        }
        first.metrics.duration.render_header(&mut out);
        for (u, l) in ups.iter().zip(&labels) {
            u.metrics.duration.render_series(&mut out, l);
        }
    }
    let m = &shared.metrics;
    counter_line(
        &mut out,
        "kimi:gateway_retries_total",
        "Attempts on another upstream after one failed before any output was sent.",
        "counter",
        m.retries.load(Ordering::Relaxed),
    );
    counter_line(
        &mut out,
        "kimi:gateway_affinity_entries",
        "Conversation prefixes remembered for affinity.",
        "gauge",
        shared.affinity.len() as u64,
    );
    counter_line(
        &mut out,
        "kimi:gateway_requests_waiting",
        "Requests waiting for a healthy upstream.",
        "gauge",
        shared.pool.waiting.load(Ordering::Relaxed) as u64,
    );
    header(
        &mut out,
        "kimi:gateway_affinity_total",
        "Routing by session or prefix affinity: hit (sent to its upstream), miss (none \
         known), overridden (its upstream was busy, ejected or already tried).",
        "counter",
    );
    for (result, value) in [
        ("hit", &m.affinity_hits),
        ("miss", &m.affinity_misses),
        ("overridden", &m.affinity_overridden),
    ] {
        let _ = writeln!(
            out,
            "kimi:gateway_affinity_total{{result=\"{result}\"}} {}",
            value.load(Ordering::Relaxed)
        );
    }
    header(
        &mut out,
        "kimi:http_errors_total",
        "Error responses, by HTTP status.",
        "counter",
    );
    for (status, n) in m
        .http_errors
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .iter()
    {
        let _ = writeln!(out, "kimi:http_errors_total{{status=\"{status}\"}} {n}");
    }
    counter_line(
        &mut out,
        "kimi:http_connections_open",
        "HTTP connections being served.",
        "gauge",
        shared.connections.open.load(Ordering::Relaxed) as u64,
    );
    counter_line(
        &mut out,
        "kimi:http_connections_refused_total",
        "Connections refused because max_connections were open.",
        "counter",
        shared.connections.refused.load(Ordering::Relaxed),
    );
    if let Some(cache) = &shared.config.cache {
        cache.render_metrics(&mut out);
    }
    if let Some(limiter) = &shared.config.limiter {
        limiter.render_metrics(&mut out);
    }
    out
}
