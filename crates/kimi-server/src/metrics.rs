//! `/metrics` in Prometheus' text exposition format, with vLLM's metric names where one
//! exists. A small registry of our own (no global recorder): histograms and counters the
//! server records, plus gauges read from the engine at scrape time.

use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, PoisonError};

use kimi_engine::serving::{EngineMetrics, ExpertOffloadMetrics};

use crate::listener::ConnectionCounters;
use crate::prometheus::{escape, header, Histogram};

/// vLLM's buckets for time to first token.
const TTFT_BUCKETS: &[f64] = &[
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
];
/// vLLM's buckets for time per output token.
const TPOT_BUCKETS: &[f64] = &[
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
    40.0, 80.0,
];
/// vLLM's buckets for request latencies (end to end, queue).
const LATENCY_BUCKETS: &[f64] = &[
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
    480.0, 960.0, 1920.0, 7680.0,
];
/// Token-count buckets (1, 2, 5, 10, ... as vLLM's `build_1_2_5_buckets`).
const TOKEN_BUCKETS: &[f64] = &[
    1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0, 2000.0, 5000.0, 10000.0, 20000.0,
    50000.0, 100000.0, 200000.0, 500000.0, 1000000.0,
];

/// What one finished sequence reports.
#[derive(Clone, Copy, Debug)]
pub(crate) struct SequenceStats {
    /// `stop`, `length`, `tool_calls`, `abort`, `error`.
    pub finished_reason: &'static str,
    /// Arrival to first token, if one came.
    pub ttft_secs: Option<f64>,
    /// Mean gap between output tokens, if there were two or more.
    pub tpot_secs: Option<f64>,
    /// Arrival to end.
    pub e2e_secs: f64,
    /// Wait in the engine's queue, if it was reported.
    pub queue_secs: Option<f64>,
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// Output tokens.
    pub generation_tokens: usize,
}

/// The server's metrics.
#[derive(Debug)]
pub(crate) struct Metrics {
    model_label: String,
    ttft: Histogram,
    tpot: Histogram,
    e2e: Histogram,
    queue: Histogram,
    prompt_tokens: Histogram,
    generation_tokens: Histogram,
    finished: Mutex<BTreeMap<&'static str, u64>>,
    http_errors: Mutex<BTreeMap<u16, u64>>,
    /// Open and refused connections (the listener counts them).
    pub connections: Arc<ConnectionCounters>,
}

impl Metrics {
    pub(crate) fn new(model_name: &str) -> Self {
        Metrics {
            model_label: format!("model_name=\"{}\"", escape(model_name)),
            ttft: Histogram::new(
                "vllm:time_to_first_token_seconds",
                "Histogram of time to first token in seconds.",
                TTFT_BUCKETS,
            ),
            tpot: Histogram::new(
                "vllm:time_per_output_token_seconds",
                "Histogram of time per output token in seconds.",
                TPOT_BUCKETS,
            ),
            e2e: Histogram::new(
                "vllm:e2e_request_latency_seconds",
                "Histogram of end to end request latency in seconds.",
                LATENCY_BUCKETS,
            ),
            queue: Histogram::new(
                "vllm:request_queue_time_seconds",
                "Histogram of time spent waiting in the queue in seconds.",
                LATENCY_BUCKETS,
            ),
            prompt_tokens: Histogram::new(
                "vllm:request_prompt_tokens",
                "Number of prefill tokens processed.",
                TOKEN_BUCKETS,
            ),
            generation_tokens: Histogram::new(
                "vllm:request_generation_tokens",
                "Number of generation tokens processed.",
                TOKEN_BUCKETS,
            ),
            finished: Mutex::new(BTreeMap::new()),
            http_errors: Mutex::new(BTreeMap::new()),
            connections: Arc::new(ConnectionCounters::default()),
        }
    }

    /// Records a finished (or aborted) sequence.
    pub(crate) fn record(&self, stats: &SequenceStats) {
        if let Some(t) = stats.ttft_secs {
            self.ttft.observe(t);
        }
        if let Some(t) = stats.tpot_secs {
            self.tpot.observe(t);
        }
        if let Some(t) = stats.queue_secs {
            self.queue.observe(t);
        }
        self.e2e.observe(stats.e2e_secs);
        self.prompt_tokens.observe(stats.prompt_tokens as f64);
        self.generation_tokens
            .observe(stats.generation_tokens as f64);
        *self
            .finished
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .entry(stats.finished_reason)
            .or_default() += 1;
    }

    /// Counts an error response.
    pub(crate) fn record_error(&self, status: u16) {
        *self
            .http_errors
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .entry(status)
            .or_default() += 1;
    }

    /// The exposition text: engine gauges and counters, then the server's own.
    pub(crate) fn render(&self, engine: &EngineMetrics, num_pending: usize) -> String {
        let labels = self.model_label.as_str();
        let mut out = String::new();
        let mut single = |name: &str, help: &str, kind: &str, value: String| {
            header(&mut out, name, help, kind);
            let _ = writeln!(out, "{name}{{{labels}}} {value}");
        };
        single(
            "vllm:num_requests_running",
            "Number of requests in model execution batches.",
            "gauge",
            engine.num_running.to_string(),
        );
        single(
            "vllm:num_requests_waiting",
            "Number of requests waiting to be processed.",
            "gauge",
            engine.num_waiting.to_string(),
        );
        single(
            "vllm:gpu_cache_usage_perc",
            "KV-cache usage. 1 means 100 percent usage.",
            "gauge",
            engine.cache_usage.to_string(),
        );
        single(
            "vllm:kv_cache_usage_perc",
            "KV-cache usage. 1 means 100 percent usage.",
            "gauge",
            engine.cache_usage.to_string(),
        );
        single(
            "kimi:cache_pool_bytes",
            "Bytes of the cache pool allocated at start (paged blocks and state slots).",
            "gauge",
            engine.cache_bytes.to_string(),
        );
        single(
            "vllm:prompt_tokens_total",
            "Number of prefill tokens processed.",
            "counter",
            engine.prompt_tokens_total.to_string(),
        );
        single(
            "vllm:generation_tokens_total",
            "Number of generation tokens processed.",
            "counter",
            engine.generation_tokens_total.to_string(),
        );
        single(
            "kimi:engine_steps_total",
            "Forward passes (engine steps) run.",
            "counter",
            engine.steps_total.to_string(),
        );
        single(
            "kimi:engine_step_tokens_total",
            "Tokens fed to forward passes (prompt chunks and decode tokens).",
            "counter",
            engine.step_tokens_total.to_string(),
        );
        single(
            "kimi:engine_step_seconds_total",
            "Seconds spent in forward passes; wall time minus this is idle or scheduling time.",
            "counter",
            engine.step_seconds_total.to_string(),
        );
        single(
            "vllm:num_preemptions_total",
            "Cumulative number of preemptions from the engine.",
            "counter",
            engine.num_preemptions_total.to_string(),
        );
        single(
            "kimi:num_requests_pending",
            "Sequences the HTTP server has in flight (running or waiting).",
            "gauge",
            num_pending.to_string(),
        );
        single(
            "kimi:http_connections_open",
            "HTTP connections being served.",
            "gauge",
            self.connections.open.load(Ordering::Relaxed).to_string(),
        );
        single(
            "kimi:http_connections_refused_total",
            "Connections refused with 503 because max_connections were open.",
            "counter",
            self.connections.refused.load(Ordering::Relaxed).to_string(),
        );
        for histogram in [
            &self.ttft,
            &self.tpot,
            &self.e2e,
            &self.queue,
            &self.prompt_tokens,
            &self.generation_tokens,
        ] {
            histogram.render(&mut out, labels);
        }
        self.render_counters(&mut out, engine);
        if let Some(offload) = &engine.expert_offload {
            self.render_expert_offload(&mut out, engine, offload);
        }
        out
    }

    /// The expert tiers (`--cpu-offload-gb`): where the experts are, and what the device
    /// slots and the host did, summed over the MoE layers.
    fn render_expert_offload(
        &self,
        out: &mut String,
        engine: &EngineMetrics,
        offload: &ExpertOffloadMetrics,
    ) {
        let labels = self.model_label.as_str();
        let (p, c) = (&offload.placement, &offload.counts);
        header(
            out,
            "kimi:expert_offload_experts",
            "Routed experts by tier, summed over MoE layers: resident on the device, in host \
             memory, and device slots caching host experts.",
            "gauge",
        );
        for (tier, n) in [
            ("device", p.resident),
            ("host", p.host),
            ("cache_slot", p.slots),
        ] {
            let _ = writeln!(
                out,
                "kimi:expert_offload_experts{{{labels},tier=\"{tier}\"}} {n}"
            );
        }
        header(
            out,
            "kimi:expert_offload_bytes",
            "Stored bytes of routed experts by tier (device: resident experts and cache slots).",
            "gauge",
        );
        for (tier, n) in [("device", p.device_bytes), ("host", p.host_bytes)] {
            let _ = writeln!(
                out,
                "kimi:expert_offload_bytes{{{labels},tier=\"{tier}\"}} {n}"
            );
        }
        if let Some(costs) = &p.miss_costs {
            header(
                out,
                "kimi:expert_miss_cost_seconds",
                "What serving one host expert's miss costs, measured at load (--offload-miss \
                 auto): copying it into a device slot, or the CPU computing it for one token.",
                "gauge",
            );
            for (side, v) in [("copy", costs.fill_s), ("cpu", costs.host_first_s)] {
                let _ = writeln!(
                    out,
                    "kimi:expert_miss_cost_seconds{{{labels},side=\"{side}\"}} {v}"
                );
            }
        }
        let mut single = |name: &str, help: &str, kind: &str, value: String| {
            header(out, name, help, kind);
            let _ = writeln!(out, "{name}{{{labels}}} {value}");
        };
        for (name, help, value) in [
            (
                "kimi:expert_cache_hits_total",
                "Host experts a step needed and found in a device slot.",
                c.hits,
            ),
            (
                "kimi:expert_cache_fills_total",
                "Host experts copied into a device slot.",
                c.fills,
            ),
            (
                "kimi:expert_cache_evictions_total",
                "Slot fills that replaced another expert.",
                c.evictions,
            ),
            (
                "kimi:expert_cache_bytes_moved_total",
                "Bytes copied from host memory into device slots.",
                c.bytes_moved,
            ),
            (
                "kimi:expert_cold_experts_total",
                "Host experts computed on the host (no slot free for them).",
                c.cold_experts,
            ),
            (
                "kimi:expert_cold_pairs_total",
                "Token-expert pairs computed on the host.",
                c.cold_pairs,
            ),
            (
                "kimi:expert_device_pairs_total",
                "Token-expert pairs of tiered layers computed on the device.",
                c.device_pairs,
            ),
            (
                "kimi:expert_cache_ahead_fills_total",
                "Host experts copied into a device slot ahead of their layer's step: on the \
                 previous layer's prediction, or after the CPU computed them.",
                c.ahead_fills,
            ),
            (
                "kimi:expert_cache_ahead_used_total",
                "Experts copied ahead that their layer then needed.",
                c.ahead_used,
            ),
        ] {
            single(name, help, "counter", value.to_string());
        }
        for (name, help, ns) in [
            (
                "kimi:expert_host_compute_seconds_total",
                "Time the host spent computing cold experts.",
                c.host_ns,
            ),
            (
                "kimi:expert_tiered_step_seconds_total",
                "Time the tiered MoE steps took on the engine's thread, the host's share included.",
                c.step_ns,
            ),
        ] {
            single(name, help, "counter", (ns as f64 / 1e9).to_string());
        }
        single(
            "kimi:expert_cache_hit_ratio",
            "Hits over host experts needed (hits + fills + cold) since start; NaN before any.",
            "gauge",
            c.hit_rate().unwrap_or(f64::NAN).to_string(),
        );
        let tokens = engine.step_tokens_total;
        single(
            "kimi:expert_bytes_moved_per_token",
            "Bytes copied into device slots per token fed to the model since start.",
            "gauge",
            if tokens == 0 {
                "0".to_string()
            } else {
                (c.bytes_moved as f64 / tokens as f64).to_string()
            },
        );
    }

    fn render_counters(&self, out: &mut String, engine: &EngineMetrics) {
        let labels = self.model_label.as_str();
        header(
            out,
            "vllm:request_success_total",
            "Count of finished requests, by finish reason.",
            "counter",
        );
        let finished = self.finished.lock().unwrap_or_else(PoisonError::into_inner);
        for reason in ["stop", "length", "abort"] {
            if !finished.contains_key(reason) {
                let _ = writeln!(
                    out,
                    "vllm:request_success_total{{{labels},finished_reason=\"{reason}\"}} 0"
                );
            }
        }
        for (reason, count) in finished.iter() {
            let _ = writeln!(
                out,
                "vllm:request_success_total{{{labels},finished_reason=\"{reason}\"}} {count}"
            );
        }
        drop(finished);
        header(
            out,
            "kimi:http_errors_total",
            "Error responses, by HTTP status.",
            "counter",
        );
        let errors = self
            .http_errors
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        for (status, count) in errors.iter() {
            let _ = writeln!(
                out,
                "kimi:http_errors_total{{{labels},status=\"{status}\"}} {count}"
            );
        }
        drop(errors);
        if let Some(imbalance) = engine.expert_imbalance {
            for (name, help, kind, value) in [
                (
                    "kimi:moe_expert_imbalance",
                    "The largest rank's routed tokens over the mean, averaged over the MoE \
                     layers, in the last window of steps (expert parallelism; 1 is even).",
                    "gauge",
                    imbalance.to_string(),
                ),
                (
                    "kimi:moe_expert_rebalances_total",
                    "Times the routed experts moved between ranks (--enable-eplb).",
                    "counter",
                    engine.expert_rebalances_total.to_string(),
                ),
                (
                    "kimi:moe_experts_moved_total",
                    "Routed experts moved between ranks.",
                    "counter",
                    engine.experts_moved_total.to_string(),
                ),
            ] {
                header(out, name, help, kind);
                let _ = writeln!(out, "{name}{{{labels}}} {value}");
            }
        }
        header(
            out,
            "kimi:moe_expert_tokens_total",
            "Tokens routed to each expert of each MoE layer.",
            "counter",
        );
        for (layer, experts) in engine.expert_counts.iter().enumerate() {
            for (expert, count) in experts.iter().enumerate() {
                let _ = writeln!(
                    out,
                    "kimi:moe_expert_tokens_total{{{labels},layer=\"{layer}\",expert=\"{expert}\"}} {count}"
                );
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_prometheus_text() {
        let m = Metrics::new("demo \"x\"");
        m.record(&SequenceStats {
            finished_reason: "stop",
            ttft_secs: Some(0.003),
            tpot_secs: Some(0.02),
            e2e_secs: 0.4,
            queue_secs: Some(0.0),
            prompt_tokens: 7,
            generation_tokens: 3,
        });
        m.record_error(400);
        let engine = EngineMetrics {
            num_running: 2,
            expert_counts: vec![vec![], vec![5, 6]],
            expert_imbalance: Some(1.25),
            expert_rebalances_total: 2,
            experts_moved_total: 9,
            ..EngineMetrics::default()
        };
        let text = m.render(&engine, 3);
        assert!(
            !text.contains("kimi:expert_cache"),
            "no tiers, no tier metrics"
        );
        assert!(text.contains("vllm:num_requests_running{model_name=\"demo \\\"x\\\"\"} 2\n"));
        assert!(text.contains("vllm:time_to_first_token_seconds_bucket{model_name=\"demo \\\"x\\\"\",le=\"0.005\"} 1\n"));
        assert!(text.contains("le=\"0.001\"} 0\n"));
        assert!(text.contains("vllm:request_success_total{model_name=\"demo \\\"x\\\"\",finished_reason=\"stop\"} 1\n"));
        assert!(text.contains("finished_reason=\"length\"} 0\n"));
        assert!(text.contains("kimi:moe_expert_tokens_total{model_name=\"demo \\\"x\\\"\",layer=\"1\",expert=\"1\"} 6\n"));
        assert!(text.contains("kimi:moe_expert_imbalance{model_name=\"demo \\\"x\\\"\"} 1.25\n"));
        assert!(text.contains("kimi:moe_experts_moved_total{model_name=\"demo \\\"x\\\"\"} 9\n"));
        assert!(text
            .contains("kimi:http_errors_total{model_name=\"demo \\\"x\\\"\",status=\"400\"} 1\n"));
        assert!(text.contains("# TYPE vllm:e2e_request_latency_seconds histogram\n"));
    }

    #[test]
    fn renders_the_expert_tiers() {
        let m = Metrics::new("k3");
        let engine = EngineMetrics {
            step_tokens_total: 10,
            expert_offload: Some(ExpertOffloadMetrics {
                placement: kimi_engine::Placement {
                    resident: 4,
                    host: 12,
                    slots: 2,
                    device_bytes: 600,
                    host_bytes: 1200,
                    miss_costs: Some(kimi_ops::offload::MissCosts {
                        fill_s: 0.25e-3,
                        host_first_s: 0.5e-3,
                        host_next_s: 0.1e-3,
                        host_more_s: 0.2e-3,
                    }),
                },
                counts: kimi_engine::OffloadCounts {
                    steps: 5,
                    hits: 3,
                    fills: 1,
                    evictions: 1,
                    cold_experts: 4,
                    cold_pairs: 6,
                    device_pairs: 20,
                    bytes_moved: 100,
                    host_ns: 1_500_000_000,
                    step_ns: 2_000_000_000,
                    ahead_fills: 2,
                    ahead_used: 1,
                },
            }),
            ..EngineMetrics::default()
        };
        let text = m.render(&engine, 0);
        for line in [
            "kimi:expert_offload_experts{model_name=\"k3\",tier=\"host\"} 12\n",
            "kimi:expert_offload_experts{model_name=\"k3\",tier=\"cache_slot\"} 2\n",
            "kimi:expert_offload_bytes{model_name=\"k3\",tier=\"device\"} 600\n",
            "kimi:expert_miss_cost_seconds{model_name=\"k3\",side=\"copy\"} 0.00025\n",
            "kimi:expert_miss_cost_seconds{model_name=\"k3\",side=\"cpu\"} 0.0005\n",
            "# TYPE kimi:expert_cache_hits_total counter\n",
            "kimi:expert_cache_hits_total{model_name=\"k3\"} 3\n",
            "kimi:expert_cache_evictions_total{model_name=\"k3\"} 1\n",
            "kimi:expert_cold_pairs_total{model_name=\"k3\"} 6\n",
            "kimi:expert_cache_hit_ratio{model_name=\"k3\"} 0.375\n",
            "kimi:expert_cache_ahead_fills_total{model_name=\"k3\"} 2\n",
            "kimi:expert_cache_ahead_used_total{model_name=\"k3\"} 1\n",
            "kimi:expert_bytes_moved_per_token{model_name=\"k3\"} 10\n",
            "# TYPE kimi:expert_host_compute_seconds_total counter\n",
            "kimi:expert_host_compute_seconds_total{model_name=\"k3\"} 1.5\n",
            "kimi:expert_tiered_step_seconds_total{model_name=\"k3\"} 2\n",
        ] {
            assert!(text.contains(line), "{line} missing from\n{text}");
        }
    }
}
