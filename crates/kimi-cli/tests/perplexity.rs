//! `kimi-infer perplexity` on the demo model over a slice of the corpus: determinism, the
//! figure against one computed here from `kimi-infer logits`, KL against itself, and the
//! refusal of a saved file made from other windows.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use serde_json::Value;

const CTX: usize = 128;
const CHUNKS: usize = 3;

fn bin() -> Command {
    Command::new(env!("CARGO_BIN_EXE_kimi-infer"))
}

fn repo(path: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .join(path)
}

/// The demo GGUF and the corpus, or `None` (the test is skipped) when either is absent.
fn inputs() -> Option<(PathBuf, PathBuf)> {
    let model = repo("models/SmolLM2-135M-Instruct.Q4_1.gguf");
    let corpus = repo("models/corpus/alice29.txt");
    for (path, script) in [
        (&model, "scripts/fetch_demo_model.sh"),
        (&corpus, "scripts/fetch_corpus.sh"),
    ] {
        if !path.exists() {
            eprintln!("SKIPPED: {} is absent ({script})", path.display());
            return None;
        }
    }
    Some((model, corpus))
}

/// The corpus's first `bytes` bytes (it is ASCII) in a file of `dir`.
fn slice(corpus: &Path, dir: &Path, name: &str, skip: usize, bytes: usize) -> PathBuf {
    let text = std::fs::read_to_string(corpus).unwrap();
    let path = dir.join(name);
    std::fs::write(&path, &text[skip..skip + bytes]).unwrap();
    path
}

fn perplexity(model: &Path, text: &Path, extra: &[&str]) -> Output {
    bin()
        .args(["perplexity", "--model"])
        .arg(model)
        .arg("--text")
        .arg(text)
        .args(["--ctx", &CTX.to_string(), "--chunks", &CHUNKS.to_string()])
        .args(extra)
        .output()
        .expect("binary runs")
}

fn ok(o: &Output) -> String {
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn read_json(path: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

/// A little-endian f32 `.npy` as f64.
fn read_npy_f32(path: &Path) -> Vec<f64> {
    let bytes = std::fs::read(path).unwrap();
    assert_eq!(&bytes[..6], b"\x93NUMPY");
    let header_len = u16::from_le_bytes([bytes[8], bytes[9]]) as usize;
    bytes[10 + header_len..]
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()) as f64)
        .collect()
}

/// The PPL of the first `CHUNKS` windows, from `kimi-infer logits` of each window and
/// llama.cpp's rule (score positions ctx/2 ..= ctx-2), all in f64 here.
fn ppl_from_logits(model: &Path, text: &Path, dir: &Path) -> f64 {
    let gguf = kimi_gguf::GgufFile::open(model).unwrap();
    let tokenizer = kimi_tokenizer::Tokenizer::from_gguf(&gguf).unwrap();
    // SmolLM2's GGUF says tokenizer.ggml.add_bos_token = false: no BOS anywhere.
    assert_eq!(
        gguf.get("tokenizer.ggml.add_bos_token"),
        Some(&kimi_gguf::Value::Bool(false))
    );
    let tokens = tokenizer
        .encode(&std::fs::read_to_string(text).unwrap(), false)
        .unwrap();
    assert!(tokens.len() >= CHUNKS * CTX, "{} tokens", tokens.len());
    let vocab = tokenizer.vocab_size();
    let (mut nll, mut count) = (0.0f64, 0usize);
    for window in tokens.chunks_exact(CTX).take(CHUNKS) {
        let ids: Vec<String> = window.iter().map(|t| t.to_string()).collect();
        let out = dir.join("window.npy");
        let o = bin()
            .args(["logits", "--model"])
            .arg(model)
            .args(["--ids", &ids.join(","), "--out"])
            .arg(&out)
            .output()
            .unwrap();
        ok(&o);
        let logits = read_npy_f32(&out);
        assert_eq!(logits.len(), CTX * vocab);
        for pos in CTX / 2..CTX - 1 {
            let row = &logits[pos * vocab..(pos + 1) * vocab];
            let max = row.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let log_sum = max + row.iter().map(|v| (v - max).exp()).sum::<f64>().ln();
            nll += log_sum - row[window[pos + 1] as usize];
            count += 1;
        }
    }
    (nll / count as f64).exp()
}

#[test]
fn perplexity_is_deterministic_and_matches_the_logits() {
    let Some((model, corpus)) = inputs() else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let text = slice(&corpus, dir.path(), "alice.txt", 0, 4000);
    let (json_a, json_b) = (dir.path().join("a.json"), dir.path().join("b.json"));
    let first = ok(&perplexity(
        &model,
        &text,
        &["--json", json_a.to_str().unwrap()],
    ));
    // A window fed 32 tokens at a time must give the same figure as one fed whole.
    let second = ok(&perplexity(
        &model,
        &text,
        &["--json", json_b.to_str().unwrap(), "--batch", "32"],
    ));
    assert_eq!(first, second, "the running estimates differ");
    assert!(first.starts_with("[1]"), "{first}");
    assert!(first.contains("[3]"), "{first}");
    assert!(first.contains("Final estimate: PPL = "), "{first}");
    let (a, b) = (read_json(&json_a), read_json(&json_b));
    let ppl = a["ppl"].as_f64().unwrap();
    assert!(ppl.is_finite() && ppl > 1.0, "{ppl}");
    assert!(a["ppl_stderr"].as_f64().unwrap() > 0.0);
    assert_eq!(a["chunks"], CHUNKS);
    assert_eq!(a["scored_tokens"], CHUNKS * (CTX - CTX / 2 - 1));
    assert_eq!(a["running_ppl"].as_array().unwrap().len(), CHUNKS);
    assert_eq!(a["ppl"], b["ppl"], "two runs differ");

    let expected = ppl_from_logits(&model, &text, dir.path());
    let relative = (ppl - expected).abs() / expected;
    assert!(
        relative < 1e-6,
        "perplexity {ppl}, from the logits {expected}"
    );
}

#[test]
fn kl_divergence_against_its_own_logits_is_zero_and_other_windows_are_refused() {
    let Some((model, corpus)) = inputs() else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let text = slice(&corpus, dir.path(), "alice.txt", 0, 4000);
    let saved = dir.path().join("base.kld");
    let saved_arg = saved.to_str().unwrap();
    let out = ok(&perplexity(&model, &text, &["--save-logits", saved_arg]));
    assert!(out.contains("Final estimate"), "{out}");

    let json = dir.path().join("kld.json");
    ok(&perplexity(
        &model,
        &text,
        &[
            "--kl-divergence",
            saved_arg,
            "--json",
            json.to_str().unwrap(),
        ],
    ));
    let kld = &read_json(&json)["kl_divergence"];
    assert!(kld["mean"].as_f64().unwrap().abs() < 1e-9, "{kld}");
    assert_eq!(kld["same_top"].as_f64(), Some(1.0), "{kld}");
    assert_eq!(kld["tokens"], CHUNKS * (CTX - CTX / 2 - 1));

    // Another text, another --ctx: both refused, naming the file.
    let other = slice(&corpus, dir.path(), "later.txt", 20_000, 4000);
    let refused = perplexity(&model, &other, &["--kl-divergence", saved_arg]);
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(!refused.status.success());
    assert!(
        stderr.contains(saved_arg) && stderr.contains("other token ids"),
        "{stderr}"
    );
    let refused = bin()
        .args(["perplexity", "--model"])
        .arg(&model)
        .arg("--text")
        .arg(&text)
        .args(["--ctx", "64", "--kl-divergence", saved_arg])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(!refused.status.success());
    assert!(
        stderr.contains(saved_arg) && stderr.contains("--ctx 128"),
        "{stderr}"
    );
}

#[test]
fn a_missing_text_is_named() {
    let o = bin()
        .args(["perplexity", "--text", "/nonexistent/corpus.txt"])
        .output()
        .unwrap();
    assert!(!o.status.success());
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(stderr.contains("/nonexistent/corpus.txt"), "{stderr}");
}

/// `convert --to safetensors` turns the demo GGUF into a `LlamaForCausalLM` checkpoint (Q/K
/// rows back in `rotate_half` order, tokenizer.json from the GGUF's vocabulary) whose f32
/// weights are the GGUF's dequantized values: the checkpoint tokenizes the text to the same
/// ids and scores it with the same perplexity (f32 products on both), and its bf16 form
/// within 1 %.
#[test]
fn converted_checkpoint_scores_as_the_gguf() {
    let Some((model, corpus)) = inputs() else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let text = slice(&corpus, dir.path(), "alice.txt", 0, 4000);
    let final_ppl = |out: &str| -> f64 {
        let line = out
            .lines()
            .find(|l| l.starts_with("Final estimate"))
            .unwrap();
        line.split_whitespace().nth(4).unwrap().parse().unwrap()
    };
    let gguf = final_ppl(&ok(&perplexity(&model, &text, &[])));
    for (quant, tolerance) in [("f32", 1e-4), ("bf16", 1e-2)] {
        let out = dir.path().join(quant);
        ok(&bin()
            .args([
                "convert",
                "--to",
                "safetensors",
                "--quant",
                quant,
                "--model",
            ])
            .arg(&model)
            .arg("--out")
            .arg(&out)
            .output()
            .unwrap());
        let config = read_json(&out.join("config.json"));
        assert_eq!(config["model_type"], "llama");
        assert_eq!(config["tie_word_embeddings"], true);
        let ours = kimi_tokenizer::Tokenizer::from_dir(&out).unwrap();
        let theirs =
            kimi_tokenizer::Tokenizer::from_gguf(&kimi_gguf::GgufFile::open(&model).unwrap())
                .unwrap();
        let sample = std::fs::read_to_string(&text).unwrap();
        assert_eq!(
            ours.encode(&sample, false).unwrap(),
            theirs.encode(&sample, false).unwrap()
        );
        let converted = final_ppl(&ok(&perplexity(&out, &text, &[])));
        let rel = (converted - gguf).abs() / gguf;
        assert!(
            rel < tolerance,
            "{quant}: {converted} against the GGUF's {gguf}"
        );
    }
}
