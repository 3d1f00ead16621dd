//! Op cases of the ops Kimi K3 adds (the MoE seam's routing and expert bank with MXFP4 and
//! bf16 experts, SiTU FFNs, the sigmoid output gate, Block AttnRes mixes), shared by
//! `tests/backend_ops.rs` and `examples/check.rs` like `op_cases.rs`.
#![allow(dead_code)]

use kimi_core::config::Activation;
use kimi_core::DType;
use kimi_ops::{Backend, ExpertView, HostTensor, MlpWeights, MoeRouting};

use super::op_cases::{weight, Case, Res, Rng, Runner};

macro_rules! k3_case {
    ($f:expr) => {{
        let c: Case = Box::new(move |r: &dyn Runner| match (r.cpu(), r.cuda()) {
            (Some(b), _) => $f(b),
            (_, Some(b)) => $f(b),
            _ => unreachable!(),
        });
        c
    }};
}

/// Kimi K3's SiTU-GLU parameters (`activation_situ_beta`, `activation_situ_linear_beta`).
pub const SITU: Activation = Activation::Situ {
    beta: 4.0,
    linear_beta: Some(25.0),
};

/// ggml `block_mxfp4` bytes of a `[rows, cols]` matrix: random codes, E8M0 scales between
/// 2^-9 and 2^-1 (the range of trained expert weights), with the extreme scales 0 (the
/// subnormal 2^-127) and 200 (2^73) in the first blocks when `extremes`.
pub fn mxfp4_blocks(rng: &mut Rng, rows: usize, cols: usize, extremes: bool) -> Vec<u8> {
    let blocks = rows * cols / 32;
    let mut out = Vec::with_capacity(blocks * 17);
    for b in 0..blocks {
        let e = match (extremes, b) {
            (true, 0) => 0,
            (true, 1) => 200,
            _ => 118 + (rng.next() * 8.0) as u8,
        };
        out.push(e);
        out.extend((0..16).map(|_| (rng.next() * 256.0) as u8));
    }
    out
}

fn mxfp4_weight<B: Backend>(b: &B, rng: &mut Rng, rows: usize, cols: usize) -> Res<B::Tensor> {
    let bytes = mxfp4_blocks(rng, rows, cols, false);
    Ok(b.upload(HostTensor {
        shape: &[rows, cols],
        dtype: DType::MXFP4,
        bytes: &bytes,
    })?)
}

/// An MXFP4 matrix read back widened (the upload and `to_f32` of the packed format).
pub fn op_mxfp4_roundtrip<B: Backend>(b: &B, rows: usize, cols: usize) -> Res<Vec<Vec<f32>>> {
    let mut rng = Rng(31);
    let bytes = mxfp4_blocks(&mut rng, rows, cols, true);
    let w = b.upload(HostTensor {
        shape: &[rows, cols],
        dtype: DType::MXFP4,
        bytes: &bytes,
    })?;
    let x = b.upload_f32(&[3, cols], &rng.vec(3 * cols, 1.0))?;
    Ok(vec![b.to_f32(&w)?, b.to_f32(&b.matmul(&x, &w)?)?])
}

pub fn op_bulk_matmul<B: Backend>(b: &B, n: usize, k: usize, o: usize) -> Res<Vec<Vec<f32>>> {
    let mut rng = Rng(3);
    let x = b.upload_f32(&[n, k], &rng.vec(n * k, 1.0))?;
    let w = weight(b, &[o, k], &rng.vec(o * k, 0.05), DType::BF16)?;
    Ok(vec![b.to_f32(&b.matmul(&x, &w)?)?])
}

pub fn op_sigmoid_gate<B: Backend>(b: &B, n: usize, d: usize) -> Res<Vec<Vec<f32>>> {
    let mut rng = Rng(5);
    let x = b.upload_f32(&[n, d], &rng.vec(n * d, 2.0))?;
    let g = b.upload_f32(&[n, d], &rng.vec(n * d, 6.0))?;
    Ok(vec![b.to_f32(&b.sigmoid_gate(&x, &g)?)?])
}

pub fn op_attn_res_mix<B: Backend>(b: &B, n: usize, d: usize, blocks: usize) -> Res<Vec<Vec<f32>>> {
    let mut rng = Rng(9 + blocks as u64);
    let srcs: Vec<B::Tensor> = (0..blocks)
        .map(|i| b.upload_f32(&[n, d], &rng.vec(n * d, 1.0 + i as f32)))
        .collect::<Result<_, _>>()?;
    let partial = b.upload_f32(&[n, d], &rng.vec(n * d, 0.5))?;
    let w = b.upload_f32(&[d], &rng.vec(d, 0.2))?;
    let refs: Vec<&B::Tensor> = srcs.iter().collect();
    Ok(vec![b.to_f32(&b.attn_res_mix(&refs, &partial, &w, 1e-5)?)?])
}

pub fn op_ffn<B: Backend>(
    b: &B,
    n: usize,
    d: usize,
    inter: usize,
    act: Activation,
) -> Res<Vec<Vec<f32>>> {
    let mut rng = Rng(17);
    let x = b.upload_f32(&[n, d], &rng.vec(n * d, 1.0))?;
    let w = MlpWeights {
        gate: weight(b, &[inter, d], &rng.vec(inter * d, 0.3), DType::BF16)?,
        up: weight(b, &[inter, d], &rng.vec(inter * d, 0.3), DType::BF16)?,
        down: weight(b, &[d, inter], &rng.vec(d * inter, 0.3), DType::BF16)?,
    };
    Ok(vec![b.to_f32(&b.ffn(&x, &w, act)?)?])
}

/// K3-style routing (sigmoid, correction bias for the choice only, renormalised) over `e`
/// experts: the chosen ids (as f32) and their weights.
pub fn op_moe_route<B: Backend>(
    b: &B,
    n: usize,
    d: usize,
    e: usize,
    top_k: usize,
) -> Res<Vec<Vec<f32>>> {
    let mut rng = Rng(23);
    let x = b.upload_f32(&[n, d], &rng.vec(n * d, 1.0))?;
    let router = b.upload_f32(&[e, d], &rng.vec(e * d, 0.5))?;
    let bias = b.upload_f32(&[e], &rng.vec(e, 0.1))?;
    let r = routing(top_k);
    let routes = b.moe_route(&x, &router, Some(&bias), &r)?;
    let ids = b.expert_ids(&routes.experts)?;
    Ok(vec![
        ids.iter().map(|&i| i as f32).collect(),
        b.to_f32(&routes.weights)?,
    ])
}

fn routing(top_k: usize) -> MoeRouting {
    MoeRouting {
        top_k,
        num_groups: 1,
        topk_group: 1,
        renormalize: true,
        scaling: 1.0,
        weights_use_bias: false,
    }
}

/// An MoE layer's input, router and routed experts.
type Bank<B> = (
    <B as Backend>::Tensor,
    <B as Backend>::Tensor,
    Vec<MlpWeights<<B as Backend>::Tensor>>,
);

/// Inputs `x [n, d]`, an f32 router over `e` experts and the experts' SwiGLU weights in
/// `format` (MXFP4, bf16, or a type kept packed), drawn from `Rng(seed)`.
fn random_bank<B: Backend>(
    b: &B,
    seed: u64,
    (n, d, inter, e): (usize, usize, usize, usize),
    format: DType,
) -> Res<Bank<B>> {
    let mut rng = Rng(seed);
    let x = b.upload_f32(&[n, d], &rng.vec(n * d, 1.0))?;
    let router = b.upload_f32(&[e, d], &rng.vec(e * d, 0.5))?;
    let mut experts = Vec::with_capacity(e);
    for _ in 0..e {
        let mut mat = |rows: usize, cols: usize| -> Res<B::Tensor> {
            match format {
                DType::MXFP4 => mxfp4_weight(b, &mut rng, rows, cols),
                DType::BF16 => weight(b, &[rows, cols], &rng.vec(rows * cols, 0.2), DType::BF16),
                q => super::quant_cases::quant_weight(b, &mut rng, q, rows, cols),
            }
        };
        experts.push(MlpWeights {
            gate: mat(inter, d)?,
            up: mat(inter, d)?,
            down: mat(d, inter)?,
        });
    }
    Ok((x, router, experts))
}

/// Routed experts of an `e`-expert bank at width `d` (the LatentMoE latent), routed by
/// `moe_route`, in `format` (MXFP4 or bf16), with SiTU.
pub fn op_moe_experts<B: Backend>(
    b: &B,
    n: usize,
    d: usize,
    inter: usize,
    e: usize,
    top_k: usize,
    format: DType,
) -> Res<Vec<Vec<f32>>> {
    let (x, router, experts) = random_bank(b, 41, (n, d, inter, e), format)?;
    let routes = b.moe_route(&x, &router, None, &routing(top_k))?;
    let y = b.moe_experts(&x, &routes, &ExpertView::new(&experts), SITU)?;
    let ids = b.expert_ids(&routes.experts)?;
    Ok(vec![b.to_f32(&y)?, ids.iter().map(|&i| i as f32).collect()])
}

/// [`op_moe_experts`] over a view in which every third expert is absent (held by another
/// rank, or a tiered bank's cold expert; its weights a present one's): their pairs add
/// nothing. `act` SiLU takes the table paths (fused GEMV, grouped GEMMs) for bf16 banks;
/// `format` Q4Z the packed tensor-core path.
#[allow(clippy::too_many_arguments)]
pub fn op_moe_experts_absent<B: Backend>(
    b: &B,
    n: usize,
    d: usize,
    inter: usize,
    e: usize,
    top_k: usize,
    format: DType,
    act: Activation,
) -> Res<Vec<Vec<f32>>> {
    let (x, router, experts) = random_bank(b, 43, (n, d, inter, e), format)?;
    let routes = b.moe_route(&x, &router, None, &routing(top_k))?;
    let view = ExpertView::partial(
        (0..e)
            .map(|i| match i % 3 {
                2 => (&experts[0], false),
                _ => (&experts[i], true),
            })
            .collect(),
    );
    let y = b.moe_experts(&x, &routes, &view, act)?;
    Ok(vec![b.to_f32(&y)?])
}

/// Every K3 case, named for the report.
pub fn cases() -> Vec<(String, Case)> {
    let situ_no_linear = Activation::Situ {
        beta: 4.0,
        linear_beta: None,
    };
    vec![
        (
            "k3 mxfp4 upload + to_f32 + matmul 64x96".into(),
            k3_case!(|b| op_mxfp4_roundtrip(b, 64, 96)),
        ),
        (
            // A 48 KiB gemv_bulk tile (4 rows of 6144 bf16), as K3's shared-expert down.
            "k3 matmul bf16 1x6144->200 (full bulk tile)".into(),
            k3_case!(|b| op_bulk_matmul(b, 1, 6144, 200)),
        ),
        (
            "k3 matmul bf16 3x3072->100 (full bulk tile)".into(),
            k3_case!(|b| op_bulk_matmul(b, 3, 3072, 100)),
        ),
        (
            "k3 sigmoid_gate 5x96".into(),
            k3_case!(|b| op_sigmoid_gate(b, 5, 96)),
        ),
        (
            "k3 attn_res_mix 1 tok, no blocks, d 48".into(),
            k3_case!(|b| op_attn_res_mix(b, 1, 48, 0)),
        ),
        (
            "k3 attn_res_mix 7 tok, 3 blocks, d 48".into(),
            k3_case!(|b| op_attn_res_mix(b, 7, 48, 3)),
        ),
        (
            "k3 attn_res_mix 2 tok, 8 blocks, d 7168".into(),
            k3_case!(|b| op_attn_res_mix(b, 2, 7168, 8)),
        ),
        (
            "k3 ffn situ 1 tok 64->96".into(),
            k3_case!(|b| op_ffn(b, 1, 64, 96, SITU)),
        ),
        (
            "k3 ffn situ (no linear beta) 300 tok 128->192".into(),
            k3_case!(|b| op_ffn(b, 300, 128, 192, situ_no_linear)),
        ),
        (
            "k3 moe_route 3 tok, 896e top16".into(),
            k3_case!(|b| op_moe_route(b, 3, 128, 896, 16)),
        ),
        (
            "k3 moe_experts mxfp4 1 tok, 16e top4, d 64 inter 96 (padded tiles)".into(),
            k3_case!(|b| op_moe_experts(b, 1, 64, 96, 16, 4, DType::MXFP4)),
        ),
        (
            "k3 moe_experts mxfp4 37 tok, 16e top4, d 64 inter 96 (16 pairs a pass)".into(),
            k3_case!(|b| op_moe_experts(b, 37, 64, 96, 16, 4, DType::MXFP4)),
        ),
        (
            "k3 moe_experts mxfp4 2 tok, 8e top2, d 3584 inter 3072 (K3 widths)".into(),
            k3_case!(|b| op_moe_experts(b, 2, 3584, 3072, 8, 2, DType::MXFP4)),
        ),
        (
            "k3 moe_experts mxfp4 600 tok, 32e top4, d 128 inter 192 (32 pairs a pass)".into(),
            k3_case!(|b| op_moe_experts(b, 600, 128, 192, 32, 4, DType::MXFP4)),
        ),
        (
            "k3 moe_experts mxfp4 520 tok, 8e top2, d 3584 inter 3072 (32 pairs a pass, K3 widths)"
                .into(),
            k3_case!(|b| op_moe_experts(b, 520, 3584, 3072, 8, 2, DType::MXFP4)),
        ),
        (
            "k3 moe_experts mxfp4 160 tok, 8e top2, d 3584 inter 3072 (40 pairs each, two passes)"
                .into(),
            k3_case!(|b| op_moe_experts(b, 160, 3584, 3072, 8, 2, DType::MXFP4)),
        ),
        (
            "k3 moe_experts bf16 5 tok, 8e top3, d 64 inter 96 (one by one)".into(),
            k3_case!(|b| op_moe_experts(b, 5, 64, 96, 8, 3, DType::BF16)),
        ),
        // Absent experts (expert parallelism, a tiered bank's cold ones) on every path.
        (
            "moe_experts absent bf16 5 tok, 8e top3, d 64 inter 96 (one by one)".into(),
            k3_case!(|b| op_moe_experts_absent(b, 5, 64, 96, 8, 3, DType::BF16, SITU)),
        ),
        (
            "moe_experts absent bf16 1 tok, 32e top8, d 2304 inter 1024 (fused GEMV)".into(),
            k3_case!(|b| op_moe_experts_absent(
                b,
                1,
                2304,
                1024,
                32,
                8,
                DType::BF16,
                Activation::Silu
            )),
        ),
        (
            "moe_experts absent bf16 520 tok, 32e top8, d 2304 inter 1024 (grouped)".into(),
            k3_case!(|b| op_moe_experts_absent(
                b,
                520,
                2304,
                1024,
                32,
                8,
                DType::BF16,
                Activation::Silu
            )),
        ),
        (
            "moe_experts absent bf16 1100 tok, 64e top8, d 256 inter 192 (multi-block lists)"
                .into(),
            k3_case!(|b| op_moe_experts_absent(
                b,
                1100,
                256,
                192,
                64,
                8,
                DType::BF16,
                Activation::Silu
            )),
        ),
        (
            "moe_experts absent mxfp4 37 tok, 16e top4, d 64 inter 96".into(),
            k3_case!(|b| op_moe_experts_absent(b, 37, 64, 96, 16, 4, DType::MXFP4, SITU)),
        ),
        (
            "moe_experts absent q4z 1 tok, 16e top4, d 256 inter 128".into(),
            k3_case!(|b| op_moe_experts_absent(
                b,
                1,
                256,
                128,
                16,
                4,
                DType::Q4Z,
                Activation::Silu
            )),
        ),
        (
            "moe_experts absent q4z 300 tok, 16e top4, d 256 inter 128".into(),
            k3_case!(|b| op_moe_experts_absent(
                b,
                300,
                256,
                128,
                16,
                4,
                DType::Q4Z,
                Activation::Silu
            )),
        ),
    ]
}
