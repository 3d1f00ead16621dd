//! Dot-product and dequantization kernels with a portable fallback, an AVX2+FMA variant and
//! an AVX-512 variant chosen at run time.
//!
//! These are the inner loops of every f32 matmul. The SIMD functions are `unsafe` only
//! because they need the CPU features that the dispatcher checks first. On AVX-512 every
//! product (`dot`, `dot4`, `dot4x4`) sums each pair of rows in the same order (16 lanes,
//! masked tail, one reduction), so a token's result does not depend on how many tokens or
//! rows were computed with it.

mod tokens16;
pub use tokens16::rows_16bit_by_tokens;

/// `out[r][t] = w[r] · x[t]` for four weight rows and four token rows at once: on AVX-512
/// sixteen accumulators, so each loaded vector feeds four FMAs (prefill is bound by the
/// FMA rate, not by loads); on AVX2 two rows by four tokens per pass. Every row must be at
/// least `w[0].len()` long.
pub fn dot4x4(w: [&[f32]; 4], x: [&[f32]; 4]) -> [[f32; 4]; 4] {
    #[cfg(target_arch = "x86_64")]
    {
        if has_avx512() {
            // SAFETY: AVX-512F was detected on this CPU just above.
            return unsafe { avx512::dot4x4(w, x) };
        }
        if has_avx2_fma() {
            // SAFETY: the AVX2 and FMA features were detected on this CPU just above.
            return unsafe { avx2::dot4x4(w, x) };
        }
    }
    w.map(|row| dot4(row, x))
}

/// Values of a row per block of [`tile_products`]: the four tokens' block (4 KiB) stays in
/// L1 while every row's block passes it.
pub const TILE_BLOCK: usize = 256;

/// Weight rows for [`tile_products`], row-major `[rows, k]` as stored: 16-bit rows are
/// widened in registers (a widening pass over an f16 model's weights, and a copy into a
/// blocked layout, took a quarter of its prefill).
#[derive(Clone, Copy, Debug)]
pub enum TileRows<'a> {
    /// f32 values.
    F32(&'a [f32]),
    /// IEEE half-precision bits.
    F16(&'a [u16]),
    /// bfloat16 bits.
    Bf16(&'a [u16]),
}

impl TileRows<'_> {
    fn len(&self) -> usize {
        match self {
            TileRows::F32(v) => v.len(),
            TileRows::F16(v) | TileRows::Bf16(v) => v.len(),
        }
    }

    /// Row `r` (of length `k`) widened to f32.
    fn row(&self, r: usize, k: usize) -> Vec<f32> {
        match self {
            TileRows::F32(v) => v[r * k..(r + 1) * k].to_vec(),
            TileRows::F16(v) => v[r * k..(r + 1) * k]
                .iter()
                .map(|&b| widen_16bit::<true>(b))
                .collect(),
            TileRows::Bf16(v) => v[r * k..(r + 1) * k]
                .iter()
                .map(|&b| widen_16bit::<false>(b))
                .collect(),
        }
    }
}

/// Whether [`tile_products`] is this CPU's fastest product of several rows by several
/// tokens: AVX2 (with F16C) without AVX-512. AVX-512 keeps [`dot4x4`], whose sixteen
/// accumulators already fill its FMA pipes.
pub fn wide_tiles() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        !has_avx512() && has_avx2_fma_f16c()
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// `out[r][t] = w[r] · x[t]` for the `rows` rows of `w` and `T` token rows, each equal to
/// [`dot`] of the (widened) row bit for bit. On AVX2 (see [`wide_tiles`]) three rows by
/// four tokens hold twelve accumulators per pass (`dot4x4`'s two rows by four left the FMA
/// pipes waiting on their latency), kept in `acc` between blocks of [`TILE_BLOCK`] values
/// so that the tokens' block stays in L1. `acc` needs `rows * 2 * T` vectors of eight
/// values.
pub fn tile_products<const T: usize>(
    w: TileRows<'_>,
    rows: usize,
    k: usize,
    x: [&[f32]; T],
    acc: &mut [[f32; 8]],
    out: &mut [[f32; T]],
) {
    assert!(
        w.len() >= rows * k
            && x.iter().all(|r| r.len() >= k)
            && acc.len() >= rows * 2 * T
            && out.len() >= rows,
        "tile_products: {rows} rows of {k} in {} values, {} accumulators, {} outputs",
        w.len(),
        acc.len(),
        out.len()
    );
    #[cfg(target_arch = "x86_64")]
    {
        if wide_tiles() {
            // SAFETY: AVX2, FMA and F16C were detected on this CPU just above; the lengths
            // were asserted.
            unsafe {
                match w {
                    TileRows::F32(v) => {
                        avx2::tile_products::<avx2::AsF32, T>(v, rows, k, x, acc, out)
                    }
                    TileRows::F16(v) => {
                        avx2::tile_products::<avx2::AsF16, T>(v, rows, k, x, acc, out)
                    }
                    TileRows::Bf16(v) => {
                        avx2::tile_products::<avx2::AsBf16, T>(v, rows, k, x, acc, out)
                    }
                }
            }
            return;
        }
    }
    for (r, o) in out.iter_mut().enumerate().take(rows) {
        let row = w.row(r, k);
        *o = x.map(|xt| dot(&row, xt));
    }
}

/// One 16-bit value widened to f32 (exact for both formats).
fn widen_16bit<const F16: bool>(v: u16) -> f32 {
    if F16 {
        half::f16::from_bits(v).to_f32()
    } else {
        f32::from_bits(u32::from(v) << 16)
    }
}

/// `Σ w[i]·x_t[i]` for four token rows `x_t` at once, so each weight element is loaded once
/// per four tokens. Rows shorter than four tokens pass the same slice several times.
pub fn dot4(w: &[f32], x: [&[f32]; 4]) -> [f32; 4] {
    #[cfg(target_arch = "x86_64")]
    {
        if has_avx512() {
            // SAFETY: AVX-512F was detected on this CPU just above.
            return unsafe { avx512::dot4x4([w, w, w, w], x)[0] };
        }
        if has_avx2_fma() {
            // SAFETY: the AVX2 and FMA features were detected on this CPU just above.
            return unsafe { avx2::dot4(w, x) };
        }
    }
    dot4_scalar(w, x)
}

/// `Σ w[i]·x[i]` for a row of bf16 weights, widened in registers on AVX-512 and AVX2 (decode reads
/// the bf16 bytes once and writes no f32 copy). Equals `dot` of the widened row bit for bit
/// on every variant. `x` must be at least `w.len()` long.
pub fn dot_bf16(w: &[u16], x: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    {
        if has_avx512() && has_avx512_bw_vl() {
            // SAFETY: AVX-512F and BW were detected on this CPU just above.
            return unsafe { avx512::dot_16bit::<false>(w, x) };
        }
        if has_avx2_fma_f16c() {
            // SAFETY: AVX2, FMA and F16C were detected on this CPU just above.
            return unsafe { avx2::dot_16bit::<false>(w, x) };
        }
    }
    let widen = |b: &u16| f32::from_bits(u32::from(*b) << 16);
    let mut buf = [0f32; 4096];
    match w.len() <= buf.len() {
        true => {
            for (o, b) in buf.iter_mut().zip(w) {
                *o = widen(b);
            }
            dot(&buf[..w.len()], x)
        }
        false => dot(&w.iter().map(widen).collect::<Vec<_>>(), x),
    }
}

/// `Σ w[i]·x[i]` for a row of f16 weights, widened in registers on AVX-512 and AVX2 (`vcvtph2ps`,
/// exact), so decode reads the f16 bytes once. Equals `dot` of the widened row bit for bit
/// on every variant. `x` must be at least `w.len()` long.
pub fn dot_f16(w: &[u16], x: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    {
        if has_avx512() && has_avx512_bw_vl() {
            // SAFETY: AVX-512F and BW were detected on this CPU just above.
            return unsafe { avx512::dot_16bit::<true>(w, x) };
        }
        if has_avx2_fma_f16c() {
            // SAFETY: AVX2, FMA and F16C were detected on this CPU just above.
            return unsafe { avx2::dot_16bit::<true>(w, x) };
        }
    }
    use half::slice::{HalfBitsSliceExt, HalfFloatSliceExt};
    let halves = w.reinterpret_cast::<half::f16>();
    let mut buf = [0f32; 4096];
    match w.len() <= buf.len() {
        true => {
            halves.convert_to_f32_slice(&mut buf[..w.len()]);
            dot(&buf[..w.len()], x)
        }
        false => dot(&halves.to_f32_vec(), x),
    }
}

/// `out[r] = w[r] · x` for every row of `k` 16-bit weights in `w` (f16 when `F16`, else
/// bf16), equal bit for bit to [`dot_f16`] / [`dot_bf16`] per row. On AVX-512 and AVX2 four rows go
/// together, each with its own accumulator in the same order, so that four weight streams
/// are in flight (one row at a time left decode of an F16 model short of the memory
/// bandwidth).
pub fn dot_rows_16bit<const F16: bool>(w: &[u16], k: usize, x: &[f32], out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    {
        if has_avx512() && has_avx512_bw_vl() {
            // SAFETY: AVX-512F, BW and VL were detected on this CPU just above.
            return unsafe { avx512::rows_16bit::<F16>(w, k, x, out) };
        }
        if has_avx2_fma_f16c() {
            // SAFETY: AVX2, FMA and F16C were detected on this CPU just above.
            return unsafe { avx2::rows_16bit::<F16>(w, k, x, out) };
        }
    }
    for (r, o) in out.iter_mut().enumerate() {
        let row = &w[r * k..(r + 1) * k];
        *o = if F16 {
            dot_f16(row, x)
        } else {
            dot_bf16(row, x)
        };
    }
}

/// `Σ a[i]·b[i]` over the shorter of the two slices.
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len().min(b.len());
    let (a, b) = (&a[..n], &b[..n]);
    #[cfg(target_arch = "x86_64")]
    {
        if has_avx512() {
            // SAFETY: AVX-512F was detected on this CPU just above.
            return unsafe { avx512::dot(a, b) };
        }
        if has_avx2_fma() {
            // SAFETY: the AVX2 and FMA features were detected on this CPU just above.
            return unsafe { avx2::dot(a, b) };
        }
    }
    dot_scalar(a, b)
}

/// `out[i] += p · v[i]` over the shorter of the two slices, rounded as the scalar loop
/// rounds it (a product, then a sum: no fused multiply-add), eight lanes at a time where
/// the CPU has AVX2.
pub fn add_scaled(out: &mut [f32], p: f32, v: &[f32]) {
    let n = out.len().min(v.len());
    let (out, v) = (&mut out[..n], &v[..n]);
    #[cfg(target_arch = "x86_64")]
    {
        if has_avx2_fma() {
            // SAFETY: the AVX2 and FMA features were detected on this CPU just above.
            return unsafe { avx2::add_scaled(out, p, v) };
        }
    }
    for (o, &x) in out.iter_mut().zip(v) {
        *o += p * x;
    }
}

/// `scores[s] = q · row s` for the rows of a strided run, row `s` at
/// `rows[s * stride..][..q.len()]`: each score is [`dot`]'s, bit for bit, with one dispatch
/// per run instead of one per row (attention's scores over a cache block).
pub fn dot_strided(q: &[f32], rows: &[f32], stride: usize, scores: &mut [f32]) {
    let d = q.len();
    if let Some(last) = scores.len().checked_sub(1) {
        assert!(
            rows.len() >= last * stride + d,
            "dot_strided: rows too short"
        );
    }
    #[cfg(target_arch = "x86_64")]
    {
        if !has_avx512() && has_avx2_fma() {
            // SAFETY: AVX2 and FMA were detected just above; every row is in `rows`
            // (asserted).
            return unsafe { avx2::dot_strided(q, rows, stride, scores) };
        }
    }
    for (s, score) in scores.iter_mut().enumerate() {
        *score = dot(q, &rows[s * stride..][..d]);
    }
}

/// `out += Σ_s p[s] · row s` over a strided run (rows as in [`dot_strided`]), the rows
/// added in order and each term rounded as [`add_scaled`] rounds it: the result of calling
/// `add_scaled` row by row, with `out` held in registers across the rows.
pub fn add_scaled_strided(out: &mut [f32], p: &[f32], rows: &[f32], stride: usize) {
    let d = out.len();
    if let Some(last) = p.len().checked_sub(1) {
        assert!(
            rows.len() >= last * stride + d,
            "add_scaled_strided: rows too short"
        );
    }
    #[cfg(target_arch = "x86_64")]
    {
        if has_avx2_fma() {
            // SAFETY: AVX2 and FMA were detected just above; every row is in `rows`
            // (asserted).
            return unsafe { avx2::add_scaled_strided(out, p, rows, stride) };
        }
    }
    for (s, &ps) in p.iter().enumerate() {
        add_scaled(out, ps, &rows[s * stride..][..d]);
    }
}

/// [`dot_strided`] over rows of f16 bit patterns: each score is `dot_strided`'s on the
/// rows widened to f32, bit for bit (attention over an f16 key cache).
pub fn dot_strided_f16(q: &[f32], rows: &[u16], stride: usize, scores: &mut [f32]) {
    let d = q.len();
    if let Some(last) = scores.len().checked_sub(1) {
        assert!(
            rows.len() >= last * stride + d,
            "dot_strided_f16: rows too short"
        );
    }
    #[cfg(target_arch = "x86_64")]
    {
        if !has_avx512() && has_avx2_fma_f16c() {
            // SAFETY: AVX2, FMA and F16C were detected just above; every row is in `rows`
            // (asserted).
            return unsafe { avx2::dot_strided_f16(q, rows, stride, scores) };
        }
    }
    let mut row = vec![0f32; d];
    for (s, score) in scores.iter_mut().enumerate() {
        widen_f16(&rows[s * stride..][..d], &mut row);
        *score = dot(q, &row);
    }
}

/// [`add_scaled_strided`] over rows of f16 bit patterns, widened to f32: bit for bit
/// `add_scaled_strided` on the widened rows.
pub fn add_scaled_strided_f16(out: &mut [f32], p: &[f32], rows: &[u16], stride: usize) {
    let d = out.len();
    if let Some(last) = p.len().checked_sub(1) {
        assert!(
            rows.len() >= last * stride + d,
            "add_scaled_strided_f16: rows too short"
        );
    }
    #[cfg(target_arch = "x86_64")]
    {
        if has_avx2_fma_f16c() {
            // SAFETY: AVX2, FMA and F16C were detected just above; every row is in `rows`
            // (asserted).
            return unsafe { avx2::add_scaled_strided_f16(out, p, rows, stride) };
        }
    }
    let mut row = vec![0f32; d];
    for (s, &ps) in p.iter().enumerate() {
        widen_f16(&rows[s * stride..][..d], &mut row);
        add_scaled(out, ps, &row);
    }
}

/// f16 bit patterns to f32, exactly.
fn widen_f16(src: &[u16], out: &mut [f32]) {
    for (o, &h) in out.iter_mut().zip(src) {
        *o = crate::quant::f16_to_f32(h);
    }
}

/// The portable `dot`: eight lanes, then the tail.
pub fn dot_scalar(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len().min(b.len());
    let mut acc = [0f32; 8];
    let full = n / 8 * 8;
    for i in (0..full).step_by(8) {
        for l in 0..8 {
            acc[l] += a[i + l] * b[i + l];
        }
    }
    // The tail is added term by term onto the lanes' sum, exactly as `dot4_scalar` does, so
    // a token's result does not depend on whether it went through `dot` (a lone token) or
    // `dot4` (a group): batches give each sequence the numbers it gets alone.
    let mut s: f32 = acc.iter().sum();
    for i in full..n {
        s += a[i] * b[i];
    }
    s
}

/// Dequantizes whole blocks of a Q8_0/Q4_0/Q4_1 weight row: AVX2 when the CPU has it, else
/// the portable loops of `crate::quant` (the tests check the two against each other and
/// against `kimi-gguf`).
pub(crate) fn dequantize_legacy(kind: crate::quant::Legacy, bytes: &[u8], out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    {
        if has_avx2_fma() {
            // SAFETY: the AVX2 and FMA features were detected on this CPU just above.
            return unsafe { avx2::dequantize_legacy(kind, bytes, out) };
        }
    }
    crate::quant::dequantize_legacy(kind, bytes, out)
}

/// Portable version: eight independent lanes per token so the compiler can vectorise
/// without reassociating a single running sum.
pub fn dot4_scalar(w: &[f32], x: [&[f32]; 4]) -> [f32; 4] {
    let n = w.len();
    let mut acc = [[0f32; 8]; 4];
    let full = n / 8 * 8;
    for i in (0..full).step_by(8) {
        let wc = &w[i..i + 8];
        for (t, xt) in x.iter().enumerate() {
            let xc = &xt[i..i + 8];
            for l in 0..8 {
                acc[t][l] += wc[l] * xc[l];
            }
        }
    }
    let mut out = [0f32; 4];
    for t in 0..4 {
        let mut s: f32 = acc[t].iter().sum();
        for i in full..n {
            s += w[i] * x[t][i];
        }
        out[t] = s;
    }
    out
}

/// Makes the calling thread treat subnormal floats as zero (x86: MXCSR FTZ and DAZ bits;
/// AArch64: FPCR.FZ).
pub fn flush_subnormals_to_zero() {
    fp_mode::write(fp_mode::flushing(fp_mode::read()));
}

/// Flushes subnormal floats to zero on the calling thread while it lives, as
/// [`flush_subnormals_to_zero`] does; dropping it restores the thread's previous mode.
pub(crate) struct FlushSubnormals {
    saved: fp_mode::Bits,
    /// The mode belongs to this thread: the guard must be dropped where it was made.
    _this_thread: std::marker::PhantomData<*const ()>,
}

impl FlushSubnormals {
    pub(crate) fn new() -> Self {
        let saved = fp_mode::read();
        fp_mode::write(fp_mode::flushing(saved));
        FlushSubnormals {
            saved,
            _this_thread: std::marker::PhantomData,
        }
    }
}

impl Drop for FlushSubnormals {
    fn drop(&mut self) {
        fp_mode::write(self.saved);
    }
}

/// The calling thread's floating-point control register. Only values read from it, with
/// the flush bits added, are written back: rounding and exception masks never change.
mod fp_mode {
    #[cfg(target_arch = "x86_64")]
    pub(super) type Bits = u32;

    /// `bits` with MXCSR FTZ (bit 15) and DAZ (bit 6) set.
    #[cfg(target_arch = "x86_64")]
    pub(super) fn flushing(bits: Bits) -> Bits {
        bits | (1 << 15) | (1 << 6)
    }

    #[cfg(target_arch = "x86_64")]
    pub(super) fn read() -> Bits {
        let mut csr: u32 = 0;
        // SAFETY: stmxcsr stores this thread's SSE control register (SSE is part of x86_64)
        // into a live local.
        unsafe {
            std::arch::asm!("stmxcsr [{}]", in(reg) &mut csr, options(nostack, preserves_flags));
        }
        csr
    }

    #[cfg(target_arch = "x86_64")]
    pub(super) fn write(csr: Bits) {
        // SAFETY: ldmxcsr loads this thread's SSE control register from a live local. `csr`
        // is a value `read` returned, maybe with FTZ/DAZ added, which only changes how
        // subnormal values are treated; no code here relies on them.
        unsafe {
            std::arch::asm!("ldmxcsr [{}]", in(reg) &csr, options(nostack, preserves_flags));
        }
    }

    #[cfg(target_arch = "aarch64")]
    pub(super) type Bits = u64;

    /// `bits` with FPCR.FZ (bit 24) set.
    #[cfg(target_arch = "aarch64")]
    pub(super) fn flushing(bits: Bits) -> Bits {
        bits | (1 << 24)
    }

    #[cfg(target_arch = "aarch64")]
    pub(super) fn read() -> Bits {
        let fpcr: u64;
        // SAFETY: reads this thread's floating-point control register.
        unsafe {
            std::arch::asm!("mrs {}, fpcr", out(reg) fpcr, options(nomem, nostack, preserves_flags));
        }
        fpcr
    }

    #[cfg(target_arch = "aarch64")]
    pub(super) fn write(fpcr: Bits) {
        // SAFETY: writes this thread's floating-point control register with a value `read`
        // returned, maybe with FZ added, which only flushes subnormal values to zero. Not
        // `nomem`: loads and stores of float results must not move across the mode switch.
        unsafe {
            std::arch::asm!("msr fpcr, {}", in(reg) fpcr, options(nostack, preserves_flags));
        }
    }

    // Elsewhere there is no mode to set.
    #[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
    pub(super) type Bits = ();
    #[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
    pub(super) fn flushing(_: Bits) -> Bits {}
    #[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
    pub(super) fn read() -> Bits {}
    #[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
    pub(super) fn write(_: Bits) {}
}

#[cfg(target_arch = "x86_64")]
pub(crate) fn has_avx2_fma() -> bool {
    std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma")
}

#[cfg(target_arch = "x86_64")]
fn has_avx2_fma_f16c() -> bool {
    has_avx2_fma() && std::is_x86_feature_detected!("f16c")
}

#[cfg(target_arch = "x86_64")]
pub(crate) fn has_avx512() -> bool {
    std::is_x86_feature_detected!("avx512f")
}

#[cfg(target_arch = "x86_64")]
fn has_avx512_bw_vl() -> bool {
    std::is_x86_feature_detected!("avx512bw") && std::is_x86_feature_detected!("avx512vl")
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::*;

    /// Lanes `0..len` set (the masked tail of a row).
    #[inline]
    fn tail_mask(len: usize) -> __mmask16 {
        ((1u32 << len.min(16)) - 1) as __mmask16
    }

    /// # Safety
    /// The CPU must support AVX-512F; `b` must be at least `a.len()` long.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn dot(a: &[f32], b: &[f32]) -> f32 {
        let n = a.len();
        assert!(b.len() >= n, "dot: second row shorter than the first");
        let mut acc = _mm512_setzero_ps();
        let mut i = 0;
        while i < n {
            let m = tail_mask(n - i);
            // SAFETY: the mask covers only indices below n, inside both slices; masked-off
            // lanes are not read.
            unsafe {
                let x = _mm512_maskz_loadu_ps(m, a.as_ptr().add(i));
                let y = _mm512_maskz_loadu_ps(m, b.as_ptr().add(i));
                acc = _mm512_fmadd_ps(x, y, acc);
            }
            i += 16;
        }
        _mm512_reduce_add_ps(acc)
    }

    /// `Σ w[i]·x[i]` for 16-bit weights: f16 when `F16`, else bf16 (both widen exactly).
    ///
    /// # Safety
    /// The CPU must support AVX-512F, BW and VL (the 256-bit masked load is a VL
    /// instruction: without VL enabled here it compiled to a call per 16 values, 13 % of
    /// an F16 model's decode).
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    pub unsafe fn dot_16bit<const F16: bool>(w: &[u16], x: &[f32]) -> f32 {
        let n = w.len();
        assert!(
            x.len() >= n,
            "dot_16bit: activation row shorter than the weights"
        );
        let mut acc = _mm512_setzero_ps();
        let mut i = 0;
        while i < n {
            let m = tail_mask(n - i);
            // SAFETY: the mask covers only indices below n, inside both slices; masked-off
            // lanes are not read (and widen to +0.0). bf16 → f32 is a 16-bit left shift.
            unsafe {
                let h = _mm256_maskz_loadu_epi16(m, w.as_ptr().add(i).cast());
                let wf = if F16 {
                    _mm512_cvtph_ps(h)
                } else {
                    _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16))
                };
                let xv = _mm512_maskz_loadu_ps(m, x.as_ptr().add(i));
                acc = _mm512_fmadd_ps(wf, xv, acc);
            }
            i += 16;
        }
        _mm512_reduce_add_ps(acc)
    }

    /// `out[r] = dot_16bit(w[r], x)` for the `out.len()` rows of `k` values in `w`, four
    /// rows per pass (see `dot_rows_16bit`).
    ///
    /// # Safety
    /// The CPU must support AVX-512F, BW and VL.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    pub unsafe fn rows_16bit<const F16: bool>(w: &[u16], k: usize, x: &[f32], out: &mut [f32]) {
        let rows = out.len();
        assert!(
            w.len() >= rows * k && x.len() >= k,
            "rows_16bit: {} weights for {rows} rows of {k}, {} activations",
            w.len(),
            x.len()
        );
        let widen = |h: __m256i| {
            if F16 {
                _mm512_cvtph_ps(h)
            } else {
                _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16))
            }
        };
        let full = rows / 4 * 4;
        for r0 in (0..full).step_by(4) {
            let mut acc = [_mm512_setzero_ps(); 4];
            let mut i = 0;
            while i < k {
                let m = tail_mask(k - i);
                // SAFETY: the mask covers only indices below k, inside row r0 + j < rows
                // of `w` and inside `x` (asserted); masked-off lanes are not read.
                unsafe {
                    let xv = _mm512_maskz_loadu_ps(m, x.as_ptr().add(i));
                    for (j, a) in acc.iter_mut().enumerate() {
                        let p = w.as_ptr().add((r0 + j) * k + i);
                        let h = _mm256_maskz_loadu_epi16(m, p.cast());
                        *a = _mm512_fmadd_ps(widen(h), xv, *a);
                    }
                }
                i += 16;
            }
            for (j, a) in acc.iter().enumerate() {
                out[r0 + j] = _mm512_reduce_add_ps(*a);
            }
        }
        for r in full..rows {
            // SAFETY: features as this function's; row r lies inside `w` (asserted).
            out[r] = unsafe { dot_16bit::<F16>(&w[r * k..(r + 1) * k], x) };
        }
    }

    /// # Safety
    /// The CPU must support AVX-512F; every `x[t]` and `w[r]` must be at least `w[0].len()`
    /// long.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn dot4x4(w: [&[f32]; 4], x: [&[f32]; 4]) -> [[f32; 4]; 4] {
        let n = w[0].len();
        assert!(
            w.iter().chain(&x).all(|r| r.len() >= n),
            "dot4x4: row shorter than the first weight row"
        );
        let mut acc = [[_mm512_setzero_ps(); 4]; 4];
        let mut i = 0;
        while i < n {
            let m = tail_mask(n - i);
            // SAFETY: the mask covers only indices below n, inside every row (asserted).
            unsafe {
                let wv = w.map(|r| _mm512_maskz_loadu_ps(m, r.as_ptr().add(i)));
                let xv = x.map(|r| _mm512_maskz_loadu_ps(m, r.as_ptr().add(i)));
                for r in 0..4 {
                    for t in 0..4 {
                        acc[r][t] = _mm512_fmadd_ps(wv[r], xv[t], acc[r][t]);
                    }
                }
            }
            i += 16;
        }
        acc.map(|row| row.map(|a| _mm512_reduce_add_ps(a)))
    }
}

#[cfg(target_arch = "x86_64")]
pub(crate) mod avx2 {
    use std::arch::x86_64::*;

    /// How many rows ahead `rows_16bit` asks for weight lines: the pass after next's four
    /// rows, at the column being read. Four 16-bit rows were four streams left to the
    /// hardware prefetcher; cold f16 `[1024, 1024]` decode products took 80 µs on two EPYC
    /// cores, 69 µs with 4 or 8 rows of lead (`[3336, 1024]`: 246 → 225 and 216 µs,
    /// `examples/cold_bench.rs`).
    const STREAM_LEAD_ROWS: usize = 8;

    /// # Safety
    /// The CPU must support AVX2 and FMA; every `x[t]` must be at least `w.len()` long.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn dot4(w: &[f32], x: [&[f32]; 4]) -> [f32; 4] {
        let n = w.len();
        assert!(
            x.iter().all(|r| r.len() >= n),
            "dot4: token row shorter than weight row"
        );
        let full = n / 16 * 16;
        let mut a0 = _mm256_setzero_ps();
        let mut a1 = _mm256_setzero_ps();
        let mut a2 = _mm256_setzero_ps();
        let mut a3 = _mm256_setzero_ps();
        let mut b0 = _mm256_setzero_ps();
        let mut b1 = _mm256_setzero_ps();
        let mut b2 = _mm256_setzero_ps();
        let mut b3 = _mm256_setzero_ps();
        let wp = w.as_ptr();
        let (p0, p1, p2, p3) = (x[0].as_ptr(), x[1].as_ptr(), x[2].as_ptr(), x[3].as_ptr());
        let mut i = 0;
        while i < full {
            // SAFETY: i + 16 <= n and every row holds at least n elements (asserted above).
            unsafe {
                let w0 = _mm256_loadu_ps(wp.add(i));
                let w1 = _mm256_loadu_ps(wp.add(i + 8));
                a0 = _mm256_fmadd_ps(w0, _mm256_loadu_ps(p0.add(i)), a0);
                a1 = _mm256_fmadd_ps(w0, _mm256_loadu_ps(p1.add(i)), a1);
                a2 = _mm256_fmadd_ps(w0, _mm256_loadu_ps(p2.add(i)), a2);
                a3 = _mm256_fmadd_ps(w0, _mm256_loadu_ps(p3.add(i)), a3);
                b0 = _mm256_fmadd_ps(w1, _mm256_loadu_ps(p0.add(i + 8)), b0);
                b1 = _mm256_fmadd_ps(w1, _mm256_loadu_ps(p1.add(i + 8)), b1);
                b2 = _mm256_fmadd_ps(w1, _mm256_loadu_ps(p2.add(i + 8)), b2);
                b3 = _mm256_fmadd_ps(w1, _mm256_loadu_ps(p3.add(i + 8)), b3);
            }
            i += 16;
        }
        let mut out = [
            hsum(_mm256_add_ps(a0, b0)),
            hsum(_mm256_add_ps(a1, b1)),
            hsum(_mm256_add_ps(a2, b2)),
            hsum(_mm256_add_ps(a3, b3)),
        ];
        for j in full..n {
            for (t, o) in out.iter_mut().enumerate() {
                *o += w[j] * x[t][j];
            }
        }
        out
    }

    /// `dot4` of four rows, bit for bit: each `dot4` accumulator (the 8 lanes of every
    /// 16-value step's first half, then of its second half) is its own pass over two rows
    /// by four tokens, eight accumulators beside two weight vectors (the four `dot4` calls
    /// this replaces loaded every token vector once per row).
    ///
    /// # Safety
    /// The CPU must support AVX2 and FMA; every `x[t]` and `w[r]` must be at least
    /// `w[0].len()` long.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn dot4x4(w: [&[f32]; 4], x: [&[f32]; 4]) -> [[f32; 4]; 4] {
        let n = w[0].len();
        assert!(
            w.iter().chain(&x).all(|r| r.len() >= n),
            "dot4x4: a row shorter than the first weight row"
        );
        let full = n / 16 * 16;
        let xp = x.map(|r| r.as_ptr());
        let mut out = [[0f32; 4]; 4];
        for pair in 0..2 {
            let (w0, w1) = (w[2 * pair].as_ptr(), w[2 * pair + 1].as_ptr());
            // [half of the 16-value step][row of the pair][token]
            let mut sums = [[[_mm256_setzero_ps(); 4]; 2]; 2];
            for (half, sum) in sums.iter_mut().enumerate() {
                let mut acc = [[_mm256_setzero_ps(); 4]; 2];
                let mut i = 8 * half;
                while i < full {
                    // SAFETY: i + 8 <= full <= n, inside every row (asserted).
                    unsafe {
                        let (a, b) = (_mm256_loadu_ps(w0.add(i)), _mm256_loadu_ps(w1.add(i)));
                        for t in 0..4 {
                            let xv = _mm256_loadu_ps(xp[t].add(i));
                            acc[0][t] = _mm256_fmadd_ps(a, xv, acc[0][t]);
                            acc[1][t] = _mm256_fmadd_ps(b, xv, acc[1][t]);
                        }
                    }
                    i += 16;
                }
                *sum = acc;
            }
            for r in 0..2 {
                let row = w[2 * pair + r];
                for t in 0..4 {
                    let mut o = hsum(_mm256_add_ps(sums[0][r][t], sums[1][r][t]));
                    for j in full..n {
                        o += row[j] * x[t][j];
                    }
                    out[2 * pair + r][t] = o;
                }
            }
        }
        out
    }

    /// How [`tile_products`] reads a weight row's values.
    pub trait RowFormat {
        type Elem: Copy;
        /// Eight values from `p` as f32.
        ///
        /// # Safety
        /// AVX2 and F16C from the caller; `p` has eight readable values.
        unsafe fn load8(p: *const Self::Elem) -> __m256;
        /// One value as f32 (the tail).
        fn one(v: Self::Elem) -> f32;
    }

    pub struct AsF32;
    pub struct AsF16;
    pub struct AsBf16;

    impl RowFormat for AsF32 {
        type Elem = f32;
        #[inline(always)]
        unsafe fn load8(p: *const f32) -> __m256 {
            // SAFETY: as the caller guarantees.
            unsafe { _mm256_loadu_ps(p) }
        }
        fn one(v: f32) -> f32 {
            v
        }
    }

    impl RowFormat for AsF16 {
        type Elem = u16;
        #[inline(always)]
        unsafe fn load8(p: *const u16) -> __m256 {
            // SAFETY: as the caller guarantees.
            unsafe { widen8::<true>(p) }
        }
        fn one(v: u16) -> f32 {
            super::widen_16bit::<true>(v)
        }
    }

    impl RowFormat for AsBf16 {
        type Elem = u16;
        #[inline(always)]
        unsafe fn load8(p: *const u16) -> __m256 {
            // SAFETY: as the caller guarantees.
            unsafe { widen8::<false>(p) }
        }
        fn one(v: u16) -> f32 {
            super::widen_16bit::<false>(v)
        }
    }

    /// [`super::tile_products`]: per block of values, per three rows, per half of the
    /// 16-value step, `R × T` accumulators loaded, run over the block and stored; then
    /// `dot`'s sum of the two halves, reduction and tail.
    ///
    /// # Safety
    /// The CPU must support AVX2, FMA and F16C; lengths as `super::tile_products` asserts.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn tile_products<F: RowFormat, const T: usize>(
        w: &[F::Elem],
        rows: usize,
        k: usize,
        x: [&[f32]; T],
        acc: &mut [[f32; 8]],
        out: &mut [[f32; T]],
    ) {
        let full = k / 16 * 16;
        acc[..rows * 2 * T].fill([0.0; 8]);
        // The tokens' block side by side, from a 64-byte boundary: rows of the activations
        // lie a power of two apart, so four of them at one offset share an L1 set, and a
        // 32-byte load across two lines costs two.
        #[repr(align(64))]
        struct Block<const T: usize>([[f32; super::TILE_BLOCK]; T]);
        let mut xbuf = Block([[0f32; super::TILE_BLOCK]; T]);
        for b0 in (0..full).step_by(super::TILE_BLOCK) {
            let len = super::TILE_BLOCK.min(full - b0);
            for (dst, src) in xbuf.0.iter_mut().zip(&x) {
                dst[..len].copy_from_slice(&src[b0..b0 + len]);
            }
            let xb: [&[f32]; T] = std::array::from_fn(|t| &xbuf.0[t][..len]);
            let mut r = 0;
            while r < rows {
                let left = rows - r;
                // SAFETY: the features as this function requires; the rows hold the
                // block (w holds rows * k values, asserted by the caller).
                unsafe {
                    if left >= 3 {
                        block_pass::<F, 3, T>(&w[r * k + b0..], k, xb, &mut acc[r * 2 * T..]);
                        r += 3;
                    } else if left == 2 {
                        block_pass::<F, 2, T>(&w[r * k + b0..], k, xb, &mut acc[r * 2 * T..]);
                        r += 2;
                    } else {
                        block_pass::<F, 1, T>(&w[r * k + b0..], k, xb, &mut acc[r * 2 * T..]);
                        r += 1;
                    }
                }
            }
        }
        for r in 0..rows {
            for t in 0..T {
                let ld = |h: usize| {
                    // SAFETY: the vector is eight values of `acc`.
                    unsafe { _mm256_loadu_ps(acc[(r * 2 + h) * T + t].as_ptr()) }
                };
                let mut o = hsum(_mm256_add_ps(ld(0), ld(1)));
                for j in full..k {
                    o += F::one(w[r * k + j]) * x[t][j];
                }
                out[r][t] = o;
            }
        }
    }

    /// One block of `R` rows `stride` apart (from `w[0]`, each `x[t].len()` values, a
    /// multiple of 16) into their accumulators (`acc[(r * 2 + half) * T + t]`), one half
    /// of the steps at a time.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn block_pass<F: RowFormat, const R: usize, const T: usize>(
        w: &[F::Elem],
        stride: usize,
        x: [&[f32]; T],
        acc: &mut [[f32; 8]],
    ) {
        let len = x[0].len();
        assert!(w.len() >= (R - 1) * stride + len && acc.len() >= R * 2 * T);
        let (wp, xp) = (w.as_ptr(), x.map(|r| r.as_ptr()));
        let line = 64 / std::mem::size_of::<F::Elem>();
        for half in 0..2 {
            let mut a = [[_mm256_setzero_ps(); T]; R];
            for r in 0..R {
                for t in 0..T {
                    // SAFETY: the index is below R * 2 * T (asserted).
                    a[r][t] = unsafe { _mm256_loadu_ps(acc[(r * 2 + half) * T + t].as_ptr()) };
                }
            }
            let mut i = 8 * half;
            while i < len {
                if half == 0 && i % line == 0 {
                    // The next rows' block, a line per row as this pass reaches each new
                    // line of its own (the first half's pass is the first to touch them):
                    // the next rows lie k values on, a stream of their own.
                    for r in 0..R {
                        let p = wp.wrapping_add((R + r) * stride + i);
                        _mm_prefetch::<_MM_HINT_T0>(p.cast());
                    }
                }
                // SAFETY: i + 8 <= len, inside every token row and every weight row
                // (asserted).
                unsafe {
                    let mut wv = [_mm256_setzero_ps(); R];
                    for (r, v) in wv.iter_mut().enumerate() {
                        *v = F::load8(wp.add(r * stride + i));
                    }
                    for t in 0..T {
                        let xv = _mm256_loadu_ps(xp[t].add(i));
                        for r in 0..R {
                            a[r][t] = _mm256_fmadd_ps(wv[r], xv, a[r][t]);
                        }
                    }
                }
                i += 16;
            }
            for r in 0..R {
                for t in 0..T {
                    // SAFETY: as for the loads.
                    unsafe { _mm256_storeu_ps(acc[(r * 2 + half) * T + t].as_mut_ptr(), a[r][t]) };
                }
            }
        }
    }

    /// # Safety
    /// The CPU must support AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn dequantize_legacy(kind: crate::quant::Legacy, bytes: &[u8], out: &mut [f32]) {
        use crate::quant::{f16_to_f32, Legacy};
        let scale =
            |b: &[u8], i: usize| _mm256_set1_ps(f16_to_f32(u16::from_le_bytes([b[i], b[i + 1]])));
        match kind {
            Legacy::Q8_0 => {
                for (b, o) in bytes.chunks_exact(34).zip(out.chunks_exact_mut(32)) {
                    let d = scale(b, 0);
                    for i in 0..4 {
                        // SAFETY: b is 34 bytes, so b[2 + 8i..10 + 8i] is inside it; o is 32
                        // floats, so o[8i..8i + 8] is inside it.
                        unsafe {
                            let q = _mm_loadl_epi64(b.as_ptr().add(2 + 8 * i).cast());
                            let x = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q));
                            _mm256_storeu_ps(o.as_mut_ptr().add(8 * i), _mm256_mul_ps(x, d));
                        }
                    }
                }
            }
            Legacy::Q4_0 | Legacy::Q4_1 => {
                let (block_bytes, qs) = match kind {
                    Legacy::Q4_0 => (18, 2),
                    _ => (20, 4),
                };
                for (b, o) in bytes
                    .chunks_exact(block_bytes)
                    .zip(out.chunks_exact_mut(32))
                {
                    let d = scale(b, 0);
                    // Q4_0: (q - 8) * d = q * d - 8d; Q4_1: q * d + m.
                    let m = match kind {
                        Legacy::Q4_0 => _mm256_mul_ps(d, _mm256_set1_ps(-8.0)),
                        _ => scale(b, 2),
                    };
                    // SAFETY: b holds 16 nibble bytes from `qs`; o is 32 floats, written in
                    // four stores of 8 at 0, 8, 16 and 24.
                    unsafe {
                        let q = _mm_loadu_si128(b.as_ptr().add(qs).cast());
                        let mask = _mm_set1_epi8(0x0F);
                        let lo = _mm_and_si128(q, mask);
                        let hi = _mm_and_si128(_mm_srli_epi16(q, 4), mask);
                        for (half, base) in [(lo, 0), (hi, 16)] {
                            let a = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(half));
                            let c =
                                _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(half, 8)));
                            _mm256_storeu_ps(o.as_mut_ptr().add(base), _mm256_fmadd_ps(a, d, m));
                            _mm256_storeu_ps(
                                o.as_mut_ptr().add(base + 8),
                                _mm256_fmadd_ps(c, d, m),
                            );
                        }
                    }
                }
            }
        }
    }

    /// Eight 16-bit weights from `p` widened to f32 (f16 when `F16`, else bf16: both exact).
    ///
    /// # Safety
    /// AVX2 and F16C from the caller; `p` has 8 readable values.
    #[inline(always)]
    unsafe fn widen8<const F16: bool>(p: *const u16) -> __m256 {
        // SAFETY: as the caller guarantees.
        unsafe {
            let h = _mm_loadu_si128(p.cast());
            if F16 {
                _mm256_cvtph_ps(h)
            } else {
                _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16))
            }
        }
    }

    /// `Σ w[i]·x[i]` for 16-bit weights widened in registers, in [`dot`]'s order (two
    /// accumulators over 16-value steps, then the tail term by term): bit for bit `dot` of
    /// the widened row.
    ///
    /// # Safety
    /// The CPU must support AVX2, FMA and F16C.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dot_16bit<const F16: bool>(w: &[u16], x: &[f32]) -> f32 {
        let n = w.len();
        assert!(
            x.len() >= n,
            "dot_16bit: activation row shorter than the weights"
        );
        let full = n / 16 * 16;
        let (mut s0, mut s1) = (_mm256_setzero_ps(), _mm256_setzero_ps());
        let (pw, px) = (w.as_ptr(), x.as_ptr());
        let mut i = 0;
        while i < full {
            // SAFETY: i + 16 <= n, within both slices (asserted).
            unsafe {
                s0 = _mm256_fmadd_ps(widen8::<F16>(pw.add(i)), _mm256_loadu_ps(px.add(i)), s0);
                s1 = _mm256_fmadd_ps(
                    widen8::<F16>(pw.add(i + 8)),
                    _mm256_loadu_ps(px.add(i + 8)),
                    s1,
                );
            }
            i += 16;
        }
        let mut out = hsum(_mm256_add_ps(s0, s1));
        for j in full..n {
            out += super::widen_16bit::<F16>(w[j]) * x[j];
        }
        out
    }

    /// `out[r] = dot_16bit(w[r], x)` for the `out.len()` rows of `k` values in `w`, four
    /// rows per pass with their own accumulator pairs (four weight streams in flight).
    ///
    /// # Safety
    /// The CPU must support AVX2, FMA and F16C.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn rows_16bit<const F16: bool>(w: &[u16], k: usize, x: &[f32], out: &mut [f32]) {
        let rows = out.len();
        assert!(
            w.len() >= rows * k && x.len() >= k,
            "rows_16bit: {} weights for {rows} rows of {k}, {} activations",
            w.len(),
            x.len()
        );
        let full_k = k / 16 * 16;
        let full = rows / 4 * 4;
        for r0 in (0..full).step_by(4) {
            let mut s0 = [_mm256_setzero_ps(); 4];
            let mut s1 = [_mm256_setzero_ps(); 4];
            let mut i = 0;
            while i < full_k {
                // SAFETY: i + 16 <= k, inside row r0 + j < rows of `w` and inside `x`
                // (asserted).
                unsafe {
                    if i % 32 == 0 {
                        // A line of each of the four rows `STREAM_LEAD_ROWS` ahead, at this column
                        // (a prefetch never faults, past the end of `w` too).
                        for j in 0..4 {
                            let ahead =
                                w.as_ptr().wrapping_add((r0 + STREAM_LEAD_ROWS + j) * k + i);
                            _mm_prefetch::<_MM_HINT_T0>(ahead.cast());
                        }
                    }
                    let x0 = _mm256_loadu_ps(x.as_ptr().add(i));
                    let x1 = _mm256_loadu_ps(x.as_ptr().add(i + 8));
                    for j in 0..4 {
                        let p = w.as_ptr().add((r0 + j) * k + i);
                        s0[j] = _mm256_fmadd_ps(widen8::<F16>(p), x0, s0[j]);
                        s1[j] = _mm256_fmadd_ps(widen8::<F16>(p.add(8)), x1, s1[j]);
                    }
                }
                i += 16;
            }
            for j in 0..4 {
                let row = &w[(r0 + j) * k..(r0 + j + 1) * k];
                let mut o = hsum(_mm256_add_ps(s0[j], s1[j]));
                for c in full_k..k {
                    o += super::widen_16bit::<F16>(row[c]) * x[c];
                }
                out[r0 + j] = o;
            }
        }
        for r in full..rows {
            // SAFETY: features as this function's; row r lies inside `w` (asserted).
            out[r] = unsafe { dot_16bit::<F16>(&w[r * k..(r + 1) * k], x) };
        }
    }

    /// # Safety
    /// The CPU must support AVX2 and FMA; `a` and `b` must have the same length.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn dot(a: &[f32], b: &[f32]) -> f32 {
        let n = a.len().min(b.len());
        let full = n / 16 * 16;
        let (mut s0, mut s1) = (_mm256_setzero_ps(), _mm256_setzero_ps());
        let (pa, pb) = (a.as_ptr(), b.as_ptr());
        let mut i = 0;
        while i < full {
            // SAFETY: i + 16 <= n, within both slices.
            unsafe {
                s0 = _mm256_fmadd_ps(_mm256_loadu_ps(pa.add(i)), _mm256_loadu_ps(pb.add(i)), s0);
                s1 = _mm256_fmadd_ps(
                    _mm256_loadu_ps(pa.add(i + 8)),
                    _mm256_loadu_ps(pb.add(i + 8)),
                    s1,
                );
            }
            i += 16;
        }
        let mut out = hsum(_mm256_add_ps(s0, s1));
        for j in full..n {
            out += a[j] * b[j];
        }
        out
    }

    /// # Safety
    /// The CPU must support AVX2 and FMA; `out` and `v` must have the same length.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn add_scaled(out: &mut [f32], p: f32, v: &[f32]) {
        let n = out.len().min(v.len());
        let full = n / 8 * 8;
        let (po, pv, pp) = (out.as_mut_ptr(), v.as_ptr(), _mm256_set1_ps(p));
        let mut i = 0;
        while i < full {
            // SAFETY: i + 8 <= n, within both slices.
            unsafe {
                let prod = _mm256_mul_ps(pp, _mm256_loadu_ps(pv.add(i)));
                _mm256_storeu_ps(po.add(i), _mm256_add_ps(_mm256_loadu_ps(po.add(i)), prod));
            }
            i += 8;
        }
        for j in full..n {
            out[j] += p * v[j];
        }
    }

    /// # Safety
    /// The CPU must support AVX2 and FMA; `rows` holds `scores.len()` rows of `q.len()`
    /// values, `stride` apart.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn dot_strided(q: &[f32], rows: &[f32], stride: usize, scores: &mut [f32]) {
        for (s, score) in scores.iter_mut().enumerate() {
            // SAFETY: features from the caller.
            *score = unsafe { dot(q, &rows[s * stride..][..q.len()]) };
        }
    }

    /// `dot(q, row)` on the row widened from f16, in `dot`'s order.
    ///
    /// # Safety
    /// The CPU must support AVX2, FMA and F16C; `row` has `q.len()` values.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn dot_f16_row(q: &[f32], row: &[u16]) -> f32 {
        let n = q.len();
        let full = n / 16 * 16;
        let (mut s0, mut s1) = (_mm256_setzero_ps(), _mm256_setzero_ps());
        let (pa, pb) = (q.as_ptr(), row.as_ptr());
        let mut i = 0;
        while i < full {
            // SAFETY: i + 16 <= n, within both slices.
            unsafe {
                let b0 = _mm256_cvtph_ps(_mm_loadu_si128(pb.add(i).cast()));
                let b1 = _mm256_cvtph_ps(_mm_loadu_si128(pb.add(i + 8).cast()));
                s0 = _mm256_fmadd_ps(_mm256_loadu_ps(pa.add(i)), b0, s0);
                s1 = _mm256_fmadd_ps(_mm256_loadu_ps(pa.add(i + 8)), b1, s1);
            }
            i += 16;
        }
        let mut out = hsum(_mm256_add_ps(s0, s1));
        for j in full..n {
            out += q[j] * crate::quant::f16_to_f32(row[j]);
        }
        out
    }

    /// # Safety
    /// The CPU must support AVX2, FMA and F16C; `rows` holds `scores.len()` rows of
    /// `q.len()` values, `stride` apart.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dot_strided_f16(q: &[f32], rows: &[u16], stride: usize, scores: &mut [f32]) {
        for (s, score) in scores.iter_mut().enumerate() {
            // SAFETY: features from the caller.
            *score = unsafe { dot_f16_row(q, &rows[s * stride..][..q.len()]) };
        }
    }

    /// [`add_scaled_strided`] on rows widened from f16, in the same order.
    ///
    /// # Safety
    /// The CPU must support AVX2, FMA and F16C; `rows` holds `p.len()` rows of
    /// `out.len()` values, `stride` apart.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn add_scaled_strided_f16(out: &mut [f32], p: &[f32], rows: &[u16], stride: usize) {
        // SAFETY (each load): `at` points at 8 values of a row inside `rows`.
        let load = |at: *const u16| unsafe { _mm256_cvtph_ps(_mm_loadu_si128(at.cast())) };
        // SAFETY: as this function requires.
        unsafe { add_scaled_rows(out, p, rows, stride, load, crate::quant::f16_to_f32) }
    }

    /// # Safety
    /// The CPU must support AVX2 and FMA; `rows` holds `p.len()` rows of `out.len()`
    /// values, `stride` apart.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn add_scaled_strided(out: &mut [f32], p: &[f32], rows: &[f32], stride: usize) {
        // SAFETY (each load): `at` points at 8 values of a row inside `rows`.
        let load = |at: *const f32| unsafe { _mm256_loadu_ps(at) };
        // SAFETY: as this function requires.
        unsafe { add_scaled_rows(out, p, rows, stride, load, |v| v) }
    }

    /// `out += Σ_s p[s] · row s`, a product then a sum per term, rows in order: 32 values
    /// (four chains) per pass over the rows, then 8, then one at a time. `load` widens 8
    /// values of a row, `widen` one.
    ///
    /// # Safety
    /// AVX2 from the caller; `rows` holds `p.len()` rows of `out.len()` values, `stride`
    /// apart.
    #[inline(always)]
    unsafe fn add_scaled_rows<T: Copy>(
        out: &mut [f32],
        p: &[f32],
        rows: &[T],
        stride: usize,
        load: impl Fn(*const T) -> __m256,
        widen: impl Fn(T) -> f32,
    ) {
        let d = out.len();
        let (po, pr) = (out.as_mut_ptr(), rows.as_ptr());
        let mut c = 0;
        while c + 32 <= d {
            // SAFETY: c + 32 <= d; row s spans s·stride..s·stride + d inside `rows`.
            unsafe {
                let mut acc = [_mm256_setzero_ps(); 4];
                for (j, a) in acc.iter_mut().enumerate() {
                    *a = _mm256_loadu_ps(po.add(c + 8 * j));
                }
                for (s, &ps) in p.iter().enumerate() {
                    let (pv, row) = (_mm256_set1_ps(ps), pr.add(s * stride + c));
                    for (j, a) in acc.iter_mut().enumerate() {
                        *a = _mm256_add_ps(*a, _mm256_mul_ps(pv, load(row.add(8 * j))));
                    }
                }
                for (j, a) in acc.iter().enumerate() {
                    _mm256_storeu_ps(po.add(c + 8 * j), *a);
                }
            }
            c += 32;
        }
        while c + 8 <= d {
            // SAFETY: as above, for 8 values.
            unsafe {
                let mut acc = _mm256_loadu_ps(po.add(c));
                for (s, &ps) in p.iter().enumerate() {
                    let prod = _mm256_mul_ps(_mm256_set1_ps(ps), load(pr.add(s * stride + c)));
                    acc = _mm256_add_ps(acc, prod);
                }
                _mm256_storeu_ps(po.add(c), acc);
            }
            c += 8;
        }
        for j in c..d {
            for (s, &ps) in p.iter().enumerate() {
                out[j] += ps * widen(rows[s * stride + j]);
            }
        }
    }

    #[target_feature(enable = "avx2,fma")]
    fn hsum(v: __m256) -> f32 {
        let hi = _mm256_extractf128_ps(v, 1);
        let lo = _mm256_castps256_ps128(v);
        let s = _mm_add_ps(hi, lo);
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
        _mm_cvtss_f32(s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The portable single and four-token products round identically, for every tail
    /// length: batch invariance on machines without the x86 kernels rests on it.
    #[test]
    fn portable_dot_equals_portable_dot4_bit_for_bit() {
        for n in 0..40usize {
            let w: Vec<f32> = (0..n)
                .map(|i| ((i * 29 % 13) as f32 - 6.0) * 0.37)
                .collect();
            let rows: Vec<Vec<f32>> = (0..4)
                .map(|t| {
                    (0..n)
                        .map(|i| ((i * 11 + t * 5) % 19) as f32 * 0.071 - 0.6)
                        .collect()
                })
                .collect();
            let x = [&rows[0][..], &rows[1][..], &rows[2][..], &rows[3][..]];
            let four = dot4_scalar(&w, x);
            for t in 0..4 {
                assert_eq!(
                    dot_scalar(&w, x[t]).to_bits(),
                    four[t].to_bits(),
                    "n={n} t={t}"
                );
            }
        }
    }

    /// Every tile shape gives each row and token `dot` of the widened row, bit for bit, on
    /// this CPU's path (AVX2's or the portable one), across blocks and tails.
    #[test]
    fn tile_products_equal_dot_bit_for_bit() {
        let f = |i: usize| ((i * 37 % 23) as f32 - 11.0) * 0.037;
        for k in [1usize, 16, 37, 256, 300, 600] {
            for rows in [1usize, 2, 3, 4, 5, 7] {
                let w: Vec<f32> = (0..rows * k).map(|i| f(i + 3)).collect();
                let xs: Vec<f32> = (0..4 * k).map(|i| f(2 * i + 1)).collect();
                let x: [&[f32]; 4] = std::array::from_fn(|t| &xs[t * k..(t + 1) * k]);
                let h16: Vec<u16> = w
                    .iter()
                    .map(|&v| half::f16::from_f32(v).to_bits())
                    .collect();
                let b16: Vec<u16> = w
                    .iter()
                    .map(|&v| half::bf16::from_f32(v).to_bits())
                    .collect();
                for rows_of in [TileRows::F32(&w), TileRows::F16(&h16), TileRows::Bf16(&b16)] {
                    let mut acc = vec![[0f32; 8]; rows * 8];
                    let mut out = vec![[0f32; 4]; rows];
                    tile_products(rows_of, rows, k, x, &mut acc, &mut out);
                    for (r, got) in out.iter().enumerate() {
                        let row = rows_of.row(r, k);
                        let want = x.map(|xt| dot(&row, xt).to_bits());
                        assert_eq!(got.map(f32::to_bits), want, "k={k} rows={rows} {rows_of:?}");
                    }
                }
            }
        }
    }

    /// The strided runs attention uses give what a row-by-row `dot` and `add_scaled` give,
    /// bit for bit, for widths with and without 32- and 8-value tails.
    #[test]
    fn strided_runs_equal_row_by_row() {
        let f = |i: usize| ((i * 37 % 23) as f32 - 11.0) * 0.037;
        for d in [1usize, 5, 8, 13, 32, 40, 64, 71, 128] {
            for rows in [0usize, 1, 3, 16] {
                let stride = d + 7;
                let pool: Vec<f32> = (0..rows * stride + d).map(f).collect();
                let q: Vec<f32> = (0..d).map(|i| f(i + 5)).collect();
                let mut got = vec![0f32; rows];
                dot_strided(&q, &pool, stride, &mut got);
                let want: Vec<f32> = (0..rows)
                    .map(|s| dot(&q, &pool[s * stride..][..d]))
                    .collect();
                assert_eq!(got, want, "dot_strided d={d} rows={rows}");

                let p: Vec<f32> = (0..rows).map(|i| f(3 * i + 1)).collect();
                let mut got: Vec<f32> = (0..d).map(|i| f(i + 9)).collect();
                let mut want = got.clone();
                add_scaled_strided(&mut got, &p, &pool, stride);
                for (s, &ps) in p.iter().enumerate() {
                    add_scaled(&mut want, ps, &pool[s * stride..][..d]);
                }
                assert_eq!(got, want, "add_scaled_strided d={d} rows={rows}");
                let mut scalar: Vec<f32> = (0..d).map(|i| f(i + 9)).collect();
                for (s, &ps) in p.iter().enumerate() {
                    for (o, &v) in scalar.iter_mut().zip(&pool[s * stride..][..d]) {
                        *o += ps * v;
                    }
                }
                assert_eq!(got, scalar, "add_scaled_strided vs the scalar loop d={d}");
            }
        }
    }

    /// The f16 strided runs equal the f32 ones on the widened rows, bit for bit.
    #[test]
    fn f16_strided_runs_equal_f32_runs_on_widened_rows() {
        let f = |i: usize| ((i * 41 % 29) as f32 - 14.0) * 0.041;
        for d in [1usize, 8, 13, 40, 64, 71, 128] {
            for rows in [0usize, 1, 5] {
                let stride = d + 3;
                let bits: Vec<u16> = (0..rows * stride + d)
                    .map(|i| half::f16::from_f32(f(i)).to_bits())
                    .collect();
                let wide: Vec<f32> = bits
                    .iter()
                    .map(|&b| half::f16::from_bits(b).to_f32())
                    .collect();
                let q: Vec<f32> = (0..d).map(|i| f(i + 2)).collect();
                let (mut got, mut want) = (vec![0f32; rows], vec![0f32; rows]);
                dot_strided_f16(&q, &bits, stride, &mut got);
                dot_strided(&q, &wide, stride, &mut want);
                assert_eq!(got, want, "dot d={d} rows={rows}");
                let p: Vec<f32> = (0..rows).map(|i| f(5 * i + 1)).collect();
                let mut got: Vec<f32> = (0..d).map(|i| f(i + 7)).collect();
                let mut want = got.clone();
                add_scaled_strided_f16(&mut got, &p, &bits, stride);
                add_scaled_strided(&mut want, &p, &wide, stride);
                assert_eq!(got, want, "add d={d} rows={rows}");
            }
        }
    }

    #[test]
    fn dispatched_matches_scalar() {
        for n in [1usize, 7, 16, 33, 100, 2304] {
            let w: Vec<f32> = (0..n).map(|i| ((i * 37 % 11) as f32 - 5.0) * 0.1).collect();
            let rows: Vec<Vec<f32>> = (0..4)
                .map(|t| {
                    (0..n)
                        .map(|i| ((i * 13 + t * 7) % 17) as f32 * 0.05 - 0.4)
                        .collect()
                })
                .collect();
            let x = [&rows[0][..], &rows[1][..], &rows[2][..], &rows[3][..]];
            // Four weight rows by four tokens: each pair exactly as the single products.
            let ws: Vec<Vec<f32>> = (0..4)
                .map(|r| w.iter().map(|v| v * (r as f32 + 1.0) - 0.01).collect())
                .collect();
            let tile = dot4x4([&ws[0], &ws[1], &ws[2], &ws[3]], x);
            // One summation order for every product is an AVX-512 guarantee.
            #[cfg(target_arch = "x86_64")]
            let same_order = has_avx512();
            #[cfg(not(target_arch = "x86_64"))]
            let same_order = false;
            for (r, wr) in ws.iter().enumerate() {
                assert_eq!(tile[r], dot4(wr, x), "n={n}");
                for t in 0..4 {
                    if same_order {
                        assert_eq!(tile[r][t].to_bits(), dot(wr, x[t]).to_bits(), "n={n}");
                    }
                }
            }
            // bf16 rows: the fused kernel equals the product of the widened row.
            let wb: Vec<u16> = w.iter().map(|v| (v.to_bits() >> 16) as u16).collect();
            let widened: Vec<f32> = wb
                .iter()
                .map(|b| f32::from_bits(u32::from(*b) << 16))
                .collect();
            assert_eq!(
                dot_bf16(&wb, x[1]).to_bits(),
                dot(&widened, x[1]).to_bits(),
                "n={n}"
            );
            // f16 rows likewise.
            let wh: Vec<u16> = w
                .iter()
                .map(|v| half::f16::from_f32(*v).to_bits())
                .collect();
            let widened: Vec<f32> = wh
                .iter()
                .map(|b| half::f16::from_bits(*b).to_f32())
                .collect();
            assert_eq!(
                dot_f16(&wh, x[1]).to_bits(),
                dot(&widened, x[1]).to_bits(),
                "n={n}"
            );
            // Several rows at once (four per pass and a tail): each as its row alone.
            for rows in [1, 4, 7] {
                let many: Vec<u16> = (0..rows)
                    .flat_map(|r| wh.iter().map(move |b| b ^ r))
                    .collect();
                let manyb: Vec<u16> = (0..rows)
                    .flat_map(|r| wb.iter().map(move |b| b ^ r))
                    .collect();
                let (mut got, mut gotb) = (vec![0f32; rows as usize], vec![0f32; rows as usize]);
                dot_rows_16bit::<true>(&many, n, x[1], &mut got);
                dot_rows_16bit::<false>(&manyb, n, x[1], &mut gotb);
                for r in 0..rows as usize {
                    let want = dot_f16(&many[r * n..(r + 1) * n], x[1]);
                    let wantb = dot_bf16(&manyb[r * n..(r + 1) * n], x[1]);
                    assert_eq!(got[r].to_bits(), want.to_bits(), "n={n} rows={rows}");
                    assert_eq!(gotb[r].to_bits(), wantb.to_bits(), "n={n} rows={rows}");
                }
            }
            let a = dot4(&w, x);
            let b = dot4_scalar(&w, x);
            let single = dot(&w, x[2]);
            let exact2: f64 = w.iter().zip(x[2]).map(|(a, b)| *a as f64 * *b as f64).sum();
            assert!(
                (single as f64 - exact2).abs() <= 1e-4 * (1.0 + exact2.abs()),
                "n={n}"
            );
            for t in 0..4 {
                let exact: f64 = w.iter().zip(x[t]).map(|(a, b)| *a as f64 * *b as f64).sum();
                assert!(
                    (a[t] as f64 - exact).abs() <= 1e-4 * (1.0 + exact.abs()),
                    "n={n}"
                );
                assert!(
                    (b[t] as f64 - exact).abs() <= 1e-4 * (1.0 + exact.abs()),
                    "n={n}"
                );
            }
        }
    }

    /// The guard flushes while it lives and restores the thread's mode when dropped.
    #[test]
    fn flush_guard_restores_the_previous_mode() {
        use std::hint::black_box;
        // The product goes through black_box before the guards drop: otherwise the
        // optimiser may compute it after the mode is restored (the mode switch is an asm
        // block that touches no memory, and a multiply has no effects to keep it in place).
        let half_min = || black_box(black_box(f32::MIN_POSITIVE) * black_box(0.5));
        let (inside, after) = std::thread::spawn(move || {
            let inside = {
                let _flush = FlushSubnormals::new();
                let _nested = FlushSubnormals::new();
                half_min()
            };
            (inside, half_min())
        })
        .join()
        .unwrap();
        assert!(after.is_subnormal(), "{after:e}");
        if cfg!(any(target_arch = "x86_64", target_arch = "aarch64")) {
            assert_eq!(inside, 0.0);
        }
    }

    /// The control-register write takes effect on this architecture (x86_64 MXCSR, AArch64
    /// FPCR; scripts/arm/test.sh runs the latter under qemu). In a thread of its own, so that
    /// no other test sees the flag.
    #[test]
    fn flush_subnormals_to_zero_flushes() {
        use std::hint::black_box;
        let half_min = || black_box(f32::MIN_POSITIVE) * black_box(0.5);
        let before = half_min();
        assert!(before > 0.0 && before.is_subnormal(), "{before:e}");
        let after = std::thread::spawn(move || {
            flush_subnormals_to_zero();
            half_min()
        })
        .join()
        .unwrap();
        if cfg!(any(target_arch = "x86_64", target_arch = "aarch64")) {
            assert_eq!(after, 0.0);
        }
    }
}
