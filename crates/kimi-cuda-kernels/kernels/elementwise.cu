// Row-wise and elementwise ops: embedding, RMSNorm (plain and gated), add, sigmoid,
// SwiGLU, column copies (split/concat), row gathers and the f32 -> bf16/f16 cast for GEMMs.
#include "common.cuh"

// out[t, :] = table[ids[t], :] as f32. grid (num_tokens), block 256.
extern "C" __global__ void embedding(const void* table, int dt, const uint32_t* ids,
                                     float* out, int d) {
  pdl_enter();
  size_t t = blockIdx.x;
  size_t row = ids[t];
  for (int j = threadIdx.x; j < d; j += blockDim.x) out[t * d + j] = ld(table, row * d + j, dt);
}

// out = x * rsqrt(mean(x^2) + eps) * w [* sigmoid(z)], rows of width d. grid (rows), block 256.
extern "C" __global__ void rms_norm(const float* x, const void* w, int wdt, const float* z,
                                    float* out, int d, float eps) {
  pdl_enter();
  __shared__ float red[32];
  size_t r = blockIdx.x;
  const float* xr = x + r * d;
  float ss = 0.0f;
  for (int j = threadIdx.x; j < d; j += blockDim.x) ss += xr[j] * xr[j];
  ss = block_sum(ss, red);
  float inv = 1.0f / sqrtf(ss / (float)d + eps);
  for (int j = threadIdx.x; j < d; j += blockDim.x) {
    float y = xr[j] * inv * ld(w, j, wdt);
    if (z) y *= sigmoidf_(z[r * d + j]);
    out[r * d + j] = y;
  }
}

// rms_norm (add = 0) and add_rms_norm (add = 1: x += y first, written back) for rows of
// d = 4 * blockDim.x * NORM_V floats at most, d % 4 == 0, 16-byte aligned rows: every thread
// loads its float4s of the row at once and keeps them in registers, so a row costs one
// memory round trip instead of one per loop step (a one-row decode norm of 2304 took
// ~10 us as a strided loop). The weights' raw bits load before `pdl_wait` (`norm_w_load`),
// not after the row's sum. One block per row; the two ops share the summation order, so
// add_rms_norm matches add_assign + rms_norm bit for bit.
#define NORM_V 2
__device__ __forceinline__ void norm_w_load(const void* w, int wdt, int d,
                                            uint32_t (&wr)[NORM_V][4]) {
  const int n4 = d >> 2;
#pragma unroll
  for (int i = 0; i < NORM_V; ++i) {
    const int c = threadIdx.x + i * blockDim.x;
#pragma unroll
    for (int u = 0; u < 4; ++u) wr[i][u] = c < n4 ? ld_raw(w, 4 * c + u, wdt) : 0u;
  }
}
__device__ __forceinline__ void norm_row_vec(float* x, const float* y,
                                             const uint32_t (&wr)[NORM_V][4], int wdt,
                                             float* out, int d, float eps, bool add) {
  __shared__ float red[32];
  const size_t r = blockIdx.x;
  float4* x4 = reinterpret_cast<float4*>(x + r * d);
  const float4* y4 = add ? reinterpret_cast<const float4*>(y + r * d) : nullptr;
  float4* o4 = reinterpret_cast<float4*>(out + r * d);
  const int n4 = d >> 2;
  float4 v[NORM_V], yv[NORM_V];
  // Every load before the first store (x and y may alias as far as the compiler knows).
#pragma unroll
  for (int i = 0; i < NORM_V; ++i) {
    const int c = threadIdx.x + i * blockDim.x;
    if (c < n4) {
      v[i] = x4[c];
      if (add) yv[i] = y4[c];
    }
  }
  float ss = 0.0f;
#pragma unroll
  for (int i = 0; i < NORM_V; ++i) {
    const int c = threadIdx.x + i * blockDim.x;
    if (c < n4) {
      if (add) {
        const float4 b = yv[i];
        v[i].x += b.x;
        v[i].y += b.y;
        v[i].z += b.z;
        v[i].w += b.w;
        x4[c] = v[i];
      }
      ss += v[i].x * v[i].x + v[i].y * v[i].y + v[i].z * v[i].z + v[i].w * v[i].w;
    }
  }
  ss = block_sum(ss, red);
  const float inv = 1.0f / sqrtf(ss / (float)d + eps);
#pragma unroll
  for (int i = 0; i < NORM_V; ++i) {
    const int c = threadIdx.x + i * blockDim.x;
    if (c < n4) {
      o4[c] = make_float4(
          v[i].x * inv * raw_val(wr[i][0], wdt), v[i].y * inv * raw_val(wr[i][1], wdt),
          v[i].z * inv * raw_val(wr[i][2], wdt), v[i].w * inv * raw_val(wr[i][3], wdt));
    }
  }
}
extern "C" __global__ void rms_norm_vec(const float* x, const void* w, int wdt, float* out, int d,
                                        float eps) {
  uint32_t wr[NORM_V][4];
  norm_w_load(w, wdt, d, wr);
  pdl_enter();
  norm_row_vec(const_cast<float*>(x), nullptr, wr, wdt, out, d, eps, false);
}
extern "C" __global__ void add_rms_norm_vec(float* x, const float* y, const void* w, int wdt,
                                            float* out, int d, float eps) {
  uint32_t wr[NORM_V][4];
  norm_w_load(w, wdt, d, wr);
  pdl_enter();
  norm_row_vec(x, y, wr, wdt, out, d, eps, true);
}

// rms_norm for short rows (d <= 1024, the gated per-head norm of KDA at d = 128): one warp
// per row, 8 rows per 256-thread block, so no thread idles and no block barrier is needed.
extern "C" __global__ void rms_norm_warp(const float* x, const void* w, int wdt, const float* z,
                                         float* out, int rows, int d, float eps) {
  pdl_enter();
  const int lane = threadIdx.x & 31;
  const int r = blockIdx.x * 8 + (threadIdx.x >> 5);
  if (r >= rows) return;
  const size_t base = (size_t)r * d;
  const float* xr = x + base;
  float ss = 0.0f;
  for (int j = lane; j < d; j += 32) ss += xr[j] * xr[j];
  for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
  const float inv = 1.0f / sqrtf(ss / (float)d + eps);
  for (int j = lane; j < d; j += 32) {
    float y = xr[j] * inv * ld(w, j, wdt);
    if (z) y *= sigmoidf_(z[base + j]);
    out[base + j] = y;
  }
}

// x += y, then out = rms_norm(x) * w: rms_norm's arithmetic in the same order (bit for bit
// add_assign followed by rms_norm), one launch instead of two. One block per row.
extern "C" __global__ void add_rms_norm(float* x, const float* y, const void* w, int wdt,
                                        float* out, int d, float eps) {
  pdl_enter();
  __shared__ float red[32];
  size_t r = blockIdx.x;
  float* xr = x + r * d;
  const float* yr = y + r * d;
  float ss = 0.0f;
  for (int j = threadIdx.x; j < d; j += blockDim.x) {
    const float v = xr[j] + yr[j];
    xr[j] = v;
    ss += v * v;
  }
  ss = block_sum(ss, red);
  float inv = 1.0f / sqrtf(ss / (float)d + eps);
  for (int j = threadIdx.x; j < d; j += blockDim.x) out[r * d + j] = xr[j] * inv * ld(w, j, wdt);
}

extern "C" __global__ void add_assign(float* x, const float* y, size_t n) {
  pdl_enter();
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x)
    x[i] += y[i];
}

extern "C" __global__ void sigmoid(const float* x, float* out, size_t n) {
  pdl_enter();
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x)
    out[i] = sigmoidf_(x[i]);
}

// gate = silu(gate) * up.
extern "C" __global__ void silu_mul(float* gate, const float* up, size_t n) {
  pdl_enter();
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x) {
    float g = gate[i];
    gate[i] = g * sigmoidf_(g) * up[i];
  }
}

// dst[r, dst_off + j] = src[r, src_off + j] for j < w. grid-stride over rows*w.
extern "C" __global__ void copy_cols(const float* src, int src_ld, int src_off, float* dst,
                                     int dst_ld, int dst_off, int rows, int w) {
  pdl_enter();
  size_t n = (size_t)rows * w;
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x) {
    size_t r = i / w, j = i % w;
    dst[r * dst_ld + dst_off + j] = src[r * src_ld + src_off + j];
  }
}

// out[r, :] = [a[r, :wa] | b[r, :wb]] (f32): concat_cols of two parts in one launch (the
// MLA latent row, [normed latent | rope key], took two copy_cols launches per layer).
extern "C" __global__ void concat_cols2(const float* a, int wa, const float* b, int wb,
                                        float* out, int rows) {
  pdl_enter();
  const int w = wa + wb;
  const size_t n = (size_t)rows * w;
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x) {
    const size_t r = i / w;
    const int j = (int)(i - r * w);
    out[i] = j < wa ? a[r * wa + j] : b[r * wb + (j - wa)];
  }
}

// out[i, :] = x[rows[i], :]. grid (num_rows), block 256.
extern "C" __global__ void gather_rows(const float* x, const uint32_t* rows, float* out, int d) {
  pdl_enter();
  size_t i = blockIdx.x;
  size_t r = rows[i];
  for (int j = threadIdx.x; j < d; j += blockDim.x) out[i * d + j] = x[r * d + j];
}

// out[rows[i], :] += weights[i] * y[i, :], one launch per expert.
extern "C" __global__ void scatter_add_rows(const float* y, const uint32_t* rows,
                                            const float* weights, float* out, int d) {
  pdl_enter();
  size_t i = blockIdx.x;
  size_t r = rows[i];
  float wt = weights[i];
  // Atomic: under expert parallelism the pairs of absent experts share a stand-in expert, so
  // one launch may hold a row twice (at weight 0); for distinct rows the bits are the same.
  for (int j = threadIdx.x; j < d; j += blockDim.x) atomicAdd(&out[r * d + j], wt * y[i * d + j]);
}

extern "C" __global__ void cast_f32_bf16(const float* x, __nv_bfloat16* out, size_t n) {
  pdl_enter();
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x)
    out[i] = __float2bfloat16(x[i]);
}

extern "C" __global__ void cast_f32_f16(const float* x, __half* out, size_t n) {
  pdl_enter();
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x)
    out[i] = __float2half(x[i]);
}

extern "C" __global__ void cast_to_f32(const void* x, int dt, float* out, size_t n) {
  pdl_enter();
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x)
    out[i] = ld(x, i, dt);
}

// Two-term split of f32 activations for GEMMs against 16-bit weights: rows [0, n) get
// hi = round(x), rows [n, 2n) get lo = round(x - hi), so W·hi + W·lo carries ~16 mantissa
// bits of x instead of 8. `n_elems` = rows * cols of x.
extern "C" __global__ void split_f32_bf16(const float* x, __nv_bfloat16* out, size_t n_elems) {
  pdl_enter();
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n_elems;
       i += (size_t)gridDim.x * blockDim.x) {
    __nv_bfloat16 hi = __float2bfloat16(x[i]);
    out[i] = hi;
    out[n_elems + i] = __float2bfloat16(x[i] - __bfloat162float(hi));
  }
}

extern "C" __global__ void split_f32_f16(const float* x, __half* out, size_t n_elems) {
  pdl_enter();
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n_elems;
       i += (size_t)gridDim.x * blockDim.x) {
    __half hi = __float2half(x[i]);
    out[i] = hi;
    out[n_elems + i] = __float2half(x[i] - __half2float(hi));
  }
}

// y[i] = y2[i] + y2[m + i]: sums the hi and lo halves of a split GEMM's output.
extern "C" __global__ void sum_halves(const float* y2, float* y, size_t m) {
  pdl_enter();
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < m;
       i += (size_t)gridDim.x * blockDim.x)
    y[i] = y2[i] + y2[m + i];
}

// out[r] = the index of the largest value of row r of x [rows, d]: NaN never wins, +inf
// counts as FLT_MAX, ties go to the lowest index, a row of -inf/NaN gives 0 (the rule of
// `kimi_ops::argmax_row`). grid (rows), block 256.
extern "C" __global__ void argmax_rows(const float* x, uint32_t* out, int d) {
  pdl_enter();
  __shared__ float sv[32];
  __shared__ uint32_t si[32];
  const float* xr = x + (size_t)blockIdx.x * d;
  float bv = -INFINITY;
  uint32_t bi = 0;
  for (int j = threadIdx.x; j < d; j += blockDim.x) {
    const float v = fminf(xr[j], 3.402823466e38f);  // fminf(NaN, m) = m: filter NaN first
    if (xr[j] == xr[j] && v > bv) bv = v, bi = (uint32_t)j;
  }
  // (value, index) pairs: larger value wins, then lower index; an empty lane has -inf at 0.
  for (int o = 16; o > 0; o >>= 1) {
    const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
    const uint32_t oi = __shfl_xor_sync(0xffffffffu, bi, o);
    if (ov > bv || (ov == bv && oi < bi)) bv = ov, bi = oi;
  }
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) sv[warp] = bv, si[warp] = bi;
  __syncthreads();
  if (warp == 0) {
    const int nw = (blockDim.x + 31) >> 5;
    bv = lane < nw ? sv[lane] : -INFINITY;
    bi = lane < nw ? si[lane] : 0u;
    for (int o = 16; o > 0; o >>= 1) {
      const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
      const uint32_t oi = __shfl_xor_sync(0xffffffffu, bi, o);
      if (ov > bv || (ov == bv && oi < bi)) bv = ov, bi = oi;
    }
    if (lane == 0) out[blockIdx.x] = bi;
  }
}

// out = x * sigmoid(gate) (Kimi K3's MLA output gate). grid-stride over n.
extern "C" __global__ void sigmoid_gate(const float* x, const float* gate, float* out, size_t n) {
  pdl_enter();
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x) {
    out[i] = x[i] * sigmoidf_(gate[i]);
  }
}

// gate = SiTU-GLU(gate, up) (Kimi K3): beta·tanh(g/beta)·sigmoid(g) · lbeta·tanh(u/lbeta),
// the up half unchanged when lbeta <= 0. grid-stride over n.
extern "C" __global__ void situ_mul(float* gate, const float* up, size_t n, float beta,
                                    float lbeta) {
  pdl_enter();
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x) {
    const float g = gate[i], u = up[i];
    const float a = beta * tanhf(g / beta) * sigmoidf_(g);
    gate[i] = a * (lbeta > 0.0f ? lbeta * tanhf(u / lbeta) : u);
  }
}
