// Small-batch `y [n, o] = x [n, k] · wᵀ` for bf16 weights `w [o, k]` and f32 activations:
// f32 products and accumulation (no rounding of the activations), each weight row read once
// per group of up to 8 tokens. Decode-sized batches only; cuBLAS takes the rest.
// Grid ceil(o / 8); block 256 = 8 warps, one output row per warp. Needs k % 8 == 0 and
// 16-byte aligned `w` and `x` (the launcher checks).
#include "common.cuh"

#define GEMV_TG 8

extern "C" __global__ void __launch_bounds__(256)
    gemv_bf16(const __nv_bfloat16* w, const float* x, float* y, int n, int o, int k) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int row = blockIdx.x * 8 + warp;
  if (row >= o) return;
  const uint4* wr = reinterpret_cast<const uint4*>(w + (size_t)row * k);
  const int nv = k >> 3;
  for (int t0 = 0; t0 < n; t0 += GEMV_TG) {
    const int ng = min(GEMV_TG, n - t0);
    float acc[GEMV_TG];
#pragma unroll
    for (int g = 0; g < GEMV_TG; ++g) acc[g] = 0.0f;
    // Four 16-byte weight loads in flight per lane before any arithmetic.
    for (int c0 = lane; c0 < nv; c0 += 32 * 4) {
      uint4 v[4];
#pragma unroll
      for (int u = 0; u < 4; ++u)
        if (c0 + 32 * u < nv) v[u] = __ldg(wr + c0 + 32 * u);
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        const int c = c0 + 32 * u;
        if (c >= nv) break;
        const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&v[u]);
        float f[8];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          float2 t = __bfloat1622float2(h[i]);
          f[2 * i] = t.x;
          f[2 * i + 1] = t.y;
        }
#pragma unroll
        for (int g = 0; g < GEMV_TG; ++g) {
          if (g < ng) {
            const float4* x4 =
                reinterpret_cast<const float4*>(x + (size_t)(t0 + g) * k + 8 * c);
            float4 a = x4[0], b = x4[1];
            float s = acc[g];
            s = fmaf(f[0], a.x, s);
            s = fmaf(f[1], a.y, s);
            s = fmaf(f[2], a.z, s);
            s = fmaf(f[3], a.w, s);
            s = fmaf(f[4], b.x, s);
            s = fmaf(f[5], b.y, s);
            s = fmaf(f[6], b.z, s);
            s = fmaf(f[7], b.w, s);
            acc[g] = s;
          }
        }
      }
    }
#pragma unroll
    for (int g = 0; g < GEMV_TG; ++g) {
      float s = acc[g];
      for (int off = 16; off > 0; off >>= 1) s += __shfl_xor_sync(0xffffffffu, s, off);
      if (lane == 0 && g < ng) y[(size_t)(t0 + g) * o + row] = s;
    }
  }
}
