//! Kimi Linear hyper-parameters as llama.cpp's GGUF metadata (`kimi-linear.*` keys, written
//! by `convert_hf_to_gguf.py` `KimiLinearModel.set_gguf_parameters` and read by
//! `src/models/kimi-linear.cpp`), both ways; Kimi K3's as `kimi-k3.*` (the same keys plus
//! `expert_latent_length`, `activation.situ_beta`, `activation.situ_linear_beta` and
//! `attn_res.block_size`, which llama.cpp's `src/models/kimi-k3.cpp` requires).
//!
//! GGUF cannot say everything a `config.json` says; what it lacks is decided here:
//! * layer kinds: `attention.head_count_kv` per layer, 0 for KDA (llama.cpp's convention);
//!   dense vs MoE feed-forward from the tensors present (`leading_dense_block_count` alone
//!   cannot express the fixtures' irregular schedules);
//! * `kv_a_layernorm` epsilon: no key exists; the reference's 1e-6 (spec §6) is used;
//! * the remote-code routing flag (`kimi_infer_router_weights_use_bias`): off, as in llama.cpp;
//! * K3's gate forms (full-rank KDA gate, MLA output gate), the latent norm and the experts'
//!   MXFP4 storage: from the tensors present, as llama.cpp decides them.

use kimi_core::config::{
    Activation, ExpertFormat, Family, Ffn, KdaConfig, KdaGate, KdaOutputGate, LatentMoe, LayerSpec,
    Mixer, MlaConfig, MoeConfig,
};
use kimi_core::{ConfigError, ModelConfig};
use kimi_gguf::{Array, GgmlType, GgufFile, Value};

use crate::source::format_error;
use crate::Result;

/// `general.architecture` of a Kimi Linear GGUF.
pub const ARCH: &str = "kimi-linear";

/// `general.architecture` of a Kimi K3 GGUF.
pub const ARCH_K3: &str = "kimi-k3";

/// The GGUF architecture a model is written as.
pub(crate) fn arch_of(config: &ModelConfig) -> &'static str {
    match config.family {
        Family::KimiLinear => ARCH,
        Family::KimiK3 => ARCH_K3,
    }
}

/// The reference `kv_a_layernorm` epsilon (GGUF has no key for it).
const LATENT_NORM_EPS: f32 = 1e-6;

/// `ExpertGatingFuncType.SIGMOID` in gguf-py.
const GATING_SIGMOID: u32 = 2;

fn arch_key(arch: &str, name: &str) -> String {
    format!("{arch}.{name}")
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

/// The `kimi-linear.*` (or `kimi-k3.*`) metadata of `config`, in the converter's order.
pub(crate) fn metadata(config: &ModelConfig, extra: &ExtraHparams) -> Vec<(String, Value)> {
    let arch = arch_of(config);
    let mut m: Vec<(String, Value)> = Vec::new();
    let mut put = |k: &str, v: Value| m.push((arch_key(arch, k), v));
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
        if let Some(l) = moe.latent {
            put("expert_latent_length", u32_of(l.width));
        }
    }
    if config.family == Family::KimiK3 {
        // llama.cpp requires these three of every kimi-k3 file; 0 turns a part off there.
        if let Activation::Situ { beta, linear_beta } = config.activation {
            put("activation.situ_beta", Value::F32(beta));
            put(
                "activation.situ_linear_beta",
                Value::F32(linear_beta.unwrap_or(0.0)),
            );
        }
        put(
            "attn_res.block_size",
            u32_of(config.attn_res_block_size.unwrap_or(0)),
        );
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

/// Reads the model configuration of a Kimi Linear or Kimi K3 GGUF.
pub fn config_from_gguf(file: &GgufFile) -> Result<ModelConfig> {
    let arch = file.get_str("general.architecture")?;
    let family = match arch {
        ARCH => Family::KimiLinear,
        ARCH_K3 => Family::KimiK3,
        other => {
            return Err(format_error(
                file,
                format!("general.architecture is `{other}`, not `{ARCH}` or `{ARCH_K3}`"),
            ))
        }
    };
    let arch: &'static str = if family == Family::KimiK3 {
        ARCH_K3
    } else {
        ARCH
    };
    let key = |name: &str| arch_key(arch, name);
    let n = |k: &str| -> Result<usize> { Ok(file.get_u64(&key(k))? as usize) };
    let opt = |k: &str| -> Result<Option<usize>> {
        match file.get(&key(k)) {
            Some(_) => n(k).map(Some),
            None => Ok(None),
        }
    };
    let num_layers = n("block_count")?;
    let kv_heads = per_layer_values(file, arch, "attention.head_count_kv", num_layers)?;
    let heads = per_layer_values(file, arch, "attention.head_count", num_layers)?;
    // The first layer of each kind says which of K3's optional tensors the file has.
    let first_with = |mixer: Mixer| {
        kv_heads
            .iter()
            .position(|&kv| (kv == 0) == (mixer == Mixer::Kda))
    };
    let has = |name: String| file.tensor(&name).is_ok();
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
            output_gate: match first_with(Mixer::Kda) {
                Some(i) if has(format!("blk.{i}.ssm_g.weight")) => KdaOutputGate::FullRank,
                _ => KdaOutputGate::LowRank,
            },
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
                output_gate: first_with(Mixer::Mla)
                    .is_some_and(|i| has(format!("blk.{i}.attn_gate.weight"))),
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
    let moe = match ffns.iter().position(|&f| f == Ffn::Moe) {
        Some(first) => Some(moe_config(file, arch, first)?),
        None => None,
    };
    let (activation, attn_res_block_size) = match family {
        Family::KimiLinear => (Activation::Silu, None),
        Family::KimiK3 => {
            // Required, as llama.cpp requires them: a default would run a different model.
            let linear_beta = file.get_f32(&key("activation.situ_linear_beta"))?;
            let block = n("attn_res.block_size")?;
            (
                Activation::Situ {
                    beta: file.get_f32(&key("activation.situ_beta"))?,
                    linear_beta: (linear_beta > 0.0).then_some(linear_beta),
                },
                (block > 0).then_some(block),
            )
        }
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
        model_type: match family {
            Family::KimiLinear => "kimi_linear".into(),
            Family::KimiK3 => "kimi_k3".into(),
        },
        family,
        activation,
        attn_res_block_size,
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
            format_error(file, format!("{}: {reason}", gguf_key(arch, &field)))
        }
        other => format_error(file, other.to_string()),
    })?;
    Ok(config)
}

/// The metadata key that holds a config.json field (as `ModelConfig::validate` names it).
fn gguf_key(arch: &str, field: &str) -> String {
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
        "routed_expert_hidden_size" => "expert_latent_length",
        "activation_situ_beta" => "activation.situ_beta",
        "activation_situ_linear_beta" => "activation.situ_linear_beta",
        "attn_res_block_size" => "attn_res.block_size",
        other => return other.to_string(),
    };
    arch_key(arch, name)
}

/// The MoE settings; `first` is the first MoE layer, whose tensors say what the metadata
/// cannot (the latent norm, the experts' storage).
fn moe_config(file: &GgufFile, arch: &str, first: usize) -> Result<MoeConfig> {
    let key = |name: &str| arch_key(arch, name);
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
                format!("expert_gating_func {f} is not sigmoid (2), which Kimi models use"),
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
        latent: match file.get(&key("expert_latent_length")) {
            Some(_) => Some(LatentMoe {
                width: n("expert_latent_length")?,
                norm: file
                    .tensor(&format!("blk.{first}.ffn_routed_norm.weight"))
                    .is_ok(),
            })
            .filter(|l| l.width > 0),
            None => None,
        },
        expert_format: match file.tensor(&format!("blk.{first}.ffn_gate_exps.weight")) {
            Ok(t) if t.info.ggml_type == GgmlType::MXFP4 => ExpertFormat::Mxfp4,
            _ => ExpertFormat::Dense,
        },
    })
}

fn mixer_name(m: Mixer) -> &'static str {
    match m {
        Mixer::Kda => "KDA",
        Mixer::Mla => "MLA",
    }
}

/// A per-layer count: an array of `num_layers` integers, or one integer for every layer.
fn per_layer_values(
    file: &GgufFile,
    arch: &str,
    name: &str,
    num_layers: usize,
) -> Result<Vec<usize>> {
    let k = arch_key(arch, name);
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
