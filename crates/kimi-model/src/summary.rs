//! Parameter, byte and cache arithmetic from a config, for `kimi-infer inspect` and `plan`.
//!
//! Every tensor is counted as the checkpoint stores it (the specs' §2 tables): Kimi K3's
//! full-rank KDA `g_proj`, its `A_log` padded to `max(heads, head_dim)` entries (128 on the
//! released model, of which the first `heads` are read), q-LoRA and gated MLA, the LatentMoE
//! down/norm/up wrapper and the AttnRes norm/projection vectors. Routed experts stored as
//! MXFP4 cost 17/32 bytes per value (codes plus one E8M0 scale per 32); every other matrix
//! uses the config's declared dtype, and `A_log`, `dt_bias` (and K3's router bias) are f32.

use kimi_core::config::{ExpertFormat, Family, Ffn, KdaOutputGate, Mixer};
use kimi_core::{DType, ModelConfig};

/// Parameter counts of a model.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ParamCounts {
    /// Every stored parameter (an MXFP4 expert counts its values, not its bytes).
    pub total: u64,
    /// Parameters one token touches (routed experts counted `top_k` times of `num_experts`;
    /// the input embedding counted whole, as model cards do).
    pub active: u64,
    /// Parameters per decoder layer.
    pub per_layer: Vec<u64>,
    /// Embedding plus head plus final norm.
    pub embedding_and_head: u64,
}

/// A part of the model that inspect and plan report separately.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Component {
    /// `embed_tokens` (a token reads one row of it).
    Embedding,
    /// KDA token mixers.
    Kda,
    /// MLA token mixers.
    Mla,
    /// Dense MLPs (`intermediate_size`).
    DenseFfn,
    /// MoE routers and their correction biases.
    Router,
    /// Shared experts.
    SharedExperts,
    /// LatentMoE down-projection, norm and up-projection (Kimi K3).
    Latent,
    /// Routed experts.
    RoutedExperts,
    /// Per-layer RMSNorms and the final norm.
    Norms,
    /// Block AttnRes norm and projection vectors (two pairs per layer and the output pair).
    AttnRes,
    /// `lm_head` (absent when tied to the embedding).
    LmHead,
}

impl Component {
    /// Every component, in report order.
    pub const ALL: [Component; 11] = [
        Component::Embedding,
        Component::Kda,
        Component::Mla,
        Component::DenseFfn,
        Component::Router,
        Component::SharedExperts,
        Component::Latent,
        Component::RoutedExperts,
        Component::Norms,
        Component::AttnRes,
        Component::LmHead,
    ];

    /// A short machine name (JSON keys).
    pub fn name(self) -> &'static str {
        match self {
            Component::Embedding => "embedding",
            Component::Kda => "kda",
            Component::Mla => "mla",
            Component::DenseFfn => "dense_ffn",
            Component::Router => "router",
            Component::SharedExperts => "shared_experts",
            Component::Latent => "latent_moe",
            Component::RoutedExperts => "routed_experts",
            Component::Norms => "norms",
            Component::AttnRes => "attn_res",
            Component::LmHead => "lm_head",
        }
    }
}

/// Size of one component.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ComponentSize {
    /// Stored parameters.
    pub params: u64,
    /// Parameters one token touches (see [`ParamCounts::active`]).
    pub active_params: u64,
    /// Stored bytes.
    pub bytes: u64,
    /// Weight bytes one decoded token reads (one embedding row, `top_k` experts per layer).
    pub read_bytes: u64,
}

/// Bytes per value of the KDA recurrent state (f32, the reference and serving default).
pub const STATE_BYTES: u64 = 4;
/// Bytes per value of the KDA convolution windows and the MLA latent cache (bf16, the
/// activation dtype serving engines keep them in; spec §3.9).
pub const CACHE_BYTES: u64 = 2;

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
    /// Size of every component, in [`Component::ALL`] order (zero where the model has none).
    pub components: Vec<(Component, ComponentSize)>,
    /// Stored bytes per decoder layer.
    pub layer_bytes: Vec<u64>,
    /// The dtype assumed for unquantized weights (the config's, else bf16 as released).
    pub weight_dtype: DType,
    /// Routed experts per MoE layer (0 without MoE).
    pub num_experts: u64,
    /// Routed experts each token uses per MoE layer.
    pub top_k: u64,
    /// Stored bytes of one routed expert of one layer.
    pub bytes_per_expert: u64,
    /// Stored `A_log` entries no head reads (K3's zero padding), included in the totals.
    pub a_log_padding: u64,
}

/// Accumulates tensors into components.
struct Tally {
    sizes: [ComponentSize; Component::ALL.len()],
    dtype: u64,
}

impl Tally {
    fn add(&mut self, c: Component, params: u64, active: u64, bytes: u64, read: u64) {
        let s = &mut self.sizes[c as usize];
        s.params += params;
        s.active_params += active;
        s.bytes += bytes;
        s.read_bytes += read;
    }

    /// `n` values in the weight dtype, all read by every token.
    fn dense(&mut self, c: Component, n: u64) {
        self.add(c, n, n, n * self.dtype, n * self.dtype);
    }

    /// `n` f32 values, all read by every token.
    fn f32(&mut self, c: Component, n: u64) {
        self.add(c, n, n, 4 * n, 4 * n);
    }

    fn totals(&self) -> (u64, u64) {
        self.sizes
            .iter()
            .fold((0, 0), |(p, b), s| (p + s.params, b + s.bytes))
    }
}

/// Stored bytes of a `[rows, cols]` MXFP4 matrix: `cols/2` code bytes and `cols/32` scale
/// bytes per row.
fn mxfp4_bytes(rows: u64, cols: u64) -> u64 {
    rows * (cols.div_ceil(2) + cols.div_ceil(32))
}

impl ModelSummary {
    /// Computes the summary of `cfg`.
    pub fn new(cfg: &ModelConfig) -> Self {
        let d = cfg.hidden_size as u64;
        let weight_dtype = cfg.dtype.unwrap_or(DType::BF16);
        let mut t = Tally {
            sizes: Default::default(),
            dtype: weight_dtype.size_bytes() as u64,
        };
        let k3 = cfg.family == Family::KimiK3;
        let (mut num_experts, mut top_k, mut bytes_per_expert, mut a_log_padding) = (0, 0, 0, 0);
        let mut per_layer = Vec::with_capacity(cfg.layers.len());
        let mut layer_bytes = Vec::with_capacity(cfg.layers.len());
        let (mut kda_n, mut mla_n, mut moe_n) = (0, 0, 0);
        for spec in &cfg.layers {
            let before = t.totals();
            t.dense(Component::Norms, 2 * d);
            if cfg.attn_res_block_size.is_some() {
                // self_attention_res and mlp_res: a norm and a [1, hidden] projection each.
                t.dense(Component::AttnRes, 4 * d);
            }
            match (spec.mixer, &cfg.kda, &cfg.mla) {
                (Mixer::Kda, Some(k), _) => {
                    kda_n += 1;
                    let (h, hd, w) = (k.num_heads as u64, k.head_dim as u64, k.conv_kernel as u64);
                    let width = h * hd;
                    let c = Component::Kda;
                    t.dense(c, 3 * width * d + 3 * width * w); // q/k/v and their convolutions
                    t.dense(c, hd * d + width * hd); // f_a, f_b
                    match k.output_gate {
                        KdaOutputGate::LowRank => t.dense(c, hd * d + width * hd),
                        KdaOutputGate::FullRank => t.dense(c, width * d),
                    }
                    t.dense(c, h * d + hd + d * width); // b_proj, o_norm, o_proj
                                                        // K3 stores A_log as a zero-padded vector (spec §2.2).
                    let a_log = if k3 { h.max(hd) } else { h };
                    a_log_padding += a_log - h;
                    t.f32(c, a_log + width); // A_log, dt_bias
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
                    let gate = if m.output_gate { h * dv * d } else { 0 };
                    t.dense(
                        Component::Mla,
                        q + (r + dr) * d + r + h * (dn + dv) * r + d * h * dv + gate,
                    );
                }
                _ => {}
            }
            match (spec.ffn, &cfg.moe) {
                (Ffn::Moe, Some(m)) => {
                    moe_n += 1;
                    let (e, k, i) = (
                        m.num_experts as u64,
                        m.top_k as u64,
                        m.expert_intermediate_size as u64,
                    );
                    t.dense(Component::Router, e * d);
                    // K3 ships the correction bias in f32, Kimi Linear in the weight dtype.
                    if k3 {
                        t.f32(Component::Router, e);
                    } else {
                        t.dense(Component::Router, e);
                    }
                    t.dense(
                        Component::SharedExperts,
                        m.num_shared_experts as u64 * 3 * d * i,
                    );
                    let input = match m.latent {
                        Some(l) => {
                            let w = l.width as u64;
                            t.dense(Component::Latent, 2 * w * d + if l.norm { w } else { 0 });
                            w
                        }
                        None => d,
                    };
                    let values = 3 * input * i;
                    let bytes = match m.expert_format {
                        ExpertFormat::Mxfp4 => 2 * mxfp4_bytes(i, input) + mxfp4_bytes(input, i),
                        ExpertFormat::Dense => values * t.dtype,
                    };
                    t.add(
                        Component::RoutedExperts,
                        e * values,
                        k * values,
                        e * bytes,
                        k * bytes,
                    );
                    (num_experts, top_k, bytes_per_expert) = (e, k, bytes);
                }
                _ => t.dense(Component::DenseFfn, 3 * d * cfg.intermediate_size as u64),
            }
            let after = t.totals();
            per_layer.push(after.0 - before.0);
            layer_bytes.push(after.1 - before.1);
        }
        let (v, w) = (cfg.vocab_size as u64, t.dtype);
        // A token reads one row of the input embedding; a tied head reads the whole matrix.
        let embed_read = if cfg.tie_word_embeddings { v * d } else { d };
        t.add(
            Component::Embedding,
            v * d,
            v * d,
            v * d * w,
            embed_read * w,
        );
        if !cfg.tie_word_embeddings {
            t.dense(Component::LmHead, v * d);
        }
        t.dense(Component::Norms, d);
        if cfg.attn_res_block_size.is_some() {
            t.dense(Component::AttnRes, 2 * d); // output_attn_res norm and projection
        }
        let heads = if cfg.tie_word_embeddings { 1 } else { 2 };
        let params = ParamCounts {
            total: t.sizes.iter().map(|s| s.params).sum(),
            active: t.sizes.iter().map(|s| s.active_params).sum(),
            per_layer,
            embedding_and_head: heads * v * d + d,
        };
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
            components: Component::ALL
                .iter()
                .map(|&c| (c, t.sizes[c as usize]))
                .collect(),
            layer_bytes,
            weight_dtype,
            num_experts,
            top_k,
            bytes_per_expert,
            a_log_padding,
        }
    }

    /// The size of one component.
    pub fn component(&self, c: Component) -> ComponentSize {
        self.components
            .iter()
            .find(|(k, _)| *k == c)
            .map_or_else(ComponentSize::default, |(_, s)| *s)
    }

    /// This summary with the routed experts of every MoE layer taking `bytes` in all, for a
    /// backend that keeps them in another format than the config's dtype (4-bit experts
    /// kept packed: 6 bits a value, not bf16's 16), so that placing them counts what the
    /// device will hold. Their read bytes scale alike; `layer_bytes` keep the config's sizes.
    pub fn with_routed_expert_bytes(mut self, bytes: u64) -> Self {
        for (c, s) in &mut self.components {
            if *c == Component::RoutedExperts && s.bytes > 0 {
                s.read_bytes =
                    (u128::from(s.read_bytes) * u128::from(bytes) / u128::from(s.bytes)) as u64;
                s.bytes = bytes;
            }
        }
        let experts = self.num_experts * self.num_moe_layers as u64;
        if let Some(per) = bytes.checked_div(experts) {
            self.bytes_per_expert = per;
        }
        self
    }

    /// Every stored byte.
    pub fn total_bytes(&self) -> u64 {
        self.components.iter().map(|(_, s)| s.bytes).sum()
    }

    /// Stored bytes of the routed experts.
    pub fn routed_expert_bytes(&self) -> u64 {
        self.component(Component::RoutedExperts).bytes
    }

    /// Stored bytes of everything but the routed experts.
    pub fn non_expert_bytes(&self) -> u64 {
        self.total_bytes() - self.routed_expert_bytes()
    }

    /// Active parameters without the input embedding (a lookup, not a product).
    pub fn active_params_without_embedding(&self) -> u64 {
        self.params.active - self.component(Component::Embedding).active_params
    }

    /// Weight bytes one decoded token reads (batch 1).
    pub fn read_bytes_per_token(&self) -> u64 {
        self.components.iter().map(|(_, s)| s.read_bytes).sum()
    }

    /// Non-expert weight bytes a decode step of `batch` tokens reads: everything once, and
    /// one embedding row per token.
    pub fn non_expert_read_bytes(&self, batch: u64) -> u64 {
        let embed = self.component(Component::Embedding);
        let rest: u64 = self
            .components
            .iter()
            .filter(|(c, _)| !matches!(c, Component::Embedding | Component::RoutedExperts))
            .map(|(_, s)| s.read_bytes)
            .sum();
        rest + (embed.read_bytes * batch).min(embed.bytes)
    }

    /// Bytes of the KDA recurrent state of one sequence ([`STATE_BYTES`] per value).
    pub fn kda_state_bytes_per_seq(&self) -> u64 {
        self.kda_state_elems_per_seq * STATE_BYTES
    }

    /// Bytes of the KDA convolution windows of one sequence ([`CACHE_BYTES`] per value).
    pub fn kda_conv_bytes_per_seq(&self) -> u64 {
        self.kda_conv_elems_per_seq * CACHE_BYTES
    }

    /// Bytes of MLA latent cache each token adds ([`CACHE_BYTES`] per value).
    pub fn mla_cache_bytes_per_token(&self) -> u64 {
        self.mla_cache_elems_per_token * CACHE_BYTES
    }

    /// Cache bytes of one sequence holding `context` tokens.
    pub fn cache_bytes_per_seq(&self, context: u64) -> u64 {
        self.kda_state_bytes_per_seq()
            + self.kda_conv_bytes_per_seq()
            + self.mla_cache_bytes_per_token() * context
    }
}

#[cfg(test)]
#[path = "summary_tests.rs"]
pub(crate) mod tests;
