//! Kimi Linear through llama.cpp's GGUF layout: every committed fixture is converted
//! (`gguf_kimi::plan_export`, what `kimi-infer convert` runs) and loaded back
//! (`KimiLinear::load_gguf`), then compared with the safetensors model and with the
//! transformers float64 reference logits.
//!
//! Checks, for every fixture and type:
//! * loading is exact: the GGUF model equals the f32 model of the file's own (dequantized)
//!   weights (bound 1e-6, measured 0), so every layout change is undone correctly;
//! * f32 round trip: equal to the safetensors model (bound 1e-6, measured 0; `A_log` comes
//!   back from `-exp(A_log)` within an ulp) and the same config;
//! * against the float64 reference (relative L2 over all prefill logits), when the experts
//!   chosen are the same as with the original weights. Top-k routing is discontinuous: a
//!   rounding that flips one near-tied choice moves that token's logits by O(1) (it happens
//!   on hub-f32-sharded even with f16), which measures the fixture, not the rounding.
//!   - f16: weights rounded to 11 bits (rms 2.8e-4 relative), amplified ~4x by the
//!     fixtures: measured 1.05e-3 / 1.13e-3 on the f32 fixtures (bound 2e-3); bf16
//!     fixtures convert exactly (measured ≤ 1.8e-6).
//!   - q8_0: ~0.5 % rms per weight where rows are whole 32-blocks: measured 2.8e-2
//!     (native-f32-short; bound 5e-2).
//!   - q4_k_m: the fixtures' rows are never whole 256-blocks (llama.cpp's fallbacks Q5_0/F16
//!     apply) and their routing flips; a random 256-wide model with every expert active
//!     tests real Q4_K/Q6_K against its f32 weights: weights 3.5e-2, logits 3.2e-1 with a
//!     gain of 8.7x measured by f16 rounding on the same model (bound 2 x gain x weights).
//!     The same model on the integer kernels (int8 activations, `QuantMatmul::Int8`): 3.3e-2
//!     from its own weights in f32, inside the error the weights' rounding causes (bound
//!     gain x weights). The loading checks run on exact f32 products.

use std::path::{Path, PathBuf};

use kimi_cpu::{CpuBackend, QuantMatmul};
use kimi_gguf::{GgmlType, GgufFile};
use kimi_model::gguf_kimi::{plan_export, ExportOptions, ExtraHparams, GgufQuant};
use kimi_model::{
    Batch, CausalLm, CheckpointSource, ForwardOptions, KimiLinear, RandomWeights, WeightSource,
};
use kimi_ops::Segment;
use kimi_weights::Checkpoint;

fn fixture_dirs() -> Vec<PathBuf> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/kimi-linear");
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(root)
        .expect("fixtures/kimi-linear exists")
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.join("reference.json").exists())
        .collect();
    dirs.sort();
    assert!(dirs.len() >= 6, "expected the committed fixtures");
    dirs
}

/// Little-endian float64 `.npy` matrix data (the fixtures' `logits.npy`).
fn read_npy_f64(path: &Path) -> Vec<f64> {
    let bytes = std::fs::read(path).expect("npy readable");
    let (header_len, start) = match bytes[6] {
        1 => (u16::from_le_bytes([bytes[8], bytes[9]]) as usize, 10),
        _ => (
            u32::from_le_bytes([bytes[8], bytes[9], bytes[10], bytes[11]]) as usize,
            12,
        ),
    };
    bytes[start + header_len..]
        .chunks_exact(8)
        .map(|c| f64::from_le_bytes(c.try_into().expect("8 bytes")))
        .collect()
}

fn prompt(dir: &Path) -> Vec<u32> {
    let text = std::fs::read_to_string(dir.join("reference.json")).expect("reference.json");
    let v: serde_json::Value = serde_json::from_str(&text).expect("json");
    v["prompt_ids"]
        .as_array()
        .expect("ids")
        .iter()
        .map(|x| x.as_u64().expect("id") as u32)
        .collect()
}

/// Logits of every position of one prefill.
fn logits(model: &KimiLinear<CpuBackend>, ids: &[u32]) -> Vec<f32> {
    run(model, ids).0
}

/// Logits and, per layer, how often each expert was chosen.
fn run(model: &KimiLinear<CpuBackend>, ids: &[u32]) -> (Vec<f32>, Vec<Vec<u32>>) {
    let (mut pool, mut cache) = model.single_cache(ids.len()).expect("cache");
    let batch = Batch {
        tokens: ids.to_vec(),
        segments: vec![Segment {
            start: 0,
            len: ids.len(),
        }],
        logits_rows: (0..ids.len()).collect(),
        sampling: None,
    };
    let out = model
        .forward(
            &batch,
            &mut pool,
            &mut [&mut cache],
            ForwardOptions::default(),
        )
        .expect("forward");
    (out.logits, out.expert_counts)
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

fn options(quant: GgufQuant) -> ExportOptions {
    ExportOptions {
        quant,
        name: "fixture".into(),
        extra: ExtraHparams::default(),
        extra_metadata: Vec::new(),
    }
}

/// Converts `source` and opens the result.
fn convert(
    source: &dyn WeightSource,
    config: &kimi_core::ModelConfig,
    quant: GgufQuant,
    path: &Path,
) -> GgufFile {
    let plan = plan_export(source, config, &options(quant)).expect("plan");
    plan.write(source, path, &mut |_, _| {}).expect("write");
    GgufFile::open(path).expect("open")
}

fn temp(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("kimi-gguf-kimi-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    dir.join(name)
}

/// Relative error bound against the reference per type (see the module comment).
fn bound(quant: GgufQuant) -> f64 {
    match quant {
        GgufQuant::F32 => 1e-4,
        GgufQuant::F16 | GgufQuant::Bf16 => 2e-3,
        GgufQuant::Q8_0 => 5e-2,
        GgufQuant::Q4KM => 2e-1,
    }
}

/// Every weight of `inner` as f32: the model of exactly the numbers a quantized file holds.
struct Dequantized<'a>(&'a dyn WeightSource);

impl WeightSource for Dequantized<'_> {
    fn contains(&self, name: &str) -> bool {
        self.0.contains(name)
    }
    fn load(
        &self,
        name: &str,
        shape: &[usize],
    ) -> kimi_model::Result<(kimi_core::DType, std::borrow::Cow<'_, [u8]>)> {
        let (dtype, bytes) = self.0.load(name, shape)?;
        let ty = match dtype {
            kimi_core::DType::F32 => GgmlType::F32,
            kimi_core::DType::F16 => GgmlType::F16,
            kimi_core::DType::BF16 => GgmlType::BF16,
            kimi_core::DType::Q8_0 => GgmlType::Q8_0,
            kimi_core::DType::Q5_0 => GgmlType::Q5_0,
            kimi_core::DType::Q5_1 => GgmlType::Q5_1,
            kimi_core::DType::Q4_K => GgmlType::Q4_K,
            kimi_core::DType::Q5_K => GgmlType::Q5_K,
            kimi_core::DType::Q6_K => GgmlType::Q6_K,
            kimi_core::DType::MXFP4 => GgmlType::MXFP4,
            other => panic!("{name}: unexpected {other}"),
        };
        let values = kimi_gguf::dequantize(ty, &bytes, shape.iter().product()).expect("dequantize");
        let bytes = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        Ok((kimi_core::DType::F32, std::borrow::Cow::Owned(bytes)))
    }
    fn check_all_used(&self, used: &std::collections::HashSet<String>) -> kimi_model::Result<()> {
        self.0.check_all_used(used)
    }
    fn shape(&self, name: &str) -> Option<Vec<usize>> {
        self.0.shape(name)
    }
}

#[test]
fn fixtures_through_gguf_match_the_reference() {
    let quants = [
        GgufQuant::F32,
        GgufQuant::F16,
        GgufQuant::Q8_0,
        GgufQuant::Q4KM,
    ];
    let mut failures = Vec::new();
    for dir in fixture_dirs() {
        let name = dir.file_name().unwrap().to_string_lossy().into_owned();
        let ckpt = Checkpoint::open(&dir).expect("checkpoint");
        let ids = prompt(&dir);
        let reference = read_npy_f64(&dir.join("logits.npy"));
        let direct = KimiLinear::load(exact_backend(), &ckpt).expect("safetensors model");
        let (direct_logits, direct_experts) = run(&direct, &ids);
        let direct_logits: Vec<f64> = direct_logits.iter().map(|&x| x as f64).collect();
        // Hub names, whichever layout transformers stored them in.
        let source = CheckpointSource::new(&ckpt).expect("checkpoint layout");
        for quant in quants {
            let path = temp(&format!("{name}-{quant:?}.gguf"));
            let file = convert(&source, ckpt.config(), quant, &path);
            let model = KimiLinear::load_gguf(exact_backend(), &file)
                .unwrap_or_else(|e| panic!("{name} {quant:?}: {e}"));
            let (got, experts) = run(&model, &ids);
            // The same numbers in f32: isolates loading (layouts, slicing) from rounding.
            let config = kimi_model::gguf_kimi::config_from_gguf(&file).expect("config");
            let gguf = kimi_model::gguf_kimi::KimiGguf::new(&file, &config);
            let exact = KimiLinear::load_from(exact_backend(), config.clone(), &Dequantized(&gguf))
                .expect("dequantized model");
            let exact_logits: Vec<f64> = logits(&exact, &ids).iter().map(|&x| x as f64).collect();
            let err = rel_err(&got, &reference);
            let vs_direct = rel_err(&got, &direct_logits);
            let vs_exact = rel_err(&got, &exact_logits);
            // Top-k routing is discontinuous: a rounding that flips one token's expert choice
            // changes its logits by O(1), which says nothing about the rounding itself.
            let same_routing = experts == direct_experts;
            eprintln!(
                "{name:<24} {quant:<5?} vs reference {err:.2e}  vs safetensors {vs_direct:.2e}  \
                 vs its own weights in f32 {vs_exact:.2e}{}",
                if same_routing {
                    ""
                } else {
                    "  (expert choices changed)"
                }
            );
            if vs_exact > 1e-6 || (same_routing && err > bound(quant)) {
                failures.push(format!("{name} {quant:?}: {err:.3e} / {vs_exact:.3e}"));
            }
            if quant == GgufQuant::F32 {
                assert!(vs_direct <= 1e-6, "{name}: f32 round trip {vs_direct:.3e}");
                // A GGUF's tensors carry their own types: the declared dtype is not kept.
                let declared = kimi_core::ModelConfig {
                    dtype: None,
                    ..direct.config().clone()
                };
                assert_eq!(config, declared, "{name}: config round trip");
            }
            std::fs::remove_file(&path).ok();
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

/// Relative L2 error of all weights of `file` against the same tensors of `exact`.
fn weights_rel_err(file: &GgufFile, exact: &GgufFile) -> f64 {
    let (mut num, mut den) = (0.0f64, 0.0f64);
    for info in exact.tensors() {
        let want = exact
            .tensor(&info.name)
            .and_then(|t| t.to_f32())
            .expect("f32");
        let got = file
            .tensor(&info.name)
            .and_then(|t| t.to_f32())
            .expect("tensor");
        for (g, w) in got.iter().zip(&want) {
            num += (*g as f64 - *w as f64).powi(2);
            den += (*w as f64).powi(2);
        }
    }
    (num / den).sqrt()
}

/// A random model shaped so that rows are whole 256-blocks: Q4_K_M uses real Q4_K/Q6_K
/// here. Compared with the same weights in f32.
#[test]
fn q4_k_m_on_block_shaped_weights() {
    let ckpt = Checkpoint::open(fixture_dirs()[0].as_path()).expect("checkpoint");
    let mut config = ckpt.config().clone();
    config.hidden_size = 256;
    config.intermediate_size = 256;
    config.vocab_size = 512;
    if let Some(k) = config.kda.as_mut() {
        k.head_dim = 256;
    }
    if let Some(m) = config.moe.as_mut() {
        m.expert_intermediate_size = 256;
        // Every expert chosen: no top-k discontinuity, so the error is the rounding's alone.
        m.top_k = m.num_experts;
        m.topk_group = m.num_expert_groups;
    }
    let source = RandomWeights {
        dtype: kimi_core::DType::F32,
        seed: 7,
    };
    let reference = KimiLinear::load_from(CpuBackend::new(), config.clone(), &source).expect("f32");
    let ids: Vec<u32> = (0..40).map(|i| (i * 37 % 512) as u32).collect();
    let want: Vec<f64> = logits(&reference, &ids).iter().map(|&x| x as f64).collect();
    let path = temp("random-q4km.gguf");
    let file = convert(&source, &config, GgufQuant::Q4KM, &path);
    let types: Vec<GgmlType> = file.tensors().iter().map(|t| t.ggml_type).collect();
    let f32_file = convert(&source, &config, GgufQuant::F32, &temp("random-f32.gguf"));
    let weight_err = weights_rel_err(&file, &f32_file);
    // The model's own error amplification, measured with f16 rounding (small, so linear).
    let f16_file = convert(&source, &config, GgufQuant::F16, &temp("random-f16.gguf"));
    let f16_model = KimiLinear::load_gguf(CpuBackend::new(), &f16_file).expect("f16 model");
    let gain = rel_err(&logits(&f16_model, &ids), &want) / weights_rel_err(&f16_file, &f32_file);
    assert!(types.contains(&GgmlType::Q4_K) && types.contains(&GgmlType::Q6_K));
    let model = KimiLinear::load_gguf(exact_backend(), &file).expect("q4_k_m model");
    let got = logits(&model, &ids);
    let gguf_config = kimi_model::gguf_kimi::config_from_gguf(&file).expect("config");
    let gguf = kimi_model::gguf_kimi::KimiGguf::new(&file, &gguf_config);
    let exact = KimiLinear::load_from(exact_backend(), gguf_config.clone(), &Dequantized(&gguf))
        .expect("dequantized");
    let exact: Vec<f64> = logits(&exact, &ids).iter().map(|&x| x as f64).collect();
    let vs_exact = rel_err(&got, &exact);
    let err = rel_err(&got, &want);
    eprintln!(
        "random 256-wide model q4_k_m: weights {weight_err:.2e}, logits vs f32 weights {err:.2e} \
         (f16 gain {gain:.1}x), vs its own weights {vs_exact:.2e}"
    );
    assert!(vs_exact <= 1e-5, "q4_k_m loading {vs_exact:.3e}");
    // The integer kernels (activations rounded to int8 per 32 values, as llama.cpp does;
    // the interleaved VNNI kernels where the CPU has them) stay well inside the error the
    // weights' own rounding causes.
    let int8 = KimiLinear::load_gguf(CpuBackend::with_quant_matmul(QuantMatmul::Int8), &file)
        .expect("q4_k_m model, int8 kernels");
    let int8_err = rel_err(&logits(&int8, &ids), &exact);
    eprintln!("  int8 kernels vs its own weights in f32 {int8_err:.2e}");
    assert!(
        int8_err <= gain * weight_err,
        "q4_k_m int8 kernels {int8_err:.3e}"
    );
    // Linear propagation of the weight error through the measured gain, with 2x margin for
    // the larger perturbation.
    assert!(err <= 2.0 * gain * weight_err, "q4_k_m {err:.3e}");
    std::fs::remove_file(&path).ok();
}

/// Copies `file` with `edit` applied to each tensor (`None` drops it).
fn rewrite(file: &GgufFile, edit: impl Fn(&str, Vec<usize>) -> Option<Vec<usize>>) -> GgufFile {
    let mut w = kimi_gguf::GgufWriter::new();
    for (k, v) in file.metadata() {
        w.add_metadata(k.clone(), v.clone()).expect("metadata");
    }
    for info in file.tensors() {
        let t = file.tensor(&info.name).expect("tensor");
        let Some(shape) = edit(&info.name, info.shape_outer_first()) else {
            continue;
        };
        w.add_tensor(info.name.clone(), &shape, info.ggml_type, t.bytes.to_vec())
            .expect("tensor");
    }
    GgufFile::from_vec(w.to_bytes().expect("bytes")).expect("parse")
}

#[test]
fn broken_kimi_ggufs_name_the_tensor_file_and_shapes() {
    let dir = &fixture_dirs()[0];
    let ckpt = Checkpoint::open(dir).expect("checkpoint");
    let path = temp("broken-base.gguf");
    let file = convert(&ckpt, ckpt.config(), GgufQuant::F32, &path);
    let err = |f: &GgufFile| match KimiLinear::load_gguf(CpuBackend::new(), f) {
        Ok(_) => panic!("a broken file loaded"),
        Err(e) => e.to_string(),
    };

    let missing = rewrite(&file, |n, s| {
        (n != "blk.0.ssm_conv1d_k.weight").then_some(s)
    });
    let msg = err(&missing);
    assert!(
        msg.contains("<memory>") && msg.contains("`blk.0.ssm_conv1d_k.weight` is missing"),
        "{msg}"
    );
    assert!(msg.contains("ggml ne [4, 1, 36, 1]"), "{msg}");

    let swapped = rewrite(&file, |n, s| {
        Some(if n == "blk.0.attn_q.weight" {
            s.into_iter().rev().collect()
        } else {
            s
        })
    });
    let msg = err(&swapped);
    assert!(
        msg.contains("`blk.0.attn_q.weight` has shape [48, 36]")
            && msg.contains("calls for [36, 48]"),
        "{msg}"
    );

    let extra = rewrite(&file, |_, s| Some(s));
    let mut w = kimi_gguf::GgufWriter::new();
    for (k, v) in extra.metadata() {
        w.add_metadata(k.clone(), v.clone()).expect("metadata");
    }
    w.add_tensor("blk.0.attn_kv_b.weight", &[1], GgmlType::F32, vec![0u8; 4])
        .expect("tensor");
    let bare = GgufFile::from_vec(w.to_bytes().expect("bytes")).expect("parse");
    assert!(
        err(&bare).contains("is missing"),
        "an empty file fails on a named tensor"
    );
    std::fs::remove_file(&path).ok();
}

/// Copies `file` with the metadata value at `key` replaced.
fn with_meta(file: &GgufFile, key: &str, value: kimi_gguf::Value) -> GgufFile {
    let mut w = kimi_gguf::GgufWriter::new();
    for (k, v) in file.metadata() {
        let v = if k == key { value.clone() } else { v.clone() };
        w.add_metadata(k.clone(), v).expect("metadata");
    }
    for info in file.tensors() {
        let t = file.tensor(&info.name).expect("tensor");
        w.add_tensor(
            info.name.clone(),
            &info.shape_outer_first(),
            info.ggml_type,
            t.bytes.to_vec(),
        )
        .expect("tensor");
    }
    GgufFile::from_vec(w.to_bytes().expect("bytes")).expect("parse")
}

/// NaN, negative and inconsistent metadata load as errors naming the file and the key,
/// instead of a model whose every logit is NaN.
#[test]
fn bad_kimi_gguf_metadata_names_the_file_and_key() {
    use kimi_gguf::Value;
    let dir = &fixture_dirs()[0];
    let ckpt = Checkpoint::open(dir).expect("checkpoint");
    let path = temp("bad-meta.gguf");
    let file = convert(&ckpt, ckpt.config(), GgufQuant::F32, &path);
    assert!(KimiLinear::load_gguf(CpuBackend::new(), &file).is_ok());
    let experts = file
        .get_u64("kimi-linear.expert_count")
        .expect("a MoE fixture");
    for (key, value) in [
        (
            "kimi-linear.attention.layer_norm_rms_epsilon",
            Value::F32(f32::NAN),
        ),
        (
            "kimi-linear.attention.layer_norm_rms_epsilon",
            Value::F32(-1e-6),
        ),
        ("kimi-linear.expert_weights_scale", Value::F32(f32::NAN)),
        ("kimi-linear.expert_weights_scale", Value::F32(-2.5)),
        (
            "kimi-linear.expert_used_count",
            Value::U32(experts as u32 + 1),
        ),
    ] {
        let shown = format!("{value:?}");
        let spoiled = with_meta(&file, key, value);
        let msg = match KimiLinear::load_gguf(CpuBackend::new(), &spoiled) {
            Ok(_) => panic!("{key} = {shown} loaded"),
            Err(e) => e.to_string(),
        };
        assert!(
            msg.starts_with("<memory>: ") && msg.contains(key),
            "{key} = {shown}: {msg}"
        );
    }
    std::fs::remove_file(&path).ok();
}

fn k3_fixture_dirs() -> Vec<PathBuf> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/kimi-k3");
    let dirs: Vec<PathBuf> = ["k3-tiny-7l", "k3-tiny-5l-b2"]
        .iter()
        .map(|n| root.join(n))
        .collect();
    assert!(dirs.iter().all(|d| d.join("logits.npy").exists()));
    dirs
}

/// Kimi K3 through llama.cpp's `kimi-k3` layout (names of `src/models/kimi-k3.cpp`): both K3
/// fixtures are converted at every type and loaded back.
/// * The routed experts are `MXFP4` tensors whose bytes are the checkpoint's planes
///   repacked block for block, at every type (the rest follows the type).
/// * Loading is exact: the GGUF model equals the f32 model of the file's own numbers
///   (bound 1e-6), so the folded AttnRes scores, `ssm_a` without its padding, the K3 gates
///   and the latent projections are all undone correctly.
/// * f32 and bf16 (the fixtures are bf16 with f32 `A_log`/`dt_bias`/convolutions, all kept):
///   equal to the safetensors model (bound 1e-6) with the same config.
/// * Against the float64 reference where the routing did not change: bf16 like f32
///   (1e-4), q8_0 5e-2; q4_k_m falls back to Q5_0/Q5_1/F16 on these 48-wide rows (bound 2e-1).
#[test]
fn k3_fixtures_through_gguf_match_the_checkpoint_and_reference() {
    let quants = [
        GgufQuant::F32,
        GgufQuant::Bf16,
        GgufQuant::Q8_0,
        GgufQuant::Q4KM,
    ];
    let mut failures = Vec::new();
    for dir in k3_fixture_dirs() {
        let name = dir.file_name().unwrap().to_string_lossy().into_owned();
        let ckpt = Checkpoint::open(&dir).expect("checkpoint");
        let config = ckpt.config().clone();
        let moe = config.moe.clone().expect("K3 fixtures have experts");
        let ids = prompt(&dir);
        let reference = read_npy_f64(&dir.join("logits.npy"));
        let direct = KimiLinear::load(exact_backend(), &ckpt).expect("safetensors model");
        let (direct_logits, direct_experts) = run(&direct, &ids);
        let direct_logits: Vec<f64> = direct_logits.iter().map(|&x| x as f64).collect();
        let source = CheckpointSource::new(&ckpt).expect("checkpoint layout");
        for quant in quants {
            let path = temp(&format!("{name}-{quant:?}.gguf"));
            let file = convert(&source, &config, quant, &path);
            assert_eq!(file.get_str("general.architecture").unwrap(), "kimi-k3");
            let layer = config
                .layers
                .iter()
                .position(|l| l.ffn == kimi_core::config::Ffn::Moe)
                .expect("a MoE layer");
            let experts = file
                .tensor(&format!("blk.{layer}.ffn_down_exps.weight"))
                .expect("stacked experts");
            assert_eq!(experts.info.ggml_type, GgmlType::MXFP4, "{name} {quant:?}");
            let latent = moe.latent.expect("LatentMoE").width;
            let (rows, cols) = (latent, moe.expert_intermediate_size);
            let per_expert = rows * cols / 32 * 17;
            for e in [0, moe.num_experts - 1] {
                let base =
                    format!("language_model.model.layers.{layer}.block_sparse_moe.experts.{e}.w2");
                let (_, codes) = source
                    .load(&format!("{base}.weight_packed"), &[rows, cols / 2])
                    .expect("codes");
                let (_, scales) = source
                    .load(&format!("{base}.weight_scale"), &[rows, cols / 32])
                    .expect("scales");
                let mut want = vec![0u8; per_expert];
                for ((out, c), sc) in want
                    .chunks_exact_mut(cols / 32 * 17)
                    .zip(codes.chunks_exact(cols / 2))
                    .zip(scales.chunks_exact(cols / 32))
                {
                    kimi_gguf::mxfp4::from_planes(c, sc, out);
                }
                assert!(
                    experts.bytes[e * per_expert..(e + 1) * per_expert] == want[..],
                    "{name} {quant:?}: expert {e}'s MXFP4 blocks differ from its planes"
                );
            }
            let model = KimiLinear::load_gguf(exact_backend(), &file)
                .unwrap_or_else(|e| panic!("{name} {quant:?}: {e}"));
            let (got, experts) = run(&model, &ids);
            let read = kimi_model::gguf_kimi::config_from_gguf(&file).expect("config");
            let gguf = kimi_model::gguf_kimi::KimiGguf::new(&file, &read);
            let exact = KimiLinear::load_from(exact_backend(), read.clone(), &Dequantized(&gguf))
                .expect("dequantized model");
            let exact_logits: Vec<f64> = logits(&exact, &ids).iter().map(|&x| x as f64).collect();
            let err = rel_err(&got, &reference);
            let vs_direct = rel_err(&got, &direct_logits);
            let vs_exact = rel_err(&got, &exact_logits);
            let same_routing = experts == direct_experts;
            eprintln!(
                "{name:<14} {quant:<5?} vs reference {err:.2e}  vs safetensors {vs_direct:.2e}  \
                 vs its own weights in f32 {vs_exact:.2e}{}",
                if same_routing {
                    ""
                } else {
                    "  (expert choices changed)"
                }
            );
            let bound = match quant {
                GgufQuant::F32 | GgufQuant::Bf16 => 1e-4,
                other => bound(other),
            };
            if vs_exact > 1e-6 || (same_routing && err > bound) {
                failures.push(format!("{name} {quant:?}: {err:.3e} / {vs_exact:.3e}"));
            }
            if matches!(quant, GgufQuant::F32 | GgufQuant::Bf16) {
                assert!(
                    vs_direct <= 1e-6,
                    "{name} {quant:?}: round trip {vs_direct:.3e}"
                );
                let declared = kimi_core::ModelConfig {
                    dtype: None,
                    ..config.clone()
                };
                assert_eq!(read, declared, "{name}: config round trip");
            }
            std::fs::remove_file(&path).ok();
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

/// A K3 GGUF written again from itself (`convert` of a kimi-k3 file's weights) keeps its
/// experts' blocks and its logits; missing required K3 keys and tensors fail by name.
#[test]
fn k3_gguf_rewrites_itself_and_names_what_is_missing() {
    use kimi_gguf::Value;
    let dir = &k3_fixture_dirs()[0];
    let ckpt = Checkpoint::open(dir).expect("checkpoint");
    let source = CheckpointSource::new(&ckpt).expect("checkpoint layout");
    let path = temp("k3-first.gguf");
    let file = convert(&source, ckpt.config(), GgufQuant::Bf16, &path);
    let config = kimi_model::gguf_kimi::config_from_gguf(&file).expect("config");
    let gguf = kimi_model::gguf_kimi::KimiGguf::new(&file, &config);
    let again_path = temp("k3-again.gguf");
    let again = convert(&gguf, &config, GgufQuant::Bf16, &again_path);
    for info in file.tensors() {
        let a = file.tensor(&info.name).expect("tensor");
        let b = again.tensor(&info.name).expect("the same tensors");
        assert_eq!(a.info.ggml_type, b.info.ggml_type, "{}", info.name);
        if info.ggml_type == GgmlType::MXFP4 || info.name.contains("res_score") {
            assert!(a.bytes == b.bytes, "{} changed", info.name);
        }
    }
    let ids = prompt(dir);
    let first = KimiLinear::load_gguf(exact_backend(), &file).expect("first");
    let second = KimiLinear::load_gguf(exact_backend(), &again).expect("second");
    let (a, b) = (logits(&first, &ids), logits(&second, &ids));
    let a64: Vec<f64> = a.iter().map(|&x| x as f64).collect();
    assert!(rel_err(&b, &a64) <= 1e-6, "{:.3e}", rel_err(&b, &a64));

    let err = |f: &GgufFile| match KimiLinear::load_gguf(CpuBackend::new(), f) {
        Ok(_) => panic!("a broken file loaded"),
        Err(e) => e.to_string(),
    };
    for key in [
        "kimi-k3.attn_res.block_size",
        "kimi-k3.activation.situ_beta",
        "kimi-k3.activation.situ_linear_beta",
    ] {
        let mut w = kimi_gguf::GgufWriter::new();
        for (k, v) in file.metadata().iter().filter(|(k, _)| k.as_str() != key) {
            w.add_metadata(k.clone(), v.clone()).expect("metadata");
        }
        for info in file.tensors() {
            let t = file.tensor(&info.name).expect("tensor");
            w.add_tensor(
                info.name.clone(),
                &info.shape_outer_first(),
                info.ggml_type,
                t.bytes.to_vec(),
            )
            .expect("tensor");
        }
        let spoiled = GgufFile::from_vec(w.to_bytes().expect("bytes")).expect("parse");
        let msg = err(&spoiled);
        assert!(
            msg.starts_with("<memory>: ") && msg.contains(key),
            "{key}: {msg}"
        );
    }
    let nan = with_meta(&file, "kimi-k3.activation.situ_beta", Value::F32(f32::NAN));
    assert!(err(&nan).contains("situ_beta"), "{}", err(&nan));
    let missing = rewrite(&file, |n, s| {
        (n != "blk.1.ffn_routed_up.weight").then_some(s)
    });
    let msg = err(&missing);
    assert!(
        msg.contains("`blk.1.ffn_routed_up.weight` is missing"),
        "{msg}"
    );
    std::fs::remove_file(&path).ok();
    std::fs::remove_file(&again_path).ok();
}

/// Products of the dequantized weights in f32: loading checks compare exact numbers (the
/// default integer kernels round activations, which is checked on its own).
fn exact_backend() -> CpuBackend {
    CpuBackend::with_quant_matmul(QuantMatmul::F32)
}
