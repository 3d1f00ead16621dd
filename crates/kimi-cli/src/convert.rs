//! `kimi-infer convert`: a Kimi Linear checkpoint directory to a llama.cpp GGUF.

use std::path::Path;
use std::time::Instant;

use anyhow::Context;
use kimi_model::gguf_kimi::{plan_export, ExportOptions, ExtraHparams, GgufQuant};
use kimi_tokenizer::Tokenizer;
use kimi_weights::Checkpoint;

use crate::args::{ConvertArgs, QuantArg};

pub fn convert(args: ConvertArgs) -> anyhow::Result<()> {
    let dir = &args.model;
    let ckpt = Checkpoint::open(dir)
        .with_context(|| format!("cannot open the checkpoint in {}", dir.display()))?;
    let quant = match args.quant {
        QuantArg::F32 => GgufQuant::F32,
        QuantArg::F16 => GgufQuant::F16,
        QuantArg::Bf16 => GgufQuant::Bf16,
        QuantArg::Q8_0 => GgufQuant::Q8_0,
        QuantArg::Q4KM => GgufQuant::Q4KM,
    };
    let name = dir
        .canonicalize()
        .ok()
        .and_then(|d| d.file_name().map(|n| n.to_string_lossy().into_owned()))
        .unwrap_or_else(|| "kimi-linear".into());
    let extra_metadata = tokenizer_metadata(dir, ckpt.config().vocab_size);
    let opts = ExportOptions {
        quant,
        name,
        extra: extra_hparams(dir)?,
        extra_metadata,
    };
    let plan = plan_export(&ckpt, ckpt.config(), &opts)
        .with_context(|| format!("cannot convert {}", dir.display()))?;
    for w in &plan.warnings {
        eprintln!("warning: {w}");
    }
    let total = plan.tensors.len();
    let width = total.to_string().len();
    let start = Instant::now();
    plan.write(&ckpt, &args.out, &mut |i, t| {
        let note = t
            .fallback
            .as_deref()
            .map(|f| format!("  ({f})"))
            .unwrap_or_default();
        eprintln!(
            "[{:>width$}/{total}] {:<32} {:<6} {:?}{note}",
            i + 1,
            t.name,
            t.ggml_type.name(),
            t.shape
        );
    })
    .with_context(|| format!("cannot write {}", args.out.display()))?;
    let bytes = std::fs::metadata(&args.out).map(|m| m.len()).unwrap_or(0);
    eprintln!(
        "wrote {} ({total} tensors, {:.1} MiB) in {:.1} s",
        args.out.display(),
        bytes as f64 / (1 << 20) as f64,
        start.elapsed().as_secs_f64()
    );
    Ok(())
}

/// The checkpoint's tokenizer as `tokenizer.ggml.*` metadata, or none (with a note).
fn tokenizer_metadata(dir: &Path, vocab_size: usize) -> Vec<(String, kimi_gguf::Value)> {
    match Tokenizer::from_dir(dir) {
        Ok(t) => match t.gguf_metadata(vocab_size) {
            Some(meta) => {
                eprintln!("tokenizer: Kimi tiktoken vocabulary written as gpt2 BPE (pre kimi-k2)");
                meta
            }
            None => {
                eprintln!(
                    "note: no tokenizer is written: only Kimi's tiktoken.model vocabulary can be \
                     converted to GGUF yet"
                );
                Vec::new()
            }
        },
        Err(e) => {
            eprintln!(
                "note: no tokenizer is written ({e}); the GGUF carries special-token ids only"
            );
            Vec::new()
        }
    }
}

/// `rope_theta` and the legacy `head_dim` of `config.json`, which llama.cpp's converter
/// writes but kimi-infer's config does not keep.
fn extra_hparams(dir: &Path) -> anyhow::Result<ExtraHparams> {
    let path = dir.join("config.json");
    let text =
        std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
    let json: serde_json::Value =
        serde_json::from_str(&text).with_context(|| format!("parsing {}", path.display()))?;
    let rope_theta = json
        .get("rope_theta")
        .or_else(|| {
            json.get("rope_parameters")
                .and_then(|r| r.get("rope_theta"))
        })
        .and_then(|v| v.as_f64())
        .map(|v| v as f32);
    let head_dim = json
        .get("head_dim")
        .and_then(|v| v.as_u64())
        .and_then(|v| u32::try_from(v).ok());
    Ok(ExtraHparams {
        rope_theta,
        head_dim,
    })
}
