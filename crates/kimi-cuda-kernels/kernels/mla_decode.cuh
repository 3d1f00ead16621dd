// Shared by mla.cu and mla_fp8.cu: small load helpers, the paged-row index and the
// split-KV decode kernel body, templated on how a tile of latent rows is loaded (f32 rows
// scalar or by cp.async, or FP8 E4M3 rows widened to f32 as they land in shared memory).
#pragma once
#include "common.cuh"

#include <cuda_fp8.h>

// ---------------------------------------------------------------- helpers

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
  unsigned s = (unsigned)__cvta_generic_to_shared(smem);
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
// Waits until at most one committed group is still in flight.
__device__ __forceinline__ void cp_async_wait1() { asm volatile("cp.async.wait_group 1;\n" ::); }
__device__ __forceinline__ void cp_async_wait0() { asm volatile("cp.async.wait_group 0;\n" ::); }

__device__ __forceinline__ float4 ld4(const float* p) { return *reinterpret_cast<const float4*>(p); }
__device__ __forceinline__ void st4(float* p, float4 v) { *reinterpret_cast<float4*>(p) = v; }
__device__ __forceinline__ float dot4(float4 a, float4 b, float acc) {
  acc = fmaf(a.x, b.x, acc);
  acc = fmaf(a.y, b.y, acc);
  acc = fmaf(a.z, b.z, acc);
  return fmaf(a.w, b.w, acc);
}

// Shared-memory row stride for rows of `w` floats: a multiple of 4 (16-byte rows for float4
// and cp.async) that is 4 mod 32, so 8 consecutive rows read at one column fall in 8
// different 16-byte bank groups.
__host__ __device__ __forceinline__ int smem_ld(int w) { return ((w + 31) / 32) * 32 + 4; }

// Paged latent caches: a layer's pool is [num_blocks, bs, r + dr]; a sequence finds position s
// in row s % bs of block table[s / bs] (u32 block ids). These move rows between a sequence's
// slots and contiguous buffers (new rows in; all rows out for the expanded prefill).
// Offset in rows of position s of a sequence in its pool.
__device__ __forceinline__ size_t paged_row(const unsigned* table, int bs, int s) {
  return (size_t)table[s / bs] * bs + s % bs;
}

// One sequence piece of an absorbed launch: its latent rows, `len` new queries at positions
// past .. past+len-1 (query token i sees latent rows 0 ..= past+i), whose rows in the
// launch-local q_cat / o_lat buffers start at token `row0` (row (row0 + i)*H + h).
// Latent row s lives at cache + s*lw, or with a block table at
// cache + (block_table[s / block_size] * block_size + s % block_size) * lw.
struct MlaSeq {
  const float* cache;
  const uint32_t* block_table;  // nullptr: contiguous rows
  int past;
  int len;
  int row0;
  int chunk_len;  // latent rows per split (a multiple of 16)
};

__device__ __forceinline__ const float* latent_row(const MlaSeq& s, int row, int block_size,
                                                   int lw) {
  if (s.block_table == nullptr) return s.cache + (size_t)row * lw;
  const size_t slot =
      (size_t)s.block_table[row / block_size] * block_size + (size_t)(row % block_size);
  return s.cache + slot * lw;
}

// FP8 latent caches (`--kv-cache-dtype fp8`, the CPU's `fp8_cache.rs` layout): a row is two
// f32 scales (c: columns < r; k_pe: the rest) and then lw E4M3 codes, 8 + lw bytes; value
// i = e4m3(code i) · scale[i >= r], widened exactly (E4M3 fits f16) and scaled in f32 as the
// CPU does, so both backends attend over the same f32 values.
__device__ __forceinline__ const uint8_t* fp8_row(const MlaSeq& s, int row, int block_size,
                                                  int lw) {
  const uint8_t* base = reinterpret_cast<const uint8_t*>(s.cache);
  const size_t slot =
      s.block_table == nullptr ? (size_t)row : paged_row(s.block_table, block_size, row);
  return base + slot * (size_t)(8 + lw);
}
__device__ __forceinline__ float e4m3_to_float(uint8_t b) {
  return __half2float(__half(__nv_cvt_fp8_to_halfraw(b, __NV_E4M3)));
}
// Codes `v & 0xff` (x) and `v >> 8` (y).
__device__ __forceinline__ float2 e4m3x2_to_float2(unsigned v) {
  return __half22float2(__half2(__nv_cvt_fp8x2_to_halfraw2((unsigned short)v, __NV_E4M3)));
}
// An f32 at any byte address (a row's scales are 4-byte aligned only when lw % 4 == 0).
__device__ __forceinline__ float ld_f32_bytes(const uint8_t* p) {
  const unsigned u = (unsigned)p[0] | ((unsigned)p[1] << 8) | ((unsigned)p[2] << 16) |
                     ((unsigned)p[3] << 24);
  return __uint_as_float(u);
}

namespace dc {
constexpr int BQ = 32;   // query rows (token, head) per CTA
constexpr int BK = 16;   // latent rows per tile
constexpr int NT = 256;  // 8 warps
constexpr int LDR = 17;  // row stride of the per-warp partial score tiles
}  // namespace dc

// Dynamic shared memory of mla_decode_partial, in bytes.
__host__ __device__ __forceinline__ size_t decode_smem_bytes(int lw) {
  using namespace dc;
  return (size_t)(BQ * smem_ld(lw) + 2 * BK * smem_ld(lw) + 8 * BQ * LDR + BK * BQ + 3 * BQ) * 4;
}

// Split-KV attention in the latent space. Grid (nchunks, row tiles, pieces), block 256,
// dynamic shared memory decode_smem_bytes(r + dr). CTA (x, y, z): piece z, query rows
// y*32 .. y*32+31 of its len*H rows (row = i*H + h), latent rows [x*chunk_len,
// (x+1)*chunk_len). Writes for each of its rows the chunk's running max m and sum l
// (log2 domain; m = -inf, l = 0 when it sees no row) to part_ml[row*nchunks + x] and the
// unnormalised Σ p·c to part_o[(row*nchunks + x)*r ..] (only when l > 0).
// r <= 512, r + dr <= 640. VEC: q and partial rows move as float4 (r, r + dr % 4 == 0) and,
// for f32 caches, tiles by cp.async (16-byte aligned caches). FP8: the cache holds FP8 rows
// (`fp8_row`), loaded with plain loads and widened to f32 on their way to shared memory,
// eight codes per 8-byte load where r and dr % 8 == 0.
template <bool VEC, bool FP8 = false>
__device__ __forceinline__ void decode_partial(const MlaSeq* __restrict__ seqs, int block_size,
                                               const float* __restrict__ qcat,
                                               float2* __restrict__ part_ml,
                                               float* __restrict__ part_o, int nchunks, int H,
                                               int r, int dr, float scale_log2) {
  using namespace dc;
  extern __shared__ __align__(16) float sm[];
  const MlaSeq sq = seqs[blockIdx.z];
  const int rows = sq.len * H, rt0 = blockIdx.y * BQ;
  if (rt0 >= rows) return;
  const int lw = r + dr, ldq = smem_ld(lw), lw4 = (lw + 3) & ~3;
  const int nrows = min(BQ, rows - rt0);
  const int x = blockIdx.x;
  const int total = sq.past + sq.len;
  // Latent rows of this chunk that any of its query rows can see.
  const int last_tok = (rt0 + nrows - 1) / H;
  const int c0 = x * sq.chunk_len;
  const int c1 = min(min(c0 + sq.chunk_len, total), sq.past + last_tok + 1);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const size_t grow0 = (size_t)sq.row0 * H + rt0;  // launch-local row of local row 0

  if (c0 >= c1) {
    if (tid < nrows) part_ml[(grow0 + tid) * nchunks + x] = make_float2(-INFINITY, 0.0f);
    return;
  }

  float* Qs = sm;                      // [BQ][ldq]
  float* Cs = Qs + BQ * ldq;           // [2][BK][ldq]
  float* red = Cs + 2 * BK * ldq;      // [8][BQ][LDR]
  float* Pt = red + 8 * BQ * LDR;      // [BK][BQ] (transposed probabilities)
  float* ms = Pt + BK * BQ;            // [BQ] running max
  float* ls = ms + BQ;                 // [BQ] running sum
  float* al = ls + BQ;                 // [BQ] this tile's rescale factor
  // Zero the tiles (pad columns are never loaded and must stay finite); the row stats
  // after them start at m = -inf, l = 0.
  const int tile_floats = BQ * ldq + 2 * BK * ldq + 8 * BQ * LDR + BK * BQ;
  for (int i = tid; i < tile_floats; i += NT) sm[i] = 0.0f;
  if (tid < BQ) {
    ms[tid] = -INFINITY;
    ls[tid] = 0.0f;
    al[tid] = 1.0f;
  }
  __syncthreads();

  auto load_q = [&]() {
    if constexpr (VEC) {
      const int c4 = lw / 4;
      for (int i = tid; i < nrows * c4; i += NT) {
        const int row = i / c4, col = (i - row * c4) * 4;
        cp_async16(Qs + row * ldq + col, qcat + (grow0 + row) * lw + col);
      }
    } else {
      for (int i = tid; i < nrows * lw; i += NT) {
        const int row = i / lw, col = i - row * lw;
        Qs[row * ldq + col] = qcat[(grow0 + row) * lw + col];
      }
    }
  };
  auto load_c = [&](int s0, int buf) {
    float* dst0 = Cs + buf * BK * ldq;
    if constexpr (FP8) {
      if ((r & 7) == 0 && (lw & 7) == 0) {
        const int c8 = lw / 8;
        for (int i = tid; i < BK * c8; i += NT) {
          const int row = i / c8, col = (i - row * c8) * 8, s = s0 + row;
          float* dst = dst0 + row * ldq + col;
          if (s < c1) {
            const uint8_t* p = fp8_row(sq, s, block_size, lw);
            const float sc = reinterpret_cast<const float*>(p)[col < r ? 0 : 1];
            const uint2 q8 = *reinterpret_cast<const uint2*>(p + 8 + col);
            const float2 a = e4m3x2_to_float2(q8.x & 0xffffu), b = e4m3x2_to_float2(q8.x >> 16);
            const float2 c = e4m3x2_to_float2(q8.y & 0xffffu), d = e4m3x2_to_float2(q8.y >> 16);
            st4(dst, make_float4(a.x * sc, a.y * sc, b.x * sc, b.y * sc));
            st4(dst + 4, make_float4(c.x * sc, c.y * sc, d.x * sc, d.y * sc));
          } else {
            st4(dst, make_float4(0.f, 0.f, 0.f, 0.f));
            st4(dst + 4, make_float4(0.f, 0.f, 0.f, 0.f));
          }
        }
      } else {
        for (int i = tid; i < BK * lw; i += NT) {
          const int row = i / lw, col = i - row * lw, s = s0 + row;
          float v = 0.0f;
          if (s < c1) {
            const uint8_t* p = fp8_row(sq, s, block_size, lw);
            v = e4m3_to_float(p[8 + col]) * ld_f32_bytes(p + (col < r ? 0 : 4));
          }
          dst0[row * ldq + col] = v;
        }
      }
    } else if constexpr (VEC) {
      const int c4 = lw / 4;
      for (int i = tid; i < BK * c4; i += NT) {
        const int row = i / c4, col = (i - row * c4) * 4, s = s0 + row;
        float* dst = dst0 + row * ldq + col;
        if (s < c1) cp_async16(dst, latent_row(sq, s, block_size, lw) + col);
        else st4(dst, make_float4(0.f, 0.f, 0.f, 0.f));
      }
    } else {
      for (int i = tid; i < BK * lw; i += NT) {
        const int row = i / lw, col = i - row * lw, s = s0 + row;
        dst0[row * ldq + col] = s < c1 ? latent_row(sq, s, block_size, lw)[col] : 0.0f;
      }
    }
  };

  // S phase: warp w sums k in its slice of the lw4/4 float4 columns; lane = (rg, cg) owns
  // rows rg + 8e and keys cg + 4f.
  const int nk4 = lw4 / 4, per = (nk4 + 7) / 8;
  const int k4a = min(nk4, warp * per), k4b = min(nk4, k4a + per);
  const int rg = lane >> 2, cg = lane & 3;
  // PV phase: warp w owns latent columns w*64 .. w*64+63 (two float4 per lane, 32 apart)
  // of rows pr*8 .. pr*8+7.
  const int pr = lane >> 3, pc = lane & 7;
  const int col0 = warp * 64 + pc * 4;
  float o[8][8];
#pragma unroll
  for (int e = 0; e < 8; ++e)
#pragma unroll
    for (int c = 0; c < 8; ++c) o[e][c] = 0.0f;

  const int ntiles = (c1 - c0 + BK - 1) / BK;
  load_q();
  load_c(c0, 0);
  cp_async_commit();
  for (int j = 0; j < ntiles; ++j) {
    const int buf = j & 1, s0 = c0 + j * BK;
    if (j + 1 < ntiles) load_c(s0 + BK, buf ^ 1);
    cp_async_commit();
    cp_async_wait1();  // tile j (and Q) have landed
    __syncthreads();
    const float* Ct = Cs + buf * BK * ldq;

    float acc[4][4];
#pragma unroll
    for (int e = 0; e < 4; ++e)
#pragma unroll
      for (int f = 0; f < 4; ++f) acc[e][f] = 0.0f;
#pragma unroll 2
    for (int k4 = k4a; k4 < k4b; ++k4) {
      float4 qv[4], cv[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) qv[e] = ld4(Qs + (rg + 8 * e) * ldq + k4 * 4);
#pragma unroll
      for (int f = 0; f < 4; ++f) cv[f] = ld4(Ct + (cg + 4 * f) * ldq + k4 * 4);
#pragma unroll
      for (int e = 0; e < 4; ++e)
#pragma unroll
        for (int f = 0; f < 4; ++f) acc[e][f] = dot4(qv[e], cv[f], acc[e][f]);
    }
#pragma unroll
    for (int e = 0; e < 4; ++e)
#pragma unroll
      for (int f = 0; f < 4; ++f) red[(warp * BQ + rg + 8 * e) * LDR + cg + 4 * f] = acc[e][f];
    __syncthreads();

    {
      // Softmax: 8 consecutive lanes own one row, two keys each.
      const int row = tid >> 3, kp = (tid & 7) * 2;
      const int limit = sq.past + (rt0 + row) / H;  // last visible latent row
      float v[2], mx = -INFINITY;
#pragma unroll
      for (int u = 0; u < 2; ++u) {
        const int key = kp + u, s = s0 + key;
        float sum = 0.0f;
#pragma unroll
        for (int w = 0; w < 8; ++w) sum += red[(w * BQ + row) * LDR + key];
        v[u] = (row < nrows && s < c1 && s <= limit) ? sum * scale_log2 : -INFINITY;
        mx = fmaxf(mx, v[u]);
      }
      const float mold = ms[row];
#pragma unroll
      for (int off = 4; off > 0; off >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
      const float mnew = fmaxf(mold, mx);
      // A row that has seen no visible key yet keeps m = -inf, l = 0.
      const bool live = mnew != -INFINITY;
      const float alpha = live ? exp2f(mold - mnew) : 1.0f;
      float psum = 0.0f;
#pragma unroll
      for (int u = 0; u < 2; ++u) {
        const float p = live ? exp2f(v[u] - mnew) : 0.0f;
        Pt[(kp + u) * BQ + row] = p;
        psum += p;
      }
#pragma unroll
      for (int off = 4; off > 0; off >>= 1) psum += __shfl_xor_sync(0xffffffffu, psum, off);
      if ((tid & 7) == 0) {
        ms[row] = mnew;
        ls[row] = ls[row] * alpha + psum;
        al[row] = alpha;
      }
    }
    __syncthreads();

    if (col0 < r) {
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        const float a = al[pr * 8 + e];
#pragma unroll
        for (int c = 0; c < 8; ++c) o[e][c] *= a;
      }
#pragma unroll 2
      for (int k = 0; k < BK; ++k) {
        const float4 p0 = ld4(Pt + k * BQ + pr * 8), p1 = ld4(Pt + k * BQ + pr * 8 + 4);
        const float4 v0 = ld4(Ct + k * ldq + col0), v1 = ld4(Ct + k * ldq + col0 + 32);
        const float pe[8] = {p0.x, p0.y, p0.z, p0.w, p1.x, p1.y, p1.z, p1.w};
#pragma unroll
        for (int e = 0; e < 8; ++e) {
          o[e][0] = fmaf(pe[e], v0.x, o[e][0]);
          o[e][1] = fmaf(pe[e], v0.y, o[e][1]);
          o[e][2] = fmaf(pe[e], v0.z, o[e][2]);
          o[e][3] = fmaf(pe[e], v0.w, o[e][3]);
          o[e][4] = fmaf(pe[e], v1.x, o[e][4]);
          o[e][5] = fmaf(pe[e], v1.y, o[e][5]);
          o[e][6] = fmaf(pe[e], v1.z, o[e][6]);
          o[e][7] = fmaf(pe[e], v1.w, o[e][7]);
        }
      }
    }
    __syncthreads();  // tile j's buffer, Pt and al are free for the next tile
  }
  cp_async_wait0();

  if (tid < nrows) part_ml[(grow0 + tid) * nchunks + x] = make_float2(ms[tid], ls[tid]);
#pragma unroll
  for (int e = 0; e < 8; ++e) {
    const int row = pr * 8 + e;
    if (row >= nrows || ls[row] == 0.0f) continue;
    float* dst = part_o + ((grow0 + row) * nchunks + x) * r;
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      const int col = col0 + 32 * c;
      if constexpr (VEC) {
        if (col < r) st4(dst + col, make_float4(o[e][4 * c], o[e][4 * c + 1], o[e][4 * c + 2],
                                                o[e][4 * c + 3]));
      } else {
#pragma unroll
        for (int u = 0; u < 4; ++u)
          if (col + u < r) dst[col + u] = o[e][4 * c + u];
      }
    }
  }
}
