//! CUDA kernels of kimi-infer, compiled at build time to `sm_90a` cubins and embedded.
//!
//! With the `cuda` feature, `build.rs` runs `$CUDA_HOME/bin/nvcc` (the pinned PyPI toolkit
//! from `scripts/cuda/setup.sh`) on every `kernels/*.cu`; [`CUBINS`] lists one cubin per
//! source file, named by its stem (`elementwise`, `kda`, ...). Without the feature the table
//! is empty and no toolkit is needed. Kernel entry points are `extern "C"`, take raw device
//! pointers, integer sizes and dtype codes (0 = f32, 1 = bf16, 2 = f16); `kimi-cuda` launches
//! them.
//!
//! [`cutlass`] (with the feature) declares the C functions of `cutlass/*.cu`, kernels built
//! from CUTLASS templates whose parameters are made on the host, linked as a static library.
#![deny(unsafe_code)]
#![deny(missing_docs)]

/// `(module name, cubin bytes)` for every kernel source file.
pub static CUBINS: &[(&str, &[u8])] = include!(concat!(env!("OUT_DIR"), "/cubins.rs"));

/// The cubin of module `name`, if it was built.
pub fn cubin(name: &str) -> Option<&'static [u8]> {
    CUBINS.iter().find(|(n, _)| *n == name).map(|(_, b)| *b)
}

/// The C interfaces of `cutlass/moe_grouped.cu` and `flashinfer/mla_prefill.cu` (see those
/// files for the operations).
#[cfg(feature = "cuda")]
#[allow(unsafe_code)]
pub mod cutlass {
    use std::ffi::c_void;

    extern "C" {
        /// Bytes of the per-group argument arrays for `groups` groups.
        pub fn kimi_moe_grouped_scratch_bytes(groups: i32) -> usize;
        /// Bytes of CUTLASS's workspace (`d_f32`: f32 output, else bf16); 0 without a device.
        pub fn kimi_moe_grouped_workspace_bytes(groups: i32, d_f32: i32) -> usize;
        /// One grouped projection of every routed pair; 0 on success, else the failing step.
        pub fn kimi_moe_grouped_gemm(
            glu: i32,
            d_f32: i32,
            experts: i32,
            offsets: *const u32,
            wtab: *const u64,
            a: *const c_void,
            d: *mut c_void,
            n: i32,
            k: i32,
            ldd: i32,
            beta: f32,
            scratch: *mut c_void,
            workspace: *mut c_void,
            stream: *mut c_void,
        ) -> i32;
        /// Causal attention of one MLA prefill segment (bf16, heads of 192 / 128); 0 on
        /// success, 1 for unsupported sizes, else 100 + the CUDA error.
        pub fn kimi_mla_prefill_sm90(
            q: *const c_void,
            k: *const c_void,
            v: *const c_void,
            o: *mut c_void,
            qo_len: i32,
            kv_len: i32,
            heads: i32,
            q_stride_n: i64,
            k_stride_n: i64,
            v_stride_n: i64,
            o_stride_n: i64,
            sm_scale: f32,
            stream: *mut c_void,
        ) -> i32;
    }
}
