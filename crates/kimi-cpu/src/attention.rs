//! Rotary position embedding and causal grouped-query attention over paged key/value
//! caches (the attention of Llama-architecture models).
//!
//! A layer's cache is two pools `[num_blocks, block_size, Hkv*D]`, keys (already rotated)
//! and values, both f32 or both f16 (the backend's int8 mode, as llama.cpp's default cache
//! type: decode reads every cached row once per step, and f16 halves that read; products
//! run on the widened values); a sequence's rows are found through its block table
//! (`kimi_ops::PagedSeq`). New rows are written at the sequence's next positions, then every
//! new token attends to the positions up to itself:
//!
//! ```text
//!   cache rows:  0 .. past-1 | past .. past+len-1   (the segment's new tokens)
//!   token t of the segment sees rows 0 ..= past + t
//! ```

use crate::mla::softmax;
use crate::paged::{write_rows, PagedRows};
use crate::simd::{add_scaled_strided, add_scaled_strided_f16, dot_strided, dot_strided_f16};
use crate::tensor::{shape_err, CpuTensor, Storage};
use kimi_ops::{check_paged, check_segments};
use kimi_ops::{AttentionDims, PagedSeq, Result, RopeStyle, Segment};

/// Up to this many rows (decode) `rope` runs on the calling thread alone: a parallel
/// section would cost more than rotating them.
const SEQUENTIAL_ROPE_ROWS: usize = 8;

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
    if n <= SEQUENTIAL_ROPE_ROWS {
        out.chunks_mut(width).zip(positions).for_each(rotate);
    } else {
        crate::team().for_each_part(&mut out, width, 1, |first, part| {
            part.chunks_mut(width)
                .zip(&positions[first..])
                .for_each(rotate);
        });
    }
    CpuTensor::f32(&x.shape, out)
}

/// See `Backend::attention`.
#[allow(clippy::too_many_arguments)]
pub fn attention(
    q: &CpuTensor,
    k: &CpuTensor,
    v: &CpuTensor,
    dims: &AttentionDims,
    segments: &[Segment],
    k_pool: &mut CpuTensor,
    v_pool: &mut CpuTensor,
    seqs: &[PagedSeq<'_>],
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
        || k_pool.shape != v_pool.shape
    {
        return Err(shape_err(
            "attention",
            format!(
                "q {:?}, k {:?}, v {:?}, pools {:?} and {:?} do not fit {dims:?}",
                q.shape, k.shape, v.shape, k_pool.shape, v_pool.shape
            ),
        ));
    }
    check_segments("attention", segments, seqs.len(), n)?;
    let block_size = check_paged("attention", &k_pool.shape, kvw, segments, seqs)?;
    let (ks, vs) = (k.as_f32("attention")?, v.as_f32("attention")?);
    let qs = q.as_f32("attention")?;
    let layout = Layout {
        hq,
        group: hq / hkv,
        d,
        qw,
        kvw,
        block_size,
        scale: dims.scale,
    };
    let out = match (&mut k_pool.storage, &mut v_pool.storage) {
        (Storage::F32(kp), Storage::F32(vp)) => {
            write_and_attend(qs, (ks, vs), (kp, vp), segments, seqs, &layout)
        }
        (Storage::F16(kp), Storage::F16(vp)) => {
            write_and_attend(qs, (ks, vs), (kp, vp), segments, seqs, &layout)
        }
        _ => {
            return Err(shape_err(
                "attention",
                "key/value pools must both be f32 or both f16".into(),
            ))
        }
    };
    CpuTensor::f32(&[n, qw], out)
}

/// Sizes shared by every head's task.
struct Layout {
    hq: usize,
    group: usize,
    d: usize,
    qw: usize,
    kvw: usize,
    block_size: usize,
    scale: f32,
}

/// Writes every segment's new keys and values `(ks, vs)` into the pools, then its new
/// tokens attend over their caches: `[n, hq·d]`.
fn write_and_attend<T: CacheValue>(
    qs: &[f32],
    (ks, vs): (&[f32], &[f32]),
    (k_rows, v_rows): (&mut [T], &mut [T]),
    segments: &[Segment],
    seqs: &[PagedSeq<'_>],
    l: &Layout,
) -> Vec<f32> {
    for (seg, seq) in segments.iter().zip(seqs) {
        let new = seg.start * l.kvw..(seg.start + seg.len) * l.kvw;
        write_rows(
            k_rows,
            seq,
            l.block_size,
            l.kvw,
            &ks[new.clone()],
            T::from_f32,
        );
        write_rows(v_rows, seq, l.block_size, l.kvw, &vs[new], T::from_f32);
    }
    let (k_rows, v_rows): (&[T], &[T]) = (k_rows, v_rows);
    let tasks: Vec<(usize, usize)> = (0..segments.len())
        .filter(|&s| segments[s].len > 0)
        .flat_map(|s| (0..l.hq).map(move |head| (s, head)))
        .collect();
    let team = crate::team();
    // Decode: each thread takes a run of consecutive heads, so the query heads that share
    // a key/value head mostly run on one core and read its cached rows from L2 (as tasks
    // claimed one by one, both cores fetched every key/value head). Prefill keeps one
    // task per head, which balances uneven segments.
    let runs = if segments.iter().all(|seg| seg.len <= 1) {
        crate::team::parts(tasks.len(), 1, team.threads())
    } else {
        (0..tasks.len()).map(|t| t..t + 1).collect()
    };
    let attend = |task: usize| {
        let (s, head) = tasks[task];
        let (seg, seq) = (segments[s], &seqs[s]);
        attend_head(
            &qs[seg.start * l.qw..(seg.start + seg.len) * l.qw],
            PagedRows::new(k_rows, seq, l.block_size, l.kvw),
            PagedRows::new(v_rows, seq, l.block_size, l.kvw),
            seq.num_cached,
            Head {
                q_offset: head * l.d,
                kv_offset: head / l.group * l.d,
                q_width: l.qw,
                dim: l.d,
                scale: l.scale,
            },
        )
    };
    let results: Vec<Vec<f32>> = team
        .map(runs.len(), |r| {
            runs[r].clone().map(attend).collect::<Vec<_>>()
        })
        .into_iter()
        .flatten()
        .collect();
    let mut out = vec![0f32; qs.len()];
    for (&(s, head), o) in tasks.iter().zip(&results) {
        let seg = segments[s];
        for (t, ot) in o.chunks_exact(l.d).enumerate() {
            let row = (seg.start + t) * l.qw + head * l.d;
            out[row..row + l.d].copy_from_slice(ot);
        }
    }
    out
}

/// An element type of key/value pools: f32, or f16 bit patterns (`u16`).
pub(crate) trait CacheValue: Copy + Sync {
    /// A value as stored (f16: rounded to nearest).
    fn from_f32(v: f32) -> Self;
    /// `scores[s] = q · row s` (see [`crate::simd::dot_strided`]).
    fn dot_strided(q: &[f32], rows: &[Self], stride: usize, scores: &mut [f32]);
    /// `out += Σ p[s] · row s` (see [`crate::simd::add_scaled_strided`]).
    fn add_scaled_strided(out: &mut [f32], p: &[f32], rows: &[Self], stride: usize);
}

impl CacheValue for f32 {
    fn from_f32(v: f32) -> f32 {
        v
    }
    fn dot_strided(q: &[f32], rows: &[f32], stride: usize, scores: &mut [f32]) {
        dot_strided(q, rows, stride, scores);
    }
    fn add_scaled_strided(out: &mut [f32], p: &[f32], rows: &[f32], stride: usize) {
        add_scaled_strided(out, p, rows, stride);
    }
}

impl CacheValue for u16 {
    fn from_f32(v: f32) -> u16 {
        half::f16::from_f32(v).to_bits()
    }
    fn dot_strided(q: &[f32], rows: &[u16], stride: usize, scores: &mut [f32]) {
        dot_strided_f16(q, rows, stride, scores);
    }
    fn add_scaled_strided(out: &mut [f32], p: &[f32], rows: &[u16], stride: usize) {
        add_scaled_strided_f16(out, p, rows, stride);
    }
}

/// Where one query head and its key/value head sit in their rows.
struct Head {
    q_offset: usize,
    kv_offset: usize,
    q_width: usize,
    dim: usize,
    scale: f32,
}

/// One head's causal attention for a segment's new tokens `q [len, q_width]` over the
/// sequence's cached positions `0 .. past + len`. Returns `[len, dim]`.
fn attend_head<T: CacheValue>(
    q: &[f32],
    k_cache: PagedRows<'_, T>,
    v_cache: PagedRows<'_, T>,
    past: usize,
    h: Head,
) -> Vec<f32> {
    let len = q.len() / h.q_width;
    let d = h.dim;
    let mut out = vec![0f32; len * d];
    let mut scores = vec![0f32; past + len];
    for (t, ot) in out.chunks_exact_mut(d).enumerate() {
        let qt = &q[t * h.q_width + h.q_offset..][..d];
        let visible = past + t + 1;
        // Scores and values a cache block at a time (runs of rows `stride` apart).
        let stride = k_cache.width();
        let mut first = 0;
        for (run, rows) in k_cache.runs(visible) {
            let out = &mut scores[first..first + rows];
            T::dot_strided(qt, &run[h.kv_offset..], stride, out);
            out.iter_mut().for_each(|s| *s *= h.scale);
            first += rows;
        }
        softmax(&mut scores[..visible]);
        let mut first = 0;
        for (run, rows) in v_cache.runs(visible) {
            let p = &scores[first..first + rows];
            T::add_scaled_strided(ot, p, &run[h.kv_offset..], stride);
            first += rows;
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

    /// Key and value pools of 16 blocks of 3 rows, full of NaN (a row read before it was
    /// written poisons the output).
    fn pools(width: usize) -> (CpuTensor, CpuTensor) {
        let nan = || CpuTensor::f32(&[16, 3, width], vec![f32::NAN; 48 * width]).unwrap();
        (nan(), nan())
    }

    /// A sequence in the pools: a scattered block table and its cached length.
    struct Seq(Vec<u32>, usize);

    impl Seq {
        fn paged(&self) -> PagedSeq<'_> {
            PagedSeq {
                block_table: &self.0,
                num_cached: self.1,
            }
        }
    }

    /// Runs attention and advances each sequence by its segment.
    #[allow(clippy::too_many_arguments)]
    fn run(
        q: &CpuTensor,
        k: &CpuTensor,
        v: &CpuTensor,
        dims: &AttentionDims,
        segs: &[Segment],
        (kp, vp): &mut (CpuTensor, CpuTensor),
        seqs: &mut [&mut Seq],
    ) -> Result<CpuTensor> {
        let paged: Vec<PagedSeq<'_>> = seqs.iter().map(|s| s.paged()).collect();
        let out = attention(q, k, v, dims, segs, kp, vp, &paged)?;
        for (s, seg) in seqs.iter_mut().zip(segs) {
            s.1 += seg.len;
        }
        Ok(out)
    }

    /// The sequence's `n` cached rows of a pool, in token order.
    fn gather(pool: &CpuTensor, seq: &Seq, n: usize) -> Vec<f32> {
        let (bs, w) = (pool.shape[1], pool.shape[2]);
        let data = pool.to_f32_vec();
        (0..n)
            .flat_map(|i| {
                let at = (seq.0[i / bs] as usize * bs + i % bs) * w;
                data[at..at + w].to_vec()
            })
            .collect()
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

    /// f16 pools (the int8 mode's) give, bit for bit, what f32 pools give when fed the keys
    /// and values rounded to f16: prompt and single-token steps, head widths with and
    /// without 32- and 8-value tails. Mixed pools are refused.
    #[test]
    fn f16_pools_equal_f32_pools_of_rounded_values() {
        let mut rng = ChaCha8Rng::seed_from_u64(5);
        let round = |t: &CpuTensor| {
            let v = t.to_f32_vec();
            let r = v.iter().map(|&x| half::f16::from_f32(x).to_f32()).collect();
            CpuTensor::f32(&t.shape, r).unwrap()
        };
        for d in [8usize, 40, 64] {
            let dims = AttentionDims {
                num_heads: 6,
                num_kv_heads: 2,
                head_dim: d,
                scale: (d as f32).powf(-0.5),
            };
            let (n, kvw) = (7, 2 * d);
            let q = random(&mut rng, &[n, 6 * d]);
            let k = random(&mut rng, &[n, kvw]);
            let v = random(&mut rng, &[n, kvw]);
            let (kr, vr) = (round(&k), round(&v));
            let half_pools = || {
                let z = || CpuTensor::f16_zeros(&[16, 3, kvw]);
                (z(), z())
            };
            let mut outs = Vec::new();
            for f16 in [false, true] {
                let mut pool = if f16 { half_pools() } else { pools(kvw) };
                let (k, v) = if f16 { (&k, &v) } else { (&kr, &vr) };
                let mut seq = Seq(vec![9, 2, 14], 0);
                // A 4-token prompt, then three single-token steps.
                let mut out = Vec::new();
                for range in [0..4, 4..5, 5..6, 6..7] {
                    let seg = [Segment {
                        start: 0,
                        len: range.len(),
                    }];
                    let part = run(
                        &rows(&q, range.clone()),
                        &rows(k, range.clone()),
                        &rows(v, range),
                        &dims,
                        &seg,
                        &mut pool,
                        &mut [&mut seq],
                    )
                    .unwrap();
                    out.extend(part.to_f32_vec());
                }
                outs.push(out);
            }
            assert_eq!(outs[0], outs[1], "head_dim {d}");
            let want = naive(
                &q.to_f32_vec(),
                &kr.to_f32_vec(),
                &vr.to_f32_vec(),
                n,
                &dims,
            );
            assert_close(&outs[1], &want, 1e-5);
        }
        let dims = AttentionDims {
            num_heads: 2,
            num_kv_heads: 1,
            head_dim: 8,
            scale: 0.3,
        };
        let (q, k, v) = (
            random(&mut rng, &[1, 16]),
            random(&mut rng, &[1, 8]),
            random(&mut rng, &[1, 8]),
        );
        let mut mixed = (CpuTensor::f16_zeros(&[16, 3, 8]), pools(8).1);
        let seg = [Segment { start: 0, len: 1 }];
        let mut seq = Seq(vec![0], 0);
        assert!(run(&q, &k, &v, &dims, &seg, &mut mixed, &mut [&mut seq]).is_err());
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

        let mut pool = pools(16);
        let mut seq = Seq(vec![9, 2, 14, 5], 0);
        let seg = [Segment { start: 0, len: n }];
        let whole = run(&q, &k, &v, &dims, &seg, &mut pool, &mut [&mut seq]).unwrap();
        assert_close(&whole.to_f32_vec(), &want, 1e-5);
        assert_eq!(gather(&pool.0, &seq, n), k.to_f32_vec());

        // Chunks of 1, 3 and 5 through other blocks of the same pools give the same rows.
        let mut seq = Seq(vec![3, 0, 11], 0);
        let mut streamed = Vec::new();
        for range in [0..1, 1..4, 4..9] {
            let seg = [Segment {
                start: 0,
                len: range.len(),
            }];
            let part = run(
                &rows(&q, range.clone()),
                &rows(&k, range.clone()),
                &rows(&v, range),
                &dims,
                &seg,
                &mut pool,
                &mut [&mut seq],
            )
            .unwrap();
            streamed.extend(part.to_f32_vec());
        }
        assert_close(&streamed, &whole.to_f32_vec(), 1e-6);
        assert_eq!(gather(&pool.1, &seq, n), v.to_f32_vec());
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
        let mut pool = pools(16);
        let mut a = Seq(vec![4, 1], 0);
        let mut b = Seq(vec![7], 0);
        let mut c = Seq(vec![], 0);
        let seg = [Segment { start: 0, len: 2 }];
        run(
            &rows(&q, 4..6),
            &rows(&k, 4..6),
            &rows(&v, 4..6),
            &dims,
            &seg,
            &mut pool,
            &mut [&mut b],
        )
        .unwrap();
        let batch = [
            Segment { start: 0, len: 4 },
            Segment { start: 4, len: 1 },
            Segment { start: 5, len: 0 },
        ];
        let qb = [rows(&q, 0..4).to_f32_vec(), rows(&q, 6..7).to_f32_vec()].concat();
        let kb_new = [rows(&k, 0..4).to_f32_vec(), rows(&k, 6..7).to_f32_vec()].concat();
        let vb_new = [rows(&v, 0..4).to_f32_vec(), rows(&v, 6..7).to_f32_vec()].concat();
        let out = run(
            &CpuTensor::f32(&[5, 16], qb).unwrap(),
            &CpuTensor::f32(&[5, 16], kb_new).unwrap(),
            &CpuTensor::f32(&[5, 16], vb_new).unwrap(),
            &dims,
            &batch,
            &mut pool,
            &mut [&mut a, &mut b, &mut c],
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
        assert_eq!((a.1, b.1, c.1), (4, 3, 0));
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
        let mut pool = pools(6);
        let seg = [Segment { start: 0, len: n }];
        let out = run(
            &q,
            &k,
            &v,
            &dims,
            &seg,
            &mut pool,
            &mut [&mut Seq(vec![2], 0)],
        )
        .unwrap();
        for (i, &o) in out.to_f32_vec().iter().enumerate() {
            let head = i % 12 / 2;
            assert!((o - (head / 2 + 1) as f32).abs() < 1e-6, "head {head}: {o}");
        }
        let bad = AttentionDims {
            num_kv_heads: 4,
            ..dims
        };
        assert!(run(
            &q,
            &k,
            &v,
            &bad,
            &seg,
            &mut pool,
            &mut [&mut Seq(vec![2], 0)]
        )
        .is_err());
        let short = run(
            &q,
            &k,
            &v,
            &dims,
            &seg,
            &mut pool,
            &mut [&mut Seq(vec![], 0)],
        );
        assert!(
            short.is_err(),
            "a table too short for the tokens is refused"
        );
    }
}
