//! The access log: one line per request with method, path, status, latency, tokens,
//! request id and key id (never the key), at info for 2xx–4xx, including streams.

mod common;

use std::io::Write;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use common::*;
use serde_json::json;

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

#[derive(Clone, Default)]
struct Captured(Arc<Mutex<Vec<u8>>>);

impl Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().expect("lock").extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Everything logged at info and above by `kimi_server`, as plain text.
fn captured() -> &'static Captured {
    static LOG: OnceLock<Captured> = OnceLock::new();
    LOG.get_or_init(|| {
        let log = Captured::default();
        let writer = log.clone();
        tracing_subscriber::fmt()
            .with_env_filter("kimi_server=info")
            .with_ansi(false)
            .with_writer(move || writer.clone())
            .init();
        log
    })
}

/// The access lines that mention `needle`, waiting a little for a stream's line.
async fn lines_with(needle: &str) -> Vec<String> {
    let deadline = Instant::now() + bound(Duration::from_secs(10));
    loop {
        let text = String::from_utf8_lossy(&captured().0.lock().expect("lock")).into_owned();
        let found: Vec<String> = text
            .lines()
            .filter(|l| l.contains("kimi_server::access") && l.contains(needle))
            .map(str::to_owned)
            .collect();
        if !found.is_empty() || Instant::now() > deadline {
            return found;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_request_gets_one_access_line() {
    captured();
    let config = kimi_server::ServerConfig {
        api_keys: vec!["sk-first-secret".into(), "sk-second-secret".into()],
        ..server_config()
    };
    let server = start_with(config, serving_config()).await;
    let auth = [
        ("Authorization", "Bearer sk-second-secret"),
        ("Content-Type", "application/json"),
        ("X-Request-Id", "trace-chat-1"),
    ];
    let body = serde_json::to_vec(&chat("Hello there", 4)).expect("json");
    let resp = request(server.addr, "POST", "/v1/chat/completions", &auth, &body).await;
    assert_eq!(resp.status, 200, "{}", resp.text());
    assert_eq!(resp.header("x-request-id"), Some("trace-chat-1"));
    let usage = &resp.json()["usage"];
    let line = lines_with("request_id=trace-chat-1").await;
    assert_eq!(line.len(), 1, "{line:?}");
    let line = &line[0];
    for part in [
        " INFO ",
        "method=POST",
        "path=/v1/chat/completions",
        "status=200",
        "latency_ms=",
        &format!("prompt_tokens={}", usage["prompt_tokens"]),
        &format!("completion_tokens={}", usage["completion_tokens"]),
        "key=key-2",
        "client=127.0.0.1:",
        "aborted=false",
    ] {
        assert!(line.contains(part), "{part} missing in {line}");
    }

    // A stream's line comes at its end, with its tokens.
    let mut streamed = chat("Count", 5);
    streamed["stream"] = json!(true);
    streamed["ignore_eos"] = json!(true);
    let body = serde_json::to_vec(&streamed).expect("json");
    let headers = [auth[0], auth[1], ("X-Request-Id", "trace-stream-1")];
    let resp = request(server.addr, "POST", "/v1/chat/completions", &headers, &body).await;
    assert_eq!(resp.status, 200);
    let line = lines_with("request_id=trace-stream-1").await;
    assert!(
        line.len() == 1 && line[0].contains("completion_tokens=5"),
        "{line:?}"
    );

    // Errors are at info with their message; no key shows as `-`.
    let headers = [("X-Request-Id", "trace-denied-1")];
    let resp = request(server.addr, "GET", "/v1/models", &headers, b"").await;
    assert_eq!(resp.status, 401);
    let line = lines_with("request_id=trace-denied-1").await;
    assert!(
        line.len() == 1
            && line[0].contains(" INFO ")
            && line[0].contains("status=401")
            && line[0].contains("key=-")
            && line[0].contains("error=Incorrect API key"),
        "{line:?}"
    );
    // A generated id when the client sends none.
    let resp = request(server.addr, "GET", "/v1/models", &[auth[0]], b"").await;
    let id = resp.header("x-request-id").expect("an id").to_string();
    assert!(id.starts_with("req-"), "{id}");
    assert_eq!(lines_with(&format!("request_id={id}")).await.len(), 1);

    let all = String::from_utf8_lossy(&captured().0.lock().expect("lock")).into_owned();
    assert!(!all.contains("secret"), "a key leaked into the log:\n{all}");
    assert!(!all.contains('\u{1b}'), "ANSI escapes in the log");
}
