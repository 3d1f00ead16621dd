//! Real programs in the real sandbox: limits, allowlist, network and filesystem rules.

use std::path::Path;

use kimi_agent::{CallContext, Registry, ToolsFile};

async fn registry(toml: &str) -> Registry {
    let file = ToolsFile::parse(toml, Path::new("tools.toml")).expect("valid tools file");
    Registry::from_file(file, Path::new("tools.toml"))
        .await
        .expect("registry")
}

fn ctx(dir: &tempfile::TempDir) -> CallContext {
    CallContext {
        workdir: dir.path().to_owned(),
    }
}

const TOOLS: &str = r#"
[sandbox]
programs = ["sh", "echo", "cat", "python3", "head"]
timeout_seconds = 5
cpu_seconds = 2
memory_mb = 256
max_output_bytes = 4096

[[tool]]
type = "shell"
name = "echo"
command = ["echo", "{text}"]
parameters = { type = "object", properties = { text = { type = "string", maxLength = 100 } }, required = ["text"] }

[[tool]]
type = "shell"
name = "sh"
command = ["sh", "-c", "{script}"]
allow_option_values = true
parameters = { type = "object", properties = { script = { type = "string" } }, required = ["script"] }

[[tool]]
type = "shell"
name = "cat"
command = ["cat", "{path}"]
parameters = { type = "object", properties = { path = { type = "string" } }, required = ["path"] }

[[tool]]
type = "code"
"#;

#[tokio::test]
async fn shell_tools_run_confined() {
    let r = registry(TOOLS).await;
    let dir = tempfile::tempdir().unwrap();
    let c = ctx(&dir);
    let out = r.call("echo", r#"{"text": "hello; rm -rf /"}"#, &c).await;
    assert_eq!(out.text, "hello; rm -rf /\n");
    assert!(!out.is_error);

    // Schema violations never run anything.
    let out = r.call("echo", r#"{"text": 5}"#, &c).await;
    assert!(out.is_error && out.text.contains("schema"), "{}", out.text);
    let out = r.call("echo", "{not json", &c).await;
    assert!(
        out.is_error && out.text.contains("not valid JSON"),
        "{}",
        out.text
    );
    let out = r.call("rm", "{}", &c).await;
    assert!(
        out.is_error && out.text.contains("no tool named `rm`"),
        "{}",
        out.text
    );

    // Landlock's rules (execute allowlist, filesystem) need a kernel that has it.
    let landlock = kimi_agent::sandbox::Sandbox::landlock_enforced();
    if !landlock {
        eprintln!("WARNING: this kernel does not enforce Landlock: its checks are skipped");
    }

    // A program outside the allowlist cannot be executed from inside the sandbox either.
    let out = r.call("sh", r#"{"script": "ls /"}"#, &c).await;
    if landlock {
        assert!(out.is_error, "{}", out.text);
        assert!(out.text.contains("ermission denied"), "{}", out.text);
    }

    // A prompt-injected program outside the allowlist is refused inside the sandbox too.
    let code = r#"{"code": "import subprocess\nsubprocess.run(['ls', '/'])"}"#;
    let out = r.call("run_python", code, &c).await;
    if landlock {
        assert!(
            out.is_error && out.text.contains("PermissionError"),
            "{}",
            out.text
        );
    }

    // Hangs are killed at the wall-clock limit.
    let start = std::time::Instant::now();
    let out = r
        .call("sh", r#"{"script": "while :; do :; done"}"#, &c)
        .await;
    assert!(out.is_error, "{}", out.text);
    assert!(start.elapsed().as_secs_f64() < 8.0);
    let out = r
        .call("sh", r#"{"script": "read x < /dev/zero; sleep 100"}"#, &c)
        .await;
    assert!(out.is_error, "{}", out.text);

    // Crashes are reported.
    let out = r.call("sh", r#"{"script": "kill -SEGV $$"}"#, &c).await;
    assert!(out.is_error && out.text.contains("SIGSEGV"), "{}", out.text);
    let out = r
        .call("sh", r#"{"script": "echo out; echo err >&2; exit 3"}"#, &c)
        .await;
    assert!(
        out.is_error && out.text.contains("status 3") && out.text.contains("err"),
        "{}",
        out.text
    );

    // 100 MB of output: head and tail kept, the rest counted.
    let code = r#"{"code": "import sys\nsys.stdout.write('a' * (100 << 20))\nprint('END')"}"#;
    let out = r.call("run_python", code, &c).await;
    assert!(out.text.len() < 10_000, "{}", out.text.len());
    assert!(
        out.text.contains("bytes elided") && out.text.contains("END"),
        "{}",
        &out.text[..200]
    );

    // Invalid UTF-8 is said.
    let out = r
        .call(
            "run_python",
            r#"{"code": "import sys; sys.stdout.buffer.write(b'ok \\xff\\xfe')"}"#,
            &c,
        )
        .await;
    assert!(
        out.text.contains("not valid UTF-8") && out.text.contains('\u{FFFD}'),
        "{}",
        out.text
    );

    // Memory and CPU limits.
    let out = r
        .call("run_python", r#"{"code": "x = bytearray(1 << 30)"}"#, &c)
        .await;
    assert!(
        out.is_error && out.text.contains("MemoryError"),
        "{}",
        out.text
    );
    let out = r
        .call("run_python", r#"{"code": "while True: pass"}"#, &c)
        .await;
    assert!(
        out.is_error && (out.text.contains("SIGXCPU") || out.text.contains("SIGKILL")),
        "{}",
        out.text
    );

    // No network.
    let out = r
        .call(
            "run_python",
            r#"{"code": "import socket\ns = socket.socket()\ns.connect(('127.0.0.1', 9))"}"#,
            &c,
        )
        .await;
    assert!(
        out.is_error && out.text.contains("PermissionError"),
        "{}",
        out.text
    );

    // The working directory is writable, the rest of the filesystem is not readable.
    let out = r
        .call(
            "run_python",
            r#"{"code": "open('f.txt', 'w').write('kept'); print(open('f.txt').read())"}"#,
            &c,
        )
        .await;
    assert_eq!(out.text, "kept\n", "{}", out.text);
    assert_eq!(
        std::fs::read_to_string(dir.path().join("f.txt")).unwrap(),
        "kept"
    );
    let secret = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(secret.path(), "secret").unwrap();
    let args = serde_json::json!({"path": secret.path()}).to_string();
    let out = r.call("cat", &args, &c).await;
    if landlock {
        assert!(
            out.is_error && out.text.contains("ermission denied"),
            "{}",
            out.text
        );
    }
    // Values that look like options are refused.
    let out = r.call("cat", r#"{"path": "--version"}"#, &c).await;
    assert!(
        out.is_error && out.text.contains("starts with `-`"),
        "{}",
        out.text
    );
}

#[tokio::test]
async fn programs_outside_the_allowlist_are_refused_at_load() {
    let text = r#"
[sandbox]
programs = ["echo"]
[[tool]]
type = "shell"
name = "net"
command = ["curl", "{url}"]
parameters = { type = "object", properties = { url = { type = "string" } } }
"#;
    let file = ToolsFile::parse(text, Path::new("t.toml")).unwrap();
    let err = Registry::from_file(file, Path::new("t.toml"))
        .await
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("tool `net`")
            && err.contains("curl")
            && err.contains("not in [sandbox] programs"),
        "{err}"
    );
}
