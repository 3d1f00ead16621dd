// Causal attention of MLA prefill in the expanded form (per head: q·k over 128 + 64 = 192
// dimensions, values of 128), on FlashInfer's Hopper prefill kernel (FA3 design: TMA loads,
// wgmma, warp specialization; headers from the pinned `flashinfer-python` wheel, which also
// bundles the CUTLASS and CCCL versions it is written against).
//
// bf16 q [qo_len, H, 192], k [kv_len, H, 192], v [kv_len, H, 128] → bf16 o [qo_len, H, 128],
// rows strided by the given element counts. The causal mask is aligned to the end: query i
// (of qo_len) sees keys 0 ..= kv_len - qo_len + i, so a segment that continues a cached
// prefix passes the prefix's keys first.

#include <flashinfer/attention/hopper/default_params.cuh>
#include <flashinfer/attention/hopper/prefill_sm90.cuh>
#include <flashinfer/attention/hopper/variants.cuh>
#include <flashinfer/attention/mask.cuh>

namespace kimi_mla_prefill {
using Bf16 = cutlass::bfloat16_t;
using Params = flashinfer::SinglePrefillParams<Bf16, Bf16, Bf16, int32_t>;
}  // namespace kimi_mla_prefill

extern "C" {

// Returns 0, 1 for unsupported sizes, or 100 + the CUDA error of the launch.
int kimi_mla_prefill_sm90(const void* q, const void* k, const void* v, void* o, int qo_len,
                          int kv_len, int heads, long long q_stride_n, long long k_stride_n,
                          long long v_stride_n, long long o_stride_n, float sm_scale,
                          void* stream) {
  using namespace kimi_mla_prefill;
  if (qo_len <= 0 || kv_len < qo_len || heads <= 0) return 1;
  Params p{};
  p.q_ptr = static_cast<Bf16*>(const_cast<void*>(q));
  p.k_ptr = static_cast<Bf16*>(const_cast<void*>(k));
  p.v_ptr = static_cast<Bf16*>(const_cast<void*>(v));
  p.o_ptr = static_cast<Bf16*>(o);
  p.lse_ptr = nullptr;
  p.additional_params.logits_soft_cap = 0.0f;
  p.additional_params.sm_scale = sm_scale;
  p.additional_params.scale_q = nullptr;
  p.additional_params.scale_k = nullptr;
  p.additional_params.scale_v = nullptr;
  p.q_stride_n = q_stride_n;
  p.k_stride_n = k_stride_n;
  p.v_stride_n = v_stride_n;
  p.o_stride_n = o_stride_n;
  p.q_stride_h = 192;
  p.k_stride_h = 192;
  p.v_stride_h = 128;
  p.o_stride_h = 128;
  p.qo_len = qo_len;
  p.kv_len = kv_len;
  p.num_qo_heads = heads;
  p.num_kv_heads = heads;
  p.group_size = 1;
  p.window_left = -1;
  p.causal = true;
  cudaError_t e = flashinfer::SinglePrefillWithKVCacheDispatched<
      192, 128, flashinfer::MaskMode::kCausal, /*LEFT_SLIDING_WINDOW=*/false,
      flashinfer::StandardAttention>(p, static_cast<cudaStream_t>(stream));
  return e == cudaSuccess ? 0 : 100 + (int)e;
}

}  // extern "C"
