//! `y = x · wᵀ` for f32 activations and f32/bf16/f16 or block-quantized weights.
//!
//! Work is split over output features: each thread of the CPU team takes one contiguous
//! range of weight rows (the same rows whatever the batch, so a token's result does not
//! depend on the thread count) and goes through it in blocks. Each block of weight rows is
//! converted to f32 once, then multiplied with every token row four tokens at a time, so a
//! weight element is read from memory once per call (decode is bound by that read).
//! Block-quantized weights take one of two paths (see [`QuantMatmul`]): the integer kernels
//! of `crate::qdot` on int8-quantized activations, or f32 products with rows dequantized a
//! few at a time into an L1-sized buffer.

use crate::qdot::{self, Kind, Q8Acts};
use crate::simd::{dot, dot4, dot4x4, dot_rows_16bit, tile_products, TileRows};
use crate::team::Team;
use crate::tensor::{row_to_f32, shape_err, CpuTensor, Storage};
use kimi_core::DType;
use kimi_ops::{Activation, Result};

/// How block-quantized weights multiply f32 activations.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum QuantMatmul {
    /// Batches of up to [`INT8_MAX_TOKENS`] tokens (decode) quantize the activations to
    /// int8 per 32-value block, as llama.cpp does, and dot them with the packed weights in
    /// integer arithmetic (types with kernels in `crate::qdot`). Results differ from the
    /// f32 product by the rounding of the activations (at most half a step per value),
    /// which can flip a greedy choice between near-tied tokens. Within that path a token's
    /// result does not depend on the other tokens of its batch. Larger batches (prefill)
    /// take the f32 path, which measured faster there, except on weights interleaved for
    /// the interleaved kernels (`crate::qdot::groups`): those take the integer path at any batch
    /// size (SmolLM2 Q4_1 prefill of 128 tokens 1.7× faster than the f32 path).
    #[default]
    Int8,
    /// Always dequantize weights to f32 and multiply with the f32 activations: the product
    /// of the dequantized weights up to f32 summation order (golden-output tests use it).
    F32,
}

/// The largest batch [`QuantMatmul::Int8`] runs on the integer kernels. Above it the
/// integer kernels' per-block scaling (one multiply, broadcast and FMA per block and token)
/// costs more than dequantizing a tile once and running the f32 kernel over all tokens:
/// at 128 tokens they were 1.3–2× slower (`examples/quant_bench.rs`).
pub const INT8_MAX_TOKENS: usize = 8;

/// Weight rows per block within a thread's range: 128 rows of up to a few thousand f32
/// values stay in L2 while every token passes over them.
const BLOCK_ROWS: usize = 128;

/// Thread ranges start at multiples of this many rows: whole kernel tiles (4 rows), and
/// for a single token whole 64-byte lines of the output, so no line is written by two
/// threads.
const ROW_ALIGN: usize = 16;

// Interleaved weights are multiplied in whole 16-row groups.
const _: () = assert!(
    ROW_ALIGN.is_multiple_of(qdot::groups::GROUP) && BLOCK_ROWS.is_multiple_of(qdot::groups::GROUP)
);

/// `x [n, k] · w[o, k]ᵀ → [n, o]`, on the CPU backend's team.
pub fn matmul(x: &CpuTensor, w: &CpuTensor, mode: QuantMatmul) -> Result<CpuTensor> {
    matmul_on(crate::team(), x, w, mode)
}

/// [`matmul`] on the given team.
pub(crate) fn matmul_on(
    team: &Team,
    x: &CpuTensor,
    w: &CpuTensor,
    mode: QuantMatmul,
) -> Result<CpuTensor> {
    let (n, k, o) = dims("matmul", x, w)?;
    let xs = x.as_f32("matmul")?;
    let q8 = int8_acts(xs, n, k, mode, &[w]);
    let product = Product::new(xs, n, k, w, mode, q8.as_ref());
    let mut out_t = vec![0f32; o * n];
    team.for_each_part(&mut out_t, n.max(1), ROW_ALIGN, |first, part| {
        for (b, chunk) in part.chunks_mut(BLOCK_ROWS * n.max(1)).enumerate() {
            product.rows(first + b * BLOCK_ROWS, chunk);
        }
    });
    token_major(x, out_t, n, o)
}

/// `silu(x · gateᵀ) ⊙ (x · upᵀ)`, SwiGLU's hidden activations `[n, o]`, in one section of
/// the CPU backend's team: each thread multiplies the same rows of both weights and
/// combines them, and the activations are quantized once for both. The values are those
/// of the two matmuls followed by the element-wise product.
pub fn glu(
    x: &CpuTensor,
    gate: &CpuTensor,
    up: &CpuTensor,
    act: Activation,
    mode: QuantMatmul,
) -> Result<CpuTensor> {
    glu_on(crate::team(), x, gate, up, act, mode)
}

/// [`glu`] on the given team.
pub(crate) fn glu_on(
    team: &Team,
    x: &CpuTensor,
    gate: &CpuTensor,
    up: &CpuTensor,
    act: Activation,
    mode: QuantMatmul,
) -> Result<CpuTensor> {
    let (n, k, o) = dims("mlp", x, gate)?;
    if up.shape != gate.shape {
        return Err(shape_err(
            "mlp",
            format!("gate {:?} and up {:?} differ", gate.shape, up.shape),
        ));
    }
    let xs = x.as_f32("mlp")?;
    let q8 = int8_acts(xs, n, k, mode, &[gate, up]);
    let (g, u) = (
        Product::new(xs, n, k, gate, mode, q8.as_ref()),
        Product::new(xs, n, k, up, mode, q8.as_ref()),
    );
    let mut out_t = vec![0f32; o * n];
    team.for_each_part(&mut out_t, n.max(1), ROW_ALIGN, |first, part| {
        let mut ubuf = vec![0f32; part.len().min(BLOCK_ROWS * n.max(1))];
        for (b, chunk) in part.chunks_mut(BLOCK_ROWS * n.max(1)).enumerate() {
            let row0 = first + b * BLOCK_ROWS;
            glu_rows(&g, &u, act, row0, chunk, &mut ubuf[..chunk.len()]);
        }
    });
    token_major(x, out_t, n, o)
}

/// `chunk = act(gate rows, up rows)` for output rows from `row0`; `ub` (as long as
/// `chunk`) holds the up product meanwhile.
fn glu_rows(
    gate: &Product,
    up: &Product,
    act: Activation,
    row0: usize,
    chunk: &mut [f32],
    ub: &mut [f32],
) {
    gate.rows(row0, chunk);
    up.rows(row0, ub);
    match act {
        Activation::Silu => {
            for (g, u) in chunk.iter_mut().zip(ub.iter()) {
                *g = crate::kda::silu(*g) * u;
            }
        }
        Activation::Situ { beta, linear_beta } => {
            for (g, u) in chunk.iter_mut().zip(ub.iter()) {
                *g = situ(*g, *u, beta, linear_beta);
            }
        }
    }
}

/// SiTU-GLU of one gate/up pair (Kimi K3): `β₁·tanh(g/β₁)·sigmoid(g) · β₂·tanh(u/β₂)`.
pub(crate) fn situ(g: f32, u: f32, beta: f32, linear_beta: Option<f32>) -> f32 {
    let a = beta * (g / beta).tanh() * crate::kda::sigmoid(g);
    let u = match linear_beta {
        Some(b) => b * (u / b).tanh(),
        None => u,
    };
    a * u
}

/// Output rows per task of [`glu_many`] and [`matmul_many`] where the products have rows
/// enough: whole 16-row groups. Tasks of 64 rows measured ~15 % slower on the experts of a
/// 0.5B Kimi Linear (`[512, 1024]` gate/up, `[1024, 512]` down, Q4_K): each task starts
/// its weight stream cold.
const MANY_ROWS: usize = 256;

/// Output rows per task for products of `rows` output rows in all: [`MANY_ROWS`] where
/// that gives every thread several tasks, else fewer (whole 16-row groups), so that a step
/// with one cold expert (1,024 gate/up rows: four tasks of 256) still has every thread
/// streaming its weights.
fn rows_per_task(rows: usize, threads: usize) -> usize {
    let tasks = 4 * threads.max(1);
    if rows >= tasks * MANY_ROWS {
        MANY_ROWS
    } else {
        rows.div_ceil(tasks)
            .next_multiple_of(16)
            .clamp(16, MANY_ROWS)
    }
}

/// `act(x_i · gate_iᵀ, x_i · up_iᵀ)` for every `(x_i, gate_i, up_i)` (an MoE layer's
/// experts), all in one section of the team; each result equals [`glu`]'s bit for bit.
pub(crate) fn glu_many(
    items: &[(&CpuTensor, &CpuTensor, &CpuTensor)],
    act: Activation,
    mode: QuantMatmul,
) -> Result<Vec<CpuTensor>> {
    many(items.iter().map(|&(x, g, u)| (x, g, Some(u))), act, mode)
}

/// `x_i · w_iᵀ` for every `(x_i, w_i)`, all in one section of the team; each result
/// equals [`matmul`]'s bit for bit.
pub(crate) fn matmul_many(
    items: &[(&CpuTensor, &CpuTensor)],
    mode: QuantMatmul,
) -> Result<Vec<CpuTensor>> {
    many(
        items.iter().map(|&(x, w)| (x, w, None)),
        Activation::Silu,
        mode,
    )
}

/// Independent products (gated pairs with `act` where `up` is given) as one section whose tasks are
/// blocks of output rows of one product ([`rows_per_task`]): a decode step's experts are small
/// matrices, and one section each (two per expert) cost more in hand-overs and uneven
/// finishes than their rows take to multiply. A row's value depends only on its product,
/// never on the task or thread that computes it.
fn many<'a>(
    items: impl Iterator<Item = (&'a CpuTensor, &'a CpuTensor, Option<&'a CpuTensor>)>,
    act: Activation,
    mode: QuantMatmul,
) -> Result<Vec<CpuTensor>> {
    let items: Vec<_> = items.collect();
    let mut shapes = Vec::with_capacity(items.len());
    let mut q8s = Vec::with_capacity(items.len());
    for &(x, w, up) in &items {
        let (n, k, o) = dims("matmul", x, w)?;
        if let Some(u) = up.filter(|u| u.shape != w.shape) {
            return Err(shape_err(
                "mlp",
                format!("gate {:?} and up {:?} differ", w.shape, u.shape),
            ));
        }
        let ws: Vec<&CpuTensor> = std::iter::once(w).chain(up).collect();
        q8s.push(int8_acts(x.as_f32("matmul")?, n, k, mode, &ws));
        shapes.push((n, k, o));
    }
    let mut products = Vec::with_capacity(items.len());
    for ((&(x, w, up), &(n, k, _)), q8) in items.iter().zip(&shapes).zip(&q8s) {
        let xs = x.as_f32("matmul")?;
        products.push((
            Product::new(xs, n, k, w, mode, q8.as_ref()),
            up.map(|u| Product::new(xs, n, k, u, mode, q8.as_ref())),
        ));
    }
    let mut outs: Vec<Vec<f32>> = shapes.iter().map(|&(n, _, o)| vec![0f32; o * n]).collect();
    let block = rows_per_task(
        shapes.iter().map(|&(_, _, o)| o).sum(),
        crate::team().threads(),
    );
    let mut slots = Vec::new();
    for (i, out) in outs.iter_mut().enumerate() {
        let n = shapes[i].0.max(1);
        for (b, chunk) in out.chunks_mut(block * n).enumerate() {
            slots.push(std::sync::Mutex::new(Some((i, b * block, chunk))));
        }
    }
    crate::team().run(slots.len(), &|t| {
        // Each task takes its own block, once: the lock is never contended.
        let taken = slots[t]
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .take();
        if let Some((i, row0, chunk)) = taken {
            match &products[i] {
                (gate, Some(up)) => {
                    glu_rows(gate, up, act, row0, chunk, &mut vec![0f32; chunk.len()])
                }
                (w, None) => w.rows(row0, chunk),
            }
        }
    });
    drop(slots);
    // Each product's rows turned token-major by the team too: one task per product (a
    // prefill's experts on the calling thread alone took a tenth of the step on 16 cores).
    let major = crate::team().map_chunks_mut(&mut outs, 1, |i, out_t| {
        let (n, _, o) = shapes[i];
        transposed(std::mem::take(&mut out_t[0]), n, o)
    });
    major
        .into_iter()
        .zip(items.iter().zip(&shapes))
        .map(|(out, (&(x, ..), &(_, _, o)))| token_shaped(x, out, o))
        .collect()
}

/// `(n, k, o)` of `x [n, k] · w[o, k]ᵀ`, or a shape error.
fn dims(op: &'static str, x: &CpuTensor, w: &CpuTensor) -> Result<(usize, usize, usize)> {
    let (n, k) = x.rows_cols(op)?;
    let (o, wk) = weight_dims(w)?;
    if k != wk {
        return Err(shape_err(
            op,
            format!("activation {:?} does not fit weight {:?}", x.shape, w.shape),
        ));
    }
    Ok((n, k, o))
}

/// The integer kernel for weight `w`, if `mode` and the batch size take that path.
fn int8_kind(w: &CpuTensor, n: usize, mode: QuantMatmul) -> Option<Kind> {
    match &w.storage {
        Storage::Quant { dtype, grouped, .. }
            if mode == QuantMatmul::Int8 && (n <= INT8_MAX_TOKENS || grouped.is_some()) =>
        {
            Kind::of(*dtype)
        }
        _ => None,
    }
}

/// The activations quantized once, by the calling thread, if any of `weights` takes the
/// integer path.
fn int8_acts(
    xs: &[f32],
    n: usize,
    k: usize,
    mode: QuantMatmul,
    weights: &[&CpuTensor],
) -> Option<Q8Acts> {
    weights
        .iter()
        .any(|w| int8_kind(w, n, mode).is_some())
        .then(|| Q8Acts::quantize(xs, n, k))
}

/// `out_t [o, n]` (one weight row's results together, as the kernels write them) as a
/// tensor `[.., n, o]` shaped like `x` but for its last dimension.
fn token_major(x: &CpuTensor, out_t: Vec<f32>, n: usize, o: usize) -> Result<CpuTensor> {
    token_shaped(x, transposed(out_t, n, o), o)
}

/// Token-major values `[n, o]` as a tensor shaped like `x` but for its last dimension.
fn token_shaped(x: &CpuTensor, out: Vec<f32>, o: usize) -> Result<CpuTensor> {
    let mut shape = x.shape[..x.shape.len() - 1].to_vec();
    shape.push(o);
    CpuTensor::f32(&shape, out)
}

/// `out_t [o, n]` transposed to `[n, o]`.
fn transposed(out_t: Vec<f32>, n: usize, o: usize) -> Vec<f32> {
    if n == 1 {
        out_t
    } else {
        // In 16 × 16 tiles: a row-by-row transpose wrote every value to a different cache
        // line (11 % of a 512-token prefill).
        const TILE: usize = 16;
        let mut out = vec![0f32; n * o];
        for r0 in (0..o).step_by(TILE) {
            for t0 in (0..n).step_by(TILE) {
                for t in t0..(t0 + TILE).min(n) {
                    for r in r0..(r0 + TILE).min(o) {
                        out[t * o + r] = out_t[r * n + t];
                    }
                }
            }
        }
        out
    }
}

/// One product `x [n, k] · w[o, k]ᵀ`, ready to compute any block of output rows.
struct Product<'a> {
    xs: &'a [f32],
    n: usize,
    k: usize,
    w: &'a Storage,
    /// The integer kernel, the packed weights, the quantized activations, and whether the
    /// weights are interleaved in 16-row groups.
    int8: Option<(Kind, &'a [u8], &'a Q8Acts, bool)>,
}

impl<'a> Product<'a> {
    fn new(
        xs: &'a [f32],
        n: usize,
        k: usize,
        w: &'a CpuTensor,
        mode: QuantMatmul,
        q8: Option<&'a Q8Acts>,
    ) -> Self {
        if let Some(tap) = kimi_ops::calibrate::tap() {
            if let Some(stored) = w.stored() {
                tap.input(kimi_ops::calibrate::weight_key(&stored), xs, n, k);
            }
        }
        let int8 = match (&w.storage, int8_kind(w, n, mode), q8) {
            (Storage::Quant { bytes, grouped, .. }, Some(kind), Some(q8)) => {
                Some((kind, &bytes[..], q8, grouped.is_some()))
            }
            _ => None,
        };
        Product {
            xs,
            n,
            k,
            w: &w.storage,
            int8,
        }
    }

    /// Output rows `row0..row0 + chunk.len() / n`, weight-row-major (`chunk[r * n + t]`).
    fn rows(&self, row0: usize, chunk: &mut [f32]) {
        let (xs, n, k) = (self.xs, self.n, self.k);
        let rows = chunk.len() / n.max(1);
        if let Some((kind, bytes, xq, grouped)) = self.int8 {
            let rb = kind.row_bytes(k);
            if grouped {
                // Whole groups: parts and blocks start at multiples of 16 rows, and only
                // the matrix's last group may be partial (padded in storage).
                let (gb, group) = (qdot::groups::group_bytes(kind, k), qdot::groups::GROUP);
                let w = &bytes[row0 / group * gb..(row0 + rows).div_ceil(group) * gb];
                qdot::groups::matmul_groups(kind, w, xq, chunk);
            } else {
                qdot::matmul_rows(kind, &bytes[row0 * rb..(row0 + rows) * rb], xq, chunk);
            }
            return;
        }
        if self.rows_16bit_in_registers(row0, rows, chunk) {
            return;
        }
        if n >= WIDE_MIN_TOKENS && crate::simd::wide_tiles() {
            return multiply_wide(self.w, row0, xs, k, n, chunk);
        }
        match self.w {
            Storage::F32(v) => multiply_rows(&v[row0 * k..(row0 + rows) * k], xs, n, chunk),
            // Decode: widen 16-bit weights in registers; equal to the tile path's rounding.
            Storage::Bf16(v) if n == 1 => {
                dot_rows_16bit::<false>(&v[row0 * k..(row0 + rows) * k], k, xs, chunk)
            }
            Storage::F16(v) if n == 1 => {
                dot_rows_16bit::<true>(&v[row0 * k..(row0 + rows) * k], k, xs, chunk)
            }
            // Decode on repacked AWQ / GPTQ / compressed-tensors / FP8 rows: widened in
            // registers, equal to the tile path's rounding.
            Storage::Quant {
                dtype: dtype @ (DType::Q4Z | DType::Q8Z | DType::F8S),
                bytes,
                grouped: None,
            } if n == 1 => {
                let rb = k / 32 * dtype.block_bytes();
                crate::zquant::dot_rows(*dtype, &bytes[row0 * rb..(row0 + rows) * rb], k, xs, chunk)
            }
            // Decode on MXFP4 rows (K3's experts; cold experts of a device's host tier):
            // widened in registers, equal to the tile path's rounding.
            Storage::Quant {
                dtype: DType::MXFP4,
                bytes,
                grouped: None,
            } if n == 1 => {
                let rb = k / 32 * DType::MXFP4.block_bytes();
                crate::mxfp4::dot_rows(&bytes[row0 * rb..(row0 + rows) * rb], k, xs, chunk)
            }
            Storage::Quant { .. }
            | Storage::Bf16(_)
            | Storage::F16(_)
            | Storage::Fp8Rows { .. } => {
                // Whole groups of four rows, so that `multiply_rows` can use its 4×4 kernel
                // (a tile of 3 rows at k = 2048 ran every row through the 1×4 one: 2.5×
                // slower prefill).
                let tile = ((QUANT_TILE_BYTES / (4 * k.max(1))) / 4 * 4).max(4);
                widened_rows(self.w, row0, k, n, tile, chunk, |w, _, out| {
                    multiply_rows(w, xs, n, out)
                })
            }
        }
    }
}

impl Product<'_> {
    /// Rows of 16-bit weights against several tokens by tiles of rows and tokens, widened
    /// in registers (AVX-512; equal to the tile path's rounding). `false` where that does
    /// not apply or this CPU has no such kernel.
    fn rows_16bit_in_registers(&self, row0: usize, rows: usize, chunk: &mut [f32]) -> bool {
        let (n, k) = (self.n, self.k);
        let span = row0 * k..(row0 + rows) * k;
        match self.w {
            Storage::Bf16(v) if n > 1 => {
                crate::simd::rows_16bit_by_tokens::<false>(&v[span], k, self.xs, n, chunk)
            }
            Storage::F16(v) if n > 1 => {
                crate::simd::rows_16bit_by_tokens::<true>(&v[span], k, self.xs, n, chunk)
            }
            _ => false,
        }
    }
}

/// `out[r * n + t] = wrows[r] · x[t]` for every row of `wrows [rows, k]` and token of
/// `xs [n, k]`, four rows by four tokens at a time (a lone last token, as in decode, takes
/// the single dot product, which rounds exactly as `dot4` and `dot4x4` do on AVX2 and on
/// AVX-512).
fn multiply_rows(wrows: &[f32], xs: &[f32], n: usize, out: &mut [f32]) {
    let k = xs.len() / n.max(1);
    let rows = out.len() / n.max(1);
    for t0 in (0..n).step_by(4) {
        if t0 + 1 == n {
            let x = &xs[t0 * k..(t0 + 1) * k];
            for r in 0..rows {
                out[r * n + t0] = dot(&wrows[r * k..(r + 1) * k], x);
            }
            continue;
        }
        let tok = |i: usize| {
            let t = (t0 + i).min(n - 1);
            &xs[t * k..(t + 1) * k]
        };
        let xrows = [tok(0), tok(1), tok(2), tok(3)];
        let full = rows / 4 * 4;
        let wrow = |r: usize| &wrows[r * k..(r + 1) * k];
        for r0 in (0..full).step_by(4) {
            let d = dot4x4([wrow(r0), wrow(r0 + 1), wrow(r0 + 2), wrow(r0 + 3)], xrows);
            for (r, dr) in d.iter().enumerate() {
                for (i, v) in dr.iter().enumerate().take((n - t0).min(4)) {
                    out[(r0 + r) * n + t0 + i] = *v;
                }
            }
        }
        for r in full..rows {
            let d = dot4(wrow(r), xrows);
            for (i, v) in d.iter().enumerate().take((n - t0).min(4)) {
                out[r * n + t0 + i] = *v;
            }
        }
    }
}

/// Output rows `row0..` of `storage` by [`tile_products`], four tokens at a time (two or
/// one for the last, repeating the last of three): f32 and 16-bit rows as stored,
/// block-quantized ones dequantized a tile at a time. The AVX2 path for
/// [`WIDE_MIN_TOKENS`] or more tokens.
fn multiply_wide(storage: &Storage, row0: usize, xs: &[f32], k: usize, n: usize, out: &mut [f32]) {
    let rows = out.len() / n;
    let (at, end) = (row0 * k, (row0 + rows) * k);
    match storage {
        Storage::F32(v) => tiles_over_tokens(TileRows::F32(&v[at..end]), rows, k, xs, n, out),
        Storage::F16(v) => tiles_over_tokens(TileRows::F16(&v[at..end]), rows, k, xs, n, out),
        Storage::Bf16(v) => tiles_over_tokens(TileRows::Bf16(&v[at..end]), rows, k, xs, n, out),
        Storage::Quant { .. } | Storage::Fp8Rows { .. } => {
            let tile = (WIDE_QUANT_TILE_BYTES / (4 * k.max(1))).max(2);
            widened_rows(storage, row0, k, n, tile, out, |w, num, out| {
                tiles_over_tokens(TileRows::F32(w), num, k, xs, n, out)
            })
        }
    }
}

/// Every token of `xs` against the `rows` rows of `w`, into `out[r * n + t]`.
fn tiles_over_tokens(
    w: TileRows<'_>,
    rows: usize,
    k: usize,
    xs: &[f32],
    n: usize,
    out: &mut [f32],
) {
    let mut acc = vec![[0f32; 8]; rows * 2 * 4];
    let mut res = vec![0f32; rows * 4];
    let mut t0 = 0;
    while t0 < n {
        let (acc, res) = (&mut acc[..], &mut res[..]);
        t0 += match n - t0 {
            1 => tokens_tile::<1>(w, rows, k, xs, n, t0, acc, res, out),
            2 => tokens_tile::<2>(w, rows, k, xs, n, t0, acc, res, out),
            _ => tokens_tile::<4>(w, rows, k, xs, n, t0, acc, res, out),
        };
    }
}

/// Tokens `t0..t0 + T` (those below `n`) against the `rows` rows of `w`, into
/// `out[r * n + t]`; returns how many tokens it wrote.
#[allow(clippy::too_many_arguments)]
fn tokens_tile<const T: usize>(
    w: TileRows<'_>,
    rows: usize,
    k: usize,
    xs: &[f32],
    n: usize,
    t0: usize,
    acc: &mut [[f32; 8]],
    res: &mut [f32],
    out: &mut [f32],
) -> usize {
    let x: [&[f32]; T] = std::array::from_fn(|i| {
        let t = (t0 + i).min(n - 1);
        &xs[t * k..(t + 1) * k]
    });
    let real = (n - t0).min(T);
    let res = &mut res.as_chunks_mut::<T>().0[..rows];
    tile_products(w, rows, k, x, acc, res);
    for (r, d) in res.iter().enumerate() {
        out[r * n + t0..r * n + t0 + real].copy_from_slice(&d[..real]);
    }
    real
}

/// Batches from this size take [`multiply_wide`] where [`crate::simd::wide_tiles`] holds
/// (measured at 32 and 128 tokens; smaller batches keep the paths they had).
const WIDE_MIN_TOKENS: usize = 4;

/// Bytes of dequantized rows [`multiply_wide`] keeps at once: a share of L2 (512 KiB on
/// Zen 3), since each four tokens pass over all of them (an L1-sized tile of four rows
/// re-read every token from L3 for each four rows).
const WIDE_QUANT_TILE_BYTES: usize = 128 * 1024;

/// Bytes of dequantized weight rows a task keeps at once: half of a 48 KiB L1 data cache.
const QUANT_TILE_BYTES: usize = 24 * 1024;

/// Block-quantized or 16-bit weights: widens `tile` rows at a time into a buffer and hands
/// each tile to `multiply(rows, count, out)`, so each weight byte is read once and no large
/// f32 copy of the weights is written (16-bit prefill used to widen a task's whole chunk).
fn widened_rows(
    storage: &Storage,
    row0: usize,
    k: usize,
    n: usize,
    tile: usize,
    out: &mut [f32],
    multiply: impl Fn(&[f32], usize, &mut [f32]),
) {
    let rows = out.len() / n.max(1);
    let tile = tile.min(rows.max(1));
    let mut buf = vec![0f32; tile * k];
    for r0 in (0..rows).step_by(tile) {
        let num = tile.min(rows - r0);
        for r in 0..num {
            row_to_f32(storage, (row0 + r0 + r) * k, &mut buf[r * k..(r + 1) * k]);
        }
        multiply(&buf[..num * k], num, &mut out[r0 * n..(r0 + num) * n]);
    }
}

/// `[out, in]` of a weight; 3-D conv-style weights `[C, 1, W]` count as `[C, W]`.
fn weight_dims(w: &CpuTensor) -> Result<(usize, usize)> {
    match w.shape.as_slice() {
        [o, k] => Ok((*o, *k)),
        _ => Err(shape_err(
            "matmul",
            format!("weight must be 2-D, got {:?}", w.shape),
        )),
    }
}

#[cfg(test)]
mod tests;
