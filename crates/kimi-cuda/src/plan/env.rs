//! [`KernelConfig::from_env`]: the one reader of the `KIMI_CUDA_*` variables, which
//! measurement scripts set to compare kernels without rebuilding.

use super::{CutlassMinPairs, KdaChunkKernel, KernelConfig, MlaPrefillKernel, StreamShape};

/// A `KIMI_CUDA_*` variable whose value [`KernelConfig::from_env`] does not understand; the
/// configuration keeps that field's default.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{name}={value:?} is not understood (expected {expected}); keeping the default")]
pub struct EnvVarError {
    /// The variable.
    pub name: &'static str,
    /// Its value (lossily decoded when it is not Unicode).
    pub value: String,
    /// What it may be.
    pub expected: &'static str,
}

const MLA_PREFILL: &str = "KIMI_CUDA_MLA_PREFILL";
const KDA_CHUNK: &str = "KIMI_CUDA_KDA_CHUNK";
const MOE_LAYER: &str = "KIMI_CUDA_MOE_LAYER";
const MOE_GEMM: &str = "KIMI_CUDA_MOE_GEMM";
const FUSED_MOE_MAX_TOKENS: &str = "KIMI_CUDA_FUSED_MOE_MAX_TOKENS";
const STREAM_SHAPE: &str = "KIMI_CUDA_STREAM_SHAPE";
const GRAPHS: &str = "KIMI_CUDA_GRAPHS";
const PDL: &str = "KIMI_CUDA_PDL";
const POOL_RELEASE: &str = "KIMI_CUDA_POOL_RELEASE";
const GRAPH_ARENA_MB: &str = "KIMI_CUDA_GRAPH_ARENA_MB";
const MXFP4_TOKEN_TILES: &str = "KIMI_CUDA_MXFP4_TOKEN_TILES";
const PIN_HOST_EXPERTS: &str = "KIMI_CUDA_PIN_HOST_EXPERTS";
const MXFP4_DEVICE_FILLS: &str = "KIMI_CUDA_MXFP4_DEVICE_FILLS";
const PACKED_DEVICE_FILLS: &str = "KIMI_CUDA_PACKED_DEVICE_FILLS";
const PACKED_QUANT: &str = "KIMI_CUDA_PACKED_QUANT";
const INT4_LAYER: &str = "KIMI_CUDA_INT4_LAYER";
const INT4_GEMV: &str = "KIMI_CUDA_INT4_GEMV";

/// Every variable [`KernelConfig::from_env`] reads.
const VARS: [&str; 17] = [
    MLA_PREFILL,
    KDA_CHUNK,
    MOE_LAYER,
    MOE_GEMM,
    FUSED_MOE_MAX_TOKENS,
    STREAM_SHAPE,
    GRAPHS,
    PDL,
    POOL_RELEASE,
    GRAPH_ARENA_MB,
    MXFP4_TOKEN_TILES,
    PIN_HOST_EXPERTS,
    MXFP4_DEVICE_FILLS,
    PACKED_DEVICE_FILLS,
    PACKED_QUANT,
    INT4_LAYER,
    INT4_GEMV,
];

impl KernelConfig {
    /// The defaults with the `KIMI_CUDA_*` variables of the process environment applied (see
    /// [`Self::from_vars`]); a value it does not understand is logged as a warning naming the
    /// variable, and that field keeps its default.
    pub fn from_env() -> Self {
        let mut vars = Vec::new();
        let mut errors = Vec::new();
        for name in VARS {
            match std::env::var(name) {
                Ok(value) => vars.push((name, value)),
                Err(std::env::VarError::NotPresent) => {}
                Err(std::env::VarError::NotUnicode(value)) => errors.push(EnvVarError {
                    name,
                    value: value.to_string_lossy().into_owned(),
                    expected: "a Unicode value",
                }),
            }
        }
        let (config, parse_errors) =
            Self::from_vars(vars.iter().map(|(name, value)| (*name, value.as_str())));
        for e in errors.iter().chain(&parse_errors) {
            tracing::warn!("{e}");
        }
        config
    }

    /// The defaults with `vars` applied, `(name, value)` in order, and the values that were
    /// not understood. Names other than the `KIMI_CUDA_*` variables below are ignored, and
    /// so are empty values.
    ///
    /// | variable | values |
    /// |---|---|
    /// | `KIMI_CUDA_MLA_PREFILL` | `f32`: [`MlaPrefillKernel::F32`]; `auto` |
    /// | `KIMI_CUDA_KDA_CHUNK` | `f32`: [`KdaChunkKernel::F32`]; `mma-prep`: [`KdaChunkKernel::MmaPairPrep`]; `auto` |
    /// | `KIMI_CUDA_MOE_LAYER` | `0`: no `moe_stream_layer`; `1` |
    /// | `KIMI_CUDA_MOE_GEMM` | `cutlass` / `mma`: the automatic grouped GEMM is always / never CUTLASS's; `auto` |
    /// | `KIMI_CUDA_FUSED_MOE_MAX_TOKENS` | tokens |
    /// | `KIMI_CUDA_STREAM_SHAPE` | `TILE_KIB,CTA_KIB` (0 keeps one) |
    /// | `KIMI_CUDA_GRAPHS` | `1`: CUDA graphs on; `0` |
    /// | `KIMI_CUDA_PDL` | `0`: programmatic dependent launch off; `1` |
    /// | `KIMI_CUDA_POOL_RELEASE` | `1`: freed memory goes back to the driver; `0` |
    /// | `KIMI_CUDA_GRAPH_ARENA_MB` | MiB |
    /// | `KIMI_CUDA_MXFP4_TOKEN_TILES` | `1`, `2` or `4`; `auto` |
    /// | `KIMI_CUDA_PIN_HOST_EXPERTS` | `0`: expert slots fill from pageable memory; `1` |
    /// | `KIMI_CUDA_MXFP4_DEVICE_FILLS` | `1`: MXFP4 slot fills laid out on the GPU; `0` |
    /// | `KIMI_CUDA_PACKED_DEVICE_FILLS` | `1`: packed integer/FP8/ggml slot fills laid out on the GPU; `0` |
    /// | `KIMI_CUDA_PACKED_QUANT` | `0`: integer/FP8/ggml weights widened to bf16 at load; `1` |
    /// | `KIMI_CUDA_INT4_LAYER` | `1`: one-token 4-bit expert layers in one streamed launch; `0` |
    /// | `KIMI_CUDA_INT4_GEMV` | `1`: one-token 4-bit products streamed by persistent CTAs; `0` |
    pub fn from_vars<'a>(
        vars: impl IntoIterator<Item = (&'a str, &'a str)>,
    ) -> (Self, Vec<EnvVarError>) {
        let mut config = Self::default();
        let mut errors = Vec::new();
        for (name, value) in vars {
            if value.is_empty() {
                continue;
            }
            if let Err(e) = config.apply_var(name, value) {
                errors.push(e);
            }
        }
        (config, errors)
    }

    /// Applies one variable (a name not in [`VARS`] changes nothing).
    fn apply_var(&mut self, name: &str, value: &str) -> Result<(), EnvVarError> {
        let Some(&name) = VARS.iter().find(|v| **v == name) else {
            return Ok(());
        };
        let invalid = |expected| EnvVarError {
            name,
            value: value.to_owned(),
            expected,
        };
        match name {
            MLA_PREFILL => {
                self.mla_prefill = match value {
                    "f32" => MlaPrefillKernel::F32,
                    "auto" => MlaPrefillKernel::Auto,
                    _ => return Err(invalid("`f32` or `auto`")),
                }
            }
            KDA_CHUNK => {
                self.kda_chunk = match value {
                    "f32" => KdaChunkKernel::F32,
                    "mma-prep" => KdaChunkKernel::MmaPairPrep,
                    "auto" => KdaChunkKernel::Auto,
                    _ => return Err(invalid("`f32`, `mma-prep` or `auto`")),
                }
            }
            MOE_LAYER => self.moe_layer = flag(value).ok_or_else(|| invalid("`0` or `1`"))?,
            MOE_GEMM => {
                // Moves the automatic choice's threshold, so that an explicit
                // `grouped_moe` still wins.
                self.cutlass_min_pairs = match value {
                    "cutlass" => CutlassMinPairs { half: 0, split: 0 },
                    "mma" => CutlassMinPairs {
                        half: usize::MAX,
                        split: usize::MAX,
                    },
                    "auto" => CutlassMinPairs::default(),
                    _ => return Err(invalid("`cutlass`, `mma` or `auto`")),
                }
            }
            FUSED_MOE_MAX_TOKENS => {
                self.fused_moe_max_tokens =
                    value.parse().map_err(|_| invalid("a number of tokens"))?
            }
            STREAM_SHAPE => {
                let shape = stream_shape(value, self.stream_shape)
                    .ok_or_else(|| invalid("`TILE_KIB,CTA_KIB`, e.g. `40,200`"))?;
                self.stream_shape = shape;
            }
            GRAPHS => self.cuda_graphs = flag(value).ok_or_else(|| invalid("`0` or `1`"))?,
            PDL => self.pdl = flag(value).ok_or_else(|| invalid("`0` or `1`"))?,
            PIN_HOST_EXPERTS => {
                self.pin_host_experts = flag(value).ok_or_else(|| invalid("`0` or `1`"))?
            }
            MXFP4_DEVICE_FILLS => {
                self.mxfp4_device_fills = flag(value).ok_or_else(|| invalid("`0` or `1`"))?
            }
            PACKED_DEVICE_FILLS => {
                self.packed_device_fills = flag(value).ok_or_else(|| invalid("`0` or `1`"))?
            }
            PACKED_QUANT => {
                self.packed_quant_weights = flag(value).ok_or_else(|| invalid("`0` or `1`"))?
            }
            INT4_LAYER => {
                self.int4_stream_layer = flag(value).ok_or_else(|| invalid("`0` or `1`"))?
            }
            INT4_GEMV => {
                self.int4_stream_gemv = flag(value).ok_or_else(|| invalid("`0` or `1`"))?
            }
            POOL_RELEASE => {
                self.pool_keeps_memory = !flag(value).ok_or_else(|| invalid("`0` or `1`"))?
            }
            GRAPH_ARENA_MB => {
                self.graph_arena_mb = value
                    .parse::<usize>()
                    .ok()
                    .filter(|mb| mb.checked_mul(1 << 20).is_some())
                    .ok_or_else(|| invalid("a size in MiB"))?
            }
            MXFP4_TOKEN_TILES => {
                self.mxfp4_token_tiles = match value {
                    "1" => Some(1),
                    "2" => Some(2),
                    "4" => Some(4),
                    "auto" => None,
                    _ => return Err(invalid("`1`, `2`, `4` or `auto`")),
                }
            }
            _ => {}
        }
        Ok(())
    }
}

fn flag(value: &str) -> Option<bool> {
    match value {
        "0" => Some(false),
        "1" => Some(true),
        _ => None,
    }
}

/// `TILE_KIB,CTA_KIB` over `current` (a 0 keeps that part).
fn stream_shape(value: &str, current: StreamShape) -> Option<StreamShape> {
    let kib = |s: &str| {
        s.trim()
            .parse::<usize>()
            .ok()
            .and_then(|k| k.checked_mul(1024))
    };
    let (tile, cta) = value.split_once(',')?;
    let (tile, cta) = (kib(tile)?, kib(cta)?);
    let keep = |new: usize, old: usize| if new > 0 { new } else { old };
    Some(StreamShape {
        tile_bytes: keep(tile, current.tile_bytes),
        cta_bytes: keep(cta, current.cta_bytes),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::GroupedMoeKernel;

    fn parse(vars: &[(&str, &str)]) -> (KernelConfig, Vec<EnvVarError>) {
        KernelConfig::from_vars(vars.iter().copied())
    }

    #[test]
    fn no_variables_give_the_defaults() {
        let (config, errors) = parse(&[("PATH", "/bin"), ("KIMI_CUDA_OTHER", "1")]);
        assert_eq!(config, KernelConfig::default());
        assert!(errors.is_empty());
        // Empty values count as unset.
        let (config, errors) = parse(&[(GRAPHS, ""), (PDL, "")]);
        assert_eq!(config, KernelConfig::default());
        assert!(errors.is_empty());
    }

    #[test]
    fn every_variable_sets_its_field() {
        let (config, errors) = parse(&[
            (MLA_PREFILL, "f32"),
            (KDA_CHUNK, "mma-prep"),
            (MOE_LAYER, "0"),
            (MOE_GEMM, "cutlass"),
            (FUSED_MOE_MAX_TOKENS, "64"),
            (STREAM_SHAPE, "20, 128"),
            (GRAPHS, "1"),
            (PDL, "0"),
            (POOL_RELEASE, "1"),
            (GRAPH_ARENA_MB, "1024"),
        ]);
        assert!(errors.is_empty(), "{errors:?}");
        let want = KernelConfig {
            mla_prefill: MlaPrefillKernel::F32,
            kda_chunk: KdaChunkKernel::MmaPairPrep,
            moe_layer: false,
            cutlass_min_pairs: CutlassMinPairs { half: 0, split: 0 },
            fused_moe_max_tokens: 64,
            stream_shape: StreamShape {
                tile_bytes: 20 << 10,
                cta_bytes: 128 << 10,
            },
            cuda_graphs: true,
            pdl: false,
            pool_keeps_memory: false,
            graph_arena_mb: 1024,
            ..KernelConfig::default()
        };
        assert_eq!(config, want);
        // The explicit kernel choice stays automatic: the variable moved its threshold.
        assert_eq!(config.grouped_moe, GroupedMoeKernel::Auto);
    }

    #[test]
    fn the_other_spellings() {
        let (config, errors) = parse(&[
            (KDA_CHUNK, "f32"),
            (MOE_GEMM, "mma"),
            (STREAM_SHAPE, "0,160"),
            (MOE_LAYER, "1"),
            (POOL_RELEASE, "0"),
            (PACKED_QUANT, "0"),
            (INT4_LAYER, "0"),
            (INT4_GEMV, "0"),
        ]);
        assert!(errors.is_empty(), "{errors:?}");
        assert!(!config.packed_quant_weights && !config.int4_stream_layer);
        assert!(!config.int4_stream_gemv);
        assert_eq!(config.kda_chunk, KdaChunkKernel::F32);
        assert_eq!(config.cutlass_min_pairs.split, usize::MAX);
        assert_eq!(config.stream_shape.tile_bytes, 40 << 10);
        assert_eq!(config.stream_shape.cta_bytes, 160 << 10);
        assert!(config.moe_layer && config.pool_keeps_memory);
        // A later value of a variable wins.
        let (config, _) = parse(&[(KDA_CHUNK, "f32"), (KDA_CHUNK, "auto")]);
        assert_eq!(config.kda_chunk, KdaChunkKernel::Auto);
    }

    #[test]
    fn values_not_understood_keep_the_default_and_name_the_variable() {
        let (config, errors) = parse(&[
            (MLA_PREFILL, "fp32"),
            (FUSED_MOE_MAX_TOKENS, "-1"),
            (STREAM_SHAPE, "40"),
            (GRAPHS, "yes"),
            (GRAPH_ARENA_MB, "99999999999999999999"),
            (PDL, "0"),
        ]);
        let named: Vec<&str> = errors.iter().map(|e| e.name).collect();
        assert_eq!(
            named,
            [
                MLA_PREFILL,
                FUSED_MOE_MAX_TOKENS,
                STREAM_SHAPE,
                GRAPHS,
                GRAPH_ARENA_MB
            ]
        );
        let want = KernelConfig {
            pdl: false,
            ..KernelConfig::default()
        };
        assert_eq!(config, want);
        let message = errors[0].to_string();
        assert!(
            message.contains("KIMI_CUDA_MLA_PREFILL") && message.contains("fp32"),
            "{message}"
        );
    }
}
