"""The Python API keeps mlx-lm's contract: reused prompt caches, bad ids, plain decoding."""

import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache

import mlx_spec
from mlx_spec.testing.reference import (
    OracleDrafter,
    cache_arrays,
    cache_offsets,
    prompts,
    reference_tokens,
    spec_tokens,
)

DRAFTS = ["ngram", "mtp", "mtp+ngram"]


@pytest.mark.parametrize("draft", DRAFTS + ["none"])
@pytest.mark.slow
def test_reused_prompt_cache_matches_mlx_lm(models, plain_models, family, draft):
    """Three calls on one cache (the last stopped early by the caller): every
    call's tokens and the cache after it equal mlx-lm's with its own cache."""
    model, tok = models[family]
    plain, plain_tok = plain_models[family]
    ours, theirs = make_prompt_cache(model), make_prompt_cache(plain)
    calls = [(prompts("repetitive"), 20, None), ([5, 6, 7], 17, None), ([9], 30, 11)]
    for prompt, max_tokens, stop_after in calls:
        want = reference_tokens(
            plain, plain_tok, prompt, max_tokens, stop_after, prompt_cache=theirs
        )
        got = spec_tokens(
            model,
            tok,
            prompt,
            max_tokens,
            stop_after,
            prompt_cache=ours,
            draft=draft,
            num_draft_tokens=3,
        )
        assert got == want
        assert cache_offsets(ours) == cache_offsets(theirs)
        for a, b in zip(cache_arrays(ours), cache_arrays(theirs), strict=True):
            assert mx.array_equal(a, b)


def test_caller_stopping_mid_pass_keeps_only_what_it_saw(models, plain_models, family):
    """A caller that stops inside a pass of accepted drafts: the cache holds
    exactly the tokens it received, as mlx-lm's does."""
    model, tok = models[family]
    plain, plain_tok = plain_models[family]
    prompt = prompts("mixed")
    ref = reference_tokens(plain, plain_tok, prompt, 40)
    for stop_after in (1, 5, 6, 13):
        ours, theirs = make_prompt_cache(model), make_prompt_cache(plain)
        reference_tokens(plain, plain_tok, prompt, 40, stop_after, prompt_cache=theirs)
        got = spec_tokens(
            model,
            tok,
            prompt,
            40,
            stop_after,
            prompt_cache=ours,
            draft=OracleDrafter(prompt + ref),
            num_draft_tokens=6,
        )
        assert got == ref[:stop_after]
        assert (
            cache_offsets(ours)
            == cache_offsets(theirs)
            == [len(prompt) + stop_after] * len(cache_offsets(ours))
        )
        for a, b in zip(cache_arrays(ours), cache_arrays(theirs), strict=True):
            assert mx.array_equal(a, b)


@pytest.mark.parametrize("draft", DRAFTS + ["none"])
def test_bad_token_ids_are_refused_before_any_state_changes(
    models, plain_models, draft
):
    model, tok = models["qwen3_next"]
    vocab = model.model.embed_tokens.weight.shape[0]
    prompt = prompts("random")
    cache = make_prompt_cache(model)
    bad = {
        -1: prompt + [-1],
        vocab: prompt + [vocab],
        "1.5": [1.5, 2.7],
        "float32": mx.array([1.0, 2.0]),
        "True": [True, 3],
    }
    for name, ids in bad.items():
        with pytest.raises(ValueError, match=f"{name}|integers"):
            list(
                mlx_spec.stream_generate(
                    model, tok, ids, 5, draft=draft, prompt_cache=cache
                )
            )
        if isinstance(name, int):
            with pytest.raises(ValueError, match=f"vocabulary of {vocab}"):
                list(mlx_spec.stream_generate(model, tok, ids, 5, draft=draft))
    assert cache_offsets(cache) == [0] * len(cache_offsets(cache))  # untouched
    plain, plain_tok = plain_models["qwen3_next"]
    want = reference_tokens(plain, plain_tok, prompt, 12)
    got = [
        r.token for r in mlx_spec.stream_generate(model, tok, prompt, 12, draft=draft)
    ]
    assert got == want


@pytest.mark.parametrize("options", [{"draft": "none"}, {"num_draft_tokens": 0}])
def test_plain_decoding_takes_the_speculative_options(models, plain_models, options):
    """draft='none' / num_draft_tokens=0 run mlx-lm's loop and accept (and
    check) the options of the speculative path."""
    model, tok = models["qwen3_5"]
    plain, plain_tok = plain_models["qwen3_5"]
    prompt = prompts("mixed")
    want = reference_tokens(plain, plain_tok, prompt, 16)
    got = [
        r.token
        for r in mlx_spec.stream_generate(
            model, tok, prompt, 16, rollback="store", **options
        )
    ]
    assert got == want
    with pytest.raises(ValueError, match="'undo'"):
        list(
            mlx_spec.stream_generate(model, tok, prompt, 16, rollback="undo", **options)
        )


def test_generate_command_with_plain_decoding(checkpoint_dirs, capsys):
    from mlx_spec.commands import generate as generate_cli

    path = str(checkpoint_dirs["qwen3_next"])
    for flags in (["--draft", "none"], ["--num-draft-tokens", "0"]):
        rc = generate_cli.main(
            ["--model", path, "--prompt", "hello", "--max-tokens", "5", *flags]
        )
        assert rc == 0
    assert capsys.readouterr().out.strip()
