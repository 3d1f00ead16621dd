// MXFP4 (OCP microscaling FP4) routed experts: GEMVs over the (token, expert) pairs of a MoE
// layer whose expert weights stay packed on the device (Kimi K3's routed experts, 4.25 bits
// per weight).
//
// Device layout of one MXFP4 matrix [rows, cols] (cols % 32 == 0), made by the backend's
// upload from ggml `block_mxfp4` blocks: the codes plane, rows * cols / 2 bytes (per block of
// 32 values the block's 16 code bytes as ggml stores them: byte j holds value j in its low
// nibble and value j + 16 in its high nibble), then the scales plane, rows * cols / 32 E8M0
// bytes. Every block's codes are one aligned 16-byte load.
//
// E2M1 to float without a table: a code `s e1 e0 m` placed at bits 15 and 11..9 of an f16
// (sign, the two low exponent bits, the top mantissa bit) is exactly the E2M1 value times
// 2^-14, subnormal codes included (0 and 0.5 become 0 and the f16 subnormal 2^-15). The 2^14
// goes into the block scale. Two codes become one f16 pair with a byte permute, two shifts
// and a bit select; the products and sums stay in f32.
#include "common.cuh"

__device__ __forceinline__ float mx_warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// Four codes of a 32-bit word of codes (bytes b0..b3; `high` = the high nibbles) as two f16
// pairs: (v[0], v[1]) and (v[2], v[3]), values 4w .. 4w + 3 of the word's block half.
__device__ __forceinline__ void e2m1x4(uint32_t q, bool high, float2& a, float2& b) {
  const uint32_t n = high ? (q >> 4) & 0x0F0F0F0Fu : q & 0x0F0F0F0Fu;
  // Bytes 0,1 (then 2,3) into the low byte of each 16-bit half.
  const uint32_t s0 = __byte_perm(n, 0, 0x4140), s1 = __byte_perm(n, 0, 0x4342);
  const uint32_t h0 = ((s0 << 9) & 0x0E000E00u) | ((s0 << 12) & 0x80008000u);
  const uint32_t h1 = ((s1 << 9) & 0x0E000E00u) | ((s1 << 12) & 0x80008000u);
  a = __half22float2(*reinterpret_cast<const __half2*>(&h0));
  b = __half22float2(*reinterpret_cast<const __half2*>(&h1));
}

// An E8M0 scale byte times 2^14 (the f16 placement's offset): 2^(e - 113).
__device__ __forceinline__ float e8m0_scale(uint32_t e) {
  // e = 0 is 2^-127, an f32 subnormal: scaled by 2^14 in two exact steps.
  return e == 0 ? 5.877471754e-39f * 16384.0f : __uint_as_float(e << 23) * 16384.0f;
}

// The dot of one block's 32 codes (four words) with the block's 32 activations `x` (eight
// float4 at `xs[j * stride]`, j = 0..7, the natural order of the block's values).
__device__ __forceinline__ float block_dot(const uint4& q, const float4* xs, int stride) {
  const uint32_t w[4] = {q.x, q.y, q.z, q.w};
  float acc = 0.0f;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    float2 a, b;
    const float4 lo = xs[i * stride], hi = xs[(4 + i) * stride];
    e2m1x4(w[i], false, a, b);
    acc = fmaf(a.x, lo.x, acc);
    acc = fmaf(a.y, lo.y, acc);
    acc = fmaf(b.x, lo.z, acc);
    acc = fmaf(b.y, lo.w, acc);
    e2m1x4(w[i], true, a, b);
    acc = fmaf(a.x, hi.x, acc);
    acc = fmaf(a.y, hi.y, acc);
    acc = fmaf(b.x, hi.z, acc);
    acc = fmaf(b.y, hi.w, acc);
  }
  return acc;
}

// The gated activation of a gate/up pair: 0 = SiLU-GLU, 1 = SiTU-GLU (Kimi K3:
// beta·tanh(g/beta)·sigmoid(g) · lbeta·tanh(u/lbeta); lbeta <= 0: u unchanged).
__device__ __forceinline__ float glu_act(float g, float u, int act, float beta, float lbeta) {
  if (act == 0) return g * sigmoidf_(g) * u;
  const float a = beta * tanhf(g / beta) * sigmoidf_(g);
  return a * (lbeta > 0.0f ? lbeta * tanhf(u / lbeta) : u);
}

#define MX_TG 4  // tokens per pass over a weight row
#define MX_RW 4  // rows per warp
#define MX_UB 1  // blocks per lane per step

// Expert GEMV over the pairs routed to one expert, MXFP4 weights. Grid
// (ceil(rows_out / (8 * MX_RW)), number of pairs or experts, whichever is fewer); 256 threads = 8
// warps of MX_RW rows. Block (x, j) serves the j-th expert that received pairs (the active
// list after `offsets`, as `moe_lists` writes it), for each group of MX_TG of its pairs.
// `wtab` holds per expert the (gate, up, down) matrix addresses. glu = 1: out[p, r] =
// act(gate_e[r]·x, up_e[r]·x) with x = in[p / top_k] (the token's row); glu = 0:
// out[p, r] = down_e[r]·in[p]. The group's activation rows are staged in shared memory
// (MX_TG * cols floats), each block's 32 values as eight float4 strided by the number of
// blocks per row, so that the 32 lanes of a warp (one block each) read them without bank
// conflicts.
extern "C" __global__ void __launch_bounds__(256, 2)
    moe_mxfp4_gemv(const uint64_t* wtab, int glu, const float* in, int top_k,
                   const uint32_t* offsets, int E, const uint32_t* slots, float* out,
                   int rows_out, int cols, int act, float beta, float lbeta) {
  pdl_enter();
  extern __shared__ float4 mx_xs[];
  const uint32_t* active = offsets + E + 1;
  if (blockIdx.y >= active[0]) return;
  const uint32_t e = active[1 + blockIdx.y];
  const uint32_t beg = offsets[e], end = offsets[e + 1];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int nb = cols >> 5;  // blocks per row
  const uint8_t* wa = reinterpret_cast<const uint8_t*>(wtab[3 * e + (glu ? 0 : 2)]);
  const uint8_t* wb = reinterpret_cast<const uint8_t*>(wtab[3 * e + 1]);
  const size_t codes_bytes = (size_t)rows_out * cols / 2;
  const int row0 = (blockIdx.x * 8 + warp) * MX_RW;
  for (uint32_t g0 = beg; g0 < end; g0 += MX_TG) {
    const int ng = min((uint32_t)MX_TG, end - g0);
    __syncthreads();  // the previous group's rows are no longer read
    for (int i = threadIdx.x; i < ng * nb * 8; i += blockDim.x) {
      const int g = i / (nb * 8), rest = i - g * nb * 8;
      const int b = rest >> 3, j = rest & 7;
      const uint32_t p = slots[g0 + g];
      const float4* src =
          reinterpret_cast<const float4*>(in + (size_t)(glu ? p / top_k : p) * cols);
      mx_xs[(size_t)g * nb * 8 + j * nb + b] = src[b * 8 + j];
    }
    __syncthreads();
    if (row0 >= rows_out) continue;
    float aa[MX_RW][MX_TG], ab[MX_RW][MX_TG];
#pragma unroll
    for (int r = 0; r < MX_RW; ++r)
#pragma unroll
      for (int g = 0; g < MX_TG; ++g) aa[r][g] = ab[r][g] = 0.0f;
    // MX_UB blocks per lane per step, all loads queued before any product: 16-byte loads of
    // MX_RW rows (x2 with up) x MX_UB blocks in flight per lane.
    for (int b0 = lane; b0 < nb; b0 += 32 * MX_UB) {
      uint4 qa[MX_UB][MX_RW], qb[MX_UB][MX_RW];
      uint32_t ea[MX_UB][MX_RW], eb[MX_UB][MX_RW];
#pragma unroll
      for (int u = 0; u < MX_UB; ++u) {
        const int b = min(b0 + 32 * u, nb - 1);
#pragma unroll
        for (int r = 0; r < MX_RW; ++r) {
          const size_t row = (size_t)min(row0 + r, rows_out - 1);
          const size_t blk = row * nb + b;
          qa[u][r] = __ldg(reinterpret_cast<const uint4*>(wa) + blk);
          ea[u][r] = __ldg(wa + codes_bytes + blk);
          if (glu) {
            qb[u][r] = __ldg(reinterpret_cast<const uint4*>(wb) + blk);
            eb[u][r] = __ldg(wb + codes_bytes + blk);
          }
        }
      }
#pragma unroll
      for (int u = 0; u < MX_UB; ++u) {
        const int b = b0 + 32 * u;
        if (b >= nb) break;
#pragma unroll
        for (int g = 0; g < MX_TG; ++g) {
          if (g < ng) {
            const float4* xs = mx_xs + (size_t)g * nb * 8 + b;
#pragma unroll
            for (int r = 0; r < MX_RW; ++r) {
              aa[r][g] = fmaf(block_dot(qa[u][r], xs, nb), e8m0_scale(ea[u][r]), aa[r][g]);
              if (glu)
                ab[r][g] = fmaf(block_dot(qb[u][r], xs, nb), e8m0_scale(eb[u][r]), ab[r][g]);
            }
          }
        }
      }
    }
#pragma unroll
    for (int r = 0; r < MX_RW; ++r) {
#pragma unroll
      for (int g = 0; g < MX_TG; ++g) {
        const float a = mx_warp_sum(aa[r][g]);
        const float u = mx_warp_sum(ab[r][g]);
        if (lane == 0 && g < ng && row0 + r < rows_out) {
          const uint32_t p = slots[g0 + g];
          out[(size_t)p * rows_out + row0 + r] = glu ? glu_act(a, u, act, beta, lbeta) : a;
        }
      }
    }
  }
}

// `out [rows, cols] f32` = the MXFP4 matrix at `w` (device layout above), one thread per
// value (reading weights back, and the fallback paths that need them widened).
extern "C" __global__ void mxfp4_to_f32(const uint8_t* w, float* out, int rows, int cols) {
  pdl_enter();
  const size_t total = (size_t)rows * cols;
  const size_t codes_bytes = total / 2;
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < total;
       i += (size_t)gridDim.x * blockDim.x) {
    const size_t blk = i >> 5;
    const int j = i & 31;
    const uint32_t byte = w[blk * 16 + (j & 15)];
    const uint32_t code = j < 16 ? byte & 15 : byte >> 4;
    const uint32_t h = ((code & 7) << 9) | ((code & 8) << 12);
    const float v = __half2float(__ushort_as_half((unsigned short)h));
    out[i] = v * e8m0_scale(w[codes_bytes + blk]);
  }
}
