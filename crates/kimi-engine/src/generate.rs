//! Single-sequence generation: prefill in chunks, then decode token by token.

use std::ops::ControlFlow;

use kimi_model::{Batch, CachePool, CausalLm, ForwardOptions, SeqCache};
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
        let batch = Batch {
            tokens: chunk.to_vec(),
            segments: vec![Segment {
                start: 0,
                len: chunk.len(),
            }],
            logits_rows: rows,
        };
        Ok(self
            .model
            .forward(&batch, pool, &mut [seq], self.options)?
            .logits)
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
        let mut logits = Vec::new();
        for chunk in prompt.chunks(self.prefill_chunk.max(1)) {
            logits = self.forward_chunk(chunk, &mut pool, &mut seq, false)?;
        }
        let prefill_secs = start.elapsed().as_secs_f64();
        let decode_start = std::time::Instant::now();
        let mut tokens: Vec<Sampled> = Vec::new();
        let mut output_ids: Vec<u32> = Vec::new();
        let finish = loop {
            let next = sampler.sample(&mut logits, prompt, &output_ids);
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
            let last = output_ids[output_ids.len() - 1];
            logits = self.forward_chunk(&[last], &mut pool, &mut seq, false)?;
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
