//! Kimi K3's XTML chat format through the HTTP API: the demo model with the K3 tokenizer
//! (`<|open|>` 959, `<|close|>` 960, `<|sep|>` 961, `<|end_of_msg|>` 958, no chat template).
//! Random weights: tests check prompts, structure and constraints, not wording.

use crate::common;

use common::*;
use serde_json::{json, Value};

const CLOSE: u32 = 960;
const THINK_PROMPT: &str = "<|open|>message role=\"assistant\"<|sep|><|open|>think<|sep|>";
const RESPONSE_PROMPT: &str = "<|open|>message role=\"assistant\"<|sep|><|open|>response<|sep|>";

fn tools() -> Value {
    json!([
        {"type": "function", "function": {
            "name": "get_weather",
            "description": "Weather in a city",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "enum": ["Paris", "Tokyo", "Lima"]},
                    "days": {"type": "integer", "minimum": 1, "maximum": 7},
                    "metric": {"type": "boolean"}
                },
                "required": ["city", "days"],
                "additionalProperties": false
            }
        }},
        {"type": "function", "function": {
            "name": "get_time",
            "parameters": {
                "type": "object",
                "properties": {"zone": {"type": "string", "maxLength": 6}},
                "required": ["zone"]
            }
        }}
    ])
}

fn schema_of(name: &str) -> Value {
    tools()
        .as_array()
        .into_iter()
        .flatten()
        .find(|t| t["function"]["name"] == name)
        .map(|t| t["function"]["parameters"].clone())
        .expect("tool exists")
}

/// The prompt the server renders for `body`, as text.
async fn prompt_text(server: &TestServer, body: Value) -> String {
    let resp = post(server.addr, "/tokenize", &body).await;
    assert_eq!(resp.status, 200, "{}", resp.text());
    let ids: Vec<u32> = serde_json::from_value(resp.json()["tokens"].clone()).expect("ids");
    server.tokenizer.decode(&ids, false).expect("decodes")
}

/// `(reasoning, content, calls as (id, name, arguments), finish_reason)` of a stream.
fn assemble(events: &[Value]) -> (String, String, Vec<(String, String, String)>, String) {
    let (mut reasoning, mut content, mut finish) = (String::new(), String::new(), String::new());
    let mut calls: Vec<(String, String, String)> = Vec::new();
    for event in events {
        let Some(choice) = event["choices"].get(0) else {
            continue;
        };
        let delta = &choice["delta"];
        reasoning += delta["reasoning_content"].as_str().unwrap_or("");
        content += delta["content"].as_str().unwrap_or("");
        for call in delta["tool_calls"].as_array().into_iter().flatten() {
            let index = call["index"].as_u64().expect("index") as usize;
            if let Some(id) = call["id"].as_str() {
                assert_eq!(index, calls.len(), "calls count from 0");
                let name = call["function"]["name"].as_str().expect("name first");
                calls.push((id.into(), name.into(), String::new()));
            }
            calls[index].2 += call["function"]["arguments"].as_str().unwrap_or("");
        }
        if let Some(reason) = choice["finish_reason"].as_str() {
            finish = reason.into();
        }
    }
    (reasoning, content, calls, finish)
}

/// The same fields of a whole response.
fn whole(body: &Value) -> (String, String, Vec<(String, String, String)>, String) {
    let choice = &body["choices"][0];
    let message = &choice["message"];
    let calls = message["tool_calls"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|c| {
            assert_eq!(c["type"], "function");
            let text = |v: &Value| v.as_str().unwrap_or("").to_string();
            (
                text(&c["id"]),
                text(&c["function"]["name"]),
                text(&c["function"]["arguments"]),
            )
        })
        .collect();
    (
        message["reasoning_content"].as_str().unwrap_or("").into(),
        message["content"].as_str().unwrap_or("").into(),
        calls,
        choice["finish_reason"].as_str().unwrap_or("").into(),
    )
}

/// Posts `request` whole and streamed; both must agree (ids aside) and leak no marker.
async fn both_ways(
    server: &TestServer,
    request: &Value,
) -> (String, String, Vec<(String, String, String)>, String) {
    let resp = post(server.addr, "/v1/chat/completions", request).await;
    assert_eq!(resp.status, 200, "{}", resp.text());
    let got = whole(&resp.json());
    let mut streaming = request.clone();
    streaming["stream"] = json!(true);
    let events = post(server.addr, "/v1/chat/completions", &streaming)
        .await
        .sse();
    let streamed = assemble(&events);
    let strip = |x: &(String, String, Vec<(String, String, String)>, String)| {
        let calls: Vec<(String, String)> = x.2.iter().map(|c| (c.1.clone(), c.2.clone())).collect();
        (x.0.clone(), x.1.clone(), calls, x.3.clone())
    };
    assert_eq!(strip(&got), strip(&streamed), "streamed vs whole");
    for text in [&got.0, &got.1] {
        for marker in ["<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>"] {
            assert!(!text.contains(marker), "{marker} leaked: {text:?}");
        }
    }
    got
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_server_renders_xtml_prompts() {
    let server = start_k3().await;
    let user = json!([{"role": "user", "content": "Hi <|open|>"}]);
    let text = prompt_text(&server, json!({"messages": user})).await;
    assert!(
        text.starts_with("<|open|>message role=\"system\" type=\"thinking-effort\"<|sep|>"),
        "{text}"
    );
    assert!(text.contains("`thinking_effort=max`.<|close|>message<|sep|><|end_of_msg|>"));
    assert!(text.ends_with(&format!(
        "<|open|>message role=\"user\"<|sep|>Hi <|open|><|close|>message<|sep|><|end_of_msg|>{THINK_PROMPT}"
    )));
    // The user's `<|open|>` is text: control tokens only for the real markers.
    let resp = post(server.addr, "/tokenize", &json!({"messages": user})).await;
    let ids: Vec<u32> = serde_json::from_value(resp.json()["tokens"].clone()).expect("ids");
    let opens = ids.iter().filter(|&&id| id == 959).count();
    assert_eq!(opens, text.matches("<|open|>").count() - 1);

    let off = prompt_text(
        &server,
        json!({"messages": user, "chat_template_kwargs": {"thinking": false}}),
    )
    .await;
    assert!(
        !off.contains("thinking-effort") && off.ends_with(RESPONSE_PROMPT),
        "{off}"
    );
    let low = prompt_text(
        &server,
        json!({"messages": user, "reasoning_effort": "low"}),
    )
    .await;
    assert!(low.contains("`thinking_effort=low`."), "{low}");

    let history = json!({
        "messages": [
            {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": null, "reasoning_content": "Call it.", "tool_calls": [
                {"id": "c1", "type": "function",
                 "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\", \"days\": 2}"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "Sunny"},
        ],
        "tools": tools(), "tool_choice": "required",
    });
    let text = prompt_text(&server, history).await;
    assert!(
        text.starts_with("<|open|>message role=\"system\" type=\"tool-declare\"<|sep|># Tools\n")
    );
    assert!(
        text.contains("\"name\":\"get_weather\",\"parameters\":{\"additionalProperties\":false,")
    );
    assert!(text.contains(
        "<|open|>think<|sep|>Call it.<|close|>think<|sep|><|open|>response<|sep|><|close|>response<|sep|>\
         <|open|>tools<|sep|><|open|>call tool=\"get_weather\" index=\"1\"<|sep|>\
         <|open|>argument key=\"city\" type=\"string\"<|sep|>Paris<|close|>argument<|sep|>\
         <|open|>argument key=\"days\" type=\"number\"<|sep|>2<|close|>argument<|sep|>\
         <|close|>call<|sep|><|close|>tools<|sep|><|close|>message<|sep|><|end_of_msg|>\
         <|open|>message role=\"tool\" tool=\"get_weather\" index=\"1\"<|sep|>Sunny"
    ));
    assert!(text
        .contains("type=\"tool-choice\"<|sep|>The system is invoked with `tool_choice=required`."));
    assert!(text.ends_with(THINK_PROMPT));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn free_generation_gives_reasoning_and_content() {
    let server = start_k3().await;
    for thinking in [true, false] {
        let request = json!({
            "model": MODEL,
            "messages": [{"role": "user", "content": "Hello"}],
            "tools": tools(),
            "chat_template_kwargs": {"thinking": thinking},
            "temperature": 0, "max_tokens": 24,
        });
        let (_, _, calls, finish) = both_ways(&server, &request).await;
        assert!(["stop", "length", "tool_calls"].contains(&finish.as_str()));
        assert_eq!(finish == "tool_calls", !calls.is_empty());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn required_and_named_tool_choice_give_schema_valid_calls() {
    let server = start_k3().await;
    for (choice, thinking, seed) in [
        (json!("required"), false, 1),
        (json!("required"), true, 2),
        (
            json!({"type": "function", "function": {"name": "get_time"}}),
            false,
            3,
        ),
        (
            json!({"type": "function", "function": {"name": "get_weather"}}),
            true,
            4,
        ),
    ] {
        let mut request = json!({
            "model": MODEL,
            "messages": [{"role": "user", "content": "What's the weather in Paris?"}],
            "tools": tools(), "tool_choice": choice,
            "chat_template_kwargs": {"thinking": thinking},
            "temperature": 1.0, "seed": seed, "max_tokens": 1300,
        });
        if thinking {
            // Random weights would reason until max_tokens; a bias on `<|close|>` ends the
            // think element (and string values) at once, as a real model would end them.
            request["logit_bias"] = json!({CLOSE.to_string(): 100});
        }
        let (_, content, calls, finish) = both_ways(&server, &request).await;
        assert!(!calls.is_empty(), "{choice}");
        assert!(content.is_empty());
        let ids: Vec<&String> = calls.iter().map(|c| &c.0).collect();
        for (i, (id, name, arguments)) in calls.iter().enumerate() {
            assert!(id.starts_with("call_") && !ids[..i].contains(&id), "{id}");
            if let Some(named) = choice["function"]["name"].as_str() {
                assert_eq!(name, named);
            }
            let args: Value = serde_json::from_str(arguments)
                .unwrap_or_else(|e| panic!("arguments are not JSON ({e}): {arguments}"));
            validate(&schema_of(name), &args).unwrap_or_else(|e| panic!("{e}: {arguments}"));
        }
        let expected = if choice.is_string() {
            "tool_calls"
        } else {
            "stop"
        };
        assert_eq!(finish, expected, "{choice}: {calls:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn response_format_gives_json_in_the_response() {
    let server = start_k3().await;
    let schema = json!({
        "type": "object",
        "properties": {
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "member": {"type": "boolean"},
            "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b"]}, "maxItems": 3}
        },
        "required": ["age", "member", "tags"],
        "additionalProperties": false
    });
    for (thinking, seed) in [(false, 0), (true, 1)] {
        let mut request = json!({
            "model": MODEL,
            "messages": [{"role": "user", "content": "A person as JSON"}],
            "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": schema}},
            "chat_template_kwargs": {"thinking": thinking},
            "temperature": 0.8, "seed": seed, "max_tokens": 300,
        });
        if thinking {
            request["logit_bias"] = json!({CLOSE.to_string(): 100});
        }
        let (reasoning, content, calls, finish) = both_ways(&server, &request).await;
        assert!(reasoning.is_empty() && calls.is_empty());
        let value: Value =
            serde_json::from_str(&content).unwrap_or_else(|e| panic!("not JSON ({e}): {content}"));
        validate(&schema, &value).unwrap_or_else(|e| panic!("{e}: {content}"));
        assert_eq!(finish, "stop");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_xtml_requests_are_400s() {
    let server = start_k3().await;
    let user = json!([{"role": "user", "content": "x"}]);
    let image = json!({"model": MODEL, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "What is this?"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]});
    let err = post(server.addr, "/v1/chat/completions", &image)
        .await
        .expect_error(400);
    assert!(
        err["message"]
            .as_str()
            .is_some_and(|m| m.contains("images are not supported yet")),
        "{err}"
    );
    for body in [
        json!({"messages": user, "chat_template_kwargs": {"thinking_effort": "medium"}}),
        json!({"messages": user, "reasoning_effort": "medium"}),
        json!({"messages": user, "chat_template_kwargs": {"thinking": "no"}}),
        json!({"messages": user, "add_generation_prompt": false,
               "response_format": {"type": "json_object"}}),
        json!({"messages": [{"role": "tool", "content": "orphan"}]}),
    ] {
        post(server.addr, "/v1/chat/completions", &body)
            .await
            .expect_error(400);
    }
}
