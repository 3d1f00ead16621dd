#!/usr/bin/env python3
"""Make tiny random Kimi K3 checkpoints in the released layout, plus float64 reference logits.

Each fixture under fixtures/kimi-k3/<name>/ is a K3 checkpoint as the real one is laid out
(shared/docs/kimi-k3-spec.md sections 1-2): the KimiK3ForConditionalGeneration wrapper config
with a nested kimi_linear `text_config` (and its nested `quantization_config`), sharded
safetensors under `language_model.` with a `model.safetensors.index.json`, BF16 non-expert
weights, F32 A_log / dt_bias / router bias, MXFP4 routed experts (U8 codes + U8 E8M0 scales),
and a few `vision_tower.*` / `mm_projector.*` tensors that a text engine must skip.

Written per fixture:
  config.json, model-0000k-of-0000N.safetensors, model.safetensors.index.json
  tiktoken.model, tokenizer_config.json     copied from assets/demo-tokenizer-k3/
  logits.npy        float64 [T, vocab] from scripts/k3_reference.py (reading the files back)
  reference.json    prompt, greedy continuation, what the fixture covers, mlx-lm agreement

Everything is deterministic (numpy Generator with a fixed seed per fixture; the safetensors
library's own writer). Needs numpy + safetensors; the mlx-lm cross-check (check_k3_mlx.py) runs
when mlx and mlx-lm are importable and is skipped (and recorded as skipped) otherwise.

Run from the repository root:
    python3 scripts/make_k3_fixtures.py [--out fixtures/kimi-k3] [--only NAME] [--no-mlx]
"""

import argparse
import json
import os
import platform
import shutil
import struct
import sys
import time

import numpy as np
import safetensors
from safetensors import TensorSpec, serialize_file

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import k3_reference  # noqa: E402
from k3_reference import K3Reference, test_mxfp4_decode  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOKENIZER_DIR = os.path.join(ROOT, "assets", "demo-tokenizer-k3")

# Tiny tokenizer ids (assets/demo-tokenizer-k3: n_base 956 + K3 offsets).
N_BASE = 956
VOCAB = 1212
BOS, EOS, PAD, MEDIA_PAD = N_BASE + 0, N_BASE + 2, N_BASE + 255, N_BASE + 21

GREEDY_PROMPT = 12
GREEDY_NEW = 16

# ---------------------------------------------------------------------------------------------
# Fixture definitions. schedule: one letter per layer, "K" = KDA, "M" = MLA (0-based order).
# Layer 0 is dense (first_k_dense_replace 1), every other layer is LatentMoE.
# MXFP4 needs the expert input widths (latent for w1/w3, moe_intermediate for w2) to be
# multiples of 32; where one of them is 64 the decode has to index more than one scale per row.
# ---------------------------------------------------------------------------------------------
FIXTURES = [
    dict(
        name="k3-tiny-7l", seed=3001, T=80, shards=2,
        schedule="KKKMKMM", block=3,
        hidden=48, kda_heads=2, kda_head_dim=16, a_log_len=16,
        mla_heads=2, q_lora=24, kv_lora=32, nope=16, rope=8, v_head=16,
        experts=8, top_k=3, moe_inter=64, latent=32, shared=2, dense_inter=96,
        conv_dtype="F32", o_norm_dtype="F32",
        covers=[
            "released-like schedule K K K M K M M (1-based kda_layers [1,2,3,5], full_attn_layers [4,6,7]); "
            "the last two layers are both MLA",
            "layer 0 KDA + dense SiTU MLP, layers 1-6 LatentMoE",
            "Block AttnRes block size 3: blocks stored at layers 0 (embedding), 3, 6; "
            "the final mix has 4 sources and layer 6 starts a new block",
            "KDA 2 heads x 16, A_log stored [16] (2 used, 14 zero padding), conv [32,1,4] F32, o_norm F32",
            "MLA q-LoRA 24, kv_lora 32, nope 16 + rope 8 (unrotated), v 16, output gate",
            "8 experts top-3, sigmoid router, e_score_correction_bias changes some selections",
            "LatentMoE latent 32 (< hidden 48), expert width 64: w2 rows hold 2 MXFP4 scale blocks",
            "2 shared experts fused as one 128-wide MLP",
            "2 shards, embedding + lm_head in the last shard, vision tensors skipped",
            "T=80 (more than one 64-token KDA chunk)",
        ],
    ),
    dict(
        name="k3-tiny-5l-b2", seed=3002, T=40, shards=3,
        schedule="MKKMK", block=2,
        hidden=80, kda_heads=3, kda_head_dim=16, a_log_len=16,
        mla_heads=3, q_lora=16, kv_lora=24, nope=8, rope=8, v_head=12,
        experts=8, top_k=4, moe_inter=32, latent=64, shared=1, dense_inter=64,
        conv_dtype="BF16", o_norm_dtype="BF16",
        covers=[
            "schedule M K K M K (1-based kda_layers [2,3,5], full_attn_layers [1,4]): MLA on layer 0 "
            "(with the dense MLP), KDA last",
            "Block AttnRes block size 2: blocks at layers 0, 2, 4; the last layer starts a block, "
            "final mix has 4 sources",
            "KDA 3 heads x 16, A_log stored [16] (3 used, 13 zero padding), conv BF16, o_norm BF16",
            "MLA 3 heads, q-LoRA 16, kv_lora 24, nope 8 + rope 8, v 12 (v != nope)",
            "8 experts top-4; LatentMoE latent 64 (< hidden 80), expert width 32: w1/w3 rows hold "
            "2 MXFP4 scale blocks",
            "1 shared expert (32 wide)",
            "3 shards, embedding + lm_head in the last shard",
            "T=40 (shorter than one KDA chunk)",
        ],
    ),
]

QUANTIZATION_CONFIG = {
    "quant_method": "compressed-tensors",
    "format": "mxfp4-pack-quantized",
    "quantization_status": "compressed",
    "config_groups": {
        "group_0": {
            "format": "mxfp4-pack-quantized",
            "targets": ["Linear"],
            "input_activations": None,
            "weights": {
                "num_bits": 4,
                "type": "float",
                "symmetric": True,
                "group_size": 32,
                "strategy": "group",
                "scale_dtype": "torch.uint8",
                "dynamic": False,
                "actorder": None,
                "block_structure": None,
            },
        }
    },
    "ignore": [
        "re:.*self_attn.*",
        "re:.*shared_experts.*",
        r"re:.*mlp\.(gate|up|gate_up|down)_proj.*",
        "re:.*lm_head.*",
        "re:.*vision_tower.*",
        "re:.*mm_projector.*",
    ],
}


def make_config(s):
    n = len(s["schedule"])
    text = {
        "architectures": ["KimiLinearForCausalLM"],
        "model_type": "kimi_linear",
        "dtype": "bfloat16",
        "vocab_size": VOCAB,
        "hidden_size": s["hidden"],
        "num_hidden_layers": n,
        "num_attention_heads": s["mla_heads"],
        "num_key_value_heads": s["mla_heads"],
        "intermediate_size": s["dense_inter"],
        "first_k_dense_replace": 1,
        "moe_layer_freq": 1,
        "hidden_act": "situ",
        "activation_situ_beta": 4.0,
        "activation_situ_linear_beta": 25.0,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 4096,
        "mla_use_nope": True,
        "mla_use_output_gate": True,
        "q_lora_rank": s["q_lora"],
        "kv_lora_rank": s["kv_lora"],
        "qk_nope_head_dim": s["nope"],
        "qk_rope_head_dim": s["rope"],
        "v_head_dim": s["v_head"],
        "linear_attn_config": {
            "num_heads": s["kda_heads"],
            "head_dim": s["kda_head_dim"],
            "short_conv_kernel_size": 4,
            "gate_lower_bound": -5.0,
            "use_full_rank_gate": True,
            "kda_layers": [i + 1 for i, c in enumerate(s["schedule"]) if c == "K"],
            "full_attn_layers": [i + 1 for i, c in enumerate(s["schedule"]) if c == "M"],
        },
        "num_experts": s["experts"],
        "num_experts_per_token": s["top_k"],
        "num_shared_experts": s["shared"],
        "moe_intermediate_size": s["moe_inter"],
        "routed_expert_hidden_size": s["latent"],
        "latent_moe_use_norm": True,
        "moe_router_activation_func": "sigmoid",
        "moe_renormalize": True,
        "routed_scaling_factor": 1.0,
        "use_grouped_topk": True,
        "num_expert_group": 1,
        "topk_group": 1,
        "topk_method": "noaux_tc",
        "attn_res_block_size": s["block"],
        "num_nextn_predict_layers": 0,
        "tie_word_embeddings": False,
        "eos_token_id": EOS,
        "quantization_config": QUANTIZATION_CONFIG,
    }
    vision = {
        "patch_size": 14,
        "vt_hidden_size": 32,
        "vt_num_hidden_layers": 1,
        "vt_num_attention_heads": 2,
        "vt_intermediate_size": 64,
        "merge_kernel_size": [2, 2],
        "mm_projector_type": "patchmergerv2",
        "merge_type": "sd2_tpool",
        "pos_emb_type": "divided_fixed",
        "text_hidden_size": s["hidden"],
    }
    return {
        "architectures": ["KimiK3ForConditionalGeneration"],
        "model_type": "kimi_k3",
        "bos_token_id": BOS,
        "eos_token_id": EOS,
        "pad_token_id": PAD,
        "media_placeholder_token_id": MEDIA_PAD,
        "image_placeholder": "<|kimi_image_placeholder|>",
        "tie_word_embeddings": False,
        "text_config": text,
        "vision_config": vision,
    }


# ---------------------------------------------------------------------------------------------
# Random weights
# ---------------------------------------------------------------------------------------------

def to_bf16_bits(x):
    """float32 -> bfloat16 bit patterns (uint16), round to nearest even (no NaNs here)."""
    b = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    return ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).astype(np.uint16)


def pack_mxfp4(codes):
    """codes int [out, in] (0..15) -> U8 [out, in/2], even column in the low nibble."""
    codes = codes.astype(np.uint8)
    return (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)


class Builder:
    """Collects tensors {full name: (safetensors dtype, raw array)} with a recorded init rule."""

    def __init__(self, seed):
        self.rng = np.random.default_rng(seed)
        self.t = {}
        self.rules = {}

    def put(self, name, dtype, values, rule):
        if dtype == "BF16":
            raw = to_bf16_bits(values)
        elif dtype == "F32":
            raw = np.ascontiguousarray(values, dtype=np.float32)
        else:
            raw = np.ascontiguousarray(values, dtype=np.uint8)
        assert name not in self.t, name
        self.t[name] = (dtype, raw)
        self.rules[rule] = self.rules.get(rule, 0) + 1

    def matrix(self, name, out, inp, dtype="BF16", factor=1.0):
        std = factor * min(max(1.0 / np.sqrt(inp), 0.1), 0.3)
        rule = "matrices ~ N(0, clamp(1/sqrt(fan_in), 0.1, 0.3))" if factor == 1.0 else \
            f"matrices ~ N(0, {factor} * clamp(1/sqrt(fan_in), 0.1, 0.3))"
        self.put(name, dtype, self.rng.normal(0.0, std, (out, inp)), rule)

    def norm(self, name, n, dtype="BF16"):
        self.put(name, dtype, 1.0 + 0.1 * self.rng.normal(size=n), "norm weights ~ 1 + 0.1 N(0,1)")

    def normal(self, name, shape, std, dtype, rule, mean=0.0):
        self.put(name, dtype, self.rng.normal(mean, std, shape), rule)

    def mxfp4(self, name, out, inp, force_neg_zero=False):
        codes = self.rng.integers(0, 16, (out, inp))
        if force_neg_zero:
            codes[0, 0] = 0x8          # make sure the file holds a negative-zero code
        scale = self.rng.integers(127 - 5, 127 - 1, (out, inp // 32))   # 122..125: 2^-5 .. 2^-2
        self.put(name + ".weight_packed", "U8", pack_mxfp4(codes), "MXFP4 codes ~ U{0..15}")
        self.put(name + ".weight_scale", "U8", scale, "E8M0 scales ~ U{122..125}")


def build_tensors(s):
    b = Builder(s["seed"])
    H = s["hidden"]
    lm = "language_model.model."
    attn_res_std = 3.0 / np.sqrt(H)
    for L, kind in enumerate(s["schedule"]):
        pre = f"{lm}layers.{L}."
        b.norm(pre + "input_layernorm.weight", H)
        b.norm(pre + "post_attention_layernorm.weight", H)
        for r in ("self_attention_res", "mlp_res"):
            b.norm(pre + r + "_norm.weight", H)
            b.normal(pre + r + "_proj.weight", (1, H), attn_res_std, "BF16",
                     "AttnRes proj ~ N(0, 3/sqrt(hidden))")
        a = pre + "self_attn."
        if kind == "K":
            nh, D = s["kda_heads"], s["kda_head_dim"]
            P = nh * D
            for p in "qkv":
                b.matrix(a + f"{p}_proj.weight", P, H)
            for p in "qkv":
                b.normal(a + f"{p}_conv1d.weight", (P, 1, 4), 0.3, s["conv_dtype"], "conv ~ N(0, 0.3)")
            b.matrix(a + "f_a_proj.weight", D, H)
            b.matrix(a + "f_b_proj.weight", P, D, factor=0.5)
            b.matrix(a + "b_proj.weight", nh, H)
            b.matrix(a + "g_proj.weight", P, H)
            b.normal(a + "dt_bias", (P,), 1.0, "F32", "dt_bias ~ N(-2, 1)", mean=-2.0)
            a_log = np.zeros(s["a_log_len"])
            a_log[:nh] = b.rng.uniform(0.0, np.log(16.0), nh)
            b.put(a + "A_log", "F32", a_log, "A_log[:num_heads] ~ U(log 1, log 16), rest 0")
            b.norm(a + "o_norm.weight", D, s["o_norm_dtype"])
            b.matrix(a + "o_proj.weight", H, P)
        else:
            nh, dn, dr, dv = s["mla_heads"], s["nope"], s["rope"], s["v_head"]
            b.matrix(a + "q_a_proj.weight", s["q_lora"], H)
            b.norm(a + "q_a_layernorm.weight", s["q_lora"])
            b.matrix(a + "q_b_proj.weight", nh * (dn + dr), s["q_lora"])
            b.matrix(a + "kv_a_proj_with_mqa.weight", s["kv_lora"] + dr, H)
            b.norm(a + "kv_a_layernorm.weight", s["kv_lora"])
            b.matrix(a + "kv_b_proj.weight", nh * (dn + dv), s["kv_lora"])
            b.matrix(a + "g_proj.weight", nh * dv, H)
            b.matrix(a + "o_proj.weight", H, nh * dv)
        if L == 0:
            m = pre + "mlp."
            b.matrix(m + "gate_proj.weight", s["dense_inter"], H)
            b.matrix(m + "up_proj.weight", s["dense_inter"], H)
            b.matrix(m + "down_proj.weight", H, s["dense_inter"])
        else:
            m = pre + "block_sparse_moe."
            E, Z, I = s["experts"], s["latent"], s["moe_inter"]
            b.matrix(m + "gate.weight", E, H)
            b.normal(m + "gate.e_score_correction_bias", (E,), 0.1, "F32",
                     "e_score_correction_bias ~ N(0, 0.1)")
            b.matrix(m + "routed_expert_down_proj.weight", Z, H)
            b.norm(m + "routed_expert_norm.weight", Z)
            b.matrix(m + "routed_expert_up_proj.weight", H, Z)
            SW = s["shared"] * I
            b.matrix(m + "shared_experts.gate_proj.weight", SW, H)
            b.matrix(m + "shared_experts.up_proj.weight", SW, H)
            b.matrix(m + "shared_experts.down_proj.weight", H, SW)
            for e in range(E):
                x = f"{m}experts.{e}."
                b.mxfp4(x + "w1", I, Z, force_neg_zero=(L == 1 and e == 0))
                b.mxfp4(x + "w2", Z, I)
                b.mxfp4(x + "w3", I, Z)
    b.normal(lm + "embed_tokens.weight", (VOCAB, H), 1.0, "BF16", "embed_tokens ~ N(0, 1)")
    b.norm(lm + "norm.weight", H)
    b.norm(lm + "output_attn_res_norm.weight", H)
    b.normal(lm + "output_attn_res_proj.weight", (1, H), attn_res_std, "BF16",
             "AttnRes proj ~ N(0, 3/sqrt(hidden))")
    b.normal("language_model.lm_head.weight", (VOCAB, H), 0.3, "BF16", "lm_head ~ N(0, 0.3)")
    # Placeholders for the vision side (names as in the real repo's prefixes; shapes made up).
    b.normal("vision_tower.patch_embed.proj.bias", (32,), 0.1, "BF16", "vision placeholders ~ N(0, 0.1)")
    b.normal("vision_tower.encoder.final_layernorm.weight", (32,), 0.1, "BF16", "vision placeholders ~ N(0, 0.1)")
    b.normal("mm_projector.proj.0.weight", (H, 4 * 32), 0.1, "BF16", "vision placeholders ~ N(0, 0.1)")
    b.normal("mm_projector.proj.2.weight", (H, H), 0.1, "BF16", "vision placeholders ~ N(0, 0.1)")
    return b.t, b.rules


# ---------------------------------------------------------------------------------------------
# Writing
# ---------------------------------------------------------------------------------------------

ST_DTYPE = {"BF16": "bfloat16", "F32": "float32", "U8": "uint8"}


def shard_of(name, n_layers, n_shards):
    """Layers are split evenly over the shards; vision goes first; globals go in the last one."""
    if name.startswith(("vision_tower.", "mm_projector.")):
        return 0
    marker = "model.layers."
    if marker in name:
        L = int(name.split(marker)[1].split(".")[0])
        return L * n_shards // n_layers if n_shards > 1 else 0
    return n_shards - 1


def write_shards(tensors, d, n_layers, n_shards):
    """safetensors shards + index. Returns the tensor order each shard was written in."""
    groups = [dict() for _ in range(n_shards)]
    for name, v in tensors.items():
        groups[shard_of(name, n_layers, n_shards)][name] = v
    weight_map, total, layouts = {}, 0, {}
    for k, g in enumerate(groups):
        fn = f"model-{k + 1:05d}-of-{n_shards:05d}.safetensors"
        specs = {name: TensorSpec(dtype=ST_DTYPE[dt], shape=list(raw.shape), data_ptr=raw.ctypes.data,
                                  data_len=raw.nbytes)
                 for name, (dt, raw) in g.items()}
        serialize_file(specs, os.path.join(d, fn), metadata={"format": "pt"})
        os.chmod(os.path.join(d, fn), 0o644)   # the writer creates 0600 files
        for name, (_, raw) in g.items():
            weight_map[name] = fn
            total += raw.nbytes
        layouts[fn] = data_order(os.path.join(d, fn))
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    with open(os.path.join(d, "model.safetensors.index.json"), "w") as f:
        json.dump(index, f, indent=2)
        f.write("\n")
    return layouts


def data_order(path):
    """[(name, dtype, begin, end)] of a safetensors file in data-offset order."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return sorted(((k, v["dtype"], *v["data_offsets"]) for k, v in header.items()), key=lambda r: r[2])


def expert_layout_check(layouts):
    """Checks that each expert's six tensors sit back to back, in the order w1p,w1s,w2p,w2s,w3p,w3s."""
    want = ["w1.weight_packed", "w1.weight_scale", "w2.weight_packed", "w2.weight_scale",
            "w3.weight_packed", "w3.weight_scale"]
    experts, ok = {}, True
    for fn, rows in layouts.items():
        for i, (name, _, begin, end) in enumerate(rows):
            if ".experts." in name:
                head, tail = name.split(".experts.")
                e, rest = tail.split(".", 1)
                experts.setdefault((fn, head, int(e)), []).append((rest, begin, end))
    for key, parts in experts.items():
        names = [p[0] for p in parts]
        contiguous = all(parts[i][2] == parts[i + 1][1] for i in range(len(parts) - 1))
        ok &= names == want and contiguous
    return {"experts": len(experts), "all_back_to_back_in_w1p_w1s_w2p_w2s_w3p_w3s_order": bool(ok)}


# ---------------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------------

def versions():
    v = {"python": platform.python_version(), "numpy": np.__version__, "safetensors": safetensors.__version__}
    try:
        import mlx.core as mx
        import mlx_lm
        v["mlx"] = mx.__version__
        v["mlx_lm"] = mlx_lm.__version__
    except Exception:
        pass
    return v


def make_one(s, out, use_mlx, log):
    t0 = time.time()
    d = os.path.join(out, s["name"])
    if os.path.isdir(d):
        shutil.rmtree(d)
    os.makedirs(d)
    config = make_config(s)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
        f.write("\n")
    tensors, rules = build_tensors(s)
    layouts = write_shards(tensors, d, len(s["schedule"]), s["shards"])
    for fn in ("tiktoken.model", "tokenizer_config.json"):
        shutil.copyfile(os.path.join(TOKENIZER_DIR, fn), os.path.join(d, fn))

    # Reference: read the directory back (so it computes on exactly the stored values).
    ref = K3Reference.load(d)
    assert len(ref.skipped) == 4 and not ref.warnings, (ref.skipped, ref.warnings)
    prompt = [int(i) for i in np.random.default_rng(s["seed"] + 7).integers(0, N_BASE, s["T"])]
    stats = {}
    logits = ref.forward(prompt, stats)
    np.save(os.path.join(d, "logits.npy"), logits.astype(np.float64))
    greedy_prompt = prompt[:GREEDY_PROMPT]
    new, margin = ref.greedy(greedy_prompt, GREEDY_NEW)
    t_ref = time.time() - t0

    routing = stats["routing"]
    n_sel = sum(idx.shape[0] for _, idx, _ in routing)
    ref_stats = {
        "min_routing_margin": float(min(np.min(m) for _, _, m in routing)),
        "tokens_x_moe_layers": n_sel,
        "token_layer_selections_changed_by_correction_bias": int(sum(np.sum(c) for c in stats["bias_changed"])),
        "experts_used_per_moe_layer": {str(L): sorted(set(int(e) for e in idx.ravel())) for L, idx, _ in routing},
        "attn_res_mean_max_weight": float(np.mean(stats["attn_res_max_weight"])),
        "final_attn_res_sources": stats["final_sources"],
        "logits_std": float(np.std(logits)),
        "min_top2_margin_prompt": float(np.min(np.diff(np.sort(logits, axis=-1)[:, -2:], axis=-1))),
    }
    file_bytes = {fn: os.path.getsize(os.path.join(d, fn)) for fn in sorted(os.listdir(d))}
    reference = {
        "name": s["name"],
        "seed": s["seed"],
        "prompt_ids": prompt,
        "greedy": {"prompt_ids": greedy_prompt, "new_tokens": new, "min_top2_margin": margin,
                   "contains_eos": EOS in new, "contains_special": any(t >= N_BASE for t in new)},
        "covers": s["covers"],
        "dims": {k: v for k, v in s.items() if k not in ("covers", "name")},
        "stored_dtypes": {
            "non-expert weights": "BF16", "A_log": "F32", "dt_bias": "F32",
            "e_score_correction_bias": "F32", "q/k/v_conv1d": s["conv_dtype"], "o_norm": s["o_norm_dtype"],
            "experts.*.w{1,2,3}": "U8 weight_packed [out, in/2] + U8 weight_scale [out, in/32]",
        },
        "init": rules,
        "reference_stats": ref_stats,
        "safetensors_expert_order": expert_layout_check(layouts),
        "safetensors_data_order_first_shard_head": [r[:2] for r in layouts[sorted(layouts)[0]][:12]],
        "file_bytes": file_bytes,
        "total_bytes": sum(file_bytes.values()),
        "reference": "scripts/k3_reference.py (float64 NumPy, token-by-token KDA recurrence)",
        "versions": versions(),
    }
    if use_mlx:
        try:
            import check_k3_mlx
            reference["mlx"] = check_k3_mlx.compare(d, prompt, logits, greedy_prompt, new)
        except ImportError as exc:
            reference["mlx"] = {"skipped": f"mlx / mlx-lm not importable: {exc}"}
    else:
        reference["mlx"] = {"skipped": "--no-mlx"}
    with open(os.path.join(d, "reference.json"), "w") as f:
        json.dump(reference, f, indent=1)
        f.write("\n")
    log(f"{s['name']}: {reference['total_bytes']} bytes, reference {t_ref:.1f} s, total {time.time() - t0:.1f} s; "
        f"greedy {new}; routing margin {ref_stats['min_routing_margin']:.3g}; "
        f"bias changed {ref_stats['token_layer_selections_changed_by_correction_bias']}/{n_sel} token-layer selections; "
        f"mlx {json.dumps(reference['mlx'])}")
    return reference


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.path.join(ROOT, "fixtures", "kimi-k3"))
    ap.add_argument("--only", help="make only this fixture")
    ap.add_argument("--no-mlx", action="store_true", help="skip the mlx-lm cross-check")
    args = ap.parse_args()
    test_mxfp4_decode()
    print("MXFP4 decode self-test: ok")
    os.makedirs(args.out, exist_ok=True)
    for s in FIXTURES:
        if args.only and s["name"] != args.only:
            continue
        make_one(s, args.out, not args.no_mlx, print)


if __name__ == "__main__":
    main()
