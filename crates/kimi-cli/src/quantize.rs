//! `kimi-infer quantize`: a float checkpoint to a compressed-tensors `pack-quantized`
//! checkpoint (round to nearest), as llm-compressor writes one, so vLLM, transformers and
//! kimi-infer load it.
//!
//! Every 2-D Linear weight (`*.weight` of a float dtype, not the embeddings, `lm_head`,
//! norms or the MoE router) whose width the group divides is quantized; the others are
//! copied and named in `quantization_config.ignore`. The output is one `model.safetensors`
//! written tensor by tensor (the header is computed from the shapes first), plus
//! `config.json` with the `quantization_config` and the source's other files (tokenizer,
//! generation config) copied.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::Path;

use anyhow::{bail, Context};
use kimi_core::DType;
use kimi_model::quantized::rtn::{self, RtnOptions};
use kimi_weights::Checkpoint;
use serde_json::{json, Map, Value};

use crate::args::QuantizeArgs;

/// What becomes of one stored tensor.
enum Plan {
    Copy,
    Quantize { rows: usize, cols: usize },
}

struct Entry {
    name: String,
    plan: Plan,
    /// `(name, safetensors dtype, shape, bytes)` of each tensor written for it.
    outputs: Vec<(String, &'static str, Vec<usize>, usize)>,
}

pub fn quantize(args: QuantizeArgs) -> anyhow::Result<()> {
    if args.method != "rtn" {
        bail!(
            "--method {}: only `rtn` (round to nearest) is implemented",
            args.method
        );
    }
    if ![4, 8].contains(&args.bits) {
        bail!("--bits {}: 4 or 8", args.bits);
    }
    let group_size = match args.group_size {
        0 => bail!("--group-size must be positive, or -1 for one scale per row"),
        g if g < 0 => None,
        g => Some(g as usize),
    };
    let opts = RtnOptions {
        bits: args.bits,
        group_size,
        symmetric: args.symmetric || args.bits == 8,
    };
    let ckpt = Checkpoint::open(&args.model)
        .with_context(|| format!("cannot open {}", args.model.display()))?;
    if ckpt.config_json().get("quantization_config").is_some() {
        bail!(
            "{} is already quantized (config.json has a quantization_config)",
            args.model.display()
        );
    }
    if args.out.exists() && std::fs::read_dir(&args.out)?.next().is_some() {
        bail!("--out {} exists and is not empty", args.out.display());
    }
    std::fs::create_dir_all(&args.out)
        .with_context(|| format!("cannot create {}", args.out.display()))?;

    let mut entries = Vec::new();
    let mut ignore = Vec::new();
    for name in ckpt.tensor_names() {
        let view = ckpt.get(name)?;
        let linear = view.shape.len() == 2
            && name.ends_with(".weight")
            && matches!(view.dtype, DType::F32 | DType::BF16 | DType::F16)
            && !["embed_tokens", "lm_head", "norm", "conv1d"]
                .iter()
                .any(|p| name.contains(p))
            && !name.ends_with(".gate.weight");
        let (rows, cols) = (view.shape[0], *view.shape.last().unwrap_or(&0));
        let fits =
            linear && opts.groups(cols).is_some() && (cols * opts.bits as usize).is_multiple_of(32);
        // Linear modules left in float, the MoE routers included, are named for loaders
        // that match `targets: ["Linear"]` by module type (vLLM).
        let router = view.shape.len() == 2 && name.ends_with(".gate.weight");
        if (linear && !fits) || router {
            ignore.push(name.trim_end_matches(".weight").to_string());
        }
        let st = st_dtype(view.dtype)?;
        let outputs = if fits {
            let base = name.trim_end_matches(".weight");
            let groups = opts.groups(cols).unwrap_or(1);
            let mut o = vec![
                (
                    format!("{base}.weight_packed"),
                    "I32",
                    vec![rows, rtn::packed_words(cols, opts.bits)],
                    0,
                ),
                (format!("{base}.weight_scale"), st, vec![rows, groups], 0),
                (format!("{base}.weight_shape"), "I64", vec![2], 0),
            ];
            if !opts.symmetric {
                let zw = rtn::packed_words(rows, opts.bits);
                o.push((
                    format!("{base}.weight_zero_point"),
                    "I32",
                    vec![zw, groups],
                    0,
                ));
            }
            for t in &mut o {
                let elem = match t.1 {
                    "I64" => 8,
                    "I32" | "F32" => 4,
                    _ => 2,
                };
                t.3 = t.2.iter().product::<usize>() * elem;
            }
            o
        } else {
            vec![(name.to_string(), st, view.shape.to_vec(), view.bytes.len())]
        };
        entries.push(Entry {
            name: name.to_string(),
            plan: if fits {
                Plan::Quantize { rows, cols }
            } else {
                Plan::Copy
            },
            outputs,
        });
    }

    // The header, from the shapes alone.
    let mut header = Map::new();
    header.insert("__metadata__".into(), json!({"format": "pt"}));
    let mut offset = 0usize;
    for e in &entries {
        for (name, dtype, shape, bytes) in &e.outputs {
            header.insert(
                name.clone(),
                json!({"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + bytes]}),
            );
            offset += bytes;
        }
    }
    let mut header_bytes = serde_json::to_vec(&Value::Object(header))?;
    while header_bytes.len() % 8 != 0 {
        header_bytes.push(b' ');
    }
    let path = args.out.join("model.safetensors");
    let mut out = BufWriter::new(
        File::create(&path).with_context(|| format!("cannot create {}", path.display()))?,
    );
    out.write_all(&(header_bytes.len() as u64).to_le_bytes())?;
    out.write_all(&header_bytes)?;

    let bar = crate::progress::count_bar(entries.len() as u64, "quantizing");
    let (mut quantized, mut bytes_in) = (0usize, 0usize);
    for e in &entries {
        let view = ckpt.get(&e.name)?;
        bytes_in += view.bytes.len();
        match e.plan {
            Plan::Copy => out.write_all(view.bytes)?,
            Plan::Quantize { rows, cols } => {
                let dtype = view.dtype;
                let m = rtn::quantize(&view.to_f32_vec(), rows, cols, opts, |s| round_to(dtype, s));
                write_i32(&mut out, &m.packed)?;
                for s in &m.scales {
                    match dtype {
                        DType::BF16 => out.write_all(&half::bf16::from_f32(*s).to_le_bytes())?,
                        DType::F16 => out.write_all(&half::f16::from_f32(*s).to_le_bytes())?,
                        _ => out.write_all(&s.to_le_bytes())?,
                    }
                }
                out.write_all(&(rows as i64).to_le_bytes())?;
                out.write_all(&(cols as i64).to_le_bytes())?;
                if let Some(z) = &m.zeros {
                    write_i32(&mut out, z)?;
                }
                quantized += 1;
            }
        }
        if let Some(b) = &bar {
            b.inc(1);
        } else if let Plan::Quantize { .. } = e.plan {
            tracing::debug!(tensor = %e.name, "quantized");
        }
    }
    out.flush()?;
    if let Some(b) = bar {
        b.finish_and_clear();
    }

    let mut config = ckpt.config_json().clone();
    let group = json!({
        "targets": ["Linear"],
        "weights": {
            "num_bits": opts.bits, "type": "int", "symmetric": opts.symmetric,
            "strategy": if opts.group_size.is_some() { "group" } else { "channel" },
            "group_size": opts.group_size, "dynamic": false, "actorder": null,
            "block_structure": null, "observer": "minmax",
        },
        "input_activations": null, "output_activations": null, "format": "pack-quantized",
    });
    ignore.push("lm_head".into());
    config["quantization_config"] = json!({
        "quant_method": "compressed-tensors", "format": "pack-quantized",
        "quantization_status": "compressed", "config_groups": {"group_0": group},
        "ignore": ignore, "kv_cache_scheme": null, "sparsity_config": {},
        "global_compression_ratio": null, "version": "0.19.0",
    });
    std::fs::write(
        args.out.join("config.json"),
        serde_json::to_string_pretty(&config)?,
    )?;
    copy_other_files(&args.model, &args.out)?;
    let bytes_out = std::fs::metadata(&path)?.len();
    eprintln!(
        "quantized {quantized} matrices to {} bits ({}), {:.1} MB -> {:.1} MB: {}",
        opts.bits,
        opts.group_size
            .map_or("per channel".into(), |g| format!("groups of {g}")),
        bytes_in as f64 / 1e6,
        bytes_out as f64 / 1e6,
        args.out.display()
    );
    Ok(())
}

fn st_dtype(dtype: DType) -> anyhow::Result<&'static str> {
    Ok(match dtype {
        DType::F32 => "F32",
        DType::F16 => "F16",
        DType::BF16 => "BF16",
        DType::U8 => "U8",
        DType::E8M0 => "F8_E8M0",
        DType::I8 => "I8",
        DType::I32 => "I32",
        DType::I64 => "I64",
        DType::F8E4M3 => "F8_E4M3",
        other => bail!("tensors of {other} cannot be copied"),
    })
}

/// `s` as the scale's stored dtype gives it back.
fn round_to(dtype: DType, s: f32) -> f32 {
    match dtype {
        DType::BF16 => half::bf16::from_f32(s).to_f32(),
        DType::F16 => half::f16::from_f32(s).to_f32(),
        _ => s,
    }
}

fn write_i32(out: &mut impl Write, values: &[i32]) -> std::io::Result<()> {
    for v in values {
        out.write_all(&v.to_le_bytes())?;
    }
    Ok(())
}

/// Copies the source's files other than weights and config (tokenizer, templates,
/// generation config).
fn copy_other_files(from: &Path, to: &Path) -> anyhow::Result<()> {
    for entry in std::fs::read_dir(from)? {
        let entry = entry?;
        let name = entry.file_name().to_string_lossy().into_owned();
        let skip = name.ends_with(".safetensors")
            || name == "model.safetensors.index.json"
            || name == "config.json"
            || !entry.file_type()?.is_file();
        if !skip {
            std::fs::copy(entry.path(), to.join(&name))
                .with_context(|| format!("cannot copy {name}"))?;
        }
    }
    Ok(())
}
