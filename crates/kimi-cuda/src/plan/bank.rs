//! The planner of `Backend::moe_experts`: which kernels run the routed experts of an
//! expert bank (Kimi K3's MXFP4 experts in the LatentMoE latent, or any other format).

use super::KernelConfig;

/// An MXFP4 bank the device kernels read: every expert's gate and up `[inter, width]` and
/// down `[width, inter]`, both widths whole 32-value blocks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Mxfp4Bank {
    pub(crate) inter: usize,
    pub(crate) width: usize,
}

/// What [`plan_expert_bank`] decides from: one `moe_experts` call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct BankCall {
    pub(crate) tokens: usize,
    pub(crate) top_k: usize,
    pub(crate) experts: usize,
    /// `None` where the bank is not one MXFP4 layout the kernels read.
    pub(crate) mxfp4: Option<Mxfp4Bank>,
}

/// How a `moe_experts` call runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum BankPath {
    /// `moe_mxfp4_mma_*`: every pair on the tensor cores, the weights widened in registers,
    /// `token_tiles` groups of 8 pairs per pass over an expert's weights.
    Mxfp4Mma { bank: Mxfp4Bank, token_tiles: usize },
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
    let Some(bank) = call.mxfp4 else {
        return BankPath::OneByOne;
    };
    let pairs = call.tokens * call.top_k;
    let per_expert = pairs.div_ceil(call.experts.min(pairs).max(1));
    let token_tiles = cfg.mxfp4_token_tiles.unwrap_or(match per_expert {
        0..=8 => 1,
        9..=16 => 2,
        _ => 4,
    });
    BankPath::Mxfp4Mma { bank, token_tiles }
}

#[cfg(test)]
mod tests {
    use super::*;

    const K3: Mxfp4Bank = Mxfp4Bank {
        inter: 3072,
        width: 3584,
    };

    fn tiles_at(cfg: &KernelConfig, tokens: usize) -> usize {
        let call = BankCall {
            tokens,
            top_k: 16,
            experts: 896,
            mxfp4: Some(K3),
        };
        match plan_expert_bank(cfg, &call) {
            BankPath::Mxfp4Mma { bank, token_tiles } => {
                assert_eq!(bank, K3);
                token_tiles
            }
            BankPath::OneByOne => panic!("K3's bank runs on the MXFP4 kernels"),
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
            mxfp4: None,
        };
        assert_eq!(plan_expert_bank(&cfg, &other), BankPath::OneByOne);
    }
}
