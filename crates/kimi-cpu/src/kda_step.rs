//! A KDA layer's decode step (`Backend::kda_decode`) in one parallel section: each head's
//! short convolutions, forget gate, β, q/k normalisation, recurrence and gated output norm
//! run together on one thread, on values that stay in L1.
//!
//! Composed from the separate ops, a decode step of a KDA layer was seven calls, each
//! with its own allocations and full passes over `[H·D]` rows (and three passes over the
//! state): ~220 µs per layer of a 0.5B Kimi Linear with 8 heads, more than its
//! projections. Every value is computed by the same per-value functions as those ops
//! (`crate::kda`), in the same order, so the result equals the composition bit for bit
//! (tested).

use crate::kda::{gate_value, gated_norm_row, l2_normalize, recurrent_step, sigmoid, silu};
use crate::tensor::{shape_err, CpuTensor};
use kimi_ops::{check_segments, KdaStepInputs, KdaStepWeights, Result, Segment};

/// See `Backend::kda_decode`; every segment must be one token (the caller falls back to
/// the composed ops otherwise).
pub fn decode(
    x: &KdaStepInputs<'_, CpuTensor>,
    w: &KdaStepWeights<'_, CpuTensor>,
    num_heads: usize,
    segments: &[Segment],
    caches: &mut [(&mut [CpuTensor; 3], &mut CpuTensor)],
) -> Result<CpuTensor> {
    const OP: &str = "kda_decode";
    let (n, width) = x.qkv[0].rows_cols(OP)?;
    for (name, t) in [("k", x.qkv[1]), ("v", x.qkv[2]), ("f", x.f), ("z", x.z)] {
        if t.rows_cols(OP)? != (n, width) {
            return Err(shape_err(
                OP,
                format!("{name} {:?} vs q {:?}", t.shape, x.qkv[0].shape),
            ));
        }
    }
    if num_heads == 0 || width % num_heads != 0 || x.beta_logits.rows_cols(OP)? != (n, num_heads) {
        return Err(shape_err(
            OP,
            format!(
                "q {:?}, beta {:?}, {num_heads} heads",
                x.qkv[0].shape, x.beta_logits.shape
            ),
        ));
    }
    let d = width / num_heads;
    check_segments(OP, segments, caches.len(), n)?;
    let conv_w = [
        w.conv[0].f32_values(),
        w.conv[1].f32_values(),
        w.conv[2].f32_values(),
    ];
    let taps = conv_w[0].len() / width.max(1);
    let (a_log, dt_bias, o_norm) = (
        w.a_log.f32_values(),
        w.dt_bias.f32_values(),
        w.o_norm.f32_values(),
    );
    if taps == 0
        || conv_w.iter().any(|c| c.len() != taps * width)
        || a_log.len() != num_heads
        || dt_bias.len() != width
        || o_norm.len() != d
    {
        return Err(shape_err(
            OP,
            format!(
                "conv {:?}, A_log {:?}, dt_bias {:?}, o_norm {:?} for {num_heads} heads of {d}",
                w.conv[0].shape, w.a_log.shape, w.dt_bias.shape, w.o_norm.shape
            ),
        ));
    }
    let rows = [
        x.qkv[0].as_f32(OP)?,
        x.qkv[1].as_f32(OP)?,
        x.qkv[2].as_f32(OP)?,
    ];
    let (fs, bl, zs) = (x.f.as_f32(OP)?, x.beta_logits.as_f32(OP)?, x.z.as_f32(OP)?);
    let q_scale = (d as f32).powf(-0.5);
    let mut out = vec![0f32; n * width];
    for (seg, (conv, state)) in segments.iter().zip(caches.iter_mut()) {
        if seg.len != 1 {
            return Err(shape_err(OP, format!("a segment of {} tokens", seg.len)));
        }
        let t = seg.start;
        let windows = [
            conv[0].as_f32(OP)?,
            conv[1].as_f32(OP)?,
            conv[2].as_f32(OP)?,
        ];
        if windows.iter().any(|c| c.len() != (taps - 1) * width) {
            return Err(shape_err(
                OP,
                format!(
                    "convolution state {:?}, expected {}x{width}",
                    conv[0].shape,
                    taps - 1
                ),
            ));
        }
        let st = state.as_f32_mut(OP)?;
        if st.len() != num_heads * d * d {
            return Err(shape_err(
                OP,
                format!(
                    "state has {} values, expected {num_heads}x{d}x{d}",
                    st.len()
                ),
            ));
        }
        let heads = crate::team().map_chunks_mut(st, d * d, |h, s| {
            let cols = h * d..(h + 1) * d;
            // q, k, v: the causal window (cached inputs, then this token's) · weights, SiLU,
            // as `short_conv_silu` sums it.
            let mut qkv = [vec![0f32; d], vec![0f32; d], vec![0f32; d]];
            for (i, dst) in qkv.iter_mut().enumerate() {
                for (y, ch) in dst.iter_mut().zip(cols.clone()) {
                    let mut acc = 0f32;
                    for j in 0..taps {
                        let input = if j + 1 < taps {
                            windows[i][j * width + ch]
                        } else {
                            rows[i][t * width + ch]
                        };
                        acc += conv_w[i][ch * taps + j] * input;
                    }
                    *y = silu(acc);
                }
            }
            let [mut q, mut k, v] = qkv;
            l2_normalize(&mut q, q_scale);
            l2_normalize(&mut k, 1.0);
            let g: Vec<f32> = cols
                .clone()
                .map(|i| gate_value(fs[t * width + i], dt_bias[i], a_log[h], w.gate))
                .collect();
            let beta = sigmoid(bl[t * num_heads + h]);
            let (mut u, mut o) = (vec![0f32; d], vec![0f32; d]);
            recurrent_step([&q, &k, &v, &g], beta, s, &mut u, &mut o);
            let mut y = vec![0f32; d];
            gated_norm_row(
                &o,
                &zs[t * width + cols.start..][..d],
                &o_norm,
                w.eps,
                &mut y,
            );
            y
        });
        for (h, y) in heads.iter().enumerate() {
            out[t * width + h * d..][..d].copy_from_slice(y);
        }
        // The window slides by one: its oldest row drops out, this token's input comes in.
        for (i, c) in conv.iter_mut().enumerate() {
            let win = c.as_f32_mut(OP)?;
            if taps > 1 {
                win.copy_within(width.., 0);
                win[(taps - 2) * width..].copy_from_slice(&rows[i][t * width..(t + 1) * width]);
            }
        }
    }
    CpuTensor::f32(&x.qkv[0].shape, out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::CpuBackend;
    use kimi_core::config::KdaGate;
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    fn rand_tensor(rng: &mut ChaCha8Rng, shape: &[usize], scale: f32) -> CpuTensor {
        let n: usize = shape.iter().product();
        let v = (0..n)
            .map(|_| rng.random_range(-1.0..1.0) * scale)
            .collect();
        CpuTensor::f32(shape, v).unwrap()
    }

    type Caches = Vec<([CpuTensor; 3], CpuTensor)>;

    /// Three decode steps of two sequences through `step`; every output and final state.
    fn steps(
        gate: KdaGate,
        step: impl Fn(
            &KdaStepInputs<'_, CpuTensor>,
            &KdaStepWeights<'_, CpuTensor>,
            &[Segment],
            &mut [(&mut [CpuTensor; 3], &mut CpuTensor)],
        ) -> Result<CpuTensor>,
    ) -> (Vec<Vec<f32>>, Caches) {
        let (h, d, taps, n) = (3, 16, 4, 2);
        let width = h * d;
        let mut rng = ChaCha8Rng::seed_from_u64(7);
        let conv = [0, 1, 2].map(|_| rand_tensor(&mut rng, &[width, 1, taps], 0.5));
        let a_log = rand_tensor(&mut rng, &[1, 1, h, 1], 1.0);
        let dt_bias = rand_tensor(&mut rng, &[width], 1.0);
        let o_norm = rand_tensor(&mut rng, &[d], 1.0);
        let w = KdaStepWeights {
            conv: [&conv[0], &conv[1], &conv[2]],
            a_log: &a_log,
            dt_bias: &dt_bias,
            o_norm: &o_norm,
            gate,
            eps: 1e-5,
        };
        let mut caches: Caches = (0..n)
            .map(|_| {
                (
                    [0, 1, 2].map(|_| rand_tensor(&mut rng, &[taps - 1, width], 1.0)),
                    rand_tensor(&mut rng, &[h, d, d], 0.3),
                )
            })
            .collect();
        let segments = [Segment { start: 0, len: 1 }, Segment { start: 1, len: 1 }];
        let mut outs = Vec::new();
        for _ in 0..3 {
            let qkv = [0, 1, 2].map(|_| rand_tensor(&mut rng, &[n, width], 2.0));
            let f = rand_tensor(&mut rng, &[n, width], 3.0);
            let beta = rand_tensor(&mut rng, &[n, h], 3.0);
            let z = rand_tensor(&mut rng, &[n, width], 2.0);
            let x = KdaStepInputs {
                qkv: [&qkv[0], &qkv[1], &qkv[2]],
                f: &f,
                beta_logits: &beta,
                z: &z,
            };
            let mut refs: Vec<_> = caches.iter_mut().map(|(c, s)| (c, s)).collect();
            outs.push(step(&x, &w, &segments, &mut refs).unwrap().to_f32_vec());
        }
        (outs, caches)
    }

    #[test]
    fn fused_step_equals_the_composed_ops() {
        let be = CpuBackend::new();
        for gate in [KdaGate::Softplus, KdaGate::LowerBound(-5.0)] {
            let fused = steps(gate, |x, w, s, c| decode(x, w, 3, s, c));
            let composed = steps(gate, |x, w, s, c| {
                kimi_ops::kda_decode_composed(&be, x, w, 3, s, c)
            });
            assert_eq!(fused.0, composed.0, "outputs, {gate:?}");
            for ((fc, fs), (cc, cs)) in fused.1.iter().zip(&composed.1) {
                assert_eq!(fs.to_f32_vec(), cs.to_f32_vec(), "state, {gate:?}");
                for (a, b) in fc.iter().zip(cc) {
                    assert_eq!(a.to_f32_vec(), b.to_f32_vec(), "conv window, {gate:?}");
                }
            }
            assert!(fused.0.iter().flatten().all(|v| v.is_finite()));
        }
    }

    #[test]
    fn mis_shaped_inputs_are_refused() {
        let mut rng = ChaCha8Rng::seed_from_u64(1);
        let t = |rng: &mut ChaCha8Rng, s: &[usize]| rand_tensor(rng, s, 1.0);
        let (q, k, v, f, z) = (
            t(&mut rng, &[1, 32]),
            t(&mut rng, &[1, 32]),
            t(&mut rng, &[1, 32]),
            t(&mut rng, &[1, 32]),
            t(&mut rng, &[1, 32]),
        );
        let beta = t(&mut rng, &[1, 2]);
        let conv = t(&mut rng, &[32, 1, 4]);
        let (a_log, dt_bias, o_norm) = (t(&mut rng, &[2]), t(&mut rng, &[32]), t(&mut rng, &[15]));
        let x = KdaStepInputs {
            qkv: [&q, &k, &v],
            f: &f,
            beta_logits: &beta,
            z: &z,
        };
        let w = KdaStepWeights {
            conv: [&conv, &conv, &conv],
            a_log: &a_log,
            dt_bias: &dt_bias,
            o_norm: &o_norm,
            gate: KdaGate::Softplus,
            eps: 1e-5,
        };
        let mut conv_state = [0, 1, 2].map(|_| t(&mut rng, &[3, 32]));
        let mut state = t(&mut rng, &[2, 16, 16]);
        let seg = [Segment { start: 0, len: 1 }];
        let err = decode(&x, &w, 2, &seg, &mut [(&mut conv_state, &mut state)]).unwrap_err();
        assert!(err.to_string().contains("o_norm"), "{err}");
    }
}
