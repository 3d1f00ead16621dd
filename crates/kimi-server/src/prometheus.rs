//! Prometheus' text exposition format: a fixed-bucket histogram, metric headers and label
//! escaping. A small registry of our own (no global recorder), shared by the server's and
//! the gateway's `/metrics`.

use std::fmt::Write;
use std::sync::{Mutex, PoisonError};

/// Buckets for request latencies in seconds, from 1 ms to 10 minutes.
pub const LATENCY_SECONDS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
    120.0, 300.0, 600.0,
];

#[derive(Debug, Default)]
struct HistogramData {
    /// Count per bucket (not cumulative), plus one for `+Inf`.
    counts: Vec<u64>,
    sum: f64,
    count: u64,
}

/// A fixed-bucket histogram.
#[derive(Debug)]
pub struct Histogram {
    name: &'static str,
    help: &'static str,
    buckets: &'static [f64],
    data: Mutex<HistogramData>,
}

impl Histogram {
    /// An empty histogram.
    pub const fn new(name: &'static str, help: &'static str, buckets: &'static [f64]) -> Self {
        Histogram {
            name,
            help,
            buckets,
            data: Mutex::new(HistogramData {
                counts: Vec::new(),
                sum: 0.0,
                count: 0,
            }),
        }
    }

    /// Counts one value (non-finite values are ignored).
    pub fn observe(&self, value: f64) {
        if !value.is_finite() {
            return;
        }
        let mut data = self.data.lock().unwrap_or_else(PoisonError::into_inner);
        data.counts.resize(self.buckets.len() + 1, 0);
        let slot = self
            .buckets
            .iter()
            .position(|&le| value <= le)
            .unwrap_or(self.buckets.len());
        data.counts[slot] += 1;
        data.sum += value;
        data.count += 1;
    }

    /// The header and the series with `labels` (`name="value",...`).
    pub fn render(&self, out: &mut String, labels: &str) {
        self.render_header(out);
        self.render_series(out, labels);
    }

    /// `# HELP` and `# TYPE` only: once per metric name, before each labelled series.
    pub fn render_header(&self, out: &mut String) {
        header(out, self.name, self.help, "histogram");
    }

    /// The series with `labels` and no header (one of several label sets of a name).
    pub fn render_series(&self, out: &mut String, labels: &str) {
        let data = self.data.lock().unwrap_or_else(PoisonError::into_inner);
        let sep = if labels.is_empty() { "" } else { "," };
        let mut cumulative = 0;
        for (i, le) in self.buckets.iter().enumerate() {
            cumulative += data.counts.get(i).copied().unwrap_or(0);
            let _ = writeln!(
                out,
                "{}_bucket{{{labels}{sep}le=\"{le:?}\"}} {cumulative}",
                self.name
            );
        }
        let _ = writeln!(
            out,
            "{}_bucket{{{labels}{sep}le=\"+Inf\"}} {}",
            self.name, data.count
        );
        let _ = writeln!(out, "{}_sum{{{labels}}} {}", self.name, data.sum);
        let _ = writeln!(out, "{}_count{{{labels}}} {}", self.name, data.count);
    }
}

/// `# HELP` and `# TYPE` lines.
pub fn header(out: &mut String, name: &str, help: &str, kind: &str) {
    let _ = writeln!(out, "# HELP {name} {help}");
    let _ = writeln!(out, "# TYPE {name} {kind}");
}

/// Escapes a label value (backslash, quote, newline).
pub fn escape(value: &str) -> String {
    value
        .replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn series_without_labels_and_with() {
        let h = Histogram::new("t_seconds", "Test.", &[0.1, 1.0]);
        h.observe(0.5);
        h.observe(f64::NAN);
        let mut out = String::new();
        h.render(&mut out, "");
        h.render_series(&mut out, "a=\"b\"");
        assert!(out.contains("# TYPE t_seconds histogram\n"));
        assert!(out.contains("t_seconds_bucket{le=\"0.1\"} 0\nt_seconds_bucket{le=\"1.0\"} 1\n"));
        assert!(out.contains("t_seconds_bucket{a=\"b\",le=\"+Inf\"} 1\n"));
        assert!(out.contains("t_seconds_count{a=\"b\"} 1\n"));
        assert_eq!(escape("a\"b\\\n"), "a\\\"b\\\\\\n");
    }
}
