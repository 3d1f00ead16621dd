//! Op cases of weights kept packed on the device (Q4Z, Q8Z, F8S: AWQ / GPTQ /
//! compressed-tensors INT4 and INT8, FP8), shared by `tests/backend_ops.rs` and
//! `examples/check.rs` like `op_cases.rs`. The GEMV cases (1 to 8 rows) compare f32 products
//! at the default tolerance; the prefill cases widen the weights to bf16 for cuBLAS and
//! carry `[bf16 weights]` (the tolerance of the bf16-operand cases).
#![allow(dead_code)]

use kimi_core::{qblocks, DType};
use kimi_ops::{Backend, HostTensor, MlpWeights, MoeRouting, MoeWeights};

use super::op_cases::{weight, Case, Res, Rng, Runner};

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

/// The packed types these cases cover: the repacked Hugging Face formats, then ggml's.
pub const DTYPES: [DType; 7] = [
    DType::Q4Z,
    DType::Q8Z,
    DType::F8S,
    DType::Q4_0,
    DType::Q4_1,
    DType::Q8_0,
    DType::Q4_K,
];

/// Stored blocks of a `[rows, cols]` matrix of `dtype` (`cols` whole blocks): random codes,
/// scales near what the quantizers write for weights of magnitude ~0.1, zero points
/// around the middle of the code range (every 5th block a fractional one, which the
/// format allows), F8S codes without the NaN bytes; ggml blocks of random bytes under f16
/// scales (Q4_K: random 6-bit sub-block scales and mins).
pub fn quant_blocks(rng: &mut Rng, dtype: DType, rows: usize, cols: usize) -> Vec<u8> {
    let blocks = rows * cols / dtype.block_size();
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
            DType::F8S => {
                let d = 1e-3 + 1e-3 * rng.next();
                let codes = codes.map(|c| if c & 0x7F == 0x7F { c ^ 1 } else { c });
                qblocks::write_f8s(&codes, d, b);
            }
            _ => {
                for x in b.iter_mut() {
                    *x = (rng.next() * 256.0) as u8;
                }
                // d (and Q4_1's m, Q4_K's dmin) as f16; Q4_K's sub-block scales multiply d.
                let (d, m) = match dtype {
                    DType::Q8_0 => (0.001 + 0.001 * rng.next(), 0.0),
                    DType::Q4_K => (0.0003 + 0.0003 * rng.next(), 0.002 * rng.next()),
                    _ => (0.01 + 0.02 * rng.next(), -0.08 * rng.next()),
                };
                b[..2].copy_from_slice(&half::f16::from_f32(d).to_le_bytes());
                if matches!(dtype, DType::Q4_1 | DType::Q4_K) {
                    b[2..4].copy_from_slice(&half::f16::from_f32(m).to_le_bytes());
                }
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

/// `matmul_pair` of one token each through two packed matrices of `k` columns (KDA's f_b
/// and g_b): both products.
pub fn op_quant_matmul_pair<B: Backend>(
    b: &B,
    dtype: DType,
    k: usize,
    oa: usize,
    ob: usize,
) -> Res<Vec<Vec<f32>>> {
    let mut rng = Rng(71 + k as u64);
    let wa = quant_weight(b, &mut rng, dtype, oa, k)?;
    let wb = quant_weight(b, &mut rng, dtype, ob, k)?;
    let xa = b.upload_f32(&[1, k], &rng.vec(k, 1.0))?;
    let xb = b.upload_f32(&[1, k], &rng.vec(k, 1.0))?;
    let (ya, yb) = b.matmul_pair((&xa, &wa), (&xb, &wb))?;
    Ok(vec![b.to_f32(&ya)?, b.to_f32(&yb)?])
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

/// Embedding rows (repeats included) of a packed `[vocab, d]` table.
pub fn op_quant_embedding<B: Backend>(
    b: &B,
    dtype: DType,
    vocab: usize,
    d: usize,
) -> Res<Vec<Vec<f32>>> {
    let mut rng = Rng(89);
    let table = quant_weight(b, &mut rng, dtype, vocab, d)?;
    let ids: Vec<u32> = (0..13)
        .map(|i| (i * 7 % vocab) as u32)
        .chain([0, 0])
        .collect();
    Ok(vec![b.to_f32(&b.embedding(&table, &ids)?)?])
}

/// A Kimi Linear MoE layer (bf16 router with a correction bias, grouped routing) whose
/// routed and shared experts are packed: the per-expert path, through `mlp`.
pub fn op_quant_moe<B: Backend>(b: &B, dtype: DType, n: usize) -> Res<Vec<Vec<f32>>> {
    // Q4_K's rows are whole 256-value super-blocks.
    let inter = if dtype == DType::Q4_K { 256 } else { 64 };
    op_quant_moe_shaped(b, dtype, n, 256, inter, 2 * inter)
}

/// As [`op_quant_moe`] with hidden `d`, routed experts of width `inter` and a shared one of
/// `shared_inter` (of the routed width, the streamed one-token layer runs it as one more
/// slot).
pub fn op_quant_moe_shaped<B: Backend>(
    b: &B,
    dtype: DType,
    n: usize,
    d: usize,
    inter: usize,
    shared_inter: usize,
) -> Res<Vec<Vec<f32>>> {
    let e = 16usize;
    let mut rng = Rng(83);
    let x = b.upload_f32(&[n, d], &rng.vec(n * d, 1.0))?;
    let router = weight(b, &[e, d], &rng.vec(e * d, 0.0625), DType::BF16)?;
    let bias = b.upload_f32(&[e], &rng.vec(e, 0.1))?;
    let mut mlp = |inter: usize| -> Res<MlpWeights<B::Tensor>> {
        Ok(MlpWeights {
            gate: quant_weight(b, &mut rng, dtype, inter, d)?,
            up: quant_weight(b, &mut rng, dtype, inter, d)?,
            down: quant_weight(b, &mut rng, dtype, d, inter)?,
        })
    };
    let experts = (0..e).map(|_| mlp(inter)).collect::<Res<Vec<_>>>()?;
    let shared = Some(mlp(shared_inter)?);
    let w = MoeWeights {
        router,
        correction_bias: Some(bias),
        experts,
        shared,
    };
    let routing = MoeRouting {
        top_k: 4,
        num_groups: 4,
        topk_group: 2,
        renormalize: true,
        scaling: 2.5,
        weights_use_bias: false,
    };
    let (y, chosen) = b.moe(&x, &w, &routing)?;
    let ids = b.expert_ids(&chosen)?;
    Ok(vec![b.to_f32(&y)?, ids.iter().map(|&i| i as f32).collect()])
}

/// Every packed-weight case, named for the report.
pub fn cases() -> Vec<(String, Case)> {
    let mut out: Vec<(String, Case)> = Vec::new();
    for dt in DTYPES {
        // Widths of a few blocks, of one more block than a warp's 32 lanes take (Q4_K: five
        // super-blocks) and the 48B model's hidden; Q4_K's rows are whole super-blocks.
        let k4 = dt == DType::Q4_K;
        let (small, mid) = if k4 { (256, 1280) } else { (96, 1056) };
        let inter = if k4 { 256 } else { 96 };
        out.push((
            format!("quant {dt} upload + to_f32 37x{small}"),
            quant_case!(move |b| op_quant_roundtrip(b, dt, 37, small)),
        ));
        out.push((
            format!("quant {dt} embedding 15 ids of 50x{small}"),
            quant_case!(move |b| op_quant_embedding(b, dt, 50, small)),
        ));
        // GEMV: rows 1..8 (every kernel width and the partial groups), odd output counts.
        for n in [1usize, 2, 3, 5, 8] {
            for (k, o) in [(small, 37usize), (mid, 33), (2304, 129)] {
                out.push((
                    format!("quant {dt} matmul gemv {n}x{k}->{o}"),
                    quant_case!(move |b| op_quant_matmul(b, dt, n, k, o)),
                ));
            }
        }
        // One row of a 4-bit matrix whose width streams (`quant_gemv_int4_stream_1`): one
        // slice, two slices (4,096: o_proj), tiles of many rows, a single output.
        if matches!(dt, DType::Q4Z | DType::Q4_0 | DType::Q4_1 | DType::Q4_K) {
            for (k, o) in [(4096usize, 300usize), (2304, 2304), (512, 1), (6144, 77)] {
                out.push((
                    format!("quant {dt} matmul gemv 1x{k}->{o} (streamed)"),
                    quant_case!(move |b| op_quant_matmul(b, dt, 1, k, o)),
                ));
            }
        }
        // One token each through two narrow matrices (`quant_gemv_narrow_pair` for 4-bit
        // types): KDA's f_b and g_b, one block per row, a width of 32 lanes.
        let pairs: &[(usize, usize, usize)] = if k4 {
            &[(256, 300, 77)]
        } else {
            &[(128, 4096, 4096), (32, 40, 9), (1024, 77, 300)]
        };
        for &(k, oa, ob) in pairs {
            out.push((
                format!("quant {dt} matmul_pair 1x{k}->{oa}, 1x{k}->{ob}"),
                quant_case!(move |b| op_quant_matmul_pair(b, dt, k, oa, ob)),
            ));
        }
        // Prefill: widened to bf16 for cuBLAS.
        for (n, k, o) in [(9usize, small, 37usize), (64, 2304, 129), (300, mid, 200)] {
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
            format!("quant {dt} matmul_split 4x{small}->[5,32] (gemv, then columns)"),
            quant_case!(move |b| op_quant_matmul_split(b, dt, 4, small, &[5, 32])),
        ));
        out.push((
            format!("quant {dt} matmul_split 70x256->[64,1,63] [bf16 weights]"),
            quant_case!(move |b| op_quant_matmul_split(b, dt, 70, 256, &[64, 1, 63])),
        ));
        out.push((
            format!("quant {dt} matmul 1-row view at column 4, {small}->40"),
            quant_case!(move |b| op_quant_matmul_view(b, dt, 4, small, 40)),
        ));
        out.push((
            format!(
                "quant {dt} matmul 1-row view at column 3, {small}->40 (unaligned) [bf16 weights]"
            ),
            quant_case!(move |b| op_quant_matmul_view(b, dt, 3, small, 40)),
        ));
        out.push((
            format!("quant {dt} mlp 1 tok 256->{inter}"),
            quant_case!(move |b| op_quant_mlp(b, dt, 1, 256, inter)),
        ));
        out.push((
            format!("quant {dt} mlp 40 tok 256->{inter} [bf16 weights]"),
            quant_case!(move |b| op_quant_mlp(b, dt, 40, 256, inter)),
        ));
        out.push((
            format!("quant {dt} moe 1 tok, 16e top4, d 256 (+ shared)"),
            quant_case!(move |b| op_quant_moe(b, dt, 1)),
        ));
        // One token of 4-bit experts whose widths stream (`moe_int4_stream_layer`), the
        // shared expert one more slot or (wider) an MLP.
        if matches!(dt, DType::Q4Z | DType::Q4_0 | DType::Q4_1 | DType::Q4_K) {
            for (d, inter, shared) in [(512usize, 256usize, 256usize), (768, 512, 1024)] {
                out.push((
                    format!("quant {dt} moe 1 tok streamed, 16e top4, d {d}, inter {inter} (+ shared {shared})"),
                    quant_case!(move |b| op_quant_moe_shaped(b, dt, 1, d, inter, shared)),
                ));
            }
        }
        out.push((
            format!("quant {dt} moe 6 tok, 16e top4, d 256 (+ shared)"),
            quant_case!(move |b| op_quant_moe(b, dt, 6)),
        ));
        out.push((
            format!("quant {dt} moe 70 tok, 16e top4 [bf16 weights]"),
            quant_case!(move |b| op_quant_moe(b, dt, 70)),
        ));
    }
    out
}
