//! Flags of `kimi-infer agent serve` and `agent run`.

use std::path::PathBuf;

use clap::{Args, Subcommand};

use crate::args::{parse_secs, parse_tool_call_parser, ModelArgs};

/// `kimi-infer agent`.
#[derive(Args, Debug)]
pub struct AgentArgs {
    #[command(subcommand)]
    pub command: AgentCommand,
}

/// The agent subcommands.
#[derive(Subcommand, Debug)]
pub enum AgentCommand {
    /// Serve OpenAI's Responses API (`POST /v1/responses`, streaming, previous_response_id):
    /// each request runs the tool loop around the model.
    Serve(AgentServeArgs),
    /// Run the tool loop once on a prompt and print each step.
    Run(AgentRunArgs),
}

/// Where the model is, which tools there are, and the loop's limits.
#[derive(Args, Debug, Clone)]
pub struct AgentCommon {
    /// Tools file (TOML, or JSON when it ends in .json; docs/agent-tools.md has the schema).
    /// Without it the agent has no tools of its own (a request's function tools still work).
    #[arg(long)]
    pub tools: Option<PathBuf>,
    /// An OpenAI-compatible endpoint to drive instead of a model in this process, e.g.
    /// http://127.0.0.1:8000/v1 (kimi-infer serve, vLLM, SGLang, llama.cpp's server).
    #[arg(long, conflicts_with = "model")]
    pub endpoint: Option<String>,
    /// API key of --endpoint (also KIMI_ENDPOINT_API_KEY).
    #[arg(
        long,
        env = "KIMI_ENDPOINT_API_KEY",
        hide_env_values = true,
        requires = "endpoint"
    )]
    pub endpoint_api_key: Option<String>,
    /// The model to ask for at --endpoint (default: the first one its /v1/models lists).
    #[arg(long, requires = "endpoint")]
    pub endpoint_model: Option<String>,
    /// The model in this process (as for `serve`: a checkpoint directory or GGUF file;
    /// without --model and --endpoint, the demo model).
    #[command(flatten)]
    pub model: ModelArgs,
    /// Tokenizer directory (tiktoken.model or tokenizer.json) or .gguf file: with
    /// --endpoint, how tokens are counted for context management (without it they are
    /// estimated at one per 3 bytes); with an in-process model, replaces the model's own.
    #[arg(long)]
    pub tokenizer: Option<PathBuf>,
    /// The model's context window in tokens (default: the in-process model's
    /// --max-model-len, or the endpoint's max_model_len from /v1/models, else 8192).
    #[arg(long)]
    pub context_window: Option<usize>,
    /// In-process model: longest prompt + output (default: the model's context, at most
    /// 32768).
    #[arg(long)]
    pub max_model_len: Option<usize>,
    /// In-process model: a chat template file (Jinja) replacing the tokenizer's.
    #[arg(long)]
    pub chat_template: Option<PathBuf>,
    /// In-process model: how it writes tool calls (auto, kimi, hermes, llama3_json,
    /// mistral, generic).
    #[arg(long, default_value = "auto", value_parser = parse_tool_call_parser)]
    pub tool_call_parser: kimi_server::ToolCallParser,
    /// What happens to a tool output that does not fit the context: `truncate` (keep its
    /// head and tail with a marked elision) or `summarize` (the model condenses it).
    #[arg(long, default_value = "truncate")]
    pub overflow: kimi_agent::OverflowPolicy,
    /// Most model calls per task (requests may ask for fewer with `max_steps`).
    #[arg(long, default_value_t = 10)]
    pub max_steps: usize,
    /// Seconds a task may take in all (model calls and tools); then it ends `incomplete`.
    #[arg(long, default_value_t = 300.0, value_parser = parse_secs)]
    pub time_budget: f64,
    /// Most tokens (prompt + output, summed over the steps) per task; none by default.
    #[arg(long)]
    pub token_budget: Option<u64>,
    /// `max_tokens` of each model call (also the room kept for the answer).
    #[arg(long, default_value_t = 1024)]
    pub step_max_tokens: u64,
}

/// `kimi-infer agent serve`.
#[derive(Args, Debug)]
pub struct AgentServeArgs {
    #[command(flatten)]
    pub common: AgentCommon,
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// Port to listen on (0 picks a free one).
    #[arg(long, default_value_t = 8100)]
    pub port: u16,
    /// Accepted API key (repeatable; also KIMI_API_KEY, comma-separated), named key-1,
    /// key-2, ... in logs. With no key at all (nor --api-key-file, nor
    /// KIMI_API_KEYS=name=key,name=key), every client is served.
    #[arg(
        long = "api-key",
        env = "KIMI_API_KEY",
        value_delimiter = ',',
        hide_env_values = true
    )]
    pub api_keys: Vec<String>,
    /// File of named API keys, one per line: `NAME KEY` (as for `serve`; per-key limits in
    /// it are not applied by the agent server).
    #[arg(long, env = "KIMI_API_KEY_FILE")]
    pub api_key_file: Option<PathBuf>,
    #[command(flatten)]
    pub tls: crate::access_args::TlsArgs,
    /// Model name clients send and /v1/models lists (default: the model's name).
    #[arg(long)]
    pub served_model_name: Option<String>,
    /// Tasks run at once; more requests get 429.
    #[arg(long, default_value_t = 64)]
    pub max_concurrent_runs: usize,
}

/// `kimi-infer agent run`.
#[derive(Args, Debug)]
pub struct AgentRunArgs {
    #[command(flatten)]
    pub common: AgentCommon,
    /// The task.
    #[arg(long, short = 'p')]
    pub prompt: String,
    /// Instructions (a system message).
    #[arg(long)]
    pub instructions: Option<String>,
    /// The first step's tool choice: auto, none, required, or a tool's name (later steps
    /// are `auto`).
    #[arg(long, default_value = "auto")]
    pub tool_choice: String,
    /// Sampling temperature (default: the endpoint's).
    #[arg(long)]
    pub temperature: Option<f64>,
    /// Random seed for sampling.
    #[arg(long)]
    pub seed: Option<u64>,
    /// Most output tokens over all steps.
    #[arg(long)]
    pub max_output_tokens: Option<u64>,
    /// Print the final result as the Responses API's JSON object instead of the steps.
    #[arg(long)]
    pub json: bool,
}
