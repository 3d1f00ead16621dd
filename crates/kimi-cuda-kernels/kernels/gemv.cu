// Small-batch `y [n, o] = x [n, k] · wᵀ` for bf16 weights `w [o, k]` and f32 activations:
// f32 products and accumulation (no rounding of the activations), each weight row read once
// per group of up to NT tokens. Decode-sized batches only; cuBLAS takes the rest.
//
// Decode is bound by the weight stream, and a stream only reaches HBM bandwidth with enough
// bytes in flight per SM. So each warp owns RW = 2 rows and issues all 2·U 16-byte loads of
// a step (U per row) before any arithmetic, and the kernel is bounded to 64 registers per
// thread so that 4 blocks (32 warps) share an SM: up to 32 KiB of loads in flight per SM.
// Rows shorter than a step (k = 1024 is 4 loads per lane) still keep 2·4 loads in flight.
// Grid ceil(o / 16); block 256 = 8 warps. Needs k % 8 == 0 and 16-byte aligned `w` and `x`
// (the launcher checks).
#include "common.cuh"

#define GEMV_RW 2
#define GEMV_U 4

template <int NT>
__device__ __forceinline__ void gemv_rows(const __nv_bfloat16* w, const float* x, float* y,
                                          int n, int o, int k, int t0) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int row0 = (blockIdx.x * 8 + warp) * GEMV_RW;
  if (row0 >= o) return;
  const int ng = min(NT, n - t0);
  const int nv = k >> 3;
  const uint4* wr[GEMV_RW];
#pragma unroll
  for (int r = 0; r < GEMV_RW; ++r)
    wr[r] = reinterpret_cast<const uint4*>(w + (size_t)min(row0 + r, o - 1) * k);
  float acc[GEMV_RW][NT];
#pragma unroll
  for (int r = 0; r < GEMV_RW; ++r)
#pragma unroll
    for (int g = 0; g < NT; ++g) acc[r][g] = 0.0f;
  for (int c0 = lane; c0 < nv; c0 += 32 * GEMV_U) {
    uint4 v[GEMV_RW][GEMV_U];
#pragma unroll
    for (int u = 0; u < GEMV_U; ++u)
#pragma unroll
      for (int r = 0; r < GEMV_RW; ++r)
        if (c0 + 32 * u < nv) v[r][u] = __ldg(wr[r] + c0 + 32 * u);
#pragma unroll
    for (int u = 0; u < GEMV_U; ++u) {
      const int c = c0 + 32 * u;
      if (c >= nv) break;
#pragma unroll
      for (int g = 0; g < NT; ++g) {
        if (g < ng) {
          const float4* x4 = reinterpret_cast<const float4*>(x + (size_t)(t0 + g) * k + 8 * c);
          const float4 a = x4[0], b = x4[1];
#pragma unroll
          for (int r = 0; r < GEMV_RW; ++r) {
            const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&v[r][u]);
            const float2 f0 = __bfloat1622float2(h[0]), f1 = __bfloat1622float2(h[1]);
            const float2 f2 = __bfloat1622float2(h[2]), f3 = __bfloat1622float2(h[3]);
            float s = acc[r][g];
            s = fmaf(f0.x, a.x, s);
            s = fmaf(f0.y, a.y, s);
            s = fmaf(f1.x, a.z, s);
            s = fmaf(f1.y, a.w, s);
            s = fmaf(f2.x, b.x, s);
            s = fmaf(f2.y, b.y, s);
            s = fmaf(f3.x, b.z, s);
            s = fmaf(f3.y, b.w, s);
            acc[r][g] = s;
          }
        }
      }
    }
  }
#pragma unroll
  for (int r = 0; r < GEMV_RW; ++r) {
#pragma unroll
    for (int g = 0; g < NT; ++g) {
      float s = acc[r][g];
      for (int off = 16; off > 0; off >>= 1) s += __shfl_xor_sync(0xffffffffu, s, off);
      if (lane == 0 && g < ng && row0 + r < o) y[(size_t)(t0 + g) * o + row0 + r] = s;
    }
  }
}

// Up to four tokens (one is decode at batch 1): few accumulators keep it inside the
// 64-register bound.
extern "C" __global__ void __launch_bounds__(256, 4)
    gemv_bf16(const __nv_bfloat16* w, const float* x, float* y, int n, int o, int k) {
  if (n == 1)
    gemv_rows<1>(w, x, y, n, o, k, 0);
  else
    gemv_rows<4>(w, x, y, n, o, k, 0);
}

// Five to eight tokens in one pass over the weights, at half the occupancy.
extern "C" __global__ void __launch_bounds__(256, 2)
    gemv_bf16_8(const __nv_bfloat16* w, const float* x, float* y, int n, int o, int k) {
  gemv_rows<8>(w, x, y, n, o, k, 0);
}
