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

import openai
import pytest

from mlx_spec.server.http import make_app
from mlx_spec.testing.checkpoints import write_tiny_checkpoint
from mlx_spec.testing.server import (
    free_port,
    gated_engine,
    leaves_after_disconnect,
    mlx_spec_server,
    request_context,
    running_server,
    serving,
)

MODEL_ID = "tiny"
KEY = "sekrit-key"
LONG = {"input": "import os", "max_output_tokens": 3000, "draft": "none"}  # no EOS


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("rh") / MODEL_ID, "qwen3_next")


@pytest.fixture(scope="module")
def engine(tiny):
    with gated_engine(tiny) as engine:
        yield engine


@pytest.fixture(scope="module")
def ports(engine):
    ctx = request_context(engine.tokenizer, MODEL_ID, max_tokens=8)
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
    request = head.encode() + body
    assert leaves_after_disconnect(engine, ports["plain"], request, stream) <= 1


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
