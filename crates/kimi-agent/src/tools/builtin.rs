//! Built-in tools: code execution in the sandbox, and fetching a URL on an allowed host.

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use serde_json::{json, Map, Value};

use super::{seconds, CallContext, ToolOutput};
use crate::config::{CodeToolConfig, FetchToolConfig, SandboxConfig};
use crate::http::{body_text, describe_error, read_capped};
use crate::sandbox::{Limits, Sandbox};

/// Runs the model's program text with an allowlisted interpreter.
#[derive(Debug)]
pub struct CodeTool {
    interpreter: PathBuf,
    interpreter_args: Vec<String>,
    extension: String,
    limits: Limits,
    counter: AtomicU64,
}

impl CodeTool {
    /// The tool, its description and its parameter schema.
    ///
    /// # Errors
    ///
    /// An interpreter outside the allowlist, a bad extension or limit.
    pub fn new(
        c: &CodeToolConfig,
        sandbox_config: &SandboxConfig,
        sandbox: &Sandbox,
    ) -> Result<(CodeTool, String, Value), String> {
        let interpreter = sandbox
            .allowlist()
            .resolve(&c.interpreter)
            .ok_or_else(|| {
                format!(
                    "the interpreter `{}` is not in [sandbox] programs",
                    c.interpreter
                )
            })?
            .to_owned();
        if c.extension.is_empty() || !c.extension.bytes().all(|b| b.is_ascii_alphanumeric()) {
            return Err(format!(
                "`extension` must be letters and digits, got `{}`",
                c.extension
            ));
        }
        let limits = Limits::new(sandbox_config, &c.sandbox)?;
        let description = c.description.clone().unwrap_or_else(|| {
            format!(
                "Runs a program with {} in a sandbox and returns what it prints (stdout, and \
                 stderr when there is any). No network{}, {} s of CPU, {} MiB of memory. Files \
                 written to the current directory stay for the rest of the task. Print \
                 the results you need.",
                c.interpreter,
                if limits.network { " restrictions" } else { "" },
                limits.cpu_seconds,
                limits.memory_bytes >> 20,
            )
        });
        let schema = json!({
            "type": "object",
            "properties": {"code": {"type": "string", "description": "The program's source text."}},
            "required": ["code"],
            "additionalProperties": false
        });
        Ok((
            CodeTool {
                interpreter,
                interpreter_args: c.interpreter_args.clone(),
                extension: c.extension.clone(),
                limits,
                counter: AtomicU64::new(0),
            },
            description,
            schema,
        ))
    }

    /// Writes the code to a file in the working directory and runs it.
    pub async fn call(
        &self,
        args: &Map<String, Value>,
        sandbox: &Sandbox,
        ctx: &CallContext,
    ) -> ToolOutput {
        let Some(code) = args.get("code").and_then(Value::as_str) else {
            return ToolOutput::error("the argument `code` (a string) is required");
        };
        let workdir = sandbox.workdir.as_deref().unwrap_or(&ctx.workdir);
        let n = self.counter.fetch_add(1, Ordering::Relaxed);
        let file = workdir.join(format!(
            ".kimi-code-{}-{n}.{}",
            std::process::id(),
            self.extension
        ));
        if let Err(e) = tokio::fs::write(&file, code).await {
            return ToolOutput::error(format!("cannot write the program file: {e}"));
        }
        let mut argv = self.interpreter_args.clone();
        argv.push(file.to_string_lossy().into_owned());
        let outcome = sandbox
            .run(&self.interpreter, &argv, workdir, &self.limits)
            .await;
        let _ = tokio::fs::remove_file(&file).await;
        let text = outcome.describe(&self.limits);
        if outcome.success() {
            ToolOutput::ok(text)
        } else {
            ToolOutput::error(text)
        }
    }
}

/// A host the fetch tool may reach: any port, or one.
#[derive(Debug, Clone, PartialEq)]
struct AllowedHost {
    host: String,
    port: Option<u16>,
}

impl AllowedHost {
    fn parse(text: &str) -> Result<AllowedHost, String> {
        let text = text.trim().to_ascii_lowercase();
        if text.is_empty() || text.contains('/') || text.contains('@') {
            return Err(format!(
                "`{text}` is not a host (write `example.com` or `127.0.0.1:8080`)"
            ));
        }
        // `[v6]:port`, `[v6]`, `host:port`, `host`.
        let (host, port) = if let Some(rest) = text.strip_prefix('[') {
            let (h, after) = rest
                .split_once(']')
                .ok_or_else(|| format!("`{text}`: a `[` without its `]`"))?;
            (format!("[{h}]"), after.strip_prefix(':'))
        } else {
            match text.rsplit_once(':') {
                Some((h, p)) => (h.to_string(), Some(p)),
                None => (text.clone(), None),
            }
        };
        let port = port
            .map(|p| p.parse::<u16>().map_err(|_| format!("`{text}`: bad port")))
            .transpose()?;
        Ok(AllowedHost { host, port })
    }

    fn allows(&self, url: &reqwest::Url) -> bool {
        let Some(host) = url.host_str() else {
            return false;
        };
        host.eq_ignore_ascii_case(&self.host)
            && self
                .port
                .is_none_or(|p| url.port_or_known_default() == Some(p))
    }
}

fn host_allowed(hosts: &[AllowedHost], url: &reqwest::Url) -> bool {
    matches!(url.scheme(), "http" | "https") && hosts.iter().any(|h| h.allows(url))
}

/// Fetches a URL on an allowed host.
#[derive(Debug)]
pub struct FetchTool {
    client: reqwest::Client,
    hosts: Arc<Vec<AllowedHost>>,
    timeout: Duration,
    max_bytes: usize,
}

impl FetchTool {
    /// The tool, its description and its parameter schema.
    ///
    /// # Errors
    ///
    /// No or malformed allowed hosts, or a bad limit.
    pub fn new(c: &FetchToolConfig) -> Result<(FetchTool, String, Value), String> {
        if c.allowed_hosts.is_empty() {
            return Err("`allowed_hosts` is empty: the tool could fetch nothing".into());
        }
        let hosts = Arc::new(
            c.allowed_hosts
                .iter()
                .map(|h| AllowedHost::parse(h))
                .collect::<Result<Vec<_>, _>>()?,
        );
        if c.max_response_bytes == 0 {
            return Err("max_response_bytes must be at least 1".into());
        }
        let redirect_hosts = Arc::clone(&hosts);
        let policy = reqwest::redirect::Policy::custom(move |attempt| {
            if attempt.previous().len() >= 5 {
                attempt.error("more than 5 redirects")
            } else if host_allowed(&redirect_hosts, attempt.url()) {
                attempt.follow()
            } else {
                let to = attempt.url().host_str().unwrap_or("?").to_string();
                attempt.error(format!(
                    "a redirect to `{to}`, which is not an allowed host"
                ))
            }
        });
        let client = crate::http::client_builder()
            .redirect(policy)
            .build()
            .map_err(|e| format!("HTTP client: {e}"))?;
        let names: Vec<&str> = c.allowed_hosts.iter().map(String::as_str).collect();
        let description = c.description.clone().unwrap_or_else(|| {
            format!(
                "Fetches a URL with GET and returns its text. Only these hosts can be \
                 reached: {}.",
                names.join(", ")
            )
        });
        let schema = json!({
            "type": "object",
            "properties": {"url": {"type": "string", "description": "An http or https URL."}},
            "required": ["url"],
            "additionalProperties": false
        });
        Ok((
            FetchTool {
                client,
                hosts,
                timeout: seconds(c.timeout_seconds, "timeout_seconds")?,
                max_bytes: c.max_response_bytes,
            },
            description,
            schema,
        ))
    }

    /// GETs the URL if its host is allowed.
    pub async fn call(&self, args: &Map<String, Value>) -> ToolOutput {
        let Some(text) = args.get("url").and_then(Value::as_str) else {
            return ToolOutput::error("the argument `url` (a string) is required");
        };
        let url = match reqwest::Url::parse(text) {
            Ok(url) => url,
            Err(e) => return ToolOutput::error(format!("`{text}` is not a URL: {e}")),
        };
        if !host_allowed(&self.hosts, &url) {
            return ToolOutput::error(format!(
                "`{}` is not an allowed host for this tool (refused without a request)",
                url.host_str().unwrap_or(text)
            ));
        }
        let response = match self.client.get(url).timeout(self.timeout).send().await {
            Ok(r) => r,
            Err(e) => {
                return ToolOutput::error(format!("the request failed: {}", describe_error(&e)))
            }
        };
        let status = response.status();
        let content_type = response
            .headers()
            .get(reqwest::header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
            .to_string();
        match read_capped(response, self.max_bytes).await {
            Ok(body) => {
                let text = body_text(&body, self.max_bytes);
                let header = format!("HTTP {status}; content-type: {content_type}\n");
                if status.is_success() {
                    ToolOutput::ok(format!("{header}{text}"))
                } else {
                    ToolOutput::error(format!("{header}{text}"))
                }
            }
            Err(e) => ToolOutput::error(format!(
                "HTTP {status}, then reading the body failed: {}",
                describe_error(&e)
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hosts_match_exactly() {
        let hosts: Vec<AllowedHost> = ["example.com", "127.0.0.1:8080", "[::1]:9"]
            .iter()
            .map(|h| AllowedHost::parse(h).unwrap())
            .collect();
        let ok = |u: &str| host_allowed(&hosts, &reqwest::Url::parse(u).unwrap());
        assert!(ok("https://example.com/a"));
        assert!(ok("http://EXAMPLE.com:81/"));
        assert!(ok("http://127.0.0.1:8080/x"));
        assert!(!ok("http://127.0.0.1:8081/x"));
        assert!(!ok("http://example.com.evil.org/"));
        assert!(!ok("http://evil.org/?example.com"));
        assert!(!ok("file:///etc/passwd"));
        assert!(ok("http://[::1]:9/"));
        assert!(AllowedHost::parse("http://x/").is_err());
        assert!(AllowedHost::parse("x:port").is_err());
    }
}
