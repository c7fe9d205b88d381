"""KV-cache quantisation where it changes the text: speculative decoding
quantises the attention caches exactly where mlx-lm's plain decoding does.

At 8 bits mlx-lm's quantised output equals its unquantised output on the tiny
checkpoints, so a decoder that ignored ``kv_bits`` would pass there. At 2 bits
(group size 32) it differs on every family, and each test first asserts that
difference: a decoder that quantised late, early or not at all, or let a
verify pass run across the quantisation start (its later rows would attend to
keys plain decoding had already quantised), emits mlx-lm's unquantised text or
something else, not the quantised text.
"""

import pytest

import mlx_spec
from mlx_spec.testing.reference import (
    OracleDrafter,
    prompts,
    reference_tokens,
    spec_tokens,
)

BITS, GROUP, N_TOKENS = 2, 32, 30
PROMPT = prompts("mixed")  # 25 tokens: the prefill leaves 24 in the caches


def quantised(start):
    return dict(kv_bits=BITS, kv_group_size=GROUP, quantized_kv_start=start)


def quantised_reference(model, tok, start):
    """mlx-lm's quantised greedy tokens, after checking that they differ
    from its unquantised ones (else the test could not tell)."""
    want = reference_tokens(model, tok, PROMPT, N_TOKENS, **quantised(start))
    plain = reference_tokens(model, tok, PROMPT, N_TOKENS)
    assert want != plain, "quantisation does not change this text: pick lower bits"
    return want


# 10: quantised right after the prompt; 27, 31, 38: inside generation, where
# a pass of 1 + 5 tokens from the previous pass's end would run across it.
@pytest.mark.parametrize("start", [10, 27, 31, 38])
@pytest.mark.slow
def test_quantised_kv_is_lossless_where_it_bites(models, family, start):
    model, tok = models[family]
    want = quantised_reference(model, tok, start)
    for error, seed in ((0.0, 0), (0.3, 1)):
        stats = mlx_spec.SpecStats()
        drafter = OracleDrafter(PROMPT + want, error=error, seed=seed)
        out = spec_tokens(
            model,
            tok,
            PROMPT,
            N_TOKENS,
            draft=drafter,
            num_draft_tokens=5,
            stats=stats,
            **quantised(start),
        )
        assert out == want, (family, start, error)
        assert stats.accepted > 0  # passes of several tokens reached the start


@pytest.mark.parametrize("draft", ["ngram", "mtp"])
@pytest.mark.slow
def test_quantised_kv_with_built_in_drafters(models, family, draft):
    """The built-in drafters (drafts mostly rejected on random weights) under
    quantisation that starts mid-generation."""
    model, tok = models[family]
    want = quantised_reference(model, tok, 31)
    out = spec_tokens(
        model, tok, PROMPT, N_TOKENS, draft=draft, num_draft_tokens=4, **quantised(31)
    )
    assert out == want


def test_quantised_caches_are_where_plain_decoding_puts_them(models):
    """After the run, every attention cache is quantised with the requested
    bits and group size (the GDN layers' states are not KV caches)."""
    from mlx_spec.mlx_lm_compat import make_prompt_cache

    model, tok = models["qwen3_next"]
    want = quantised_reference(model, tok, 31)
    cache = make_prompt_cache(model)
    out = spec_tokens(
        model,
        tok,
        PROMPT,
        N_TOKENS,
        draft=OracleDrafter(PROMPT + want),
        num_draft_tokens=5,
        prompt_cache=cache,
        **quantised(31),
    )
    assert out == want
    attention = [c for c in cache if hasattr(c, "bits")]
    assert len(attention) == sum(
        hasattr(c, "to_quantized") or hasattr(c, "bits") for c in cache
    )
    assert {(c.bits, c.group_size) for c in attention} == {(BITS, GROUP)}
