//! MCP servers through the official Rust SDK (`rmcp`): a stdio child process or a
//! streamable-HTTP endpoint. Their tools are listed once at start; a call on a broken
//! connection reconnects once before it gives up.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use reqwest::header::{HeaderName, HeaderValue};
use rmcp::model::CallToolRequestParams;
use rmcp::service::{Peer, RunningService, ServiceError};
use rmcp::transport::streamable_http_client::StreamableHttpClientTransportConfig;
use rmcp::transport::{StreamableHttpClientTransport, TokioChildProcess};
use rmcp::{RoleClient, ServiceExt};
use serde_json::{Map, Value};
use tokio::io::AsyncBufReadExt;

use super::{seconds, Tool, ToolKind, ToolOutput};
use crate::config::{expand_env, resolve, McpConfig};
use crate::schema::ArgsSchema;

/// How to reach a server.
#[derive(Debug, Clone)]
enum Endpoint {
    Stdio {
        argv: Vec<String>,
        cwd: Option<PathBuf>,
        env: Vec<(String, String)>,
    },
    Http {
        url: String,
        bearer: Option<String>,
        headers: HashMap<HeaderName, HeaderValue>,
    },
}

struct Connection {
    service: RunningService<RoleClient, ()>,
    generation: u64,
}

/// One configured MCP server and its connection.
pub struct McpServer {
    name: String,
    endpoint: Endpoint,
    timeout: Duration,
    max_bytes: usize,
    connection: tokio::sync::Mutex<Option<Connection>>,
}

impl std::fmt::Debug for McpServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("McpServer")
            .field("name", &self.name)
            .field("endpoint", &self.endpoint)
            .finish_non_exhaustive()
    }
}

impl McpServer {
    /// Connects to the server of `config` and lists its tools.
    ///
    /// # Errors
    ///
    /// A bad table, or a server that cannot be started, reached or listed.
    pub async fn start(
        config: &McpConfig,
        base_dir: &Path,
    ) -> Result<(Arc<McpServer>, Vec<Tool>), String> {
        let endpoint = match (&config.command, &config.url) {
            (Some(argv), None) => {
                if argv.is_empty() {
                    return Err("`command` is empty".into());
                }
                let env = config
                    .env
                    .iter()
                    .map(|(k, v)| {
                        expand_env(v)
                            .map(|v| (k.clone(), v))
                            .map_err(|e| format!("env `{k}`: {e}"))
                    })
                    .collect::<Result<_, _>>()?;
                Endpoint::Stdio {
                    argv: argv.clone(),
                    cwd: config.cwd.as_ref().map(|c| resolve(base_dir, c)),
                    env,
                }
            }
            (None, Some(url)) => {
                reqwest::Url::parse(url).map_err(|e| format!("`url` `{url}`: {e}"))?;
                let mut bearer = None;
                let mut headers = HashMap::new();
                for (name, value) in &config.headers {
                    let value = expand_env(value).map_err(|e| format!("header `{name}`: {e}"))?;
                    if name.eq_ignore_ascii_case("authorization") {
                        let token = value
                            .strip_prefix("Bearer ")
                            .or_else(|| value.strip_prefix("bearer "))
                            .unwrap_or(&value);
                        bearer = Some(token.to_string());
                        continue;
                    }
                    let header = HeaderName::from_bytes(name.as_bytes())
                        .map_err(|_| format!("`{name}` is not a valid header name"))?;
                    let mut value = HeaderValue::from_str(&value)
                        .map_err(|_| format!("header `{name}`: not a valid header value"))?;
                    value.set_sensitive(true);
                    headers.insert(header, value);
                }
                Endpoint::Http {
                    url: url.clone(),
                    bearer,
                    headers,
                }
            }
            _ => return Err("give exactly one of `command` (stdio) and `url` (HTTP)".into()),
        };
        let server = Arc::new(McpServer {
            name: config.name.clone(),
            endpoint,
            timeout: seconds(config.timeout_seconds, "timeout_seconds")?,
            max_bytes: config.max_output_bytes.max(1),
            connection: tokio::sync::Mutex::new(None),
        });
        let peer = server.peer().await?;
        let listed = tokio::time::timeout(server.timeout, peer.list_all_tools())
            .await
            .map_err(|_| "listing its tools timed out".to_string())?
            .map_err(|e| format!("listing its tools failed: {e}"))?;
        let mut tools = Vec::new();
        for remote in listed {
            let remote_name = remote.name.to_string();
            if let Some(wanted) = &config.tools {
                if !wanted.contains(&remote_name) {
                    continue;
                }
            }
            let mut schema = Value::Object((*remote.input_schema).clone());
            if config.strict {
                close_objects(&mut schema);
            }
            let args = match ArgsSchema::new(schema) {
                Ok(args) => args,
                Err(e) => {
                    tracing::warn!(
                        "MCP server `{}`: tool `{remote_name}` left out: {e}",
                        config.name
                    );
                    continue;
                }
            };
            tools.push(Tool {
                name: format!("{}{remote_name}", config.prefix),
                description: remote.description.as_deref().unwrap_or("").to_string(),
                args,
                kind: ToolKind::Mcp(McpTool {
                    server: Arc::clone(&server),
                    remote_name,
                }),
            });
        }
        if let Some(wanted) = &config.tools {
            for w in wanted {
                if !tools.iter().any(|t| match &t.kind {
                    ToolKind::Mcp(m) => &m.remote_name == w,
                    _ => false,
                }) {
                    return Err(format!("the server has no tool `{w}`"));
                }
            }
        }
        Ok((server, tools))
    }

    /// The live connection's peer, connecting first when there is none.
    async fn peer(&self) -> Result<Peer<RoleClient>, String> {
        self.peer_with_generation().await.map(|(peer, _)| peer)
    }

    async fn peer_with_generation(&self) -> Result<(Peer<RoleClient>, u64), String> {
        let mut slot = self.connection.lock().await;
        if let Some(c) = slot.as_ref() {
            if !c.service.is_closed() && !c.service.peer().is_transport_closed() {
                return Ok((c.service.peer().clone(), c.generation));
            }
        }
        let generation = slot.as_ref().map_or(0, |c| c.generation + 1);
        let service = tokio::time::timeout(self.timeout, self.connect())
            .await
            .map_err(|_| {
                format!(
                    "connecting timed out after {:.0} s",
                    self.timeout.as_secs_f64()
                )
            })??;
        let peer = service.peer().clone();
        *slot = Some(Connection {
            service,
            generation,
        });
        Ok((peer, generation))
    }

    async fn connect(&self) -> Result<RunningService<RoleClient, ()>, String> {
        match &self.endpoint {
            Endpoint::Stdio { argv, cwd, env } => {
                let mut command = tokio::process::Command::new(&argv[0]);
                command.args(&argv[1..]).envs(env.iter().cloned());
                if let Some(cwd) = cwd {
                    command.current_dir(cwd);
                }
                let (transport, stderr) = TokioChildProcess::builder(command)
                    .stderr(std::process::Stdio::piped())
                    .spawn()
                    .map_err(|e| format!("cannot start `{}`: {e}", argv[0]))?;
                if let Some(stderr) = stderr {
                    // The server's own log, kept at debug level.
                    let name = self.name.clone();
                    tokio::spawn(async move {
                        let mut lines = tokio::io::BufReader::new(stderr).lines();
                        while let Ok(Some(line)) = lines.next_line().await {
                            tracing::debug!(target: "kimi_agent::mcp", server = %name, "{line}");
                        }
                    });
                }
                ().serve(transport)
                    .await
                    .map_err(|e| format!("the MCP handshake failed: {e}"))
            }
            Endpoint::Http {
                url,
                bearer,
                headers,
            } => {
                crate::http::init_tls();
                let mut config = StreamableHttpClientTransportConfig::with_uri(url.as_str());
                if let Some(token) = bearer {
                    config = config.auth_header(token.clone());
                }
                config.custom_headers = headers.clone();
                let transport = StreamableHttpClientTransport::from_config(config);
                ().serve(transport)
                    .await
                    .map_err(|e| format!("the MCP handshake with {url} failed: {e}"))
            }
        }
    }

    /// Forgets the connection of `generation` (a newer one is kept).
    async fn drop_connection(&self, generation: u64) {
        let mut slot = self.connection.lock().await;
        if slot.as_ref().is_some_and(|c| c.generation == generation) {
            if let Some(mut c) = slot.take() {
                let _ = c.service.close_with_timeout(Duration::from_secs(2)).await;
            }
        }
    }

    /// Closes the connection (a stdio server is stopped).
    pub async fn close(&self) {
        let taken = self.connection.lock().await.take();
        if let Some(mut c) = taken {
            let _ = c.service.close_with_timeout(Duration::from_secs(5)).await;
        }
    }
}

/// One tool of an MCP server.
#[derive(Debug)]
pub struct McpTool {
    server: Arc<McpServer>,
    remote_name: String,
}

impl McpTool {
    /// The server's configured name.
    pub fn server_name(&self) -> &str {
        &self.server.name
    }

    /// Calls the tool; a broken connection is reopened once.
    pub async fn call(&self, args: Map<String, Value>) -> ToolOutput {
        let server = &self.server;
        for attempt in 0..2 {
            let (peer, generation) = match server.peer_with_generation().await {
                Ok(p) => p,
                Err(e) => {
                    return ToolOutput::error(format!(
                        "the MCP server `{}` is not reachable: {e}",
                        server.name
                    ))
                }
            };
            let params =
                CallToolRequestParams::new(self.remote_name.clone()).with_arguments(args.clone());
            let result = tokio::time::timeout(server.timeout, peer.call_tool(params)).await;
            match result {
                Err(_) => {
                    if peer.is_transport_closed() {
                        // It went away mid-call (it may have done the work): not retried.
                        server.drop_connection(generation).await;
                        return ToolOutput::error(format!(
                            "the MCP server `{}` closed the connection during the call",
                            server.name
                        ));
                    }
                    return ToolOutput::error(format!(
                        "the MCP server `{}` did not answer within {:.0} s",
                        server.name,
                        server.timeout.as_secs_f64()
                    ));
                }
                Ok(Ok(result)) => {
                    let json = serde_json::to_value(&result).unwrap_or(Value::Null);
                    return render_result(&json, server.max_bytes);
                }
                Ok(Err(e)) => {
                    let broken = matches!(
                        e,
                        ServiceError::TransportClosed | ServiceError::TransportSend(_)
                    );
                    if broken {
                        server.drop_connection(generation).await;
                        if attempt == 0 {
                            continue;
                        }
                    }
                    return ToolOutput::error(format!(
                        "the MCP server `{}` failed the call: {e}",
                        server.name
                    ));
                }
            }
        }
        ToolOutput::error(format!(
            "the MCP server `{}` closed the connection twice",
            server.name
        ))
    }
}

/// Sets `additionalProperties: false` on every object schema that has `properties` and
/// does not say otherwise, walking only the keywords that hold schemas.
fn close_objects(schema: &mut Value) {
    let Value::Object(map) = schema else { return };
    if map.contains_key("properties") && !map.contains_key("additionalProperties") {
        map.insert("additionalProperties".into(), Value::Bool(false));
    }
    for key in ["properties", "$defs", "definitions"] {
        if let Some(Value::Object(children)) = map.get_mut(key) {
            children.values_mut().for_each(close_objects);
        }
    }
    for key in ["anyOf", "oneOf", "allOf", "prefixItems"] {
        if let Some(Value::Array(children)) = map.get_mut(key) {
            children.iter_mut().for_each(close_objects);
        }
    }
    for key in ["items", "additionalProperties", "not"] {
        if let Some(child) = map.get_mut(key) {
            close_objects(child);
        }
    }
}

/// A `CallToolResult` (as JSON, so that new content kinds need no code here) as text.
fn render_result(result: &Value, max_bytes: usize) -> ToolOutput {
    let mut parts: Vec<String> = Vec::new();
    for block in result
        .get("content")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
    {
        let kind = block.get("type").and_then(Value::as_str).unwrap_or("");
        let text = match kind {
            "text" => block
                .get("text")
                .and_then(Value::as_str)
                .unwrap_or("")
                .to_string(),
            "image" | "audio" => format!(
                "[{kind}: {}, {} bytes of base64, not shown]",
                block.get("mimeType").and_then(Value::as_str).unwrap_or("?"),
                block
                    .get("data")
                    .and_then(Value::as_str)
                    .map_or(0, str::len)
            ),
            "resource" => match block.pointer("/resource/text").and_then(Value::as_str) {
                Some(text) => text.to_string(),
                None => format!(
                    "[resource {}]",
                    block
                        .pointer("/resource/uri")
                        .and_then(Value::as_str)
                        .unwrap_or("?")
                ),
            },
            "resource_link" => format!(
                "[resource link {}]",
                block.get("uri").and_then(Value::as_str).unwrap_or("?")
            ),
            other => format!("[{other} content]"),
        };
        parts.push(text);
    }
    if parts.is_empty() {
        if let Some(structured) = result.get("structuredContent") {
            parts.push(structured.to_string());
        }
    }
    let mut text = parts.join("\n");
    if text.len() > max_bytes {
        let total = text.len();
        let mut cut = max_bytes;
        while !text.is_char_boundary(cut) {
            cut -= 1;
        }
        text.truncate(cut);
        text.push_str(&format!(
            "\n[... the output was {total} bytes; cut at {max_bytes} ...]"
        ));
    }
    if result.get("isError") == Some(&Value::Bool(true)) {
        ToolOutput::error(text)
    } else {
        ToolOutput::ok(text)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn strict_closes_object_schemas() {
        let mut s = json!({"type": "object", "properties": {"a": {"type": "object",
            "properties": {}}, "b": {"type": "object", "properties": {},
            "additionalProperties": true}, "properties": {"type": "string"}}});
        close_objects(&mut s);
        assert_eq!(s["additionalProperties"], false);
        assert_eq!(s["properties"]["a"]["additionalProperties"], false);
        assert_eq!(s["properties"]["b"]["additionalProperties"], true);
        assert!(s["properties"].get("additionalProperties").is_none());
    }

    #[test]
    fn results_become_text() {
        let r = json!({"content": [{"type": "text", "text": "a"},
            {"type": "image", "mimeType": "image/png", "data": "AAAA"}], "isError": false});
        let out = render_result(&r, 100);
        assert!(!out.is_error);
        assert_eq!(
            out.text,
            "a\n[image: image/png, 4 bytes of base64, not shown]"
        );
        let out = render_result(
            &json!({"content": [{"type": "text", "text": "bad"}],
            "isError": true}),
            100,
        );
        assert!(out.is_error && out.text == "error: bad");
        let out = render_result(&json!({"content": [], "structuredContent": {"x": 1}}), 100);
        assert_eq!(out.text, "{\"x\":1}");
        let out = render_result(&json!({"content": [{"type": "text", "text": "ééé"}]}), 3);
        assert!(out.text.starts_with("é\n[..."), "{}", out.text);
    }
}
