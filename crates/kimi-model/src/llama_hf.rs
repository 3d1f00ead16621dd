//! Llama-architecture models as Hugging Face checkpoints (`LlamaForCausalLM`: config.json and
//! safetensors, float or quantized by a tool, as `save_pretrained` writes them), run by the
//! definition of llama GGUF files ([`crate::Llama`]): the config becomes a [`LlamaConfig`]
//! with `rotate_half` RoPE, and the model reads the tensors under their GGUF names through
//! [`hf_name`]. `kimi-infer convert --to safetensors` writes such a checkpoint from a llama
//! GGUF ([`unpermute_rows`] undoes the Q/K row order llama.cpp's converter gave it).

use std::borrow::Cow;
use std::collections::HashSet;
use std::path::{Path, PathBuf};

use kimi_core::DType;
use kimi_ops::RopeStyle;
use kimi_weights::SafetensorsDir;
use serde_json::Value;

use crate::quantized::{QuantReader, QuantScheme};
use crate::source::WeightSource;
use crate::{LlamaConfig, ModelError, Result};

/// GGUF names of a decoder layer's tensors (after `blk.{i}.`) and their Hugging Face names
/// (after `model.layers.{i}.`).
pub const LAYER_NAMES: [(&str, &str); 9] = [
    ("attn_norm.weight", "input_layernorm.weight"),
    ("attn_q.weight", "self_attn.q_proj.weight"),
    ("attn_k.weight", "self_attn.k_proj.weight"),
    ("attn_v.weight", "self_attn.v_proj.weight"),
    ("attn_output.weight", "self_attn.o_proj.weight"),
    ("ffn_norm.weight", "post_attention_layernorm.weight"),
    ("ffn_gate.weight", "mlp.gate_proj.weight"),
    ("ffn_up.weight", "mlp.up_proj.weight"),
    ("ffn_down.weight", "mlp.down_proj.weight"),
];

/// GGUF and Hugging Face names of the tensors outside the layers.
pub const GLOBAL_NAMES: [(&str, &str); 3] = [
    ("token_embd.weight", "model.embed_tokens.weight"),
    ("output_norm.weight", "model.norm.weight"),
    ("output.weight", "lm_head.weight"),
];

/// The Hugging Face name of a llama GGUF tensor name.
pub fn hf_name(gguf: &str) -> Option<String> {
    if let Some((_, hf)) = GLOBAL_NAMES.iter().find(|(g, _)| *g == gguf) {
        return Some(hf.to_string());
    }
    let rest = gguf.strip_prefix("blk.")?;
    let (layer, rest) = rest.split_once('.')?;
    let layer: usize = layer.parse().ok()?;
    let (_, hf) = LAYER_NAMES.iter().find(|(g, _)| *g == rest)?;
    Some(format!("model.layers.{layer}.{hf}"))
}

/// The llama GGUF name of a Hugging Face tensor name.
pub fn gguf_name(hf: &str) -> Option<String> {
    if let Some((g, _)) = GLOBAL_NAMES.iter().find(|(_, h)| *h == hf) {
        return Some(g.to_string());
    }
    let rest = hf.strip_prefix("model.layers.")?;
    let (layer, rest) = rest.split_once('.')?;
    let layer: usize = layer.parse().ok()?;
    let (g, _) = LAYER_NAMES.iter().find(|(_, h)| *h == rest)?;
    Some(format!("blk.{layer}.{g}"))
}

/// Whether a decoded config.json describes a llama-architecture model.
pub fn is_llama_config(json: &Value) -> bool {
    json.get("model_type").and_then(Value::as_str) == Some("llama")
}

/// The rows of a `[heads · head_dim, cols]` Q or K matrix of a llama GGUF file in Hugging
/// Face's order: llama.cpp's converter stores each head's rows as interleaved pairs
/// `(0, D/2), (1, D/2+1), …` so that ggml's adjacent-pair RoPE rotates them; `rotate_half`
/// wants the two halves apart. `row_bytes` is the size of one row.
pub fn unpermute_rows(bytes: &[u8], heads: usize, row_bytes: usize) -> Vec<u8> {
    let rows = bytes.len() / row_bytes.max(1);
    let head_dim = rows / heads.max(1);
    let half = head_dim / 2;
    let mut out = vec![0u8; bytes.len()];
    for h in 0..heads {
        for i in 0..half {
            for (pair, dst) in [(0, i), (1, half + i)] {
                let src = h * head_dim + 2 * i + pair;
                let dst = h * head_dim + dst;
                out[dst * row_bytes..(dst + 1) * row_bytes]
                    .copy_from_slice(&bytes[src * row_bytes..(src + 1) * row_bytes]);
            }
        }
    }
    out
}

impl LlamaConfig {
    /// Reads a `LlamaForCausalLM` config.json (`path` names it in errors). Fails on what the
    /// model does not implement: rope scaling, partial rotary, attention or MLP biases.
    pub fn from_hf_json(json: &Value, path: &Path) -> Result<Self> {
        let err = |reason: String| ModelError::Format {
            path: path.to_path_buf(),
            reason,
        };
        if !is_llama_config(json) {
            return Err(err("model_type is not `llama`".into()));
        }
        let count = |key: &str| -> Result<usize> {
            json.get(key)
                .and_then(Value::as_u64)
                .map(|v| v as usize)
                .ok_or_else(|| err(format!("`{key}` is missing or not a whole number")))
        };
        let optional = |key: &str, default: usize| -> Result<usize> {
            match json.get(key) {
                None | Some(Value::Null) => Ok(default),
                Some(_) => count(key),
            }
        };
        let float = |key: &str, default: f64| -> Result<f32> {
            match json.get(key) {
                None | Some(Value::Null) => Ok(default as f32),
                Some(v) => v
                    .as_f64()
                    .map(|v| v as f32)
                    .ok_or_else(|| err(format!("`{key}` is not a number"))),
            }
        };
        for key in ["attention_bias", "mlp_bias"] {
            if json.get(key).and_then(Value::as_bool) == Some(true) {
                return Err(err(format!("`{key}: true` is not supported")));
            }
        }
        if !matches!(json.get("rope_scaling"), None | Some(Value::Null)) {
            return Err(err("`rope_scaling` is not supported".into()));
        }
        let hidden_size = count("hidden_size")?;
        let num_heads = count("num_attention_heads")?;
        if num_heads == 0 {
            return Err(err("`num_attention_heads` is 0".into()));
        }
        let num_kv_heads = optional("num_key_value_heads", num_heads)?;
        let head_dim = optional("head_dim", hidden_size / num_heads)?;
        crate::llama::check_heads(&err, num_heads, num_kv_heads, head_dim, [head_dim; 2])?;
        let eos_token_ids = match json.get("eos_token_id") {
            Some(Value::Number(n)) => n.as_u64().map(|v| vec![v as u32]).unwrap_or_default(),
            Some(Value::Array(a)) => a
                .iter()
                .filter_map(|v| v.as_u64())
                .map(|v| v as u32)
                .collect(),
            _ => Vec::new(),
        };
        let config = Self {
            vocab_size: count("vocab_size")?,
            hidden_size,
            intermediate_size: count("intermediate_size")?,
            num_layers: count("num_hidden_layers")?,
            num_heads,
            num_kv_heads,
            head_dim,
            rope_theta: float("rope_theta", 10_000.0)?,
            rope_style: RopeStyle::HalfSplit,
            rms_norm_eps: float("rms_norm_eps", 1e-6)?,
            max_context: optional("max_position_embeddings", 2048)?,
            tie_word_embeddings: json
                .get("tie_word_embeddings")
                .and_then(Value::as_bool)
                .unwrap_or(false),
            eos_token_ids,
        };
        config.validate(&err, &|key| hf_key(key).to_string())?;
        Ok(config)
    }
}

/// The config.json field of a `llama.*` GGUF metadata key.
fn hf_key(gguf: &str) -> &str {
    match gguf {
        "rope.freq_base" => "rope_theta",
        "attention.layer_norm_rms_epsilon" => "rms_norm_eps",
        "embedding_length" => "hidden_size",
        "feed_forward_length" => "intermediate_size",
        "block_count" => "num_hidden_layers",
        "context_length" => "max_position_embeddings",
        "attention.key_length" => "head_dim",
        other => other,
    }
}

/// A llama Hugging Face checkpoint's tensors under their GGUF names, float or quantized
/// (the formats of [`QuantScheme`]).
pub struct HfLlamaSource<'a> {
    files: &'a SafetensorsDir,
    quant: QuantReader,
}

impl<'a> HfLlamaSource<'a> {
    /// The tensors of `files`, whose config.json (`config_path`) is `json`.
    pub fn new(files: &'a SafetensorsDir, json: &Value, config_path: &Path) -> Result<Self> {
        Ok(Self {
            files,
            quant: QuantReader::new(QuantScheme::from_config(json, config_path)?),
        })
    }

    fn stored(name: &str) -> String {
        hf_name(name).unwrap_or_else(|| name.to_string())
    }

    fn quantized(&self, stored: &str) -> Option<&QuantScheme> {
        self.quant.holding(self.files, stored)
    }
}

impl WeightSource for HfLlamaSource<'_> {
    fn contains(&self, name: &str) -> bool {
        let stored = Self::stored(name);
        self.files.contains(&stored) || self.quantized(&stored).is_some()
    }

    fn load(&self, name: &str, shape: &[usize]) -> Result<(DType, Cow<'_, [u8]>)> {
        let stored = Self::stored(name);
        if let Some(q) = self.quantized(&stored) {
            let (dtype, bytes) = self.quant.decode(q, self.files, &stored, shape)?;
            return Ok((dtype, Cow::Owned(bytes)));
        }
        let view = self.files.get_shaped(&stored, shape)?;
        Ok((view.dtype, Cow::Borrowed(view.bytes)))
    }

    fn check_all_used(&self, used: &HashSet<String>) -> Result<()> {
        let stored = self
            .quant
            .with_parts(used.iter().map(|n| Self::stored(n)).collect());
        Ok(self.files.check_all_used(&stored)?)
    }

    fn shape(&self, name: &str) -> Option<Vec<usize>> {
        let stored = Self::stored(name);
        match self.quantized(&stored) {
            Some(q) => q.shape(self.files, &stored),
            None => self.files.shape(&stored).map(<[usize]>::to_vec),
        }
    }
}

/// config.json of `dir`, decoded, with its path.
pub fn read_config_json(dir: &Path) -> Result<(Value, PathBuf)> {
    let path = dir.join("config.json");
    let text = std::fs::read_to_string(&path).map_err(|e| ModelError::Format {
        path: path.clone(),
        reason: format!("cannot read it: {e}"),
    })?;
    let json = serde_json::from_str(&text).map_err(|e| ModelError::Format {
        path: path.clone(),
        reason: format!("not valid JSON: {e}"),
    })?;
    Ok((json, path))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_map_both_ways() {
        for (g, h) in [
            (
                "blk.3.attn_q.weight",
                "model.layers.3.self_attn.q_proj.weight",
            ),
            (
                "blk.11.ffn_down.weight",
                "model.layers.11.mlp.down_proj.weight",
            ),
            ("token_embd.weight", "model.embed_tokens.weight"),
            ("output.weight", "lm_head.weight"),
        ] {
            assert_eq!(hf_name(g).as_deref(), Some(h));
            assert_eq!(gguf_name(h).as_deref(), Some(g));
        }
        assert_eq!(hf_name("blk.x.attn_q.weight"), None);
        assert_eq!(
            gguf_name("model.layers.0.self_attn.rotary_emb.inv_freq"),
            None
        );
    }

    #[test]
    fn configs_name_what_they_cannot_run() {
        let base = serde_json::json!({
            "model_type": "llama", "vocab_size": 64, "hidden_size": 16, "intermediate_size": 32,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": true,
            "eos_token_id": [2, 3],
        });
        let path = Path::new("config.json");
        let c = LlamaConfig::from_hf_json(&base, path).unwrap();
        assert_eq!(
            (c.head_dim, c.rope_style, c.eos_token_ids.clone()),
            (4, RopeStyle::HalfSplit, vec![2, 3])
        );
        for (key, value, says) in [
            (
                "rope_scaling",
                serde_json::json!({"rope_type": "llama3"}),
                "rope_scaling",
            ),
            ("attention_bias", serde_json::json!(true), "attention_bias"),
            ("num_key_value_heads", serde_json::json!(3), "cannot share"),
            ("rms_norm_eps", serde_json::json!(-1.0), "rms_norm_eps"),
            ("hidden_size", serde_json::json!("wide"), "hidden_size"),
        ] {
            let mut bad = base.clone();
            bad[key] = value;
            let err = LlamaConfig::from_hf_json(&bad, path)
                .unwrap_err()
                .to_string();
            assert!(
                err.contains(says) && err.contains("config.json"),
                "{key}: {err}"
            );
        }
    }

    /// llama.cpp's converter permutes head rows `[h, 2, D/2] → [h, D/2, 2]`; un-permuting
    /// gives back the original order.
    #[test]
    fn unpermute_undoes_the_converter() {
        let (heads, d) = (3, 8);
        let original: Vec<u8> = (0..(heads * d) as u8).collect();
        // The converter: row (h, half, i) goes to (h, i, half).
        let mut permuted = vec![0u8; original.len()];
        for h in 0..heads {
            for half in 0..2 {
                for i in 0..d / 2 {
                    permuted[h * d + i * 2 + half] = original[h * d + half * (d / 2) + i];
                }
            }
        }
        assert_eq!(unpermute_rows(&permuted, heads, 1), original);
    }
}
