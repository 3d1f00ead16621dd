#!/usr/bin/env python3
"""Checks a Kimi Linear GGUF written by `kimi-infer convert` with llama.cpp's own `gguf`
package (gguf-py, pinned in scripts/check_gguf_kimi.sh):

* metadata: `general.architecture == kimi-linear` and every `kimi-linear.*` key that
  llama.cpp's `src/models/kimi-linear.cpp` reads, with the GGUF value type gguf-py's writer
  uses (`add_uint32`, `add_float32`, `add_head_count_kv` → INT32 array, ...);
* tensor names: each one is a `MODEL_TENSORS[MODEL_ARCH.KIMI_LINEAR]` name of
  `gguf.constants.TENSOR_NAMES` for a block below `block_count`, nothing missing;
* shapes: the ggml `ne` of `create_tensor` in `kimi-linear.cpp` (conv 4-D `[W, 1, C, 1]`,
  `ssm_a` `[1, H, 1, 1]`, `attn_k_b` `[nope, kv_lora, H]`, stacked experts ...);
* types: norms, 1-D tensors, the router, the KDA convolutions and non-`.weight` tensors F32
  (converter rules; llama.cpp aborts on an F16 `ssm_conv1d_*`);
* values (with `--checkpoint DIR`): every tensor dequantized by gguf-py against the
  safetensors tensors transformed as `convert_hf_to_gguf.py` does (`-exp(A_log)`, experts
  stacked, `kv_b_proj` split with the key half transposed), within the type's tolerance.

Usage: check_gguf_kimi.py FILE.gguf [--checkpoint DIR]
"""
import argparse
import json
import struct
import sys
from pathlib import Path

import numpy as np
import gguf
from gguf import GGUFReader, GGUFValueType as VT, GGMLQuantizationType as QT

ARCH = gguf.MODEL_ARCH.KIMI_LINEAR
A = gguf.MODEL_ARCH_NAMES[ARCH]
errors: list[str] = []


def fail(msg: str) -> None:
    errors.append(msg)


def field(reader: GGUFReader, key: str):
    return reader.fields.get(key)


def value(f):
    if f.types[0] == VT.ARRAY:
        return [f.parts[i].tolist()[0] if f.types[-1] != VT.STRING else bytes(f.parts[i]).decode()
                for i in f.data]
    if f.types[0] == VT.STRING:
        return bytes(f.parts[f.data[0]]).decode()
    return f.parts[f.data[0]].tolist()[0]


def check_key(reader, key, types, required=True):
    f = field(reader, key)
    if f is None:
        if required:
            fail(f"missing metadata key {key}")
        return None
    if f.types[0] not in types:
        fail(f"{key}: type {f.types[0].name}, llama.cpp's converter writes {[t.name for t in types]}")
    if f.types[0] == VT.ARRAY and f.types[-1] != VT.INT32:
        fail(f"{key}: array of {f.types[-1].name}, gguf-py writes INT32 elements")
    return value(f)


def check_metadata(reader):
    K = gguf.Keys
    arch = check_key(reader, K.General.ARCHITECTURE, [VT.STRING])
    if arch != A:
        fail(f"general.architecture is {arch!r}, expected {A!r}")
    u32 = [VT.UINT32]
    hp = {}
    for name, key, types, req in [
        ("n_layer", K.LLM.BLOCK_COUNT, u32, True),
        ("n_ctx", K.LLM.CONTEXT_LENGTH, u32, True),
        ("n_embd", K.LLM.EMBEDDING_LENGTH, u32, True),
        ("n_ff", K.LLM.FEED_FORWARD_LENGTH, u32, True),
        ("n_head", K.Attention.HEAD_COUNT, [VT.UINT32, VT.ARRAY], True),
        ("n_head_kv", K.Attention.HEAD_COUNT_KV, [VT.ARRAY], True),
        ("eps", K.Attention.LAYERNORM_RMS_EPS, [VT.FLOAT32], True),
        ("n_vocab", K.LLM.VOCAB_SIZE, u32, True),
        ("d_conv", K.SSM.CONV_KERNEL, u32, False),
        ("kda_head", K.KDA.HEAD_DIM, u32, False),
        ("q_lora", K.Attention.Q_LORA_RANK, u32, False),
        ("kv_lora", K.Attention.KV_LORA_RANK, u32, False),
        ("n_rot", K.Rope.DIMENSION_COUNT, u32, False),
        ("k_mla", K.Attention.KEY_LENGTH_MLA, u32, False),
        ("v_mla", K.Attention.VALUE_LENGTH_MLA, u32, False),
        ("key_length", K.Attention.KEY_LENGTH, u32, False),
        ("value_length", K.Attention.VALUE_LENGTH, u32, False),
        ("n_expert", K.LLM.EXPERT_COUNT, u32, False),
        ("n_expert_used", K.LLM.EXPERT_USED_COUNT, u32, False),
        ("n_ff_exp", K.LLM.EXPERT_FEED_FORWARD_LENGTH, u32, False),
        ("n_shexp", K.LLM.EXPERT_SHARED_COUNT, u32, False),
        ("n_dense_lead", K.LLM.LEADING_DENSE_BLOCK_COUNT, u32, False),
        ("scale", K.LLM.EXPERT_WEIGHTS_SCALE, [VT.FLOAT32], False),
        ("norm_w", K.LLM.EXPERT_WEIGHTS_NORM, [VT.BOOL], False),
        ("gating", K.LLM.EXPERT_GATING_FUNC, u32, False),
        ("n_group", K.LLM.EXPERT_GROUP_COUNT, u32, False),
        ("n_group_used", K.LLM.EXPERT_GROUP_USED_COUNT, u32, False),
        ("rope_base", K.Rope.FREQ_BASE, [VT.FLOAT32], False),
        ("file_type", K.General.FILE_TYPE, u32, True),
        ("qver", K.General.QUANTIZATION_VERSION, u32, True),
    ]:
        hp[name] = check_key(reader, key.format(arch=A), types, req)
    n_layer = hp["n_layer"] or 0
    kv = hp["n_head_kv"] or []
    if len(kv) != n_layer:
        fail(f"head_count_kv has {len(kv)} entries for {n_layer} layers")
    heads = hp["n_head"] if isinstance(hp["n_head"], list) else [hp["n_head"]] * n_layer
    hp["heads"] = heads
    hp["recurrent"] = [h == 0 for h in kv]
    if any(hp["recurrent"]) and (hp["d_conv"] is None or hp["kda_head"] is None):
        fail("KDA layers need ssm.conv_kernel and kda.head_dim")
    if not all(hp["recurrent"]) and any(hp[k] is None for k in ("kv_lora", "n_rot", "k_mla", "v_mla")):
        fail("MLA layers need kv_lora_rank, rope.dimension_count, key_length_mla, value_length_mla")
    if hp["n_expert"] is not None:
        for k in ("n_expert_used", "n_ff_exp", "n_shexp", "gating"):
            if hp[k] is None:
                fail(f"MoE metadata {k} missing")
        if hp["gating"] not in (None, int(gguf.ExpertGatingFuncType.SIGMOID)):
            fail("expert_gating_func must be SIGMOID (2)")
    tok_model = field(reader, K.Tokenizer.MODEL)
    if tok_model is not None:
        if value(tok_model) != "gpt2" or value(field(reader, K.Tokenizer.PRE)) != "kimi-k2":
            fail("Kimi's vocabulary is written as tokenizer.ggml.model gpt2, pre kimi-k2")
        for key, elem in [(K.Tokenizer.LIST, VT.STRING), (K.Tokenizer.TOKEN_TYPE, VT.INT32),
                          (K.Tokenizer.MERGES, VT.STRING)]:
            f = field(reader, key)
            if f is None and key == K.Tokenizer.MERGES:
                continue  # a vocabulary of single bytes has none; llama.cpp needs none for kimi-k2
            if f is None or f.types[0] != VT.ARRAY or f.types[-1] != elem:
                fail(f"{key}: must be an array of {elem.name}")
            elif key != K.Tokenizer.MERGES and len(f.data) != hp["n_vocab"]:
                fail(f"{key}: {len(f.data)} entries for vocab_size {hp['n_vocab']}")
        for key in (K.Tokenizer.BOS_ID, K.Tokenizer.EOS_ID):
            check_key(reader, key, [VT.UINT32])
    try:
        gguf.LlamaFileType(hp["file_type"])
    except ValueError:
        fail(f"general.file_type {hp['file_type']} is not a llama_ftype")
    return hp


def expected_tensors(hp, present):
    """name -> ggml ne, following kimi-linear.cpp load_arch_tensors."""
    T = gguf.MODEL_TENSOR
    tn = lambda t, bid=None, suffix=".weight": gguf.TENSOR_NAMES[t].format(bid=bid) + suffix
    n_embd, n_vocab = hp["n_embd"], hp["n_vocab"]
    exp = {tn(T.TOKEN_EMBD): [n_embd, n_vocab], tn(T.OUTPUT_NORM): [n_embd]}
    if tn(T.OUTPUT) in present:
        exp[tn(T.OUTPUT)] = [n_embd, n_vocab]
    for i in range(hp["n_layer"]):
        h = hp["heads"][i]
        exp[tn(T.ATTN_NORM, i)] = [n_embd]
        exp[tn(T.FFN_NORM, i)] = [n_embd]
        if hp["recurrent"][i]:
            d, w = hp["kda_head"], hp["d_conv"]
            inner = d * h
            for t in (T.ATTN_Q, T.ATTN_K, T.ATTN_V):
                exp[tn(t, i)] = [n_embd, inner]
            for t in (T.SSM_CONV1D_Q, T.SSM_CONV1D_K, T.SSM_CONV1D_V):
                exp[tn(t, i)] = [w, 1, inner, 1]
            exp[tn(T.SSM_F_A, i)] = [n_embd, d]
            exp[tn(T.SSM_F_B, i)] = [d, inner]
            exp[tn(T.SSM_BETA, i)] = [n_embd, h]
            exp[tn(T.SSM_A, i, "")] = [1, h, 1, 1]
            exp[tn(T.SSM_DT, i, ".bias")] = [inner]
            exp[tn(T.SSM_G_A, i)] = [n_embd, d]
            exp[tn(T.SSM_G_B, i)] = [d, inner]
            exp[tn(T.SSM_NORM, i)] = [d]
            exp[tn(T.ATTN_OUT, i)] = [inner, n_embd]
        else:
            r, rot, k_mla, v = hp["kv_lora"], hp["n_rot"], hp["k_mla"], hp["v_mla"]
            if hp["q_lora"]:
                q = hp["q_lora"]
                exp[tn(T.ATTN_Q_A, i)] = [n_embd, q]
                exp[tn(T.ATTN_Q_A_NORM, i)] = [q]
                exp[tn(T.ATTN_Q_B, i)] = [q, h * k_mla]
            else:
                exp[tn(T.ATTN_Q, i)] = [n_embd, h * k_mla]
            exp[tn(T.ATTN_KV_A_MQA, i)] = [n_embd, r + rot]
            exp[tn(T.ATTN_KV_A_NORM, i)] = [r]
            exp[tn(T.ATTN_K_B, i)] = [k_mla - rot, r, h]
            exp[tn(T.ATTN_V_B, i)] = [r, v, h]
            exp[tn(T.ATTN_OUT, i)] = [h * v, n_embd]
        if tn(T.FFN_GATE_INP, i) in present:
            e, ff = hp["n_expert"], hp["n_ff_exp"]
            if i < (hp["n_dense_lead"] or 0):
                fail(f"layer {i} is MoE but below leading_dense_block_count")
            exp[tn(T.FFN_GATE_INP, i)] = [n_embd, e]
            exp[tn(T.FFN_GATE_EXP, i)] = [n_embd, ff, e]
            exp[tn(T.FFN_UP_EXP, i)] = [n_embd, ff, e]
            exp[tn(T.FFN_DOWN_EXP, i)] = [ff, n_embd, e]
            if tn(T.FFN_EXP_PROBS_B, i, ".bias") in present:
                exp[tn(T.FFN_EXP_PROBS_B, i, ".bias")] = [e]
            if hp["n_shexp"]:
                s = ff * hp["n_shexp"]
                exp[tn(T.FFN_GATE_SHEXP, i)] = [n_embd, s]
                exp[tn(T.FFN_UP_SHEXP, i)] = [n_embd, s]
                exp[tn(T.FFN_DOWN_SHEXP, i)] = [s, n_embd]
        else:
            ff = hp["n_ff"]
            exp[tn(T.FFN_GATE, i)] = [n_embd, ff]
            exp[tn(T.FFN_UP, i)] = [n_embd, ff]
            exp[tn(T.FFN_DOWN, i)] = [ff, n_embd]
    return exp


def check_tensors(reader, hp):
    allowed = set()
    for t in gguf.MODEL_TENSORS[ARCH]:
        for bid in range(hp["n_layer"]):
            allowed.add(gguf.TENSOR_NAMES[t].format(bid=bid))
    tensors = {t.name: t for t in reader.tensors}
    for name in tensors:
        base = name.rsplit(".", 1)[0] if name.endswith((".weight", ".bias")) else name
        if base not in allowed:
            fail(f"{name}: not a kimi-linear tensor name in gguf-py's constants")
    exp = expected_tensors(hp, tensors)
    for name, ne in exp.items():
        t = tensors.get(name)
        if t is None:
            fail(f"missing tensor {name} (ne {ne})")
            continue
        if [int(x) for x in t.shape] != ne:
            fail(f"{name}: ne {list(map(int, t.shape))}, llama.cpp expects {ne}")
        must_f32 = (len([d for d in ne if d != 1]) <= 1 or name.endswith("_norm.weight")
                    or "ffn_gate_inp" in name or "ssm_conv1d" in name
                    or not name.endswith(".weight"))
        if must_f32 and t.tensor_type != QT.F32:
            fail(f"{name}: {t.tensor_type.name}, the converter keeps it F32")
    for name in set(tensors) - set(exp):
        fail(f"{name}: unexpected tensor")
    return tensors


def read_safetensors(dir_: Path):
    out = {}
    for f in sorted(dir_.glob("*.safetensors")):
        raw = f.read_bytes()
        n = struct.unpack("<Q", raw[:8])[0]
        header = json.loads(raw[8:8 + n])
        data = raw[8 + n:]
        for k, v in header.items():
            if k == "__metadata__":
                continue
            a, b = v["data_offsets"]
            buf = np.frombuffer(data[a:b], dtype={"F32": np.float32, "BF16": np.uint16, "F16": np.float16}[v["dtype"]])
            if v["dtype"] == "BF16":
                buf = (buf.astype(np.uint32) << 16).view(np.float32)
            out[k] = buf.astype(np.float32).reshape(v["shape"])
    return out


def hub_to_gguf(ckpt, hp):
    """What convert_hf_to_gguf.py's KimiLinearModel.modify_tensors makes, as numpy arrays."""
    T = gguf.MODEL_TENSOR
    tmap = gguf.get_tensor_name_map(ARCH, hp["n_layer"])
    out = {}
    experts = {}
    for name, x in ckpt.items():
        if name.endswith((".q_conv1d.weight", ".k_conv1d.weight", ".v_conv1d.weight")):
            x = x.reshape(1, x.shape[0], 1, x.shape[-1])
        if name.endswith(".A_log"):
            x = -np.exp(x.astype(np.float64)).astype(np.float32)
        if name.endswith("e_score_correction_bias"):  # as the converter's base class renames it
            name = name[: -len("_bias")] + ".bias"
        if name.endswith(".dt_bias"):
            name = name[: -len(".dt_bias")] + ".dt_proj.bias"
        if ".block_sparse_moe.experts." in name:
            bid = int(name.split(".")[2])
            experts.setdefault((bid, name.split(".")[-2]), {})[int(name.split(".")[5])] = x
            continue
        if name.endswith("kv_b_proj.weight"):
            bid = int(name.split(".")[2])
            h, nope, v = hp["heads"][bid], hp["k_mla"] - hp["n_rot"], hp["v_mla"]
            kv = x.reshape(h, nope + v, x.shape[-1])
            out[gguf.TENSOR_NAMES[T.ATTN_K_B].format(bid=bid) + ".weight"] = kv[:, :nope].transpose(0, 2, 1)
            out[gguf.TENSOR_NAMES[T.ATTN_V_B].format(bid=bid) + ".weight"] = kv[:, nope:]
            continue
        new = tmap.get_name(name, try_suffixes=(".weight", ".bias"))
        if new is None:
            fail(f"gguf-py's tensor map has no name for {name}")
            continue
        out[new] = x
    for (bid, w), per in experts.items():
        t = {"w1": T.FFN_GATE_EXP, "w2": T.FFN_DOWN_EXP, "w3": T.FFN_UP_EXP}[w]
        out[gguf.TENSOR_NAMES[t].format(bid=bid) + ".weight"] = np.stack([per[e] for e in sorted(per)])
    return out


TOL = {QT.F32: 1e-6, QT.F16: 1e-3, QT.BF16: 8e-3, QT.Q8_0: 2e-2, QT.Q6_K: 3e-2,
       QT.Q5_0: 6e-2, QT.Q5_1: 6e-2, QT.Q5_K: 6e-2, QT.Q4_K: 1.2e-1}


def check_values(tensors, ckpt_dir, hp):
    want = hub_to_gguf(read_safetensors(ckpt_dir), hp)
    worst = {}
    for name, t in tensors.items():
        if name not in want:
            fail(f"{name}: no checkpoint tensor maps to it")
            continue
        got = gguf.quants.dequantize(t.data, t.tensor_type).reshape(-1).astype(np.float64)
        ref = want[name].reshape(-1).astype(np.float64)
        if got.shape != ref.shape:
            fail(f"{name}: {got.size} values, the checkpoint gives {ref.size}")
            continue
        err = np.linalg.norm(got - ref) / max(np.linalg.norm(ref), 1e-30)
        tol = TOL.get(t.tensor_type, 0.2)
        worst[t.tensor_type.name] = max(worst.get(t.tensor_type.name, 0.0), err)
        if err > tol:
            fail(f"{name}: {t.tensor_type.name} relative error {err:.2e} > {tol:.0e}")
    return worst


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("gguf")
    ap.add_argument("--checkpoint", type=Path)
    args = ap.parse_args()
    reader = GGUFReader(args.gguf)
    hp = check_metadata(reader)
    tensors = check_tensors(reader, hp) if not errors else {}
    worst = check_values(tensors, args.checkpoint, hp) if args.checkpoint and not errors else {}
    types = sorted({t.tensor_type.name for t in reader.tensors})
    if errors:
        for e in errors:
            print(f"FAIL {args.gguf}: {e}", file=sys.stderr)
        sys.exit(1)
    detail = ", ".join(f"{k} ≤ {v:.1e}" for k, v in sorted(worst.items()))
    print(f"ok {args.gguf}: {len(reader.tensors)} tensors ({'/'.join(types)}), "
          f"{len(reader.fields)} keys{'; values ' + detail if detail else ''}")


if __name__ == "__main__":
    main()
