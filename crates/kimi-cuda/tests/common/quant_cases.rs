//! Op cases of weights kept packed on the device (Q4Z, Q8Z, F8S: AWQ / GPTQ /
//! compressed-tensors INT4 and INT8, FP8), shared by `tests/backend_ops.rs` and
//! `examples/check.rs` like `op_cases.rs`. The GEMV cases (1 to 8 rows) compare f32 products
//! at the default tolerance; the prefill cases widen the weights to bf16 for cuBLAS and
//! carry `[bf16 weights]` (the tolerance of the bf16-operand cases).
#![allow(dead_code)]

use kimi_core::{qblocks, DType};
use kimi_ops::{Backend, HostTensor, MlpWeights};

use super::op_cases::{Case, Res, Rng, Runner};

macro_rules! quant_case {
    ($f:expr) => {{
        let c: Case = Box::new(move |r: &dyn Runner| match (r.cpu(), r.cuda()) {
            (Some(b), _) => $f(b),
            (_, Some(b)) => $f(b),
            _ => unreachable!(),
        });
        c
    }};
}

/// The packed types these cases cover.
pub const DTYPES: [DType; 3] = [DType::Q4Z, DType::Q8Z, DType::F8S];

/// Stored blocks of a `[rows, cols]` matrix of `dtype` (`cols % 32 == 0`): random codes,
/// scales near what the quantizers write for weights of magnitude ~0.1, zero points
/// around the middle of the code range (every 5th block a fractional one, which the
/// format allows), F8S codes without the NaN bytes.
pub fn quant_blocks(rng: &mut Rng, dtype: DType, rows: usize, cols: usize) -> Vec<u8> {
    let blocks = rows * cols / 32;
    let bb = dtype.block_bytes();
    let mut out = vec![0u8; blocks * bb];
    for (i, b) in out.chunks_exact_mut(bb).enumerate() {
        let codes: [u8; 32] = std::array::from_fn(|_| (rng.next() * 256.0) as u8);
        let frac = if i % 5 == 4 { 0.5 } else { 0.0 };
        match dtype {
            DType::Q4Z => {
                let d = 0.01 + 0.02 * rng.next();
                let z = (6.0 + 4.0 * rng.next()).floor() + frac;
                qblocks::write_q4z(&codes.map(|c| c & 0xF), d, z, b);
            }
            DType::Q8Z => {
                let d = 0.0008 + 0.001 * rng.next();
                let z = (112.0 + 32.0 * rng.next()).floor() + frac;
                qblocks::write_q8z(&codes, d, z, b);
            }
            _ => {
                let d = 1e-3 + 1e-3 * rng.next();
                let codes = codes.map(|c| if c & 0x7F == 0x7F { c ^ 1 } else { c });
                qblocks::write_f8s(&codes, d, b);
            }
        }
    }
    out
}

/// A packed `[rows, cols]` weight of `dtype` uploaded as stored.
pub fn quant_weight<B: Backend>(
    b: &B,
    rng: &mut Rng,
    dtype: DType,
    rows: usize,
    cols: usize,
) -> Res<B::Tensor> {
    let bytes = quant_blocks(rng, dtype, rows, cols);
    Ok(b.upload(HostTensor {
        shape: &[rows, cols],
        dtype,
        bytes: &bytes,
    })?)
}

/// A packed matrix read back widened (the upload into planes and `to_f32`).
pub fn op_quant_roundtrip<B: Backend>(
    b: &B,
    dtype: DType,
    rows: usize,
    cols: usize,
) -> Res<Vec<Vec<f32>>> {
    let mut rng = Rng(61);
    let w = quant_weight(b, &mut rng, dtype, rows, cols)?;
    Ok(vec![b.to_f32(&w)?])
}

/// `x [n, k] · wᵀ` with a packed `w [o, k]`.
pub fn op_quant_matmul<B: Backend>(
    b: &B,
    dtype: DType,
    n: usize,
    k: usize,
    o: usize,
) -> Res<Vec<Vec<f32>>> {
    let mut rng = Rng(67 + n as u64);
    let w = quant_weight(b, &mut rng, dtype, o, k)?;
    let x = b.upload_f32(&[n, k], &rng.vec(n * k, 1.0))?;
    Ok(vec![b.to_f32(&b.matmul(&x, &w)?)?])
}

/// `matmul_split` of a packed weight stacked from `rows` blocks: every block's product.
pub fn op_quant_matmul_split<B: Backend>(
    b: &B,
    dtype: DType,
    n: usize,
    k: usize,
    rows: &[usize],
) -> Res<Vec<Vec<f32>>> {
    let mut rng = Rng(71);
    let o: usize = rows.iter().sum();
    let w = quant_weight(b, &mut rng, dtype, o, k)?;
    let x = b.upload_f32(&[n, k], &rng.vec(n * k, 1.0))?;
    b.matmul_split(&x, &w, rows)?
        .iter()
        .map(|p| Ok(b.to_f32(p)?))
        .collect()
}

/// A one-row activation that starts `skip` columns into a wider row (a view on CUDA, at an
/// address that is not 16-byte aligned for odd `skip`), times a packed weight.
pub fn op_quant_matmul_view<B: Backend>(
    b: &B,
    dtype: DType,
    skip: usize,
    k: usize,
    o: usize,
) -> Res<Vec<Vec<f32>>> {
    let mut rng = Rng(73);
    let w = quant_weight(b, &mut rng, dtype, o, k)?;
    let wide = b.upload_f32(&[1, skip + k], &rng.vec(skip + k, 1.0))?;
    let parts = b.split_cols(&wide, &[skip, k])?;
    Ok(vec![b.to_f32(&b.matmul(&parts[1], &w)?)?])
}

/// A SwiGLU MLP with packed gate, up and down (a shared expert of an AWQ checkpoint).
pub fn op_quant_mlp<B: Backend>(
    b: &B,
    dtype: DType,
    n: usize,
    d: usize,
    inter: usize,
) -> Res<Vec<Vec<f32>>> {
    let mut rng = Rng(79);
    let w = MlpWeights {
        gate: quant_weight(b, &mut rng, dtype, inter, d)?,
        up: quant_weight(b, &mut rng, dtype, inter, d)?,
        down: quant_weight(b, &mut rng, dtype, d, inter)?,
    };
    let x = b.upload_f32(&[n, d], &rng.vec(n * d, 1.0))?;
    Ok(vec![b.to_f32(&b.mlp(&x, &w)?)?])
}

/// Every packed-weight case, named for the report.
pub fn cases() -> Vec<(String, Case)> {
    let mut out: Vec<(String, Case)> = Vec::new();
    for dt in DTYPES {
        out.push((
            format!("quant {dt} upload + to_f32 37x96"),
            quant_case!(move |b| op_quant_roundtrip(b, dt, 37, 96)),
        ));
        // GEMV: rows 1..8 (every kernel width and the partial groups), odd output counts,
        // widths of 3 blocks, 33 blocks (one lane takes two) and the 48B model's hidden.
        for n in [1usize, 2, 3, 5, 8] {
            for (k, o) in [(96usize, 37usize), (1056, 33), (2304, 129)] {
                out.push((
                    format!("quant {dt} matmul gemv {n}x{k}->{o}"),
                    quant_case!(move |b| op_quant_matmul(b, dt, n, k, o)),
                ));
            }
        }
        // Prefill: widened to bf16 for cuBLAS.
        for (n, k, o) in [
            (9usize, 96usize, 37usize),
            (64, 2304, 129),
            (300, 1056, 200),
        ] {
            out.push((
                format!("quant {dt} matmul {n}x{k}->{o} [bf16 weights]"),
                quant_case!(move |b| op_quant_matmul(b, dt, n, k, o)),
            ));
        }
        out.push((
            format!("quant {dt} matmul_split 1x2304->[64,33,128]"),
            quant_case!(move |b| op_quant_matmul_split(b, dt, 1, 2304, &[64, 33, 128])),
        ));
        out.push((
            format!("quant {dt} matmul_split 4x96->[5,32] (gemv, then columns)"),
            quant_case!(move |b| op_quant_matmul_split(b, dt, 4, 96, &[5, 32])),
        ));
        out.push((
            format!("quant {dt} matmul_split 70x256->[64,1,63] [bf16 weights]"),
            quant_case!(move |b| op_quant_matmul_split(b, dt, 70, 256, &[64, 1, 63])),
        ));
        out.push((
            format!("quant {dt} matmul 1-row view at column 4, 96->40"),
            quant_case!(move |b| op_quant_matmul_view(b, dt, 4, 96, 40)),
        ));
        out.push((
            format!("quant {dt} matmul 1-row view at column 3, 96->40 (unaligned) [bf16 weights]"),
            quant_case!(move |b| op_quant_matmul_view(b, dt, 3, 96, 40)),
        ));
        out.push((
            format!("quant {dt} mlp 1 tok 256->96"),
            quant_case!(move |b| op_quant_mlp(b, dt, 1, 256, 96)),
        ));
        out.push((
            format!("quant {dt} mlp 40 tok 256->96 [bf16 weights]"),
            quant_case!(move |b| op_quant_mlp(b, dt, 40, 256, 96)),
        ));
    }
    out
}
