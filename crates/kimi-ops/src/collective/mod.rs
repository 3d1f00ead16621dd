//! Collectives between the ranks of a model split over several devices (tensor and expert
//! parallelism): every rank calls the same operations in the same order, each with its own
//! backend and its own part of the data.
//!
//! [`Collective`] is the interface the model calls; on GPUs it is NCCL's. [`ThreadGroup`]
//! implements it for ranks that are threads of one process, on any backend (through host
//! f32 copies), so that every parallel path runs in CI on the CPU backend. Its reductions
//! add the ranks' values in rank order on every rank, so all ranks hold the same bits.
//! [`ShmGroup`] does the same for ranks that are processes of one node (the CPU backend's
//! place of NCCL when `serve` starts one process per rank), through shared memory; both
//! combine the ranks' values with the same code ([`ops`]), so their results are equal.
//! Every wait has a deadline: a rank that fails or never arrives ends the others' calls
//! with an error naming the operation and the missing ranks, never a hang.

use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use crate::{Backend, Error, Result};

mod ops;
// Maps files shared between processes: the crate's only unsafe code.
#[allow(unsafe_code)]
mod shm;

pub use shm::{ShmComm, ShmGroup};

/// The collective operations of a group of ranks. Tensors are row-major `[rows, cols]`
/// (a vector counts as one row).
pub trait Collective<B: Backend>: Send + Sync {
    /// This rank, `0..world`.
    fn rank(&self) -> usize;
    /// Number of ranks.
    fn world(&self) -> usize;
    /// Every rank's `t` summed, into `t` on every rank (all ranks pass the same shape).
    fn all_reduce_sum(&self, be: &B, t: &mut B::Tensor) -> Result<()>;
    /// The ranks' `t` side by side, rank 0's columns first: `[rows, Σ cols]`.
    fn all_gather_cols(&self, be: &B, t: &B::Tensor) -> Result<B::Tensor>;
    /// The ranks' `t` stacked, rank 0's rows first: `[Σ rows, cols]`.
    fn all_gather_rows(&self, be: &B, t: &B::Tensor) -> Result<B::Tensor>;
    /// Every rank's `t` (`[rows, cols]`, rows a multiple of the world) summed, then this
    /// rank's share of the rows: `[rows / world, cols]`.
    fn reduce_scatter_rows(&self, be: &B, t: &B::Tensor) -> Result<B::Tensor>;
    /// `parts[j]` (any number of rows, the same columns everywhere) goes to rank `j`;
    /// returns what each rank sent to this one, by sender.
    fn all_to_all_rows(&self, be: &B, parts: &[B::Tensor]) -> Result<Vec<B::Tensor>>;
    /// Rank `root`'s `t`, into `t` on every rank.
    fn broadcast(&self, be: &B, t: &mut B::Tensor, root: usize) -> Result<()>;
    /// Ends every pending and later call of the group with `reason` (a rank that failed
    /// calls it, so the others stop waiting for it).
    fn abort(&self, reason: &str);
}

/// What rank 0 of a group of rank processes hands the others ([`Backend::new_process_group`]).
pub struct ProcessGroupId {
    /// The bytes every rank joins with (the rendezvous payload).
    pub bytes: Vec<u8>,
    /// What must live until rank 0 has joined (a shared-memory group's control file).
    pub keep: Option<Box<dyn std::any::Any + Send>>,
}

/// How long a rank waits for the others in one collective before it gives up, unless
/// [`ThreadGroup::with_timeout`] says otherwise.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(600);

/// How one rank's deposit meets the others' ([`ThreadGroup`]: a mutex of one process;
/// [`ShmGroup`]: shared memory between processes). [`ops`] combines the deposits.
trait Exchange {
    fn rank(&self) -> usize;
    fn world(&self) -> usize;
    /// Deposits `mine`, waits for every rank's deposit of the same operation, and returns
    /// `read` of all of them (in rank order).
    fn exchange<R>(&self, mine: Deposit, read: impl FnOnce(&[&Deposit]) -> Result<R>) -> Result<R>;
}

/// One rank's contribution to the operation in flight.
struct Deposit {
    op: &'static str,
    shape: [usize; 2],
    /// Row-major values; for `all_to_all_rows` every destination's rows one after another.
    values: Vec<f32>,
    /// `all_to_all_rows`: rows sent to each rank.
    rows_to: Vec<usize>,
}

/// What the ranks of a [`ThreadGroup`] share.
struct Board {
    /// Operations completed by the whole group.
    generation: u64,
    deposits: Vec<Option<Deposit>>,
    /// Ranks that have read the deposits of the operation in flight.
    taken: usize,
    failed: Option<String>,
}

/// The ranks of one process, each a thread, exchanging through shared memory.
pub struct ThreadGroup {
    world: usize,
    timeout: Duration,
    state: Mutex<Board>,
    changed: Condvar,
}

impl ThreadGroup {
    /// A group of `world` ranks; hand [`ThreadGroup::comm`] of each rank to its thread.
    pub fn new(world: usize) -> Arc<Self> {
        Self::with_timeout(world, DEFAULT_TIMEOUT)
    }

    /// [`ThreadGroup::new`] with another deadline per collective.
    pub fn with_timeout(world: usize, timeout: Duration) -> Arc<Self> {
        Arc::new(Self {
            world: world.max(1),
            timeout,
            state: Mutex::new(Board {
                generation: 0,
                deposits: (0..world.max(1)).map(|_| None).collect(),
                taken: 0,
                failed: None,
            }),
            changed: Condvar::new(),
        })
    }

    /// Clears a failure and any half-done operation, so the group can run again. Only
    /// while no rank is inside a collective (every rank has returned from the step that
    /// failed).
    pub fn reset(&self) {
        let mut st = self.lock();
        st.failed = None;
        st.deposits.iter_mut().for_each(|d| *d = None);
        st.taken = 0;
        st.generation += 1;
    }

    /// Rank `rank`'s handle.
    pub fn comm(self: &Arc<Self>, rank: usize) -> ThreadComm {
        ThreadComm {
            group: Arc::clone(self),
            rank,
        }
    }

    fn lock(&self) -> MutexGuard<'_, Board> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Waits on the condition until `done` holds, the group fails or the deadline passes.
    fn wait<'a>(
        &self,
        mut st: MutexGuard<'a, Board>,
        deadline: Instant,
        what: impl Fn(&Board) -> String,
        done: impl Fn(&Board) -> bool,
    ) -> Result<MutexGuard<'a, Board>> {
        loop {
            if let Some(reason) = &st.failed {
                return Err(Error::Device(format!("collective aborted: {reason}")));
            }
            if done(&st) {
                return Ok(st);
            }
            let now = Instant::now();
            if now >= deadline {
                let message = format!("{} within {:?}", what(&st), self.timeout);
                st.failed = Some(message.clone());
                self.changed.notify_all();
                return Err(Error::Device(format!("collective timed out: {message}")));
            }
            st = self
                .changed
                .wait_timeout(st, deadline - now)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
    }

    /// Deposits `mine` as rank `rank`, waits for every rank's deposit of the same
    /// operation, and returns `read` of all of them (in rank order).
    fn exchange<R>(
        &self,
        rank: usize,
        mine: Deposit,
        read: impl FnOnce(&[&Deposit]) -> Result<R>,
    ) -> Result<R> {
        let op = mine.op;
        let deadline = Instant::now() + self.timeout;
        let st = self.lock();
        // A rank still reading the previous operation holds its slot: wait for it.
        let mut st = self.wait(
            st,
            deadline,
            |_| format!("rank {rank}: the previous collective did not complete before {op}"),
            |s| s.deposits[rank].is_none(),
        )?;
        let generation = st.generation;
        st.deposits[rank] = Some(mine);
        self.changed.notify_all();
        let st = self.wait(
            st,
            deadline,
            |s| {
                let missing: Vec<String> = (0..self.world)
                    .filter(|&r| s.deposits[r].is_none())
                    .map(|r| r.to_string())
                    .collect();
                format!("{op}: rank(s) {} did not arrive", missing.join(", "))
            },
            |s| s.generation != generation || s.deposits.iter().all(Option::is_some),
        )?;
        let mut st = st;
        let deposits: Vec<&Deposit> = st.deposits.iter().flatten().collect();
        let result = match deposits.iter().find(|d| d.op != op) {
            Some(other) => Err(Error::Device(format!(
                "collective mismatch: rank {rank} called {op} while another rank called {}",
                other.op
            ))),
            None => read(&deposits),
        };
        st.taken += 1;
        if st.taken == self.world {
            st.deposits.iter_mut().for_each(|d| *d = None);
            st.taken = 0;
            st.generation += 1;
            self.changed.notify_all();
        }
        if let Err(e) = &result {
            st.failed.get_or_insert_with(|| e.to_string());
            self.changed.notify_all();
        }
        result
    }
}

/// One rank's handle on a [`ThreadGroup`].
#[derive(Clone)]
pub struct ThreadComm {
    group: Arc<ThreadGroup>,
    rank: usize,
}

impl Exchange for ThreadComm {
    fn rank(&self) -> usize {
        self.rank
    }
    fn world(&self) -> usize {
        self.group.world
    }
    fn exchange<R>(&self, mine: Deposit, read: impl FnOnce(&[&Deposit]) -> Result<R>) -> Result<R> {
        self.group.exchange(self.rank, mine, read)
    }
}

/// The [`Collective`] of an [`Exchange`]: [`ops`]' operations, and the type's `abort_group`.
macro_rules! collective_over_exchange {
    ($t:ty) => {
        impl<B: Backend> Collective<B> for $t {
            fn rank(&self) -> usize {
                Exchange::rank(self)
            }
            fn world(&self) -> usize {
                Exchange::world(self)
            }
            fn all_reduce_sum(&self, be: &B, t: &mut B::Tensor) -> Result<()> {
                ops::all_reduce_sum(self, be, t)
            }
            fn all_gather_cols(&self, be: &B, t: &B::Tensor) -> Result<B::Tensor> {
                ops::all_gather_cols(self, be, t)
            }
            fn all_gather_rows(&self, be: &B, t: &B::Tensor) -> Result<B::Tensor> {
                ops::all_gather_rows(self, be, t)
            }
            fn reduce_scatter_rows(&self, be: &B, t: &B::Tensor) -> Result<B::Tensor> {
                ops::reduce_scatter_rows(self, be, t)
            }
            fn all_to_all_rows(&self, be: &B, parts: &[B::Tensor]) -> Result<Vec<B::Tensor>> {
                ops::all_to_all_rows(self, be, parts)
            }
            fn broadcast(&self, be: &B, t: &mut B::Tensor, root: usize) -> Result<()> {
                ops::broadcast(self, be, t, root)
            }
            fn abort(&self, reason: &str) {
                self.abort_group(reason)
            }
        }
    };
}
collective_over_exchange!(ThreadComm);
collective_over_exchange!(ShmComm);

impl ThreadComm {
    /// Ends every pending and later collective of the group with `reason`.
    fn abort_group(&self, reason: &str) {
        let mut st = self.group.lock();
        st.failed
            .get_or_insert_with(|| format!("rank {}: {reason}", self.rank));
        self.group.changed.notify_all();
    }
}
