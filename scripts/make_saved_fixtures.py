#!/usr/bin/env python3
"""Kimi Linear fixtures exactly as transformers' `save_pretrained` writes them.

transformers >= 5.17 does not write the hub layout for every tensor (see
fixtures/kimi-linear/README.md): by default (`save_original_format=True`) it undoes its weight
conversions on save, but its `.block_sparse_moe. -> .mlp.` renaming is undone for dense MLP layers
too, so those are written as `model.layers.N.block_sparse_moe.{gate,up,down}_proj.weight`; with
`save_original_format=False` it writes its in-memory names (fused `experts.gate_up_proj` /
`experts.down_proj`, fused `conv1d`, `forget_gate.*`, `mlp.*`).

For each twin in TWINS this script rebuilds the model of an existing hub-layout fixture exactly as
scripts/make_fixtures.py does (same config, seed, re-initialisation and storage dtype), saves it with
`save_pretrained`, and copies that directory as it is (config.json, generation_config.json,
safetensors). The weights are the twin's: every tensor is checked bit for bit against the twin's
hub-layout files after undoing the layout, and the directory is reloaded with
`KimiLinearForCausalLM.from_pretrained(dir, dtype=torch.float64)` and its logits compared with the
twin's logits.npy, which is copied together with the twin's reference.json (name, covers, checkpoint
and reload entries rewritten). Existing fixtures are read, never written.

Run (torch + transformers 5.17; CPU only):

    HF_HUB_OFFLINE=1 python3 scripts/make_saved_fixtures.py --fixtures fixtures/kimi-linear \
        [--out fixtures/kimi-linear]
"""

import argparse
import copy
import json
import os
import re
import shutil
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from transformers import KimiLinearForCausalLM  # noqa: E402

import make_fixtures as mf  # noqa: E402

TWINS = [
    dict(name="native-saved-bf16-freq2", twin="native-bf16-freq2", save_original_format=True,
         covers=["checkpoint exactly as save_pretrained wrote it (save_original_format=True, the default)",
                 "dense MLP layers 0, 1, 3, 5 stored as block_sparse_moe.{gate,up,down}_proj",
                 "save_pretrained's own config.json and generation_config.json"]),
    dict(name="native-saved-fused-f32-short", twin="native-f32-short", save_original_format=False,
         covers=["checkpoint exactly as save_pretrained(save_original_format=False) wrote it: "
                 "transformers' in-memory names",
                 "experts fused into mlp.experts.gate_up_proj [E, 2I, D] (gate rows first) and "
                 "mlp.experts.down_proj [E, D, I]",
                 "q/k/v convolutions fused into self_attn.conv1d.weight [3HK, 1, W] (q|k|v)",
                 "self_attn.forget_gate.{f_a_proj,f_b_proj,A_log,dt_bias}", "MoE layers under mlp.",
                 "save_pretrained's own config.json and generation_config.json"]),
]

DENSE_SAVED = re.compile(r"^(model\.layers\.\d+\.)block_sparse_moe\.((gate|up|down)_proj\.weight)$")


def undo_layout(saved, s, fused):
    """The hub names of a save_pretrained state dict (inverse of what transformers did)."""
    if fused:
        return mf.to_hub(saved, s, set())
    return {(DENSE_SAVED.sub(r"\1mlp.\2", k)): v for k, v in saved.items()}


def build_model(s):
    """The fixture's model, as make_fixtures.make_one builds it before saving."""
    _, _, _, cfg, _, _, _ = mf.build_config(s, lambda *a: None)
    torch.manual_seed(s["seed"])
    model = KimiLinearForCausalLM(cfg)
    model.eval()
    mf.reinit(model, s["seed"])
    mf.cast_storage(model, {"bfloat16": torch.bfloat16, "float32": torch.float32}[s["dtype"]])
    return model


def make_twin(t, fixtures, out, log):
    spec = next(f for f in mf.FIXTURES if f["name"] == t["twin"])
    s = mf.full_spec(spec)
    twin_dir = os.path.join(fixtures, t["twin"])
    with open(os.path.join(twin_dir, "reference.json")) as f:
        twin_ref = json.load(f)
    model = build_model(s)

    d = os.path.join(out, t["name"])
    if os.path.exists(d):
        shutil.rmtree(d)
    tmp = tempfile.mkdtemp(prefix="kl_saved_")
    kw = {"save_original_format": t["save_original_format"]}
    if s.get("shards", 1) > 1:
        total = sum(v.numel() * v.element_size() for v in model.state_dict().values())
        kw["max_shard_size"] = int(total * 0.6)
    model.save_pretrained(tmp, **kw)
    shutil.copytree(tmp, d)
    shutil.rmtree(tmp, ignore_errors=True)
    for fn in os.listdir(d):
        os.chmod(os.path.join(d, fn), 0o644)

    # ---- the weights are the twin's
    saved, saved_files = mf.read_safetensors_dir(d)
    hub, _ = mf.read_safetensors_dir(twin_dir)
    back = undo_layout(saved, s, not t["save_original_format"])
    if set(back) != set(hub):
        raise RuntimeError(f"{t['name']}: names after undoing the layout differ from {t['twin']}: "
                           f"{sorted(set(back) ^ set(hub))[:10]}")
    unequal = [k for k in hub if not torch.equal(back[k], hub[k]) or back[k].dtype != hub[k].dtype]
    if unequal:
        raise RuntimeError(f"{t['name']}: tensors differ from {t['twin']}: {unequal[:10]}")
    only_saved = sorted(set(saved) - set(hub))
    only_hub = sorted(set(hub) - set(saved))

    # ---- transformers reads the directory back; its logits are the twin's
    model64, info = KimiLinearForCausalLM.from_pretrained(
        d, dtype=torch.float64, attn_implementation="eager", experts_implementation="eager",
        output_loading_info=True)
    model64.eval()
    def info_keys(k):
        return info.get(k, []) if isinstance(info, dict) else getattr(info, k, [])

    keys = {k: sorted(str(x) for x in info_keys(k))[:40]
            for k in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs")}
    ids = torch.tensor(twin_ref["prompt_ids"])[None]
    with torch.no_grad():
        logits = model64(input_ids=ids, use_cache=False).logits[0].numpy()
    want = np.load(os.path.join(twin_dir, "logits.npy"))
    diff = float(np.abs(logits - want).max())
    if any(keys[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")) or diff != 0.0:
        raise RuntimeError(f"{t['name']}: from_pretrained keys {keys}, logits differ by {diff}")
    shutil.copy(os.path.join(twin_dir, "logits.npy"), os.path.join(d, "logits.npy"))

    ref = copy.deepcopy(twin_ref)
    call = "model.save_pretrained(dir)" if t["save_original_format"] else \
        "model.save_pretrained(dir, save_original_format=False)"
    ref["name"] = t["name"]
    ref["twin_of"] = t["twin"]
    ref["covers"] = t["covers"] + [c for c in twin_ref["covers"]]
    ref["checkpoint"] = {
        "layout": f"as written by transformers {transformers.__version__} {call}, copied unchanged",
        "save_pretrained_call": call,
        "files": sorted(os.listdir(d)),
        "safetensors_files": saved_files,
        "tensor_count": len(saved),
        "names_not_in_hub_layout": {k: [list(saved[k].shape), mf.dtype_name(saved[k])] for k in only_saved},
        "hub_names_not_stored": only_hub if len(only_hub) <= 40 else only_hub[:40] + [f"... {len(only_hub)} in all"],
        "hub_names_not_stored_count": len(only_hub),
        "weights": f"{len(hub)} of {len(hub)} tensors bit-identical (values and dtypes) to {t['twin']}'s "
                   "hub-layout files after undoing the layout",
    }
    ref["reload"] = {
        "config_used": "the fixture's own config.json (as save_pretrained wrote it)",
        **keys,
        "max_abs_logit_diff_vs_twin_logits": diff,
        "logits": f"logits.npy copied from {t['twin']} (equal to this directory's from_pretrained logits)",
    }
    ref["deviations"] = [x for x in twin_ref.get("deviations", []) if "save_pretrained did not write" not in x]
    ref["transformers_version"] = transformers.__version__
    ref["torch_version"] = torch.__version__
    with open(os.path.join(d, "reference.json"), "w") as f:
        json.dump(ref, f, indent=1)
        f.write("\n")
    for fn in os.listdir(d):
        os.chmod(os.path.join(d, fn), 0o644)
    size = sum(os.path.getsize(os.path.join(d, x)) for x in os.listdir(d))
    log(f"{t['name']}: {len(saved)} tensors, {len(only_saved)} not in the hub layout, "
        f"{len(only_hub)} hub names not stored, {size} bytes, logits diff {diff}")
    return ref


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--fixtures", required=True, help="the hub-layout fixtures (fixtures/kimi-linear)")
    ap.add_argument("--out", help="where the new directories go (default: --fixtures)")
    ap.add_argument("--only", help="comma-separated twin names")
    args = ap.parse_args()
    torch.set_num_threads(min(8, os.cpu_count() or 1))
    out = args.out or args.fixtures
    os.makedirs(out, exist_ok=True)
    for t in TWINS:
        if args.only and t["name"] not in args.only.split(","):
            continue
        make_twin(t, args.fixtures, out, lambda *a: print(*a, flush=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
