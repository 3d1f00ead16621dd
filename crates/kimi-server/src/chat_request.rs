//! Reading a `/v1/chat/completions` body: messages, tools, `tool_choice`,
//! `response_format` and logprob fields (sampling fields are in [`crate::params`]).

use serde_json::{json, Map, Value};

use crate::error::ApiError;
use crate::fields::{bad_value, wrong_type, Body};

/// One function the model may call.
#[derive(Clone, Debug)]
pub(crate) struct ToolSpec {
    pub name: String,
    /// JSON schema of the arguments (an empty object schema when not given).
    pub parameters: Value,
    /// The tool as given, for the chat template.
    pub raw: Value,
}

/// `tool_choice`.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum ToolChoice {
    None,
    Auto,
    Required,
    Named(String),
}

/// `response_format`.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum ResponseFormat {
    Text,
    JsonObject,
    /// The schema (`None`: any JSON object).
    JsonSchema(Option<Value>),
}

const ROLES: [&str; 5] = ["system", "developer", "user", "assistant", "tool"];

/// `messages`, checked and normalised for the chat template: text parts joined into a
/// string, `developer` as `system`, an assistant's `reasoning` as `reasoning_content`.
pub(crate) fn parse_messages(body: &Body) -> Result<Vec<Value>, ApiError> {
    let messages = match body.required("messages")? {
        Value::Array(items) => items,
        other => return Err(wrong_type("messages", "an array", other)),
    };
    if messages.is_empty() {
        return Err(bad_value("messages", "must have at least one message"));
    }
    messages
        .iter()
        .enumerate()
        .map(|(i, m)| parse_message(&format!("messages[{i}]"), m))
        .collect()
}

fn parse_message(param: &str, message: &Value) -> Result<Value, ApiError> {
    let Value::Object(m) = message else {
        return Err(wrong_type(param, "an object", message));
    };
    let role = match m.get("role") {
        Some(Value::String(role)) if ROLES.contains(&role.as_str()) => role.as_str(),
        Some(Value::String(role)) => {
            return Err(bad_value(
                &format!("{param}.role"),
                format!("must be one of {ROLES:?}, got {role:?}"),
            ))
        }
        Some(other) => return Err(wrong_type(&format!("{param}.role"), "a string", other)),
        None => return Err(bad_value(&format!("{param}.role"), "is required")),
    };
    let mut out = Map::new();
    out.insert(
        "role".into(),
        json!(if role == "developer" { "system" } else { role }),
    );
    let content = parse_content(&format!("{param}.content"), m.get("content"))?;
    let tool_calls = match m.get("tool_calls") {
        None | Some(Value::Null) => None,
        Some(_) if role != "assistant" => {
            return Err(bad_value(
                &format!("{param}.tool_calls"),
                "is only allowed in assistant messages",
            ))
        }
        Some(calls) => Some(parse_history_calls(&format!("{param}.tool_calls"), calls)?),
    };
    if content.is_null() && tool_calls.is_none() && role != "assistant" {
        return Err(bad_value(&format!("{param}.content"), "is required"));
    }
    out.insert("content".into(), content);
    for key in ["name", "tool_call_id"] {
        match m.get(key) {
            None | Some(Value::Null) => {}
            Some(Value::String(s)) => {
                out.insert(key.into(), json!(s));
            }
            Some(other) => return Err(wrong_type(&format!("{param}.{key}"), "a string", other)),
        }
    }
    if let Some(calls) = tool_calls {
        out.insert("tool_calls".into(), calls);
    }
    // Past reasoning, sent back by clients (vLLM names it `reasoning`).
    for key in ["reasoning_content", "reasoning"] {
        match m.get(key) {
            None | Some(Value::Null) => {}
            Some(Value::String(s)) if role == "assistant" => {
                out.entry("reasoning_content").or_insert_with(|| json!(s));
            }
            Some(Value::String(_)) => {}
            Some(other) => return Err(wrong_type(&format!("{param}.{key}"), "a string", other)),
        }
    }
    Ok(Value::Object(out))
}

/// Content: a string, `null`, or a list of text parts (joined).
fn parse_content(param: &str, content: Option<&Value>) -> Result<Value, ApiError> {
    match content {
        None | Some(Value::Null) => Ok(Value::Null),
        Some(Value::String(s)) => Ok(json!(s)),
        Some(Value::Array(parts)) => {
            let mut text = String::new();
            for (j, part) in parts.iter().enumerate() {
                let part_param = format!("{param}[{j}]");
                match part {
                    Value::String(s) => text += s,
                    Value::Object(p) => match (p.get("type"), p.get("text")) {
                        (Some(Value::String(t)), Some(Value::String(s))) if t == "text" => {
                            text += s
                        }
                        (Some(Value::String(t)), _)
                            if ["image_url", "image", "input_image"].contains(&t.as_str()) =>
                        {
                            return Err(bad_value(
                                &part_param,
                                "is an image: images are not supported yet (text only)",
                            ))
                        }
                        (Some(Value::String(t)), _) if t != "text" => {
                            return Err(bad_value(
                                &part_param,
                                format!("has type {t:?}; this model accepts only text parts"),
                            ))
                        }
                        _ => {
                            return Err(bad_value(
                                &part_param,
                                "must be {\"type\": \"text\", \"text\": string}",
                            ))
                        }
                    },
                    other => return Err(wrong_type(&part_param, "a content part object", other)),
                }
            }
            Ok(json!(text))
        }
        Some(other) => Err(wrong_type(
            param,
            "a string or a list of content parts",
            other,
        )),
    }
}

/// Tool calls of an assistant message in the history.
fn parse_history_calls(param: &str, calls: &Value) -> Result<Value, ApiError> {
    let Value::Array(items) = calls else {
        return Err(wrong_type(param, "an array", calls));
    };
    let mut out = Vec::with_capacity(items.len());
    for (i, call) in items.iter().enumerate() {
        let call_param = format!("{param}[{i}]");
        let function = call
            .get("function")
            .and_then(Value::as_object)
            .ok_or_else(|| bad_value(&call_param, "must have a `function` object"))?;
        let name = function
            .get("name")
            .and_then(Value::as_str)
            .ok_or_else(|| bad_value(&format!("{call_param}.function.name"), "must be a string"))?;
        let arguments = match function.get("arguments") {
            None | Some(Value::Null) => json!("{}"),
            Some(Value::String(s)) => json!(s),
            Some(v @ Value::Object(_)) => json!(v.to_string()),
            Some(other) => {
                return Err(wrong_type(
                    &format!("{call_param}.function.arguments"),
                    "a string",
                    other,
                ))
            }
        };
        let id = match call.get("id") {
            Some(Value::String(id)) => id.clone(),
            None | Some(Value::Null) => format!("functions.{name}:{i}"),
            Some(other) => return Err(wrong_type(&format!("{call_param}.id"), "a string", other)),
        };
        out.push(json!({
            "id": id,
            "type": "function",
            "function": {"name": name, "arguments": arguments},
        }));
    }
    Ok(Value::Array(out))
}

/// OpenAI's rule for function names: 1 to 64 of `a-z A-Z 0-9 _ -`.
fn valid_function_name(name: &str) -> bool {
    (1..=64).contains(&name.len())
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

/// `tools` (schemas are compiled later, by the caller).
pub(crate) fn parse_tools(body: &Body) -> Result<Vec<ToolSpec>, ApiError> {
    let Some(items) = body.array("tools")? else {
        return Ok(Vec::new());
    };
    let mut tools: Vec<ToolSpec> = Vec::with_capacity(items.len());
    for (i, tool) in items.iter().enumerate() {
        let param = format!("tools[{i}]");
        let Value::Object(t) = tool else {
            return Err(wrong_type(&param, "an object", tool));
        };
        match t.get("type") {
            None | Some(Value::Null) => {}
            Some(Value::String(kind)) if kind == "function" => {}
            Some(other) => {
                return Err(bad_value(
                    &format!("{param}.type"),
                    format!("must be \"function\", got {other}"),
                ))
            }
        }
        let function = match t.get("function") {
            Some(Value::Object(f)) => f,
            Some(other) => {
                return Err(wrong_type(&format!("{param}.function"), "an object", other))
            }
            None => return Err(bad_value(&format!("{param}.function"), "is required")),
        };
        let name = match function.get("name") {
            Some(Value::String(name)) if valid_function_name(name) => name.clone(),
            Some(Value::String(name)) => {
                return Err(bad_value(
                    &format!("{param}.function.name"),
                    format!("must be 1 to 64 of a-z, A-Z, 0-9, _ and -, got {name:?}"),
                ))
            }
            Some(other) => {
                return Err(wrong_type(
                    &format!("{param}.function.name"),
                    "a string",
                    other,
                ))
            }
            None => return Err(bad_value(&format!("{param}.function.name"), "is required")),
        };
        if tools.iter().any(|other| other.name == name) {
            return Err(bad_value(
                &format!("{param}.function.name"),
                format!("{name:?} is defined twice"),
            ));
        }
        if let Some(d) = function
            .get("description")
            .filter(|d| !d.is_null() && !d.is_string())
        {
            return Err(wrong_type(
                &format!("{param}.function.description"),
                "a string",
                d,
            ));
        }
        let parameters = match function.get("parameters") {
            None | Some(Value::Null) => json!({"type": "object", "properties": {}}),
            Some(schema @ Value::Object(_)) => schema.clone(),
            Some(other) => {
                return Err(wrong_type(
                    &format!("{param}.function.parameters"),
                    "a JSON schema object",
                    other,
                ))
            }
        };
        tools.push(ToolSpec {
            name,
            parameters,
            raw: tool.clone(),
        });
    }
    Ok(tools)
}

/// `tool_choice`, checked against the tools.
pub(crate) fn parse_tool_choice(body: &Body, tools: &[ToolSpec]) -> Result<ToolChoice, ApiError> {
    let choice = match body.get("tool_choice") {
        None if tools.is_empty() => ToolChoice::None,
        None => ToolChoice::Auto,
        Some(Value::String(s)) => match s.as_str() {
            "none" => ToolChoice::None,
            "auto" => ToolChoice::Auto,
            "required" => ToolChoice::Required,
            other => {
                return Err(bad_value(
                    "tool_choice",
                    format!(
                        "must be \"none\", \"auto\", \"required\" or a function, got {other:?}"
                    ),
                ))
            }
        },
        Some(Value::Object(o)) => {
            let name = o
                .get("function")
                .and_then(|f| f.get("name"))
                .and_then(Value::as_str)
                .ok_or_else(|| {
                    bad_value(
                        "tool_choice",
                        "must be {\"type\": \"function\", \"function\": {\"name\": ...}}",
                    )
                })?;
            if !tools.iter().any(|t| t.name == name) {
                return Err(bad_value(
                    "tool_choice",
                    format!("names function {name:?}, which is not in `tools`"),
                ));
            }
            ToolChoice::Named(name.to_string())
        }
        Some(other) => return Err(wrong_type("tool_choice", "a string or an object", other)),
    };
    if matches!(choice, ToolChoice::Required) && tools.is_empty() {
        return Err(bad_value(
            "tool_choice",
            "is \"required\" but no `tools` were given",
        ));
    }
    Ok(choice)
}

/// `response_format`.
pub(crate) fn parse_response_format(body: &Body) -> Result<ResponseFormat, ApiError> {
    let Some(format) = body.object("response_format")? else {
        return Ok(ResponseFormat::Text);
    };
    match format.get("type").and_then(Value::as_str) {
        Some("text") => Ok(ResponseFormat::Text),
        Some("json_object") => Ok(ResponseFormat::JsonObject),
        Some("json_schema") => {
            let spec = match format.get("json_schema") {
                Some(Value::Object(spec)) => spec,
                Some(other) => {
                    return Err(wrong_type(
                        "response_format.json_schema",
                        "an object",
                        other,
                    ))
                }
                None => return Err(bad_value("response_format.json_schema", "is required")),
            };
            match spec.get("schema") {
                None | Some(Value::Null) => Ok(ResponseFormat::JsonSchema(None)),
                Some(schema @ Value::Object(_)) => {
                    Ok(ResponseFormat::JsonSchema(Some(schema.clone())))
                }
                Some(other) => Err(wrong_type(
                    "response_format.json_schema.schema",
                    "an object",
                    other,
                )),
            }
        }
        _ => Err(bad_value(
            "response_format",
            "must have `type` \"text\", \"json_object\" or \"json_schema\"",
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn body(json: &str) -> Body {
        Body::parse(json.as_bytes()).expect("valid JSON object")
    }

    #[test]
    fn messages_are_normalised() {
        let b = body(
            r#"{"messages": [{"role": "developer", "content": [{"type": "text", "text": "a"}, "b"]},
            {"role": "assistant", "content": null, "tool_calls": [{"function": {"name": "f", "arguments": {"x": 1}}}]}]}"#,
        );
        let m = parse_messages(&b).expect("valid");
        assert_eq!(m[0], json!({"role": "system", "content": "ab"}));
        assert_eq!(m[1]["tool_calls"][0]["id"], "functions.f:0");
        assert_eq!(m[1]["tool_calls"][0]["function"]["arguments"], "{\"x\":1}");
        let r = body(
            r#"{"messages": [{"role": "assistant", "content": "a", "reasoning": "why"},
            {"role": "user", "content": "b", "reasoning_content": "dropped"}]}"#,
        );
        let m = parse_messages(&r).expect("valid");
        assert_eq!(m[0]["reasoning_content"], "why");
        assert!(m[1].get("reasoning_content").is_none());
        let image = body(r#"{"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}"#);
        let err = parse_messages(&image).expect_err("images refused");
        assert!(
            err.message.contains("images are not supported yet"),
            "{}",
            err.message
        );
        for bad in [
            r#"{"messages": []}"#,
            r#"{"messages": "hi"}"#,
            r#"{"messages": [{"role": "robot", "content": "x"}]}"#,
            r#"{"messages": [{"role": "user"}]}"#,
            r#"{"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}"#,
            r#"{"messages": [{"role": "user", "content": 5}]}"#,
        ] {
            assert!(parse_messages(&body(bad)).is_err(), "{bad}");
        }
    }

    #[test]
    fn tools_and_choice() {
        let b = body(
            r#"{"tools": [{"type": "function", "function": {"name": "get_weather"}}],
                         "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}"#,
        );
        let tools = parse_tools(&b).expect("valid");
        assert_eq!(
            tools[0].parameters,
            json!({"type": "object", "properties": {}})
        );
        assert_eq!(
            parse_tool_choice(&b, &tools).ok(),
            Some(ToolChoice::Named("get_weather".into()))
        );
        assert!(parse_tool_choice(&body(r#"{"tool_choice": "required"}"#), &[]).is_err());
        assert!(parse_tool_choice(
            &body(r#"{"tool_choice": {"function": {"name": "nope"}}}"#),
            &tools
        )
        .is_err());
        assert!(parse_tools(&body(r#"{"tools": [{"function": {"name": "bad name"}}]}"#)).is_err());
        assert!(parse_tools(&body(
            r#"{"tools": [{"function": {"name": "f", "parameters": 3}}]}"#
        ))
        .is_err());
    }

    #[test]
    fn response_formats() {
        assert_eq!(
            parse_response_format(&body("{}")).ok(),
            Some(ResponseFormat::Text)
        );
        let b = body(
            r#"{"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}}"#,
        );
        assert_eq!(
            parse_response_format(&b).ok(),
            Some(ResponseFormat::JsonSchema(Some(json!({"type": "object"}))))
        );
        assert!(parse_response_format(&body(r#"{"response_format": {"type": "yaml"}}"#)).is_err());
    }
}
