//! Kimi Delta Attention on the CPU: short convolution, forget gate, the gated delta rule
//! (token recurrence and chunked WY form) and the gated output norm.
//!
//! Equations and their order follow `shared/docs/kimi-linear-spec.md` §3 (fla
//! `naive_recurrent_kda` / `naive_chunk_kda`, transformers `torch_recurrent_kda` /
//! `torch_chunk_kda`). States are f32 `[H, K, V]`, key-major as in fla.

use crate::tensor::{shape_err, CpuTensor};
use kimi_core::config::KdaGate;
use kimi_ops::{check_segments, KdaMode, Result, Segment};

/// Tokens per chunk of the WY form (fla uses 64).
pub const CHUNK: usize = 64;

/// Causal depthwise convolution + SiLU; see `Backend::short_conv_silu`.
pub fn short_conv_silu(
    x: &CpuTensor,
    weight: &CpuTensor,
    segments: &[Segment],
    states: &mut [&mut CpuTensor],
) -> Result<CpuTensor> {
    let (n, c) = x.rows_cols("short_conv")?;
    let w = weight.f32_values();
    if !w.len().is_multiple_of(c.max(1)) || w.is_empty() {
        return Err(shape_err(
            "short_conv",
            format!("weight {:?} for {c} channels", weight.shape),
        ));
    }
    let width = w.len() / c;
    check_segments("short_conv", segments, states.len(), n)?;
    let xs = x.as_f32("short_conv")?;
    let mut out = vec![0f32; n * c];
    for (seg, state) in segments.iter().zip(states.iter_mut()) {
        let st = state.as_f32_mut("short_conv")?;
        if st.len() != (width - 1) * c {
            return Err(shape_err(
                "short_conv",
                format!("state has {} values, expected {}x{c}", st.len(), width - 1),
            ));
        }
        // Window of inputs: the W-1 cached ones, then this segment's rows.
        let input = |pos: isize, ch: usize| -> f32 {
            if pos < 0 {
                st[((width as isize - 1 + pos) as usize) * c + ch]
            } else {
                xs[(seg.start + pos as usize) * c + ch]
            }
        };
        for t in 0..seg.len {
            let row = &mut out[(seg.start + t) * c..(seg.start + t + 1) * c];
            for (ch, y) in row.iter_mut().enumerate() {
                let mut acc = 0f32;
                for j in 0..width {
                    acc += w[ch * width + j]
                        * input(t as isize - (width as isize - 1) + j as isize, ch);
                }
                *y = silu(acc);
            }
        }
        let mut next = vec![0f32; (width - 1) * c];
        for j in 0..width - 1 {
            let pos = seg.len as isize - (width as isize - 1) + j as isize;
            for ch in 0..c {
                next[j * c + ch] = input(pos, ch);
            }
        }
        *st = next;
    }
    CpuTensor::f32(&x.shape, out)
}

/// The log-space forget gate; see `Backend::kda_gate`.
pub fn gate(
    f: &CpuTensor,
    a_log: &CpuTensor,
    dt_bias: &CpuTensor,
    num_heads: usize,
    kind: KdaGate,
) -> Result<CpuTensor> {
    let (n, width) = f.rows_cols("kda_gate")?;
    let a = a_log.f32_values();
    let bias = dt_bias.f32_values();
    if a.len() != num_heads || bias.len() != width || num_heads == 0 || width % num_heads != 0 {
        return Err(shape_err(
            "kda_gate",
            format!(
                "f width {width}, A_log {:?}, dt_bias {:?}, {num_heads} heads",
                a_log.shape, dt_bias.shape
            ),
        ));
    }
    let d = width / num_heads;
    let fs = f.as_f32("kda_gate")?;
    let mut g = vec![0f32; n * width];
    for t in 0..n {
        for i in 0..width {
            g[t * width + i] = gate_value(fs[t * width + i], bias[i], a[i / d], kind);
        }
    }
    CpuTensor::f32(&f.shape, g)
}

/// One forget-gate value (log space) of pre-activation `f`, its `dt_bias` and its head's
/// `A_log`.
pub(crate) fn gate_value(f: f32, bias: f32, a_log: f32, kind: KdaGate) -> f32 {
    let x = f + bias;
    let scale = a_log.exp();
    match kind {
        KdaGate::Softplus => -scale * softplus(x),
        KdaGate::LowerBound(lb) => lb * sigmoid(scale * x),
    }
}

/// Inputs of one head of one segment, as contiguous `[len, D]` copies.
struct HeadInputs {
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    g: Vec<f32>,
    beta: Vec<f32>,
}

/// The gated delta rule; see `Backend::kda`.
#[allow(clippy::too_many_arguments)]
pub fn kda(
    q: &CpuTensor,
    k: &CpuTensor,
    v: &CpuTensor,
    g: &CpuTensor,
    beta: &CpuTensor,
    num_heads: usize,
    segments: &[Segment],
    states: &mut [&mut CpuTensor],
    mode: KdaMode,
) -> Result<CpuTensor> {
    let (n, width) = q.rows_cols("kda")?;
    for (name, t) in [("k", k), ("v", v), ("g", g)] {
        if t.rows_cols("kda")? != (n, width) {
            return Err(shape_err(
                "kda",
                format!("{name} {:?} vs q {:?}", t.shape, q.shape),
            ));
        }
    }
    if num_heads == 0 || width % num_heads != 0 || beta.rows_cols("kda")? != (n, num_heads) {
        return Err(shape_err(
            "kda",
            format!("q {:?}, beta {:?}, {num_heads} heads", q.shape, beta.shape),
        ));
    }
    check_segments("kda", segments, states.len(), n)?;
    let d = width / num_heads;
    let (qs, ks, vs, gs, bs) = (
        q.as_f32("kda")?,
        k.as_f32("kda")?,
        v.as_f32("kda")?,
        g.as_f32("kda")?,
        beta.as_f32("kda")?,
    );
    let mut out = vec![0f32; n * width];
    for (seg, state) in segments.iter().zip(states.iter_mut()) {
        let st = state.as_f32_mut("kda")?;
        if st.len() != num_heads * d * d {
            return Err(shape_err(
                "kda",
                format!(
                    "state has {} values, expected {num_heads}x{d}x{d}",
                    st.len()
                ),
            ));
        }
        let chunked = match mode {
            KdaMode::Auto => seg.len > 1,
            KdaMode::Recurrent => false,
            KdaMode::Chunked => true,
        };
        let head_outputs: Vec<Vec<f32>> = crate::team().map_chunks_mut(st, d * d, |h, s| {
            let gather = |src: &[f32]| -> Vec<f32> {
                let mut buf = Vec::with_capacity(seg.len * d);
                for t in seg.start..seg.start + seg.len {
                    buf.extend_from_slice(&src[t * width + h * d..t * width + (h + 1) * d]);
                }
                buf
            };
            let mut inp = HeadInputs {
                q: gather(qs),
                k: gather(ks),
                v: gather(vs),
                g: gather(gs),
                beta: (seg.start..seg.start + seg.len)
                    .map(|t| bs[t * num_heads + h])
                    .collect(),
            };
            normalize_qk(&mut inp, d);
            if chunked {
                chunked_head(&inp, s, d)
            } else {
                recurrent_head(&inp, s, d)
            }
        });
        for (h, o) in head_outputs.iter().enumerate() {
            for t in 0..seg.len {
                out[(seg.start + t) * width + h * d..(seg.start + t) * width + (h + 1) * d]
                    .copy_from_slice(&o[t * d..(t + 1) * d]);
            }
        }
    }
    CpuTensor::f32(&q.shape, out)
}

/// L2-normalises q and k rows (`x·rsqrt(Σx²+1e-6)`) and scales q by `D^-1/2`.
fn normalize_qk(inp: &mut HeadInputs, d: usize) {
    let scale = (d as f32).powf(-0.5);
    for (rows, extra) in [(&mut inp.q, scale), (&mut inp.k, 1.0)] {
        rows.chunks_exact_mut(d)
            .for_each(|row| l2_normalize(row, extra));
    }
}

/// `row · extra / sqrt(Σ row² + 1e-6)`, in place.
pub(crate) fn l2_normalize(row: &mut [f32], extra: f32) {
    let ss: f32 = row.iter().map(|x| x * x).sum();
    let r = extra / (ss + 1e-6).sqrt();
    row.iter_mut().for_each(|x| *x *= r);
}

/// Token-by-token recurrence (§3.6): decay, delta with the decayed state, rank-1 write,
/// read-out with the updated state.
fn recurrent_head(inp: &HeadInputs, s: &mut [f32], d: usize) -> Vec<f32> {
    let len = inp.beta.len();
    let mut out = vec![0f32; len * d];
    let mut u = vec![0f32; d];
    for t in 0..len {
        let at = t * d..(t + 1) * d;
        let (q, k, v, g) = (
            &inp.q[at.clone()],
            &inp.k[at.clone()],
            &inp.v[at.clone()],
            &inp.g[at],
        );
        recurrent_step(
            [q, k, v, g],
            inp.beta[t],
            s,
            &mut u,
            &mut out[t * d..(t + 1) * d],
        );
    }
    out
}

/// One token of the recurrence on a head's state `s [D, D]`: `o += ` the read-out (`o`
/// starts at zero), `u` is scratch of `D`. Two passes over the state: each row is decayed
/// and then used for the delta in the same pass (the same operations, per value, as a
/// separate decay pass).
pub(crate) fn recurrent_step(
    [q, k, v, g]: [&[f32]; 4],
    beta: f32,
    s: &mut [f32],
    u: &mut [f32],
    o: &mut [f32],
) {
    let d = q.len();
    u.copy_from_slice(v);
    for (i, row) in s.chunks_exact_mut(d).enumerate() {
        let (a, ki) = (g[i].exp(), k[i]);
        for (uj, sij) in u.iter_mut().zip(row.iter_mut()) {
            *sij *= a;
            *uj -= *sij * ki;
        }
    }
    u.iter_mut().for_each(|x| *x *= beta);
    for (i, row) in s.chunks_exact_mut(d).enumerate() {
        let (ki, qi) = (k[i], q[i]);
        for ((sij, uj), oj) in row.iter_mut().zip(u.iter()).zip(o.iter_mut()) {
            *sij += ki * uj;
            *oj += *sij * qi;
        }
    }
}

/// Chunked WY form (§3.8).
///
/// Decay factors between two positions of a chunk, `exp(Γ_r − Γ_c)`, are formed as running
/// products of the per-token factors `exp(g_s)`, which are ≤ 1: nothing is ever divided by a
/// decay, so the unbounded softplus gate cannot overflow (the spec's "differences only" rule).
fn chunked_head(inp: &HeadInputs, s: &mut [f32], d: usize) -> Vec<f32> {
    let len = inp.beta.len();
    let mut out = vec![0f32; len * d];
    let mut decay = vec![0f32; CHUNK * d]; // exp(g_r)
    let mut from_start = vec![0f32; CHUNK * d]; // exp(Γ_r)
    let mut to_end = vec![0f32; CHUNK * d]; // exp(Γ_last − Γ_c)
    let mut lmat = vec![0f32; CHUNK * CHUNK];
    let mut amat = vec![0f32; CHUNK * CHUNK];
    let mut run = vec![0f32; d];
    for c0 in (0..len).step_by(CHUNK) {
        let l = CHUNK.min(len - c0);
        let at = |r: usize| (c0 + r) * d..(c0 + r + 1) * d;
        for r in 0..l {
            for i in 0..d {
                decay[r * d + i] = inp.g[(c0 + r) * d + i].exp();
                from_start[r * d + i] = decay[r * d + i]
                    * if r == 0 {
                        1.0
                    } else {
                        from_start[(r - 1) * d + i]
                    };
            }
        }
        for c in (0..l).rev() {
            for i in 0..d {
                to_end[c * d + i] = if c == l - 1 {
                    1.0
                } else {
                    to_end[(c + 1) * d + i] * decay[(c + 1) * d + i]
                };
            }
        }
        // L[r,c] (c < r, without β) and A[r,c] (c ≤ r), walking r upward from each c.
        for c in 0..l {
            let kc = &inp.k[at(c)];
            run.copy_from_slice(kc);
            for r in c..l {
                if r > c {
                    for i in 0..d {
                        run[i] *= decay[r * d + i];
                    }
                    lmat[r * CHUNK + c] = crate::simd::dot(&inp.k[at(r)], &run);
                }
                amat[r * CHUNK + c] = crate::simd::dot(&inp.q[at(r)], &run);
            }
        }
        // Forward substitution with (I + diag(β)L): rows become U = T·V and W = T·(exp(Γ)⊙K).
        let mut uu = vec![0f32; l * d];
        let mut ww = vec![0f32; l * d];
        for r in 0..l {
            let b = inp.beta[c0 + r];
            for i in 0..d {
                uu[r * d + i] = b * inp.v[(c0 + r) * d + i];
                ww[r * d + i] = b * from_start[r * d + i] * inp.k[(c0 + r) * d + i];
            }
            for c in 0..r {
                let lrc = b * lmat[r * CHUNK + c];
                for i in 0..d {
                    uu[r * d + i] -= lrc * uu[c * d + i];
                    ww[r * d + i] -= lrc * ww[c * d + i];
                }
            }
        }
        // V_new = U − W·S.
        let mut vnew = uu;
        for r in 0..l {
            for i in 0..d {
                let wri = ww[r * d + i];
                axpy(-wri, &s[i * d..(i + 1) * d], &mut vnew[r * d..(r + 1) * d]);
            }
        }
        // O = (Q⊙exp(Γ))·S + A·V_new.
        for r in 0..l {
            let o = &mut out[(c0 + r) * d..(c0 + r + 1) * d];
            for i in 0..d {
                let qe = inp.q[(c0 + r) * d + i] * from_start[r * d + i];
                axpy(qe, &s[i * d..(i + 1) * d], o);
            }
            for c in 0..=r {
                axpy(amat[r * CHUNK + c], &vnew[c * d..(c + 1) * d], o);
            }
        }
        // S ← diag(exp(Γ_last))·S + Σ_c (exp(Γ_last−Γ_c)⊙k_c) ⊗ V_new[c].
        for i in 0..d {
            let srow = &mut s[i * d..(i + 1) * d];
            let total = from_start[(l - 1) * d + i];
            srow.iter_mut().for_each(|x| *x *= total);
            for c in 0..l {
                let kc = inp.k[(c0 + c) * d + i] * to_end[c * d + i];
                axpy(kc, &vnew[c * d..(c + 1) * d], srow);
            }
        }
    }
    out
}

/// `y += a·x`.
fn axpy(a: f32, x: &[f32], y: &mut [f32]) {
    if a != 0.0 {
        for (yi, xi) in y.iter_mut().zip(x) {
            *yi += a * xi;
        }
    }
}

/// Per-head RMSNorm times weight, gated by `sigmoid(z)`; see `Backend::gated_rms_norm`.
pub fn gated_rms_norm(
    o: &CpuTensor,
    z: &CpuTensor,
    weight: &CpuTensor,
    eps: f32,
) -> Result<CpuTensor> {
    let (n, width) = o.rows_cols("gated_rms_norm")?;
    let w = weight.f32_values();
    let d = w.len();
    if d == 0 || width % d != 0 || z.rows_cols("gated_rms_norm")? != (n, width) {
        return Err(shape_err(
            "gated_rms_norm",
            format!(
                "o {:?}, z {:?}, weight {:?}",
                o.shape, z.shape, weight.shape
            ),
        ));
    }
    let (os, zs) = (o.as_f32("gated_rms_norm")?, z.as_f32("gated_rms_norm")?);
    let mut out = vec![0f32; n * width];
    for ((orow, zrow), dst) in os
        .chunks_exact(d)
        .zip(zs.chunks_exact(d))
        .zip(out.chunks_exact_mut(d))
    {
        gated_norm_row(orow, zrow, &w, eps, dst);
    }
    CpuTensor::f32(&o.shape, out)
}

/// `dst = o · rsqrt(mean(o²) + eps) · w · sigmoid(z)` for one head's row.
pub(crate) fn gated_norm_row(o: &[f32], z: &[f32], w: &[f32], eps: f32, dst: &mut [f32]) {
    let ms = o.iter().map(|x| x * x).sum::<f32>() / o.len() as f32;
    let r = 1.0 / (ms + eps).sqrt();
    for j in 0..o.len() {
        dst[j] = o[j] * r * w[j] * sigmoid(z[j]);
    }
}

pub(crate) fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

pub(crate) fn silu(x: f32) -> f32 {
    x * sigmoid(x)
}

/// `log(1+exp(x))`, identity above 20 (the threshold of fla and PyTorch).
fn softplus(x: f32) -> f32 {
    if x > 20.0 {
        x
    } else {
        x.exp().ln_1p()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    fn rand_tensor(rng: &mut ChaCha8Rng, shape: &[usize], scale: f32) -> CpuTensor {
        let n: usize = shape.iter().product();
        CpuTensor::f32(
            shape,
            (0..n)
                .map(|_| rng.random_range(-1.0..1.0) * scale)
                .collect(),
        )
        .unwrap()
    }

    fn run(
        mode: KdaMode,
        segs: &[Segment],
        lens_total: usize,
        h: usize,
        d: usize,
        seed: u64,
    ) -> (Vec<f32>, Vec<Vec<f32>>) {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let q = rand_tensor(&mut rng, &[lens_total, h * d], 1.0);
        let k = rand_tensor(&mut rng, &[lens_total, h * d], 1.0);
        let v = rand_tensor(&mut rng, &[lens_total, h * d], 1.0);
        // Strongly negative gates on some channels exercise the overflow-free form.
        let g = CpuTensor::f32(
            &[lens_total, h * d],
            (0..lens_total * h * d)
                .map(|i| {
                    if i % 7 == 0 {
                        -30.0
                    } else {
                        -rng.random_range(0.0..0.5f32)
                    }
                })
                .collect(),
        )
        .unwrap();
        let beta = CpuTensor::f32(
            &[lens_total, h],
            (0..lens_total * h)
                .map(|_| rng.random_range(0.0..1.0))
                .collect(),
        )
        .unwrap();
        let mut states: Vec<CpuTensor> = segs
            .iter()
            .map(|_| CpuTensor::f32(&[h, d, d], vec![0.0; h * d * d]).unwrap())
            .collect();
        let mut refs: Vec<&mut CpuTensor> = states.iter_mut().collect();
        let o = kda(&q, &k, &v, &g, &beta, h, segs, &mut refs, mode).unwrap();
        (
            o.to_f32_vec(),
            states.iter().map(|s| s.to_f32_vec()).collect(),
        )
    }

    fn rel(a: &[f32], b: &[f32]) -> f64 {
        let num: f64 = a.iter().zip(b).map(|(x, y)| ((x - y) as f64).powi(2)).sum();
        let den: f64 = b.iter().map(|y| (*y as f64).powi(2)).sum();
        (num / den.max(1e-30)).sqrt()
    }

    #[test]
    fn chunked_equals_recurrent_over_several_chunks_and_segments() {
        let segs = [
            Segment { start: 0, len: 150 },
            Segment { start: 150, len: 3 },
            Segment {
                start: 153,
                len: 64,
            },
        ];
        let (o1, s1) = run(KdaMode::Recurrent, &segs, 217, 2, 12, 1);
        let (o2, s2) = run(KdaMode::Chunked, &segs, 217, 2, 12, 1);
        assert!(rel(&o2, &o1) < 1e-5, "outputs differ: {}", rel(&o2, &o1));
        for (a, b) in s2.iter().zip(&s1) {
            assert!(rel(a, b) < 1e-5);
        }
    }

    #[test]
    fn gates_follow_their_formulas() {
        let f = CpuTensor::f32(&[1, 4], vec![-30.0, 0.5, 25.0, -1.0]).unwrap();
        let a_log = CpuTensor::f32(&[1, 1, 2, 1], vec![0.0, 1.0]).unwrap();
        let bias = CpuTensor::f32(&[4], vec![0.0, 0.1, -0.5, 0.2]).unwrap();
        let soft = gate(&f, &a_log, &bias, 2, KdaGate::Softplus)
            .unwrap()
            .to_f32_vec();
        let want = |x: f64, a: f64| -a.exp() * if x > 20.0 { x } else { x.exp().ln_1p() };
        for (i, (x, a)) in [(-30.0, 0.0), (0.6, 0.0), (24.5, 1.0), (-0.8, 1.0)]
            .iter()
            .enumerate()
        {
            assert!(
                (soft[i] as f64 - want(*x, *a)).abs() < 1e-6 * (1.0 + want(*x, *a).abs()),
                "{i}"
            );
        }
        let safe = gate(&f, &a_log, &bias, 2, KdaGate::LowerBound(-5.0))
            .unwrap()
            .to_f32_vec();
        for (i, (x, a)) in [(-30.0f64, 0.0f64), (0.6, 0.0), (24.5, 1.0), (-0.8, 1.0)]
            .iter()
            .enumerate()
        {
            let w = -5.0 / (1.0 + (-(a.exp() * x)).exp());
            assert!((safe[i] as f64 - w).abs() < 1e-6, "{i}");
            assert!(safe[i] >= -5.0 && safe[i] <= 0.0);
        }
    }

    #[test]
    fn conv_streaming_equals_whole() {
        let mut rng = ChaCha8Rng::seed_from_u64(3);
        let (n, c, w) = (10, 5, 4);
        let x = rand_tensor(&mut rng, &[n, c], 1.0);
        let wt = rand_tensor(&mut rng, &[c, 1, w], 1.0);
        let mut st = CpuTensor::f32(&[w - 1, c], vec![0.0; (w - 1) * c]).unwrap();
        let whole = short_conv_silu(&x, &wt, &[Segment { start: 0, len: n }], &mut [&mut st])
            .unwrap()
            .to_f32_vec();
        let mut st2 = CpuTensor::f32(&[w - 1, c], vec![0.0; (w - 1) * c]).unwrap();
        let xs = x.to_f32_vec();
        let mut pieces = vec![];
        for (a, b) in [(0, 1), (1, 3), (3, 10)] {
            let part = CpuTensor::f32(&[b - a, c], xs[a * c..b * c].to_vec()).unwrap();
            pieces.extend(
                short_conv_silu(
                    &part,
                    &wt,
                    &[Segment {
                        start: 0,
                        len: b - a,
                    }],
                    &mut [&mut st2],
                )
                .unwrap()
                .to_f32_vec(),
            );
        }
        assert!(rel(&pieces, &whole) < 1e-6);
        assert!(rel(&st2.to_f32_vec(), &st.to_f32_vec()) < 1e-6);
    }
}
