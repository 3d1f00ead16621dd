//! The tool registry: every tool of a tools file, by name, with its schema; and calling
//! one, which always ends in text for the model (an error is text too, never a failure of
//! the loop).
//!
//! ```text
//! Registry::call(name, arguments)
//!   unknown name            → "error: there is no tool named ..." (the names listed)
//!   arguments not JSON      → "error: the arguments are not valid JSON ..."
//!   schema violations       → "error: the arguments do not match the tool's schema ..."
//!   otherwise the tool runs on its own task (a panic there is an error message too):
//!     shell / code → sandbox::Sandbox::run        rest / openapi → reqwest
//!     mcp          → rmcp client (stdio or streamable HTTP)   fetch → reqwest, allowed hosts
//! ```

mod builtin;
mod mcp;
mod openapi;
mod rest;
mod shell;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use serde_json::{json, Value};

use crate::config::{ToolConfig, ToolsFile};
use crate::error::ConfigError;
use crate::sandbox::Sandbox;
use crate::schema::{parse_arguments, ArgsSchema};

/// What a tool call gives back to the model.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolOutput {
    /// The text the model reads.
    pub text: String,
    /// Whether the call failed (the text then starts with `error:`).
    pub is_error: bool,
}

impl ToolOutput {
    /// A successful result.
    pub fn ok(text: impl Into<String>) -> ToolOutput {
        ToolOutput {
            text: text.into(),
            is_error: false,
        }
    }

    /// A failure, as `error: <message>`.
    pub fn error(message: impl AsRef<str>) -> ToolOutput {
        let message = message.as_ref();
        let text = if message.starts_with("error:") {
            message.to_owned()
        } else {
            format!("error: {message}")
        };
        ToolOutput {
            text,
            is_error: true,
        }
    }
}

/// One tool.
#[derive(Debug)]
pub struct Tool {
    /// The function name the model calls.
    pub name: String,
    /// What it does, for the model.
    pub description: String,
    args: ArgsSchema,
    kind: ToolKind,
}

#[derive(Debug)]
enum ToolKind {
    Shell(shell::ShellTool),
    Rest(rest::RestTool),
    Mcp(mcp::McpTool),
    Code(builtin::CodeTool),
    Fetch(builtin::FetchTool),
}

impl Tool {
    /// The JSON schema of its arguments.
    pub fn parameters(&self) -> &Value {
        self.args.schema()
    }

    /// What kind of tool it is, for listings (`shell`, `rest`, `mcp:<server>`, ...).
    pub fn kind(&self) -> String {
        match &self.kind {
            ToolKind::Shell(_) => "shell".into(),
            ToolKind::Rest(_) => "rest".into(),
            ToolKind::Mcp(t) => format!("mcp:{}", t.server_name()),
            ToolKind::Code(_) => "code".into(),
            ToolKind::Fetch(_) => "fetch".into(),
        }
    }

    /// The tool in the `tools` array of a chat-completions request.
    pub fn function_spec(&self) -> Value {
        json!({
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": self.args.schema(),
            }
        })
    }
}

/// Where a call runs.
#[derive(Debug, Clone)]
pub struct CallContext {
    /// The working directory of sandboxed programs for this agent run.
    pub workdir: PathBuf,
}

/// Every tool of a tools file.
#[derive(Debug)]
pub struct Registry {
    tools: Vec<Arc<Tool>>,
    index: HashMap<String, usize>,
    sandbox: Arc<Sandbox>,
    mcp: Vec<Arc<mcp::McpServer>>,
}

/// Tool names as OpenAI accepts them: 1 to 64 of `[A-Za-z0-9_-]`.
pub fn valid_tool_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 64
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

impl Registry {
    /// No tools at all.
    pub fn empty() -> Registry {
        Registry {
            tools: Vec::new(),
            index: HashMap::new(),
            sandbox: Arc::new(Sandbox::empty()),
            mcp: Vec::new(),
        }
    }

    /// Reads a tools file and builds every tool: programs resolved, schemas compiled,
    /// OpenAPI documents read, MCP servers started and their tools listed.
    ///
    /// # Errors
    ///
    /// [`ConfigError`] naming the file and the part of it at fault.
    pub async fn load(path: &Path) -> Result<Registry, ConfigError> {
        let file = ToolsFile::read(path)?;
        Registry::from_file(file, path).await
    }

    /// Builds the tools of `file`, read from `path` (relative paths in it are relative to
    /// its directory).
    ///
    /// # Errors
    ///
    /// [`ConfigError::Invalid`] naming the part of the file at fault.
    pub async fn from_file(file: ToolsFile, path: &Path) -> Result<Registry, ConfigError> {
        crate::http::init_tls();
        let base_dir = path
            .parent()
            .filter(|p| !p.as_os_str().is_empty())
            .unwrap_or(Path::new("."));
        let invalid = |what: String, message: String| ConfigError::Invalid {
            path: path.to_owned(),
            what,
            message,
        };
        let sandbox = Arc::new(
            Sandbox::new(&file.sandbox, base_dir).map_err(|m| invalid("[sandbox]".into(), m))?,
        );
        let http = crate::http::client_builder()
            .redirect(reqwest::redirect::Policy::limited(5))
            .build()
            .map_err(|e| invalid("HTTP client".into(), e.to_string()))?;
        let mut registry = Registry {
            tools: Vec::new(),
            index: HashMap::new(),
            sandbox: Arc::clone(&sandbox),
            mcp: Vec::new(),
        };
        for config in file.tools {
            let what = format!("tool `{}`", config.name());
            let tool = build_tool(config, &file.sandbox, &sandbox, &http)
                .map_err(|m| invalid(what.clone(), m))?;
            registry.add(tool).map_err(|m| invalid(what, m))?;
        }
        for api in &file.openapi {
            let what = format!("[[openapi]] {}", api.spec.display());
            let tools =
                openapi::tools(api, base_dir, &http).map_err(|m| invalid(what.clone(), m))?;
            for tool in tools {
                let what = format!("{what}: operation `{}`", tool.name);
                registry.add(tool).map_err(|m| invalid(what, m))?;
            }
        }
        for server in &file.mcp {
            let what = format!("[[mcp]] `{}`", server.name);
            let (server, tools) = mcp::McpServer::start(server, base_dir)
                .await
                .map_err(|m| invalid(what.clone(), m))?;
            registry.mcp.push(server);
            for tool in tools {
                let what = format!("{what}: tool `{}`", tool.name);
                registry.add(tool).map_err(|m| invalid(what, m))?;
            }
        }
        Ok(registry)
    }

    fn add(&mut self, tool: Tool) -> Result<(), String> {
        if !valid_tool_name(&tool.name) {
            return Err(format!(
                "`{}` is not a valid tool name (1 to 64 letters, digits, `_` or `-`)",
                tool.name
            ));
        }
        if self.index.contains_key(&tool.name) {
            return Err(format!("a second tool is named `{}`", tool.name));
        }
        self.index.insert(tool.name.clone(), self.tools.len());
        self.tools.push(Arc::new(tool));
        Ok(())
    }

    /// The tools, in file order.
    pub fn tools(&self) -> impl Iterator<Item = &Tool> {
        self.tools.iter().map(|t| &**t)
    }

    /// The tool named `name`.
    pub fn get(&self, name: &str) -> Option<&Tool> {
        self.index.get(name).map(|&i| &*self.tools[i])
    }

    /// Whether there are no tools.
    pub fn is_empty(&self) -> bool {
        self.tools.is_empty()
    }

    /// The shared sandbox settings.
    pub fn sandbox(&self) -> &Sandbox {
        &self.sandbox
    }

    /// Every tool as a chat-completions `tools` entry.
    pub fn function_specs(&self) -> Vec<Value> {
        self.tools.iter().map(|t| t.function_spec()).collect()
    }

    /// Calls `name` with the model's `arguments` text. Never fails: every problem is an
    /// error message for the model.
    pub async fn call(&self, name: &str, arguments: &str, ctx: &CallContext) -> ToolOutput {
        let Some(&index) = self.index.get(name) else {
            let mut names: Vec<&str> = self.tools.iter().map(|t| t.name.as_str()).collect();
            names.sort_unstable();
            return ToolOutput::error(format!(
                "there is no tool named `{name}`; the tools are: {}",
                if names.is_empty() {
                    "(none)".to_string()
                } else {
                    names.join(", ")
                }
            ));
        };
        let tool = Arc::clone(&self.tools[index]);
        let args = match parse_arguments(arguments) {
            Ok(args) => args,
            Err(e) => return ToolOutput::error(e),
        };
        if let Err(e) = tool.args.check(&args) {
            return ToolOutput::error(e);
        }
        let sandbox = Arc::clone(&self.sandbox);
        let ctx = ctx.clone();
        let task = tokio::spawn(async move { run_tool(&tool, args, &sandbox, &ctx).await });
        match task.await {
            Ok(output) => output,
            Err(e) => ToolOutput::error(format!("the tool `{name}` failed internally: {e}")),
        }
    }

    /// Closes the MCP connections (stdio servers are stopped).
    pub async fn shutdown(&self) {
        for server in &self.mcp {
            server.close().await;
        }
    }
}

async fn run_tool(tool: &Tool, args: Value, sandbox: &Sandbox, ctx: &CallContext) -> ToolOutput {
    let Value::Object(args) = args else {
        return ToolOutput::error("the arguments must be a JSON object");
    };
    match &tool.kind {
        ToolKind::Shell(t) => t.call(&args, sandbox, ctx).await,
        ToolKind::Rest(t) => t.call(&args).await,
        ToolKind::Mcp(t) => t.call(args).await,
        ToolKind::Code(t) => t.call(&args, sandbox, ctx).await,
        ToolKind::Fetch(t) => t.call(&args).await,
    }
}

fn build_tool(
    config: ToolConfig,
    sandbox_config: &crate::config::SandboxConfig,
    sandbox: &Sandbox,
    http: &reqwest::Client,
) -> Result<Tool, String> {
    match config {
        ToolConfig::Shell(c) => {
            let args = ArgsSchema::new(c.parameters.clone())?;
            let kind = shell::ShellTool::new(&c, sandbox_config, sandbox, args.schema())?;
            Ok(Tool {
                name: c.name,
                description: c.description,
                args,
                kind: ToolKind::Shell(kind),
            })
        }
        ToolConfig::Rest(c) => {
            let args = ArgsSchema::new(c.parameters.clone())?;
            let kind = rest::RestTool::from_config(&c, http.clone())?;
            Ok(Tool {
                name: c.name,
                description: c.description,
                args,
                kind: ToolKind::Rest(kind),
            })
        }
        ToolConfig::Code(c) => {
            let (kind, description, schema) = builtin::CodeTool::new(&c, sandbox_config, sandbox)?;
            Ok(Tool {
                name: c.name,
                description,
                args: ArgsSchema::new(schema)?,
                kind: ToolKind::Code(kind),
            })
        }
        ToolConfig::Fetch(c) => {
            let (kind, description, schema) = builtin::FetchTool::new(&c)?;
            Ok(Tool {
                name: c.name,
                description,
                args: ArgsSchema::new(schema)?,
                kind: ToolKind::Fetch(kind),
            })
        }
    }
}

/// Seconds from a config value, checked.
pub(crate) fn seconds(value: f64, field: &str) -> Result<Duration, String> {
    if value > 0.0 && value < 1e7 {
        Ok(Duration::from_secs_f64(value))
    } else {
        Err(format!(
            "{field} must be a positive number of seconds, got {value}"
        ))
    }
}

/// A JSON value as an argument string: strings as they are, other scalars as JSON.
pub(crate) fn scalar_text(value: &Value) -> Option<String> {
    match value {
        Value::String(s) => Some(s.clone()),
        Value::Number(n) => Some(n.to_string()),
        Value::Bool(b) => Some(b.to_string()),
        _ => None,
    }
}
