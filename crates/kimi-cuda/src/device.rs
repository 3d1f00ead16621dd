//! The device: one CUDA context and stream, a cuBLAS handle and the embedded kernels.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use cudarc::cublas::CudaBlas;
use cudarc::driver::sys::CUfunction_attribute_enum;
use cudarc::driver::{CudaContext, CudaFunction, CudaStream, DriverError, LaunchConfig};
use cudarc::nvrtc::Ptx;
use kimi_ops::Result;

mod transfer;

use transfer::AheadCopies;

use crate::buffer::{Arena, DevBuf};
use crate::error::{Error, OpContext};
use crate::graph::{self, Args, GraphCache, KernelOp, Op, Outcome};
pub(crate) use crate::plan::MAX_DYNAMIC_SMEM_BYTES;
use crate::plan::{KernelConfig, LAYER_SMEM_BYTES};

/// The one-launch MoE layers, whose limit is above the others' (`LAYER_SMEM_BYTES`).
const LAYER_KERNELS: &[&str] = &["moe_stream_layer", "moe_int4_stream_layer"];

/// Kernels that get the large dynamic shared memory limit.
const BIG_SMEM_KERNELS: &[&str] = &[
    "mla_flash_prefill",
    "mla_flash_prefill_vec",
    "mla_flash_prefill_mma",
    "mla_decode_partial",
    "mla_decode_partial_vec",
    "mla_decode_partial_fp8",
    "mla_decode_partial_fp8_vec",
    "moe_route",
    "moe_mma_64_half",
    "moe_mma_64_split",
    "moe_mma_128_half",
    "moe_mma_128_split",
    "kda_chunk_prep_64",
    "kda_chunk_prep_128",
    "kda_chunk_state_64",
    "kda_chunk_state_128",
    "sample_rows",
    "kda_chunk_prep_mma_64",
    "kda_chunk_prep_mma_128",
    "kda_chunk_mma_64_split",
    "kda_chunk_mma_64_half",
    "kda_chunk_mma_128_split",
    "kda_chunk_mma_128_half",
    "kda_chunk_prep_blk_64",
    "kda_chunk_prep_blk_128",
    "gemv_stream_1",
    "moe_stream_1",
    "quant_gemv_int4_stream_1",
    // A 48 KiB weight tile plus the kernel's static shared memory is over the default limit
    // (rows of 3072 or 6144 bf16: Kimi K3's shared experts).
    "gemv_bulk_1",
    "gemv_bulk_4",
    "gemv_bulk_8",
];

/// Sets the release threshold of the device's default memory pool, which serves every
/// stream-ordered allocation (`cuMemAllocAsync`): with `keep`, freed memory stays in the
/// pool, so the buffers of a decode step are carved out of memory the pool already holds;
/// without it (the driver's default, threshold 0) the pool returns its free memory to the
/// driver at every synchronisation (each step's token read-back), and the next step maps it
/// again.
fn pool_keeps_memory(ctx: &CudaContext, keep: bool) -> Result<()> {
    use cudarc::driver::sys;
    let pool = default_pool(ctx)?;
    let mut threshold: u64 = if keep { u64::MAX } else { 0 };
    // SAFETY: the release threshold attribute takes a pointer to a u64 (cuuint64_t).
    unsafe {
        sys::cuMemPoolSetAttribute(
            pool,
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
            (&mut threshold as *mut u64).cast(),
        )
    }
    .result()
    .op("memory pool")
}

/// The device's default memory pool, which serves every stream-ordered allocation.
fn default_pool(ctx: &CudaContext) -> Result<cudarc::driver::sys::CUmemoryPool> {
    use cudarc::driver::sys;
    let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
    // SAFETY: `pool` is a valid out-pointer and the device handle comes from a live context.
    unsafe { sys::cuDeviceGetDefaultMemPool(&mut pool, ctx.cu_device()) }
        .result()
        .op("memory pool")?;
    Ok(pool)
}

/// A u64 attribute of the default memory pool.
fn pool_attribute(
    ctx: &CudaContext,
    attr: cudarc::driver::sys::CUmemPool_attribute,
) -> Result<u64> {
    let pool = default_pool(ctx)?;
    let mut value: u64 = 0;
    // SAFETY: the used-memory attributes are u64 (cuuint64_t) values.
    unsafe {
        cudarc::driver::sys::cuMemPoolGetAttribute(pool, attr, (&mut value as *mut u64).cast())
    }
    .result()
    .op("memory pool")?;
    Ok(value)
}

/// One GPU: context, the stream every operation runs on, cuBLAS, the kernel table and the
/// state of recorded passes (arena and CUDA graphs, see `graph.rs`).
pub(crate) struct Device {
    pub(crate) ctx: Arc<CudaContext>,
    pub(crate) stream: Arc<CudaStream>,
    pub(crate) blas: CudaBlas,
    functions: HashMap<&'static str, CudaFunction>,
    /// Whether decode passes run through CUDA graphs (`KernelConfig::cuda_graphs`).
    graphs_on: AtomicBool,
    /// Whether kernels launch with programmatic stream serialization, so that a kernel's
    /// blocks start while its predecessor drains (`pdl_wait` in `kernels/common.cuh`;
    /// `KernelConfig::pdl`). Read at every launch, hence an atomic beside the backend's
    /// configuration.
    pdl_on: AtomicBool,
    /// MiB of the pass arena (`KernelConfig::graph_arena_mb`), read when it is made.
    arena_mb: AtomicUsize,
    /// The pass arena, made on the first recorded pass; `Err` once it could not be made.
    arena: Mutex<Option<std::result::Result<Arc<Arena>, ()>>>,
    graphs: Mutex<GraphCache>,
    /// Counts of how recorded passes reached the GPU: eager, captured, replayed.
    pub(crate) pass_counts: Mutex<[u64; 3]>,
    /// Streaming multiprocessors: persistent kernels size their grids by it.
    pub(crate) sm_count: usize,
    /// The stream of expert slot copies made ahead of their layer, beside `stream`.
    ahead: AheadCopies,
}

impl Device {
    /// Opens GPU `ordinal` with `config`'s launch settings (CUDA graphs, programmatic
    /// launch, the memory pool's release, the pass arena's size).
    pub(crate) fn new(ordinal: usize, config: &KernelConfig) -> Result<Self> {
        // cudarc panics on first use of a library it cannot dlopen; look first.
        // SAFETY: only tries to dlopen the candidate names, running no library code.
        if !unsafe { cudarc::driver::sys::is_culib_present() } {
            return Err(kimi_ops::Error::Unsupported(
                "CUDA without an NVIDIA driver (no libcuda.so found)".into(),
            ));
        }
        // SAFETY: as above.
        if !unsafe { cudarc::cublas::sys::is_culib_present() } {
            return Err(kimi_ops::Error::Unsupported(
                "CUDA without cuBLAS (no libcublas.so.13 on LD_LIBRARY_PATH)".into(),
            ));
        }
        let ctx = CudaContext::new(ordinal).op("init")?;
        // SAFETY: called before any allocation or launch on this context; every operation
        // runs on the one stream below, so stream order alone keeps buffers consistent.
        unsafe { ctx.disable_event_tracking() };
        // A stream of our own: the legacy default stream cannot be captured into a graph.
        let stream = ctx.new_stream().op("init")?;
        let blas = CudaBlas::new(stream.clone()).op("init cuBLAS")?;
        let ahead = AheadCopies::new(&ctx)?;
        let mut functions = HashMap::new();
        for (module, names) in crate::kernel_list::KERNELS {
            let cubin = kimi_cuda_kernels::cubin(module).ok_or_else(|| Error::MissingKernel {
                op: "init",
                name: (*module).to_string(),
            })?;
            let m = ctx
                .load_module(Ptx::from_binary(cubin.to_vec()))
                .op("load kernels")?;
            for name in *names {
                let f = m.load_function(name).op("load kernel")?;
                let smem_limit = if LAYER_KERNELS.contains(name) {
                    Some(LAYER_SMEM_BYTES)
                } else {
                    BIG_SMEM_KERNELS
                        .contains(name)
                        .then_some(MAX_DYNAMIC_SMEM_BYTES)
                };
                if let Some(limit) = smem_limit {
                    f.set_attribute(
                        CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                        limit as i32,
                    )
                    .op("set kernel attribute")?;
                }
                functions.insert(*name, f);
            }
        }
        pool_keeps_memory(&ctx, config.pool_keeps_memory)?;
        let sm_count = ctx
            .attribute(
                cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
            )
            .op("init")?
            .max(1) as usize;
        Ok(Self {
            ctx,
            stream,
            blas,
            functions,
            graphs_on: AtomicBool::new(config.cuda_graphs),
            pdl_on: AtomicBool::new(config.pdl),
            arena_mb: AtomicUsize::new(config.graph_arena_mb),
            arena: Mutex::new(None),
            graphs: Mutex::new(GraphCache::new()),
            pass_counts: Mutex::new([0; 3]),
            sm_count,
            ahead,
        })
    }

    /// Whether freed stream-ordered memory stays in the device's pool (see
    /// [`pool_keeps_memory`]).
    pub(crate) fn set_pool_keeps_memory(&self, keep: bool) -> Result<()> {
        self.enter("memory pool")?;
        pool_keeps_memory(&self.ctx, keep)
    }

    /// Bytes of the default pool in use now and at most since the last
    /// [`Device::reset_pool_peak`] (weights and caches included: they come from the pool).
    pub(crate) fn pool_used(&self) -> Result<(u64, u64)> {
        use cudarc::driver::sys::CUmemPool_attribute as A;
        self.enter("memory pool")?;
        Ok((
            pool_attribute(&self.ctx, A::CU_MEMPOOL_ATTR_USED_MEM_CURRENT)?,
            pool_attribute(&self.ctx, A::CU_MEMPOOL_ATTR_USED_MEM_HIGH)?,
        ))
    }

    /// Starts a new peak for [`Device::pool_used`].
    pub(crate) fn reset_pool_peak(&self) -> Result<()> {
        self.enter("memory pool")?;
        let pool = default_pool(&self.ctx)?;
        let mut zero: u64 = 0;
        // SAFETY: the high-water attribute takes a u64, and 0 is the only value allowed.
        unsafe {
            cudarc::driver::sys::cuMemPoolSetAttribute(
                pool,
                cudarc::driver::sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_HIGH,
                (&mut zero as *mut u64).cast(),
            )
        }
        .result()
        .op("memory pool")
    }

    /// Hands the pool's unused memory back to the driver (after the queued work is done).
    pub(crate) fn trim_pool(&self) -> Result<()> {
        self.synchronize("memory pool")?;
        let pool = default_pool(&self.ctx)?;
        // SAFETY: trimming only releases memory no allocation holds.
        unsafe { cudarc::driver::sys::cuMemPoolTrimTo(pool, 0) }
            .result()
            .op("memory pool")
    }

    /// Makes the context current on the calling thread.
    pub(crate) fn enter(&self, op: &'static str) -> Result<()> {
        self.ctx.bind_to_thread().op(op)
    }

    /// A launch builder for kernel `name`.
    pub(crate) fn kernel(&self, op: &'static str, name: &str) -> Result<Launch<'_>> {
        let f = self
            .functions
            .get(name)
            .ok_or_else(|| Error::MissingKernel {
                op,
                name: name.to_string(),
            })?;
        Ok(Launch {
            dev: self,
            func: f.cu_function() as usize,
            args: Args::default(),
        })
    }

    fn blas_handle(&self) -> graph::sys_blas::Handle {
        graph::sys_blas::Handle(*self.blas.handle())
    }

    /// Queues `op` now, or records it inside a recorded pass.
    ///
    /// # Safety
    /// As [`graph::issue`]: the op's addresses are live buffers of the sizes it uses.
    pub(crate) unsafe fn submit(&self, op: Op) -> std::result::Result<(), DriverError> {
        match graph::record(self.stream.cu_stream(), op) {
            None => Ok(()),
            // SAFETY: the caller's contract; eager ops carry no uploads.
            Some(op) => unsafe {
                graph::issue(
                    &op,
                    self.stream.cu_stream(),
                    std::ptr::null(),
                    self.blas_handle(),
                )
            },
        }
    }

    /// An uninitialised buffer of at least `bytes` (every reader's producer writes it):
    /// from the pass arena inside a recorded pass, else from the stream-ordered pool.
    pub(crate) fn alloc(&self, bytes: usize, op: &'static str) -> Result<DevBuf> {
        if graph::recording(self.stream.cu_stream()) {
            let arena = self
                .arena
                .lock()
                .ok()
                .and_then(|a| a.as_ref().and_then(|r| r.as_ref().ok().cloned()));
            if let Some(b) = arena.and_then(|a| a.take(bytes)) {
                return Ok(b);
            }
            // A full arena: this pass gets pool memory and is issued op by op.
            graph::spoil();
        }
        // SAFETY: see the doc comment; spare capacity is never read.
        let s = unsafe { self.stream.alloc::<u8>(bytes.max(4)) }.op(op)?;
        Ok(DevBuf::from_pool(s))
    }

    /// A buffer of `bytes` zero bytes.
    pub(crate) fn alloc_zeros(&self, bytes: usize, op: &'static str) -> Result<DevBuf> {
        let b = self.alloc(bytes, op)?;
        // SAFETY: `b` holds at least `bytes` bytes.
        unsafe { self.zero(b.ptr(), bytes.max(4).min(b.len()), op)? };
        Ok(b)
    }

    /// Sets `len` bytes at `dst` to zero, in stream order.
    ///
    /// # Safety
    /// `dst` points at `len` bytes of live device memory.
    pub(crate) unsafe fn zero(&self, dst: u64, len: usize, op: &'static str) -> Result<()> {
        // SAFETY: the caller's contract.
        unsafe { self.submit(Op::Zero { dst, len }) }.op(op)
    }

    /// A device copy of `bytes`, for the current pass (token ids, tables): inside a
    /// recorded pass staged so that a replayed graph reads the new values.
    pub(crate) fn upload(&self, bytes: &[u8], op: &'static str) -> Result<DevBuf> {
        let stream = self.stream.cu_stream();
        if graph::recording(stream) {
            let b = self.alloc(bytes.len(), op)?;
            if graph::record_upload(stream, b.ptr(), bytes) {
                return Ok(b);
            }
        }
        self.upload_kept(bytes, op)
    }

    /// A device copy of `bytes` that may outlive the current pass (weights, tables kept
    /// across passes): always from the pool, copied now.
    pub(crate) fn upload_kept(&self, bytes: &[u8], op: &'static str) -> Result<DevBuf> {
        if bytes.is_empty() {
            // SAFETY: nothing reads an empty buffer.
            let s = unsafe { self.stream.alloc::<u8>(4) }.op(op)?;
            return Ok(DevBuf::from_pool(s));
        }
        let s = self.stream.clone_htod(bytes).op(op)?;
        Ok(DevBuf::from_pool(s))
    }

    /// Queues what the current pass has recorded so far (a read-back needs the results):
    /// as a segment of the pass through its own graph where the pass is replayed, else op by
    /// op (and the rest of the pass too).
    pub(crate) fn flush(&self, op: &'static str) -> Result<()> {
        let stream = self.stream.cu_stream();
        match graph::take_segment(stream) {
            None => {}
            Some((Some(key), rec)) => {
                let mut cache = self
                    .graphs
                    .lock()
                    .map_err(|_| kimi_ops::Error::Device("graph cache lock poisoned".into()))?;
                // SAFETY: recorded by this pass, whose buffers are alive (the arena's blocks
                // until the pass ends, pool buffers kept with the segment until queued); the
                // pass began on an idle stream and queues each segment key once.
                let outcome = unsafe { cache.run(key, rec, stream, self.blas_handle()) }.op(op)?;
                self.count_pass(outcome);
            }
            Some((None, rec)) => {
                for o in &rec.ops {
                    // SAFETY: as above.
                    unsafe { graph::issue(o, stream, rec.staging.as_ptr(), self.blas_handle()) }
                        .op(op)?;
                }
            }
        }
        Ok(())
    }

    /// Runs `f` outside the pass being recorded (if any): what it launches is queued at
    /// once, after the pass's recorded ops, and what it allocates comes from the pool.
    pub(crate) fn outside_pass<R>(
        &self,
        op: &'static str,
        f: impl FnOnce() -> Result<R>,
    ) -> Result<R> {
        if !graph::recording(self.stream.cu_stream()) {
            return f();
        }
        self.flush(op)?;
        let _set_aside = graph::suspend();
        f()
    }

    fn count_pass(&self, outcome: Outcome) {
        if let Ok(mut c) = self.pass_counts.lock() {
            match outcome {
                Outcome::Empty => {}
                Outcome::Eager => c[0] += 1,
                Outcome::Captured => c[1] += 1,
                Outcome::Replayed => c[2] += 1,
            }
        }
    }

    /// Waits for all queued work, after queuing a recorded pass's ops.
    pub(crate) fn synchronize(&self, op: &'static str) -> Result<()> {
        self.flush(op)?;
        self.stream.synchronize().op(op)
    }

    /// Why an existing graph was last captured again, if one was.
    pub(crate) fn last_recapture(&self) -> Option<String> {
        self.graphs.lock().ok()?.last_recapture.clone()
    }

    /// Turns programmatic dependent launch on or off for later launches (a captured graph
    /// whose launches differ is captured again).
    pub(crate) fn set_pdl(&self, on: bool) {
        self.pdl_on.store(on, Ordering::Relaxed);
    }

    /// Turns CUDA graphs for recorded passes on or off.
    pub(crate) fn set_graphs(&self, on: bool) {
        self.graphs_on.store(on, Ordering::Relaxed);
    }

    /// Sets the size of the pass arena, for when it is made (at the first recorded pass).
    pub(crate) fn set_arena_mb(&self, mb: usize) {
        self.arena_mb.store(mb, Ordering::Relaxed);
    }

    /// Makes the pass arena now where CUDA graphs are on, so that a memory plan made from
    /// free memory afterwards (`serve`'s) counts it; otherwise the first recorded pass
    /// makes it, after the cache may already have taken that memory.
    pub(crate) fn reserve_graph_arena(&self) {
        if self.graphs_on.load(Ordering::Relaxed) {
            let _ = self.arena();
        }
    }

    /// The arena, made on first use; `None` if it cannot be.
    fn arena(&self) -> Option<Arc<Arena>> {
        let mut slot = self.arena.lock().ok()?;
        if slot.is_none() {
            let mb = self.arena_mb.load(Ordering::Relaxed);
            // SAFETY: arena blocks are written by their producers before they are read.
            let made = unsafe { self.stream.alloc::<u8>(mb.saturating_mul(1 << 20)) };
            *slot = Some(match made {
                Ok(mem) => Ok(Arc::new(Arena::new(mem))),
                Err(e) => {
                    tracing::warn!("no CUDA graphs: cannot allocate a {mb} MiB pass arena ({e})");
                    Err(())
                }
            });
        }
        slot.as_ref()?.as_ref().ok().cloned()
    }

    /// Runs `f`, one pass of queued work named `key`, recorded and replayed as a CUDA
    /// graph (see `graph.rs`); without a key, with graphs off or inside another pass, `f`
    /// runs as is.
    pub(crate) fn replay_pass<R>(&self, key: Option<u64>, f: impl FnOnce() -> R) -> Result<R> {
        const OP: &str = "replay_pass";
        let Some(key) = key else { return Ok(f()) };
        if !self.graphs_on.load(Ordering::Relaxed) || graph::recording_any() {
            return Ok(f());
        }
        let Some(arena) = self.arena() else {
            return Ok(f());
        };
        // The pinned staging and the arena are reused: the last pass must be done with them.
        self.stream.synchronize().op(OP)?;
        if !arena.reset() {
            // A tensor of an earlier pass is still alive in the arena.
            return Ok(f());
        }
        let stream = self.stream.cu_stream();
        graph::start(stream, key);
        /// Ends the recording if `f` unwinds.
        struct Stop;
        impl Drop for Stop {
            fn drop(&mut self) {
                let _ = graph::stop();
            }
        }
        let guard = Stop;
        let out = f();
        let rec = graph::stop();
        drop(guard);
        let Some((key, rec)) = rec else {
            return Ok(out);
        };
        let mut cache = self
            .graphs
            .lock()
            .map_err(|_| kimi_ops::Error::Device("graph cache lock poisoned".into()))?;
        // SAFETY: the ops were recorded by this pass on this device; the arena blocks they
        // name stay reserved until the next pass, which waits for this one first.
        let outcome = unsafe { cache.run(key, rec, stream, self.blas_handle()) }.op(OP)?;
        drop(cache);
        self.count_pass(outcome);
        Ok(out)
    }
}

/// A kernel launch being built: `dev.kernel(..)?.arg(&x).arg(&n)`, then `launch(cfg)`.
pub(crate) struct Launch<'a> {
    dev: &'a Device,
    func: usize,
    args: Args,
}

impl Launch<'_> {
    /// Appends an argument (by value: the builder copies it).
    pub(crate) fn arg<T: cudarc::driver::DeviceRepr>(&mut self, v: &T) -> &mut Self {
        self.args.push(v);
        self
    }

    /// Queues (or records) the launch.
    ///
    /// # Safety
    /// The arguments match the kernel's parameters, and every buffer they name is live and
    /// large enough for the grid.
    pub(crate) unsafe fn launch(
        &mut self,
        cfg: LaunchConfig,
    ) -> std::result::Result<(), DriverError> {
        let op = Op::Kernel(KernelOp {
            func: self.func,
            grid: cfg.grid_dim,
            block: cfg.block_dim.0,
            smem: cfg.shared_mem_bytes,
            pdl: self.dev.pdl_on.load(Ordering::Relaxed),
            args: std::mem::take(&mut self.args),
        });
        // SAFETY: the caller's contract.
        unsafe { self.dev.submit(op) }
    }
}

/// Grid-stride launch shape for `n` elements.
pub(crate) fn flat(n: usize) -> LaunchConfig {
    let blocks = n.div_ceil(256).clamp(1, 132 * 16) as u32;
    LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// One block of `threads` per grid point.
pub(crate) fn grid(grid_dim: (u32, u32, u32), threads: u32, smem: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim,
        block_dim: (threads, 1, 1),
        shared_mem_bytes: smem,
    }
}
