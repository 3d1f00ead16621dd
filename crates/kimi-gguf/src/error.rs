//! The error type of the crate.

use std::path::PathBuf;

use crate::types::GgmlType;

/// A problem reading or writing a GGUF file, or (de)quantizing a tensor.
///
/// Every variant about a file names it (`path`; `<memory>` for bytes parsed with
/// [`crate::GgufFile::from_vec`]) and, where there is one, the metadata key or tensor.
/// Byte offsets are from the start of the file.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum GgufError {
    /// Opening, mapping, creating or writing a file failed.
    #[error("{}: {source}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// The operating system's error.
        source: std::io::Error,
    },
    /// The file does not start with the four bytes `GGUF`.
    #[error("{}: not a GGUF file (it starts with \"{}\", expected \"GGUF\")", path.display(), found.escape_ascii())]
    BadMagic {
        /// The file.
        path: PathBuf,
        /// The first (up to four) bytes of the file.
        found: Vec<u8>,
    },
    /// The GGUF version is not 2 or 3 (a big-endian file also lands here, its version
    /// reads byte-swapped).
    #[error("{}: GGUF version {version} is not supported (kimi-gguf reads versions 2 and 3, little-endian)", path.display())]
    UnsupportedVersion {
        /// The file.
        path: PathBuf,
        /// The version field as read (little-endian).
        version: u32,
    },
    /// The file ends inside the header.
    #[error("{}: truncated header: {what} at byte {offset} needs {needed} bytes, only {available} remain", path.display())]
    Truncated {
        /// The file.
        path: PathBuf,
        /// What was being read.
        what: String,
        /// Where it starts.
        offset: u64,
        /// How many bytes it needs.
        needed: u64,
        /// How many bytes the file has from `offset` on.
        available: u64,
    },
    /// A count in the header (metadata entries, tensors, array elements, string bytes)
    /// cannot fit in the rest of the file, so it is corrupt. Checked before anything is
    /// allocated for it.
    #[error("{}: {what} at byte {offset} is {count}, which cannot fit in the {available} bytes left in the file", path.display())]
    CountTooLarge {
        /// The file.
        path: PathBuf,
        /// Which count.
        what: String,
        /// Where the count is stored.
        offset: u64,
        /// The count as stored.
        count: u64,
        /// Bytes left in the file after the count.
        available: u64,
    },
    /// A string in the header is not valid UTF-8.
    #[error("{}: {what} at byte {offset} is not valid UTF-8", path.display())]
    InvalidUtf8 {
        /// The file.
        path: PathBuf,
        /// Which string.
        what: String,
        /// Where the string's bytes start.
        offset: u64,
    },
    /// A metadata value is malformed: an unknown value type, a bool byte other than 0 or
    /// 1, arrays nested too deeply.
    #[error("{}: metadata `{key}` at byte {offset}: {reason}", path.display())]
    BadValue {
        /// The file.
        path: PathBuf,
        /// The metadata key.
        key: String,
        /// Where the bad part starts.
        offset: u64,
        /// What is wrong.
        reason: String,
    },
    /// The same metadata key appears twice.
    #[error("{}: metadata key `{key}` appears more than once", path.display())]
    DuplicateKey {
        /// The file.
        path: PathBuf,
        /// The key.
        key: String,
    },
    /// `general.alignment` is not a non-zero power-of-two `u32`.
    #[error("{}: general.alignment must be a non-zero power-of-two u32, found {found}", path.display())]
    BadAlignment {
        /// The file (or the writer's target).
        path: PathBuf,
        /// The value found, formatted.
        found: String,
    },
    /// A tensor's type id is not a ggml type this crate knows.
    #[error("{}: tensor `{tensor}` has unknown ggml type id {type_id}", path.display())]
    UnknownTensorType {
        /// The file.
        path: PathBuf,
        /// The tensor name.
        tensor: String,
        /// The type id as stored.
        type_id: u32,
    },
    /// A tensor's shape is invalid: more than four dimensions, a first dimension that is
    /// not a whole number of blocks, or an element or byte count that overflows.
    #[error("{}: tensor `{tensor}` has an invalid shape: {reason}", path.display())]
    BadShape {
        /// The file.
        path: PathBuf,
        /// The tensor name.
        tensor: String,
        /// What is wrong.
        reason: String,
    },
    /// A tensor's offset is not a multiple of the file's alignment.
    #[error("{}: tensor `{tensor}` has offset {offset}, not a multiple of the alignment {alignment}", path.display())]
    MisalignedOffset {
        /// The file.
        path: PathBuf,
        /// The tensor name.
        tensor: String,
        /// The offset, relative to the data section.
        offset: u64,
        /// The file's alignment.
        alignment: u64,
    },
    /// A tensor's data runs past the end of the file.
    #[error("{}: tensor `{tensor}` occupies bytes {start}..{end}, past the end of the file ({file_len} bytes)", path.display())]
    TensorOutOfRange {
        /// The file.
        path: PathBuf,
        /// The tensor name.
        tensor: String,
        /// First byte of the data (absolute; may be past the end).
        start: u64,
        /// One past the last byte (absolute; saturated at `u64::MAX`).
        end: u64,
        /// The file size.
        file_len: u64,
    },
    /// The same tensor name appears twice.
    #[error("{}: tensor `{tensor}` appears more than once", path.display())]
    DuplicateTensor {
        /// The file.
        path: PathBuf,
        /// The tensor name.
        tensor: String,
    },
    /// A tensor asked for is not in the file.
    #[error("{}: no tensor named `{tensor}`", path.display())]
    TensorNotFound {
        /// The file.
        path: PathBuf,
        /// The name asked for.
        tensor: String,
    },
    /// A metadata key asked for is not in the file.
    #[error("{}: no metadata key `{key}`", path.display())]
    KeyNotFound {
        /// The file.
        path: PathBuf,
        /// The key asked for.
        key: String,
    },
    /// A metadata value has a different type than asked for.
    #[error("{}: metadata `{key}` is {found}, expected {expected}", path.display())]
    KeyType {
        /// The file.
        path: PathBuf,
        /// The key.
        key: String,
        /// What the caller asked for.
        expected: &'static str,
        /// The type in the file (and the value, if it is an out-of-range integer).
        found: String,
    },
    /// A type cannot be dequantized or quantized by this crate.
    #[error("{op} is not implemented for ggml type {ty}")]
    UnsupportedType {
        /// The ggml type.
        ty: GgmlType,
        /// `"dequantize"` or `"quantize"`.
        op: &'static str,
    },
    /// A (de)quantization buffer has the wrong length, or the element count is not a whole
    /// number of blocks.
    #[error("{ty}: {reason}")]
    BadLength {
        /// The ggml type.
        ty: GgmlType,
        /// What is wrong.
        reason: String,
    },
    /// The writer was given an invalid tensor (bad shape, wrong data length, duplicate name).
    #[error("cannot write tensor `{tensor}`: {reason}")]
    InvalidTensor {
        /// The tensor name.
        tensor: String,
        /// What is wrong.
        reason: String,
    },
    /// The writer was given invalid metadata (duplicate key, an array whose elements
    /// differ in type).
    #[error("cannot write metadata `{key}`: {reason}")]
    InvalidMetadata {
        /// The key.
        key: String,
        /// What is wrong.
        reason: String,
    },
}

impl GgufError {
    /// A helper for `map_err`: an I/O error on `path`.
    pub(crate) fn io(path: &std::path::Path) -> impl FnOnce(std::io::Error) -> GgufError + '_ {
        move |source| GgufError::Io {
            path: path.to_path_buf(),
            source,
        }
    }
}

/// The crate's result type.
pub type Result<T, E = GgufError> = std::result::Result<T, E>;
