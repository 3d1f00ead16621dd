//! Every op of `CudaBackend` against `CpuBackend` (the reference), relative error per
//! output. Needs the `cuda` feature and a GPU; skips (passes with a note) without a device.
#![cfg(feature = "cuda")]

#[path = "common/k3_cases.rs"]
mod k3_cases;
#[path = "common/op_cases.rs"]
mod op_cases;
#[path = "common/quant_cases.rs"]
mod quant_cases;

use kimi_cpu::{CpuBackend, QuantMatmul};
use kimi_cuda::CudaBackend;
use op_cases::{rel_err, CpuRun, CudaRun};

/// Split-bf16 GEMMs and f32 kernels measured ≤ 5e-6 on an H200 (device-results/).
const TOLERANCE: f64 = 1e-4;

#[test]
fn every_op_matches_cpu() {
    let cuda = match CudaBackend::new(0) {
        Ok(b) => b,
        Err(e) => {
            eprintln!("skipped: no CUDA device ({e})");
            return;
        }
    };
    // The reference multiplies in f32: the CPU's default integer path for packed weights
    // (MXFP4, ggml blocks) rounds the activations to int8.
    let cpu = CpuRun(CpuBackend::with_quant_matmul(QuantMatmul::F32));
    let mut failures = vec![];
    for (name, case) in op_cases::cases()
        .into_iter()
        .chain(k3_cases::cases())
        .chain(quant_cases::cases())
    {
        let want = case(&cpu).unwrap_or_else(|e| panic!("{name}: CPU: {e}"));
        let got = match case(&CudaRun(&cuda)) {
            Ok(g) => g,
            Err(e) => {
                failures.push(format!("{name}: {e}"));
                continue;
            }
        };
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            let err = rel_err(g, w);
            eprintln!("{name:<50} output {i}: rel err {err:.2e}");
            if err > TOLERANCE.max(op_cases::tolerance(&name)) {
                failures.push(format!("{name} output {i}: {err:.3e}"));
            }
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}
