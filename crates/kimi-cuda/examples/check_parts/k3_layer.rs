//! `k3-moe-bench`: one Kimi K3 LatentMoE layer at full width on the GPU (hidden 7168, 896
//! MXFP4 experts top-16 in the 3584-wide latent, expert width 3072, two shared experts as
//! one 6144-wide SiTU MLP, the f32 router with its correction bias), random weights. Per
//! batch size: the whole layer (routing, latent down-projection, routed experts, latent
//! RMSNorm, up-projection, shared experts, sum) and the routed experts alone, inside replayed
//! passes of fresh activations, against the HBM roofline of the bytes each must read.

use std::io::Write;

use kimi_core::DType;
use kimi_cuda::{CudaBackend, CudaTensor};
use kimi_ops::{Backend, ExpertView, HostTensor, MlpWeights, MoeRouting};

use super::k3_cases::{mxfp4_blocks, SITU};
use super::op_cases::{self, Rng};
use super::{time_calls, Res};

const HIDDEN: usize = 7168;
const LATENT: usize = 3584;
const EXPERT_WIDTH: usize = 3072;
const EXPERTS: usize = 896;
const TOP_K: usize = 16;
const SHARED_WIDTH: usize = 6144;

/// Distinct random expert matrices; the 896 experts are uploaded copies of them (every
/// expert has its own device memory, so the bandwidth is that of 896 experts).
const PATTERNS: usize = 4;

struct Layer {
    router: CudaTensor,
    bias: CudaTensor,
    down: CudaTensor,
    norm: CudaTensor,
    up: CudaTensor,
    shared: MlpWeights<CudaTensor>,
    bank: Vec<MlpWeights<CudaTensor>>,
    routing: MoeRouting,
}

impl Layer {
    fn new(be: &CudaBackend, r: &mut Rng) -> Res<Self> {
        let bf16 = |r: &mut Rng, rows: usize, cols: usize| {
            op_cases::weight(
                be,
                &[rows, cols],
                &r.vec(rows * cols, (cols as f32).powf(-0.5)),
                DType::BF16,
            )
        };
        let patterns: Vec<[Vec<u8>; 3]> = (0..PATTERNS)
            .map(|_| {
                [
                    mxfp4_blocks(r, EXPERT_WIDTH, LATENT, false),
                    mxfp4_blocks(r, EXPERT_WIDTH, LATENT, false),
                    mxfp4_blocks(r, LATENT, EXPERT_WIDTH, false),
                ]
            })
            .collect();
        let mut experts = Vec::with_capacity(EXPERTS);
        for e in 0..EXPERTS {
            let [g, u, d] = &patterns[e % PATTERNS];
            let up = |bytes: &[u8], rows, cols| {
                be.upload(HostTensor {
                    shape: &[rows, cols],
                    dtype: DType::MXFP4,
                    bytes,
                })
            };
            experts.push(MlpWeights {
                gate: up(g, EXPERT_WIDTH, LATENT)?,
                up: up(u, EXPERT_WIDTH, LATENT)?,
                down: up(d, LATENT, EXPERT_WIDTH)?,
            });
        }
        Ok(Self {
            router: be.upload_f32(
                &[EXPERTS, HIDDEN],
                &r.vec(EXPERTS * HIDDEN, (HIDDEN as f32).powf(-0.5)),
            )?,
            bias: be.upload_f32(&[EXPERTS], &r.vec(EXPERTS, 0.05))?,
            down: bf16(r, LATENT, HIDDEN)?,
            norm: be.upload_f32(&[LATENT], &vec![1.0; LATENT])?,
            up: bf16(r, HIDDEN, LATENT)?,
            shared: MlpWeights {
                gate: bf16(r, SHARED_WIDTH, HIDDEN)?,
                up: bf16(r, SHARED_WIDTH, HIDDEN)?,
                down: bf16(r, HIDDEN, SHARED_WIDTH)?,
            },
            bank: experts,
            routing: MoeRouting {
                top_k: TOP_K,
                num_groups: 1,
                topk_group: 1,
                renormalize: true,
                scaling: 1.0,
                weights_use_bias: false,
            },
        })
    }

    /// The layer as `kimi_model`'s LatentMoE composes it.
    fn forward(&self, be: &CudaBackend, x: &CudaTensor) -> kimi_ops::Result<CudaTensor> {
        let routes = be.moe_route(x, &self.router, Some(&self.bias), &self.routing)?;
        let z = be.matmul(x, &self.down)?;
        let u = be.moe_experts(&z, &routes, &ExpertView::new(&self.bank), SITU)?;
        let u = be.rms_norm(&u, &self.norm, 1e-5)?;
        let mut y = be.matmul(&u, &self.up)?;
        be.add_assign(&mut y, &be.ffn(x, &self.shared, SITU)?)?;
        Ok(y)
    }
}

/// Bytes of one MXFP4 expert (gate, up and down).
const EXPERT_BYTES: usize = 3 * EXPERT_WIDTH * LATENT / 32 * 17;

pub fn k3_moe_bench() -> Res<()> {
    println!(
        "== K3 LatentMoE layer, full width: hidden {HIDDEN}, {EXPERTS} MXFP4 experts top-{TOP_K} \
         in a {LATENT} latent (width {EXPERT_WIDTH}), shared {SHARED_WIDTH} bf16, SiTU"
    );
    let be = CudaBackend::new(0)?;
    println!("device: {}", be.name());
    let bw = be.measure_read_bandwidth().unwrap_or(f64::NAN);
    println!("measured HBM read bandwidth {:.2} TB/s", bw / 1e12);
    let mut r = Rng(71);
    let t0 = std::time::Instant::now();
    let layer = Layer::new(&be, &mut r)?;
    let (free, total) = be.mem_info()?;
    println!(
        "layer built in {:.1} s: experts {:.2} GB, device memory used {:.1} of {:.1} GB",
        t0.elapsed().as_secs_f64(),
        (EXPERTS * EXPERT_BYTES) as f64 / 1e9,
        (total - free) as f64 / 1e9,
        total as f64 / 1e9
    );
    let dense_bytes = (2 * LATENT * HIDDEN + 3 * SHARED_WIDTH * HIDDEN) * 2 + EXPERTS * HIDDEN * 4;
    let mut key = 1u64 << 43;
    for n in [1usize, 16, 64, 256] {
        let calls = if n <= 64 { 8 } else { 4 };
        let xs = (0..calls)
            .map(|_| be.upload_f32(&[n, HIDDEN], &r.vec(n * HIDDEN, 1.0)))
            .collect::<kimi_ops::Result<Vec<_>>>()?;
        // Distinct experts each call reads (the roofline's bytes), and a finite check.
        let mut distinct_total = 0usize;
        for x in &xs {
            let routes = be.moe_route(x, &layer.router, Some(&layer.bias), &layer.routing)?;
            let mut ids = be.expert_ids(&routes.experts)?;
            ids.sort_unstable();
            ids.dedup();
            distinct_total += ids.len();
            let y = be.to_f32(&layer.forward(&be, x)?)?;
            if let Some(bad) = y.iter().find(|v| !v.is_finite()) {
                return Err(format!("K3 MoE layer n={n}: non-finite output {bad}").into());
            }
        }
        let experts_bytes = (distinct_total * EXPERT_BYTES) as f64 / calls as f64;
        let layer_bytes = experts_bytes + dense_bytes as f64;
        key += 1;
        let whole = time_calls(&be, 2, 5, || {
            be.replayable(Some(key), || -> kimi_ops::Result<()> {
                for x in &xs {
                    drop(layer.forward(&be, x)?);
                }
                Ok(())
            })?
        })? / calls as f64;
        // The routed experts alone, on latents and routes made beforehand.
        let prepared = xs
            .iter()
            .map(|x| {
                let routes = be.moe_route(x, &layer.router, Some(&layer.bias), &layer.routing)?;
                Ok((be.matmul(x, &layer.down)?, routes))
            })
            .collect::<kimi_ops::Result<Vec<_>>>()?;
        key += 1;
        let experts_only = time_calls(&be, 2, 5, || {
            be.replayable(Some(key), || -> kimi_ops::Result<()> {
                for (z, routes) in &prepared {
                    drop(be.moe_experts(z, routes, &ExpertView::new(&layer.bank), SITU)?);
                }
                Ok(())
            })?
        })? / calls as f64;
        println!(
            "n={n:<4} layer {:8.1} us = {:5.2} TB/s ({:4.1} % of measured) over {:6.1} MB | \
             routed experts {:8.1} us = {:5.2} TB/s ({:4.1} %) over {:6.1} MB ({:.0} experts)",
            whole * 1e6,
            layer_bytes / whole / 1e12,
            100.0 * layer_bytes / whole / bw,
            layer_bytes / 1e6,
            experts_only * 1e6,
            experts_bytes / experts_only / 1e12,
            100.0 * experts_bytes / experts_only / bw,
            experts_bytes / 1e6,
            distinct_total as f64 / calls as f64,
        );
        let _ = std::io::stdout().flush();
    }
    prefill(&be, &layer, &mut r)
}

/// The routed experts of prefill-sized batches on the MXFP4 tensor-core kernels, both
/// precisions, in useful TFLOP/s, beside cuBLAS bf16 (Half: one GEMM) on a GEMM of the same
/// M and K (`[n, 3584] x [3 * 3072, 3584]`).
fn prefill(be: &CudaBackend, layer: &Layer, r: &mut Rng) -> Res<()> {
    use kimi_cuda::GemmPrecision;
    for n in [1024usize, 8192] {
        let x = be.upload_f32(&[n, HIDDEN], &r.vec(n * HIDDEN, 1.0))?;
        let routes = be.moe_route(&x, &layer.router, Some(&layer.bias), &layer.routing)?;
        let z = be.matmul(&x, &layer.down)?;
        let flops = (n * TOP_K * 3 * 2 * LATENT * EXPERT_WIDTH) as f64;
        let mut line = format!("prefill n={n:<5} routed experts:");
        for prec in [GemmPrecision::Split, GemmPrecision::Half] {
            be.set_gemm_precision(prec);
            let y =
                be.to_f32(&be.moe_experts(&z, &routes, &ExpertView::new(&layer.bank), SITU)?)?;
            if let Some(bad) = y.iter().find(|v| !v.is_finite()) {
                return Err(format!("K3 experts n={n}: non-finite output {bad}").into());
            }
            let secs = time_calls(be, 1, 3, || {
                be.moe_experts(&z, &routes, &ExpertView::new(&layer.bank), SITU)
                    .map(drop)
            })?;
            line += &format!(
                "  {prec:?} {:8.2} ms = {:6.1} TFLOP/s",
                secs * 1e3,
                flops / secs / 1e12
            );
        }
        be.set_gemm_precision(GemmPrecision::Half);
        let w = op_cases::weight(
            be,
            &[3 * EXPERT_WIDTH, LATENT],
            &r.vec(3 * EXPERT_WIDTH * LATENT, 0.02),
            DType::BF16,
        )?;
        let secs = time_calls(be, 1, 5, || be.matmul(&z, &w).map(drop))?;
        let gemm_flops = (n * 3 * EXPERT_WIDTH * LATENT * 2) as f64;
        line += &format!(
            "  | cuBLAS bf16 [{n}, {LATENT}] x [{}, {LATENT}]: {:6.1} TFLOP/s",
            3 * EXPERT_WIDTH,
            gemm_flops / secs / 1e12
        );
        be.set_gemm_precision(GemmPrecision::Split);
        println!("{line}");
        let _ = std::io::stdout().flush();
    }
    Ok(())
}
