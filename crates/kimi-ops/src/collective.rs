//! Collectives between the ranks of a model split over several devices (tensor and expert
//! parallelism): every rank calls the same operations in the same order, each with its own
//! backend and its own part of the data.
//!
//! [`Collective`] is the interface the model calls; on GPUs it is NCCL's. [`ThreadGroup`]
//! implements it for ranks that are threads of one process, on any backend (through host
//! f32 copies), so that every parallel path runs in CI on the CPU backend. Its reductions
//! add the ranks' values in rank order on every rank, so all ranks hold the same bits.
//! Every wait has a deadline: a rank that fails or never arrives ends the others' calls
//! with an error naming the operation and the missing ranks, never a hang.

use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use crate::{Backend, Error, Result};

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

/// How long a rank waits for the others in one collective before it gives up, unless
/// [`ThreadGroup::with_timeout`] says otherwise.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(600);

/// One rank's contribution to the operation in flight.
struct Deposit {
    op: &'static str,
    shape: [usize; 2],
    /// Row-major values; for `all_to_all_rows` every destination's rows one after another.
    values: Vec<f32>,
    /// `all_to_all_rows`: rows sent to each rank.
    rows_to: Vec<usize>,
}

struct Exchange {
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
    state: Mutex<Exchange>,
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
            state: Mutex::new(Exchange {
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

    fn lock(&self) -> MutexGuard<'_, Exchange> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Waits on the condition until `done` holds, the group fails or the deadline passes.
    fn wait<'a>(
        &self,
        mut st: MutexGuard<'a, Exchange>,
        deadline: Instant,
        what: impl Fn(&Exchange) -> String,
        done: impl Fn(&Exchange) -> bool,
    ) -> Result<MutexGuard<'a, Exchange>> {
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

/// `[rows, cols]` of a tensor shape (a vector is one row; leading dims fold into rows).
fn rows_cols(shape: &[usize]) -> [usize; 2] {
    match shape {
        [] => [1, 1],
        [n] => [1, *n],
        [.., c] => [shape[..shape.len() - 1].iter().product(), *c],
    }
}

fn same_shapes(op: &str, deposits: &[&Deposit]) -> Result<[usize; 2]> {
    let shape = deposits[0].shape;
    match deposits.iter().position(|d| d.shape != shape) {
        Some(r) => Err(Error::Shape {
            op: "collective",
            detail: format!(
                "{op}: rank 0 passed {:?} but rank {r} passed {:?}",
                shape, deposits[r].shape
            ),
        }),
        None => Ok(shape),
    }
}

impl ThreadComm {
    fn deposit<B: Backend>(&self, be: &B, op: &'static str, t: &B::Tensor) -> Result<Deposit> {
        Ok(Deposit {
            op,
            shape: rows_cols(be.shape(t)),
            values: be.to_f32(t)?,
            rows_to: Vec::new(),
        })
    }
}

impl<B: Backend> Collective<B> for ThreadComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world(&self) -> usize {
        self.group.world
    }

    fn all_reduce_sum(&self, be: &B, t: &mut B::Tensor) -> Result<()> {
        const OP: &str = "all_reduce_sum";
        let shape = be.shape(t).to_vec();
        let mine = self.deposit(be, OP, t)?;
        let sum = self.group.exchange(self.rank, mine, |all| {
            same_shapes(OP, all)?;
            let mut sum = all[0].values.clone();
            for d in &all[1..] {
                for (s, v) in sum.iter_mut().zip(&d.values) {
                    *s += v;
                }
            }
            Ok(sum)
        })?;
        *t = be.upload_f32(&shape, &sum)?;
        Ok(())
    }

    fn all_gather_cols(&self, be: &B, t: &B::Tensor) -> Result<B::Tensor> {
        const OP: &str = "all_gather_cols";
        let mine = self.deposit(be, OP, t)?;
        let (rows, out) = self.group.exchange(self.rank, mine, |all| {
            let rows = all[0].shape[0];
            if let Some(r) = all.iter().position(|d| d.shape[0] != rows) {
                return Err(Error::Shape {
                    op: "collective",
                    detail: format!(
                        "{OP}: rank 0 passed {rows} rows, rank {r} {}",
                        all[r].shape[0]
                    ),
                });
            }
            let mut out = Vec::with_capacity(all.iter().map(|d| d.values.len()).sum());
            for row in 0..rows {
                for d in all {
                    let c = d.shape[1];
                    out.extend_from_slice(&d.values[row * c..(row + 1) * c]);
                }
            }
            Ok((rows, out))
        })?;
        let cols = out.len().checked_div(rows).unwrap_or(0);
        be.upload_f32(&[rows, cols], &out)
    }

    fn all_gather_rows(&self, be: &B, t: &B::Tensor) -> Result<B::Tensor> {
        const OP: &str = "all_gather_rows";
        let mine = self.deposit(be, OP, t)?;
        let (cols, out) = self.group.exchange(self.rank, mine, |all| {
            let cols = all[0].shape[1];
            if let Some(r) = all.iter().position(|d| d.shape[1] != cols) {
                return Err(Error::Shape {
                    op: "collective",
                    detail: format!(
                        "{OP}: rank 0 passed {cols} columns, rank {r} {}",
                        all[r].shape[1]
                    ),
                });
            }
            Ok((
                cols,
                all.iter()
                    .flat_map(|d| d.values.iter().copied())
                    .collect::<Vec<f32>>(),
            ))
        })?;
        let rows = out.len().checked_div(cols).unwrap_or(0);
        be.upload_f32(&[rows, cols], &out)
    }

    fn reduce_scatter_rows(&self, be: &B, t: &B::Tensor) -> Result<B::Tensor> {
        const OP: &str = "reduce_scatter_rows";
        let (world, rank) = (self.group.world, self.rank);
        let mine = self.deposit(be, OP, t)?;
        let (share, cols, sum) = self.group.exchange(self.rank, mine, |all| {
            let [rows, cols] = same_shapes(OP, all)?;
            if !rows.is_multiple_of(world) {
                return Err(Error::Shape {
                    op: "collective",
                    detail: format!("{OP}: {rows} rows do not split over {world} ranks"),
                });
            }
            let share = rows / world;
            let range = rank * share * cols..(rank + 1) * share * cols;
            let mut sum = all[0].values[range.clone()].to_vec();
            for d in &all[1..] {
                for (s, v) in sum.iter_mut().zip(&d.values[range.clone()]) {
                    *s += v;
                }
            }
            Ok((share, cols, sum))
        })?;
        be.upload_f32(&[share, cols], &sum)
    }

    fn all_to_all_rows(&self, be: &B, parts: &[B::Tensor]) -> Result<Vec<B::Tensor>> {
        const OP: &str = "all_to_all_rows";
        let world = self.group.world;
        if parts.len() != world {
            return Err(Error::Shape {
                op: "collective",
                detail: format!("{OP}: {} parts for {world} ranks", parts.len()),
            });
        }
        let mut values = Vec::new();
        let mut rows_to = Vec::with_capacity(world);
        let mut cols = None;
        for p in parts {
            let [r, c] = rows_cols(be.shape(p));
            if *cols.get_or_insert(c) != c && r > 0 {
                return Err(Error::Shape {
                    op: "collective",
                    detail: format!("{OP}: parts of {} and {c} columns", cols.unwrap_or(c)),
                });
            }
            values.extend(be.to_f32(p)?);
            rows_to.push(r);
        }
        let cols = cols.unwrap_or(0);
        let mine = Deposit {
            op: OP,
            shape: [rows_to.iter().sum(), cols],
            values,
            rows_to,
        };
        let rank = self.rank;
        let received = self.group.exchange(self.rank, mine, |all| {
            if let Some(r) = all
                .iter()
                .position(|d| d.shape[1] != cols && d.shape[0] > 0)
            {
                return Err(Error::Shape {
                    op: "collective",
                    detail: format!(
                        "{OP}: rank {rank} sends {cols} columns, rank {r} {}",
                        all[r].shape[1]
                    ),
                });
            }
            Ok(all
                .iter()
                .map(|d| {
                    let c = d.shape[1];
                    let start: usize = d.rows_to[..rank].iter().sum();
                    let rows = d.rows_to[rank];
                    (rows, d.values[start * c..(start + rows) * c].to_vec())
                })
                .collect::<Vec<_>>())
        })?;
        received
            .into_iter()
            .map(|(rows, v)| be.upload_f32(&[rows, cols], &v))
            .collect()
    }

    fn broadcast(&self, be: &B, t: &mut B::Tensor, root: usize) -> Result<()> {
        const OP: &str = "broadcast";
        let world = self.group.world;
        if root >= world {
            return Err(Error::Shape {
                op: "collective",
                detail: format!("{OP}: root {root} of {world} ranks"),
            });
        }
        let shape = be.shape(t).to_vec();
        let mine = self.deposit(be, OP, t)?;
        let values = self.group.exchange(self.rank, mine, |all| {
            same_shapes(OP, all)?;
            Ok(all[root].values.clone())
        })?;
        *t = be.upload_f32(&shape, &values)?;
        Ok(())
    }

    fn abort(&self, reason: &str) {
        let mut st = self.group.lock();
        st.failed
            .get_or_insert_with(|| format!("rank {}: {reason}", self.rank));
        self.group.changed.notify_all();
    }
}
