#!/usr/bin/env python3
"""Writes assets/demo-tokenizer/: a small but real-format Kimi-style tiktoken tokenizer.

Stdlib only. Learns a byte-level BPE (NUM_MERGES merges) from the text below, pre-split with an
ASCII approximation of Kimi's regex (Python `re` has no \\p{..}; the merges only need to be
valid), and writes

  tiktoken.model         base64(token bytes) <rank>; ranks 0..255 are the single bytes in byte
                         order, then the merges in the order they were learnt
  tokenizer_config.json  Kimi's special-token layout at n_base + the offsets of Kimi's table
                         (spec section 9.3), bos/eos/pad/unk, and the chat template
  chat_template.jinja    the Kimi Linear chat template (written by hand; read, not generated)

Run from the repository root:  python3 scripts/make_demo_tokenizer.py
The output is deterministic.
"""

import base64
import collections
import json
import pathlib
import re

NUM_MERGES = 700
OUT = pathlib.Path(__file__).resolve().parent.parent / "assets" / "demo-tokenizer"

# Kimi's special tokens as offsets from n_base (spec section 9.3: [BOS] = 163584 = n_base).
# Offsets not named here become <|reserved_token_{id}|> in the loader.
SPECIAL_OFFSETS = {
    0: "[BOS]",
    1: "[EOS]",
    2: "<|im_end|>",
    3: "<|im_user|>",
    4: "<|im_assistant|>",
    6: "<|start_header_id|>",
    7: "<|end_header_id|>",
    9: "[EOT]",
    10: "<|im_system|>",
    11: "<|tool_calls_section_begin|>",
    12: "<|tool_calls_section_end|>",
    13: "<|tool_call_begin|>",
    14: "<|tool_call_argument_begin|>",
    15: "<|tool_call_end|>",
    17: "<|im_middle|>",
    254: "[UNK]",
    255: "[PAD]",
}

# Approximation of Kimi's pre-split regex (spec section 9.2) with Python `re`:
# letters are [^\W\d_], upper case is approximated by A-Z.
LETTER = r"[^\W\d_]"
PATTERN = re.compile(
    "|".join(
        [
            r"[\u4e00-\u9fff]+",
            r"[^\r\n\w]?[A-Z]*(?:(?![A-Z])" + LETTER + r")+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
            r"[^\r\n\w]?[A-Z]+(?:(?![A-Z])" + LETTER + r")*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
            r"\d{1,3}",
            r" ?[^\s\w]+[\r\n]*",
            r"\s*[\r\n]+",
            r"\s+(?!\S)",
            r"\s+",
        ]
    )
)

# Training text: written for this repository (no third-party text), a few KB of plain English
# about the things a demo model talks about, plus chat-template and tool-call vocabulary.
CORPUS = """
The assistant reads the question, thinks about it, and then writes a short and helpful answer.
A user may ask about the weather, the time, a number, a word, or a piece of code. When the user
asks for the weather in a city, the assistant calls the tool get_weather with the city as its
argument, waits for the tool to return, and then tells the user what the tool said. When the
user asks what time it is, the assistant calls get_time with the time zone. The system message
sets the rules: be kind, be brief, be correct, and say so when you do not know.

Is 123 a prime? No, it is not, because 123 = 3 * 41. Is 127 a prime? Yes, it is. The first
primes are 2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41, 43, 47, 53, 59, 61, 67, 71, 73, 79,
83, 89 and 97. The sum of 45 and 78 is 123, and 12 times 12 is 144. There are 60 minutes in an
hour, 24 hours in a day, 7 days in a week, and 365 days in most years.

Once upon a time there was a small town by the sea. Every morning the fishermen went out in
their boats, and every evening they came home with the day's catch. The children played on
the beach, the old people sat in the sun, and the baker sold warm bread to everyone who
walked past his shop. One day a stranger arrived with a map, a lamp, and a long story about
a hidden garden on the hill. Nobody believed him at first, but the children followed him up
the narrow path, and there, behind a wall of stones, they found the garden: apple trees,
roses, a quiet pond, and a bench where you could see the whole town and the sea beyond it.

Language models read text as tokens. A tokenizer splits the text into pieces, and each piece
is turned into a number. The model then predicts the next token, one at a time, and the
tokenizer turns the numbers back into text. Byte pair encoding starts from single bytes and
learns to merge the pairs that occur most often, so common words become one token while rare
words are spelled out from smaller parts. Streaming output must never split a character in
the middle: the decoder holds back incomplete bytes until the character is complete.

def add(a, b):
    return a + b

for i in range(10):
    print(i, add(i, i))

fn main() {
    let numbers = vec![1, 2, 3];
    let total: i32 = numbers.iter().sum();
    println!("total = {}", total);
}

{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}
{"type": "function", "function": {"name": "get_time", "parameters": {"type": "object",
"properties": {"tz": {"type": "string", "description": "The time zone"}}, "required": ["tz"]}}}
functions.get_weather:0 functions.get_time:1 tool_declare system user assistant tool
## Return of functions.get_weather:0
It is sunny and 21 degrees in Paris. It is cloudy and 14 degrees in London.

Good morning! How are you today? I am fine, thank you. What would you like to do? Let me check.
I can help you with that. Here is what I found. Please tell me more about what you need.
Thank you for waiting. The answer is yes. The answer is no. I don't know, but I'll find out.
We're going to the market; they've got fresh fruit, and you'll like the apples. It's late.
"""


def pieces(text):
    return [m.group(0).encode("utf-8") for m in PATTERN.finditer(text)]


def train(text, num_merges):
    """Byte-level BPE: returns the merged tokens' bytes in the order learnt (ranks 256..)."""
    words = collections.Counter(tuple(piece) for piece in pieces(text))
    vocab = [bytes([b]) for b in range(256)]
    seen = set(vocab)
    words = {tuple(vocab[b] for b in word): count for word, count in words.items()}
    merges = []
    while len(merges) < num_merges:
        pairs = collections.Counter()
        for word, count in words.items():
            for a, b in zip(word, word[1:]):
                pairs[(a, b)] += count
        if not pairs:
            raise SystemExit(f"corpus supports only {len(merges)} merges")
        # Most frequent pair; ties broken by the pair's bytes so the output is deterministic.
        (a, b), _ = min(pairs.items(), key=lambda item: (-item[1], item[0]))
        merged = a + b
        if merged not in seen:
            seen.add(merged)
            merges.append(merged)
        new_words = {}
        for word, count in words.items():
            out, i = [], 0
            while i < len(word):
                if i + 1 < len(word) and word[i] == a and word[i + 1] == b:
                    out.append(merged)
                    i += 2
                else:
                    out.append(word[i])
                    i += 1
            key = tuple(out)
            new_words[key] = new_words.get(key, 0) + count
        words = new_words
    return vocab + merges


def main():
    tokens = train(CORPUS, NUM_MERGES)
    n_base = len(tokens)
    OUT.mkdir(parents=True, exist_ok=True)
    with open(OUT / "tiktoken.model", "w", encoding="ascii", newline="\n") as f:
        for rank, token in enumerate(tokens):
            f.write(f"{base64.b64encode(token).decode('ascii')} {rank}\n")

    template = (OUT / "chat_template.jinja").read_text(encoding="utf-8")
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
            name for name in SPECIAL_OFFSETS.values() if name.startswith("<|")
        ],
        "bos_token": "[BOS]",
        "clean_up_tokenization_spaces": False,
        "eos_token": "[EOS]",
        "model_max_length": 8192,
        "pad_token": "[PAD]",
        "tokenizer_class": "TikTokenTokenizer",
        "unk_token": "[UNK]",
        "chat_template": template,
    }
    with open(OUT / "tokenizer_config.json", "w", encoding="utf-8", newline="\n") as f:
        json.dump(config, f, indent=2, ensure_ascii=False)
        f.write("\n")
    print(f"n_base = {n_base}, vocab_size = {n_base + 258}")
    for offset, name in sorted(SPECIAL_OFFSETS.items()):
        print(f"  {n_base + offset:5d} {name}")


if __name__ == "__main__":
    main()
