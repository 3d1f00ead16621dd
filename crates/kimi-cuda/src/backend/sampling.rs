//! Token sampling on the device (`Backend::sample_rows`): penalties in place, then one
//! block per row of `sample_rows` (`kernels/sampling.cu`); only the ids come back.

use kimi_ops::{Error, Result, RowSampling, TokenPenalty};

use super::{f32_rows, shape_err, CudaBackend};
use crate::device::{flat, grid};
use crate::error::OpContext;
use crate::tensor::CudaTensor;

const OP: &str = "sample_rows";

/// Threads per row of `sample_rows` (`sampling::NT`).
const THREADS: u32 = 1024;

/// Dynamic shared memory of `sample_rows` (`struct sampling::Shared`: 32 per-warp
/// histograms of 256 u64 bins, 32 pairs of u64 partial sums, 4 u64 and two 4-byte values).
const SMEM_BYTES: u32 = 32 * 256 * 8 + 32 * 2 * 8 + 4 * 8 + 8;

/// The bytes of a slice of plain `repr(C)` records of 4-byte fields.
fn words<T: Copy>(items: &[T], fields: impl Fn(&T) -> Vec<u32>) -> Vec<u8> {
    items
        .iter()
        .flat_map(|t| fields(t).into_iter().flat_map(u32::to_le_bytes))
        .collect()
}

impl CudaBackend {
    pub(super) fn sample_rows_on_device(
        &self,
        x: &mut CudaTensor,
        params: &[RowSampling],
        penalties: &[TokenPenalty],
    ) -> Result<Vec<u32>> {
        self.dev.enter(OP)?;
        let (rows, vocab) = f32_rows(x, OP)?;
        if rows != params.len() {
            return Err(shape_err(
                OP,
                format!("{rows} logits rows for {} sampling rows", params.len()),
            ));
        }
        if let Some(p) = penalties.iter().find(|p| p.row as usize >= rows) {
            return Err(shape_err(
                OP,
                format!("a penalty for row {} of {rows}", p.row),
            ));
        }
        if rows == 0 {
            return Ok(Vec::new());
        }
        let vocab_i = i32::try_from(vocab)
            .ok()
            .filter(|&v| v < 1 << 23)
            .ok_or_else(|| Error::Unsupported(format!("sampling a vocabulary of {vocab}")))?;
        let param_bytes = words(params, |p| {
            vec![
                p.temperature.to_bits(),
                p.top_k,
                p.top_p.to_bits(),
                p.min_p.to_bits(),
                p.repetition_penalty.to_bits(),
                p.frequency_penalty.to_bits(),
                p.presence_penalty.to_bits(),
                p.uniform.to_bits(),
            ]
        });
        let params_dev = self.dev.upload(&param_bytes, OP)?;
        let pens_dev = if penalties.is_empty() {
            None
        } else {
            let bytes = words(penalties, |p| vec![p.row, p.token, p.count]);
            let n = penalties.len();
            let n_i = i32::try_from(n)
                .map_err(|_| Error::Unsupported(format!("{n} penalised tokens")))?;
            let buf = self.dev.upload(&bytes, OP)?;
            let mut b = self.dev.kernel("sampling", "apply_penalties")?;
            b.arg(&x.ptr())
                .arg(&vocab_i)
                .arg(&params_dev.ptr())
                .arg(&buf.ptr())
                .arg(&n_i);
            // SAFETY: x holds rows * vocab f32, params `rows` records, buf `n` records whose
            // rows are below `rows` (checked above); one thread per record.
            unsafe { b.launch(flat(n)) }.op(OP)?;
            Some(buf)
        };
        let ids = self.dev.alloc(rows * 4, OP)?;
        let mut b = self.dev.kernel("sampling", "sample_rows")?;
        b.arg(&x.ptr())
            .arg(&vocab_i)
            .arg(&params_dev.ptr())
            .arg(&ids.ptr());
        // SAFETY: as above; one block of THREADS per row with the kernel's shared memory.
        unsafe { b.launch(grid((rows as u32, 1, 1), THREADS, SMEM_BYTES)) }.op(OP)?;
        let mut out = vec![0u32; rows];
        // SAFETY: `out` owns rows * 4 bytes; every byte pattern is a valid u32.
        let bytes =
            unsafe { std::slice::from_raw_parts_mut(out.as_mut_ptr().cast::<u8>(), rows * 4) };
        // SAFETY: `ids` holds rows * 4 bytes; the read waits for the kernels.
        unsafe { self.dev.read(ids.ptr(), bytes, OP)? };
        drop((params_dev, pens_dev));
        Ok(out)
    }
}
