//! Response objects, output items and streaming events in the shapes of OpenAI's
//! Responses API.

use serde_json::{json, Value};

use super::request::Echo;
use crate::agent::{Event, Item, RunOutcome, Stop};
use crate::model::Usage;

/// An item as JSON; `done: false` gives the in-progress form of `output_item.added`.
pub fn item_json(item: &Item, done: bool) -> Value {
    let status = if done { "completed" } else { "in_progress" };
    match item {
        Item::Message {
            id,
            text,
            incomplete,
        } => {
            let content = if done {
                json!([{"type": "output_text", "text": text, "annotations": [], "logprobs": []}])
            } else {
                json!([])
            };
            let status = if done && *incomplete {
                "incomplete"
            } else {
                status
            };
            json!({"type": "message", "id": id, "status": status, "role": "assistant",
                   "content": content})
        }
        Item::Reasoning { id, text } => {
            let content = if done {
                json!([{"type": "reasoning_text", "text": text}])
            } else {
                json!([])
            };
            json!({"type": "reasoning", "id": id, "summary": [], "content": content,
                   "status": status})
        }
        Item::FunctionCall {
            id,
            call_id,
            name,
            arguments,
        } => {
            let arguments = if done { arguments.as_str() } else { "" };
            json!({"type": "function_call", "id": id, "call_id": call_id, "name": name,
                   "arguments": arguments, "status": status})
        }
        Item::FunctionCallOutput {
            id,
            call_id,
            name,
            output,
            ..
        } => {
            let output = if done { output.as_str() } else { "" };
            json!({"type": "function_call_output", "id": id, "call_id": call_id, "name": name,
                   "output": output, "status": status})
        }
    }
}

/// `usage` of a response.
pub fn usage_json(usage: &Usage) -> Value {
    json!({
        "input_tokens": usage.prompt_tokens,
        "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
    })
}

/// What a response object is made of besides its outcome.
#[derive(Debug, Clone)]
pub struct ResponseHead {
    /// `resp_...`.
    pub id: String,
    /// Unix seconds.
    pub created_at: u64,
    /// The model's name.
    pub model: String,
    /// `previous_response_id`.
    pub previous_response_id: Option<String>,
    /// `store`.
    pub store: bool,
    /// Echoed request fields.
    pub echo: Echo,
}

impl ResponseHead {
    /// The response object, `in_progress` with no output.
    pub fn in_progress(&self) -> Value {
        self.object(
            "in_progress",
            Value::Null,
            Value::Null,
            json!([]),
            Value::Null,
            None,
        )
    }

    /// The finished response object.
    pub fn finished(&self, outcome: &RunOutcome) -> Value {
        let output: Vec<Value> = outcome.items.iter().map(|i| item_json(i, true)).collect();
        let (status, error, incomplete) = match &outcome.stop {
            Stop::Completed | Stop::AwaitingClient => ("completed", Value::Null, Value::Null),
            Stop::Incomplete(reason) => ("incomplete", Value::Null, json!({"reason": reason})),
            Stop::Failed { code, message } => (
                "failed",
                json!({"code": code, "message": message}),
                Value::Null,
            ),
        };
        let completed_at = (status == "completed").then(now);
        self.object(
            status,
            error,
            incomplete,
            Value::Array(output),
            usage_json(&outcome.usage),
            completed_at,
        )
    }

    fn object(
        &self,
        status: &str,
        error: Value,
        incomplete: Value,
        output: Value,
        usage: Value,
        completed_at: Option<u64>,
    ) -> Value {
        let e = &self.echo;
        json!({
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "completed_at": completed_at,
            "status": status,
            "error": error,
            "incomplete_details": incomplete,
            "instructions": e.instructions,
            "max_output_tokens": e.max_output_tokens,
            "max_tool_calls": e.max_tool_calls,
            "model": self.model,
            "output": output,
            "parallel_tool_calls": e.parallel_tool_calls,
            "previous_response_id": self.previous_response_id,
            "reasoning": e.reasoning,
            "store": self.store,
            "temperature": e.temperature,
            "text": {"format": {"type": "text"}},
            "tool_choice": e.tool_choice,
            "tools": e.tools,
            "top_p": e.top_p,
            "truncation": e.truncation,
            "usage": usage,
            "user": e.user,
            "metadata": e.metadata,
        })
    }
}

/// Unix seconds now.
pub fn now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// Turns loop events into Responses streaming events, numbering them.
#[derive(Debug, Default)]
pub struct EventWriter {
    sequence: u64,
    item_ids: Vec<String>,
}

impl EventWriter {
    fn event(&mut self, kind: &str, mut body: Value) -> (String, Value) {
        body["type"] = json!(kind);
        body["sequence_number"] = json!(self.sequence);
        self.sequence += 1;
        (kind.to_string(), body)
    }

    fn id(&self, index: usize) -> String {
        self.item_ids.get(index).cloned().unwrap_or_default()
    }

    /// `response.created` and `response.in_progress`.
    pub fn start(&mut self, response: &Value) -> Vec<(String, Value)> {
        vec![
            self.event("response.created", json!({"response": response})),
            self.event("response.in_progress", json!({"response": response})),
        ]
    }

    /// The events of one loop event (none for step logs).
    pub fn translate(&mut self, event: &Event) -> Vec<(String, Value)> {
        match event {
            Event::ItemAdded { index, item } => {
                let id = item_id(item).to_string();
                if self.item_ids.len() <= *index {
                    self.item_ids.resize(*index + 1, String::new());
                }
                self.item_ids[*index] = id.clone();
                let mut out = vec![self.event(
                    "response.output_item.added",
                    json!({"output_index": index, "item": item_json(item, false)}),
                )];
                let part = match item {
                    Item::Message { .. } => {
                        Some(json!({"type": "output_text", "text": "", "annotations": []}))
                    }
                    Item::Reasoning { .. } => Some(json!({"type": "reasoning_text", "text": ""})),
                    _ => None,
                };
                if let Some(part) = part {
                    out.push(self.event(
                        "response.content_part.added",
                        json!({"item_id": id, "output_index": index, "content_index": 0,
                               "part": part}),
                    ));
                }
                out
            }
            Event::TextDelta { index, delta } => {
                let id = self.id(*index);
                vec![self.event(
                    "response.output_text.delta",
                    json!({"item_id": id, "output_index": index, "content_index": 0,
                           "delta": delta, "logprobs": []}),
                )]
            }
            Event::ReasoningDelta { index, delta } => {
                let id = self.id(*index);
                vec![self.event(
                    "response.reasoning_text.delta",
                    json!({"item_id": id, "output_index": index, "content_index": 0,
                           "delta": delta}),
                )]
            }
            Event::ArgumentsDelta { index, delta } => {
                let id = self.id(*index);
                vec![self.event(
                    "response.function_call_arguments.delta",
                    json!({"item_id": id, "output_index": index, "delta": delta}),
                )]
            }
            Event::ItemDone { index, item } => {
                let id = item_id(item).to_string();
                let mut out = Vec::new();
                match item {
                    Item::Message { text, .. } => {
                        out.push(self.event(
                            "response.output_text.done",
                            json!({"item_id": id, "output_index": index, "content_index": 0,
                                   "text": text, "logprobs": []}),
                        ));
                        out.push(self.event(
                            "response.content_part.done",
                            json!({"item_id": id, "output_index": index, "content_index": 0,
                                   "part": {"type": "output_text", "text": text,
                                            "annotations": []}}),
                        ));
                    }
                    Item::Reasoning { text, .. } => {
                        out.push(self.event(
                            "response.reasoning_text.done",
                            json!({"item_id": id, "output_index": index, "content_index": 0,
                                   "text": text}),
                        ));
                        out.push(self.event(
                            "response.content_part.done",
                            json!({"item_id": id, "output_index": index, "content_index": 0,
                                   "part": {"type": "reasoning_text", "text": text}}),
                        ));
                    }
                    Item::FunctionCall {
                        name, arguments, ..
                    } => {
                        out.push(self.event(
                            "response.function_call_arguments.done",
                            json!({"item_id": id, "output_index": index, "name": name,
                                   "arguments": arguments}),
                        ));
                    }
                    Item::FunctionCallOutput { .. } => {}
                }
                out.push(self.event(
                    "response.output_item.done",
                    json!({"output_index": index, "item": item_json(item, true)}),
                ));
                out
            }
            Event::Step(_) => Vec::new(),
        }
    }

    /// `response.completed`, `response.incomplete` or `response.failed`.
    pub fn finish(&mut self, response: &Value) -> (String, Value) {
        let kind = match response.get("status").and_then(Value::as_str) {
            Some("incomplete") => "response.incomplete",
            Some("failed") => "response.failed",
            _ => "response.completed",
        };
        self.event(kind, json!({"response": response}))
    }

    /// An `error` event (the run could not start).
    pub fn error(&mut self, code: &str, message: &str) -> (String, Value) {
        self.event(
            "error",
            json!({"code": code, "message": message, "param": null}),
        )
    }
}

fn item_id(item: &Item) -> &str {
    match item {
        Item::Message { id, .. }
        | Item::Reasoning { id, .. }
        | Item::FunctionCall { id, .. }
        | Item::FunctionCallOutput { id, .. } => id,
    }
}
