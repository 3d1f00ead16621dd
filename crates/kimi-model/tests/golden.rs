//! The model against Hugging Face transformers' float64 reference logits.
//!
//! Fixtures come from `scripts/make_fixtures.py` (tiny random checkpoints in the hub layout,
//! made with `KimiLinearForCausalLM` of transformers 5.17); see `fixtures/kimi-linear/README.md`.
//! Every fixture is checked in three feed modes — whole-prompt prefill, 16-token chunks
//! through the caches and token-by-token decode — and by a greedy continuation.

use std::path::{Path, PathBuf};

use kimi_cpu::CpuBackend;
use kimi_model::{Batch, ForwardOptions, KimiLinear, SeqCache};
use kimi_ops::{KdaMode, MlaMode, Segment};
use kimi_weights::Checkpoint;
use serde_json::Value;

/// f32 CPU arithmetic against a float64 reference.
const TOLERANCE: f64 = 1e-4;

fn fixtures_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/kimi-linear")
}

fn fixture_dirs() -> Vec<PathBuf> {
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(fixtures_root())
        .expect("fixtures/kimi-linear exists")
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.join("reference.json").exists())
        .collect();
    dirs.sort();
    assert!(
        dirs.len() >= 6,
        "expected the committed fixtures, found {}",
        dirs.len()
    );
    dirs
}

/// Reads a little-endian float64 `.npy` matrix.
fn read_npy_f64(path: &Path) -> (Vec<usize>, Vec<f64>) {
    let bytes = std::fs::read(path).expect("npy readable");
    assert_eq!(&bytes[..6], b"\x93NUMPY");
    let (header_len, start) = match bytes[6] {
        1 => (u16::from_le_bytes([bytes[8], bytes[9]]) as usize, 10),
        _ => (
            u32::from_le_bytes([bytes[8], bytes[9], bytes[10], bytes[11]]) as usize,
            12,
        ),
    };
    let header = std::str::from_utf8(&bytes[start..start + header_len]).expect("ascii header");
    assert!(
        header.contains("'<f8'") && header.contains("'fortran_order': False"),
        "{header}"
    );
    let shape_text = header
        .split("'shape': (")
        .nth(1)
        .and_then(|s| s.split(')').next())
        .expect("shape");
    let shape: Vec<usize> = shape_text
        .split(',')
        .filter_map(|s| s.trim().parse().ok())
        .collect();
    let data = bytes[start + header_len..]
        .chunks_exact(8)
        .map(|c| f64::from_le_bytes(c.try_into().expect("8 bytes")))
        .collect();
    (shape, data)
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .expect("id list")
        .iter()
        .map(|x| x.as_u64().expect("id") as u32)
        .collect()
}

struct Fixture {
    name: String,
    model: KimiLinear<CpuBackend>,
    prompt: Vec<u32>,
    logits: Vec<f64>,
    vocab: usize,
    reference: Value,
}

fn load(dir: &Path) -> Fixture {
    let name = dir.file_name().unwrap().to_string_lossy().into_owned();
    let ckpt = Checkpoint::open(dir).unwrap_or_else(|e| panic!("{name}: {e}"));
    let model =
        KimiLinear::load(CpuBackend::new(), &ckpt).unwrap_or_else(|e| panic!("{name}: {e}"));
    let reference: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("reference.json")).unwrap())
            .unwrap();
    let prompt = ids(&reference["prompt_ids"]);
    let (shape, logits) = read_npy_f64(&dir.join("logits.npy"));
    assert_eq!(shape[0], prompt.len(), "{name}: logits rows");
    Fixture {
        name,
        vocab: shape[1],
        model,
        prompt,
        logits,
        reference,
    }
}

/// Logits of every position, feeding `step` tokens per forward pass through one cache.
fn run(model: &KimiLinear<CpuBackend>, ids: &[u32], step: usize, opts: ForwardOptions) -> Vec<f32> {
    let mut cache: SeqCache<CpuBackend> = model.new_cache().unwrap();
    let mut out = Vec::new();
    for chunk in ids.chunks(step) {
        let batch = Batch {
            tokens: chunk.to_vec(),
            segments: vec![Segment {
                start: 0,
                len: chunk.len(),
            }],
            logits_rows: (0..chunk.len()).collect(),
        };
        out.extend(
            model
                .forward(&batch, &mut [&mut cache], opts)
                .unwrap()
                .logits,
        );
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

fn check_modes(modes: &[(&str, usize, ForwardOptions)]) {
    for dir in fixture_dirs() {
        let f = load(&dir);
        for (label, step, opts) in modes {
            let step = if *step == 0 { f.prompt.len() } else { *step };
            let got = run(&f.model, &f.prompt, step, *opts);
            let err = rel_err(&got, &f.logits);
            eprintln!("{:<28} {label:<22} rel err {err:.2e}", f.name);
            assert!(
                err <= TOLERANCE,
                "{}: {label}: relative error {err:.3e} > {TOLERANCE:e}",
                f.name
            );
        }
        assert_eq!(f.vocab, f.model.config().vocab_size);
    }
}

#[test]
fn prefill_matches_reference() {
    check_modes(&[
        ("prefill", 0, ForwardOptions::default()),
        (
            "prefill recurrent",
            0,
            ForwardOptions {
                kda_mode: KdaMode::Recurrent,
                mla_mode: MlaMode::Absorbed,
            },
        ),
    ]);
}

#[test]
fn chunked_step_16_matches_reference() {
    check_modes(&[("step 16", 16, ForwardOptions::default())]);
}

#[test]
fn decode_step_1_matches_reference() {
    check_modes(&[
        ("step 1", 1, ForwardOptions::default()),
        (
            "step 1 expanded",
            1,
            ForwardOptions {
                kda_mode: KdaMode::Chunked,
                mla_mode: MlaMode::Expanded,
            },
        ),
    ]);
}

#[test]
fn greedy_continuation_matches_reference() {
    for dir in fixture_dirs() {
        let f = load(&dir);
        let greedy = &f.reference["greedy"];
        let mut ids = ids(&greedy["prompt_ids"]);
        let want = self::ids(&greedy["new_tokens"]);
        let mut cache = f.model.new_cache().unwrap();
        let mut feed = ids.clone();
        let mut got = Vec::new();
        while got.len() < want.len() {
            let batch = Batch {
                tokens: feed.clone(),
                segments: vec![Segment {
                    start: 0,
                    len: feed.len(),
                }],
                logits_rows: vec![feed.len() - 1],
            };
            let logits = f
                .model
                .forward(&batch, &mut [&mut cache], ForwardOptions::default())
                .unwrap()
                .logits;
            let next = logits
                .iter()
                .enumerate()
                .max_by(|a, b| a.1.total_cmp(b.1).then(b.0.cmp(&a.0)))
                .map(|(i, _)| i as u32)
                .unwrap();
            got.push(next);
            ids.push(next);
            feed = vec![next];
        }
        assert_eq!(got, want, "{}: greedy tokens", f.name);
    }
}
