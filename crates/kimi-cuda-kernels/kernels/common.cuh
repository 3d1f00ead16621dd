// Shared helpers of the kimi-infer kernels. Activations are f32; weights are read through
// `ld` in their stored dtype (0 = f32, 1 = bf16, 2 = f16).
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

__device__ __forceinline__ float ld(const void* p, size_t i, int dt) {
  if (dt == 1) return __bfloat162float(reinterpret_cast<const __nv_bfloat16*>(p)[i]);
  if (dt == 2) return __half2float(reinterpret_cast<const __half*>(p)[i]);
  return reinterpret_cast<const float*>(p)[i];
}

// A weight's raw bits by the read-only path (f32: 32 bits; bf16, f16: 16) and their value:
// `ld` split in two, so that weights can be loaded before `pdl_wait` and converted after it
// without holding up the loads.
__device__ __forceinline__ uint32_t ld_raw(const void* p, size_t i, int dt) {
  if (dt == 0) return __ldg(reinterpret_cast<const uint32_t*>(p) + i);
  return (uint32_t)__ldg(reinterpret_cast<const unsigned short*>(p) + i);
}
__device__ __forceinline__ float raw_val(uint32_t v, int dt) {
  if (dt == 1) return __uint_as_float(v << 16);
  if (dt == 2) return __half2float(__ushort_as_half((unsigned short)v));
  return __uint_as_float(v);
}

// Programmatic dependent launch (sm_90): kernels are launched so that the next kernel's
// blocks may start while this one still runs. Every kernel therefore waits for its
// predecessor to finish (and its writes to be visible) before it touches activations
// (`pdl_wait`), then lets its successor launch (`pdl_launch`). Because every kernel waits,
// completion stays ordered down the whole chain. Without the launch attribute both are
// no-ops. Only reads of immutable data (weights) may come before `pdl_wait`.
__device__ __forceinline__ void pdl_wait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }
__device__ __forceinline__ void pdl_launch() {
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}
__device__ __forceinline__ void pdl_enter() {
  pdl_wait();
  pdl_launch();
}

// TMA bulk copies (sm_90): global -> shared memory, completion counted on an mbarrier. One
// thread initialises the barrier (then __syncthreads), announces the bytes and queues the
// copies; every thread waits for the phase.
__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return (uint32_t)__cvta_generic_to_shared(p);
}
__device__ __forceinline__ void bar_init(uint32_t bar) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(bar) : "memory");
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}
__device__ __forceinline__ void bar_expect(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes)
               : "memory");
}
// `bytes` a multiple of 16; `src` and `dst` 16-byte aligned.
__device__ __forceinline__ void bulk_copy(uint32_t dst, const void* src, uint32_t bytes,
                                          uint32_t bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::
          "r"(dst),
      "l"(src), "r"(bytes), "r"(bar)
      : "memory");
}
__device__ __forceinline__ void bar_wait(uint32_t bar, uint32_t parity) {
  uint32_t done = 0;
  while (!done) {
    asm volatile(
        "{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, "
        "0, p; }"
        : "=r"(done)
        : "r"(bar), "r"(parity)
        : "memory");
  }
}

__device__ __forceinline__ float sigmoidf_(float x) { return 1.0f / (1.0f + expf(-x)); }

// Sum over the block; `red` holds at least 32 floats. Every thread gets the result.
__device__ __forceinline__ float block_sum(float v, float* red) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  __syncthreads();
  if (lane == 0) red[warp] = v;
  __syncthreads();
  int nw = (blockDim.x + 31) >> 5;
  float t = lane < nw ? red[lane] : 0.0f;
  for (int o = 16; o > 0; o >>= 1) t += __shfl_xor_sync(0xffffffffu, t, o);
  return t;
}

__device__ __forceinline__ float block_max(float v, float* red) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  __syncthreads();
  if (lane == 0) red[warp] = v;
  __syncthreads();
  int nw = (blockDim.x + 31) >> 5;
  float t = lane < nw ? red[lane] : -INFINITY;
  for (int o = 16; o > 0; o >>= 1) t = fmaxf(t, __shfl_xor_sync(0xffffffffu, t, o));
  return t;
}
