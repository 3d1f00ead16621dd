//! Which GGML type each tensor gets, following llama.cpp:
//!
//! * f32 / f16 / bf16 / q8_0: `convert_hf_to_gguf.py` `ModelBase.prepare_tensors` — 1-D
//!   tensors, `*_norm.weight`, the router (`ffn_gate_inp`), the KDA convolutions
//!   (`ssm_conv1d_{q,k,v}`: llama.cpp's `ggml_ssm_conv` asserts F32 kernels and aborts on
//!   F16 ones) and every tensor whose name does not end in `.weight` (`ssm_a`, `ssm_dt.bias`,
//!   `exp_probs_b.bias`) stay F32; the rest take the output type, falling back to F16 when a
//!   row is not whole Q8_0 blocks (gguf-py's `QuantError` path).
//! * q4_k_m: `llama-quantize` (`src/llama-quant.cpp`) on top of the f16 file: a tensor is
//!   requantized only if its name ends in `weight`, it has ≥ 2 non-unit dimensions and it is
//!   not a norm, the router or an `ssm_conv1d*` kernel. Default Q4_K; `output.weight` (and a
//!   tied `token_embd`) Q6_K, or Q8_0 when rows are not whole 256-blocks; `attn_v` (KDA value
//!   projections, counted in layer order) Q6_K where `use_more_bits`; every `ffn_down*` of a
//!   layer where `use_more_bits(layer, n_layer)` Q6_K; the 8-expert bumps are kept for
//!   completeness. Rows that are not whole blocks fall back Q4_K→Q5_0, Q5_K→Q5_1,
//!   Q6_K→Q8_0, then F16 (llama.cpp aborts instead in the last case for a Q8_0 target).

use kimi_gguf::{GgmlType, QK_K};

use super::recipes::Recipe;

/// The file type of a converted GGUF (`general.file_type`, llama.cpp's `llama_ftype`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GgufQuant {
    /// Everything f32 (`ALL_F32`).
    F32,
    /// Matrices f16 (`MOSTLY_F16`).
    F16,
    /// Matrices bf16 (`MOSTLY_BF16`).
    Bf16,
    /// Matrices Q8_0 (`MOSTLY_Q8_0`).
    Q8_0,
    /// llama.cpp's Q4_K_M mixture (`MOSTLY_Q4_K_M`).
    Q4KM,
}

impl GgufQuant {
    /// `general.file_type`.
    pub fn file_type(self) -> u32 {
        match self {
            GgufQuant::F32 => 0,
            GgufQuant::F16 => 1,
            GgufQuant::Q8_0 => 7,
            GgufQuant::Q4KM => 15,
            GgufQuant::Bf16 => 32,
        }
    }
}

/// A type chosen for a tensor, with a note when a fallback changed it.
pub(crate) struct Choice {
    pub ggml_type: GgmlType,
    pub fallback: Option<String>,
}

/// Types for `recipes` (in file order) of a model with `num_layers` layers and
/// `num_experts` routed experts.
pub(crate) fn plan(
    recipes: &[Recipe],
    quant: GgufQuant,
    num_layers: usize,
    num_experts: usize,
) -> Vec<Choice> {
    let tied = !recipes.iter().any(|r| r.gguf == "output.weight");
    // llama-quantize walks tensors by layer, then by name (`weight_name_comparer`).
    let mut order: Vec<usize> = (0..recipes.len()).collect();
    order.sort_by_key(|&i| {
        (
            recipes[i].layer().map_or(-1, |l| l as i64),
            recipes[i].gguf.clone(),
        )
    });
    let num_attn_v = recipes.iter().filter(|r| is_attn_v(&r.gguf)).count();
    let (mut i_attn_v, mut i_ffn_down) = (0, 0);
    let mut out: Vec<Option<Choice>> = (0..recipes.len()).map(|_| None).collect();
    for i in order {
        let r = &recipes[i];
        let base = convert_type(r, quant);
        let choice = if r.mxfp4 {
            // K3's experts keep the checkpoint's MXFP4 codes, as llama.cpp stores them.
            Choice {
                ggml_type: GgmlType::MXFP4,
                fallback: None,
            }
        } else if quant == GgufQuant::Q4KM && requantizable(r) {
            let ctx = Mixture {
                tied,
                num_layers,
                num_experts,
                num_attn_v,
            };
            let wanted = ctx.pick(r, &mut i_attn_v, &mut i_ffn_down);
            fallback(r, wanted)
        } else {
            base
        };
        out[i] = Some(choice);
    }
    out.into_iter()
        .map(|c| {
            c.unwrap_or(Choice {
                ggml_type: GgmlType::F32,
                fallback: None,
            })
        })
        .collect()
}

/// The type `convert_hf_to_gguf.py` writes (for q4_k_m: the f16 file llama-quantize reads).
fn convert_type(r: &Recipe, quant: GgufQuant) -> Choice {
    let keep_f32 = r.shape.len() <= 1
        || r.gguf.ends_with("_norm.weight")
        || r.gguf.ends_with("ffn_gate_inp.weight")
        || r.gguf.contains("ssm_conv1d")
        || !r.gguf.ends_with(".weight");
    let wanted = match quant {
        _ if keep_f32 => GgmlType::F32,
        GgufQuant::F32 => GgmlType::F32,
        GgufQuant::Bf16 => GgmlType::BF16,
        GgufQuant::F16 | GgufQuant::Q4KM => GgmlType::F16,
        GgufQuant::Q8_0 => GgmlType::Q8_0,
    };
    if cols(r).is_multiple_of(wanted.block_size()) {
        return Choice {
            ggml_type: wanted,
            fallback: None,
        };
    }
    Choice {
        ggml_type: GgmlType::F16,
        fallback: Some(format!(
            "{wanted} needs rows of whole {}-blocks, row length {} → F16",
            wanted.block_size(),
            cols(r)
        )),
    }
}

fn cols(r: &Recipe) -> usize {
    r.shape.last().copied().unwrap_or(1)
}

/// `tensor_allows_quantization` of llama-quant.cpp for Kimi Linear's tensor names.
fn requantizable(r: &Recipe) -> bool {
    let dims = r.shape.iter().skip_while(|&&d| d == 1).count();
    r.gguf.ends_with("weight")
        && dims >= 2
        && !r.gguf.contains("_norm.weight")
        && !r.gguf.contains("ffn_gate_inp.weight")
        && !r.gguf.contains("ssm_conv1d")
}

fn is_attn_v(name: &str) -> bool {
    name.contains("attn_v.weight")
}

struct Mixture {
    tied: bool,
    num_layers: usize,
    num_experts: usize,
    num_attn_v: usize,
}

fn use_more_bits(i: usize, n: usize) -> bool {
    i < n / 8 || i >= 7 * n / 8 || (i as i64 - (n / 8) as i64).rem_euclid(3) == 2
}

impl Mixture {
    /// `llama_tensor_get_type_impl` for `LLAMA_FTYPE_MOSTLY_Q4_K_M`.
    fn pick(&self, r: &Recipe, i_attn_v: &mut usize, i_ffn_down: &mut usize) -> GgmlType {
        let name = r.gguf.as_str();
        let is_output = name == "output.weight" || (self.tied && name == "token_embd.weight");
        if is_output {
            return if !cols(r).is_multiple_of(QK_K) {
                GgmlType::Q8_0
            } else {
                GgmlType::Q6_K
            };
        }
        if name == "token_embd.weight" {
            return GgmlType::Q4_K;
        }
        if is_attn_v(name) {
            let mut t = GgmlType::Q4_K;
            if use_more_bits(*i_attn_v, self.num_attn_v) {
                t = GgmlType::Q6_K;
            }
            if self.num_experts == 8 {
                t = GgmlType::Q8_0;
            }
            *i_attn_v += 1;
            return t;
        }
        if name.contains("attn_k.weight") && self.num_experts == 8 {
            return GgmlType::Q8_0;
        }
        if name.contains("ffn_down") {
            // With experts llama.cpp reads the layer from the name, else it counts tensors.
            let layer = if self.num_experts > 1 {
                r.layer().unwrap_or(0)
            } else {
                *i_ffn_down
            };
            *i_ffn_down += 1;
            return if use_more_bits(layer, self.num_layers) {
                GgmlType::Q6_K
            } else {
                GgmlType::Q4_K
            };
        }
        if name.contains("attn_output.weight") && self.num_experts == 8 {
            return GgmlType::Q5_K;
        }
        GgmlType::Q4_K
    }
}

/// `tensor_type_fallback`: a type whose blocks divide the rows.
fn fallback(r: &Recipe, wanted: GgmlType) -> Choice {
    let n = cols(r);
    if n.is_multiple_of(wanted.block_size()) {
        return Choice {
            ggml_type: wanted,
            fallback: None,
        };
    }
    let second = match wanted {
        GgmlType::Q4_K => GgmlType::Q5_0,
        GgmlType::Q5_K => GgmlType::Q5_1,
        GgmlType::Q6_K => GgmlType::Q8_0,
        _ => GgmlType::F16,
    };
    let ggml_type = if n.is_multiple_of(second.block_size()) {
        second
    } else {
        GgmlType::F16
    };
    Choice {
        ggml_type,
        fallback: Some(format!(
            "{wanted} needs rows of whole {}-blocks, row length {n} → {ggml_type}",
            wanted.block_size()
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn use_more_bits_matches_llama_cpp() {
        // 27 layers (Kimi-Linear-48B): first 3, last 4, and every third in between.
        let picked: Vec<usize> = (0..27).filter(|&i| use_more_bits(i, 27)).collect();
        assert_eq!(picked, [0, 1, 2, 5, 8, 11, 14, 17, 20, 23, 24, 25, 26]);
    }

    /// llama.cpp's `ggml_ssm_conv` aborts (`GGML_ASSERT(src1->nb[0] == sizeof(float))`) on a
    /// KDA convolution that is not F32, so every file type keeps them F32, as
    /// `convert_hf_to_gguf.py` does; matrices still take the file type.
    #[test]
    fn kda_convolutions_stay_f32_in_every_file_type() {
        let config = kimi_core::ModelConfig::from_json_str(include_str!(
            "../../../kimi-core/tests/data/kimi-linear-48b-a3b-instruct.config.json"
        ))
        .expect("48B config");
        let recipes = super::super::recipes::recipes(&config);
        let convs = recipes
            .iter()
            .filter(|r| r.gguf.contains("ssm_conv1d"))
            .count();
        assert_eq!(convs, 3 * 20, "q, k and v kernels of the 20 KDA layers");
        for quant in [
            GgufQuant::F32,
            GgufQuant::F16,
            GgufQuant::Bf16,
            GgufQuant::Q8_0,
            GgufQuant::Q4KM,
        ] {
            let choices = plan(&recipes, quant, config.layers.len(), 256);
            for (r, c) in recipes.iter().zip(&choices) {
                if r.gguf.contains("ssm_conv1d") {
                    assert_eq!(c.ggml_type, GgmlType::F32, "{quant:?} {}", r.gguf);
                    assert!(c.fallback.is_none(), "{quant:?} {}", r.gguf);
                }
                if r.gguf == "blk.0.attn_q.weight" && quant != GgufQuant::F32 {
                    assert_ne!(c.ggml_type, GgmlType::F32, "{quant:?}");
                }
            }
        }
    }
}
