//! The planner of `Backend::moe_experts`: which kernels run the routed experts of an
//! expert bank (Kimi K3's MXFP4 experts in the LatentMoE latent, 4-bit integer experts, a
//! tiered bank's SwiGLU experts through the `moe` step's table kernels, or any other
//! format), and how many pairs the packed-expert kernels serve per pass.

use super::moe::{plan_table_experts, MoePath, TableCall};
use super::KernelConfig;

/// The packed weight formats whose experts run on the tensor cores with the weights widened
/// in registers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum PackedFormat {
    /// MXFP4 in the tensor-core tiles (`moe_mxfp4_mma_*`).
    Mxfp4,
    /// 4-bit integers in the GEMV's planes (`moe_int4_mma_*`): `(q − z)·d` (Q4Z, Q4_0), or
    /// with `offset` `q·a − b` (Q4_1, Q4_K).
    Int4 { offset: bool },
}

/// A packed bank the device kernels read: every expert's gate and up `[inter, width]` and
/// down `[width, inter]` of one [`PackedFormat`], both widths whole 32-value blocks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct PackedBank {
    pub(crate) inter: usize,
    pub(crate) width: usize,
    pub(crate) format: PackedFormat,
}

/// What [`plan_expert_bank`] decides from: one `moe_experts` call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct BankCall {
    pub(crate) tokens: usize,
    pub(crate) top_k: usize,
    pub(crate) experts: usize,
    /// `None` where the bank is not one packed layout the kernels read.
    pub(crate) packed: Option<PackedBank>,
    /// SwiGLU experts the `moe` step's table kernels could read (`None` for other
    /// activations).
    pub(crate) table: Option<TableCall>,
}

/// How a `moe_experts` call runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum BankPath {
    /// `moe_mxfp4_mma_*` or `moe_int4_mma_*`: every pair on the tensor cores, the weights
    /// widened in registers, `token_tiles` groups of 8 pairs per pass over an expert's
    /// weights.
    PackedMma {
        bank: PackedBank,
        token_tiles: usize,
    },
    /// The `moe` step's kernels over a table of the experts' addresses: the fused GEMV or a
    /// grouped tensor-core GEMM ([`MoePath::FusedGemv`] or [`MoePath::Grouped`]), so that a
    /// tiered bank queues the same launches whichever experts its slots hold.
    Table(MoePath),
    /// Per expert with pairs: gather, the FFN, weighted scatter-add (one host read of the
    /// counts): any format and shape.
    OneByOne,
}

/// The path of one `moe_experts` call. Each pass over an expert's weights serves 8, 16 or
/// 32 of its pairs: the smallest that covers the pairs an active expert expects (the pairs
/// spread over the experts, or one per expert when there are fewer pairs than experts), so
/// that decode streams each expert once with the fewest registers; prefill re-reads an
/// expert's weights for every 32 pairs (plan/README.md has what was measured).
pub(crate) fn plan_expert_bank(cfg: &KernelConfig, call: &BankCall) -> BankPath {
    let Some(bank) = call.packed else {
        return match call.table.map(|t| plan_table_experts(cfg, &t)) {
            Some(MoePath::PerExpert) | None => BankPath::OneByOne,
            Some(path) => BankPath::Table(path),
        };
    };
    BankPath::PackedMma {
        bank,
        token_tiles: packed_token_tiles(cfg, call.tokens, call.top_k, call.experts),
    }
}

/// Groups of 8 pairs per pass of the packed-expert kernels over an expert's weights: the
/// smallest that covers the pairs an active expert expects (`mxfp4_token_tiles` forces it).
pub(crate) fn packed_token_tiles(
    cfg: &KernelConfig,
    tokens: usize,
    top_k: usize,
    experts: usize,
) -> usize {
    let pairs = tokens * top_k;
    let per_expert = pairs.div_ceil(experts.min(pairs).max(1));
    cfg.mxfp4_token_tiles.unwrap_or(match per_expert {
        0..=8 => 1,
        9..=16 => 2,
        _ => 4,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::{ExpertLayout, GroupedPath};
    use kimi_core::DType;

    const K3: PackedBank = PackedBank {
        inter: 3072,
        width: 3584,
        format: PackedFormat::Mxfp4,
    };

    fn tiles_at(cfg: &KernelConfig, tokens: usize) -> usize {
        let call = BankCall {
            tokens,
            top_k: 16,
            experts: 896,
            packed: Some(K3),
            table: None,
        };
        match plan_expert_bank(cfg, &call) {
            BankPath::PackedMma { bank, token_tiles } => {
                assert_eq!(bank, K3);
                token_tiles
            }
            other => panic!("K3's bank runs on the MXFP4 kernels, not {other:?}"),
        }
    }

    #[test]
    fn k3_banks_stream_once_at_decode_and_widen_the_pass_at_prefill() {
        let cfg = KernelConfig::default();
        // Decode: up to 448 tokens expect at most 8 pairs per expert of 896 (top-16).
        assert_eq!(tiles_at(&cfg, 1), 1);
        assert_eq!(tiles_at(&cfg, 256), 1);
        assert_eq!(tiles_at(&cfg, 448), 1);
        assert_eq!(tiles_at(&cfg, 449), 2);
        assert_eq!(tiles_at(&cfg, 896), 2);
        assert_eq!(tiles_at(&cfg, 8192), 4);
        let forced = KernelConfig {
            mxfp4_token_tiles: Some(4),
            ..KernelConfig::default()
        };
        assert_eq!(tiles_at(&forced, 1), 4);
        let other = BankCall {
            tokens: 3,
            top_k: 2,
            experts: 8,
            packed: None,
            table: None,
        };
        assert_eq!(plan_expert_bank(&cfg, &other), BankPath::OneByOne);
    }

    /// A tiered 48B layer (256 bf16 SwiGLU experts top-8, hidden 2304, width 1024).
    fn bank_48b(tokens: usize) -> BankCall {
        BankCall {
            tokens,
            top_k: 8,
            experts: 256,
            packed: None,
            table: Some(TableCall {
                tokens,
                top_k: 8,
                hidden: 2304,
                layout: Some(ExpertLayout {
                    inter: 1024,
                    dtype: DType::BF16,
                }),
                weights_aligned: true,
                input_aligned: true,
                recording: true,
            }),
        }
    }

    #[test]
    fn swiglu_banks_take_the_moe_steps_table_kernels() {
        let cfg = KernelConfig::default();
        // Decode: the fused GEMV, one launch per projection whatever the slots hold.
        assert_eq!(
            plan_expert_bank(&cfg, &bank_48b(1)),
            BankPath::Table(MoePath::FusedGemv {
                inter: 1024,
                dtype: DType::BF16
            })
        );
        // Many tokens: a grouped tensor-core GEMM (not CUTLASS while a pass records).
        assert_eq!(
            plan_expert_bank(&cfg, &bank_48b(4096)),
            BankPath::Table(MoePath::Grouped {
                inter: 1024,
                kernel: GroupedPath::Pipelined
            })
        );
        // Experts of mixed shapes (no layout) or another activation (no table call): one by
        // one.
        let mut mixed = bank_48b(1);
        if let Some(t) = mixed.table.as_mut() {
            t.layout = None;
        }
        assert_eq!(plan_expert_bank(&cfg, &mixed), BankPath::OneByOne);
        let situ = BankCall {
            table: None,
            ..bank_48b(1)
        };
        assert_eq!(plan_expert_bank(&cfg, &situ), BankPath::OneByOne);
    }
}
