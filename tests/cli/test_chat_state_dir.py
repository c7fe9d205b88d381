"""``mlx_spec chat --state-dir``: a system prompt's state kept on disk and
read by the next chat that begins with it."""

import io
import re

import pytest

from mlx_spec.commands.chat import main

# A system prompt of well over SHARED_MIN tokens on the tiny checkpoints.
SYSTEM = "You are a careful assistant. " * 12


def chat(model_dir, lines, *extra, monkeypatch, capsys):
    """``mlx_spec chat`` in this process: (replies, prefilled per /stats, err)."""
    monkeypatch.setattr("sys.stdin", io.StringIO("".join(f"{x}\n" for x in lines)))
    args = ["--model", str(model_dir), "--max-tokens", "8", "--system-prompt", SYSTEM]
    assert main(args + list(extra)) == 0
    out, err = capsys.readouterr()
    prefilled = [int(n) for n in re.findall(r"prefilled (\d+) tokens", out)]
    replies = [part.split("\n")[0] for part in out.split(">> ")[1:]]
    return replies, prefilled, err


@pytest.mark.parametrize("draft", ["ngram", "mtp"])
def test_a_second_chat_starts_after_the_system_prompt(
    checkpoint_dirs, tmp_path, monkeypatch, capsys, draft
):
    """The first chat keeps the state where the system prompt ends; a
    second one, asked something else, reads it and prefills only its own
    message, with the reply of a chat without the store (and so of mlx-lm)."""
    model_dir, states = checkpoint_dirs["qwen3_5"], tmp_path / "states"
    run = dict(monkeypatch=monkeypatch, capsys=capsys)
    flags = ("--draft", draft, "--state-dir", str(states))
    _, (first,), _ = chat(model_dir, ["hello", "/stats"], *flags, **run)
    assert len(list(states.glob("*.safetensors"))) == 1
    replies, (second,), err = chat(model_dir, ["x = 3", "/stats"], *flags, **run)
    cold, (whole,), _ = chat(model_dir, ["x = 3", "/stats"], "--draft", draft, **run)
    assert replies[0] == cold[0]
    assert second < whole - 32 and first > second
    assert err == ""


def test_an_unusable_state_dir_is_refused_before_loading(
    checkpoint_dirs, tmp_path, capsys
):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    status = main(["--model", "/nonexistent", "--state-dir", str(blocker / "x")])
    err = capsys.readouterr().err
    assert status == 2 and str(blocker) in err and len(err.strip().splitlines()) == 1
