"""Kimi K3's XTML chat format through the official `openai` client: reasoning and tools,
streamed and whole, against `kimi-infer serve` on a K3 checkpoint directory.

Not collected by pytest itself (no `test_` names): `check_k3_xtml(model_dir)`
is run by tests/openai_client/test_k3.py on the tiny K3 fixture. The server must pick
the XTML format by itself (the K3 tokenizer has `<|open|>`, `<|sep|>`, `<|close|>`,
`<|end_of_msg|>` and no chat template). Weights may be random, so only structure,
agreement between streaming and whole responses, and constraints are checked.
"""

import contextlib
import json
import subprocess
import time
import urllib.request
from pathlib import Path

import openai

from test_openai import API_KEY, TOOLS, _free_port, _server_command, validate

MARKERS = ("<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>")


@contextlib.contextmanager
def _serve(model_dir: str):
    port = _free_port()
    cmd = _server_command(model_dir, port)
    log_path = Path(model_dir) / "k3-server.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        base = f"http://127.0.0.1:{port}"
        try:
            deadline = time.time() + 600
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"{cmd} exited: {log_path.read_text()}")
                try:
                    with urllib.request.urlopen(base + "/health", timeout=2) as r:
                        if r.status == 200:
                            break
                except OSError:
                    pass
                if time.time() > deadline:
                    raise RuntimeError("the server did not become healthy")
                time.sleep(0.5)
            yield base
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()


def _close_id(base: str) -> int:
    """The id of `<|close|>`, to end think elements a random model would not end."""
    body = json.dumps({"prompt": "<|close|>", "add_special_tokens": True}).encode()
    req = urllib.request.Request(
        base + "/tokenize", data=body,
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {API_KEY}"},
    )
    with urllib.request.urlopen(req, timeout=30) as r:
        tokens = json.loads(r.read())["tokens"]
    assert len(tokens) == 1, tokens
    return tokens[0]


def _no_markers(*texts):
    for text in texts:
        for marker in MARKERS:
            assert marker not in (text or ""), (marker, text)


def _whole(resp):
    c = resp.choices[0]
    calls = [(t.function.name, t.function.arguments) for t in (c.message.tool_calls or [])]
    for t in c.message.tool_calls or []:
        assert t.type == "function" and t.id
    reasoning = getattr(c.message, "reasoning_content", None) or ""
    return reasoning, c.message.content or "", calls, c.finish_reason


def _streamed(stream):
    reasoning, content, calls, finish = "", "", [], None
    for chunk in stream:
        if not chunk.choices:
            continue
        c = chunk.choices[0]
        reasoning += getattr(c.delta, "reasoning_content", None) or ""
        content += c.delta.content or ""
        for t in c.delta.tool_calls or []:
            if t.id:
                assert t.index == len(calls), "calls count from 0"
                assert t.function.name, "the name comes first"
                calls.append([t.function.name, ""])
            calls[t.index][1] += t.function.arguments or ""
        finish = c.finish_reason or finish
    return reasoning, content, [tuple(c) for c in calls], finish


def _both(client, **kw):
    whole = _whole(client.chat.completions.create(**kw))
    streamed = _streamed(client.chat.completions.create(stream=True, **kw))
    assert whole == streamed, (whole, streamed)
    _no_markers(whole[0], whole[1])
    return whole


def check_k3_xtml(model_dir: str) -> None:
    """Runs every check against a server on `model_dir` (a K3 checkpoint + tokenizer)."""
    with _serve(model_dir) as base:
        client = openai.OpenAI(base_url=base + "/v1", api_key=API_KEY, max_retries=0, timeout=600)
        model = client.models.list().data[0].id
        close_bias = {str(_close_id(base)): 100}
        user = [{"role": "user", "content": "What's the weather in Paris?"}]

        # Free generation, thinking on (the default) and off.
        for extra in ({}, {"chat_template_kwargs": {"thinking": False}}):
            reasoning, content, calls, finish = _both(
                client, model=model, messages=user, temperature=0, max_tokens=32,
                extra_body=extra,
            )
            assert finish in ("stop", "length", "tool_calls"), finish
            assert not calls

        # tool_choice "required" and a named function, thinking on and off.
        for choice, extra in (
            ("required", {"chat_template_kwargs": {"thinking": False}}),
            ("required", {"logit_bias": close_bias}),
            ({"type": "function", "function": {"name": "get_time"}}, {"logit_bias": close_bias}),
        ):
            _, content, calls, finish = _both(
                client, model=model, messages=user, tools=TOOLS, tool_choice=choice,
                temperature=0, max_tokens=1024, extra_body=extra,
            )
            assert calls and not content
            for name, arguments in calls:
                schema = next(t for t in TOOLS if t["function"]["name"] == name)
                validate(schema["function"]["parameters"], json.loads(arguments))
                if isinstance(choice, dict):
                    assert name == "get_time"
            assert finish == ("tool_calls" if choice == "required" else "stop"), finish

        # The calls and their results go back as history.
        resp = client.chat.completions.create(
            model=model, messages=user, tools=TOOLS, tool_choice="required", temperature=0,
            max_tokens=1024, extra_body={"chat_template_kwargs": {"thinking": False}},
        )
        message = resp.choices[0].message
        history = user + [
            {"role": "assistant", "content": message.content,
             "reasoning_content": getattr(message, "reasoning_content", None),
             "tool_calls": [t.model_dump() for t in message.tool_calls]},
        ] + [
            {"role": "tool", "tool_call_id": t.id, "content": "Sunny, 21 C"}
            for t in message.tool_calls
        ]
        _both(client, model=model, messages=history, tools=TOOLS, temperature=0, max_tokens=16)

        # response_format: JSON in the response, after the reasoning.
        schema = {"type": "object", "properties": {"ok": {"type": "boolean"}},
                  "required": ["ok"], "additionalProperties": False}
        _, content, _, finish = _both(
            client, model=model, messages=user, temperature=0, max_tokens=256,
            response_format={"type": "json_schema", "json_schema": {"name": "r", "schema": schema}},
            extra_body={"logit_bias": close_bias},
        )
        validate(schema, json.loads(content))
        assert finish == "stop"

        # Images are refused until the vision tower is in.
        try:
            client.chat.completions.create(model=model, max_tokens=4, messages=[{
                "role": "user", "content": [
                    {"type": "text", "text": "What is this?"},
                    {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
                ]}])
        except openai.BadRequestError as err:
            assert "images are not supported yet" in str(err), err
        else:
            raise AssertionError("an image part was accepted")
