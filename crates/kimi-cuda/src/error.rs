//! Errors of the CUDA backend. They reach callers as [`kimi_ops::Error::Device`], named by
//! the operation that failed.

/// A failure inside the CUDA backend.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A CUDA driver, cuBLAS or kernel-launch call failed.
    #[error("{op}: CUDA error: {detail}")]
    Cuda {
        /// The backend operation.
        op: &'static str,
        /// The driver's message.
        detail: String,
    },
    /// A kernel this operation needs was not embedded in the binary.
    #[error("{op}: kernel {name} is missing from the embedded cubins")]
    MissingKernel {
        /// The backend operation.
        op: &'static str,
        /// The kernel's symbol.
        name: String,
    },
}

impl From<Error> for kimi_ops::Error {
    fn from(e: Error) -> Self {
        kimi_ops::Error::Device(e.to_string())
    }
}

/// Names the operation of a failed CUDA call: `call().op("rms_norm")?`.
#[cfg(feature = "cuda")]
pub(crate) trait OpContext<T> {
    /// Converts the error to [`kimi_ops::Error::Device`] naming `op`.
    fn op(self, op: &'static str) -> kimi_ops::Result<T>;
}

#[cfg(feature = "cuda")]
impl<T, E: std::fmt::Display> OpContext<T> for std::result::Result<T, E> {
    fn op(self, op: &'static str) -> kimi_ops::Result<T> {
        self.map_err(|e| {
            Error::Cuda {
                op,
                detail: e.to_string(),
            }
            .into()
        })
    }
}
