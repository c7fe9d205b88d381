"""Careless input to the commands and the Python API: one line naming the bad
value (exit status 2) or a clear TypeError / ValueError, never a traceback;
and what mlx-lm accepts is accepted."""

import io

import numpy as np
import pytest

import mlx_spec
from mlx_spec.commands.cli import main
from mlx_spec.demo import default_model_path
from mlx_spec.testing.reference import reference_tokens

BAD_FLAGS = {  # flags -> what the error line names
    ("--seed", "-1"): "--seed must be in 0..2**64-1, got -1",
    ("--seed", str(2**64)): f"got {2**64}",
    ("--prefill-step-size", "0"): "--prefill-step-size must be >= 1, got 0",
    ("--temp", "nan"): "--temp must be >= 0, got nan",
    ("--temp", "inf"): "--temp must be >= 0, got inf",
    ("--top-p", "5"): "--top-p must be in 0..1, got 5.0",
    ("--top-k", "-3"): "--top-k must be >= 0 (0: off), got -3",
    ("--xtc-probability", "2"): "--xtc-probability must be in 0..1, got 2.0",
    ("--adapter-path", "/missing/adapter"): "--adapter-path '/missing/adapter'",
}
GENERATE_ONLY = {
    ("--extra-eos-token", "zzzz"): "--extra-eos-token 'zzzz' is neither a token",
    ("--extra-eos-token", "99999"): "--extra-eos-token '99999'",
    ("--prompt-cache-file", "/missing.safetensors"): "--prompt-cache-file is not",
    ("--use-default-chat-template",): "--use-default-chat-template is not",
    ("--chat-template-config", "{"): "--chat-template-config is not JSON",
    ("--chat-template-config", "[1]"): "--chat-template-config must be a JSON object",
    ("--min-p", "-1"): "--min-p must be in 0..1, got -1.0",
}


def run(argv, monkeypatch, capsys, stdin=None):
    """``mlx_spec ARGV`` in this process: (status, stdout, stderr). ``stdin``:
    its bytes (read through a UTF-8 text layer, as a terminal's are)."""
    stream = io.TextIOWrapper(io.BytesIO(stdin or b""), encoding="utf-8")
    monkeypatch.setattr("sys.stdin", stream)
    status = main(argv)
    out, err = capsys.readouterr()
    return status, out, err


def assert_one_line(err, command, named):
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(f"mlx_spec {command}: ") and named in lines[0], err


@pytest.mark.parametrize("flags", list(BAD_FLAGS) + list(GENERATE_ONLY))
@pytest.mark.parametrize("command", ["generate", "chat"])
def test_a_bad_flag_is_one_line_naming_it(
    command, flags, checkpoint_dirs, monkeypatch, capsys
):
    if command == "chat" and flags in GENERATE_ONLY:
        pytest.skip("a flag of generate only")
    named = {**BAD_FLAGS, **GENERATE_ONLY}[flags]
    model = ["--model", str(checkpoint_dirs["qwen3_next"])]
    status, _, err = run(
        [command, *model, *flags, "--max-tokens", "2"], monkeypatch, capsys
    )
    assert status == 2
    assert_one_line(err, command, named)


def test_a_prompt_on_stdin_that_is_not_utf8_is_named(
    checkpoint_dirs, monkeypatch, capsys
):
    model = ["--model", str(checkpoint_dirs["qwen3_next"])]
    argv = ["generate", *model, "--prompt", "-", "--max-tokens", "2"]
    status, _, err = run(argv, monkeypatch, capsys, stdin=b"def f():\n\xff\xfe x")
    assert status == 2
    assert_one_line(err, "generate", "not valid UTF-8 text (byte 0xff at offset 9)")


def test_flags_mlx_lm_shows_are_honoured(checkpoint_dirs, monkeypatch, capsys):
    """--extra-eos-token (a token of the vocabulary) stops the reply there,
    as mlx-lm's generate does, and --trust-remote-code loads the model."""
    path = checkpoint_dirs["qwen3_next"]
    model, tok = mlx_spec.load(path)
    prompt = "def f(x):\n    return"
    full = reference_tokens(model, tok, tok.encode(prompt), 12)
    stop = next(t for t in full[2:] if not tok.convert_ids_to_tokens(t).isdecimal())
    argv = ["generate", "--model", str(path), "--prompt", prompt, "--draft", "ngram"]
    argv += ["--max-tokens", "12", "--trust-remote-code"]
    status, whole, err = run(argv, monkeypatch, capsys)
    assert status == 0, err
    eos = ["--extra-eos-token", tok.convert_ids_to_tokens(stop)]
    status, cut, err = run(argv + eos, monkeypatch, capsys)
    assert status == 0, err
    assert "Generation: 12 tokens" in whole  # verbose, as mlx-lm's default
    assert f"Generation: {full.index(stop) + 1} tokens" in cut  # the EOS counts


def test_chat_skips_a_line_that_is_not_utf8_and_saves_the_session(
    checkpoint_dirs, monkeypatch, capsys, tmp_path
):
    """The bad line is reported on one line, the next one is answered, and
    the session file is written at the end; a top-k past the vocabulary
    keeps every token rather than failing."""
    session = tmp_path / "chat.safetensors"
    argv = ["chat", "--model", str(checkpoint_dirs["qwen3_next"]), "--max-tokens", "4"]
    argv += ["--prompt-cache-file", str(session), "--temp", "0.7", "--top-k", "5000"]
    stdin = b"\xc3\x28 broken\nprint(1)\n"
    status, out, err = run(argv, monkeypatch, capsys, stdin=stdin)
    assert status == 0, err
    assert err.strip() == (
        "mlx_spec chat: that line is not valid UTF-8 text; it was skipped (byte 0xc3)"
    )
    assert out.count(">> ") == 3  # the bad line, the answered one, then Ctrl-D
    assert session.is_file()


def test_bench_checks_its_json_path_before_the_run(monkeypatch, capsys, tmp_path):
    def no_run(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr("mlx_spec.commands.bench.load_model", no_run)
    missing = tmp_path / "missing" / "x.json"
    status, _, err = run(["bench", "--json", str(missing)], monkeypatch, capsys)
    assert status == 2
    assert_one_line(err, "bench", f"--json '{missing}' cannot be written")
    status, _, err = run(["bench", "--json", str(tmp_path)], monkeypatch, capsys)
    assert status == 2
    assert_one_line(err, "bench", "is a directory")


@pytest.fixture(scope="module")
def demo():
    return mlx_spec.load(default_model_path())


@pytest.mark.parametrize(
    "prompt",
    [
        np.array([5, 6, 7, 8]),
        np.array([5, 6, 7, 8], dtype=np.int32),
        [np.int64(5), np.int64(6), np.int64(7), np.int64(8)],
        (5, 6, 7, 8),
    ],
    ids=["numpy_int64", "numpy_int32", "list_of_numpy_ints", "tuple"],
)
def test_the_api_takes_token_ids_as_mlx_lm_does(demo, prompt):
    model, tok = demo
    want = mlx_spec.generate(model, tok, [5, 6, 7, 8], max_tokens=6, draft="ngram")
    assert mlx_spec.generate(model, tok, prompt, max_tokens=6, draft="ngram") == want


@pytest.mark.parametrize(
    "prompt, error, named",
    [
        (None, TypeError, "got NoneType"),
        (5, TypeError, "got int"),
        (b"abc", TypeError, "got bytes"),
        ([1, "a"], ValueError, "got 'a'"),
        (np.array([[1, 2]]), ValueError, "shape (1, 2)"),
        (np.array([1.5]), ValueError, "float32"),
        (np.array([], dtype=np.int64), ValueError, "shape (0,)"),
        (np.array([1, 10**6]), ValueError, "token id 1000000"),
    ],
)
@pytest.mark.parametrize("api", ["generate", "stream_generate"])
def test_the_api_refuses_other_prompts_by_name(demo, api, prompt, error, named):
    model, tok = demo
    with pytest.raises(error, match=None) as caught:
        out = getattr(mlx_spec, api)(model, tok, prompt, max_tokens=2, draft="ngram")
        list(out) if api == "stream_generate" else out
    assert named in str(caught.value)


def test_the_api_refuses_a_prefill_step_size_below_one(demo):
    model, tok = demo
    for draft in ("none", "ngram"):
        with pytest.raises(ValueError, match="prefill_step_size must be"):
            mlx_spec.generate(
                model, tok, [5, 6], max_tokens=2, draft=draft, prefill_step_size=0
            )
