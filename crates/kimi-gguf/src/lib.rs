//! GGUF files for kimi-infer: a validating, memory-mapped reader, a writer, and the ggml
//! block formats.
//!
//! - [`GgufFile::open`] maps a GGUF v2/v3 file and validates the whole header up front:
//!   every count is checked against the file size before anything is allocated for it,
//!   every tensor's type is known and its data lies inside the file at an aligned offset.
//!   A corrupt or truncated file gives a [`GgufError`] naming the file and the problem,
//!   never a panic.
//! - Metadata comes back in file order as [`Value`]s, with typed getters
//!   ([`GgufFile::get_u32`], [`GgufFile::get_str`], ...).
//! - [`GgufFile::tensor`] borrows a tensor's raw bytes; [`dequantize`] turns them into
//!   `f32`, and [`quantize`] produces them (reference-quality quantizers for Q8_0, Q4_0,
//!   Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K).
//! - [`GgufWriter`] writes a GGUF v3 file.
//!
//! Shapes: GGUF stores ggml's `ne`, innermost dimension first ([`TensorInfo::ne`]);
//! [`TensorInfo::shape_outer_first`] gives the row-major `[rows, cols]` order used in the
//! rest of kimi-infer.
//!
//! ```no_run
//! # fn main() -> Result<(), kimi_gguf::GgufError> {
//! let file = kimi_gguf::GgufFile::open("models/SmolLM2-135M-Instruct.Q4_1.gguf")?;
//! let num_layers = file.get_u32("llama.block_count")?;
//! let q = file.tensor("blk.0.attn_q.weight")?;
//! let [rows, cols] = q.info.shape_outer_first()[..] else { panic!("a matrix") };
//! let weights: Vec<f32> = q.to_f32()?; // rows * cols values, row-major
//! # let _ = (num_layers, rows, cols, weights);
//! # Ok(())
//! # }
//! ```
#![deny(unsafe_op_in_unsafe_fn)]
#![deny(missing_docs)]
#![warn(clippy::unwrap_used)]

mod error;
mod file;
mod header;
mod quant;
mod types;
mod value;
mod writer;

pub use error::{GgufError, Result};
pub use file::{GgufFile, TensorData, TensorInfo};
pub use header::DEFAULT_ALIGNMENT;
pub use quant::mxfp4;
pub use quant::{dequantize, dequantize_row, quantize, quantize_into};
pub use types::{GgmlType, QK_K};
pub use value::{Array, Value, ValueType};
pub use writer::GgufWriter;
