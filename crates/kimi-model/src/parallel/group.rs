//! The ranks of one process as threads behind one [`CausalLm`].
//!
//! Rank 0 runs on the caller's thread and owns the cache pool the caller holds; every
//! other rank is a thread that owns its model part and a pool of the same blocks and
//! slots. Each call is handed to every rank (the batch and the sequences' block tables
//! and slots, which are the same on every rank), the ranks meet in the collectives of the
//! pass, and rank 0's output is the answer. A rank that fails aborts the group, so the
//! others' collectives end at once with its reason instead of waiting.

use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;

use kimi_ops::offload::{OffloadCounts, Placement};
use kimi_ops::{Backend, Collective, ThreadGroup};

use super::control::{run_job, RankJob as Job};
use super::ExpertPlacement;
use crate::cache::{CachePool, LayerSpec, SeqCache};
use crate::forward::{Batch, CausalLm, ForwardOptions, ForwardOutput};
use crate::{KimiLinear, ModelError, Result};

struct Worker {
    jobs: Option<Sender<Job>>,
    done: Receiver<std::result::Result<(), String>>,
    thread: Option<JoinHandle<()>>,
}

/// A Kimi model split over ranks that are threads of this process ([`super`]).
pub struct TensorParallel<B: Backend> {
    lead: KimiLinear<B>,
    others: RankThreads,
}

/// Ranks 1.. of a [`TensorParallel`] and the group they meet in.
struct RankThreads {
    /// Locked for a whole step: one step at a time.
    workers: Mutex<Vec<Worker>>,
    group: Arc<ThreadGroup>,
    comm: kimi_ops::ThreadComm,
    /// Why the ranks can run no more (they disagree on where the experts are).
    broken: Mutex<Option<String>>,
}

impl<B> TensorParallel<B>
where
    B: Backend + Send + 'static,
    B::Tensor: Send + 'static,
{
    /// The ranks `parts[r]` (each loaded with `LoadOptions::shard` of rank `r` of
    /// `parts.len()`), joined by one [`ThreadGroup`] with `timeout` per collective.
    pub fn new(parts: Vec<KimiLinear<B>>, timeout: std::time::Duration) -> Result<Self> {
        let world = parts.len();
        let group = ThreadGroup::with_timeout(world, timeout);
        let mut parts = parts.into_iter().enumerate();
        let Some((_, mut lead)) = parts.next() else {
            return Err(ModelError::Input(
                "a tensor-parallel model of no ranks".into(),
            ));
        };
        lead.set_collective(Arc::new(group.comm(0)))?;
        let mut workers = Vec::with_capacity(world - 1);
        for (rank, mut part) in parts {
            part.set_collective(Arc::new(group.comm(rank)))?;
            let (jobs, inbox) = channel::<Job>();
            let (report, done) = channel();
            let comm = group.comm(rank);
            let thread = std::thread::Builder::new()
                .name(format!("kimi-rank-{rank}"))
                .spawn(move || serve_rank(part, comm, inbox, report))
                .map_err(|e| ModelError::Input(format!("cannot start rank {rank}: {e}")))?;
            workers.push(Worker {
                jobs: Some(jobs),
                done,
                thread: Some(thread),
            });
        }
        Ok(Self {
            lead,
            others: RankThreads {
                workers: Mutex::new(workers),
                comm: group.comm(0),
                group,
                broken: Mutex::new(None),
            },
        })
    }

    /// Rank 0's part.
    pub fn lead(&self) -> &KimiLinear<B> {
        &self.lead
    }

    fn on_all<R>(&self, job: impl Fn() -> Job, own: impl FnOnce() -> Result<R>) -> Result<R> {
        self.others.on_all::<B, R>(job, own)
    }
}

impl RankThreads {
    /// Hands `job()` to every other rank, runs `own` here, and waits for all: the first
    /// failure is the answer (and, for a job whose ranks meet in collectives, aborts the
    /// group so that no rank waits for it).
    fn on_all<B: Backend, R>(
        &self,
        job: impl Fn() -> Job,
        own: impl FnOnce() -> Result<R>,
    ) -> Result<R> {
        if let Some(why) = self
            .broken
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
        {
            return Err(ModelError::Input(format!(
                "the ranks stopped after an earlier failure ({why}); restart the job"
            )));
        }
        let collective = job().meets_in_collectives();
        let workers = self.workers.lock().unwrap_or_else(PoisonError::into_inner);
        for (i, w) in workers.iter().enumerate() {
            let sent = w.jobs.as_ref().is_some_and(|j| j.send(job()).is_ok());
            if !sent {
                Collective::<B>::abort(&self.comm, "a rank thread has ended");
                return Err(ModelError::Input(format!("rank {} has ended", i + 1)));
            }
        }
        let own = own();
        if let (Err(e), true) = (&own, collective) {
            Collective::<B>::abort(&self.comm, &e.to_string());
        }
        let mut first_err = None;
        for (i, w) in workers.iter().enumerate() {
            let result = w
                .done
                .recv()
                .unwrap_or_else(|_| Err("the rank thread has ended".into()));
            if let Err(e) = result {
                first_err.get_or_insert_with(|| format!("rank {}: {e}", i + 1));
            }
        }
        if collective && (own.is_err() || first_err.is_some()) {
            // Every rank has returned: the group may run the next step.
            self.group.reset();
        }
        match (own, first_err) {
            (Ok(_), Some(e)) => Err(ModelError::Input(e)),
            (own, _) => own,
        }
    }
}

/// A rank thread: runs jobs on its part until the lead goes.
fn serve_rank<B: Backend>(
    mut model: KimiLinear<B>,
    comm: kimi_ops::ThreadComm,
    inbox: Receiver<Job>,
    report: Sender<std::result::Result<(), String>>,
) {
    let mut pool: Option<CachePool<B>> = None;
    while let Ok(job) = inbox.recv() {
        let collective = job.meets_in_collectives();
        let result = run_job(&mut model, &mut pool, job);
        let result = result.map_err(|e| {
            let e = e.to_string();
            if collective {
                Collective::<B>::abort(&comm, &e);
            }
            e
        });
        if report.send(result).is_err() {
            break;
        }
    }
}

impl<B: Backend> Drop for TensorParallel<B> {
    fn drop(&mut self) {
        let workers = self
            .others
            .workers
            .get_mut()
            .unwrap_or_else(PoisonError::into_inner);
        for w in workers {
            // Closing the channel ends the thread's loop.
            drop(w.jobs.take());
            if let Some(t) = w.thread.take() {
                let _ = t.join();
            }
        }
    }
}

impl<B> CausalLm<B> for TensorParallel<B>
where
    B: Backend + Send + 'static,
    B::Tensor: Send + 'static,
{
    fn backend(&self) -> &B {
        self.lead.backend()
    }
    fn vocab_size(&self) -> usize {
        CausalLm::vocab_size(&self.lead)
    }
    fn max_context(&self) -> usize {
        CausalLm::max_context(&self.lead)
    }
    fn eos_token_ids(&self) -> &[u32] {
        CausalLm::eos_token_ids(&self.lead)
    }
    fn cache_specs(&self) -> &[LayerSpec] {
        CausalLm::cache_specs(&self.lead)
    }

    fn forward(
        &self,
        batch: &Batch,
        pool: &mut CachePool<B>,
        seqs: &mut [&mut SeqCache],
        opts: ForwardOptions,
    ) -> Result<ForwardOutput> {
        let shared: Vec<SeqCache> = seqs.iter().map(|s| (**s).clone()).collect();
        self.on_all(
            || Job::Forward {
                batch: batch.clone(),
                seqs: shared.clone(),
                opts,
            },
            || self.lead.forward(batch, pool, seqs, opts),
        )
    }

    fn new_pool(
        &self,
        num_blocks: usize,
        block_size: usize,
        num_slots: usize,
    ) -> Result<CachePool<B>> {
        self.on_all(
            || Job::Pool {
                num_blocks,
                block_size,
                num_slots,
            },
            || self.lead.new_pool(num_blocks, block_size, num_slots),
        )
    }

    fn single_cache(&self, max_tokens: usize) -> Result<(CachePool<B>, SeqCache)> {
        self.on_all(
            || Job::Single { max_tokens },
            || self.lead.single_cache(max_tokens),
        )
    }

    fn fork_state(
        &self,
        pool: &mut CachePool<B>,
        slots: (u32, u32),
        block: Option<(u32, u32)>,
    ) -> Result<()> {
        self.on_all(
            || Job::Fork { slots, block },
            || pool.fork_state(self.lead.backend(), slots, block),
        )
    }

    fn expert_placement(&self) -> Vec<(usize, Placement)> {
        self.lead.expert_placement()
    }
    fn expert_ranks(&self) -> Option<Arc<ExpertPlacement>> {
        self.lead.expert_ranks()
    }
    fn set_expert_ranks(&mut self, placement: Arc<ExpertPlacement>) -> Result<()> {
        let current = self.lead.expert_ranks();
        let layers = super::moe_layers(self.lead.config());
        let Self { lead, others } = self;
        super::move_experts(current, &placement, &layers, |job| {
            let commit = matches!(job, Job::CommitExperts);
            let done =
                others.on_all::<B, ()>(|| job.clone(), || run_job(lead, &mut None, job.clone()));
            if let (Err(e), true) = (&done, commit) {
                // Ranks that switched beside ranks that did not cannot run together.
                let why = format!("the expert placement changed on some ranks only: {e}");
                *others.broken.lock().unwrap_or_else(PoisonError::into_inner) = Some(why);
            }
            done
        })
    }
    fn failure(&self) -> Option<String> {
        self.others
            .broken
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }
    fn offload_counts(&self) -> Option<OffloadCounts> {
        self.lead.offload_counts()
    }
}
