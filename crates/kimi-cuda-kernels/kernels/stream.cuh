// Weight streaming for one-token products (decode at batch 1).
//
// Decode is bound by the weight stream. A kernel that fetches one tile per CTA and exits
// (gemv_bulk) reaches 4.5 TB/s on a 750 MB matrix but 3.0-3.2 TB/s at the 20-60 MB of a
// layer's matrices: waves of CTAs ramp up and drain. Here one persistent CTA per SM walks
// tiles t = blockIdx.x, + gridDim.x, ... through S shared-memory stages:
//
//  - a producer warp queues each tile whole with the TMA engine (`cp.async.bulk`, one copy
//    per contiguous block of rows, completion counted on the stage's `full` mbarrier), and
//    once the consumers release a stage (its `empty` mbarrier, one arrival per consumer
//    warp) writes that tile's outputs from their row sums and queues the tile S steps on;
//  - 8 consumer warps multiply: warp w owns whole weight rows of the tile (rows w, w + 8,
//    ...) or, for tiles of fewer than 8 rows, a column slice of one row; lanes stride the
//    16-byte columns. The activation row sits in shared memory, staged once per CTA, so a
//    tile costs no global load besides its weights and no CTA-wide barrier.
//
// Rows of k bf16 with k % (256 * slices) == 0, where slices = 8 / rows per tile (1 from 8
// rows up). Sums meet in a fixed order, so results do not depend on timing.
#pragma once
#include "common.cuh"

#define STREAM_CONSUMERS 8
#define STREAM_THREADS (32 * (STREAM_CONSUMERS + 1))
#define STREAM_MAX_STAGES 8
// Weight rows per tile at most (gate + up rows together for SwiGLU tiles).
#define STREAM_MAX_ROWS 16

struct StreamSmem {
  uint64_t full[STREAM_MAX_STAGES];
  uint64_t empty[STREAM_MAX_STAGES];
  // Per stage, per weight row, per column slice: the consumers' row sums.
  float part[STREAM_MAX_STAGES][STREAM_MAX_ROWS][STREAM_CONSUMERS];
};

__device__ __forceinline__ void stream_bar_init(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}

__device__ __forceinline__ void stream_bar_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}

// Every stage's `full` (one arrival: the producer's copies) and `empty` (one per consumer
// warp) barriers, then a block barrier. S: any shared struct with `full` and `empty` arrays.
template <class S>
__device__ __forceinline__ void stream_init(S& s, int stages) {
  if (threadIdx.x == 0) {
    for (int i = 0; i < stages; ++i) {
      stream_bar_init(smem_addr(&s.full[i]), 1);
      stream_bar_init(smem_addr(&s.empty[i]), STREAM_CONSUMERS);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
}

// Producer lane 0: queues `bytes0` from `src0` (and `bytes1` from `src1` right after it)
// into `dst`, completing on `full[stage]`. Sizes are multiples of 16, sources 16-byte
// aligned.
__device__ __forceinline__ void stream_fetch(StreamSmem& s, uint8_t* dst, int stage,
                                             const void* src0, uint32_t bytes0,
                                             const void* src1, uint32_t bytes1) {
  const uint32_t bar = smem_addr(&s.full[stage]);
  bar_expect(bar, bytes0 + bytes1);
  bulk_copy(smem_addr(dst), src0, bytes0, bar);
  if (bytes1) bulk_copy(smem_addr(dst + bytes0), src1, bytes1, bar);
}

// Copies `floats` f32 (a multiple of 4, 16-byte aligned) from global to shared memory with
// every thread of the block, then a barrier.
__device__ __forceinline__ void stream_stage_x(float* xs, const float* x, int floats) {
  for (int i = threadIdx.x; i < floats / 4; i += blockDim.x)
    reinterpret_cast<float4*>(xs)[i] = reinterpret_cast<const float4*>(x)[i];
  __syncthreads();
}

// Consumer warp `warp`: weight row `row` (of `row_bytes`) of the tile at `tile`, column slice
// `slice` of `slices`, times the f32 row `x` (shared or global memory); the warp's sum goes
// to part[stage][row][slice].
__device__ __forceinline__ void stream_row_dot(StreamSmem& s, int stage, const uint8_t* tile,
                                               int row, int nv, int slice, int slices,
                                               const float* x) {
  const int lane = threadIdx.x & 31;
  const int per = nv / slices;
  const uint4* w = reinterpret_cast<const uint4*>(tile) + (size_t)row * nv + slice * per;
  const float4* x4 = reinterpret_cast<const float4*>(x) + 2 * slice * per;
  float acc0 = 0.0f, acc1 = 0.0f;
#pragma unroll 4
  for (int c = lane; c < per; c += 32) {
    float f[8];
    const uint4 v = w[c];
    const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 t = __bfloat1622float2(h[i]);
      f[2 * i] = t.x;
      f[2 * i + 1] = t.y;
    }
    const float4 a = x4[2 * c], b = x4[2 * c + 1];
    acc0 = fmaf(f[0], a.x, acc0);
    acc1 = fmaf(f[1], a.y, acc1);
    acc0 = fmaf(f[2], a.z, acc0);
    acc1 = fmaf(f[3], a.w, acc1);
    acc0 = fmaf(f[4], b.x, acc0);
    acc1 = fmaf(f[5], b.y, acc1);
    acc0 = fmaf(f[6], b.z, acc0);
    acc1 = fmaf(f[7], b.w, acc1);
  }
  float v = acc0 + acc1;
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  if (lane == 0) s.part[stage][row][slice] = v;
}

// Weight row r of the tile in `stage`, summed over its slices (producer, after `empty`).
__device__ __forceinline__ float stream_row_sum(const StreamSmem& s, int stage, int r,
                                                int slices) {
  float v = 0.0f;
  for (int i = 0; i < slices; ++i) v += s.part[stage][r][i];
  return v;
}

// How consumer warp `warp` covers a tile of `rows` (plan) weight rows: `slices` column
// slices per row, and the first row it takes (then every `step`-th).
struct StreamCover {
  int slices, first, step, slice;
};

__device__ __forceinline__ StreamCover stream_cover(int rows, int warp) {
  StreamCover c;
  if (rows >= STREAM_CONSUMERS) {
    c.slices = 1;
    c.first = warp;
    c.step = STREAM_CONSUMERS;
    c.slice = 0;
  } else {
    c.slices = STREAM_CONSUMERS / rows;
    c.first = warp / c.slices;
    c.step = STREAM_CONSUMERS;  // one row each
    c.slice = warp % c.slices;
  }
  return c;
}

// ---------------------------------------------------------------------------------------------
// One-token MoE layers streamed by persistent kernels (`moe_stream_1`, `moe_stream_layer` in
// moe.cu; `moe_int4_stream_layer` in int4_stream.cu).

// Slot j's expert (table index) and its first pair's place in `slots`.
__device__ __forceinline__ int moe_stream_expert(const uint32_t* offsets, int E, int shared,
                                                 int j, uint32_t& pair) {
  if (j < shared) {
    pair = 0xffffffffu;
    return E;
  }
  const int e = (int)offsets[E + 2 + (j - shared)];
  pair = offsets[e];
  return e;
}

// Slots a launch handles at most (top_k + shared; the launcher checks).
#define MOE_STREAM_MAX_SLOTS 64

// Per slot of a one-launch layer: its three matrices and its pair row q.
struct MoeLayerSlots {
  const uint8_t* gate[MOE_STREAM_MAX_SLOTS];
  const uint8_t* up[MOE_STREAM_MAX_SLOTS];
  const uint8_t* down[MOE_STREAM_MAX_SLOTS];
  int q[MOE_STREAM_MAX_SLOTS];
};

__device__ __forceinline__ uint32_t ld_acquire_u32(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// A barrier of the consumer warps only (the producer runs on).
__device__ __forceinline__ void consumers_sync() {
  asm volatile("bar.sync 1, %0;" ::"n"(32 * STREAM_CONSUMERS) : "memory");
}

// Producer warp of a one-launch layer: this CTA's gate/up outputs are all written.
__device__ __forceinline__ void layer_count_in(uint32_t* sync, int lane) {
  __syncwarp();
  if (lane == 0) {
    __threadfence();
    atomicAdd(&sync[0], 1u);
  }
}

// Consumer warps of a one-launch layer, between its gate/up and down tiles: wait for every
// CTA's count (`sync[0]`; the last CTA past the wait zeroes both counters, so they are zero
// between launches), then stage the `floats` f32 of SwiGLU rows `h` at `xs`.
__device__ __forceinline__ void layer_handoff(uint32_t* sync, float* xs, const float* h,
                                              int floats) {
  if (threadIdx.x == 0)
    while (ld_acquire_u32(&sync[0]) < gridDim.x) __nanosleep(64);
  consumers_sync();
  if (threadIdx.x == 0 && atomicAdd(&sync[1], 1u) == gridDim.x - 1) {
    sync[0] = 0;
    sync[1] = 0;
  }
  for (int k = threadIdx.x; k < floats / 4; k += 32 * STREAM_CONSUMERS)
    reinterpret_cast<float4*>(xs)[k] = __ldcg(reinterpret_cast<const float4*>(h) + k);
  consumers_sync();
}
