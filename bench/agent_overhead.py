#!/usr/bin/env python3
"""What the agent layer costs: `kimi-infer agent serve --endpoint` in front of `kimi-infer
serve`, both on the demo model.

1. Per step: one agent step (`POST /v1/responses`, `max_steps: 1`, a forced call of a
   shell tool that runs `echo` in the sandbox) against the same chat completion sent
   straight to the model server (same messages, tools, tool_choice, max_tokens,
   temperature 0, so the same tokens come out). The difference is the agent's overhead:
   request parsing, context counting, the extra HTTP hop and SSE parsing, the sandboxed
   tool run, building the response.
2. A 10-step loop: `tool_choice: required` with `reset_tool_choice: false` and `max_steps:
   10`, so the model calls the tool at every step; wall time and time per step.

    python3 bench/agent_overhead.py [--bin target/release/kimi-infer] [--rounds 7]

Standard library only. Prints a Markdown table.
"""

import argparse
import json
import os
import socket
import statistics
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GGUF = ROOT / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
ECHO = {
    "type": "object",
    "properties": {"text": {"type": "string", "maxLength": 20, "pattern": "^[a-z ]+$"}},
    "required": ["text"],
    "additionalProperties": False,
}
PROMPT = "Repeat the words hello world."
MAX_TOKENS = 32


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(base, proc, log):
    end = time.time() + 300
    while time.time() < end:
        if proc.poll() is not None:
            raise SystemExit(f"server exited: {Path(log).read_text()}")
        try:
            with urllib.request.urlopen(base + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.2)
    raise SystemExit("server did not start")


def post(url, body):
    data = json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"content-type": "application/json"})
    start = time.perf_counter()
    with urllib.request.urlopen(req, timeout=600) as r:
        raw = r.read()
    return time.perf_counter() - start, raw


def bare_step(model_base, model):
    body = {
        "model": model,
        "messages": [{"role": "user", "content": PROMPT}],
        "tools": [{"type": "function", "function": {
            "name": "echo_text", "description": "Repeat a text.", "parameters": ECHO}}],
        "tool_choice": {"type": "function", "function": {"name": "echo_text"}},
        "parallel_tool_calls": True,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    elapsed, raw = post(model_base + "/v1/chat/completions", body)
    usage = None
    for line in raw.decode().splitlines():
        if line.startswith("data: {"):
            chunk = json.loads(line[6:])
            usage = chunk.get("usage") or usage
    return elapsed, usage["completion_tokens"]


def agent_call(agent_base, body):
    elapsed, raw = post(agent_base + "/v1/responses", body)
    return elapsed, json.loads(raw)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", default=str(ROOT / "target" / "release" / "kimi-infer"))
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--int8-matmul", action="store_true")
    a = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="agent-bench-"))
    tools = work / "tools.json"
    tools.write_text(json.dumps({
        "sandbox": {"programs": ["echo"]},
        "tools": [{"type": "shell", "name": "echo_text", "description": "Repeat a text.",
                   "command": ["echo", "{text}"], "parameters": ECHO}],
    }))
    extra = ["--int8-matmul"] if a.int8_matmul else []
    model_port, agent_port = free_port(), free_port()
    model_log, agent_log = work / "model.log", work / "agent.log"
    model = subprocess.Popen(
        [a.bin, "serve", "--model", str(GGUF), "--port", str(model_port), *extra],
        stdout=open(model_log, "w"), stderr=subprocess.STDOUT)
    model_base = f"http://127.0.0.1:{model_port}"
    agent_base = f"http://127.0.0.1:{agent_port}"
    agent = None
    try:
        wait_healthy(model_base, model, model_log)
        agent = subprocess.Popen(
            [a.bin, "agent", "serve", "--endpoint", model_base + "/v1", "--tools", str(tools),
             "--port", str(agent_port), "--step-max-tokens", str(MAX_TOKENS),
             "--tokenizer", str(GGUF)],
            stdout=open(agent_log, "w"), stderr=subprocess.STDOUT)
        wait_healthy(agent_base, agent, agent_log)
        with urllib.request.urlopen(model_base + "/v1/models") as r:
            name = json.loads(r.read())["data"][0]["id"]
        step_body = {"model": name, "input": PROMPT, "temperature": 0, "max_steps": 1,
                     "tool_choice": {"type": "function", "name": "echo_text"}}
        # Warm-up.
        bare_step(model_base, name)
        agent_call(agent_base, step_body)
        bare, agent_steps = [], []
        for _ in range(a.rounds):
            t, bare_tokens = bare_step(model_base, name)
            bare.append(t)
            t, response = agent_call(agent_base, step_body)
            agent_steps.append(t)
            assert response["usage"]["output_tokens"] == bare_tokens, (response["usage"], bare_tokens)
            assert response["output"][1]["type"] == "function_call_output", response["output"]
        step_log = Path(agent_log).read_text()
        loop_body = {"model": name, "input": PROMPT, "temperature": 0, "max_steps": 10,
                     "tool_choice": "required", "reset_tool_choice": False}
        loops = []
        for _ in range(max(3, a.rounds // 2)):
            t, response = agent_call(agent_base, loop_body)
            calls = [i for i in response["output"] if i["type"] == "function_call_output"]
            assert len(calls) >= 10, response["output"]
            loops.append((t, response["usage"]))
        tool_ms, model_ms = [], []
        for line in step_log.splitlines()[-a.rounds:]:
            if "echo_text (ok, " in line:
                tool_ms += [int(p.split(" ms")[0]) for p in line.split("echo_text (ok, ")[1:]]
                model_ms.append(int(line.split("model ")[1].split(" ms")[0]))
    finally:
        for p in (agent, model):
            if p is not None:
                p.terminate()
                p.wait(timeout=30)
    med = statistics.median
    b, s = med(bare), med(agent_steps)
    loop_t = med(t for t, _ in loops)
    usage = loops[0][1]
    print(f"| measurement | median of {a.rounds} |")
    print("|---|---|")
    print(f"| bare chat completion (forced call, {bare_tokens} tokens) | {b * 1000:.1f} ms |")
    print(f"| agent step (same call + sandboxed `echo` + response) | {s * 1000:.1f} ms |")
    print(f"| agent overhead per step | {(s - b) * 1000:.1f} ms ({(s / b - 1) * 100:.1f} %) |")
    print(f"| of which the sandboxed tool run (agent log) | {med(tool_ms):.1f} ms |")
    inside = med(t * 1000 - m for t, m in zip(agent_steps, model_ms))
    print(f"| agent step less its model call as the agent timed it | {inside:.1f} ms |")
    print(f"| 10-step loop, wall time | {loop_t:.2f} s ({loop_t / 10 * 1000:.0f} ms/step; "
          f"{usage['input_tokens']} prompt + {usage['output_tokens']} output tokens) |")
    cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo")
                if l.startswith("model name")), "?")
    print(f"\nCPU: {cpu}, {os.cpu_count()} cores; load average {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
