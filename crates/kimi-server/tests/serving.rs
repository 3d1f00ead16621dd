//! The server under load: client disconnects free their sequences, concurrent greedy
//! requests equal the same requests alone, overload gives 429, timeouts give 408.

use crate::common;

use std::time::{Duration, Instant};

use common::*;
use serde_json::json;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

async fn wait_for_metric(server: &TestServer, name: &str, filter: &str, want: f64) -> String {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let text = get(server.addr, "/metrics").await.text();
        if metric(&text, name, filter) == Some(want) {
            return text;
        }
        assert!(
            Instant::now() < deadline,
            "{name}{{{filter}}} never became {want}:\n{text}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_disconnect_cancels_the_sequence() {
    let server = start().await;
    for streaming in [true, false] {
        let mut body = chat("Talk for a long time", MAX_MODEL_LEN - 64);
        body["ignore_eos"] = json!(true);
        body["stream"] = json!(streaming);
        let bytes = serde_json::to_vec(&body).expect("json");
        let raw = build_request("POST", "/v1/chat/completions", &[], &bytes);
        let mut stream = TcpStream::connect(server.addr).await.expect("connect");
        stream.write_all(&raw).await.expect("send");
        if streaming {
            // Read until some tokens have arrived, then hang up.
            let mut seen = Vec::new();
            let mut buf = [0u8; 4096];
            while seen.windows(7).filter(|w| w == b"content").count() < 3 {
                let n = stream.read(&mut buf).await.expect("read");
                assert!(n > 0, "stream ended early");
                seen.extend_from_slice(&buf[..n]);
            }
        } else {
            wait_for_metric(&server, "vllm:num_requests_running", "", 1.0).await;
        }
        drop(stream);
        let text = wait_for_metric(&server, "kimi:num_requests_pending", "", 0.0).await;
        let aborted = if streaming { 1.0 } else { 2.0 };
        wait_for_metric(&server, "vllm:request_success_total", "abort", aborted).await;
        wait_for_metric(&server, "vllm:num_requests_running", "", 0.0).await;
        let generated = metric(&text, "vllm:generation_tokens_total", "").unwrap_or(0.0);
        assert!(generated < (MAX_MODEL_LEN - 64) as f64 * aborted, "{text}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_greedy_requests_equal_sequential_ones() {
    let server = start().await;
    let prompts: Vec<String> = (0..32)
        .map(|i| format!("Request number {i}: {}", "go ".repeat(i % 7)))
        .collect();
    let body = |p: &str| {
        let mut b = chat(p, 12);
        b["ignore_eos"] = json!(true);
        b
    };
    let mut alone = Vec::new();
    for p in &prompts {
        let resp = post(server.addr, "/v1/chat/completions", &body(p)).await;
        assert_eq!(resp.status, 200, "{}", resp.text());
        alone.push(resp.json()["choices"][0]["message"]["content"].clone());
    }
    let tasks: Vec<_> = prompts
        .iter()
        .map(|p| {
            let addr = server.addr;
            let b = body(p);
            tokio::spawn(async move { post(addr, "/v1/chat/completions", &b).await })
        })
        .collect();
    for (i, task) in tasks.into_iter().enumerate() {
        let resp = task.await.expect("task");
        assert_eq!(resp.status, 200, "{}", resp.text());
        assert_eq!(
            resp.json()["choices"][0]["message"]["content"],
            alone[i],
            "prompt {i}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn overload_is_refused_with_429() {
    let mut config = server_config();
    config.max_pending_requests = 2;
    let server = start_with(config, serving_config()).await;
    let mut body = chat("Long one", MAX_MODEL_LEN - 64);
    body["ignore_eos"] = json!(true);
    body["n"] = json!(2);
    let addr = server.addr;
    let busy = tokio::spawn(async move { post(addr, "/v1/chat/completions", &body).await });
    wait_for_metric(&server, "kimi:num_requests_pending", "", 2.0).await;
    let err = post(server.addr, "/v1/chat/completions", &chat("one more", 2))
        .await
        .expect_error(429);
    assert_eq!(err["code"], "rate_limit_exceeded");
    busy.abort();
    let _ = busy.await;
    wait_for_metric(&server, "kimi:num_requests_pending", "", 0.0).await;
    let ok = post(server.addr, "/v1/chat/completions", &chat("now fine", 2)).await;
    assert_eq!(ok.status, 200, "{}", ok.text());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn request_timeout_gives_408_and_frees_the_sequence() {
    let mut config = server_config();
    config.request_timeout = Some(Duration::from_millis(300));
    let server = start_with(config, serving_config()).await;
    let mut body = chat("Long one", MAX_MODEL_LEN - 64);
    body["ignore_eos"] = json!(true);
    let err = post(server.addr, "/v1/chat/completions", &body)
        .await
        .expect_error(408);
    assert_eq!(err["code"], "request_timeout");
    body["stream"] = json!(true);
    let resp = post(server.addr, "/v1/chat/completions", &body).await;
    assert_eq!(resp.status, 200);
    assert!(resp.text().contains("request_timeout"), "{}", resp.text());
    wait_for_metric(&server, "kimi:num_requests_pending", "", 0.0).await;
}
