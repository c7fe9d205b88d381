"""``mlx_spec chat``: turns, state carried across turns, save/load, Ctrl-C."""

import io
import os
import select
import shutil
import signal
import subprocess
import sys
import time

import mlx.core as mx
import pytest
from mlx_lm.generate import stream_generate as mlx_stream_generate
from mlx_lm.models.cache import load_prompt_cache, make_prompt_cache

from mlx_spec.commands.chat import ChatSession, main, setup_parser
from mlx_spec.states.session_file import save_session

TURNS = ["def area(width, height):", "x = area(3, 4)", "print(x)"]


def chat_cmd(model_dir, *extra):
    return [
        sys.executable,
        "-m",
        "mlx_spec",
        "chat",
        "--model",
        str(model_dir),
        "--max-tokens",
        "24",
        *extra,
    ]


def run_chat(model_dir, lines, *extra, monkeypatch, capsys):
    """``mlx_spec chat`` in this process, reading ``lines``: (status, out, err)."""
    monkeypatch.setattr("sys.stdin", io.StringIO("".join(f"{x}\n" for x in lines)))
    status = main(["--model", str(model_dir), "--max-tokens", "8", *extra])
    out, err = capsys.readouterr()
    return status, out, err


def chat_with_session(checkpoint_dirs, path, line, monkeypatch, capsys):
    """One line to ``mlx_spec chat --prompt-cache-file path`` on qwen3_5."""
    return run_chat(
        checkpoint_dirs["qwen3_5"],
        [line],
        "--prompt-cache-file",
        str(path),
        monkeypatch=monkeypatch,
        capsys=capsys,
    )


def replies_of(stdout):
    """The reply after each '>> ' prompt (stdin is not echoed)."""
    return [part.rstrip("\n") for part in stdout.split(">> ")[1:]]


def reference_replies(model, tok, turns, max_tokens=24, **kwargs):
    """What mlx-lm greedy gives for the same conversation: the same turn
    tokens (plain-continuation fallback: this tokenizer has no chat template),
    one prompt cache carried across turns; ``kwargs`` go to each turn."""
    args = setup_parser().parse_args(["--max-tokens", str(max_tokens)])
    session = ChatSession(model, tok, args)  # only used to build turn tokens
    cache, out = make_prompt_cache(model), []
    for i, text in enumerate(turns):
        session.decoder.history = [0] * i  # "not the first turn" after turn 0
        tokens = session.turn_tokens(text)
        reply = [
            r.token
            for r in mlx_stream_generate(
                model, tok, mx.array(tokens), max_tokens, prompt_cache=cache, **kwargs
            )
        ]
        detok = tok.detokenizer  # the streaming detokenizer, as the chat prints
        detok.reset()
        for t in reply:
            if t not in tok.eos_token_ids:
                detok.add_token(t)
        detok.finalize()
        out.append((detok.text, len(tokens)))
    return out


@pytest.mark.slow
def test_three_turns_match_mlx_lm_and_prefill_only_new_tokens(checkpoint_dirs, models):
    model, tok = models["qwen3_next"]
    stdin = "\n".join(TURNS + ["/stats"]) + "\n"
    run = subprocess.run(
        chat_cmd(checkpoint_dirs["qwen3_next"]),
        input=stdin,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert run.returncode == 0, run.stderr
    got = replies_of(run.stdout)
    ref = reference_replies(model, tok, TURNS)
    assert got[:3] == [text for text, _ in ref]
    stats = got[3]
    assert f"prefilled {ref[2][1]} tokens" in stats  # turn 3: its own tokens only
    context = int(stats.split(" tokens of context")[0].split()[-1])
    assert ref[2][1] < context // 3


@pytest.mark.parametrize("draft", ["ngram", "mtp+ngram"])
def test_every_family_chats_as_mlx_lm(models, family, draft):
    """A chat's turns, one session across them, are mlx-lm's replies with one
    prompt cache for the conversation, on every family."""
    model, tok = models[family]
    args = setup_parser().parse_args(["--max-tokens", "16", "--draft", draft])
    chat = ChatSession(model, tok, args)
    got = ["".join(chat.reply(text)) for text in TURNS]
    assert got == [text for text, _ in reference_replies(model, tok, TURNS, 16)]


def test_penalty_flags_apply_to_every_turn(
    checkpoint_dirs, models, monkeypatch, capsys
):
    """Each turn is mlx-lm's under the same penalties (they see the turn's own
    tokens, as mlx-lm's do with a prompt cache), not the unpenalised reply."""
    from mlx_lm.sample_utils import make_logits_processors

    model, tok = models["qwen3_5"]
    flags = ["--repetition-penalty", "3", "--repetition-context-size", "12"]
    status, out, err = run_chat(
        checkpoint_dirs["qwen3_5"],
        TURNS,
        *flags,
        monkeypatch=monkeypatch,
        capsys=capsys,
    )
    assert status == 0, err
    processors = make_logits_processors(
        repetition_penalty=3.0, repetition_context_size=12
    )
    want = reference_replies(model, tok, TURNS, 8, logits_processors=processors)
    assert replies_of(out)[:3] == [text for text, _ in want]
    assert want != reference_replies(model, tok, TURNS, 8)


@pytest.mark.slow
def test_save_quit_load_continue(checkpoint_dirs, tmp_path):
    model_dir = checkpoint_dirs["qwen3_5"]
    once = subprocess.run(
        chat_cmd(model_dir),
        input="\n".join(TURNS) + "\n",
        capture_output=True,
        text=True,
        timeout=180,
    )
    cache_file = tmp_path / "session.safetensors"
    first = subprocess.run(
        chat_cmd(model_dir, "--prompt-cache-file", str(cache_file)),
        input="\n".join(TURNS[:2]) + "\n",
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert first.returncode == 0 and cache_file.exists(), first.stderr
    second = subprocess.run(
        chat_cmd(model_dir, "--prompt-cache-file", str(cache_file)),
        input=TURNS[2] + "\n",
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert second.returncode == 0, second.stderr
    assert (
        replies_of(first.stdout)[:2] + replies_of(second.stdout)[:1]
        == replies_of(once.stdout)[:3]
    )


@pytest.mark.slow
def test_cache_file_of_another_model_is_refused(checkpoint_dirs, tmp_path):
    cache_file = tmp_path / "s.safetensors"
    subprocess.run(
        chat_cmd(checkpoint_dirs["qwen3_5"], "--prompt-cache-file", str(cache_file)),
        input="a = 1\n",
        capture_output=True,
        text=True,
        timeout=180,
    )
    run = subprocess.run(
        chat_cmd(checkpoint_dirs["qwen3_next"], "--prompt-cache-file", str(cache_file)),
        input="b = 2\n",
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert run.returncode == 2
    assert "was saved for another model" in run.stderr and str(cache_file) in run.stderr


def test_interrupted_reply_keeps_a_consistent_state(models):
    """Stopping mid-reply (what Ctrl-C does) keeps exactly the tokens shown."""
    model, tok = models["qwen3_5_moe"]
    args = setup_parser().parse_args(["--max-tokens", "200", "--num-draft-tokens", "4"])
    chat = ChatSession(model, tok, args)
    shown = []
    for segment in chat.reply(TURNS[0], interrupted=lambda: len(shown) >= 5):
        shown.append(segment)
    decoder = chat.decoder
    assert 5 <= chat.turn_stats.generated < 200
    detok = tok.detokenizer
    detok.reset()
    for t in decoder.history[chat.prefilled :]:
        detok.add_token(t)
    detok.finalize()
    assert detok.text == "".join(shown)
    # Attention caches hold everything but the pending last token.
    kv = [c for c in decoder.cache.caches if hasattr(c, "offset")]
    assert kv[0].offset == len(decoder.history) - 1


def test_stats_empty_lines_and_unknown_commands(
    checkpoint_dirs, tmp_path, monkeypatch, capsys
):
    cache_file = tmp_path / "session"
    lines = ["/stats", "", "/foo", "/stats", TURNS[0], "/reset", "  ", "/stats"]
    status, out, err = run_chat(
        checkpoint_dirs["qwen3_5"],
        lines,
        "--prompt-cache-file",
        str(cache_file),
        monkeypatch=monkeypatch,
        capsys=capsys,
    )
    assert status == 0, err
    assert out.count("last turn: no reply yet") == 2  # /foo was not a turn
    assert "unknown command /foo. Commands: /reset" in out
    last = out.split("last turn: ")[-1]  # after /reset: the reply, no context
    assert not last.startswith("no reply yet") and ", 0 tokens of context" in last
    assert cache_file.is_file()


def test_prompt_cache_file_is_exactly_the_path_given(
    checkpoint_dirs, tmp_path, monkeypatch, capsys
):
    model_dir = checkpoint_dirs["qwen3_next"]
    cache_file = tmp_path / "mysession"
    args = ("--prompt-cache-file", str(cache_file))
    kw = dict(monkeypatch=monkeypatch, capsys=capsys)

    def context(out):
        return int(out.split(" tokens of context")[0].split()[-1])

    status, first, err = run_chat(model_dir, [TURNS[0], "/stats"], *args, **kw)
    assert status == 0, err
    assert os.listdir(tmp_path) == ["mysession"]
    status, second, err = run_chat(model_dir, ["/stats"], *args, **kw)
    assert status == 0, err
    assert context(second) == context(first) > 0  # the first run's conversation
    # Still mlx-lm's prompt-cache format: its loader reads a *.safetensors copy.
    copy = shutil.copy(cache_file, tmp_path / "copy.safetensors")
    caches, meta = load_prompt_cache(str(copy), return_metadata=True)
    assert len(caches) == int(meta["n_target"]) + 3  # history, drafter, deferred


@pytest.mark.parametrize("where", ["missing_dir", "directory", "read_only_dir"])
def test_unwritable_prompt_cache_file_is_refused_before_loading(
    where, checkpoint_dirs, tmp_path, monkeypatch, capsys
):
    if where == "read_only_dir":
        if os.geteuid() == 0:
            pytest.skip("root writes into read-only directories")
        (tmp_path / "ro").mkdir(mode=0o555)
    path = {
        "missing_dir": tmp_path / "nowhere" / "s",
        "directory": tmp_path,
        "read_only_dir": tmp_path / "ro" / "s",
    }[where]
    status, out, err = chat_with_session(
        checkpoint_dirs, path, TURNS[0], monkeypatch, capsys
    )
    assert status == 2 and "[mlx_spec chat]" not in out  # nothing was loaded
    assert err.startswith("mlx_spec chat: ") and str(path) in err
    assert len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("damage", ["truncated", "garbage", "model_weights"])
def test_unreadable_prompt_cache_file_is_one_line(
    damage, checkpoint_dirs, models, tmp_path, monkeypatch, capsys
):
    model, tok = models["qwen3_5"]
    path = tmp_path / "s.safetensors"
    if damage == "model_weights":
        shutil.copy(checkpoint_dirs["qwen3_5"] / "model.safetensors", path)
    else:
        chat = ChatSession(model, tok, setup_parser().parse_args([]))
        list(chat.reply(TURNS[0]))
        save_session(path, chat.session)
        data = path.read_bytes()
        path.write_bytes(
            data[: len(data) // 2] if damage == "truncated" else data[::-1]
        )
    before = path.read_bytes()
    status, _, err = chat_with_session(
        checkpoint_dirs, path, TURNS[1], monkeypatch, capsys
    )
    assert status == 2
    assert err.startswith(f"mlx_spec chat: {str(path)!r} is not a readable")
    assert len(err.strip().splitlines()) == 1
    assert path.read_bytes() == before  # not overwritten


def read_until(proc, done, timeout=120.0):
    """Read ``proc``'s stdout until ``done(text so far)``, at most ``timeout`` s."""
    fd, out = proc.stdout.fileno(), b""
    deadline = time.monotonic() + timeout
    while not done(out.decode(errors="replace")):
        left = deadline - time.monotonic()
        assert left > 0, f"timed out; stdout so far: {out[-400:]!r}"
        if select.select([fd], [], [], left)[0]:
            chunk = os.read(fd, 4096)
            assert chunk, f"chat exited; stdout: {out[-400:]!r}"
            out += chunk
    return out.decode(errors="replace")


@pytest.mark.slow
def test_ctrl_c_returns_to_the_prompt_and_ctrl_d_exits(checkpoint_dirs):
    proc = subprocess.Popen(
        chat_cmd(checkpoint_dirs["qwen3_next"], "--max-tokens", "100000"),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        read_until(proc, lambda out: "[mlx_spec chat]" in out and ">> " in out)
        proc.stdin.write(f"{TURNS[0]}\n".encode())
        proc.stdin.flush()
        read_until(proc, bool)  # the reply is streaming
        proc.send_signal(signal.SIGINT)
        read_until(proc, lambda out: "[interrupted]" in out)
        out, err = proc.communicate(b"/stats\n", timeout=120)  # then EOF
        assert proc.returncode == 0, err.decode()
        assert "last turn:" in out.decode()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_session_file_of_an_earlier_version_is_refused_by_name(models, tmp_path):
    """Files of the first layout named their model by its config and a few
    weight rows, which a fine-tune shares with its base: they are refused
    with a message saying why, and the decoder is left as it was."""
    from mlx_spec.states.session_file import EARLIER_FORMATS, load_session
    from mlx_spec.states.snapshot import capture
    from mlx_spec.mlx_lm_compat import ArraysCache, save_prompt_cache
    from mlx_spec.states.file import plain_state

    model, tok = models["qwen3_5"]
    args = setup_parser().parse_args([])
    chat = ChatSession(model, tok, args)
    list(chat.reply(TURNS[0]))
    state = plain_state(capture(chat.decoder))
    session, extra = ArraysCache(2), ArraysCache(len(state.drafter_arrays) or 1)
    session.cache = [mx.array(state.history, mx.uint32), state.last_hidden]
    extra.cache = state.drafter_arrays or [None]
    path = tmp_path / "old.safetensors"
    meta = {
        "format": EARLIER_FORMATS[0],
        "model": "0123456789abcdef",
        "model_name": "",
        "drafter": state.drafter,
        "n_target": str(len(state.caches)),
    }
    save_prompt_cache(str(path), state.caches + [session, extra], meta)
    again = ChatSession(model, tok, args)
    with pytest.raises(ValueError, match="earlier mlx_spec") as refused:
        load_session(path, again.session)
    assert str(path) in str(refused.value)
    assert again.decoder.history == []
