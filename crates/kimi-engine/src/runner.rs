//! The model runner: owns the model and every running sequence's cache, and turns a
//! [`StepPlan`](crate::scheduler::StepPlan)'s chunks into one batched forward pass.
//!
//! ```text
//! chunks   [A: 1 token][B: 1 token][C: 5 tokens, samples][D: 8 tokens, more to come]
//! batch    tokens a|b|c c c c c|d d d d d d d d     segments 0..1, 1..2, 2..7, 7..15
//! logits   rows 0, 1, 6 (the last row of every chunk that samples), in chunk order
//! ```

use std::collections::HashMap;
use std::panic::{catch_unwind, AssertUnwindSafe};

use kimi_model::{Batch, CausalLm, ForwardOptions, ForwardOutput, SeqCache};
use kimi_ops::{Backend, Segment};

use crate::scheduler::Chunk;
use crate::serving::RequestId;

/// Runs steps on one model.
pub(crate) struct ModelRunner<B: Backend> {
    model: Box<dyn CausalLm<B>>,
    caches: HashMap<RequestId, SeqCache<B>>,
    options: ForwardOptions,
}

impl<B: Backend> ModelRunner<B> {
    /// A runner with no sequences.
    pub(crate) fn new(model: Box<dyn CausalLm<B>>) -> Self {
        Self {
            model,
            caches: HashMap::new(),
            options: ForwardOptions::default(),
        }
    }

    /// Drops the cache of `id` (finished, cancelled or preempted).
    pub(crate) fn release(&mut self, id: RequestId) {
        self.caches.remove(&id);
    }

    /// One forward pass over `chunks`; logits come back for every chunk that samples, in
    /// chunk order. A chunk starting at 0 gets a fresh cache. On error (a panic inside the
    /// backend included) the caches of every chunk are dropped.
    pub(crate) fn execute(&mut self, chunks: &[Chunk]) -> Result<ForwardOutput, String> {
        let mut caches = Vec::with_capacity(chunks.len());
        for chunk in chunks {
            let cache = match (chunk.start, self.caches.remove(&chunk.id)) {
                (0, _) => self.model.new_cache().map_err(|e| e.to_string())?,
                (start, Some(cache)) if cache.num_tokens == start => cache,
                (start, _) => {
                    return Err(format!(
                        "internal error: the cache of request {} does not hold its first {start} tokens",
                        chunk.id.0
                    ))
                }
            };
            caches.push(cache);
        }
        let batch = batch_of(chunks);
        let model = &self.model;
        let options = self.options;
        let result = catch_unwind(AssertUnwindSafe(|| {
            let mut refs: Vec<&mut SeqCache<B>> = caches.iter_mut().collect();
            model.forward(&batch, &mut refs, options)
        }));
        let num_rows = chunks.iter().filter(|c| c.samples).count();
        match result {
            Ok(Ok(out)) if out.logits.len() != num_rows * out.vocab_size => Err(format!(
                "internal error: the model returned {} logits for {num_rows} rows of {}",
                out.logits.len(),
                out.vocab_size
            )),
            Ok(Ok(out)) => {
                for (chunk, cache) in chunks.iter().zip(caches) {
                    self.caches.insert(chunk.id, cache);
                }
                Ok(out)
            }
            Ok(Err(e)) => Err(format!("the model failed: {e}")),
            Err(panic) => Err(format!("the model failed: {}", panic_message(&*panic))),
        }
    }
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
