//! Test harness: the demo model behind a real server on 127.0.0.1:0, a raw HTTP/1.1
//! client (so malformed requests can be sent as bytes), SSE parsing and a small JSON-schema
//! checker.
#![allow(dead_code)]

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use kimi_cpu::CpuBackend;
use kimi_engine::{EngineHandle, ServingConfig};
use kimi_model::KimiLinear;
use kimi_server::{AppState, ServerConfig};
use kimi_tokenizer::Tokenizer;
use kimi_weights::Checkpoint;
use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

pub const MODEL: &str = "kimi-demo";
pub const MAX_MODEL_LEN: usize = 2048;

/// The demo model and tokenizer copied into one directory.
pub fn demo_dir() -> tempfile::TempDir {
    demo_dir_with("demo-tokenizer")
}

/// The demo model with the tokenizer in `assets/{tokenizer}` (`demo-tokenizer-k3`: Kimi
/// K3's special tokens and no chat template, so the server speaks XTML; the format is about
/// tokens, so the random Kimi Linear weights serve as well as K3's would).
pub fn demo_dir_with(tokenizer: &str) -> tempfile::TempDir {
    let dir = tempfile::tempdir().expect("tempdir");
    let assets = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../assets");
    for sub in ["demo-model", tokenizer] {
        for entry in std::fs::read_dir(assets.join(sub)).expect("assets exist") {
            let path = entry.expect("dir entry").path();
            let name = path.file_name().expect("file name");
            std::fs::copy(&path, dir.path().join(name)).expect("copy asset");
        }
    }
    dir
}

pub fn serving_config() -> ServingConfig {
    ServingConfig {
        max_model_len: MAX_MODEL_LEN,
        max_num_seqs: 32,
        max_num_batched_tokens: 4096,
        block_size: 16,
        num_blocks: 1024,
        max_waiting: 256,
        expert_rebalance: None,
    }
}

/// A running server on the demo model.
pub struct TestServer {
    pub addr: SocketAddr,
    pub engine: EngineHandle,
    pub tokenizer: Arc<Tokenizer>,
    shutdown: Option<tokio::sync::oneshot::Sender<()>>,
    served: Option<tokio::task::JoinHandle<Result<(), kimi_server::ServerError>>>,
    _dir: tempfile::TempDir,
}

impl TestServer {
    /// Sends the shutdown signal and returns the serving task, which ends once the server
    /// has drained (or cut) its connections.
    pub fn begin_shutdown(
        &mut self,
    ) -> tokio::task::JoinHandle<Result<(), kimi_server::ServerError>> {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
        self.served.take().expect("the server is serving")
    }
}

impl Drop for TestServer {
    fn drop(&mut self) {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
        self.engine.shutdown(false);
    }
}

pub fn server_config() -> ServerConfig {
    ServerConfig {
        host: "127.0.0.1".into(),
        port: 0,
        served_model_name: MODEL.into(),
        request_timeout: Some(Duration::from_secs(60)),
        ..ServerConfig::default()
    }
}

pub async fn start() -> TestServer {
    start_with(server_config(), serving_config()).await
}

pub async fn start_with(config: ServerConfig, serving: ServingConfig) -> TestServer {
    start_in(demo_dir(), config, serving).await
}

/// A server on the demo model with the K3 tokenizer (XTML chat format).
pub async fn start_k3() -> TestServer {
    start_in(
        demo_dir_with("demo-tokenizer-k3"),
        server_config(),
        serving_config(),
    )
    .await
}

pub async fn start_in(
    dir: tempfile::TempDir,
    config: ServerConfig,
    serving: ServingConfig,
) -> TestServer {
    let ckpt = Checkpoint::open(dir.path()).expect("demo checkpoint opens");
    let model = KimiLinear::load(CpuBackend::new(), &ckpt).expect("demo model loads");
    start_model(dir, model, config, serving).await
}

/// A server on `model`, loaded from `dir` (which also holds the tokenizer).
pub async fn start_model(
    dir: tempfile::TempDir,
    model: KimiLinear<CpuBackend>,
    config: ServerConfig,
    serving: ServingConfig,
) -> TestServer {
    let engine = EngineHandle::spawn(model, serving).expect("engine starts");
    let tokenizer = Arc::new(Tokenizer::from_dir(dir.path()).expect("demo tokenizer loads"));
    let state = AppState::new(config, Arc::new(engine.clone()), Arc::clone(&tokenizer))
        .expect("server state");
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("local addr");
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let served = tokio::spawn(kimi_server::serve_listener(listener, state, async move {
        let _ = rx.await;
    }));
    TestServer {
        addr,
        engine,
        tokenizer,
        shutdown: Some(tx),
        served: Some(served),
        _dir: dir,
    }
}

/// A parsed HTTP response.
#[derive(Debug)]
pub struct HttpResponse {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl HttpResponse {
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("body is not JSON ({e}): {}", self.text()))
    }

    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    /// Asserts an OpenAI error body with this status, and returns the `error` object.
    pub fn expect_error(&self, status: u16) -> Value {
        assert_eq!(self.status, status, "body: {}", self.text());
        let body = self.json();
        let err = body["error"].clone();
        assert!(
            err["message"].as_str().is_some_and(|m| !m.is_empty()),
            "{body}"
        );
        assert!(err["type"].is_string(), "{body}");
        assert!(
            err.get("param").is_some() && err.get("code").is_some(),
            "{body}"
        );
        err
    }

    /// The `data:` payloads of an SSE body, which must end with `[DONE]`.
    pub fn sse(&self) -> Vec<Value> {
        let text = self.text();
        let mut events = Vec::new();
        let mut done = false;
        for line in text.lines() {
            let Some(data) = line.strip_prefix("data: ") else {
                continue;
            };
            assert!(!done, "data after [DONE]: {text}");
            if data == "[DONE]" {
                done = true;
            } else {
                events.push(serde_json::from_str(data).unwrap_or_else(|e| panic!("{e}: {data}")));
            }
        }
        assert!(done, "no [DONE]: {text}");
        events
    }
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}

pub fn parse_response(raw: &[u8]) -> HttpResponse {
    let head_end = find(raw, b"\r\n\r\n")
        .unwrap_or_else(|| panic!("no HTTP head in {:?}", String::from_utf8_lossy(raw)));
    let head = String::from_utf8_lossy(&raw[..head_end]).into_owned();
    let mut lines = head.split("\r\n");
    let status_line = lines.next().unwrap_or_default();
    let status: u16 = status_line
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("bad status line {status_line:?}"));
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_string(), v.trim().to_string()))
        .collect();
    let mut body = raw[head_end + 4..].to_vec();
    let chunked = headers
        .iter()
        .any(|(k, v)| k.eq_ignore_ascii_case("transfer-encoding") && v.contains("chunked"));
    if chunked {
        body = dechunk(&body);
    }
    HttpResponse {
        status,
        headers,
        body,
    }
}

fn dechunk(mut data: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    while let Some(line_end) = find(data, b"\r\n") {
        let size_text = String::from_utf8_lossy(&data[..line_end]).into_owned();
        let size = usize::from_str_radix(size_text.split(';').next().unwrap_or("").trim(), 16)
            .unwrap_or(0);
        if size == 0 {
            break;
        }
        let start = line_end + 2;
        let end = (start + size).min(data.len());
        out.extend_from_slice(&data[start..end]);
        data = &data[(end + 2).min(data.len())..];
    }
    out
}

/// Sends raw bytes and reads until the server closes (at most 120 s). With `close_write`
/// the client half-closes after sending (for requests the server would otherwise wait on).
pub async fn send_raw(addr: SocketAddr, raw: &[u8], close_write: bool) -> Option<Vec<u8>> {
    let mut stream = TcpStream::connect(addr).await.expect("connect");
    stream.write_all(raw).await.ok()?;
    if close_write {
        let _ = stream.shutdown().await;
    }
    let mut out = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(120), stream.read_to_end(&mut out)).await;
    assert!(
        read.is_ok(),
        "the server hung on {:?}",
        String::from_utf8_lossy(raw)
    );
    Some(out)
}

pub fn build_request(method: &str, path: &str, headers: &[(&str, &str)], body: &[u8]) -> Vec<u8> {
    let mut raw = format!("{method} {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n");
    for (k, v) in headers {
        raw += &format!("{k}: {v}\r\n");
    }
    raw += &format!("Content-Length: {}\r\n\r\n", body.len());
    let mut bytes = raw.into_bytes();
    bytes.extend_from_slice(body);
    bytes
}

pub async fn request(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) -> HttpResponse {
    let raw = build_request(method, path, headers, body);
    let out = send_raw(addr, &raw, false).await.expect("request sent");
    parse_response(&out)
}

pub async fn get(addr: SocketAddr, path: &str) -> HttpResponse {
    request(addr, "GET", path, &[], b"").await
}

pub async fn post(addr: SocketAddr, path: &str, body: &Value) -> HttpResponse {
    let bytes = serde_json::to_vec(body).expect("serialize");
    request(
        addr,
        "POST",
        path,
        &[("Content-Type", "application/json")],
        &bytes,
    )
    .await
}

pub async fn post_bytes(addr: SocketAddr, path: &str, body: &[u8]) -> HttpResponse {
    request(
        addr,
        "POST",
        path,
        &[("Content-Type", "application/json")],
        body,
    )
    .await
}

/// A chat request body with greedy decoding.
pub fn chat(content: &str, max_tokens: usize) -> Value {
    json!({
        "model": MODEL,
        "messages": [{"role": "user", "content": content}],
        "temperature": 0,
        "max_tokens": max_tokens,
    })
}

/// One value of a metric line (first match of `name{...labels containing filter}`).
pub fn metric(text: &str, name: &str, filter: &str) -> Option<f64> {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .find(|l| l.starts_with(&format!("{name}{{")) && l.contains(filter))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}

/// Checks `value` against the JSON-schema subset the tests use.
pub fn validate(schema: &Value, value: &Value) -> Result<(), String> {
    if let Some(options) = schema.get("enum").and_then(Value::as_array) {
        if !options.contains(value) {
            return Err(format!("{value} not in enum {options:?}"));
        }
    }
    let Some(kind) = schema.get("type").and_then(Value::as_str) else {
        return Ok(());
    };
    let ok = match kind {
        "object" => value.is_object(),
        "array" => value.is_array(),
        "string" => value.is_string(),
        "integer" => value.is_i64() || value.is_u64(),
        "number" => value.is_number(),
        "boolean" => value.is_boolean(),
        "null" => value.is_null(),
        _ => true,
    };
    if !ok {
        return Err(format!("{value} is not {kind}"));
    }
    if let Some(s) = value.as_str() {
        let len = s.chars().count() as u64;
        if schema
            .get("maxLength")
            .and_then(Value::as_u64)
            .is_some_and(|m| len > m)
        {
            return Err(format!("{value} too long"));
        }
        if schema
            .get("minLength")
            .and_then(Value::as_u64)
            .is_some_and(|m| len < m)
        {
            return Err(format!("{value} too short"));
        }
    }
    if let Some(x) = value.as_f64() {
        if schema
            .get("minimum")
            .and_then(Value::as_f64)
            .is_some_and(|m| x < m)
        {
            return Err(format!("{value} below minimum"));
        }
        if schema
            .get("maximum")
            .and_then(Value::as_f64)
            .is_some_and(|m| x > m)
        {
            return Err(format!("{value} above maximum"));
        }
    }
    if let (Some(items), Some(array)) = (schema.get("items"), value.as_array()) {
        if schema
            .get("maxItems")
            .and_then(Value::as_u64)
            .is_some_and(|m| array.len() as u64 > m)
        {
            return Err(format!("{value} has too many items"));
        }
        for item in array {
            validate(items, item)?;
        }
    }
    if let Some(object) = value.as_object() {
        let properties = schema.get("properties").and_then(Value::as_object);
        for key in schema
            .get("required")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
        {
            let key = key.as_str().unwrap_or_default();
            if !object.contains_key(key) {
                return Err(format!("{value} lacks required {key}"));
            }
        }
        for (key, item) in object {
            match properties.and_then(|p| p.get(key)) {
                Some(sub) => validate(sub, item)?,
                None if schema.get("additionalProperties") == Some(&json!(false)) => {
                    return Err(format!("{value} has extra property {key}"));
                }
                None => {}
            }
        }
    }
    Ok(())
}
