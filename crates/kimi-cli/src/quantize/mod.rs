//! `kimi-infer quantize`: a float checkpoint to a compressed-tensors `pack-quantized`
//! checkpoint, as llm-compressor writes one, so vLLM, transformers and kimi-infer load it.
//! Round to nearest (`rtn`), GPTQ (`gptq`, [`kimi_model::quantized::gptq`]) or AWQ (`awq`,
//! [`awq`]); the last two learn each matrix's inputs from a calibration text first
//! ([`calibrate`]).
//!
//! Every 2-D Linear weight (`*.weight` of a float dtype, not the embeddings, `lm_head`,
//! norms or the MoE router) whose width the group divides is quantized; the others are
//! copied and named in `quantization_config.ignore`. The output is safetensors shards of
//! whole layers written tensor by tensor (each header computed from the shapes first;
//! [`shards`], which also resumes an interrupted run), plus `config.json` with the
//! `quantization_config` and the source's other files (tokenizer, generation config) copied.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::Path;

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use anyhow::{bail, Context};
use kimi_core::DType;
use kimi_model::quantized::gptq;
use kimi_model::quantized::rtn::{self, PackedMatrix, RtnOptions};
use kimi_weights::SafetensorsDir;
use serde_json::json;

use crate::args::QuantizeArgs;

mod awq;
mod calibrate;
mod shards;
use calibrate::InputStats;

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

impl Entry {
    /// Bytes written for it.
    fn bytes(&self) -> usize {
        self.outputs.iter().map(|o| o.3).sum()
    }
}

pub fn quantize(args: QuantizeArgs) -> anyhow::Result<()> {
    let calibrated = args.method != "rtn";
    if calibrated && args.calibration_text.is_none() {
        bail!(
            "--method {} learns from text: give --calibration-text FILE (scripts/fetch_corpus.sh \
             fetches models/corpus/lcet10.txt)",
            args.method
        );
    }
    if calibrated && (args.calibration_ctx < 2 || args.calibration_tokens < args.calibration_ctx) {
        bail!("--calibration-tokens must hold at least one --calibration-ctx window of 2+ tokens");
    }
    if args.calibration_memory_gb.is_nan() || args.calibration_memory_gb <= 0.0 {
        bail!("--calibration-memory-gb must be positive");
    }
    if args.max_shard_gb.is_nan() || args.max_shard_gb <= 0.0 {
        bail!("--max-shard-gb must be positive");
    }
    if !(0.0..1.0).contains(&args.damp) || args.damp == 0.0 {
        bail!("--damp must lie in (0, 1)");
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
    let (config_json, _) = kimi_model::llama_hf::read_config_json(&args.model)?;
    let ckpt = SafetensorsDir::open(&args.model)
        .with_context(|| format!("cannot open {}", args.model.display()))?;
    if args.sequential && args.method != "gptq" {
        bail!("--sequential applies to --method gptq");
    }
    if config_json.get("quantization_config").is_some() {
        bail!(
            "{} is already quantized (config.json has a quantization_config)",
            args.model.display()
        );
    }

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

    // The shards, and which of them an interrupted run already wrote.
    let max_shard = (args.max_shard_gb * 1e9) as usize;
    let mut shards = shards::plan(&entries, calibrate::layer_of, max_shard);
    let sizes = shards
        .iter()
        .map(|s| shards::header(&entries, &s.entries).map(|(h, d)| 8 + h.len() + d))
        .collect::<anyhow::Result<Vec<_>>>()?;
    let request = json!({
        "model": args.model.canonicalize().unwrap_or_else(|_| args.model.clone()),
        "method": args.method, "bits": args.bits, "group_size": args.group_size,
        "symmetric": opts.symmetric, "actorder": args.actorder, "damp": args.damp,
        "calibration_text": args.calibration_text, "calibration_tokens": args.calibration_tokens,
        "calibration_ctx": args.calibration_ctx, "sequential": args.sequential,
    });
    let plan = shards::plan_json(&request, &entries, &shards);
    shards::prepare(&args.out, &plan, &mut shards, &sizes, args.resume)?;
    let left: HashSet<usize> = shards
        .iter()
        .filter(|s| !s.done)
        .flat_map(|s| s.entries.iter().copied())
        .collect();
    let kept = shards.iter().filter(|s| s.done).count();
    if kept > 0 {
        eprintln!(
            "resuming: {kept} of {} shards already written, {} tensors left",
            shards.len(),
            left.len()
        );
    }

    // What calibration learns (for the layers left), and what AWQ changes before rounding.
    let targets: Vec<(String, usize)> = entries
        .iter()
        .enumerate()
        .filter(|(i, _)| left.contains(i))
        .filter_map(|(_, e)| match e.plan {
            Plan::Quantize { cols, .. } => Some((e.name.clone(), cols)),
            Plan::Copy => None,
        })
        .collect();
    let order = match args.actorder.as_str() {
        "none" => gptq::ColumnOrder::Natural,
        _ => gptq::ColumnOrder::Static,
    };
    let shapes: HashMap<&str, (usize, usize)> = entries
        .iter()
        .filter_map(|e| match e.plan {
            Plan::Quantize { rows, cols } => Some((e.name.as_str(), (rows, cols))),
            Plan::Copy => None,
        })
        .collect();
    let stats: HashMap<String, Arc<InputStats>> = match &args.calibration_text {
        Some(text) if calibrated && !targets.is_empty() => {
            let plan = calibrate::CalibrationPlan {
                model: &args.model,
                text,
                ctx: args.calibration_ctx,
                tokens: args.calibration_tokens,
                targets: &targets,
                memory_bytes: (args.calibration_memory_gb * (1u64 << 30) as f64) as u64,
            };
            match args.sequential {
                // Each layer's matrices rounded as the writer will round them, so that the
                // next layer calibrates on what the quantized model computes.
                true => calibrate::calibrate_sequential(&plan, |layer| {
                    let mut rounded = HashMap::new();
                    for (name, s) in layer {
                        let Some(&(rows, cols)) = shapes.get(name.as_str()) else {
                            continue;
                        };
                        let view = ckpt.get(name)?;
                        let dtype = view.dtype;
                        let (_, values, _) = gptq::quantize(
                            &view.to_f32_vec(),
                            rows,
                            cols,
                            &s.hessian,
                            opts,
                            order,
                            args.damp,
                            |x| round_to(dtype, x),
                        )
                        .with_context(|| format!("GPTQ of `{name}`"))?;
                        rounded.insert(name.clone(), values);
                    }
                    Ok(rounded)
                })?,
                false => calibrate::calibrate(&plan)?,
            }
        }
        _ => HashMap::new(),
    };
    let overrides = match args.method.as_str() {
        "awq" => {
            let dtype = match targets.first() {
                Some((name, _)) => ckpt.get(name)?.dtype,
                None => DType::F32,
            };
            let names = targets.iter().map(|(n, _)| n.clone()).collect();
            awq::apply(&ckpt, &config_json, &stats, &names, opts, true, &|s| {
                round_to(dtype, s)
            })?
        }
        _ => HashMap::new(),
    };

    let bar = crate::progress::count_bar(left.len() as u64, "quantizing");
    let (mut quantized, mut bytes_in, mut uncalibrated) = (0usize, 0usize, Vec::new());
    for shard in shards.iter().filter(|s| !s.done) {
        let partial = args.out.join(format!("{}.partial", shard.file));
        let mut out = BufWriter::new(
            File::create(&partial)
                .with_context(|| format!("cannot create {}", partial.display()))?,
        );
        let (header_bytes, _) = shards::header(&entries, &shard.entries)?;
        out.write_all(&(header_bytes.len() as u64).to_le_bytes())?;
        out.write_all(&header_bytes)?;
        for e in shard.entries.iter().map(|&i| &entries[i]) {
            let view = ckpt.get(&e.name)?;
            bytes_in += view.bytes.len();
            match e.plan {
                Plan::Copy => match overrides.get(&e.name) {
                    Some(values) => write_values(&mut out, values, view.dtype)?,
                    None => out.write_all(view.bytes)?,
                },
                Plan::Quantize { rows, cols } => {
                    let dtype = view.dtype;
                    let round = |s| round_to(dtype, s);
                    let values = match overrides.get(&e.name) {
                        Some(v) => v.clone(),
                        None => view.to_f32_vec(),
                    };
                    let m: PackedMatrix = match (args.method.as_str(), stats.get(&e.name)) {
                        ("gptq", Some(s)) => {
                            let (m, ..) = gptq::quantize(
                                &values, rows, cols, &s.hessian, opts, order, args.damp, round,
                            )
                            .with_context(|| format!("GPTQ of `{}`", e.name))?;
                            m
                        }
                        (method, None) if method != "rtn" => {
                            uncalibrated.push(e.name.clone());
                            rtn::quantize(&values, rows, cols, opts, round)
                        }
                        _ => rtn::quantize(&values, rows, cols, opts, round),
                    };
                    write_i32(&mut out, &m.packed)?;
                    for s in &m.scales {
                        match dtype {
                            DType::BF16 => {
                                out.write_all(&half::bf16::from_f32(*s).to_le_bytes())?
                            }
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
        drop(out);
        std::fs::rename(&partial, args.out.join(&shard.file))
            .with_context(|| format!("cannot rename {}", partial.display()))?;
    }
    if let Some(b) = bar {
        b.finish_and_clear();
    }
    if shards.len() > 1 {
        let total = entries.iter().map(Entry::bytes).sum();
        std::fs::write(
            args.out.join("model.safetensors.index.json"),
            serde_json::to_string_pretty(&shards::index(&entries, &shards, total))?,
        )?;
    }
    if !uncalibrated.is_empty() {
        eprintln!(
            "note: {} matrices never multiplied a calibration input (experts no token was \
             routed to, or weights read other than by a product) and were rounded to nearest, \
             e.g. {}",
            uncalibrated.len(),
            uncalibrated[..uncalibrated.len().min(3)].join(", ")
        );
    }

    let mut config = config_json.clone();
    let group = json!({
        "targets": ["Linear"],
        "weights": {
            "num_bits": opts.bits, "type": "int", "symmetric": opts.symmetric,
            "strategy": if opts.group_size.is_some() { "group" } else { "channel" },
            "group_size": opts.group_size, "dynamic": false,
            "actorder": (args.method == "gptq" && args.actorder == "static").then_some("static"),
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
    let bytes_out: u64 = sizes.iter().map(|&s| s as u64).sum();
    eprintln!(
        "quantized {quantized} matrices ({}) to {} bits ({}), {:.1} MB -> {:.1} MB: {}",
        args.method,
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

/// f32 values as a float tensor of `dtype` (a folded norm or a compensated router).
fn write_values(out: &mut impl Write, values: &[f32], dtype: DType) -> anyhow::Result<()> {
    for &v in values {
        match dtype {
            DType::BF16 => out.write_all(&half::bf16::from_f32(v).to_le_bytes())?,
            DType::F16 => out.write_all(&half::f16::from_f32(v).to_le_bytes())?,
            DType::F32 => out.write_all(&v.to_le_bytes())?,
            other => bail!("cannot write changed values as {other}"),
        }
    }
    Ok(())
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
