//! The engine thread: receives commands, runs steps, sends [`Event`]s.
//!
//! ```text
//! loop:  commands (block only when idle) ─► drop requests whose receiver is gone
//!        ─► scheduler.schedule() ─► runner.execute(chunks) ─► sample, send events
//! ```
//!
//! Every request lives in two places: the [`Scheduler`] holds its tokens and capacity, and
//! [`Live`] here holds what only the engine needs (sampler, constraint, event channel).
//! [`EngineLoop::finish`] removes both together. Beam search requests run several
//! sequences each (`beams` module).

mod beams;
mod rebalance;

pub use rebalance::ExpertRebalance;
use rebalance::Rebalancer;

use std::collections::{BTreeSet, HashMap};
use std::ops::ControlFlow;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError, TryRecvError};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kimi_core::TokenId;
use kimi_model::{CausalLm, RowPicks};
use kimi_ops::Backend;
use tokio::sync::mpsc::UnboundedSender;

use crate::cache_manager::CacheManager;
use crate::runner::{panic_message, ModelRunner, Picks};
use crate::sampling::{Sampled, Sampler, SamplingParams};
use crate::scheduler::{Chunk, Scheduler, StepPlan};
use crate::serving::{EngineMetrics, Event, LogitsProcessor, Request, RequestId, ServingConfig};
use crate::FinishReason;
use beams::{BeamGroup, FIRST_FORK_ID};

/// What the handle tells the engine thread.
pub(crate) enum Command {
    /// A validated request.
    Submit(Box<Submission>),
    /// Cancel a request (unknown ids are ignored).
    Cancel(RequestId),
    /// Stop: `graceful` finishes every request first, else all are cancelled.
    Shutdown {
        /// Let requests finish.
        graceful: bool,
    },
}

/// A request on its way to the engine thread.
pub(crate) struct Submission {
    pub(crate) id: RequestId,
    pub(crate) request: Request,
    pub(crate) events: UnboundedSender<Event>,
    pub(crate) arrival: Instant,
}

/// State shared between the handles and the engine thread.
#[derive(Default)]
pub(crate) struct Shared {
    /// The latest metrics snapshot.
    pub(crate) metrics: Mutex<EngineMetrics>,
    /// Submissions sent but not yet received by the engine thread.
    pub(crate) num_in_flight: AtomicUsize,
    /// The scheduler's waiting queue length, as of the last update.
    pub(crate) num_waiting: AtomicUsize,
}

/// What only the engine loop keeps of a request.
struct Live {
    events: UnboundedSender<Event>,
    sampler: Sampler,
    params: SamplingParams,
    eos_ids: Vec<TokenId>,
    processor: Option<Box<dyn LogitsProcessor>>,
    arrival: Instant,
    /// Seconds in the queue, set when its first chunk is scheduled.
    queued_secs: Option<f64>,
    /// `Event::Started` was sent.
    started: bool,
    /// The beams of a beam search request.
    beam: Option<BeamGroup>,
}

/// How a request leaves the engine.
enum End {
    Finished(FinishReason),
    Error(String),
    /// The receiver is gone: nothing to send.
    Gone,
}

/// The step loop; runs on its own thread.
pub(crate) struct EngineLoop<B: Backend> {
    runner: ModelRunner<B>,
    scheduler: Scheduler,
    live: HashMap<RequestId, Live>,
    commands: Receiver<Command>,
    shared: Arc<Shared>,
    max_model_len: usize,
    /// Graceful shutdown: no new requests arrive; exit once idle.
    draining: bool,
    /// Counters since start (the queue fields are filled in when published).
    totals: EngineMetrics,
    /// The request of every forked beam.
    beam_owner: HashMap<RequestId, RequestId>,
    /// The id of the next forked beam.
    next_fork_id: u64,
    /// Moves routed experts between ranks as the counts say (`--enable-eplb`).
    rebalancer: Option<Rebalancer>,
}

impl<B: Backend> EngineLoop<B> {
    /// The loop over `model` with its cache pool allocated: `num_blocks` blocks of
    /// `block_size` tokens per MLA (or attention) layer and `max_num_seqs` KDA state slots,
    /// the same numbers the cache manager hands out.
    pub(crate) fn new(
        model: Box<dyn CausalLm<B>>,
        config: &ServingConfig,
        commands: Receiver<Command>,
        shared: Arc<Shared>,
    ) -> Result<Self, kimi_model::ModelError> {
        let pool = model.new_pool(config.num_blocks, config.block_size, config.max_num_seqs)?;
        let cache = CacheManager::new(config.num_blocks, config.block_size, config.max_num_seqs);
        let runner = ModelRunner::new(model, pool);
        let totals = EngineMetrics {
            cache_bytes: runner.cache_bytes(),
            expert_offload: runner.expert_offload(),
            ..EngineMetrics::default()
        };
        Ok(Self {
            runner,
            scheduler: Scheduler::new(config.max_num_seqs, config.max_num_batched_tokens, cache),
            live: HashMap::new(),
            commands,
            shared,
            max_model_len: config.max_model_len,
            draining: false,
            totals,
            beam_owner: HashMap::new(),
            next_fork_id: FIRST_FORK_ID,
            rebalancer: config.expert_rebalance.clone().map(Rebalancer::new),
        })
    }

    /// Runs until shut down (or, once every handle is gone, until the last request ends).
    pub(crate) fn run(mut self) {
        // The pool's size and the expert placement are known before the first request.
        self.publish_metrics();
        while self.receive_commands().is_continue() {
            if self.scheduler.is_idle() {
                if self.draining {
                    break;
                }
                continue;
            }
            self.step();
        }
        self.publish_metrics();
    }

    /// Handles pending commands, blocking for one when there is nothing to run. Breaks on
    /// an immediate shutdown.
    fn receive_commands(&mut self) -> ControlFlow<()> {
        if self.scheduler.is_idle() && !self.draining {
            match self.commands.recv() {
                Ok(command) => self.handle(command)?,
                Err(_) => self.draining = true,
            }
        }
        loop {
            match self.commands.try_recv() {
                Ok(command) => self.handle(command)?,
                Err(TryRecvError::Empty) => break,
                Err(TryRecvError::Disconnected) => {
                    self.draining = true;
                    break;
                }
            }
        }
        self.drop_abandoned();
        self.publish_metrics();
        ControlFlow::Continue(())
    }

    fn handle(&mut self, command: Command) -> ControlFlow<()> {
        match command {
            Command::Submit(submission) => self.add(*submission),
            Command::Cancel(id) => self.finish(id, End::Finished(FinishReason::Cancelled)),
            Command::Shutdown { graceful: true } => self.draining = true,
            Command::Shutdown { graceful: false } => {
                let ids: BTreeSet<RequestId> =
                    self.scheduler.ids().map(|id| self.owner(id)).collect();
                for id in ids {
                    self.finish(id, End::Finished(FinishReason::Cancelled));
                }
                return ControlFlow::Break(());
            }
        }
        ControlFlow::Continue(())
    }

    fn add(&mut self, submission: Submission) {
        self.shared.num_in_flight.fetch_sub(1, Ordering::Relaxed);
        let Submission {
            id,
            request,
            events,
            arrival,
        } = submission;
        let beam = request.params.beam.clone().map(|beam| {
            let prompt_len = request.prompt.len();
            let (params, eos) = (&request.params, &request.eos_ids);
            BeamGroup::new(id, params, beam, eos, prompt_len, self.max_model_len)
        });
        let width = request.params.beam.as_ref().map(|b| b.num_beams);
        let live = Live {
            events,
            sampler: Sampler::new(&request.params),
            params: request.params,
            eos_ids: request.eos_ids,
            processor: request.logits_processor,
            arrival,
            queued_secs: None,
            started: false,
            beam,
        };
        self.live.insert(id, live);
        match width {
            Some(width) => self.scheduler.add_beams(id, request.prompt, width),
            None => self.scheduler.add(id, request.prompt),
        }
    }

    /// Removes requests whose event receiver was dropped.
    fn drop_abandoned(&mut self) {
        let gone: Vec<RequestId> = self
            .live
            .iter()
            .filter(|(_, l)| l.events.is_closed())
            .map(|(&id, _)| id)
            .collect();
        for id in gone {
            self.finish(id, End::Gone);
        }
    }

    /// One step: schedule, one forward pass, sample and report.
    fn step(&mut self) {
        let plan = self.scheduler.schedule();
        for &id in &plan.preempted {
            self.runner.release(id);
        }
        self.publish_metrics();
        if plan.chunks.is_empty() {
            // Cannot happen with a validated config; wait instead of spinning if it does.
            self.wait_for_command(Duration::from_millis(10));
            return;
        }
        self.note_first_schedule(&plan);
        // When every sampling row is plain greedy, the backend picks the tokens where the
        // logits are and only token ids come back.
        let greedy = plan.chunks.iter().filter(|c| c.samples).all(|c| {
            self.live.get(&c.id).is_some_and(|l| {
                l.processor.is_none() && l.beam.is_none() && l.sampler.is_plain_greedy()
            })
        });
        let picks = if greedy {
            Picks::Greedy
        } else {
            self.device_picks(&plan.chunks)
                .map_or(Picks::Logits, Picks::Sample)
        };
        let returns_ids = !matches!(picks, Picks::Logits);
        let started = Instant::now();
        let result = self.runner.execute(&plan.chunks, picks);
        self.totals.steps_total += 1;
        self.totals.step_tokens_total += plan
            .chunks
            .iter()
            .map(|c| c.tokens.len() as u64)
            .sum::<u64>();
        self.totals.step_seconds_total += started.elapsed().as_secs_f64();
        match result {
            Ok(out) => {
                self.count_experts(&out.expert_counts);
                if returns_ids {
                    self.take_chosen(&plan.chunks, &out.token_ids);
                } else {
                    self.sample_rows(&plan.chunks, out.logits, out.vocab_size);
                }
                if let Some(r) = self.rebalancer.as_mut() {
                    r.note(&out.expert_counts);
                }
                self.rebalance_experts();
            }
            Err(message) => {
                for chunk in &plan.chunks {
                    self.finish(self.owner(chunk.id), End::Error(message.clone()));
                }
            }
        }
        self.publish_metrics();
    }

    /// Between two steps, once a window of counts is complete: moves the routed experts
    /// where a balanced placement is worth it (the sequences in flight wait for the move).
    fn rebalance_experts(&mut self) {
        let Some(r) = self.rebalancer.as_mut().filter(|r| r.due()) else {
            return;
        };
        let Some(current) = self.runner.expert_ranks() else {
            return;
        };
        let Some(look) = r.look(&current) else {
            return;
        };
        self.totals.expert_imbalance = Some(look.before);
        let Some(placement) = look.placement else {
            return;
        };
        let started = Instant::now();
        let moved = self.runner.set_expert_ranks(Arc::new(placement));
        if let Some(r) = self.rebalancer.as_mut() {
            r.moved(moved.is_ok());
        }
        match moved {
            Ok(()) => {
                self.totals.expert_rebalances_total += 1;
                self.totals.experts_moved_total += look.moves as u64;
                tracing::info!(
                    "moved {} routed experts between ranks in {:.2} s: imbalance {:.3} -> {:.3} \
                     (the largest rank's routed tokens over the mean, over the last {} steps)",
                    look.moves,
                    started.elapsed().as_secs_f64(),
                    look.before,
                    look.after,
                    look.steps
                );
            }
            Err(e) => match self.runner.model_failure() {
                Some(why) => tracing::error!("moving routed experts ended the model: {why}"),
                None => {
                    tracing::warn!("the routed experts could not all move (tried again later): {e}")
                }
            },
        }
    }

    fn wait_for_command(&mut self, timeout: Duration) {
        match self.commands.recv_timeout(timeout) {
            Ok(command) => {
                if self.handle(command).is_break() {
                    self.draining = true;
                }
            }
            Err(RecvTimeoutError::Timeout) => {}
            Err(RecvTimeoutError::Disconnected) => self.draining = true,
        }
    }

    fn note_first_schedule(&mut self, plan: &StepPlan) {
        for chunk in &plan.chunks {
            if let Some(live) = self.live.get_mut(&chunk.id) {
                live.queued_secs
                    .get_or_insert_with(|| live.arrival.elapsed().as_secs_f64());
            }
        }
    }

    fn count_experts(&mut self, counts: &[Vec<u32>]) {
        let totals = &mut self.totals.expert_counts;
        if totals.len() < counts.len() {
            totals.resize(counts.len(), Vec::new());
        }
        for (total, layer) in totals.iter_mut().zip(counts) {
            if total.len() < layer.len() {
                total.resize(layer.len(), 0);
            }
            for (t, &c) in total.iter_mut().zip(layer) {
                *t += u64::from(c);
            }
        }
    }

    /// Samples the next token of every chunk that asked for logits; `logits` holds their
    /// rows in chunk order.
    fn sample_rows(&mut self, chunks: &[Chunk], mut logits: Vec<f32>, vocab_size: usize) {
        let sampling = chunks.iter().filter(|c| c.samples);
        for (chunk, row) in sampling.zip(logits.chunks_exact_mut(vocab_size.max(1))) {
            if self.take_beam_row(chunk.id, row) {
                continue;
            }
            if let Err(end) = self.sample_one(chunk.id, Pick::Sample(row)) {
                self.finish(chunk.id, end);
            }
        }
        self.advance_beams();
    }

    /// The rules for the backend to sample every row of this step where the logits are,
    /// if it can: no row wants logprobs or has a constraint (those need the logits here).
    /// Takes one draw from each row's sampler.
    fn device_picks(&mut self, chunks: &[Chunk]) -> Option<RowPicks> {
        if !self.runner.samples_on_device() {
            return None;
        }
        let sampling = || chunks.iter().filter(|c| c.samples);
        let eligible = sampling().all(|c| {
            self.live.get(&c.id).is_some_and(|l| {
                l.processor.is_none() && l.beam.is_none() && !l.sampler.wants_logprob()
            })
        });
        if !eligible {
            return None;
        }
        let mut picks = RowPicks::default();
        for (row, chunk) in sampling().enumerate() {
            let live = self.live.get_mut(&chunk.id)?;
            let seq = self.scheduler.get(chunk.id)?;
            let (prompt, output) = seq.prompt_and_output();
            let rules =
                live.sampler
                    .device_row(prompt, output, row as u32, &mut picks.penalties)?;
            picks.rows.push(rules);
        }
        Some(picks)
    }

    /// Takes the backend's tokens (greedy or sampled there), one per chunk that samples,
    /// in chunk order.
    fn take_chosen(&mut self, chunks: &[Chunk], tokens: &[u32]) {
        let sampling = chunks.iter().filter(|c| c.samples);
        for (chunk, &token) in sampling.zip(tokens) {
            if let Err(end) = self.sample_one(chunk.id, Pick::Chosen(Sampled::greedy(token))) {
                self.finish(chunk.id, end);
            }
        }
    }

    /// Samples one token for `id` and sends it; `Err` says how the request ends.
    fn sample_one(&mut self, id: RequestId, pick: Pick<'_>) -> Result<(), End> {
        let (Some(live), Some(seq)) = (self.live.get_mut(&id), self.scheduler.get(id)) else {
            return Ok(());
        };
        if !live.started {
            live.started = true;
            self.totals.prompt_tokens_total += seq.num_prompt_tokens as u64;
            let queued_secs = live.queued_secs.unwrap_or(0.0);
            send(&live.events, Event::Started { queued_secs })?;
        }
        let (prompt, output) = seq.prompt_and_output();
        let sampled = match pick {
            Pick::Chosen(sampled) => sampled,
            Pick::Sample(logits) => {
                if let Some(processor) = live.processor.as_mut() {
                    guarded(|| processor.mask(logits))?;
                }
                live.sampler.sample(logits, prompt, output)
            }
        };
        let token = sampled.token;
        let is_stop = live.params.stop_token_ids.contains(&token)
            || (!live.params.ignore_eos && live.eos_ids.contains(&token));
        if is_stop {
            return Err(End::Finished(FinishReason::Stop));
        }
        let mut constraint_done = false;
        if let Some(processor) = live.processor.as_mut() {
            guarded(|| processor.accept(token))?.map_err(End::Error)?;
            constraint_done = guarded(|| processor.is_finished())?;
        }
        let num_output = output.len() + 1;
        let num_tokens = seq.tokens.len() + 1;
        self.scheduler.append_token(id, token);
        self.totals.generation_tokens_total += 1;
        send(&live.events, Event::Token(sampled))?;
        if constraint_done {
            Err(End::Finished(FinishReason::Stop))
        } else if num_output >= live.params.max_tokens || num_tokens >= self.max_model_len {
            Err(End::Finished(FinishReason::Length))
        } else {
            Ok(())
        }
    }

    /// Removes `id` everywhere, frees its capacity and sends its last event. Idempotent.
    fn finish(&mut self, id: RequestId, end: End) {
        let seq = self.scheduler.remove(id);
        self.runner.release(id);
        let Some(live) = self.live.remove(&id) else {
            return;
        };
        if let Some(beams) = &live.beam {
            self.remove_beams(id);
            if let End::Finished(reason) = end {
                for event in Self::beam_results(beams, reason) {
                    let _ = live.events.send(event);
                }
            } else if let End::Error(message) = end {
                let _ = live.events.send(Event::Error(message));
            }
            return;
        }
        let (prompt_tokens, completion_tokens) =
            seq.map_or((0, 0), |s| (s.num_prompt_tokens, s.num_output_tokens()));
        let event = match end {
            End::Finished(reason) => Event::Finished {
                reason,
                prompt_tokens,
                completion_tokens,
            },
            End::Error(message) => Event::Error(message),
            End::Gone => return,
        };
        let _ = live.events.send(event);
    }

    fn publish_metrics(&mut self) {
        let m = &mut self.totals;
        m.num_running = self.scheduler.num_running();
        m.num_waiting = self.scheduler.num_waiting();
        m.cache_usage = self.scheduler.cache_usage();
        m.num_preemptions_total = self.scheduler.num_preemptions();
        m.expert_offload = self.runner.expert_offload();
        m.model_failure = self.runner.model_failure();
        self.shared
            .num_waiting
            .store(m.num_waiting, Ordering::Relaxed);
        let mut shared = self
            .shared
            .metrics
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        shared.clone_from(m);
    }
}

/// How a row's token is chosen.
enum Pick<'a> {
    /// By the request's sampler, from its logits row (masked first by its processor).
    Sample(&'a mut [f32]),
    /// Already chosen (greedy, on the backend).
    Chosen(Sampled),
}

/// Sends an event; a closed receiver means the client left.
fn send(events: &UnboundedSender<Event>, event: Event) -> Result<(), End> {
    events.send(event).map_err(|_| End::Gone)
}

/// Runs caller-supplied constraint code; a panic ends the request with an error.
fn guarded<T>(f: impl FnOnce() -> T) -> Result<T, End> {
    catch_unwind(AssertUnwindSafe(f)).map_err(|p| {
        End::Error(format!(
            "the logits processor failed: {}",
            panic_message(&*p)
        ))
    })
}

#[cfg(test)]
mod tests {
    use std::path::Path;
    use std::sync::mpsc;

    use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};

    use super::*;

    fn fixture_model() -> kimi_model::KimiLinear<kimi_cpu::CpuBackend> {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../fixtures/kimi-linear/hub-bf16-released-like");
        let ckpt = kimi_weights::Checkpoint::open(&dir).expect("fixture opens");
        kimi_model::KimiLinear::load(kimi_cpu::CpuBackend::new(), &ckpt).expect("fixture loads")
    }

    /// Sends a request straight to the loop, skipping the handle's validation.
    fn submit(
        commands: &mpsc::Sender<Command>,
        shared: &Shared,
        id: u64,
        prompt: Vec<TokenId>,
    ) -> UnboundedReceiver<Event> {
        let (events, receiver) = unbounded_channel();
        let params = SamplingParams {
            max_tokens: 3,
            ..SamplingParams::default()
        };
        let request = Request {
            prompt,
            params,
            eos_ids: vec![],
            logits_processor: None,
        };
        let submission = Submission {
            id: RequestId(id),
            request,
            events,
            arrival: Instant::now(),
        };
        shared.num_in_flight.fetch_add(1, Ordering::Relaxed);
        commands
            .send(Command::Submit(Box::new(submission)))
            .expect("engine is running");
        receiver
    }

    fn events(mut receiver: UnboundedReceiver<Event>) -> Vec<Event> {
        let mut all = Vec::new();
        while let Some(event) = receiver.blocking_recv() {
            let last = matches!(event, Event::Finished { .. } | Event::Error(_));
            all.push(event);
            if last {
                break;
            }
        }
        all
    }

    #[test]
    fn a_model_error_fails_its_step_and_the_engine_goes_on() {
        let config = ServingConfig {
            max_model_len: 64,
            max_num_seqs: 4,
            max_num_batched_tokens: 64,
            block_size: 4,
            num_blocks: 16,
            max_waiting: 8,
            expert_rebalance: None,
        };
        let (commands, receiver) = mpsc::channel();
        let shared = Arc::new(Shared::default());
        let engine = EngineLoop::new(
            Box::new(fixture_model()),
            &config,
            receiver,
            Arc::clone(&shared),
        )
        .expect("the pool fits");
        let thread = std::thread::spawn(move || engine.run());

        // Token 100000 is outside the vocabulary: the forward pass fails.
        let bad = events(submit(&commands, &shared, 0, vec![1, 100_000]));
        assert!(
            matches!(&bad[..], [Event::Error(e)] if e.contains("100000")),
            "{bad:?}"
        );
        let good = events(submit(&commands, &shared, 1, vec![1, 2, 3]));
        assert!(matches!(good[0], Event::Started { .. }), "{good:?}");
        assert!(matches!(
            good.last(),
            Some(Event::Finished {
                reason: FinishReason::Length,
                prompt_tokens: 3,
                completion_tokens: 3
            })
        ));
        commands
            .send(Command::Shutdown { graceful: true })
            .expect("engine is running");
        thread.join().expect("the engine thread exits cleanly");
        let metrics = shared.metrics.lock().expect("not poisoned").clone();
        assert_eq!((metrics.num_running, metrics.cache_usage), (0, 0.0));
        assert!(metrics.cache_bytes > 0, "the pool is allocated up front");
        assert_eq!(metrics.generation_tokens_total, 3);
    }
}
