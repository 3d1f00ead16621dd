//! Parsing and validating the GGUF header: metadata, tensor infos, data-section layout.
//!
//! ```text
//!  offset 0  "GGUF" | version u32 | tensor_count u64 | kv_count u64
//!            kv_count × (key: string, value_type: u32, value)
//!            tensor_count × (name: string, n_dims: u32, ne: u64 × n_dims, type: u32, offset: u64)
//!            zero padding up to a multiple of general.alignment
//!  data      tensor bytes; each tensor at data + offset, offset a multiple of the alignment
//! ```
//! A string is a `u64` byte length then the bytes. Every read is bounds-checked, and every
//! count is checked against the bytes left before anything is allocated for it.

use std::collections::HashSet;
use std::path::{Path, PathBuf};

use crate::error::{GgufError, Result};
use crate::types::GgmlType;
use crate::value::{Array, Value, ValueType};
use crate::TensorInfo;

/// The four bytes every GGUF file starts with.
pub(crate) const MAGIC: [u8; 4] = *b"GGUF";
/// The alignment used when `general.alignment` is absent.
pub const DEFAULT_ALIGNMENT: u64 = 32;
/// Most dimensions a tensor may have (`GGML_MAX_DIMS`).
pub(crate) const MAX_DIMS: u32 = 4;
/// Deepest array nesting accepted; GGUF sets no limit, this stops stack exhaustion.
pub(crate) const MAX_ARRAY_DEPTH: usize = 8;
/// Bytes a tensor info needs at the least: name length, n_dims, type, offset.
const MIN_TENSOR_INFO_BYTES: usize = 8 + 4 + 4 + 8;
/// Bytes a metadata entry needs at the least: key length, value type, one-byte value.
const MIN_KV_BYTES: usize = 8 + 4 + 1;

/// Everything the header says.
#[derive(Debug)]
pub(crate) struct Header {
    pub version: u32,
    pub metadata: Vec<(String, Value)>,
    pub tensors: Vec<TensorInfo>,
    pub alignment: u64,
    /// Absolute offset of the data section.
    pub data_offset: u64,
}

/// A bounds-checked little-endian reader over the file's bytes.
struct Reader<'a> {
    path: &'a Path,
    bytes: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    fn remaining(&self) -> usize {
        self.bytes.len().saturating_sub(self.pos)
    }

    fn take(&mut self, n: usize, what: &dyn Fn() -> String) -> Result<&'a [u8]> {
        let slice = self
            .pos
            .checked_add(n)
            .and_then(|end| self.bytes.get(self.pos..end));
        match slice {
            Some(s) => {
                self.pos += n;
                Ok(s)
            }
            None => Err(GgufError::Truncated {
                path: self.path.to_path_buf(),
                what: what(),
                offset: self.pos as u64,
                needed: n as u64,
                available: self.remaining() as u64,
            }),
        }
    }

    fn array<const N: usize>(&mut self, what: &dyn Fn() -> String) -> Result<[u8; N]> {
        let mut out = [0u8; N];
        out.copy_from_slice(self.take(N, what)?);
        Ok(out)
    }

    fn u32(&mut self, what: &dyn Fn() -> String) -> Result<u32> {
        self.array(what).map(u32::from_le_bytes)
    }

    fn u64(&mut self, what: &dyn Fn() -> String) -> Result<u64> {
        self.array(what).map(u64::from_le_bytes)
    }

    /// Reads a count and checks that `count` items of at least `min_item_bytes` each fit
    /// in the rest of the file, so the count can size an allocation.
    fn count(&mut self, min_item_bytes: usize, what: &dyn Fn() -> String) -> Result<usize> {
        let offset = self.pos as u64;
        let count = self.u64(what)?;
        let available = self.remaining() as u64;
        let fits = count
            .checked_mul(min_item_bytes as u64)
            .is_some_and(|n| n <= available);
        match usize::try_from(count) {
            Ok(n) if fits => Ok(n),
            _ => Err(GgufError::CountTooLarge {
                path: self.path.to_path_buf(),
                what: what(),
                offset,
                count,
                available,
            }),
        }
    }

    fn string(&mut self, what: &dyn Fn() -> String) -> Result<String> {
        let len = self.count(1, &|| format!("length of {}", what()))?;
        let offset = self.pos as u64;
        let bytes = self.take(len, what)?;
        String::from_utf8(bytes.to_vec()).map_err(|_| GgufError::InvalidUtf8 {
            path: self.path.to_path_buf(),
            what: what(),
            offset,
        })
    }
}

/// Parses and validates the whole header of `bytes`, the contents of `path`.
pub(crate) fn parse(path: &Path, bytes: &[u8]) -> Result<Header> {
    let mut r = Reader {
        path,
        bytes,
        pos: 0,
    };
    let magic = bytes.get(..4).unwrap_or(bytes);
    if magic != MAGIC {
        return Err(GgufError::BadMagic {
            path: path.to_path_buf(),
            found: magic.to_vec(),
        });
    }
    r.pos = 4;
    let version = r.u32(&|| "version".into())?;
    if version != 2 && version != 3 {
        return Err(GgufError::UnsupportedVersion {
            path: path.to_path_buf(),
            version,
        });
    }
    let num_tensors = r.count(MIN_TENSOR_INFO_BYTES, &|| "tensor count".into())?;
    let num_kv = r.count(MIN_KV_BYTES, &|| "metadata entry count".into())?;

    let metadata = read_metadata(&mut r, num_kv)?;
    let alignment = alignment(path, &metadata)?;
    let raw = read_tensor_infos(&mut r, num_tensors)?;

    let data_offset = align_up(r.pos as u64, alignment).unwrap_or(u64::MAX);
    let tensors = validate_tensors(path, raw, alignment, data_offset, bytes.len() as u64)?;
    Ok(Header {
        version,
        metadata,
        tensors,
        alignment,
        data_offset,
    })
}

fn read_metadata(r: &mut Reader<'_>, num_kv: usize) -> Result<Vec<(String, Value)>> {
    let mut metadata = Vec::with_capacity(num_kv);
    let mut seen = HashSet::with_capacity(num_kv);
    for i in 0..num_kv {
        let key = r.string(&|| format!("key of metadata entry {i}"))?;
        let type_offset = r.pos as u64;
        let type_id = r.u32(&|| format!("value type of metadata `{key}`"))?;
        let value = read_value(r, &key, type_id, type_offset, 0)?;
        if !seen.insert(key.clone()) {
            return Err(GgufError::DuplicateKey {
                path: r.path.to_path_buf(),
                key,
            });
        }
        metadata.push((key, value));
    }
    Ok(metadata)
}

fn bad_value(r: &Reader<'_>, key: &str, offset: u64, reason: String) -> GgufError {
    GgufError::BadValue {
        path: r.path.to_path_buf(),
        key: key.to_string(),
        offset,
        reason,
    }
}

fn value_type(r: &Reader<'_>, key: &str, id: u32, offset: u64) -> Result<ValueType> {
    ValueType::from_id(id)
        .ok_or_else(|| bad_value(r, key, offset, format!("unknown value type id {id}")))
}

fn read_value(r: &mut Reader<'_>, key: &str, id: u32, offset: u64, depth: usize) -> Result<Value> {
    let what = || format!("value of metadata `{key}`");
    Ok(match value_type(r, key, id, offset)? {
        ValueType::U8 => Value::U8(u8::from_le_bytes(r.array(&what)?)),
        ValueType::I8 => Value::I8(i8::from_le_bytes(r.array(&what)?)),
        ValueType::U16 => Value::U16(u16::from_le_bytes(r.array(&what)?)),
        ValueType::I16 => Value::I16(i16::from_le_bytes(r.array(&what)?)),
        ValueType::U32 => Value::U32(u32::from_le_bytes(r.array(&what)?)),
        ValueType::I32 => Value::I32(i32::from_le_bytes(r.array(&what)?)),
        ValueType::F32 => Value::F32(f32::from_le_bytes(r.array(&what)?)),
        ValueType::U64 => Value::U64(u64::from_le_bytes(r.array(&what)?)),
        ValueType::I64 => Value::I64(i64::from_le_bytes(r.array(&what)?)),
        ValueType::F64 => Value::F64(f64::from_le_bytes(r.array(&what)?)),
        ValueType::Bool => Value::Bool(read_bool(r, key)?),
        ValueType::String => Value::String(r.string(&what)?),
        ValueType::Array => Value::Array(read_array(r, key, depth)?),
    })
}

fn read_bool(r: &mut Reader<'_>, key: &str) -> Result<bool> {
    let offset = r.pos as u64;
    match r.array::<1>(&|| format!("value of metadata `{key}`"))? {
        [0] => Ok(false),
        [1] => Ok(true),
        [b] => Err(bad_value(
            r,
            key,
            offset,
            format!("bool byte is {b}, expected 0 or 1"),
        )),
    }
}

/// Reads an array header and its elements; `depth` is how many arrays enclose this one.
fn read_array(r: &mut Reader<'_>, key: &str, depth: usize) -> Result<Array> {
    let offset = r.pos as u64;
    if depth >= MAX_ARRAY_DEPTH {
        let reason = format!("arrays nested more than {MAX_ARRAY_DEPTH} deep");
        return Err(bad_value(r, key, offset, reason));
    }
    let elem_id = r.u32(&|| format!("element type of array `{key}`"))?;
    let elem = value_type(r, key, elem_id, offset)?;
    let n = r.count(elem.min_size(), &|| {
        format!("element count of array `{key}`")
    })?;
    let what = || format!("elements of array `{key}`");
    Ok(match elem {
        ValueType::U8 => Array::U8(r.take(n, &what)?.to_vec()),
        ValueType::I8 => Array::I8(fixed(r, n, &what, i8::from_le_bytes)?),
        ValueType::U16 => Array::U16(fixed(r, n, &what, u16::from_le_bytes)?),
        ValueType::I16 => Array::I16(fixed(r, n, &what, i16::from_le_bytes)?),
        ValueType::U32 => Array::U32(fixed(r, n, &what, u32::from_le_bytes)?),
        ValueType::I32 => Array::I32(fixed(r, n, &what, i32::from_le_bytes)?),
        ValueType::F32 => Array::F32(fixed(r, n, &what, f32::from_le_bytes)?),
        ValueType::U64 => Array::U64(fixed(r, n, &what, u64::from_le_bytes)?),
        ValueType::I64 => Array::I64(fixed(r, n, &what, i64::from_le_bytes)?),
        ValueType::F64 => Array::F64(fixed(r, n, &what, f64::from_le_bytes)?),
        ValueType::Bool => Array::Bool((0..n).map(|_| read_bool(r, key)).collect::<Result<_>>()?),
        ValueType::String => Array::String(
            (0..n)
                .map(|i| r.string(&|| format!("element {i} of array `{key}`")))
                .collect::<Result<_>>()?,
        ),
        ValueType::Array => Array::Array(
            (0..n)
                .map(|_| read_array(r, key, depth + 1))
                .collect::<Result<_>>()?,
        ),
    })
}

/// Reads `n` fixed-size little-endian values (`n` was already checked against the file).
fn fixed<T, const N: usize>(
    r: &mut Reader<'_>,
    n: usize,
    what: &dyn Fn() -> String,
    decode: fn([u8; N]) -> T,
) -> Result<Vec<T>> {
    let bytes = r.take(n.saturating_mul(N), what)?;
    Ok(bytes
        .chunks_exact(N)
        .map(|c| {
            let mut a = [0u8; N];
            a.copy_from_slice(c);
            decode(a)
        })
        .collect())
}

/// `general.alignment`, or the default when absent.
fn alignment(path: &Path, metadata: &[(String, Value)]) -> Result<u64> {
    match metadata.iter().find(|(k, _)| k == "general.alignment") {
        None => Ok(DEFAULT_ALIGNMENT),
        Some((_, Value::U32(a))) if a.is_power_of_two() => Ok(u64::from(*a)),
        Some((_, v)) => Err(GgufError::BadAlignment {
            path: path.to_path_buf(),
            found: match v.as_integer() {
                Some(i) => format!("{} {i}", v.describe()),
                None => v.describe(),
            },
        }),
    }
}

/// A tensor info as stored, before its type and layout are checked.
struct RawTensorInfo {
    name: String,
    ne: Vec<u64>,
    type_id: u32,
    offset: u64,
}

fn read_tensor_infos(r: &mut Reader<'_>, num_tensors: usize) -> Result<Vec<RawTensorInfo>> {
    let mut infos = Vec::with_capacity(num_tensors);
    for i in 0..num_tensors {
        let name = r.string(&|| format!("name of tensor {i}"))?;
        let n_dims = r.u32(&|| format!("n_dims of tensor `{name}`"))?;
        if n_dims > MAX_DIMS {
            return Err(GgufError::BadShape {
                path: r.path.to_path_buf(),
                tensor: name,
                reason: format!("{n_dims} dimensions, at most {MAX_DIMS} are allowed"),
            });
        }
        let ne = (0..n_dims)
            .map(|d| r.u64(&|| format!("ne[{d}] of tensor `{name}`")))
            .collect::<Result<Vec<u64>>>()?;
        let type_id = r.u32(&|| format!("type of tensor `{name}`"))?;
        let offset = r.u64(&|| format!("offset of tensor `{name}`"))?;
        infos.push(RawTensorInfo {
            name,
            ne,
            type_id,
            offset,
        });
    }
    Ok(infos)
}

fn validate_tensors(
    path: &Path,
    raw: Vec<RawTensorInfo>,
    alignment: u64,
    data_offset: u64,
    file_len: u64,
) -> Result<Vec<TensorInfo>> {
    let mut seen = HashSet::with_capacity(raw.len());
    let mut tensors = Vec::with_capacity(raw.len());
    for t in raw {
        let ty = GgmlType::from_id(t.type_id).ok_or_else(|| GgufError::UnknownTensorType {
            path: path.to_path_buf(),
            tensor: t.name.clone(),
            type_id: t.type_id,
        })?;
        let size_bytes = tensor_bytes(path, &t, ty)?;
        if !t.offset.is_multiple_of(alignment) {
            return Err(GgufError::MisalignedOffset {
                path: path.to_path_buf(),
                tensor: t.name,
                offset: t.offset,
                alignment,
            });
        }
        let start = data_offset.checked_add(t.offset);
        let end = start.and_then(|s| s.checked_add(size_bytes));
        if end.is_none_or(|e| e > file_len) {
            return Err(GgufError::TensorOutOfRange {
                path: path.to_path_buf(),
                tensor: t.name,
                start: start.unwrap_or(u64::MAX),
                end: end.unwrap_or(u64::MAX),
                file_len,
            });
        }
        if !seen.insert(t.name.clone()) {
            return Err(GgufError::DuplicateTensor {
                path: path.to_path_buf(),
                tensor: t.name,
            });
        }
        tensors.push(TensorInfo {
            name: t.name,
            ne: t.ne,
            ggml_type: ty,
            offset: t.offset,
            size_bytes,
        });
    }
    Ok(tensors)
}

/// The byte size of a tensor: whole blocks along `ne[0]`, no overflow anywhere.
fn tensor_bytes(path: &Path, t: &RawTensorInfo, ty: GgmlType) -> Result<u64> {
    let bad = |reason: String| GgufError::BadShape {
        path: path.to_path_buf(),
        tensor: t.name.clone(),
        reason,
    };
    let ne0 = t.ne.first().copied().unwrap_or(1);
    let block = ty.block_size() as u64;
    if !ne0.is_multiple_of(block) {
        return Err(bad(format!(
            "ne[0] = {ne0} is not a multiple of the {ty} block size {block}"
        )));
    }
    let num_elements =
        t.ne.iter()
            .try_fold(1u64, |acc, &d| acc.checked_mul(d))
            .ok_or_else(|| bad(format!("element count of {:?} overflows", t.ne)))?;
    if t.ne.iter().any(|&d| usize::try_from(d).is_err()) {
        return Err(bad(format!("dimensions {:?} do not fit in usize", t.ne)));
    }
    (num_elements / block)
        .checked_mul(ty.type_size() as u64)
        .ok_or_else(|| bad(format!("byte size of {:?} overflows", t.ne)))
}

/// Rounds `n` up to a multiple of `alignment` (a power of two), `None` on overflow.
pub(crate) fn align_up(n: u64, alignment: u64) -> Option<u64> {
    n.checked_add(alignment - 1).map(|v| v & !(alignment - 1))
}

/// The path used in errors for bytes that did not come from a file.
pub(crate) fn memory_path() -> PathBuf {
    PathBuf::from("<memory>")
}
