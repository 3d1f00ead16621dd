// Token sampling on the device: penalties, temperature, top-k, top-p, min-p and one draw per
// logits row, so that only token ids travel back to the host (a 64-row step of a
// 163,840-token vocabulary would otherwise copy 42 MB of logits).
//
// Semantics are `kimi_ops::sample_row` (the host reference): penalties, then NaN → -inf and
// +inf → the largest finite value; temperature 0 takes the argmax; otherwise weights
// exp((logit − max) / T) over the finite logits, top-k (ties by lowest id), top-p (the
// smallest best-first set whose weight reaches top_p of the total, ties by lowest id),
// min-p (weight ≥ min_p), and a draw in id order with the host's uniform number.
//
// Thresholds come from radix selection over an order-preserving u32 key of each logit
// (4 passes of 8 bits). Weights are summed as 2^-40 fixed-point integers, so every sum is
// exact and independent of the order the threads add in: the same logits and the same
// uniform always give the same token.
#include "common.cuh"

struct RowSampling {
  float temperature;
  unsigned top_k;
  float top_p;
  float min_p;
  float repetition;
  float frequency;
  float presence;
  float uniform;
};

struct TokenPenalty {
  unsigned row, token, count;
};

// Penalties of every listed (row, token), in place: repetition (the token is in the prompt
// or the output), then frequency and presence (it is in the output `count` times).
extern "C" __global__ void apply_penalties(float* logits, int vocab, const RowSampling* params,
                                           const TokenPenalty* pens, int n) {
  pdl_enter();
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const TokenPenalty e = pens[i];
  if (e.token >= (unsigned)vocab) return;
  const RowSampling p = params[e.row];
  float* x = logits + (size_t)e.row * vocab + e.token;
  float l = *x;
  if (p.repetition != 1.0f) l = l > 0.0f ? l / p.repetition : l * p.repetition;
  if (e.count > 0) l -= (float)e.count * p.frequency + p.presence;
  *x = l;
}

namespace sampling {

constexpr int NT = 1024, NW = NT / 32;
constexpr unsigned BINS = 256;
typedef unsigned long long u64;

__device__ __forceinline__ float sanitise(float x) {
  if (x != x) return -INFINITY;
  if (x == 0.0f) return 0.0f;  // -0 and +0 are one value, as in the host's comparisons
  return fminf(x, 3.402823466e38f);
}

// Larger float, larger key (for sanitised values: no NaN, one zero).
__device__ __forceinline__ unsigned key_of(float x) {
  const unsigned b = __float_as_uint(x);
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

__device__ __forceinline__ float value_of(unsigned k) {
  return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}

// A weight in [0, 1] as an integer multiple of 2^-40 (sums of 2^23 of them fit in 63 bits).
__device__ __forceinline__ u64 fixed(float w) { return __float2ull_rn(w * 1099511627776.0f); }

struct Shared {
  u64 hist[NW][BINS];  // per-warp histograms of one radix pass
  u64 warp[NW][2];     // per-warp partial sums / scans
  u64 bcast[4];
  float fbest;
  unsigned ibest;
};

// Sum over the block of two values; every thread gets the totals.
__device__ __forceinline__ void block_sum2(Shared& s, u64& a, u64& b) {
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    a += __shfl_xor_sync(0xffffffffu, a, o);
    b += __shfl_xor_sync(0xffffffffu, b, o);
  }
  __syncthreads();
  if (lane == 0) s.warp[w][0] = a, s.warp[w][1] = b;
  __syncthreads();
  a = 0, b = 0;
  for (int i = 0; i < NW; ++i) a += s.warp[i][0], b += s.warp[i][1];
}

// Exclusive prefix over warps (in warp order) of two per-warp values (the same in every
// lane of a warp); also returns the totals.
__device__ __forceinline__ void warp_prefix2(Shared& s, u64& a, u64& b, u64& ta, u64& tb) {
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
  __syncthreads();
  if (lane == 0) s.warp[w][0] = a, s.warp[w][1] = b;
  __syncthreads();
  u64 pa = 0, pb = 0;
  ta = 0, tb = 0;
  for (int i = 0; i < NW; ++i) {
    if (i < w) pa += s.warp[i][0], pb += s.warp[i][1];
    ta += s.warp[i][0], tb += s.warp[i][1];
  }
  a = pa, b = pb;
}

// The radix selection: the key K with amount(key > K) < target <= amount(key >= K), where
// a token's amount is `count ? 1 : fixed(weight)`, over the finite tokens with key > floor,
// plus `extra` tokens of key `floor_key` (amount `extra_amount` in all) when `extra` > 0.
// Returns K and writes amount(key > K) to `above`.
__device__ unsigned select_key(Shared& s, const float* x, int vocab, float max, float inv_t,
                               bool count, unsigned floor, bool use_floor, unsigned floor_key,
                               u64 extra_amount, u64 target, u64& above) {
  const int tid = threadIdx.x, w = tid >> 5;
  unsigned prefix = 0, mask = 0;
  above = 0;
  for (int shift = 24; shift >= 0; shift -= 8) {
    for (int i = tid; i < NW * BINS; i += NT) (&s.hist[0][0])[i] = 0;
    __syncthreads();
    // Lanes with the same bin add once (most logits share the top bytes of their keys, and
    // one shared-memory atomic per token serialises on those few bins).
    for (int base = 0; base < vocab; base += NT) {
      const int j = base + tid;
      unsigned bin = BINS;  // none
      u64 a = 0;
      if (j < vocab) {
        const float v = sanitise(x[j]);
        const unsigned k = key_of(v);
        if (v != -INFINITY && (k & mask) == prefix && !(use_floor && k <= floor)) {
          bin = (k >> shift) & 255u;
          a = count ? 1ull : fixed(expf((v - max) * inv_t));
        }
      }
      // After the first pass few tokens match the prefix: most warps skip the match.
      if (!__any_sync(0xffffffffu, bin < BINS)) continue;
      const unsigned group = __match_any_sync(0xffffffffu, bin);
      if (bin < BINS) {
        u64 sum = __popc(group);
        if (!count) {
          // Weights are < 2^41: two 20-bit halves, each summed over <= 32 lanes in 32 bits.
          const unsigned hi = __reduce_add_sync(group, (unsigned)(a >> 20));
          const unsigned lo = __reduce_add_sync(group, (unsigned)(a & 0xfffffu));
          sum = ((u64)hi << 20) + lo;
        }
        if ((threadIdx.x & 31) == __ffs(group) - 1) atomicAdd(&s.hist[w][bin], sum);
      }
    }
    __syncthreads();
    // The digit: the largest d with above + amount(digit >= d) >= target. Thread t holds
    // bin d = 255 - t, so an inclusive scan in thread order sums the bins from the top.
    if (tid < (int)BINS) {
      const unsigned d = BINS - 1 - tid;
      u64 t = 0;
      for (int i = 0; i < NW; ++i) t += s.hist[i][d];
      if (extra_amount > 0 && (floor_key & mask) == prefix && ((floor_key >> shift) & 255u) == d)
        t += extra_amount;
      u64 inc = t;
#pragma unroll
      for (int o = 1; o < 32; o <<= 1) {
        const u64 y = __shfl_up_sync(0xffffffffu, inc, o);
        if ((tid & 31) >= o) inc += y;
      }
      if ((tid & 31) == 31) s.warp[w][0] = inc;
      asm volatile("bar.sync 1, %0;" ::"r"(BINS));  // the 8 warps holding bins only
      for (int i = 0; i < w; ++i) inc += s.warp[i][0];
      const u64 exc = inc - t;
      // Exactly one bin: the first to reach the target, or bin 0 if none does (rounding).
      if (above + exc < target && (above + inc >= target || d == 0)) {
        s.bcast[0] = above + exc;
        s.bcast[1] = (u64)d;
      }
    }
    __syncthreads();
    above = s.bcast[0];
    prefix |= (unsigned)s.bcast[1] << shift;
    mask |= 255u << shift;
    __syncthreads();
  }
  return prefix;
}

}  // namespace sampling

// One block of 1024 threads per row of `logits [rows, vocab]`; writes `out[row]`.
extern "C" __global__ void __launch_bounds__(1024) sample_rows(const float* logits, int vocab,
                                                               const RowSampling* params,
                                                               unsigned* out) {
  using namespace sampling;
  pdl_enter();
  extern __shared__ __align__(16) unsigned char smem_raw[];
  Shared& s = *reinterpret_cast<Shared*>(smem_raw);
  const int tid = threadIdx.x, lane = tid & 31, w = tid >> 5;
  const float* x = logits + (size_t)blockIdx.x * vocab;
  const RowSampling p = params[blockIdx.x];

  // The best finite logit (lowest id on ties) and how many logits are finite.
  float bv = -INFINITY;
  unsigned bi = 0;
  u64 finite = 0, zero = 0;
  for (int j = tid; j < vocab; j += NT) {
    const float v = sanitise(x[j]);
    if (v == -INFINITY) continue;
    ++finite;
    if (v > bv) bv = v, bi = (unsigned)j;
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
    const unsigned oi = __shfl_xor_sync(0xffffffffu, bi, o);
    if (ov > bv || (ov == bv && oi < bi)) bv = ov, bi = oi;
  }
  if (lane == 0) s.hist[0][w] = ((u64)__float_as_uint(bv) << 32) | bi;
  block_sum2(s, finite, zero);
  if (tid == 0) {
    float fb = -INFINITY;
    unsigned ib = 0;
    for (int i = 0; i < NW; ++i) {
      const float v = __uint_as_float((unsigned)(s.hist[0][i] >> 32));
      const unsigned id = (unsigned)s.hist[0][i];
      if (v > fb || (v == fb && id < ib)) fb = v, ib = id;
    }
    s.fbest = fb, s.ibest = ib;
  }
  __syncthreads();
  const float max = s.fbest;
  const unsigned best = s.ibest;
  if (max == -INFINITY || p.temperature == 0.0f) {
    if (tid == 0) out[blockIdx.x] = max == -INFINITY ? 0u : best;
    return;
  }
  const float inv_t = 1.0f / p.temperature;

  // Top-k: keep key > kk, and the first need_k tokens (by id) of key == kk.
  const bool k_on = p.top_k > 0 && (u64)p.top_k < finite;
  unsigned kk = 0;
  u64 need_k = 0;
  if (k_on) {
    u64 gt;
    kk = select_key(s, x, vocab, max, inv_t, true, 0, false, 0, 0, p.top_k, gt);
    need_k = p.top_k - gt;
  }
  // The weight of what top-k keeps.
  const float wk = k_on ? expf((value_of(kk) - max) * inv_t) : 0.0f;

  // Top-p: keep key > kp, and the first need_p tokens of key == kp (within top-k's set).
  const bool p_on = p.top_p < 1.0f;
  unsigned kp = 0;
  u64 need_p = 0;
  if (p_on) {
    u64 total = 0;
    for (int j = tid; j < vocab; j += NT) {
      const float v = sanitise(x[j]);
      if (v == -INFINITY) continue;
      if (!k_on || key_of(v) > kk) total += fixed(expf((v - max) * inv_t));
    }
    block_sum2(s, total, zero);
    if (k_on) total += need_k * fixed(wk);
    const u64 target = (u64)((double)total * (double)p.top_p);
    const u64 goal = target > 0 ? target : 1;
    u64 above;
    kp = select_key(s, x, vocab, max, inv_t, false, kk, k_on, kk, k_on ? need_k * fixed(wk) : 0,
                    goal, above);
    const u64 wp = fixed(expf((value_of(kp) - max) * inv_t));
    need_p = wp > 0 ? (goal - above + wp - 1) / wp : 1;
    if (need_p == 0) need_p = 1;
    if (k_on && kp == kk && need_p > need_k) need_p = need_k;
  }

  // Each warp owns a contiguous run of ids and walks it 32 at a time (coalesced), so ranks
  // among equal keys follow id order: a lane's rank is the count before its warp's run
  // plus the lanes below it in the ballot.
  const int per_warp = (((vocab + NW - 1) / NW) + 31) & ~31;
  const int wlo = min(vocab, w * per_warp), whi = min(vocab, wlo + per_warp);
  const unsigned below = (1u << lane) - 1u;
  u64 eq_k = 0, eq_p = 0;
  for (int j = wlo + lane; j < whi; j += 32) {
    const float v = sanitise(x[j]);
    const unsigned k = key_of(v);
    eq_k += v != -INFINITY && k_on && k == kk;
    eq_p += v != -INFINITY && p_on && k == kp;
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    eq_k += __shfl_xor_sync(0xffffffffu, eq_k, o);
    eq_p += __shfl_xor_sync(0xffffffffu, eq_p, o);
  }
  u64 tk, tp;
  warp_prefix2(s, eq_k, eq_p, tk, tp);
  // Whether token j (lane's id in a step) is kept, with its weight; advances the ranks.
  auto step = [&](int j, u64& rk, u64& rp, float& wv) {
    const float v = j < whi ? sanitise(x[j]) : -INFINITY;
    const unsigned k = key_of(v);
    const bool fin = v != -INFINITY, is_k = fin && k_on && k == kk, is_p = fin && p_on && k == kp;
    const unsigned mk = __ballot_sync(0xffffffffu, is_k), mp = __ballot_sync(0xffffffffu, is_p);
    const u64 my_k = rk + __popc(mk & below), my_p = rp + __popc(mp & below);
    rk += __popc(mk);
    rp += __popc(mp);
    bool keep = fin;
    if (k_on) keep = keep && (is_k ? my_k < need_k : k > kk);
    if (p_on) keep = keep && (is_p ? my_p < need_p : k > kp);
    wv = keep ? expf((v - max) * inv_t) : 0.0f;
    return keep && wv >= p.min_p;
  };
  u64 mine = 0;
  {
    u64 rk = eq_k, rp = eq_p;
    float wv;
    for (int base = wlo; base < whi; base += 32)
      if (step(base + lane, rk, rp, wv)) mine += fixed(wv);
  }
  u64 warp_mass = mine;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) warp_mass += __shfl_xor_sync(0xffffffffu, warp_mass, o);
  u64 before = warp_mass, unused = 0, kept_total, t2;
  warp_prefix2(s, before, unused, kept_total, t2);
  if (tid == 0) s.bcast[2] = best;
  __syncthreads();
  const u64 target = (u64)((double)kept_total * (double)p.uniform);
  if (target >= before && target < before + warp_mass) {
    // This warp holds the draw: running inclusive sums, 32 ids at a time.
    u64 rk = eq_k, rp = eq_p, run = before;
    float wv;
    for (int base = wlo; base < whi; base += 32) {
      const bool keep = step(base + lane, rk, rp, wv);
      u64 inc = keep ? fixed(wv) : 0ull;
#pragma unroll
      for (int o = 1; o < 32; o <<= 1) {
        const u64 y = __shfl_up_sync(0xffffffffu, inc, o);
        if (lane >= o) inc += y;
      }
      const unsigned hit = __ballot_sync(0xffffffffu, keep && run + inc > target);
      if (hit) {
        if (lane == __ffs(hit) - 1) s.bcast[2] = (u64)(base + lane);
        break;
      }
      run += __shfl_sync(0xffffffffu, inc, 31);
    }
  }
  __syncthreads();
  if (tid == 0) out[blockIdx.x] = (unsigned)s.bcast[2];
}
