"""The agent server (`kimi-infer agent serve`) through the official `openai` client's
Responses API: `client.responses.create` (whole and streamed), `responses.stream`,
`previous_response_id`, client-side function tools, and the server's own tools of every
kind against real parts: a local REST server started here (also through an OpenAPI
document and the fetch tool), the `mcp` package's FastMCP server (tests/agent/mcp_server.py)
over stdio and streamable HTTP, shell and code tools in the sandbox.

The model is the demo model (SmolLM2-135M-Instruct GGUF), behind `kimi-infer serve` for
the main agent (`--endpoint`) and in the agent's own process for the summarize test; named
tool choices are decoded under llguidance grammars, so even this small model's calls
match their schemas. A K3-format checkpoint (fixtures/kimi-k3) in the agent's process
checks the XTML path. Parallel calls in one turn (one breaking its schema) come from a
local endpoint of fixed answers (`_ScriptedModel`), since a small model rarely makes two.

Run through scripts/test_openai.sh (which also runs scripts/agent_test_deps.sh for the
MCP server's Python package).
"""

import contextlib
import http.server
import json
import os
import shutil
import socket
import subprocess
import tempfile
import threading
import time
import urllib.parse
import urllib.request
from pathlib import Path

import openai
import pytest

from test_openai import ROOT, _free_port, validate

GGUF = ROOT / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
_forced = Path(os.environ.get("KIMI_SERVER_BIN", ""))
CLI = _forced if _forced.name == "kimi-infer" else ROOT / "target" / "release" / "kimi-infer"
MCP_PYTHON = ROOT / "target" / "agent-venv" / "bin" / "python"
MCP_SERVER = ROOT / "tests" / "agent" / "mcp_server.py"
KEY = "agent-key-1"

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Tokyo"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 5},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
ECHO = {
    "type": "object",
    "properties": {"text": {"type": "string", "maxLength": 30, "pattern": "^[a-z ]+$"}},
    "required": ["text"],
    "additionalProperties": False,
}

pytestmark = pytest.mark.skipif(not GGUF.exists(), reason="the demo GGUF is not fetched")


class _Api(http.server.BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def do_GET(self):
        url = urllib.parse.urlparse(self.path)
        query = urllib.parse.parse_qs(url.query)
        if url.path.startswith("/weather/"):
            city = urllib.parse.unquote(url.path[len("/weather/"):])
            days = int(query.get("days", ["1"])[0])
            body = json.dumps({"city": city, "days": days, "forecast": ["sunny"] * days})
            self._send(200, body.encode(), "application/json")
        else:
            self._send(404, b"no such page", "text/plain")

    def _send(self, status, body, kind):
        self.send_response(status)
        self.send_header("content-type", kind)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture(scope="module")
def rest_server():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Api)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def _wait_port(port, proc, what, deadline=60):
    end = time.time() + deadline
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 1):
            return
        if time.time() > end:
            raise RuntimeError(f"{what} did not start")
        time.sleep(0.1)


@pytest.fixture(scope="module")
def mcp_http():
    if not MCP_PYTHON.exists():
        yield None
        return
    port = _free_port()
    proc = subprocess.Popen([str(MCP_PYTHON), str(MCP_SERVER), "http", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _wait_port(port, proc, "the MCP HTTP server")
    yield f"http://127.0.0.1:{port}/mcp"
    proc.terminate()
    proc.wait(timeout=10)


def _tools_file(directory: Path, rest: str, mcp_url) -> Path:
    port = urllib.parse.urlparse(rest).port
    (directory / "api.json").write_text(json.dumps({
        "openapi": "3.0.3",
        "info": {"title": "weather", "version": "1"},
        "servers": [{"url": rest}],
        "paths": {"/weather/{city}": {"get": {
            "operationId": "getForecast",
            "summary": "Forecast for a city",
            "parameters": [
                {"name": "city", "in": "path", "required": True,
                 "schema": {"type": "string", "enum": ["Paris", "Tokyo"]}},
                {"name": "days", "in": "query", "required": True,
                 "schema": {"type": "integer", "minimum": 1, "maximum": 3}},
            ],
        }}},
    }))
    flood = ("import sys\nfor i in range(3_000_000): sys.stdout.write(f'report line {{i}}\\n')")
    config = {
        "sandbox": {"programs": ["echo", "python3"], "timeout_seconds": 3, "cpu_seconds": 2,
                    "memory_mb": 512, "max_output_bytes": 65536},
        "tools": [
            {"type": "shell", "name": "echo_text", "description": "Repeat a text.",
             "command": ["echo", "{text}"], "parameters": ECHO},
            # `{{i}}`: a literal brace pair, not a placeholder.
            {"type": "shell", "name": "flood", "description": "Print a very long report.",
             "command": ["python3", "-c", flood],
             "sandbox": {"cpu_seconds": 30, "timeout_seconds": 60}},
            {"type": "shell", "name": "hang", "description": "Wait for something that never happens.",
             "command": ["python3", "-c", "import time; time.sleep(600)"]},
            {"type": "rest", "name": "get_weather", "description": "Weather forecast for a city.",
             "url": rest + "/weather/{city}", "parameters": WEATHER},
            {"type": "code"},
            {"type": "fetch", "allowed_hosts": [f"127.0.0.1:{port}"]},
        ],
        "openapi": [{"spec": "api.json", "prefix": "api_"}],
        "mcp": [],
    }
    if mcp_url:
        config["mcp"] = [
            {"name": "local", "command": [str(MCP_PYTHON), str(MCP_SERVER), "stdio"],
             "tools": ["add", "shout"], "strict": True},
            {"name": "remote", "url": mcp_url, "prefix": "remote_", "tools": ["add"], "strict": True},
        ]
    path = directory / "tools.json"
    path.write_text(json.dumps(config, indent=1))
    return path


@contextlib.contextmanager
def _agent_server(args, log_path: Path, deadline=300):
    port = _free_port()
    cmd = [str(CLI), "agent", "serve", "--port", str(port), "--api-key", KEY, *args]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        base = f"http://127.0.0.1:{port}"
        try:
            end = time.time() + deadline
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"{cmd} exited: {log_path.read_text()}")
                try:
                    with urllib.request.urlopen(base + "/health", timeout=2) as r:
                        if r.status == 200:
                            break
                except OSError:
                    pass
                if time.time() > end:
                    raise RuntimeError(f"the agent server did not start: {log_path.read_text()}")
                time.sleep(0.2)
            yield base
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()


@pytest.fixture(scope="module")
def model_server():
    """`kimi-infer serve` on the demo model: the endpoint the main agent drives."""
    directory = Path(tempfile.mkdtemp(prefix="kimi-agent-model-"))
    port = _free_port()
    cmd = [str(CLI), "serve", "--model", str(GGUF), "--int8-matmul", "--max-model-len", "4096",
           "--port", str(port), "--api-key", "model-key"]
    log = directory / "model.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
        try:
            _wait_port(port, proc, "kimi-infer serve", deadline=300)
            yield f"http://127.0.0.1:{port}/v1"
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture(scope="module")
def agent(rest_server, mcp_http, model_server):
    """The agent in front of the model server (`--endpoint`); the in-process model is
    checked by the K3 and summarize tests."""
    directory = Path(tempfile.mkdtemp(prefix="kimi-agent-"))
    tools = _tools_file(directory, rest_server, mcp_http)
    args = ["--tools", str(tools), "--endpoint", model_server, "--endpoint-api-key",
            "model-key", "--tokenizer", str(GGUF), "--max-steps", "4",
            "--step-max-tokens", "48", "--time-budget", "120"]
    with _agent_server(args, directory / "agent.log") as base:
        yield base
    shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture(scope="module")
def client(agent):
    return openai.OpenAI(base_url=agent + "/v1", api_key=KEY, max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


def _named(name):
    return {"type": "function", "name": name}


def _items(response, kind):
    return [i for i in response.output if i.type == kind]


def _call_and_output(response, name, parse=True):
    calls = [i for i in _items(response, "function_call") if i.name == name]
    assert calls, response.output
    call = calls[0]
    outputs = [i for i in _items(response, "function_call_output") if i.call_id == call.call_id]
    assert len(outputs) == 1, response.output
    return call, json.loads(call.arguments) if parse else None, outputs[0].output


def test_models_and_keys(agent, client, model):
    listed = client.models.list().data
    assert model in [m.id for m in listed]
    assert model == "SmolLM2-135M-Instruct.Q4_1.gguf"  # the endpoint's model
    stranger = openai.OpenAI(base_url=agent + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        stranger.responses.create(model=model, input="hi")


def test_a_forced_rest_call_runs_and_the_loop_goes_on(client, model):
    r = client.responses.create(
        model=model, input="What is the weather in Tokyo this week?",
        tool_choice=_named("get_weather"), extra_body={"max_steps": 2},
    )
    assert r.object == "response" and r.id.startswith("resp_")
    call, args, output = _call_and_output(r, "get_weather")
    assert r.output[0].type == "function_call"
    validate(WEATHER, args)
    assert json.loads(output) == {"city": args["city"], "days": args["days"],
                                  "forecast": ["sunny"] * args["days"]}
    # A second model call followed the tool output (auto: text or another call).
    assert len(r.output) >= 3, r.output
    assert r.status in ("completed", "incomplete"), r.status
    if r.status == "incomplete":
        assert r.incomplete_details.reason in ("max_steps", "max_output_tokens")
    assert r.usage.input_tokens > 0 and r.usage.output_tokens > 0
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert client.responses.retrieve(r.id).output == r.output


def test_the_stream_tells_the_same_story(client, model):
    stream = client.responses.create(
        model=model, input="Weather in Paris?", tool_choice=_named("get_weather"),
        extra_body={"max_steps": 2}, stream=True,
    )
    events = list(stream)
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"], kinds
    assert kinds[-1] in ("response.completed", "response.incomplete"), kinds
    assert [e.sequence_number for e in events] == list(range(len(events)))
    final = events[-1].response
    added = {e.output_index: e.item for e in events if e.type == "response.output_item.added"}
    done = {e.output_index: e.item for e in events if e.type == "response.output_item.done"}
    assert sorted(added) == sorted(done) == list(range(len(final.output)))
    assert [done[i] for i in range(len(final.output))] == final.output
    for index, item in done.items():
        if item.type == "function_call":
            deltas = "".join(e.delta for e in events if e.type ==
                             "response.function_call_arguments.delta" and e.output_index == index)
            assert deltas == item.arguments
            validate(WEATHER, json.loads(item.arguments)) if item.name == "get_weather" else None
        if item.type == "message":
            text = "".join(e.delta for e in events if e.type == "response.output_text.delta"
                           and e.output_index == index)
            assert text == item.content[0].text
    assert final.output[0].type == "function_call"
    assert final.output[1].type == "function_call_output"
    assert client.responses.retrieve(final.id).status == final.status


def test_the_stream_helper_accumulates(client, model):
    with client.responses.stream(
        # Greedy: a sampled answer may run past the step's 48 tokens and end `incomplete`,
        # which the helper rightly refuses to call final.
        model=model, input="Say hello.", tool_choice="none", temperature=0,
        extra_body={"max_steps": 1},
    ) as stream:
        for _ in stream:
            pass
        final = stream.get_final_response()
    assert final.output and final.output[-1].type == "message"
    assert final.output_text == final.output[-1].content[0].text


def test_previous_response_id_continues_the_conversation(client, model):
    first = client.responses.create(
        model=model, input="The code word is kiwi.", tool_choice="none",
        instructions="Answer briefly.", extra_body={"max_steps": 1},
    )
    second = client.responses.create(
        model=model, input="What was the code word?", previous_response_id=first.id,
        tool_choice="none", extra_body={"max_steps": 1},
    )
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens > first.usage.input_tokens
    with pytest.raises(openai.BadRequestError):
        client.responses.create(model=model, input="x", previous_response_id="resp_nope")


def _forced(client, model, name, text):
    return client.responses.create(
        model=model, input=text, tool_choice=_named(name), extra_body={"max_steps": 1},
    )


def test_shell_and_openapi_tools(client, model):
    r = _forced(client, model, "echo_text", "Say hello world")
    _, args, output = _call_and_output(r, "echo_text")
    validate(ECHO, args)
    assert output == args["text"] + "\n"
    # One step only: the run stops after the tools with its reason.
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_steps"
    r = _forced(client, model, "api_getForecast", "Forecast for Paris")
    _, args, output = _call_and_output(r, "api_getForecast")
    assert json.loads(output)["city"] == args["city"] and 1 <= args["days"] <= 3


def test_code_and_fetch_tools_answer_whatever_they_are_given(client, model):
    # Free-text arguments may run past the step's token limit: the tool then answers that
    # they are not valid JSON, which is an answer too.
    r = _forced(client, model, "run_python", "Compute 2 + 2 in Python.")
    _, _, output = _call_and_output(r, "run_python", parse=False)
    assert output
    r = _forced(client, model, "fetch", "Fetch the home page.")
    _, _, output = _call_and_output(r, "fetch", parse=False)
    # Whatever URL the model wrote: fetched from the allowed host, or refused in words.
    assert output.startswith("HTTP ") or output.startswith("error:"), output


@pytest.mark.parametrize("name", ["add", "remote_add"])
def test_mcp_tools_over_stdio_and_http(client, model, name):
    if not MCP_PYTHON.exists():
        pytest.skip("target/agent-venv is missing (scripts/agent_test_deps.sh)")
    r = _forced(client, model, name, "Add 2 and 3.")
    _, args, output = _call_and_output(r, name)
    assert output == str(args["a"] + args["b"])


def test_a_hanging_tool_is_killed_and_the_loop_goes_on(client, model):
    start = time.time()
    r = client.responses.create(
        model=model, input="Wait for it.", tool_choice=_named("hang"),
        extra_body={"max_steps": 2},
    )
    _, _, output = _call_and_output(r, "hang")
    assert output.startswith("error:") and "time limit of 3 s" in output, output
    assert time.time() - start < 60
    assert len(r.output) >= 3, r.output


def test_a_flood_of_output_is_cut_to_fit(client, model):
    r = _forced(client, model, "flood", "Print the report.")
    _, _, output = _call_and_output(r, "flood")
    assert "report line 0\n" in output and "report line 2999999" in output
    assert "elided" in output and len(output) < 40_000, len(output)


def test_client_function_tools_come_back_to_the_client(client, model):
    tools = [{"type": "function", "name": "lookup_order", "description": "Find an order",
              "parameters": {"type": "object", "properties": {"order_id": {"type": "integer"}},
                             "required": ["order_id"], "additionalProperties": False}}]
    r = client.responses.create(model=model, input="Where is my order?", tools=tools,
                                tool_choice=_named("lookup_order"))
    assert r.status == "completed"
    call = r.output[-1]
    assert call.type == "function_call" and call.name == "lookup_order"
    assert isinstance(json.loads(call.arguments)["order_id"], int)
    assert not _items(r, "function_call_output")
    follow = client.responses.create(
        model=model, previous_response_id=r.id, tools=tools, tool_choice="none",
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "shipped"}],
        extra_body={"max_steps": 1},
    )
    assert follow.output[-1].type == "message"


def test_bad_requests_get_openai_errors(client, model):
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="no-such-model", input="x")
    with pytest.raises(openai.BadRequestError):
        client.responses.create(model=model, input="x", tools=[{"type": "web_search"}])
    with pytest.raises(openai.BadRequestError):
        client.responses.create(model=model, input=[
            {"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}])
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve("resp_unknown")


def test_k3_xtml_tool_calls_in_the_loop(rest_server):
    """A K3-format checkpoint (random weights) in the agent's process: the XTML format's
    forced call must reach the REST tool with schema-valid arguments."""
    directory = Path(tempfile.mkdtemp(prefix="kimi-agent-k3-"))
    model_dir = directory / "k3"
    shutil.copytree(ROOT / "fixtures" / "kimi-k3" / "k3-tiny-7l", model_dir)
    tools = directory / "tools.json"
    tools.write_text(json.dumps({"tools": [
        {"type": "rest", "name": "get_weather", "description": "Weather forecast for a city.",
         "url": rest_server + "/weather/{city}", "parameters": WEATHER}]}))
    args = ["--tools", str(tools), "--model", str(model_dir), "--step-max-tokens", "256"]
    with _agent_server(args, directory / "agent.log", deadline=600) as base:
        k3 = openai.OpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0, timeout=600)
        name = k3.models.list().data[0].id
        r = k3.responses.create(
            model=name, input="Weather in Paris?", tool_choice=_named("get_weather"),
            extra_body={"max_steps": 1, "chat_template_kwargs": {"thinking": False}},
        )
        _, args, output = _call_and_output(r, "get_weather")
        validate(WEATHER, args)
        assert json.loads(output)["city"] == args["city"]
    shutil.rmtree(directory, ignore_errors=True)


def test_summarize_policy_condenses_what_does_not_fit(tmp_path):
    """`--overflow summarize`: an output over its share of a small window is replaced by
    the model's summary (or, if that fails, cut to its head and tail)."""
    (tmp_path / "tools.json").write_text(json.dumps({
        "sandbox": {"programs": ["python3"]},
        "tools": [{"type": "shell", "name": "report", "description": "Print the report.",
                   "command": ["python3", "-c",
                               "for i in range(2000): print(f'item {{i}}: all systems nominal')"]}],
    }))
    args = ["--tools", str(tmp_path / "tools.json"), "--model", str(GGUF), "--int8-matmul",
            "--overflow", "summarize", "--context-window", "700", "--max-model-len", "2048",
            "--step-max-tokens", "48"]
    with _agent_server(args, tmp_path / "agent.log") as base:
        c = openai.OpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0, timeout=300)
        name = c.models.list().data[0].id
        r = c.responses.create(model=name, input="Is everything nominal?",
                               tool_choice=_named("report"), extra_body={"max_steps": 1})
        _, _, output = _call_and_output(r, "report")
    log = (tmp_path / "agent.log").read_text()
    assert len(output) < 4000, len(output)
    if output.startswith("[summary by the model of "):
        assert "was summarised by the model" in log, log
    else:
        assert "tokens of tool output elided" in output and "summarising" in log, log


def test_an_unreachable_model_is_a_clear_502(tmp_path):
    port = _free_port()  # nothing listens there
    args = ["--endpoint", f"http://127.0.0.1:{port}/v1", "--endpoint-model", "absent",
            "--context-window", "4096"]
    with _agent_server(args, tmp_path / "agent.log", deadline=60) as base:
        c = openai.OpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0, timeout=60)
        with pytest.raises(openai.APIStatusError) as err:
            c.responses.create(model="absent", input="hello")
        assert err.value.status_code == 502
        assert "cannot reach the model" in str(err.value), err.value


class _ScriptedModel(http.server.BaseHTTPRequestHandler):
    """An OpenAI-compatible endpoint whose answers are fixed: two tool calls in one turn
    (one with arguments that break the tool's schema), then, once tool results are in the
    conversation, a final answer. Streams as the chat-completions API does."""

    requests: list = []

    def log_message(self, *args):
        pass

    def do_GET(self):
        self._json({"object": "list", "data": [{"id": "scripted", "object": "model"}]})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).requests.append(body)
        if any(m.get("role") == "tool" for m in body["messages"]):
            deltas = [{"role": "assistant", "content": "Both tools "}, {"content": "answered."}]
            finish = "stop"
        else:
            calls = [("call_a", "get_weather", {"city": "Berlin", "days": 9}),
                     ("call_b", "echo_text", {"text": "hello world"})]
            deltas = [{"role": "assistant", "tool_calls": [
                {"index": i, "id": cid, "type": "function",
                 "function": {"name": name, "arguments": json.dumps(args)}}]}
                for i, (cid, name, args) in enumerate(calls)]
            finish = "tool_calls"
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        chunks = [{"choices": [{"index": 0, "delta": d, "finish_reason": None}]} for d in deltas]
        chunks.append({"choices": [{"index": 0, "delta": {}, "finish_reason": finish}]})
        chunks.append({"choices": [], "usage": {"prompt_tokens": 20, "completion_tokens": 10,
                                                "total_tokens": 30}})
        for c in chunks:
            c.update(id="chatcmpl-1", object="chat.completion.chunk", created=0, model="scripted")
            self.wfile.write(f"data: {json.dumps(c)}\n\n".encode())
        self.wfile.write(b"data: [DONE]\n\n")

    def _json(self, value):
        data = json.dumps(value).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


def test_parallel_calls_and_a_schema_violation_in_one_turn(tmp_path, rest_server):
    """Two calls in one model turn, one breaking its tool's schema: the valid one runs, the
    other is answered with the schema error without running, both results go back to the
    model, and the loop ends with its answer."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _ScriptedModel)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    _ScriptedModel.requests = []
    tools = _tools_file(tmp_path, rest_server, None)
    args = ["--tools", str(tools), "--endpoint", f"http://127.0.0.1:{server.server_port}/v1",
            "--endpoint-model", "scripted", "--context-window", "4096", "--max-steps", "3"]
    try:
        with _agent_server(args, tmp_path / "agent.log", deadline=60) as base:
            c = openai.OpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0, timeout=60)
            r = c.responses.create(model="scripted", input="Weather in Berlin, and echo.")
    finally:
        server.shutdown()
    kinds = [i.type for i in r.output]
    assert kinds == ["function_call", "function_call", "function_call_output",
                     "function_call_output", "message"], kinds
    assert r.status == "completed" and r.output_text == "Both tools answered."
    _, args, refused = _call_and_output(r, "get_weather")
    assert args == {"city": "Berlin", "days": 9}
    assert refused.startswith("error:") and "schema" in refused, refused
    _, _, echoed = _call_and_output(r, "echo_text")
    assert echoed == "hello world\n", echoed
    # The second model call saw both results, in the order of the calls.
    assert len(_ScriptedModel.requests) == 2
    tool_msgs = [m for m in _ScriptedModel.requests[1]["messages"] if m["role"] == "tool"]
    assert [m["content"] for m in tool_msgs] == [refused, echoed], tool_msgs
