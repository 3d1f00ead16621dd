// Integer and FP8 weights kept packed on the device: Q4Z (W4A16: AWQ, GPTQ and
// compressed-tensors INT4), Q8Z (INT8) and F8S (FP8 E4M3), 32 values per block with an f32
// scale (and zero point) each, and ggml's Q4_0, Q4_1, Q8_0 and Q4_K repacked on the host
// into the same 32-value units (format 3: `q · a − b`, Q4_1 and Q4_K's sub-blocks). Decode products stream the packed blocks (`quant_gemv_*`);
// prefill widens the matrix to bf16 once per call (`quant_widen`) for cuBLAS.
//
// Device layout (made on the host by `quant_layout::device_planes`): the stored blocks of a
// [rows, cols] matrix split into two planes, row-major by (row, block), so that a lane's
// codes are whole aligned 16-byte words and a warp's loads are contiguous:
//   codes:  rows * nb * CB bytes (Q4Z: 16, ggml nibble order: byte j holds value j in its
//           low nibble and value j + 16 in its high one; Q8Z: 32 u8; F8S: 32 E4M3 bytes),
//   scales: rows * nb * SB bytes after it (Q4Z, Q8Z: float2 (d, z); F8S: float d;
//           Q4A: float2 (a, b)),
// nb = cols / 32. A value is (q - z) * d (Q4Z, Q8Z), e4m3(q) * d (F8S) or q * a - b (Q4A,
// codes as Q4Z's), as on the CPU.
#include <cuda_fp8.h>

#include "common.cuh"

namespace qz {
constexpr int Q4Z = 0, Q8Z = 1, F8S = 2, Q4A = 3;

template <int FMT>
struct Fmt;
template <>
struct Fmt<Q4Z> {
  static constexpr int CB = 16, SB = 8;
};
template <>
struct Fmt<Q8Z> {
  static constexpr int CB = 32, SB = 8;
};
template <>
struct Fmt<F8S> {
  static constexpr int CB = 32, SB = 4;
};
template <>
struct Fmt<Q4A> {
  static constexpr int CB = 16, SB = 8;
};

// Byte `b` of `w` as an exact float: 0x4B0000qq is 2^23 + q, one PRMT and one FADD instead of
// an integer conversion (a quarter-rate instruction on sm_90).
__device__ __forceinline__ float byte_f(uint32_t w, int b) {
  return __uint_as_float(__byte_perm(w, 0x4B000000u, 0x7440u + b)) - 8388608.0f;
}

// One lane's block of one row, as loaded: two 16-byte code words (Q4Z uses the first) and
// the scale entry.
struct Raw {
  uint4 c0, c1;
  float d, z;
};

template <int FMT>
__device__ __forceinline__ Raw load_block(const uint8_t* codes, const uint8_t* scales,
                                          size_t blk) {
  Raw r;
  const uint4* c = reinterpret_cast<const uint4*>(codes + blk * Fmt<FMT>::CB);
  r.c0 = __ldg(c);
  if constexpr (Fmt<FMT>::CB == 32) r.c1 = __ldg(c + 1);
  if constexpr (FMT == F8S) {
    r.d = __ldg(reinterpret_cast<const float*>(scales) + blk);
    r.z = 0.0f;
  } else {
    const float2 dz = __ldg(reinterpret_cast<const float2*>(scales) + blk);
    r.d = dz.x;
    r.z = dz.y;
  }
  return r;
}

__device__ __forceinline__ uint32_t word(const uint4& q, int i) {
  return i == 0 ? q.x : i == 1 ? q.y : i == 2 ? q.z : q.w;
}

// Piece `i` (0..3) of a block: 8 of its values before the scale, q - z (Q4Z, Q8Z) or
// e4m3(q) (F8S), or with it, q * a - b (Q4A); the first four at offset `xa` of the block
// and the last four at `xb`. Q4Z, Q4A: word i's low nibbles are values 4i.., its high
// nibbles 16 + 4i..; Q8Z, F8S: words 2i and 2i + 1 are values 8i.. in order.
template <int FMT>
__device__ __forceinline__ void piece(const Raw& r, int i, float v[8], int& xa, int& xb) {
  if constexpr (Fmt<FMT>::CB == 16) {
    const uint32_t w = word(r.c0, i);
    const uint32_t lo = w & 0x0F0F0F0Fu, hi = (w >> 4) & 0x0F0F0F0Fu;
#pragma unroll
    for (int b = 0; b < 4; ++b) {
      if constexpr (FMT == Q4A) {
        v[b] = fmaf(byte_f(lo, b), r.d, -r.z);
        v[4 + b] = fmaf(byte_f(hi, b), r.d, -r.z);
      } else {
        v[b] = byte_f(lo, b) - r.z;
        v[4 + b] = byte_f(hi, b) - r.z;
      }
    }
    xa = 4 * i;
    xb = 16 + 4 * i;
  } else {
    const uint4& q = i < 2 ? r.c0 : r.c1;
    const uint32_t w0 = word(q, 2 * (i & 1)), w1 = word(q, 2 * (i & 1) + 1);
    xa = 8 * i;
    xb = 8 * i + 4;
    if constexpr (FMT == Q8Z) {
#pragma unroll
      for (int b = 0; b < 4; ++b) {
        v[b] = byte_f(w0, b) - r.z;
        v[4 + b] = byte_f(w1, b) - r.z;
      }
    } else {
      // E4M3 -> f16 pairs (exact: every E4M3 value is an f16), then f32.
#pragma unroll
      for (int h = 0; h < 4; ++h) {
        const uint32_t w = h < 2 ? w0 : w1;
        const __half2_raw p =
            __nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)(w >> (16 * (h & 1))), __NV_E4M3);
        const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&p));
        v[2 * h] = f.x;
        v[2 * h + 1] = f.y;
      }
    }
  }
}
}  // namespace qz

// ---------------------------------------------------------------------------------------
// y [n, o] = x [n, k] · wᵀ for a packed w [o, k] and f32 activations, n <= NT <= 8: f32
// products and sums (no rounding of the activations), each weight block read once for all
// tokens.
//
// A CTA (4 warps) owns 16 * WR rows, WR = 4 / WK: warp w takes rows 16 (w % WR).. and the
// K slice w / WR of WK. In a warp, lane group g = lane / 8 owns 4 rows (RW), and its 8
// lanes take 8 consecutive blocks of them per step (a group's loads are 128 contiguous
// code bytes per row), the warp's steps 8 * WK blocks apart. The activations of a chunk of
// CH blocks are staged once per CTA in shared memory as f32 (block b's 8 float4 at slots
// q ^ (b & 7): the 8 lanes of a group read 8 different bank quads), with each block's sum
// Σx; every float4 read there feeds 4 rows. A value is dequantized once for all tokens with
// its scale folded in, q·d (one FMA: (2^23 + q)·d − 2^23·d is q·d rounded once); the zero
// point (or Q4A's offset) enters per block as −(z·d)·Σx. The lanes' sums meet by shuffles
// in a group and through shared memory across the WK slices, in a fixed order (the result
// does not depend on timing). For small o, grid.y splits K across CTAs in spans of whole
// warp steps: each writes its partial sums, which `quant_gemv_reduce` adds in order. With
// PF the next step's weights load before the current step's math; otherwise the other
// warps on the SM keep the loads in flight. The first step's weights load before waiting
// on the previous kernel. Needs k % 32 == 0 and x 4-byte aligned (16-byte aligned x is
// staged with vector loads).
#define QGEMV_THREADS 128
#define QGEMV_RW 4

namespace qz {
// (scale, zero term) of one row's block: value = q * d - zd per value (Q4Z, Q8Z: zd = z * d;
// Q4A: d = a, zd = b; F8S: zd = 0).
struct Blk {
  uint4 c0, c1;
  float d, zd;
};

template <int FMT>
__device__ __forceinline__ Blk load_blk(const uint8_t* codes, const uint8_t* scales, size_t blk) {
  const Raw r = load_block<FMT>(codes, scales, blk);
  Blk b;
  b.c0 = r.c0;
  b.c1 = r.c1;
  b.d = r.d;
  b.zd = FMT == Q4A ? r.z : FMT == F8S ? 0.0f : r.z * r.d;
  return b;
}

// Values 4p..4p+3 of a block (float4 slot p of its activations), times d. Q4Z, Q4A: low
// (p < 4) or high nibbles of code word p & 3; Q8Z, F8S: word p.
template <int FMT>
__device__ __forceinline__ void quad(const Blk& b, int P, float v[4]) {
  if constexpr (Fmt<FMT>::CB == 16 || FMT == Q8Z) {
    uint32_t w;
    if constexpr (Fmt<FMT>::CB == 16) {
      const uint32_t c = word(b.c0, P & 3);
      w = (P < 4 ? c : c >> 4) & 0x0F0F0F0Fu;
    } else {
      w = word(P < 4 ? b.c0 : b.c1, P & 3);
    }
    const float off = -8388608.0f * b.d;
#pragma unroll
    for (int j = 0; j < 4; ++j)
      v[j] = fmaf(__uint_as_float(__byte_perm(w, 0x4B000000u, 0x7440u + j)), b.d, off);
  } else {
    const uint32_t w = word(P < 4 ? b.c0 : b.c1, P & 3);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const __half2_raw p =
          __nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)(w >> (16 * h)), __NV_E4M3);
      const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&p));
      v[2 * h] = f.x * b.d;
      v[2 * h + 1] = f.y * b.d;
    }
  }
}

// Shared-memory slot of float4 `p` of chunk block `bl` of token `t`.
__device__ __forceinline__ int xslot(int t, int bl, int p, int ch) {
  return ((t * ch + bl) << 3) + (p ^ (bl & 7));
}
}  // namespace qz

template <int FMT, int NT, bool PF>
__device__ __forceinline__ void quant_gemv_body(const uint8_t* w, const float* x, float* y,
                                                int n, int o, int k, int wk_count, int ch,
                                                int span) {
  using F = qz::Fmt<FMT>;
  extern __shared__ float4 qgemv_smem[];
  __shared__ float red[QGEMV_THREADS / 32][16][NT];
  float4* xs = qgemv_smem;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int g = lane >> 3, l8 = lane & 7;
  const int wr_count = 4 / wk_count;
  const int wr = warp % wr_count, wk = warp / wr_count;
  const int nb = k >> 5;
  // This CTA's blocks of K: kb0.. (nk of them); split CTAs write partial sums [splits, n, o].
  // Below, block indices count from kb0.
  const int kb0 = blockIdx.y * span, nk = min(nb - kb0, span);
  const int stride = 8 * wk_count;
  float* xsum = reinterpret_cast<float*>(xs + (size_t)min(n, NT) * ch * 8);
  const uint8_t* scales = w + (size_t)o * nb * F::CB;
  const int row0 = blockIdx.x * 16 * wr_count + 16 * wr + QGEMV_RW * g;
  // Block indices fit 32 bits (checked on the host).
  uint32_t base[QGEMV_RW];
#pragma unroll
  for (int r = 0; r < QGEMV_RW; ++r)
    base[r] = (uint32_t)min(row0 + r, o - 1) * (uint32_t)nb + (uint32_t)kb0;
  float acc[QGEMV_RW][NT];
#pragma unroll
  for (int r = 0; r < QGEMV_RW; ++r)
#pragma unroll
    for (int t = 0; t < NT; ++t) acc[r][t] = 0.0f;
  const int ng = min(n, NT);
  qz::Blk cur[QGEMV_RW];
  // The first step's weights: before waiting on the previous kernel.
  {
    const int b = 8 * wk + l8;
    if (b < min(ch, nk)) {
#pragma unroll
      for (int r = 0; r < QGEMV_RW; ++r) cur[r] = qz::load_blk<FMT>(w, scales, base[r] + b);
    }
  }
  pdl_enter();
  const bool vec = (reinterpret_cast<uintptr_t>(x) & 15) == 0;
  for (int c0 = 0; c0 < nk; c0 += ch) {
    const int c1 = min(c0 + ch, nk), cn = c1 - c0;
    if (c0 > 0) {
      const int b = c0 + 8 * wk + l8;
      if (b < c1) {
#pragma unroll
        for (int r = 0; r < QGEMV_RW; ++r) cur[r] = qz::load_blk<FMT>(w, scales, base[r] + b);
      }
    }
    // Stage the chunk: 8 consecutive threads per block (one float4 each), Σx by shuffles.
    __syncthreads();
    {
      const int items = ng * cn * 8;
      for (int i0 = 0; i0 < items; i0 += QGEMV_THREADS) {
        const int i = i0 + threadIdx.x;
        float4 a = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        int t = 0, bl = 0;
        const int q = i & 7;
        if (i < items) {
          t = i / (cn * 8);
          bl = (i >> 3) - t * cn;
          const float* src =
              x + (size_t)t * k + (size_t)(blockIdx.y * span + c0 + bl) * 32 + 4 * q;
          if (vec) {
            a = *reinterpret_cast<const float4*>(src);
          } else {
            a = make_float4(src[0], src[1], src[2], src[3]);
          }
          xs[qz::xslot(t, bl, q, ch)] = a;
        }
        float s = (a.x + a.y) + (a.z + a.w);
        s += __shfl_xor_sync(0xffffffffu, s, 1);
        s += __shfl_xor_sync(0xffffffffu, s, 2);
        s += __shfl_xor_sync(0xffffffffu, s, 4);
        if (i < items && q == 0) xsum[t * ch + bl] = s;
      }
    }
    __syncthreads();
    for (int s0 = c0 + 8 * wk; s0 < c1; s0 += stride) {
      const int b = s0 + l8;
      const bool more = s0 + stride < c1, on = b < c1, next = b + stride < c1;
      qz::Blk nxt[QGEMV_RW];
      if (PF && next) {
#pragma unroll
        for (int r = 0; r < QGEMV_RW; ++r)
          nxt[r] = qz::load_blk<FMT>(w, scales, base[r] + b + stride);
      }
      if (on) {
        const int bl = b - c0;
#pragma unroll
        for (int p = 0; p < 8; ++p) {
          float v[QGEMV_RW][4];
#pragma unroll
          for (int r = 0; r < QGEMV_RW; ++r) qz::quad<FMT>(cur[r], p, v[r]);
#pragma unroll
          for (int t = 0; t < NT; ++t) {
            const float4 a = xs[qz::xslot(min(t, ng - 1), bl, p, ch)];
#pragma unroll
            for (int r = 0; r < QGEMV_RW; ++r) {
              float u = acc[r][t];
              u = fmaf(v[r][0], a.x, u);
              u = fmaf(v[r][1], a.y, u);
              u = fmaf(v[r][2], a.z, u);
              u = fmaf(v[r][3], a.w, u);
              acc[r][t] = u;
            }
          }
        }
        if constexpr (FMT != qz::F8S) {
#pragma unroll
          for (int t = 0; t < NT; ++t) {
            const float sx = xsum[min(t, ng - 1) * ch + bl];
#pragma unroll
            for (int r = 0; r < QGEMV_RW; ++r) acc[r][t] = fmaf(-cur[r].zd, sx, acc[r][t]);
          }
        }
      }
      if (more && next) {
        if (PF) {
#pragma unroll
          for (int r = 0; r < QGEMV_RW; ++r) cur[r] = nxt[r];
        } else {
#pragma unroll
          for (int r = 0; r < QGEMV_RW; ++r)
            cur[r] = qz::load_blk<FMT>(w, scales, base[r] + b + stride);
        }
      }
    }
  }
  // A group's 8 lanes hold sums over different blocks of the same rows.
#pragma unroll
  for (int r = 0; r < QGEMV_RW; ++r) {
#pragma unroll
    for (int t = 0; t < NT; ++t) {
      float s = acc[r][t];
      s += __shfl_xor_sync(0xffffffffu, s, 1);
      s += __shfl_xor_sync(0xffffffffu, s, 2);
      s += __shfl_xor_sync(0xffffffffu, s, 4);
      if (l8 == 0) red[warp][QGEMV_RW * g + r][t] = s;
    }
  }
  __syncthreads();
  const int rows = 16 * wr_count;
  y += (size_t)blockIdx.y * n * o;
  for (int i = threadIdx.x; i < rows * ng; i += QGEMV_THREADS) {
    const int rl = i % rows, t = i / rows;
    const int row = blockIdx.x * rows + rl;
    float s = 0.0f;
    for (int j = 0; j < wk_count; ++j) s += red[j * wr_count + rl / 16][rl % 16][t];
    if (row < o) y[(size_t)t * o + row] = s;
  }
}

// Arguments: w, x, y, n, o, k, wk (K slices per CTA: 1, 2 or 4), ch (blocks of x staged at
// a time), span (blocks of K per CTA along grid.y). Grid (ceil(o / (64 / wk)),
// ceil(k / 32 / span)), block 128, dynamic shared memory n * ch * 132 bytes (static: NT KiB
// / 4). With more than one split, y holds [splits, n, o] partial sums for
// `quant_gemv_reduce`.
#define QUANT_GEMV(NAME, FMT, NT, PF, MINB)                                          \
  extern "C" __global__ void __launch_bounds__(QGEMV_THREADS, MINB)                 \
      NAME(const uint8_t* w, const float* x, float* y, int n, int o, int k, int wk, int ch, \
           int span) {                                                               \
    quant_gemv_body<FMT, NT, PF>(w, x, y, n, o, k, wk, ch, span);                    \
  }
QUANT_GEMV(quant_gemv_q4z_1, qz::Q4Z, 1, true, 4)
QUANT_GEMV(quant_gemv_q4z_2, qz::Q4Z, 2, true, 4)
QUANT_GEMV(quant_gemv_q4z_4, qz::Q4Z, 4, false, 4)
QUANT_GEMV(quant_gemv_q4z_8, qz::Q4Z, 8, false, 3)
QUANT_GEMV(quant_gemv_q8z_1, qz::Q8Z, 1, true, 4)
QUANT_GEMV(quant_gemv_q8z_2, qz::Q8Z, 2, true, 4)
QUANT_GEMV(quant_gemv_q8z_4, qz::Q8Z, 4, false, 4)
QUANT_GEMV(quant_gemv_q8z_8, qz::Q8Z, 8, false, 3)
QUANT_GEMV(quant_gemv_f8s_1, qz::F8S, 1, true, 4)
QUANT_GEMV(quant_gemv_f8s_2, qz::F8S, 2, true, 4)
QUANT_GEMV(quant_gemv_f8s_4, qz::F8S, 4, false, 4)
QUANT_GEMV(quant_gemv_f8s_8, qz::F8S, 8, false, 3)
QUANT_GEMV(quant_gemv_q4a_1, qz::Q4A, 1, true, 4)
QUANT_GEMV(quant_gemv_q4a_2, qz::Q4A, 2, true, 4)
QUANT_GEMV(quant_gemv_q4a_4, qz::Q4A, 4, false, 4)
QUANT_GEMV(quant_gemv_q4a_8, qz::Q4A, 8, false, 3)

// y [len] = Σ_j part [j, len] over the `splits` partial sums of a split `quant_gemv_*`,
// added in order j = 0, 1, .. (the result does not depend on timing).
extern "C" __global__ void quant_gemv_reduce(const float* part, float* y, int len,
                                             int splits) {
  pdl_enter();
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < len; i += gridDim.x * blockDim.x) {
    float s = part[i];
    for (int j = 1; j < splits; ++j) s += part[(size_t)j * len + i];
    y[i] = s;
  }
}

// ---------------------------------------------------------------------------------------
// Two one-token products of narrow 4-bit matrices in one launch (KDA's f_b and g_b: 4,096
// rows of 128 columns each, where `quant_gemv_*_1` spent ~5 us a matrix waiting on one
// round trip): a lane owns one 32-value block of one row, nb = k / 32 lanes a row (a power
// of two, at most 32), so a warp takes 32 / nb rows and one load per lane brings the whole
// matrix in flight. CTAs below ceil(o0 / rows) take y0 = x0 · w0ᵀ, the rest y1 = x1 · w1ᵀ
// (rows = 8 warps · 32 / nb). The weights load before the wait on the previous kernel; the
// lanes of a row meet by shuffles in a fixed order. Format 0 (Q4Z) or 3 (Q4A, `fmt3`); x0
// and x1 16-byte aligned.
template <int FMT>
__device__ __forceinline__ void narrow_rows(const uint8_t* w, const float* x, float* y, int o,
                                            int k, int cta) {
  const int nb = k >> 5, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int row = (cta * 8 + warp) * (32 / nb) + lane / nb, b = lane % nb;
  qz::Blk blk = {};
  if (row < o) blk = qz::load_blk<FMT>(w, w + (size_t)o * nb * 16, (size_t)row * nb + b);
  pdl_enter();
  float acc = 0.0f;
  if (row < o) {
    const float4* x4 = reinterpret_cast<const float4*>(x) + 8 * b;
    float sx = 0.0f;
#pragma unroll
    for (int p = 0; p < 8; ++p) {
      const float4 a = x4[p];
      float v[4];
      qz::quad<FMT>(blk, p, v);
      acc = fmaf(v[0], a.x, acc);
      acc = fmaf(v[1], a.y, acc);
      acc = fmaf(v[2], a.z, acc);
      acc = fmaf(v[3], a.w, acc);
      sx += (a.x + a.y) + (a.z + a.w);
    }
    acc = fmaf(-blk.zd, sx, acc);
  }
  for (int off = nb >> 1; off > 0; off >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, off);
  if (row < o && b == 0) y[row] = acc;
}

extern "C" __global__ void __launch_bounds__(256)
    quant_gemv_narrow_pair(const uint8_t* w0, const float* x0, float* y0, int o0,
                           const uint8_t* w1, const float* x1, float* y1, int o1, int k,
                           int fmt3) {
  const int rows = 8 * (32 / (k >> 5));
  const int first = (o0 + rows - 1) / rows;
  const bool second = (int)blockIdx.x >= first;
  const int cta = second ? (int)blockIdx.x - first : (int)blockIdx.x;
  const uint8_t* w = second ? w1 : w0;
  const float* x = second ? x1 : x0;
  float* y = second ? y1 : y0;
  const int o = second ? o1 : o0;
  if (fmt3)
    narrow_rows<qz::Q4A>(w, x, y, o, k, cta);
  else
    narrow_rows<qz::Q4Z>(w, x, y, o, k, cta);
}

// ---------------------------------------------------------------------------------------
// The packed matrix w [rows, cols] (format `fmt`: 0 = Q4Z, 1 = Q8Z, 2 = F8S, 3 = Q4A) widened to
// `out`: bf16 (`bf16` != 0) for the prefill GEMM, else f32 (reading weights back). Each
// value is (q - z) * d or e4m3(q) * d in f32, one rounding as on the CPU, then rounded to
// bf16. One thread per 8 values: its block's codes and scale, and one 16- or 32-byte store.
// `i` counts 8-value groups of `out`; `blk` is the unit they come from.
template <int FMT>
__device__ __forceinline__ void widen8(const uint8_t* w, void* out, int bf16, size_t nblocks,
                                       size_t i, size_t blk) {
  using F = qz::Fmt<FMT>;
  const int part = (int)(i & 3);
  const qz::Raw r = qz::load_block<FMT>(w, w + nblocks * F::CB, blk);
  // Values 8·part.. in order: for Q8Z and F8S the GEMV's piece `part`; for Q4Z and Q4A the low
  // (parts 0, 1) or high (2, 3) nibbles of code words 2·(part & 1) and the next.
  float f[8];
  if constexpr (qz::Fmt<FMT>::CB == 16) {
    const uint32_t wd = qz::word(r.c0, 2 * (part & 1)), we = qz::word(r.c0, 2 * (part & 1) + 1);
    const int sh = 4 * (part >> 1);  // values 0..15 (low nibbles) or 16..31 (high)
    const uint32_t a = (wd >> sh) & 0x0F0F0F0Fu, b = (we >> sh) & 0x0F0F0F0Fu;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      if constexpr (FMT == qz::Q4A) {
        f[j] = fmaf(qz::byte_f(a, j), r.d, -r.z);
        f[4 + j] = fmaf(qz::byte_f(b, j), r.d, -r.z);
      } else {
        f[j] = (qz::byte_f(a, j) - r.z) * r.d;
        f[4 + j] = (qz::byte_f(b, j) - r.z) * r.d;
      }
    }
  } else {
    float v[8];
    int xa, xb;
    qz::piece<FMT>(r, part, v, xa, xb);
#pragma unroll
    for (int j = 0; j < 8; ++j) f[j] = v[j] * r.d;
  }
  if (bf16) {
    uint4 pk;
    uint32_t* p = reinterpret_cast<uint32_t*>(&pk);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const __nv_bfloat162 h = __floats2bfloat162_rn(f[2 * j], f[2 * j + 1]);
      p[j] = *reinterpret_cast<const uint32_t*>(&h);
    }
    reinterpret_cast<uint4*>(out)[i] = pk;
  } else {
    float4* o4 = reinterpret_cast<float4*>(out) + 2 * i;
    o4[0] = make_float4(f[0], f[1], f[2], f[3]);
    o4[1] = make_float4(f[4], f[5], f[6], f[7]);
  }
}

__device__ __forceinline__ void widen_any(const uint8_t* w, int fmt, void* out, int bf16,
                                          size_t nblocks, size_t i, size_t blk) {
  if (fmt == qz::Q4Z)
    widen8<qz::Q4Z>(w, out, bf16, nblocks, i, blk);
  else if (fmt == qz::Q8Z)
    widen8<qz::Q8Z>(w, out, bf16, nblocks, i, blk);
  else if (fmt == qz::Q4A)
    widen8<qz::Q4A>(w, out, bf16, nblocks, i, blk);
  else
    widen8<qz::F8S>(w, out, bf16, nblocks, i, blk);
}

extern "C" __global__ void quant_widen(const uint8_t* w, int fmt, void* out, int bf16,
                                       int rows, int cols) {
  pdl_enter();
  const size_t nblocks = (size_t)rows * (cols >> 5), total = nblocks * 4;
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < total;
       i += (size_t)gridDim.x * blockDim.x) {
    widen_any(w, fmt, out, bf16, nblocks, i, i >> 2);
  }
}

// Embedding rows of a packed table [vocab, d]: out [n, d] f32 = rows ids[0..n) widened.
// One thread per 8 values of the output. Ids are checked against the vocabulary on the
// host.
extern "C" __global__ void quant_embed(const uint8_t* w, int fmt, const uint32_t* ids,
                                       float* out, int n, int d, int vocab) {
  pdl_enter();
  const int nb = d >> 5;
  const size_t nblocks = (size_t)vocab * nb, total = (size_t)n * nb * 4;
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < total;
       i += (size_t)gridDim.x * blockDim.x) {
    const size_t t = i / ((size_t)nb * 4);
    const size_t b = (i >> 2) - t * nb;
    widen_any(w, fmt, out, 0, nblocks, i, (size_t)ids[t] * nb + b);
  }
}

// A slot fill's stored blocks (copied to the device as the checkpoint holds them) laid out
// in the planes above, as `quant_layout::device_planes` lays them out on the host: one
// thread per 32-value unit of `units`. `kind` is the stored type: 0 Q4Z, 1 Q8Z, 2 F8S
// (header and codes as they are), 3 Q4_0 (d, z = 8), 4 Q8_0 (d, z = 128; codes + 128),
// 5 Q4_1 (a = d, b = -m), 6 Q4_K (per 32-value sub-block a = d · scale, b = dmin · min, its
// nibbles in Q4Z's order).
namespace qfill {
__device__ __forceinline__ float f16_at(const uint8_t* b) {
  return __half2float(__ushort_as_half((unsigned short)(b[0] | (b[1] << 8))));
}
// ggml's get_scale_min_k4: sub-block j's 6-bit scale and min from the 12 scale bytes `s`.
__device__ __forceinline__ void q4k_scale_min(int j, const uint8_t* s, int& sc, int& m) {
  if (j < 4) {
    sc = s[j] & 63;
    m = s[j + 4] & 63;
  } else {
    sc = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
    m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}
}  // namespace qfill

// One unit: its header (h0, h1) and code bytes into the planes.
__device__ __forceinline__ void fill_unit(const uint8_t* blocks, uint8_t* planes, int kind,
                                          uint32_t units, uint32_t u) {
  // Code bytes and header bytes per unit, stored block bytes and units per stored block.
  const int cb = (kind == 1 || kind == 2 || kind == 4) ? 32 : 16;
  const int sb = kind == 2 ? 4 : 8;
  const int bb = kind == 0 ? 24 : kind == 1 ? 40 : kind == 2 ? 36 : kind == 3 ? 18
               : kind == 4 ? 34 : kind == 5 ? 20 : 144;
  const int per = kind == 6 ? 8 : 1;
  const uint8_t* b = blocks + (size_t)(u / per) * bb;
  const int j = u % per;
  __align__(16) uint8_t code[32];
  float h0, h1 = 0.0f;
  if (kind <= 2) {
    // Q4Z, Q8Z, F8S: the f32 header (4-byte aligned: every block size is a multiple of 4),
    // then the codes, as stored.
    h0 = *reinterpret_cast<const float*>(b);
    if (sb == 8) h1 = *reinterpret_cast<const float*>(b + 4);
    for (int i = 0; i < cb; ++i) code[i] = b[sb + i];
  } else if (kind == 3) {
    h0 = qfill::f16_at(b);
    h1 = 8.0f;
    for (int i = 0; i < 16; ++i) code[i] = b[2 + i];
  } else if (kind == 4) {
    h0 = qfill::f16_at(b);
    h1 = 128.0f;
    for (int i = 0; i < 32; ++i) code[i] = b[2 + i] ^ 0x80;
  } else if (kind == 5) {
    h0 = qfill::f16_at(b);
    h1 = -qfill::f16_at(b + 2);
    for (int i = 0; i < 16; ++i) code[i] = b[4 + i];
  } else {
    int sc, m;
    qfill::q4k_scale_min(j, b + 4, sc, m);
    h0 = qfill::f16_at(b) * (float)sc;
    h1 = qfill::f16_at(b + 2) * (float)m;
    const uint8_t* qs = b + 16 + 32 * (j / 2);
    const int sh = 4 * (j % 2);
    for (int i = 0; i < 16; ++i)
      code[i] = ((qs[i] >> sh) & 0xF) | (((qs[i + 16] >> sh) & 0xF) << 4);
  }
  uint4* dst = reinterpret_cast<uint4*>(planes + (size_t)u * cb);
  dst[0] = *reinterpret_cast<const uint4*>(code);
  if (cb == 32) dst[1] = *reinterpret_cast<const uint4*>(code + 16);
  float* head = reinterpret_cast<float*>(planes + (size_t)units * cb + (size_t)u * sb);
  head[0] = h0;
  if (sb == 8) head[1] = h1;
}

extern "C" __global__ void quant_from_blocks(const uint8_t* blocks, uint8_t* planes, int kind,
                                             uint32_t units) {
  pdl_enter();
  for (uint32_t u = blockIdx.x * blockDim.x + threadIdx.x; u < units;
       u += gridDim.x * blockDim.x)
    fill_unit(blocks, planes, kind, units, u);
}
