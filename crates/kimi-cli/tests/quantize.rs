//! `kimi-infer quantize` against the binary: the checkpoint it writes loads back (through the
//! same compressed-tensors reader as llm-compressor's checkpoints) with every weight within
//! half a quantization step, the rest unchanged, and bad requests are refused.

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
    assert!(!o.status.success() && String::from_utf8_lossy(&o.stderr).contains("rtn"));
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
