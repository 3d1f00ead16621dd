// Kimi Delta Attention: the forget gate and the recurrent gated delta rule.
// Follows crates/kimi-cpu/src/kda.rs (`gate`, `recurrent_head`).
#include "common.cuh"

// kind 0: g = -exp(a_log[h]) * softplus(f + dt_bias); kind 1: g = lb * sigmoid(exp(a_log[h]) * (f + dt_bias)).
// Grid (column blocks, row blocks): 32-bit column arithmetic, no 64-bit division per element.
extern "C" __global__ void kda_gate(const float* f, const void* a_log, int adt, const void* dt_bias,
                                    int bdt, float* g, int rows, int width, int d, int kind,
                                    float lb) {
  pdl_enter();
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= width) return;
  const float bias = ld(dt_bias, c, bdt);
  const float scale = expf(ld(a_log, c / d, adt));
  for (int r = blockIdx.y; r < rows; r += gridDim.y) {
    const size_t i = (size_t)r * width + c;
    const float x = f[i] + bias;
    if (kind == 0) {
      const float sp = x > 20.0f ? x : log1pf(expf(x));
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
    pdl_enter();                                                                              \
    kda_recurrent_impl<N>(q, k, v, g, beta, state, out, start, len, H, D);                    \
  }
KDA_RECURRENT(32)
KDA_RECURRENT(64)
KDA_RECURRENT(128)

// ------------------------------------------------------------------------------------------
// Split-V recurrence, the fused decode step and the chunked (WY) form.
//
// Segment tables travel as kernel parameters (no host-to-device copy per call): at most
// KDA_MAX_SEGS segments per launch; the launcher splits longer lists. Layouts are mirrored
// by #[repr(C)] structs in crates/kimi-cuda/src/ops/kda.rs.
#include <cooperative_groups.h>
namespace cg = cooperative_groups;

#define KDA_MAX_SEGS 64
#define KDA_C 64  // tokens per chunk, as kimi-cpu's CHUNK

struct KdaSegs {
  int n;                         // segments in this launch
  int start[KDA_MAX_SEGS];       // first row
  int len[KDA_MAX_SEGS];         // rows (>= 1)
  int chunk0[KDA_MAX_SEGS];      // first chunk of the segment in the launch's scratch
  float* state[KDA_MAX_SEGS];    // [H, D, D] f32, key-major
};

struct KdaStepSegs {
  int n;
  int row[KDA_MAX_SEGS];         // the segment's only row
  float* state[KDA_MAX_SEGS];    // [H, D, D]
  float* conv[3][KDA_MAX_SEGS];  // q, k, v windows [W-1, H*D], oldest first
};

struct KdaStepArgs {
  const float* x[3];     // q, k, v projections before the convolution [n, H*D]
  const void* w[3];      // conv weights [H*D, W]
  const float* f;        // gate pre-activation [n, H*D]
  const float* b;        // beta logits [n, H]
  const float* z;        // output gate [n, H*D]
  const void* a_log;     // [H]
  const void* dt_bias;   // [H*D]
  const void* o_norm;    // [D]
  float* y;              // [n, H*D]
  int wdt[3];
  int adt, bdt, odt;
  int H, W, kind;
  float lb, eps;
};

// Thread layout of one (head, V-block) state update with 128 threads: the block owns BV =
// D/4 state columns; thread t works on column t % BV and rows t/BV + RG*m (m < RPT).
template <int D>
struct Split {
  static constexpr int NV = 4, BV = D / NV, RG = 128 / BV, RPT = D / RG;
};

// One token of the recurrence on this thread's slice `s` of the state (§3.6): decay, delta
// with the decayed state, rank-1 write, read-out. Returns o[column] (same in every row group).
// qs/ks/as hold the normalised q, k and exp(g) of the head; red holds 128 floats.
template <int D>
__device__ __forceinline__ float split_step(float (&s)[Split<D>::RPT], const float* qs,
                                            const float* ks, const float* as, float vj, float b,
                                            float* red) {
  using L = Split<D>;
  const int c = threadIdx.x % L::BV, rg = threadIdx.x / L::BV;
  float part = 0.0f;
#pragma unroll
  for (int m = 0; m < L::RPT; ++m) {
    const int i = rg + L::RG * m;
    s[m] *= as[i];
    part += s[m] * ks[i];
  }
  red[rg * L::BV + c] = part;
  __syncthreads();
  float sk = 0.0f;
#pragma unroll
  for (int r = 0; r < L::RG; ++r) sk += red[r * L::BV + c];
  const float u = (vj - sk) * b;
  __syncthreads();
  part = 0.0f;
#pragma unroll
  for (int m = 0; m < L::RPT; ++m) {
    const int i = rg + L::RG * m;
    s[m] += ks[i] * u;
    part += s[m] * qs[i];
  }
  red[rg * L::BV + c] = part;
  __syncthreads();
  float o = 0.0f;
#pragma unroll
  for (int r = 0; r < L::RG; ++r) o += red[r * L::BV + c];
  __syncthreads();
  return o;
}

// Recurrence over every row of each segment. grid (NV, H, segs.n), block 128.
template <int D>
__device__ void recurrent_split(const float* q, const float* k, const float* v, const float* g,
                                const float* beta, const KdaSegs& segs, float* out, int H) {
  using L = Split<D>;
  __shared__ float qs[D], ks[D], as[D], red[128], red2[32];
  const int vb = blockIdx.x, h = blockIdx.y, sg = blockIdx.z, tid = threadIdx.x;
  const int c = tid % L::BV, rg = tid / L::BV, col = vb * L::BV + c;
  float* S = segs.state[sg] + (size_t)h * D * D;
  float s[L::RPT];
#pragma unroll
  for (int m = 0; m < L::RPT; ++m) s[m] = S[(size_t)(rg + L::RG * m) * D + col];
  const size_t width = (size_t)H * D;
  const float qscale = 1.0f / sqrtf((float)D);
  const int start = segs.start[sg], len = segs.len[sg];
  for (int t = 0; t < len; ++t) {
    const size_t row = (size_t)(start + t) * width + (size_t)h * D;
    const float qi = tid < D ? q[row + tid] : 0.0f, ki = tid < D ? k[row + tid] : 0.0f;
    const float gi = tid < D ? g[row + tid] : 0.0f;
    const float vj = v[row + col], b = beta[(size_t)(start + t) * H + h];
    const float ssq = block_sum(qi * qi, red2);
    const float ssk = block_sum(ki * ki, red2);
    if (tid < D) {
      qs[tid] = qi * (qscale / sqrtf(ssq + 1e-6f));
      ks[tid] = ki * (1.0f / sqrtf(ssk + 1e-6f));
      as[tid] = expf(gi);
    }
    __syncthreads();
    const float o = split_step<D>(s, qs, ks, as, vj, b, red);
    if (rg == 0) out[row + col] = o;
  }
#pragma unroll
  for (int m = 0; m < L::RPT; ++m) S[(size_t)(rg + L::RG * m) * D + col] = s[m];
}

#define KDA_RECURRENT_SPLIT(D)                                                                \
  extern "C" __global__ void __launch_bounds__(128) kda_recurrent_split_##D(                 \
      const float* q, const float* k, const float* v, const float* g, const float* beta,      \
      const KdaSegs segs, float* out, int H) {                                                \
    pdl_enter();                                                                              \
    recurrent_split<D>(q, k, v, g, beta, segs, out, H);                                       \
  }
KDA_RECURRENT_SPLIT(64)
KDA_RECURRENT_SPLIT(128)

// Causal conv of one channel for the current token x: window taps 0..W-2 from the cache.
__device__ __forceinline__ float conv_silu_1(const float* cache, float x, const void* w, int wdt,
                                            int ch, int width, int W) {
  float acc = 0.0f;
  for (int j = 0; j < W - 1; ++j) acc += ld(w, (size_t)ch * W + j, wdt) * cache[(size_t)j * width + ch];
  acc += ld(w, (size_t)ch * W + W - 1, wdt) * x;
  return acc * sigmoidf_(acc);
}

// Drops the oldest window row of one channel and appends x (same thread reads before it writes).
__device__ __forceinline__ void conv_shift_1(float* cache, float x, int ch, int width, int W) {
  for (int j = 0; j + 1 < W - 1; ++j) cache[(size_t)j * width + ch] = cache[(size_t)(j + 1) * width + ch];
  if (W > 1) cache[(size_t)(W - 2) * width + ch] = x;
}

// One decode step of a KDA layer for one-token segments: the three short convolutions +
// SiLU (updating their windows in place), the forget gate, sigmoid(beta), L2 norms, the
// state update and the gated RMSNorm. A cluster of NV blocks shares one (segment, head):
// block x owns state columns x*BV..; the norm's sum of squares is exchanged through
// distributed shared memory. grid (NV, H, segs.n), block 128, cluster (NV, 1, 1).
//
// Loads: with windows of at most KDA_MAXW taps, the weights (conv taps, dt_bias, A_log,
// o_norm) load before `pdl_wait`, and after it every activation, window row and state value
// is requested before any is used. Loaded where they were used, a tap at a time behind a
// dtype branch, they made a chain of ~30 dependent round trips (13.1 us per launch, ncu).
#define KDA_MAXW 4
template <int D>
__device__ void decode_step(const KdaStepArgs& a, const KdaStepSegs& segs) {
  using L = Split<D>;
  __shared__ float qs[D], ks[D], as[D], vs[L::BV], red[128], red2[32];
  __shared__ float partial;
  cg::cluster_group cluster = cg::this_cluster();
  const int vb = blockIdx.x, h = blockIdx.y, sg = blockIdx.z, tid = threadIdx.x;
  const int c = tid % L::BV, rg = tid / L::BV, col = vb * L::BV + c;
  const int H = a.H, W = a.W;
  const int width = H * D;
  const bool fast = W >= 1 && W <= KDA_MAXW;
  const int chq = h * D + tid;              // q/k channel (tid < D)
  const int chv = h * D + vb * L::BV + tid;  // value channel (tid < BV)
  // Weights (immutable): before waiting for the previous kernel.
  uint32_t rw[3][KDA_MAXW];
#pragma unroll
  for (int st = 0; st < 3; ++st) {
    const int ch = st < 2 ? chq : chv;
    const bool mine = st < 2 ? tid < D : tid < L::BV;
#pragma unroll
    for (int j = 0; j < KDA_MAXW; ++j)
      rw[st][j] = fast && mine && j < W ? ld_raw(a.w[st], (size_t)ch * W + j, a.wdt[st]) : 0u;
  }
  const uint32_t rdtb = tid < D ? ld_raw(a.dt_bias, chq, a.bdt) : 0u;
  const uint32_t rlog = tid < D ? ld_raw(a.a_log, h, a.adt) : 0u;
  const uint32_t rnorm = rg == 0 ? ld_raw(a.o_norm, col, a.odt) : 0u;
  pdl_enter();
  const size_t row = (size_t)segs.row[sg];
  // The state columns first: their 16-64 KiB are the step's longest wait, and nothing
  // below changes them before `split_step`.
  float* S = segs.state[sg] + (size_t)h * D * D;
  float s[L::RPT];
#pragma unroll
  for (int m = 0; m < L::RPT; ++m) s[m] = S[(size_t)(rg + L::RG * m) * D + col];
  // Every activation and window value this thread needs, all requested at once.
  float xin[3] = {0.0f, 0.0f, 0.0f}, win[3][KDA_MAXW - 1];
#pragma unroll
  for (int st = 0; st < 3; ++st) {
    const int ch = st < 2 ? chq : chv;
    const bool mine = st < 2 ? tid < D : tid < L::BV;
    if (mine) xin[st] = a.x[st][row * width + ch];
#pragma unroll
    for (int j = 0; j < KDA_MAXW - 1; ++j)
      win[st][j] = fast && mine && j < W - 1 ? segs.conv[st][sg][(size_t)j * width + ch] : 0.0f;
  }
  const float fin = tid < D ? a.f[row * width + chq] : 0.0f;
  const float blog = a.b[row * H + h];
  const size_t yidx = row * width + (size_t)h * D + col;
  const float zin = rg == 0 ? a.z[yidx] : 0.0f;
  // conv_silu_1's sums in its order: taps 0..W-2 on the window, tap W-1 on the new input.
  auto conv = [&](int st) {
    float acc = 0.0f;
#pragma unroll
    for (int j = 0; j < KDA_MAXW; ++j) {
      const float w = raw_val(rw[st][j], a.wdt[st]);
      if (j < W - 1) acc += w * win[st][j];
      else if (j == W - 1) acc += w * xin[st];
    }
    return acc * sigmoidf_(acc);
  };
  // conv_shift_1 from the values read above.
  auto shift = [&](int st, int ch) {
    float* cache = segs.conv[st][sg];
#pragma unroll
    for (int j = 0; j + 1 < KDA_MAXW - 1; ++j)
      if (j + 1 < W - 1) cache[(size_t)j * width + ch] = win[st][j + 1];
    if (W > 1) cache[(size_t)(W - 2) * width + ch] = xin[st];
  };
  float qk[2] = {0.0f, 0.0f};
  if (tid < D) {
#pragma unroll
    for (int st = 0; st < 2; ++st)
      qk[st] = fast ? conv(st)
                    : conv_silu_1(segs.conv[st][sg], xin[st], a.w[st], a.wdt[st], chq, width, W);
    const float x = fin + raw_val(rdtb, a.bdt);
    const float scale = expf(raw_val(rlog, a.adt));
    const float gi = a.kind == 0 ? -scale * (x > 20.0f ? x : log1pf(expf(x)))
                                 : a.lb * sigmoidf_(scale * x);
    as[tid] = expf(gi);
  }
  if (tid < L::BV) {
    // This block's value channels: nobody else reads their window, so shift it now.
    if (fast) {
      vs[tid] = conv(2);
      shift(2, chv);
    } else {
      float* cache = segs.conv[2][sg];
      vs[tid] = conv_silu_1(cache, xin[2], a.w[2], a.wdt[2], chv, width, W);
      conv_shift_1(cache, xin[2], chv, width, W);
    }
  }
  const float ssq = block_sum(qk[0] * qk[0], red2);
  const float ssk = block_sum(qk[1] * qk[1], red2);
  if (tid < D) {
    qs[tid] = qk[0] * ((1.0f / sqrtf((float)D)) / sqrtf(ssq + 1e-6f));
    ks[tid] = qk[1] * (1.0f / sqrtf(ssk + 1e-6f));
  }
  const float b = sigmoidf_(blog);
  __syncthreads();
  const float o = split_step<D>(s, qs, ks, as, vs[c], b, red);
#pragma unroll
  for (int m = 0; m < L::RPT; ++m) S[(size_t)(rg + L::RG * m) * D + col] = s[m];
  const float p = block_sum(rg == 0 ? o * o : 0.0f, red2);
  if (tid == 0) partial = p;
  cluster.sync();  // partials visible; every block has read the q/k windows
  float ss = 0.0f;
#pragma unroll
  for (int r = 0; r < L::NV; ++r) ss += *cluster.map_shared_rank(&partial, r);
  if (vb == 0 && tid < D) {
#pragma unroll
    for (int st = 0; st < 2; ++st) {
      if (fast) shift(st, chq);
      else conv_shift_1(segs.conv[st][sg], xin[st], chq, width, W);
    }
  }
  if (rg == 0) {
    const float inv = 1.0f / sqrtf(ss / (float)D + a.eps);
    a.y[yidx] = o * inv * raw_val(rnorm, a.odt) * sigmoidf_(zin);
  }
  cluster.sync();  // keep `partial` alive until every block of the cluster has read it
}

#define KDA_DECODE(D)                                                                         \
  extern "C" __global__ void __cluster_dims__(4, 1, 1) __launch_bounds__(128)                \
      kda_decode_##D(const KdaStepArgs a, const KdaStepSegs segs) {                           \
    decode_step<D>(a, segs); /* pdl_enter() inside, after the weights' loads */               \
  }
KDA_DECODE(64)
KDA_DECODE(128)

// ------------------------------------------------------------------------------------------
// Chunked WY form (spec §3.8, kimi-cpu `chunked_head`), two kernels per launch group:
//
//  kda_chunk_prep_D   grid (chunks, H), block 256, fully parallel. Per chunk of C = 64 rows:
//                     inverse norms of q/k rows, A[r][c] = q̂_r·(k̂_c ⊙ P(c,r)) for c <= r,
//                     L[r][c] = k̂_r·(k̂_c ⊙ P(c,r)) for c < r, where P(c,r) = Π_{c<s<=r}
//                     exp(g_s) is a running product (never a quotient, so the unbounded
//                     softplus gate cannot overflow), and T = (I + diag(β)L)^-1 diag(β) by
//                     forward substitution. Writes one C×C matrix M (A in the lower
//                     triangle with its diagonal, T's strict lower triangle transposed into
//                     the upper; T's diagonal is β) and the 2C inverse norms.
//  kda_chunk_state_D  grid (D/32, H, segments), block 256: the serial pass over a segment's
//                     chunks for 32 state columns, state in shared memory (f32):
//                     X = V − (k̂⊙e^Γ)·S,  V' = T·X,  O = (q̂⊙e^Γ)·S + A·V',
//                     S ← e^Γ_last ⊙ S + Σ_c (k̂_c ⊙ e^(Γ_last−Γ_c)) ⊗ V'_c.
//                     V' = T·(V − W_k S) equals the CPU's U − W·S with U = T·V, W = T·(e^Γ⊙K).
//
// Rows past a segment's end are zero (q, k, v, β) with exp(g) = 1, which leaves every
// product above unchanged; their outputs are not written.
#define KDA_SCRATCH (KDA_C * KDA_C + 2 * KDA_C)  // floats per (chunk, head)

__device__ __forceinline__ int seg_of_chunk(const KdaSegs& segs, int gc) {
  int s = 0;
  while (s + 1 < segs.n && gc >= segs.chunk0[s + 1]) ++s;
  return s;
}

__device__ __forceinline__ float4 ld4(const float* p) { return *reinterpret_cast<const float4*>(p); }
__device__ __forceinline__ void st4(float* p, float4 v) { *reinterpret_cast<float4*>(p) = v; }

// Column j of T = (I + diag(β)L)^-1 diag(β) by forward substitution: x[r] collects
// δ_rj − Σ_{c<r} L[r][c] T[c][j] and ends as T[r][j] (0 above the diagonal, β_j on it).
// M holds L[r][c] at M[c][r] (c < r).
__device__ __forceinline__ void solve_t(const float* Ms, const float* Bs, int j,
                                        float (&x)[KDA_C]) {
  constexpr int C = KDA_C;
#pragma unroll
  for (int r = 0; r < C; ++r) x[r] = r == j ? 1.0f : 0.0f;
#pragma unroll
  for (int c = 0; c < C; ++c) {
    const float tc = Bs[c] * x[c];
    x[c] = tc;
#pragma unroll
    for (int r4 = ((c + 1) / 4) * 4; r4 < C; r4 += 4) {
      const float4 lv = ld4(Ms + c * C + r4);  // L[r][c] for r > c
      if (r4 + 0 > c) x[r4 + 0] -= lv.x * tc;
      if (r4 + 1 > c) x[r4 + 1] -= lv.y * tc;
      if (r4 + 2 > c) x[r4 + 2] -= lv.z * tc;
      if (r4 + 3 > c) x[r4 + 3] -= lv.w * tc;
    }
  }
}

// ---- Operands of the tensor-core state pass (kda_chunk_mma_*), written by
// kda_chunk_prep_mma_D. Per (chunk, head), bf16 planes, each value x as hi = bf16(x) and,
// with `split` only, lo = bf16(x − hi) (without it the lo planes are left out of the
// layout, so a launch group of bf16-only operands holds twice the chunks), then f32:
//   KG hi, KG lo, QG hi, QG lo   [C][D]  k̂_r ⊙ e^Γ_r, q̂_r ⊙ e^Γ_r (Γ_r: inclusive cumsum of g)
//   T hi, T lo                   [C][C]  T[r][c] (lower triangle, β_r on the diagonal)
//   A hi, A lo                   [C][C]  A[r][c] = q̂_r·(k̂_c ⊙ P(c,r)) for c <= r, else 0
//   Kd hi, Kd lo                 [C][D]  k̂_r ⊙ e^(Γ_last − Γ_r)
//   γ                            [D] f32 e^Γ_last
// Every decay is a running product of e^g (never a quotient), so nothing can overflow.
// Rows past the segment's end are zero (k̂ = q̂ = 0, β = 0, e^g = 1).
__host__ __device__ constexpr size_t kda_mma_scratch_bytes(int D, bool split) {
  return (size_t)(split ? 2 : 1) * (3 * KDA_C * D + 2 * KDA_C * KDA_C) * 2 + (size_t)4 * D;
}

__device__ __forceinline__ void st_hilo(__nv_bfloat16* hi, size_t plane, size_t i, float x,
                                        bool split) {
  const __nv_bfloat16 h = __float2bfloat16_rn(x);
  hi[i] = h;
  if (split) hi[plane + i] = __float2bfloat16_rn(x - __bfloat162float(h));
}

// The part of kda_chunk_prep_mma_D after A and L are in Ms (block of 256 threads): threads
// 0..C-1 solve one column of T each and store it; threads C..C+D-1 take one key channel each
// for the decayed k/q rows and γ; then all store A.
// BLK (kda_chunk_prep_blk_D): Qs, Ks, As hold q̂ ⊙ fl, k̂ ⊙ fl and k̂ ⊙ bl instead of q̂, k̂,
// e^g, where fl_r / bl_r are the decay products from the start of r's 16-row block through r
// / from after r through the block's end, and gt[R] (this thread's channel) the block totals.
template <int D, bool BLK = false>
__device__ __forceinline__ void prep_mma_tail(const float* Qs, const float* Ks, const float* As,
                                              const float* Ms, const float* Bs, float* scratch,
                                              int slot, bool split,
                                              const float (&gt)[KDA_C / 16] = {}) {
  constexpr int C = KDA_C, NT = 256;
  constexpr size_t PD = (size_t)C * D, PC = (size_t)C * C;
  const int tid = threadIdx.x;
  const size_t np = split ? 2 : 1;  // planes per operand
  unsigned char* base =
      reinterpret_cast<unsigned char*>(scratch) + kda_mma_scratch_bytes(D, split) * slot;
  __nv_bfloat16* kg = reinterpret_cast<__nv_bfloat16*>(base);
  __nv_bfloat16* qg = kg + np * PD;
  __nv_bfloat16* tm = qg + np * PD;
  __nv_bfloat16* am = tm + np * PC;
  __nv_bfloat16* kd = am + np * PC;
  float* gam = reinterpret_cast<float*>(kd + np * PD);
  if (tid < C) {
    float x[C];
    solve_t(Ms, Bs, tid, x);
#pragma unroll
    for (int r = 0; r < C; ++r) st_hilo(tm, PC, (size_t)r * C + tid, x[r], split);
  } else if (BLK && tid < C + D) {
    const int i = tid - C;
    float pre = 1.0f;  // Π of the block totals before block R
#pragma unroll
    for (int R = 0; R < C / 16; ++R) {
#pragma unroll 4
      for (int m = 0; m < 16; ++m) {
        const int r = 16 * R + m;
        st_hilo(kg, PD, (size_t)r * D + i, Ks[r * D + i] * pre, split);
        st_hilo(qg, PD, (size_t)r * D + i, Qs[r * D + i] * pre, split);
      }
      pre *= gt[R];
    }
    gam[i] = pre;
    float post = 1.0f;  // Π of the block totals after block R
#pragma unroll
    for (int R = C / 16 - 1; R >= 0; --R) {
#pragma unroll 4
      for (int m = 0; m < 16; ++m) {
        const int r = 16 * R + m;
        st_hilo(kd, PD, (size_t)r * D + i, As[r * D + i] * post, split);
      }
      post *= gt[R];
    }
  } else if (!BLK && tid < C + D) {
    const int i = tid - C;
    float te = 1.0f;
#pragma unroll 4
    for (int r = C - 1; r >= 0; --r) {
      st_hilo(kd, PD, (size_t)r * D + i, Ks[r * D + i] * te, split);
      te *= As[r * D + i];
    }
    float fs = 1.0f;
#pragma unroll 4
    for (int r = 0; r < C; ++r) {
      fs *= As[r * D + i];
      st_hilo(kg, PD, (size_t)r * D + i, Ks[r * D + i] * fs, split);
      st_hilo(qg, PD, (size_t)r * D + i, Qs[r * D + i] * fs, split);
    }
    gam[i] = fs;
  }
  for (int e = tid; e < C * C; e += NT) {
    const int r = e / C, c = e % C;
    st_hilo(am, PC, e, c <= r ? Ms[e] : 0.0f, split);
  }
}

template <int D, bool MMA>
__device__ void chunk_prep(const float* q, const float* k, const float* g, const float* beta,
                           const KdaSegs& segs, float* scratch, int H, bool split) {
  constexpr int C = KDA_C, NT = 256, SL = D / 8;  // SL: key channels per lane of a group
  extern __shared__ __align__(16) float sm[];
  float* Qs = sm;            // [C][D] q̂ (normalised, scaled)
  float* Ks = Qs + C * D;    // [C][D] k̂
  float* As = Ks + C * D;    // [C][D] exp(g)
  float* Ms = As + C * D;    // [C][C]
  float* Bs = Ms + C * C;    // [C] β
  float* Rn = Bs + C;        // [2C] q then k inverse norms
  const int gc = blockIdx.x, h = blockIdx.y, tid = threadIdx.x;
  const int lane = tid & 31, w = tid >> 5;
  const int sg = seg_of_chunk(segs, gc);
  const int ci = gc - segs.chunk0[sg];
  const int row0 = segs.start[sg] + ci * C;
  const int l = min(C, segs.len[sg] - ci * C);
  const size_t width = (size_t)H * D;
  for (int e = tid; e < C * D / 4; e += NT) {
    const int r = e / (D / 4), i = (e % (D / 4)) * 4;
    float4 qv = make_float4(0.f, 0.f, 0.f, 0.f), kv = qv, av = make_float4(1.f, 1.f, 1.f, 1.f);
    if (r < l) {
      const size_t off = (size_t)(row0 + r) * width + (size_t)h * D + i;
      qv = ld4(q + off);
      kv = ld4(k + off);
      const float4 gv = ld4(g + off);
      av = make_float4(expf(gv.x), expf(gv.y), expf(gv.z), expf(gv.w));
    }
    st4(Qs + r * D + i, qv);
    st4(Ks + r * D + i, kv);
    st4(As + r * D + i, av);
  }
  for (int e = tid; e < C * C; e += NT) Ms[e] = 0.0f;
  if (tid < C) Bs[tid] = tid < l ? beta[(size_t)(row0 + tid) * H + h] : 0.0f;
  __syncthreads();
  // Inverse norms (as kimi-cpu `normalize_qk`): warp w takes rows w, w+8, ...
  const float qscale = 1.0f / sqrtf((float)D);
  for (int r = w; r < C; r += NT / 32) {
    float sq = 0.0f, sk = 0.0f;
#pragma unroll
    for (int u = 0; u < D / 32; ++u) {
      const float a = Qs[r * D + lane + 32 * u], b = Ks[r * D + lane + 32 * u];
      sq += a * a;
      sk += b * b;
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      sq += __shfl_xor_sync(0xffffffffu, sq, o);
      sk += __shfl_xor_sync(0xffffffffu, sk, o);
    }
    const float rq = qscale / sqrtf(sq + 1e-6f), rk = 1.0f / sqrtf(sk + 1e-6f);
#pragma unroll
    for (int u = 0; u < D / 32; ++u) {
      Qs[r * D + lane + 32 * u] *= rq;
      Ks[r * D + lane + 32 * u] *= rk;
    }
    if (lane == 0) {
      Rn[r] = rq;
      Rn[C + r] = rk;
    }
  }
  __syncthreads();
  // L and A. Lane group p = tid/8 (32 groups) takes key rows c = p and c = C-1-p (balanced
  // work); lane sl = tid%8 of the group holds channels 32u + 4sl + e (conflict-free float4).
  // r runs over a warp-uniform range so the group reductions can shuffle the full warp.
  {
    const int p = tid >> 3, sl = tid & 7;
#pragma unroll 1
    for (int pass = 0; pass < 2; ++pass) {
      const int c = pass == 0 ? p : C - 1 - p;
      const int rmin = pass == 0 ? 4 * w : C - 4 - 4 * w;
      float run[SL];
#pragma unroll
      for (int u = 0; u < D / 32; ++u) {
        const float4 kv = ld4(Ks + c * D + 32 * u + 4 * sl);
        run[4 * u] = kv.x, run[4 * u + 1] = kv.y, run[4 * u + 2] = kv.z, run[4 * u + 3] = kv.w;
      }
      for (int r = rmin; r < l; ++r) {
        const bool later = r > c;
        float pl = 0.0f, pa = 0.0f;
#pragma unroll
        for (int u = 0; u < D / 32; ++u) {
          const int i = r * D + 32 * u + 4 * sl;
          const float4 av = ld4(As + i), kv = ld4(Ks + i), qv = ld4(Qs + i);
          if (later) {
            run[4 * u] *= av.x, run[4 * u + 1] *= av.y, run[4 * u + 2] *= av.z, run[4 * u + 3] *= av.w;
          }
          pl += kv.x * run[4 * u] + kv.y * run[4 * u + 1] + kv.z * run[4 * u + 2] + kv.w * run[4 * u + 3];
          pa += qv.x * run[4 * u] + qv.y * run[4 * u + 1] + qv.z * run[4 * u + 2] + qv.w * run[4 * u + 3];
        }
#pragma unroll
        for (int o = 4; o > 0; o >>= 1) {
          pl += __shfl_xor_sync(0xffffffffu, pl, o);
          pa += __shfl_xor_sync(0xffffffffu, pa, o);
        }
        if (sl == 0 && r >= c) {
          Ms[r * C + c] = pa;
          if (later) Ms[c * C + r] = pl;
        }
      }
    }
  }
  __syncthreads();
  if constexpr (MMA) {
    prep_mma_tail<D>(Qs, Ks, As, Ms, Bs, scratch, gc * H + h, split);
    return;
  }
  // T, one column per thread: x[r] collects δ_rj − Σ_{c<r} L[r][c] T[c][j]; T[r][j] = β_r x[r].
  float x[C];
  if (tid < C) solve_t(Ms, Bs, tid, x);
  __syncthreads();
  if (tid < C) {
#pragma unroll
    for (int r = 0; r < C; ++r)
      if (r > tid) Ms[tid * C + r] = x[r];
  }
  __syncthreads();
  float* out = scratch + ((size_t)gc * H + h) * KDA_SCRATCH;
  for (int e = tid; e < C * C / 4; e += NT) st4(out + 4 * e, ld4(Ms + 4 * e));
  if (tid < 2 * C) out[C * C + tid] = Rn[tid];
}

template <int D>
__device__ void chunk_state(const float* q, const float* k, const float* v, const float* g,
                            const float* beta, const KdaSegs& segs, const float* scratch,
                            float* out, int H) {
  constexpr int C = KDA_C, NT = 256, BV = 32, SP = D + 4, RI = D / 8;
  extern __shared__ __align__(16) float sm[];
  float* KQ = sm;               // [2C][D]: k̂⊙e^Γ rows, then q̂⊙e^Γ rows; later Kd and V'
  float* Ms = KQ + 2 * C * D;   // [C][C] this chunk's M
  float* St = Ms + C * C;       // [BV][SP] the state columns, transposed (St[j][i] = S[i][j])
  float* Xs = St + BV * SP;     // [C][BV]
  float* Rn = Xs + C * BV;      // [2C]
  float* Bs = Rn + 2 * C;       // [C]
  float* Tot = Bs + C;          // [D] e^Γ_last
  float* Vn = KQ + C * D;       // [C][BV] V', in the q half once it is dead
  const int vb = blockIdx.x, h = blockIdx.y, sg = blockIdx.z, tid = threadIdx.x;
  const int j = tid & 31, w = tid >> 5, col = vb * BV + j;
  const size_t width = (size_t)H * D;
  const size_t hoff = (size_t)h * D;
  float* S = segs.state[sg] + (size_t)h * D * D;
  for (int i = w; i < D; i += NT / 32) St[j * SP + i] = S[(size_t)i * D + col];
  const int start = segs.start[sg], len = segs.len[sg];
  const int nch = (len + C - 1) / C;
  for (int ci = 0; ci < nch; ++ci) {
    const int row0 = start + ci * C, l = min(C, len - ci * C);
    const float* M = scratch + ((size_t)(segs.chunk0[sg] + ci) * H + h) * KDA_SCRATCH;
    __syncthreads();  // the previous chunk is done with every buffer
    if (tid < 2 * C) Rn[tid] = M[C * C + tid];
    if (tid < C) Bs[tid] = tid < l ? beta[(size_t)(row0 + tid) * H + h] : 0.0f;
    __syncthreads();
    if (tid < D) {
      // Running products from the chunk start, one key channel per thread (as kimi-cpu).
      const int i = tid;
      float fs = 1.0f;
#pragma unroll 4
      for (int r = 0; r < l; ++r) {
        const size_t off = (size_t)(row0 + r) * width + hoff + i;
        fs *= expf(g[off]);
        KQ[r * D + i] = (k[off] * Rn[C + r]) * fs;
        KQ[(C + r) * D + i] = (q[off] * Rn[r]) * fs;
      }
      for (int r = l; r < C; ++r) KQ[r * D + i] = KQ[(C + r) * D + i] = 0.0f;
      Tot[i] = fs;
    }
    for (int e = tid; e < C * C / 4; e += NT) st4(Ms + 4 * e, ld4(M + 4 * e));
    __syncthreads();
    // P1: rows w*16.. of KQ times the state column j.
    float acc[16];
#pragma unroll
    for (int m = 0; m < 16; ++m) acc[m] = 0.0f;
    {
      const float* a = KQ + (w * 16) * D;
#pragma unroll 2
      for (int i = 0; i < D; i += 4) {
        const float4 s4 = ld4(St + j * SP + i);
#pragma unroll
        for (int m = 0; m < 16; ++m) {
          const float4 a4 = ld4(a + m * D + i);
          acc[m] += a4.x * s4.x + a4.y * s4.y + a4.z * s4.z + a4.w * s4.w;
        }
      }
    }
    if (w < 4) {
#pragma unroll
      for (int m = 0; m < 16; ++m) {
        const int r = w * 16 + m;
        const float vv = r < l ? v[(size_t)(row0 + r) * width + hoff + col] : 0.0f;
        Xs[r * BV + j] = vv - acc[m];
      }
    }
    __syncthreads();
    // P2: V' = T·X, rows w*8..w*8+7; T[r][c] = Ms[c][r] for c < r, T[r][r] = β_r.
    {
      const int r0 = w * 8;
      float vn[8];
#pragma unroll
      for (int m = 0; m < 8; ++m) vn[m] = Bs[r0 + m] * Xs[(r0 + m) * BV + j];
      for (int c = 0; c < r0 + 7; ++c) {
        const float xc = Xs[c * BV + j];
        const float4 t0 = ld4(Ms + c * C + r0), t1 = ld4(Ms + c * C + r0 + 4);
        const float t[8] = {t0.x, t0.y, t0.z, t0.w, t1.x, t1.y, t1.z, t1.w};
#pragma unroll
        for (int m = 0; m < 8; ++m)
          if (c < r0 + m) vn[m] += t[m] * xc;
      }
#pragma unroll
      for (int m = 0; m < 8; ++m) Vn[(r0 + m) * BV + j] = vn[m];
    }
    __syncthreads();
    if (tid < D) {
      // Kd = k̂ ⊙ e^(Γ_last − Γ_c), a running product from the chunk end, into the k half.
      const int i = tid;
      float te = 1.0f;
      for (int r = C - 1; r >= l; --r) KQ[r * D + i] = 0.0f;
#pragma unroll 4
      for (int r = l - 1; r >= 0; --r) {
        const size_t off = (size_t)(row0 + r) * width + hoff + i;
        KQ[r * D + i] = (k[off] * Rn[C + r]) * te;
        te *= expf(g[off]);
      }
    }
    if (w >= 4) {
      // P3: O = (q̂⊙e^Γ)·S (in acc) + A·V' for rows rb..rb+15; A[r][c] = Ms[r][c], c <= r.
      const int rb = (w - 4) * 16;
      for (int c = 0; c < rb + 16; c += 4) {
        const float v0 = Vn[c * BV + j], v1 = Vn[(c + 1) * BV + j];
        const float v2 = Vn[(c + 2) * BV + j], v3 = Vn[(c + 3) * BV + j];
#pragma unroll
        for (int m = 0; m < 16; ++m) {
          const int r = rb + m;
          const float4 a4 = ld4(Ms + r * C + c);
          if (c <= r) acc[m] += a4.x * v0;
          if (c + 1 <= r) acc[m] += a4.y * v1;
          if (c + 2 <= r) acc[m] += a4.z * v2;
          if (c + 3 <= r) acc[m] += a4.w * v3;
        }
      }
#pragma unroll
      for (int m = 0; m < 16; ++m) {
        const int r = rb + m;
        if (r < l) out[(size_t)(row0 + r) * width + hoff + col] = acc[m];
      }
    }
    __syncthreads();
    // P4: S ← e^Γ_last ⊙ S + Kdᵀ·V' for rows i = w*RI.. of column j.
    {
      const int i0 = w * RI;
      float sacc[RI];
#pragma unroll
      for (int m = 0; m < RI; ++m) sacc[m] = Tot[i0 + m] * St[j * SP + i0 + m];
      for (int c = 0; c < l; ++c) {
        const float vn = Vn[c * BV + j];
#pragma unroll
        for (int m4 = 0; m4 < RI / 4; ++m4) {
          const float4 kd = ld4(KQ + c * D + i0 + 4 * m4);
          sacc[4 * m4] += kd.x * vn;
          sacc[4 * m4 + 1] += kd.y * vn;
          sacc[4 * m4 + 2] += kd.z * vn;
          sacc[4 * m4 + 3] += kd.w * vn;
        }
      }
#pragma unroll
      for (int m4 = 0; m4 < RI / 4; ++m4)
        st4(St + j * SP + i0 + 4 * m4,
            make_float4(sacc[4 * m4], sacc[4 * m4 + 1], sacc[4 * m4 + 2], sacc[4 * m4 + 3]));
    }
  }
  __syncthreads();
  for (int i = w; i < D; i += NT / 32) S[(size_t)i * D + col] = St[j * SP + i];
}

#define KDA_CHUNK(D)                                                                          \
  extern "C" __global__ void __launch_bounds__(256, 2) kda_chunk_prep_##D(                   \
      const float* q, const float* k, const float* g, const float* beta, const KdaSegs segs,  \
      float* scratch, int H) {                                                                \
    pdl_enter();                                                                              \
    chunk_prep<D, false>(q, k, g, beta, segs, scratch, H, false);                             \
  }                                                                                           \
  extern "C" __global__ void __launch_bounds__(256, 2) kda_chunk_state_##D(                  \
      const float* q, const float* k, const float* v, const float* g, const float* beta,      \
      const KdaSegs segs, const float* scratch, float* out, int H) {                          \
    pdl_enter();                                                                              \
    chunk_state<D>(q, k, v, g, beta, segs, scratch, out, H);                                  \
  }
KDA_CHUNK(64)
KDA_CHUNK(128)


// ------------------------------------------------------------------------------------------
// The chunked form on bf16 tensor cores (mma.sync m16n8k16, f32 accumulators).
//
//  kda_chunk_prep_mma_D   as kda_chunk_prep_D (A, L, T in f32), but writes the operands of
//                         the state pass in bf16 hi/lo planes (kda_mma_scratch_bytes above).
//  kda_chunk_mma_D_{split,half}
//                         grid (D / (16·KM_NW), H, segments), block 32·KM_NW: the serial pass.
//                         Warp w owns 16 value columns j of one state and keeps Sᵀ (16 × D,
//                         Sᵀ[j][i] = S[i][j]) in f32 mma accumulator fragments for the whole
//                         segment. With the state as the M side of every product, each
//                         accumulator fragment is also the A fragment of the next product, so
//                         the chain never leaves registers and warps never exchange data:
//     phase 0  Pᵀ = Sᵀ·KGᵀ, Oᵀ = Sᵀ·QGᵀ     (16 × C each, k = D)   Xᵀ = Vᵀ − Pᵀ
//     phase 1  V'ᵀ = Xᵀ·Tᵀ                   (k = C, lower-triangular tiles only)
//     phase 2  Oᵀ += V'ᵀ·Aᵀ → out            (causal tiles only)
//     phase 3  Sᵀ = Sᵀ ⊙ γ + V'ᵀ·Kd          (16 × D, k = C)
//                         The block shares the chunk's operands in shared memory (padded rows
//                         for conflict-free ldmatrix), one buffer each: the operand of phase q
//                         of the next chunk is fetched with cp.async as soon as phase q is done
//                         (after the barrier in front of phase q+1), so each load has three
//                         phases to land. Split: every product is hi·hi + lo·hi + hi·lo (three
//                         MMAs, ~2^-17 relative error per product, as mla_flash_prefill_mma);
//                         half: hi·hi.
namespace km {
constexpr int NW = 4;  // warps per block (16 value columns each)
constexpr int C = KDA_C;
template <int D>
struct Lay {
  static constexpr int LD = D + 8;        // bf16 per shared row of a C × D operand
  static constexpr int LC = C + 8;        // of a C × C operand
  static constexpr int PD = C * LD;       // one shared plane (bf16)
  static constexpr int PC = C * LC;
  static constexpr int BV = 16 * NW;      // value columns per block
  static constexpr int LV = BV + 4;       // f32 per shared row of V (conflict-free reads)
  static constexpr size_t GD = (size_t)C * D, GC = (size_t)C * C;  // global plane sizes
};
}  // namespace km

// Dynamic shared memory of kda_chunk_mma_D_*: KG, QG, T, A, Kd (hi, and lo with split) as
// bf16, V [C][LV] and γ [D] as f32.
__host__ __device__ constexpr size_t kda_mma_smem_bytes(int D, bool split) {
  return (size_t)(split ? 2 : 1) * (3 * km::C * (D + 8) + 2 * km::C * (km::C + 8)) * 2 +
         (size_t)km::C * (16 * km::NW + 4) * 4 + (size_t)D * 4;
}

__device__ __forceinline__ void km_cp16(uint32_t dst, const void* src, bool valid) {
  const int n = valid ? 16 : 0;  // 0 bytes read: the destination becomes zeros
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(n)
               : "memory");
}
__device__ __forceinline__ void km_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
__device__ __forceinline__ void km_wait2() { asm volatile("cp.async.wait_group 2;\n" ::: "memory"); }
__device__ __forceinline__ void km_ldsm(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr)
               : "memory");
}
__device__ __forceinline__ void km_ldsm_t(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr)
               : "memory");
}
// c += a·b for one m16n8k16 tile (bf16 in, f32 accumulate).
__device__ __forceinline__ void km_mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                       uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
// (x, y) -> hi = bf16 pair (x in the low half) and, with SPLIT, lo = bf16 pair of remainders.
template <bool SPLIT>
__device__ __forceinline__ void km_split(float x, float y, uint32_t& hi, uint32_t& lo) {
  const __nv_bfloat162 h = __floats2bfloat162_rn(x, y);
  hi = *reinterpret_cast<const uint32_t*>(&h);
  if constexpr (SPLIT) {
    const float2 hf = __bfloat1622float2(h);
    const __nv_bfloat162 l = __floats2bfloat162_rn(x - hf.x, y - hf.y);
    lo = *reinterpret_cast<const uint32_t*>(&l);
  }
}
// The A fragments (hi, lo) of k-step ks from accumulator n-tiles 2ks and 2ks+1.
template <bool SPLIT>
__device__ __forceinline__ void km_afrag(const float (&c0)[4], const float (&c1)[4],
                                         uint32_t (&ah)[4], uint32_t (&al)[4]) {
  km_split<SPLIT>(c0[0], c0[1], ah[0], al[0]);
  km_split<SPLIT>(c0[2], c0[3], ah[1], al[1]);
  km_split<SPLIT>(c1[0], c1[1], ah[2], al[2]);
  km_split<SPLIT>(c1[2], c1[3], ah[3], al[3]);
}
// c0 (n-tile 2np) and c1 (2np+1) += a·b with b from ldmatrix at `addr` (hi) and addr + lo.
template <bool SPLIT, bool TRANS>
__device__ __forceinline__ void km_mma2(float (&c0)[4], float (&c1)[4], const uint32_t (&ah)[4],
                                        const uint32_t (&al)[4], uint32_t addr, uint32_t lo) {
  uint32_t bh[4];
  if constexpr (TRANS) km_ldsm_t(bh, addr); else km_ldsm(bh, addr);
  km_mma(c0, ah, bh[0], bh[1]);
  km_mma(c1, ah, bh[2], bh[3]);
  if constexpr (SPLIT) {
    uint32_t bl[4];
    if constexpr (TRANS) km_ldsm_t(bl, addr + lo); else km_ldsm(bl, addr + lo);
    km_mma(c0, al, bh[0], bh[1]);
    km_mma(c1, al, bh[2], bh[3]);
    km_mma(c0, ah, bl[0], bl[1]);
    km_mma(c1, ah, bl[2], bl[3]);
  }
}

template <int D, bool SPLIT>
__device__ void chunk_mma(const float* __restrict__ v, const KdaSegs& segs,
                          const unsigned char* __restrict__ scratch, float* __restrict__ out,
                          int H) {
  using L = km::Lay<D>;
  constexpr int C = km::C, NT = 32 * km::NW, NP = SPLIT ? 2 : 1;
  constexpr int NTD = D / 8;  // n-tiles of the state (key channels)
  extern __shared__ __align__(16) unsigned char smc[];
  __nv_bfloat16* KGs = reinterpret_cast<__nv_bfloat16*>(smc);  // NP planes [C][LD]
  __nv_bfloat16* QGs = KGs + NP * L::PD;                       // NP planes [C][LD]
  __nv_bfloat16* Ts = QGs + NP * L::PD;                        // NP planes [C][LC]
  __nv_bfloat16* As = Ts + NP * L::PC;                         // NP planes [C][LC]
  __nv_bfloat16* Kds = As + NP * L::PC;                        // NP planes [C][LD]
  float* Vs = reinterpret_cast<float*>(Kds + NP * L::PD);      // [C][LV]
  float* Gs = Vs + C * L::LV;                                  // [D]
  const int tid = threadIdx.x, lane = tid & 31, w = tid >> 5;
  const int g = lane >> 2, c = lane & 3;
  const int h = blockIdx.y, sg = blockIdx.z;
  const int vcol0 = blockIdx.x * L::BV;  // the block's first value column
  const int jw = 16 * w;                 // the warp's first column within the block
  const size_t width = (size_t)H * D, hoff = (size_t)h * D;
  const int start = segs.start[sg], len = segs.len[sg];
  const int nch = (len + C - 1) / C;
  float* S = segs.state[sg] + (size_t)h * D * D;

  // Loaders: one 16-byte cp.async per (row, 8 bf16) of each plane.
  auto chunk_base = [&](int ci) {
    return scratch + ((size_t)(segs.chunk0[sg] + ci) * H + h) * kda_mma_scratch_bytes(D, SPLIT);
  };
  auto load_planes = [&](__nv_bfloat16* dst, const unsigned char* src, int rw, int ld,
                         size_t gplane) {
    const int per_row = rw / 8, n = C * per_row;
#pragma unroll
    for (int p = 0; p < NP; ++p)
      for (int e = tid; e < n; e += NT) {
        const int r = e / per_row, cc = e % per_row;
        km_cp16(smem_addr(dst + p * C * ld + r * ld + cc * 8),
                src + (p * gplane + (size_t)r * rw + cc * 8) * 2, true);
      }
  };
  // Group 0: KG, QG and this block's V columns (zero past the segment's end).
  auto load_g0 = [&](int ci) {
    if (ci < nch) {
      const unsigned char* b = chunk_base(ci);
      load_planes(KGs, b, D, L::LD, L::GD);
      load_planes(QGs, b + NP * L::GD * 2, D, L::LD, L::GD);
      const int row0 = start + ci * C, l = min(C, len - ci * C);
      for (int e = tid; e < C * L::BV / 4; e += NT) {
        const int r = e / (L::BV / 4), cc = (e % (L::BV / 4)) * 4;
        const float* src = v + (size_t)(row0 + min(r, l - 1)) * width + hoff + vcol0 + cc;
        km_cp16(smem_addr(Vs + r * L::LV + cc), src, r < l);
      }
    }
    km_commit();
  };
  auto load_g1 = [&](int ci) {  // T
    if (ci < nch) load_planes(Ts, chunk_base(ci) + 2 * NP * L::GD * 2, C, L::LC, L::GC);
    km_commit();
  };
  auto load_g2 = [&](int ci) {  // A
    if (ci < nch)
      load_planes(As, chunk_base(ci) + NP * (2 * L::GD + L::GC) * 2, C, L::LC, L::GC);
    km_commit();
  };
  auto load_g3 = [&](int ci) {  // Kd, γ
    if (ci < nch) {
      const unsigned char* b = chunk_base(ci) + 2 * NP * (L::GD + L::GC) * 2;
      load_planes(Kds, b, D, L::LD, L::GD);
      for (int e = tid; e < D / 4; e += NT)
        km_cp16(smem_addr(Gs + 4 * e), b + NP * L::GD * 2 + 16 * e, true);
    }
    km_commit();
  };
  load_g0(0);
  load_g1(0);
  load_g2(0);
  load_g3(0);

  // ldmatrix lane addresses (bytes). B from [n][k] rows (KG, QG, T, A; k contiguous): lanes
  // 0-7 rows 0-7 / k 0, 8-15 rows 0-7 / k 8, 16-23 rows 8-15 / k 0, 24-31 rows 8-15 / k 8
  // -> (b0, b1) of n-tiles 2np and 2np+1. B from [k][n] rows through .trans (Kd): lanes 0-7
  // k 0-7 / n 0-7, 8-15 k 8-15 / n 0-7, 16-23 k 0-7 / n 8-15, 24-31 k 8-15 / n 8-15.
  const int l7 = lane & 7, l8 = (lane >> 3) & 1, l16 = lane >> 4;
  const uint32_t kga = smem_addr(KGs + (l7 + 8 * l16) * L::LD + 8 * l8);
  const uint32_t qga = smem_addr(QGs + (l7 + 8 * l16) * L::LD + 8 * l8);
  const uint32_t ta = smem_addr(Ts + (l7 + 8 * l16) * L::LC + 8 * l8);
  const uint32_t aa = smem_addr(As + (l7 + 8 * l16) * L::LC + 8 * l8);
  const uint32_t kda = smem_addr(Kds + (l7 + 8 * l8) * L::LD + 8 * l16);
  constexpr uint32_t lod = L::PD * 2, loc = L::PC * 2;  // hi plane -> lo plane, bytes

  // Sᵀ fragments: st[nt][e] = S[i = 8nt + 2c + (e & 1)][j = jw + g + 8(e >> 1)].
  const int colg = vcol0 + jw + g;
  float st[NTD][4];
#pragma unroll
  for (int nt = 0; nt < NTD; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e)
      st[nt][e] = S[(size_t)(8 * nt + 2 * c + (e & 1)) * D + colg + 8 * (e >> 1)];

#pragma unroll 1
  for (int ci = 0; ci < nch; ++ci) {
    const int row0 = start + ci * C, l = min(C, len - ci * C);
    // ---- phase 0: Pᵀ = Sᵀ·KGᵀ, Oᵀ = Sᵀ·QGᵀ (n = chunk rows r, k = key channels i).
    km_wait2();
    __syncthreads();  // KG, QG, V of chunk ci landed; every warp is done with chunk ci-1
    if (ci > 0) load_g3(ci);
    float pk[8][4], o[8][4];
#pragma unroll
    for (int nt = 0; nt < 8; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) pk[nt][e] = o[nt][e] = 0.0f;
#pragma unroll
    for (int ks = 0; ks < D / 16; ++ks) {
      uint32_t ah[4], al[4];
      km_afrag<SPLIT>(st[2 * ks], st[2 * ks + 1], ah, al);
#pragma unroll
      for (int np = 0; np < 4; ++np) {
        const uint32_t off = (np * 16 * L::LD + ks * 16) * 2;
        km_mma2<SPLIT, false>(pk[2 * np], pk[2 * np + 1], ah, al, kga + off, lod);
        km_mma2<SPLIT, false>(o[2 * np], o[2 * np + 1], ah, al, qga + off, lod);
      }
    }
    // Xᵀ = Vᵀ − Pᵀ, as A fragments over k = chunk rows.
    uint32_t xh[4][4], xl[4][4];
    {
#pragma unroll
      for (int nt = 0; nt < 8; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e)
          pk[nt][e] = Vs[(8 * nt + 2 * c + (e & 1)) * L::LV + jw + g + 8 * (e >> 1)] - pk[nt][e];
#pragma unroll
      for (int ks = 0; ks < 4; ++ks) km_afrag<SPLIT>(pk[2 * ks], pk[2 * ks + 1], xh[ks], xl[ks]);
    }
    // ---- phase 1: V'ᵀ = Xᵀ·Tᵀ; tiles with k-step ks > n-pair np are zero.
    km_wait2();
    __syncthreads();  // T landed; KG, QG, V are free
    load_g0(ci + 1);
    float vn[8][4];
#pragma unroll
    for (int nt = 0; nt < 8; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) vn[nt][e] = 0.0f;
#pragma unroll
    for (int np = 0; np < 4; ++np)
#pragma unroll
      for (int ks = 0; ks <= np; ++ks)
        km_mma2<SPLIT, false>(vn[2 * np], vn[2 * np + 1], xh[ks], xl[ks],
                              ta + (np * 16 * L::LC + ks * 16) * 2, loc);
    uint32_t uh[4][4], ul[4][4];
#pragma unroll
    for (int ks = 0; ks < 4; ++ks) km_afrag<SPLIT>(vn[2 * ks], vn[2 * ks + 1], uh[ks], ul[ks]);
    // ---- phase 2: Oᵀ += V'ᵀ·Aᵀ (causal tiles), then the output rows of this chunk.
    km_wait2();
    __syncthreads();  // A landed; T is free
    load_g1(ci + 1);
#pragma unroll
    for (int np = 0; np < 4; ++np)
#pragma unroll
      for (int ks = 0; ks <= np; ++ks)
        km_mma2<SPLIT, false>(o[2 * np], o[2 * np + 1], uh[ks], ul[ks],
                              aa + (np * 16 * L::LC + ks * 16) * 2, loc);
#pragma unroll
    for (int nt = 0; nt < 8; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = 8 * nt + 2 * c + (e & 1);
        if (r < l) out[(size_t)(row0 + r) * width + hoff + colg + 8 * (e >> 1)] = o[nt][e];
      }
    // ---- phase 3: Sᵀ = Sᵀ ⊙ γ + V'ᵀ·Kd (n = key channels, k = chunk rows).
    km_wait2();
    __syncthreads();  // Kd, γ landed; A is free
    load_g2(ci + 1);
#pragma unroll
    for (int nt = 0; nt < NTD; ++nt) {
      const float2 gm = *reinterpret_cast<const float2*>(Gs + 8 * nt + 2 * c);
      st[nt][0] *= gm.x;
      st[nt][1] *= gm.y;
      st[nt][2] *= gm.x;
      st[nt][3] *= gm.y;
    }
#pragma unroll
    for (int np = 0; np < D / 16; ++np)
#pragma unroll
      for (int ks = 0; ks < 4; ++ks)
        km_mma2<SPLIT, true>(st[2 * np], st[2 * np + 1], uh[ks], ul[ks],
                             kda + (ks * 16 * L::LD + np * 16) * 2, lod);
  }
  asm volatile("cp.async.wait_group 0;\n" ::: "memory");
#pragma unroll
  for (int nt = 0; nt < NTD; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e)
      S[(size_t)(8 * nt + 2 * c + (e & 1)) * D + colg + 8 * (e >> 1)] = st[nt][e];
}

#define KDA_CHUNK_MMA(D)                                                                      \
  extern "C" __global__ void __launch_bounds__(256, 2) kda_chunk_prep_mma_##D(               \
      const float* q, const float* k, const float* g, const float* beta, const KdaSegs segs,  \
      float* scratch, int H, int split) {                                                     \
    pdl_enter();                                                                              \
    chunk_prep<D, true>(q, k, g, beta, segs, scratch, H, split != 0);                         \
  }                                                                                           \
  extern "C" __global__ void __launch_bounds__(32 * km::NW, 1) kda_chunk_mma_##D##_split(    \
      const float* v, const KdaSegs segs, const unsigned char* scratch, float* out, int H) {  \
    pdl_enter();                                                                              \
    chunk_mma<D, true>(v, segs, scratch, out, H);                                             \
  }                                                                                           \
  extern "C" __global__ void __launch_bounds__(32 * km::NW, 1) kda_chunk_mma_##D##_half(     \
      const float* v, const KdaSegs segs, const unsigned char* scratch, float* out, int H) {  \
    pdl_enter();                                                                              \
    chunk_mma<D, false>(v, segs, scratch, out, H);                                            \
  }
KDA_CHUNK_MMA(64)
KDA_CHUNK_MMA(128)


// ------------------------------------------------------------------------------------------
//  kda_chunk_prep_blk_D   as kda_chunk_prep_mma_D (same scratch), with A and L by 16-row
//  blocks: pairs (r, c) inside one diagonal block by running products as chunk_prep; pairs
//  across blocks Cb < R factor through the end of block Cb,
//      P(c, r) = bl_c · Π_{Cb<m<R} gt_m · fl_r     (every factor a product of e^g <= 1),
//  so A and L there are plain products of 16 × D tiles (split bf16 MMAs; no running product
//  per pair, ~1/4 of the pair loop left). Shared memory as kda_chunk_prep_D, with gt_1, gt_2
//  (then β) after M.
template <int D>
__device__ void chunk_prep_blk(const float* q, const float* k, const float* g, const float* beta,
                               const KdaSegs& segs, float* scratch, int H, bool split) {
  constexpr int C = KDA_C, NT = 256, SL = D / 8, NB = C / 16;
  static_assert(NB == 4 && 2 * D >= C, "blocked prep layout");
  extern __shared__ __align__(16) float sm[];
  float* Qs = sm;            // [C][D] q̂, then q̂ ⊙ fl
  float* Ks = Qs + C * D;    // [C][D] k̂, then k̂ ⊙ fl
  float* As = Ks + C * D;    // [C][D] exp(g), then k̂ ⊙ bl
  float* Ms = As + C * D;    // [C][C]
  float* Xs = Ms + C * C;    // [2][D] gt_1, gt_2; then [C] β
  const int gc = blockIdx.x, h = blockIdx.y, tid = threadIdx.x;
  const int lane = tid & 31, w = tid >> 5;
  const int sg = seg_of_chunk(segs, gc);
  const int ci = gc - segs.chunk0[sg];
  const int row0 = segs.start[sg] + ci * C;
  const int l = min(C, segs.len[sg] - ci * C);
  const size_t width = (size_t)H * D;
  // q, k and g straight into shared memory, every copy of the block in flight at once
  // (rows past the chunk's end read as zeros: g = 0 makes e^g = 1); each thread then turns
  // its own g values into e^g (its copies are visible to it after the wait).
  for (int e = tid; e < C * D / 4; e += NT) {
    const int r = e / (D / 4), i = (e % (D / 4)) * 4;
    const size_t off = (size_t)(row0 + min(r, l - 1)) * width + (size_t)h * D + i;
    km_cp16(smem_addr(Qs + r * D + i), q + off, r < l);
    km_cp16(smem_addr(Ks + r * D + i), k + off, r < l);
    km_cp16(smem_addr(As + r * D + i), g + off, r < l);
  }
  km_commit();
  for (int e = tid; e < C * C; e += NT) Ms[e] = 0.0f;
  asm volatile("cp.async.wait_group 0;\n" ::: "memory");
  for (int e = tid; e < C * D / 4; e += NT) {
    const float4 gv = ld4(As + 4 * e);
    st4(As + 4 * e, make_float4(expf(gv.x), expf(gv.y), expf(gv.z), expf(gv.w)));
  }
  const float bt = tid < l ? beta[(size_t)(row0 + tid) * H + h] : 0.0f;  // used by tid < C
  __syncthreads();
  const float qscale = 1.0f / sqrtf((float)D);
  for (int r = w; r < C; r += NT / 32) {
    float sq = 0.0f, sk = 0.0f;
#pragma unroll
    for (int u = 0; u < D / 32; ++u) {
      const float a = Qs[r * D + lane + 32 * u], b = Ks[r * D + lane + 32 * u];
      sq += a * a;
      sk += b * b;
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      sq += __shfl_xor_sync(0xffffffffu, sq, o);
      sk += __shfl_xor_sync(0xffffffffu, sk, o);
    }
    const float rq = qscale / sqrtf(sq + 1e-6f), rk = 1.0f / sqrtf(sk + 1e-6f);
#pragma unroll
    for (int u = 0; u < D / 32; ++u) {
      Qs[r * D + lane + 32 * u] *= rq;
      Ks[r * D + lane + 32 * u] *= rk;
    }
  }
  __syncthreads();
  // Diagonal blocks, as chunk_prep's pair loop with r limited to c's block: lane group
  // p = tid/8 takes c = p and c = C-1-p; a warp's four c share one block.
  {
    const int p = tid >> 3, sl = tid & 7;
#pragma unroll 1
    for (int pass = 0; pass < 2; ++pass) {
      const int c = pass == 0 ? p : C - 1 - p;
      const int rmin = pass == 0 ? 4 * w : C - 4 - 4 * w;
      const int rend = min(l, (rmin & ~15) + 16);
      float run[SL];
#pragma unroll
      for (int u = 0; u < D / 32; ++u) {
        const float4 kv = ld4(Ks + c * D + 32 * u + 4 * sl);
        run[4 * u] = kv.x, run[4 * u + 1] = kv.y, run[4 * u + 2] = kv.z, run[4 * u + 3] = kv.w;
      }
      for (int r = rmin; r < rend; ++r) {
        const bool later = r > c;
        float pl = 0.0f, pa = 0.0f;
#pragma unroll
        for (int u = 0; u < D / 32; ++u) {
          const int i = r * D + 32 * u + 4 * sl;
          const float4 av = ld4(As + i), kv = ld4(Ks + i), qv = ld4(Qs + i);
          if (later) {
            run[4 * u] *= av.x, run[4 * u + 1] *= av.y, run[4 * u + 2] *= av.z, run[4 * u + 3] *= av.w;
          }
          pl += kv.x * run[4 * u] + kv.y * run[4 * u + 1] + kv.z * run[4 * u + 2] + kv.w * run[4 * u + 3];
          pa += qv.x * run[4 * u] + qv.y * run[4 * u + 1] + qv.z * run[4 * u + 2] + qv.w * run[4 * u + 3];
        }
#pragma unroll
        for (int o = 4; o > 0; o >>= 1) {
          pl += __shfl_xor_sync(0xffffffffu, pl, o);
          pa += __shfl_xor_sync(0xffffffffu, pa, o);
        }
        if (sl == 0 && r >= c) {
          Ms[r * C + c] = pa;
          if (later) Ms[c * C + r] = pl;
        }
      }
    }
  }
  __syncthreads();
  // Block factors, thread C + i for channel i: Ks ← k̂ ⊙ fl, Qs ← q̂ ⊙ fl, As ← k̂ ⊙ bl.
  float gt[NB] = {1.0f, 1.0f, 1.0f, 1.0f};
  if (tid >= C && tid < C + D) {
    const int i = tid - C;
#pragma unroll
    for (int R = 0; R < NB; ++R) {
      float av[16], kv[16];
#pragma unroll
      for (int m = 0; m < 16; ++m) {
        av[m] = As[(16 * R + m) * D + i];
        kv[m] = Ks[(16 * R + m) * D + i];
      }
      float bl = 1.0f;
#pragma unroll
      for (int m = 15; m >= 0; --m) {
        As[(16 * R + m) * D + i] = kv[m] * bl;
        bl *= av[m];
      }
      float fl = 1.0f;
#pragma unroll
      for (int m = 0; m < 16; ++m) {
        fl *= av[m];
        Ks[(16 * R + m) * D + i] = kv[m] * fl;
        Qs[(16 * R + m) * D + i] *= fl;
      }
      gt[R] = fl;
    }
    Xs[i] = gt[1];
    Xs[D + i] = gt[2];
  }
  __syncthreads();
  // Blocks (R, Cb), Cb < R, one per warp, on the tensor cores: A[r][c] = Σ_i Qs[r][i] m_i
  // As[c][i] and L likewise from Ks, with m = Π_{Cb<m<R} gt_m. Rows r of block R are the
  // M side, columns c of block Cb the N side (two n-tiles), key channels the k side. The
  // order of the k slots is free as long as both operands agree: lane (g, q) of k-step ks
  // reads channels 16ks + 4q .. +3 as one float4 and puts them in k slots (2q, 2q+1) and
  // (2q+8, 2q+9). Each product is hi·hi + lo·hi + hi·lo (~2^-17 relative, as the state
  // pass's split), so the solve for T sees near-f32 L in either precision.
  if (w < 6) {
    const int R = w < 3 ? w + 1 : (w < 5 ? w - 1 : 3);
    const int Cb = w < 3 ? w : (w == 4 ? 1 : 0);
    if (16 * R < l) {
      const int g8 = lane >> 2, q4 = lane & 3;
      const float* qr = Qs + (16 * R + g8) * D + 4 * q4;
      const float* kr = Ks + (16 * R + g8) * D + 4 * q4;
      const float* br = As + (16 * Cb + g8) * D + 4 * q4;
      float ca[2][4] = {}, cl[2][4] = {};
#pragma unroll
      for (int ks = 0; ks < D / 16; ++ks) {
        const int i = 16 * ks;
        float4 m4 = make_float4(1.f, 1.f, 1.f, 1.f);
        if (w == 3 || w == 5) m4 = ld4(Xs + i + 4 * q4);
        if (w >= 4) {
          const float4 t = ld4(Xs + D + i + 4 * q4);
          m4 = make_float4(m4.x * t.x, m4.y * t.y, m4.z * t.z, m4.w * t.w);
        }
        uint32_t qh[4], ql[4], kh[4], kl[4];
        {
          const float4 a = ld4(qr + i), b = ld4(qr + 8 * D + i);
          km_split<true>(a.x, a.y, qh[0], ql[0]);
          km_split<true>(b.x, b.y, qh[1], ql[1]);
          km_split<true>(a.z, a.w, qh[2], ql[2]);
          km_split<true>(b.z, b.w, qh[3], ql[3]);
          const float4 c = ld4(kr + i), d = ld4(kr + 8 * D + i);
          km_split<true>(c.x, c.y, kh[0], kl[0]);
          km_split<true>(d.x, d.y, kh[1], kl[1]);
          km_split<true>(c.z, c.w, kh[2], kl[2]);
          km_split<true>(d.z, d.w, kh[3], kl[3]);
        }
#pragma unroll
        for (int t = 0; t < 2; ++t) {
          float4 b = ld4(br + 8 * t * D + i);
          b = make_float4(b.x * m4.x, b.y * m4.y, b.z * m4.z, b.w * m4.w);
          uint32_t bh0, bl0, bh1, bl1;
          km_split<true>(b.x, b.y, bh0, bl0);
          km_split<true>(b.z, b.w, bh1, bl1);
          km_mma(ca[t], qh, bh0, bh1);
          km_mma(ca[t], ql, bh0, bh1);
          km_mma(ca[t], qh, bl0, bl1);
          km_mma(cl[t], kh, bh0, bh1);
          km_mma(cl[t], kl, bh0, bh1);
          km_mma(cl[t], kh, bl0, bl1);
        }
      }
      // Accumulator e of n-tile t: row 16R + g8 + 8(e >> 1), column 16Cb + 8t + 2q4 + (e & 1).
#pragma unroll
      for (int t = 0; t < 2; ++t)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int r = 16 * R + g8 + 8 * (e >> 1), c = 16 * Cb + 8 * t + 2 * q4 + (e & 1);
          Ms[r * C + c] = ca[t][e];
          Ms[c * C + r] = cl[t][e];
        }
    }
  }
  __syncthreads();
  if (tid < C) Xs[tid] = bt;
  __syncthreads();
  prep_mma_tail<D, true>(Qs, Ks, As, Ms, Xs, scratch, gc * H + h, split, gt);
}

#define KDA_CHUNK_PREP_BLK(D)                                                                 \
  extern "C" __global__ void __launch_bounds__(256, 2) kda_chunk_prep_blk_##D(               \
      const float* q, const float* k, const float* g, const float* beta, const KdaSegs segs,  \
      float* scratch, int H, int split) {                                                     \
    pdl_enter();                                                                              \
    chunk_prep_blk<D>(q, k, g, beta, segs, scratch, H, split != 0);                           \
  }
KDA_CHUNK_PREP_BLK(64)
KDA_CHUNK_PREP_BLK(128)
