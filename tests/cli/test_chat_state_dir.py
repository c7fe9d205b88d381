"""``mlx_spec chat --state-dir``: a system prompt's state kept on disk and
read by the next chat that begins with it."""

import io
import logging
import os
import re
import shutil
import time

import pytest

from mlx_spec.commands.chat import main
from mlx_spec.states.store import STALE_TEMP_S
from mlx_spec.testing.checkpoints import fine_tune_copy
from mlx_spec.testing.dflash_drafters import write_dflash_checkpoint

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


def files_of(directory):
    """name -> bytes of every file in ``directory`` (its subfolders too)."""
    return {
        str(p.relative_to(directory)): p.read_bytes()
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


@pytest.mark.parametrize("holding", ["a model", "adapters", "an empty path"])
def test_a_state_dir_that_is_not_its_own_is_refused_and_left_alone(
    checkpoint_dirs, tmp_path, capsys, holding
):
    """``--state-dir`` naming a model's directory, a directory of adapters,
    or nothing at all (an unset shell variable) is one line, before the model
    loads, and no file there changes."""
    directory = tmp_path / "d"
    if holding == "a model":
        shutil.copytree(checkpoint_dirs["qwen3_5"], directory)
    elif holding == "adapters":
        directory.mkdir()
        (directory / "adapter_config.json").write_text('{"fine_tune_type": "lora"}')
        (directory / "adapters.safetensors").write_bytes(b"weights")
    else:
        directory.mkdir()
    before = files_of(directory)
    flag = "" if holding == "an empty path" else str(directory)
    status = main(["--model", "/nonexistent", "--state-dir", flag])
    err = capsys.readouterr().err
    assert status == 2 and len(err.strip().splitlines()) == 1, err
    assert ("empty path" if holding == "an empty path" else "not states") in err
    assert files_of(directory) == before


def test_chat_leaves_the_files_it_did_not_write(
    checkpoint_dirs, tmp_path, monkeypatch, capsys
):
    """Hidden files and a file named like a state that is none, in the state
    directory before two chats; the second chat's budget holds one state, so
    it trims when it starts and after it writes: those files stay as they
    were, and one state is left."""
    states = tmp_path / "states"
    states.mkdir()
    old = time.time() - 2 * STALE_TEMP_S
    (states / ".DS_Store").write_bytes(b"finder")
    alike = states / ("0" * 40 + ".safetensors")
    shutil.copy(checkpoint_dirs["qwen3_5"] / "model.safetensors", alike)
    for path in states.iterdir():
        os.utime(path, (old, old))  # the oldest, were they counted
    before = files_of(states)
    run = dict(monkeypatch=monkeypatch, capsys=capsys)
    model, flags = checkpoint_dirs["qwen3_5"], ("--state-dir", str(states))
    chat(model, ["x = 3"], *flags, **run)
    (kept,) = [p for p in states.glob("*.safetensors") if p != alike]
    budget = str(int(1.5 * kept.stat().st_size))
    other = ("--system-prompt", "You answer in verse. " * 12)
    chat(model, ["y = 4"], *flags, "--state-dir-bytes", budget, *other, **run)
    after = files_of(states)
    assert {name: after.get(name) for name in before} == before
    (left,) = [p for p in states.glob("*.safetensors") if p != alike]
    assert left != kept  # the first chat's state was trimmed


def test_a_session_of_the_base_model_is_refused_for_its_fine_tune(
    checkpoint_dirs, tmp_path, monkeypatch, capsys
):
    """``--prompt-cache-file`` written with one model and loaded with a
    fine-tune of one of its layers (the same config, tokenizer and embedding):
    refused, naming the file; with the base, it still loads."""
    base = checkpoint_dirs["qwen3_5"]
    fine_tune_copy(base, tmp_path / "tuned")
    session = tmp_path / "s.safetensors"
    run = dict(monkeypatch=monkeypatch, capsys=capsys)
    chat(base, ["a = 1"], "--prompt-cache-file", str(session), **run)
    monkeypatch.setattr("sys.stdin", io.StringIO("b = 2\n"))
    args = ["--model", str(tmp_path / "tuned"), "--prompt-cache-file", str(session)]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "saved for another model or other weights" in err and str(session) in err
    replies, _, err = chat(base, ["b = 2"], "--prompt-cache-file", str(session), **run)
    assert err == "" and replies


def test_a_state_kept_with_one_drafter_model_is_not_read_with_another(
    checkpoint_dirs, tmp_path, monkeypatch, capsys, caplog
):
    """The system prompt's state kept by a chat with DFlash drafter A: a
    chat with drafter B (same shapes, other weights) skips it with a warning
    and prefills the whole prompt; a chat with A again reads it. Each
    answers as a chat without the store does."""
    model_dir, states = checkpoint_dirs["qwen3_5"], tmp_path / "states"
    a = write_dflash_checkpoint(tmp_path / "a", "qwen3_5", seed=0)
    b = write_dflash_checkpoint(tmp_path / "b", "qwen3_5", seed=1)
    run = dict(monkeypatch=monkeypatch, capsys=capsys)

    def chat_with(drafter, *flags):
        lines = ["x = 3", "/stats"]
        return chat(model_dir, lines, "--draft-model", str(drafter), *flags, **run)

    store = ("--state-dir", str(states))
    chat(model_dir, ["hello"], "--draft-model", str(a), *store, **run)
    cold, (whole,), _ = chat_with(a)
    caplog.set_level(logging.WARNING, "mlx_spec.states")
    other, (with_b,), _ = chat_with(b, *store)
    assert with_b == whole
    said = [r.getMessage() for r in caplog.records]
    assert any("another DFlash drafter model" in m for m in said), said
    again, (with_a,), _ = chat_with(a, *store)
    assert with_a < whole - 32
    assert other[0] == again[0] == cold[0]
