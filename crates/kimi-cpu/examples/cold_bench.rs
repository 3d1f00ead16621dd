//! Times one-token quantized matmuls at a 0.5B Kimi Linear's shapes with the weights hot
//! (the same copy every time, as `quant_bench` does) and cold (cycling through copies
//! that together exceed the last-level cache, as decode streams them from DRAM):
//! `cargo run --release -p kimi-cpu --example cold_bench [threads]`. Medians.

use kimi_core::DType;
use kimi_cpu::CpuBackend;
use kimi_gguf::GgmlType;
use kimi_ops::{Backend, HostTensor};
use std::time::Instant;

fn main() {
    let threads: usize = std::env::args()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(2);
    kimi_cpu::set_num_threads(threads).unwrap();
    let be = CpuBackend::new();
    for (dtype, ty, n, k, o) in [
        (DType::Q4_K, GgmlType::Q4_K, 1usize, 1024usize, 1024usize),
        (DType::Q4_K, GgmlType::Q4_K, 1, 1024, 512),
        (DType::Q4_K, GgmlType::Q4_K, 1, 1024, 3336),
        (DType::Q4_K, GgmlType::Q4_K, 1, 512, 1024),
        (DType::Q6_K, GgmlType::Q6_K, 1, 512, 1024),
        (DType::Q6_K, GgmlType::Q6_K, 1, 1024, 32768),
        (DType::Q8_0, GgmlType::Q8_0, 1, 1024, 1024),
        (DType::F16, GgmlType::F16, 1, 1024, 1024),
        (DType::F16, GgmlType::F16, 1, 1024, 3336),
    ] {
        let w: Vec<f32> = (0..o * k)
            .map(|i| ((i as u32).wrapping_mul(2654435761) % 1000) as f32 / 1000.0 - 0.5)
            .collect();
        let bytes = kimi_gguf::quantize(ty, &w).unwrap();
        let copies = (128 << 20) / bytes.len() + 1;
        let ws: Vec<_> = (0..copies)
            .map(|_| {
                be.upload(HostTensor {
                    shape: &[o, k],
                    dtype,
                    bytes: &bytes,
                })
                .unwrap()
            })
            .collect();
        let x: Vec<f32> = (0..n * k).map(|i| (i % 37) as f32 * 0.01 - 0.18).collect();
        let xt = be.upload_f32(&[n, k], &x).unwrap();
        for (label, cold) in [("hot", false), ("cold", true)] {
            let mut ts = Vec::new();
            for i in 0..(copies * 3).max(60) {
                let wt = if cold { &ws[i % copies] } else { &ws[0] };
                let t = Instant::now();
                be.matmul(&xt, wt).unwrap();
                ts.push(t.elapsed().as_secs_f64());
            }
            ts.sort_by(f64::total_cmp);
            let med = ts[ts.len() / 2];
            println!(
                "{dtype:?} n={n} k={k} o={o} {label:>4}: {:8.1} us  {:6.1} GMAC/s {:5.1} GB/s",
                med * 1e6,
                (n * k * o) as f64 / med / 1e9,
                bytes.len() as f64 / med / 1e9
            );
        }
    }
}
