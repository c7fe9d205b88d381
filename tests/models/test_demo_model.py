"""The shipped demo model (mlx_spec/data/demo): loads like a raw Qwen3-Next release, decodes losslessly."""

import json
import shlex
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.generate import stream_generate as mlx_stream_generate

import mlx_spec
from mlx_spec.demo import default_model_path

PROMPTS = [
    "import os\nimport sys\n\n\ndef main(argv):\n    ",
    'class Stack:\n    """A simple stack."""\n\n    def __init__(self):\n        ',
]
MAX_TOKENS = 40


@pytest.fixture(scope="module")
def demo():
    return mlx_spec.load(default_model_path())


def test_default_model_is_the_shipped_checkpoint():
    path = default_model_path()
    assert path.name == "demo" and path.parent.name == "data"
    config = json.loads((path / "config.json").read_text())
    assert config["model_type"] == "qwen3_next"
    assert config["num_experts"] > 0 and config["full_attention_interval"] == 4
    total = sum(p.stat().st_size for p in path.iterdir() if p.is_file())
    assert total <= 64 * 1024 * 1024
    names = set(mx.load(str(path / "model.safetensors")))
    assert "model.layers.0.mlp.experts.0.gate_proj.weight" in names
    assert (
        "mtp.fc.weight" in names
        and "mtp.layers.0.mlp.experts.0.up_proj.weight" in names
    )
    assert (path / "README.md").is_file() and (path / "training.json").is_file()


def test_loads_with_mtp_head(demo):
    model, tok = demo
    assert model.mtp_head is not None
    eos = json.loads((default_model_path() / "config.json").read_text())["eos_token_id"]
    assert eos in tok.eos_token_ids
    text = "def f(x):\n    return {'a': x}  # ok\n"
    assert tok.decode(tok.encode(text)) == text


def _reference(model, tok, prompt):
    ids = mx.array(tok.encode(prompt))
    return [
        r.token for r in mlx_stream_generate(model, tok, ids, max_tokens=MAX_TOKENS)
    ]


@pytest.mark.parametrize("prompt", PROMPTS)
@pytest.mark.slow
def test_lossless_greedy(demo, prompt):
    model, tok = demo
    want = _reference(model, tok, prompt)
    for draft, k in (("mtp", 3), ("ngram", 4), ("mtp+ngram", 2)):
        stats = mlx_spec.SpecStats()
        got = [
            r.token
            for r in mlx_spec.stream_generate(
                model,
                tok,
                prompt,
                max_tokens=MAX_TOKENS,
                draft=draft,
                num_draft_tokens=k,
                stats=stats,
            )
        ]
        assert got == want, (draft, k)


def test_mtp_drafts_are_accepted_on_code(demo):
    model, tok = demo
    stats = mlx_spec.SpecStats()
    text = "".join(
        r.text
        for r in mlx_spec.stream_generate(
            model,
            tok,
            PROMPTS[0],
            max_tokens=MAX_TOKENS,
            draft="mtp",
            num_draft_tokens=2,
            stats=stats,
        )
    )
    assert text.strip()
    assert stats.accepted > 0
    assert stats.tokens_per_pass > 1.0


def _first_command() -> list:
    """The arguments of the README's first ``mlx_spec generate`` command."""
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    line = next(x for x in readme.splitlines() if x.startswith("mlx_spec generate "))
    return shlex.split(line.split("mlx_spec generate ", 1)[1])


@pytest.mark.slow
def test_readme_first_command_is_lossless_and_does_not_loop(demo, capsys):
    """The README's first command prints what mlx-lm prints under the same
    penalty, and its text does not repeat itself: at most 5% of its 16-token
    windows were seen before in it, where plain greedy decoding's repeat
    (``scripts/train_demo/evaluate.py`` counts a text past 30% as a loop)."""
    from mlx_lm.generate import generate as mlx_generate
    from mlx_lm.sample_utils import make_logits_processors

    from mlx_spec.commands.generate import main, setup_parser

    args = _first_command()
    flags = setup_parser().parse_args(args)
    assert main(args + ["--verbose", "False"]) == 0
    text = capsys.readouterr().out[:-1]  # print's newline
    model, tok = demo
    processors = make_logits_processors(
        repetition_penalty=flags.repetition_penalty,
        repetition_context_size=flags.repetition_context_size,
    )
    prompt = mx.array(tok.encode(flags.prompt))
    kw = dict(max_tokens=flags.max_tokens)
    assert text == mlx_generate(model, tok, prompt, logits_processors=processors, **kw)
    assert len(tok.encode(text)) >= 100 and _repeated(tok.encode(text)) <= 0.05
    # the control: plain greedy decoding of this model repeats itself here
    assert _repeated(tok.encode(mlx_generate(model, tok, prompt, **kw))) > 0.1


def _repeated(tokens) -> float:
    """The share of the 16-token windows of ``tokens`` seen earlier in it."""
    windows = [tuple(tokens[i : i + 16]) for i in range(len(tokens) - 15)]
    return sum(w in windows[:i] for i, w in enumerate(windows)) / len(windows)
