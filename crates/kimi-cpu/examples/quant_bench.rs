//! Times quantized matmuls at the demo model's shapes on both paths (int8 activations and
//! f32): `cargo run --release -p kimi-cpu --example quant_bench [reps] [threads]`. Best of
//! `reps`. `QB_16BIT=1` times f16/bf16 weights at Kimi Linear 0.5B's prefill shapes,
//! `QB_TILE=1` the f32 tile kernel alone, `QB_MXFP4=1` MXFP4 weights at the K3 CPU bench's
//! expert shapes over a range of token counts, `QB_MOE=1` that bench's routed experts
//! whole (11 layers of 128, top-16, cold in memory) per decoded token and per prefill. On a shared machine, `perf stat -e cycles:u` over one thread counts work without
//! the noise of other processes.

use std::time::Instant;

use kimi_core::DType;
use kimi_cpu::{CpuBackend, QuantMatmul};
use kimi_gguf::GgmlType;
use kimi_ops::{Activation, Backend, ExpertView, HostTensor, MlpWeights, MoeRoutes};

fn main() {
    let reps: usize = std::env::args()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(20);
    if let Some(threads) = std::env::args().nth(2).and_then(|s| s.parse().ok()) {
        kimi_cpu::set_num_threads(threads).unwrap();
    }
    let fast = CpuBackend::new();
    let exact = CpuBackend::with_quant_matmul(QuantMatmul::F32);
    if std::env::var("QB_TILE").is_ok() {
        return tile_kernel(reps);
    }
    if std::env::var("QB_16BIT").is_ok() {
        return sixteen_bit(&fast, reps);
    }
    if std::env::var("QB_MOE").is_ok() {
        return moe(&fast, &exact, reps);
    }
    if std::env::var("QB_MXFP4").is_ok() {
        return mxfp4(&fast, &exact, reps);
    }
    for (dtype, ty) in [
        (DType::Q4_1, GgmlType::Q4_1),
        (DType::Q8_0, GgmlType::Q8_0),
        (DType::Q4_0, GgmlType::Q4_0),
        (DType::Q5_0, GgmlType::Q5_0),
        (DType::Q4_K, GgmlType::Q4_K),
        (DType::Q5_K, GgmlType::Q5_K),
        (DType::Q6_K, GgmlType::Q6_K),
    ] {
        for (n, k, o) in [
            (1usize, 576usize, 1536usize),
            (1, 1024, 4096),
            (1, 4096, 1024),
            (128, 1024, 4096),
            (1, 1536, 576),
            (1, 576, 49152),
            (4, 576, 1536),
            (128, 576, 1536),
            (128, 1536, 576),
        ] {
            if !k.is_multiple_of(ty.block_size()) {
                continue;
            }
            let w: Vec<f32> = (0..o * k)
                .map(|i| ((i as u32).wrapping_mul(2654435761) % 1000) as f32 / 1000.0 - 0.5)
                .collect();
            let bytes = kimi_gguf::quantize(ty, &w).unwrap();
            let x: Vec<f32> = (0..n * k).map(|i| (i % 37) as f32 * 0.01 - 0.18).collect();
            let mut line = format!("{dtype:<5} n={n:<4} k={k:<5} o={o:<6}");
            // `QB_ONLY=q4_1/1/576/1536/int8` times one case (for `perf stat`).
            let only = std::env::var("QB_ONLY").ok();
            for (label, be) in [("int8", &fast), ("f32", &exact)] {
                let name = format!("{dtype}/{n}/{k}/{o}/{label}");
                if only.as_ref().is_some_and(|o| *o != name) {
                    continue;
                }
                let best = best_matmul(be, dtype, &bytes, &x, [n, k, o], reps);
                let gmacs = (n * k * o) as f64 / best / 1e9;
                let gbs = bytes.len() as f64 / best / 1e9;
                line += &format!(
                    "  {label} {:>8.1} us {gmacs:>6.1} GMAC/s {gbs:>5.1} GB/s",
                    best * 1e6
                );
            }
            println!("{line}");
        }
    }
}

/// The best of `reps` timed matmuls of `x [n, k]` by weights `[o, k]` of `dtype` (one
/// untimed call first), in seconds.
fn best_matmul(
    be: &CpuBackend,
    dtype: DType,
    bytes: &[u8],
    x: &[f32],
    [n, k, o]: [usize; 3],
    reps: usize,
) -> f64 {
    let wt = be
        .upload(HostTensor {
            shape: &[o, k],
            dtype,
            bytes,
        })
        .unwrap();
    let xt = be.upload_f32(&[n, k], x).unwrap();
    be.matmul(&xt, &wt).unwrap();
    let mut best = f64::MAX;
    for _ in 0..reps {
        let t = Instant::now();
        be.matmul(&xt, &wt).unwrap();
        best = best.min(t.elapsed().as_secs_f64());
    }
    best
}

/// `QB_16BIT=1`: f16 and bf16 weights at Kimi Linear 0.5B's prefill shapes (128 tokens: the
/// projections, an expert's share of tokens, the output head) and at one token.
fn sixteen_bit(be: &CpuBackend, reps: usize) {
    for dtype in [DType::F16, DType::BF16] {
        for (n, k, o) in [
            (128usize, 1024usize, 4096usize),
            (128, 4096, 1024),
            (128, 1024, 1024),
            (32, 1024, 512),
            (32, 512, 1024),
            (128, 1024, 32768),
            (1, 1024, 4096),
        ] {
            let bits: Vec<u16> = (0..o * k)
                .map(|i| {
                    let v = ((i as u32).wrapping_mul(2654435761) % 1000) as f32 / 1000.0 - 0.5;
                    match dtype {
                        DType::F16 => half::f16::from_f32(v).to_bits(),
                        _ => half::bf16::from_f32(v).to_bits(),
                    }
                })
                .collect();
            let bytes: Vec<u8> = bits.iter().flat_map(|b| b.to_le_bytes()).collect();
            let x: Vec<f32> = (0..n * k).map(|i| (i % 37) as f32 * 0.01 - 0.18).collect();
            let best = best_matmul(be, dtype, &bytes, &x, [n, k, o], reps);
            println!(
                "{dtype:<5} n={n:<4} k={k:<5} o={o:<6} {:>9.1} us {:>6.1} GFLOP/s",
                best * 1e6,
                2.0 * (n * k * o) as f64 / best / 1e9
            );
        }
    }
}

/// `QB_TILE=1`: the f32 tile kernel alone on cache-resident rows (four tokens, one thread):
/// its share of the FMA peak, apart from memory.
fn tile_kernel(reps: usize) {
    for (rows, k) in [(2usize, 512usize), (32, 512), (32, 1024), (32, 4096)] {
        let w: Vec<f32> = (0..rows * k).map(|i| (i % 29) as f32 * 0.01).collect();
        let xs: Vec<f32> = (0..4 * k).map(|i| (i % 31) as f32 * 0.01).collect();
        let x: [&[f32]; 4] = std::array::from_fn(|t| &xs[t * k..(t + 1) * k]);
        let mut acc = vec![[0f32; 8]; rows * 8];
        let mut out = vec![[0f32; 4]; rows];
        let inner = 200;
        let mut best = f64::MAX;
        for _ in 0..reps {
            let t = Instant::now();
            for _ in 0..inner {
                let rows_f32 = kimi_cpu::simd::TileRows::F32(&w);
                kimi_cpu::simd::tile_products(rows_f32, rows, k, x, &mut acc, &mut out);
            }
            best = best.min(t.elapsed().as_secs_f64() / inner as f64);
        }
        println!(
            "tile rows={rows:<3} k={k:<5} {:>8.2} us {:>6.1} GFLOP/s ({})",
            best * 1e6,
            2.0 * (rows * 4 * k) as f64 / best / 1e9,
            out[0][0]
        );
    }
}

/// `QB_MXFP4=1`: MXFP4 experts of `configs/bench-kimi-k3-cpu.json` (gate/up `[448, 512]`,
/// down `[512, 448]`) on both paths, from one token (decode) to an expert's share of a long
/// prefill.
fn mxfp4(fast: &CpuBackend, exact: &CpuBackend, reps: usize) {
    for (k, o) in [(512usize, 448usize), (448, 512)] {
        let w: Vec<f32> = (0..o * k)
            .map(|i| ((i as u32).wrapping_mul(2654435761) % 1000) as f32 / 1000.0 - 0.5)
            .collect();
        let bytes = kimi_gguf::quantize(GgmlType::MXFP4, &w).unwrap();
        for n in [1usize, 2, 4, 8, 16, 32, 64, 128] {
            let x: Vec<f32> = (0..n * k).map(|i| (i % 37) as f32 * 0.01 - 0.18).collect();
            let mut line = format!("MXFP4 n={n:<4} k={k:<5} o={o:<6}");
            for (label, be) in [("int8", fast), ("f32", exact)] {
                let best = best_matmul(be, DType::MXFP4, &bytes, &x, [n, k, o], reps);
                let gmacs = (n * k * o) as f64 / best / 1e9;
                line += &format!("  {label} {:>8.1} us {gmacs:>6.1} GMAC/s", best * 1e6);
            }
            println!("{line}");
        }
    }
}

/// `QB_MOE=1`: the routed experts of `configs/bench-kimi-k3-cpu.json` alone: 11 layers of
/// 128 MXFP4 experts (64 MB read per token at top-16, twice the last-level cache), random
/// routes, SiTU. Decode alternates the two paths token by token (the same routes for
/// both), so both see the same machine load; prints the median and best time per token and
/// the expert bytes per second, then one prefill of 256 tokens per path (best of `reps`).
fn moe(fast: &CpuBackend, exact: &CpuBackend, reps: usize) {
    const LAYERS: usize = 11;
    const EXPERTS: usize = 128;
    const TOP_K: usize = 16;
    let (d, width) = (512usize, 448usize);
    let act = Activation::Situ {
        beta: 4.0,
        linear_beta: Some(25.0),
    };
    let mut seed = 0x2545_f491u32;
    let mut next = move || {
        seed ^= seed << 13;
        seed ^= seed >> 17;
        seed ^= seed << 5;
        seed
    };
    let mut matrix = |rows: usize, cols: usize| {
        let w: Vec<f32> = (0..rows * cols)
            .map(|_| (next() % 2001) as f32 / 1000.0 - 1.0)
            .collect();
        kimi_gguf::quantize(GgmlType::MXFP4, &w).unwrap()
    };
    // One set of bytes, uploaded by each backend (row-major for f32, interleaved for int8).
    let layers: Vec<Vec<[Vec<u8>; 3]>> = (0..LAYERS)
        .map(|_| {
            (0..EXPERTS)
                .map(|_| [matrix(width, d), matrix(width, d), matrix(d, width)])
                .collect()
        })
        .collect();
    let banks = |be: &CpuBackend| -> Vec<Vec<MlpWeights<_>>> {
        let up = |b: &[u8], rows, cols| {
            be.upload(HostTensor {
                shape: &[rows, cols],
                dtype: DType::MXFP4,
                bytes: b,
            })
            .unwrap()
        };
        layers
            .iter()
            .map(|experts| {
                experts
                    .iter()
                    .map(|[g, u, dn]| MlpWeights {
                        gate: up(g, width, d),
                        up: up(u, width, d),
                        down: up(dn, d, width),
                    })
                    .collect()
            })
            .collect()
    };
    let (int8_banks, f32_banks) = (banks(fast), banks(exact));
    let mut route = |n: usize| -> Vec<f32> {
        let mut ids = Vec::with_capacity(n * TOP_K);
        for _ in 0..n {
            let mut chosen: Vec<f32> = Vec::with_capacity(TOP_K);
            while chosen.len() < TOP_K {
                let e = (next() as usize % EXPERTS) as f32;
                if !chosen.contains(&e) {
                    chosen.push(e);
                }
            }
            ids.extend(chosen);
        }
        ids
    };
    let pass = |be: &CpuBackend, banks: &[Vec<MlpWeights<_>>], ids: &[f32], n: usize| -> f64 {
        let x: Vec<f32> = (0..n * d).map(|i| (i % 37) as f32 * 0.01 - 0.18).collect();
        let routes = MoeRoutes {
            experts: be.upload_f32(&[n, TOP_K], ids).unwrap(),
            weights: be
                .upload_f32(&[n, TOP_K], &vec![1.0 / TOP_K as f32; n * TOP_K])
                .unwrap(),
            top_k: TOP_K,
        };
        let xt = be.upload_f32(&[n, d], &x).unwrap();
        let t = Instant::now();
        for bank in banks {
            be.moe_experts(&xt, &routes, &ExpertView::new(bank), act)
                .unwrap();
        }
        t.elapsed().as_secs_f64()
    };
    let bytes_per_token = (LAYERS * TOP_K * 3 * width * d / 32 * 17) as f64;
    let (mut ti, mut tf) = (Vec::new(), Vec::new());
    for _ in 0..10 * reps.max(1) {
        let ids = route(1);
        ti.push(pass(fast, &int8_banks, &ids, 1));
        tf.push(pass(exact, &f32_banks, &ids, 1));
    }
    for (label, t) in [("int8", &mut ti), ("f32", &mut tf)] {
        t.sort_by(f64::total_cmp);
        let (median, best) = (t[t.len() / 2], t[0]);
        println!(
            "MoE decode {label:<4}: median {:.2} ms/token (best {:.2}), experts {:.1} GB/s",
            median * 1e3,
            best * 1e3,
            bytes_per_token / median / 1e9
        );
    }
    let n = 256;
    let ids = route(n);
    for (label, be, banks) in [("int8", fast, &int8_banks), ("f32", exact, &f32_banks)] {
        let best = (0..reps.max(1))
            .map(|_| pass(be, banks, &ids, n))
            .fold(f64::MAX, f64::min);
        println!(
            "MoE prefill {label:<4}: {n} tokens in {:.1} ms ({:.0} tokens/s)",
            best * 1e3,
            n as f64 / best
        );
    }
}
