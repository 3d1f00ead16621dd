//! Writing a Kimi Linear model as a llama.cpp GGUF: names, shapes and metadata of
//! `convert_hf_to_gguf.py` (`KimiLinearModel`), types of [`super::quant_plan`].

use std::path::Path;

use kimi_core::config::Mixer;
use kimi_core::ModelConfig;
use kimi_gguf::{GgmlType, GgufWriter, Value};

use super::config::{ffn_schedule_is_leading_dense, metadata, ExtraHparams, ARCH};
use super::quant_plan::{plan, GgufQuant};
use super::recipes::{recipes, Layout, Recipe};
use super::source::ggml_type;
use crate::source::WeightSource;
use crate::{ModelError, Result};

/// How to write the file.
#[derive(Clone, Debug)]
pub struct ExportOptions {
    /// Tensor types.
    pub quant: GgufQuant,
    /// `general.name`.
    pub name: String,
    /// Hyper-parameters of `config.json` that [`ModelConfig`] does not keep.
    pub extra: ExtraHparams,
    /// Further metadata (a tokenizer's `tokenizer.ggml.*`), written after the model's.
    pub extra_metadata: Vec<(String, Value)>,
}

/// One tensor of the file to be written.
#[derive(Clone, Debug)]
pub struct PlannedTensor {
    /// GGUF name.
    pub name: String,
    /// Shape, outermost first (ggml `ne` reversed).
    pub shape: Vec<usize>,
    /// Stored type.
    pub ggml_type: GgmlType,
    /// Why the type differs from the mixture's choice, if it does.
    pub fallback: Option<String>,
}

/// A checked conversion, ready to write.
pub struct ExportPlan {
    config: ModelConfig,
    recipes: Vec<Recipe>,
    writer: GgufWriter<'static>,
    /// The tensors, in file order.
    pub tensors: Vec<PlannedTensor>,
    /// Things llama.cpp will not read the way kimi-infer does.
    pub warnings: Vec<String>,
}

/// llama.cpp's `kimi-linear` layout has no names for Kimi K3's extensions (the forks that
/// convert K3 disagree on them, K3 spec §7 item 12), so such a config is refused by name.
fn refuse_k3_variants(config: &ModelConfig) -> Result<()> {
    use kimi_core::config::{Activation, ExpertFormat, Family, KdaOutputGate};
    let mut found = Vec::new();
    if config.family == Family::KimiK3 {
        found.push("the Kimi K3 wrapper");
    }
    if config.activation != Activation::Silu {
        found.push("SiTU");
    }
    if config.attn_res_block_size.is_some() {
        found.push("Block AttnRes");
    }
    if let Some(m) = &config.moe {
        if m.latent.is_some() {
            found.push("LatentMoE");
        }
        if m.expert_format == ExpertFormat::Mxfp4 {
            found.push("MXFP4 experts");
        }
    }
    if config.mla.as_ref().is_some_and(|m| m.output_gate) {
        found.push("the MLA output gate");
    }
    if config
        .kda
        .as_ref()
        .is_some_and(|k| k.output_gate == KdaOutputGate::FullRank)
    {
        found.push("the full-rank KDA gate");
    }
    if found.is_empty() {
        return Ok(());
    }
    Err(crate::ModelError::Input(format!(
        "GGUF export writes llama.cpp's kimi-linear layout, which has no tensors for {}; \
         converting Kimi K3 to GGUF is not supported yet",
        found.join(", ")
    )))
}

/// Plans the GGUF of `config` with weights from `source`: every tensor's name, shape and
/// type, and the metadata. Fails before anything is written if a tensor is missing.
pub fn plan_export(
    source: &dyn WeightSource,
    config: &ModelConfig,
    opts: &ExportOptions,
) -> Result<ExportPlan> {
    refuse_k3_variants(config)?;
    let mut recipes = recipes(config);
    recipes.retain(|r| !r.optional || r.hub.iter().all(|h| source.contains(h)));
    let num_experts = config.moe.as_ref().map_or(0, |m| m.num_experts);
    let choices = plan(&recipes, opts.quant, config.layers.len(), num_experts);
    let mut writer = GgufWriter::new();
    let mut meta = vec![
        (
            "general.architecture".to_string(),
            Value::String(ARCH.into()),
        ),
        ("general.type".to_string(), Value::String("model".into())),
        ("general.name".to_string(), Value::String(opts.name.clone())),
    ];
    meta.extend(metadata(config, &opts.extra));
    meta.push((
        "general.file_type".into(),
        Value::U32(opts.quant.file_type()),
    ));
    meta.push(("general.quantization_version".into(), Value::U32(2)));
    let ids = [
        ("tokenizer.ggml.bos_token_id", config.bos_token_id),
        (
            "tokenizer.ggml.eos_token_id",
            config.eos_token_ids.first().copied(),
        ),
        ("tokenizer.ggml.padding_token_id", config.pad_token_id),
    ];
    let tokenizer_keys: Vec<&str> = opts
        .extra_metadata
        .iter()
        .map(|(k, _)| k.as_str())
        .collect();
    for (k, id) in ids {
        if let (Some(id), false) = (id, tokenizer_keys.contains(&k)) {
            meta.push((k.into(), Value::U32(id)));
        }
    }
    meta.extend(opts.extra_metadata.iter().cloned());
    for (k, v) in meta {
        writer.add_metadata(k, v)?;
    }
    let mut tensors = Vec::with_capacity(recipes.len());
    for (r, c) in recipes.iter().zip(choices) {
        writer.add_tensor_info(&r.gguf, &r.shape, c.ggml_type)?;
        tensors.push(PlannedTensor {
            name: r.gguf.clone(),
            shape: r.shape.clone(),
            ggml_type: c.ggml_type,
            fallback: c.fallback,
        });
    }
    Ok(ExportPlan {
        warnings: warnings(config),
        config: config.clone(),
        recipes,
        writer,
        tensors,
    })
}

fn warnings(config: &ModelConfig) -> Vec<String> {
    let mut w = Vec::new();
    if !ffn_schedule_is_leading_dense(config) {
        w.push(
            "the dense/MoE layer schedule is not `leading dense, then all MoE`: llama.cpp reads \
             only leading_dense_block_count (kimi-infer reads the tensors present)"
                .into(),
        );
    }
    if let (Some(k), Some(m)) = (&config.kda, &config.mla) {
        let both = config.layers.iter().any(|s| s.mixer == Mixer::Kda)
            && config.layers.iter().any(|s| s.mixer == Mixer::Mla);
        if both && k.num_heads != m.num_heads {
            w.push(format!(
                "KDA has {} heads and MLA {}: written as a per-layer attention.head_count, which \
                 llama.cpp's kimi-linear graph does not support",
                k.num_heads, m.num_heads
            ));
        }
    }
    if config
        .moe
        .as_ref()
        .is_some_and(|m| m.weights_use_correction_bias)
    {
        w.push("router weights from bias-corrected scores cannot be stored in GGUF".into());
    }
    w
}

impl ExportPlan {
    /// Writes the file, reading, converting and quantizing one tensor at a time;
    /// `progress(i, tensor)` is called before tensor `i` is produced.
    pub fn write(
        &self,
        source: &dyn WeightSource,
        path: &Path,
        progress: &mut dyn FnMut(usize, &PlannedTensor),
    ) -> Result<()> {
        self.writer.write_streamed(path, |i| -> Result<Vec<u8>> {
            let t = &self.tensors[i];
            progress(i, t);
            let values = gguf_values(source, &self.recipes[i], &self.config)?;
            kimi_gguf::quantize(t.ggml_type, &values).map_err(|e| ModelError::Format {
                path: path.to_path_buf(),
                reason: format!("tensor `{}`: {e}", t.name),
            })
        })
    }
}

/// The values of a GGUF tensor, in its memory order, as f32.
fn gguf_values(source: &dyn WeightSource, r: &Recipe, config: &ModelConfig) -> Result<Vec<f32>> {
    let mut out = Vec::new();
    for hub in &r.hub {
        out.extend(hub_values(source, hub, &r.hub_shape)?);
    }
    match r.layout {
        Layout::Same | Layout::Stacked => Ok(out),
        // f64 so that the loader's ln(-x) gives A_log back within an ulp.
        Layout::NegExp => Ok(out.iter().map(|&a| -(a as f64).exp() as f32).collect()),
        Layout::KvBKeys | Layout::KvBValues => {
            let Some(mla) = &config.mla else {
                return Ok(out);
            };
            Ok(split_kv_b(&out, r, mla.qk_nope_head_dim, mla.v_head_dim))
        }
    }
}

/// One half of `kv_b_proj` `[heads·(nope + v), rank]`: keys transposed per head
/// `[heads, rank, nope]`, or values `[heads, v, rank]`.
fn split_kv_b(kv_b: &[f32], r: &Recipe, nope: usize, v: usize) -> Vec<f32> {
    let rank = r.hub_shape.get(1).copied().unwrap_or(0);
    let heads = r.shape.first().copied().unwrap_or(0);
    let mut out = Vec::with_capacity(kv_b.len());
    for h in 0..heads {
        let head = &kv_b[h * (nope + v) * rank..(h + 1) * (nope + v) * rank];
        if r.layout == Layout::KvBKeys {
            for c in 0..rank {
                out.extend((0..nope).map(|j| head[j * rank + c]));
            }
        } else {
            out.extend_from_slice(&head[nope * rank..]);
        }
    }
    out
}

fn hub_values(source: &dyn WeightSource, name: &str, shape: &[usize]) -> Result<Vec<f32>> {
    let (dtype, bytes) = source.load(name, shape)?;
    let ty = ggml_type(dtype).ok_or_else(|| {
        ModelError::Input(format!(
            "`{name}` has dtype {dtype}, which cannot be converted"
        ))
    })?;
    Ok(kimi_gguf::dequantize(ty, &bytes, shape.iter().product())?)
}
