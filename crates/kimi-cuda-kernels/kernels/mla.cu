// Multi-head latent attention (spec §4); follows crates/kimi-cpu/src/mla.rs.
//
// Latent cache rows are c ‖ k_pe, lw = r + dr floats. Two forms:
//
// * Expanded (prefill): flash attention per (64-query tile, head) over the decompressed
//   kv [total, H*(dn+dv)] (k_nope ‖ v per head) and the k_pe columns of a contiguous
//   [total, lw] latent view. Online softmax, K/V tiles in shared memory, any length.
//   `mla_flash_prefill_mma` does the same on bf16 tensor cores (128-query tiles) where the
//   widths allow, with hi + lo operands for near-f32 results.
// * Absorbed (decode, small segments): q_lat = W_ukᵀ q_nope per (token, head)
//   (`mla_q_absorb`), split-KV attention of 32 query rows (token, head) over chunks of
//   latent rows (`mla_decode_partial`, all heads of a token share each latent row read),
//   a log-sum-exp merge of the chunks (`mla_decode_combine`), then out = W_uv o_lat
//   (`mla_uv_project`). Latent rows are read through an optional block table.
//
// Scores are kept in the log2 domain (scale · log2 e folded in) so exp2f is the only
// transcendental; that matches the CPU's exp(x − max) to f32 rounding.
#include "mla_decode.cuh"

// ---------------------------------------------------------------- expanded (flash) prefill

namespace fp {
constexpr int BM = 64;    // queries per CTA
constexpr int BN = 64;    // keys per tile
constexpr int NT = 256;   // threads: 16 x 16, each a 4x4 patch of S and 4x8 of O
constexpr int LDV = 128;  // V tile row stride; dv <= 128
constexpr int LDP = 68;   // P tile row stride (4 mod 32)
}  // namespace fp

// Dynamic shared memory of the flash prefill kernel, in bytes.
__host__ __device__ __forceinline__ size_t flash_smem_bytes(int dq) {
  return (size_t)(2 * fp::BM * smem_ld(dq) + fp::BN * fp::LDV + fp::BM * fp::LDP) * 4;
}

// One (query tile, head). VEC: every width (dn, dr, dv, r) is a multiple of 4 and every
// base pointer 16-byte aligned, so tiles move as 16-byte cp.async copies; otherwise
// scalar loads.
template <bool VEC>
__device__ __forceinline__ void flash_prefill(const float* __restrict__ q,
                                              const float* __restrict__ cache,
                                              const float* __restrict__ kv,
                                              float* __restrict__ out, int past, int len, int H,
                                              int r, int dn, int dr, int dv, float scale_log2) {
  using namespace fp;
  extern __shared__ __align__(16) float sm[];
  const int dq = dn + dr, ldq = smem_ld(dq), dq4 = (dq + 3) & ~3;
  const int lw = r + dr, ph = dn + dv, total = past + len;
  float* Qs = sm;                 // [BM][ldq]
  float* Ks = Qs + BM * ldq;      // [BN][ldq]
  float* Vs = Ks + BN * ldq;      // [BN][LDV]
  float* Ps = Vs + BN * LDV;      // [BM][LDP]
  const int tid = threadIdx.x, tx = tid & 15, ty = tid >> 4;
  const int h = blockIdx.y;
  // Longest (last) query tiles first: causal work grows with the tile index.
  const int qt0 = (gridDim.x - 1 - blockIdx.x) * BM;

  // Zero everything once: pad columns are never loaded and must stay finite.
  const int smem_floats = 2 * BM * ldq + BN * LDV + BM * LDP;
  for (int i = tid; i < smem_floats; i += NT) sm[i] = 0.0f;
  __syncthreads();

  auto load_q = [&]() {
    if constexpr (VEC) {
      const int c4 = dq / 4;
      for (int i = tid; i < BM * c4; i += NT) {
        const int row = i / c4, col = (i - row * c4) * 4, t = qt0 + row;
        float* dst = Qs + row * ldq + col;
        if (t < len) cp_async16(dst, q + ((size_t)t * H + h) * dq + col);
        else st4(dst, make_float4(0.f, 0.f, 0.f, 0.f));
      }
    } else {
      for (int i = tid; i < BM * dq; i += NT) {
        const int row = i / dq, col = i - row * dq, t = qt0 + row;
        Qs[row * ldq + col] = t < len ? q[((size_t)t * H + h) * dq + col] : 0.0f;
      }
    }
  };
  // K row s = k_nope(s, h) ‖ k_pe(s).
  auto load_k = [&](int s0) {
    if constexpr (VEC) {
      const int c4 = dq / 4;
      for (int i = tid; i < BN * c4; i += NT) {
        const int row = i / c4, col = (i - row * c4) * 4, s = s0 + row;
        float* dst = Ks + row * ldq + col;
        if (s >= total) st4(dst, make_float4(0.f, 0.f, 0.f, 0.f));
        else if (col < dn) cp_async16(dst, kv + ((size_t)s * H + h) * ph + col);
        else cp_async16(dst, cache + (size_t)s * lw + r + (col - dn));
      }
    } else {
      for (int i = tid; i < BN * dq; i += NT) {
        const int row = i / dq, col = i - row * dq, s = s0 + row;
        float v = 0.0f;
        if (s < total)
          v = col < dn ? kv[((size_t)s * H + h) * ph + col] : cache[(size_t)s * lw + r + col - dn];
        Ks[row * ldq + col] = v;
      }
    }
  };
  auto load_v = [&](int s0) {
    if constexpr (VEC) {
      const int c4 = dv / 4;
      for (int i = tid; i < BN * c4; i += NT) {
        const int row = i / c4, col = (i - row * c4) * 4, s = s0 + row;
        float* dst = Vs + row * LDV + col;
        if (s < total) cp_async16(dst, kv + ((size_t)s * H + h) * ph + dn + col);
        else st4(dst, make_float4(0.f, 0.f, 0.f, 0.f));
      }
    } else {
      for (int i = tid; i < BN * dv; i += NT) {
        const int row = i / dv, col = i - row * dv, s = s0 + row;
        Vs[row * LDV + col] = s < total ? kv[((size_t)s * H + h) * ph + dn + col] : 0.0f;
      }
    }
  };

  // Keys any row of this tile can see: s <= past + qt0 + BM - 1, s < total.
  const int kv_end = min(total, past + qt0 + BM);
  const int ntiles = (kv_end + BN - 1) / BN;

  float m[4], l[4], o[4][8];
#pragma unroll
  for (int a = 0; a < 4; ++a) {
    m[a] = -INFINITY;
    l[a] = 0.0f;
#pragma unroll
    for (int c = 0; c < 8; ++c) o[a][c] = 0.0f;
  }

  // cp.async groups: {Q, K0}, {V0}, then per tile {K j+1} and {V j+1} (possibly empty).
  load_q();
  load_k(0);
  cp_async_commit();
  load_v(0);
  cp_async_commit();

  for (int j = 0; j < ntiles; ++j) {
    const int s0 = j * BN;
    cp_async_wait1();  // Q and K_j have landed; V_j may be in flight
    __syncthreads();

    float sacc[4][4];
#pragma unroll
    for (int a = 0; a < 4; ++a)
#pragma unroll
      for (int b = 0; b < 4; ++b) sacc[a][b] = 0.0f;
#pragma unroll 2
    for (int k = 0; k < dq4; k += 4) {
      float4 qa[4], kb[4];
#pragma unroll
      for (int a = 0; a < 4; ++a) qa[a] = ld4(Qs + (ty + 16 * a) * ldq + k);
#pragma unroll
      for (int b = 0; b < 4; ++b) kb[b] = ld4(Ks + (tx + 16 * b) * ldq + k);
#pragma unroll
      for (int a = 0; a < 4; ++a)
#pragma unroll
        for (int b = 0; b < 4; ++b) sacc[a][b] = dot4(qa[a], kb[b], sacc[a][b]);
    }
    __syncthreads();  // every warp is done with K_j
    if (j + 1 < ntiles) load_k(s0 + BN);
    cp_async_commit();

    // Online softmax; the 16 threads sharing `ty` (one half-warp) hold a row's 64 scores.
#pragma unroll
    for (int a = 0; a < 4; ++a) {
      const int limit = past + qt0 + ty + 16 * a;  // last visible key of this row
      float v[4], mx = -INFINITY;
#pragma unroll
      for (int b = 0; b < 4; ++b) {
        const int s = s0 + tx + 16 * b;
        v[b] = (s <= limit && s < total) ? sacc[a][b] * scale_log2 : -INFINITY;
        mx = fmaxf(mx, v[b]);
      }
#pragma unroll
      for (int off = 8; off > 0; off >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
      // Key 0 is visible to every row, so mx is finite from the first tile on.
      const float mnew = fmaxf(m[a], mx);
      const float alpha = exp2f(m[a] - mnew);
      float sum = 0.0f;
#pragma unroll
      for (int b = 0; b < 4; ++b) {
        const float p = exp2f(v[b] - mnew);
        Ps[(ty + 16 * a) * LDP + tx + 16 * b] = p;
        sum += p;
      }
#pragma unroll
      for (int off = 8; off > 0; off >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, off);
      l[a] = l[a] * alpha + sum;
      m[a] = mnew;
#pragma unroll
      for (int c = 0; c < 8; ++c) o[a][c] *= alpha;
    }
    cp_async_wait1();  // V_j has landed (only K_{j+1} may be in flight)
    __syncthreads();   // ... for every thread, and P is complete

    const int kmax = min(BN, kv_end - s0);
#pragma unroll 1
    for (int k = 0; k < kmax; k += 4) {
      float4 pa[4];
#pragma unroll
      for (int a = 0; a < 4; ++a) pa[a] = ld4(Ps + (ty + 16 * a) * LDP + k);
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) {
        const float4 v0 = ld4(Vs + (k + kk) * LDV + tx * 4);
        const float4 v1 = ld4(Vs + (k + kk) * LDV + 64 + tx * 4);
#pragma unroll
        for (int a = 0; a < 4; ++a) {
          const float p = kk == 0 ? pa[a].x : kk == 1 ? pa[a].y : kk == 2 ? pa[a].z : pa[a].w;
          o[a][0] = fmaf(p, v0.x, o[a][0]);
          o[a][1] = fmaf(p, v0.y, o[a][1]);
          o[a][2] = fmaf(p, v0.z, o[a][2]);
          o[a][3] = fmaf(p, v0.w, o[a][3]);
          o[a][4] = fmaf(p, v1.x, o[a][4]);
          o[a][5] = fmaf(p, v1.y, o[a][5]);
          o[a][6] = fmaf(p, v1.z, o[a][6]);
          o[a][7] = fmaf(p, v1.w, o[a][7]);
        }
      }
    }
    __syncthreads();  // every warp is done with V_j and P
    if (j + 1 < ntiles) load_v(s0 + BN);
    cp_async_commit();
  }
  cp_async_wait0();

#pragma unroll
  for (int a = 0; a < 4; ++a) {
    const int t = qt0 + ty + 16 * a;
    if (t >= len) continue;
    const float inv = 1.0f / l[a];
    float* orow = out + ((size_t)t * H + h) * dv;
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      const int col = tx * 4 + 64 * c;
      if constexpr (VEC) {
        if (col < dv)
          st4(orow + col, make_float4(o[a][4 * c] * inv, o[a][4 * c + 1] * inv,
                                      o[a][4 * c + 2] * inv, o[a][4 * c + 3] * inv));
      } else {
#pragma unroll
        for (int e = 0; e < 4; ++e)
          if (col + e < dv) orow[col + e] = o[a][4 * c + e] * inv;
      }
    }
  }
}

// Grid (ceil(len / 64), H), block 256, dynamic shared memory flash_smem_bytes(dn + dr).
// q [len, H*(dn+dr)] (this segment's rows), cache [total, r+dr] contiguous, kv
// [total, H*(dn+dv)], out [len, H*dv]; total = past + len; dv <= 128.
extern "C" __global__ void __launch_bounds__(256, 1)
    mla_flash_prefill(const float* q, const float* cache, const float* kv, float* out, int past,
                      int len, int H, int r, int dn, int dr, int dv, float scale_log2) {
  pdl_enter();
  flash_prefill<false>(q, cache, kv, out, past, len, H, r, dn, dr, dv, scale_log2);
}

// As mla_flash_prefill, with dn, dr, dv, r multiples of 4 and 16-byte aligned pointers.
extern "C" __global__ void __launch_bounds__(256, 1)
    mla_flash_prefill_vec(const float* q, const float* cache, const float* kv, float* out,
                          int past, int len, int H, int r, int dn, int dr, int dv,
                          float scale_log2) {
  pdl_enter();
  flash_prefill<true>(q, cache, kv, out, past, len, H, r, dn, dr, dv, scale_log2);
}

// ---------------------------------------------------------------- expanded prefill on tensor cores

// The same attention as flash_prefill with both products on bf16 tensor cores
// (mma.sync m16n8k16, f32 accumulators). Each f32 operand x is held as hi = bf16(x) and,
// with `split`, lo = bf16(x - hi); a product is then hi·hi + lo·hi + hi·lo (three MMAs),
// which leaves ~2^-17 relative error per product (the dropped lo·lo and lo's own rounding)
// instead of bf16's 2^-9. Softmax statistics and the output stay in f32 registers.
namespace fm {
// 8 warps of 16 query rows. Q (hi and lo) plus one K and one V tile take 184 KiB of shared
// memory at dq = 192, dv = 128, so one CTA fills an SM whatever its size: 8 warps rather than
// 4 keep more MMAs in flight per SM and halve the K/V reads and bf16 conversions per query.
constexpr int BM = 128;  // queries per CTA
constexpr int BN = 64;   // keys per tile
constexpr int NT = 256;  // threads
// float4s per thread of the next K / V tile held in registers while the current tile is
// multiplied (16 threads per row, 4 rows of 16): K columns beyond 192 (dq > 192) are loaded
// when stored instead; dv <= 128 always fits.
constexpr int KPF = 12;
constexpr int VPF = 8;
}  // namespace fm

// Dynamic shared memory of mla_flash_prefill_mma, in bytes: Q, K, V as hi and lo bf16 rows
// padded by 8 elements (an odd number of 16-byte units per row, so ldmatrix's eight row
// reads hit eight different bank groups).
__host__ __device__ __forceinline__ size_t flash_mma_smem_bytes(int dq, int dv) {
  return (size_t)4 * (fm::BM + fm::BN) * (dq + 8) + (size_t)4 * fm::BN * (dv + 8);
}

__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr)
               : "memory");
}
__device__ __forceinline__ void ldsm_x4_t(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr)
               : "memory");
}
// c += a·b for one m16n8k16 tile (bf16 in, f32 accumulate).
__device__ __forceinline__ void mma16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                         uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
__device__ __forceinline__ uint32_t bf2_bits(__nv_bfloat162 v) {
  return *reinterpret_cast<uint32_t*>(&v);
}
// (x, y) -> hi = bf16 pair (x in the low half), lo = bf16 pair of the remainders.
__device__ __forceinline__ void split2(float x, float y, uint32_t& hi, uint32_t& lo) {
  const __nv_bfloat162 h = __floats2bfloat162_rn(x, y);
  const float2 hf = __bfloat1622float2(h);
  hi = bf2_bits(h);
  lo = bf2_bits(__floats2bfloat162_rn(x - hf.x, y - hf.y));
}
// Four floats to bf16 at hi (and their remainders at lo), 8 bytes each.
template <bool SPLIT>
__device__ __forceinline__ void st_split4(__nv_bfloat16* hi, __nv_bfloat16* lo, float4 v) {
  uint32_t h0, l0, h1, l1;
  split2(v.x, v.y, h0, l0);
  split2(v.z, v.w, h1, l1);
  *reinterpret_cast<uint2*>(hi) = make_uint2(h0, h1);
  if constexpr (SPLIT) *reinterpret_cast<uint2*>(lo) = make_uint2(l0, l1);
}

// One (128-query tile, head); widths and pointers as mla_flash_prefill_mma requires.
template <bool SPLIT>
__device__ __forceinline__ void flash_prefill_mma(const float* __restrict__ q,
                                                  const float* __restrict__ cache,
                                                  const float* __restrict__ kv,
                                                  float* __restrict__ out, int past, int len,
                                                  int H, int r, int dn, int dr, int dv,
                                                  float scale_log2) {
  using namespace fm;
  extern __shared__ __align__(16) float sm[];
  const int dq = dn + dr, ldk = dq + 8, ldv = dv + 8;
  const int lw = r + dr, ph = dn + dv, total = past + len;
  __nv_bfloat16* Qh = reinterpret_cast<__nv_bfloat16*>(sm);  // [BM][ldk]
  __nv_bfloat16* Ql = Qh + BM * ldk;                          // [BM][ldk]
  __nv_bfloat16* Kh = Ql + BM * ldk;                          // [BN][ldk]
  __nv_bfloat16* Kl = Kh + BN * ldk;                          // [BN][ldk]
  __nv_bfloat16* Vh = Kl + BN * ldk;                          // [BN][ldv]
  __nv_bfloat16* Vl = Vh + BN * ldv;                          // [BN][ldv]
  const int tid = threadIdx.x, lane = tid & 31, w = tid >> 5;
  const int g = lane >> 2, c = lane & 3;
  const int h = blockIdx.y;
  // Longest (last) query tiles first: causal work grows with the tile index.
  const int qt0 = (gridDim.x - 1 - blockIdx.x) * BM;
  // Loader layout: 16 threads per row, each a float4 column in every 16.
  const int cl = tid & 15, rg = tid >> 4;

  const float4 zero4 = make_float4(0.f, 0.f, 0.f, 0.f);
  // K row s (zero past the end): k_nope(s, h) ‖ k_pe(s); col a multiple of 4.
  auto k_at = [&](int s, int col) -> float4 {
    if (s >= total) return zero4;
    return col < dn ? ld4(kv + ((size_t)s * H + h) * ph + col)
                    : ld4(cache + (size_t)s * lw + r + (col - dn));
  };
  auto v_at = [&](int s, int col) -> float4 {
    if (s >= total) return zero4;
    return ld4(kv + ((size_t)s * H + h) * ph + dn + col);
  };
  // Rows rg + 16i, float4 columns cl + 16jc of a key tile.
  auto fetch_k = [&](int s0, float4 (&reg)[KPF]) {
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
      for (int jc = 0; jc < 3; ++jc) {
        const int col = (cl + 16 * jc) * 4;
        reg[i * 3 + jc] = col < dq ? k_at(s0 + rg + 16 * i, col) : zero4;
      }
  };
  auto put_k = [&](int s0, const float4 (&reg)[KPF]) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int row = rg + 16 * i;
#pragma unroll
      for (int jc = 0; jc < 3; ++jc) {
        const int col = (cl + 16 * jc) * 4;
        const int at = row * ldk + col;
        if (col < dq) st_split4<SPLIT>(Kh + at, Kl + at, reg[i * 3 + jc]);
      }
      const int col = (cl + 48) * 4, at = row * ldk + col;
      if (col < dq) st_split4<SPLIT>(Kh + at, Kl + at, k_at(s0 + row, col));
    }
  };
  auto fetch_v = [&](int s0, float4 (&reg)[VPF]) {
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
      for (int jc = 0; jc < 2; ++jc) {
        const int col = (cl + 16 * jc) * 4;
        reg[i * 2 + jc] = col < dv ? v_at(s0 + rg + 16 * i, col) : zero4;
      }
  };
  auto put_v = [&](const float4 (&reg)[VPF]) {
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
      for (int jc = 0; jc < 2; ++jc) {
        const int col = (cl + 16 * jc) * 4, at = (rg + 16 * i) * ldv + col;
        if (col < dv) st_split4<SPLIT>(Vh + at, Vl + at, reg[i * 2 + jc]);
      }
  };

  // Keys any row of this tile can see: s <= past + qt0 + BM - 1, s < total.
  const int kv_end = min(total, past + qt0 + BM);
  const int ntiles = (kv_end + BN - 1) / BN;
  // This warp's rows qt0 + 16w .. +15: the last key any of them sees (rows past len see
  // keys up to total - 1 at most, which the s < total test covers).
  const int wrow0 = qt0 + 16 * w;
  const bool has_rows = wrow0 < len;
  const int wlast = past + wrow0 + 15;

  // Prologue: K_0 and V_0 loads in flight while Q is converted.
  float4 kreg[KPF], vreg[VPF];
  fetch_k(0, kreg);
  fetch_v(0, vreg);
#pragma unroll 1
  for (int i = 0; i < BM / 16; ++i) {
    const int row = rg + 16 * i, t = qt0 + row;
#pragma unroll
    for (int jc = 0; jc < 4; ++jc) {
      const int col = (cl + 16 * jc) * 4;
      if (col < dq) {
        const float4 x = t < len ? ld4(q + ((size_t)t * H + h) * dq + col) : zero4;
        st_split4<SPLIT>(Qh + row * ldk + col, Ql + row * ldk + col, x);
      }
    }
  }
  put_k(0, kreg);
  __syncthreads();

  // ldmatrix lane addresses (bytes). A (Q rows, row-major): lanes 0-15 rows 0-15 at k 0,
  // lanes 16-31 rows 0-15 at k 8 -> a0..a3. B of QKᵀ (K rows = n, k contiguous): lanes
  // 0-7 keys 0-7 / k 0, 8-15 keys 0-7 / k 8, 16-23 keys 8-15 / k 0, 24-31 keys 8-15 / k 8 ->
  // (b0, b1) of n-tiles 2np and 2np+1. B of P·V through .trans (V rows = k, n contiguous):
  // lanes 0-7 keys 0-7 / cols 0-7, 8-15 keys 8-15 / cols 0-7, 16-23 keys 0-7 / cols 8-15,
  // 24-31 keys 8-15 / cols 8-15 -> (b0, b1) of n-tiles 2np and 2np+1.
  const uint32_t qa = smem_addr(Qh + (16 * w + (lane & 15)) * ldk + (lane >> 4) * 8);
  const int l7 = lane & 7, l8 = (lane >> 3) & 1, l16 = lane >> 4;
  const uint32_t ka = smem_addr(Kh + (l7 + 8 * l16) * ldk + 8 * l8);
  const uint32_t va = smem_addr(Vh + (l7 + 8 * l8) * ldv + 8 * l16);
  const uint32_t qlo = BM * ldk * 2, klo = BN * ldk * 2, vlo = BN * ldv * 2;  // hi -> lo

  // Rows g and g + 8 of the warp's 16: running max (log2 domain), this thread's share of
  // the running sum (its quad's four shares add up at the end) and O (n-tile, C fragment).
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
  float o[16][4];
#pragma unroll
  for (int nt = 0; nt < 16; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) o[nt][e] = 0.0f;

  // Per tile j: S = Q K_jᵀ; V_j to shared memory; K_{j+1} loads issued; softmax; sync;
  // O += P V_j; V_{j+1} loads issued; K_{j+1} to shared memory; sync. K_{j+1}'s loads are
  // covered by P·V, V_{j+1}'s by the next QKᵀ. Ks is written only after the first sync
  // (every warp done with S), Vs only after the previous tile's second (done with P·V).
  for (int j = 0; j < ntiles; ++j) {
    const int s0 = j * BN;
    const bool active = has_rows && s0 <= wlast;
    // Keys of this tile that any row of the warp sees (>= 1 when active: s0 < kv_end).
    const int nvis = min(BN, min(total, wlast + 1) - s0);
    float sacc[8][4];
#pragma unroll
    for (int nt = 0; nt < 8; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) sacc[nt][e] = 0.0f;
    if (active) {
      const int npairs = (nvis + 15) >> 4;
#pragma unroll 1
      for (int ks = 0; ks < dq / 16; ++ks) {
        uint32_t ah[4], al[4];
        ldsm_x4(ah, qa + ks * 32);
        if constexpr (SPLIT) ldsm_x4(al, qa + qlo + ks * 32);
#pragma unroll
        for (int np = 0; np < 4; ++np) {
          if (np < npairs) {
            const uint32_t kb = ka + (np * 16 * ldk + ks * 16) * 2;
            uint32_t bh[4];
            ldsm_x4(bh, kb);
            mma16816(sacc[2 * np], ah, bh[0], bh[1]);
            mma16816(sacc[2 * np + 1], ah, bh[2], bh[3]);
            if constexpr (SPLIT) {
              uint32_t bl[4];
              ldsm_x4(bl, kb + klo);
              mma16816(sacc[2 * np], al, bh[0], bh[1]);
              mma16816(sacc[2 * np + 1], al, bh[2], bh[3]);
              mma16816(sacc[2 * np], ah, bl[0], bl[1]);
              mma16816(sacc[2 * np + 1], ah, bl[2], bl[3]);
            }
          }
        }
      }
    }
    put_v(vreg);
    if (j + 1 < ntiles) fetch_k(s0 + BN, kreg);

    // Online softmax. sacc[nt][2rr + e] is row g + 8rr, key s0 + 8nt + 2c + e; the C
    // fragments of keys 16kk .. 16kk+15 (n-tiles 2kk, 2kk+1) are the A fragment of P·V.
    uint32_t ph_[4][4], pl_[4][4];
    if (active) {
      // Every key of the tile visible to every row of the warp: no mask needed.
      const bool full = s0 + BN - 1 <= past + wrow0 && s0 + BN <= total;
      float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
      for (int nt = 0; nt < 8; ++nt)
#pragma unroll
        for (int rr = 0; rr < 2; ++rr)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            float v = sacc[nt][2 * rr + e] * scale_log2;
            if (!full) {
              const int s = s0 + 8 * nt + 2 * c + e;
              if (s > past + wrow0 + g + 8 * rr || s >= total) v = -INFINITY;
            }
            sacc[nt][2 * rr + e] = v;
            mx[rr] = fmaxf(mx[rr], v);
          }
      float ref[2];
#pragma unroll
      for (int rr = 0; rr < 2; ++rr) {
        mx[rr] = fmaxf(mx[rr], __shfl_xor_sync(0xffffffffu, mx[rr], 1));
        mx[rr] = fmaxf(mx[rr], __shfl_xor_sync(0xffffffffu, mx[rr], 2));
        const float mnew = fmaxf(m[rr], mx[rr]);
        // A row with no visible key yet keeps m = -inf; exponents then use 0 (all p = 0).
        ref[rr] = mnew == -INFINITY ? 0.0f : mnew;
        const float alpha = exp2f(m[rr] - ref[rr]);
        m[rr] = mnew;
        l[rr] *= alpha;
#pragma unroll
        for (int nt = 0; nt < 16; ++nt) {
          o[nt][2 * rr] *= alpha;
          o[nt][2 * rr + 1] *= alpha;
        }
      }
#pragma unroll
      for (int nt = 0; nt < 8; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const float p = exp2f(sacc[nt][e] - ref[e >> 1]);
          l[e >> 1] += p;
          sacc[nt][e] = p;
        }
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) {
        split2(sacc[2 * kk][0], sacc[2 * kk][1], ph_[kk][0], pl_[kk][0]);
        split2(sacc[2 * kk][2], sacc[2 * kk][3], ph_[kk][1], pl_[kk][1]);
        split2(sacc[2 * kk + 1][0], sacc[2 * kk + 1][1], ph_[kk][2], pl_[kk][2]);
        split2(sacc[2 * kk + 1][2], sacc[2 * kk + 1][3], ph_[kk][3], pl_[kk][3]);
      }
    }
    __syncthreads();  // V_j stored by every thread

    if (active) {
      const int ksteps = (nvis + 15) >> 4;
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) {
        if (kk < ksteps) {
#pragma unroll
          for (int np = 0; np < 8; ++np) {
            if (np < dv / 16) {
              const uint32_t vb = va + (kk * 16 * ldv + np * 16) * 2;
              uint32_t bh[4];
              ldsm_x4_t(bh, vb);
              mma16816(o[2 * np], ph_[kk], bh[0], bh[1]);
              mma16816(o[2 * np + 1], ph_[kk], bh[2], bh[3]);
              if constexpr (SPLIT) {
                uint32_t bl[4];
                ldsm_x4_t(bl, vb + vlo);
                mma16816(o[2 * np], pl_[kk], bh[0], bh[1]);
                mma16816(o[2 * np + 1], pl_[kk], bh[2], bh[3]);
                mma16816(o[2 * np], ph_[kk], bl[0], bl[1]);
                mma16816(o[2 * np + 1], ph_[kk], bl[2], bl[3]);
              }
            }
          }
        }
      }
    }
    if (j + 1 < ntiles) {
      fetch_v(s0 + BN, vreg);
      put_k(s0 + BN, kreg);
      __syncthreads();  // K_{j+1} stored by every thread; every warp done with V_j
    }
  }

  if (!has_rows) return;
#pragma unroll
  for (int rr = 0; rr < 2; ++rr) {
    float sum = l[rr];
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
    sum += __shfl_xor_sync(0xffffffffu, sum, 2);
    const int t = wrow0 + g + 8 * rr;
    if (t >= len) continue;
    const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
    float* orow = out + ((size_t)t * H + h) * dv + 2 * c;
#pragma unroll
    for (int nt = 0; nt < 16; ++nt)
      if (nt < dv / 8)
        *reinterpret_cast<float2*>(orow + 8 * nt) =
            make_float2(o[nt][2 * rr] * inv, o[nt][2 * rr + 1] * inv);
  }
}

// Grid (ceil(len / 128), H), block 256, dynamic shared memory flash_mma_smem_bytes(dn + dr,
// dv). Arguments as mla_flash_prefill, plus split (1: hi/lo operands, near f32; 0: bf16).
// Needs dn + dr and dv multiples of 16, dn, dr, r multiples of 4, dn + dr <= 256, dv <= 128
// and 16-byte aligned pointers.
extern "C" __global__ void __launch_bounds__(fm::NT, 1)
    mla_flash_prefill_mma(const float* q, const float* cache, const float* kv, float* out,
                          int past, int len, int H, int r, int dn, int dr, int dv,
                          float scale_log2, int split) {
  pdl_enter();
  if (split)
    flash_prefill_mma<true>(q, cache, kv, out, past, len, H, r, dn, dr, dv, scale_log2);
  else
    flash_prefill_mma<false>(q, cache, kv, out, past, len, H, r, dn, dr, dv, scale_log2);
}

// ---------------------------------------------------------------- absorbed (split-KV) decode


// q_cat[(t*H + h)] = [W_uk[h]ᵀ q_nope(t, h) ‖ q_pe(t, h)] (width lw) for launch-local token
// t < ntok, whose q row is rows[t]. Grid (H, ceil(ntok / 8), ceil(r / 64)), block 256.
// Each thread's first QA_PRE weights load before `pdl_wait` (weights never depend on the
// previous kernel), all at once: in a loop, one or two loads at a time waited for DRAM, and
// a launch took 14.5 us for 4.2 MB at one token (ncu).
#define QA_PRE 32
template <int N>
struct IntC {
  static constexpr int value = N;
};
extern "C" __global__ void __launch_bounds__(256)
    mla_q_absorb(const float* q, const uint32_t* rows, int ntok, const void* kvb, int kdt,
                 float* qcat, int H, int r, int dn, int dr, int dv) {
  __shared__ float qn[8][256];  // dn <= 256
  const int h = blockIdx.x, t0 = blockIdx.y * 8, nt = min(8, ntok - t0);
  const int dq = dn + dr, lw = r + dr, ph = dn + dv;
  // CTA z covers columns z*64 .. z*64+63; its four 64-thread quarters split the dn rows of
  // W_uk and add up through shared memory (more CTAs in flight: at one token, H CTAs alone
  // read the weight far below the memory's bandwidth).
  __shared__ float part[4][8][64];
  const int cl = threadIdx.x & 63, quarter = threadIdx.x >> 6;
  const int c = blockIdx.z * 64 + cl;
  const size_t wk = (size_t)h * ph * r;
  uint32_t pre[QA_PRE];
  if (kdt == 0) {
#pragma unroll
    for (int m = 0; m < QA_PRE; ++m) {
      const int i = quarter + 4 * m;
      pre[m] = c < r && i < dn ? ld_raw(kvb, wk + (size_t)i * r + c, 0) : 0u;
    }
  } else {
#pragma unroll
    for (int m = 0; m < QA_PRE; ++m) {
      const int i = quarter + 4 * m;
      pre[m] = c < r && i < dn ? ld_raw(kvb, wk + (size_t)i * r + c, 1) : 0u;
    }
  }
  pdl_enter();
  for (int i = threadIdx.x; i < 8 * dn; i += blockDim.x) {
    const int k = i / dn, d = i - k * dn;
    qn[k][d] = k < nt ? q[((size_t)rows[t0 + k] * H + h) * dq + d] : 0.0f;
  }
  __syncthreads();
  // KT token rows: 1 when the CTA has one token (decode at B=1), else 8 (rows past nt are
  // zeros and never written out).
  auto products = [&](auto kt) {
    constexpr int KT = decltype(kt)::value;
    float acc[KT];
#pragma unroll
    for (int k = 0; k < KT; ++k) acc[k] = 0.0f;
    if (c < r) {
#pragma unroll
      for (int m = 0; m < QA_PRE; ++m) {
        const int i = quarter + 4 * m;
        if (i < dn) {
          const float w = raw_val(pre[m], kdt);
#pragma unroll
          for (int k = 0; k < KT; ++k) acc[k] = fmaf(qn[k][i], w, acc[k]);
        }
      }
      for (int i = quarter + 4 * QA_PRE; i < dn; i += 4) {
        const float w = ld(kvb, wk + (size_t)i * r + c, kdt);
#pragma unroll
        for (int k = 0; k < KT; ++k) acc[k] = fmaf(qn[k][i], w, acc[k]);
      }
    }
#pragma unroll
    for (int k = 0; k < KT; ++k) part[quarter][k][cl] = acc[k];
  };
  if (nt == 1) products(IntC<1>{});
  else products(IntC<8>{});
  __syncthreads();
  if (quarter == 0 && c < r)
    for (int k = 0; k < nt; ++k)
      qcat[((size_t)(t0 + k) * H + h) * lw + c] =
          (part[0][k][cl] + part[1][k][cl]) + (part[2][k][cl] + part[3][k][cl]);
  if (blockIdx.z != 0) return;
  for (int i = threadIdx.x; i < nt * dr; i += blockDim.x) {
    const int k = i / dr, e = i - k * dr;
    qcat[((size_t)(t0 + k) * H + h) * lw + r + e] =
        q[((size_t)rows[t0 + k] * H + h) * dq + dn + e];
  }
}


extern "C" __global__ void __launch_bounds__(256, 1)
    mla_decode_partial(const MlaSeq* seqs, int block_size, const float* qcat, float2* part_ml,
                       float* part_o, int nchunks, int H, int r, int dr, float scale_log2) {
  pdl_enter();
  decode_partial<false>(seqs, block_size, qcat, part_ml, part_o, nchunks, H, r, dr, scale_log2);
}

// As mla_decode_partial, with r and dr multiples of 4 and 16-byte aligned caches.
extern "C" __global__ void __launch_bounds__(256, 1)
    mla_decode_partial_vec(const MlaSeq* seqs, int block_size, const float* qcat,
                           float2* part_ml, float* part_o, int nchunks, int H, int r, int dr,
                           float scale_log2) {
  pdl_enter();
  decode_partial<true>(seqs, block_size, qcat, part_ml, part_o, nchunks, H, r, dr, scale_log2);
}

// o_lat[row] = Σ_x 2^(m_x − M) o_x / Σ_x 2^(m_x − M) l_x over the chunks x that saw a
// visible row (l_x > 0). Grid (rows), block 128.
extern "C" __global__ void mla_decode_combine(const float2* part_ml, const float* part_o,
                                              int nchunks, int r, float* olat) {
  pdl_enter();
  const size_t row = blockIdx.x;
  const float2* ml = part_ml + row * nchunks;
  float mx = -INFINITY;
  for (int x = 0; x < nchunks; ++x)
    if (ml[x].y > 0.0f) mx = fmaxf(mx, ml[x].x);
  float lsum = 0.0f;
  for (int x = 0; x < nchunks; ++x)
    if (ml[x].y > 0.0f) lsum += exp2f(ml[x].x - mx) * ml[x].y;
  const float inv = lsum > 0.0f ? 1.0f / lsum : 0.0f;
  for (int c = threadIdx.x; c < r; c += blockDim.x) {
    float acc = 0.0f;
    for (int x = 0; x < nchunks; ++x)
      if (ml[x].y > 0.0f) acc = fmaf(exp2f(ml[x].x - mx), part_o[(row * nchunks + x) * r + c], acc);
    olat[row * r + c] = acc * inv;
  }
}

// out[rows[t]*H + h] (width dv) = W_uv[h] · o_lat[t*H + h] for launch-local token t < ntok.
// Grid (H, ceil(ntok / 8), splits of the dv rows), block 256, dynamic shared memory 8*r floats.
// A warp's first UV_PRE_J output rows' first 32 * UV_PRE_C weights load before `pdl_wait`,
// all at once (as in mla_q_absorb: the loop's few loads in flight made it latency-bound,
// 14.6 us for 4.2 MB at one token under ncu).
#define UV_PRE_J 2
#define UV_PRE_C 16
extern "C" __global__ void __launch_bounds__(256)
    mla_uv_project(const float* olat, const uint32_t* rows, int ntok, const void* kvb, int kdt,
                   float* out, int H, int r, int dn, int dv) {
  extern __shared__ float os[];  // [8][r]
  const int h = blockIdx.x, t0 = blockIdx.y * 8, nt = min(8, ntok - t0);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  const size_t wv = ((size_t)h * (dn + dv) + dn) * r;
  // CTA z of gridDim.z takes every gridDim.z-th group of nw output rows.
  const int j0 = blockIdx.z * nw + warp, js = nw * gridDim.z;
  uint32_t pre[UV_PRE_J][UV_PRE_C];
  const int rdt = kdt == 0 ? 0 : 1;  // ld_raw's two widths
#pragma unroll
  for (int jj = 0; jj < UV_PRE_J; ++jj) {
    const int j = j0 + jj * js;
    if (rdt == 0) {
#pragma unroll
      for (int cc = 0; cc < UV_PRE_C; ++cc) {
        const int c = lane + 32 * cc;
        pre[jj][cc] = j < dv && c < r ? ld_raw(kvb, wv + (size_t)j * r + c, 0) : 0u;
      }
    } else {
#pragma unroll
      for (int cc = 0; cc < UV_PRE_C; ++cc) {
        const int c = lane + 32 * cc;
        pre[jj][cc] = j < dv && c < r ? ld_raw(kvb, wv + (size_t)j * r + c, 1) : 0u;
      }
    }
  }
  pdl_enter();
  for (int i = threadIdx.x; i < 8 * r; i += blockDim.x) {
    const int k = i / r, c = i - k * r;
    os[i] = k < nt ? olat[((size_t)(t0 + k) * H + h) * r + c] : 0.0f;
  }
  __syncthreads();
  // KT token rows: 1 when the CTA has one token (decode at B=1), else 8 (rows past nt are
  // zeros and never written out).
  auto products = [&](auto kt) {
    constexpr int KT = decltype(kt)::value;
    auto finish = [&](int j, float* acc) {
#pragma unroll
      for (int k = 0; k < KT; ++k)
#pragma unroll
        for (int off = 16; off > 0; off >>= 1)
          acc[k] += __shfl_xor_sync(0xffffffffu, acc[k], off);
      if (lane == 0)
        for (int k = 0; k < nt; ++k) out[((size_t)rows[t0 + k] * H + h) * dv + j] = acc[k];
    };
#pragma unroll
    for (int jj = 0; jj < UV_PRE_J; ++jj) {
      const int j = j0 + jj * js;
      if (j >= dv) break;
      float acc[KT];
#pragma unroll
      for (int k = 0; k < KT; ++k) acc[k] = 0.0f;
#pragma unroll
      for (int cc = 0; cc < UV_PRE_C; ++cc) {
        const int c = lane + 32 * cc;
        if (c < r) {
          const float w = raw_val(pre[jj][cc], kdt);
#pragma unroll
          for (int k = 0; k < KT; ++k) acc[k] = fmaf(w, os[k * r + c], acc[k]);
        }
      }
      for (int c = lane + 32 * UV_PRE_C; c < r; c += 32) {
        const float w = ld(kvb, wv + (size_t)j * r + c, kdt);
#pragma unroll
        for (int k = 0; k < KT; ++k) acc[k] = fmaf(w, os[k * r + c], acc[k]);
      }
      finish(j, acc);
    }
    for (int j = j0 + UV_PRE_J * js; j < dv; j += js) {
      float acc[KT];
#pragma unroll
      for (int k = 0; k < KT; ++k) acc[k] = 0.0f;
      for (int c = lane; c < r; c += 32) {
        const float w = ld(kvb, wv + (size_t)j * r + c, kdt);
#pragma unroll
        for (int k = 0; k < KT; ++k) acc[k] = fmaf(w, os[k * r + c], acc[k]);
      }
      finish(j, acc);
    }
  };
  if (nt == 1) products(IntC<1>{});
  else products(IntC<8>{});
}

// ---------------------------------------------------------------------------------------------

// Writes every row j of src [n, lw] that belongs to a sequence: where[2j] is the offset of
// that sequence's block table in `tables`, where[2j+1] the row's position (0xffffffff: not a
// cache row). One launch per layer for a whole batch; the positions are data, so a replayed
// decode graph needs no new arguments. Grid (n).
extern "C" __global__ void mla_paged_write_rows(const float* src, float* pool,
                                                const unsigned* tables, const unsigned* where,
                                                int bs, int lw) {
  pdl_enter();
  const int j = blockIdx.x;
  const unsigned pos = where[2 * j + 1];
  if (pos == 0xffffffffu) return;
  const float* from = src + (size_t)j * lw;
  float* to = pool + paged_row(tables + where[2 * j], bs, (int)pos) * lw;
  for (int i = threadIdx.x; i < lw; i += blockDim.x) to[i] = from[i];
}

// Gathers columns 0 .. ncols-1 of positions 0 .. total-1 into out [total, ncols]. Grid (total).
extern "C" __global__ void mla_paged_gather(const float* pool, const unsigned* table, int bs,
                                            int lw, int ncols, float* out) {
  pdl_enter();
  const int s = blockIdx.x;
  const float* from = pool + paged_row(table, bs, s) * lw;
  float* to = out + (size_t)s * ncols;
  for (int i = threadIdx.x; i < ncols; i += blockDim.x) to[i] = from[i];
}

// Operands of FlashInfer's Hopper prefill (`flashinfer/mla_prefill.cu`) for one segment,
// as bf16 with heads of fixed width: qb [len, H, dn+dr] (q as stored), kb [total, H, dn+dr]
// (k_nope of each head, then the shared k_pe of the latent row), vb [total, H, dv]. Four
// elements per thread; dn, dr and dv % 4 == 0, 16-byte aligned inputs.
extern "C" __global__ void mla_pack_bf16(const float* q, const float* cache, const float* kv,
                                         __nv_bfloat16* qb, __nv_bfloat16* kb,
                                         __nv_bfloat16* vb, int len, int total, int H, int r,
                                         int dn, int dr, int dv) {
  pdl_enter();
  const int dq = dn + dr, ph = dn + dv, lw = r + dr;
  const size_t nq = (size_t)len * H * dq / 4, nk = (size_t)total * H * dq / 4,
               nv = (size_t)total * H * dv / 4;
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < nq + nk + nv;
       i += (size_t)gridDim.x * blockDim.x) {
    float4 x;
    __nv_bfloat16* dst;
    if (i < nq) {
      x = reinterpret_cast<const float4*>(q)[i];
      dst = qb + 4 * i;
    } else if (i < nq + nk) {
      const size_t j = i - nq, e = 4 * j;
      const size_t s = e / ((size_t)H * dq);
      const int h = (int)(e / dq % H), c = (int)(e % dq);
      x = c < dn ? *reinterpret_cast<const float4*>(kv + (s * H + h) * ph + c)
                 : *reinterpret_cast<const float4*>(cache + s * lw + r + (c - dn));
      dst = kb + e;
    } else {
      const size_t e = 4 * (i - nq - nk);
      const size_t s = e / ((size_t)H * dv);
      const int h = (int)(e / dv % H), c = (int)(e % dv);
      x = *reinterpret_cast<const float4*>(kv + (s * H + h) * ph + dn + c);
      dst = vb + e;
    }
    __align__(8) __nv_bfloat16 o[4] = {__float2bfloat16(x.x), __float2bfloat16(x.y),
                                        __float2bfloat16(x.z), __float2bfloat16(x.w)};
    *reinterpret_cast<uint2*>(dst) = *reinterpret_cast<const uint2*>(o);
  }
}
