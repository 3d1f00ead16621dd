#!/usr/bin/env python3
"""HF transformers on the same random Kimi-Linear-48B-A3B config: the baseline a newcomer
tries first, run on the GPU machine in the same session as `kimi-infer bench --device cuda`.

The model is built from the config with random bf16 weights directly on the GPU (no
checkpoint). transformers uses flash-linear-attention's kernels for KDA when `fla` imports
(carry the fla-core / flash-linear-attention wheels; scripts/cuda/device-bench.sh does).

Measures prefill tokens/s (one forward of a P-token prompt, no cache kept beyond it) and
decode tokens/s at batch B (greedy `generate` of N new tokens minus a 1-token generate, per
new token). Prints one JSON object.
"""

import argparse
import json
import sys
import time

import torch


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    ap.add_argument("--prefill", default="1024,8192")
    ap.add_argument("--decode-batch", default="1,8")
    ap.add_argument("--decode-prompt", type=int, default=1024)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--out")
    a = ap.parse_args()

    import transformers
    from transformers import KimiLinearConfig, KimiLinearForCausalLM

    try:
        import fla  # noqa: F401

        fla_version = getattr(fla, "__version__", "yes")
    except Exception as e:  # noqa: BLE001
        fla_version = f"not importable: {e}"

    hub = json.load(open(a.config))
    kw = {k: v for k, v in hub.items() if k not in ("architectures", "model_type", "torch_dtype", "auto_map")}
    cfg = KimiLinearConfig(**kw)
    torch.manual_seed(0)
    t0 = time.time()
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        model = KimiLinearForCausalLM(cfg)
    model.eval()
    # Random init gives logits far from any trained distribution; scale like our RandomWeights
    # (uniform in ±1/sqrt(fan_in)) so activations stay finite through 27 layers.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                bound = p.shape[-1] ** -0.5
                p.uniform_(-bound, bound)
    torch.cuda.synchronize()
    build_s = time.time() - t0
    res = {
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "fla": fla_version,
        "gpu": torch.cuda.get_device_name(0),
        "build_secs": build_s,
        "params": sum(p.numel() for p in model.parameters()),
        "memory_allocated_bytes": torch.cuda.memory_allocated(),
        "prefill": [],
        "decode": [],
    }
    vocab = cfg.vocab_size

    def ids(b, n, salt=0):
        g = torch.Generator().manual_seed(1234 + salt)
        return torch.randint(0, vocab, (b, n), generator=g).cuda()

    with torch.no_grad():
        for p in [int(x) for x in a.prefill.split(",") if x]:
            x = ids(1, p)
            model(x, use_cache=False)  # warm-up (kernel compilation)
            torch.cuda.synchronize()
            best = float("inf")
            for _ in range(2):
                t = time.time()
                model(x, use_cache=False)
                torch.cuda.synchronize()
                best = min(best, time.time() - t)
            res["prefill"].append({"prompt_len": p, "secs": best, "tokens_per_sec": p / best})
            print(f"prefill {p}: {p / best:.1f} tok/s", file=sys.stderr)
        for b in [int(x) for x in a.decode_batch.split(",") if x]:
            x = ids(b, a.decode_prompt, salt=b)
            mask = torch.ones_like(x)
            kw = dict(attention_mask=mask, do_sample=False, pad_token_id=0)
            model.generate(x, max_new_tokens=2, min_new_tokens=2, **kw)  # warm-up
            torch.cuda.synchronize()
            t = time.time()
            model.generate(x, max_new_tokens=1, min_new_tokens=1, **kw)
            torch.cuda.synchronize()
            one = time.time() - t
            t = time.time()
            model.generate(x, max_new_tokens=a.new_tokens, min_new_tokens=a.new_tokens, **kw)
            torch.cuda.synchronize()
            full = time.time() - t
            per_step = (full - one) / (a.new_tokens - 1)
            res["decode"].append({
                "batch": b, "context": a.decode_prompt, "new_tokens": a.new_tokens,
                "step_ms": per_step * 1e3, "tokens_per_sec": b / per_step,
            })
            print(f"decode x{b}: {b / per_step:.1f} tok/s ({per_step * 1e3:.1f} ms/step)", file=sys.stderr)
    out = json.dumps(res, indent=1)
    print(out)
    if a.out:
        open(a.out, "w").write(out)


if __name__ == "__main__":
    main()
