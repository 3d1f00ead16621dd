//! Real processes for the gateway tests: `kimi-infer serve` replicas on the built-in demo
//! model, `kimi-infer gateway` in front of them, and `redis-server`; an HTTP client and SSE
//! reading on top of reqwest.
#![allow(dead_code)]

use std::io::{BufRead, BufReader};
use std::net::{SocketAddr, TcpListener};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures_util::StreamExt;
use serde_json::{json, Value};

fn bin() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_kimi-infer"));
    c.env(
        "XDG_CACHE_HOME",
        std::env::temp_dir().join("kimi-infer-cli-tests"),
    )
    .env("KIMI_LOG", "info,kimi_gateway=debug")
    .env_remove("KIMI_API_KEY")
    .env_remove("KIMI_API_KEYS")
    .env_remove("KIMI_API_KEY_FILE")
    .env_remove("KIMI_REDIS_URL")
    .env_remove("KIMI_UPSTREAM_API_KEY");
    // A launcher's variables make a process one rank of a split model.
    for v in [
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "LOCAL_WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
    ] {
        c.env_remove(v);
    }
    c
}

/// `kimi-infer ARGS` with `env` set, not waited for (a rank that serves no API).
pub fn start(args: &[String], env: &[(&str, String)]) -> Child {
    bin()
        .args(args)
        .envs(env.iter().map(|(k, v)| (k, v)))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("kimi-infer starts")
}

/// A child process whose stderr is collected; killed when dropped.
pub struct Proc {
    pub child: Child,
    pub addr: SocketAddr,
    pub log: Arc<Mutex<String>>,
    pub args: Vec<String>,
}

impl Proc {
    /// Runs `kimi-infer ARGS` and waits for the line with `marker` that names its address
    /// (`... on http://ADDR` or `https://ADDR`).
    pub fn spawn(args: &[String], marker: &'static str) -> Proc {
        Self::spawn_with(args, &[], marker)
    }

    /// [`Proc::spawn`] with `env` set.
    pub fn spawn_with(args: &[String], env: &[(&str, String)], marker: &'static str) -> Proc {
        let mut child = bin()
            .args(args)
            .envs(env.iter().map(|(k, v)| (k, v)))
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("kimi-infer starts");
        let stderr = child.stderr.take().expect("stderr");
        let log = Arc::new(Mutex::new(String::new()));
        let (tx, rx) = std::sync::mpsc::channel();
        {
            let log = Arc::clone(&log);
            std::thread::spawn(move || {
                for line in BufReader::new(stderr).lines() {
                    let Ok(line) = line else { break };
                    if line.contains(marker) {
                        let addr = line
                            .split("://")
                            .nth(1)
                            .and_then(|a| a.split(['"', ' ']).next())
                            .and_then(|a| a.parse::<SocketAddr>().ok());
                        if let Some(addr) = addr {
                            let _ = tx.send(addr);
                        }
                    }
                    let mut log = log.lock().expect("lock");
                    log.push_str(&line);
                    log.push('\n');
                }
            });
        }
        let addr = rx
            .recv_timeout(Duration::from_secs(120))
            .unwrap_or_else(|_| panic!("{args:?} did not start:\n{}", log.lock().expect("lock")));
        Proc {
            child,
            addr,
            log,
            args: args.to_vec(),
        }
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    pub fn log(&self) -> String {
        self.log.lock().expect("lock").clone()
    }

    /// The log once it holds every one of `needles` (stderr is read by another thread, so
    /// the lines of a request just answered may not be in yet), or as it is after 10 s.
    pub fn log_with(&self, needles: &[&str]) -> String {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let log = self.log();
            if needles.iter().all(|n| log.contains(n)) || Instant::now() > deadline {
                return log;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Sends a signal (`KILL`, `STOP`, `CONT`, `TERM`).
    pub fn signal(&self, name: &str) {
        let status = Command::new("kill")
            .args([&format!("-{name}"), &self.child.id().to_string()])
            .status()
            .expect("kill runs");
        assert!(status.success());
    }

    /// Kills the process and waits for it.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        // A test that failed with the process stopped: continue it so it exits at once.
        if let Ok(None) = self.child.try_wait() {
            let _ = Command::new("kill")
                .args(["-CONT", &self.child.id().to_string()])
                .status();
        }
        self.kill();
    }
}

pub fn strings(args: &[&str]) -> Vec<String> {
    args.iter().map(|s| s.to_string()).collect()
}

/// A `serve` replica on the built-in demo model (tiny, random weights, fast), on `port`
/// (0: any) with a small cache.
pub fn replica(port: u16, extra: &[&str]) -> Proc {
    let port = port.to_string();
    let mut args = strings(&[
        "serve",
        "--port",
        &port,
        "--max-num-seqs",
        "8",
        "--max-model-len",
        "32768",
        "--served-model-name",
        "kimi-demo",
    ]);
    args.extend(strings(extra));
    Proc::spawn(&args, "serving `")
}

/// A gateway over `upstreams` with quick health checks (`extra` may set others).
pub fn gateway(upstreams: &[String], extra: &[&str]) -> Proc {
    let mut args = strings(&["gateway", "--port", "0"]);
    for (flag, value) in [
        ("--health-interval", "0.3"),
        ("--health-timeout", "0.5"),
        ("--healthy-threshold", "1"),
    ] {
        if !extra.contains(&flag) {
            args.extend(strings(&[flag, value]));
        }
    }
    for u in upstreams {
        args.push("--upstream".into());
        args.push(u.clone());
    }
    args.extend(strings(extra));
    Proc::spawn(&args, "gateway for")
}

/// A free port on 127.0.0.1.
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port")
}

/// A `redis-server` on a free loopback port, or `None` (with a WARNING) if it is not
/// installed; with `KIMI_REQUIRE_REDIS=1` (set by scripts/test.sh after installing it) a
/// missing server fails the test instead.
pub struct Redis {
    child: Child,
    pub port: u16,
    _dir: tempfile::TempDir,
}

impl Redis {
    pub fn start() -> Option<Redis> {
        let dir = tempfile::tempdir().expect("tempdir");
        let port = free_port();
        let spawned = Command::new("redis-server")
            .args([
                "--port",
                &port.to_string(),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
            ])
            .arg(dir.path())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn();
        let child = match spawned {
            Ok(child) => child,
            Err(e) => {
                assert!(
                    std::env::var_os("KIMI_REQUIRE_REDIS").is_none(),
                    "redis-server cannot run ({e}) but KIMI_REQUIRE_REDIS is set"
                );
                eprintln!("WARNING: redis-server is not installed ({e}); Redis test skipped");
                return None;
            }
        };
        let deadline = Instant::now() + Duration::from_secs(10);
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(Instant::now() < deadline, "redis-server did not start");
            std::thread::sleep(Duration::from_millis(20));
        }
        Some(Redis {
            child,
            port,
            _dir: dir,
        })
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/0", self.port)
    }
}

impl Drop for Redis {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// An HTTP client for tests.
pub fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .timeout(Duration::from_secs(120))
        .no_proxy()
        .build()
        .expect("client")
}

/// A chat request body.
pub fn chat(content: &str, max_tokens: usize, stream: bool) -> Value {
    json!({
        "model": "kimi-demo",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": stream,
    })
}

/// A response read whole.
pub struct Answer {
    pub status: u16,
    pub headers: reqwest::header::HeaderMap,
    pub text: String,
}

impl Answer {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }

    pub fn json(&self) -> Value {
        serde_json::from_str(&self.text).unwrap_or_else(|e| panic!("{e}: {}", self.text))
    }

    /// The `data:` payloads (not `[DONE]`) of an SSE body; asserts it ends with `[DONE]`.
    pub fn events(&self) -> Vec<Value> {
        let data: Vec<&str> = self
            .text
            .lines()
            .filter_map(|l| l.strip_prefix("data: "))
            .collect();
        assert_eq!(data.last(), Some(&"[DONE]"), "no [DONE]: {}", self.text);
        data[..data.len() - 1]
            .iter()
            .map(|d| serde_json::from_str(d).unwrap_or_else(|e| panic!("{e}: {d}")))
            .collect()
    }
}

/// POSTs JSON with extra headers and reads the whole answer.
pub async fn post(
    client: &reqwest::Client,
    url: &str,
    body: &Value,
    headers: &[(&str, &str)],
) -> Answer {
    let mut request = client.post(url).json(body);
    for (k, v) in headers {
        request = request.header(*k, *v);
    }
    let response = request.send().await.expect("request sent");
    let status = response.status().as_u16();
    let headers = response.headers().clone();
    let text = response.text().await.expect("body");
    Answer {
        status,
        headers,
        text,
    }
}

/// GETs a URL.
pub async fn get(client: &reqwest::Client, url: &str) -> Answer {
    let response = client.get(url).send().await.expect("request sent");
    let status = response.status().as_u16();
    let headers = response.headers().clone();
    let text = response.text().await.expect("body");
    Answer {
        status,
        headers,
        text,
    }
}

/// A Prometheus sample's value (`name{labels}` as written, or `name` alone).
pub fn metric(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
}

/// Polls `f` every 50 ms until it is true, for at most `limit`.
pub async fn eventually(limit: Duration, mut f: impl AsyncFnMut() -> bool) -> bool {
    let deadline = Instant::now() + limit;
    loop {
        if f().await {
            return true;
        }
        if Instant::now() > deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A stream being read: events as they arrive.
pub struct Stream {
    pub status: u16,
    pub upstream: Option<String>,
    chunks: futures_util::stream::BoxStream<'static, reqwest::Result<bytes::Bytes>>,
    buf: String,
}

impl Stream {
    pub async fn open(client: &reqwest::Client, url: &str, body: &Value) -> Stream {
        let response = client.post(url).json(body).send().await.expect("sent");
        Stream {
            status: response.status().as_u16(),
            upstream: response
                .headers()
                .get("x-kimi-upstream")
                .and_then(|v| v.to_str().ok())
                .map(str::to_owned),
            chunks: response.bytes_stream().boxed(),
            buf: String::new(),
        }
    }

    /// The next `data:` payload, or `None` at the end of the body.
    pub async fn next(&mut self) -> Option<String> {
        loop {
            if let Some(end) = self.buf.find("\n\n") {
                let event: String = self.buf.drain(..end + 2).collect();
                if let Some(data) = event.lines().find_map(|l| l.strip_prefix("data: ")) {
                    return Some(data.to_string());
                }
                continue;
            }
            match self.chunks.next().await {
                Some(Ok(bytes)) => self.buf.push_str(&String::from_utf8_lossy(&bytes)),
                _ => return None,
            }
        }
    }
}

/// Limits count fixed minutes of the wall clock, so a test that must see several requests
/// in one minute waits out the last seconds of a minute first.
pub fn clear_of_minute_end() {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    if secs % 60 >= 45 {
        std::thread::sleep(std::time::Duration::from_secs(61 - secs % 60));
    }
}
