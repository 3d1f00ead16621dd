//! Parsing and validation of one safetensors header.
//!
//! Layout (the safetensors format): an 8-byte little-endian header length `n`, `n` bytes of
//! JSON, then the data section. The JSON maps tensor names to `{dtype, shape, data_offsets}`
//! (offsets relative to the data section) plus an optional `__metadata__` map. The data
//! section must be covered exactly by the tensors, without overlaps or holes.
//!
//! ```text
//! | n: u64 LE | header JSON (n bytes) | tensor bytes ... (data section)          |
//! 0           8                       8+n                                  file end
//! ```
//!
//! Everything here is checked and reported with the file name; nothing indexes unchecked.

use std::path::Path;

use kimi_core::DType;
use serde_json::{Map, Value};

use crate::error::{corrupt, WeightsError};

/// Bytes of the header-length field.
const LEN_FIELD_BYTES: usize = 8;

/// Largest header accepted (the limit of the reference safetensors implementation).
const MAX_HEADER_BYTES: u64 = 100_000_000;

/// One tensor entry of a header, validated against the file.
#[derive(Debug)]
pub(crate) struct RawTensor {
    /// Name as written.
    pub(crate) name: String,
    /// Dtype as written (`BF16`, `U8`, ...).
    pub(crate) dtype_name: String,
    /// The dtype when kimi-infer can read it.
    pub(crate) dtype: Option<DType>,
    /// Shape, outermost first.
    pub(crate) shape: Vec<usize>,
    /// First byte in the file.
    pub(crate) start: usize,
    /// One past the last byte in the file.
    pub(crate) end: usize,
}

/// Parses and validates the header of the safetensors file `bytes`, read from `file`.
pub(crate) fn parse(file: &Path, bytes: &[u8]) -> Result<Vec<RawTensor>, WeightsError> {
    let len_field: [u8; LEN_FIELD_BYTES] = bytes
        .get(..LEN_FIELD_BYTES)
        .and_then(|b| b.try_into().ok())
        .ok_or_else(|| {
            corrupt(
                file,
                format!(
                    "the file is {} bytes long, too short for the 8-byte header length that \
                     starts a safetensors file",
                    bytes.len()
                ),
            )
        })?;
    let header_len = u64::from_le_bytes(len_field);
    let available = bytes.len().saturating_sub(LEN_FIELD_BYTES);
    if header_len > available as u64 {
        return Err(corrupt(
            file,
            format!(
                "the header length field says {header_len} bytes but only {available} bytes \
                 follow it (the file is truncated or is not a safetensors file)"
            ),
        ));
    }
    if header_len > MAX_HEADER_BYTES {
        return Err(corrupt(
            file,
            format!(
                "the header is {header_len} bytes, more than the {MAX_HEADER_BYTES}-byte limit"
            ),
        ));
    }
    // header_len <= available, so this fits in usize.
    let data_start = LEN_FIELD_BYTES + header_len as usize;
    let header = bytes.get(LEN_FIELD_BYTES..data_start).unwrap_or_default();
    let text = std::str::from_utf8(header)
        .map_err(|e| corrupt(file, format!("the header is not UTF-8 text: {e}")))?;
    let json: Value = serde_json::from_str(text)
        .map_err(|e| corrupt(file, format!("the header is not valid JSON: {e}")))?;
    let Value::Object(entries) = json else {
        return Err(corrupt(file, "the header is not a JSON object"));
    };
    let data_len = bytes.len() - data_start;
    let mut tensors = Vec::with_capacity(entries.len());
    for (name, entry) in entries {
        if name == "__metadata__" {
            continue;
        }
        tensors.push(entry_of(file, name, &entry, data_start, data_len)?);
    }
    check_coverage(file, &mut tensors, data_start, data_len)?;
    Ok(tensors)
}

/// Validates one `name: {dtype, shape, data_offsets}` entry.
fn entry_of(
    file: &Path,
    name: String,
    entry: &Value,
    data_start: usize,
    data_len: usize,
) -> Result<RawTensor, WeightsError> {
    let bad = |what: &str| corrupt(file, format!("tensor `{name}`: {what}"));
    let Some(obj) = entry.as_object() else {
        return Err(bad("the header entry is not an object"));
    };
    let dtype_name = obj
        .get("dtype")
        .and_then(Value::as_str)
        .ok_or_else(|| bad("`dtype` is missing or not a string"))?;
    let shape = uint_list(obj, "shape")
        .ok_or_else(|| bad("`shape` is missing or not a list of whole numbers"))?;
    let offsets = uint_list(obj, "data_offsets").unwrap_or_default();
    let [begin, end] = offsets[..] else {
        return Err(bad(
            "`data_offsets` is missing or not a pair of whole numbers",
        ));
    };
    if begin > end {
        return Err(bad(&format!("data_offsets [{begin}, {end}] run backwards")));
    }
    if end > data_len {
        return Err(bad(&format!(
            "data_offsets [{begin}, {end}] reach past the end of the data section ({data_len} \
             bytes; the file may be truncated)"
        )));
    }
    let bits = element_bits(dtype_name);
    if let Some(bits) = bits {
        let expected_bits = shape
            .iter()
            .try_fold(1usize, |acc, &d| acc.checked_mul(d))
            .and_then(|n| n.checked_mul(bits))
            .ok_or_else(|| bad(&format!("shape {shape:?} is too large")))?;
        if expected_bits % 8 != 0 {
            return Err(bad(&format!(
                "dtype {dtype_name} with shape {shape:?} is {expected_bits} bits, not a whole \
                 number of bytes"
            )));
        }
        if expected_bits / 8 != end - begin {
            return Err(bad(&format!(
                "data_offsets [{begin}, {end}] hold {} bytes but dtype {dtype_name} with shape \
                 {shape:?} needs {}",
                end - begin,
                expected_bits / 8
            )));
        }
    }
    // end <= data_len and data_start + data_len is the file length, so neither sum overflows.
    Ok(RawTensor {
        dtype: kimi_dtype(dtype_name),
        dtype_name: dtype_name.to_string(),
        shape,
        start: data_start + begin,
        end: data_start + end,
        name,
    })
}

/// Checks that the tensors cover the data section exactly once; sorts them by offset.
fn check_coverage(
    file: &Path,
    tensors: &mut [RawTensor],
    data_start: usize,
    data_len: usize,
) -> Result<(), WeightsError> {
    tensors.sort_by_key(|t| (t.start, t.end));
    let mut cursor = data_start;
    let mut previous: Option<&str> = None;
    for t in tensors.iter() {
        if t.start < cursor {
            return Err(corrupt(
                file,
                format!(
                    "tensors `{}` and `{}` overlap",
                    previous.unwrap_or("?"),
                    t.name
                ),
            ));
        }
        if t.start > cursor {
            return Err(corrupt(
                file,
                format!(
                    "data bytes {}..{} belong to no tensor (before `{}`)",
                    cursor - data_start,
                    t.start - data_start,
                    t.name
                ),
            ));
        }
        cursor = t.end;
        previous = Some(&t.name);
    }
    let covered = cursor - data_start;
    if covered != data_len {
        return Err(corrupt(
            file,
            format!("the tensors cover {covered} bytes but the data section has {data_len}"),
        ));
    }
    Ok(())
}

/// A list of whole numbers under `key`.
fn uint_list(obj: &Map<String, Value>, key: &str) -> Option<Vec<usize>> {
    obj.get(key)?
        .as_array()?
        .iter()
        .map(|v| v.as_u64().and_then(|n| usize::try_from(n).ok()))
        .collect()
}

/// Bits per element of a safetensors dtype name, `None` when the name is unknown.
fn element_bits(name: &str) -> Option<usize> {
    let dtype: safetensors::Dtype = serde_json::from_value(Value::String(name.to_string())).ok()?;
    Some(dtype.bitsize())
}

/// The kimi-infer dtype for a safetensors dtype name, if kimi-infer reads it.
fn kimi_dtype(name: &str) -> Option<DType> {
    match name {
        "F32" => Some(DType::F32),
        "F16" => Some(DType::F16),
        "BF16" => Some(DType::BF16),
        // Packed planes (MXFP4 codes and E8M0 scales); only the expert loader asks for them.
        "U8" => Some(DType::U8),
        "F8_E8M0" => Some(DType::E8M0),
        // Planes of quantized checkpoints (AWQ, GPTQ, compressed-tensors, FP8); only the
        // quantized-weight decoder asks for them.
        "I8" => Some(DType::I8),
        "I32" => Some(DType::I32),
        "I64" => Some(DType::I64),
        "F8_E4M3" => Some(DType::F8E4M3),
        _ => None,
    }
}
