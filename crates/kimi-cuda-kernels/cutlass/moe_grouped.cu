// Grouped expert GEMM of a MoE layer on Hopper's warp-specialized TMA + wgmma pipeline,
// built from CUTLASS 3 collectives (headers from the pinned `nvidia-cutlass` wheel).
//
// Unlike `kernels/*.cu` (cubins loaded through the driver API), this file is compiled with
// its host code into a static library: CUTLASS builds its kernel parameters (TMA
// descriptors, scheduler state) on the host. The C functions below are the only interface.
//
// The routed (token, expert) pairs arrive sorted by expert (`moe_lists`: `offsets[E+1]`),
// and their activation rows A were gathered in that order (bf16, `[P, K]` row-major), so
// that expert e's rows are the contiguous block A[offsets[e] .. offsets[e+1]). Every expert
// is one group of a grouped GEMM D_e = A_e · W_eᵀ (+ beta · D_e), W_e = `[N, K]` row-major
// bf16 as stored in the checkpoint. A device kernel writes the per-group shapes, pointers
// and strides from `offsets` and the weight table, so the host never reads the counts back
// and the launch can sit inside a CUDA graph; the GEMM runs a persistent grid of one CTA
// per SM that walks the groups' tiles (experts without pairs have no tiles).
//
//   glu = 1: 2E groups; group e < E multiplies by gate_e into D[:, 0:N), group E + e by
//            up_e into D[:, N:2N) (ldd = 2N), so one launch does both halves;
//   glu = 0: E groups by down_e into D[:, 0:N) (ldd = N).
//
// The weight table holds per expert the addresses (gate, up, down), as for the other MoE
// kernels. Accumulation is f32; D is f32 or bf16.

#include <cstdint>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/epilogue/thread/linear_combination.h"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/group_array_problem_shape.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"

using namespace cute;

namespace kimi_moe_grouped {

using ProblemShape = cutlass::gemm::GroupProblemShape<Shape<int, int, int>>;
using Shape3 = ProblemShape::UnderlyingProblemShape;
using Bf16 = cutlass::bfloat16_t;

// Tiles of 128 pairs x 256 features x 64 k, two consumer warp groups (cooperative), no
// cluster. Measured on an H200 (one 48B MoE layer, `check moe-bench`, 8K tokens, bf16
// operands): 3.50 ms against 3.89 ms with 128 x 128 tiles and 4.40 ms with 128 x 128 tiles
// in clusters of two sharing weight tiles by multicast (neighbouring tiles often belong to
// different experts), 4.22 ms with 256 x 128 and 3.85 ms with the ping-pong schedule on
// 128 x 128; 128 x 256 was also the fastest at 256-1024 tokens.
template <class ElementD>
struct GroupedGemm {
  using TileShape = Shape<_128, _256, _64>;
  using ClusterShape = Shape<_1, _1, _1>;
  using LayoutA = cutlass::layout::RowMajor;     // pair rows, k contiguous
  using LayoutB = cutlass::layout::ColumnMajor;  // weight rows [N, K], k contiguous
  using LayoutD = cutlass::layout::RowMajor;
  static constexpr int kAlignAB = 8;
  static constexpr int kAlignD = 16 / sizeof(ElementD);

  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, ElementD, LayoutD*,
      kAlignD, ElementD, LayoutD*, kAlignD,
      cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative,
      cutlass::epilogue::fusion::LinearCombination<ElementD, float, ElementD,
                                                   float>>::CollectiveOp;

  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Bf16, LayoutA*, kAlignAB, Bf16,
      LayoutB*, kAlignAB, float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename Epilogue::SharedStorage))>,
      cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative>::CollectiveOp;

  using Kernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, Mainloop, Epilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
  using StrideA = typename Kernel::InternalStrideA;
  using StrideB = typename Kernel::InternalStrideB;
  using StrideD = typename Kernel::InternalStrideD;
};

// The per-group arrays, carved from one scratch buffer in this order.
struct GroupArrays {
  Shape3* shapes;
  const Bf16** a;
  const Bf16** b;
  void** d;
  int64_t* sa;  // each Internal stride type is one int64 (static_assert below)
  int64_t* sb;
  int64_t* sd;
};

constexpr size_t align16(size_t n) { return (n + 15) & ~size_t(15); }

size_t arrays_bytes(int groups) {
  const size_t g = (size_t)groups;
  return align16(g * sizeof(Shape3)) + 6 * align16(g * 8);
}

GroupArrays carve(void* scratch, int groups) {
  char* p = static_cast<char*>(scratch);
  const size_t g = (size_t)groups;
  GroupArrays r;
  r.shapes = reinterpret_cast<Shape3*>(p);
  p += align16(g * sizeof(Shape3));
  r.a = reinterpret_cast<const Bf16**>(p);
  p += align16(g * 8);
  r.b = reinterpret_cast<const Bf16**>(p);
  p += align16(g * 8);
  r.d = reinterpret_cast<void**>(p);
  p += align16(g * 8);
  r.sa = reinterpret_cast<int64_t*>(p);
  p += align16(g * 8);
  r.sb = reinterpret_cast<int64_t*>(p);
  p += align16(g * 8);
  r.sd = reinterpret_cast<int64_t*>(p);
  return r;
}

// One thread per group: shape, operand addresses and leading dimensions from the expert
// offsets and the weight table.
__global__ void fill_groups(GroupArrays g, int groups, int experts, int glu,
                            const uint32_t* offsets, const uint64_t* wtab, const Bf16* a,
                            char* d, int d_elem_bytes, int n, int k, int ldd) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= groups) return;
  const int e = i % experts;
  const int half = i / experts;  // glu: 0 = gate, 1 = up
  const uint32_t row0 = offsets[e];
  const int m = (int)(offsets[e + 1] - row0);
  const int which = glu ? half : 2;
  g.shapes[i] = Shape3{m, n, k};
  g.a[i] = a + (size_t)row0 * k;
  g.b[i] = reinterpret_cast<const Bf16*>(wtab[3 * e + which]);
  g.d[i] = d + ((size_t)row0 * ldd + (size_t)half * n) * d_elem_bytes;
  g.sa[i] = k;
  g.sb[i] = k;
  g.sd[i] = ldd;
}

int sm_count_cached() {
  static int count = 0;
  if (count == 0) {
    int dev = 0;
    if (cudaGetDevice(&dev) != cudaSuccess) return 0;
    count = cutlass::KernelHardwareInfo::query_device_multiprocessor_count(dev);
  }
  return count;
}

template <class Cfg>
typename Cfg::Gemm::Arguments arguments(GroupArrays g, int groups, float beta) {
  static_assert(sizeof(typename Cfg::StrideA) == 8 && sizeof(typename Cfg::StrideB) == 8 &&
                    sizeof(typename Cfg::StrideD) == 8,
                "one int64 per stride");
  using ElementD = typename Cfg::Gemm::ElementD;
  cutlass::KernelHardwareInfo hw;
  hw.device_id = 0;
  hw.sm_count = sm_count_cached();
  typename Cfg::Gemm::Arguments args;
  decltype(args.epilogue.thread) fusion;
  fusion.alpha = 1.0f;
  fusion.beta = beta;
  fusion.alpha_ptr = nullptr;
  fusion.beta_ptr = nullptr;
  fusion.alpha_ptr_array = nullptr;
  fusion.beta_ptr_array = nullptr;
  fusion.dAlpha = {_0{}, _0{}, 0};
  fusion.dBeta = {_0{}, _0{}, 0};
  auto* sd = reinterpret_cast<typename Cfg::StrideD*>(g.sd);
  args = typename Cfg::Gemm::Arguments{
      cutlass::gemm::GemmUniversalMode::kGrouped,
      {groups, g.shapes, nullptr},
      {g.a, reinterpret_cast<typename Cfg::StrideA*>(g.sa), g.b,
       reinterpret_cast<typename Cfg::StrideB*>(g.sb)},
      {fusion, const_cast<const ElementD**>(reinterpret_cast<ElementD**>(g.d)), sd,
       reinterpret_cast<ElementD**>(g.d), sd},
      hw};
  return args;
}

template <class Cfg>
size_t workspace_bytes(int groups) {
  GroupArrays none{};
  auto args = arguments<Cfg>(none, groups, 0.0f);
  return Cfg::Gemm::get_workspace_size(args);
}

template <class Cfg>
int run(GroupArrays g, int groups, float beta, void* workspace, cudaStream_t stream) {
  auto args = arguments<Cfg>(g, groups, beta);
  typename Cfg::Gemm gemm;
  if (gemm.can_implement(args) != cutlass::Status::kSuccess) return 3;
  if (gemm.initialize(args, workspace, stream) != cutlass::Status::kSuccess) return 4;
  if (gemm.run(stream) != cutlass::Status::kSuccess) return 5;
  return cudaGetLastError() == cudaSuccess ? 0 : 6;
}

using GemmF32 = GroupedGemm<float>;
using GemmBf16 = GroupedGemm<Bf16>;

}  // namespace kimi_moe_grouped

using namespace kimi_moe_grouped;

extern "C" {

// Bytes of the scratch buffer (per-group arrays) and of CUTLASS's workspace for `groups`
// groups; 0 when the device cannot be queried.
size_t kimi_moe_grouped_scratch_bytes(int groups) { return arrays_bytes(groups); }

size_t kimi_moe_grouped_workspace_bytes(int groups, int d_f32) {
  if (sm_count_cached() <= 0) return 0;
  return d_f32 ? workspace_bytes<GemmF32>(groups) : workspace_bytes<GemmBf16>(groups);
}

// Runs one projection of every routed pair (see the top of this file). `a`: bf16 pair rows
// [P, k]; `d`: [P, ldd] of f32 (`d_f32`) or bf16, written at column 0 (and n for the up
// half when `glu`); `beta` = 1 adds to what `d` holds. `scratch` and `workspace` hold the
// bytes the two functions above give. Returns 0, or a code for the failing step:
// 1 bad sizes, 2 the group kernel's launch, 3 can_implement, 4 initialize, 5/6 the launch.
int kimi_moe_grouped_gemm(int glu, int d_f32, int experts, const uint32_t* offsets,
                          const uint64_t* wtab, const void* a, void* d, int n, int k, int ldd,
                          float beta, void* scratch, void* workspace, void* stream) {
  if (experts <= 0 || n <= 0 || k <= 0 || k % 8 != 0 || n % 8 != 0 || ldd < (glu ? 2 : 1) * n)
    return 1;
  const int groups = glu ? 2 * experts : experts;
  auto s = static_cast<cudaStream_t>(stream);
  GroupArrays g = carve(scratch, groups);
  fill_groups<<<(groups + 127) / 128, 128, 0, s>>>(
      g, groups, experts, glu, offsets, wtab, static_cast<const Bf16*>(a),
      static_cast<char*>(d), d_f32 ? 4 : 2, n, k, ldd);
  if (cudaGetLastError() != cudaSuccess) return 2;
  return d_f32 ? run<GemmF32>(g, groups, beta, workspace, s)
               : run<GemmBf16>(g, groups, beta, workspace, s);
}

}  // extern "C"
