//! `quant-bench`: the packed-weight GEMV (`quant_gemv_*`: Q4Z, Q8Z, F8S) at the decode
//! shapes of Kimi-Linear-48B (its attention projections and an expert's matrices), against
//! the bf16 GEMV on the same shapes. Each shape rotates over enough uploaded copies of its
//! matrix (>= 320 MB) that every call streams from HBM, not L2; back-to-back calls in a
//! replayed pass, as in a decode step. Prints µs per call, GB/s of weight bytes read, the
//! fraction of the measured HBM read bandwidth, and the speed-up over bf16; at one row, Q4Z
//! also on the streamed 4-bit kernel (`quant_gemv_int4_stream_1`).

use std::io::Write;

use kimi_core::DType;
use kimi_cuda::{CudaBackend, CudaTensor};
use kimi_ops::{Backend, HostTensor};

use super::op_cases::{self, rel_err, Rng};
use super::quant_cases::quant_blocks;
use super::{time_calls, Res};

/// Seconds per call of `x · wᵀ` rotating over `ws`, in a replayed pass of `calls` products.
fn per_call(be: &CudaBackend, key: u64, x: &CudaTensor, ws: &[CudaTensor]) -> Res<f64> {
    let calls = ws.len().max(32);
    let pass = || -> kimi_ops::Result<()> {
        be.replayable(Some(key), || -> kimi_ops::Result<()> {
            for i in 0..calls {
                drop(be.matmul(x, &ws[i % ws.len()])?);
            }
            Ok(())
        })?
    };
    Ok(time_calls(be, 2, 10, pass)? / calls as f64)
}

/// Copies of one matrix (`bytes` of host data as `dtype`) summing to at least 320 MB.
fn copies(be: &CudaBackend, shape: [usize; 2], dtype: DType, bytes: &[u8]) -> Res<Vec<CudaTensor>> {
    let n = (320usize << 20).div_ceil(bytes.len()).clamp(1, 512);
    (0..n)
        .map(|_| {
            Ok(be.upload(HostTensor {
                shape: &shape,
                dtype,
                bytes,
            })?)
        })
        .collect()
}

pub fn quant_bench() -> Res<()> {
    println!("== quant GEMV: packed weights (Q4Z, Q8Z, F8S) vs bf16, f32 activations");
    let be = CudaBackend::new(0)?;
    println!("device: {}", be.name());
    let hbm = be
        .measure_read_bandwidth()
        .ok_or("no bandwidth measurement")?;
    println!("measured HBM read bandwidth: {:.0} GB/s", hbm / 1e9);
    let shapes: [(&str, usize, usize); 7] = [
        ("kda in (q,k,v,f,g,b)", 12576, 2304),
        ("o_proj", 2304, 4096),
        ("mla q_proj", 6144, 2304),
        ("expert gate / up", 1024, 2304),
        ("expert down", 2304, 1024),
        ("dense gate / up", 9216, 2304),
        ("dense down", 2304, 9216),
    ];
    let mut r = Rng(7);
    let mut key = 1u64 << 41;
    for (name, o, k) in shapes {
        let host = r.vec(o * k, 0.05);
        let bf16 = copies(&be, [o, k], DType::BF16, &op_cases::bf16_bytes(&host))?;
        drop(host);
        let packed: Vec<(DType, Vec<CudaTensor>)> = [DType::Q4Z, DType::Q8Z, DType::F8S]
            .into_iter()
            .map(|dt| {
                Ok((
                    dt,
                    copies(&be, [o, k], dt, &quant_blocks(&mut r, dt, o, k))?,
                ))
            })
            .collect::<Res<_>>()?;
        for n in [1usize, 4, 8] {
            let x = be.upload_f32(&[n, k], &r.vec(n * k, 1.0))?;
            key += 1;
            let base = per_call(&be, key, &x, &bf16)?;
            let bf16_bytes = (o * k * 2) as f64;
            let mut line = format!(
                "{name:<20} o={o:<6} k={k:<5} n={n}: bf16 {:6.2} us {:5.0} GB/s ({:3.0}%)",
                base * 1e6,
                bf16_bytes / base / 1e9,
                100.0 * bf16_bytes / base / hbm
            );
            let xv = be.to_f32(&x)?;
            for (dt, ws) in &packed {
                // Against the widened matrix (`quant-ops` checks the widening), in f64.
                let wv = be.to_f32(&ws[0])?;
                let want: Vec<f32> = (0..n * o)
                    .map(|i| {
                        let (t, row) = (i / o, i % o);
                        let (xr, wr) = (&xv[t * k..][..k], &wv[row * k..][..k]);
                        xr.iter()
                            .zip(wr)
                            .map(|(a, b)| f64::from(*a) * f64::from(*b))
                            .sum::<f64>() as f32
                    })
                    .collect();
                // One row of Q4Z also on the streamed kernel (`quant_gemv_int4_stream_1`).
                let streamed = n == 1 && *dt == DType::Q4Z;
                for stream in [false, true].into_iter().filter(|&s| !s || streamed) {
                    be.update_kernel_config(|c| c.int4_stream_gemv = stream)?;
                    let err = rel_err(&be.to_f32(&be.matmul(&x, &ws[0])?)?, &want);
                    if err > 1e-4 {
                        return Err(format!("{dt} {name} n={n}: rel err {err:.2e}").into());
                    }
                    key += 1;
                    let secs = per_call(&be, key, &x, ws)?;
                    let bytes = dt.storage_bytes(o * k).unwrap_or(0) as f64;
                    line += &format!(
                        " | {dt}{} {:6.2} us {:5.0} GB/s ({:3.0}%) x{:.2}",
                        if stream { " streamed" } else { "" },
                        secs * 1e6,
                        bytes / secs / 1e9,
                        100.0 * bytes / secs / hbm,
                        base / secs
                    );
                }
                be.update_kernel_config(|c| c.int4_stream_gemv = false)?;
            }
            println!("{line}");
            let _ = std::io::stdout().flush();
        }
    }
    Ok(())
}
