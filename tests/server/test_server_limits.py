"""What a careless or hostile client may cost the server, and what it is told:
a reply capped at the model's context and at ``--max-tokens-limit`` (with the
finish reason saying so), a stream whose client stops reading ended after a
bounded backlog, a connection whose writes stay blocked closed, headers and
bodies that never finish timed out, and a stream the server cuts short ended
so that no client takes it for a whole reply.

Two kinds of server: an ``mlx_spec server`` process on a tiny checkpoint
with a small context (the command's own wiring), and in-process apps on one
engine whose passes a test counts (:class:`GatedEngine`), with small limits
so that nothing waits long. Every wait is for a signal (the engine's state,
a connection's end), bounded; servers listen on free ports of 127.0.0.1.
"""

import http.client
import json
import socket
import time

import pytest

import mlx_spec
from mlx_spec.commands import server as server_command
from mlx_spec.core.batch_row import BatchRow
from mlx_spec.server.anthropic import MessageResponse
from mlx_spec.server import bridge
from mlx_spec.server.engine import Engine
from mlx_spec.server.events import Finished, GenerationParams, Job
from mlx_spec.server.http import make_app
from mlx_spec.server.limits import ClientLimits
from mlx_spec.testing.checkpoints import write_tiny_checkpoint
from mlx_spec.testing.http_client import (
    get_health,
    http_request,
    json_request,
    post_json,
    post_stream,
    read_until_closed,
)
from mlx_spec.testing.server import gated_engine, job_events, request_context
from mlx_spec.testing.server import served_checkpoint, serving

MODEL_ID = "tiny"
CONTEXT = 128  # the small-context checkpoint's max_position_embeddings
CEILING = 12  # the in-process apps' max_tokens_limit
BACKLOG = 16  # tokens a stream of the in-process apps may fall behind
SEND_BUFFER = 16 << 10  # their connections' SO_SNDBUF
SHORT = 2.0  # the "slow" app's header, body and write timeouts, in seconds
PROMPT = "import os"  # greedy, its reply runs past 3000 tokens before EOS
ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/messages")
WAIT = 2400  # cap of every polling loop (iterations of 0.05 s)
FINISH = {"/v1/messages": "max_tokens"}  # else "length"


def _wait(condition, what):
    for _ in range(WAIT):
        if condition():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting until {what}")


def body_for(path, max_tokens, **fields):
    if path == "/v1/completions":
        body = {"prompt": PROMPT}
    else:
        body = {"messages": [{"role": "user", "content": PROMPT}]}
    return {"max_tokens": max_tokens, **body, **fields}


def finish_of(path, reply) -> str:
    if path == "/v1/messages":
        return reply["stop_reason"]
    return reply["choices"][0]["finish_reason"]


def usage_of(path, reply):
    """(prompt tokens, completion tokens) of a reply not streamed."""
    u = reply["usage"]
    if path == "/v1/messages":
        return u["input_tokens"] + u["cache_read_input_tokens"], u["output_tokens"]
    return u["prompt_tokens"], u["completion_tokens"]


# -- servers ---------------------------------------------------------------


@pytest.fixture(scope="module")
def small_context(tmp_path_factory):
    """``mlx_spec server`` on a checkpoint whose context is ``CONTEXT``
    tokens, drafting 3 tokens a pass (so drafts reach the context's end)."""

    def write(path, family):
        return write_tiny_checkpoint(path, family, max_position_embeddings=CONTEXT)

    with served_checkpoint(
        tmp_path_factory, write, MODEL_ID, "qwen3_next", "--num-draft-tokens", "3"
    ) as served:
        yield served[1]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_checkpoint(
        tmp_path_factory.mktemp("limits") / MODEL_ID, "qwen3_next"
    )


@pytest.fixture(scope="module")
def engine(tiny):
    with gated_engine(tiny) as engine:
        yield engine


def _context(engine, **extra):
    return request_context(engine.tokenizer, MODEL_ID, max_tokens=8, **extra)


@pytest.fixture(scope="module")
def apps(engine):
    """In-process apps on one engine: ``capped`` (a ``max_tokens_limit`` of
    ``CEILING``), ``patient`` (a small send buffer and backlog, the default
    timeouts) and ``slow`` (the same, with ``SHORT`` timeouts)."""
    small = dict(send_buffer=SEND_BUFFER, stream_backlog=BACKLOG)
    made = {
        "capped": make_app(engine, _context(engine, max_tokens_limit=CEILING)),
        "patient": make_app(engine, _context(engine), limits=ClientLimits(**small)),
        "slow": make_app(
            engine,
            _context(engine),
            limits=ClientLimits(
                header_seconds=SHORT, body_seconds=SHORT, write_seconds=SHORT, **small
            ),
        ),
    }
    with serving(made["capped"]) as a, serving(made["patient"]) as b:
        with serving(made["slow"]) as c:
            yield {
                "capped": a,
                "patient": b,
                "slow": c,
                "generations": {
                    name: app.state.server.generations for name, app in made.items()
                },
            }


# -- max_tokens: capped, never past the context ----------------------------


def _streamed_usage(port, path, body):
    """(prompt tokens, completion tokens) of a streamed reply, whose finish
    must say it was cut at its budget."""
    if path == "/v1/messages":
        events = post_stream(port, path, {**body, "stream": True})
        (start,) = [e for e in events if e["type"] == "message_start"]
        (delta,) = [e for e in events if e["type"] == "message_delta"]
        assert delta["delta"]["stop_reason"] == "max_tokens"
        usage = start["message"]["usage"]
        prompt = usage["input_tokens"] + usage["cache_read_input_tokens"]
        return prompt, delta["usage"]["output_tokens"]
    options = {"stream": True, "stream_options": {"include_usage": True}}
    events = post_stream(port, path, {**body, **options})
    assert events[-2]["choices"][0]["finish_reason"] == "length"
    usage = events[-1]["usage"]
    return usage["prompt_tokens"], usage["completion_tokens"]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("asked", [1000, 2**70])
@pytest.mark.parametrize("path", ENDPOINTS)
def test_a_reply_ends_at_the_context_with_a_length_finish(
    small_context, path, asked, stream
):
    """``max_tokens`` past what the prompt leaves of the context (or 2**70)
    is not refused: the reply stops at the context, and says so."""
    body = body_for(path, asked)
    if stream:
        prompt, completion = _streamed_usage(small_context, path, body)
    else:
        status, reply = post_json(small_context, path, body)
        assert status == 200, reply
        assert finish_of(path, reply) == FINISH.get(path, "length")
        prompt, completion = usage_of(path, reply)
    assert prompt + completion == CONTEXT
    # the states kept after the replies hold no more than the context
    assert max(get_health(small_context)["kept_states"]) <= CONTEXT


def test_the_engine_never_drafts_past_the_context(tiny, monkeypatch):
    """Every draft a row makes, verified with its pending token, ends within
    the model's context, and the reply fills it: the budget a row gets is
    what its prompt leaves of the context."""
    reach = []  # tokens the caches would hold after each pass, drafts kept
    draft = BatchRow.draft
    model, tok = mlx_spec.load(tiny)

    def recorded(self, k, heads):
        made = draft(self, k, heads)
        if self.decoder.model is model:  # this test's engines' rows only
            reach.append((len(self.decoder.history) + len(made), len(made)))
        return made

    monkeypatch.setattr(BatchRow, "draft", recorded)
    context = 96
    for name in ("ngram", "mtp+ngram"):
        engine = Engine(model, tok, name, num_draft_tokens=3, context_length=context)
        try:
            prompt = tok.encode(PROMPT * 4)
            job = engine.submit(Job(prompt, GenerationParams(max_tokens=10**6)))
            (finished,) = [e for e in job_events(job) if isinstance(e, Finished)]
        finally:
            engine.close()
        assert finished.reason == "length"
        assert len(prompt) + finished.completion_tokens == context
        assert finished.speculation["drafted"] > 0
    assert max(r for r, _ in reach) <= context
    assert any(size for _, size in reach)


@pytest.mark.parametrize("path", ENDPOINTS)
def test_max_tokens_is_capped_at_the_server_limit(apps, path):
    port = apps["capped"]
    for fields in ({"max_tokens": 2**70}, {"max_tokens": 10**6}):
        status, reply = post_json(port, path, body_for(path, **fields))
        assert status == 200, reply
        assert usage_of(path, reply)[1] == CEILING
        assert finish_of(path, reply) == FINISH.get(path, "length")
    if path != "/v1/messages":
        body = body_for(path, 4, max_completion_tokens=2**70)
        status, reply = post_json(port, path, body)
        assert status == 200 and usage_of(path, reply)[1] == CEILING
    status, reply = post_json(port, path, body_for(path, 5))
    assert status == 200 and usage_of(path, reply)[1] == 5  # below it: its own


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["--max-tokens", "600", "--max-tokens-limit", "500"], "--max-tokens"),
        (["--max-tokens-limit", "0"], "--max-tokens-limit"),
        (["--header-timeout", "0"], "--header-timeout"),
        (["--body-timeout", "-1"], "--body-timeout"),
        (["--write-timeout", "nan"], "--write-timeout"),
        (["--temp", "1e-30"], "--temp"),
    ],
)
def test_bad_limit_flags_are_one_line_naming_the_flag(capsys, argv, flag):
    assert server_command.main(["--model", "/nonexistent", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("mlx_spec server: ")
    assert flag in err


# -- a stream whose client does not read -----------------------------------


def _silent_client(port, path, body) -> socket.socket:
    """A connection that sends a streamed request and reads nothing (its
    receive buffer small, so that the server's side fills soon)."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.settimeout(120)
    sock.connect(("127.0.0.1", port))
    sock.sendall(json_request(path, {**body, "stream": True}))
    return sock


# what the server may hold for a client that reads nothing, in tokens: its
# send buffer (which Linux doubles), uvicorn's 64 KiB, the client's receive
# buffer, at 300 bytes a token at least (each carries 20 top logprobs), and
# the backlog, plus the pass that ends it
MOST_TOKENS = BACKLOG + 1 + (4 * SEND_BUFFER + (64 << 10) + (16 << 10)) // 300
LONG = {"prompt": PROMPT, "max_tokens": 3000, "draft": "none", "logprobs": 20}


def _the_new_job(engine, jobs):
    _wait(lambda: len(engine.jobs) > jobs, "the job is submitted")
    return engine.jobs[-1]


def test_a_client_that_stops_reading_has_its_generation_ended(apps, engine):
    """The client reads nothing: once the buffers are full and ``BACKLOG``
    tokens wait, the row leaves the batch, well before its ``max_tokens``
    (its greedy reply would run on past 3000); the server answers others
    meanwhile. Read at last, the stream ends with a ``cancelled`` chunk
    carrying the counters so far, and ``[DONE]``."""
    jobs = len(engine.jobs)
    sock = _silent_client(apps["patient"], "/v1/completions", LONG)
    try:
        job = _the_new_job(engine, jobs)
        _wait(lambda: job.cancelled, "the generation is ended")
        _wait(lambda: not engine.decoding(job), "the row leaves the batch")
        assert engine.passes[id(job)] <= MOST_TOKENS
        status, reply = post_json(
            apps["patient"], "/v1/completions", {"prompt": "x", "max_tokens": 3}
        )
        assert status == 200 and reply["usage"]["completion_tokens"] == 3
        received = b""
        while b"data: [DONE]" not in received:
            chunk = sock.recv(65536)
            assert chunk, "the stream ended without [DONE]"
            received += chunk
    finally:
        sock.close()
    chunks = [
        json.loads(line[6:])
        for line in received.decode(errors="replace").splitlines()
        if line.startswith("data: {")
    ]
    last = chunks[-1]
    assert last["choices"][0]["finish_reason"] == "cancelled"
    assert 0 < last["speculation"]["verify_passes"] <= engine.passes[id(job)]


def test_a_connection_that_reads_nothing_is_closed(apps, engine):
    """After its generation ended, a client that still reads nothing for the
    write timeout loses its connection: its request ends (nothing left
    open), and the server goes on."""
    jobs = len(engine.jobs)
    open_now = apps["generations"]["slow"].open
    sock = _silent_client(apps["slow"], "/v1/completions", LONG)
    try:
        job = _the_new_job(engine, jobs)
        _wait(lambda: not engine.decoding(job), "the row leaves the batch")
        _wait(lambda: not open_now, "the request ends")
        assert job.cancelled and engine.passes[id(job)] <= MOST_TOKENS
        read_until_closed(sock)  # a socket.timeout if it stays open
    finally:
        sock.close()
    status, _ = post_json(apps["slow"], "/v1/completions", {"prompt": "x"})
    assert status == 200


def test_an_anthropic_stream_cut_short_ends_with_an_error_event():
    """A reply the server ends early is an ``error`` event (Anthropic's
    documented shape), never ``message_stop`` with ``end_turn``."""
    counters = {"draft": "ngram", "drafted": 6, "accepted": 4, "verify_passes": 3}
    reply = MessageResponse(MODEL_ID)
    events = reply.stream(
        [Finished("cancelled", 7, counters, cut=bridge.FellBehind(16))]
    )
    assert [name for name, _ in events] == ["error"]
    _, data = events[0]
    assert data["type"] == "error" and data["error"]["type"] == "api_error"
    assert "did not read" in data["error"]["message"]
    assert data["speculation"] == counters and data["usage"]["output_tokens"] == 7


# -- headers and bodies that never finish ----------------------------------


def _closed_after(port, data: bytes) -> bytes:
    """Send ``data`` and read to the connection's end (a ``socket.timeout``
    after 60 s if the server keeps it open)."""
    with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
        sock.sendall(data)
        return read_until_closed(sock)


HALF_HEADER = b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Le"


@pytest.mark.parametrize("data", [b"", HALF_HEADER], ids=["nothing", "half"])
def test_headers_that_never_finish_close_the_connection(apps, data):
    assert _closed_after(apps["slow"], data) == b""


def test_a_kept_alive_connection_is_held_to_the_header_timeout_too(apps):
    """After a whole exchange, the next request's half header: closed."""
    request = json_request("/v1/completions", {"prompt": "x", "max_tokens": 2})
    with socket.create_connection(("127.0.0.1", apps["slow"]), timeout=60) as sock:
        sock.sendall(request)
        received = b""
        while b'"completion_tokens": 2' not in received:
            chunk = sock.recv(65536)
            assert chunk, "closed before the first response"
            received += chunk
        sock.sendall(HALF_HEADER)
        assert read_until_closed(sock) == b""


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/messages"])
def test_a_body_that_never_finishes_is_a_408(apps, engine, path):
    jobs = len(engine.jobs)
    head = http_request(
        path,
        b'{"prompt": "x", "max',
        ["Content-Type: application/json", "Content-Length: 400"],
    )
    received = _closed_after(apps["slow"], head)
    assert received.startswith(b"HTTP/1.1 408 ")
    error = json.loads(received.split(b"\r\n\r\n", 1)[1])
    if path == "/v1/messages":
        assert error["type"] == "error"
        assert error["error"]["type"] == "invalid_request_error"
        message = error["error"]["message"]
    else:
        message = error["error"]["message"]
    assert "did not arrive" in message and f"{SHORT:g} s" in message
    assert len(engine.jobs) == jobs


def test_a_request_sent_in_pieces_is_served(apps):
    """Headers and body in several sends, within the timeouts: answered."""
    body = json.dumps({"prompt": "x", "max_tokens": 2}).encode()
    head = http_request(
        "/v1/completions",
        b"",
        [
            "Content-Type: application/json",
            f"Content-Length: {len(body)}",
            "Connection: close",
        ],
    )
    with socket.create_connection(("127.0.0.1", apps["slow"]), timeout=60) as sock:
        for piece in (head[:20], head[20:], body[:5], body[5:]):
            sock.sendall(piece)
        received = read_until_closed(sock)
    assert received.startswith(b"HTTP/1.1 200 ")
    conn = http.client.HTTPConnection("127.0.0.1", apps["slow"], timeout=60)
    conn.request("GET", "/health")
    assert conn.getresponse().status == 200
    conn.close()
