// MoE routing on the device: sigmoid scores, correction bias for selection, group-limited
// top-k (groups scored by their two best), weights from the unbiased (or biased) scores,
// renormalised and scaled. Follows crates/kimi-cpu/src/moe.rs `route`.
// One block per token; shared memory holds 3*E floats. Each of the top_k picks is a
// block-wide argmax; ties go to the lower index.
#include "common.cuh"

extern "C" __global__ void moe_route(const float* logits, const void* bias, int bdt, int has_bias,
                                     uint32_t* ids, float* weights, int E, int top_k,
                                     int num_groups, int topk_group, int renormalize,
                                     float scaling, int weights_use_bias) {
  pdl_enter();
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
  if (num_groups > 1) {
    // Few groups: thread 0 scores them and masks the dropped ones.
    if (threadIdx.x == 0) {
      int per = E / num_groups;
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
    __syncthreads();
  }
  // top_k rounds of a block-wide argmax (ties to the lower index, as the CPU's serial scan):
  // each thread scans its strided experts, warps reduce with shuffles, warp 0 reduces the
  // warp winners and marks the chosen expert taken.
  __shared__ float red_v[32];
  __shared__ int red_i[32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
  const float taken = -3.0e38f;
  float wsum = 0.0f;  // meaningful in thread 0
  for (int n = 0; n < top_k; ++n) {
    float bv = 0.0f;
    int bi = -1;
    for (int e = threadIdx.x; e < E; e += blockDim.x) {
      const float m = masked[e];
      if (m != taken && (bi < 0 || m > bv)) { bv = m; bi = e; }
    }
    for (int o = 16; o > 0; o >>= 1) {
      const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
      const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
      if (oi >= 0 && (bi < 0 || ov > bv || (ov == bv && oi < bi))) { bv = ov; bi = oi; }
    }
    if (lane == 0) { red_v[warp] = bv; red_i[warp] = bi; }
    __syncthreads();
    if (warp == 0) {
      bv = lane < nw ? red_v[lane] : 0.0f;
      bi = lane < nw ? red_i[lane] : -1;
      for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
        const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
        if (oi >= 0 && (bi < 0 || ov > bv || (ov == bv && oi < bi))) { bv = ov; bi = oi; }
      }
      if (lane == 0) {
        const int best = bi < 0 ? 0 : bi;
        ids[t * top_k + n] = (uint32_t)best;
        const float w = weights_use_bias ? choice[best] : scores[best];
        weights[t * top_k + n] = w;
        wsum += w;
        masked[best] = taken;
      }
    }
    __syncthreads();
  }
  if (threadIdx.x != 0) return;
  for (int n = 0; n < top_k; ++n) {
    float w = weights[t * top_k + n];
    if (renormalize && top_k > 1) w /= (wsum + 1e-20f);
    weights[t * top_k + n] = w * scaling;
  }
}

// moe_route for ungrouped routing (num_groups <= 1) over at most 32 * ROUTE_MAXJ experts: one
// warp per token, 8 tokens per 256-thread block, expert e = lane + 32 j held in registers
// (no shared memory, no block barriers). Same picks, ties and arithmetic order as moe_route.
__device__ __forceinline__ float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

#define ROUTE_MAXJ 16
#define ROUTE_MAX_EXPERTS (32 * ROUTE_MAXJ)
// One thread's share of the correction bias `bias [E]` (dtype `bdt`), for staging it in
// shared memory: the raw bits of experts `threadIdx.x + i * nthreads` (i < 2), loaded before
// `pdl_wait` (the bias never depends on the previous kernel) and converted only when stored,
// so that the loads stay in flight. E <= 2 * nthreads.
struct BiasStage {
  uint32_t raw[2];
};
__device__ __forceinline__ BiasStage bias_stage_load(const void* bias, int bdt, int has_bias,
                                                     int E, int nthreads) {
  BiasStage b;
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int e = threadIdx.x + i * nthreads;
    b.raw[i] = 0;
    if (has_bias && e < E)
      b.raw[i] = bdt == 0 ? __ldg(reinterpret_cast<const uint32_t*>(bias) + e)
                          : (uint32_t)__ldg(reinterpret_cast<const unsigned short*>(bias) + e);
  }
  return b;
}
// Stores the staged bias as f32 (as `ld` converts it) into `sm [E]`.
__device__ __forceinline__ void bias_stage_store(const BiasStage& b, int bdt, int E,
                                                 int nthreads, float* sm) {
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int e = threadIdx.x + i * nthreads;
    if (e < E)
      sm[e] = bdt == 1   ? __uint_as_float(b.raw[i] << 16)
              : bdt == 2 ? __half2float(__ushort_as_half((unsigned short)b.raw[i]))
                         : __uint_as_float(b.raw[i]);
  }
}

// The correction bias's raw bytes (E entries of dtype `bdt`, 4-byte aligned, E even unless
// f32) copied into `raw` (shared memory, E u32) by cp.async, which keeps no register busy
// while the copies are in flight; `cp.async.wait_all`, a barrier, then `bias_convert`.
__device__ __forceinline__ void bias_copy_async(const void* bias, int bdt, int E,
                                                uint32_t* raw) {
  const int words = bdt == 0 ? E : E / 2;
  const uint32_t* src = reinterpret_cast<const uint32_t*>(bias);
  for (int i = threadIdx.x; i < words; i += blockDim.x)
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(smem_addr(raw + i)),
                 "l"(src + i)
                 : "memory");
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}
__device__ __forceinline__ void bias_convert(const uint32_t* raw, int bdt, int E, float* out) {
  const unsigned short* raw16 = reinterpret_cast<const unsigned short*>(raw);
  for (int e = threadIdx.x; e < E; e += blockDim.x)
    out[e] = bdt == 1   ? __uint_as_float((uint32_t)raw16[e] << 16)
             : bdt == 2 ? __half2float(__ushort_as_half(raw16[e]))
                        : __uint_as_float(raw[e]);
}

// One warp routes one token: `logits` its E router logits, `bias_sm` the correction bias as
// f32 in shared memory (null without one), `ids`/`weights` its top_k picks (global or shared
// memory). The E logits load at once (one L2 round trip; one per expert chunk, each followed
// by its bias load, cost moe_route_one ~12 us when they ran in series), and with
// top_k <= 32 lane k keeps pick k in registers until the weights are final.
__device__ __forceinline__ void route_token_warp(const float* logits, const float* bias_sm,
                                                 uint32_t* ids, float* weights, int E,
                                                 int top_k, int renormalize, float scaling,
                                                 int weights_use_bias) {
  const int lane = threadIdx.x & 31;
  const float taken = -3.0e38f;
  float score[ROUTE_MAXJ], choice[ROUTE_MAXJ], masked[ROUTE_MAXJ];
#pragma unroll
  for (int j = 0; j < ROUTE_MAXJ; ++j) {
    const int e = lane + 32 * j;
    // L2 loads: in moe_route_one other blocks wrote these logits during this launch.
    score[j] = e < E ? __ldcg(logits + e) : 0.0f;
  }
#pragma unroll
  for (int j = 0; j < ROUTE_MAXJ; ++j) {
    const int e = lane + 32 * j;
    choice[j] = 0.0f;
    masked[j] = taken;  // experts past E are never picked
    if (e < E) {
      const float s = sigmoidf_(score[j]);
      score[j] = s;
      choice[j] = bias_sm ? s + bias_sm[e] : s;
      masked[j] = choice[j];
    } else {
      score[j] = 0.0f;
    }
  }
  const bool own = top_k <= 32;  // lane k keeps pick k
  uint32_t my_id = 0;
  float my_w = 0.0f;
  float wsum = 0.0f;  // the same in every lane
  for (int k = 0; k < top_k; ++k) {
    float bv = 0.0f;
    int bi = -1;
#pragma unroll
    for (int j = 0; j < ROUTE_MAXJ; ++j) {
      const float m = masked[j];
      if (m != taken && (bi < 0 || m > bv)) { bv = m; bi = lane + 32 * j; }
    }
    for (int o = 16; o > 0; o >>= 1) {
      const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
      const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
      if (oi >= 0 && (bi < 0 || ov > bv || (ov == bv && oi < bi))) { bv = ov; bi = oi; }
    }
    const int best = bi < 0 ? 0 : bi;
    float w = 0.0f;
#pragma unroll
    for (int j = 0; j < ROUTE_MAXJ; ++j)
      if (lane + 32 * j == best) {
        w = weights_use_bias ? choice[j] : score[j];
        masked[j] = taken;
      }
    w = __shfl_sync(0xffffffffu, w, best & 31);
    wsum += w;
    if (own) {
      if (lane == k) { my_id = (uint32_t)best; my_w = w; }
    } else if (lane == 0) {
      ids[k] = (uint32_t)best;
      weights[k] = w;
    }
  }
  if (own) {
    if (lane < top_k) {
      if (renormalize && top_k > 1) my_w /= (wsum + 1e-20f);
      ids[lane] = my_id;
      weights[lane] = my_w * scaling;
    }
    return;
  }
  if (lane != 0) return;
  for (int k = 0; k < top_k; ++k) {
    float w = weights[k];
    if (renormalize && top_k > 1) w /= (wsum + 1e-20f);
    weights[k] = w * scaling;
  }
}

// Block 256 (8 tokens, a warp each); the bias is staged in shared memory first.
extern "C" __global__ void __launch_bounds__(256)
    moe_route_warp(const float* logits, const void* bias, int bdt, int has_bias, uint32_t* ids,
                   float* weights, int n, int E, int top_k, int renormalize, float scaling,
                   int weights_use_bias) {
  __shared__ float bias_sm[ROUTE_MAX_EXPERTS];
  const BiasStage bs = bias_stage_load(bias, bdt, has_bias, E, 256);
  pdl_enter();
  if (has_bias) {
    bias_stage_store(bs, bdt, E, 256, bias_sm);
    __syncthreads();
  }
  const int t = blockIdx.x * 8 + (threadIdx.x >> 5);
  if (t >= n) return;
  route_token_warp(logits + (size_t)t * E, has_bias ? bias_sm : nullptr, ids + (size_t)t * top_k,
                   weights + (size_t)t * top_k, E, top_k, renormalize, scaling,
                   weights_use_bias);
}

// ---------------------------------------------------------------------------------------------
// Device-side expert dispatch (no host round trip).

// Exclusive prefix sum over the block (blockDim.x a multiple of 32, at most 1024); `total`
// gets the block's sum. `red` holds 32 u32.
__device__ __forceinline__ uint32_t block_exclusive_scan(uint32_t v, uint32_t* red,
                                                         uint32_t& total) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  uint32_t x = v;
  for (int o = 1; o < 32; o <<= 1) {
    const uint32_t y = __shfl_up_sync(0xffffffffu, x, o);
    if (lane >= o) x += y;
  }
  __syncthreads();
  if (lane == 31) red[warp] = x;
  __syncthreads();
  uint32_t before = 0;
  total = 0;
  for (int w = 0; w < nw; ++w) {
    if (w < warp) before += red[w];
    total += red[w];
  }
  return before + x - v;
}

// From the per-expert counts `cnt[E]` (shared memory): `offsets[0..E]` (exclusive prefix
// sum, then the total), `cur[e] = offsets[e]`, and after `offsets[E]` the active-expert list
// (`offsets[E+1]` = how many experts received pairs, then those experts in increasing
// order); with `offsets` null, only `cur`. A block-wide scan in chunks of blockDim.x experts.
__device__ void expert_offsets(const uint32_t* cnt, uint32_t* cur, uint32_t* offsets, int E) {
  __shared__ uint32_t red[32];
  uint32_t* active = offsets ? offsets + E + 1 : nullptr;
  uint32_t carry = 0, carry_active = 0;
  for (int base = 0; base < E; base += blockDim.x) {
    const int e = base + threadIdx.x;
    const uint32_t c = e < E ? cnt[e] : 0u;
    uint32_t sum, nact;
    const uint32_t off = block_exclusive_scan(c, red, sum);
    const uint32_t a = block_exclusive_scan(c > 0 ? 1u : 0u, red, nact);
    if (e < E) {
      cur[e] = carry + off;
      if (offsets) {
        offsets[e] = carry + off;
        if (c > 0) active[1 + carry_active + a] = (uint32_t)e;
      }
    }
    carry += sum;
    carry_active += nact;
  }
  if (offsets && threadIdx.x == 0) {
    offsets[E] = carry;
    active[0] = carry_active;
  }
  __syncthreads();
}

// counts[e] += how many of the pairs p0..p1 chose expert e (ids >= E are ignored); `counts`
// in shared memory.
__device__ __forceinline__ void count_pairs(const uint32_t* ids, int p0, int p1, int E,
                                            uint32_t* counts) {
  for (int p = p0 + threadIdx.x; p < p1; p += blockDim.x) {
    const uint32_t e = ids[p];
    if (e < (uint32_t)E) atomicAdd(&counts[e], 1u);
  }
}

// Writes pairs p0..p1 to their slots: pair p of expert e takes slot cur[e]++ (`cur` in shared
// memory), with its token row and routing weight; meta[p] = its expert.
__device__ __forceinline__ void place_pairs(const uint32_t* ids, const float* weights, int p0,
                                            int p1, int E, int top_k, uint32_t* cur,
                                            uint32_t* slots, uint32_t* rows, float* wsel,
                                            uint32_t* meta) {
  for (int p = p0 + threadIdx.x; p < p1; p += blockDim.x) {
    const uint32_t e = ids[p];
    meta[p] = e;
    if (e >= (uint32_t)E) continue;
    const uint32_t pos = atomicAdd(&cur[e], 1u);
    slots[pos] = (uint32_t)p;
    rows[pos] = (uint32_t)(p / top_k);
    wsel[pos] = weights[p];
  }
}

// `moe_lists` (one block) sorts the P = n*top_k (token, k) pairs by expert: `offsets[E+1]`
// (exclusive prefix sum of the per-expert counts), followed in the same buffer by the
// experts that received pairs (`offsets[E+1]` = their number, then the experts in increasing
// order; 2E+2 entries in all), and `slots[P]` (pair numbers, grouped by
// expert; order inside one expert is arbitrary and does not change any result). It also
// writes, per slot, the token row (`rows`) and routing weight (`wsel`) for the cuBLAS path,
// and `meta = [ids (P) | counts (E)]` so the host can read both back in one copy.
__device__ __forceinline__ void lists_block(const uint32_t* ids, const float* weights, int P,
                                            int E, int top_k, uint32_t* offsets,
                                            uint32_t* slots, uint32_t* rows, float* wsel,
                                            uint32_t* meta, uint32_t* cnt_sm) {
  uint32_t* cnt = cnt_sm;
  uint32_t* cur = cnt_sm + E;
  for (int e = threadIdx.x; e < E; e += blockDim.x) cnt[e] = 0;
  __syncthreads();
  count_pairs(ids, 0, P, E, cnt);
  __syncthreads();
  expert_offsets(cnt, cur, offsets, E);
  for (int e = threadIdx.x; e < E; e += blockDim.x) meta[P + e] = cnt[e];
  place_pairs(ids, weights, 0, P, E, top_k, cur, slots, rows, wsel, meta);
}

// Pairs routed to experts that are not here (present[e] == 0: held by another rank, or a
// tiered bank's cold experts, computed on the host) get the id NO_EXPERT and weight 0; the
// others are copied. moe_lists places no NO_EXPERT pair, so no kernel computes them, and
// moe_combine skips pairs of weight 0 without reading their (unwritten) output rows.
// ids/weights hold P entries, present one byte per expert.
#define NO_EXPERT 0xFFFFFFFFu
extern "C" __global__ void moe_mask_absent(const uint32_t* ids, const float* weights,
                                           const uint8_t* present, int P, uint32_t* ids_out,
                                           float* weights_out) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= P) return;
  uint32_t e = ids[i];
  bool here = present[e] != 0;
  ids_out[i] = here ? e : NO_EXPERT;
  weights_out[i] = here ? weights[i] : 0.0f;
}

extern "C" __global__ void moe_lists(const uint32_t* ids, const float* weights, int P, int E,
                                     int top_k, uint32_t* offsets, uint32_t* slots,
                                     uint32_t* rows, float* wsel, uint32_t* meta) {
  pdl_enter();
  extern __shared__ uint32_t cnt_sm[];
  lists_block(ids, weights, P, E, top_k, offsets, slots, rows, wsel, meta, cnt_sm);
}

// moe_lists' outputs for one token's top_k <= 32 pairs, whose picks `pk_id`/`pk_w` (shared
// memory) are final: the same offsets, active list, counts and slots (pairs of one expert in
// pair order), without moe_lists' global reads, atomics and scans. Every thread of the block
// takes part; the picks must be visible to all of it (a barrier before).
__device__ __forceinline__ void lists_one_token(const uint32_t* pk_id, const float* pk_w,
                                                int top_k, int E, uint32_t* ids,
                                                float* weights, uint32_t* offsets,
                                                uint32_t* slots, uint32_t* rows, float* wsel,
                                                uint32_t* meta) {
  // offsets[e] = pairs with an expert below e; meta's counts.
  for (int e = threadIdx.x; e <= E; e += blockDim.x) {
    uint32_t below = 0, same = 0;
#pragma unroll 8
    for (int k = 0; k < top_k; ++k) {
      const uint32_t id = pk_id[k];
      below += id < (uint32_t)e;
      same += id == (uint32_t)e;
    }
    offsets[e] = below;
    if (e < E) meta[top_k + e] = same;
  }
  const int k = threadIdx.x;
  if (k >= 32) return;
  // Warp 0: lane j holds pick j; each lane learns whether its pick is its expert's first.
  const int lane = k;
  const uint32_t mine = lane < top_k ? pk_id[lane] : 0xffffffffu;
  uint32_t dup_before = 0;  // a lower lane holds the same expert
  for (int j = 0; j < top_k; ++j) {
    const uint32_t o = __shfl_sync(0xffffffffu, mine, j);
    dup_before |= (j < lane) & (o == mine);
  }
  const uint32_t firsts = __ballot_sync(0xffffffffu, lane < top_k && !dup_before);
  if (k >= top_k) return;
  const uint32_t id = mine;
  const float w = pk_w[k];
  uint32_t below = 0, before = 0, distinct_below = 0;
  const uint32_t first = !dup_before, distinct = __popc(firsts);
#pragma unroll 8
  for (int j = 0; j < top_k; ++j) {
    const uint32_t o = pk_id[j];
    below += o < id;
    before += j < k && o == id;
    distinct_below += ((firsts >> j) & 1u) && o < id;
  }
  const uint32_t pos = below + before;
  slots[pos] = (uint32_t)k;
  rows[pos] = 0;
  wsel[pos] = w;
  meta[k] = id;
  ids[k] = id;
  weights[k] = w;
  uint32_t* active = offsets + E + 1;
  if (first) active[1 + distinct_below] = id;
  if (k == 0) active[0] = distinct;
}

// One token's routing in one launch, for ungrouped routing over at most ROUTE_MAX_EXPERTS
// experts and top_k <= min(32, E): the router logits (f32 weights `router [E, d]` times the
// hidden row `x [d]`, two experts per block, E / 2 blocks), then the last block to finish makes
// moe_route_warp's picks and moe_lists' lists for the token's top_k pairs. Before, these
// were three launches (cuBLAS, moe_route_warp, moe_lists) of a few microseconds' work
// each. `ticket` counts finished blocks; the last block resets it to zero for the next
// launch (launches on the stream never overlap it: each waits for its predecessor).
// Block 256. `logits` holds E f32 of scratch. d % 4 == 0, 16-byte aligned router and x; the
// bias (if any) 4-byte aligned, E even unless it is f32.
extern "C" __global__ void __launch_bounds__(256)
    moe_route_one(const float* router, const float* x, int d, const void* bias, int bdt,
                  int has_bias, int E, int top_k, int renormalize, float scaling,
                  int weights_use_bias, float* logits, uint32_t* ids, float* weights,
                  uint32_t* offsets, uint32_t* slots, uint32_t* rows, float* wsel,
                  uint32_t* meta, uint32_t* ticket) {
  __shared__ int last;
  __shared__ float part[8];
  __shared__ float bias_sm[ROUTE_MAX_EXPERTS];
  __shared__ __align__(16) uint32_t bias_raw[ROUTE_MAX_EXPERTS];
  __shared__ uint32_t pk_id[32];
  __shared__ float pk_w[32];
  // Two experts per block, four warps each over a quarter of the row: one DRAM round trip
  // per lane (a warp per whole row took three, 18 us per launch under ncu). The first
  // ROUTE_PRE float4 of each lane's weights load before `pdl_wait` (weights never depend on
  // the previous kernel), overlapping its tail, and so does the correction bias, which
  // every block copies into shared memory (only the last block reads it, but which block
  // that is is known only at the end).
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int e = blockIdx.x * 2 + (warp >> 2), quarter = warp & 3;
  const int q = d / 4, per = (q + 3) / 4;
  const int lo = quarter * per, hi = e < E ? min(q, lo + per) : lo;
  const float4* w4 = reinterpret_cast<const float4*>(router + (size_t)min(e, E - 1) * d);
  const float4* x4 = reinterpret_cast<const float4*>(x);
  constexpr int ROUTE_PRE = 8;
  float4 pre[ROUTE_PRE];
#pragma unroll
  for (int j = 0; j < ROUTE_PRE; ++j) {
    const int c = lo + lane + 32 * j;
    if (c < hi) pre[j] = __ldg(w4 + c);
  }
  if (has_bias) bias_copy_async(bias, bdt, E, bias_raw);
  pdl_enter();
  float acc = 0.0f;
#pragma unroll
  for (int j = 0; j < ROUTE_PRE; ++j) {
    const int c = lo + lane + 32 * j;
    if (c < hi) {
      const float4 a = pre[j], b = x4[c];
      acc = fmaf(a.x, b.x, acc);
      acc = fmaf(a.y, b.y, acc);
      acc = fmaf(a.z, b.z, acc);
      acc = fmaf(a.w, b.w, acc);
    }
  }
  for (int c = lo + lane + 32 * ROUTE_PRE; c < hi; c += 32) {
    const float4 a = __ldg(w4 + c), b = x4[c];
    acc = fmaf(a.x, b.x, acc);
    acc = fmaf(a.y, b.y, acc);
    acc = fmaf(a.z, b.z, acc);
    acc = fmaf(a.w, b.w, acc);
  }
  acc = warp_sum(acc);
  if (lane == 0) part[warp] = acc;
  asm volatile("cp.async.wait_all;\n" ::: "memory");
  __syncthreads();
  if (threadIdx.x < 2 && blockIdx.x * 2 + threadIdx.x < E) {
    const float* pq = part + 4 * threadIdx.x;
    logits[blockIdx.x * 2 + threadIdx.x] = (pq[0] + pq[1]) + (pq[2] + pq[3]);
  }
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) last = atomicAdd(ticket, 1u) == gridDim.x - 1;
  __syncthreads();
  if (!last) return;
  __threadfence();
  if (has_bias) bias_convert(bias_raw, bdt, E, bias_sm);
  __syncthreads();
  // The picks by rank, every expert at once: expert e is pick k when k experts come before
  // it in (biased score descending, index ascending) order, which is the order of
  // route_token_warp's rounds of argmax (ties to the lower index). One warp's rounds were a
  // serial chain of ~3,500 instructions. `msk` reuses the raw bias words.
  float* msk = reinterpret_cast<float*>(bias_raw);
  float sc[2] = {0.0f, 0.0f}, chs[2] = {0.0f, 0.0f};
  const int E4 = (E + 3) & ~3;  // msk padded to float4s with -inf (never before a pick)
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int ex = threadIdx.x + i * 256;
    if (ex < E) {
      const float sg = sigmoidf_(__ldcg(logits + ex));
      sc[i] = sg;
      chs[i] = has_bias ? sg + bias_sm[ex] : sg;
      msk[ex] = chs[i];
    } else if (ex < E4) {
      msk[ex] = -INFINITY;
    }
  }
  if (threadIdx.x < 32) {  // every slot is written even if ranks collide (NaN scores)
    pk_id[threadIdx.x] = 0;
    pk_w[threadIdx.x] = 0.0f;
  }
  __syncthreads();
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int ex = threadIdx.x + i * 256;
    if (ex < E) {
      // Experts before ex: v > ch, or v == ch at a lower index. float4 reads, 16 values per
      // step, so the shared loads overlap (a scalar loop waited for each).
      const float ch = chs[i];
      const float4* m4 = reinterpret_cast<const float4*>(msk);
      int rank = 0;
#pragma unroll 4
      for (int j4 = 0; j4 < E4 / 4; ++j4) {
        const float4 v = m4[j4];
        const int j = 4 * j4;
        rank += (v.x > ch) | ((v.x == ch) & (j < ex));
        rank += (v.y > ch) | ((v.y == ch) & (j + 1 < ex));
        rank += (v.z > ch) | ((v.z == ch) & (j + 2 < ex));
        rank += (v.w > ch) | ((v.w == ch) & (j + 3 < ex));
      }
      if (rank < top_k) {
        pk_id[rank] = (uint32_t)ex;
        pk_w[rank] = weights_use_bias ? ch : sc[i];
      }
    }
  }
  __syncthreads();
  if (warp == 0) {
    // route_token_warp's weights: the sum in pick order, then renormalised and scaled.
    float wsum = 0.0f;
    for (int k = 0; k < top_k; ++k) wsum += pk_w[k];
    float w = lane < top_k ? pk_w[lane] : 0.0f;
    if (renormalize && top_k > 1) w /= (wsum + 1e-20f);
    __syncwarp();
    if (lane < top_k) pk_w[lane] = w * scaling;
  }
  __syncthreads();
  lists_one_token(pk_id, pk_w, top_k, E, ids, weights, offsets, slots, rows, wsel, meta);
  if (threadIdx.x == 0) *ticket = 0;
}

// moe_lists for many pairs, over several blocks: `moe_lists_count` adds each block's
// per-expert counts into `cnt[E]` (zeroed before), then every `moe_lists_place` block scans
// `cnt` itself (block 0 also writes `offsets`, the active list and meta's counts), reserves
// a range per expert for its own pairs with one global atomic per expert (`cursor[E]`,
// zeroed before) and places them. Pairs of one expert land in an arbitrary order, as in
// moe_lists. LISTS_CHUNK pairs per block; dynamic shared memory 2E u32.
#define LISTS_CHUNK 4096
// `cnt[e] +=` how many of this block's LISTS_CHUNK pairs (of P) chose e, counted in shared
// memory `sm` (E u32) first: one global atomic per expert and block.
__device__ __forceinline__ void count_chunk(const uint32_t* ids, int P, int E, uint32_t* sm,
                                            uint32_t* cnt) {
  for (int e = threadIdx.x; e < E; e += blockDim.x) sm[e] = 0;
  __syncthreads();
  const int p0 = blockIdx.x * LISTS_CHUNK, p1 = min(P, p0 + LISTS_CHUNK);
  count_pairs(ids, p0, p1, E, sm);
  __syncthreads();
  for (int e = threadIdx.x; e < E; e += blockDim.x)
    if (sm[e]) atomicAdd(cnt + e, sm[e]);
}

extern "C" __global__ void moe_lists_count(const uint32_t* ids, int P, int E, uint32_t* cnt) {
  pdl_enter();
  extern __shared__ uint32_t lc_sm[];
  count_chunk(ids, P, E, lc_sm, cnt);
}

// Every MoE layer's chosen experts counted in one launch (the metrics' `expert_counts`,
// read after each pass): grid (ceil(most pairs / LISTS_CHUNK), layers), block 1024, dynamic
// shared memory E u32; `cnt [layers][E]` zeroed before. A layer with fewer pairs leaves its
// surplus blocks idle.
#define COUNT_LAYERS 64
struct MoeCountLayers {
  const uint32_t* ids[COUNT_LAYERS];
  int n[COUNT_LAYERS];
};
extern "C" __global__ void moe_count_layers(const MoeCountLayers t, int E, uint32_t* cnt) {
  pdl_enter();
  extern __shared__ uint32_t cl_sm[];
  const int layer = blockIdx.y, P = t.n[layer];
  if ((int)blockIdx.x * LISTS_CHUNK >= P) return;  // the whole block: no barrier is skipped
  count_chunk(t.ids[layer], P, E, cl_sm, cnt + (size_t)layer * E);
}

extern "C" __global__ void moe_lists_place(const uint32_t* ids, const float* weights, int P,
                                           int E, int top_k, const uint32_t* cnt,
                                           uint32_t* cursor, uint32_t* offsets,
                                           uint32_t* slots, uint32_t* rows, float* wsel,
                                           uint32_t* meta) {
  pdl_enter();
  extern __shared__ uint32_t lp_sm[];
  uint32_t* start = lp_sm;      // [E] this expert's first slot for this block's pairs
  uint32_t* local = lp_sm + E;  // [E] this block's pairs per expert, then a cursor
  for (int e = threadIdx.x; e < E; e += blockDim.x) {
    start[e] = cnt[e];
    local[e] = 0;
  }
  __syncthreads();
  // Offsets into `start`, in place (each thread reads its count before writing its
  // offset); block 0 also writes them out.
  expert_offsets(start, start, blockIdx.x == 0 ? offsets : nullptr, E);
  if (blockIdx.x == 0)
    for (int e = threadIdx.x; e < E; e += blockDim.x) meta[P + e] = cnt[e];
  const int p0 = blockIdx.x * LISTS_CHUNK, p1 = min(P, p0 + LISTS_CHUNK);
  count_pairs(ids, p0, p1, E, local);
  __syncthreads();
  for (int e = threadIdx.x; e < E; e += blockDim.x)
    if (local[e]) start[e] += atomicAdd(cursor + e, local[e]);
  __syncthreads();
  place_pairs(ids, weights, p0, p1, E, top_k, start, slots, rows, wsel, meta);
}

__device__ __forceinline__ void bf16x8(const uint4& v, float* f) {
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    float2 t = __bfloat1622float2(h[i]);
    f[2 * i] = t.x;
    f[2 * i + 1] = t.y;
  }
}


// Expert GEMV over the pairs routed to one expert. Grid (ceil(rows_out/(16*rb)), min(P, E));
// block 256 = 8 warps, two output rows per warp, `rb` times over (more rows per CTA when
// many pairs fill the GPU anyway: fewer, longer CTAs stage the activations less often). Block (x, j) serves the j-th expert that
// received pairs (the active list after `offsets`; blocks past its length exit at once, so a
// batch that reaches few experts costs few blocks), for every pair p routed to it, tokens in
// groups of TG so that one pass over a weight row serves TG tokens. `wtab` holds per expert
// the three weight addresses (gate, up, down); `glu` = 1: out[p, j] = silu(gate_e[j]·x) *
// (up_e[j]·x) with x = in[p / top_k] (hidden rows); glu = 0: out[p, j] = down_e[j]·in[p]
// (intermediate rows). Weights of dtype `dt`; `vec` = 1 when dt is bf16 and cols % 8 == 0
// (16-byte loads). `stage` = 1: the group's TG activation rows are first copied to shared
// memory (TG * cols floats of dynamic shared memory), which the 8 warps then share instead
// of each reading them from L1/L2. f32 accumulation.
//
// The weight stream is what bounds this kernel (see kernels/gemv.cu): each lane issues eight
// 16-byte loads (two rows, and gate + up or four steps of down) before any arithmetic.
#define TG 4
#define EX_RW 2

// `split` = 1: the activation rows are staged in shared memory as two halves (float4 2c of
// the row first, then every float4 2c+1), so that a lane's two float4 of step c sit 16 bytes
// from its neighbours' (no bank conflicts); 0: plain rows.
template <bool GLU, bool SPLIT>
__device__ __forceinline__ void expert_rows_vec(const __nv_bfloat16* wa,
                                                const __nv_bfloat16* wb,
                                                const float* const (&xr)[TG], const float* xs,
                                                int ng, int cols, int row0, int rows_out,
                                                float (&aa)[EX_RW][TG],
                                                float (&ab)[EX_RW][TG]) {
  constexpr int U = GLU ? 2 : 4;
  const int lane = threadIdx.x & 31;
  const int nv = cols >> 3;
  const uint4* va[EX_RW];
  const uint4* vb[EX_RW];
#pragma unroll
  for (int r = 0; r < EX_RW; ++r) {
    const size_t roff = (size_t)min(row0 + r, rows_out - 1) * cols;
    va[r] = reinterpret_cast<const uint4*>(wa + roff);
    vb[r] = reinterpret_cast<const uint4*>(wb + roff);
  }
  for (int c0 = lane; c0 < nv; c0 += 32 * U) {
    uint4 la[EX_RW][U], lb[EX_RW][U];
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
      for (int r = 0; r < EX_RW; ++r)
        if (c0 + 32 * u < nv) {
          la[r][u] = __ldg(va[r] + c0 + 32 * u);
          if (GLU) lb[r][u] = __ldg(vb[r] + c0 + 32 * u);
        }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int c = c0 + 32 * u;
      if (c >= nv) break;
#pragma unroll
      for (int g = 0; g < TG; ++g) {
        if (g < ng) {
          const float4* x4 = reinterpret_cast<const float4*>(SPLIT ? xs + g * cols : xr[g]);
          const float4 x0 = SPLIT ? x4[c] : x4[2 * c];
          const float4 x1 = SPLIT ? x4[nv + c] : x4[2 * c + 1];
          const float xv[8] = {x0.x, x0.y, x0.z, x0.w, x1.x, x1.y, x1.z, x1.w};
#pragma unroll
          for (int r = 0; r < EX_RW; ++r) {
            float fa[8];
            bf16x8(la[r][u], fa);
#pragma unroll
            for (int i = 0; i < 8; ++i) aa[r][g] = fmaf(fa[i], xv[i], aa[r][g]);
            if (GLU) {
              float fb[8];
              bf16x8(lb[r][u], fb);
#pragma unroll
              for (int i = 0; i < 8; ++i) ab[r][g] = fmaf(fb[i], xv[i], ab[r][g]);
            }
          }
        }
      }
    }
  }
}

extern "C" __global__ void __launch_bounds__(256, 2)
    moe_expert_gemv(const uint64_t* wtab, int glu, const float* in, int top_k,
                    const uint32_t* offsets, int E, const uint32_t* slots, float* out,
                    int rows_out, int cols, int dt, int vec, int stage, int rb) {
  pdl_enter();
  extern __shared__ float4 xs_sm4[];
  float* xs_sm = reinterpret_cast<float*>(xs_sm4);
  const uint32_t* active = offsets + E + 1;
  if (blockIdx.y >= active[0]) return;
  const uint32_t e = active[1 + blockIdx.y];
  const uint32_t beg = offsets[e], end = offsets[e + 1];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const void* wa = reinterpret_cast<const void*>(wtab[3 * e + (glu ? 0 : 2)]);
  const void* wb = reinterpret_cast<const void*>(wtab[3 * e + 1]);
  for (uint32_t g0 = beg; g0 < end; g0 += TG) {
    const int ng = min((uint32_t)TG, end - g0);
    const float* xr[TG];
    uint32_t pr[TG];
#pragma unroll
    for (int g = 0; g < TG; ++g) {
      uint32_t p = slots[g0 + (g < ng ? g : 0)];
      pr[g] = p;
      xr[g] = in + (size_t)(glu ? p / top_k : p) * cols;
    }
    if (stage) {
      __syncthreads();  // the previous group's rows are no longer read
      const int c4 = cols >> 2;
      // With 16-byte weight loads (`vec`), in the split layout of expert_rows_vec.
      const int half = c4 >> 1;
      for (int i = threadIdx.x; i < ng * c4; i += blockDim.x) {
        const int g = i / c4, c = i - g * c4;
        const int at = vec ? (c & 1) * half + (c >> 1) : c;
        // The row from `slots`, not xr[g]: a runtime index would put xr in local memory.
        const uint32_t p = slots[g0 + g];
        const float* src = in + (size_t)(glu ? p / top_k : p) * cols;
        xs_sm4[g * c4 + at] = reinterpret_cast<const float4*>(src)[c];
      }
      __syncthreads();
#pragma unroll
      for (int g = 0; g < TG; ++g) xr[g] = xs_sm + (size_t)g * cols;
    }
    // `rb` row blocks of 16 per CTA: the staged activations serve them all. Warps past the
    // last row leave this loop but still take part in the next group's staging barriers.
    for (int rbi = 0; rbi < rb; ++rbi) {
    const int row0 = ((blockIdx.x * rb + rbi) * 8 + warp) * EX_RW;
    if (row0 >= rows_out) break;
    float aa[EX_RW][TG], ab[EX_RW][TG];
#pragma unroll
    for (int r = 0; r < EX_RW; ++r)
#pragma unroll
      for (int g = 0; g < TG; ++g) aa[r][g] = ab[r][g] = 0.0f;
    if (vec) {
      const __nv_bfloat16* ha = reinterpret_cast<const __nv_bfloat16*>(wa);
      const __nv_bfloat16* hb = reinterpret_cast<const __nv_bfloat16*>(wb);
      if (glu && stage)
        expert_rows_vec<true, true>(ha, hb, xr, xs_sm, ng, cols, row0, rows_out, aa, ab);
      else if (glu)
        expert_rows_vec<true, false>(ha, hb, xr, xs_sm, ng, cols, row0, rows_out, aa, ab);
      else if (stage)
        expert_rows_vec<false, true>(ha, hb, xr, xs_sm, ng, cols, row0, rows_out, aa, ab);
      else
        expert_rows_vec<false, false>(ha, hb, xr, xs_sm, ng, cols, row0, rows_out, aa, ab);
    } else {
#pragma unroll
      for (int r = 0; r < EX_RW; ++r) {
        const size_t roff = (size_t)min(row0 + r, rows_out - 1) * cols;
        for (int c = lane; c < cols; c += 32) {
          float fa = ld(wa, roff + c, dt);
          float fb = glu ? ld(wb, roff + c, dt) : 0.0f;
#pragma unroll
          for (int g = 0; g < TG; ++g) {
            if (g < ng) {
              float xv = xr[g][c];
              aa[r][g] = fmaf(fa, xv, aa[r][g]);
              ab[r][g] = fmaf(fb, xv, ab[r][g]);
            }
          }
        }
      }
    }
#pragma unroll
    for (int r = 0; r < EX_RW; ++r) {
#pragma unroll
      for (int g = 0; g < TG; ++g) {
        float a = warp_sum(aa[r][g]);
        float b = warp_sum(ab[r][g]);
        if (lane == 0 && g < ng && row0 + r < rows_out) {
          float v = glu ? (a / (1.0f + expf(-a))) * b : a;
          out[(size_t)pr[g] * rows_out + row0 + r] = v;
        }
      }
    }
    }
  }
}

// out[t, i] (+)= sum_k weights[t*K + k] * y[row(t*K + k), i], row(p) = p (pair order) or,
// with `inv`, inv[p] (rows in sorted pair order, `moe_gather_bf16`): each output element
// owned by one thread, no atomics. `accumulate` = 0 overwrites `out`. A pair of weight 0
// adds nothing and its row is not read: an absent expert's pair (moe_mask_absent) has none.
extern "C" __global__ void moe_combine(const float* y, const uint32_t* inv, const float* weights,
                                       float* out, int n, int d, int top_k, int accumulate) {
  pdl_enter();
  size_t total = (size_t)n * d;
  for (size_t idx = blockIdx.x * (size_t)blockDim.x + threadIdx.x; idx < total;
       idx += (size_t)gridDim.x * blockDim.x) {
    size_t t = idx / d, i = idx % d;
    float acc = 0.0f;
    for (int k = 0; k < top_k; ++k) {
      const size_t pair = t * top_k + k;
      const float w = weights[pair];
      if (w == 0.0f) continue;
      const size_t row = inv ? inv[pair] : pair;
      acc += w * y[row * d + i];
    }
    out[idx] = accumulate ? out[idx] + acc : acc;
  }
}

// ---------------------------------------------------------------------------------------------
// Around the CUTLASS grouped GEMM (`cutlass/moe_grouped.cu`), which reads and writes pair
// rows in sorted order (expert e's pairs at offsets[e] .. offsets[e+1]).

// out[pos] = bf16(x[rows[pos]]) for every sorted pair (and, with `split`, the lo terms
// x - hi at out[P + pos]); inv[slots[pos]] = pos for `moe_combine`. Positions from
// offsets[E] (the pairs moe_lists placed; fewer than P when some went to NO_EXPERT) on are
// left alone. One thread per 8 columns; `d` % 8 == 0.
extern "C" __global__ void moe_gather_bf16(const float* x, const uint32_t* rows,
                                           const uint32_t* slots, const uint32_t* offsets,
                                           int E, __nv_bfloat16* out, uint32_t* inv, int P,
                                           int d, int split) {
  pdl_enter();
  const int per_row = d >> 3;
  const size_t total = (size_t)P * per_row;
  const size_t placed = offsets[E];
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < total;
       i += (size_t)gridDim.x * blockDim.x) {
    const size_t pos = i / per_row;
    if (pos >= placed) continue;
    const int c = (int)(i % per_row) * 8;
    if (c == 0) inv[slots[pos]] = (uint32_t)pos;
    const float4* src = reinterpret_cast<const float4*>(x + (size_t)rows[pos] * d + c);
    const float4 a = src[0], b = src[1];
    const float v[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
    __align__(16) __nv_bfloat16 hi[8], lo[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      hi[j] = __float2bfloat16(v[j]);
      lo[j] = __float2bfloat16(v[j] - __bfloat162float(hi[j]));
    }
    *reinterpret_cast<uint4*>(out + pos * d + c) = *reinterpret_cast<const uint4*>(hi);
    if (split)
      *reinterpret_cast<uint4*>(out + ((size_t)P + pos) * d + c) =
          *reinterpret_cast<const uint4*>(lo);
  }
}

// h[p, j] = silu(gu[p, j]) * gu[p, I + j] as bf16 (hi, and with `split` the lo terms at
// h[P + p]); gu is f32 (`gu_f32`) or bf16 rows of 2I. Grid (ceil(I / (8 * 256)), pair
// blocks): each thread takes 8 columns of a row, 16-byte accesses where I % 8 == 0.
__device__ __forceinline__ float silu_times(float a, float b) { return (a / (1.0f + expf(-a))) * b; }
extern "C" __global__ void moe_silu_mul_bf16(const void* gu, int gu_f32, __nv_bfloat16* h,
                                             int P, int I, int split) {
  pdl_enter();
  const int c = (blockIdx.x * blockDim.x + threadIdx.x) * 8;
  if (c >= I) return;
  const bool vec = (I & 7) == 0;
  for (int p = blockIdx.y; p < P; p += gridDim.y) {
    const size_t g = (size_t)p * 2 * I + c;
    float a[8], b[8];
    if (vec && gu_f32) {
      const float4* ga = reinterpret_cast<const float4*>(static_cast<const float*>(gu) + g);
      const float4* gb = reinterpret_cast<const float4*>(static_cast<const float*>(gu) + g + I);
      const float4 a0 = ga[0], a1 = ga[1], b0 = gb[0], b1 = gb[1];
      const float av[8] = {a0.x, a0.y, a0.z, a0.w, a1.x, a1.y, a1.z, a1.w};
      const float bv[8] = {b0.x, b0.y, b0.z, b0.w, b1.x, b1.y, b1.z, b1.w};
#pragma unroll
      for (int j = 0; j < 8; ++j) { a[j] = av[j]; b[j] = bv[j]; }
    } else if (vec) {
      const __nv_bfloat16* gh = static_cast<const __nv_bfloat16*>(gu);
      const uint4 ua = *reinterpret_cast<const uint4*>(gh + g);
      const uint4 ub = *reinterpret_cast<const uint4*>(gh + g + I);
      bf16x8(ua, a);
      bf16x8(ub, b);
    } else {
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const bool in = c + j < I;
        if (gu_f32) {
          a[j] = in ? static_cast<const float*>(gu)[g + j] : 0.0f;
          b[j] = in ? static_cast<const float*>(gu)[g + I + j] : 0.0f;
        } else {
          a[j] = in ? __bfloat162float(static_cast<const __nv_bfloat16*>(gu)[g + j]) : 0.0f;
          b[j] = in ? __bfloat162float(static_cast<const __nv_bfloat16*>(gu)[g + I + j]) : 0.0f;
        }
      }
    }
    __align__(16) __nv_bfloat16 hi[8], lo[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const float v = silu_times(a[j], b[j]);
      hi[j] = __float2bfloat16(v);
      lo[j] = __float2bfloat16(v - __bfloat162float(hi[j]));
    }
    const size_t o = (size_t)p * I + c;
    if (vec) {
      *reinterpret_cast<uint4*>(h + o) = *reinterpret_cast<const uint4*>(hi);
      if (split) *reinterpret_cast<uint4*>(h + (size_t)P * I + o) = *reinterpret_cast<const uint4*>(lo);
    } else {
      for (int j = 0; j < 8 && c + j < I; ++j) {
        h[o + j] = hi[j];
        if (split) h[(size_t)P * I + o + j] = lo[j];
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Expert GEMVs of one token, streamed (see stream.cuh): persistent CTAs walk the tiles of
// every expert the token chose, and of the shared expert, in one launch.
//
// Slots: with `shared` = 1, slot 0 is the shared expert (table entry E: gate, up, down);
// then the active experts (the list after `offsets`, from `moe_lists`). A slot has
// ceil(rows_out / rows) tiles; a tile holds `rows` rows of the expert's weight (glu: its
// `rows` gate rows, then the same up rows, 2 * rows weight rows in all).
// glu = 1: out[q, j] = silu(gate_e[j]·x) * (up_e[j]·x) with x = in[0], the token; glu = 0:
// out[q, j] = down_e[j]·in[q], q the expert's pair. The shared expert's row is q = p (after
// the p = top_k pair rows). The input rows (1 for glu, p + shared for down) are staged in
// shared memory when `stage_in`, else read from global memory.
// The shared expert's tiles come first, so the producer may queue them before `pdl_wait`:
// its weights, unlike the routed experts' choice, do not depend on the previous kernel.
//
// grid = one CTA per SM, block STREAM_THREADS, dynamic smem stages * tile bytes (+ the
// staged rows). bf16 weights, cols % (256 * slices) == 0, 16-byte aligned weights and `in`.
#include "stream.cuh"

// Per slot, looked up once per CTA (by the producer warp's lanes) instead of per tile: the
// weight rows the tiles come from (gate or down, and up) and the output / input row q.
struct MoeStreamSlots {
  const uint8_t* a[MOE_STREAM_MAX_SLOTS];
  const uint8_t* b[MOE_STREAM_MAX_SLOTS];
  int q[MOE_STREAM_MAX_SLOTS];
};

// `route_ready` = 1 says the routing (`offsets`, `slots`) is final before `pdl_wait`: true
// for the down pass, launched right after the gate/up pass on the same stream. Every CTA of
// that pass executes `pdl_wait` (its predecessor, the routing, has completed and its writes
// are visible) before `pdl_launch`, and this launch starts only once all of them have; so
// the routing may be read, and every routed tile queued, while the gate/up pass drains.
// Its output (`in` here) is still read after `pdl_wait` only.
extern "C" __global__ void __launch_bounds__(STREAM_THREADS, 1)
    moe_stream_1(const uint64_t* wtab, int glu, const float* in, int top_k,
                 const uint32_t* offsets, int E, const uint32_t* slots, float* out,
                 int rows_out, int cols, int rows, int stages, int shared, int stage_in,
                 int route_ready) {
  extern __shared__ __align__(128) uint8_t stream_buf[];
  __shared__ StreamSmem s;
  __shared__ MoeStreamSlots sl;
  const int p = top_k;
  const uint32_t row_bytes = (uint32_t)cols * 2u;
  const int wrows = glu ? 2 * rows : rows;
  const uint32_t tile_bytes = row_bytes * (uint32_t)wrows;
  const int tps = (rows_out + rows - 1) / rows;
  const int nv = cols >> 3;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const bool producer = warp == STREAM_CONSUMERS;
  float* xs = reinterpret_cast<float*>(stream_buf + (size_t)stages * tile_bytes);
  // Producer lanes: fill slots [j0, j1) of the table, then sync the warp.
  auto fill = [&](int j0, int j1) {
    for (int j = j0 + lane; j < j1; j += 32) {
      uint32_t pair;
      const int ex = moe_stream_expert(offsets, E, shared, j, pair);
      sl.a[j] = reinterpret_cast<const uint8_t*>(wtab[3 * ex + (glu ? 0 : 2)]);
      sl.b[j] = glu ? reinterpret_cast<const uint8_t*>(wtab[3 * ex + 1]) : nullptr;
      sl.q[j] = pair == 0xffffffffu ? p : (int)slots[pair];
    }
    __syncwarp();
  };
  // Producer lane 0: queue tile t (slot t / tps) into `stage`.
  auto fetch = [&](int t, int stage) {
    const int j = t / tps;
    const int r0 = (t % tps) * rows, nr = min(rows, rows_out - r0);
    const size_t off = (size_t)r0 * row_bytes;
    uint8_t* dst = stream_buf + (size_t)stage * tile_bytes;
    stream_fetch(s, dst, stage, sl.a[j] + off, row_bytes * nr, glu ? sl.b[j] + off : nullptr,
                 glu ? row_bytes * nr : 0);
  };
  // The staged input rows arrive by one bulk copy, completing on `xbar`.
  __shared__ __align__(8) uint64_t xbar;
  const uint32_t x_bytes = (uint32_t)((glu ? 1 : p + shared) * cols * 4);
  if (threadIdx.x == 0) stream_bar_init(smem_addr(&xbar), 1);
  stream_init(s, stages);
  int queued = 0, filled = 0;
  // The shared expert's tiles (and, when the routing is ready, every tile) before the wait.
  int tiles = shared * tps;
  auto queue = [&]() {
    if (lane == 0)
      for (; queued < stages; ++queued) {
        const int t = blockIdx.x + queued * gridDim.x;
        if (t >= tiles) break;
        fetch(t, queued);
      }
  };
  if (producer) {
    filled = shared;
    fill(0, filled);
    queue();
    if (route_ready) {
      filled = shared + (int)offsets[E + 1];
      tiles = filled * tps;
      fill(shared, filled);
      queue();
    }
  }
  // The consumers read the table for the down pass's input rows (glu: never).
  if (!glu && route_ready) __syncthreads();
  pdl_enter();
  tiles = (shared + (int)offsets[E + 1]) * tps;
  if (producer) {
    if (lane == 0 && stage_in) {
      bar_expect(smem_addr(&xbar), x_bytes);
      bulk_copy(smem_addr(xs), in, x_bytes, smem_addr(&xbar));
    }
    fill(filled, tiles / tps);
    queue();
  }
  if (!glu && !route_ready) __syncthreads();
  const float* src = in;
  if (stage_in) {
    if (!producer) bar_wait(smem_addr(&xbar), 0);
    src = xs;
  }
  if (producer) {
    const int slices = stream_cover(wrows, 0).slices;
    for (int i = 0;; ++i) {
      const int t = blockIdx.x + i * gridDim.x;
      if (t >= tiles) break;
      const int stage = i % stages;
      const int q = sl.q[t / tps];
      const int r0 = (t % tps) * rows, nr = min(rows, rows_out - r0);
      bar_wait(smem_addr(&s.empty[stage]), (i / stages) & 1);
      if (lane < nr) {
        float v = stream_row_sum(s, stage, lane, slices);
        if (glu) {
          const float u = stream_row_sum(s, stage, nr + lane, slices);
          v = (v / (1.0f + expf(-v))) * u;
        }
        out[(size_t)q * rows_out + r0 + lane] = v;
      }
      __syncwarp();
      if (lane == 0 && t + stages * (int)gridDim.x < tiles) fetch(t + stages * gridDim.x, stage);
    }
    return;
  }
  const StreamCover cov = stream_cover(wrows, warp);
  for (int i = 0;; ++i) {
    const int t = blockIdx.x + i * gridDim.x;
    if (t >= tiles) break;
    const int stage = i % stages;
    const int r0 = (t % tps) * rows, nr = min(rows, rows_out - r0);
    const float* x = glu ? src : src + (size_t)sl.q[t / tps] * cols;
    bar_wait(smem_addr(&s.full[stage]), (i / stages) & 1);
    const uint8_t* tile = stream_buf + (size_t)stage * tile_bytes;
    for (int r = cov.first; r < (glu ? 2 * nr : nr); r += cov.step)
      stream_row_dot(s, stage, tile, r, nv, cov.slice, cov.slices, x);
    __syncwarp();
    if (lane == 0) stream_bar_arrive(smem_addr(&s.empty[stage]));
  }
}

// ---------------------------------------------------------------------------------------------
// A one-token MoE layer's experts in one persistent launch: the gate/up tiles of every slot
// (as `moe_stream_1` with glu = 1, writing the SwiGLU rows `h`), then the down tiles (glu = 0,
// reading `h`, writing `y`), walked as one tile sequence. Two launches left each CTA's
// pipeline to ramp up and drain twice, and the down pass's ~10 tiles per CTA never reached
// full speed; here a CTA's producer queues down tiles into the stages its last gate/up tiles
// free, so the weight stream runs on across the handoff.
//
// The handoff is grid-wide: a down row needs its pair's whole SwiGLU row, written by every
// CTA. Each producer, once it has written its last gate/up outputs, fences and counts itself
// in `sync[0]`; the consumers, before their first down tile, wait for all `gridDim.x`
// arrivals and stage every `h` row in shared memory (where the token's row was). The weight
// stages keep filling while they wait. This needs every CTA resident at once: one CTA per SM,
// grid <= SMs (the launcher's plan), and no CTA waits on one that has not been scheduled (the
// successor launches only after all of ours ran `pdl_launch`). `sync[1]` counts the CTAs past
// the wait; the last one zeroes both, so they are zero between launches.
//
// Tiles: slot j's gate/up tile holds `rows_gu` gate rows then the same up rows, its down tile
// `rows_dn` down rows; every stage is `stage_bytes` (the larger tile). Dynamic smem: stages *
// stage_bytes, then max(d, (top_k + shared) * inter) f32.
extern "C" __global__ void __launch_bounds__(STREAM_THREADS, 1)
    moe_stream_layer(const uint64_t* wtab, const float* x, int top_k, const uint32_t* offsets,
                     int E, const uint32_t* slots, float* h, float* y, int d, int inter,
                     int rows_gu, int rows_dn, int stages, int stage_bytes, int shared,
                     uint32_t* sync) {
  extern __shared__ __align__(128) uint8_t stream_buf[];
  __shared__ StreamSmem s;
  __shared__ MoeLayerSlots sl;
  __shared__ __align__(8) uint64_t xbar;
  const int p = top_k;
  const uint32_t gu_row = (uint32_t)d * 2u, dn_row = (uint32_t)inter * 2u;
  const int tps0 = (inter + rows_gu - 1) / rows_gu, tps1 = (d + rows_dn - 1) / rows_dn;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const bool producer = warp == STREAM_CONSUMERS;
  float* xs = reinterpret_cast<float*>(stream_buf + (size_t)stages * stage_bytes);
  auto fill = [&](int j0, int j1) {
    for (int j = j0 + lane; j < j1; j += 32) {
      uint32_t pair;
      const int ex = moe_stream_expert(offsets, E, shared, j, pair);
      sl.gate[j] = reinterpret_cast<const uint8_t*>(wtab[3 * ex]);
      sl.up[j] = reinterpret_cast<const uint8_t*>(wtab[3 * ex + 1]);
      sl.down[j] = reinterpret_cast<const uint8_t*>(wtab[3 * ex + 2]);
      sl.q[j] = pair == 0xffffffffu ? p : (int)slots[pair];
    }
    __syncwarp();
  };
  // Gate/up tiles [0, t0), down tiles [t0, total); before the wait only the shared expert's
  // gate/up tiles are known (t0 = INT_MAX keeps every tile below `limit` a gate/up tile).
  int t0 = 0x7fffffff, total = 0, limit = shared * tps0;
  auto fetch = [&](int u, int stage) {
    uint8_t* dst = stream_buf + (size_t)stage * stage_bytes;
    if (u < t0) {
      const int j = u / tps0, r0 = (u % tps0) * rows_gu, nr = min(rows_gu, inter - r0);
      const size_t off = (size_t)r0 * gu_row;
      stream_fetch(s, dst, stage, sl.gate[j] + off, gu_row * nr, sl.up[j] + off, gu_row * nr);
    } else {
      const int v = u - t0, j = v / tps1, r0 = (v % tps1) * rows_dn;
      const int nr = min(rows_dn, d - r0);
      stream_fetch(s, dst, stage, sl.down[j] + (size_t)r0 * dn_row, dn_row * nr, nullptr, 0);
    }
  };
  int queued = 0;
  auto queue = [&]() {
    if (lane == 0)
      for (; queued < stages; ++queued) {
        const int u = blockIdx.x + queued * gridDim.x;
        if (u >= limit) break;
        fetch(u, queued);
      }
  };
  if (threadIdx.x == 0) stream_bar_init(smem_addr(&xbar), 1);
  stream_init(s, stages);
  if (producer) {
    fill(0, shared);
    queue();
  }
  pdl_enter();
  const int nsl = shared + (int)offsets[E + 1];
  t0 = nsl * tps0;
  total = t0 + nsl * tps1;
  if (producer) {
    if (lane == 0) {
      bar_expect(smem_addr(&xbar), (uint32_t)d * 4u);
      bulk_copy(smem_addr(xs), x, (uint32_t)d * 4u, smem_addr(&xbar));
    }
    fill(shared, nsl);
    limit = total;
    queue();
  }
  __syncthreads();  // the slot table, for the consumers' down tiles
  if (producer) {
    const int sl0 = stream_cover(2 * rows_gu, 0).slices, sl1 = stream_cover(rows_dn, 0).slices;
    bool counted = false;
    auto count_in = [&]() {
      layer_count_in(sync, lane);
      counted = true;
    };
    for (int i = 0;; ++i) {
      const int u = blockIdx.x + i * gridDim.x;
      if (u >= total) break;
      if (u >= t0 && !counted) count_in();
      const int stage = i % stages;
      bar_wait(smem_addr(&s.empty[stage]), (i / stages) & 1);
      if (u < t0) {
        const int j = u / tps0, r0 = (u % tps0) * rows_gu, nr = min(rows_gu, inter - r0);
        if (lane < nr) {
          const float g = stream_row_sum(s, stage, lane, sl0);
          const float up = stream_row_sum(s, stage, nr + lane, sl0);
          h[(size_t)sl.q[j] * inter + r0 + lane] = (g / (1.0f + expf(-g))) * up;
        }
      } else {
        const int v = u - t0, j = v / tps1, r0 = (v % tps1) * rows_dn;
        const int nr = min(rows_dn, d - r0);
        if (lane < nr) y[(size_t)sl.q[j] * d + r0 + lane] = stream_row_sum(s, stage, lane, sl1);
      }
      __syncwarp();
      if (lane == 0 && u + stages * (int)gridDim.x < total) fetch(u + stages * gridDim.x, stage);
    }
    if (!counted) count_in();
    return;
  }
  bar_wait(smem_addr(&xbar), 0);
  const StreamCover c0 = stream_cover(2 * rows_gu, warp), c1 = stream_cover(rows_dn, warp);
  int i = 0;
  for (;; ++i) {
    const int u = blockIdx.x + i * gridDim.x;
    if (u >= t0) break;
    const int stage = i % stages;
    const int r0 = (u % tps0) * rows_gu, nr = min(rows_gu, inter - r0);
    bar_wait(smem_addr(&s.full[stage]), (i / stages) & 1);
    const uint8_t* tile = stream_buf + (size_t)stage * stage_bytes;
    for (int r = c0.first; r < 2 * nr; r += c0.step)
      stream_row_dot(s, stage, tile, r, d >> 3, c0.slice, c0.slices, xs);
    __syncwarp();
    if (lane == 0) stream_bar_arrive(smem_addr(&s.empty[stage]));
  }
  // The handoff: every CTA's SwiGLU rows are written; stage them where x was.
  layer_handoff(sync, xs, h, (p + shared) * inter);
  for (;; ++i) {
    const int u = blockIdx.x + i * gridDim.x;
    if (u >= total) break;
    const int stage = i % stages;
    const int v = u - t0, j = v / tps1, r0 = (v % tps1) * rows_dn;
    const int nr = min(rows_dn, d - r0);
    bar_wait(smem_addr(&s.full[stage]), (i / stages) & 1);
    const uint8_t* tile = stream_buf + (size_t)stage * stage_bytes;
    const float* xr = xs + (size_t)sl.q[j] * inter;
    for (int r = c1.first; r < nr; r += c1.step)
      stream_row_dot(s, stage, tile, r, inter >> 3, c1.slice, c1.slices, xr);
    __syncwarp();
    if (lane == 0) stream_bar_arrive(smem_addr(&s.empty[stage]));
  }
}
