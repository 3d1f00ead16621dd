//! Writer → reader round trips: every metadata type, every tensor type, alignment, v2.
#![allow(clippy::unwrap_used)]

use crate::common;

use kimi_gguf::{dequantize, quantize, Array, GgmlType, GgufError, GgufFile, GgufWriter, Value};
use rand::Rng;

#[test]
fn every_metadata_type_round_trips_in_order() {
    let values = common::every_value();
    let mut w = GgufWriter::new();
    for (k, v) in &values {
        w.add_metadata(k.clone(), v.clone()).unwrap();
    }
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("meta.gguf");
    w.write(&path).unwrap();
    let file = GgufFile::open(&path).unwrap();
    assert_eq!(file.version(), 3);
    assert_eq!(file.metadata(), &values[..]);
    assert!(file.tensors().is_empty());
    for (k, v) in &values {
        assert_eq!(file.get(k), Some(v));
    }
}

#[test]
fn every_tensor_type_round_trips() {
    let mut rng = common::rng(1);
    let mut w = GgufWriter::new();
    let mut expected = Vec::new();
    for (i, ty) in GgmlType::all().enumerate() {
        let shape = [3, 2, 2 * ty.block_size()];
        let num_values = shape.iter().product::<usize>();
        let bytes = if ty.can_quantize() {
            quantize(ty, &common::gaussian(&mut rng, num_values)).unwrap()
        } else {
            let n = ty.row_bytes(num_values).unwrap();
            (0..n).map(|_| rng.random::<u8>()).collect()
        };
        let name = format!("t{i}.{ty}");
        w.add_tensor(name.clone(), &shape, ty, bytes.clone())
            .unwrap();
        expected.push((name, ty, shape, bytes));
    }
    let file = GgufFile::from_vec(w.to_bytes().unwrap()).unwrap();
    assert_eq!(file.tensors().len(), expected.len());
    for ((name, ty, shape, bytes), info) in expected.iter().zip(file.tensors()) {
        assert_eq!(&info.name, name);
        assert_eq!(info.ggml_type, *ty);
        assert_eq!(info.shape_outer_first(), shape);
        assert_eq!(
            info.ne,
            shape.iter().rev().map(|&d| d as u64).collect::<Vec<_>>()
        );
        assert_eq!(info.offset % 32, 0);
        let data = file.tensor(name).unwrap();
        assert_eq!(data.bytes, &bytes[..], "{name}");
        if ty.can_dequantize() {
            let n = shape.iter().product();
            assert_eq!(data.to_f32().unwrap(), dequantize(*ty, bytes, n).unwrap());
        } else {
            assert!(matches!(
                data.to_f32(),
                Err(GgufError::UnsupportedType { .. })
            ));
        }
    }
}

#[test]
fn custom_alignment_is_honoured() {
    let mut w = GgufWriter::new();
    w.add_metadata("general.alignment", Value::U32(256))
        .unwrap();
    w.add_tensor("a", &[3], GgmlType::F32, vec![0u8; 12])
        .unwrap();
    w.add_tensor("b", &[5], GgmlType::F16, vec![1u8; 10])
        .unwrap();
    let file = GgufFile::from_vec(w.to_bytes().unwrap()).unwrap();
    assert_eq!(file.alignment(), 256);
    assert_eq!(file.data_offset() % 256, 0);
    assert_eq!(file.tensors()[1].offset, 256);
    assert_eq!(file.tensor("b").unwrap().bytes, &[1u8; 10]);
}

#[test]
fn version_2_is_read_and_other_versions_are_refused() {
    let mut bytes = common::small_file();
    bytes[4..8].copy_from_slice(&2u32.to_le_bytes());
    let v2 = GgufFile::from_vec(bytes.clone()).unwrap();
    assert_eq!(v2.version(), 2);
    assert_eq!(v2.get_str("general.architecture").unwrap(), "llama");
    assert_eq!(v2.tensors().len(), 3);
    for version in [0u32, 1, 4, 0x0300_0000] {
        bytes[4..8].copy_from_slice(&version.to_le_bytes());
        let err = GgufFile::from_vec(bytes.clone()).unwrap_err();
        assert!(matches!(err, GgufError::UnsupportedVersion { version: v, .. } if v == version));
    }
}

#[test]
fn typed_getters() {
    let mut w = GgufWriter::new();
    w.add_metadata("small", Value::U8(7)).unwrap();
    w.add_metadata("big", Value::U64(1 << 40)).unwrap();
    w.add_metadata("neg", Value::I32(-1)).unwrap();
    w.add_metadata("eps", Value::F32(1e-5)).unwrap();
    w.add_metadata("eps64", Value::F64(0.25)).unwrap();
    w.add_metadata("flag", Value::Bool(true)).unwrap();
    w.add_metadata("name", Value::String("x".into())).unwrap();
    w.add_metadata("list", Value::Array(Array::F32(vec![1.0])))
        .unwrap();
    let file = GgufFile::from_vec(w.to_bytes().unwrap()).unwrap();
    assert_eq!(file.get_u32("small").unwrap(), 7);
    assert_eq!(file.get_u64("big").unwrap(), 1 << 40);
    assert_eq!(file.get_i64("neg").unwrap(), -1);
    assert_eq!(file.get_f32("eps").unwrap(), 1e-5);
    assert_eq!(file.get_f32("eps64").unwrap(), 0.25);
    assert!(file.get_bool("flag").unwrap());
    assert_eq!(file.get_str("name").unwrap(), "x");
    assert_eq!(file.get_array("list").unwrap(), &Array::F32(vec![1.0]));

    let err = file.get_u32("big").unwrap_err();
    assert_eq!(
        err.to_string(),
        "<memory>: metadata `big` is u64 1099511627776, expected an integer that fits in u32"
    );
    assert!(matches!(
        file.get_u32("neg"),
        Err(GgufError::KeyType { .. })
    ));
    assert!(
        matches!(file.get_str("list"), Err(GgufError::KeyType { found, .. }) if found == "array of f32")
    );
    assert!(matches!(
        file.get_u32("missing"),
        Err(GgufError::KeyNotFound { .. })
    ));
    assert!(matches!(
        file.tensor("missing"),
        Err(GgufError::TensorNotFound { .. })
    ));
}

#[test]
fn writer_rejects_invalid_input() {
    let mut w = GgufWriter::new();
    w.add_metadata("k", Value::U8(1)).unwrap();
    assert!(matches!(
        w.add_metadata("k", Value::U8(2)),
        Err(GgufError::InvalidMetadata { .. })
    ));
    for bad in [Value::U32(3), Value::U32(0), Value::U64(32)] {
        let err = GgufWriter::new()
            .add_metadata("general.alignment", bad)
            .map(|_| ())
            .unwrap_err();
        assert!(matches!(err, GgufError::InvalidMetadata { .. }));
    }
    w.add_tensor("t", &[2, 32], GgmlType::Q8_0, vec![0u8; 68])
        .unwrap();
    let cases: [(&str, &[usize], GgmlType, usize); 5] = [
        ("t", &[2, 32], GgmlType::Q8_0, 68),          // duplicate
        ("u", &[2, 32], GgmlType::Q8_0, 67),          // wrong length
        ("v", &[2, 33], GgmlType::Q8_0, 68),          // not whole blocks
        ("w", &[1, 1, 1, 1, 32], GgmlType::Q8_0, 34), // five dimensions
        (&"x".repeat(64), &[32], GgmlType::Q8_0, 34), // name too long for ggml
    ];
    for (name, shape, ty, len) in cases {
        let err = w
            .add_tensor(name, shape, ty, vec![0u8; len])
            .map(|_| ())
            .unwrap_err();
        assert!(
            matches!(err, GgufError::InvalidTensor { .. }),
            "{name} {shape:?}: {err}"
        );
    }
    let overflow = [usize::MAX, 2, 32];
    assert!(w
        .add_tensor("y", &overflow, GgmlType::Q8_0, vec![0u8; 34])
        .is_err());
}

#[test]
fn zero_dimensional_and_empty_tensors() {
    let mut w = GgufWriter::new();
    w.add_tensor("scalar", &[], GgmlType::F32, 2.5f32.to_le_bytes().to_vec())
        .unwrap();
    w.add_tensor("empty", &[0, 32], GgmlType::Q4_0, Vec::new())
        .unwrap();
    let file = GgufFile::from_vec(w.to_bytes().unwrap()).unwrap();
    let scalar = file.tensor("scalar").unwrap();
    assert!(scalar.info.ne.is_empty());
    assert_eq!(scalar.to_f32().unwrap(), [2.5]);
    let empty = file.tensor("empty").unwrap();
    assert_eq!(empty.info.shape_outer_first(), [0, 32]);
    assert!(empty.to_f32().unwrap().is_empty());
}
