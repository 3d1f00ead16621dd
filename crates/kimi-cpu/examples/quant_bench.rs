//! Times quantized matmuls at the demo model's shapes on both paths (int8 activations and
//! f32): `cargo run --release -p kimi-cpu --example quant_bench [reps] [threads]`. Best of
//! `reps`. On a shared machine, `perf stat -e cycles:u` over one thread counts work without
//! the noise of other processes.

use std::time::Instant;

use kimi_core::DType;
use kimi_cpu::{CpuBackend, QuantMatmul};
use kimi_gguf::GgmlType;
use kimi_ops::{Backend, HostTensor};

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
                let wt = be
                    .upload(HostTensor {
                        shape: &[o, k],
                        dtype,
                        bytes: &bytes,
                    })
                    .unwrap();
                let xt = be.upload_f32(&[n, k], &x).unwrap();
                be.matmul(&xt, &wt).unwrap();
                let mut best = f64::MAX;
                for _ in 0..reps {
                    let t = Instant::now();
                    be.matmul(&xt, &wt).unwrap();
                    best = best.min(t.elapsed().as_secs_f64());
                }
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
