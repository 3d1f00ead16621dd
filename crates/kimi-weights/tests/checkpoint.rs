//! Checkpoint loading against small safetensors files written into a temporary directory.
#![allow(clippy::unwrap_used)]

use std::collections::HashSet;
use std::fs;
use std::path::Path;

use half::{bf16, f16};
use kimi_core::DType;
use kimi_weights::{Checkpoint, TensorView, WeightsError};
use safetensors::{serialize, Dtype};
use tempfile::TempDir;

/// A two-layer Kimi Linear config (layer 0 KDA + dense MLP, layer 1 MLA + MoE).
const CONFIG: &str = r#"{
  "architectures": ["KimiLinearForCausalLM"], "model_type": "kimi_linear",
  "vocab_size": 32, "hidden_size": 8, "num_hidden_layers": 2, "intermediate_size": 16,
  "linear_attn_config": {"kda_layers": [1], "full_attn_layers": [2], "head_dim": 4,
                         "num_heads": 2, "short_conv_kernel_size": 4},
  "num_attention_heads": 2, "kv_lora_rank": 4, "qk_nope_head_dim": 4, "qk_rope_head_dim": 2,
  "v_head_dim": 4, "mla_use_nope": true, "q_lora_rank": null,
  "num_experts": 4, "num_experts_per_token": 2, "num_shared_experts": 1,
  "moe_intermediate_size": 4, "first_k_dense_replace": 1, "moe_layer_freq": 1,
  "rms_norm_eps": 1e-5, "model_max_length": 128, "eos_token_id": [1, 2]
}"#;

const F32_VALUES: [f32; 6] = [1.0, -2.5, 3.25, 0.0, 1e-3, -7.0];
const F16_VALUES: [f32; 4] = [0.5, -1.0, 65504.0, 0.25];
const BF16_VALUES: [f32; 4] = [1.5, -3.0, 256.0, -0.125];

/// Serializes `(name, dtype, shape, bytes)` tensors into safetensors bytes.
fn safetensors_bytes(tensors: &[(&str, Dtype, Vec<usize>, Vec<u8>)]) -> Vec<u8> {
    let views: Vec<(&str, safetensors::tensor::TensorView<'_>)> = tensors
        .iter()
        .map(|(name, dtype, shape, bytes)| {
            (
                *name,
                safetensors::tensor::TensorView::new(*dtype, shape.clone(), bytes).unwrap(),
            )
        })
        .collect();
    serialize(views, None).unwrap()
}

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}
fn f16_bytes(v: &[f32]) -> Vec<u8> {
    v.iter()
        .flat_map(|x| f16::from_f32(*x).to_bits().to_le_bytes())
        .collect()
}
fn bf16_bytes(v: &[f32]) -> Vec<u8> {
    v.iter()
        .flat_map(|x| bf16::from_f32(*x).to_bits().to_le_bytes())
        .collect()
}

/// The three-dtype tensor set used by most tests.
fn sample_tensors() -> Vec<(&'static str, Dtype, Vec<usize>, Vec<u8>)> {
    vec![
        (
            "model.embed_tokens.weight",
            Dtype::F32,
            vec![2, 3],
            f32_bytes(&F32_VALUES),
        ),
        (
            "model.norm.weight",
            Dtype::F16,
            vec![4],
            f16_bytes(&F16_VALUES),
        ),
        (
            "lm_head.weight",
            Dtype::BF16,
            vec![2, 2],
            bf16_bytes(&BF16_VALUES),
        ),
    ]
}

/// A directory with config.json and one model.safetensors.
fn single_file_dir() -> TempDir {
    let dir = TempDir::new().unwrap();
    fs::write(dir.path().join("config.json"), CONFIG).unwrap();
    fs::write(
        dir.path().join("model.safetensors"),
        safetensors_bytes(&sample_tensors()),
    )
    .unwrap();
    dir
}

/// A directory with config.json, two shards and an index mapping `weight_map`.
fn sharded_dir(weight_map: &str) -> TempDir {
    let dir = TempDir::new().unwrap();
    let t = sample_tensors();
    fs::write(dir.path().join("config.json"), CONFIG).unwrap();
    fs::write(
        dir.path().join("model-00001-of-00002.safetensors"),
        safetensors_bytes(&t[..2]),
    )
    .unwrap();
    fs::write(
        dir.path().join("model-00002-of-00002.safetensors"),
        safetensors_bytes(&t[2..]),
    )
    .unwrap();
    let index = format!(r#"{{"metadata": {{"total_size": 44}}, "weight_map": {weight_map}}}"#);
    fs::write(dir.path().join("model.safetensors.index.json"), index).unwrap();
    dir
}

const GOOD_MAP: &str = r#"{
  "model.embed_tokens.weight": "model-00001-of-00002.safetensors",
  "model.norm.weight": "model-00001-of-00002.safetensors",
  "lm_head.weight": "model-00002-of-00002.safetensors"
}"#;

/// Writes a safetensors file from a raw header text and data section.
fn raw_file(path: &Path, header: &str, data: &[u8]) {
    let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(header.as_bytes());
    bytes.extend_from_slice(data);
    fs::write(path, bytes).unwrap();
}

fn open_err(dir: &Path) -> WeightsError {
    Checkpoint::open(dir).unwrap_err()
}

fn check_sample_values(ckpt: &Checkpoint) {
    let emb = ckpt.get("model.embed_tokens.weight").unwrap();
    assert_eq!(
        (emb.dtype, emb.shape, emb.num_elements()),
        (DType::F32, &[2, 3][..], 6)
    );
    assert_eq!(emb.to_f32_vec(), F32_VALUES);
    let norm = ckpt.get_shaped("model.norm.weight", &[4]).unwrap();
    assert_eq!(norm.dtype, DType::F16);
    assert_eq!(norm.to_f32_vec(), F16_VALUES);
    let head = ckpt.get("lm_head.weight").unwrap();
    assert_eq!(head.dtype, DType::BF16);
    assert_eq!(head.to_f32_vec(), BF16_VALUES);
    assert_eq!(head.name, "lm_head.weight");
    assert_eq!(ckpt.total_bytes(), 24 + 8 + 8);
    assert_eq!(
        ckpt.tensor_names(),
        vec![
            "lm_head.weight",
            "model.embed_tokens.weight",
            "model.norm.weight"
        ]
    );
}

#[test]
fn single_file_round_trips_every_dtype() {
    let dir = single_file_dir();
    let ckpt = Checkpoint::open(dir.path()).unwrap();
    check_sample_values(&ckpt);
    assert_eq!(ckpt.dir(), dir.path());
    assert_eq!(ckpt.config().hidden_size, 8);
    assert_eq!(ckpt.config().eos_token_ids, vec![1, 2]);
    assert_eq!(ckpt.config_json()["vocab_size"], 32);
    let file = ckpt.get("lm_head.weight").unwrap().file;
    assert_eq!(file, dir.path().join("model.safetensors"));
}

#[test]
fn sharded_round_trips_and_reports_the_right_file() {
    let dir = sharded_dir(GOOD_MAP);
    let ckpt = Checkpoint::open(dir.path()).unwrap();
    check_sample_values(&ckpt);
    let head = ckpt.get("lm_head.weight").unwrap();
    assert_eq!(
        head.file,
        dir.path().join("model-00002-of-00002.safetensors")
    );
}

#[test]
fn missing_tensor_names_the_tensor_and_the_files() {
    let dir = sharded_dir(GOOD_MAP);
    let ckpt = Checkpoint::open(dir.path()).unwrap();
    let err = ckpt
        .get("model.layers.0.self_attn.q_proj.weight")
        .unwrap_err();
    assert!(matches!(err, WeightsError::Missing { .. }), "{err:?}");
    let text = err.to_string();
    assert!(
        text.contains("model.layers.0.self_attn.q_proj.weight"),
        "{text}"
    );
    assert!(text.contains("model-00001-of-00002.safetensors"), "{text}");
    assert!(text.contains("model-00002-of-00002.safetensors"), "{text}");
}

/// A missing tensor's error lists the stored names that nearly match it, closest first and
/// at most five, and says so when none does.
#[test]
fn missing_tensor_lists_the_names_that_nearly_match() {
    let dir = TempDir::new().unwrap();
    fs::write(dir.path().join("config.json"), CONFIG).unwrap();
    let zeros = f32_bytes(&[0.0; 4]);
    let mut names: Vec<String> = ["gate", "up", "down"]
        .iter()
        .map(|m| format!("model.layers.0.block_sparse_moe.{m}_proj.weight"))
        .collect();
    names.extend((0..8).map(|e| format!("model.layers.1.block_sparse_moe.experts.{e}.w1.weight")));
    names.push("model.layers.1.block_sparse_moe.gate_proj.weight".into());
    names.push("model.norm.weight".into());
    let tensors: Vec<_> = names
        .iter()
        .map(|n| (n.as_str(), Dtype::F32, vec![4], zeros.clone()))
        .collect();
    fs::write(
        dir.path().join("model.safetensors"),
        safetensors_bytes(&tensors),
    )
    .unwrap();
    let ckpt = Checkpoint::open(dir.path()).unwrap();

    let err = ckpt
        .get_shaped("model.layers.0.mlp.gate_proj.weight", &[4])
        .unwrap_err();
    let WeightsError::Missing { name, files, near } = &err else {
        panic!("{err:?}");
    };
    assert_eq!(name, "model.layers.0.mlp.gate_proj.weight");
    assert_eq!(files, &[dir.path().join("model.safetensors")]);
    assert_eq!(near[0], "model.layers.0.block_sparse_moe.gate_proj.weight");
    assert!(near.len() <= 5 && near.len() >= 2, "{near:?}");
    assert!(!near.iter().any(|n| n.contains("norm")), "{near:?}");
    let text = err.to_string();
    assert!(
        text.contains(
            "names that nearly match: `model.layers.0.block_sparse_moe.gate_proj.weight`"
        ),
        "{text}"
    );
    assert!(text.contains("model.safetensors"), "{text}");

    // Eight stored experts are one segment away; five are listed.
    let err = ckpt
        .get("model.layers.1.block_sparse_moe.experts.9.w1.weight")
        .unwrap_err();
    let WeightsError::Missing { near, .. } = &err else {
        panic!("{err:?}");
    };
    assert_eq!(near.len(), 5, "{near:?}");
    assert!(near[0].starts_with("model.layers.1.block_sparse_moe.experts."));

    let text = ckpt
        .get("vision_tower.patch_embed.weight")
        .unwrap_err()
        .to_string();
    assert!(text.contains("no stored name nearly matches"), "{text}");
    assert!(ckpt.contains("model.norm.weight") && !ckpt.contains("model.norm"));
    assert_eq!(ckpt.shape("model.norm.weight"), Some(&[4][..]));
}

#[test]
fn wrong_shape_names_expected_and_found() {
    let dir = single_file_dir();
    let ckpt = Checkpoint::open(dir.path()).unwrap();
    let err = ckpt
        .get_shaped("model.embed_tokens.weight", &[3, 2])
        .unwrap_err();
    assert!(matches!(err, WeightsError::Shape { .. }), "{err:?}");
    let text = err.to_string();
    for needle in [
        "model.embed_tokens.weight",
        "model.safetensors",
        "expected shape [3, 2]",
        "found [2, 3]",
    ] {
        assert!(text.contains(needle), "missing {needle:?} in {text}");
    }
}

#[test]
fn unused_tensors_are_named() {
    let dir = sharded_dir(GOOD_MAP);
    let ckpt = Checkpoint::open(dir.path()).unwrap();
    let all: HashSet<String> = ckpt.tensor_names().into_iter().map(String::from).collect();
    ckpt.check_all_used(&all).unwrap();
    let mut used = all.clone();
    used.remove("model.norm.weight");
    used.remove("lm_head.weight");
    used.insert("some.tensor.the.model.wanted".into());
    let err = ckpt.check_all_used(&used).unwrap_err();
    let WeightsError::Unexpected { names } = &err else {
        panic!("{err:?}")
    };
    assert_eq!(names, &["lm_head.weight", "model.norm.weight"]);
    assert!(err.to_string().contains("model.norm.weight"));
}

#[test]
fn truncated_file_is_corrupt_and_names_the_file() {
    let dir = single_file_dir();
    let path = dir.path().join("model.safetensors");
    let bytes = fs::read(&path).unwrap();
    // Cut in half: the header survives, the data does not. Then cut inside the header.
    for keep in [bytes.len() / 2, bytes.len() - 1, 20, 3, 0] {
        fs::write(&path, &bytes[..keep]).unwrap();
        let err = open_err(dir.path());
        assert!(
            matches!(err, WeightsError::Corrupt { .. }),
            "keep {keep}: {err:?}"
        );
        assert!(
            err.to_string().contains(&path.display().to_string()),
            "keep {keep}: {err}"
        );
    }
}

#[test]
fn garbage_headers_are_corrupt() {
    let dir = single_file_dir();
    let path = dir.path().join("model.safetensors");
    let cases: Vec<(Vec<u8>, &str)> = vec![
        (
            b"\x05\x00\x00\x00\x00\x00\x00\x00hello".to_vec(),
            "not valid JSON",
        ),
        (
            b"\xff\xff\xff\xff\xff\xff\xff\xff{}".to_vec(),
            "header length",
        ),
        (
            b"\x02\x00\x00\x00\x00\x00\x00\x00\xff\xfe".to_vec(),
            "UTF-8",
        ),
        (
            b"\x02\x00\x00\x00\x00\x00\x00\x00[]".to_vec(),
            "not a JSON object",
        ),
        (vec![0x41; 64], "header length"),
    ];
    for (bytes, needle) in cases {
        fs::write(&path, &bytes).unwrap();
        let err = open_err(dir.path());
        let text = err.to_string();
        assert!(
            matches!(err, WeightsError::Corrupt { .. }) && text.contains(needle),
            "{text}"
        );
        assert!(text.contains("model.safetensors"), "{text}");
    }
}

#[test]
fn bad_offsets_are_corrupt_and_name_the_tensor() {
    let dir = single_file_dir();
    let path = dir.path().join("model.safetensors");
    let data = [0u8; 16];
    let cases = [
        (
            r#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}}"#,
            "overlap",
        ),
        (
            r#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[2],"data_offsets":[8,24]}}"#,
            "past the end",
        ),
        (
            r#"{"a":{"dtype":"F32","shape":[3],"data_offsets":[0,16]}}"#,
            "needs 12",
        ),
        (
            r#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[8,16]}}"#,
            "belong to no tensor",
        ),
        (
            r#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}"#,
            "data section has 16",
        ),
        (
            r#"{"a":{"dtype":"F32","shape":[4],"data_offsets":[16,0]}}"#,
            "backwards",
        ),
        (
            r#"{"a":{"dtype":"F32","shape":[4],"data_offsets":[0]}}"#,
            "data_offsets",
        ),
        (
            r#"{"a":{"dtype":"F32","shape":[-4],"data_offsets":[0,16]}}"#,
            "shape",
        ),
        (
            r#"{"a":{"dtype":7,"shape":[4],"data_offsets":[0,16]}}"#,
            "dtype",
        ),
        (
            r#"{"a":{"dtype":"F32","shape":[4294967296,4294967296,4294967296],"data_offsets":[0,16]}}"#,
            "too large",
        ),
        (r#"{"a":[1,2]}"#, "not an object"),
    ];
    for (header, needle) in cases {
        raw_file(&path, header, &data);
        let err = open_err(dir.path());
        let text = err.to_string();
        assert!(
            matches!(err, WeightsError::Corrupt { .. }),
            "{header}: {err:?}"
        );
        assert!(
            text.contains(needle) && text.contains("model.safetensors"),
            "{header}: {text}"
        );
    }
}

#[test]
fn other_dtypes_open_but_get_says_unsupported() {
    let dir = single_file_dir();
    let path = dir.path().join("model.safetensors");
    let mut tensors = sample_tensors();
    tensors.push((
        "experts.w1.weight_packed",
        Dtype::U8,
        vec![2, 4],
        vec![7; 8],
    ));
    tensors.push((
        "experts.w1.weight_scale",
        Dtype::F8_E8M0,
        vec![2],
        vec![127; 2],
    ));
    tensors.push(("q.weight", Dtype::I8, vec![3], vec![1, 2, 3]));
    tensors.push(("fp8.weight", Dtype::F8_E4M3, vec![2], vec![1, 2]));
    tensors.push(("h.weight", Dtype::I16, vec![1], vec![1, 2]));
    tensors.push(("d.weight", Dtype::F64, vec![1], vec![0; 8]));
    fs::write(&path, safetensors_bytes(&tensors)).unwrap();
    let ckpt = Checkpoint::open(dir.path()).unwrap();
    check_sample_values_except_total(&ckpt);
    // MXFP4 planes are raw bytes; the model's expert loader interprets them.
    let packed = ckpt.get("experts.w1.weight_packed").unwrap();
    assert_eq!((packed.dtype, packed.bytes), (DType::U8, &[7u8; 8][..]));
    let scale = ckpt.get("experts.w1.weight_scale").unwrap();
    assert_eq!((scale.dtype, scale.bytes), (DType::E8M0, &[127u8; 2][..]));
    // So are the planes of AWQ, GPTQ, compressed-tensors and FP8 checkpoints.
    let q = ckpt.get("q.weight").unwrap();
    assert_eq!((q.dtype, q.bytes), (DType::I8, &[1u8, 2, 3][..]));
    assert_eq!(ckpt.get("fp8.weight").unwrap().dtype, DType::F8E4M3);
    for (name, dtype) in [("h.weight", "I16"), ("d.weight", "F64")] {
        let err = ckpt.get(name).unwrap_err();
        let WeightsError::UnsupportedDType { dtype: found, .. } = &err else {
            panic!("{err:?}")
        };
        assert_eq!(found, dtype);
        let text = err.to_string();
        assert!(
            text.contains(name) && text.contains(dtype) && text.contains("model.safetensors"),
            "{text}"
        );
    }
    // An unknown dtype name still opens; its size cannot be checked but its range is.
    raw_file(
        &path,
        r#"{"x":{"dtype":"F3_FUTURE","shape":[4],"data_offsets":[0,3]}}"#,
        &[1, 2, 3],
    );
    let ckpt = Checkpoint::open(dir.path()).unwrap();
    assert!(matches!(
        ckpt.get("x"),
        Err(WeightsError::UnsupportedDType { .. })
    ));
}

fn check_sample_values_except_total(ckpt: &Checkpoint) {
    assert_eq!(
        ckpt.get("model.embed_tokens.weight").unwrap().to_f32_vec(),
        F32_VALUES
    );
    assert_eq!(
        ckpt.get("lm_head.weight").unwrap().to_f32_vec(),
        BF16_VALUES
    );
}

#[test]
fn index_naming_a_missing_shard_is_an_error() {
    let map = GOOD_MAP.replace("model-00002-of-00002", "model-00003-of-00003");
    let dir = sharded_dir(&map);
    let err = open_err(dir.path());
    let text = err.to_string();
    assert!(matches!(err, WeightsError::Index { .. }), "{err:?}");
    assert!(
        text.contains("model-00003-of-00003.safetensors") && text.contains("lm_head.weight"),
        "{text}"
    );
}

#[test]
fn index_entry_whose_shard_lacks_the_tensor_is_an_error() {
    // lm_head.weight is really in shard 2; the index puts it in shard 1.
    let map = GOOD_MAP.replace(
        r#""lm_head.weight": "model-00002-of-00002.safetensors""#,
        r#""lm_head.weight": "model-00001-of-00002.safetensors""#,
    );
    let dir = sharded_dir(&map);
    let err = open_err(dir.path());
    let text = err.to_string();
    assert!(matches!(err, WeightsError::Index { .. }), "{err:?}");
    assert!(
        text.contains("lm_head.weight") && text.contains("does not contain it"),
        "{text}"
    );
    // A tensor that no shard holds at all.
    let map = GOOD_MAP.replace('}', r#", "ghost": "model-00001-of-00002.safetensors"}"#);
    let dir = sharded_dir(&map);
    let text = open_err(dir.path()).to_string();
    assert!(
        text.contains("ghost") && text.contains("no shard holds it"),
        "{text}"
    );
}

#[test]
fn tensor_in_two_shards_is_an_error() {
    let dir = sharded_dir(GOOD_MAP);
    let t = sample_tensors();
    // Shard 2 now also holds model.norm.weight.
    let both = vec![t[1].clone(), t[2].clone()];
    fs::write(
        dir.path().join("model-00002-of-00002.safetensors"),
        safetensors_bytes(&both),
    )
    .unwrap();
    let err = open_err(dir.path());
    let WeightsError::Duplicate { name, files } = &err else {
        panic!("{err:?}")
    };
    assert_eq!(name, "model.norm.weight");
    assert_eq!(files.len(), 2);
    let text = err.to_string();
    assert!(
        text.contains("model-00001-of-00002") && text.contains("model-00002-of-00002"),
        "{text}"
    );
}

#[test]
fn malformed_indexes_are_errors() {
    let cases = [
        ("not json", "not valid JSON"),
        (r#"{"metadata": {}}"#, "weight_map"),
        (r#"{"weight_map": {}}"#, "empty"),
        (r#"{"weight_map": {"a": 3}}"#, "not a file name"),
        (
            r#"{"weight_map": {"a": "../model.safetensors"}}"#,
            "plain file name",
        ),
        (r#"{"weight_map": {"a": "/etc/passwd"}}"#, "plain file name"),
    ];
    for (index, needle) in cases {
        let dir = sharded_dir(GOOD_MAP);
        fs::write(dir.path().join("model.safetensors.index.json"), index).unwrap();
        let err = open_err(dir.path());
        assert!(
            matches!(err, WeightsError::Index { .. }),
            "{index}: {err:?}"
        );
        assert!(err.to_string().contains(needle), "{index}: {err}");
    }
}

#[test]
fn directory_problems_are_named() {
    let dir = TempDir::new().unwrap();
    let err = open_err(dir.path());
    assert!(
        matches!(err, WeightsError::Io { .. }) && err.to_string().contains("config.json"),
        "{err}"
    );

    fs::write(dir.path().join("config.json"), CONFIG).unwrap();
    let err = open_err(dir.path());
    assert!(matches!(err, WeightsError::NoWeights { .. }), "{err:?}");

    fs::write(dir.path().join("config.json"), r#"{"model_type": "llama"}"#).unwrap();
    let err = open_err(dir.path());
    assert!(
        matches!(err, WeightsError::Config { .. }) && err.to_string().contains("llama"),
        "{err}"
    );

    fs::write(dir.path().join("config.json"), "{").unwrap();
    let err = open_err(dir.path());
    assert!(
        matches!(err, WeightsError::Config { .. }) && err.to_string().contains("config.json"),
        "{err}"
    );
}

#[test]
fn to_f32_vec_reads_unaligned_bytes() {
    let values = [1.0f32, -0.5, 3.0];
    for offset in 0..4 {
        let mut buf = vec![0xAA; offset];
        buf.extend(f32_bytes(&values));
        let view = TensorView {
            name: "t",
            file: Path::new("x"),
            shape: &[3],
            dtype: DType::F32,
            bytes: &buf[offset..],
        };
        assert_eq!(view.to_f32_vec(), values);
        let mut buf = vec![0xAA; offset];
        buf.extend(bf16_bytes(&values));
        let view = TensorView {
            dtype: DType::BF16,
            bytes: &buf[offset..],
            ..view
        };
        assert_eq!(view.to_f32_vec(), values);
    }
    // A hand-built view with a ragged byte count neither panics nor invents values.
    let view = TensorView {
        name: "t",
        file: Path::new("x"),
        shape: &[usize::MAX, 2],
        dtype: DType::F16,
        bytes: &[0, 60, 1],
    };
    assert_eq!(view.to_f32_vec(), vec![1.0]);
    assert_eq!(view.num_elements(), usize::MAX);
}

#[test]
fn header_metadata_and_empty_tensors_are_accepted() {
    let dir = single_file_dir();
    let path = dir.path().join("model.safetensors");
    let header = r#"{"__metadata__":{"format":"pt"},"empty":{"dtype":"BF16","shape":[0,4],"data_offsets":[0,0]},"b":{"dtype":"BF16","shape":[2],"data_offsets":[0,4]}}  "#;
    raw_file(&path, header, &bf16_bytes(&[2.0, 4.0]));
    let ckpt = Checkpoint::open(dir.path()).unwrap();
    assert_eq!(ckpt.get("empty").unwrap().to_f32_vec(), Vec::<f32>::new());
    assert_eq!(ckpt.get("b").unwrap().to_f32_vec(), vec![2.0, 4.0]);
    assert_eq!(ckpt.tensor_names(), vec!["b", "empty"]);
}
