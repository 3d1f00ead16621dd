//! Weights interleaved in groups of 16 rows, for the x86 kernels (AVX-512 VNNI, and AVX2
//! on the two 8-row halves of a group).
//!
//! With row-major blocks a matrix-vector product spends its instructions per weight row:
//! each 32-value block of each row is expanded, dotted into eight partial lanes, converted
//! and scaled on its own (about 14 instructions per row and block), and decode on this
//! machine's cores ran at a sixth of the bandwidth they can read. Here 16 rows share every
//! instruction: within block `b` of a group, the rows' quants are interleaved by 4-byte
//! words, so one 512-bit `vpdpbusd` multiplies four values of each of the 16 rows by the
//! same four activation values (one broadcast), and the 16 rows' scales sit in one vector
//! (about 2 instructions per row and block). llama.cpp's repacked Q4_0 formats rest on the
//! same idea.
//!
//! Layout: group `g` (rows `16g..16g + 16`) is contiguous, block after block; block `b` of
//! the group takes `16 · block_bytes` bytes at `(g · nb + b) · 16 · block_bytes`:
//! - Q8_0: `d[16]:f16 | w[8][16]:[u8; 4]`: word `j` (values `4j..4j + 4`) of row `r` at
//!   `32 + 64j + 4r`, each byte `q ^ 0x80` (`q + 128` as unsigned: `vpdpbusd` multiplies
//!   unsigned by signed bytes, and `Σ (q + 128)·x − 128·Σx` is the same integer);
//! - Q4_0: `d[16]:f16 | w[4][16]:[u8; 4]`: word `j` is bytes `4j..4j + 4` of the row's 16
//!   nibble bytes (values `4j..4j + 4` low, `16 + 4j..16 + 4j + 4` high);
//! - Q4_1: `d[16]:f16 | m[16]:f16 | w[4][16]:[u8; 4]`.
//! - Q4_K (256-value super-blocks): `d[16]:f16 | dmin[16]:f16 | sc[8][16]:u8 |
//!   m[8][16]:u8 | w[4][8][16]:[u8; 4]`: the 6-bit scales and mins unpacked (2,368 bytes
//!   for 16 rows instead of 2,304), word `w` of nibble-pair `p` holding values `4w..4w + 4`
//!   of sub-blocks `2p` (low nibbles) and `2p + 1` (high).
//! - Q6_K: `d[16]:f16 | sc[16][16]:i8 | ql[2][2][8][16]:[u8; 4] | qh[2][8][16]:[u8; 4]`:
//!   the ggml block's byte runs (`ql[64h + 32m..][..32]`, `qh[32h..][..32]`) cut into
//!   words, 3,360 bytes as in ggml.
//! - MXFP4: `e[16]:u8 | w[4][16]:[u8; 4]`, Q4_0's words after the 16 E8M0 scale bytes
//!   (272 bytes, as in ggml).
//!
//! Every value is kept: [`block_at`] rebuilds any ggml block exactly (dequantization and
//! the scalar reference go through it).

use super::{Isa, Kind, Q8Acts};
use crate::arena::WeightBuf;

/// Rows per interleaved group: one 512-bit vector of i32 or f32 lanes.
pub(crate) const GROUP: usize = 16;

/// Whether `kind` has an interleaved layout.
pub(crate) fn supported(kind: Kind) -> bool {
    matches!(
        kind,
        Kind::Q4_0 | Kind::Q4_1 | Kind::Q8_0 | Kind::Q4K | Kind::Q6K | Kind::Mxfp4
    )
}

/// Bytes of one block (or super-block) of a whole group of 16 rows.
pub(crate) fn block_group_bytes(kind: Kind) -> usize {
    match kind {
        Kind::Q4K => 64 + 256 + 2048,
        _ => GROUP * kind.block_bytes(),
    }
}

/// Bytes of one group of 16 rows of `k` values.
pub(crate) fn group_bytes(kind: Kind, k: usize) -> usize {
    k / kind.block_values() * block_group_bytes(kind)
}

/// Whether weights of `kind` with `rows` rows are stored interleaved on this CPU: where an
/// interleaved kernel runs (AVX2 or AVX-512 VNNI), the type has a layout and there is at
/// least one whole group (a last partial group is padded with zero rows).
/// `KIMI_CPU_INTERLEAVE=0` keeps every weight row-major (for comparisons).
pub(crate) fn wanted(kind: Kind, rows: usize) -> bool {
    #[cfg(target_arch = "x86_64")]
    let kernel = matches!(Isa::best(), Isa::Avx2 | Isa::Avx512Vnni);
    #[cfg(not(target_arch = "x86_64"))]
    let kernel = false;
    kernel
        && supported(kind)
        && rows >= GROUP
        && std::env::var("KIMI_CPU_INTERLEAVE").map_or(true, |v| v != "0")
}

/// Bytes of scales before the quant words in a group's block.
#[cfg(target_arch = "x86_64")]
pub(super) fn scale_bytes(kind: Kind) -> usize {
    match kind {
        Kind::Q4_1 => 4 * GROUP,
        Kind::Mxfp4 => GROUP,
        _ => 2 * GROUP,
    }
}

/// Bytes of `rows` interleaved rows of `k` values: whole groups, the last one padded.
pub(crate) fn padded_bytes(kind: Kind, rows: usize, k: usize) -> usize {
    rows.div_ceil(GROUP) * group_bytes(kind, k)
}

/// Row-major ggml blocks of rows of `k` values interleaved, the last group padded with
/// zero blocks (scale 0: their results are 0 and never read).
pub(crate) fn interleave(kind: Kind, rows_major: &[u8], k: usize) -> WeightBuf<u8> {
    let bb = kind.block_bytes();
    let nb = k / kind.block_values();
    let rows = rows_major.len().checked_div(nb * bb).unwrap_or(0);
    assert!(
        supported(kind) && rows_major.len() == rows * nb * bb,
        "interleave: {kind:?}, {} bytes of rows of {k}",
        rows_major.len()
    );
    let zero = vec![0u8; bb];
    let mut out = WeightBuf::zeroed(padded_bytes(kind, rows, k));
    for (g, dst_group) in out.chunks_exact_mut(group_bytes(kind, k)).enumerate() {
        for (b, dst) in dst_group
            .chunks_exact_mut(block_group_bytes(kind))
            .enumerate()
        {
            for r in 0..GROUP {
                let row = g * GROUP + r;
                let src = match row < rows {
                    true => &rows_major[(row * nb + b) * bb..][..bb],
                    false => &zero[..],
                };
                for (from, &v) in src.iter().enumerate() {
                    if let Some(to) = position(kind, r, from) {
                        dst[to] = if flipped(kind, from) { v ^ 0x80 } else { v };
                    }
                }
                if kind == Kind::Q4K {
                    for j in 0..8 {
                        let (sc, m) = super::q4k_scale_min(j, &src[4..16]);
                        dst[64 + 16 * j + r] = sc;
                        dst[192 + 16 * j + r] = m;
                    }
                }
            }
        }
    }
    out
}

/// The ggml block `b` of row `row` of interleaved weights with `nb` blocks per row, written
/// to `out[..kind.block_bytes()]`: the inverse of [`position`] (and [`flipped`]), a word or
/// a scale at a time (the f32 path widens interleaved rows through it).
pub(crate) fn block_at(kind: Kind, bytes: &[u8], nb: usize, row: usize, b: usize, out: &mut [u8]) {
    let (g, r) = (row / GROUP, row % GROUP);
    let bgb = block_group_bytes(kind);
    let src = &bytes[(g * nb + b) * bgb..][..bgb];
    // Row r's 4-byte words of a run whose word planes (64 bytes each) start at `base`.
    let words = |out: &mut [u8], base: usize| {
        for (i, w) in out.chunks_exact_mut(4).enumerate() {
            w.copy_from_slice(&src[base + 64 * i + 4 * r..][..4]);
        }
    };
    // Row r's f16 among 16 side by side at `base`.
    let half = |out: &mut [u8], base: usize| out.copy_from_slice(&src[base + 2 * r..][..2]);
    let out = &mut out[..kind.block_bytes()];
    match kind {
        Kind::Q8_0 => {
            half(&mut out[..2], 0);
            words(&mut out[2..], 32);
            for q in &mut out[2..] {
                *q ^= 0x80;
            }
        }
        Kind::Q4_0 => {
            half(&mut out[..2], 0);
            words(&mut out[2..], 32);
        }
        Kind::Q4_1 => {
            half(&mut out[..2], 0);
            half(&mut out[2..4], 32);
            words(&mut out[4..], 64);
        }
        Kind::Q4K => {
            half(&mut out[..2], 0);
            half(&mut out[2..4], 32);
            // The inverse of `q4k_scale_min`: six bits each, the top two of sub-blocks 4..8
            // in the top bits of bytes 0..8.
            let (sc, m) = (
                |j: usize| src[64 + 16 * j + r],
                |j: usize| src[192 + 16 * j + r],
            );
            for j in 0..4 {
                out[4 + j] = sc(j) | (sc(j + 4) >> 4) << 6;
                out[8 + j] = m(j) | (m(j + 4) >> 4) << 6;
                out[12 + j] = (sc(j + 4) & 0xF) | (m(j + 4) & 0xF) << 4;
            }
            words(&mut out[16..], 320);
        }
        Kind::Mxfp4 => {
            out[0] = src[r];
            words(&mut out[1..], GROUP);
        }
        Kind::Q6K => {
            words(&mut out[..192], 288);
            for s in 0..16 {
                out[192 + s] = src[32 + 16 * s + r];
            }
            half(&mut out[208..], 0);
        }
        // `supported` admits no other kind (callers hold interleaved bytes).
        _ => debug_assert!(false, "invariant: {kind:?} is never interleaved"),
    }
}

/// Where byte `from` of row `r`'s ggml block goes in its group's block (Q8_0's quants
/// also flip their top bit, see the module docs); `None` for Q4_K's 12 bytes of packed
/// scales, which the callers unpack and repack.
fn position(kind: Kind, r: usize, from: usize) -> Option<usize> {
    // Byte `i` of a run cut into 4-byte words, word planes of 16 rows from `base`.
    let word = |base: usize, i: usize| base + 64 * (i / 4) + 4 * r + i % 4;
    Some(match (kind, from) {
        (Kind::Q6K, 0..192) => word(288, from),
        (Kind::Q6K, 192..208) => 32 + 16 * (from - 192) + r,
        (Kind::Q6K, _) => 2 * r + from - 208,
        (Kind::Mxfp4, 0) => r,
        (Kind::Mxfp4, _) => word(GROUP, from - 1),
        (_, 0..2) => 2 * r + from,
        (Kind::Q8_0 | Kind::Q4_0, _) => word(32, from - 2),
        (Kind::Q4_1 | Kind::Q4K, 2..4) => 32 + 2 * r + from - 2,
        (Kind::Q4_1, _) => word(64, from - 4),
        (Kind::Q4K, 4..16) => return None,
        (_, _) => word(320, from - 16),
    })
}

/// Whether byte `from` of a block is stored with its top bit flipped.
fn flipped(kind: Kind, from: usize) -> bool {
    kind == Kind::Q8_0 && from >= 2
}

/// Dequantizes `out.len()` values (whole blocks) of interleaved weights with rows of `k`
/// values, starting at value `offset`: the blocks rebuilt row-major first, then widened by
/// the row-major dequantizers in one call (block by block, through the byte map, the
/// default f32 product ran ~15× slower on interleaved weights than on row-major ones).
pub(crate) fn dequantize(
    dtype: kimi_core::DType,
    kind: Kind,
    bytes: &[u8],
    k: usize,
    offset: usize,
    out: &mut [f32],
) {
    let (bv, bb, nb) = (
        kind.block_values(),
        kind.block_bytes(),
        k / kind.block_values(),
    );
    let mut blocks = vec![0u8; out.len() / bv * bb];
    for (i, blk) in blocks.chunks_exact_mut(bb).enumerate() {
        let block = offset / bv + i;
        block_at(kind, bytes, nb, block / nb, block % nb, blk);
    }
    crate::quant::dequantize(dtype, &blocks, out);
}

/// `out[r * x.n + t] = row r · token t` for the first `out.len() / x.n` rows of the
/// interleaved weights `w` (whole groups of rows of `x.k` values, the last one possibly
/// padded), with the best kernel of this CPU.
pub(crate) fn matmul_groups(kind: Kind, w: &[u8], x: &Q8Acts, out: &mut [f32]) {
    matmul_groups_with(Isa::best(), kind, w, x, out)
}

/// [`matmul_groups`] with a given variant: AVX2 or VNNI where given, else the scalar
/// reference (NEON has no interleaved kernel).
pub(crate) fn matmul_groups_with(isa: Isa, kind: Kind, w: &[u8], x: &Q8Acts, out: &mut [f32]) {
    let group_bytes = group_bytes(kind, x.k);
    let groups = w.len().checked_div(group_bytes).unwrap_or(0);
    let rows = out.len().checked_div(x.n).unwrap_or(0);
    // The kernels rely on these: whole groups, whole blocks, a result for every token of
    // every row, and rows in every group (only the last one may be partial).
    assert!(
        supported(kind)
            && x.k.is_multiple_of(kind.block_values())
            && w.len() == groups * group_bytes
            && out.len() == rows * x.n
            && rows.div_ceil(GROUP) == groups
            && x.qs.len() == x.n * x.k
            && x.d.len() == x.n * x.blocks()
            && x.sum.len() == x.d.len()
            && x.sum_f16.len() == x.d.len()
            && x.isum.len() == x.d.len()
            && x.isum16.len() == 2 * x.d.len(),
        "qdot groups: inconsistent sizes"
    );
    match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => {
            assert!(Isa::available().contains(&Isa::Avx2));
            // SAFETY: AVX2, FMA and F16C were detected (the assert above); sizes were
            // checked above.
            unsafe { super::x86::matmul_groups_avx2(kind, w, x, out) }
        }
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512Vnni => {
            assert!(Isa::available().contains(&Isa::Avx512Vnni));
            // SAFETY: AVX-512 F/BW/VL/VNNI, AVX2, FMA and F16C were detected (the assert
            // above); sizes were checked above.
            unsafe { super::x86::matmul_groups_vnni(kind, w, x, out) }
        }
        _ => scalar(kind, w, x, out),
    }
}

/// The reference: each group's blocks rebuilt row-major and multiplied by the scalar
/// row-major kernel.
fn scalar(kind: Kind, w: &[u8], x: &Q8Acts, out: &mut [f32]) {
    let (bb, nb) = (kind.block_bytes(), x.k / kind.block_values());
    let mut rows = vec![0u8; GROUP * nb * bb];
    for (g, group) in w.chunks_exact(group_bytes(kind, x.k)).enumerate() {
        for r in 0..GROUP {
            for b in 0..nb {
                block_at(kind, group, nb, r, b, &mut rows[(r * nb + b) * bb..][..bb]);
            }
        }
        let mut dst = vec![0f32; GROUP * x.n];
        super::matmul_rows_with(Isa::Scalar, kind, &rows, x, &mut dst);
        let valid = (out.len() - g * GROUP * x.n).min(GROUP * x.n);
        out[g * GROUP * x.n..][..valid].copy_from_slice(&dst[..valid]);
    }
}
