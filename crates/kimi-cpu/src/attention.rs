//! Rotary position embedding and causal grouped-query attention over per-sequence
//! key/value caches (the attention of Llama-architecture models).
//!
//! A sequence's cache is two f32 matrices `[tokens, Hkv*D]`, keys (already rotated) and
//! values; new rows are appended, then every new token attends to the rows up to itself:
//!
//! ```text
//!   cache rows:  0 .. past-1 | past .. past+len-1   (the segment's new tokens)
//!   token t of the segment sees rows 0 ..= past + t
//! ```

use rayon::prelude::*;

use crate::mla::softmax;
use crate::simd::dot;
use crate::tensor::{shape_err, CpuTensor};
use kimi_ops::check_segments;
use kimi_ops::{AttentionDims, Result, RopeStyle, Segment};

/// Up to this many rows `rope` runs sequentially (the backend then calls it on the calling
/// thread, without a hand-off to the pool).
pub const SEQUENTIAL_ROPE_ROWS: usize = 8;

/// See `Backend::rope`.
pub fn rope(
    x: &CpuTensor,
    positions: &[usize],
    num_heads: usize,
    head_dim: usize,
    theta: f32,
    style: RopeStyle,
) -> Result<CpuTensor> {
    let (n, width) = x.rows_cols("rope")?;
    if width != num_heads * head_dim || !head_dim.is_multiple_of(2) || positions.len() != n {
        return Err(shape_err(
            "rope",
            format!(
                "x {:?} with {} positions does not fit {num_heads} heads of even width {head_dim}",
                x.shape,
                positions.len()
            ),
        ));
    }
    let half = head_dim / 2;
    // Frequencies and angles in f64: exact enough that f32 rounding of cos/sin dominates.
    let inv_freq: Vec<f64> = (0..half)
        .map(|i| f64::from(theta).powf(-2.0 * i as f64 / head_dim as f64))
        .collect();
    let mut out = x.as_f32("rope")?.to_vec();
    if width == 0 {
        return CpuTensor::f32(&x.shape, out);
    }
    let rotate = |(row, &pos): (&mut [f32], &usize)| {
        let (cos, sin): (Vec<f32>, Vec<f32>) = inv_freq
            .iter()
            .map(|f| {
                let angle = pos as f64 * f;
                (angle.cos() as f32, angle.sin() as f32)
            })
            .unzip();
        for head in row.chunks_exact_mut(head_dim) {
            for i in 0..half {
                let (a, b) = match style {
                    RopeStyle::Adjacent => (2 * i, 2 * i + 1),
                    RopeStyle::HalfSplit => (i, i + half),
                };
                let (x0, x1) = (head[a], head[b]);
                head[a] = x0 * cos[i] - x1 * sin[i];
                head[b] = x0 * sin[i] + x1 * cos[i];
            }
        }
    };
    // A few rows (decode) are cheaper on the calling thread than spread over the pool.
    if n <= SEQUENTIAL_ROPE_ROWS {
        out.chunks_mut(width).zip(positions).for_each(rotate);
    } else {
        out.par_chunks_mut(width)
            .zip(positions.par_iter())
            .for_each(rotate);
    }
    CpuTensor::f32(&x.shape, out)
}

/// See `Backend::attention`.
pub fn attention(
    q: &CpuTensor,
    k: &CpuTensor,
    v: &CpuTensor,
    dims: &AttentionDims,
    segments: &[Segment],
    caches: &mut [(&mut CpuTensor, &mut CpuTensor)],
) -> Result<CpuTensor> {
    let AttentionDims {
        num_heads: hq,
        num_kv_heads: hkv,
        head_dim: d,
        ..
    } = *dims;
    let (n, qw) = q.rows_cols("attention")?;
    let kvw = hkv * d;
    if hkv == 0
        || !hq.is_multiple_of(hkv)
        || qw != hq * d
        || k.rows_cols("attention")? != (n, kvw)
        || v.rows_cols("attention")? != (n, kvw)
    {
        return Err(shape_err(
            "attention",
            format!(
                "q {:?}, k {:?}, v {:?} do not fit {dims:?}",
                q.shape, k.shape, v.shape
            ),
        ));
    }
    check_segments("attention", segments, caches.len(), n)?;
    let (ks, vs) = (k.as_f32("attention")?, v.as_f32("attention")?);
    let mut pasts = Vec::with_capacity(segments.len());
    for (seg, (k_cache, v_cache)) in segments.iter().zip(caches.iter_mut()) {
        pasts.push(append_rows(k_cache, v_cache, ks, vs, seg, kvw)?);
    }
    let views = caches
        .iter()
        .map(|(kc, vc)| Ok((kc.as_f32("attention")?, vc.as_f32("attention")?)))
        .collect::<Result<Vec<_>>>()?;
    let qs = q.as_f32("attention")?;
    let tasks: Vec<(usize, usize)> = (0..segments.len())
        .filter(|&s| segments[s].len > 0)
        .flat_map(|s| (0..hq).map(move |head| (s, head)))
        .collect();
    let group = hq / hkv;
    let results: Vec<Vec<f32>> = tasks
        .par_iter()
        .map(|&(s, head)| {
            let seg = segments[s];
            let (k_cache, v_cache) = views[s];
            attend_head(
                &qs[seg.start * qw..(seg.start + seg.len) * qw],
                k_cache,
                v_cache,
                pasts[s],
                Head {
                    q_offset: head * d,
                    kv_offset: head / group * d,
                    q_width: qw,
                    kv_width: kvw,
                    dim: d,
                    scale: dims.scale,
                },
            )
        })
        .collect();
    let mut out = vec![0f32; n * qw];
    for (&(s, head), o) in tasks.iter().zip(&results) {
        let seg = segments[s];
        for (t, ot) in o.chunks_exact(d).enumerate() {
            let row = (seg.start + t) * qw + head * d;
            out[row..row + d].copy_from_slice(ot);
        }
    }
    CpuTensor::f32(&[n, qw], out)
}

/// Appends the segment's new key and value rows to its caches; returns the earlier length.
fn append_rows(
    k_cache: &mut CpuTensor,
    v_cache: &mut CpuTensor,
    ks: &[f32],
    vs: &[f32],
    seg: &Segment,
    kvw: usize,
) -> Result<usize> {
    let past = k_cache.shape.first().copied().unwrap_or(0);
    if k_cache.shape != [past, kvw] || v_cache.shape != [past, kvw] {
        return Err(shape_err(
            "attention",
            format!(
                "caches {:?} and {:?} are not both [tokens, {kvw}]",
                k_cache.shape, v_cache.shape
            ),
        ));
    }
    let rows = seg.start * kvw..(seg.start + seg.len) * kvw;
    k_cache
        .as_f32_mut("attention")?
        .extend_from_slice(&ks[rows.clone()]);
    v_cache
        .as_f32_mut("attention")?
        .extend_from_slice(&vs[rows]);
    k_cache.shape[0] = past + seg.len;
    v_cache.shape[0] = past + seg.len;
    Ok(past)
}

/// Where one query head and its key/value head sit in their rows.
struct Head {
    q_offset: usize,
    kv_offset: usize,
    q_width: usize,
    kv_width: usize,
    dim: usize,
    scale: f32,
}

/// One head's causal attention for a segment's new tokens `q [len, q_width]` over the
/// cache rows `[past + len, kv_width]`. Returns `[len, dim]`.
fn attend_head(q: &[f32], k_cache: &[f32], v_cache: &[f32], past: usize, h: Head) -> Vec<f32> {
    let len = q.len() / h.q_width;
    let d = h.dim;
    let mut out = vec![0f32; len * d];
    let mut scores = vec![0f32; past + len];
    for (t, ot) in out.chunks_exact_mut(d).enumerate() {
        let qt = &q[t * h.q_width + h.q_offset..][..d];
        let visible = past + t + 1;
        for (s, score) in scores[..visible].iter_mut().enumerate() {
            *score = dot(qt, &k_cache[s * h.kv_width + h.kv_offset..][..d]) * h.scale;
        }
        softmax(&mut scores[..visible]);
        for (s, &p) in scores[..visible].iter().enumerate() {
            let vrow = &v_cache[s * h.kv_width + h.kv_offset..][..d];
            for (o, &vj) in ot.iter_mut().zip(vrow) {
                *o += p * vj;
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    fn random(rng: &mut ChaCha8Rng, shape: &[usize]) -> CpuTensor {
        let n = shape.iter().product();
        CpuTensor::f32(shape, (0..n).map(|_| rng.random_range(-1.0..1.0)).collect()).unwrap()
    }

    fn empty_cache(width: usize) -> (CpuTensor, CpuTensor) {
        (
            CpuTensor::f32(&[0, width], vec![]).unwrap(),
            CpuTensor::f32(&[0, width], vec![]).unwrap(),
        )
    }

    fn rows(t: &CpuTensor, range: std::ops::Range<usize>) -> CpuTensor {
        let w = t.shape[1];
        let data = t.to_f32_vec()[range.start * w..range.end * w].to_vec();
        CpuTensor::f32(&[range.len(), w], data).unwrap()
    }

    fn assert_close(a: &[f32], b: &[f32], tol: f32) {
        assert_eq!(a.len(), b.len());
        for (i, (x, y)) in a.iter().zip(b).enumerate() {
            assert!((x - y).abs() <= tol, "element {i}: {x} vs {y}");
        }
    }

    /// Rotation of pair `(x0, x1)` by `pos * theta^(-2i/D)`, evaluated in f64.
    fn rotate(x0: f32, x1: f32, pos: usize, i: usize, d: usize, theta: f64) -> (f32, f32) {
        let angle = pos as f64 / theta.powf(2.0 * i as f64 / d as f64);
        let (s, c) = angle.sin_cos();
        let (x0, x1) = (f64::from(x0), f64::from(x1));
        ((x0 * c - x1 * s) as f32, (x0 * s + x1 * c) as f32)
    }

    #[test]
    fn rope_matches_the_formula_in_both_styles() {
        let mut rng = ChaCha8Rng::seed_from_u64(1);
        let (heads, d, theta) = (3, 8, 10000.0);
        let positions = [0, 1, 5, 77, 4095];
        let x = random(&mut rng, &[positions.len(), heads * d]);
        let xs = x.to_f32_vec();
        for style in [RopeStyle::Adjacent, RopeStyle::HalfSplit] {
            let y = rope(&x, &positions, heads, d, theta, style)
                .unwrap()
                .to_f32_vec();
            let mut want = xs.clone();
            for (row, &pos) in positions.iter().enumerate() {
                for head in 0..heads {
                    let base = row * heads * d + head * d;
                    for i in 0..d / 2 {
                        let (a, b) = match style {
                            RopeStyle::Adjacent => (base + 2 * i, base + 2 * i + 1),
                            RopeStyle::HalfSplit => (base + i, base + i + d / 2),
                        };
                        (want[a], want[b]) = rotate(xs[a], xs[b], pos, i, d, f64::from(theta));
                    }
                }
            }
            assert_close(&y, &want, 1e-6);
        }
        // Position 0 is the identity.
        let y = rope(&x, &[0; 5], heads, d, theta, RopeStyle::Adjacent).unwrap();
        assert_eq!(y.to_f32_vec(), xs);
        assert!(rope(&x, &positions[..4], heads, d, theta, RopeStyle::Adjacent).is_err());
        assert!(rope(&x, &positions, heads, 7, theta, RopeStyle::Adjacent).is_err());
    }

    /// Straightforward f64 causal attention over the full sequence with `repeat_kv`.
    fn naive(q: &[f32], k: &[f32], v: &[f32], n: usize, dims: &AttentionDims) -> Vec<f32> {
        let (hq, hkv, d) = (dims.num_heads, dims.num_kv_heads, dims.head_dim);
        let mut out = vec![0f32; n * hq * d];
        for head in 0..hq {
            let kvh = head / (hq / hkv);
            for t in 0..n {
                let qt = &q[t * hq * d + head * d..][..d];
                let scores: Vec<f64> = (0..=t)
                    .map(|s| {
                        let ks = &k[s * hkv * d + kvh * d..][..d];
                        let dot: f64 = qt.iter().zip(ks).map(|(a, b)| f64::from(a * b)).sum();
                        dot * f64::from(dims.scale)
                    })
                    .collect();
                let m = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                let e: Vec<f64> = scores.iter().map(|s| (s - m).exp()).collect();
                let z: f64 = e.iter().sum();
                for j in 0..d {
                    let o: f64 = (0..=t)
                        .map(|s| e[s] / z * f64::from(v[s * hkv * d + kvh * d + j]))
                        .sum();
                    out[t * hq * d + head * d + j] = o as f32;
                }
            }
        }
        out
    }

    #[test]
    fn whole_prompt_matches_naive_and_streaming() {
        let mut rng = ChaCha8Rng::seed_from_u64(2);
        let dims = AttentionDims {
            num_heads: 6,
            num_kv_heads: 2,
            head_dim: 8,
            scale: 8f32.powf(-0.5),
        };
        let n = 9;
        let q = random(&mut rng, &[n, 48]);
        let k = random(&mut rng, &[n, 16]);
        let v = random(&mut rng, &[n, 16]);
        let want = naive(&q.to_f32_vec(), &k.to_f32_vec(), &v.to_f32_vec(), n, &dims);

        let (mut kc, mut vc) = empty_cache(16);
        let seg = [Segment { start: 0, len: n }];
        let whole = attention(&q, &k, &v, &dims, &seg, &mut [(&mut kc, &mut vc)]).unwrap();
        assert_close(&whole.to_f32_vec(), &want, 1e-5);
        assert_eq!(kc.shape(), &[n, 16]);
        assert_eq!(kc.to_f32_vec(), k.to_f32_vec());

        // Chunks of 1, 3 and 5 through the same caches give the same rows.
        let (mut kc, mut vc) = empty_cache(16);
        let mut streamed = Vec::new();
        for range in [0..1, 1..4, 4..9] {
            let seg = [Segment {
                start: 0,
                len: range.len(),
            }];
            let part = attention(
                &rows(&q, range.clone()),
                &rows(&k, range.clone()),
                &rows(&v, range),
                &dims,
                &seg,
                &mut [(&mut kc, &mut vc)],
            )
            .unwrap();
            streamed.extend(part.to_f32_vec());
        }
        assert_close(&streamed, &whole.to_f32_vec(), 1e-6);
        assert_eq!(vc.to_f32_vec(), v.to_f32_vec());
    }

    #[test]
    fn segments_use_their_own_caches() {
        let mut rng = ChaCha8Rng::seed_from_u64(3);
        let dims = AttentionDims {
            num_heads: 4,
            num_kv_heads: 4,
            head_dim: 4,
            scale: 0.5,
        };
        let (q, k, v) = (
            random(&mut rng, &[7, 16]),
            random(&mut rng, &[7, 16]),
            random(&mut rng, &[7, 16]),
        );
        // Sequence A is rows 0..4, sequence B rows 4..7; B's first two rows were fed earlier.
        let (mut ka, mut va) = empty_cache(16);
        let (mut kb, mut vb) = empty_cache(16);
        let seg = [Segment { start: 0, len: 2 }];
        attention(
            &rows(&q, 4..6),
            &rows(&k, 4..6),
            &rows(&v, 4..6),
            &dims,
            &seg,
            &mut [(&mut kb, &mut vb)],
        )
        .unwrap();
        let batch = [
            Segment { start: 0, len: 4 },
            Segment { start: 4, len: 1 },
            Segment { start: 5, len: 0 },
        ];
        let (mut kc, mut vc) = empty_cache(16);
        let qb = [rows(&q, 0..4).to_f32_vec(), rows(&q, 6..7).to_f32_vec()].concat();
        let kb_new = [rows(&k, 0..4).to_f32_vec(), rows(&k, 6..7).to_f32_vec()].concat();
        let vb_new = [rows(&v, 0..4).to_f32_vec(), rows(&v, 6..7).to_f32_vec()].concat();
        let out = attention(
            &CpuTensor::f32(&[5, 16], qb).unwrap(),
            &CpuTensor::f32(&[5, 16], kb_new).unwrap(),
            &CpuTensor::f32(&[5, 16], vb_new).unwrap(),
            &dims,
            &batch,
            &mut [(&mut ka, &mut va), (&mut kb, &mut vb), (&mut kc, &mut vc)],
        )
        .unwrap()
        .to_f32_vec();
        let want_a = naive(
            &rows(&q, 0..4).to_f32_vec(),
            &rows(&k, 0..4).to_f32_vec(),
            &rows(&v, 0..4).to_f32_vec(),
            4,
            &dims,
        );
        let want_b = naive(
            &rows(&q, 4..7).to_f32_vec(),
            &rows(&k, 4..7).to_f32_vec(),
            &rows(&v, 4..7).to_f32_vec(),
            3,
            &dims,
        );
        assert_close(&out[..4 * 16], &want_a, 1e-5);
        assert_close(&out[4 * 16..], &want_b[2 * 16..], 1e-5);
        assert_eq!((ka.shape()[0], kb.shape()[0], kc.shape()[0]), (4, 3, 0));
    }

    #[test]
    fn query_heads_read_their_group_kv_head() {
        // 6 query heads over 3 kv heads: heads 0,1 read kv head 0, heads 2,3 kv head 1, ...
        let dims = AttentionDims {
            num_heads: 6,
            num_kv_heads: 3,
            head_dim: 2,
            scale: 1.0,
        };
        let n = 3;
        let q = CpuTensor::f32(&[n, 12], vec![0.3; n * 12]).unwrap();
        let k = CpuTensor::f32(&[n, 6], vec![0.1; n * 6]).unwrap();
        // Every value of kv head j is j + 1.
        let v: Vec<f32> = (0..n * 6).map(|i| (i % 6 / 2 + 1) as f32).collect();
        let v = CpuTensor::f32(&[n, 6], v).unwrap();
        let (mut kc, mut vc) = empty_cache(6);
        let seg = [Segment { start: 0, len: n }];
        let out = attention(&q, &k, &v, &dims, &seg, &mut [(&mut kc, &mut vc)]).unwrap();
        for (i, &o) in out.to_f32_vec().iter().enumerate() {
            let head = i % 12 / 2;
            assert!((o - (head / 2 + 1) as f32).abs() < 1e-6, "head {head}: {o}");
        }
        let bad = AttentionDims {
            num_kv_heads: 4,
            ..dims
        };
        assert!(attention(&q, &k, &v, &bad, &seg, &mut [(&mut kc, &mut vc)]).is_err());
    }
}
