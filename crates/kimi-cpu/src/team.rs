//! A spinning fork-join team: the CPU backend's parallel sections.
//!
//! A decode step runs a few hundred short parallel sections (a matmul, an attention), each
//! some tens of microseconds long. Rayon's idle workers go to sleep between them, and every
//! wake-up costs several microseconds. The team's workers instead spin on a generation
//! counter for a while after each section (the spin budget, `KIMI_CPU_SPIN_US`, default
//! [`DEFAULT_SPIN`]), so back-to-back sections start as soon as the counter's cache line
//! moves; they park once the backend has been idle that long, so an idle server costs no CPU.
//!
//! A section ([`Team::run`]) calls a closure once for every task index `0..tasks`. The
//! calling thread and the workers claim tasks from a shared counter, and the section ends
//! when every task is done. Workers join a section only while it is open: the caller closes
//! it once no task is left to claim, so a worker that lost its core to another process
//! holds nothing up (the caller runs its share), as rayon's work stealing would. A section
//! started from inside a section, or while another thread's section holds the team, runs
//! its tasks serially on the calling thread. A panic in any task is re-raised on the caller
//! once every task has finished.
//!
//! The helpers split work so that which thread computes a value never changes the value:
//! [`Team::for_each_part`] cuts an output into one large contiguous part per thread plus a
//! few small ones for balance (for matmuls: each thread streams its own weight rows, and
//! the boundaries depend only on the sizes); [`Team::map`] makes every item a task (for
//! uneven work such as attention heads).

use std::any::Any;
use std::cell::Cell;
use std::hint::spin_loop;
use std::ops::Range;
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, PoisonError, TryLockError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How long an idle worker spins before it parks, unless `KIMI_CPU_SPIN_US` says otherwise.
/// Longer than the gaps between sections of a forward pass and between decode steps, short
/// enough that an idle process goes quiet at once.
pub(crate) const DEFAULT_SPIN: Duration = Duration::from_micros(200);

/// The spin budget: `KIMI_CPU_SPIN_US` microseconds if set, else [`DEFAULT_SPIN`].
pub(crate) fn spin_budget() -> Duration {
    std::env::var("KIMI_CPU_SPIN_US")
        .ok()
        .and_then(|v| v.trim().parse().ok())
        .map_or(DEFAULT_SPIN, Duration::from_micros)
}

/// How long a waiting worker polls without letting go of its core (the gaps between the
/// sections of a forward pass are shorter). After that it yields between polls until the
/// spin budget is spent, so that on a busy machine the caller's serial work or another
/// process can have the core.
const HOT_SPIN: Duration = Duration::from_micros(50);

/// Polls of the generation between two looks at the clock.
const POLLS_PER_CLOCK_READ: u32 = 64;

/// `Shared::state`: set while no section is open; the other bits count joined workers.
const CLOSED: usize = 1 << (usize::BITS - 1);

type Payload = Box<dyn Any + Send>;

/// One section. It lives on the stack of the thread running the section, which does not
/// return before every worker that joined has left.
struct Job<'a> {
    f: &'a (dyn Fn(usize) + Sync),
    tasks: usize,
    /// The next task to claim.
    next: AtomicUsize,
}

impl Job<'_> {
    /// Claims and runs tasks until none is left; keeps the first panic in `slot`.
    fn work(&self, slot: &Mutex<Option<Payload>>) {
        loop {
            let t = self.next.fetch_add(1, Ordering::Relaxed);
            if t >= self.tasks {
                return;
            }
            if let Err(payload) = catch_unwind(AssertUnwindSafe(|| (self.f)(t))) {
                let mut slot = slot.lock().unwrap_or_else(PoisonError::into_inner);
                slot.get_or_insert(payload);
            }
        }
    }
}

/// What the caller and the workers share.
struct Shared {
    /// Bumped once per section, and at shutdown; idle workers wait for it to change.
    generation: AtomicUsize,
    /// [`CLOSED`] or the number of workers in the open section.
    state: AtomicUsize,
    /// The open section's job, set before it opens; valid until every worker that joined
    /// has left.
    job: AtomicPtr<Job<'static>>,
    /// The first panic of the current section.
    panic: Mutex<Option<Payload>>,
    /// Workers parked, or about to park, on `wake`.
    sleepers: AtomicUsize,
    sleep_lock: Mutex<()>,
    wake: Condvar,
    shutdown: AtomicBool,
    spin: Duration,
    /// Until when idle workers keep spinning whatever the spin budget (nanoseconds after
    /// `epoch`): work was announced ([`Team::expect_work`]).
    hot_until: AtomicU64,
    epoch: Instant,
    /// Tests hold it to keep workers out of sections (as if they had lost their cores).
    #[cfg(test)]
    stall: Mutex<()>,
}

/// A fixed team of worker threads plus the caller; see the module docs.
pub(crate) struct Team {
    shared: Arc<Shared>,
    threads: usize,
    /// Held by the thread running a section.
    busy: Mutex<()>,
    workers: Vec<JoinHandle<()>>,
}

thread_local! {
    /// Whether this thread is inside a section (workers always are): a nested section runs
    /// serially instead of waiting on workers that are busy with the outer one.
    static IN_SECTION: Cell<bool> = const { Cell::new(false) };
}

impl Team {
    /// A team of `threads` (at least 1) including the caller: `threads - 1` workers, which
    /// flush subnormal floats to zero. If a worker cannot be spawned the team is smaller.
    pub(crate) fn new(threads: usize, spin: Duration) -> Team {
        let shared = Arc::new(Shared {
            generation: AtomicUsize::new(0),
            state: AtomicUsize::new(CLOSED),
            job: AtomicPtr::new(std::ptr::null_mut()),
            panic: Mutex::new(None),
            sleepers: AtomicUsize::new(0),
            sleep_lock: Mutex::new(()),
            wake: Condvar::new(),
            shutdown: AtomicBool::new(false),
            spin,
            hot_until: AtomicU64::new(0),
            epoch: Instant::now(),
            #[cfg(test)]
            stall: Mutex::new(()),
        });
        let mut workers = Vec::new();
        for index in 1..threads.max(1) {
            let s = Arc::clone(&shared);
            let spawned = std::thread::Builder::new()
                .name(format!("kimi-cpu-team-{index}"))
                .spawn(move || worker(&s));
            match spawned {
                Ok(handle) => workers.push(handle),
                Err(_) => break,
            }
        }
        Team {
            shared,
            threads: workers.len() + 1,
            busy: Mutex::new(()),
            workers,
        }
    }

    /// Threads in a section, the caller included.
    pub(crate) fn threads(&self) -> usize {
        self.threads
    }

    /// Announces a section within `within`: parked workers wake now, and idle ones keep
    /// spinning until then, so that a section started after a wait the caller cannot
    /// shorten (a device's results) begins with every thread at work rather than with the
    /// time it takes to wake them, which on a virtual machine can exceed the section.
    pub(crate) fn expect_work(&self, within: Duration) {
        let s = &*self.shared;
        let until = s.nanos_now().saturating_add(within.as_nanos() as u64);
        s.hot_until.fetch_max(until, Ordering::Relaxed);
        if s.sleepers.load(Ordering::SeqCst) == 0 {
            return;
        }
        // A running section has its workers awake already.
        let Ok(_busy) = self.busy.try_lock() else {
            return;
        };
        // A new generation with no section open: the woken workers find it closed and go
        // back to waiting, now spinning until `hot_until`.
        s.generation.fetch_add(1, Ordering::SeqCst);
        let _lock = s.sleep_lock.lock().unwrap_or_else(PoisonError::into_inner);
        s.wake.notify_all();
    }

    /// Calls `f(t)` once for every task `t` in `0..tasks`, spread over the team, and
    /// returns when all calls have returned. Re-raises the first panic among them.
    pub(crate) fn run(&self, tasks: usize, f: &(dyn Fn(usize) + Sync)) {
        if tasks <= 1 || self.workers.is_empty() || IN_SECTION.get() {
            return (0..tasks).for_each(f);
        }
        let busy = match self.busy.try_lock() {
            Ok(guard) => guard,
            Err(TryLockError::Poisoned(p)) => p.into_inner(),
            Err(TryLockError::WouldBlock) => return (0..tasks).for_each(f),
        };
        let s = &*self.shared;
        let job = Job {
            f,
            tasks,
            next: AtomicUsize::new(0),
        };
        // Workers see the job as 'static: it outlives the section, which ends below only
        // once every worker that joined has left, whether or not a task panicked.
        s.job.store(
            (&job as *const Job<'_>).cast::<Job<'static>>().cast_mut(),
            Ordering::Relaxed,
        );
        s.state.store(0, Ordering::Release);
        // SeqCst, paired with a parking worker's: either the worker sees the new generation
        // or this thread sees it among the sleepers (see `Shared::wait`).
        s.generation.fetch_add(1, Ordering::SeqCst);
        if s.sleepers.load(Ordering::SeqCst) > 0 {
            let _lock = s.sleep_lock.lock().unwrap_or_else(PoisonError::into_inner);
            s.wake.notify_all();
        }
        IN_SECTION.set(true);
        job.work(&s.panic);
        IN_SECTION.set(false);
        // Every task is claimed: close the section to latecomers, wait for the others.
        if s.state.fetch_or(CLOSED, Ordering::AcqRel) != 0 {
            // After a while, yield between polls: a worker may have lost its core.
            let start = Instant::now();
            let mut polls = 0u32;
            while s.state.load(Ordering::Acquire) != CLOSED {
                spin_loop();
                polls += 1;
                if polls.is_multiple_of(POLLS_PER_CLOCK_READ) && start.elapsed() >= HOT_SPIN {
                    std::thread::yield_now();
                }
            }
        }
        let panic = s
            .panic
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        drop(busy);
        if let Some(payload) = panic {
            resume_unwind(payload);
        }
    }

    /// Cuts `data`, a sequence of items of `unit` values each, into contiguous parts of
    /// whole `align`-item steps (see [`parts`]) and calls `f(first_item, part)` for each,
    /// spread over the team.
    pub(crate) fn for_each_part<T: Send>(
        &self,
        data: &mut [T],
        unit: usize,
        align: usize,
        f: impl Fn(usize, &mut [T]) + Sync,
    ) {
        let unit = unit.max(1);
        let items = data.len() / unit;
        if items == 0 {
            return;
        }
        let mut slots = Vec::new();
        let mut rest = data;
        for range in parts(items, align, self.threads) {
            let (part, tail) = std::mem::take(&mut rest).split_at_mut(range.len() * unit);
            rest = tail;
            slots.push(Mutex::new(Some((range.start, part))));
        }
        self.run(slots.len(), &|i| {
            // Each task takes its own part, once: the lock is never contended.
            let taken = slots[i]
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .take();
            if let Some((first, part)) = taken {
                f(first, part);
            }
        });
    }

    /// `[f(0), f(1), .., f(tasks - 1)]`, each task claimed by whichever thread is free
    /// (for tasks of uneven size).
    pub(crate) fn map<R: Send>(&self, tasks: usize, f: impl Fn(usize) -> R + Sync) -> Vec<R> {
        let results: Vec<Mutex<Option<R>>> = (0..tasks).map(|_| Mutex::new(None)).collect();
        self.run(tasks, &|t| {
            let r = f(t);
            *results[t].lock().unwrap_or_else(PoisonError::into_inner) = Some(r);
        });
        results
            .into_iter()
            .map(|m| {
                m.into_inner()
                    .unwrap_or_else(PoisonError::into_inner)
                    .expect("invariant: every task ran")
            })
            .collect()
    }

    /// [`Team::map`] over the `chunk`-sized pieces of `data`: `f(i, piece i)`.
    pub(crate) fn map_chunks_mut<T: Send, R: Send>(
        &self,
        data: &mut [T],
        chunk: usize,
        f: impl Fn(usize, &mut [T]) -> R + Sync,
    ) -> Vec<R> {
        let pieces: Vec<Mutex<Option<&mut [T]>>> = data
            .chunks_mut(chunk.max(1))
            .map(|c| Mutex::new(Some(c)))
            .collect();
        self.map(pieces.len(), |i| {
            let piece = pieces[i]
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .take()
                .expect("invariant: each piece is taken once");
            f(i, piece)
        })
    }
}

impl Drop for Team {
    fn drop(&mut self) {
        let s = &*self.shared;
        s.shutdown.store(true, Ordering::SeqCst);
        s.generation.fetch_add(1, Ordering::SeqCst);
        {
            let _lock = s.sleep_lock.lock().unwrap_or_else(PoisonError::into_inner);
            s.wake.notify_all();
        }
        for w in self.workers.drain(..) {
            let _ = w.join();
        }
    }
}

/// How [`Team::for_each_part`] cuts `0..items`: contiguous ranges of whole `align`-item
/// steps (but the ragged end), in order, none empty. One large range per thread covers
/// most of the items; the last few steps, one range each, go to whichever threads finish
/// their large range first. They make up for a thread that starts late (a worker first
/// has to notice the section) or runs slower, to within one step of work, at the price of
/// a claim each.
pub(crate) fn parts(items: usize, align: usize, threads: usize) -> Vec<Range<usize>> {
    let align = align.max(1);
    let steps = items.div_ceil(align);
    let threads = threads.max(1);
    // About an eighth of the work, if each thread has at least eight steps, at most eight
    // steps per thread.
    let tail = if threads > 1 && steps >= 8 * threads {
        (steps / 8).min(8 * threads)
    } else {
        0
    };
    let (head, per, extra) = (
        steps - tail,
        (steps - tail) / threads,
        (steps - tail) % threads,
    );
    let mut bounds = vec![0];
    // Later large ranges take the extra steps: the ragged end then shortens the longest.
    bounds.extend((1..=threads).map(|i| i * per + i.saturating_sub(threads - extra)));
    bounds.extend(head + 1..=steps);
    bounds
        .windows(2)
        .map(|w| (w[0] * align).min(items)..(w[1] * align).min(items))
        .filter(|r| !r.is_empty())
        .collect()
}

/// A worker's life: wait for a section, join it if it is still open, claim tasks, leave.
fn worker(s: &Shared) {
    crate::simd::flush_subnormals_to_zero();
    IN_SECTION.set(true);
    let mut seen = 0;
    loop {
        seen = s.wait(seen);
        if s.shutdown.load(Ordering::Acquire) {
            return;
        }
        #[cfg(test)]
        drop(s.stall.lock().unwrap_or_else(PoisonError::into_inner));
        // A closed section is finished, or finishing without this worker.
        let open = |v: usize| (v & CLOSED == 0).then_some(v + 1);
        if s.state
            .fetch_update(Ordering::Acquire, Ordering::Relaxed, open)
            .is_err()
        {
            continue;
        }
        {
            // SAFETY: this worker joined an open section (Acquire, after the caller's
            // Release store that opened it, which follows its store of `job`). That
            // section's caller keeps its `Job` alive until every joined worker has left,
            // and this reference is gone before the `fetch_sub` below.
            let job = unsafe { &*s.job.load(Ordering::Relaxed) };
            job.work(&s.panic);
        }
        s.state.fetch_sub(1, Ordering::Release);
    }
}

impl Shared {
    fn nanos_now(&self) -> u64 {
        self.epoch.elapsed().as_nanos() as u64
    }

    /// Waits until the generation differs from `seen` and returns it: spins (see
    /// [`HOT_SPIN`]) for the spin budget or until announced work is due, then parks.
    fn wait(&self, seen: usize) -> usize {
        let start = Instant::now();
        loop {
            for _ in 0..POLLS_PER_CLOCK_READ {
                let g = self.generation.load(Ordering::Acquire);
                if g != seen {
                    return g;
                }
                spin_loop();
            }
            let waited = start.elapsed();
            if waited >= self.spin && self.nanos_now() >= self.hot_until.load(Ordering::Relaxed) {
                break;
            }
            if waited >= HOT_SPIN {
                std::thread::yield_now();
            }
        }
        let mut lock = self
            .sleep_lock
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        // Announce, then re-check (both SeqCst, mirroring `Team::run`'s bump then look): a
        // section published after the re-check sees this sleeper and notifies under the
        // lock, which this thread holds until `wait` releases it.
        self.sleepers.fetch_add(1, Ordering::SeqCst);
        loop {
            let g = self.generation.load(Ordering::SeqCst);
            if g != seen {
                self.sleepers.fetch_sub(1, Ordering::SeqCst);
                return g;
            }
            lock = self.wake.wait(lock).unwrap_or_else(PoisonError::into_inner);
        }
    }
}

#[cfg(test)]
mod tests;
