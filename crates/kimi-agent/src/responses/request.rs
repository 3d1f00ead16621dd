//! A `POST /v1/responses` body, read into a [`RunRequest`] (with the fields the response
//! echoes back). Fields this server cannot honour are refused by name; fields that only
//! tune OpenAI's own service (`user`, `prompt_cache_key`, `service_tier`, ...) are ignored.

use kimi_server::ApiError;
use serde_json::{json, Map, Value};

use crate::agent::RunRequest;
use crate::message::{Message, ToolCall};

/// Fields passed through to every chat-completions call (vLLM's and kimi-infer's sampling
/// extensions, sent by the `openai` client through `extra_body`).
const PASS_THROUGH: &[&str] = &[
    "seed",
    "chat_template_kwargs",
    "logit_bias",
    "top_k",
    "min_p",
    "repetition_penalty",
    "frequency_penalty",
    "presence_penalty",
];

/// A parsed request.
#[derive(Debug)]
pub struct ParsedRequest {
    /// For the loop (its `messages` hold only the new input; the conversation of
    /// `previous_response_id` goes in front of it later).
    pub run: RunRequest,
    /// `previous_response_id`.
    pub previous_response_id: Option<String>,
    /// `stream`.
    pub stream: bool,
    /// `store` (default true).
    pub store: bool,
    /// The fields the response object repeats.
    pub echo: Echo,
}

/// Request fields the response object repeats.
#[derive(Debug, Clone, Default)]
pub struct Echo {
    /// `instructions`.
    pub instructions: Value,
    /// `max_output_tokens`.
    pub max_output_tokens: Value,
    /// `max_tool_calls`.
    pub max_tool_calls: Value,
    /// `metadata`.
    pub metadata: Value,
    /// `parallel_tool_calls`.
    pub parallel_tool_calls: bool,
    /// `temperature`.
    pub temperature: Value,
    /// `top_p`.
    pub top_p: Value,
    /// `tool_choice` as sent (default `auto`).
    pub tool_choice: Value,
    /// `tools` as sent (Responses format).
    pub tools: Value,
    /// `truncation`.
    pub truncation: Value,
    /// `user`.
    pub user: Value,
    /// `reasoning`.
    pub reasoning: Value,
}

fn invalid(message: impl Into<String>, param: &str) -> ApiError {
    ApiError::invalid(message, Some(param))
}

fn number(body: &Map<String, Value>, key: &str) -> Result<Option<f64>, ApiError> {
    match body.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v
            .as_f64()
            .map(Some)
            .ok_or_else(|| invalid(format!("`{key}` must be a number"), key)),
    }
}

fn count(body: &Map<String, Value>, key: &str, min: u64) -> Result<Option<u64>, ApiError> {
    match body.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => match v.as_u64() {
            Some(n) if n >= min => Ok(Some(n)),
            _ => Err(invalid(
                format!("`{key}` must be an integer of at least {min}"),
                key,
            )),
        },
    }
}

fn flag(body: &Map<String, Value>, key: &str, default: bool) -> Result<bool, ApiError> {
    match body.get(key) {
        None | Some(Value::Null) => Ok(default),
        Some(Value::Bool(b)) => Ok(*b),
        Some(_) => Err(invalid(format!("`{key}` must be true or false"), key)),
    }
}

/// Reads `body`; `model_name` is the one model this server answers for.
///
/// # Errors
///
/// OpenAI's 400 (or 404 for another model) naming the field at fault.
pub fn parse(body: &Value, model_name: &str) -> Result<ParsedRequest, ApiError> {
    let body = body
        .as_object()
        .ok_or_else(|| ApiError::invalid("The request body must be a JSON object", None))?;
    match body.get("model") {
        None | Some(Value::Null) => {}
        Some(Value::String(m)) if m == model_name => {}
        Some(Value::String(m)) => return Err(ApiError::model_not_found(m)),
        Some(_) => return Err(invalid("`model` must be a string", "model")),
    }
    for (key, what) in [
        ("background", "background responses"),
        (
            "conversation",
            "conversation objects (use previous_response_id)",
        ),
        ("prompt", "prompt templates"),
    ] {
        if body
            .get(key)
            .is_some_and(|v| !v.is_null() && v != &Value::Bool(false))
        {
            return Err(invalid(
                format!("{what} are not supported by this server"),
                key,
            ));
        }
    }
    if let Some(format) = body.get("text").and_then(|t| t.get("format")) {
        let kind = format.get("type").and_then(Value::as_str).unwrap_or("");
        if kind != "text" {
            return Err(invalid(
                format!("`text.format` `{kind}` is not supported: answers are plain text"),
                "text.format",
            ));
        }
    }
    let messages = match body.get("input") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::String(text)) => vec![Message::User {
            content: text.clone(),
        }],
        Some(Value::Array(items)) => input_items(items)?,
        Some(_) => {
            return Err(invalid(
                "`input` must be a string or a list of input items",
                "input",
            ))
        }
    };
    let instructions = match body.get("instructions") {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) => Some(s.clone()),
        Some(_) => return Err(invalid("`instructions` must be a string", "instructions")),
    };
    let previous_response_id = match body.get("previous_response_id") {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) => Some(s.clone()),
        Some(_) => {
            return Err(invalid(
                "`previous_response_id` must be a string",
                "previous_response_id",
            ))
        }
    };
    if messages.is_empty() && previous_response_id.is_none() {
        return Err(invalid("`input` is required", "input"));
    }
    let (client_tools, tools_echo) = tools(body.get("tools"))?;
    let (tool_choice, tool_choice_echo) = tool_choice(body.get("tool_choice"))?;
    let parallel = flag(body, "parallel_tool_calls", true)?;
    let max_output_tokens = count(body, "max_output_tokens", 1)?;
    let max_tool_calls = count(body, "max_tool_calls", 0)?;
    let max_steps = count(body, "max_steps", 1)?;
    let temperature = number(body, "temperature")?;
    let top_p = number(body, "top_p")?;
    let mut extra = Map::new();
    for key in PASS_THROUGH {
        if let Some(v) = body.get(*key).filter(|v| !v.is_null()) {
            extra.insert((*key).to_string(), v.clone());
        }
    }
    let echo = Echo {
        instructions: body.get("instructions").cloned().unwrap_or(Value::Null),
        max_output_tokens: body
            .get("max_output_tokens")
            .cloned()
            .unwrap_or(Value::Null),
        max_tool_calls: body.get("max_tool_calls").cloned().unwrap_or(Value::Null),
        metadata: body.get("metadata").cloned().unwrap_or(json!({})),
        parallel_tool_calls: parallel,
        temperature: body.get("temperature").cloned().unwrap_or(Value::Null),
        top_p: body.get("top_p").cloned().unwrap_or(Value::Null),
        tool_choice: tool_choice_echo,
        tools: tools_echo,
        truncation: body.get("truncation").cloned().unwrap_or(json!("disabled")),
        user: body.get("user").cloned().unwrap_or(Value::Null),
        reasoning: body
            .get("reasoning")
            .cloned()
            .unwrap_or(json!({"effort": null, "summary": null})),
    };
    Ok(ParsedRequest {
        run: RunRequest {
            instructions,
            messages,
            client_tools,
            tool_choice,
            reset_tool_choice: flag(body, "reset_tool_choice", true)?,
            max_output_tokens,
            max_tool_calls: max_tool_calls.map(|n| n as usize),
            max_steps: max_steps.map(|n| n as usize),
            temperature,
            top_p,
            parallel_tool_calls: parallel,
            extra,
        },
        previous_response_id,
        stream: flag(body, "stream", false)?,
        store: flag(body, "store", true)?,
        echo,
    })
}

/// Text of a message's `content`: a string, or a list of text parts.
fn content_text(content: &Value, param: &str) -> Result<String, ApiError> {
    match content {
        Value::String(s) => Ok(s.clone()),
        Value::Array(parts) => {
            let mut text = String::new();
            for part in parts {
                let kind = part.get("type").and_then(Value::as_str).unwrap_or("");
                match kind {
                    "input_text" | "output_text" | "text" | "summary_text" | "reasoning_text" => {
                        text.push_str(part.get("text").and_then(Value::as_str).unwrap_or(""))
                    }
                    "refusal" => {
                        text.push_str(part.get("refusal").and_then(Value::as_str).unwrap_or(""))
                    }
                    other => {
                        return Err(invalid(
                            format!("content of type `{other}` is not supported (text only)"),
                            param,
                        ))
                    }
                }
            }
            Ok(text)
        }
        _ => Err(invalid(
            "`content` must be a string or a list of parts",
            param,
        )),
    }
}

fn input_items(items: &[Value]) -> Result<Vec<Message>, ApiError> {
    let mut messages: Vec<Message> = Vec::new();
    for (i, item) in items.iter().enumerate() {
        let param = format!("input[{i}]");
        let kind = item
            .get("type")
            .and_then(Value::as_str)
            .unwrap_or("message");
        match kind {
            "message" => {
                let role = item.get("role").and_then(Value::as_str).unwrap_or("");
                let content = item
                    .get("content")
                    .ok_or_else(|| invalid("a message needs `content`", &param))?;
                let text = content_text(content, &param)?;
                messages.push(match role {
                    "user" => Message::User { content: text },
                    "system" | "developer" => Message::System { content: text },
                    "assistant" => Message::Assistant {
                        content: text,
                        reasoning: String::new(),
                        tool_calls: Vec::new(),
                    },
                    other => {
                        return Err(invalid(
                            format!("unknown role `{other}` (user, assistant, system, developer)"),
                            &param,
                        ))
                    }
                });
            }
            "function_call" => {
                let field = |key: &str| {
                    item.get(key)
                        .and_then(Value::as_str)
                        .map(str::to_owned)
                        .ok_or_else(|| invalid(format!("a function_call needs `{key}`"), &param))
                };
                let call = ToolCall {
                    id: field("call_id")?,
                    name: field("name")?,
                    arguments: field("arguments")?,
                };
                // Calls of one turn join the assistant message before them.
                match messages.last_mut() {
                    Some(Message::Assistant { tool_calls, .. }) => tool_calls.push(call),
                    _ => messages.push(Message::Assistant {
                        content: String::new(),
                        reasoning: String::new(),
                        tool_calls: vec![call],
                    }),
                }
            }
            "function_call_output" => {
                let call_id = item
                    .get("call_id")
                    .and_then(Value::as_str)
                    .ok_or_else(|| invalid("a function_call_output needs `call_id`", &param))?;
                let output = item
                    .get("output")
                    .ok_or_else(|| invalid("a function_call_output needs `output`", &param))?;
                messages.push(Message::Tool {
                    call_id: call_id.to_string(),
                    content: content_text(output, &param)?,
                });
            }
            "reasoning" => {
                let text = match item.get("content") {
                    Some(c) => content_text(c, &param)?,
                    None => String::new(),
                };
                if !text.is_empty() {
                    messages.push(Message::Assistant {
                        content: String::new(),
                        reasoning: text,
                        tool_calls: Vec::new(),
                    });
                }
            }
            other => {
                return Err(invalid(
                    format!(
                        "input items of type `{other}` are not supported (message, \
                         function_call, function_call_output, reasoning)"
                    ),
                    &param,
                ))
            }
        }
    }
    Ok(messages)
}

/// The request's function tools, as chat-completions specs and as echoed.
fn tools(value: Option<&Value>) -> Result<(Vec<Value>, Value), ApiError> {
    let Some(value) = value.filter(|v| !v.is_null()) else {
        return Ok((Vec::new(), json!([])));
    };
    let list = value
        .as_array()
        .ok_or_else(|| invalid("`tools` must be a list", "tools"))?;
    let mut specs = Vec::new();
    for (i, tool) in list.iter().enumerate() {
        let param = format!("tools[{i}]");
        let kind = tool.get("type").and_then(Value::as_str).unwrap_or("");
        if kind != "function" {
            return Err(invalid(
                format!(
                    "tools of type `{kind}` are not supported: send function tools, or \
                     configure the server's own tools (--tools)"
                ),
                &param,
            ));
        }
        let name = tool
            .get("name")
            .and_then(Value::as_str)
            .filter(|n| crate::tools::valid_tool_name(n))
            .ok_or_else(|| invalid("a function tool needs a valid `name`", &param))?;
        let parameters = tool
            .get("parameters")
            .cloned()
            .filter(|p| !p.is_null())
            .unwrap_or(json!({"type": "object", "properties": {}}));
        specs.push(json!({
            "type": "function",
            "function": {
                "name": name,
                "description": tool.get("description").cloned().unwrap_or(json!("")),
                "parameters": parameters,
            }
        }));
    }
    Ok((specs, value.clone()))
}

/// `tool_choice` in chat-completions form, and as echoed.
fn tool_choice(value: Option<&Value>) -> Result<(Option<Value>, Value), ApiError> {
    match value {
        None | Some(Value::Null) => Ok((None, json!("auto"))),
        Some(Value::String(s)) if matches!(s.as_str(), "auto" | "none" | "required") => {
            Ok((Some(json!(s)), json!(s)))
        }
        Some(v @ Value::Object(obj)) => {
            let name = obj
                .get("name")
                .or_else(|| obj.get("function").and_then(|f| f.get("name")))
                .and_then(Value::as_str)
                .filter(|_| obj.get("type").and_then(Value::as_str) == Some("function"))
                .ok_or_else(|| {
                    invalid(
                        "`tool_choice` must be auto, none, required or {\"type\": \"function\", \
                         \"name\": ...}",
                        "tool_choice",
                    )
                })?;
            Ok((
                Some(json!({"type": "function", "function": {"name": name}})),
                v.clone(),
            ))
        }
        Some(_) => Err(invalid(
            "`tool_choice` must be auto, none, required or a function",
            "tool_choice",
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn input_items_become_messages() {
        let body = json!({
            "model": "m",
            "instructions": "be brief",
            "input": [
                {"role": "user", "content": [{"type": "input_text", "text": "hi"}]},
                {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c1", "output": "42"},
                {"type": "message", "role": "developer", "content": "d"}
            ],
            "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}],
            "tool_choice": {"type": "function", "name": "f"},
            "max_steps": 3,
            "seed": 7
        });
        let p = parse(&body, "m").unwrap();
        assert_eq!(p.run.messages.len(), 4);
        assert!(
            matches!(&p.run.messages[1], Message::Assistant { tool_calls, .. } if tool_calls[0].id == "c1")
        );
        assert_eq!(p.run.client_tools[0]["function"]["name"], "f");
        assert_eq!(p.run.tool_choice.unwrap()["function"]["name"], "f");
        assert_eq!(p.run.max_steps, Some(3));
        assert_eq!(p.run.extra["seed"], 7);
        assert_eq!(p.run.instructions.as_deref(), Some("be brief"));
    }

    #[test]
    fn bad_requests_name_the_field() {
        let cases = [
            (json!({"input": "x", "model": "other"}), "model"),
            (json!({"input": 5}), "input"),
            (json!({}), "input"),
            (
                json!({"input": "x", "tools": [{"type": "web_search"}]}),
                "tools[0]",
            ),
            (
                json!({"input": "x", "tool_choice": "sometimes"}),
                "tool_choice",
            ),
            (
                json!({"input": "x", "max_output_tokens": 0}),
                "max_output_tokens",
            ),
            (
                json!({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}),
                "input[0]",
            ),
            (json!({"input": "x", "background": true}), "background"),
            (
                json!({"input": "x", "text": {"format": {"type": "json_schema"}}}),
                "text.format",
            ),
        ];
        for (body, param) in cases {
            let err = parse(&body, "m").unwrap_err();
            assert_eq!(err.param.as_deref(), Some(param), "{body}: {}", err.message);
        }
    }
}
