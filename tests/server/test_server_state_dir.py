"""``mlx_spec server --state-dir``: conversation states that outlive the
server process, and two server processes sharing one directory.

Servers run on 127.0.0.1 on free ports and are always stopped; the reference
text is a cold server's (one with an empty state directory)."""

import time

import mlx_lm
import pytest

from mlx_spec.mlx_lm_compat import server_message_helpers
from mlx_spec.testing.checkpoints import write_tiny_checkpoint
from mlx_spec.testing.http_client import get_health as health, post_json
from mlx_spec.testing.server import free_port, mlx_spec_server, running_server

FIRST = [{"role": "user", "content": "def add(a, b):"}]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("srv") / "tiny", "qwen3_next")


def serving(model_path, state_dir, *extra):
    port = free_port()
    argv = mlx_spec_server(
        model_path, port, "--num-draft-tokens", "3", "--state-dir", str(state_dir)
    )
    return port, running_server(argv + list(extra), port)


def chat(port, messages, max_tokens=12):
    body = {"messages": messages, "max_tokens": max_tokens}
    status, r = post_json(port, "/v1/chat/completions", body)
    assert status == 200, r
    cached = r["usage"]["prompt_tokens_details"]["cached_tokens"]
    return r["choices"][0]["message"]["content"], cached


def wait_written(port, limit=600):
    """Poll /health until the server has written a state and has none
    waiting to be written (bounded)."""
    for _ in range(limit):
        disk = health(port)["disk"]
        if disk["written"] and not disk["queued"]:
            return disk
        time.sleep(0.05)
    raise TimeoutError("no state was written")


def next_turn(reply):
    return FIRST + [
        {"role": "assistant", "content": reply},
        {"role": "user", "content": "and now subtract"},
    ]


@pytest.fixture(scope="module")
def first_prompt_tokens(model_path):
    convert_chat, _ = server_message_helpers()
    _, tok = mlx_lm.load(str(model_path))
    return len(tok.encode(convert_chat(FIRST)))


def test_a_restarted_server_continues_the_conversation_from_disk(
    model_path, tmp_path, first_prompt_tokens
):
    port, server = serving(model_path, tmp_path / "states")
    with server:
        reply, cached = chat(port, FIRST)
        assert cached == 0
    # stopped: its states were written when it stopped
    assert any(p.suffix == ".safetensors" for p in (tmp_path / "states").iterdir())
    second = next_turn(reply)
    port, server = serving(model_path, tmp_path / "states")
    with server:
        text, cached = chat(port, second)
        assert health(port)["disk"]["loaded"] == 1
    port, server = serving(model_path, tmp_path / "cold")
    with server:
        cold, cold_cached = chat(port, second)
    assert cold_cached == 0 and text == cold
    # only the new turn was prefilled: the first prompt (at least) came from disk
    assert cached >= first_prompt_tokens - 1


def test_two_servers_share_a_state_directory(model_path, tmp_path):
    """A state one server writes (its memory keeps none) the other loads."""
    states = tmp_path / "states"
    port_a, server_a = serving(model_path, states, "--prompt-cache-bytes", "0")
    port_b, server_b = serving(model_path, states, "--prompt-cache-bytes", "0")
    with server_a, server_b:
        reply, _ = chat(port_a, FIRST)
        wait_written(port_a)
        second = next_turn(reply)
        text, cached = chat(port_b, second)
        assert cached > 0 and health(port_b)["disk"]["loaded"] >= 1
        again, _ = chat(port_a, second)  # A too, from a state either wrote
        assert again == text


def test_an_unusable_state_dir_is_refused_before_the_model_loads(tmp_path):
    import subprocess
    import sys

    blocker = tmp_path / "file"
    blocker.write_text("")
    argv = [sys.executable, "-m", "mlx_spec", "server", "--model", "nowhere"]
    out = subprocess.run(
        argv + ["--state-dir", str(blocker / "states")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode != 0
    assert (
        out.stderr.strip()
        .splitlines()[-1]
        .startswith("mlx_spec server: cannot keep states in")
    )
