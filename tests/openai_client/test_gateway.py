"""The official `openai` client against `kimi-infer gateway` over two real
`kimi-infer serve` replicas on the demo model: chat and text completions (streamed and
not), the merged model list, named keys, a per-key limit answered with 429 and
Retry-After, and the response cache's header.

Run through scripts/test_openai.sh, which builds the binary and installs the client.
"""

import os
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

import openai
import pytest

ROOT = Path(__file__).resolve().parents[2]
KEYS = "alice sk-gw-alice\nlimited sk-gw-limited rpm=2\n"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _binary() -> str:
    forced = os.environ.get("KIMI_INFER_BIN")
    if forced:
        return forced
    target = Path(os.environ.get("CARGO_TARGET_DIR", ROOT / "target"))
    return str(target / "release" / "kimi-infer")


def _wait_healthy(proc, base, log_path):
    deadline = time.time() + 120
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"exited: {Path(log_path).read_text()}")
        try:
            with urllib.request.urlopen(base + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        if time.time() > deadline:
            proc.kill()
            raise RuntimeError(f"{base} did not become healthy: {Path(log_path).read_text()}")
        time.sleep(0.2)


@pytest.fixture(scope="module")
def gateway():
    work = Path(tempfile.mkdtemp(prefix="kimi-gateway-"))
    model_dir = work / "model"
    model_dir.mkdir()
    for sub in ("demo-model", "demo-tokenizer"):
        for f in (ROOT / "assets" / sub).iterdir():
            shutil.copy(f, model_dir)
    (work / "keys.txt").write_text(KEYS)
    procs = []
    replicas = []
    try:
        for i in range(2):
            port = _free_port()
            log = work / f"replica{i}.log"
            cmd = [_binary(), "serve", "--model", str(model_dir), "--port", str(port),
                   "--served-model-name", "kimi-demo", "--max-num-seqs", "8",
                   "--max-model-len", "2048"]
            procs.append(subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT))
            base = f"http://127.0.0.1:{port}"
            _wait_healthy(procs[-1], base, log)
            replicas.append(base)
        port = _free_port()
        log = work / "gateway.log"
        cmd = [_binary(), "gateway", "--port", str(port), "--api-key-file",
               str(work / "keys.txt"), "--response-cache", "memory",
               "--health-interval", "0.5"]
        for r in replicas:
            cmd += ["--upstream", r]
        procs.append(subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT))
        base = f"http://127.0.0.1:{port}"
        _wait_healthy(procs[-1], base, log)
        yield base, replicas
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
        shutil.rmtree(work, ignore_errors=True)


@pytest.fixture(scope="module")
def client(gateway):
    base, _ = gateway
    return openai.OpenAI(base_url=base + "/v1", api_key="sk-gw-alice", max_retries=0, timeout=120)


def test_models_are_merged(client):
    assert [m.id for m in client.models.list().data] == ["kimi-demo"]


def test_chat_and_its_upstream(client, gateway):
    _, replicas = gateway
    raw = client.chat.completions.with_raw_response.create(
        model="kimi-demo", messages=[{"role": "user", "content": "Say hi"}],
        max_tokens=8, temperature=0, extra_headers={"x-request-id": "py-trace-1"})
    assert raw.headers["x-request-id"] == "py-trace-1"
    assert raw.headers["x-kimi-upstream"] in replicas
    reply = raw.parse()
    assert reply.choices[0].message.role == "assistant"
    assert reply.usage.completion_tokens > 0


def test_streams_pass_through(client):
    kwargs = dict(model="kimi-demo", messages=[{"role": "user", "content": "Count"}],
                  max_tokens=10, temperature=0)
    whole = client.chat.completions.create(**kwargs).choices[0].message.content
    chunks = list(client.chat.completions.create(
        stream=True, stream_options={"include_usage": True}, **kwargs))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0
    finished = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finished in (["length"], ["stop"])
    # Without include_usage, no usage chunk reaches the client.
    plain = list(client.chat.completions.create(stream=True, **kwargs))
    assert all(c.choices for c in plain)

    pieces = list(client.completions.create(
        model="kimi-demo", prompt="Once upon", max_tokens=6, temperature=0, stream=True))
    assert any(p.choices and p.choices[0].text for p in pieces)


def test_the_cache_says_hit(client):
    kwargs = dict(model="kimi-demo", messages=[{"role": "user", "content": "cache this"}],
                  max_tokens=6, temperature=0)
    first = client.chat.completions.with_raw_response.create(**kwargs)
    second = client.chat.completions.with_raw_response.create(**kwargs)
    assert first.headers["x-kimi-cache"] == "miss"
    assert second.headers["x-kimi-cache"] == "hit"
    assert second.parse().choices[0].message.content == first.parse().choices[0].message.content
    sampled = client.chat.completions.with_raw_response.create(
        model="kimi-demo", messages=[{"role": "user", "content": "x"}], max_tokens=2,
        temperature=0.8)
    assert sampled.headers["x-kimi-cache"] == "bypass"


def test_keys_and_limits(gateway):
    base, _ = gateway
    stranger = openai.OpenAI(base_url=base + "/v1", api_key="sk-unknown", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        stranger.models.list()
    limited = openai.OpenAI(base_url=base + "/v1", api_key="sk-gw-limited", max_retries=0)
    for _ in range(2):
        limited.completions.create(model="kimi-demo", prompt="a", max_tokens=1)
    with pytest.raises(openai.RateLimitError) as refused:
        limited.completions.create(model="kimi-demo", prompt="a", max_tokens=1)
    assert 1 <= int(refused.value.response.headers["retry-after"]) <= 60
    assert refused.value.code == "rate_limit_exceeded"
    with urllib.request.urlopen(base + "/metrics", timeout=10) as r:
        text = r.read().decode()
    assert 'kimi:rate_limited_requests_total{key="limited",limit="requests"} 1' in text
