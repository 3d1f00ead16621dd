//! The tools file (`tools.toml` or `tools.json`): which tools an agent may call and how
//! they run. The schema is documented in `docs/agent-tools.md`; every table refuses fields
//! it does not know, so a typo is an error that names it rather than a silently ignored
//! setting.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::Deserialize;
use serde_json::Value;

use crate::error::ConfigError;

/// The whole file.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ToolsFile {
    /// Defaults for every tool that runs a program (shell and code tools).
    #[serde(default)]
    pub sandbox: SandboxConfig,
    /// Tools defined one by one (`[[tool]]`).
    #[serde(default, rename = "tool", alias = "tools")]
    pub tools: Vec<ToolConfig>,
    /// OpenAPI 3 documents whose operations become REST tools (`[[openapi]]`).
    #[serde(default)]
    pub openapi: Vec<OpenApiConfig>,
    /// MCP servers whose tools are offered (`[[mcp]]`).
    #[serde(default)]
    pub mcp: Vec<McpConfig>,
}

/// How sandboxed programs run (`[sandbox]`); tools may override the limits.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SandboxConfig {
    /// The programs tools may run, by name (looked up in `/usr/local/bin:/usr/bin:/bin`) or
    /// absolute path. Nothing else can be executed inside the sandbox.
    #[serde(default)]
    pub programs: Vec<String>,
    /// A directory the tools share across calls and requests; default: a new empty
    /// directory for each agent run, deleted when it ends.
    #[serde(default)]
    pub workdir: Option<PathBuf>,
    /// Whether sandboxed programs may open network sockets (default: no).
    #[serde(default)]
    pub network: bool,
    /// Wall-clock limit of one call, seconds.
    #[serde(default = "defaults::timeout")]
    pub timeout_seconds: f64,
    /// CPU time limit of one call, seconds (RLIMIT_CPU).
    #[serde(default = "defaults::cpu_seconds")]
    pub cpu_seconds: u64,
    /// Address-space limit, MiB (RLIMIT_AS).
    #[serde(default = "defaults::memory_mb")]
    pub memory_mb: u64,
    /// Largest file a program may write, MiB (RLIMIT_FSIZE).
    #[serde(default = "defaults::file_mb")]
    pub max_file_mb: u64,
    /// Open files per process (RLIMIT_NOFILE).
    #[serde(default = "defaults::open_files")]
    pub max_open_files: u64,
    /// Output kept per stream (stdout, stderr), bytes: the first and last halves of
    /// anything longer are kept and the middle is counted, not stored.
    #[serde(default = "defaults::output_bytes")]
    pub max_output_bytes: usize,
    /// Paths readable inside the sandbox (default: the system's program and library
    /// directories and a few files of /etc that programs need).
    #[serde(default)]
    pub read_paths: Option<Vec<PathBuf>>,
    /// Paths writable inside the sandbox besides the working directory.
    #[serde(default)]
    pub write_paths: Vec<PathBuf>,
    /// Environment variables set for sandboxed programs (the agent's own environment is
    /// not passed on); `${NAME}` is replaced by the agent's variable.
    #[serde(default)]
    pub env: BTreeMap<String, String>,
}

impl Default for SandboxConfig {
    fn default() -> Self {
        SandboxConfig {
            programs: Vec::new(),
            workdir: None,
            network: false,
            timeout_seconds: defaults::timeout(),
            cpu_seconds: defaults::cpu_seconds(),
            memory_mb: defaults::memory_mb(),
            max_file_mb: defaults::file_mb(),
            max_open_files: defaults::open_files(),
            max_output_bytes: defaults::output_bytes(),
            read_paths: None,
            write_paths: Vec::new(),
            env: BTreeMap::new(),
        }
    }
}

/// Per-tool changes to the `[sandbox]` limits.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SandboxOverrides {
    /// See [`SandboxConfig::network`].
    pub network: Option<bool>,
    /// See [`SandboxConfig::timeout_seconds`].
    pub timeout_seconds: Option<f64>,
    /// See [`SandboxConfig::cpu_seconds`].
    pub cpu_seconds: Option<u64>,
    /// See [`SandboxConfig::memory_mb`].
    pub memory_mb: Option<u64>,
    /// See [`SandboxConfig::max_output_bytes`].
    pub max_output_bytes: Option<usize>,
}

/// One `[[tool]]`, by its `type`.
#[derive(Debug, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ToolConfig {
    /// A program run in the sandbox with arguments from a template.
    Shell(ShellToolConfig),
    /// An HTTP endpoint.
    Rest(RestToolConfig),
    /// Built-in: runs a program (Python by default) given as source text in the sandbox.
    Code(CodeToolConfig),
    /// Built-in: fetches a URL on an allowed host.
    Fetch(FetchToolConfig),
}

impl ToolConfig {
    /// The tool's name as the model calls it.
    pub fn name(&self) -> &str {
        match self {
            ToolConfig::Shell(t) => &t.name,
            ToolConfig::Rest(t) => &t.name,
            ToolConfig::Code(t) => &t.name,
            ToolConfig::Fetch(t) => &t.name,
        }
    }
}

/// `type = "shell"`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ShellToolConfig {
    /// The function name the model calls.
    pub name: String,
    /// What the tool does, for the model.
    #[serde(default)]
    pub description: String,
    /// argv: the program (a name from `[sandbox] programs`, never a placeholder), then
    /// arguments where `{name}` is replaced by the argument `name`. An element that is
    /// exactly `{name}` becomes one argv element per array item, and disappears when an
    /// optional argument is absent; an element with text around a placeholder disappears
    /// when any of its arguments is absent. No shell is involved.
    pub command: Vec<String>,
    /// JSON schema of the arguments (an object schema; default: no arguments).
    #[serde(default = "defaults::empty_object")]
    pub parameters: Value,
    /// Whether argument values may start with `-` where a placeholder is a whole argv
    /// element (default: no, so that a value cannot turn into an option of the program).
    #[serde(default)]
    pub allow_option_values: bool,
    /// Limits for this tool.
    #[serde(default)]
    pub sandbox: SandboxOverrides,
}

/// `type = "rest"`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RestToolConfig {
    /// The function name the model calls.
    pub name: String,
    /// What the tool does, for the model.
    #[serde(default)]
    pub description: String,
    /// HTTP method.
    #[serde(default = "defaults::get")]
    pub method: String,
    /// URL; `{name}` in it is replaced by the percent-encoded argument `name`.
    pub url: String,
    /// JSON schema of the arguments (an object schema).
    #[serde(default = "defaults::empty_object")]
    pub parameters: Value,
    /// Arguments sent in the query string. Default: every argument not in the URL for
    /// GET, HEAD and DELETE; none for other methods, whose remaining arguments form the
    /// JSON body.
    #[serde(default)]
    pub query: Option<Vec<String>>,
    /// Request headers; `${NAME}` is replaced by the environment variable NAME when the
    /// file is loaded (a missing variable is an error), so secrets stay out of the file.
    #[serde(default)]
    pub headers: BTreeMap<String, String>,
    /// Seconds before the request is abandoned.
    #[serde(default = "defaults::rest_timeout")]
    pub timeout_seconds: f64,
    /// Most response bytes read; the rest is cut off and said so.
    #[serde(default = "defaults::response_bytes")]
    pub max_response_bytes: usize,
}

/// `type = "code"`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CodeToolConfig {
    /// The function name the model calls.
    #[serde(default = "defaults::code_name")]
    pub name: String,
    /// What the tool does, for the model.
    #[serde(default)]
    pub description: Option<String>,
    /// The interpreter (from `[sandbox] programs`) that runs the code file.
    #[serde(default = "defaults::interpreter")]
    pub interpreter: String,
    /// Arguments before the code file's path.
    #[serde(default = "defaults::interpreter_args")]
    pub interpreter_args: Vec<String>,
    /// The code file's extension.
    #[serde(default = "defaults::code_extension")]
    pub extension: String,
    /// Limits for this tool.
    #[serde(default)]
    pub sandbox: SandboxOverrides,
}

/// `type = "fetch"`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FetchToolConfig {
    /// The function name the model calls.
    #[serde(default = "defaults::fetch_name")]
    pub name: String,
    /// What the tool does, for the model.
    #[serde(default)]
    pub description: Option<String>,
    /// Hosts the tool may reach: `example.com` (any port) or `127.0.0.1:8080`. Redirects
    /// are followed only to these.
    pub allowed_hosts: Vec<String>,
    /// Seconds before the request is abandoned.
    #[serde(default = "defaults::rest_timeout")]
    pub timeout_seconds: f64,
    /// Most response bytes read.
    #[serde(default = "defaults::response_bytes")]
    pub max_response_bytes: usize,
}

/// `[[openapi]]`: an OpenAPI 3 document (JSON) whose operations become REST tools.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OpenApiConfig {
    /// The document, relative to the tools file.
    pub spec: PathBuf,
    /// Base URL of the API (default: the document's first `servers` entry).
    #[serde(default)]
    pub base_url: Option<String>,
    /// Only these `operationId`s (default: every operation that has one).
    #[serde(default)]
    pub operations: Option<Vec<String>>,
    /// Put in front of each operationId to form the tool name.
    #[serde(default)]
    pub prefix: String,
    /// Headers of every request (`${NAME}` from the environment).
    #[serde(default)]
    pub headers: BTreeMap<String, String>,
    /// Seconds before a request is abandoned.
    #[serde(default = "defaults::rest_timeout")]
    pub timeout_seconds: f64,
    /// Most response bytes read.
    #[serde(default = "defaults::response_bytes")]
    pub max_response_bytes: usize,
}

/// `[[mcp]]`: an MCP server, over stdio (`command`) or streamable HTTP (`url`).
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct McpConfig {
    /// Names the server in logs and errors.
    pub name: String,
    /// argv of a server that speaks MCP on stdin/stdout (it runs outside the sandbox, as
    /// configured software the operator trusts).
    #[serde(default)]
    pub command: Option<Vec<String>>,
    /// Working directory of `command`, relative to the tools file.
    #[serde(default)]
    pub cwd: Option<PathBuf>,
    /// Environment of `command` in addition to the agent's (`${NAME}` substituted).
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// Endpoint of a streamable-HTTP server, e.g. `http://127.0.0.1:8000/mcp`.
    #[serde(default)]
    pub url: Option<String>,
    /// Headers for `url` (`${NAME}` substituted); `Authorization` goes as the auth header.
    #[serde(default)]
    pub headers: BTreeMap<String, String>,
    /// Only these of the server's tools (default: all).
    #[serde(default)]
    pub tools: Option<Vec<String>>,
    /// Put in front of each tool name (default: none).
    #[serde(default)]
    pub prefix: String,
    /// Close the server's argument schemas (`additionalProperties: false` where an object
    /// schema does not say), as OpenAI's strict mode does: constrained decoding then
    /// cannot add keys the tool does not know, which small models otherwise do.
    #[serde(default)]
    pub strict: bool,
    /// Seconds a call may take.
    #[serde(default = "defaults::mcp_timeout")]
    pub timeout_seconds: f64,
    /// Most output bytes passed on from one call.
    #[serde(default = "defaults::response_bytes")]
    pub max_output_bytes: usize,
}

mod defaults {
    use serde_json::{json, Value};

    pub fn timeout() -> f64 {
        30.0
    }
    pub fn cpu_seconds() -> u64 {
        10
    }
    pub fn memory_mb() -> u64 {
        1024
    }
    pub fn file_mb() -> u64 {
        64
    }
    pub fn open_files() -> u64 {
        256
    }
    pub fn output_bytes() -> usize {
        64 << 10
    }
    pub fn rest_timeout() -> f64 {
        30.0
    }
    pub fn mcp_timeout() -> f64 {
        60.0
    }
    pub fn response_bytes() -> usize {
        1 << 20
    }
    pub fn get() -> String {
        "GET".into()
    }
    /// No arguments, and no room for invented ones (constrained decoding would otherwise
    /// let a small model write keys until its token limit).
    pub fn empty_object() -> Value {
        json!({"type": "object", "properties": {}, "additionalProperties": false})
    }
    pub fn code_name() -> String {
        "run_python".into()
    }
    pub fn interpreter() -> String {
        "python3".into()
    }
    pub fn interpreter_args() -> Vec<String> {
        vec!["-I".into()]
    }
    pub fn code_extension() -> String {
        "py".into()
    }
    pub fn fetch_name() -> String {
        "fetch".into()
    }
}

impl ToolsFile {
    /// Reads `path`: JSON when it ends in `.json`, else TOML.
    ///
    /// # Errors
    ///
    /// [`ConfigError`] naming the file, and the line and field where parsing stopped.
    pub fn read(path: &Path) -> Result<ToolsFile, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.to_owned(),
            source,
        })?;
        Self::parse(&text, path)
    }

    /// Parses `text` as the file at `path` (its extension picks the format).
    ///
    /// # Errors
    ///
    /// [`ConfigError::Parse`] with the parser's message.
    pub fn parse(text: &str, path: &Path) -> Result<ToolsFile, ConfigError> {
        let json = path
            .extension()
            .is_some_and(|e| e.eq_ignore_ascii_case("json"));
        let parsed = if json {
            serde_json::from_str(text).map_err(|e| e.to_string())
        } else {
            toml::from_str(text).map_err(|e| e.to_string())
        };
        parsed.map_err(|message| ConfigError::Parse {
            path: path.to_owned(),
            message: message.trim_end().to_owned(),
        })
    }
}

/// Replaces every `${NAME}` in `text` by the environment variable `NAME`.
///
/// # Errors
///
/// The name of a variable that is not set (or not Unicode), or a `${` without its `}`.
pub fn expand_env(text: &str) -> Result<String, String> {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(start) = rest.find("${") {
        out.push_str(&rest[..start]);
        let after = &rest[start + 2..];
        let end = after
            .find('}')
            .ok_or_else(|| format!("`${{` without a closing `}}` in `{text}`"))?;
        let name = &after[..end];
        let value = std::env::var(name)
            .map_err(|_| format!("the environment variable `{name}` is not set"))?;
        out.push_str(&value);
        rest = &after[end + 1..];
    }
    out.push_str(rest);
    Ok(out)
}

/// `path` relative to `base` unless it is absolute.
pub(crate) fn resolve(base: &Path, path: &Path) -> PathBuf {
    if path.is_absolute() {
        path.to_owned()
    } else {
        base.join(path)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn toml_and_json_say_the_same() {
        let toml_text = r#"
            [sandbox]
            programs = ["echo"]
            [[tool]]
            type = "shell"
            name = "say"
            command = ["echo", "{text}"]
            parameters = { type = "object", properties = { text = { type = "string" } } }
        "#;
        let json_text = r#"{"sandbox": {"programs": ["echo"]}, "tools": [{"type": "shell",
            "name": "say", "command": ["echo", "{text}"], "parameters": {"type": "object",
            "properties": {"text": {"type": "string"}}}}]}"#;
        let a = ToolsFile::parse(toml_text, Path::new("t.toml")).unwrap();
        let b = ToolsFile::parse(json_text, Path::new("t.json")).unwrap();
        for f in [a, b] {
            assert_eq!(f.sandbox.programs, ["echo"]);
            assert_eq!(f.tools.len(), 1);
            assert_eq!(f.tools[0].name(), "say");
        }
    }

    #[test]
    fn unknown_fields_are_named() {
        let text = "[[tool]]\ntype = \"shell\"\nname = \"x\"\ncommand = [\"ls\"]\ntimeout = 3\n";
        let err = ToolsFile::parse(text, Path::new("tools.toml")).unwrap_err();
        let msg = err.to_string();
        assert!(
            msg.contains("tools.toml") && msg.contains("timeout"),
            "{msg}"
        );
        let err = ToolsFile::parse("[[tool]]\ntype = \"ftp\"\n", Path::new("t.toml"))
            .unwrap_err()
            .to_string();
        assert!(err.contains("ftp"), "{err}");
    }

    #[test]
    fn environment_is_expanded() {
        std::env::set_var("KIMI_AGENT_TEST_SECRET", "s3cret");
        assert_eq!(
            expand_env("Bearer ${KIMI_AGENT_TEST_SECRET}!").unwrap(),
            "Bearer s3cret!"
        );
        assert!(expand_env("${KIMI_AGENT_SURELY_UNSET_VAR}")
            .unwrap_err()
            .contains("KIMI_AGENT_SURELY_UNSET_VAR"));
        assert!(expand_env("${OPEN").is_err());
        assert_eq!(expand_env("plain").unwrap(), "plain");
    }
}
