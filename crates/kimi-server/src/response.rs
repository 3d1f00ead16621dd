//! Delivering a [`Run`]: collected into one JSON body, or streamed as server-sent events
//! (`data: {chunk}` frames, keep-alive comments while idle, `data: [DONE]` last).

use std::convert::Infallible;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::http::header;
use axum::response::{IntoResponse, Response};
use futures_util::stream;
use kimi_tokenizer::Tokenizer;
use serde_json::{json, Value};
use tokio::time::Instant;

use crate::decode::{token_bytes, token_text};
use crate::error::ApiError;
use crate::generation::{Delta, Run, TokenLogprob};

/// An idle stream sends a comment this often, which also notices a client that left.
const KEEP_ALIVE: Duration = Duration::from_secs(10);

/// Logprobs as JSON numbers (`-inf` has no JSON form; vLLM clamps the same way).
pub(crate) fn logprob_value(logprob: f32) -> f64 {
    f64::from(logprob.max(-9999.0))
}

/// A chat logprob entry: `{"token", "logprob", "bytes", "top_logprobs": [...]}`.
pub(crate) fn chat_logprob(tokenizer: &Tokenizer, entry: &TokenLogprob) -> Value {
    let one = |id: u32, logprob: f32| {
        json!({
            "token": token_text(tokenizer, id),
            "logprob": logprob_value(logprob),
            "bytes": token_bytes(tokenizer, id),
        })
    };
    let mut value = one(entry.token, entry.logprob);
    value["top_logprobs"] = entry.top.iter().map(|&(id, lp)| one(id, lp)).collect();
    value
}

/// A whole choice, collected.
#[derive(Debug, Default)]
pub(crate) struct CollectedChoice {
    pub reasoning: String,
    pub content: String,
    /// `(id, name, arguments)` per call.
    pub tool_calls: Vec<(String, String, String)>,
    pub logprobs: Vec<TokenLogprob>,
    pub finish_reason: &'static str,
}

/// Runs to the end (or the deadline) and gathers each choice.
pub(crate) async fn collect(
    run: &mut Run,
    num_choices: usize,
    deadline: Option<(Instant, Duration)>,
) -> Result<Vec<CollectedChoice>, ApiError> {
    let mut choices: Vec<CollectedChoice> = (0..num_choices)
        .map(|_| CollectedChoice::default())
        .collect();
    loop {
        let next = match deadline {
            Some((at, limit)) => tokio::time::timeout_at(at, run.next())
                .await
                .map_err(|_| ApiError::timeout(limit.as_secs_f64()))?,
            None => run.next().await,
        };
        let Some((index, delta)) = next else {
            return Ok(choices);
        };
        if let Some(message) = delta.error {
            return Err(ApiError::internal(format!("generation failed: {message}")));
        }
        let choice = &mut choices[index];
        choice.reasoning += &delta.reasoning;
        choice.content += &delta.content;
        for call in delta.tool_calls {
            match (call.id, call.name) {
                (Some(id), Some(name)) => choice.tool_calls.push((id, name, call.arguments)),
                _ => {
                    if let Some(last) = choice.tool_calls.last_mut() {
                        last.2 += &call.arguments;
                    }
                }
            }
        }
        choice.logprobs.extend(delta.logprobs);
        if let Some(reason) = delta.finish_reason {
            choice.finish_reason = reason;
        }
    }
}

/// How an endpoint writes its chunks.
pub(crate) trait ChunkWriter: Send + 'static {
    /// Chunks sent before any token (chat: the assistant role; completions: echoed prompts).
    fn opening(&mut self) -> Vec<Value>;
    /// The chunk for one delta, if it carries anything.
    fn delta(&mut self, index: usize, delta: Delta) -> Option<Value>;
    /// The closing usage chunk, if the client asked for one.
    fn usage(&mut self, completion_tokens: usize) -> Option<Value>;
}

fn frame(value: &Value) -> String {
    format!("data: {value}\n\n")
}

const DONE: &str = "data: [DONE]\n\n";

enum Phase {
    Opening,
    Running,
    Done,
}

struct StreamState<W> {
    run: Run,
    writer: W,
    phase: Phase,
    deadline: Option<(Instant, Duration)>,
}

impl<W: ChunkWriter> StreamState<W> {
    /// The next bytes to send; `None` once `[DONE]` went out.
    async fn next_frames(&mut self) -> Option<String> {
        match self.phase {
            Phase::Opening => {
                self.phase = Phase::Running;
                Some(self.writer.opening().iter().map(frame).collect())
            }
            Phase::Running => Some(self.running().await),
            Phase::Done => None,
        }
    }

    async fn running(&mut self) -> String {
        loop {
            let keep_alive_at = Instant::now() + KEEP_ALIVE;
            let wake = match self.deadline {
                Some((at, _)) => at.min(keep_alive_at),
                None => keep_alive_at,
            };
            match tokio::time::timeout_at(wake, self.run.next()).await {
                Ok(Some((_, delta))) if delta.error.is_some() => {
                    self.phase = Phase::Done;
                    let message = delta.error.unwrap_or_default();
                    let err = ApiError::internal(format!("generation failed: {message}"));
                    return frame(&err.to_json()) + DONE;
                }
                Ok(Some((index, delta))) => {
                    if let Some(chunk) = self.writer.delta(index, delta) {
                        return frame(&chunk);
                    }
                }
                Ok(None) => {
                    self.phase = Phase::Done;
                    let usage = self.writer.usage(self.run.completion_tokens());
                    return usage.as_ref().map(frame).unwrap_or_default() + DONE;
                }
                Err(_) => match self.deadline {
                    Some((at, limit)) if Instant::now() >= at => {
                        self.phase = Phase::Done;
                        return frame(&ApiError::timeout(limit.as_secs_f64()).to_json()) + DONE;
                    }
                    _ => return ": keep-alive\n\n".into(),
                },
            }
        }
    }
}

/// A `text/event-stream` response that drives `run`. Dropping the body (the client left)
/// drops the run, which cancels its sequences.
pub(crate) fn stream<W: ChunkWriter>(
    run: Run,
    writer: W,
    deadline: Option<(Instant, Duration)>,
) -> Response {
    let state = StreamState {
        run,
        writer,
        phase: Phase::Opening,
        deadline,
    };
    let frames = stream::unfold(state, |mut state| async move {
        let text = state.next_frames().await?;
        Some((Ok::<_, Infallible>(Bytes::from(text)), state))
    });
    (
        [
            (header::CONTENT_TYPE, "text/event-stream"),
            (header::CACHE_CONTROL, "no-cache"),
        ],
        Body::from_stream(frames),
    )
        .into_response()
}
