//! Relaying a stream (SSE) from an upstream to the client, event by event, as each event
//! completes: nothing waits for more than the event it is part of.
//!
//! ```text
//! upstream bytes ─► split into events ─► comment (": keep-alive"): passed on
//!                                      ├► no output yet (the role chunk): held
//!                                      ├► output (a token, a finish reason, an error, [DONE]):
//!                                      │    held events, then this one, passed on
//!                                      └► the usage chunk the gateway asked for: counted, dropped
//! upstream fails ─► no output sent yet: held events dropped, the request sent to another
//!                   upstream (≤ max_retries), its stream relayed instead
//!               └► output sent: an error event and [DONE] end the client's stream
//! client leaves ─► the task ends, dropping the upstream response: its connection closes
//!                  and the upstream cancels the request
//! ```
//!
//! An upstream that is ejected while a stream runs: one that has sent no output is
//! abandoned and retried elsewhere; one that has is given `health.interval +
//! health.timeout` without data before its stream is ended with an error.

use std::sync::Arc;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::http::{header, HeaderValue};
use axum::response::{IntoResponse, Response};
use futures_util::StreamExt;
use kimi_server::limits::Lease;
use serde_json::Value;
use tokio::sync::mpsc;

use crate::access_log::Record;
use crate::cache::{Entry, Kind};
use crate::proxy::{connect, count_usage, upstream_failed, Attempt, Route, UPSTREAM_HEADER};
use crate::request::Prepared;
use crate::upstream::describe;
use crate::Gateway;

/// The longest event the relay holds (an upstream sending more without a blank line is
/// cut off).
const MAX_EVENT_BYTES: usize = 16 << 20;
/// Events queued for a slow client before the relay waits for it.
const CLIENT_QUEUE: usize = 32;

/// A stream request in flight.
pub(crate) struct Job {
    pub gateway: Gateway,
    pub prepared: Arc<Prepared>,
    pub record: Arc<Record>,
    pub lease: Option<Lease>,
    pub cache_key: Option<String>,
    pub route: Route,
}

/// Answers the client with an SSE response fed by a relay task.
pub(crate) fn start(job: Job, attempt: Attempt) -> Response {
    let upstream = attempt.upstream.url.clone();
    let (tx, rx) = mpsc::channel::<Result<Bytes, std::io::Error>>(CLIENT_QUEUE);
    tokio::spawn(run(job, attempt, tx));
    let events = futures_util::stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|item| (item, rx))
    });
    let mut response = (
        [
            (header::CONTENT_TYPE, "text/event-stream"),
            (header::CACHE_CONTROL, "no-cache"),
        ],
        Body::from_stream(events),
    )
        .into_response();
    if let Ok(v) = HeaderValue::from_str(&upstream) {
        response.headers_mut().insert(UPSTREAM_HEADER, v);
    }
    response
}

/// Splits complete SSE events (each with its blank line) off a byte buffer.
#[derive(Default)]
pub(crate) struct Splitter {
    buf: Vec<u8>,
    /// Bytes of `buf` already searched for a boundary.
    scanned: usize,
}

impl Splitter {
    /// Adds bytes; returns the events they completed.
    pub fn push(&mut self, bytes: &[u8]) -> Result<Vec<Bytes>, String> {
        self.buf.extend_from_slice(bytes);
        let mut events = Vec::new();
        loop {
            let from = self.scanned.saturating_sub(3);
            let end = boundary(&self.buf[from..]).map(|e| from + e);
            match end {
                Some(end) => {
                    let rest = self.buf.split_off(end);
                    events.push(Bytes::from(std::mem::replace(&mut self.buf, rest)));
                    self.scanned = 0;
                }
                None => {
                    self.scanned = self.buf.len();
                    break;
                }
            }
        }
        if self.buf.len() > MAX_EVENT_BYTES {
            return Err(format!("an event longer than {MAX_EVENT_BYTES} bytes"));
        }
        Ok(events)
    }

    /// Whether a partial event is pending.
    pub fn is_empty(&self) -> bool {
        self.buf.iter().all(|b| b.is_ascii_whitespace())
    }
}

/// The end (after the blank line) of the first event in `bytes`.
fn boundary(bytes: &[u8]) -> Option<usize> {
    let lf = bytes.windows(2).position(|w| w == b"\n\n").map(|i| i + 2);
    let crlf = bytes
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .map(|i| i + 4);
    match (lf, crlf) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

/// A stored stream's events, one `Bytes` each.
pub(crate) fn split_events(body: Bytes) -> Vec<Bytes> {
    let mut splitter = Splitter::default();
    splitter.push(&body).unwrap_or_default()
}

/// What an event is to the relay.
#[derive(Debug, PartialEq)]
enum EventKind {
    /// Only comments (keep-alives).
    Comment,
    /// `data: [DONE]`.
    Done,
    /// A chunk that carries no output yet (the role chunk).
    Empty,
    /// A chunk with output, an error, or anything not understood (passed on as is).
    Output,
    /// A usage-only chunk (no choices), with its usage.
    Usage(Value),
}

fn classify(event: &[u8]) -> EventKind {
    let text = String::from_utf8_lossy(event);
    let mut data = String::new();
    let mut any_field = false;
    for line in text.lines() {
        let line = line.trim_end_matches('\r');
        if line.is_empty() || line.starts_with(':') {
            continue;
        }
        any_field = true;
        if let Some(value) = line.strip_prefix("data:") {
            if !data.is_empty() {
                data.push('\n');
            }
            data.push_str(value.strip_prefix(' ').unwrap_or(value));
        }
    }
    if !any_field {
        return EventKind::Comment;
    }
    if data.trim() == "[DONE]" {
        return EventKind::Done;
    }
    let Ok(chunk) = serde_json::from_str::<Value>(&data) else {
        return EventKind::Output;
    };
    if chunk.get("error").is_some() {
        return EventKind::Output;
    }
    let Some(choices) = chunk.get("choices").and_then(Value::as_array) else {
        return EventKind::Output;
    };
    if choices.is_empty() {
        return match chunk.get("usage") {
            Some(usage) if !usage.is_null() => EventKind::Usage(usage.clone()),
            _ => EventKind::Empty,
        };
    }
    let text_in = |v: Option<&Value>| v.and_then(Value::as_str).is_some_and(|s| !s.is_empty());
    let present = |v: Option<&Value>| v.is_some_and(|v| !v.is_null());
    let output = choices.iter().any(|c| {
        let delta = c.get("delta");
        present(c.get("finish_reason"))
            || present(c.get("logprobs"))
            || text_in(c.get("text"))
            || text_in(delta.and_then(|d| d.get("content")))
            || text_in(delta.and_then(|d| d.get("reasoning_content")))
            || delta
                .and_then(|d| d.get("tool_calls"))
                .and_then(Value::as_array)
                .is_some_and(|calls| !calls.is_empty())
    });
    if output {
        EventKind::Output
    } else {
        EventKind::Empty
    }
}

/// What ended an attempt's stream.
enum Ended {
    /// `[DONE]` came and the body ended.
    Complete,
    /// The client left.
    ClientGone,
    /// The upstream failed (why).
    Failed(String),
}

/// The relay's state across attempts.
struct Relay {
    tx: mpsc::Sender<Result<Bytes, std::io::Error>>,
    /// Events without output, held while a retry is still possible.
    held: Vec<Bytes>,
    /// Some output went to the client: no more retries.
    committed: bool,
    /// The events sent, for the cache (`None` once it cannot be stored).
    recorded: Option<Vec<u8>>,
    max_record: usize,
    usage: Option<Value>,
    strip_usage: bool,
}

impl Relay {
    /// Sends bytes to the client; `false` if it left.
    async fn send(&mut self, bytes: Bytes, record: bool) -> bool {
        if record {
            if let Some(recorded) = &mut self.recorded {
                if recorded.len() + bytes.len() > self.max_record {
                    self.recorded = None;
                } else {
                    recorded.extend_from_slice(&bytes);
                }
            }
        }
        self.tx.send(Ok(bytes)).await.is_ok()
    }

    /// Handles one event; `false` if the client left.
    async fn event(&mut self, event: Bytes) -> bool {
        match classify(&event) {
            EventKind::Comment => self.tx.send(Ok(event)).await.is_ok(),
            EventKind::Empty if !self.committed => {
                self.held.push(event);
                true
            }
            EventKind::Usage(usage) => {
                self.usage = Some(usage);
                if self.strip_usage {
                    return true;
                }
                self.output(event).await
            }
            kind => {
                if kind == EventKind::Output && event_is_error(&event) {
                    // An error is passed on but never cached.
                    self.recorded = None;
                }
                self.output(event).await
            }
        }
    }

    async fn output(&mut self, event: Bytes) -> bool {
        self.committed = true;
        for held in std::mem::take(&mut self.held) {
            if !self.send(held, true).await {
                return false;
            }
        }
        self.send(event, true).await
    }

    /// Ends the client's stream with an error event and `[DONE]`.
    async fn fail(&mut self, message: &str, record: &Record) {
        record.set_error(message);
        self.recorded = None;
        let error = upstream_failed(message.to_string(), false).to_json();
        let frames = format!("data: {error}\n\ndata: [DONE]\n\n");
        let _ = self.tx.send(Ok(Bytes::from(frames))).await;
    }
}

fn event_is_error(event: &[u8]) -> bool {
    let text = String::from_utf8_lossy(event);
    text.lines().any(|l| {
        l.strip_prefix("data:")
            .and_then(|d| serde_json::from_str::<Value>(d.trim()).ok())
            .is_some_and(|v| v.get("error").is_some())
    })
}

/// Relays `attempt`'s stream, retrying on other upstreams while no output was sent.
async fn run(mut job: Job, mut attempt: Attempt, tx: mpsc::Sender<Result<Bytes, std::io::Error>>) {
    let shared = Arc::clone(&job.gateway.shared);
    let max_record = shared
        .config
        .cache
        .as_ref()
        .map_or(0, |c| c.max_entry_bytes());
    let mut relay = Relay {
        tx,
        held: Vec::new(),
        committed: false,
        recorded: job.cache_key.is_some().then(Vec::new),
        max_record,
        usage: None,
        strip_usage: job.prepared.strip_usage,
    };
    let grace = shared.config.health.interval + shared.config.health.timeout;
    loop {
        let index = attempt.index;
        let upstream = Arc::clone(&attempt.upstream);
        let ended = relay_attempt(&mut relay, attempt, grace).await;
        let message = match ended {
            Ended::Complete => break,
            Ended::ClientGone => {
                job.record.set_error("the client disconnected");
                relay.recorded = None;
                break;
            }
            Ended::Failed(message) => message,
        };
        upstream.metrics.error("stream");
        let message = format!("{}: {message}", upstream.url);
        if relay.committed {
            shared.pool.eject(index, &message);
            relay
                .fail(
                    &format!("The upstream failed mid-stream ({message})"),
                    &job.record,
                )
                .await;
            break;
        }
        shared.pool.eject(index, &message);
        relay.held.clear();
        let next = if job.route.tried.len() > shared.config.max_retries {
            None
        } else {
            connect(&shared, &job.prepared, &job.record, &mut job.route)
                .await
                .ok()
                .filter(|a| a.is_event_stream() && a.response.status().is_success())
        };
        match next {
            Some(next) => {
                shared.affinity.record(&job.prepared.chain, next.index);
                attempt = next;
            }
            None => {
                relay
                    .fail(
                        &format!("No upstream could finish the stream ({message})"),
                        &job.record,
                    )
                    .await;
                break;
            }
        }
    }
    if let Some(usage) = relay.usage.take() {
        count_usage(&usage, &job.record, job.lease.take());
    }
    if let (Some(key), Some(cache), Some(events)) =
        (&job.cache_key, &shared.config.cache, relay.recorded.take())
    {
        cache
            .put(
                key,
                Entry {
                    kind: Kind::Events,
                    body: Bytes::from(events),
                },
            )
            .await;
    }
}

/// Relays one attempt's body until it ends, fails or the client leaves.
async fn relay_attempt(relay: &mut Relay, attempt: Attempt, grace: Duration) -> Ended {
    let mut splitter = Splitter::default();
    let mut done = false;
    let ejected = attempt.upstream.ejected();
    tokio::pin!(ejected);
    let mut ejected_at: Option<tokio::time::Instant> = None;
    // Counted in flight until this returns.
    let _in_flight = attempt.in_flight;
    let mut chunks = attempt.response.bytes_stream();
    loop {
        let stall = async {
            match ejected_at {
                Some(at) => tokio::time::sleep_until(at + grace).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            () = relay.tx.closed() => return Ended::ClientGone,
            () = &mut ejected, if ejected_at.is_none() => {
                if !relay.committed {
                    return Ended::Failed("ejected while streaming".into());
                }
                ejected_at = Some(tokio::time::Instant::now());
            }
            () = stall => return Ended::Failed("ejected, and no data since".into()),
            chunk = chunks.next() => match chunk {
                Some(Ok(bytes)) => {
                    if ejected_at.is_some() {
                        ejected_at = Some(tokio::time::Instant::now());
                    }
                    let events = match splitter.push(&bytes) {
                        Ok(events) => events,
                        Err(message) => return Ended::Failed(message),
                    };
                    for event in events {
                        if classify(&event) == EventKind::Done {
                            done = true;
                        }
                        if !relay.event(event).await {
                            return Ended::ClientGone;
                        }
                    }
                }
                Some(Err(e)) => return Ended::Failed(format!("the stream broke off: {}", describe(&e))),
                None if done && splitter.is_empty() => return Ended::Complete,
                None => return Ended::Failed("the stream ended before [DONE]".into()),
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_split_across_chunks_and_line_endings() {
        let mut s = Splitter::default();
        assert!(s.push(b"data: {\"a\":").expect("ok").is_empty());
        assert!(!s.is_empty());
        let events = s
            .push(b"1}\n\n: keep-alive\n\ndata: x\r\n\r\ndata: [DO")
            .expect("ok");
        assert_eq!(
            events,
            vec![
                Bytes::from_static(b"data: {\"a\":1}\n\n"),
                Bytes::from_static(b": keep-alive\n\n"),
                Bytes::from_static(b"data: x\r\n\r\n"),
            ]
        );
        let events = s.push(b"NE]\n\n").expect("ok");
        assert_eq!(events, vec![Bytes::from_static(b"data: [DONE]\n\n")]);
        assert!(s.is_empty());
    }

    #[test]
    fn events_are_classified() {
        let role = br#"data: {"choices":[{"index":0,"delta":{"role":"assistant","content":""},"finish_reason":null}]}"#;
        let token =
            br#"data: {"choices":[{"index":0,"delta":{"content":"Hi"},"finish_reason":null}]}"#;
        let text = br#"data: {"choices":[{"index":0,"text":" a","finish_reason":null}]}"#;
        let finish = br#"data: {"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}"#;
        let usage = br#"data: {"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":2}}"#;
        let error = br#"data: {"error":{"message":"x"}}"#;
        assert_eq!(classify(role), EventKind::Empty);
        assert_eq!(classify(token), EventKind::Output);
        assert_eq!(classify(text), EventKind::Output);
        assert_eq!(classify(finish), EventKind::Output);
        assert!(matches!(classify(usage), EventKind::Usage(_)));
        assert_eq!(classify(error), EventKind::Output);
        assert!(event_is_error(error));
        assert_eq!(classify(b": keep-alive\n\n"), EventKind::Comment);
        assert_eq!(classify(b"data: [DONE]\n\n"), EventKind::Done);
        assert_eq!(classify(b"data: not json\n\n"), EventKind::Output);
    }

    #[test]
    fn stored_streams_replay_as_their_events() {
        let body = Bytes::from_static(b"data: 1\n\ndata: 2\n\ndata: [DONE]\n\n");
        assert_eq!(split_events(body).len(), 3);
    }

    #[test]
    fn oversized_events_are_refused() {
        let mut s = Splitter::default();
        let big = vec![b'x'; MAX_EVENT_BYTES + 1];
        assert!(s.push(&big).is_err());
    }
}
