"""The server's HTTP front under careless and hostile clients: framing (raw
socket bytes), body limits, disconnects (counted in passes), the Host and
Origin checks, CORS, the API key, graceful shutdown (real signals), the
protocol fields (stop sequences, cached input tokens, echo, non-finite
logprobs, the model id in errors) and the ``server`` command's own flags.

The in-process servers share one engine whose passes a test can hold and
count (:class:`GatedEngine`); they listen on free ports of 127.0.0.1 and stop
whatever happens.
"""

import http.client
import json
import re
import signal
import socket
import subprocess
import threading

import openai
import pytest

import mlx_spec
from mlx_spec.commands import server as server_command
from mlx_spec.server.events import Finished, GenerationParams, Started, Token
from mlx_spec.server.engine import Engine
from mlx_spec.server.http import make_app
from mlx_spec.server.openai import OpenAIResponse
from mlx_spec.server.wire import json_bytes
from mlx_spec.testing.checkpoints import write_tiny_checkpoint
from mlx_spec.testing.server import (
    free_port,
    gated_engine,
    leaves_after_disconnect,
    mlx_spec_server,
    request_context,
    running_server,
    serving,
    wait_until,
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


def request(port, method, path, body=None, headers=None, raw=None):
    """(status, headers, parsed JSON or text) of one request."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    data = raw if raw is not None else (json.dumps(body) if body is not None else None)
    conn.request(
        method, path, data, {"Content-Type": "application/json", **(headers or {})}
    )
    r = conn.getresponse()
    text = r.read().decode()
    conn.close()
    is_json = r.getheader("Content-Type", "").startswith("application/json")
    return r.status, dict(r.getheaders()), json.loads(text) if is_json else text


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


def _messages(port, **extra):
    body = {"model": MODEL_ID, "max_tokens": 24, "messages": CHAT, **extra}
    status, _, reply = request(port, "POST", "/v1/messages", body)
    assert status == 200, reply
    return reply


def _events(port, path, body):
    status, _, text = request(port, "POST", path, {**body, "stream": True})
    assert status == 200
    return [json.loads(l[6:]) for l in text.splitlines() if l.startswith("data: {")]


def test_anthropic_stop_sequences_are_reported(ports):
    port = ports["wide"]
    full = _messages(port)["content"][0]["text"]
    stop = full[6:9]
    assert stop and stop not in full[:6]
    msg = _messages(port, stop_sequences=[stop, "never appears"])
    assert msg["content"][0]["text"] == full[: full.index(stop)]
    assert (msg["stop_reason"], msg["stop_sequence"]) == ("stop_sequence", stop)
    body = {"max_tokens": 24, "messages": CHAT, "stop_sequences": [stop]}
    (delta,) = [
        e for e in _events(port, "/v1/messages", body) if e["type"] == "message_delta"
    ]
    assert delta["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": stop}
    plain = _messages(port)
    assert (plain["stop_reason"], plain["stop_sequence"]) == ("max_tokens", None)


def test_anthropic_input_tokens_exclude_the_cached_ones(ports):
    port = ports["wide"]
    messages = [{"role": "user", "content": "input tokens, cached or not"}]
    first = _messages(port, messages=messages)["usage"]
    second = _messages(port, messages=messages)["usage"]
    assert first["cache_read_input_tokens"] == 0
    assert second["cache_read_input_tokens"] > 0
    assert (
        second["input_tokens"] + second["cache_read_input_tokens"]
        == first["input_tokens"]
    )


def test_echo_implemented_best_of_and_suffix_refused_by_name(ports):
    port = ports["wide"]
    text = completion(port, 8)["choices"][0]["text"]
    echoed = completion(port, 8, echo=True)["choices"][0]["text"]
    assert echoed == PROMPT + text
    chunks = _events(
        port, "/v1/completions", {"prompt": PROMPT, "max_tokens": 8, "echo": True}
    )
    assert "".join(c["choices"][0]["text"] for c in chunks) == PROMPT + text
    for extra, name in (
        ({"best_of": 2}, "best_of"),
        ({"suffix": "return x"}, "suffix"),
        ({"echo": True, "logprobs": 2}, "echo"),
    ):
        body = {"prompt": PROMPT, "max_tokens": 2, **extra}
        status, _, reply = request(port, "POST", "/v1/completions", body)
        assert status == 400 and reply["error"]["param"] == name
        assert f"'{name}'" in reply["error"]["message"]
    assert completion(port, 2, best_of=1, suffix="", echo=False)


def test_non_finite_logprobs_are_null_and_json_stays_standard():
    tokenizer = type("T", (), {"decode": staticmethod(lambda ids: f"<{ids[0]}>")})
    for chat in (True, False):
        params = GenerationParams(max_tokens=2, logprobs=True, top_logprobs=2)
        r = OpenAIResponse(chat, "m", params, tokenizer)
        r.add(Started(3, 0))
        r.add(Token(1, float("-inf"), [(2, -0.1), (1, float("-inf"))]))
        r.add(Finished("length", 1, {}))
        body = json.loads(json_bytes(r.body()))  # raises on NaN or Infinity
        logprobs = body["choices"][0]["logprobs"]
        if chat:
            (entry,) = logprobs["content"]
            assert entry["logprob"] is None
            assert [t["logprob"] for t in entry["top_logprobs"]] == [-0.1, None]
        else:
            assert logprobs["token_logprobs"] == [None]
            assert logprobs["top_logprobs"] == [{"<2>": -0.1, "<1>": None}]
    with pytest.raises(ValueError):
        json_bytes({"x": float("nan")})
    assert json.loads(json_bytes({"x": "a\ud800"})) == {"x": "a\ud800"}


def test_errors_name_the_model_id_not_its_path(tmp_path):
    """A model without MTP weights: the engine's refusal of ``draft: mtp``
    names the directory; the client sees the model's id instead."""
    path = write_tiny_checkpoint(
        tmp_path / "nomtp", "qwen3_next", mtp_num_hidden_layers=0
    )
    model, tokenizer = mlx_spec.load(path)
    engine = Engine(model, tokenizer, "ngram", 3)
    try:
        ctx = _context(tokenizer, model)
        app = make_app(engine, ctx, hidden=(str(path),))
        with serving(app) as port:
            body = {"prompt": "x", "max_tokens": 2, "draft": "mtp"}
            status, _, reply = request(port, "POST", "/v1/completions", body)
    finally:
        engine.close()
    message = reply["error"]["message"]
    assert status == 400 and "MTP" in message
    assert str(tmp_path) not in message and MODEL_ID in message


def test_routes_and_methods_answer_json(ports):
    port = ports["wide"]
    status, _, reply = request(port, "GET", "/v1/completions")
    assert status == 405 and "GET" in reply["error"]["message"]
    status, _, reply = request(port, "POST", "/v1/messages/nope", {})
    assert status == 404 and reply["type"] == "error"
    status, _, reply = request(port, "GET", "/v1/models")
    assert [m["id"] for m in reply["data"]] == [MODEL_ID]


# -- graceful shutdown -----------------------------------------------------


def _open_stream(port, path, body):
    """A socket whose response to a streamed ``body`` has begun (its first
    text is in), and what it received so far."""
    data = json.dumps({**body, "stream": True})
    sock = socket.create_connection(("127.0.0.1", port), timeout=120)
    sock.sendall(
        http_request(
            path,
            data.encode(),
            ["Content-Type: application/json", f"Content-Length: {len(data)}"],
        )
    )
    received = b""
    while (
        b"_delta" not in received
        and b'"text": "' not in received.split(b"\r\n\r\n", 1)[-1]
    ):
        chunk = sock.recv(65536)
        assert chunk, "the server closed the stream"
        received += chunk
    return sock, received


def _rest(sock, received) -> str:
    """The body of a chunked response of which ``received`` came in so far:
    read to the connection's end, decoded; it must end with the last chunk."""
    while True:
        chunk = sock.recv(65536)
        if not chunk:
            break
        received += chunk
    rest, body = received.split(b"\r\n\r\n", 1)[1], b""
    while True:
        size, rest = rest.split(b"\r\n", 1)
        if int(size, 16) == 0:
            assert rest == b"\r\n", "the response did not end"
            return body.decode()
        body, rest = body + rest[: int(size, 16)], rest[int(size, 16) + 2 :]


def _decoding(port) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request("GET", "/health")
    status = json.loads(conn.getresponse().read())
    conn.close()
    return status["decoding"]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
@pytest.mark.slow
def test_a_signal_ends_open_requests_at_once(tiny, sig):
    """SIGTERM or SIGINT while an OpenAI and an Anthropic stream and a
    request not streamed are decoding: the OpenAI stream ends with its final
    chunk (``cancelled``) and ``[DONE]``, the Anthropic stream with an
    ``error`` event (not ``message_stop``: a client must not take a cut reply
    for a whole one), each with the speculation counters so far; the other
    request gets a 503; then the process exits with status 0."""
    port = free_port()
    long = {"max_tokens": 3000, "draft": "none"}
    with running_server(mlx_spec_server(tiny, port), port) as proc:
        # prompts whose greedy replies run 1166 tokens and past 3000 before EOS
        stack = [{"role": "user", "content": "class Stack:"}]
        an = _open_stream(port, "/v1/messages", {"messages": stack, **long})
        oa = _open_stream(port, "/v1/completions", {"prompt": "import os", **long})
        whole = {}
        body = {"prompt": "import os", **long}
        asker = threading.Thread(
            target=lambda: whole.update(
                r=request(port, "POST", "/v1/completions", body)
            )
        )
        asker.start()
        wait_until(lambda: _decoding(port) == 3, "three requests decode")
        proc.send_signal(sig)
        oa_text, an_text = _rest(*oa), _rest(*an)
        oa[0].close(), an[0].close()
        asker.join(timeout=120)
        assert proc.wait(timeout=60) == 0
    assert oa_text.rstrip().endswith("data: [DONE]")
    last = json.loads(oa_text.split("data: ")[-2])
    assert last["choices"][0]["finish_reason"] == "cancelled"
    assert last["speculation"]["verify_passes"] > 0  # the counters so far
    events = re.findall(r"event: (\w+)", an_text)
    assert events[-1] == "error"
    assert "message_delta" not in events and "message_stop" not in events
    error = json.loads(an_text.rstrip().split("data: ")[-1])
    assert error["error"]["type"] == "overloaded_error"
    assert "shutting down" in error["error"]["message"]
    assert error["speculation"]["verify_passes"] > 0
    assert error["usage"]["output_tokens"] > 0
    status, _, reply = whole["r"]
    assert status == 503 and "shutting down" in reply["error"]["message"]


# -- the server command's flags --------------------------------------------


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["--port", "70000"], "--port"),
        (["--port", "-1"], "--port"),
        (["--decode-concurrency", "0"], "--decode-concurrency"),
        (["--temp", "-1"], "--temp"),
        (["--temp", "nan"], "--temp"),
        (["--top-p", "5"], "--top-p"),
        (["--max-tokens", "0"], "--max-tokens"),
        (["--min-p", "2"], "--min-p"),
        (["--top-k", "-3"], "--top-k"),
        (["--prefill-chunk", "0"], "--prefill-chunk"),
        (["--prefill-step-size", "0"], "--prefill-step-size"),
        (["--allow-origin", "http://ui.example/"], "--allow-origin"),
        (["--api-key", " "], "--api-key"),
    ],
)
def test_bad_server_flags_are_one_line_naming_the_flag(capsys, argv, flag):
    assert server_command.main(["--model", "/nonexistent", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("mlx_spec server: ")
    assert flag in err and "batch_size" not in err


def test_top_k_beyond_the_vocabulary_is_refused_at_start(tiny):
    out = subprocess.run(
        mlx_spec_server(tiny, free_port(), "--top-k", "5000"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2
    assert out.stderr.strip().splitlines()[-1].startswith("mlx_spec server: --top-k")


def test_new_flags_are_in_the_help(capsys):
    with pytest.raises(SystemExit):
        server_command.main(["--help"])
    out = capsys.readouterr().out
    assert "--allow-origin" in out and "--api-key" in out
