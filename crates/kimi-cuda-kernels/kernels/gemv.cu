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
                                          int n, int o, int k, int t0, int blk) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int row0 = (blk * 8 + warp) * GEMV_RW;
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
  pdl_enter();
  if (n == 1)
    gemv_rows<1>(w, x, y, n, o, k, 0, blockIdx.x);
  else
    gemv_rows<4>(w, x, y, n, o, k, 0, blockIdx.x);
}

// Two independent one-token products in one launch (KDA's f_b and g_b, 128 columns each):
// blocks below ceil(o0 / 16) take y0 = x0 · w0ᵀ, the rest y1 = x1 · w1ᵀ.
extern "C" __global__ void __launch_bounds__(256, 4)
    gemv_bf16_pair(const __nv_bfloat16* w0, const float* x0, float* y0, int o0,
                   const __nv_bfloat16* w1, const float* x1, float* y1, int o1, int k) {
  pdl_enter();
  const int nb0 = (o0 + 15) / 16;
  if ((int)blockIdx.x < nb0)
    gemv_rows<1>(w0, x0, y0, 1, o0, k, 0, blockIdx.x);
  else
    gemv_rows<1>(w1, x1, y1, 1, o1, k, 0, blockIdx.x - nb0);
}

// Five to eight tokens in one pass over the weights, at half the occupancy.
extern "C" __global__ void __launch_bounds__(256, 2)
    gemv_bf16_8(const __nv_bfloat16* w, const float* x, float* y, int n, int o, int k) {
  pdl_enter();
  gemv_rows<8>(w, x, y, n, o, k, 0, blockIdx.x);
}

// ---------------------------------------------------------------------------------------
// The same product with the weight tile fetched by the TMA engine (`cp.async.bulk`): one
// thread queues a bulk copy per weight row into shared memory, so a CTA has its whole tile
// (`rows` x k bf16, at most 48 KiB) in flight at once at no register cost, and several CTAs
// per SM keep ~150 KiB in flight: one DRAM round trip per tile instead of one per 1024
// columns. The copies are queued before `pdl_wait`, since weights never depend on the
// previous kernel: the fetch overlaps the previous kernel's tail.
//
// grid ceil(o / rows), block 256 = 8 warps, dynamic smem rows * k * 2 bytes, rows <= 8.
// Needs k % 8 == 0 and 16-byte aligned `w` and `x`.

template <int NT>
__device__ __forceinline__ void gemv_bulk(const __nv_bfloat16* w, const float* x, float* y,
                                          int n, int o, int k, int rows) {
  extern __shared__ __align__(128) uint8_t tile[];
  __shared__ __align__(8) uint64_t bar;
  __shared__ float part[8][8 * NT];
  const int row0 = blockIdx.x * rows;
  const int nrows = min(rows, o - row0);
  const uint32_t row_bytes = (uint32_t)k * 2u;
  const uint32_t bar_a = smem_addr(&bar);
  if (threadIdx.x == 0) bar_init(bar_a);
  __syncthreads();
  if (threadIdx.x == 0) {
    bar_expect(bar_a, row_bytes * (uint32_t)nrows);
    for (int r = 0; r < nrows; ++r)
      bulk_copy(smem_addr(tile + (size_t)r * row_bytes), w + (size_t)(row0 + r) * k, row_bytes,
                bar_a);
  }
  pdl_enter();
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int ng = min(NT, n);
  float acc[8][NT];
#pragma unroll
  for (int r = 0; r < 8; ++r)
#pragma unroll
    for (int g = 0; g < NT; ++g) acc[r][g] = 0.0f;
  // Warp w takes every 8th 16-byte column group of all the tile's rows, so each activation
  // value is read once per CTA (not once per row). The first group's activations are loaded
  // while the tile is in flight, and (one token) the next group's before the current one's
  // products, so no L2 round trip waits behind the tile.
  const int nv = k >> 3;
  auto load_x = [&](float (&xv)[NT][8], int c) {
#pragma unroll
    for (int g = 0; g < NT; ++g) {
      if (g < ng && c < nv) {
        const float4* x4 = reinterpret_cast<const float4*>(x + (size_t)g * k + 8 * c);
        const float4 a = x4[0], b = x4[1];
        xv[g][0] = a.x, xv[g][1] = a.y, xv[g][2] = a.z, xv[g][3] = a.w;
        xv[g][4] = b.x, xv[g][5] = b.y, xv[g][6] = b.z, xv[g][7] = b.w;
      }
    }
  };
  float xv[NT][8];
  int c = warp * 32 + lane;
  load_x(xv, c);
  bar_wait(bar_a, 0);
  for (; c < nv; c += 256) {
    float xn[NT][8];
    if (NT == 1) load_x(xn, c + 256);
#pragma unroll
    for (int r = 0; r < 8; ++r) {
      if (r < nrows) {
        const uint4 v = reinterpret_cast<const uint4*>(tile + (size_t)r * row_bytes)[c];
        const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&v);
        float f[8];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const float2 t = __bfloat1622float2(h[i]);
          f[2 * i] = t.x, f[2 * i + 1] = t.y;
        }
#pragma unroll
        for (int g = 0; g < NT; ++g) {
          if (g < ng) {
            float s = acc[r][g];
#pragma unroll
            for (int i = 0; i < 8; ++i) s = fmaf(f[i], xv[g][i], s);
            acc[r][g] = s;
          }
        }
      }
    }
    if (NT == 1) {
#pragma unroll
      for (int i = 0; i < 8; ++i) xv[0][i] = xn[0][i];
    } else {
      load_x(xv, c + 256);
    }
  }
  // Warp sums, then the 8 warps' partials through shared memory.
#pragma unroll
  for (int r = 0; r < 8; ++r)
#pragma unroll
    for (int g = 0; g < NT; ++g) {
      float s = acc[r][g];
      for (int off = 16; off > 0; off >>= 1) s += __shfl_xor_sync(0xffffffffu, s, off);
      if (lane == 0) part[warp][r * NT + g] = s;
    }
  __syncthreads();
  for (int i = threadIdx.x; i < nrows * NT; i += blockDim.x) {
    const int r = i / NT, g = i % NT;
    if (g < ng) {
      float s = 0.0f;
#pragma unroll
      for (int w8 = 0; w8 < 8; ++w8) s += part[w8][i];
      y[(size_t)g * o + row0 + r] = s;
    }
  }
}

extern "C" __global__ void __launch_bounds__(256)
    gemv_bulk_1(const __nv_bfloat16* w, const float* x, float* y, int n, int o, int k, int rows) {
  gemv_bulk<1>(w, x, y, n, o, k, rows);
}

extern "C" __global__ void __launch_bounds__(256)
    gemv_bulk_4(const __nv_bfloat16* w, const float* x, float* y, int n, int o, int k, int rows) {
  gemv_bulk<4>(w, x, y, n, o, k, rows);
}

extern "C" __global__ void __launch_bounds__(256)
    gemv_bulk_8(const __nv_bfloat16* w, const float* x, float* y, int n, int o, int k, int rows) {
  gemv_bulk<8>(w, x, y, n, o, k, rows);
}

// ---------------------------------------------------------------------------------------
// The same product for one token with persistent CTAs streaming tiles of `rows` weight rows
// through `stages` shared-memory stages (see stream.cuh). The producer queues the first
// `stages` tiles before `pdl_wait`: weights never depend on the previous kernel.
//
// grid <= ceil(o / rows) (one CTA per SM), block STREAM_THREADS, dynamic smem
// stages * rows * k * 2 + k * 4 bytes; rows <= STREAM_MAX_ROWS, stages <=
// STREAM_MAX_STAGES. Needs k % (256 * slices) == 0 (stream_cover), 16-byte aligned w, x.
#include "stream.cuh"

extern "C" __global__ void __launch_bounds__(STREAM_THREADS, 1)
    gemv_stream_1(const __nv_bfloat16* w, const float* x, float* y, int o, int k, int rows,
                  int stages) {
  extern __shared__ __align__(128) uint8_t stream_buf[];
  __shared__ StreamSmem s;
  const uint32_t row_bytes = (uint32_t)k * 2u, tile_bytes = row_bytes * (uint32_t)rows;
  const int tiles = (o + rows - 1) / rows;
  const int nv = k >> 3;
  float* xs = reinterpret_cast<float*>(stream_buf + (size_t)stages * tile_bytes);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const bool producer = warp == STREAM_CONSUMERS;
  stream_init(s, stages);
  auto fetch = [&](int t, int stage) {
    stream_fetch(s, stream_buf + (size_t)stage * tile_bytes, stage, w + (size_t)t * rows * k,
                 row_bytes * min(rows, o - t * rows), nullptr, 0);
  };
  if (producer && lane == 0)
    for (int i = 0; i < stages && blockIdx.x + i * gridDim.x < tiles; ++i)
      fetch(blockIdx.x + i * gridDim.x, i);
  pdl_enter();
  stream_stage_x(xs, x, k);
  if (producer) {
    for (int i = 0;; ++i) {
      const int t = blockIdx.x + i * gridDim.x;
      if (t >= tiles) break;
      const int stage = i % stages;
      bar_wait(smem_addr(&s.empty[stage]), (i / stages) & 1);
      const int nr = min(rows, o - t * rows);
      const int slices = stream_cover(rows, 0).slices;
      if (lane < nr) y[(size_t)t * rows + lane] = stream_row_sum(s, stage, lane, slices);
      __syncwarp();
      if (lane == 0 && t + stages * (int)gridDim.x < tiles) fetch(t + stages * gridDim.x, stage);
    }
    return;
  }
  const StreamCover cov = stream_cover(rows, warp);
  for (int i = 0;; ++i) {
    const int t = blockIdx.x + i * gridDim.x;
    if (t >= tiles) break;
    const int stage = i % stages;
    const int nr = min(rows, o - t * rows);
    bar_wait(smem_addr(&s.full[stage]), (i / stages) & 1);
    const uint8_t* tile = stream_buf + (size_t)stage * tile_bytes;
    for (int r = cov.first; r < nr; r += cov.step)
      stream_row_dot(s, stage, tile, r, nv, cov.slice, cov.slices, xs);
    __syncwarp();
    if (lane == 0) stream_bar_arrive(smem_addr(&s.empty[stage]));
  }
}
