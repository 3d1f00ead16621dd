//! The one table between the hub checkpoint tensors of spec §2 and the tensors of a
//! llama.cpp Kimi Linear GGUF (`convert_hf_to_gguf.py` `KimiLinearModel`, gguf-py
//! `constants.py` / `tensor_mapping.py`) or Kimi K3 GGUF (`kimi-k3`, llama.cpp's
//! `src/models/kimi-k3.cpp`: the names unsloth's `Kimi-K3-GGUF` files carry), with the
//! layout change each tensor undergoes. The loader reads it backwards, the converter
//! forwards.
//!
//! Kimi K3's additions: the AttnRes mixes folded into one scoring vector per mix
//! (`attn_res_score`, `ffn_res_score`, `output_res_score` = norm ⊙ proj), the full-rank KDA
//! gate `ssm_g`, the MLA output gate `attn_gate`, `ssm_a` as `[heads]` (the checkpoint's
//! padding dropped), the LatentMoE projections `ffn_routed_{down,norm,up}`, and MXFP4 experts
//! stored as ggml `MXFP4` blocks (the checkpoint's two planes repacked, values unchanged).

use kimi_core::config::{ExpertFormat, Family, Ffn, KdaOutputGate, Mixer};
use kimi_core::ModelConfig;

/// How a GGUF tensor's values relate to its hub tensor(s).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Layout {
    /// Same values in the same order; the shapes may differ by unit dimensions only
    /// (convolutions: hub `[C, 1, W]`, GGUF `[1, C, 1, W]`, ggml `ne = [W, 1, C, 1]`).
    Same,
    /// The GGUF holds `-exp(A_log)` (`ssm_a`), precomputed by llama.cpp's converter.
    NegExp,
    /// One hub matrix `[rows, cols]` per expert, stacked into `[experts, rows, cols]`.
    Stacked,
    /// The key rows of `kv_b_proj` per head, transposed: `[heads, kv_lora_rank, nope]`.
    KvBKeys,
    /// The value rows of `kv_b_proj` per head: `[heads, v_head_dim, kv_lora_rank]`.
    KvBValues,
    /// An AttnRes mix's scoring vector `norm ⊙ proj` (in f32, as the model folds it) from
    /// `hub = [{mix}_norm.weight [d], {mix}_proj.weight [1, d]]`; read back as the norm, with
    /// a projection of ones.
    ResScore,
}

/// One GGUF tensor and where its values come from.
#[derive(Clone, Debug)]
pub(crate) struct Recipe {
    /// GGUF name (`blk.0.ssm_conv1d_q.weight`).
    pub gguf: String,
    /// Shape llama.cpp's converter writes, outermost first (numpy order; ggml `ne` reversed).
    pub shape: Vec<usize>,
    pub layout: Layout,
    /// Hub tensors it is made of: one, or one per expert for [`Layout::Stacked`].
    pub hub: Vec<String>,
    /// Shape of each hub tensor.
    pub hub_shape: Vec<usize>,
    /// Absent from some checkpoints (the router's correction bias).
    pub optional: bool,
    /// Stored as ggml `MXFP4` blocks whatever the file's type (K3's routed experts).
    pub mxfp4: bool,
}

impl Recipe {
    fn new(gguf: String, shape: &[usize], hub: String, hub_shape: &[usize]) -> Self {
        Recipe {
            gguf,
            shape: shape.to_vec(),
            layout: Layout::Same,
            hub: vec![hub],
            hub_shape: hub_shape.to_vec(),
            optional: false,
            mxfp4: false,
        }
    }

    /// A tensor stored under the same shape in both layouts.
    fn plain(gguf: String, hub: String, shape: &[usize]) -> Self {
        Recipe::new(gguf, shape, hub, shape)
    }

    /// The layer number of a `blk.N.` tensor.
    pub fn layer(&self) -> Option<usize> {
        self.gguf
            .strip_prefix("blk.")
            .and_then(|rest| rest.split('.').next())
            .and_then(|n| n.parse().ok())
    }
}

/// An AttnRes mix's scoring vector `{gguf}` from the hub's `{mix}_norm` and `{mix}_proj`.
fn res_score(gguf: String, mix: &str, hidden: usize) -> Recipe {
    Recipe {
        layout: Layout::ResScore,
        hub: vec![format!("{mix}_norm.weight"), format!("{mix}_proj.weight")],
        ..Recipe::plain(gguf, String::new(), &[hidden])
    }
}

/// Every tensor of the GGUF for `config`, in the order the converter writes them.
pub(crate) fn recipes(config: &ModelConfig) -> Vec<Recipe> {
    let hidden = config.hidden_size;
    // Kimi K3's text model sits under the wrapper's `language_model.`.
    let pre = config.tensor_prefix();
    let attn_res = config.attn_res_block_size.is_some();
    let mut out = vec![Recipe::plain(
        "token_embd.weight".into(),
        format!("{pre}model.embed_tokens.weight"),
        &[config.vocab_size, hidden],
    )];
    for (i, spec) in config.layers.iter().enumerate() {
        let (p, b) = (format!("{pre}model.layers.{i}"), format!("blk.{i}"));
        out.push(Recipe::plain(
            format!("{b}.attn_norm.weight"),
            format!("{p}.input_layernorm.weight"),
            &[hidden],
        ));
        if attn_res {
            out.push(res_score(
                format!("{b}.attn_res_score.weight"),
                &format!("{p}.self_attention_res"),
                hidden,
            ));
            out.push(res_score(
                format!("{b}.ffn_res_score.weight"),
                &format!("{p}.mlp_res"),
                hidden,
            ));
        }
        match spec.mixer {
            Mixer::Kda => kda(&mut out, config, &p, &b),
            Mixer::Mla => mla(&mut out, config, &p, &b),
        }
        out.push(Recipe::plain(
            format!("{b}.ffn_norm.weight"),
            format!("{p}.post_attention_layernorm.weight"),
            &[hidden],
        ));
        match spec.ffn {
            Ffn::Dense => {
                let names = [
                    ("gate", "gate_proj"),
                    ("up", "up_proj"),
                    ("down", "down_proj"),
                ];
                mlp(
                    &mut out,
                    &format!("{p}.mlp"),
                    &b,
                    "",
                    names,
                    hidden,
                    config.intermediate_size,
                );
            }
            Ffn::Moe => moe(&mut out, config, &p, &b),
        }
    }
    out.push(Recipe::plain(
        "output_norm.weight".into(),
        format!("{pre}model.norm.weight"),
        &[hidden],
    ));
    if attn_res {
        out.push(res_score(
            "output_res_score.weight".into(),
            &format!("{pre}model.output_attn_res"),
            hidden,
        ));
    }
    if !config.tie_word_embeddings {
        out.push(Recipe::plain(
            "output.weight".into(),
            format!("{pre}lm_head.weight"),
            &[config.vocab_size, hidden],
        ));
    }
    out
}

fn kda(out: &mut Vec<Recipe>, config: &ModelConfig, p: &str, b: &str) {
    let Some(c) = &config.kda else { return };
    let (hidden, h, d, w) = (config.hidden_size, c.num_heads, c.head_dim, c.conv_kernel);
    let width = h * d;
    let a = format!("{p}.self_attn");
    for (g, hub) in [
        ("attn_q", "q_proj"),
        ("attn_k", "k_proj"),
        ("attn_v", "v_proj"),
    ] {
        out.push(Recipe::plain(
            format!("{b}.{g}.weight"),
            format!("{a}.{hub}.weight"),
            &[width, hidden],
        ));
    }
    for s in ["q", "k", "v"] {
        out.push(Recipe::new(
            format!("{b}.ssm_conv1d_{s}.weight"),
            &[1, width, 1, w],
            format!("{a}.{s}_conv1d.weight"),
            &[width, 1, w],
        ));
    }
    let mut low_rank = vec![
        ("ssm_f_a", "f_a_proj", [d, hidden]),
        ("ssm_f_b", "f_b_proj", [width, d]),
        ("ssm_beta", "b_proj", [h, hidden]),
    ];
    match c.output_gate {
        KdaOutputGate::LowRank => {
            low_rank.push(("ssm_g_a", "g_a_proj", [d, hidden]));
            low_rank.push(("ssm_g_b", "g_b_proj", [width, d]));
        }
        KdaOutputGate::FullRank => low_rank.push(("ssm_g", "g_proj", [width, hidden])),
    }
    for (g, hub, shape) in low_rank {
        out.push(Recipe::plain(
            format!("{b}.{g}.weight"),
            format!("{a}.{hub}.weight"),
            &shape,
        ));
    }
    // Kimi Linear's converter keeps the hub's `[1, 1, H, 1]`; K3's stores `[H]` (its
    // checkpoint's `[N ≥ H]` padding dropped, see `gguf_values`).
    let a_shape: &[usize] = match config.family {
        Family::KimiLinear => &[1, 1, h, 1],
        Family::KimiK3 => &[h],
    };
    out.push(Recipe {
        layout: Layout::NegExp,
        ..Recipe::plain(format!("{b}.ssm_a"), format!("{a}.A_log"), a_shape)
    });
    out.push(Recipe::plain(
        format!("{b}.ssm_dt.bias"),
        format!("{a}.dt_bias"),
        &[width],
    ));
    out.push(Recipe::plain(
        format!("{b}.ssm_norm.weight"),
        format!("{a}.o_norm.weight"),
        &[d],
    ));
    out.push(Recipe::plain(
        format!("{b}.attn_output.weight"),
        format!("{a}.o_proj.weight"),
        &[hidden, width],
    ));
}

fn mla(out: &mut Vec<Recipe>, config: &ModelConfig, p: &str, b: &str) {
    let Some(c) = &config.mla else { return };
    let (hidden, h, r) = (config.hidden_size, c.num_heads, c.kv_lora_rank);
    let (nope, rope, v) = (c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim);
    let a = format!("{p}.self_attn");
    match c.q_lora_rank {
        None => out.push(Recipe::plain(
            format!("{b}.attn_q.weight"),
            format!("{a}.q_proj.weight"),
            &[h * (nope + rope), hidden],
        )),
        Some(q) => {
            out.push(Recipe::plain(
                format!("{b}.attn_q_a.weight"),
                format!("{a}.q_a_proj.weight"),
                &[q, hidden],
            ));
            out.push(Recipe::plain(
                format!("{b}.attn_q_a_norm.weight"),
                format!("{a}.q_a_layernorm.weight"),
                &[q],
            ));
            out.push(Recipe::plain(
                format!("{b}.attn_q_b.weight"),
                format!("{a}.q_b_proj.weight"),
                &[h * (nope + rope), q],
            ));
        }
    }
    out.push(Recipe::plain(
        format!("{b}.attn_kv_a_mqa.weight"),
        format!("{a}.kv_a_proj_with_mqa.weight"),
        &[r + rope, hidden],
    ));
    out.push(Recipe::plain(
        format!("{b}.attn_kv_a_norm.weight"),
        format!("{a}.kv_a_layernorm.weight"),
        &[r],
    ));
    let kv_b = format!("{a}.kv_b_proj.weight");
    let kv_b_shape = [h * (nope + v), r];
    out.push(Recipe {
        layout: Layout::KvBKeys,
        ..Recipe::new(
            format!("{b}.attn_k_b.weight"),
            &[h, r, nope],
            kv_b.clone(),
            &kv_b_shape,
        )
    });
    out.push(Recipe {
        layout: Layout::KvBValues,
        ..Recipe::new(
            format!("{b}.attn_v_b.weight"),
            &[h, v, r],
            kv_b,
            &kv_b_shape,
        )
    });
    if c.output_gate {
        out.push(Recipe::plain(
            format!("{b}.attn_gate.weight"),
            format!("{a}.g_proj.weight"),
            &[h * v, hidden],
        ));
    }
    out.push(Recipe::plain(
        format!("{b}.attn_output.weight"),
        format!("{a}.o_proj.weight"),
        &[hidden, h * v],
    ));
}

/// A SwiGLU block: `ffn_{gate,up,down}{suffix}.weight` from `{prefix}.{names}.weight`.
fn mlp(
    out: &mut Vec<Recipe>,
    prefix: &str,
    b: &str,
    suffix: &str,
    names: [(&str, &str); 3],
    hidden: usize,
    width: usize,
) {
    for (g, hub) in names {
        let shape = if g == "down" {
            [hidden, width]
        } else {
            [width, hidden]
        };
        out.push(Recipe::plain(
            format!("{b}.ffn_{g}{suffix}.weight"),
            format!("{prefix}.{hub}.weight"),
            &shape,
        ));
    }
}

fn moe(out: &mut Vec<Recipe>, config: &ModelConfig, p: &str, b: &str) {
    let Some(c) = &config.moe else { return };
    let (hidden, e, width) = (
        config.hidden_size,
        c.num_experts,
        c.expert_intermediate_size,
    );
    let m = format!("{p}.block_sparse_moe");
    out.push(Recipe::plain(
        format!("{b}.ffn_gate_inp.weight"),
        format!("{m}.gate.weight"),
        &[e, hidden],
    ));
    out.push(Recipe {
        optional: true,
        ..Recipe::plain(
            format!("{b}.exp_probs_b.bias"),
            format!("{m}.gate.e_score_correction_bias"),
            &[e],
        )
    });
    // LatentMoE: the routed experts read and write the latent, the router the hidden state.
    let expert_in = match c.latent {
        None => hidden,
        Some(l) => {
            out.push(Recipe::plain(
                format!("{b}.ffn_routed_down.weight"),
                format!("{m}.routed_expert_down_proj.weight"),
                &[l.width, hidden],
            ));
            if l.norm {
                out.push(Recipe::plain(
                    format!("{b}.ffn_routed_norm.weight"),
                    format!("{m}.routed_expert_norm.weight"),
                    &[l.width],
                ));
            }
            out.push(Recipe::plain(
                format!("{b}.ffn_routed_up.weight"),
                format!("{m}.routed_expert_up_proj.weight"),
                &[hidden, l.width],
            ));
            l.width
        }
    };
    // w1 = gate, w3 = up, w2 = down (spec §2).
    for (g, w) in [("gate", "w1"), ("up", "w3"), ("down", "w2")] {
        let hub_shape = if g == "down" {
            [expert_in, width]
        } else {
            [width, expert_in]
        };
        out.push(Recipe {
            gguf: format!("{b}.ffn_{g}_exps.weight"),
            shape: vec![e, hub_shape[0], hub_shape[1]],
            layout: Layout::Stacked,
            hub: (0..e)
                .map(|x| format!("{m}.experts.{x}.{w}.weight"))
                .collect(),
            hub_shape: hub_shape.to_vec(),
            optional: false,
            mxfp4: c.expert_format == ExpertFormat::Mxfp4,
        });
    }
    if c.num_shared_experts > 0 {
        let names = [
            ("gate", "gate_proj"),
            ("up", "up_proj"),
            ("down", "down_proj"),
        ];
        let width = c.num_shared_experts * width;
        mlp(
            out,
            &format!("{m}.shared_experts"),
            b,
            "_shexp",
            names,
            hidden,
            width,
        );
    }
}
