//! Kimi K3's config as released: the multimodal wrapper and the text model's extensions.
//!
//! Key names follow `shared/docs/kimi-k3-spec.md` §1: a `KimiK3ForConditionalGeneration`
//! wrapper (`model_type` `kimi_k3`) whose `text_config` is a `kimi_linear` config with extra
//! keys (SiTU, AttnRes, LatentMoE, gated MLA, the safe KDA gate) and, nested inside it, the
//! `quantization_config` of the MXFP4 routed experts. The extensions parse in `parse.rs` for
//! any Kimi Linear-style config; this file holds what is K3's own.

use serde_json::{Map, Value};

use super::fields::{describe, invalid, Fields};
use super::{ConfigError, ExpertFormat};

/// `model_type` of the K3 multimodal wrapper.
pub(super) const K3_MODEL_TYPE: &str = "kimi_k3";

/// Whether an architecture name belongs to the Kimi K3 family.
pub(super) fn is_k3_architecture(name: &str) -> bool {
    name.starts_with("KimiK3")
}

/// The text model's object of a K3 wrapper: `text_config`, or the wrapper itself where a
/// flattened config has none (as mlx-lm accepts).
pub(super) fn text_config<'a>(
    root: Fields<'a>,
    obj: &'a Map<String, Value>,
) -> Result<Fields<'a>, ConfigError> {
    match root.object_opt("text_config")? {
        Some(text) => {
            let text = Fields::new(text, "text_config.");
            match text.str_opt(&["model_type"])? {
                None | Some("kimi_linear") => Ok(text),
                Some(other) => Err(ConfigError::Unsupported(format!(
                    "text_config.model_type {other:?}: a Kimi K3 wrapper holds a `kimi_linear` \
                     text model"
                ))),
            }
        }
        None => Ok(Fields::new(obj, "")),
    }
}

/// The `quant_method`s of `quantization_config` that kimi-infer reads (see kimi-model's
/// `quantized` module).
pub const QUANT_METHODS: [&str; 4] = ["compressed-tensors", "awq", "gptq", "fp8"];

/// The compressed-tensors `format`s kimi-infer reads.
const COMPRESSED_FORMATS: [&str; 5] = [
    "pack-quantized",
    "int-quantized",
    "float-quantized",
    "naive-quantized",
    "mxfp4-pack-quantized",
];

/// The routed experts' storage named by a `quantization_config` (in `text_config`, or at the
/// top level where a tool hoisted it, as vLLM does): K3's MXFP4 experts, or `Dense` for
/// every other method kimi-infer reads, whose matrices the weight decoder answers one by one.
pub(super) fn expert_format(
    text: Fields<'_>,
    wrapper: Option<Fields<'_>>,
) -> Result<ExpertFormat, ConfigError> {
    let quant = text
        .get("quantization_config")
        .map(|q| (q, text.name("quantization_config")))
        .or_else(|| {
            wrapper.and_then(|w| {
                w.get("quantization_config")
                    .map(|q| (q, w.name("quantization_config")))
            })
        });
    let Some((quant, field)) = quant else {
        return Ok(ExpertFormat::Dense);
    };
    let Some(q) = quant.as_object() else {
        return Err(invalid(
            field,
            format!("expected an object, found {}", describe(quant)),
        ));
    };
    let text_of = |key: &str| q.get(key).and_then(Value::as_str);
    let method = text_of("quant_method").unwrap_or("(absent)");
    let format = text_of("format").unwrap_or("(absent)");
    if !QUANT_METHODS.contains(&method) {
        return Err(ConfigError::Unsupported(format!(
            "{field}.quant_method {method:?}: kimi-infer reads quantized checkpoints of {}",
            QUANT_METHODS.join(", ")
        )));
    }
    if method == "compressed-tensors" && !COMPRESSED_FORMATS.contains(&format) {
        return Err(ConfigError::Unsupported(format!(
            "{field}.format {format:?}: kimi-infer reads the compressed-tensors formats \
             pack-quantized (INT4/INT8), int-quantized (INT8), float-quantized (FP8 E4M3), \
             naive-quantized and mxfp4-pack-quantized (MXFP4)"
        )));
    }
    if method != "compressed-tensors" || format != "mxfp4-pack-quantized" {
        // Every matrix answers for itself by name: kimi-model's weight decoder reads the
        // format's tensors (and refuses what it cannot read, naming the tensor and field).
        return Ok(ExpertFormat::Dense);
    }
    if let Some(status) = text_of("quantization_status") {
        if status != "compressed" {
            return Err(ConfigError::Unsupported(format!(
                "{field}.quantization_status {status:?}: only packed (\"compressed\") \
                 checkpoints are read"
            )));
        }
    }
    // Every config group must describe 4-bit float weights in groups of 32 (the packing the
    // loader reads); anything else would be misread silently.
    if let Some(groups) = q.get("config_groups").and_then(Value::as_object) {
        for (name, group) in groups {
            let weights = group.get("weights");
            let num = |key: &str| weights.and_then(|w| w.get(key)).and_then(Value::as_u64);
            let kind = weights.and_then(|w| w.get("type")).and_then(Value::as_str);
            if num("num_bits") != Some(4) || num("group_size") != Some(32) || kind != Some("float")
            {
                return Err(ConfigError::Unsupported(format!(
                    "{field}.config_groups.{name}.weights: expected MXFP4 (num_bits 4, type \
                     \"float\", group_size 32), found {}",
                    weights.map_or_else(|| "nothing".into(), Value::to_string)
                )));
            }
            if group.get("input_activations").is_some_and(|a| !a.is_null()) {
                return Err(ConfigError::Unsupported(format!(
                    "{field}.config_groups.{name}.input_activations: quantized activations \
                     in the checkpoint are not supported (K3 ships weight-only MXFP4)"
                )));
            }
        }
    }
    Ok(ExpertFormat::Mxfp4)
}
