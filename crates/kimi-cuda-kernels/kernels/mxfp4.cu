// MXFP4 (OCP microscaling FP4) routed experts on the tensor cores: every (token, expert)
// pair of a MoE layer in one launch per projection, the expert weights kept packed on the
// device (Kimi K3's routed experts, 4.25 bits per weight) and widened to bf16 in registers.
//
// Device layout (made on the host by `layout::mxfp4_device_tiles`, described there in full):
// a [rows, cols] matrix in tiles of 16 rows x 128 values; each tile is 1,024 code bytes in
// which lane 4g + t of a warp finds, in one 16-byte load, its A-fragment codes of rows g and
// (512 bytes on) g + 8 for the tile's four 32-value blocks, then (after all tiles' codes) 64
// E8M0 scale bytes per tile, row-major by (row, block).
//
// Decoding: a code word holds four bf16 pairs whose bits are already where a bf16 wants them
// (sign at 15, exponent low bits at 8..7, mantissa top bit at 6: the E2M1 value times
// 2^-126, zero and the subnormal 0.5 included) after a shift and a mask; one bf16 multiply by
// 2^(scale - 1) makes the exact MXFP4 value (at most two significant bits: exact in bf16).
//
// Products: the weights are the M side of `mma.sync.m16n8k16` (16 rows per fragment) and
// the tokens the N side (8 per fragment), so one pair per expert, the decode case, wastes
// tensor-core work but none of the weight stream. Activations enter as bf16 rows in the
// fragment order (`mxfp4_act_bf16`, or the gate/up epilogue for the down projection): hi,
// and with `SPLIT` a second term lo = x - hi (close to f32 products). Accumulation is f32.
#include "expert_mma.cuh"

namespace mx {
constexpr int WARPS = 4;  // per CTA
constexpr int TILE_CODE_BYTES = 1024;
constexpr int TILE_SCALE_BYTES = 64;
}  // namespace mx

__device__ __forceinline__ uint32_t bf16x2_mul(uint32_t a, uint32_t b) {
  __nv_bfloat162 r = __hmul2(*reinterpret_cast<const __nv_bfloat162*>(&a),
                             *reinterpret_cast<const __nv_bfloat162*>(&b));
  return *reinterpret_cast<const uint32_t*>(&r);
}

// The four bf16 pairs of a code word, each value E2M1 * 2^-126 (see the layout's HALF_BITS).
__device__ __forceinline__ void mx_unpack(uint32_t w, uint32_t p[4]) {
  constexpr uint32_t M = 0x81C081C0u;
  p[0] = w & M;
  p[1] = (w << 6) & M;
  p[2] = (w << 3) & M;
  p[3] = ((w << 2) & 0x80008000u) | ((w >> 6) & 0x01000100u) | ((w >> 4) & 0x00C000C0u);
}

// The pairs of a word times 2^(s - 1), s the block's E8M0 byte: exact MXFP4 values in bf16.
// 2^(s - 1) is one bf16 up to s = 128; larger exponents (never seen in trained weights)
// take a second multiply.
__device__ __forceinline__ void mx_scale(uint32_t p[4], uint32_t s) {
  uint32_t e = s + 126;
  if (s > 128) {
#pragma unroll
    for (int j = 0; j < 4; ++j) p[j] = bf16x2_mul(p[j], 0x7F007F00u);  // 2^127
    e = s - 1;
  }
  const uint32_t s2 = (e << 7) | (e << 23);
#pragma unroll
  for (int j = 0; j < 4; ++j) p[j] = bf16x2_mul(p[j], s2);
}

// The weight stream goes through shared memory by cp.async, STAGES k tiles deep per warp,
// so that many bytes are in flight without holding them in registers. Each lane copies and
// later reads only its own slots (codes of rows g and g + 8 of both tiles, then their four
// scale words), so the pipeline needs no barrier.
constexpr int MX_STAGES = 4;
constexpr int MX_STAGE_BYTES = 5 * 32 * 16;  // per warp: four code slots and one scale slot

__device__ __forceinline__ void mx_cp16(uint32_t dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src));
}
__device__ __forceinline__ void mx_cp4(uint32_t dst, const void* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(dst), "l"(src));
}
__device__ __forceinline__ void mx_commit() { asm volatile("cp.async.commit_group;\n"); }
template <int N>
__device__ __forceinline__ void mx_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// Queues k tile `S` of both row tiles into this lane's slots of stage `S % MX_STAGES`.
__device__ __forceinline__ void mx_issue(uint32_t warp_stages, int lane, int S,
                                         const uint8_t* ca, const uint8_t* cb,
                                         const uint8_t* sa, const uint8_t* sb) {
  const uint32_t st = warp_stages + (S % MX_STAGES) * MX_STAGE_BYTES + lane * 16;
  const size_t c = (size_t)S * mx::TILE_CODE_BYTES, sc = (size_t)S * mx::TILE_SCALE_BYTES;
  mx_cp16(st, ca + c);
  mx_cp16(st + 512, ca + c + 512);
  mx_cp16(st + 1024, cb + c);
  mx_cp16(st + 1536, cb + c + 512);
  mx_cp4(st + 2048, sa + sc);
  mx_cp4(st + 2052, sa + sc + 32);
  mx_cp4(st + 2056, sb + sc);
  mx_cp4(st + 2060, sb + sc + 32);
}

// Expert projection over the pairs routed to each expert, MXFP4 weights. Grid (row chunks,
// number of pairs or experts, whichever is fewer); 4 warps. Block (x, y) serves the y-th
// expert that received pairs (the active list after `offsets`, as `moe_lists` writes it), its
// pairs 8 * NT at a time. Each warp owns two 16-row weight tiles: glu = 1: gate tile R and up
// tile R (R = x * 4 + warp), writing h = act(gate·x, up·x) for 16 features as bf16 (hi, and
// lo at `out_lo`) rows of `out_kp` in the fragment order, at the pair's sorted position;
// glu = 0: down tiles 2R and 2R + 1, writing f32 out[slots[q] * rows_out + row].
// `act` holds bf16 activation rows of `Kp` (K rounded up to 128) in the fragment order, lo
// at `act_lo`: glu rows are tokens (slots[q] / top_k), down rows sorted pairs (q).
template <int NT, bool SPLIT>
__device__ __forceinline__ void mxfp4_mma_body(const uint64_t* wtab, int glu,
                                               const __nv_bfloat16* act, size_t act_lo,
                                               int top_k, const uint32_t* offsets, int E,
                                               const uint32_t* slots, void* out, size_t out_lo,
                                               int rows_out, int out_kp, int K, int act_code,
                                               float beta, float lbeta) {
  ExpertTiles w;
  if (!expert_tiles(wtab, glu, offsets, E, rows_out, mx::WARPS, w)) return;
  const uint32_t beg = w.beg, end = w.end;
  const int ra = w.ra, rb = w.rb;
  const bool has_b = w.has_b;
  const uint8_t *wa = w.wa, *wb = w.wb;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int g = lane >> 2, t = lane & 3;
  const int tiles_r = (rows_out + 15) >> 4, kt = (K + 127) >> 7, Kp = kt * 128;
  const size_t codes_plane = (size_t)tiles_r * kt * mx::TILE_CODE_BYTES;
  const uint8_t* ca = wa + (size_t)ra * kt * mx::TILE_CODE_BYTES + lane * 16;
  const uint8_t* cb = wb + (size_t)rb * kt * mx::TILE_CODE_BYTES + lane * 16;
  const uint8_t* sa = wa + codes_plane + (size_t)ra * kt * mx::TILE_SCALE_BYTES + g * 4;
  const uint8_t* sb = wb + codes_plane + (size_t)rb * kt * mx::TILE_SCALE_BYTES + g * 4;
  extern __shared__ __align__(16) uint8_t stages[];
  const uint32_t warp_stages = smem_addr(stages) + warp * (MX_STAGES * MX_STAGE_BYTES);

  for (uint32_t g0 = beg; g0 < end; g0 += 8 * NT) {
    const __nv_bfloat16* brow[NT];
    float acc[2][NT][4];
    pair_rows<NT>(brow, acc, g0, end, g, t, glu, slots, top_k, act, Kp);

#pragma unroll
    for (int st = 0; st < MX_STAGES - 1; ++st) {
      if (st < kt) mx_issue(warp_stages, lane, st, ca, cb, sa, sb);
      mx_commit();
    }
    for (int S = 0; S < kt; ++S) {
      mx_wait<MX_STAGES - 2>();
      const uint8_t* mine = stages + warp * (MX_STAGES * MX_STAGE_BYTES) +
                            (S % MX_STAGES) * MX_STAGE_BYTES + lane * 16;
      const uint4 qa0 = *reinterpret_cast<const uint4*>(mine);
      const uint4 qa1 = *reinterpret_cast<const uint4*>(mine + 512);
      const uint4 qb0 = *reinterpret_cast<const uint4*>(mine + 1024);
      const uint4 qb1 = *reinterpret_cast<const uint4*>(mine + 1536);
      const uint4 scl = *reinterpret_cast<const uint4*>(mine + 2048);
      if (S + MX_STAGES - 1 < kt) mx_issue(warp_stages, lane, S + MX_STAGES - 1, ca, cb, sa, sb);
      mx_commit();
#pragma unroll
      for (int blk = 0; blk < 4; ++blk) {
        uint4 bh[NT], bl[NT];
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
          bh[nt] = bl[nt] = make_uint4(0, 0, 0, 0);
          if (brow[nt]) {
            const __nv_bfloat16* p = brow[nt] + (size_t)(S * 4 + blk) * 32;
            bh[nt] = __ldg(reinterpret_cast<const uint4*>(p));
            if (SPLIT) bl[nt] = __ldg(reinterpret_cast<const uint4*>(p + act_lo));
          }
        }
#pragma unroll
        for (int s = 0; s < 2; ++s) {
          uint32_t p0[4], p1[4];
          mx_unpack(word_of(s == 0 ? qa0 : qb0, blk), p0);
          mx_unpack(word_of(s == 0 ? qa1 : qb1, blk), p1);
          mx_scale(p0, ((s == 0 ? scl.x : scl.z) >> (8 * blk)) & 0xFFu);
          mx_scale(p1, ((s == 0 ? scl.y : scl.w) >> (8 * blk)) & 0xFFu);
#pragma unroll
          for (int h = 0; h < 2; ++h) {
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) {
              mma_bf16_16816(acc[s][nt], p0[2 * h], p1[2 * h], p0[2 * h + 1], p1[2 * h + 1],
                             word_of(bh[nt], 2 * h), word_of(bh[nt], 2 * h + 1));
              if (SPLIT)
                mma_bf16_16816(acc[s][nt], p0[2 * h], p1[2 * h], p0[2 * h + 1], p1[2 * h + 1],
                               word_of(bl[nt], 2 * h), word_of(bl[nt], 2 * h + 1));
            }
          }
        }
      }
    }

    expert_mma_store<NT, SPLIT>(acc, g0, end, g, t, glu, ra, rb, has_b, slots, out, out_lo,
                                rows_out, out_kp, act_code, beta, lbeta);
  }
}

#define MXFP4_MMA_KERNEL(NAME, NT, SPLIT, MINB)                                              \
  extern "C" __global__ void __launch_bounds__(mx::WARPS * 32, MINB)                          \
      NAME(const uint64_t* wtab, int glu, const __nv_bfloat16* act, size_t act_lo, int top_k, \
           const uint32_t* offsets, int E, const uint32_t* slots, void* out, size_t out_lo,   \
           int rows_out, int out_kp, int K, int act_code, float beta, float lbeta) {          \
    pdl_enter();                                                                              \
    mxfp4_mma_body<NT, SPLIT>(wtab, glu, act, act_lo, top_k, offsets, E, slots, out, out_lo,  \
                              rows_out, out_kp, K, act_code, beta, lbeta);                    \
  }
MXFP4_MMA_KERNEL(moe_mxfp4_mma_1_half, 1, false, 5)
MXFP4_MMA_KERNEL(moe_mxfp4_mma_1_split, 1, true, 5)
MXFP4_MMA_KERNEL(moe_mxfp4_mma_2_half, 2, false, 3)
MXFP4_MMA_KERNEL(moe_mxfp4_mma_2_split, 2, true, 3)
MXFP4_MMA_KERNEL(moe_mxfp4_mma_4_half, 4, false, 2)
MXFP4_MMA_KERNEL(moe_mxfp4_mma_4_split, 4, true, 2)

// f32 rows [rows, K] -> bf16 rows [rows, Kp] in the fragment order (zeros past K): hi, and
// with `split` lo = x - hi at `lo` elements on. One thread per bf16 pair.
extern "C" __global__ void mxfp4_act_bf16(const float* x, __nv_bfloat16* out, size_t lo,
                                          int rows, int K, int Kp, int split) {
  pdl_enter();
  const size_t words = (size_t)rows * (Kp >> 1);
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < words;
       i += (size_t)gridDim.x * blockDim.x) {
    const size_t row = i / (Kp >> 1);
    const int w = (int)(i - row * (Kp >> 1));
    const int r16 = w & 15, k = (w >> 4) * 32 + 8 * (r16 & 3) + 2 * (r16 >> 2);
    float v0 = 0.0f, v1 = 0.0f;
    if (k < K) {
      const float2 v = *reinterpret_cast<const float2*>(x + row * K + k);
      v0 = v.x;
      v1 = v.y;
    }
    const __nv_bfloat162 hi = __floats2bfloat162_rn(v0, v1);
    reinterpret_cast<__nv_bfloat162*>(out)[i] = hi;
    if (split)
      reinterpret_cast<__nv_bfloat162*>(out + lo)[i] =
          __floats2bfloat162_rn(v0 - __low2float(hi), v1 - __high2float(hi));
  }
}

// `out [rows, cols] f32` = the MXFP4 matrix at `w` (device layout above), one thread per
// value (reading weights back, and the fallback paths that need them widened).
extern "C" __global__ void mxfp4_to_f32(const uint8_t* w, float* out, int rows, int cols) {
  pdl_enter();
  const int tiles_r = (rows + 15) >> 4, kt = (cols + 127) >> 7;
  const size_t codes_plane = (size_t)tiles_r * kt * mx::TILE_CODE_BYTES;
  const size_t total = (size_t)rows * cols;
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < total;
       i += (size_t)gridDim.x * blockDim.x) {
    const int r = (int)(i / cols), c = (int)(i - (size_t)r * cols);
    const size_t tile = (size_t)(r >> 4) * kt + (c >> 7);
    const int rr = r & 15, blk = (c >> 5) & 3, v = c & 31;
    const int j = v >> 3, t = (v & 7) >> 1, half = v & 1;
    const uint32_t word = *reinterpret_cast<const uint32_t*>(
        w + tile * mx::TILE_CODE_BYTES + (rr >> 3) * 512 + (4 * (rr & 7) + t) * 16 + blk * 4);
    uint32_t p[4];
    mx_unpack(word, p);
    const uint32_t bits = half ? p[j] >> 16 : p[j] & 0xFFFFu;
    // Sign at 15, e1 e0 m at 8..6.
    const float mags[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
    const float m = mags[(bits >> 6) & 7];
    const int s = w[codes_plane + tile * mx::TILE_SCALE_BYTES + rr * 4 + blk];
    const float val = ldexpf(m, s - 127);
    out[i] = bits & 0x8000u ? -val : val;
  }
}

// The device layout of an MXFP4 `[rows, cols]` matrix written into `w` (which already holds
// the layout of a matrix of this shape: its padding is zero) from ggml `block_mxfp4` blocks
// copied to the device as stored (an expert's slot fill: the blocks cross the host link at its
// speed and are laid out here). One thread per (row, 32-value block); the placement is
// `layout.rs`'s `mxfp4_device_tiles`: the scale byte at `codes_plane + tile * 64 + rr * 4 +
// blk`, and for each t = 0..3 the word of values 8j + 2t + half (j = 0..3) at `tile * 1024 +
// (rr / 8) * 512 + (4 * (rr % 8) + t) * 16 + blk * 4`, each code's sign, e1, e0 and m bits at
// HALF_BITS[j] (+ 16 for the high value of the pair).
__device__ __forceinline__ uint32_t mx_spread(uint32_t code, int j, int half) {
  constexpr int HALF_BITS[4][4] = {{15, 8, 7, 6}, {9, 2, 1, 0}, {12, 5, 4, 3}, {13, 14, 11, 10}};
  const int sh = 16 * half;
  return ((code >> 3) << (HALF_BITS[j][0] + sh)) | (((code >> 2) & 1u) << (HALF_BITS[j][1] + sh)) |
         (((code >> 1) & 1u) << (HALF_BITS[j][2] + sh)) | ((code & 1u) << (HALF_BITS[j][3] + sh));
}

extern "C" __global__ void mxfp4_from_blocks(const uint8_t* blocks, uint8_t* w, int rows, int cols) {
  pdl_enter();
  const int nb = cols >> 5, tiles_r = (rows + 15) >> 4, kt = (cols + 127) >> 7;
  const size_t codes_plane = (size_t)tiles_r * kt * mx::TILE_CODE_BYTES;
  const size_t total = (size_t)rows * nb;
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < total;
       i += (size_t)gridDim.x * blockDim.x) {
    const int r = (int)(i / nb), b = (int)(i - (size_t)r * nb);
    const uint8_t* blk = blocks + i * 17;
    const int rr = r & 15, h = rr >> 3, g = rr & 7, bi = b & 3;
    const size_t tile = (size_t)(r >> 4) * kt + (b >> 2);
    w[codes_plane + tile * mx::TILE_SCALE_BYTES + rr * 4 + bi] = blk[0];
    const uint8_t* q = blk + 1;
#pragma unroll
    for (int t = 0; t < 4; ++t) {
      uint32_t word = 0;
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const uint32_t lo = q[2 * t + half], hi = q[8 + 2 * t + half];
        // Value 8j + 2t + half: byte 2t + half (j = 0 low nibble, j = 2 high) or byte
        // 8 + 2t + half (j = 1 low, j = 3 high).
        word |= mx_spread(lo & 15u, 0, half) | mx_spread(lo >> 4, 2, half) |
                mx_spread(hi & 15u, 1, half) | mx_spread(hi >> 4, 3, half);
      }
      *reinterpret_cast<uint32_t*>(w + tile * mx::TILE_CODE_BYTES + h * 512 + (4 * g + t) * 16 +
                                   bi * 4) = word;
    }
  }
}
