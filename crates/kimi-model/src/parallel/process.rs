//! The ranks of a model as processes (one per GPU), the way [`super::TensorParallel`] runs
//! them as threads: rank 0 is the [`CausalLm`] the engine sees; every call is encoded as a
//! [`RankJob`] and sent over the bootstrap's control link to every other process, which runs
//! it on its part ([`serve_worker`]) and answers done or the error's text. The tensors meet
//! in the collective (NCCL across processes); the links carry only the job and the answer.
//!
//! Failure ends the job: a step that fails anywhere aborts the collective (so no rank waits
//! for it), and the group refuses every later step with the first error, since an aborted
//! NCCL communicator cannot be used again. While rank 0 runs its own part it watches the
//! links, so a worker whose process dies aborts the step at once, named, instead of after
//! the collective's deadline.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use kimi_ops::bootstrap::rendezvous::{Link, BYE, MESSAGE};
use kimi_ops::offload::{OffloadCounts, Placement};
use kimi_ops::{Backend, Collective};

use super::control::{decode_reply, encode_reply, run_job, RankJob};
use super::ExpertPlacement;
use crate::cache::{CachePool, LayerSpec, SeqCache};
use crate::forward::{Batch, CausalLm, ForwardOptions, ForwardOutput};
use crate::{KimiLinear, ModelError, Result};

/// The least time rank 0 waits for a rank's answer to a placement job.
const PLACEMENT_REPLY_TIMEOUT: Duration = Duration::from_secs(3600);

fn failed(e: impl std::fmt::Display) -> ModelError {
    ModelError::Input(e.to_string())
}

/// Rank 0 of a model whose other ranks are processes reached through control links.
pub struct ProcessRanks<B: Backend> {
    lead: KimiLinear<B>,
    others: RankLinks<B>,
}

/// The other ranks of a [`ProcessRanks`]: their links, and the group's state.
struct RankLinks<B: Backend> {
    comm: Arc<dyn Collective<B>>,
    /// `links[r - 1]` reaches rank `r` (locked for a whole step: one step at a time).
    links: Mutex<Vec<Link>>,
    /// The first failure: the group is over.
    broken: Mutex<Option<String>>,
    /// How long rank 0 waits for a worker's answer once its own part is done.
    reply_timeout: Duration,
}

impl<B: Backend> ProcessRanks<B> {
    /// Rank 0's part joined to `comm` (rank 0 of its group), with a link to every other
    /// rank (from the rendezvous); `timeout` is the collective's deadline.
    pub fn new(
        mut lead: KimiLinear<B>,
        comm: Arc<dyn Collective<B>>,
        links: Vec<Link>,
        timeout: Duration,
    ) -> Result<Self> {
        let world = comm.world();
        let peers: Vec<usize> = links.iter().map(Link::peer).collect();
        if comm.rank() != 0 || peers != (1..world).collect::<Vec<_>>() {
            return Err(ModelError::Input(format!(
                "rank 0 of {world} needs links to ranks 1..{world}, has rank {} with {peers:?}",
                comm.rank()
            )));
        }
        lead.set_collective(Arc::clone(&comm))?;
        Ok(Self {
            lead,
            others: RankLinks {
                comm,
                links: Mutex::new(links),
                broken: Mutex::new(None),
                // Every live rank's step ends within the collective's deadline.
                reply_timeout: timeout.saturating_mul(2) + Duration::from_secs(10),
            },
        })
    }

    /// Rank 0's part.
    pub fn lead(&self) -> &KimiLinear<B> {
        &self.lead
    }

    fn on_all<R>(&self, job: RankJob, own: impl FnOnce() -> Result<R>) -> Result<R> {
        self.others.on_all(job, own)
    }
}

impl<B: Backend> RankLinks<B> {
    /// Ends the group with `why` (kept for every later call) and aborts the collective.
    fn end(&self, why: String) -> ModelError {
        self.comm.abort(&why);
        let mut b = self.broken.lock().unwrap_or_else(PoisonError::into_inner);
        let first = b.get_or_insert(why).clone();
        ModelError::Input(first)
    }

    /// Sends `job` to every worker, runs `own` here while watching the links, and collects
    /// the answers: the first failure is the answer, and ends the group unless the job was
    /// each rank's alone (a placement's: the ranks answer, and the group goes on).
    fn on_all<R>(&self, job: RankJob, own: impl FnOnce() -> Result<R>) -> Result<R> {
        let collective = job.meets_in_collectives();
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
        let mut links = self.links.lock().unwrap_or_else(PoisonError::into_inner);
        let msg = job.encode();
        for l in links.iter_mut() {
            if let Err(e) = l.send(MESSAGE, &msg) {
                return Err(self.end(e.to_string()));
            }
        }
        let done = AtomicBool::new(false);
        let comm: &dyn Collective<B> = self.comm.as_ref();
        let own = std::thread::scope(|s| {
            let watched: &[Link] = &links;
            s.spawn(|| watch(watched, &done, comm));
            let own = own();
            done.store(true, Ordering::Relaxed);
            own
        });
        if let (Err(e), true) = (&own, collective) {
            self.comm.abort(&format!("rank 0: {e}"));
        }
        // Reading experts from disk is bound by no collective's deadline: a placement's
        // jobs wait longer (a dead rank is still noticed at once by `watch`).
        let wait = match collective {
            true => self.reply_timeout,
            false => self.reply_timeout.max(PLACEMENT_REPLY_TIMEOUT),
        };
        let deadline = Instant::now() + wait;
        let (mut first_err, mut link_lost) = (None, false);
        for l in links.iter_mut() {
            let peer = l.peer();
            let answer = l
                .recv(Some(deadline), "running a step")
                .and_then(|(_, body)| decode_reply(&body));
            let err = match answer {
                Ok(Ok(())) => continue,
                Ok(Err(e)) => format!("rank {peer}: {e}"),
                Err(e) => {
                    link_lost = true;
                    e.to_string()
                }
            };
            first_err.get_or_insert(err);
        }
        // A job of each rank's alone fails without ending the group, unless a link is
        // lost (that is the end whatever the job).
        let goes_on = !collective && !link_lost;
        match (own, first_err) {
            (Ok(r), None) => Ok(r),
            (Ok(_), Some(e)) if goes_on => Err(ModelError::Input(e)),
            (Err(e), _) if goes_on => Err(ModelError::Input(format!("rank 0: {e}"))),
            (Ok(_), Some(e)) => Err(self.end(e)),
            (Err(e), _) => Err(self.end(format!("rank 0: {e}"))),
        }
    }
}

/// Until `done`, checks every link for a closed peer and aborts `comm` naming it.
fn watch<B: Backend>(links: &[Link], done: &AtomicBool, comm: &dyn Collective<B>) {
    let mut answered = vec![false; links.len()];
    while !done.load(Ordering::Relaxed) {
        for (i, l) in links.iter().enumerate() {
            if answered[i] {
                continue;
            }
            match l.peek_closed(Duration::from_millis(20)) {
                Some(true) => {
                    comm.abort(&format!(
                        "rank {}'s process ended (its control link closed)",
                        l.peer()
                    ));
                    return;
                }
                // Its answer is waiting: nothing more to watch on this link.
                Some(false) => answered[i] = true,
                None => {}
            }
        }
        if answered.iter().all(|&a| a) {
            return;
        }
    }
}

/// A worker process's loop: runs rank 0's jobs on `model` (its part, joined to `comm`)
/// until rank 0 says the job is over (`Ok`), answering each. A link that closes without
/// that is rank 0's process gone: an error.
pub fn serve_worker<B: Backend>(
    model: &mut KimiLinear<B>,
    comm: &dyn Collective<B>,
    mut link: Link,
) -> Result<()> {
    let mut pool: Option<CachePool<B>> = None;
    loop {
        let body = match link.recv(None, "waiting for rank 0's next step") {
            Ok((MESSAGE, body)) => body,
            Ok((BYE, _)) => return Ok(()),
            Ok((kind, _)) => return Err(failed(format!("rank 0 sent a frame of kind {kind}"))),
            Err(e) => {
                comm.abort(&e.to_string());
                return Err(failed(e));
            }
        };
        let (result, collective) = match RankJob::decode(&body) {
            Ok(job) => {
                let collective = job.meets_in_collectives();
                let result = run_job(model, &mut pool, job).map_err(|e| e.to_string());
                (result, collective)
            }
            Err(e) => (
                Err(e.to_string()),
                RankJob::encoded_meets_in_collectives(&body),
            ),
        };
        if let (Err(e), true) = (&result, collective) {
            comm.abort(e);
        }
        link.send(MESSAGE, &encode_reply(&result)).map_err(failed)?;
    }
}

impl<B: Backend> CausalLm<B> for ProcessRanks<B> {
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
        let job = RankJob::Forward {
            batch: batch.clone(),
            seqs: seqs.iter().map(|s| (**s).clone()).collect(),
            opts,
        };
        self.on_all(job, || self.lead.forward(batch, pool, seqs, opts))
    }

    fn new_pool(
        &self,
        num_blocks: usize,
        block_size: usize,
        num_slots: usize,
    ) -> Result<CachePool<B>> {
        let job = RankJob::Pool {
            num_blocks,
            block_size,
            num_slots,
        };
        self.on_all(job, || {
            self.lead.new_pool(num_blocks, block_size, num_slots)
        })
    }

    fn single_cache(&self, max_tokens: usize) -> Result<(CachePool<B>, SeqCache)> {
        self.on_all(RankJob::Single { max_tokens }, || {
            self.lead.single_cache(max_tokens)
        })
    }

    fn fork_state(
        &self,
        pool: &mut CachePool<B>,
        slots: (u32, u32),
        block: Option<(u32, u32)>,
    ) -> Result<()> {
        self.on_all(RankJob::Fork { slots, block }, || {
            pool.fork_state(self.lead.backend(), slots, block)
        })
    }

    fn expert_placement(&self) -> Vec<(usize, Placement)> {
        self.lead.expert_placement()
    }
    fn offload_counts(&self) -> Option<OffloadCounts> {
        self.lead.offload_counts()
    }
    fn expert_ranks(&self) -> Option<Arc<ExpertPlacement>> {
        self.lead.expert_ranks()
    }
    fn set_expert_ranks(&mut self, placement: Arc<ExpertPlacement>) -> Result<()> {
        let current = self.lead.expert_ranks();
        let layers = super::moe_layers(self.lead.config());
        let Self { lead, others } = self;
        super::move_experts(current, &placement, &layers, |job| {
            let commit = matches!(job, RankJob::CommitExperts);
            let done = others.on_all(job.clone(), || run_job(lead, &mut None, job));
            match (done, commit) {
                // Ranks that switched beside ranks that did not cannot run together.
                (Err(e), true) => Err(others.end(format!(
                    "the expert placement changed on some ranks only: {e}"
                ))),
                (done, _) => done,
            }
        })
    }
    fn failure(&self) -> Option<String> {
        self.others
            .broken
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }
}

impl<B: Backend> Drop for ProcessRanks<B> {
    fn drop(&mut self) {
        // The workers' loops end (`serve_worker` returns `Ok`).
        let links = self
            .others
            .links
            .get_mut()
            .unwrap_or_else(PoisonError::into_inner);
        for l in links.iter_mut() {
            let _ = l.send(BYE, &[]);
            l.close();
        }
    }
}
