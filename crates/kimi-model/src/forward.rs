//! What every model's forward pass takes and returns, and the [`CausalLm`] trait that lets
//! the engine drive any architecture.

use kimi_ops::offload::{OffloadCounts, Placement};
use std::sync::Arc;

use crate::parallel::ExpertPlacement;
use kimi_ops::{Backend, KdaMode, MlaMode, RowSampling, Segment, TokenPenalty};

use crate::cache::{CachePool, LayerSpec, SeqCache};
use crate::{ModelError, Result};

/// The tokens of one forward pass: several sequences' new tokens, flattened.
#[derive(Clone, Debug, Default)]
pub struct Batch {
    /// New token ids of every sequence, back to back.
    pub tokens: Vec<u32>,
    /// Where each sequence's tokens sit in `tokens`; segment `s` uses `seqs[s]`.
    pub segments: Vec<Segment>,
    /// Rows of `tokens` whose logits are wanted (e.g. each segment's last row).
    pub logits_rows: Vec<usize>,
    /// When set, the backend picks each logits row's token by these rules
    /// ([`Backend::sample_rows`]) and [`ForwardOutput::token_ids`] holds them.
    pub sampling: Option<RowPicks>,
}

/// How the backend chooses the tokens of a batch's logits rows.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RowPicks {
    /// One entry per logits row, in order.
    pub rows: Vec<RowSampling>,
    /// Tokens the rows' penalties touch (each row lists a token at most once).
    pub penalties: Vec<TokenPenalty>,
}

/// The logits rows back on the host, or their tokens where the batch or `opts` ask the
/// backend to choose them.
pub(crate) fn pick_tokens<B: Backend>(
    be: &B,
    mut logits: B::Tensor,
    batch: &Batch,
    opts: ForwardOptions,
) -> Result<(Vec<f32>, Vec<u32>)> {
    Ok(if let Some(picks) = &batch.sampling {
        let ids = be.sample_rows(&mut logits, &picks.rows, &picks.penalties)?;
        (Vec::new(), ids)
    } else if opts.greedy_ids {
        (Vec::new(), be.argmax_rows(&logits)?)
    } else {
        (be.to_f32(&logits)?, Vec::new())
    })
}

/// Which kernels to use; the defaults pick the fast form for each case. Models without
/// KDA or MLA layers ignore them.
#[derive(Clone, Copy, Debug, Default)]
pub struct ForwardOptions {
    /// KDA recurrence form.
    pub kda_mode: KdaMode,
    /// MLA attention form.
    pub mla_mode: MlaMode,
    /// Return each logits row's greedy token ([`kimi_ops::argmax_row`]) in
    /// [`ForwardOutput::token_ids`] instead of the rows themselves: the backend picks them
    /// where the logits are (42 MB of logits per 64-sequence step stay on the GPU).
    pub greedy_ids: bool,
}

/// Result of a forward pass.
#[derive(Clone, Debug)]
pub struct ForwardOutput {
    /// `[logits_rows.len(), vocab]`, row-major; empty with [`ForwardOptions::greedy_ids`] or
    /// [`Batch::sampling`].
    pub logits: Vec<f32>,
    /// With [`Batch::sampling`] or [`ForwardOptions::greedy_ids`], the chosen token of each
    /// logits row; else empty.
    pub token_ids: Vec<u32>,
    /// Vocabulary size (row width of `logits`).
    pub vocab_size: usize,
    /// For each layer, how many times each expert was chosen in this pass (empty for dense layers).
    pub expert_counts: Vec<Vec<u32>>,
}

/// A causal language model on backend `B`, whatever its architecture: what generation
/// needs to drive it.
pub trait CausalLm<B: Backend>: Send + Sync {
    /// The backend the weights live on.
    fn backend(&self) -> &B;
    /// Rows of the logits (token ids are below this).
    fn vocab_size(&self) -> usize;
    /// The longest sequence (prompt plus generated tokens) the model supports.
    fn max_context(&self) -> usize;
    /// Token ids that end a sequence, from the model's metadata (may be empty).
    fn eos_token_ids(&self) -> &[u32];
    /// What each layer keeps per token or per sequence (sizes a [`CachePool`]).
    fn cache_specs(&self) -> &[LayerSpec];
    /// Runs the new tokens of several sequences through the model. Segment `s` belongs to
    /// `seqs[s]`, whose block table must cover its tokens after this pass; its rows and
    /// state are read and written in `pool`, and its `num_tokens` advances. A sequence at
    /// `num_tokens == 0` starts from a zeroed state slot.
    fn forward(
        &self,
        batch: &Batch,
        pool: &mut CachePool<B>,
        seqs: &mut [&mut SeqCache],
        opts: ForwardOptions,
    ) -> Result<ForwardOutput>;

    /// A cache pool of `num_blocks` blocks of `block_size` tokens and `num_slots` state
    /// slots for this model.
    fn new_pool(
        &self,
        num_blocks: usize,
        block_size: usize,
        num_slots: usize,
    ) -> Result<CachePool<B>> {
        CachePool::new(
            self.backend(),
            self.cache_specs(),
            num_blocks,
            block_size,
            num_slots,
        )
    }

    /// A pool holding one sequence of up to `max_tokens` tokens, and that sequence.
    fn single_cache(&self, max_tokens: usize) -> Result<(CachePool<B>, SeqCache)> {
        CachePool::single(
            self.backend(),
            self.cache_specs(),
            max_tokens,
            SINGLE_BLOCK_SIZE,
        )
    }

    /// Gives state slot `slots.1` a copy of slot `slots.0` and, with `block`, block
    /// `block.1` a copy of block `block.0` ([`CachePool::fork_state`]; a model split over
    /// ranks does it in every rank's pool).
    fn fork_state(
        &self,
        pool: &mut CachePool<B>,
        slots: (u32, u32),
        block: Option<(u32, u32)>,
    ) -> Result<()> {
        pool.fork_state(self.backend(), slots, block)
    }

    /// Where each MoE layer's experts are (layer index, placement), for layers whose
    /// experts are in tiers; empty when every expert is in the backend's memory.
    fn expert_placement(&self) -> Vec<(usize, Placement)> {
        Vec::new()
    }

    /// Hits, fills, cold experts and bytes moved of the expert tiers so far, summed over
    /// the layers; `None` without tiers.
    fn offload_counts(&self) -> Option<OffloadCounts> {
        None
    }

    /// Why this model can run no more calls, once that is so (a rank process of a split
    /// model has died): every later call fails, and a server should end.
    fn failure(&self) -> Option<String> {
        None
    }

    /// Which rank holds which routed experts, for a model whose whole experts are spread
    /// over ranks (expert parallelism); `None` otherwise.
    fn expert_ranks(&self) -> Option<Arc<ExpertPlacement>> {
        None
    }

    /// Moves the routed experts to `placement` between passes: every rank reads the
    /// experts it takes on, and only once all have does any switch, so that a failure
    /// leaves the model as it was. The caches are untouched (sequences in flight go on).
    fn set_expert_ranks(&mut self, placement: Arc<ExpertPlacement>) -> Result<()> {
        let _ = placement;
        Err(input(
            "the expert placement changes only where whole experts are spread over ranks",
        ))
    }
}

/// Block size of [`CausalLm::single_cache`] pools.
pub const SINGLE_BLOCK_SIZE: usize = 16;

impl<B: Backend, M: CausalLm<B> + ?Sized> CausalLm<B> for Box<M> {
    fn backend(&self) -> &B {
        (**self).backend()
    }
    fn vocab_size(&self) -> usize {
        (**self).vocab_size()
    }
    fn max_context(&self) -> usize {
        (**self).max_context()
    }
    fn eos_token_ids(&self) -> &[u32] {
        (**self).eos_token_ids()
    }
    fn cache_specs(&self) -> &[LayerSpec] {
        (**self).cache_specs()
    }
    fn forward(
        &self,
        batch: &Batch,
        pool: &mut CachePool<B>,
        seqs: &mut [&mut SeqCache],
        opts: ForwardOptions,
    ) -> Result<ForwardOutput> {
        (**self).forward(batch, pool, seqs, opts)
    }
    fn new_pool(
        &self,
        num_blocks: usize,
        block_size: usize,
        num_slots: usize,
    ) -> Result<CachePool<B>> {
        (**self).new_pool(num_blocks, block_size, num_slots)
    }
    fn single_cache(&self, max_tokens: usize) -> Result<(CachePool<B>, SeqCache)> {
        (**self).single_cache(max_tokens)
    }
    fn fork_state(
        &self,
        pool: &mut CachePool<B>,
        slots: (u32, u32),
        block: Option<(u32, u32)>,
    ) -> Result<()> {
        (**self).fork_state(pool, slots, block)
    }
    fn expert_placement(&self) -> Vec<(usize, Placement)> {
        (**self).expert_placement()
    }
    fn offload_counts(&self) -> Option<OffloadCounts> {
        (**self).offload_counts()
    }
    fn failure(&self) -> Option<String> {
        (**self).failure()
    }
    fn expert_ranks(&self) -> Option<Arc<ExpertPlacement>> {
        (**self).expert_ranks()
    }
    fn set_expert_ranks(&mut self, placement: Arc<ExpertPlacement>) -> Result<()> {
        (**self).set_expert_ranks(placement)
    }
}

/// Checks that a batch's segments and logits rows lie inside its tokens, that there is one
/// sequence per segment and that every token id is in the vocabulary.
pub(crate) fn check_batch(batch: &Batch, num_caches: usize, vocab_size: usize) -> Result<()> {
    if batch.segments.len() != num_caches {
        return Err(input(&format!(
            "{} segments but {num_caches} sequences",
            batch.segments.len()
        )));
    }
    let n = batch.tokens.len();
    if batch.segments.iter().any(|s| s.start + s.len > n)
        || batch.logits_rows.iter().any(|&r| r >= n)
    {
        return Err(input(
            "batch segments or logits rows fall outside its tokens",
        ));
    }
    if let Some(picks) = &batch.sampling {
        let rows = batch.logits_rows.len();
        if picks.rows.len() != rows || picks.penalties.iter().any(|p| p.row as usize >= rows) {
            return Err(input(&format!(
                "{} sampling rows (penalties up to row {}) for {rows} logits rows",
                picks.rows.len(),
                picks.penalties.iter().map(|p| p.row).max().unwrap_or(0)
            )));
        }
    }
    if let Some(&bad) = batch.tokens.iter().find(|&&t| t as usize >= vocab_size) {
        return Err(input(&format!(
            "token id {bad} is outside the vocabulary ({vocab_size})"
        )));
    }
    Ok(())
}

pub(crate) fn input(msg: &str) -> ModelError {
    ModelError::Input(msg.to_string())
}
