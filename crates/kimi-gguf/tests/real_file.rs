//! The demo model, `models/SmolLM2-135M-Instruct.Q4_1.gguf` (fetched by
//! `scripts/fetch_demo_model.sh`; see `shared/docs/demo-model.md`). Skips, saying so, when
//! the file is absent. Reference numbers come from gguf-py's `GGUFReader` and
//! `gguf.quants.dequantize` on the same file.
#![allow(clippy::unwrap_used)]
// The reference values are exact f32s, written out in full as gguf-py printed them.
#![allow(clippy::excessive_precision)]

use std::path::PathBuf;

use kimi_gguf::{Array, GgmlType, GgufFile};

fn demo_model() -> Option<GgufFile> {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../models/SmolLM2-135M-Instruct.Q4_1.gguf");
    if !path.exists() {
        println!(
            "skipped: {} is absent (run scripts/fetch_demo_model.sh)",
            path.display()
        );
        return None;
    }
    Some(GgufFile::open(&path).unwrap())
}

#[test]
fn demo_model_header() {
    let Some(file) = demo_model() else { return };
    assert_eq!(file.version(), 3);
    assert_eq!(file.tensors().len(), 272);
    assert_eq!(file.metadata().len(), 33);
    assert_eq!(file.get_str("general.architecture").unwrap(), "llama");
    assert_eq!(file.get_u32("llama.block_count").unwrap(), 30);
    assert_eq!(file.get_u32("llama.embedding_length").unwrap(), 576);
    assert_eq!(file.get_u32("llama.attention.head_count_kv").unwrap(), 3);
    assert_eq!(file.get_f32("llama.rope.freq_base").unwrap(), 100000.0);
    let Array::String(tokens) = file.get_array("tokenizer.ggml.tokens").unwrap() else {
        panic!("tokens are strings")
    };
    assert_eq!(tokens.len(), 49152);
    assert_eq!(tokens[1], "<|im_start|>");

    let mut counts = [0usize; 3];
    for t in file.tensors() {
        let expected = if t.name == "token_embd.weight" {
            GgmlType::Q8_0
        } else if t.name.ends_with("norm.weight") {
            counts[0] += 1;
            GgmlType::F32
        } else if t.name.contains(".attn_") || t.name.contains(".ffn_") {
            counts[1] += 1;
            GgmlType::Q4_1
        } else {
            panic!("unexpected tensor {}", t.name)
        };
        assert_eq!(t.ggml_type, expected, "{}", t.name);
        counts[2] += 1;
    }
    assert_eq!(counts, [61, 210, 272]);
    let embd = file.tensor("token_embd.weight").unwrap();
    assert_eq!(embd.info.shape_outer_first(), [49152, 576]);
    assert_eq!(embd.info.ne, [576, 49152]);
    let down = file.tensor("blk.29.ffn_down.weight").unwrap();
    assert_eq!(down.info.shape_outer_first(), [576, 1536]);
}

/// `(name, first four values, sum, rms, max |x|)` from gguf-py.
const REFERENCE: [(&str, [f32; 4], f64, f64, f32); 4] = [
    (
        "blk.0.attn_q.weight",
        [
            -0.0963134765625,
            0.1573486328125,
            -0.0963134765625,
            -0.73046875,
        ],
        59.22322082519531,
        0.2839461246469261,
        5.251953125,
    ),
    (
        "token_embd.weight",
        [
            -0.10654449462890625,
            0.032978057861328125,
            0.048198699951171875,
            -0.022830963134765625,
        ],
        -15353.04449415207,
        0.13557929232202331,
        1.96112060546875,
    ),
    (
        "output_norm.weight",
        [1.7578125, 1.8203125, 1.78125, 1.6015625],
        1038.33203125,
        1.8265668454357387,
        3.34375,
    ),
    (
        "blk.29.ffn_down.weight",
        [
            -0.2733154296875,
            0.186279296875,
            0.186279296875,
            0.04840087890625,
        ],
        49.83570861816406,
        0.1831177799228307,
        4.34375,
    ),
];

#[test]
fn demo_model_dequantizes_like_gguf_py() {
    let Some(file) = demo_model() else { return };
    for (name, first, sum, rms, max) in REFERENCE {
        let x = file.tensor(name).unwrap().to_f32().unwrap();
        assert!(x.iter().all(|v| v.is_finite()), "{name}");
        assert_eq!(&x[..4], &first, "{name}");
        let got_sum: f64 = x.iter().map(|&v| f64::from(v)).sum();
        let got_rms =
            (x.iter().map(|&v| f64::from(v).powi(2)).sum::<f64>() / x.len() as f64).sqrt();
        let got_max = x.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        assert!(
            (got_sum - sum).abs() <= 1e-6 * sum.abs().max(1.0) * x.len() as f64,
            "{name}: sum {got_sum}"
        );
        assert!((got_rms - rms).abs() <= 1e-9, "{name}: rms {got_rms}");
        assert_eq!(got_max, max, "{name}");
    }
    // blk.0.attn_q.weight has a plausible weight scale.
    let q = file
        .tensor("blk.0.attn_q.weight")
        .unwrap()
        .to_f32()
        .unwrap();
    let rms = (q.iter().map(|v| v * v).sum::<f32>() / q.len() as f32).sqrt();
    assert!((0.01..1.0).contains(&rms), "rms {rms}");
}
