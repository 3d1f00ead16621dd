//! Writing a Kimi Linear or Kimi K3 model as a llama.cpp GGUF: names, shapes and metadata of
//! `convert_hf_to_gguf.py` (`KimiLinearModel`; `kimi-k3` as llama.cpp's K3 graph reads it),
//! types of [`super::quant_plan`]. K3's MXFP4 experts are copied as ggml `MXFP4` blocks, bit
//! for bit, whatever the type of the rest.

use std::path::Path;

use kimi_core::config::Mixer;
use kimi_core::{DType, ModelConfig};
use kimi_gguf::{GgmlType, GgufWriter, Value};

use super::config::{arch_of, ffn_schedule_is_leading_dense, metadata, ExtraHparams};
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

/// llama.cpp's `kimi-linear` layout has no names for Kimi K3's extensions, so a Kimi Linear
/// config that uses them is refused by name (a K3 checkpoint is written as `kimi-k3`); and
/// `kimi-k3` always runs SiTU, so a K3 config without it is refused too.
fn refuse_unwritable(config: &ModelConfig) -> Result<()> {
    use kimi_core::config::{Activation, ExpertFormat, Family, KdaOutputGate};
    if config.family == Family::KimiK3 {
        if config.activation == Activation::Silu {
            return Err(crate::ModelError::Input(
                "llama.cpp's kimi-k3 layout always runs SiTU; this K3 config uses SwiGLU".into(),
            ));
        }
        return Ok(());
    }
    let mut found = Vec::new();
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
        "GGUF export writes a Kimi Linear checkpoint in llama.cpp's kimi-linear layout, which has \
         no tensors for {}; only a Kimi K3 checkpoint (model_type kimi_k3) is written as kimi-k3",
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
    refuse_unwritable(config)?;
    let mut recipes = recipes(config);
    recipes.retain(|r| !r.optional || r.hub.iter().all(|h| source.contains(h)));
    let num_experts = config.moe.as_ref().map_or(0, |m| m.num_experts);
    let choices = plan(&recipes, opts.quant, config.layers.len(), num_experts);
    let mut writer = GgufWriter::new();
    let mut meta = vec![
        (
            "general.architecture".to_string(),
            Value::String(arch_of(config).into()),
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
            let r = &self.recipes[i];
            if t.ggml_type == GgmlType::MXFP4 && r.layout == Layout::Stacked {
                return mxfp4_experts(source, r);
            }
            let values = gguf_values(source, r, &self.config)?;
            kimi_gguf::quantize(t.ggml_type, &values).map_err(|e| ModelError::Format {
                path: path.to_path_buf(),
                reason: format!("tensor `{}`: {e}", t.name),
            })
        })
    }
}

/// The values of a GGUF tensor, in its memory order, as f32.
fn gguf_values(source: &dyn WeightSource, r: &Recipe, config: &ModelConfig) -> Result<Vec<f32>> {
    match r.layout {
        // f32 products, as the model folds the mix when it loads a checkpoint.
        Layout::ResScore => {
            let d = r.hub_shape.iter().product::<usize>();
            let norm = hub_values(source, &r.hub[0], &r.hub_shape)?;
            let proj = hub_values(source, &r.hub[1], &[1, d])?;
            return Ok(norm.iter().zip(&proj).map(|(n, p)| n * p).collect());
        }
        Layout::NegExp => {
            let a_log = a_log_values(source, r)?;
            // f64 so that the loader's ln(-x) gives A_log back within an ulp.
            return Ok(a_log.iter().map(|&a| -(a as f64).exp() as f32).collect());
        }
        _ => {}
    }
    let mut out = Vec::new();
    for hub in &r.hub {
        out.extend(hub_values(source, hub, &r.hub_shape)?);
    }
    match r.layout {
        Layout::Same | Layout::Stacked | Layout::ResScore | Layout::NegExp => Ok(out),
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

/// `A_log`'s per-head values: K3 checkpoints store `[N ≥ H]`, the heads first and zero
/// padding after them (refused if not zero: the padding would be lost silently).
fn a_log_values(source: &dyn WeightSource, r: &Recipe) -> Result<Vec<f32>> {
    let heads: usize = r.shape.iter().product();
    let hub = &r.hub[0];
    let stored = match source.shape(hub) {
        Some(s) if s.len() == 1 && s[0] >= heads => s,
        _ => r.hub_shape.clone(),
    };
    let values = hub_values(source, hub, &stored)?;
    if let Some(i) = (heads..values.len()).find(|&i| values[i] != 0.0) {
        return Err(ModelError::Input(format!(
            "`{hub}`: entry {i} is {} but entries {heads}.. of a padded A_log must be zero",
            values[i]
        )));
    }
    Ok(values[..heads].to_vec())
}

/// A stacked expert tensor as ggml `MXFP4` blocks: each expert's two checkpoint planes
/// (`weight_packed` codes, `weight_scale` E8M0) repacked with the values unchanged, or its
/// stored blocks (a K3 GGUF read back); experts stored in another type are quantized.
fn mxfp4_experts(source: &dyn WeightSource, r: &Recipe) -> Result<Vec<u8>> {
    let [rows, cols] = r.hub_shape[..] else {
        return Err(ModelError::Input(format!("`{}` is not a matrix", r.gguf)));
    };
    let blocks = cols / 32;
    let mut out = Vec::with_capacity(r.hub.len() * rows * blocks * 17);
    for hub in &r.hub {
        let base = hub.strip_suffix(".weight").unwrap_or(hub);
        let packed = format!("{base}.weight_packed");
        if !source.contains(&packed) {
            let (dtype, bytes) = source.load(hub, &r.hub_shape)?;
            if dtype == DType::MXFP4 {
                out.extend_from_slice(&bytes);
            } else {
                out.extend(kimi_gguf::quantize(
                    GgmlType::MXFP4,
                    &hub_values(source, hub, &r.hub_shape)?,
                )?);
            }
            continue;
        }
        if !cols.is_multiple_of(32) {
            return Err(ModelError::Input(format!(
                "`{hub}`: MXFP4 rows of {cols} values are not whole 32-value blocks"
            )));
        }
        let scale = format!("{base}.weight_scale");
        let (codes_type, codes) = source.load(&packed, &[rows, cols / 2])?;
        let (scales_type, scales) = source.load(&scale, &[rows, blocks])?;
        out.extend(crate::layers::mxfp4_blocks(
            (&packed, codes_type, &codes),
            (&scale, scales_type, &scales),
            rows,
            cols,
        )?);
    }
    Ok(out)
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
