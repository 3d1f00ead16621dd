// Causal depthwise short convolution + SiLU over one segment, and its state update.
// x [n, C]; w [C, W] (tap W-1 multiplies the current token); state [W-1, C], oldest first.
#include "common.cuh"

__device__ __forceinline__ float conv_input(const float* x, const float* state, int start,
                                            int pos, int ch, int C, int W) {
  return pos < 0 ? state[(size_t)(W - 1 + pos) * C + ch] : x[(size_t)(start + pos) * C + ch];
}

// out rows start..start+len. Grid-stride over len*C.
extern "C" __global__ void short_conv_silu(const float* x, const void* w, int wdt,
                                           const float* state, float* out, int start, int len,
                                           int C, int W) {
  pdl_enter();
  size_t n = (size_t)len * C;
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x) {
    int t = (int)(i / C), ch = (int)(i % C);
    float acc = 0.0f;
    for (int j = 0; j < W; ++j)
      acc += ld(w, (size_t)ch * W + j, wdt) * conv_input(x, state, start, t - (W - 1) + j, ch, C, W);
    out[(size_t)(start + t) * C + ch] = acc * sigmoidf_(acc);
  }
}

// The same for a fixed width: thread (channel, run of CONV_RUN tokens) keeps the last W-1
// inputs in registers, so every input is read once and the weights once per run. Grid
// (ceil(C / blockDim.x), ceil(len / CONV_RUN)); sums in the order of short_conv_silu.
#define CONV_RUN 16
template <int W>
__device__ __forceinline__ void conv_runs(const float* __restrict__ x, const void* w, int wdt,
                                          const float* state, float* __restrict__ out,
                                          int start, int len, int C) {
  const int ch = blockIdx.x * blockDim.x + threadIdx.x;
  const int t0 = blockIdx.y * CONV_RUN;
  if (ch >= C || t0 >= len) return;
  float wk[W], hist[W - 1];
#pragma unroll
  for (int j = 0; j < W; ++j) wk[j] = ld(w, (size_t)ch * W + j, wdt);
#pragma unroll
  for (int j = 0; j < W - 1; ++j) hist[j] = conv_input(x, state, start, t0 - (W - 1) + j, ch, C, W);
  const int t1 = min(len, t0 + CONV_RUN);
  // Unrolled so that the loads of several tokens are in flight at once (`out` does not
  // alias `x`).
#pragma unroll 4
  for (int t = t0; t < t1; ++t) {
    const float xin = x[(size_t)(start + t) * C + ch];
    float acc = 0.0f;
#pragma unroll
    for (int j = 0; j < W - 1; ++j) acc += wk[j] * hist[j];
    acc += wk[W - 1] * xin;
#pragma unroll
    for (int j = 0; j + 1 < W - 1; ++j) hist[j] = hist[j + 1];
    hist[W - 2] = xin;
    out[(size_t)(start + t) * C + ch] = acc * sigmoidf_(acc);
  }
}
#define CONV_RUNS_KERNEL(W)                                                                    \
  extern "C" __global__ void short_conv_silu_w##W(const float* x, const void* w, int wdt,     \
                                                  const float* state, float* out, int start, \
                                                  int len, int C) {                          \
    pdl_enter();                                                                             \
    conv_runs<W>(x, w, wdt, state, out, start, len, C);                                      \
  }
CONV_RUNS_KERNEL(2)
CONV_RUNS_KERNEL(3)
CONV_RUNS_KERNEL(4)

// next_state = the last W-1 inputs (old state, then the segment's rows).
extern "C" __global__ void short_conv_state(const float* x, const float* state,
                                            float* next_state, int start, int len, int C, int W) {
  pdl_enter();
  size_t n = (size_t)(W - 1) * C;
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x) {
    int j = (int)(i / C), ch = (int)(i % C);
    next_state[i] = conv_input(x, state, start, len - (W - 1) + j, ch, C, W);
  }
}
