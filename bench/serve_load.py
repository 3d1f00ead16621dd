#!/usr/bin/env python3
"""Load generator for `kimi-infer serve`: throughput, TTFT and TPOT percentiles.

Sends `--num-requests` streamed chat completions with at most `--concurrency` in flight,
using the official `openai` client (as users do), and prints/saves JSON:

  python3 bench/serve_load.py --base-url http://127.0.0.1:8000/v1 --concurrency 1 16 64 \
      --num-requests 64 --max-tokens 32 --json out.json

TTFT = time from sending the request to the first content token; TPOT = (end − first token)
/ (output tokens − 1); throughput = output tokens of all requests / wall time of the level.

`--client raw` sends the same requests as pre-built JSON bodies over httpx2 (the openai
package's own HTTP client) and reads the SSE stream by hand, as vLLM's benchmark does with
aiohttp. Building an `openai` request costs the client several ms of Python, and asyncio
builds all of a level's requests before it sends the first, so with `--client openai` a
64-request level reaches the server only after ~0.3–0.5 s: time the server spends idle.
"""
import argparse
import asyncio
import json
import statistics
import time

import httpx2 as httpx  # the openai package's HTTP client (openai 3.x ships httpx2)
from openai import AsyncOpenAI


def percentiles(xs):
    if not xs:
        return {}
    xs = sorted(xs)
    pick = lambda p: xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]
    return {"p50": pick(50), "p90": pick(90), "p99": pick(99), "mean": statistics.fmean(xs)}


# Sampling fields of every request (set from the command line in `main`).
SAMPLING = {"temperature": 0}


async def one(client, model, prompt, max_tokens, out):
    """`prompt` is chat text, or a list of token ids for /v1/completions."""
    start = time.perf_counter()
    first = None
    tokens = 0
    common = dict(model=model, max_tokens=max_tokens, stream=True, **SAMPLING,
                  stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    if isinstance(prompt, list):
        stream = await client.completions.create(prompt=prompt, **common)
    else:
        stream = await client.chat.completions.create(
            messages=[{"role": "user", "content": prompt}], **common)
    accepted = time.perf_counter()  # the server has the request and answered with headers
    usage = None
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        if not chunk.choices:
            continue
        c = chunk.choices[0]
        text = c.text if isinstance(prompt, list) else (c.delta.content if c.delta else None)
        if text:
            if first is None:
                first = time.perf_counter()
            tokens += 1
    end = time.perf_counter()
    n = usage.completion_tokens if usage is not None else tokens
    out.append({"accepted": accepted, "ttft": (first or end) - start, "e2e": end - start, "tokens": n,
                "tpot": (end - first) / (n - 1) if first is not None and n > 1 else None})


ENGINE_COUNTERS = ("kimi:engine_steps_total", "kimi:engine_step_tokens_total",
                   "kimi:engine_step_seconds_total")


async def engine_counters(client):
    """The server's engine-step counters from /metrics (empty if it has none)."""
    url = str(client.base_url).rstrip("/")
    url = url[: -len("/v1")] if url.endswith("/v1") else url
    try:
        r = await client._client.get(url + "/metrics")
        values = {}
        for line in r.text.splitlines():
            name, _, value = line.rpartition(" ")
            name = name.split("{")[0]
            if name in ENGINE_COUNTERS:
                values[name] = float(value)
        return values
    except Exception:
        return {}


async def one_raw(http, base_url, model, prompt, max_tokens, out):
    """`one` without the openai package: a pre-built body, SSE parsed by hand."""
    body = dict(model=model, max_tokens=max_tokens, stream=True, **SAMPLING,
                stream_options={"include_usage": True}, ignore_eos=True)
    if isinstance(prompt, list):
        url, body["prompt"] = base_url + "/completions", prompt
    else:
        url, body["messages"] = base_url + "/chat/completions", [{"role": "user", "content": prompt}]
    payload = json.dumps(body).encode()
    start = time.perf_counter()
    first = None
    tokens = 0
    usage = None
    async with http.stream("POST", url, content=payload,
                           headers={"content-type": "application/json"}) as resp:
        accepted = time.perf_counter()
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            for c in chunk.get("choices") or []:
                text = c.get("text") if isinstance(prompt, list) else (c.get("delta") or {}).get("content")
                if text:
                    if first is None:
                        first = time.perf_counter()
                    tokens += 1
    end = time.perf_counter()
    n = usage["completion_tokens"] if usage else tokens
    out.append({"accepted": accepted, "ttft": (first or end) - start, "e2e": end - start, "tokens": n,
                "tpot": (end - first) / (n - 1) if first is not None and n > 1 else None})


async def level(client, model, concurrency, num_requests, max_tokens, prompt_words, prompt_ids,
                vocab, http=None):
    sem = asyncio.Semaphore(concurrency)
    results = []

    async def guarded(i):
        async with sem:
            if prompt_ids:
                # The token ids of `kimi-infer bench` (`bench_prompt`, first id varied per
                # request as --batch does), given the model's vocabulary size.
                prompt = [((j * 2654435761) % vocab) for j in range(prompt_ids)]
                prompt[0] = i % vocab
            else:
                prompt = " ".join(f"word{(i * 7 + j) % 97}" for j in range(prompt_words))
            if http is not None:
                await one_raw(http, str(client.base_url).rstrip("/"), model, prompt, max_tokens,
                              results)
            else:
                await one(client, model, prompt, max_tokens, results)

    before = await engine_counters(client)
    start = time.perf_counter()
    await asyncio.gather(*(guarded(i) for i in range(num_requests)))
    wall = time.perf_counter() - start
    after = await engine_counters(client)
    steps = {k: after[k] - before[k] for k in after if k in before}
    total = sum(r["tokens"] for r in results)
    return {
        "concurrency": concurrency,
        "requests": num_requests,
        "output_tokens": total,
        "wall_secs": wall,
        "output_tokens_per_sec": total / wall,
        "ttft_secs": percentiles([r["ttft"] for r in results]),
        "tpot_secs": percentiles([r["tpot"] for r in results if r["tpot"] is not None]),
        "e2e_secs": percentiles([r["e2e"] for r in results]),
        "accepted_offsets_secs": percentiles([r["accepted"] - start for r in results]),
        "engine": steps,
    }


async def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    ap.add_argument("--api-key", default="none")
    ap.add_argument("--model", default=None, help="served model name (default: the first /v1/models entry)")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--prompt-words", type=int, default=24)
    ap.add_argument("--prompt-ids", type=int, default=0,
                    help="send this many token ids to /v1/completions instead of chat text")
    ap.add_argument("--vocab", type=int, default=163840,
                    help="vocabulary size for --prompt-ids (the model's, as `kimi-infer bench` uses)")
    ap.add_argument("--client", choices=["openai", "raw"], default="openai",
                    help="send with the openai package, or pre-built JSON over httpx (see above)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="sampling temperature of every request (0 = greedy)")
    ap.add_argument("--top-p", type=float, default=1.0)
    a = ap.parse_args()
    SAMPLING["temperature"] = a.temperature
    if a.top_p < 1.0:
        SAMPLING["top_p"] = a.top_p
    client = AsyncOpenAI(base_url=a.base_url, api_key=a.api_key, timeout=600)
    model = a.model or (await client.models.list()).data[0].id
    report = {"base_url": a.base_url, "model": model, "sampling": dict(SAMPLING), "levels": []}
    http = None
    if a.client == "raw":
        http = httpx.AsyncClient(timeout=600, headers={"authorization": f"Bearer {a.api_key}"},
                                 limits=httpx.Limits(max_connections=1000,
                                                     max_keepalive_connections=1000))
    for c in a.concurrency:
        r = await level(client, model, c, max(a.num_requests, c), a.max_tokens, a.prompt_words,
                        a.prompt_ids, a.vocab, http)
        r["client"] = a.client
        report["levels"].append(r)
        print(f"concurrency {c:>3} ({a.client}): {r['output_tokens_per_sec']:8.1f} tok/s  "
              f"TTFT p50 {r['ttft_secs'].get('p50', 0)*1e3:7.1f} ms p99 {r['ttft_secs'].get('p99', 0)*1e3:7.1f} ms  "
              f"TPOT p50 {r['tpot_secs'].get('p50', 0)*1e3:6.1f} ms p99 {r['tpot_secs'].get('p99', 0)*1e3:6.1f} ms",
              flush=True)
        e = r["engine"]
        if e.get("kimi:engine_steps_total"):
            steps = e["kimi:engine_steps_total"]
            print(f"      engine: {steps:.0f} steps, "
                  f"{e.get('kimi:engine_step_tokens_total', 0) / steps:.1f} tokens/step, "
                  f"{e.get('kimi:engine_step_seconds_total', 0):.3f} s in passes of {r['wall_secs']:.3f} s; "
                  f"requests accepted by {r['accepted_offsets_secs'].get('p50', 0)*1e3:.0f} ms (p50) / "
                  f"{r['accepted_offsets_secs'].get('p99', 0)*1e3:.0f} ms (p99)", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    asyncio.run(main())
