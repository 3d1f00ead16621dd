//! The device: one CUDA context and stream, a cuBLAS handle and the embedded kernels.

use std::collections::HashMap;
use std::sync::Arc;

use cudarc::cublas::CudaBlas;
use cudarc::driver::sys::CUfunction_attribute_enum;
use cudarc::driver::{CudaContext, CudaFunction, CudaStream, LaunchArgs, LaunchConfig};
use cudarc::nvrtc::Ptx;
use kimi_ops::Result;

use crate::error::{Error, OpContext};

/// Kernels with more than 48 KiB of dynamic shared memory opt in to this much.
pub(crate) const MAX_DYNAMIC_SMEM_BYTES: u32 = 200 * 1024;

/// Kernels that get the large dynamic shared memory limit.
const BIG_SMEM_KERNELS: &[&str] = &[
    "mla_flash_prefill",
    "mla_flash_prefill_vec",
    "mla_decode_partial",
    "mla_decode_partial_vec",
    "moe_route",
    "kda_chunk_prep_64",
    "kda_chunk_prep_128",
    "kda_chunk_state_64",
    "kda_chunk_state_128",
];

/// Every kernel symbol, by module (the `kernels/<module>.cu` file stem).
const KERNELS: &[(&str, &[&str])] = &[
    (
        "elementwise",
        &[
            "embedding",
            "rms_norm",
            "add_assign",
            "sigmoid",
            "silu_mul",
            "copy_cols",
            "gather_rows",
            "scatter_add_rows",
            "cast_f32_bf16",
            "cast_f32_f16",
            "cast_to_f32",
            "split_f32_bf16",
            "split_f32_f16",
            "sum_halves",
        ],
    ),
    ("conv", &["short_conv_silu", "short_conv_state"]),
    ("gemv", &["gemv_bf16", "gemv_bf16_8"]),
    (
        "kda",
        &[
            "kda_gate",
            "kda_recurrent_32",
            "kda_recurrent_64",
            "kda_recurrent_128",
            "kda_recurrent_split_64",
            "kda_recurrent_split_128",
            "kda_chunk_prep_64",
            "kda_chunk_prep_128",
            "kda_chunk_state_64",
            "kda_chunk_state_128",
            "kda_decode_64",
            "kda_decode_128",
        ],
    ),
    (
        "mla",
        &[
            "mla_flash_prefill",
            "mla_flash_prefill_vec",
            "mla_q_absorb",
            "mla_decode_partial",
            "mla_decode_partial_vec",
            "mla_decode_combine",
            "mla_uv_project",
            "mla_paged_write",
            "mla_paged_gather",
        ],
    ),
    (
        "moe",
        &["moe_route", "moe_lists", "moe_expert_gemv", "moe_combine"],
    ),
    ("moe_gemm", &["moe_grouped_mma"]),
];

/// One GPU: context, the stream every operation runs on, cuBLAS and the kernel table.
pub(crate) struct Device {
    pub(crate) ctx: Arc<CudaContext>,
    pub(crate) stream: Arc<CudaStream>,
    pub(crate) blas: CudaBlas,
    functions: HashMap<&'static str, CudaFunction>,
}

impl Device {
    pub(crate) fn new(ordinal: usize) -> Result<Self> {
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
        let stream = ctx.default_stream();
        let blas = CudaBlas::new(stream.clone()).op("init cuBLAS")?;
        let mut functions = HashMap::new();
        for (module, names) in KERNELS {
            let cubin = kimi_cuda_kernels::cubin(module).ok_or_else(|| Error::MissingKernel {
                op: "init",
                name: (*module).to_string(),
            })?;
            let m = ctx
                .load_module(Ptx::from_binary(cubin.to_vec()))
                .op("load kernels")?;
            for name in *names {
                let f = m.load_function(name).op("load kernel")?;
                if BIG_SMEM_KERNELS.contains(name) {
                    f.set_attribute(
                        CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                        MAX_DYNAMIC_SMEM_BYTES as i32,
                    )
                    .op("set kernel attribute")?;
                }
                functions.insert(*name, f);
            }
        }
        Ok(Self {
            ctx,
            stream,
            blas,
            functions,
        })
    }

    /// Makes the context current on the calling thread.
    pub(crate) fn enter(&self, op: &'static str) -> Result<()> {
        self.ctx.bind_to_thread().op(op)
    }

    /// A launch builder for kernel `name`.
    pub(crate) fn kernel(&self, op: &'static str, name: &str) -> Result<LaunchArgs<'_>> {
        let f = self
            .functions
            .get(name)
            .ok_or_else(|| Error::MissingKernel {
                op,
                name: name.to_string(),
            })?;
        Ok(self.stream.launch_builder(f))
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
