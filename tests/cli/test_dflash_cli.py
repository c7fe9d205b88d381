"""``mlx_spec generate --draft-model``: a DFlash drafter from a directory,
the same text as plain decoding, and each wrong use refused on one line."""

import io
import re

import pytest

from mlx_spec.commands.cli import main
from mlx_spec.testing.dflash_drafters import write_dflash_checkpoint

FAMILY = "qwen3_5"
FLAGS = ["--max-tokens", "12", "--temp", "0", "--prompt", "def main():"]


@pytest.fixture(scope="module")
def drafter_dir(tmp_path_factory):
    return write_dflash_checkpoint(tmp_path_factory.mktemp("cli_dflash"), FAMILY)


def generate(model_dir, extra, monkeypatch, capsys):
    """``mlx_spec generate`` in this process: (status, stdout, stderr)."""
    status = main(["generate", "--model", str(model_dir)] + FLAGS + extra)
    out, err = capsys.readouterr()
    return status, out, err


def text_of(out: str) -> str:
    """The generated text between the verbose report's two rules."""
    return out.split("=" * 10)[1]


def assert_one_line(err, command, named):
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(f"mlx_spec {command}: ") and named in lines[0], err


def test_generate_with_a_drafter_prints_the_plain_text(
    checkpoint_dirs, drafter_dir, monkeypatch, capsys
):
    model_dir = checkpoint_dirs[FAMILY]
    status, plain, err = generate(model_dir, ["--draft", "none"], monkeypatch, capsys)
    assert status == 0, err
    plain = text_of(plain)
    assert plain.strip()
    for extra in (
        ["--draft-model", str(drafter_dir), "--num-draft-tokens", "3"],
        ["--draft", "dflash", "--draft-model", str(drafter_dir)],
        ["--draft-model", str(drafter_dir), "--draft-quantize", "8"],
    ):
        status, out, err = generate(model_dir, extra, monkeypatch, capsys)
        assert status == 0, err
        assert text_of(out) == plain, extra
        assert "Speculation:" in out  # it drafted


@pytest.mark.parametrize(
    "extra, named",
    [
        (["--draft", "dflash"], "--draft dflash needs --draft-model PATH_OR_REPO"),
        (["--draft", "ngram", "--draft-model", "x"], "not --draft ngram"),
        (["--draft-model", "/missing/drafter"], "/missing/drafter"),
        (["--draft-model", "DRAFTER", "--num-draft-tokens", "4"], "1..3 tokens"),
    ],
)
def test_a_wrong_use_is_one_line(
    checkpoint_dirs, drafter_dir, extra, named, monkeypatch, capsys
):
    extra = [str(drafter_dir) if a == "DRAFTER" else a for a in extra]
    status, _, err = generate(checkpoint_dirs[FAMILY], extra, monkeypatch, capsys)
    assert status == 2
    assert_one_line(err, "generate", named)


def test_a_drafter_that_does_not_fit_is_named(
    checkpoint_dirs, tmp_path, monkeypatch, capsys
):
    bad = write_dflash_checkpoint(tmp_path, FAMILY, mask_token_id=None)
    extra = ["--draft-model", str(bad)]
    status, _, err = generate(checkpoint_dirs[FAMILY], extra, monkeypatch, capsys)
    assert status == 2
    assert_one_line(err, "generate", "mask_token_id is missing")


def test_chat_with_a_drafter_replies_as_without(
    checkpoint_dirs, drafter_dir, monkeypatch, capsys
):
    from mlx_spec.commands.chat import main as chat_main

    lines = ["def main():", "and then?"]

    def replies(*extra):
        monkeypatch.setattr("sys.stdin", io.StringIO("".join(f"{x}\n" for x in lines)))
        argv = ["--model", str(checkpoint_dirs[FAMILY]), "--max-tokens", "8"]
        status = chat_main(argv + ["--temp", "0", *extra])
        out, err = capsys.readouterr()
        assert status == 0, err
        return [part.rstrip("\n") for part in out.split(">> ")[1:]]

    plain = replies("--draft", "none")
    assert len(plain) >= 2 and any(r.strip() for r in plain)
    assert replies("--draft-model", str(drafter_dir)) == plain


@pytest.mark.parametrize("prog", ["chat", "server"])
def test_chat_and_server_refuse_dflash_without_a_drafter(
    checkpoint_dirs, prog, monkeypatch, capsys
):
    argv = [prog, "--model", str(checkpoint_dirs[FAMILY]), "--draft", "dflash"]
    monkeypatch.setattr("sys.stdin", io.StringIO(""))
    assert main(argv) == 2
    assert_one_line(capsys.readouterr()[1], prog, "--draft dflash needs --draft-model")


def test_bench_runs_dflash_beside_ngram_and_refuses_a_wrong_use(
    checkpoint_dirs, drafter_dir, tmp_path, capsys
):
    import json

    import mlx_spec.commands.bench as bench

    workloads = tmp_path / "w.jsonl"
    row = {"name": "rep", "kind": "copy", "prompt": "a = 1\n" * 6, "max_tokens": 10}
    workloads.write_text(json.dumps(row) + "\n")
    argv = ["--model", str(checkpoint_dirs[FAMILY]), "--workloads-file", str(workloads)]
    argv += ["--repeats", "1", "--num-draft-tokens", "3", "--json", str(tmp_path / "b")]
    rc = bench.main(
        argv + ["--draft", "dflash", "ngram", "--draft-model", str(drafter_dir)]
    )
    out, err = capsys.readouterr()
    assert rc == 0, err
    results = json.loads((tmp_path / "b").read_text())["results"]
    assert [r["draft"] for r in results] == ["dflash", "ngram"]
    assert all(r["first_token_differing_from_plain"] is None for r in results)
    assert bench.main(argv + ["--draft", "dflash"]) == 2
    assert_one_line(
        capsys.readouterr()[1], "bench", "--draft dflash needs --draft-model"
    )
    rc = bench.main(argv + ["--draft", "ngram", "--draft-model", str(drafter_dir)])
    assert rc == 2
    assert_one_line(capsys.readouterr()[1], "bench", "read by --draft dflash")


# Stdlib-like code, the demo model's training distribution (\n as the flag gives it).
DEMO_PROMPT = (
    "import os\\nimport sys\\n\\n\\nclass Config:\\n"
    "    def __init__(self, name, default=None):\\n        "
)


def test_the_demo_model_drafts_with_its_bundled_drafter(capsys):
    """No --model, no --draft-model: the demo model's own drafter; the text
    is --draft none's and some drafts are accepted."""
    flags = ["--max-tokens", "48", "--temp", "0", "--prompt", DEMO_PROMPT]
    assert main(["generate", *flags, "--draft", "none"]) == 0
    plain = text_of(capsys.readouterr()[0])
    argv = ["generate", *flags, "--draft", "dflash", "--num-draft-tokens", "15"]
    status = main(argv)
    out, err = capsys.readouterr()
    assert status == 0, err
    assert text_of(out) == plain
    accepted = re.search(r"(\d+)/(\d+) drafted tokens accepted", out)
    assert accepted is not None, out
    assert int(accepted.group(1)) > 0


def test_chat_on_the_demo_model_uses_its_drafter(monkeypatch, capsys):
    from mlx_spec.commands.chat import main as chat_main

    def replies(*extra):
        monkeypatch.setattr("sys.stdin", io.StringIO("class Config:\n"))
        status = chat_main(["--max-tokens", "16", "--temp", "0", *extra])
        out, err = capsys.readouterr()
        assert status == 0, err
        return [part.rstrip("\n") for part in out.split(">> ")[1:]]

    plain = replies("--draft", "none")
    assert any(r.strip() for r in plain)
    assert replies("--draft", "dflash") == plain
