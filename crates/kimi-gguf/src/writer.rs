//! [`GgufWriter`]: builds a GGUF v3 file from metadata and tensors.

use std::borrow::Cow;
use std::collections::HashSet;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::Path;

use crate::error::{GgufError, Result};
use crate::header::{align_up, DEFAULT_ALIGNMENT, MAGIC, MAX_ARRAY_DEPTH, MAX_DIMS};
use crate::types::GgmlType;
use crate::value::{Array, Value};

/// Longest tensor name ggml accepts (`GGML_MAX_NAME` is 64 bytes with the terminator).
const MAX_NAME_BYTES: usize = 63;

/// Collects metadata and tensors, then writes them as one GGUF v3 file.
///
/// Tensors are written in the order added, each at the next offset that is a multiple of
/// the alignment (`general.alignment` if that key was added as a `u32`, else 32), with
/// zero padding between them.
///
/// ```
/// use kimi_gguf::{GgmlType, GgufFile, GgufWriter, Value};
///
/// # fn main() -> Result<(), kimi_gguf::GgufError> {
/// let weights: Vec<f32> = (0..64).map(|i| i as f32 / 64.0).collect();
/// let mut writer = GgufWriter::new();
/// writer.add_metadata("general.architecture", Value::String("llama".into()))?;
/// writer.add_tensor("w", &[2, 32], GgmlType::Q8_0, kimi_gguf::quantize(GgmlType::Q8_0, &weights)?)?;
/// let file = GgufFile::from_vec(writer.to_bytes()?)?;
/// assert_eq!(file.get_str("general.architecture")?, "llama");
/// assert_eq!(file.tensor("w")?.info.shape_outer_first(), [2, 32]);
/// # Ok(())
/// # }
/// ```
#[derive(Debug, Default)]
pub struct GgufWriter<'a> {
    metadata: Vec<(String, Value)>,
    keys: HashSet<String>,
    tensors: Vec<PendingTensor<'a>>,
    names: HashSet<String>,
    alignment: Option<u64>,
}

struct PendingTensor<'a> {
    name: String,
    /// Innermost first, as stored.
    ne: Vec<u64>,
    ggml_type: GgmlType,
    /// `None` for a tensor declared with [`GgufWriter::add_tensor_info`], whose bytes come
    /// later from [`GgufWriter::write_streamed`].
    data: Option<Cow<'a, [u8]>>,
    size_bytes: usize,
}

impl std::fmt::Debug for PendingTensor<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PendingTensor")
            .field("name", &self.name)
            .field("ne", &self.ne)
            .field("ggml_type", &self.ggml_type)
            .field("size_bytes", &self.size_bytes)
            .finish()
    }
}

impl<'a> GgufWriter<'a> {
    /// An empty writer.
    pub fn new() -> GgufWriter<'a> {
        GgufWriter::default()
    }

    /// Adds a metadata entry; keys must be unique, arrays nested at most 8 deep.
    /// `general.alignment`, if given, must be a power-of-two [`Value::U32`] and sets the
    /// data alignment.
    pub fn add_metadata(&mut self, key: impl Into<String>, value: Value) -> Result<&mut Self> {
        let key = key.into();
        let invalid = |reason: &str| GgufError::InvalidMetadata {
            key: key.clone(),
            reason: reason.to_string(),
        };
        if self.keys.contains(&key) {
            return Err(invalid("the key was already added"));
        }
        if let Value::Array(a) = &value {
            if a.depth() > MAX_ARRAY_DEPTH {
                return Err(invalid(
                    "arrays nested more than 8 deep cannot be read back",
                ));
            }
        }
        if key == "general.alignment" {
            match value {
                Value::U32(a) if a.is_power_of_two() => self.alignment = Some(u64::from(a)),
                _ => return Err(invalid("general.alignment must be a power-of-two u32")),
            }
        }
        self.keys.insert(key.clone());
        self.metadata.push((key, value));
        Ok(self)
    }

    /// Adds a tensor. `shape_outer_first` is row-major (`[rows, cols]`); it is stored
    /// reversed as ggml's `ne`. `data` must be exactly the tensor's size in `ggml_type`'s
    /// block layout (see [`crate::quantize`]), and the innermost dimension a whole number
    /// of blocks.
    pub fn add_tensor(
        &mut self,
        name: impl Into<String>,
        shape_outer_first: &[usize],
        ggml_type: GgmlType,
        data: impl Into<Cow<'a, [u8]>>,
    ) -> Result<&mut Self> {
        let name = name.into();
        let data = data.into();
        let pending = self.check_tensor(name, shape_outer_first, ggml_type)?;
        if data.len() != pending.size_bytes {
            return Err(GgufError::InvalidTensor {
                tensor: pending.name,
                reason: format!(
                    "{ggml_type} {shape_outer_first:?} needs {} bytes, got {}",
                    pending.size_bytes,
                    data.len()
                ),
            });
        }
        self.push(PendingTensor {
            data: Some(data),
            ..pending
        });
        Ok(self)
    }

    /// Declares a tensor whose bytes are produced later, while the file is written, by
    /// [`GgufWriter::write_streamed`] (so a converter never holds a whole model in memory).
    /// The checks are those of [`GgufWriter::add_tensor`].
    pub fn add_tensor_info(
        &mut self,
        name: impl Into<String>,
        shape_outer_first: &[usize],
        ggml_type: GgmlType,
    ) -> Result<&mut Self> {
        let pending = self.check_tensor(name.into(), shape_outer_first, ggml_type)?;
        self.push(pending);
        Ok(self)
    }

    /// Bytes `ggml_type` needs for `shape_outer_first` (whole blocks along the last
    /// dimension), or why it cannot hold that shape.
    fn check_tensor(
        &self,
        name: String,
        shape_outer_first: &[usize],
        ggml_type: GgmlType,
    ) -> Result<PendingTensor<'a>> {
        let invalid = |reason: String| GgufError::InvalidTensor {
            tensor: name.clone(),
            reason,
        };
        if name.len() > MAX_NAME_BYTES {
            return Err(invalid(format!("names are at most {MAX_NAME_BYTES} bytes")));
        }
        if self.names.contains(&name) {
            return Err(invalid("the name was already added".into()));
        }
        if shape_outer_first.len() > MAX_DIMS as usize {
            return Err(invalid(format!("at most {MAX_DIMS} dimensions")));
        }
        let ne: Vec<u64> = shape_outer_first.iter().rev().map(|&d| d as u64).collect();
        let num_cols = shape_outer_first.last().copied().unwrap_or(1);
        let num_rows = shape_outer_first
            .iter()
            .rev()
            .skip(1)
            .try_fold(1usize, |a, &d| a.checked_mul(d));
        let size_bytes = ggml_type
            .row_bytes(num_cols)
            .zip(num_rows)
            .and_then(|(row, rows)| row.checked_mul(rows))
            .ok_or_else(|| {
                invalid(format!(
                    "shape {shape_outer_first:?} is not whole {ggml_type} blocks of {} along \
                     the last dimension, or its size overflows",
                    ggml_type.block_size()
                ))
            })?;
        Ok(PendingTensor {
            name,
            ne,
            ggml_type,
            data: None,
            size_bytes,
        })
    }

    fn push(&mut self, tensor: PendingTensor<'a>) {
        self.names.insert(tensor.name.clone());
        self.tensors.push(tensor);
    }

    /// Writes the file at `path`, asking `fill(i)` for the bytes of the `i`-th tensor (in
    /// the order added) that was declared with [`GgufWriter::add_tensor_info`]; tensors
    /// added with their data are written as they are. Each tensor is written and dropped
    /// before the next one is asked for.
    pub fn write_streamed<E: From<GgufError>>(
        &self,
        path: impl AsRef<Path>,
        mut fill: impl FnMut(usize) -> std::result::Result<Vec<u8>, E>,
    ) -> std::result::Result<(), E> {
        let path = path.as_ref();
        let file = File::create(path).map_err(GgufError::io(path))?;
        let mut out = BufWriter::new(file);
        let alignment = self.alignment.unwrap_or(DEFAULT_ALIGNMENT);
        let mut w = CountingWriter {
            out: &mut out,
            written: 0,
        };
        self.write_header(&mut w, alignment)
            .map_err(GgufError::io(path))?;
        for (i, t) in self.tensors.iter().enumerate() {
            let owned;
            let bytes: &[u8] = match &t.data {
                Some(data) => data,
                None => {
                    owned = fill(i)?;
                    &owned
                }
            };
            if bytes.len() != t.size_bytes {
                return Err(GgufError::InvalidTensor {
                    tensor: t.name.clone(),
                    reason: format!("needs {} bytes, got {}", t.size_bytes, bytes.len()),
                }
                .into());
            }
            w.put(bytes).map_err(GgufError::io(path))?;
            w.pad_to(alignment).map_err(GgufError::io(path))?;
        }
        out.into_inner()
            .map_err(|e| e.into_error())
            .and_then(|f| f.sync_all())
            .map_err(GgufError::io(path))?;
        Ok(())
    }

    /// Writes the file at `path` (created or truncated).
    pub fn write(&self, path: impl AsRef<Path>) -> Result<()> {
        let path = path.as_ref();
        let file = File::create(path).map_err(GgufError::io(path))?;
        let mut out = BufWriter::new(file);
        self.write_to(&mut out).map_err(GgufError::io(path))?;
        out.into_inner()
            .map_err(|e| e.into_error())
            .and_then(|f| f.sync_all())
            .map_err(GgufError::io(path))
    }

    /// The file's bytes, in memory.
    pub fn to_bytes(&self) -> Result<Vec<u8>> {
        let mut out = Vec::new();
        self.write_to(&mut out)
            .map_err(GgufError::io(Path::new("<memory>")))?;
        Ok(out)
    }

    /// Writes the file to `out`. Fails for a tensor declared without its data
    /// ([`GgufWriter::add_tensor_info`]; use [`GgufWriter::write_streamed`]).
    pub fn write_to(&self, out: &mut impl Write) -> std::io::Result<()> {
        let alignment = self.alignment.unwrap_or(DEFAULT_ALIGNMENT);
        let mut w = CountingWriter { out, written: 0 };
        self.write_header(&mut w, alignment)?;
        for t in &self.tensors {
            let data = t.data.as_deref().ok_or_else(|| {
                std::io::Error::other(format!(
                    "tensor `{}` was declared without data; write it with write_streamed",
                    t.name
                ))
            })?;
            w.put(data)?;
            w.pad_to(alignment)?;
        }
        Ok(())
    }

    /// Magic, counts, metadata and tensor infos, padded to the data section.
    fn write_header<W: Write>(
        &self,
        w: &mut CountingWriter<'_, W>,
        alignment: u64,
    ) -> std::io::Result<()> {
        w.put(&MAGIC)?;
        w.put(&3u32.to_le_bytes())?;
        w.put(&(self.tensors.len() as u64).to_le_bytes())?;
        w.put(&(self.metadata.len() as u64).to_le_bytes())?;
        for (key, value) in &self.metadata {
            write_string(w, key)?;
            w.put(&value.value_type().id().to_le_bytes())?;
            write_value(w, value)?;
        }
        let mut offset = 0u64;
        for t in &self.tensors {
            write_string(w, &t.name)?;
            w.put(&(t.ne.len() as u32).to_le_bytes())?;
            for d in &t.ne {
                w.put(&d.to_le_bytes())?;
            }
            w.put(&t.ggml_type.id().to_le_bytes())?;
            w.put(&offset.to_le_bytes())?;
            offset = aligned(offset.saturating_add(t.size_bytes as u64), alignment)?;
        }
        w.pad_to(alignment)
    }
}

fn aligned(n: u64, alignment: u64) -> std::io::Result<u64> {
    align_up(n, alignment).ok_or_else(|| std::io::Error::other("file size overflows u64"))
}

/// Counts bytes so padding can be computed without `Seek`.
struct CountingWriter<'w, W: Write> {
    out: &'w mut W,
    written: u64,
}

impl<W: Write> CountingWriter<'_, W> {
    fn put(&mut self, bytes: &[u8]) -> std::io::Result<()> {
        self.out.write_all(bytes)?;
        self.written += bytes.len() as u64;
        Ok(())
    }

    fn pad_to(&mut self, alignment: u64) -> std::io::Result<()> {
        let target = aligned(self.written, alignment)?;
        let zeros = [0u8; 64];
        while self.written < target {
            let n = (target - self.written).min(zeros.len() as u64) as usize;
            self.put(&zeros[..n])?;
        }
        Ok(())
    }
}

fn write_string<W: Write>(w: &mut CountingWriter<'_, W>, s: &str) -> std::io::Result<()> {
    w.put(&(s.len() as u64).to_le_bytes())?;
    w.put(s.as_bytes())
}

fn write_value<W: Write>(w: &mut CountingWriter<'_, W>, value: &Value) -> std::io::Result<()> {
    match value {
        Value::U8(v) => w.put(&v.to_le_bytes()),
        Value::I8(v) => w.put(&v.to_le_bytes()),
        Value::U16(v) => w.put(&v.to_le_bytes()),
        Value::I16(v) => w.put(&v.to_le_bytes()),
        Value::U32(v) => w.put(&v.to_le_bytes()),
        Value::I32(v) => w.put(&v.to_le_bytes()),
        Value::U64(v) => w.put(&v.to_le_bytes()),
        Value::I64(v) => w.put(&v.to_le_bytes()),
        Value::F32(v) => w.put(&v.to_le_bytes()),
        Value::F64(v) => w.put(&v.to_le_bytes()),
        Value::Bool(v) => w.put(&[u8::from(*v)]),
        Value::String(s) => write_string(w, s),
        Value::Array(a) => write_array(w, a),
    }
}

/// Writes an array: element type, count, elements.
fn write_array<W: Write>(w: &mut CountingWriter<'_, W>, array: &Array) -> std::io::Result<()> {
    w.put(&array.element_type().id().to_le_bytes())?;
    w.put(&(array.len() as u64).to_le_bytes())?;
    macro_rules! each {
        ($v:expr) => {
            $v.iter().try_for_each(|x| w.put(&x.to_le_bytes()))
        };
    }
    match array {
        Array::U8(v) => w.put(v),
        Array::I8(v) => each!(v),
        Array::U16(v) => each!(v),
        Array::I16(v) => each!(v),
        Array::U32(v) => each!(v),
        Array::I32(v) => each!(v),
        Array::U64(v) => each!(v),
        Array::I64(v) => each!(v),
        Array::F32(v) => each!(v),
        Array::F64(v) => each!(v),
        Array::Bool(v) => v.iter().try_for_each(|&b| w.put(&[u8::from(b)])),
        Array::String(v) => v.iter().try_for_each(|s| write_string(w, s)),
        Array::Array(v) => v.iter().try_for_each(|a| write_array(w, a)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::GgufFile;

    #[test]
    fn streamed_tensors_read_back_like_added_ones() {
        let dir = std::env::temp_dir().join(format!("kimi-gguf-stream-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let path = dir.join("s.gguf");
        let mut w = GgufWriter::new();
        w.add_tensor("a", &[2], GgmlType::F32, vec![0u8; 8])
            .expect("a");
        w.add_tensor_info("b", &[3], GgmlType::F32).expect("b");
        assert!(w.to_bytes().is_err(), "declared data must be streamed");
        let result: Result<()> = w.write_streamed(&path, |i| {
            assert_eq!(i, 1);
            Ok([1f32, 2.0, 3.0]
                .iter()
                .flat_map(|v| v.to_le_bytes())
                .collect())
        });
        result.expect("written");
        let file = GgufFile::open(&path).expect("readable");
        assert_eq!(
            file.tensor("b").and_then(|t| t.to_f32()).ok(),
            Some(vec![1.0, 2.0, 3.0])
        );
        let short: Result<()> = w.write_streamed(&path, |_| Ok(vec![0u8; 4]));
        assert!(short.is_err(), "a wrong size is rejected");
        std::fs::remove_dir_all(&dir).ok();
    }
}
