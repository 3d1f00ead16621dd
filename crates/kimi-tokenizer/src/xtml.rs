//! Kimi K3's chat format, "XTML" (K3 ships no Jinja template; Moonshot renders it in Python,
//! `encoding_k3.py`). Elements are `<|open|>TAG attrs<|sep|>BODY<|close|>TAG<|sep|>` and every
//! top-level message ends with `<|end_of_msg|>`:
//!
//! ```text
//! <|open|>message role="system" type="tool-declare"<|sep|># Tools …<|close|>message<|sep|><|end_of_msg|>
//! <|open|>message role="system" type="thinking-effort"<|sep|>…<|close|>message<|sep|><|end_of_msg|>
//! <|open|>message role="user"<|sep|>Hi<|close|>message<|sep|><|end_of_msg|>
//! <|open|>message role="assistant"<|sep|><|open|>think<|sep|>…<|close|>think<|sep|>
//!   <|open|>response<|sep|>…<|close|>response<|sep|>
//!   <|open|>tools<|sep|><|open|>call tool="f" index="1"<|sep|>
//!     <|open|>argument key="k" type="string"<|sep|>v<|close|>argument<|sep|>
//!   <|close|>call<|sep|><|close|>tools<|sep|>
//! <|close|>message<|sep|><|end_of_msg|>
//! <|open|>message role="tool" tool="f" index="1"<|sep|>result<|close|>message<|sep|><|end_of_msg|>
//! <|open|>message role="assistant"<|sep|><|open|>think<|sep|>          ← generation prompt
//! ```
//!
//! Choices where public sources disagree (Kimi K3 spec §5, §7 item 9):
//! * Attribute values escape `&` → `&amp;` and `"` → `&quot;`, as the reference encoder and
//!   sglang's parser do (not `\"`).
//! * Tool results are `role="tool" tool="NAME" index="N"`: every public port of
//!   `encoding_k3.py` and the reference's own renders write `tool=`/`index=`, not `name=`.
//! * Past reasoning is kept: in thinking mode every assistant turn carries a `think` element
//!   holding the `reasoning_content` the client sent back (empty when none), as the
//!   reference does; a client that wants it dropped simply does not send it. With thinking
//!   off no `think` element is written.
//! * No `[BOS]` is prepended (not stated by any source; the K2 templates emit none either).
//!
//! The prompt is a list of [`Segment`]s: structural markers are encoded as control tokens and
//! all message text as plain BPE ([`crate::Tokenizer::encode_xtml`]), so text that spells
//! `<|open|>` cannot inject structure, as with the reference's `EncodeSegment`s.

use serde_json::Value;

use crate::chat_template::json_to_value;
use crate::pyjson::{dumps, DumpOptions};

/// Opens an element.
pub const OPEN: &str = "<|open|>";
/// Closes an element.
pub const CLOSE: &str = "<|close|>";
/// Ends an element's header (after `<|open|>TAG attrs` or `<|close|>TAG`).
pub const SEP: &str = "<|sep|>";
/// Ends a top-level message; generation stops here.
pub const END_OF_MSG: &str = "<|end_of_msg|>";

/// How long the model should think (`thinking_effort`; K3 accepts these three).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ThinkingEffort {
    /// `low`.
    Low,
    /// `high`.
    High,
    /// `max`, the default (K3's `tokenization_kimi.py` sets it when absent).
    #[default]
    Max,
}

impl ThinkingEffort {
    /// `"low"`, `"high"` or `"max"`.
    pub fn parse(name: &str) -> Option<Self> {
        match name {
            "low" => Some(Self::Low),
            "high" => Some(Self::High),
            "max" => Some(Self::Max),
            _ => None,
        }
    }

    /// The name the prompt states.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Low => "low",
            Self::High => "high",
            Self::Max => "max",
        }
    }
}

/// `tool_choice` as the prompt states it (a named function adds no directive).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum XtmlToolChoice {
    /// No directive.
    #[default]
    Auto,
    /// "You MUST call tools in the next message."
    Required,
    /// "You MUST NOT call any tools in the next message."
    None,
}

/// `response_format` as the prompt states it.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub enum XtmlResponseFormat<'a> {
    /// No directive.
    #[default]
    Text,
    /// Raw JSON.
    JsonObject,
    /// Raw JSON matching the schema (`None`: written as `null`, as the reference does).
    JsonSchema(Option<&'a Value>),
}

/// What to render besides the messages.
#[derive(Clone, Copy, Debug)]
pub struct XtmlOptions<'a> {
    /// OpenAI tool objects, declared in a `tool-declare` system message when not empty.
    pub tools: &'a [Value],
    /// Thinking mode (the default): the effort message, `think` elements, and a generation
    /// prompt that opens `think`; off, it opens `response`.
    pub thinking: bool,
    /// Stated in the `thinking-effort` message (thinking mode only).
    pub thinking_effort: ThinkingEffort,
    /// End with the assistant's opening (the generation prompt).
    pub add_generation_prompt: bool,
    /// A `tool-choice` directive after the conversation (only with tools).
    pub tool_choice: XtmlToolChoice,
    /// A `response-format` directive after the conversation.
    pub response_format: XtmlResponseFormat<'a>,
}

impl Default for XtmlOptions<'_> {
    fn default() -> Self {
        XtmlOptions {
            tools: &[],
            thinking: true,
            thinking_effort: ThinkingEffort::Max,
            add_generation_prompt: true,
            tool_choice: XtmlToolChoice::Auto,
            response_format: XtmlResponseFormat::Text,
        }
    }
}

/// Why a conversation cannot be rendered.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum XtmlError {
    /// An image (or other media) content part: the text engine has no vision tower yet.
    #[error("messages[{message}]: images are not supported yet (content part of type {kind:?})")]
    Image {
        /// The message's index.
        message: usize,
        /// The part's `type`.
        kind: String,
    },
    /// Content that is neither a string nor a list of text parts.
    #[error("messages[{message}].content: {reason}")]
    Content {
        /// The message's index.
        message: usize,
        /// What is wrong.
        reason: String,
    },
    /// A role XTML has no form for.
    #[error("messages[{message}]: unknown role {role:?}")]
    Role {
        /// The message's index.
        message: usize,
        /// The role given.
        role: String,
    },
    /// A tool call without a function name.
    #[error("messages[{message}].tool_calls[{call}]: the call has no function name")]
    CallName {
        /// The message's index.
        message: usize,
        /// The call's index.
        call: usize,
    },
    /// A tool result whose tool cannot be named.
    #[error(
        "messages[{message}]: a tool message needs a `tool_call_id` of the preceding assistant \
         message's tool_calls, or a `name`"
    )]
    ToolName {
        /// The message's index.
        message: usize,
    },
}

/// One piece of a prompt: a control marker, or plain text.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Segment {
    /// The text.
    pub text: String,
    /// A structural marker, to be encoded as its control token.
    pub control: bool,
}

/// A rendered prompt.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct XtmlPrompt {
    segments: Vec<Segment>,
}

impl XtmlPrompt {
    /// The pieces in order; each is encoded on its own, as the reference encodes its
    /// segments (this decides where BPE merges stop).
    pub fn segments(&self) -> &[Segment] {
        &self.segments
    }

    /// The whole prompt as text.
    pub fn text(&self) -> String {
        self.segments.iter().map(|s| s.text.as_str()).collect()
    }

    fn control(&mut self, marker: &str) {
        self.segments.push(Segment {
            text: marker.to_owned(),
            control: true,
        });
    }

    fn plain(&mut self, text: &str) {
        if !text.is_empty() {
            self.segments.push(Segment {
                text: text.to_owned(),
                control: false,
            });
        }
    }

    fn open(&mut self, tag: &str, attrs: &[(&str, &str)]) {
        self.control(OPEN);
        self.plain(tag);
        for (key, value) in attrs {
            self.plain(&format!(" {key}"));
            self.plain("=\"");
            self.plain(&escape_attr(value));
            self.plain("\"");
        }
        self.control(SEP);
    }

    fn close(&mut self, tag: &str) {
        self.control(CLOSE);
        self.plain(tag);
        self.control(SEP);
    }

    /// `<|close|>message<|sep|><|end_of_msg|>`.
    fn end_message(&mut self) {
        self.close("message");
        self.control(END_OF_MSG);
    }

    fn system_message(&mut self, kind: &str, body: &str) {
        self.open("message", &[("role", "system"), ("type", kind)]);
        self.plain(body.trim());
        self.end_message();
    }
}

/// `&` → `&amp;`, `"` → `&quot;` (attribute values are quoted).
pub fn escape_attr(value: &str) -> String {
    value.replace('&', "&amp;").replace('"', "&quot;")
}

/// The inverse of [`escape_attr`]: `&quot;` first, so an escaped `&amp;quot;` stays `&quot;`.
pub fn unescape_attr(value: &str) -> String {
    value.replace("&quot;", "\"").replace("&amp;", "&")
}

/// Renders OpenAI chat `messages` (system/developer, user, assistant with `content`,
/// `reasoning_content` and `tool_calls`, tool with `tool_call_id`/`name`) in XTML.
pub fn render_xtml(messages: &[Value], options: &XtmlOptions<'_>) -> Result<XtmlPrompt, XtmlError> {
    let mut p = XtmlPrompt::default();
    if !options.tools.is_empty() {
        let tools = json_dumps(&deep_sort(&Value::Array(options.tools.to_vec())), true);
        let body = format!(
            "# Tools\nHere are the available tools, described in JSONSchema.\n\n```json\n{tools}\n```"
        );
        p.system_message("tool-declare", &body);
    }
    if options.thinking {
        let body = format!(
            "`thinking_effort` guides on how much to think in your thinking channel (not \
             including the response channel), supported values include `low`, `medium`, \
             `high`, and `max`.\nNow the system is invoked with `thinking_effort={}`.",
            options.thinking_effort.as_str()
        );
        p.system_message("thinking-effort", &body);
    }
    let mut i = 0;
    // The latest assistant tool calls, for naming and ordering the results that follow.
    let mut calls: &[Value] = &[];
    while i < messages.len() {
        let message = &messages[i];
        let role = message.get("role").and_then(Value::as_str).unwrap_or("");
        match role {
            "system" | "developer" | "user" => {
                let role = if role == "user" { "user" } else { "system" };
                open_message(&mut p, role, message);
                content(&mut p, i, message.get("content"))?;
                p.end_message();
            }
            "assistant" => {
                calls = message
                    .get("tool_calls")
                    .and_then(Value::as_array)
                    .map_or(&[], Vec::as_slice);
                assistant(&mut p, i, message, options.thinking)?;
            }
            "tool" => {
                let run_end = messages[i..]
                    .iter()
                    .position(|m| m.get("role").and_then(Value::as_str) != Some("tool"))
                    .map_or(messages.len(), |n| i + n);
                tool_results(&mut p, i, &messages[i..run_end], calls)?;
                i = run_end;
                continue;
            }
            other => {
                return Err(XtmlError::Role {
                    message: i,
                    role: other.to_owned(),
                })
            }
        }
        i += 1;
    }
    if !options.tools.is_empty() {
        match options.tool_choice {
            XtmlToolChoice::Required => p.system_message(
                "tool-choice",
                "The system is invoked with `tool_choice=required`.\n\
                 You MUST call tools in the next message.",
            ),
            XtmlToolChoice::None => p.system_message(
                "tool-choice",
                "The system is invoked with `tool_choice=none`.\n\
                 You MUST NOT call any tools in the next message.",
            ),
            XtmlToolChoice::Auto => {}
        }
    }
    const RAW_JSON: &str = "Your response must be raw JSON data without markdown code blocks \
                            (```json) or any additional formatting.";
    match options.response_format {
        XtmlResponseFormat::Text => {}
        XtmlResponseFormat::JsonObject => p.system_message(
            "response-format",
            &format!("The system is invoked with `response_format=json_object`.\n{RAW_JSON}"),
        ),
        XtmlResponseFormat::JsonSchema(schema) => {
            let schema = schema.map_or_else(|| "null".into(), |s| json_dumps(&deep_sort(s), true));
            p.system_message(
                "response-format",
                &format!(
                    "The system is invoked with `response_format=json_schema`.\n{RAW_JSON}\n\
                     The JSON data must match the following schema:\n```json\n{schema}\n```"
                ),
            );
        }
    }
    if options.add_generation_prompt {
        p.open("message", &[("role", "assistant")]);
        p.open(
            if options.thinking {
                "think"
            } else {
                "response"
            },
            &[],
        );
    }
    Ok(p)
}

/// `<|open|>message role="ROLE" [name="NAME"]<|sep|>`.
fn open_message(p: &mut XtmlPrompt, role: &str, message: &Value) {
    match message.get("name").and_then(Value::as_str) {
        Some(name) if !name.is_empty() => p.open("message", &[("role", role), ("name", name)]),
        _ => p.open("message", &[("role", role)]),
    }
}

/// A string, or a list of text parts (each its own segment); media is refused.
fn content(p: &mut XtmlPrompt, message: usize, content: Option<&Value>) -> Result<(), XtmlError> {
    match content {
        None | Some(Value::Null) => Ok(()),
        Some(Value::String(text)) => {
            p.plain(text);
            Ok(())
        }
        Some(Value::Array(parts)) => {
            for part in parts {
                match part {
                    Value::String(text) => p.plain(text),
                    Value::Object(o) => match o.get("type").and_then(Value::as_str) {
                        None | Some("text") => match o.get("text").and_then(Value::as_str) {
                            Some(text) => p.plain(text),
                            None => {
                                return Err(XtmlError::Content {
                                    message,
                                    reason: "a text part has no string `text`".into(),
                                })
                            }
                        },
                        Some(kind) => {
                            return Err(XtmlError::Image {
                                message,
                                kind: kind.to_owned(),
                            })
                        }
                    },
                    _ => {
                        return Err(XtmlError::Content {
                            message,
                            reason: "content parts must be objects or strings".into(),
                        })
                    }
                }
            }
            Ok(())
        }
        Some(_) => Err(XtmlError::Content {
            message,
            reason: "must be a string or a list of content parts".into(),
        }),
    }
}

fn assistant(
    p: &mut XtmlPrompt,
    index: usize,
    message: &Value,
    thinking: bool,
) -> Result<(), XtmlError> {
    open_message(p, "assistant", message);
    if thinking {
        p.open("think", &[]);
        let reasoning = ["reasoning_content", "reasoning"]
            .iter()
            .find_map(|key| message.get(*key).and_then(Value::as_str))
            .unwrap_or("");
        if !reasoning.trim().is_empty() {
            p.plain(reasoning);
        }
        p.close("think");
    }
    p.open("response", &[]);
    content(p, index, message.get("content"))?;
    p.close("response");
    let calls = message
        .get("tool_calls")
        .and_then(Value::as_array)
        .map_or(&[][..], Vec::as_slice);
    if !calls.is_empty() {
        p.open("tools", &[]);
        for (c, call) in calls.iter().enumerate() {
            let function = call.get("function").unwrap_or(call);
            let name = function
                .get("name")
                .and_then(Value::as_str)
                .ok_or(XtmlError::CallName {
                    message: index,
                    call: c,
                })?;
            p.open("call", &[("tool", name), ("index", &(c + 1).to_string())]);
            call_arguments(p, function.get("arguments"));
            p.close("call");
        }
        p.close("tools");
    }
    p.end_message();
    Ok(())
}

/// An object's entries as typed `argument` elements; anything else (a non-object or
/// unparsable arguments string) as one raw `json type="object"` block.
fn call_arguments(p: &mut XtmlPrompt, arguments: Option<&Value>) {
    let parsed;
    let object = match arguments {
        None | Some(Value::Null) => return,
        Some(Value::Object(map)) => map,
        Some(Value::String(text)) if text.trim().is_empty() => return,
        Some(Value::String(text)) => {
            parsed = serde_json::from_str::<Value>(text);
            match &parsed {
                Ok(Value::Object(map)) => map,
                _ => {
                    p.open("json", &[("type", "object")]);
                    p.plain(text);
                    p.close("json");
                    return;
                }
            }
        }
        Some(other) => {
            p.open("json", &[("type", "object")]);
            p.plain(&json_dumps(other, false));
            p.close("json");
            return;
        }
    };
    for (key, value) in object {
        p.open("argument", &[("key", key), ("type", xtml_type(value))]);
        match value {
            Value::String(text) => p.plain(text),
            other => p.plain(&json_dumps(other, false)),
        }
        p.close("argument");
    }
}

/// The `type` attribute of an argument value.
pub fn xtml_type(value: &Value) -> &'static str {
    match value {
        Value::Null => "null",
        Value::Bool(_) => "boolean",
        Value::Number(_) => "number",
        Value::String(_) => "string",
        Value::Array(_) => "array",
        Value::Object(_) => "object",
    }
}

/// A run of tool results. When every `tool_call_id` names one of `calls`, they are put in
/// call order and named by their call (the reference's rule); otherwise they keep their order
/// and take their `name`, else the call at their position.
fn tool_results(
    p: &mut XtmlPrompt,
    first: usize,
    run: &[Value],
    calls: &[Value],
) -> Result<(), XtmlError> {
    let call_name = |call: &Value| {
        call.get("function")
            .unwrap_or(call)
            .get("name")
            .and_then(Value::as_str)
            .map(str::to_owned)
    };
    let matched: Vec<Option<(usize, Option<String>)>> = run
        .iter()
        .map(|m| {
            let id = m.get("tool_call_id").and_then(Value::as_str)?;
            let position = calls
                .iter()
                .position(|c| c.get("id").and_then(Value::as_str) == Some(id))?;
            Some((position, call_name(&calls[position])))
        })
        .collect();
    let mut order: Vec<usize> = (0..run.len()).collect();
    if matched.iter().all(Option::is_some) {
        order.sort_by_key(|&k| matched[k].as_ref().map(|(position, _)| *position));
    }
    for (n, &k) in order.iter().enumerate() {
        let message = &run[k];
        let name = matched[k]
            .as_ref()
            .and_then(|(_, name)| name.clone())
            .or_else(|| {
                message
                    .get("name")
                    .and_then(Value::as_str)
                    .filter(|s| !s.is_empty())
                    .map(str::to_owned)
            })
            .or_else(|| calls.get(n).and_then(call_name))
            .ok_or(XtmlError::ToolName { message: first + k })?;
        p.open(
            "message",
            &[
                ("role", "tool"),
                ("tool", &name),
                ("index", &(n + 1).to_string()),
            ],
        );
        content(p, first + k, message.get("content"))?;
        p.end_message();
    }
    Ok(())
}

/// Object keys sorted at every level (arrays keep their order).
fn deep_sort(value: &Value) -> Value {
    match value {
        Value::Object(map) => {
            let mut entries: Vec<(&String, &Value)> = map.iter().collect();
            entries.sort_by(|a, b| a.0.cmp(b.0));
            Value::Object(
                entries
                    .into_iter()
                    .map(|(k, v)| (k.clone(), deep_sort(v)))
                    .collect(),
            )
        }
        Value::Array(items) => Value::Array(items.iter().map(deep_sort).collect()),
        other => other.clone(),
    }
}

/// Python's `json.dumps(value, ensure_ascii=False)`: compact `(",", ":")` separators, or
/// Python's default `(", ", ": ")` ones (how the reference writes typed argument values).
fn json_dumps(value: &Value, compact: bool) -> String {
    let mut options = DumpOptions::new(None);
    if compact {
        options.item_separator = ",".into();
        options.key_separator = ":".into();
    }
    // JSON-born values always serialize; serde's form is a safe fallback all the same.
    dumps(&json_to_value(value), &options).unwrap_or_else(|_| value.to_string())
}

#[cfg(test)]
mod tests;
