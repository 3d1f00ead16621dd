//! Llama-architecture decoders from GGUF files (SmolLM2, the CPU demo model; see
//! `shared/docs/demo-model.md`).
//!
//! ```text
//! ids → token_embd → [ blk.0 … blk.L-1 ] → output_norm → output (or token_embd, tied) → logits
//! blk.i:  h = x + attn_output(GQA(rope(attn_q(n)), rope(attn_k(n)), attn_v(n)))   n = attn_norm(x)
//!         x = h + ffn_down(silu(ffn_gate(m)) ⊙ ffn_up(m))                          m = ffn_norm(h)
//! ```
//!
//! llama.cpp's converter permutes the Q/K rows of Hugging Face checkpoints so that GGUF
//! files rotate adjacent pairs (ggml's "normal" rope, `RopeStyle::Adjacent`); the layout
//! follows llama.cpp `src/models/llama.cpp`.

use std::collections::HashSet;

use kimi_gguf::GgufFile;
use kimi_ops::{AttentionDims, Backend, MlpWeights, PagedSeq, RopeStyle, Segment};

use crate::cache::{CachePool, LayerPool, LayerSpec, SeqCache};
use crate::forward::{
    check_batch, input, pick_tokens, Batch, CausalLm, ForwardOptions, ForwardOutput,
};
use crate::layers::{Loader, Stacked};
use crate::source::{format_error, WeightSource};
use crate::Result;

/// Hyper-parameters of a Llama-architecture model.
#[derive(Clone, Debug, PartialEq)]
pub struct LlamaConfig {
    /// Vocabulary size (rows of `token_embd`).
    pub vocab_size: usize,
    /// Residual width.
    pub hidden_size: usize,
    /// SwiGLU width.
    pub intermediate_size: usize,
    /// Decoder layers.
    pub num_layers: usize,
    /// Query heads.
    pub num_heads: usize,
    /// Key/value heads (grouped-query attention when fewer than `num_heads`).
    pub num_kv_heads: usize,
    /// Width of one head.
    pub head_dim: usize,
    /// RoPE base frequency.
    pub rope_theta: f32,
    /// How RoPE pairs dimensions (adjacent pairs for llama GGUF files).
    pub rope_style: RopeStyle,
    /// RMSNorm epsilon.
    pub rms_norm_eps: f32,
    /// Trained context length.
    pub max_context: usize,
    /// The output head is the embedding table (no `output.weight`).
    pub tie_word_embeddings: bool,
    /// End-of-sequence ids (`tokenizer.ggml.eos_token_id`, `tokenizer.ggml.eot_token_id`).
    pub eos_token_ids: Vec<u32>,
}

impl LlamaConfig {
    /// Reads the `llama.*` metadata of a GGUF file (and the vocabulary size from
    /// `token_embd.weight`); fails on other architectures and on RoPE variants this model
    /// does not implement (partial rotary, rope scaling).
    pub fn from_gguf(file: &GgufFile) -> Result<Self> {
        let arch = file.get_str("general.architecture")?;
        if arch != "llama" {
            return Err(format_error(
                file,
                format!("architecture `{arch}` is not supported (only `llama`)"),
            ));
        }
        let count =
            |key: &str| -> Result<usize> { Ok(file.get_u32(&format!("llama.{key}"))? as usize) };
        let optional = |key: &str, default: usize| -> Result<usize> {
            match file.get(&format!("llama.{key}")) {
                Some(_) => count(key),
                None => Ok(default),
            }
        };
        let hidden_size = count("embedding_length")?;
        let num_heads = count("attention.head_count")?;
        if num_heads == 0 {
            return Err(format_error(file, "llama.attention.head_count is 0".into()));
        }
        let num_kv_heads = optional("attention.head_count_kv", num_heads)?;
        let head_dim = optional("attention.key_length", hidden_size / num_heads)?;
        let rope_dim = optional("rope.dimension_count", head_dim)?;
        let value_dim = optional("attention.value_length", head_dim)?;
        check_heads(
            &|reason| format_error(file, reason),
            num_heads,
            num_kv_heads,
            head_dim,
            [rope_dim, value_dim],
        )?;
        if file.get("llama.rope.scaling.type").is_some() {
            let kind = file.get_str("llama.rope.scaling.type")?;
            if kind != "none" {
                return Err(format_error(
                    file,
                    format!("rope scaling `{kind}` is not supported"),
                ));
            }
        }
        let rope_theta = match file.get("llama.rope.freq_base") {
            Some(_) => file.get_f32("llama.rope.freq_base")?,
            None => 10_000.0, // llama.cpp's default for llama
        };
        let embed = file.tensor("token_embd.weight")?.info.shape_outer_first();
        let config = Self {
            vocab_size: embed.first().copied().unwrap_or(0),
            hidden_size,
            intermediate_size: count("feed_forward_length")?,
            num_layers: count("block_count")?,
            num_heads,
            num_kv_heads,
            head_dim,
            rope_theta,
            rope_style: RopeStyle::Adjacent,
            rms_norm_eps: file.get_f32("llama.attention.layer_norm_rms_epsilon")?,
            max_context: count("context_length")?,
            tie_word_embeddings: file.tensor("output.weight").is_err(),
            eos_token_ids: eos_token_ids(file)?,
        };
        config.validate(&|reason| format_error(file, reason), &|key| {
            format!("llama.{key}")
        })?;
        Ok(config)
    }

    /// Every number in range, so that none shows up later as NaN logits: a NaN or negative
    /// RoPE base or norm epsilon loads fine and breaks every forward pass. `err` makes the
    /// error of the file; `name` gives the file's name of a GGUF metadata key (after
    /// `llama.`).
    pub(crate) fn validate(
        &self,
        err: &dyn Fn(String) -> crate::ModelError,
        name: &dyn Fn(&str) -> String,
    ) -> Result<()> {
        let bad = |key: &str, reason: String| err(format!("{}: {reason}", name(key)));
        let floats = [
            ("rope.freq_base", self.rope_theta, f32::INFINITY),
            ("attention.layer_norm_rms_epsilon", self.rms_norm_eps, 1.0),
        ];
        for (key, x, below) in floats {
            if !(x.is_finite() && x > 0.0 && x < below) {
                let range = if below.is_finite() {
                    format!("in (0, {below})")
                } else {
                    "finite and greater than 0".into()
                };
                return Err(bad(key, format!("must be {range}, found {x}")));
            }
        }
        let counts = [
            ("embedding_length", self.hidden_size),
            ("feed_forward_length", self.intermediate_size),
            ("block_count", self.num_layers),
            ("context_length", self.max_context),
            ("attention.key_length", self.head_dim),
        ];
        for (key, n) in counts {
            if n == 0 {
                return Err(bad(key, "must be at least 1, found 0".into()));
            }
        }
        if self.vocab_size == 0 {
            return Err(err("the vocabulary is empty".into()));
        }
        Ok(())
    }

    pub(crate) fn kv_width(&self) -> usize {
        self.num_kv_heads * self.head_dim
    }
}

/// Rejects head layouts and RoPE variants this model does not implement: grouped heads
/// must divide evenly, and rotary covers the whole even-width head (no partial rotary, no
/// rope scaling, values as wide as keys).
pub(crate) fn check_heads(
    err: &dyn Fn(String) -> crate::ModelError,
    num_heads: usize,
    num_kv_heads: usize,
    head_dim: usize,
    [rope_dim, value_dim]: [usize; 2],
) -> Result<()> {
    if num_kv_heads == 0 || !num_heads.is_multiple_of(num_kv_heads) {
        return Err(err(format!(
            "{num_heads} query heads cannot share {num_kv_heads} key/value heads"
        )));
    }
    if rope_dim != head_dim || value_dim != head_dim || !head_dim.is_multiple_of(2) {
        return Err(err(format!(
            "heads of {head_dim} (values {value_dim}) with {rope_dim} rotary dimensions \
                 are not supported (rotary over the whole, even-width head only)"
        )));
    }
    Ok(())
}

/// `tokenizer.ggml.eos_token_id` and `tokenizer.ggml.eot_token_id`, where present.
fn eos_token_ids(file: &GgufFile) -> Result<Vec<u32>> {
    let mut ids = Vec::new();
    for key in ["tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id"] {
        if file.get(key).is_some() {
            let id = file.get_u32(key)?;
            if !ids.contains(&id) {
                ids.push(id);
            }
        }
    }
    Ok(ids)
}

struct LlamaLayer<T> {
    attn_norm: T,
    /// `attn_q`, `attn_k` and `attn_v`: one matmul when they share a type.
    qkv: Stacked<T>,
    o: T,
    ffn_norm: T,
    mlp: MlpWeights<T>,
}

/// A loaded Llama-architecture model on backend `B`.
pub struct Llama<B: Backend> {
    backend: B,
    config: LlamaConfig,
    embed: B::Tensor,
    layers: Vec<LlamaLayer<B::Tensor>>,
    norm: B::Tensor,
    lm_head: Option<B::Tensor>,
    cache_specs: Vec<LayerSpec>,
}

impl<B: Backend> Llama<B> {
    /// Loads a Llama-architecture GGUF file: reads its config, then every tensor with its
    /// stored type (block-quantized matrices stay quantized), checking names and shapes.
    /// Fails if the file holds tensors the model does not use.
    pub fn load(backend: B, file: &GgufFile) -> Result<Self> {
        let config = LlamaConfig::from_gguf(file)?;
        Self::load_from(backend, config, file)
    }

    /// Builds the model of `config` from any weight source with GGUF tensor names (e.g.
    /// [`crate::RandomWeights`]).
    pub fn load_from(backend: B, config: LlamaConfig, source: &dyn WeightSource) -> Result<Self> {
        let c = &config;
        let (hidden, q_width) = (c.hidden_size, c.num_heads * c.head_dim);
        let mut ld = Loader {
            backend: &backend,
            source,
            used: HashSet::new(),
            prefix: "",
            offload: None,
            moe_layers: 0,
            shard: crate::parallel::Shard::SINGLE,
            placement: None,
            dispatch: crate::parallel::ExpertDispatch::AllReduce,
        };
        let embed = ld.get("token_embd.weight", &[c.vocab_size, hidden])?;
        let mut layers = Vec::with_capacity(c.num_layers);
        for i in 0..c.num_layers {
            let qkv = ld.stacked(
                &[
                    (format!("blk.{i}.attn_q.weight"), q_width),
                    (format!("blk.{i}.attn_k.weight"), c.kv_width()),
                    (format!("blk.{i}.attn_v.weight"), c.kv_width()),
                ],
                hidden,
            )?;
            let mut get =
                |name: &str, shape: &[usize]| ld.get(&format!("blk.{i}.{name}.weight"), shape);
            layers.push(LlamaLayer {
                attn_norm: get("attn_norm", &[hidden])?,
                qkv,
                o: get("attn_output", &[hidden, q_width])?,
                ffn_norm: get("ffn_norm", &[hidden])?,
                mlp: MlpWeights {
                    gate: get("ffn_gate", &[c.intermediate_size, hidden])?,
                    up: get("ffn_up", &[c.intermediate_size, hidden])?,
                    down: get("ffn_down", &[hidden, c.intermediate_size])?,
                },
            });
        }
        let norm = ld.get("output_norm.weight", &[hidden])?;
        let lm_head = match c.tie_word_embeddings {
            true => None,
            false => Some(ld.get("output.weight", &[c.vocab_size, hidden])?),
        };
        source.check_all_used(&ld.used)?;
        Ok(Self {
            cache_specs: vec![
                LayerSpec::Kv {
                    width: config.kv_width()
                };
                layers.len()
            ],
            backend,
            config,
            embed,
            layers,
            norm,
            lm_head,
        })
    }

    /// The model's configuration.
    pub fn config(&self) -> &LlamaConfig {
        &self.config
    }

    /// Runs the new tokens of several sequences through the model, writing their keys and
    /// values to the paged caches (see [`CausalLm::forward`]). `opts` is ignored (no KDA or
    /// MLA layers).
    pub fn forward(
        &self,
        batch: &Batch,
        pool: &mut CachePool<B>,
        seqs: &mut [&mut SeqCache],
        opts: ForwardOptions,
    ) -> Result<ForwardOutput> {
        let c = &self.config;
        check_batch(batch, seqs.len(), c.vocab_size)?;
        let positions = self.positions(batch, seqs)?;
        let be = &self.backend;
        pool.prepare(be, self.layers.len(), seqs)?;
        let paged: Vec<_> = seqs.iter().map(|s| s.paged()).collect();
        let mut x = be.embedding(&self.embed, &batch.tokens)?;
        for (i, layer) in self.layers.iter().enumerate() {
            let normed = be.rms_norm(&x, &layer.attn_norm, c.rms_norm_eps)?;
            let LayerPool::Kv { k, v } = &mut pool.layers[i] else {
                return Err(input("cache layout does not match the model"));
            };
            let attn =
                self.attention(layer, &normed, &positions, &batch.segments, (k, v), &paged)?;
            be.add_assign(&mut x, &attn)?;
            let normed = be.rms_norm(&x, &layer.ffn_norm, c.rms_norm_eps)?;
            be.add_assign(&mut x, &be.mlp(&normed, &layer.mlp)?)?;
        }
        for (seq, seg) in seqs.iter_mut().zip(&batch.segments) {
            seq.num_tokens += seg.len;
        }
        let last = be.select_rows(&x, &batch.logits_rows)?;
        let normed = be.rms_norm(&last, &self.norm, c.rms_norm_eps)?;
        let logits = be.matmul(&normed, self.lm_head.as_ref().unwrap_or(&self.embed))?;
        let (logits, token_ids) = pick_tokens(be, logits, batch, opts)?;
        Ok(ForwardOutput {
            logits,
            token_ids,
            vocab_size: c.vocab_size,
            expert_counts: vec![Vec::new(); self.layers.len()],
        })
    }

    /// Each row's position in its sequence (rows outside every segment get 0); checks
    /// that no sequence outgrows the context.
    fn positions(&self, batch: &Batch, caches: &[&mut SeqCache]) -> Result<Vec<usize>> {
        let mut positions = vec![0; batch.tokens.len()];
        for (seg, cache) in batch.segments.iter().zip(caches) {
            if cache.num_tokens + seg.len > self.config.max_context {
                return Err(input(&format!(
                    "a sequence of {} tokens exceeds the model's context of {}",
                    cache.num_tokens + seg.len,
                    self.config.max_context
                )));
            }
            for (j, p) in positions[seg.start..seg.start + seg.len]
                .iter_mut()
                .enumerate()
            {
                *p = cache.num_tokens + j;
            }
        }
        Ok(positions)
    }

    fn attention(
        &self,
        layer: &LlamaLayer<B::Tensor>,
        x: &B::Tensor,
        positions: &[usize],
        segments: &[Segment],
        (k_pool, v_pool): (&mut B::Tensor, &mut B::Tensor),
        seqs: &[PagedSeq<'_>],
    ) -> Result<B::Tensor> {
        let (be, c) = (&self.backend, &self.config);
        let rope = |t: B::Tensor, heads: usize| {
            be.rope(&t, positions, heads, c.head_dim, c.rope_theta, c.rope_style)
        };
        let mut qkv = layer.qkv.matmul(be, x)?.into_iter();
        let (Some(q), Some(k), Some(v)) = (qkv.next(), qkv.next(), qkv.next()) else {
            return Err(input("attention projections"));
        };
        let q = rope(q, c.num_heads)?;
        let k = rope(k, c.num_kv_heads)?;
        let dims = AttentionDims {
            num_heads: c.num_heads,
            num_kv_heads: c.num_kv_heads,
            head_dim: c.head_dim,
            scale: (c.head_dim as f32).powf(-0.5),
        };
        let o = be.attention(&q, &k, &v, &dims, segments, k_pool, v_pool, seqs)?;
        Ok(be.matmul(&o, &layer.o)?)
    }
}

impl<B: Backend> CausalLm<B> for Llama<B> {
    fn backend(&self) -> &B {
        &self.backend
    }
    fn vocab_size(&self) -> usize {
        self.config.vocab_size
    }
    fn max_context(&self) -> usize {
        self.config.max_context
    }
    fn eos_token_ids(&self) -> &[u32] {
        &self.config.eos_token_ids
    }
    fn cache_specs(&self) -> &[LayerSpec] {
        &self.cache_specs
    }
    fn forward(
        &self,
        batch: &Batch,
        pool: &mut CachePool<B>,
        seqs: &mut [&mut SeqCache],
        opts: ForwardOptions,
    ) -> Result<ForwardOutput> {
        self.backend
            .run_pass(|| Llama::forward(self, batch, pool, seqs, opts))
    }
}
