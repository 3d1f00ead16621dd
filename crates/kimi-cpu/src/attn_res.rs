//! Kimi K3's Block Attention Residuals mix and the sigmoid output gate (K3 spec §3.3, §3.6).

use crate::tensor::{shape_err, CpuTensor};
use kimi_ops::Result;

/// `x ⊙ sigmoid(gate)`; see `Backend::sigmoid_gate`.
pub fn sigmoid_gate(x: &CpuTensor, gate: &CpuTensor) -> Result<CpuTensor> {
    if x.shape() != gate.shape() {
        return Err(shape_err(
            "sigmoid_gate",
            format!("{:?} gated by {:?}", x.shape(), gate.shape()),
        ));
    }
    let (xs, gs) = (x.as_f32("sigmoid_gate")?, gate.as_f32("sigmoid_gate")?);
    let out = xs
        .iter()
        .zip(gs)
        .map(|(&v, &g)| v * crate::kda::sigmoid(g))
        .collect();
    CpuTensor::f32(x.shape(), out)
}

/// The softmax mix over stored blocks and the partial sum; see `Backend::attn_res_mix`.
pub fn mix(
    blocks: &[&CpuTensor],
    partial: &CpuTensor,
    w_eff: &CpuTensor,
    eps: f32,
) -> Result<CpuTensor> {
    let (n, d) = partial.rows_cols("attn_res_mix")?;
    if w_eff.shape() != [d] {
        return Err(shape_err(
            "attn_res_mix",
            format!("weight {:?} for width {d}", w_eff.shape()),
        ));
    }
    if let Some(b) = blocks.iter().find(|b| b.shape() != partial.shape()) {
        return Err(shape_err(
            "attn_res_mix",
            format!(
                "block {:?} beside partial sum {:?}",
                b.shape(),
                partial.shape()
            ),
        ));
    }
    let w = w_eff.f32_values();
    let mut sources = Vec::with_capacity(blocks.len() + 1);
    for b in blocks {
        sources.push(b.as_f32("attn_res_mix")?);
    }
    sources.push(partial.as_f32("attn_res_mix")?);
    let mut out = vec![0f32; n * d];
    let mut logits = vec![0f32; sources.len()];
    for t in 0..n {
        let rows = t * d..(t + 1) * d;
        for (logit, src) in logits.iter_mut().zip(&sources) {
            let v = &src[rows.clone()];
            let (mut dot, mut sq) = (0f32, 0f32);
            for (x, wi) in v.iter().zip(w.iter()) {
                dot += x * wi;
                sq += x * x;
            }
            // RMS-normalised without a weight: the norm's weight is folded into `w_eff`.
            *logit = dot / (sq / d as f32 + eps).sqrt();
        }
        let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let mut total = 0f32;
        for l in logits.iter_mut() {
            *l = (*l - max).exp();
            total += *l;
        }
        let o = &mut out[rows.clone()];
        for (p, src) in logits.iter().zip(&sources) {
            let p = p / total;
            for (o, x) in o.iter_mut().zip(&src[rows.clone()]) {
                *o += p * x;
            }
        }
    }
    CpuTensor::f32(partial.shape(), out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(shape: &[usize], v: &[f32]) -> CpuTensor {
        CpuTensor::f32(shape, v.to_vec()).unwrap()
    }

    #[test]
    fn mix_is_a_softmax_over_normalised_scores() {
        // One token, width 2, two blocks and the partial sum.
        let b0 = t(&[1, 2], &[1.0, 0.0]);
        let b1 = t(&[1, 2], &[0.0, 3.0]);
        let p = t(&[1, 2], &[2.0, 2.0]);
        let w = t(&[2], &[1.0, 0.5]);
        let eps = 1e-5f32;
        let got = mix(&[&b0, &b1], &p, &w, eps).unwrap().to_f32_vec();
        let src = [[1.0f64, 0.0], [0.0, 3.0], [2.0, 2.0]];
        let logit: Vec<f64> = src
            .iter()
            .map(|v| {
                let rms = ((v[0] * v[0] + v[1] * v[1]) / 2.0 + eps as f64).sqrt();
                (v[0] * 1.0 + v[1] * 0.5) / rms
            })
            .collect();
        let z: f64 = logit.iter().map(|l| l.exp()).sum();
        for j in 0..2 {
            let want: f64 = src
                .iter()
                .zip(&logit)
                .map(|(v, l)| l.exp() / z * v[j])
                .sum();
            assert!((got[j] as f64 - want).abs() < 1e-6, "{got:?} vs {want}");
        }
        // No blocks: the partial sum itself (softmax over one source).
        assert_eq!(mix(&[], &p, &w, eps).unwrap().to_f32_vec(), vec![2.0, 2.0]);
        assert!(mix(&[&b0], &p, &t(&[3], &[1.0; 3]), eps).is_err());
    }

    #[test]
    fn gate_multiplies_by_the_sigmoid() {
        let y = sigmoid_gate(&t(&[1, 2], &[2.0, -4.0]), &t(&[1, 2], &[0.0, 100.0]))
            .unwrap()
            .to_f32_vec();
        assert_eq!(y, vec![1.0, -4.0]);
    }
}
