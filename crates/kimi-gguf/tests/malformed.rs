//! Malformed files: every one is an error naming what is wrong, never a panic, and no
//! count in the file can make the reader allocate more than the file's size.
#![allow(clippy::unwrap_used)]

use crate::common;

use kimi_gguf::{GgmlType, GgufError, GgufFile};
use rand::Rng;

/// A tensor info as stored: `(name, n_dims, ne, type id, offset)`.
type RawTensor = (Vec<u8>, u32, Vec<u64>, u32, u64);

/// Builds GGUF bytes field by field, so a test can put any value in any field.
#[derive(Clone)]
struct Raw {
    magic: Vec<u8>,
    version: u32,
    num_tensors: Option<u64>,
    num_kv: Option<u64>,
    /// `(key bytes, value type id, value bytes)`.
    kvs: Vec<(Vec<u8>, u32, Vec<u8>)>,
    tensors: Vec<RawTensor>,
    alignment: usize,
    data: Vec<u8>,
}

fn string(s: &[u8]) -> Vec<u8> {
    let mut v = (s.len() as u64).to_le_bytes().to_vec();
    v.extend_from_slice(s);
    v
}

impl Raw {
    /// One u32 metadata entry and one F32 `[2, 4]` tensor.
    fn valid() -> Raw {
        Raw {
            magic: b"GGUF".to_vec(),
            version: 3,
            num_tensors: None,
            num_kv: None,
            kvs: vec![(b"general.architecture".to_vec(), 8, string(b"llama"))],
            tensors: vec![(b"t".to_vec(), 2, vec![4, 2], 0, 0)],
            alignment: 32,
            data: (0..8).flat_map(|i| (i as f32).to_le_bytes()).collect(),
        }
    }

    fn bytes(&self) -> Vec<u8> {
        let mut b = self.magic.clone();
        b.extend(self.version.to_le_bytes());
        b.extend(
            self.num_tensors
                .unwrap_or(self.tensors.len() as u64)
                .to_le_bytes(),
        );
        b.extend(self.num_kv.unwrap_or(self.kvs.len() as u64).to_le_bytes());
        for (key, ty, value) in &self.kvs {
            b.extend(string(key));
            b.extend(ty.to_le_bytes());
            b.extend(value);
        }
        for (name, n_dims, ne, ty, offset) in &self.tensors {
            b.extend(string(name));
            b.extend(n_dims.to_le_bytes());
            ne.iter().for_each(|d| b.extend(d.to_le_bytes()));
            b.extend(ty.to_le_bytes());
            b.extend(offset.to_le_bytes());
        }
        b.resize(b.len().next_multiple_of(self.alignment), 0);
        b.extend(&self.data);
        b
    }

    fn with(mut self, f: impl FnOnce(&mut Raw)) -> Raw {
        f(&mut self);
        self
    }

    fn with_kv(self, key: &str, ty: u32, value: Vec<u8>) -> Raw {
        self.with(|r| r.kvs.push((key.as_bytes().to_vec(), ty, value)))
    }
}

fn array_header(elem_ty: u32, count: u64) -> Vec<u8> {
    let mut v = elem_ty.to_le_bytes().to_vec();
    v.extend(count.to_le_bytes());
    v
}

/// `depth` arrays nested in one another, the innermost empty.
fn nested_arrays(depth: usize) -> Vec<u8> {
    let mut v = Vec::new();
    for _ in 1..depth {
        v.extend(array_header(9, 1));
    }
    v.extend(array_header(4, 0));
    v
}

type Check = fn(&GgufError) -> bool;

/// A header claiming one metadata entry whose key is `u64::MAX` bytes long.
fn key_length_beyond_file() -> Vec<u8> {
    let mut b = b"GGUF".to_vec();
    b.extend(3u32.to_le_bytes());
    b.extend(0u64.to_le_bytes());
    b.extend(1u64.to_le_bytes());
    b.extend(u64::MAX.to_le_bytes());
    b.extend([0; 16]);
    b
}

#[test]
fn valid_raw_file_parses() {
    let file = GgufFile::from_vec(Raw::valid().bytes()).unwrap();
    assert_eq!(
        file.tensor("t").unwrap().to_f32().unwrap(),
        [0., 1., 2., 3., 4., 5., 6., 7.]
    );
    assert_eq!(file.tensors()[0].shape_outer_first(), [2, 4]);
}

#[test]
fn table_of_malformed_files() {
    use GgufError as E;
    let v = Raw::valid;
    let cases: Vec<(&str, Vec<u8>, Check)> = vec![
        ("empty file", vec![], |e| matches!(e, E::BadMagic { .. })),
        (
            "bad magic",
            v().with(|r| r.magic = b"GGUG".to_vec()).bytes(),
            |e| matches!(e, E::BadMagic { .. }),
        ),
        (
            "lower-case magic",
            v().with(|r| r.magic = b"gguf".to_vec()).bytes(),
            |e| matches!(e, E::BadMagic { .. }),
        ),
        ("version 1", v().with(|r| r.version = 1).bytes(), |e| {
            matches!(e, E::UnsupportedVersion { version: 1, .. })
        }),
        (
            "big-endian v3",
            v().with(|r| r.version = 3u32.swap_bytes()).bytes(),
            |e| matches!(e, E::UnsupportedVersion { .. }),
        ),
        ("only magic and version", b"GGUF\x03\0\0\0".to_vec(), |e| {
            matches!(e, E::Truncated { .. })
        }),
        (
            "tensor count u64::MAX",
            v().with(|r| r.num_tensors = Some(u64::MAX)).bytes(),
            |e| matches!(e, E::CountTooLarge { .. }),
        ),
        (
            "tensor count 2^40",
            v().with(|r| r.num_tensors = Some(1 << 40)).bytes(),
            |e| matches!(e, E::CountTooLarge { .. }),
        ),
        (
            "kv count u64::MAX",
            v().with(|r| r.num_kv = Some(u64::MAX)).bytes(),
            |e| matches!(e, E::CountTooLarge { .. }),
        ),
        (
            "kv count one too many",
            v().with(|r| r.num_kv = Some(2)).bytes(),
            |e| {
                // The tensor info is then read as a key; it fails somewhere, cleanly.
                !matches!(e, E::Io { .. })
            },
        ),
        ("key length beyond file", key_length_beyond_file(), |e| {
            matches!(e, E::CountTooLarge { .. })
        }),
        (
            "string value length beyond file",
            v().with_kv("s", 8, (1u64 << 50).to_le_bytes().to_vec())
                .bytes(),
            |e| matches!(e, E::CountTooLarge { .. }),
        ),
        (
            "unknown value type",
            v().with_kv("x", 13, vec![0; 8]).bytes(),
            |e| matches!(e, E::BadValue { key, .. } if key == "x"),
        ),
        ("bool byte 2", v().with_kv("b", 7, vec![2]).bytes(), |e| {
            matches!(e, E::BadValue { .. })
        }),
        (
            "invalid UTF-8 key",
            v().with(|r| r.kvs.push((vec![0xff, 0xfe], 4, vec![0; 4])))
                .bytes(),
            |e| matches!(e, E::InvalidUtf8 { .. }),
        ),
        (
            "invalid UTF-8 string value",
            v().with_kv("s", 8, string(&[b'a', 0xc3])).bytes(),
            |e| matches!(e, E::InvalidUtf8 { .. }),
        ),
        (
            "duplicate key",
            v().with_kv("general.architecture", 4, vec![0; 4]).bytes(),
            |e| matches!(e, E::DuplicateKey { .. }),
        ),
        (
            "array count u64::MAX",
            v().with_kv("a", 9, array_header(4, u64::MAX)).bytes(),
            |e| matches!(e, E::CountTooLarge { .. }),
        ),
        (
            "string array count beyond file",
            v().with_kv("a", 9, array_header(8, 1 << 30)).bytes(),
            |e| matches!(e, E::CountTooLarge { .. }),
        ),
        (
            "nested array count beyond file",
            v().with_kv("a", 9, array_header(9, 1 << 30)).bytes(),
            |e| matches!(e, E::CountTooLarge { .. }),
        ),
        (
            "array of unknown type",
            v().with_kv("a", 9, array_header(99, 1)).bytes(),
            |e| matches!(e, E::BadValue { .. }),
        ),
        (
            "arrays nested 9 deep",
            v().with_kv("a", 9, nested_arrays(9)).bytes(),
            |e| matches!(e, E::BadValue { reason, .. } if reason.contains("nested")),
        ),
        (
            "alignment 3",
            v().with_kv("general.alignment", 4, 3u32.to_le_bytes().to_vec())
                .bytes(),
            |e| matches!(e, E::BadAlignment { .. }),
        ),
        (
            "alignment 0",
            v().with_kv("general.alignment", 4, 0u32.to_le_bytes().to_vec())
                .bytes(),
            |e| matches!(e, E::BadAlignment { .. }),
        ),
        (
            "alignment as u64",
            v().with_kv("general.alignment", 10, 32u64.to_le_bytes().to_vec())
                .bytes(),
            |e| matches!(e, E::BadAlignment { .. }),
        ),
        (
            "five dimensions",
            v().with(|r| r.tensors[0].1 = 5)
                .with(|r| r.tensors[0].2 = vec![1; 5])
                .bytes(),
            |e| matches!(e, E::BadShape { .. }),
        ),
        (
            "n_dims u32::MAX",
            v().with(|r| r.tensors[0].1 = u32::MAX).bytes(),
            |e| matches!(e, E::BadShape { .. }),
        ),
        (
            "element count overflows",
            v().with(|r| r.tensors[0].2 = vec![u64::MAX, 2]).bytes(),
            |e| matches!(e, E::BadShape { .. }),
        ),
        (
            "byte count overflows",
            v().with(|r| r.tensors[0].2 = vec![1 << 62, 1]).bytes(),
            |e| matches!(e, E::BadShape { .. }),
        ),
        (
            "ne[0] not whole blocks",
            v().with(|r| {
                r.tensors[0].2 = vec![33, 1];
                r.tensors[0].3 = GgmlType::Q8_0.id();
            })
            .bytes(),
            |e| matches!(e, E::BadShape { .. }),
        ),
        (
            "removed tensor type 4",
            v().with(|r| r.tensors[0].3 = 4).bytes(),
            |e| matches!(e, E::UnknownTensorType { type_id: 4, .. }),
        ),
        (
            "tensor type 1000",
            v().with(|r| r.tensors[0].3 = 1000).bytes(),
            |e| matches!(e, E::UnknownTensorType { .. }),
        ),
        (
            "misaligned offset",
            v().with(|r| r.tensors[0].4 = 4).bytes(),
            |e| {
                matches!(
                    e,
                    E::MisalignedOffset {
                        offset: 4,
                        alignment: 32,
                        ..
                    }
                )
            },
        ),
        (
            "offset past the end",
            v().with(|r| r.tensors[0].4 = 64).bytes(),
            |e| matches!(e, E::TensorOutOfRange { .. }),
        ),
        (
            "offset near u64::MAX",
            v().with(|r| r.tensors[0].4 = u64::MAX - 31).bytes(),
            |e| matches!(e, E::TensorOutOfRange { .. }),
        ),
        (
            "data shorter than the tensor",
            v().with(|r| r.data.truncate(31)).bytes(),
            |e| matches!(e, E::TensorOutOfRange { .. }),
        ),
        (
            "shape larger than the data",
            v().with(|r| r.tensors[0].2 = vec![4, 1 << 40]).bytes(),
            |e| matches!(e, E::TensorOutOfRange { .. }),
        ),
        (
            "duplicate tensor",
            v().with(|r| r.tensors.push(r.tensors[0].clone())).bytes(),
            |e| matches!(e, E::DuplicateTensor { .. }),
        ),
        (
            "invalid UTF-8 tensor name",
            v().with(|r| r.tensors[0].0 = vec![0x80]).bytes(),
            |e| matches!(e, E::InvalidUtf8 { .. }),
        ),
    ];
    for (name, bytes, check) in cases {
        match GgufFile::from_vec(bytes) {
            Ok(_) => panic!("{name}: parsed"),
            Err(e) => {
                assert!(check(&e), "{name}: unexpected error {e:?}");
                assert!(e.to_string().starts_with("<memory>: "), "{name}: {e}");
                println!("{name:<34} {e}");
            }
        }
    }
}

/// The smallest length at which `bytes` still holds every tensor's data.
fn min_valid_len(bytes: &[u8]) -> usize {
    let file = GgufFile::from_vec(bytes.to_vec()).unwrap();
    let end = file
        .tensors()
        .iter()
        .map(|t| t.offset + t.size_bytes)
        .max()
        .unwrap_or(0);
    (file.data_offset() + end) as usize
}

#[test]
fn every_truncation_is_an_error() {
    for bytes in [common::small_file(), Raw::valid().bytes()] {
        let min_len = min_valid_len(&bytes);
        let lengths = (0..bytes.len())
            .step_by(7)
            .chain([min_len - 1, min_len, bytes.len()]);
        for len in lengths {
            let result = GgufFile::from_vec(bytes[..len].to_vec());
            assert_eq!(
                result.is_ok(),
                len >= min_len,
                "length {len} of {}: {result:?}",
                bytes.len()
            );
        }
    }
}

#[test]
fn errors_from_files_name_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("broken.gguf");
    std::fs::write(&path, b"GGML\x03\0\0\0").unwrap();
    let err = GgufFile::open(&path).unwrap_err().to_string();
    assert!(
        err.starts_with(&format!("{}: not a GGUF file", path.display())),
        "{err}"
    );
    std::fs::write(&path, b"").unwrap();
    assert!(matches!(
        GgufFile::open(&path),
        Err(GgufError::BadMagic { .. })
    ));
    let missing = GgufFile::open(dir.path().join("missing.gguf")).unwrap_err();
    assert!(matches!(missing, GgufError::Io { .. }));
}

/// Interesting values to write over a field.
const SPECIAL: [u64; 8] = [0, 1, 2, 31, 255, 1 << 31, u64::MAX, u64::MAX / 2];

/// Applies one random mutation: flip a byte, overwrite 4 or 8 bytes with a special
/// value, truncate, or insert/delete a few bytes.
fn mutate(rng: &mut impl Rng, bytes: &mut Vec<u8>) {
    if bytes.is_empty() {
        bytes.push(rng.random());
        return;
    }
    let at = rng.random_range(0..bytes.len());
    match rng.random_range(0..6) {
        0 => bytes[at] ^= 1 << rng.random_range(0..8),
        1 => bytes[at] = rng.random(),
        2 | 3 => {
            let width = if rng.random() { 4 } else { 8 };
            let value = SPECIAL[rng.random_range(0..SPECIAL.len())].to_le_bytes();
            let end = (at + width).min(bytes.len());
            bytes[at..end].copy_from_slice(&value[..end - at]);
        }
        4 => bytes.truncate(at),
        _ => {
            if rng.random() {
                bytes.drain(at..(at + rng.random_range(1..5)).min(bytes.len()));
            } else {
                bytes.splice(
                    at..at,
                    (0..rng.random_range(1..5)).map(|_| rng.random::<u8>()),
                );
            }
        }
    }
}

/// Touches everything a caller could read from a parsed file.
fn exercise(file: &GgufFile) {
    for (key, value) in file.metadata() {
        assert_eq!(file.get(key), Some(value));
        let _ = (
            file.get_u32(key),
            file.get_str(key),
            file.get_f32(key),
            file.get_array(key),
        );
    }
    for info in file.tensors() {
        let data = file.tensor(&info.name).unwrap();
        assert_eq!(data.bytes.len() as u64, info.size_bytes);
        let _ = data.to_f32();
        let _ = info.shape_outer_first();
    }
}

#[test]
fn random_mutations_never_panic() {
    let mut rng = common::rng(2026);
    let seeds = [common::small_file(), Raw::valid().bytes()];
    let (mut parsed, mut rejected) = (0, 0);
    for i in 0..2000 {
        let mut bytes = seeds[i % 2].clone();
        for _ in 0..rng.random_range(1..4) {
            mutate(&mut rng, &mut bytes);
        }
        match GgufFile::from_vec(bytes) {
            Ok(file) => {
                exercise(&file);
                parsed += 1;
            }
            Err(e) => {
                assert!(!e.to_string().is_empty());
                rejected += 1;
            }
        }
    }
    println!("2000 mutations: {parsed} parsed, {rejected} rejected");
    assert!(rejected > 1000, "mutations should mostly break the file");
}
