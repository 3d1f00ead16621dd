//! The validated model configuration, parsed from a Hugging Face `config.json`.
//!
//! Two schemas describe Kimi Linear (see `shared/docs/kimi-linear-spec.md`, "Two config
//! schemas"): the hub one (`linear_attn_config` with 1-indexed layer lists,
//! `first_k_dense_replace`, `moe_layer_freq`) and the transformers-5 native one
//! (`layer_types`, `mlp_layer_types`). Both parse into the same [`ModelConfig`]; model code
//! never sees raw JSON.

use serde_json::Value;

use crate::DType;

pub use validate::MAX_PARAMS;

mod fields;
mod k3;
pub use k3::QUANT_METHODS;
mod parse;
mod schedule;
#[cfg(test)]
mod tests;
mod validate;

/// Which token mixer a decoder layer uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mixer {
    /// Kimi Delta Attention (linear attention with a recurrent state).
    Kda,
    /// Multi-head latent attention (softmax attention over a compressed cache).
    Mla,
}

/// Which feed-forward block a decoder layer uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Ffn {
    /// Dense SwiGLU MLP of width `intermediate_size`.
    Dense,
    /// Routed mixture of experts plus shared experts.
    Moe,
}

/// One decoder layer's structure.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LayerSpec {
    /// Token mixer.
    pub mixer: Mixer,
    /// Feed-forward block.
    pub ffn: Ffn,
}

/// The gated linear unit of every feed-forward block: `act(gate) ⊙ up`, computed in f32.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Activation {
    /// SwiGLU: `silu(gate) · up` (Kimi Linear).
    Silu,
    /// SiTU-GLU (Kimi K3): `β₁·tanh(gate/β₁)·sigmoid(gate) · β₂·tanh(up/β₂)`; without a
    /// `linear_beta` the up half passes unchanged.
    Situ {
        /// β₁, the gate half's soft cap (`activation_situ_beta`).
        beta: f32,
        /// β₂, the up half's soft cap (`activation_situ_linear_beta`).
        linear_beta: Option<f32>,
    },
}

/// The output gate of a KDA layer (`sigmoid(z)` on the normalised heads).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KdaOutputGate {
    /// `z = g_b(g_a(x))`, a rank-`head_dim` pair (Kimi Linear).
    LowRank,
    /// `z = g_proj(x)`, one full-rank matrix (Kimi K3, `use_full_rank_gate`).
    FullRank,
}

/// The model family a config describes: which tensor names and wrapper the checkpoint has.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Family {
    /// `kimi_linear` (`KimiLinearForCausalLM`): tensors under `model.`, head `lm_head`.
    KimiLinear,
    /// `kimi_k3` (`KimiK3ForConditionalGeneration`): a multimodal wrapper whose text model is
    /// a Kimi Linear variant, its tensors under `language_model.`.
    KimiK3,
}

/// How the routed experts' weights are stored in the checkpoint.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ExpertFormat {
    /// As the other matrices (`w1/w2/w3.weight`, bf16 or f32).
    Dense,
    /// MXFP4 (`compressed-tensors`, `mxfp4-pack-quantized`): `weight_packed` U8 codes (two
    /// E2M1 values per byte, the even column in the low nibble) and `weight_scale` U8 E8M0
    /// scales, one per 32 inputs (Kimi K3).
    Mxfp4,
}

/// LatentMoE (Kimi K3): the routed experts run in a narrower latent space.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LatentMoe {
    /// Width of the latent (`routed_expert_hidden_size`).
    pub width: usize,
    /// RMSNorm on the weighted expert sum before the up-projection (`latent_moe_use_norm`).
    pub norm: bool,
}

/// The KDA forget gate.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum KdaGate {
    /// `g = -exp(A_log) * softplus(f + dt_bias)` (released Kimi Linear checkpoints).
    Softplus,
    /// `g = lower_bound * sigmoid(exp(A_log) * (f + dt_bias))` (Kimi K3's safe gate).
    LowerBound(f32),
}

/// Kimi Delta Attention dimensions.
#[derive(Clone, Debug, PartialEq)]
pub struct KdaConfig {
    /// Number of heads (q, k and v heads are equal).
    pub num_heads: usize,
    /// Key and value width per head (also the rank of the low-rank gates).
    pub head_dim: usize,
    /// Width of the causal depthwise convolutions.
    pub conv_kernel: usize,
    /// Forget-gate form.
    pub gate: KdaGate,
    /// Output-gate form.
    pub output_gate: KdaOutputGate,
}

/// Multi-head latent attention dimensions.
#[derive(Clone, Debug, PartialEq)]
pub struct MlaConfig {
    /// Number of attention heads.
    pub num_heads: usize,
    /// Rank of the query LoRA (`q_a_proj`/`q_b_proj`); `None` means a full `q_proj`.
    pub q_lora_rank: Option<usize>,
    /// Latent (compressed KV) width.
    pub kv_lora_rank: usize,
    /// Per-head query/key width without position information.
    pub qk_nope_head_dim: usize,
    /// Width of the shared key part (`k_pe`), never rotated in Kimi Linear (NoPE).
    pub qk_rope_head_dim: usize,
    /// Per-head value width.
    pub v_head_dim: usize,
    /// Epsilon of `kv_a_layernorm` (and `q_a_layernorm`): 1e-6 in the reference.
    pub latent_norm_eps: f32,
    /// `o ⊙ sigmoid(g_proj(x))` before `o_proj`, the gate computed from the layer's
    /// normalised input (Kimi K3, `mla_use_output_gate`).
    pub output_gate: bool,
}

/// Mixture-of-experts routing and sizes.
#[derive(Clone, Debug, PartialEq)]
pub struct MoeConfig {
    /// Routed experts per layer.
    pub num_experts: usize,
    /// Experts chosen per token.
    pub top_k: usize,
    /// Width of each routed expert.
    pub expert_intermediate_size: usize,
    /// Number of shared experts; their combined width is `num_shared_experts * expert_intermediate_size`.
    pub num_shared_experts: usize,
    /// Renormalise the chosen weights to sum to one (only when `top_k > 1`).
    pub renormalize: bool,
    /// Multiplies the routed weights.
    pub routed_scaling_factor: f32,
    /// Expert groups for group-limited selection (1 means no grouping).
    pub num_expert_groups: usize,
    /// Groups kept per token before the top-k.
    pub topk_group: usize,
    /// Weight chosen experts by the bias-corrected scores, as the checkpoint's remote code does.
    /// Off by default: the reference (transformers native) uses the unbiased sigmoid scores.
    pub weights_use_correction_bias: bool,
    /// Routed experts in a latent space (Kimi K3), if any.
    pub latent: Option<LatentMoe>,
    /// How the routed experts are stored.
    pub expert_format: ExpertFormat,
}

/// A validated configuration of a Kimi Linear-style text model (Kimi Linear itself, or the
/// text model of Kimi K3, whose extensions are variants of the same layer stack).
#[derive(Clone, Debug, PartialEq)]
pub struct ModelConfig {
    /// `model_type` as written in the file (`kimi_linear`, or `kimi_k3` for the wrapper).
    pub model_type: String,
    /// Which family, and so which tensor names, the checkpoint has.
    pub family: Family,
    /// Vocabulary rows of the embedding and the head.
    pub vocab_size: usize,
    /// Residual stream width.
    pub hidden_size: usize,
    /// Structure of every decoder layer, index = layer.
    pub layers: Vec<LayerSpec>,
    /// Epsilon of every RMSNorm except the MLA latent norm.
    pub rms_norm_eps: f32,
    /// The gated unit of every feed-forward block (dense, shared and routed experts).
    pub activation: Activation,
    /// Block Attention Residuals (Kimi K3): layers per stored block, if the residual stream
    /// is replaced by per-token softmax mixes over block sums.
    pub attn_res_block_size: Option<usize>,
    /// Width of the dense MLP.
    pub intermediate_size: usize,
    /// KDA dimensions, present when any layer uses KDA.
    pub kda: Option<KdaConfig>,
    /// MLA dimensions, present when any layer uses MLA.
    pub mla: Option<MlaConfig>,
    /// MoE configuration, present when any layer uses MoE.
    pub moe: Option<MoeConfig>,
    /// `lm_head` shares the embedding matrix.
    pub tie_word_embeddings: bool,
    /// Beginning-of-sequence id, if the config names one.
    pub bos_token_id: Option<u32>,
    /// Ids that end generation (config `eos_token_id`, a number or a list).
    pub eos_token_ids: Vec<u32>,
    /// Padding id, if any.
    pub pad_token_id: Option<u32>,
    /// Longest context the model was trained for.
    pub max_position_embeddings: usize,
    /// The dtype `config.json` declares for the unquantized weights (`dtype`, or the older
    /// `torch_dtype`); `None` when absent or not a float type. Sizing only: loaders read
    /// each tensor's own dtype.
    pub dtype: Option<DType>,
}

/// A problem with a `config.json`.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// The text is not JSON.
    #[error("config.json is not valid JSON: {0}")]
    Json(#[from] serde_json::Error),
    /// A required field is absent.
    #[error("config.json: missing field `{0}`")]
    Missing(String),
    /// A field has the wrong type or an impossible value.
    #[error("config.json: field `{field}`: {reason}")]
    Invalid {
        /// The field's name.
        field: String,
        /// What is wrong with it.
        reason: String,
    },
    /// The file describes a model or a feature kimi-infer does not run yet.
    #[error("config.json: {0}")]
    Unsupported(String),
}

impl ModelConfig {
    /// Parses and validates a `config.json` text of either schema.
    pub fn from_json_str(text: &str) -> Result<Self, ConfigError> {
        let value: Value = serde_json::from_str(text)?;
        Self::from_json(&value)
    }

    /// Parses and validates an already-decoded `config.json`.
    ///
    /// Accepts the hub schema and the transformers-5 native schema (and both at once, when they
    /// agree), and Kimi K3's multimodal wrapper (`KimiK3ForConditionalGeneration`, the text
    /// model's config nested in `text_config`). Other model types, and features kimi-infer
    /// does not run, are rejected with [`ConfigError::Unsupported`]. Never panics.
    pub fn from_json(value: &Value) -> Result<Self, ConfigError> {
        let config = parse::model_config(value)?;
        config.validate()?;
        Ok(config)
    }

    /// Number of decoder layers.
    pub fn num_layers(&self) -> usize {
        self.layers.len()
    }

    /// The prefix of the text model's tensor names: `""` for Kimi Linear, `"language_model."`
    /// for Kimi K3 (its `model.*` and `lm_head.weight` sit under the wrapper's field).
    pub fn tensor_prefix(&self) -> &'static str {
        match self.family {
            Family::KimiLinear => "",
            Family::KimiK3 => "language_model.",
        }
    }
}
