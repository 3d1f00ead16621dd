//! The renderer against hand-written prompts, one per message kind.

use serde_json::{json, Value};

use super::*;

const EFFORT_MAX: &str = "<|open|>message role=\"system\" type=\"thinking-effort\"<|sep|>\
    `thinking_effort` guides on how much to think in your thinking channel (not including the \
    response channel), supported values include `low`, `medium`, `high`, and `max`.\n\
    Now the system is invoked with `thinking_effort=max`.<|close|>message<|sep|><|end_of_msg|>";
const THINK_PROMPT: &str = "<|open|>message role=\"assistant\"<|sep|><|open|>think<|sep|>";
const RESPONSE_PROMPT: &str = "<|open|>message role=\"assistant\"<|sep|><|open|>response<|sep|>";

fn render(messages: &[Value], options: &XtmlOptions<'_>) -> String {
    render_xtml(messages, options).expect("renders").text()
}

fn no_thinking() -> XtmlOptions<'static> {
    XtmlOptions {
        thinking: false,
        ..XtmlOptions::default()
    }
}

#[test]
fn user_turn_with_thinking_defaults() {
    let got = render(
        &[json!({"role": "user", "content": "Hello!"})],
        &XtmlOptions::default(),
    );
    let want = format!(
        "{EFFORT_MAX}<|open|>message role=\"user\"<|sep|>Hello!<|close|>message<|sep|>\
         <|end_of_msg|>{THINK_PROMPT}"
    );
    assert_eq!(got, want);
}

#[test]
fn system_and_user_without_thinking() {
    let got = render(
        &[
            json!({"role": "system", "content": "Be brief."}),
            json!({"role": "developer", "content": "Use metric units."}),
            json!({"role": "user", "content": [{"type": "text", "text": "Hi "}, "there"]}),
        ],
        &no_thinking(),
    );
    let want = "<|open|>message role=\"system\"<|sep|>Be brief.<|close|>message<|sep|><|end_of_msg|>\
        <|open|>message role=\"system\"<|sep|>Use metric units.<|close|>message<|sep|><|end_of_msg|>\
        <|open|>message role=\"user\"<|sep|>Hi there<|close|>message<|sep|><|end_of_msg|>"
        .to_string()
        + RESPONSE_PROMPT;
    assert_eq!(got, want);
}

#[test]
fn thinking_effort_is_stated() {
    let options = XtmlOptions {
        thinking_effort: ThinkingEffort::Low,
        add_generation_prompt: false,
        ..XtmlOptions::default()
    };
    let got = render(&[json!({"role": "user", "content": "x"})], &options);
    assert!(got.starts_with("<|open|>message role=\"system\" type=\"thinking-effort\"<|sep|>"));
    assert!(got.contains("Now the system is invoked with `thinking_effort=low`.<|close|>"));
    assert!(
        got.ends_with("x<|close|>message<|sep|><|end_of_msg|>"),
        "{got}"
    );
    assert_eq!(ThinkingEffort::parse("high"), Some(ThinkingEffort::High));
    assert_eq!(ThinkingEffort::parse("medium"), None);
}

#[test]
fn tools_are_declared_sorted_and_compact() {
    let tools = [json!({"type": "function", "function": {
        "name": "get_weather", "description": "Wetter in Zürich",
        "parameters": {"type": "object", "required": ["city"],
                       "properties": {"city": {"type": "string"}, "days": {"type": "integer", "maximum": 7.5}}}}})];
    let options = XtmlOptions {
        tools: &tools,
        thinking: false,
        ..XtmlOptions::default()
    };
    let got = render(&[json!({"role": "user", "content": "Weather?"})], &options);
    let want = "<|open|>message role=\"system\" type=\"tool-declare\"<|sep|># Tools\n\
        Here are the available tools, described in JSONSchema.\n\n```json\n\
        [{\"function\":{\"description\":\"Wetter in Zürich\",\"name\":\"get_weather\",\
        \"parameters\":{\"properties\":{\"city\":{\"type\":\"string\"},\"days\":{\"maximum\":7.5,\
        \"type\":\"integer\"}},\"required\":[\"city\"],\"type\":\"object\"}},\"type\":\"function\"}]\n\
        ```<|close|>message<|sep|><|end_of_msg|>\
        <|open|>message role=\"user\"<|sep|>Weather?<|close|>message<|sep|><|end_of_msg|>"
        .to_string()
        + RESPONSE_PROMPT;
    assert_eq!(got, want);
}

#[test]
fn assistant_turn_with_reasoning_typed_calls_and_sorted_results() {
    let messages = [
        json!({"role": "user", "content": "Go"}),
        json!({"role": "assistant", "reasoning_content": "Two calls.", "content": "On it.",
               "tool_calls": [
                   {"id": "a", "type": "function", "function": {"name": "get_weather",
                    "arguments": "{\"city\": \"Paris\", \"days\": 3, \"ratio\": 1.5, \"metric\": true, \"at\": null}"}},
                   {"id": "b", "type": "function", "function": {"name": "search",
                    "arguments": "{\"filters\": {\"tags\": [\"a\", \"b\"], \"max\": 3}, \"ids\": [1,2]}"}}]}),
        // Results in the wrong order are put back in call order and named by their call.
        json!({"role": "tool", "tool_call_id": "b", "content": "[]"}),
        json!({"role": "tool", "tool_call_id": "a", "name": "ignored", "content": "{\"temp\": 20}"}),
    ];
    let got = render(
        &messages,
        &XtmlOptions {
            add_generation_prompt: false,
            ..XtmlOptions::default()
        },
    );
    let want = EFFORT_MAX.to_string()
        + "<|open|>message role=\"user\"<|sep|>Go<|close|>message<|sep|><|end_of_msg|>\
        <|open|>message role=\"assistant\"<|sep|>\
        <|open|>think<|sep|>Two calls.<|close|>think<|sep|>\
        <|open|>response<|sep|>On it.<|close|>response<|sep|>\
        <|open|>tools<|sep|>\
        <|open|>call tool=\"get_weather\" index=\"1\"<|sep|>\
        <|open|>argument key=\"city\" type=\"string\"<|sep|>Paris<|close|>argument<|sep|>\
        <|open|>argument key=\"days\" type=\"number\"<|sep|>3<|close|>argument<|sep|>\
        <|open|>argument key=\"ratio\" type=\"number\"<|sep|>1.5<|close|>argument<|sep|>\
        <|open|>argument key=\"metric\" type=\"boolean\"<|sep|>true<|close|>argument<|sep|>\
        <|open|>argument key=\"at\" type=\"null\"<|sep|>null<|close|>argument<|sep|>\
        <|close|>call<|sep|>\
        <|open|>call tool=\"search\" index=\"2\"<|sep|>\
        <|open|>argument key=\"filters\" type=\"object\"<|sep|>{\"tags\": [\"a\", \"b\"], \"max\": 3}<|close|>argument<|sep|>\
        <|open|>argument key=\"ids\" type=\"array\"<|sep|>[1, 2]<|close|>argument<|sep|>\
        <|close|>call<|sep|>\
        <|close|>tools<|sep|>\
        <|close|>message<|sep|><|end_of_msg|>\
        <|open|>message role=\"tool\" tool=\"get_weather\" index=\"1\"<|sep|>{\"temp\": 20}<|close|>message<|sep|><|end_of_msg|>\
        <|open|>message role=\"tool\" tool=\"search\" index=\"2\"<|sep|>[]<|close|>message<|sep|><|end_of_msg|>";
    assert_eq!(got, want);
}

#[test]
fn assistant_history_without_thinking_drops_reasoning() {
    let messages = [
        json!({"role": "user", "content": "Hi"}),
        json!({"role": "assistant", "content": "Hello.", "reasoning_content": "greet"}),
        json!({"role": "user", "content": "Bye"}),
    ];
    let want = "<|open|>message role=\"user\"<|sep|>Hi<|close|>message<|sep|><|end_of_msg|>\
        <|open|>message role=\"assistant\"<|sep|><|open|>response<|sep|>Hello.<|close|>response<|sep|>\
        <|close|>message<|sep|><|end_of_msg|>\
        <|open|>message role=\"user\"<|sep|>Bye<|close|>message<|sep|><|end_of_msg|>"
        .to_string()
        + RESPONSE_PROMPT;
    assert_eq!(render(&messages, &no_thinking()), want);
    // Thinking on: an empty think element even without reasoning; `reasoning` is an alias.
    let with_thinking = render(
        &[
            json!({"role": "assistant", "content": "A"}),
            json!({"role": "assistant", "content": null, "reasoning": "R"}),
        ],
        &XtmlOptions {
            add_generation_prompt: false,
            ..XtmlOptions::default()
        },
    );
    assert_eq!(
        with_thinking,
        EFFORT_MAX.to_string()
            + "<|open|>message role=\"assistant\"<|sep|><|open|>think<|sep|><|close|>think<|sep|>\
               <|open|>response<|sep|>A<|close|>response<|sep|><|close|>message<|sep|><|end_of_msg|>\
               <|open|>message role=\"assistant\"<|sep|><|open|>think<|sep|>R<|close|>think<|sep|>\
               <|open|>response<|sep|><|close|>response<|sep|><|close|>message<|sep|><|end_of_msg|>"
    );
}

#[test]
fn non_object_arguments_become_a_json_block() {
    let messages = [json!({"role": "assistant", "content": "", "tool_calls": [
        {"id": "1", "function": {"name": "f", "arguments": "not json"}},
        {"id": "2", "function": {"name": "g", "arguments": "[1, 2]"}},
        {"id": "3", "function": {"name": "h", "arguments": ""}}]})];
    let got = render(&messages, &{
        let mut o = no_thinking();
        o.add_generation_prompt = false;
        o
    });
    let want = "<|open|>message role=\"assistant\"<|sep|><|open|>response<|sep|><|close|>response<|sep|>\
        <|open|>tools<|sep|>\
        <|open|>call tool=\"f\" index=\"1\"<|sep|><|open|>json type=\"object\"<|sep|>not json<|close|>json<|sep|><|close|>call<|sep|>\
        <|open|>call tool=\"g\" index=\"2\"<|sep|><|open|>json type=\"object\"<|sep|>[1, 2]<|close|>json<|sep|><|close|>call<|sep|>\
        <|open|>call tool=\"h\" index=\"3\"<|sep|><|close|>call<|sep|>\
        <|close|>tools<|sep|><|close|>message<|sep|><|end_of_msg|>";
    assert_eq!(got, want);
}

#[test]
fn attribute_values_are_escaped() {
    let messages = [
        json!({"role": "user", "name": "a\"b&c", "content": "q"}),
        json!({"role": "assistant", "content": "", "tool_calls": [
            {"function": {"name": "f", "arguments": {"say \"hi\"": "x&y"}}}]}),
    ];
    let got = render(&messages, &no_thinking());
    assert!(got.contains("<|open|>message role=\"user\" name=\"a&quot;b&amp;c\"<|sep|>q"));
    // Keys are attributes (escaped); string values are raw text.
    assert!(got.contains(
        "<|open|>argument key=\"say &quot;hi&quot;\" type=\"string\"<|sep|>x&y<|close|>argument"
    ));
    assert_eq!(unescape_attr(&escape_attr("&quot; & \"")), "&quot; & \"");
}

#[test]
fn tool_results_by_name_or_position() {
    let calls = json!([{"id": "x", "function": {"name": "first", "arguments": "{}"}},
                       {"id": "y", "function": {"name": "second", "arguments": "{}"}}]);
    let messages = [
        json!({"role": "assistant", "content": "", "tool_calls": calls}),
        // An unknown id: the run keeps its order; names come from `name`, then position.
        json!({"role": "tool", "tool_call_id": "zzz", "name": "named", "content": "1"}),
        json!({"role": "tool", "content": "2"}),
    ];
    let got = render(&messages, &no_thinking());
    assert!(got.contains(
        "<|open|>message role=\"tool\" tool=\"named\" index=\"1\"<|sep|>1<|close|>message<|sep|>\
         <|end_of_msg|><|open|>message role=\"tool\" tool=\"second\" index=\"2\"<|sep|>2"
    ));
    let orphan = [json!({"role": "tool", "content": "?"})];
    assert_eq!(
        render_xtml(&orphan, &no_thinking()),
        Err(XtmlError::ToolName { message: 0 })
    );
}

#[test]
fn directives_follow_the_conversation() {
    let tools = [json!({"type": "function", "function": {"name": "f"}})];
    let schema = json!({"type": "object", "properties": {"a": {"type": "string"}}});
    let options = XtmlOptions {
        tools: &tools,
        thinking: false,
        tool_choice: XtmlToolChoice::Required,
        response_format: XtmlResponseFormat::JsonSchema(Some(&schema)),
        ..XtmlOptions::default()
    };
    let got = render(&[json!({"role": "user", "content": "u"})], &options);
    let tail = "<|open|>message role=\"user\"<|sep|>u<|close|>message<|sep|><|end_of_msg|>\
        <|open|>message role=\"system\" type=\"tool-choice\"<|sep|>The system is invoked with \
        `tool_choice=required`.\nYou MUST call tools in the next message.<|close|>message<|sep|>\
        <|end_of_msg|><|open|>message role=\"system\" type=\"response-format\"<|sep|>The system is \
        invoked with `response_format=json_schema`.\nYour response must be raw JSON data without \
        markdown code blocks (```json) or any additional formatting.\nThe JSON data must match the \
        following schema:\n```json\n{\"properties\":{\"a\":{\"type\":\"string\"}},\"type\":\"object\"}\n\
        ```<|close|>message<|sep|><|end_of_msg|>"
        .to_string()
        + RESPONSE_PROMPT;
    assert!(got.ends_with(&tail), "{got}");
    let none = XtmlOptions {
        tool_choice: XtmlToolChoice::None,
        response_format: XtmlResponseFormat::JsonObject,
        ..options
    };
    let got = render(&[json!({"role": "user", "content": "u"})], &none);
    assert!(got.contains("`tool_choice=none`.\nYou MUST NOT call any tools in the next message."));
    assert!(got.contains("`response_format=json_object`.\nYour response must be raw JSON"));
    // Without tools there is nothing to choose, so no tool-choice directive.
    let no_tools = XtmlOptions { tools: &[], ..none };
    let got = render(&[json!({"role": "user", "content": "u"})], &no_tools);
    assert!(!got.contains("tool-choice"));
}

#[test]
fn images_and_unknown_roles_are_refused() {
    let image = [json!({"role": "user", "content": [
        {"type": "text", "text": "What is this?"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]})];
    let err = render_xtml(&image, &XtmlOptions::default()).expect_err("images refused");
    assert!(matches!(err, XtmlError::Image { message: 0, .. }));
    assert!(
        err.to_string().contains("images are not supported yet"),
        "{err}"
    );
    let robot = [json!({"role": "robot", "content": "beep"})];
    assert!(matches!(
        render_xtml(&robot, &XtmlOptions::default()),
        Err(XtmlError::Role { .. })
    ));
    let nameless = [json!({"role": "assistant", "tool_calls": [{"function": {}}]})];
    assert_eq!(
        render_xtml(&nameless, &XtmlOptions::default()),
        Err(XtmlError::CallName {
            message: 0,
            call: 0
        })
    );
}

#[test]
fn segments_keep_markers_apart_from_text() {
    let prompt = render_xtml(
        &[json!({"role": "user", "content": "a <|open|> b"})],
        &no_thinking(),
    )
    .expect("renders");
    let segments = prompt.segments();
    assert_eq!(
        segments[..7]
            .iter()
            .map(|s| (s.text.as_str(), s.control))
            .collect::<Vec<_>>(),
        [
            ("<|open|>", true),
            ("message", false),
            (" role", false),
            ("=\"", false),
            ("user", false),
            ("\"", false),
            ("<|sep|>", true),
        ]
    );
    assert_eq!(segments[7].text, "a <|open|> b");
    assert!(!segments[7].control);
}

#[test]
fn the_k3_tokenizer_encodes_markers_as_control_tokens_only() {
    let dir =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../assets/demo-tokenizer-k3");
    let tok = crate::Tokenizer::from_dir(&dir).expect("K3 demo tokenizer");
    let (open, close, sep, end) = (959, 960, 961, 958);
    assert_eq!(tok.token_id(OPEN), Some(open));
    assert!(tok.eos_ids().contains(&end));
    let prompt = render_xtml(
        &[json!({"role": "user", "content": "x<|open|>y"})],
        &no_thinking(),
    )
    .expect("renders");
    let ids = tok.encode_xtml(&prompt).expect("encodes");
    let count = |id| ids.iter().filter(|&&t| t == id).count();
    // user message + assistant message + response: three opens, the text's `<|open|>` is BPE.
    assert_eq!(
        (count(open), count(close), count(sep), count(end)),
        (3, 1, 4, 1)
    );
    assert_eq!(tok.decode(&ids, false).expect("decodes"), prompt.text());
}
