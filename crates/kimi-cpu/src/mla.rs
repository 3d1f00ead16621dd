//! Multi-head latent attention over a paged latent cache (spec §4).
//!
//! A layer's cache is one f32 pool `[num_blocks, block_size, r + rope]`; each row is a
//! token's normalised latent `c` followed by its shared key `k_pe`, and each sequence finds
//! its rows through its block table (`kimi_ops::PagedSeq`). Kimi Linear's MLA is NoPE, so
//! nothing is rotated.

use crate::attention::CacheValue;
use crate::fp8_cache;
use crate::paged::{write_rows, PagedRows};
use crate::simd::{add_scaled, dot};
use crate::tensor::{shape_err, CpuTensor, Storage};
use kimi_ops::{check_paged, check_segments};
use kimi_ops::{MlaDims, MlaMode, PagedSeq, Result, Segment};

/// See `Backend::mla`.
#[allow(clippy::too_many_arguments)]
pub fn mla(
    q: &CpuTensor,
    latent: &CpuTensor,
    kv_b: &CpuTensor,
    dims: &MlaDims,
    segments: &[Segment],
    pool: &mut CpuTensor,
    seqs: &[PagedSeq<'_>],
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
    check_segments("mla", segments, seqs.len(), n)?;
    let block_size = check_paged("mla", &pool.shape, lw, segments, seqs)?;
    // The absorbed form reads kv_b row by row as f32; the expanded one multiplies it as stored.
    let mut kvb = None;
    let (qs, ls) = (q.as_f32("mla")?, latent.as_f32("mla")?);
    // An FP8 pool (`--kv-cache-dtype fp8`) scales the latent and the rope key apart.
    if let Storage::Fp8Rows { split, .. } = &mut pool.storage {
        *split = r;
    }
    match &mut pool.storage {
        Storage::Fp8Rows { bytes, split } => {
            for (seg, seq) in segments.iter().zip(seqs) {
                let new_rows = &ls[seg.start * lw..(seg.start + seg.len) * lw];
                fp8_cache::write_rows(bytes, seq, block_size, lw, *split, new_rows);
            }
        }
        _ => {
            let pool_rows = pool.as_f32_mut("mla")?;
            for (seg, seq) in segments.iter().zip(seqs) {
                let new_rows = &ls[seg.start * lw..(seg.start + seg.len) * lw];
                write_rows(pool_rows, seq, block_size, lw, new_rows, |v| v);
            }
        }
    }
    let mut out = vec![0f32; n * h * dv];
    for (seg, seq) in segments.iter().zip(seqs) {
        if seg.len == 0 {
            continue;
        }
        let absorbed = match mode {
            MlaMode::Auto => seg.len == 1,
            MlaMode::Absorbed => true,
            MlaMode::Expanded => false,
        };
        // FP8 rows are widened once per call into one contiguous block.
        let visible = seq.num_cached + seg.len;
        let (gathered, one_block);
        let (rows_pool, rows_seq, rows_block) = match &pool.storage {
            Storage::Fp8Rows { bytes, split } => {
                gathered = fp8_cache::gather(bytes, seq, block_size, lw, *split, visible);
                one_block = [0u32];
                let flat = PagedSeq {
                    block_table: &one_block,
                    num_cached: seq.num_cached,
                };
                (&gathered[..], flat, visible.max(1))
            }
            _ => (pool.as_f32("mla")?, *seq, block_size),
        };
        let rows = PagedRows::new(rows_pool, &rows_seq, rows_block, lw);
        let seg_q = &qs[seg.start * qw..(seg.start + seg.len) * qw];
        let (past, new) = (seq.num_cached, seg.len);
        let seg_out = if absorbed {
            // An f16 kv_b (GGUF files) is read as stored: half the bytes of f32.
            if let Storage::F16(half) = &kv_b.storage {
                absorbed_attention(seg_q, rows, &half[..], dims, past, new)
            } else {
                let kvb = kvb.get_or_insert_with(|| kv_b.f32_values());
                absorbed_attention(seg_q, rows, &kvb[..], dims, past, new)
            }
        } else {
            expanded_attention(seg_q, rows, kv_b, dims, past, new)?
        };
        out[seg.start * h * dv..(seg.start + seg.len) * h * dv].copy_from_slice(&seg_out);
    }
    CpuTensor::f32(&[n, h * dv], out)
}

/// Reference form: decompress every cached latent into per-head keys and values.
fn expanded_attention(
    q: &[f32],
    cache: PagedRows<'_>,
    kv_b: &CpuTensor,
    dims: &MlaDims,
    past: usize,
    new: usize,
) -> Result<Vec<f32>> {
    let MlaDims {
        num_heads: h,
        kv_lora_rank: r,
        qk_nope_head_dim: dn,
        qk_rope_head_dim: dr,
        v_head_dim: dv,
        scale,
    } = *dims;
    let total = past + new;
    let per_head = dn + dv;
    // kv[s, h, :] = W_kvb[h] · c(s): [total, h, dn + dv], one matmul of the cached
    // latents by kv_b (the matmul's 4 × 4 tiles; a dot per value was 11 % of a prefill).
    let mut latents = Vec::with_capacity(total * r);
    for s in 0..total {
        latents.extend_from_slice(&cache.row(s)[..r]);
    }
    let kv = crate::matmul::matmul(
        &CpuTensor::f32(&[total, r], latents)?,
        kv_b,
        crate::matmul::QuantMatmul::F32,
    )?
    .to_f32_vec();
    let head_out: Vec<Vec<f32>> = crate::team().map(h, |head| {
        let mut o = vec![0f32; new * dv];
        let mut scores = vec![0f32; total];
        for t in 0..new {
            let qt = &q[(t * h + head) * (dn + dr)..(t * h + head + 1) * (dn + dr)];
            let visible = past + t + 1;
            for (s, score) in scores.iter_mut().enumerate().take(visible) {
                let k = &kv[(s * h + head) * per_head..(s * h + head) * per_head + dn];
                let kpe = &cache.row(s)[r..];
                *score = (dot(&qt[..dn], k) + dot(&qt[dn..], kpe)) * scale;
            }
            softmax(&mut scores[..visible]);
            let ot = &mut o[t * dv..(t + 1) * dv];
            for (s, &p) in scores.iter().enumerate().take(visible) {
                let v = &kv[(s * h + head) * per_head + dn..(s * h + head + 1) * per_head];
                add_scaled(ot, p, v);
            }
        }
        o
    });
    Ok(interleave_heads(&head_out, new, h, dv))
}

/// Absorbed form: queries move into the latent space, attention runs over the raw cache.
fn absorbed_attention<V: CacheValue>(
    q: &[f32],
    cache: PagedRows<'_>,
    kvb: &[V],
    dims: &MlaDims,
    past: usize,
    new: usize,
) -> Vec<f32> {
    let MlaDims {
        num_heads: h,
        kv_lora_rank: r,
        qk_nope_head_dim: dn,
        qk_rope_head_dim: dr,
        v_head_dim: dv,
        scale,
    } = *dims;
    let total = past + new;
    let per_head = dn + dv;
    let head_out: Vec<Vec<f32>> = crate::team().map(h, |head| {
        let w_uk = &kvb[head * per_head * r..(head * per_head + dn) * r];
        let w_uv = &kvb[(head * per_head + dn) * r..(head + 1) * per_head * r];
        let mut o = vec![0f32; new * dv];
        let mut scores = vec![0f32; total];
        let mut q_lat = vec![0f32; r];
        let mut o_lat = vec![0f32; r];
        for t in 0..new {
            let qt = &q[(t * h + head) * (dn + dr)..(t * h + head + 1) * (dn + dr)];
            q_lat.iter_mut().for_each(|x| *x = 0.0);
            V::add_scaled_strided(&mut q_lat, &qt[..dn], w_uk, r);
            let visible = past + t + 1;
            for (score, row) in scores[..visible].iter_mut().zip(cache.first(visible)) {
                *score = (dot(&q_lat, &row[..r]) + dot(&qt[dn..], &row[r..])) * scale;
            }
            softmax(&mut scores[..visible]);
            o_lat.iter_mut().for_each(|x| *x = 0.0);
            for (&p, row) in scores[..visible].iter().zip(cache.first(visible)) {
                add_scaled(&mut o_lat, p, &row[..r]);
            }
            V::dot_strided(&o_lat, w_uv, r, &mut o[t * dv..(t + 1) * dv]);
        }
        o
    });
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

    const DIMS: MlaDims = MlaDims {
        num_heads: 3,
        kv_lora_rank: 10,
        qk_nope_head_dim: 6,
        qk_rope_head_dim: 4,
        v_head_dim: 5,
        scale: 0.3,
    };
    const LW: usize = 14;

    fn f(i: usize, m: usize) -> f32 {
        ((i * m % 29) as f32 - 14.0) * 0.05
    }

    /// Queries and latents of `n` tokens (`salt` varies them) and `kv_b`.
    fn inputs(n: usize, salt: usize) -> (CpuTensor, CpuTensor, CpuTensor) {
        let q = CpuTensor::f32(&[n, 30], (0..n * 30).map(|i| f(i + salt, 7)).collect());
        let lat = CpuTensor::f32(&[n, LW], (0..n * LW).map(|i| f(i + salt, 11)).collect());
        let kvb = CpuTensor::f32(&[3 * 11, 10], (0..330).map(|i| f(i, 13)).collect());
        (q.unwrap(), lat.unwrap(), kvb.unwrap())
    }

    fn rows(t: &CpuTensor, range: std::ops::Range<usize>) -> CpuTensor {
        let w = t.shape[1];
        let data = t.to_f32_vec()[range.start * w..range.end * w].to_vec();
        CpuTensor::f32(&[range.len(), w], data).unwrap()
    }

    /// A pool of `num_blocks` blocks full of NaN: reading a row never written poisons the
    /// output.
    fn nan_pool(num_blocks: usize, block_size: usize) -> CpuTensor {
        let n = num_blocks * block_size * LW;
        CpuTensor::f32(&[num_blocks, block_size, LW], vec![f32::NAN; n]).unwrap()
    }

    /// Feeds one sequence's `n` tokens in chunks of `steps` (cycled) through `table`.
    fn stream(
        n: usize,
        salt: usize,
        pool: &mut CpuTensor,
        table: &[u32],
        steps: &[usize],
        mode: MlaMode,
    ) -> Vec<f32> {
        let (q, lat, kvb) = inputs(n, salt);
        let mut out = Vec::new();
        let (mut done, mut k) = (0, 0);
        while done < n {
            let len = steps[k % steps.len()].min(n - done);
            let seg = [Segment { start: 0, len }];
            let seq = [PagedSeq {
                block_table: table,
                num_cached: done,
            }];
            let (qc, lc) = (rows(&q, done..done + len), rows(&lat, done..done + len));
            let o = mla(&qc, &lc, &kvb, &DIMS, &seg, pool, &seq, mode).unwrap();
            out.extend(o.to_f32_vec());
            done += len;
            k += 1;
        }
        out
    }

    #[test]
    fn absorbed_equals_expanded() {
        let n = 7;
        let mut outs = vec![];
        for mode in [MlaMode::Expanded, MlaMode::Absorbed] {
            let mut pool = nan_pool(1, n);
            outs.push(stream(n, 0, &mut pool, &[0], &[n], mode));
        }
        for (a, b) in outs[0].iter().zip(&outs[1]) {
            assert!((a - b).abs() < 1e-5, "{a} {b}");
        }
    }

    /// Scattered, out-of-order blocks whose size does not divide the prompt give exactly
    /// the results of one contiguous block, in both forms and in every feed.
    #[test]
    fn scattered_block_tables_match_one_contiguous_block() {
        let n = 11;
        for mode in [MlaMode::Expanded, MlaMode::Absorbed, MlaMode::Auto] {
            let mut flat = nan_pool(1, n);
            let want = stream(n, 3, &mut flat, &[0], &[n], mode);
            for steps in [&[n][..], &[4, 1, 2], &[1]] {
                let mut pool = nan_pool(9, 3);
                let got = stream(n, 3, &mut pool, &[7, 2, 8, 0], steps, mode);
                if steps.len() == 1 && steps[0] == n {
                    assert_eq!(got, want, "{mode:?}");
                } else {
                    for (a, b) in got.iter().zip(&want) {
                        assert!((a - b).abs() < 1e-5, "{mode:?} {steps:?}: {a} {b}");
                    }
                }
                assert!(got.iter().all(|x| x.is_finite()));
            }
        }
    }

    /// Two sequences share a pool in one call; then the first is freed and a third reuses
    /// its blocks (stale rows included) and sees only its own rows.
    #[test]
    fn sequences_share_a_pool_and_reused_blocks_hold_no_stale_rows() {
        let alone = |n: usize, salt: usize| {
            let mut pool = nan_pool(1, n);
            stream(n, salt, &mut pool, &[0], &[n], MlaMode::Expanded)
        };
        let mut pool = nan_pool(8, 2);
        let (qa, la, kvb) = inputs(5, 1);
        let (qb, lb, _) = inputs(3, 2);
        let cat = |a: &CpuTensor, b: &CpuTensor| {
            let mut v = a.to_f32_vec();
            v.extend(b.to_f32_vec());
            CpuTensor::f32(&[a.shape[0] + b.shape[0], a.shape[1]], v).unwrap()
        };
        let segs = [Segment { start: 0, len: 5 }, Segment { start: 5, len: 3 }];
        let seqs = [
            PagedSeq {
                block_table: &[6, 1, 4],
                num_cached: 0,
            },
            PagedSeq {
                block_table: &[0, 5],
                num_cached: 0,
            },
        ];
        let out = mla(
            &cat(&qa, &qb),
            &cat(&la, &lb),
            &kvb,
            &DIMS,
            &segs,
            &mut pool,
            &seqs,
            MlaMode::Expanded,
        )
        .unwrap()
        .to_f32_vec();
        let w = 3 * 5;
        assert_eq!(out[..5 * w], alone(5, 1)[..]);
        assert_eq!(out[5 * w..], alone(3, 2)[..]);
        // Sequence A is gone; C takes its blocks 4 and 1 (in that order) for 3 tokens.
        let got = stream(3, 9, &mut pool, &[4, 1], &[2, 1], MlaMode::Auto);
        let mut fresh = nan_pool(1, 3);
        let want = stream(3, 9, &mut fresh, &[0], &[2, 1], MlaMode::Auto);
        assert_eq!(got, want);
    }

    /// An f16 kv_b is read as stored: the absorbed form gives the results of the same
    /// values widened to f32, bit for bit.
    #[test]
    fn f16_kv_b_equals_its_widened_values() {
        let (q, lat, kvb) = inputs(5, 4);
        let halves: Vec<u16> = kvb
            .to_f32_vec()
            .iter()
            .map(|&v| half::f16::from_f32(v).to_bits())
            .collect();
        let widened = halves.iter().map(|&h| half::f16::from_bits(h).to_f32());
        let widened = CpuTensor::f32(&kvb.shape, widened.collect()).unwrap();
        let half = CpuTensor::new(kvb.shape.clone(), Storage::F16(halves.into()));
        let seg = [Segment { start: 0, len: 5 }];
        let seq = [PagedSeq {
            block_table: &[0],
            num_cached: 0,
        }];
        let run = |w: &CpuTensor| {
            let mut pool = nan_pool(1, 5);
            let mode = MlaMode::Absorbed;
            let o = mla(&q, &lat, w, &DIMS, &seg, &mut pool, &seq, mode).unwrap();
            o.to_f32_vec()
        };
        assert_eq!(run(&half), run(&widened));
    }

    #[test]
    fn short_block_tables_and_foreign_blocks_are_refused() {
        let (q, lat, kvb) = inputs(5, 0);
        let seg = [Segment { start: 0, len: 5 }];
        let mut pool = nan_pool(4, 2);
        for table in [&[0u32, 1][..], &[0, 1, 4]] {
            let seq = [PagedSeq {
                block_table: table,
                num_cached: 0,
            }];
            let e = mla(&q, &lat, &kvb, &DIMS, &seg, &mut pool, &seq, MlaMode::Auto);
            assert!(e.is_err(), "{table:?}");
        }
    }
}
