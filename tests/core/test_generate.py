"""The mlx-lm compatible API and CLI: responses, statistics, bad input."""

import subprocess
import sys

import mlx.core as mx
import pytest
from mlx_lm.generate import GenerationResponse
from mlx_lm.models import llama, qwen3

import mlx_spec
from mlx_spec.testing.reference import (
    OracleDrafter,
    prompts,
    reference_tokens,
    spec_tokens,
)


def test_responses_match_mlx_lm_text_and_fields(models, family):
    from mlx_lm.generate import stream_generate as mlx_stream

    model, tok = models[family]
    prompt = "def add(a, b):\n    return a + b\n\ndef add("
    ref = list(mlx_stream(model, tok, prompt, max_tokens=20))
    out = list(mlx_spec.stream_generate(model, tok, prompt, max_tokens=20))
    assert all(isinstance(r, GenerationResponse) for r in out)
    assert [r.token for r in out] == [r.token for r in ref]
    assert "".join(r.text for r in out) == "".join(r.text for r in ref)
    assert out[-1].finish_reason == ref[-1].finish_reason
    assert [r.generation_tokens for r in out] == [r.generation_tokens for r in ref]
    stats = out[-1].stats
    assert stats.verify_passes >= 1 and stats.generated >= len(out) - 1


def test_generate_returns_text_and_prints_stats(models, capsys):
    model, tok = models["qwen3_5"]
    text = mlx_spec.generate(
        model, tok, "x = 1\nx = 1\nx =", max_tokens=12, verbose=True
    )
    printed = capsys.readouterr().out
    assert text and text in printed
    assert "verify passes" in printed and "Acceptance per draft position" in printed


def test_prompt_forms_agree(models):
    model, tok = models["qwen3_next"]
    ids = tok.encode("for i in range(10):")
    by_list = spec_tokens(model, tok, ids, 10)
    by_str = [
        r.token for r in mlx_spec.stream_generate(model, tok, "for i in range(10):", 10)
    ]
    assert by_list == by_str == reference_tokens(model, tok, ids, 10)


def test_stats_per_position(models):
    model, tok = models["qwen3_next"]
    prompt = prompts("mixed")
    ref = reference_tokens(model, tok, prompt, 30)
    stats = mlx_spec.SpecStats()
    drafter = OracleDrafter(prompt + ref, error=0.25, seed=1)
    spec_tokens(model, tok, prompt, 30, draft=drafter, num_draft_tokens=3, stats=stats)
    assert len(stats.drafted_at) == 3
    assert stats.drafted_at[0] >= stats.drafted_at[1] >= stats.drafted_at[2]
    assert sum(stats.accepted_at) == stats.accepted
    rates = stats.acceptance_per_position
    assert all(0 <= r <= 1 for r in rates) and rates[0] > 0
    assert stats.tokens_per_pass == pytest.approx(30 / stats.verify_passes)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(prompt=[]), "prompt must be a non-empty"),
        (dict(prompt=""), "prompt must be a non-empty"),
        (dict(max_tokens=0), "max_tokens must be a positive integer, got 0"),
        (dict(max_tokens=-3), "got -3"),
        (
            dict(num_draft_tokens=17),
            "num_draft_tokens must be .auto. or an integer in 0..16, got 17",
        ),
        (dict(num_draft_tokens=-1), "got -1"),
        (dict(draft="eagle"), "unknown draft 'eagle'"),
        (dict(max_ngram=1), "max_ngram must be an integer >= 2, got 1"),
        (dict(max_kv_size=64), "max_kv_size is not supported"),
    ],
)
def test_bad_input_is_clear_and_leaves_model_usable(models, kwargs, match):
    model, tok = models["qwen3_5_moe"]
    args = dict(prompt=prompts("mixed"), max_tokens=8)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        list(mlx_spec.stream_generate(model, tok, **args))
    p = prompts("mixed")
    assert spec_tokens(model, tok, p, 8) == reference_tokens(model, tok, p, 8)


def _tiny(module, **extra):
    args = module.ModelArgs(
        model_type=module.__name__.split(".")[-1],
        hidden_size=64,
        num_hidden_layers=2,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-6,
        vocab_size=400,
        **extra,
    )
    mx.random.seed(1)
    model = module.Model(args)
    model.eval()
    mx.eval(model.parameters())
    return model


@pytest.mark.parametrize(
    "module, extra",
    [
        (llama, {}),
        (
            qwen3,
            dict(
                head_dim=16,
                rope_theta=1e4,
                tie_word_embeddings=True,
                max_position_embeddings=4096,
            ),
        ),
    ],
)
def test_attention_only_models_are_lossless(models, module, extra):
    """Models whose caches all trim (llama, qwen3) need no GDN machinery."""
    model = _tiny(module, **extra)
    tok = models["qwen3_next"][1]
    prompt = prompts("mixed")
    ref = reference_tokens(model, tok, prompt, 24)
    drafter = OracleDrafter(prompt + ref, error=0.3)
    assert spec_tokens(model, tok, prompt, 24, draft=drafter, num_draft_tokens=4) == ref
    assert spec_tokens(model, tok, prompt, 24, num_draft_tokens=4) == ref


@pytest.mark.slow
def test_cli_generate(checkpoint_dirs):
    cmd = [
        sys.executable,
        "-m",
        "mlx_spec",
        "generate",
        "--model",
        str(checkpoint_dirs["qwen3_next"]),
    ]
    out = subprocess.run(
        cmd
        + [
            "--prompt",
            "a = 1\na = 1\na =",
            "--max-tokens",
            "16",
            "--num-draft-tokens",
            "4",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "Generation: 16 tokens" in out.stdout
    assert "verify passes" in out.stdout
    bad = subprocess.run(
        cmd + ["--num-draft-tokens", "40"], capture_output=True, text=True, timeout=120
    )
    assert bad.returncode == 2 and "got 40" in bad.stderr


@pytest.mark.slow
def test_cli_penalty_flags_match_mlx_lm(checkpoint_dirs, models, family, capsys):
    """``--repetition-penalty`` and ``--frequency-penalty`` reach every pass:
    the text is mlx-lm's under the same processors, and not the unpenalised one."""
    from mlx_lm.generate import generate as mlx_generate
    from mlx_lm.sample_utils import make_logits_processors

    from mlx_spec.commands.generate import main

    model, tok = models[family]
    text = "a = 1\na = 1\na = 1\nb = 2\nb = 2\na ="
    penalties = dict(
        repetition_penalty=3.0,
        repetition_context_size=8,
        frequency_penalty=2.0,
        frequency_context_size=16,
    )
    flags = [f"--{name.replace('_', '-')}={value}" for name, value in penalties.items()]
    status = main(
        ["--model", str(checkpoint_dirs[family]), "--prompt", text]
        + ["--max-tokens", "24", "--num-draft-tokens", "3", "--verbose", "False"]
        + flags
    )
    assert status == 0
    got = capsys.readouterr().out

    def reference(**kw):
        return mlx_generate(model, tok, mx.array(tok.encode(text)), max_tokens=24, **kw)

    want = reference(logits_processors=make_logits_processors(**penalties))
    assert got == want + "\n"
    assert want != reference()
