//! Single-sequence generation: prefill in chunks, then decode token by token.

use std::ops::ControlFlow;

use kimi_model::{Batch, CachePool, CausalLm, ForwardOptions, RowPicks, SeqCache};
use kimi_ops::{Backend, Segment};

use crate::sampling::{Sampled, Sampler, SamplingParams};
use crate::{EngineError, Result};

/// Why generation ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinishReason {
    /// An end-of-sequence or stop token was produced (it is not part of the output).
    Stop,
    /// `max_tokens` was reached.
    Length,
    /// The caller asked to stop (a stop string matched, or the client left).
    Cancelled,
}

/// What a generation produced.
#[derive(Clone, Debug)]
pub struct Generation {
    /// Generated tokens (without the final stop token).
    pub tokens: Vec<Sampled>,
    /// Why it ended.
    pub finish: FinishReason,
    /// Prompt tokens.
    pub num_prompt_tokens: usize,
    /// Seconds spent on the prompt (prefill).
    pub prefill_secs: f64,
    /// Seconds spent decoding after the first token.
    pub decode_secs: f64,
}

/// Drives one model for single sequences. The server's scheduler batches many of these.
pub struct Engine<B: Backend> {
    model: Box<dyn CausalLm<B>>,
    /// Tokens per prefill forward pass (chunked prefill bounds activation memory).
    pub prefill_chunk: usize,
    /// Kernel choices.
    pub options: ForwardOptions,
}

impl<B: Backend> Engine<B> {
    /// Wraps a loaded model.
    pub fn new(model: impl CausalLm<B> + 'static) -> Self {
        Self {
            model: Box::new(model),
            prefill_chunk: 512,
            options: ForwardOptions::default(),
        }
    }

    /// The model.
    pub fn model(&self) -> &dyn CausalLm<B> {
        self.model.as_ref()
    }

    /// Gives the model back (e.g. to hand it to the serving engine).
    pub fn into_model(self) -> Box<dyn CausalLm<B>> {
        self.model
    }

    /// Feeds `ids` through a cache `step` tokens at a time and returns the logits of every
    /// position, `[ids.len(), vocab]`. `step = ids.len()` is one prefill; `1` is pure decode.
    pub fn logits(&self, ids: &[u32], step: usize) -> Result<Vec<f32>> {
        if step == 0 {
            return Err(EngineError::Request("step must be at least 1".into()));
        }
        let (mut pool, mut seq) = self.model.single_cache(ids.len())?;
        let mut all = Vec::with_capacity(ids.len() * self.model.vocab_size());
        for chunk in ids.chunks(step) {
            let out = self.forward_chunk(chunk, &mut pool, &mut seq, true)?;
            all.extend_from_slice(&out);
        }
        Ok(all)
    }

    /// Runs `chunk` through `seq`; returns logits of every row or of the last one.
    fn forward_chunk(
        &self,
        chunk: &[u32],
        pool: &mut CachePool<B>,
        seq: &mut SeqCache,
        every_row: bool,
    ) -> Result<Vec<f32>> {
        let rows = if every_row {
            (0..chunk.len()).collect()
        } else {
            vec![chunk.len() - 1]
        };
        let mut batch = one_sequence(chunk, None);
        batch.logits_rows = rows;
        Ok(self
            .model
            .forward(&batch, pool, &mut [seq], self.options)?
            .logits)
    }

    /// Runs a prompt chunk whose logits nobody needs (the backend's argmax of its last row
    /// is the cheapest output to ask for).
    fn prefill_chunk(
        &self,
        chunk: &[u32],
        pool: &mut CachePool<B>,
        seq: &mut SeqCache,
    ) -> Result<()> {
        let batch = one_sequence(chunk, None);
        let options = ForwardOptions {
            greedy_ids: true,
            ..self.options
        };
        self.model.forward(&batch, pool, &mut [seq], options)?;
        Ok(())
    }

    /// Runs `chunk` through `seq` and chooses the token after it: on the backend when the
    /// sampler is plain greedy or the backend samples where the logits are (and no logprobs
    /// are wanted), else here from the copied logits row.
    fn next_token(
        &self,
        chunk: &[u32],
        pool: &mut CachePool<B>,
        seq: &mut SeqCache,
        sampler: &mut Sampler,
        prompt: &[u32],
        output: &[u32],
    ) -> Result<Sampled> {
        let mut options = self.options;
        let mut picks = None;
        if sampler.is_plain_greedy() {
            options.greedy_ids = true;
        } else if self.model.backend().samples_on_device() {
            let mut penalties = Vec::new();
            picks = sampler
                .device_row(prompt, output, 0, &mut penalties)
                .map(|rules| RowPicks {
                    rows: vec![rules],
                    penalties,
                });
        }
        let batch = one_sequence(chunk, picks);
        let mut out = self.model.forward(&batch, pool, &mut [seq], options)?;
        Ok(match out.token_ids.first() {
            Some(&token) => Sampled::greedy(token),
            None => sampler.sample(&mut out.logits, prompt, output),
        })
    }

    /// Generates from `prompt`, calling `on_token` after each sampled token; the callback
    /// can stop generation early by returning `ControlFlow::Break`.
    pub fn generate(
        &self,
        prompt: &[u32],
        params: &SamplingParams,
        eos_ids: &[u32],
        mut on_token: impl FnMut(&Sampled) -> ControlFlow<()>,
    ) -> Result<Generation> {
        let vocab = self.model.vocab_size();
        params
            .validate(vocab)
            .map_err(|e| EngineError::Request(e.to_string()))?;
        if prompt.is_empty() {
            return Err(EngineError::Request("the prompt has no tokens".into()));
        }
        let max_len = self.model.max_context();
        if prompt.len() >= max_len {
            return Err(EngineError::Request(format!(
                "the prompt has {} tokens but the model's context is {max_len}",
                prompt.len()
            )));
        }
        let mut sampler = Sampler::new(params);
        // One sequence's own pool, as large as the prompt and output can grow.
        let max_tokens = prompt.len().saturating_add(params.max_tokens).min(max_len);
        let (mut pool, mut seq) = self.model.single_cache(max_tokens)?;
        let start = std::time::Instant::now();
        let chunks: Vec<&[u32]> = prompt.chunks(self.prefill_chunk.max(1)).collect();
        let (last_chunk, first_chunks) = chunks.split_last().expect("the prompt is not empty");
        for chunk in first_chunks {
            self.prefill_chunk(chunk, &mut pool, &mut seq)?;
        }
        let mut tokens: Vec<Sampled> = Vec::new();
        let mut output_ids: Vec<u32> = Vec::new();
        let mut next =
            self.next_token(last_chunk, &mut pool, &mut seq, &mut sampler, prompt, &[])?;
        let prefill_secs = start.elapsed().as_secs_f64();
        let decode_start = std::time::Instant::now();
        let finish = loop {
            let is_stop = params.stop_token_ids.contains(&next.token)
                || (!params.ignore_eos && eos_ids.contains(&next.token));
            if is_stop {
                break FinishReason::Stop;
            }
            output_ids.push(next.token);
            let flow = on_token(&next);
            tokens.push(next);
            if flow.is_break() {
                break FinishReason::Cancelled;
            }
            if output_ids.len() >= params.max_tokens || prompt.len() + output_ids.len() >= max_len {
                break FinishReason::Length;
            }
            let last = [output_ids[output_ids.len() - 1]];
            next = self.next_token(
                &last,
                &mut pool,
                &mut seq,
                &mut sampler,
                prompt,
                &output_ids,
            )?;
        };
        Ok(Generation {
            tokens,
            finish,
            num_prompt_tokens: prompt.len(),
            prefill_secs,
            decode_secs: decode_start.elapsed().as_secs_f64(),
        })
    }
}

/// A batch of one sequence's `chunk` that wants the logits of its last row.
fn one_sequence(chunk: &[u32], sampling: Option<RowPicks>) -> Batch {
    Batch {
        tokens: chunk.to_vec(),
        segments: vec![Segment {
            start: 0,
            len: chunk.len(),
        }],
        logits_rows: vec![chunk.len() - 1],
        sampling,
    }
}
