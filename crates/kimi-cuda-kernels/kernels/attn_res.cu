// Block Attention Residuals (Kimi K3 spec §3.6): the per-token softmax mix over the stored
// block sums and the current partial sum. Follows crates/kimi-cpu/src/attn_res.rs `mix`.
#include "common.cuh"

#define ATTN_RES_MAX_SOURCES 64

// The sources of one mix, passed by value: `src[k]` is `[n, d]` f32, k < count (the blocks
// in order, the partial sum last).
struct AttnResSources {
  const float* src[ATTN_RES_MAX_SOURCES];
  int count;
};

// out[t] = Σ_k π_k V_k[t], π = softmax_k((V_k[t] · w) / sqrt(mean(V_k[t]²) + eps)), f32.
// One block per token; the logits live in shared memory.
extern "C" __global__ void attn_res_mix(const AttnResSources s, const float* w, float* out,
                                        int d, float eps) {
  pdl_enter();
  __shared__ float red[32];
  __shared__ float prob[ATTN_RES_MAX_SOURCES];
  const size_t t = blockIdx.x;
  for (int k = 0; k < s.count; ++k) {
    const float* v = s.src[k] + t * d;
    float dot = 0.0f, sq = 0.0f;
    for (int i = threadIdx.x; i < d; i += blockDim.x) {
      const float x = v[i];
      dot = fmaf(x, w[i], dot);
      sq = fmaf(x, x, sq);
    }
    dot = block_sum(dot, red);
    sq = block_sum(sq, red);
    if (threadIdx.x == 0) prob[k] = dot / sqrtf(sq / d + eps);
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    float m = -INFINITY;
    for (int k = 0; k < s.count; ++k) m = fmaxf(m, prob[k]);
    float total = 0.0f;
    for (int k = 0; k < s.count; ++k) {
      prob[k] = expf(prob[k] - m);
      total += prob[k];
    }
    for (int k = 0; k < s.count; ++k) prob[k] /= total;
  }
  __syncthreads();
  for (int i = threadIdx.x; i < d; i += blockDim.x) {
    float acc = 0.0f;
    for (int k = 0; k < s.count; ++k) acc = fmaf(prob[k], s.src[k][t * d + i], acc);
    out[t * d + i] = acc;
  }
}
