"""The ``server`` command as a process: a signal (SIGTERM, SIGINT) ends the
open requests at once, each stream with its last event and counters, then the
process exits cleanly; its flags, each bad one refused in one line naming it."""

import http.client
import json
import re
import signal
import socket
import subprocess
import threading

import pytest

from mlx_spec.commands import server as server_command
from mlx_spec.testing.checkpoints import write_tiny_checkpoint
from mlx_spec.testing.http_client import http_request, request
from mlx_spec.testing.server import (
    free_port,
    mlx_spec_server,
    running_server,
    wait_until,
)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_checkpoint(
        tmp_path_factory.mktemp("command") / "tiny", "qwen3_next"
    )


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
