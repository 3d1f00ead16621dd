//! The serving engine: many concurrent requests, continuously batched.
//!
//! CONTRACT between the engine loop and the HTTP server (kimi-server). The types and
//! signatures below are fixed; the loop behind them lives in `engine_loop.rs` (the thread),
//! `scheduler.rs` (queues, budget, preemption), `cache_manager.rs` (blocks and slots) and
//! `runner.rs` (the model and its caches).
//!
//! A dedicated thread owns the model and runs `step()` repeatedly: schedule (decode first,
//! then chunked prefill within `max_num_batched_tokens`), one batched forward pass over
//! every scheduled sequence, sample, and send [`Event`]s to each request's channel.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{self, Sender};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::Instant;

use kimi_core::TokenId;
use kimi_model::CausalLm;
use kimi_ops::Backend;
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};

use crate::beam::{BeamOutput, BeamParams};
use crate::engine_loop::{Command, EngineLoop, Shared, Submission};
use crate::sampling::{Sampled, SamplingParams};
use crate::{EngineError, FinishReason};

/// Engine-wide limits (validated `serve` flags).
#[derive(Clone, Debug)]
pub struct ServingConfig {
    /// Longest prompt + output a request may have (`--max-model-len`).
    pub max_model_len: usize,
    /// Sequences running at once (`--max-num-seqs`).
    pub max_num_seqs: usize,
    /// Tokens per forward pass (`--max-num-batched-tokens`); prefills are chunked to fit.
    pub max_num_batched_tokens: usize,
    /// Tokens per cache block.
    pub block_size: usize,
    /// Cache blocks per MLA (or attention) layer, allocated when the engine starts; they
    /// bound admission and preemption.
    pub num_blocks: usize,
    /// Requests allowed to wait; more are refused with [`SubmitError::QueueFull`].
    pub max_waiting: usize,
    /// Moving routed experts between ranks as the routing counts say (`--enable-eplb`),
    /// for a model split by whole experts; `None`: they stay where they were loaded.
    pub expert_rebalance: Option<crate::ExpertRebalance>,
}

/// Constrains decoding (tool calls, JSON schemas): masks logits before sampling and
/// advances on each accepted token.
pub trait LogitsProcessor: Send {
    /// Sets disallowed tokens' logits to `-inf`.
    fn mask(&mut self, logits: &mut [f32]);
    /// Records the sampled token. An error ends the request with that error.
    fn accept(&mut self, token: TokenId) -> Result<(), String>;
    /// True once the constraint is complete and generation must stop.
    fn is_finished(&self) -> bool;
}

/// One generation request.
pub struct Request {
    /// Prompt token ids.
    pub prompt: Vec<TokenId>,
    /// Sampling parameters (already validated by the caller, validated again here).
    pub params: SamplingParams,
    /// End-of-sequence ids (tokenizer's and config's).
    pub eos_ids: Vec<TokenId>,
    /// Optional constraint on the output.
    pub logits_processor: Option<Box<dyn LogitsProcessor>>,
}

/// Identifies a submitted request.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RequestId(pub u64);

/// What the engine reports about a request, in order: `Started` once, `Token`s, then
/// exactly one `Finished` or `Error`. A beam search request sends no `Token`s: its beams
/// come in one `Beams` just before `Finished`.
#[derive(Clone, Debug)]
pub enum Event {
    /// Prefill finished; `queued_secs` is the wait before it was scheduled.
    Started {
        /// Seconds in the waiting queue.
        queued_secs: f64,
    },
    /// A new output token.
    Token(Sampled),
    /// The best beams of a beam search, best first.
    Beams(Vec<BeamOutput>),
    /// Generation ended normally.
    Finished {
        /// Why.
        reason: FinishReason,
        /// Prompt tokens.
        prompt_tokens: usize,
        /// Output tokens.
        completion_tokens: usize,
    },
    /// The request failed (it is removed and its capacity freed).
    Error(String),
}

/// Why a request was not accepted.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SubmitError {
    /// The request is invalid (empty or over-long prompt, bad sampling values, bad token ids).
    #[error("{0}")]
    Invalid(String),
    /// Too many requests are waiting.
    #[error("the server is overloaded: {0} requests are waiting")]
    QueueFull(usize),
    /// The engine is shutting down.
    #[error("the engine is shutting down")]
    ShuttingDown,
}

/// A point-in-time view for `/metrics`.
#[derive(Clone, Debug, Default)]
pub struct EngineMetrics {
    /// Sequences in the running set.
    pub num_running: usize,
    /// Requests waiting for admission.
    pub num_waiting: usize,
    /// Fraction of cache blocks in use, 0..1.
    pub cache_usage: f64,
    /// Bytes of the pre-allocated cache pool (every layer's blocks and state slots).
    pub cache_bytes: usize,
    /// Prompt tokens processed since start.
    pub prompt_tokens_total: u64,
    /// Output tokens generated since start.
    pub generation_tokens_total: u64,
    /// Preemptions since start.
    pub num_preemptions_total: u64,
    /// Forward passes (engine steps) since start.
    pub steps_total: u64,
    /// Tokens fed to those passes (prompt chunks and decode tokens).
    pub step_tokens_total: u64,
    /// Seconds spent in those passes (scheduling excluded), for telling idle time from work.
    pub step_seconds_total: f64,
    /// For each layer, how many times each expert was chosen since start (empty for dense layers).
    pub expert_counts: Vec<Vec<u64>>,
    /// Where the routed experts are and what their tiers did since start, when some live
    /// off the device (`--cpu-offload-gb`); `None` when every expert is resident.
    pub expert_offload: Option<ExpertOffloadMetrics>,
    /// Why the model can run no more steps (a rank process of a split model died): every
    /// request fails from then on, and a server should end.
    pub model_failure: Option<String>,
    /// Under expert parallelism with rebalancing: the largest rank's routed tokens over
    /// the mean (averaged over the MoE layers) in the last window of steps, for the
    /// placement in use then.
    pub expert_imbalance: Option<f64>,
    /// Times the routed experts moved between ranks.
    pub expert_rebalances_total: u64,
    /// Routed experts moved between ranks, summed over those times.
    pub experts_moved_total: u64,
}

/// The expert tiers of a model whose routed experts do not all live on the device.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct ExpertOffloadMetrics {
    /// Where the experts are, summed over the MoE layers.
    pub placement: kimi_model::Placement,
    /// Hits, fills, cold pairs and bytes moved since start, summed over the MoE layers.
    pub counts: kimi_model::OffloadCounts,
}

/// Why a [`ServingConfig`] cannot run `model`, if it cannot.
fn check_config(config: &ServingConfig, max_context: usize) -> Result<(), String> {
    let positive = [
        ("max_model_len", config.max_model_len),
        ("max_num_seqs", config.max_num_seqs),
        ("max_num_batched_tokens", config.max_num_batched_tokens),
        ("block_size", config.block_size),
        ("num_blocks", config.num_blocks),
        ("max_waiting", config.max_waiting),
    ];
    if let Some((name, _)) = positive.iter().find(|(_, v)| *v == 0) {
        return Err(format!("{name} must be at least 1"));
    }
    if config.max_model_len > max_context {
        return Err(format!(
            "max_model_len {} is longer than the model's context of {max_context} tokens",
            config.max_model_len
        ));
    }
    if config.max_num_batched_tokens < config.max_num_seqs {
        return Err(format!(
            "max_num_batched_tokens ({}) must be at least max_num_seqs ({}), so that every \
             running sequence can decode in each step",
            config.max_num_batched_tokens, config.max_num_seqs
        ));
    }
    let capacity = config.num_blocks.saturating_mul(config.block_size);
    if capacity < config.max_model_len {
        return Err(format!(
            "the cache holds {capacity} tokens (num_blocks {} x block_size {}), fewer than \
             max_model_len {}; one sequence of full length could never run",
            config.num_blocks, config.block_size, config.max_model_len
        ));
    }
    Ok(())
}

/// The handle's side of the engine thread.
struct Inner {
    control: Mutex<Control>,
    thread: Mutex<Option<JoinHandle<()>>>,
    shared: Arc<Shared>,
    next_id: AtomicU64,
    vocab_size: usize,
    max_model_len: usize,
    max_waiting: usize,
    /// Cache limits a beam search must fit in.
    max_num_seqs: usize,
    block_size: usize,
    num_blocks: usize,
}

struct Control {
    commands: Sender<Command>,
    /// False once shutdown began; checked under the same lock as sending, so no request
    /// reaches the engine after its `Shutdown`.
    accepting: bool,
}

/// A handle to the serving engine: a thread that owns the model and batches every request
/// submitted through any clone of the handle.
///
/// When the last clone is dropped without [`EngineHandle::shutdown`], the engine finishes
/// the requests it has and its thread exits on its own.
///
/// ```no_run
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// use kimi_engine::sampling::SamplingParams;
/// use kimi_engine::{EngineHandle, Event, Request, ServingConfig};
///
/// let ckpt = kimi_weights::Checkpoint::open("model-dir".as_ref())?;
/// let model = kimi_model::KimiLinear::load(kimi_cpu::CpuBackend::new(), &ckpt)?;
/// let config = ServingConfig {
///     max_model_len: 4096,
///     max_num_seqs: 16,
///     max_num_batched_tokens: 2048,
///     block_size: 16,
///     num_blocks: 1024,
///     max_waiting: 256,
///     expert_rebalance: None,
/// };
/// let engine = EngineHandle::spawn(model, config)?;
/// let request = Request {
///     prompt: vec![1, 2, 3],
///     params: SamplingParams::default(),
///     eos_ids: vec![2],
///     logits_processor: None,
/// };
/// let (_id, mut events) = engine.submit(request)?;
/// while let Some(event) = events.blocking_recv() {
///     match event {
///         Event::Token(t) => println!("{}", t.token),
///         Event::Finished { .. } | Event::Error(_) => break,
///         Event::Started { .. } | Event::Beams(_) => {}
///     }
/// }
/// engine.shutdown(true);
/// # Ok(())
/// # }
/// ```
#[derive(Clone)]
pub struct EngineHandle {
    inner: Arc<Inner>,
}

impl EngineHandle {
    /// Moves the model to a dedicated engine thread and starts the step loop.
    ///
    /// # Errors
    ///
    /// [`EngineError::Request`] when `config` has a zero limit, a `max_model_len` over the
    /// model's context, fewer batched tokens than sequences, or fewer cache blocks than one
    /// `max_model_len` sequence needs; or when the cache pool cannot be allocated or the
    /// thread cannot be started.
    pub fn spawn<B: Backend + 'static>(
        model: impl CausalLm<B> + 'static,
        config: ServingConfig,
    ) -> Result<Self, EngineError> {
        check_config(&config, model.max_context())
            .map_err(|e| EngineError::Request(format!("invalid serving configuration: {e}")))?;
        let vocab_size = model.vocab_size();
        let model: Box<dyn CausalLm<B>> = Box::new(model);
        let (commands, receiver) = mpsc::channel();
        let shared = Arc::new(Shared::default());
        let engine = EngineLoop::new(model, &config, receiver, Arc::clone(&shared))
            .map_err(|e| EngineError::Request(format!("cannot allocate the cache pool: {e}")))?;
        let thread = std::thread::Builder::new()
            .name("kimi-engine".into())
            .spawn(move || engine.run())
            .map_err(|e| EngineError::Request(format!("cannot start the engine thread: {e}")))?;
        Ok(Self {
            inner: Arc::new(Inner {
                control: Mutex::new(Control {
                    commands,
                    accepting: true,
                }),
                thread: Mutex::new(Some(thread)),
                shared,
                next_id: AtomicU64::new(0),
                vocab_size,
                max_model_len: config.max_model_len,
                max_waiting: config.max_waiting,
                max_num_seqs: config.max_num_seqs,
                block_size: config.block_size,
                num_blocks: config.num_blocks,
            }),
        })
    }

    /// Queues a request; events arrive on the receiver. Dropping the receiver cancels it.
    ///
    /// # Errors
    ///
    /// [`SubmitError::Invalid`] for an empty prompt, a prompt of `max_model_len` tokens or
    /// more, a token id outside the vocabulary or invalid sampling parameters;
    /// [`SubmitError::QueueFull`] when `max_waiting` requests wait already;
    /// [`SubmitError::ShuttingDown`] once [`EngineHandle::shutdown`] was called.
    pub fn submit(
        &self,
        request: Request,
    ) -> Result<(RequestId, UnboundedReceiver<Event>), SubmitError> {
        self.check_request(&request).map_err(SubmitError::Invalid)?;
        let control = lock(&self.inner.control);
        if !control.accepting {
            return Err(SubmitError::ShuttingDown);
        }
        let shared = &self.inner.shared;
        let num_waiting = shared.num_in_flight.load(Ordering::Relaxed)
            + shared.num_waiting.load(Ordering::Relaxed);
        if num_waiting >= self.inner.max_waiting {
            return Err(SubmitError::QueueFull(num_waiting));
        }
        let id = RequestId(self.inner.next_id.fetch_add(1, Ordering::Relaxed));
        let (events, receiver) = unbounded_channel();
        let submission = Submission {
            id,
            request,
            events,
            arrival: Instant::now(),
        };
        shared.num_in_flight.fetch_add(1, Ordering::Relaxed);
        if control
            .commands
            .send(Command::Submit(Box::new(submission)))
            .is_err()
        {
            shared.num_in_flight.fetch_sub(1, Ordering::Relaxed);
            return Err(SubmitError::ShuttingDown);
        }
        Ok((id, receiver))
    }

    /// Why `request` cannot be served, in words for the client.
    fn check_request(&self, request: &Request) -> Result<(), String> {
        let (vocab, max_len) = (self.inner.vocab_size, self.inner.max_model_len);
        let n = request.prompt.len();
        if n == 0 {
            return Err("the prompt has no tokens".into());
        }
        if n >= max_len {
            return Err(format!(
                "the prompt has {n} tokens, but this server's context is {max_len} tokens for \
                 the prompt and the output together; shorten the prompt"
            ));
        }
        if let Some((i, id)) = request
            .prompt
            .iter()
            .enumerate()
            .find(|(_, &id)| id as usize >= vocab)
        {
            return Err(format!(
                "prompt token {i} has id {id}, which is not in the vocabulary (ids 0..{vocab})"
            ));
        }
        request.params.validate(vocab).map_err(|e| e.to_string())?;
        match &request.params.beam {
            Some(beam) => self.check_beams(beam, request),
            None => Ok(()),
        }
    }

    /// Why the cache cannot hold this beam search, if it cannot: every beam is a running
    /// sequence, and beams share the prompt's full blocks but, in the worst case, nothing
    /// after them.
    fn check_beams(&self, beam: &BeamParams, request: &Request) -> Result<(), String> {
        let inner = &self.inner;
        if request.logits_processor.is_some() {
            return Err(
                "beam search cannot be combined with constrained decoding or logit biases \
                 (tools, response_format, logit_bias)"
                    .into(),
            );
        }
        if beam.num_beams > inner.max_num_seqs {
            return Err(format!(
                "beam search with {} beams needs as many running sequences, but this server \
                 runs at most {} (--max-num-seqs)",
                beam.num_beams, inner.max_num_seqs
            ));
        }
        let prompt = request.prompt.len();
        let output = request.params.max_tokens.min(inner.max_model_len - prompt);
        let bs = inner.block_size.max(1);
        let per_beam = (prompt % bs + output).div_ceil(bs);
        let needed = (prompt / bs).saturating_add(beam.num_beams.saturating_mul(per_beam));
        if needed > inner.num_blocks {
            return Err(format!(
                "beam search with {} beams of up to {output} tokens after a {prompt}-token \
                 prompt may need {needed} cache blocks of {bs} tokens, more than the {} this \
                 server has; lower max_tokens or the number of beams",
                beam.num_beams, inner.num_blocks
            ));
        }
        Ok(())
    }

    /// Cancels a request (idempotent); its capacity is freed before the next step. Its
    /// receiver gets `Event::Finished` with [`FinishReason::Cancelled`] unless it already ended.
    pub fn cancel(&self, id: RequestId) {
        let _ = lock(&self.inner.control).commands.send(Command::Cancel(id));
    }

    /// The latest metrics snapshot (updated at least once per step).
    pub fn metrics(&self) -> EngineMetrics {
        lock(&self.inner.shared.metrics).clone()
    }

    /// Vocabulary size of the model.
    pub fn vocab_size(&self) -> usize {
        self.inner.vocab_size
    }

    /// Longest prompt + output a request may have.
    pub fn max_model_len(&self) -> usize {
        self.inner.max_model_len
    }

    /// Stops accepting requests; `graceful` lets running ones finish, else cancels them.
    /// Returns once the engine thread has exited. Later calls return at once.
    pub fn shutdown(&self, graceful: bool) {
        {
            let mut control = lock(&self.inner.control);
            if control.accepting {
                control.accepting = false;
                let _ = control.commands.send(Command::Shutdown { graceful });
            }
        }
        let mut thread = lock(&self.inner.thread);
        if let Some(thread) = thread.take() {
            // The loop never panics on requests; a panic would already have been reported.
            let _ = thread.join();
        }
    }
}

impl std::fmt::Debug for EngineHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EngineHandle")
            .field("vocab_size", &self.inner.vocab_size)
            .field("max_model_len", &self.inner.max_model_len)
            .finish_non_exhaustive()
    }
}

/// Locks a mutex, ignoring poisoning: every value behind these locks stays consistent.
fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|e| e.into_inner())
}
