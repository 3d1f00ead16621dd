//! `kimi-infer perplexity`: perplexity of a text as llama.cpp's `llama-perplexity` measures
//! it, and the KL divergence from a reference model's saved top-k log-probabilities.
//!
//! Windowing follows `perplexity()` in llama.cpp's tools/perplexity/perplexity.cpp: the
//! whole text is tokenized once (BOS in front when the vocabulary adds one), cut into
//! `n_chunk = tokens / ctx` windows of `ctx` tokens, each evaluated from an empty cache with
//! its first token replaced by BOS (when the vocabulary adds one); the logits at positions
//! `ctx/2 ..= ctx-2` score the tokens after them, `ctx - ctx/2 - 1` per window. The running
//! estimate after each window is `exp(mean NLL)`, and the final standard error is
//! `sqrt((mean(NLL²) - mean(NLL)²) / (count - 1)) * PPL`, as llama.cpp prints it.

use std::io::Write;
use std::path::Path;

use anyhow::Context;
use kimi_gguf::GgufFile;
use kimi_ops::Backend;

use crate::args::PerplexityArgs;
use crate::kld::{KldHeader, KldReader, KldStats, KldSummary, KldWriter, TopK};

pub fn perplexity(a: PerplexityArgs) -> anyhow::Result<()> {
    anyhow::ensure!(a.ctx >= 4, "--ctx must be at least 4 (it is {})", a.ctx);
    anyhow::ensure!(a.batch != Some(0), "--batch must be at least 1");
    anyhow::ensure!(a.chunks != Some(0), "--chunks must be at least 1");
    anyhow::ensure!(a.top_k >= 1, "--top-k must be at least 1");
    let text = std::fs::read_to_string(&a.text)
        .with_context(|| format!("reading --text {}", a.text.display()))?;
    crate::load::with_backend!(a.model, |backend| perplexity_on(backend, &a, &text))
}

/// What one run measured.
struct Measured {
    tokens: usize,
    chunks: usize,
    scored: u64,
    running: Vec<f64>,
    ppl: f64,
    ppl_stderr: f64,
    kld: Option<KldSummary>,
}

fn perplexity_on<B: Backend + 'static>(
    backend: B,
    a: &PerplexityArgs,
    text: &str,
) -> anyhow::Result<()> {
    let loaded = crate::load::load(backend, &a.model, true)?;
    let tokenizer = loaded
        .tokenizer
        .as_ref()
        .context("the model has no tokenizer")?;
    let bos = if adds_bos(&loaded.dir)? {
        Some(tokenizer.bos_id().with_context(|| {
            format!(
                "{} asks for a BOS token but names none",
                loaded.dir.display()
            )
        })?)
    } else {
        None
    };
    let mut tokens = Vec::with_capacity(text.len() / 3);
    tokens.extend(bos);
    tokens.extend(
        tokenizer
            .encode(text, false)
            .with_context(|| format!("tokenizing {}", a.text.display()))?,
    );
    // llama.cpp asks for two windows' worth at least.
    anyhow::ensure!(
        tokens.len() >= 2 * a.ctx,
        "{} tokenizes to {} tokens; --ctx {} needs at least {}",
        a.text.display(),
        tokens.len(),
        a.ctx,
        2 * a.ctx
    );
    let engine = &loaded.engine;
    let vocab = engine.model().vocab_size();
    let mut chunks = tokens.len() / a.ctx;
    if let Some(limit) = a.chunks {
        chunks = chunks.min(limit);
    }
    let windows: Vec<Vec<u32>> = (0..chunks)
        .map(|i| {
            let mut w = tokens[i * a.ctx..(i + 1) * a.ctx].to_vec();
            if let Some(bos) = bos {
                w[0] = bos;
            }
            w
        })
        .collect();
    let header = KldHeader {
        vocab: vocab as u32,
        ctx: a.ctx as u32,
        chunks: chunks as u32,
        top_k: a.top_k.min(vocab) as u32,
        tokens: windows.concat(),
    };
    let mut reference = match &a.kl_divergence {
        Some(path) => Some(open_reference(path, &header)?),
        None => None,
    };
    let mut save = match &a.save_logits {
        Some(path) => Some(KldWriter::create(path, &header)?),
        None => None,
    };

    let first = a.ctx / 2;
    let step = a.batch.unwrap_or(a.ctx).min(a.ctx);
    let bar = crate::progress::count_bar(chunks as u64, "perplexity");
    let mut nll_sum = 0.0f64;
    let mut nll_sq_sum = 0.0f64;
    let mut count = 0u64;
    let mut kld = KldStats::default();
    let mut running = Vec::with_capacity(chunks);
    let mut stdout = std::io::stdout().lock();
    for (i, window) in windows.iter().enumerate() {
        let logits = engine
            .logits(window, step)
            .with_context(|| format!("evaluating window {} of {chunks}", i + 1))?;
        for pos in first..a.ctx - 1 {
            let logprobs = log_softmax(&logits[pos * vocab..(pos + 1) * vocab]);
            let nll = -logprobs[window[pos + 1] as usize];
            nll_sum += nll;
            nll_sq_sum += nll * nll;
            count += 1;
            if let Some(w) = save.as_mut() {
                w.push(&TopK::of(&logprobs, a.top_k))?;
            }
            if let Some(r) = reference.as_mut() {
                kld.push(&r.next()?, &logprobs);
            }
        }
        let estimate = (nll_sum / count as f64).exp();
        running.push(estimate);
        // llama.cpp's `[%d]%.4lf,` stream, flushed so a long run shows its progress.
        write!(stdout, "[{}]{estimate:.4},", i + 1)?;
        stdout.flush()?;
        if let Some(bar) = &bar {
            bar.inc(1);
        }
    }
    writeln!(stdout)?;
    if let Some(bar) = bar {
        bar.finish_and_clear();
    }
    if let Some(w) = save {
        w.finish()?;
    }
    let n = count as f64;
    let mean = nll_sum / n;
    let ppl = mean.exp();
    let variance = nll_sq_sum / n - mean * mean;
    let ppl_stderr = if count > 1 && variance > 0.0 {
        (variance / (n - 1.0)).sqrt() * ppl
    } else {
        0.0
    };
    writeln!(stdout, "Final estimate: PPL = {ppl:.4} +/- {ppl_stderr:.5}")?;
    let kld = reference.is_some().then(|| kld.summary());
    if let Some(k) = &kld {
        writeln!(
            stdout,
            "Mean KLD: {:10.6} ± {:10.6}\nSame top p: {:6.3} ± {:5.3} %",
            k.mean,
            k.mean_stderr,
            100.0 * k.same_top,
            100.0 * k.same_top_stderr
        )?;
    }
    if let Some(path) = &a.save_logits {
        eprintln!(
            "saved the top-{} log-probabilities of {count} tokens to {}",
            header.top_k,
            path.display()
        );
    }
    let measured = Measured {
        tokens: tokens.len(),
        chunks,
        scored: count,
        running,
        ppl,
        ppl_stderr,
        kld,
    };
    if let Some(path) = &a.json {
        write_json(path, a, bos.is_some(), &measured)?;
    }
    Ok(())
}

/// Opens a `--save-logits` file and refuses it unless it was made from the same windows.
fn open_reference(path: &Path, ours: &KldHeader) -> anyhow::Result<KldReader> {
    let reader = KldReader::open(path, ours.top_k as usize)?;
    let theirs = &reader.header;
    let name = path.display();
    anyhow::ensure!(
        theirs.vocab == ours.vocab,
        "{name} was saved with a vocabulary of {} tokens; this model has {}",
        theirs.vocab,
        ours.vocab
    );
    anyhow::ensure!(
        theirs.ctx == ours.ctx,
        "{name} was saved with --ctx {}; this run uses --ctx {}",
        theirs.ctx,
        ours.ctx
    );
    anyhow::ensure!(
        theirs.chunks == ours.chunks,
        "{name} holds {} windows; this run scores {} (pass the same --chunks and text)",
        theirs.chunks,
        ours.chunks
    );
    if let Some(at) = theirs
        .tokens
        .iter()
        .zip(&ours.tokens)
        .position(|(a, b)| a != b)
    {
        anyhow::bail!(
            "{name} was saved from other token ids (the first difference is at token {at}: \
             {} there, {} here): a different text or tokenizer",
            theirs.tokens[at],
            ours.tokens[at]
        );
    }
    Ok(reader)
}

/// Whether llama.cpp would put BOS in front of the text: GGUF's
/// `tokenizer.ggml.add_bos_token` when present, else true only for SentencePiece (`llama`)
/// vocabularies (llama-vocab.cpp's defaults); a checkpoint's tokenizer_config.json
/// `add_bos_token` (Kimi's tokenizers add none).
fn adds_bos(model: &Path) -> anyhow::Result<bool> {
    if crate::load::is_gguf(model) {
        let file =
            GgufFile::open(model).with_context(|| format!("cannot open {}", model.display()))?;
        if let Some(kimi_gguf::Value::Bool(add)) = file.get("tokenizer.ggml.add_bos_token") {
            return Ok(*add);
        }
        return Ok(matches!(
            file.get("tokenizer.ggml.model"),
            Some(kimi_gguf::Value::String(m)) if m == "llama"
        ));
    }
    let config = model.join("tokenizer_config.json");
    let Ok(text) = std::fs::read_to_string(&config) else {
        return Ok(false);
    };
    let json: serde_json::Value =
        serde_json::from_str(&text).with_context(|| format!("parsing {}", config.display()))?;
    Ok(json["add_bos_token"].as_bool().unwrap_or(false))
}

/// Log-softmax of one row of logits, in f64.
fn log_softmax(logits: &[f32]) -> Vec<f64> {
    let max = logits
        .iter()
        .fold(f64::NEG_INFINITY, |m, &v| m.max(v as f64));
    let sum: f64 = logits.iter().map(|&v| (v as f64 - max).exp()).sum();
    let lse = max + sum.ln();
    logits.iter().map(|&v| v as f64 - lse).collect()
}

fn write_json(path: &Path, a: &PerplexityArgs, adds_bos: bool, m: &Measured) -> anyhow::Result<()> {
    let mut json = serde_json::json!({
        "text": a.text.display().to_string(),
        "ctx": a.ctx,
        "batch": a.batch.unwrap_or(a.ctx).min(a.ctx),
        "adds_bos": adds_bos,
        "tokens": m.tokens,
        "chunks": m.chunks,
        "scored_tokens": m.scored,
        "running_ppl": m.running,
        "ppl": m.ppl,
        "ppl_stderr": m.ppl_stderr,
    });
    if let Some(k) = &m.kld {
        json["kl_divergence"] = serde_json::json!({
            "reference": a.kl_divergence.as_ref().map(|p| p.display().to_string()),
            "mean": k.mean,
            "mean_stderr": k.mean_stderr,
            "same_top": k.same_top,
            "same_top_stderr": k.same_top_stderr,
            "tokens": k.count,
        });
    }
    let text = serde_json::to_string_pretty(&json)? + "\n";
    std::fs::write(path, text).with_context(|| format!("writing --json {}", path.display()))
}
