//! GPTQ (Frantar et al., 2022): quantizes a matrix column by column and spreads each
//! column's rounding error over the columns not yet quantized, weighted by the inverse
//! Hessian `H = Σ xᵀx` of the inputs the matrix saw on calibration text, so that the
//! product with those inputs changes as little as the codes allow. Codes, groups and
//! scales are those of [`super::rtn`] (compressed-tensors' min-max observer per group, the
//! group's parameters taken when its first column comes up), so the output packs the same way.
//!
//! The algorithm as the paper's reference code runs it: dead inputs (`H_ii = 0`) get weight
//! 0; `H + λI` with `λ` = 1 % of the mean diagonal (raised tenfold while the Cholesky
//! factorization fails); the upper Cholesky factor `U` of `H⁻¹`; blocks of 128 columns, the
//! updates inside a block applied at once and those beyond it once per block. Rows are
//! independent given `H`, so they are split over threads.

use rayon::prelude::*;

use super::rtn::{pack, GroupParams, PackedMatrix, RtnOptions};

/// Columns updated together before the rest of the matrix is.
const BLOCK: usize = 128;

/// `Σ xᵀx` over the rows `x` a matrix multiplied, `[k, k]`.
#[derive(Clone, Debug)]
pub struct Hessian {
    k: usize,
    /// The upper triangle (row-major, full `k × k` storage); the lower is filled by
    /// [`Hessian::symmetric`].
    h: Vec<f32>,
    /// Rows added.
    pub rows: u64,
}

impl Hessian {
    /// An empty sum over inputs of width `k`.
    pub fn new(k: usize) -> Self {
        Self {
            k,
            h: vec![0.0; k * k],
            rows: 0,
        }
    }

    /// Input width.
    pub fn width(&self) -> usize {
        self.k
    }

    /// Adds `n` rows of `x` (`[n, k]`, row-major).
    pub fn add(&mut self, x: &[f32], n: usize) {
        let k = self.k;
        if n == 0 || x.len() < n * k {
            return;
        }
        self.h.par_chunks_mut(k).enumerate().for_each(|(i, row)| {
            let row = &mut row[i..];
            for t in 0..n {
                let xt = &x[t * k..(t + 1) * k];
                let a = xt[i];
                if a != 0.0 {
                    for (h, &v) in row.iter_mut().zip(&xt[i..]) {
                        *h += a * v;
                    }
                }
            }
        });
        self.rows += n as u64;
    }

    /// The whole symmetric matrix in f64.
    pub fn symmetric(&self) -> Vec<f64> {
        let k = self.k;
        let mut m = vec![0f64; k * k];
        for i in 0..k {
            for j in i..k {
                let v = self.h[i * k + j] as f64;
                m[i * k + j] = v;
                m[j * k + i] = v;
            }
        }
        m
    }
}

/// What one [`quantize`] did beyond the codes.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct GptqReport {
    /// Inputs the calibration never saw non-zero (their weights were set to 0).
    pub dead_inputs: usize,
    /// The damping added to the diagonal, relative to its mean.
    pub damping: f64,
}

/// Why a matrix could not be quantized with GPTQ.
#[derive(Debug, thiserror::Error)]
pub enum GptqError {
    /// `H + λI` stayed indefinite however much damping was added.
    #[error("the input Hessian is not positive definite even with damping {0}")]
    NotPositiveDefinite(f64),
    /// Shapes disagree.
    #[error("{0}")]
    Shape(String),
}

/// The order GPTQ quantizes columns in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ColumnOrder {
    /// Left to right; each group's parameters taken from the updated weights when its first
    /// column comes up (the paper's code).
    Natural,
    /// Largest `H_ii` first (the inputs with most energy get the most room to be
    /// compensated), each group's parameters taken from the original weights beforehand, so
    /// groups stay contiguous and no `g_idx` is needed (llm-compressor's `actorder: static`).
    Static,
}

/// Quantizes `values` `[rows, cols]` with GPTQ against the inputs' Hessian `h` (width
/// `cols`); `damp` is the relative damping (0.01 in the paper's code); `round_scale` rounds
/// scales to their stored dtype. Returns the planes, the values they stand for (`[rows,
/// cols]`) and a report.
#[allow(clippy::too_many_arguments)]
pub fn quantize(
    values: &[f32],
    rows: usize,
    cols: usize,
    h: &Hessian,
    o: RtnOptions,
    order: ColumnOrder,
    damp: f64,
    round_scale: impl Fn(f32) -> f32 + Sync,
) -> Result<(PackedMatrix, Vec<f32>, GptqReport), GptqError> {
    if h.width() != cols || values.len() != rows * cols {
        return Err(GptqError::Shape(format!(
            "a [{rows}, {cols}] matrix with {} values against a Hessian of width {}",
            values.len(),
            h.width()
        )));
    }
    let group = cols / o.groups(cols).unwrap_or(1);
    let full = h.symmetric();
    // perm[i]: the original column quantized i-th.
    let mut perm: Vec<usize> = (0..cols).collect();
    if order == ColumnOrder::Static {
        perm.sort_by(|&a, &b| full[b * cols + b].total_cmp(&full[a * cols + a]));
    }
    let mut hm = vec![0f64; cols * cols];
    for (i, &pi) in perm.iter().enumerate() {
        for (j, &pj) in perm.iter().enumerate() {
            hm[i * cols + j] = full[pi * cols + pj];
        }
    }
    let mut dead = vec![false; cols];
    for (i, d) in dead.iter_mut().enumerate() {
        if hm[i * cols + i] == 0.0 {
            hm[i * cols + i] = 1.0;
            *d = true;
        }
    }
    let mean_diag = (0..cols).map(|i| hm[i * cols + i]).sum::<f64>() / cols as f64;
    let mut relative = damp;
    let u = loop {
        let mut damped = hm.clone();
        for i in 0..cols {
            damped[i * cols + i] += relative * mean_diag;
        }
        if let Some(u) = inverse_upper_factor(&damped, cols) {
            break u;
        }
        relative *= 10.0;
        if relative > 10.0 {
            return Err(GptqError::NotPositiveDefinite(relative));
        }
    };
    let threads = rayon::current_num_threads().max(1);
    let chunk_rows = rows.div_ceil(threads).max(1);
    let groups = cols / group;
    let mut codes = vec![0i32; rows * cols];
    let mut params = vec![GroupParams::default(); rows * groups];
    codes
        .par_chunks_mut(chunk_rows * cols)
        .zip(params.par_chunks_mut(chunk_rows * groups))
        .enumerate()
        .for_each(|(c, (codes, params))| {
            let r0 = c * chunk_rows;
            let n = codes.len() / cols;
            quantize_rows(
                &values[r0 * cols..(r0 + n) * cols],
                n,
                cols,
                group,
                &perm,
                order,
                &u,
                &dead,
                o,
                &round_scale,
                codes,
                params,
            );
        });
    let mut dequantized = vec![0f32; rows * cols];
    for (r, row) in dequantized.chunks_exact_mut(cols).enumerate() {
        for (c, v) in row.iter_mut().enumerate() {
            *v = params[r * groups + c / group].value(codes[r * cols + c]);
        }
    }
    Ok((
        pack(&codes, &params, rows, cols, o),
        dequantized,
        GptqReport {
            dead_inputs: dead.iter().filter(|&&d| d).count(),
            damping: relative,
        },
    ))
}

/// GPTQ over `n` rows: `codes` `[n, cols]` and `params` `[n, groups]` out (both in the
/// original column order); columns go in the order `perm`, against `u` and `dead` of that
/// order.
#[allow(clippy::too_many_arguments)]
fn quantize_rows(
    values: &[f32],
    n: usize,
    cols: usize,
    group: usize,
    perm: &[usize],
    order: ColumnOrder,
    u: &[f64],
    dead: &[bool],
    o: RtnOptions,
    round_scale: &(impl Fn(f32) -> f32 + Sync),
    codes: &mut [i32],
    params: &mut [GroupParams],
) {
    let groups = cols / group;
    // Column-major working copy in quantization order: column i (original perm[i]) of
    // every row is `w[i * n..]`.
    let mut w = vec![0f32; cols * n];
    for r in 0..n {
        for (i, &c) in perm.iter().enumerate() {
            w[i * n + r] = if dead[i] { 0.0 } else { values[r * cols + c] };
        }
    }
    if order == ColumnOrder::Static {
        for r in 0..n {
            for g in 0..groups {
                let part = &values[r * cols + g * group..r * cols + (g + 1) * group];
                params[r * groups + g] = GroupParams::of(part, o, round_scale);
            }
        }
    }
    let mut err = vec![0f32; BLOCK * n];
    let mut part = vec![0f32; group];
    for b0 in (0..cols).step_by(BLOCK) {
        let b1 = (b0 + BLOCK).min(cols);
        for i in b0..b1 {
            let g = perm[i] / group;
            if order == ColumnOrder::Natural && i % group == 0 {
                for r in 0..n {
                    for (c, v) in part.iter_mut().enumerate() {
                        *v = w[(i + c) * n + r];
                    }
                    params[r * groups + g] = GroupParams::of(&part, o, round_scale);
                }
            }
            let d = u[i * cols + i] as f32;
            let (done, rest) = w.split_at_mut((i + 1) * n);
            let col = &done[i * n..];
            let e = &mut err[(i - b0) * n..(i - b0 + 1) * n];
            for r in 0..n {
                let p = params[r * groups + g];
                let q = p.code(col[r], o);
                codes[r * cols + perm[i]] = q;
                e[r] = (col[r] - p.value(q)) / d;
            }
            // The columns left in this block, now.
            for j in i + 1..b1 {
                let f = u[i * cols + j] as f32;
                if f != 0.0 {
                    for (x, &ev) in rest[(j - i - 1) * n..(j - i) * n].iter_mut().zip(e.iter()) {
                        *x -= ev * f;
                    }
                }
            }
        }
        // The columns after the block, once.
        let count = b1 - b0;
        let (_, later) = w.split_at_mut(b1 * n);
        for (jj, col) in later.chunks_mut(n).enumerate() {
            let j = b1 + jj;
            for i in 0..count {
                let f = u[(b0 + i) * cols + j] as f32;
                if f != 0.0 {
                    for (x, &ev) in col.iter_mut().zip(&err[i * n..(i + 1) * n]) {
                        *x -= ev * f;
                    }
                }
            }
        }
    }
}

/// The lower Cholesky factor of the symmetric `a` `[n, n]`, or `None` where it is not
/// positive definite.
fn cholesky(a: &[f64], n: usize) -> Option<Vec<f64>> {
    let mut l = vec![0f64; n * n];
    for j in 0..n {
        let (lj, _) = l.split_at(j * n + n);
        let rowj = &lj[j * n..j * n + j];
        let d = a[j * n + j] - rowj.iter().map(|v| v * v).sum::<f64>();
        if !(d > 0.0 && d.is_finite()) {
            return None;
        }
        let d = d.sqrt();
        let rowj: Vec<f64> = rowj.to_vec();
        l[j * n + j] = d;
        for i in j + 1..n {
            let s: f64 = l[i * n..i * n + j]
                .iter()
                .zip(&rowj)
                .map(|(a, b)| a * b)
                .sum();
            l[i * n + j] = (a[i * n + j] - s) / d;
        }
    }
    Some(l)
}

/// The upper Cholesky factor `U` of `a⁻¹` (`a⁻¹ = Uᵀ U`), row-major, or `None` where `a`
/// is not positive definite.
fn inverse_upper_factor(a: &[f64], n: usize) -> Option<Vec<f64>> {
    let l = cholesky(a, n)?;
    // lᵀ row-major, so that back substitution reads rows.
    let mut lt = vec![0f64; n * n];
    for i in 0..n {
        for j in 0..=i {
            lt[j * n + i] = l[i * n + j];
        }
    }
    // a⁻¹ column by column (each a row, by symmetry): L y = e_c, Lᵀ x = y.
    let mut inv = vec![0f64; n * n];
    inv.par_chunks_mut(n).enumerate().for_each(|(c, x)| {
        let mut y = vec![0f64; n];
        for i in c..n {
            let s: f64 = l[i * n + c..i * n + i]
                .iter()
                .zip(&y[c..i])
                .map(|(a, b)| a * b)
                .sum();
            let rhs = if i == c { 1.0 } else { 0.0 };
            y[i] = (rhs - s) / l[i * n + i];
        }
        for i in (0..n).rev() {
            let s: f64 = lt[i * n + i + 1..(i + 1) * n]
                .iter()
                .zip(&x[i + 1..])
                .map(|(a, b)| a * b)
                .sum();
            x[i] = (y[i] - s) / lt[i * n + i];
        }
    });
    let li = cholesky(&inv, n)?;
    let mut u = vec![0f64; n * n];
    for i in 0..n {
        for j in 0..=i {
            u[j * n + i] = li[i * n + j];
        }
    }
    Some(u)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lcg(seed: &mut u64) -> f32 {
        *seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((*seed >> 33) as f32 / (1u64 << 31) as f32) * 2.0 - 1.0
    }

    #[test]
    fn inverse_factor_reproduces_the_inverse() {
        let n = 7;
        let mut seed = 3;
        let b: Vec<f64> = (0..n * n).map(|_| lcg(&mut seed) as f64).collect();
        // a = bᵀb + I: positive definite.
        let mut a = vec![0f64; n * n];
        for i in 0..n {
            for j in 0..n {
                a[i * n + j] = (0..n).map(|k| b[k * n + i] * b[k * n + j]).sum::<f64>()
                    + if i == j { 1.0 } else { 0.0 };
            }
        }
        let u = inverse_upper_factor(&a, n).expect("positive definite");
        // a · (Uᵀ U) = I.
        for i in 0..n {
            for j in 0..n {
                let inv_kj = |k: usize| (0..n).map(|m| u[m * n + k] * u[m * n + j]).sum::<f64>();
                let v: f64 = (0..n).map(|k| a[i * n + k] * inv_kj(k)).sum();
                let want = if i == j { 1.0 } else { 0.0 };
                assert!((v - want).abs() < 1e-9, "({i}, {j}): {v}");
            }
        }
        assert!(cholesky(&[1.0, 2.0, 2.0, 1.0], 2).is_none());
    }

    /// Inputs with correlated, unevenly scaled columns: GPTQ's codes give a smaller output
    /// error `‖(W − Ŵ) xᵀ‖²` than rounding to nearest with the same groups, and its values
    /// still sit on each group's grid.
    #[test]
    fn gptq_beats_rounding_on_the_calibration_inputs() {
        let (rows, cols, n) = (24, 64, 256);
        let mut seed = 11;
        let w: Vec<f32> = (0..rows * cols).map(|_| lcg(&mut seed)).collect();
        let base: Vec<f32> = (0..n * 8).map(|_| lcg(&mut seed)).collect();
        // Columns mix 8 latent factors, with scales from 0.1 to 3.
        let mix: Vec<f32> = (0..8 * cols).map(|_| lcg(&mut seed)).collect();
        let x: Vec<f32> = (0..n * cols)
            .map(|i| {
                let (t, c) = (i / cols, i % cols);
                let s = 0.1 + 2.9 * (c as f32 / cols as f32);
                s * (0..8)
                    .map(|f| base[t * 8 + f] * mix[f * cols + c])
                    .sum::<f32>()
                    + 0.05 * lcg(&mut seed)
            })
            .collect();
        let mut h = Hessian::new(cols);
        h.add(&x[..n / 2 * cols], n / 2);
        h.add(&x[n / 2 * cols..], n - n / 2);
        let o = RtnOptions {
            bits: 4,
            group_size: Some(32),
            symmetric: false,
        };
        let (g, values, report) =
            quantize(&w, rows, cols, &h, o, ColumnOrder::Natural, 0.01, |s| s).expect("gptq");
        assert_eq!(values, dequant(&g, rows, cols, o));
        assert_eq!(report.dead_inputs, 0);
        let (gs, _, _) =
            quantize(&w, rows, cols, &h, o, ColumnOrder::Static, 0.01, |s| s).expect("gptq");
        let r = super::super::rtn::quantize(&w, rows, cols, o, |s| s);
        let out_err = |m: &PackedMatrix| {
            let deq = dequant(m, rows, cols, o);
            let mut e = 0f64;
            for t in 0..n {
                for r in 0..rows {
                    let d: f32 = (0..cols)
                        .map(|c| (w[r * cols + c] - deq[r * cols + c]) * x[t * cols + c])
                        .sum();
                    e += (d * d) as f64;
                }
            }
            e
        };
        let (eg, es, er) = (out_err(&g), out_err(&gs), out_err(&r));
        assert!(
            eg < 0.7 * er && es < 0.7 * er,
            "gptq {eg}, static order {es}, rtn {er}"
        );
    }

    /// Dequantizes compressed-tensors planes (the loader's rules, written out).
    fn dequant(m: &PackedMatrix, rows: usize, cols: usize, o: RtnOptions) -> Vec<f32> {
        let words = super::super::rtn::packed_words(cols, o.bits);
        let groups = m.groups;
        let zwords = super::super::rtn::packed_words(rows, o.bits);
        let field = |ws: &[u32], i: usize| -> i32 {
            let bit = i * o.bits as usize;
            let (w, off) = (bit / 32, bit % 32);
            ((ws[w] >> off) & ((1 << o.bits) - 1)) as i32
        };
        let packed: Vec<u32> = m.packed.iter().map(|&v| v as u32).collect();
        let zeros: Vec<u32> = m
            .zeros
            .as_ref()
            .expect("asymmetric")
            .iter()
            .map(|&v| v as u32)
            .collect();
        let mut out = vec![0f32; rows * cols];
        let offset = 1 << (o.bits - 1);
        for r in 0..rows {
            for c in 0..cols {
                let g = c / (cols / groups);
                let zcol: Vec<u32> = (0..zwords).map(|w| zeros[w * groups + g]).collect();
                let z = field(&zcol, r) - offset;
                let q = field(&packed[r * words..(r + 1) * words], c) - offset;
                out[r * cols + c] = (q - z) as f32 * m.scales[r * groups + g];
            }
        }
        out
    }
}
