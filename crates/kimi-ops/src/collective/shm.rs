//! Collectives between the processes of one node through shared memory: the CPU backend's
//! collective when each rank is a process (`serve` starting one process per rank), so that
//! the path GPUs take through NCCL runs in CI on the CPU.
//!
//! Rank 0 makes a control file ([`ShmGroup::create`]) and hands its name to the others (the
//! rendezvous payload, where NCCL's unique id goes on GPUs); every rank joins it
//! ([`ShmComm::join`]) with a data file of its own, which holds its deposit of the operation
//! in flight and grows as deposits do. Once every rank has opened every file, rank 0 removes
//! their names, so nothing is left behind however the processes end.
//!
//! ```text
//! control   magic | world | failure: state, length, reason | per rank: joined posted taken bytes
//! data (r)  op | rows | cols | parts | rows sent to each rank … | f32 values …
//! ```
//!
//! Operation `g` on rank `r`: wait until every rank has taken `g - 1` (nobody still reads
//! `r`'s file), write the deposit, post `g`; wait until every rank has posted `g`; copy all
//! deposits out; take `g`. Every word of the control file is an atomic; every wait has the
//! group's deadline and ends at once when a rank records a failure.

use std::fs::{File, OpenOptions};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

use memmap2::{Mmap, MmapMut};

use super::{Deposit, Exchange};
use crate::{Error, Result};

const MAGIC: u64 = u64::from_le_bytes(*b"KIMISHM1");
const WORLD_AT: usize = 8;
/// 0: no failure; 1: a rank is writing its reason; 2: the reason is there.
const FAILURE_AT: usize = 16;
const REASON_LEN_AT: usize = 24;
const REASON_AT: usize = 64;
const REASON_MAX: usize = 1024;
const RANKS_AT: usize = REASON_AT + REASON_MAX;
const RANK_STRIDE: usize = 64;
/// A rank's words: 1 once its data file exists, 2 once it has opened every other's.
const JOINED: usize = 0;
/// The last operation whose deposit it wrote.
const POSTED: usize = 8;
/// The last operation whose deposits it has copied out.
const TAKEN: usize = 16;
/// Bytes of its deposit in flight.
const BYTES: usize = 24;
/// A deposit's header: op, rows, cols, parts.
const HEADER: usize = 32;
const PAGE: usize = 4096;

/// The operations a deposit names (by index).
const OPS: [&str; 6] = [
    "all_reduce_sum",
    "all_gather_cols",
    "all_gather_rows",
    "reduce_scatter_rows",
    "all_to_all_rows",
    "broadcast",
];

fn control_len(world: usize) -> usize {
    RANKS_AT + world * RANK_STRIDE
}

/// Where the files live: `/dev/shm` (memory) where there is one, else the temp folder.
fn shm_dir() -> PathBuf {
    let shm = Path::new("/dev/shm");
    match shm.is_dir() {
        true => shm.to_path_buf(),
        false => std::env::temp_dir(),
    }
}

/// Read-write options for files only this user may open (the deposits are activations).
fn private() -> OpenOptions {
    let mut o = OpenOptions::new();
    o.read(true).write(true);
    #[cfg(unix)]
    std::os::unix::fs::OpenOptionsExt::mode(&mut o, 0o600);
    o
}

fn io(what: impl std::fmt::Display, e: std::io::Error) -> Error {
    Error::Device(format!("shared-memory collective: {what}: {e}"))
}

/// Gives `file` `len` bytes of real memory, so that a full `/dev/shm` is an error here and
/// not a bus error on the first write to the mapping.
fn reserve(file: &File, path: &Path, len: usize) -> Result<()> {
    file.set_len(len as u64)
        .map_err(|e| io(format!("cannot size {} to {len} bytes", path.display()), e))?;
    #[cfg(target_os = "linux")]
    {
        use std::os::fd::AsRawFd;
        // SAFETY: `file` is an open descriptor for the call's duration; the range is the
        // file's own length.
        let r = unsafe { libc::posix_fallocate(file.as_raw_fd(), 0, len as libc::off_t) };
        if r != 0 {
            return Err(io(
                format!(
                    "cannot reserve {len} bytes for {} (is {} too small for the \
                     collective's deposits?)",
                    path.display(),
                    path.parent().map_or("".into(), |p| p.display().to_string())
                ),
                std::io::Error::from_raw_os_error(r),
            ));
        }
    }
    Ok(())
}

/// The control file of a group, made by rank 0; its name is what the other ranks join.
/// Keep it until rank 0 has joined ([`ShmComm::join`] waits for every rank to open the
/// files and then removes their names); dropping it removes the name if that has not
/// happened.
pub struct ShmGroup {
    name: String,
    path: PathBuf,
}

impl ShmGroup {
    /// Makes the control file of a group of `world` ranks.
    pub fn create(world: usize) -> Result<Self> {
        if world == 0 {
            return Err(Error::Device(
                "shared-memory collective: a group of no ranks".into(),
            ));
        }
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        let name = format!("kimi-collective-{}-{nanos:x}", std::process::id());
        let path = shm_dir().join(&name);
        let file = private()
            .create_new(true)
            .open(&path)
            .map_err(|e| io(format!("cannot create {}", path.display()), e))?;
        let group = Self { name, path };
        reserve(&file, &group.path, control_len(world))?;
        let map = Control::map(&file, &group.path)?;
        map.word(WORLD_AT).store(world as u64, Ordering::Relaxed);
        map.word(0).store(MAGIC, Ordering::Release);
        Ok(group)
    }

    /// The name the other ranks join (no path: every rank finds it in the same folder).
    pub fn name(&self) -> &str {
        &self.name
    }
}

impl Drop for ShmGroup {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

/// The control file's mapping: every access is an atomic word.
struct Control(MmapMut);

impl Control {
    fn map(file: &File, path: &Path) -> Result<Self> {
        // SAFETY: the file is this group's own, sized before mapping; it is only ever
        // accessed through the atomic words of `Control::word`, by every process alike.
        let map = unsafe { MmapMut::map_mut(file) }
            .map_err(|e| io(format!("cannot map {}", path.display()), e))?;
        Ok(Self(map))
    }

    fn word(&self, at: usize) -> &AtomicU64 {
        assert!(
            at.is_multiple_of(8) && at + 8 <= self.0.len(),
            "control word {at}"
        );
        // SAFETY: the mapping is page-aligned and `at` a multiple of 8 inside it, so the
        // word is aligned and in bounds; it lives as long as `self`. Other processes change
        // it concurrently, which is what an atomic allows; no `&mut` to the mapping is
        // ever made.
        unsafe { &*(self.0.as_ptr().add(at) as *const AtomicU64) }
    }

    fn rank_word(&self, rank: usize, field: usize) -> &AtomicU64 {
        self.word(RANKS_AT + rank * RANK_STRIDE + field)
    }
}

/// What one rank holds of the data files.
struct Files {
    /// Operations this rank has completed.
    generation: u64,
    own_file: File,
    own_path: PathBuf,
    own: MmapMut,
    /// Every rank's data file (this rank's too), opened at join.
    files: Vec<File>,
    /// Read-only mappings of the other ranks' files, remapped when they grow.
    views: Vec<Option<Mmap>>,
}

impl Files {
    /// Writes `d` into this rank's file (growing it when needed); returns its bytes.
    fn write(&mut self, d: &Deposit) -> Result<usize> {
        let op = OPS.iter().position(|&o| o == d.op).unwrap_or(usize::MAX) as u64;
        let bytes = HEADER + 8 * d.rows_to.len() + 4 * d.values.len();
        if self.own.len() < bytes {
            let len = bytes.max(2 * self.own.len()).div_ceil(PAGE) * PAGE;
            reserve(&self.own_file, &self.own_path, len)?;
            // SAFETY: as in `join`: this rank's own file, only written by this rank while
            // no other rank reads it (the protocol's taken/posted words).
            self.own = unsafe { MmapMut::map_mut(&self.own_file) }
                .map_err(|e| io(format!("cannot map {}", self.own_path.display()), e))?;
        }
        let out = &mut self.own[..bytes];
        let words = [
            op,
            d.shape[0] as u64,
            d.shape[1] as u64,
            d.rows_to.len() as u64,
        ];
        let (head, rest) = out.split_at_mut(HEADER + 8 * d.rows_to.len());
        for (dst, v) in head
            .chunks_exact_mut(8)
            .zip(words.into_iter().chain(d.rows_to.iter().map(|&r| r as u64)))
        {
            dst.copy_from_slice(&v.to_le_bytes());
        }
        for (dst, v) in rest.chunks_exact_mut(4).zip(&d.values) {
            dst.copy_from_slice(&v.to_le_bytes());
        }
        Ok(bytes)
    }

    /// Copies rank `r`'s deposit of `bytes` out of its file.
    fn read(&mut self, r: usize, own_rank: usize, bytes: usize) -> Result<Deposit> {
        let corrupt = |why: &str| {
            Error::Device(format!(
                "shared-memory collective: rank {r}'s deposit is corrupt ({why})"
            ))
        };
        let data: &[u8] = if r == own_rank {
            &self.own
        } else {
            if self.views[r].as_ref().is_none_or(|v| v.len() < bytes) {
                // SAFETY: rank `r`'s file, which it does not change between posting an
                // operation and every rank taking it; mapped read-only.
                let view = unsafe { Mmap::map(&self.files[r]) }
                    .map_err(|e| io(format!("cannot map rank {r}'s data file"), e))?;
                self.views[r] = Some(view);
            }
            self.views[r].as_deref().unwrap_or_default()
        };
        if bytes < HEADER || data.len() < bytes {
            return Err(corrupt("shorter than it says"));
        }
        let word = |i: usize| {
            let mut w = [0u8; 8];
            w.copy_from_slice(&data[8 * i..8 * i + 8]);
            u64::from_le_bytes(w) as usize
        };
        let op = *OPS
            .get(word(0))
            .ok_or_else(|| corrupt("an unknown operation"))?;
        let parts = word(3);
        let values_at = parts
            .checked_mul(8)
            .and_then(|p| p.checked_add(HEADER))
            .filter(|&v| v <= bytes && (bytes - v).is_multiple_of(4))
            .ok_or_else(|| corrupt("its parts do not fit"))?;
        Ok(Deposit {
            op,
            shape: [word(1), word(2)],
            rows_to: (0..parts).map(|i| word(4 + i)).collect(),
            values: data[values_at..bytes]
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
        })
    }
}

/// One rank's handle on a group of processes joined through shared memory.
pub struct ShmComm {
    rank: usize,
    world: usize,
    timeout: Duration,
    control: Control,
    control_path: PathBuf,
    files: Mutex<Files>,
}

fn valid_name(name: &str) -> bool {
    !name.is_empty()
        && !name.starts_with('.')
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_' || b == b'.')
}

impl ShmComm {
    /// Joins the group `name` ([`ShmGroup::name`] of rank 0) as rank `rank` of `world`:
    /// waits up to `timeout` for every rank, which is also every later operation's
    /// deadline.
    pub fn join(name: &str, rank: usize, world: usize, timeout: Duration) -> Result<Self> {
        let settings = |m: String| Error::Device(format!("shared-memory collective: {m}"));
        if !valid_name(name) {
            return Err(settings(format!("{name:?} is not a group's name")));
        }
        if rank >= world {
            return Err(settings(format!("rank {rank} of a group of {world}")));
        }
        let dir = shm_dir();
        let control_path = dir.join(name);
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .open(&control_path)
            .map_err(|e| {
                io(
                    format!(
                        "cannot open {} (the CPU backend's ranks must share one node)",
                        control_path.display()
                    ),
                    e,
                )
            })?;
        let len = file.metadata().map_or(0, |m| m.len()) as usize;
        if len < control_len(world) {
            return Err(settings(format!(
                "{} holds {len} bytes, less than a group of {world} ranks needs",
                control_path.display()
            )));
        }
        let control = Control::map(&file, &control_path)?;
        let (magic, theirs) = (
            control.word(0).load(Ordering::Acquire),
            control.word(WORLD_AT).load(Ordering::Relaxed),
        );
        if magic != MAGIC || theirs != world as u64 {
            return Err(settings(format!(
                "{} is not a group of {world} ranks (magic {magic:#x}, world {theirs})",
                control_path.display()
            )));
        }
        let own_path = dir.join(format!("{name}.{rank}"));
        // New, or another process holds this rank's place.
        let own_file = private()
            .create_new(true)
            .open(&own_path)
            .map_err(|e| io(format!("cannot create {}", own_path.display()), e))?;
        reserve(&own_file, &own_path, PAGE)?;
        // SAFETY: this rank's own file, just sized; only this rank writes it.
        let own = unsafe { MmapMut::map_mut(&own_file) }
            .map_err(|e| io(format!("cannot map {}", own_path.display()), e))?;
        let comm = Self {
            rank,
            world,
            timeout,
            control,
            control_path,
            files: Mutex::new(Files {
                generation: 0,
                own_file,
                own_path,
                own,
                files: Vec::new(),
                views: (0..world).map(|_| None).collect(),
            }),
        };
        if comm
            .control
            .rank_word(rank, JOINED)
            .swap(1, Ordering::AcqRel)
            != 0
        {
            return Err(settings(format!("rank {rank} joined twice")));
        }
        let deadline = Instant::now() + timeout;
        comm.wait_all(JOINED, 1, deadline, |m| {
            format!("rank(s) {m} did not join the collective")
        })?;
        let files = (0..world)
            .map(|r| {
                let path = dir.join(format!("{name}.{r}"));
                File::open(&path).map_err(|e| io(format!("cannot open {}", path.display()), e))
            })
            .collect::<Result<Vec<File>>>()?;
        comm.lock().files = files;
        comm.control
            .rank_word(rank, JOINED)
            .store(2, Ordering::Release);
        if rank == 0 {
            comm.wait_all(JOINED, 2, deadline, |m| {
                format!("rank(s) {m} did not open the collective's files")
            })?;
            // Every rank holds every file open: the names can go.
            let _ = std::fs::remove_file(&comm.control_path);
            for r in 0..world {
                let _ = std::fs::remove_file(dir.join(format!("{name}.{r}")));
            }
        }
        Ok(comm)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Files> {
        self.files.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The recorded failure, if any rank has recorded one.
    fn failure(&self) -> Option<String> {
        let state = self.control.word(FAILURE_AT);
        if state.load(Ordering::Acquire) == 0 {
            return None;
        }
        // A rank is writing its reason: give it a moment.
        let until = Instant::now() + Duration::from_millis(50);
        while state.load(Ordering::Acquire) != 2 && Instant::now() < until {
            std::thread::yield_now();
        }
        if state.load(Ordering::Acquire) != 2 {
            return Some("a rank failed".into());
        }
        let len =
            (self.control.word(REASON_LEN_AT).load(Ordering::Relaxed) as usize).min(REASON_MAX);
        let bytes: Vec<u8> = (0..len.div_ceil(8))
            .flat_map(|i| {
                self.control
                    .word(REASON_AT + 8 * i)
                    .load(Ordering::Relaxed)
                    .to_le_bytes()
            })
            .take(len)
            .collect();
        Some(String::from_utf8_lossy(&bytes).into_owned())
    }

    /// Records `reason` as the group's failure, unless one is recorded already.
    fn fail(&self, reason: &str) {
        let state = self.control.word(FAILURE_AT);
        if state
            .compare_exchange(0, 1, Ordering::AcqRel, Ordering::Acquire)
            .is_err()
        {
            return;
        }
        let mut bytes = reason.as_bytes();
        if bytes.len() > REASON_MAX {
            let mut end = REASON_MAX;
            while !reason.is_char_boundary(end) {
                end -= 1;
            }
            bytes = &bytes[..end];
        }
        for (i, chunk) in bytes.chunks(8).enumerate() {
            let mut w = [0u8; 8];
            w[..chunk.len()].copy_from_slice(chunk);
            self.control
                .word(REASON_AT + 8 * i)
                .store(u64::from_le_bytes(w), Ordering::Relaxed);
        }
        self.control
            .word(REASON_LEN_AT)
            .store(bytes.len() as u64, Ordering::Relaxed);
        state.store(2, Ordering::Release);
    }

    /// Waits until every rank's `field` is at least `value`, the group fails or `deadline`
    /// passes (then the failure is recorded: `what` of the missing ranks).
    fn wait_all(
        &self,
        field: usize,
        value: u64,
        deadline: Instant,
        what: impl Fn(&str) -> String,
    ) -> Result<()> {
        let mut rounds = 0u32;
        loop {
            if let Some(reason) = self.failure() {
                return Err(Error::Device(format!("collective aborted: {reason}")));
            }
            let missing: Vec<String> = (0..self.world)
                .filter(|&r| self.control.rank_word(r, field).load(Ordering::Acquire) < value)
                .map(|r| r.to_string())
                .collect();
            if missing.is_empty() {
                return Ok(());
            }
            if Instant::now() >= deadline {
                let message = format!("{} within {:?}", what(&missing.join(", ")), self.timeout);
                self.fail(&message);
                return Err(Error::Device(format!("collective timed out: {message}")));
            }
            // Spin briefly (the others are usually a moment behind), then sleep.
            rounds += 1;
            match rounds {
                0..=200 => std::hint::spin_loop(),
                201..=400 => std::thread::yield_now(),
                _ => std::thread::sleep(Duration::from_micros(50)),
            }
        }
    }

    /// Ends every pending and later collective of the group with `reason`.
    pub(super) fn abort_group(&self, reason: &str) {
        self.fail(&format!("rank {}: {reason}", self.rank));
    }
}

impl Exchange for ShmComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world(&self) -> usize {
        self.world
    }

    fn exchange<R>(&self, mine: Deposit, read: impl FnOnce(&[&Deposit]) -> Result<R>) -> Result<R> {
        let op = mine.op;
        let rank = self.rank;
        let deadline = Instant::now() + self.timeout;
        let mut files = self.lock();
        let g = files.generation + 1;
        self.wait_all(TAKEN, g - 1, deadline, |m| {
            format!("rank {rank}: rank(s) {m} did not complete the previous collective before {op}")
        })?;
        let bytes = match files.write(&mine) {
            Ok(b) => b,
            Err(e) => {
                self.abort_group(&e.to_string());
                return Err(e);
            }
        };
        let me = |field| self.control.rank_word(rank, field);
        me(BYTES).store(bytes as u64, Ordering::Relaxed);
        me(POSTED).store(g, Ordering::Release);
        self.wait_all(POSTED, g, deadline, |m| {
            format!("{op}: rank(s) {m} did not arrive")
        })?;
        let deposits = (0..self.world)
            .map(|r| {
                let bytes = self.control.rank_word(r, BYTES).load(Ordering::Relaxed);
                files.read(r, rank, bytes as usize)
            })
            .collect::<Result<Vec<Deposit>>>();
        me(TAKEN).store(g, Ordering::Release);
        files.generation = g;
        let result = deposits.and_then(|deposits| {
            let all: Vec<&Deposit> = deposits.iter().collect();
            match all.iter().find(|d| d.op != op) {
                Some(other) => Err(Error::Device(format!(
                    "collective mismatch: rank {rank} called {op} while another rank called {}",
                    other.op
                ))),
                None => read(&all),
            }
        });
        if let Err(e) = &result {
            self.fail(&e.to_string());
        }
        result
    }
}

impl Drop for ShmComm {
    fn drop(&mut self) {
        // Normally gone since the join; not where the join failed half-way.
        let files = self.files.get_mut().unwrap_or_else(PoisonError::into_inner);
        let _ = std::fs::remove_file(&files.own_path);
        if self.rank == 0 {
            let _ = std::fs::remove_file(&self.control_path);
        }
    }
}
