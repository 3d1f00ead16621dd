//! The error type of checkpoint loading.

use std::path::{Path, PathBuf};

use kimi_core::ConfigError;

/// A problem opening a checkpoint or reading a tensor from it. Every variant names the file
/// (and, where there is one, the tensor) it is about.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum WeightsError {
    /// Reading or mapping a file failed.
    #[error("{}: {source}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// The operating system's error.
        source: std::io::Error,
    },
    /// `config.json` is not a valid Kimi Linear configuration.
    #[error("{source} (in {})", path.display())]
    Config {
        /// Path of `config.json`.
        path: PathBuf,
        /// What is wrong with it.
        source: ConfigError,
    },
    /// The directory holds neither `model.safetensors` nor `model.safetensors.index.json`.
    #[error("{}: no model.safetensors or model.safetensors.index.json in this directory", dir.display())]
    NoWeights {
        /// The checkpoint directory.
        dir: PathBuf,
    },
    /// `model.safetensors.index.json` is malformed or does not match the shards.
    #[error("{}: {reason}", path.display())]
    Index {
        /// Path of the index file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// A safetensors file is truncated, malformed or inconsistent.
    #[error("{}: corrupt safetensors file: {reason}", file.display())]
    Corrupt {
        /// The shard.
        file: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// The same tensor name is stored in more than one shard.
    #[error("tensor `{name}` is stored more than once, in {}", join(files))]
    Duplicate {
        /// The tensor name.
        name: String,
        /// The shards that hold it.
        files: Vec<PathBuf>,
    },
    /// A tensor the model asked for is not in the checkpoint.
    #[error(
        "tensor `{name}` is not in the checkpoint (searched {}){}",
        join(files),
        near_list(near)
    )]
    Missing {
        /// The tensor name asked for.
        name: String,
        /// Every shard that was searched.
        files: Vec<PathBuf>,
        /// Up to five stored names that nearly match `name`, closest first.
        near: Vec<String>,
    },
    /// A tensor has a different shape than the model expects.
    #[error("tensor `{name}` in {}: expected shape {expected:?}, found {found:?}", file.display())]
    Shape {
        /// The tensor name.
        name: String,
        /// The shard that holds it.
        file: PathBuf,
        /// The shape the model expects, outermost first.
        expected: Vec<usize>,
        /// The shape stored in the file.
        found: Vec<usize>,
    },
    /// A tensor is stored in a dtype kimi-infer cannot read yet (only F32, F16 and BF16 are).
    #[error(
        "tensor `{name}` in {}: dtype {dtype} is not supported (kimi-infer reads F32, F16 and BF16)",
        file.display()
    )]
    UnsupportedDType {
        /// The tensor name.
        name: String,
        /// The shard that holds it.
        file: PathBuf,
        /// The dtype as written in the safetensors header (`I8`, `F8_E4M3`, ...).
        dtype: String,
    },
    /// The checkpoint holds tensors the model did not use.
    #[error("{} tensors in the checkpoint are not used by the model: {}", names.len(), names.join(", "))]
    Unexpected {
        /// Every unused tensor name, sorted.
        names: Vec<String>,
    },
}

/// Joins paths for messages.
fn join(files: &[PathBuf]) -> String {
    let names: Vec<String> = files.iter().map(|f| f.display().to_string()).collect();
    names.join(", ")
}

/// The suggestions of a [`WeightsError::Missing`] message.
fn near_list(near: &[String]) -> String {
    if near.is_empty() {
        return "; no stored name nearly matches".into();
    }
    let names: Vec<String> = near.iter().map(|n| format!("`{n}`")).collect();
    format!("; names that nearly match: {}", names.join(", "))
}

/// Builds a [`WeightsError::Io`] for `path`.
pub(crate) fn io(path: &Path) -> impl FnOnce(std::io::Error) -> WeightsError + '_ {
    move |source| WeightsError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// Builds a [`WeightsError::Corrupt`] for `file`.
pub(crate) fn corrupt(file: &Path, reason: impl Into<String>) -> WeightsError {
    WeightsError::Corrupt {
        file: file.to_path_buf(),
        reason: reason.into(),
    }
}
