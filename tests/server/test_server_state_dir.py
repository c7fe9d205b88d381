"""``mlx_spec server --state-dir``: conversation states that outlive the
server process, and two server processes sharing one directory.

Servers run on 127.0.0.1 on free ports and are always stopped; the reference
text is a cold server's (one with an empty state directory)."""

import shutil
import subprocess
import sys
import time

import mlx_lm
import pytest

from mlx_spec.demo import default_model_path
from mlx_spec.mlx_lm_compat import server_message_helpers
from mlx_spec.states.store import STATE_NAME
from mlx_spec.testing.checkpoints import fine_tune_copy, write_tiny_checkpoint
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


def files_of(directory):
    """name -> bytes of every file under ``directory``."""
    return {
        str(p.relative_to(directory)): p.read_bytes()
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


@pytest.mark.parametrize("given", ["a file's path", "a model", "adapters", "nothing"])
def test_an_unusable_state_dir_is_refused_before_the_model_loads(
    model_path, tmp_path, given
):
    """A path under a file, a model's directory (the one served, even), a
    directory of adapters, an empty path (an unset shell variable): one line,
    exit status 2, and every file there as it was."""
    directory = tmp_path / "d"
    if given == "a file's path":
        directory.write_text("")
        flag = str(directory / "states")
    elif given == "a model":
        shutil.copytree(model_path, directory)
        flag = str(directory)
    elif given == "adapters":
        directory.mkdir()
        (directory / "adapter_config.json").write_text('{"fine_tune_type": "lora"}')
        (directory / "adapters.safetensors").write_bytes(b"weights")
        flag = str(directory)
    else:
        directory.mkdir()
        flag = ""
    before = files_of(directory) if directory.is_dir() else None
    model = str(directory) if given == "a model" else "nowhere"
    argv = [sys.executable, "-m", "mlx_spec", "server", "--model", model]
    out = subprocess.run(
        argv + ["--state-dir", flag], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 2, out.stderr
    (line,) = out.stderr.strip().splitlines()
    assert line.startswith("mlx_spec server: ")
    assert ("empty path" if given == "nothing" else "cannot keep states in") in line
    if before is not None:
        assert files_of(directory) == before


def test_a_serving_server_leaves_the_files_it_did_not_write(model_path, tmp_path):
    """A model's files copied into the state directory while the server runs,
    under a budget of about two states, with every state spilled to disk: the
    trims after each write and at the stop remove states only."""
    states = tmp_path / "states"
    port, server = serving(
        model_path, states, "--prompt-cache-bytes", "0", "--state-dir-bytes", "200K"
    )
    with server:
        chat(port, FIRST)
        disk = wait_written(port)
        shutil.copytree(model_path, states / "model")
        for name in ("model.safetensors", "config.json"):
            shutil.copy(model_path / name, states / name)
        before = files_of(states)
        for i in range(4):
            chat(port, [{"role": "user", "content": f"def f{i}(x):"}])
        for _ in range(600):  # bounded: until the writes and trims are done
            disk = health(port)["disk"]
            if disk["written"] >= 5 and not disk["queued"]:
                break
            time.sleep(0.05)
        assert disk["removed"] >= 1 and disk["bytes"] <= 200 << 10
    after = files_of(states)
    foreign = [n for n in before if not STATE_NAME.fullmatch(n)]
    assert len(foreign) >= 6
    assert {n: after.get(n) for n in foreign} == {n: before[n] for n in foreign}


DEMO_PROMPT = [{"role": "user", "content": "def fibonacci(n):"}]


def test_a_fine_tune_of_the_demo_model_never_continues_its_base(tmp_path):
    """The demo model keeps a conversation on disk; a fine-tune of one of
    its layers, restarted on the same directory, answers as the same
    fine-tune does cold (nothing read from disk), and the base, restarted,
    continues from disk with its own cold answer."""
    base = default_model_path()
    fine_tune_copy(base, tmp_path / "tuned")
    states = tmp_path / "states"
    port, server = serving(base, states)
    with server:
        reply, _ = chat(port, DEMO_PROMPT, max_tokens=16)
    second = DEMO_PROMPT + [
        {"role": "assistant", "content": reply},
        {"role": "user", "content": "and the tests"},
    ]
    answers = {}
    for name, model, directory in (
        ("tuned", tmp_path / "tuned", states),
        ("tuned cold", tmp_path / "tuned", tmp_path / "cold1"),
        ("base", base, states),
        ("base cold", base, tmp_path / "cold2"),
    ):
        port, server = serving(model, directory)
        with server:
            answers[name] = chat(port, second, max_tokens=16)
    assert answers["tuned"] == answers["tuned cold"]  # text, and 0 cached
    assert answers["tuned"][1] == 0
    assert answers["base"][0] == answers["base cold"][0] and answers["base"][1] > 0
    assert answers["tuned"][0] != answers["base"][0]
