"""The server's HTTP front under careless and hostile clients: framing (raw
socket bytes), body limits, disconnects (counted in passes), the Host and
Origin checks, CORS and the API key. The protocol fields:
test_server_protocol.py; the ``server`` command's shutdown and flags:
test_server_command.py.

The in-process servers share one engine whose passes a test can hold and
count (:class:`GatedEngine`); they listen on free ports of 127.0.0.1 and stop
whatever happens.
"""

import http.client
import json
import re
import socket

import openai
import pytest

from mlx_spec.server.http import make_app
from mlx_spec.testing.checkpoints import write_tiny_checkpoint
from mlx_spec.testing.http_client import request
from mlx_spec.testing.server import (
    gated_engine,
    leaves_after_disconnect,
    request_context,
    serving,
)

MODEL_ID = "tiny"
PROMPT = "def fibonacci(n):\n    a, b = 0, 1\n    for"
CHAT = [{"role": "user", "content": "write a loop over range(10)"}]
LIMIT = 4096  # the body limit of the in-process servers
KEY = "sekrit-key"
UI = "http://ui.example:3000"


def _context(tokenizer, model):
    return request_context(tokenizer, MODEL_ID)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_checkpoint(
        tmp_path_factory.mktemp("http") / MODEL_ID, "qwen3_next"
    )


@pytest.fixture(scope="module")
def engine(tiny):
    with gated_engine(tiny) as engine:
        yield engine


@pytest.fixture(scope="module")
def ports(tiny, engine):
    """Ports of three apps on one engine: ``plain`` (the defaults, a small
    body limit), ``secured`` (an allowed origin and an API key) and
    ``wide`` (bound, as far as it knows, to every address)."""
    ctx = _context(engine.tokenizer, engine.model)
    hidden = (str(tiny),)
    apps = {
        "plain": make_app(engine, ctx, hidden=hidden, max_body_bytes=LIMIT),
        "secured": make_app(engine, ctx, allow_origins=[UI], api_key=KEY),
        "wide": make_app(engine, ctx, host="0.0.0.0"),
    }
    with serving(apps["plain"]) as a, serving(apps["secured"]) as b:
        with serving(apps["wide"]) as c:
            yield {"plain": a, "secured": b, "wide": c}


def with_host(port, host, path="/health"):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.putrequest("GET", path, skip_host=True)
    conn.putheader("Host", host)
    conn.endheaders()
    r = conn.getresponse()
    body = r.read()
    conn.close()
    return r.status, body


def completion(port, max_tokens=4, **extra):
    body = {"prompt": PROMPT, "max_tokens": max_tokens, **extra}
    status, _, reply = request(port, "POST", "/v1/completions", body)
    assert status == 200, reply
    return reply


# -- framing ---------------------------------------------------------------


def raw_exchange(port, data: bytes) -> bytes:
    """Send ``data`` on a new connection; everything the server sends back
    until it closes the connection (bounded by the socket timeout)."""
    with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
        sock.sendall(data)
        received = b""
        while True:
            try:
                chunk = sock.recv(65536)
            except ConnectionResetError:
                break
            if not chunk:
                return received
            received += chunk
    return received


def statuses(raw: bytes):
    """The status of every response in ``raw`` (a status line may follow the
    last body with nothing between)."""
    return [int(s) for s in re.findall(rb"HTTP/1\.1 (\d{3}) ", raw)]


def http_request(path, body: bytes, headers=()):
    lines = [f"POST {path} HTTP/1.1", "Host: 127.0.0.1", *headers]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


SMUGGLED_BODY = json.dumps({"prompt": "x", "max_tokens": 2}).encode()
SMUGGLED = http_request(
    "/v1/completions",
    SMUGGLED_BODY,
    ["Content-Type: application/json", f"Content-Length: {len(SMUGGLED_BODY)}"],
)


def chunked(data: bytes) -> bytes:
    return f"{len(data):x}\r\n".encode() + data + b"\r\n0\r\n\r\n"


FRAMING = {
    # a body that is itself a whole request, after a route that does not exist
    "unknown route": (
        http_request("/nope", SMUGGLED, [f"Content-Length: {len(SMUGGLED)}"]),
        [404],
    ),
    "Content-Length abc": (
        http_request("/v1/completions", SMUGGLED, ["Content-Length: abc"]),
        [400],
    ),
    "Content-Length -5": (
        http_request("/v1/completions", SMUGGLED, ["Content-Length: -5"]),
        [400],
    ),
    # the chunked body is read as a body: a request's text is no JSON
    "chunked": (
        http_request(
            "/v1/completions", chunked(SMUGGLED), ["Transfer-Encoding: chunked"]
        ),
        [400],
    ),
    "chunked and Content-Length": (
        http_request(
            "/v1/completions",
            chunked(SMUGGLED),
            ["Transfer-Encoding: chunked", "Content-Length: 5"],
        ),
        [400],
    ),
    # refused from its header, before one byte of it is read
    "50 MB body": (
        http_request("/v1/completions", b"", [f"Content-Length: {50 << 20}"]),
        [413],
    ),
    "chunked past the limit": (
        http_request(
            "/v1/completions",
            chunked(b" " * (2 * LIMIT)) + SMUGGLED,
            ["Transfer-Encoding: chunked"],
        ),
        [413],
    ),
}


@pytest.mark.parametrize("case", list(FRAMING))
def test_no_request_is_smuggled_after_an_error(ports, engine, case):
    """One error response, then the connection closes: the bytes after the
    point of failure (a whole completion request) are never served."""
    data, want = FRAMING[case]
    jobs = len(engine.jobs)
    assert statuses(raw_exchange(ports["plain"], data)) == want
    assert len(engine.jobs) == jobs  # nothing reached the engine
    assert completion(ports["plain"])["usage"]["completion_tokens"] == 4


def test_a_chunked_request_is_served(ports):
    """Chunked transfer coding is HTTP/1.1: the body is decoded, not refused."""
    data = http_request(
        "/v1/completions",
        chunked(SMUGGLED_BODY),
        ["Transfer-Encoding: chunked", "Connection: close"],
    )
    raw = raw_exchange(ports["plain"], data)
    assert statuses(raw) == [200]
    assert json.loads(raw.split(b"\r\n\r\n", 1)[1])["usage"]["completion_tokens"] == 2


def test_deeply_nested_json_is_a_400(ports):
    for path in ("/v1/completions", "/v1/messages"):
        status, headers, reply = request(
            ports["wide"], "POST", path, raw=b"[" * 100_000
        )
        assert status == 400 and "nested too deeply" in json.dumps(reply)
        assert headers["connection"] == "close"


def test_bodies_past_the_limit_are_413(ports):
    body = {"prompt": "x" * (2 * LIMIT), "max_tokens": 2}
    status, _, reply = request(ports["plain"], "POST", "/v1/completions", body)
    assert status == 413 and str(LIMIT) in reply["error"]["message"]


# -- disconnects -----------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
def test_a_disconnect_ends_the_row_within_one_pass(ports, engine, stream):
    """The client leaves while the engine is held before a pass: the server
    notices with no event from the engine (the job is cancelled while no pass
    runs), and the row takes part in at most one more pass."""
    body = {"prompt": "import os", "max_tokens": 3000, "draft": "none"}  # no EOS
    data = http_request(
        "/v1/completions",
        json.dumps({**body, "stream": stream}).encode(),
        [
            "Content-Type: application/json",
            f"Content-Length: {len(json.dumps({**body, 'stream': stream}))}",
        ],
    )
    assert leaves_after_disconnect(engine, ports["plain"], data, stream) <= 1
    assert completion(ports["plain"])["usage"]["completion_tokens"] == 4


# -- Host, Origin, CORS, API key -------------------------------------------


def test_loopback_host_names_are_the_only_ones_served(ports):
    port = ports["plain"]
    for host in ("localhost", "127.0.0.1", "[::1]", "LOCALHOST"):
        for name in (host, f"{host}:{port}"):
            assert with_host(port, name)[0] == 200, name
    for name in ("evil.example", f"evil.example:{port}", "127.0.0.1.evil.example"):
        status, body = with_host(port, name)
        assert status == 400 and b"is not served here" in body, name
    # a server bound to every address cannot know its names: no check
    assert with_host(ports["wide"], "my-mac.local:8080")[0] == 200


def test_host_check_accepts_the_bound_host(engine):
    """``--host 127.0.0.2`` (a loopback address): its own name is served too."""
    app = make_app(engine, _context(engine.tokenizer, engine.model), host="127.0.0.2")
    with serving(app) as port:
        assert with_host(port, f"127.0.0.2:{port}")[0] == 200
        assert with_host(port, "localhost")[0] == 200
        assert with_host(port, "127.0.0.3")[0] == 400


def test_pages_of_other_origins_cannot_make_it_generate(ports, engine):
    """A text/plain POST (no preflight) from a foreign page is refused before
    it reaches the engine; so is a preflight: CORS is off by default."""
    jobs = len(engine.jobs)
    body = json.dumps({"prompt": "x", "max_tokens": 2})
    headers = {"Origin": "http://evil.example", "Content-Type": "text/plain"}
    conn = http.client.HTTPConnection("127.0.0.1", ports["plain"], timeout=60)
    conn.request("POST", "/v1/completions", body, headers)
    r = conn.getresponse()
    assert r.status == 403 and b"web origin" in r.read()
    conn.close()
    preflight = {
        "Origin": "http://evil.example",
        "Access-Control-Request-Method": "POST",
    }
    status, headers, _ = request(
        ports["plain"], "OPTIONS", "/v1/completions", headers=preflight
    )
    assert status >= 400 and "access-control-allow-origin" not in headers
    assert len(engine.jobs) == jobs


def test_an_allowed_origin_gets_cors(ports):
    port = ports["secured"]
    preflight = {
        "Origin": UI,
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type",
    }
    status, headers, _ = request(
        port, "OPTIONS", "/v1/chat/completions", headers=preflight
    )
    assert status == 200 and headers["access-control-allow-origin"] == UI
    assert "POST" in headers["access-control-allow-methods"]
    body = {"messages": CHAT, "max_tokens": 2}
    auth = {"Origin": UI, "Authorization": f"Bearer {KEY}"}
    status, headers, reply = request(port, "POST", "/v1/chat/completions", body, auth)
    assert status == 200 and headers["access-control-allow-origin"] == UI
    evil = {**auth, "Origin": "http://evil.example"}
    status, headers, _ = request(port, "POST", "/v1/chat/completions", body, evil)
    assert status == 403 and "access-control-allow-origin" not in headers


def test_the_api_key(ports):
    port = ports["secured"]
    body = {"prompt": "x", "max_tokens": 2}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"x-api-key": KEY[:-1]}):
        status, _, reply = request(port, "POST", "/v1/completions", body, headers)
        assert status == 401 and "API key" in reply["error"]["message"]
    status, _, reply = request(
        port, "POST", "/v1/messages", {"max_tokens": 2, "messages": CHAT}
    )
    assert status == 401 and reply["error"]["type"] == "authentication_error"
    for headers in ({"Authorization": f"Bearer {KEY}"}, {"x-api-key": KEY}):
        assert request(port, "POST", "/v1/completions", body, headers)[0] == 200
    assert request(port, "GET", "/v1/models")[0] == 401
    assert request(port, "GET", "/health")[0] == 200  # for load balancers
    # the OpenAI client sends its api_key as a bearer token
    url = f"http://127.0.0.1:{port}/v1"
    client = openai.OpenAI(base_url=url, api_key=KEY, max_retries=0)
    assert client.completions.create(prompt="x", max_tokens=2, model=MODEL_ID)
    wrong = openai.OpenAI(base_url=url, api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.completions.create(prompt="x", max_tokens=2, model=MODEL_ID)


# -- protocol semantics ----------------------------------------------------
