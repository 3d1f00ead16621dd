//! Every kind of bad input gets OpenAI's error JSON with the right status and `param`, and
//! a corpus of malformed requests never crashes or hangs the server.

use crate::common;

use common::*;
use serde_json::{json, Value};

/// `(body, status, param)` for `/v1/chat/completions`.
fn chat_cases() -> Vec<(Value, u16, Option<&'static str>)> {
    let msgs = json!([{"role": "user", "content": "hi"}]);
    let with = |extra: Value| {
        let mut body = json!({"model": MODEL, "messages": msgs});
        if let (Some(b), Some(e)) = (body.as_object_mut(), extra.as_object()) {
            for (k, v) in e {
                b.insert(k.clone(), v.clone());
            }
        }
        body
    };
    let long = "word ".repeat(3000);
    vec![
        (with(json!({"model": "gpt-4"})), 404, Some("model")),
        (with(json!({"model": 7})), 400, Some("model")),
        (json!({"model": MODEL}), 400, Some("messages")),
        (with(json!({"messages": []})), 400, Some("messages")),
        (with(json!({"messages": "hi"})), 400, Some("messages")),
        (
            with(json!({"messages": [{"role": "wizard", "content": "x"}]})),
            400,
            Some("messages[0].role"),
        ),
        (
            with(json!({"messages": [{"content": "x"}]})),
            400,
            Some("messages[0].role"),
        ),
        (
            with(json!({"messages": [{"role": "user", "content": 12}]})),
            400,
            Some("messages[0].content"),
        ),
        (
            with(
                json!({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}),
            ),
            400,
            Some("messages[0].content[0]"),
        ),
        (with(json!({"max_tokens": 0})), 400, Some("max_tokens")),
        (with(json!({"max_tokens": -5})), 400, Some("max_tokens")),
        (
            with(json!({"max_completion_tokens": 0})),
            400,
            Some("max_completion_tokens"),
        ),
        (with(json!({"max_tokens": "10"})), 400, Some("max_tokens")),
        (with(json!({"max_tokens": 1.5})), 400, Some("max_tokens")),
        (with(json!({"max_tokens": 100000})), 400, Some("messages")),
        (
            with(json!({"messages": [{"role": "user", "content": long}]})),
            400,
            Some("messages"),
        ),
        (with(json!({"temperature": -0.5})), 400, Some("temperature")),
        (with(json!({"temperature": 1000})), 400, Some("temperature")),
        (
            with(json!({"temperature": "hot"})),
            400,
            Some("temperature"),
        ),
        (with(json!({"top_p": 0})), 400, Some("top_p")),
        (with(json!({"top_p": 1.5})), 400, Some("top_p")),
        (with(json!({"top_k": -3})), 400, Some("top_k")),
        (with(json!({"min_p": 2})), 400, Some("min_p")),
        (
            with(json!({"frequency_penalty": 3})),
            400,
            Some("frequency_penalty"),
        ),
        (
            with(json!({"presence_penalty": -3})),
            400,
            Some("presence_penalty"),
        ),
        (
            with(json!({"repetition_penalty": 0})),
            400,
            Some("repetition_penalty"),
        ),
        (with(json!({"n": 0})), 400, Some("n")),
        (with(json!({"n": 1000})), 400, Some("n")),
        (with(json!({"seed": "abc"})), 400, Some("seed")),
        (with(json!({"stop": 5})), 400, Some("stop")),
        (with(json!({"stop": [""]})), 400, Some("stop")),
        (with(json!({"stop": vec!["a"; 17]})), 400, Some("stop")),
        (with(json!({"stream": "yes"})), 400, Some("stream")),
        (
            with(json!({"stream_options": {"include_usage": true}})),
            400,
            Some("stream_options"),
        ),
        (with(json!({"logprobs": "yes"})), 400, Some("logprobs")),
        (with(json!({"top_logprobs": 3})), 400, Some("top_logprobs")),
        (
            with(json!({"logprobs": true, "top_logprobs": 21})),
            400,
            Some("top_logprobs"),
        ),
        (
            with(json!({"logit_bias": {"abc": 1}})),
            400,
            Some("logit_bias"),
        ),
        (
            with(json!({"logit_bias": {"5": 500}})),
            400,
            Some("logit_bias"),
        ),
        (
            with(json!({"stop_token_ids": [99999999]})),
            400,
            Some("stop_token_ids"),
        ),
        (with(json!({"tools": {}})), 400, Some("tools")),
        (
            with(json!({"tools": [{"type": "function", "function": {"name": "has space"}}]})),
            400,
            Some("tools[0].function.name"),
        ),
        (
            with(json!({"tools": [{"type": "function"}]})),
            400,
            Some("tools[0].function"),
        ),
        (
            with(json!({"tools": [{"type": "retrieval", "function": {"name": "f"}}]})),
            400,
            Some("tools[0].type"),
        ),
        (
            with(
                json!({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}]}),
            ),
            400,
            Some("tools[0].function.parameters"),
        ),
        (
            with(
                json!({"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]}),
            ),
            400,
            Some("tools[0].function.parameters"),
        ),
        (
            with(
                json!({"tools": [{"type": "function", "function": {"name": "f"}}, {"type": "function", "function": {"name": "f"}}]}),
            ),
            400,
            Some("tools[1].function.name"),
        ),
        (
            with(json!({"tool_choice": "required"})),
            400,
            Some("tool_choice"),
        ),
        (
            with(
                json!({"tool_choice": "sometimes", "tools": [{"type": "function", "function": {"name": "f"}}]}),
            ),
            400,
            Some("tool_choice"),
        ),
        (
            with(
                json!({"tool_choice": {"type": "function", "function": {"name": "g"}}, "tools": [{"type": "function", "function": {"name": "f"}}]}),
            ),
            400,
            Some("tool_choice"),
        ),
        (
            with(
                json!({"tool_choice": "required", "tools": [{"type": "function", "function": {"name": "f"}}], "response_format": {"type": "json_object"}}),
            ),
            400,
            Some("response_format"),
        ),
        (
            with(json!({"response_format": {"type": "yaml"}})),
            400,
            Some("response_format"),
        ),
        (
            with(json!({"response_format": "json"})),
            400,
            Some("response_format"),
        ),
        (
            with(json!({"response_format": {"type": "json_schema"}})),
            400,
            Some("response_format.json_schema"),
        ),
        (
            with(
                json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 5}}}}),
            ),
            400,
            Some("response_format"),
        ),
        (with(json!({"best_of": 3})), 400, Some("best_of")),
    ]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_chat_requests_get_openai_errors() {
    let server = start().await;
    for (body, status, param) in chat_cases() {
        let resp = post(server.addr, "/v1/chat/completions", &body).await;
        assert_eq!(resp.status, status, "{body} → {}", resp.text());
        let err = resp.expect_error(status);
        if status == 400 {
            assert_eq!(err["type"], "invalid_request_error", "{err}");
        }
        assert_eq!(err["param"].as_str(), param, "{body} → {err}");
    }
    // Over-long prompts say so.
    let long =
        json!({"model": MODEL, "messages": [{"role": "user", "content": "word ".repeat(3000)}]});
    let err = post(server.addr, "/v1/chat/completions", &long)
        .await
        .expect_error(400);
    assert_eq!(err["code"], "context_length_exceeded");
    let healthy = post(
        server.addr,
        "/v1/chat/completions",
        &chat("still alive?", 2),
    )
    .await;
    assert_eq!(healthy.status, 200, "{}", healthy.text());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_completion_requests_get_openai_errors() {
    let server = start().await;
    let cases: Vec<(Value, u16, Option<&str>)> = vec![
        (json!({"model": MODEL}), 400, Some("prompt")),
        (json!({"model": MODEL, "prompt": ""}), 400, Some("prompt")),
        (json!({"model": MODEL, "prompt": []}), 400, Some("prompt")),
        (
            json!({"model": MODEL, "prompt": [1, "a"]}),
            400,
            Some("prompt"),
        ),
        (json!({"model": MODEL, "prompt": [-1]}), 400, Some("prompt")),
        (
            json!({"model": MODEL, "prompt": [5000000]}),
            400,
            Some("prompt"),
        ),
        (
            json!({"model": MODEL, "prompt": [[1], "a"]}),
            400,
            Some("prompt"),
        ),
        (
            json!({"model": MODEL, "prompt": {"text": "a"}}),
            400,
            Some("prompt"),
        ),
        (
            json!({"model": MODEL, "prompt": "a", "max_tokens": 0}),
            400,
            Some("max_tokens"),
        ),
        (
            json!({"model": MODEL, "prompt": "a", "logprobs": 50}),
            400,
            Some("logprobs"),
        ),
        (
            json!({"model": MODEL, "prompt": "a", "echo": 1}),
            400,
            Some("echo"),
        ),
        (
            json!({"model": MODEL, "prompt": "a", "suffix": "b"}),
            400,
            Some("suffix"),
        ),
        (
            json!({"model": MODEL, "prompt": vec![7; MAX_MODEL_LEN]}),
            400,
            Some("prompt"),
        ),
        (
            json!({"model": MODEL, "prompt": "a", "max_tokens": MAX_MODEL_LEN}),
            400,
            Some("prompt"),
        ),
        (json!({"model": "nope", "prompt": "a"}), 404, Some("model")),
    ];
    for (body, status, param) in cases {
        let resp = post(server.addr, "/v1/completions", &body).await;
        let err = resp.expect_error(status);
        assert_eq!(err["param"].as_str(), param, "{body} → {err}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn routing_errors_are_json() {
    let server = start().await;
    get(server.addr, "/v2/nothing").await.expect_error(404);
    get(server.addr, "/v1/chat/completions")
        .await
        .expect_error(405);
    let err = post_bytes(server.addr, "/v1/chat/completions", b"{not json")
        .await
        .expect_error(400);
    assert_eq!(err["type"], "invalid_request_error");
    post_bytes(server.addr, "/v1/chat/completions", b"[1, 2]")
        .await
        .expect_error(400);
    post_bytes(server.addr, "/v1/chat/completions", b"")
        .await
        .expect_error(400);
}

/// OpenAI's and vLLM's statuses: 404 for a model the server does not serve, 415 for a
/// body that is not JSON (a browser form or `text/plain` POST, as a cross-site page could
/// send without a preflight), 413 past the body limit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_codes_follow_openai() {
    let server = start().await;
    let body = serde_json::to_vec(&chat("hi", 2)).expect("json");
    for path in ["/v1/chat/completions", "/v1/completions", "/tokenize"] {
        for content_type in [
            "text/plain",
            "application/x-www-form-urlencoded",
            "multipart/form-data; boundary=x",
        ] {
            let resp = request(
                server.addr,
                "POST",
                path,
                &[("Content-Type", content_type)],
                &body,
            )
            .await;
            let err = resp.expect_error(415);
            assert_eq!(
                err["code"], "unsupported_media_type",
                "{path} {content_type}"
            );
        }
    }
    let with_charset = request(
        server.addr,
        "POST",
        "/v1/chat/completions",
        &[("Content-Type", "application/json; charset=utf-8")],
        &body,
    )
    .await;
    assert_eq!(with_charset.status, 200, "{}", with_charset.text());
    let no_type = request(server.addr, "POST", "/v1/chat/completions", &[], &body).await;
    assert_eq!(no_type.status, 200, "{}", no_type.text());
    let mut other = chat("hi", 2);
    other["model"] = json!("gpt-4o");
    let err = post(server.addr, "/v1/chat/completions", &other)
        .await
        .expect_error(404);
    assert_eq!(err["code"], "model_not_found");
    let err = post(
        server.addr,
        "/v1/completions",
        &json!({"model": "nope", "prompt": "x"}),
    )
    .await
    .expect_error(404);
    assert_eq!(err["code"], "model_not_found");
    // Past the 32 MiB limit: the answer may come before the client has sent it all.
    let raw = build_request(
        "POST",
        "/v1/chat/completions",
        &[("Content-Type", "application/json")],
        &vec![b' '; 33 << 20],
    );
    let (mut rd, mut wr) = tokio::net::TcpStream::connect(server.addr)
        .await
        .expect("connect")
        .into_split();
    let writer = tokio::spawn(async move {
        use tokio::io::AsyncWriteExt;
        let _ = wr.write_all(&raw).await;
    });
    let mut out = Vec::new();
    let _ = tokio::time::timeout(
        std::time::Duration::from_secs(60),
        tokio::io::AsyncReadExt::read_to_end(&mut rd, &mut out),
    )
    .await;
    writer.abort();
    let err = parse_response(&out).expect_error(413);
    assert_eq!(err["code"], "payload_too_large");
}

/// Raw requests: broken HTTP, broken JSON, hostile values. Each gets an answer (or a
/// closed connection) quickly, and the server keeps serving.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_corpus_never_crashes_or_hangs() {
    let server = start().await;
    let chat_path = "/v1/chat/completions";
    let json_bodies: Vec<Vec<u8>> = vec![
        b"".to_vec(),
        b"null".to_vec(),
        b"true".to_vec(),
        b"\"string\"".to_vec(),
        b"{\"messages\": [".to_vec(),
        b"{\"messages\": [{\"role\": \"user\", \"content\": \"\\ud800\"}]}".to_vec(),
        b"{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}], \"max_tokens\": 1e400}".to_vec(),
        b"{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}], \"temperature\": NaN}".to_vec(),
        b"{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}], \"seed\": 99999999999999999999999}".to_vec(),
        vec![0xff, 0xfe, 0x00, 0x01],
        format!("{{\"messages\": {}}}", "[".repeat(5000)).into_bytes(),
        format!("{{\"messages\": [{{\"role\": \"user\", \"content\": \"{}\"}}], \"max_tokens\": 1}}", "\u{1F600}".repeat(200)).into_bytes(),
        b"{\"messages\": [{\"role\": \"user\", \"content\": \"<|im_end|><|tool_calls_section_begin|>\"}], \"max_tokens\": 2}".to_vec(),
        b"{\"messages\": [{\"role\": \"user\", \"content\": null}]}".to_vec(),
        b"{\"messages\": [{\"role\": \"assistant\", \"content\": null}], \"max_tokens\": 2}".to_vec(),
        b"{\"messages\": [{\"role\": \"assistant\", \"tool_calls\": [{\"function\": {\"name\": 5}}]}]}".to_vec(),
        b"{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}], \"tools\": [{\"type\": \"function\", \"function\": {\"name\": \"f\", \"parameters\": {\"$ref\": \"#/nowhere\"}}}], \"tool_choice\": \"required\"}".to_vec(),
        b"{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}], \"response_format\": {\"type\": \"json_schema\", \"json_schema\": {\"schema\": {\"type\": \"string\", \"pattern\": \"(((\"}}}}".to_vec(),
        b"{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}], \"response_format\": {\"type\": \"json_schema\", \"json_schema\": {\"schema\": {\"allOf\": [{\"type\": \"string\"}, {\"type\": \"integer\"}]}}}}".to_vec(),
        b"{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}], \"logit_bias\": {\"1\": \"x\"}}".to_vec(),
        b"{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}], \"n\": 2.5}".to_vec(),
        b"{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}], \"stop\": [null]}".to_vec(),
        b"{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}], \"stream_options\": 5, \"stream\": true}".to_vec(),
        b"{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}], \"tools\": [null]}".to_vec(),
        b"{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}], \"tool_choice\": 5}".to_vec(),
        b"{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}], \"messages\": 5}".to_vec(),
        b"{\"model\": null, \"messages\": [{\"role\": \"user\", \"name\": 5, \"content\": \"hi\"}]}".to_vec(),
        b"{\"messages\": [{\"role\": \"tool\", \"content\": \"x\", \"tool_call_id\": []}]}".to_vec(),
        b"{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}], \"max_tokens\": 1, \"top_k\": 100000000000}".to_vec(),
        b"{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}], \"max_tokens\": 1, \"add_generation_prompt\": \"no\"}".to_vec(),
    ];
    let mut raws: Vec<(Vec<u8>, bool)> = json_bodies
        .iter()
        .map(|b| {
            (
                build_request(
                    "POST",
                    chat_path,
                    &[("Content-Type", "application/json")],
                    b,
                ),
                false,
            )
        })
        .collect();
    for body in [
        &b"{\"prompt\": [[[1]]]}"[..],
        b"{\"prompt\": 1e9}",
        b"{\"prompt\": [1.5]}",
        b"{\"prompt\": \"x\", \"n\": 128, \"max_tokens\": 1, \"best_of\": 128}",
    ] {
        raws.push((build_request("POST", "/v1/completions", &[], body), false));
    }
    for body in [
        &b"{\"tokens\": [1, -1]}"[..],
        b"{\"tokens\": \"abc\"}",
        b"{}",
        b"{\"tokens\": [1e30]}",
    ] {
        raws.push((build_request("POST", "/detokenize", &[], body), false));
    }
    for body in [
        &b"{\"prompt\": null}"[..],
        b"{\"messages\": [{\"role\": \"user\"}]}",
        b"{\"prompt\": \"x\", \"return_token_strs\": 1}",
    ] {
        raws.push((build_request("POST", "/tokenize", &[], body), false));
    }
    for body in [
        &b"{\"prompt\": \"x\", \"max_tokens\": 2, \"logprobs\": 20, \"echo\": true, \"stream\": true}"[..],
        b"{\"prompt\": [[]]}",
        b"{\"prompt\": \"x\", \"stop\": \"\", \"max_tokens\": 2}",
        b"{\"prompt\": \"\\u0000\", \"max_tokens\": 2}",
    ] {
        raws.push((build_request("POST", "/v1/completions", &[], body), false));
    }
    // Broken HTTP itself.
    raws.extend([
        (b"GARBAGE\r\n\r\n".to_vec(), true),
        (
            b"POST /v1/chat/completions HTTP/1.1\r\nContent-Length: 100\r\n\r\n{\"a\"".to_vec(),
            true,
        ),
        (
            b"POST /v1/chat/completions HTTP/1.1\r\nContent-Length: -4\r\n\r\n".to_vec(),
            true,
        ),
        (
            b"POST /v1/chat/completions HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n"
                .to_vec(),
            true,
        ),
        (b"GET / HTTP/9.9\r\n\r\n".to_vec(), true),
        (b"\x00\x01\x02\x03\x04".to_vec(), true),
        (
            format!("GET /{} HTTP/1.1\r\nHost: x\r\n\r\n", "a".repeat(100_000)).into_bytes(),
            true,
        ),
        (
            format!("GET / HTTP/1.1\r\nX: {}\r\n\r\n", "b".repeat(200_000)).into_bytes(),
            true,
        ),
        (
            build_request(
                "POST",
                chat_path,
                &[("Content-Type", "text/plain")],
                b"hello",
            ),
            false,
        ),
        (
            build_request("POST", chat_path, &[], &vec![b'{'; 40 << 20]),
            false,
        ),
    ]);
    assert!(raws.len() >= 50, "corpus has {} cases", raws.len());
    for (raw, close_write) in &raws {
        let started = std::time::Instant::now();
        if let Some(out) = send_raw(server.addr, raw, *close_write).await {
            let head = String::from_utf8_lossy(&out[..out.len().min(12)]).into_owned();
            if head.starts_with("HTTP/1.1 ") {
                let status: u16 = head[9..12].parse().unwrap_or(0);
                assert!(
                    status != 500 && status != 0,
                    "{status} for {:?}",
                    String::from_utf8_lossy(&raw[..raw.len().min(200)])
                );
            }
        }
        assert!(started.elapsed().as_secs() < 60);
    }
    let resp = post(
        server.addr,
        "/v1/chat/completions",
        &chat("still alive?", 2),
    )
    .await;
    assert_eq!(resp.status, 200, "{}", resp.text());
    let metrics = get(server.addr, "/metrics").await.text();
    assert_eq!(
        metric(&metrics, "kimi:num_requests_pending", ""),
        Some(0.0),
        "{metrics}"
    );
}
