#!/usr/bin/env python3
"""Checks a Kimi K3 GGUF written by `kimi-infer convert` with llama.cpp's own `gguf` package
(gguf-py, pinned in scripts/check_gguf_kimi.sh), independently of kimi-infer's reader:

* metadata: `general.architecture == kimi-k3` and the `kimi-k3.*` keys llama.cpp's
  `src/models/kimi-k3.cpp` reads (its four required K3 keys included: expert_latent_length,
  attn_res.block_size, activation.situ_beta, activation.situ_linear_beta), with their types;
* tensors: exactly the names and ggml `ne` of `kimi-k3.cpp`'s `load_arch_tensors` (gguf-py
  0.19 has no kimi-k3 table, so they are written out here): folded AttnRes scores, the
  full-rank `ssm_g`, `ssm_a` as `[heads]`, the MLA `attn_gate`, `ffn_routed_{down,norm,up}`
  and latent-width experts; routed experts MXFP4, the converter's F32 rules elsewhere;
* values (with `--checkpoint DIR`): every tensor dequantized by gguf-py (its own MXFP4
  decoder) against the safetensors checkpoint transformed as llama.cpp's converter does
  (the MXFP4 planes decoded here with numpy: codes low nibble first, E8M0 scales), experts
  exactly, the rest within the type's tolerance.

Usage: check_gguf_k3.py FILE.gguf [--checkpoint DIR]
"""
import argparse
import json
import struct
import sys
from pathlib import Path

import numpy as np
import gguf
from gguf import GGUFReader, GGUFValueType as VT, GGMLQuantizationType as QT

sys.path.insert(0, str(Path(__file__).resolve().parent))
import check_gguf_kimi as kimi  # noqa: E402  (shared metadata helpers and tolerances)

A = "kimi-k3"
E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float64)


def check_metadata(reader):
    key = lambda k: f"{A}.{k}"
    arch = kimi.check_key(reader, gguf.Keys.General.ARCHITECTURE, [VT.STRING])
    if arch != A:
        kimi.fail(f"general.architecture is {arch!r}, expected {A!r}")
    u32, f32 = [VT.UINT32], [VT.FLOAT32]
    hp = {}
    for name, k, types, req in [
        ("n_layer", "block_count", u32, True),
        ("n_embd", "embedding_length", u32, True),
        ("n_ff", "feed_forward_length", u32, True),
        ("n_head", "attention.head_count", [VT.UINT32, VT.ARRAY], True),
        ("n_head_kv", "attention.head_count_kv", [VT.ARRAY], True),
        ("eps", "attention.layer_norm_rms_epsilon", f32, True),
        ("n_vocab", "vocab_size", u32, True),
        ("d_conv", "ssm.conv_kernel", u32, True),
        ("kda_head", "kda.head_dim", u32, True),
        ("lower_bound", "kda.gate_lower_bound", f32, False),
        ("q_lora", "attention.q_lora_rank", u32, False),
        ("kv_lora", "attention.kv_lora_rank", u32, True),
        ("n_rot", "rope.dimension_count", u32, True),
        ("k_mla", "attention.key_length_mla", u32, True),
        ("v_mla", "attention.value_length_mla", u32, True),
        ("n_expert", "expert_count", u32, True),
        ("n_expert_used", "expert_used_count", u32, True),
        ("n_ff_exp", "expert_feed_forward_length", u32, True),
        ("n_shexp", "expert_shared_count", u32, True),
        ("n_dense_lead", "leading_dense_block_count", u32, False),
        ("scale", "expert_weights_scale", f32, False),
        ("norm_w", "expert_weights_norm", [VT.BOOL], False),
        ("gating", "expert_gating_func", u32, True),
        ("latent", "expert_latent_length", u32, True),
        ("res_block", "attn_res.block_size", u32, True),
        ("situ_beta", "activation.situ_beta", f32, True),
        ("situ_linear_beta", "activation.situ_linear_beta", f32, True),
    ]:
        hp[name] = kimi.check_key(reader, key(k), types, req)
    n_layer = hp["n_layer"] or 0
    kv = hp["n_head_kv"] or []
    if len(kv) != n_layer:
        kimi.fail(f"head_count_kv has {len(kv)} entries for {n_layer} layers")
    hp["heads"] = hp["n_head"] if isinstance(hp["n_head"], list) else [hp["n_head"]] * n_layer
    hp["recurrent"] = [h == 0 for h in kv]
    if hp["gating"] != int(gguf.ExpertGatingFuncType.SIGMOID):
        kimi.fail("expert_gating_func must be SIGMOID (2)")
    return hp


def expected_tensors(hp, present):
    """name -> ggml ne, following kimi-k3.cpp load_arch_tensors."""
    n_embd, n_vocab = hp["n_embd"], hp["n_vocab"]
    exp = {"token_embd.weight": [n_embd, n_vocab], "output_norm.weight": [n_embd],
           "output.weight": [n_embd, n_vocab]}
    if hp["res_block"]:
        exp["output_res_score.weight"] = [n_embd]
    latent = hp["latent"] or n_embd
    for i in range(hp["n_layer"]):
        b, h = f"blk.{i}", hp["heads"][i]
        exp[f"{b}.attn_norm.weight"] = [n_embd]
        exp[f"{b}.ffn_norm.weight"] = [n_embd]
        if hp["res_block"]:
            exp[f"{b}.attn_res_score.weight"] = [n_embd]
            exp[f"{b}.ffn_res_score.weight"] = [n_embd]
        if hp["recurrent"][i]:
            d, w = hp["kda_head"], hp["d_conv"]
            inner = d * h
            for s in "qkv":
                exp[f"{b}.attn_{s}.weight"] = [n_embd, inner]
                exp[f"{b}.ssm_conv1d_{s}.weight"] = [w, 1, inner, 1]
            exp[f"{b}.ssm_f_a.weight"] = [n_embd, d]
            exp[f"{b}.ssm_f_b.weight"] = [d, inner]
            exp[f"{b}.ssm_beta.weight"] = [n_embd, h]
            exp[f"{b}.ssm_a"] = [h]
            exp[f"{b}.ssm_dt.bias"] = [inner]
            exp[f"{b}.ssm_g.weight"] = [n_embd, inner]
            exp[f"{b}.ssm_norm.weight"] = [d]
            exp[f"{b}.attn_output.weight"] = [inner, n_embd]
        else:
            r, rot, k_mla, v = hp["kv_lora"], hp["n_rot"], hp["k_mla"], hp["v_mla"]
            if hp["q_lora"]:
                q = hp["q_lora"]
                exp[f"{b}.attn_q_a.weight"] = [n_embd, q]
                exp[f"{b}.attn_q_a_norm.weight"] = [q]
                exp[f"{b}.attn_q_b.weight"] = [q, h * k_mla]
            else:
                exp[f"{b}.attn_q.weight"] = [n_embd, h * k_mla]
            exp[f"{b}.attn_kv_a_mqa.weight"] = [n_embd, r + rot]
            exp[f"{b}.attn_kv_a_norm.weight"] = [r]
            exp[f"{b}.attn_k_b.weight"] = [k_mla - rot, r, h]
            exp[f"{b}.attn_v_b.weight"] = [r, v, h]
            if f"{b}.attn_gate.weight" in present:
                exp[f"{b}.attn_gate.weight"] = [n_embd, h * v]
            exp[f"{b}.attn_output.weight"] = [h * v, n_embd]
        if i < (hp["n_dense_lead"] or 0):
            ff = hp["n_ff"]
            exp[f"{b}.ffn_gate.weight"] = [n_embd, ff]
            exp[f"{b}.ffn_up.weight"] = [n_embd, ff]
            exp[f"{b}.ffn_down.weight"] = [ff, n_embd]
        else:
            e, ff = hp["n_expert"], hp["n_ff_exp"]
            exp[f"{b}.ffn_gate_inp.weight"] = [n_embd, e]
            exp[f"{b}.exp_probs_b.bias"] = [e]
            exp[f"{b}.ffn_gate_exps.weight"] = [latent, ff, e]
            exp[f"{b}.ffn_up_exps.weight"] = [latent, ff, e]
            exp[f"{b}.ffn_down_exps.weight"] = [ff, latent, e]
            exp[f"{b}.ffn_routed_down.weight"] = [n_embd, latent]
            exp[f"{b}.ffn_routed_up.weight"] = [latent, n_embd]
            if f"{b}.ffn_routed_norm.weight" in present:
                exp[f"{b}.ffn_routed_norm.weight"] = [latent]
            s = ff * max(hp["n_shexp"], 1)
            exp[f"{b}.ffn_gate_shexp.weight"] = [n_embd, s]
            exp[f"{b}.ffn_up_shexp.weight"] = [n_embd, s]
            exp[f"{b}.ffn_down_shexp.weight"] = [s, n_embd]
    return exp


def check_tensors(reader, hp):
    tensors = {t.name: t for t in reader.tensors}
    exp = expected_tensors(hp, tensors)
    for name, ne in exp.items():
        t = tensors.get(name)
        if t is None:
            kimi.fail(f"missing tensor {name} (ne {ne})")
            continue
        if [int(x) for x in t.shape] != ne:
            kimi.fail(f"{name}: ne {list(map(int, t.shape))}, llama.cpp expects {ne}")
        if "_exps." in name and t.tensor_type != QT.MXFP4:
            kimi.fail(f"{name}: {t.tensor_type.name}, K3's routed experts are MXFP4")
        must_f32 = (len([d for d in ne if d != 1]) <= 1 or name.endswith("_norm.weight")
                    or "ffn_gate_inp" in name or "ssm_conv1d" in name
                    or not name.endswith(".weight"))
        if must_f32 and t.tensor_type != QT.F32:
            kimi.fail(f"{name}: {t.tensor_type.name}, the converter keeps it F32")
    for name in set(tensors) - set(exp):
        kimi.fail(f"{name}: unexpected tensor")
    return tensors


def read_checkpoint(dir_: Path):
    """The safetensors tensors as float32 arrays, MXFP4 planes (U8) kept as bytes."""
    out = {}
    dtypes = {"F32": np.float32, "BF16": np.uint16, "F16": np.float16, "U8": np.uint8}
    for f in sorted(dir_.glob("*.safetensors")):
        raw = f.read_bytes()
        n = struct.unpack("<Q", raw[:8])[0]
        header = json.loads(raw[8:8 + n])
        data = raw[8 + n:]
        for k, v in header.items():
            if k == "__metadata__":
                continue
            a, b = v["data_offsets"]
            buf = np.frombuffer(data[a:b], dtype=dtypes[v["dtype"]])
            if v["dtype"] == "BF16":
                buf = (buf.astype(np.uint32) << 16).view(np.float32)
            if v["dtype"] != "U8":
                buf = buf.astype(np.float32)
            out[k] = buf.reshape(v["shape"])
    return out


def mxfp4_planes(codes, scales):
    """Values of a two-plane MXFP4 matrix: column 2i in the low nibble of byte i."""
    rows = codes.shape[0]
    nib = np.stack([codes & 0xF, codes >> 4], axis=-1).reshape(rows, -1)
    scale = np.exp2(scales.astype(np.float64) - 127.0)
    return E2M1[nib] * np.repeat(scale, 32, axis=1)


def hub_to_gguf(ckpt, hp):
    """The GGUF tensors llama.cpp's K3 converter makes from the checkpoint, as numpy."""
    pre = "language_model.model."
    out = {}
    out["token_embd.weight"] = ckpt[pre + "embed_tokens.weight"]
    out["output_norm.weight"] = ckpt[pre + "norm.weight"]
    out["output.weight"] = ckpt["language_model.lm_head.weight"]
    fold = lambda p: ckpt[p + "_norm.weight"] * ckpt[p + "_proj.weight"].reshape(-1)
    if hp["res_block"]:
        out["output_res_score.weight"] = fold(pre + "output_attn_res")
    for i in range(hp["n_layer"]):
        p, b, h = f"{pre}layers.{i}.", f"blk.{i}.", hp["heads"][i]
        out[b + "attn_norm.weight"] = ckpt[p + "input_layernorm.weight"]
        out[b + "ffn_norm.weight"] = ckpt[p + "post_attention_layernorm.weight"]
        if hp["res_block"]:
            out[b + "attn_res_score.weight"] = fold(p + "self_attention_res")
            out[b + "ffn_res_score.weight"] = fold(p + "mlp_res")
        a = p + "self_attn."
        if hp["recurrent"][i]:
            for s in "qkv":
                out[b + f"attn_{s}.weight"] = ckpt[a + f"{s}_proj.weight"]
                out[b + f"ssm_conv1d_{s}.weight"] = ckpt[a + f"{s}_conv1d.weight"]
            for g, hub in [("ssm_f_a", "f_a_proj"), ("ssm_f_b", "f_b_proj"), ("ssm_beta", "b_proj"),
                           ("ssm_g", "g_proj"), ("ssm_norm", "o_norm"), ("attn_output", "o_proj")]:
                out[b + g + ".weight"] = ckpt[a + hub + ".weight"]
            a_log = ckpt[a + "A_log"].reshape(-1)
            out[b + "ssm_a"] = -np.exp(a_log[:h].astype(np.float64))
            out[b + "ssm_dt.bias"] = ckpt[a + "dt_bias"]
        else:
            for g, hub in [("attn_q_a", "q_a_proj"), ("attn_q_a_norm", "q_a_layernorm"),
                           ("attn_q_b", "q_b_proj"), ("attn_kv_a_mqa", "kv_a_proj_with_mqa"),
                           ("attn_kv_a_norm", "kv_a_layernorm"), ("attn_gate", "g_proj"),
                           ("attn_output", "o_proj")]:
                if a + hub + ".weight" in ckpt:
                    out[b + g + ".weight"] = ckpt[a + hub + ".weight"]
            nope, v = hp["k_mla"] - hp["n_rot"], hp["v_mla"]
            kv = ckpt[a + "kv_b_proj.weight"].reshape(h, nope + v, -1)
            out[b + "attn_k_b.weight"] = kv[:, :nope].transpose(0, 2, 1)
            out[b + "attn_v_b.weight"] = kv[:, nope:]
        m = p + "block_sparse_moe."
        if i < (hp["n_dense_lead"] or 0):
            for g in ("gate", "up", "down"):
                out[b + f"ffn_{g}.weight"] = ckpt[p + f"mlp.{g}_proj.weight"]
            continue
        out[b + "ffn_gate_inp.weight"] = ckpt[m + "gate.weight"]
        out[b + "exp_probs_b.bias"] = ckpt[m + "gate.e_score_correction_bias"]
        for g, hub in [("ffn_routed_down", "routed_expert_down_proj"),
                       ("ffn_routed_norm", "routed_expert_norm"),
                       ("ffn_routed_up", "routed_expert_up_proj")]:
            if m + hub + ".weight" in ckpt:
                out[b + g + ".weight"] = ckpt[m + hub + ".weight"]
        for g in ("gate", "up", "down"):
            out[b + f"ffn_{g}_shexp.weight"] = ckpt[m + f"shared_experts.{g}_proj.weight"]
        for g, w in [("gate", "w1"), ("up", "w3"), ("down", "w2")]:
            out[b + f"ffn_{g}_exps.weight"] = np.stack([
                mxfp4_planes(ckpt[m + f"experts.{e}.{w}.weight_packed"],
                             ckpt[m + f"experts.{e}.{w}.weight_scale"])
                for e in range(hp["n_expert"])])
    return out


def check_values(tensors, ckpt_dir, hp):
    want = hub_to_gguf(read_checkpoint(ckpt_dir), hp)
    worst = {}
    for name, t in tensors.items():
        if name not in want:
            kimi.fail(f"{name}: no checkpoint tensor maps to it")
            continue
        got = gguf.quants.dequantize(t.data, t.tensor_type).reshape(-1).astype(np.float64)
        ref = np.asarray(want[name]).reshape(-1).astype(np.float64)
        if got.shape != ref.shape:
            kimi.fail(f"{name}: {got.size} values, the checkpoint gives {ref.size}")
            continue
        if t.tensor_type == QT.MXFP4:
            # The checkpoint's codes carried over: every value equal (gguf-py decodes code 8,
            # E2M1's -0, as +0; kimi-infer's byte-equality test covers the sign).
            if not np.array_equal(got, ref):
                bad = int(np.sum(got != ref))
                kimi.fail(f"{name}: {bad} MXFP4 values differ from the checkpoint's planes")
            worst["MXFP4"] = 0.0
            continue
        err = np.linalg.norm(got - ref) / max(np.linalg.norm(ref), 1e-30)
        tol = kimi.TOL.get(t.tensor_type, 0.2)
        worst[t.tensor_type.name] = max(worst.get(t.tensor_type.name, 0.0), err)
        if err > tol:
            kimi.fail(f"{name}: {t.tensor_type.name} relative error {err:.2e} > {tol:.0e}")
    return worst


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("gguf")
    ap.add_argument("--checkpoint", type=Path)
    args = ap.parse_args()
    reader = GGUFReader(args.gguf)
    hp = check_metadata(reader)
    tensors = check_tensors(reader, hp) if not kimi.errors else {}
    worst = check_values(tensors, args.checkpoint, hp) if args.checkpoint and not kimi.errors else {}
    types = sorted({t.tensor_type.name for t in reader.tensors})
    if kimi.errors:
        for e in kimi.errors:
            print(f"FAIL {args.gguf}: {e}", file=sys.stderr)
        sys.exit(1)
    detail = ", ".join(f"{k} ≤ {v:.1e}" for k, v in sorted(worst.items()))
    print(f"ok {args.gguf}: {len(reader.tensors)} tensors ({'/'.join(types)}), "
          f"{len(reader.fields)} keys{'; values ' + detail if detail else ''}")


if __name__ == "__main__":
    main()
