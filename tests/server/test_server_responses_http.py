"""``/v1/responses`` under the rules every endpoint follows: the API key,
the Host and Origin checks, a disconnect cancelling the row within a pass,
and a stop signal ending an open stream with its last event. In-process
servers on one engine whose passes a test can hold and count (as in
test_server_http.py), and a server process for the signal."""

import http.client
import json
import re
import signal
import socket
import time

import openai
import pytest

import mlx_spec
from mlx_spec.drafters import default_draft
from mlx_spec.server.http import make_app
from mlx_spec.server.requests import ServerContext
from mlx_spec.testing.checkpoints import write_tiny_checkpoint
from mlx_spec.testing.server import (
    GatedEngine,
    free_port,
    mlx_spec_server,
    running_server,
    serving,
)

MODEL_ID = "tiny"
KEY = "sekrit-key"
WAIT = 2400  # cap of every polling loop (iterations of 0.05 s)
LONG = {"input": "import os", "max_output_tokens": 3000, "draft": "none"}  # no EOS


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("rh") / MODEL_ID, "qwen3_next")


@pytest.fixture(scope="module")
def engine(tiny):
    model, tokenizer = mlx_spec.load(tiny)
    engine = GatedEngine(model, tokenizer, default_draft(model), 3)
    yield engine
    engine.gate.set()
    engine.close()


@pytest.fixture(scope="module")
def ports(engine):
    defaults = {"temperature": 0.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0}
    ctx = ServerContext(
        engine.tokenizer, MODEL_ID, {**defaults, "max_tokens": 8}, 4096, 512
    )
    plain, secured = make_app(engine, ctx), make_app(engine, ctx, api_key=KEY)
    with serving(plain) as a, serving(secured) as b:
        yield {"plain": a, "secured": b}


def post(port, body, headers=None):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    try:
        conn.request(
            "POST",
            "/v1/responses",
            json.dumps(body),
            {"Content-Type": "application/json", **(headers or {})},
        )
        r = conn.getresponse()
        return r.status, json.loads(r.read())
    finally:
        conn.close()


def _wait(condition, what):
    for _ in range(WAIT):
        if condition():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting until {what}")


def test_the_api_key_host_and_origin_rules_hold(ports):
    port = ports["secured"]
    status, reply = post(port, {"input": "x"})
    assert status == 401 and "API key" in reply["error"]["message"]
    status, reply = post(port, {"input": "x"}, {"Authorization": f"Bearer {KEY}"})
    assert status == 200 and reply["status"] == "incomplete"
    client = openai.OpenAI(
        base_url=f"http://127.0.0.1:{port}/v1", api_key=KEY, max_retries=0
    )
    assert client.responses.create(model=MODEL_ID, input="x").usage.output_tokens == 8
    status, _ = post(ports["plain"], {"input": "x"}, {"Origin": "http://evil.example"})
    assert status == 403
    conn = http.client.HTTPConnection("127.0.0.1", ports["plain"], timeout=60)
    conn.putrequest("POST", "/v1/responses", skip_host=True)
    body = json.dumps({"input": "x"}).encode()
    for name, value in [
        ("Host", "rebound.example"),
        ("Content-Type", "application/json"),
        ("Content-Length", str(len(body))),
    ]:
        conn.putheader(name, value)
    conn.endheaders(body)
    assert conn.getresponse().status == 400  # a name that is not loopback
    conn.close()


@pytest.mark.parametrize("stream", [False, True])
def test_a_disconnect_cancels_the_response_within_one_pass(ports, engine, stream):
    body = json.dumps({**LONG, "stream": stream}).encode()
    head = (
        "POST /v1/responses HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    jobs = len(engine.jobs)
    sock = socket.create_connection(("127.0.0.1", ports["plain"]), timeout=60)
    try:
        sock.sendall(head.encode() + body)
        _wait(lambda: len(engine.jobs) > jobs, "the job is submitted")
        job = engine.jobs[-1]
        _wait(lambda: engine.passes[id(job)] >= 3, "the row decodes")
        if stream:
            assert sock.recv(65536).startswith(b"HTTP/1.1 200")
        engine.gate.clear()
        _wait(engine.held.is_set, "the engine waits before a pass")
        before = engine.passes[id(job)]
    finally:
        sock.close()
    try:
        _wait(lambda: job.cancelled, "the server notices the disconnect")
    finally:
        engine.gate.set()
    _wait(lambda: not engine.decoding(job), "the row leaves the batch")
    assert engine.passes[id(job)] <= before + 1


@pytest.mark.slow
def test_a_signal_ends_an_open_responses_stream_with_response_failed(tiny):
    """SIGTERM while a Responses stream decodes: the open item is closed,
    ``response.failed`` says the server is shutting down, and the process
    exits with 0."""
    port = free_port()
    with running_server(mlx_spec_server(tiny, port), port) as proc:
        data = json.dumps({**LONG, "stream": True})
        sock = socket.create_connection(("127.0.0.1", port), timeout=120)
        sock.sendall(
            (
                "POST /v1/responses HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                "Content-Type: application/json\r\n"
                f"Content-Length: {len(data)}\r\n\r\n{data}"
            ).encode()
        )
        received = b""
        while b"response.output_text.delta" not in received:
            chunk = sock.recv(65536)
            assert chunk, "the server closed the stream"
            received += chunk
        proc.send_signal(signal.SIGTERM)
        while chunk:
            chunk = sock.recv(65536)
            received += chunk
        sock.close()
        assert proc.wait(timeout=60) == 0
    text = received.decode(errors="replace")
    names = re.findall(r"event: ([\w.]+)", text)
    assert names[-2:] == ["response.output_item.done", "response.failed"]
    last = json.loads(re.findall(r"data: (\{.*\})", text)[-1])
    assert last["response"]["status"] == "failed"
    assert "shutting down" in last["response"]["error"]["message"]
    assert last["response"]["output"][0]["status"] == "incomplete"
