//! 16-bit weight rows (bf16 or f16) against several tokens at once, widened in registers:
//! the CPU's share of a prefill through a host tier's experts, where each expert sees a
//! few tokens. Widening a tile of rows into an f32 buffer first and running `dot4x4` over
//! it cost a pass over the widened copy per tile, and two or three tokens paid for four.

/// `out[r * n + t] = w[r] · x[t]` for the rows of `k` 16-bit weights in `w` (f16 when
/// `F16`, else bf16) and the `n` token rows of `k` values in `xs`, equal bit for bit to
/// [`super::dot`] of each widened row (every AVX-512 product here sums 16 lanes in order
/// with a masked tail and one reduction). Returns `false`, writing nothing, where this CPU
/// has no such kernel (callers widen rows and take `dot4x4`).
pub fn rows_16bit_by_tokens<const F16: bool>(
    w: &[u16],
    k: usize,
    xs: &[f32],
    n: usize,
    out: &mut [f32],
) -> bool {
    let rows = out.len() / n.max(1);
    assert!(
        n > 0 && w.len() >= rows * k && xs.len() >= n * k && out.len() == rows * n,
        "rows_16bit_by_tokens: {} weights, {} activations and {} outputs for {rows} rows, {n} tokens of {k}",
        w.len(),
        xs.len(),
        out.len()
    );
    #[cfg(target_arch = "x86_64")]
    {
        if super::has_avx512() && super::has_avx512_bw_vl() {
            // SAFETY: AVX-512F, BW and VL were detected on this CPU just above; the
            // lengths were asserted.
            unsafe { avx512::rows_by_tokens::<F16>(w, k, xs, n, out) };
            return true;
        }
    }
    false
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::*;

    /// Tokens per tile: four rows by six tokens hold 24 accumulators, each widened weight
    /// vector feeds six FMAs and each token vector four. (Blocks of 768 values of `k`,
    /// keeping a tile of tokens' block in L1 across row tiles with the accumulators in
    /// memory between blocks, measured 2–25 % slower on the H100 host's Xeon and on EPYC.)
    const TOKENS: usize = 6;
    /// Rows per tile.
    const ROWS: usize = 4;

    /// # Safety
    /// The CPU must support AVX-512F, BW and VL; `w` holds `out.len() / n` rows of `k`,
    /// `xs` holds `n` rows of `k`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    pub unsafe fn rows_by_tokens<const F16: bool>(
        w: &[u16],
        k: usize,
        xs: &[f32],
        n: usize,
        out: &mut [f32],
    ) {
        let rows = out.len() / n;
        let mut r0 = 0;
        while r0 < rows {
            let r_len = ROWS.min(rows - r0);
            // The tile's rows stay in L1 while every block of tokens passes them: each
            // weight byte comes from memory once.
            let mut t0 = 0;
            while t0 < n {
                let t_len = TOKENS.min(n - t0);
                let at = Tile {
                    w,
                    k,
                    xs,
                    n,
                    r0,
                    t0,
                };
                // SAFETY: features as this function's; the tile lies inside the rows and
                // tokens (r0 + r_len <= rows, t0 + t_len <= n).
                unsafe {
                    match r_len {
                        4 => at.rows::<F16, 4>(t_len, out),
                        3 => at.rows::<F16, 3>(t_len, out),
                        2 => at.rows::<F16, 2>(t_len, out),
                        _ => at.rows::<F16, 1>(t_len, out),
                    }
                }
                t0 += t_len;
            }
            r0 += r_len;
        }
    }

    /// One tile's place: rows `r0..` of `w` by tokens `t0..` of `xs`.
    struct Tile<'a> {
        w: &'a [u16],
        k: usize,
        xs: &'a [f32],
        n: usize,
        r0: usize,
        t0: usize,
    }

    impl Tile<'_> {
        /// [`Tile::run`] for `R` rows by `t_len` (at most [`TOKENS`]) tokens.
        ///
        /// # Safety
        /// As [`Tile::run`]'s, for `t_len` tokens.
        #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
        unsafe fn rows<const F16: bool, const R: usize>(&self, t_len: usize, out: &mut [f32]) {
            // SAFETY: the caller's promise, for T = t_len.
            unsafe {
                match t_len {
                    6 => self.run::<F16, R, 6>(out),
                    5 => self.run::<F16, R, 5>(out),
                    4 => self.run::<F16, R, 4>(out),
                    3 => self.run::<F16, R, 3>(out),
                    2 => self.run::<F16, R, 2>(out),
                    _ => self.run::<F16, R, 1>(out),
                }
            }
        }

        /// `out[(r0 + r) * n + t0 + t]` for `R` rows by `T` tokens.
        ///
        /// # Safety
        /// The CPU must support AVX-512F, BW and VL; rows `r0..r0 + R` of `w` and tokens
        /// `t0..t0 + T` of `xs` exist, and so do their places in `out`.
        #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
        unsafe fn run<const F16: bool, const R: usize, const T: usize>(&self, out: &mut [f32]) {
            let Tile {
                w,
                k,
                xs,
                n,
                r0,
                t0,
            } = *self;
            let mut acc = [[_mm512_setzero_ps(); T]; R];
            let wp = w.as_ptr();
            let xp = xs.as_ptr();
            let mut i = 0;
            while i < k {
                let m = ((1u32 << (k - i).min(16)) - 1) as __mmask16;
                let mut wv = [_mm512_setzero_ps(); R];
                for (r, v) in wv.iter_mut().enumerate() {
                    // SAFETY: the mask covers only indices below k of row r0 + r, which
                    // lies inside `w` (the caller's promise); masked-off lanes are not
                    // read and widen to +0.0, as in `dot`'s masked loads. bf16 → f32 is a
                    // 16-bit left shift.
                    unsafe {
                        let h = _mm256_maskz_loadu_epi16(m, wp.add((r0 + r) * k + i).cast());
                        *v = if F16 {
                            _mm512_cvtph_ps(h)
                        } else {
                            _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16))
                        };
                    }
                }
                for t in 0..T {
                    // SAFETY: as above, for token t0 + t of `xs`.
                    let xv = unsafe { _mm512_maskz_loadu_ps(m, xp.add((t0 + t) * k + i)) };
                    for (row, w) in acc.iter_mut().zip(&wv) {
                        row[t] = _mm512_fmadd_ps(*w, xv, row[t]);
                    }
                }
                i += 16;
            }
            for (r, row) in acc.iter().enumerate() {
                for (t, a) in row.iter().enumerate() {
                    out[(r0 + r) * n + t0 + t] = _mm512_reduce_add_ps(*a);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn values(n: usize, seed: usize) -> Vec<f32> {
        (0..n)
            .map(|i| ((((i + seed) * 2654435761) % 1000) as f32 / 500.0 - 1.0) * 0.7)
            .collect()
    }

    fn bf16_bits(v: &[f32]) -> Vec<u16> {
        v.iter()
            .map(|&x| half::bf16::from_f32(x).to_bits())
            .collect()
    }

    fn f16_bits(v: &[f32]) -> Vec<u16> {
        v.iter()
            .map(|&x| half::f16::from_f32(x).to_bits())
            .collect()
    }

    /// Every tile shape (1–4 rows by 1–6 tokens, and more of each) and every tail of `k`.
    const SHAPES: [(usize, usize, usize); 9] = [
        (1, 2, 16),
        (3, 5, 37),
        (4, 6, 64),
        (5, 7, 300),
        (7, 13, 33),
        (9, 2, 1),
        (8, 12, 2304),
        (6, 7, 1800),
        (2, 3, 31),
    ];

    #[test]
    fn widened_tiles_equal_dot_of_each_widened_row_bit_for_bit() {
        for (rows, n, k) in SHAPES {
            let w = values(rows * k, 7);
            let xs = values(n * k, 3);
            for f16 in [false, true] {
                let bits = if f16 { f16_bits(&w) } else { bf16_bits(&w) };
                let mut out = vec![f32::NAN; rows * n];
                let done = if f16 {
                    rows_16bit_by_tokens::<true>(&bits, k, &xs, n, &mut out)
                } else {
                    rows_16bit_by_tokens::<false>(&bits, k, &xs, n, &mut out)
                };
                if !done {
                    eprintln!("SKIPPED: no AVX-512 on this CPU");
                    return;
                }
                for r in 0..rows {
                    let row: Vec<f32> = bits[r * k..(r + 1) * k]
                        .iter()
                        .map(|&b| {
                            if f16 {
                                half::f16::from_bits(b).to_f32()
                            } else {
                                half::bf16::from_bits(b).to_f32()
                            }
                        })
                        .collect();
                    for t in 0..n {
                        let want = crate::simd::dot(&row, &xs[t * k..(t + 1) * k]);
                        assert_eq!(
                            out[r * n + t].to_bits(),
                            want.to_bits(),
                            "rows {rows}, tokens {n}, k {k}, f16 {f16}: row {r} token {t}"
                        );
                    }
                }
            }
        }
    }
}
