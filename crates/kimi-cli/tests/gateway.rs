//! `kimi-infer gateway` in front of real `kimi-infer serve` replicas: routing, streaming,
//! merged models, affinity, a replica killed mid-stream or before it answers, a replica that
//! hangs, and a client that leaves.

use crate::support;

use std::collections::HashSet;
use std::time::Duration;

use serde_json::{json, Value};
use support::{client, eventually, gateway, get, metric, post, replica, Stream};

/// The text of a chat answer or of a stream's deltas.
fn content(answer: &Value) -> String {
    answer["choices"][0]["message"]["content"]
        .as_str()
        .unwrap_or("")
        .to_string()
}

fn stream_text(events: &[Value]) -> String {
    events
        .iter()
        .filter_map(|e| e["choices"][0]["delta"]["content"].as_str())
        .collect()
}

fn long_stream(prompt: &str) -> Value {
    json!({
        "model": "kimi-demo",
        "prompt": prompt,
        "max_tokens": 30000,
        "ignore_eos": true,
        "temperature": 0,
        "stream": true,
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_replicas_behind_one_address() {
    let (r1, r2) = (replica(0, &[]), replica(0, &[]));
    let gw = gateway(&[r1.url(), r2.url()], &[]);
    let c = client();
    let base = gw.url();
    let chat_url = format!("{base}/v1/chat/completions");

    let models = get(&c, &format!("{base}/v1/models")).await.json();
    let ids: Vec<&str> = models["data"]
        .as_array()
        .expect("list")
        .iter()
        .filter_map(|m| m["id"].as_str())
        .collect();
    assert_eq!(ids, ["kimi-demo"], "merged once: {models}");

    // A JSON answer, with the client's request id passed through to the replica's log.
    let plain = post(
        &c,
        &chat_url,
        &support::chat("Name a colour.", 12, false),
        &[("x-request-id", "trace-abc-123")],
    )
    .await;
    assert_eq!(plain.status, 200, "{}", plain.text);
    assert_eq!(plain.header("x-request-id"), Some("trace-abc-123"));
    let upstream = plain.header("x-kimi-upstream").expect("upstream header");
    assert!(upstream == r1.url() || upstream == r2.url(), "{upstream}");
    let answer = plain.json();
    let replica_logs = r1.log() + &r2.log();
    assert!(
        replica_logs.contains("request_id=trace-abc-123"),
        "the request id reaches the replica"
    );

    // The same request streamed: the same text (greedy, same weights on both replicas),
    // `[DONE]` last, and no usage chunk the client did not ask for.
    let streamed = post(
        &c,
        &chat_url,
        &support::chat("Name a colour.", 12, true),
        &[],
    )
    .await;
    assert_eq!(streamed.status, 200);
    assert_eq!(
        streamed.header("content-type"),
        Some("text/event-stream"),
        "{}",
        streamed.text
    );
    let events = streamed.events();
    assert_eq!(stream_text(&events), content(&answer));
    assert!(
        events
            .iter()
            .all(|e| e["choices"].as_array().is_some_and(|c| !c.is_empty())),
        "no usage chunk: {}",
        streamed.text
    );
    let mut with_usage = support::chat("Name a colour.", 12, true);
    with_usage["stream_options"] = json!({"include_usage": true});
    let events = post(&c, &chat_url, &with_usage, &[]).await.events();
    let usage = &events.last().expect("events")["usage"];
    assert_eq!(
        usage["completion_tokens"],
        answer["usage"]["completion_tokens"]
    );

    // Concurrent streams spread over both replicas (least outstanding requests).
    let streams = (0..6).map(|i| {
        let c = c.clone();
        let url = format!("{base}/v1/completions");
        async move {
            let mut body = long_stream(&format!("spread {i}"));
            body["max_tokens"] = json!(400);
            post(&c, &url, &body, &[]).await
        }
    });
    let answers = futures_util::future::join_all(streams).await;
    let used: HashSet<String> = answers
        .iter()
        .map(|a| {
            assert_eq!(a.status, 200, "{}", a.text);
            assert!(a.events().len() > 10, "{}", a.text);
            a.header("x-kimi-upstream").expect("upstream").to_string()
        })
        .collect();
    assert_eq!(used.len(), 2, "both replicas served: {used:?}");

    // Conversation affinity: each second turn goes where its first turn went.
    let mut firsts = Vec::new();
    for k in 0..4 {
        let turn1 = json!({"model": "kimi-demo", "max_tokens": 4, "temperature": 0,
            "messages": [{"role": "user", "content": format!("conversation {k}")}]});
        let a = post(&c, &chat_url, &turn1, &[]).await;
        firsts.push((
            turn1,
            a.json(),
            a.header("x-kimi-upstream").map(str::to_owned),
        ));
    }
    for (turn1, reply, upstream) in firsts.iter().rev() {
        let mut turn2 = turn1.clone();
        let messages = turn2["messages"].as_array_mut().expect("messages");
        messages.push(reply["choices"][0]["message"].clone());
        messages.push(json!({"role": "user", "content": "and then?"}));
        let a = post(&c, &chat_url, &turn2, &[]).await;
        assert_eq!(a.header("x-kimi-upstream").map(str::to_owned), *upstream);
    }
    // A session header pins requests with different messages.
    let mut pinned = HashSet::new();
    for k in 0..4 {
        let a = post(
            &c,
            &chat_url,
            &support::chat(&format!("message {k}"), 2, false),
            &[("x-session-id", "session-7")],
        )
        .await;
        pinned.insert(a.header("x-kimi-upstream").map(str::to_owned));
    }
    assert_eq!(pinned.len(), 1, "{pinned:?}");

    let text = get(&c, &format!("{base}/metrics")).await.text;
    for r in [&r1, &r2] {
        let healthy = format!("kimi:gateway_upstream_healthy{{upstream=\"{}\"}}", r.url());
        assert_eq!(metric(&text, &healthy), Some(1.0), "{text}");
    }
    assert!(metric(&text, "kimi:gateway_affinity_total{result=\"hit\"}").unwrap_or(0.0) >= 7.0);
    assert!(text.contains("kimi:gateway_upstream_request_seconds_bucket{upstream="));
    assert!(text.contains(",status=\"200\"} "));
    // Other paths go to an upstream as they are; a wrong method is OpenAI's 405.
    let tokens = post(
        &c,
        &format!("{base}/tokenize"),
        &json!({"prompt": "hello"}),
        &[],
    )
    .await;
    assert_eq!(tokens.status, 200, "{}", tokens.text);
    assert!(tokens.json()["tokens"].is_array(), "{}", tokens.text);
    let wrong = get(&c, &chat_url).await;
    assert_eq!(wrong.status, 405);
    assert_eq!(wrong.json()["error"]["type"], "invalid_request_error");
    let health = get(&c, &format!("{base}/health")).await;
    assert_eq!(health.status, 200);
    assert_eq!(health.json()["healthy_upstreams"], 2);
    let log = gw.log_with(&["kimi_gateway::access", "request_id=trace-abc-123"]);
    assert!(
        log.contains("kimi_gateway::access") && log.contains("request_id=trace-abc-123"),
        "{log}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_killed_mid_stream() {
    let (r1, r2) = (replica(0, &[]), replica(0, &[]));
    let gw = gateway(&[r1.url(), r2.url()], &[]);
    let c = client();
    let base = gw.url();
    let mut replicas = [r1, r2];
    let mut stream =
        Stream::open(&c, &format!("{base}/v1/completions"), &long_stream("kill")).await;
    assert_eq!(stream.status, 200);
    for _ in 0..3 {
        let data = stream.next().await.expect("tokens arrive");
        assert!(data.contains("\"text\""), "{data}");
    }
    let victim_url = stream.upstream.clone().expect("upstream header");
    let victim = replicas
        .iter()
        .position(|r| r.url() == victim_url)
        .expect("one of ours");
    let port = replicas[victim].addr.port();
    replicas[victim].kill();

    // The client's stream ends with an error event and [DONE], not a hang or a bare cut.
    let mut error = None;
    let ended = tokio::time::timeout(Duration::from_secs(20), async {
        while let Some(data) = stream.next().await {
            if data == "[DONE]" {
                return true;
            }
            if data.contains("\"error\"") {
                error = Some(data);
            }
        }
        false
    })
    .await;
    assert_eq!(ended, Ok(true), "the stream ends with [DONE]");
    let error: Value = serde_json::from_str(&error.expect("an error event")).expect("JSON");
    assert_eq!(error["error"]["code"], "upstream_failed", "{error}");

    // The dead replica is out; requests go to the other one.
    let text = get(&c, &format!("{base}/metrics")).await.text;
    let healthy = format!("kimi:gateway_upstream_healthy{{upstream=\"{victim_url}\"}}");
    assert_eq!(metric(&text, &healthy), Some(0.0), "{text}");
    for i in 0..4 {
        let a = post(
            &c,
            &format!("{base}/v1/chat/completions"),
            &support::chat(&format!("after {i}"), 4, i % 2 == 0),
            &[],
        )
        .await;
        assert_eq!(a.status, 200, "{}", a.text);
        assert_ne!(a.header("x-kimi-upstream"), Some(victim_url.as_str()));
    }

    // A replica started again on the same port comes back.
    replicas[victim] = replica(port, &[]);
    let back = eventually(Duration::from_secs(20), async || {
        let text = get(&c, &format!("{base}/metrics")).await.text;
        metric(&text, &healthy) == Some(1.0)
    })
    .await;
    assert!(
        back,
        "the restarted replica is healthy again:\n{}",
        gw.log()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_replica_is_retried_before_any_output() {
    let (mut r1, r2) = (replica(0, &[]), replica(0, &[]));
    // Probes rarely: the gateway learns of the death from the requests themselves.
    let gw = gateway(&[r1.url(), r2.url()], &["--health-interval", "60"]);
    let c = client();
    let base = gw.url();
    let dead = r1.url();
    r1.kill();
    for i in 0..4 {
        let a = post(
            &c,
            &format!("{base}/v1/chat/completions"),
            &support::chat(&format!("retry {i}"), 4, i % 2 == 1),
            &[],
        )
        .await;
        assert_eq!(a.status, 200, "{}", a.text);
        assert_eq!(a.header("x-kimi-upstream"), Some(r2.url().as_str()));
        if i % 2 == 1 {
            assert!(!a.events().is_empty());
        }
    }
    let text = get(&c, &format!("{base}/metrics")).await.text;
    assert!(
        metric(&text, "kimi:gateway_retries_total").unwrap_or(0.0) >= 1.0,
        "{text}"
    );
    let errors =
        format!("kimi:gateway_upstream_errors_total{{upstream=\"{dead}\",kind=\"connect\"}}");
    assert_eq!(metric(&text, &errors), Some(1.0), "ejected at once: {text}");
    let log = gw.log_with(&["attempts=2"]);
    assert!(log.contains("attempts=2"), "{log}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_that_hangs() {
    let (r1, r2) = (replica(0, &[]), replica(0, &[]));
    let gw = gateway(&[r1.url(), r2.url()], &[]);
    let c = client();
    let base = gw.url();
    let chat_url = format!("{base}/v1/chat/completions");
    let healthy =
        |r: &support::Proc| format!("kimi:gateway_upstream_healthy{{upstream=\"{}\"}}", r.url());

    // Requests sent while r1 hangs (before and after the probes notice) all succeed.
    r1.signal("STOP");
    let requests = (0..6).map(|i| {
        let (c, url) = (c.clone(), chat_url.clone());
        async move {
            post(
                &c,
                &url,
                &support::chat(&format!("hang {i}"), 4, i % 2 == 0),
                &[],
            )
            .await
        }
    });
    let answers = tokio::time::timeout(
        Duration::from_secs(30),
        futures_util::future::join_all(requests),
    )
    .await
    .expect("no request hangs with the replica");
    for a in &answers {
        assert_eq!(a.status, 200, "{}", a.text);
        assert_eq!(a.header("x-kimi-upstream"), Some(r2.url().as_str()));
    }
    let text = get(&c, &format!("{base}/metrics")).await.text;
    assert_eq!(metric(&text, &healthy(&r1)), Some(0.0), "{text}");

    // Back when it answers again.
    r1.signal("CONT");
    let back = eventually(Duration::from_secs(20), async || {
        metric(
            &get(&c, &format!("{base}/metrics")).await.text,
            &healthy(&r1),
        ) == Some(1.0)
    })
    .await;
    assert!(back, "{}", gw.log());

    // A replica that hangs mid-stream: the stream ends with an error once it is ejected
    // and has sent nothing for a grace period.
    let mut stream =
        Stream::open(&c, &format!("{base}/v1/completions"), &long_stream("hang")).await;
    for _ in 0..3 {
        stream.next().await.expect("tokens arrive");
    }
    let url = stream.upstream.clone().expect("upstream");
    let hung = if url == r1.url() { &r1 } else { &r2 };
    hung.signal("STOP");
    let outcome = tokio::time::timeout(Duration::from_secs(30), async {
        let mut error = false;
        while let Some(data) = stream.next().await {
            error |= data.contains("upstream_failed");
            if data == "[DONE]" {
                return error;
            }
        }
        false
    })
    .await;
    hung.signal("CONT");
    assert_eq!(outcome, Ok(true), "an error event, then [DONE]");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_leaves_cancels_the_upstream_request() {
    let r1 = replica(0, &[]);
    let gw = gateway(&[r1.url()], &[]);
    let c = client();
    let mut stream = Stream::open(
        &c,
        &format!("{}/v1/completions", gw.url()),
        &long_stream("leave"),
    )
    .await;
    for _ in 0..3 {
        stream.next().await.expect("tokens arrive");
    }
    let running = |text: &str| metric(text, "vllm:num_requests_running{model_name=\"kimi-demo\"}");
    let text = get(&c, &format!("{}/metrics", r1.url())).await.text;
    assert_eq!(running(&text), Some(1.0), "{text}");
    drop(stream);
    let cancelled = eventually(Duration::from_secs(10), async || {
        running(&get(&c, &format!("{}/metrics", r1.url())).await.text) == Some(0.0)
    })
    .await;
    assert!(cancelled, "the replica stopped generating:\n{}", r1.log());
    let idle = eventually(Duration::from_secs(5), async || {
        let text = get(&c, &format!("{}/metrics", gw.url())).await.text;
        let series = format!(
            "kimi:gateway_upstream_outstanding_requests{{upstream=\"{}\"}}",
            r1.url()
        );
        metric(&text, &series) == Some(0.0)
    })
    .await;
    assert!(idle);
    let aborted = eventually(Duration::from_secs(5), async || {
        gw.log().contains("aborted=true") && r1.log().contains("aborted=true")
    })
    .await;
    assert!(
        aborted,
        "both access logs say the stream was cut:\n{}",
        gw.log()
    );
}
