//! Cache storage: per-layer pools shared by every sequence, and each sequence's place in
//! them.
//!
//! Layers that keep one row per token (MLA latents, GQA keys and values) store them in one
//! pre-allocated pool of fixed-size blocks per layer; a sequence owns a block table. Layers
//! with a fixed-size recurrent state (KDA) keep one state per *slot*; a running sequence
//! owns one slot (vLLM's mamba cache). Nothing is allocated per step.
//!
//! ```text
//! CachePool (num_blocks 6, block_size 4, num_slots 3)
//! layer 0 KDA   conv/state slots   [ s0 | s1 | s2 ]
//! layer 1 MLA   latent pool        [ b0 | b1 | b2 | b3 | b4 | b5 ]   each [4, r + rope]
//! ...           (every MLA layer has its own pool; the block table is shared by all)
//!
//! SeqCache A: slot 1, block_table [4, 0], num_tokens 6  -> tokens 0..3 in b4, 4..5 in b0
//! SeqCache B: slot 0, block_table [2],    num_tokens 3
//! ```
//!
//! Who hands out blocks and slots is the caller's business: the serving engine's cache
//! manager, or [`CachePool::single`] for one sequence. A sequence whose `num_tokens` is 0
//! gets its slot's KDA state zeroed by the model's forward pass, so a recycled slot or block
//! never leaks another sequence's state.

use kimi_core::config::Mixer;
use kimi_core::ModelConfig;
use kimi_ops::{Backend, PagedSeq};

use crate::forward::input;
use crate::Result;

/// The storage of one decoder layer, for every sequence.
pub enum LayerPool<B: Backend> {
    /// KDA: per slot, the pre-convolution inputs of the last `W-1` tokens for q, k and v
    /// (`[W-1, H*K]` each) and the recurrent state `[H, K, V]` (f32).
    Kda {
        /// Convolution windows of the q, k and v streams, one triple per slot.
        conv: Vec<[B::Tensor; 3]>,
        /// Recurrent state, one per slot.
        state: Vec<B::Tensor>,
    },
    /// MLA: every token's normalised latent followed by its shared key,
    /// `[num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]`.
    Mla {
        /// The latent pool.
        latent: B::Tensor,
    },
    /// Grouped-query attention (Llama architecture): rotated keys and values, each
    /// `[num_blocks, block_size, num_kv_heads * head_dim]`.
    Kv {
        /// Key pool.
        k: B::Tensor,
        /// Value pool.
        v: B::Tensor,
    },
}

/// What a model needs per layer, to build a [`CachePool`] of any size.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LayerSpec {
    /// A KDA layer: `heads` heads of width `head_dim`, convolution width `conv_kernel`.
    Kda {
        /// Heads.
        heads: usize,
        /// Head width (keys and values alike).
        head_dim: usize,
        /// Convolution width `W`.
        conv_kernel: usize,
    },
    /// An MLA layer with latent rows of `width` values.
    Mla {
        /// `kv_lora_rank + qk_rope_head_dim`.
        width: usize,
    },
    /// A GQA layer with key and value rows of `width` values each.
    Kv {
        /// `num_kv_heads * head_dim`.
        width: usize,
    },
}

impl LayerSpec {
    /// The layer specs of a Kimi Linear config.
    pub fn of_config(cfg: &ModelConfig) -> Result<Vec<Self>> {
        cfg.layers
            .iter()
            .map(|spec| match spec.mixer {
                Mixer::Kda => {
                    let kda = cfg.kda.as_ref().ok_or_else(|| missing("kda"))?;
                    Ok(Self::Kda {
                        heads: kda.num_heads,
                        head_dim: kda.head_dim,
                        conv_kernel: kda.conv_kernel,
                    })
                }
                Mixer::Mla => {
                    let mla = cfg.mla.as_ref().ok_or_else(|| missing("mla"))?;
                    Ok(Self::Mla {
                        width: mla.kv_lora_rank + mla.qk_rope_head_dim,
                    })
                }
            })
            .collect()
    }

    /// f32 values one token takes in a block pool (0 for KDA).
    pub fn values_per_token(&self) -> usize {
        match *self {
            Self::Kda { .. } => 0,
            Self::Mla { width } => width,
            Self::Kv { width } => 2 * width,
        }
    }

    /// f32 values one slot takes (0 for block-pooled layers).
    pub fn values_per_slot(&self) -> usize {
        match *self {
            Self::Kda {
                heads,
                head_dim,
                conv_kernel,
            } => {
                let width = heads * head_dim;
                3 * conv_kernel.saturating_sub(1) * width + heads * head_dim * head_dim
            }
            Self::Mla { .. } | Self::Kv { .. } => 0,
        }
    }
}

/// Every layer's cache storage: `num_blocks` blocks of `block_size` tokens per
/// token-indexed layer and `num_slots` recurrent-state slots per KDA layer.
pub struct CachePool<B: Backend> {
    /// One entry per decoder layer.
    pub layers: Vec<LayerPool<B>>,
    block_size: usize,
    num_blocks: usize,
    num_slots: usize,
}

impl<B: Backend> CachePool<B> {
    /// Allocates (zeroed) pools for `specs`.
    pub fn new(
        backend: &B,
        specs: &[LayerSpec],
        num_blocks: usize,
        block_size: usize,
        num_slots: usize,
    ) -> Result<Self> {
        if block_size == 0 {
            return Err(input("the cache block size must be at least 1"));
        }
        let layers = specs
            .iter()
            .map(|spec| {
                Ok(match *spec {
                    LayerSpec::Kda {
                        heads,
                        head_dim,
                        conv_kernel,
                    } => {
                        let window = [conv_kernel.saturating_sub(1), heads * head_dim];
                        let conv = (0..num_slots)
                            .map(|_| {
                                Ok([
                                    backend.zeros(&window)?,
                                    backend.zeros(&window)?,
                                    backend.zeros(&window)?,
                                ])
                            })
                            .collect::<Result<Vec<_>>>()?;
                        let state = (0..num_slots)
                            .map(|_| Ok(backend.zeros(&[heads, head_dim, head_dim])?))
                            .collect::<Result<Vec<_>>>()?;
                        LayerPool::Kda { conv, state }
                    }
                    LayerSpec::Mla { width } => LayerPool::Mla {
                        latent: backend.latent_zeros(&[num_blocks, block_size, width])?,
                    },
                    LayerSpec::Kv { width } => LayerPool::Kv {
                        k: backend.kv_zeros(&[num_blocks, block_size, width])?,
                        v: backend.kv_zeros(&[num_blocks, block_size, width])?,
                    },
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Self {
            layers,
            block_size,
            num_blocks,
            num_slots,
        })
    }

    /// A pool for one sequence of up to `max_tokens` tokens, and that sequence (slot 0,
    /// blocks in order): what single-sequence generation and tests use.
    pub fn single(
        backend: &B,
        specs: &[LayerSpec],
        max_tokens: usize,
        block_size: usize,
    ) -> Result<(Self, SeqCache)> {
        let num_blocks = max_tokens.div_ceil(block_size.max(1));
        let pool = Self::new(backend, specs, num_blocks, block_size, 1)?;
        Ok((pool, SeqCache::new(0, (0..num_blocks as u32).collect())))
    }

    /// Tokens per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Blocks in each token-indexed layer's pool.
    pub fn num_blocks(&self) -> usize {
        self.num_blocks
    }

    /// Recurrent-state slots.
    pub fn num_slots(&self) -> usize {
        self.num_slots
    }

    /// Bytes of device memory the pools occupy.
    pub fn size_bytes(&self, backend: &B) -> usize {
        self.layers
            .iter()
            .map(|l| match l {
                LayerPool::Kda { conv, state } => {
                    conv.iter()
                        .flatten()
                        .map(|c| backend.size_bytes(c))
                        .sum::<usize>()
                        + state.iter().map(|s| backend.size_bytes(s)).sum::<usize>()
                }
                LayerPool::Mla { latent } => backend.size_bytes(latent),
                LayerPool::Kv { k, v } => backend.size_bytes(k) + backend.size_bytes(v),
            })
            .sum()
    }

    /// Gives slot `dst` a copy of slot `src`'s KDA state and, with `block`, every
    /// token-indexed layer's block `block.1` a copy of block `block.0`: what a forked
    /// sequence needs before its first step. The KDA state travels through the host (one
    /// slot per layer, on forks only), so every backend can do it; blocks need
    /// [`Backend::copy_block`].
    pub fn fork_state(
        &mut self,
        backend: &B,
        (src, dst): (u32, u32),
        block: Option<(u32, u32)>,
    ) -> Result<()> {
        let (src, dst) = (src as usize, dst as usize);
        if src.max(dst) >= self.num_slots || src == dst {
            return Err(input(&format!(
                "cannot fork state slot {src} into {dst} in a pool of {}",
                self.num_slots
            )));
        }
        let copy = |t: &B::Tensor| -> Result<B::Tensor> {
            Ok(backend.upload_f32(backend.shape(t), &backend.to_f32(t)?)?)
        };
        for layer in &mut self.layers {
            match layer {
                LayerPool::Kda { conv, state } => {
                    let windows = [
                        copy(&conv[src][0])?,
                        copy(&conv[src][1])?,
                        copy(&conv[src][2])?,
                    ];
                    conv[dst] = windows;
                    state[dst] = copy(&state[src])?;
                }
                LayerPool::Mla { latent } => {
                    if let Some((from, to)) = block {
                        backend.copy_block(latent, from as usize, to as usize)?;
                    }
                }
                LayerPool::Kv { k, v } => {
                    if let Some((from, to)) = block {
                        backend.copy_block(k, from as usize, to as usize)?;
                        backend.copy_block(v, from as usize, to as usize)?;
                    }
                }
            }
        }
        Ok(())
    }

    /// Checks that the pool has one layer per model layer and that the sequences' slots
    /// are distinct and inside the pool; zeroes the KDA state of every sequence that
    /// starts (`num_tokens == 0`).
    pub(crate) fn prepare(
        &mut self,
        backend: &B,
        num_layers: usize,
        seqs: &[&mut SeqCache],
    ) -> Result<()> {
        if self.layers.len() != num_layers {
            return Err(input("cache layout does not match the model"));
        }
        let mut used = vec![false; self.num_slots];
        for seq in seqs {
            match used.get_mut(seq.slot as usize) {
                Some(u) if !*u => *u = true,
                Some(_) => return Err(input("two sequences of a batch share a state slot")),
                None => {
                    return Err(input(&format!(
                        "state slot {} is outside the pool of {}",
                        seq.slot, self.num_slots
                    )))
                }
            }
        }
        for seq in seqs.iter().filter(|s| s.num_tokens == 0) {
            let slot = seq.slot as usize;
            for layer in &mut self.layers {
                if let LayerPool::Kda { conv, state } = layer {
                    for c in &mut conv[slot] {
                        backend.fill_zero(c)?;
                    }
                    backend.fill_zero(&mut state[slot])?;
                }
            }
        }
        Ok(())
    }
}

/// Where one sequence's state lives in a [`CachePool`], and how many tokens it has seen.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SeqCache {
    /// Blocks in token order: token `i` is row `i % block_size` of block
    /// `block_table[i / block_size]` in every token-indexed layer. It must cover the
    /// sequence's tokens after each forward pass.
    pub block_table: Vec<u32>,
    /// The sequence's KDA state slot.
    pub slot: u32,
    /// Tokens already processed.
    pub num_tokens: usize,
}

impl SeqCache {
    /// A sequence with no tokens yet.
    pub fn new(slot: u32, block_table: Vec<u32>) -> Self {
        Self {
            block_table,
            slot,
            num_tokens: 0,
        }
    }

    /// Its place in a paged layer.
    pub(crate) fn paged(&self) -> PagedSeq<'_> {
        PagedSeq {
            block_table: &self.block_table,
            num_cached: self.num_tokens,
        }
    }
}

/// Mutable references to `items[i]` for each (distinct, checked) index in `picks`.
pub(crate) fn pick_mut<'a, T>(items: &'a mut [T], picks: &[usize]) -> Result<Vec<&'a mut T>> {
    let mut all: Vec<Option<&'a mut T>> = items.iter_mut().map(Some).collect();
    picks
        .iter()
        .map(|&i| {
            all.get_mut(i)
                .and_then(Option::take)
                .ok_or_else(|| input("state slots of a batch must be distinct and in the pool"))
        })
        .collect()
}

fn missing(what: &str) -> crate::ModelError {
    crate::ModelError::Input(format!(
        "config has a {what} layer but no {what} dimensions"
    ))
}
