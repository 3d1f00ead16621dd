//! `kimi-infer serve` as operators run it: the start banner and access log on stderr,
//! text or JSON, SIGTERM with a drain deadline and a second signal, and the errors for
//! impossible sizes (said once, with the flag, instead of an abort).

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Output, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

fn bin() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_kimi-infer"));
    c.env(
        "XDG_CACHE_HOME",
        std::env::temp_dir().join("kimi-infer-cli-tests"),
    )
    .env_remove("KIMI_LOG")
    .env_remove("KIMI_API_KEY");
    c
}

fn run(args: &[&str]) -> Output {
    bin().args(args).output().expect("binary runs")
}

/// A `serve` process on the built-in demo model, its stderr collected.
struct Server {
    child: Child,
    addr: SocketAddr,
    log: Arc<Mutex<String>>,
}

impl Server {
    fn start(args: &[&str]) -> Server {
        let mut child = bin()
            .args(["serve", "--port", "0"])
            .args(args)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("serve starts");
        let stderr = child.stderr.take().expect("stderr");
        let log = Arc::new(Mutex::new(String::new()));
        let (tx, rx) = std::sync::mpsc::channel();
        {
            let log = Arc::clone(&log);
            std::thread::spawn(move || {
                for line in BufReader::new(stderr).lines() {
                    let Ok(line) = line else { break };
                    if let Some(addr) = line
                        .split("on http://")
                        .nth(1)
                        .filter(|_| line.contains("serving `"))
                        .and_then(|a| a.split(['"', ' ']).next())
                        .and_then(|a| a.parse::<SocketAddr>().ok())
                    {
                        let _ = tx.send(addr);
                    }
                    let mut log = log.lock().expect("lock");
                    log.push_str(&line);
                    log.push('\n');
                }
            });
        }
        let addr = rx
            .recv_timeout(Duration::from_secs(120))
            .unwrap_or_else(|_| panic!("no banner: {}", log.lock().expect("lock")));
        Server { child, addr, log }
    }

    fn log(&self) -> String {
        self.log.lock().expect("lock").clone()
    }

    fn signal(&self, name: &str) {
        let status = Command::new("kill")
            .args([&format!("-{name}"), &self.child.id().to_string()])
            .status()
            .expect("kill runs");
        assert!(status.success());
    }

    /// Waits for the process to end, at most `limit`.
    fn wait(&mut self, limit: Duration) -> Option<ExitStatus> {
        let deadline = Instant::now() + limit;
        loop {
            if let Some(status) = self.child.try_wait().expect("try_wait") {
                return Some(status);
            }
            if Instant::now() > deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A request with `Connection: close`; the status and the whole response.
fn http(addr: SocketAddr, method: &str, path: &str, headers: &[&str], body: &str) -> (u16, String) {
    let mut stream = TcpStream::connect(addr).expect("connect");
    stream
        .set_read_timeout(Some(Duration::from_secs(60)))
        .expect("timeout");
    let mut head = format!("{method} {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n");
    for h in headers {
        head += &format!("{h}\r\n");
    }
    head += &format!("Content-Length: {}\r\n\r\n", body.len());
    stream.write_all(head.as_bytes()).expect("send");
    stream.write_all(body.as_bytes()).expect("send");
    let mut out = String::new();
    let _ = stream.read_to_string(&mut out);
    let status = out.get(9..12).and_then(|s| s.parse().ok()).unwrap_or(0);
    (status, out)
}

/// Starts a stream far longer than the test and reads until tokens flow.
fn long_stream(addr: SocketAddr) -> TcpStream {
    let body = r#"{"messages": [{"role": "user", "content": "Talk"}], "stream": true,
        "ignore_eos": true, "n": 16, "max_tokens": 1500, "temperature": 0}"#;
    let mut stream = TcpStream::connect(addr).expect("connect");
    let head = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\n\r\n{body}",
        body.len()
    );
    stream.write_all(head.as_bytes()).expect("send");
    stream
        .set_read_timeout(Some(Duration::from_secs(30)))
        .expect("timeout");
    let mut seen = Vec::new();
    let mut buf = [0u8; 4096];
    while seen.windows(7).filter(|w| w == b"content").count() < 20 {
        let n = stream.read(&mut buf).expect("read");
        assert!(n > 0, "stream ended early");
        seen.extend_from_slice(&buf[..n]);
    }
    stream
}

#[test]
fn banner_and_access_log_on_stderr_in_text_and_json() {
    let server = Server::start(&["--api-key", "sk-never-logged", "--host", "127.0.0.1"]);
    let (status, _) = http(
        server.addr,
        "POST",
        "/v1/completions",
        &[
            "Authorization: Bearer sk-never-logged",
            "Content-Type: application/json",
        ],
        r#"{"prompt": "Hello", "max_tokens": 3, "temperature": 0}"#,
    );
    assert_eq!(status, 200);
    let (status, _) = http(server.addr, "GET", "/v1/models", &[], "");
    assert_eq!(status, 401);
    std::thread::sleep(Duration::from_millis(200));
    let log = server.log();
    for part in [
        "model   ",
        "parameters",
        "cache   ",
        "blocks of 16 tokens",
        "CPU threads",
        "timeouts: keep-alive 5s, body 60s, request 600s, shutdown 30s",
        "auth    1 API key",
        "kimi_server::access: request method=POST path=/v1/completions status=200",
        "completion_tokens=3",
        "key=key-1",
        "status=401",
    ] {
        assert!(log.contains(part), "{part:?} missing in:\n{log}");
    }
    assert!(!log.contains("sk-never-logged"), "{log}");
    assert!(
        !log.contains('\u{1b}'),
        "ANSI escapes in a piped log:\n{log}"
    );
    assert!(!log.contains("without --api-key"), "{log}");
    drop(server);

    let server = Server::start(&["--host", "0.0.0.0", "--log-format", "json"]);
    let (status, _) = http(server.addr, "GET", "/v1/models", &[], "");
    assert_eq!(status, 200);
    std::thread::sleep(Duration::from_millis(200));
    let log = server.log();
    let events: Vec<serde_json::Value> = log
        .lines()
        .filter(|l| l.starts_with('{'))
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
        .collect();
    let warned = events.iter().any(|e| {
        e["level"] == "WARN"
            && e["message"]
                .as_str()
                .is_some_and(|m| m.contains("without --api-key"))
    });
    assert!(warned, "no warning for an open bind without a key:\n{log}");
    let access = events
        .iter()
        .find(|e| e["target"] == "kimi_server::access")
        .unwrap_or_else(|| panic!("no access event:\n{log}"));
    assert_eq!(access["path"], "/v1/models");
    assert_eq!(access["status"], 200);
    assert_eq!(access["key"], "none");
    assert!(access["latency_ms"].is_f64(), "{access}");
    assert!(access["request_id"]
        .as_str()
        .is_some_and(|id| id.starts_with("req-")));
}

#[test]
fn sigterm_drains_until_the_deadline_and_a_second_signal_exits_at_once() {
    // A stream longer than the deadline is cut when it passes; the exit is clean.
    let mut server = Server::start(&["--shutdown-timeout", "1"]);
    let mut stream = long_stream(server.addr);
    let started = Instant::now();
    server.signal("TERM");
    let status = server.wait(Duration::from_secs(20)).expect("exited");
    let waited = started.elapsed();
    assert!(status.success(), "{status:?}\n{}", server.log());
    assert!(
        waited >= Duration::from_millis(900) && waited < Duration::from_secs(10),
        "{waited:?}"
    );
    let mut rest = Vec::new();
    let _ = stream.read_to_end(&mut rest);
    assert!(!String::from_utf8_lossy(&rest).contains("[DONE]"));
    assert!(
        server.log().contains("shutdown timeout (1s) passed"),
        "{}",
        server.log()
    );

    // No deadline: the first signal waits for the stream, the second ends it now.
    let mut server = Server::start(&["--shutdown-timeout", "0"]);
    let _stream = long_stream(server.addr);
    server.signal("TERM");
    assert!(
        server.wait(Duration::from_millis(1500)).is_none(),
        "did not wait"
    );
    let started = Instant::now();
    server.signal("INT");
    let status = server.wait(Duration::from_secs(10)).expect("exited");
    assert!(started.elapsed() < Duration::from_secs(3));
    assert_eq!(status.code(), Some(1), "{}", server.log());
    assert!(server.log().contains("second signal"), "{}", server.log());

    // Two signals at once are one request (a process group's signal reaches a rank
    // launcher's rank 0 directly and passed on): it drains; a later one exits.
    let mut server = Server::start(&["--shutdown-timeout", "0"]);
    let _stream = long_stream(server.addr);
    server.signal("TERM");
    server.signal("TERM");
    assert!(
        server.wait(Duration::from_millis(1500)).is_none(),
        "exited on a doubled signal"
    );
    server.signal("INT");
    let status = server.wait(Duration::from_secs(10)).expect("exited");
    assert_eq!(status.code(), Some(1), "{}", server.log());

    // An idle server exits at once.
    let mut server = Server::start(&[]);
    let started = Instant::now();
    server.signal("TERM");
    let status = server.wait(Duration::from_secs(10)).expect("exited");
    assert!(status.success() && started.elapsed() < Duration::from_secs(3));
}

/// The one `error:` line of a failed run, checked to say `needle` once.
fn one_error(o: &Output, needle: &str) -> String {
    let stderr = String::from_utf8_lossy(&o.stderr).into_owned();
    assert_eq!(o.status.code(), Some(1), "{stderr}");
    let errors: Vec<&str> = stderr.lines().filter(|l| l.starts_with("error:")).collect();
    assert_eq!(errors.len(), 1, "{stderr}");
    assert_eq!(errors[0].matches(needle).count(), 1, "{stderr}");
    errors[0].to_string()
}

fn huge_config(dir: &Path) -> PathBuf {
    let base = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../fixtures/kimi-linear/hub-f32-sharded/config.json");
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(base).expect("fixture")).expect("json");
    config["vocab_size"] = (1u64 << 24).into();
    config["hidden_size"] = (1u64 << 20).into();
    let path = dir.join("huge.config.json");
    std::fs::write(&path, config.to_string()).expect("write");
    path
}

#[test]
fn impossible_sizes_are_errors_naming_the_flag() {
    let line = one_error(
        &run(&["serve", "--max-num-seqs", "0"]),
        "--max-num-seqs must be at least 1",
    );
    assert!(!line.contains("memory"), "{line}");
    let line = one_error(
        &run(&["serve", "--num-gpu-blocks-override", "100000000000"]),
        "--num-gpu-blocks-override 100000000000",
    );
    assert!(
        line.contains("cache pool") && line.contains("GiB"),
        "{line}"
    );
    one_error(
        &run(&["serve", "--num-gpu-blocks-override", "18446744073709551615"]),
        "--num-gpu-blocks-override",
    );
    one_error(
        &run(&["serve", "--max-num-seqs", "9223372036854775807"]),
        "--max-num-seqs",
    );
    one_error(
        &run(&["serve", "--max-model-len", "100000000"]),
        "--max-model-len 100000000 is more than the model's context",
    );
    let dir = tempfile::tempdir().expect("tempdir");
    let config = huge_config(dir.path());
    let config = config.to_str().expect("utf-8");
    let line = one_error(&run(&["bench", "--random-config", config]), "bf16 weights");
    assert!(line.contains("more than the"), "{line}");
    let out = dir.path().join("huge.gguf");
    let line = one_error(
        &run(&[
            "convert",
            "--random-config",
            config,
            "--out",
            out.to_str().expect("utf-8"),
        ]),
        "largest tensor",
    );
    assert!(line.contains("more than the"), "{line}");
}

#[test]
fn a_config_error_is_said_once() {
    let dir = tempfile::tempdir().expect("tempdir");
    let fixture =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/kimi-linear/hub-f32-sharded");
    for entry in std::fs::read_dir(&fixture).expect("fixture") {
        let p = entry.expect("entry").path();
        std::fs::copy(&p, dir.path().join(p.file_name().expect("name"))).expect("copy");
    }
    let path = dir.path().join("config.json");
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).expect("config")).expect("json");
    config["rms_norm_eps"] = serde_json::json!(-1.0);
    std::fs::write(&path, config.to_string()).expect("write");
    let model = dir.path().to_str().expect("utf-8");
    for args in [
        vec!["run", "--model", model, "--prompt", "hi"],
        vec!["serve", "--model", model],
        vec!["inspect", "--model", model],
    ] {
        let line = one_error(&run(&args), "rms_norm_eps");
        assert!(line.contains("config.json"), "{line}");
    }
}

/// A K3 model split over two ranks serves: greedy completions equal the one-rank server's.
#[test]
fn a_server_split_over_two_ranks_answers_as_one_rank_does() {
    let k3 = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/kimi-k3/k3-tiny-7l");
    let model = k3.to_str().expect("utf-8");
    let body =
        r#"{"model":"m","prompt":[1,5,9,2,7],"max_tokens":8,"temperature":0,"ignore_eos":true}"#;
    let mut answers = Vec::new();
    for extra in [&[][..], &["--tensor-parallel-size", "2"][..]] {
        let mut args = vec!["--model", model, "--served-model-name", "m"];
        args.extend(extra);
        let server = Server::start(&args);
        let (status, response) = http(
            server.addr,
            "POST",
            "/v1/completions",
            &["Content-Type: application/json"],
            body,
        );
        assert_eq!(status, 200, "{extra:?}: {response}\n{}", server.log());
        let json = response.split("\r\n\r\n").nth(1).expect("body");
        let v: serde_json::Value = serde_json::from_str(json).expect("json");
        answers.push(v["choices"][0]["text"].as_str().expect("text").to_string());
    }
    assert_eq!(answers[0], answers[1]);
}

#[test]
fn bench_counts_the_parameters_of_a_gguf_model() {
    let demo =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models/SmolLM2-135M-Instruct.Q4_1.gguf");
    if !demo.exists() {
        eprintln!(
            "SKIPPED: {} is absent (scripts/fetch_demo_model.sh)",
            demo.display()
        );
        return;
    }
    let o = run(&[
        "bench",
        "--model",
        demo.to_str().expect("utf-8"),
        "--prompt-len",
        "8",
        "--gen-len",
        "2",
        "--repeats",
        "1",
    ]);
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    // SmolLM2-135M: 134,515,008 stored values, all used by every token.
    assert!(
        stdout.contains("(134515008 params, 134515008 active)"),
        "{stdout}"
    );
}

#[test]
fn a_tool_call_parser_the_model_cannot_speak_is_refused_at_start() {
    let demo =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models/SmolLM2-135M-Instruct.Q4_1.gguf");
    if !demo.exists() {
        eprintln!(
            "SKIPPED: {} is absent (scripts/fetch_demo_model.sh)",
            demo.display()
        );
        return;
    }
    let model = demo.to_str().expect("utf-8");
    one_error(
        &run(&["serve", "--model", model, "--tool-call-parser", "kimi"]),
        "the tokenizer has no Kimi tool-call tokens",
    );
}

/// Peak resident memory of process `pid`, in bytes.
fn peak_rss(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|kb| kb.parse::<u64>().ok())
        .map_or(0, |kb| kb * 1024)
}

/// The issue's case on the real demo model (byte-level BPE from the GGUF): two 30 MB chat
/// messages at once, inside the 32 MiB body limit. Tokenized whole they took ~20 s and
/// ~3 GB each; refused from their length they cost a parse and a template render.
#[test]
fn huge_prompts_cost_a_length_check_on_the_demo_model() {
    let demo =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models/SmolLM2-135M-Instruct.Q4_1.gguf");
    if !demo.exists() {
        eprintln!(
            "SKIPPED: {} is absent (scripts/fetch_demo_model.sh)",
            demo.display()
        );
        return;
    }
    let server = Server::start(&[
        "--model",
        demo.to_str().expect("utf-8"),
        "--max-num-seqs",
        "4",
    ]);
    let body = Arc::new(
        serde_json::json!({"messages": [{"role": "user", "content": "hello world ".repeat(2_500_000)}]})
            .to_string(),
    );
    let before = peak_rss(server.child.id());
    let started = Instant::now();
    let requests: Vec<_> = (0..2)
        .map(|_| {
            let (addr, body) = (server.addr, Arc::clone(&body));
            std::thread::spawn(move || {
                http(
                    addr,
                    "POST",
                    "/v1/chat/completions",
                    &["Content-Type: application/json"],
                    &body,
                )
            })
        })
        .collect();
    for request in requests {
        let (status, text) = request.join().expect("request thread");
        assert_eq!(status, 400, "{}", &text[..text.len().min(300)]);
        assert!(text.contains("context_length_exceeded"), "{text}");
    }
    let elapsed = started.elapsed();
    let peak = peak_rss(server.child.id());
    eprintln!(
        "two 30 MB prompts: {elapsed:?}, peak RSS {} MiB (idle {} MiB)",
        peak >> 20,
        before >> 20
    );
    assert!(elapsed < Duration::from_secs(10), "took {elapsed:?}");
    assert!(
        peak < 1536 << 20,
        "peak RSS {} MiB (before the requests: {} MiB)",
        peak >> 20,
        before >> 20
    );
    let (status, _) = http(server.addr, "GET", "/health", &[], "");
    assert_eq!(status, 200);
}
