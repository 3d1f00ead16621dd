//! Which tool-call format a template-based model speaks, and how its prompt tells it about
//! tools.
//!
//! `--tool-call-parser auto` (the default) picks, in this order:
//! 1. `kimi` when the tokenizer has Kimi K2's tool-call special tokens;
//! 2. `hermes` when the chat template contains `<tool_call>` (Qwen 2.5/3, Hermes);
//! 3. `mistral` when it contains `[TOOL_CALLS]` (the newer `[TOOL_CALLS]name[ARGS]{...}`
//!    form when it also contains `[ARGS]`);
//! 4. `llama3_json` when it contains `<|python_tag|>`, or `<|start_header_id|>` together
//!    with `tools` (Llama 3.1-3.3);
//! 5. `generic` otherwise: a JSON object `{"tool_calls": [...]}` that the system prompt
//!    describes.
//!
//! A template that never mentions `tools` cannot show them to the model, so the server adds
//! a description of the tools and of the call format to the system prompt (as llama.cpp
//! does for generic templates), writes past calls of the conversation into the assistant's
//! text in that format, and turns `tool` messages into `user` messages holding a
//! `tool_response` object.

use std::fmt;
use std::str::FromStr;

use kimi_tokenizer::Tokenizer;
use serde_json::{json, Value};

use crate::chat_request::{ToolChoice, ToolSpec};
use crate::tool_parser::ToolTokens;

/// `--tool-call-parser`: the tool-call format, or `auto` to detect it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ToolCallParser {
    /// Detect from the tokenizer and the chat template.
    #[default]
    Auto,
    /// Kimi K2's tool-call special tokens.
    Kimi,
    /// `<tool_call>{json}</tool_call>`.
    Hermes,
    /// `{"name": ..., "parameters": ...}`, optionally after `<|python_tag|>`.
    Llama3Json,
    /// `[TOOL_CALLS][{"name": ..., "arguments": ...}]`.
    Mistral,
    /// `{"tool_calls": [{"name": ..., "arguments": ...}]}`.
    Generic,
}

impl ToolCallParser {
    /// Every accepted name.
    pub const NAMES: [&'static str; 6] = [
        "auto",
        "kimi",
        "hermes",
        "llama3_json",
        "mistral",
        "generic",
    ];
}

impl fmt::Display for ToolCallParser {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let i = match self {
            ToolCallParser::Auto => 0,
            ToolCallParser::Kimi => 1,
            ToolCallParser::Hermes => 2,
            ToolCallParser::Llama3Json => 3,
            ToolCallParser::Mistral => 4,
            ToolCallParser::Generic => 5,
        };
        f.write_str(Self::NAMES[i])
    }
}

impl FromStr for ToolCallParser {
    type Err = String;

    fn from_str(name: &str) -> Result<Self, Self::Err> {
        Ok(match name {
            "auto" => ToolCallParser::Auto,
            "kimi" | "kimi_k2" => ToolCallParser::Kimi,
            "hermes" | "qwen" => ToolCallParser::Hermes,
            "llama3_json" | "llama3" => ToolCallParser::Llama3Json,
            "mistral" => ToolCallParser::Mistral,
            "generic" => ToolCallParser::Generic,
            other => {
                return Err(format!(
                    "unknown tool-call parser {other:?}; expected one of {}",
                    Self::NAMES.join(", ")
                ))
            }
        })
    }
}

/// The text formats of [`crate::json_tool_parser`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum JsonToolKind {
    Hermes,
    Llama3Json,
    Mistral,
    /// Mistral's newer form (tokenizer v11 and later): `[TOOL_CALLS]name[ARGS]{...}`.
    MistralArgs,
    Generic,
}

impl JsonToolKind {
    pub(crate) fn name(self) -> &'static str {
        match self {
            JsonToolKind::Hermes => "hermes",
            JsonToolKind::Llama3Json => "llama3_json",
            JsonToolKind::Mistral | JsonToolKind::MistralArgs => "mistral",
            JsonToolKind::Generic => "generic",
        }
    }

    /// The key of a call's arguments.
    pub(crate) fn arguments_key(self) -> &'static str {
        match self {
            JsonToolKind::Llama3Json => "parameters",
            _ => "arguments",
        }
    }

    /// The calls as this format writes them (history, examples).
    pub(crate) fn write_calls(self, calls: &[(String, String)]) -> String {
        let key = self.arguments_key();
        let objects: Vec<String> = calls
            .iter()
            .map(|(name, arguments)| {
                let name = serde_json::to_string(name).unwrap_or_default();
                format!("{{\"name\": {name}, \"{key}\": {arguments}}}")
            })
            .collect();
        match self {
            JsonToolKind::Hermes => objects
                .iter()
                .map(|o| format!("<tool_call>\n{o}\n</tool_call>"))
                .collect::<Vec<_>>()
                .join("\n"),
            JsonToolKind::Llama3Json => objects.join("; "),
            JsonToolKind::Mistral => format!("[TOOL_CALLS][{}]", objects.join(", ")),
            JsonToolKind::MistralArgs => calls
                .iter()
                .map(|(name, arguments)| format!("[TOOL_CALLS]{name}[ARGS]{arguments}"))
                .collect(),
            JsonToolKind::Generic => format!("{{\"tool_calls\": [{}]}}", objects.join(", ")),
        }
    }
}

/// A text tool-call format as this server uses it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct JsonToolFormat {
    pub kind: JsonToolKind,
    /// The chat template shows tools to the model itself.
    pub template_renders_tools: bool,
    /// The opening tag as one special token (`[TOOL_CALLS]` in Mistral tokenizers), which a
    /// grammar must name by id: plain text cannot produce a special token.
    pub tag_token: Option<u32>,
    /// `[ARGS]` as one special token (`mistral`'s newer form).
    pub args_token: Option<u32>,
}

/// How tool calls are written, chosen once per server.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum ToolFormat {
    /// Kimi K2's special tokens.
    Kimi(ToolTokens),
    /// One of the text formats.
    Json(JsonToolFormat),
}

impl ToolFormat {
    /// The format for a template-based model (see the module docs); `Err` names what is
    /// missing for an explicit `kimi`.
    pub(crate) fn choose(
        parser: ToolCallParser,
        template: Option<&str>,
        tokenizer: &Tokenizer,
    ) -> Result<ToolFormat, String> {
        let kimi = ToolTokens::find(tokenizer);
        let kind = match parser {
            ToolCallParser::Kimi => {
                return kimi.map(ToolFormat::Kimi).ok_or_else(|| {
                    "--tool-call-parser kimi: the tokenizer has no Kimi tool-call tokens".into()
                })
            }
            ToolCallParser::Auto => match kimi {
                Some(tokens) => return Ok(ToolFormat::Kimi(tokens)),
                None => detect(template.unwrap_or_default()),
            },
            ToolCallParser::Hermes => JsonToolKind::Hermes,
            ToolCallParser::Llama3Json => JsonToolKind::Llama3Json,
            ToolCallParser::Mistral if template.is_some_and(|t| t.contains("[ARGS]")) => {
                JsonToolKind::MistralArgs
            }
            ToolCallParser::Mistral => JsonToolKind::Mistral,
            ToolCallParser::Generic => JsonToolKind::Generic,
        };
        let special = |name: &str| {
            tokenizer
                .token_id(name)
                .filter(|&id| tokenizer.is_special(id))
        };
        let tag_token = match kind {
            JsonToolKind::Hermes => special("<tool_call>"),
            JsonToolKind::Mistral | JsonToolKind::MistralArgs => special("[TOOL_CALLS]"),
            JsonToolKind::Llama3Json | JsonToolKind::Generic => None,
        };
        let args_token = match kind {
            JsonToolKind::MistralArgs => special("[ARGS]"),
            _ => None,
        };
        Ok(ToolFormat::Json(JsonToolFormat {
            kind,
            template_renders_tools: template.is_some_and(|t| t.contains("tools")),
            tag_token,
            args_token,
        }))
    }

    /// Its `--tool-call-parser` name.
    pub(crate) fn name(&self) -> &'static str {
        match self {
            ToolFormat::Kimi(_) => "kimi",
            ToolFormat::Json(format) => format.kind.name(),
        }
    }
}

/// The text format a chat template shows (rules 2-5 of the module docs).
pub(crate) fn detect(template: &str) -> JsonToolKind {
    if template.contains("<tool_call>") {
        JsonToolKind::Hermes
    } else if template.contains("[TOOL_CALLS]") && template.contains("[ARGS]") {
        JsonToolKind::MistralArgs
    } else if template.contains("[TOOL_CALLS]") {
        JsonToolKind::Mistral
    } else if template.contains("<|python_tag|>")
        || (template.contains("<|start_header_id|>") && template.contains("tools"))
    {
        JsonToolKind::Llama3Json
    } else {
        JsonToolKind::Generic
    }
}

/// The messages to render for a template that does not show tools: a system prompt that
/// describes them (unless `tool_choice` is `none`), past calls as text, tool results as
/// user messages. Templates that show tools get the messages unchanged.
pub(crate) fn adapt_messages(
    format: &JsonToolFormat,
    messages: &[Value],
    tools: &[ToolSpec],
    tool_choice: &ToolChoice,
) -> Vec<Value> {
    if format.template_renders_tools {
        return messages.to_vec();
    }
    let mut out: Vec<Value> = messages
        .iter()
        .map(|m| adapt_message(format.kind, m))
        .collect();
    if tools.is_empty() || *tool_choice == ToolChoice::None {
        return out;
    }
    let prompt = tools_prompt(format.kind, tools, tool_choice);
    match out.first_mut() {
        Some(first) if first["role"] == "system" => {
            let text = first["content"].as_str().unwrap_or_default();
            first["content"] = json!(format!("{text}\n\n{prompt}").trim_start());
        }
        _ => out.insert(0, json!({"role": "system", "content": prompt})),
    }
    out
}

fn adapt_message(kind: JsonToolKind, message: &Value) -> Value {
    let mut message = message.clone();
    let content = message["content"].as_str().unwrap_or_default().to_string();
    match message["role"].as_str() {
        Some("assistant") => {
            let calls: Vec<(String, String)> = message["tool_calls"]
                .as_array()
                .map(|calls| {
                    calls
                        .iter()
                        .map(|c| {
                            let f = &c["function"];
                            let name = f["name"].as_str().unwrap_or_default().to_string();
                            let arguments = f["arguments"].as_str().unwrap_or("{}");
                            // Arguments are JSON text; anything else is written as a string.
                            let arguments = match serde_json::from_str::<Value>(arguments) {
                                Ok(value) => value.to_string(),
                                Err(_) => json!(arguments).to_string(),
                            };
                            (name, arguments)
                        })
                        .collect()
                })
                .unwrap_or_default();
            let text = match (content.is_empty(), calls.is_empty()) {
                (_, true) => content,
                (true, false) => kind.write_calls(&calls),
                (false, false) => format!("{content}\n{}", kind.write_calls(&calls)),
            };
            if let Some(m) = message.as_object_mut() {
                m.remove("tool_calls");
            }
            message["content"] = json!(text);
        }
        Some("tool") => {
            let mut response = json!({"content": content});
            if let Some(id) = message.get("tool_call_id").filter(|id| id.is_string()) {
                response["tool_call_id"] = id.clone();
            }
            message = json!({"role": "user",
                             "content": json!({"tool_response": response}).to_string()});
        }
        _ => message["content"] = json!(content),
    }
    message
}

/// The system prompt's description of the tools and of how to call them.
fn tools_prompt(kind: JsonToolKind, tools: &[ToolSpec], tool_choice: &ToolChoice) -> String {
    let listed: Vec<Value> = tools
        .iter()
        .map(|t| {
            let f = &t.raw["function"];
            let mut tool = json!({"name": t.name, "parameters": t.parameters});
            if let Some(d) = f["description"].as_str() {
                tool["description"] = json!(d);
            }
            tool
        })
        .collect();
    let listed = serde_json::to_string_pretty(&listed).unwrap_or_default();
    let example = kind.write_calls(&[("function_name".into(), "{\"argument\": \"value\"}".into())]);
    let when = match tool_choice {
        ToolChoice::Required => "You must call at least one of these functions.".to_string(),
        ToolChoice::Named(name) => format!("You must call the function `{name}`."),
        ToolChoice::Auto | ToolChoice::None => {
            "Call a function when it helps to answer; otherwise answer normally.".into()
        }
    };
    format!(
        "You can call the following functions, described as JSON schemas:\n{listed}\n\n\
         {when} To call functions, reply with only this, and nothing else:\n{example}\n\
         with the arguments as a JSON object that matches the function's parameters."
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn detects_the_format_from_the_template() {
        let qwen = "{%- if tools %}<tools>{{ tool | tojson }}</tools> <tool_call>\n";
        assert_eq!(detect(qwen), JsonToolKind::Hermes);
        assert_eq!(detect("{{ '[TOOL_CALLS]' }}"), JsonToolKind::Mistral);
        assert_eq!(
            detect("{{ '[TOOL_CALLS]' + name + '[ARGS]' }}"),
            JsonToolKind::MistralArgs
        );
        let llama = "<|start_header_id|>ipython<|end_header_id|>{% if tools %}";
        assert_eq!(detect(llama), JsonToolKind::Llama3Json);
        assert_eq!(detect("{{ '<|python_tag|>' }}"), JsonToolKind::Llama3Json);
        let smol = "{% for message in messages %}<|im_start|>{{ message['content'] }}";
        assert_eq!(detect(smol), JsonToolKind::Generic);
        assert_eq!(
            "llama3_json".parse::<ToolCallParser>(),
            Ok(ToolCallParser::Llama3Json)
        );
        assert!("pythonic".parse::<ToolCallParser>().is_err());
    }

    #[test]
    fn the_flag_overrides_detection() {
        let dir =
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../assets/demo-tokenizer");
        let tok = Tokenizer::from_dir(&dir).expect("demo tokenizer");
        let hermes_template = Some("{% if tools %}<tool_call>{% endif %}");
        // The demo tokenizer has Kimi's tool tokens: `auto` keeps them.
        let auto = ToolFormat::choose(ToolCallParser::Auto, hermes_template, &tok);
        assert_eq!(auto.as_ref().map(ToolFormat::name), Ok("kimi"));
        let forced = ToolFormat::choose(ToolCallParser::Mistral, Some("plain"), &tok);
        assert_eq!(
            forced,
            Ok(ToolFormat::Json(JsonToolFormat {
                kind: JsonToolKind::Mistral,
                template_renders_tools: false,
                tag_token: None,
                args_token: None,
            }))
        );
        let hermes = ToolFormat::choose(ToolCallParser::Hermes, hermes_template, &tok);
        assert!(matches!(hermes, Ok(ToolFormat::Json(f)) if f.template_renders_tools));
        assert_eq!(ToolCallParser::Llama3Json.to_string(), "llama3_json");
    }

    #[test]
    fn writes_calls_in_each_format() {
        let calls = [("f".to_string(), "{\"a\": 1}".to_string())];
        assert_eq!(
            JsonToolKind::Hermes.write_calls(&calls),
            "<tool_call>\n{\"name\": \"f\", \"arguments\": {\"a\": 1}}\n</tool_call>"
        );
        assert_eq!(
            JsonToolKind::Llama3Json.write_calls(&calls),
            "{\"name\": \"f\", \"parameters\": {\"a\": 1}}"
        );
        assert_eq!(
            JsonToolKind::Mistral.write_calls(&calls),
            "[TOOL_CALLS][{\"name\": \"f\", \"arguments\": {\"a\": 1}}]"
        );
        assert_eq!(
            JsonToolKind::MistralArgs.write_calls(&calls),
            "[TOOL_CALLS]f[ARGS]{\"a\": 1}"
        );
        assert_eq!(
            JsonToolKind::Generic.write_calls(&calls),
            "{\"tool_calls\": [{\"name\": \"f\", \"arguments\": {\"a\": 1}}]}"
        );
    }

    #[test]
    fn a_template_without_tools_gets_them_in_the_system_prompt() {
        let format = JsonToolFormat {
            kind: JsonToolKind::Generic,
            template_renders_tools: false,
            tag_token: None,
            args_token: None,
        };
        let tools = [ToolSpec {
            name: "get_weather".into(),
            parameters: json!({"type": "object"}),
            raw: json!({"type": "function", "function": {"name": "get_weather",
                        "description": "Weather in a city"}}),
        }];
        let messages = [
            json!({"role": "user", "content": "Weather?"}),
            json!({"role": "assistant", "content": null, "tool_calls": [{"id": "c1",
                "type": "function", "function": {"name": "get_weather",
                "arguments": "{\"city\":\"Paris\"}"}}]}),
            json!({"role": "tool", "tool_call_id": "c1", "content": "sunny"}),
        ];
        let out = adapt_messages(&format, &messages, &tools, &ToolChoice::Required);
        assert_eq!(out.len(), 4);
        assert_eq!(out[0]["role"], "system");
        let system = out[0]["content"].as_str().unwrap_or_default();
        assert!(system.contains("Weather in a city") && system.contains("must call"));
        assert!(system.contains("{\"tool_calls\": [{\"name\": \"function_name\""));
        assert_eq!(
            out[2]["content"],
            "{\"tool_calls\": [{\"name\": \"get_weather\", \"arguments\": {\"city\":\"Paris\"}}]}"
        );
        assert!(out[2].get("tool_calls").is_none());
        assert_eq!(out[3]["role"], "user");
        assert_eq!(
            out[3]["content"],
            "{\"tool_response\":{\"content\":\"sunny\",\"tool_call_id\":\"c1\"}}"
        );
        let shown = JsonToolFormat {
            template_renders_tools: true,
            ..format
        };
        assert_eq!(
            adapt_messages(&shown, &messages, &tools, &ToolChoice::Auto),
            messages.to_vec()
        );
    }
}
