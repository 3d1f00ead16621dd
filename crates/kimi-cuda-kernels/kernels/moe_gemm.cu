// Grouped expert GEMM on the tensor cores for many-token MoE layers (prefill): every routed
// (token, expert) pair of a layer in one launch per projection, no host round trip.
//
// The pairs come grouped by expert from `moe_lists` (`offsets[E+1]`, `slots[P]`). Each CTA
// computes a 64 (pairs of one expert) x 64 (output features) tile; `blockIdx.y` numbers the
// tiles of all experts in order (expert e owns ceil(count_e / 64) of them) and CTAs past the
// last tile exit, so the host launches an upper bound without reading the counts back.
//
// Precision: weights are bf16; each f32 activation enters as two bf16 terms hi + lo
// (`split` = 1, two MMAs per step, close to f32 products) or as hi alone (`split` = 0, the
// bf16-rounded GemmPrecision::Half). Accumulation is f32.
//
// glu = 1: out[p, j] = silu(x_t · gate_e[j]) * (x_t · up_e[j]) with x_t = in[p / top_k]
//          (hidden rows, K = hidden size, N = intermediate size);
// glu = 0: out[p, j] = in[p] · down_e[j] (intermediate rows, K = intermediate, N = hidden).
// Needs K % 32 == 0, N % 64 == 0 and 16-byte aligned weights (the launcher checks).
#include <mma.h>

#include "common.cuh"

using namespace nvcuda;

#define GM 64    // pairs per tile
#define GN 64    // output features per tile
#define GK 32    // k per stage
#define GPAD 8   // bf16 padding per smem row (keeps wmma pointers 32-byte aligned)
#define CPAD 4   // f32 padding of the epilogue tile

struct Stage {
  __nv_bfloat16 a_hi[GM][GK + GPAD];
  __nv_bfloat16 a_lo[GM][GK + GPAD];
  __nv_bfloat16 b0[GN][GK + GPAD];  // gate (glu) or down rows
  __nv_bfloat16 b1[GN][GK + GPAD];  // up rows (glu only)
};
struct Epilogue {
  float c0[GM][GN + CPAD];
  float c1[GM][GN + CPAD];
};
union GemmSmem {
  Stage s;
  Epilogue e;
};

extern "C" __global__ void __launch_bounds__(128)
    moe_grouped_mma(const uint64_t* wtab, int glu, int split, const float* in, int top_k,
                    const uint32_t* offsets, const uint32_t* slots, int E, float* out, int N,
                    int K) {
  pdl_enter();
  __shared__ __align__(128) GemmSmem sm;
  __shared__ int tile_expert, tile_row0;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;

  // Which expert and which of its rows this tile covers: warp 0 scans the per-expert tile
  // counts 32 experts at a time.
  if (warp == 0) {
    const int t = blockIdx.y;
    int base = 0;  // tiles of experts before the current group of 32
    int found = -1, row0 = 0;
    for (int e0 = 0; e0 < E && found < 0; e0 += 32) {
      const int e = e0 + lane;
      int tiles = 0;
      if (e < E) tiles = (int)((offsets[e + 1] - offsets[e] + GM - 1) / GM);
      int incl = tiles;
      for (int o = 1; o < 32; o <<= 1) {
        int v = __shfl_up_sync(0xffffffffu, incl, o);
        if (lane >= o) incl += v;
      }
      const int excl = base + incl - tiles;
      const bool mine = tiles > 0 && t >= excl && t < excl + tiles;
      const unsigned ball = __ballot_sync(0xffffffffu, mine);
      if (ball) {
        const int src = __ffs(ball) - 1;
        found = __shfl_sync(0xffffffffu, e, src);
        row0 = __shfl_sync(0xffffffffu, (t - excl) * GM, src);
      }
      base += __shfl_sync(0xffffffffu, incl, 31);
    }
    if (lane == 0) {
      tile_expert = found;
      tile_row0 = row0;
    }
  }
  __syncthreads();
  const int e = tile_expert;
  if (e < 0) return;
  const uint32_t beg = offsets[e] + tile_row0;
  const int rows = min(GM, (int)(offsets[e + 1] - beg));
  const int n0 = blockIdx.x * GN;
  const __nv_bfloat16* w0 =
      reinterpret_cast<const __nv_bfloat16*>(wtab[3 * e + (glu ? 0 : 2)]) + (size_t)n0 * K;
  const __nv_bfloat16* w1 = glu ? reinterpret_cast<const __nv_bfloat16*>(wtab[3 * e + 1]) +
                                      (size_t)n0 * K
                                : nullptr;

  // Per thread: A rows (r, r+32) x 8 columns; B rows (r, r+32) x 8 columns.
  const int lr = threadIdx.x >> 2;       // 0..31
  const int lc = (threadIdx.x & 3) * 8;  // 0, 8, 16, 24
  const float* arow[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int r = lr + 32 * i;
    if (r < rows) {
      const uint32_t p = slots[beg + r];
      arow[i] = in + (size_t)(glu ? p / top_k : p) * K;
    } else {
      arow[i] = nullptr;
    }
  }

  const int wm = (warp >> 1) * 32, wn = (warp & 1) * 32;
  wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc0[2][2], acc1[2][2];
#pragma unroll
  for (int i = 0; i < 2; ++i)
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      wmma::fill_fragment(acc0[i][j], 0.0f);
      wmma::fill_fragment(acc1[i][j], 0.0f);
    }

  for (int k0 = 0; k0 < K; k0 += GK) {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int r = lr + 32 * i;
      float v[8];
      if (arow[i]) {
        const float4* src = reinterpret_cast<const float4*>(arow[i] + k0 + lc);
        float4 a = src[0], b = src[1];
        v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w;
        v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
      } else {
#pragma unroll
        for (int u = 0; u < 8; ++u) v[u] = 0.0f;
      }
#pragma unroll
      for (int u = 0; u < 8; ++u) {
        const __nv_bfloat16 hi = __float2bfloat16(v[u]);
        sm.s.a_hi[r][lc + u] = hi;
        sm.s.a_lo[r][lc + u] = __float2bfloat16(v[u] - __bfloat162float(hi));
      }
      *reinterpret_cast<uint4*>(&sm.s.b0[r][lc]) =
          __ldg(reinterpret_cast<const uint4*>(w0 + (size_t)r * K + k0 + lc));
      if (glu)
        *reinterpret_cast<uint4*>(&sm.s.b1[r][lc]) =
            __ldg(reinterpret_cast<const uint4*>(w1 + (size_t)r * K + k0 + lc));
    }
    __syncthreads();
#pragma unroll
    for (int kk = 0; kk < GK; kk += 16) {
      wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, wmma::row_major> ah[2], al[2];
      wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, wmma::col_major> b0f[2], b1f[2];
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        wmma::load_matrix_sync(ah[i], &sm.s.a_hi[wm + 16 * i][kk], GK + GPAD);
        if (split) wmma::load_matrix_sync(al[i], &sm.s.a_lo[wm + 16 * i][kk], GK + GPAD);
      }
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        // W rows are output features: as a K x N matrix that is column-major.
        wmma::load_matrix_sync(b0f[j], &sm.s.b0[wn + 16 * j][kk], GK + GPAD);
        if (glu) wmma::load_matrix_sync(b1f[j], &sm.s.b1[wn + 16 * j][kk], GK + GPAD);
      }
#pragma unroll
      for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          wmma::mma_sync(acc0[i][j], ah[i], b0f[j], acc0[i][j]);
          if (split) wmma::mma_sync(acc0[i][j], al[i], b0f[j], acc0[i][j]);
          if (glu) {
            wmma::mma_sync(acc1[i][j], ah[i], b1f[j], acc1[i][j]);
            if (split) wmma::mma_sync(acc1[i][j], al[i], b1f[j], acc1[i][j]);
          }
        }
    }
    __syncthreads();
  }

  // Epilogue through shared memory (the stage buffers are dead now).
#pragma unroll
  for (int i = 0; i < 2; ++i)
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      wmma::store_matrix_sync(&sm.e.c0[wm + 16 * i][wn + 16 * j], acc0[i][j], GN + CPAD,
                              wmma::mem_row_major);
      if (glu)
        wmma::store_matrix_sync(&sm.e.c1[wm + 16 * i][wn + 16 * j], acc1[i][j], GN + CPAD,
                                wmma::mem_row_major);
    }
  __syncthreads();
  for (int idx = threadIdx.x; idx < rows * GN; idx += blockDim.x) {
    const int r = idx / GN, c = idx % GN;
    const uint32_t p = slots[beg + r];
    float v = sm.e.c0[r][c];
    if (glu) v = (v / (1.0f + expf(-v))) * sm.e.c1[r][c];
    out[(size_t)p * N + n0 + c] = v;
  }
}
