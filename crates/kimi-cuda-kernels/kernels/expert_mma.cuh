// Pieces shared by the routed-expert kernels that keep their weights packed and widen them in
// registers for `mma.sync.m16n8k16` (`mxfp4.cu`: MXFP4; `int4_experts.cu`: 4-bit integers):
// the gated activation, the MMA itself, the activation rows' fragment order and the
// epilogue that writes a warp's two 16-row tiles.
#pragma once
#include "common.cuh"

// The gated activation of a gate/up pair: 0 = SiLU-GLU, 1 = SiTU-GLU (Kimi K3:
// beta·tanh(g/beta)·sigmoid(g) · lbeta·tanh(u/lbeta); lbeta <= 0: u unchanged).
__device__ __forceinline__ float glu_act(float g, float u, int act, float beta, float lbeta) {
  if (act == 0) return g * sigmoidf_(g) * u;
  const float a = beta * tanhf(g / beta) * sigmoidf_(g);
  return a * (lbeta > 0.0f ? lbeta * tanhf(u / lbeta) : u);
}

__device__ __forceinline__ void mma_bf16_16816(float* c, uint32_t a0, uint32_t a1, uint32_t a2,
                                               uint32_t a3, uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint32_t word_of(const uint4& q, int i) {
  return i == 0 ? q.x : i == 1 ? q.y : i == 2 ? q.z : q.w;
}

// Where feature k of an activation row goes in the fragment order: per 32-value block, word
// 4t + j holds the bf16 pair (8j + 2t, 8j + 2t + 1).
__device__ __forceinline__ int act_slot(int k) {
  const int i = k & 31, j = i >> 3, r = i & 7;
  return (k & ~31) + ((r >> 1) * 4 + j) * 2 + (r & 1);
}

// The expert block (x, y) serves (the y-th that received pairs: the active list after
// `offsets`, as `moe_lists` writes it) and this warp's two 16-row weight tiles of it: glu =
// 1: gate tile R and up tile R (R = x * warps + warp); glu = 0: down tiles 2R and 2R + 1.
// False when the block or the warp has nothing to do.
struct ExpertTiles {
  uint32_t beg, end;   // the expert's pairs in sorted order
  int ra, rb;          // row tiles (rb = ra where there is no second: computed, not written)
  bool has_b;
  const uint8_t *wa, *wb;  // their matrices
};

__device__ __forceinline__ bool expert_tiles(const uint64_t* wtab, int glu,
                                             const uint32_t* offsets, int E, int rows_out,
                                             int warps, ExpertTiles& w) {
  const uint32_t* active = offsets + E + 1;
  if (blockIdx.y >= active[0]) return false;
  const uint32_t e = active[1 + blockIdx.y];
  w.beg = offsets[e];
  w.end = offsets[e + 1];
  const int warp = threadIdx.x >> 5, tiles_r = (rows_out + 15) >> 4;
  if (glu) {
    w.ra = w.rb = blockIdx.x * warps + warp;
    w.wa = reinterpret_cast<const uint8_t*>(wtab[3 * e]);
    w.wb = reinterpret_cast<const uint8_t*>(wtab[3 * e + 1]);
  } else {
    w.ra = 2 * (blockIdx.x * warps + warp);
    w.rb = w.ra + 1;
    w.wa = w.wb = reinterpret_cast<const uint8_t*>(wtab[3 * e + 2]);
  }
  if (w.ra >= tiles_r) return false;
  w.has_b = w.rb < tiles_r;
  if (!w.has_b) w.rb = w.ra;
  return true;
}

// This thread's B-fragment rows for pairs g0..: token n = nt * 8 + g of the group (glu
// rows are tokens, slots[q] / top_k; down rows sorted pairs, q), at column 8t of rows of
// Kp; null past the expert's pairs. And the accumulators, zeroed.
template <int NT>
__device__ __forceinline__ void pair_rows(const __nv_bfloat16* (&brow)[NT],
                                          float (&acc)[2][NT][4], uint32_t g0, uint32_t end,
                                          int g, int t, int glu, const uint32_t* slots,
                                          int top_k, const __nv_bfloat16* act, int Kp) {
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    const uint32_t q = g0 + nt * 8 + g;
    brow[nt] = nullptr;
    if (q < end) brow[nt] = act + (size_t)(glu ? slots[q] / top_k : q) * Kp + 8 * t;
  }
#pragma unroll
  for (int s = 0; s < 2; ++s)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int u = 0; u < 4; ++u) acc[s][nt][u] = 0.0f;
}

// A warp's results for pairs g0.. of its group: acc[s][nt][u] is row (g + 8 * (u >> 1)) of
// tile s (row tiles ra, rb), pair g0 + nt * 8 + 2t + (u & 1). glu: h = act(gate, up) for
// features ra * 16 + row as bf16 (hi, and lo at `out_lo` with SPLIT) in rows of `out_kp`
// at the pair's sorted position; down: f32 out[slots[q] * rows_out + row] for both tiles.
template <int NT, bool SPLIT>
__device__ __forceinline__ void expert_mma_store(const float (&acc)[2][NT][4], uint32_t g0,
                                                 uint32_t end, int g, int t, int glu, int ra,
                                                 int rb, bool has_b, const uint32_t* slots,
                                                 void* out, size_t out_lo, int rows_out,
                                                 int out_kp, int act_code, float beta,
                                                 float lbeta) {
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const uint32_t q = g0 + nt * 8 + 2 * t + (u & 1);
      if (q >= end) continue;
      const int r = g + 8 * (u >> 1);
      if (glu) {
        const int f = ra * 16 + r;
        if (f >= rows_out) continue;
        const float v = glu_act(acc[0][nt][u], acc[1][nt][u], act_code, beta, lbeta);
        __nv_bfloat16* h =
            reinterpret_cast<__nv_bfloat16*>(out) + (size_t)q * out_kp + act_slot(f);
        const __nv_bfloat16 hi = __float2bfloat16(v);
        h[0] = hi;
        if (SPLIT) h[out_lo] = __float2bfloat16(v - __bfloat162float(hi));
      } else {
        float* y = reinterpret_cast<float*>(out) + (size_t)slots[q] * rows_out;
        const int r0 = ra * 16 + r, r1 = rb * 16 + r;
        if (r0 < rows_out) y[r0] = acc[0][nt][u];
        if (has_b && r1 < rows_out) y[r1] = acc[1][nt][u];
      }
    }
  }
}
