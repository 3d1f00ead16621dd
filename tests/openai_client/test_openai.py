"""The official `openai` client against a real kimi-infer server on the demo model.

Starts `kimi-infer serve` from target/release (KIMI_SERVER_BIN forces another binary:
a `kimi-infer`, or kimi-server's `serve_demo` example, which takes the same flags). The demo
model has random weights: tests check structure, determinism and constraints.

Run through scripts/test_openai.sh, which builds the binaries and installs the client.
"""

import concurrent.futures
import json
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
API_KEY = "test-key-123"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _server_command(model_dir: str, port: int) -> list:
    binary = os.environ.get("KIMI_SERVER_BIN") or str(ROOT / "target" / "release" / "kimi-infer")
    args = ["--model", model_dir, "--port", str(port), "--api-key", API_KEY]
    if Path(binary).name == "kimi-infer":
        return [binary, "serve", *args]
    return [binary, *args]


@pytest.fixture(scope="session")
def server():
    model_dir = tempfile.mkdtemp(prefix="kimi-demo-")
    for sub in ("demo-model", "demo-tokenizer"):
        for f in (ROOT / "assets" / sub).iterdir():
            shutil.copy(f, model_dir)
    port = _free_port()
    cmd = _server_command(model_dir, port)
    log = open(Path(model_dir) / "server.log", "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + 120
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{cmd} exited: {(Path(model_dir) / 'server.log').read_text()}")
        try:
            with urllib.request.urlopen(base + "/health", timeout=2) as r:
                if r.status == 200:
                    break
        except OSError:
            pass
        if time.time() > deadline:
            proc.kill()
            raise RuntimeError("the server did not become healthy")
        time.sleep(0.2)
    yield base
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
    shutil.rmtree(model_dir, ignore_errors=True)


@pytest.fixture(scope="session")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="session")
def model(client):
    return client.models.list().data[0].id


def metrics(server) -> str:
    with urllib.request.urlopen(server + "/metrics", timeout=10) as r:
        return r.read().decode()


def metric(text: str, name: str, contains: str = ""):
    for line in text.splitlines():
        if line.startswith(name + "{") and contains in line:
            return float(line.rsplit(" ", 1)[1])
    return None


def validate(schema, value):
    """The JSON-schema subset these tests use."""
    if "enum" in schema:
        assert value in schema["enum"], (value, schema)
    kind = schema.get("type")
    types = {"object": dict, "array": list, "string": str, "boolean": bool}
    if kind == "integer":
        assert isinstance(value, int) and not isinstance(value, bool), value
    elif kind in types:
        assert isinstance(value, types[kind]), (value, kind)
    if isinstance(value, str) and "maxLength" in schema:
        assert len(value) <= schema["maxLength"]
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        assert schema.get("minimum", value) <= value <= schema.get("maximum", value)
    if isinstance(value, list):
        assert len(value) <= schema.get("maxItems", len(value))
        for item in value:
            validate(schema.get("items", {}), item)
    if isinstance(value, dict):
        props = schema.get("properties", {})
        for key in schema.get("required", []):
            assert key in value, (key, value)
        for key, item in value.items():
            if key in props:
                validate(props[key], item)
            else:
                assert schema.get("additionalProperties", True) is not False, (key, value)


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather in a city",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "enum": ["Paris", "Tokyo"]},
                    "days": {"type": "integer", "minimum": 1, "maximum": 5},
                },
                "required": ["city", "days"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "parameters": {
                "type": "object",
                "properties": {"zone": {"type": "string", "maxLength": 5}},
                "required": ["zone"],
                "additionalProperties": False,
            },
        },
    },
]


def chat(client, model, content, **kw):
    kw.setdefault("temperature", 0)
    kw.setdefault("max_tokens", 8)
    return client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": content}], **kw
    )


def test_models(client, model):
    ids = [m.id for m in client.models.list().data]
    assert model in ids


def test_chat(client, model):
    r = chat(client, model, "Hello!")
    assert r.object == "chat.completion"
    c = r.choices[0]
    assert c.message.role == "assistant"
    assert isinstance(c.message.content, str)
    assert c.finish_reason in ("stop", "length")
    assert r.usage.prompt_tokens > 0
    assert 1 <= r.usage.completion_tokens <= 8
    assert chat(client, model, "Hello!").choices[0].message.content == c.message.content


def test_streaming(client, model):
    extra = {"ignore_eos": True}
    whole = chat(client, model, "Stream", max_tokens=10, extra_body=extra)
    stream = chat(
        client, model, "Stream", max_tokens=10, stream=True,
        stream_options={"include_usage": True}, extra_body=extra,
    )
    text, finish, usage = "", None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            text += c.delta.content or ""
            finish = c.finish_reason or finish
    assert text == whole.choices[0].message.content
    assert finish == "length"
    assert usage.completion_tokens == 10
    assert usage.prompt_tokens == whole.usage.prompt_tokens


@pytest.mark.parametrize(
    "tool_choice",
    ["required", {"type": "function", "function": {"name": "get_time"}}],
)
def test_tool_calls(client, model, tool_choice):
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for seed in range(3):
        r = chat(
            client, model, "What is the weather in Paris?", tools=TOOLS,
            tool_choice=tool_choice, temperature=1.0, seed=seed, max_tokens=200,
        )
        calls = r.choices[0].message.tool_calls
        assert calls, r
        for i, call in enumerate(calls):
            assert call.type == "function"
            assert call.id == f"functions.{call.function.name}:{i}"
            if isinstance(tool_choice, dict):
                assert call.function.name == "get_time"
            validate(schemas[call.function.name], json.loads(call.function.arguments))
        expected = "tool_calls" if tool_choice == "required" else "stop"
        assert r.choices[0].finish_reason == expected

    # Streamed tool-call deltas reassemble into the same calls.
    stream = chat(
        client, model, "What is the weather in Paris?", tools=TOOLS,
        tool_choice=tool_choice, temperature=1.0, seed=0, max_tokens=200, stream=True,
    )
    rebuilt = {}
    for chunk in stream:
        for c in chunk.choices:
            for d in c.delta.tool_calls or []:
                entry = rebuilt.setdefault(d.index, {"id": None, "name": None, "args": ""})
                entry["id"] = d.id or entry["id"]
                if d.function and d.function.name:
                    entry["name"] = d.function.name
                entry["args"] += (d.function.arguments or "") if d.function else ""
    again = chat(
        client, model, "What is the weather in Paris?", tools=TOOLS,
        tool_choice=tool_choice, temperature=1.0, seed=0, max_tokens=200,
    )
    expected = [
        {"id": c.id, "name": c.function.name, "args": c.function.arguments}
        for c in again.choices[0].message.tool_calls
    ]
    assert [rebuilt[i] for i in sorted(rebuilt)] == expected


def test_json_schema(client, model):
    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 10},
            "age": {"type": "integer", "minimum": 0, "maximum": 99},
            "ok": {"type": "boolean"},
        },
        "required": ["name", "age", "ok"],
        "additionalProperties": False,
    }
    for seed in range(3):
        r = chat(
            client, model, "A person as JSON", temperature=0.8, seed=seed, max_tokens=200,
            response_format={"type": "json_schema",
                             "json_schema": {"name": "person", "schema": schema, "strict": True}},
        )
        validate(schema, json.loads(r.choices[0].message.content))


def test_logprobs(client, model):
    r = chat(client, model, "Logprobs", logprobs=True, top_logprobs=2, max_tokens=4,
             extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content
    assert len(content) == 4
    for entry in content:
        assert entry.logprob <= 0
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].token == entry.token


def test_completions_with_token_ids(client, model, server):
    req = urllib.request.Request(
        server + "/tokenize", data=json.dumps({"prompt": "Once upon a time"}).encode(),
        headers={"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=30) as resp:
        ids = json.loads(resp.read())["tokens"]
    by_ids = client.completions.create(
        model=model, prompt=ids, max_tokens=6, temperature=0, echo=True, logprobs=2,
        extra_body={"ignore_eos": True},
    )
    by_text = client.completions.create(
        model=model, prompt="Once upon a time", max_tokens=6, temperature=0,
        extra_body={"ignore_eos": True},
    )
    c = by_ids.choices[0]
    assert c.text == "Once upon a time" + by_text.choices[0].text
    assert len(c.logprobs.tokens) == len(ids) + 6
    assert c.logprobs.token_logprobs[0] is None
    assert by_ids.usage.prompt_tokens == len(ids)
    assert by_ids.usage.completion_tokens == 6


def test_concurrent_greedy_equals_alone(client, model):
    prompts = [f"Request {i}: " + "go " * (i % 5) for i in range(32)]

    def one(p):
        return chat(client, model, p, max_tokens=10, extra_body={"ignore_eos": True}).choices[0].message.content

    alone = [one(p) for p in prompts]
    with concurrent.futures.ThreadPoolExecutor(max_workers=32) as pool:
        together = list(pool.map(one, prompts))
    assert together == alone


def test_disconnect_frees_the_sequence(client, model, server):
    before = metric(metrics(server), "vllm:request_success_total", "abort") or 0.0
    stream = chat(client, model, "Go on forever", max_tokens=3000, stream=True,
                  extra_body={"ignore_eos": True})
    seen = 0
    for chunk in stream:
        seen += 1
        if seen >= 5:
            break
    stream.close()
    deadline = time.time() + 20
    while True:
        text = metrics(server)
        done = (
            metric(text, "vllm:num_requests_running") == 0
            and metric(text, "vllm:num_requests_waiting") == 0
            and (metric(text, "vllm:request_success_total", "abort") or 0.0) >= before + 1
        )
        if done:
            break
        assert time.time() < deadline, text
        time.sleep(0.1)


def test_bad_inputs(client, model, server):
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, model, "x", max_tokens=0)
    assert e.value.body["param"] == "max_tokens"
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, model, "x", temperature=-1)
    assert e.value.body["param"] == "temperature"
    with pytest.raises(openai.BadRequestError):
        chat(client, model, "x", top_p=2)
    max_model_len = getattr(client.models.list().data[0], "max_model_len", None) or 4096
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, model, "x", max_tokens=max_model_len)
    assert e.value.code == "context_length_exceeded"
    if max_model_len < 50_000:
        with pytest.raises(openai.BadRequestError):
            chat(client, model, "x " * (max_model_len + 10), max_tokens=1)
    with pytest.raises(openai.BadRequestError):
        chat(client, model, "x", tools=[{"type": "function", "function": {
            "name": "f", "parameters": {"type": "nonsense"}}}])
    with pytest.raises(openai.BadRequestError):
        chat(client, model, "x", tool_choice="required")
    # OpenAI and vLLM answer 404 for a model they do not serve.
    with pytest.raises(openai.NotFoundError) as e:
        chat(client, "no-such-model", "x")
    assert e.value.code == "model_not_found"
    bad_key = openai.OpenAI(base_url=server + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        chat(bad_key, model, "x")
    # Still serving.
    assert chat(client, model, "ok?", max_tokens=2).choices[0].message.role == "assistant"
