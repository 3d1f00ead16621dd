//! Recorded passes and their CUDA graphs.
//!
//! A decode step launches ~800 small kernels; launched one by one, the GPU waits on the
//! host between them. Inside [`crate::device::Device::replay_pass`] the backend does not
//! launch anything: every kernel launch, GEMM, upload and memset becomes an [`Op`] in a
//! list, and buffers come from the pass arena (`buffer.rs`), so that the same pass records
//! the same addresses each time. At the end of the pass the list is
//!
//! * captured once per key into a CUDA graph (one stream, so a chain of nodes), or
//! * compared with the captured list: where only kernel arguments or grid sizes changed
//!   (a position, a split count) those nodes are patched in the executable graph, and the
//!   graph is launched: one launch for the whole step;
//! * issued one by one where the pass cannot be replayed (a full arena, a failed capture).
//!
//! A read-back inside the pass (the routes of a layer whose experts live partly in host
//! memory) splits it into segments: the ops recorded up to the read-back go through their
//! own graph, keyed by the pass and the segment's place in it, and recording goes on after
//! it (vLLM's piecewise graphs). Each graph stages its uploads in pinned memory of its own,
//! so a segment's copies never read bytes a later segment of the same pass has staged.
//!
//! Uploads inside a pass (token ids, block tables) are copied into pinned host memory that
//! the graph's copy nodes read when they run, so new values need no new graph.

use std::cell::RefCell;
use std::collections::{HashMap, HashSet};
use std::ffi::c_void;

use cudarc::cublas::result::gemm_ex;
use cudarc::cublas::sys::{cublasComputeType_t, cublasGemmAlgo_t, cublasOperation_t, cudaDataType};
use cudarc::driver::sys::{self, CUgraph, CUgraphExec, CUgraphNode, CUstream};
use cudarc::driver::{result, CudaSlice, DriverError};

/// Kernel arguments as bytes, each argument starting on an 8-byte word.
#[derive(Clone, Default, PartialEq, Eq)]
pub(crate) struct Args {
    words: Vec<u64>,
    starts: Vec<u32>,
}

impl Args {
    /// Appends one argument. `T` must have no padding bytes (the kernel structs spell
    /// theirs out), so that every copied byte is initialised.
    pub(crate) fn push<T: cudarc::driver::DeviceRepr>(&mut self, v: &T) {
        let size = std::mem::size_of::<T>();
        let start = self.words.len();
        self.words.resize(start + size.div_ceil(8).max(1), 0);
        // SAFETY: `words[start..]` has at least `size` bytes; `T` is plain data without
        // padding (see above), read through its own reference.
        unsafe {
            std::ptr::copy_nonoverlapping(
                (v as *const T).cast::<u8>(),
                self.words[start..].as_mut_ptr().cast::<u8>(),
                size,
            )
        };
        self.starts.push(start as u32);
    }

    /// The `kernelParams` array of a launch: one pointer per argument into `words`.
    fn pointers(&mut self) -> Vec<*mut c_void> {
        let base = self.words.as_mut_ptr();
        self.starts
            .iter()
            // SAFETY: every start indexes inside `words`.
            .map(|&s| unsafe { base.add(s as usize) }.cast::<c_void>())
            .collect()
    }
}

/// One kernel launch.
#[derive(Clone, PartialEq, Eq)]
pub(crate) struct KernelOp {
    /// The `CUfunction`, as an address (comparable and `Send`).
    pub(crate) func: usize,
    pub(crate) grid: (u32, u32, u32),
    pub(crate) block: u32,
    pub(crate) smem: u32,
    /// Launched with programmatic stream serialization (see `Device::set_pdl`).
    pub(crate) pdl: bool,
    pub(crate) args: Args,
}

/// `y [n, o] (+)= x [n, k] · w [o, k]ᵀ` through cuBLAS (see `ops/gemm.rs`).
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) struct GemmOp {
    pub(crate) x: u64,
    pub(crate) w: u64,
    pub(crate) ab: cudaDataType,
    pub(crate) y: u64,
    pub(crate) n: usize,
    pub(crate) k: usize,
    pub(crate) o: usize,
    /// Add to `y` instead of overwriting it.
    pub(crate) accumulate: bool,
}

/// One unit of device work of a pass.
#[derive(Clone, PartialEq, Eq)]
pub(crate) enum Op {
    Kernel(KernelOp),
    Gemm(GemmOp),
    /// `len` bytes from offset `src` of the pass's staged host bytes to `dst`.
    Upload {
        dst: u64,
        src: usize,
        len: usize,
    },
    /// `len` zero bytes at `dst`.
    Zero {
        dst: u64,
        len: usize,
    },
}

impl Op {
    fn kind(&self) -> &'static str {
        match self {
            Op::Kernel(_) => "kernel",
            Op::Gemm(_) => "gemm",
            Op::Upload { .. } => "upload",
            Op::Zero { .. } => "zero",
        }
    }
}

/// Queues `op` on `stream`; uploads read `staging + src` (pinned or pageable host memory).
///
/// # Safety
/// Every address in `op` is live device memory of the sizes the kernel or call expects;
/// `staging` holds the uploads' bytes; `blas` is bound to `stream`.
pub(crate) unsafe fn issue(
    op: &Op,
    stream: CUstream,
    staging: *const u8,
    blas: sys_blas::Handle,
) -> Result<(), DriverError> {
    match op {
        Op::Kernel(k) => {
            let mut args = k.args.clone();
            let mut params = args.pointers();
            let mut attr = sys::CUlaunchAttribute {
                id: sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION,
                pad: [0; 4],
                // SAFETY: an all-zero union is a valid value of each of its integer fields.
                value: unsafe { std::mem::zeroed() },
            };
            attr.value.programmaticStreamSerializationAllowed = 1;
            let config = sys::CUlaunchConfig {
                gridDimX: k.grid.0,
                gridDimY: k.grid.1,
                gridDimZ: k.grid.2,
                blockDimX: k.block,
                blockDimY: 1,
                blockDimZ: 1,
                sharedMemBytes: k.smem,
                hStream: stream,
                attrs: &mut attr,
                numAttrs: u32::from(k.pdl),
            };
            // SAFETY: the caller's contract; `params` points into `args` and `config` at
            // `attr`, both alive here.
            unsafe {
                sys::cuLaunchKernelEx(
                    &config,
                    k.func as sys::CUfunction,
                    params.as_mut_ptr(),
                    std::ptr::null_mut(),
                )
            }
            .result()
        }
        Op::Gemm(g) => {
            let (alpha, beta) = (1.0f32, if g.accumulate { 1.0f32 } else { 0.0 });
            // SAFETY: the caller's contract (see `ops::gemm::gemm` for the layout).
            unsafe {
                gemm_ex(
                    blas.0,
                    cublasOperation_t::CUBLAS_OP_T,
                    cublasOperation_t::CUBLAS_OP_N,
                    g.o as i32,
                    g.n as i32,
                    g.k as i32,
                    (&alpha) as *const f32 as *const _,
                    g.w as *const _,
                    g.ab,
                    g.k as i32,
                    g.x as *const _,
                    g.ab,
                    g.k as i32,
                    (&beta) as *const f32 as *const _,
                    g.y as *mut _,
                    cudaDataType::CUDA_R_32F,
                    g.o as i32,
                    cublasComputeType_t::CUBLAS_COMPUTE_32F,
                    cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
                )
            }
            .map_err(|_| DriverError(sys::CUresult::CUDA_ERROR_UNKNOWN))
        }
        // SAFETY: the caller's contract.
        Op::Upload { dst, src, len } => unsafe {
            sys::cuMemcpyHtoDAsync_v2(*dst, staging.add(*src).cast::<c_void>(), *len, stream)
                .result()
        },
        // SAFETY: the caller's contract.
        Op::Zero { dst, len } => unsafe { sys::cuMemsetD8Async(*dst, 0, *len, stream).result() },
    }
}

/// The cuBLAS handle, `Send` for the recorder.
pub(crate) mod sys_blas {
    /// A raw cuBLAS handle.
    #[derive(Clone, Copy)]
    pub(crate) struct Handle(pub(crate) cudarc::cublas::sys::cublasHandle_t);
}

/// What a pass has recorded so far.
struct Recorder {
    /// The stream (device) the pass belongs to.
    stream: usize,
    ops: Vec<Op>,
    staging: Vec<u8>,
    /// Pool buffers dropped during the pass, kept until the work reading them is queued.
    keep: Vec<CudaSlice<u8>>,
    /// False once something makes the pass unfit for a graph.
    graphable: bool,
    /// The pass's key; `None`: the pass is issued op by op at its end.
    key: Option<u64>,
    /// Segments already queued (each ended by a read-back).
    segment: u64,
}

thread_local! {
    static RECORDER: RefCell<Option<Recorder>> = const { RefCell::new(None) };
}

/// Starts recording the pass `key` of `stream` on this thread.
pub(crate) fn start(stream: CUstream, key: u64) {
    RECORDER.with_borrow_mut(|r| {
        *r = Some(Recorder {
            stream: stream as usize,
            ops: Vec::new(),
            staging: Vec::new(),
            keep: Vec::new(),
            graphable: true,
            key: Some(key),
            segment: 0,
        })
    });
}

/// The graph key of segment `segment` of pass `key`.
pub(crate) fn segment_key(key: u64, segment: u64) -> u64 {
    fn mix(mut z: u64) -> u64 {
        z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    mix(key ^ mix(segment))
}

/// A finished recording.
pub(crate) struct Recording {
    pub(crate) ops: Vec<Op>,
    pub(crate) staging: Vec<u8>,
    pub(crate) keep: Vec<CudaSlice<u8>>,
    pub(crate) graphable: bool,
}

/// Stops recording on this thread: the last segment and its graph key.
pub(crate) fn stop() -> Option<(u64, Recording)> {
    RECORDER.with_borrow_mut(|r| r.take()).map(|r| {
        (
            segment_key(r.key.unwrap_or(0), r.segment),
            Recording {
                ops: r.ops,
                staging: r.staging,
                keep: r.keep,
                graphable: r.graphable && r.key.is_some(),
            },
        )
    })
}

/// Recording set aside while work runs outside the pass (see [`suspend`]); put back when
/// dropped.
pub(crate) struct Suspended(Option<Recorder>);

impl Drop for Suspended {
    fn drop(&mut self) {
        let rec = self.0.take();
        RECORDER.with_borrow_mut(|r| {
            if r.is_none() {
                *r = rec;
            }
        });
    }
}

/// Sets this thread's recording aside, so that what is launched or allocated until the
/// guard drops runs at once, from the pool, in stream order, and stays out of the pass's
/// graphs and arena (expert slot fills: how many a step needs varies, the graphs must not).
/// The caller queues the recorded ops first ([`crate::device::Device::flush`]).
pub(crate) fn suspend() -> Suspended {
    Suspended(RECORDER.with_borrow_mut(|r| r.take()))
}

/// True while this thread records a pass of `stream`.
pub(crate) fn recording(stream: CUstream) -> bool {
    RECORDER.with_borrow(|r| r.as_ref().is_some_and(|r| r.stream == stream as usize))
}

/// True while this thread records any pass.
pub(crate) fn recording_any() -> bool {
    RECORDER.with_borrow(|r| r.is_some())
}

/// Records `op` if this thread records a pass of `stream`; otherwise hands it back.
pub(crate) fn record(stream: CUstream, op: Op) -> Option<Op> {
    RECORDER.with_borrow_mut(|r| match r {
        Some(r) if r.stream == stream as usize => {
            r.ops.push(op);
            None
        }
        _ => Some(op),
    })
}

/// Records an upload of `bytes` to `dst`, staging the bytes.
pub(crate) fn record_upload(stream: CUstream, dst: u64, bytes: &[u8]) -> bool {
    RECORDER.with_borrow_mut(|r| match r {
        Some(r) if r.stream == stream as usize => {
            let src = r.staging.len().next_multiple_of(16);
            r.staging.resize(src, 0);
            r.staging.extend_from_slice(bytes);
            r.ops.push(Op::Upload {
                dst,
                src,
                len: bytes.len(),
            });
            true
        }
        _ => false,
    })
}

/// Marks the current pass as unfit for a graph (it will be issued op by op).
pub(crate) fn spoil() {
    RECORDER.with_borrow_mut(|r| {
        if let Some(r) = r {
            r.graphable = false;
        }
    });
}

/// Takes the ops recorded so far, so that the caller can queue them before a read-back:
/// as the next segment of the pass with its graph key while the pass can be replayed
/// (recording goes on after it), else to be issued op by op (and the rest of the pass too).
/// `None` when this thread records no pass of `stream` or nothing since the last segment.
pub(crate) fn take_segment(stream: CUstream) -> Option<(Option<u64>, Recording)> {
    RECORDER.with_borrow_mut(|r| match r {
        Some(r) if r.stream == stream as usize && !r.ops.is_empty() => {
            let rec = Recording {
                ops: std::mem::take(&mut r.ops),
                staging: std::mem::take(&mut r.staging),
                keep: std::mem::take(&mut r.keep),
                graphable: r.graphable,
            };
            match r.key.filter(|_| r.graphable) {
                Some(key) => {
                    let k = segment_key(key, r.segment);
                    r.segment += 1;
                    Some((Some(k), rec))
                }
                None => {
                    r.graphable = false;
                    Some((None, rec))
                }
            }
        }
        _ => None,
    })
}

/// Frees a pool buffer, or keeps it until the recorded work is queued.
pub(crate) fn release_pool_buffer(s: CudaSlice<u8>) {
    let kept = RECORDER.try_with(|r| {
        let Ok(mut r) = r.try_borrow_mut() else {
            return Some(s);
        };
        match r.as_mut() {
            Some(r) => {
                r.keep.push(s);
                None
            }
            None => Some(s),
        }
    });
    // Not recording (or the thread is exiting): free in stream order now.
    drop(kept);
}

/// A captured pass: its graph, the executable graph and the op list it was made from.
pub(crate) struct Graph {
    graph: CUgraph,
    exec: CUgraphExec,
    ops: Vec<Op>,
    /// The graph node of each kernel op (`None` for other ops), for patching; `None` when
    /// the nodes could not be matched to the ops.
    nodes: Option<Vec<Option<usize>>>,
    /// Pinned bytes its upload nodes read, rewritten before each launch.
    staging: Pinned,
}

// SAFETY: the graph handles are used only under the `GraphCache` mutex, by one thread at a
// time, as the driver requires.
unsafe impl Send for Graph {}

impl Drop for Graph {
    fn drop(&mut self) {
        // SAFETY: both handles were created by `capture` and are destroyed once, here.
        unsafe {
            let _ = result::graph::exec_destroy(self.exec);
            let _ = result::graph::destroy(self.graph);
        }
    }
}

impl Graph {
    /// Captures `ops` from `stream` and instantiates the graph, its uploads reading
    /// `bytes` copied into pinned memory of its own.
    ///
    /// # Safety
    /// As [`issue`] for every op, with `bytes` the staged bytes the uploads read.
    pub(crate) unsafe fn capture(
        ops: Vec<Op>,
        stream: CUstream,
        bytes: &[u8],
        blas: sys_blas::Handle,
    ) -> Result<Self, DriverError> {
        let pinned = Pinned::holding(bytes)?;
        let staging = pinned.ptr.cast_const();
        let mode = sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL;
        // SAFETY: the stream is valid and not capturing (passes do not nest).
        unsafe { result::stream::begin_capture(stream, mode)? };
        let mut failed = None;
        for op in &ops {
            // SAFETY: the caller's contract.
            if let Err(e) = unsafe { issue(op, stream, staging, blas) } {
                failed = Some(e);
                break;
            }
        }
        // Always end the capture, so that the stream is usable again.
        // SAFETY: the stream is capturing.
        let graph = unsafe { result::stream::end_capture(stream) };
        let graph = match (graph, failed) {
            (Ok(g), None) if !g.is_null() => g,
            (Ok(g), failed) => {
                if !g.is_null() {
                    // SAFETY: created by end_capture above, not used elsewhere.
                    let _ = unsafe { result::graph::destroy(g) };
                }
                return Err(failed.unwrap_or(DriverError(
                    sys::CUresult::CUDA_ERROR_STREAM_CAPTURE_INVALIDATED,
                )));
            }
            (Err(e), _) => return Err(e),
        };
        // SAFETY: `graph` is a valid graph from the capture.
        let exec =
            match unsafe { result::graph::instantiate(graph, sys::CUgraphInstantiate_flags(0)) } {
                Ok(e) => e,
                Err(e) => {
                    // SAFETY: as above.
                    let _ = unsafe { result::graph::destroy(graph) };
                    return Err(e);
                }
            };
        // SAFETY: `graph` is valid.
        let nodes = unsafe { kernel_nodes(graph, &ops) };
        Ok(Self {
            graph,
            exec,
            ops,
            nodes,
            staging: pinned,
        })
    }

    /// Rewrites the staged bytes the upload nodes read; `false` when they do not fit (the
    /// ops then differ too, and the pass is captured again).
    ///
    /// # Safety
    /// No launch of this graph is still running (passes start on an idle stream, and a
    /// pass queues each of its segments once).
    unsafe fn restage(&mut self, bytes: &[u8]) -> bool {
        if bytes.len() > self.staging.cap {
            return false;
        }
        // SAFETY: `staging` holds `cap >= bytes.len()` bytes that nothing reads now.
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), self.staging.ptr, bytes.len()) };
        true
    }

    /// Patches the kernel nodes whose arguments or grid differ in `ops`, if every other op
    /// is unchanged; `false` (and no change) when `ops` needs a new capture.
    ///
    /// # Safety
    /// The new ops' addresses are live as for [`issue`].
    pub(crate) unsafe fn patch(&mut self, ops: &[Op]) -> Result<Result<(), String>, DriverError> {
        if ops.len() != self.ops.len() {
            return Ok(Err(format!(
                "{} ops, captured {}",
                ops.len(),
                self.ops.len()
            )));
        }
        let mut changed = Vec::new();
        for (i, (old, new)) in self.ops.iter().zip(ops).enumerate() {
            match (old, new) {
                _ if old == new => {}
                (Op::Kernel(a), Op::Kernel(b))
                    if a.func == b.func && a.block == b.block && a.pdl == b.pdl =>
                {
                    changed.push(i)
                }
                _ => return Ok(Err(format!("op {i} changed ({})", old.kind()))),
            }
        }
        if changed.is_empty() {
            return Ok(Ok(()));
        }
        let Some(nodes) = &self.nodes else {
            return Ok(Err("kernel nodes not matched to ops".into()));
        };
        for &i in &changed {
            let (Op::Kernel(k), Some(node)) = (&ops[i], nodes[i]) else {
                return Ok(Err(format!("no node for op {i}")));
            };
            let mut args = k.args.clone();
            let mut ptrs = args.pointers();
            let params = sys::CUDA_KERNEL_NODE_PARAMS {
                func: k.func as sys::CUfunction,
                gridDimX: k.grid.0,
                gridDimY: k.grid.1,
                gridDimZ: k.grid.2,
                blockDimX: k.block,
                blockDimY: 1,
                blockDimZ: 1,
                sharedMemBytes: k.smem,
                kernelParams: ptrs.as_mut_ptr(),
                extra: std::ptr::null_mut(),
                kern: std::ptr::null_mut(),
                ctx: std::ptr::null_mut(),
            };
            // SAFETY: `node` is a kernel node of the graph `exec` was made from, running
            // the same function; the caller vouches for the new arguments.
            unsafe {
                sys::cuGraphExecKernelNodeSetParams_v2(self.exec, node as CUgraphNode, &params)
            }
            .result()?;
        }
        for i in changed {
            self.ops[i] = ops[i].clone();
        }
        Ok(Ok(()))
    }

    /// Launches the executable graph on `stream`.
    pub(crate) fn launch(&self, stream: CUstream) -> Result<(), DriverError> {
        // SAFETY: `exec` is valid; the stream belongs to the graph's context.
        unsafe { result::graph::launch(self.exec, stream) }
    }
}

/// The graph's kernel node for each kernel op: the nodes in a topological order (one
/// stream's capture orders our ops totally; cuBLAS may add branches of its own in between),
/// matched to the kernel ops by function, in order.
///
/// # Safety
/// `graph` is a valid graph captured from one stream.
unsafe fn kernel_nodes(graph: CUgraph, ops: &[Op]) -> Option<Vec<Option<usize>>> {
    let mut n = 0usize;
    // SAFETY: asks for the count first, then fills room for that many.
    unsafe { sys::cuGraphGetNodes(graph, std::ptr::null_mut(), &mut n) }
        .result()
        .ok()?;
    let mut nodes: Vec<CUgraphNode> = vec![std::ptr::null_mut(); n];
    // SAFETY: as above.
    unsafe { sys::cuGraphGetNodes(graph, nodes.as_mut_ptr(), &mut n) }
        .result()
        .ok()?;
    let mut m = 0usize;
    let (none, no_data) = (std::ptr::null_mut(), std::ptr::null_mut());
    // SAFETY: as above.
    unsafe { sys::cuGraphGetEdges_v2(graph, none, none, no_data, &mut m) }
        .result()
        .ok()?;
    let mut from: Vec<CUgraphNode> = vec![std::ptr::null_mut(); m];
    let mut to: Vec<CUgraphNode> = vec![std::ptr::null_mut(); m];
    // SAFETY: as above.
    unsafe { sys::cuGraphGetEdges_v2(graph, from.as_mut_ptr(), to.as_mut_ptr(), no_data, &mut m) }
        .result()
        .ok()?;
    // Kahn's algorithm over node indices.
    let index: HashMap<usize, usize> = nodes
        .iter()
        .enumerate()
        .map(|(i, &p)| (p as usize, i))
        .collect();
    let mut out_edges = vec![Vec::new(); n];
    let mut indegree = vec![0usize; n];
    for (&f, &t) in from.iter().zip(&to) {
        let (f, t) = (*index.get(&(f as usize))?, *index.get(&(t as usize))?);
        out_edges[f].push(t);
        indegree[t] += 1;
    }
    let mut ready: std::collections::VecDeque<usize> =
        (0..n).filter(|&i| indegree[i] == 0).collect();
    let mut chain = Vec::with_capacity(n);
    while let Some(i) = ready.pop_front() {
        chain.push(nodes[i]);
        for &t in &out_edges[i] {
            indegree[t] -= 1;
            if indegree[t] == 0 {
                ready.push_back(t);
            }
        }
    }
    if chain.len() != n {
        return None;
    }
    let mut funcs = Vec::with_capacity(chain.len());
    for &node in &chain {
        let mut ty = sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_EMPTY;
        // SAFETY: `node` belongs to the graph.
        unsafe { sys::cuGraphNodeGetType(node, &mut ty) }
            .result()
            .ok()?;
        if ty != sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_KERNEL {
            funcs.push(0usize);
            continue;
        }
        // SAFETY: a kernel node; the struct is plain data the driver fills.
        let mut p: sys::CUDA_KERNEL_NODE_PARAMS = unsafe { std::mem::zeroed() };
        // SAFETY: as above.
        unsafe { sys::cuGraphKernelNodeGetParams_v2(node, &mut p) }
            .result()
            .ok()?;
        funcs.push(p.func as usize);
    }
    let mut at = 0;
    let mut out = Vec::with_capacity(ops.len());
    for op in ops {
        let Op::Kernel(k) = op else {
            out.push(None);
            continue;
        };
        while at < funcs.len() && funcs[at] != k.func {
            at += 1;
        }
        let node = *chain.get(at)?;
        out.push(Some(node as usize));
        at += 1;
    }
    Some(out)
}

/// Pinned host memory the graphs' upload nodes read.
struct Pinned {
    ptr: *mut u8,
    cap: usize,
}

impl Pinned {
    /// Pinned memory holding a copy of `bytes` (at least 4 KiB, so that small changes in
    /// what a pass uploads fit without a new allocation).
    fn holding(bytes: &[u8]) -> Result<Self, DriverError> {
        let cap = bytes.len().next_power_of_two().max(4 << 10);
        // SAFETY: a plain pinned allocation of `cap` bytes.
        let ptr = unsafe { result::malloc_host(cap, 0) }?.cast::<u8>();
        // SAFETY: `ptr` holds `cap >= bytes.len()` bytes.
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), ptr, bytes.len()) };
        Ok(Self { ptr, cap })
    }
}

impl Drop for Pinned {
    fn drop(&mut self) {
        if !self.ptr.is_null() {
            // SAFETY: allocated by `malloc_host`, freed once.
            let _ = unsafe { result::free_host(self.ptr.cast()) };
        }
    }
}

/// The captured graphs of one device, by pass (or pass segment) key.
pub(crate) struct GraphCache {
    graphs: HashMap<u64, Graph>,
    /// Keys whose capture failed: issued op by op from then on.
    failed: HashSet<u64>,
    /// Why the last existing graph had to be captured again (for diagnosis).
    pub(crate) last_recapture: Option<String>,
}

// SAFETY: the graphs' pinned pointers are only used under the device's mutex.
unsafe impl Send for GraphCache {}

/// At most this many keys (batch sizes, or their segments where experts live in host
/// memory: one per MoE layer) keep a graph.
const MAX_GRAPHS: usize = 1024;

impl GraphCache {
    pub(crate) fn new() -> Self {
        Self {
            graphs: HashMap::new(),
            failed: HashSet::new(),
            last_recapture: None,
        }
    }

    /// Queues a finished recording (a pass or a segment of one): through the key's graph
    /// where it can be, else op by op.
    ///
    /// # Safety
    /// As [`issue`] for every recorded op; the stream was idle when the pass began, and the
    /// pass queues each key once.
    pub(crate) unsafe fn run(
        &mut self,
        key: u64,
        rec: Recording,
        stream: CUstream,
        blas: sys_blas::Handle,
    ) -> Result<Outcome, DriverError> {
        let Recording {
            ops,
            staging,
            keep,
            graphable,
        } = rec;
        if ops.is_empty() {
            return Ok(Outcome::Empty);
        }
        let graphable = graphable
            && !self.failed.contains(&key)
            && (self.graphs.len() < MAX_GRAPHS || self.graphs.contains_key(&key));
        if !graphable {
            for op in &ops {
                // SAFETY: the caller's contract; pageable staging is copied at the call.
                unsafe { issue(op, stream, staging.as_ptr(), blas)? };
            }
            drop(keep);
            return Ok(Outcome::Eager);
        }
        if let Some(g) = self.graphs.get_mut(&key) {
            // SAFETY: the caller's contract (no launch of this graph is running).
            let fits = unsafe { g.restage(&staging) };
            // SAFETY: the caller's contract.
            match unsafe { g.patch(&ops)? } {
                Ok(()) if fits => {
                    g.launch(stream)?;
                    drop(keep);
                    return Ok(Outcome::Replayed);
                }
                Ok(()) => self.last_recapture = Some(format!("pass {key}: uploads grew")),
                Err(why) => self.last_recapture = Some(format!("pass {key}: {why}")),
            }
        }
        self.graphs.remove(&key);
        // SAFETY: the caller's contract; the graph keeps the pinned copy of `staging`.
        match unsafe { Graph::capture(ops.clone(), stream, &staging, blas) } {
            Ok(g) => {
                g.launch(stream)?;
                self.graphs.insert(key, g);
                drop(keep);
                Ok(Outcome::Captured)
            }
            Err(e) => {
                tracing::warn!("CUDA graph capture failed ({e}); running pass {key} op by op");
                self.failed.insert(key);
                for op in &ops {
                    // SAFETY: the caller's contract; pageable staging is copied at the call.
                    unsafe { issue(op, stream, staging.as_ptr(), blas)? };
                }
                drop(keep);
                Ok(Outcome::Eager)
            }
        }
    }
}

/// How a recorded pass reached the GPU.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Outcome {
    Empty,
    Eager,
    Captured,
    Replayed,
}

#[cfg(test)]
mod tests {
    use super::segment_key;

    /// Segments of one pass, and the same segment of passes of other batch sizes, get
    /// keys of their own (a shared key would patch one segment's graph into another's).
    #[test]
    fn segment_keys_are_distinct() {
        let mut seen = std::collections::HashSet::new();
        for pass in 0..300u64 {
            for segment in 0..100u64 {
                assert!(seen.insert(segment_key(pass, segment)), "{pass} {segment}");
            }
        }
        assert_eq!(segment_key(4, 2), segment_key(4, 2));
    }
}
