#!/usr/bin/env python3
"""Quantized Kimi Linear checkpoints made by the real tools, with float64 reference logits.

One tiny random Kimi Linear model (f32, built with scripts/make_fixtures.py's own config, seed and
re-initialisation rules; every Linear input width a multiple of 32) is quantized by:

* llm-compressor (`oneshot` + `QuantizationModifier`, data-free RTN with its min-max observers) and
  saved with `save_pretrained(save_compressed=True)` in compressed-tensors' formats:
  - ct-w4a16-asym:  INT4 pack-quantized, asymmetric, group 32 (attention) and 64 (MLPs, experts);
  - ct-w8a16:       INT8 pack-quantized, symmetric, per channel;
  - ct-fp8:         FP8 E4M3 float-quantized, per-channel scales (FP8_DYNAMIC preset; activation
                    quantization is dynamic, so nothing is stored for it);
* AutoAWQ's own GEMM packing (`awq.modules.linear.gemm.WQLinear_GEMM.from_linear`) -> awq-gemm;
* AutoGPTQ's own packing (`QuantLinear.pack`, v1 format: zero points minus one) of
  round-to-nearest GPTQ codes, with an activation-order `g_idx` -> gptq-4bit-actorder, and
  8-bit symmetric per channel -> gptq-8bit-sym;
* transformers' fine-grained FP8 (`quant_method: fp8`, 128 x 128 blocks, `weight_scale_inv`) as
  Kimi K2 and DeepSeek V3 ship it -> fp8-block.

The reference logits of each fixture come from transformers' `KimiLinearForCausalLM` in float64
whose Linear weights are the tool's own dequantization of the stored tensors (compressed-tensors'
compressor `decompress`, AutoAWQ's / GPTQ's unpacking rules, transformers' block dequantization),
computed in f32 as the tools do, then widened to float64.

Run on a CPU (no GPU needed):

    python3 -m venv .venv && .venv/bin/pip install llmcompressor==0.14.0.1 \
        compressed-tensors==0.19.0 transformers==5.17.0 torch==2.14.0 && \
        .venv/bin/pip install --no-deps autoawq==0.2.9 auto-gptq==0.7.1
    HF_HUB_OFFLINE=1 .venv/bin/python scripts/make_quant_fixtures.py --out fixtures/quantized
"""

import argparse
import json
import math
import os
import re
import shutil
import sys
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from safetensors import safe_open  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from transformers import KimiLinearForCausalLM  # noqa: E402

import make_fixtures as mf  # noqa: E402

SPEC = dict(
    name="quant-base", schema="hub", dtype="float32", T=48, seed=2701, mixers="KMK", first_k=1,
    experts=4, groups=1, topk_group=1, top_k=2, shared=1, renorm=True, conv=4,
    hidden=64, intermediate=128, moe_intermediate=64, kda_heads=2, kda_head_dim=32,
    mla_heads=2, nope=32, rope=16, v=32, kv_lora=32,
)
GREEDY_PROMPT, GREEDY_NEW = 12, 16
EXPERT = re.compile(r"^(model\.layers\.\d+\.block_sparse_moe\.experts\.\d+\.)(gate|up|down)_proj\.weight$")
DENSE = re.compile(r"^(model\.layers\.(\d+)\.)block_sparse_moe\.((gate|up|down)_proj\.weight)$")


def build_base(s, d):
    _, _, _, cfg, _, _, _ = mf.build_config(s, lambda *a: None)
    torch.manual_seed(s["seed"])
    model = KimiLinearForCausalLM(cfg)
    model.eval()
    mf.reinit(model, s["seed"])
    mf.cast_storage(model, torch.float32)
    model.save_pretrained(d)
    return cfg


def read_dir(d):
    out = {}
    for fn in sorted(os.listdir(d)):
        if fn.endswith(".safetensors"):
            with safe_open(os.path.join(d, fn), "pt") as f:
                for k in f.keys():
                    out[k] = f.get_tensor(k)
    return out


def to_hub(tensors, s):
    """Names as transformers' save_pretrained and llm-compressor write them -> hub names."""
    hub = {}
    for k, v in tensors.items():
        m = EXPERT.match(k)
        if m:
            k = m.group(1) + {"gate": "w1", "up": "w3", "down": "w2"}[m.group(2)] + ".weight"
        m = DENSE.match(k)
        if m and s["ffn"][int(m.group(2))] == "dense":
            k = m.group(1) + "mlp." + m.group(3)
        hub[k] = v
    return hub


def reference(fixture_dir, hub_f32, cfg, s, out, meta):
    """float64 logits and a greedy continuation of transformers' model on `hub_f32`."""
    model = KimiLinearForCausalLM(cfg)
    model.eval()
    sd = model.state_dict()
    hub64 = {k: v.to(torch.float64) for k, v in hub_f32.items()}
    missing = [k for k in mf.to_hub(sd, s, set()) if k not in hub64]
    if missing:
        raise RuntimeError(f"{fixture_dir}: no dequantized tensor for {missing[:8]}")
    model = model.to(torch.float64)
    model.load_state_dict(mf.from_hub(hub64, model.state_dict(), s))
    mf.force_eager(model)
    rng = np.random.default_rng(s["seed"])
    ids = rng.integers(3, s["vocab"], size=s["T"]).astype(np.int64)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor(ids)[None], use_cache=False).logits[0]
        np.save(os.path.join(out, "logits.npy"), logits.numpy().astype("<f8"))
        seq = ids[:GREEDY_PROMPT].tolist()
        new, margins = [], []
        for _ in range(GREEDY_NEW):
            lg = model(input_ids=torch.tensor(seq)[None], use_cache=False).logits[0, -1]
            t2 = torch.topk(lg, 2).values
            margins.append(float(t2[0] - t2[1]))
            new.append(int(lg.argmax()))
            seq.append(new[-1])
    ref = dict(meta)
    ref.update({
        "prompt_ids": ids.tolist(),
        "prompt_rule": f"numpy.random.default_rng({s['seed']}).integers(3, {s['vocab']}, size={s['T']})",
        "logits": {"file": "logits.npy", "dtype": "<f8", "shape": list(logits.shape),
                   "definition": "KimiLinearForCausalLM (float64, eager) on the tool's dequantized weights: "
                                 "model(prompt_ids).logits[0]"},
        "greedy": {"prompt_ids": ids[:GREEDY_PROMPT].tolist(), "new_tokens": new,
                   "min_top2_margin": min(margins)},
        "versions": {"transformers": transformers.__version__, "torch": torch.__version__,
                     "python": sys.version.split()[0], "numpy": np.__version__},
    })
    with open(os.path.join(out, "reference.json"), "w") as f:
        json.dump(ref, f, indent=1)
        f.write("\n")


# ---------------------------------------------------------------------------- llm-compressor
def llmcompressor_fixture(name, base, out, recipe_fn, covers):
    from llmcompressor import oneshot
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig

    model = KimiLinearForCausalLM.from_pretrained(base, dtype=torch.float32)
    oneshot(model=model, recipe=recipe_fn())
    d = os.path.join(out, name)
    shutil.rmtree(d, ignore_errors=True)
    model.save_pretrained(d, save_compressed=True)
    with open(os.path.join(d, "config.json")) as f:
        qcfg = QuantizationConfig.model_validate(json.load(f)["quantization_config"])
    stored = read_dir(d)
    # The tool's own dequantization of each compressed module.
    modules = sorted({k.rsplit(".", 1)[0] for k in stored if k.endswith(".weight_scale")})
    deq = {k: v for k, v in stored.items()}
    for mod in modules:
        scheme = next(g for g in qcfg.config_groups.values()
                      if any(t == "Linear" or (t.startswith("re:") and re.match(t[3:], mod))
                             for t in g.targets))
        fmt = scheme.format or qcfg.format
        local = {k[len(mod) + 1:]: v for k, v in stored.items() if k.startswith(mod + ".")}
        w = BaseCompressor.get_value_from_registry(fmt).decompress(local, scheme)["weight"]
        for k in local:
            deq.pop(f"{mod}.{k}")
        deq[f"{mod}.weight"] = w.to(torch.float32)
    return d, deq, {"tool": f"llmcompressor {__import__('llmcompressor').__version__}, "
                            f"compressed-tensors {__import__('compressed_tensors').__version__}",
                    "covers": covers}


def ct_recipes():
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from llmcompressor.modifiers.quantization import QuantizationModifier

    ignore = ["lm_head", "re:.*block_sparse_moe.gate$"]

    def w4(g):
        return QuantizationArgs(num_bits=4, type="int", symmetric=False, strategy="group", group_size=g)

    return [
        ("ct-w4a16-asym", lambda: QuantizationModifier(ignore=ignore, config_groups={
            "group_0": QuantizationScheme(targets=["re:.*self_attn.*"], weights=w4(32)),
            "group_1": QuantizationScheme(targets=["re:.*(mlp|block_sparse_moe).*"], weights=w4(64))}),
         ["compressed-tensors pack-quantized INT4, asymmetric (packed zero points)",
          "group 32 (attention) and 64 (MLPs, experts) in one checkpoint",
          "experts linearized by llm-compressor (block_sparse_moe.experts.N.{gate,up,down}_proj)",
          "dense MLP under block_sparse_moe. (save_pretrained's layout)"]),
        ("ct-w8a16", lambda: QuantizationModifier(ignore=ignore, config_groups={
            "group_0": QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(
                num_bits=8, type="int", symmetric=True, strategy="channel"))}),
         ["compressed-tensors pack-quantized INT8, symmetric, per-channel scales"]),
        ("ct-fp8", lambda: QuantizationModifier(ignore=ignore, targets=["Linear"], scheme="FP8_DYNAMIC"),
         ["compressed-tensors float-quantized FP8 E4M3, per-channel scales (FP8_DYNAMIC preset)"]),
    ]


# ---------------------------------------------------------------------------- AutoAWQ
def awq_fixture(base_dir, hub, cfg_json, out, group=32):
    """AutoAWQ's GEMM layout: AutoAWQ's own pseudo-quantization (`AwqQuantizer.pseudo_quantize_tensor`,
    asymmetric min-max per group, in f16) and packing (`WQLinear_GEMM.from_linear`), as its
    quantizer's `_apply_quant` calls them (AWQ's scale search needs calibration data and a GPU
    and is not run: the layout is the same)."""
    import types
    from awq.modules.linear.gemm import WQLinear_GEMM
    from awq.quantize.quantizer import AwqQuantizer
    from compressed_tensors.entrypoints.convert.converters.autoawq import AutoAWQConverter

    d = os.path.join(out, "awq-gemm")
    shutil.rmtree(d, ignore_errors=True)
    os.makedirs(d)
    tensors, deq = {}, {}
    q_args = types.SimpleNamespace(w_bit=4, group_size=group, zero_point=True)
    for k, w in hub.items():
        # WQLinear_GEMM.from_linear sizes qweight as out // 32 * 4 words: matrices whose rows
        # are not a multiple of 32 (KDA's 2-row b_proj, MLA's 48-row kv_a) stay f32.
        if not quantizable(k, w) or w.shape[0] % 32:
            tensors[k] = w
            deq[k] = w
            continue
        lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=False).to(torch.float16)
        wq, scales, zeros = AwqQuantizer.pseudo_quantize_tensor(q_args, w.to(torch.float16))
        lin.weight.data = wq
        q = WQLinear_GEMM.from_linear(lin, 4, group, init_only=False,
                                      scales=scales.t().contiguous(), zeros=zeros.t().contiguous())
        base = k[: -len(".weight")]
        tensors[base + ".qweight"] = q.qweight.contiguous()
        tensors[base + ".qzeros"] = q.qzeros.contiguous()
        tensors[base + ".scales"] = q.scales.contiguous()
        # compressed-tensors' AutoAWQ converter unpacks it: (q - z) * s per group, in f32.
        iw, iz = AutoAWQConverter.unpack_awq(q.qweight, q.qzeros, 4)
        iw, iz = AutoAWQConverter.reverse_awq_order(iw, iz, 4)
        iw, iz = (iw.to(torch.int32) & 15), (iz.to(torch.int32) & 15)  # [in, out], [groups, out]
        sc = q.scales.to(torch.float32)
        g = torch.arange(w.shape[1]) // group
        deq[k] = ((iw - iz[g]).to(torch.float32) * sc[g]).T.contiguous()
    cfg = dict(cfg_json)
    cfg["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": group,
                                  "zero_point": True, "version": "gemm", "modules_to_not_convert": None}
    write(d, tensors, cfg)
    return d, deq, {"tool": "AutoAWQ 0.2.9 AwqQuantizer.pseudo_quantize_tensor + WQLinear_GEMM.from_linear; "
                            "unpacked by compressed-tensors' AutoAWQConverter for the reference",
                    "covers": ["AutoAWQ GEMM layout: qweight [in, out/8] in AWQ's nibble order "
                               "[0,2,4,6,1,3,5,7], qzeros, f16 scales", f"group {group}, zero points"]}


# ---------------------------------------------------------------------------- GPTQ
def gptq_quant_linear():
    """AutoGPTQ's QuantLinear (`auto_gptq/nn_modules/qlinear/qlinear_cuda.py`, its packing and
    its torch dequantization), loaded from its file: the package's __init__ imports
    transformers 4 names that transformers 5 no longer has. Its CUDA kernels are absent here,
    and its forward then dequantizes in torch."""
    import importlib.util
    import site

    for root in site.getsitepackages():
        path = os.path.join(root, "auto_gptq", "nn_modules", "qlinear", "qlinear_cuda.py")
        if os.path.exists(path):
            spec = importlib.util.spec_from_file_location("auto_gptq_qlinear_cuda", path)
            mod = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(mod)
            return mod.QuantLinear
    raise RuntimeError("auto-gptq is not installed (pip install --no-deps auto-gptq==0.7.1)")


def gptq_pack(w, bits, group, act_order, sym, seed):
    """GPTQ's round-to-nearest codes (its Quantizer.find_params min-max rule; the Hessian-based
    error compensation needs calibration data and does not change the layout), packed by
    AutoGPTQ's QuantLinear.pack into the v1 format: qweight [in*bits/32, out] packed along
    the input, qzeros [groups, out*bits/32] holding zero - 1, scales [groups, out] f16,
    g_idx [in]. The reference weight is QuantLinear's own dequantization (its forward on the
    identity), with the scales widened to f32."""
    QuantLinear = gptq_quant_linear()
    rows, cols = w.shape
    group = cols if group < 0 else group  # -1: one group per row
    maxq = (1 << bits) - 1
    if act_order:
        perm = torch.randperm(cols, generator=torch.Generator().manual_seed(seed))
        g_idx = torch.empty(cols, dtype=torch.int32)
        g_idx[perm] = (torch.arange(cols) // group).to(torch.int32)
    else:
        g_idx = (torch.arange(cols) // group).to(torch.int32)
    groups = cols // group
    scales = torch.empty(rows, groups)
    zeros = torch.empty(rows, groups)
    for g in range(groups):
        wg = w[:, g_idx == g].to(torch.float32)
        mx, mn = wg.amax(1).clamp(min=0), wg.amin(1).clamp(max=0)
        if sym:
            mx = torch.maximum(mn.abs(), mx)
            mn = -mx
        sc = ((mx - mn).clamp(min=1e-8) / maxq).to(torch.float16).to(torch.float32)
        z = torch.full_like(sc, (maxq + 1) / 2) if sym else torch.round(-mn / sc)
        scales[:, g], zeros[:, g] = sc, z
    sc, zc = scales[:, g_idx.long()], zeros[:, g_idx.long()]
    fake = (torch.clamp(torch.round(w / sc) + zc, 0, maxq) - zc) * sc
    lin = torch.nn.Linear(cols, rows, bias=False).to(torch.float16)
    lin.weight.data = fake.to(torch.float16)
    q = QuantLinear(bits, group, cols, rows, False, weight_dtype=torch.float16)
    q.pack(lin, scales.to(torch.float16), zeros.to(torch.float16), g_idx)
    q.scales = q.scales.to(torch.float32)
    with torch.no_grad():
        deq = q(torch.eye(cols, dtype=torch.float32)).T.contiguous()
    return (q.qweight.contiguous(), q.qzeros.contiguous(), q.scales.to(torch.float16).contiguous(),
            q.g_idx.to(torch.int32).contiguous(), deq.to(torch.float32))


def gptq_fixture(name, hub, cfg_json, out, bits, group, act_order, sym):
    d = os.path.join(out, name)
    shutil.rmtree(d, ignore_errors=True)
    os.makedirs(d)
    tensors, deq = {}, {}
    for i, (k, w) in enumerate(sorted(hub.items())):
        # QuantLinear.pack sizes qzeros as out // 32 * bits words: matrices whose rows are
        # not a multiple of 32 (b_proj, kv_a) stay f32.
        if not quantizable(k, w) or w.shape[0] % 32:
            tensors[k] = w
            deq[k] = w
            continue
        qw, qz, sc, g_idx, dq = gptq_pack(w, bits, group, act_order, sym, i)
        base = k[: -len(".weight")]
        tensors.update({base + ".qweight": qw, base + ".qzeros": qz, base + ".scales": sc,
                        base + ".g_idx": g_idx})
        deq[k] = dq
    cfg = dict(cfg_json)
    cfg["quantization_config"] = {"quant_method": "gptq", "bits": bits, "group_size": group,
                                  "desc_act": act_order, "sym": sym, "checkpoint_format": "gptq",
                                  "true_sequential": True, "damp_percent": 0.01}
    write(d, tensors, cfg)
    return d, deq, {"tool": "AutoGPTQ 0.7.1 QuantLinear.pack (qlinear_cuda.py) on round-to-nearest GPTQ codes",
                    "covers": [f"GPTQ {bits}-bit, group {group}, {'act-order g_idx' if act_order else 'ordered g_idx'}, "
                               f"{'symmetric' if sym else 'asymmetric'}", "v1 zero points (stored minus one)"]}


# ---------------------------------------------------------------------------- fine-grained FP8
def fp8_block_fixture(hub, cfg_json, out, block=128):
    """`quant_method: fp8` with 128 x 128 blocks, as transformers' FineGrainedFP8 quantizes."""
    d = os.path.join(out, "fp8-block")
    shutil.rmtree(d, ignore_errors=True)
    os.makedirs(d)
    tensors, deq = {}, {}
    fmax = torch.finfo(torch.float8_e4m3fn).max
    for k, w in hub.items():
        if not quantizable(k, w):
            tensors[k] = w
            deq[k] = w
            continue
        rows, cols = w.shape
        sr, sc = math.ceil(rows / block), math.ceil(cols / block)
        scale_inv = torch.empty(sr, sc)
        q = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
        for i in range(sr):
            for j in range(sc):
                t = w[i * block:(i + 1) * block, j * block:(j + 1) * block]
                s = (t.abs().amax().clamp(min=1e-12) / fmax).to(torch.float32)
                q[i * block:(i + 1) * block, j * block:(j + 1) * block] = (t / s).clamp(-fmax, fmax).to(torch.float8_e4m3fn)
                scale_inv[i, j] = s
        base = k[: -len(".weight")]
        tensors[k] = q
        tensors[base + ".weight_scale_inv"] = scale_inv
        rep = scale_inv.repeat_interleave(block, 0)[:rows].repeat_interleave(block, 1)[:, :cols]
        deq[k] = q.to(torch.float32) * rep
    cfg = dict(cfg_json)
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": [block, block]}
    write(d, tensors, cfg)
    return d, deq, {"tool": "fine-grained FP8 layout (Kimi K2 / DeepSeek V3: F8_E4M3 weight, f32 weight_scale_inv "
                            "per 128x128 block)", "covers": ["quant_method fp8, weight_block_size [128, 128]"]}


def quantizable(k, w):
    return (w.dim() == 2 and k.endswith(".weight") and "norm" not in k and "embed" not in k
            and "lm_head" not in k and not k.endswith("block_sparse_moe.gate.weight"))


def write(d, tensors, cfg):
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(d, "model.safetensors"),
              metadata={"format": "pt"})
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
        f.write("\n")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    s = mf.full_spec(SPEC)
    tmp = tempfile.mkdtemp(prefix="kq_")
    base = os.path.join(tmp, "base")
    cfg = build_base(s, base)
    hub = to_hub(read_dir(base), s)
    with open(os.path.join(base, "config.json")) as f:
        cfg_json = json.load(f)
    made = []
    for name, recipe, covers in ct_recipes():
        made.append(llmcompressor_fixture(name, base, args.out, recipe, covers))
    made.append(awq_fixture(base, hub, cfg_json, args.out))
    made.append(gptq_fixture("gptq-4bit-actorder", hub, cfg_json, args.out, 4, 32, True, False))
    made.append(gptq_fixture("gptq-8bit-sym", hub, cfg_json, args.out, 8, -1, False, True))
    made.append(fp8_block_fixture(hub, cfg_json, args.out))
    for d, deq, meta in made:
        meta = dict(meta, name=os.path.basename(d), base_model=dict(
            (k, s[k]) for k in ("mixers", "hidden", "intermediate", "moe_intermediate", "experts", "top_k",
                                "kda_heads", "kda_head_dim", "mla_heads", "kv_lora", "vocab", "seed")))
        reference(d, to_hub(deq, s), cfg, s, d, meta)
        for fn in os.listdir(d):
            os.chmod(os.path.join(d, fn), 0o644)
        print(d, sum(os.path.getsize(os.path.join(d, f)) for f in os.listdir(d)), "bytes")
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
