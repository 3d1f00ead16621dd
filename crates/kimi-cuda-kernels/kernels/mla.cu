// Multi-head latent attention over a paged latent cache; follows crates/kimi-cpu/src/mla.rs.
// The cache of a layer is one pool [num_blocks, bs, r + dr] (rows c ‖ k_pe); a segment's
// sequence finds position s in row s % bs of block table[s / bs] (table: u32 block ids).
// Queries q [len, H*(dn+dr)] (this segment's rows only); out [len, H*dv]. Attention kernels:
// grid (len, H), block 256, dynamic shared memory.
#include "common.cuh"

// Offset in rows of position s of a sequence in its pool.
__device__ __forceinline__ size_t paged_row(const unsigned* table, int bs, int s) {
  return (size_t)table[s / bs] * bs + s % bs;
}

// Writes src [len, lw] to positions first .. first+len-1 of the sequence. Grid (len).
extern "C" __global__ void mla_paged_write(const float* src, float* pool, const unsigned* table,
                                           int bs, int first, int lw) {
  const int j = blockIdx.x;
  const float* from = src + (size_t)j * lw;
  float* to = pool + paged_row(table, bs, first + j) * lw;
  for (int i = threadIdx.x; i < lw; i += blockDim.x) to[i] = from[i];
}

// Gathers columns 0 .. ncols-1 of positions 0 .. total-1 into out [total, ncols]. Grid (total).
extern "C" __global__ void mla_paged_gather(const float* pool, const unsigned* table, int bs,
                                            int lw, int ncols, float* out) {
  const int s = blockIdx.x;
  const float* from = pool + paged_row(table, bs, s) * lw;
  float* to = out + (size_t)s * ncols;
  for (int i = threadIdx.x; i < ncols; i += blockDim.x) to[i] = from[i];
}

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
extern "C" __global__ void mla_expanded(const float* q, const float* cache,
                                        const unsigned* table, int bs, const float* kv,
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
    const float* pe = cache + paged_row(table, bs, s) * lw + r;
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
extern "C" __global__ void mla_absorbed(const float* q, const float* cache,
                                        const unsigned* table, int bs, const void* kvb,
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
    const float* row = cache + paged_row(table, bs, s) * lw;
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
    for (int s = 0; s < visible; ++s) acc += sc[s] * cache[paged_row(table, bs, s) * lw + c];
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
