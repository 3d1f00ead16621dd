//! Device layouts of packed weight formats: pure host code (no CUDA), so that its tests run
//! in every build.
#![cfg_attr(not(feature = "cuda"), allow(dead_code))]

/// Bytes per block of 32 values in ggml's `block_mxfp4`: the E8M0 scale, then 16 code bytes.
const BLOCK_BYTES: usize = 17;

/// The device layout of an MXFP4 matrix from ggml `block_mxfp4` bytes: every block's 16 code
/// bytes in order (the codes plane), then every block's scale byte (the scales plane). The
/// codes keep ggml's nibble order (value `j` low, `j + 16` high), which the kernels read.
/// `None` when `blocks` is not a whole number of blocks.
pub(crate) fn mxfp4_device_planes(blocks: &[u8]) -> Option<Vec<u8>> {
    if !blocks.len().is_multiple_of(BLOCK_BYTES) {
        return None;
    }
    let n = blocks.len() / BLOCK_BYTES;
    let mut out = vec![0u8; n * BLOCK_BYTES];
    let (codes, scales) = out.split_at_mut(n * 16);
    for ((b, c), s) in blocks
        .chunks_exact(BLOCK_BYTES)
        .zip(codes.chunks_exact_mut(16))
        .zip(scales.iter_mut())
    {
        *s = b[0];
        c.copy_from_slice(&b[1..]);
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn planes_split_scales_from_codes() {
        let mut blocks = Vec::new();
        for blk in 0..3u8 {
            blocks.push(100 + blk);
            blocks.extend((0..16).map(|j| blk * 16 + j));
        }
        let planes = mxfp4_device_planes(&blocks).expect("whole blocks");
        assert_eq!(planes.len(), 51);
        assert_eq!(&planes[..16], &(0..16).collect::<Vec<u8>>()[..]);
        assert_eq!(&planes[16..32], &(16..32).collect::<Vec<u8>>()[..]);
        assert_eq!(&planes[48..], &[100, 101, 102]);
        assert!(mxfp4_device_planes(&blocks[..20]).is_none());
    }
}
