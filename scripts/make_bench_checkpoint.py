#!/usr/bin/env python3
"""A mid-sized random Kimi Linear checkpoint in bf16 for the quantization benchmarks.

Hidden 1024, four layers (KDA, KDA, KDA, MLA; layer 0 dense, then MoE with 16 experts of 512,
top-2, one shared expert), KDA 8 heads x 128, MLA 8 heads (nope 128, rope 64, v 128,
kv_lora 512), vocab 1212 (the demo tokenizer's, copied beside it so that `perplexity` reads
it): about 115 M parameters, 230 MB. Weights follow scripts/make_fixtures.py's
re-initialisation rules (seed 4343); saved with transformers' save_pretrained.

    python3 scripts/make_bench_checkpoint.py --out models/bench-bf16
"""

import argparse
import os
import shutil
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from transformers import KimiLinearForCausalLM  # noqa: E402

import make_fixtures as mf  # noqa: E402

SPEC = dict(
    name="bench", schema="hub", dtype="bfloat16", T=16, seed=4343, mixers="KKKM", first_k=1,
    experts=16, groups=1, topk_group=1, top_k=2, shared=1, renorm=True, conv=4,
    hidden=1024, intermediate=2816, moe_intermediate=512, kda_heads=8, kda_head_dim=128,
    mla_heads=8, nope=128, rope=64, v=128, kv_lora=512, vocab=1212, bos=956, eos=958, pad=1211,
)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    s = mf.full_spec(SPEC)
    _, _, _, cfg, _, _, _ = mf.build_config(s, lambda *a: None)
    torch.manual_seed(s["seed"])
    model = KimiLinearForCausalLM(cfg)
    model.eval()
    mf.reinit(model, s["seed"])
    mf.cast_storage(model, torch.bfloat16)
    model.save_pretrained(args.out)
    tok = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "assets", "demo-tokenizer")
    for f in os.listdir(tok):
        shutil.copy(os.path.join(tok, f), os.path.join(args.out, f))


if __name__ == "__main__":
    main()
