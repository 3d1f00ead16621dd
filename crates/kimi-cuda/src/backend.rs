//! [`CudaBackend`]: the `kimi_ops::Backend` implementation. Every method checks shapes and
//! dtypes on the host, allocates its outputs and calls the launchers in `ops/`.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError, RwLock};

use cudarc::cublas::sys::cudaDataType;
use kimi_core::config::{Activation, KdaGate};
use kimi_core::DType;
use kimi_ops::{
    check_paged, check_segments, Backend, Error, ExpertView, HostTensor, KdaMode, KdaStepInputs,
    KdaStepWeights, MlaDims, MlaMode, MlpWeights, MoeRoutes, MoeRouting, MoeWeights, PagedSeq,
    Result, RowSampling, Segment, TokenPenalty,
};

use crate::buffer::DevBuf;
use crate::device::{grid, Device};
use crate::error::OpContext;
use crate::ops;
use crate::plan::{self, GemmPrecision, KdaChunkPath, KernelConfig, MatmulPath};
use crate::tensor::{dtype_code, CudaTensor};

mod fp8_kv;
mod k3;
mod kda_decode;
mod moe;
mod nccl;
mod packed_experts;
mod quant;
mod routes;
mod sampling;
mod slot_fill;

pub use nccl::{nccl_version, NcclComm, NcclId};

/// The CUDA backend on one GPU. See the crate documentation for its precision.
pub struct CudaBackend {
    dev: Device,
    /// This backend's kernel choices; every op reads them once (`kernel_config`).
    config: RwLock<KernelConfig>,
    ordinal: usize,
    device_name: String,
    /// Expert address tables of the fused MoE path, by their contents.
    moe_tables: Mutex<HashMap<Vec<u64>, DevBuf>>,
    /// Address tables of expert banks whose views change (a tiered bank's slots).
    bank_tables: Mutex<moe::RecentTables>,
    /// One u32, zero between launches: `moe_route_one`'s count of finished blocks.
    route_ticket: DevBuf,
    /// Two u32, zero between launches: `moe_stream_layer`'s grid-wide handoff counters.
    layer_sync: DevBuf,
    /// Packed matrices that kernels read widened (MLA's decompression matrix), by address
    /// and shape: the packed tensor (held, so that its address stays its own) and its bf16
    /// copy, made once.
    plain_copies: Mutex<quant::PlainCopies>,
}

fn shape_err(op: &'static str, detail: String) -> Error {
    Error::Shape { op, detail }
}

fn f32_rows(t: &CudaTensor, op: &'static str) -> Result<(usize, usize)> {
    if t.dtype != DType::F32 {
        return Err(shape_err(
            op,
            format!("expected an f32 tensor, got {}", t.dtype),
        ));
    }
    t.rows_cols()
        .ok_or_else(|| shape_err(op, "scalar given where a matrix is needed".into()))
}

/// Whether the non-empty `segments` cover rows `0..n` exactly, each row once: then an op
/// whose kernels write every row of their segments leaves no row of its output unwritten,
/// and the output needs no zeroing (a memset node in a decode graph, which also ends the
/// programmatic overlap of the kernels around it).
fn rows_tiled(segments: &[Segment], n: usize) -> bool {
    let mut spans: Vec<(usize, usize)> = segments
        .iter()
        .filter(|s| s.len > 0)
        .map(|s| (s.start, s.len))
        .collect();
    spans.sort_unstable();
    let mut next = 0;
    for (start, len) in spans {
        if start != next {
            return false;
        }
        next = start + len;
    }
    next == n
}

fn code(t: &CudaTensor, op: &'static str) -> Result<i32> {
    dtype_code(t.dtype).ok_or_else(|| Error::Unsupported(format!("{op} on dtype {}", t.dtype)))
}

impl CudaBackend {
    /// Opens GPU `ordinal`, loads the embedded kernels and cuBLAS, with the kernel choices
    /// of [`KernelConfig::from_env`].
    pub fn new(ordinal: usize) -> Result<Self> {
        Self::with_config(ordinal, KernelConfig::from_env())
    }

    /// Opens GPU `ordinal` with the kernel choices of `config`.
    pub fn with_config(ordinal: usize, config: KernelConfig) -> Result<Self> {
        let dev = Device::new(ordinal, &config)?;
        let device_name = dev.ctx.name().op("init")?;
        let route_ticket = dev.upload_kept(&[0u8; 4], "init")?;
        let layer_sync = dev.upload_kept(&[0u8; 8], "init")?;
        Ok(Self {
            dev,
            config: RwLock::new(config),
            ordinal,
            device_name,
            moe_tables: Mutex::new(HashMap::new()),
            bank_tables: Mutex::new(moe::RecentTables::default()),
            route_ticket,
            layer_sync,
            plain_copies: Mutex::default(),
        })
    }

    /// This backend's kernel choices now.
    pub fn kernel_config(&self) -> KernelConfig {
        // A poisoned lock still holds a whole configuration (writers only assign one).
        *self.config.read().unwrap_or_else(PoisonError::into_inner)
    }

    /// Replaces this backend's kernel choices; later calls plan with them. The device-wide
    /// ones take effect at once (the memory pool's release, programmatic launch, CUDA
    /// graphs; a captured graph whose launches differ is captured again), except the pass
    /// arena's size, which applies when the arena is made (the first recorded pass).
    pub fn set_kernel_config(&self, config: KernelConfig) -> Result<()> {
        self.update_kernel_config(|c| *c = config)
    }

    /// Changes some of this backend's kernel choices, as [`Self::set_kernel_config`]:
    /// `be.update_kernel_config(|c| c.gemv = GemvKernel::Bulk)`.
    pub fn update_kernel_config(&self, change: impl FnOnce(&mut KernelConfig)) -> Result<()> {
        let mut current = self.config.write().unwrap_or_else(PoisonError::into_inner);
        let mut config = *current;
        change(&mut config);
        if config.pool_keeps_memory != current.pool_keeps_memory {
            self.dev.set_pool_keeps_memory(config.pool_keeps_memory)?;
        }
        self.dev.set_pdl(config.pdl);
        self.dev.set_graphs(config.cuda_graphs);
        self.dev.set_arena_mb(config.graph_arena_mb);
        *current = config;
        Ok(())
    }

    /// Chooses how GEMMs against 16-bit weights round the activations (default: split).
    pub fn set_gemm_precision(&self, p: GemmPrecision) {
        self.config
            .write()
            .unwrap_or_else(PoisonError::into_inner)
            .precision = p;
    }

    /// The current [`GemmPrecision`].
    pub fn gemm_precision(&self) -> GemmPrecision {
        self.kernel_config().precision
    }

    /// Waits for all queued work (for timing).
    pub fn synchronize(&self) -> Result<()> {
        self.dev.synchronize("synchronize")
    }

    /// Turns CUDA graphs for decode passes on or off ([`KernelConfig::cuda_graphs`]).
    pub fn set_cuda_graphs(&self, on: bool) {
        let mut config = self.config.write().unwrap_or_else(PoisonError::into_inner);
        config.cuda_graphs = on;
        self.dev.set_graphs(on);
    }

    /// Whether freed device memory stays in the allocation pool between passes
    /// ([`KernelConfig::pool_keeps_memory`]), for comparison.
    pub fn set_pool_keeps_memory(&self, keep: bool) -> Result<()> {
        let mut config = self.config.write().unwrap_or_else(PoisonError::into_inner);
        self.dev.set_pool_keeps_memory(keep)?;
        config.pool_keeps_memory = keep;
        Ok(())
    }

    /// Turns programmatic dependent launch on or off ([`KernelConfig::pdl`]), for
    /// comparison.
    pub fn set_pdl(&self, on: bool) {
        let mut config = self.config.write().unwrap_or_else(PoisonError::into_inner);
        config.pdl = on;
        self.dev.set_pdl(on);
    }

    /// The expanded-prefill attention alone, for timing: `q [len, H*(dn+dr)]` attends over
    /// `past + len` keys whose k_pe are columns `r..` of `rows [past+len, r+dr]` and whose
    /// k_nope ‖ v per head are `kv [past+len, H*(dn+dv)]` (all f32), with the kernel that
    /// [`KernelConfig::mla_prefill`] and [`KernelConfig::precision`] choose. Returns
    /// `[len, H*dv]`.
    pub fn mla_expanded_attention(
        &self,
        q: &CudaTensor,
        rows: &CudaTensor,
        kv: &CudaTensor,
        dims: &MlaDims,
        past: usize,
    ) -> Result<CudaTensor> {
        const OP: &str = "mla";
        self.dev.enter(OP)?;
        let (h, dn, dr, dv) = (
            dims.num_heads,
            dims.qk_nope_head_dim,
            dims.qk_rope_head_dim,
            dims.v_head_dim,
        );
        let (len, qw) = f32_rows(q, OP)?;
        let total = past + len;
        if qw != h * (dn + dr)
            || f32_rows(rows, OP)? != (total, dims.kv_lora_rank + dr)
            || f32_rows(kv, OP)? != (total, h * (dn + dv))
        {
            return Err(shape_err(
                OP,
                format!(
                    "q {:?}, rows {:?}, kv {:?} do not fit {dims:?} with {past} cached rows",
                    q.shape, rows.shape, kv.shape
                ),
            ));
        }
        let out = self.zeroed(&[len, h * dv], OP)?;
        let cfg = self.kernel_config();
        // SAFETY: shapes checked above: q holds len rows, rows/kv past+len rows of the
        // widths the kernel reads, out len rows of H*dv f32.
        unsafe {
            ops::mla::expanded(
                &self.dev,
                q.ptr(),
                rows.ptr(),
                kv.ptr(),
                out.ptr(),
                past,
                len,
                dims,
                &cfg,
            )?
        };
        Ok(out)
    }

    /// Why a pass's existing CUDA graph was last captured again instead of patched.
    pub fn last_graph_recapture(&self) -> Option<String> {
        self.dev.last_recapture()
    }

    /// How recorded passes reached the GPU so far: `[op by op, captured, replayed]`.
    pub fn graph_pass_counts(&self) -> [u64; 3] {
        self.dev.pass_counts.lock().map_or([0; 3], |c| *c)
    }

    /// Free and total device memory in bytes.
    pub fn mem_info(&self) -> Result<(usize, usize)> {
        self.dev.ctx.mem_get_info().op("mem_info")
    }

    fn raw(&self, bytes: usize, op: &'static str) -> Result<DevBuf> {
        // Every caller writes each element it later reads (kernels or copies fill the
        // buffer before use); spare capacity is never read.
        self.dev.alloc(bytes, op)
    }

    /// An uninitialised tensor; the caller's kernel writes every element.
    fn empty(&self, shape: &[usize], dtype: DType, op: &'static str) -> Result<CudaTensor> {
        let n: usize = shape.iter().product();
        Ok(CudaTensor {
            shape: shape.to_vec(),
            dtype,
            buf: Arc::new(self.raw(n * dtype.size_bytes(), op)?),
            offset: 0,
        })
    }

    fn zeroed(&self, shape: &[usize], op: &'static str) -> Result<CudaTensor> {
        let n: usize = shape.iter().product();
        Ok(CudaTensor {
            shape: shape.to_vec(),
            dtype: DType::F32,
            buf: Arc::new(self.dev.alloc_zeros(n * 4, op)?),
            offset: 0,
        })
    }

    fn upload_u32(&self, v: &[u32], op: &'static str) -> Result<DevBuf> {
        let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
        self.upload_bytes(&bytes, op)
    }

    /// Bytes for this pass (ids, tables): staged inside a recorded pass.
    fn upload_bytes(&self, bytes: &[u8], op: &'static str) -> Result<DevBuf> {
        self.dev.upload(bytes, op)
    }

    fn slice_ptr(s: &DevBuf) -> u64 {
        s.ptr()
    }

    /// An f32 copy of a weight of any supported dtype (or `None` if already f32).
    fn as_f32_copy(&self, w: &CudaTensor, op: &'static str) -> Result<Option<CudaTensor>> {
        if w.dtype == DType::F32 {
            return Ok(None);
        }
        if quant::is_planar(w.dtype) {
            return Ok(Some(self.widen_quant(w, DType::F32, op)?));
        }
        let dt = code(w, op)?;
        let out = self.empty(&w.shape, DType::F32, op)?;
        // SAFETY: `w` holds `len` elements of dtype `dt`; `out` holds `len` f32.
        unsafe { ops::elementwise::cast_to_f32(&self.dev, w.ptr(), dt, out.ptr(), w.len())? };
        Ok(Some(out))
    }

    fn matmul_op(&self, x: &CudaTensor, w: &CudaTensor, op: &'static str) -> Result<CudaTensor> {
        let o = w.shape.first().copied().unwrap_or(0);
        let mut parts = self.matmul_blocks(x, w, &[o], op)?;
        parts
            .pop()
            .ok_or_else(|| shape_err(op, "no product".into()))
    }

    /// `x · wᵀ` per block of `rows[i]` rows of `w`, each product written to its own tensor.
    /// Many rows (prefill): `x` is rounded to the weight's dtype once and every block is its
    /// own GEMM on a row offset of `w`, so no `[n, Σ rows]` product is split by copies. A
    /// few rows: one GEMV, then [`Backend::split_cols`] (views for one row).
    fn matmul_blocks(
        &self,
        x: &CudaTensor,
        w: &CudaTensor,
        rows: &[usize],
        op: &'static str,
    ) -> Result<Vec<CudaTensor>> {
        let (n, k) = f32_rows(x, op)?;
        let (o, wk) = match w.shape.as_slice() {
            [o, wk] => (*o, *wk),
            _ => {
                return Err(shape_err(
                    op,
                    format!("weight {:?} is not a matrix", w.shape),
                ))
            }
        };
        if k != wk {
            return Err(shape_err(
                op,
                format!("activation {:?} does not fit weight {:?}", x.shape, w.shape),
            ));
        }
        if rows.iter().sum::<usize>() != o {
            return Err(shape_err(
                op,
                format!("blocks {rows:?} do not add up to the weight's {o} rows"),
            ));
        }
        // The whole product, split afterwards where there is more than one block.
        let whole = |y: CudaTensor| -> Result<Vec<CudaTensor>> {
            if rows.len() == 1 {
                Ok(vec![y])
            } else {
                self.split_cols(&y, rows)
            }
        };
        let (cast, split, ab) = match w.dtype {
            DType::F32 => {
                let y = self.empty(&[n, o], DType::F32, op)?;
                // SAFETY: x [n,k], w [o,k] f32 and y [n,o] f32 were checked/allocated above.
                unsafe {
                    ops::gemm::gemm(
                        &self.dev,
                        x.ptr(),
                        w.ptr(),
                        cudaDataType::CUDA_R_32F,
                        y.ptr(),
                        n,
                        k,
                        o,
                    )?
                };
                return whole(y);
            }
            DType::BF16 => ("cast_f32_bf16", "split_f32_bf16", cudaDataType::CUDA_R_16BF),
            DType::F16 => ("cast_f32_f16", "split_f32_f16", cudaDataType::CUDA_R_16F),
            // Packed weights outside the expert kernels (rare): widened for this product.
            DType::MXFP4 => return self.matmul_blocks(x, &self.widen_mxfp4(w, op)?, rows, op),
            dt if quant::is_planar(dt) => return self.matmul_quant(x, w, rows, op),
            other => return Err(Error::Unsupported(format!("{op} with {other} weights"))),
        };
        if n * k == 0 {
            return whole(self.zeroed(&[n, o], op)?);
        }
        let aligned = (x.ptr() | w.ptr()).is_multiple_of(16) && k.is_multiple_of(8);
        let cfg = self.kernel_config();
        let path = plan::plan_matmul(&cfg, w.dtype == DType::BF16, n, aligned);
        if path == MatmulPath::Gemv {
            let y = self.empty(&[n, o], DType::F32, op)?;
            // SAFETY: the planner took the GEMV only for bf16 w [o,k] and x [n,k] f32 with
            // n <= 8, 16-byte aligned, k % 8 == 0; y [n,o].
            unsafe { ops::gemm::gemv_bf16(&self.dev, &cfg, x.ptr(), w.ptr(), y.ptr(), n, k, o)? };
            return whole(y);
        }
        let half = path == MatmulPath::Half;
        // Half: x rounded once. Split: rows [0,n) = hi, [n,2n) = lo.
        let xs = self.empty(&[if half { n } else { 2 * n }, k], w.dtype, op)?;
        let kernel = if half { cast } else { split };
        // SAFETY: x holds n*k f32 and xs n*k (Half) or 2*n*k (Split) halves.
        unsafe { ops::elementwise::binary(&self.dev, op, kernel, x.ptr(), xs.ptr(), n * k)? };
        let row_bytes = (k * w.dtype.size_bytes()) as u64;
        let mut first = 0usize;
        let mut out = Vec::with_capacity(rows.len());
        for &ob in rows {
            let wb = w.ptr() + first as u64 * row_bytes;
            first += ob;
            let y = self.empty(&[n, ob], DType::F32, op)?;
            if half {
                // SAFETY: xs [n,k] and the block's rows of w [ob,k] share dtype `ab`;
                // y [n,ob] f32.
                unsafe { ops::gemm::gemm(&self.dev, xs.ptr(), wb, ab, y.ptr(), n, k, ob)? };
            } else if path == MatmulPath::SplitAccumulate {
                // Many rows (prefill): y = hi·wᵀ, then y += lo·wᵀ (cuBLAS's beta = 1), no
                // [2n, ob] intermediate and no summing pass.
                let lo = xs.ptr() + (n * k * 2) as u64;
                // SAFETY: both halves of xs are [n,k] of dtype `ab` like the block
                // [ob,k]; y [n,ob] f32 holds the first product before the second adds to it.
                unsafe {
                    ops::gemm::gemm_into(&self.dev, xs.ptr(), wb, ab, y.ptr(), n, k, ob, false)?;
                    ops::gemm::gemm_into(&self.dev, lo, wb, ab, y.ptr(), n, k, ob, true)?;
                }
            } else {
                // Few rows (decode batches): one GEMM of 2n rows reads the weight once.
                let y2 = self.empty(&[2 * n, ob], DType::F32, op)?;
                // SAFETY: xs [2n,k] and the block [ob,k] share dtype `ab`; y2 [2n,ob] f32.
                unsafe { ops::gemm::gemm(&self.dev, xs.ptr(), wb, ab, y2.ptr(), 2 * n, k, ob)? };
                // SAFETY: y2 holds 2*n*ob f32 and y n*ob.
                unsafe {
                    ops::elementwise::binary(
                        &self.dev,
                        op,
                        "sum_halves",
                        y2.ptr(),
                        y.ptr(),
                        n * ob,
                    )?
                };
            }
            out.push(y);
        }
        Ok(out)
    }

    fn gather(
        &self,
        x: &CudaTensor,
        rows: &[u32],
        d: usize,
        op: &'static str,
    ) -> Result<CudaTensor> {
        let idx = self.upload_u32(rows, op)?;
        let out = self.empty(&[rows.len(), d], DType::F32, op)?;
        // SAFETY: indices were bounds-checked by the caller; out holds rows.len()*d f32.
        unsafe {
            ops::elementwise::gather_rows(
                &self.dev,
                x.ptr(),
                Self::slice_ptr(&idx),
                out.ptr(),
                rows.len(),
                d,
            )?
        };
        Ok(out)
    }
}

impl CudaBackend {
    /// Device-to-device copy bandwidth counted as bytes read (a copy reads and writes each
    /// byte; HBM serves both, so read bandwidth is twice the copy rate): best of 5 copies of
    /// 1 GiB, timed with events on the backend's stream.
    fn copy_bandwidth(&self) -> Result<f64> {
        const BYTES: usize = 1 << 30;
        let dev = &self.dev;
        dev.enter("bandwidth")?;
        let src = dev.stream.alloc_zeros::<u8>(BYTES).op("bandwidth")?;
        let mut dst = dev.stream.alloc_zeros::<u8>(BYTES).op("bandwidth")?;
        let mut best = f64::MAX;
        for _ in 0..5 {
            let timing = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
            let start = dev.ctx.new_event(timing).op("bandwidth")?;
            let stop = dev.ctx.new_event(timing).op("bandwidth")?;
            start.record(&dev.stream).op("bandwidth")?;
            dev.stream.memcpy_dtod(&src, &mut dst).op("bandwidth")?;
            stop.record(&dev.stream).op("bandwidth")?;
            stop.synchronize().op("bandwidth")?;
            best = best.min(f64::from(start.elapsed_ms(&stop).op("bandwidth")?) * 1e-3);
        }
        Ok(2.0 * BYTES as f64 / best)
    }
}

impl Backend for CudaBackend {
    type Tensor = CudaTensor;

    fn name(&self) -> String {
        format!("cuda:{} ({})", self.ordinal, self.device_name)
    }

    fn new_process_group(&self, world: usize) -> Result<kimi_ops::ProcessGroupId> {
        let _ = world;
        Ok(kimi_ops::ProcessGroupId {
            bytes: NcclId::new()?.0.to_vec(),
            keep: None,
        })
    }

    fn join_process_group(
        &self,
        id: &[u8],
        rank: usize,
        world: usize,
        timeout: std::time::Duration,
    ) -> Result<Arc<dyn kimi_ops::Collective<Self>>> {
        let id = <[u8; NcclId::LEN]>::try_from(id).map_err(|_| {
            kimi_ops::Error::Device(format!(
                "rank 0 sent an NCCL id of {} bytes, not {}",
                id.len(),
                NcclId::LEN
            ))
        })?;
        Ok(Arc::new(NcclComm::new(
            self,
            &NcclId(id),
            rank,
            world,
            timeout,
        )?))
    }

    fn stores(&self, dtype: DType) -> bool {
        dtype_code(dtype).is_some()
            || dtype == DType::MXFP4
            || (quant::is_planar(dtype) && self.kernel_config().packed_quant_weights)
    }

    fn stores_experts(&self, dtype: DType) -> bool {
        self.kernel_config().keeps_routed_experts(dtype)
    }

    fn synchronize(&self) -> Result<()> {
        self.dev.synchronize("synchronize")
    }

    fn upload(&self, host: HostTensor<'_>) -> Result<CudaTensor> {
        if host.dtype == DType::MXFP4 {
            return self.upload_mxfp4(&host);
        }
        if quant::is_planar(host.dtype) {
            return self.upload_quant(&host);
        }
        let n: usize = host.shape.iter().product();
        if dtype_code(host.dtype).is_none() {
            return Err(Error::Unsupported(format!(
                "upload of dtype {}",
                host.dtype
            )));
        }
        let want = n * host.dtype.size_bytes();
        if host.bytes.len() != want {
            return Err(shape_err(
                "upload",
                format!(
                    "shape {:?} of {} needs {want} bytes, got {}",
                    host.shape,
                    host.dtype,
                    host.bytes.len()
                ),
            ));
        }
        self.dev.enter("upload")?;
        Ok(CudaTensor {
            shape: host.shape.to_vec(),
            dtype: host.dtype,
            buf: Arc::new(self.dev.upload_kept(host.bytes, "upload")?),
            offset: 0,
        })
    }

    fn upload_into(&self, dst: &mut CudaTensor, host: HostTensor<'_>) -> Result<()> {
        // Expert slot fills run outside a replayed pass: how many a step needs varies, and
        // the pass's graphs and arena addresses must not.
        self.dev
            .outside_pass("expert slot fill", || self.fill_slot(dst, host, false))
    }

    fn upload_into_ahead(&self, dst: &mut CudaTensor, host: HostTensor<'_>) -> Result<()> {
        self.dev
            .outside_pass("expert slot fill ahead", || self.fill_slot(dst, host, true))
    }

    fn await_ahead(&self) -> Result<()> {
        self.dev.outside_pass("expert slot fill ahead", || {
            self.dev.await_ahead("await_ahead")
        })
    }

    fn lock_host_region(
        &self,
        region: kimi_ops::HostRegion,
        owner: Arc<dyn Send + Sync>,
    ) -> Result<Option<kimi_ops::LockedRegion>> {
        if !self.kernel_config().pin_host_experts {
            return Ok(None);
        }
        crate::host_lock::lock_host(&self.dev.ctx, region, owner)
    }

    fn upload_f32(&self, shape: &[usize], data: &[f32]) -> Result<CudaTensor> {
        let bytes: Vec<u8> = data.iter().flat_map(|v| v.to_le_bytes()).collect();
        self.upload(HostTensor {
            shape,
            dtype: DType::F32,
            bytes: &bytes,
        })
    }

    fn zeros(&self, shape: &[usize]) -> Result<CudaTensor> {
        self.dev.enter("zeros")?;
        self.zeroed(shape, "zeros")
    }

    fn latent_zeros(&self, shape: &[usize]) -> Result<CudaTensor> {
        self.latent_pool(shape)
    }

    fn fill_zero(&self, t: &mut CudaTensor) -> Result<()> {
        self.dev.enter("fill_zero")?;
        // SAFETY: the buffer holds len() bytes.
        unsafe { self.dev.zero(t.ptr(), t.len_bytes(), "fill_zero") }
    }

    fn to_f32(&self, t: &CudaTensor) -> Result<Vec<f32>> {
        self.dev.enter("to_f32")?;
        if t.dtype == DType::F8E4M3 {
            return Err(Error::Unsupported(
                "to_f32 of an FP8 latent pool (its rows: CudaBackend::fp8_rows)".into(),
            ));
        }
        if t.dtype == DType::MXFP4 {
            return self.to_f32(&self.widen_mxfp4(t, "to_f32")?);
        }
        if quant::is_planar(t.dtype) {
            return self.to_f32(&self.widen_quant(t, DType::F32, "to_f32")?);
        }
        let nb = t.len_bytes();
        if t.dtype == DType::F32 {
            // Straight into the result: no byte buffer and no conversion pass (the logits of
            // a 64-sequence decode step are 42 MB; two host passes over them cost more than
            // the copy itself).
            let mut out = vec![0f32; nb / 4];
            // SAFETY: `out` owns nb bytes (nb / 4 f32, f32 tensors are whole 4-byte values);
            // every byte pattern is a valid f32, and u8 needs no alignment.
            let bytes =
                unsafe { std::slice::from_raw_parts_mut(out.as_mut_ptr().cast::<u8>(), nb) };
            // SAFETY: the tensor holds nb bytes.
            unsafe { self.dev.read(t.ptr(), bytes, "to_f32")? };
            return Ok(out);
        }
        let mut host = vec![0u8; nb];
        // SAFETY: the tensor holds nb bytes.
        unsafe { self.dev.read(t.ptr(), &mut host, "to_f32")? };
        Ok(match t.dtype {
            DType::F32 => host
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect(),
            DType::BF16 => host
                .chunks_exact(2)
                .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32())
                .collect(),
            DType::F16 => host
                .chunks_exact(2)
                .map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32())
                .collect(),
            other => return Err(Error::Unsupported(format!("to_f32 of {other}"))),
        })
    }

    fn shape<'a>(&self, t: &'a CudaTensor) -> &'a [usize] {
        &t.shape
    }

    fn size_bytes(&self, t: &CudaTensor) -> usize {
        t.capacity_bytes()
    }

    fn memory_info(&self) -> Option<(u64, u64)> {
        self.dev.enter("memory_info").ok()?;
        let (free, total) = self.dev.ctx.mem_get_info().ok()?;
        Some((free as u64, total as u64))
    }

    fn measure_workspace<R>(&self, f: impl FnOnce() -> R) -> (R, Option<u64>) {
        // The graph arena is memory the plan must see as used, not as workspace.
        self.dev.reserve_graph_arena();
        let start = self
            .dev
            .synchronize("measure_workspace")
            .and_then(|()| self.dev.reset_pool_peak())
            .and_then(|()| self.dev.pool_used());
        let result = f();
        let end = self
            .dev
            .synchronize("measure_workspace")
            .and_then(|()| self.dev.pool_used());
        let extra = match (start, end) {
            (Ok((in_use, _)), Ok((_, peak))) => Some(peak.saturating_sub(in_use)),
            _ => None,
        };
        (result, extra)
    }

    fn release_unused_memory(&self) -> Result<()> {
        self.dev.trim_pool()
    }

    fn measure_read_bandwidth(&self) -> Option<f64> {
        self.copy_bandwidth().ok()
    }

    fn replayable<R>(&self, key: Option<u64>, f: impl FnOnce() -> R) -> Result<R> {
        self.dev.enter("replay_pass")?;
        self.dev.replay_pass(key, f)
    }

    fn embedding(&self, table: &CudaTensor, ids: &[u32]) -> Result<CudaTensor> {
        const OP: &str = "embedding";
        self.dev.enter(OP)?;
        let (vocab, d) = match table.shape.as_slice() {
            [v, d] => (*v, *d),
            _ => return Err(shape_err(OP, format!("table {:?}", table.shape))),
        };
        if let Some(&bad) = ids.iter().find(|&&i| i as usize >= vocab) {
            return Err(shape_err(
                OP,
                format!("token id {bad} is outside the vocabulary of {vocab}"),
            ));
        }
        let out = self.empty(&[ids.len(), d], DType::F32, OP)?;
        if ids.is_empty() {
            return Ok(out);
        }
        let idx = self.upload_u32(ids, OP)?;
        if quant::is_planar(table.dtype) {
            // A packed table (GGUF files): only the rows asked for are widened.
            // SAFETY: the table is a [vocab, d] matrix in the device planes (its upload
            // checked d against the block size); ids are below vocab; out holds
            // ids.len()*d f32.
            unsafe {
                ops::quant::embed(
                    &self.dev,
                    table.dtype,
                    table.ptr(),
                    Self::slice_ptr(&idx),
                    out.ptr(),
                    ids.len(),
                    d,
                    vocab,
                )?
            };
            return Ok(out);
        }
        let dt = code(table, OP)?;
        // SAFETY: ids are below vocab; out holds ids.len()*d f32.
        unsafe {
            ops::elementwise::embedding(
                &self.dev,
                table.ptr(),
                dt,
                Self::slice_ptr(&idx),
                out.ptr(),
                ids.len(),
                d,
            )?
        };
        Ok(out)
    }

    fn embedding_part(
        &self,
        table: &CudaTensor,
        ids: &[u32],
        first: usize,
        vocab: usize,
    ) -> Result<CudaTensor> {
        const OP: &str = "embedding_part";
        self.dev.enter(OP)?;
        let (rows, d) = match table.shape.as_slice() {
            [r, d] => (*r, *d),
            _ => return Err(shape_err(OP, format!("table {:?}", table.shape))),
        };
        if first.checked_add(rows).is_none_or(|end| end > vocab) {
            return Err(shape_err(
                OP,
                format!("rows {first}..{first}+{rows} are not inside a vocabulary of {vocab}"),
            ));
        }
        if let Some(&bad) = ids.iter().find(|&&i| i as usize >= vocab) {
            return Err(shape_err(
                OP,
                format!("token id {bad} is outside the vocabulary of {vocab}"),
            ));
        }
        // Every id looked up (another rank's as row 0) and added into zero rows at weight
        // 1 for this rank's, 0 for the others': the same launches and upload sizes for any
        // ids of one length, so that a captured pass replays. Table rows are finite, so
        // 0 · row adds nothing.
        let (mut local, mut keep) = (Vec::with_capacity(ids.len()), Vec::new());
        for &id in ids {
            let l = (id as usize).checked_sub(first).filter(|&l| l < rows);
            local.push(l.unwrap_or(0) as u32);
            keep.push(if l.is_some() { 1.0f32 } else { 0.0 });
        }
        let out = self.zeroed(&[ids.len(), d], OP)?;
        if ids.is_empty() {
            return Ok(out);
        }
        let found = self.embedding(table, &local)?;
        let at: Vec<u32> = (0..ids.len() as u32).collect();
        let at = self.upload_u32(&at, OP)?;
        let keep = self.upload_f32(&[ids.len()], &keep)?;
        // SAFETY: `found` holds ids.len() rows of d f32; `at` and `keep` ids.len() entries;
        // every position in `at` is below ids.len(), the rows of `out`.
        unsafe {
            ops::elementwise::scatter_add_rows(
                &self.dev,
                found.ptr(),
                Self::slice_ptr(&at),
                keep.ptr(),
                out.ptr(),
                ids.len(),
                d,
            )?
        };
        Ok(out)
    }

    fn matmul(&self, x: &CudaTensor, w: &CudaTensor) -> Result<CudaTensor> {
        self.dev.enter("matmul")?;
        self.matmul_op(x, w, "matmul")
    }

    fn matmul_split(
        &self,
        x: &CudaTensor,
        w: &CudaTensor,
        rows: &[usize],
    ) -> Result<Vec<CudaTensor>> {
        self.dev.enter("matmul")?;
        self.matmul_blocks(x, w, rows, "matmul")
    }

    fn matmul_pair(
        &self,
        a: (&CudaTensor, &CudaTensor),
        b: (&CudaTensor, &CudaTensor),
    ) -> Result<(CudaTensor, CudaTensor)> {
        const OP: &str = "matmul";
        self.dev.enter(OP)?;
        // One token through two matrices of one row length: one launch where both are bf16,
        // or both packed 4-bit of a narrow width.
        let one_token = |(x, w): (&CudaTensor, &CudaTensor)| -> Option<(usize, usize)> {
            let (n, k) = f32_rows(x, OP).ok()?;
            match w.shape.as_slice() {
                [o, wk] if n == 1 && *wk == k => Some((k, *o)),
                _ => None,
            }
        };
        if let (Some((ka, oa)), Some((kb, ob))) = (one_token(a), one_token(b)) {
            let packed = quant::is_planar(a.1.dtype) && quant::is_planar(b.1.dtype);
            let bf16 = a.1.dtype == DType::BF16 && b.1.dtype == DType::BF16;
            let aligned = [a.0, a.1, b.0, b.1]
                .iter()
                .all(|t| t.ptr().is_multiple_of(16));
            if ka == kb && (packed || (bf16 && ka.is_multiple_of(8) && aligned)) {
                let (ya, yb) = (
                    self.empty(&[1, oa], DType::F32, OP)?,
                    self.empty(&[1, ob], DType::F32, OP)?,
                );
                let cfg = self.kernel_config();
                let pa = [a.0.ptr(), a.1.ptr(), ya.ptr()];
                let pb = [b.0.ptr(), b.1.ptr(), yb.ptr()];
                // SAFETY: each x holds k f32 (one row), each w an [o, k] matrix of its type
                // (packed: in the device planes; bf16: 16-byte aligned with k % 8 == 0, as
                // checked above); each y holds its o f32.
                let done = unsafe {
                    if packed {
                        let types = (a.1.dtype, b.1.dtype);
                        ops::quant::gemv_narrow_pair(&self.dev, &cfg, types, pa, oa, pb, ob, ka)?
                    } else {
                        ops::gemm::gemv_bf16_pair(&self.dev, &cfg, pa, oa, pb, ob, ka)?
                    }
                };
                if done {
                    return Ok((ya, yb));
                }
            }
        }
        Ok((self.matmul_op(a.0, a.1, OP)?, self.matmul_op(b.0, b.1, OP)?))
    }

    fn rms_norm(&self, x: &CudaTensor, weight: &CudaTensor, eps: f32) -> Result<CudaTensor> {
        const OP: &str = "rms_norm";
        self.dev.enter(OP)?;
        let (n, d) = f32_rows(x, OP)?;
        if weight.len() != d {
            return Err(shape_err(
                OP,
                format!("x {:?}, weight {:?}", x.shape, weight.shape),
            ));
        }
        let wdt = code(weight, OP)?;
        let out = self.empty(&x.shape, DType::F32, OP)?;
        if n * d > 0 {
            // SAFETY: x/out hold n*d f32, weight d elements of dtype wdt.
            unsafe {
                ops::elementwise::rms_norm(
                    &self.dev,
                    x.ptr(),
                    weight.ptr(),
                    wdt,
                    0,
                    out.ptr(),
                    n,
                    d,
                    eps,
                )?
            };
        }
        Ok(out)
    }

    fn add_rms_norm(
        &self,
        x: &mut CudaTensor,
        y: &CudaTensor,
        weight: &CudaTensor,
        eps: f32,
    ) -> Result<CudaTensor> {
        const OP: &str = "add_rms_norm";
        self.dev.enter(OP)?;
        let (n, d) = f32_rows(x, OP)?;
        if x.shape != y.shape || y.dtype != DType::F32 || weight.len() != d {
            return Err(shape_err(
                OP,
                format!(
                    "x {:?}, y {:?}, weight {:?}",
                    x.shape, y.shape, weight.shape
                ),
            ));
        }
        let wdt = code(weight, OP)?;
        let out = self.empty(&x.shape, DType::F32, OP)?;
        if n * d > 0 {
            // SAFETY: x, y and out hold n*d f32 (out is fresh); weight d elements.
            unsafe {
                ops::elementwise::add_rms_norm(
                    &self.dev,
                    x.ptr(),
                    y.ptr(),
                    weight.ptr(),
                    wdt,
                    out.ptr(),
                    n,
                    d,
                    eps,
                )?
            };
        }
        Ok(out)
    }

    fn add_assign(&self, x: &mut CudaTensor, y: &CudaTensor) -> Result<()> {
        const OP: &str = "add";
        self.dev.enter(OP)?;
        if x.shape != y.shape || x.dtype != DType::F32 || y.dtype != DType::F32 {
            return Err(shape_err(OP, format!("{:?} + {:?}", x.shape, y.shape)));
        }
        if x.is_empty() {
            return Ok(());
        }
        // SAFETY: both hold len f32.
        unsafe { ops::elementwise::binary(&self.dev, OP, "add_assign", x.ptr(), y.ptr(), x.len()) }
    }

    fn select_rows(&self, x: &CudaTensor, rows: &[usize]) -> Result<CudaTensor> {
        const OP: &str = "select_rows";
        self.dev.enter(OP)?;
        let (n, d) = f32_rows(x, OP)?;
        if let Some(&r) = rows.iter().find(|&&r| r >= n) {
            return Err(shape_err(OP, format!("row {r} of {n}")));
        }
        let idx: Vec<u32> = rows.iter().map(|&r| r as u32).collect();
        self.gather(x, &idx, d, OP)
    }

    fn split_cols(&self, x: &CudaTensor, widths: &[usize]) -> Result<Vec<CudaTensor>> {
        const OP: &str = "split_cols";
        self.dev.enter(OP)?;
        let (n, d) = f32_rows(x, OP)?;
        if widths.iter().sum::<usize>() != d {
            return Err(shape_err(
                OP,
                format!("widths {widths:?} do not add up to {d}"),
            ));
        }
        // One row: each block of columns is contiguous, so the parts are views of `x` (no
        // copies: a decode step splits fused projections this way). Offsets stay 64-byte
        // aligned for the kernels' vector loads.
        let mut starts = widths.iter().scan(0, |acc, &w| {
            let s = *acc;
            *acc += w;
            Some(s)
        });
        if n == 1 && starts.all(|s| (s * 4).is_multiple_of(64)) {
            let mut off = 0;
            let mut parts = Vec::with_capacity(widths.len());
            for &w in widths {
                parts.push(CudaTensor {
                    shape: vec![1, w],
                    dtype: DType::F32,
                    buf: x.buf.clone(),
                    offset: x.offset + off * 4,
                });
                off += w;
            }
            return Ok(parts);
        }
        let mut off = 0;
        let mut parts = Vec::with_capacity(widths.len());
        for &w in widths {
            let p = self.empty(&[n, w], DType::F32, OP)?;
            // SAFETY: x holds n rows of d, p n rows of w, off + w <= d.
            unsafe {
                ops::elementwise::copy_cols(&self.dev, x.ptr(), d, off, p.ptr(), w, 0, n, w)?
            };
            parts.push(p);
            off += w;
        }
        Ok(parts)
    }

    fn concat_cols(&self, parts: &[&CudaTensor]) -> Result<CudaTensor> {
        const OP: &str = "concat_cols";
        self.dev.enter(OP)?;
        let first = parts
            .first()
            .ok_or_else(|| shape_err(OP, "nothing to concatenate".into()))?;
        let n = f32_rows(first, OP)?.0;
        let mut dims = Vec::with_capacity(parts.len());
        for p in parts {
            let (pn, pw) = f32_rows(p, OP)?;
            if pn != n {
                return Err(shape_err(OP, format!("row counts {pn} and {n} differ")));
            }
            dims.push(pw);
        }
        let total: usize = dims.iter().sum();
        let out = self.empty(&[n, total], DType::F32, OP)?;
        if let ([a, b], [wa, wb]) = (parts, dims.as_slice()) {
            // SAFETY: a holds n rows of wa, b n rows of wb, out n rows of wa + wb.
            unsafe {
                ops::elementwise::concat_cols2(&self.dev, a.ptr(), *wa, b.ptr(), *wb, out.ptr(), n)?
            };
            return Ok(out);
        }
        let mut off = 0;
        for (p, w) in parts.iter().zip(dims) {
            // SAFETY: p holds n rows of w, out n rows of total, off + w <= total.
            unsafe {
                ops::elementwise::copy_cols(&self.dev, p.ptr(), w, 0, out.ptr(), total, off, n, w)?
            };
            off += w;
        }
        Ok(out)
    }

    fn sigmoid(&self, x: &CudaTensor) -> Result<CudaTensor> {
        const OP: &str = "sigmoid";
        self.dev.enter(OP)?;
        f32_rows(x, OP)?;
        let out = self.empty(&x.shape, DType::F32, OP)?;
        if !x.is_empty() {
            // SAFETY: both hold len f32.
            unsafe {
                ops::elementwise::binary(&self.dev, OP, "sigmoid", x.ptr(), out.ptr(), x.len())?
            };
        }
        Ok(out)
    }

    fn sigmoid_gate(&self, x: &CudaTensor, gate: &CudaTensor) -> Result<CudaTensor> {
        self.gate_sigmoid(x, gate)
    }

    fn attn_res_mix(
        &self,
        blocks: &[&CudaTensor],
        partial: &CudaTensor,
        w_eff: &CudaTensor,
        eps: f32,
    ) -> Result<CudaTensor> {
        self.mix_attn_res(blocks, partial, w_eff, eps)
    }

    fn ffn(
        &self,
        x: &CudaTensor,
        w: &MlpWeights<CudaTensor>,
        act: Activation,
    ) -> Result<CudaTensor> {
        self.gated_ffn(x, w, act)
    }

    fn moe_route(
        &self,
        x: &CudaTensor,
        router: &CudaTensor,
        correction_bias: Option<&CudaTensor>,
        routing: &MoeRouting,
    ) -> Result<MoeRoutes<CudaTensor>> {
        self.route_moe(x, router, correction_bias, routing)
    }

    fn moe_experts(
        &self,
        x: &CudaTensor,
        routes: &MoeRoutes<CudaTensor>,
        experts: &ExpertView<'_, CudaTensor>,
        act: Activation,
    ) -> Result<CudaTensor> {
        if experts.has_absent() {
            return self.run_present_experts(x, routes, experts, act);
        }
        self.run_routed_experts(x, routes, experts, act)
    }

    fn mlp(&self, x: &CudaTensor, w: &MlpWeights<CudaTensor>) -> Result<CudaTensor> {
        const OP: &str = "mlp";
        self.dev.enter(OP)?;
        let gate = self.matmul_op(x, &w.gate, OP)?;
        let up = self.matmul_op(x, &w.up, OP)?;
        if gate.shape != up.shape {
            return Err(shape_err(OP, "gate and up widths differ".into()));
        }
        if !gate.is_empty() {
            // SAFETY: gate and up hold len f32 each.
            unsafe {
                ops::elementwise::binary(
                    &self.dev,
                    OP,
                    "silu_mul",
                    gate.ptr(),
                    up.ptr(),
                    gate.len(),
                )?
            };
        }
        self.matmul_op(&gate, &w.down, OP)
    }

    fn moe(
        &self,
        x: &CudaTensor,
        w: &MoeWeights<CudaTensor>,
        r: &MoeRouting,
    ) -> Result<(CudaTensor, CudaTensor)> {
        self.moe_layer(x, w, r)
    }

    fn argmax_rows(&self, x: &CudaTensor) -> Result<Vec<u32>> {
        const OP: &str = "argmax_rows";
        self.dev.enter(OP)?;
        let (rows, d) = f32_rows(x, OP)?;
        if rows == 0 {
            return Ok(Vec::new());
        }
        let ids = self.dev.alloc(rows * 4, OP)?;
        let di = d as i32;
        let mut b = self.dev.kernel(OP, "argmax_rows")?;
        b.arg(&x.ptr()).arg(&ids.ptr()).arg(&di);
        // SAFETY: x holds rows * d f32 and ids rows u32.
        unsafe { b.launch(grid((rows as u32, 1, 1), 256, 0)) }.op(OP)?;
        let mut out = vec![0u32; rows];
        // SAFETY: `out` owns rows * 4 bytes; every byte pattern is a valid u32.
        let bytes =
            unsafe { std::slice::from_raw_parts_mut(out.as_mut_ptr().cast::<u8>(), rows * 4) };
        // SAFETY: `ids` holds rows * 4 bytes.
        unsafe { self.dev.read(ids.ptr(), bytes, OP)? };
        Ok(out)
    }

    fn samples_on_device(&self) -> bool {
        true
    }

    fn sample_rows(
        &self,
        x: &mut CudaTensor,
        params: &[RowSampling],
        penalties: &[TokenPenalty],
    ) -> Result<Vec<u32>> {
        self.sample_rows_on_device(x, params, penalties)
    }

    fn expert_ids(&self, chosen: &CudaTensor) -> Result<Vec<u32>> {
        // `moe_route` writes u32 ids into the f32-typed buffer: read the bits back.
        Ok(self.to_f32(chosen)?.into_iter().map(f32::to_bits).collect())
    }

    fn read_routes(&self, routes: &MoeRoutes<CudaTensor>) -> Result<(Vec<u32>, Vec<f32>)> {
        let mut sets = self.read_route_sets(&[routes])?;
        sets.pop()
            .ok_or_else(|| shape_err("read_routes", "no routes read".into()))
    }

    fn read_route_sets(
        &self,
        sets: &[&MoeRoutes<CudaTensor>],
    ) -> Result<Vec<(Vec<u32>, Vec<f32>)>> {
        self.read_routes_back(sets)
    }

    fn upload_expert_ids(&self, shape: &[usize], ids: &[u32]) -> Result<CudaTensor> {
        // The layout `moe_route` writes: u32 ids in the f32-typed buffer (bits kept).
        let bits: Vec<f32> = ids.iter().map(|&e| f32::from_bits(e)).collect();
        self.upload_f32(shape, &bits)
    }

    fn expert_counts(&self, chosen: &[&CudaTensor], num_experts: usize) -> Result<Vec<Vec<u32>>> {
        const OP: &str = "expert_counts";
        self.dev.enter(OP)?;
        let e = num_experts;
        if chosen.is_empty() || e == 0 {
            return Ok(vec![Vec::new(); chosen.len()]);
        }
        // u32 counts in an f32-typed buffer (zero bits = 0), read back as bits.
        let counts = self.zeroed(&[chosen.len(), e], OP)?;
        // Ids are u32 bits in f32-typed tensors; anything else counts nothing.
        let layers: Vec<(u64, usize)> = chosen
            .iter()
            .map(|c| match c.dtype {
                DType::F32 => (c.ptr(), c.len()),
                _ => (0, 0),
            })
            .collect();
        // SAFETY: each layer's address holds its n u32 ids; counts holds chosen.len() * e u32.
        unsafe { ops::moe::count_layers(&self.dev, &layers, counts.ptr(), e)? };
        let bits = self.to_f32(&counts)?;
        Ok(bits
            .chunks(e)
            .map(|row| row.iter().map(|v| v.to_bits()).collect())
            .collect())
    }

    fn short_conv_silu(
        &self,
        x: &CudaTensor,
        weight: &CudaTensor,
        segments: &[Segment],
        states: &mut [&mut CudaTensor],
    ) -> Result<CudaTensor> {
        const OP: &str = "short_conv";
        self.dev.enter(OP)?;
        let (n, c) = f32_rows(x, OP)?;
        let wn = weight.len();
        if c == 0 || wn == 0 || !wn.is_multiple_of(c) {
            return Err(shape_err(
                OP,
                format!("weight {:?} for {c} channels", weight.shape),
            ));
        }
        let width = wn / c;
        let wdt = code(weight, OP)?;
        check_segments(OP, segments, states.len(), n)?;
        let out = self.zeroed(&x.shape, OP)?;
        for (seg, state) in segments.iter().zip(states.iter_mut()) {
            if state.dtype != DType::F32 || state.len() != (width - 1) * c {
                return Err(shape_err(
                    OP,
                    format!(
                        "state has {} values, expected {}x{c}",
                        state.len(),
                        width - 1
                    ),
                ));
            }
            let next = self.empty(&state.shape, DType::F32, OP)?;
            // SAFETY: shapes checked above; next does not alias state.
            unsafe {
                ops::conv::short_conv_silu(
                    &self.dev,
                    x.ptr(),
                    weight.ptr(),
                    wdt,
                    state.ptr(),
                    next.ptr(),
                    out.ptr(),
                    seg.start,
                    seg.len,
                    c,
                    width,
                )?
            };
            **state = next;
        }
        Ok(out)
    }

    fn kda_gate(
        &self,
        f: &CudaTensor,
        a_log: &CudaTensor,
        dt_bias: &CudaTensor,
        num_heads: usize,
        gate: KdaGate,
    ) -> Result<CudaTensor> {
        const OP: &str = "kda_gate";
        self.dev.enter(OP)?;
        let (n, width) = f32_rows(f, OP)?;
        if a_log.len() != num_heads
            || dt_bias.len() != width
            || num_heads == 0
            || !width.is_multiple_of(num_heads)
        {
            return Err(shape_err(
                OP,
                format!(
                    "f width {width}, A_log {:?}, dt_bias {:?}, {num_heads} heads",
                    a_log.shape, dt_bias.shape
                ),
            ));
        }
        let (kind, lb) = match gate {
            KdaGate::Softplus => (0, 0.0),
            KdaGate::LowerBound(lb) => (1, lb),
        };
        let g = self.empty(&f.shape, DType::F32, OP)?;
        if n * width > 0 {
            let (adt, bdt) = (code(a_log, OP)?, code(dt_bias, OP)?);
            // SAFETY: shapes checked above.
            unsafe {
                ops::kda::gate(
                    &self.dev,
                    f.ptr(),
                    a_log.ptr(),
                    adt,
                    dt_bias.ptr(),
                    bdt,
                    g.ptr(),
                    n * width,
                    width,
                    width / num_heads,
                    kind,
                    lb,
                )?
            };
        }
        Ok(g)
    }

    fn kda(
        &self,
        q: &CudaTensor,
        k: &CudaTensor,
        v: &CudaTensor,
        g: &CudaTensor,
        beta: &CudaTensor,
        num_heads: usize,
        segments: &[Segment],
        states: &mut [&mut CudaTensor],
        mode: KdaMode,
    ) -> Result<CudaTensor> {
        const OP: &str = "kda";
        self.dev.enter(OP)?;
        let (n, width) = f32_rows(q, OP)?;
        for (name, t) in [("k", k), ("v", v), ("g", g)] {
            if f32_rows(t, OP)? != (n, width) {
                return Err(shape_err(
                    OP,
                    format!("{name} {:?} vs q {:?}", t.shape, q.shape),
                ));
            }
        }
        if num_heads == 0
            || !width.is_multiple_of(num_heads)
            || f32_rows(beta, OP)? != (n, num_heads)
        {
            return Err(shape_err(
                OP,
                format!("q {:?}, beta {:?}, {num_heads} heads", q.shape, beta.shape),
            ));
        }
        check_segments(OP, segments, states.len(), n)?;
        let d = width / num_heads;
        for state in states.iter() {
            if state.dtype != DType::F32 || state.len() != num_heads * d * d {
                return Err(shape_err(
                    OP,
                    format!(
                        "state has {} values, expected {num_heads}x{d}x{d}",
                        state.len()
                    ),
                ));
            }
        }
        let out = self.zeroed(&q.shape, OP)?;
        let qkvg = [q.ptr(), k.ptr(), v.ptr(), g.ptr()];
        // (start, len, state address) of the non-empty segments, by kernel.
        let (mut chunked, mut recurrent) = (vec![], vec![]);
        for (seg, state) in segments.iter().zip(states.iter()) {
            if seg.len == 0 {
                continue;
            }
            let chunk = match mode {
                KdaMode::Auto => seg.len > 1,
                KdaMode::Recurrent => false,
                KdaMode::Chunked => true,
            };
            let entry = (seg.start, seg.len, state.ptr());
            if chunk { &mut chunked } else { &mut recurrent }.push(entry);
        }
        if !ops::kda::has_split_kernels(d) {
            // Other head sizes: one block per head and segment, every mode (the recurrence
            // equals the chunked form to f32 rounding).
            for (start, len, state) in chunked.into_iter().chain(recurrent) {
                // SAFETY: shapes checked above.
                unsafe {
                    ops::kda::recurrent(
                        &self.dev,
                        qkvg,
                        beta.ptr(),
                        state,
                        out.ptr(),
                        start,
                        len,
                        num_heads,
                        d,
                    )?
                };
            }
            return Ok(out);
        }
        // The chunked kernels read q, k, v, g as float4 (fresh allocations are aligned).
        if qkvg.iter().any(|p| !p.is_multiple_of(16)) {
            recurrent.append(&mut chunked);
        }
        let cfg = self.kernel_config();
        let path = plan::plan_kda_chunk(&cfg);
        let mma = path != KdaChunkPath::F32;
        let split = cfg.split();
        let per_chunk = ops::kda::scratch_bytes(d, mma, split);
        // Groups of about equal size when the scratch bound cuts the chunks into several.
        let total: usize = chunked.iter().map(|s| s.1.div_ceil(ops::kda::CHUNK)).sum();
        let max_chunks = ops::kda::max_group_chunks(num_heads, d, mma, split, cfg.kda_group_chunks);
        let max_chunks = total.div_ceil(total.div_ceil(max_chunks).max(1)).max(1);
        for group in ops::kda::launch_groups(&chunked, max_chunks) {
            let (table, chunks) = ops::kda::SegTable::new(&group)?;
            let scratch = self.empty(&[chunks * num_heads * per_chunk / 4], DType::F32, OP)?;
            // SAFETY: shapes checked above; the table's segments lie inside the n rows and
            // their states are distinct `[H, D, D]` f32 tensors (a segment cut by
            // `launch_groups` appears once per group, its pieces in order); scratch has room
            // for every (chunk, head); the inputs are 16-byte aligned.
            unsafe {
                match path {
                    KdaChunkPath::TensorCore(prep) => ops::kda::chunked_mma(
                        &self.dev,
                        qkvg,
                        beta.ptr(),
                        &table,
                        chunks,
                        scratch.ptr(),
                        out.ptr(),
                        num_heads,
                        d,
                        split,
                        prep,
                        cfg.kda_stages,
                    )?,
                    KdaChunkPath::F32 => ops::kda::chunked(
                        &self.dev,
                        qkvg,
                        beta.ptr(),
                        &table,
                        chunks,
                        scratch.ptr(),
                        out.ptr(),
                        num_heads,
                        d,
                        cfg.kda_stages,
                    )?,
                }
            };
        }
        for group in recurrent.chunks(ops::kda::MAX_SEGS) {
            let (table, _) = ops::kda::SegTable::new(group)?;
            // SAFETY: as above.
            unsafe {
                ops::kda::recurrent_split(
                    &self.dev,
                    qkvg,
                    beta.ptr(),
                    &table,
                    out.ptr(),
                    num_heads,
                    d,
                )?
            };
        }
        Ok(out)
    }

    fn kda_decode(
        &self,
        x: &KdaStepInputs<'_, CudaTensor>,
        w: &KdaStepWeights<'_, CudaTensor>,
        num_heads: usize,
        segments: &[Segment],
        caches: &mut [(&mut [CudaTensor; 3], &mut CudaTensor)],
    ) -> Result<CudaTensor> {
        const OP: &str = "kda_decode";
        self.dev.enter(OP)?;
        match self.kda_decode_shape(x, w, num_heads, segments, caches)? {
            Some(d) => self.kda_decode_fused(x, w, num_heads, d, segments, caches),
            None => kimi_ops::kda_decode_composed(self, x, w, num_heads, segments, caches),
        }
    }

    fn gated_rms_norm(
        &self,
        o: &CudaTensor,
        z: &CudaTensor,
        weight: &CudaTensor,
        eps: f32,
    ) -> Result<CudaTensor> {
        const OP: &str = "gated_rms_norm";
        self.dev.enter(OP)?;
        let (n, width) = f32_rows(o, OP)?;
        let d = weight.len();
        if d == 0 || !width.is_multiple_of(d) || f32_rows(z, OP)? != (n, width) {
            return Err(shape_err(
                OP,
                format!(
                    "o {:?}, z {:?}, weight {:?}",
                    o.shape, z.shape, weight.shape
                ),
            ));
        }
        let wdt = code(weight, OP)?;
        let out = self.empty(&o.shape, DType::F32, OP)?;
        if n * width > 0 {
            // SAFETY: o/z/out hold n*width f32 = (n*width/d) rows of d; weight d elements.
            unsafe {
                ops::elementwise::rms_norm(
                    &self.dev,
                    o.ptr(),
                    weight.ptr(),
                    wdt,
                    z.ptr(),
                    out.ptr(),
                    n * width / d,
                    d,
                    eps,
                )?
            };
        }
        Ok(out)
    }

    fn mla(
        &self,
        q: &CudaTensor,
        latent: &CudaTensor,
        kv_b: &CudaTensor,
        dims: &MlaDims,
        segments: &[Segment],
        pool: &mut CudaTensor,
        seqs: &[PagedSeq<'_>],
        mode: MlaMode,
    ) -> Result<CudaTensor> {
        const OP: &str = "mla";
        self.dev.enter(OP)?;
        let MlaDims {
            num_heads: h,
            kv_lora_rank: r,
            qk_nope_head_dim: dn,
            qk_rope_head_dim: dr,
            v_head_dim: dv,
            ..
        } = *dims;
        let (n, qw) = f32_rows(q, OP)?;
        let lw = r + dr;
        if qw != h * (dn + dr)
            || f32_rows(latent, OP)? != (n, lw)
            || kv_b.shape != [h * (dn + dv), r]
        {
            return Err(shape_err(
                OP,
                format!(
                    "q {:?}, latent {:?}, kv_b {:?} do not fit {dims:?}",
                    q.shape, latent.shape, kv_b.shape
                ),
            ));
        }
        check_segments(OP, segments, seqs.len(), n)?;
        let block_size = check_paged(OP, &pool.shape, lw, segments, seqs)?;
        // FP8 pools (`latent_zeros` under `kv_cache: Fp8`) are quantized as rows arrive and
        // widened where they are read.
        let fp8 = match pool.dtype {
            DType::F32 => false,
            DType::F8E4M3 => true,
            other => {
                return Err(shape_err(
                    OP,
                    format!("the latent pool is {other}, not f32 or FP8 rows"),
                ))
            }
        };
        // A packed decompression matrix is widened per call for the MLA kernels.
        let plain_kv_b = self.plain_copy(kv_b, OP)?;
        let kv_b = plain_kv_b.as_ref().unwrap_or(kv_b);
        let kdt = code(kv_b, OP)?;
        // Absorbed segments' rows are all written (mla_uv_project covers every head and
        // column of each); zeroed only where rows could be left over.
        let all_absorbed = segments.iter().all(|s| {
            s.len == 0
                || match mode {
                    MlaMode::Auto => s.len == 1,
                    MlaMode::Absorbed => true,
                    MlaMode::Expanded => false,
                }
        });
        let out = if all_absorbed && rows_tiled(segments, n) {
            self.empty(&[n, h * dv], DType::F32, OP)?
        } else {
            self.zeroed(&[n, h * dv], OP)?
        };
        // Every segment's block table, then the new rows' places (`where_`), in one small
        // upload (one copy node per layer in a decode graph); segment i's table starts at
        // offsets[i].
        let mut flat = Vec::new();
        let mut offsets = Vec::with_capacity(seqs.len());
        for (seg, seq) in segments.iter().zip(seqs) {
            offsets.push(flat.len());
            let used = (seq.num_cached + seg.len).div_ceil(block_size);
            flat.extend_from_slice(&seq.block_table[..used]);
            // Padded to a power of two, so that decode steps upload tables of one size
            // (and a replayed graph's copy stays valid) until the context doubles.
            flat.resize(flat.len() + used.next_power_of_two() - used, 0);
        }
        // Every new latent row to its sequence's position, in one launch.
        let mut where_ = vec![u32::MAX; 2 * n];
        for (i, (seg, seq)) in segments.iter().zip(seqs).enumerate() {
            for j in 0..seg.len {
                let row = seg.start + j;
                where_[2 * row] = offsets[i] as u32;
                where_[2 * row + 1] = u32::try_from(seq.num_cached + j)
                    .map_err(|_| shape_err(OP, "position beyond 2^32".into()))?;
            }
        }
        let where_at = flat.len();
        flat.extend_from_slice(&where_);
        let tables = self.upload_u32(&flat, OP)?;
        let tables_ptr = Self::slice_ptr(&tables);
        let where_ptr = tables_ptr + (where_at * 4) as u64;
        let paged = |i: usize| ops::mla::Paged {
            pool: pool.ptr(),
            table: tables_ptr + (offsets[i] * 4) as u64,
            block_size,
            width: lw,
        };
        // SAFETY: latent holds n rows of width lw; each named table covers its rows' new
        // positions with blocks inside the pool (check_paged), whose rows are lw f32 or, FP8,
        // 8 + lw bytes (made so by latent_pool); where_ holds 2n u32.
        unsafe {
            if fp8 {
                ops::mla_fp8::write_rows_all(
                    &self.dev,
                    latent.ptr(),
                    pool.ptr(),
                    tables_ptr,
                    where_ptr,
                    n,
                    block_size,
                    lw,
                    r,
                )?
            } else {
                ops::mla::write_rows_all(
                    &self.dev,
                    latent.ptr(),
                    pool.ptr(),
                    tables_ptr,
                    where_ptr,
                    n,
                    block_size,
                    lw,
                )?
            }
        };
        // Absorbed segments are attended together (split-KV over the pool through their
        // tables) after every sequence has its new rows; expanded ones one by one.
        let mut pieces = vec![];
        let cfg = self.kernel_config();
        for (i, (seg, seq)) in segments.iter().zip(seqs).enumerate() {
            if seg.len == 0 {
                continue;
            }
            let past = seq.num_cached;
            let total = past + seg.len;
            let absorbed = match mode {
                MlaMode::Auto => seg.len == 1,
                MlaMode::Absorbed => true,
                MlaMode::Expanded => false,
            };
            if absorbed {
                pieces.push(ops::mla::Piece {
                    cache: pool.ptr(),
                    block_table: paged(i).table,
                    past,
                    len: seg.len,
                    q_row: seg.start,
                });
                continue;
            }
            let qp = q.ptr() + (seg.start * qw * 4) as u64;
            let op_ = out.ptr() + (seg.start * h * dv * 4) as u64;
            // The flash kernel reads contiguous rows: gather the sequence's latents (for
            // k_pe) and their c columns (for the decompression GEMM), then
            // c [total, r] · kv_bᵀ → kv [total, H*(dn+dv)].
            let rows = self.empty(&[total, lw], DType::F32, OP)?;
            let c = self.empty(&[total, r], DType::F32, OP)?;
            // SAFETY: rows/c hold total rows of lw / r <= lw f32; the table covers them in a
            // pool of f32 rows or (fp8) FP8 rows.
            unsafe {
                if fp8 {
                    // Widened once per call into the f32 buffers the f32 path gathers into.
                    ops::mla_fp8::gather(&self.dev, paged(i), r, total, lw, rows.ptr())?;
                    ops::mla_fp8::gather(&self.dev, paged(i), r, total, r, c.ptr())?;
                } else {
                    ops::mla::gather(&self.dev, paged(i), total, lw, rows.ptr())?;
                    ops::mla::gather(&self.dev, paged(i), total, r, c.ptr())?;
                }
            }
            let kv = self.matmul_op(&c, kv_b, OP)?;
            // SAFETY: q/out point at this segment's rows (shapes checked above), rows holds
            // `total` contiguous rows of lw f32 and kv `total` rows of H*(dn+dv) f32.
            unsafe {
                ops::mla::expanded(
                    &self.dev,
                    qp,
                    rows.ptr(),
                    kv.ptr(),
                    op_,
                    past,
                    seg.len,
                    dims,
                    &cfg,
                )?
            };
        }
        if !pieces.is_empty() {
            // SAFETY: every piece's rows lie inside q/out (check_segments); its table (inside
            // `tables`, alive until the end of this call and read by kernels queued on the
            // same stream) covers past+len positions of the pool with blocks inside it
            // (check_paged), of FP8 rows exactly when `fp8`; kv_b is [H*(dn+dv), r] of dtype
            // kdt.
            unsafe {
                ops::mla::absorbed(
                    &self.dev,
                    q.ptr(),
                    &pieces,
                    block_size,
                    kv_b.ptr(),
                    kdt,
                    out.ptr(),
                    dims,
                    cfg.mla_decode_min_chunk,
                    fp8,
                )?
            };
        }
        Ok(out)
    }
}
