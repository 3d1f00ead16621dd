//! Errors of loading a tools file and of talking to the model. Errors of running a tool are
//! not here: they are text for the model ([`crate::ToolOutput`]), never failures of the loop.

use std::path::PathBuf;

/// A tools file that cannot be used; each names the file and what in it is wrong.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file cannot be read.
    #[error("cannot read {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// The file is not valid TOML/JSON or does not fit the schema.
    #[error("{path}: {message}")]
    Parse {
        /// The file.
        path: PathBuf,
        /// The parser's message (line, column, field).
        message: String,
    },
    /// A part of the file is wrong: `what` names it (`tool \`x\``, `[sandbox]`, ...).
    #[error("{path}: {what}: {message}")]
    Invalid {
        /// The file.
        path: PathBuf,
        /// The table or tool at fault.
        what: String,
        /// What is wrong.
        message: String,
    },
}

/// A failed call to the chat-completions endpoint.
#[derive(Debug, Clone, thiserror::Error)]
pub enum ModelError {
    /// The endpoint could not be reached or the connection broke.
    #[error("cannot reach the model at {url}: {message}")]
    Connect {
        /// The endpoint.
        url: String,
        /// What failed.
        message: String,
    },
    /// The endpoint answered with an error status.
    #[error("the model endpoint answered {status}: {message}")]
    Status {
        /// HTTP status.
        status: u16,
        /// The error message it sent (OpenAI's `error.message` when present).
        message: String,
        /// OpenAI's `error.code`, when present.
        code: Option<String>,
    },
    /// The answer is not what an OpenAI-compatible endpoint sends.
    #[error("the model endpoint sent an unexpected answer: {0}")]
    Protocol(String),
    /// The call ran past its deadline.
    #[error("the model did not answer within {0:.0} s")]
    Timeout(f64),
}
