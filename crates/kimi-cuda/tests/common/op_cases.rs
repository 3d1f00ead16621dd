//! Op-level cases shared by `tests/backend_ops.rs` and `examples/check.rs`: each case runs
//! one `Backend` op on deterministic random inputs and returns its outputs as f32 vectors,
//! so the same closure drives `CpuBackend` (the reference) and `CudaBackend`.
#![allow(dead_code)]

use std::error::Error;

use half::bf16;
use kimi_core::config::KdaGate;
use kimi_core::DType;
use kimi_cpu::CpuBackend;
use kimi_cuda::{CudaBackend, GemmPrecision, KdaChunkKernel};
use kimi_ops::{
    kda_decode_composed, Backend, HostTensor, KdaMode, KdaStepInputs, KdaStepWeights, MlaDims,
    MlaMode, MlpWeights, MoeRouting, MoeWeights, PagedSeq, RowSampling, Segment, TokenPenalty,
};

pub type Res<T> = std::result::Result<T, Box<dyn Error>>;

// ---------------------------------------------------------------- random inputs

pub struct Rng(pub u64);
impl Rng {
    pub fn next(&mut self) -> f32 {
        self.0 = self.0.wrapping_add(0x9e3779b97f4a7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58476d1ce4e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d049bb133111eb);
        ((z ^ (z >> 31)) >> 40) as f32 / (1u64 << 24) as f32
    }
    pub fn vec(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| (2.0 * self.next() - 1.0) * scale).collect()
    }
}

pub fn bf16_bytes(v: &[f32]) -> Vec<u8> {
    v.iter()
        .flat_map(|x| bf16::from_f32(*x).to_le_bytes())
        .collect()
}

/// Uploads `data` as a weight of `dtype`.
pub fn weight<B: Backend>(b: &B, shape: &[usize], data: &[f32], dtype: DType) -> Res<B::Tensor> {
    Ok(match dtype {
        DType::BF16 => b.upload(HostTensor {
            shape,
            dtype,
            bytes: &bf16_bytes(data),
        })?,
        _ => b.upload_f32(shape, data)?,
    })
}

pub fn rel_err(got: &[f32], want: &[f32]) -> f64 {
    if got.len() != want.len() {
        return f64::INFINITY;
    }
    let num: f64 = got
        .iter()
        .zip(want)
        .map(|(g, w)| (*g as f64 - *w as f64).powi(2))
        .sum();
    let den: f64 = want.iter().map(|w| (*w as f64).powi(2)).sum();
    if den == 0.0 {
        num.sqrt()
    } else {
        (num / den).sqrt()
    }
}

// ---------------------------------------------------------------- op cases

/// Largest relative error a case may show: 1e-4, or 3e-2 for cases named `[half]` (bf16
/// operands without the lo term, ~3e-3 measured in emulation) or `[bf16 weights]` (packed
/// weights widened to bf16 for a GEMM: ~1e-3 from rounding each weight once).
pub fn tolerance(name: &str) -> f64 {
    if name.contains("[half]") || name.contains("[bf16 weights]") {
        3e-2
    } else {
        1e-4
    }
}

/// One op case: runs on any backend and returns its outputs (as f32 vectors).
pub type Case = Box<dyn Fn(&dyn Runner) -> Res<Vec<Vec<f32>>>>;

/// Object-safe shim so one closure can drive both backends.
pub trait Runner {
    fn cpu(&self) -> Option<&CpuBackend>;
    fn cuda(&self) -> Option<&CudaBackend>;
}
pub struct CpuRun(pub CpuBackend);
pub struct CudaRun<'a>(pub &'a CudaBackend);
impl Runner for CpuRun {
    fn cpu(&self) -> Option<&CpuBackend> {
        Some(&self.0)
    }
    fn cuda(&self) -> Option<&CudaBackend> {
        None
    }
}
impl Runner for CudaRun<'_> {
    fn cpu(&self) -> Option<&CpuBackend> {
        None
    }
    fn cuda(&self) -> Option<&CudaBackend> {
        Some(self.0)
    }
}

macro_rules! case {
    ($f:expr) => {{
        let c: Case = Box::new(move |r: &dyn Runner| match (r.cpu(), r.cuda()) {
            (Some(b), _) => $f(b),
            (_, Some(b)) => $f(b),
            _ => unreachable!(),
        });
        c
    }};
}

pub fn t<B: Backend>(b: &B, x: &B::Tensor) -> Res<Vec<f32>> {
    Ok(b.to_f32(x)?)
}

pub fn op_embedding<B: Backend>(b: &B, vocab: usize, d: usize, dt: DType) -> Res<Vec<Vec<f32>>> {
    let mut r = Rng(1);
    let table = weight(b, &[vocab, d], &r.vec(vocab * d, 1.0), dt)?;
    let ids: Vec<u32> = (0..37).map(|i| (i * 7919 % vocab) as u32).collect();
    Ok(vec![t(b, &b.embedding(&table, &ids)?)?])
}

/// Greedy picks of rows with ties, NaN, +inf and nothing above -inf, then random rows of
/// a 163,840-token vocabulary; the ids as f32 (exact).
pub fn op_argmax<B: Backend>(b: &B) -> Res<Vec<Vec<f32>>> {
    let (nan, inf) = (f32::NAN, f32::INFINITY);
    let d = 7;
    let mut rows: Vec<f32> = vec![
        1.0,
        3.0,
        3.0,
        2.0,
        0.0,
        0.0,
        0.0, //
        nan,
        0.5,
        nan,
        -1.0,
        nan,
        0.5,
        nan, //
        -inf,
        -inf,
        -inf,
        -inf,
        -inf,
        -inf,
        -inf, //
        nan,
        nan,
        nan,
        nan,
        nan,
        nan,
        nan, //
        f32::MAX,
        inf,
        0.0,
        0.0,
        0.0,
        0.0,
        0.0, //
        -1.0,
        -2.0,
        inf,
        0.0,
        inf,
        0.0,
        0.0,
    ];
    let small = b.upload_f32(&[rows.len() / d, d], &rows)?;
    let mut r = Rng(17);
    let vocab = 163_840;
    rows = r.vec(3 * vocab, 4.0);
    let big = b.upload_f32(&[3, vocab], &rows)?;
    let ids = |t| -> Res<Vec<f32>> { Ok(b.argmax_rows(t)?.iter().map(|&i| i as f32).collect()) };
    Ok(vec![ids(&small)?, ids(&big)?])
}

/// Sampling on the backend (`Backend::sample_rows`) against the host rule: a small row with
/// ties, NaN and ±inf, and random rows of a 163,840-token vocabulary with runs of equal
/// logits, under temperature, top-k, top-p, min-p, their mix and penalties, each at four
/// uniform draws; the ids as f32 (exact).
pub fn op_sample<B: Backend>(b: &B) -> Res<Vec<Vec<f32>>> {
    let (nan, inf) = (f32::NAN, f32::INFINITY);
    let small = vec![
        1.0, 3.0, nan, 3.0, -inf, inf, 0.5, -0.0, 0.0, 2.0, 2.0, -3.0,
    ];
    let mut r = Rng(23);
    let vocab = 163_840;
    let mut big = r.vec(2 * vocab, 4.0);
    // Runs of equal logits at the top, so that the cut-offs fall inside ties.
    for row in big.chunks_mut(vocab) {
        let top = row.iter().copied().fold(f32::MIN, f32::max);
        for i in (0..vocab).step_by(997).take(40) {
            row[i] = top - 1.5;
        }
    }
    let rules = |temperature, top_k, top_p, min_p| RowSampling {
        temperature,
        top_k,
        top_p,
        min_p,
        ..RowSampling::greedy()
    };
    let penalised = RowSampling {
        temperature: 0.9,
        repetition_penalty: 1.3,
        frequency_penalty: 0.5,
        presence_penalty: 0.3,
        top_k: 20,
        ..RowSampling::greedy()
    };
    let sets = [
        rules(1.0, 0, 1.0, 0.0),
        rules(0.7, 50, 1.0, 0.0),
        rules(1.3, 0, 0.9, 0.0),
        rules(1.0, 0, 1.0, 0.05),
        rules(0.8, 40, 0.95, 0.02),
        rules(1.0, 1, 1.0, 0.0),
        rules(1.0, 0, 1e-3, 0.0),
        penalised,
        RowSampling {
            temperature: 0.0,
            ..penalised
        },
    ];
    let draws = [0.03f32, 0.35, 0.65, 0.97];
    let mut out = Vec::new();
    for (logits, width) in [(&small, small.len()), (&big, vocab)] {
        let mut data = Vec::new();
        let mut params = Vec::new();
        let mut penalties = Vec::new();
        for set in &sets {
            for &uniform in &draws {
                for row in logits.chunks(width) {
                    let n = params.len() as u32;
                    if set.repetition_penalty != 1.0 {
                        // The row's best tokens and a few others, some seen in the output.
                        let mut seen = Vec::new();
                        for (i, &token) in [0u32, 1, 3, 5, 997, 1994, 7, 11].iter().enumerate() {
                            let token = token % width as u32;
                            if !seen.contains(&token) {
                                seen.push(token);
                                let count = (i % 3) as u32;
                                penalties.push(TokenPenalty {
                                    row: n,
                                    token,
                                    count,
                                });
                            }
                        }
                    }
                    data.extend_from_slice(row);
                    params.push(RowSampling { uniform, ..*set });
                }
            }
        }
        let mut x = b.upload_f32(&[params.len(), width], &data)?;
        let ids = b.sample_rows(&mut x, &params, &penalties)?;
        out.push(ids.iter().map(|&i| i as f32).collect());
    }
    Ok(out)
}

pub fn op_matmul<B: Backend>(b: &B, n: usize, k: usize, o: usize, dt: DType) -> Res<Vec<Vec<f32>>> {
    let mut r = Rng(2);
    let x = b.upload_f32(&[n, k], &r.vec(n * k, 1.0))?;
    let w = weight(b, &[o, k], &r.vec(o * k, 0.1), dt)?;
    Ok(vec![t(b, &b.matmul(&x, &w)?)?])
}

/// `matmul_split` of a weight stacked from `rows` blocks: every block's product.
pub fn op_matmul_split<B: Backend>(
    b: &B,
    n: usize,
    k: usize,
    rows: &[usize],
) -> Res<Vec<Vec<f32>>> {
    let mut r = Rng(12);
    let o: usize = rows.iter().sum();
    let x = b.upload_f32(&[n, k], &r.vec(n * k, 1.0))?;
    let w = weight(b, &[o, k], &r.vec(o * k, 0.1), DType::BF16)?;
    b.matmul_split(&x, &w, rows)?
        .iter()
        .map(|p| t(b, p))
        .collect()
}

/// `matmul_pair` of `n` rows with inputs sliced from one projection, as KDA's gates take
/// them: `x [n, 2k]` split into halves (views at one row), times `wa [oa, k]`, `wb [ob, k]`.
pub fn op_matmul_pair<B: Backend>(
    b: &B,
    n: usize,
    k: usize,
    oa: usize,
    ob: usize,
) -> Res<Vec<Vec<f32>>> {
    let mut r = Rng(21);
    let x = b.upload_f32(&[n, 2 * k], &r.vec(n * 2 * k, 1.0))?;
    let halves = b.split_cols(&x, &[k, k])?;
    let wa = weight(b, &[oa, k], &r.vec(oa * k, 0.1), DType::BF16)?;
    let wb = weight(b, &[ob, k], &r.vec(ob * k, 0.1), DType::BF16)?;
    let (ya, yb) = b.matmul_pair((&halves[0], &wa), (&halves[1], &wb))?;
    Ok(vec![t(b, &ya)?, t(b, &yb)?])
}

pub fn op_rows<B: Backend>(b: &B, n: usize, d: usize) -> Res<Vec<Vec<f32>>> {
    let mut r = Rng(3);
    let xv = r.vec(n * d, 2.0);
    let mut x = b.upload_f32(&[n, d], &xv)?;
    let y = b.upload_f32(&[n, d], &r.vec(n * d, 2.0))?;
    let w = weight(b, &[d], &r.vec(d, 1.0), DType::BF16)?;
    let norm = t(b, &b.rms_norm(&x, &w, 1e-6)?)?;
    // The fused residual step, on a second copy of x: the sum and its norm.
    let mut x2 = b.upload_f32(&[n, d], &xv)?;
    let fused_norm = t(b, &b.add_rms_norm(&mut x2, &y, &w, 1e-6)?)?;
    let fused_sum = t(b, &x2)?;
    let sig = t(b, &b.sigmoid(&x)?)?;
    b.add_assign(&mut x, &y)?;
    let added = t(b, &x)?;
    let rows: Vec<usize> = (0..n).rev().step_by(2).collect();
    let sel = t(b, &b.select_rows(&x, &rows)?)?;
    let parts = b.split_cols(&x, &[d / 4, d / 2, d - d / 4 - d / 2])?;
    let split: Vec<f32> = parts
        .iter()
        .map(|p| t(b, p))
        .collect::<Res<Vec<_>>>()?
        .concat();
    let mut cat = t(b, &b.concat_cols(&[&parts[2], &parts[0], &parts[1]])?)?;
    // Two parts (one launch on CUDA, as for the MLA latent row).
    cat.extend(t(b, &b.concat_cols(&[&parts[1], &parts[0]])?)?);
    let z = b.upload_f32(&[n, d], &r.vec(n * d, 2.0))?;
    let gw = weight(b, &[d / 4], &r.vec(d / 4, 1.0), DType::F32)?;
    let gated = t(b, &b.gated_rms_norm(&y, &z, &gw, 1e-5)?)?;
    Ok(vec![
        norm, sig, added, sel, split, cat, gated, fused_norm, fused_sum,
    ])
}

pub fn mlp_weights<B: Backend>(
    b: &B,
    r: &mut Rng,
    d: usize,
    inter: usize,
) -> Res<MlpWeights<B::Tensor>> {
    Ok(MlpWeights {
        gate: weight(
            b,
            &[inter, d],
            &r.vec(inter * d, (d as f32).powf(-0.5)),
            DType::BF16,
        )?,
        up: weight(
            b,
            &[inter, d],
            &r.vec(inter * d, (d as f32).powf(-0.5)),
            DType::BF16,
        )?,
        down: weight(
            b,
            &[d, inter],
            &r.vec(inter * d, (inter as f32).powf(-0.5)),
            DType::BF16,
        )?,
    })
}

pub fn op_mlp<B: Backend>(b: &B, n: usize, d: usize, inter: usize) -> Res<Vec<Vec<f32>>> {
    let mut r = Rng(4);
    let x = b.upload_f32(&[n, d], &r.vec(n * d, 1.0))?;
    let w = mlp_weights(b, &mut r, d, inter)?;
    Ok(vec![t(b, &b.mlp(&x, &w)?)?])
}

pub fn op_moe<B: Backend>(
    b: &B,
    n: usize,
    d: usize,
    e: usize,
    groups: usize,
) -> Res<Vec<Vec<f32>>> {
    op_moe_sized(b, n, d, e, groups, 64, 4)
}

/// `op_moe` with the expert width and top-k chosen (the grouped tensor-core path needs
/// `d` and `inter` to be multiples of 64 and more than 64 tokens).
pub fn op_moe_sized<B: Backend>(
    b: &B,
    n: usize,
    d: usize,
    e: usize,
    groups: usize,
    inter: usize,
    top_k: usize,
) -> Res<Vec<Vec<f32>>> {
    op_moe_shared(b, n, d, e, groups, inter, top_k, 128)
}

/// `op_moe_sized` with the shared expert's width chosen: equal to `inter`, the CUDA
/// decode path streams it with the routed experts (`moe_stream`).
#[allow(clippy::too_many_arguments)]
pub fn op_moe_shared<B: Backend>(
    b: &B,
    n: usize,
    d: usize,
    e: usize,
    groups: usize,
    inter: usize,
    top_k: usize,
    shared_inter: usize,
) -> Res<Vec<Vec<f32>>> {
    let mut r = Rng(5);
    let x = b.upload_f32(&[n, d], &r.vec(n * d, 1.0))?;
    let router = weight(
        b,
        &[e, d],
        &r.vec(e * d, (d as f32).powf(-0.5)),
        DType::BF16,
    )?;
    let bias = b.upload_f32(&[e], &r.vec(e, 0.1))?;
    let experts = (0..e)
        .map(|_| mlp_weights(b, &mut r, d, inter))
        .collect::<Res<Vec<_>>>()?;
    let shared = Some(mlp_weights(b, &mut r, d, shared_inter)?);
    let w = MoeWeights {
        router,
        correction_bias: Some(bias),
        experts,
        shared,
    };
    let routing = MoeRouting {
        top_k,
        num_groups: groups,
        topk_group: (groups / 2).max(1),
        renormalize: true,
        scaling: 2.5,
        weights_use_bias: false,
    };
    let (y, chosen) = b.moe(&x, &w, &routing)?;
    let ids = b.expert_ids(&chosen)?;
    // Per-layer counts as a pass reads them (two layers here), counted on the device by CUDA.
    let counts: Vec<f32> = b
        .expert_counts(&[&chosen, &chosen], e)?
        .concat()
        .iter()
        .map(|&c| c as f32)
        .collect();
    Ok(vec![
        t(b, &y)?,
        ids.iter().map(|&i| i as f32).collect(),
        counts,
    ])
}

pub fn op_conv<B: Backend>(b: &B, c: usize, width: usize) -> Res<Vec<Vec<f32>>> {
    let mut r = Rng(6);
    let n = 23;
    let x = b.upload_f32(&[n, c], &r.vec(n * c, 1.0))?;
    let w = weight(b, &[c, width], &r.vec(c * width, 0.5), DType::BF16)?;
    let segs = [
        Segment { start: 0, len: 1 },
        Segment { start: 1, len: 2 },
        Segment { start: 3, len: 20 },
    ];
    let mut states: Vec<B::Tensor> = (0..3)
        .map(|_| b.upload_f32(&[width - 1, c], &r.vec((width - 1) * c, 1.0)))
        .collect::<Result<_, _>>()?;
    let mut refs: Vec<&mut B::Tensor> = states.iter_mut().collect();
    let y = t(b, &b.short_conv_silu(&x, &w, &segs, &mut refs)?)?;
    let mut out = vec![y];
    for s in &states {
        out.push(t(b, s)?);
    }
    Ok(out)
}

pub fn op_gate<B: Backend>(b: &B, h: usize, d: usize, gate: KdaGate) -> Res<Vec<Vec<f32>>> {
    let mut r = Rng(7);
    let n = 9;
    let f = b.upload_f32(&[n, h * d], &r.vec(n * h * d, 3.0))?;
    let a = b.upload_f32(&[h], &r.vec(h, 1.0))?;
    let bias = b.upload_f32(&[h * d], &r.vec(h * d, 0.5))?;
    Ok(vec![t(b, &b.kda_gate(&f, &a, &bias, h, gate)?)?])
}

pub fn op_kda<B: Backend>(b: &B, h: usize, d: usize, mode: KdaMode) -> Res<Vec<Vec<f32>>> {
    let mut r = Rng(8);
    let lens = [1usize, 70, 5];
    let n: usize = lens.iter().sum();
    let w = h * d;
    let q = b.upload_f32(&[n, w], &r.vec(n * w, 1.0))?;
    let k = b.upload_f32(&[n, w], &r.vec(n * w, 1.0))?;
    let v = b.upload_f32(&[n, w], &r.vec(n * w, 1.0))?;
    let g: Vec<f32> = r
        .vec(n * w, 1.0)
        .iter()
        .map(|x| -0.5 * (x + 1.0) - 0.01)
        .collect();
    let g = b.upload_f32(&[n, w], &g)?;
    let beta: Vec<f32> = r.vec(n * h, 1.0).iter().map(|x| 0.5 + 0.5 * x).collect();
    let beta = b.upload_f32(&[n, h], &beta)?;
    let mut segs = vec![];
    let mut start = 0;
    for l in lens {
        segs.push(Segment { start, len: l });
        start += l;
    }
    let mut states: Vec<B::Tensor> = (0..lens.len())
        .map(|_| b.upload_f32(&[h, d, d], &r.vec(h * d * d, 0.1)))
        .collect::<Result<_, _>>()?;
    let mut refs: Vec<&mut B::Tensor> = states.iter_mut().collect();
    let o = t(b, &b.kda(&q, &k, &v, &g, &beta, h, &segs, &mut refs, mode)?)?;
    let mut out = vec![o];
    for s in &states {
        out.push(t(b, s)?);
    }
    Ok(out)
}

/// A forget gate from random pre-activations through `kda_gate` (`[n, h*d]`), with every
/// 11th channel pushed far below zero (decays that underflow within a chunk).
pub fn kda_gates<B: Backend>(
    b: &B,
    r: &mut Rng,
    n: usize,
    h: usize,
    d: usize,
    gate: KdaGate,
) -> Res<B::Tensor> {
    let f: Vec<f32> = r
        .vec(n * h * d, 3.0)
        .into_iter()
        .enumerate()
        .map(|(i, x)| if i % 11 == 0 { x + 25.0 } else { x })
        .collect();
    let f = b.upload_f32(&[n, h * d], &f)?;
    let a = b.upload_f32(&[h], &r.vec(h, 1.0))?;
    let bias = b.upload_f32(&[h * d], &r.vec(h * d, 0.5))?;
    Ok(b.kda_gate(&f, &a, &bias, h, gate)?)
}

/// `kda` over segments of `lens` rows with random non-zero initial states; returns the
/// output and every final state.
pub fn op_kda_segs<B: Backend>(
    b: &B,
    h: usize,
    d: usize,
    lens: &[usize],
    gate: KdaGate,
    mode: KdaMode,
) -> Res<Vec<Vec<f32>>> {
    let mut r = Rng(10 + lens.len() as u64);
    let n: usize = lens.iter().sum();
    let w = h * d;
    let q = b.upload_f32(&[n, w], &r.vec(n * w, 1.0))?;
    let k = b.upload_f32(&[n, w], &r.vec(n * w, 1.0))?;
    let v = b.upload_f32(&[n, w], &r.vec(n * w, 1.0))?;
    let g = kda_gates(b, &mut r, n, h, d, gate)?;
    let beta: Vec<f32> = r.vec(n * h, 1.0).iter().map(|x| 0.5 + 0.5 * x).collect();
    let beta = b.upload_f32(&[n, h], &beta)?;
    let mut segs = vec![];
    let mut start = 0;
    for &l in lens {
        segs.push(Segment { start, len: l });
        start += l;
    }
    let mut states: Vec<B::Tensor> = lens
        .iter()
        .map(|_| b.upload_f32(&[h, d, d], &r.vec(h * d * d, 0.3)))
        .collect::<Result<_, _>>()?;
    let mut refs: Vec<&mut B::Tensor> = states.iter_mut().collect();
    let o = t(b, &b.kda(&q, &k, &v, &g, &beta, h, &segs, &mut refs, mode)?)?;
    let mut out = vec![o];
    for s in &states {
        out.push(t(b, s)?);
    }
    Ok(out)
}

/// One sequence's KDA cache: `[q, k, v]` conv windows and the state.
type KdaCache<B> = ([<B as Backend>::Tensor; 3], <B as Backend>::Tensor);

/// Three decode steps of `batch` one-token sequences through `Backend::kda_decode` (fused
/// on CUDA) and through `kda_decode_composed` on copies of the same caches. Returns
/// `[fused y, composed y, fused states, composed states, fused conv windows, composed
/// conv windows]`, each concatenated over steps or sequences.
pub fn op_kda_decode<B: Backend>(
    b: &B,
    batch: usize,
    h: usize,
    d: usize,
    gate: KdaGate,
) -> Res<Vec<Vec<f32>>> {
    let mut r = Rng(20 + batch as u64);
    let (w, width) = (4usize, h * d);
    let conv: Vec<B::Tensor> = (0..3)
        .map(|_| weight(b, &[width, 1, w], &r.vec(width * w, 0.5), DType::BF16))
        .collect::<Res<_>>()?;
    let a_log = b.upload_f32(&[1, 1, h, 1], &r.vec(h, 1.0))?;
    let dt_bias = weight(b, &[width], &r.vec(width, 0.5), DType::F32)?;
    let o_norm = weight(b, &[d], &r.vec(d, 1.0), DType::BF16)?;
    let weights = KdaStepWeights {
        conv: [&conv[0], &conv[1], &conv[2]],
        a_log: &a_log,
        dt_bias: &dt_bias,
        o_norm: &o_norm,
        gate,
        eps: 1e-5,
    };
    // Two identical cache sets: [q, k, v] windows and the state, per sequence.
    let mut sets: Vec<Vec<KdaCache<B>>> = vec![vec![], vec![]];
    for _ in 0..batch {
        let wins: Vec<Vec<f32>> = (0..3).map(|_| r.vec((w - 1) * width, 1.0)).collect();
        let st = r.vec(h * d * d, 0.3);
        for set in sets.iter_mut() {
            set.push((
                [
                    b.upload_f32(&[w - 1, width], &wins[0])?,
                    b.upload_f32(&[w - 1, width], &wins[1])?,
                    b.upload_f32(&[w - 1, width], &wins[2])?,
                ],
                b.upload_f32(&[h, d, d], &st)?,
            ));
        }
    }
    // Sequences in reverse row order, so segment i is not row i.
    let segs: Vec<Segment> = (0..batch)
        .map(|i| Segment {
            start: batch - 1 - i,
            len: 1,
        })
        .collect();
    let mut ys = vec![vec![], vec![]];
    for _step in 0..3 {
        let pre: Vec<B::Tensor> = (0..3)
            .map(|_| b.upload_f32(&[batch, width], &r.vec(batch * width, 1.0)))
            .collect::<Result<_, _>>()?;
        let f = b.upload_f32(&[batch, width], &r.vec(batch * width, 3.0))?;
        let bl = b.upload_f32(&[batch, h], &r.vec(batch * h, 2.0))?;
        let z = b.upload_f32(&[batch, width], &r.vec(batch * width, 2.0))?;
        let inputs = KdaStepInputs {
            qkv: [&pre[0], &pre[1], &pre[2]],
            f: &f,
            beta_logits: &bl,
            z: &z,
        };
        for (which, set) in sets.iter_mut().enumerate() {
            let mut caches: Vec<(&mut [B::Tensor; 3], &mut B::Tensor)> =
                set.iter_mut().map(|(c, s)| (c, s)).collect();
            let y = if which == 0 {
                b.kda_decode(&inputs, &weights, h, &segs, &mut caches)?
            } else {
                kda_decode_composed(b, &inputs, &weights, h, &segs, &mut caches)?
            };
            ys[which].extend(t(b, &y)?);
        }
    }
    let mut out = ys;
    for set in &sets {
        let mut st = vec![];
        for (_, s) in set {
            st.extend(t(b, s)?);
        }
        out.push(st);
    }
    for set in &sets {
        let mut win = vec![];
        for (c, _) in set {
            for x in c {
                win.extend(t(b, x)?);
            }
        }
        out.push(win);
    }
    Ok(out)
}

/// Paged MLA over one pool with scattered, out-of-order block tables of `block_size`:
/// a prefill of two sequences (13 and 40 tokens), a step of 1 and 3 tokens, then the first
/// sequence is done and a third (20 tokens) reuses its blocks, stale rows included, next to
/// 2 more tokens of the second. Outputs: each call's result, then the whole pool.
pub fn op_mla<B: Backend>(
    b: &B,
    dims: MlaDims,
    mode: MlaMode,
    dt: DType,
    block_size: usize,
) -> Res<Vec<Vec<f32>>> {
    let mut r = Rng(9);
    let (h, rk, dn, dr, dv) = (
        dims.num_heads,
        dims.kv_lora_rank,
        dims.qk_nope_head_dim,
        dims.qk_rope_head_dim,
        dims.v_head_dim,
    );
    let kvb = weight(
        b,
        &[h * (dn + dv), rk],
        &r.vec(h * (dn + dv) * rk, (rk as f32).powf(-0.5)),
        dt,
    )?;
    let blocks = |tokens: usize| tokens.div_ceil(block_size);
    let num_blocks = blocks(14) + blocks(45) + blocks(20) + 1;
    let mut pool = b.zeros(&[num_blocks, block_size, rk + dr])?;
    // A scattered permutation of the pool's blocks.
    let mut ids: Vec<u32> = (0..num_blocks as u32).collect();
    ids.sort_by_key(|&k| (k as usize * 37 + 11) % 101);
    let (first, rest) = ids.split_at(blocks(14));
    let (second, spare) = rest.split_at(blocks(45));
    let mut third: Vec<u32> = first.iter().rev().copied().collect();
    third.extend_from_slice(spare);
    // (tables, cached lengths, new lengths) of each call.
    type Call<'a> = ([&'a [u32]; 2], [usize; 2], [usize; 2]);
    let calls: [Call<'_>; 3] = [
        ([first, second], [0, 0], [13, 40]),
        ([first, second], [13, 40], [1, 3]),
        ([second, &third], [43, 0], [2, 20]),
    ];
    let mut out = vec![];
    for (tables, cached, lens) in calls {
        let n: usize = lens.iter().sum();
        let q = b.upload_f32(&[n, h * (dn + dr)], &r.vec(n * h * (dn + dr), 1.0))?;
        let lat = b.upload_f32(&[n, rk + dr], &r.vec(n * (rk + dr), 1.0))?;
        let segs = [
            Segment {
                start: 0,
                len: lens[0],
            },
            Segment {
                start: lens[0],
                len: lens[1],
            },
        ];
        let seqs = [
            PagedSeq {
                block_table: tables[0],
                num_cached: cached[0],
            },
            PagedSeq {
                block_table: tables[1],
                num_cached: cached[1],
            },
        ];
        out.push(t(
            b,
            &b.mla(&q, &lat, &kvb, &dims, &segs, &mut pool, &seqs, mode)?,
        )?);
    }
    out.push(t(b, &pool)?);
    Ok(out)
}

/// MLA with caches that already hold `past[i]` random latent rows: one call whose
/// segment `i` adds `lens[i]` tokens, then (when `steps > 0`) `steps` one-token calls over
/// every sequence. Returns each call's output and the final caches.
#[allow(clippy::too_many_arguments)]
pub fn op_mla_ctx<B: Backend>(
    b: &B,
    dims: MlaDims,
    mode: MlaMode,
    dt: DType,
    past: &[usize],
    lens: &[usize],
    steps: usize,
    seed: u64,
) -> Res<Vec<Vec<f32>>> {
    let calls: Vec<Vec<usize>> = std::iter::once(lens.to_vec())
        .chain((0..steps).map(|_| vec![1; past.len()]))
        .collect();
    op_mla_calls(b, dims, mode, dt, past, &calls, seed)
}

/// As [`op_mla_ctx`] with the calls spelled out: call `k` adds `calls[k][i]` tokens to
/// sequence `i` (each call a segment per sequence).
pub fn op_mla_calls<B: Backend>(
    b: &B,
    dims: MlaDims,
    mode: MlaMode,
    dt: DType,
    past: &[usize],
    calls: &[Vec<usize>],
    seed: u64,
) -> Res<Vec<Vec<f32>>> {
    let mut r = Rng(seed);
    let (h, rk, dn, dr, dv) = (
        dims.num_heads,
        dims.kv_lora_rank,
        dims.qk_nope_head_dim,
        dims.qk_rope_head_dim,
        dims.v_head_dim,
    );
    let (qw, lw) = (h * (dn + dr), rk + dr);
    let kvb = weight(
        b,
        &[h * (dn + dv), rk],
        &r.vec(h * (dn + dv) * rk, (rk as f32).powf(-0.5)),
        dt,
    )?;
    // A paged pool of 16-token blocks; each sequence's blocks are interleaved with the
    // others' and in descending order, so no table is contiguous. The `past` rows are
    // random latents placed through the tables before the first call.
    let bs = 16;
    let need: Vec<usize> = past
        .iter()
        .enumerate()
        .map(|(i, &p)| {
            (p + calls.iter().map(|c| c[i]).sum::<usize>())
                .div_ceil(bs)
                .max(1)
        })
        .collect();
    let num_blocks: usize = need.iter().sum();
    let seqs_n = past.len();
    let mut tables: Vec<Vec<u32>> = vec![vec![]; seqs_n];
    let mut next = num_blocks;
    for j in 0..need.iter().copied().max().unwrap_or(0) {
        for (s, table) in tables.iter_mut().enumerate() {
            if j < need[s] {
                next -= 1;
                table.push(next as u32);
            }
        }
    }
    let mut host_pool = vec![0f32; num_blocks * bs * lw];
    for (s, &p) in past.iter().enumerate() {
        let rows = r.vec(p * lw, 1.0);
        for i in 0..p {
            let at = (tables[s][i / bs] as usize * bs + i % bs) * lw;
            host_pool[at..at + lw].copy_from_slice(&rows[i * lw..(i + 1) * lw]);
        }
    }
    let mut pool = b.upload_f32(&[num_blocks, bs, lw], &host_pool)?;
    let mut cached: Vec<usize> = past.to_vec();
    let mut out = vec![];
    for lens in calls {
        let n: usize = lens.iter().sum();
        // q scaled up so that the softmax is not flat over long contexts.
        let q = b.upload_f32(&[n, qw], &r.vec(n * qw, 2.0))?;
        let lat = b.upload_f32(&[n, lw], &r.vec(n * lw, 1.0))?;
        let mut segs = vec![];
        let mut start = 0;
        for &l in lens {
            segs.push(Segment { start, len: l });
            start += l;
        }
        let seqs: Vec<PagedSeq<'_>> = tables
            .iter()
            .zip(&cached)
            .map(|(table, &num_cached)| PagedSeq {
                block_table: table,
                num_cached,
            })
            .collect();
        out.push(t(
            b,
            &b.mla(&q, &lat, &kvb, &dims, &segs, &mut pool, &seqs, mode)?,
        )?);
        for (c, l) in cached.iter_mut().zip(lens) {
            *c += l;
        }
    }
    out.push(t(b, &pool)?);
    Ok(out)
}

/// Every op case: `(label, case)`.
pub fn cases() -> Vec<(String, Case)> {
    let small_mla = MlaDims {
        num_heads: 3,
        kv_lora_rank: 40,
        qk_nope_head_dim: 24,
        qk_rope_head_dim: 8,
        v_head_dim: 20,
        scale: 0.15,
    };
    let real_mla = MlaDims {
        num_heads: 32,
        kv_lora_rank: 512,
        qk_nope_head_dim: 128,
        qk_rope_head_dim: 64,
        v_head_dim: 128,
        scale: 0.0722,
    };
    let mut v: Vec<(String, Case)> = vec![
        (
            "embedding bf16 1000x96".into(),
            case!(|b| op_embedding(b, 1000, 96, DType::BF16)),
        ),
        (
            "embedding f32 500x2304".into(),
            case!(|b| op_embedding(b, 500, 2304, DType::F32)),
        ),
        (
            "matmul f32 1x64->96".into(),
            case!(|b| op_matmul(b, 1, 64, 96, DType::F32)),
        ),
        (
            "matmul f32 33x512->300".into(),
            case!(|b| op_matmul(b, 33, 512, 300, DType::F32)),
        ),
        ("argmax rows (greedy picks)".into(), case!(op_argmax)),
        (
            "sample rows (penalties, temperature, top-k/p, min-p)".into(),
            case!(op_sample),
        ),
        (
            "matmul bf16 1x2304->1024".into(),
            case!(|b| op_matmul(b, 1, 2304, 1024, DType::BF16)),
        ),
        (
            "matmul bf16 1x2304->4101 (GEMV, partial last tile)".into(),
            case!(|b| op_matmul(b, 1, 2304, 4101, DType::BF16)),
        ),
        (
            "matmul bf16 1x1024->300 (GEMV)".into(),
            case!(|b| op_matmul(b, 1, 1024, 300, DType::BF16)),
        ),
        (
            "matmul bf16 77x2304->512".into(),
            case!(|b| op_matmul(b, 77, 2304, 512, DType::BF16)),
        ),
        (
            "matmul bf16 600x512->136 (two accumulating GEMMs)".into(),
            case!(|b| op_matmul(b, 600, 512, 136, DType::BF16)),
        ),
        (
            "matmul 8x256x301 bf16 (gemv)".into(),
            case!(|b| op_matmul(b, 8, 256, 301, DType::BF16)),
        ),
        (
            "matmul 5x260x70 bf16 (k % 8 != 0)".into(),
            case!(|b| op_matmul(b, 5, 260, 70, DType::BF16)),
        ),
        (
            "matmul_split bf16 600x512->[200,136,64] (per-block GEMMs)".into(),
            case!(|b| op_matmul_split(b, 600, 512, &[200, 136, 64])),
        ),
        (
            "matmul_split bf16 40x256->[96,32] (2n-row GEMMs)".into(),
            case!(|b| op_matmul_split(b, 40, 256, &[96, 32])),
        ),
        (
            "matmul_split bf16 1x2304->[128,64,32] (GEMV, views)".into(),
            case!(|b| op_matmul_split(b, 1, 2304, &[128, 64, 32])),
        ),
        (
            "matmul_pair bf16 1x128->(4096, 4101) (one launch)".into(),
            case!(|b| op_matmul_pair(b, 1, 128, 4096, 4101)),
        ),
        (
            "matmul_pair bf16 3x128->(200, 72) (two products)".into(),
            case!(|b| op_matmul_pair(b, 3, 128, 200, 72)),
        ),
        (
            "rows(norm,sig,add,sel,split,cat,gated,add+norm) 5x64".into(),
            case!(|b| op_rows(b, 5, 64)),
        ),
        (
            "rows(norm,sig,add,sel,split,cat,gated,add+norm) 40x2304".into(),
            case!(|b| op_rows(b, 40, 2304)),
        ),
        (
            "rows(...) 1x2304 (split as views)".into(),
            case!(|b| op_rows(b, 1, 2304)),
        ),
        ("mlp 7x256x512".into(), case!(|b| op_mlp(b, 7, 256, 512))),
        (
            "moe 1 tok, 16e groups 4".into(),
            case!(|b| op_moe(b, 1, 128, 16, 4)),
        ),
        (
            "moe 50 tok, 16e ungrouped".into(),
            case!(|b| op_moe(b, 50, 128, 16, 1)),
        ),
        (
            "moe 64 tok, 32e groups 8".into(),
            case!(|b| op_moe(b, 64, 96, 32, 8)),
        ),
        (
            "moe 100 tok, 16e groups 4 (grouped tensor-core path)".into(),
            case!(|b| op_moe(b, 100, 128, 16, 4)),
        ),
        (
            "moe 300 tok, 64e top8, inter 192 (grouped, partial tiles)".into(),
            case!(|b| op_moe_sized(b, 300, 256, 64, 1, 192, 8)),
        ),
        (
            "moe 520 tok, 32e top8, d 2304 inter 1024 (48B widths, grouped)".into(),
            case!(|b| op_moe_sized(b, 520, 2304, 32, 1, 1024, 8)),
        ),
        (
            "moe 1100 tok, 64e top8 (multi-block routing lists)".into(),
            case!(|b| op_moe_sized(b, 1100, 256, 64, 1, 192, 8)),
        ),
        (
            "moe 2100 tok, 600e top8 (block router, multi-block lists)".into(),
            case!(|b| op_moe_sized(b, 2100, 128, 600, 1, 64, 8)),
        ),
        (
            "moe 90 tok, 16e, d 96 (cuBLAS per-expert path)".into(),
            case!(|b| op_moe_sized(b, 90, 96, 16, 1, 64, 4)),
        ),
        (
            "moe 1 tok, 32e top8, d 2304 inter 1024, shared streamed (moe_stream_layer)".into(),
            case!(|b| op_moe_shared(b, 1, 2304, 32, 1, 1024, 8, 1024)),
        ),
        (
            "moe 1 tok, 32e top6, d 1280 inter 768, shared streamed (one-launch layer)".into(),
            case!(|b| op_moe_shared(b, 1, 1280, 32, 1, 768, 6, 768)),
        ),
        (
            "moe 1 tok, 16e top4, d 512 inter 256, shared an MLP (streamed, sliced rows)".into(),
            case!(|b| op_moe_shared(b, 1, 512, 16, 1, 256, 4, 128)),
        ),
        (
            "moe 5 tok, 16e top4, d 512 inter 256 (pairs share experts)".into(),
            case!(|b| op_moe_shared(b, 5, 512, 16, 1, 256, 4, 256)),
        ),
        (
            "moe 8 tok, 16e, d 100 (unaligned)".into(),
            case!(|b| op_moe(b, 8, 100, 16, 1)),
        ),
        (
            "short_conv c=96 w=4 (out, 3 states)".into(),
            case!(|b| op_conv(b, 96, 4)),
        ),
        ("short_conv c=40 w=3".into(), case!(|b| op_conv(b, 40, 3))),
        (
            "short_conv c=33 w=5 (generic kernel)".into(),
            case!(|b| op_conv(b, 33, 5)),
        ),
        (
            "kda_gate softplus 4x32".into(),
            case!(|b| op_gate(b, 4, 32, KdaGate::Softplus)),
        ),
        (
            "kda_gate lowerbound 3x20".into(),
            case!(|b| op_gate(b, 3, 20, KdaGate::LowerBound(-5.0))),
        ),
        (
            "kda recurrent h2 d20 (out, 3 states)".into(),
            case!(|b| op_kda(b, 2, 20, KdaMode::Recurrent)),
        ),
        (
            "kda chunked h3 d64".into(),
            case!(|b| op_kda(b, 3, 64, KdaMode::Chunked)),
        ),
        (
            "kda auto h4 d128".into(),
            case!(|b| op_kda(b, 4, 128, KdaMode::Auto)),
        ),
        (
            "mla expanded small f32 paged bs16 (3 calls)".into(),
            case!(|b| op_mla(b, small_mla, MlaMode::Expanded, DType::F32, 16)),
        ),
        (
            "mla expanded small f32 paged bs5".into(),
            case!(|b| op_mla(b, small_mla, MlaMode::Expanded, DType::F32, 5)),
        ),
        (
            "mla absorbed small f32 paged bs1".into(),
            case!(|b| op_mla(b, small_mla, MlaMode::Absorbed, DType::F32, 1)),
        ),
        (
            "mla absorbed small f32 paged bs7".into(),
            case!(|b| op_mla(b, small_mla, MlaMode::Absorbed, DType::F32, 7)),
        ),
        (
            "mla auto real-dims bf16 paged bs16".into(),
            case!(|b| op_mla(b, real_mla, MlaMode::Auto, DType::BF16, 16)),
        ),
        (
            "mla auto real-dims bf16 paged bs3".into(),
            case!(|b| op_mla(b, real_mla, MlaMode::Auto, DType::BF16, 3)),
        ),
        (
            "mla absorbed real-dims bf16 paged bs64".into(),
            case!(|b| op_mla(b, real_mla, MlaMode::Absorbed, DType::BF16, 64)),
        ),
        (
            "mla expanded real-dims bf16 paged bs11".into(),
            case!(|b| op_mla(b, real_mla, MlaMode::Expanded, DType::BF16, 11)),
        ),
    ];
    v.extend(mla_cases());
    v.extend(kda_cases());
    v
}

/// Flash prefill and split-KV decode at the lengths where their tiling changes.
fn mla_cases() -> Vec<(String, Case)> {
    let vec_mla = MlaDims {
        num_heads: 3,
        kv_lora_rank: 40,
        qk_nope_head_dim: 16,
        qk_rope_head_dim: 8,
        v_head_dim: 12,
        scale: 0.2,
    };
    let odd_mla = MlaDims {
        num_heads: 2,
        kv_lora_rank: 37,
        qk_nope_head_dim: 13,
        qk_rope_head_dim: 7,
        v_head_dim: 11,
        scale: 0.22,
    };
    let real_mla = MlaDims {
        num_heads: 32,
        kv_lora_rank: 512,
        qk_nope_head_dim: 128,
        qk_rope_head_dim: 64,
        v_head_dim: 128,
        scale: 0.0722,
    };
    let mut v: Vec<(String, Case)> = vec![];
    // Expanded prefill: T = 1, 17, 64, 130, 1000 with and without earlier context.
    for (label, dims) in [("small", vec_mla), ("odd", odd_mla)] {
        v.push((
            format!("mla prefill {label} T=1,17,64,130,1000 past 0"),
            case!(move |b| op_mla_ctx(
                b,
                dims,
                MlaMode::Expanded,
                DType::F32,
                &[0, 0, 0, 0, 0],
                &[1, 17, 64, 130, 1000],
                0,
                21
            )),
        ));
        v.push((
            format!("mla prefill {label} T=1,17,64,130,1000 past 5,63,64,200,77"),
            case!(move |b| op_mla_ctx(
                b,
                dims,
                MlaMode::Expanded,
                DType::F32,
                &[5, 63, 64, 200, 77],
                &[1, 17, 64, 130, 1000],
                0,
                22
            )),
        ));
    }
    v.push((
        "mla prefill real bf16 T=1000 past 0".into(),
        case!(|b| op_mla_ctx(
            b,
            real_mla,
            MlaMode::Expanded,
            DType::BF16,
            &[0],
            &[1000],
            0,
            23
        )),
    ));
    v.push((
        "mla prefill real f32 T=17,130,64 past 0,300,1000".into(),
        case!(|b| op_mla_ctx(
            b,
            real_mla,
            MlaMode::Expanded,
            DType::F32,
            &[0, 300, 1000],
            &[17, 130, 64],
            0,
            24
        )),
    ));
    // The tensor-core prefill kernel (real head dims, 4 heads): a 200-token prompt (two
    // 128-query tiles, the second partial), then 75 more tokens over 200 cached; and two
    // sequences with cached rows, then a one-token and a 190-token Expanded call. Totals
    // are not multiples of the 64-key tile.
    let mma_mla = MlaDims {
        num_heads: 4,
        ..real_mla
    };
    v.push((
        "mla prefill mma H=4 bf16 T=200 past 0, then T=75 past 200".into(),
        case!(move |b| op_mla_calls(
            b,
            mma_mla,
            MlaMode::Expanded,
            DType::BF16,
            &[0],
            &[vec![200], vec![75]],
            28
        )),
    ));
    v.push((
        "mla prefill mma H=4 bf16 T=130,61 past 37,0, then T=1,190".into(),
        case!(move |b| op_mla_calls(
            b,
            mma_mla,
            MlaMode::Expanded,
            DType::BF16,
            &[37, 0],
            &[vec![130, 61], vec![1, 190]],
            29
        )),
    ));
    // Absorbed decode: contexts 1, 100, 5000, 70000 (past the old shared-memory cap), one
    // token per sequence (Auto), then 2 steps; and small multi-token segments (Absorbed).
    for (label, dims, dt) in [
        ("small f32", vec_mla, DType::F32),
        ("odd bf16", odd_mla, DType::BF16),
        ("real bf16", real_mla, DType::BF16),
        ("real f32", real_mla, DType::F32),
    ] {
        v.push((
            format!("mla decode {label} ctx 1,100,5000,70000 (+2 steps)"),
            case!(move |b| op_mla_ctx(
                b,
                dims,
                MlaMode::Auto,
                dt,
                &[0, 99, 4999, 69_999],
                &[1, 1, 1, 1],
                2,
                25
            )),
        ));
    }
    for (label, dims) in [("small", vec_mla), ("real", real_mla)] {
        v.push((
            format!("mla absorbed {label} bf16 segments 3,1,17 past 0,5000,130"),
            case!(move |b| op_mla_ctx(
                b,
                dims,
                MlaMode::Absorbed,
                DType::BF16,
                &[0, 5000, 130],
                &[3, 1, 17],
                1,
                26
            )),
        ));
    }
    // More query rows than one launch group (128 tokens) and a long absorbed segment.
    v.push((
        "mla absorbed small f32 T=300 past 40 (3 launch groups)".into(),
        case!(|b| op_mla_ctx(
            b,
            vec_mla,
            MlaMode::Absorbed,
            DType::F32,
            &[40, 7],
            &[300, 1],
            0,
            27
        )),
    ));
    v
}

/// The KDA kernels: chunked at lengths around the chunk size with several segments and
/// non-zero initial states, both gate kinds and head sizes 64/128; mixed Auto calls;
/// the split-V recurrence; more than 64 segments in one call (two launches); and the fused
/// decode step against the composed ops.
pub fn kda_cases() -> Vec<(String, Case)> {
    let gates = [
        ("softplus", KdaGate::Softplus),
        ("lowerbound", KdaGate::LowerBound(-5.0)),
    ];
    let mut out: Vec<(String, Case)> = vec![];
    for d in [64usize, 128] {
        for (gname, gate) in gates {
            for len in [1usize, 63, 64, 65, 200, 1000] {
                // The long segment first, then a one-token and a two-chunk segment.
                let lens = vec![len, 1, 70];
                out.push((
                    format!("kda chunked d{d} {gname} T={len} (+1, +70) h3"),
                    case!(|b| op_kda_segs(b, 3, d, &lens, gate, KdaMode::Chunked)),
                ));
            }
        }
        let mixed = vec![1usize, 130, 1, 1, 64, 2];
        out.push((
            format!("kda auto mixed lens d{d} h4"),
            case!(|b| op_kda_segs(b, 4, d, &mixed, KdaGate::Softplus, KdaMode::Auto)),
        ));
        let rec = vec![1usize, 37, 5];
        out.push((
            format!("kda recurrent split d{d} h4"),
            case!(|b| op_kda_segs(b, 4, d, &rec, KdaGate::Softplus, KdaMode::Recurrent)),
        ));
    }
    // The chunked kernels in their other settings (CUDA side; the CPU reference is the same):
    // bf16 operands only (Half, looser tolerance), the f32 kernels, and launch groups of at
    // most 2 chunks (segments cut and continued from their state).
    for d in [64usize, 128] {
        let lens = vec![200usize, 1, 70, 129];
        for (label, setting) in [
            ("[half]", 0usize),
            ("f32 kernels", 1),
            ("pair-loop prep", 3),
            ("2-chunk groups", 2),
        ] {
            let lens = lens.clone();
            let c: Case = Box::new(move |r: &dyn Runner| match (r.cpu(), r.cuda()) {
                (Some(b), _) => op_kda_segs(b, 3, d, &lens, KdaGate::Softplus, KdaMode::Chunked),
                (_, Some(b)) => {
                    let before = b.kernel_config();
                    let mut cfg = before;
                    match setting {
                        0 => cfg.precision = GemmPrecision::Half,
                        1 => cfg.kda_chunk = KdaChunkKernel::F32,
                        3 => cfg.kda_chunk = KdaChunkKernel::MmaPairPrep,
                        _ => cfg.kda_group_chunks = std::num::NonZeroUsize::new(2),
                    }
                    b.set_kernel_config(cfg)?;
                    let out = op_kda_segs(b, 3, d, &lens, KdaGate::Softplus, KdaMode::Chunked);
                    b.set_kernel_config(before)?;
                    out
                }
                _ => unreachable!(),
            });
            out.push((
                format!("kda chunked d{d} {label} T=200 (+1, +70, +129) h3"),
                c,
            ));
        }
    }
    let many: Vec<usize> = (0..70).map(|i| 1 + i % 3).collect();
    let many2 = many.clone();
    out.push((
        "kda chunked 70 segments d64 h2".into(),
        case!(|b| op_kda_segs(b, 2, 64, &many, KdaGate::Softplus, KdaMode::Chunked)),
    ));
    out.push((
        "kda recurrent 70 segments d128 h2".into(),
        case!(|b| op_kda_segs(b, 2, 128, &many2, KdaGate::Softplus, KdaMode::Recurrent)),
    ));
    out.push((
        "kda chunked d20 fallback h2".into(),
        case!(|b| op_kda_segs(b, 2, 20, &[100, 3], KdaGate::Softplus, KdaMode::Chunked)),
    ));
    for (batch, h, d, (gname, gate)) in [
        (1usize, 4usize, 128usize, gates[0]),
        (3, 4, 128, gates[1]),
        (64, 4, 128, gates[0]),
        (70, 2, 64, gates[1]),
        (3, 2, 64, gates[0]),
        (2, 2, 20, gates[0]),
    ] {
        out.push((
            format!("kda_decode B={batch} h{h} d{d} {gname} (y, y', S, S', conv, conv')"),
            case!(|b| op_kda_decode(b, batch, h, d, gate)),
        ));
    }
    out
}
