//! Device layouts of packed weight formats: pure host code (no CUDA), so that its tests run
//! in every build.
#![cfg_attr(not(feature = "cuda"), allow(dead_code))]

/// Bytes per block of 32 values in ggml's `block_mxfp4`: the E8M0 scale, then 16 code bytes
/// (byte `j` holds value `j` in its low nibble and value `j + 16` in its high nibble).
const BLOCK_BYTES: usize = 17;

/// Rows of one device tile (the M side of one `mma.m16n8k16`).
pub(crate) const TILE_ROWS: usize = 16;
/// Values along a row of one device tile (four 32-value blocks).
pub(crate) const TILE_COLS: usize = 128;
/// Code bytes of one tile: 16 rows x 128 values x 4 bits.
const TILE_CODE_BYTES: usize = 1024;
/// Scale bytes of one tile: 16 rows x 4 blocks.
const TILE_SCALE_BYTES: usize = 64;

/// Where the four 4-bit codes of one 16-bit half of a code word go: for each of the word's
/// four pairs `j`, the bit of the sign and the bits of `e1`, `e0`, `m`. Pair 0 is in place for
/// a bf16 (sign at 15, exponent's low bits at 8..7, mantissa's top bit at 6: the E2M1 value
/// times 2^-126); pairs 1 and 2 come there by a shift of 6 and 3 and one mask, pair 3 by
/// three shifts (`kernels/mxfp4.cu`, `mx_unpack`).
const HALF_BITS: [[u32; 4]; 4] = [[15, 8, 7, 6], [9, 2, 1, 0], [12, 5, 4, 3], [13, 14, 11, 10]];

/// Tile counts of an MXFP4 `[rows, cols]` matrix in the device layout: (row tiles, k tiles).
pub(crate) fn mxfp4_tiles(rows: usize, cols: usize) -> (usize, usize) {
    (rows.div_ceil(TILE_ROWS), cols.div_ceil(TILE_COLS))
}

/// Device bytes of an MXFP4 `[rows, cols]` matrix (padded to whole tiles).
pub(crate) fn mxfp4_device_bytes(rows: usize, cols: usize) -> usize {
    let (rt, kt) = mxfp4_tiles(rows, cols);
    rt * kt * (TILE_CODE_BYTES + TILE_SCALE_BYTES)
}

/// The device layout of an MXFP4 `[rows, cols]` matrix (`cols % 32 == 0`) from ggml
/// `block_mxfp4` bytes, made for the tensor cores: the matrix in tiles of 16 rows x 128
/// values (zero-padded), tile `(R, S)` (row tile `R`, k tile `S`, row-major over tiles)
/// owning 1,024 code bytes at `(R * kt + S) * 1024` and 64 scale bytes at
/// `codes_plane + (R * kt + S) * 64`.
///
/// Inside a tile's codes, lane `4g + t` of a warp (the `mma` fragment's group `g` and thread
/// `t`) reads 16 bytes at `h * 512 + (4g + t) * 16`: for row `8h + g` of the tile, one 32-bit
/// word per block `blk` = 0..3. That word holds the eight values the A fragment needs from
/// the block: pair `j` = values `8j + 2t` (low 16 bits) and `8j + 2t + 1` (high 16 bits), each
/// code's bits placed as [`HALF_BITS`] says. Scales: byte `row * 4 + blk` of the tile's 64,
/// the block's E8M0 exponent as stored.
///
/// `None` when `blocks` is not `rows * cols / 32` blocks.
/// Row tiles are laid out in parallel (a K3 expert is 17.5 MB: host experts are laid out
/// again at every slot fill).
pub(crate) fn mxfp4_device_tiles(blocks: &[u8], rows: usize, cols: usize) -> Option<Vec<u8>> {
    use rayon::prelude::*;
    let nb = cols / 32;
    if !cols.is_multiple_of(32) || blocks.len() != rows.checked_mul(nb)?.checked_mul(BLOCK_BYTES)? {
        return None;
    }
    let (rt, kt) = mxfp4_tiles(rows, cols);
    let mut out = vec![0u8; mxfp4_device_bytes(rows, cols)];
    if out.is_empty() {
        return Some(out);
    }
    let (codes, scales) = out.split_at_mut(rt * kt * TILE_CODE_BYTES);
    codes
        .par_chunks_mut(kt * TILE_CODE_BYTES)
        .zip(scales.par_chunks_mut(kt * TILE_SCALE_BYTES))
        .enumerate()
        .for_each(|(tr, (tile_codes, tile_scales))| {
            for rr in 0..TILE_ROWS.min(rows - tr * TILE_ROWS) {
                let r = tr * TILE_ROWS + rr;
                let (h, g) = (rr / 8, rr % 8);
                for b in 0..nb {
                    let blk = &blocks[(r * nb + b) * BLOCK_BYTES..][..BLOCK_BYTES];
                    let (ts, bi) = (b / 4, b % 4);
                    tile_scales[ts * TILE_SCALE_BYTES + rr * 4 + bi] = blk[0];
                    let q = &blk[1..];
                    for t in 0..4 {
                        // Values 8j + 2t + half: bytes 2t + half (j = 0 low nibble, 2 high)
                        // and 8 + 2t + half (j = 1 low, 3 high).
                        let word = BYTE_SPREAD[0][q[2 * t] as usize]
                            | BYTE_SPREAD[1][q[2 * t + 1] as usize]
                            | BYTE_SPREAD[2][q[8 + 2 * t] as usize]
                            | BYTE_SPREAD[3][q[9 + 2 * t] as usize];
                        let at = ts * TILE_CODE_BYTES + h * 512 + (4 * g + t) * 16 + bi * 4;
                        tile_codes[at..at + 4].copy_from_slice(&word.to_le_bytes());
                    }
                }
            }
        });
    Some(out)
}

/// A 4-bit code of pair `j`'s low (`half` 0) or high value placed in the code word as
/// [`HALF_BITS`] says (its sign, `e1`, `e0`, `m` bits).
const fn spread(code: u32, j: usize, half: u32) -> u32 {
    let fields = [code >> 3, (code >> 2) & 1, (code >> 1) & 1, code & 1];
    let mut word = 0u32;
    let mut f = 0;
    while f < 4 {
        word |= fields[f] << (HALF_BITS[j][f] + 16 * half);
        f += 1;
    }
    word
}

/// Both codes of one ggml code byte placed at once: `BYTE_SPREAD[k][byte]` for the byte of
/// value `2t + half` (`k = half`: pairs 0 and 2) or of value `8 + 2t + half` (`k = 2 +
/// half`: pairs 1 and 3), its low nibble the lower pair's code and its high nibble the
/// upper's.
const BYTE_SPREAD: [[u32; 256]; 4] = byte_spread();

const fn byte_spread() -> [[u32; 256]; 4] {
    let mut table = [[0u32; 256]; 4];
    let mut k = 0;
    while k < 4 {
        let (j_low, half) = (k / 2, (k % 2) as u32);
        let mut byte = 0u32;
        while byte < 256 {
            table[k][byte as usize] =
                spread(byte & 15, j_low, half) | spread(byte >> 4, j_low + 2, half);
            byte += 1;
        }
        k += 1;
    }
    table
}

#[cfg(test)]
mod tests {
    use super::*;

    /// E2M1 magnitudes by the three low code bits.
    const E2M1: [f32; 8] = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0];

    fn e8m0(s: u8) -> f32 {
        2f32.powi(s as i32 - 127)
    }

    /// The kernel's bit operations (`mx_unpack`) on one code word: four bf16 pairs.
    fn unpack(w: u32) -> [u32; 4] {
        const M: u32 = 0x81C0_81C0;
        [
            w & M,
            (w << 6) & M,
            (w << 3) & M,
            ((w << 2) & 0x8000_8000) | ((w >> 6) & 0x0100_0100) | ((w >> 4) & 0x00C0_00C0),
        ]
    }

    /// One bf16 (as its bits) to f64, subnormals included.
    fn bf16(bits: u32) -> f64 {
        f32::from_bits(bits << 16) as f64
    }

    /// Reads value `(r, c)` back from the device layout the way the kernels do.
    fn device_value(dev: &[u8], rows: usize, cols: usize, r: usize, c: usize) -> f64 {
        let (rt, kt) = mxfp4_tiles(rows, cols);
        let tile = (r / 16) * kt + c / 128;
        let (rr, blk, i) = (r % 16, (c / 32) % 4, c % 32);
        let (j, t, half) = (i / 8, (i % 8) / 2, i % 2);
        let at = tile * 1024 + (rr / 8) * 512 + (4 * (rr % 8) + t) * 16 + blk * 4;
        let w = u32::from_le_bytes(dev[at..at + 4].try_into().unwrap());
        let pair = unpack(w)[j];
        let bits = if half == 1 { pair >> 16 } else { pair & 0xFFFF };
        let scale = dev[rt * kt * 1024 + tile * 64 + rr * 4 + blk];
        // The placed value is E2M1 * 2^-126; the kernel multiplies by 2^(scale - 1).
        bf16(bits) * 2f64.powi(126) * 2f64.powi(scale as i32 - 127)
    }

    fn ggml_value(blocks: &[u8], cols: usize, r: usize, c: usize) -> f64 {
        let blk = &blocks[(r * (cols / 32) + c / 32) * 17..][..17];
        let i = c % 32;
        let byte = blk[1 + (i & 15)];
        let code = if i < 16 { byte & 15 } else { byte >> 4 };
        let v = E2M1[(code & 7) as usize] * e8m0(blk[0]);
        (if code & 8 != 0 { -v } else { v }) as f64
    }

    fn random_blocks(rows: usize, cols: usize, seed: u64) -> Vec<u8> {
        let mut s = seed;
        (0..rows * cols / 32 * 17)
            .map(|i| {
                s = s
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                let v = (s >> 33) as u8;
                // Scale bytes in a range where 6 * 2^(e-127) is a normal f32.
                if i % 17 == 0 {
                    100 + v % 40
                } else {
                    v
                }
            })
            .collect()
    }

    #[test]
    fn tiles_hold_every_value_where_the_kernel_reads_it() {
        for (rows, cols) in [(16, 128), (3, 32), (37, 96), (64, 256), (20, 160)] {
            let blocks = random_blocks(rows, cols, (rows * 1000 + cols) as u64);
            let dev = mxfp4_device_tiles(&blocks, rows, cols).expect("whole blocks");
            assert_eq!(dev.len(), mxfp4_device_bytes(rows, cols));
            for r in 0..rows {
                for c in 0..cols {
                    let (want, got) = (
                        ggml_value(&blocks, cols, r, c),
                        device_value(&dev, rows, cols, r, c),
                    );
                    assert_eq!(want, got, "{rows}x{cols} at ({r}, {c})");
                }
            }
            // Padding rows and columns read as zeros.
            let (rt, kt) = mxfp4_tiles(rows, cols);
            for r in rows..rt * 16 {
                for c in 0..kt * 128 {
                    assert_eq!(device_value(&dev, rows, cols, r, c), 0.0);
                }
            }
        }
    }

    #[test]
    fn every_code_decodes_exactly() {
        // One row of one block per code value, scale 2^0: each of the 16 codes at each of
        // the 32 positions.
        for code in 0u8..16 {
            let mut blocks = vec![127u8];
            blocks.extend(std::iter::repeat_n(code | (code << 4), 16));
            let dev = mxfp4_device_tiles(&blocks, 1, 32).expect("one block");
            for c in 0..32 {
                let v = E2M1[(code & 7) as usize] as f64;
                let want = if code & 8 != 0 { -v } else { v };
                assert_eq!(device_value(&dev, 1, 32, 0, c), want, "code {code} at {c}");
            }
        }
    }

    /// The layout written out bit by bit, as first specified: the reference for the table-
    /// driven, parallel [`mxfp4_device_tiles`].
    fn reference_tiles(blocks: &[u8], rows: usize, cols: usize) -> Option<Vec<u8>> {
        let nb = cols / 32;
        if !cols.is_multiple_of(32)
            || blocks.len() != rows.checked_mul(nb)?.checked_mul(BLOCK_BYTES)?
        {
            return None;
        }
        let (rt, kt) = mxfp4_tiles(rows, cols);
        let codes_plane = rt * kt * TILE_CODE_BYTES;
        let mut out = vec![0u8; mxfp4_device_bytes(rows, cols)];
        for r in 0..rows {
            let (tr, rr) = (r / TILE_ROWS, r % TILE_ROWS);
            let (h, g) = (rr / 8, rr % 8);
            for b in 0..nb {
                let blk = &blocks[(r * nb + b) * BLOCK_BYTES..][..BLOCK_BYTES];
                let code = |i: usize| {
                    let byte = blk[1 + (i & 15)];
                    if i < 16 {
                        byte & 15
                    } else {
                        byte >> 4
                    }
                };
                let (ts, bi) = (b / 4, b % 4);
                let tile = tr * kt + ts;
                out[codes_plane + tile * TILE_SCALE_BYTES + rr * 4 + bi] = blk[0];
                for t in 0..4 {
                    let mut word = 0u32;
                    for (j, bits) in HALF_BITS.iter().enumerate() {
                        for (half, value) in
                            [8 * j + 2 * t, 8 * j + 2 * t + 1].into_iter().enumerate()
                        {
                            let c = code(value) as u32;
                            let fields = [c >> 3, (c >> 2) & 1, (c >> 1) & 1, c & 1];
                            for (field, &bit) in fields.iter().zip(bits) {
                                word |= field << (bit + 16 * half as u32);
                            }
                        }
                    }
                    let at = tile * TILE_CODE_BYTES + h * 512 + (4 * g + t) * 16 + bi * 4;
                    out[at..at + 4].copy_from_slice(&word.to_le_bytes());
                }
            }
        }
        Some(out)
    }

    #[test]
    fn the_table_driven_layout_is_the_bitwise_one() {
        for (rows, cols) in [
            (16, 128),
            (3, 32),
            (37, 96),
            (64, 256),
            (20, 160),
            (1, 4096),
        ] {
            let blocks = random_blocks(rows, cols, (rows * 7 + cols) as u64);
            assert_eq!(
                mxfp4_device_tiles(&blocks, rows, cols),
                reference_tiles(&blocks, rows, cols),
                "{rows}x{cols}"
            );
        }
        assert_eq!(mxfp4_device_tiles(&[], 0, 64), Some(Vec::new()));
    }

    #[test]
    fn wrong_sizes_are_refused() {
        let blocks = random_blocks(2, 64, 1);
        assert!(mxfp4_device_tiles(&blocks, 2, 64).is_some());
        assert!(mxfp4_device_tiles(&blocks[..20], 2, 64).is_none());
        assert!(mxfp4_device_tiles(&blocks, 2, 48).is_none());
        assert!(mxfp4_device_tiles(&blocks, 4, 64).is_none());
    }
}
