#!/usr/bin/env python3
"""flash-linear-attention's KDA kernels, timed the way `check kda-bench` times ours.

chunk_kda (forward only, inference): B=1, T tokens, H heads, D=128, bf16 q/k/v, f32 log-decay
g, beta after sigmoid, q/k L2-normalised inside the kernel (as kimi-infer's kernel does),
initial state given and final state returned. fused_recurrent_kda: one decode step per layer
at batch B with a state. Times are CUDA-event medians over repeats after warm-up (Triton
compiles on the first call). Prints one JSON object.

With `--k3-heads H` (Kimi K3: 96 heads) the same two kernels also run with K3's safe gate
computed inside them (`use_gate_in_kernel`, `safe_gate`, `lower_bound=-5`: g = -5 *
sigmoid(exp(A_log) * (f + dt_bias))), the raw gate input f, A_log [H] and dt_bias [H*D]; the
chunked form at T tokens, the recurrent step at each decode batch ("k3_chunk", "k3_decode").
"""

import argparse
import json
import sys

import torch


def timed(fn, reps):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        s = torch.cuda.Event(enable_timing=True)
        e = torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e))
    times.sort()
    return times[len(times) // 2]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--T", type=int, default=8192)
    ap.add_argument("--heads", default="32,64,96")
    ap.add_argument("--D", type=int, default=128)
    ap.add_argument("--decode-batch", default="1,64")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--k3-heads", type=int, default=0)
    ap.add_argument("--out")
    a = ap.parse_args()

    import fla
    from fla.ops.kda import chunk_kda, fused_recurrent_kda

    torch.manual_seed(0)
    dev = "cuda"
    D = a.D
    res = {"fla": getattr(fla, "__version__", "?"), "gpu": torch.cuda.get_device_name(0),
           "chunk": [], "decode": [], "k3_chunk": [], "k3_decode": []}

    def inputs(b, t, h):
        q = torch.randn(b, t, h, D, device=dev, dtype=torch.bfloat16)
        k = torch.randn(b, t, h, D, device=dev, dtype=torch.bfloat16)
        v = torch.randn(b, t, h, D, device=dev, dtype=torch.bfloat16)
        # log decay in the trained range: -exp(A) * softplus(x), small negatives
        g = -torch.nn.functional.softplus(torch.randn(b, t, h, D, device=dev)) * 0.1
        beta = torch.sigmoid(torch.randn(b, t, h, device=dev)).to(torch.bfloat16)
        s0 = torch.zeros(b, h, D, D, device=dev, dtype=torch.float32)
        return q, k, v, g, beta, s0

    with torch.no_grad():
        for h in [int(x) for x in a.heads.split(",") if x]:
            q, k, v, g, beta, s0 = inputs(1, a.T, h)

            def run():
                return chunk_kda(q, k, v, g, beta, scale=D ** -0.5, initial_state=s0,
                                 output_final_state=True, use_qk_l2norm_in_kernel=True)

            ms = timed(run, a.reps)
            res["chunk"].append({"T": a.T, "H": h, "D": D, "ms": ms})
            print(f"fla chunk_kda T={a.T} H={h} D={D}: {ms:.3f} ms", file=sys.stderr)
        for b in [int(x) for x in a.decode_batch.split(",") if x]:
            h = 32
            q, k, v, g, beta, s0 = inputs(b, 1, h)

            def step():
                return fused_recurrent_kda(q, k, v, g, beta, scale=D ** -0.5, initial_state=s0,
                                           output_final_state=True, use_qk_l2norm_in_kernel=True)

            ms = timed(step, max(a.reps, 50))
            res["decode"].append({"B": b, "H": h, "D": D, "us": ms * 1e3})
            print(f"fla fused_recurrent_kda B={b} H={h}: {ms * 1e3:.1f} us", file=sys.stderr)
        if a.k3_heads:
            h = a.k3_heads
            a_log = torch.randn(h, device=dev, dtype=torch.float32) * 0.5
            dt_bias = torch.randn(h * D, device=dev, dtype=torch.float32) * 0.1
            for b, t in [(1, a.T)] + [(b, 1) for b in
                                      [int(x) for x in a.decode_batch.split(",") if x]]:
                q, k, v, _, beta, s0 = inputs(b, t, h)
                f = torch.randn(b, t, h, D, device=dev, dtype=torch.bfloat16)
                gate = dict(A_log=a_log, dt_bias=dt_bias, use_gate_in_kernel=True,
                            lower_bound=-5.0)
                if t > 1:
                    def run():
                        return chunk_kda(q, k, v, f, beta, scale=D ** -0.5, initial_state=s0,
                                         output_final_state=True, use_qk_l2norm_in_kernel=True,
                                         safe_gate=True, **gate)

                    ms = timed(run, a.reps)
                    res["k3_chunk"].append({"T": t, "H": h, "D": D, "ms": ms})
                    print(f"fla chunk_kda safe gate T={t} H={h} D={D}: {ms:.3f} ms",
                          file=sys.stderr)
                else:
                    def step():
                        return fused_recurrent_kda(q, k, v, f, beta, scale=D ** -0.5,
                                                   initial_state=s0, output_final_state=True,
                                                   use_qk_l2norm_in_kernel=True, **gate)

                    ms = timed(step, max(a.reps, 50))
                    res["k3_decode"].append({"B": b, "H": h, "D": D, "us": ms * 1e3})
                    print(f"fla fused_recurrent_kda safe gate B={b} H={h}: {ms * 1e3:.1f} us",
                          file=sys.stderr)
    out = json.dumps(res, indent=1)
    print(out)
    if a.out:
        open(a.out, "w").write(out)


if __name__ == "__main__":
    main()
