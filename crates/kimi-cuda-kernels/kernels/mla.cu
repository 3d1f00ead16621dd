// Multi-head latent attention over one segment's latent cache [total, r + dr] (rows
// c ‖ k_pe); follows crates/kimi-cpu/src/mla.rs. Queries q [len, H*(dn+dr)] (this
// segment's rows only); out [len, H*dv]. Grid (len, H), block 256, dynamic shared memory.
#include "common.cuh"

// Softmax of sc[0..visible) in place (unnormalised exp); returns the sum.
__device__ float softmax_inplace(float* sc, int visible, float* red) {
  float m = -INFINITY;
  for (int s = threadIdx.x; s < visible; s += blockDim.x) m = fmaxf(m, sc[s]);
  m = block_max(m, red);
  float sum = 0.0f;
  for (int s = threadIdx.x; s < visible; s += blockDim.x) {
    float e = expf(sc[s] - m);
    sc[s] = e;
    sum += e;
  }
  sum = block_sum(sum, red);
  __syncthreads();
  return sum;
}

// Expanded form: kv [total, H*(dn+dv)] holds the decompressed keys and values.
// Shared: scores[total].
extern "C" __global__ void mla_expanded(const float* q, const float* cache, const float* kv,
                                        float* out, int past, int H, int r, int dn, int dr,
                                        int dv, float scale) {
  extern __shared__ float sm[];
  __shared__ float red[32];
  const int t = blockIdx.x, h = blockIdx.y;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  const int lw = r + dr, ph = dn + dv, visible = past + t + 1;
  const float* qt = q + ((size_t)t * H + h) * (dn + dr);
  float* sc = sm;
  for (int s = warp; s < visible; s += nw) {
    const float* kr = kv + ((size_t)s * H + h) * ph;
    const float* pe = cache + (size_t)s * lw + r;
    float acc = 0.0f;
    for (int i = lane; i < dn; i += 32) acc += qt[i] * kr[i];
    for (int i = lane; i < dr; i += 32) acc += qt[dn + i] * pe[i];
    for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
    if (lane == 0) sc[s] = acc * scale;
  }
  __syncthreads();
  float sum = softmax_inplace(sc, visible, red);
  for (int j = threadIdx.x; j < dv; j += blockDim.x) {
    float acc = 0.0f;
    for (int s = 0; s < visible; ++s) acc += sc[s] * kv[((size_t)s * H + h) * ph + dn + j];
    out[((size_t)t * H + h) * dv + j] = acc / sum;
  }
}

// Absorbed form: q_lat = W_uk[h]ᵀ q_nope, scores over raw latents, o = W_uv[h] · Σ p c.
// kv_b [H*(dn+dv), r] in dtype kdt. Shared: q_lat[r], o_lat[r], scores[total].
extern "C" __global__ void mla_absorbed(const float* q, const float* cache, const void* kvb,
                                        int kdt, float* out, int past, int H, int r, int dn,
                                        int dr, int dv, float scale) {
  extern __shared__ float sm[];
  __shared__ float red[32];
  const int t = blockIdx.x, h = blockIdx.y;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  const int lw = r + dr, ph = dn + dv, visible = past + t + 1;
  const float* qt = q + ((size_t)t * H + h) * (dn + dr);
  float* qlat = sm;
  float* olat = sm + r;
  float* sc = sm + 2 * r;
  const size_t wk = (size_t)h * ph * r, wv = ((size_t)h * ph + dn) * r;
  for (int c = threadIdx.x; c < r; c += blockDim.x) {
    float acc = 0.0f;
    for (int i = 0; i < dn; ++i) acc += qt[i] * ld(kvb, wk + (size_t)i * r + c, kdt);
    qlat[c] = acc;
  }
  __syncthreads();
  for (int s = warp; s < visible; s += nw) {
    const float* row = cache + (size_t)s * lw;
    float acc = 0.0f;
    for (int i = lane; i < r; i += 32) acc += qlat[i] * row[i];
    for (int i = lane; i < dr; i += 32) acc += qt[dn + i] * row[r + i];
    for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
    if (lane == 0) sc[s] = acc * scale;
  }
  __syncthreads();
  float sum = softmax_inplace(sc, visible, red);
  for (int c = threadIdx.x; c < r; c += blockDim.x) {
    float acc = 0.0f;
    for (int s = 0; s < visible; ++s) acc += sc[s] * cache[(size_t)s * lw + c];
    olat[c] = acc / sum;
  }
  __syncthreads();
  for (int j = warp; j < dv; j += nw) {
    float acc = 0.0f;
    for (int c = lane; c < r; c += 32) acc += ld(kvb, wv + (size_t)j * r + c, kdt) * olat[c];
    for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
    if (lane == 0) out[((size_t)t * H + h) * dv + j] = acc;
  }
}
