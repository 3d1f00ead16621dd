#!/usr/bin/env python3
"""Cross-check K3 fixtures against mlx-lm's independent implementation (mlx_lm.models.kimi_k3).

For each fixture directory: copy it to a temporary directory (the fixture itself is never
changed), hoist `text_config.quantization_config` to the top level there (mlx-lm's loader reads
the top level; 0.32.2 also hoists it itself), load it with mlx_lm on the CPU, cast every BF16
parameter to float32 (BF16 activations flip expert choices), keep the MXFP4 experts packed
(mlx-lm's own mxfp4 kernels decode them), and compute logits for the fixture's prompt in one
pass. Reports max|a-b| and max|a-b| / max|b| against the float64 NumPy reference (`logits.npy`,
from scripts/k3_reference.py), top-1 agreement per position, and the greedy continuation mlx
produces by repeated full forward passes.

Needs: pip install numpy safetensors "mlx[cpu]" mlx-lm==0.32.2
Run from the repository root:
    python3 scripts/check_k3_mlx.py [fixtures/kimi-k3/<name> ...]     (default: all fixtures)
"""

import glob
import json
import os
import shutil
import sys
import tempfile

import numpy as np

import mlx.core as mx
import mlx_lm
from mlx.utils import tree_map
from mlx_lm.utils import load_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load_f32(d):
    """mlx-lm model for fixture dir d, with float32 parameters, from a temporary copy."""
    mx.set_default_device(mx.cpu)
    tmp = tempfile.mkdtemp(prefix="k3mlx-")
    try:
        for fn in glob.glob(os.path.join(d, "*.safetensors")) + [os.path.join(d, "model.safetensors.index.json")]:
            shutil.copyfile(fn, os.path.join(tmp, os.path.basename(fn)))
        with open(os.path.join(d, "config.json")) as f:
            config = json.load(f)
        if "quantization_config" not in config and "quantization_config" in config.get("text_config", {}):
            config["quantization_config"] = config["text_config"]["quantization_config"]
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(config, f)
        from pathlib import Path
        model, _ = load_model(Path(tmp))
        model.update(tree_map(lambda a: a.astype(mx.float32) if a.dtype == mx.bfloat16 else a,
                              model.parameters()))
        mx.eval(model.parameters())
        return model
    finally:
        shutil.rmtree(tmp)


def logits_of(model, ids):
    out = model(mx.array([list(ids)], dtype=mx.int32))
    mx.eval(out)
    return np.array(out[0].astype(mx.float32)).astype(np.float64)


def compare(d, prompt, ref_logits, greedy_prompt=None, ref_new=None):
    """Agreement figures of mlx-lm vs the NumPy reference for one fixture (a JSON-able dict)."""
    model = load_f32(d)
    a = logits_of(model, prompt)
    err = np.abs(a - ref_logits)
    res = {
        "mlx_lm": mlx_lm.__version__,
        "mlx": mx.__version__,
        "device": "cpu",
        "param_dtype": "float32 (BF16 cast up; experts kept as MXFP4, decoded by mlx)",
        "max_abs_err": float(err.max()),
        "max_rel_err": float(err.max() / np.abs(ref_logits).max()),
        "max_abs_logit": float(np.abs(ref_logits).max()),
        "argmax_agree": f"{int(np.sum(a.argmax(-1) == ref_logits.argmax(-1)))}/{len(prompt)}",
    }
    if greedy_prompt is not None:
        seq, new = list(greedy_prompt), []
        for _ in range(len(ref_new)):
            tok = int(np.argmax(logits_of(model, seq)[-1]))
            new.append(tok)
            seq.append(tok)
        res["greedy_new_tokens"] = new
        res["greedy_match"] = new == list(ref_new)
    return res


def main():
    dirs = sys.argv[1:] or sorted(glob.glob(os.path.join(ROOT, "fixtures", "kimi-k3", "*", "")))
    for d in dirs:
        d = d.rstrip("/")
        with open(os.path.join(d, "reference.json")) as f:
            ref = json.load(f)
        res = compare(d, ref["prompt_ids"], np.load(os.path.join(d, "logits.npy")),
                      ref["greedy"]["prompt_ids"], ref["greedy"]["new_tokens"])
        print(os.path.basename(d), json.dumps(res))


if __name__ == "__main__":
    main()
