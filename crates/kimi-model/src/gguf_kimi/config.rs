//! Kimi Linear hyper-parameters as llama.cpp's GGUF metadata (`kimi-linear.*` keys, written
//! by `convert_hf_to_gguf.py` `KimiLinearModel.set_gguf_parameters` and read by
//! `src/models/kimi-linear.cpp`), both ways.
//!
//! GGUF cannot say everything a `config.json` says; what it lacks is decided here:
//! * layer kinds: `attention.head_count_kv` per layer, 0 for KDA (llama.cpp's convention);
//!   dense vs MoE feed-forward from the tensors present (`leading_dense_block_count` alone
//!   cannot express the fixtures' irregular schedules);
//! * `kv_a_layernorm` epsilon: no key exists; the reference's 1e-6 (spec §6) is used;
//! * the remote-code routing flag (`kimi_infer_router_weights_use_bias`): off, as in llama.cpp.

use kimi_core::config::{
    Activation, ExpertFormat, Family, Ffn, KdaConfig, KdaGate, KdaOutputGate, LayerSpec, Mixer,
    MlaConfig, MoeConfig,
};
use kimi_core::{ConfigError, ModelConfig};
use kimi_gguf::{Array, GgufFile, Value};

use crate::source::format_error;
use crate::Result;

/// `general.architecture` of a Kimi Linear GGUF.
pub const ARCH: &str = "kimi-linear";

/// The reference `kv_a_layernorm` epsilon (GGUF has no key for it).
const LATENT_NORM_EPS: f32 = 1e-6;

/// `ExpertGatingFuncType.SIGMOID` in gguf-py.
const GATING_SIGMOID: u32 = 2;

fn key(name: &str) -> String {
    format!("{ARCH}.{name}")
}

/// What `config.json` holds that [`ModelConfig`] does not, but llama.cpp's converter writes.
#[derive(Clone, Debug, Default)]
pub struct ExtraHparams {
    /// `rope_theta` (unused by the NoPE model; written as `rope.freq_base`).
    pub rope_theta: Option<f32>,
    /// The legacy `head_dim` (written as `attention.value_length`, as the converter does).
    pub head_dim: Option<u32>,
}

fn u32_of(n: usize) -> Value {
    Value::U32(u32::try_from(n).unwrap_or(u32::MAX))
}

fn per_layer(values: impl Iterator<Item = usize>) -> Value {
    Value::Array(Array::I32(
        values
            .map(|v| i32::try_from(v).unwrap_or(i32::MAX))
            .collect(),
    ))
}

/// The `kimi-linear.*` metadata of `config`, in the converter's order.
pub(crate) fn metadata(config: &ModelConfig, extra: &ExtraHparams) -> Vec<(String, Value)> {
    let mut m: Vec<(String, Value)> = Vec::new();
    let mut put = |k: &str, v: Value| m.push((key(k), v));
    put("block_count", u32_of(config.layers.len()));
    put("context_length", u32_of(config.max_position_embeddings));
    put("embedding_length", u32_of(config.hidden_size));
    put("feed_forward_length", u32_of(config.intermediate_size));
    let heads = |spec: &LayerSpec| match spec.mixer {
        Mixer::Kda => config.kda.as_ref().map_or(0, |k| k.num_heads),
        Mixer::Mla => config.mla.as_ref().map_or(0, |a| a.num_heads),
    };
    let first = config.layers.first().map_or(0, heads);
    if config.layers.iter().all(|s| heads(s) == first) {
        put("attention.head_count", u32_of(first));
    } else {
        // llama.cpp's kimi-linear graph assumes one head count; an array keeps ours exact.
        put(
            "attention.head_count",
            per_layer(config.layers.iter().map(heads)),
        );
    }
    // The converter forces MLA to MQA (one KV head) and marks KDA layers with 0.
    let kv = config
        .layers
        .iter()
        .map(|s| usize::from(s.mixer == Mixer::Mla));
    put("attention.head_count_kv", per_layer(kv));
    if let Some(theta) = extra.rope_theta {
        put("rope.freq_base", Value::F32(theta));
    }
    put(
        "attention.layer_norm_rms_epsilon",
        Value::F32(config.rms_norm_eps),
    );
    if let Some(moe) = &config.moe {
        put("expert_count", u32_of(moe.num_experts));
        put("expert_used_count", u32_of(moe.top_k));
        put("expert_group_count", u32_of(moe.num_expert_groups));
        put("expert_group_used_count", u32_of(moe.topk_group));
        put("expert_gating_func", Value::U32(GATING_SIGMOID));
    }
    if let Some(mla) = &config.mla {
        put(
            "attention.key_length",
            u32_of(mla.kv_lora_rank + mla.qk_rope_head_dim),
        );
    }
    if let Some(head_dim) = extra.head_dim {
        put("attention.value_length", Value::U32(head_dim));
    }
    put("vocab_size", u32_of(config.vocab_size));
    if let Some(kda) = &config.kda {
        put("ssm.conv_kernel", u32_of(kda.conv_kernel));
        put("kda.head_dim", u32_of(kda.head_dim));
        if let KdaGate::LowerBound(bound) = kda.gate {
            put("kda.gate_lower_bound", Value::F32(bound));
        }
    }
    if let Some(mla) = &config.mla {
        if let Some(q) = mla.q_lora_rank {
            put("attention.q_lora_rank", u32_of(q));
        }
        put("attention.kv_lora_rank", u32_of(mla.kv_lora_rank));
        put("rope.dimension_count", u32_of(mla.qk_rope_head_dim));
        put(
            "attention.key_length_mla",
            u32_of(mla.qk_nope_head_dim + mla.qk_rope_head_dim),
        );
        put("attention.value_length_mla", u32_of(mla.v_head_dim));
    }
    if let Some(moe) = &config.moe {
        put(
            "expert_feed_forward_length",
            u32_of(moe.expert_intermediate_size),
        );
        put("expert_shared_count", u32_of(moe.num_shared_experts));
        let lead = config
            .layers
            .iter()
            .take_while(|s| s.ffn == Ffn::Dense)
            .count();
        put("leading_dense_block_count", u32_of(lead));
        put(
            "expert_weights_scale",
            Value::F32(moe.routed_scaling_factor),
        );
        put("expert_weights_norm", Value::Bool(moe.renormalize));
    }
    m
}

/// Whether llama.cpp's `leading_dense_block_count` describes the FFN schedule exactly.
pub(crate) fn ffn_schedule_is_leading_dense(config: &ModelConfig) -> bool {
    let lead = config
        .layers
        .iter()
        .take_while(|s| s.ffn == Ffn::Dense)
        .count();
    config.layers[lead..].iter().all(|s| s.ffn == Ffn::Moe)
}

/// Reads the model configuration of a Kimi Linear GGUF.
pub fn config_from_gguf(file: &GgufFile) -> Result<ModelConfig> {
    let arch = file.get_str("general.architecture")?;
    if arch != ARCH {
        return Err(format_error(
            file,
            format!("general.architecture is `{arch}`, not `{ARCH}`"),
        ));
    }
    let n = |k: &str| -> Result<usize> { Ok(file.get_u64(&key(k))? as usize) };
    let opt = |k: &str| -> Result<Option<usize>> {
        match file.get(&key(k)) {
            Some(_) => n(k).map(Some),
            None => Ok(None),
        }
    };
    let num_layers = n("block_count")?;
    let kv_heads = per_layer_values(file, "attention.head_count_kv", num_layers)?;
    let heads = per_layer_values(file, "attention.head_count", num_layers)?;
    let mixers: Vec<Mixer> = kv_heads
        .iter()
        .map(|&kv| if kv == 0 { Mixer::Kda } else { Mixer::Mla })
        .collect();
    let heads_of = |mixer: Mixer| -> Result<Option<usize>> {
        let mut it = mixers.iter().zip(&heads).filter(|(m, _)| **m == mixer);
        let Some((_, &first)) = it.next() else {
            return Ok(None);
        };
        if it.any(|(_, &h)| h != first) {
            return Err(format_error(
                file,
                format!(
                    "{} layers with different attention.head_count",
                    mixer_name(mixer)
                ),
            ));
        }
        Ok(Some(first))
    };
    let kda = match heads_of(Mixer::Kda)? {
        None => None,
        Some(num_heads) => Some(KdaConfig {
            num_heads,
            head_dim: n("kda.head_dim")?,
            conv_kernel: n("ssm.conv_kernel")?,
            gate: match file.get(&key("kda.gate_lower_bound")) {
                Some(_) => KdaGate::LowerBound(file.get_f32(&key("kda.gate_lower_bound"))?),
                None => KdaGate::Softplus,
            },
            output_gate: KdaOutputGate::LowRank,
        }),
    };
    let mla = match heads_of(Mixer::Mla)? {
        None => None,
        Some(num_heads) => {
            let rope = n("rope.dimension_count")?;
            let qk = n("attention.key_length_mla")?;
            let qk_nope_head_dim = qk.checked_sub(rope).ok_or_else(|| {
                format_error(
                    file,
                    format!("key_length_mla {qk} < rope.dimension_count {rope}"),
                )
            })?;
            Some(MlaConfig {
                num_heads,
                q_lora_rank: opt("attention.q_lora_rank")?.filter(|&q| q > 0),
                kv_lora_rank: n("attention.kv_lora_rank")?,
                qk_nope_head_dim,
                qk_rope_head_dim: rope,
                v_head_dim: n("attention.value_length_mla")?,
                latent_norm_eps: LATENT_NORM_EPS,
                output_gate: false,
            })
        }
    };
    // A layer is MoE when its router is present (see the module comment).
    let ffns: Vec<Ffn> = (0..num_layers)
        .map(
            |i| match file.tensor(&format!("blk.{i}.ffn_gate_inp.weight")) {
                Ok(_) => Ffn::Moe,
                Err(_) => Ffn::Dense,
            },
        )
        .collect();
    let moe = if ffns.contains(&Ffn::Moe) {
        Some(moe_config(file)?)
    } else {
        None
    };
    let intermediate_size = if ffns.contains(&Ffn::Dense) {
        n("feed_forward_length")?
    } else {
        opt("feed_forward_length")?.unwrap_or(0)
    };
    let token = |k: &str| -> Result<Option<u32>> {
        match file.get(k) {
            Some(_) => Ok(Some(file.get_u32(k)?)),
            None => Ok(None),
        }
    };
    let vocab_size = match opt("vocab_size")? {
        Some(v) => v,
        None => file
            .tensor("token_embd.weight")?
            .info
            .shape_outer_first()
            .first()
            .copied()
            .unwrap_or(0),
    };
    let config = ModelConfig {
        model_type: "kimi_linear".into(),
        family: Family::KimiLinear,
        activation: Activation::Silu,
        attn_res_block_size: None,
        vocab_size,
        hidden_size: n("embedding_length")?,
        layers: mixers
            .into_iter()
            .zip(ffns)
            .map(|(mixer, ffn)| LayerSpec { mixer, ffn })
            .collect(),
        rms_norm_eps: file.get_f32(&key("attention.layer_norm_rms_epsilon"))?,
        intermediate_size,
        kda,
        mla,
        moe,
        tie_word_embeddings: file.tensor("output.weight").is_err(),
        bos_token_id: token("tokenizer.ggml.bos_token_id")?,
        eos_token_ids: token("tokenizer.ggml.eos_token_id")?.into_iter().collect(),
        pad_token_id: token("tokenizer.ggml.padding_token_id")?,
        max_position_embeddings: n("context_length")?,
        // GGUF tensors carry their own types; there is no declared checkpoint dtype.
        dtype: None,
    };
    config.validate().map_err(|e| match e {
        ConfigError::Invalid { field, reason } => {
            format_error(file, format!("{}: {reason}", gguf_key(&field)))
        }
        other => format_error(file, other.to_string()),
    })?;
    Ok(config)
}

/// The metadata key that holds a config.json field (as `ModelConfig::validate` names it).
fn gguf_key(field: &str) -> String {
    let name = match field {
        "rms_norm_eps" => "attention.layer_norm_rms_epsilon",
        "routed_scaling_factor" => "expert_weights_scale",
        "num_experts_per_token" => "expert_used_count",
        "num_experts" => "expert_count",
        "moe_intermediate_size" => "expert_feed_forward_length",
        "n_group" => "expert_group_count",
        "topk_group" => "expert_group_used_count",
        "linear_attn_config.gate_lower_bound" => "kda.gate_lower_bound",
        "linear_attn_config.head_dim" => "kda.head_dim",
        "linear_attn_config.short_conv_kernel_size" => "ssm.conv_kernel",
        "linear_attn_config.num_heads" | "num_attention_heads" => "attention.head_count",
        "kv_lora_rank" => "attention.kv_lora_rank",
        "v_head_dim" => "attention.value_length_mla",
        "hidden_size" => "embedding_length",
        "num_hidden_layers" => "block_count",
        "intermediate_size" => "feed_forward_length",
        "max_position_embeddings" => "context_length",
        "vocab_size" => "vocab_size (or token_embd.weight's rows)",
        other => return other.to_string(),
    };
    key(name)
}

fn moe_config(file: &GgufFile) -> Result<MoeConfig> {
    let n = |k: &str| -> Result<usize> { Ok(file.get_u64(&key(k))? as usize) };
    let n_or = |k: &str, default: usize| -> Result<usize> {
        match file.get(&key(k)) {
            Some(_) => n(k),
            None => Ok(default),
        }
    };
    if file.get(&key("expert_gating_func")).is_some() {
        let f = file.get_u32(&key("expert_gating_func"))?;
        if f != GATING_SIGMOID {
            return Err(format_error(
                file,
                format!("expert_gating_func {f} is not sigmoid (2), which Kimi Linear uses"),
            ));
        }
    }
    let num_expert_groups = n_or("expert_group_count", 1)?;
    Ok(MoeConfig {
        num_experts: n("expert_count")?,
        top_k: n("expert_used_count")?,
        expert_intermediate_size: n("expert_feed_forward_length")?,
        num_shared_experts: n_or("expert_shared_count", 0)?,
        renormalize: match file.get(&key("expert_weights_norm")) {
            Some(_) => file.get_bool(&key("expert_weights_norm"))?,
            None => true,
        },
        routed_scaling_factor: match file.get(&key("expert_weights_scale")) {
            Some(_) => file.get_f32(&key("expert_weights_scale"))?,
            None => 1.0,
        },
        num_expert_groups,
        topk_group: n_or("expert_group_used_count", num_expert_groups)?,
        weights_use_correction_bias: false,
        latent: None,
        expert_format: ExpertFormat::Dense,
    })
}

fn mixer_name(m: Mixer) -> &'static str {
    match m {
        Mixer::Kda => "KDA",
        Mixer::Mla => "MLA",
    }
}

/// A per-layer count: an array of `num_layers` integers, or one integer for every layer.
fn per_layer_values(file: &GgufFile, name: &str, num_layers: usize) -> Result<Vec<usize>> {
    let k = key(name);
    let bad = |reason: String| format_error(file, format!("{k}: {reason}"));
    match file.get(&k) {
        Some(Value::Array(a)) => {
            let values: Vec<usize> = match a {
                Array::I32(v) => v
                    .iter()
                    .map(|&x| usize::try_from(x).ok())
                    .collect::<Option<_>>(),
                Array::U32(v) => v.iter().map(|&x| usize::try_from(x).ok()).collect(),
                Array::I64(v) => v.iter().map(|&x| usize::try_from(x).ok()).collect(),
                Array::U64(v) => v.iter().map(|&x| usize::try_from(x).ok()).collect(),
                Array::I16(v) => v.iter().map(|&x| usize::try_from(x).ok()).collect(),
                Array::U16(v) => v.iter().map(|&x| Some(usize::from(x))).collect(),
                Array::I8(v) => v.iter().map(|&x| usize::try_from(x).ok()).collect(),
                Array::U8(v) => v.iter().map(|&x| Some(usize::from(x))).collect(),
                _ => None,
            }
            .ok_or_else(|| bad("expected non-negative integers".into()))?;
            if values.len() != num_layers {
                return Err(bad(format!(
                    "has {} entries for {num_layers} layers",
                    values.len()
                )));
            }
            Ok(values)
        }
        // Absent keys fail here with the file and key named.
        _ => Ok(vec![file.get_u64(&k)? as usize; num_layers]),
    }
}
