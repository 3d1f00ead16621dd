//! Kimi Linear: a hybrid decoder of KDA and MLA layers with dense and MoE feed-forwards,
//! and Kimi K3's text model as variants of it (`shared/docs/kimi-k3-spec.md` §3).
//!
//! ```text
//! ids → embed → [ layer 0 … layer L-1 ] → norm → lm_head → logits
//! layer i:  h = x + Mixer_i(RMSNorm_in(x))        Mixer = KDA | MLA
//!           x = h + FFN_i(RMSNorm_post(h))        FFN   = dense | MoE (SwiGLU or SiTU)
//! ```
//!
//! With Block Attention Residuals (K3) the residual stream is replaced by stored block sums
//! and a partial sum `p`; every sublayer's input is a per-token softmax mix of them:
//!
//! ```text
//! blocks = [], p = embed
//! layer i:  h = mix_attn(blocks, p);  if i % block_size == 0 { blocks.push(p); p = 0 }
//!           p += Mixer_i(RMSNorm_in(h))
//!           p += FFN_i(RMSNorm_post(mix_mlp(blocks, p)))
//! → norm(mix_out(blocks, p)) → lm_head
//! ```

use std::collections::HashSet;
use std::sync::Arc;

use kimi_core::config::{Ffn, Mixer};
use kimi_core::ModelConfig;
use kimi_ops::offload::{OffloadCounts, Placement};
use kimi_ops::{Backend, Collective, Segment};
use kimi_weights::Checkpoint;

use crate::cache::{pick_mut, CachePool, LayerPool, LayerSpec, SeqCache};
use crate::ffn::FfnLayer;
use crate::forward::{
    check_batch, input, pick_tokens, Batch, CausalLm, ForwardOptions, ForwardOutput,
};
use crate::layers::{KdaLayer, Loader, MlaLayer};
use crate::native_names::CheckpointSource;
use crate::parallel::{Shard, ShardedSource};
use crate::source::WeightSource;
use crate::{LoadOptions, Result};

mod experts;

enum MixerLayer<T> {
    Kda(KdaLayer<T>),
    Mla(MlaLayer<T>),
}

struct DecoderLayer<T> {
    input_norm: T,
    post_norm: T,
    mixer: MixerLayer<T>,
    ffn: FfnLayer<T>,
    /// Block AttnRes mixes before the mixer and before the FFN, if the model has them.
    res: Option<[T; 2]>,
}

/// The model's Block AttnRes settings: layers per block and the mix before the final norm.
struct AttnRes<T> {
    block_size: usize,
    output: T,
}

/// Tensors of the vision encoder that a text model skips (K3's multimodal checkpoint).
const VISION_PREFIXES: [&str; 4] = [
    "vision_tower.",
    "mm_projector.",
    "vision_model.",
    "multi_modal_projector.",
];

/// A loaded Kimi Linear model on backend `B`.
pub struct KimiLinear<B: Backend> {
    backend: B,
    config: ModelConfig,
    /// The config of this rank's part (heads and dense widths divided over the ranks);
    /// `config` itself where the model is whole.
    rank_config: ModelConfig,
    shard: Shard,
    /// How this rank meets the others, where the model is split.
    collective: Option<Arc<dyn Collective<B>>>,
    embed: B::Tensor,
    layers: Vec<DecoderLayer<B::Tensor>>,
    norm: B::Tensor,
    lm_head: Option<B::Tensor>,
    /// `embed` and `lm_head` hold this rank's share of the vocabulary rows: the embedding
    /// is summed over the ranks and the logits are gathered.
    vocab_split: bool,
    attn_res: Option<AttnRes<B::Tensor>>,
    cache_specs: Vec<LayerSpec>,
    ignored_vision_tensors: usize,
    /// Which rank holds which routed experts where whole experts are spread (`None`: in
    /// order), the weights to read the experts it takes on when that changes (and the tiers
    /// a share in tiers is placed in again), and a new placement read but not yet in use
    /// (`experts.rs`).
    expert_ranks: Option<Arc<crate::parallel::ExpertPlacement>>,
    reopen: Option<crate::WeightsReopener>,
    offload: Option<kimi_ops::offload::ExpertOffload>,
    expert_dispatch: crate::parallel::ExpertDispatch,
    staged: Option<experts::StagedPlacement<B::Tensor>>,
}

impl<B: Backend> KimiLinear<B> {
    /// Loads every tensor the config calls for, checking names and shapes, and rejects
    /// checkpoints holding tensors the model does not use. Checkpoints as transformers'
    /// `save_pretrained` writes them load too ([`CheckpointSource`]).
    pub fn load(backend: B, ckpt: &Checkpoint) -> Result<Self> {
        Self::load_checkpoint_with(backend, ckpt, &LoadOptions::default())
    }

    /// [`KimiLinear::load`] with options.
    pub fn load_checkpoint_with(
        backend: B,
        ckpt: &Checkpoint,
        options: &LoadOptions,
    ) -> Result<Self> {
        let source = CheckpointSource::new(ckpt)?;
        Self::load_with(backend, ckpt.config().clone(), &source, options)
    }

    /// Loads a llama.cpp Kimi Linear GGUF (`general.architecture = kimi-linear`): the config
    /// from its metadata, the weights through [`crate::gguf_kimi::KimiGguf`].
    pub fn load_gguf(backend: B, file: &kimi_gguf::GgufFile) -> Result<Self> {
        Self::load_gguf_with(backend, file, &LoadOptions::default())
    }

    /// [`KimiLinear::load_gguf`] with options.
    pub fn load_gguf_with(
        backend: B,
        file: &kimi_gguf::GgufFile,
        options: &LoadOptions,
    ) -> Result<Self> {
        let config = crate::gguf_kimi::config_from_gguf(file)?;
        let source = crate::gguf_kimi::KimiGguf::new(file, &config);
        Self::load_with(backend, config, &source, options)
    }

    /// Where each MoE layer's experts are, for layers whose experts are in tiers.
    pub fn expert_placement(&self) -> Vec<(usize, Placement)> {
        self.layers
            .iter()
            .enumerate()
            .filter_map(|(i, l)| l.ffn.tiered().map(|t| (i, t.placement())))
            .collect()
    }

    /// This rank's all-to-all expert dispatch traffic summed over the layers, if its MoE
    /// layers dispatch tokens ([`crate::parallel::ExpertDispatch::AllToAll`]).
    pub fn dispatch_traffic(&self) -> Option<crate::parallel::DispatchTraffic> {
        let mut total: Option<crate::parallel::DispatchTraffic> = None;
        for t in self.layers.iter().filter_map(|l| l.ffn.dispatch_traffic()) {
            *total.get_or_insert_with(Default::default) += t;
        }
        total
    }

    /// The offload counters summed over the layers, if any layer's experts are in tiers.
    pub fn offload_counts(&self) -> Option<OffloadCounts> {
        let mut total: Option<OffloadCounts> = None;
        for t in self.layers.iter().filter_map(|l| l.ffn.tiered()) {
            *total.get_or_insert_with(OffloadCounts::default) += t.counts();
        }
        total
    }

    /// Builds the model of `config` from any weight source (e.g. [`crate::RandomWeights`]).
    pub fn load_from(backend: B, config: ModelConfig, source: &dyn WeightSource) -> Result<Self> {
        Self::load_with(backend, config, source, &LoadOptions::default())
    }

    /// [`KimiLinear::load_from`] with options (experts in tiers).
    pub fn load_with(
        backend: B,
        config: ModelConfig,
        source: &dyn WeightSource,
        options: &LoadOptions,
    ) -> Result<Self> {
        let hidden = config.hidden_size;
        let (act, eps) = (config.activation, config.rms_norm_eps);
        let shard = options.shard;
        let rank_config = rank_config(&config, shard)?;
        let num_experts = config.moe.as_ref().map_or(0, |m| m.num_experts);
        let placement = options.expert_placement.clone();
        let sharded = ShardedSource::new(
            source,
            shard,
            num_experts,
            placement.clone(),
            config.vocab_size,
        );
        let source: &dyn WeightSource = match shard.is_split() {
            true => &sharded,
            false => source,
        };
        let mut ld = Loader {
            backend: &backend,
            source,
            used: HashSet::new(),
            prefix: config.tensor_prefix(),
            offload: options.offload.clone(),
            moe_layers: config.layers.iter().filter(|l| l.ffn == Ffn::Moe).count(),
            shard,
            placement,
            dispatch: options.expert_dispatch,
        };
        // The embedding and the head split by vocabulary rows where the vocabulary divides
        // over the ranks (K3's are 2.3 GB each): each rank looks up and multiplies its
        // share; the embedding rows are summed and the logits gathered.
        let vocab_split = shard.is_split() && config.vocab_size.is_multiple_of(shard.world);
        let vocab_rows = match vocab_split {
            true => config.vocab_size / shard.world,
            false => config.vocab_size,
        };
        let embed = ld.get("model.embed_tokens.weight", &[vocab_rows, hidden])?;
        let mut layers = Vec::with_capacity(config.layers.len());
        for (i, spec) in config.layers.iter().enumerate() {
            let p = format!("model.layers.{i}");
            let mixer = match spec.mixer {
                Mixer::Kda => {
                    let c = rank_config
                        .kda
                        .as_ref()
                        .ok_or_else(|| input("KDA layer without KDA dimensions"))?;
                    MixerLayer::Kda(KdaLayer::load(
                        &mut ld,
                        &format!("{p}.self_attn"),
                        hidden,
                        c,
                    )?)
                }
                Mixer::Mla => {
                    let c = rank_config
                        .mla
                        .as_ref()
                        .ok_or_else(|| input("MLA layer without MLA dimensions"))?;
                    MixerLayer::Mla(MlaLayer::load(
                        &mut ld,
                        &format!("{p}.self_attn"),
                        hidden,
                        c,
                    )?)
                }
            };
            let ffn = match spec.ffn {
                Ffn::Dense => {
                    FfnLayer::load_dense(&mut ld, &p, hidden, rank_config.intermediate_size, act)?
                }
                Ffn::Moe => {
                    let c = config
                        .moe
                        .as_ref()
                        .ok_or_else(|| input("MoE layer without MoE configuration"))?;
                    FfnLayer::load_moe(&mut ld, i, hidden, c, act, eps)?
                }
            };
            let res = match config.attn_res_block_size {
                Some(_) => Some([
                    mix_weight(&mut ld, &format!("{p}.self_attention_res"), hidden)?,
                    mix_weight(&mut ld, &format!("{p}.mlp_res"), hidden)?,
                ]),
                None => None,
            };
            layers.push(DecoderLayer {
                input_norm: ld.get(&format!("{p}.input_layernorm.weight"), &[hidden])?,
                post_norm: ld.get(&format!("{p}.post_attention_layernorm.weight"), &[hidden])?,
                mixer,
                ffn,
                res,
            });
        }
        let norm = ld.get("model.norm.weight", &[hidden])?;
        let attn_res = match config.attn_res_block_size {
            Some(block_size) => Some(AttnRes {
                block_size,
                output: mix_weight(&mut ld, "model.output_attn_res", hidden)?,
            }),
            None => None,
        };
        let lm_head = if config.tie_word_embeddings {
            None
        } else {
            Some(ld.get("lm_head.weight", &[vocab_rows, hidden])?)
        };
        // A multimodal checkpoint's vision encoder: skipped, and counted so that the
        // front end can say once that images are not supported.
        let mut ignored_vision_tensors = 0;
        for name in source.names() {
            if VISION_PREFIXES.iter().any(|v| name.starts_with(v)) {
                ld.used.insert(name);
                ignored_vision_tensors += 1;
            }
        }
        source.check_all_used(&ld.used)?;
        Ok(Self {
            cache_specs: LayerSpec::of_config(&rank_config)?,
            backend,
            config,
            rank_config,
            shard,
            collective: None,
            embed,
            layers,
            norm,
            lm_head,
            vocab_split,
            attn_res,
            ignored_vision_tensors,
            expert_ranks: options.expert_placement.clone(),
            reopen: options.reopen.clone(),
            offload: options.offload.clone(),
            expert_dispatch: options.expert_dispatch,
            staged: None,
        })
    }

    /// The model's configuration.
    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// Which part of the model this is.
    pub fn shard(&self) -> Shard {
        self.shard
    }

    /// Joins this rank's part to the others': every sublayer's partial output is summed
    /// over them. A split model runs only with one.
    pub fn set_collective(&mut self, collective: Arc<dyn Collective<B>>) -> Result<()> {
        if (collective.rank(), collective.world()) != (self.shard.rank, self.shard.world) {
            return Err(input(&format!(
                "a collective of rank {} of {} for the part of rank {} of {}",
                collective.rank(),
                collective.world(),
                self.shard.rank,
                self.shard.world
            )));
        }
        self.collective = Some(collective);
        Ok(())
    }

    /// The collective of a split model (`None` for a whole one).
    fn group(&self) -> Result<Option<&dyn Collective<B>>> {
        match (&self.collective, self.shard.is_split()) {
            (Some(c), _) => Ok(Some(c.as_ref())),
            (None, false) => Ok(None),
            (None, true) => Err(input(&format!(
                "rank {} of a model split over {} ranks runs only with its collective",
                self.shard.rank, self.shard.world
            ))),
        }
    }

    /// How many tensors of a vision encoder the checkpoint held and the text model skipped
    /// (Kimi K3's `vision_tower.*` / `mm_projector.*`): non-zero means images exist in the
    /// checkpoint but kimi-infer runs text only.
    pub fn ignored_vision_tensors(&self) -> usize {
        self.ignored_vision_tensors
    }

    /// The backend the weights live on.
    pub fn backend(&self) -> &B {
        &self.backend
    }

    /// Runs the new tokens of several sequences through the model (see
    /// [`CausalLm::forward`]).
    pub fn forward(
        &self,
        batch: &Batch,
        pool: &mut CachePool<B>,
        seqs: &mut [&mut SeqCache],
        opts: ForwardOptions,
    ) -> Result<ForwardOutput> {
        check_batch(batch, seqs.len(), self.config.vocab_size)?;
        let be = &self.backend;
        pool.prepare(be, self.layers.len(), seqs)?;
        // Decode steps of one batch size queue the same work: let the backend replay it.
        let decode = batch.segments.iter().all(|s| s.len == 1);
        let key = decode.then_some(batch.segments.len() as u64);
        let (logits, chosen_per_layer) =
            be.replayable(key, || self.queue_pass(batch, pool, seqs, opts))??;
        for (seq, seg) in seqs.iter_mut().zip(&batch.segments) {
            seq.num_tokens += seg.len;
        }
        let (logits, token_ids) = pick_tokens(be, logits, batch, opts)?;
        // The experts are read after the logits: by then the device has finished the pass.
        let num_experts = self.config.moe.as_ref().map_or(0, |m| m.num_experts);
        let moe_layers: Vec<&B::Tensor> = chosen_per_layer.iter().flatten().collect();
        let mut counts = be.expert_counts(&moe_layers, num_experts)?.into_iter();
        // Dense layers report no counts.
        let expert_counts = chosen_per_layer
            .iter()
            .map(|c| match c {
                Some(_) => counts.next().unwrap_or_default(),
                None => Vec::new(),
            })
            .collect();
        Ok(ForwardOutput {
            logits,
            token_ids,
            vocab_size: self.config.vocab_size,
            expert_counts,
        })
    }

    /// Queues the device work of one pass and returns the logits of `batch.logits_rows` and
    /// each layer's chosen experts, still on the device.
    #[allow(clippy::type_complexity)]
    fn queue_pass(
        &self,
        batch: &Batch,
        pool: &mut CachePool<B>,
        seqs: &[&mut SeqCache],
        opts: ForwardOptions,
    ) -> Result<(B::Tensor, Vec<Option<B::Tensor>>)> {
        if let Some(res) = &self.attn_res {
            return self.queue_pass_attn_res(res, batch, pool, seqs, opts);
        }
        let be = &self.backend;
        let group = self.group()?;
        let segs = &batch.segments;
        let eps = self.config.rms_norm_eps;
        let mut x = self.embed(&batch.tokens, group)?;
        let mut chosen_per_layer = Vec::with_capacity(self.layers.len());
        // The last sublayer's output, added to `x` together with the next norm.
        let mut pending: Option<B::Tensor> = None;
        for (i, layer) in self.layers.iter().enumerate() {
            let normed = match pending.take() {
                Some(y) => be.add_rms_norm(&mut x, &y, &layer.input_norm, eps)?,
                None => be.rms_norm(&x, &layer.input_norm, eps)?,
            };
            let mut mixed =
                self.run_mixer(layer, &normed, segs, &mut pool.layers[i], seqs, opts)?;
            if let Some(group) = group {
                group.all_reduce_sum(be, &mut mixed)?;
            }
            let normed = be.add_rms_norm(&mut x, &mixed, &layer.post_norm, eps)?;
            let next = self.layers.get(i + 1).map(|l| &l.ffn);
            let (ffn_out, chosen) = layer.ffn.forward(be, &normed, group, next)?;
            pending = Some(ffn_out);
            chosen_per_layer.push(chosen);
        }
        if let Some(y) = pending {
            be.add_assign(&mut x, &y)?;
        }
        let last = be.select_rows(&x, &batch.logits_rows)?;
        let normed = be.rms_norm(&last, &self.norm, eps)?;
        let logits = self.head(&normed, group)?;
        Ok((logits, chosen_per_layer))
    }

    /// [`Self::queue_pass`] with Block Attention Residuals (see the module docs).
    #[allow(clippy::type_complexity)]
    fn queue_pass_attn_res(
        &self,
        res: &AttnRes<B::Tensor>,
        batch: &Batch,
        pool: &mut CachePool<B>,
        seqs: &[&mut SeqCache],
        opts: ForwardOptions,
    ) -> Result<(B::Tensor, Vec<Option<B::Tensor>>)> {
        let be = &self.backend;
        let group = self.group()?;
        let segs = &batch.segments;
        let eps = self.config.rms_norm_eps;
        let no_mix = || input("AttnRes layer without its mix weights");
        let mut blocks: Vec<B::Tensor> = Vec::new();
        let mut partial = self.embed(&batch.tokens, group)?;
        let mut chosen_per_layer = Vec::with_capacity(self.layers.len());
        for (i, layer) in self.layers.iter().enumerate() {
            let [attn_mix, mlp_mix] = layer.res.as_ref().ok_or_else(no_mix)?;
            let h = be.attn_res_mix(&blocks.iter().collect::<Vec<_>>(), &partial, attn_mix, eps)?;
            let normed = be.rms_norm(&h, &layer.input_norm, eps)?;
            let mut mixed =
                self.run_mixer(layer, &normed, segs, &mut pool.layers[i], seqs, opts)?;
            if let Some(group) = group {
                group.all_reduce_sum(be, &mut mixed)?;
            }
            // A block starts here: the sum so far is stored and the new partial sum begins
            // with this mixer's output (layer 0 stores the embedding as block 0).
            if i % res.block_size == 0 {
                blocks.push(std::mem::replace(&mut partial, mixed));
            } else {
                be.add_assign(&mut partial, &mixed)?;
            }
            let h = be.attn_res_mix(&blocks.iter().collect::<Vec<_>>(), &partial, mlp_mix, eps)?;
            let normed = be.rms_norm(&h, &layer.post_norm, eps)?;
            let next = self.layers.get(i + 1).map(|l| &l.ffn);
            let (ffn_out, chosen) = layer.ffn.forward(be, &normed, group, next)?;
            be.add_assign(&mut partial, &ffn_out)?;
            chosen_per_layer.push(chosen);
        }
        // Only the rows whose logits are asked for go through the last mix.
        let rows = &batch.logits_rows;
        let picked = blocks
            .iter()
            .map(|b| be.select_rows(b, rows))
            .collect::<std::result::Result<Vec<_>, _>>()?;
        let last = be.select_rows(&partial, rows)?;
        let mixed = be.attn_res_mix(&picked.iter().collect::<Vec<_>>(), &last, &res.output, eps)?;
        let normed = be.rms_norm(&mixed, &self.norm, eps)?;
        let logits = self.head(&normed, group)?;
        Ok((logits, chosen_per_layer))
    }

    /// The embedding rows of `tokens`: this rank's share of the vocabulary looked up and
    /// summed over the ranks where it is split (one non-zero term per row: exact), else
    /// the whole table's.
    fn embed(&self, tokens: &[u32], group: Option<&dyn Collective<B>>) -> Result<B::Tensor> {
        let be = &self.backend;
        match (group, self.vocab_split) {
            (Some(group), true) => {
                let rows = self.config.vocab_size / self.shard.world;
                let first = self.shard.rank * rows;
                let mut x =
                    be.embedding_part(&self.embed, tokens, first, self.config.vocab_size)?;
                group.all_reduce_sum(be, &mut x)?;
                Ok(x)
            }
            _ => Ok(be.embedding(&self.embed, tokens)?),
        }
    }

    /// The logits of `normed` rows: through this rank's share of the vocabulary and
    /// gathered where the head is split, else through the whole head.
    fn head(&self, normed: &B::Tensor, group: Option<&dyn Collective<B>>) -> Result<B::Tensor> {
        let be = &self.backend;
        let logits = be.matmul(normed, self.lm_head.as_ref().unwrap_or(&self.embed))?;
        match (group, self.vocab_split) {
            (Some(group), true) => Ok(group.all_gather_cols(be, &logits)?),
            _ => Ok(logits),
        }
    }

    fn run_mixer(
        &self,
        layer: &DecoderLayer<B::Tensor>,
        x: &B::Tensor,
        segs: &[Segment],
        pool: &mut LayerPool<B>,
        seqs: &[&mut SeqCache],
        opts: ForwardOptions,
    ) -> Result<B::Tensor> {
        let be = &self.backend;
        let mismatch = || input("cache layout does not match the model");
        match (&layer.mixer, pool) {
            (MixerLayer::Kda(m), LayerPool::Kda { conv, state }) => {
                let c = self
                    .rank_config
                    .kda
                    .as_ref()
                    .ok_or_else(|| input("KDA layer without KDA dimensions"))?;
                let slots: Vec<usize> = seqs.iter().map(|s| s.slot as usize).collect();
                let mut states: Vec<_> = pick_mut(conv, &slots)?
                    .into_iter()
                    .zip(pick_mut(state, &slots)?)
                    .collect();
                m.forward(
                    be,
                    x,
                    c,
                    self.config.rms_norm_eps,
                    segs,
                    &mut states,
                    opts.kda_mode,
                )
            }
            (MixerLayer::Mla(m), LayerPool::Mla { latent }) => {
                let c = self
                    .rank_config
                    .mla
                    .as_ref()
                    .ok_or_else(|| input("MLA layer without MLA dimensions"))?;
                let paged: Vec<_> = seqs.iter().map(|s| s.paged()).collect();
                m.forward(be, x, c, segs, latent, &paged, opts.mla_mode)
            }
            _ => Err(mismatch()),
        }
    }
}

/// The config of rank `shard.rank`'s part: KDA and MLA heads and the dense MLP's width
/// divided over the ranks (routed and shared experts are divided where they load), or an
/// error naming what does not divide.
fn rank_config(config: &ModelConfig, shard: Shard) -> Result<ModelConfig> {
    let mut c = config.clone();
    if !shard.is_split() {
        return Ok(c);
    }
    if let Some(kda) = &mut c.kda {
        kda.num_heads = shard.part(kda.num_heads, "the KDA heads")?;
    }
    if let Some(mla) = &mut c.mla {
        mla.num_heads = shard.part(mla.num_heads, "the MLA heads")?;
    }
    if c.layers.iter().any(|l| l.ffn == Ffn::Dense) {
        c.intermediate_size = shard.part(c.intermediate_size, "the dense MLP's width")?;
    }
    if let Some(moe) = &c.moe {
        match shard.experts {
            crate::parallel::ExpertSplit::Tensor => {
                shard.part(moe.expert_intermediate_size, "the experts' width")?;
            }
            crate::parallel::ExpertSplit::Experts => {
                shard.part(moe.num_experts, "the routed experts")?;
            }
        }
        shard.part(
            moe.num_shared_experts * moe.expert_intermediate_size,
            "the shared experts' width",
        )?;
    }
    Ok(c)
}

/// One AttnRes mix's `w_eff = norm ⊙ proj` in f32 (spec §3.6): the RMS-normalisation's
/// weight folds into the scoring vector. Reads `{p}_norm.weight [d]` and `{p}_proj.weight
/// [1, d]`.
fn mix_weight<B: Backend>(ld: &mut Loader<'_, B>, p: &str, d: usize) -> Result<B::Tensor> {
    let norm = ld.values(&format!("{p}_norm.weight"), &[d])?;
    let proj = ld.values(&format!("{p}_proj.weight"), &[1, d])?;
    let w: Vec<f32> = norm.iter().zip(&proj).map(|(n, p)| n * p).collect();
    Ok(ld.backend.upload_f32(&[d], &w)?)
}

impl<B: Backend> CausalLm<B> for KimiLinear<B> {
    fn backend(&self) -> &B {
        &self.backend
    }
    fn expert_placement(&self) -> Vec<(usize, Placement)> {
        KimiLinear::expert_placement(self)
    }
    fn offload_counts(&self) -> Option<OffloadCounts> {
        KimiLinear::offload_counts(self)
    }
    fn expert_ranks(&self) -> Option<Arc<crate::parallel::ExpertPlacement>> {
        KimiLinear::expert_ranks(self)
    }
    fn vocab_size(&self) -> usize {
        self.config.vocab_size
    }
    fn max_context(&self) -> usize {
        self.config.max_position_embeddings
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
            .run_pass(|| KimiLinear::forward(self, batch, pool, seqs, opts))
    }
}
