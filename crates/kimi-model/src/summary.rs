//! Parameter and memory arithmetic from a config, for `kimi-infer inspect` and planning.

use kimi_core::config::{Ffn, Mixer};
use kimi_core::ModelConfig;

/// Parameter counts of a model.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ParamCounts {
    /// Every parameter.
    pub total: u64,
    /// Parameters one token touches (routed experts counted `top_k` times of `num_experts`).
    pub active: u64,
    /// Parameters per decoder layer.
    pub per_layer: Vec<u64>,
    /// Embedding plus head plus final norm.
    pub embedding_and_head: u64,
}

/// Sizes derived from a config.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelSummary {
    /// Parameter counts.
    pub params: ParamCounts,
    /// Number of KDA layers.
    pub num_kda_layers: usize,
    /// Number of MLA layers.
    pub num_mla_layers: usize,
    /// Number of MoE layers.
    pub num_moe_layers: usize,
    /// MLA latent cache elements per token over all MLA layers.
    pub mla_cache_elems_per_token: u64,
    /// KDA recurrent-state elements per sequence over all KDA layers (kept in f32).
    pub kda_state_elems_per_seq: u64,
    /// KDA convolution-window elements per sequence over all KDA layers.
    pub kda_conv_elems_per_seq: u64,
}

impl ModelSummary {
    /// Computes the summary of `cfg`.
    pub fn new(cfg: &ModelConfig) -> Self {
        let d = cfg.hidden_size as u64;
        let mut params = ParamCounts::default();
        let (mut kda_n, mut mla_n, mut moe_n) = (0, 0, 0);
        for spec in &cfg.layers {
            let mut total = 2 * d; // the two norms
            let mut active = 2 * d;
            let mixer = match (spec.mixer, &cfg.kda, &cfg.mla) {
                (Mixer::Kda, Some(k), _) => {
                    kda_n += 1;
                    let (h, hd, w) = (k.num_heads as u64, k.head_dim as u64, k.conv_kernel as u64);
                    let width = h * hd;
                    3 * width * d
                        + 3 * width * w
                        + 2 * (hd * d + width * hd)
                        + h
                        + width
                        + h * d
                        + hd
                        + d * width
                }
                (Mixer::Mla, _, Some(m)) => {
                    mla_n += 1;
                    let h = m.num_heads as u64;
                    let (r, dn, dr, dv) = (
                        m.kv_lora_rank as u64,
                        m.qk_nope_head_dim as u64,
                        m.qk_rope_head_dim as u64,
                        m.v_head_dim as u64,
                    );
                    let q = match m.q_lora_rank {
                        None => h * (dn + dr) * d,
                        Some(rank) => rank as u64 * (d + 1) + h * (dn + dr) * rank as u64,
                    };
                    q + (r + dr) * d + r + h * (dn + dv) * r + d * h * dv
                }
                _ => 0,
            };
            total += mixer;
            active += mixer;
            match (spec.ffn, &cfg.moe) {
                (Ffn::Moe, Some(m)) => {
                    moe_n += 1;
                    let e = m.num_experts as u64;
                    let expert = 3 * d * m.expert_intermediate_size as u64;
                    let shared = m.num_shared_experts as u64 * expert;
                    total += e * d + e + e * expert + shared;
                    active += e * d + e + m.top_k as u64 * expert + shared;
                }
                _ => {
                    let dense = 3 * d * cfg.intermediate_size as u64;
                    total += dense;
                    active += dense;
                }
            }
            params.per_layer.push(total);
            params.total += total;
            params.active += active;
        }
        let heads = if cfg.tie_word_embeddings { 1 } else { 2 };
        params.embedding_and_head = heads * cfg.vocab_size as u64 * d + d;
        params.total += params.embedding_and_head;
        params.active += params.embedding_and_head;
        let mla_cache = cfg
            .mla
            .as_ref()
            .map_or(0, |m| (m.kv_lora_rank + m.qk_rope_head_dim) as u64);
        let (state, conv) = cfg.kda.as_ref().map_or((0, 0), |k| {
            let width = (k.num_heads * k.head_dim) as u64;
            (
                k.num_heads as u64 * (k.head_dim as u64).pow(2),
                3 * (k.conv_kernel as u64).saturating_sub(1) * width,
            )
        });
        Self {
            params,
            num_kda_layers: kda_n,
            num_mla_layers: mla_n,
            num_moe_layers: moe_n,
            mla_cache_elems_per_token: mla_cache * mla_n as u64,
            kda_state_elems_per_seq: state * kda_n as u64,
            kda_conv_elems_per_seq: conv * kda_n as u64,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The released checkpoint's table sums to 49,122,681,728 parameters (spec §0, [INV]).
    #[test]
    fn released_48b_parameter_count() {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../kimi-core/tests/data/kimi-linear-48b-a3b-instruct.config.json"
        );
        let cfg = ModelConfig::from_json_str(&std::fs::read_to_string(path).unwrap()).unwrap();
        let s = ModelSummary::new(&cfg);
        assert_eq!(s.params.total, 49_122_681_728);
        assert_eq!(
            (s.num_kda_layers, s.num_mla_layers, s.num_moe_layers),
            (20, 7, 26)
        );
        assert_eq!(s.mla_cache_elems_per_token, 576 * 7);
        assert_eq!(s.kda_state_elems_per_seq * 4, 40 << 20);
        // About 3 B active per token.
        assert!(
            (2_500_000_000..3_500_000_000).contains(&s.params.active),
            "{}",
            s.params.active
        );
    }
}
