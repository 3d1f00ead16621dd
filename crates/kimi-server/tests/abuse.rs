//! The server under abuse, on a loopback socket: huge prompts, half-sent heads and bodies,
//! idle and hoarded connections, a shutdown during a long stream. Each case checks that
//! the server answers in bounded time and memory and stays healthy afterwards. The cases
//! run one at a time (they measure this process's memory and sockets).

use crate::common;

use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use serde_json::json;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// A wall-clock bound of these tests, stretched tenfold under emulation
/// (`scripts/arm/test.sh` runs them in qemu user mode, several times slower; it sets
/// `KIMI_TEST_EMULATED`). The server's own timeouts are not stretched.
fn bound(d: Duration) -> Duration {
    if std::env::var_os("KIMI_TEST_EMULATED").is_some() {
        d * 10
    } else {
        d
    }
}

/// Serializes the cases of this file.
async fn serial() -> tokio::sync::MutexGuard<'static, ()> {
    static LOCK: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
    LOCK.lock().await
}

/// Resident memory of this process, in bytes.
fn rss() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|kb| kb.parse::<u64>().ok())
        .map_or(0, |kb| kb * 1024)
}

/// Runs `work` and reports the peak of resident memory above where it started.
async fn peak_growth<F: Future>(work: F) -> (F::Output, u64) {
    let base = rss();
    let stop = Arc::new(AtomicBool::new(false));
    let peak = Arc::new(AtomicU64::new(base));
    let sampler = {
        let (stop, peak) = (Arc::clone(&stop), Arc::clone(&peak));
        std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                peak.fetch_max(rss(), Ordering::Relaxed);
                std::thread::sleep(Duration::from_millis(5));
            }
        })
    };
    let out = work.await;
    stop.store(true, Ordering::Relaxed);
    let _ = sampler.join();
    (out, peak.load(Ordering::Relaxed).saturating_sub(base))
}

/// Reads until the server closes the connection; how long that took (panics past `limit`).
async fn closed_within(mut stream: TcpStream, limit: Duration) -> (Duration, Vec<u8>) {
    let started = Instant::now();
    let mut seen = Vec::new();
    let read = tokio::time::timeout(limit, async {
        let mut buf = [0u8; 4096];
        loop {
            match stream.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => seen.extend_from_slice(&buf[..n]),
            }
        }
    })
    .await;
    assert!(
        read.is_ok(),
        "the server kept the connection open past {limit:?}"
    );
    (started.elapsed(), seen)
}

async fn assert_healthy(server: &TestServer) {
    assert_eq!(get(server.addr, "/health").await.status, 200);
    let resp = post(
        server.addr,
        "/v1/chat/completions",
        &chat("still alive?", 2),
    )
    .await;
    assert_eq!(resp.status, 200, "{}", resp.text());
}

fn quick_config() -> kimi_server::ServerConfig {
    kimi_server::ServerConfig {
        keep_alive_timeout: Some(Duration::from_secs(1)),
        body_timeout: Some(Duration::from_secs(1)),
        ..server_config()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn huge_prompts_are_refused_quickly_in_bounded_memory() {
    let _serial = serial().await;
    let server = start().await;
    // 30 MB of text, inside the 32 MiB body limit.
    let text = "hello world ".repeat(2_500_000);
    let chat_body = serde_json::to_vec(
        &json!({"model": MODEL, "messages": [{"role": "user", "content": text}]}),
    )
    .expect("json");
    let completion_body =
        serde_json::to_vec(&json!({"model": MODEL, "prompt": text})).expect("json");
    let tokenize_body = serde_json::to_vec(&json!({"prompt": text})).expect("json");
    assert!(chat_body.len() < 32 << 20);
    drop(text);
    let started = Instant::now();
    let (responses, growth) = peak_growth(async {
        tokio::join!(
            post_bytes(server.addr, "/v1/chat/completions", &chat_body),
            post_bytes(server.addr, "/v1/chat/completions", &chat_body),
            post_bytes(server.addr, "/v1/completions", &completion_body),
            post_bytes(server.addr, "/tokenize", &tokenize_body),
        )
    })
    .await;
    let elapsed = started.elapsed();
    let (a, b, c, d) = responses;
    for resp in [a, b, c, d] {
        let err = resp.expect_error(400);
        assert_eq!(err["code"], "context_length_exceeded", "{err}");
        assert!(
            err["message"]
                .as_str()
                .is_some_and(|m| m.contains("at least")),
            "{err}"
        );
    }
    // Four 30 MB requests at once, each parsed and rendered once but never tokenized:
    // seconds and hundreds of MB, where tokenizing took tens of seconds and GBs each.
    assert!(elapsed < bound(Duration::from_secs(15)), "took {elapsed:?}");
    assert!(growth < 1536 << 20, "memory grew by {} MiB", growth >> 20);
    assert_healthy(&server).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn half_sent_heads_and_idle_connections_are_closed() {
    let _serial = serial().await;
    let server = start_with(quick_config(), serving_config()).await;
    let mut hogs = Vec::new();
    for i in 0..60 {
        let mut stream = TcpStream::connect(server.addr).await.expect("connect");
        match i % 3 {
            0 => {} // connects and says nothing
            1 => stream
                .write_all(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")
                .await
                .expect("send"),
            _ => stream.write_all(b"GET /heal").await.expect("send"),
        }
        hogs.push(stream);
    }
    // A head trickled a byte at a time does not extend its deadline.
    let mut trickle = TcpStream::connect(server.addr).await.expect("connect");
    let trickled = tokio::spawn(async move {
        for &byte in b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: 1111111111111111111111111" {
            if trickle.write_all(&[byte]).await.is_err() {
                return true;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        false
    });
    for stream in hogs {
        let (waited, seen) = closed_within(stream, bound(Duration::from_secs(10))).await;
        assert!(
            seen.is_empty() || seen.starts_with(b"HTTP/1.1 408"),
            "{seen:?}"
        );
        assert!(
            waited < bound(Duration::from_secs(5)),
            "closed after {waited:?}"
        );
    }
    assert!(
        trickled.await.expect("trickle task"),
        "the trickled head was served"
    );
    // A keep-alive connection is closed once it idles past the timeout.
    let mut stream = TcpStream::connect(server.addr).await.expect("connect");
    stream
        .write_all(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        .await
        .expect("send");
    let (waited, seen) = closed_within(stream, bound(Duration::from_secs(10))).await;
    assert!(seen.starts_with(b"HTTP/1.1 200"), "{seen:?}");
    assert!(
        waited >= Duration::from_millis(900) && waited < bound(Duration::from_secs(5)),
        "{waited:?}"
    );
    let metrics = get(server.addr, "/metrics").await.text();
    // Only the scrape's own connection is open.
    assert_eq!(
        metric(&metrics, "kimi:http_connections_open", ""),
        Some(1.0)
    );
    assert_healthy(&server).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn half_sent_bodies_time_out_with_408() {
    let _serial = serial().await;
    let server = start_with(quick_config(), serving_config()).await;
    let mut streams = Vec::new();
    for _ in 0..20 {
        let mut stream = TcpStream::connect(server.addr).await.expect("connect");
        stream
            .write_all(
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n\
                  Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{\"model\": ",
            )
            .await
            .expect("send");
        streams.push(stream);
    }
    for stream in streams {
        let (waited, seen) = closed_within(stream, bound(Duration::from_secs(10))).await;
        let text = String::from_utf8_lossy(&seen);
        assert!(text.starts_with("HTTP/1.1 408"), "{text}");
        assert!(text.contains("body_timeout"), "{text}");
        assert!(waited < bound(Duration::from_secs(5)), "{waited:?}");
    }
    assert_healthy(&server).await;
}

/// Opens `n` connections that each send half a request head and then wait.
async fn hoard(server: &TestServer, n: usize) -> Vec<TcpStream> {
    let mut hogs = Vec::with_capacity(n);
    for _ in 0..n {
        let mut stream = TcpStream::connect(server.addr).await.expect("connect");
        let _ = stream.write_all(b"GET /v1/models HTTP/1.1\r\n").await;
        hogs.push(stream);
    }
    hogs
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_connection_cap_refuses_clearly_and_health_stays_reachable() {
    let _serial = serial().await;
    let config = kimi_server::ServerConfig {
        max_connections: 16,
        keep_alive_timeout: Some(Duration::from_secs(30)),
        ..server_config()
    };
    let server = start_with(config, serving_config()).await;
    let hogs = hoard(&server, 16).await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    let refused = post(server.addr, "/v1/chat/completions", &chat("hi", 2)).await;
    let err = refused.expect_error(503);
    assert_eq!(err["code"], "too_many_connections", "{err}");
    assert_eq!(refused.header("retry-after"), Some("1"));
    assert_eq!(get(server.addr, "/health").await.status, 200);
    drop(hogs);
    // The server notices the hogs are gone and serves again.
    let deadline = Instant::now() + bound(Duration::from_secs(10));
    loop {
        let resp = post(server.addr, "/v1/chat/completions", &chat("hi", 2)).await;
        if resp.status == 200 {
            break;
        }
        assert!(Instant::now() < deadline, "still refused: {}", resp.text());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let metrics = get(server.addr, "/metrics").await.text();
    let refused = metric(&metrics, "kimi:http_connections_refused_total", "");
    assert!(refused.is_some_and(|n| n >= 2.0), "{metrics}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_hoarding_sockets_cannot_lock_others_out() {
    let _serial = serial().await;
    let config = kimi_server::ServerConfig {
        max_connections: 64,
        keep_alive_timeout: Some(Duration::from_secs(2)),
        ..server_config()
    };
    let server = start_with(config, serving_config()).await;
    // One client holds 600 sockets (kept open on its side throughout).
    let hogs = hoard(&server, 600).await;
    // /health answers while they are held...
    let deadline = Instant::now() + bound(Duration::from_secs(5));
    while get(server.addr, "/health").await.status != 200 {
        assert!(Instant::now() < deadline, "/health unreachable");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // ...and once the server has timed out its share of them, everything does.
    let deadline = Instant::now() + bound(Duration::from_secs(10));
    loop {
        let resp = post(server.addr, "/v1/chat/completions", &chat("hi", 2)).await;
        if resp.status == 200 {
            break;
        }
        assert_eq!(resp.status, 503, "{}", resp.text());
        assert!(Instant::now() < deadline, "still refused");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // The server's side of every hoarded socket closes (only a scrape's own stays open).
    let deadline = Instant::now() + bound(Duration::from_secs(10));
    loop {
        let metrics = get(server.addr, "/metrics").await.text();
        if metric(&metrics, "kimi:http_connections_open", "") == Some(1.0) {
            break;
        }
        assert!(Instant::now() < deadline, "{metrics}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    drop(hogs);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_cuts_a_long_stream_at_the_deadline() {
    let _serial = serial().await;
    let config = kimi_server::ServerConfig {
        shutdown_timeout: Some(Duration::from_secs(1)),
        ..server_config()
    };
    let mut server = start_with(config, serving_config()).await;
    // 16 choices of the longest output: far more than the tiny model writes in a second.
    let mut body = chat("Talk for a long time", MAX_MODEL_LEN - 64);
    body["ignore_eos"] = json!(true);
    body["stream"] = json!(true);
    body["n"] = json!(16);
    let bytes = serde_json::to_vec(&body).expect("json");
    let raw = build_request("POST", "/v1/chat/completions", &[], &bytes);
    let mut stream = TcpStream::connect(server.addr).await.expect("connect");
    stream.write_all(&raw).await.expect("send");
    let mut seen = Vec::new();
    let mut buf = [0u8; 4096];
    while seen.windows(7).filter(|w| w == b"content").count() < 3 {
        let n = stream.read(&mut buf).await.expect("read");
        assert!(n > 0, "stream ended early");
        seen.extend_from_slice(&buf[..n]);
    }
    let started = Instant::now();
    let served = server.begin_shutdown();
    let result = tokio::time::timeout(bound(Duration::from_secs(10)), served).await;
    let waited = started.elapsed();
    let (_, rest) = closed_within(stream, bound(Duration::from_secs(5))).await;
    assert!(result.is_ok(), "the server outlived its shutdown timeout");
    assert!(
        waited >= Duration::from_millis(900) && waited < bound(Duration::from_secs(5)),
        "{waited:?}"
    );
    // The stream was cut, not finished: no [DONE].
    seen.extend_from_slice(&rest);
    assert!(!String::from_utf8_lossy(&seen).contains("[DONE]"));
    assert!(
        TcpStream::connect(server.addr).await.is_err(),
        "still listening"
    );
}
