//! NCCL behind [`Collective<CudaBackend>`]: the ranks of a model split over GPUs (one per
//! rank, in one process or in several) meet in NCCL's collectives on each backend's stream.
//!
//! `libnccl` is loaded at run time like cuBLAS (cudarc's dynamic loading looks for
//! `libnccl.so` on the library path; NCCL's wheels and packages ship `libnccl.so.2`, which
//! `scripts/cuda/device-check.sh` links under that name). Nothing here moves a tensor through
//! the host: only the row counts of the variable-size operations are read back.
//!
//! Every operation waits for its stream while polling `ncclCommGetAsyncError`, with a
//! deadline: a rank that died or never calls makes the others' calls fail with the
//! operation's name and their rank once the deadline passes, and the communicator is
//! aborted (`ncclCommAbort`), so the job ends instead of hanging. [`Collective::abort`]
//! aborts it too; every later call fails at once. The wait per operation synchronises the
//! host with the stream (the cost of a clear failure; a watchdog thread polling events
//! would let passes run ahead, later).

use std::ffi::CStr;
use std::sync::{Mutex, MutexGuard, OnceLock, PoisonError};
use std::time::{Duration, Instant};

use cudarc::driver::sys as cu;
use cudarc::nccl::sys as nccl;
use kimi_core::DType;
use kimi_ops::{Collective, Error, Result};

use super::CudaBackend;
use crate::tensor::CudaTensor;

use nccl::ncclResult_t::{ncclInProgress, ncclSuccess};

/// The bytes that name one NCCL communicator: rank 0 makes it ([`NcclId::new`]) and hands
/// it to the other ranks (the bootstrap's rendezvous), which all pass it to [`NcclComm::new`].
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct NcclId(pub [u8; NcclId::LEN]);

impl std::fmt::Debug for NcclId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("NcclId(..)")
    }
}

impl NcclId {
    /// Its length in bytes (`NCCL_UNIQUE_ID_BYTES`).
    pub const LEN: usize = 128;

    /// A new id (NCCL opens its bootstrap listener on this host).
    pub fn new() -> Result<Self> {
        loaded()?;
        let mut id = nccl::ncclUniqueId { internal: [0; 128] };
        // SAFETY: `id` is a valid out-pointer of the struct NCCL fills.
        let r = unsafe { nccl::ncclGetUniqueId(&mut id) };
        result(r, None).map_err(|e| Error::Device(format!("NCCL unique id: {e}")))?;
        Ok(Self(id.internal.map(|c| c as u8)))
    }
}

/// Whether NCCL's library could be loaded (looked up once).
fn loaded() -> Result<()> {
    static PRESENT: OnceLock<bool> = OnceLock::new();
    // SAFETY: only tries to dlopen the candidate names, running no library code.
    let present = *PRESENT.get_or_init(|| unsafe { nccl::is_culib_present() });
    if present {
        Ok(())
    } else {
        Err(Error::Device(
            "NCCL not found: no libnccl.so on the library path (NCCL ships libnccl.so.2, e.g. \
             in PyTorch's nvidia-nccl wheel: link it as libnccl.so in a folder on \
             LD_LIBRARY_PATH, as scripts/cuda/device-check.sh does)"
                .into(),
        ))
    }
}

/// NCCL's version as `major.minor.patch`, or why it cannot be loaded.
pub fn nccl_version() -> Result<String> {
    loaded()?;
    let mut v: std::ffi::c_int = 0;
    // SAFETY: `v` is a valid out-pointer.
    result(unsafe { nccl::ncclGetVersion(&mut v) }, None).map_err(Error::Device)?;
    // NCCL_VERSION_CODE is major*10000 + minor*100 + patch since 2.9.
    Ok(format!("{}.{}.{}", v / 10000, (v / 100) % 100, v % 100))
}

/// A communicator handle, used by one thread at a time (the state's `busy` says which).
#[derive(Clone, Copy)]
struct Raw(nccl::ncclComm_t);
// SAFETY: NCCL communicators may be used from any thread as long as calls on one are not
// concurrent; `NcclComm` hands the handle to one operation at a time (`busy`) and aborts it
// only when no operation holds it.
unsafe impl Send for Raw {}

/// `Ok` for success, else NCCL's message (and the communicator's last error).
fn result(r: nccl::ncclResult_t, comm: Option<Raw>) -> std::result::Result<(), String> {
    if r == ncclSuccess {
        return Ok(());
    }
    // SAFETY: NCCL returns static NUL-terminated strings (or null).
    let text = |p: *const std::ffi::c_char| unsafe {
        (!p.is_null()).then(|| CStr::from_ptr(p).to_string_lossy().into_owned())
    };
    // SAFETY: any result code has a string.
    let what = text(unsafe { nccl::ncclGetErrorString(r) }).unwrap_or_default();
    // SAFETY: a live communicator (the caller holds it).
    let last = comm.and_then(|c| text(unsafe { nccl::ncclGetLastError(c.0) }));
    Err(match last {
        Some(last) if !last.is_empty() => format!("{r:?}: {what} ({last})"),
        _ => format!("{r:?}: {what}"),
    })
}

struct State {
    /// `None` once aborted or destroyed.
    comm: Option<Raw>,
    /// Why the communicator was aborted (by a failed call or [`Collective::abort`]).
    failed: Option<String>,
    /// An operation holds `comm` now: [`Collective::abort`] leaves the abort to it.
    busy: bool,
}

/// One rank's NCCL communicator on its [`CudaBackend`]'s GPU.
pub struct NcclComm {
    state: Mutex<State>,
    /// The GPU's context, made current to destroy the communicator on any thread.
    ctx: std::sync::Arc<cudarc::driver::CudaContext>,
    rank: usize,
    world: usize,
    ordinal: usize,
    timeout: Duration,
}

impl NcclComm {
    /// Joins the communicator named by `id` as rank `rank` of `world`, on `be`'s GPU, with
    /// `timeout` for the join and for every later operation. All ranks call this at about
    /// the same time (in one process, from one thread per rank); a rank that does not come
    /// makes the others fail after `timeout` (a join that hangs is left behind on its
    /// thread: the job is expected to end).
    pub fn new(
        be: &CudaBackend,
        id: &NcclId,
        rank: usize,
        world: usize,
        timeout: Duration,
    ) -> Result<Self> {
        loaded()?;
        if world == 0 || rank >= world {
            return Err(Error::Device(format!(
                "NCCL: rank {rank} of a group of {world}"
            )));
        }
        let ctx = be.dev.ctx.clone();
        let internal = id.0.map(|b| b as std::ffi::c_char);
        let (tx, rx) = std::sync::mpsc::channel();
        // The join blocks until every rank has joined: on a thread of its own, so that a
        // missing rank ends in an error here.
        std::thread::Builder::new()
            .name(format!("nccl-join-{rank}"))
            .spawn(move || {
                let joined = ctx
                    .bind_to_thread()
                    .map_err(|e| e.to_string())
                    .and_then(|_| {
                        let mut comm: nccl::ncclComm_t = std::ptr::null_mut();
                        let id = nccl::ncclUniqueId { internal };
                        // SAFETY: `comm` is a valid out-pointer; the GPU's context is current,
                        // which is the device NCCL binds the communicator to.
                        let r = unsafe {
                            nccl::ncclCommInitRank(&mut comm, world as i32, id, rank as i32)
                        };
                        result(r, None).map(|()| Raw(comm))
                    });
                let _ = tx.send(joined);
            })
            .map_err(|e| Error::Device(format!("NCCL join: no thread: {e}")))?;
        let comm = match rx.recv_timeout(timeout) {
            Ok(Ok(comm)) => comm,
            Ok(Err(e)) => {
                return Err(Error::Device(format!(
                    "NCCL join (rank {rank} of {world}, GPU {}): {e}",
                    be.ordinal
                )))
            }
            Err(_) => {
                return Err(Error::Device(format!(
                    "NCCL join (rank {rank} of {world}, GPU {}): the other ranks did not \
                     join within {timeout:?}",
                    be.ordinal
                )))
            }
        };
        Ok(Self {
            ctx: be.dev.ctx.clone(),
            state: Mutex::new(State {
                comm: Some(comm),
                failed: None,
                busy: false,
            }),
            rank,
            world,
            ordinal: be.ordinal,
            timeout,
        })
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// An error naming the operation and this rank.
    fn error(&self, op: &str, detail: impl std::fmt::Display) -> Error {
        Error::Device(format!(
            "NCCL {op} (rank {} of {}, GPU {}): {detail}",
            self.rank, self.world, self.ordinal
        ))
    }

    /// Aborts the communicator (held by the caller), records `why` and returns the error.
    fn fail(&self, op: &str, why: String) -> Error {
        let mut st = self.lock();
        if let Some(c) = st.comm.take() {
            // SAFETY: the caller holds the handle (`busy`), so no other call uses it; abort
            // ends its kernels and frees it.
            unsafe { nccl::ncclCommAbort(c.0) };
        }
        st.busy = false;
        let e = self.error(op, &why);
        st.failed.get_or_insert_with(|| e.to_string());
        e
    }

    /// Runs `f` with the communicator on `be`'s stream, after the pass's recorded work, and
    /// waits for the stream; any failure aborts the communicator.
    fn run<R>(
        &self,
        be: &CudaBackend,
        op: &'static str,
        f: impl FnOnce(&Step) -> std::result::Result<R, String>,
    ) -> Result<R> {
        be.dev.enter(op)?;
        // NCCL's calls are queued directly on the stream: what a recorded pass (CUDA graphs)
        // holds so far must be queued first (the pass then runs op by op).
        be.dev.flush(op)?;
        let comm = {
            let mut st = self.lock();
            match (&st.failed, st.comm) {
                (Some(why), _) => return Err(self.error(op, format!("aborted earlier: {why}"))),
                (None, None) => return Err(self.error(op, "the communicator is closed")),
                (None, Some(c)) => {
                    st.busy = true;
                    c
                }
            }
        };
        let step = Step {
            comm,
            stream: be.dev.stream.cu_stream(),
        };
        let out = f(&step).and_then(|r| self.wait(&step).map(|()| r));
        match out {
            Ok(r) => {
                let mut st = self.lock();
                st.busy = false;
                if let Some(why) = st.failed.clone() {
                    // `abort` came while this call held the communicator.
                    drop(st);
                    return Err(self.fail(op, why));
                }
                Ok(r)
            }
            Err(why) => Err(self.fail(op, why)),
        }
    }

    /// Waits until the stream has run the queued work, polling NCCL's asynchronous error,
    /// an abort from another thread and the deadline.
    fn wait(&self, step: &Step) -> std::result::Result<(), String> {
        let deadline = Instant::now() + self.timeout;
        let mut polls = 0u32;
        loop {
            // SAFETY: the backend's live stream.
            match unsafe { cu::cuStreamQuery(step.stream) } {
                cu::CUresult::CUDA_SUCCESS => return Ok(()),
                cu::CUresult::CUDA_ERROR_NOT_READY => {}
                e => return Err(format!("the stream failed: {e:?}")),
            }
            let mut async_err = ncclSuccess;
            // SAFETY: a live communicator held by this call; a valid out-pointer.
            let r = unsafe { nccl::ncclCommGetAsyncError(step.comm.0, &mut async_err) };
            result(r, Some(step.comm))?;
            if async_err != ncclSuccess && async_err != ncclInProgress {
                return Err(format!(
                    "a rank failed: {}",
                    result(async_err, Some(step.comm)).err().unwrap_or_default()
                ));
            }
            if let Some(why) = self.lock().failed.clone() {
                return Err(format!("aborted: {why}"));
            }
            if Instant::now() >= deadline {
                return Err(format!(
                    "timed out after {:?} waiting for the other ranks (a rank died or did \
                     not call this operation)",
                    self.timeout
                ));
            }
            polls += 1;
            if polls < 2000 {
                std::thread::yield_now();
            } else {
                std::thread::sleep(Duration::from_micros(50));
            }
        }
    }

    /// Every rank's `mine` (the same length on every rank), by rank: the row counts of the
    /// variable-size operations.
    fn gather_counts(
        &self,
        be: &CudaBackend,
        step: &Step,
        op: &'static str,
        mine: &[u64],
    ) -> std::result::Result<Vec<Vec<u64>>, String> {
        let bytes: Vec<u8> = mine.iter().flat_map(|v| v.to_le_bytes()).collect();
        let send = be.dev.upload_kept(&bytes, op).map_err(|e| e.to_string())?;
        let recv = be
            .dev
            .alloc(bytes.len() * self.world, op)
            .map_err(|e| e.to_string())?;
        step.call(|c, s| {
            // SAFETY: both buffers are live for the call and the wait below; `recv` holds
            // `world` times `mine.len()` u64.
            unsafe {
                nccl::ncclAllGather(
                    send.ptr() as *const _,
                    recv.ptr() as *mut _,
                    mine.len(),
                    nccl::ncclDataType_t::ncclUint64,
                    c,
                    s,
                )
            }
        })?;
        self.wait(step)?;
        let mut out = vec![0u8; bytes.len() * self.world];
        // SAFETY: `recv` holds `out.len()` bytes, written by the gather waited for above.
        unsafe { be.dev.read(recv.ptr(), &mut out, op) }.map_err(|e| e.to_string())?;
        Ok(out
            .chunks(bytes.len().max(1))
            .map(|r| {
                r.chunks_exact(8)
                    .map(|b| u64::from_le_bytes(b.try_into().unwrap_or([0; 8])))
                    .collect()
            })
            .collect())
    }

    /// `t`'s values stacked with every rank's (rank 0 first), each `counts[r]` f32, into a
    /// new buffer: one all-gather where the counts agree, else one broadcast per rank.
    fn gather_flat(
        &self,
        step: &Step,
        t: &CudaTensor,
        counts: &[usize],
        out: &CudaTensor,
    ) -> std::result::Result<(), String> {
        let f32 = nccl::ncclDataType_t::ncclFloat32;
        if counts.iter().all(|&c| c == counts[0]) {
            if counts[0] == 0 {
                return Ok(());
            }
            return step.call(|c, s| {
                // SAFETY: `t` holds counts[0] f32 and `out` world times that.
                unsafe {
                    nccl::ncclAllGather(
                        t.ptr() as *const _,
                        out.ptr() as *mut _,
                        counts[0],
                        f32,
                        c,
                        s,
                    )
                }
            });
        }
        step.group(|| {
            let mut offset = 0usize;
            for (root, &n) in counts.iter().enumerate() {
                if n > 0 {
                    let dst = out.ptr() + 4 * offset as u64;
                    step.call(|c, s| {
                        // SAFETY: the root's `t` holds `n` f32 (others do not read it);
                        // `dst` has room for them inside `out`.
                        unsafe {
                            nccl::ncclBroadcast(
                                t.ptr() as *const _,
                                dst as *mut _,
                                n,
                                f32,
                                root as i32,
                                c,
                                s,
                            )
                        }
                    })?;
                }
                offset += n;
            }
            Ok(())
        })
    }
}

impl Drop for NcclComm {
    fn drop(&mut self) {
        let _ = self.ctx.bind_to_thread();
        let st = self.state.get_mut().unwrap_or_else(PoisonError::into_inner);
        if let Some(c) = st.comm.take() {
            // SAFETY: no operation holds the handle (we own `self`); every operation waited
            // for its work, so nothing of the communicator is pending.
            unsafe { nccl::ncclCommDestroy(c.0) };
        }
    }
}

/// One operation's communicator and stream.
struct Step {
    comm: Raw,
    stream: cu::CUstream,
}

impl Step {
    /// One NCCL call, its failure as NCCL's message.
    fn call(
        &self,
        f: impl FnOnce(nccl::ncclComm_t, nccl::cudaStream_t) -> nccl::ncclResult_t,
    ) -> std::result::Result<(), String> {
        let r = f(self.comm.0, self.stream.cast());
        // Non-blocking communicators answer InProgress; ours are blocking, but either
        // means the call was queued.
        if r == ncclInProgress {
            return Ok(());
        }
        result(r, Some(self.comm))
    }

    /// `f`'s calls as one NCCL group (point-to-point calls of one exchange must be).
    fn group<R>(
        &self,
        f: impl FnOnce() -> std::result::Result<R, String>,
    ) -> std::result::Result<R, String> {
        // SAFETY: group calls only mark this thread's NCCL calls as one launch.
        result(unsafe { nccl::ncclGroupStart() }, Some(self.comm))?;
        let out = f();
        // The group is closed even after a failed call, so the thread's group depth stays 0.
        // SAFETY: as above.
        let end = self.call(|_, _| unsafe { nccl::ncclGroupEnd() });
        let out = out?;
        end.map(|()| out)
    }
}

const F32: nccl::ncclDataType_t = nccl::ncclDataType_t::ncclFloat32;
const SUM: nccl::ncclRedOp_t = nccl::ncclRedOp_t::ncclSum;

/// `[rows, cols]` with leading dimensions folded into rows (a scalar is one value).
fn rows_cols(t: &CudaTensor) -> (usize, usize) {
    t.rows_cols().unwrap_or((1, 1))
}

/// Collectives move f32 activations only.
fn f32_only(op: &str, t: &CudaTensor) -> Result<()> {
    match t.dtype {
        DType::F32 => Ok(()),
        other => Err(Error::Unsupported(format!("NCCL {op} of a {other} tensor"))),
    }
}

/// A new f32 tensor of `shape` for the closure of [`NcclComm::run`].
fn empty(
    be: &CudaBackend,
    shape: &[usize],
    op: &'static str,
) -> std::result::Result<CudaTensor, String> {
    be.empty(shape, DType::F32, op).map_err(|e| e.to_string())
}

/// Copies a `[rows, width]` f32 block at `src` into columns `col..col + width` of the
/// `[rows, dst_cols]` matrix at `dst`, in stream order.
///
/// # Safety
/// Both regions are live device memory of those sizes.
unsafe fn copy_cols(
    stream: cu::CUstream,
    src: u64,
    dst: u64,
    (rows, width): (usize, usize),
    (col, dst_cols): (usize, usize),
) -> std::result::Result<(), String> {
    if rows == 0 || width == 0 {
        return Ok(());
    }
    let device = cu::CUmemorytype::CU_MEMORYTYPE_DEVICE;
    let copy = cu::CUDA_MEMCPY2D {
        srcXInBytes: 0,
        srcY: 0,
        srcMemoryType: device,
        srcHost: std::ptr::null(),
        srcDevice: src,
        srcArray: std::ptr::null_mut(),
        srcPitch: width * 4,
        dstXInBytes: col * 4,
        dstY: 0,
        dstMemoryType: device,
        dstHost: std::ptr::null_mut(),
        dstDevice: dst,
        dstArray: std::ptr::null_mut(),
        dstPitch: dst_cols * 4,
        WidthInBytes: width * 4,
        Height: rows,
    };
    // SAFETY: the caller's contract; `copy` lives through the call (the driver reads it
    // before returning).
    unsafe { cu::cuMemcpy2DAsync_v2(&copy, stream) }
        .result()
        .map_err(|e| format!("column copy: {e}"))
}

impl Collective<CudaBackend> for NcclComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world(&self) -> usize {
        self.world
    }

    fn all_reduce_sum(&self, be: &CudaBackend, t: &mut CudaTensor) -> Result<()> {
        const OP: &str = "all_reduce_sum";
        f32_only(OP, t)?;
        be.dev.enter(OP)?;
        // Out of place: `t` may share its buffer with other tensors (views).
        let out = be.empty(&t.shape, DType::F32, OP)?;
        let n = t.len();
        if n > 0 {
            self.run(be, OP, |step| {
                step.call(|c, s| {
                    // SAFETY: `t` and `out` hold `n` f32 each, live through the wait.
                    unsafe {
                        nccl::ncclAllReduce(
                            t.ptr() as *const _,
                            out.ptr() as *mut _,
                            n,
                            F32,
                            SUM,
                            c,
                            s,
                        )
                    }
                })
            })?;
        }
        *t = out;
        Ok(())
    }

    fn all_gather_cols(&self, be: &CudaBackend, t: &CudaTensor) -> Result<CudaTensor> {
        const OP: &str = "all_gather_cols";
        f32_only(OP, t)?;
        be.dev.enter(OP)?;
        let (rows, cols) = rows_cols(t);
        self.run(be, OP, |step| {
            let all = self.gather_counts(be, step, OP, &[rows as u64, cols as u64])?;
            if let Some(r) = all.iter().position(|m| m[0] as usize != rows) {
                return Err(format!(
                    "rank {} passed {rows} rows, rank {r} {}",
                    self.rank, all[r][0]
                ));
            }
            let widths: Vec<usize> = all.iter().map(|m| m[1] as usize).collect();
            let total: usize = widths.iter().sum();
            // Gathered by rank (each rank's block contiguous), then laid side by side.
            let flat = empty(be, &[rows * total], OP)?;
            let counts: Vec<usize> = widths.iter().map(|w| rows * w).collect();
            self.gather_flat(step, t, &counts, &flat)?;
            let out = empty(be, &[rows, total], OP)?;
            let (mut col, mut offset) = (0, 0);
            for &w in &widths {
                // SAFETY: rank r's block is `[rows, w]` at `offset` in `flat`; `out` is
                // `[rows, total]` with `col + w <= total`.
                unsafe {
                    copy_cols(
                        step.stream,
                        flat.ptr() + 4 * offset as u64,
                        out.ptr(),
                        (rows, w),
                        (col, total),
                    )?;
                }
                col += w;
                offset += rows * w;
            }
            Ok(out)
        })
    }

    fn all_gather_rows(&self, be: &CudaBackend, t: &CudaTensor) -> Result<CudaTensor> {
        const OP: &str = "all_gather_rows";
        f32_only(OP, t)?;
        be.dev.enter(OP)?;
        let (rows, cols) = rows_cols(t);
        self.run(be, OP, |step| {
            let all = self.gather_counts(be, step, OP, &[rows as u64, cols as u64])?;
            if let Some(r) = all.iter().position(|m| m[1] as usize != cols) {
                return Err(format!(
                    "rank {} passed {cols} columns, rank {r} {}",
                    self.rank, all[r][1]
                ));
            }
            let total: usize = all.iter().map(|m| m[0] as usize).sum();
            let out = empty(be, &[total, cols], OP)?;
            let counts: Vec<usize> = all.iter().map(|m| m[0] as usize * cols).collect();
            self.gather_flat(step, t, &counts, &out)?;
            Ok(out)
        })
    }

    fn reduce_scatter_rows(&self, be: &CudaBackend, t: &CudaTensor) -> Result<CudaTensor> {
        const OP: &str = "reduce_scatter_rows";
        f32_only(OP, t)?;
        be.dev.enter(OP)?;
        let (rows, cols) = rows_cols(t);
        if !rows.is_multiple_of(self.world) {
            return Err(Error::Shape {
                op: "collective",
                detail: format!("{OP}: {rows} rows do not split over {} ranks", self.world),
            });
        }
        let share = rows / self.world;
        let out = be.empty(&[share, cols], DType::F32, OP)?;
        if share * cols > 0 {
            self.run(be, OP, |step| {
                step.call(|c, s| {
                    // SAFETY: `t` holds world * share * cols f32, `out` share * cols.
                    unsafe {
                        nccl::ncclReduceScatter(
                            t.ptr() as *const _,
                            out.ptr() as *mut _,
                            share * cols,
                            F32,
                            SUM,
                            c,
                            s,
                        )
                    }
                })
            })?;
        }
        Ok(out)
    }

    fn all_to_all_rows(&self, be: &CudaBackend, parts: &[CudaTensor]) -> Result<Vec<CudaTensor>> {
        const OP: &str = "all_to_all_rows";
        if parts.len() != self.world {
            return Err(Error::Shape {
                op: "collective",
                detail: format!("{OP}: {} parts for {} ranks", parts.len(), self.world),
            });
        }
        let mut cols = None;
        let mut mine = vec![0u64];
        for p in parts {
            f32_only(OP, p)?;
            let (r, c) = rows_cols(p);
            if *cols.get_or_insert(c) != c && r > 0 {
                return Err(Error::Shape {
                    op: "collective",
                    detail: format!("{OP}: parts of {} and {c} columns", cols.unwrap_or(c)),
                });
            }
            mine.push(r as u64);
        }
        let cols = cols.unwrap_or(0);
        mine[0] = cols as u64;
        be.dev.enter(OP)?;
        let rank = self.rank;
        self.run(be, OP, |step| {
            // Row counts by sender: all[i] = [cols, rows to rank 0, rows to rank 1, ...].
            let all = self.gather_counts(be, step, OP, &mine)?;
            let from: Vec<usize> = all.iter().map(|m| m[1 + rank] as usize).collect();
            if let Some(i) = (0..self.world).find(|&i| from[i] > 0 && all[i][0] as usize != cols) {
                return Err(format!(
                    "rank {rank} takes {cols} columns, rank {i} sends {}",
                    all[i][0]
                ));
            }
            let outs = from
                .iter()
                .map(|&n| empty(be, &[n, cols], OP))
                .collect::<std::result::Result<Vec<_>, _>>()?;
            let own = from[rank] * cols * 4;
            if own > 0 {
                // SAFETY: this rank's part and its output hold `own` bytes each.
                unsafe {
                    cu::cuMemcpyDtoDAsync_v2(outs[rank].ptr(), parts[rank].ptr(), own, step.stream)
                }
                .result()
                .map_err(|e| format!("copy of the own part: {e}"))?;
            }
            step.group(|| {
                for (peer, p) in parts.iter().enumerate() {
                    let n = p.len();
                    if peer != rank && n > 0 {
                        step.call(|c, s| {
                            // SAFETY: `p` holds `n` f32, live through the wait.
                            unsafe {
                                nccl::ncclSend(p.ptr() as *const _, n, F32, peer as i32, c, s)
                            }
                        })?;
                    }
                }
                for (peer, o) in outs.iter().enumerate() {
                    let n = o.len();
                    if peer != rank && n > 0 {
                        step.call(|c, s| {
                            // SAFETY: `o` has room for the `n` f32 the peer sends.
                            unsafe { nccl::ncclRecv(o.ptr() as *mut _, n, F32, peer as i32, c, s) }
                        })?;
                    }
                }
                Ok(())
            })?;
            Ok(outs)
        })
    }

    fn broadcast(&self, be: &CudaBackend, t: &mut CudaTensor, root: usize) -> Result<()> {
        const OP: &str = "broadcast";
        if root >= self.world {
            return Err(Error::Shape {
                op: "collective",
                detail: format!("{OP}: root {root} of {} ranks", self.world),
            });
        }
        f32_only(OP, t)?;
        be.dev.enter(OP)?;
        let out = be.empty(&t.shape, DType::F32, OP)?;
        let n = t.len();
        if n > 0 {
            self.run(be, OP, |step| {
                step.call(|c, s| {
                    // SAFETY: `t` and `out` hold `n` f32 each.
                    unsafe {
                        nccl::ncclBroadcast(
                            t.ptr() as *const _,
                            out.ptr() as *mut _,
                            n,
                            F32,
                            root as i32,
                            c,
                            s,
                        )
                    }
                })
            })?;
        }
        *t = out;
        Ok(())
    }

    fn abort(&self, reason: &str) {
        let mut st = self.lock();
        st.failed
            .get_or_insert_with(|| format!("rank {}: {reason}", self.rank));
        if !st.busy {
            if let Some(c) = st.comm.take() {
                // SAFETY: no operation holds the handle (not busy, and the lock is held).
                unsafe { nccl::ncclCommAbort(c.0) };
            }
        }
    }
}
