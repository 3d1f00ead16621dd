//! Kimi Linear's chat template (assets/demo-tokenizer/chat_template.jinja) against spec §9.4.

use crate::common;

use kimi_tokenizer::{ChatTemplate, TokenizerError};
use serde_json::json;

fn template() -> ChatTemplate {
    ChatTemplate::new(
        &common::kimi_template(),
        Some("[BOS]".into()),
        Some("[EOS]".into()),
    )
    .unwrap()
}

#[test]
fn spec_example_renders_exactly() {
    let messages = [
        json!({"role": "system", "content": "You are a helpful assistant provided by Moonshot-AI."}),
        json!({"role": "user", "content": "Is 123 a prime?"}),
    ];
    assert_eq!(
        template().render(&messages, None, true).unwrap(),
        "<|im_system|>system<|im_middle|>You are a helpful assistant provided by Moonshot-AI.<|im_end|><|im_user|>user<|im_middle|>Is 123 a prime?<|im_end|><|im_assistant|>assistant<|im_middle|>"
    );
    assert_eq!(
        template().render(&messages[1..], None, false).unwrap(),
        "<|im_user|>user<|im_middle|>Is 123 a prime?<|im_end|>"
    );
}

#[test]
fn tools_tool_calls_and_results() {
    let tools = [json!({
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather for a city — «quoted» \"text\"",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
        }
    })];
    let messages = [
        json!({"role": "user", "content": "Weather in Paris and the time?"}),
        json!({"role": "assistant", "content": "Let me check.", "tool_calls": [
            {"id": "functions.get_weather:0", "type": "function",
             "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}},
            {"id": "functions.get_time:1", "type": "function",
             "function": {"name": "get_time", "arguments": {"tz": "CET"}}}
        ]}),
        json!({"role": "tool", "tool_call_id": "functions.get_weather:0", "content": "sunny, 21 °C"}),
        json!({"role": "tool", "name": "get_time", "tool_call_id": "functions.get_time:1",
               "content": [{"type": "text", "text": "12:00"}, {"type": "text", "text": " CET"}]}),
        json!({"role": "assistant", "content": "Sunny, 21 °C, and it is noon."}),
        json!({"role": "user", "name": "alice", "content": "Thanks"}),
    ];
    let expected = concat!(
        r#"<|im_system|>tool_declare<|im_middle|>[{"type":"function","function":{"name":"get_weather","description":"Weather for a city — «quoted» \"text\"","parameters":{"type":"object","properties":{"city":{"type":"string"}},"required":["city"]}}}]<|im_end|>"#,
        "<|im_user|>user<|im_middle|>Weather in Paris and the time?<|im_end|>",
        "<|im_assistant|>assistant<|im_middle|>Let me check.<|tool_calls_section_begin|>",
        r#"<|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|>"#,
        r#"<|tool_call_begin|>functions.get_time:1<|tool_call_argument_begin|>{"tz": "CET"}<|tool_call_end|>"#,
        "<|tool_calls_section_end|><|im_end|>",
        "<|im_system|>tool<|im_middle|>## Return of functions.get_weather:0\nsunny, 21 °C<|im_end|>",
        "<|im_system|>get_time<|im_middle|>## Return of functions.get_time:1\n12:00 CET<|im_end|>",
        "<|im_assistant|>assistant<|im_middle|>Sunny, 21 °C, and it is noon.<|im_end|>",
        "<|im_user|>alice<|im_middle|>Thanks<|im_end|>",
        "<|im_assistant|>assistant<|im_middle|>",
    );
    assert_eq!(
        template().render(&messages, Some(&tools), true).unwrap(),
        expected
    );
}

#[test]
fn tool_call_without_content_and_empty_tools() {
    let messages = [json!({"role": "assistant", "content": null, "tool_calls": [
        {"id": "functions.f:0", "function": {"name": "f", "arguments": "{}"}}]})];
    assert_eq!(
        template().render(&messages, Some(&[]), false).unwrap(),
        "<|im_assistant|>assistant<|im_middle|><|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{}<|tool_call_end|><|tool_calls_section_end|><|im_end|>"
    );
}

#[test]
fn images_are_rejected() {
    let messages = [json!({"role": "user", "content": [
        {"type": "text", "text": "what is this?"},
        {"type": "image_url", "image_url": {"url": "data:,"}}]})];
    let err = template().render(&messages, None, true).unwrap_err();
    assert!(matches!(err, TokenizerError::TemplateRender(_)));
    assert!(err.to_string().contains("text-only"), "{err}");
}
