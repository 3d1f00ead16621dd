//! `kimi-infer quantize` against the binary: the checkpoint it writes loads back (through the
//! same compressed-tensors reader as llm-compressor's checkpoints) with every weight within
//! half a quantization step, the rest unchanged; GPTQ and AWQ calibrate on text and keep the
//! model's function (AWQ's folded scales included); bad requests are refused.

use std::path::{Path, PathBuf};
use std::process::Command;

use kimi_core::DType;
use kimi_model::{CheckpointSource, WeightSource};
use kimi_weights::Checkpoint;

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../fixtures/kimi-linear")
        .join(name)
}

fn quantize(model: &Path, out: &Path, extra: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_kimi-infer"))
        .args(["quantize", "--model"])
        .arg(model)
        .arg("--out")
        .arg(out)
        .args(extra)
        .output()
        .expect("binary runs")
}

fn values(dtype: DType, bytes: &[u8], n: usize) -> Vec<f32> {
    match dtype {
        DType::F32 => bytes
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
            .collect(),
        DType::BF16 => bytes
            .chunks_exact(2)
            .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect(),
        q => {
            let mut out = vec![0f32; n];
            assert!(kimi_core::qblocks::dequantize(q, bytes, &mut out), "{q}");
            out
        }
    }
}

#[test]
fn quantized_checkpoints_load_back_within_half_a_step() {
    for (name, bits, group, levels, packed) in [
        ("hub-f32-mla-first", "4", "8", 15.0, DType::F32), // groups of 8: widened, exact
        ("hub-bf16-released-like", "4", "16", 15.0, DType::F32),
        // 8-bit is symmetric: steps of max|w| / 127.5, i.e. a range of 255 steps.
        ("native-f32-short", "8", "-1", 127.5, DType::Q8Z),
        ("native-f32-short", "4", "32", 15.0, DType::Q4Z),
    ] {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("q");
        let o = quantize(
            &fixture(name),
            &out,
            &["--bits", bits, "--group-size", group],
        );
        assert!(
            o.status.success(),
            "{name}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
        let (src, dst) = (
            Checkpoint::open(&fixture(name)).unwrap(),
            Checkpoint::open(&out).unwrap(),
        );
        let (a, b) = (
            CheckpointSource::new(&src).unwrap(),
            CheckpointSource::new(&dst).unwrap(),
        );
        let mut quantized = 0;
        let mut seen = std::collections::HashSet::new();
        for weight in a.names() {
            let shape = a.shape(&weight).unwrap();
            let (ta, ba) = a.load(&weight, &shape).unwrap();
            let (tb, bb) = b.load(&weight, &shape).unwrap();
            let n = shape.iter().product();
            let (va, vb) = (values(ta, &ba, n), values(tb, &bb, n));
            if ta == tb && ba == bb {
                continue;
            }
            quantized += 1;
            seen.insert(tb);
            let cols = *shape.last().unwrap();
            for (ra, rb) in va.chunks(cols).zip(vb.chunks(cols)) {
                let lo = ra.iter().fold(0f32, |m, v| m.min(*v));
                let hi = ra.iter().fold(0f32, |m, v| m.max(*v));
                // A group's step is at most the row's range over the levels (plus the
                // bf16 rounding of its scale).
                let range = if levels > 16.0 { hi.max(-lo) } else { hi - lo };
                let tol = range / levels * 0.55 + 1e-6;
                for (x, y) in ra.iter().zip(rb) {
                    assert!(
                        (x - y).abs() <= tol,
                        "{name} {weight}: {y} for {x} (tolerance {tol})"
                    );
                }
            }
        }
        assert!(quantized >= 10, "{name}: only {quantized} matrices changed");
        assert!(seen.contains(&packed), "{name}: {seen:?}");
        // Every tensor is accounted for: the model loads and runs.
        let model = kimi_model::KimiLinear::load(kimi_cpu::CpuBackend::new(), &dst);
        assert!(model.is_ok(), "{name}: {}", model.err().unwrap());
    }
}

#[test]
fn bad_requests_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("q");
    let o = quantize(&fixture("native-f32-short"), &out, &["--bits", "3"]);
    assert!(!o.status.success() && String::from_utf8_lossy(&o.stderr).contains("--bits 3"));
    let o = quantize(&fixture("native-f32-short"), &out, &["--method", "gptq"]);
    assert!(
        !o.status.success() && String::from_utf8_lossy(&o.stderr).contains("--calibration-text")
    );
    let o = quantize(&fixture("native-f32-short"), &out, &["--method", "spqr"]);
    assert!(!o.status.success() && String::from_utf8_lossy(&o.stderr).contains("spqr"));
    let quantized = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/quantized/ct-w8a16");
    let o = quantize(&quantized, &out, &[]);
    assert!(
        !o.status.success() && String::from_utf8_lossy(&o.stderr).contains("already quantized")
    );
    std::fs::create_dir_all(&out).unwrap();
    std::fs::write(out.join("x"), "keep").unwrap();
    let o = quantize(&fixture("native-f32-short"), &out, &[]);
    assert!(!o.status.success() && String::from_utf8_lossy(&o.stderr).contains("not empty"));
    assert_eq!(std::fs::read_to_string(out.join("x")).unwrap(), "keep");
}

/// A copy of a fixture with a byte-level tiktoken vocabulary (ids 0–255 are the bytes, as
/// the fixtures' 256-row embeddings have them), so that calibration can read text.
fn with_byte_vocabulary(name: &str) -> tempfile::TempDir {
    const B64: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let dir = tempfile::tempdir().unwrap();
    for f in ["config.json", "model.safetensors"] {
        std::fs::copy(fixture(name).join(f), dir.path().join(f)).unwrap();
    }
    let lines: String = (0..=255u8)
        .map(|b| {
            let (c0, c1) = (B64[(b >> 2) as usize], B64[((b & 3) << 4) as usize]);
            format!("{}{}== {b}\n", c0 as char, c1 as char)
        })
        .collect();
    std::fs::write(dir.path().join("tiktoken.model"), lines).unwrap();
    dir
}

/// Logits of `ids` from a checkpoint directory, on the CPU in f32.
fn logits(dir: &Path, ids: &[u32]) -> Vec<f32> {
    let ckpt = Checkpoint::open(dir).unwrap();
    let backend = kimi_cpu::CpuBackend::with_quant_matmul(kimi_cpu::QuantMatmul::F32);
    let loaded = kimi_model::registry::load_checkpoint(backend, &ckpt).unwrap();
    kimi_engine::Engine::new(loaded.model)
        .logits(ids, ids.len())
        .unwrap()
}

fn relative_error(a: &[f32], b: &[f32]) -> f64 {
    let num: f64 = a.iter().zip(b).map(|(x, y)| ((x - y) as f64).powi(2)).sum();
    let den: f64 = a.iter().map(|x| (*x as f64).powi(2)).sum();
    (num / den).sqrt()
}

/// GPTQ and AWQ through the binary on a Kimi Linear fixture (KDA, MLA, MoE with a shared
/// expert): every matrix gets its inputs' statistics (the routed experts theirs), the
/// checkpoints load and their logits stay as near the float model's as rounding to nearest
/// keeps them. (This random bf16 model turns any rounding into a large change of its logits:
/// 8-bit rounding moves them by about 30 %. That AWQ's folding itself changes nothing is
/// checked in f32, without rounding, by the unit test `folded_scales_keep_the_logits`.)
#[test]
fn calibrated_methods_keep_the_model() {
    let model = with_byte_vocabulary("hub-bf16-released-like");
    let text = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../README.md");
    let ids: Vec<u32> = b"The engine loads real checkpoints and serves them."
        .iter()
        .map(|&b| b as u32)
        .collect();
    let reference = logits(model.path(), &ids);
    let mut errors = std::collections::HashMap::new();
    for method in ["rtn", "gptq", "awq"] {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("q");
        let o = quantize(
            model.path(),
            &out,
            &[
                "--method",
                method,
                "--bits",
                "8",
                "--group-size",
                "16",
                "--calibration-text",
                text.to_str().unwrap(),
                "--calibration-tokens",
                "1024",
                "--calibration-ctx",
                "128",
            ],
        );
        let stderr = String::from_utf8_lossy(&o.stderr);
        assert!(o.status.success(), "{method}: {stderr}");
        assert!(
            !stderr.contains("never multiplied"),
            "{method}: a matrix had no calibration inputs: {stderr}"
        );
        if method == "awq" {
            assert!(stderr.contains("scale groups"), "{stderr}");
        }
        std::fs::copy(
            model.path().join("tiktoken.model"),
            out.join("tiktoken.model"),
        )
        .ok();
        let e = relative_error(&reference, &logits(&out, &ids));
        assert!(e.is_finite() && e > 0.0, "{method}: {e}");
        errors.insert(method, e);
    }
    let rtn = errors["rtn"];
    for method in ["gptq", "awq"] {
        assert!(
            errors[method] < 3.0 * rtn,
            "{method}: relative logit error {} against rounding's {rtn}",
            errors[method]
        );
    }
}

fn files(dir: &Path) -> Vec<(String, Vec<u8>)> {
    let mut v: Vec<(String, Vec<u8>)> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| {
            let e = e.unwrap();
            (
                e.file_name().to_string_lossy().into_owned(),
                std::fs::read(e.path()).unwrap(),
            )
        })
        .collect();
    v.sort();
    v
}

/// Small shards (whole layers each, with an index), and an interrupted run finished by
/// `--resume`: the shards it had written are kept, the rest redone, and the result is the
/// same bytes as an uninterrupted run. Without `--resume`, or with other arguments, the
/// directory is refused and left as it was.
#[test]
fn interrupted_runs_resume() {
    let model = with_byte_vocabulary("hub-bf16-released-like");
    let text = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../README.md");
    let dir = tempfile::tempdir().unwrap();
    let args = |extra: &[&str]| -> Vec<String> {
        let mut a: Vec<String> = [
            "--method",
            "gptq",
            "--group-size",
            "16",
            "--max-shard-gb",
            "0.00003",
            "--calibration-text",
            text.to_str().unwrap(),
            "--calibration-tokens",
            "256",
            "--calibration-ctx",
            "64",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        a.extend(extra.iter().map(|s| s.to_string()));
        a
    };
    let run = |out: &Path, extra: &[&str]| {
        let a = args(extra);
        let a: Vec<&str> = a.iter().map(String::as_str).collect();
        quantize(model.path(), out, &a)
    };
    let whole = dir.path().join("whole");
    let o = run(&whole, &[]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let shards: Vec<String> = files(&whole)
        .into_iter()
        .map(|(n, _)| n)
        .filter(|n| n.ends_with(".safetensors"))
        .collect();
    assert!(shards.len() >= 3, "{shards:?}");
    assert!(whole.join("model.safetensors.index.json").is_file());
    let model_out = kimi_model::KimiLinear::load(
        kimi_cpu::CpuBackend::new(),
        &Checkpoint::open(&whole).unwrap(),
    );
    assert!(model_out.is_ok(), "{}", model_out.err().unwrap());

    // An interruption: the last shard half written, no index, no config.
    let cut = dir.path().join("cut");
    std::fs::create_dir_all(&cut).unwrap();
    for (name, bytes) in files(&whole) {
        if name == "config.json" || name == "model.safetensors.index.json" {
            continue;
        }
        if Some(&name) == shards.last() {
            std::fs::write(
                cut.join(format!("{name}.partial")),
                &bytes[..bytes.len() / 2],
            )
            .unwrap();
        } else {
            std::fs::write(cut.join(&name), bytes).unwrap();
        }
    }
    let before = files(&cut);
    let o = run(&cut, &[]);
    assert!(!o.status.success() && String::from_utf8_lossy(&o.stderr).contains("--resume"));
    let o = run(&cut, &["--resume", "--damp", "0.05"]);
    assert!(!o.status.success() && String::from_utf8_lossy(&o.stderr).contains("other arguments"));
    assert_eq!(files(&cut), before, "a refused run changed the directory");
    let o = run(&cut, &["--resume"]);
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{stderr}");
    assert!(
        stderr.contains(&format!(
            "{} of {} shards already written",
            shards.len() - 1,
            shards.len()
        )),
        "{stderr}"
    );
    let finished: Vec<(String, Vec<u8>)> = files(&cut)
        .into_iter()
        .filter(|(n, _)| !n.ends_with(".partial"))
        .collect();
    assert_eq!(
        finished,
        files(&whole),
        "the resumed run differs from the whole one"
    );
}

/// GPTQ and AWQ on a Kimi K3 fixture (names under `language_model.`, MXFP4 experts kept as
/// they are, a vision projector the text model never runs, rounded to nearest and named):
/// the checkpoints load and run; AWQ's scales fold into the input, post-attention, MLA and
/// latent norms (the router compensates; SiTU's up halves keep theirs).
#[test]
fn gptq_on_kimi_k3() {
    let k3 = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/kimi-k3/k3-tiny-7l");
    let text = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../README.md");
    let dir = tempfile::tempdir().unwrap();
    let calibration = [
        "--group-size",
        "16",
        "--calibration-text",
        text.to_str().unwrap(),
        "--calibration-tokens",
        "256",
        "--calibration-ctx",
        "64",
    ];
    let out = dir.path().join("gptq");
    let o = quantize(
        &k3,
        &out,
        &[&["--method", "gptq"][..], &calibration[..]].concat(),
    );
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{stderr}");
    assert!(stderr.contains("mm_projector"), "{stderr}");
    let ckpt = Checkpoint::open(&out).unwrap();
    assert!(ckpt
        .tensor_names()
        .iter()
        .any(|n| n.starts_with("language_model.") && n.ends_with(".weight_packed")));
    let backend = kimi_cpu::CpuBackend::with_quant_matmul(kimi_cpu::QuantMatmul::F32);
    let loaded = kimi_model::registry::load_checkpoint(backend, &ckpt).unwrap();
    let logits = kimi_engine::Engine::new(loaded.model)
        .logits(&[1, 2, 3, 4], 4)
        .unwrap();
    assert!(logits.iter().all(|v| v.is_finite()));
    // AWQ: every group's search lowers its rounded output error (the folds themselves keep
    // the function bit for bit: kimi-model's tests/awq_groups.rs), and the result runs.
    let out = dir.path().join("awq");
    let o = quantize(
        &k3,
        &out,
        &[&["--method", "awq"][..], &calibration[..]].concat(),
    );
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{stderr}");
    let share: f64 = stderr
        .split("output error after scaling ")
        .nth(1)
        .and_then(|r| r.split(" %").next())
        .and_then(|p| p.trim().parse().ok())
        .unwrap_or_else(|| panic!("no search summary in {stderr}"));
    assert!(share < 100.0, "{stderr}");
    let ckpt = Checkpoint::open(&out).unwrap();
    let backend = kimi_cpu::CpuBackend::with_quant_matmul(kimi_cpu::QuantMatmul::F32);
    let loaded = kimi_model::registry::load_checkpoint(backend, &ckpt).unwrap();
    let logits = kimi_engine::Engine::new(loaded.model)
        .logits(&[1, 2, 3, 4], 4)
        .unwrap();
    assert!(logits.iter().all(|v| v.is_finite()));
}

/// `--sequential`: the first layer sees the float model's inputs in both modes, so its
/// matrices come out the same; later layers calibrate on the quantized layers before them,
/// so some of theirs differ. The result loads and runs.
#[test]
fn sequential_gptq_calibrates_on_the_quantized_layers() {
    let model = with_byte_vocabulary("hub-bf16-released-like");
    let text = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../README.md");
    let dir = tempfile::tempdir().unwrap();
    let common = [
        "--method",
        "gptq",
        "--group-size",
        "16",
        "--calibration-text",
        text.to_str().unwrap(),
        "--calibration-tokens",
        "512",
        "--calibration-ctx",
        "64",
    ];
    let (one, seq) = (dir.path().join("one"), dir.path().join("seq"));
    let o = quantize(model.path(), &one, &common);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let o = quantize(
        model.path(),
        &seq,
        &[&common[..], &["--sequential"]].concat(),
    );
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(
        o.status.success() && stderr.contains("layer by layer"),
        "{stderr}"
    );
    let (a, b) = (
        Checkpoint::open(&one).unwrap(),
        Checkpoint::open(&seq).unwrap(),
    );
    let (mut first_same, mut later_differ) = (0, 0);
    for name in a.tensor_names() {
        if !name.ends_with(".weight_packed") {
            continue;
        }
        let same = a.get(name).unwrap().bytes == b.get(name).unwrap().bytes;
        if name.starts_with("model.layers.0.") {
            assert!(same, "{name}: layer 0 differs");
            first_same += 1;
        } else if !same {
            later_differ += 1;
        }
    }
    assert!(
        first_same > 0 && later_differ > 0,
        "{first_same} {later_differ}"
    );
    let backend = kimi_cpu::CpuBackend::new();
    assert!(kimi_model::registry::load_checkpoint(backend, &b).is_ok());
    let o = quantize(
        model.path(),
        &dir.path().join("x"),
        &["--method", "rtn", "--sequential"],
    );
    assert!(!o.status.success() && String::from_utf8_lossy(&o.stderr).contains("--sequential"));
}
