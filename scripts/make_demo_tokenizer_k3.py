#!/usr/bin/env python3
"""Writes assets/demo-tokenizer-k3/: the demo tokenizer with Kimi K3's special-token table.

Stdlib only, deterministic. The BPE is unchanged: `tiktoken.model` is a byte-identical copy of
assets/demo-tokenizer/tiktoken.model (956 ranks, made by scripts/make_demo_tokenizer.py). Only
the special tokens differ. K3 uses the XTML envelope (<|open|> ... <|sep|> ... <|close|>) and
stops at <|end_of_msg|>; its table (K3 spec section 5) is placed at n_base + offset, exactly as
the real tokenizer places it at 163584 + offset:

  tiktoken.model         copied from assets/demo-tokenizer/
  tokenizer_config.json  added_tokens_decoder at 956 + offset, bos [BOS], eos <|end_of_msg|>,
                         pad [PAD], unk [UNK]; NO chat_template (K3 ships none, its prompt is
                         rendered by Python code)

Run from the repository root:  python3 scripts/make_demo_tokenizer_k3.py
"""

import json
import pathlib
import shutil

ROOT = pathlib.Path(__file__).resolve().parent.parent
SRC = ROOT / "assets" / "demo-tokenizer" / "tiktoken.model"
OUT = ROOT / "assets" / "demo-tokenizer-k3"

# K3 special tokens as offsets from n_base (K3 spec section 5: [BOS] = 163584 = n_base).
# Offsets not named here become <|reserved_token_{id}|> in the loader.
SPECIAL_OFFSETS = {
    0: "[BOS]",
    1: "[EOS]",
    2: "<|end_of_msg|>",
    3: "<|open|>",
    4: "<|close|>",
    5: "<|sep|>",
    6: "[start_header_id]",
    7: "[end_header_id]",
    9: "[EOT]",
    18: "<|media_begin|>",
    19: "<|media_content|>",
    20: "<|media_end|>",
    21: "<|media_pad|>",
    254: "[UNK]",
    255: "[PAD]",
}


def main():
    OUT.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(SRC, OUT / "tiktoken.model")
    # n_base = number of ranks in the BPE file (one "base64 rank" line each).
    with open(SRC, "rb") as f:
        n_base = sum(1 for line in f if line.strip())

    added = {
        str(n_base + offset): {
            "content": name,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for offset, name in sorted(SPECIAL_OFFSETS.items())
    }
    config = {
        "added_tokens_decoder": added,
        "additional_special_tokens": [
            name for _, name in sorted(SPECIAL_OFFSETS.items()) if name.startswith("<|")
        ],
        "bos_token": "[BOS]",
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|end_of_msg|>",
        "model_max_length": 8192,
        "pad_token": "[PAD]",
        "tokenizer_class": "TikTokenTokenizer",
        "unk_token": "[UNK]",
    }
    with open(OUT / "tokenizer_config.json", "w", encoding="utf-8", newline="\n") as f:
        json.dump(config, f, indent=2, ensure_ascii=False)
        f.write("\n")
    print(f"n_base = {n_base}, vocab_size = {n_base + 256}")
    for offset, name in sorted(SPECIAL_OFFSETS.items()):
        print(f"  {n_base + offset:5d} {name}")


if __name__ == "__main__":
    main()
