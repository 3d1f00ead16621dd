//! The planner of `Backend::moe_experts`: which kernels run the routed experts of an
//! expert bank (Kimi K3's MXFP4 experts in the LatentMoE latent, or any other format).

use super::KernelConfig;

/// An MXFP4 bank the device kernels read: every expert's gate and up `[inter, width]` and
/// down `[width, inter]`, both widths whole 32-value blocks and the staged activation rows
/// within shared memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Mxfp4Bank {
    pub(crate) inter: usize,
    pub(crate) width: usize,
}

/// What [`plan_expert_bank`] decides from: one `moe_experts` call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct BankCall {
    pub(crate) tokens: usize,
    /// `None` where the bank is not one MXFP4 layout the kernels read.
    pub(crate) mxfp4: Option<Mxfp4Bank>,
}

/// How a `moe_experts` call runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum BankPath {
    /// `moe_mxfp4_gemv` over the pairs (each pass over an expert's rows serves 4 pairs).
    Mxfp4Gemv(Mxfp4Bank),
    /// `moe_mxfp4_grouped_mma`: tiles of 64 pairs on the tensor cores, weights widened to
    /// bf16 in shared memory.
    Mxfp4Grouped(Mxfp4Bank),
    /// Per expert with pairs: gather, the FFN, weighted scatter-add (one host read of the
    /// counts): any format and shape.
    OneByOne,
}

/// The path of one `moe_experts` call: GEMVs up to [`KernelConfig::mxfp4_gemv_max_tokens`]
/// tokens, the grouped GEMM above where both widths are multiples of its 64-wide tiles.
pub(crate) fn plan_expert_bank(cfg: &KernelConfig, call: &BankCall) -> BankPath {
    match call.mxfp4 {
        Some(b)
            if call.tokens > cfg.mxfp4_gemv_max_tokens
                && b.inter.is_multiple_of(64)
                && b.width.is_multiple_of(64) =>
        {
            BankPath::Mxfp4Grouped(b)
        }
        Some(b) => BankPath::Mxfp4Gemv(b),
        None => BankPath::OneByOne,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const K3: Mxfp4Bank = Mxfp4Bank {
        inter: 3072,
        width: 3584,
    };

    #[test]
    fn k3_banks_stream_at_decode_and_group_at_prefill() {
        let cfg = KernelConfig::default();
        let at = |tokens, mxfp4| plan_expert_bank(&cfg, &BankCall { tokens, mxfp4 });
        assert_eq!(at(1, Some(K3)), BankPath::Mxfp4Gemv(K3));
        assert_eq!(at(512, Some(K3)), BankPath::Mxfp4Gemv(K3));
        assert_eq!(at(513, Some(K3)), BankPath::Mxfp4Grouped(K3));
        // The tiny fixtures' latent of 32 never fits the 64-wide tiles.
        let tiny = Mxfp4Bank {
            inter: 64,
            width: 32,
        };
        assert_eq!(at(8192, Some(tiny)), BankPath::Mxfp4Gemv(tiny));
        assert_eq!(at(3, None), BankPath::OneByOne);
    }
}
