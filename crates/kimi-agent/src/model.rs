//! The model: any OpenAI-compatible chat-completions endpoint (kimi-infer's own, vLLM,
//! SGLang, llama.cpp's server, ...), called with `stream: true` so that text and tool-call
//! arguments reach the agent's own stream as they are generated.

use std::time::Duration;

use futures_util::StreamExt;
use serde_json::{json, Map, Value};

use crate::error::ModelError;
use crate::message::{Message, ToolCall};

/// Most bytes of one streamed answer (a broken endpoint cannot exhaust memory).
const MAX_ANSWER_BYTES: usize = 64 << 20;

/// A client of one endpoint and model.
#[derive(Debug, Clone)]
pub struct ChatModel {
    http: reqwest::Client,
    base_url: String,
    api_key: Option<String>,
    /// The model name sent in each request.
    pub model: String,
}

/// One chat-completions request.
#[derive(Debug, Clone, Default)]
pub struct ChatRequest {
    /// The conversation.
    pub messages: Vec<Message>,
    /// `tools` entries (function specs).
    pub tools: Vec<Value>,
    /// `tool_choice` (`auto` when absent and there are tools).
    pub tool_choice: Option<Value>,
    /// `max_tokens` of this call.
    pub max_tokens: Option<u64>,
    /// Sampling temperature.
    pub temperature: Option<f64>,
    /// Nucleus sampling.
    pub top_p: Option<f64>,
    /// `parallel_tool_calls`.
    pub parallel_tool_calls: Option<bool>,
    /// Other fields passed through (`seed`, `chat_template_kwargs`, `logit_bias`, ...).
    pub extra: Map<String, Value>,
}

/// Token counts of one call.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Usage {
    /// Prompt tokens.
    pub prompt_tokens: u64,
    /// Generated tokens.
    pub completion_tokens: u64,
}

impl std::ops::AddAssign for Usage {
    fn add_assign(&mut self, other: Usage) {
        self.prompt_tokens += other.prompt_tokens;
        self.completion_tokens += other.completion_tokens;
    }
}

/// What the model said in one call.
#[derive(Debug, Clone, Default)]
pub struct ChatTurn {
    /// Text.
    pub content: String,
    /// Reasoning text (`reasoning_content`), if the endpoint sends it.
    pub reasoning: String,
    /// Tool calls, in order.
    pub tool_calls: Vec<ToolCall>,
    /// `stop`, `length`, `tool_calls`, ...
    pub finish_reason: Option<String>,
    /// Token counts (zero when the endpoint does not report them).
    pub usage: Usage,
}

/// A piece of an answer as it streams.
#[derive(Debug, Clone, PartialEq)]
pub enum Delta {
    /// Text.
    Content(String),
    /// Reasoning text.
    Reasoning(String),
    /// A tool call begins (its position among this answer's calls, and its name).
    ToolCallStart {
        /// Position among this answer's calls.
        index: usize,
        /// Function name.
        name: String,
    },
    /// More of a tool call's arguments.
    ToolCallArguments {
        /// Position among this answer's calls.
        index: usize,
        /// The text.
        text: String,
    },
}

impl ChatModel {
    /// A client of `base_url` (e.g. `http://127.0.0.1:8000/v1`) for `model`.
    ///
    /// # Errors
    ///
    /// A URL that is not http(s), or a client that cannot be built.
    pub fn new(
        base_url: &str,
        api_key: Option<String>,
        model: String,
    ) -> Result<ChatModel, ModelError> {
        let base_url = base_url.trim_end_matches('/').to_string();
        let parsed = reqwest::Url::parse(&base_url).map_err(|e| ModelError::Connect {
            url: base_url.clone(),
            message: format!("not a URL: {e}"),
        })?;
        if !matches!(parsed.scheme(), "http" | "https") {
            return Err(ModelError::Connect {
                url: base_url,
                message: "the endpoint must be an http or https URL".into(),
            });
        }
        let http = crate::http::client_builder()
            .build()
            .map_err(|e| ModelError::Connect {
                url: base_url.clone(),
                message: e.to_string(),
            })?;
        Ok(ChatModel {
            http,
            base_url,
            api_key,
            model,
        })
    }

    /// The endpoint's base URL.
    pub fn base_url(&self) -> &str {
        &self.base_url
    }

    /// `GET /models`: the served models with their context length when reported
    /// (`max_model_len`, as vLLM and kimi-infer send it).
    ///
    /// # Errors
    ///
    /// [`ModelError`] when the endpoint cannot be reached or answers an error.
    pub async fn list_models(&self) -> Result<Vec<(String, Option<u64>)>, ModelError> {
        let url = format!("{}/models", self.base_url);
        let mut request = self.http.get(&url).timeout(Duration::from_secs(30));
        if let Some(key) = &self.api_key {
            request = request.bearer_auth(key);
        }
        let response = request.send().await.map_err(|e| self.connect_error(&e))?;
        let status = response.status();
        let body: Value = response.json().await.map_err(|e| self.connect_error(&e))?;
        if !status.is_success() {
            return Err(status_error(status.as_u16(), &body));
        }
        let models = body
            .get("data")
            .and_then(Value::as_array)
            .ok_or_else(|| ModelError::Protocol("`/models` has no `data` list".into()))?;
        Ok(models
            .iter()
            .filter_map(|m| {
                let id = m.get("id")?.as_str()?.to_string();
                Some((id, m.get("max_model_len").and_then(Value::as_u64)))
            })
            .collect())
    }

    fn connect_error(&self, e: &reqwest::Error) -> ModelError {
        ModelError::Connect {
            url: self.base_url.clone(),
            message: crate::http::describe_error(e),
        }
    }

    /// One streamed chat completion; each piece is passed to `on_delta` as it arrives.
    ///
    /// # Errors
    ///
    /// [`ModelError`]: unreachable, an error status, a malformed stream, or `timeout`.
    pub async fn complete(
        &self,
        request: &ChatRequest,
        timeout: Duration,
        on_delta: &mut (dyn FnMut(Delta) + Send),
    ) -> Result<ChatTurn, ModelError> {
        let secs = timeout.as_secs_f64();
        tokio::time::timeout(timeout, self.complete_inner(request, on_delta))
            .await
            .unwrap_or(Err(ModelError::Timeout(secs)))
    }

    async fn complete_inner(
        &self,
        request: &ChatRequest,
        on_delta: &mut (dyn FnMut(Delta) + Send),
    ) -> Result<ChatTurn, ModelError> {
        let body = self.body(request);
        let url = format!("{}/chat/completions", self.base_url);
        let mut http = self.http.post(&url).json(&body);
        if let Some(key) = &self.api_key {
            http = http.bearer_auth(key);
        }
        let response = http.send().await.map_err(|e| self.connect_error(&e))?;
        let status = response.status();
        if !status.is_success() {
            let body = crate::http::read_capped(response, 1 << 20)
                .await
                .map(|b| serde_json::from_slice(&b.bytes).unwrap_or(Value::Null))
                .unwrap_or(Value::Null);
            return Err(status_error(status.as_u16(), &body));
        }
        let mut turn = ChatTurn::default();
        let mut stream = response.bytes_stream();
        let mut buffer: Vec<u8> = Vec::new();
        let mut received = 0usize;
        let mut done = false;
        while !done {
            let Some(chunk) = stream.next().await else {
                break;
            };
            let chunk = chunk.map_err(|e| self.connect_error(&e))?;
            received += chunk.len();
            if received > MAX_ANSWER_BYTES {
                return Err(ModelError::Protocol(format!(
                    "the answer passed {MAX_ANSWER_BYTES} bytes"
                )));
            }
            buffer.extend_from_slice(&chunk);
            while let Some((event, rest)) = split_event(&buffer) {
                let data = event_data(event);
                buffer = rest.to_vec();
                let Some(data) = data else { continue };
                if data.trim() == "[DONE]" {
                    done = true;
                    break;
                }
                let value: Value = serde_json::from_str(&data).map_err(|e| {
                    ModelError::Protocol(format!("a stream chunk is not JSON ({e}): {data}"))
                })?;
                apply_chunk(&value, &mut turn, on_delta)?;
            }
        }
        if !done && turn.finish_reason.is_none() {
            return Err(ModelError::Protocol(
                "the stream ended before the answer was finished".into(),
            ));
        }
        for (i, call) in turn.tool_calls.iter_mut().enumerate() {
            if call.id.is_empty() {
                call.id = format!("call_{}_{i}", crate::message::random_id());
            }
        }
        Ok(turn)
    }

    fn body(&self, request: &ChatRequest) -> Value {
        let messages: Vec<Value> = request.messages.iter().map(Message::to_chat).collect();
        let mut obj = Map::new();
        obj.insert("model".into(), json!(self.model));
        obj.insert("messages".into(), Value::Array(messages));
        obj.insert("stream".into(), Value::Bool(true));
        obj.insert("stream_options".into(), json!({"include_usage": true}));
        if !request.tools.is_empty() {
            obj.insert("tools".into(), Value::Array(request.tools.clone()));
            if let Some(choice) = &request.tool_choice {
                obj.insert("tool_choice".into(), choice.clone());
            }
            if let Some(p) = request.parallel_tool_calls {
                obj.insert("parallel_tool_calls".into(), Value::Bool(p));
            }
        }
        if let Some(n) = request.max_tokens {
            obj.insert("max_tokens".into(), json!(n));
        }
        if let Some(t) = request.temperature {
            obj.insert("temperature".into(), json!(t));
        }
        if let Some(p) = request.top_p {
            obj.insert("top_p".into(), json!(p));
        }
        for (k, v) in &request.extra {
            obj.entry(k.clone()).or_insert_with(|| v.clone());
        }
        Value::Object(obj)
    }
}

/// The first complete SSE event in `buffer` and what follows it.
fn split_event(buffer: &[u8]) -> Option<(&[u8], &[u8])> {
    let lf = buffer.windows(2).position(|w| w == b"\n\n").map(|p| (p, 2));
    let crlf = buffer
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .map(|p| (p, 4));
    let (at, len) = match (lf, crlf) {
        (Some(a), Some(b)) => {
            if a.0 <= b.0 {
                a
            } else {
                b
            }
        }
        (a, b) => a.or(b)?,
    };
    Some((&buffer[..at], &buffer[at + len..]))
}

/// The `data:` lines of an event, joined; `None` for an event without data.
fn event_data(event: &[u8]) -> Option<String> {
    let text = String::from_utf8_lossy(event);
    let mut data: Option<String> = None;
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("data:") {
            let rest = rest.strip_prefix(' ').unwrap_or(rest);
            match &mut data {
                Some(d) => {
                    d.push('\n');
                    d.push_str(rest);
                }
                None => data = Some(rest.to_string()),
            }
        }
    }
    data
}

fn apply_chunk(
    chunk: &Value,
    turn: &mut ChatTurn,
    on_delta: &mut (dyn FnMut(Delta) + Send),
) -> Result<(), ModelError> {
    if let Some(error) = chunk.get("error") {
        return Err(status_error(500, &json!({ "error": error })));
    }
    if let Some(usage) = chunk.get("usage").filter(|u| u.is_object()) {
        turn.usage = Usage {
            prompt_tokens: usage
                .get("prompt_tokens")
                .and_then(Value::as_u64)
                .unwrap_or(0),
            completion_tokens: usage
                .get("completion_tokens")
                .and_then(Value::as_u64)
                .unwrap_or(0),
        };
    }
    let Some(choice) = chunk
        .get("choices")
        .and_then(Value::as_array)
        .and_then(|c| c.first())
    else {
        return Ok(());
    };
    if let Some(reason) = choice.get("finish_reason").and_then(Value::as_str) {
        turn.finish_reason = Some(reason.to_string());
    }
    let Some(delta) = choice.get("delta") else {
        return Ok(());
    };
    for key in ["reasoning_content", "reasoning"] {
        if let Some(text) = delta.get(key).and_then(Value::as_str) {
            if !text.is_empty() {
                turn.reasoning.push_str(text);
                on_delta(Delta::Reasoning(text.to_string()));
            }
            break;
        }
    }
    if let Some(text) = delta.get("content").and_then(Value::as_str) {
        if !text.is_empty() {
            turn.content.push_str(text);
            on_delta(Delta::Content(text.to_string()));
        }
    }
    for call in delta
        .get("tool_calls")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
    {
        let index = call
            .get("index")
            .and_then(Value::as_u64)
            .map_or(turn.tool_calls.len().saturating_sub(1), |i| i as usize);
        if index > turn.tool_calls.len() || index > 1024 {
            return Err(ModelError::Protocol(format!(
                "tool call index {index} skips ahead of the {} calls so far",
                turn.tool_calls.len()
            )));
        }
        let function = call.get("function");
        let name = function
            .and_then(|f| f.get("name"))
            .and_then(Value::as_str)
            .unwrap_or("");
        if index == turn.tool_calls.len() {
            turn.tool_calls.push(ToolCall {
                id: String::new(),
                name: name.to_string(),
                arguments: String::new(),
            });
            on_delta(Delta::ToolCallStart {
                index,
                name: name.to_string(),
            });
        } else if !name.is_empty() && turn.tool_calls[index].name.is_empty() {
            turn.tool_calls[index].name = name.to_string();
        }
        let entry = &mut turn.tool_calls[index];
        if let Some(id) = call.get("id").and_then(Value::as_str) {
            if entry.id.is_empty() {
                entry.id = id.to_string();
            }
        }
        if let Some(args) = function
            .and_then(|f| f.get("arguments"))
            .and_then(Value::as_str)
        {
            if !args.is_empty() {
                entry.arguments.push_str(args);
                on_delta(Delta::ToolCallArguments {
                    index,
                    text: args.to_string(),
                });
            }
        }
    }
    Ok(())
}

/// An error answer as [`ModelError::Status`].
fn status_error(status: u16, body: &Value) -> ModelError {
    let error = body.get("error");
    let message = error
        .and_then(|e| e.get("message").or(Some(e)))
        .and_then(|m| m.as_str().map(str::to_owned))
        .or_else(|| body.get("detail").map(Value::to_string))
        .unwrap_or_else(|| {
            if body.is_null() {
                "(no JSON body)".to_string()
            } else {
                body.to_string()
            }
        });
    let code = error
        .and_then(|e| e.get("code"))
        .and_then(Value::as_str)
        .map(str::to_owned);
    ModelError::Status {
        status,
        message,
        code,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sse_events_split_on_blank_lines() {
        let buf = b"data: {\"a\":1}\n\ndata: [DONE]\r\n\r\nrest";
        let (e, rest) = split_event(buf).unwrap();
        assert_eq!(event_data(e).unwrap(), "{\"a\":1}");
        let (e, rest) = split_event(rest).unwrap();
        assert_eq!(event_data(e).unwrap(), "[DONE]");
        assert_eq!(rest, b"rest");
        assert!(split_event(b"data: partial").is_none());
        assert!(event_data(b": comment").is_none());
    }

    #[test]
    fn chunks_accumulate_text_and_calls() {
        let mut turn = ChatTurn::default();
        let mut deltas = Vec::new();
        let mut sink = |d: Delta| deltas.push(d);
        for chunk in [
            json!({"choices": [{"delta": {"content": "Hi"}}]}),
            json!({"choices": [{"delta": {"tool_calls": [{"index": 0, "id": "c1",
                "function": {"name": "f", "arguments": "{\"a\""}}]}}]}),
            json!({"choices": [{"delta": {"tool_calls": [{"index": 0,
                "function": {"arguments": ": 1}"}}]}, "finish_reason": "tool_calls"}]}),
            json!({"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 7}}),
        ] {
            apply_chunk(&chunk, &mut turn, &mut sink).unwrap();
        }
        assert_eq!(turn.content, "Hi");
        assert_eq!(turn.tool_calls[0].arguments, "{\"a\": 1}");
        assert_eq!(turn.tool_calls[0].id, "c1");
        assert_eq!(turn.finish_reason.as_deref(), Some("tool_calls"));
        assert_eq!(turn.usage.completion_tokens, 7);
        let bad = json!({"choices": [{"delta": {"tool_calls": [{"index": 5}]}}]});
        assert!(apply_chunk(&bad, &mut turn, &mut sink).is_err());
        assert_eq!(deltas.len(), 4);
    }
}
