//! `kimi-infer inspect`: what a checkpoint holds and what it will cost to run.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::Path;

use anyhow::Context;
use kimi_core::config::{ExpertFormat, Ffn, KdaGate, KdaOutputGate, Mixer};
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
    let path = crate::load::model_path(&a.model)?;
    // A bare config.json: the arithmetic alone (planning before any download).
    if crate::load::is_config_file(&path) {
        let cfg = crate::load::read_config(&path)?;
        return report_kimi(&path, &cfg, None, a.json, &mut out);
    }
    if crate::load::is_gguf(&path) {
        return report_gguf(&path, a.json, &mut out);
    }
    // A directory with only config.json gets the same arithmetic.
    let ckpt = match Checkpoint::open(&path) {
        Ok(c) => Some(c),
        Err(WeightsError::NoWeights { .. }) => None,
        Err(e) => {
            return Err(anyhow::Error::new(e)
                .context(format!("cannot open the model in {}", path.display())))
        }
    };
    let cfg = match &ckpt {
        Some(c) => c.config().clone(),
        None => crate::load::read_config(&path.join("config.json"))?,
    };
    report_kimi(&path, &cfg, ckpt.as_ref(), a.json, &mut out)
}

/// What the checkpoint's tensors hold, by dtype and by layer.
struct Stored {
    total: u64,
    by_dtype: BTreeMap<String, u64>,
    per_layer: Vec<u64>,
    other: u64,
    /// A multimodal checkpoint's vision encoder, which the text model skips.
    vision: u64,
}

/// The loader's list (`kimi_model`'s `VISION_PREFIXES`).
const VISION_PREFIXES: [&str; 4] = [
    "vision_tower.",
    "mm_projector.",
    "vision_model.",
    "multi_modal_projector.",
];

fn stored(cfg: &ModelConfig, ckpt: &Checkpoint) -> Stored {
    let mut s = Stored {
        total: ckpt.total_bytes(),
        by_dtype: BTreeMap::new(),
        per_layer: vec![0; cfg.layers.len()],
        other: 0,
        vision: 0,
    };
    for name in ckpt.tensor_names() {
        let (dtype, bytes) = match ckpt.get(name) {
            Ok(view) => (view.dtype.to_string(), view.bytes.len() as u64),
            Err(_) => ("unsupported".to_string(), 0),
        };
        *s.by_dtype.entry(dtype).or_default() += bytes;
        if VISION_PREFIXES.iter().any(|p| name.starts_with(p)) {
            s.vision += bytes;
            continue;
        }
        match layer_of(name.strip_prefix(cfg.tensor_prefix()).unwrap_or(name)) {
            Some(i) if i < s.per_layer.len() => s.per_layer[i] += bytes,
            _ => s.other += bytes,
        }
    }
    s
}

fn report_kimi(
    path: &Path,
    cfg: &ModelConfig,
    ckpt: Option<&Checkpoint>,
    json: bool,
    out: &mut impl Write,
) -> anyhow::Result<()> {
    let summary = ModelSummary::new(cfg);
    let stored = ckpt.map(|c| stored(cfg, c));
    if json {
        let v = report_json(cfg, &summary, stored.as_ref());
        writeln!(out, "{}", serde_json::to_string_pretty(&v)?)?;
        return Ok(());
    }
    writeln!(out, "model        {}", path.display())?;
    writeln!(
        out,
        "architecture {} — {} layers, hidden {}, vocab {}, context {}",
        cfg.model_type,
        cfg.layers.len(),
        cfg.hidden_size,
        cfg.vocab_size,
        cfg.max_position_embeddings
    )?;
    describe_layers(cfg, out)?;
    let p = &summary.params;
    writeln!(
        out,
        "parameters   total {}, active per token {} ({} without the input embedding)",
        human(p.total),
        human(p.active),
        human(summary.active_params_without_embedding())
    )?;
    let experts = match cfg.moe.as_ref().map(|m| m.expert_format) {
        Some(ExpertFormat::Mxfp4) => format!(
            "; routed experts mxfp4, {} B each",
            grouped(summary.bytes_per_expert)
        ),
        _ => String::new(),
    };
    writeln!(
        out,
        "weights      {} from config.json ({}{experts}; GB = 10^9 B)",
        si(summary.total_bytes()),
        summary.weight_dtype
    )?;
    match &stored {
        Some(s) => {
            let vision = match s.vision {
                0 => String::new(),
                v => format!(", {} of it a vision encoder the text model skips", si(v)),
            };
            writeln!(
                out,
                "             {} of tensor data in the checkpoint{vision}",
                si(s.total)
            )?;
            for (dtype, b) in &s.by_dtype {
                writeln!(out, "  {dtype:<11} {}", si(*b))?;
            }
        }
        None => writeln!(
            out,
            "             (no safetensors here: sizes from config.json only)"
        )?,
    }
    component_table(cfg, &summary, out)?;
    writeln!(
        out,
        "per layer    (params, bytes{})",
        if stored.is_some() { ", stored" } else { "" }
    )?;
    for (i, l) in cfg.layers.iter().enumerate() {
        let bytes = stored
            .as_ref()
            .map_or(summary.layer_bytes[i], |s| s.per_layer[i]);
        writeln!(
            out,
            "  {i:>3} {:?}+{:?}  {:>10}  {:>10}",
            l.mixer,
            l.ffn,
            human(p.per_layer[i]),
            si(bytes)
        )?;
    }
    let other = stored.as_ref().map_or_else(
        || summary.total_bytes() - summary.layer_bytes.iter().sum::<u64>(),
        |s| s.other,
    );
    writeln!(out, "  embed/head/norm          {:>10}", si(other))?;
    cache_lines(cfg, &summary, out)
}

fn describe_layers(cfg: &ModelConfig, out: &mut impl Write) -> anyhow::Result<()> {
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
        let output = match k.output_gate {
            KdaOutputGate::LowRank => "low-rank g_a/g_b",
            KdaOutputGate::FullRank => "full-rank g_proj",
        };
        writeln!(
            out,
            "KDA          {} heads x {}, conv width {}, gate {gate}, output gate {output}",
            k.num_heads, k.head_dim, k.conv_kernel
        )?;
    }
    if let Some(m) = &cfg.mla {
        writeln!(
            out,
            "MLA          {} heads, latent {}, nope {}, rope {} (NoPE), v {}, q_lora {}, output gate {}",
            m.num_heads,
            m.kv_lora_rank,
            m.qk_nope_head_dim,
            m.qk_rope_head_dim,
            m.v_head_dim,
            m.q_lora_rank.map_or_else(|| "none".to_string(), |r| r.to_string()),
            if m.output_gate { "yes" } else { "no" }
        )?;
    }
    if let Some(m) = &cfg.moe {
        let latent = m.latent.map_or_else(String::new, |l| {
            format!(
                ", latent {}{}",
                l.width,
                if l.norm { " (+norm)" } else { "" }
            )
        });
        let format = match m.expert_format {
            ExpertFormat::Dense => "dense",
            ExpertFormat::Mxfp4 => "mxfp4",
        };
        writeln!(out,
            "MoE          {} experts, top-{}, {} shared, width {}{latent}, experts {format}, groups {} keep {}, renormalize {}, scale {}",
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
    if let Some(b) = cfg.attn_res_block_size {
        writeln!(
            out,
            "AttnRes      blocks of {b} layers (two mixes per layer, one before the final norm)"
        )?;
    }
    Ok(())
}

/// Parameters and bytes per component, from the config.
fn component_table(
    cfg: &ModelConfig,
    s: &ModelSummary,
    out: &mut impl Write,
) -> anyhow::Result<()> {
    writeln!(
        out,
        "components   {:<15} {:>11} {:>11} {:>11} {:>11}",
        "", "params", "active", "bytes", "read/token"
    )?;
    for (c, size) in &s.components {
        if size.params == 0 {
            continue;
        }
        writeln!(
            out,
            "  {:<26} {:>11} {:>11} {:>11} {:>11}",
            c.name(),
            human(size.params),
            human(size.active_params),
            si(size.bytes),
            si(size.read_bytes)
        )?;
    }
    writeln!(
        out,
        "  {:<26} {:>11} {:>11} {:>11} {:>11}",
        "total",
        human(s.params.total),
        human(s.params.active),
        si(s.total_bytes()),
        si(s.read_bytes_per_token())
    )?;
    if s.num_experts > 0 {
        writeln!(
            out,
            "  routed experts {} ({} per layer x {} layers, {} per token per layer); everything else {}",
            si(s.routed_expert_bytes()),
            s.num_experts,
            s.num_moe_layers,
            s.top_k,
            si(s.non_expert_bytes())
        )?;
    }
    if let (Some(k), true) = (&cfg.kda, s.a_log_padding > 0) {
        let per_layer = s.a_log_padding / s.num_kda_layers.max(1) as u64;
        writeln!(
            out,
            "  A_log stored as {} values per KDA layer, {} read: the {} padding values are counted",
            k.num_heads as u64 + per_layer,
            k.num_heads,
            grouped(s.a_log_padding)
        )?;
    }
    Ok(())
}

fn cache_lines(cfg: &ModelConfig, s: &ModelSummary, out: &mut impl Write) -> anyhow::Result<()> {
    let mla = s.mla_cache_elems_per_token;
    writeln!(
        out,
        "cache        MLA latent {} values/token over {} layers = {} B (bf16) / {} B (f32) per token",
        mla,
        s.num_mla_layers,
        grouped(mla * 2),
        grouped(mla * 4)
    )?;
    writeln!(
        out,
        "             KDA state {} per sequence (f32) + conv windows {} (bf16) / {} (f32), constant in length",
        si(s.kda_state_bytes_per_seq()),
        si(s.kda_conv_bytes_per_seq()),
        si(s.kda_conv_elems_per_seq * 4)
    )?;
    let max = cfg.max_position_embeddings as u64;
    let mut lengths = vec![4096, 131_072, max];
    lengths.retain(|&t| t <= max);
    lengths.dedup();
    let lengths: Vec<String> = lengths
        .iter()
        .map(|&t| format!("{} tokens {}", grouped(t), si(s.cache_bytes_per_seq(t))))
        .collect();
    writeln!(
        out,
        "             one sequence (f32 state, bf16 windows and latents): {}",
        lengths.join(", ")
    )?;
    Ok(())
}

fn report_json(cfg: &ModelConfig, s: &ModelSummary, stored: Option<&Stored>) -> serde_json::Value {
    let layers: Vec<_> = cfg
        .layers
        .iter()
        .enumerate()
        .map(|(i, l)| {
            json!({"layer": i, "mixer": format!("{:?}", l.mixer), "ffn": format!("{:?}", l.ffn),
                   "params": s.params.per_layer[i], "config_bytes": s.layer_bytes[i],
                   "bytes": stored.map_or(0, |st| st.per_layer[i])})
        })
        .collect();
    let components: serde_json::Map<String, serde_json::Value> = s
        .components
        .iter()
        .map(|(c, size)| {
            (
                c.name().to_string(),
                json!({"params": size.params, "active_params": size.active_params,
                "bytes": size.bytes, "read_bytes_per_token": size.read_bytes}),
            )
        })
        .collect();
    let max = cfg.max_position_embeddings as u64;
    let (mla, kda_state, kda_conv) = (
        s.mla_cache_elems_per_token,
        s.kda_state_elems_per_seq,
        s.kda_conv_elems_per_seq,
    );
    json!({
        "model_type": cfg.model_type, "num_layers": cfg.layers.len(), "hidden_size": cfg.hidden_size,
        "vocab_size": cfg.vocab_size, "total_params": s.params.total, "active_params": s.params.active,
        "active_params_without_input_embedding": s.active_params_without_embedding(),
        "weight_dtype": s.weight_dtype.to_string(), "components": components,
        "config_bytes": s.total_bytes(), "routed_expert_bytes": s.routed_expert_bytes(),
        "non_expert_bytes": s.non_expert_bytes(), "bytes_per_expert": s.bytes_per_expert,
        "experts_per_layer": s.num_experts, "experts_per_token_per_layer": s.top_k,
        "moe_layers": s.num_moe_layers, "a_log_padding_values": s.a_log_padding,
        "read_bytes_per_token": s.read_bytes_per_token(),
        "weight_bytes": stored.map(|st| st.total), "bytes_by_dtype": stored.map(|st| &st.by_dtype),
        "layers": layers, "non_layer_bytes": stored.map_or(0, |st| st.other),
        "vision_bytes": stored.map_or(0, |st| st.vision),
        "mla_cache_values_per_token": mla,
        "mla_cache_bytes_per_token_bf16": mla * 2, "mla_cache_bytes_per_token_f32": mla * 4,
        "kda_state_bytes_per_sequence_f32": kda_state * 4, "kda_conv_bytes_per_sequence_bf16": kda_conv * 2,
        "kda_conv_bytes_per_sequence_f32": kda_conv * 4,
        "cache_bytes_per_sequence_at_max_context": s.cache_bytes_per_seq(max),
    })
}

fn layer_of(name: &str) -> Option<usize> {
    name.strip_prefix("model.layers.")?
        .split('.')
        .next()?
        .parse()
        .ok()
}

pub fn human(n: u64) -> String {
    match n {
        n if n >= 1_000_000_000_000 => format!("{:.4} T", n as f64 / 1e12),
        n if n >= 1_000_000_000 => format!("{:.2} B", n as f64 / 1e9),
        n if n >= 1_000_000 => format!("{:.2} M", n as f64 / 1e6),
        n if n >= 1_000 => format!("{:.1} K", n as f64 / 1e3),
        n => n.to_string(),
    }
}

/// Decimal bytes (the spec's and vendors' units).
pub fn si(n: u64) -> String {
    match n {
        n if n >= 1_000_000_000_000 => format!("{:.4} TB", n as f64 / 1e12),
        n if n >= 1_000_000_000 => format!("{:.2} GB", n as f64 / 1e9),
        n if n >= 1_000_000 => format!("{:.1} MB", n as f64 / 1e6),
        n if n >= 1_000 => format!("{:.1} kB", n as f64 / 1e3),
        n => format!("{n} B"),
    }
}

/// `n` with thousands separators.
pub fn grouped(n: u64) -> String {
    let digits = n.to_string();
    let mut out = String::with_capacity(digits.len() + digits.len() / 3);
    for (i, ch) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(ch);
    }
    out
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
