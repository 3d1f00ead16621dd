#!/usr/bin/env python3
"""Writes a Kimi-format tokenizer (tiktoken.model + tokenizer_config.json) whose vocabulary
covers a random-weight model's full vocab_size, for serving benchmarks of configs without a
checkpoint (e.g. the 48B shapes: 163,840 ids). The 256 byte tokens come first, then distinct
synthetic ASCII pieces (" w<n>"), then 256 special tokens laid out as Kimi's (the last 256
ids; [BOS], [EOS], <|im_end|> ... from the demo tokenizer). Text is meaningless; ids decode.

  python3 bench/synthetic_tokenizer.py --vocab 163840 --out target/synthetic-tokenizer
"""
import argparse
import base64
import json
import os
import shutil

HERE = os.path.dirname(os.path.abspath(__file__))
DEMO = os.path.join(HERE, "..", "assets", "demo-tokenizer")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--vocab", type=int, required=True)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    n_special = 256
    n_base = a.vocab - n_special
    assert n_base > 256, "vocabulary too small"
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "tiktoken.model"), "w") as f:
        for i in range(256):
            f.write(f"{base64.b64encode(bytes([i])).decode()} {i}\n")
        for i in range(256, n_base):
            f.write(f"{base64.b64encode(f' w{i}'.encode()).decode()} {i}\n")
    cfg = json.load(open(os.path.join(DEMO, "tokenizer_config.json")))
    demo_base = min(int(k) for k in cfg["added_tokens_decoder"])
    cfg["added_tokens_decoder"] = {
        str(int(k) - demo_base + n_base): v for k, v in cfg["added_tokens_decoder"].items()
    }
    cfg["model_max_length"] = 1048576
    json.dump(cfg, open(os.path.join(a.out, "tokenizer_config.json"), "w"), indent=1)
    tmpl = os.path.join(DEMO, "chat_template.jinja")
    if os.path.exists(tmpl):
        shutil.copy(tmpl, a.out)
    print(f"wrote {a.out}: {n_base} base + {n_special} special tokens")


if __name__ == "__main__":
    main()
