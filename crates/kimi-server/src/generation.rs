//! Running one request's sequences on the engine and turning their [`Event`]s into text,
//! tool calls and logprobs ([`Delta`]s), for both streaming and whole responses.
//!
//! ```text
//! handler ─► Run::submit ─► engine (one sequence per choice)
//!                 │  events per choice
//!                 ▼
//!   Run::next ─► ChoiceOutput: tokens ─► K2 tool parser ─► UTF-8 decoder ─► stop matcher
//!                                    ├──► text tool-call parser (content, tool calls) ──┤
//!                                    └──► XTML parser (reasoning, content, tool calls) ─┘
//!                 │  Delta { reasoning, content, tool_calls, logprobs, finish_reason }
//!                 ▼
//!   JSON body (collect) or SSE chunks (stream)
//! ```
//!
//! Dropping a [`Run`] (client gone, timeout) cancels every sequence still running.

use std::future::poll_fn;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::task::Poll;
use std::time::Instant;

use kimi_engine::sampling::{Sampled, SamplingParams};
use kimi_engine::serving::{Event, LogitsProcessor, Request, RequestId, SubmitError};
use kimi_engine::stop::StopMatcher;
use kimi_engine::FinishReason;
use kimi_tokenizer::Tokenizer;
use tokio::sync::mpsc::UnboundedReceiver;

use crate::access_log::RequestRecord;
use crate::beam_relay::BeamRelay;
use crate::decode::{token_bytes, ByteDecoder};
use crate::error::ApiError;
use crate::json_tool_parser::{JsonToolParser, ToolEvent};
use crate::metrics::SequenceStats;
use crate::state::{Inner, Permit};
use crate::tool_format::JsonToolKind;
use crate::tool_parser::{Piece, ToolParser, ToolTokens};
use crate::xtml_output::{XtmlEvent, XtmlParser, XtmlStart, XtmlTokens};

/// One sequence to run.
pub(crate) struct SequenceSetup {
    pub prompt: Vec<u32>,
    pub params: SamplingParams,
    pub processor: Option<Box<dyn LogitsProcessor>>,
}

/// How generated tokens are read.
#[derive(Clone, Copy, Debug)]
pub(crate) enum OutputFormat {
    /// All text.
    Text,
    /// Text and Kimi K2 tool-call sections.
    KimiK2Tools(ToolTokens),
    /// Text and tool calls in one of the text formats.
    JsonTools(JsonToolKind),
    /// Kimi K3's XTML: reasoning, response and (with `tools`) tool calls.
    Xtml {
        tokens: XtmlTokens,
        start: XtmlStart,
        tools: bool,
    },
}

/// How generated tokens become output.
#[derive(Clone, Copy, Debug)]
pub(crate) struct OutputOptions {
    pub format: OutputFormat,
    /// `tool_choice` named a function: the finish reason stays `stop` (as OpenAI).
    pub named_tool: bool,
    /// Report each token's logprob.
    pub logprobs: bool,
    /// Leave special tokens out of the text.
    pub skip_special: bool,
}

/// One token's logprob and its alternatives.
#[derive(Clone, Debug)]
pub(crate) struct TokenLogprob {
    pub token: u32,
    pub logprob: f32,
    pub top: Vec<(u32, f32)>,
}

/// Part of a tool call, as OpenAI streams it: the first part has id and name.
#[derive(Clone, Debug, Default)]
pub(crate) struct ToolCallDelta {
    pub index: usize,
    pub id: Option<String>,
    pub name: Option<String>,
    pub arguments: String,
}

/// What one event added to a choice.
#[derive(Debug, Default)]
pub(crate) struct Delta {
    /// Reasoning (`reasoning_content`), XTML only.
    pub reasoning: String,
    pub content: String,
    pub tool_calls: Vec<ToolCallDelta>,
    pub logprobs: Vec<TokenLogprob>,
    /// Set on the choice's last delta: `stop`, `length`, `tool_calls`, `abort`, `error`.
    pub finish_reason: Option<&'static str>,
    /// The engine failed this sequence.
    pub error: Option<String>,
}

impl Delta {
    /// Nothing for the client.
    pub(crate) fn is_empty(&self) -> bool {
        self.content.is_empty()
            && self.reasoning.is_empty()
            && self.tool_calls.is_empty()
            && self.logprobs.is_empty()
            && self.finish_reason.is_none()
            && self.error.is_none()
    }
}

/// The parser of one sequence's tokens.
enum Parser {
    Text,
    KimiK2(ToolParser),
    Json(JsonToolParser),
    Xtml(XtmlParser),
}

/// Turns one sequence's tokens into output.
struct ChoiceOutput {
    content: ByteDecoder,
    /// Stop strings apply to content (not to reasoning or tool calls).
    stop: StopMatcher,
    parser: Parser,
    options: OutputOptions,
    num_tokens: usize,
}

impl ChoiceOutput {
    fn new(options: OutputOptions, stop: &[String]) -> Self {
        let parser = match options.format {
            OutputFormat::Text => Parser::Text,
            OutputFormat::KimiK2Tools(tokens) => Parser::KimiK2(ToolParser::new(tokens)),
            OutputFormat::JsonTools(kind) => {
                Parser::Json(JsonToolParser::new(kind, options.skip_special))
            }
            OutputFormat::Xtml {
                tokens,
                start,
                tools,
            } => Parser::Xtml(XtmlParser::new(tokens, start, tools, options.skip_special)),
        };
        ChoiceOutput {
            content: ByteDecoder::default(),
            stop: StopMatcher::new(stop),
            parser,
            options,
            num_tokens: 0,
        }
    }

    fn on_token(&mut self, tokenizer: &Tokenizer, sampled: Sampled, delta: &mut Delta) {
        self.num_tokens += 1;
        if self.options.logprobs {
            delta.logprobs.push(TokenLogprob {
                token: sampled.token,
                logprob: sampled.logprob,
                top: sampled.top_logprobs,
            });
        }
        let pieces = match &mut self.parser {
            Parser::Text => vec![Piece::Content(sampled.token)],
            Parser::KimiK2(parser) => parser.push(tokenizer, sampled.token),
            Parser::Xtml(parser) => {
                let events = parser.push_token(tokenizer, sampled.token);
                self.apply_xtml(events, delta);
                return;
            }
            Parser::Json(parser) => {
                let events = parser.push_token(tokenizer, sampled.token);
                self.apply_json(events, delta);
                return;
            }
        };
        self.apply(tokenizer, pieces, delta);
    }

    fn apply_xtml(&mut self, events: Vec<XtmlEvent>, delta: &mut Delta) {
        for event in events {
            match event {
                XtmlEvent::Reasoning(text) => delta.reasoning += &text,
                XtmlEvent::Content(text) => self.push_text(&text, delta),
                XtmlEvent::CallStart { index, id, name } => delta.tool_calls.push(ToolCallDelta {
                    index,
                    id: Some(id),
                    name: Some(name),
                    arguments: String::new(),
                }),
                XtmlEvent::Arguments { index, text } => add_arguments(delta, index, text),
            }
        }
    }

    fn apply_json(&mut self, events: Vec<ToolEvent>, delta: &mut Delta) {
        for event in events {
            match event {
                ToolEvent::Content(text) => self.push_text(&text, delta),
                ToolEvent::CallStart { index, id, name } => delta.tool_calls.push(ToolCallDelta {
                    index,
                    id: Some(id),
                    name: Some(name),
                    arguments: String::new(),
                }),
                ToolEvent::Arguments { index, text } => add_arguments(delta, index, text),
            }
        }
    }

    fn apply(&mut self, tokenizer: &Tokenizer, pieces: Vec<Piece>, delta: &mut Delta) {
        for piece in pieces {
            match piece {
                Piece::Content(id) => {
                    if self.options.skip_special && tokenizer.is_special(id) {
                        continue;
                    }
                    let text = self.content.push(&token_bytes(tokenizer, id));
                    self.push_text(&text, delta);
                }
                Piece::CallStart { index, id, name } => delta.tool_calls.push(ToolCallDelta {
                    index,
                    id: Some(id),
                    name: Some(name),
                    arguments: String::new(),
                }),
                Piece::Arguments { index, text } => add_arguments(delta, index, text),
            }
        }
    }

    fn push_text(&mut self, text: &str, delta: &mut Delta) {
        if text.is_empty() || self.stop.stopped() {
            return;
        }
        let out = self.stop.push(text);
        delta.content += &out.emit;
        if out.stopped {
            delta.finish_reason = Some("stop");
        }
    }

    fn on_finished(&mut self, tokenizer: &Tokenizer, reason: FinishReason, delta: &mut Delta) {
        match &mut self.parser {
            Parser::Text => {}
            Parser::KimiK2(parser) => {
                let pieces = parser.finish();
                self.apply(tokenizer, pieces, delta);
            }
            Parser::Xtml(parser) => {
                let events = parser.finish();
                self.apply_xtml(events, delta);
            }
            Parser::Json(parser) => {
                let events = parser.finish();
                self.apply_json(events, delta);
            }
        }
        let rest = self.content.finish();
        self.push_text(&rest, delta);
        if !self.stop.stopped() {
            delta.content += &self.stop.finish();
        }
        let num_calls = match &self.parser {
            Parser::Text => 0,
            Parser::KimiK2(parser) => parser.num_calls(),
            Parser::Xtml(parser) => parser.num_calls(),
            Parser::Json(parser) => parser.num_calls(),
        };
        delta.finish_reason = Some(match reason {
            _ if self.stop.stopped() => "stop",
            FinishReason::Length => "length",
            FinishReason::Stop if num_calls > 0 && !self.options.named_tool => "tool_calls",
            FinishReason::Stop => "stop",
            FinishReason::Cancelled => "abort",
        });
    }
}

/// Adds argument text to the delta's part of call `index`.
fn add_arguments(delta: &mut Delta, index: usize, text: String) {
    match delta.tool_calls.last_mut() {
        Some(last) if last.index == index => last.arguments += &text,
        _ => delta.tool_calls.push(ToolCallDelta {
            index,
            arguments: text,
            ..ToolCallDelta::default()
        }),
    }
}

/// One running sequence.
struct Sequence {
    id: RequestId,
    events: UnboundedReceiver<Event>,
    output: ChoiceOutput,
    done: bool,
    prompt_tokens: usize,
    queue_secs: Option<f64>,
    first_token: Option<Instant>,
    last_token: Option<Instant>,
}

/// A submitted request: its sequences, in choice order.
pub(crate) struct Run {
    state: Arc<Inner>,
    sequences: Vec<Sequence>,
    arrival: Instant,
    /// Round-robin start for polling, so one busy choice cannot starve the others.
    next_poll: usize,
    /// Where the access log reads the token counts.
    record: Option<Arc<RequestRecord>>,
    /// Beam search requests whose beams have not come yet.
    relays: Vec<BeamRelay>,
    _permit: Permit,
}

fn submit_error(err: SubmitError) -> ApiError {
    match err {
        SubmitError::QueueFull(_) => ApiError::overloaded(err.to_string()),
        SubmitError::ShuttingDown => ApiError::unavailable(err.to_string()),
        SubmitError::Invalid(message) => ApiError::invalid(message, None),
        other => ApiError::internal(other.to_string()),
    }
}

impl Run {
    /// Submits every sequence, or none: on a failure the ones already queued are cancelled.
    pub(crate) fn submit(
        state: &Arc<Inner>,
        setups: Vec<SequenceSetup>,
        options: OutputOptions,
        arrival: Instant,
        record: Option<Arc<RequestRecord>>,
    ) -> Result<Run, ApiError> {
        let permit = state.reserve(setups.len())?;
        if let Some(record) = &record {
            let prompt_tokens = setups.iter().map(|s| s.prompt.len()).sum();
            record.prompt_tokens.store(prompt_tokens, Ordering::Relaxed);
        }
        let mut run = Run {
            state: Arc::clone(state),
            sequences: Vec::with_capacity(setups.len()),
            arrival,
            next_poll: 0,
            record,
            relays: Vec::new(),
            _permit: permit,
        };
        let eos_ids = state.tokenizer.eos_ids();
        let mut setups = setups.into_iter();
        while let Some(setup) = setups.next() {
            if let Some(n) = setup.params.beam.as_ref().map(|b| b.num_return) {
                // A beam search's `n` choices come as `n` equal setups: one request.
                for _ in 1..n {
                    setups.next();
                }
                run.submit_beams(setup, n, options, eos_ids.clone())?;
                continue;
            }
            let output = ChoiceOutput::new(options, &setup.params.stop);
            let prompt_tokens = setup.prompt.len();
            let request = Request {
                prompt: setup.prompt,
                params: setup.params,
                eos_ids: eos_ids.clone(),
                logits_processor: setup.processor,
            };
            // On error `run` drops here and cancels what was queued.
            let (id, events) = state.generator.submit(request).map_err(submit_error)?;
            run.sequences.push(Sequence {
                id,
                events,
                output,
                done: false,
                prompt_tokens,
                queue_secs: None,
                first_token: None,
                last_token: None,
            });
        }
        Ok(run)
    }

    /// Submits one beam search request for `n` choices.
    fn submit_beams(
        &mut self,
        setup: SequenceSetup,
        n: usize,
        options: OutputOptions,
        eos_ids: Vec<u32>,
    ) -> Result<(), ApiError> {
        let prompt_tokens = setup.prompt.len();
        let stop = setup.params.stop.clone();
        let request = Request {
            prompt: setup.prompt,
            params: setup.params,
            eos_ids,
            logits_processor: setup.processor,
        };
        let (id, events) = self.state.generator.submit(request).map_err(submit_error)?;
        let (relay, receivers) = BeamRelay::new(events, n, prompt_tokens);
        self.relays.push(relay);
        for events in receivers {
            self.sequences.push(Sequence {
                id,
                events,
                output: ChoiceOutput::new(options, &stop),
                done: false,
                prompt_tokens,
                queue_secs: None,
                first_token: None,
                last_token: None,
            });
        }
        Ok(())
    }

    /// Tokens generated so far by each choice.
    pub(crate) fn completion_tokens(&self) -> usize {
        self.sequences.iter().map(|s| s.output.num_tokens).sum()
    }

    /// The next change of any choice, as `(choice index, delta)`; `None` once all finished.
    pub(crate) async fn next(&mut self) -> Option<(usize, Delta)> {
        loop {
            let (index, event) = self.next_event().await?;
            let delta = self.on_event(index, event);
            if !delta.is_empty() {
                return Some((index, delta));
            }
        }
    }

    async fn next_event(&mut self) -> Option<(usize, Option<Event>)> {
        let num = self.sequences.len();
        let start = self.next_poll;
        poll_fn(|cx| {
            self.relays.retain_mut(|relay| relay.poll(cx).is_pending());
            let mut any_running = false;
            for k in 0..num {
                let i = (start + k) % num;
                let seq = &mut self.sequences[i];
                if seq.done {
                    continue;
                }
                any_running = true;
                if let Poll::Ready(event) = seq.events.poll_recv(cx) {
                    return Poll::Ready(Some((i, event)));
                }
            }
            if any_running {
                Poll::Pending
            } else {
                Poll::Ready(None)
            }
        })
        .await
        .inspect(|(i, _)| self.next_poll = (i + 1) % num.max(1))
    }

    fn on_event(&mut self, index: usize, event: Option<Event>) -> Delta {
        let tokenizer = Arc::clone(&self.state.tokenizer);
        let seq = &mut self.sequences[index];
        let mut delta = Delta::default();
        // Whether the engine itself ended the sequence (else a stop string did).
        let engine_done = !matches!(event, Some(Event::Started { .. } | Event::Token(_)));
        match event {
            Some(Event::Started { queued_secs }) => seq.queue_secs = Some(queued_secs),
            Some(Event::Token(sampled)) => {
                let now = Instant::now();
                seq.first_token.get_or_insert(now);
                seq.last_token = Some(now);
                seq.output.on_token(&tokenizer, sampled, &mut delta);
                if let Some(record) = &self.record {
                    record.completion_tokens.fetch_add(1, Ordering::Relaxed);
                }
            }
            Some(Event::Finished { reason, .. }) => {
                seq.output.on_finished(&tokenizer, reason, &mut delta);
            }
            Some(Event::Error(message)) => {
                delta.error = Some(message);
                delta.finish_reason = Some("error");
            }
            // The relay turns beams into tokens; a choice never sees them.
            Some(Event::Beams(_)) => {
                delta.error = Some("internal error: beams reached a choice unrelayed".into());
                delta.finish_reason = Some("error");
            }
            None => {
                delta.error = Some("the engine dropped the request".into());
                delta.finish_reason = Some("error");
            }
        }
        if let Some(reason) = delta.finish_reason {
            self.finish(index, reason, !engine_done);
        }
        delta
    }

    /// Marks a choice done and records its metrics; with `cancel`, also stops its sequence
    /// in the engine (a stop string or the client ended it before the engine did).
    fn finish(&mut self, index: usize, reason: &'static str, cancel: bool) {
        let seq = &mut self.sequences[index];
        if seq.done {
            return;
        }
        seq.done = true;
        if cancel {
            self.state.generator.cancel(seq.id);
        }
        let tpot_secs = match (seq.first_token, seq.last_token) {
            (Some(first), Some(last)) if seq.output.num_tokens > 1 => {
                Some((last - first).as_secs_f64() / (seq.output.num_tokens - 1) as f64)
            }
            _ => None,
        };
        self.state.metrics.record(&SequenceStats {
            finished_reason: reason,
            ttft_secs: seq.first_token.map(|t| (t - self.arrival).as_secs_f64()),
            tpot_secs,
            e2e_secs: self.arrival.elapsed().as_secs_f64(),
            queue_secs: seq.queue_secs,
            prompt_tokens: seq.prompt_tokens,
            generation_tokens: seq.output.num_tokens,
        });
    }
}

impl Drop for Run {
    fn drop(&mut self) {
        for index in 0..self.sequences.len() {
            self.finish(index, "abort", true);
        }
    }
}
