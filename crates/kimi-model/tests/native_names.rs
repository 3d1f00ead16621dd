//! Checkpoints as transformers' `save_pretrained` writes them, read by hub name: the
//! `native-saved-*` fixtures against their hub-layout twins, and the errors of incomplete or
//! mixed ones.

use std::collections::HashSet;
use std::path::{Path, PathBuf};

use kimi_core::DType;
use kimi_cpu::CpuBackend;
use kimi_model::{CheckpointLayout, CheckpointSource, KimiLinear, ModelError, WeightSource};
use kimi_weights::Checkpoint;

fn fixture(family: &str, name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(format!("../../fixtures/{family}/{name}"))
}

fn open(name: &str) -> Checkpoint {
    Checkpoint::open(&fixture("kimi-linear", name)).unwrap_or_else(|e| panic!("{name}: {e}"))
}

/// The layout is read off the stored names.
#[test]
fn layouts_are_detected_from_the_stored_names() {
    for (family, name, want) in [
        ("kimi-linear", "hub-bf16-irregular", CheckpointLayout::Hub),
        ("kimi-linear", "native-bf16-freq2", CheckpointLayout::Hub),
        (
            "kimi-linear",
            "native-saved-bf16-freq2",
            CheckpointLayout::SavePretrained,
        ),
        (
            "kimi-linear",
            "native-saved-fused-f32-short",
            CheckpointLayout::InMemory,
        ),
        ("kimi-k3", "k3-tiny-7l", CheckpointLayout::Hub),
    ] {
        let ckpt = Checkpoint::open(&fixture(family, name)).unwrap();
        let source = CheckpointSource::new(&ckpt).unwrap();
        assert_eq!(source.layout(), want, "{name}");
    }
}

/// Every hub tensor of the twin comes out of the save_pretrained directory with the same
/// dtype and bytes, and using all of them uses every stored tensor.
#[test]
fn saved_checkpoints_give_their_hub_twins_tensors() {
    for (saved, twin) in [
        ("native-saved-bf16-freq2", "native-bf16-freq2"),
        ("native-saved-fused-f32-short", "native-f32-short"),
    ] {
        let (saved_ckpt, hub) = (open(saved), open(twin));
        let source = CheckpointSource::new(&saved_ckpt).unwrap();
        let mut used = HashSet::new();
        for name in hub.tensor_names() {
            let want = hub.get(name).unwrap();
            assert!(source.contains(name), "{saved}: {name}");
            let (dtype, bytes) = source
                .load(name, want.shape)
                .unwrap_or_else(|e| panic!("{saved}: {e}"));
            assert_eq!(dtype, want.dtype, "{saved}: {name}");
            assert!(bytes == want.bytes, "{saved}: {name} differs from {twin}'s");
            used.insert(name.to_string());
        }
        source.check_all_used(&used).unwrap();
        used.remove("model.layers.1.post_attention_layernorm.weight");
        let err = source.check_all_used(&used).unwrap_err().to_string();
        assert!(err.contains("post_attention_layernorm"), "{err}");
    }
}

/// A hub name whose stored tensor is missing: the error names both, the layout, the file
/// and the stored names that nearly match.
#[test]
fn a_missing_stored_tensor_is_named_with_near_matches() {
    let ckpt = open("native-saved-bf16-freq2");
    let source = CheckpointSource::new(&ckpt).unwrap();
    let err = source
        .load("model.layers.2.mlp.gate_proj.weight", &[72, 48])
        .unwrap_err();
    assert!(matches!(err, ModelError::Stored { .. }), "{err:?}");
    let text = err.to_string();
    for part in [
        "`model.layers.2.mlp.gate_proj.weight` is read from \
         `model.layers.2.block_sparse_moe.gate_proj.weight`",
        "save_pretrained layout",
        "model.safetensors",
        "names that nearly match: `model.layers.2.block_sparse_moe.gate.weight`",
        "`model.layers.3.block_sparse_moe.gate_proj.weight`",
    ] {
        assert!(text.contains(part), "{part} not in: {text}");
    }

    // In the hub layout the tensor's own name is the one searched.
    let hub = open("native-bf16-freq2");
    let text = CheckpointSource::new(&hub)
        .unwrap()
        .load("model.layers.2.mlp.gate_proj.weight", &[72, 48])
        .unwrap_err()
        .to_string();
    assert!(
        text.contains("tensor `model.layers.2.mlp.gate_proj.weight` is not in the checkpoint"),
        "{text}"
    );
    assert!(
        text.contains("`model.layers.1.mlp.gate_proj.weight`"),
        "{text}"
    );
}

/// A fused tensor that cannot hold the hub tensor asked for: its expected stored shape.
#[test]
fn fused_tensors_are_shape_checked() {
    let ckpt = open("native-saved-fused-f32-short");
    let source = CheckpointSource::new(&ckpt).unwrap();
    // 4 experts of 12 × 32: the fused gate_up_proj is [4, 24, 32].
    let (_, w3) = source
        .load(
            "model.layers.1.block_sparse_moe.experts.3.w3.weight",
            &[12, 32],
        )
        .unwrap();
    assert_eq!(w3.len(), 12 * 32 * 4);
    let text = source
        .load(
            "model.layers.1.block_sparse_moe.experts.0.w1.weight",
            &[10, 32],
        )
        .unwrap_err()
        .to_string();
    assert!(
        text.contains("`model.layers.1.mlp.experts.gate_up_proj`")
            && text.contains("expected shape [4, 20, 32], found [4, 24, 32]"),
        "{text}"
    );
    let text = source
        .load("model.layers.0.self_attn.k_conv1d.weight", &[16, 1, 4])
        .unwrap_err()
        .to_string();
    assert!(
        text.contains("expected shape [48, 1, 4], found [48, 1, 5]"),
        "{text}"
    );
}

/// Writes a safetensors file of `(name, dtype, shape, bytes)` tensors.
fn write_safetensors(path: &Path, tensors: &[(String, DType, Vec<usize>, Vec<u8>)]) {
    let mut header = serde_json::Map::new();
    let mut data = Vec::new();
    for (name, dtype, shape, bytes) in tensors {
        let dtype = match dtype {
            DType::F32 => "F32",
            DType::BF16 => "BF16",
            other => panic!("{other}"),
        };
        let offsets = [data.len(), data.len() + bytes.len()];
        header.insert(
            name.clone(),
            serde_json::json!({"dtype": dtype, "shape": shape, "data_offsets": offsets}),
        );
        data.extend_from_slice(bytes);
    }
    let mut json = serde_json::to_vec(&header).unwrap();
    json.resize(json.len().next_multiple_of(8), b' ');
    let mut file = (json.len() as u64).to_le_bytes().to_vec();
    file.extend(json);
    file.extend(data);
    std::fs::write(path, file).unwrap();
}

/// A copy of fixture `name` whose tensors `edit` may drop (`None`) or rename.
fn edited_copy(name: &str, tag: &str, edit: impl Fn(&str) -> Option<String>) -> PathBuf {
    let src = fixture("kimi-linear", name);
    let ckpt = Checkpoint::open(&src).unwrap();
    let dir = std::env::temp_dir().join(format!("kimi-native-names-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::copy(src.join("config.json"), dir.join("config.json")).unwrap();
    let tensors: Vec<_> = ckpt
        .tensor_names()
        .into_iter()
        .filter_map(|n| {
            let t = ckpt.get(n).unwrap();
            edit(n).map(|new| (new, t.dtype, t.shape.to_vec(), t.bytes.to_vec()))
        })
        .collect();
    write_safetensors(&dir.join("model.safetensors"), &tensors);
    dir
}

/// The model's own load says which tensor is missing and what is stored nearby.
#[test]
fn loading_an_incomplete_saved_checkpoint_names_the_missing_tensor() {
    let dropped = "model.layers.3.block_sparse_moe.up_proj.weight";
    let dir = edited_copy("native-saved-bf16-freq2", "drop", |n| {
        (n != dropped).then(|| n.to_string())
    });
    let ckpt = Checkpoint::open(&dir).unwrap();
    let err = KimiLinear::load(CpuBackend::new(), &ckpt)
        .err()
        .expect("a missing tensor fails the load")
        .to_string();
    std::fs::remove_dir_all(&dir).unwrap();
    assert!(
        err.contains(&format!(
            "`model.layers.3.mlp.up_proj.weight` is read from `{dropped}`"
        )),
        "{err}"
    );
    assert!(
        err.contains("names that nearly match: `model.layers.3.block_sparse_moe.down_proj.weight`"),
        "{err}"
    );
}

/// Names of both of transformers' layouts in one checkpoint: refused, naming one of each.
#[test]
fn mixed_layouts_are_refused() {
    let dir = edited_copy("native-saved-fused-f32-short", "mixed", |n| {
        Some(n.replace(
            "layers.0.mlp.gate_proj",
            "layers.0.block_sparse_moe.gate_proj",
        ))
    });
    let ckpt = Checkpoint::open(&dir).unwrap();
    let err = CheckpointSource::new(&ckpt).err().unwrap().to_string();
    std::fs::remove_dir_all(&dir).unwrap();
    assert!(err.contains("mixes"), "{err}");
    assert!(err.contains("block_sparse_moe.gate_proj.weight"), "{err}");
    assert!(err.contains("save_original_format=False"), "{err}");
}
