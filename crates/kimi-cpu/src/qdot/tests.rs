use super::*;
use kimi_gguf::GgmlType;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

const KINDS: [Kind; 8] = [
    Kind::Q4_0,
    Kind::Q4_1,
    Kind::Q5_0,
    Kind::Q8_0,
    Kind::Q4K,
    Kind::Q5K,
    Kind::Q6K,
    Kind::Mxfp4,
];

fn ggml(kind: Kind) -> GgmlType {
    match kind {
        Kind::Q4_0 => GgmlType::Q4_0,
        Kind::Q4_1 => GgmlType::Q4_1,
        Kind::Q5_0 => GgmlType::Q5_0,
        Kind::Q8_0 => GgmlType::Q8_0,
        Kind::Q4K => GgmlType::Q4_K,
        Kind::Q5K => GgmlType::Q5_K,
        Kind::Q6K => GgmlType::Q6_K,
        Kind::Mxfp4 => GgmlType::MXFP4,
    }
}

fn f16_bits(v: f32) -> [u8; 2] {
    half::f16::from_f32(v).to_bits().to_le_bytes()
}

/// Column counts per kind: one block, a few, and the demo model's 576 / 1536.
fn widths(kind: Kind) -> &'static [usize] {
    match kind {
        Kind::Q4K | Kind::Q5K | Kind::Q6K => &[256, 512, 1536],
        Kind::Q4_0 | Kind::Q4_1 | Kind::Q5_0 | Kind::Q8_0 | Kind::Mxfp4 => {
            &[32, 96, 128, 576, 1536]
        }
    }
}

#[test]
fn the_rounding_trick_rounds_ties_to_even() {
    let mut rng = ChaCha8Rng::seed_from_u64(9);
    let mut ys: Vec<f32> = (-300..=300).map(|i| i as f32 * 0.5).collect();
    ys.extend((0..10_000).map(|_| rng.random_range(-128.0f32..128.0)));
    for y in ys {
        assert_eq!((y + ROUNDER) - ROUNDER, y.round_ties_even(), "{y}");
    }
}

#[test]
fn quantized_activations_are_within_half_a_step() {
    let mut rng = ChaCha8Rng::seed_from_u64(1);
    let (n, k) = (3, 96);
    let mut xs: Vec<f32> = (0..n * k).map(|_| rng.random_range(-3.0..3.0)).collect();
    xs[32..64].fill(0.0); // an all-zero block
    xs[64] = 1e-30; // a tiny one
    let a = Q8Acts::quantize(&xs, n, k);
    assert_eq!((a.n, a.k, a.blocks()), (n, k, 3));
    for (b, x) in xs.chunks_exact(QK).enumerate() {
        let q = &a.qs[b * QK..(b + 1) * QK];
        // The step is the unrounded scale; the stored one is its f16 rounding.
        let step = x.iter().fold(0f32, |m, v| m.max(v.abs())) / 127.0;
        let d = a.d[b];
        assert_eq!(d, half::f16::from_f32(step).to_f32());
        for (v, &qv) in x.iter().zip(q) {
            assert!((-127..=127).contains(&qv));
            assert!(
                (v - f32::from(qv) * step).abs() <= step * 0.5 * (1.0 + 1e-6),
                "{v}"
            );
        }
        let s: i32 = q.iter().map(|&v| i32::from(v)).sum();
        assert_eq!(a.sum[b], d * s as f32);
        assert_eq!(a.sum_f16[b], half::f16::from_f32(step * s as f32).to_f32());
        // The block's largest value maps to ±127.
        assert!(d == 0.0 || q.iter().any(|v| v.abs() == 127));
    }
    assert_eq!(a.d[1], 0.0);
    assert!(a.qs[32..64].iter().all(|&q| q == 0));
}

/// Weight rows with random quant bits but power-of-two scales and small activations, so
/// that every product and partial sum is exact in f32: then every variant must return
/// exactly the scalar kernel's result (this checks the integer parts bit for bit).
fn exact_case(
    kind: Kind,
    rows: usize,
    n: usize,
    k: usize,
    rng: &mut ChaCha8Rng,
) -> (Vec<u8>, Q8Acts) {
    let pow2 = |rng: &mut ChaCha8Rng, lo: i32, hi: i32| 2f32.powi(rng.random_range(lo..=hi));
    let mut w = vec![0u8; rows * kind.row_bytes(k)];
    for blk in w.chunks_exact_mut(kind.block_bytes()) {
        rng.fill(blk);
        match kind {
            Kind::Q4_1 | Kind::Q4K | Kind::Q5K => {
                blk[..2].copy_from_slice(&f16_bits(pow2(rng, -2, -1)));
                blk[2..4].copy_from_slice(&f16_bits(pow2(rng, -2, -1)));
            }
            Kind::Q8_0 => {
                blk[..2].copy_from_slice(&f16_bits(pow2(rng, -2, -1)));
                for q in &mut blk[2..] {
                    *q = (rng.random_range(-4i8..=4)) as u8;
                }
            }
            Kind::Q4_0 | Kind::Q5_0 => blk[..2].copy_from_slice(&f16_bits(pow2(rng, -2, -1))),
            Kind::Q6K => {
                // Small scales of both signs keep every partial sum exact in f32.
                for sc in &mut blk[192..208] {
                    *sc = (rng.random_range(-8i8..=8)) as u8;
                }
                blk[208..].copy_from_slice(&f16_bits(pow2(rng, -2, -1)));
            }
            // Half scales 2^-2 and 2^-1, as the others'.
            Kind::Mxfp4 => blk[0] = rng.random_range(126..=127),
        }
    }
    let nb = k / QK;
    let mut x = Q8Acts {
        n,
        k,
        qs: (0..n * k).map(|_| rng.random_range(-4i8..=4)).collect(),
        d: (0..n * nb).map(|_| pow2(rng, -3, -2)).collect(),
        sum: vec![0.0; n * nb],
        sum_f16: vec![0.0; n * nb],
        isum: vec![0; n * nb],
        isum16: vec![0; 2 * n * nb],
    };
    for b in 0..n * nb {
        let s: i32 = x.qs[b * QK..(b + 1) * QK]
            .iter()
            .map(|&v| i32::from(v))
            .sum();
        x.sum[b] = x.d[b] * s as f32;
        // Exact in f16 too (|s| ≤ 128, a power-of-two scale).
        x.sum_f16[b] = x.sum[b];
        x.isum[b] = s;
        for h in 0..2 {
            x.isum16[2 * b + h] = x.qs[b * QK + 16 * h..b * QK + 16 * h + 16]
                .iter()
                .map(|&v| i32::from(v))
                .sum();
        }
    }
    (w, x)
}

/// A multiplication under test: the row-major kernels or the interleaved ones (which
/// interleave the row-major weights first).
type Multiply = fn(Isa, Kind, &[u8], &Q8Acts, &mut [f32]);

fn row_major(isa: Isa, kind: Kind, w: &[u8], x: &Q8Acts, out: &mut [f32]) {
    matmul_rows_with(isa, kind, w, x, out)
}

fn interleaved(isa: Isa, kind: Kind, w: &[u8], x: &Q8Acts, out: &mut [f32]) {
    let packed = groups::interleave(kind, w, x.k);
    groups::matmul_groups_with(isa, kind, &packed, x, out)
}

/// Every variant of `multiply` on exact values (see [`exact_case`]) equals the row-major
/// scalar kernel bit for bit, for `(tokens, rows)` in `cases`.
fn check_exact(kinds: &[Kind], cases: &[(usize, usize)], seed: u64, multiply: Multiply) {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    for &kind in kinds {
        for &k in widths(kind) {
            for &(n, rows) in cases {
                let (w, x) = exact_case(kind, rows, n, k, &mut rng);
                let mut want = vec![0f32; rows * n];
                matmul_rows_with(Isa::Scalar, kind, &w, &x, &mut want);
                for isa in Isa::available() {
                    let mut got = vec![f32::NAN; rows * n];
                    multiply(isa, kind, &w, &x, &mut got);
                    let same = got
                        .iter()
                        .zip(&want)
                        .all(|(a, b)| a.to_bits() == b.to_bits());
                    assert!(same, "{kind:?} {isa:?} k={k} n={n}: {got:?} vs {want:?}");
                }
            }
        }
    }
}

/// On general values every variant of `multiply` differs from the row-major scalar kernel
/// only by the order of f32 additions of per-block results: 1e-5 of the sum of magnitudes.
fn check_random(kinds: &[Kind], cases: &[(usize, usize)], seed: u64, multiply: Multiply) {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    for &kind in kinds {
        for &k in widths(kind) {
            for &(n, rows) in cases {
                let (bytes, wd, xs) = random_case(kind, rows, n, k, &mut rng);
                check_near_scalar(kind, multiply, &bytes, &wd, &xs, k);
            }
        }
    }
}

/// Every variant of `multiply` on weights `w` (dequantized: `wd`, rows of `k`) and tokens
/// `xs` within 1e-5 of each product's sum of magnitudes of the row-major scalar kernel.
fn check_near_scalar(kind: Kind, multiply: Multiply, w: &[u8], wd: &[f32], xs: &[f32], k: usize) {
    let (rows, n) = (wd.len() / k, xs.len() / k);
    let x = Q8Acts::quantize(xs, n, k);
    let mut want = vec![0f32; rows * n];
    matmul_rows_with(Isa::Scalar, kind, w, &x, &mut want);
    for isa in Isa::available() {
        let mut got = vec![0f32; rows * n];
        multiply(isa, kind, w, &x, &mut got);
        for r in 0..rows {
            for t in 0..n {
                let magnitude: f32 = (0..k).map(|i| (wd[r * k + i] * xs[t * k + i]).abs()).sum();
                let (a, b) = (got[r * n + t], want[r * n + t]);
                assert!(
                    (a - b).abs() <= 1e-5 * magnitude,
                    "{kind:?} {isa:?} k={k} n={n} row {r} token {t}: {a} vs {b}"
                );
            }
        }
    }
}

/// Row counts around the tile heights (1, 2 and 4 rows) and their tails.
#[test]
fn every_variant_equals_scalar_bit_for_bit_on_exact_values() {
    let cases = [(1, 3), (1, 9), (2, 6), (3, 3), (4, 5), (5, 4), (9, 7)];
    check_exact(&KINDS, &cases, 2, row_major);
}

/// Random weights quantized by `kimi-gguf` (the reference format) and random activations.
fn random_case(
    kind: Kind,
    rows: usize,
    n: usize,
    k: usize,
    rng: &mut ChaCha8Rng,
) -> (Vec<u8>, Vec<f32>, Vec<f32>) {
    let w: Vec<f32> = (0..rows * k).map(|_| rng.random_range(-1.0..1.0)).collect();
    let bytes = kimi_gguf::quantize(ggml(kind), &w).expect("quantizes");
    let wd = kimi_gguf::dequantize(ggml(kind), &bytes, w.len()).expect("dequantizes");
    let xs: Vec<f32> = (0..n * k)
        .map(|i| rng.random_range(-2.0..2.0) * if i % 7 == 0 { 4.0 } else { 1.0 })
        .collect();
    (bytes, wd, xs)
}

/// The scalar kernel against dequantize-then-f64-dot: the only difference allowed is the
/// rounding of the activations, at most half a step `s = max|x| / 127` plus the f16
/// rounding of the stored scale `d` per value, so `|error| ≤ Σ |w_i| · (s / 2 + |q_i| ·
/// |s − d|)`, and for Q4_1 the f16 rounding of ggml's Q8_1 sum that its min multiplies
/// (`Σ_blocks |m| · |sum_f16 − d·Σq|`), plus f32 rounding of the sums (1e-5 relative).
#[test]
fn scalar_equals_dequantized_product_within_the_activation_rounding() {
    let mut rng = ChaCha8Rng::seed_from_u64(3);
    for kind in KINDS {
        for &k in widths(kind) {
            let (rows, n) = (4, 3);
            let (bytes, wd, xs) = random_case(kind, rows, n, k, &mut rng);
            let x = Q8Acts::quantize(&xs, n, k);
            let mut got = vec![0f32; rows * n];
            matmul_rows_with(Isa::Scalar, kind, &bytes, &x, &mut got);
            for r in 0..rows {
                for t in 0..n {
                    let (wr, xr) = (&wd[r * k..(r + 1) * k], &xs[t * k..(t + 1) * k]);
                    let exact: f64 = wr
                        .iter()
                        .zip(xr)
                        .map(|(a, b)| f64::from(*a) * f64::from(*b))
                        .sum();
                    let magnitude: f64 = wr
                        .iter()
                        .zip(xr)
                        .map(|(a, b)| f64::from((a * b).abs()))
                        .sum();
                    let nb = k / QK;
                    let step = |b: usize| {
                        let blk = &xr[b * QK..(b + 1) * QK];
                        f64::from(blk.iter().fold(0f32, |m, v| m.max(v.abs())) / 127.0)
                    };
                    let mut bound: f64 = wr
                        .iter()
                        .enumerate()
                        .map(|(i, a)| {
                            let (b, q) = (i / QK, f64::from(x.qs[t * k + i]));
                            let d = f64::from(x.d[t * nb + b]);
                            f64::from(a.abs()) * (step(b) / 2.0 + q.abs() * (step(b) - d).abs())
                        })
                        .sum();
                    if kind == Kind::Q4_1 {
                        let row = &bytes[r * kind.row_bytes(k)..];
                        bound += (0..nb)
                            .map(|b| {
                                let m = f64::from(f16_at(row, b * 20 + 2)).abs();
                                let exact =
                                    f64::from(x.d[t * nb + b]) * f64::from(x.isum[t * nb + b]);
                                m * (f64::from(x.sum_f16[t * nb + b]) - exact).abs()
                            })
                            .sum::<f64>();
                    }
                    let err = (f64::from(got[r * n + t]) - exact).abs();
                    assert!(
                        err <= bound * (1.0 + 1e-5) + 1e-5 * magnitude,
                        "{kind:?} k={k}: error {err} > bound {bound}"
                    );
                }
            }
        }
    }
}

#[test]
fn every_variant_matches_scalar_on_random_values() {
    let cases = [(1, 5), (1, 8), (2, 9), (4, 5), (7, 6)];
    check_random(&KINDS, &cases, 4, row_major);
}

#[test]
fn the_best_variant_is_one_of_the_available_ones() {
    let all = Isa::available();
    assert_eq!(all[0], Isa::Scalar);
    assert_eq!(Isa::best(), *all.last().expect("scalar at least"));
    assert_eq!(Kind::of(DType::Q4_K), Some(Kind::Q4K));
    assert_eq!(Kind::of(DType::Q6_K), Some(Kind::Q6K));
    assert_eq!(Kind::of(DType::Q5_1), None);
    assert_eq!(Kind::Q6K.row_bytes(512), 2 * 210);
    assert_eq!(Kind::Q4_1.row_bytes(576), 18 * 20);
    assert_eq!(Kind::of(DType::MXFP4), Some(Kind::Mxfp4));
    assert_eq!(Kind::Mxfp4.row_bytes(448), 14 * 17);
}

/// The quantizer's vector-friendly form equals the plain one (per block: a serial `max`
/// fold, then round through ±1.5·2^23 in f32 and a saturating cast) bit for bit, ties,
/// zeros, subnormals and non-finite values included.
#[test]
fn quantize_equals_the_plain_form() {
    fn plain(xs: &[f32]) -> (Vec<i8>, Vec<f32>, Vec<f32>, Vec<f32>) {
        let f16 = |v: f32| half::f16::from_f32(v).to_f32();
        let (mut qs, mut d, mut sum, mut sum16) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for x in xs.chunks_exact(QK) {
            let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
            let db = amax / 127.0;
            let id = if amax > 0.0 { 127.0 / amax } else { 0.0 };
            let mut s = 0i32;
            for v in x {
                let r = ((v * id + ROUNDER) - ROUNDER).clamp(-127.0, 127.0) as i8;
                qs.push(r);
                s += i32::from(r);
            }
            d.push(f16(db));
            sum.push(f16(db) * s as f32);
            sum16.push(f16(db * s as f32));
        }
        (qs, d, sum, sum16)
    }
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    let mut rng = ChaCha8Rng::seed_from_u64(7);
    let mut blocks: Vec<Vec<f32>> = Vec::new();
    // Random magnitudes over many octaves.
    for _ in 0..200 {
        let scale = 2f32.powi(rng.random_range(-30..30));
        blocks.push(
            (0..QK)
                .map(|_| rng.random_range(-1.0..1.0) * scale)
                .collect(),
        );
    }
    // Exact ties: with amax 127, v·id lands on halves.
    blocks.push(
        (0..QK)
            .map(|i| if i == 0 { 127.0 } else { i as f32 - 15.5 })
            .collect(),
    );
    blocks.push(vec![0.0; QK]);
    blocks.push(
        (0..QK)
            .map(|i| if i % 2 == 0 { -0.0 } else { 0.0 })
            .collect(),
    );
    blocks.push((0..QK).map(|i| f32::from_bits(i as u32 + 1)).collect());
    for special in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY, f32::MAX] {
        let mut b: Vec<f32> = (0..QK).map(|i| i as f32 * 0.25 - 4.0).collect();
        b[5] = special;
        blocks.push(b);
        blocks.push(vec![special; QK]);
    }
    let xs: Vec<f32> = blocks.concat();
    let a = Q8Acts::quantize(&xs, 1, xs.len());
    let (qs, d, sum, sum16) = plain(&xs);
    assert_eq!(a.qs, qs);
    assert_eq!(bits(&a.d), bits(&d));
    assert_eq!(bits(&a.sum), bits(&sum));
    assert_eq!(bits(&a.sum_f16), bits(&sum16));
}

const GROUPED: [Kind; 6] = [
    Kind::Q4_0,
    Kind::Q4_1,
    Kind::Q8_0,
    Kind::Q4K,
    Kind::Q6K,
    Kind::Mxfp4,
];

#[test]
fn interleaving_keeps_every_block() {
    let mut rng = ChaCha8Rng::seed_from_u64(11);
    for kind in GROUPED {
        let (rows, k) = (37, 512);
        let mut w = vec![0u8; rows * kind.row_bytes(k)];
        rng.fill(&mut w[..]);
        let packed = groups::interleave(kind, &w, k);
        assert_eq!(packed.len(), 3 * groups::group_bytes(kind, k));
        let (bb, nb) = (kind.block_bytes(), k / kind.block_values());
        let mut blk = [0u8; 256];
        for r in 0..rows {
            for b in 0..nb {
                groups::block_at(kind, &packed, nb, r, b, &mut blk);
                assert_eq!(
                    &blk[..bb],
                    &w[(r * nb + b) * bb..][..bb],
                    "{kind:?} row {r} block {b}"
                );
            }
        }
    }
}

/// The interleaved kernels, for token counts around the 4-token passes and partial last
/// groups.
#[test]
fn interleaved_kernels_equal_scalar_bit_for_bit_on_exact_values() {
    let cases = [
        (1, 16),
        (1, 37),
        (2, 32),
        (3, 20),
        (4, 16),
        (5, 33),
        (9, 16),
    ];
    check_exact(&GROUPED, &cases, 12, interleaved);
}

#[test]
fn interleaved_kernels_match_scalar_on_random_values() {
    let cases = [(1, 16), (1, 21), (2, 32), (4, 16), (7, 40)];
    check_random(&GROUPED, &cases, 13, interleaved);
}

/// Extreme levels: every quant byte 0x00, 0x7F, 0x80 or 0xFF (nibbles 0 or 15, Q8_0's −128
/// and 127, Q6_K's 0 and 63; MXFP4's codes 7 and 15, ±6, and 0x77, +6 in both nibbles, the
/// largest biased operand), the largest scales of both signs, and activations of ±127
/// in long runs. A 16-bit pair sum that saturated (as `vpmaddubsw` does above 2^15) would
/// be off by thousands of steps, far beyond the summation-order tolerance.
#[test]
fn kernels_do_not_saturate_on_extreme_values() {
    let mut rng = ChaCha8Rng::seed_from_u64(14);
    let kinds = [
        Kind::Q4_0,
        Kind::Q4_1,
        Kind::Q8_0,
        Kind::Q4K,
        Kind::Q6K,
        Kind::Mxfp4,
    ];
    let (rows, n, k) = (32, 3, 512);
    for kind in kinds {
        let mut w = vec![0u8; rows * kind.row_bytes(k)];
        for blk in w.chunks_exact_mut(kind.block_bytes()) {
            blk.fill([0x00, 0x7F, 0x80, 0xFF, 0x77][rng.random_range(0..5)]);
            let one = f16_bits(1.0);
            match kind {
                Kind::Q6K => {
                    for sc in &mut blk[192..208] {
                        *sc = [0x7F, 0x80, 0x01][rng.random_range(0..3)];
                    }
                    blk[208..].copy_from_slice(&one);
                }
                Kind::Q4_1 | Kind::Q4K => {
                    blk[..2].copy_from_slice(&one);
                    blk[2..4].copy_from_slice(&one);
                }
                Kind::Mxfp4 => blk[0] = 127,
                _ => blk[..2].copy_from_slice(&one),
            }
        }
        let wd = kimi_gguf::dequantize(ggml(kind), &w, rows * k).expect("dequantizes");
        // Runs of +1 and −1 (quantized to ±127), changing sign every 64 values per token.
        let xs: Vec<f32> = (0..n * k)
            .map(|i| if (i / 64 + i / k) % 2 == 0 { 1.0 } else { -1.0 })
            .collect();
        for multiply in [row_major as Multiply, interleaved] {
            check_near_scalar(kind, multiply, &w, &wd, &xs, k);
        }
    }
}

/// The MXFP4 integer form is the dequantized one: doubled codes are twice `kimi-gguf`'s E2M1
/// values (−0 as 0) and half scales half its E8M0 scales, bit for bit, subnormals included.
#[test]
fn mxfp4_doubled_codes_and_half_scales_match_kimi_gguf() {
    use kimi_gguf::mxfp4::{e8m0_to_f32, E2M1};
    for (c, &v) in MXFP4_DOUBLED.iter().enumerate() {
        assert_eq!(f32::from(v), 2.0 * E2M1[c], "code {c}");
    }
    for e in 0..=254u8 {
        let want = e8m0_to_f32(e) * 0.5;
        assert_eq!(mxfp4_half_scale(e).to_bits(), want.to_bits(), "e8m0 {e}");
    }
}

/// Activations from given quants and block scales, with their sums.
fn acts(n: usize, k: usize, qs: Vec<i8>, d: Vec<f32>) -> Q8Acts {
    let nb = k / QK;
    let isum: Vec<i32> = qs
        .chunks_exact(QK)
        .map(|q| q.iter().map(|&v| i32::from(v)).sum())
        .collect();
    let isum16 = qs
        .chunks_exact(QK / 2)
        .map(|q| q.iter().map(|&v| i32::from(v)).sum())
        .collect();
    let sum: Vec<f32> = isum.iter().zip(&d).map(|(&s, &d)| d * s as f32).collect();
    let sum_f16 = sum.iter().map(|&s| round_f16(s)).collect();
    assert_eq!(d.len(), n * nb);
    Q8Acts {
        n,
        k,
        qs,
        d,
        sum,
        sum_f16,
        isum,
        isum16,
    }
}

/// MXFP4 rows at the ends of the E8M0 range (scale bytes 0 and 1, whose halves are f32
/// subnormals, and 251..=254), with negative-zero codes (whole blocks of 0x88, and single
/// nibbles) and the largest codes: every variant, row-major and interleaved, equals the
/// scalar kernel bit for bit, and the scalar kernel equals the exact product (activation
/// scales are chosen so that every product and sum is exact in f32).
#[test]
fn mxfp4_kernels_equal_scalar_at_extreme_scales() {
    let mut rng = ChaCha8Rng::seed_from_u64(21);
    let kind = Kind::Mxfp4;
    for (scales, x_exp) in [(0u8..=3, 18..=20), (251..=254, -122..=-120)] {
        for &k in &[32usize, 96, 448, 512] {
            for &(n, rows) in &[(1usize, 5usize), (1, 16), (2, 37), (5, 16)] {
                let mut w = vec![0u8; rows * kind.row_bytes(k)];
                for blk in w.chunks_exact_mut(17) {
                    match rng.random_range(0..4) {
                        0 => blk[1..].fill(0x88),
                        1 => blk[1..].fill([0x77, 0xFF, 0x7F, 0xF7][rng.random_range(0..4)]),
                        _ => rng.fill(&mut blk[1..]),
                    }
                    blk[0] = rng.random_range(scales.clone());
                }
                let nb = k / QK;
                let qs = (0..n * k).map(|_| rng.random_range(-127i8..=127)).collect();
                let d = (0..n * nb)
                    .map(|_| 2f32.powi(rng.random_range(x_exp.clone())))
                    .collect();
                let x = acts(n, k, qs, d);
                let mut want = vec![0f32; rows * n];
                matmul_rows_with(Isa::Scalar, kind, &w, &x, &mut want);
                for r in 0..rows {
                    for t in 0..n {
                        let exact: f64 = (0..k)
                            .map(|i| {
                                let blk = &w[(r * nb + i / QK) * 17..][..17];
                                let j = i % QK;
                                let code = if j < 16 {
                                    blk[1 + j] & 0xF
                                } else {
                                    blk[1 + j - 16] >> 4
                                };
                                f64::from(MXFP4_DOUBLED[usize::from(code)])
                                    * f64::from(x.qs[t * k + i])
                                    * f64::from(mxfp4_half_scale(blk[0]))
                                    * f64::from(x.d[t * nb + i / QK])
                            })
                            .sum();
                        assert_eq!(f64::from(want[r * n + t]), exact, "k={k} row {r}");
                    }
                }
                for isa in Isa::available() {
                    for multiply in [row_major as Multiply, interleaved] {
                        let mut got = vec![f32::NAN; rows * n];
                        multiply(isa, kind, &w, &x, &mut got);
                        let same = got
                            .iter()
                            .zip(&want)
                            .all(|(a, b)| a.to_bits() == b.to_bits());
                        assert!(same, "{isa:?} k={k} n={n} rows={rows}: {got:?} vs {want:?}");
                    }
                }
            }
        }
    }
}

/// MXFP4 rows whose scale bytes span 0..=200 (values from 2^-128 to 2^73) and quantized
/// random activations: every variant within the summation-order tolerance of the scalar
/// kernel, the magnitude taken in f64 from the doubled codes (the f32 dequantization of the
/// largest would not matter here, but keeps no subnormal).
#[test]
fn mxfp4_kernels_match_scalar_across_the_scale_range() {
    let mut rng = ChaCha8Rng::seed_from_u64(22);
    let kind = Kind::Mxfp4;
    for &k in &[64usize, 448, 512] {
        for &(n, rows) in &[(1usize, 16usize), (3, 21), (8, 32)] {
            let mut w = vec![0u8; rows * kind.row_bytes(k)];
            rng.fill(&mut w[..]);
            for blk in w.chunks_exact_mut(17) {
                blk[0] = rng.random_range(0..=200);
            }
            let xs: Vec<f32> = (0..n * k).map(|_| rng.random_range(-2.0..2.0)).collect();
            let x = Q8Acts::quantize(&xs, n, k);
            let nb = k / QK;
            let mut want = vec![0f32; rows * n];
            matmul_rows_with(Isa::Scalar, kind, &w, &x, &mut want);
            for isa in Isa::available() {
                for multiply in [row_major as Multiply, interleaved] {
                    let mut got = vec![0f32; rows * n];
                    multiply(isa, kind, &w, &x, &mut got);
                    for r in 0..rows {
                        for t in 0..n {
                            let magnitude: f64 = (0..k)
                                .map(|i| {
                                    let blk = &w[(r * nb + i / QK) * 17..][..17];
                                    let e = i32::from(blk[0]) - 128;
                                    12.0 * 2f64.powi(e) * f64::from(xs[t * k + i].abs())
                                })
                                .sum();
                            let (a, b) = (got[r * n + t], want[r * n + t]);
                            assert!(
                                f64::from((a - b).abs()) <= 1e-5 * magnitude,
                                "{isa:?} k={k} n={n} row {r} token {t}: {a} vs {b}"
                            );
                        }
                    }
                }
            }
        }
    }
}

/// ggml's `block_q8_1` (`d:f16 | s:f16 | qs:i8[32]`) as bits.
struct BlockQ8_1 {
    d: u16,
    s: u16,
    qs: [i8; QK],
}

/// A scalar transcription of the AVX2 branch of ggml's x86 `quantize_row_q8_1`
/// (`ggml-cpu/arch/x86/quants.c`, llama.cpp 0c1e57098): `max|x|` over the block,
/// `d = max / 127`, `id = 127 / max` (0 for an all-zero block), `_mm256_round_ps` to nearest
/// (ties to even), `d` and `s = d · Σq` stored as f16 by F16C (to nearest, ties to even).
fn ggml_x86_quantize_row_q8_1(x: &[f32]) -> Vec<BlockQ8_1> {
    x.chunks_exact(QK)
        .map(|x| {
            let max_scalar = x.iter().fold(0f32, |m, v| m.max(v.abs()));
            let d = max_scalar / 127.0;
            let id = if max_scalar != 0.0 {
                127.0 / max_scalar
            } else {
                0.0
            };
            let qs: [i8; QK] = std::array::from_fn(|j| (x[j] * id).round_ties_even() as i8);
            let sum: i32 = qs.iter().map(|&q| i32::from(q)).sum();
            BlockQ8_1 {
                d: half::f16::from_f32(d).to_bits(),
                s: half::f16::from_f32(d * sum as f32).to_bits(),
                qs,
            }
        })
        .collect()
}

/// A scalar transcription of ggml's portable `quantize_row_q8_1_ref` (`ggml-quants.c`):
/// `id = 1 / d` and `roundf` (ties away from zero). The ARM and generic builds use `1 / d`
/// too; llama.cpp's x86 build (the one this matches) uses `127 / max`.
fn ggml_quantize_row_q8_1_ref(x: &[f32]) -> Vec<BlockQ8_1> {
    x.chunks_exact(QK)
        .map(|x| {
            let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
            let d = amax / 127.0;
            let id = if d != 0.0 { 1.0 / d } else { 0.0 };
            let qs: [i8; QK] = std::array::from_fn(|j| (x[j] * id).round() as i8);
            let sum: i32 = qs.iter().map(|&q| i32::from(q)).sum();
            BlockQ8_1 {
                d: half::f16::from_f32(d).to_bits(),
                s: half::f16::from_f32(sum as f32 * d).to_bits(),
                qs,
            }
        })
        .collect()
}

/// Activation blocks as llama.cpp's x86 build quantizes them, bit for bit: quants, the
/// f16 scale (`Q8Acts::d`, Q8_0's and Q8_1's `d`) and Q8_1's f16 sum (`Q8Acts::sum_f16`),
/// over random magnitudes, exact halves, tiny (f16-subnormal scale) and zero blocks.
#[test]
fn quantize_equals_ggml_quantize_row_q8_1_bit_for_bit() {
    let mut rng = ChaCha8Rng::seed_from_u64(27);
    let mut xs: Vec<f32> = Vec::new();
    for _ in 0..2000 {
        let scale = 2f32.powi(rng.random_range(-24..12));
        xs.extend((0..QK).map(|_| rng.random_range(-1.0f32..1.0) * scale));
    }
    // Halves: with max 127, x · 127 / max = x lands on ties.
    xs.extend((0..QK).map(|i| if i == 0 { 127.0 } else { i as f32 - 15.5 }));
    xs.extend([0.0; QK]);
    let a = Q8Acts::quantize(&xs, 1, xs.len());
    let ggml = ggml_x86_quantize_row_q8_1(&xs);
    for (b, g) in ggml.iter().enumerate() {
        assert_eq!(a.qs[b * QK..(b + 1) * QK], g.qs, "block {b}");
        assert_eq!(half::f16::from_f32(a.d[b]).to_bits(), g.d, "block {b}");
        assert_eq!(a.d[b], half::f16::from_bits(g.d).to_f32(), "block {b}");
        assert_eq!(
            a.sum_f16[b],
            half::f16::from_bits(g.s).to_f32(),
            "block {b}"
        );
    }
    // The portable reference has the same scales; its quants differ only where `1 / d`
    // and `127 / max` or the two tie rules part, by one, rarely.
    let reference = ggml_quantize_row_q8_1_ref(&xs);
    let mut differ = 0;
    for (g, r) in ggml.iter().zip(&reference) {
        assert_eq!(g.d, r.d);
        for (p, q) in g.qs.iter().zip(&r.qs) {
            assert!((i32::from(*p) - i32::from(*q)).abs() <= 1);
            differ += usize::from(p != q);
        }
    }
    assert!(
        differ * 1000 < xs.len(),
        "{differ} of {} quants differ",
        xs.len()
    );
}
