//! Assembles a validated [`ModelConfig`] from a decoded `config.json`.
//!
//! Defaults follow the transformers-5 `KimiLinearConfig` class (`configuration_kimi_linear.py`,
//! the team's reference) where it has one that is not just a 48B checkpoint value; sizes are
//! always required.

use serde_json::Value;

use crate::DType;

use super::fields::{as_uint, describe, invalid, to_usize, Fields, MAX_CONTEXT};
use super::schedule::{self, EXPERT_KEYS};
use super::{
    k3, Activation, ConfigError, ExpertFormat, Family, Ffn, KdaConfig, KdaGate, KdaOutputGate,
    LatentMoe, LayerSpec, Mixer, MlaConfig, ModelConfig, MoeConfig,
};

/// `model_type` of Kimi Linear (and of K3's text model).
const KIMI_LINEAR: &str = "kimi_linear";

/// Architectures that identify a Kimi Linear config without a `model_type`.
const KIMI_LINEAR_ARCHITECTURES: &[&str] = &["KimiLinearForCausalLM", "KimiLinearModel"];

/// `rms_norm_eps` when absent: the transformers-5 class default, 1e-5 (the released configs
/// also say 1e-5). The checkpoint's own `configuration_kimi.py` would default to 1e-6.
const DEFAULT_RMS_NORM_EPS: f32 = 1e-5;

/// `kv_a_layernorm` epsilon: hard-coded 1e-6 in the reference modeling code, not a config key
/// (vLLM and llama.cpp use 1e-5; see the spec's pitfall 2).
const LATENT_NORM_EPS: f32 = 1e-6;

/// `routed_scaling_factor` when absent: 1.0, the default of the checkpoint's
/// `configuration_kimi.py` (a neutral scale). The transformers-5 class instead defaults to the
/// 48B value 2.446; every released config writes the key, so the difference only matters for
/// hand-written configs.
const DEFAULT_ROUTED_SCALING: f32 = 1.0;

/// Parses and validates a whole config.
pub(super) fn model_config(value: &Value) -> Result<ModelConfig, ConfigError> {
    let Some(obj) = value.as_object() else {
        return Err(invalid(
            "(top level)",
            format!("expected a JSON object, found {}", describe(value)),
        ));
    };
    let root = Fields::new(obj, "");
    let (family, model_type) = identify(root)?;
    // K3 nests the text model's config; its token ids may sit at either level.
    let (text, wrapper) = match family {
        Family::KimiK3 => (k3::text_config(root, obj)?, Some(root)),
        Family::KimiLinear => (root, None),
    };
    if text.bool_opt(&["attention_bias"])? == Some(true) {
        return Err(ConfigError::Unsupported(
            "attention_bias = true: Kimi Linear attention projections have no bias".into(),
        ));
    }
    let activation = activation(text)?;
    let expert_format = k3::expert_format(text, wrapper)?;

    let vocab_size = text.positive(&["vocab_size"])?;
    let hidden_size = text.positive(&["hidden_size"])?;
    let num_layers = text.positive(&["num_hidden_layers"])?;
    let lac_prefix = if text.name("").is_empty() {
        "linear_attn_config."
    } else {
        "text_config.linear_attn_config."
    };
    let lac = text
        .object_opt("linear_attn_config")?
        .map(|o| Fields::new(o, lac_prefix));
    let mixers = schedule::mixers(text, lac, num_layers)?;
    let ffns = schedule::ffns(text, num_layers, schedule::names_experts(text))?;
    let layers: Vec<LayerSpec> = mixers
        .into_iter()
        .zip(ffns)
        .map(|(mixer, ffn)| LayerSpec { mixer, ffn })
        .collect();
    let uses_mixer = |m: Mixer| layers.iter().any(|l| l.mixer == m);
    let uses_ffn = |f: Ffn| layers.iter().any(|l| l.ffn == f);

    let kda = if uses_mixer(Mixer::Kda) {
        Some(kda_config(text, lac)?)
    } else {
        None
    };
    let mla = if uses_mixer(Mixer::Mla) {
        Some(mla_config(text)?)
    } else {
        None
    };
    let moe = if uses_ffn(Ffn::Moe) {
        Some(moe_config(text, hidden_size, expert_format)?)
    } else {
        None
    };
    let intermediate_size = dense_width(text, uses_ffn(Ffn::Dense))?;
    // transformers' `KimiLinearConfig` writes 0 for "off".
    let attn_res_block_size = text.count_opt(&["attn_res_block_size"])?.filter(|&n| n > 0);

    let context_keys = &["max_position_embeddings", "model_max_length"];
    // Absent: the transformers class default (1,048,576, the released model's context).
    let max_position_embeddings = text
        .positive_opt_max(context_keys, MAX_CONTEXT)?
        .unwrap_or(1 << 20);
    // The wrapper's ids win where both levels name them (K3 repeats them in `text_config`).
    let ids = wrapper.unwrap_or(text);
    let id_source = |key: &str| if ids.get(key).is_some() { ids } else { text };

    Ok(ModelConfig {
        model_type,
        family,
        vocab_size,
        hidden_size,
        layers,
        rms_norm_eps: text.positive_f32_or(&["rms_norm_eps"], DEFAULT_RMS_NORM_EPS)?,
        activation,
        attn_res_block_size,
        intermediate_size,
        kda,
        mla,
        moe,
        tie_word_embeddings: id_source("tie_word_embeddings")
            .bool_opt(&["tie_word_embeddings"])?
            .unwrap_or(false),
        bos_token_id: token_id(id_source("bos_token_id"), "bos_token_id", vocab_size)?,
        eos_token_ids: eos_token_ids(id_source("eos_token_id"), vocab_size)?,
        pad_token_id: token_id(id_source("pad_token_id"), "pad_token_id", vocab_size)?,
        max_position_embeddings,
        dtype: declared_dtype(text).or_else(|| wrapper.and_then(declared_dtype)),
    })
}

/// The float dtype a config declares for its weights. Lenient on purpose: the value only
/// sizes things, so an unknown spelling (`"auto"`) means "not declared", not an error.
fn declared_dtype(fields: Fields<'_>) -> Option<DType> {
    let name = ["dtype", "torch_dtype"]
        .iter()
        .find_map(|k| fields.get(k).and_then(Value::as_str))?;
    match name.strip_prefix("torch.").unwrap_or(name) {
        "bfloat16" | "bf16" => Some(DType::BF16),
        "float16" | "half" | "fp16" => Some(DType::F16),
        "float32" | "float" | "fp32" => Some(DType::F32),
        _ => None,
    }
}

/// Checks `model_type` / `architectures`: Kimi Linear, or Kimi K3's wrapper. Returns the
/// family and the `model_type` to record.
fn identify(root: Fields<'_>) -> Result<(Family, String), ConfigError> {
    let model_type = root.str_opt(&["model_type"])?;
    let architectures = architectures(root)?;
    let text_model_type = root
        .get("text_config")
        .and_then(|t| t.get("model_type"))
        .and_then(Value::as_str);
    let is_k3 = model_type == Some(k3::K3_MODEL_TYPE)
        || architectures.iter().any(|a| k3::is_k3_architecture(a))
        || (root.get("text_config").is_some()
            && (matches!(model_type, None | Some(KIMI_LINEAR))
                || text_model_type == Some(KIMI_LINEAR)));
    let who = || {
        format!(
            "model_type `{}`, architectures [{}]",
            model_type.unwrap_or("(absent)"),
            architectures.join(", ")
        )
    };
    if is_k3 {
        return Ok((Family::KimiK3, k3::K3_MODEL_TYPE.into()));
    }
    match model_type {
        Some(KIMI_LINEAR) => Ok((Family::KimiLinear, KIMI_LINEAR.into())),
        None if architectures
            .iter()
            .any(|a| KIMI_LINEAR_ARCHITECTURES.contains(a)) =>
        {
            Ok((Family::KimiLinear, KIMI_LINEAR.into()))
        }
        None if architectures.is_empty() => Err(root.missing(&["model_type"])),
        _ => Err(ConfigError::Unsupported(format!(
            "{} is not a model kimi-infer runs (it runs Kimi Linear, model_type \
             `{KIMI_LINEAR}`, and Kimi K3, `{}`)",
            who(),
            k3::K3_MODEL_TYPE
        ))),
    }
}

/// The feed-forward blocks' gated unit: SwiGLU (`silu`) or K3's SiTU-GLU (`situ`, with its
/// two soft caps; mlx-lm and the reference default β₁ to 1 when absent).
fn activation(text: Fields<'_>) -> Result<Activation, ConfigError> {
    match text.str_opt(&["hidden_act"])?.unwrap_or("silu") {
        "silu" => Ok(Activation::Silu),
        "situ" => {
            let beta = text.positive_f32_or(&["activation_situ_beta"], 1.0)?;
            let linear_beta = match text.f32_opt(&["activation_situ_linear_beta"])? {
                Some(b) if b > 0.0 && b.is_finite() => Some(b),
                Some(b) => {
                    return Err(invalid(
                        text.name("activation_situ_linear_beta"),
                        format!("must be a positive number, found {b}"),
                    ))
                }
                None => None,
            };
            Ok(Activation::Situ { beta, linear_beta })
        }
        other => Err(ConfigError::Unsupported(format!(
            "{} {other:?}: kimi-infer runs SwiGLU (`silu`) and SiTU-GLU (`situ`) feed-forward \
             blocks only",
            text.name("hidden_act")
        ))),
    }
}

/// `architectures` as a list of names (empty when absent).
fn architectures<'a>(root: Fields<'a>) -> Result<Vec<&'a str>, ConfigError> {
    let Some(items) = root.array_opt("architectures")? else {
        return Ok(Vec::new());
    };
    items
        .iter()
        .enumerate()
        .map(|(i, item)| {
            item.as_str().ok_or_else(|| {
                invalid(
                    format!("architectures[{i}]"),
                    format!("expected a string, found {}", describe(item)),
                )
            })
        })
        .collect()
}

/// A value that may be given in `linear_attn_config` (hub) or at the top level (native); both
/// spellings must agree.
fn kda_value(
    root: Fields<'_>,
    lac: Option<Fields<'_>>,
    lac_key: &'static str,
    root_key: &'static str,
) -> Result<usize, ConfigError> {
    let nested = match lac {
        Some(lac) => lac.positive_opt(&[lac_key])?,
        None => None,
    };
    match (nested, root.positive_opt(&[root_key])?) {
        (Some(a), Some(b)) if a != b => Err(invalid(
            root_key,
            format!("is {b} but linear_attn_config.{lac_key} is {a}; they must agree"),
        )),
        (Some(v), _) | (None, Some(v)) => Ok(v),
        (None, None) => Err(ConfigError::Missing(format!(
            "linear_attn_config.{lac_key} / {root_key}"
        ))),
    }
}

/// KDA dimensions and gate.
fn kda_config(root: Fields<'_>, lac: Option<Fields<'_>>) -> Result<KdaConfig, ConfigError> {
    let nested = match lac {
        Some(lac) => lac.f32_opt(&["gate_lower_bound"])?,
        None => None,
    };
    let lower_bound = match (nested, root.f32_opt(&["gate_lower_bound"])?) {
        (Some(a), Some(b)) if a != b => {
            return Err(invalid(
                "gate_lower_bound",
                format!("is {b} but linear_attn_config.gate_lower_bound is {a}; they must agree"),
            ));
        }
        (a, b) => a.or(b),
    };
    let full_rank = match lac {
        Some(lac) => lac.bool_opt(&["use_full_rank_gate"])?,
        None => None,
    };
    let output_gate = match full_rank.or(root.bool_opt(&["use_full_rank_gate"])?) {
        Some(true) => KdaOutputGate::FullRank,
        _ => KdaOutputGate::LowRank,
    };
    let gate = match lower_bound {
        None => KdaGate::Softplus,
        Some(x) if x < 0.0 => KdaGate::LowerBound(x),
        Some(x) => {
            return Err(invalid(
                "linear_attn_config.gate_lower_bound",
                format!("must be negative (the per-step decay is exp of it), found {x}"),
            ));
        }
    };
    Ok(KdaConfig {
        num_heads: kda_value(root, lac, "num_heads", "linear_num_heads")?,
        head_dim: kda_value(root, lac, "head_dim", "linear_head_dim")?,
        conv_kernel: kda_value(
            root,
            lac,
            "short_conv_kernel_size",
            "linear_conv_kernel_dim",
        )?,
        gate,
        output_gate,
    })
}

/// MLA dimensions. Kimi Linear's MLA is NoPE; RoPE MLA is not implemented.
fn mla_config(root: Fields<'_>) -> Result<MlaConfig, ConfigError> {
    let qk_rope_head_dim = root
        .count_opt(&["qk_rope_head_dim"])?
        .ok_or_else(|| root.missing(&["qk_rope_head_dim"]))?;
    // The transformers-5 class (our reference) has no `mla_use_nope` field and is always
    // NoPE; its saved configs omit the key. Only an explicit `false` asks for RoPE.
    let nope = root.bool_opt(&["mla_use_nope"])?.unwrap_or(true) || qk_rope_head_dim == 0;
    if !nope {
        return Err(ConfigError::Unsupported(
            "MLA with rotary position embeddings (`mla_use_nope: false`) is not supported \
             yet; Kimi Linear checkpoints set `mla_use_nope: true`"
                .into(),
        ));
    }
    Ok(MlaConfig {
        num_heads: root.positive(&["num_attention_heads"])?,
        q_lora_rank: root.positive_opt(&["q_lora_rank"])?,
        kv_lora_rank: root.positive(&["kv_lora_rank"])?,
        qk_nope_head_dim: root.positive(&["qk_nope_head_dim"])?,
        qk_rope_head_dim,
        v_head_dim: root.positive(&["v_head_dim"])?,
        latent_norm_eps: LATENT_NORM_EPS,
        output_gate: root.bool_opt(&["mla_use_output_gate"])?.unwrap_or(false),
    })
}

/// Routing and sizes of the MoE layers.
fn moe_config(
    root: Fields<'_>,
    hidden_size: usize,
    expert_format: ExpertFormat,
) -> Result<MoeConfig, ConfigError> {
    let activation = root
        .str_opt(&["moe_router_activation_func"])?
        .unwrap_or("sigmoid");
    if activation != "sigmoid" {
        return Err(ConfigError::Unsupported(format!(
            "moe_router_activation_func {activation:?}: only sigmoid routing is supported"
        )));
    }
    if let Some(method) = root.str_opt(&["topk_method"])? {
        if method != "noaux_tc" {
            return Err(ConfigError::Unsupported(format!(
                "topk_method {method:?}: only bias-corrected selection (\"noaux_tc\") is supported"
            )));
        }
    }
    let num_experts = root.positive(EXPERT_KEYS)?;
    let top_k = root.positive(&["num_experts_per_token", "num_experts_per_tok"])?;
    let shared_keys = &["num_shared_experts", "n_shared_experts"];
    let num_shared_experts = root
        .count_opt(shared_keys)?
        .ok_or_else(|| root.missing(shared_keys))?;
    if top_k > num_experts {
        return Err(invalid(
            "num_experts_per_token",
            format!("is {top_k} but there are only {num_experts} routed experts"),
        ));
    }
    let grouped = root.bool_opt(&["use_grouped_topk"])?.unwrap_or(true);
    let (num_expert_groups, topk_group) = if grouped {
        groups(root, num_experts, top_k)?
    } else {
        (1, 1)
    };
    Ok(MoeConfig {
        num_experts,
        top_k,
        expert_intermediate_size: root.positive(&["moe_intermediate_size"])?,
        num_shared_experts,
        renormalize: root
            .bool_opt(&["moe_renormalize", "norm_topk_prob"])?
            .unwrap_or(true),
        routed_scaling_factor: root
            .positive_f32_or(&["routed_scaling_factor"], DEFAULT_ROUTED_SCALING)?,
        num_expert_groups,
        topk_group,
        weights_use_correction_bias: root
            .bool_opt(&["kimi_infer_router_weights_use_bias"])?
            .unwrap_or(false),
        latent: latent_moe(root, hidden_size, expert_format)?,
        expert_format,
    })
}

/// LatentMoE: present when `routed_expert_hidden_size` is given (the reference then builds the
/// down/up projections even at the hidden width). MXFP4 packs 32 inputs per scale, so every
/// expert input width must be a multiple of 32.
fn latent_moe(
    root: Fields<'_>,
    hidden_size: usize,
    expert_format: ExpertFormat,
) -> Result<Option<LatentMoe>, ConfigError> {
    let width = root.positive_opt(&["routed_expert_hidden_size"])?;
    let norm = root.bool_opt(&["latent_moe_use_norm"])?.unwrap_or(false);
    if expert_format == ExpertFormat::Mxfp4 {
        let expert_in = width.unwrap_or(hidden_size);
        let inner = root.positive(&["moe_intermediate_size"])?;
        for (field, n) in [
            ("routed_expert_hidden_size", expert_in),
            ("moe_intermediate_size", inner),
        ] {
            if !n.is_multiple_of(32) {
                return Err(invalid(
                    root.name(field),
                    format!("is {n}; MXFP4 experts need input widths that are multiples of 32"),
                ));
            }
        }
    }
    Ok(width.map(|width| LatentMoe { width, norm }))
}

/// Group-limited selection: `(num_expert_groups, topk_group)`, both defaulting to 1.
fn groups(
    root: Fields<'_>,
    num_experts: usize,
    top_k: usize,
) -> Result<(usize, usize), ConfigError> {
    let num_groups = root
        .positive_opt(&["num_expert_group", "n_group"])?
        .unwrap_or(1);
    let topk_group = root.positive_opt(&["topk_group"])?.unwrap_or(1);
    if num_experts.checked_rem(num_groups) != Some(0) {
        return Err(invalid(
            "num_expert_group",
            format!("{num_experts} routed experts cannot be split evenly into {num_groups} groups"),
        ));
    }
    if topk_group > num_groups {
        return Err(invalid(
            "topk_group",
            format!(
                "is {topk_group} but there are only {num_groups} expert groups (num_expert_group)"
            ),
        ));
    }
    let reachable = topk_group * (num_experts / num_groups);
    if reachable < top_k {
        return Err(invalid(
            "topk_group",
            format!(
                "keeping {topk_group} of {num_groups} groups leaves {reachable} experts, fewer \
                 than num_experts_per_token ({top_k})"
            ),
        ));
    }
    Ok((num_groups, topk_group))
}

/// Width of the dense MLP: `dense_ffn_hidden` when given (a transformers-5 key that falls back
/// to `intermediate_size`), else `intermediate_size`. Required only when a layer is dense;
/// otherwise 0 when absent.
fn dense_width(root: Fields<'_>, needed: bool) -> Result<usize, ConfigError> {
    let width = match root.positive_opt(&["dense_ffn_hidden"])? {
        Some(w) => Some(w),
        None => root.positive_opt(&["intermediate_size"])?,
    };
    match width {
        Some(w) => Ok(w),
        None if needed => Err(root.missing(&["intermediate_size"])),
        None => Ok(0),
    }
}

/// An optional token id, which must be a row of the embedding.
fn token_id(
    root: Fields<'_>,
    key: &'static str,
    vocab_size: usize,
) -> Result<Option<u32>, ConfigError> {
    let Some(value) = root.get(key) else {
        return Ok(None);
    };
    checked_id(key, value, vocab_size).map(Some)
}

/// `eos_token_id`: a number, a list of numbers, or absent (no ids).
fn eos_token_ids(root: Fields<'_>, vocab_size: usize) -> Result<Vec<u32>, ConfigError> {
    match root.get("eos_token_id") {
        None => Ok(Vec::new()),
        Some(Value::Array(items)) => items
            .iter()
            .enumerate()
            .map(|(i, item)| checked_id(&format!("eos_token_id[{i}]"), item, vocab_size))
            .collect(),
        Some(value) => Ok(vec![checked_id("eos_token_id", value, vocab_size)?]),
    }
}

/// Reads one token id and checks it against the vocabulary.
fn checked_id(field: &str, value: &Value, vocab_size: usize) -> Result<u32, ConfigError> {
    let id = as_uint(field, value, u64::from(u32::MAX))?;
    if to_usize(id) >= vocab_size {
        return Err(invalid(
            field,
            format!("token id {id} is not below vocab_size ({vocab_size})"),
        ));
    }
    u32::try_from(id).map_err(|_| invalid(field, format!("token id {id} does not fit in 32 bits")))
}
