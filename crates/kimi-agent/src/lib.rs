//! The agent layer of kimi-infer: tools, the tool loop, context management and the
//! OpenAI Responses API.
// One `unsafe` block: the sandbox's fork-to-exec hook (sandbox/linux.rs).
#![deny(unsafe_code)]
#![warn(missing_docs)]
#![cfg_attr(not(test), warn(clippy::unwrap_used))]

pub mod config;
pub mod error;
pub mod http;
pub mod sandbox;
pub mod schema;
pub mod tools;

pub use config::ToolsFile;
pub use error::{ConfigError, ModelError};
pub use tools::{CallContext, Registry, ToolOutput};
