//! Chat messages → prompt ids in the server's [`ChatFormat`], and the thinking options of
//! Kimi K3's XTML.
//!
//! XTML requests read `chat_template_kwargs: {"thinking": bool, "thinking_effort":
//! "low"|"high"|"max"}` (`enable_thinking` is an alias of `thinking`) and the top-level
//! `reasoning_effort` (`"none"` turns thinking off; `low`/`high`/`max` set the effort unless
//! `thinking_effort` does). Thinking is on, at `max`, by default.

use kimi_tokenizer::xtml::{
    render_xtml, ThinkingEffort, XtmlError, XtmlOptions, XtmlResponseFormat, XtmlToolChoice,
};
use serde_json::Value;

use crate::chat_request::{ResponseFormat, ToolChoice, ToolSpec};
use crate::error::ApiError;
use crate::fields::{bad_value, wrong_type, Body};
use crate::state::{ChatFormat, Inner};
use crate::tool_format::{adapt_messages, ToolFormat};
use crate::xtml_output::XtmlStart;

/// Thinking mode for an XTML prompt.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Thinking {
    pub enabled: bool,
    pub effort: ThinkingEffort,
}

impl Default for Thinking {
    fn default() -> Self {
        Thinking {
            enabled: true,
            effort: ThinkingEffort::Max,
        }
    }
}

/// What a chat request asks the prompt to say.
pub(crate) struct PromptRequest<'a> {
    pub messages: &'a [Value],
    pub tools: &'a [ToolSpec],
    pub tool_choice: &'a ToolChoice,
    pub response_format: &'a ResponseFormat,
    pub add_generation_prompt: bool,
    pub thinking: Thinking,
}

impl PromptRequest<'_> {
    /// Where an XTML prompt leaves the model.
    pub(crate) fn xtml_start(&self) -> XtmlStart {
        match (self.add_generation_prompt, self.thinking.enabled) {
            (false, _) => XtmlStart::Message,
            (true, true) => XtmlStart::Think,
            (true, false) => XtmlStart::Response,
        }
    }
}

const EFFORTS: &str = "\"low\", \"high\" or \"max\"";

/// The thinking options of a request (see the module docs).
pub(crate) fn parse_thinking(body: &Body) -> Result<Thinking, ApiError> {
    let mut thinking = Thinking::default();
    let (mut thinking_set, mut effort_set) = (false, false);
    if let Some(kwargs) = body.object("chat_template_kwargs")? {
        for key in ["thinking", "enable_thinking"] {
            match kwargs.get(key) {
                None | Some(Value::Null) => {}
                Some(Value::Bool(on)) => {
                    thinking.enabled = *on;
                    thinking_set = true;
                }
                Some(other) => {
                    return Err(wrong_type(
                        &format!("chat_template_kwargs.{key}"),
                        "a boolean",
                        other,
                    ))
                }
            }
        }
        match kwargs.get("thinking_effort") {
            None | Some(Value::Null) => {}
            Some(Value::String(name)) => {
                thinking.effort = ThinkingEffort::parse(name).ok_or_else(|| {
                    bad_value(
                        "chat_template_kwargs.thinking_effort",
                        format!("must be {EFFORTS}, got {name:?}"),
                    )
                })?;
                effort_set = true;
            }
            Some(other) => {
                return Err(wrong_type(
                    "chat_template_kwargs.thinking_effort",
                    "a string",
                    other,
                ))
            }
        }
    }
    match body.str("reasoning_effort")? {
        None => {}
        // An explicit `thinking` wins over the effort field.
        Some("none") if !thinking_set => thinking.enabled = false,
        Some("none") => {}
        Some(name) => match ThinkingEffort::parse(name) {
            Some(effort) if !effort_set => thinking.effort = effort,
            Some(_) => {}
            None => {
                return Err(bad_value(
                    "reasoning_effort",
                    format!("must be \"none\", {EFFORTS} for this model, got {name:?}"),
                ))
            }
        },
    }
    Ok(thinking)
}

/// Renders the conversation in the server's chat format and tokenizes it.
pub(crate) fn render_prompt(
    inner: &Inner,
    request: &PromptRequest<'_>,
) -> Result<Vec<u32>, ApiError> {
    let raw_tools: Vec<Value> = request.tools.iter().map(|t| t.raw.clone()).collect();
    match inner.chat_format {
        ChatFormat::Xtml(_) => {
            let options = XtmlOptions {
                tools: &raw_tools,
                thinking: request.thinking.enabled,
                thinking_effort: request.thinking.effort,
                add_generation_prompt: request.add_generation_prompt,
                tool_choice: match request.tool_choice {
                    ToolChoice::Required => XtmlToolChoice::Required,
                    ToolChoice::None => XtmlToolChoice::None,
                    ToolChoice::Auto | ToolChoice::Named(_) => XtmlToolChoice::Auto,
                },
                response_format: match request.response_format {
                    ResponseFormat::Text => XtmlResponseFormat::Text,
                    ResponseFormat::JsonObject => XtmlResponseFormat::JsonObject,
                    ResponseFormat::JsonSchema(schema) => {
                        XtmlResponseFormat::JsonSchema(schema.as_ref())
                    }
                },
            };
            let prompt = render_xtml(request.messages, &options).map_err(xtml_error)?;
            inner.encode_xtml_prompt(&prompt, "messages")
        }
        ChatFormat::Template => {
            let template = inner
                .chat_template()
                .ok_or_else(|| ApiError::internal("the chat template went missing".to_string()))?;
            let tools_arg = (!raw_tools.is_empty()).then_some(raw_tools.as_slice());
            let adapted;
            let messages = match &inner.tool_format {
                Some(ToolFormat::Json(format)) => {
                    adapted = adapt_messages(
                        format,
                        request.messages,
                        request.tools,
                        request.tool_choice,
                    );
                    adapted.as_slice()
                }
                _ => request.messages,
            };
            let text = template
                .render(messages, tools_arg, request.add_generation_prompt)
                .map_err(|e| {
                    ApiError::invalid(format!("The chat template failed: {e}"), Some("messages"))
                })?;
            inner.encode_prompt(&text, true, "messages")
        }
        ChatFormat::Unavailable => Err(ApiError::invalid(
            "The model has no chat template; use /v1/completions",
            None,
        )),
    }
}

fn xtml_error(err: XtmlError) -> ApiError {
    ApiError::invalid(err.to_string(), Some("messages"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn thinking(json: &str) -> Result<Thinking, ApiError> {
        parse_thinking(&Body::parse(json.as_bytes()).expect("JSON object"))
    }

    #[test]
    fn thinking_options() {
        let on = |effort| Thinking {
            enabled: true,
            effort,
        };
        assert_eq!(thinking("{}").ok(), Some(on(ThinkingEffort::Max)));
        let off = thinking(r#"{"chat_template_kwargs": {"thinking": false}}"#).ok();
        assert_eq!(off.map(|t| t.enabled), Some(false));
        let off = thinking(r#"{"chat_template_kwargs": {"enable_thinking": false}}"#).ok();
        assert_eq!(off.map(|t| t.enabled), Some(false));
        let off = thinking(r#"{"reasoning_effort": "none"}"#).ok();
        assert_eq!(off.map(|t| t.enabled), Some(false));
        assert_eq!(
            thinking(r#"{"chat_template_kwargs": {"thinking_effort": "low"}, "reasoning_effort": "high"}"#).ok(),
            Some(on(ThinkingEffort::Low))
        );
        assert_eq!(
            thinking(r#"{"reasoning_effort": "high"}"#).ok(),
            Some(on(ThinkingEffort::High))
        );
        for bad in [
            r#"{"chat_template_kwargs": {"thinking_effort": "medium"}}"#,
            r#"{"chat_template_kwargs": {"thinking": "yes"}}"#,
            r#"{"chat_template_kwargs": 3}"#,
            r#"{"reasoning_effort": "medium"}"#,
        ] {
            assert!(thinking(bad).is_err(), "{bad}");
        }
    }
}
