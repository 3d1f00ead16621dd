//! REST, OpenAPI and fetch tools against a real HTTP server started by the test, and MCP
//! tools against a real MCP server (the `mcp` package's FastMCP, tests/agent/mcp_server.py)
//! over stdio and streamable HTTP.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use axum::extract::Path as UrlPath;
use axum::http::{HeaderMap, StatusCode};
use axum::routing::{get, post};
use axum::{Json, Router};
use kimi_agent::{CallContext, Registry, ToolsFile};
use serde_json::{json, Value};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// A small real API: weather, echo, a huge body, a slow one, invalid UTF-8, a redirect,
/// a route that wants a bearer token, and its own OpenAPI document.
async fn start_api() -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let openapi = json!({
        "openapi": "3.0.3",
        "info": {"title": "test", "version": "1"},
        "servers": [{"url": format!("http://{addr}")}],
        "paths": {
            "/weather/{city}": {"get": {
                "operationId": "getWeather",
                "summary": "Weather of a city",
                "parameters": [
                    {"name": "city", "in": "path", "required": true, "schema": {"type": "string"}},
                    {"name": "units", "in": "query", "schema": {"$ref": "#/components/schemas/Units"}}
                ]
            }},
            "/echo": {"post": {
                "operationId": "echo",
                "requestBody": {"required": true, "content": {"application/json": {
                    "schema": {"type": "object", "properties": {"msg": {"type": "string"}},
                               "required": ["msg"]}}}}
            }}
        },
        "components": {"schemas": {"Units": {"type": "string", "enum": ["metric", "imperial"]}}}
    });
    let app = Router::new()
        .route(
            "/weather/{city}",
            get(
                |UrlPath(city): UrlPath<String>,
                 query: axum::extract::Query<std::collections::HashMap<String, String>>| async move {
                    Json(json!({"city": city, "units": query.get("units"), "temp": 21}))
                },
            ),
        )
        .route("/echo", post(|Json(body): Json<Value>| async move { Json(body) }))
        .route("/big", get(|| async { "x".repeat(5 << 20) }))
        .route(
            "/slow",
            get(|| async {
                tokio::time::sleep(Duration::from_secs(30)).await;
                "late"
            }),
        )
        .route("/bytes", get(|| async { vec![b'o', b'k', 0xff, 0xfe] }))
        .route(
            "/away",
            get(|| async {
                (StatusCode::FOUND, [("location", "http://example.invalid/")], "")
            }),
        )
        .route(
            "/secret",
            get(|headers: HeaderMap| async move {
                match headers.get("authorization").and_then(|v| v.to_str().ok()) {
                    Some("Bearer s3cret-token") => (StatusCode::OK, "welcome"),
                    _ => (StatusCode::UNAUTHORIZED, "no entry"),
                }
            }),
        )
        .route("/openapi.json", get(move || async move { Json(openapi) }));
    tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    addr
}

async fn registry_in(dir: &Path, toml: &str) -> Result<Registry, String> {
    let path = dir.join("tools.toml");
    std::fs::write(&path, toml).unwrap();
    let file = ToolsFile::read(&path).map_err(|e| e.to_string())?;
    Registry::from_file(file, &path)
        .await
        .map_err(|e| e.to_string())
}

fn ctx(dir: &Path) -> CallContext {
    CallContext {
        workdir: dir.to_owned(),
    }
}

#[tokio::test]
async fn rest_openapi_and_fetch_tools() {
    let addr = start_api().await;
    let dir = tempfile::tempdir().unwrap();
    let spec = reqwest_get(&format!("http://{addr}/openapi.json")).await;
    std::fs::write(dir.path().join("api.json"), spec).unwrap();
    std::env::set_var("KIMI_AGENT_TEST_TOKEN", "s3cret-token");
    let toml = format!(
        r#"
[[tool]]
type = "rest"
name = "weather"
url = "http://{addr}/weather/{{city}}"
parameters = {{ type = "object", properties = {{ city = {{ type = "string" }}, units = {{ type = "string" }} }}, required = ["city"] }}

[[tool]]
type = "rest"
name = "echo"
method = "POST"
url = "http://{addr}/echo"
parameters = {{ type = "object", properties = {{ msg = {{ type = "string" }} }} }}

[[tool]]
type = "rest"
name = "big"
url = "http://{addr}/big"
max_response_bytes = 1000

[[tool]]
type = "rest"
name = "slow"
url = "http://{addr}/slow"
timeout_seconds = 0.5

[[tool]]
type = "rest"
name = "secret"
url = "http://{addr}/secret"
headers = {{ Authorization = "Bearer ${{KIMI_AGENT_TEST_TOKEN}}" }}

[[tool]]
type = "rest"
name = "no_secret"
url = "http://{addr}/secret"

[[tool]]
type = "fetch"
allowed_hosts = ["127.0.0.1:{port}"]

[[openapi]]
spec = "api.json"
prefix = "api_"
"#,
        port = addr.port()
    );
    let r = registry_in(dir.path(), &toml).await.unwrap();
    let c = ctx(dir.path());

    let out = r
        .call(
            "weather",
            r#"{"city": "Paris/../x", "units": "metric"}"#,
            &c,
        )
        .await;
    let v: Value = serde_json::from_str(&out.text).unwrap();
    assert_eq!(v["city"], "Paris/../x");
    assert_eq!(v["units"], "metric");
    let out = r.call("echo", r#"{"msg": "hi"}"#, &c).await;
    assert_eq!(
        serde_json::from_str::<Value>(&out.text).unwrap(),
        json!({"msg": "hi"})
    );

    let out = r.call("big", "{}", &c).await;
    assert!(
        out.text.len() < 1200 && out.text.contains("longer than 1000 bytes"),
        "{}",
        out.text
    );
    let start = Instant::now();
    let out = r.call("slow", "{}", &c).await;
    assert!(
        out.is_error && out.text.contains("timed out"),
        "{}",
        out.text
    );
    assert!(start.elapsed() < Duration::from_secs(5));
    assert_eq!(r.call("secret", "{}", &c).await.text, "welcome");
    let out = r.call("no_secret", "{}", &c).await;
    assert!(out.is_error && out.text.contains("401"), "{}", out.text);

    // OpenAPI operations: path and query parameters, a JSON body, enums from $ref.
    let tool = r.get("api_getWeather").unwrap();
    assert_eq!(
        tool.parameters()["properties"]["units"]["enum"],
        json!(["metric", "imperial"])
    );
    let out = r
        .call(
            "api_getWeather",
            r#"{"city": "Oslo", "units": "imperial"}"#,
            &c,
        )
        .await;
    assert_eq!(
        serde_json::from_str::<Value>(&out.text).unwrap()["units"],
        "imperial"
    );
    let out = r
        .call(
            "api_getWeather",
            r#"{"city": "Oslo", "units": "kelvin"}"#,
            &c,
        )
        .await;
    assert!(out.is_error && out.text.contains("schema"), "{}", out.text);
    let out = r
        .call("api_echo", r#"{"body": {"msg": "via openapi"}}"#, &c)
        .await;
    assert_eq!(
        serde_json::from_str::<Value>(&out.text).unwrap()["msg"],
        "via openapi"
    );
    let out = r.call("api_echo", r#"{}"#, &c).await;
    assert!(out.is_error && out.text.contains("body"), "{}", out.text);

    // fetch: allowed host, invalid UTF-8, refused hosts and redirects.
    let out = r
        .call(
            "fetch",
            &json!({"url": format!("http://{addr}/weather/Rome")}).to_string(),
            &c,
        )
        .await;
    assert!(!out.is_error && out.text.contains("Rome"), "{}", out.text);
    let out = r
        .call(
            "fetch",
            &json!({"url": format!("http://{addr}/bytes")}).to_string(),
            &c,
        )
        .await;
    assert!(out.text.contains("not valid UTF-8"), "{}", out.text);
    let out = r
        .call("fetch", r#"{"url": "http://example.com/"}"#, &c)
        .await;
    assert!(
        out.is_error && out.text.contains("not an allowed host"),
        "{}",
        out.text
    );
    let out = r
        .call(
            "fetch",
            &json!({"url": format!("http://{addr}/away")}).to_string(),
            &c,
        )
        .await;
    assert!(
        out.is_error && out.text.contains("not an allowed host"),
        "{}",
        out.text
    );
    let out = r
        .call("fetch", r#"{"url": "file:///etc/passwd"}"#, &c)
        .await;
    assert!(out.is_error, "{}", out.text);
}

#[tokio::test]
async fn bad_tool_files_are_named() {
    let dir = tempfile::tempdir().unwrap();
    let cases = [
        ("[[tool]]\ntype = \"rest\"\nname = \"x\"\nurl = \"not a url\"\n", "tool `x`"),
        (
            "[[tool]]\ntype = \"rest\"\nname = \"x\"\nurl = \"http://h/\"\nheaders = { A = \"${KIMI_AGENT_NOT_SET_EVER}\" }\n",
            "KIMI_AGENT_NOT_SET_EVER",
        ),
        ("[[tool]]\ntype = \"fetch\"\nallowed_hosts = []\n", "allowed_hosts"),
        ("[[tool]]\ntype = \"code\"\n", "not in [sandbox] programs"),
        (
            "[[tool]]\ntype = \"rest\"\nname = \"a b\"\nurl = \"http://h/\"\n",
            "not a valid tool name",
        ),
        (
            "[[tool]]\ntype = \"rest\"\nname = \"x\"\nurl = \"http://h/\"\n[[tool]]\ntype = \"rest\"\nname = \"x\"\nurl = \"http://h/\"\n",
            "a second tool",
        ),
        ("[[openapi]]\nspec = \"missing.json\"\n", "missing.json"),
        ("[[mcp]]\nname = \"m\"\n", "exactly one of"),
        ("[[mcp]]\nname = \"m\"\ncommand = [\"/nonexistent/server\"]\n", "cannot start"),
    ];
    for (toml, expected) in cases {
        let err = registry_in(dir.path(), toml).await.unwrap_err();
        assert!(
            err.contains(expected) && err.contains("tools.toml"),
            "{toml}: {err}"
        );
    }
}

async fn reqwest_get(url: &str) -> String {
    kimi_agent::http::client_builder()
        .build()
        .unwrap()
        .get(url)
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap()
}

/// The Python with the `mcp` package (scripts/agent_test_deps.sh), if installed.
fn mcp_python() -> Option<PathBuf> {
    let python = root().join("target/agent-venv/bin/python");
    if python.exists() {
        Some(python)
    } else {
        eprintln!(
            "WARNING: target/agent-venv is missing (run scripts/agent_test_deps.sh): MCP tests \
             skipped"
        );
        None
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

async fn check_mcp_tools(r: &Registry, prefix: &str, c: &CallContext) {
    let name = |t: &str| format!("{prefix}{t}");
    let out = r.call(&name("add"), r#"{"a": 2, "b": 40}"#, c).await;
    assert_eq!(out.text, "42", "{out:?}");
    let out = r.call(&name("shout"), r#"{"text": "quiet"}"#, c).await;
    assert_eq!(out.text, "QUIET");
    let out = r.call(&name("add"), r#"{"a": "two", "b": 40}"#, c).await;
    assert!(out.is_error && out.text.contains("schema"), "{}", out.text);
    let out = r.call(&name("fail"), r#"{"reason": "testing"}"#, c).await;
    assert!(
        out.is_error && out.text.contains("failed on purpose: testing"),
        "{}",
        out.text
    );
    let out = r.call(&name("nap"), r#"{"seconds": 30}"#, c).await;
    assert!(
        out.is_error && out.text.contains("did not answer"),
        "{}",
        out.text
    );
}

#[tokio::test]
async fn mcp_servers_over_stdio_and_http() {
    let Some(python) = mcp_python() else { return };
    let server = root().join("tests/agent/mcp_server.py");
    let port = free_port();
    let mut http_server = tokio::process::Command::new(&python)
        .arg(&server)
        .args(["http", &port.to_string()])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    // Wait for the HTTP server to listen.
    let deadline = Instant::now() + Duration::from_secs(30);
    while tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .is_err()
    {
        assert!(
            Instant::now() < deadline,
            "the MCP HTTP server did not start"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let dir = tempfile::tempdir().unwrap();
    let toml = format!(
        r#"
[[mcp]]
name = "local"
command = ["{python}", "{server}", "stdio"]
timeout_seconds = 3

[[mcp]]
name = "remote"
url = "http://127.0.0.1:{port}/mcp"
prefix = "remote_"
tools = ["add", "shout", "fail", "nap"]
timeout_seconds = 3
"#,
        python = python.display(),
        server = server.display(),
    );
    let r = registry_in(dir.path(), &toml).await.unwrap();
    let c = ctx(dir.path());
    assert!(r.get("add").is_some() && r.get("remote_add").is_some());
    assert!(
        r.get("remote_crash").is_none(),
        "the `tools` filter applies"
    );
    assert_eq!(r.get("add").unwrap().kind(), "mcp:local");
    check_mcp_tools(&r, "", &c).await;
    check_mcp_tools(&r, "remote_", &c).await;

    // A server that dies: the call says so, the next call starts it again.
    let out = r.call("crash", "{}", &c).await;
    assert!(out.is_error, "{out:?}");
    let out = r.call("add", r#"{"a": 1, "b": 1}"#, &c).await;
    assert_eq!(out.text, "2", "{out:?}");
    r.shutdown().await;
    let _ = http_server.kill().await;
}
