//! The agent layer of kimi-infer (layer L6, beside kimi-server): a registry of tools, the
//! multi-step tool loop over any OpenAI-compatible chat-completions endpoint, context
//! management, and OpenAI's Responses API in front of it all.
//!
//! ```text
//! client ──POST /v1/responses──► responses::AgentServer ─► agent::Agent::run
//!   (openai SDK, curl)                                         │ model::ChatModel
//!                                                              │   (chat completions,
//!                                                              │    streamed, with tools)
//!                                                              │ tools::Registry::call
//!                                                              │   shell / code ─► sandbox
//!                                                              │   rest / openapi / fetch
//!                                                              │   mcp (rmcp)
//!                                                              ▼ context::ContextManager
//! ```
//!
//! `kimi-infer agent serve` and `agent run` (crate kimi-cli) build these from flags and a
//! tools file (`config::ToolsFile`, documented in docs/agent-tools.md).

// One `unsafe` block: the sandbox's fork-to-exec hook (sandbox/linux.rs).
#![deny(unsafe_code)]
#![warn(missing_docs)]
#![cfg_attr(not(test), warn(clippy::unwrap_used))]

pub mod agent;
pub mod config;
pub mod context;
pub mod error;
pub mod http;
pub mod message;
pub mod model;
pub mod responses;
pub mod sandbox;
pub mod schema;
pub mod tools;

pub use agent::{Agent, AgentLimits, Event, Item, RunOutcome, RunRequest, Stop};
pub use config::ToolsFile;
pub use context::{ContextManager, OverflowPolicy, TokenCounter};
pub use error::{ConfigError, ModelError};
pub use message::Message;
pub use model::ChatModel;
pub use responses::{AgentServer, ServerSettings};
pub use tools::{CallContext, Registry, ToolOutput};
