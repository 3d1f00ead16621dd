// One-token products of 4-bit integer weights streamed by persistent kernels: an MoE layer
// (`moe_int4_stream_layer`) and a dense matrix (`quant_gemv_int4_stream_1`, at the end).
//
// A one-token MoE layer whose experts are 4-bit integers (Q4Z: AWQ, GPTQ, compressed-tensors
// INT4; ggml's Q4_0, Q4_1, Q4_K), in one persistent launch: `moe_stream_layer`'s schedule
// (stream.cuh: a producer warp queues whole tiles with the TMA engine into shared-memory
// stages; the gate/up tiles of every slot, a grid-wide handoff, then the down tiles) over
// the planes of `quant_layout` (per 32-value block of a row, 16 code bytes — byte j holds
// value j in its low nibble and j + 16 in its high one — and, after all the codes, an f32
// pair (d, z): (q − z)·d, or with fmt3 (a, b): q·a − b).
//
// At batch 1 the tensor-core kernels (`int4_experts.cu`) leave 7 of an MMA's 8 columns empty
// and cannot keep enough bytes in flight: 571 GB/s on an H100. Here the products are f32 on
// the CUDA cores, exact weights times f32 activations: a code word (8 values) per lane, each
// value made by one PRMT (0.5 + q/256, see `half_nib`) and one FMA into the word's sum P;
// per word the block's scale and offset enter through P and S, the word's Σx. A lane takes the same words of every row (word lane + 32j of a row of
// cols / 8), so its activations sit in registers: loaded once for the gate/up tiles, and per
// down tile from the staged SwiGLU row of the tile's slot; shared memory carries only the
// weights.
//
// A tile is whole rows of one matrix, each part (gate, up, or down rows) laid out as in the
// planes: the part's codes, then its headers; a gate/up tile holds `rows_gu` gate rows then
// the same up rows, a down tile `rows_dn` down rows. Needs d % 256 == 0 and inter % 256 == 0
// (whole words per lane) with at most I4S_MAX_WORDS words per lane, whole matrices, 16-byte
// aligned x, and the grid one CTA per SM (the handoff waits on every CTA).
#include "stream.cuh"

// Code words per lane of a row at most: widths up to 32 · 8 · 12 = 3072.
#define I4S_MAX_WORDS 12
// Weight rows of a tile at most.
#define I4S_MAX_ROWS 32

namespace i4s {
struct Smem {
  uint64_t full[STREAM_MAX_STAGES];
  uint64_t empty[STREAM_MAX_STAGES];
  // Per stage, per weight row: the warp's sum (a row is one warp's).
  float part[STREAM_MAX_STAGES][I4S_MAX_ROWS];
};

// One lane's activations of a row: word c = lane + 32j covers values 32b + 4w.. (a) and
// 32b + 16 + 4w.. (b), b = c / 4, w = c % 4; s = their sum.
struct Xs {
  float4 a[I4S_MAX_WORDS], b[I4S_MAX_WORDS];
  float s[I4S_MAX_WORDS];
};

__device__ __forceinline__ void load_x(Xs& r, const float* x, int words, int lane) {
#pragma unroll
  for (int j = 0; j < I4S_MAX_WORDS; ++j)
    if (j < words) {
      const int c = lane + 32 * j;
      const float4* p = reinterpret_cast<const float4*>(x) + 8 * (c >> 2) + (c & 3);
      r.a[j] = p[0];
      r.b[j] = p[4];
      r.s[j] = ((r.a[j].x + r.a[j].y) + (r.a[j].z + r.a[j].w)) +
               ((r.b[j].x + r.b[j].y) + (r.b[j].z + r.b[j].w));
    }
}

// Nibble k of v (bytes of 0..15) as the float 0.5 + q/256, one PRMT: the nibble becomes the
// top byte of the mantissa under the exponent of 0.5 (0x3F0q0000). Against an exact q (a
// PRMT into 2^23 + q and an FADD) it saves the FADD; the 0.5 it carries is taken out per
// word through the activations' sum.
__device__ __forceinline__ float half_nib(uint32_t v, int k) {
  return __uint_as_float(__byte_perm(v, 0x3F000000u, 0x7044u + (k << 8)));
}

// Row r of a part of `nr` rows of `nb` blocks at `part` (shared memory), from code word c0
// of the row on (a multiple of 32), times the lane's activations: the warp's sum, in every
// lane. Per word, P = Σ (0.5 + q/256)·x = S/2 + Σ q·x / 256 over its 8 values, so its
// contribution d·Σ q·x − c·S (c = z·d, or b for fmt3) is 256·d·P − (128·d + c)·S. The S/2 in
// P costs about 4 bits of its f32 rounding against Σ q·x / 256 (a relative error near 1e-6).
__device__ __forceinline__ float row_dot(const uint8_t* part, int nr, int r, int nb, int c0,
                                         const Xs& x, int words, int fmt3, int lane) {
  const uint32_t* code = reinterpret_cast<const uint32_t*>(part) + (size_t)r * nb * 4;
  const float2* head =
      reinterpret_cast<const float2*>(part + (size_t)nr * nb * 16) + (size_t)r * nb;
  float acc = 0.0f;
#pragma unroll
  for (int j = 0; j < I4S_MAX_WORDS; ++j)
    if (j < words) {
      const int c = c0 + lane + 32 * j;
      const uint32_t w = code[c];
      const float2 hd = head[c >> 2];
      const uint32_t lo = w & 0x0F0F0F0Fu, hi = (w >> 4) & 0x0F0F0F0Fu;
      const float4 a = x.a[j], b = x.b[j];
      float p0 = half_nib(lo, 0) * a.x, p1 = half_nib(hi, 0) * b.x;
      p0 = fmaf(half_nib(lo, 1), a.y, p0);
      p1 = fmaf(half_nib(hi, 1), b.y, p1);
      p0 = fmaf(half_nib(lo, 2), a.z, p0);
      p1 = fmaf(half_nib(hi, 2), b.z, p1);
      p0 = fmaf(half_nib(lo, 3), a.w, p0);
      p1 = fmaf(half_nib(hi, 3), b.w, p1);
      const float off = fmaf(128.0f, hd.x, fmt3 ? hd.y : hd.x * hd.y);
      acc = fmaf(256.0f * hd.x, p0 + p1, fmaf(-off, x.s[j], acc));
    }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
  return acc;
}

// Producer lane 0: rows [r0, r0 + nr) of a matrix of `rows` rows of `nb` blocks (its planes
// at m) to `dst`: their codes, then their headers, completing on `bar`.
__device__ __forceinline__ void part_fetch(uint8_t* dst, const uint8_t* m, int rows, int nb,
                                           int r0, int nr, uint32_t bar) {
  const uint32_t codes = (uint32_t)(nr * nb) * 16u;
  bulk_copy(smem_addr(dst), m + (size_t)r0 * nb * 16, codes, bar);
  bulk_copy(smem_addr(dst + codes), m + (size_t)rows * nb * 16 + (size_t)r0 * nb * 8,
            codes / 2, bar);
}
}  // namespace i4s

// Arguments as `moe_stream_layer`, plus `fmt3` (the planes' format 3). Dynamic smem: stages *
// stage_bytes, then max(d, (top_k + shared) * inter) f32.
extern "C" __global__ void __launch_bounds__(STREAM_THREADS, 1)
    moe_int4_stream_layer(const uint64_t* wtab, const float* x, int top_k,
                          const uint32_t* offsets, int E, const uint32_t* slots, float* h,
                          float* y, int d, int inter, int fmt3, int rows_gu, int rows_dn,
                          int stages, int stage_bytes, int shared, uint32_t* sync) {
  extern __shared__ __align__(128) uint8_t stream_buf[];
  __shared__ i4s::Smem s;
  __shared__ MoeLayerSlots sl;
  __shared__ __align__(8) uint64_t xbar;
  const int p = top_k;
  const int nb0 = d >> 5, nb1 = inter >> 5;
  // Bytes of one gate (or up) row and of one down row.
  const uint32_t gu_row = (uint32_t)nb0 * 24u, dn_row = (uint32_t)nb1 * 24u;
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
  // gate/up tiles are known.
  int t0 = 0x7fffffff, total = 0, limit = shared * tps0;
  auto fetch = [&](int u, int stage) {
    uint8_t* dst = stream_buf + (size_t)stage * stage_bytes;
    const uint32_t bar = smem_addr(&s.full[stage]);
    if (u < t0) {
      const int j = u / tps0, r0 = (u % tps0) * rows_gu, nr = min(rows_gu, inter - r0);
      bar_expect(bar, 2u * nr * gu_row);
      i4s::part_fetch(dst, sl.gate[j], inter, nb0, r0, nr, bar);
      i4s::part_fetch(dst + nr * gu_row, sl.up[j], inter, nb0, r0, nr, bar);
    } else {
      const int v = u - t0, j = v / tps1, r0 = (v % tps1) * rows_dn;
      const int nr = min(rows_dn, d - r0);
      bar_expect(bar, nr * dn_row);
      i4s::part_fetch(dst, sl.down[j], d, nb1, r0, nr, bar);
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
    bool counted = false;
    for (int i = 0;; ++i) {
      const int u = blockIdx.x + i * gridDim.x;
      if (u >= total) break;
      if (u >= t0 && !counted) {
        layer_count_in(sync, lane);
        counted = true;
      }
      const int stage = i % stages;
      bar_wait(smem_addr(&s.empty[stage]), (i / stages) & 1);
      if (u < t0) {
        const int j = u / tps0, r0 = (u % tps0) * rows_gu, nr = min(rows_gu, inter - r0);
        if (lane < nr) {
          const float g = s.part[stage][lane], up = s.part[stage][nr + lane];
          h[(size_t)sl.q[j] * inter + r0 + lane] = (g / (1.0f + expf(-g))) * up;
        }
      } else {
        const int v = u - t0, j = v / tps1, r0 = (v % tps1) * rows_dn;
        const int nr = min(rows_dn, d - r0);
        if (lane < nr) y[(size_t)sl.q[j] * d + r0 + lane] = s.part[stage][lane];
      }
      __syncwarp();
      if (lane == 0 && u + stages * (int)gridDim.x < total) fetch(u + stages * gridDim.x, stage);
    }
    if (!counted) layer_count_in(sync, lane);
    return;
  }
  bar_wait(smem_addr(&xbar), 0);
  i4s::Xs xr;
  i4s::load_x(xr, xs, d >> 8, lane);
  int i = 0;
  for (;; ++i) {
    const int u = blockIdx.x + i * gridDim.x;
    if (u >= t0) break;
    const int stage = i % stages;
    const int r0 = (u % tps0) * rows_gu, nr = min(rows_gu, inter - r0);
    bar_wait(smem_addr(&s.full[stage]), (i / stages) & 1);
    const uint8_t* tile = stream_buf + (size_t)stage * stage_bytes;
    for (int r = warp; r < 2 * nr; r += STREAM_CONSUMERS) {
      const bool up = r >= nr;
      const float v = i4s::row_dot(tile + (up ? nr * gu_row : 0u), nr, up ? r - nr : r, nb0, 0,
                                   xr, d >> 8, fmt3, lane);
      if (lane == 0) s.part[stage][r] = v;
    }
    __syncwarp();
    if (lane == 0) stream_bar_arrive(smem_addr(&s.empty[stage]));
  }
  // The handoff: every CTA's SwiGLU rows are written; stage them where x was.
  layer_handoff(sync, xs, h, (p + shared) * inter);
  int loaded = -1;  // the slot row whose activations xr holds
  for (;; ++i) {
    const int u = blockIdx.x + i * gridDim.x;
    if (u >= total) break;
    const int stage = i % stages;
    const int v = u - t0, j = v / tps1, r0 = (v % tps1) * rows_dn;
    const int nr = min(rows_dn, d - r0);
    if (sl.q[j] != loaded) {
      loaded = sl.q[j];
      i4s::load_x(xr, xs + (size_t)loaded * inter, inter >> 8, lane);
    }
    bar_wait(smem_addr(&s.full[stage]), (i / stages) & 1);
    const uint8_t* tile = stream_buf + (size_t)stage * stage_bytes;
    for (int r = warp; r < nr; r += STREAM_CONSUMERS) {
      const float val = i4s::row_dot(tile, nr, r, nb1, 0, xr, inter >> 8, fmt3, lane);
      if (lane == 0) s.part[stage][r] = val;
    }
    __syncwarp();
    if (lane == 0) stream_bar_arrive(smem_addr(&s.empty[stage]));
  }
}

// ---------------------------------------------------------------------------------------
// One token's product y [o] = x [k] · wᵀ with a 4-bit matrix w [o, k] in the same planes
// (decode at batch 1 of dense and attention projections): `gemv_stream_1`'s schedule — one
// persistent CTA per SM walks tiles of `rows` whole packed rows through `stages` stages, a
// producer warp queueing each tile with two bulk copies (the rows' codes, then their
// headers) — with the layer's row products above. The packed GEMV (`quant_gemv_*` in
// quant.cu) reached 1.3 TB/s at its widest and needed a second launch to add K splits on
// narrow matrices; here a tile is in flight whole and each row is one warp's.
//
// Rows too wide for one lane's registers split into `slices` column slices (1, 2, 4 or 8;
// cols / 256 / slices <= I4S_MAX_WORDS words per lane): consumer warp w takes slice
// w % slices of rows w / slices, + 8 / slices, ..., and loads that slice of x once. The
// producer adds a row's slices in order (the result does not depend on timing). Needs
// cols % (256 * slices) == 0, rows * slices <= I4S_GEMV_UNITS, 16-byte aligned x; the
// first `stages` tiles are queued before the wait on the previous kernel.
#define I4S_GEMV_UNITS 64

namespace i4s {
struct GemvSmem {
  uint64_t full[STREAM_MAX_STAGES];
  uint64_t empty[STREAM_MAX_STAGES];
  float part[STREAM_MAX_STAGES][I4S_GEMV_UNITS];
};
}  // namespace i4s

// Dynamic smem: stages * stage_bytes (stage_bytes >= rows * cols / 32 * 24, a multiple of
// 128). Grid <= ceil(o / rows), block STREAM_THREADS.
extern "C" __global__ void __launch_bounds__(STREAM_THREADS, 1)
    quant_gemv_int4_stream_1(const uint8_t* w, const float* x, float* y, int o, int k,
                             int fmt3, int rows, int slices, int stages, int stage_bytes) {
  extern __shared__ __align__(128) uint8_t stream_buf[];
  __shared__ i4s::GemvSmem s;
  const int nb = k >> 5;
  const int tiles = (o + rows - 1) / rows;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const bool producer = warp == STREAM_CONSUMERS;
  auto fetch = [&](int t, int stage) {
    const int r0 = t * rows, nr = min(rows, o - r0);
    const uint32_t bar = smem_addr(&s.full[stage]);
    bar_expect(bar, (uint32_t)(nr * nb) * 24u);
    i4s::part_fetch(stream_buf + (size_t)stage * stage_bytes, w, o, nb, r0, nr, bar);
  };
  stream_init(s, stages);
  if (producer && lane == 0)
    for (int i = 0; i < stages && blockIdx.x + i * gridDim.x < tiles; ++i)
      fetch(blockIdx.x + i * gridDim.x, i);
  pdl_enter();
  if (producer) {
    for (int i = 0;; ++i) {
      const int t = blockIdx.x + i * gridDim.x;
      if (t >= tiles) break;
      const int stage = i % stages;
      bar_wait(smem_addr(&s.empty[stage]), (i / stages) & 1);
      const int nr = min(rows, o - t * rows);
      if (lane < nr) {
        float v = 0.0f;
        for (int j = 0; j < slices; ++j) v += s.part[stage][lane * slices + j];
        y[(size_t)t * rows + lane] = v;
      }
      __syncwarp();
      if (lane == 0 && t + stages * (int)gridDim.x < tiles) fetch(t + stages * gridDim.x, stage);
    }
    return;
  }
  const int slice = warp % slices, words = (k >> 8) / slices, c0 = slice * 32 * words;
  i4s::Xs xr;
  i4s::load_x(xr, x + 8 * c0, words, lane);
  for (int i = 0;; ++i) {
    const int t = blockIdx.x + i * gridDim.x;
    if (t >= tiles) break;
    const int stage = i % stages;
    const int nr = min(rows, o - t * rows);
    bar_wait(smem_addr(&s.full[stage]), (i / stages) & 1);
    const uint8_t* tile = stream_buf + (size_t)stage * stage_bytes;
    for (int r = warp / slices; r < nr; r += STREAM_CONSUMERS / slices) {
      const float v = i4s::row_dot(tile, nr, r, nb, c0, xr, words, fmt3, lane);
      if (lane == 0) s.part[stage][r * slices + slice] = v;
    }
    __syncwarp();
    if (lane == 0) stream_bar_arrive(smem_addr(&s.empty[stage]));
  }
}
