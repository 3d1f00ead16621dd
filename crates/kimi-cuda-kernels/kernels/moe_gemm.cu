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

// Which expert and which of its rows tile `t` covers (tiles of BM rows, experts in order);
// expert -1 past the last tile. Warp 0 scans the per-expert tile counts 32 experts at a time.
template <int BM>
__device__ __forceinline__ void find_tile(const uint32_t* offsets, int E, int t, int lane,
                                          int& expert, int& row0) {
  int base = 0, found = -1, r0 = 0;
  for (int e0 = 0; e0 < E && found < 0; e0 += 32) {
    const int e = e0 + lane;
    int tiles = 0;
    if (e < E) tiles = (int)((offsets[e + 1] - offsets[e] + BM - 1) / BM);
    int incl = tiles;
    for (int o = 1; o < 32; o <<= 1) {
      int v = __shfl_up_sync(0xffffffffu, incl, o);
      if (lane >= o) incl += v;
    }
    const int excl = base + incl - tiles;
    const unsigned ball = __ballot_sync(0xffffffffu, tiles > 0 && t >= excl && t < excl + tiles);
    if (ball) {
      const int src = __ffs(ball) - 1;
      found = __shfl_sync(0xffffffffu, e, src);
      r0 = __shfl_sync(0xffffffffu, (t - excl) * BM, src);
    }
    base += __shfl_sync(0xffffffffu, incl, 31);
  }
  expert = found;
  row0 = r0;
}

// Eight bf16 weights of row `r` of a tile, columns k0 + lc .. + 7, into `dst` (one 16-byte
// load).
__device__ __forceinline__ void load_b8(const void* w, int K, int r, int k0, int lc,
                                        __nv_bfloat16* dst) {
  *reinterpret_cast<uint4*>(dst) = __ldg(reinterpret_cast<const uint4*>(
      reinterpret_cast<const __nv_bfloat16*>(w) + (size_t)r * K + k0 + lc));
}

__device__ __forceinline__ void grouped_mma_body(const uint64_t* wtab, int glu, int split,
                                                 const float* in, int top_k,
                                                 const uint32_t* offsets,
                                                 const uint32_t* slots, int E, float* out,
                                                 int N, int K) {
  pdl_enter();
  __shared__ __align__(128) GemmSmem sm;
  __shared__ int tile_expert, tile_row0;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;

  if (warp == 0) {
    int e, r0;
    find_tile<GM>(offsets, E, blockIdx.y, lane, e, r0);
    if (lane == 0) {
      tile_expert = e;
      tile_row0 = r0;
    }
  }
  __syncthreads();
  const int e = tile_expert;
  if (e < 0) return;
  const uint32_t beg = offsets[e] + tile_row0;
  const int rows = min(GM, (int)(offsets[e + 1] - beg));
  const int n0 = blockIdx.x * GN;
  const void* w0 = reinterpret_cast<const void*>(wtab[3 * e + (glu ? 0 : 2)]);
  const void* w1 = glu ? reinterpret_cast<const void*>(wtab[3 * e + 1]) : nullptr;

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
      load_b8(w0, K, n0 + r, k0, lc, &sm.s.b0[r][lc]);
      if (glu) load_b8(w1, K, n0 + r, k0, lc, &sm.s.b1[r][lc]);
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
    if (glu) {
      const float gv = v;
      v = gv / (1.0f + expf(-gv)) * sm.e.c1[r][c];
    }
    out[(size_t)p * N + n0 + c] = v;
  }
}

extern "C" __global__ void __launch_bounds__(128)
    moe_grouped_mma(const uint64_t* wtab, int glu, int split, const float* in, int top_k,
                    const uint32_t* offsets, const uint32_t* slots, int E, float* out, int N,
                    int K) {
  grouped_mma_body(wtab, glu, split, in, top_k, offsets, slots, E, out, N, K);
}

// ---------------------------------------------------------------- pipelined mma.sync version
//
// The same grouped product with bf16 operands prepared beforehand, so tiles move as 16-byte
// cp.async copies through a STAGES-deep pipeline and feed `mma.sync.m16n8k16` via ldmatrix.
//
// A operand (activations) as bf16 rows: hi at a + row*K, lo (split only) at a + a_lo + row*K.
//   glu = 1: row = slots[q] / top_k (the token; a = the split/cast hidden states)
//   glu = 0: row = q (the pair's sorted position; a = this kernel's own glu output)
// B operand: 128 weight rows per CTA. glu: 64 gate rows then the same 64 up rows (64 output
// features per CTA); down: 128 down rows (128 output features).
// Outputs: glu writes h = silu(gate) * up as bf16 hi (and lo) at sorted position q, ready to
// be the down projection's A; down writes f32 out[slots[q] * N + col] (pair order).
// Needs K % 32 == 0, N % 64 == 0 (glu) / N % 4 == 0 (down), 16-byte aligned rows.

namespace mg {
constexpr int BN = 128;      // weight rows per CTA
constexpr int BK = 32;       // k per stage
constexpr int LDS = BK + 8;  // bf16 row stride in smem: 80 bytes, ldmatrix conflict-free
constexpr int THREADS = 256;  // 8 warps: 2 (rows) x 4 (weight-row slices of 32)
}  // namespace mg

// Pipeline depth: 3 stages of 128-row tiles keep two CTAs per SM; 64-row tiles (small
// groups, where streaming the weights is the bound) afford 4 with two CTAs per SM.
__host__ __device__ constexpr int moe_mma_stages(int bm) { return bm == 128 ? 3 : 4; }

__host__ __device__ constexpr size_t moe_mma_smem_bytes(int bm) {
  // Pipeline stages, or the f32 epilogue tile, whichever is larger.
  return (size_t)moe_mma_stages(bm) * (2 * bm + mg::BN) * mg::LDS * 2 >
                 (size_t)bm * (mg::BN + 4) * 4
             ? (size_t)moe_mma_stages(bm) * (2 * bm + mg::BN) * mg::LDS * 2
             : (size_t)bm * (mg::BN + 4) * 4;
}

__device__ __forceinline__ void cp_async16_zfill(uint32_t dst, const void* src, bool valid) {
  const int n = valid ? 16 : 0;  // 0 bytes read: the 16 destination bytes become zeros
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(n));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}
__device__ __forceinline__ void ldsm_x4(uint32_t addr, uint32_t& r0, uint32_t& r1, uint32_t& r2,
                                        uint32_t& r3) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(addr));
}
__device__ __forceinline__ void mma_bf16(float* c, const uint32_t* a, uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

template <int BM, bool SPLIT>
__device__ __forceinline__ void moe_mma_tile(const uint64_t* wtab, int glu,
                                             const __nv_bfloat16* a, size_t a_lo, int top_k,
                                             const uint32_t* offsets, const uint32_t* slots,
                                             int E, void* out, size_t out_lo, int N, int K) {
  using namespace mg;
  constexpr int MT = BM / 32;  // m16 tiles per warp (each warp: BM/2 rows x 32 weight rows)
  constexpr int STAGES = moe_mma_stages(BM);
  extern __shared__ __align__(128) uint8_t smem_raw[];
  __nv_bfloat16* sm = reinterpret_cast<__nv_bfloat16*>(smem_raw);
  __shared__ int tile_expert, tile_row0;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  if (warp == 0) {
    int e, r0;
    find_tile<BM>(offsets, E, blockIdx.y, lane, e, r0);
    if (lane == 0) {
      tile_expert = e;
      tile_row0 = r0;
    }
  }
  __syncthreads();
  const int e = tile_expert;
  if (e < 0) return;
  const uint32_t beg = offsets[e] + tile_row0;
  const int rows = min(BM, (int)(offsets[e + 1] - beg));
  // glu: output features f0..f0+63; down: n0..n0+127.
  const int n0 = blockIdx.x * (glu ? BN / 2 : BN);

  // Stage layout: A hi [BM][LDS], A lo [BM][LDS], B [BN][LDS].
  constexpr int A_ELEMS = BM * LDS, STAGE_ELEMS = 2 * A_ELEMS + BN * LDS;
  const uint32_t sbase = smem_addr(sm);

  // Each thread copies A chunks (row, 8 columns): BM*4 chunks over 256 threads.
  constexpr int A_PER = BM * 4 / THREADS;  // 1 or 2
  const __nv_bfloat16* arow[A_PER];
  bool avalid[A_PER];
  int a_soff[A_PER];
#pragma unroll
  for (int i = 0; i < A_PER; ++i) {
    const int c = tid + i * THREADS, r = c >> 2, col = (c & 3) * 8;
    avalid[i] = r < rows;
    const uint32_t row = avalid[i] ? (glu ? slots[beg + r] / top_k : beg + r) : 0;
    arow[i] = a + (size_t)row * K + col;
    a_soff[i] = r * LDS + col;
  }
  // B: 128 rows x 4 chunks = 512 chunks, two per thread.
  const __nv_bfloat16* brow[2];
  bool bvalid[2];
  int b_soff[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int c = tid + i * THREADS, r = c >> 2, col = (c & 3) * 8;
    const __nv_bfloat16* base;
    int wr;
    if (glu) {
      base = reinterpret_cast<const __nv_bfloat16*>(wtab[3 * e + (r < BN / 2 ? 0 : 1)]);
      wr = n0 + (r & (BN / 2 - 1));
    } else {
      base = reinterpret_cast<const __nv_bfloat16*>(wtab[3 * e + 2]);
      wr = n0 + r;
    }
    bvalid[i] = wr < N;
    brow[i] = base + (size_t)(bvalid[i] ? wr : 0) * K + col;
    b_soff[i] = 2 * A_ELEMS + r * LDS + col;
  }
  auto load_stage = [&](int slot, int k0) {
    const uint32_t st = sbase + (uint32_t)(slot * STAGE_ELEMS) * 2;
#pragma unroll
    for (int i = 0; i < A_PER; ++i) {
      cp_async16_zfill(st + a_soff[i] * 2, arow[i] + k0, avalid[i]);
      if (SPLIT) cp_async16_zfill(st + (A_ELEMS + a_soff[i]) * 2, arow[i] + a_lo + k0, avalid[i]);
    }
#pragma unroll
    for (int i = 0; i < 2; ++i) cp_async16_zfill(st + b_soff[i] * 2, brow[i] + k0, bvalid[i]);
  };

  const int wm = (warp >> 2) * (BM / 2), wn = (warp & 3) * 32;
  float acc[MT][4][4];
#pragma unroll
  for (int i = 0; i < MT; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int u = 0; u < 4; ++u) acc[i][j][u] = 0.0f;

  const int KT = K / BK;
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s < KT) load_stage(s, s * BK);
    cp_async_commit();
  }
  // ldmatrix lane offsets: A rows lane%16, columns (lane/16)*8; B rows (lane%8) +
  // (lane/16)*8, columns ((lane/8)%2)*8.
  const int a_lane = (lane & 15) * LDS + (lane >> 4) * 8;
  const int b_lane = ((lane & 7) + (lane >> 4) * 8) * LDS + ((lane >> 3) & 1) * 8;
  for (int kt = 0; kt < KT; ++kt) {
    cp_async_wait<STAGES - 2>();
    __syncthreads();
    const int nk = kt + STAGES - 1;
    if (nk < KT) load_stage(nk % STAGES, nk * BK);
    cp_async_commit();
    const uint32_t st = sbase + (uint32_t)((kt % STAGES) * STAGE_ELEMS) * 2;
#pragma unroll
    for (int kk = 0; kk < BK; kk += 16) {
      uint32_t bf[4][2];
#pragma unroll
      for (int j = 0; j < 2; ++j)
        ldsm_x4(st + (2 * A_ELEMS + (wn + j * 16) * LDS + kk + b_lane) * 2, bf[2 * j][0],
                bf[2 * j][1], bf[2 * j + 1][0], bf[2 * j + 1][1]);
#pragma unroll
      for (int i = 0; i < MT; ++i) {
        uint32_t af[4];
        const int off = (wm + i * 16) * LDS + kk + a_lane;
        ldsm_x4(st + off * 2, af[0], af[1], af[2], af[3]);
#pragma unroll
        for (int j = 0; j < 4; ++j) mma_bf16(acc[i][j], af, bf[j][0], bf[j][1]);
        if (SPLIT) {
          ldsm_x4(st + (A_ELEMS + off) * 2, af[0], af[1], af[2], af[3]);
#pragma unroll
          for (int j = 0; j < 4; ++j) mma_bf16(acc[i][j], af, bf[j][0], bf[j][1]);
        }
      }
    }
  }
  cp_async_wait<0>();
  __syncthreads();

  // Epilogue through shared memory (the stages are dead): C [BM][BN + 4] f32.
  float* cs = reinterpret_cast<float*>(smem_raw);
  constexpr int LDC = BN + 4;
  const int g = lane >> 2, c2 = (lane & 3) * 2;
#pragma unroll
  for (int i = 0; i < MT; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int r = wm + i * 16 + g, c = wn + j * 8 + c2;
      *reinterpret_cast<float2*>(&cs[r * LDC + c]) = make_float2(acc[i][j][0], acc[i][j][1]);
      *reinterpret_cast<float2*>(&cs[(r + 8) * LDC + c]) = make_float2(acc[i][j][2], acc[i][j][3]);
    }
  __syncthreads();
  if (glu) {
    // h[q, n0 + c] = silu(gate) * up, 8 features per thread-step, as bf16 hi (+ lo).
    __nv_bfloat16* h = reinterpret_cast<__nv_bfloat16*>(out);
    for (int idx = tid; idx < rows * 8; idx += THREADS) {
      const int r = idx >> 3, c = (idx & 7) * 8;
      __align__(16) __nv_bfloat16 hi[8], lo[8];
#pragma unroll
      for (int u = 0; u < 8; ++u) {
        const float gv = cs[r * LDC + c + u], uv = cs[r * LDC + BN / 2 + c + u];
        const float v = gv / (1.0f + __expf(-gv)) * uv;
        hi[u] = __float2bfloat16(v);
        lo[u] = __float2bfloat16(v - __bfloat162float(hi[u]));
      }
      const size_t o = (size_t)(beg + r) * N + n0 + c;
      *reinterpret_cast<uint4*>(h + o) = *reinterpret_cast<const uint4*>(hi);
      if (SPLIT) *reinterpret_cast<uint4*>(h + out_lo + o) = *reinterpret_cast<const uint4*>(lo);
    }
  } else {
    float* y = reinterpret_cast<float*>(out);
    const int cols = min(BN, N - n0);
    for (int idx = tid; idx < rows * (BN / 4); idx += THREADS) {
      const int r = idx / (BN / 4), c = (idx % (BN / 4)) * 4;
      if (c >= cols) continue;
      const uint32_t p = slots[beg + r];
      *reinterpret_cast<float4*>(y + (size_t)p * N + n0 + c) =
          *reinterpret_cast<const float4*>(&cs[r * LDC + c]);
    }
  }
}

#define MOE_MMA_KERNEL(NAME, BM, SPLIT)                                                        \
  extern "C" __global__ void __launch_bounds__(mg::THREADS, 2)                                 \
      NAME(const uint64_t* wtab, int glu, const __nv_bfloat16* a, size_t a_lo, int top_k,     \
           const uint32_t* offsets, const uint32_t* slots, int E, void* out, size_t out_lo,   \
           int N, int K) {                                                                     \
    pdl_enter();                                                                               \
    moe_mma_tile<BM, SPLIT>(wtab, glu, a, a_lo, top_k, offsets, slots, E, out, out_lo, N, K); \
  }
MOE_MMA_KERNEL(moe_mma_64_half, 64, false)
MOE_MMA_KERNEL(moe_mma_64_split, 64, true)
MOE_MMA_KERNEL(moe_mma_128_half, 128, false)
MOE_MMA_KERNEL(moe_mma_128_split, 128, true)
