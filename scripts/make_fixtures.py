#!/usr/bin/env python3
"""Make tiny random Kimi Linear checkpoints (original hub layout) plus float64 reference logits.

Reference implementation: Hugging Face transformers' native port (`KimiLinearForCausalLM`,
model_type `kimi_linear`), see shared/docs/kimi-linear-spec.md "Numerical reference for kimi-infer".

Run (on a machine with torch + transformers >= 5.17; no GPU needed, everything runs on the CPU):

    HF_HUB_OFFLINE=1 python3 scripts/make_fixtures.py --out fixtures/kimi-linear \
        --demo-out assets/demo-model [--demo-vocab N] [--inspect inspect.txt]

For each fixture in FIXTURES this script
  1. builds a `KimiLinearConfig` (from the hub schema when the class expresses the fixture, else from
     an equivalent native config) and a model with a fixed seed, then re-initialises every parameter
     so the logits are far from flat;
  2. casts it to the fixture's storage dtype (bf16 or f32; `A_log` and `dt_bias` stay f32);
  3. saves it with `save_pretrained` and verifies the tensor names/shapes/dtypes against the hub layout
     of spec §2 (converting the in-memory names itself if transformers saved something else);
  4. writes `config.json` in the fixture's schema ("hub" = released-checkpoint schema, "native" =
     what `KimiLinearConfig.save_pretrained` writes);
  5. reloads the directory with `KimiLinearForCausalLM.from_pretrained(dir, dtype=torch.float64)`,
     checks that no key is missing/unexpected, and computes from THAT model: `logits.npy`
     (float64 [T, vocab]) for a fixed pseudo-random prompt, and 24 greedy tokens (repeated full
     forward passes, no cache) from the first 12 prompt ids -> `reference.json`.
"""

import argparse
import contextlib
import copy
import dataclasses
import importlib.util
import inspect
import io
import json
import math
import os
import platform
import re
import shutil
import sys
import tempfile
import traceback

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import numpy as np
import torch

import transformers
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import KimiLinearConfig, KimiLinearForCausalLM

try:
    from transformers.models.kimi_linear import modeling_kimi_linear as MKL
except Exception:  # pragma: no cover
    MKL = None

GREEDY_PROMPT = 12
GREEDY_NEW = 24

# --------------------------------------------------------------------------------------------
# Fixture definitions.  mixers: "K" = KDA, "M" = MLA (0-indexed layer order).
# ffn is derived with the hub rule: MoE iff i >= first_k_dense_replace and i % moe_layer_freq == 0.
# --------------------------------------------------------------------------------------------
BASE = dict(
    vocab=256, hidden=48, intermediate=72, moe_intermediate=20,
    kda_heads=3, kda_head_dim=12, conv=4,
    mla_heads=2, nope=12, rope=6, v=10, kv_lora=20,
    experts=8, top_k=2, groups=1, topk_group=1, shared=1,
    renorm=True, scaling=2.446, first_k=1, freq=1, eps=1e-5,
    bos=1, eos=2, pad=0,
)

FIXTURES = [
    dict(
        name="hub-bf16-irregular", schema="hub", dtype="bfloat16", T=150, seed=1001,
        mixers="KMKKM", first_k=2, experts=8, groups=4, topk_group=2, top_k=2, shared=2,
        renorm=True, conv=3,
        covers=["KDA/MLA irregular order KDA,MLA,KDA,KDA,MLA", "first_k_dense_replace=2",
                "grouped routing: 8 experts, 4 groups, topk_group 2, top_k 2", "moe_renormalize on",
                "num_shared_experts=2", "odd head dims (KDA 3x12, MLA nope 12 rope 6 v 10 kv_lora 20)",
                "conv kernel 3", "prompt spans 3 KDA chunks (T=150)", "hub schema", "bf16 weights"],
    ),
    dict(
        name="hub-f32-sharded", schema="hub", dtype="float32", T=140, seed=1002, shards=2,
        mixers="KKMK", first_k=1, experts=6, groups=1, topk_group=1, top_k=3, shared=1,
        renorm=False, conv=5, hidden=40, intermediate=56, moe_intermediate=16,
        kda_heads=2, kda_head_dim=16, mla_heads=3, nope=8, rope=4, v=8, kv_lora=12,
        covers=["2 safetensors shards + model.safetensors.index.json", "f32 weights", "conv kernel 5",
                "moe_renormalize off", "top_k 3 of 6 experts, single group", "hub schema", "T=140"],
    ),
    dict(
        name="hub-bf16-released-like", schema="hub", dtype="bfloat16", T=170, seed=1003,
        mixers="KKKMKKM", first_k=1, experts=8, groups=1, topk_group=1, top_k=2, shared=1,
        renorm=True, conv=4, hidden=48, intermediate=80, moe_intermediate=16,
        kda_heads=3, kda_head_dim=16, mla_heads=3, nope=16, rope=8, v=16, kv_lora=24,
        covers=["released-like schedule (KDA,KDA,KDA,MLA, ..., KDA,KDA,MLA)", "layer 0 dense, rest MoE",
                "conv kernel 4", "bf16", "T=170 (3 KDA chunks, last one partial)", "hub schema"],
    ),
    dict(
        name="hub-f32-mla-first", schema="hub", dtype="float32", T=130, seed=1004,
        mixers="MKMK", first_k=1, experts=6, groups=3, topk_group=2, top_k=3, shared=1,
        renorm=True, conv=3, kv_lora=8, nope=10, rope=6, v=12, mla_heads=3,
        hidden=40, intermediate=64, moe_intermediate=16, kda_heads=2, kda_head_dim=12,
        covers=["MLA at layer 0 (dense FFN) and layer 2", "grouped routing: 6 experts, 3 groups, topk_group 2, top_k 3",
                "small kv_lora_rank 8", "f32", "T=130", "hub schema"],
    ),
    dict(
        name="hub-bf16-freq2", schema="hub", dtype="bfloat16", T=133, seed=1005,
        mixers="KKMKK", first_k=1, freq=2, experts=8, groups=2, topk_group=1, top_k=2, shared=1,
        renorm=True, conv=4,
        covers=["moe_layer_freq=2 in a hub config (MoE on layers 2 and 4 only)",
                "groups 2 / topk_group 1", "bf16", "T=133", "hub schema"],
    ),
    dict(
        name="native-bf16-freq2", schema="native", dtype="bfloat16", T=137, seed=1006,
        mixers="MKKMKK", first_k=1, freq=2, experts=8, groups=4, topk_group=2, top_k=2, shared=2,
        renorm=False, conv=4,
        covers=["native schema (layer_types / mlp_layer_types)",
                "mlp_layer_types with a moe_layer_freq=2 pattern (dense,dense,sparse,dense,sparse,dense)",
                "MLA first", "grouped routing 8/4/2, top_k 2", "moe_renormalize off", "2 shared experts",
                "bf16", "T=137"],
    ),
    dict(
        name="native-f32-short", schema="native", dtype="float32", T=37, seed=1007,
        mixers="KMK", first_k=1, experts=4, groups=2, topk_group=1, top_k=2, shared=1,
        renorm=True, conv=5, hidden=32, intermediate=40, moe_intermediate=12,
        kda_heads=2, kda_head_dim=8, mla_heads=2, nope=8, rope=4, v=6, kv_lora=10,
        covers=["native schema", "T=37 (shorter than one KDA chunk)", "f32", "conv kernel 5",
                "4 experts, 2 groups, topk_group 1"],
    ),
]

DEMO = dict(
    name="demo-model", schema="hub", dtype="bfloat16", seed=4242,
    mixers="KKKM", first_k=1, freq=1, vocab=1024, hidden=128, intermediate=256, moe_intermediate=64,
    kda_heads=2, kda_head_dim=64, conv=4, mla_heads=2, nope=32, rope=16, v=32, kv_lora=64,
    experts=8, top_k=2, groups=1, topk_group=1, shared=1, renorm=True, scaling=2.446, eps=1e-5,
    bos=1, eos=2, pad=0,
)


def full_spec(f):
    s = dict(BASE)
    s.update(f)
    n = len(s["mixers"])
    s["layers"] = n
    s["mixer"] = ["kda" if c == "K" else "mla" for c in s["mixers"]]
    s["ffn"] = ["moe" if (i >= s["first_k"] and i % s["freq"] == 0) else "dense" for i in range(n)]
    return s


# --------------------------------------------------------------------------------------------
# Config schemas
# --------------------------------------------------------------------------------------------
def hub_config(s):
    n = s["layers"]
    return {
        "architectures": ["KimiLinearForCausalLM"],
        "model_type": "kimi_linear",
        "vocab_size": s["vocab"],
        "hidden_size": s["hidden"],
        "intermediate_size": s["intermediate"],
        "num_hidden_layers": n,
        "num_attention_heads": s["mla_heads"],
        "num_key_value_heads": s["mla_heads"],
        "head_dim": s["hidden"] // s["mla_heads"],  # legacy, unused by the math (spec §1)
        "hidden_act": "silu",
        "rms_norm_eps": s["eps"],
        "linear_attn_config": {
            "kda_layers": [i + 1 for i in range(n) if s["mixer"][i] == "kda"],
            "full_attn_layers": [i + 1 for i in range(n) if s["mixer"][i] == "mla"],
            "head_dim": s["kda_head_dim"],
            "num_heads": s["kda_heads"],
            "short_conv_kernel_size": s["conv"],
        },
        "mla_use_nope": True,
        "q_lora_rank": None,
        "kv_lora_rank": s["kv_lora"],
        "qk_nope_head_dim": s["nope"],
        "qk_rope_head_dim": s["rope"],
        "v_head_dim": s["v"],
        "first_k_dense_replace": s["first_k"],
        "moe_layer_freq": s["freq"],
        "num_experts": s["experts"],
        "num_experts_per_token": s["top_k"],
        "num_shared_experts": s["shared"],
        "moe_intermediate_size": s["moe_intermediate"],
        "moe_renormalize": s["renorm"],
        "routed_scaling_factor": s["scaling"],
        "num_expert_group": s["groups"],
        "topk_group": s["topk_group"],
        "use_grouped_topk": True,
        "moe_router_activation_func": "sigmoid",
        "bos_token_id": s["bos"],
        "eos_token_id": s["eos"],
        "pad_token_id": s["pad"],
        "tie_word_embeddings": False,
        "torch_dtype": s["dtype"],
    }


HUB_ONLY_KEYS = {
    "architectures", "torch_dtype", "linear_attn_config", "moe_layer_freq", "use_grouped_topk",
    "moe_router_activation_func", "model_type", "transformers_version",
}


def class_fields():
    names = set()
    try:
        names |= {f.name for f in dataclasses.fields(KimiLinearConfig)}
    except Exception:
        pass
    try:
        names |= set(inspect.signature(KimiLinearConfig.__init__).parameters)
    except Exception:
        pass
    return names


def make_config_from_hub(hub):
    kw = {k: v for k, v in hub.items() if k not in ("architectures", "model_type", "torch_dtype")}
    return KimiLinearConfig(**kw)


def make_native_config(s, probe):
    """Native-schema config: explicit layer_types / mlp_layer_types (+ the class's own fields)."""
    fields = class_fields()
    d = probe.to_dict()
    amap = getattr(KimiLinearConfig, "attribute_map", {}) or {}
    allowed = fields | set(amap) | set(amap.values())
    kw = {}
    for k, v in d.items():
        if k in HUB_ONLY_KEYS or (fields and k not in allowed):
            continue
        if k == "first_k_dense_replace" and "mlp_layer_types" in fields:
            continue
        kw[k] = v
    # vocabulary of layer type names used by this transformers version
    lt = list(probe.layer_types)
    full_name = "full_attention"
    lin_names = sorted({x for x in lt if x != full_name})
    lin_name = lin_names[0] if lin_names else "linear_attention"
    kw["layer_types"] = [full_name if m == "mla" else lin_name for m in s["mixer"]]
    if "mlp_layer_types" in fields or hasattr(probe, "mlp_layer_types"):
        kw["mlp_layer_types"] = ["sparse" if f == "moe" else "dense" for f in s["ffn"]]
    for k in ("dtype", "torch_dtype"):
        kw.pop(k, None)
    return KimiLinearConfig(**kw)


# --------------------------------------------------------------------------------------------
# Model structure helpers
# --------------------------------------------------------------------------------------------
def layer_ffn_module(layer):
    for n in ("mlp", "block_sparse_moe", "feed_forward"):
        m = getattr(layer, n, None)
        if m is not None:
            return m
    raise RuntimeError("no ffn module")


def structure(model):
    out = []
    for layer in model.model.layers:
        att = layer.self_attn
        mixer = "mla" if hasattr(att, "kv_a_proj_with_mqa") else "kda"
        ffn_m = layer_ffn_module(layer)
        ffn = "moe" if hasattr(ffn_m, "experts") else "dense"
        out.append((mixer, ffn))
    return out


def expected_hub(s, dtype):
    """name -> (shape, dtype) of the hub layout (spec §2)."""
    D, V = s["hidden"], s["vocab"]
    H, K, W = s["kda_heads"], s["kda_head_dim"], s["conv"]
    nh, nope, rope, vd, kvr = s["mla_heads"], s["nope"], s["rope"], s["v"], s["kv_lora"]
    E, I, S, Id = s["experts"], s["moe_intermediate"], s["shared"], s["intermediate"]
    f32 = "float32"
    e = {
        "model.embed_tokens.weight": ([V, D], dtype),
        "model.norm.weight": ([D], dtype),
        "lm_head.weight": ([V, D], dtype),
    }
    for i in range(s["layers"]):
        p = f"model.layers.{i}."
        e[p + "input_layernorm.weight"] = ([D], dtype)
        e[p + "post_attention_layernorm.weight"] = ([D], dtype)
        a = p + "self_attn."
        if s["mixer"][i] == "kda":
            for x in ("q", "k", "v"):
                e[a + f"{x}_proj.weight"] = ([H * K, D], dtype)
                e[a + f"{x}_conv1d.weight"] = ([H * K, 1, W], dtype)
            e[a + "f_a_proj.weight"] = ([K, D], dtype)
            e[a + "f_b_proj.weight"] = ([H * K, K], dtype)
            e[a + "A_log"] = ([1, 1, H, 1], f32)
            e[a + "dt_bias"] = ([H * K], f32)
            e[a + "b_proj.weight"] = ([H, D], dtype)
            e[a + "g_a_proj.weight"] = ([K, D], dtype)
            e[a + "g_b_proj.weight"] = ([H * K, K], dtype)
            e[a + "o_norm.weight"] = ([K], dtype)
            e[a + "o_proj.weight"] = ([D, H * K], dtype)
        else:
            e[a + "q_proj.weight"] = ([nh * (nope + rope), D], dtype)
            e[a + "kv_a_proj_with_mqa.weight"] = ([kvr + rope, D], dtype)
            e[a + "kv_a_layernorm.weight"] = ([kvr], dtype)
            e[a + "kv_b_proj.weight"] = ([nh * (nope + vd), kvr], dtype)
            e[a + "o_proj.weight"] = ([D, nh * vd], dtype)
        if s["ffn"][i] == "dense":
            e[p + "mlp.gate_proj.weight"] = ([Id, D], dtype)
            e[p + "mlp.up_proj.weight"] = ([Id, D], dtype)
            e[p + "mlp.down_proj.weight"] = ([D, Id], dtype)
        else:
            m = p + "block_sparse_moe."
            e[m + "gate.weight"] = ([E, D], dtype)
            e[m + "gate.e_score_correction_bias"] = ([E], dtype)
            for x in range(E):
                e[m + f"experts.{x}.w1.weight"] = ([I, D], dtype)
                e[m + f"experts.{x}.w3.weight"] = ([I, D], dtype)
                e[m + f"experts.{x}.w2.weight"] = ([D, I], dtype)
            e[m + "shared_experts.gate_proj.weight"] = ([I * S, D], dtype)
            e[m + "shared_experts.up_proj.weight"] = ([I * S, D], dtype)
            e[m + "shared_experts.down_proj.weight"] = ([D, I * S], dtype)
    return e


KDA_RENAME = {
    "forget_gate_down.weight": "f_a_proj.weight",
    "forget_gate_up.weight": "f_b_proj.weight",
    "beta_proj.weight": "b_proj.weight",
    "output_gate_down.weight": "g_a_proj.weight",
    "output_gate_up.weight": "g_b_proj.weight",
    "f_proj.0.weight": "f_a_proj.weight",
    "f_proj.1.weight": "f_b_proj.weight",
    "g_proj.0.weight": "g_a_proj.weight",
    "g_proj.1.weight": "g_b_proj.weight",
    "q_conv1d.weight": "q_conv1d.weight",
}
EXPERT_RENAME = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2", "w1": "w1", "w2": "w2", "w3": "w3"}


def to_hub(sd, s, notes):
    """In-memory (state_dict) names -> hub names, splitting fused tensors."""
    out = {}
    H, K, W = s["kda_heads"], s["kda_head_dim"], s["conv"]
    E, I, D = s["experts"], s["moe_intermediate"], s["hidden"]
    for name, t in sd.items():
        m = re.match(r"model\.layers\.(\d+)\.(.*)$", name)
        if not m:
            out[name] = t
            continue
        i, rest = int(m.group(1)), m.group(2)
        p = f"model.layers.{i}."
        head, _, sub = rest.partition(".")
        if head in ("mlp", "block_sparse_moe", "feed_forward") and s["ffn"][i] == "moe":
            q = p + "block_sparse_moe."
            if sub == "experts.gate_up_proj":
                if list(t.shape) == [E, 2 * I, D]:
                    w1, w3 = t[:, :I, :], t[:, I:, :]
                    notes.add("experts.gate_up_proj [E, 2I, D] (gate rows first) split into w1/w3")
                elif list(t.shape) == [E, D, 2 * I]:
                    w1, w3 = t[:, :, :I].transpose(1, 2), t[:, :, I:].transpose(1, 2)
                    notes.add("experts.gate_up_proj [E, D, 2I] (transposed, gate first) split into w1/w3")
                else:
                    raise RuntimeError(f"unexpected gate_up_proj shape {list(t.shape)}")
                for x in range(E):
                    out[q + f"experts.{x}.w1.weight"] = w1[x].contiguous().clone()
                    out[q + f"experts.{x}.w3.weight"] = w3[x].contiguous().clone()
            elif sub == "experts.down_proj":
                if list(t.shape) == [E, D, I]:
                    w2 = t
                elif list(t.shape) == [E, I, D]:
                    w2 = t.transpose(1, 2)
                    notes.add("experts.down_proj stored transposed [E, I, D]")
                else:
                    raise RuntimeError(f"unexpected down_proj shape {list(t.shape)}")
                for x in range(E):
                    out[q + f"experts.{x}.w2.weight"] = w2[x].contiguous().clone()
            elif re.match(r"experts\.\d+\.\w+\.weight$", sub):
                _, x, kind, _ = sub.split(".")
                out[q + f"experts.{x}.{EXPERT_RENAME[kind]}.weight"] = t
            else:
                out[q + sub] = t
        elif head == "self_attn" and s["mixer"][i] == "kda":
            a = p + "self_attn."
            if sub.startswith("forget_gate."):
                notes.add(f"self_attn.{sub} -> self_attn.{sub[len('forget_gate.'):]} (forget_gate submodule)")
                sub = sub[len("forget_gate."):]
            if sub == "conv1d.weight":
                tt = t if t.dim() == 3 else t.unsqueeze(1)
                qk = H * K
                if tt.shape[0] != 3 * qk:
                    raise RuntimeError(f"unexpected fused conv shape {list(t.shape)}")
                out[a + "q_conv1d.weight"] = tt[:qk].contiguous().clone()
                out[a + "k_conv1d.weight"] = tt[qk:2 * qk].contiguous().clone()
                out[a + "v_conv1d.weight"] = tt[2 * qk:].contiguous().clone()
                notes.add("fused depthwise conv1d [3*H*K,1,W] (q|k|v channel order) split into q/k/v_conv1d")
            elif sub in ("q_conv1d.weight", "k_conv1d.weight", "v_conv1d.weight"):
                out[a + sub] = t if t.dim() == 3 else t.unsqueeze(1)
            elif sub == "A_log":
                if list(t.shape) != [1, 1, H, 1]:
                    notes.add(f"A_log in-memory shape {list(t.shape)} reshaped to [1,1,H,1]")
                out[a + "A_log"] = t.reshape(1, 1, H, 1).contiguous()
            elif sub == "dt_bias":
                if list(t.shape) != [H * K]:
                    notes.add(f"dt_bias in-memory shape {list(t.shape)} reshaped to [H*K]")
                out[a + "dt_bias"] = t.reshape(H * K).contiguous()
            else:
                nn_ = KDA_RENAME.get(sub, sub)
                if nn_ != sub:
                    notes.add(f"renamed self_attn.{sub} -> {nn_}")
                out[a + nn_] = t
        else:
            out[name] = t
    return out


def from_hub(hub, model_sd, s):
    """Hub names -> the in-memory names of `model_sd` (fallback loader; inverse of to_hub)."""
    H, K = s["kda_heads"], s["kda_head_dim"]
    E, I, D = s["experts"], s["moe_intermediate"], s["hidden"]
    inv_kda = {v: k for k, v in KDA_RENAME.items() if k != v}
    out = {}
    for name, ref in model_sd.items():
        m = re.match(r"model\.layers\.(\d+)\.(.*)$", name)
        if not m:
            out[name] = hub[name]
            continue
        i, rest = int(m.group(1)), m.group(2)
        p = f"model.layers.{i}."
        head, _, sub = rest.partition(".")
        if head in ("mlp", "block_sparse_moe", "feed_forward") and s["ffn"][i] == "moe":
            q = p + "block_sparse_moe."
            if sub == "experts.gate_up_proj":
                w = torch.stack([torch.cat([hub[q + f"experts.{x}.w1.weight"], hub[q + f"experts.{x}.w3.weight"]], 0)
                                 for x in range(E)])
                out[name] = w if list(ref.shape) == [E, 2 * I, D] else w.transpose(1, 2).contiguous()
            elif sub == "experts.down_proj":
                w = torch.stack([hub[q + f"experts.{x}.w2.weight"] for x in range(E)])
                out[name] = w if list(ref.shape) == [E, D, I] else w.transpose(1, 2).contiguous()
            elif re.match(r"experts\.\d+\.\w+\.weight$", sub):
                _, x, kind, _ = sub.split(".")
                out[name] = hub[q + f"experts.{x}.{EXPERT_RENAME[kind]}.weight"]
            else:
                out[name] = hub[q + sub]
        elif head == "self_attn" and s["mixer"][i] == "kda":
            a = p + "self_attn."
            if sub.startswith("forget_gate."):
                sub = sub[len("forget_gate."):]
            if sub == "conv1d.weight":
                w = torch.cat([hub[a + f"{x}_conv1d.weight"] for x in "qkv"], 0)
                out[name] = w.reshape(ref.shape)
            elif sub in ("A_log", "dt_bias"):
                out[name] = hub[a + sub].reshape(ref.shape)
            else:
                hn = KDA_RENAME.get(sub, sub)
                out[name] = hub[a + hn].reshape(ref.shape)
        else:
            out[name] = hub[name]
    return out


# --------------------------------------------------------------------------------------------
# Init, save, load
# --------------------------------------------------------------------------------------------
def reinit(model, seed):
    g = torch.Generator().manual_seed(seed)
    desc = {}
    named = dict(model.named_parameters())
    named.update({n: b for n, b in model.named_buffers() if n.endswith("e_score_correction_bias")})
    with torch.no_grad():
        for n in sorted(named):
            t = named[n]
            shp = tuple(t.shape)

            def randn(*sz):
                return torch.randn(sz, generator=g, dtype=torch.float32)

            if n.endswith("A_log"):
                v = torch.empty(shp, dtype=torch.float32).uniform_(0.0, math.log(16.0), generator=g)
                rule = "A_log ~ U(log 1, log 16)"
            elif n.endswith("dt_bias"):
                v = -2.0 + 1.0 * randn(*shp)
                rule = "dt_bias ~ N(-2, 1)"
            elif n.endswith("e_score_correction_bias"):
                v = 0.1 * randn(*shp)
                rule = "e_score_correction_bias ~ N(0, 0.1)"
            elif "conv" in n:
                v = 0.3 * randn(*shp)
                rule = "conv weights ~ N(0, 0.3)"
            elif t.dim() == 1 and "norm" in n:
                v = 1.0 + 0.1 * randn(*shp)
                rule = "norm weights ~ 1 + 0.1 N(0,1)"
            elif n.endswith("embed_tokens.weight"):
                v = randn(*shp)
                rule = "embed_tokens ~ N(0, 1)"
            elif n.endswith("lm_head.weight"):
                v = 0.3 * randn(*shp)
                rule = "lm_head ~ N(0, 0.3)"
            elif t.dim() >= 2:
                fan_in = shp[-1]
                std = min(0.3, max(0.1, 1.0 / math.sqrt(fan_in)))
                if "forget_gate_up" in n or "f_b_proj" in n or "f_proj.1" in n:
                    std *= 0.5
                    rule = "forget-gate up-projection ~ N(0, 0.5*clamp(1/sqrt(fan_in), 0.1, 0.3))"
                else:
                    rule = "other matrices ~ N(0, clamp(1/sqrt(fan_in), 0.1, 0.3))"
                v = std * randn(*shp)
            else:
                v = 0.1 * randn(*shp)
                rule = "other vectors ~ N(0, 0.1)"
            t.copy_(v.to(t.dtype))
            desc[rule] = desc.get(rule, 0) + 1
    return desc


def cast_storage(model, dtype):
    keep = {}
    for n, p in model.named_parameters():
        if n.endswith("A_log") or n.endswith("dt_bias"):
            keep[n] = p.detach().to(torch.float32).clone()
    model.to(dtype)
    named = dict(model.named_parameters())
    for n, v in keep.items():
        named[n].data = v
    return model


def read_safetensors_dir(d):
    tensors, files = {}, []
    for fn in sorted(os.listdir(d)):
        if fn.endswith(".safetensors"):
            files.append(fn)
            with safe_open(os.path.join(d, fn), framework="pt") as f:
                for k in f.keys():
                    tensors[k] = f.get_tensor(k)
    return tensors, files


def dtype_name(t):
    return str(t.dtype).replace("torch.", "")


def check_layout(tensors, exp, dtypes=True):
    problems = []
    names, enames = set(tensors), set(exp)
    for n in sorted(enames - names)[:20]:
        problems.append(f"missing {n}")
    for n in sorted(names - enames)[:20]:
        problems.append(f"extra {n}")
    for n in sorted(names & enames):
        shp, dt = exp[n]
        if list(tensors[n].shape) != shp:
            problems.append(f"shape {n} {list(tensors[n].shape)} != {shp}")
        if dtypes and dtype_name(tensors[n]) != dt:
            problems.append(f"dtype {n} {dtype_name(tensors[n])} != {dt}")
    return problems


def write_weights(tensors, d, shards):
    names = sorted(tensors)
    meta = {"format": "pt"}
    if shards <= 1:
        save_file({k: tensors[k].contiguous() for k in names}, os.path.join(d, "model.safetensors"), metadata=meta)
        return ["model.safetensors"]
    total = sum(tensors[k].numel() * tensors[k].element_size() for k in names)
    per = total / shards
    groups, cur, acc = [], [], 0
    for k in names:
        cur.append(k)
        acc += tensors[k].numel() * tensors[k].element_size()
        if acc >= per * (len(groups) + 1) and len(groups) < shards - 1:
            groups.append(cur)
            cur = []
    groups.append(cur)
    files, wmap = [], {}
    for j, g in enumerate(groups):
        fn = f"model-{j + 1:05d}-of-{len(groups):05d}.safetensors"
        save_file({k: tensors[k].contiguous() for k in g}, os.path.join(d, fn), metadata=meta)
        files.append(fn)
        for k in g:
            wmap[k] = fn
    with open(os.path.join(d, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": wmap}, f, indent=2, sort_keys=True)
    return files + ["model.safetensors.index.json"]


# --------------------------------------------------------------------------------------------
# Instrumentation: which KDA function ran; pure-float64 patch; routing check
# --------------------------------------------------------------------------------------------
KDA_CALLS = []


def install_kda_probes(model):
    if MKL is None:
        return []
    done = []
    for nm in ("chunk_kimi_delta_attention", "recurrent_kimi_delta_attention",
               "torch_chunk_kda", "torch_recurrent_kda", "chunk_kda", "fused_recurrent_kda",
               "fused_chunk_kda", "naive_chunk_kda", "naive_recurrent_kda"):
        fn = getattr(MKL, nm, None)
        if fn is None or getattr(fn, "_kda_probe", False):
            continue

        def wrap(f, label):
            def w(*a, **k):
                KDA_CALLS.append(label + ":" + getattr(f, "__module__", "?") + "." + getattr(f, "__name__", "?"))
                return f(*a, **k)
            w._kda_probe = True
            return w

        setattr(MKL, nm, wrap(fn, nm))
        done.append(nm)
    for mod in model.modules():
        for attr in ("chunk_kda", "recurrent_kda", "fused_recurrent_kda"):
            fn = mod.__dict__.get(attr)
            if callable(fn) and not getattr(fn, "_kda_probe", False):
                def wrap2(f, label):
                    def w(*a, **k):
                        KDA_CALLS.append("attr " + label + ":" + getattr(f, "__name__", "?"))
                        return f(*a, **k)
                    w._kda_probe = True
                    return w
                setattr(mod, attr, wrap2(fn, attr))
    return done


@contextlib.contextmanager
def pure_f64():
    """Turn the port's internal float32 upcasts into float64 (only for tensors already float64)."""
    T = torch.Tensor
    o_to, o_float, o_type = T.to, T.float, T.type
    o_softmax = torch.nn.functional.softmax

    def fix(x):
        return torch.float64 if x is torch.float32 else x

    def to(self, *a, **k):
        if self.dtype == torch.float64:
            a = tuple(fix(x) for x in a)
            k = {kk: fix(vv) for kk, vv in k.items()}
        return o_to(self, *a, **k)

    def flt(self, *a, **k):
        return self if self.dtype == torch.float64 else o_float(self, *a, **k)

    def typ(self, *a, **k):
        if self.dtype == torch.float64 and a and a[0] is torch.float32:
            return self
        return o_type(self, *a, **k)

    def softmax(x, *a, **k):
        if x.dtype == torch.float64 and k.get("dtype") is torch.float32:
            k["dtype"] = torch.float64
        return o_softmax(x, *a, **k)

    T.to, T.float, T.type = to, flt, typ
    torch.nn.functional.softmax = softmax
    try:
        yield
    finally:
        T.to, T.float, T.type = o_to, o_float, o_type
        torch.nn.functional.softmax = o_softmax


def routing_check(model, s):
    for layer in model.model.layers:
        ffn = layer_ffn_module(layer)
        if hasattr(ffn, "experts"):
            gate = ffn.gate
            break
    else:
        return {"checked": False}
    bias = getattr(gate, "e_score_correction_bias")
    W = gate.weight.detach().to(torch.float64)
    x = torch.randn(7, s["hidden"], generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    with torch.no_grad():
        res = gate(x.to(gate.weight.dtype))
    res = res if isinstance(res, (tuple, list)) else (res,)
    idx = [r for r in res if torch.is_tensor(r) and not r.is_floating_point()]
    wts = [r for r in res if torch.is_tensor(r) and r.is_floating_point() and r.shape[-1] == s["top_k"]]
    if (not idx or not wts) and hasattr(ffn, "route_tokens_to_experts"):
        with torch.no_grad():
            rr = ffn.route_tokens_to_experts(res[0])
        res = tuple(rr) + tuple(res)
        idx = [r for r in rr if torch.is_tensor(r) and not r.is_floating_point()]
        wts = [r for r in rr if torch.is_tensor(r) and r.is_floating_point() and r.shape[-1] == s["top_k"]]
    if not idx or not wts:
        return {"checked": False, "why": f"router returned {[tuple(r.shape) for r in res if torch.is_tensor(r)]}"}
    idx, wts = idx[0].reshape(-1, s["top_k"]), wts[0].reshape(-1, s["top_k"]).to(torch.float64)
    sc = torch.sigmoid(x.to(torch.float32) @ W.to(torch.float32).T).to(torch.float64)
    b = bias.detach().to(torch.float64)

    def fin(w):
        if s["renorm"]:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        return w * s["scaling"]

    unb = fin(sc.gather(1, idx))
    bia = fin((sc + b).gather(1, idx))
    # selection check: top-k of biased scores within allowed groups
    d_unb = (unb - wts).abs().max().item()
    d_bia = (bia - wts).abs().max().item()
    return {
        "checked": True,
        "weights": "unbiased sigmoid scores" if d_unb < d_bia else "biased (s + e_score_correction_bias)",
        "max_abs_diff_vs_unbiased_formula": d_unb,
        "max_abs_diff_vs_biased_formula": d_bia,
        "router_returns": [str(tuple(r.shape)) + " " + dtype_name(r) for r in res if torch.is_tensor(r)],
    }


def module_facts(model):
    facts = {}
    for layer in model.model.layers:
        att = layer.self_attn
        if not hasattr(att, "kv_a_proj_with_mqa") and "o_norm" not in facts:
            on = att.o_norm
            fg = getattr(att, "forget_gate", att)
            facts["o_norm"] = {"class": type(on).__name__,
                               "eps": getattr(on, "variance_epsilon", getattr(on, "eps", None)),
                               "activation": getattr(on, "activation", None)}
            facts["A_log_dtype_in_model"] = dtype_name(fg.A_log)
            facts["dt_bias_dtype_in_model"] = dtype_name(fg.dt_bias)
            facts["A_log_shape_in_model"] = list(fg.A_log.shape)
            facts["dt_bias_shape_in_model"] = list(fg.dt_bias.shape)
        if hasattr(att, "kv_a_layernorm") and "kv_a_layernorm_eps" not in facts:
            ln = att.kv_a_layernorm
            facts["kv_a_layernorm_eps"] = getattr(ln, "variance_epsilon", getattr(ln, "eps", None))
            facts["mla_scaling"] = getattr(att, "scaling", None)
        if "input_layernorm_eps" not in facts:
            ln = layer.input_layernorm
            facts["input_layernorm_eps"] = getattr(ln, "variance_epsilon", getattr(ln, "eps", None))
    facts["attn_implementation"] = getattr(model.config, "_attn_implementation", None)
    facts["experts_implementation"] = getattr(model.config, "_experts_implementation", None)
    return facts


# --------------------------------------------------------------------------------------------
# One fixture
# --------------------------------------------------------------------------------------------
def force_eager(model):
    for fn, val in (("set_attn_implementation", "eager"), ("set_experts_implementation", "eager")):
        if hasattr(model, fn):
            try:
                getattr(model, fn)(val)
            except Exception as e:  # noqa
                print(f"  {fn} failed: {e}")
    return model


def build_config(s, log):
    hub = hub_config(s)
    deviations = []
    probe, err = None, None
    try:
        probe = make_config_from_hub(hub)
    except Exception as e:  # noqa
        err = f"{type(e).__name__}: {e}"
        log(f"  hub config rejected by KimiLinearConfig: {err}")
    hub_ok = False
    if probe is not None:
        st = structure(KimiLinearForCausalLM(probe))
        want = list(zip(s["mixer"], s["ffn"]))
        hub_ok = st == want
        if not hub_ok and s["schema"] == "hub":
            deviations.append(
                f"KimiLinearConfig built from the hub config gives schedule {st}, not the hub-rule schedule {want} "
                "(the class ignores moe_layer_freq); the reference model was built from the equivalent native config")
    if probe is None:
        probe = make_config_from_hub({k: v for k, v in hub.items() if k not in ("moe_layer_freq",)})
    native = make_native_config(s, probe)
    st = structure(KimiLinearForCausalLM(native))
    if st != list(zip(s["mixer"], s["ffn"])):
        raise RuntimeError(f"native config cannot express schedule: {st}")
    if s["schema"] == "hub" and hub_ok:
        cfg = probe
    else:
        cfg = native
    return hub, probe, native, cfg, hub_ok, err, deviations


def make_one(s, outdir, log, with_reference=True):
    name = s["name"]
    dt = {"bfloat16": torch.bfloat16, "float32": torch.float32}[s["dtype"]]
    d = os.path.join(outdir, name) if with_reference else outdir
    if os.path.exists(d):
        shutil.rmtree(d)
    os.makedirs(d)
    tmp = tempfile.mkdtemp(prefix="kl_" + name + "_")
    ref = {"name": name, "schema": s["schema"], "weight_dtype": s["dtype"], "seed": s["seed"],
           "covers": s.get("covers", [])}
    deviations = []
    notes = set()

    hub, probe, native, cfg, hub_ok, hub_err, dev = build_config(s, log)
    deviations += dev
    ref["hub_config_loads_directly"] = hub_ok
    if hub_err:
        ref["hub_config_error"] = hub_err

    torch.manual_seed(s["seed"])
    model = KimiLinearForCausalLM(cfg)
    model.eval()
    ref["init"] = reinit(model, s["seed"])
    ref["default_implementations"] = {
        "attn": getattr(model.config, "_attn_implementation", None),
        "experts": getattr(model.config, "_experts_implementation", None)}
    cast_storage(model, dt)
    mem_names = {k: [list(v.shape), dtype_name(v)] for k, v in model.state_dict().items()}
    orig64 = force_eager(copy.deepcopy(model).to(torch.float64))

    # ---- save_pretrained and verify the layout
    shards = s.get("shards", 1)
    sp_dir = os.path.join(tmp, "save_pretrained")
    total_bytes = sum(v.numel() * v.element_size() for v in model.state_dict().values())
    kw = {"safe_serialization": True} if "safe_serialization" in inspect.signature(model.save_pretrained).parameters else {}
    if shards > 1:
        kw["max_shard_size"] = int(total_bytes * 0.6)
    model.save_pretrained(sp_dir, **kw)
    saved, saved_files = read_safetensors_dir(sp_dir)
    exp = expected_hub(s, s["dtype"])
    problems = check_layout(saved, exp, dtypes=False)
    dtype_problems = check_layout(saved, exp) if not problems else []
    conv = to_hub({k: v.detach() for k, v in model.state_dict().items()}, s, notes)
    conv_problems = check_layout(conv, exp)
    ck = {"save_pretrained_files": saved_files, "save_pretrained_tensor_count": len(saved),
          "save_pretrained_layout_problems": problems[:40],
          "in_memory_state_dict": {k: v for k, v in mem_names.items() if not re.search(r"experts\.\d+\.", k)}}
    if not problems:
        ck["layout"] = "hub layout written by transformers save_pretrained (names and shapes verified)"
        agree = all(torch.equal(saved[k], conv[k]) for k in exp) if not conv_problems else False
        ck["own_converter_agrees_with_save_pretrained"] = agree
        final = saved
        if dtype_problems:
            ck["save_pretrained_dtype_problems"] = dtype_problems[:40]
            deviations.append("save_pretrained wrote hub names but unexpected dtypes; tensors re-cast to the "
                              "fixture dtype (A_log/dt_bias f32) and rewritten by this script")
            final = {k: v.to(getattr(torch, exp[k][1])) for k, v in saved.items()}
            problems = ["dtype"]  # forces rewriting below
    else:
        if conv_problems:
            raise RuntimeError(f"{name}: own conversion does not give hub layout: {conv_problems[:10]}")
        common = sorted(set(saved) & set(conv))
        ck["save_pretrained_tensors_equal_to_own_conversion"] = (
            f"{sum(torch.equal(saved[k], conv[k]) for k in common)} of {len(common)} common names equal; "
            f"{len(set(saved) - set(conv))} save_pretrained names not in the hub layout")
        ck["layout"] = "hub layout written by this script (safetensors.save_file) from the in-memory state_dict"
        ck["conversion_steps"] = sorted(notes)
        deviations.append("save_pretrained did not write the hub layout (see checkpoint.save_pretrained_layout_problems); "
                          "tensors were converted to hub names by this script")
        final = conv
    ck["save_pretrained_names_sample"] = sorted(saved)[:12]
    ref["checkpoint"] = ck

    # ---- write weights
    sp_shards = [f for f in saved_files]
    if not problems and not dtype_problems and ((shards <= 1 and sp_shards == ["model.safetensors"]) or (shards > 1 and len(sp_shards) == shards)):
        for fn in os.listdir(sp_dir):
            if fn.endswith(".safetensors") or fn == "model.safetensors.index.json":
                shutil.copy(os.path.join(sp_dir, fn), os.path.join(d, fn))
        files = sorted(f for f in os.listdir(d))
        ck["files_from"] = "copied from save_pretrained output"
    else:
        files = write_weights(final, d, shards)
        ck["files_from"] = "written by this script with safetensors.save_file" + (f" ({shards} shards)" if shards > 1 else "")
    ck["files"] = files
    for fn in os.listdir(d):
        os.chmod(os.path.join(d, fn), 0o644)

    # ---- config.json
    with open(os.path.join(sp_dir, "config.json")) as f:
        sp_cfg = json.load(f)
    if s["schema"] == "hub":
        cfg_json = hub
    else:
        cfg_json = sp_cfg
        if "linear_attn_config" in cfg_json or "moe_layer_freq" in cfg_json:
            deviations.append("native config.json written by save_pretrained also contains hub-schema keys")
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg_json, f, indent=2)
        f.write("\n")
    # native config for reference if needed
    nat_dir = os.path.join(tmp, "native_cfg")
    native.save_pretrained(nat_dir)

    # ---- reload in float64
    load_kw = dict(dtype=torch.float64, attn_implementation="eager", experts_implementation="eager",
                   output_loading_info=True)
    reload = {}
    model64, info = None, None
    src = d
    if s["schema"] == "hub" and not hub_ok:
        # config.json (hub schema) cannot express this model in the class: use the native twin
        alt = os.path.join(tmp, "reload_native")
        os.makedirs(alt)
        shutil.copy(os.path.join(nat_dir, "config.json"), os.path.join(alt, "config.json"))
        for fn in files:
            os.symlink(os.path.abspath(os.path.join(d, fn)), os.path.join(alt, fn))
        src = alt
        reload["config_used"] = "native config equivalent to the hub config.json (same weights)"
    else:
        reload["config_used"] = "the fixture's own config.json"
    try:
        model64, info = KimiLinearForCausalLM.from_pretrained(src, **load_kw)
    except Exception as e:
        reload["from_pretrained_error"] = f"{type(e).__name__}: {e}"[:2000]
        log("  from_pretrained failed: " + reload["from_pretrained_error"][:500])
    if info is not None:
        for k in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs"):
            v = info.get(k, []) if isinstance(info, dict) else getattr(info, k, [])
            reload[k] = sorted(str(x) for x in v)[:40]
    bad = model64 is None or any(reload.get(k) for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    if bad:
        deviations.append("from_pretrained could not load the hub-layout files cleanly; the reference model was "
                          "loaded with this script's hub->in-memory conversion instead")
        model64 = KimiLinearForCausalLM(cfg).to(torch.float64)
        hubt, _ = read_safetensors_dir(d)
        msd = model64.state_dict()
        conv_back = from_hub(hubt, msd, s)
        res = model64.load_state_dict({k: v.to(msd[k].dtype) for k, v in conv_back.items()}, strict=True)
        reload["fallback_load"] = str(res)
        force_eager(model64)
    model64.eval()
    st = structure(model64)
    if st != list(zip(s["mixer"], s["ffn"])):
        raise RuntimeError(f"{name}: reloaded model schedule {st} != intended")
    reload["param_dtypes"] = sorted({dtype_name(p) for p in model64.parameters()})
    ref["reload"] = reload
    ref["module_facts"] = module_facts(model64)
    try:  # does the class keep A_log / dt_bias in fp32 when a bf16 load is asked for?
        mb = KimiLinearForCausalLM.from_pretrained(src, dtype=torch.bfloat16)
        fb = module_facts(mb)
        ref["module_facts"]["A_log_dtype_when_loaded_with_dtype_bf16"] = fb.get("A_log_dtype_in_model")
        ref["module_facts"]["dt_bias_dtype_when_loaded_with_dtype_bf16"] = fb.get("dt_bias_dtype_in_model")
        del mb
    except Exception as e:
        ref["module_facts"]["bf16_load_error"] = f"{type(e).__name__}: {e}"[:300]

    hub_file_dtypes = {}
    for k, v in read_safetensors_dir(d)[0].items():
        kind = k.split(".")[-1] if k.endswith(("A_log", "dt_bias", "e_score_correction_bias")) else "other"
        hub_file_dtypes.setdefault(kind, set()).add(dtype_name(v))
    ck["file_dtypes"] = {k: sorted(v) for k, v in hub_file_dtypes.items()}

    if not with_reference:
        shutil.rmtree(tmp, ignore_errors=True)
        return ref, deviations

    # ---- reference computation
    install_kda_probes(model64)
    T = s["T"]
    rng = np.random.default_rng(s["seed"])
    ids = rng.integers(3, s["vocab"], size=T).astype(np.int64)
    x = torch.tensor(ids)[None]
    KDA_CALLS.clear()
    with torch.no_grad():
        logits = model64(input_ids=x, use_cache=False).logits[0]
    prefill_calls = sorted(set(KDA_CALLS))
    assert logits.dtype == torch.float64, logits.dtype
    L = logits.numpy().astype("<f8")
    np.save(os.path.join(d, "logits.npy"), L)
    with torch.no_grad():
        l_orig = orig64(input_ids=x, use_cache=False).logits[0]
    reload["roundtrip_max_abs_logit_diff_vs_in_memory_model"] = float((l_orig - logits).abs().max())

    KDA_CALLS.clear()
    seq = ids[:GREEDY_PROMPT].tolist()
    new = []
    with torch.no_grad():
        for _ in range(GREEDY_NEW):
            lg = model64(input_ids=torch.tensor(seq)[None], use_cache=False).logits[0, -1]
            top2 = torch.topk(lg, 2).values
            nxt = int(lg.argmax())
            new.append(nxt)
            seq.append(nxt)
    greedy_calls = sorted(set(KDA_CALLS))
    # greedy margin (smallest gap between best and second best over the greedy steps)
    margins = []
    with torch.no_grad():
        lg_all = model64(input_ids=torch.tensor(seq[:-1])[None], use_cache=False).logits[0]
        for j in range(GREEDY_PROMPT - 1, len(seq) - 1):
            t2 = torch.topk(lg_all[j], 2).values
            margins.append(float(t2[0] - t2[1]))
    consistent = [int(lg_all[j].argmax()) for j in range(GREEDY_PROMPT - 1, len(seq) - 1)] == new

    # pure float64 variant: how far the stock reference is from an all-f64 computation
    numerics = {}
    try:
        with pure_f64():
            with torch.no_grad():
                l64 = model64(input_ids=x, use_cache=False).logits[0]
        numerics["pure_f64_max_abs_logit_diff"] = float((l64 - logits).abs().max())
        numerics["pure_f64_same_argmax_rows"] = int((l64.argmax(-1) == logits.argmax(-1)).sum())
    except Exception as e:
        numerics["pure_f64_error"] = f"{type(e).__name__}: {e}"[:500]
    numerics["note"] = ("model dtype float64, but the port upcasts/downcasts to float32 internally (RMSNorm, gated "
                        "o_norm variance, router, KDA gate/beta, torch KDA kernels, eager softmax); "
                        "pure_f64_* measures the effect by forcing those casts to float64")
    numerics["logits_std_mean_over_rows"] = float(L.std(axis=1).mean())
    numerics["logits_abs_max"] = float(np.abs(L).max())
    numerics["distinct_argmax_over_prompt"] = int(len(set(L.argmax(1).tolist())))
    ref["numerics"] = numerics

    try:
        ref["routing"] = routing_check(model64, s)
    except Exception as e:
        ref["routing"] = {"checked": False, "error": f"{type(e).__name__}: {e}"[:500]}

    fla = importlib.util.find_spec("fla") is not None
    ref["kda_path"] = {
        "fla_importable": fla,
        "prefill_functions_called": prefill_calls,
        "greedy_functions_called": greedy_calls,
    }
    ref.update({
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
        "python_version": platform.python_version(),
        "numpy_version": np.__version__,
        "compute": {"dtype": "float64", "device": "cpu", "attn_implementation": "eager",
                    "experts_implementation": "eager", "use_cache": False},
        "layer_schedule": [{"layer": i, "mixer": s["mixer"][i], "ffn": s["ffn"][i]} for i in range(s["layers"])],
        "dims": {k: s[k] for k in ("vocab", "hidden", "intermediate", "moe_intermediate", "kda_heads", "kda_head_dim",
                                   "conv", "mla_heads", "nope", "rope", "v", "kv_lora", "experts", "top_k", "groups",
                                   "topk_group", "shared", "renorm", "scaling", "first_k", "freq", "eps")},
        "T": T,
        "prompt_ids": ids.tolist(),
        "prompt_rule": f"numpy.random.default_rng({s['seed']}).integers(3, {s['vocab']}, size={T})",
        "logits": {"file": "logits.npy", "dtype": "<f8", "shape": [T, s["vocab"]],
                   "definition": "model(prompt_ids).logits[0] (all positions)"},
        "greedy": {"prompt_ids": ids[:GREEDY_PROMPT].tolist(), "new_tokens": new,
                   "method": "argmax of the last position, one full forward pass (no cache) per step",
                   "min_top2_margin": min(margins), "consistent_with_single_pass": consistent},
    })
    ref["deviations"] = deviations
    for fn in os.listdir(d):
        os.chmod(os.path.join(d, fn), 0o644)
    with open(os.path.join(d, "reference.json"), "w") as f:
        json.dump(ref, f, indent=1)
        f.write("\n")
    shutil.rmtree(tmp, ignore_errors=True)
    return ref, deviations


# --------------------------------------------------------------------------------------------
# Inspection dump
# --------------------------------------------------------------------------------------------
def inspect_dump(path, srctar):
    buf = io.StringIO()

    def p(*a):
        print(*a, file=buf)

    p("transformers", transformers.__version__, "torch", torch.__version__, "python", platform.python_version())
    p("fla importable:", importlib.util.find_spec("fla") is not None)
    try:
        p("KimiLinearConfig.__init__", inspect.signature(KimiLinearConfig.__init__))
    except Exception as e:
        p("signature error", e)
    try:
        p("fields:", [(f.name, f.default) for f in dataclasses.fields(KimiLinearConfig)])
    except Exception as e:
        p("fields error", e)
    p("attribute_map:", getattr(KimiLinearConfig, "attribute_map", None))
    try:
        from transformers import conversion_mapping as cm
        m = cm.get_checkpoint_conversion_mapping("kimi_linear")
        p("conversion mapping kimi_linear:")
        for x in (m or []):
            p("   ", repr(x)[:600])
    except Exception as e:
        p("conversion mapping error", e)
    for attr in ("_checkpoint_conversion_mapping", "_keep_in_fp32_modules", "_keep_in_fp32_modules_strict"):
        p(attr, getattr(KimiLinearForCausalLM, attr, None))
    files = []
    if MKL is not None:
        mdir = os.path.dirname(MKL.__file__)
        files = [os.path.join(mdir, f) for f in sorted(os.listdir(mdir)) if f.endswith(".py")]
        try:
            from transformers import conversion_mapping as cm
            files.append(cm.__file__)
        except Exception:
            pass
        pat = re.compile(r"class |def |softplus|l2norm|eps|sigmoid|gather|conv1d|A_log|dt_bias|keep_in_fp32|"
                         r"chunk_kda|recurrent_kda|q_len|_mode|variance|w1|w2|w3|block_sparse_moe|e_score|kimi")
        for fpath in files:
            p(f"==== grep {fpath}")
            with open(fpath) as f:
                for n, line in enumerate(f, 1):
                    if pat.search(line) and (not fpath.endswith("conversion_mapping.py") or "kimi" in line.lower()
                                             or "block_sparse_moe" in line):
                        p(f"{n}: {line.rstrip()}")
        if srctar:
            import tarfile
            with tarfile.open(srctar, "w:gz") as tf:
                for fpath in files:
                    tf.add(fpath, arcname=os.path.basename(fpath))
    text = buf.getvalue()
    if path:
        with open(path, "w") as f:
            f.write(text)
    return text


def demo_tokenizer_ids(d):
    """vocab = n_base + 256 (as the real model: 163584 BPE ranks + 256 = 163840), bos = [BOS],
    eos = <|im_end|> (config eos of the released model), pad = [PAD]."""
    tm, tc = os.path.join(d, "tiktoken.model"), os.path.join(d, "tokenizer_config.json")
    if not (os.path.exists(tm) and os.path.exists(tc)):
        return None
    with open(tm) as f:
        n_base = sum(1 for line in f if line.strip())
    with open(tc) as f:
        cfg = json.load(f)
    ids = {v["content"]: int(k) for k, v in cfg.get("added_tokens_decoder", {}).items()}
    vocab = n_base + 256
    out = {"vocab": vocab, "bos": ids.get("[BOS]", n_base), "eos": ids.get("<|im_end|>", n_base + 2),
           "pad": ids.get("[PAD]", n_base + 255), "n_base": n_base}
    if max(out["bos"], out["eos"], out["pad"]) >= vocab:
        raise RuntimeError(f"demo tokenizer special ids exceed vocab {vocab}: {out}")
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True, help="fixtures directory (e.g. fixtures/kimi-linear)")
    ap.add_argument("--demo-out", help="write the demo model (config.json + model.safetensors) here")
    ap.add_argument("--demo-vocab", type=int, default=None, help="demo vocab size (default 1024)")
    ap.add_argument("--demo-tokenizer", default="assets/demo-tokenizer",
                    help="read the demo vocab size / special ids from this tokenizer folder if it exists")
    ap.add_argument("--demo-bos", type=int, default=None)
    ap.add_argument("--demo-eos", type=int, default=None)
    ap.add_argument("--inspect", help="write a dump of the installed transformers kimi_linear source facts here")
    ap.add_argument("--src-tar", help="tar.gz of the installed kimi_linear sources")
    ap.add_argument("--only", help="comma-separated fixture names")
    args = ap.parse_args()
    torch.set_num_threads(min(8, os.cpu_count() or 1))

    def log(*a):
        print(*a, flush=True)

    if args.inspect or args.src_tar:
        txt = inspect_dump(args.inspect, args.src_tar)
        log(txt[:6000])
    os.makedirs(args.out, exist_ok=True)
    summary, errors = [], []
    for f in FIXTURES:
        if args.only and f["name"] not in args.only.split(","):
            continue
        s = full_spec(f)
        log(f"== {s['name']}")
        try:
            ref, dev = make_one(s, args.out, log)
            d = os.path.join(args.out, s["name"])
            size = sum(os.path.getsize(os.path.join(d, x)) for x in os.listdir(d))
            summary.append((s["name"], s["mixers"], "".join("M" if x == "moe" else "D" for x in s["ffn"]), s["schema"],
                            s["dtype"], s["T"], size, ref["checkpoint"]["layout"][:40], ref["reload"].get("config_used", "")[:20],
                            ref["reload"].get("roundtrip_max_abs_logit_diff_vs_in_memory_model"),
                            ref["numerics"].get("pure_f64_max_abs_logit_diff"), ref["routing"].get("weights"),
                            ref["kda_path"]["prefill_functions_called"], ref["greedy"]["min_top2_margin"], dev))
        except Exception as e:
            errors.append((s["name"], traceback.format_exc()))
            log(traceback.format_exc())
    if args.demo_out:
        s = dict(DEMO)
        tok = demo_tokenizer_ids(args.demo_tokenizer)
        if tok:
            s.update(tok)
            log(f"  demo vocab/special ids from {args.demo_tokenizer}: {tok}")
        else:
            log(f"  {args.demo_tokenizer} not found: demo vocab {s['vocab']}")
        if args.demo_vocab:
            s["vocab"] = args.demo_vocab
        if args.demo_bos is not None:
            s["bos"] = args.demo_bos
        if args.demo_eos is not None:
            s["eos"] = args.demo_eos
        s = full_spec(s)
        log("== demo")
        try:
            ref, dev = make_one(s, args.demo_out, log, with_reference=False)
            for fn in os.listdir(args.demo_out):
                log(f"  demo file {fn} {os.path.getsize(os.path.join(args.demo_out, fn))}")
            log("  demo checkpoint:", json.dumps(ref["checkpoint"])[:800])
            log("  demo reload:", json.dumps(ref["reload"])[:800])
            log("  demo deviations:", dev)
        except Exception:
            errors.append(("demo", traceback.format_exc()))
            log(traceback.format_exc())
    log("\n==== SUMMARY")
    for row in summary:
        log(" | ".join(str(x) for x in row))
    for n, tb in errors:
        log(f"ERROR {n}: {tb[-1500:]}")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
