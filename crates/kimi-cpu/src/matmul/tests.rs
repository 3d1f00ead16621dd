use super::*;
use half::bf16;

fn naive(x: &[f32], w: &[f32], n: usize, k: usize, o: usize) -> Vec<f32> {
    let mut y = vec![0f32; n * o];
    for t in 0..n {
        for r in 0..o {
            y[t * o + r] = (0..k)
                .map(|i| x[t * k + i] as f64 * w[r * k + i] as f64)
                .sum::<f64>() as f32;
        }
    }
    y
}

#[test]
fn matches_naive_for_f32_and_bf16() {
    for (n, k, o) in [(1, 5, 3), (3, 64, 17), (9, 130, 257), (4, 8, 1)] {
        let x: Vec<f32> = (0..n * k)
            .map(|i| ((i * 7 % 23) as f32 - 11.0) * 0.03)
            .collect();
        let w: Vec<f32> = (0..o * k)
            .map(|i| ((i * 5 % 19) as f32 - 9.0) * 0.02)
            .collect();
        let xt = CpuTensor::f32(&[n, k], x.clone()).unwrap();
        let wt = CpuTensor::f32(&[o, k], w.clone()).unwrap();
        let y = matmul(&xt, &wt, QuantMatmul::F32).unwrap().to_f32_vec();
        let want = naive(&x, &w, n, k, o);
        for (a, b) in y.iter().zip(&want) {
            assert!((a - b).abs() < 1e-4, "{a} vs {b}");
        }
        let wb: Vec<u16> = w.iter().map(|v| bf16::from_f32(*v).to_bits()).collect();
        let wround: Vec<f32> = wb.iter().map(|b| bf16::from_bits(*b).to_f32()).collect();
        let wt = CpuTensor::new(vec![o, k], Storage::Bf16(wb.into()));
        let y = matmul(&xt, &wt, QuantMatmul::F32).unwrap().to_f32_vec();
        let want = naive(&x, &wround, n, k, o);
        for (a, b) in y.iter().zip(&want) {
            assert!((a - b).abs() < 1e-4, "{a} vs {b}");
        }
        let wh: Vec<u16> = w
            .iter()
            .map(|v| half::f16::from_f32(*v).to_bits())
            .collect();
        let wround: Vec<f32> = wh
            .iter()
            .map(|b| half::f16::from_bits(*b).to_f32())
            .collect();
        let wt = CpuTensor::new(vec![o, k], Storage::F16(wh.into()));
        let y = matmul(&xt, &wt, QuantMatmul::F32).unwrap().to_f32_vec();
        let want = naive(&x, &wround, n, k, o);
        for (a, b) in y.iter().zip(&want) {
            assert!((a - b).abs() < 1e-4, "{a} vs {b}");
        }
    }
}

/// Every path gives the same bits whatever the team size (ranges of rows move between
/// threads; each row's products must not change).
#[test]
fn results_do_not_depend_on_the_thread_count() {
    use kimi_core::DType;
    use kimi_gguf::GgmlType;
    let teams: Vec<Team> = [1, 2, 3, 7]
        .into_iter()
        .map(|t| Team::new(t, crate::team::DEFAULT_SPIN))
        .collect();
    let k = 256;
    for o in [1, 37, 300] {
        let w: Vec<f32> = (0..o * k)
            .map(|i| ((i * 5 % 19) as f32 - 9.0) * 0.02)
            .collect();
        let q41 = kimi_gguf::quantize(GgmlType::Q4_1, &w).unwrap();
        let to_bits =
            |v: &[f32]| -> Vec<u16> { v.iter().map(|v| bf16::from_f32(*v).to_bits()).collect() };
        let weights = [
            CpuTensor::f32(&[o, k], w.clone()).unwrap(),
            CpuTensor::new(vec![o, k], Storage::Bf16(to_bits(&w).into())),
            CpuTensor::from_host(kimi_ops::HostTensor {
                shape: &[o, k],
                dtype: DType::Q4_1,
                bytes: &q41,
            })
            .unwrap(),
        ];
        for n in [1, 3, 9] {
            let x: Vec<f32> = (0..n * k)
                .map(|i| ((i * 7 % 23) as f32 - 11.0) * 0.03)
                .collect();
            let xt = CpuTensor::f32(&[n, k], x).unwrap();
            for wt in &weights {
                for mode in [QuantMatmul::F32, QuantMatmul::Int8] {
                    let run = |team| {
                        let y = matmul_on(team, &xt, wt, mode).unwrap().to_f32_vec();
                        y.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
                    };
                    let want = run(&teams[0]);
                    for team in &teams[1..] {
                        assert_eq!(run(team), want, "o={o} n={n} {mode:?}");
                    }
                }
            }
        }
    }
}

/// A token's products do not depend on the batch around it: every batch size (tiles of
/// four, two and one tokens and of one to three rows on AVX2, of four elsewhere) gives
/// each token the bits of its own one-token product, for f32, bf16, f16 and dequantized
/// weights and for widths across several 256-value blocks with and without a tail.
#[test]
fn batched_products_equal_single_token_products() {
    use kimi_core::DType;
    use kimi_gguf::GgmlType;
    for k in [5usize, 16, 37, 288, 600] {
        for o in [1usize, 2, 3, 4, 17] {
            let w: Vec<f32> = (0..o * k)
                .map(|i| ((i * 5 % 19) as f32 - 9.0) * 0.02)
                .collect();
            let mut weights = vec![
                CpuTensor::f32(&[o, k], w.clone()).unwrap(),
                CpuTensor::new(
                    vec![o, k],
                    Storage::Bf16(w.iter().map(|v| bf16::from_f32(*v).to_bits()).collect()),
                ),
                CpuTensor::new(
                    vec![o, k],
                    Storage::F16(
                        w.iter()
                            .map(|v| half::f16::from_f32(*v).to_bits())
                            .collect(),
                    ),
                ),
            ];
            if k.is_multiple_of(32) {
                let q8 = kimi_gguf::quantize(GgmlType::Q8_0, &w).unwrap();
                weights.push(
                    CpuTensor::from_host(kimi_ops::HostTensor {
                        shape: &[o, k],
                        dtype: DType::Q8_0,
                        bytes: &q8,
                    })
                    .unwrap(),
                );
            }
            for n in [2usize, 3, 4, 5, 6, 7, 13, 20] {
                let x: Vec<f32> = (0..n * k)
                    .map(|i| ((i * 7 % 23) as f32 - 11.0) * 0.03)
                    .collect();
                let xt = CpuTensor::f32(&[n, k], x.clone()).unwrap();
                for (wt, mode) in weights.iter().map(|w| (w, QuantMatmul::F32)) {
                    let got = matmul(&xt, wt, mode).unwrap().to_f32_vec();
                    for t in 0..n {
                        let one = CpuTensor::f32(&[1, k], x[t * k..(t + 1) * k].to_vec());
                        let want = matmul(&one.unwrap(), wt, mode).unwrap().to_f32_vec();
                        let got: Vec<u32> = got[t * o..(t + 1) * o]
                            .iter()
                            .map(|v| v.to_bits())
                            .collect();
                        let want: Vec<u32> = want.iter().map(|v| v.to_bits()).collect();
                        assert_eq!(
                            got,
                            want,
                            "k={k} o={o} n={n} t={t} {} {mode:?}",
                            wt.size_bytes()
                        );
                    }
                }
            }
        }
    }
}

/// The fused SwiGLU equals its two matmuls and the element-wise product, bit for bit.
#[test]
fn glu_matches_two_matmuls() {
    use kimi_core::DType;
    use kimi_gguf::GgmlType;
    let (k, o) = (256, 300);
    let weight = |seed: usize| -> (CpuTensor, CpuTensor) {
        let w: Vec<f32> = (0..o * k)
            .map(|i| (((i + seed) * 5 % 19) as f32 - 9.0) * 0.02)
            .collect();
        let q = kimi_gguf::quantize(GgmlType::Q4_1, &w).unwrap();
        let q = CpuTensor::from_host(kimi_ops::HostTensor {
            shape: &[o, k],
            dtype: DType::Q4_1,
            bytes: &q,
        })
        .unwrap();
        (CpuTensor::f32(&[o, k], w).unwrap(), q)
    };
    let ((gf, gq), (uf, uq)) = (weight(0), weight(7));
    for team in [1, 2, 3].map(|t| Team::new(t, crate::team::DEFAULT_SPIN)) {
        for n in [1, 3, 9] {
            let x: Vec<f32> = (0..n * k)
                .map(|i| ((i * 7 % 23) as f32 - 11.0) * 0.03)
                .collect();
            let xt = CpuTensor::f32(&[n, k], x).unwrap();
            for (g, u) in [(&gf, &uf), (&gq, &uq), (&gq, &uf)] {
                for mode in [QuantMatmul::F32, QuantMatmul::Int8] {
                    let gy = matmul_on(&team, &xt, g, mode).unwrap().to_f32_vec();
                    let uy = matmul_on(&team, &xt, u, mode).unwrap().to_f32_vec();
                    let want: Vec<u32> = gy
                        .iter()
                        .zip(&uy)
                        .map(|(g, u)| (crate::kda::silu(*g) * u).to_bits())
                        .collect();
                    let got = glu_on(&team, &xt, g, u, Activation::Silu, mode).unwrap();
                    assert_eq!(got.shape, vec![n, o]);
                    let got: Vec<u32> = got.to_f32_vec().iter().map(|v| v.to_bits()).collect();
                    assert_eq!(got, want, "n={n} {mode:?}");
                }
            }
        }
    }
    // Several products in one section equal each alone, bit for bit.
    let xs: Vec<CpuTensor> = [1, 3, 9]
        .iter()
        .map(|&n| {
            let x = (0..n * k).map(|i| ((i * 11 % 29) as f32 - 14.0) * 0.02);
            CpuTensor::f32(&[n, k], x.collect()).unwrap()
        })
        .collect();
    let bits = |t: &CpuTensor| {
        t.to_f32_vec()
            .iter()
            .map(|v| v.to_bits())
            .collect::<Vec<_>>()
    };
    for mode in [QuantMatmul::F32, QuantMatmul::Int8] {
        let pairs = [(&xs[0], &gq, &uq), (&xs[1], &gf, &uf), (&xs[2], &gq, &uf)];
        let many = glu_many(&pairs, Activation::Silu, mode).unwrap();
        for ((x, g, u), got) in pairs.iter().zip(&many) {
            assert_eq!(
                bits(got),
                bits(&glu(x, g, u, Activation::Silu, mode).unwrap()),
                "{mode:?}"
            );
        }
        let singles = [(&xs[2], &gq), (&xs[0], &uf), (&xs[1], &uq)];
        let many = matmul_many(&singles, mode).unwrap();
        for ((x, w), got) in singles.iter().zip(&many) {
            assert_eq!(bits(got), bits(&matmul(x, w, mode).unwrap()), "{mode:?}");
        }
        // The backend's pair of products is one such section.
        let be = crate::CpuBackend::with_quant_matmul(mode);
        let (ya, yb) = kimi_ops::Backend::matmul_pair(&be, singles[0], singles[1]).unwrap();
        assert_eq!(bits(&ya), bits(&matmul(&xs[2], &gq, mode).unwrap()));
        assert_eq!(bits(&yb), bits(&matmul(&xs[0], &uf, mode).unwrap()));
    }
    let x = CpuTensor::f32(&[1, k], vec![0.0; k]).unwrap();
    let small = CpuTensor::f32(&[3, k], vec![0.0; 3 * k]).unwrap();
    assert!(glu(&x, &gf, &small, Activation::Silu, QuantMatmul::F32).is_err());
    assert!(glu_many(&[(&x, &gf, &small)], Activation::Silu, QuantMatmul::F32).is_err());
}

/// Quantized weights multiply as their dequantized f32 values do (Q4_1 and Q8_0 are
/// the demo model's types; the K types cover the 256-value super-blocks; MXFP4 is Kimi
/// K3's experts), on the f32 path and, up to the activation rounding, on the integer one.
#[test]
fn quantized_weights_match_dequantized() {
    use kimi_core::DType;
    // Where the interleaved kernels run, 37 rows are interleaved with a padded last group, 48
    // in whole groups and 13 not at all.
    for o in [13, 37, 48] {
        quantized_case(5, 512, o);
    }
    // Rows must be whole blocks, and the byte count must fit.
    let bytes = vec![0u8; 20];
    let bad = |shape: &[usize], dtype| {
        CpuTensor::from_host(kimi_ops::HostTensor {
            shape,
            dtype,
            bytes: &bytes,
        })
    };
    assert!(bad(&[2, 16], DType::Q4_1).is_err());
    assert!(bad(&[1, 32], DType::Q8_0).is_err());
    assert!(bad(&[1, 32], DType::Q4_1).is_ok());
}

fn quantized_case(n: usize, k: usize, o: usize) {
    use kimi_core::DType;
    use kimi_gguf::GgmlType;
    let x: Vec<f32> = (0..n * k)
        .map(|i| ((i * 7 % 23) as f32 - 11.0) * 0.03)
        .collect();
    let w: Vec<f32> = (0..o * k)
        .map(|i| ((i * 5 % 19) as f32 - 9.0) * 0.02)
        .collect();
    let xt = CpuTensor::f32(&[n, k], x.clone()).unwrap();
    for (dtype, ty) in [
        (DType::Q4_0, GgmlType::Q4_0),
        (DType::Q4_1, GgmlType::Q4_1),
        (DType::Q5_0, GgmlType::Q5_0),
        (DType::Q8_0, GgmlType::Q8_0),
        (DType::Q4_K, GgmlType::Q4_K),
        (DType::Q5_K, GgmlType::Q5_K),
        (DType::Q6_K, GgmlType::Q6_K),
        (DType::MXFP4, GgmlType::MXFP4),
    ] {
        let bytes = kimi_gguf::quantize(ty, &w).unwrap();
        let wround = kimi_gguf::dequantize(ty, &bytes, w.len()).unwrap();
        let wt = CpuTensor::from_host(kimi_ops::HostTensor {
            shape: &[o, k],
            dtype,
            bytes: &bytes,
        })
        .unwrap();
        let kind = crate::qdot::Kind::of(dtype).unwrap();
        let grouped = matches!(
            wt.storage,
            Storage::Quant {
                grouped: Some(_),
                ..
            }
        );
        assert_eq!(
            grouped,
            crate::qdot::groups::wanted(kind, o),
            "{dtype} {o} rows"
        );
        let padded = crate::qdot::groups::padded_bytes(kind, o, k);
        assert_eq!(wt.size_bytes(), if grouped { padded } else { bytes.len() });
        assert_eq!(wt.to_f32_vec(), wround);
        let y = matmul(&xt, &wt, QuantMatmul::F32).unwrap().to_f32_vec();
        let want = naive(&x, &wround, n, k, o);
        for (a, b) in y.iter().zip(&want) {
            assert!((a - b).abs() < 1e-4, "{dtype}: {a} vs {b}");
        }
        // |x| ≤ 0.33, so int8 activations round by at most 0.33 / 254 per value.
        assert!(int8_kind(&wt, INT8_MAX_TOKENS, QuantMatmul::Int8).is_some());
        let y = matmul(&xt, &wt, QuantMatmul::Int8).unwrap().to_f32_vec();
        for (i, (a, b)) in y.iter().zip(&want).enumerate() {
            let row = &wround[(i % o) * k..(i % o + 1) * k];
            let bound = row.iter().map(|v| v.abs()).sum::<f32>() * 0.33 / 254.0 + 1e-4;
            assert!((a - b).abs() <= bound, "{dtype} int8: {a} vs {b}");
        }
        let emb = crate::norm::embedding(&wt, &[3, 0, o as u32 - 1])
            .unwrap()
            .to_f32_vec();
        assert_eq!(&emb[k..2 * k], &wround[..k]);
        assert_eq!(&emb[2 * k..3 * k], &wround[(o - 1) * k..o * k]);
    }
}

#[test]
fn many_products_keep_every_thread_busy_in_whole_row_groups() {
    use super::{rows_per_task, MANY_ROWS};
    // 64 experts of 1,024 rows on 16 threads: the long blocks.
    assert_eq!(rows_per_task(64 * 1024, 16), MANY_ROWS);
    // One expert's gate/up (1,024 rows) on 16 threads: 64 tasks of 16 rows, not 4 of 256.
    assert_eq!(rows_per_task(1024, 16), 16);
    // Its down product (2,304 rows): 36 rows a task, rounded up to 48.
    assert_eq!(rows_per_task(2304, 16), 48);
    // Two threads: blocks stay long where there are 8 of them.
    assert_eq!(rows_per_task(2048, 2), MANY_ROWS);
    assert_eq!(rows_per_task(1024, 2), 128);
    assert_eq!(rows_per_task(1, 1), 16);
    for (rows, threads) in [(1, 16), (100, 3), (5000, 7), (1 << 20, 64)] {
        let r = rows_per_task(rows, threads);
        assert!(
            r.is_multiple_of(16) && (16..=MANY_ROWS).contains(&r),
            "{rows} {threads}: {r}"
        );
    }
}
