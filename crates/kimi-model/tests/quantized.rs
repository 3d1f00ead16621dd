//! Quantized checkpoints as the tools write them, against float64 reference logits.
//!
//! `fixtures/quantized/` holds one tiny Kimi Linear model quantized by llm-compressor
//! (compressed-tensors INT4 asymmetric with groups 32 and 64, INT8 per channel, FP8 per
//! channel), by AutoAWQ's GEMM packing, in GPTQ's v1 layout (4-bit act-order, 8-bit
//! symmetric per channel) and as block-scaled FP8 (`weight_scale_inv`); each with the logits
//! of transformers' `KimiLinearForCausalLM` in float64 on the tool's own dequantization of
//! the stored tensors (`scripts/make_quant_fixtures.py`, `fixtures/quantized/README.md`).
//! Loading repacks the weights with their values unchanged, so the f32 CPU path must match
//! the reference as closely as the float checkpoints do.

use std::path::{Path, PathBuf};

use kimi_core::DType;
use kimi_cpu::{CpuBackend, QuantMatmul};
use kimi_model::{
    Batch, CausalLm, CheckpointSource, ForwardOptions, KimiLinear, SeqCache, WeightSource,
};
use kimi_ops::{Backend, KdaMode, MlaMode, Segment};
use kimi_weights::Checkpoint;
use serde_json::Value;

/// Relative L2 error allowed for f32 arithmetic against the float64 reference.
const TOLERANCE: f64 = 2e-5;

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(format!("../../fixtures/quantized/{name}"))
}

const FIXTURES: [&str; 7] = [
    "ct-w4a16-asym",
    "ct-w8a16",
    "ct-fp8",
    "awq-gemm",
    "gptq-4bit-actorder",
    "gptq-8bit-sym",
    "fp8-block",
];

fn read_npy_f64(path: &Path) -> Vec<f64> {
    let bytes = std::fs::read(path).expect("npy readable");
    assert_eq!(&bytes[..6], b"\x93NUMPY");
    let header_len = u16::from_le_bytes([bytes[8], bytes[9]]) as usize;
    let header = std::str::from_utf8(&bytes[10..10 + header_len]).expect("ascii header");
    assert!(header.contains("'<f8'"), "{header}");
    bytes[10 + header_len..]
        .chunks_exact(8)
        .map(|c| f64::from_le_bytes(c.try_into().expect("8 bytes")))
        .collect()
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .expect("id list")
        .iter()
        .map(|x| x.as_u64().expect("id") as u32)
        .collect()
}

fn load(name: &str, mode: QuantMatmul) -> (KimiLinear<CpuBackend>, Value) {
    let dir = fixture(name);
    let ckpt = Checkpoint::open(&dir).unwrap_or_else(|e| panic!("{name}: {e}"));
    let model = KimiLinear::load(CpuBackend::with_quant_matmul(mode), &ckpt)
        .unwrap_or_else(|e| panic!("{name}: {e}"));
    let reference: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("reference.json")).unwrap())
            .unwrap();
    (model, reference)
}

/// Logits of every position, feeding `step` tokens per forward pass through one cache.
fn run(model: &KimiLinear<CpuBackend>, ids: &[u32], step: usize, opts: ForwardOptions) -> Vec<f32> {
    let mut pool = model.new_pool(ids.len().div_ceil(4), 4, 1).unwrap();
    let mut cache = SeqCache::new(0, (0..ids.len().div_ceil(4) as u32).collect());
    let mut out = Vec::new();
    for chunk in ids.chunks(step) {
        let batch = Batch {
            tokens: chunk.to_vec(),
            segments: vec![Segment {
                start: 0,
                len: chunk.len(),
            }],
            logits_rows: (0..chunk.len()).collect(),
            sampling: None,
        };
        let fwd = model.forward(&batch, &mut pool, &mut [&mut cache], opts);
        out.extend(fwd.unwrap().logits);
    }
    out
}

fn rel_err(got: &[f32], want: &[f64]) -> f64 {
    assert_eq!(got.len(), want.len());
    let num: f64 = got
        .iter()
        .zip(want)
        .map(|(g, w)| (*g as f64 - w).powi(2))
        .sum();
    let den: f64 = want.iter().map(|w| w * w).sum();
    (num / den).sqrt()
}

#[test]
fn quantized_checkpoints_match_their_reference() {
    let modes = [
        ("prefill", 0, ForwardOptions::default()),
        (
            "decode",
            1,
            ForwardOptions {
                kda_mode: KdaMode::Recurrent,
                mla_mode: MlaMode::Absorbed,
                ..ForwardOptions::default()
            },
        ),
    ];
    for name in FIXTURES {
        let (model, reference) = load(name, QuantMatmul::F32);
        let prompt = ids(&reference["prompt_ids"]);
        let want = read_npy_f64(&fixture(name).join("logits.npy"));
        for (label, step, opts) in modes {
            let step = if step == 0 { prompt.len() } else { step };
            let got = run(&model, &prompt, step, opts);
            let err = rel_err(&got, &want);
            eprintln!("{name:<20} {label:<8} rel err {err:.2e}");
            assert!(err <= TOLERANCE, "{name} {label}: relative error {err:.3e}");
        }
        // Greedy continuation, token by token through the caches.
        let greedy = &reference["greedy"];
        let mut seq = ids(&greedy["prompt_ids"]);
        let want_new = ids(&greedy["new_tokens"]);
        let mut got_new = Vec::new();
        while got_new.len() < want_new.len() {
            let logits = run(&model, &seq, seq.len(), ForwardOptions::default());
            let vocab = model.config().vocab_size;
            let next = kimi_ops::argmax_row(&logits[logits.len() - vocab..]);
            got_new.push(next);
            seq.push(next);
        }
        assert_eq!(got_new, want_new, "{name}: greedy continuation");
    }
}

/// Each format keeps its weights packed where the blocks hold them exactly.
#[test]
fn weights_stay_packed() {
    for (name, weight, dtype) in [
        (
            "ct-w4a16-asym",
            "model.layers.0.self_attn.q_proj.weight",
            DType::Q4Z,
        ),
        (
            "ct-w4a16-asym",
            "model.layers.1.block_sparse_moe.experts.2.w3.weight",
            DType::Q4Z,
        ),
        (
            "ct-w4a16-asym",
            "model.layers.0.mlp.down_proj.weight",
            DType::Q4Z,
        ),
        (
            "ct-w8a16",
            "model.layers.1.self_attn.kv_b_proj.weight",
            DType::Q8Z,
        ),
        (
            "ct-fp8",
            "model.layers.2.self_attn.o_proj.weight",
            DType::F8S,
        ),
        (
            "awq-gemm",
            "model.layers.0.self_attn.k_proj.weight",
            DType::Q4Z,
        ),
        (
            "gptq-8bit-sym",
            "model.layers.0.mlp.up_proj.weight",
            DType::Q8Z,
        ),
        (
            "fp8-block",
            "model.layers.2.self_attn.v_proj.weight",
            DType::F8S,
        ),
        // Act-order groups cross 32-value blocks: widened to f32, values unchanged.
        (
            "gptq-4bit-actorder",
            "model.layers.0.self_attn.q_proj.weight",
            DType::F32,
        ),
    ] {
        let ckpt = Checkpoint::open(&fixture(name)).unwrap();
        let source = CheckpointSource::new(&ckpt).unwrap();
        assert!(source.contains(weight), "{name}: {weight}");
        let shape = source
            .shape(weight)
            .unwrap_or_else(|| panic!("{name}: {weight} shape"));
        let (got, bytes) = source.load(weight, &shape).unwrap();
        assert_eq!(got, dtype, "{name}: {weight}");
        assert_eq!(Some(bytes.len()), got.storage_bytes(shape.iter().product()));
    }
}

/// A broken quantized tensor is refused naming the tensor and the file.
#[test]
fn broken_quantized_tensors_name_themselves() {
    let dir = tempfile::tempdir().unwrap();
    for f in ["config.json", "model.safetensors"] {
        std::fs::copy(fixture("ct-w4a16-asym").join(f), dir.path().join(f)).unwrap();
    }
    // A config that says GPTQ over compressed-tensors' tensors finds no `qweight`.
    let mut config: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.path().join("config.json")).unwrap())
            .unwrap();
    config["quantization_config"] = serde_json::json!({"quant_method": "gptq", "bits": 4});
    std::fs::write(dir.path().join("config.json"), config.to_string()).unwrap();
    let ckpt = Checkpoint::open(dir.path()).unwrap();
    let err = KimiLinear::load(CpuBackend::new(), &ckpt)
        .map(|_| ())
        .unwrap_err()
        .to_string();
    assert!(err.contains("q_proj"), "{err}");
    // An unknown method is refused when the config is read.
    config["quantization_config"] = serde_json::json!({"quant_method": "hqq"});
    std::fs::write(dir.path().join("config.json"), config.to_string()).unwrap();
    let err = Checkpoint::open(dir.path()).unwrap_err().to_string();
    assert!(err.contains("quant_method") && err.contains("hqq"), "{err}");
}

/// The automatic placement counts a quantized checkpoint's routed experts as the backend
/// will hold them, not in the config's bf16: repacked 4-bit experts as Q4Z blocks, 8-bit as
/// Q8Z, FP8 as F8S (the CPU backend keeps each packed); float experts leave it to the
/// config's arithmetic.
#[test]
fn routed_experts_are_sized_as_the_backend_holds_them() {
    for (name, dtype) in [
        ("ct-w4a16-asym", DType::Q4Z),
        ("awq-gemm", DType::Q4Z),
        ("ct-w8a16", DType::Q8Z),
        ("gptq-8bit-sym", DType::Q8Z),
        ("ct-fp8", DType::F8S),
        ("fp8-block", DType::F8S),
    ] {
        let ckpt = Checkpoint::open(&fixture(name)).unwrap();
        let source = CheckpointSource::new(&ckpt).unwrap();
        let cfg = ckpt.config();
        let cpu = CpuBackend::new();
        let keeps = |d| cpu.stores_experts(d);
        let got = kimi_model::routed_expert_bytes(&keeps, &source, cfg)
            .unwrap()
            .unwrap_or_else(|| panic!("{name}: quantized experts"));
        let moe = cfg.moe.as_ref().unwrap();
        let moe_layers = cfg
            .layers
            .iter()
            .filter(|l| l.ffn == kimi_core::config::Ffn::Moe)
            .count();
        let matrix = dtype
            .storage_bytes(moe.expert_intermediate_size * cfg.hidden_size)
            .unwrap();
        assert_eq!(
            got as usize,
            3 * matrix * moe.num_experts * moe_layers,
            "{name}"
        );
        let summary = kimi_model::ModelSummary::new(cfg);
        let as_config = summary.routed_expert_bytes();
        assert!(
            got < as_config,
            "{name}: {got} vs {as_config} in the config's dtype"
        );
    }
    let ckpt = Checkpoint::open(
        &Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/kimi-linear/hub-bf16-freq2"),
    )
    .unwrap();
    let source = CheckpointSource::new(&ckpt).unwrap();
    let bytes = kimi_model::routed_expert_bytes(&|_| true, &source, ckpt.config());
    assert_eq!(bytes.unwrap(), None);
}
