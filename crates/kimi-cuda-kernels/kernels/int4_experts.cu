// Routed experts whose weights stay 4-bit integers on the device (Q4Z: AWQ, GPTQ and
// compressed-tensors INT4; ggml's Q4_0, Q4_1 and Q4_K) on the tensor cores: every (token,
// expert) pair of a MoE layer in one launch per projection, like `mxfp4.cu`, reading the
// planes of `quant_layout` that the GEMV of `quant.cu` reads (per 32-value block of a row,
// 16 code bytes — byte j holds value j in its low nibble and value j + 16 in its high one —
// and an f32 pair after all the codes: (d, z) for format 0, value (q − z)·d; (a, b) for
// format 3, value q·a − b).
//
// Exact weights: a code q becomes the bf16 integer q − zr (zr = z rounded into 0..127, or 0
// for format 3; |q − zr| < 128 is exact) in three instructions: its nibble ORed under the
// bits of bf16 128 and 128 + zr subtracted. Per block the tensor cores sum P = Σ (q − zr)·x
// over the block's 32 values, and the f32 accumulator takes d·P − c·S, S = Σ x over the block
// and c = d·(z − zr) (format 0) or b (format 3). Integer zero points (AWQ, GPTQ,
// compressed-tensors, Q4_0) make c = 0 and S is then not computed. Activations enter as bf16
// hi (+ lo = x − hi with SPLIT, close to f32 products); accumulation is f32.
//
// Grid and tiles as `moe_mxfp4_mma_*`: block (x, y) serves the y-th active expert, 8·NT pairs
// at a time; a warp owns gate and up tile R (glu) or down tiles 2R and 2R + 1, 16 rows each.
// Lane (g, t) reads rows g and g + 8 of both tiles: one 16-byte code load and one 8-byte
// header load per row and block, two blocks ahead of the math.
#include "expert_mma.cuh"

namespace i4 {
constexpr int WARPS = 4;

// One block of this lane's four weight rows ([tile][row g, g + 8]), as loaded.
struct Raw {
  uint4 c[2][2];
  float2 h[2][2];
};

__device__ __forceinline__ void load(Raw& r, const uint4* const (&code)[2][2],
                                     const float2* const (&head)[2][2], int b) {
#pragma unroll
  for (int s = 0; s < 2; ++s)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      r.c[s][h] = __ldg(code[s][h] + b);
      r.h[s][h] = __ldg(head[s][h] + b);
    }
}

__device__ __forceinline__ uint32_t bf16x2_sub(uint32_t a, uint32_t b) {
  __nv_bfloat162 r = __hsub2(*reinterpret_cast<const __nv_bfloat162*>(&a),
                             *reinterpret_cast<const __nv_bfloat162*>(&b));
  return *reinterpret_cast<const uint32_t*>(&r);
}

__device__ __forceinline__ float bf16x2_sum(uint32_t w) {
  return __uint_as_float(w << 16) + __uint_as_float(w & 0xFFFF0000u);
}

// The math of block `b`: this lane's A fragments from `r`, NT MMAs per tile and slice, the
// block's scales into acc.
template <int NT, bool SPLIT>
__device__ __forceinline__ void block_step(const Raw& r, int b, int fmt3, uint32_t sel, int wl,
                                           int t, const __nv_bfloat16* const (&brow)[NT],
                                           size_t act_lo, float (&acc)[2][NT][4]) {
  uint4 bh[NT], bl[NT];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    bh[nt] = bl[nt] = make_uint4(0, 0, 0, 0);
    if (brow[nt]) {
      const __nv_bfloat16* p = brow[nt] + (size_t)b * 32;
      bh[nt] = __ldg(reinterpret_cast<const uint4*>(p));
      if (SPLIT) bl[nt] = __ldg(reinterpret_cast<const uint4*>(p + act_lo));
    }
  }
  // Per row: scale d, offset term c and the bf16 pair 128 + zr.
  float d[2][2], c[2][2];
  uint32_t zz[2][2];
  bool offset = false;
#pragma unroll
  for (int s = 0; s < 2; ++s)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float2 v = r.h[s][h];
      const float zr = fmt3 ? 0.0f : fminf(fmaxf(rintf(v.y), 0.0f), 127.0f);
      d[s][h] = v.x;
      c[s][h] = fmt3 ? v.y : v.x * (v.y - zr);
      zz[s][h] = (0x4300u + (uint32_t)zr) * 0x10001u;
      offset |= c[s][h] != 0.0f;
    }
  // S for the tokens of this lane's accumulators (2t, 2t + 1 of each group of 8), only
  // when some row of the warp has an offset term in this block.
  float S[NT][2];
  if (__any_sync(0xffffffffu, offset)) {
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      // Lane (g, t) holds 8 of token g's 32 values; the four lanes of g add up.
      float v = 0.0f;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        v += bf16x2_sum(word_of(bh[nt], j));
        if (SPLIT) v += bf16x2_sum(word_of(bl[nt], j));
      }
      v += __shfl_xor_sync(0xffffffffu, v, 1);
      v += __shfl_xor_sync(0xffffffffu, v, 2);
      S[nt][0] = __shfl_sync(0xffffffffu, v, 8 * t);
      S[nt][1] = __shfl_sync(0xffffffffu, v, 8 * t + 4);
    }
  } else {
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) S[nt][0] = S[nt][1] = 0.0f;
  }
#pragma unroll
  for (int s = 0; s < 2; ++s) {
    // a[h][i]: row g + 8h; i = 2·slice + (0: values 2t, 2t + 1; 1: 2t + 8, 2t + 9) of the
    // slice's 16 values (slice 0: low nibbles of bytes 0..15, slice 1: high nibbles).
    uint32_t a[2][4];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const uint32_t ul = __byte_perm(word_of(r.c[s][h], wl), 0, sel);
      const uint32_t uh = __byte_perm(word_of(r.c[s][h], 2 + wl), 0, sel);
      const uint32_t z = zz[s][h];
      a[h][0] = bf16x2_sub((ul & 0x000F000Fu) | 0x43004300u, z);
      a[h][1] = bf16x2_sub((uh & 0x000F000Fu) | 0x43004300u, z);
      a[h][2] = bf16x2_sub(((ul >> 4) & 0x000F000Fu) | 0x43004300u, z);
      a[h][3] = bf16x2_sub(((uh >> 4) & 0x000F000Fu) | 0x43004300u, z);
    }
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      float p[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
      for (int sl = 0; sl < 2; ++sl) {
        mma_bf16_16816(p, a[0][2 * sl], a[1][2 * sl], a[0][2 * sl + 1], a[1][2 * sl + 1],
                       word_of(bh[nt], 2 * sl), word_of(bh[nt], 2 * sl + 1));
        if (SPLIT)
          mma_bf16_16816(p, a[0][2 * sl], a[1][2 * sl], a[0][2 * sl + 1], a[1][2 * sl + 1],
                         word_of(bl[nt], 2 * sl), word_of(bl[nt], 2 * sl + 1));
      }
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        const int h = u >> 1;
        acc[s][nt][u] = fmaf(d[s][h], p[u], fmaf(-c[s][h], S[nt][u & 1], acc[s][nt][u]));
      }
    }
  }
}
}  // namespace i4

// Expert projection over the pairs routed to each expert, 4-bit integer weights in the
// planes of `quant_layout` (format 0 or, with fmt3, format 3). Arguments as
// `moe_mxfp4_mma_*`: `act` holds bf16 activation rows of K rounded up to 128 in the fragment
// order (`mxfp4_act_bf16`), lo at `act_lo`; glu rows are tokens (slots[q] / top_k), down
// rows sorted pairs (q). Needs K % 32 == 0 and whole matrices (the planes from their start).
template <int NT, bool SPLIT>
__device__ __forceinline__ void int4_mma_body(const uint64_t* wtab, int glu, int fmt3,
                                              const __nv_bfloat16* act, size_t act_lo,
                                              int top_k, const uint32_t* offsets, int E,
                                              const uint32_t* slots, void* out, size_t out_lo,
                                              int rows_out, int out_kp, int K, int act_code,
                                              float beta, float lbeta) {
  ExpertTiles w;
  if (!expert_tiles(wtab, glu, offsets, E, rows_out, i4::WARPS, w)) return;
  const uint32_t beg = w.beg, end = w.end;
  const int ra = w.ra, rb = w.rb;
  const bool has_b = w.has_b;
  const uint8_t *wa = w.wa, *wb = w.wb;
  const int lane = threadIdx.x & 31;
  const int g = lane >> 2, t = lane & 3;
  const int nb = K >> 5, Kp = ((K + 127) >> 7) << 7;
  // This lane's rows g and g + 8 of both tiles (rows past the end read the last one, never
  // written): their code blocks and headers.
  const uint4* code[2][2];
  const float2* head[2][2];
#pragma unroll
  for (int s = 0; s < 2; ++s)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = min((s ? rb : ra) * 16 + g + 8 * h, rows_out - 1);
      const uint8_t* w = s ? wb : wa;
      code[s][h] = reinterpret_cast<const uint4*>(w) + (size_t)row * nb;
      head[s][h] = reinterpret_cast<const float2*>(w + (size_t)rows_out * nb * 16) +
                   (size_t)row * nb;
    }
  // Bytes 2t, 2t + 1 of a code word pair to bits 0..7 and 16..23.
  const uint32_t sel = (t & 1) ? 0x4342u : 0x4140u;
  const int wl = t >> 1;

  for (uint32_t g0 = beg; g0 < end; g0 += 8 * NT) {
    const __nv_bfloat16* brow[NT];
    float acc[2][NT][4];
    pair_rows<NT>(brow, acc, g0, end, g, t, glu, slots, top_k, act, Kp);

    // Two blocks in flight ahead of the math (A: even blocks, B: odd).
    i4::Raw A, B;
    i4::load(A, code, head, 0);
    if (nb > 1) i4::load(B, code, head, 1);
    for (int b = 0; b < nb; b += 2) {
      i4::Raw cur = A;
      if (b + 2 < nb) i4::load(A, code, head, b + 2);
      i4::block_step<NT, SPLIT>(cur, b, fmt3, sel, wl, t, brow, act_lo, acc);
      if (b + 1 < nb) {
        cur = B;
        if (b + 3 < nb) i4::load(B, code, head, b + 3);
        i4::block_step<NT, SPLIT>(cur, b + 1, fmt3, sel, wl, t, brow, act_lo, acc);
      }
    }
    expert_mma_store<NT, SPLIT>(acc, g0, end, g, t, glu, ra, rb, has_b, slots, out, out_lo,
                                rows_out, out_kp, act_code, beta, lbeta);
  }
}

#define INT4_MMA_KERNEL(NAME, NT, SPLIT, MINB)                                                 \
  extern "C" __global__ void __launch_bounds__(i4::WARPS * 32, MINB)                            \
      NAME(const uint64_t* wtab, int glu, int fmt3, const __nv_bfloat16* act, size_t act_lo,    \
           int top_k, const uint32_t* offsets, int E, const uint32_t* slots, void* out,         \
           size_t out_lo, int rows_out, int out_kp, int K, int act_code, float beta,            \
           float lbeta) {                                                                       \
    pdl_enter();                                                                                \
    int4_mma_body<NT, SPLIT>(wtab, glu, fmt3, act, act_lo, top_k, offsets, E, slots, out,       \
                             out_lo, rows_out, out_kp, K, act_code, beta, lbeta);               \
  }
INT4_MMA_KERNEL(moe_int4_mma_1_half, 1, false, 3)
INT4_MMA_KERNEL(moe_int4_mma_1_split, 1, true, 3)
INT4_MMA_KERNEL(moe_int4_mma_2_half, 2, false, 3)
INT4_MMA_KERNEL(moe_int4_mma_2_split, 2, true, 3)
INT4_MMA_KERNEL(moe_int4_mma_4_half, 4, false, 2)
INT4_MMA_KERNEL(moe_int4_mma_4_split, 4, true, 2)
