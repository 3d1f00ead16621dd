// MLA latent caches in FP8 E4M3 (`--kv-cache-dtype fp8`): rows of two f32 scales and lw codes
// (`fp8_row` in mla_decode.cuh; the CPU's crates/kimi-cpu/src/fp8_cache.rs layout, so both
// backends hold the same bytes for the same latents).
//
// * `mla_fp8_write_rows` quantizes each new row as `fp8_cache::quantize_row` does: per part
//   (c: columns < r; k_pe: the rest) scale = absmax / 448, codes = RNE-saturating E4M3 of
//   value · (1 / scale), with IEEE-rounded division and products, bit for bit the CPU's.
// * `mla_decode_partial_fp8[_vec]` is the split-KV decode kernel of mla.cu reading FP8 rows
//   (widened to f32 as each tile lands in shared memory; the rest of the decode pipeline,
//   q absorb, combine and W_uv, is mla.cu's).
// * `mla_fp8_gather` widens a sequence's rows into a contiguous f32 buffer for the expanded
//   prefill, which then runs mla.cu's kernels unchanged (the prefill reads each row once per
//   call: a scratch copy costs little next to its attention, and keeps one prefill kernel).
#include "mla_decode.cuh"

namespace {
constexpr float E4M3_MAX = 448.0f;

__device__ __forceinline__ void st_f32_bytes(uint8_t* p, float v) {
  const unsigned u = __float_as_uint(v);
  p[0] = (uint8_t)u;
  p[1] = (uint8_t)(u >> 8);
  p[2] = (uint8_t)(u >> 16);
  p[3] = (uint8_t)(u >> 24);
}

}  // namespace

// Writes every row j of src [n, lw] that belongs to a sequence into the FP8 pool: where[2j]
// is the offset of that sequence's block table in `tables`, where[2j+1] the row's position
// (0xffffffff: not a cache row), as mla_paged_write_rows. Grid (n), block 128.
extern "C" __global__ void __launch_bounds__(128)
    mla_fp8_write_rows(const float* src, uint8_t* pool, const unsigned* tables,
                       const unsigned* where, int bs, int lw, int r) {
  __shared__ float red[32];
  pdl_enter();
  const int j = blockIdx.x;
  const unsigned pos = where[2 * j + 1];
  if (pos == 0xffffffffu) return;
  const float* from = src + (size_t)j * lw;
  uint8_t* to = pool + paged_row(tables + where[2 * j], bs, (int)pos) * (size_t)(8 + lw);
  float m0 = 0.0f, m1 = 0.0f;
  for (int i = threadIdx.x; i < lw; i += blockDim.x) {
    const float a = fabsf(from[i]);
    if (i < r) m0 = fmaxf(m0, a);
    else m1 = fmaxf(m1, a);
  }
  // common.cuh's block_max (magnitudes are >= 0, so its -inf seed never wins).
  m0 = block_max(m0, red);
  m1 = block_max(m1, red);
  const float s0 = __fdiv_rn(m0, E4M3_MAX), s1 = __fdiv_rn(m1, E4M3_MAX);
  const float inv0 = s0 > 0.0f ? __frcp_rn(s0) : 0.0f, inv1 = s1 > 0.0f ? __frcp_rn(s1) : 0.0f;
  if (threadIdx.x == 0) {
    st_f32_bytes(to, s0);
    st_f32_bytes(to + 4, s1);
  }
  for (int i = threadIdx.x; i < lw; i += blockDim.x) {
    const float v = __fmul_rn(from[i], i < r ? inv0 : inv1);
    to[8 + i] = (uint8_t)__nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3);
  }
}

// Widens columns 0 .. ncols-1 of positions 0 .. total-1 of a sequence's FP8 rows into
// out [total, ncols] f32. Grid (total), block 128.
extern "C" __global__ void __launch_bounds__(128)
    mla_fp8_gather(const uint8_t* pool, const unsigned* table, int bs, int lw, int r, int ncols,
                   float* out) {
  pdl_enter();
  const int s = blockIdx.x;
  const uint8_t* from = pool + paged_row(table, bs, s) * (size_t)(8 + lw);
  const float s0 = ld_f32_bytes(from), s1 = ld_f32_bytes(from + 4);
  float* to = out + (size_t)s * ncols;
  for (int i = threadIdx.x; i < ncols; i += blockDim.x)
    to[i] = e4m3_to_float(from[8 + i]) * (i < r ? s0 : s1);
}

// mla_decode_partial over FP8 rows (MlaSeq::cache points at the pool's bytes).
extern "C" __global__ void __launch_bounds__(256, 1)
    mla_decode_partial_fp8(const MlaSeq* seqs, int block_size, const float* qcat,
                           float2* part_ml, float* part_o, int nchunks, int H, int r, int dr,
                           float scale_log2) {
  pdl_enter();
  decode_partial<false, true>(seqs, block_size, qcat, part_ml, part_o, nchunks, H, r, dr,
                              scale_log2);
}

// As mla_decode_partial_fp8 with r and r + dr multiples of 4 (float4 q and partial rows).
extern "C" __global__ void __launch_bounds__(256, 1)
    mla_decode_partial_fp8_vec(const MlaSeq* seqs, int block_size, const float* qcat,
                               float2* part_ml, float* part_o, int nchunks, int H, int r,
                               int dr, float scale_log2) {
  pdl_enter();
  decode_partial<true, true>(seqs, block_size, qcat, part_ml, part_o, nchunks, H, r, dr,
                             scale_log2);
}
