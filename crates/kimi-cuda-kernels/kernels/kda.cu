// Kimi Delta Attention: the forget gate and the recurrent gated delta rule.
// Follows crates/kimi-cpu/src/kda.rs (`gate`, `recurrent_head`).
#include "common.cuh"

// kind 0: g = -exp(a_log[h]) * softplus(f + dt_bias); kind 1: g = lb * sigmoid(exp(a_log[h]) * (f + dt_bias)).
extern "C" __global__ void kda_gate(const float* f, const void* a_log, int adt, const void* dt_bias,
                                    int bdt, float* g, size_t n, int width, int d, int kind,
                                    float lb) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x) {
    int c = (int)(i % width);
    float x = f[i] + ld(dt_bias, c, bdt);
    float scale = expf(ld(a_log, c / d, adt));
    if (kind == 0) {
      float sp = x > 20.0f ? x : log1pf(expf(x));
      g[i] = -scale * sp;
    } else {
      g[i] = lb * sigmoidf_(scale * x);
    }
  }
}

// One block per head of one segment; thread j owns column j (value index) of the f32
// state S [H, D, D] (key-major, S[h][i][j]) in registers. Rows start..start+len.
// q is L2-normalised and scaled by D^-1/2, k is L2-normalised (eps 1e-6 inside the sqrt).
template <int MAXD>
__device__ void kda_recurrent_impl(const float* q, const float* k, const float* v,
                                   const float* g, const float* beta, float* state, float* out,
                                   int start, int len, int H, int D) {
  __shared__ float qs[MAXD], ks[MAXD], as[MAXD], red[32];
  const int h = blockIdx.x, j = threadIdx.x;
  const bool live = j < D;
  float* S = state + (size_t)h * D * D;
  float s[MAXD];
#pragma unroll
  for (int i = 0; i < MAXD; ++i) s[i] = (i < D && live) ? S[(size_t)i * D + j] : 0.0f;
  const size_t width = (size_t)H * D;
  const float qscale = rsqrtf((float)D);
  for (int t = 0; t < len; ++t) {
    const size_t row = (size_t)(start + t) * width + (size_t)h * D;
    float qj = live ? q[row + j] : 0.0f, kj = live ? k[row + j] : 0.0f;
    float ssq = block_sum(qj * qj, red);
    float ssk = block_sum(kj * kj, red);
    if (live) {
      qs[j] = qj * (qscale / sqrtf(ssq + 1e-6f));
      ks[j] = kj * (1.0f / sqrtf(ssk + 1e-6f));
      as[j] = expf(g[row + j]);
    }
    __syncthreads();
    if (live) {
      float u = v[row + j];
#pragma unroll
      for (int i = 0; i < MAXD; ++i)
        if (i < D) {
          s[i] *= as[i];
          u -= s[i] * ks[i];
        }
      u *= beta[(size_t)(start + t) * H + h];
      float o = 0.0f;
#pragma unroll
      for (int i = 0; i < MAXD; ++i)
        if (i < D) {
          s[i] += ks[i] * u;
          o += s[i] * qs[i];
        }
      out[row + j] = o;
    }
    __syncthreads();
  }
#pragma unroll
  for (int i = 0; i < MAXD; ++i)
    if (i < D && live) S[(size_t)i * D + j] = s[i];
}

#define KDA_RECURRENT(N)                                                                      \
  extern "C" __global__ void __launch_bounds__(N) kda_recurrent_##N(                         \
      const float* q, const float* k, const float* v, const float* g, const float* beta,      \
      float* state, float* out, int start, int len, int H, int D) {                           \
    kda_recurrent_impl<N>(q, k, v, g, beta, state, out, start, len, H, D);                    \
  }
KDA_RECURRENT(32)
KDA_RECURRENT(64)
KDA_RECURRENT(128)
