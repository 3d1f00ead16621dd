//! CUDA kernels of kimi-infer, compiled at build time to `sm_90a` cubins and embedded.
//!
//! With the `cuda` feature, `build.rs` runs `$CUDA_HOME/bin/nvcc` (the pinned PyPI toolkit
//! from `scripts/cuda/setup.sh`) on every `kernels/*.cu`; [`CUBINS`] lists one cubin per
//! source file, named by its stem (`elementwise`, `kda`, ...). Without the feature the table
//! is empty and no toolkit is needed. Kernel entry points are `extern "C"`, take raw device
//! pointers, integer sizes and dtype codes (0 = f32, 1 = bf16, 2 = f16); `kimi-cuda` launches
//! them.
#![forbid(unsafe_code)]
#![deny(missing_docs)]

/// `(module name, cubin bytes)` for every kernel source file.
pub static CUBINS: &[(&str, &[u8])] = include!(concat!(env!("OUT_DIR"), "/cubins.rs"));

/// The cubin of module `name`, if it was built.
pub fn cubin(name: &str) -> Option<&'static [u8]> {
    CUBINS.iter().find(|(n, _)| *n == name).map(|(_, b)| *b)
}
