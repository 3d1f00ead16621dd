//! Times the CPU backend's heaviest ops at Kimi-Linear-like shapes: `cargo run --release -p kimi-cpu --example op_bench`.

use std::time::Instant;

use kimi_cpu::{CpuBackend, CpuTensor};
use kimi_ops::{Backend, KdaMode, Segment};

fn time<F: FnMut()>(label: &str, flops: f64, mut f: F) {
    f();
    let reps = 3;
    let t = Instant::now();
    for _ in 0..reps {
        f();
    }
    let secs = t.elapsed().as_secs_f64() / reps as f64;
    println!(
        "{label:<40} {:>9.3} ms {:>8.1} GFLOP/s",
        secs * 1e3,
        flops / secs / 1e9
    );
}

fn filled(shape: &[usize], seed: u32) -> CpuTensor {
    let n: usize = shape.iter().product();
    let data = (0..n)
        .map(|i| (((i as u32).wrapping_mul(2654435761) ^ seed) % 1000) as f32 / 1000.0 - 0.5)
        .collect();
    CpuTensor::f32(shape, data).unwrap()
}

fn main() {
    let be = CpuBackend::new();
    for (n, k, o) in [
        (1, 1024, 4096),
        (256, 1024, 4096),
        (256, 4096, 1024),
        (1, 2304, 4096),
    ] {
        let x = filled(&[n, k], 1);
        let w = filled(&[o, k], 2);
        time(
            &format!("matmul f32 {n}x{k}x{o}"),
            2.0 * (n * k * o) as f64,
            || {
                be.matmul(&x, &w).unwrap();
            },
        );
    }
    let (h, d, t) = (8, 128, 256);
    let q = filled(&[t, h * d], 3);
    let k = filled(&[t, h * d], 4);
    let v = filled(&[t, h * d], 5);
    let g = CpuTensor::f32(&[t, h * d], vec![-3.0; t * h * d]).unwrap();
    let beta = CpuTensor::f32(&[t, h], vec![0.5; t * h]).unwrap();
    for mode in [KdaMode::Chunked, KdaMode::Recurrent] {
        time(&format!("kda {mode:?} T={t} H={h} D={d}"), 0.0, || {
            let mut s = be.zeros(&[h, d, d]).unwrap();
            be.kda(
                &q,
                &k,
                &v,
                &g,
                &beta,
                h,
                &[Segment { start: 0, len: t }],
                &mut [&mut s],
                mode,
            )
            .unwrap();
        });
    }
}
