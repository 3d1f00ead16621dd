//! `kimi-infer run --num-beams N`: beam search on the serving engine, for one prompt.
//!
//! The beams are sequences of the continuous batch, as in `serve`: the model goes to an
//! engine sized for this one request (`num_beams` sequences, blocks for every beam's
//! worst case), which returns the best beams at the end; nothing is streamed.

use anyhow::Context;
use kimi_engine::beam::BeamOutput;
use kimi_engine::sampling::SamplingParams;
use kimi_engine::stop::StopMatcher;
use kimi_engine::{Engine, EngineHandle, Event, Request, ServingConfig};
use kimi_ops::Backend;
use kimi_tokenizer::{StreamDecoder, Tokenizer};

const BLOCK_SIZE: usize = 16;

/// Runs the search and prints the best beam to stdout, every beam to stderr.
pub fn run_beams<B: Backend + 'static>(
    engine: Engine<B>,
    tok: &Tokenizer,
    prompt: Vec<u32>,
    params: SamplingParams,
) -> anyhow::Result<()> {
    let beam = params.beam.clone().context("beam parameters")?;
    let model = engine.into_model();
    let vocab = model.vocab_size();
    params
        .validate(vocab)
        .map_err(|e| anyhow::anyhow!("{e} (the flag is --{})", flag_of(&e)))?;
    let context = model.max_context();
    if prompt.is_empty() || prompt.len() >= context {
        anyhow::bail!(
            "the prompt has {} tokens; the model's context is {context}",
            prompt.len()
        );
    }
    let output = params.max_tokens.min(context - prompt.len());
    let max_model_len = prompt.len() + output;
    let num_seqs = beam.num_beams.max(1);
    let per_beam = (prompt.len() % BLOCK_SIZE + output).div_ceil(BLOCK_SIZE);
    let num_blocks =
        (prompt.len() / BLOCK_SIZE + num_seqs * per_beam).max(max_model_len.div_ceil(BLOCK_SIZE));
    let config = ServingConfig {
        max_model_len: (max_model_len + 1).min(context),
        max_num_seqs: num_seqs,
        max_num_batched_tokens: prompt.len().max(num_seqs),
        block_size: BLOCK_SIZE,
        num_blocks,
        max_waiting: 1,
        expert_rebalance: None,
    };
    let mut eos = tok.eos_ids();
    eos.extend(model.eos_token_ids().iter().copied());
    let handle = EngineHandle::spawn(model, config)?;
    let stop = params.stop.clone();
    let request = Request {
        prompt,
        params,
        eos_ids: eos,
        logits_processor: None,
    };
    let (_, mut events) = handle.submit(request)?;
    let mut beams: Vec<BeamOutput> = Vec::new();
    while let Some(event) = events.blocking_recv() {
        match event {
            Event::Beams(b) => beams = b,
            Event::Error(e) => anyhow::bail!("beam search failed: {e}"),
            Event::Finished { .. } => break,
            Event::Started { .. } | Event::Token(_) => {}
        }
    }
    handle.shutdown(true);
    for (i, b) in beams.iter().enumerate() {
        let text = beam_text(tok, b, &stop);
        if i == 0 {
            println!("{text}");
        }
        eprintln!(
            "[beam {i}: score {:.4}, logprob {:.4}, {} tokens, finish {:?}] {text:?}",
            b.score,
            b.cumulative_logprob,
            b.tokens.len(),
            b.finish
        );
    }
    Ok(())
}

/// A beam's text, cut at the first stop string.
fn beam_text(tok: &Tokenizer, beam: &BeamOutput, stop: &[String]) -> String {
    let mut decoder = StreamDecoder::new(tok, true);
    let mut stops = StopMatcher::new(stop);
    let mut text = String::new();
    for t in &beam.tokens {
        let out = stops.push(&decoder.push(t.token));
        text.push_str(&out.emit);
        if out.stopped {
            return text;
        }
    }
    let out = stops.push(&decoder.finish());
    text.push_str(&out.emit);
    if !out.stopped {
        text.push_str(&stops.finish());
    }
    text
}

/// The command-line flag of a sampling field.
fn flag_of(err: &kimi_engine::sampling::SamplingError) -> String {
    match err {
        kimi_engine::sampling::SamplingError::Invalid { field, .. } => field.replace('_', "-"),
        _ => "?".into(),
    }
}
