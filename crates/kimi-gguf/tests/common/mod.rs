//! Helpers shared by the integration tests.
#![allow(dead_code, clippy::unwrap_used)]

use kimi_gguf::{Array, GgmlType, GgufWriter, Value};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// A deterministic RNG.
pub fn rng(seed: u64) -> ChaCha8Rng {
    ChaCha8Rng::seed_from_u64(seed)
}

/// `n` standard-normal values (Box-Muller, so only `rand` is needed).
pub fn gaussian(rng: &mut impl Rng, n: usize) -> Vec<f32> {
    (0..n)
        .map(|_| {
            let u1: f64 = rng.random_range(f64::EPSILON..1.0);
            let u2: f64 = rng.random_range(0.0..1.0);
            ((-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()) as f32
        })
        .collect()
}

/// One metadata value of every type, nested arrays and empty arrays included.
pub fn every_value() -> Vec<(String, Value)> {
    let values = vec![
        Value::U8(255),
        Value::I8(-128),
        Value::U16(65535),
        Value::I16(-32768),
        Value::U32(u32::MAX),
        Value::I32(i32::MIN),
        Value::U64(u64::MAX),
        Value::I64(i64::MIN),
        Value::F32(-1.5e-7),
        Value::F64(std::f64::consts::PI),
        Value::Bool(true),
        Value::Bool(false),
        Value::String("llama".into()),
        Value::String(String::new()),
        Value::String("ünïcode ✓ \u{0}".into()),
        Value::Array(Array::U8(vec![0, 1, 255])),
        Value::Array(Array::I8(vec![-1, 1])),
        Value::Array(Array::U16(vec![7])),
        Value::Array(Array::I16(vec![-7, 7])),
        Value::Array(Array::U32(vec![1, 2, 3])),
        Value::Array(Array::I32(vec![-3, 0])),
        Value::Array(Array::U64(vec![u64::MAX])),
        Value::Array(Array::I64(vec![i64::MIN, i64::MAX])),
        Value::Array(Array::F32(vec![0.0, -0.0, 1e30])),
        Value::Array(Array::F64(vec![1e-300])),
        Value::Array(Array::Bool(vec![true, false, true])),
        Value::Array(Array::String(vec!["<s>".into(), "".into(), "Ġthe".into()])),
        Value::Array(Array::String(vec![])),
        Value::Array(Array::U32(vec![])),
        Value::Array(Array::Array(vec![
            Array::I32(vec![1, 2]),
            Array::String(vec!["x".into()]),
            Array::Array(vec![Array::F32(vec![0.5]), Array::Bool(vec![])]),
        ])),
    ];
    values
        .into_iter()
        .enumerate()
        .map(|(i, v)| (format!("test.value_{i}"), v))
        .collect()
}

/// A small valid file: some metadata and three tensors of different types.
pub fn small_file() -> Vec<u8> {
    let mut w = GgufWriter::new();
    w.add_metadata("general.architecture", Value::String("llama".into()))
        .unwrap();
    w.add_metadata("llama.block_count", Value::U32(2)).unwrap();
    w.add_metadata(
        "tokenizer.ggml.tokens",
        Value::Array(Array::String(vec!["a".into(), "bc".into()])),
    )
    .unwrap();
    w.add_metadata(
        "nested",
        Value::Array(Array::Array(vec![Array::U8(vec![1, 2])])),
    )
    .unwrap();
    let x: Vec<f32> = (0..64).map(|i| (i as f32 - 30.0) / 7.0).collect();
    w.add_tensor(
        "norm",
        &[8],
        GgmlType::F32,
        kimi_gguf::quantize(GgmlType::F32, &x[..8]).unwrap(),
    )
    .unwrap();
    w.add_tensor(
        "q8",
        &[2, 32],
        GgmlType::Q8_0,
        kimi_gguf::quantize(GgmlType::Q8_0, &x).unwrap(),
    )
    .unwrap();
    w.add_tensor(
        "q41",
        &[1, 64],
        GgmlType::Q4_1,
        kimi_gguf::quantize(GgmlType::Q4_1, &x).unwrap(),
    )
    .unwrap();
    w.to_bytes().unwrap()
}

/// Relative RMSE of `y` against `x`: `rms(x - y) / rms(x)`.
pub fn relative_rmse(x: &[f32], y: &[f32]) -> f64 {
    let err: f64 = x
        .iter()
        .zip(y)
        .map(|(&a, &b)| f64::from(a - b).powi(2))
        .sum();
    let scale: f64 = x.iter().map(|&a| f64::from(a).powi(2)).sum();
    (err / scale).sqrt()
}
