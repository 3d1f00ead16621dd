"""Tool calls on a model without Kimi's tool tokens: the real demo model (SmolLM2-135M-Instruct
GGUF, whose chat template shows no tool format) behind `kimi-infer serve`, through the
official `openai` client. A forced call (`tool_choice` required or named) must come back
as valid JSON arguments matching the tool's schema, whole and streamed; `auto` answers
with text or calls.

Skipped when models/SmolLM2-135M-Instruct.Q4_1.gguf is absent (scripts/fetch_demo_model.sh
fetches it). Run through scripts/test_openai.sh.
"""

import json
import os
import subprocess
import time
import urllib.request
from pathlib import Path

import openai
import pytest

from test_openai import ROOT, _free_port, validate

GGUF = ROOT / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
# KIMI_SERVER_BIN, when it is a kimi-infer binary (serve_demo cannot load a GGUF).
_forced = Path(os.environ.get("KIMI_SERVER_BIN", ""))
CLI = _forced if _forced.name == "kimi-infer" else ROOT / "target" / "release" / "kimi-infer"

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Tokyo"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 5},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather forecast for a city",
            "parameters": SCHEMA,
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "Current time in a time zone",
            "parameters": {
                "type": "object",
                "properties": {"zone": {"type": "string", "maxLength": 20}},
                "required": ["zone"],
                "additionalProperties": False,
            },
        },
    },
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
MESSAGES = [{"role": "user", "content": "What will the weather be in Paris for 3 days?"}]


def _start(parser: str):
    port = _free_port()
    cmd = [str(CLI), "serve", "--model", str(GGUF), "--port", str(port),
           "--max-model-len", "2048", "--tool-call-parser", parser]
    log_path = Path(f"/tmp/kimi-tools-{parser}-{port}.log")
    log = open(log_path, "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + 120
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{cmd} exited: {log_path.read_text()}")
        try:
            with urllib.request.urlopen(base + "/health", timeout=2) as r:
                if r.status == 200:
                    return proc, base, log_path
        except OSError:
            pass
        if time.time() > deadline:
            proc.kill()
            raise RuntimeError("the server did not become healthy")
        time.sleep(0.2)


@pytest.fixture(scope="module", params=["auto", "hermes"])
def gguf(request):
    if not GGUF.exists():
        pytest.skip(f"{GGUF} is absent (scripts/fetch_demo_model.sh)")
    if not CLI.exists():
        pytest.skip(f"{CLI} is not built")
    proc, base, log_path = _start(request.param)
    client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    yield client, model, request.param, log_path
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()


def check_call(name, arguments):
    assert name in SCHEMAS, name
    validate(SCHEMAS[name], json.loads(arguments))


@pytest.mark.parametrize("choice", ["required", "named"])
def test_forced_call_returns_schema_valid_arguments(gguf, choice):
    client, model, parser, log_path = gguf
    tool_choice = (
        "required" if choice == "required"
        else {"type": "function", "function": {"name": "get_weather"}}
    )
    r = client.chat.completions.create(
        model=model, messages=MESSAGES, tools=TOOLS, tool_choice=tool_choice,
        parallel_tool_calls=False, temperature=0, max_tokens=100,
    )
    choice0 = r.choices[0]
    calls = choice0.message.tool_calls
    assert calls and len(calls) == 1, (choice0, log_path.read_text()[-2000:])
    check_call(calls[0].function.name, calls[0].function.arguments)
    assert calls[0].id.startswith("call_") and calls[0].type == "function"
    if choice == "named":
        assert calls[0].function.name == "get_weather"
        assert choice0.finish_reason == "stop"
    else:
        assert choice0.finish_reason == "tool_calls"
    assert not choice0.message.content


@pytest.mark.parametrize("choice", ["required", "named"])
def test_forced_call_streams_openai_deltas(gguf, choice):
    client, model, _, _ = gguf
    tool_choice = (
        "required" if choice == "required"
        else {"type": "function", "function": {"name": "get_time"}}
    )
    stream = client.chat.completions.create(
        model=model, messages=MESSAGES, tools=TOOLS, tool_choice=tool_choice,
        temperature=0, max_tokens=400, stream=True,
    )
    calls = {}
    finish = None
    content = ""
    argument_chunks = 0
    for chunk in stream:
        for c in chunk.choices:
            content += c.delta.content or ""
            finish = c.finish_reason or finish
            for d in c.delta.tool_calls or []:
                if d.index not in calls:
                    # The first delta of a call carries its id and name.
                    assert d.id and d.id.startswith("call_") and d.function.name, d
                    calls[d.index] = {"name": d.function.name, "arguments": ""}
                else:
                    assert d.id is None and not d.function.name, d
                if d.function.arguments:
                    argument_chunks += 1
                    calls[d.index]["arguments"] += d.function.arguments
    assert calls and sorted(calls) == list(range(len(calls)))
    for call in calls.values():
        check_call(call["name"], call["arguments"])
    if choice == "named":
        assert [c["name"] for c in calls.values()] == ["get_time"]
    assert argument_chunks > 1, "arguments arrived in one piece"
    assert finish == ("stop" if choice == "named" else "tool_calls")
    assert content == ""


def test_forced_stream_and_whole_agree(gguf):
    client, model, _, _ = gguf
    args = dict(model=model, messages=MESSAGES, tools=TOOLS, tool_choice="required",
                parallel_tool_calls=False, temperature=0, max_tokens=100)
    whole = client.chat.completions.create(**args).choices[0].message.tool_calls[0]
    arguments = ""
    name = None
    for chunk in client.chat.completions.create(**args, stream=True):
        for c in chunk.choices:
            for d in c.delta.tool_calls or []:
                name = name or d.function.name
                arguments += d.function.arguments or ""
    assert (name, arguments) == (whole.function.name, whole.function.arguments)


def test_auto_answers_and_history_with_calls_renders(gguf):
    client, model, _, _ = gguf
    r = client.chat.completions.create(
        model=model, messages=MESSAGES, tools=TOOLS, tool_choice="auto",
        temperature=0, max_tokens=40,
    )
    message = r.choices[0].message
    assert message.content or message.tool_calls
    for call in message.tool_calls or []:
        json.loads(call.function.arguments)
    history = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 3}'},
        }]},
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 21 C"},
    ]
    r = client.chat.completions.create(
        model=model, messages=history, tools=TOOLS, temperature=0, max_tokens=20,
    )
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_an_unknown_parser_is_refused_at_start():
    if not CLI.exists():
        pytest.skip(f"{CLI} is not built")
    out = subprocess.run([str(CLI), "serve", "--tool-call-parser", "pythonic"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode != 0
    assert "unknown tool-call parser" in out.stderr and "hermes" in out.stderr
