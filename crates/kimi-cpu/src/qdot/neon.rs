//! aarch64 NEON kernels (baseline NEON only: widening multiplies and pairwise adds, no
//! `dotprod` extension). Each block's integer dot is reduced to a scalar and then scaled
//! and summed in exactly the scalar kernel's order, so results equal the scalar ones bit
//! for bit.

use std::arch::aarch64::*;

use super::{mxfp4_half_scale, q4k_scale_min, Kind, Q8Acts, MXFP4_DOUBLED, QK};

/// # Safety
/// Sizes as checked by `qdot::matmul_rows_with` (NEON is part of the aarch64 baseline).
pub(super) unsafe fn matmul_rows(kind: Kind, w: &[u8], x: &Q8Acts, out: &mut [f32]) {
    let row_bytes = kind.row_bytes(x.k);
    for (r, row) in w.chunks_exact(row_bytes.max(1)).enumerate() {
        for t in 0..x.n {
            // SAFETY: `row` is one whole row and token `t` exists (checked by the caller).
            out[r * x.n + t] = unsafe { row_dot(kind, row, x, t) };
        }
    }
}

/// `acc + Σ w[i]·x[i]` over 16 signed bytes, widened to i32 lanes (|products| ≤ 2^14, so
/// the i16 stage cannot overflow).
#[inline(always)]
unsafe fn dot16(acc: int32x4_t, w: int8x16_t, x: int8x16_t) -> int32x4_t {
    // SAFETY: NEON is baseline on aarch64; register-only operations.
    unsafe {
        let lo = vmull_s8(vget_low_s8(w), vget_low_s8(x));
        let hi = vmull_high_s8(w, x);
        vpadalq_s16(vpadalq_s16(acc, lo), hi)
    }
}

/// Q5_0's high bits of 16 values: byte `l` is `0x10` where bit `l` of `lo | hi << 8` is
/// set, else 0.
#[inline(always)]
unsafe fn q5_0_high_bits(lo: u8, hi: u8) -> uint8x16_t {
    // SAFETY: NEON is baseline on aarch64; the mask is read from a local array.
    unsafe {
        const BITS: [u8; 16] = [1, 2, 4, 8, 16, 32, 64, 128, 1, 2, 4, 8, 16, 32, 64, 128];
        let bytes = vcombine_u8(vdup_n_u8(lo), vdup_n_u8(hi));
        let set = vtstq_u8(bytes, vld1q_u8(BITS.as_ptr()));
        vandq_u8(set, vdupq_n_u8(0x10))
    }
}

/// Values `16s..16s + 16` (`s` < 2) of activation block `j` (< 8) of the Q6_K super-block
/// `blk`, `q - 32` as signed bytes (layout in `qdot::q6k_level`).
#[inline(always)]
unsafe fn q6k_levels16(blk: &[u8], j: usize, s: usize) -> int8x16_t {
    let (h, k) = (j / 4, j % 4);
    let lo = 64 * h + 32 * (k % 2) + 16 * s;
    let hi = 128 + 32 * h + 16 * s;
    // SAFETY: NEON is baseline; both loads read 16 bytes of bounds-checked sub-slices.
    unsafe {
        let ql = vld1q_u8(blk[lo..lo + 16].as_ptr());
        let qh = vld1q_u8(blk[hi..hi + 16].as_ptr());
        let low = if k < 2 {
            vandq_u8(ql, vdupq_n_u8(0x0F))
        } else {
            vshrq_n_u8::<4>(ql)
        };
        // Bits 2k..2k + 2 of each byte to bits 4..6.
        let high = match k {
            0 => vshlq_n_u8::<4>(qh),
            1 => vshlq_n_u8::<2>(qh),
            2 => qh,
            _ => vshrq_n_u8::<2>(qh),
        };
        let q = vorrq_u8(low, vandq_u8(high, vdupq_n_u8(0x30)));
        vsubq_s8(vreinterpretq_s8_u8(q), vdupq_n_s8(32))
    }
}

#[inline(always)]
fn f16_at(b: &[u8], i: usize) -> f32 {
    crate::quant::f16_to_f32(u16::from_le_bytes([b[i], b[i + 1]]))
}

/// # Safety
/// `row` is one whole row of `x.k` values of `kind`; token `t` exists in `x`.
unsafe fn row_dot(kind: Kind, row: &[u8], x: &Q8Acts, t: usize) -> f32 {
    let nb = x.blocks();
    let qs = &x.qs[t * x.k..(t + 1) * x.k];
    let (xd, xs) = (&x.d[t * nb..(t + 1) * nb], &x.sum[t * nb..(t + 1) * nb]);
    let (mut acc, mut offset) = (0f32, 0f32);
    // SAFETY (every load below): each reads 16 bytes inside a slice that was bounds-checked
    // to hold them (`blk`, `q`, `half` and `qh` are exact sub-slices; the MXFP4 table is a
    // 16-byte array).
    unsafe {
        let m4 = vdupq_n_u8(0x0F);
        match kind {
            Kind::Q4_0 | Kind::Q4_1 | Kind::Q5_0 | Kind::Q8_0 => {
                let bb = kind.block_bytes();
                for (b, blk) in row.chunks_exact(bb).enumerate() {
                    let q = &qs[b * QK..(b + 1) * QK];
                    let x0 = vld1q_s8(q.as_ptr());
                    let x1 = vld1q_s8(q[16..].as_ptr());
                    let dw = f16_at(blk, 0);
                    let sum = match kind {
                        Kind::Q8_0 => {
                            let w0 = vld1q_s8(blk[2..18].as_ptr().cast());
                            let w1 = vld1q_s8(blk[18..34].as_ptr().cast());
                            dot16(dot16(vdupq_n_s32(0), w0, x0), w1, x1)
                        }
                        _ => {
                            let qo = match kind {
                                Kind::Q4_0 => 2,
                                Kind::Q4_1 => 4,
                                _ => 6,
                            };
                            let nib = vld1q_u8(blk[qo..qo + 16].as_ptr());
                            let mut lo = vandq_u8(nib, m4);
                            let mut hi = vshrq_n_u8::<4>(nib);
                            if kind == Kind::Q5_0 {
                                // Bits 0..16 of qh top values 0..16, bits 16..32 the rest.
                                lo = vorrq_u8(lo, q5_0_high_bits(blk[2], blk[3]));
                                hi = vorrq_u8(hi, q5_0_high_bits(blk[4], blk[5]));
                            }
                            let (lo, hi) = (vreinterpretq_s8_u8(lo), vreinterpretq_s8_u8(hi));
                            dot16(dot16(vdupq_n_s32(0), lo, x0), hi, x1)
                        }
                    };
                    let dot = vaddvq_s32(sum);
                    // The scalar kernel's expressions, in its order.
                    acc += dw * xd[b] * dot as f32;
                    match kind {
                        Kind::Q4_0 => offset += -8.0 * dw * xs[b],
                        Kind::Q5_0 => offset += -16.0 * dw * xs[b],
                        Kind::Q4_1 => offset += f16_at(blk, 2) * x.sum_f16[t * nb + b],
                        _ => {}
                    }
                }
            }
            Kind::Q4K | Kind::Q5K => {
                let five = kind == Kind::Q5K;
                for (sb, blk) in row.chunks_exact(kind.block_bytes()).enumerate() {
                    let (d, dmin) = (f16_at(blk, 0), f16_at(blk, 2));
                    let (scales, qh) = (&blk[4..16], &blk[16..48]);
                    let nibs = &blk[if five { 48 } else { 16 }..];
                    for j in 0..8 {
                        let (sc, m) = q4k_scale_min(j, scales);
                        let b = sb * 8 + j;
                        let q = &qs[b * QK..(b + 1) * QK];
                        let half = &nibs[32 * (j / 2)..32 * (j / 2) + 32];
                        let mut sum = vdupq_n_s32(0);
                        for h in 0..2 {
                            let v = vld1q_u8(half[16 * h..16 * h + 16].as_ptr());
                            let mut v = if j % 2 == 0 {
                                vandq_u8(v, m4)
                            } else {
                                vshrq_n_u8::<4>(v)
                            };
                            if five {
                                // Bit j of qh[l] is the fifth bit of value l.
                                let hb = vld1q_u8(qh[16 * h..16 * h + 16].as_ptr());
                                let set = vtstq_u8(hb, vdupq_n_u8(1 << j));
                                v = vorrq_u8(v, vandq_u8(set, vdupq_n_u8(0x10)));
                            }
                            let xv = vld1q_s8(q[16 * h..16 * h + 16].as_ptr());
                            sum = dot16(sum, vreinterpretq_s8_u8(v), xv);
                        }
                        let dot = vaddvq_s32(sum);
                        acc += d * f32::from(sc) * xd[b] * dot as f32;
                        offset += -dmin * f32::from(m) * xs[b];
                    }
                }
            }
            Kind::Mxfp4 => {
                // Doubled E2M1 values by table lookup (`tbl`, one per 16 codes).
                let table = vld1q_s8(MXFP4_DOUBLED.as_ptr());
                for (b, blk) in row.chunks_exact(17).enumerate() {
                    let q = &qs[b * QK..(b + 1) * QK];
                    let x0 = vld1q_s8(q.as_ptr());
                    let x1 = vld1q_s8(q[16..].as_ptr());
                    let nib = vld1q_u8(blk[1..17].as_ptr());
                    let lo = vqtbl1q_s8(table, vandq_u8(nib, m4));
                    let hi = vqtbl1q_s8(table, vshrq_n_u8::<4>(nib));
                    let dot = vaddvq_s32(dot16(dot16(vdupq_n_s32(0), lo, x0), hi, x1));
                    acc += mxfp4_half_scale(blk[0]) * xd[b] * dot as f32;
                }
            }
            Kind::Q6K => {
                for (sb, blk) in row.chunks_exact(210).enumerate() {
                    let d = f16_at(blk, 208);
                    for j in 0..8 {
                        let b = sb * 8 + j;
                        let q = &qs[b * QK..(b + 1) * QK];
                        let mut dot = 0i32;
                        for s in 0..2 {
                            let w = q6k_levels16(blk, j, s);
                            let xv = vld1q_s8(q[16 * s..16 * s + 16].as_ptr());
                            let part = vaddvq_s32(dot16(vdupq_n_s32(0), w, xv));
                            dot += i32::from(blk[192 + 2 * j + s] as i8) * part;
                        }
                        acc += d * xd[b] * dot as f32;
                    }
                }
            }
        }
    }
    acc + offset
}
