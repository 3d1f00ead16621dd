//! What every model's forward pass takes and returns, and the [`CausalLm`] trait that lets
//! the engine drive any architecture.

use kimi_ops::{Backend, KdaMode, MlaMode, Segment};

use crate::cache::SeqCache;
use crate::{ModelError, Result};

/// The tokens of one forward pass: several sequences' new tokens, flattened.
#[derive(Clone, Debug, Default)]
pub struct Batch {
    /// New token ids of every sequence, back to back.
    pub tokens: Vec<u32>,
    /// Where each sequence's tokens sit in `tokens`; segment `s` uses `caches[s]`.
    pub segments: Vec<Segment>,
    /// Rows of `tokens` whose logits are wanted (e.g. each segment's last row).
    pub logits_rows: Vec<usize>,
}

/// Which kernels to use; the defaults pick the fast form for each case. Models without
/// KDA or MLA layers ignore them.
#[derive(Clone, Copy, Debug, Default)]
pub struct ForwardOptions {
    /// KDA recurrence form.
    pub kda_mode: KdaMode,
    /// MLA attention form.
    pub mla_mode: MlaMode,
}

/// Result of a forward pass.
#[derive(Clone, Debug)]
pub struct ForwardOutput {
    /// `[logits_rows.len(), vocab]`, row-major.
    pub logits: Vec<f32>,
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
    /// Fresh (empty) state for a new sequence.
    fn new_cache(&self) -> Result<SeqCache<B>>;
    /// Runs the new tokens of several sequences through the model, updating their caches.
    fn forward(
        &self,
        batch: &Batch,
        caches: &mut [&mut SeqCache<B>],
        opts: ForwardOptions,
    ) -> Result<ForwardOutput>;
}

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
    fn new_cache(&self) -> Result<SeqCache<B>> {
        (**self).new_cache()
    }
    fn forward(
        &self,
        batch: &Batch,
        caches: &mut [&mut SeqCache<B>],
        opts: ForwardOptions,
    ) -> Result<ForwardOutput> {
        (**self).forward(batch, caches, opts)
    }
}

/// Checks that a batch's segments and logits rows lie inside its tokens, that there is one
/// cache per segment and that every token id is in the vocabulary.
pub(crate) fn check_batch(batch: &Batch, num_caches: usize, vocab_size: usize) -> Result<()> {
    if batch.segments.len() != num_caches {
        return Err(input(&format!(
            "{} segments but {num_caches} caches",
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
