//! Recognises Kimi K3 configs and names the K3 features kimi-infer does not run yet.
//!
//! Key names follow `shared/docs/kimi-k3-spec.md` §1 (the released `config.json`: a
//! `KimiK3ForConditionalGeneration` wrapper whose `text_config` is a `kimi_linear` config with
//! extra keys). Detection is lenient about types: a feature key that is present with any
//! non-default value counts, so a malformed K3 config is still reported as K3.

use serde_json::Value;

use super::fields::{describe, Fields};

/// `model_type` of the K3 multimodal wrapper.
pub(super) const K3_MODEL_TYPE: &str = "kimi_k3";

/// Whether an architecture name belongs to the Kimi K3 family.
pub(super) fn is_k3_architecture(name: &str) -> bool {
    name.starts_with("KimiK3")
}

/// True for values that switch a feature on: not null, false, 0, "" or an empty container.
fn truthy(value: Option<&Value>) -> bool {
    match value {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(Value::Number(n)) => n.as_f64().is_some_and(|x| x != 0.0),
        Some(Value::String(s)) => !s.is_empty(),
        Some(Value::Array(a)) => !a.is_empty(),
        Some(Value::Object(o)) => !o.is_empty(),
    }
}

/// The features of a Kimi-Linear-style text config that kimi-infer does not run yet, one
/// plain-words item each (empty for a Kimi Linear config). `wrapper` is the top level of a K3
/// multimodal config, whose `quantization_config` may sit outside `text_config`.
pub(super) fn unsupported_features(text: Fields<'_>, wrapper: Option<Fields<'_>>) -> Vec<String> {
    let mut out = Vec::new();
    if let Some(v) = text.get("attn_res_block_size").filter(|v| truthy(Some(v))) {
        out.push(format!(
            "Block Attention Residuals (`attn_res_block_size` = {})",
            describe(v)
        ));
    }
    if text.get("hidden_act").and_then(Value::as_str) == Some("situ") {
        out.push("SiTU-GLU activation (`hidden_act` = \"situ\")".into());
    }
    let latent = text.get("routed_expert_hidden_size");
    let latent_differs = latent.is_some() && latent != text.get("hidden_size");
    if latent_differs || truthy(text.get("latent_moe_use_norm")) {
        let width = latent.map_or_else(|| "unset".into(), describe);
        out.push(format!(
            "LatentMoE (routed experts in a latent of width `routed_expert_hidden_size` = {width}, \
             `latent_moe_use_norm`)"
        ));
    }
    let lac = text.get("linear_attn_config").and_then(Value::as_object);
    let full_rank_gate = lac
        .and_then(|o| o.get("use_full_rank_gate"))
        .or(text.get("use_full_rank_gate"));
    if truthy(full_rank_gate) {
        out.push("full-rank KDA output gate (`linear_attn_config.use_full_rank_gate`)".into());
    }
    if truthy(text.get("mla_use_output_gate")) {
        let q_lora = match text.get("q_lora_rank") {
            Some(v) => format!("; with q-LoRA `q_lora_rank` = {}", describe(v)),
            None => String::new(),
        };
        out.push(format!("gated MLA output (`mla_use_output_gate`{q_lora})"));
    }
    let quant = text
        .get("quantization_config")
        .or_else(|| wrapper.and_then(|w| w.get("quantization_config")));
    if let Some(q) = quant {
        out.push(describe_quantization(q));
    }
    if let Some(w) = wrapper.filter(|w| w.get("text_config").is_some()) {
        let mut parts = vec!["`text_config`"];
        if w.get("vision_config").is_some() {
            parts.push("`vision_config`");
        }
        out.push(format!(
            "the multimodal wrapper ({}; text weights under `language_model.`)",
            parts.join(" + ")
        ));
    }
    out
}

/// Names a `quantization_config` in plain words: MXFP4 experts for K3, else the method.
fn describe_quantization(q: &Value) -> String {
    let field = |key: &str| q.get(key).and_then(Value::as_str);
    let format = field("format");
    if format.is_some_and(|f| f.contains("mxfp4")) {
        return format!(
            "MXFP4 routed experts (`quantization_config`: format {:?})",
            format.unwrap_or_default()
        );
    }
    match field("quant_method").or(format) {
        Some(method) => format!("quantized weights (`quantization_config`: {method:?})"),
        None => "quantized weights (`quantization_config`)".into(),
    }
}
