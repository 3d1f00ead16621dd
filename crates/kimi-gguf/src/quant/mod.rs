//! Dequantization and reference quantization of ggml block formats.
//!
//! Each format works on whole blocks: a block of `block_size()` values is stored in
//! `type_size()` bytes. The layouts are those of the `block_*` structs in ggml's
//! `ggml-common.h`. The quantizers re-implement the designs of ggml's
//! `quantize_row_*_ref` (no importance matrix) and produce the same bytes, down to the
//! sign of a zero; `tests/oracle.rs` checks that against blocks quantized by ggml itself.

mod kquants;
mod legacy;
pub mod mxfp4;

use half::{bf16, f16};

use crate::error::{GgufError, Result};
use crate::types::GgmlType;

/// Whether this module can dequantize and quantize `ty`.
pub(crate) fn supported(ty: GgmlType) -> bool {
    use GgmlType::*;
    matches!(
        ty,
        F32 | F16 | BF16 | Q4_0 | Q4_1 | Q5_0 | Q5_1 | Q8_0 | Q4_K | Q5_K | Q6_K | MXFP4
    )
}

/// Checks that `num_values` is whole blocks of `ty` stored in exactly `num_bytes`.
fn check_lengths(ty: GgmlType, num_values: usize, num_bytes: usize) -> Result<()> {
    match ty.row_bytes(num_values) {
        Some(expected) if expected == num_bytes => Ok(()),
        Some(expected) => Err(GgufError::BadLength {
            ty,
            reason: format!("{num_values} values take {expected} bytes, got {num_bytes}"),
        }),
        None => Err(GgufError::BadLength {
            ty,
            reason: format!(
                "{num_values} values are not a whole number of {}-value blocks",
                ty.block_size()
            ),
        }),
    }
}

/// Dequantizes `n` values of type `ty` from `bytes` (exactly `ty.row_bytes(n)` long).
pub fn dequantize(ty: GgmlType, bytes: &[u8], n: usize) -> Result<Vec<f32>> {
    check_lengths(ty, n, bytes.len())?;
    if !supported(ty) {
        return Err(GgufError::UnsupportedType {
            ty,
            op: "dequantize",
        });
    }
    let mut out = vec![0.0f32; n];
    dequantize_row(ty, bytes, &mut out)?;
    Ok(out)
}

/// Dequantizes `bytes` of type `ty` into `out`; `bytes` must be exactly
/// `ty.row_bytes(out.len())` long. Any number of whole blocks works (a row, a tensor).
pub fn dequantize_row(ty: GgmlType, bytes: &[u8], out: &mut [f32]) -> Result<()> {
    check_lengths(ty, out.len(), bytes.len())?;
    use GgmlType::*;
    match ty {
        F32 => per_block(bytes, out, |b: &[u8; 4], o: &mut [f32; 1]| {
            o[0] = f32::from_le_bytes(*b)
        }),
        F16 => per_block(bytes, out, |b: &[u8; 2], o: &mut [f32; 1]| {
            o[0] = f16::from_le_bytes(*b).to_f32();
        }),
        BF16 => per_block(bytes, out, |b: &[u8; 2], o: &mut [f32; 1]| {
            o[0] = bf16::from_le_bytes(*b).to_f32();
        }),
        Q4_0 => per_block(bytes, out, legacy::dequantize_q4_0),
        Q4_1 => per_block(bytes, out, legacy::dequantize_q4_1),
        Q5_0 => per_block(bytes, out, legacy::dequantize_q5_0),
        Q5_1 => per_block(bytes, out, legacy::dequantize_q5_1),
        Q8_0 => per_block(bytes, out, legacy::dequantize_q8_0),
        Q4_K => per_block(bytes, out, kquants::dequantize_q4_k),
        Q5_K => per_block(bytes, out, kquants::dequantize_q5_k),
        Q6_K => per_block(bytes, out, kquants::dequantize_q6_k),
        MXFP4 => per_block(bytes, out, mxfp4::dequantize_mxfp4),
        _ => {
            return Err(GgufError::UnsupportedType {
                ty,
                op: "dequantize",
            })
        }
    }
    Ok(())
}

/// Quantizes `values` to type `ty`; `values.len()` must be a whole number of blocks.
/// Returns `ty.row_bytes(values.len())` bytes.
pub fn quantize(ty: GgmlType, values: &[f32]) -> Result<Vec<u8>> {
    let num_bytes = ty
        .row_bytes(values.len())
        .ok_or_else(|| GgufError::BadLength {
            ty,
            reason: format!(
                "{} values are not a whole number of {}-value blocks",
                values.len(),
                ty.block_size()
            ),
        })?;
    if !supported(ty) {
        return Err(GgufError::UnsupportedType { ty, op: "quantize" });
    }
    let mut out = vec![0u8; num_bytes];
    quantize_into(ty, values, &mut out)?;
    Ok(out)
}

/// Quantizes `values` into `out`, which must be exactly `ty.row_bytes(values.len())` long.
pub fn quantize_into(ty: GgmlType, values: &[f32], out: &mut [u8]) -> Result<()> {
    check_lengths(ty, values.len(), out.len())?;
    use GgmlType::*;
    match ty {
        F32 => per_value_block(values, out, |x: &[f32; 1], o: &mut [u8; 4]| {
            *o = x[0].to_le_bytes();
        }),
        F16 => per_value_block(values, out, |x: &[f32; 1], o: &mut [u8; 2]| {
            *o = f16::from_f32(x[0]).to_le_bytes();
        }),
        BF16 => per_value_block(values, out, |x: &[f32; 1], o: &mut [u8; 2]| {
            *o = bf16::from_f32(x[0]).to_le_bytes();
        }),
        Q4_0 => per_value_block(values, out, legacy::quantize_q4_0),
        Q4_1 => per_value_block(values, out, legacy::quantize_q4_1),
        Q5_0 => per_value_block(values, out, legacy::quantize_q5_0),
        Q5_1 => per_value_block(values, out, legacy::quantize_q5_1),
        Q8_0 => per_value_block(values, out, legacy::quantize_q8_0),
        Q4_K => per_value_block(values, out, kquants::quantize_q4_k),
        Q5_K => per_value_block(values, out, kquants::quantize_q5_k),
        Q6_K => per_value_block(values, out, kquants::quantize_q6_k),
        MXFP4 => per_value_block(values, out, mxfp4::quantize_mxfp4),
        _ => return Err(GgufError::UnsupportedType { ty, op: "quantize" }),
    }
    Ok(())
}

/// Applies `f` to each `(block bytes, output values)` pair. The lengths were checked, so
/// the chunks are exactly `TS` and `BS` long and every conversion succeeds.
fn per_block<const TS: usize, const BS: usize>(
    bytes: &[u8],
    out: &mut [f32],
    f: impl Fn(&[u8; TS], &mut [f32; BS]),
) {
    let blocks = bytes
        .chunks_exact(TS)
        .filter_map(|c| <&[u8; TS]>::try_from(c).ok());
    let outs = out
        .chunks_exact_mut(BS)
        .filter_map(|c| <&mut [f32; BS]>::try_from(c).ok());
    blocks.zip(outs).for_each(|(b, o)| f(b, o));
}

/// Applies `f` to each `(input values, block bytes)` pair; see [`per_block`].
fn per_value_block<const BS: usize, const TS: usize>(
    values: &[f32],
    out: &mut [u8],
    f: impl Fn(&[f32; BS], &mut [u8; TS]),
) {
    let xs = values
        .chunks_exact(BS)
        .filter_map(|c| <&[f32; BS]>::try_from(c).ok());
    let outs = out
        .chunks_exact_mut(TS)
        .filter_map(|c| <&mut [u8; TS]>::try_from(c).ok());
    xs.zip(outs).for_each(|(x, o)| f(x, o));
}

/// The `f16` at `b[i..i + 2]` as `f32`.
#[inline]
fn f16_at(b: &[u8], i: usize) -> f32 {
    f16::from_le_bytes([b[i], b[i + 1]]).to_f32()
}

/// Stores `v` as `f16` at `b[i..i + 2]`; returns the stored value as `f32`.
#[inline]
fn put_f16(b: &mut [u8], i: usize, v: f32) -> f32 {
    let h = f16::from_f32(v);
    b[i..i + 2].copy_from_slice(&h.to_le_bytes());
    h.to_f32()
}

/// Round to nearest, ties to even (ggml's `nearest_int`); saturates out of range and
/// maps NaN to 0 instead of being undefined.
#[inline]
fn nearest_int(v: f32) -> i32 {
    v.round_ties_even() as i32
}
