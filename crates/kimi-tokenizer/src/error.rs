//! The crate's one error type.

use std::path::PathBuf;

/// Everything that can go wrong while loading a tokenizer, encoding, decoding or rendering a
/// chat template. Load errors name the file (and line, where there is one) and what is wrong.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TokenizerError {
    /// A file could not be read.
    #[error("{}: {source}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// The model directory holds neither `tiktoken.model` nor `tokenizer.json`.
    #[error("{}: no tokenizer found (expected tiktoken.model or tokenizer.json)", dir.display())]
    NotFound {
        /// The directory that was searched.
        dir: PathBuf,
    },
    /// A JSON file does not parse.
    #[error("{}: invalid JSON: {source}", path.display())]
    Json {
        /// The file.
        path: PathBuf,
        /// The parse error.
        #[source]
        source: serde_json::Error,
    },
    /// One line of a `tiktoken.model` vocabulary is malformed or inconsistent.
    #[error("{}:{line}: {reason}", path.display())]
    VocabLine {
        /// The vocabulary file.
        path: PathBuf,
        /// 1-based line number.
        line: usize,
        /// What is wrong with the line.
        reason: String,
    },
    /// A file parses but its content is invalid (wrong field type, duplicate token, ...).
    #[error("{}: {reason}", path.display())]
    InvalidFile {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// The `tokenizers` crate rejected a `tokenizer.json`.
    #[error("{}: {source}", path.display())]
    HfLoad {
        /// The `tokenizer.json` file.
        path: PathBuf,
        /// The error reported by `tokenizers`.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// Encoding failed inside the BPE or the pre-tokenizer (for example a regex backtrack limit).
    #[error("encoding failed: {0}")]
    Encode(String),
    /// Decoding failed inside the `tokenizers` decoder.
    #[error("decoding failed: {0}")]
    Decode(String),
    /// A token id is not in the vocabulary.
    #[error("token id {id} is out of range (vocab size {vocab_size})")]
    UnknownId {
        /// The offending id.
        id: u32,
        /// The vocabulary size (highest id + 1).
        vocab_size: usize,
    },
    /// A GGUF file's tokenizer metadata could not be read (missing key, wrong type).
    #[error(transparent)]
    Gguf(#[from] kimi_gguf::GgufError),
    /// A chat template does not compile.
    #[error("chat template{}: {source}", origin_suffix(origin))]
    TemplateSyntax {
        /// Where the template came from (a file name), if known.
        origin: Option<PathBuf>,
        /// The compile error.
        #[source]
        source: minijinja::Error,
    },
    /// Rendering a chat template failed (including `raise_exception` called by the template).
    #[error("rendering chat template: {0}")]
    TemplateRender(#[source] minijinja::Error),
}

fn origin_suffix(origin: &Option<PathBuf>) -> String {
    match origin {
        Some(path) => format!(" from {}", path.display()),
        None => String::new(),
    }
}
