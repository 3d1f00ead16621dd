//! `kimi-infer convert --to safetensors`: a llama GGUF file to a Hugging Face
//! `LlamaForCausalLM` checkpoint, the direction of llama.cpp's `convert_hf_to_gguf.py`
//! undone: tensors renamed ([`kimi_model::llama_hf`]), dequantized to the asked float type,
//! Q/K rows back in `rotate_half` order, the tokenizer as `tokenizer.json`. The result loads
//! in transformers and here (`--model DIR`), and is what `quantize` starts from.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::Path;

use anyhow::{bail, Context};
use kimi_core::DType;
use kimi_gguf::GgufFile;
use kimi_model::llama_hf::{hf_name, unpermute_rows};
use kimi_model::LlamaConfig;
use kimi_tokenizer::Tokenizer;
use serde_json::{json, Map, Value};

pub fn gguf_to_checkpoint(gguf: &Path, out: &Path, dtype: DType) -> anyhow::Result<()> {
    let file = GgufFile::open(gguf).with_context(|| format!("cannot open {}", gguf.display()))?;
    let config = LlamaConfig::from_gguf(&file).with_context(|| {
        format!(
            "{} is not a llama GGUF this converter reads",
            gguf.display()
        )
    })?;
    if out.exists() && std::fs::read_dir(out)?.next().is_some() {
        bail!("--out {} exists and is not empty", out.display());
    }
    let mut plan = Vec::new();
    for t in file.tensors() {
        let Some(name) = hf_name(&t.name) else {
            bail!(
                "{}: tensor `{}` has no Hugging Face llama name",
                gguf.display(),
                t.name
            );
        };
        plan.push((t.name.clone(), name, t.shape_outer_first()));
    }
    let elem = dtype.size_bytes();
    let mut header = Map::new();
    header.insert("__metadata__".into(), json!({"format": "pt"}));
    let st = match dtype {
        DType::F32 => "F32",
        DType::F16 => "F16",
        _ => "BF16",
    };
    let mut offset = 0usize;
    for (_, name, shape) in &plan {
        let bytes = shape.iter().product::<usize>() * elem;
        header.insert(
            name.clone(),
            json!({"dtype": st, "shape": shape, "data_offsets": [offset, offset + bytes]}),
        );
        offset += bytes;
    }
    let mut header_bytes = serde_json::to_vec(&Value::Object(header))?;
    while header_bytes.len() % 8 != 0 {
        header_bytes.push(b' ');
    }
    std::fs::create_dir_all(out).with_context(|| format!("cannot create {}", out.display()))?;
    let path = out.join("model.safetensors");
    let mut w = BufWriter::new(
        File::create(&path).with_context(|| format!("cannot create {}", path.display()))?,
    );
    w.write_all(&(header_bytes.len() as u64).to_le_bytes())?;
    w.write_all(&header_bytes)?;
    let bar = crate::progress::count_bar(plan.len() as u64, "converting");
    for (gguf_name, _, shape) in &plan {
        let values = file
            .tensor(gguf_name)?
            .to_f32()
            .with_context(|| format!("cannot dequantize `{gguf_name}`"))?;
        let mut bytes = Vec::with_capacity(values.len() * elem);
        for v in values {
            match dtype {
                DType::F32 => bytes.extend_from_slice(&v.to_le_bytes()),
                DType::F16 => bytes.extend_from_slice(&half::f16::from_f32(v).to_le_bytes()),
                _ => bytes.extend_from_slice(&half::bf16::from_f32(v).to_le_bytes()),
            }
        }
        let row_bytes = shape.get(1..).map_or(1, |s| s.iter().product()) * elem;
        if gguf_name.ends_with(".attn_q.weight") {
            bytes = unpermute_rows(&bytes, config.num_heads, row_bytes);
        } else if gguf_name.ends_with(".attn_k.weight") {
            bytes = unpermute_rows(&bytes, config.num_kv_heads, row_bytes);
        }
        w.write_all(&bytes)?;
        if let Some(b) = &bar {
            b.inc(1);
        }
    }
    w.flush()?;
    if let Some(b) = bar {
        b.finish_and_clear();
    }

    let tokenizer = Tokenizer::from_gguf(&file)
        .with_context(|| format!("cannot read the tokenizer of {}", gguf.display()))?;
    let add_bos = matches!(
        file.get("tokenizer.ggml.add_bos_token"),
        Some(kimi_gguf::Value::Bool(true))
    );
    let c = &config;
    let mut cfg = json!({
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads,
        "head_dim": c.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": c.max_context,
        "rms_norm_eps": shortest(c.rms_norm_eps),
        "rope_theta": shortest(c.rope_theta),
        "rope_scaling": null,
        "attention_bias": false,
        "mlp_bias": false,
        "tie_word_embeddings": c.tie_word_embeddings,
        "torch_dtype": match dtype { DType::F32 => "float32", DType::F16 => "float16", _ => "bfloat16" },
        "bos_token_id": tokenizer.bos_id(),
        "eos_token_id": c.eos_token_ids.first(),
    });
    if let Ok(name) = file.get_str("general.name") {
        cfg["_name_or_path"] = Value::String(name.to_string());
    }
    std::fs::write(out.join("config.json"), serde_json::to_string_pretty(&cfg)?)?;
    match tokenizer.hf_files(add_bos)? {
        Some(files) => {
            for (name, text) in files {
                std::fs::write(out.join(&name), text)
                    .with_context(|| format!("cannot write {name}"))?;
            }
        }
        None => eprintln!("note: the GGUF's tokenizer has no tokenizer.json form; none written"),
    }
    let bytes = std::fs::metadata(&path).map(|m| m.len()).unwrap_or(0);
    eprintln!(
        "wrote {} ({} tensors, {:.1} MB, {st})",
        out.display(),
        plan.len(),
        bytes as f64 / 1e6
    );
    Ok(())
}

/// An f32 as the f64 of its shortest decimal form (`1e-5`, not `9.999999747378752e-6`).
fn shortest(x: f32) -> f64 {
    x.to_string().parse().unwrap_or(x as f64)
}
