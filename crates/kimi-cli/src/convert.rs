//! `kimi-infer convert`: a Kimi Linear or Kimi K3 checkpoint directory, or a config.json with
//! deterministic random weights, to a llama.cpp GGUF (`kimi-linear` or `kimi-k3`).

use std::path::Path;
use std::time::Instant;

use anyhow::Context;
use kimi_core::{DType, ModelConfig};
use kimi_model::gguf_kimi::{plan_export, ExportOptions, ExtraHparams, GgufQuant};
use kimi_model::{CheckpointSource, RandomWeights, WeightSource};
use kimi_tokenizer::Tokenizer;
use kimi_weights::Checkpoint;

use crate::args::{ConvertArgs, ConvertFormat, QuantArg};

pub fn convert(args: ConvertArgs) -> anyhow::Result<()> {
    if args.to == ConvertFormat::Safetensors {
        let Some(model) = &args.model else {
            anyhow::bail!("--to safetensors converts a llama GGUF file: give it with --model");
        };
        let dtype = match args.quant {
            QuantArg::F32 => DType::F32,
            QuantArg::F16 => DType::F16,
            QuantArg::Bf16 => DType::BF16,
            other => anyhow::bail!("--to safetensors writes f32, f16 or bf16, not {other:?}"),
        };
        return crate::convert_hf::gguf_to_checkpoint(model, &args.out, dtype);
    }
    let quant = match args.quant {
        QuantArg::F32 => GgufQuant::F32,
        QuantArg::F16 => GgufQuant::F16,
        QuantArg::Bf16 => GgufQuant::Bf16,
        QuantArg::Q8_0 => GgufQuant::Q8_0,
        QuantArg::Q4KM => GgufQuant::Q4KM,
    };
    match (&args.model, &args.random_config) {
        (_, Some(config_path)) => {
            let text = std::fs::read_to_string(config_path)
                .with_context(|| format!("cannot read {}", config_path.display()))?;
            let config = ModelConfig::from_json_str(&text).with_context(|| {
                format!("cannot parse the model config {}", config_path.display())
            })?;
            check_fits(&config, &config_path.display().to_string())?;
            let name = config_path
                .file_stem()
                .map(|n| n.to_string_lossy().trim_end_matches(".config").to_string())
                .unwrap_or_else(|| "kimi-linear".into());
            let opts = ExportOptions {
                quant,
                name: format!("{name} (random weights)"),
                extra: extra_hparams(config_path)?,
                extra_metadata: placeholder_vocab(&config),
            };
            // The weights `bench --random-config` runs (bf16, seed 0).
            let source = RandomWeights {
                dtype: DType::BF16,
                seed: 0,
            };
            write(
                &source,
                &config,
                &opts,
                &args.out,
                &config_path.display().to_string(),
            )
        }
        (Some(model), None) => {
            let dir = &crate::hub::resolve_model(model, false)?;
            let ckpt = Checkpoint::open(dir)
                .with_context(|| format!("cannot open the checkpoint in {}", dir.display()))?;
            // A hub model's snapshot folder is named by its commit: use the repository's name.
            let hub_name =
                crate::hub::repo_name(model).and_then(|r| r.rsplit('/').next().map(str::to_string));
            let name = hub_name
                .or_else(|| {
                    dir.canonicalize()
                        .ok()
                        .and_then(|d| d.file_name().map(|n| n.to_string_lossy().into_owned()))
                })
                .unwrap_or_else(|| "kimi-linear".into());
            let extra_metadata = tokenizer_metadata(dir, ckpt.config().vocab_size);
            let opts = ExportOptions {
                quant,
                name,
                extra: extra_hparams(&dir.join("config.json"))?,
                extra_metadata,
            };
            // Hub names also from the layouts transformers' save_pretrained writes.
            let source = CheckpointSource::new(&ckpt)?;
            write(
                &source,
                ckpt.config(),
                &opts,
                &args.out,
                &dir.display().to_string(),
            )
        }
        (None, None) => anyhow::bail!("convert needs --model DIR or --random-config CONFIG.json"),
    }
}

fn write(
    source: &dyn WeightSource,
    config: &ModelConfig,
    opts: &ExportOptions,
    out: &Path,
    what: &str,
) -> anyhow::Result<()> {
    let plan =
        plan_export(source, config, opts).with_context(|| format!("cannot convert {what}"))?;
    for w in &plan.warnings {
        eprintln!("warning: {w}");
    }
    let total = plan.tensors.len();
    let width = total.to_string().len();
    let start = Instant::now();
    // A terminal gets a bar (fallback notes still print above it); a log gets a line each.
    let bar = crate::progress::count_bar(total as u64, "converting");
    let written = plan.write(source, out, &mut |i, t| {
        let note = t
            .fallback
            .as_deref()
            .map(|f| format!("  ({f})"))
            .unwrap_or_default();
        match &bar {
            Some(bar) => {
                if !note.is_empty() {
                    bar.println(format!("{}{note}", t.name));
                }
                bar.set_position(i as u64);
                bar.set_message(t.name.clone());
            }
            None => eprintln!(
                "[{:>width$}/{total}] {:<32} {:<6} {:?}{note}",
                i + 1,
                t.name,
                t.ggml_type.name(),
                t.shape
            ),
        }
    });
    if let Some(bar) = bar {
        bar.finish_and_clear();
    }
    written.with_context(|| format!("cannot write {}", out.display()))?;
    let bytes = std::fs::metadata(out).map(|m| m.len()).unwrap_or(0);
    eprintln!(
        "wrote {} ({total} tensors, {:.1} MiB) in {:.1} s",
        out.display(),
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

/// A byte-level stand-in vocabulary for a model without a tokenizer: llama.cpp refuses a
/// GGUF without `tokenizer.ggml.model`, and with it both llama.cpp and kimi-infer can tokenize
/// text (byte by byte) and stop at the config's eos id.
fn placeholder_vocab(config: &ModelConfig) -> Vec<(String, kimi_gguf::Value)> {
    let tokenizer = Tokenizer::byte_level_placeholder(
        config.vocab_size,
        config.bos_token_id,
        config.eos_token_ids.first().copied(),
        config.pad_token_id,
    );
    match tokenizer.and_then(|t| t.gguf_metadata(config.vocab_size)) {
        Some(meta) => {
            eprintln!(
                "tokenizer: byte-level stand-in vocabulary (ids 0-255 are bytes, {} special ids)",
                config.vocab_size - 256
            );
            meta
        }
        None => {
            eprintln!(
                "note: no tokenizer is written: a stand-in vocabulary needs at least 256 ids \
                 (llama.cpp will not load the file)"
            );
            Vec::new()
        }
    }
}

/// `rope_theta` and the legacy `head_dim` of `config.json` (at `path`), which llama.cpp's
/// converter writes but kimi-infer's config does not keep.
fn extra_hparams(path: &Path) -> anyhow::Result<ExtraHparams> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let outer: serde_json::Value =
        serde_json::from_str(&text).with_context(|| format!("parsing {}", path.display()))?;
    // Kimi K3's wrapper nests the text model's config.
    let json = outer.get("text_config").unwrap_or(&outer);
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

/// Tensors are converted one at a time: the largest (the embedding, or a layer's experts
/// stacked into one GGUF tensor), read in bf16 and widened to f32 at once, must fit in the
/// memory left.
fn check_fits(config: &ModelConfig, what: &str) -> anyhow::Result<()> {
    let d = config.hidden_size as u64;
    let experts = config.moe.as_ref().map_or(0, |m| {
        (m.num_experts as u64).saturating_mul(m.expert_intermediate_size as u64)
    });
    let largest = [
        config.vocab_size as u64,
        config.intermediate_size as u64,
        experts,
    ]
    .into_iter()
    .max()
    .unwrap_or(0)
    .saturating_mul(d);
    let need = largest.saturating_mul(6);
    if let Some(room) = crate::memory::HostMemory::read().usable() {
        anyhow::ensure!(
            need <= room,
            "cannot convert {what}: its largest tensor ({largest} values) needs {} while it \
             is converted, more than the {} of memory left",
            crate::cache_plan::gib(need),
            crate::cache_plan::gib(room)
        );
    }
    Ok(())
}
