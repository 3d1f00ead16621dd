//! The planner of `Backend::moe`: how a call routes its tokens and which kernels run its
//! experts.

use kimi_core::DType;

use super::bank::PackedFormat;
use super::bank::{packed_token_tiles, PackedBank};
use super::stream::{
    layer_plan, packed_layer_plan, stream_plan, stream_staged_bytes, LayerPlan, StreamPlan,
    STREAM_MAX_SLOTS,
};
use super::{GroupedMoeKernel, KernelConfig};

/// The most experts `moe_route_warp` holds in its lanes' registers (32 × `ROUTE_MAXJ`).
pub(crate) const ROUTE_WARP_MAX_EXPERTS: usize = 512;

/// The most picks per token `moe_route_one` takes (one per lane of the routing warp).
pub(crate) const ROUTE_ONE_MAX_TOP_K: usize = 32;

/// The routed experts' common layout: every expert's gate and up `[inter, hidden]` and down
/// `[hidden, inter]`, all of `dtype`, one the kernels read (f32, bf16 or f16).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct ExpertLayout {
    pub(crate) inter: usize,
    pub(crate) dtype: DType,
}

/// The layer's shared expert.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum SharedExpert {
    Absent,
    /// Of the routed experts' shapes and kind (bf16, or packed in their format): the
    /// streamed path runs it as one more slot.
    Foldable,
    /// Anything else: it runs as an MLP.
    Separate,
}

/// What the one-launch routing needs of the router.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct RouterFacts {
    /// Ungrouped routing (at most one group).
    pub(crate) ungrouped: bool,
    /// The router weight is f32 (as the backend converts it) and 16-byte aligned.
    pub(crate) f32_aligned: bool,
    /// No correction bias, or one `moe_route_one` can copy as 4-byte words: 4-byte aligned,
    /// f32 or an even number of 16-bit values.
    pub(crate) bias_fits: bool,
}

/// What [`plan_moe`] decides from: one `moe` call's sizes and its tensors' properties.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct MoeCall {
    pub(crate) tokens: usize,
    pub(crate) experts: usize,
    pub(crate) top_k: usize,
    pub(crate) hidden: usize,
    /// `None` where the experts differ in shape or dtype, or have a dtype no kernel reads.
    pub(crate) layout: Option<ExpertLayout>,
    /// Experts kept packed in a format the packed-expert kernels read (MXFP4, 4-bit
    /// integers), where no other kernel reads their layout.
    pub(crate) packed: Option<PackedBank>,
    pub(crate) shared: SharedExpert,
    pub(crate) router: RouterFacts,
    /// Every routed and shared expert weight is 16-byte aligned.
    pub(crate) weights_aligned: bool,
    /// The hidden states are 16-byte aligned.
    pub(crate) input_aligned: bool,
    /// A pass is being recorded (CUTLASS's host launch would bypass the recorder).
    pub(crate) recording: bool,
    /// The device's SMs (persistent kernels run one CTA per SM).
    pub(crate) sm_count: usize,
}

/// How a `moe` call routes its tokens.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum RoutePath {
    /// `moe_route_one`: logits, picks and pair lists of one token in one launch.
    OneLaunch,
    /// The router GEMM, `moe_route*`, then `moe_lists`.
    Separate,
}

/// The launches of [`MoePath::Streamed`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum StreamPasses {
    /// Gate/up and down in one `moe_stream_layer` launch.
    Layer(LayerPlan),
    /// Two `moe_stream_1` passes.
    Two {
        gate_up: StreamPlan,
        down: StreamPlan,
    },
    /// 4-bit integer experts in one `moe_int4_stream_layer` launch (`offset`: the planes'
    /// `q · a − b` format).
    Int4Layer { plan: LayerPlan, offset: bool },
}

/// The grouped tensor-core GEMM of [`MoePath::Grouped`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum GroupedPath {
    /// CUTLASS's grouped GEMM over the pairs gathered in sorted order.
    Cutlass,
    /// The pipelined `moe_mma_*`.
    Pipelined,
    /// The single-stage `moe_grouped_mma`.
    SingleStage,
}

/// Which kernels run a `moe` call's experts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum MoePath {
    /// One token: its routed experts (and the shared one when `fold_shared`) streamed by
    /// persistent kernels, bf16 or 4-bit integers; a shared expert not folded runs as an
    /// MLP.
    Streamed {
        inter: usize,
        fold_shared: bool,
        passes: StreamPasses,
    },
    /// `moe_expert_gemv` over every (token, expert) pair, gate/up then down.
    FusedGemv { inter: usize, dtype: DType },
    /// A grouped tensor-core GEMM per projection (bf16 experts).
    Grouped { inter: usize, kernel: GroupedPath },
    /// Packed experts on the tensor cores (`moe_int4_mma_*`), the weights widened in
    /// registers; the shared expert runs as an MLP.
    PackedMma {
        bank: PackedBank,
        token_tiles: usize,
    },
    /// cuBLAS per expert, after one host read of the routing.
    PerExpert,
}

/// The routing and expert kernels of one `moe` call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct MoePlan {
    pub(crate) route: RoutePath,
    pub(crate) experts: MoePath,
}

/// How a `moe` call of `call` runs under `cfg`.
pub(crate) fn plan_moe(cfg: &KernelConfig, call: &MoeCall) -> MoePlan {
    MoePlan {
        route: plan_route(cfg, call),
        experts: plan_experts(cfg, call),
    }
}

fn plan_route(cfg: &KernelConfig, c: &MoeCall) -> RoutePath {
    let one_launch = c.tokens == 1
        && cfg.moe_route_one
        && c.router.ungrouped
        && c.experts <= ROUTE_WARP_MAX_EXPERTS
        && c.top_k <= ROUTE_ONE_MAX_TOP_K.min(c.experts)
        && c.router.bias_fits
        && c.router.f32_aligned
        && c.hidden.is_multiple_of(4)
        && c.input_aligned;
    if one_launch {
        RoutePath::OneLaunch
    } else {
        RoutePath::Separate
    }
}

fn plan_experts(cfg: &KernelConfig, c: &MoeCall) -> MoePath {
    if let Some(bank) = c.packed {
        if let Some(path) = plan_int4_streamed(cfg, c, bank) {
            return path;
        }
        return MoePath::PackedMma {
            bank,
            token_tiles: packed_token_tiles(cfg, c.tokens, c.top_k, c.experts),
        };
    }
    if c.tokens == 1 && cfg.moe_stream {
        let streamable = c
            .layout
            .filter(|l| grouped_layout(l, c.hidden))
            .and_then(|l| plan_streamed(cfg, c, l.inter));
        if let Some(path) = streamable {
            return path;
        }
    }
    plan_table_experts(
        cfg,
        &TableCall {
            tokens: c.tokens,
            top_k: c.top_k,
            hidden: c.hidden,
            layout: c.layout,
            weights_aligned: c.weights_aligned,
            input_aligned: c.input_aligned,
            recording: c.recording,
        },
    )
}

/// What [`plan_table_experts`] decides from: routed experts read through a device table of
/// their addresses, without a shared expert (a `moe` call's, or an expert bank's).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct TableCall {
    pub(crate) tokens: usize,
    pub(crate) top_k: usize,
    pub(crate) hidden: usize,
    /// `None` where the experts differ in shape or dtype, or have a dtype no kernel reads.
    pub(crate) layout: Option<ExpertLayout>,
    /// Every expert weight is 16-byte aligned.
    pub(crate) weights_aligned: bool,
    /// The hidden states are 16-byte aligned.
    pub(crate) input_aligned: bool,
    /// A pass is being recorded (CUTLASS's host launch would bypass the recorder).
    pub(crate) recording: bool,
}

/// The grouped tensor-core kernels' (and the streamed ones') layout: bf16 experts with both
/// sizes multiples of 64.
fn grouped_layout(l: &ExpertLayout, hidden: usize) -> bool {
    l.dtype == DType::BF16 && l.inter > 0 && l.inter.is_multiple_of(64) && hidden.is_multiple_of(64)
}

/// The table kernels of SwiGLU experts: the fused GEMV for few tokens, a grouped tensor-core
/// GEMM for more, cuBLAS per expert where neither reads the layout. Never
/// [`MoePath::Streamed`].
pub(crate) fn plan_table_experts(cfg: &KernelConfig, c: &TableCall) -> MoePath {
    if c.tokens <= cfg.fused_moe_max_tokens {
        if let Some(l) = c.layout.filter(|l| l.inter > 0) {
            return MoePath::FusedGemv {
                inter: l.inter,
                dtype: l.dtype,
            };
        }
    }
    let Some(inter) = c
        .layout
        .filter(|l| grouped_layout(l, c.hidden))
        .map(|l| l.inter)
    else {
        return MoePath::PerExpert;
    };
    let pairs = c.tokens * c.top_k;
    let staged = cfg.grouped_moe != GroupedMoeKernel::SingleStage;
    let cutlass = match cfg.grouped_moe {
        GroupedMoeKernel::Pipelined => false,
        GroupedMoeKernel::Cutlass => true,
        GroupedMoeKernel::Auto | GroupedMoeKernel::SingleStage => {
            pairs >= cfg.cutlass_min_pairs.for_precision(cfg.precision)
        }
    };
    let kernel = if c.weights_aligned
        && !c.recording
        && staged
        && cutlass
        && c.input_aligned
        && c.hidden.is_multiple_of(8)
    {
        GroupedPath::Cutlass
    } else if c.weights_aligned && staged {
        GroupedPath::Pipelined
    } else if c.weights_aligned && c.input_aligned {
        GroupedPath::SingleStage
    } else {
        return MoePath::PerExpert;
    };
    MoePath::Grouped { inter, kernel }
}

/// The streamed path of one token whose experts fit the grouped kernels' layout, or `None`
/// where its cut does not fit (too many slots, shapes the tiles do not divide, unaligned
/// weights).
fn plan_streamed(cfg: &KernelConfig, c: &MoeCall, inter: usize) -> Option<MoePath> {
    let (k, d) = (c.top_k, c.hidden);
    let fold_shared = c.shared == SharedExpert::Foldable;
    let slots = k.min(c.experts) + fold_shared as usize;
    if slots > STREAM_MAX_SLOTS {
        return None;
    }
    let staged = |glu, cols| stream_staged_bytes(glu, k, fold_shared, cols);
    let shape = cfg.stream_shape;
    let gate_up = stream_plan(shape, c.sm_count, d, inter * slots, 2, staged(true, d))?;
    let down = stream_plan(shape, c.sm_count, inter, d * slots, 1, staged(false, inter))?;
    if !c.weights_aligned || !c.input_aligned {
        return None;
    }
    // The pair rows, then the shared expert's.
    let rows = c.tokens * k + if fold_shared { c.tokens } else { 0 };
    let layer = cfg
        .moe_layer
        .then(|| layer_plan(shape, c.sm_count, d, inter, rows))
        .flatten();
    Some(MoePath::Streamed {
        inter,
        fold_shared,
        passes: layer.map_or(StreamPasses::Two { gate_up, down }, StreamPasses::Layer),
    })
}

/// One token of 4-bit integer experts in one `moe_int4_stream_layer` launch, or `None`
/// where it does not apply (more tokens, MXFP4, the layer launch or `int4_stream_layer`
/// off, widths its lanes do not divide, unaligned weights).
fn plan_int4_streamed(cfg: &KernelConfig, c: &MoeCall, bank: PackedBank) -> Option<MoePath> {
    let PackedFormat::Int4 { offset } = bank.format else {
        return None;
    };
    if c.tokens != 1 || !cfg.int4_stream_layer || !cfg.moe_stream || !cfg.moe_layer {
        return None;
    }
    if !c.weights_aligned || !c.input_aligned || bank.width != c.hidden {
        return None;
    }
    let fold_shared = c.shared == SharedExpert::Foldable;
    let slots = c.top_k.min(c.experts) + fold_shared as usize;
    if slots > STREAM_MAX_SLOTS {
        return None;
    }
    let plan = packed_layer_plan(
        c.sm_count,
        c.hidden,
        bank.inter,
        c.top_k + fold_shared as usize,
    )?;
    Some(MoePath::Streamed {
        inter: bank.inter,
        fold_shared,
        passes: StreamPasses::Int4Layer { plan, offset },
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::{CutlassMinPairs, GemmPrecision};

    /// A layer of the 48B model (256 bf16 experts top-8, hidden 2304, width 1024, a shared
    /// expert of the routed width) at `tokens`, everything aligned, on an H200.
    fn call_48b(tokens: usize) -> MoeCall {
        MoeCall {
            tokens,
            experts: 256,
            top_k: 8,
            hidden: 2304,
            layout: Some(ExpertLayout {
                inter: 1024,
                dtype: DType::BF16,
            }),
            packed: None,
            shared: SharedExpert::Foldable,
            router: RouterFacts {
                ungrouped: true,
                f32_aligned: true,
                bias_fits: true,
            },
            weights_aligned: true,
            input_aligned: true,
            recording: false,
            sm_count: 132,
        }
    }

    fn with(f: impl FnOnce(&mut KernelConfig)) -> KernelConfig {
        let mut cfg = KernelConfig::default();
        f(&mut cfg);
        cfg
    }

    fn experts(cfg: &KernelConfig, call: &MoeCall) -> MoePath {
        plan_moe(cfg, call).experts
    }

    const FUSED_BF16: MoePath = MoePath::FusedGemv {
        inter: 1024,
        dtype: DType::BF16,
    };

    fn grouped(kernel: GroupedPath) -> MoePath {
        MoePath::Grouped {
            inter: 1024,
            kernel,
        }
    }

    #[test]
    fn one_token_streams_the_whole_layer_in_one_launch() {
        let cfg = KernelConfig::default();
        let plan = plan_moe(&cfg, &call_48b(1));
        assert_eq!(plan.route, RoutePath::OneLaunch);
        assert!(matches!(
            plan.experts,
            MoePath::Streamed {
                inter: 1024,
                fold_shared: true,
                passes: StreamPasses::Layer(_)
            }
        ));
        let two = with(|c| c.moe_layer = false);
        assert!(matches!(
            experts(&two, &call_48b(1)),
            MoePath::Streamed {
                passes: StreamPasses::Two { .. },
                ..
            }
        ));
        // Without the stream, or with unaligned weights: the fused GEMV.
        let no_stream = with(|c| c.moe_stream = false);
        assert_eq!(experts(&no_stream, &call_48b(1)), FUSED_BF16);
        let unaligned = MoeCall {
            weights_aligned: false,
            ..call_48b(1)
        };
        assert_eq!(experts(&cfg, &unaligned), FUSED_BF16);
        // A shared expert of another width is not folded.
        let separate = MoeCall {
            shared: SharedExpert::Separate,
            ..call_48b(1)
        };
        assert!(matches!(
            experts(&cfg, &separate),
            MoePath::Streamed {
                fold_shared: false,
                ..
            }
        ));
    }

    #[test]
    fn one_launch_routing_needs_one_ungrouped_token() {
        let cfg = KernelConfig::default();
        assert_eq!(plan_moe(&cfg, &call_48b(2)).route, RoutePath::Separate);
        let off = with(|c| c.moe_route_one = false);
        assert_eq!(plan_moe(&off, &call_48b(1)).route, RoutePath::Separate);
        let mut grouped = call_48b(1);
        grouped.router.ungrouped = false;
        assert_eq!(plan_moe(&cfg, &grouped).route, RoutePath::Separate);
        let top_k_33 = MoeCall {
            top_k: 33,
            ..call_48b(1)
        };
        assert_eq!(plan_moe(&cfg, &top_k_33).route, RoutePath::Separate);
        let many = MoeCall {
            experts: 513,
            ..call_48b(1)
        };
        assert_eq!(plan_moe(&cfg, &many).route, RoutePath::Separate);
    }

    #[test]
    fn fused_gemv_up_to_56_tokens_then_grouped() {
        let cfg = KernelConfig::default();
        assert_eq!(experts(&cfg, &call_48b(2)), FUSED_BF16);
        assert_eq!(experts(&cfg, &call_48b(56)), FUSED_BF16);
        assert_eq!(
            experts(&cfg, &call_48b(57)),
            grouped(GroupedPath::Pipelined)
        );
        let wider = with(|c| c.fused_moe_max_tokens = 64);
        assert_eq!(experts(&wider, &call_48b(64)), FUSED_BF16);
    }

    #[test]
    fn cutlass_from_2048_pairs_under_half_and_16384_under_split() {
        let split = KernelConfig::default();
        let half = with(|c| c.precision = GemmPrecision::Half);
        // 8 picks per token: 256 tokens are 2048 pairs, 2048 tokens 16384.
        assert_eq!(
            experts(&half, &call_48b(255)),
            grouped(GroupedPath::Pipelined)
        );
        assert_eq!(
            experts(&half, &call_48b(256)),
            grouped(GroupedPath::Cutlass)
        );
        assert_eq!(
            experts(&split, &call_48b(2047)),
            grouped(GroupedPath::Pipelined)
        );
        assert_eq!(
            experts(&split, &call_48b(2048)),
            grouped(GroupedPath::Cutlass)
        );
        // Inside a recorded pass, or with unaligned hidden states: the pipelined kernel.
        let recording = MoeCall {
            recording: true,
            ..call_48b(8192)
        };
        assert_eq!(experts(&split, &recording), grouped(GroupedPath::Pipelined));
        let unaligned = MoeCall {
            input_aligned: false,
            ..call_48b(8192)
        };
        assert_eq!(experts(&split, &unaligned), grouped(GroupedPath::Pipelined));
    }

    #[test]
    fn grouped_overrides() {
        let single = with(|c| c.grouped_moe = GroupedMoeKernel::SingleStage);
        assert_eq!(
            experts(&single, &call_48b(8192)),
            grouped(GroupedPath::SingleStage)
        );
        let unaligned = MoeCall {
            input_aligned: false,
            ..call_48b(100)
        };
        assert_eq!(experts(&single, &unaligned), MoePath::PerExpert);
        let pipelined = with(|c| c.grouped_moe = GroupedMoeKernel::Pipelined);
        assert_eq!(
            experts(&pipelined, &call_48b(8192)),
            grouped(GroupedPath::Pipelined)
        );
        let cutlass = with(|c| c.grouped_moe = GroupedMoeKernel::Cutlass);
        assert_eq!(
            experts(&cutlass, &call_48b(57)),
            grouped(GroupedPath::Cutlass)
        );
        // What `KIMI_CUDA_MOE_GEMM=cutlass` sets: CUTLASS from the first pair.
        let always = with(|c| {
            c.cutlass_min_pairs = CutlassMinPairs { half: 0, split: 0 };
        });
        assert_eq!(
            experts(&always, &call_48b(57)),
            grouped(GroupedPath::Cutlass)
        );
    }

    #[test]
    fn other_experts_fall_back() {
        let cfg = KernelConfig::default();
        let f16 = MoeCall {
            layout: Some(ExpertLayout {
                inter: 1024,
                dtype: DType::F16,
            }),
            ..call_48b(1)
        };
        // f16 experts: the fused GEMV reads them, the grouped kernels do not.
        assert_eq!(
            experts(&cfg, &f16),
            MoePath::FusedGemv {
                inter: 1024,
                dtype: DType::F16
            }
        );
        let f16_prefill = MoeCall { tokens: 100, ..f16 };
        assert_eq!(experts(&cfg, &f16_prefill), MoePath::PerExpert);
        let odd_width = MoeCall {
            layout: Some(ExpertLayout {
                inter: 1000,
                dtype: DType::BF16,
            }),
            ..call_48b(100)
        };
        assert_eq!(experts(&cfg, &odd_width), MoePath::PerExpert);
        let mixed = MoeCall {
            layout: None,
            ..call_48b(1)
        };
        assert_eq!(experts(&cfg, &mixed), MoePath::PerExpert);
        let unaligned = MoeCall {
            weights_aligned: false,
            ..call_48b(100)
        };
        assert_eq!(experts(&cfg, &unaligned), MoePath::PerExpert);
    }

    #[test]
    fn int4_experts_run_packed_at_every_batch() {
        let cfg = KernelConfig::default();
        let bank = PackedBank {
            inter: 1024,
            width: 2304,
            format: crate::plan::PackedFormat::Int4 { offset: false },
        };
        let int4 = |tokens| MoeCall {
            layout: None,
            packed: Some(bank),
            shared: SharedExpert::Separate,
            ..call_48b(tokens)
        };
        // One pass per 8 pairs of an expert from two tokens, four groups of 8 at prefill.
        for (tokens, tiles) in [(2, 1), (64, 1), (512, 2), (8192, 4)] {
            assert_eq!(
                experts(&cfg, &int4(tokens)),
                MoePath::PackedMma {
                    bank,
                    token_tiles: tiles
                },
                "{tokens} tokens"
            );
        }
        // One token streams its layer in one launch, the shared expert folded in where it
        // is packed like the routed ones.
        let streamed = |shared| MoePath::Streamed {
            inter: 1024,
            fold_shared: shared == SharedExpert::Foldable,
            passes: StreamPasses::Int4Layer {
                plan: packed_layer_plan(
                    132,
                    2304,
                    1024,
                    8 + usize::from(shared == SharedExpert::Foldable),
                )
                .expect("fits"),
                offset: false,
            },
        };
        for shared in [SharedExpert::Separate, SharedExpert::Foldable] {
            let call = MoeCall { shared, ..int4(1) };
            assert_eq!(experts(&cfg, &call), streamed(shared));
        }
        // The default; with the layer launch or the 4-bit layer off, the tensor cores.
        assert_eq!(
            experts(&KernelConfig::default(), &int4(1)),
            streamed(SharedExpert::Separate)
        );
        let no_layer = with(|c| c.moe_layer = false);
        let no_int4 = with(|c| c.int4_stream_layer = false);
        for cfg in [no_layer, no_int4] {
            assert_eq!(
                experts(&cfg, &int4(1)),
                MoePath::PackedMma {
                    bank,
                    token_tiles: 1
                }
            );
        }
        // MXFP4 experts have no streamed kernel yet.
        let mxfp4 = MoeCall {
            packed: Some(PackedBank {
                format: PackedFormat::Mxfp4,
                ..bank
            }),
            ..int4(1)
        };
        assert!(matches!(experts(&cfg, &mxfp4), MoePath::PackedMma { .. }));
    }
}
