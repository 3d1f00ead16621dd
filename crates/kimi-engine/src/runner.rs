//! The model runner: owns the model, the cache pool and every running sequence's place in
//! it, and turns a [`StepPlan`](crate::scheduler::StepPlan)'s chunks into one batched
//! forward pass.
//!
//! The pool is allocated once (`num_blocks` blocks per MLA layer, `max_num_seqs` KDA state
//! slots); the scheduler's cache manager decides which blocks and slot a sequence owns, and
//! each chunk carries the blocks added to its table since the last step.
//!
//! ```text
//! chunks   [A: 1 token][B: 1 token][C: 5 tokens, samples][D: 8 tokens, more to come]
//! batch    tokens a|b|c c c c c|d d d d d d d d     segments 0..1, 1..2, 2..7, 7..15
//! logits   rows 0, 1, 6 (the last row of every chunk that samples), in chunk order
//! ```

use std::collections::HashMap;
use std::panic::{catch_unwind, AssertUnwindSafe};

use kimi_model::{Batch, CachePool, CausalLm, ForwardOptions, ForwardOutput, RowPicks, SeqCache};
use kimi_ops::{Backend, Segment};

use crate::cache_manager::ForkCopy;
use crate::scheduler::Chunk;
use crate::serving::RequestId;

/// Runs steps on one model.
pub(crate) struct ModelRunner<B: Backend> {
    model: Box<dyn CausalLm<B>>,
    pool: CachePool<B>,
    seqs: HashMap<RequestId, SeqCache>,
    options: ForwardOptions,
}

impl<B: Backend> ModelRunner<B> {
    /// A runner with no sequences over a pool made for `model`.
    pub(crate) fn new(model: Box<dyn CausalLm<B>>, pool: CachePool<B>) -> Self {
        Self {
            model,
            pool,
            seqs: HashMap::new(),
            options: ForwardOptions::default(),
        }
    }

    /// Forgets `id` (finished, cancelled or preempted); its blocks and slot go back to the
    /// cache manager, which frees them in the same call.
    pub(crate) fn release(&mut self, id: RequestId) {
        self.seqs.remove(&id);
    }

    /// Makes `child` a copy of `parent`'s cached state, in the blocks and slot the cache
    /// manager gave it (`copy` says what to duplicate; the full blocks are shared). On
    /// error the child has no cache here and must be prefilled.
    pub(crate) fn fork(
        &mut self,
        parent: RequestId,
        child: RequestId,
        copy: &ForkCopy,
        block_ids: Vec<u32>,
    ) -> Result<(), String> {
        let Some(num_tokens) = self.seqs.get(&parent).map(|s| s.num_tokens) else {
            return Err(format!("request {} has no cache to fork", parent.0));
        };
        let (model, pool) = (&self.model, &mut self.pool);
        catch_unwind(AssertUnwindSafe(|| {
            model.fork_state(pool, copy.slots, copy.block)
        }))
        .map_err(|p| panic_message(&*p))?
        .map_err(|e| e.to_string())?;
        let seq = SeqCache {
            block_table: block_ids,
            slot: copy.slots.1,
            num_tokens,
        };
        self.seqs.insert(child, seq);
        Ok(())
    }

    /// Whether the backend samples where the logits are ([`Backend::samples_on_device`]).
    pub(crate) fn samples_on_device(&self) -> bool {
        self.model.backend().samples_on_device()
    }

    /// Which rank holds which routed experts (expert parallelism).
    pub(crate) fn expert_ranks(
        &self,
    ) -> Option<std::sync::Arc<kimi_model::parallel::ExpertPlacement>> {
        self.model.expert_ranks()
    }

    /// Moves the routed experts between ranks ([`CausalLm::set_expert_ranks`]).
    pub(crate) fn set_expert_ranks(
        &mut self,
        placement: std::sync::Arc<kimi_model::parallel::ExpertPlacement>,
    ) -> kimi_model::Result<()> {
        self.model.set_expert_ranks(placement)
    }

    /// Why the model can run no more steps, once that is so.
    pub(crate) fn model_failure(&self) -> Option<String> {
        self.model.failure()
    }

    /// The expert tiers' placement and counters, when some experts live off the device.
    pub(crate) fn expert_offload(&self) -> Option<crate::ExpertOffloadMetrics> {
        let counts = self.model.offload_counts()?;
        let placement = self.model.expert_placement().into_iter().fold(
            kimi_model::Placement::default(),
            |mut sum, (_, p)| {
                sum += p;
                sum
            },
        );
        Some(crate::ExpertOffloadMetrics { placement, counts })
    }

    /// Bytes the cache pool occupies.
    pub(crate) fn cache_bytes(&self) -> usize {
        self.pool.size_bytes(self.model.backend())
    }

    /// One forward pass over `chunks`; logits come back for every chunk that samples, in
    /// chunk order. A chunk starting at 0 starts its sequence afresh (its slot's state is
    /// zeroed by the model). On error (a panic inside the backend included) every chunk's
    /// sequence is forgotten.
    ///
    /// Unless `picks` is [`Picks::Logits`], the model returns each sampling chunk's token
    /// instead of its logits row.
    pub(crate) fn execute(
        &mut self,
        chunks: &[Chunk],
        picks: Picks,
    ) -> Result<ForwardOutput, String> {
        let mut seqs = Vec::with_capacity(chunks.len());
        for chunk in chunks {
            let seq = match (chunk.start, self.seqs.remove(&chunk.id)) {
                (0, _) => SeqCache::new(chunk.slot, chunk.new_blocks.clone()),
                (start, Some(mut seq)) if seq.num_tokens == start && seq.slot == chunk.slot => {
                    seq.block_table.extend_from_slice(&chunk.new_blocks);
                    seq
                }
                (start, _) => {
                    return Err(format!(
                        "internal error: the cache of request {} does not hold its first {start} tokens",
                        chunk.id.0
                    ))
                }
            };
            seqs.push(seq);
        }
        let mut batch = batch_of(chunks);
        let (model, pool) = (&self.model, &mut self.pool);
        let returns_ids = !matches!(picks, Picks::Logits);
        let options = ForwardOptions {
            greedy_ids: matches!(picks, Picks::Greedy),
            ..self.options
        };
        if let Picks::Sample(rows) = picks {
            batch.sampling = Some(rows);
        }
        let result = catch_unwind(AssertUnwindSafe(|| {
            let mut refs: Vec<&mut SeqCache> = seqs.iter_mut().collect();
            model.forward(&batch, pool, &mut refs, options)
        }));
        let num_rows = chunks.iter().filter(|c| c.samples).count();
        match result {
            Ok(Ok(out)) if returns_ids && out.token_ids.len() != num_rows => Err(format!(
                "internal error: the model returned {} tokens for {num_rows} rows",
                out.token_ids.len()
            )),
            Ok(Ok(out)) if !returns_ids && out.logits.len() != num_rows * out.vocab_size => {
                Err(format!(
                    "internal error: the model returned {} logits for {num_rows} rows of {}",
                    out.logits.len(),
                    out.vocab_size
                ))
            }
            Ok(Ok(out)) => {
                for (chunk, seq) in chunks.iter().zip(seqs) {
                    self.seqs.insert(chunk.id, seq);
                }
                Ok(out)
            }
            Ok(Err(e)) => Err(format!("the model failed: {e}")),
            Err(panic) => Err(format!("the model failed: {}", panic_message(&*panic))),
        }
    }
}

/// How a step's sampling rows get their tokens.
#[derive(Debug)]
pub(crate) enum Picks {
    /// The logits rows come back; the engine samples.
    Logits,
    /// The backend takes each row's argmax.
    Greedy,
    /// The backend samples each row by these rules.
    Sample(RowPicks),
}

/// Flattens the chunks into one batch: segment `i` is chunk `i`.
fn batch_of(chunks: &[Chunk]) -> Batch {
    let mut batch = Batch::default();
    for chunk in chunks {
        let start = batch.tokens.len();
        batch.tokens.extend_from_slice(&chunk.tokens);
        batch.segments.push(Segment {
            start,
            len: chunk.tokens.len(),
        });
        if chunk.samples {
            batch.logits_rows.push(batch.tokens.len() - 1);
        }
    }
    batch
}

/// The text of a panic payload.
pub(crate) fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "panic".to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn batch_rows_follow_chunks() {
        let chunk = |id, start, tokens: &[u32], samples| Chunk {
            id: RequestId(id),
            start,
            tokens: tokens.to_vec(),
            samples,
            slot: id as u32,
            new_blocks: vec![],
        };
        let chunks = [
            chunk(0, 4, &[5], true),
            chunk(1, 0, &[1, 2, 3], true),
            chunk(2, 0, &[9, 9], false),
        ];
        let batch = batch_of(&chunks);
        assert_eq!(batch.tokens, vec![5, 1, 2, 3, 9, 9]);
        assert_eq!(
            batch.segments,
            vec![
                Segment { start: 0, len: 1 },
                Segment { start: 1, len: 3 },
                Segment { start: 4, len: 2 }
            ]
        );
        assert_eq!(batch.logits_rows, vec![0, 3]);
    }
}
