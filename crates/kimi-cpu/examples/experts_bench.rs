//! Times a MoE step's routed experts on the CPU (`Backend::ffn_many`, as a device's host
//! tier computes its cold experts): bf16 SwiGLU experts at Kimi-Linear-48B's shapes
//! (hidden 2304, intermediate 1024), more of them than the last-level cache holds, each on
//! `n` tokens: `cargo run --release -p kimi-cpu --example experts_bench [threads] [experts]
//! [bf16|q4z]` (q4z: 4-bit blocks with an integer zero point, as AWQ and GPTQ experts load).
//! Prints the median step time, expert bytes per second and multiply-adds per second (f32
//! products, `QuantMatmul::F32`, as a host tier's store makes them); then one expert for one
//! token at a time after the threads were idle for a while (a tiered decode step's lone
//! cold expert), with and without `Backend::expect_work` before the idle time.

use kimi_core::DType;
use kimi_cpu::{CpuBackend, QuantMatmul};
use kimi_ops::{Activation, Backend, HostTensor, MlpWeights};
use std::time::{Duration, Instant};

fn main() {
    let mut args = std::env::args().skip(1);
    let threads: usize = args.next().and_then(|s| s.parse().ok()).unwrap_or(2);
    let experts: usize = args.next().and_then(|s| s.parse().ok()).unwrap_or(24);
    let dtype = match args.next().as_deref() {
        None | Some("bf16") => DType::BF16,
        Some("q4z") => DType::Q4Z,
        Some(other) => {
            eprintln!("experts_bench: weight type `{other}`: bf16 or q4z");
            std::process::exit(2);
        }
    };
    kimi_cpu::set_num_threads(threads).unwrap();
    run(
        &CpuBackend::with_quant_matmul(QuantMatmul::F32),
        experts,
        dtype,
    );
}

/// `o * k` values as `dtype`'s stored bytes: bf16 values in ±0.05, or 4-bit codes 1..=15
/// about a zero point of 8 with a scale of 0.05 / 7 (the same range).
fn weight_bytes(dtype: DType, o: usize, k: usize, seed: usize) -> Vec<u8> {
    let hash = |i: usize| ((i + seed) as u32).wrapping_mul(2654435761);
    if dtype == DType::Q4Z {
        let mut out = vec![0u8; DType::Q4Z.storage_bytes(o * k).unwrap()];
        for (b, block) in out.chunks_exact_mut(DType::Q4Z.block_bytes()).enumerate() {
            let codes: [u8; 32] = std::array::from_fn(|j| 1 + (hash(32 * b + j) % 15) as u8);
            kimi_core::qblocks::write_q4z(&codes, 0.05 / 7.0, 8.0, block);
        }
        return out;
    }
    (0..o * k)
        .flat_map(|i| {
            let v = (hash(i) % 1000) as f32 / 1e4 - 0.05;
            half::bf16::from_f32(v).to_le_bytes()
        })
        .collect()
}

fn run(be: &CpuBackend, experts: usize, dtype: DType) {
    let (hidden, inter) = (2304usize, 1024usize);
    let upload = |o: usize, k: usize, seed: usize| {
        be.upload(HostTensor {
            shape: &[o, k],
            dtype,
            bytes: &weight_bytes(dtype, o, k, seed),
        })
        .unwrap()
    };
    let weights: Vec<MlpWeights<_>> = (0..experts)
        .map(|e| MlpWeights {
            gate: upload(inter, hidden, 3 * e),
            up: upload(inter, hidden, 3 * e + 1),
            down: upload(hidden, inter, 3 * e + 2),
        })
        .collect();
    let expert_bytes = 3 * dtype.storage_bytes(hidden * inter).unwrap();
    println!("{dtype} experts, {expert_bytes} bytes each");
    for n in [1usize, 2, 4, 8, 16, 32] {
        let x: Vec<f32> = (0..n * hidden)
            .map(|i| (i % 37) as f32 * 0.01 - 0.18)
            .collect();
        let xs: Vec<_> = (0..experts)
            .map(|_| be.upload_f32(&[n, hidden], &x).unwrap())
            .collect();
        let items: Vec<_> = xs.iter().zip(&weights).collect();
        let mut ts = Vec::new();
        for _ in 0..7 {
            let t = Instant::now();
            be.ffn_many(&items, Activation::Silu).unwrap();
            ts.push(t.elapsed().as_secs_f64());
        }
        ts.sort_by(f64::total_cmp);
        let med = ts[ts.len() / 2];
        println!(
            "{experts} experts x {n:>2} tokens: {:8.2} ms  {:6.1} GB/s of experts  {:6.1} GMAC/s",
            med * 1e3,
            (experts * expert_bytes) as f64 / med / 1e9,
            (experts * n * 3 * hidden * inter) as f64 / med / 1e9,
        );
    }
    lone(be, &weights, hidden, expert_bytes);
}

/// One expert on one token after `idle` without work, each call on the next expert (out
/// of the caches), median of the calls.
fn lone(be: &CpuBackend, weights: &[MlpWeights<kimi_cpu::CpuTensor>], hidden: usize, bytes: usize) {
    let x: Vec<f32> = (0..hidden).map(|i| (i % 37) as f32 * 0.01 - 0.18).collect();
    let x = be.upload_f32(&[1, hidden], &x).unwrap();
    for idle_us in [0u64, 300, 1000, 3000] {
        for woken in [false, true] {
            let mut ts = Vec::new();
            for w in weights.iter().cycle().take(weights.len().max(24)) {
                let idle = Duration::from_micros(idle_us);
                if woken {
                    be.expect_work(idle + Duration::from_millis(1));
                }
                std::thread::sleep(idle);
                let t = Instant::now();
                be.ffn_many(&[(&x, w)], Activation::Silu).unwrap();
                ts.push(t.elapsed().as_secs_f64());
            }
            ts.sort_by(f64::total_cmp);
            let med = ts[ts.len() / 2];
            println!(
                "1 expert x 1 token after {idle_us:>4} us idle{}: {:6.3} ms  {:6.1} GB/s",
                if woken {
                    ", woken ahead"
                } else {
                    "             "
                },
                med * 1e3,
                bytes as f64 / med / 1e9,
            );
        }
    }
}
