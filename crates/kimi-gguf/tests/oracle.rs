//! Checks against `tests/data/oracle.gguf`, written by gguf-py (llama.cpp's Python GGUF
//! library, an independent implementation; see `tests/data/make_oracle.py`): its metadata
//! as read by our reader and its dequantized blocks; and quantizations made by ggml's own
//! `quantize_row_*_ref`.
#![allow(clippy::unwrap_used)]

use std::path::Path;

use kimi_gguf::{dequantize, quantize, Array, GgmlType, GgufFile, Value};

fn oracle() -> GgufFile {
    GgufFile::open(Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/oracle.gguf")).unwrap()
}

#[test]
fn metadata_written_by_gguf_py() {
    let file = oracle();
    assert_eq!(file.version(), 3);
    let expected = [
        ("general.architecture", Value::String("oracle".into())),
        ("t.u8", Value::U8(200)),
        ("t.i8", Value::I8(-100)),
        ("t.u16", Value::U16(60000)),
        ("t.i16", Value::I16(-30000)),
        ("t.u32", Value::U32(4_000_000_000)),
        ("t.i32", Value::I32(-2_000_000_000)),
        ("t.u64", Value::U64(18_000_000_000_000_000_000)),
        ("t.i64", Value::I64(-9_000_000_000_000_000_000)),
        ("t.f32", Value::F32(0.15625)),
        ("t.f64", Value::F64(-2.5e-300)),
        ("t.bool", Value::Bool(true)),
        ("t.string", Value::String("héllo ✓".into())),
        ("t.array_u16", Value::Array(Array::U16(vec![1, 2, 65535]))),
        ("t.array_f32", Value::Array(Array::F32(vec![0.5, -1.25]))),
        (
            "t.array_string",
            Value::Array(Array::String(vec!["a".into(), "".into(), "ü".into()])),
        ),
        ("t.array_bool", Value::Array(Array::Bool(vec![true, false]))),
        (
            "t.nested",
            Value::Array(Array::Array(vec![
                Array::I32(vec![1, 2]),
                Array::String(vec!["x".into()]),
            ])),
        ),
    ];
    let found: Vec<(&str, &Value)> = file
        .metadata()
        .iter()
        .map(|(k, v)| (k.as_str(), v))
        .collect();
    let expected: Vec<(&str, &Value)> = expected.iter().map(|(k, v)| (*k, v)).collect();
    assert_eq!(found, expected);
}

const TYPES: [GgmlType; 8] = [
    GgmlType::Q4_0,
    GgmlType::Q4_1,
    GgmlType::Q5_0,
    GgmlType::Q5_1,
    GgmlType::Q8_0,
    GgmlType::Q4_K,
    GgmlType::Q5_K,
    GgmlType::Q6_K,
];

#[test]
fn dequantization_matches_gguf_py() {
    let file = oracle();
    for ty in TYPES {
        let raw = file.tensor(&format!("{ty}.raw")).unwrap();
        assert_eq!(raw.info.ggml_type, ty);
        let expected = file
            .tensor(&format!("{ty}.dequant"))
            .unwrap()
            .to_f32()
            .unwrap();
        let got = raw.to_f32().unwrap();
        assert_eq!(got.len(), expected.len());
        let max_diff = got
            .iter()
            .zip(&expected)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0, f32::max);
        let scale = expected.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        assert!(
            max_diff <= 1e-6 * scale,
            "{ty}: max diff {max_diff} (scale {scale})"
        );
    }
}

/// Our quantizers are bit-identical to ggml's `quantize_row_*_ref`.
#[test]
fn quantization_matches_ggml_bit_for_bit() {
    let file = oracle();
    let input = file.tensor("quant.input").unwrap();
    assert_eq!(input.info.shape_outer_first(), [8, 256]);
    let input = input.to_f32().unwrap();
    for ty in TYPES {
        let expected = file.tensor(&format!("{ty}.quant")).unwrap();
        assert_eq!(expected.info.ggml_type, ty);
        let got = quantize(ty, &input).unwrap();
        assert_eq!(got.len(), expected.bytes.len(), "{ty}");
        let first_diff = got.iter().zip(expected.bytes).position(|(a, b)| a != b);
        assert_eq!(first_diff, None, "{ty}: first differing byte");
        assert_eq!(
            dequantize(ty, &got, input.len()).unwrap().len(),
            input.len()
        );
    }
}
