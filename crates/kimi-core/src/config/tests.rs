#![allow(clippy::unwrap_used)]

use serde_json::{json, Value};

use super::*;

const RELEASED: &str = include_str!("../../tests/data/kimi-linear-48b-a3b-instruct.config.json");
const K3: &str = include_str!("../../tests/data/kimi-k3-trimmed.config.json");

fn released() -> Value {
    serde_json::from_str(RELEASED).unwrap()
}

fn parse(v: &Value) -> Result<ModelConfig, ConfigError> {
    ModelConfig::from_json(v)
}

/// The released config with `edit` applied to its top-level object.
fn edited(edit: impl FnOnce(&mut serde_json::Map<String, Value>)) -> Value {
    let mut v = released();
    edit(v.as_object_mut().unwrap());
    v
}

fn lac(v: &mut serde_json::Map<String, Value>) -> &mut serde_json::Map<String, Value> {
    v.get_mut("linear_attn_config")
        .unwrap()
        .as_object_mut()
        .unwrap()
}

fn mla_layers(c: &ModelConfig) -> Vec<usize> {
    (0..c.num_layers())
        .filter(|&i| c.layers[i].mixer == Mixer::Mla)
        .collect()
}

fn dense_layers(c: &ModelConfig) -> Vec<usize> {
    (0..c.num_layers())
        .filter(|&i| c.layers[i].ffn == Ffn::Dense)
        .collect()
}

/// The Kimi-Linear-48B model written in the transformers-5 native schema, with the class's own
/// spellings (`num_local_experts`, `num_experts_per_tok`, `n_shared_experts`, ...).
fn native() -> Value {
    let mla = [3, 7, 11, 15, 19, 23, 26];
    let layer_types: Vec<&str> = (0..27)
        .map(|i| {
            if mla.contains(&i) {
                "full_attention"
            } else {
                "linear_attention"
            }
        })
        .collect();
    let mlp_layer_types: Vec<&str> = (0..27)
        .map(|i| if i == 0 { "dense" } else { "sparse" })
        .collect();
    json!({
        "architectures": ["KimiLinearForCausalLM"],
        "model_type": "kimi_linear",
        "vocab_size": 163840, "hidden_size": 2304, "intermediate_size": 9216,
        "moe_intermediate_size": 1024, "num_hidden_layers": 27, "num_attention_heads": 32,
        "num_key_value_heads": 32, "n_shared_experts": 1, "routed_scaling_factor": 2.446,
        "kv_lora_rank": 512, "q_lora_rank": null, "qk_rope_head_dim": 64, "v_head_dim": 128,
        "qk_nope_head_dim": 128, "n_group": 1, "topk_group": 1, "num_experts_per_tok": 8,
        "norm_topk_prob": true, "hidden_act": "silu", "max_position_embeddings": 1048576,
        "rms_norm_eps": 1e-5, "pad_token_id": 163839, "bos_token_id": 163584,
        "eos_token_id": 163586, "tie_word_embeddings": false, "attention_bias": false,
        "num_local_experts": 256, "layer_types": layer_types, "mlp_layer_types": mlp_layer_types,
        "linear_head_dim": 128, "linear_num_heads": 32, "linear_conv_kernel_dim": 4,
        "mla_use_nope": true, "mla_use_output_gate": false, "attn_res_block_size": 0,
        "head_dim": 64, "dtype": "bfloat16"
    })
}

#[test]
fn released_config_parses() {
    let c = parse(&released()).unwrap();
    assert_eq!(c.model_type, "kimi_linear");
    assert_eq!(
        (c.vocab_size, c.hidden_size, c.num_layers()),
        (163840, 2304, 27)
    );
    assert_eq!(mla_layers(&c), vec![3, 7, 11, 15, 19, 23, 26]);
    assert_eq!(dense_layers(&c), vec![0]);
    assert_eq!(
        c.layers.iter().filter(|l| l.mixer == Mixer::Kda).count(),
        20
    );
    assert_eq!(
        c.layers[26],
        LayerSpec {
            mixer: Mixer::Mla,
            ffn: Ffn::Moe
        }
    );
    assert_eq!(
        c.layers[0],
        LayerSpec {
            mixer: Mixer::Kda,
            ffn: Ffn::Dense
        }
    );
    assert_eq!(c.rms_norm_eps, 1e-5);
    assert_eq!(c.intermediate_size, 9216);
    assert_eq!(
        c.kda,
        Some(KdaConfig {
            num_heads: 32,
            head_dim: 128,
            conv_kernel: 4,
            gate: KdaGate::Softplus,
            output_gate: KdaOutputGate::LowRank,
        })
    );
    assert_eq!(
        c.mla,
        Some(MlaConfig {
            num_heads: 32,
            q_lora_rank: None,
            kv_lora_rank: 512,
            qk_nope_head_dim: 128,
            qk_rope_head_dim: 64,
            v_head_dim: 128,
            latent_norm_eps: 1e-6,
            output_gate: false,
        })
    );
    assert_eq!(
        c.moe,
        Some(MoeConfig {
            num_experts: 256,
            top_k: 8,
            expert_intermediate_size: 1024,
            num_shared_experts: 1,
            renormalize: true,
            routed_scaling_factor: 2.446,
            num_expert_groups: 1,
            topk_group: 1,
            weights_use_correction_bias: false,
            latent: None,
            expert_format: ExpertFormat::Dense,
        })
    );
    assert_eq!(c.family, Family::KimiLinear);
    assert_eq!(c.activation, Activation::Silu);
    assert_eq!(c.attn_res_block_size, None);
    assert!(!c.tie_word_embeddings);
    assert_eq!(c.bos_token_id, Some(163584));
    assert_eq!(c.eos_token_ids, vec![163586]);
    assert_eq!(c.pad_token_id, Some(163839));
    assert_eq!(c.max_position_embeddings, 1048576);
}

#[test]
fn from_json_str_matches_and_rejects_bad_json() {
    assert_eq!(
        ModelConfig::from_json_str(RELEASED).unwrap(),
        parse(&released()).unwrap()
    );
    let err = ModelConfig::from_json_str("{\"vocab_size\": ").unwrap_err();
    assert!(matches!(err, ConfigError::Json(_)), "{err}");
}

#[test]
fn native_schema_gives_the_same_model() {
    assert_eq!(parse(&native()).unwrap(), parse(&released()).unwrap());
}

#[test]
fn both_schemas_that_agree_are_accepted() {
    let mut v = released();
    let n = native();
    for key in [
        "layer_types",
        "mlp_layer_types",
        "linear_head_dim",
        "linear_num_heads",
        "linear_conv_kernel_dim",
    ] {
        v[key] = n[key].clone();
    }
    assert_eq!(parse(&v).unwrap(), parse(&released()).unwrap());
}

#[test]
fn schema_disagreement_is_an_error() {
    // Layer types: the native list moves the last MLA layer.
    let v = edited(|o| {
        let mut types = native()["layer_types"].clone();
        types[26] = json!("linear_attention");
        types[25] = json!("full_attention");
        o.insert("layer_types".into(), types);
    });
    let err = parse(&v).unwrap_err().to_string();
    assert!(
        err.contains("disagree") && err.contains("layer 25") && err.contains("layer 26"),
        "{err}"
    );

    // MoE layers: moe_layer_freq 2 makes odd layers dense in the hub rule.
    let v = edited(|o| {
        o.insert(
            "mlp_layer_types".into(),
            native()["mlp_layer_types"].clone(),
        );
        o.insert("moe_layer_freq".into(), json!(2));
    });
    let err = parse(&v).unwrap_err().to_string();
    assert!(
        err.contains("mlp_layer_types") && err.contains("disagree"),
        "{err}"
    );

    // KDA dims given twice with different values.
    let v = edited(|o| {
        o.insert("linear_num_heads".into(), json!(16));
    });
    let err = parse(&v).unwrap_err().to_string();
    assert!(
        err.contains("linear_num_heads") && err.contains("must agree"),
        "{err}"
    );
}

#[test]
fn hub_moe_rule_uses_moe_layer_freq() {
    let v = edited(|o| {
        o.insert("first_k_dense_replace".into(), json!(2));
        o.insert("moe_layer_freq".into(), json!(3));
    });
    let c = parse(&v).unwrap();
    let moe: Vec<usize> = (0..27).filter(|&i| c.layers[i].ffn == Ffn::Moe).collect();
    assert_eq!(moe, vec![3, 6, 9, 12, 15, 18, 21, 24]);
}

#[test]
fn one_hub_list_is_enough() {
    let want = parse(&released()).unwrap();
    let only_kda = edited(|o| {
        lac(o).remove("full_attn_layers");
    });
    assert_eq!(parse(&only_kda).unwrap(), want);
    let only_full = edited(|o| {
        lac(o).remove("kda_layers");
    });
    assert_eq!(parse(&only_full).unwrap(), want);
}

#[test]
fn no_layer_schedule_is_an_error() {
    let v = edited(|o| {
        let l = lac(o);
        l.remove("full_attn_layers");
        l.remove("kda_layers");
    });
    let err = parse(&v).unwrap_err().to_string();
    assert!(
        err.contains("layer_types") && err.contains("does not guess"),
        "{err}"
    );
}

#[test]
fn aliases_are_accepted() {
    let want = parse(&released()).unwrap();
    let renames = [
        ("num_experts", "num_local_experts"),
        ("num_experts", "n_routed_experts"),
        ("num_experts_per_token", "num_experts_per_tok"),
        ("num_shared_experts", "n_shared_experts"),
        ("num_expert_group", "n_group"),
        ("moe_renormalize", "norm_topk_prob"),
        ("model_max_length", "max_position_embeddings"),
    ];
    for (from, to) in renames {
        let v = edited(|o| {
            let value = o.remove(from).unwrap();
            o.insert(to.into(), value);
        });
        assert_eq!(parse(&v).unwrap(), want, "{from} -> {to}");
    }
    // Two spellings with the same value are fine; different values are not.
    let v = edited(|o| {
        o.insert("num_local_experts".into(), json!(256));
    });
    assert_eq!(parse(&v).unwrap(), want);
    let v = edited(|o| {
        o.insert("num_local_experts".into(), json!(128));
    });
    let err = parse(&v).unwrap_err().to_string();
    assert!(
        err.contains("num_experts") && err.contains("num_local_experts"),
        "{err}"
    );
}

#[test]
fn defaults_apply_when_optional_fields_are_absent() {
    let v = edited(|o| {
        for key in [
            "moe_renormalize",
            "routed_scaling_factor",
            "num_expert_group",
            "topk_group",
            "tie_word_embeddings",
            "rms_norm_eps",
            "moe_router_activation_func",
            "hidden_act",
            "bos_token_id",
            "pad_token_id",
            "eos_token_id",
        ] {
            o.remove(key);
        }
    });
    let c = parse(&v).unwrap();
    let moe = c.moe.unwrap();
    assert!(moe.renormalize);
    assert_eq!(moe.routed_scaling_factor, 1.0);
    assert_eq!((moe.num_expert_groups, moe.topk_group), (1, 1));
    assert!(!c.tie_word_embeddings);
    assert_eq!(c.rms_norm_eps, 1e-5);
    assert_eq!((c.bos_token_id, c.pad_token_id), (None, None));
    assert!(c.eos_token_ids.is_empty());
}

#[test]
fn gate_lower_bound_router_bias_and_eos_list() {
    let v = edited(|o| {
        lac(o).insert("gate_lower_bound".into(), json!(-5.0));
        o.insert("kimi_infer_router_weights_use_bias".into(), json!(true));
        o.insert("eos_token_id".into(), json!([163586, 163585]));
    });
    let c = parse(&v).unwrap();
    assert_eq!(c.kda.unwrap().gate, KdaGate::LowerBound(-5.0));
    assert!(c.moe.unwrap().weights_use_correction_bias);
    assert_eq!(c.eos_token_ids, vec![163586, 163585]);
}

#[test]
fn grouped_selection_is_validated() {
    let v = edited(|o| {
        o.insert("num_expert_group".into(), json!(8));
        o.insert("topk_group".into(), json!(4));
    });
    let moe = parse(&v).unwrap().moe.unwrap();
    assert_eq!((moe.num_expert_groups, moe.topk_group), (8, 4));
    // With grouping switched off the group fields are unused.
    let v = edited(|o| {
        o.insert("use_grouped_topk".into(), json!(false));
        o.insert("num_expert_group".into(), json!(3));
    });
    let moe = parse(&v).unwrap().moe.unwrap();
    assert_eq!((moe.num_expert_groups, moe.topk_group), (1, 1));
}

#[test]
fn dense_only_config_needs_no_moe_fields() {
    let v = edited(|o| {
        for key in [
            "num_experts",
            "num_experts_per_token",
            "num_shared_experts",
            "moe_intermediate_size",
        ] {
            o.remove(key);
        }
    });
    let c = parse(&v).unwrap();
    assert!(c.moe.is_none());
    assert!(c.layers.iter().all(|l| l.ffn == Ffn::Dense));
}

#[test]
fn kimi_k3_released_config_parses() {
    let c = ModelConfig::from_json_str(K3).unwrap();
    assert_eq!(c.family, Family::KimiK3);
    assert_eq!(c.model_type, "kimi_k3");
    assert_eq!(c.tensor_prefix(), "language_model.");
    assert_eq!(
        (c.vocab_size, c.hidden_size, c.num_layers()),
        (163840, 7168, 93)
    );
    // 69 KDA + 24 MLA, MLA at 3, 7, ..., 91 and 92; layer 0 dense.
    let mla: Vec<usize> = (0..93)
        .filter(|&i| c.layers[i].mixer == Mixer::Mla)
        .collect();
    let mut expect: Vec<usize> = (0..23).map(|b| 4 * b + 3).collect();
    expect.push(92);
    assert_eq!(mla, expect);
    assert_eq!(c.layers[0].ffn, Ffn::Dense);
    assert!(c.layers[1..].iter().all(|l| l.ffn == Ffn::Moe));
    assert_eq!(
        c.activation,
        Activation::Situ {
            beta: 4.0,
            linear_beta: Some(25.0)
        }
    );
    assert_eq!(c.attn_res_block_size, Some(12));
    let kda = c.kda.as_ref().unwrap();
    assert_eq!((kda.num_heads, kda.head_dim, kda.conv_kernel), (96, 128, 4));
    assert_eq!(kda.gate, KdaGate::LowerBound(-5.0));
    assert_eq!(kda.output_gate, KdaOutputGate::FullRank);
    let mla = c.mla.as_ref().unwrap();
    assert_eq!(mla.q_lora_rank, Some(1536));
    assert!(mla.output_gate);
    assert_eq!(mla.latent_norm_eps, 1e-6);
    let moe = c.moe.as_ref().unwrap();
    assert_eq!((moe.num_experts, moe.top_k), (896, 16));
    assert_eq!(moe.num_shared_experts, 2);
    assert_eq!(
        moe.latent,
        Some(LatentMoe {
            width: 3584,
            norm: true
        })
    );
    assert_eq!(moe.expert_format, ExpertFormat::Mxfp4);
    assert_eq!(c.eos_token_ids, vec![163586]);
    assert_eq!(
        (c.bos_token_id, c.pad_token_id),
        (Some(163584), Some(163839))
    );
    assert!(!c.tie_word_embeddings);
    assert_eq!(c.dtype, Some(DType::BF16));
}

#[test]
fn declared_dtype_is_read_leniently() {
    assert_eq!(parse(&released()).unwrap().dtype, Some(DType::BF16));
    let v = edited(|o| {
        o.remove("dtype");
        o.insert("torch_dtype".into(), json!("float32"));
    });
    assert_eq!(parse(&v).unwrap().dtype, Some(DType::F32));
    // Unknown or absent: not declared, and never a reason to refuse the config.
    let v = edited(|o| {
        o.insert("dtype".into(), json!("auto"));
    });
    assert_eq!(parse(&v).unwrap().dtype, None);
    let v = edited(|o| {
        o.remove("dtype");
    });
    assert_eq!(parse(&v).unwrap().dtype, None);
}

#[test]
fn k3_text_config_alone_is_a_kimi_linear_variant() {
    let k3: Value = serde_json::from_str(K3).unwrap();
    let c = parse(&k3["text_config"]).unwrap();
    assert_eq!(c.family, Family::KimiLinear);
    assert_eq!(c.attn_res_block_size, Some(12));
    assert_eq!(c.moe.unwrap().expert_format, ExpertFormat::Mxfp4);
    // Architectures alone identify K3; then `text_config` is needed for the weights' prefix
    // only, and a flattened config still parses.
    let v = edited(|o| {
        o.insert(
            "architectures".into(),
            json!(["KimiK3ForConditionalGeneration"]),
        );
    });
    assert_eq!(parse(&v).unwrap().family, Family::KimiK3);
}

#[test]
fn k3_config_errors_name_the_nested_field() {
    let k3: Value = serde_json::from_str(K3).unwrap();
    let with = |edit: &dyn Fn(&mut Value)| {
        let mut v = k3.clone();
        edit(&mut v);
        parse(&v).unwrap_err().to_string()
    };
    let msg = with(&|v| v["text_config"]["hidden_size"] = json!("wide"));
    assert!(msg.contains("text_config.hidden_size"), "{msg}");
    let msg = with(&|v| v["text_config"]["linear_attn_config"]["num_heads"] = json!(0));
    assert!(
        msg.contains("text_config.linear_attn_config.num_heads"),
        "{msg}"
    );
    let msg = with(&|v| v["text_config"]["hidden_act"] = json!("gelu"));
    assert!(msg.contains("gelu") && msg.contains("situ"), "{msg}");
    let msg = with(&|v| {
        v["text_config"]["quantization_config"]["format"] = json!("nvfp4-pack-quantized")
    });
    assert!(
        msg.contains("nvfp4-pack-quantized") && msg.contains("MXFP4"),
        "{msg}"
    );
    let msg = with(&|v| {
        v["text_config"]["quantization_config"]["config_groups"]["group_0"]["weights"]
            ["group_size"] = json!(16)
    });
    assert!(
        msg.contains("group_0") && msg.contains("group_size"),
        "{msg}"
    );
    let msg = with(&|v| v["text_config"]["routed_expert_hidden_size"] = json!(3583));
    assert!(
        msg.contains("routed_expert_hidden_size") && msg.contains("32"),
        "{msg}"
    );
    let msg = with(&|v| v["text_config"]["model_type"] = json!("qwen3"));
    assert!(msg.contains("text_config.model_type"), "{msg}");
    let msg = with(&|v| v["text_config"]["activation_situ_linear_beta"] = json!(-1.0));
    assert!(msg.contains("activation_situ_linear_beta"), "{msg}");
    // A quantization config hoisted to the top level (as vLLM does) is read there too.
    let mut hoisted = k3.clone();
    let q = hoisted["text_config"]
        .as_object_mut()
        .unwrap()
        .remove("quantization_config")
        .unwrap();
    hoisted["quantization_config"] = q;
    assert_eq!(
        parse(&hoisted).unwrap().moe.unwrap().expert_format,
        ExpertFormat::Mxfp4
    );
}

#[test]
fn other_models_are_rejected_by_name() {
    let v = json!({"model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"]});
    let err = parse(&v).unwrap_err();
    let ConfigError::Unsupported(msg) = &err else {
        panic!("expected Unsupported, got {err:?}")
    };
    assert!(
        msg.contains("deepseek_v3") && msg.contains("DeepseekV3ForCausalLM"),
        "{msg}"
    );
}

/// Each case edits the released config; every one must fail with an error whose text contains
/// the given words.
#[test]
fn malformed_configs_give_errors() {
    type Edit = Box<dyn Fn(&mut serde_json::Map<String, Value>)>;
    fn set(key: &'static str, value: Value) -> Edit {
        Box::new(move |o| {
            o.insert(key.into(), value.clone());
        })
    }
    fn set_lac(key: &'static str, value: Value) -> Edit {
        Box::new(move |o| {
            lac(o).insert(key.into(), value.clone());
        })
    }
    fn remove(key: &'static str) -> Edit {
        Box::new(move |o| {
            o.remove(key);
        })
    }
    let cases: Vec<(&str, Edit, &str)> = vec![
        ("zero vocab", set("vocab_size", json!(0)), "vocab_size"),
        ("negative vocab", set("vocab_size", json!(-1)), "negative"),
        (
            "string vocab",
            set("vocab_size", json!("163840")),
            "whole number",
        ),
        (
            "fractional hidden",
            set("hidden_size", json!(2304.5)),
            "hidden_size",
        ),
        (
            "huge hidden",
            set("hidden_size", json!(1u64 << 40)),
            "maximum",
        ),
        (
            "null hidden",
            set("hidden_size", Value::Null),
            "missing field `hidden_size`",
        ),
        (
            "no layers count",
            remove("num_hidden_layers"),
            "num_hidden_layers",
        ),
        (
            "more layers than lists",
            set("num_hidden_layers", json!(28)),
            "28",
        ),
        (
            "fewer layers than lists",
            set("num_hidden_layers", json!(26)),
            "out of range",
        ),
        (
            "layer 0 in 1-indexed list",
            set_lac("kda_layers", json!([0, 1, 2])),
            "1-indexed",
        ),
        (
            "duplicate layer",
            set_lac("full_attn_layers", json!([4, 4, 8, 12, 16, 20, 24, 27])),
            "twice",
        ),
        (
            "overlapping lists",
            set_lac("full_attn_layers", json!([1, 4, 8, 12, 16, 20, 24, 27])),
            "also listed",
        ),
        (
            "list of strings",
            set_lac("kda_layers", json!(["1"])),
            "kda_layers[0]",
        ),
        (
            "list not array",
            set_lac("kda_layers", json!(5)),
            "expected an array",
        ),
        (
            "lac not object",
            set("linear_attn_config", json!([1, 2])),
            "expected an object",
        ),
        (
            "zero kda heads",
            set_lac("num_heads", json!(0)),
            "linear_attn_config.num_heads",
        ),
        (
            "no kda head dim",
            Box::new(|o| {
                lac(o).remove("head_dim");
            }),
            "linear_attn_config.head_dim",
        ),
        (
            "layer_types too short",
            set("layer_types", json!(["linear_attention"])),
            "entries",
        ),
        (
            "layer_types bad entry",
            set("layer_types", json!(vec!["mamba"; 27])),
            "layer_types[0]",
        ),
        (
            "mlp_layer_types bad entry",
            set("mlp_layer_types", json!(vec![1; 27])),
            "mlp_layer_types[0]",
        ),
        (
            "top_k above experts",
            set("num_experts_per_token", json!(300)),
            "only 256",
        ),
        (
            "zero top_k",
            set("num_experts_per_token", json!(0)),
            "at least 1",
        ),
        ("zero experts", set("num_experts", json!(0)), "num_experts"),
        (
            "no expert width",
            remove("moe_intermediate_size"),
            "moe_intermediate_size",
        ),
        (
            "no shared count",
            remove("num_shared_experts"),
            "num_shared_experts",
        ),
        (
            "topk_group above groups",
            set("topk_group", json!(2)),
            "topk_group",
        ),
        ("uneven groups", set("num_expert_group", json!(3)), "evenly"),
        (
            "negative scaling",
            set("routed_scaling_factor", json!(-1.0)),
            "greater than 0",
        ),
        (
            "string eps",
            set("rms_norm_eps", json!("1e-5")),
            "expected a number",
        ),
        ("zero eps", set("rms_norm_eps", json!(0.0)), "rms_norm_eps"),
        (
            "softmax router",
            set("moe_router_activation_func", json!("softmax")),
            "sigmoid",
        ),
        (
            "other topk method",
            set("topk_method", json!("greedy")),
            "topk_method",
        ),
        ("gelu", set("hidden_act", json!("gelu")), "silu"),
        (
            "rope mla",
            set("mla_use_nope", json!(false)),
            "mla_use_nope",
        ),
        (
            "bool as string",
            set("mla_use_nope", json!("true")),
            "true or false",
        ),
        ("zero q lora", set("q_lora_rank", json!(0)), "q_lora_rank"),
        ("no kv lora", remove("kv_lora_rank"), "kv_lora_rank"),
        (
            "no mla heads",
            remove("num_attention_heads"),
            "num_attention_heads",
        ),
        (
            "positive gate bound",
            set_lac("gate_lower_bound", json!(1.0)),
            "negative",
        ),
        (
            "eos string",
            set("eos_token_id", json!("163586")),
            "eos_token_id",
        ),
        (
            "eos list bad item",
            set("eos_token_id", json!([163586, -2])),
            "eos_token_id[1]",
        ),
        (
            "eos beyond vocab",
            set("eos_token_id", json!(200000)),
            "vocab_size",
        ),
        (
            "bos beyond vocab",
            set("bos_token_id", json!(163840)),
            "bos_token_id",
        ),
        (
            "zero context",
            set("model_max_length", json!(0)),
            "at least 1",
        ),
        (
            "negative first_k",
            set("first_k_dense_replace", json!(-1)),
            "first_k_dense_replace",
        ),
        (
            "zero moe freq",
            set("moe_layer_freq", json!(0)),
            "moe_layer_freq",
        ),
        (
            "no schedule for experts",
            remove("first_k_dense_replace"),
            "mlp_layer_types",
        ),
        (
            "model_type number",
            set("model_type", json!(3)),
            "model_type",
        ),
        (
            "unknown model_type",
            set("model_type", json!("llama")),
            "llama",
        ),
        (
            "architectures string",
            set("architectures", json!("KimiLinearForCausalLM")),
            "architectures",
        ),
        (
            "architectures number item",
            set("architectures", json!([1])),
            "architectures[0]",
        ),
        (
            "bias flag string",
            set("kimi_infer_router_weights_use_bias", json!("yes")),
            "kimi_infer",
        ),
        (
            "attention bias",
            set("attention_bias", json!(true)),
            "attention_bias",
        ),
        (
            "quantized",
            set(
                "quantization_config",
                json!({"quant_method": "bitsandbytes"}),
            ),
            "bitsandbytes",
        ),
    ];
    for (what, edit, needle) in cases {
        let mut v = released();
        edit(v.as_object_mut().unwrap());
        match parse(&v) {
            Ok(_) => panic!("{what}: parsed, expected an error"),
            Err(e) => assert!(
                e.to_string().contains(needle),
                "{what}: {e} (wanted {needle:?})"
            ),
        }
    }
    for top in [json!(null), json!([]), json!("kimi"), json!(5), json!({})] {
        assert!(parse(&top).is_err(), "{top}");
    }
}

/// Replaces every field (top level and `linear_attn_config`) with odd values and removes it in
/// turn: parsing must return, never panic.
#[test]
fn odd_values_never_panic() {
    let odd = [
        Value::Null,
        json!(true),
        json!(-1),
        json!(0),
        json!(1),
        json!(u64::MAX),
        json!(1e300),
        json!(-0.5),
        json!("x"),
        json!([]),
        json!([1, 2, 1000000]),
        json!({}),
    ];
    let base = released();
    let keys: Vec<String> = base.as_object().unwrap().keys().cloned().collect();
    let lac_keys: Vec<String> = base["linear_attn_config"]
        .as_object()
        .unwrap()
        .keys()
        .cloned()
        .collect();
    let mut count = 0;
    for key in &keys {
        let mut v = base.clone();
        v.as_object_mut().unwrap().remove(key);
        let _ = parse(&v);
        for value in &odd {
            let mut v = base.clone();
            v[key.as_str()] = value.clone();
            let _ = parse(&v);
            count += 1;
        }
    }
    for key in &lac_keys {
        for value in &odd {
            let mut v = base.clone();
            v["linear_attn_config"][key.as_str()] = value.clone();
            let _ = parse(&v);
            count += 1;
        }
    }
    let mut k3: Value = serde_json::from_str(K3).unwrap();
    for value in &odd {
        k3["text_config"] = value.clone();
        let _ = parse(&k3);
    }
    assert!(count > 500);
}
