//! Multi-head latent attention over a per-sequence latent cache (spec §4).
//!
//! The cache of a sequence is an f32 `[tokens, r + rope]` matrix: each row is a token's
//! normalised latent `c` followed by its shared key `k_pe`. Kimi Linear's MLA is NoPE, so
//! nothing is rotated.

use rayon::prelude::*;

use crate::simd::dot;
use crate::tensor::{shape_err, CpuTensor};
use kimi_ops::check_segments;
use kimi_ops::{MlaDims, MlaMode, Result, Segment};

/// See `Backend::mla`.
pub fn mla(
    q: &CpuTensor,
    latent: &CpuTensor,
    kv_b: &CpuTensor,
    dims: &MlaDims,
    segments: &[Segment],
    caches: &mut [&mut CpuTensor],
    mode: MlaMode,
) -> Result<CpuTensor> {
    let MlaDims {
        num_heads: h,
        kv_lora_rank: r,
        qk_nope_head_dim: dn,
        qk_rope_head_dim: dr,
        v_head_dim: dv,
        ..
    } = *dims;
    let (n, qw) = q.rows_cols("mla")?;
    let lw = r + dr;
    if qw != h * (dn + dr)
        || latent.rows_cols("mla")? != (n, lw)
        || kv_b.shape() != [h * (dn + dv), r]
    {
        return Err(shape_err(
            "mla",
            format!(
                "q {:?}, latent {:?}, kv_b {:?} do not fit {dims:?}",
                q.shape, latent.shape, kv_b.shape
            ),
        ));
    }
    check_segments("mla", segments, caches.len(), n)?;
    let kvb = kv_b.to_f32_vec();
    let (qs, ls) = (q.as_f32("mla")?, latent.as_f32("mla")?);
    let mut out = vec![0f32; n * h * dv];
    for (seg, cache) in segments.iter().zip(caches.iter_mut()) {
        let past = cache.shape.first().copied().unwrap_or(0);
        if cache.shape.len() != 2 || cache.shape[1] != lw {
            return Err(shape_err(
                "mla",
                format!("cache {:?} is not [tokens, {lw}]", cache.shape),
            ));
        }
        let buf = cache.as_f32_mut("mla")?;
        buf.extend_from_slice(&ls[seg.start * lw..(seg.start + seg.len) * lw]);
        cache.shape[0] = past + seg.len;
        let cache_rows: &[f32] = cache.as_f32("mla")?;
        let absorbed = match mode {
            MlaMode::Auto => seg.len == 1,
            MlaMode::Absorbed => true,
            MlaMode::Expanded => false,
        };
        let attend = if absorbed {
            absorbed_attention
        } else {
            expanded_attention
        };
        let seg_q = &qs[seg.start * qw..(seg.start + seg.len) * qw];
        let seg_out = attend(seg_q, cache_rows, &kvb, dims, past);
        out[seg.start * h * dv..(seg.start + seg.len) * h * dv].copy_from_slice(&seg_out);
    }
    CpuTensor::f32(&[n, h * dv], out)
}

/// Reference form: decompress every cached latent into per-head keys and values.
fn expanded_attention(
    q: &[f32],
    cache: &[f32],
    kvb: &[f32],
    dims: &MlaDims,
    past: usize,
) -> Vec<f32> {
    let MlaDims {
        num_heads: h,
        kv_lora_rank: r,
        qk_nope_head_dim: dn,
        qk_rope_head_dim: dr,
        v_head_dim: dv,
        scale,
    } = *dims;
    let lw = r + dr;
    let total = cache.len() / lw;
    let new = total - past;
    let per_head = dn + dv;
    // kv[s, h, :] = W_kvb[h] · c(s): [total, h, dn + dv].
    let kv: Vec<f32> = (0..total)
        .into_par_iter()
        .flat_map_iter(|s| {
            let c = &cache[s * lw..s * lw + r];
            (0..h * per_head).map(move |row| dot(&kvb[row * r..(row + 1) * r], c))
        })
        .collect();
    let head_out: Vec<Vec<f32>> = (0..h)
        .into_par_iter()
        .map(|head| {
            let mut o = vec![0f32; new * dv];
            let mut scores = vec![0f32; total];
            for t in 0..new {
                let qt = &q[(t * h + head) * (dn + dr)..(t * h + head + 1) * (dn + dr)];
                let visible = past + t + 1;
                for (s, score) in scores.iter_mut().enumerate().take(visible) {
                    let k = &kv[(s * h + head) * per_head..(s * h + head) * per_head + dn];
                    let kpe = &cache[s * lw + r..(s + 1) * lw];
                    *score = (dot(&qt[..dn], k) + dot(&qt[dn..], kpe)) * scale;
                }
                softmax(&mut scores[..visible]);
                let ot = &mut o[t * dv..(t + 1) * dv];
                for (s, p) in scores.iter().enumerate().take(visible) {
                    let v = &kv[(s * h + head) * per_head + dn..(s * h + head + 1) * per_head];
                    for (oj, vj) in ot.iter_mut().zip(v) {
                        *oj += p * vj;
                    }
                }
            }
            o
        })
        .collect();
    interleave_heads(&head_out, new, h, dv)
}

/// Absorbed form: queries move into the latent space, attention runs over the raw cache.
fn absorbed_attention(
    q: &[f32],
    cache: &[f32],
    kvb: &[f32],
    dims: &MlaDims,
    past: usize,
) -> Vec<f32> {
    let MlaDims {
        num_heads: h,
        kv_lora_rank: r,
        qk_nope_head_dim: dn,
        qk_rope_head_dim: dr,
        v_head_dim: dv,
        scale,
    } = *dims;
    let lw = r + dr;
    let total = cache.len() / lw;
    let new = total - past;
    let per_head = dn + dv;
    let head_out: Vec<Vec<f32>> = (0..h)
        .into_par_iter()
        .map(|head| {
            let w_uk = &kvb[head * per_head * r..(head * per_head + dn) * r];
            let w_uv = &kvb[(head * per_head + dn) * r..(head + 1) * per_head * r];
            let mut o = vec![0f32; new * dv];
            let mut scores = vec![0f32; total];
            let mut q_lat = vec![0f32; r];
            let mut o_lat = vec![0f32; r];
            for t in 0..new {
                let qt = &q[(t * h + head) * (dn + dr)..(t * h + head + 1) * (dn + dr)];
                q_lat.iter_mut().for_each(|x| *x = 0.0);
                for (i, qi) in qt[..dn].iter().enumerate() {
                    for (ql, w) in q_lat.iter_mut().zip(&w_uk[i * r..(i + 1) * r]) {
                        *ql += qi * w;
                    }
                }
                let visible = past + t + 1;
                for (s, score) in scores.iter_mut().enumerate().take(visible) {
                    let row = &cache[s * lw..(s + 1) * lw];
                    *score = (dot(&q_lat, &row[..r]) + dot(&qt[dn..], &row[r..])) * scale;
                }
                softmax(&mut scores[..visible]);
                o_lat.iter_mut().for_each(|x| *x = 0.0);
                for (s, p) in scores.iter().enumerate().take(visible) {
                    for (ol, c) in o_lat.iter_mut().zip(&cache[s * lw..s * lw + r]) {
                        *ol += p * c;
                    }
                }
                for j in 0..dv {
                    o[t * dv + j] = dot(&w_uv[j * r..(j + 1) * r], &o_lat);
                }
            }
            o
        })
        .collect();
    interleave_heads(&head_out, new, h, dv)
}

fn interleave_heads(head_out: &[Vec<f32>], new: usize, h: usize, dv: usize) -> Vec<f32> {
    let mut out = vec![0f32; new * h * dv];
    for (head, o) in head_out.iter().enumerate() {
        for t in 0..new {
            out[(t * h + head) * dv..(t * h + head + 1) * dv]
                .copy_from_slice(&o[t * dv..(t + 1) * dv]);
        }
    }
    out
}

pub(crate) fn softmax(x: &mut [f32]) {
    let m = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0f32;
    for v in x.iter_mut() {
        *v = (*v - m).exp();
        sum += *v;
    }
    x.iter_mut().for_each(|v| *v /= sum);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn absorbed_equals_expanded() {
        let dims = MlaDims {
            num_heads: 3,
            kv_lora_rank: 10,
            qk_nope_head_dim: 6,
            qk_rope_head_dim: 4,
            v_head_dim: 5,
            scale: 0.3,
        };
        let n = 7;
        let f = |i: usize, m: usize| ((i * m % 29) as f32 - 14.0) * 0.05;
        let q = CpuTensor::f32(&[n, 3 * 10], (0..n * 30).map(|i| f(i, 7)).collect()).unwrap();
        let lat = CpuTensor::f32(&[n, 14], (0..n * 14).map(|i| f(i, 11)).collect()).unwrap();
        let kvb = CpuTensor::f32(&[3 * 11, 10], (0..330).map(|i| f(i, 13)).collect()).unwrap();
        let seg = [Segment { start: 0, len: n }];
        let mut outs = vec![];
        for mode in [MlaMode::Expanded, MlaMode::Absorbed] {
            let mut cache = CpuTensor::f32(&[0, 14], vec![]).unwrap();
            outs.push(
                mla(&q, &lat, &kvb, &dims, &seg, &mut [&mut cache], mode)
                    .unwrap()
                    .to_f32_vec(),
            );
            assert_eq!(cache.shape(), &[n, 14]);
        }
        for (a, b) in outs[0].iter().zip(&outs[1]) {
            assert!((a - b).abs() < 1e-5, "{a} {b}");
        }
    }
}
