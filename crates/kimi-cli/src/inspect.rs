//! `kimi-infer inspect`: what a checkpoint holds and what it will cost to run.

use std::collections::BTreeMap;
use std::io::Write;

use anyhow::Context;
use kimi_core::config::{Ffn, KdaGate, Mixer};
use kimi_core::ModelConfig;
use kimi_model::ModelSummary;
use kimi_weights::{Checkpoint, WeightsError};
use serde_json::json;

use crate::args::InspectArgs;

pub fn inspect(a: InspectArgs) -> anyhow::Result<()> {
    match report(a) {
        Err(e) if is_broken_pipe(&e) => Ok(()),
        other => other,
    }
}

/// A closed stdout (e.g. `| head`) is not an error worth reporting.
pub fn is_broken_pipe(e: &anyhow::Error) -> bool {
    e.downcast_ref::<std::io::Error>()
        .is_some_and(|io| io.kind() == std::io::ErrorKind::BrokenPipe)
}

fn report(a: InspectArgs) -> anyhow::Result<()> {
    let stdout = std::io::stdout();
    let mut out = stdout.lock();
    let dir = crate::load::model_path(&a.model)?;
    if crate::load::is_gguf(&dir) {
        return report_gguf(&dir, a.json, &mut out);
    }
    // A directory with only config.json still gets the arithmetic (planning before download).
    let ckpt = match Checkpoint::open(&dir) {
        Ok(c) => Some(c),
        Err(WeightsError::NoWeights { .. }) => None,
        Err(e) => {
            return Err(anyhow::Error::new(e)
                .context(format!("cannot open the model in {}", dir.display())))
        }
    };
    let cfg = match &ckpt {
        Some(c) => c.config().clone(),
        None => {
            let path = dir.join("config.json");
            let text = std::fs::read_to_string(&path)
                .with_context(|| format!("reading {}", path.display()))?;
            ModelConfig::from_json_str(&text).with_context(|| format!("in {}", path.display()))?
        }
    };
    let cfg = &cfg;
    let summary = ModelSummary::new(cfg);
    let mut by_dtype: BTreeMap<String, u64> = BTreeMap::new();
    let mut per_layer = vec![0u64; cfg.layers.len()];
    let mut other_bytes = 0u64;
    let names = ckpt.as_ref().map(|c| c.tensor_names()).unwrap_or_default();
    for name in names {
        let Some(ckpt) = &ckpt else { break };
        let (dtype, bytes) = match ckpt.get(name) {
            Ok(view) => (view.dtype.to_string(), view.bytes.len() as u64),
            Err(_) => ("unsupported".to_string(), 0),
        };
        *by_dtype.entry(dtype).or_default() += bytes;
        match layer_of(name) {
            Some(i) if i < per_layer.len() => per_layer[i] += bytes,
            _ => other_bytes += bytes,
        }
    }
    let mla_per_token = summary.mla_cache_elems_per_token;
    let kda_state = summary.kda_state_elems_per_seq;
    let kda_conv = summary.kda_conv_elems_per_seq;
    if a.json {
        let layers: Vec<_> = cfg
            .layers
            .iter()
            .enumerate()
            .map(|(i, l)| {
                json!({"layer": i, "mixer": format!("{:?}", l.mixer), "ffn": format!("{:?}", l.ffn),
                       "params": summary.params.per_layer[i], "bytes": per_layer[i]})
            })
            .collect();
        let v = json!({
            "model_type": cfg.model_type, "num_layers": cfg.layers.len(), "hidden_size": cfg.hidden_size,
            "vocab_size": cfg.vocab_size, "total_params": summary.params.total, "active_params": summary.params.active,
            "weight_bytes": ckpt.as_ref().map(|c| c.total_bytes()), "bytes_by_dtype": by_dtype, "layers": layers,
            "non_layer_bytes": other_bytes,
            "mla_cache_values_per_token": mla_per_token,
            "mla_cache_bytes_per_token_bf16": mla_per_token * 2, "mla_cache_bytes_per_token_f32": mla_per_token * 4,
            "kda_state_bytes_per_sequence_f32": kda_state * 4, "kda_conv_bytes_per_sequence_bf16": kda_conv * 2,
            "kda_conv_bytes_per_sequence_f32": kda_conv * 4,
        });
        writeln!(out, "{}", serde_json::to_string_pretty(&v)?)?;
        return Ok(());
    }
    writeln!(out, "model        {}", dir.display())?;
    writeln!(
        out,
        "architecture {} — {} layers, hidden {}, vocab {}, context {}",
        cfg.model_type,
        cfg.layers.len(),
        cfg.hidden_size,
        cfg.vocab_size,
        cfg.max_position_embeddings
    )?;
    let mixers: String = cfg
        .layers
        .iter()
        .map(|l| if l.mixer == Mixer::Kda { 'K' } else { 'M' })
        .collect();
    let ffns: String = cfg
        .layers
        .iter()
        .map(|l| if l.ffn == Ffn::Dense { 'D' } else { 'E' })
        .collect();
    writeln!(out, "mixers       {mixers}   (K = KDA, M = MLA)")?;
    writeln!(out, "ffn          {ffns}   (D = dense MLP, E = experts)")?;
    if let Some(k) = &cfg.kda {
        let gate = match k.gate {
            KdaGate::Softplus => "softplus".to_string(),
            KdaGate::LowerBound(b) => format!("safe gate, lower bound {b}"),
        };
        writeln!(
            out,
            "KDA          {} heads x {}, conv width {}, gate {gate}",
            k.num_heads, k.head_dim, k.conv_kernel
        )?;
    }
    if let Some(m) = &cfg.mla {
        writeln!(
            out,
            "MLA          {} heads, latent {}, nope {}, rope {} (NoPE), v {}, q_lora {:?}",
            m.num_heads,
            m.kv_lora_rank,
            m.qk_nope_head_dim,
            m.qk_rope_head_dim,
            m.v_head_dim,
            m.q_lora_rank
        )?;
    }
    if let Some(m) = &cfg.moe {
        writeln!(out,
            "MoE          {} experts, top-{}, {} shared, width {}, groups {} keep {}, renormalize {}, scale {}",
            m.num_experts,
            m.top_k,
            m.num_shared_experts,
            m.expert_intermediate_size,
            m.num_expert_groups,
            m.topk_group,
            m.renormalize,
            m.routed_scaling_factor
        )?;
    }
    writeln!(
        out,
        "parameters   total {} , active per token {}",
        human(summary.params.total),
        human(summary.params.active)
    )?;
    match &ckpt {
        Some(c) => writeln!(
            out,
            "weights      {} of tensor data",
            bytes(c.total_bytes())
        )?,
        None => writeln!(
            out,
            "weights      (no safetensors in this directory: sizes from config.json only)"
        )?,
    }
    for (dtype, b) in &by_dtype {
        writeln!(out, "  {dtype:<11} {}", bytes(*b))?;
    }
    writeln!(out, "per layer    (params, bytes)")?;
    for (i, l) in cfg.layers.iter().enumerate() {
        writeln!(
            out,
            "  {i:>3} {:?}+{:?}  {:>10}  {:>10}",
            l.mixer,
            l.ffn,
            human(summary.params.per_layer[i]),
            bytes(per_layer[i])
        )?;
    }
    writeln!(out, "  embed/head/norm          {:>10}", bytes(other_bytes))?;
    writeln!(
        out,
        "cache        MLA latent {} values/token over {} layers = {} (bf16) / {} (f32) per token",
        mla_per_token,
        summary.num_mla_layers,
        bytes(mla_per_token * 2),
        bytes(mla_per_token * 4)
    )?;
    writeln!(
        out,
        "             KDA state {} per sequence (f32) + conv window {} (f32), constant in length",
        bytes(kda_state * 4),
        bytes(kda_conv * 4)
    )?;
    Ok(())
}

fn layer_of(name: &str) -> Option<usize> {
    name.strip_prefix("model.layers.")?
        .split('.')
        .next()?
        .parse()
        .ok()
}

fn human(n: u64) -> String {
    match n {
        n if n >= 1_000_000_000 => format!("{:.2} B", n as f64 / 1e9),
        n if n >= 1_000_000 => format!("{:.2} M", n as f64 / 1e6),
        n if n >= 1_000 => format!("{:.1} K", n as f64 / 1e3),
        n => n.to_string(),
    }
}

pub fn bytes(n: u64) -> String {
    match n {
        n if n >= 1 << 30 => format!("{:.2} GiB", n as f64 / (1u64 << 30) as f64),
        n if n >= 1 << 20 => format!("{:.2} MiB", n as f64 / (1u64 << 20) as f64),
        n if n >= 1 << 10 => format!("{:.1} KiB", n as f64 / 1024.0),
        n => format!("{n} B"),
    }
}

/// Metadata, tensor types and sizes of a GGUF file.
fn report_gguf(path: &std::path::Path, json: bool, out: &mut impl Write) -> anyhow::Result<()> {
    let file = kimi_gguf::GgufFile::open(path)
        .with_context(|| format!("cannot open {}", path.display()))?;
    let config = kimi_model::LlamaConfig::from_gguf(&file).ok();
    let mut by_type: BTreeMap<String, u64> = BTreeMap::new();
    for t in file.tensors() {
        *by_type.entry(t.ggml_type.name().to_string()).or_default() += t.size_bytes;
    }
    let total: u64 = by_type.values().sum();
    let arch = file
        .get_str("general.architecture")
        .unwrap_or("unknown")
        .to_string();
    let params: u64 = file.tensors().iter().map(|t| t.num_elements()).sum();
    if json {
        let v = json!({
            "format": "gguf", "version": file.version(), "architecture": arch,
            "tensors": file.tensors().len(), "total_params": params, "weight_bytes": total,
            "bytes_by_type": by_type,
            "num_layers": config.as_ref().map(|c| c.num_layers),
            "kv_cache_values_per_token": config.as_ref().map(|c| 2 * c.num_layers * c.num_kv_heads * c.head_dim),
        });
        writeln!(out, "{}", serde_json::to_string_pretty(&v)?)?;
        return Ok(());
    }
    writeln!(
        out,
        "model        {} (GGUF v{})",
        path.display(),
        file.version()
    )?;
    writeln!(
        out,
        "architecture {arch}, {} tensors, {} parameters",
        file.tensors().len(),
        human(params)
    )?;
    if let Some(c) = &config {
        writeln!(
            out,
            "llama        {} layers, hidden {}, {} heads ({} kv) x {}, ffn {}, vocab {}, context {}",
            c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size,
            c.vocab_size, c.max_context
        )?;
        let kv = 2 * c.num_layers * c.num_kv_heads * c.head_dim;
        writeln!(
            out,
            "cache        K+V {kv} values/token = {} (f16, --int8-matmul) / {} (f32) per token",
            bytes(kv as u64 * 2),
            bytes(kv as u64 * 4)
        )?;
    }
    writeln!(out, "weights      {}", bytes(total))?;
    for (ty, b) in &by_type {
        writeln!(out, "  {ty:<11} {}", bytes(*b))?;
    }
    Ok(())
}
