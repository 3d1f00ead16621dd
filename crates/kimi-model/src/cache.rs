//! Per-sequence state: what a sequence carries from one forward pass to the next.

use kimi_core::config::Mixer;
use kimi_core::ModelConfig;
use kimi_ops::Backend;

use crate::Result;

/// The state one decoder layer keeps for one sequence.
pub enum LayerCache<B: Backend> {
    /// KDA: the pre-convolution inputs of the last `W-1` tokens for q, k and v (`[W-1, H*K]`
    /// each) and the recurrent state `[H, K, V]` (f32).
    Kda {
        /// Convolution windows of the q, k and v streams.
        conv: [B::Tensor; 3],
        /// Recurrent state.
        state: B::Tensor,
    },
    /// MLA: every earlier token's normalised latent followed by its shared key,
    /// `[tokens, kv_lora_rank + qk_rope_head_dim]`.
    Mla {
        /// Latent cache rows.
        latent: B::Tensor,
    },
    /// Grouped-query attention: every earlier token's rotated keys and its values, each
    /// `[tokens, num_kv_heads * head_dim]` (Llama architecture).
    Kv {
        /// Key rows.
        k: B::Tensor,
        /// Value rows.
        v: B::Tensor,
    },
}

/// All layers' state for one sequence, plus how many tokens it has seen.
pub struct SeqCache<B: Backend> {
    /// One entry per decoder layer.
    pub layers: Vec<LayerCache<B>>,
    /// Tokens already processed.
    pub num_tokens: usize,
}

impl<B: Backend> SeqCache<B> {
    /// Fresh (empty) state for a new Kimi Linear sequence (other architectures:
    /// [`crate::CausalLm::new_cache`]).
    pub fn new(backend: &B, cfg: &ModelConfig) -> Result<Self> {
        let mut layers = Vec::with_capacity(cfg.layers.len());
        for spec in &cfg.layers {
            layers.push(match spec.mixer {
                Mixer::Kda => {
                    let kda = cfg.kda.as_ref().ok_or_else(|| missing("kda"))?;
                    let width = kda.num_heads * kda.head_dim;
                    let window = [kda.conv_kernel.saturating_sub(1), width];
                    LayerCache::Kda {
                        conv: [
                            backend.zeros(&window)?,
                            backend.zeros(&window)?,
                            backend.zeros(&window)?,
                        ],
                        state: backend.zeros(&[kda.num_heads, kda.head_dim, kda.head_dim])?,
                    }
                }
                Mixer::Mla => {
                    let mla = cfg.mla.as_ref().ok_or_else(|| missing("mla"))?;
                    LayerCache::Mla {
                        latent: backend.zeros(&[0, mla.kv_lora_rank + mla.qk_rope_head_dim])?,
                    }
                }
            });
        }
        Ok(Self {
            layers,
            num_tokens: 0,
        })
    }

    /// Bytes of device memory this sequence's state occupies now.
    pub fn size_bytes(&self, backend: &B) -> usize {
        self.layers
            .iter()
            .map(|l| match l {
                LayerCache::Kda { conv, state } => {
                    conv.iter().map(|c| backend.size_bytes(c)).sum::<usize>()
                        + backend.size_bytes(state)
                }
                LayerCache::Mla { latent } => backend.size_bytes(latent),
                LayerCache::Kv { k, v } => backend.size_bytes(k) + backend.size_bytes(v),
            })
            .sum()
    }
}

fn missing(what: &str) -> crate::ModelError {
    crate::ModelError::Input(format!(
        "config has a {what} layer but no {what} dimensions"
    ))
}
