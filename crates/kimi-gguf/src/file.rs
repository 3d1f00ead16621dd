//! [`GgufFile`]: an opened, validated GGUF file, and its tensors.

use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};

use memmap2::Mmap;

use crate::error::{GgufError, Result};
use crate::header::{self, Header};
use crate::types::GgmlType;
use crate::value::{Array, Value};

/// An opened GGUF file (version 2 or 3). The whole header is parsed and validated by
/// [`GgufFile::open`]: every tensor's type is known and its data lies inside the file at
/// an aligned offset, so later lookups cannot fail on a corrupt file.
pub struct GgufFile {
    path: PathBuf,
    bytes: Bytes,
    header: Header,
    /// Tensor name to index in `header.tensors`.
    index: HashMap<String, usize>,
}

/// Where the file's bytes live.
enum Bytes {
    Mapped(Mmap),
    Owned(Vec<u8>),
}

impl Bytes {
    fn as_slice(&self) -> &[u8] {
        match self {
            Bytes::Mapped(m) => m,
            Bytes::Owned(v) => v,
        }
    }
}

/// One tensor's header entry.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct TensorInfo {
    /// The tensor name (`blk.0.attn_q.weight`).
    pub name: String,
    /// Dimensions as ggml stores them, **innermost first**: `ne[0]` is the number of
    /// columns (elements contiguous in memory). At most four.
    pub ne: Vec<u64>,
    /// The element type.
    pub ggml_type: GgmlType,
    /// Offset of the data from the start of the data section (a multiple of the alignment).
    pub offset: u64,
    /// Bytes of data.
    pub size_bytes: u64,
}

impl TensorInfo {
    /// The shape outermost first, the row-major order used elsewhere in kimi-infer
    /// (`[rows, cols]` for a matrix whose `ne` is `[cols, rows]`).
    pub fn shape_outer_first(&self) -> Vec<usize> {
        // Each dimension was checked to fit in usize when the file was opened.
        self.ne
            .iter()
            .rev()
            .map(|&d| usize::try_from(d).unwrap_or(usize::MAX))
            .collect()
    }

    /// Number of elements (product of `ne`; 1 for a zero-dimensional tensor).
    pub fn num_elements(&self) -> u64 {
        self.ne.iter().product()
    }
}

/// A tensor's header entry and its raw bytes, borrowed from the file.
#[derive(Debug, Clone, Copy)]
pub struct TensorData<'a> {
    /// The header entry.
    pub info: &'a TensorInfo,
    /// The raw data, `info.size_bytes` long, in `info.ggml_type`'s block layout.
    pub bytes: &'a [u8],
}

impl TensorData<'_> {
    /// Dequantizes the whole tensor to `f32`, in memory order (row-major over
    /// [`TensorInfo::shape_outer_first`]).
    pub fn to_f32(&self) -> Result<Vec<f32>> {
        let n = usize::try_from(self.info.num_elements()).map_err(|_| GgufError::BadLength {
            ty: self.info.ggml_type,
            reason: format!("tensor `{}` has too many elements", self.info.name),
        })?;
        crate::dequantize(self.info.ggml_type, self.bytes, n)
    }
}

impl GgufFile {
    /// Memory-maps and validates the GGUF file at `path`.
    pub fn open(path: impl AsRef<Path>) -> Result<GgufFile> {
        let path = path.as_ref().to_path_buf();
        let file = File::open(&path).map_err(GgufError::io(&path))?;
        // SAFETY: the map is read-only and lives as long as `GgufFile`. As with ripgrep's
        // mmap searching and `kimi-weights`, kimi-infer treats model files as immutable
        // while they are open; another process truncating or rewriting the file at the
        // same time is the user's risk (at worst wrong weights or a SIGBUS).
        let map = unsafe { Mmap::map(&file) }.map_err(GgufError::io(&path))?;
        let header = header::parse(&path, &map)?;
        Ok(GgufFile::new(path, Bytes::Mapped(map), header))
    }

    /// Parses GGUF bytes already in memory (tests, fuzzing, downloads); errors name the
    /// file `<memory>`.
    pub fn from_vec(bytes: Vec<u8>) -> Result<GgufFile> {
        let path = header::memory_path();
        let header = header::parse(&path, &bytes)?;
        Ok(GgufFile::new(path, Bytes::Owned(bytes), header))
    }

    fn new(path: PathBuf, bytes: Bytes, header: Header) -> GgufFile {
        let index = header
            .tensors
            .iter()
            .enumerate()
            .map(|(i, t)| (t.name.clone(), i))
            .collect();
        GgufFile {
            path,
            bytes,
            header,
            index,
        }
    }

    /// The path the file was opened from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The GGUF version, 2 or 3.
    pub fn version(&self) -> u32 {
        self.header.version
    }

    /// The data-section alignment (`general.alignment`, default 32).
    pub fn alignment(&self) -> u64 {
        self.header.alignment
    }

    /// Absolute file offset of the data section.
    pub fn data_offset(&self) -> u64 {
        self.header.data_offset
    }

    /// All metadata entries, in file order.
    pub fn metadata(&self) -> &[(String, Value)] {
        &self.header.metadata
    }

    /// The metadata value for `key`, if present.
    pub fn get(&self, key: &str) -> Option<&Value> {
        self.header
            .metadata
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v)
    }

    fn require(&self, key: &str) -> Result<&Value> {
        self.get(key).ok_or_else(|| GgufError::KeyNotFound {
            path: self.path.clone(),
            key: key.to_string(),
        })
    }

    fn wrong_type(&self, key: &str, expected: &'static str, found: &Value) -> GgufError {
        let found = match found.as_integer() {
            Some(i) => format!("{} {i}", found.describe()),
            None => found.describe(),
        };
        GgufError::KeyType {
            path: self.path.clone(),
            key: key.to_string(),
            expected,
            found,
        }
    }

    fn get_integer<T: TryFrom<i128>>(&self, key: &str, expected: &'static str) -> Result<T> {
        let v = self.require(key)?;
        v.as_integer()
            .and_then(|i| T::try_from(i).ok())
            .ok_or_else(|| self.wrong_type(key, expected, v))
    }

    /// The integer at `key` as a `u32`. Any integer type is accepted if the value fits
    /// (converters disagree on `u32` vs `u64` for counts).
    pub fn get_u32(&self, key: &str) -> Result<u32> {
        self.get_integer(key, "an integer that fits in u32")
    }

    /// The integer at `key` as a `u64`; any integer type is accepted if the value fits.
    pub fn get_u64(&self, key: &str) -> Result<u64> {
        self.get_integer(key, "an integer that fits in u64")
    }

    /// The integer at `key` as an `i64`; any integer type is accepted if the value fits.
    pub fn get_i64(&self, key: &str) -> Result<i64> {
        self.get_integer(key, "an integer that fits in i64")
    }

    /// The float at `key` as an `f32` (an `f64` is narrowed).
    pub fn get_f32(&self, key: &str) -> Result<f32> {
        match self.require(key)? {
            Value::F32(v) => Ok(*v),
            Value::F64(v) => Ok(*v as f32),
            other => Err(self.wrong_type(key, "f32", other)),
        }
    }

    /// The bool at `key`.
    pub fn get_bool(&self, key: &str) -> Result<bool> {
        match self.require(key)? {
            Value::Bool(v) => Ok(*v),
            other => Err(self.wrong_type(key, "bool", other)),
        }
    }

    /// The string at `key`.
    pub fn get_str(&self, key: &str) -> Result<&str> {
        match self.require(key)? {
            Value::String(v) => Ok(v),
            other => Err(self.wrong_type(key, "string", other)),
        }
    }

    /// The array at `key`.
    pub fn get_array(&self, key: &str) -> Result<&Array> {
        match self.require(key)? {
            Value::Array(v) => Ok(v),
            other => Err(self.wrong_type(key, "array", other)),
        }
    }

    /// All tensor infos, in file order.
    pub fn tensors(&self) -> &[TensorInfo] {
        &self.header.tensors
    }

    /// The tensor named `name`: its info and raw bytes.
    pub fn tensor(&self, name: &str) -> Result<TensorData<'_>> {
        let info = self
            .index
            .get(name)
            .and_then(|&i| self.header.tensors.get(i))
            .ok_or_else(|| GgufError::TensorNotFound {
                path: self.path.clone(),
                tensor: name.to_string(),
            })?;
        Ok(TensorData {
            info,
            bytes: self.tensor_bytes(info),
        })
    }

    /// The bytes of `info`, which must come from this file (range checked at open; an
    /// info from another file gets an empty slice if its range is not inside this one).
    fn tensor_bytes(&self, info: &TensorInfo) -> &[u8] {
        let start = self.header.data_offset.saturating_add(info.offset);
        let end = start.saturating_add(info.size_bytes);
        let (Ok(start), Ok(end)) = (usize::try_from(start), usize::try_from(end)) else {
            return &[];
        };
        self.bytes.as_slice().get(start..end).unwrap_or(&[])
    }
}

impl std::fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufFile")
            .field("path", &self.path)
            .field("version", &self.header.version)
            .field("num_metadata", &self.header.metadata.len())
            .field("num_tensors", &self.header.tensors.len())
            .finish()
    }
}
