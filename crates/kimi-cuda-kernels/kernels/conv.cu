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
