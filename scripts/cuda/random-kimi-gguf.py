#!/usr/bin/env python3
"""A Kimi Linear GGUF with random bf16 weights, as llama.cpp (commit 0c1e57098) reads it.

Writes what `kimi-infer convert --random-config CONFIG --quant bf16` writes (names, shapes, types
and `kimi-linear.*` metadata of crates/kimi-model/src/gguf_kimi, which follow llama.cpp's
convert_hf_to_gguf.py `KimiLinearModel`), without kimi-infer: for the GPU machine, which has
python3 and numpy but no Rust. Values are drawn as `RandomWeights` draws them (other numbers,
same distributions): matrices uniform in +-1/sqrt(fan_in) stored as bf16, norms 1 +- 0.05,
`ssm_a` = -exp(A_log) with A in [1, 16), `ssm_dt.bias` and the router bias `exp_probs_b` in
+-0.1; norms, routers, convolutions and the vectors in f32 (as llama.cpp's converter keeps them).

The vocabulary is Kimi's tiktoken one as kimi-infer's converter writes it (gpt2 BPE, pre
`kimi-k2`): by default the committed demo tokenizer (assets/demo-tokenizer: 956 ranks and 258
specials), padded to the config's vocab_size with `[PAD{id}]` tokens of type UNUSED as llama.cpp's
converter pads.

Tensors are generated in chunks on several threads and written as they come, so memory stays
small whatever the model's size (the 48B config cut to 8 layers is about 28 GB).

    python3 scripts/cuda/random-kimi-gguf.py --config crates/kimi-core/tests/data/kimi-linear-48b-a3b-instruct.config.json \
        --layers 8 --out /tmp/kimi-48b-8l.gguf [--write-config /tmp/kimi-48b-8l.config.json]

Needs numpy and llama.cpp's gguf-py: `--gguf-py DIR`, else $GGUF_PY, /tmp/llama.cpp/gguf-py (where
device-bench.sh unpacks scripts/cuda/llamacpp-src.sh's tarball) or bench/llamacpp/build.sh's source.
scripts/cuda/kimi-linear-tiny.config.json gives a 90 M-parameter file of the same structure (KKKM,
16 experts) for a quick check with a CPU build of llama-bench.
"""

from __future__ import annotations

import argparse
import base64
import concurrent.futures as cf
import collections
import json
import os
import sys
import time
import types
import zlib

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CHUNK = 1 << 24  # values per generated chunk (64 MiB of f32 scratch per thread)

TOKEN_NORMAL, TOKEN_CONTROL, TOKEN_UNUSED = 1, 3, 5


def import_gguf(path: str | None):
    for p in [path, os.environ.get("GGUF_PY"), "/tmp/llama.cpp/gguf-py",
              os.path.join(REPO, "target/llamacpp/src/llama_cpp_python-0.3.36/vendor/llama.cpp/gguf-py")]:
        if p and os.path.isdir(os.path.join(p, "gguf")):
            sys.path.insert(0, p)
            break
    try:
        import yaml  # noqa: F401  (gguf-py's metadata module imports it; unused here)
    except ImportError:
        sys.modules["yaml"] = types.ModuleType("yaml")
    import gguf
    return gguf


# --- config -----------------------------------------------------------------------------------

def cut_config(c: dict, layers: int | None) -> dict:
    """The config cut to `layers` layers, as device-bench.sh's k3-stack stage cuts K3's."""
    if layers is None:
        return c
    c = json.loads(json.dumps(c))
    t = c.get("text_config", c)
    if layers > t["num_hidden_layers"]:
        sys.exit(f"--layers {layers}: the config has only {t['num_hidden_layers']}")
    t["num_hidden_layers"] = layers
    la = t["linear_attn_config"]
    for k in ("kda_layers", "full_attn_layers"):
        la[k] = [i for i in la[k] if i <= layers]
    return c


class Model:
    """The parts of a Kimi Linear config.json the GGUF needs (kimi-core's reading of it)."""

    def __init__(self, c: dict):
        if c.get("model_type") not in (None, "kimi_linear") or "text_config" in c:
            sys.exit(f"only Kimi Linear configs (model_type kimi_linear), not {c.get('model_type')}")
        self.c = c
        self.hidden = c["hidden_size"]
        self.n_layers = c["num_hidden_layers"]
        self.vocab = c["vocab_size"]
        self.intermediate = c["intermediate_size"]
        la = c["linear_attn_config"]
        kda = {i - 1 for i in la.get("kda_layers", [])}
        full = {i - 1 for i in la.get("full_attn_layers", [])}
        if kda & full or (kda | full) != set(range(self.n_layers)):
            sys.exit("linear_attn_config: kda_layers and full_attn_layers must cover each layer once")
        self.mixers = ["mla" if i in full else "kda" for i in range(self.n_layers)]
        self.kda_heads, self.kda_dim = la["num_heads"], la["head_dim"]
        self.conv = la["short_conv_kernel_size"]
        self.mla_heads = c["num_attention_heads"]
        self.q_lora = c.get("q_lora_rank")
        self.kv_lora = c["kv_lora_rank"]
        self.nope, self.rope, self.v = c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"]
        self.experts = c.get("num_experts") or 0
        first, freq = c.get("first_k_dense_replace", 0), c.get("moe_layer_freq", 1)
        self.ffns = ["moe" if self.experts and i >= first and i % freq == 0 else "dense"
                     for i in range(self.n_layers)]
        lead = next((i for i, f in enumerate(self.ffns) if f == "moe"), self.n_layers)
        if any(f == "dense" for f in self.ffns[lead:]):
            sys.exit("llama.cpp reads only leading_dense_block_count: dense layers must come first")
        self.lead_dense = lead
        self.top_k = c.get("num_experts_per_token")
        self.expert_width = c.get("moe_intermediate_size")
        self.shared = c.get("num_shared_experts", 0)
        if c.get("tie_word_embeddings"):
            sys.exit("tied embeddings are not written (kimi-linear checkpoints have an lm_head)")

    def metadata(self):
        """(key, value, GGUF type) in kimi-infer's converter's order (gguf_kimi/config.rs)."""
        c, A = self.c, "kimi-linear."
        heads = [self.kda_heads if m == "kda" else self.mla_heads for m in self.mixers]
        m = [
            (A + "block_count", self.n_layers, "u32"),
            (A + "context_length", c.get("max_position_embeddings") or c["model_max_length"], "u32"),
            (A + "embedding_length", self.hidden, "u32"),
            (A + "feed_forward_length", self.intermediate, "u32"),
            (A + "attention.head_count", heads[0] if len(set(heads)) == 1 else heads,
             "u32" if len(set(heads)) == 1 else "i32[]"),
            (A + "attention.head_count_kv", [int(x == "mla") for x in self.mixers], "i32[]"),
        ]
        theta = c.get("rope_theta") or (c.get("rope_parameters") or {}).get("rope_theta")
        if theta is not None:
            m.append((A + "rope.freq_base", float(theta), "f32"))
        m.append((A + "attention.layer_norm_rms_epsilon", c["rms_norm_eps"], "f32"))
        if self.experts:
            m += [
                (A + "expert_count", self.experts, "u32"),
                (A + "expert_used_count", self.top_k, "u32"),
                (A + "expert_group_count", c.get("num_expert_group", 1), "u32"),
                (A + "expert_group_used_count", c.get("topk_group", 1), "u32"),
                (A + "expert_gating_func", 2, "u32"),  # sigmoid
            ]
        m.append((A + "attention.key_length", self.kv_lora + self.rope, "u32"))
        if c.get("head_dim") is not None:
            m.append((A + "attention.value_length", c["head_dim"], "u32"))
        m += [
            (A + "vocab_size", self.vocab, "u32"),
            (A + "ssm.conv_kernel", self.conv, "u32"),
            (A + "kda.head_dim", self.kda_dim, "u32"),
        ]
        if self.q_lora:
            m.append((A + "attention.q_lora_rank", self.q_lora, "u32"))
        m += [
            (A + "attention.kv_lora_rank", self.kv_lora, "u32"),
            (A + "rope.dimension_count", self.rope, "u32"),
            (A + "attention.key_length_mla", self.nope + self.rope, "u32"),
            (A + "attention.value_length_mla", self.v, "u32"),
        ]
        if self.experts:
            m += [
                (A + "expert_feed_forward_length", self.expert_width, "u32"),
                (A + "expert_shared_count", self.shared, "u32"),
                (A + "leading_dense_block_count", self.lead_dense, "u32"),
                (A + "expert_weights_scale", float(c.get("routed_scaling_factor", 1.0)), "f32"),
                (A + "expert_weights_norm", bool(c.get("moe_renormalize", True)), "bool"),
            ]
        return m

    def tensors(self):
        """(name, shape outermost first, kind, fan_in) in the converter's order (recipes.rs)."""
        H, out = self.hidden, []

        def mat(name, shape, fan_in=None):
            out.append((name, tuple(shape), "matrix", fan_in or shape[-1]))

        out.append(("token_embd.weight", (self.vocab, H), "matrix", H))
        for i in range(self.n_layers):
            b = f"blk.{i}"
            out.append((f"{b}.attn_norm.weight", (H,), "norm", 1))
            if self.mixers[i] == "kda":
                h, d, w = self.kda_heads, self.kda_dim, self.conv
                for g in ("attn_q", "attn_k", "attn_v"):
                    mat(f"{b}.{g}.weight", (h * d, H))
                for s in "qkv":
                    out.append((f"{b}.ssm_conv1d_{s}.weight", (1, h * d, 1, w), "conv", w))
                mat(f"{b}.ssm_f_a.weight", (d, H))
                mat(f"{b}.ssm_f_b.weight", (h * d, d))
                mat(f"{b}.ssm_beta.weight", (h, H))
                mat(f"{b}.ssm_g_a.weight", (d, H))
                mat(f"{b}.ssm_g_b.weight", (h * d, d))
                out.append((f"{b}.ssm_a", (1, 1, h, 1), "ssm_a", 1))
                out.append((f"{b}.ssm_dt.bias", (h * d,), "bias", 1))
                out.append((f"{b}.ssm_norm.weight", (d,), "norm", 1))
                mat(f"{b}.attn_output.weight", (H, h * d))
            else:
                h, r = self.mla_heads, self.kv_lora
                if self.q_lora:
                    mat(f"{b}.attn_q_a.weight", (self.q_lora, H))
                    out.append((f"{b}.attn_q_a_norm.weight", (self.q_lora,), "norm", 1))
                    mat(f"{b}.attn_q_b.weight", (h * (self.nope + self.rope), self.q_lora))
                else:
                    mat(f"{b}.attn_q.weight", (h * (self.nope + self.rope), H))
                mat(f"{b}.attn_kv_a_mqa.weight", (r + self.rope, H))
                out.append((f"{b}.attn_kv_a_norm.weight", (r,), "norm", 1))
                # Both halves of kv_b_proj [h * (nope + v), r]: its fan-in is r.
                mat(f"{b}.attn_k_b.weight", (h, r, self.nope), fan_in=r)
                mat(f"{b}.attn_v_b.weight", (h, self.v, r), fan_in=r)
                mat(f"{b}.attn_output.weight", (H, h * self.v))
            out.append((f"{b}.ffn_norm.weight", (H,), "norm", 1))
            if self.ffns[i] == "dense":
                mat(f"{b}.ffn_gate.weight", (self.intermediate, H))
                mat(f"{b}.ffn_up.weight", (self.intermediate, H))
                mat(f"{b}.ffn_down.weight", (H, self.intermediate))
            else:
                e, wd = self.experts, self.expert_width
                out.append((f"{b}.ffn_gate_inp.weight", (e, H), "router", H))
                out.append((f"{b}.exp_probs_b.bias", (e,), "bias", 1))
                mat(f"{b}.ffn_gate_exps.weight", (e, wd, H))
                mat(f"{b}.ffn_up_exps.weight", (e, wd, H))
                mat(f"{b}.ffn_down_exps.weight", (e, H, wd))
                if self.shared:
                    s = self.shared * wd
                    mat(f"{b}.ffn_gate_shexp.weight", (s, H))
                    mat(f"{b}.ffn_up_shexp.weight", (s, H))
                    mat(f"{b}.ffn_down_shexp.weight", (H, s))
        out.append(("output_norm.weight", (H,), "norm", 1))
        mat("output.weight", (self.vocab, H))
        return out


# --- tokenizer --------------------------------------------------------------------------------

def byte_encoder():
    """GPT-2's bytes_to_unicode."""
    printable = [b for b in range(256) if 0x21 <= b <= 0x7E or 0xA1 <= b <= 0xAC or 0xAE <= b <= 0xFF]
    enc, n = {}, 0
    for b in range(256):
        if b in printable:
            enc[b] = chr(b)
        else:
            n += 1
            enc[b] = chr(255 + n)
    return enc


def last_merge(token: bytes, rank: int, ranks: dict):
    """The two parts BPE joins last to form `token` (llama.cpp's QwenModel.bpe(max_rank=rank))."""
    if len(token) < 2:
        return None
    cuts = list(range(len(token) + 1))
    while True:
        best = None
        for i in range(len(cuts) - 2):
            r = ranks.get(token[cuts[i]:cuts[i + 2]])
            if r is not None and r < rank and (best is None or r < best[0]):
                best = (r, i)
        if best is None:
            break
        del cuts[best[1] + 1]
    return (token[:cuts[1]], token[cuts[1]:]) if len(cuts) == 3 else None


def tokenizer_metadata(tok_dir: str, vocab_size: int):
    """`tokenizer.ggml.*` of Kimi's tiktoken vocabulary (kimi-tokenizer's gguf::kimi_metadata)."""
    ranks = {}
    with open(os.path.join(tok_dir, "tiktoken.model"), "rb") as f:
        for line in f:
            if line.strip():
                b64, r = line.split()
                ranks[base64.b64decode(b64)] = int(r)
    n_base = len(ranks)
    by_id = sorted(ranks.items(), key=lambda kv: kv[1])
    if [r for _, r in by_id] != list(range(n_base)):
        sys.exit(f"{tok_dir}/tiktoken.model: ranks are not 0..{n_base - 1}")
    cfg = json.load(open(os.path.join(tok_dir, "tokenizer_config.json")))
    added = {int(k): v["content"] for k, v in cfg.get("added_tokens_decoder", {}).items()}
    specials = {i: added.get(i, f"<|reserved_token_{i}|>") for i in range(n_base, n_base + 258)}
    enc = byte_encoder()
    text = lambda b: "".join(enc[x] for x in b)  # noqa: E731
    tokens, types_, merges = [], [], []
    for i in range(vocab_size):
        if i < n_base:
            b = by_id[i][0]
            tokens.append(text(b))
            types_.append(TOKEN_NORMAL)
            m = last_merge(b, i, ranks)
            if m:
                merges.append(f"{text(m[0])} {text(m[1])}")
        elif i in specials:
            tokens.append(specials[i])
            types_.append(TOKEN_CONTROL)
        else:
            tokens.append(f"[PAD{i}]")
            types_.append(TOKEN_UNUSED)
    name_to_id = {v: k for k, v in specials.items() if k < vocab_size}
    meta = [
        ("tokenizer.ggml.model", "gpt2", "str"),
        ("tokenizer.ggml.pre", "kimi-k2", "str"),
        ("tokenizer.ggml.tokens", tokens, "str[]"),
        ("tokenizer.ggml.token_type", types_, "i32[]"),
    ]
    if merges:
        meta.append(("tokenizer.ggml.merges", merges, "str[]"))
    for key, field in (("bos_token_id", "bos_token"), ("eos_token_id", "eos_token")):
        name = cfg.get(field)
        name = name.get("content") if isinstance(name, dict) else name
        if name in name_to_id:
            meta.append((f"tokenizer.ggml.{key}", name_to_id[name], "u32"))
    tmpl = os.path.join(tok_dir, "chat_template.jinja")
    if os.path.exists(tmpl):
        meta.append(("tokenizer.chat_template", open(tmpl).read(), "str"))
    elif isinstance(cfg.get("chat_template"), str):
        meta.append(("tokenizer.chat_template", cfg["chat_template"], "str"))
    return meta, n_base


# --- values -----------------------------------------------------------------------------------

def stored_f32(name: str, kind: str) -> bool:
    """llama.cpp's converter keeps these in f32 (kimi-model's quant_plan convert_type)."""
    return (kind in ("norm", "router", "conv", "ssm_a", "bias") or name.endswith("_norm.weight")
            or not name.endswith(".weight"))


def gen_chunk(seed: int, n: int, kind: str, fan_in: int, f32: bool) -> bytes:
    rng = np.random.Generator(np.random.PCG64(seed))
    u = rng.random(n, dtype=np.float32)
    if kind in ("matrix", "router", "conv"):
        a = np.float32(1.0 / np.sqrt(max(fan_in, 1)))
        u *= 2 * a
        u -= a
    elif kind == "norm":
        u -= np.float32(0.5)
        u *= np.float32(0.1)
        u += np.float32(1.0)
    elif kind == "ssm_a":  # -exp(A_log), A_log = ln(1 + 15 u)
        u *= np.float32(-15.0)
        u -= np.float32(1.0)
    elif kind == "bias":
        u -= np.float32(0.5)
        u *= np.float32(0.2)
    if f32:
        return u.tobytes()
    bits = u.view(np.uint32)
    bits += np.uint32(0x8000)  # round to the nearest bf16 (ties away from zero)
    bits >>= np.uint32(16)
    return bits.astype(np.uint16).tobytes()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default=os.path.join(
        REPO, "crates/kimi-core/tests/data/kimi-linear-48b-a3b-instruct.config.json"))
    ap.add_argument("--layers", type=int, help="cut num_hidden_layers and the layer lists to N")
    ap.add_argument("--out", required=True)
    ap.add_argument("--write-config", help="also write the (cut) config.json here")
    ap.add_argument("--tokenizer", default=os.path.join(REPO, "assets/demo-tokenizer"),
                    help="a Kimi tokenizer directory (tiktoken.model + tokenizer_config.json)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 4)
    ap.add_argument("--gguf-py", help="llama.cpp's gguf-py directory")
    args = ap.parse_args()
    gguf = import_gguf(args.gguf_py)
    t0 = time.time()

    config = cut_config(json.load(open(args.config)), args.layers)
    if args.write_config:
        with open(args.write_config, "w") as f:
            json.dump(config, f, indent=1)
    model = Model(config)
    tok_meta, n_base = tokenizer_metadata(args.tokenizer, model.vocab)

    w = gguf.GGUFWriter(args.out + ".tmp", "kimi-linear")
    T = gguf.GGUFValueType
    scalar = {"u32": T.UINT32, "i32": T.INT32, "f32": T.FLOAT32, "bool": T.BOOL, "str": T.STRING}
    name = os.path.basename(args.config).removesuffix(".json").removesuffix(".config")
    meta = [("general.type", "model", "str"), ("general.name", f"{name} (random weights)", "str")]
    meta += model.metadata()
    meta += [("general.file_type", int(gguf.LlamaFileType.MOSTLY_BF16), "u32"),
             ("general.quantization_version", 2, "u32")]
    tok_keys = {k for k, _, _ in tok_meta}
    for key, cfg_key in (("tokenizer.ggml.bos_token_id", "bos_token_id"),
                         ("tokenizer.ggml.eos_token_id", "eos_token_id"),
                         ("tokenizer.ggml.padding_token_id", "pad_token_id")):
        v = config.get(cfg_key)
        v = v[0] if isinstance(v, list) else v
        if key not in tok_keys and v is not None:
            meta.append((key, v, "u32"))
    meta += tok_meta
    for key, val, ty in meta:
        if ty.endswith("[]"):
            w.add_key_value(key, val, T.ARRAY, sub_type=scalar[ty[:-2]])
        else:
            w.add_key_value(key, val, scalar[ty])

    tensors = model.tensors()
    plan = []
    for tname, shape, kind, fan_in in tensors:
        f32 = stored_f32(tname, kind)
        n = int(np.prod(shape))
        nbytes = n * (4 if f32 else 2)
        w.add_tensor_info(tname, shape, np.float32 if f32 else np.uint16, nbytes,
                          raw_dtype=gguf.GGMLQuantizationType.F32 if f32 else gguf.GGMLQuantizationType.BF16)
        plan.append((tname, n, kind, fan_in, f32, nbytes))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    fout = w.fout[0]
    align = w.data_alignment

    def pad():
        p = (-fout.tell()) % align
        if p:
            fout.write(b"\0" * p)

    # Chunks of every tensor in file order, generated ahead on a pool, written in order.
    jobs = ((tname, ci, min(CHUNK, n - ci * CHUNK), kind, fan_in, f32)
            for tname, n, kind, fan_in, f32, _ in plan for ci in range((n + CHUNK - 1) // CHUNK))
    sizes = {tname: nbytes for tname, _, _, _, _, nbytes in plan}
    written = collections.defaultdict(int)
    pending = collections.deque()
    current = None
    with cf.ThreadPoolExecutor(max_workers=args.threads) as pool:
        def submit():
            job = next(jobs, None)
            if job is None:
                return False
            tname, ci, n, kind, fan_in, f32 = job
            seed = (args.seed * 0x9E3779B1 + zlib.crc32(tname.encode())) * 65536 + ci
            pending.append((tname, pool.submit(gen_chunk, seed, n, kind, fan_in, f32)))
            return True

        while len(pending) < 2 * args.threads and submit():
            pass
        while pending:
            tname, fut = pending.popleft()
            data = fut.result()
            submit()
            if tname != current:
                pad()
                current = tname
            fout.write(data)
            written[tname] += len(data)
    pad()
    fout.close()
    bad = [t for t in sizes if written[t] != sizes[t]]
    if bad:
        sys.exit(f"internal error: wrong byte counts for {bad[:3]}")
    os.replace(args.out + ".tmp", args.out)
    size = os.path.getsize(args.out)
    params = sum(n for _, n, *_ in plan)
    layers = "".join("M" if m == "mla" else "K" for m in model.mixers)
    print(f"wrote {args.out}: {len(plan)} tensors, {params / 1e9:.2f} B parameters, "
          f"{size / 2**30:.2f} GiB, layers {layers}, vocabulary {n_base} ranks + specials padded to "
          f"{model.vocab}, in {time.time() - t0:.1f} s", flush=True)


if __name__ == "__main__":
    main()
