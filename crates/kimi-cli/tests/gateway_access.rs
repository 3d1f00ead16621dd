//! Who gets in and how often, in `kimi-infer gateway` and `serve`: named keys from a file,
//! per-key limits answered with 429 and Retry-After (in memory, and shared through a real
//! `redis-server`), the response cache (in memory and in Redis), TLS with a certificate
//! made here, and CORS.

use crate::support;

use std::time::Duration;

use serde_json::{json, Value};
use support::{chat, client, eventually, gateway, get, metric, post, replica, Redis};

fn key_file(dir: &tempfile::TempDir, text: &str) -> String {
    let path = dir.path().join("keys.txt");
    std::fs::write(&path, text).expect("write keys");
    path.display().to_string()
}

/// Asserts a 429 in OpenAI's shape and returns its Retry-After.
fn expect_429(a: &support::Answer) -> u64 {
    assert_eq!(a.status, 429, "{}", a.text);
    let err = &a.json()["error"];
    assert_eq!(err["type"], "rate_limit_error", "{err}");
    assert_eq!(err["code"], "rate_limit_exceeded", "{err}");
    a.header("retry-after")
        .and_then(|v| v.parse().ok())
        .expect("Retry-After in seconds")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_and_limits_in_the_gateway() {
    support::clear_of_minute_end();
    let dir = tempfile::tempdir().expect("tempdir");
    let keys = key_file(
        &dir,
        "# name key limits\nalice sk-alice rpm=2\nbob sk-bob concurrency=1\ncarol sk-carol tpm=5\n",
    );
    let r1 = replica(0, &[]);
    let gw = gateway(
        &[r1.url()],
        &["--api-key-file", &keys, "--api-key", "sk-plain"],
    );
    let c = client();
    let url = format!("{}/v1/chat/completions", gw.url());
    let auth = |key: &str| format!("Bearer {key}");

    let anonymous = post(&c, &url, &chat("hi", 2, false), &[]).await;
    assert_eq!(anonymous.status, 401, "{}", anonymous.text);
    let models = get(&c, &format!("{}/v1/models", gw.url())).await;
    assert_eq!(models.status, 401);
    let plain = post(
        &c,
        &url,
        &chat("hi", 2, false),
        &[("authorization", &auth("sk-plain"))],
    )
    .await;
    assert_eq!(plain.status, 200, "an unlimited --api-key: {}", plain.text);

    // alice: 2 requests per minute.
    let alice = [("authorization", auth("sk-alice"))];
    let alice: Vec<(&str, &str)> = alice.iter().map(|(k, v)| (*k, v.as_str())).collect();
    for _ in 0..2 {
        assert_eq!(
            post(&c, &url, &chat("hi", 2, false), &alice).await.status,
            200
        );
    }
    let retry = expect_429(&post(&c, &url, &chat("hi", 2, false), &alice).await);
    assert!((1..=60).contains(&retry), "{retry}");

    // bob: one request in flight.
    let bob_key = auth("sk-bob");
    let held = c
        .post(format!("{}/v1/completions", gw.url()))
        .header("authorization", &bob_key)
        .json(&json!({"prompt": "x", "max_tokens": 30000, "ignore_eos": true, "stream": true}))
        .send()
        .await
        .expect("stream opens");
    assert_eq!(held.status(), 200);
    let bob = [("authorization", bob_key.as_str())];
    let busy = post(&c, &url, &chat("hi", 2, false), &bob).await;
    assert_eq!(expect_429(&busy), 1);
    drop(held);
    let freed = eventually(Duration::from_secs(10), async || {
        post(&c, &url, &chat("hi", 2, false), &bob).await.status == 200
    })
    .await;
    assert!(freed, "the slot is freed when the stream ends");

    // carol: 5 tokens per minute; her first request spends more.
    let carol_key = auth("sk-carol");
    let carol = [("authorization", carol_key.as_str())];
    assert_eq!(
        post(&c, &url, &chat("hello there", 4, true), &carol)
            .await
            .status,
        200
    );
    let spent = post(&c, &url, &chat("hi", 2, false), &carol).await;
    assert!(expect_429(&spent) >= 1);
    assert!(spent.json()["error"]["message"]
        .as_str()
        .is_some_and(|m| m.contains("5 tokens per minute")));

    let text = get(&c, &format!("{}/metrics", gw.url())).await.text;
    for (key, limit) in [
        ("alice", "requests"),
        ("bob", "concurrency"),
        ("carol", "tokens"),
    ] {
        let series = format!("kimi:rate_limited_requests_total{{key=\"{key}\",limit=\"{limit}\"}}");
        // bob's may count a retry made before the gateway saw his stream close.
        assert!(
            metric(&text, &series).unwrap_or(0.0) >= 1.0,
            "{series}: {text}"
        );
    }
    let log = gw.log_with(&["key=alice", "key=key-1"]);
    assert!(
        log.contains("key=alice") && log.contains("key=key-1"),
        "{log}"
    );
    assert!(!log.contains("sk-alice"), "a key leaked into the log");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_takes_named_keys_and_limits() {
    support::clear_of_minute_end();
    let dir = tempfile::tempdir().expect("tempdir");
    let keys = key_file(&dir, "alice sk-alice rpm=1\n");
    let r1 = replica(
        0,
        &["--api-key-file", &keys, "--max-parallel-requests", "4"],
    );
    let c = client();
    let url = format!("{}/v1/chat/completions", r1.url());
    let alice = [("authorization", "Bearer sk-alice")];
    assert_eq!(post(&c, &url, &chat("hi", 2, false), &[]).await.status, 401);
    assert_eq!(
        post(&c, &url, &chat("hi", 2, false), &alice).await.status,
        200
    );
    let refused = post(&c, &url, &chat("hi", 2, true), &alice).await;
    assert!(expect_429(&refused) >= 1);
    let text = get(&c, &format!("{}/metrics", r1.url())).await.text;
    let series = "kimi:rate_limited_requests_total{key=\"alice\",limit=\"requests\"}";
    assert_eq!(metric(&text, series), Some(1.0), "{text}");
    let log = r1.log_with(&["key=alice"]);
    assert!(log.contains("key=alice"), "{log}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn limits_and_cache_shared_through_redis() {
    support::clear_of_minute_end();
    let Some(redis) = Redis::start() else {
        return;
    };
    let r1 = replica(0, &[]);
    let shared = [
        "--redis-url",
        &redis.url(),
        "--rpm-limit",
        "3",
        "--api-key",
        "sk-team",
        "--response-cache",
        "redis",
    ];
    let (g1, g2) = (gateway(&[r1.url()], &shared), gateway(&[r1.url()], &shared));
    let c = client();
    let key = [("authorization", "Bearer sk-team")];
    let path = "/v1/chat/completions";
    let body = chat("shared cache", 6, false);

    let first = post(&c, &format!("{}{path}", g1.url()), &body, &key).await;
    assert_eq!(first.status, 200, "{}", first.text);
    assert_eq!(first.header("x-kimi-cache"), Some("miss"));
    // The other gateway answers from the entry the first one stored.
    let second = post(&c, &format!("{}{path}", g2.url()), &body, &key).await;
    assert_eq!(second.header("x-kimi-cache"), Some("hit"));
    assert_eq!(second.text, first.text);
    // Three requests a minute across both gateways: the fourth is refused by either.
    let third = post(
        &c,
        &format!("{}{path}", g1.url()),
        &chat("other", 2, false),
        &key,
    )
    .await;
    assert_eq!(third.status, 200);
    let fourth = post(
        &c,
        &format!("{}{path}", g2.url()),
        &chat("more", 2, false),
        &key,
    )
    .await;
    assert!(expect_429(&fourth) >= 1);

    let text = get(&c, &format!("{}/metrics", g2.url())).await.text;
    assert_eq!(
        metric(&text, "kimi:gateway_cache_hits_total"),
        Some(1.0),
        "{text}"
    );
    assert_eq!(
        metric(&text, "kimi:rate_limit_store_errors_total"),
        Some(0.0)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_response_cache_in_memory() {
    let r1 = replica(0, &[]);
    let gw = gateway(&[r1.url()], &["--response-cache", "memory"]);
    let c = client();
    let url = format!("{}/v1/chat/completions", gw.url());
    let cache = |a: &support::Answer| a.header("x-kimi-cache").map(str::to_owned);

    let body = chat("cache me", 8, false);
    let a = post(&c, &url, &body, &[]).await;
    let b = post(&c, &url, &body, &[]).await;
    assert_eq!(
        (cache(&a), cache(&b)),
        (Some("miss".into()), Some("hit".into()))
    );
    assert_eq!(a.text, b.text);
    assert_eq!(b.header("content-type"), Some("application/json"));

    // A stream is replayed as the same events.
    let mut streamed = chat("cache me", 8, true);
    streamed["stream_options"] = json!({"include_usage": true});
    let a = post(&c, &url, &streamed, &[]).await;
    let b = post(&c, &url, &streamed, &[]).await;
    assert_eq!(
        (cache(&a), cache(&b)),
        (Some("miss".into()), Some("hit".into()))
    );
    assert_eq!(a.text, b.text);
    assert_eq!(b.header("content-type"), Some("text/event-stream"));
    assert!(b.events().last().is_some_and(|e| e["usage"].is_object()));

    // Sampled without a seed: not cached. With a seed: cached.
    let mut sampled = chat("sampled", 4, false);
    sampled["temperature"] = json!(0.9);
    assert_eq!(
        cache(&post(&c, &url, &sampled, &[]).await).as_deref(),
        Some("bypass")
    );
    sampled["seed"] = json!(7);
    assert_eq!(
        cache(&post(&c, &url, &sampled, &[]).await).as_deref(),
        Some("miss")
    );
    assert_eq!(
        cache(&post(&c, &url, &sampled, &[]).await).as_deref(),
        Some("hit")
    );

    // Errors are never stored; stream options it cannot replay and no-store bypass it.
    let mut bad = chat("bad", 4, false);
    bad["max_tokens"] = json!(-1);
    for _ in 0..2 {
        let a = post(&c, &url, &bad, &[]).await;
        assert_eq!(
            (a.status, cache(&a).as_deref()),
            (400, Some("miss")),
            "{}",
            a.text
        );
    }
    let mut odd = chat("odd", 4, true);
    odd["stream_options"] = json!({"include_usage": true, "chunk_tokens": 4});
    assert_eq!(
        cache(&post(&c, &url, &odd, &[]).await).as_deref(),
        Some("bypass")
    );
    let no_store = post(&c, &url, &body, &[("cache-control", "no-store")]).await;
    assert_eq!(cache(&no_store).as_deref(), Some("bypass"));

    let text = get(&c, &format!("{}/metrics", gw.url())).await.text;
    assert_eq!(
        metric(&text, "kimi:gateway_cache_hits_total"),
        Some(3.0),
        "{text}"
    );
    assert_eq!(
        metric(&text, "kimi:gateway_cache_misses_total"),
        Some(5.0),
        "{text}"
    );
    assert!(metric(&text, "kimi:gateway_cache_bytes").unwrap_or(0.0) > 0.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_end_to_end_and_cors() {
    let dir = tempfile::tempdir().expect("tempdir");
    let cert = rcgen::generate_simple_self_signed(vec!["localhost".into(), "127.0.0.1".into()])
        .expect("certificate");
    let (certfile, keyfile) = (dir.path().join("cert.pem"), dir.path().join("key.pem"));
    std::fs::write(&certfile, cert.cert.pem()).expect("write");
    std::fs::write(&keyfile, cert.key_pair.serialize_pem()).expect("write");
    let (certfile, keyfile) = (
        certfile.display().to_string(),
        keyfile.display().to_string(),
    );
    let tls = [
        "--ssl-certfile",
        certfile.as_str(),
        "--ssl-keyfile",
        keyfile.as_str(),
    ];

    // A replica over HTTPS, with CORS for one origin.
    let mut replica_args = tls.to_vec();
    replica_args.extend(["--allowed-origins", r#"["https://app.example"]"#]);
    let r1 = replica(0, &replica_args);
    let upstream = format!("https://localhost:{}", r1.addr.port());
    let mut gateway_args = tls.to_vec();
    gateway_args.extend([
        "--upstream-ca-file",
        certfile.as_str(),
        "--allowed-origins",
        "https://app.example,https://other.example",
    ]);
    let gw = gateway(std::slice::from_ref(&upstream), &gateway_args);
    let trusted = reqwest::Client::builder()
        .add_root_certificate(
            reqwest::Certificate::from_pem(cert.cert.pem().as_bytes()).expect("pem"),
        )
        .no_proxy()
        .timeout(Duration::from_secs(60))
        .build()
        .expect("client");
    let base = format!("https://localhost:{}", gw.addr.port());
    let a = post(
        &trusted,
        &format!("{base}/v1/chat/completions"),
        &chat("secure", 4, true),
        &[],
    )
    .await;
    assert_eq!(a.status, 200, "{}", a.text);
    assert_eq!(a.header("x-kimi-upstream"), Some(upstream.as_str()));
    assert!(!a.events().is_empty());
    // Plain HTTP to a TLS port gets no HTTP answer; an untrusting client refuses the
    // certificate.
    assert!(client()
        .get(format!("http://{}/health", gw.addr))
        .send()
        .await
        .is_err());
    assert!(client().get(format!("{base}/health")).send().await.is_err());

    // CORS: a preflight from an allowed origin, one from another.
    for (url, origin, allowed) in [
        (&base, "https://other.example", true),
        (&base, "https://evil.example", false),
        (
            &format!("https://localhost:{}", r1.addr.port()),
            "https://app.example",
            true,
        ),
    ] {
        let preflight = trusted
            .request(
                reqwest::Method::OPTIONS,
                format!("{url}/v1/chat/completions"),
            )
            .header("origin", origin)
            .header("access-control-request-method", "POST")
            .header(
                "access-control-request-headers",
                "authorization,content-type",
            )
            .send()
            .await
            .expect("preflight");
        let header = preflight
            .headers()
            .get("access-control-allow-origin")
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned);
        assert_eq!(
            header.as_deref(),
            allowed.then_some(origin),
            "{url} {origin}"
        );
    }
    let models = trusted
        .get(format!("{base}/v1/models"))
        .header("origin", "https://app.example")
        .send()
        .await
        .expect("models");
    let exposed = models
        .headers()
        .get("access-control-expose-headers")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_string();
    assert!(exposed.contains("x-request-id"), "{exposed}");
    let body: Value = models.json().await.expect("JSON");
    assert_eq!(body["data"][0]["id"], "kimi-demo");
}
