// MoE routing on the device: sigmoid scores, correction bias for selection, group-limited
// top-k (groups scored by their two best), weights from the unbiased (or biased) scores,
// renormalised and scaled. Follows crates/kimi-cpu/src/moe.rs `route`.
// One block per token; shared memory holds 3*E floats. Selection is serial in thread 0
// (E <= a few hundred, k <= 16); ties go to the lower index.
#include "common.cuh"

extern "C" __global__ void moe_route(const float* logits, const void* bias, int bdt, int has_bias,
                                     uint32_t* ids, float* weights, int E, int top_k,
                                     int num_groups, int topk_group, int renormalize,
                                     float scaling, int weights_use_bias) {
  extern __shared__ float sm[];
  float* scores = sm;
  float* choice = sm + E;
  float* masked = sm + 2 * E;
  const size_t t = blockIdx.x;
  for (int e = threadIdx.x; e < E; e += blockDim.x) {
    float s = sigmoidf_(logits[t * E + e]);
    scores[e] = s;
    choice[e] = has_bias ? s + ld(bias, e, bdt) : s;
    masked[e] = choice[e];
  }
  __syncthreads();
  if (threadIdx.x != 0) return;
  if (num_groups > 1) {
    int per = E / num_groups;
    // Group scores, then keep the topk_group best groups.
    float gs[64];
    bool keep[64];
    for (int gi = 0; gi < num_groups && gi < 64; ++gi) {
      float b1 = -INFINITY, b2 = -INFINITY;
      for (int e = gi * per; e < (gi + 1) * per; ++e) {
        float c = choice[e];
        if (c > b1) { b2 = b1; b1 = c; } else if (c > b2) { b2 = c; }
      }
      gs[gi] = per >= 2 ? b1 + b2 : b1;
      keep[gi] = false;
    }
    for (int n = 0; n < topk_group; ++n) {
      int best = -1;
      for (int gi = 0; gi < num_groups && gi < 64; ++gi)
        if (!keep[gi] && (best < 0 || gs[gi] > gs[best])) best = gi;
      if (best >= 0) keep[best] = true;
    }
    for (int gi = 0; gi < num_groups && gi < 64; ++gi)
      if (!keep[gi])
        for (int e = gi * per; e < (gi + 1) * per; ++e) masked[e] = -INFINITY;
  }
  float wsum = 0.0f;
  for (int n = 0; n < top_k; ++n) {
    int best = -1;
    for (int e = 0; e < E; ++e)
      if (masked[e] != -3.0e38f && (best < 0 || masked[e] > masked[best])) best = e;
    ids[t * top_k + n] = (uint32_t)best;
    float w = weights_use_bias ? choice[best] : scores[best];
    weights[t * top_k + n] = w;
    wsum += w;
    masked[best] = -3.0e38f;  // taken
  }
  for (int n = 0; n < top_k; ++n) {
    float w = weights[t * top_k + n];
    if (renormalize && top_k > 1) w /= (wsum + 1e-20f);
    weights[t * top_k + n] = w * scaling;
  }
}
