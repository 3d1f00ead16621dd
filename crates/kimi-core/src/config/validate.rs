//! [`ModelConfig::validate`]: the checks a config must pass whichever file it came from
//! (config.json, GGUF metadata, a test's literal), so that no NaN, zero or out-of-range
//! value reaches the model, where it would only show as NaN logits or empty output.

use super::{Activation, ConfigError, Ffn, KdaGate, ModelConfig};

/// Parameters above this are not a model but a typo (Kimi K3 has 2.8 × 10^12): refusing
/// them keeps every size computed from a config far from overflowing a `u64`.
pub const MAX_PARAMS: f64 = 1e15;

fn invalid(field: &str, reason: impl Into<String>) -> ConfigError {
    ConfigError::Invalid {
        field: field.to_string(),
        reason: reason.into(),
    }
}

/// A norm epsilon: finite, in (0, 1).
fn epsilon(field: &str, x: f32) -> Result<(), ConfigError> {
    if x.is_finite() && x > 0.0 && x < 1.0 {
        Ok(())
    } else {
        Err(invalid(
            field,
            format!("must be a number in (0, 1), found {x}"),
        ))
    }
}

/// A scale: finite and greater than 0.
fn positive(field: &str, x: f32) -> Result<(), ConfigError> {
    if x.is_finite() && x > 0.0 {
        Ok(())
    } else {
        Err(invalid(
            field,
            format!("must be a finite number greater than 0, found {x}"),
        ))
    }
}

fn at_least_one(field: &str, n: usize) -> Result<(), ConfigError> {
    if n == 0 {
        Err(invalid(field, "must be at least 1, found 0"))
    } else {
        Ok(())
    }
}

impl ModelConfig {
    /// Checks every numeric parameter: floats finite and in range, sizes at least 1, counts
    /// consistent with each other, and the whole model under [`MAX_PARAMS`] parameters.
    /// Fields are named as config.json names them. `from_json` calls it; readers of other
    /// formats should too (and may rename the fields as their format spells them).
    pub fn validate(&self) -> Result<(), ConfigError> {
        at_least_one("vocab_size", self.vocab_size)?;
        at_least_one("hidden_size", self.hidden_size)?;
        at_least_one("num_hidden_layers", self.layers.len())?;
        at_least_one("max_position_embeddings", self.max_position_embeddings)?;
        epsilon("rms_norm_eps", self.rms_norm_eps)?;
        if self.layers.iter().any(|l| l.ffn == Ffn::Dense) {
            at_least_one("intermediate_size", self.intermediate_size)?;
        }
        if let Activation::Situ { beta, linear_beta } = self.activation {
            positive("activation_situ_beta", beta)?;
            if let Some(b) = linear_beta {
                positive("activation_situ_linear_beta", b)?;
            }
        }
        if let Some(k) = &self.kda {
            at_least_one("linear_attn_config.num_heads", k.num_heads)?;
            at_least_one("linear_attn_config.head_dim", k.head_dim)?;
            at_least_one("linear_attn_config.short_conv_kernel_size", k.conv_kernel)?;
            if let KdaGate::LowerBound(b) = k.gate {
                if !b.is_finite() {
                    return Err(invalid(
                        "linear_attn_config.gate_lower_bound",
                        format!("must be a finite number, found {b}"),
                    ));
                }
            }
        }
        if let Some(m) = &self.mla {
            at_least_one("num_attention_heads", m.num_heads)?;
            at_least_one("kv_lora_rank", m.kv_lora_rank)?;
            at_least_one("v_head_dim", m.v_head_dim)?;
            epsilon("kv_a_layernorm eps", m.latent_norm_eps)?;
        }
        if let Some(m) = &self.moe {
            at_least_one("num_experts", m.num_experts)?;
            at_least_one("num_experts_per_token", m.top_k)?;
            at_least_one("moe_intermediate_size", m.expert_intermediate_size)?;
            at_least_one("n_group", m.num_expert_groups)?;
            if m.top_k > m.num_experts {
                return Err(invalid(
                    "num_experts_per_token",
                    format!(
                        "is {} but there are only {} routed experts",
                        m.top_k, m.num_experts
                    ),
                ));
            }
            if m.num_experts % m.num_expert_groups != 0 {
                return Err(invalid(
                    "n_group",
                    format!(
                        "{} groups do not divide {} routed experts",
                        m.num_expert_groups, m.num_experts
                    ),
                ));
            }
            if m.topk_group == 0 || m.topk_group > m.num_expert_groups {
                return Err(invalid(
                    "topk_group",
                    format!(
                        "must be in 1..={} (the number of groups), found {}",
                        m.num_expert_groups, m.topk_group
                    ),
                ));
            }
            positive("routed_scaling_factor", m.routed_scaling_factor)?;
        }
        let params = self.rough_params();
        if params > MAX_PARAMS {
            return Err(invalid(
                "hidden_size",
                format!(
                    "with these sizes the model would have about {params:.2e} parameters, \
                     more than any model this program can hold ({MAX_PARAMS:.0e})"
                ),
            ));
        }
        Ok(())
    }

    /// An over-estimate of the parameter count in floating point (no overflow on any
    /// config): every layer costed as if it had all of KDA, MLA and its FFN at full width.
    fn rough_params(&self) -> f64 {
        let d = self.hidden_size as f64;
        let kda = self.kda.as_ref().map_or(0.0, |k| {
            let w = (k.num_heads * k.head_dim) as f64;
            8.0 * w * d + 3.0 * w * k.conv_kernel as f64
        });
        let mla = self.mla.as_ref().map_or(0.0, |m| {
            let h = m.num_heads as f64;
            let head = (m.qk_nope_head_dim + m.qk_rope_head_dim + m.v_head_dim) as f64;
            let rank = m.q_lora_rank.unwrap_or(0).max(m.kv_lora_rank) as f64;
            4.0 * h * head * (d + rank) + 2.0 * rank * d
        });
        let moe = self.moe.as_ref().map_or(0.0, |m| {
            let experts = (m.num_experts + m.num_shared_experts) as f64;
            3.0 * experts * m.expert_intermediate_size as f64 * d + m.num_experts as f64 * d
        });
        let dense = 3.0 * self.intermediate_size as f64 * d;
        let per_layer = kda + mla + moe.max(dense) + 8.0 * d;
        2.0 * self.vocab_size as f64 * d + self.layers.len() as f64 * per_layer
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const RELEASED: &str =
        include_str!("../../tests/data/kimi-linear-48b-a3b-instruct.config.json");

    fn released() -> ModelConfig {
        ModelConfig::from_json_str(RELEASED).expect("the released config is valid")
    }

    fn field_of(config: &ModelConfig) -> String {
        match config.validate() {
            Err(ConfigError::Invalid { field, .. }) => field,
            other => panic!("expected an invalid field, got {other:?}"),
        }
    }

    #[test]
    fn non_finite_and_out_of_range_values_are_named() {
        for eps in [f32::NAN, -1e-6, 0.0, 2.0, f32::INFINITY] {
            let mut c = released();
            c.rms_norm_eps = eps;
            assert_eq!(field_of(&c), "rms_norm_eps", "{eps}");
        }
        let mut c = released();
        c.moe.as_mut().expect("MoE").routed_scaling_factor = f32::NAN;
        assert_eq!(field_of(&c), "routed_scaling_factor");
        let mut c = released();
        c.moe.as_mut().expect("MoE").top_k = 1000;
        assert_eq!(field_of(&c), "num_experts_per_token");
        let mut c = released();
        c.moe.as_mut().expect("MoE").topk_group = 0;
        assert_eq!(field_of(&c), "topk_group");
        let mut c = released();
        c.kda.as_mut().expect("KDA").gate = KdaGate::LowerBound(f32::NEG_INFINITY);
        assert_eq!(field_of(&c), "linear_attn_config.gate_lower_bound");
        let mut c = released();
        c.activation = Activation::Situ {
            beta: f32::NAN,
            linear_beta: None,
        };
        assert_eq!(field_of(&c), "activation_situ_beta");
        let mut c = released();
        c.mla.as_mut().expect("MLA").latent_norm_eps = f32::NAN;
        assert!(c.validate().is_err());
    }

    #[test]
    fn absurd_sizes_are_refused_before_anything_multiplies_them() {
        let mut json: serde_json::Value = serde_json::from_str(RELEASED).expect("JSON");
        json["vocab_size"] = (1u64 << 24).into();
        json["hidden_size"] = (1u64 << 24).into();
        json["moe_intermediate_size"] = (1u64 << 24).into();
        let err = ModelConfig::from_json(&json).expect_err("too large");
        let text = err.to_string();
        assert!(text.contains("parameters"), "{text}");
        // The released 48B model is far below the limit.
        assert!(released().rough_params() < 1e12);
    }
}
